"""Turns (dsecd/turns.py): the callers of one key take its lock in the
order they came, and its turn goes with its last caller, whether that one
went through or was cancelled while it waited."""

from __future__ import annotations

import asyncio

from dsecd.turns import Turn, Turns


def test_the_callers_of_a_key_go_in_the_order_they_came():
    async def go() -> list[str]:
        turns: Turns[str, Turn] = Turns(Turn)
        went: list[str] = []
        release = asyncio.Event()

        async def caller(tag: str) -> None:
            async with turns.taken("k"):
                if tag == "a":
                    await release.wait()       # the first holds the lock while the others queue
                went.append(tag)

        callers = [asyncio.ensure_future(caller(t)) for t in "abcd"]
        await asyncio.sleep(0)
        assert turns.get("k").users == 4
        release.set()
        await asyncio.gather(*callers)
        assert len(turns) == 0 and turns.get("k") is None
        return went

    assert asyncio.run(go()) == ["a", "b", "c", "d"]


def test_keys_have_turns_of_their_own():
    async def go() -> None:
        turns: Turns[str, Turn] = Turns(Turn)
        async with turns.taken("one") as one:
            async with turns.taken("two") as two:     # not queued behind "one"
                assert one is not two and len(turns) == 2
        assert len(turns) == 0

    asyncio.run(go())


def test_a_caller_cancelled_while_it_waits_leaves_the_turn_to_the_others_and_none_behind():
    async def go() -> None:
        turns: Turns[str, Turn] = Turns(Turn)
        release = asyncio.Event()

        async def holder() -> None:
            async with turns.taken("k"):
                await release.wait()

        async def waiter() -> None:
            async with turns.taken("k"):
                pass

        held = asyncio.ensure_future(holder())
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)
        assert turns.get("k").users == 2
        waiting.cancel()
        await asyncio.wait({waiting})
        assert turns.get("k").users == 1
        release.set()
        await held
        assert len(turns) == 0

    asyncio.run(go())


def test_a_turn_of_a_subclass_carries_what_it_adds():
    class Gate(Turn):
        def __init__(self):
            super().__init__()
            self.begun = asyncio.Event()

    async def go() -> None:
        turns: Turns[int, Gate] = Turns(Gate)
        async with turns.taken(7) as gate:
            assert isinstance(gate, Gate) and turns.get(7) is gate
            gate.begun.set()

    asyncio.run(go())
