"""A keyed streamed exec's output across lost connections
(dsecd/engine/keyedstream.py, through OpKeys.once): the request sent again
gets what its client had not got, once, then the rest and the result; the
command runs once; what the daemon no longer has is told as `lost`."""

from __future__ import annotations

import asyncio

import pytest
from journal_kit import MemoryJournal

from dsecd import protocol
from dsecd.engine import keyedstream
from dsecd.engine.execs import exec_summary
from dsecd.engine.keyedstream import KeyedStream
from dsecd.engine.opkeys import OpKeys
from dsecd.engine.sandboxes import Sandbox, SandboxRegistry
from dsecd.errors import BadRequest, Conflict


class _Ctx:
    """A request's context: the frames sent to its client, and its connection's execs."""

    def __init__(self, why: str = "gone"):
        self.frames: list[dict] = []
        self.why = why
        self.execs: list[object] = []

    async def emit(self, payload: dict) -> None:
        self.emit_nowait(payload)
        await self.drained()

    def emit_nowait(self, payload: dict) -> None:
        self.frames.append(payload)

    async def drained(self) -> None:
        await asyncio.sleep(0)

    def why_cancelled(self) -> str:
        return self.why

    def register_exec(self, io) -> None:
        self.execs.append(io)

    def unregister_exec(self) -> None:
        self.execs.clear()

    def output(self, fd: int) -> bytes:
        return b"".join(f["data"] for f in self.frames if f.get("fd") == fd and "data" in f)

    def lost(self, fd: int) -> int:
        return sum(f.get("lost", 0) for f in self.frames if f.get("fd") == fd)


