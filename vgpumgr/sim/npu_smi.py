"""The simulated root's `npu-smi` (usr/local/sbin/npu-smi): the commands vgpumgr and the tests use, with their
effects on the simulated Ascend cards (docs/sources.md §22.1).

- `npu-smi set -t vnpu-mode -d 0|1`: container (0) or VM (1) mode, for every card on the host (the vendor's
  command ignores `-i`); refused while vNPUs of the other mode exist. In VM mode the vascend mdev types offer
  instances; in container mode none.
- `npu-smi set -t create-vnpu -i ID -c CHIP -f TEMPLATE`: a container vNPU (container mode only).
- `npu-smi set -t destroy-vnpu -i ID -c CHIP -v VNPU_ID`.
- `npu-smi info -t vnpu-mode`: the mode.
The wording of the tool's messages is the simulator's (no source gives it).
"""

from __future__ import annotations

import fcntl
import sys
from pathlib import Path


def main(root: str, argv: list[str]) -> int:
    from vgpumgr.sim.tree import SimTree
    from vgpumgr.sim.vendor_gpus import refresh_parent

    opts = _options(argv)
    if argv[:1] not in (["set"], ["info"]) or "t" not in opts:
        sys.stderr.write("Usage: npu-smi set -t vnpu-mode -d <0|1> | info -t vnpu-mode\n")
        return 2
    with open(Path(root) / ".vgpumgr-sim.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tree = SimTree(Path(root))
        cards = {a: vp for a, vp in tree.state.get("vendor_parents", {}).items() if vp["kind"] == "ascend"}
        if not cards:
            sys.stderr.write("Error: no NPU device found\n")
            return 1
        if argv[0] == "info":
            mode = next(iter(cards.values()))["mode"]
            sys.stdout.write(f"vnpu-mode : {'vm' if mode else 'docker'} ({mode})\n")
            return 0
        what = opts["t"]
        if what == "vnpu-mode":
            want = opts.get("d")
            if want not in ("0", "1"):
                sys.stderr.write("Error: vnpu-mode must be 0 (container) or 1 (virtual machine)\n")
                return 2
            for address, vp in sorted(cards.items()):
                if int(want) == vp["mode"]:
                    continue
                if vp["mode"] == 1 and tree.mdevs_of(tree.parent_dir(address)):
                    sys.stderr.write(f"Error: device {address} has vNPUs mounted to virtual machines; "
                                     "destroy them before changing vnpu-mode\n")
                    return 1
                if vp["mode"] == 0 and vp["container_vnpus"]:
                    sys.stderr.write(f"Error: device {address} has container vNPUs "
                                     f"({', '.join(str(v) for v in vp['container_vnpus'])}); destroy them "
                                     "(npu-smi set -t destroy-vnpu) before changing vnpu-mode\n")
                    return 1
            for address, vp in cards.items():
                vp["mode"] = int(want)
                refresh_parent(tree, str(tree.parent_dir(address)))
            tree.save(force=True)
            sys.stdout.write(f"Status : OK\nMessage : set vnpu-mode to {want} success\n")
            return 0
        address = sorted(cards)[int(opts.get("i", "0"))] if opts.get("i", "0").isdigit() else None
        vp = cards.get(address or "")
        if vp is None:
            sys.stderr.write("Error: no such NPU id\n")
            return 1
        if what == "create-vnpu":
            if vp["mode"] != 0:
                sys.stderr.write("Error: vnpu-mode is vm: container vNPUs cannot be created\n")
                return 1
            vnpu = 100 + len(vp["container_vnpus"])
            vp["container_vnpus"].append(vnpu)
            tree.save(force=True)
            sys.stdout.write(f"Status : OK\nMessage : create vnpu success\nvnpu_id : {vnpu}\n")
            return 0
        if what == "destroy-vnpu":
            vnpu = int(opts.get("v", "-1"))
            if vnpu not in vp["container_vnpus"]:
                sys.stderr.write(f"Error: no vNPU {vnpu}\n")
                return 1
            vp["container_vnpus"].remove(vnpu)
            tree.save(force=True)
            sys.stdout.write("Status : OK\nMessage : destroy vnpu success\n")
            return 0
    sys.stderr.write(f"Error: unsupported -t {what}\n")
    return 2


def _options(argv: list[str]) -> dict[str, str]:
    out = {}
    for i, a in enumerate(argv):
        if a.startswith("-") and len(a) == 2 and i + 1 < len(argv):
            out[a[1]] = argv[i + 1]
    return out
