#!/usr/bin/env python3
"""What closing the databases at a command's exit costs (VGPUMGR_CHECKPOINT_AT_EXIT, default on): the wall time
of a writing command (`vgpumgr vgpu` + `vgpumgr release`) and of a reading one (`vgpumgr placements`), run as
processes on a simulated host with SQLite, with and without it, interleaved so that load on the machine falls on
both alike; and what is left in the write-ahead log after each.

    .venv/bin/python scripts/bench_checkpoint.py [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VGPUMGR = str(Path(sys.executable).parent / "vgpumgr")


def timed(env: dict[str, str], *argv: str) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run([VGPUMGR, *argv], env=env, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise SystemExit(f"vgpumgr {' '.join(argv)}: {p.stderr}")
    return time.perf_counter() - t, p.stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root, state = Path(tmp) / "host", Path(tmp) / "state"
        base = {**{k: v for k, v in os.environ.items() if not k.startswith("VGPUMGR_")},
                "VGPUMGR_SYSFS_ROOT": str(root), "VGPUMGR_STATE_DIR": str(state),
                "VGPUMGR_LIBVIRT_URI": "test:///default"}
        subprocess.run([VGPUMGR, "sim", "create", str(root), "--profile", "t4"], env=base, check=True,
                       capture_output=True)
        timed(base, "placements")
        results: dict[str, dict[str, list[float]]] = {"on": {"write": [], "read": []}, "off": {"write": [], "read": []}}
        wal: dict[str, list[int]] = {"on": [], "off": []}
        for _ in range(args.runs):
            for mode in ("off", "on"):
                env = {**base, "VGPUMGR_CHECKPOINT_AT_EXIT": "1" if mode == "on" else "0"}
                t1, out = timed(env, "vgpu", "--type", "T4-4Q", "--vm", "bench", "--json")
                uuid = json.loads(out)["uuid"]
                t2, _ = timed(env, "release", uuid)
                results[mode]["write"].append(t1 + t2)
                results[mode]["read"].append(timed(env, "placements")[0])
                w = state / "vgpumgr.db-wal"
                wal[mode].append(w.stat().st_size if w.exists() else 0)
        print(f"checkpoint at exit, {args.runs} runs each, interleaved (median; SQLite, simulated T4 host)")
        print(f"{'':5} {'vgpu+release':>14} {'placements':>12} {'WAL left':>10}")
        for mode in ("off", "on"):
            r = results[mode]
            w, rd = statistics.median(r["write"]) * 1000, statistics.median(r["read"]) * 1000
            print(f"{mode:5} {w:11.0f} ms {rd:9.0f} ms {statistics.median(wal[mode]) // 1024:7d} KiB")
        d = statistics.median(results["on"]["write"]) - statistics.median(results["off"]["write"])
        print(f"difference for the writing pair: {d * 1000:+.0f} ms (two processes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
