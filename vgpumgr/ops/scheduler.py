"""The vGPU scheduler as recorded intent (docs/sources.md §24): what each GPU should have, applied through NVML
when NVML allows it, brought back at boot, persisted as RmPVMRL, compared with what the driver has.

NVML changes the scheduler only while no vGPU exists on the GPU and MIG is off, and forgets it at the next
reboot or driver reload. So `set` records the wish first, applies it at once when the GPU is empty, and
otherwise says when it will apply: when the GPU's last vGPU stops (a VM stop, a hook's release: `apply_pending`)
or at the next boot (`restore`). Fixed share is refused in mixed-size mode, and any policy the driver's
capabilities lack, with the reason. Every change is audited (`vgpu.scheduler`).
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select

from vgpumgr import ids
from vgpumgr.config import Config
from vgpumgr.db import store
from vgpumgr.db.models import GpuSchedulerIntent
from vgpumgr.errors import Conflict, InvalidInput, VgpuError
from vgpumgr.nvidia import rmpvmrl
from vgpumgr.nvidia import scheduler as nvml_scheduler

log = logging.getLogger(__name__)
POLICIES = ("best-effort", "equal-share", "fixed-share")
AUDIT = "vgpu.scheduler"
WHEN = "when the GPU's last vGPU stops (its VMs shut down or are released), or at the next boot (`vgpumgr restore`)"


def _session(cfg: Config) -> Any:
    from vgpumgr.db.session import ensure_schema, session_factory

    ensure_schema(cfg.db_url)
    return session_factory(cfg.db_url).begin()


def _host_id(s: Any) -> int:
    from vgpumgr.ops.context import hostname

    return store.upsert_host(s, hostname()).id


def intents(cfg: Config) -> dict[str, dict[str, Any]]:
    """Every recorded intent of this host, by GPU address. Read only (it runs after every VM stop): a host
    without a record has none."""
    from vgpumgr.db.models import Host as HostRow
    from vgpumgr.db.session import ensure_schema, read_sessions
    from vgpumgr.ops.context import hostname

    ensure_schema(cfg.db_url)
    with read_sessions(cfg.db_url)() as s:
        rows = s.scalars(select(GpuSchedulerIntent).join(HostRow, HostRow.id == GpuSchedulerIntent.host_id)
                         .where(HostRow.name == hostname())).all()
        return {r.address: _json(r) for r in rows}


def _json(r: GpuSchedulerIntent) -> dict[str, Any]:
    return {"gpu": r.address, "policy": r.policy, "timeslice_ms": r.timeslice_ms, "frequency_hz": r.frequency_hz,
            "avg_factor": r.avg_factor, "applied": r.applied_at is not None,
            "applied_at": r.applied_at.isoformat() if r.applied_at else None, "pending_reason": r.pending_reason}


def _record(cfg: Config, gpu: str, want: rmpvmrl.Setting, *, applied: bool, reason: str | None) -> dict[str, Any]:
    with _session(cfg) as s:
        h = _host_id(s)
        row = s.scalars(select(GpuSchedulerIntent).where(GpuSchedulerIntent.host_id == h,
                                                         GpuSchedulerIntent.address == gpu)).first()
        if row is None:
            row = GpuSchedulerIntent(host_id=h, address=gpu, policy=want.policy)
            s.add(row)
        row.policy, row.timeslice_ms = want.policy, want.timeslice_ms
        row.frequency_hz, row.avg_factor = want.frequency_hz, want.avg_factor
        row.applied_at = datetime.now(UTC) if applied else None
        row.pending_reason = None if applied else reason
        s.flush()
        return _json(row)


def _mark(cfg: Config, gpu: str, *, applied: bool, reason: str | None) -> None:
    with _session(cfg) as s:
        row = s.scalars(select(GpuSchedulerIntent).where(GpuSchedulerIntent.host_id == _host_id(s),
                                                         GpuSchedulerIntent.address == gpu)).first()
        if row is not None:
            row.applied_at = datetime.now(UTC) if applied else None
            row.pending_reason = None if applied else reason


def setting(policy: str, timeslice_ms: int | None = None, frequency_hz: int | None = None,
            avg_factor: int | None = None) -> rmpvmrl.Setting:
    """The wanted setting, checked against NVIDIA's documented ranges (rmpvmrl.encode says what is wrong)."""
    if policy not in POLICIES:
        raise InvalidInput(f"'{policy}' is not a vGPU scheduler policy", hint="use " + ", ".join(POLICIES))
    if policy == "best-effort" and (timeslice_ms or frequency_hz or avg_factor):
        raise InvalidInput("best effort takes no --timeslice, --frequency or --avg-factor",
                           hint="they tune equal-share and fixed-share only")
    if (frequency_hz is None) != (avg_factor is None):
        raise InvalidInput("--frequency and --avg-factor go together (adaptive round robin takes both)",
                           hint="give both, or --timeslice alone")
    want = rmpvmrl.Setting(policy, timeslice_ms, frequency_hz, avg_factor)
    rmpvmrl.encode(want)
    return want


