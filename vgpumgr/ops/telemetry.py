"""Telemetry as the CLI and the REST service ask for it: a snapshot of the running vGPUs joined with the
records, and the licence check (see vgpumgr.telemetry)."""

from __future__ import annotations

from typing import Any

from vgpumgr.ops.context import Context
from vgpumgr.telemetry import licence_check as check
from vgpumgr.telemetry import snapshot
from vgpumgr.telemetry.read import Reader


def _reader(svc: Context) -> Reader:
    reader = getattr(svc, "_telemetry_reader", None)
    if reader is None:
        from vgpumgr.nvidia.facts import nvml_layer
        from vgpumgr.nvidia.nvml import NvmlLayer

        reader = Reader(nvml_layer(svc.cfg) or NvmlLayer(None, notice="NVML is not available here"))
        svc._telemetry_reader = reader  # type: ignore[attr-defined]
    return reader


def guest_sampler(svc: Context) -> Any:
    """This process's guest-side reader (its threads start on first use)."""
    sampler = getattr(svc, "_guest_sampler", None)
    if sampler is None:
        from vgpumgr.telemetry.guest_sampler import GuestSampler

        sampler = svc._guest_sampler = GuestSampler(svc)  # type: ignore[attr-defined]
    return sampler


def telemetry(svc: Context, gpu: str | None = None, *, guest_wait: float | None = None) -> dict[str, Any]:
    """Every running vGPU of this host now (only those on `gpu` when given), and the guest-side readings this
    process has. `guest_wait` (a CLI without the service): hand out the due guest reads, and wait at most that
    many seconds for them (0: do not wait; `top` shows them on its next refresh)."""
    guests = guest_sampler(svc)
    if guest_wait is not None:
        guests.settle(guest_wait)
        if guest_wait > 0:  # a one-shot caller: no connection outlives its answer
            guests.close_idle()
    snap = snapshot.take(svc, _reader(svc), guests.readings())
    from vgpumgr.ops import licence_delivery

    licence_delivery.note_licensed(svc, snap)
    if gpu:
        from vgpumgr import ids

        gpu = ids.pci_address(gpu)
        snap = {**snap, "vgpus": [r for r in snap["vgpus"] if r["gpu"] == gpu],
                "gpus": [g for g in snap["gpus"] if g["gpu"] == gpu]}
    return snap


def licence_check(svc: Context, snap: dict[str, Any] | None = None, *, audit: bool = True,
                  actor: str | None = None) -> dict[str, Any]:
    """The ledger against the guests; new findings are audited once (unless `audit` is False: the web view
    shows them without writing)."""
    snap = snap or telemetry(svc)
    found = check.findings(svc, snap)
    new = check.audit_new(svc, found, actor) if audit else []
    return {"taken": snap["taken"], "host": snap["host"], "findings": found,
            "newly_audited": [f["key"] for f in new], "checked_vgpus": len(snap["vgpus"]),
            "absent": snap["absent"], "notices": snap["notices"]}


def scheduler_check(svc: Context, seconds: float = 1.0, tolerance: float = 0.2) -> dict[str, Any]:
    """Each running VM's share of GPU time from the scheduler's log, read for `seconds` (5 reads a second, as
    NVML asks), against its policy's promise: the busy VMs that got less than promised x (1 - tolerance)."""
    import time

    from vgpumgr.telemetry.sampler import LOG_POLL_S
    from vgpumgr.telemetry.sched_share import shortfalls

    telemetry(svc)  # the first read: which GPUs run vGPUs
    reader = _reader(svc)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(LOG_POLL_S)
        reader.poll_logs()
    snap = telemetry(svc)
    return {"taken": snap["taken"], "findings": shortfalls(snap, tolerance), "absent": snap["absent"],
            "vgpus": [{"vm": r["vm"] or r["vm_uuid"], "gpu": r["gpu"], "vgpu": r["vgpu"], **(r.get("scheduler") or {})}
                      for r in snap["vgpus"]]}
