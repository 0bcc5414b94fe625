"""A VM's agent and monitor links are closed by blocking code in worker
threads (a destroy's or a pause's end of QEMU: backend.stop, end_process)
while the loop may be reading or writing on them. Their transports and
reader tasks are the loop's, and neither asyncio's nor uvloop's are
thread-safe (a transport closed from another thread while the loop polls it
can take the daemon down), so a close from a worker happens on the loop."""

from __future__ import annotations

import asyncio
import threading

from dsecd.backends.microvm.agent import AgentLink
from dsecd.backends.microvm.qmp import QMP


class _Writer:
    """Records the thread that closed it."""

    def __init__(self):
        self.closed_in: int | None = None

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed_in = threading.get_ident()


async def _closed_from_a_worker(link, writer: _Writer) -> int | None:
    await asyncio.get_running_loop().run_in_executor(None, link.close)
    for _ in range(10):          # a close handed to the loop runs at its next turn
        await asyncio.sleep(0)
    return writer.closed_in


def test_an_agent_link_closed_from_a_worker_closes_on_the_loop():
    async def run():
        writer = _Writer()
        link = AgentLink(asyncio.StreamReader(), writer, "test VM")
        closed_in = await _closed_from_a_worker(link, writer)
        assert link.closed
        assert closed_in == threading.get_ident()
        await asyncio.sleep(0)
        assert link._task.done()
    asyncio.run(run())


def test_a_monitor_closed_from_a_worker_closes_on_the_loop():
    async def run():
        writer = _Writer()
        qmp = QMP(asyncio.StreamReader(), writer, "test VM")
        assert await _closed_from_a_worker(qmp, writer) == threading.get_ident()
    asyncio.run(run())


def test_a_command_right_after_a_close_from_a_worker_says_the_vm_is_being_ended():
    """Closed from a worker, the transport closes at the loop's next turn;
    a command in between is refused as the close means, not written."""
    import pytest

    from dsecd.backends.microvm.qmp import QMPError

    async def run():
        writer = _Writer()
        writer.is_closing = lambda: writer.closed_in is not None
        qmp = QMP(asyncio.StreamReader(), writer, "test VM")
        await asyncio.get_running_loop().run_in_executor(None, qmp.close)
        with pytest.raises(QMPError, match="being ended"):
            await qmp.command("stop")
    asyncio.run(run())


def test_a_link_closed_on_the_loop_closes_at_once():
    async def run():
        writer = _Writer()
        link = AgentLink(asyncio.StreamReader(), writer, "test VM")
        link.close()
        assert writer.closed_in == threading.get_ident()
    asyncio.run(run())
