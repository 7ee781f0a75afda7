#!/usr/bin/env python3
"""What the checkpoint at a command's exit costs (VGPUMGR_CHECKPOINT_AT_EXIT, default on): the wall time of a
writing command (`vgpumgr vgpu` + `vgpumgr release`) and of a reading one (`vgpumgr placements`), run as
processes on a simulated host with SQLite, with and without it, interleaved so that load on the machine falls on
both alike; whether a plain copy of vgpumgr.db (without its -wal) holds the vGPU just made; and the exit
handler's own time, in process.

    .venv/bin/python scripts/bench_checkpoint.py [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
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
                copy = Path(tmp) / "copy.db"
                shutil.copy(state / "vgpumgr.db", copy)  # what `cp vgpumgr.db` takes
                with closing(sqlite3.connect(copy)) as conn:
                    wal[mode].append(conn.execute("SELECT count(*) FROM allocations WHERE uuid = ?", (uuid,))
                                     .fetchone()[0])
                copy.unlink()
                t2, _ = timed(env, "release", uuid)
                results[mode]["write"].append(t1 + t2)
                results[mode]["read"].append(timed(env, "placements")[0])
        print(f"checkpoint at exit, {args.runs} runs each, interleaved (median; SQLite, simulated T4 host)")
        print(f"{'':5} {'vgpu+release':>14} {'placements':>12} {'cp vgpumgr.db has the new vGPU':>32}")
        for mode in ("off", "on"):
            r = results[mode]
            w, rd = statistics.median(r["write"]) * 1000, statistics.median(r["read"]) * 1000
            print(f"{mode:5} {w:11.0f} ms {rd:9.0f} ms {sum(wal[mode]):>22} of {len(wal[mode])} runs")
        d = statistics.median(results["on"]["write"]) - statistics.median(results["off"]["write"])
        print(f"difference for the writing pair: {d * 1000:+.0f} ms (two processes; within the processes' noise)")
        print(f"the close itself, in process (the atexit handler's work): {closing_cost(base, args.runs)}")
    return 0


def closing_cost(env: dict[str, str], runs: int) -> str:
    """Time what the exit handler does (a PASSIVE checkpoint of the log into the database file) after a read
    and after a write, in this process, where process start-up noise does not hide it."""
    import io

    os.environ.update({k: v for k, v in env.items() if k.startswith("VGPUMGR_")})
    from vgpumgr.cli.main import main as cli
    from vgpumgr.db import session

    after: dict[str, list[float]] = {"read": [], "write": []}
    for _ in range(runs):
        for kind, argv in (("read", ["placements"]), ("write", ["vgpu", "--type", "T4-4Q", "--vm", "close", "--json"])):
            out = io.StringIO()
            cli(argv, out, io.StringIO())
            t = time.perf_counter()
            session.checkpoint_sqlite()
            after[kind].append(time.perf_counter() - t)
            if kind == "write":
                cli(["release", json.loads(out.getvalue())["uuid"]], io.StringIO(), io.StringIO())
                session.dispose_engines()
    return ", ".join(f"after a {k} median {statistics.median(v) * 1000:.1f} ms" for k, v in after.items())


if __name__ == "__main__":
    sys.exit(main())
