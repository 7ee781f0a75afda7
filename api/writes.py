"""vGPU allocations and releases of this process run one at a time, on a worker thread.

They serialise anyway, on the host lock (from the decision to the kernel write) and on SQLite's single
writer (the transactions after it), so more threads add only contention: 16 clients over the unix socket,
measured on the 2-core machine (two alternated 10 s runs each), cost 13.8 ms of server CPU per
allocate+release pair with the thread pool's 40 threads and 11.4 ms with one at a time (70 and 81
pairs/s), and p99 fell from ~590 to ~340 ms. Requests wait for their turn on the event loop, which stays
free for reads; a wait past the host lock's own timeout is answered Busy, as the host lock would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread
from fastapi import FastAPI

from vgpumgr.errors import Busy

T = TypeVar("T")
WAIT_SECONDS = 30.0  # Context.locked's default timeout


def _turns(app: FastAPI) -> anyio.CapacityLimiter:
    """The app's limiter, made on first use inside its event loop (one thread: no race). A limiter's waiters
    belong to one loop; a server has one, a TestClient without `with` starts one per request."""
    loop = asyncio.get_running_loop()
    made = getattr(app.state, "vgpu_writes", None)
    if made is None or made[0] is not loop:
        made = app.state.vgpu_writes = (loop, anyio.CapacityLimiter(1))
    return made[1]


async def one_at_a_time(app: FastAPI, work: Callable[[], T]) -> T:
    """`work()` on a worker thread once no other vGPU write of this app runs."""
    turns = _turns(app)
    with anyio.move_on_after(WAIT_SECONDS) as waited:
        await turns.acquire()
    if waited.cancelled_caught:
        raise Busy(f"other allocations and releases of this service ran for more than {WAIT_SECONDS:.0f} s "
                   "before this one's turn", hint="retry in a moment")
    try:
        return await anyio.to_thread.run_sync(work)
    finally:
        turns.release()
