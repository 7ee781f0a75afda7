#!/usr/bin/env python3
"""Time `vgpumgr demo` as a user runs it: a fresh process, its simulated host in a temporary folder.

Four cases, RUNS times each, the median counting (target: <= 3 s on the project's 2-core machine):
  unset, cold   PYTHONDONTWRITEBYTECODE unset, no __pycache__ in the checkout (a fresh clone: Python
                compiles vgpumgr's modules and writes the bytecode)
  unset, warm   the same with the bytecode there (every later run, or a pip-installed copy)
  set, cold     PYTHONDONTWRITEBYTECODE=1 and no __pycache__: every run compiles and writes nothing
  set, warm     PYTHONDONTWRITEBYTECODE=1 with the bytecode there (read, not written)
Only the checkout's own bytecode (vgpumgr/, api/, migrations/) is removed for a cold run; the installed
dependencies keep theirs, as pip leaves them. Without --dir the demo builds its host in /dev/shm where it can
(vgpumgr.sim.demo.scratch_dir); for comparison each round also times the warm, unset case with the host on
disk, under the system's temporary folder (`--dir`). `--steps` adds one run that times each of the demo's
steps in-process (building the simulated host, the first database use, each CLI command).

    .venv/bin/python scripts/bench_demo.py [--runs 3] [--steps] [--json]
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

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 3.0
CASES = (("unset", "cold"), ("unset", "warm"), ("set", "cold"), ("set", "warm"))

# Run inside a fresh interpreter: the demo with every CLI step (and the host's build) timed.
STEPS = r"""
import io, json, sys, time
t_start = time.perf_counter()
import vgpumgr.cli.main as cli
from vgpumgr.sim import profiles
real_main, real_create, steps = cli.main, profiles.create, []
def timed_main(argv, out=None, err=None, **kw):
    if argv[:1] == ["demo"]:
        return real_main(argv, out=out, err=err, **kw)
    t = time.perf_counter()
    try:
        return real_main(argv, out=out, err=err, **kw)
    finally:
        steps.append((" ".join(argv), time.perf_counter() - t))
def timed_create(*a, **k):
    t = time.perf_counter()
    try:
        return real_create(*a, **k)
    finally:
        steps.append(("(build the simulated mixed host)", time.perf_counter() - t))
cli.main, profiles.create = timed_main, timed_create
t0 = time.perf_counter()
err = io.StringIO()
rc = real_main(["demo"], out=io.StringIO(), err=err)
print(json.dumps({"rc": rc, "err": err.getvalue()[-2000:], "start_s": t0 - t_start,
                  "demo_s": time.perf_counter() - t0, "steps": steps}))
"""


def demo_command() -> list[str]:
    script = Path(sys.executable).parent / "vgpumgr"  # the venv's console script: what a user types
    return [str(script), "demo"] if script.exists() else [sys.executable, "-m", "vgpumgr.cli.main", "demo"]


def remove_bytecode() -> None:
    for top in ("vgpumgr", "api", "migrations"):
        for d in (REPO_ROOT / top).rglob("__pycache__"):
            shutil.rmtree(d, ignore_errors=True)


def compile_bytecode() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(REPO_ROOT / d) for d in
                                                              ("vgpumgr", "api", "migrations"))],
                   check=True, stdout=subprocess.DEVNULL, env=env)


def run_once(dont_write: str, temperature: str, on_disk: bool = False) -> float:
    if temperature == "cold":
        remove_bytecode()
    else:
        compile_bytecode()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if dont_write == "set":
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    scratch = tempfile.mkdtemp(prefix="bench-demo-") if on_disk else None
    command = demo_command() + (["--dir", f"{scratch}/demo"] if scratch else [])
    t = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        elapsed = time.perf_counter() - t  # (the demo removes its host itself only without --dir)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"vgpumgr demo failed ({proc.returncode}): {' / '.join(tail)}")
    return elapsed


def step_times() -> dict:
    compile_bytecode()
    proc = subprocess.run([sys.executable, "-c", STEPS], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if found["rc"] != 0:
        raise SystemExit(f"the timed demo failed ({found['rc']}): {found['err']}")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per case (default 3)")
    ap.add_argument("--steps", action="store_true", help="also time each step of one in-process run")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    a = ap.parse_args()
    result: dict = {"target_s": TARGET_S, "runs": a.runs, "cases": {}}
    try:
        for _ in range(a.runs):  # interleaved, so a busy moment of the machine spreads over all four
            for dont_write, temperature in CASES:
                key = f"PYTHONDONTWRITEBYTECODE {dont_write}, {temperature}"
                result["cases"].setdefault(key, []).append(run_once(dont_write, temperature))
            result.setdefault("on_disk_s", []).append(run_once("unset", "warm", on_disk=True))
        if a.steps:
            result["steps"] = step_times()
    finally:
        compile_bytecode()  # leave the checkout as an installed copy would be
    medians = {k: statistics.median(v) for k, v in result["cases"].items()}
    result["median_s"] = medians
    result["slowest_median_s"] = max(medians.values())
    result["on_disk_median_s"] = statistics.median(result["on_disk_s"])
    result["on_disk_dir"] = tempfile.gettempdir()
    if a.json:
        print(json.dumps(result))
        return 0
    for key, values in result["cases"].items():
        print(f"{key:<34} median {medians[key]:.2f} s  (runs: {', '.join(f'{v:.2f}' for v in values)})")
    verdict = "met" if result["slowest_median_s"] <= TARGET_S else "MISSED"
    print(f"slowest median {result['slowest_median_s']:.2f} s, target <= {TARGET_S:.1f} s: {verdict}")
    print(f"for comparison, the host on disk (--dir under {result['on_disk_dir']}), unset, warm: median "
          f"{result['on_disk_median_s']:.2f} s (runs: {', '.join(f'{v:.2f}' for v in result['on_disk_s'])})")
    if a.steps:
        s = result["steps"]
        print(f"\none in-process run, bytecode present: interpreter + CLI import {s['start_s']:.2f} s, "
              f"demo {s['demo_s']:.2f} s")
        for what, secs in s["steps"]:
            print(f"  {secs * 1000:6.0f} ms  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
