"""`vgpumgr demo`: the main job on a simulated mixed host, libvirt's test driver and SQLite, in well under a minute.

Every step runs the real CLI command (shown as the user would type it) against a simulated root,
so what the demo prints is exactly what those commands print."""

from __future__ import annotations

import argparse
import io
import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import TextIO

from vgpumgr.errors import VgpuError

RAM_DIR = "/dev/shm"
RAM_DIR_MIN_FREE = 64 << 20  # the demo's host and database take a few MB


def scratch_dir() -> Path:
    """Where the demo builds its throwaway host when no --dir is given: a RAM-backed folder when the system has
    one with room to spare, unless TMPDIR names another place; else the system's temporary folder.

    A simulated sysfs is over a thousand directories, links and tiny files that live for seconds, and the real
    sysfs is in memory too. On a disk the inodes are the cost: on the project's 2-core machine making one under
    /tmp takes 0.2-1 ms (an ext4 block group crowded by years of temporary files), so the host's build took
    0.4-1.1 s there against 0.1 s in /dev/shm (scripts/bench_demo.py measures both)."""
    if not os.environ.get("TMPDIR") and os.path.isdir(RAM_DIR) and os.access(RAM_DIR, os.W_OK | os.X_OK):
        try:
            st = os.statvfs(RAM_DIR)
            if st.f_bavail * st.f_frsize >= RAM_DIR_MIN_FREE:
                return Path(tempfile.mkdtemp(prefix="vgpumgr-demo-", dir=RAM_DIR))
        except OSError:
            pass  # not usable after all: the ordinary temporary folder
    return Path(tempfile.mkdtemp(prefix="vgpumgr-demo-"))


def demo(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.main import main
    from vgpumgr.sim import profiles
    from vgpumgr.userinput import files

    base = files.checked_path(args.dir, "demo --dir") if args.dir is not None else scratch_dir()
    root = base / "host"
    t0 = time.monotonic()
    saved = {k: os.environ.get(k) for k in ("VGPUMGR_SYSFS_ROOT", "VGPUMGR_LIBVIRT_URI", "VGPUMGR_DB",
                                            "VGPUMGR_STATE_DIR", "VGPUMGR_LICENCE_MODE")}
    step = 0
    parsers: dict = {}  # each command's parser built once for the whole demo

    def say(text: str) -> None:
        out.write(f"\n== {text}\n")
        out.flush()

    def run(*argv: str, expect_fail: bool = False) -> str:
        nonlocal step
        step += 1
        out.write(f"$ vgpumgr {' '.join(shlex.quote(a) for a in argv)}\n")
        buf, err = io.StringIO(), io.StringIO()
        rc = main(list(argv), out=buf, err=err, parsers=parsers)
        out.write(buf.getvalue())
        if err.getvalue():
            out.write(err.getvalue())
        if (rc != 0) != expect_fail:
            raise VgpuError(f"demo step {step} (`vgpumgr {' '.join(argv)}`) exited {rc}",
                            hint="this is a bug in vgpumgr or its simulator; please report it")
        out.flush()
        return buf.getvalue()

    try:
        every_vendor = getattr(args, "profile", "mixed") == "all"
        if every_vendor:
            say("1. Build a simulated host with every vendor: NVIDIA, Intel, Huawei Ascend, Moore Threads, Cambricon, "
                "AMD, Hygon, MetaX, Enflame")
        else:
            say("1. Build a simulated mixed host: Tesla T4 (mdev), L40S (vendor VF), A100 (MIG), Intel GVT-g")
        profiles.create(root, "all" if every_vendor else "mixed", force=True)
        out.write(f"simulated sysfs tree at {root} (every command below reads and writes it through --sysfs-root)\n")
        os.environ["VGPUMGR_SYSFS_ROOT"] = str(root)
        os.environ["VGPUMGR_LIBVIRT_URI"] = "test:///default"
        os.environ.pop("VGPUMGR_DB", None)
        os.environ.pop("VGPUMGR_STATE_DIR", None)
        os.environ["VGPUMGR_LICENCE_MODE"] = "enforce"
        if every_vendor:
            from vgpumgr.sim.demo_vendors import vendor_steps

            vendor_steps(run, say)
            out.write(f"\ndemo finished in {time.monotonic() - t0:.1f} s; the simulated host is at {root}"
                      f"{'' if args.keep or args.dir else ' (removed now; pass --keep to keep it)'}\n")
            return 0

        say("2. Discover GPUs and vGPU types")
        run("gpus")
        run("types", "--parent", "0000:3b:00.0")
        run("types", "--parent", "0000:3d:00.4", "--available")

        say("3. Create a vGPU by hand, show it, remove it")
        uuid = "5a4f0b1e-7c2d-4e8a-9b3c-1d2e3f4a5b6c"
        run("mdev", "create", "--parent", "0000:3b:00.0", "--type", "T4-4Q", "--uuid", uuid)
        run("mdev", "list")
        run("types", "--parent", "0000:3b:00.0", "--available")
        run("mdev", "remove", uuid)

        say("4. Licences: a vWS pool with 2 seats, enforced")
        run("license", "add", "lab-vws", "--edition", "vWS", "--seats", "2")

        say("5. Where would a T4-4Q go? (nothing changes)")
        run("place", "--type", "T4-4Q", "--vm", "web1", "--explain")

        say("6. VMs: a T4-4Q desktop with a display, and a MIG-backed compute VM with an L40S vGPU too")
        run("vm", "create", "web1", "--vgpu", "T4-4Q", "--display", "--memory", "8192", "--start")
        run("vm", "create", "ml1", "--mig", "1g.10gb", "--vgpu", "L40S-2Q", "--vcpus", "8")
        run("vm", "list")
        run("placements")
        run("license", "usage")

        say("7. A third VM needs a seat that is not there: refused, nothing left half-made")
        run("vm", "create", "web2", "--vgpu", "T4-4Q", expect_fail=True)
        run("placements")

        say("8. A reboot loses the vGPUs (and VFs, MIG GPU instances); restore brings them back from the records")
        run("sim", "reboot")
        run("reconcile", expect_fail=True)
        run("restore", "--dry-run")
        run("restore")
        run("reconcile")

        say("9. Delete the VMs: devices removed, seats released")
        run("vm", "delete", "web1")
        run("vm", "delete", "ml1")
        run("license", "usage")

        say("10. The audit trail, and its hash chain verified")
        run("audit")
        run("audit", "verify")
        out.write(f"\ndemo finished in {time.monotonic() - t0:.1f} s; the simulated host is at {root}"
                  f"{'' if args.keep or args.dir else ' (removed now; pass --keep to keep it)'}\n")
        return 0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
