"""`vgpumgr db ...` (schema, backups) and `vgpumgr upgrade check` (rolling upgrades: README, 'Upgrading')."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json
from vgpumgr.errors import Conflict, InvalidInput


def register(sub: Any, cmd: Any, group: Any) -> None:
    db = group("db", "the database: schema, backups")
    p = cmd(db, ("db", "upgrade"), "vgpumgr.cli.dbadmin:db_upgrade",
            "create or upgrade the schema: expand steps (old hosts keep working); contract steps with --contract")
    p.add_argument("--contract", action="store_true",
                   help="also apply contract steps (removals), refused while a live host runs code that needs them")
    p.add_argument("--ignore-host", action="append", default=[], metavar="HOST",
                   help="with --contract: a retired host whose recorded version does not count (repeat)")
    p.add_argument("--dry-run", action="store_true", help="say what would be applied, change nothing")
    p.add_argument("--json", action="store_true")
    p = cmd(db, ("db", "downgrade"), "vgpumgr.cli.dbadmin:db_downgrade",
            "take the schema back to an earlier revision of this vgpumgr (drops what later steps added: a backup "
            "is taken first, and the loss must be confirmed with --yes-destroy-data)")
    p.add_argument("revision", metavar="REVISION",
                   help="a revision of this vgpumgr (`vgpumgr db current --json` shows the database's), or base")
    p.add_argument("--yes-destroy-data", action="store_true",
                   help="go ahead: drop the tables and columns the undone steps added, with their rows")
    p.add_argument("--backup", metavar="FILE", help="SQLite: where the backup goes (default: beside the database, "
                                                    "<db>.before-downgrade-<revision>-<time>)")
    p.add_argument("--no-backup", action="store_true",
                   help="PostgreSQL: confirm that you took a backup yourself (pg_dump); vgpumgr cannot take one")
    p.add_argument("--dry-run", action="store_true", help="say what would be dropped, change nothing")
    p.add_argument("--json", action="store_true")
    p = cmd(db, ("db", "current"), "vgpumgr.cli.dbadmin:db_current",
            "print the schema revision (--json: contract level, this code's revision, compatibility)")
    p.add_argument("--json", action="store_true")
    p = cmd(db, ("db", "backup"), "vgpumgr.cli.dbadmin:db_backup",
            "copy the SQLite database consistently (online backup API), audit chain verified")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.add_argument("--json", action="store_true")
    p = cmd(db, ("db", "restore"), "vgpumgr.cli.dbadmin:db_restore",
            "replace the SQLite database with a backup (its audit chain verified first; the old one kept)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--force", action="store_true", help="restore even if the backup's audit chain does not verify")
    p.add_argument("--dry-run", action="store_true",
                   help="only compare the backup with the host (devices, VMs, seats), change nothing")
    p.add_argument("--json", action="store_true")

    up = group("upgrade", "rolling upgrades of vgpumgr")
    p = cmd(up, ("upgrade", "check"), "vgpumgr.cli.dbadmin:upgrade_check",
            "run by the newly installed release before its restart: what the upgrade does, what would break "
            "(exit 10)")
    p.add_argument("--kernel", metavar="RELEASE", help="the kernel the host will boot (default: newest in /boot)")
    p.add_argument("--driver", metavar="VERSION", help="the NVIDIA host driver it will load")
    p.add_argument("--json", action="store_true")


def _cfg(args: argparse.Namespace) -> Any:
    from vgpumgr.cli.devices import config

    return config(args)


def db_upgrade(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.db import admin
    from vgpumgr.db.schema import who
    from vgpumgr.ops.context import hostname

    cfg = _cfg(args)
    plan = admin.upgrade(cfg.db_url, contract=args.contract, ignore=frozenset(args.ignore_host), me=hostname(),
                         dry_run=args.dry_run)
    refused = args.contract and bool(plan.blockers)  # asked for the contract steps and did not get them
    if args.json:
        dump_json(out, {**plan.as_dict(), "dry_run": args.dry_run})
        return 4 if refused else 0
    verb = "would apply" if args.dry_run else "applied"
    for step in plan.apply:
        out.write(f"{verb} {step.revision} ({step.phase}): {step.doc}\n")
    for step in plan.held:
        old = plan.blockers.get(step.revision)
        why = (f"hosts still run code that needs it: {who(old)}" if old else
               "contract step: run `vgpumgr db upgrade --contract` once every host runs this release"
               if step.phase == "contract" else "after the contract step before it")
        out.write(f"held back {step.revision} ({step.phase}): {why}\n")
    if plan.ahead:
        out.write(f"the database is newer than this vgpumgr ({plan.current}); it still serves this release\n")
    revision = plan.target if not args.dry_run else plan.current
    out.write(f"database at revision {revision or 'base (empty)'}\n")
    if refused:
        raise Conflict("contract step(s) refused: live hosts run vgpumgr code that needs what they remove",
                       hint="upgrade those hosts first (or, for a host that is retired, --ignore-host NAME); "
                            "`vgpumgr upgrade check` lists the hosts and their versions")
    return 0


def db_downgrade(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.db import admin
    from vgpumgr.db.models import utcnow
    from vgpumgr.db.session import get_engine
    from vgpumgr.ops.context import hostname

    cfg = _cfg(args)
    plan = admin.downgrade_plan(cfg.db_url, args.revision)  # an unknown revision: exit 2, nothing changed
    lost = ", ".join(f"{t} ({n} rows)" for t, n in plan.dropped.items()) or "no table (columns and indexes only)"
    if not plan.steps:
        out.write(f"the database is already at revision {plan.current}; nothing to do\n")
        return 0
    if args.dry_run or not args.yes_destroy_data:
        if args.json:
            dump_json(out, plan.as_dict())
        else:
            out.write(f"db downgrade {plan.current} -> {plan.target} would undo "
                      f"{', '.join(s.revision for s in plan.steps)} and drop {lost}\n")
        if args.dry_run:
            return 0
        raise InvalidInput("db downgrade destroys data; nothing was changed",
                           hint="add --yes-destroy-data to go ahead (SQLite: a backup is taken first)")
    sqlite = get_engine(cfg.db_url).dialect.name == "sqlite"
    if not sqlite and not args.no_backup:
        raise InvalidInput("vgpumgr cannot back up a PostgreSQL database; nothing was changed",
                           hint="take one (pg_dump --format=custom --file FILE URL), then add --no-backup")
    dest = None
    if sqlite:
        db = Path(get_engine(cfg.db_url).url.database or "")
        stamp = utcnow().strftime("%Y%m%dT%H%M%SZ")
        dest = Path(args.backup) if args.backup else db.with_name(f"{db.name}.before-downgrade-{plan.current}-{stamp}")
    plan = admin.downgrade(cfg.db_url, plan, backup_to=dest, actor=cfg.actor, host=hostname())
    if args.json:
        dump_json(out, plan.as_dict())
        return 0
    out.write(f"database at revision {plan.target if plan.target != admin.BASE else 'base (empty)'}; dropped {lost}\n")
    if plan.backup:
        out.write(f"the database as it was is in {plan.backup} (`vgpumgr db restore` takes it back)\n")
    if plan.audit_events is not None:
        out.write(f"the audit trail ({plan.audit_events} events) was dropped with it"
                  + (f"; it is kept in {plan.backup}\n" if plan.backup else "\n"))
    return 0


def db_current(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.db import admin

    cur = admin.current(_cfg(args).db_url)
    if args.json:
        dump_json(out, cur.as_dict())
        return 0
    out.write(f"{cur.revision or 'base (empty)'}\n")
    return 0


def db_backup(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.db import admin

    copy = admin.backup(_cfg(args).db_url, Path(args.file), force=args.force)
    if args.json:
        dump_json(out, copy.as_dict())
        return 0
    out.write(f"backup written: {copy.path} ({copy.size // 1024} KiB, schema {copy.revision}, "
              f"{copy.events} audit events, chain verified to event {copy.head_seq})\n")
    return 0


def db_restore(args: argparse.Namespace, out: TextIO) -> int:
    """The backup compared with the host first; then the restore, and its signed record in the checkpoint file
    (vgpumgr.audit.restore) that `audit verify` reads; should the record fail, the restore is undone."""
    from vgpumgr.audit.checkpoints import Checkpointer
    from vgpumgr.db import admin
    from vgpumgr.db.session import get_engine
    from vgpumgr.hostfs.locking import host_lock
    from vgpumgr.ops import backup_diff
    from vgpumgr.ops.context import hostname
    from vgpumgr.userinput import files

    cfg, written = _cfg(args), []
    source = files.regular(args.file, "db restore", hint="name the backup file written by `vgpumgr db backup`")

    def record(kept: Path) -> None:
        cp = Checkpointer.from_env(cfg.state_dir, hostname(), simulated=cfg.host.simulated)
        written.append(cp.write_restore(get_engine(cfg.db_url), source, kept))

    with host_lock(cfg.state_dir / "vgpumgr.lock", timeout=30):
        diff = backup_diff.compare(cfg, hostname(), source, admin._sqlite_path(cfg.db_url, "restore"))
        if not args.json:
            out.write(backup_diff.text(diff, source))
        if args.dry_run:
            if args.json:
                dump_json(out, {"dry_run": True, "host_diff": diff})
            return 0
        copy, kept = admin.restore(cfg.db_url, source, force=args.force, record=record)
    if args.json:
        dump_json(out, {**copy.as_dict(), "previous": str(kept), "host_diff": diff,
                        "checkpoint": written[0].to_json(), "dry_run": False})
        return 0
    chain = (f"audit chain verified to event {copy.head_seq}" if copy.events >= 0 else
             "audit chain NOT verified (--force)")
    r = written[0].record
    out.write(f"restored {copy.path} (schema {copy.revision}, {chain}); the database it replaced is {kept}\n"
              f"audit: the restore is signed checkpoint {r['n']}: the chain now ends at event {r['seq']}, the "
              f"events after it (to {r['restore']['kept_seq']}) are kept in {kept}\n"
              "restart vgpumgr.service so that the service reads the restored records; `vgpumgr reconcile` then "
              "settles the differences listed above\n")
    return 0


def _guest_rule(args: argparse.Namespace) -> Any:
    """NVIDIA's guest/host driver window (ops.guest_check), read once for the planned driver and asked per VM."""
    from vgpumgr.cli.vm import service
    from vgpumgr.ops import guest_check

    found: dict[str, list[dict[str, Any]]] = {}

    def rule(vm: str, planned: str) -> list[tuple[str, str, str]]:
        if not found:
            found["rows"] = guest_check.rows(service(args), planned)["vgpus"]
        return [("block", "guest", f"VM {vm}: guest driver {r['guest_driver']} on {r['gpu']}: {r['reason']}")
                for r in found["rows"] if r["vm"] == vm and r["accepted"] is False]

    return rule


def upgrade_check(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops.context import hostname
    from vgpumgr.ops.upgrade_check import check

    report = check(_cfg(args), hostname(), kernel=args.kernel, driver=args.driver,
                   guests=_guest_rule(args) if args.driver else None)
    if args.json:
        dump_json(out, report.as_dict())
        return 10 if report.blocked else 0
    s = report.schema
    out.write(f"host {report.host}: vgpumgr {report.version} (schema {s['code']}); database at "
              f"{s['database'] or 'no schema yet'} (contract level {s['contract_level']})\n")
    for f in report.findings:
        out.write(f"  {f.severity.upper():5}  {f.area:6}  {f.message}\n")
    out.write("upgrade blocked: fix the BLOCK findings first\n" if report.blocked else "nothing blocks the upgrade\n")
    return 10 if report.blocked else 0
