#!/usr/bin/env python3
"""The simulated kernel alone: ms and syscalls per create+remove of one vGPU, written through Host.write.

Cases (each on a tree built by `vgpumgr sim create` on tmpfs, with other vGPUs held meanwhile):
  t4-mdev   create + remove of a T4-4Q mdev on one of 8 T4s (bench_allocate.py's host, 16 held)
  a40-mdev  create + remove of an A40-4Q mdev on a VF of one A40 with 32 VFs (8 VFs held)
  l40s-vf   current_vgpu_type set + clear of L40S-4Q on a VF of one L40S with 32 VFs (8 VFs held)
Syscalls are counted with `strace -f -c` around two runs that differ only in the number of pairs, so
the tree building and the interpreter's start cancel out.

    .venv/bin/python scripts/bench_sim_kernel.py [--case t4-mdev] [--pairs 1000] [--syscalls] [--floor] [--json]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

CASES = ("t4-mdev", "a40-mdev", "l40s-vf")


def _uuid() -> str:
    """A random UUID without os.urandom's getrandom() syscall, which the kernel's callers make, not it."""
    return str(uuidlib.UUID(int=random.getrandbits(128), version=4))


def _type_id(table: list[Any], suffix: str) -> int:
    return next(t.id for t in table if t.name.endswith(suffix))


def _setup(case: str, base: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    """Build the tree, hold the background vGPUs; return (make one vGPU, undo it)."""
    from vgpumgr.hostfs.root import Host
    from vgpumgr.sim import catalog, profiles

    if case == "t4-mdev":
        host = Host(profiles.create(base / "host", "t4", scale=8))
        tid = _type_id(catalog.T4, "T4-4Q")
        parents = sorted(os.listdir(host.mdev_bus))
        for i in range(16):  # four full GPUs, as the allocation benchmark's placer leaves them
            host.write(host.mdev_type(parents[i // 4], f"nvidia-{tid}") / "create", _uuid())
        parent = parents[4]
    elif case == "a40-mdev":
        host = Host(profiles.create(base / "host", "a40-sriov", scale=1, vfs=32))
        tid = _type_id(catalog.A40, "A40-4Q")
        parents = sorted(os.listdir(host.mdev_bus))
        for p in parents[:8]:
            host.write(host.mdev_type(p, f"nvidia-{tid}") / "create", _uuid())
        parent = parents[8]
    else:
        host = Host(profiles.create(base / "host", "l40s-vfio", scale=1, vfs=32))
        tid = _type_id(catalog.L40S, "L40S-4Q")
        vfs = sorted(a for a in os.listdir(host.pci_devices) if (host.pci(a) / "physfn").is_symlink())
        for a in vfs[:8]:
            host.write(host.pci(a) / "nvidia/current_vgpu_type", str(tid))
        vf = host.pci(vfs[8]) / "nvidia/current_vgpu_type"
        return (lambda: host.write(vf, str(tid))), (lambda: host.write(vf, "0"))

    create = host.mdev_type(parent, f"nvidia-{tid}") / "create"
    made: list[str] = []

    def make() -> None:
        made.append(_uuid())
        host.write(create, made[-1])

    def undo() -> None:
        host.write(host.mdev(made.pop()) / "remove", "1")

    return make, undo


def floor_ms(pairs: int, tmp: str | None, count_files: int = 17) -> float:
    """ms per pair of the T4 pair's syscalls replayed bare (as strace lists them, no logic between):
    per write the lock, the state's stat, the path's resolution and the checks' reads; the mdev's 4
    directories, 5 links and 5 files made and then removed; `count_files` available_instances rewritten
    by each write (17: a T4 going from empty to one vGPU and back)."""
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        for sub in ("types", "groups", "bus", "vfio", "proc"):
            os.mkdir(f"{d}/{sub}")
        counts = [f"{d}/types/{i}" for i in range(count_files)]
        for c in counts:
            Path(c).write_text("4\n")
        os.symlink("types", f"{d}/link")
        lock, state = f"{d}/lock", f"{d}/state"
        Path(state).write_text("{}")
        wr, new = os.O_WRONLY | os.O_CLOEXEC, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC

        def common(name: str) -> int:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.stat(state)
            p = os.open(f"{d}/types", os.O_PATH | os.O_DIRECTORY)
            os.lstat(name, dir_fd=p)
            os.readlink(f"/proc/self/fd/{p}")
            os.close(p)
            return fd

        def counts_write(value: bytes) -> None:
            os.readlink(f"{d}/link")  # physfn and the bus link, then the parent's listing
            os.readlink(f"{d}/link")
            list(os.scandir(d))
            for c in counts:
                fd = os.open(c, wr)
                os.write(fd, value)
                os.close(fd)

        def pair() -> None:
            fd = common("0")
            m, g = f"{d}/m", f"{d}/groups/11"
            os.path.lexists(f"{d}/bus/u")
            f = os.open(counts[0], os.O_RDONLY)
            os.read(f, 4096)
            os.close(f)
            os.mkdir(m)
            os.symlink("t", f"{m}/mdev_type")
            os.close(os.open(f"{m}/remove", new, 0o666))
            f = os.open(f"{m}/uevent", new, 0o666)
            os.write(f, b"DRIVER=nvidia\n")
            os.close(f)
            os.listdir(f"{d}/groups")
            os.symlink("g", f"{m}/iommu_group")
            os.mkdir(g)
            os.mkdir(f"{g}/devices")
            os.symlink("m", f"{g}/devices/u")
            os.close(os.open(f"{d}/vfio/11", new, 0o666))
            os.symlink("m", f"{d}/types/u")
            os.symlink("m", f"{d}/bus/u")
            os.mkdir(f"{m}/nvidia")
            for n in ("vgpu_params", "vm_name"):
                f = os.open(f"{m}/nvidia/{n}", new, 0o666)
                os.write(f, b"\n")
                os.close(f)
            counts_write(b"3\n")
            os.close(fd)
            fd = common("1")
            os.path.islink(f"{m}/mdev_type")
            os.readlink(f"{m}/iommu_group")
            os.listdir(f"{d}/proc")
            os.readlink(f"{m}/mdev_type")
            for p in (f"{d}/types/u", f"{d}/bus/u", f"{d}/vfio/11", f"{g}/devices/u"):
                os.unlink(p)
            os.rmdir(f"{g}/devices")
            os.rmdir(g)
            for n in ("mdev_type", "remove", "uevent", "iommu_group", "nvidia/vgpu_params", "nvidia/vm_name"):
                os.unlink(f"{m}/{n}")
            os.rmdir(f"{m}/nvidia")
            os.rmdir(m)
            counts_write(b"4\n")
            os.close(fd)

        for _ in range(20):
            pair()
        t0 = time.perf_counter()
        for _ in range(pairs):
            pair()
        return (time.perf_counter() - t0) * 1000 / pairs


def timed(case: str, pairs: int, tmp: str | None) -> float:
    """ms per pair."""
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        make, undo = _setup(case, Path(d))
        for _ in range(20):  # warm the emulator's caches
            make()
            undo()
        t0 = time.perf_counter()
        for _ in range(pairs):
            make()
            undo()
        return (time.perf_counter() - t0) * 1000 / pairs


def _strace_counts(case: str, pairs: int, tmp: str | None) -> dict[str, int]:
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        subprocess.run(["strace", "-f", "-c", "-o", out.name, sys.executable, __file__, "--case", case,
                        "--pairs", str(pairs), "--inner"] + (["--tmp", tmp] if tmp else []),
                       check=True, stdout=subprocess.DEVNULL)
        counts: dict[str, int] = {}
        for line in out.read().splitlines():
            # % time  seconds  usecs/call  calls  [errors]  syscall
            m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?([a-z_0-9]+)\s*$", line)
            if m and m.group(2) != "total":
                counts[m.group(2)] = int(m.group(1))
        return counts


def syscalls(case: str, pairs: int, tmp: str | None) -> dict[str, float]:
    """Syscalls per pair by name: a run of `pairs` pairs less a run of none."""
    full, empty = _strace_counts(case, pairs, tmp), _strace_counts(case, 0, tmp)
    per = {k: (full.get(k, 0) - empty.get(k, 0)) / pairs for k in set(full) | set(empty)}
    return dict(sorted(((k, v) for k, v in per.items() if round(v, 1)), key=lambda kv: -kv[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=CASES, action="append", help="(repeatable; default all)")
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per case; the best is reported")
    ap.add_argument("--syscalls", action="store_true", help="also count syscalls per pair (strace -f -c)")
    ap.add_argument("--tmp", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--floor", action="store_true",
                    help="also the T4 pair's syscalls replayed bare, without the emulator's logic")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # one untimed run under strace
    args = ap.parse_args()
    cases = args.case or list(CASES)
    if args.inner:
        timed(cases[0], args.pairs, args.tmp) if args.pairs else _setup_only(cases[0], args.tmp)
        return 0
    if args.syscalls and not shutil.which("strace"):
        ap.error("--syscalls needs strace")
    results = {}
    for case in cases:
        r: dict[str, Any] = {"ms_per_pair": min(timed(case, args.pairs, args.tmp) for _ in range(args.repeat))}
        if args.syscalls:
            per = syscalls(case, min(args.pairs, 300), args.tmp)
            r["syscalls_per_pair"] = round(sum(per.values()), 1)
            r["by_syscall"] = {k: round(v, 1) for k, v in per.items()}
        results[case] = r
    if args.floor:
        results["floor (t4 syscalls bare)"] = {"ms_per_pair": min(floor_ms(args.pairs, args.tmp)
                                                                   for _ in range(args.repeat))}
    if args.json:
        print(json.dumps(results))
        return 0
    for case, r in results.items():
        line = f"{case:<9} {r['ms_per_pair']:7.3f} ms per pair"
        if "syscalls_per_pair" in r:
            top = ", ".join(f"{k} {v:g}" for k, v in r["by_syscall"].items())
            line += f"  {r['syscalls_per_pair']:6.1f} syscalls per pair ({top})"
        print(line)
    return 0


def _setup_only(case: str, tmp: str | None) -> None:
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        make, undo = _setup(case, Path(d))
        for _ in range(20):
            make()
            undo()


if __name__ == "__main__":
    sys.exit(main())
