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
from dsecd.backends.microvm.agent import (
    ID_SPAN,
    OUTPUT_WINDOW,
    READY_MAX,
    AgentGone,
    AgentLink,
    find_ready,
)


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
        reader.feed_data(cut + _ready(link.first_id) + push[:10])
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
        reader.feed_data(_ready(link.first_id))
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
        assert run.id == link.first_id
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
        await _send(guest, wire.frame(wire.OK, link.first_id))      # the PING's answer: the link's first id
        await asyncio.wait_for(pending, 5)
        assert not link.closed and not broken
        link.close()
        guest.close()

    asyncio.run(main())


def test_a_new_link_numbers_its_requests_from_a_random_point_and_never_uses_0():
    """A restored VM's (or a restarted daemon's) new link must not reuse the
    ids of execs the guest agent still holds from the link before (a watch
    left running across a pause): the agent refuses an exec under an id in
    use (EEXIST, "exec id in use"), and a link that counted from 1 again
    hit exactly those. Ids wrap within u32, skipping 0 (the agent's pushes)."""
    async def main():
        firsts = set()
        for _ in range(4):
            link, guest, _ = await _link()
            firsts.add(link.first_id)
            assert link.new_id() == link.first_id
            link._next_id = ID_SPAN
            assert [link.new_id(), link.new_id()] == [ID_SPAN, 1]
            link.close()
            guest.close()
        assert len(firsts) > 1 and 0 not in firsts

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


# ------------------------------------------------------------ output windows

async def _read_frames(guest: socket.socket, until_kind: int, timeout: float = 5.0) -> list[tuple[int, int, bytes]]:
    """What the host sent the guest, as (type, id, body), up to the first of `until_kind`."""
    loop = asyncio.get_running_loop()
    buf, frames = b"", []
    async with asyncio.timeout(timeout):
        while True:
            while len(buf) >= wire.HEADER.size:
                length, kind, msg_id = wire.HEADER.unpack_from(buf)
                if len(buf) < 4 + length:
                    break
                frames.append((kind, msg_id, buf[wire.HEADER.size:4 + length]))
                buf = buf[4 + length:]
                if kind == until_kind:
                    return frames
            buf += await loop.sock_recv(guest, 1 << 16)


def _out(msg_id: int, n: int) -> bytes:
    return wire.frame(wire.OUT, msg_id, wire.u64(1), wire.bstr(b"o" * n))


def test_an_exec_asks_a_current_agent_for_a_window_and_credits_what_its_consumer_took():
    async def main():
        link, guest, broken = await _link()
        link.agent_version = wire.WINDOW_AGENT_VERSION
        run = await link.start_exec(["yes"], [], "/", 0, False)
        (kind, msg_id, body), = await _read_frames(guest, wire.EXEC)
        r = wire.Reader(body)
        r.u64(), r.u64()
        assert r.u64() & wire.EXEC_WINDOW
        r.str(), r.u64(), r.str(), r.u64()         # cwd, argc 1, argv[0], envc 0
        assert r.u64() == run.window == OUTPUT_WINDOW and not r.more()
        chunk = OUTPUT_WINDOW // 8
        for _ in range(8):                          # the whole window, nothing taken yet: allowed
            await _send(guest, _out(run.id, chunk))
        await _send(guest, wire.frame(wire.OK, 99))
        for _ in range(100):
            if run.received == OUTPUT_WINDOW:
                break
            await asyncio.sleep(0.01)
        assert run.backlog() == OUTPUT_WINDOW and not broken
        await run.next_event()                      # an eighth taken: below a quarter, no credit yet
        await run.next_event()                      # a quarter: credit for it
        kind, msg_id, body = (await _read_frames(guest, wire.CREDIT))[-1]
        assert msg_id == run.id and wire.Reader(body).u64() == 2 * chunk
        link.forget(run)                            # the consumer is done: the rest is dropped here
        kind, msg_id, body = (await _read_frames(guest, wire.CREDIT))[-1]
        assert msg_id == run.id and wire.Reader(body).u64() == wire.DISCARD_ALL
        link.close()
        guest.close()

    asyncio.run(main())


