"""A ^C that comes before `dsec`'s command starts: held, then said as any other.

Before its command starts, `dsec` parses its arguments and imports the
client (asyncio, the protocol: most of its start). Python's own SIGINT
handler would raise KeyboardInterrupt inside whichever import was
running: a traceback, and an exit by the signal. So from the first line
of dsec's entry module (cliboot.py) SIGINT is only held, and dsec says it
as it says a ^C during a command (`dsec CMD: interrupted (SIGINT)`, the
--json error, exit 130) instead of starting the command: before reading
the arguments (cliargs.parsed) or as the command would start
(run_command, cli/dispatch.py). Inside the command (`raised`), SIGINT is
Python's KeyboardInterrupt again, which the commands and asyncio.run
expect. A second ^C while one is held ends dsec at once, so a start that
hangs (an import from a hung file system) can still be stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

_held: list[int] = []


def _hold(signum: int, frame) -> None:
    if _held:
        os.write(2, b"dsec: interrupted (SIGINT)\n")
        os._exit(128 + signum)
    _held.append(signum)


def hold() -> None:
    """Hold SIGINT from now on, if Python's handler has it: an ignored
    SIGINT (a background job of a non-interactive shell) stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        with contextlib.suppress(ValueError):       # not the main thread: its SIGINT is not ours to set
            signal.signal(signal.SIGINT, _hold)


def held() -> bool:
    """Whether a ^C came while SIGINT was held."""
    return bool(_held)


def restore(handler) -> None:
    """Put back the SIGINT handler cli.main found (when called in a process of
    its own, as by tests, it must not leave that process's ^C held)."""
    if signal.getsignal(signal.SIGINT) is _hold and handler is not _hold:
        signal.signal(signal.SIGINT, handler)
        _held.clear()


@contextlib.contextmanager
def raised() -> Iterator[None]:
    """SIGINT as Python's default inside the block (KeyboardInterrupt); a ^C
    held before it raises at its start. Held again after it, while dsec
    says how the command ended and exits."""
    if signal.getsignal(signal.SIGINT) is not _hold:       # ignored, or not ours: left as it is
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if _held:
            _held.clear()
            raise KeyboardInterrupt
        yield
    finally:
        signal.signal(signal.SIGINT, _hold)
