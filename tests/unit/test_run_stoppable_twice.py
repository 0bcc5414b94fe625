"""Workers.run_stoppable: a cancel of the caller sets the work's stop and
waits for the work to return, so that once the caller's cancel is through
nothing more of the work happens (a cancelled build's COPY has stopped
writing into the step sandbox its caller then destroys). A second cancel
while it waits (a `cancel`, then the client's connection closing) must not
cut that wait short."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dsecd.engine.workers import Workers


def test_a_second_cancel_does_not_end_the_wait_for_the_stopped_work():
    stop, started, gate, returned = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def work():
        started.set()
        stop.wait()
        gate.wait()             # the chunk it was writing when the stop came
        returned.set()

    async def run():
        workers = Workers(1)
        workers.start(asyncio.get_running_loop())
        try:
            task = asyncio.ensure_future(workers.run_stoppable(stop, work))
            while not started.is_set():
                await asyncio.sleep(0.001)
            task.cancel()
            for _ in range(10):
                await asyncio.sleep(0)
            task.cancel()
            for _ in range(20):
                await asyncio.sleep(0)
            ended_early = task.done() and not returned.is_set()
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            return ended_early
        finally:
            gate.set()
            workers.pool.shutdown(wait=True)

    assert not asyncio.run(run()), "the caller's cancel was through while its work still ran"
