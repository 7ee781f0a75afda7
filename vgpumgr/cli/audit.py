"""`vgpumgr audit`: the trail, its verification against the chain and the signed checkpoints, export."""

from __future__ import annotations

import argparse
import sys
from datetime import date, datetime
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.cli.vm import service
from vgpumgr.errors import InvalidInput
from vgpumgr.userinput.numbers import integer


def register(sub: Any, cmd: Any, group: Any) -> None:
    p = cmd(sub, ("audit",), "vgpumgr.cli.audit:audit_list", "the audit trail (append-only, hash-chained)")
    p.add_argument("action_", nargs="?", choices=("list", "verify", "checkpoint", "export"), default="list",
                   metavar="list|verify|checkpoint|export",
                   help="verify: check the chain and every signed checkpoint (then write one); checkpoint: sign "
                        "the head now; export: events, checkpoints and public key for scripts/verify-audit-export")
    p.add_argument("--output", "-o", metavar="FILE", help="export: write the bundle here (default: stdout)")
    p.add_argument("--vm", metavar="NAME")
    p.add_argument("--gpu", metavar="BDF")
    p.add_argument("--since", metavar="TIME", help="ISO date or time (UTC)")
    p.add_argument("--until", metavar="TIME")
    p.add_argument("--limit", type=integer(1, 10**9, "--limit"))
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--csv", action="store_true")



def parse_date(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"'{text}' is not a date", hint="use YYYY-MM-DD") from None


def _time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"'{text}' is not a date or time", hint="use YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS") from None


def audit_list(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.audit import chain as audit

    if args.action_ in ("verify", "checkpoint", "export"):
        return _audit_checkpoints(args, out)
    if args.output:
        raise InvalidInput("--output only goes with `audit export`", hint="vgpumgr audit export --output FILE")
    svc = service(args)
    with svc.sessions() as s:
        events = audit.query(s, vm=args.vm, gpu=args.gpu, since=_time(args.since), until=_time(args.until),
                             limit=args.limit)
        if args.json:
            out.write(audit.to_json(events) + "\n")
        elif args.csv:
            out.write(audit.to_csv(events))
        else:
            table(out, ["SEQ", "AT", "ACTOR", "ACTION", "OUTCOME", "GPU", "VM", "VGPU", "ERROR"],
                  [[e.seq, e.at.isoformat()[:19], e.actor, e.action, e.outcome, e.gpu, e.vm, e.vgpu,
                    (e.error or "")[:60] or None] for e in events], empty="no audit events")
    return 0


def _audit_checkpoints(args: argparse.Namespace, out: TextIO) -> int:
    """verify, checkpoint and export: the chain, compared with the signed checkpoints outside the database."""
    from vgpumgr.errors import AuditBroken, VgpuError

    if args.csv or args.output and args.action_ != "export":
        raise InvalidInput(f"`audit {args.action_}` takes neither --csv nor --output",
                           hint="--output FILE goes with `audit export`; --json with verify and checkpoint")
    if args.output is not None:  # refused before a checkpoint is written
        from vgpumgr.userinput import files

        files.target(args.output, "--output", replace=True)
    svc = service(args)
    cp = svc.checkpointer
    engine = svc.sessions.kw["bind"]
    if args.action_ == "checkpoint":
        written = cp.write(engine, reason="on demand")
        if args.json:
            dump_json(out, written.to_json())
        else:
            out.write(written.message() + "\n")
        return 0
    result = svc.verify_audit()
    written, refused = None, "the chain or a checkpoint is broken"
    if result.ok:
        try:
            written = cp.write(engine, reason=args.action_)
        except VgpuError as exc:  # e.g. an auditor who may read the state dir but not write it
            refused = str(exc)
    note = written.message() if written else f"no checkpoint written: {refused}"
    if args.action_ == "export":
        with svc.sessions() as s:
            _write_bundle(cp.export(s), args.output, out)
        (out if args.output else sys.stderr).write(result.message() + "\n" + note + "\n")
        if not result.ok:
            raise AuditBroken(result.message(), hint="the bundle was written anyway, for whoever investigates")
        return 0
    if args.json:
        dump_json(out, {**result.to_json(), "checkpoint": written.to_json() if written else None,
                        **({} if written else {"checkpoint_error": refused})})
    else:
        out.write(result.message() + "\n" + note + "\n")
    return 0 if result.ok else AuditBroken.exit_code


def _write_bundle(bundle: dict[str, Any], path: str | None, out: TextIO) -> None:
    import json

    text = json.dumps(bundle, indent=1, ensure_ascii=False) + "\n"
    if not path:
        out.write(text)
        return
    from vgpumgr.userinput import files

    files.write(path, text.encode("utf-8"), what="--output", mode=0o600)  # nothing half-written, nothing beside
