"""The service samples its vGPUs every `VGPUMGR_TELEMETRY_INTERVAL` seconds (default 5) on a thread of its own
into the history; `/metrics`, `top` and the web view read the newest sample (taken on demand when none is
fresh, e.g. without the thread)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from vgpumgr.ops.context import Context
from vgpumgr.telemetry import snapshot
from vgpumgr.telemetry.history import History
from vgpumgr.telemetry.read import Reader

log = logging.getLogger("vgpumgr.telemetry")
INTERVAL_ENV = "VGPUMGR_TELEMETRY_INTERVAL"
LOG_POLL_S = 0.15  # NVML: "at least 5 times a second"; 200 slices of 1 ms last 0.2 s


def interval_seconds() -> float:
    try:
        value = float(os.environ.get(INTERVAL_ENV, "5"))
    except ValueError:
        return 5.0
    return min(max(value, 0.2), 3600.0)


class Sampler:
    def __init__(self, svc: Context, interval: float | None = None, span: float = 3600.0) -> None:
        from vgpumgr.nvidia.facts import nvml_layer
        from vgpumgr.nvidia.nvml import NvmlLayer

        self.svc = svc
        self.interval = interval or interval_seconds()
        self.history = History(span, self.interval)
        self.reader = Reader(nvml_layer(svc.cfg) or NvmlLayer(None, notice="NVML is not available here"))
        self._latest: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log_thread: threading.Thread | None = None
        self.notices_said: set[str] = set()
        from vgpumgr.telemetry.guest_sampler import GuestSampler

        self.guests = GuestSampler(svc)

    def sample(self) -> dict[str, Any]:
        with self._lock:  # one reader, one pass at a time
            snap = snapshot.take(self.svc, self.reader, self.guests.readings())
            from vgpumgr.ops import licence_delivery

            licence_delivery.note_licensed(self.svc, snap)
            for notice in snap["notices"] + [a["reason"] for a in snap["absent"]]:
                if notice not in self.notices_said:  # absent data is said once, not on every pass
                    self.notices_said.add(notice)
                    log.info("%s", notice)
            self.history.add(snap)
            self._latest = snap
            return snap

    def latest(self, max_age: float | None = None) -> dict[str, Any]:
        import time

        snap = self._latest
        if snap is None or time.time() - snap["taken"] > (self.interval if max_age is None else max_age):
            snap = self.sample()
        return snap

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vgpumgr-telemetry", daemon=True)
            self._thread.start()
            self._log_thread = threading.Thread(target=self._poll_logs, name="vgpumgr-scheduler-log", daemon=True)
            self._log_thread.start()
            self.guests.start()

    def stop(self) -> None:
        self._stop.set()
        self.guests.stop()
        for t in (self._thread, self._log_thread):
            if t is not None:
                t.join(timeout=5)

    def _poll_logs(self) -> None:
        """The vGPU scheduler's log holds the last 200 time slices: read 5 times a second (NVML's advice)."""
        while not self._stop.wait(LOG_POLL_S):
            try:
                with self._lock:
                    self.reader.poll_logs()
            except Exception:  # noqa: BLE001 - a failed read must not end the polling
                log.exception("scheduler log read failed")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed pass must not end the sampling
                log.exception("telemetry sample failed")
            self._stop.wait(self.interval)
