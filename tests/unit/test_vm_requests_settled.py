"""A microVM's pause waits for the agent requests under way to be answered
(MicroVMService._requests_settled): a QEMU ended while a request's frame
was on its way would leave the guest agent half a frame. The stat that
records a temporary copy by its guest's inode (VmFiles.identity, after the
copy's own counted request ended) is such a request too: VmFiles counts it
with the MicroVMService's request_running, which the pause waits on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from vm_kit import vm_files

from dsecd.backends.microvm import wire


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


async def _turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_pause_waits_for_the_stat_that_records_a_temporary():
    async def run():
        (files, vms), link = vm_files(), _Link()
        sb = SimpleNamespace(id="v1", handle=SimpleNamespace(agent=link))
        stat = asyncio.ensure_future(files.identity(sb, "/work/.dsec-tmp"))
        await _turns()
        assert link.sent == 1                   # on its way to the agent
        settled = asyncio.ensure_future(vms._requests_settled(sb))
        await _turns()
        waited = not settled.done()
        link.answer.set_exception(ConnectionError("test over"))
        await asyncio.gather(stat, settled, return_exceptions=True)
        return waited

    assert asyncio.run(run()), "the pause went on while the stat was on its way to the agent"
