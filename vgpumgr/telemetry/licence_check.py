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
- `running-without-seat`: a vGPU whose series needs a licence runs with no seat in the ledger (started in warn
  mode without a free seat, or before a pool existed: a pool added later does not give it one).
- `token-not-delivered`: a guest that is not licensed never got the client configuration token since its VM
  started (delivery `none`, no token set, a domain without the fw_cfg item, an agent VM never delivered to).
- `delivered-still-unlicensed`: the token was delivered longer than `VGPUMGR_LICENCE_DELIVERY_GRACE` (default
  300 s) ago and the guest still reports no licence.
- `token-expired-or-other-server`: the token the guest got has expired, or is not the one set now and names
  another licence server.

Each finding is audited once (`licence.drift`, keyed by kind, VM and vGPU); later checks list it again but do
not audit it again while it lasts.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

from vgpumgr.audit import chain as audit
from vgpumgr.licensing import seats as licensing
from vgpumgr.ops.context import WARNING, Context

DRIFT = "licence.drift"
GRACE_ENV = "VGPUMGR_LICENCE_GRACE"
DELIVERY_GRACE_ENV = "VGPUMGR_LICENCE_DELIVERY_GRACE"
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


def delivery_grace_seconds() -> float:
    try:
        return float(os.environ.get(DELIVERY_GRACE_ENV, "300"))
    except ValueError:
        return 300.0


def _since(iso: str | None, now: float) -> float | None:
    return now - datetime.fromisoformat(iso).astimezone(UTC).timestamp() if iso else None


def _delivery_findings(svc: Context, row: dict[str, Any], series: str | None, base: dict[str, Any],
                       deliveries: dict[str, dict[str, Any]], current: Any, now: float) -> list[dict[str, Any]]:
    """`current`: the licence tokens set on this host (licence_token.all_info), read once per check."""
    from vgpumgr.ops import licence_delivery

    state = row["licence"]["state"]
    try:
        needs = licensing.edition_candidates(series)
    except Exception:  # noqa: BLE001 - a series the ledger does not know
        needs = []
    out: list[dict[str, Any]] = []
    if not needs or not row["vm"]:
        return out
    if row["recorded"] and not row["seat"] and state != "licensed" and svc.licence_mode != licensing.MODE_OFF:
        out.append({**base, "kind": "running-without-seat",
                    "evidence": f"a {series}-series vGPU needs a {' or '.join(needs)} seat; the ledger holds none for "
                                f"it (started without a free seat, licence mode {svc.licence_mode}); stop and start "
                                "the VM to take one"})
    d = deliveries.get(row["vm"]) or {}
    delivered = d.get("delivered_at")
    started = d.get("started_at")
    mode = d.get("mode") or licence_delivery.default_mode()
    # vgpumgr judges delivery only where it delivers: a token is set here and the VM's mode is not none
    if state == "licensed" or not current or mode == "none":
        return out
    if not delivered:
        why = (d.get("error") or
               {"agent": f"its delivery is agent and no token was pushed since it started "
                         f"(`vgpumgr license deliver {row['vm']}`)",
                "fwcfg": "its domain gives the guest no fw_cfg token (no token was set when it was defined: "
                         f"`vgpumgr license delivery {row['vm']} fwcfg`, then restart it)"}[mode])
        out.append({**base, "kind": "token-not-delivered",
                    "evidence": f"the guest reports {state}; the licence token was not delivered: {why}"})
        return out
    # an agent's token stays on the guest's disk across restarts: the clock runs from the later of the two
    age = _since(max(delivered, started or delivered), now) or 0.0
    by_fp = {i.fingerprint: i for i in current}
    got = by_fp.get(d.get("fingerprint") or "")
    if got is not None and got.expired():
        out.append({**base, "kind": "token-expired-or-other-server",
                    "evidence": f"the token delivered ({got.fingerprint}) expired on {got.expires.isoformat()[:19]}; "
                                "set a new one (`vgpumgr license token set FILE`)"})
    elif got is None and current:
        servers = sorted({i.server for i in current if i.server})
        if d.get("server") and servers and d.get("server") not in servers:
            out.append({**base, "kind": "token-expired-or-other-server",
                        "evidence": f"the guest got token {d.get('fingerprint')} for {d.get('server')}; the token set "
                                    f"now is for {', '.join(servers)}; deliver it again (restart the VM, or "
                                    f"`vgpumgr license deliver {row['vm']}`)"})
    if age > delivery_grace_seconds():
        out.append({**base, "kind": "delivered-still-unlicensed",
                    "evidence": f"token {d.get('fingerprint')} delivered by {d.get('method')} {_ago(delivered, now)}; "
                                f"the guest still reports {state} (is nvidia-gridd running, the licence server "
                                "reachable, the guest's clock right?)"})
    return out


def _ago(iso: str, now: float) -> str:
    minutes = (_since(iso, now) or 0.0) / 60
    return f"{minutes:.0f} minutes ago" if minutes >= 1 else "less than a minute ago"


def findings(svc: Context, snap: dict[str, Any]) -> list[dict[str, Any]]:
    from vgpumgr.licensing import token as licence_token
    from vgpumgr.ops import licence_delivery
    from vgpumgr.telemetry.snapshot import live_records

    records = {a.get("uuid") or a.get("pci_address"): a for a in live_records(svc)}
    deliveries = licence_delivery.records(svc)
    tokens = licence_token.all_info(svc.cfg.state_dir)
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
        out.extend(_delivery_findings(svc, row, series, base, deliveries, tokens, snap["taken"]))
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
