"""The heartbeat of `vgpumgr serve`: this host published in full at start and every VGPUMGR_FLEET_HEARTBEAT
seconds, on a thread of its own. A failed beat is logged and the next one tries again; a host whose beats stop
(killed, hung, cut off from the database) goes stale for every reader after its window."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vgpumgr.fleet")


class Heartbeat:
    def __init__(self, beat: Callable[[], Any], interval_s: float) -> None:
        self.beat, self.interval_s = beat, interval_s
        self.beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="vgpumgr-fleet-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
                self.beats += 1
            except Exception as exc:  # noqa: BLE001 - the database may be away for a while; keep beating
                log.warning("fleet heartbeat failed: %s", exc)
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._thread = None
