"""Guest-side readings, cached and rate-limited on threads of their own (docs/sources.md §25).

A planning pass (every few seconds, on its own thread) lists the running VMs, keeps those chosen for guest
telemetry (vgpumgr.ops.guest_watch) and hands each one whose reading is due to a small pool of reader threads;
a VM already being read is not handed out again. `/metrics`, `top` and the web view only ever copy the cache
(`readings()`): a slow, hung, absent or lying agent costs a reader thread its deadline, never a scrape.

A VM is read every VGPUMGR_GUEST_TELEMETRY_INTERVAL seconds (default 30); one whose answer will not change soon
(no agent, guest-exec blocked, tool missing) every 10 intervals (at most 10 minutes), as each read taints the
domain in libvirt's log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vgpumgr.ops.context import Context
from vgpumgr.telemetry import guest_exec

log = logging.getLogger("vgpumgr.telemetry")
INTERVAL_ENV = "VGPUMGR_GUEST_TELEMETRY_INTERVAL"
SLOW_REASONS = ("no-agent", "blocked", "tool-missing")
VENDORS = {"10de": "nvidia", "19e5": "ascend"}


def interval_seconds() -> float:
    try:
        value = float(os.environ.get(INTERVAL_ENV, "30"))
    except ValueError:
        return 30.0
    return min(max(value, 5.0), 3600.0)


class GuestSampler:
    def __init__(self, svc: Context, interval: float | None = None, workers: int = 4,
                 deadline_s: float = 10.0) -> None:
        self.svc = svc
        self.interval = interval or interval_seconds()
        self.deadline_s = deadline_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vgpumgr-guest")
        self._lock = threading.Lock()
        self._cache: dict[str, dict[str, Any]] = {}  # VM name -> its newest reading
        self._due: dict[str, float] = {}
        self._inflight: dict[str, float] = {}  # VM name -> when its read began
        self._os: dict[str, str] = {}  # VM uuid -> the guest's OS id (asked once per VM)
        self._vendors: dict[str, str] = {}
        self._left: dict[str, int] = {}  # VM uuid -> a tool's pid whose exit the agent has not reported yet
        self._conns: dict[int, Any] = {}  # reader thread -> its libvirt connection
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reads = 0

    # -- what everybody else reads -------------------------------------------------------------
    def readings(self) -> list[dict[str, Any]]:
        """A copy of the cache; a VM whose read has run past twice its deadline shows as timed out."""
        now = time.monotonic()
        with self._lock:
            out = [dict(r) for r in self._cache.values()]
            late = {vm for vm, began in self._inflight.items() if now - began > 2 * self.deadline_s}
        for r in out:
            if r["vm"] in late:
                r.update(guest_exec.unknown("timed-out", "the guest agent has not answered"), gpus=[])
        return sorted(out, key=lambda r: r["vm"])

    def busy(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    # -- the planning pass ---------------------------------------------------------------------
    def plan(self) -> int:
        """Hand out the due reads; returns how many. Runs on the sampler's thread (or a test's)."""
        from vgpumgr.errors import VgpuError
        from vgpumgr.ops import guest_watch

        try:
            with self.svc.virt() as v:
                running = {d["name"]: d["uuid"].lower() for d in v.list() if d["state"] in ("running", "paused")}
        except VgpuError:
            running = {}
        chosen = guest_watch.enabled_vms(self.svc, sorted(running)) if running else {}
        devices = self._devices(set(chosen)) if chosen else {}
        now = time.monotonic()
        handed = 0
        with self._lock:
            for vm in [vm for vm in self._cache if vm not in chosen]:
                del self._cache[vm]
                self._due.pop(vm, None)
            for vm, where in chosen.items():
                if vm in self._inflight or self._due.get(vm, 0.0) > now:
                    continue
                self._inflight[vm] = now
                self._cache.setdefault(vm, {"vm": vm, **guest_exec.unknown("pending"),
                                            "vm_uuid": running[vm], "source": "guest", "chosen": where,
                                            "read_at": None})
                self._pool.submit(self._read, vm, running[vm], where, devices.get(vm, []))
                handed += 1
        return handed

    def _devices(self, vms: set[str]) -> dict[str, list[dict[str, Any]]]:
        """VM -> its recorded devices (GPU address, vGPU, type, vendor), in a stable order."""
        from vgpumgr.telemetry.snapshot import live_records

        out: dict[str, list[dict[str, Any]]] = {}
        for a in live_records(self.svc):
            if a["vm"] in vms:
                gpu = a.get("gpu") or a.get("parent") or a.get("pci_address")
                vendor = self._vendor(gpu)
                out.setdefault(a["vm"], []).append({
                    "gpu": gpu, "vgpu": a.get("uuid") or a.get("pci_address"), "type": a.get("type_name") or a["type"],
                    "vendor": VENDORS.get(vendor, vendor)})
        return {vm: sorted(d, key=lambda x: str(x["vgpu"])) for vm, d in out.items()}

    def _vendor(self, address: str | None) -> str:
        """The PCI vendor of a recorded device's GPU, from sysfs (once per address)."""
        from vgpumgr import ids

        if not address or not ids.is_pci_address(address):
            return "10de"
        if address not in self._vendors:
            from vgpumgr.discovery.fs import read_id

            self._vendors[address] = read_id(f"{self.svc.cfg.host.pci(address)}/vendor") or "10de"
        return self._vendors[address]

    def _read(self, vm: str, vm_uuid: str, where: str, devices: list[dict[str, Any]]) -> None:
        began = time.monotonic()
        try:
            reading = self._read_one(vm, vm_uuid, devices)
        except Exception as exc:  # noqa: BLE001 - one VM's failure stays that VM's
            log.exception("guest reading of VM %s failed", vm)
            reading = guest_exec.unknown("failed", type(exc).__name__)
        took = time.monotonic() - began
        row = {"vm": vm, "vm_uuid": vm_uuid, "source": "guest", "chosen": where, "read_at": time.time(),
               "took_s": round(took, 3), **reading, "gpus": _bind(reading.get("gpus") or [], devices)}
        row.pop("os", None)
        row.pop("left_pid", None)
        slow = reading.get("reason") in SLOW_REASONS
        with self._lock:
            self.reads += 1
            self._inflight.pop(vm, None)
            if vm in self._cache:  # not dropped meanwhile (stopped, opted out)
                self._cache[vm] = row
                self._due[vm] = time.monotonic() + min(self.interval * (10 if slow else 1), 600.0 if slow else 3600)
            # a failed read may be a broken connection (libvirtd restarted): this thread connects afresh next time
            broken = self._conns.pop(threading.get_ident(), None) if reading.get("state") != "ok" else None
        if broken is not None:
            broken.close()

    def _read_one(self, vm: str, vm_uuid: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
        from vgpumgr.errors import NotFound

        vendors = {d["vendor"] for d in devices} or {"nvidia"}
        vendor = sorted(vendors)[0]

        def agent(command: str, arguments: dict[str, Any] | None, timeout: int) -> Any:
            try:
                return self._virt().agent(vm, command, arguments, timeout=timeout)
            except NotFound:  # a VM this thread's connection has not seen yet: connect again, once
                with self._lock:
                    stale = self._conns.pop(threading.get_ident(), None)
                if stale is not None:
                    stale.close()
                return self._virt().agent(vm, command, arguments, timeout=timeout)

        reading = guest_exec.read(agent, vendor, deadline_s=self.deadline_s, os_id=self._os.get(vm_uuid),
                                  left_pid=self._left.pop(vm_uuid, None))
        if reading.get("os"):
            self._os[vm_uuid] = reading["os"]
        if reading.get("left_pid") is not None:
            self._left[vm_uuid] = reading["left_pid"]
        return reading

    def _virt(self) -> Any:
        """This reader thread's libvirt connection, kept between reads (a connection per read costs more than
        the read); dropped after a failed read, and by `close_idle`."""
        me = threading.get_ident()
        with self._lock:
            v = self._conns.get(me)
            if v is None:
                v = self._conns[me] = self.svc.virt()
        return v

    def close_idle(self) -> None:
        """Close the reader threads' connections if no read is under way (the service's stop, a one-shot CLI)."""
        with self._lock:
            conns = [] if self._inflight else list(self._conns.values())
            if conns:
                self._conns = {}
        for v in conns:
            v.close()

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vgpumgr-guest-plan", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.close_idle()

    def settle(self, timeout: float) -> None:
        """Plan once and wait (at most `timeout` s) for the reads handed out (the CLI's one-shot `top`)."""
        self.plan()
        end = time.monotonic() + timeout
        while self.busy() and time.monotonic() < end:
            time.sleep(0.05)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.plan()
            except Exception:  # noqa: BLE001 - a failed pass must not end the sampling
                log.exception("guest telemetry planning failed")
            self._stop.wait(min(self.interval / 3, 10.0))


def _bind(gpus: list[dict[str, Any]], devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The guest's GPUs, bound to the VM's devices where their counts agree (one device: always); the guest's
    own names for them are never kept."""
    out = []
    for i, g in enumerate(gpus):
        d = devices[i] if len(devices) == len(gpus) else {}
        out.append({"index": g["index"], "gpu": d.get("gpu"), "vgpu": d.get("vgpu"), "type": d.get("type"),
                    "driver": g.get("driver"), "util": g["util"], "memory_used_bytes": g.get("memory_used_bytes"),
                    "memory_total_bytes": g.get("memory_total_bytes")})
    return out