def _refusal(state: dict[str, Any], want: rmpvmrl.Setting) -> str | None:
    """Why this GPU can never take `want` now (None: it can, at once or later)."""
    caps = state.get("capabilities")
    if caps is None and not state.get("engines"):
        return (f"GPU {state['address']} has no vGPU scheduler: NVML answers NotSupported "
                f"({', '.join(state['not_supported']) or 'no vGPU host driver'})")
    if state.get("mig") and any(gi["engines"] for gi in state.get("gpu_instances") or []):
        return ("MIG mode is on: NVML refuses the GPU's own scheduler while MIG is on; here each GPU instance has a "
                "scheduler of its own (GB20x), which `scheduler show` reads and vgpumgr does not set")
    if state.get("mig"):
        return ("MIG mode is on: MIG-backed vGPUs get fixed share (NVIDIA's driver, before GB20x), and NVML refuses "
                "scheduler changes while MIG is on")
    if want.policy == "fixed-share" and state.get("heterogeneous_mode"):
        return ("fixed share is not supported in mixed-size mode (NVIDIA vGPU user guide: only the best effort and "
                "equal share schedulers are)")
    if caps and want.policy not in caps["policies"]:
        return f"the driver offers {', '.join(caps['policies'])} on this GPU, not {want.policy}"
    if caps and want.timeslice_ms:
        low, high = caps["timeslice_ms"]
        if low and high and not low <= want.timeslice_ms <= high:
            return f"time slice {want.timeslice_ms} ms is outside the driver's {low:g}..{high:g} ms"
    if caps and want.frequency_hz:
        low, high = caps["frequency_hz"]
        if low and high and not low <= want.frequency_hz <= high:
            return f"frequency {want.frequency_hz} Hz is outside the driver's {low}..{high} Hz"
    return None


def set_scheduler(cfg: Config, gpu: str, want: rmpvmrl.Setting) -> dict[str, Any]:
    """Record `want` for `gpu`; apply it now when NVML allows, else say when it will apply."""
    from vgpumgr.ops.manual import audited, nvml

    gpu, layer = ids.pci_address(gpu), nvml(cfg)
    state = nvml_scheduler.read(layer, gpu)
    why = _refusal(state, want)
    if not why and want.policy == "fixed-share" and _recorded_mode(cfg, gpu) == "mixed":
        why = ("the GPU is recorded in mixed-size mode (`vgpumgr gpu mode`; `restore` sets it again after a reboot), "
               "where fixed share is not supported")
    if why:
        raise Conflict(f"cannot set {want.policy} on {gpu}: {why}",
                       hint="`vgpumgr scheduler show " + gpu + "` shows what the driver offers")
    before = (state.get("engines") or {}).get("graphics")
    out: dict[str, Any] = {"gpu": gpu, "wanted": _want_json(want), "before": before}
    if state.get("active_vgpus"):
        reason = (f"{state['active_vgpus']} vGPU(s) run on {gpu}; NVML changes the scheduler only while no vGPU "
                  "exists on the GPU")
        out.update(status="deferred", reason=reason, applies=WHEN)
        out["intent"] = _record(cfg, gpu, want, applied=False, reason=reason)
    else:
        try:
            res = _apply(layer, gpu, want)
        except VgpuError as e:
            out.update(status="deferred", reason=f"NVML refused it now: {e.message}", applies=WHEN)
            out["intent"] = _record(cfg, gpu, want, applied=False, reason=out["reason"])
        else:
            out.update(status="applied", api=res["api"],
                       after=(nvml_scheduler.read(layer, gpu).get("engines") or {}).get("graphics"))
            out["intent"] = _record(cfg, gpu, want, applied=True, reason=None)
    audited(cfg, AUDIT, gpu=gpu, detail={k: v for k, v in out.items() if k != "intent"})
    return out


