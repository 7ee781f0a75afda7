"""What NVML tells about each running vGPU, in the simulated NVML: utilisation per engine, framebuffer used,
encoder and FBC sessions, the frame rate limit, the guest's licence (docs/sources.md §19).

Each running vGPU (vgpumgr.sim.nvml_vgpus) carries a `load`: per engine a base percentage, and a `wobble`
(percentage points) by which the value moves over time, as a real guest's load does:

    value(t) = clamp(base + wobble * sin(2 * pi * t / 60 s + instance id), 0, 100)

so a test can compute what NVML answers at a given time (and freeze it with wobble 0); where the vGPUs of one
GPU together ask for more than 100 % of an engine, each gets its proportional share (`shares`). The framebuffer used,
encoder/FBC sessions, fps and latency, the frame rate limit and the licence state are set per guest
(vgpumgr.sim.guests.set_load / set_licence) and answered as they are. Every figure is the simulator's
choice; the calls, structures and states are NVML's.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any

import pynvml

ENGINES = ("sm", "mem", "enc", "dec", "jpg", "ofa")
DEFAULT_LOAD = {"sm": 0, "mem": 0, "enc": 0, "dec": 0, "jpg": 0, "ofa": 0, "wobble": 0}
PERIOD_S = 60.0


def engine_value(load: dict[str, Any], engine: str, instance_id: int, at: float) -> int:
    """What the simulated NVML answers for one engine of one running vGPU at time `at` (seconds)."""
    base, wobble = float(load.get(engine, 0)), float(load.get("wobble", 0))
    value = base + wobble * math.sin(2 * math.pi * at / PERIOD_S + instance_id)
    return int(round(min(100.0, max(0.0, value))))


def shares(instances: list[dict[str, Any]], at: float) -> list[dict[str, int]]:
    """Each running vGPU's utilisation per engine at `at`: what its load asks for, scaled down where the vGPUs of
    one GPU ask for more than the whole engine (they share its time: together they never pass 100 %)."""
    wanted = [{e: engine_value(i.get("load") or DEFAULT_LOAD, e, i["id"], at) for e in ENGINES} for i in instances]
    for e in ENGINES:
        total = sum(w[e] for w in wanted)
        if total > 100:
            for w in wanted:
                w[e] = w[e] * 100 // total
    return wanted


class VgpuTelemetry:
    """pynvml's per-vGPU telemetry calls, mixed into SimNvml (which supplies `_read`, `_instance`, `_type`)."""

    _read: Any
    _instance: Any
    _type: Any

    def nvmlDeviceGetVgpuInstancesUtilizationInfo(self, handle: Any, timestamp: int) -> list[Any]:  # noqa: N802
        gpu, _spec = self._read(handle, "nvmlDeviceGetVgpuInstancesUtilizationInfo")
        now = time.time()
        instances = list(gpu.get("vgpu_instances", ()))
        values = shares(instances, now)
        out = []
        for inst, v in zip(instances, values, strict=True):
            sample = pynvml.c_nvmlVgpuInstanceUtilizationInfo_v1_t()
            sample.timeStamp = int(now * 1_000_000)
            sample.vgpuInstance = inst["id"]
            for engine in ENGINES:
                getattr(sample, f"{engine}Util").uiVal = v[engine]
            out.append(sample)
        return out

    def nvmlVgpuInstanceGetFbUsage(self, vgpu_instance: int) -> int:  # noqa: N802
        inst = self._instance(vgpu_instance, "nvmlVgpuInstanceGetFbUsage")[1]
        total = self._type(inst["type_id"]).framebuffer_mb << 20
        used = int(inst.get("fb_used_mb", 0)) << 20
        return min(used, total)

    def nvmlVgpuInstanceGetEncoderStats(self, vgpu_instance: int) -> tuple[int, int, int]:  # noqa: N802
        enc = self._instance(vgpu_instance, "nvmlVgpuInstanceGetEncoderStats")[1].get("encoder") or {}
        return int(enc.get("sessions", 0)), int(enc.get("fps", 0)), int(enc.get("latency_us", 0))

    def nvmlVgpuInstanceGetFBCStats(self, vgpu_instance: int) -> Any:  # noqa: N802
        fbc = self._instance(vgpu_instance, "nvmlVgpuInstanceGetFBCStats")[1].get("fbc") or {}
        stats = pynvml.c_nvmlFBCStats_t()
        stats.sessionsCount, stats.averageFPS = int(fbc.get("sessions", 0)), int(fbc.get("fps", 0))
        stats.averageLatency = int(fbc.get("latency_us", 0))
        return stats

    def nvmlVgpuInstanceGetFrameRateLimit(self, vgpu_instance: int) -> int:  # noqa: N802
        inst = self._instance(vgpu_instance, "nvmlVgpuInstanceGetFrameRateLimit")[1]
        return int(inst.get("frame_rate_limit", 60))

    def nvmlVgpuInstanceGetLicenseInfo_v2(self, vgpu_instance: int) -> Any:  # noqa: N802
        from vgpumgr.sim.guest_licence import licence_of

        lic = licence_of(self._instance(vgpu_instance, "nvmlVgpuInstanceGetLicenseInfo_v2")[1])
        info = pynvml.c_nvmlVgpuLicenseInfo_t()
        state = int(lic.get("state", pynvml.NVML_GRID_LICENSE_STATE_UNINITIALIZED))
        info.currentState = state
        info.isLicensed = 1 if state == pynvml.NVML_GRID_LICENSE_STATE_LICENSED else 0
        expiry = lic.get("expiry")
        if expiry:
            t = datetime.fromtimestamp(float(expiry), UTC)
            e = info.licenseExpiry
            e.year, e.month, e.day, e.hour, e.min, e.sec = t.year, t.month, t.day, t.hour, t.minute, t.second
            e.status = 1
        return info

    def nvmlVgpuInstanceGetLicenseInfo(self, vgpu_instance: int) -> Any:  # noqa: N802
        return self.nvmlVgpuInstanceGetLicenseInfo_v2(vgpu_instance)
