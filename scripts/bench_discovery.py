#!/usr/bin/env python3
"""Wall time of whole `vgpumgr` processes on simulated hosts, and of Debian's `mdevctl types` on the same tree.

Builds A40 hosts with 8 and 128 mdev parents (VFs), each offering the real A40 catalogue of 29 types
(more than the 24 of the target), then times `vgpumgr types --json` and `vgpumgr --help` as separate
processes, as a user would run them. Prints median, min and max over the runs.

mdevctl (1.2.0) always reads /sys, so the comparison runs in a private mount namespace (`unshare -m`,
needs root) in which the simulated tree's `sys` is bind-mounted over /sys: there `mdevctl types --dumpjson`
and `vgpumgr types --json` alternate on the same 128 x 29 tree, and the ratio of the medians is printed
(target <= 0.8). The host's own /sys is never touched. Without root or unshare the comparison is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = REPO_ROOT = Path(__file__).resolve().parent.parent
VGPUMGR = [str(Path(sys.executable).with_name("vgpumgr"))]
MDEVCTL = ["mdevctl", "types", "--dumpjson"]
TARGET_RATIO = 0.8


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


def inside(root: str, runs: int) -> int:
    """In the private mount namespace: bind the tree over /sys, then alternate the two commands."""
    subprocess.run(["mount", "--bind", f"{root}/sys", "/sys"], check=True)
    env = dict(os.environ)
    ours = [*VGPUMGR, "--sysfs-root", root, "types", "--json"]
    got = json.loads(subprocess.run(MDEVCTL, capture_output=True, check=True, env=env).stdout)
    types = sum(len(types) for parent in got for types in parent.values())
    times: dict[str, list[float]] = {"vgpumgr": [], "mdevctl": []}
    for cmd in (ours, MDEVCTL):  # warm the page cache and vgpumgr's type cache
        timed(cmd, 2, env)
    for _ in range(runs):
        times["vgpumgr"] += timed(ours, 1, env)
        times["mdevctl"] += timed(MDEVCTL, 1, env)
    print(json.dumps({"mdevctl_types_seen": types, **times}))
    return 0


def compare_with_mdevctl(root: Path, runs: int) -> dict[str, object]:
    why = None
    if os.geteuid() != 0:
        why = "needs root for a private mount namespace (unshare -m)"
    elif not shutil.which("unshare") or not shutil.which("mdevctl"):
        why = "unshare or mdevctl not found (scripts/setup installs mdevctl)"
    if why:
        return {"skipped": why}
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, __file__,
                           "--inside", str(root), "--runs", str(runs)], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"skipped": f"the namespace run failed: {proc.stderr.strip()[-300:]}"}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**r, "ratio": statistics.median(r["vgpumgr"]) / statistics.median(r["mdevctl"])}


def installed_like() -> None:
    """Time vgpumgr as installed: pip byte-compiles a package when it installs it, so compile this checkout
    once and let the timed processes read the bytecode (PYTHONDONTWRITEBYTECODE, if set, would make every
    run compile ~25 modules from source: ~40 ms that no installed copy pays)."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO_ROOT / "vgpumgr"), str(REPO_ROOT / "api")],
                   check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    ap.add_argument("--inside", help=argparse.SUPPRESS)  # the namespace half (see compare_with_mdevctl)
    args = ap.parse_args()
    if args.inside:
        return inside(args.inside, args.runs)
    installed_like()
    env = dict(os.environ)
    result: dict[str, object] = {}
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
            result[f"types_{parents}"] = ms
            if not args.json:
                show(f"types --json, {parents} parents x {n // parents} types", ms, 120 if parents == 128 else None)
            if parents == 128:
                result["mdevctl"] = cmp = compare_with_mdevctl(root, args.runs)
                if args.json:
                    continue
                if "skipped" in cmp:
                    print(f"vs mdevctl types: SKIPPED ({cmp['skipped']})")
                else:
                    show(f"  same tree, mdevctl types ({cmp['mdevctl_types_seen']} types)", cmp["mdevctl"])  # type: ignore[arg-type]
                    show("  same tree, vgpumgr types --json, alternating", cmp["vgpumgr"])  # type: ignore[arg-type]
                    ratio = float(cmp["ratio"])  # type: ignore[arg-type]
                    print(f"  ratio vgpumgr/mdevctl: {ratio:.2f}x (target <= {TARGET_RATIO}x: "
                          f"{'met' if ratio <= TARGET_RATIO else 'MISSED'})")
        result["help"] = timed([*VGPUMGR, "--help"], args.runs, env)
        result["python"] = timed([sys.executable, "-c", "pass"], args.runs, env)
    if args.json:
        print(json.dumps(result))
        return 0
    show("vgpumgr --help", result["help"], 150)  # type: ignore[arg-type]
    show("python -c pass (interpreter floor)", result["python"])  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
