"""`vgpumgr guests check`: every vGPU VM whose guest driver the host's vGPU manager does not accept, or would not
accept after a planned host driver (`--driver`), before the VM fails with "Incompatible Guest/Host drivers"
(docs/sources.md §25).

Per running vGPU, NVML's metadata (`nvmlVgpuInstanceGetMetadata`) gives the guest driver's version and whether
the guest has reported it yet (`guestInfoState`); for this host's own driver NVML's answer decides where it gives
one (`nvmlDeviceGetVgpuMetadata` + `nvmlGetVgpuCompatibility`: a VM that may not even cold-boot here, limited by
the guest driver); otherwise, and always for a planned driver, NVIDIA's rule (vgpumgr.nvidia.driver_window).
A finding is audited once (`guest.driver.incompatible`), not again on every run.
"""

from __future__ import annotations

import ctypes
from typing import Any

from vgpumgr.audit import chain as audit
from vgpumgr.nvidia import driver_window as window
from vgpumgr.ops.context import WARNING, Context

FINDING = "guest.driver.incompatible"
_COLD = 0x1  # NVML_VGPU_VM_COMPATIBILITY_COLD
_GUEST_LIMIT = 0x2  # NVML_VGPU_COMPATIBILITY_LIMIT_GUEST_DRIVER
_INITIALIZED = 1  # NVML_VGPU_INSTANCE_GUEST_INFO_STATE_INITIALIZED


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v or "")


def _names(svc: Context) -> dict[str, str]:
    from vgpumgr.errors import VgpuError

    try:
        with svc.virt() as v:
            return {d["uuid"].lower(): d["name"] for d in v.list()}
    except VgpuError:
        return {}


def _metadata(n: Any, inst: int) -> Any | None:
    """NVML's metadata of a running vGPU, or None. pynvml asks NVML for the size and trusts it; a structure
    whose size does not match its own is not read."""
    try:
        meta = n.nvmlVgpuInstanceGetMetadata(inst)
    except n.NVMLError:
        return None
    expected = getattr(n, "c_nvmlVgpuMetadata_t", None)
    if expected is not None and ctypes.sizeof(meta) != ctypes.sizeof(expected):
        return None
    return meta


def _nvml_answer(n: Any, handle: Any, meta: Any) -> tuple[bool | None, str]:
    """(accepted, why) as NVML says for this GPU; (None, "") where it cannot answer."""
    try:
        answer = n.nvmlGetVgpuCompatibility(meta, n.nvmlDeviceGetVgpuMetadata(handle))
    except n.NVMLError:
        return None, ""
    if int(answer.vgpuVmCompatibility) & _COLD:
        return True, "NVML: the VM may boot here"
    if int(answer.compatibilityLimitCode) & _GUEST_LIMIT:
        return False, "NVML: the vGPU cannot run here, limited by the guest driver version"
    return None, ""  # limited by something else: not this check's finding


def rows(svc: Context, planned: str | None = None) -> dict[str, Any]:
    """Every running vGPU with its guest driver and the verdict for the host's driver (or `planned`)."""
    from vgpumgr.nvidia.facts import nvml_layer

    layer = nvml_layer(svc.cfg)
    if layer is None or not layer.open():
        return {"host_driver": None, "planned_driver": planned, "vgpus": [],
                "absent": (layer.notice if layer is not None else None) or "NVML is not available here"}
    n = layer.nvml
    host = layer.driver().get("driver_version")
    target = planned or host
    names = _names(svc)
    out: list[dict[str, Any]] = []
    absent = []
    for address, index in layer.addresses().items():
        try:
            handle = n.nvmlDeviceGetHandleByIndex(index)
            instances = list(n.nvmlDeviceGetActiveVgpus(handle))
        except n.NVMLError as exc:
            absent.append(f"NVML gives no vGPU data for {address}: {exc}")
            continue
        for inst in instances:
            out.append(_row(n, handle, address, int(inst), names, host, target, planned is not None))
    return {"host_driver": host, "planned_driver": planned, "vgpus": out, "absent": "; ".join(absent) or None}


def _row(n: Any, handle: Any, gpu: str, inst: int, names: dict[str, str], host: str | None, target: str | None,
         planned: bool) -> dict[str, Any]:
    try:
        vm_uuid = _text(n.nvmlVgpuInstanceGetVmID(inst)[0]).lower()
        mdev = _text(n.nvmlVgpuInstanceGetMdevUUID(inst)).lower() or None
    except n.NVMLError:
        vm_uuid, mdev = "", None
    meta = _metadata(n, inst)
    row: dict[str, Any] = {"vm": names.get(vm_uuid), "vm_uuid": vm_uuid or None, "gpu": gpu, "vgpu": mdev,
                           "instance": inst, "guest_driver": None, "guest_state": "unknown", "host_driver": target,
                           "accepted": None, "source": "rules", "reason": ""}
    if meta is None:
        row["reason"] = "NVML gives no metadata for this vGPU"
        return row
    ready = int(meta.guestInfoState) == _INITIALIZED
    row["guest_state"] = "initialized" if ready else "uninitialized"
    driver = _text(meta.guestDriverVersion).strip() or None
    row["guest_driver"] = driver if ready else None
    if not ready or not driver:
        row["reason"] = "the guest driver has not reported yet"
        return row
    if not planned:
        ok, why = _nvml_answer(n, handle, meta)
        if ok is not None:
            row.update(accepted=ok, source="nvml", reason=why)
            return row
    verdict = window.accepts(target, driver)
    row.update(accepted=verdict.ok, reason=verdict.reason, window=[f"R{b}" for b in verdict.window])
    return row


def check(svc: Context, planned: str | None = None, *, audit_findings: bool = True,
          actor: str | None = None) -> dict[str, Any]:
    if planned is not None and window.branch(planned) is None:
        from vgpumgr.errors import InvalidInput

        raise InvalidInput(f"--driver {planned!r} is not an NVIDIA driver version",
                           hint="give the planned host driver, e.g. --driver 595.58.02")
    res = rows(svc, planned)
    found = [r for r in res["vgpus"] if r["accepted"] is False]
    for f in found:
        f["key"] = f"{f['vm_uuid']}|{f['guest_driver']}|{f['host_driver']}"
    new = _audit_new(svc, found, actor) if audit_findings else []
    return {**res, "findings": found, "newly_audited": [f["key"] for f in new]}


def _audit_new(svc: Context, found: list[dict[str, Any]], actor: str | None) -> list[dict[str, Any]]:
    if not found:
        return []
    with svc.reads() as s:
        seen = {(e.detail or {}).get("key") for e in audit.query(s, host=svc.hostname, action=FINDING)}
    new = [f for f in found if f["key"] not in seen]
    if new:
        with svc.tx() as s:
            for f in new:
                svc.event(s, FINDING, WARNING, actor=actor, gpu=f["gpu"], vm=f["vm"], vgpu=f["vgpu"],
                          error=f["reason"], detail={k: f[k] for k in ("key", "vm", "vm_uuid", "gpu", "guest_driver",
                                                                       "host_driver", "source", "reason")})
    return new
