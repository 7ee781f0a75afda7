"""Placement, records, licences, audit, reconcile, database, MIG and the vGPU scheduler."""

from __future__ import annotations

import argparse
import sys
from datetime import date, datetime
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.cli.vm import _policy_args, policy_from, service
from vgpumgr.errors import InvalidInput


def register(sub: Any, cmd: Any, group: Any) -> None:
    p = cmd(sub, ("place",), "vgpumgr.cli.records:place", "show where a vGPU would go, changing nothing")
    p.add_argument("--type", required=True, metavar="TYPE")
    p.add_argument("--vm", metavar="NAME", help="the VM it is for (one vGPU per physical GPU per VM)")
    _policy_args(p)
    p.add_argument("--explain", action="store_true", help="why each other candidate was refused")
    p.add_argument("--json", action="store_true")

    p = cmd(sub, ("vgpu",), "vgpumgr.cli.records:vgpu_create", "place and create one vGPU (recorded, audited)")
    p.add_argument("--type", required=True, metavar="TYPE")
    p.add_argument("--vm", metavar="NAME")
    p.add_argument("--uuid", metavar="UUID", help="mdev UUID to use")
    p.add_argument("--idempotency-key", metavar="KEY", help="a retry with the same key gets the same vGPU")
    _policy_args(p)
    p.add_argument("--json", action="store_true")
    p = cmd(sub, ("release",), "vgpumgr.cli.records:release", "remove a recorded vGPU and release its seat")
    p.add_argument("ref", metavar="UUID|BDF")
    p.add_argument("--grace", type=float, default=0.0, metavar="S")

    p = cmd(sub, ("placements",), "vgpumgr.cli.records:placements", "list vGPU allocations (records)")
    p.add_argument("--vm", metavar="NAME")
    p.add_argument("--gpu", metavar="BDF")
    p.add_argument("--state", choices=("reserved", "active", "released"))
    p.add_argument("--all", action="store_true", help="include released allocations")
    p.add_argument("--json", action="store_true")

    lic = group("license", "NVIDIA vGPU licence pools and seats (also spelt `licence`)", aliases=("licence",))
    p = cmd(lic, ("license", "add"), "vgpumgr.cli.records:licence_add", "add a licence pool")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--edition", required=True, help="vApps, vPC, vCS or vWS")
    p.add_argument("--seats", required=True, type=int)
    p.add_argument("--unit", choices=("vm", "gpu"), default="vm", help="a seat per VM or per physical GPU")
    p.add_argument("--expires", metavar="YYYY-MM-DD")
    p = cmd(lic, ("license", "list"), "vgpumgr.cli.records:licence_list", "list pools")
    p.add_argument("--json", action="store_true")
    p = cmd(lic, ("license", "usage"), "vgpumgr.cli.records:licence_usage", "seats used and free, and who holds them")
    p.add_argument("--json", action="store_true")
    p = cmd(lic, ("license", "remove"), "vgpumgr.cli.records:licence_remove", "remove a pool with no seats in use")
    p.add_argument("name", metavar="NAME")

    p = cmd(sub, ("audit",), "vgpumgr.cli.records:audit_list", "the audit trail (append-only, hash-chained)")
    p.add_argument("action_", nargs="?", choices=("list", "verify"), default="list", metavar="list|verify")
    p.add_argument("--vm", metavar="NAME")
    p.add_argument("--gpu", metavar="BDF")
    p.add_argument("--since", metavar="TIME", help="ISO date or time (UTC)")
    p.add_argument("--until", metavar="TIME")
    p.add_argument("--limit", type=int)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--csv", action="store_true")

    p = cmd(sub, ("reconcile",), "vgpumgr.cli.records:reconcile", "compare records with the host's devices")
    p.add_argument("--fix", action="store_true", help="re-create recorded vGPUs that vanished, with their UUIDs")
    p.add_argument("--remove-unknown", action="store_true", help="with --fix: remove devices nobody recorded")
    p.add_argument("--json", action="store_true")

    db = group("db", "the database")
    cmd(db, ("db", "upgrade"), "vgpumgr.cli.records:db_upgrade", "create or upgrade the schema")
    p = cmd(db, ("db", "downgrade"), "vgpumgr.cli.records:db_downgrade", "downgrade the schema")
    p.add_argument("revision", help="target revision, or 'base'")
    cmd(db, ("db", "current"), "vgpumgr.cli.records:db_current", "print the schema revision")

    mig = group("mig", "MIG GPU instances (through NVML)")
    p = cmd(mig, ("mig", "list"), "vgpumgr.cli.records:mig_list", "MIG mode, profiles and GPU instances")
    p.add_argument("--json", action="store_true")
    p = cmd(mig, ("mig", "plan"), "vgpumgr.cli.records:mig_plan", "where a profile would go (or why not)")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("profile", nargs="+", metavar="PROFILE", help="one or more profiles: a layout to check")
    p = cmd(mig, ("mig", "create"), "vgpumgr.cli.records:mig_create", "create a GPU instance")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("profile", metavar="PROFILE")
    p.add_argument("--start", type=int, help="explicit placement start slice")
    p.add_argument("--compute-instance", action="store_true")
    p = cmd(mig, ("mig", "destroy"), "vgpumgr.cli.records:mig_destroy", "destroy a GPU instance")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("gi", type=int, metavar="GI_ID")
    p = cmd(mig, ("mig", "mode"), "vgpumgr.cli.records:mig_mode", "enable or disable MIG mode (reports pending)")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("state", choices=("on", "off"))

    sch = group("scheduler", "vGPU time-slice scheduler (through NVML)")
    p = cmd(sch, ("scheduler", "show"), "vgpumgr.cli.records:scheduler_show", "scheduler state of a GPU")
    p.add_argument("gpu", metavar="BDF")
    p = cmd(sch, ("scheduler", "set"), "vgpumgr.cli.records:scheduler_set", "set a GPU's scheduler")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("policy", choices=("best-effort", "equal-share", "fixed-share"))
    p.add_argument("--timeslice-ns", type=int)