def test_output_past_the_window_ends_the_channel():
    """The agent stops at its window; a guest that sends past it does not
    run the agent's code, and gets what bytes that are no frame get."""
    async def main():
        link, guest, broken = await _link()
        link.agent_version = wire.WINDOW_AGENT_VERSION
        run = await link.start_exec(["yes"], [], "/", 0, False)
        await _send(guest, _out(run.id, OUTPUT_WINDOW) + _out(run.id, 1))
        await _closed(link)
        assert len(broken) == 1 and "over its window" in broken[0], broken
        guest.close()

    asyncio.run(main())


def test_an_agent_without_windows_has_its_channel_held_while_an_exec_lags():
    """An older agent cannot be told to stop: past OUTPUT_WINDOW of one
    exec's untaken output the host reads no more of that channel until the
    exec's consumer catches up; nothing is lost, and no more is held."""
    async def main():
        link, guest, broken = await _link()
        link.agent_version = 2
        run = await link.start_exec(["yes"], [], "/", 0, False)
        assert run.window == 0
        (_, _, body), = await _read_frames(guest, wire.EXEC)
        assert not wire.Reader(body[16:]).u64() & wire.EXEC_WINDOW
        ping = asyncio.ensure_future(link.request(wire.PING))
        (_, ping_id, _), = await _read_frames(guest, wire.PING)
        chunk = 64 << 10
        for _ in range(OUTPUT_WINDOW // chunk + 1):
            await _send(guest, _out(run.id, chunk))
        await _send(guest, wire.frame(wire.OK, ping_id))
        await asyncio.sleep(0.2)
        assert not ping.done() and run.backlog() == OUTPUT_WINDOW + chunk
        await run.next_event()
        await run.next_event()
        await asyncio.wait_for(ping, 5)
        assert ping_id and not broken
        link.close()
        guest.close()

    asyncio.run(main())


def test_a_hello_says_whether_the_host_still_follows_its_execs():
    """A HELLO again on a link with execs running (a job resume) keeps
    their windows; on a new link (a restarted daemon, a restored VM) the
    agent is told the execs it has are nobody's, and lets their output go."""
    async def main():
        link, guest, broken = await _link()

        async def hello_keeps() -> int:
            asking = asyncio.ensure_future(link.hello("h", "sb"))
            (_, msg_id, body), = await _read_frames(guest, wire.HELLO)
            r = wire.Reader(body)
            r.str(), r.u64(), r.bytes(), r.str()
            keeps = r.u64()
            await _send(guest, _ready(msg_id, b"dsec-guest-agent 3"))
            assert await asyncio.wait_for(asking, 5) == "dsec-guest-agent 3"
            return keeps

        assert await hello_keeps() == 0 and link.agent_version == 3
        run = await link.start_exec(["yes"], [], "/", 0, False)
        assert run.window == OUTPUT_WINDOW
        await _read_frames(guest, wire.EXEC)
        assert await hello_keeps() == 1
        assert not broken
        link.close()
        guest.close()

    asyncio.run(main())


def test_a_request_whose_send_broke_as_the_channel_closed_leaves_no_unretrieved_error():
    # QEMU ended (a pause) under a large write: the read loop failed the
    # request's future with AgentGone while its drain raised a broken pipe;
    # nobody took the future's error, and the daemon logged "Future
    # exception was never retrieved" at error level.
    import gc

    class BrokenWriter(_Writer):
        def __init__(self, reader):
            self.reader = reader

        async def drain(self) -> None:
            self.reader.feed_eof()              # the channel closes ...
            for _ in range(5):
                await asyncio.sleep(0)          # ... and the read loop fails the waiters
            raise BrokenPipeError(32, "Broken pipe")

    async def run():
        unretrieved = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx["message"]))
        reader = asyncio.StreamReader()
        link = AgentLink(reader, BrokenWriter(reader), "test VM")
        with pytest.raises(AgentGone, match="broke"):
            await link.request(wire.WRITE, wire.bstr("/big"))
        await asyncio.sleep(0)
        gc.collect()
        return unretrieved

    assert asyncio.run(run()) == []


def test_an_agent_error_gives_the_hint_a_containers_gets():
    # A VM's exec of too long an argv said only "[Errno 7] Argument list too
    # long (guest agent, at exec)"; a container's says what the limit is.
    import errno

    from dsecd.backends.microvm.agent import AgentError

    err = AgentError(errno.E2BIG, "exec")
    assert err.errno == errno.E2BIG and err.step == "exec"
    assert "argv plus env exceed the kernel's limit (ARG_MAX)" in str(err), str(err)
    assert str(AgentError(errno.EIO, "open")).endswith("Input/output error (guest agent, at open)")
