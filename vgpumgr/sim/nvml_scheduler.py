"""The vGPU time-slice scheduler of each simulated GPU: capabilities, state and log, the old calls and the `_v2`
ones (docs/sources.md §24).

The GPU's own state and log answer NotSupported while MIG is on (NVML's change log, v570 to v575: "return
NVML_ERROR_NOT_SUPPORTED when in MIG mode"); the capabilities still answer. State, per GPU in the NVML state
file: `"scheduler": {"policy", "arr", "timeslice_ns", "avg_factor", "frequency"}` (policy 1 best effort, 2 equal
share, 3 fixed share). A simulated reboot puts it back to best effort (NVML's setting does not persist). NVML's
refusals as its header documents them: NotSupported while MIG is on or any vGPU instance exists on the GPU;
fixed share in mixed-size mode is refused as NotSupported too (the code is the simulator's choice; the rule is
NVIDIA's user guide).

The log follows the policy and what each running guest asks for (its `sm` load, vgpumgr.sim.nvml_telemetry):

- best effort: every vGPU gets what it asks; when together they ask for more than the GPU, proportionally less
  (idle time is given away);
- equal share: each busy vGPU gets at most 1/n of the GPU, n the busy vGPUs (a vGPU that asks for less leaves
  its slice idle);
- fixed share: each vGPU gets at most 1/(its type's max instances), whoever else runs.

Laid out as rounds of one time slice per vGPU that ran, each vGPU in instance order, packed at the round's
start; the entries are the last NVML_SCHEDULER_SW_MAX_LOG_ENTRIES slices before now, on a grid fixed in time so
two reads a moment apart share their common entries (as the driver's ring does). A log entry's software
runlist id is the vGPU instance id here: how a real driver numbers them is not documented. A test may make the
scheduler shorten a vGPU's slices (it then gets less than its share while using every slice it is given):
`"scheduler_fault": {"<instance id>": factor}` in the GPU's entry.

Per GPU instance (`nvmlGpuInstance{Get}VgpuScheduler{State,Log}` and their `_v2`; NVIDIA's header: "For
Blackwell GB20x or newer"): a GPU whose profile has `gi_scheduler` answers them for each of its GPU instances
while MIG is on, from `"scheduler"` in the GPU instance's entry (best effort when absent: the state does not
survive GPU instance creation or deletion), the log following the loads of the vGPUs on that GPU instance as
above; every other GPU answers NotSupported. The simulator has no per-GPU-instance set.
"""

from __future__ import annotations

import time
from typing import Any

import pynvml

from vgpumgr.sim.nvml_telemetry import DEFAULT_LOAD, engine_value

DEFAULT = {"policy": 1, "arr": 0, "timeslice_ns": 0, "avg_factor": 0, "frequency": 0}
MIN_TIMESLICE_NS, MAX_TIMESLICE_NS = 1_000_000, 30_000_000  # 1-30 ms (NVIDIA's user guide)
MIN_FREQUENCY, MAX_FREQUENCY = 63, 960  # Hz (the RmPVMRL ranges)
MIN_AVG_FACTOR, MAX_AVG_FACTOR = 1, 60
GRAPHICS = 1
MAX_ENTRIES = 200


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def default_timeslice_ns(max_instances: int) -> int:
    """2 ms when the type allows up to 8 vGPUs on the GPU, 1 ms when more (NVIDIA's user guide, §7.3)."""
    return 2_000_000 if max_instances <= 8 else 1_000_000


def granted(policy: int, wants: list[tuple[int, float, int]]) -> dict[int, float]:
    """Each vGPU's share of GPU time: `wants` is [(instance id, asked 0..1, its type's max instances)]."""
    if policy == 2:
        busy = [w for w in wants if w[1] > 0]
        return {i: min(asked, 1.0 / len(busy)) if busy else 0.0 for i, asked, _m in wants}
    if policy == 3:
        return {i: min(asked, 1.0 / max(1, m)) for i, asked, m in wants}
    total = sum(w[1] for w in wants)
    scale = 1.0 / total if total > 1.0 else 1.0
    return {i: asked * scale for i, asked, _m in wants}


