"""Read what NVML knows of each running vGPU (docs/sources.md §19).

Per physical GPU one utilisation call for all its vGPUs (`nvmlDeviceGetVgpuInstancesUtilizationInfo`: SM,
memory, encoder, decoder, JPEG, OFA); per running vGPU its framebuffer use, encoder and FBC statistics and the
guest's licence, and, once per vGPU instance (they do not change while it lives), its VM, mdev, type, GPU
instance, frame rate limit and guest driver. A GPU whose driver answers NotSupported (no vGPU manager, as the
lent H100 in passthrough mode) has no vGPU data: it is listed as absent with NVML's words, and no error is
raised; a single call that a driver does not answer leaves that field None.
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass, field
from typing import Any

from vgpumgr import ids
from vgpumgr.nvidia.nvml import NvmlLayer
from vgpumgr.telemetry import sched_share
from vgpumgr.telemetry.sched_share import ShareTracker

ENGINES = ("sm", "mem", "enc", "dec", "jpg", "ofa")
LICENCE_STATES = {0: "unknown", 1: "uninitialized", 2: "unlicensed-unrestricted", 3: "unlicensed-restricted",
                  4: "unlicensed", 5: "licensed"}  # NVML_GRID_LICENSE_STATE_*
_INVALID_GI = 0xFFFFFFFF


@dataclass
class VgpuReading:
    gpu: str
    instance: int
    vm_uuid: str | None = None
    mdev_uuid: str | None = None
    type_id: int | None = None
    type_name: str | None = None
    gpu_instance: int | None = None
    guest_driver: str | None = None
    frame_rate_limit: int | None = None
    fb_used_bytes: int | None = None
    fb_total_bytes: int | None = None
    util: dict[str, float | None] = field(default_factory=dict)  # ratios 0..1 per engine
    encoder_sessions: int | None = None
    encoder_fps: int | None = None
    encoder_latency_s: float | None = None
    fbc_sessions: int | None = None
    fbc_fps: int | None = None
    fbc_latency_s: float | None = None
    licence_state: str = "unknown"
    licensed: bool = False
    licence_expiry: float | None = None  # epoch seconds
    scheduler: dict[str, Any] | None = None  # share of GPU time from the scheduler's log, and the promised one
    absent: list[str] = field(default_factory=list)  # calls the driver did not answer

    @property
    def load(self) -> float:
        """What `top` sorts by: the busiest engine."""
        return max((v for v in self.util.values() if v is not None), default=0.0)


@dataclass
class GpuReading:
    address: str
    vgpus: list[VgpuReading] = field(default_factory=list)
    absent: str | None = None  # why NVML gives no vGPU data for this GPU
    scheduler: dict[str, Any] | None = None  # policy, the log's window; None: the driver keeps no log


class Reader:
    """Keeps what does not change while a vGPU instance lives, so a sampling pass asks NVML only for what
    moves. One per process (the service's sampler); not shared between threads."""

    def __init__(self, layer: NvmlLayer) -> None:
        self.layer = layer
        self._static: dict[tuple[str, int], dict[str, Any]] = {}
        self._types: dict[int, tuple[str | None, int | None]] = {}
        self.shares = ShareTracker()
        self._max: dict[tuple[str, int], int | None] = {}
        self._logged: set[str] = set()  # GPUs with running vGPUs and a scheduler log: polled between reads

    def read(self) -> tuple[list[GpuReading], list[str]]:
        """Every GPU's running vGPUs now, and the notices (NVML missing) to say once."""
        if not self.layer.open():
            return [], [self.layer.notice or "NVML is not available: no vGPU telemetry"]
        n = self.layer.nvml
        out = []
        for address, index in self.layer.addresses().items():
            try:
                handle = n.nvmlDeviceGetHandleByIndex(index)
                instances = list(n.nvmlDeviceGetActiveVgpus(handle))
            except n.NVMLError as exc:
                out.append(GpuReading(address, absent=f"NVML gives no vGPU data for {address}: {exc}"))
                continue
            gpu = GpuReading(address)
            util = self._utilisation(n, handle) if instances else {}
            live = set()
            for inst in instances:
                live.add((address, int(inst)))
                gpu.vgpus.append(self._vgpu(n, address, int(inst), util.get(int(inst))))
            for key in [k for k in self._static if k[0] == address and k not in live]:
                del self._static[key]  # an instance that ended: its id may come back for another VM
            self._scheduler(n, handle, gpu)
            out.append(gpu)
        return out, []

    def poll_logs(self) -> None:
        """Read the scheduler log of every GPU that had running vGPUs at the last read (the service does it
        5 times a second, as NVML asks, so that no time slice is missed)."""
        from vgpumgr.nvidia import scheduler as nvml_scheduler

        for address in sorted(self._logged):
            try:
                log = nvml_scheduler.read_log(self.layer, address)
            except Exception:  # noqa: BLE001 - a GPU gone between two reads: the next read() says so
                continue
            self.shares.feed(address, log["entries"])

    def _scheduler(self, n: Any, handle: Any, gpu: GpuReading) -> None:
        from vgpumgr.nvidia import scheduler as nvml_scheduler

        if not gpu.vgpus:
            self._logged.discard(gpu.address)
            self.shares.forget(gpu.address)
            return
        try:
            log = nvml_scheduler.read_log(self.layer, gpu.address)
        except Exception:  # noqa: BLE001 - no log is no error: the rows say nothing of shares
            return
        if log["policy"] is None:
            self._logged.discard(gpu.address)
            return
        self._logged.add(gpu.address)
        self.shares.feed(gpu.address, log["entries"])
        seen = self.shares.shares(gpu.address) or {"window_s": 0.0, "lost_reads": 0, "runlists": {}}
        gpu.scheduler = {"policy": log["policy"], "timeslice_ns": log["timeslice_ns"], "api": log.get("api"),
                         "window_s": seen["window_s"], "lost_reads": seen["lost_reads"]}
        for r in gpu.vgpus:
            mine = seen["runlists"].get(r.instance) or {"share": 0.0, "busy": False}  # runlist = instance id
            most = self._max_instances(n, handle, gpu.address, r.type_id)
            r.scheduler = {"policy": log["policy"], "share": round(mine["share"], 4), "busy": mine["busy"],
                           "expected": sched_share.expected(log["policy"], len(gpu.vgpus), most),
                           "window_s": seen["window_s"]}

    def _max_instances(self, n: Any, handle: Any, gpu: str, type_id: int | None) -> int | None:
        if type_id is None:
            return None
        key = (gpu, int(type_id))
        if key not in self._max:
            try:
                self._max[key] = int(n.nvmlVgpuTypeGetMaxInstances(handle, int(type_id)))
            except n.NVMLError:
                self._max[key] = None
        return self._max[key]

    @staticmethod
    def _utilisation(n: Any, handle: Any) -> dict[int, dict[str, float | None]]:
        try:
            samples = n.nvmlDeviceGetVgpuInstancesUtilizationInfo(handle, 0)
        except n.NVMLError:
            return {}
        return {int(s.vgpuInstance): {e: getattr(s, f"{e}Util").uiVal / 100.0 for e in ENGINES} for s in samples}

    def _vgpu(self, n: Any, gpu: str, inst: int, util: dict[str, float | None] | None) -> VgpuReading:
        r = VgpuReading(gpu, inst, util=dict(util) if util else dict.fromkeys(ENGINES))
        static = self._static.get((gpu, inst))
        if static is None:
            static = self._static[(gpu, inst)] = self._read_static(n, inst)
        for k, v in static.items():
            setattr(r, k, v)
        r.absent = list(static.get("absent", []))
        r.fb_used_bytes = _try(n, r, "fb", n.nvmlVgpuInstanceGetFbUsage, inst)
        enc = _try(n, r, "encoder", n.nvmlVgpuInstanceGetEncoderStats, inst)
        if enc is not None:
            r.encoder_sessions, r.encoder_fps, r.encoder_latency_s = int(enc[0]), int(enc[1]), enc[2] / 1e6
        fbc = _try(n, r, "fbc", n.nvmlVgpuInstanceGetFBCStats, inst)
        if fbc is not None:
            r.fbc_sessions, r.fbc_fps, r.fbc_latency_s = fbc.sessionsCount, fbc.averageFPS, fbc.averageLatency / 1e6
        lic = _try(n, r, "licence", n.nvmlVgpuInstanceGetLicenseInfo_v2, inst)
        if lic is not None:
            r.licence_state = LICENCE_STATES.get(int(lic.currentState), "unknown")
            r.licensed = bool(lic.isLicensed)
            e = lic.licenseExpiry
            r.licence_expiry = (float(calendar.timegm((e.year, e.month, e.day, e.hour, e.min, e.sec)))
                                if e.year else None)
        return r

    def _read_static(self, n: Any, inst: int) -> dict[str, Any]:
        probe = VgpuReading("", inst)
        vm = _try(n, probe, "vm", n.nvmlVgpuInstanceGetVmID, inst)
        type_id = _try(n, probe, "type", n.nvmlVgpuInstanceGetType, inst)
        gi = _try(n, probe, "gpu_instance", n.nvmlVgpuInstanceGetGpuInstanceId, inst)
        driver = _try(n, probe, "guest_driver", n.nvmlVgpuInstanceGetVmDriverVersion, inst)
        mdev = _try(n, probe, "mdev", n.nvmlVgpuInstanceGetMdevUUID, inst)
        name, fb = self._type(n, int(type_id)) if type_id is not None else (None, None)
        return {"vm_uuid": _uuid(vm[0]) if vm else None, "mdev_uuid": _uuid(mdev), "type_id": type_id,
                "type_name": name, "fb_total_bytes": fb, "gpu_instance": None if gi in (None, _INVALID_GI) else gi,
                "guest_driver": None if not driver or _text(driver) == "Not Available" else _text(driver),
                "frame_rate_limit": _try(n, probe, "frame_rate_limit", n.nvmlVgpuInstanceGetFrameRateLimit, inst),
                "absent": probe.absent}

    def _type(self, n: Any, type_id: int) -> tuple[str | None, int | None]:
        if type_id not in self._types:
            probe = VgpuReading("", 0)
            name = _try(n, probe, "type_name", n.nvmlVgpuTypeGetName, type_id)
            fb = _try(n, probe, "framebuffer", n.nvmlVgpuTypeGetFramebufferSize, type_id)
            self._types[type_id] = (_text(name) if name else None, fb)
        return self._types[type_id]


def _try(n: Any, r: VgpuReading, what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except n.NVMLError:
        r.absent.append(what)
        return None


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _uuid(v: Any) -> str | None:
    text = _text(v).strip().lower() if v else ""
    return text if ids.is_mdev_uuid(text) else None


def now() -> float:
    return time.time()
