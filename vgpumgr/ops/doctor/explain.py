"""`vgpumgr doctor --for TYPE`: why TYPE cannot be made on this host now, end to end: the host checks in its way
(card, branch, VFs, mode, MIG), then placement's own answer in the words of `place --explain` (capacity)."""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.model import Gpu
from vgpumgr.ops.doctor.facts import Facts
from vgpumgr.ops.doctor.report import PASS, Report, Result


def cards_for(f: Facts, type_name: str) -> list[Gpu]:
    """The physical GPUs whose model `type_name` names (by NVML's supported types, else by the name's prefix)."""
    parsed = ids.parse_type_name(type_name)
    short = (parsed.short if parsed else type_name).lower()
    out = []
    for g in f.physical:
        supported = ((g.nvml or {}).get("vgpu") or {}).get("supported_types") or []
        names = {str(t.get("name", "")).split()[-1].lower() for t in supported if t.get("name")}
        prefix = parsed.gpu.lower() if parsed else None
        if short in names or (prefix and prefix in g.name.lower().replace(" ", "")):
            out.append(g)
    return out


def explain(svc: Any, f: Facts, report: Report, type_name: str) -> dict[str, Any]:
    from vgpumgr.errors import VgpuError
    from vgpumgr.placement.placer import explain_text

    cards = {g.address for g in cards_for(f, type_name)}
    blockers: list[Result] = [r for r in report.results if r.level != PASS and
                              ((r.gpu in cards) or (r.gpu is None and r.level == "FAIL"))]
    out: dict[str, Any] = {"type": type_name, "gpus": sorted(cards), "can_make": False,
                           "blockers": [r.as_dict() for r in blockers], "placement": None}
    try:
        d = svc.place(type_name)
    except VgpuError as e:
        out["placement"] = {"error": e.message, "hint": e.hint}
        out["text"] = f"{e.message}" + (f"\n  hint: {e.hint}" if e.hint else "")
        return out
    out["placement"] = d.as_dict()
    out["can_make"] = d.choice is not None
    out["text"] = explain_text(d)
    return out


def text(answer: dict[str, Any]) -> str:
    t = answer["type"]
    lines = [f"vgpumgr doctor --for {t}: " + ("it can be made now" if answer["can_make"] else
                                              "it cannot be made on this host now")]
    gpus = answer["gpus"]
    lines.append(f"cards that offer {t}: {', '.join(gpus) if gpus else 'none on this host'}")
    if answer["blockers"]:
        lines.append("host checks in the way:")
        for r in answer["blockers"]:
            where = f"{r['gpu']} " if r["gpu"] else ""
            lines.append(f"  {r['level']}  {where}{r['check']}: {r['message']}")
            lines.append(f"        hint: {r['hint']}")
    lines.append("placement (as `vgpumgr place --type " + t + " --explain` says):")
    lines += ["  " + line for line in answer["text"].splitlines()]
    return "\n".join(lines) + "\n"
