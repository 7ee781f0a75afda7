"""`vgpumgr top` and `vgpumgr license check`: what each VM's vGPU is doing, and whether its guest is licensed."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.userinput.numbers import decimal

GUEST_WAIT_S = 12.0  # a one-shot `top` waits this long at most for the guest reads it started (deadline 10 s)


def register(sub: Any, cmd: Any, group: Any) -> None:
    p = cmd(sub, ("top",), "vgpumgr.cli.telemetry:top",
            "what each VM's vGPU is doing now (NVML per running vGPU), busiest first, refreshed in place")
    p.add_argument("--gpu", metavar="BDF", help="only the vGPUs of this physical GPU")
    p.add_argument("--once", action="store_true", help="print one table and exit (for scripts)")
    p.add_argument("--json", action="store_true", help="one snapshot as JSON (what /metrics is made of) and exit")
    p.add_argument("--interval", type=decimal(0.1, 3600, "--interval"), default=2.0, metavar="S",
                   help="seconds between refreshes (2)")


def _service(args: argparse.Namespace):  # noqa: ANN202
    from vgpumgr.cli.vm import service

    return service(args)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}"


def _share(sch: dict[str, Any] | None) -> str:
    """The scheduler's share of GPU time for the vGPU over the log's window, and what its policy promises."""
    if not sch:
        return "-"
    return f"{_pct(sch.get('share'))}/{_pct(sch.get('expected')) if sch.get('expected') is not None else '-'}"


def render(snap: dict[str, Any]) -> str:
    rows = [[r["vm"] or r["vm_uuid"] or "?", r["type"] or "?", r["gpu"], _pct(r["util"].get("sm")),
             _pct(r["util"].get("mem")), _pct(r["util"].get("enc")), _pct(r["util"].get("dec")),
             f"{_gib(r['fb_used_bytes'])}/{_gib(r['fb_total_bytes'])}", r["licence"]["state"],
             r["seat"] or "-", _share(r.get("scheduler")), "host"] for r in snap["vgpus"]]
    guests = snap.get("guests") or []
    rows += [[g["vm"], d.get("type") or "?", d.get("gpu") or f"guest:{d['index']}", _pct(d["util"].get("gpu")),
              _pct(d["util"].get("memory")), "-", "-",
              f"{_gib(d['memory_used_bytes'])}/{_gib(d['memory_total_bytes'])}", "-", "-", "-", "guest"]
             for g in guests for d in g["gpus"]]
    head = ["VM", "TYPE", "GPU", "SM%", "MEM%", "ENC%", "DEC%", "FB GiB", "GUEST LICENCE", "SEAT", "SHARE%/PROMISED",
            "SOURCE"]
    import io

    buf = io.StringIO()
    table(buf, head, rows, empty="no running vGPU (NVML lists none)")
    for g in guests:
        if g["state"] != "ok":
            buf.write(f"{g['vm']}: guest reading unknown: {g['why']}\n")
    for a in snap["absent"]:
        buf.write(f"{a['reason']}\n")
    for n in snap["notices"]:
        buf.write(f"{n}\n")
    return buf.getvalue()


def top(args: argparse.Namespace, out: TextIO) -> int:
    svc = _service(args)
    if args.json or args.once:
        snap = svc.telemetry(args.gpu, guest_wait=GUEST_WAIT_S)
        dump_json(out, snap) if args.json else out.write(render(snap))
        return 0
    if args.interval <= 0:
        from vgpumgr.errors import InvalidInput

        raise InvalidInput(f"--interval {args.interval} is not a positive number of seconds", hint="e.g. --interval 2")
    try:
        while True:
            snap = svc.telemetry(args.gpu, guest_wait=0)
            stamp = time.strftime("%H:%M:%S", time.localtime(snap["taken"]))
            out.write("\x1b[H\x1b[2J" + f"vgpumgr top - {snap['host']} {stamp}  ({len(snap['vgpus'])} vGPUs, "
                      f"every {args.interval:g} s, Ctrl-C quits)\n\n" + render(snap))
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        out.write("\n")
        return 0


def licence_check(args: argparse.Namespace, out: TextIO) -> int:
    res = _service(args).licence_check()
    if args.json:
        dump_json(out, res)
    else:
        rows = [[f["kind"], f["vm"] or f["vm_uuid"] or "?", f["vgpu"] or "?", f["seat"] or "-", f["guest_licence"],
                 f["evidence"]] for f in res["findings"]]
        table(out, ["FINDING", "VM", "VGPU", "SEAT", "GUEST", "EVIDENCE"], rows,
              empty=f"the seat ledger agrees with the {res['checked_vgpus']} running guest(s)")
        for a in res["absent"]:
            out.write(f"{a['reason']} (not checked)\n")
        if res["newly_audited"]:
            sys.stderr.write(f"{len(res['newly_audited'])} new finding(s) audited as licence.drift\n")
    return 10 if res["findings"] else 0
