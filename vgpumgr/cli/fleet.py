"""`vgpumgr host cordon|uncordon|drain|show` and `vgpumgr fleet hosts|gpus|capacity|place|compact|publish`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.userinput.numbers import integer


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
    p = cmd(host, ("host", "drain"), "vgpumgr.cli.migrate:drain",
            "cordon this host and live-migrate every running vGPU VM away, one at a time")
    p.add_argument("--to", action="append", default=[], metavar="URI",
                   help="a destination's libvirt URI; repeat it: each VM goes to the first that can take it "
                        "(none: the fleet chooses for each VM, as `fleet place --vm` does)")
    p.add_argument("--to-api", action="append", default=[], metavar="URL",
                   help="the vgpumgr service of the --to of the same position, for its preflight")
    p.add_argument("--to-token-file", action="append", default=[], metavar="FILE",
                   help="a token of the --to-api of the same position (one file: for all; or $VGPUMGR_TO_TOKEN)")
    p.add_argument("--reason", metavar="R", help="why the host is drained (the cordon's reason)")
    p.add_argument("--json", action="store_true")
    p = cmd(host, ("host", "show"), "vgpumgr.cli.fleet:show", "whether a host is cordoned, and why")
    p.add_argument("host", nargs="?", metavar="HOST", help="the host (default: this one)")
    p.add_argument("--json", action="store_true")

    fleet = group("fleet", "every host sharing this database (VGPUMGR_DB): what they published, and where a "
                           "vGPU should go")
    p = cmd(fleet, ("fleet", "hosts"), "vgpumgr.cli.fleet:hosts",
            "the hosts, their heartbeat (stale when older than their window) and cordon")
    p.add_argument("--json", action="store_true")
    p = cmd(fleet, ("fleet", "gpus"), "vgpumgr.cli.fleet:gpus", "the hosts' GPUs: model, board, driver, mode")
    p.add_argument("--host", metavar="HOST", help="only this host")
    p.add_argument("--type", metavar="TYPE", help="only GPUs offering this vGPU type, with its free instances")
    p.add_argument("--json", action="store_true")
    p = cmd(fleet, ("fleet", "capacity"), "vgpumgr.cli.fleet:capacity",
            "free and used vGPUs per type across the fleet, or per host for one type")
    p.add_argument("--type", metavar="TYPE", help="per host, for this vGPU type (L40S-4Q)")
    p.add_argument("--json", action="store_true")
    p = cmd(fleet, ("fleet", "place"), "vgpumgr.cli.fleet:place",
            "which host should take a vGPU, and why not the others (changes nothing: the chosen host's own "
            "service allocates, and its placement decides)")
    p.add_argument("--type", required=True, metavar="TYPE")
    p.add_argument("--vm", metavar="NAME", help="the VM it is for; a VM with vGPUs on another host is being "
                                                "moved: NVIDIA's live-migration rules then apply")
    p.add_argument("--count", type=integer(1, 64, "--count"), default=1, metavar="N",
                   help="vGPUs of the type for the VM (one per GPU)")
    p.add_argument("--policy", choices=("pack", "spread"), default="pack",
                   help="pack: best fit, the host whose fullest GPU with room has the least framebuffer left; "
                        "spread: the most free instances")
    p.add_argument("--allow-model", action="append", default=[], metavar="MODEL")
    p.add_argument("--deny-model", action="append", default=[], metavar="MODEL")
    p.add_argument("--explain", action="store_true",
                   help="every host, ranked or with the reason it was not chosen (a fleet of over 200 hosts "
                        "otherwise gets its best 5 and the others counted by reason)")
    p.add_argument("--json", action="store_true")
    p = cmd(fleet, ("fleet", "compact"), "vgpumgr.cli.fleet:compact",
            "the fewest live migrations across the fleet that free a placement of TYPE on some host (plan; "
            "--apply runs it on the host whose GPU is freed, one VM at a time through `vm migrate`)")
    p.add_argument("--for", dest="type", required=True, metavar="TYPE")
    p.add_argument("--apply", action="store_true", help="migrate the planned VMs, stopping at the first failure")
    p.add_argument("--max-moves", type=integer(1, 64, "--max-moves"), default=8, metavar="N",
                   help="plans of at most N migrations (8)")
    p.add_argument("--per-host", type=integer(1, 64, "--per-host"), default=2, metavar="N",
                   help="at most N of the plan's migrations into any one host (2)")
    p.add_argument("--json", action="store_true")
    p = cmd(fleet, ("fleet", "publish"), "vgpumgr.cli.fleet:publish",
            "publish this host now, all of it (what `vgpumgr serve` does at start and on every heartbeat)")
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


# -- the fleet ----------------------------------------------------------------------------------------------

def _state(r: dict[str, Any]) -> str:
    return "stale" if r["stale"] else "cordoned" if r["cordoned"] else "ok"


def hosts(args: argparse.Namespace, out: TextIO) -> int:
    rows = service(args).fleet_hosts()
    if args.json:
        dump_json(out, rows)
        return 0
    table(out, ["HOST", "STATE", "HEARTBEAT", "GPUS", "VGPUS", "DRIVER", "VGPUMGR", "ENDPOINT", "CORDON"],
          [[r["host"], _state(r), f"{r['heartbeat_age_s']:.0f}s ago (window {r['stale_after_s']:g}s)", r["gpus"],
            r["vgpus"], r["driver_version"], r["vgpumgr_version"], r["endpoint"],
            r["cordon_reason"] if r["cordoned"] else None]
           for r in rows], empty="no host has published yet (hosts publish while `vgpumgr serve` runs there)")
    return 0


def gpus(args: argparse.Namespace, out: TextIO) -> int:
    rows = service(args).fleet_gpus(args.host, args.type)
    if args.json:
        dump_json(out, rows)
        return 0
    head = ["HOST", "GPU", "MODEL", "PCI ID", "SUBSYSTEM", "DRIVER", "MODE", "NUMA", "VGPUS"]
    if args.type:
        table(out, [*head, "FREE", "USED", "MAX", "STATE"],
              [[r["host"], r["address"], r["model"], r["pci_id"], r["subsystem_id"], r["driver_version"], r["mode"],
                r["numa_node"], r["vgpus"], r["free"], r["used"], r["max"], _state(r)] for r in rows],
              empty=f"no published GPU offers {args.type}")
    else:
        table(out, [*head, "TYPES (FREE)", "STATE"],
              [[r["host"], r["address"], r["model"], r["pci_id"], r["subsystem_id"], r["driver_version"], r["mode"],
                r["numa_node"], r["vgpus"], f"{r['types']} ({r['types_free']})", _state(r)] for r in rows],
              empty="no GPU published")
    return 0


def capacity(args: argparse.Namespace, out: TextIO) -> int:
    r = service(args).fleet_capacity(args.type)
    if args.json:
        dump_json(out, r)
        return 0
    if args.type is None:
        table(out, ["TYPE", "HOSTS", "GPUS", "FREE", "USED"],
              [[t["type"], t["hosts"], t["gpus"], t["free"], t["used"]] for t in r["types"]],
              empty="no host has published yet")
        return 0
    table(out, ["HOST", "GPUS", "GPUS FREE", "FREE", "USED", "STATE"],
          [[h["host"], h["gpus"], h["gpus_free"], h["free"], h["used"], _state(h)] for h in r["hosts"]],
          empty=f"no host offers {args.type}")
    out.write(f"{r['type']}: {r['free']} free on hosts that can be chosen"
              f" ({r['free_including_unplaceable']} counting stale and cordoned hosts)\n")
    return 0


def place(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.errors import NoCapacity
    from vgpumgr.fleet.place import FleetRequest

    req = FleetRequest(args.type, vm=args.vm, count=args.count, strategy=args.policy,
                       allow_models=tuple(args.allow_model), deny_models=tuple(args.deny_model))
    d = service(args).fleet_place(req, every_host=args.explain)
    if args.json:
        dump_json(out, d.as_dict())
    elif args.explain:
        out.write(explain(d))
    elif d.choice:
        c = d.choice
        out.write(f"{req.count} x {req.type}{f' for VM {req.vm}' if req.vm else ''} would go to host {c.host} "
                  f"(GPU {', '.join(c.gpus)}; {c.endpoint or 'no endpoint published'}): {c.why}\n")
    if d.choice is None:
        if not (args.explain or args.json):
            raise NoCapacity(f"no host can take {req.type} now: {d.summary()}",
                             hint=(_compact_hint(d) + "; " if d.compact else "") + "add --explain for every host")
        return NoCapacity.exit_code
    return 0


def explain(d: Any) -> str:
    req = d.request
    head = f"fleet placement of {req.count} x {req.type}" + (f" for VM {req.vm}" if req.vm else "")
    if d.migrating:
        head += f" (moving from {d.migrating.host}: same board and vGPU manager needed)"
    lines = [f"{head} (policy: {req.strategy}): {d.considered} host(s) considered"]
    if d.choice is None:
        lines.append("no host can take it now")
    rows = [["chosen" if i == 0 else f"fits, ranked {i + 1}", c.host, ",".join(c.gpus), c.why]
            for i, c in enumerate(d.ranked)]
    rows += [[r.code, r.host, "-", r.reason] for r in d.rejected]
    import io

    buf = io.StringIO()
    table(buf, ["RESULT", "HOST", "GPUS", "WHY"], rows, empty="no host has published yet")
    return "\n".join(lines) + "\n" + buf.getvalue() + (f"hint: {_compact_hint(d)}\n" if d.compact else "")


def _compact_hint(d: Any) -> str:
    from vgpumgr.fleet.fragmented import hint

    return hint(d.compact)


def compact(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import fleet_compact

    svc = service(args)
    plan = fleet_compact.plan(svc, args.type, max_moves=args.max_moves, per_host=args.per_host)
    if args.apply:
        plan = fleet_compact.apply(svc, plan)
    if args.json:
        dump_json(out, plan)
    else:
        out.write(fleet_compact.text(plan))
    err = fleet_compact.failure(plan)
    if err is not None:
        raise err  # after the output: what was moved is shown, the error says what stopped it
    return 0


def publish(args: argparse.Namespace, out: TextIO) -> int:
    r = service(args).publish_fleet()
    if args.json:
        dump_json(out, r)
    elif r["busy"]:
        out.write(f"host {r['host']}: the host lock stayed taken; only its heartbeat was written\n")
    else:
        out.write(f"host {r['host']} published: {r['gpus_written']} GPU(s) in {r['ms']:.1f} ms\n")
    return 0
