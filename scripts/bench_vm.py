#!/usr/bin/env python3
"""Time `vgpumgr vm create ... --print-xml` against `virt-install --print-xml` for an equivalent vGPU VM.

Both commands run as fresh processes (what a user waits for), alternating, RUNS times each after a warm-up.
virt-install only accepts an mdev as a libvirt node device, so it runs against a test-driver host file
(written here) that declares a Tesla T4 with its mdev types and one T4-4Q mdev. Prints both medians and
the ratio; the target is vgpumgr <= 25% of virt-install's time.

    .venv/bin/python scripts/bench_vm.py [--runs 15] [--sysfs-root DIR] [--vgpumgr-cmd "vgpumgr vm ..."]

`{root}` in --vgpumgr-cmd is replaced by the simulated sysfs root. Without --sysfs-root the script
tries `--sim-create` (default `vgpumgr sim create --profile t4 {root}`) in a temporary folder. If the
vgpumgr command fails, its side is skipped with the reason and virt-install is still measured.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_discovery import installed_like  # this folder: the same byte-compiled checkout for both timings

REPO_ROOT = Path(__file__).resolve().parent.parent
MDEV_UUID = "02cf755c-dcc5-5620-af1c-67549994f1ab"
PARENT = "0000:3b:00.0"
DEFAULT_VGPUMGR = "vgpumgr vm create bench-vm --vgpu T4-4Q --print-xml --sysfs-root {root}"
DEFAULT_SIM_CREATE = "vgpumgr sim create --profile t4 {root}"

# A test-driver host: the T4 PCI function with mdev types, and one mdev on it (libvirt nodedev XML).
TEST_HOST = f"""<node>
  <cpu><mode>host-passthrough</mode></cpu>
  <device>
    <name>pci_0000_3b_00_0</name>
    <path>/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0</path>
    <parent>computer</parent>
    <driver><name>nvidia</name></driver>
    <capability type='pci'>
      <class>0x030200</class>
      <domain>0</domain><bus>59</bus><slot>0</slot><function>0</function>
      <product id='0x1eb8'>TU104GL [Tesla T4]</product>
      <vendor id='0x10de'>NVIDIA Corporation</vendor>
      <capability type='mdev_types'>
        <type id='nvidia-222'><name>GRID T4-1B</name><deviceAPI>vfio-pci</deviceAPI>
          <availableInstances>16</availableInstances></type>
        <type id='nvidia-232'><name>GRID T4-4Q</name><deviceAPI>vfio-pci</deviceAPI>
          <availableInstances>3</availableInstances></type>
      </capability>
      <iommuGroup number='40'><address domain='0x0000' bus='0x3b' slot='0x00' function='0x0'/></iommuGroup>
    </capability>
  </device>
  <device>
    <name>mdev_{MDEV_UUID.replace('-', '_')}_0000_3b_00_0</name>
    <path>/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/{MDEV_UUID}</path>
    <parent>pci_0000_3b_00_0</parent>
    <driver><name>vfio_mdev</name></driver>
    <capability type='mdev'>
      <type id='nvidia-232'/>
      <uuid>{MDEV_UUID}</uuid>
      <parent_addr>{PARENT}</parent_addr>
      <iommuGroup number='41'/>
    </capability>
  </device>
</node>
"""


def virt_install_cmd(host_file: Path) -> list[str]:
    """The VM vgpumgr's default spec describes: 4 GiB, 2 vCPUs, no disk, no network, headless, one mdev."""
    return ["virt-install", "--connect", f"test://{host_file}", "--print-xml", "--name", "bench-vm",
            "--memory", "4096", "--vcpus", "2", "--disk", "none", "--network", "none", "--graphics", "none",
            "--import", "--osinfo", "linux2022", "--noautoconsole",
            "--hostdev", f"mdev_{MDEV_UUID.replace('-', '_')}_0000_3b_00_0"]


