"""Each vGPU's share of GPU time, from the vGPU scheduler's log, next to the share its policy promises
(docs/sources.md §24).

The driver keeps the last 200 time slices per GPU (`nvmlDeviceGetVgpuSchedulerLog`; "call at least 5 times a
second" to see them all). Each read's new entries (newer than the newest seen) make one piece of the GPU's
timeline: from where the previous piece ended (or, when entries were lost in between, from the first new slice's
start) to the newest slice's end, with the run time of each software runlist in it. A vGPU's share over the
window (the last minute) is its run time over the pieces' span. A vGPU is "busy" when it ran its slices to their
end (run time >= 90 % of the target slice): it asked for the GPU and got what it was given.

Promised: equal share 1/n of the GPU's running vGPUs; fixed share 1/(max instances of the vGPU's type); best
effort nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Any

WINDOW_S = 60.0
BUSY = 0.9


class ShareTracker:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_ns = int(window_s * 1e9)
        self._pieces: dict[str, deque[tuple[int, int, dict[int, list[int]]]]] = {}
        self._last: dict[str, int] = {}
        self.lost: dict[str, int] = {}

    def feed(self, gpu: str, entries: list[dict[str, int]]) -> None:
        """One read of the GPU's log (vgpumgr.nvidia.scheduler.read_log's entries)."""
        entries = sorted(entries, key=lambda e: e["timestamp_ns"])
        if not entries:
            return
        last = self._last.get(gpu)
        new = [e for e in entries if last is None or e["timestamp_ns"] > last]
        if not new:
            return
        if last is None or entries[0]["timestamp_ns"] > last:
            if last is not None:  # the log moved past entries nobody read
                self.lost[gpu] = self.lost.get(gpu, 0) + 1
            start = new[0]["timestamp_ns"] - new[0]["run_ns"]
        else:
            start = last
        runs: dict[int, list[int]] = {}
        for e in new:
            acc = runs.setdefault(e["runlist"], [0, 0])
            acc[0] += e["run_ns"]
            acc[1] += e["target_ns"]
        end = new[-1]["timestamp_ns"]
        pieces = self._pieces.setdefault(gpu, deque())
        pieces.append((start, end, runs))
        self._last[gpu] = end
        while pieces and pieces[0][1] < end - self.window_ns:
            pieces.popleft()

    def forget(self, gpu: str) -> None:
        self._pieces.pop(gpu, None)
        self._last.pop(gpu, None)

    def shares(self, gpu: str) -> dict[str, Any] | None:
        """{"window_s", "lost_reads", "runlists": {runlist: {"share", "busy"}}}; None before any entry."""
        pieces = self._pieces.get(gpu)
        if not pieces:
            return None
        span = sum(end - start for start, end, _ in pieces)
        total: dict[int, list[int]] = {}
        for _s, _e, runs in pieces:
            for rl, (run, target) in runs.items():
                acc = total.setdefault(rl, [0, 0])
                acc[0] += run
                acc[1] += target
        return {"window_s": round(span / 1e9, 3), "lost_reads": self.lost.get(gpu, 0),
                "runlists": {rl: {"share": run / span if span else 0.0,
                                  "busy": bool(target) and run >= BUSY * target}
                             for rl, (run, target) in total.items()}}


def expected(policy: str | None, running: int, max_instances: int | None) -> float | None:
    """The share the policy promises one running vGPU."""
    if policy == "equal-share" and running:
        return 1.0 / running
    if policy == "fixed-share" and max_instances:
        return 1.0 / max_instances
    return None


def shortfalls(snap: dict[str, Any], tolerance: float = 0.2) -> list[dict[str, Any]]:
    """Busy VMs that got clearly less than promised: share < expected x (1 - tolerance)."""
    out = []
    for r in snap["vgpus"]:
        sch = r.get("scheduler") or {}
        want, got = sch.get("expected"), sch.get("share")
        if want is None or got is None or not sch.get("busy"):
            continue
        if got < want * (1.0 - tolerance):
            out.append({"vm": r["vm"] or r["vm_uuid"], "vgpu": r["vgpu"], "gpu": r["gpu"], "type": r["type"],
                        "policy": sch.get("policy"), "share": round(got, 4), "expected": round(want, 4),
                        "window_s": sch.get("window_s"),
                        "evidence": f"busy, got {got:.1%} of the GPU's time over {sch.get('window_s')} s; "
                                    f"{sch.get('policy')} promises {want:.1%}"})
    return out
