"""`vgpumgr license token|delivery|deliver|guest-helper`: NVIDIA's client configuration token and how each VM
gets it (vgpumgr.licensing.token, vgpumgr.ops.licence_delivery). The token's bytes are never printed."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.errors import InvalidInput, NotFound


def register(lic: Any, cmd: Any) -> None:
    p = cmd(lic, ("license", "token"), "vgpumgr.cli.licence_token:token",
            "NVIDIA's client configuration token: set FILE, show, remove (stored 0600; never printed)")
    p.add_argument("action", choices=("set", "show", "remove"))
    p.add_argument("file", nargs="?", metavar="FILE", help="set: the client_configuration_token_*.tok file")
    p.add_argument("--pool", metavar="POOL", help="only for VMs holding a seat of this pool (default: every VM)")
    p.add_argument("--force", action="store_true",
                   help="set: take a file without the shape of a client configuration token (a signed JWT); audited")
    p.add_argument("--json", action="store_true")
    p = cmd(lic, ("license", "delivery"), "vgpumgr.cli.licence_token:delivery",
            "how VMs get the token: list, or set a VM's (or --pool's) mode fwcfg|agent|none|default")
    p.add_argument("vm", nargs="?", metavar="VM")
    p.add_argument("mode", nargs="?", choices=("fwcfg", "agent", "none", "default"))
    p.add_argument("--pool", metavar="POOL", help="set the default of VMs holding a seat of this pool")
    p.add_argument("--json", action="store_true")
    p = cmd(lic, ("license", "deliver"), "vgpumgr.cli.licence_token:deliver",
            "write the token into a running VM's guest through the QEMU guest agent and restart its licensing")
    p.add_argument("vm", metavar="VM")
    p.add_argument("--json", action="store_true")
    p = cmd(lic, ("license", "guest-helper"), "vgpumgr.cli.licence_token:guest_helper",
            "print the guest helper that installs an fw_cfg token in a Linux guest (script, unit, cloud-init)")
    p.add_argument("part", nargs="?", choices=("script", "unit", "cloud-init"), default="cloud-init")


def _service(args: argparse.Namespace):  # noqa: ANN202
    from vgpumgr.cli.vm import service

    return service(args)


def _read_token_file(name: str, force: bool) -> bytes:
    """The token file by the rule for user files (vgpumgr.userinput.files: a regular file, no symlink out of its
    directory, never a device or a FIFO, size-capped), then checked for a token's shape."""
    from vgpumgr.licensing import token as licence_token
    from vgpumgr.userinput import files

    data = files.read(name, what="the token file", limit=licence_token.MAX_TOKEN_BYTES,
                      hint="give the client_configuration_token_*.tok file downloaded from the licence server")
    return licence_token.check_token(data, name, force=force)


def token(args: argparse.Namespace, out: TextIO) -> int:
    svc = _service(args)
    if args.action == "show":
        if args.file:
            raise InvalidInput("`license token show` takes no FILE", hint="use --pool POOL for one pool's token")
        infos = [t for t in svc.licence_tokens() if not args.pool or t["scope"] == args.pool]
        if args.json:
            dump_json(out, infos)
        else:
            table(out, ["SCOPE", "FINGERPRINT", "SERVER", "EXPIRES", "SET"],
                  [[t["scope"], t["fingerprint"], t["server"] or "-",
                    (t["expires"] or "-")[:19] + (" (expired)" if t["expired"] else ""), t["set_at"][:19]]
                   for t in infos],
                  empty="no licence token is set (`vgpumgr license token set FILE`)")
        return 0
    if args.action == "set":
        if not args.file:
            raise InvalidInput("`license token set` needs the token file", hint="vgpumgr license token set FILE")
        res = svc.set_licence_token(_read_token_file(args.file, args.force), pool=args.pool, force=args.force)
    else:
        if args.file or args.force:
            raise InvalidInput("`license token remove` takes no FILE and no --force",
                               hint="use --pool POOL for one pool's token")
        res = svc.remove_licence_token(pool=args.pool)
    if args.json:
        dump_json(out, res)
        return 0
    whom = "every VM" if res["scope"] == "default" else "pool " + res["scope"]
    if args.action == "set":
        verb = "set" if not res["replaced"] else "unchanged" if res["replaced"] == res["fingerprint"] else "changed"
        out.write(f"licence token {verb} for {whom}: {res['fingerprint']}, server {res['server'] or 'unknown'}, "
                  f"expires {(res['expires'] or 'unknown')[:19]}\n")
        if res["expired"]:
            out.write("warning: this token has expired; guests will not license with it\n")
    else:
        out.write(f"licence token {res['fingerprint']} removed ({whom})\n")
    copies = res["fw_cfg_copies"]
    if copies:
        out.write(f"{copies} VM fw_cfg cop{'y' if copies == 1 else 'ies'} refreshed "
                  "(guests read it at their next boot)\n")
    for p in res["agent"]:
        out.write(f"  {p['vm']}: " + (f"delivered through the guest agent ({p['path']})" if "error" not in p
                                     else f"agent delivery failed: {p['error']}") + "\n")
    return 0


def delivery(args: argparse.Namespace, out: TextIO) -> int:
    svc = _service(args)
    mode = None if args.mode in (None, "default") else args.mode
    if args.pool:
        # `license delivery --pool P MODE`: argparse hands the one positional to VM
        given = args.mode or args.vm
        if given not in ("fwcfg", "agent", "none", "default") or (args.mode and args.vm):
            raise InvalidInput("`license delivery --pool P` needs one mode and no VM",
                               hint="vgpumgr license delivery --pool P fwcfg|agent|none|default")
        mode = None if given == "default" else given
        res = svc.set_pool_licence_delivery(args.pool, mode)
        dump_json(out, res) if args.json else out.write(f"pool {args.pool}: licence delivery {mode or 'default'}\n")
        return 0
    if args.vm and args.mode:
        res = svc.set_licence_delivery(args.vm, mode)
        dump_json(out, res) if args.json else out.write(f"VM {res['vm']}: licence delivery {res['mode']} "
                                                        f"(chosen by {res['chosen_by']})\n")
        return 0
    rows = list(svc.licence_deliveries().values())
    if args.vm:
        rows = [r for r in rows if r["vm"] == args.vm]
        if not rows:
            raise NotFound(f"no licence delivery record for VM {args.vm}",
                           hint="`vgpumgr license delivery` lists the VMs vgpumgr delivers to")
    if args.json:
        dump_json(out, rows)
        return 0
    table(out, ["VM", "MODE", "CHOSEN BY", "DELIVERED", "HOW", "TOKEN", "STARTED", "LICENSED", "ERROR"],
          [[r["vm"], r["mode"], r["chosen_by"], (r["delivered_at"] or "-")[:19], r["method"] or "-",
            r["fingerprint"] or "-", (r["started_at"] or "-")[:19], (r["first_licensed_at"] or "-")[:19],
            r["error"] or "-"] for r in rows],
          empty="no VM has a licence delivery yet (`vgpumgr vm create ... --licence-delivery fwcfg|agent`)")
    return 0


def deliver(args: argparse.Namespace, out: TextIO) -> int:
    res = _service(args).deliver_licence_token(args.vm)
    if args.json:
        dump_json(out, res)
    else:
        out.write(f"VM {res['vm']}: token {res['fingerprint']} written to {res['path']} ({res['os']} guest), "
                  f"{res['service']} restarted\n")
    return 0


def guest_helper(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.guest import helper

    out.write(helper.part(args.part))
    return 0