class VgpuScheduler:
    """pynvml's scheduler calls, mixed into SimNvml (which supplies `_read`, `_mutate`, `_gpu`, `_type`)."""

    _read: Any
    _mutate: Any
    _gpu: Any
    _type: Any

    @staticmethod
    def _sched(gpu: dict[str, Any]) -> dict[str, Any]:
        return {**DEFAULT, **(gpu.get("scheduler") or {})}

    def _timeslice(self, gpu: dict[str, Any], sched: dict[str, Any], instances: Any = None) -> int:
        if sched["timeslice_ns"]:
            return int(sched["timeslice_ns"])
        if sched["frequency"]:
            return int(1_000_000_000 // sched["frequency"])
        instances = gpu.get("vgpu_instances", ()) if instances is None else instances
        most = max((self._type(i["type_id"]).max_instances for i in instances), default=8)
        return default_timeslice_ns(most)

    def _mig_on(self, gpu: dict[str, Any], spec: Any) -> bool:
        return bool(spec.mig_table and gpu["mig_mode"][0])

    def _device_sched(self, handle: Any, call: str) -> dict[str, Any]:
        """The GPU whose own scheduler is asked: NotSupported while MIG is on (NVML since R575)."""
        gpu, spec = self._read(handle, call)
        if self._mig_on(gpu, spec):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # -- capabilities and state ------------------------------------------------------------------
    def nvmlDeviceGetVgpuSchedulerCapabilities(self, handle: Any) -> Any:  # noqa: N802 - pynvml's names
        _gpu, spec = self._read(handle, "nvmlDeviceGetVgpuSchedulerCapabilities")
        caps = pynvml.c_nvmlVgpuSchedulerCapabilities_t()
        for i, policy in enumerate((1, 2, 3)):
            caps.supportedSchedulers[i] = policy
        caps.minTimeslice, caps.maxTimeslice = MIN_TIMESLICE_NS, MAX_TIMESLICE_NS
        caps.isArrModeSupported = 1
        caps.minFrequencyForARR, caps.maxFrequencyForARR = MIN_FREQUENCY, MAX_FREQUENCY
        caps.minAvgFactorForARR, caps.maxAvgFactorForARR = MIN_AVG_FACTOR, MAX_AVG_FACTOR
        return caps

    def nvmlDeviceGetVgpuSchedulerState(self, handle: Any) -> Any:  # noqa: N802
        gpu = self._device_sched(handle, "nvmlDeviceGetVgpuSchedulerState")
        state = pynvml.c_nvmlVgpuSchedulerGetState_t()
        self._fill_v1(gpu, state)
        return state

    def _fill_v1(self, gpu: dict[str, Any], out: Any, sched: Any = None, instances: Any = None) -> None:
        sched = self._sched(gpu) if sched is None else sched
        instances = gpu.get("vgpu_instances", ()) if instances is None else instances
        out.schedulerPolicy = sched["policy"]
        arr = bool(sched["arr"]) and sched["policy"] != 1
        out.arrMode = pynvml.NVML_VGPU_SCHEDULER_ARR_ENABLE if arr else pynvml.NVML_VGPU_SCHEDULER_ARR_DISABLE
        active = sched["policy"] != 1 and bool(instances)  # 0 when there is no active scheduling
        ts = self._timeslice(gpu, sched, instances) if active else 0
        if arr:
            out.schedulerParams.vgpuSchedDataWithARR.avgFactor = (sched["avg_factor"] or 33) if active else 0
            out.schedulerParams.vgpuSchedDataWithARR.timeslice = ts
        else:
            out.schedulerParams.vgpuSchedData.timeslice = ts

    def nvmlDeviceGetVgpuSchedulerState_v2(self, handle: Any, info: Any) -> Any:  # noqa: N802
        gpu = self._device_sched(handle, "nvmlDeviceGetVgpuSchedulerState_v2")
        sched = self._sched(gpu)
        if info.engineId != GRAPHICS:  # other engines: best effort (the header)
            info.schedulerPolicy, info.avgFactor, info.timeslice = 1, 0, 0
            return info
        active = sched["policy"] != 1 and bool(gpu.get("vgpu_instances"))
        info.schedulerPolicy = sched["policy"]
        info.avgFactor = (sched["avg_factor"] or 33) if active else 0
        info.timeslice = self._timeslice(gpu, sched) if active else 0
        return info

    # -- set -------------------------------------------------------------------------------------
    def _set(self, handle: Any, call: str, new: dict[str, Any]) -> int:
        try:  # the mode as the driver holds it (vgpumgr.sim.nvml_placement), read before this call's own lock
            mixed = bool(self.nvmlDeviceGetVgpuHeterogeneousMode(handle))  # type: ignore[attr-defined]
        except pynvml.NVMLError:
            mixed = False
        with self._mutate() as state:
            gpu, spec = self._gpu(state, handle, call)
            if self._mig_on(gpu, spec) or gpu.get("vgpu_instances"):
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if new["policy"] == 3 and mixed:
                raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if new["policy"] not in (1, 2, 3):
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            ts, freq, avg = new["timeslice_ns"], new["frequency"], new["avg_factor"]
            if (ts and not MIN_TIMESLICE_NS <= ts <= MAX_TIMESLICE_NS) or \
                    (freq and not MIN_FREQUENCY <= freq <= MAX_FREQUENCY) or \
                    (avg and not MIN_AVG_FACTOR <= avg <= MAX_AVG_FACTOR):
                raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            gpu["scheduler"] = dict(DEFAULT) if new["policy"] == 1 else new
        return pynvml.NVML_SUCCESS

    def nvmlDeviceSetVgpuSchedulerState(self, handle: Any, sched_state: Any) -> int:  # noqa: N802
        arr = sched_state.enableARRMode == pynvml.NVML_VGPU_SCHEDULER_ARR_ENABLE
        params = sched_state.schedulerParams
        new = {"policy": int(sched_state.schedulerPolicy), "arr": int(arr),
               "timeslice_ns": 0 if arr else int(params.vgpuSchedData.timeslice),
               "avg_factor": int(params.vgpuSchedDataWithARR.avgFactor) if arr else 0,
               "frequency": int(params.vgpuSchedDataWithARR.frequency) if arr else 0}
        return self._set(handle, "nvmlDeviceSetVgpuSchedulerState", new)

    def nvmlDeviceSetVgpuSchedulerState_v2(self, handle: Any, sched_state: Any) -> int:  # noqa: N802
        if sched_state.engineId != GRAPHICS:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        new = {"policy": int(sched_state.schedulerPolicy), "arr": 1, "timeslice_ns": 0,
               "avg_factor": int(sched_state.avgFactor), "frequency": int(sched_state.frequency)}
        return self._set(handle, "nvmlDeviceSetVgpuSchedulerState_v2", new)

    # -- log -------------------------------------------------------------------------------------
    def _entries(self, gpu: dict[str, Any], at: float, sched: Any = None,
                 instances: Any = None) -> tuple[int, list[dict[str, int]]]:
        """(time slice ns, the log's entries ending before `at`), oldest first: the GPU's, or with `sched` and
        `instances` given, one GPU instance's."""
        sched = self._sched(gpu) if sched is None else sched
        instances = sorted(gpu.get("vgpu_instances", ()) if instances is None else instances, key=lambda i: i["id"])
        slice_ns = self._timeslice(gpu, sched, instances)
        wants = [(i["id"], engine_value(i.get("load") or DEFAULT_LOAD, "sm", i["id"], at) / 100.0,
                  self._type(i["type_id"]).max_instances) for i in instances]
        got = granted(sched["policy"], wants)
        fault = {int(k): float(v) for k, v in (gpu.get("scheduler_fault") or {}).items()}
        got = {i: g * fault.get(i, 1.0) for i, g in got.items()}
        ran = [i for i in instances if got[i["id"]] > 0]
        if not ran:
            return slice_ns, []
        # a round: one slot per vGPU that ran (fixed share: one per instance the type allows, idle ones included)
        slots = max(w[2] for w in wants) if sched["policy"] == 3 else len(ran)
        round_ns = slice_ns * max(slots, len(ran))
        now_ns = int(at * 1e9)
        first_round = now_ns // round_ns - (MAX_ENTRIES // len(ran) + 2)
        out: list[dict[str, int]] = []
        for r in range(first_round, now_ns // round_ns + 1):
            offset = r * round_ns
            for inst in ran:
                run = int(got[inst["id"]] * round_ns)
                offset += run
                if offset > now_ns:
                    break
                since = int(float(inst.get("started", 0)) * 1e9)
                target = int(slice_ns * fault.get(inst["id"], 1.0))  # a fault shortens the vGPU's slices
                out.append({"timestamp": offset, "run": run, "runlist": inst["id"], "target": target,
                            "total": int(got[inst["id"]] * max(0, offset - since)), "preempt": 0,
                            "weight": 0})
        return slice_ns, out[-MAX_ENTRIES:]

    @staticmethod
    def _fill_entries(array: Any, entries: list[dict[str, int]], v2: bool) -> None:
        for k, e in enumerate(entries):
            a = array[k]
            a.timestamp, a.timeRun, a.timeRunTotal = e["timestamp"], e["run"], e["total"]
            a.swRunlistId, a.targetTimeSlice, a.cumulativePreemptionTime = e["runlist"], e["target"], e["preempt"]
            if v2:
                a.weight = e["weight"]

    def nvmlDeviceGetVgpuSchedulerLog(self, handle: Any) -> Any:  # noqa: N802
        gpu = self._device_sched(handle, "nvmlDeviceGetVgpuSchedulerLog")
        log = pynvml.c_nvmlVgpuSchedulerLog_t()
        log.engineId = GRAPHICS
        self._fill_v1(gpu, log)
        _slice, entries = self._entries(gpu, time.time())
        log.entriesCount = len(entries)
        self._fill_entries(log.logEntries, entries, v2=False)
        return log

    def nvmlDeviceGetVgpuSchedulerLog_v2(self, handle: Any, info: Any) -> Any:  # noqa: N802
        gpu = self._device_sched(handle, "nvmlDeviceGetVgpuSchedulerLog_v2")
        return self._log_v2(info, gpu, self._sched(gpu), None)

    def _log_v2(self, info: Any, gpu: dict[str, Any], sched: dict[str, Any], on_gi: list[dict[str, Any]] | None
                ) -> Any:
        """A `_v2` log of the GPU (`on_gi` None) or of one GPU instance's vGPUs; engines but graphics: empty."""
        if info.engineId != GRAPHICS:
            info.schedulerPolicy, info.avgFactor, info.timeslice, info.entriesCount = 1, 0, 0, 0
            return info
        slice_ns, entries = self._entries(gpu, time.time(), sched, on_gi)
        active = sched["policy"] != 1 and bool(gpu.get("vgpu_instances") if on_gi is None else on_gi)
        info.schedulerPolicy = sched["policy"]
        info.avgFactor = (sched["avg_factor"] or 33) if active else 0
        info.timeslice = slice_ns if active else 0
        info.entriesCount = len(entries)
        self._fill_entries(info.logEntries, entries, v2=True)
        return info

    # -- per GPU instance (Blackwell GB20x) ------------------------------------------------------------
    _gi: Any

    def _gi_sched(self, handle: Any, call: str) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        """(GPU, its scheduler state on this GPU instance, the vGPUs running there); NotSupported before GB20x."""
        gpu, spec = self._read(handle, call)
        if not (spec.gi_scheduler and self._mig_on(gpu, spec)):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gi = self._gi(gpu, handle)
        on_gi = [i for i in gpu.get("vgpu_instances", ()) if i.get("gi_id") == gi["id"]]
        return gpu, {**DEFAULT, **(gi.get("scheduler") or {})}, on_gi

    @staticmethod
    def _version(info: Any, wanted: int) -> None:
        if info.version != wanted:
            raise _err(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)

    def nvmlGpuInstanceGetVgpuSchedulerState(self, gi_handle: Any, info: Any) -> Any:  # noqa: N802
        gpu, sched, on_gi = self._gi_sched(gi_handle, "nvmlGpuInstanceGetVgpuSchedulerState")
        self._version(info, pynvml.nvmlVgpuSchedulerStateInfo_v1)
        self._fill_v1(gpu, info, sched if info.engineId == GRAPHICS else dict(DEFAULT), on_gi)
        return info

    def nvmlGpuInstanceGetVgpuSchedulerState_v2(self, gi_handle: Any, info: Any) -> Any:  # noqa: N802
        gpu, sched, on_gi = self._gi_sched(gi_handle, "nvmlGpuInstanceGetVgpuSchedulerState_v2")
        if info.engineId != GRAPHICS:  # other engines: best effort (the header)
            sched = dict(DEFAULT)
        active = sched["policy"] != 1 and bool(on_gi)
        info.schedulerPolicy = sched["policy"]
        info.avgFactor = (sched["avg_factor"] or 33) if active else 0
        info.timeslice = self._timeslice(gpu, sched, on_gi) if active else 0
        return info

    def nvmlGpuInstanceGetVgpuSchedulerLog(self, gi_handle: Any, info: Any) -> Any:  # noqa: N802
        gpu, sched, on_gi = self._gi_sched(gi_handle, "nvmlGpuInstanceGetVgpuSchedulerLog")
        self._version(info, pynvml.nvmlVgpuSchedulerLogInfo_v1)
        graphics = info.engineId == GRAPHICS
        self._fill_v1(gpu, info, sched if graphics else dict(DEFAULT), on_gi)
        entries = self._entries(gpu, time.time(), sched, on_gi)[1] if graphics else []
        info.entriesCount = len(entries)
        self._fill_entries(info.logEntries, entries, v2=False)
        return info

    def nvmlGpuInstanceGetVgpuSchedulerLog_v2(self, gi_handle: Any, info: Any) -> Any:  # noqa: N802
        gpu, sched, on_gi = self._gi_sched(gi_handle, "nvmlGpuInstanceGetVgpuSchedulerLog_v2")
        return self._log_v2(info, gpu, sched, on_gi)
