"""The host-wide lock around "choose a device + create it": one vgpumgr at a time per host.

flock() locks belong to an open file, so they vanish when the holder dies (no stale locks), and
two threads of one process that each open the file exclude each other too. The holder writes its
pid into the file so a waiter that times out can say who is in the way. Re-entering the lock from
the thread that already holds it is allowed (nested service calls).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vgpumgr.errors import Busy

LOCK_FILE = "vgpumgr.lock"
SYSTEM_STATE_DIR = Path("/var/lib/vgpumgr")

_held = threading.local()


def state_dir() -> Path:
    """Where the database and the lock live: $VGPUMGR_STATE_DIR, /var/lib/vgpumgr as root,
    else the user's state dir ($XDG_STATE_HOME/vgpumgr, default ~/.local/state/vgpumgr)."""
    override = os.environ.get("VGPUMGR_STATE_DIR")
    if override:
        return Path(override)
    if os.geteuid() == 0:
        return SYSTEM_STATE_DIR
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "vgpumgr"


def default_lock_path() -> Path:
    return state_dir() / LOCK_FILE


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


@contextmanager
def host_lock(path: str | os.PathLike[str] | None = None, timeout: float = 30.0,
              poll: float = 0.02) -> Iterator[Path]:
    """Hold the exclusive host lock at `path` (default: the state dir's vgpumgr.lock).

    Waits up to `timeout` seconds (0 = try once), then raises Busy naming the holder's pid."""
    lock_path = Path(path) if path is not None else default_lock_path()
    key = os.path.abspath(lock_path)
    depth: dict[str, int] = getattr(_held, "depth", None) or {}
    _held.depth = depth
    if depth.get(key):
        depth[key] += 1
        try:
            yield lock_path
        finally:
            depth[key] -= 1
        return

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read_holder(fd)
                    who = f"process {holder}" if holder else "another process"
                    raise Busy(
                        f"{who} holds the host lock {lock_path} (waited {timeout:g} s)",
                        hint=f"wait for it to finish and retry; check it with `ps -p {holder or '<pid>'}`",
                        holder_pid=int(holder) if holder else None,
                        lock=str(lock_path),
                    ) from None
                time.sleep(poll)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        depth[key] = 1
        try:
            yield lock_path
        finally:
            depth.pop(key, None)
            # Clear the pid before unlocking so nobody later blames a process that has let go.
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
