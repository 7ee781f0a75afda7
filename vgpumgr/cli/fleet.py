"""`vgpumgr host cordon|uncordon|show` and `vgpumgr fleet hosts|gpus|capacity|place`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json


def register(sub: Any, cmd: Any, group: Any) -> None:
    host = group("host", "this host (or another of the fleet) as the fleet sees it: cordon, uncordon, show")
    p = cmd(host, ("host", "cordon"), "vgpumgr.cli.fleet:cordon",
            "cordon a host: `fleet place` never chooses it and live migrations into it are refused; what runs "
            "there stays, and local commands still work (with a warning)")
    p.add_argument("host", nargs="?", metavar="HOST", help="the host (default: this one)")
    p.add_argument("--reason", metavar="R", help="why, shown with the host (e.g. 'BIOS update')")
    p.add_argument("--json", action="store_true")
    p = cmd(host, ("host", "uncordon"), "vgpumgr.cli.fleet:uncordon", "let the fleet place on a host again")
    p.add_argument("host", nargs="?", metavar="HOST", help="the host (default: this one)")
    p.add_argument("--json", action="store_true")
    p = cmd(host, ("host", "show"), "vgpumgr.cli.fleet:show", "whether a host is cordoned, and why")
    p.add_argument("host", nargs="?", metavar="HOST", help="the host (default: this one)")
    p.add_argument("--json", action="store_true")


def service(args: argparse.Namespace):  # noqa: ANN201
    from vgpumgr.cli.devices import config
    from vgpumgr.service import Service

    return Service(config(args))


def cordon(args: argparse.Namespace, out: TextIO) -> int:
    r = service(args).cordon_host(args.host, reason=args.reason)
    if args.json:
        dump_json(out, r)
    elif r["changed"]:
        out.write(f"host {r['host']} cordoned{_why(r)}: `vgpumgr fleet place` will not choose it; "
                  "what runs there stays\n")
    else:
        out.write(f"host {r['host']} was already cordoned{_why(r)}\n")
    return 0


def uncordon(args: argparse.Namespace, out: TextIO) -> int:
    r = service(args).uncordon_host(args.host)
    if args.json:
        dump_json(out, r)
    else:
        out.write(f"host {r['host']} uncordoned\n" if r["changed"] else f"host {r['host']} was not cordoned\n")
    return 0


def show(args: argparse.Namespace, out: TextIO) -> int:
    r = service(args).host_status(args.host)
    if args.json:
        dump_json(out, r)
    elif r["cordoned"]:
        out.write(f"host {r['host']}: cordoned{_why(r)} since {r['cordoned_at'][:19]} by {r['cordoned_by']}\n")
    else:
        out.write(f"host {r['host']}: not cordoned\n")
    return 0


def _why(r: dict[str, Any]) -> str:
    return f" ({r['reason']})" if r.get("reason") else ""


def warn_if_cordoned(svc: Any, err: TextIO | None = None) -> None:
    """Local creates go ahead on a cordoned host (see vgpumgr.ops.cordon); say so, on stderr."""
    r = svc.host_status()
    if r["cordoned"]:
        (err or sys.stderr).write(f"warning: host {r['host']} is cordoned{_why(r)}: the fleet places nothing "
                                  "new here; this local command goes ahead (`vgpumgr host uncordon` to undo)\n")
