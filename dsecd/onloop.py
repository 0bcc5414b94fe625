"""Two things done on an event loop's terms: a call run on the loop's own
thread (on_loop), and a task cancelled once (cancel_once).

Transports, tasks and futures belong to the loop that made them: neither
asyncio's nor uvloop's are thread-safe, and a transport closed from another
thread while the loop polls it can corrupt the loop or abort the process.
Blocking code run in worker threads (engine/workers.py) that must touch one,
such as closing a VM's channels before killing its QEMU, goes through
on_loop."""

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


def cancel_once(task: asyncio.Task) -> None:
    """Cancel `task` unless a cancel of it is pending already. A cancelled
    request undoes what it began as its CancelledError unwinds (an exec's
    process group killed, a snapshot's sandbox thawed, a copy's temp files
    removed), awaiting on the way; a second cancel lands in that undoing
    and cuts it short. Whoever ends a task that another may have ended
    first (a `cancel` request, sent again or not, its connection's close,
    the daemon's stop, the keyed requests' close) cancels it through here."""
    if not task.cancelling():
        task.cancel()
