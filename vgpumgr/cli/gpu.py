"""`vgpumgr gpu`: settings of one physical GPU: NVIDIA's vGPU mode (mixed or equal size) and making room for a
size in mixed-size mode (`gpu compact`)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json


def register(sub: Any, cmd: Any, group: Any) -> None:
    gpu = group("gpu", "one physical GPU's vGPU settings (NVIDIA mixed-size mode)")
    p = cmd(gpu, ("gpu", "mode"), "vgpumgr.cli.gpu:mode",
            "set NVIDIA's vGPU mode: mixed sizes on one GPU, or equal size (no vGPU may exist on it)")
    p.add_argument("gpu", metavar="BDF")
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--mixed", action="store_const", const="mixed", dest="mode", help="mixed-size (heterogeneous)")
    m.add_argument("--equal", action="store_const", const="equal", dest="mode", help="equal-size (the default)")
    p.add_argument("--json", action="store_true")
    p = cmd(gpu, ("gpu", "slots"), "vgpumgr.cli.gpu:slots",
            "mixed-size mode: the GPU's placement map and each type's creatable placement IDs")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("--json", action="store_true")
    p = cmd(gpu, ("gpu", "compact"), "vgpumgr.cli.gpu:compact",
            "mixed-size mode: the fewest live migrations that free a placement of TYPE (plan; --apply runs it)")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("--for", dest="type", required=True, metavar="TYPE")
    p.add_argument("--apply", action="store_true")
    p.add_argument("--json", action="store_true")


def _service(args: argparse.Namespace):  # noqa: ANN202
    from vgpumgr.cli.vm import service

    return service(args)


def mode(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import vgpu_mode

    got = vgpu_mode.set_mode(_service(args), args.gpu, args.mode)
    if args.json:
        dump_json(out, got)
    elif got["changed"]:
        out.write(f"{got['gpu']}: {got['mode']}-size vGPU mode (was {got['before'] or 'unknown'}); "
                  "`vgpumgr restore` sets it again after a reboot\n")
    else:
        out.write(f"{got['gpu']}: already in {got['mode']}-size vGPU mode\n")
    return 0


def slots(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import slot_map

    got = slot_map.slot_map(_service(args), args.gpu)
    if args.json:
        dump_json(out, got)
    else:
        out.write(slot_map.text(got))
    return 0


def compact(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import compact as compact_ops

    svc = _service(args)
    plan = compact_ops.plan(svc, args.gpu, args.type)
    if args.apply:
        plan = compact_ops.apply(svc, plan)
    if args.json:
        dump_json(out, plan)
    else:
        out.write(compact_ops.text(plan))
    err = compact_ops.failure(plan)
    if err is not None:
        raise err  # after the output: what was moved is shown, the error says what stopped it
    return 0 if plan["feasible"] else 4
