"""Placement, records, licences, reconcile and the database."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from vgpumgr.cli.audit import parse_date
from vgpumgr.cli.output import dump_json, table
from vgpumgr.cli.vm import _policy_args, policy_from, service
from vgpumgr.errors import InvalidInput
from vgpumgr.userinput.numbers import decimal, integer


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
    p.add_argument("--idempotency-key", metavar="KEY",
                   help="a retry of the same command with the same key gets the same vGPU (keys expire after "
                   "VGPUMGR_IDEMPOTENCY_TTL s, default 24 h)")
    _policy_args(p)
    p.add_argument("--json", action="store_true")
    p = cmd(sub, ("release",), "vgpumgr.cli.records:release", "remove a recorded vGPU and release its seat")
    p.add_argument("ref", metavar="UUID|BDF")
    p.add_argument("--grace", type=decimal(0, 600, "--grace"), default=0.0, metavar="S")

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
    p.add_argument("--seats", required=True, type=integer(0, 1_000_000, "--seats"))
    p.add_argument("--unit", choices=("vm", "gpu"), default="vm", help="a seat per VM or per physical GPU")
    p.add_argument("--expires", metavar="YYYY-MM-DD")
    p = cmd(lic, ("license", "list"), "vgpumgr.cli.records:licence_list", "list pools")
    p.add_argument("--json", action="store_true")
    p = cmd(lic, ("license", "usage"), "vgpumgr.cli.records:licence_usage", "seats used and free, and who holds them")
    p.add_argument("--json", action="store_true")
    p = cmd(lic, ("license", "remove"), "vgpumgr.cli.records:licence_remove", "remove a pool with no seats in use")
    p.add_argument("name", metavar="NAME")
    p = cmd(lic, ("license", "check"), "vgpumgr.cli.telemetry:licence_check",
            "compare the seat ledger with what each running guest reports (exit 10 on any finding)")
    p.add_argument("--json", action="store_true")
    from vgpumgr.cli import licence_token

    licence_token.register(lic, cmd)

    p = cmd(sub, ("reconcile",), "vgpumgr.cli.records:reconcile", "compare records with the host's devices")
    p.add_argument("--fix", action="store_true",
                   help="re-create recorded vGPUs that vanished, with their UUIDs; roll back dead reservations")
    p.add_argument("--remove-unknown", action="store_true", help="with --fix: remove devices nobody recorded")
    p.add_argument("--json", action="store_true")


def _ref(a: dict[str, Any]) -> str:
    return a.get("uuid") or a.get("pci_address") or "-"


def place(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.errors import NoCapacity
    from vgpumgr.placement.placer import explain_text

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
    from vgpumgr.cli.fleet import warn_if_cordoned

    svc, policy = service(args), policy_from(args)
    warn_if_cordoned(svc)

    def run(key: str | None) -> tuple[int, Any]:
        return 0, svc.allocate(args.type, vm=args.vm, policy=policy, uuid=args.uuid, idempotency_key=key)

    if args.idempotency_key is None:
        a = run(None)[1]
    else:  # the key is the CLI actor's, bound to these arguments
        import dataclasses

        from vgpumgr.ops.idempotency import fingerprint

        pol = {k: sorted(v) if isinstance(v, frozenset | tuple) else v for k, v in dataclasses.asdict(policy).items()}
        fp = fingerprint("CLI", "vgpu", {"type": args.type, "vm": args.vm, "uuid": args.uuid, "policy": pol})
        a = svc.run_once(caller=svc.cfg.actor, key=args.idempotency_key, fingerprint=fp, run=run)[1]
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
    from vgpumgr.audit import chain as audit
    from vgpumgr.licensing import seats as licensing

    expires = parse_date(args.expires) if args.expires else None
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
    from vgpumgr.licensing import seats as licensing

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
    from vgpumgr.licensing import seats as licensing

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
    from vgpumgr.audit import chain as audit
    from vgpumgr.licensing import seats as licensing

    svc = service(args)
    with svc.tx() as s:
        licensing.remove_pool(s, args.name)
        svc.event(s, audit.LICENCE_POOL_REMOVE, detail={"pool": args.name})
    out.write(f"licence pool {args.name} removed\n")
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
        out.write(f"dead reservations: {len(r['dead_reservations'])}\n")
        for d in r["dead_reservations"]:
            done = f" -> {d['action']}" if "action" in d else ""
            out.write(f"  {d['ref']}  {d['state']} for VM {d['vm'] or '-'}: {d['reason']}{done}\n")
        out.write(f"stale records (VM gone, its release never came): {len(r['stale_records'])}\n")
        for st in r["stale_records"]:
            _stale_line(out, st)
        if r.get("stale_unchecked"):
            out.write(f"  not checked: {r['stale_unchecked']}\n")
        out.write(f"devices nobody recorded: {len(r['unknown'])}\n")
        for u in r["unknown"]:
            out.write(f"  {u.get('uuid') or u.get('address')}  {u.get('type')} on {u.get('parent') or u.get('gpu')}\n")
        out.write(f"vGPU schedulers not as recorded: {len(r.get('scheduler_drift') or [])}\n")
        for d in r.get("scheduler_drift") or []:
            want = (d.get("recorded") or {}).get("policy")
            have = (d.get("actual") or {}).get("policy")
            out.write(f"  {d['gpu']}  recorded {want}, driver {have or '-'}: {d['why']}\n")
        modes = r.get("vgpu_mode_drift") or []
        if modes:
            out.write(f"vGPU modes not as recorded: {len(modes)}\n")
        for d in modes:
            out.write(f"  {d['gpu']}  recorded {d['recorded']}, driver {d['actual']}: {d['why']}\n")
        vendor = r.get("vendor_drift") or []
        if vendor:
            out.write(f"vendor steps not as recorded: {len(vendor)}\n")
        for d in vendor:
            now = d["actual"] or "unreadable"
            out.write(f"  {d['gpu']}  {d['step']}: recorded {d['recorded']}; {now}: {d['why']}\n")
        if args.fix:
            out.write(f"restored: {', '.join(r['restored']) or 'none'}; removed: {', '.join(r['removed']) or 'none'}\n")
        for e in r["errors"]:
            out.write(f"  error: {e}\n")
    if r["errors"]:
        return 1
    unfixed = r.get("vgpu_mode_drift") or r.get("vendor_drift")  # only `restore` sets these again
    differs = (r["missing"] or r["unknown"] or r["dead_reservations"] or r["stale_records"] or r.get("scheduler_drift")
               or unfixed)
    return 10 if unfixed or (differs and not args.fix) else 0


def _stale_line(out: TextIO, st: dict[str, Any]) -> None:
    ev = st["evidence"]
    done = ""
    if "action" in st:  # --fix
        why = st.get("why") or st.get("error")
        done = f" -> {st['action']}" + (f" ({why})" if why else "")
    out.write(f"  {st['vgpu']}  {st['type']} for VM {st['vm']} ({st['kind']}){done}\n")
    if st["kind"] == "proxmox" and "mdev" in ev:
        out.write(f"    {ev.get('qemu')}; mdev {ev['mdev']} (qemu-server removes it when the VM stops)\n")
    elif st["kind"] == "proxmox":
        out.write(f"    {ev.get('qemu')}; VF type {ev.get('vf_type')}; reservation: {ev.get('reservation') or 'none'}; "
                  f"held by: {', '.join(ev.get('holders') or []) or 'nobody'}\n")
    else:
        out.write(f"    {ev.get('domain')}; held by: {', '.join(ev.get('holders') or []) or 'nobody'}\n")
