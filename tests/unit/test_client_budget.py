"""The client's share of the daemon's per-connection request limit (client.conn._Budget)."""

import asyncio

import pytest

from dsecd.client import _Budget


def test_waiters_cancelled_while_queued_raise_cancelled_and_free_nothing():
    """A release that finds cancelled waiters at the head drops them; their
    own cancellation must then not fail (it was a ValueError)."""
    async def go():
        b = _Budget(1)
        await b.acquire(1)
        waiting = [asyncio.ensure_future(b.acquire(1)) for _ in range(3)]
        await asyncio.sleep(0)
        for w in waiting:
            w.cancel()
        b.release(1)                          # meets the cancelled waiters first
        for w in waiting:
            with pytest.raises(asyncio.CancelledError):
                await w
        assert b.free == 1 and not b._waiters
        await asyncio.wait_for(b.acquire(1), 1)    # the unit is there for the next one

    asyncio.run(go())


def test_a_unit_granted_as_its_waiter_is_cancelled_goes_back():
    async def go():
        b = _Budget(1)
        await b.acquire(1)
        w = asyncio.ensure_future(b.acquire(1))
        await asyncio.sleep(0)
        b.release(1)                          # granted...
        w.cancel()                            # ...and cancelled before it ran
        with pytest.raises(asyncio.CancelledError):
            await w
        assert b.free == 1

    asyncio.run(go())


def test_a_cancelled_waiter_does_not_hold_back_those_behind_it():
    """A waiter for 2 units at the head, cancelled: a waiter for 1 behind it
    gets the free unit at once."""
    async def go():
        b = _Budget(3)
        await b.acquire(2)
        big = asyncio.ensure_future(b.acquire(2))
        small = asyncio.ensure_future(b.acquire(1))
        await asyncio.sleep(0)
        assert b.free == 1 and not small.done()   # first come, first served: it waits behind big
        big.cancel()
        with pytest.raises(asyncio.CancelledError):
            await big
        await asyncio.wait_for(small, 1)

    asyncio.run(go())


def test_one_that_comes_as_a_waiter_is_handed_its_unit_queues_behind_it():
    """A unit released to a waiter is its own from then on, but its task
    runs on (and sends its request) only at the loop's next turn: one that
    came meanwhile and took a unit free at that moment went first. A
    Process's inputs, numbered in the order they came, then reached the
    daemon out of order, and the later was refused as past the bytes written."""
    async def go():
        b = _Budget(2)
        order = []

        async def request(name):
            await b.acquire(1)
            order.append(name)

        await b.acquire(1)
        await b.acquire(1)
        waiting = asyncio.ensure_future(request("came first"))
        await asyncio.sleep(0)
        after = asyncio.ensure_future(request("came after"))     # runs at the next turn, before...
        b.release(1)                          # ...the waiter, handed its unit now
        b.release(1)                          # and one more unit free
        await asyncio.wait_for(asyncio.gather(waiting, after), 1)
        assert order == ["came first", "came after"]
        assert b.free == 0 and not b._waiters

    asyncio.run(go())
