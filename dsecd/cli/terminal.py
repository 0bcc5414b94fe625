"""`dsec exec -t` and `dsec run -t`: a pty exec driven from our terminal,
in raw mode with our keys forwarded, its window size following ours."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty

from ..errors import DsecError
from .common import _ReadQueue, _write_flush


async def _on_terminal(stream, a) -> int | None:
    """A pty exec's stream (`dsec exec -t`, `dsec run -t`) driven from our
    terminal: raw mode (with -i) so that every key, ^C included, goes to the
    sandbox's terminal as typed; its window size follows ours (SIGWINCH).
    The signal that ended it (the stream cancelled), or None at its end."""
    fd = sys.stdin.fileno()
    ended_by = None                       # the signal that ended it
    with _raw_terminal(fd) if a.interactive else contextlib.nullcontext():
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        killed: list[int] = []

        def on_signal(signum: int) -> None:
            killed.append(signum)
            main.cancel()

        for signum in _ENDING_SIGNALS:
            loop.add_signal_handler(signum, on_signal, signum)
        loop.add_signal_handler(signal.SIGWINCH, _follow_window, loop, stream, fd)
        keys = loop.create_task(_forward_keys(stream, fd)) if a.interactive else None
        try:
            async for _fd, data in stream:
                _write_flush(1, data)
        except asyncio.CancelledError:
            if not killed:
                raise
            ended_by = killed[0]
        finally:
            for signum in (*_ENDING_SIGNALS, signal.SIGWINCH):
                loop.remove_signal_handler(signum)
            if keys is not None:
                keys.cancel()
                with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
                    await keys
    return ended_by


# Signals that end `dsec exec -t` (its terminal restored, the exec cancelled)
# and that `dsec run` forwards to its command (the second one kills it and
# removes its sandbox).
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)


def _window_size(fd: int) -> tuple[int, int]:
    """(rows, cols) of the terminal on fd; 24 x 80 where it says 0 (a serial line, some emulators)."""
    cols, rows = os.get_terminal_size(fd)
    return rows or 24, cols or 80


def _follow_window(loop: asyncio.AbstractEventLoop, stream, fd: int) -> None:
    """SIGWINCH: our window changed; the sandbox's terminal gets the new size."""
    rows, cols = _window_size(fd)
    task = loop.create_task(stream.resize(rows, cols))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())    # the exec may have ended meanwhile


async def _forward_keys(stream, fd: int) -> None:
    """Our stdin's bytes, as they come, into the sandbox's terminal (in order,
    what arrived meanwhile in one exec_input). Our end of input (the terminal
    hung up) stops the forwarding only: the sandbox's terminal reads ^D as its end."""
    with _ReadQueue(fd).watch() as queue:
        while True:
            chunks = [await queue.get()]
            while not queue.empty():
                chunks.append(queue.get_nowait())
            if data := b"".join(chunks):
                await stream.write(data)
            if not chunks[-1]:
                return


@contextlib.contextmanager
def _raw_terminal(fd: int):
    """The terminal on fd in raw mode (no echo, no line editing, no signals
    from keys) for the block; its settings back however the block ends."""
    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSANOW)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
