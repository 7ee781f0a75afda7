"""POST /v1/vgpus and DELETE /v1/vgpus/{ref} take turns on one worker thread per service process: they
serialise on the host lock anyway, and more threads only add contention (api/writes.py). What must hold:
the event loop stays free meanwhile, the writes never overlap, and a wait past the host lock's timeout
is answered Busy."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest
from fastapi import FastAPI

from api import writes
from vgpumgr.errors import Busy


def test_writes_take_turns_off_the_event_loop_which_stays_free() -> None:
    app = FastAPI()
    running = 0
    overlapped = False
    workers: set[int] = set()
    lock = threading.Lock()
    ticks = 0

    def work() -> int:
        nonlocal running, overlapped
        with lock:
            running += 1
            overlapped |= running > 1
        workers.add(threading.get_ident())
        time.sleep(0.05)  # blocking: must not hold up the loop
        with lock:
            running -= 1
        return 7

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(20):
            await anyio.sleep(0.01)
            ticks += 1

    async def main() -> list[int]:
        results: list[int] = []

        async def one() -> None:
            results.append(await writes.one_at_a_time(app, work))

        loop_thread = threading.get_ident()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for _ in range(4):
                tg.start_soon(one)
        assert loop_thread not in workers
        return results

    started = time.monotonic()
    assert anyio.run(main) == [7, 7, 7, 7]
    assert not overlapped
    assert time.monotonic() - started >= 0.2  # four turns of 50 ms, one after the other
    assert ticks == 20  # the loop ran its other tasks meanwhile


def test_a_wait_past_the_timeout_is_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    app = FastAPI()
    monkeypatch.setattr(writes, "WAIT_SECONDS", 0.1)
    release = threading.Event()

    async def main() -> Any:
        async with anyio.create_task_group() as tg:
            tg.start_soon(writes.one_at_a_time, app, lambda: release.wait(5))
            await anyio.sleep(0.02)
            with pytest.raises(Busy):
                await writes.one_at_a_time(app, lambda: None)
            release.set()
        return await writes.one_at_a_time(app, lambda: "next")  # the slot was given back

    assert anyio.run(main) == "next"


def test_a_failed_write_gives_its_turn_back() -> None:
    app = FastAPI()

    def fail() -> None:
        raise Busy("the host lock is held elsewhere", hint="retry")

    async def main() -> str:
        with pytest.raises(Busy):
            await writes.one_at_a_time(app, fail)
        with anyio.fail_after(1):
            return await writes.one_at_a_time(app, lambda: "next")

    assert anyio.run(main) == "next"
