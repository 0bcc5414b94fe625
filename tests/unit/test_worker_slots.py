"""Workers.run_in_slot (dsecd/engine/workers.py): a slot bounds the work
running, so a request cancelled while its work runs keeps the slot until
the work is over (images.max_pulls: a cancelled pull converts the layers it
started before the next pull may begin)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dsecd.engine.workers import Workers


def _blocking(release: threading.Event, started: list, name: str):
    def work():
        started.append(name)
        assert release.wait(10), f"{name} was never released"
        return name
    return work


def test_a_cancelled_requests_slot_is_held_until_its_work_ends():
    async def main():
        workers = Workers(4)
        workers.start(asyncio.get_running_loop())
        slot = asyncio.Semaphore(1)
        first_free, second_free = threading.Event(), threading.Event()
        started: list[str] = []
        asked_to_stop = []
        first = asyncio.ensure_future(workers.run_in_slot(slot, lambda: asked_to_stop.append(1),
                                                          _blocking(first_free, started, "first")))
        while started != ["first"]:
            await asyncio.sleep(0.01)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert asked_to_stop == [1], "the cancel did not ask the work to stop"
        second = asyncio.ensure_future(workers.run_in_slot(slot, lambda: None,
                                                           _blocking(second_free, started, "second")))
        await asyncio.sleep(0.3)
        assert started == ["first"], "the second work started while the cancelled one still ran"
        first_free.set()
        while started != ["first", "second"]:
            await asyncio.sleep(0.01)
        second_free.set()
        assert await second == "second"
        assert not slot.locked()
        workers.shutdown()

    asyncio.run(main())


def test_a_request_cancelled_while_waiting_for_the_slot_runs_nothing():
    async def main():
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        slot = asyncio.Semaphore(1)
        free = threading.Event()
        started: list[str] = []
        holder = asyncio.ensure_future(workers.run_in_slot(slot, lambda: None, _blocking(free, started, "holder")))
        while not started:
            await asyncio.sleep(0.01)
        waiter = asyncio.ensure_future(workers.run_in_slot(slot, lambda: None, _blocking(free, started, "waiter")))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        free.set()
        assert await holder == "holder"
        await asyncio.sleep(0.1)
        assert started == ["holder"]
        assert not slot.locked(), "the cancelled waiter kept or leaked a slot"
        workers.shutdown()

    asyncio.run(main())


def test_a_failing_works_slot_comes_back_and_its_error_reaches_the_caller():
    async def main():
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        slot = asyncio.Semaphore(1)

        def fail():
            raise OSError(5, "the store went away")

        with pytest.raises(OSError, match="the store went away"):
            await workers.run_in_slot(slot, lambda: None, fail)
        assert not slot.locked()
        workers.shutdown()

    asyncio.run(main())
