"""`vgpumgr scheduler`: the vGPU time-slice scheduler per GPU as recorded intent (vgpumgr.ops.scheduler): show,
set, the driver's log, persist as RmPVMRL, check each VM's share of GPU time."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.userinput.numbers import decimal, integer


def register(sub: Any, cmd: Any, group: Any) -> None:
    sch = group("scheduler", "vGPU time-slice scheduler per GPU: recorded, applied, persisted, measured")
    p = cmd(sch, ("scheduler", "show"), "vgpumgr.cli.scheduler:show",
            "what the driver has (capabilities, state per engine; with MIG on per GPU instance) and what is recorded")
    p.add_argument("gpu", metavar="BDF", nargs="?", help="one GPU, as JSON (default: every GPU, as a table)")
    p.add_argument("--json", action="store_true")
    p = cmd(sch, ("scheduler", "set"), "vgpumgr.cli.scheduler:set_",
            "record a GPU's scheduler; applied now when the GPU holds no vGPU, else when it is empty or at boot")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("policy", metavar="POLICY", help="best-effort, equal-share or fixed-share")
    p.add_argument("--timeslice", type=integer(1, 30, "--timeslice"), metavar="MS", help="time slice, 1-30 ms")
    p.add_argument("--frequency", type=integer(63, 960, "--frequency"), metavar="HZ",
                   help="scheduling frequency (adaptive round robin), 63-960; given with --avg-factor")
    p.add_argument("--avg-factor", type=integer(1, 60, "--avg-factor"), metavar="N",
                   help="averaging factor (adaptive round robin), 1-60; given with --frequency")
    p = cmd(sch, ("scheduler", "log"), "vgpumgr.cli.scheduler:log_", "the driver's log of the last time slices")
    p.add_argument("gpu", metavar="BDF")
    p.add_argument("--engine", choices=("graphics", "nvenc0", "nvenc1"), default="graphics")
    p.add_argument("--gpu-instance", type=integer(0, 63, "--gpu-instance"), metavar="ID",
                   help="the log of one MIG GPU instance (its own scheduler: Blackwell GB20x and newer)")
    p.add_argument("--json", action="store_true")
    p = cmd(sch, ("scheduler", "persist"), "vgpumgr.cli.scheduler:persist",
            "write the recorded schedulers as RmPVMRL into a modprobe options file (used at the next driver load)")
    p.add_argument("--file", metavar="PATH", help="default: /etc/modprobe.d/vgpumgr-scheduler.conf under the root")
    p.add_argument("--json", action="store_true")
    p = cmd(sch, ("scheduler", "check"), "vgpumgr.cli.scheduler:check",
            "each running VM's share of GPU time against its policy's promise; exit 10 when one got clearly less")
    p.add_argument("--seconds", type=decimal(0, 300, "--seconds"), default=1.0, metavar="S",
                   help="how long to read the log (1)")
    p.add_argument("--tolerance", type=decimal(0, 1, "--tolerance"), default=0.2, metavar="F",
                   help="flag a busy VM below promised x (1 - F) (0.2)")
    p.add_argument("--json", action="store_true")


def _cfg(args: argparse.Namespace) -> Any:
    from vgpumgr.cli.devices import config

    return config(args)


def _ms(ns: int | None) -> str:
    return "-" if not ns else f"{ns / 1e6:g}"


def show(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr import ids
    from vgpumgr.ops import scheduler

    gpu = ids.pci_address(args.gpu) if args.gpu else None
    states = scheduler.show(_cfg(args), gpu)
    for st in states:  # the graphics engine's policy at the top level, as before
        st["policy"] = (st["engines"].get("graphics") or {}).get("policy")
    if gpu:
        dump_json(out, states[0])
        return 0
    if args.json:
        dump_json(out, {st["address"]: st for st in states})
        return 0
    rows = []
    for st in states:
        g, rec = st["engines"].get("graphics") or {}, st["recorded"] or {}
        state = "-" if not rec else "in effect" if st["in_effect"] else "pending" if not rec["applied"] else "drift"
        rows.append([st["address"], st.get("name"), g.get("policy"), _ms(g.get("timeslice_ns")),
                     ",".join((st["capabilities"] or {}).get("policies") or []) or None, st["active_vgpus"],
                     rec.get("policy"), state, st["api"] if g else None])
    table(out, ["GPU", "NAME", "POLICY", "SLICE_MS", "SUPPORTED", "VGPUS", "RECORDED", "STATE", "API"], rows,
          empty="no GPUs known to NVML")
    for st in states:
        if not st["engines"] and (st.get("gpu_instances") is None or st["capabilities"] is None):
            out.write(f"{st['address']}: no vGPU scheduler ({', '.join(st['not_supported']) or 'NotSupported'})\n")
    _gpu_instances([st for st in states if st.get("gpu_instances") is not None], out)
    return 0


def _gpu_instances(states: list[dict[str, Any]], out: TextIO) -> None:
    """GPUs with MIG on, after a blank line: each GPU instance's own scheduler (GB20x and newer), or why not."""
    if not states:
        return
    rows = []
    for st in states:
        for gi in st["gpu_instances"]:
            g = gi["engines"].get("graphics") or {}
            rows.append([st["address"], gi["id"], gi["profile"], g.get("policy") or "not answered",
                         _ms(g.get("timeslice_ns")), g.get("avg_factor"), gi["api"]])
    out.write("\n")
    table(out, ["GPU", "GPU_INSTANCE", "PROFILE", "POLICY", "SLICE_MS", "AVG_FACTOR", "API"], rows,
          empty="no GPU instance exists on the GPUs with MIG on")
    for st in states:
        if st.get("mig_note"):
            out.write(f"{st['address']}: {st['mig_note']}\n")


