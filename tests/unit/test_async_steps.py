"""dsecd/steps.py AsyncSteps: the create path's checklist (no root)."""

from __future__ import annotations

import asyncio

import pytest

from dsecd.steps import AsyncSteps


def test_undos_run_in_reverse_on_failure_and_not_after_commit():
    done: list[str] = []

    async def async_undo():
        done.append("b")

    async def go(fail: bool):
        async with AsyncSteps("t") as steps:
            steps.undo("a", lambda: done.append("a"))
            steps.undo("b", async_undo)
            steps.undo("c", lambda: done.append("c"))
            if fail:
                raise RuntimeError("step 4 failed")
            steps.commit()

    with pytest.raises(RuntimeError, match="step 4"):
        asyncio.run(go(True))
    assert done == ["c", "b", "a"]
    done.clear()
    asyncio.run(go(False))
    assert done == []


def test_a_failing_undo_is_logged_and_the_rest_still_run(caplog):
    done: list[str] = []

    async def go():
        async with AsyncSteps("t") as steps:
            steps.undo("a", lambda: done.append("a"))
            steps.undo("broken", lambda: 1 / 0)
            raise KeyError("original")

    with pytest.raises(KeyError):
        asyncio.run(go())
    assert done == ["a"] and "undo step 'broken' failed" in caplog.text


def test_handed_over_undos_run_once_by_whoever_calls_first():
    done: list[str] = []

    async def go():
        async with AsyncSteps("t") as steps:
            steps.undo("ids", lambda: done.append("ids"))
            steps.undo("forget", lambda: done.append("forget"))
            steps.undo("layers", lambda: done.append("layers"))
            release = steps.hand_over("ids", "layers")
            steps.undo("both", release)           # taken back after the work finished
            release()                             # the work's own handler ran it first
            raise RuntimeError

    with pytest.raises(RuntimeError):
        asyncio.run(go())
    assert done == ["layers", "ids", "forget"]     # the hand-over ran once; the rest in reverse


def test_a_cancelled_request_leaves_handed_over_undos_to_their_new_owner():
    done: list[str] = []
    later: list = []

    async def go():
        async with AsyncSteps("t") as steps:
            steps.undo("ids", lambda: done.append("ids"))
            steps.undo("forget", lambda: done.append("forget"))
            later.append(steps.hand_over("ids"))
            await asyncio.sleep(10)               # cancelled here, like a create during its spawn

    async def main():
        task = asyncio.ensure_future(go())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert done == ["forget"]
    later[0]()
    assert done == ["forget", "ids"]


def test_drop_and_unknown_names():
    steps = AsyncSteps("t")
    steps.undo("netns", lambda: None)
    steps.drop("netns")
    with pytest.raises(ValueError, match="no undo step named"):
        steps.hand_over("netns")
