"""A microVM's pause waits for the agent requests under way to be answered
(MicroVMService._requests_settled): a QEMU ended while a request's frame
was on its way would leave the guest agent half a frame. The stat that
records a temporary copy by its guest's inode (identity, after the copy's
own counted request ended) is such a request too."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dsecd.backends.microvm import wire
from dsecd.engine.microvms import MicroVMService


class _Link:
    """An agent channel whose STAT is answered only once `answer` is set."""

    closed = False

    def __init__(self):
        self.answer: asyncio.Future | None = None
        self.sent = 0

    async def request(self, kind, *fields):
        assert kind == wire.STAT
        self.sent += 1
        self.answer = asyncio.get_running_loop().create_future()
        return await self.answer


def _service() -> MicroVMService:
    svc = object.__new__(MicroVMService)
    svc.balloon = None
    svc._requests, svc._requests_idle = {}, {}
    return svc


async def _turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_pause_waits_for_the_stat_that_records_a_temporary():
    async def run():
        svc, link = _service(), _Link()
        sb = SimpleNamespace(id="v1", handle=SimpleNamespace(agent=link))
        stat = asyncio.ensure_future(svc.identity(sb, "/work/.dsec-tmp"))
        await _turns()
        assert link.sent == 1                   # on its way to the agent
        settled = asyncio.ensure_future(svc._requests_settled(sb))
        await _turns()
        waited = not settled.done()
        link.answer.set_exception(ConnectionError("test over"))
        await asyncio.gather(stat, settled, return_exceptions=True)
        return waited

    assert asyncio.run(run()), "the pause went on while the stat was on its way to the agent"
