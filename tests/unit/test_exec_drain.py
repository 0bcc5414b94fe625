"""What a streamed exec wrote before its exit reaches its client, however
slow the client takes it (dsecd/execio.py, ExecIO._drain); a background
child that holds the pipes open still ends the reading after the grace."""

from __future__ import annotations

import asyncio
import os
import pty
import tty

from dsecd.execio import ExecIO, PtyIO

GRACE_S = 0.2


class _Watch:
    """A process that has exited (status 0) as soon as `exited` is set."""

    kill_grace = 1.0

    def __init__(self, loop):
        self.exited = loop.create_future()

    def stop(self) -> None:
        pass

    def kill(self) -> None:
        pass

    def abandon(self):
        return None


def _run_with(emit_delay: float, writes: list[bytes], hold_open: bool) -> tuple[bytes, dict, float]:
    """Run an ExecIO whose process wrote `writes` to stdout, then exited
    (its pipes closed unless `hold_open`: a background child keeps them),
    each frame taking `emit_delay` s to hand on. (What was emitted, the
    result, how long run() took.)"""
    async def go():
        loop = asyncio.get_running_loop()
        got = bytearray()

        async def emit(_fd: int, data: bytes) -> None:
            got.extend(data)
            await asyncio.sleep(emit_delay)

        io = ExecIO(loop, 1 << 30, emit, False)
        watch = _Watch(loop)
        started = loop.time()
        run = asyncio.ensure_future(io.run(watch, None, GRACE_S))
        out_w = io.out_w
        os.write(out_w, writes[0])
        await asyncio.sleep(0.05)            # read, and its emit under way
        for piece in writes[1:]:
            os.write(out_w, piece)
        if not hold_open:
            io.close_child_ends()
        watch.exited.set_result({"status": 0})
        result = await run              # its close() closes the ends held open too
        return bytes(got), result, loop.time() - started
    return asyncio.run(go())


def test_output_written_before_the_exit_reaches_a_slow_client():
    writes = [b"a" * 4096, b"b" * 4096]
    got, result, _took = _run_with(emit_delay=1.0, writes=writes, hold_open=False)
    assert got == b"".join(writes) and result["exit_code"] == 0


def test_a_pipe_held_open_by_a_background_child_ends_the_reading_after_the_grace():
    got, result, took = _run_with(emit_delay=0.0, writes=[b"x"], hold_open=True)
    assert got == b"x" and result["exit_code"] == 0
    assert took < 5.0, took


def test_a_background_child_writing_on_ends_the_reading_after_the_grace_for_a_slow_client():
    """Output that comes after the exit (a background child writing on, as
    a build's RUN may leave one) is read for the grace only: the time a slow
    client takes it counts, so the exec ends however long the child writes."""
    async def go() -> tuple[bytes, dict]:
        loop = asyncio.get_running_loop()
        got = bytearray()

        async def emit(_fd: int, data: bytes) -> None:
            got.extend(data)
            await asyncio.sleep(0.01)        # a client slower than the child writes

        io = ExecIO(loop, 1 << 62, emit, False)
        watch = _Watch(loop)
        os.set_blocking(io.out_w, False)
        writing = True

        async def child() -> None:
            while writing:
                try:
                    os.write(io.out_w, b"y" * 4096)
                except BlockingIOError:
                    pass
                await asyncio.sleep(0.001)

        writer = asyncio.ensure_future(child())
        os.write(io.out_w, b"before the exit")
        await asyncio.sleep(0.05)
        watch.exited.set_result({"status": 0})
        try:
            result = await asyncio.wait_for(io.run(watch, None, GRACE_S), 10)
        finally:
            writing = False
            await writer
        return bytes(got), result

    got, result = asyncio.run(go())
    assert got.startswith(b"before the exit") and result["exit_code"] == 0
    assert result["duration_ms"] < 5000, result


def test_output_a_terminal_held_at_the_exit_reaches_a_slow_client():
    """A pty holds what the process wrote before its exit in buffers
    FIONREAD does not count (past its first 4 KiB; 8 KiB fits in them without a reader): that output reaches a
    slow client too."""
    async def go() -> tuple[bytes, dict]:
        loop = asyncio.get_running_loop()
        got = bytearray()

        async def emit(_fd: int, data: bytes) -> None:
            got.extend(data)
            await asyncio.sleep(0.3)

        master, slave = pty.openpty()
        tty.setraw(slave)
        io = PtyIO(loop, emit, 24, 80, (master, slave))
        watch = _Watch(loop)
        os.write(io.stdin_r, b"t" * 8192)
        io.close_child_ends()
        watch.exited.set_result({"status": 0})
        result = await asyncio.wait_for(io.run(watch, None, GRACE_S), 30)
        return bytes(got), result

    got, result = asyncio.run(go())
    assert got == b"t" * 8192 and result["exit_code"] == 0
