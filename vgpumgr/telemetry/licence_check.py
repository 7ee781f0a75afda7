"""Licence truth: the seat ledger against what each guest's driver reports (docs/sources.md §19).

A guest licenses itself with NVIDIA's licence server; the host sees the outcome per running vGPU
(`nvmlVgpuInstanceGetLicenseInfo_v2`). Findings, each with its evidence:

- `unlicensed-with-seat`: the ledger gives the VM a seat, but its guest reports unlicensed (NVIDIA's
  `unlicensed`/`unlicensed-restricted`: the licence was lost or the grace period is over), or has never
  licensed although the vGPU has been active longer than the grace period (`VGPUMGR_LICENCE_GRACE`, default
  1200 s: NVIDIA's guest driver runs unrestricted for about 20 minutes before it restricts the vGPU).
- `licensed-without-seat`: the guest reports licensed, but the ledger has no seat for it (or vgpumgr has no
  record of the vGPU at all).
- `edition-mismatch`: the seat's edition does not cover the vGPU's series (a Q-series vGPU needs vWS).

Each finding is audited once (`licence.drift`, keyed by kind, VM and vGPU); later checks list it again but do
not audit it again while it lasts.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

from vgpumgr import audit, licensing
from vgpumgr.ops.context import WARNING, Context

DRIFT = "licence.drift"
GRACE_ENV = "VGPUMGR_LICENCE_GRACE"
UNLICENSED = ("unlicensed", "unlicensed-restricted")


def grace_seconds() -> float:
    try:
        return float(os.environ.get(GRACE_ENV, "1200"))
    except ValueError:
        return 1200.0


def _age(record: dict[str, Any] | None, now: float) -> float | None:
    when = (record or {}).get("activated_at")
    if not when:
        return None
    return now - datetime.fromisoformat(when).astimezone(UTC).timestamp()


def findings(svc: Context, snap: dict[str, Any]) -> list[dict[str, Any]]:
    from vgpumgr.telemetry.snapshot import live_records

    records = {a.get("uuid") or a.get("pci_address"): a for a in live_records(svc)}
    out = []
    for row in snap["vgpus"]:
        state = row["licence"]["state"]
        rec = records.get(row["vgpu"] or "") if row["recorded"] else None
        seat = row["seat"]
        base = {"vm": row["vm"], "vm_uuid": row["vm_uuid"], "vgpu": row["vgpu"], "gpu": row["gpu"],
                "type": row["type"], "seat": seat, "guest_licence": state}
        if seat and state in UNLICENSED:
            out.append({**base, "kind": "unlicensed-with-seat",
                        "evidence": f"the ledger holds a {seat} seat; the guest's driver reports {state}"})
        elif seat and state != "licensed":
            age = _age(rec, snap["taken"])
            if age is not None and age > grace_seconds():
                out.append({**base, "kind": "unlicensed-with-seat",
                            "evidence": f"the ledger holds a {seat} seat; the guest has reported no licence ({state}) "
                                        f"in the {age / 60:.0f} min since its vGPU became active"})
        if state == "licensed" and not seat:
            why = "vgpumgr has no record of this vGPU" if not row["recorded"] else "the ledger holds no seat for it"
            out.append({**base, "kind": "licensed-without-seat", "evidence": f"the guest reports licensed; {why}"})
        series = (rec or {}).get("series")
        if seat and series:
            try:
                covering = licensing.edition_candidates(series)
            except Exception:  # noqa: BLE001 - a series the ledger does not know: nothing to compare
                covering = []
            if covering and seat not in covering:
                out.append({**base, "kind": "edition-mismatch",
                            "evidence": f"a {series}-series vGPU needs {' or '.join(covering)}; its seat is {seat}"})
    for f in out:
        f["key"] = f"{f['kind']}|{f['vm'] or f['vm_uuid']}|{f['vgpu']}"
    return out


def audit_new(svc: Context, found: list[dict[str, Any]], actor: str | None = None) -> list[dict[str, Any]]:
    """Audit the findings not audited before; returns those."""
    if not found:
        return []
    with svc.reads() as s:
        seen = {(e.detail or {}).get("key") for e in audit.query(s, host=svc.hostname, action=DRIFT)}
    new = [f for f in found if f["key"] not in seen]
    if new:
        with svc.tx() as s:
            for f in new:
                svc.event(s, DRIFT, WARNING, actor=actor, gpu=f["gpu"], vm=f["vm"], vgpu=f["vgpu"],
                          error=f["evidence"], detail=f)
    return new
