"""`vgpumgr vendor list|prepare`: the accelerators besides NVIDIA (vgpumgr/vendors/profiles.py) and their mode steps."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.userinput.numbers import integer
from vgpumgr.vendors.profiles import MIN_VF_MEMORY_MIB


def register(sub: Any, cmd: Any, group: Any) -> None:
    v = group("vendor", "accelerators besides NVIDIA: their profiles, and the steps that make their slices")
    p = cmd(v, ("vendor", "list"), "vgpumgr.cli.vendor:list_", "cards with a vendor profile, mechanism and state")
    p.add_argument("--json", action="store_true")
    p = cmd(v, ("vendor", "prepare"), "vgpumgr.cli.vendor:prepare",
            "run a card's mode steps (Ascend vNPU VM mode, Intel VF quotas and VFs, Cambricon VFs; AMD GIM's VF "
            "count is checked), record them for `vgpumgr restore`")
    p.add_argument("address", metavar="BDF", help="the card (physical function)")
    p.add_argument("--vfs", type=integer(0, 1024, "--vfs"), metavar="N",
                   help="SR-IOV cards: the VF count (AMD: checked, never written)")
    p.add_argument("--vf-memory", type=integer(MIN_VF_MEMORY_MIB, 1 << 20, "--vf-memory"), metavar="MIB",
                   help="Intel: each VF's memory quota, written before the VFs are enabled "
                        f"(at least {MIN_VF_MEMORY_MIB} MiB)")
    p.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    p.add_argument("--json", action="store_true")


def _cfg(args: argparse.Namespace):  # noqa: ANN202
    from vgpumgr.cli.devices import config

    return config(args)


def list_(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops.vendor import cards
    from vgpumgr.vendors.steps import state_text

    found = cards(_cfg(args).host)
    if args.json:
        dump_json(out, found)
        return 0
    table(out, ["ADDRESS", "NAME", "MECHANISM", "DRIVER", "SR-IOV", "STATE"],
          [[c["address"], c["name"], c["mechanism"], c["driver"], c["vfs"], state_text(c["state"])] for c in found],
          empty="no cards with a vendor profile")
    return 0


def prepare(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import vendor as vendor_ops

    results = vendor_ops.prepare(_cfg(args), args.address, vfs=args.vfs, vf_memory_mib=args.vf_memory,
                                 dry_run=args.dry_run)
    if args.json:
        dump_json(out, results)
        return 0
    for r in results:
        out.write(f"{r['target']}  {r['step']:<18} {'ok' if r['ok'] else 'REFUSED'}  {r['message']}\n")
        if r.get("hint"):
            out.write(f"  hint: {r['hint']}\n")
    return 0 if all(r["ok"] for r in results) else 4
