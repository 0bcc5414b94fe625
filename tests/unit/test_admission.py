"""The create queue (dsecd/admission.py): bound, fairness across jobs, cancellation."""

import asyncio

import pytest

from dsecd.admission import CreateQueue
from dsecd.errors import Busy


def test_fair_across_jobs_and_bounded():
    async def run():
        q = CreateQueue(max_active=1, max_queued=50)
        order: list[str] = []
        gate = asyncio.Event()

        async def create(job: str):
            async with q.slot(job):
                order.append(job)
                await gate.wait()

        # Job "big" queues 30 creates before job "small" queues 5.
        tasks = [asyncio.create_task(create("big")) for _ in range(30)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(create("small")) for _ in range(5)]
        await asyncio.sleep(0)
        assert q.active == 1 and q.queued == 34
        assert q.info()["queued_by_job"] == {"big": 29, "small": 5}
        gate.set()
        await asyncio.gather(*tasks)
        return q, order

    q, order = asyncio.run(run())
    # Round-robin: "small" is done within the first 11 slots, not after all 30 "big".
    assert max(i for i, j in enumerate(order) if j == "small") <= 11
    assert q.active == 0 and q.queued == 0 and q.admitted == 35
    assert q.info()["wait_max_ms"] > 0


def test_full_queue_is_busy_at_once_with_retry_after():
    async def run():
        q = CreateQueue(max_active=1, max_queued=2)
        gate = asyncio.Event()

        async def create():
            async with q.slot("j"):
                await gate.wait()

        tasks = [asyncio.create_task(create()) for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(Busy) as err:
            async with q.slot("j"):
                pass
        gate.set()
        await asyncio.gather(*tasks)
        return q, err.value

    q, err = asyncio.run(run())
    assert err.detail["retry_after_s"] > 0 and err.detail["queued"] == 2
    assert q.rejected == 1


def test_cancelled_waiter_leaves_no_slot_behind():
    async def run():
        q = CreateQueue(max_active=1, max_queued=10)
        gate = asyncio.Event()

        async def create():
            async with q.slot("j"):
                await gate.wait()

        first = asyncio.create_task(create())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(create())
        await asyncio.sleep(0)
        assert q.queued == 1
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert q.queued == 0
        gate.set()
        await first
        return q

    q = asyncio.run(run())
    assert q.active == 0 and q.queued == 0


def test_a_pool_is_named_by_its_exact_shape():
    """A create takes from the pool of its name: two shapes must never share
    one, or a create asking for 95M would get a pool's 95.9M sandbox."""
    from dsecd.engine.creates import pool_name

    assert pool_name("busybox", 1.0, 512 << 20) == "busybox@1cpu-512M"
    assert pool_name("busybox", 0.5, 64 << 20) == "busybox@0.5cpu-64M"
    memories = [95 << 20, (95 << 20) + 1, int(95.9 * (1 << 20))]
    assert len({pool_name("busybox", 1.0, m) for m in memories}) == 3
    assert pool_name("busybox", 0.3333333, 64 << 20) != pool_name("busybox", 0.333333, 64 << 20)


def test_a_raised_max_active_starts_waiting_creates_at_once():
    """A config reload raising admission.max_active_creates: the creates
    already waiting take the new slots then, not one per create's end."""
    async def run():
        q = CreateQueue(max_active=1, max_queued=10)
        gate = asyncio.Event()
        running: list[int] = []

        async def create(i: int):
            async with q.slot("j"):
                running.append(i)
                await gate.wait()

        tasks = [asyncio.create_task(create(i)) for i in range(4)]
        await asyncio.sleep(0)
        assert (q.active, q.queued, running) == (1, 3, [0])
        q.set_max_active(3)
        await asyncio.sleep(0)
        assert (q.active, q.queued, sorted(running)) == (3, 1, [0, 1, 2])
        gate.set()
        await asyncio.gather(*tasks)
        return q

    q = asyncio.run(run())
    assert (q.active, q.queued, q.admitted) == (0, 0, 4)


def test_a_lowered_max_active_holds_waiting_creates_until_below_it():
    """Lowered: the creates running go on; a slot freed past the new cap is
    not handed to a waiting create until fewer than the cap run."""
    async def run():
        q = CreateQueue(max_active=3, max_queued=10)
        gates = [asyncio.Event() for _ in range(5)]
        running: list[int] = []

        async def create(i: int):
            async with q.slot("j"):
                running.append(i)
                await gates[i].wait()

        tasks = [asyncio.create_task(create(i)) for i in range(5)]
        await asyncio.sleep(0)
        assert (q.active, q.queued) == (3, 2)
        q.set_max_active(1)
        gates[0].set()
        await asyncio.sleep(0.01)
        assert (q.active, q.queued, sorted(running)) == (2, 2, [0, 1, 2])
        gates[1].set()
        await asyncio.sleep(0.01)
        assert (q.active, q.queued, sorted(running)) == (1, 2, [0, 1, 2])
        gates[2].set()
        await asyncio.sleep(0.01)
        assert (q.active, q.queued, sorted(running)) == (1, 1, [0, 1, 2, 3])
        for g in gates:
            g.set()
        await asyncio.gather(*tasks)
        return q

    q = asyncio.run(run())
    assert (q.active, q.queued, q.admitted) == (0, 0, 5)