def resolve(cmd: list[str]) -> list[str]:
    """`vgpumgr` from this interpreter's venv when there is one (running as .venv/bin/python)."""
    beside = Path(sys.executable).parent / cmd[0]
    if cmd and "/" not in cmd[0] and beside.exists():  # this checkout's, not another install's on PATH
        return [str(beside), *cmd[1:]]
    return cmd


def run_once(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def check(label: str, cmd: list[str]) -> str | None:
    """None when the command works, else why it is skipped."""
    if shutil.which(cmd[0]) is None:
        return f"{cmd[0]} not found"
    _, proc = run_once(cmd)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return f"exit {proc.returncode}: " + " | ".join(tail)
    if "<domain" not in proc.stdout or "<hostdev" not in proc.stdout:
        return "its output holds no <domain> with a <hostdev>"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sysfs-root", help="simulated sysfs root (default: made with --sim-create)")
    ap.add_argument("--sim-create", default=DEFAULT_SIM_CREATE, help="command that makes a simulated root")
    ap.add_argument("--vgpumgr-cmd", default=DEFAULT_VGPUMGR, help="vgpumgr command line to time ({root})")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = ap.parse_args()
    say = (lambda *a: None) if args.json else print  # noqa: E731
    skipped: dict[str, str] = {}

    installed_like()
    with tempfile.TemporaryDirectory(prefix="bench-vm-") as tmp:
        host_file = Path(tmp) / "testhost-t4.xml"
        host_file.write_text(TEST_HOST)
        root = args.sysfs_root or str(Path(tmp) / "root")
        sides: dict[str, list[str]] = {"virt-install": virt_install_cmd(host_file)}

        vg_cmd = resolve(shlex.split(args.vgpumgr_cmd.format(root=root)))
        why = None
        if not args.sysfs_root:
            create = resolve(shlex.split(args.sim_create.format(root=root)))
            if shutil.which(create[0]) is None:
                why = f"{create[0]} not found"
            else:
                proc = subprocess.run(create, capture_output=True, text=True)
                if proc.returncode != 0:
                    why = f"making the simulated root failed: {' '.join(create)}: " + \
                          " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
        why = why or check("vgpumgr", vg_cmd)
        if why:
            say(f"vgpumgr: SKIPPED ({why})")
            skipped["vgpumgr"] = why
        else:
            sides["vgpumgr"] = vg_cmd
        why = check("virt-install", sides["virt-install"])
        if why:
            say(f"virt-install: SKIPPED ({why}); install it with `apt-get install virtinst`")
            skipped["virt-install"] = why
            del sides["virt-install"]
        if not sides:
            if args.json:
                print(json.dumps({"skipped": skipped}))
            return 1

        times: dict[str, list[float]] = {k: [] for k in sides}
        for i in range(args.warmup + args.runs):
            for label, cmd in sides.items():  # alternate so drift affects both sides alike
                elapsed, proc = run_once(cmd)
                if proc.returncode != 0:
                    print(f"{label}: failed during the run: {proc.stderr.strip()[-300:]}")
                    return 1
                if i >= args.warmup:
                    times[label].append(elapsed)

    medians = {k: statistics.median(v) for k, v in times.items()}
    if args.json:
        print(json.dumps({"ms": {k: [t * 1000 for t in v] for k, v in times.items()}, "skipped": skipped,
                          "ratio": medians["vgpumgr"] / medians["virt-install"] if len(medians) == 2 else None}))
        return 0
    for label, cmd in sides.items():
        v = times[label]
        print(f"{label:13s} median {medians[label] * 1000:7.1f} ms  (min {min(v) * 1000:.1f}, "
              f"max {max(v) * 1000:.1f}, n={len(v)})  $ {shlex.join(cmd)}")
    if len(medians) == 2:
        ratio = medians["vgpumgr"] / medians["virt-install"]
        verdict = "meets" if ratio <= 0.25 else "misses"
        print(f"ratio vgpumgr/virt-install: {ratio:.1%} ({verdict} the <= 25% target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
