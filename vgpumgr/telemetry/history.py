"""The last hour of utilisation per vGPU and per GPU, in memory (docs/sources.md §19).

Kept in the service's memory, not in a table: only this host's service reads it (the web view's charts of
the last hour), a restart may lose it without harm (Prometheus, scraping /metrics, is the long-term store),
and writing every vGPU's sample every few seconds into the database a fleet shares would load the one
PostgreSQL every host depends on. Bounded: each series is a ring of fixed size (span / interval samples) of
one byte per engine (whole percent) and one float for the time: 8 GPUs x 32 vGPUs at the default 5 s over
an hour is about 2.7 MB. A series not seen for a whole span is dropped.
"""

from __future__ import annotations

import threading
from array import array
from typing import Any

from vgpumgr.telemetry.read import ENGINES


class Ring:
    def __init__(self, size: int) -> None:
        self.size = size
        self.times = array("d", [0.0] * size)
        self.values = {e: array("B", bytes(size)) for e in ENGINES}
        self.count = 0  # samples ever added
        self.last = 0.0

    def add(self, at: float, util: dict[str, float | None]) -> None:
        i = self.count % self.size
        self.times[i] = at
        for e in ENGINES:
            v = util.get(e)
            self.values[e][i] = 0 if v is None else max(0, min(100, int(round(v * 100))))
        self.count += 1
        self.last = at

    def points(self, since: float) -> list[tuple[float, dict[str, int]]]:
        n = min(self.count, self.size)
        start = self.count - n
        out = []
        for k in range(start, self.count):
            i = k % self.size
            if self.times[i] >= since:
                out.append((self.times[i], {e: self.values[e][i] for e in ENGINES}))
        return out


class History:
    def __init__(self, span_s: float = 3600.0, interval_s: float = 5.0) -> None:
        self.span_s = span_s
        self.size = max(2, int(span_s / max(interval_s, 0.1)) + 1)
        self._series: dict[tuple[str, ...], Ring] = {}
        self._labels: dict[tuple[str, ...], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def add(self, snap: dict[str, Any]) -> None:
        at = snap["taken"]
        with self._lock:
            for row in snap["vgpus"]:
                key = ("vgpu", row["gpu"], str(row["vgpu"] or row["instance"]))
                self._ring(key, {"vm": row["vm"] or row["vm_uuid"], "type": row["type"], "gpu": row["gpu"],
                                 "vgpu": row["vgpu"]}).add(at, row["util"])
            for g in snap["gpus"]:
                self._ring(("gpu", g["gpu"]), {"gpu": g["gpu"]}).add(at, g["util"])
            for key in [k for k, r in self._series.items() if r.last < at - self.span_s]:
                del self._series[key], self._labels[key]

    def _ring(self, key: tuple[str, ...], labels: dict[str, Any]) -> Ring:
        ring = self._series.get(key)
        if ring is None:
            ring = self._series[key] = Ring(self.size)
        self._labels[key] = labels  # the newest names (a renamed VM)
        return ring

    def series(self, kind: str, since: float) -> list[dict[str, Any]]:
        """[{"labels": {...}, "points": [(t, {engine: percent})]}] of one kind ("vgpu" or "gpu")."""
        with self._lock:
            return [{"labels": dict(self._labels[k]), "points": r.points(since)}
                    for k, r in sorted(self._series.items()) if k[0] == kind]

    def nbytes(self) -> int:
        with self._lock:
            return sum(r.times.itemsize * r.size + len(ENGINES) * r.size for r in self._series.values())