def set_(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import scheduler

    want = scheduler.setting(args.policy, args.timeslice, args.frequency, args.avg_factor)
    res = scheduler.set_scheduler(_cfg(args), args.gpu, want)
    dump_json(out, res)
    if res["status"] == "deferred":
        sys.stderr.write(f"recorded, not applied yet: {res['reason']}; it applies {res['applies']}\n")
    return 0


def log_(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.nvidia import gi_scheduler as nvml_gi_scheduler
    from vgpumgr.nvidia import scheduler as nvml_scheduler
    from vgpumgr.ops.manual import nvml

    engine = {"graphics": 1, "nvenc1": 2, "nvenc0": 3}[args.engine]
    if getattr(args, "gpu_instance", None) is not None:
        res = nvml_gi_scheduler.read_log(nvml(_cfg(args)), args.gpu, args.gpu_instance, engine)
    else:
        res = nvml_scheduler.read_log(nvml(_cfg(args)), args.gpu, engine)
    if args.json:
        dump_json(out, res)
        return 0
    rows = [[e["timestamp_ns"], e["runlist"], _ms(e["run_ns"]), _ms(e["target_ns"]), _ms(e["total_ns"])]
            for e in res["entries"]]
    where = res["address"] + (f" GPU instance {res['gpu_instance']}" if "gpu_instance" in res else "")
    out.write(f"{where}: policy {res['policy'] or '-'}, time slice {_ms(res['timeslice_ns'])} ms\n")
    table(out, ["TIMESTAMP_NS", "RUNLIST", "RUN_MS", "TARGET_MS", "TOTAL_MS"], rows,
          empty="no entries" + (f" (not answered: {', '.join(res['not_supported'])})" if res["not_supported"] else ""))
    return 0


def persist(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import scheduler

    res = scheduler.persist(_cfg(args), args.file)
    if args.json:
        dump_json(out, res)
        return 0
    if res["removed"]:
        out.write(f"no equal- or fixed-share scheduler is recorded: {res['file']} removed (driver defaults)\n")
    else:
        out.write(f"wrote {res['file']}:\n{res['text']}")
    out.write(f"note: it {res['note']}\n")
    return 0


def check(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.vm import service
    from vgpumgr.errors import InvalidInput

    if not 0 <= args.tolerance < 1 or not 0 <= args.seconds <= 300:
        raise InvalidInput("--tolerance must be 0..1 (exclusive) and --seconds 0..300", hint="e.g. --tolerance 0.2")
    res = service(args).scheduler_check(args.seconds, args.tolerance)
    if args.json:
        dump_json(out, res)
    else:
        rows = [[r["vm"] or "?", r["gpu"], r.get("policy"), _pct(r.get("share")), _pct(r.get("expected")),
                 "yes" if r.get("busy") else "no"] for r in res["vgpus"]]
        table(out, ["VM", "GPU", "POLICY", "SHARE%", "PROMISED%", "BUSY"], rows,
              empty="no running vGPU (NVML lists none)")
        for f in res["findings"]:
            out.write(f"LESS THAN PROMISED: {f['vm']} on {f['gpu']}: {f['evidence']}\n")
        for a in res["absent"]:
            out.write(f"{a['reason']} (not checked)\n")
    return 10 if res["findings"] else 0


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}"