class World:
    """One sandbox, and an exec whose run writes what `feed` gives it."""

    def __init__(self):
        self.registry = SandboxRegistry(MemoryJournal())
        self.registry.op_keys = OpKeys(self.registry)
        self.sb = Sandbox(id="sb1", image="busybox", state="running", created=0.0,
                          limits={"cpu": 1.0, "memory": 1 << 20})
        self.registry.add(self.sb)
        self.runs = 0
        self.feed: asyncio.Queue = asyncio.Queue()     # (fd, data) to write; None: exit
        self.io = object()

    def exec(self, ctx: _Ctx, stream_from: list[int] | None = None):
        req = protocol.Exec(sandbox=self.sb.id, argv=["yes"], stream=True, key="k", stream_from=stream_from)
        stream = KeyedStream(ctx)

        async def run() -> dict:
            self.runs += 1
            stream.register_exec(self.io)
            try:
                while (item := await self.feed.get()) is not None:
                    await stream.emit({"fd": item[0], "data": item[1]})
            finally:
                stream.unregister_exec()
            return {"exit_code": 0, "signal": None, "timed_out": False}

        return self.registry.op_keys.once(self.sb, "exec", req, ctx, run, exec_summary, stream=stream)

    async def start(self, ctx: _Ctx, *items: tuple[int, bytes] | None) -> asyncio.Future:
        """The exec sent by request `ctx`, `items` written (None: its end): its answer to come."""
        task = asyncio.ensure_future(self.exec(ctx))
        for item in items:
            await self.feed.put(item)
        return task

    async def cut(self, *items: tuple[int, bytes]) -> _Ctx:
        """The exec sent, `items` written, then its connection lost: its request's context."""
        ctx = _Ctx()
        task = await self.start(ctx, *items)
        await _settle()
        await _lose(task)
        return ctx

    async def resend_to_end(self, stream_from: list[int], *items: tuple[int, bytes]) -> tuple[_Ctx, dict]:
        """The exec sent again from `stream_from`, `items` written, then its
        end: (the context of the request sent again, its answer)."""
        ctx = _Ctx()
        task = asyncio.ensure_future(self.exec(ctx, stream_from))
        await _settle()
        for item in items:
            await self.feed.put(item)
        await self.feed.put(None)
        return ctx, await task


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def _lose(task: asyncio.Task) -> None:
    """The request's connection went: its task is cancelled (its ctx says "gone")."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_the_request_sent_again_gets_the_output_its_client_missed_and_the_command_runs_once():
    w = World()

    async def go():
        first = await w.cut((1, b"one "), (2, b"err "), (1, b"two "))
        # Its client got "one " only: "two " and "err " were in flight.
        return first, *await w.resend_to_end([4, 0], (1, b"three"))

    first, again, result = asyncio.run(go())
    assert first.output(1) == b"one two "
    assert again.output(1) == b"two three" and again.output(2) == b"err "
    assert result["existing"] is True and result["exit_code"] == 0
    assert w.runs == 1


def test_output_written_while_no_request_is_connected_goes_to_the_next():
    w = World()

    async def go():
        first = await w.cut()
        await w.feed.put((1, b"held"))
        await _settle()
        held = w.feed.empty() and first.output(1) == b""
        again, _ = await w.resend_to_end([0, 0])
        return held, first, again

    held, first, again = asyncio.run(go())
    assert held
    assert first.output(1) == b"" and again.output(1) == b"held"


def test_what_fell_out_of_the_tail_is_told_as_lost(monkeypatch):
    monkeypatch.setattr(keyedstream, "TAIL_BYTES", 8)
    w = World()

    async def go():
        await w.cut((1, b"aaaaaaaa"), (1, b"bbbbbbbb"), (1, b"cccccccc"))
        return await w.resend_to_end([0, 0])

    again, _ = asyncio.run(go())
    # 24 bytes written; whole frames are kept while the rest is at least 8 bytes.
    assert again.lost(1) == 16 and again.output(1) == b"cccccccc"


def test_stdout_and_stderr_sent_again_come_in_the_order_they_were_first_sent():
    w = World()

    async def go():
        await w.cut((1, b"a"), (2, b"bb"), (1, b"cc"), (2, b"d"))
        return await w.resend_to_end([0, 1])

    again, _ = asyncio.run(go())
    assert again.frames[0] == {"resumed": True}
    assert [(f["fd"], f["data"]) for f in again.frames[1:]] == [(1, b"a"), (2, b"b"), (1, b"cc"), (2, b"d")]


def test_a_request_sent_again_after_the_end_gets_the_rest_then_the_result():
    w = World()

    async def go():
        first = _Ctx()
        answer = await (await w.start(first, (1, b"all of it"), None))
        again = _Ctx()
        return answer, again, await w.exec(again, [4, 0])

    answer, again, result = asyncio.run(go())
    assert again.output(1) == b"of it" and result == {**answer, "existing": True}
    assert w.runs == 1


def test_stream_from_past_what_the_exec_wrote_is_refused():
    w = World()

    async def go():
        await w.cut((1, b"abc"))
        with pytest.raises(BadRequest, match="stream_from says 4 bytes of fd 1"):
            await w.exec(_Ctx(), [4, 0])
        return await w.resend_to_end([3, 0])

    assert asyncio.run(go())[1]["exit_code"] == 0


def test_output_got_under_a_key_this_daemon_does_not_know_is_not_run_again():
    w = World()

    async def go():
        with pytest.raises(Conflict) as caught:
            await w.exec(_Ctx(), [10, 0])
        return caught.value

    err = asyncio.run(go())
    assert err.detail["outcome"] == "unknown" and w.runs == 0


def test_the_running_exec_is_registered_with_the_request_connected_now():
    """exec_signal names the exec on the connection of the request sent again."""
    w = World()

    async def go():
        first = _Ctx()
        task = asyncio.ensure_future(w.exec(first))
        await _settle()
        registered_first = list(first.execs)
        await _lose(task)
        again = _Ctx()
        task = asyncio.ensure_future(w.exec(again, [0, 0]))
        await _settle()
        state = (registered_first, list(first.execs), list(again.execs))
        await w.feed.put(None)
        await task
        return state, again

    (registered_first, first_after, again_during), again = asyncio.run(go())
    assert registered_first == [w.io] and first_after == [] and again_during == [w.io]
    assert again.execs == []


def test_a_cancel_of_the_request_sent_again_ends_the_exec():
    w = World()

    async def go():
        await w.cut()
        task = asyncio.ensure_future(w.exec(_Ctx("cancel"), [0, 0]))
        await _settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(Conflict) as caught:
            await w.exec(_Ctx(), [0, 0])
        return caught.value

    assert asyncio.run(go()).detail["outcome"] == "cancelled"
    assert w.runs == 1


def test_bad_stream_from_values_are_refused():
    for bad in ([1], [1, 2, 3], [-1, 0], [True, 0], "0,0"):
        with pytest.raises(BadRequest, match="stream_from must be two byte counts"):
            keyedstream.check_stream_from(bad)
    keyedstream.check_stream_from([0, 5])
    keyedstream.check_stream_from(None)


def test_a_request_whose_output_another_request_of_its_key_took_over_is_told_so():
    """The same request sent while the first is still connected (a client
    that cannot know the first's link is gone) takes the output over; the
    first is answered that it was taken, not a result over output cut short."""
    w = World()

    async def go():
        first = _Ctx()
        task = await w.start(first, (1, b"one "))
        await _settle()
        second = _Ctx()
        again = asyncio.ensure_future(w.exec(second))
        await _settle()
        await w.feed.put((1, b"two"))
        await w.feed.put(None)
        result = await again
        with pytest.raises(Conflict) as caught:
            await task
        return first, second, result, caught.value

    first, second, result, err = asyncio.run(go())
    assert first.output(1) == b"one " and second.output(1) == b"one two"
    assert err.detail["outcome"] == "taken_over" and "took its output over" in err.message
    assert result["existing"] is True and w.runs == 1


def test_an_ended_exec_s_kept_output_holds_no_request_of_its_key():
    """The tail stays for a request sent again (up to an hour): the requests
    it went to, and their connections, are not kept with it."""
    import gc
    import weakref

    w = World()

    async def go():
        first = _Ctx()
        await (await w.start(first, (1, b"all of it"), None))
        again = _Ctx()
        await w.exec(again, [4, 0])
        return weakref.ref(first), weakref.ref(again), again.output(1)

    first, again, output = asyncio.run(go())
    gc.collect()
    assert output == b"of it" and w.registry.op_keys._streams
    assert first() is None and again() is None


def test_an_exec_that_ends_while_no_request_is_connected_keeps_its_last_output():
    """Output written while no request is attached is kept and the exec goes
    on: it may end (ExecIO then stops reading its pipes soon after), and the
    request sent again gets that output, then the result."""
    w = World()

    async def go():
        await w.cut((1, b"sent "))
        await w.feed.put((1, b"late"))
        await w.feed.put(None)
        await _settle()
        ended = not w.registry.op_keys._running
        again = _Ctx()
        return ended, again, await w.exec(again, [5, 0])

    ended, again, result = asyncio.run(go())
    assert ended
    assert again.output(1) == b"late" and result["existing"] is True and result["exit_code"] == 0


def test_output_past_the_tail_waits_while_no_request_is_connected(monkeypatch):
    """Kept unsent up to the tail; past it the exec waits rather than have
    output it wrote fall out unsent."""
    monkeypatch.setattr(keyedstream, "TAIL_BYTES", 8)
    w = World()

    async def go():
        await w.cut((1, b"sent"))
        for piece in (b"kep", b"t, ", b"wait"):
            await w.feed.put((1, piece))
        await _settle()
        waits = w.feed.empty() and bool(w.registry.op_keys._running)
        again, _ = await w.resend_to_end([4, 0])
        return waits, again

    waits, again = asyncio.run(go())
    assert waits and again.output(1) == b"kept, wait" and again.lost(1) == 0


class _StuckCtx(_Ctx):
    """A request whose connection stopped taking frames without ending (a
    link cut that neither end has noticed): sends past its first wait."""

    def __init__(self):
        super().__init__()
        self.stuck = asyncio.Event()

    async def drained(self) -> None:
        if len(self.frames) > 1:
            self.stuck.set()
            await asyncio.Event().wait()


def test_the_request_sent_again_takes_the_output_over_from_a_connection_that_stopped_taking_it():
    w = World()

    async def go():
        first = _StuckCtx()
        task = await w.start(first, (1, b"one "), (1, b"two "))
        await first.stuck.wait()
        again = _Ctx()
        resent = asyncio.ensure_future(w.exec(again, [4, 0]))
        await _settle()
        await w.feed.put((1, b"three"))
        await w.feed.put(None)
        result = await asyncio.wait_for(resent, 5)
        with pytest.raises(Conflict):
            await task
        return again, result

    again, result = asyncio.run(go())
    assert again.output(1) == b"two three" and result["existing"] is True and w.runs == 1


def test_a_frame_queued_behind_a_stuck_send_does_not_hold_the_request_sent_again():
    """stdout's frame stuck on the old connection, stderr's waiting behind it:
    neither keeps the request sent again from taking the output over."""
    async def go():
        first, again = _StuckCtx(), _Ctx()
        stream = KeyedStream(first)
        await stream.emit({"fd": 1, "data": b"one "})
        stuck = asyncio.ensure_future(stream.emit({"fd": 1, "data": b"two "}))
        await first.stuck.wait()
        queued = asyncio.ensure_future(stream.emit({"fd": 2, "data": b"err"}))
        await _settle()
        await asyncio.wait_for(stream.attach(again, [4, 0]), 5)
        await asyncio.wait_for(asyncio.gather(stuck, queued), 5)
        return first, again

    again = asyncio.run(go())[1]
    assert again.output(1) == b"two " and again.output(2) == b"err"
