"""The host's end of a guest agent's channel (dsecd/backends/microvm/agent.py),
without QEMU: a fresh link skips what an earlier host left on the channel up
to the READY of its HELLO, then reads frames as they come, background process
pushes (id 0) going to on_proc; and against a hostile guest, the test plays
the guest on the other end of a socketpair and writes what root in a real
guest could write to the virtio-serial port (test_attack_microvm.py does it
from a real guest)."""

from __future__ import annotations

import asyncio
import socket
import struct
import tracemalloc

import pytest

from dsecd.backends.microvm import wire
from dsecd.backends.microvm.agent import READY_MAX, AgentGone, AgentLink, find_ready


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


def test_a_flood_before_the_ready_is_skipped_without_keeping_it():
    """What comes before the READY is skipped in a bounded buffer: a guest
    that floods a fresh link holds no more than two READY frames' worth of
    the daemon's memory, and a READY that arrives after the flood counts."""
    async def run():
        reader = asyncio.StreamReader(limit=1 << 26)
        link = AgentLink(reader, _Writer(), "test VM", fresh=True)
        hello = asyncio.ensure_future(link.request(wire.HELLO))
        await asyncio.sleep(0)
        chunk = b"\x07" * (1 << 16)
        tracemalloc.start()
        try:
            for _ in range(64):                   # 4 MiB, each chunk read before the next comes
                reader.feed_data(chunk)
                for _ in range(3):
                    await asyncio.sleep(0)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 * (1 << 16) + 2 * READY_MAX, peak
        reader.feed_data(_ready(1))
        assert (await asyncio.wait_for(hello, 5)).str() == "dsec-guest-agent 2"
        link.close()

    asyncio.run(run())



async def _link():
    """An AgentLink on one end of a socketpair, the guest's end, and the
    reasons its on_broken was called with."""
    host, guest = socket.socketpair()
    guest.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=host, limit=1 << 26)
    broken: list[str] = []
    return AgentLink(reader, writer, "test VM", on_broken=broken.append), guest, broken


async def _send(guest: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(guest, data)


async def _closed(link: AgentLink, timeout: float = 10.0) -> None:
    await asyncio.wait_for(asyncio.shield(link._task), timeout)
    assert link.closed


def test_a_huge_length_header_ends_the_channel_before_its_body_is_read():
    """The header's length is checked before the read: the host does not
    wait for (and buffer) the 4 GiB it announces. Before the check, every
    byte the guest sent after such a header stayed in the daemon's memory."""
    async def main():
        link, guest, broken = await _link()
        waiting = asyncio.ensure_future(link.request(wire.PING))
        # The header alone: a host that read the body first would wait here for ever.
        await _send(guest, struct.pack(">IBI", 0xFFFFFFF0, wire.OUT, 1))
        await _closed(link)
        with pytest.raises(AgentGone, match="frame length"):
            await waiting
        assert len(broken) == 1 and "frame length 4294967280" in broken[0]
        guest.close()

    asyncio.run(main())


@pytest.mark.parametrize("bad", [
    struct.pack(">IBI", 4, wire.OK, 1),                                  # shorter than its own header
    wire.HEADER.pack(5 + 8 + 4, wire.OUT, 7) + wire.u64(1) + struct.pack(">I", 1000),   # a field cut short
    wire.HEADER.pack(5 + 3, wire.STARTED, 7) + b"abc",                   # a u64 of 3 bytes
])
def test_a_malformed_frame_ends_the_channel_and_fails_every_waiter(bad):
    async def main():
        link, guest, broken = await _link()
        run = await link.start_exec(["true"], [], "/", 0, False)
        assert run.id == 1
        pending = asyncio.ensure_future(link.request(wire.PING))
        # Re-aim the frame at the running exec's id (7 above stands for it).
        bad_frame = bad[:5] + struct.pack(">I", run.id) + bad[9:]
        await _send(guest, bad_frame)
        await _closed(link)
        assert len(broken) == 1
        kind, err = await asyncio.wait_for(run.events.get(), 5)
        assert kind == "gone" and isinstance(err, AgentGone)
        with pytest.raises(AgentGone):
            await pending
        with pytest.raises(AgentGone):
            link.send(wire.frame(wire.PING, 99))
        guest.close()

    asyncio.run(main())


def test_answers_to_requests_never_sent_are_dropped_and_the_channel_goes_on():
    async def main():
        link, guest, broken = await _link()
        for kind in (wire.OK, wire.ERR, wire.DATA, wire.OUT, wire.EXITED, wire.READY, 250):
            await _send(guest, wire.frame(kind, 4000 + kind, wire.u64(5), wire.bstr(b"unasked")))
        pending = asyncio.ensure_future(link.request(wire.PING))
        await asyncio.sleep(0)
        await _send(guest, wire.frame(wire.OK, 1))          # the PING's answer: id 1, the link's first
        await asyncio.wait_for(pending, 5)
        assert not link.closed and not broken
        link.close()
        guest.close()

    asyncio.run(main())


def test_a_closed_channel_is_no_protocol_breach():
    """QEMU exiting closes the channel: the VM's death is its watch's to
    report, not on_broken's."""
    async def main():
        link, guest, broken = await _link()
        guest.close()
        await _closed(link)
        assert broken == []

    asyncio.run(main())


def test_an_exec_whose_vm_went_can_still_be_killed_on_its_way_out():
    """The exec loop kills its process whenever it leaves early; when it
    leaves because the VM died, that kill must not raise (it turned the
    clear "sandbox is exiting" answer into an internal error)."""
    async def main():
        link, guest, broken = await _link()
        run = await link.start_exec(["sleep", "60"], [], "/", 0, False)
        guest.close()
        kind, err = await asyncio.wait_for(run.events.get(), 5)
        assert kind == "gone" and isinstance(err, AgentGone)
        run.kill()
        run.close_stdin_nowait()
        assert broken == []

    asyncio.run(main())
