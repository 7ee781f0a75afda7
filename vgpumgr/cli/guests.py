"""`vgpumgr guests`: what vgpumgr reads from inside the guests (opt-in), and whether each vGPU VM's guest driver
fits the host's driver (now, or after a planned driver)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table


def register(sub: Any, cmd: Any, group: Any) -> None:
    g = group("guests", "inside the guests: guest-side telemetry (opt-in) and guest/host driver compatibility")
    p = cmd(g, ("guests", "telemetry"), "vgpumgr.cli.guests:telemetry",
            "choose whether a VM (or a licence pool's VMs) is read from inside through its guest agent; "
            "without arguments: the choices made")
    p.add_argument("vm", nargs="?", metavar="VM")
    p.add_argument("choice", nargs="?", choices=("on", "off", "default"),
                   help="on, off, or default (its pool's choice, else off)")
    p.add_argument("--pool", metavar="POOL", help="choose for the VMs holding a seat of this licence pool")
    p.add_argument("--json", action="store_true")
    p = cmd(g, ("guests", "check"), "vgpumgr.cli.guests:check",
            "every vGPU VM whose guest driver the host driver does not accept (or would not after --driver); "
            "exit 10 when one is found")
    p.add_argument("--driver", metavar="VERSION", help="a planned host driver, e.g. 595.58.02")
    p.add_argument("--json", action="store_true")


def _service(args: argparse.Namespace) -> Any:
    from vgpumgr.cli.vm import service

    return service(args)


def telemetry(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.errors import InvalidInput
    from vgpumgr.ops import guest_watch

    svc = _service(args)
    if args.pool and args.vm and not args.choice:  # `guests telemetry --pool P on`
        args.vm, args.choice = None, args.vm
    if args.pool or args.vm:
        if args.choice is None:
            raise InvalidInput("a choice is missing", hint="e.g. `vgpumgr guests telemetry VM on` (on, off, default)")
        res: dict[str, Any] = (guest_watch.set_pool(svc, args.pool, args.choice) if args.pool
                               else guest_watch.set_vm(svc, args.vm, args.choice))
        dump_json(out, res) if args.json else out.write(
            f"guest telemetry {res['telemetry']} for {'pool ' + args.pool if args.pool else 'VM ' + res['vm']}\n")
        return 0
    res = guest_watch.choices(svc)
    if args.json:
        dump_json(out, res)
        return 0
    rows = [["VM", k, "on" if v else "off"] for k, v in sorted(res["vms"].items())]
    rows += [["pool", k, "on" if v else "off"] for k, v in sorted(res["pools"].items())]
    table(out, ["FOR", "NAME", "GUEST TELEMETRY"], rows, empty="no VM or pool is read from inside (off by default)")
    return 0


def check(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import guest_check

    res = guest_check.check(_service(args), args.driver)
    if args.json:
        dump_json(out, res)
    else:
        rows = [[f["vm"] or f["vm_uuid"] or "?", f["gpu"], f["guest_driver"], f["host_driver"], f["source"],
                 f["reason"]] for f in res["findings"]]
        target = f"the planned driver {args.driver}" if args.driver else f"the host's driver {res['host_driver']}"
        table(out, ["VM", "GPU", "GUEST DRIVER", "HOST DRIVER", "BY", "WHY"], rows,
              empty=f"every guest driver reported fits {target} ({len(res['vgpus'])} running vGPU(s))")
        waiting = [r for r in res["vgpus"] if r["accepted"] is None]
        for r in waiting:
            out.write(f"{r['vm'] or r['vm_uuid'] or r['instance']}: not judged: {r['reason']}\n")
        if res["absent"]:
            out.write(f"{res['absent']}\n")
        if res["newly_audited"]:
            sys.stderr.write(f"{len(res['newly_audited'])} new finding(s) audited as guest.driver.incompatible\n")
    return 10 if res["findings"] else 0
