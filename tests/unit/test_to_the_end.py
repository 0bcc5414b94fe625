"""to_the_end (dsecd/engine/workers.py): a change of state, once begun,
runs to its end though its request is cancelled, the cancelled request
ends after it (its final frame then comes after the change), and the
daemon's stop waits for it (finish_under_way) before the journal closes."""

from __future__ import annotations

import asyncio

import pytest

from dsecd.engine.workers import finish_under_way, to_the_end


def test_a_cancelled_request_ends_after_its_change_and_the_stop_waits_for_it():
    ended = []

    async def change(delay):
        await asyncio.sleep(delay)
        ended.append(delay)

    async def run():
        request = asyncio.ensure_future(to_the_end(change(0.2)))
        await asyncio.sleep(0.05)
        request.cancel()                    # a `cancel`, or the server's stop
        stopping = asyncio.ensure_future(finish_under_way(5.0))
        await asyncio.sleep(0)
        assert ended == [] and not stopping.done()      # the change runs on, and the stop waits for it
        with pytest.raises(asyncio.CancelledError):
            await request
        assert ended == [0.2]               # the cancelled request ended after its change
        assert await stopping == []

    asyncio.run(run())


def test_the_stop_waits_only_so_long():
    async def run():
        request = asyncio.ensure_future(to_the_end(asyncio.sleep(2)))
        await asyncio.sleep(0.01)
        assert await finish_under_way(0.05) == ["sleep (no request)"]     # what it is, for the log
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request

    asyncio.run(run())


def test_work_behind_an_answer_given_to_before_stop_is_waited_for():
    """A job pause's VM save runs behind its answer: the stop waits for it too."""
    from dsecd.engine.workers import before_stop

    ended = []

    async def save():
        await asyncio.sleep(0.1)
        ended.append("saved")

    async def run():
        before_stop(asyncio.get_running_loop().create_task(save()))
        assert await finish_under_way(5.0) == []
        assert ended == ["saved"]

    asyncio.run(run())
