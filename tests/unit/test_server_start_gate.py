"""Requests that feed another request of their connection (exec_input,
exec_resize, file_tar_input) before it registered what takes their data:
they wait for it, and go on in the order they came (dsecd/server.py
Connection.started)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dsecd.server import Connection


def _conn() -> Connection:
    return Connection(SimpleNamespace(max_frame=1 << 20), None, None)


def test_input_that_comes_before_the_start_is_taken_in_order():
    async def scenario() -> list[str]:
        conn, taken = _conn(), []
        conn.starting.add(7)

        async def feed(tag: str) -> None:
            if await conn.started(7, conn.execs) is not None:
                taken.append(tag)          # what feed_stdin does at once when its queue has room

        early = [asyncio.ensure_future(feed(t)) for t in ("a", "b", "c")]
        await asyncio.sleep(0)             # all three wait at the gate
        conn.execs[7] = object()
        conn.begun(7)
        late = asyncio.ensure_future(feed("d"))        # came after the start, before the others went on
        await asyncio.gather(*early, late)
        assert not conn.gates
        return taken

    assert asyncio.run(scenario()) == ["a", "b", "c", "d"]


def test_a_request_that_ends_before_its_start_releases_its_waiters():
    async def scenario():
        conn = _conn()
        conn.starting.add(9)
        waiter = asyncio.ensure_future(conn.started(9, conn.inputs))
        await asyncio.sleep(0)
        conn.begun(9)                      # what the request's end calls
        found = await asyncio.wait_for(waiter, 5)
        return found, len(conn.gates), await conn.started(9, conn.inputs)

    assert asyncio.run(scenario()) == (None, 0, None)


def test_a_request_that_takes_no_input_is_not_waited_for():
    async def scenario():
        return await asyncio.wait_for(_conn().started(3, {}), 5)

    assert asyncio.run(scenario()) is None