def _ref(a: dict[str, Any]) -> str:
    return a.get("uuid") or a.get("pci_address") or "-"


def place(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.errors import NoCapacity
    from vgpumgr.placement import explain_text

    d = service(args).place(args.type, args.vm, policy_from(args))
    if args.json:
        dump_json(out, d.as_dict())
    elif args.explain:
        out.write(explain_text(d) + "\n")
    elif d.choice:
        c = d.choice
        out.write(f"{c.name or c.type} ({c.type}) would go on {c.parent} (GPU {c.gpu or '-'}, {c.backend})\n")
    if d.choice is None:
        if not args.explain and not args.json:
            raise NoCapacity(f"no GPU can take {args.type} now: {d.summary()}", hint="add --explain for the reasons")
        return NoCapacity.exit_code
    return 0


def vgpu_create(args: argparse.Namespace, out: TextIO) -> int:
    a = service(args).allocate(args.type, vm=args.vm, policy=policy_from(args), uuid=args.uuid,
                               idempotency_key=args.idempotency_key)
    if args.json:
        dump_json(out, a)
    else:
        out.write(f"created {a['type_name']} {_ref(a)} on {a['parent']} (GPU {a['gpu']}) for VM {a['vm'] or '-'}\n")
    return 0


def release(args: argparse.Namespace, out: TextIO) -> int:
    a = service(args).release(args.ref, grace=args.grace)
    out.write(f"released {_ref(a)} ({a['type_name'] or a['type']})\n")
    return 0


def placements(args: argparse.Namespace, out: TextIO) -> int:
    rows = service(args).allocations(vm=args.vm, gpu=args.gpu, state=args.state,
                                     live=None if (args.all or args.state) else True)
    if args.json:
        dump_json(out, rows)
        return 0
    table(out, ["ID", "VGPU", "TYPE", "BACKEND", "PARENT", "GPU", "VM", "STATE", "LICENCE", "CREATED"],
          [[a["id"], _ref(a), a["type_name"] or a["type"], a["backend"], a["parent"], a["gpu"], a["vm"], a["state"],
            a["licence"], (a["created_at"] or "")[:19]] for a in rows], empty="no allocations")
    return 0


def licence_add(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import audit, licensing

    expires = _date(args.expires) if args.expires else None
    svc = service(args)
    with svc.tx() as s:
        pool = licensing.add_pool(s, name=args.name, edition_name=args.edition, seats=args.seats, unit=args.unit,
                                  expires=expires)
        svc.event(s, audit.LICENCE_POOL_ADD, detail={"pool": pool.name, "edition": pool.edition,
                                                    "seats": pool.seats, "unit": pool.unit, "expires": args.expires})
        out.write(f"licence pool {pool.name}: {pool.seats} {pool.edition} seats per {pool.unit}"
                  f"{', expires ' + args.expires if args.expires else ''}\n")
    return 0


def licence_list(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import licensing

    svc = service(args)
    with svc.sessions() as s:
        pools = [u for e in licensing.usage(s) for u in e.pools]
        if args.json:
            dump_json(out, [p.to_json() for p in pools])
            return 0
        table(out, ["POOL", "EDITION", "UNIT", "SEATS", "USED", "FREE", "EXPIRES"],
              [[p.name, p.edition, p.unit, p.seats, p.used, p.free,
                (p.expires.isoformat() if p.expires else "-") + (" (expired)" if p.expired else "")] for p in pools],
              empty="no licence pools (add one with `vgpumgr license add`)")
    return 0


def licence_usage(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import licensing

    svc = service(args)
    with svc.sessions() as s:
        usage = licensing.usage(s)
        if args.json:
            dump_json(out, [e.to_json() for e in usage])
            return 0
        table(out, ["EDITION", "SEATS", "USED", "FREE"], [[e.edition, e.seats, e.used, e.free] for e in usage],
              empty="no licence pools")
        holders = [h for e in usage for h in e.holders]
        if holders:
            out.write("\n")
            table(out, ["EDITION", "POOL", "VM", "GPU", "HOST", "SINCE"],
                  [[h.edition, h.pool, h.vm, h.gpu, h.host, h.since.isoformat()[:19]] for h in holders])
    out.write(f"licence mode: {svc.licence_mode} (VGPUMGR_LICENCE_MODE)\n" if not args.json else "")
    return 0


def licence_remove(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import audit, licensing

    svc = service(args)
    with svc.tx() as s:
        licensing.remove_pool(s, args.name)
        svc.event(s, audit.LICENCE_POOL_REMOVE, detail={"pool": args.name})
    out.write(f"licence pool {args.name} removed\n")
    return 0


def _date(text: str) -> date:
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
    from vgpumgr import audit

    svc = service(args)
    with svc.sessions() as s:
        if args.action_ == "verify":
            result = audit.verify(s)
            if args.json:
                dump_json(out, result.to_json())
            else:
                out.write(result.message() + "\n")
            return 0 if result.ok else 9
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


def reconcile(args: argparse.Namespace, out: TextIO) -> int:
    if args.remove_unknown and not args.fix:
        raise InvalidInput("--remove-unknown only works with --fix", hint="add --fix")
    r = service(args).reconcile(fix=args.fix, remove_unknown=args.remove_unknown)
    if args.json:
        dump_json(out, {k: v for k, v in r.items() if k != "missing_detail"})
    else:
        out.write(f"recorded vGPUs missing on the host: {len(r['missing'])}\n")
        for a in r["missing_detail"]:
            out.write(f"  {_ref(a)}  {a['type_name'] or a['type']} on {a['parent']} (VM {a['vm'] or '-'})\n")
        out.write(f"devices nobody recorded: {len(r['unknown'])}\n")
        for u in r["unknown"]:
            out.write(f"  {u.get('uuid') or u.get('address')}  {u.get('type')} on {u.get('parent') or u.get('gpu')}\n")
        if args.fix:
            out.write(f"restored: {', '.join(r['restored']) or 'none'}; removed: {', '.join(r['removed']) or 'none'}\n")
        for e in r["errors"]:
            out.write(f"  error: {e}\n")
    if r["errors"]:
        return 1
    return 0 if (args.fix or not (r["missing"] or r["unknown"])) else 10


def db_upgrade(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.devices import config
    from vgpumgr.db.session import current_revision, upgrade

    cfg = config(args)
    upgrade(cfg.db_url)
    out.write(f"database at revision {current_revision(cfg.db_url)}\n")
    return 0


def db_downgrade(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.devices import config
    from vgpumgr.db.session import current_revision, downgrade

    cfg = config(args)
    downgrade(cfg.db_url, args.revision)
    out.write(f"database at revision {current_revision(cfg.db_url) or 'base (empty)'}\n")
    return 0


def db_current(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.devices import config
    from vgpumgr.db.session import current_revision

    out.write(f"{current_revision(config(args).db_url) or 'base (empty)'}\n")
    return 0


def _layer(args: argparse.Namespace):  # noqa: ANN202
    from vgpumgr.cli.devices import config
    from vgpumgr.errors import Unavailable
    from vgpumgr.nvml_facts import nvml_layer

    cfg = config(args)
    layer = nvml_layer(cfg)
    if layer is None or not layer.open():
        raise Unavailable(getattr(layer, "notice", None) or "NVML is not available for this root",
                          hint="MIG and scheduler commands need NVIDIA's NVML (or a simulated host with one)")
    return cfg, layer


def _audited(args: argparse.Namespace, action: str, gpu: str, detail: dict[str, Any]) -> None:
    from vgpumgr.cli.devices import _audit, config

    _audit(config(args), action, gpu=gpu, detail=detail)


def _sync(cfg: Any, layer: Any) -> None:
    cfg.host.kernel.gpu_instances_changed(layer)


def _boot_record(cfg: Any, what: str, *args: Any) -> None:
    """Keep what `vgpumgr restore` brings back after a reboot in step with a manual MIG change."""
    from vgpumgr.ops import boot_records

    boot_records.note(cfg, getattr(boot_records, what), *args)


def mig_list(args: argparse.Namespace, out: TextIO) -> int:
    _, layer = _layer(args)
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
    from vgpumgr import ids, mig

    _, layer = _layer(args)
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
    from vgpumgr import ids

    cfg, layer = _layer(args)
    gpu = ids.pci_address(args.gpu)
    res = layer.create_gpu_instance(gpu, args.profile, start=args.start, compute_instance=args.compute_instance)
    _sync(cfg, layer)
    _audited(args, "mig.gi.create", gpu, res)
    _boot_record(cfg, "remember_gpu_instance", gpu, res)
    dump_json(out, res)
    return 0


def mig_destroy(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import ids

    cfg, layer = _layer(args)
    gpu = ids.pci_address(args.gpu)
    res = layer.destroy_gpu_instance(gpu, args.gi)
    _sync(cfg, layer)
    _audited(args, "mig.gi.destroy", gpu, res)
    _boot_record(cfg, "forget_gpu_instance", gpu, res["start"])
    dump_json(out, res)
    return 0


def mig_mode(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import ids

    cfg, layer = _layer(args)
    gpu = ids.pci_address(args.gpu)
    res = layer.set_mig_mode(gpu, args.state == "on")
    _sync(cfg, layer)
    _audited(args, "mig.mode", gpu, res)
    _boot_record(cfg, "remember_mig_mode", gpu, args.state == "on")
    dump_json(out, res)
    if res.get("pending") != res.get("current"):
        sys.stderr.write("note: the change is pending until the GPU is reset\n")
    return 0


def scheduler_show(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import ids

    _, layer = _layer(args)
    dump_json(out, layer.scheduler(ids.pci_address(args.gpu)))
    return 0


def scheduler_set(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import ids

    _, layer = _layer(args)
    gpu = ids.pci_address(args.gpu)
    res = layer.set_scheduler(gpu, args.policy, timeslice_ns=args.timeslice_ns)
    _audited(args, "vgpu.scheduler", gpu, res)
    dump_json(out, res)
    return 0
