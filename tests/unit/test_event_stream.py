"""The `events` stream (dsecd/engine/events.py): a replay followed by live
events misses none published while the replay was being sent (no root)."""

from __future__ import annotations

import asyncio

from dsecd.engine.events import EventBus
from dsecd.protocol import Events


class _SlowClient:
    """A stream's ctx whose every emit waits for the loop, as a socket
    write does; `during` runs at the first one."""

    def __init__(self, during=None):
        self.got: list[dict] = []
        self.during = during

    async def emit(self, ev: dict) -> None:
        if self.during is not None:
            self.during()
            self.during = None
        await asyncio.sleep(0)
        self.got.append(ev)


def test_events_published_during_the_replay_follow_it():
    async def run() -> list[str]:
        bus = EventBus()
        bus.publish("created", "a")
        bus.publish("paused", "a")
        ctx = _SlowClient(during=lambda: bus.publish("destroyed", "a"))
        stream = asyncio.ensure_future(bus.stream(Events(replay=True), ctx))
        for _ in range(50):
            await asyncio.sleep(0)
        stream.cancel()
        return [ev["event"] for ev in ctx.got]

    assert asyncio.run(run()) == ["created", "paused", "destroyed"]


def test_no_event_comes_twice_between_replay_and_live():
    async def run() -> list[int]:
        bus = EventBus()
        for _ in range(3):
            bus.publish("created", "a")
        ctx = _SlowClient()
        stream = asyncio.ensure_future(bus.stream(Events(replay=True), ctx))
        for _ in range(10):
            await asyncio.sleep(0)
        bus.publish("destroyed", "a")
        for _ in range(10):
            await asyncio.sleep(0)
        stream.cancel()
        return [ev["seq"] for ev in ctx.got]

    assert asyncio.run(run()) == [1, 2, 3, 4]


def test_a_stream_of_one_sandbox_hears_that_it_lost_events():
    async def run() -> list[dict]:
        bus = EventBus(per_subscriber=2)
        bus.named = lambda sb_id: sb_id
        ctx = _SlowClient()
        stream = asyncio.ensure_future(bus.stream(Events(sandbox="a"), ctx))
        await asyncio.sleep(0)                    # subscribed
        bus.publish("paused", "a")                # pushed out by the others: lost
        for _ in range(3):
            bus.publish("created", "b")
        bus.publish("resumed", "a")
        for _ in range(10):
            await asyncio.sleep(0)
        stream.cancel()
        return ctx.got

    got = asyncio.run(run())
    assert [ev["event"] for ev in got] == ["resumed"]
    assert got[0]["lost_before"] >= 1
