"""A host's summary summed afresh after its changes commit (PostgreSQL).

A change writes its GPUs' rows and moves the host one generation on, leaving the host's per-type summary
(fleet_host_types) behind (vgpumgr.fleet.writes, _PG_CHANGE). Until the summary is true again every reader takes
that host from its own rows (vgpumgr.fleet.ranked.irregular, vgpumgr.fleet.store), so every answer stays exact;
only that host costs a reader a few rows more. A thread of the publishing process then sums the summary afresh, off
the change's path, in a transaction of its own on a connection of its own: QUIET_S after the last change of a
burst and at most LATEST_S after the first, so a burst is summed once and the sum seldom holds the host's publish
lock when its next change comes.

Where another publish of the host holds the lock (a change, a full publish) the sum is tried again later; a process
that ends first sums at its exit (`settle`); and a heartbeat sums a host it finds behind (a process killed first).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from typing import Any

from sqlalchemy import text

log = logging.getLogger("vgpumgr.fleet")
QUIET_S = 0.05  # after a host's last change
LATEST_S = 5.0  # after the first change still unsummed: a host changing without a pause is summed that often
IDLE_S = 2.0  # with nothing due, the thread ends and its connection closes


class Follower:
    """One host's summary, summed afresh after its changes (`due`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._cond = threading.Condition()
        self._due: int | None = None  # the host id whose summary is behind
        self._busy: int | None = None  # the host id the thread sums now
        self._summing = threading.Lock()
        self._first = self._last = 0.0
        self._thread: threading.Thread | None = None
        self._engine: Any = None
        self.spent_ms: deque[float] = deque(maxlen=10_000)  # each sum's time (scripts/bench_fleet.py)
        _followers.add(self)

    def due(self, host_id: int) -> None:
        """A change of the host committed: its summary is behind."""
        with self._cond:
            now = time.monotonic()
            if self._due is None:
                self._first = now
            self._due, self._last = host_id, now
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="vgpumgr-fleet-follow", daemon=True)
                self._thread.start()
            self._cond.notify()

    def settle(self) -> None:
        """Sum now what is due or being summed, waiting for the host's lock (a process's exit; tests)."""
        with self._cond:
            host = self._due if self._due is not None else self._busy
            self._due = None
        if host is not None:
            self._sum(host, wait=True)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._due is None or time.monotonic() < self._at():
                    if self._due is None:
                        if not self._cond.wait(IDLE_S) and self._due is None:
                            self._close()
                            return
                    else:
                        self._cond.wait(max(0.0, self._at() - time.monotonic()))
                host, self._due = self._due, None
                self._busy = host
            done = self._sum(host, wait=False)
            with self._cond:
                self._busy = None
                if not done:  # the lock was held: again, after the holder (whose change marks it due too)
                    if self._due is None:
                        self._due, self._first = host, time.monotonic()
                    self._last = time.monotonic()

    def _at(self) -> float:
        return min(self._last + QUIET_S, self._first + LATEST_S)

    def _sum(self, host_id: int, wait: bool) -> bool:
        """True where the sum was done or cannot be (logged: the next heartbeat sums it)."""
        from vgpumgr.fleet import writes

        with self._summing:
            started = time.perf_counter()
            try:
                with self._open().begin() as s:
                    if not wait and not writes.try_lock_host(s, host_id):
                        return False
                    if wait:
                        s.execute(text("SET LOCAL lock_timeout = '10s'"))  # an exit waits no longer for a holder
                        writes.lock_host(s, host_id)
                    writes.refresh_types(s, host_id)
            except Exception as exc:  # noqa: BLE001 - off the change's path: its host is read from its rows
                log.warning("fleet: could not sum this host's summary after a change (%s); the heartbeat sums it",
                            exc)
                return True
            self.spent_ms.append((time.perf_counter() - started) * 1000)
            return True

    def _open(self) -> Any:
        from vgpumgr.db.session import make_engine, session_factory

        with self._cond:
            if self._engine is None:
                self._engine = make_engine(self.url, pool_size=1, max_overflow=1)
            return session_factory(self._engine)

    def close(self) -> None:
        """Its connection closed, where its thread is not running (a later sum opens another)."""
        with self._cond:
            if self._thread is None:
                self._close()

    def _close(self) -> None:
        """With self._cond held: the thread ends, its connection closes."""
        self._thread = None
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


_followers: weakref.WeakSet[Follower] = weakref.WeakSet()


@atexit.register
def settle_all() -> None:
    """Every follower of this process sums what is due, and closes its connection."""
    for f in list(_followers):
        f.settle()
        f.close()
