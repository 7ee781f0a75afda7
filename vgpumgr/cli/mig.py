"""`vgpumgr mig`: MIG GPU instances, through NVML (the vGPU scheduler is in vgpumgr.cli.scheduler)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.userinput.numbers import integer


def register(sub: Any, cmd: Any, group: Any) -> None:
    mig = group("mig", "MIG GPU instances (through NVML)")
    p = cmd(mig, ("mig", "list"), "vgpumgr.cli.mig:mig_list", "MIG mode, profiles and GPU instances")
    p.add_argument("--json", action="store_true")
    p = cmd(mig, ("mig", "plan"), "vgpumgr.cli.mig:mig_plan", "where a profile would go (or why not)")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("profile", nargs="+", metavar="PROFILE", help="one or more profiles: a layout to check")
    p = cmd(mig, ("mig", "create"), "vgpumgr.cli.mig:mig_create", "create a GPU instance")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("--start", type=integer(0, 7, "--start"), help="explicit placement start slice")
    p.add_argument("--compute-instance", action="store_true")
    p = cmd(mig, ("mig", "destroy"), "vgpumgr.cli.mig:mig_destroy", "destroy a GPU instance")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("gi", type=integer(0, 63, "GI_ID"), metavar="GI_ID")
    p = cmd(mig, ("mig", "mode"), "vgpumgr.cli.mig:mig_mode", "enable or disable MIG mode (reports pending)")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("state", choices=("on", "off"))


def _layer(args: argparse.Namespace):  # noqa: ANN202
    from vgpumgr.cli.devices import config
    from vgpumgr.ops.manual import nvml

    return nvml(config(args))


def mig_list(args: argparse.Namespace, out: TextIO) -> int:
    layer = _layer(args)
    gpus = layer.gpus()
    if args.json:
        dump_json(out, {a: g.get("mig") for a, g in gpus.items()})
        return 0
    rows = []
    for a, g in sorted(gpus.items()):
        m = g.get("mig") or {}
        if not m.get("supported"):
            continue
        gis = ", ".join(f"{gi['profile']}@{gi['start']} (GI {gi['id']})" for gi in m.get("gpu_instances", []))
        rows.append([a, g.get("name"), m.get("current"), m.get("pending"), gis or "-"])
    table(out, ["GPU", "NAME", "MIG", "PENDING", "GPU INSTANCES"], rows, empty="no MIG-capable GPUs")
    return 0


def mig_plan(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import ids
    from vgpumgr.mig import plan as mig

    layer = _layer(args)
    gpu = ids.pci_address(args.gpu)
    table_ = layer.mig_table(gpu)
    existing = layer.gpu_instances(gpu)
    placed = list(existing)
    for name in args.profile:
        p = mig.plan(table_, placed, table_.find(name))
        placed.append(p)
        out.write(f"{name}: start {p.start} size {p.size}\n")
    return 0


def mig_create(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.devices import config
    from vgpumgr.ops import manual

    dump_json(out, manual.mig_create(config(args), args.gpu, args.profile, start=args.start,
                                     compute_instance=args.compute_instance))
    return 0


def mig_destroy(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.devices import config
    from vgpumgr.ops import manual

    dump_json(out, manual.mig_destroy(config(args), args.gpu, args.gi))
    return 0


def mig_mode(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.devices import config
    from vgpumgr.ops import manual

    res = manual.mig_mode(config(args), args.gpu, args.state == "on")
    dump_json(out, res)
    if res.get("pending") != res.get("current"):
        sys.stderr.write("note: the change is pending until the GPU is reset\n")
    return 0