def _recorded_mode(cfg: Config, gpu: str) -> str | None:
    """The vGPU mode `vgpumgr gpu mode` recorded for the GPU (None: none), as restore will set it."""
    from vgpumgr.ops import boot_records

    found: list[str | None] = []
    boot_records.note(cfg, lambda s, host_id: found.append(
        getattr(boot_records.boot_states(s, host_id).get(gpu), "vgpu_mode", None)))
    return found[0] if found else None


def _want_json(want: rmpvmrl.Setting) -> dict[str, Any]:
    return {"policy": want.policy, "timeslice_ms": want.timeslice_ms, "frequency_hz": want.frequency_hz,
            "avg_factor": want.avg_factor}


def _apply(layer: Any, gpu: str, want: rmpvmrl.Setting) -> dict[str, Any]:
    return nvml_scheduler.apply(layer, gpu, want.policy, timeslice_ms=want.timeslice_ms,
                                frequency_hz=want.frequency_hz, avg_factor=want.avg_factor)


def _setting_of(intent: dict[str, Any]) -> rmpvmrl.Setting:
    return rmpvmrl.Setting(intent["policy"], intent["timeslice_ms"], intent["frequency_hz"], intent["avg_factor"])


def matches(intent: dict[str, Any], actual: dict[str, Any] | None) -> bool:
    """Does the driver's graphics-engine state carry out the intent? (Parameters are compared only while the
    driver reports them: it reports 0 when no vGPU runs.)"""
    if actual is None:
        return False
    if actual.get("policy") != intent["policy"]:
        return False
    if intent["policy"] == "best-effort":
        return True
    ts = actual.get("timeslice_ns")
    if ts and intent.get("timeslice_ms") and round(ts / 1e6) != intent["timeslice_ms"]:
        return False
    if ts and intent.get("frequency_hz") and abs(1e9 / ts - intent["frequency_hz"]) > 2:
        return False
    avg = actual.get("avg_factor")
    return not (avg and intent.get("avg_factor") and avg != intent["avg_factor"])


def apply_pending(cfg: Config, gpus: list[str] | None = None, *, actor: str | None = None) -> list[dict[str, Any]]:
    """Apply every recorded intent that is not in effect on a GPU that holds no vGPU now. Never raises: it runs
    after a VM stopped or a vGPU was released, whose outcome it must not change."""
    from vgpumgr.nvidia.facts import nvml_layer
    from vgpumgr.ops.manual import audited

    try:
        wanted = intents(cfg)
        if gpus is not None:
            wanted = {g: w for g, w in wanted.items() if g in set(gpus)}
        if not wanted:
            return []
        layer = nvml_layer(cfg)
        if layer is None or not layer.open():
            return []
    except Exception as e:  # noqa: BLE001
        log.warning("vGPU scheduler intents not applied: %s", e)
        return []
    done = []
    for gpu, intent in sorted(wanted.items()):
        try:
            state = nvml_scheduler.read(layer, gpu)
            actual = (state.get("engines") or {}).get("graphics")
            if state.get("active_vgpus") or (intent["applied"] and matches(intent, actual)):
                continue
            if matches(intent, actual) and not intent["applied"]:
                _mark(cfg, gpu, applied=True, reason=None)
                continue
            res = _apply(layer, gpu, _setting_of(intent))
            _mark(cfg, gpu, applied=True, reason=None)
            entry = {"gpu": gpu, "status": "applied", "api": res["api"], "wanted": intent, "trigger": "gpu empty"}
            audited(cfg, AUDIT, gpu=gpu, detail=entry, actor=actor)
            done.append(entry)
        except Exception as e:  # noqa: BLE001
            log.warning("vGPU scheduler of %s not applied: %s", gpu, e)
            sys.stderr.write(f"vgpumgr: warning: the recorded vGPU scheduler of {gpu} is not applied yet: {e}\n")
    return done


