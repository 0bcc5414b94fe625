"""The host's end of the guest agent's channel (dsecd/backends/microvm/agent.py):
a fresh link skips what an earlier host left on the channel up to the READY
of its HELLO, then reads frames as they come; background process pushes
(id 0) go to on_proc."""

from __future__ import annotations

import asyncio

from dsecd.backends.microvm import wire
from dsecd.backends.microvm.agent import AgentLink, find_ready


def _ready(msg_id: int, text: bytes = b"dsec-guest-agent 2") -> bytes:
    return wire.frame(wire.READY, msg_id, wire.bstr(text))


def test_find_ready_skips_a_cut_frame_and_other_ids():
    stale = wire.frame(wire.OUT, 1, wire.u64(1), wire.bstr(b"x" * 100))[30:]     # a frame's tail
    other = _ready(7)
    buf = stale + other + _ready(1) + b"\x00\x00"
    start = len(stale) + len(other)
    assert find_ready(buf, 1) == (start, start + len(_ready(1)))
    assert find_ready(buf[:start + 10], 1) is None          # not all there yet
    assert find_ready(b"", 1) is None


class _Writer:
    def write(self, data: bytes) -> None:
        self.sent = data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_fresh_link_reads_on_after_the_ready():
    async def run():
        reader = asyncio.StreamReader()
        link = AgentLink(reader, _Writer(), "test VM", fresh=True)
        pushes = []
        link.on_proc = lambda kind, r: pushes.append((kind, r.u64(), r.u64(), r.u64(), r.u64(), r.bytes()))
        hello = asyncio.ensure_future(link.request(wire.HELLO))
        await asyncio.sleep(0)
        cut = wire.frame(wire.EXITED, 1, wire.u64(0))[3:]            # left by an earlier host
        push = wire.frame(wire.PROC_OUT, 0, wire.u64(42), wire.u64(0), wire.u64(1), wire.u64(5), wire.bstr(b"hi"))
        reader.feed_data(cut + _ready(1) + push[:10])
        assert (await hello).str() == "dsec-guest-agent 2"
        reader.feed_data(push[10:])
        for _ in range(10):
            await asyncio.sleep(0)
        assert pushes == [(wire.PROC_OUT, 42, 0, 1, 5, b"hi")]
        link.close()

    asyncio.run(run())
