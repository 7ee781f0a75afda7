"""The host lock: exclusive across processes and threads, re-entrant per thread, names its holder."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vgpumgr.errors import Busy
from vgpumgr.hostfs.locking import default_lock_path, host_lock

HOLDER = """
import sys, time
from vgpumgr.hostfs.locking import host_lock
with host_lock(sys.argv[1], timeout=5):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_holder_pid_is_written_and_cleared(tmp_path: Path) -> None:
    lock = tmp_path / "state" / "vgpumgr.lock"
    with host_lock(lock, timeout=1) as path:
        assert path == lock
        assert lock.read_text().strip() == str(os.getpid())
    assert lock.read_text() == ""


def test_another_process_makes_us_wait_then_busy_names_it(tmp_path: Path) -> None:
    lock = tmp_path / "vgpumgr.lock"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with pytest.raises(Busy) as info:
            with host_lock(lock, timeout=0.3):
                pytest.fail("got a lock another process holds")
        assert time.monotonic() - started >= 0.3
        assert f"process {proc.pid}" in str(info.value) and info.value.detail["holder_pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()
    with host_lock(lock, timeout=2):  # the lock died with its holder
        pass


def test_threads_exclude_each_other(tmp_path: Path) -> None:
    lock = tmp_path / "vgpumgr.lock"
    inside = 0
    overlaps: list[int] = []

    def worker() -> None:
        nonlocal inside
        for _ in range(20):
            with host_lock(lock, timeout=10, poll=0.001):
                inside += 1
                overlaps.append(inside)
                time.sleep(0.001)
                inside -= 1

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(overlaps) == 60 and max(overlaps) == 1


def test_reentrant_in_one_thread_but_not_across_threads(tmp_path: Path) -> None:
    lock = tmp_path / "vgpumgr.lock"
    seen: list[BaseException] = []
    with host_lock(lock, timeout=0):
        with host_lock(lock, timeout=0):
            pass
        # still held after the inner block ends
        t = threading.Thread(target=lambda: _try(lock, seen))
        t.start()
        t.join()
    assert len(seen) == 1 and isinstance(seen[0], Busy)


def _try(lock: Path, seen: list[BaseException]) -> None:
    try:
        with host_lock(lock, timeout=0):
            pass
    except Busy as exc:
        seen.append(exc)


def test_default_path_follows_the_state_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path))
    assert default_lock_path() == tmp_path / "vgpumgr.lock"
    with host_lock(timeout=0):
        assert (tmp_path / "vgpumgr.lock").read_text().strip() == str(os.getpid())