def restore_plan(layer: Any, gpu: str, intent: dict[str, Any]) -> dict[str, Any]:
    """What `restore` does with a GPU's recorded scheduler: {"action": "ok" | "pending" | "apply" | "failed",
    "message", "hint", "apply": callable}."""
    name = intent["policy"] + "".join(f", {k} {intent[k]}" for k in ("timeslice_ms", "frequency_hz", "avg_factor")
                                      if intent.get(k))
    if layer is None:
        return {"action": "failed", "message": "NVML is not available, so the vGPU scheduler cannot be restored",
                "hint": "install the NVIDIA driver's NVML and nvidia-ml-py"}
    try:
        state = nvml_scheduler.read(layer, gpu)
    except VgpuError as e:
        return {"action": "failed", "message": f"reading the vGPU scheduler: {e.message}", "hint": e.hint}
    if matches(intent, (state.get("engines") or {}).get("graphics")):
        return {"action": "ok", "message": f"vGPU scheduler {name} in effect"}
    if state.get("active_vgpus"):
        return {"action": "pending", "message": f"vGPU scheduler {name}: {state['active_vgpus']} vGPU(s) run on "
                "the GPU", "hint": "it is applied when the GPU's last vGPU stops"}
    return {"action": "apply", "message": f"set the vGPU scheduler to {name}",
            "apply": lambda: _apply(layer, gpu, _setting_of(intent))}


def mark_applied(cfg: Config, gpu: str) -> None:
    _mark(cfg, gpu, applied=True, reason=None)


def show(cfg: Config, gpu: str | None = None) -> list[dict[str, Any]]:
    """Per GPU: what the driver has (capabilities, engines), what is recorded, and whether they agree."""
    from vgpumgr.ops.manual import nvml

    layer = nvml(cfg)
    recorded = intents(cfg)
    gpus = [ids.pci_address(gpu)] if gpu else sorted(layer.addresses())
    out = []
    for g in gpus:
        state = nvml_scheduler.read(layer, g)
        intent = recorded.get(g)
        actual = (state.get("engines") or {}).get("graphics")
        state["recorded"] = intent
        state["in_effect"] = None if intent is None else matches(intent, actual)
        if intent and intent["policy"] != "best-effort":
            state["rmpvmrl"] = rmpvmrl.hex_value(rmpvmrl.encode(_setting_of(intent)))
        out.append(state)
    return out


def drift(cfg: Config, layer: Any) -> list[dict[str, Any]]:
    """Recorded intents the driver does not carry out (for `reconcile`)."""
    out = []
    for gpu, intent in sorted(intents(cfg).items()):
        try:
            state = nvml_scheduler.read(layer, gpu)
        except VgpuError as e:
            out.append({"gpu": gpu, "recorded": intent, "actual": None, "why": e.message})
            continue
        actual = (state.get("engines") or {}).get("graphics")
        if matches(intent, actual):
            continue
        why = (intent["pending_reason"] or "recorded, not applied yet") if not intent["applied"] else \
            "the driver's scheduler differs from the recorded one (a reboot, a driver reload or a change by hand)"
        out.append({"gpu": gpu, "recorded": intent, "actual": actual, "why": why,
                    "fix": "applied when the GPU holds no vGPU; `vgpumgr restore` at boot"})
    return out


def drift_report(cfg: Config, *, fix: bool = False, actor: str | None = None) -> list[dict[str, Any]]:
    """`reconcile`'s part: recorded schedulers the driver does not carry out ([] without NVML or intents);
    with `fix`, those on an empty GPU are applied first."""
    from vgpumgr.nvidia.facts import nvml_layer

    try:
        if not intents(cfg):
            return []
        if fix:
            apply_pending(cfg, actor=actor)
        layer = nvml_layer(cfg)
        if layer is None or not layer.open():
            return []
        return drift(cfg, layer)
    except VgpuError as e:
        return [{"gpu": None, "why": f"the vGPU scheduler could not be compared: {e.message}"}]


def persist(cfg: Config, path: str | None = None) -> dict[str, Any]:
    """Write RmPVMRL for every GPU with a recorded equal- or fixed-share intent into a modprobe options file."""
    from vgpumgr.ops.manual import audited
    from vgpumgr.userinput import files

    target = files.checked_path(path, "--file") if path is not None else Path(cfg.host.root) / rmpvmrl.DEFAULT_FILE
    per_gpu = {g: rmpvmrl.encode(_setting_of(i)) for g, i in intents(cfg).items() if i["policy"] != "best-effort"}
    text = rmpvmrl.write(target, per_gpu, make_dir=path is None)
    out = {"file": str(target), "values": {g: rmpvmrl.hex_value(v) for g, v in per_gpu.items()},
           "text": text, "removed": not per_gpu,
           "note": "takes effect when the nvidia module loads again: reload the NVIDIA driver or reboot"}
    audited(cfg, "vgpu.scheduler.persist", detail={k: out[k] for k in ("file", "values")})
    return out
