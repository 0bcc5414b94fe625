"""Run a call on an event loop's own thread.

Transports, tasks and futures belong to the loop that made them: neither
asyncio's nor uvloop's are thread-safe, and a transport closed from another
thread while the loop polls it can corrupt the loop or abort the process.
Blocking code run in worker threads (engine/workers.py) that must touch one,
such as closing a VM's channels before killing its QEMU, goes through here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """fn() now if this thread runs `loop`, else at the loop's next turn
    (without waiting for it). A closed loop (the daemon is ending) runs
    nothing: what fn would have closed goes with the loop."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn()
        return
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:        # closed
        pass
