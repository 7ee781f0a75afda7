#!/usr/bin/env python3
"""Wall time of whole `vgpumgr` processes on simulated hosts (issue: discovery speed).

Builds A40 hosts with 8 and 128 mdev parents (VFs), each offering the real A40 catalogue of 29 types
(more than the 24 of the target), then times `vgpumgr types --json` and `vgpumgr --help` as separate
processes, as a user would run them. Prints median, min and max over the runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VGPUMGR = [str(Path(sys.executable).with_name("vgpumgr"))]


def timed(argv: list[str], runs: int, env: dict[str, str]) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, check=True, env=env)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def show(label: str, ms: list[float], target: float | None = None) -> None:
    med = statistics.median(ms)
    verdict = "" if target is None else (f"  target <= {target:.0f} ms: " + ("met" if med <= target else "MISSED"))
    print(f"{label:<44} median {med:7.1f} ms  min {min(ms):7.1f}  max {max(ms):7.1f}  (n={len(ms)}){verdict}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        for gpus, vfs in ((1, 8), (4, 32)):
            root = Path(tmp) / f"a40x{gpus}x{vfs}"
            subprocess.run([*VGPUMGR, "sim", "create", str(root), "--profile", "a40-sriov", "--scale", str(gpus),
                            "--vfs", str(vfs)], check=True, stdout=subprocess.DEVNULL)
            out = subprocess.run([*VGPUMGR, "--sysfs-root", str(root), "types", "--json"], capture_output=True,
                                 check=True, env=env).stdout
            parents = gpus * vfs
            n = out.count(b'"parent"')
            timed([*VGPUMGR, "--sysfs-root", str(root), "types", "--json"], 2, env)  # warm the page cache
            ms = timed([*VGPUMGR, "--sysfs-root", str(root), "types", "--json"], args.runs, env)
            show(f"types --json, {parents} parents x {n // parents} types", ms, 120 if parents == 128 else None)
        show("vgpumgr --help", timed([*VGPUMGR, "--help"], args.runs, env), 150)
        show("python -c pass (interpreter floor)", timed([sys.executable, "-c", "pass"], args.runs, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
