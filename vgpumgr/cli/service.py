"""`vgpumgr serve` (the REST service) and `vgpumgr token` (its bearer tokens)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.userinput.numbers import integer


def register(sub: Any, cmd: Any, group: Any) -> None:
    p = cmd(sub, ("serve",), "vgpumgr.cli.service:serve", "run the REST service (OpenAPI at /docs)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=integer(1, 65535, "--port"), default=8470)
    p.add_argument("--socket", metavar="PATH", help="listen on a unix socket instead (e.g. /run/vgpumgr/api.sock)")
    p.add_argument("--metrics-public", action="store_true",
                   help="answer /metrics without a token on TCP too (default: a token of any role; on a unix socket "
                        "none is needed)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    tok = group("token", "bearer tokens for the REST service")
    p = cmd(tok, ("token", "create"), "vgpumgr.cli.service:token_create", "create a token (printed once)")
    p.add_argument("--name", help="who uses it (shown as the audit actor `token:NAME`; default ROLE-xxxxxx)")
    p.add_argument("--role", required=True, choices=("admin", "operator", "hook", "auditor"))
    p = cmd(tok, ("token", "list"), "vgpumgr.cli.service:token_list", "list tokens (never their secrets)")
    p.add_argument("--all", action="store_true", help="include revoked tokens")
    p.add_argument("--json", action="store_true")
    p = cmd(tok, ("token", "revoke"), "vgpumgr.cli.service:token_revoke", "revoke a token")
    p.add_argument("name")
    p = cmd(sub, ("install-units",), "vgpumgr.cli.service:install_units",
            "write the systemd units (API socket and service, boot-time restore) for this installation")
    p.add_argument("--dest", metavar="DIR", default="/etc/systemd/system", help="where to write them")
    p.add_argument("--bin", metavar="PATH", help="the vgpumgr executable the units run (default: this one)")
    p.add_argument("--json", action="store_true")


def _cfg(args: argparse.Namespace):  # noqa: ANN202
    from vgpumgr.cli.devices import config

    return config(args)


def serve(args: argparse.Namespace, out: TextIO) -> int:
    from api.server import serve as run

    run(_cfg(args), host=args.host, port=args.port, uds=args.socket, log_level=args.log_level,
        metrics_public=args.metrics_public)
    return 0


def token_create(args: argparse.Namespace, out: TextIO) -> int:
    import secrets

    from api.tokens import create_token

    name = args.name or f"{args.role}-{secrets.token_hex(3)}"
    secret = create_token(_cfg(args), name, args.role)
    out.write(f"{secret}\n")
    return 0


def token_list(args: argparse.Namespace, out: TextIO) -> int:
    from api.tokens import list_tokens

    rows = list_tokens(_cfg(args), include_revoked=args.all)
    if args.json:
        dump_json(out, rows)
        return 0
    keys = list(rows[0]) if rows else ["name", "role"]
    table(out, [k.upper() for k in keys], [[r.get(k) for k in keys] for r in rows], empty="no tokens")
    return 0


def token_revoke(args: argparse.Namespace, out: TextIO) -> int:
    from api.tokens import revoke_token

    revoke_token(_cfg(args), args.name)
    out.write(f"token {args.name} revoked\n")
    return 0


def install_units(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.platforms import systemd_units

    exe = systemd_units.check_executable(args.bin or systemd_units.default_executable())
    written = systemd_units.install(args.dest, exe)
    if args.json:
        dump_json(out, {"executable": str(exe), "units": [str(p) for p in written]})
        return 0
    for p in written:
        out.write(f"wrote {p}\n")
    out.write(f"the units run {exe}; enable them with:\n"
              "  systemctl daemon-reload\n"
              "  systemctl enable --now vgpumgr.socket\n"
              "  systemctl enable vgpumgr-restore.service   # runs `vgpumgr restore` at the next boot\n")
    return 0
