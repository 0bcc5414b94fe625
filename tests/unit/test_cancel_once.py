"""cancel_once (dsecd/onloop.py): the connection's close, the daemon's stop
and the keyed requests' close may each end the same request; its undoing,
begun by the first cancel, runs whole."""

from __future__ import annotations

import asyncio

import pytest

from dsecd.onloop import cancel_once


def _undoing_task(undone: list[str]) -> tuple[asyncio.Task, asyncio.Event, asyncio.Event]:
    """A task whose undoing takes turns of the loop: it waits for `release`
    once `undoing` is set, then says it was undone."""
    undoing, release = asyncio.Event(), asyncio.Event()

    async def run() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            undoing.set()
            await release.wait()
            undone.append("whole")
            raise

    return asyncio.ensure_future(run()), undoing, release


def test_a_task_cancelled_twice_through_cancel_once_is_undone_whole():
    undone: list[str] = []

    async def go() -> None:
        task, undoing, release = _undoing_task(undone)
        await asyncio.sleep(0)
        cancel_once(task)                 # the first closer
        await undoing.wait()
        cancel_once(task)                 # the second, while the first's undoing runs
        await asyncio.sleep(0.01)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert undone == ["whole"], undone


def test_a_task_not_cancelled_yet_is_cancelled():
    async def go() -> asyncio.Task:
        task = asyncio.ensure_future(asyncio.Event().wait())
        await asyncio.sleep(0)
        cancel_once(task)
        await asyncio.wait({task})
        return task

    assert asyncio.run(go()).cancelled()
