"""`vgpumgr doctor`: what on this host keeps it from offering vGPU types (README, "Doctor")."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json


def register(sub: Any, cmd: Any, group: Any) -> None:
    p = cmd(sub, ("doctor",), "vgpumgr.cli.doctor:doctor",
            "check the host for what keeps it from offering vGPU types (exit 12 on a FAIL)")
    p.add_argument("--gpu", metavar="BDF", help="only this physical GPU's checks (the host's still run)")
    p.add_argument("--for", dest="for_type", metavar="TYPE",
                   help="why this vGPU type cannot be made on this host now, end to end")
    p.add_argument("--json", action="store_true")


def doctor(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.devices import config
    from vgpumgr.ops.context import hostname
    from vgpumgr.ops.doctor import render
    from vgpumgr.ops.doctor.facts import Facts
    from vgpumgr.ops.doctor.registry import run

    cfg = config(args)
    facts = Facts(cfg, args.gpu)
    report = run(cfg, hostname(), facts=facts)
    if args.for_type:
        from vgpumgr.ops.doctor import explain
        from vgpumgr.service import Service

        answer = explain.explain(Service(cfg), facts, report, args.for_type)
        if args.json:
            dump_json(out, {k: v for k, v in answer.items() if k != "text"})
        else:
            out.write(explain.text(answer))
        return 0 if answer["can_make"] else report.exit_code or 4
    if args.json:
        dump_json(out, report.as_dict())
    else:
        out.write(render.text(report, colour=out is sys.stdout and sys.stdout.isatty()))
    return report.exit_code
