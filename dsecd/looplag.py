"""The event loop's health: how late it runs a timer (its lag), and the
systemd watchdog and status that depend on it turning.

Every TICK_S a task asks the loop to wake it; how much later than asked it
wakes is the time the loop spent on other work (a callback that blocked, a
burst of frames). The samples go to the metrics histogram
(dsecd_event_loop_lag_seconds) and a window of recent ones (`stats()`:
p50/p99/max in `dsec info`, which bench/core.py reads).

The same task sends systemd WATCHDOG=1 (when WatchdogSec= armed one) and
STATUS= with the live counts. So a wedged loop stops the pings, and systemd
restarts the daemon (Restart=on-failure covers a watchdog timeout); the
sandboxes keep running and the next daemon re-adopts them.

A wedged loop cannot say where it is stuck, and systemd's kill (SIGABRT)
leaves only "Watchdog timeout" in the journal: a thread of the monitor's
own looks at the task's last turn every STALL_CHECK_S, and once the loop
has not turned for STALL_REPORT_S (well before the unit's 30 s) logs the
loop thread's stack, one warning per stall (event `loop_stalled`), then
how long the stall lasted if it ends (`loop_resumed`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

from . import metrics
from .sdnotify import Notifier

log = logging.getLogger(__name__)

TICK_S = 0.1
STATUS_EVERY_S = 5.0
WINDOW = 36000          # samples kept for stats(): an hour at TICK_S
STALL_REPORT_S = 10.0   # a loop that has not turned for this long is reported
STALL_CHECK_S = 1.0


class LoopMonitor:
    def __init__(self, notifier: Notifier, status: Callable[[], str], tick_s: float = TICK_S):
        self.notifier = notifier
        self.status = status
        self.tick_s = tick_s
        self.lags: deque[float] = deque(maxlen=WINDOW)
        self._task: asyncio.Task | None = None
        self.last_turn = time.monotonic()
        self._done = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        self.last_turn = time.monotonic()
        self._done.clear()
        self._watch = threading.Thread(target=self._watch_stalls, args=(threading.get_ident(),),
                                       name="dsecd-loop-watch", daemon=True)
        self._watch.start()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._done.set()
        if self._watch is not None and self._watch is not threading.current_thread():
            # It sees _done within STALL_CHECK_S, unless a write of its own
            # blocks (a log nobody reads): a daemon thread, not waited for then.
            self._watch.join(2 * STALL_CHECK_S)

    def _watch_stalls(self, loop_thread: int) -> None:
        """In a thread: report a loop that stopped turning, with its stack."""
        stalled_since = None
        while not self._done.wait(STALL_CHECK_S):
            last = self.last_turn
            late = time.monotonic() - last
            if stalled_since is not None and last != stalled_since:
                log.info("event loop turned again after %.1f s", last - stalled_since,
                         extra={"fields": {"event": "loop_resumed", "stalled_s": round(last - stalled_since, 1)}})
                stalled_since = None
            if stalled_since is None and late >= STALL_REPORT_S:
                stalled_since = last
                frame = sys._current_frames().get(loop_thread)
                stack = "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(not found)"
                log.warning("event loop has not turned for %.0f s (systemd's watchdog kills the daemon at "
                            "WatchdogSec=); it is in the stack below", late,
                            extra={"fields": {"event": "loop_stalled", "stalled_s": round(late, 1),
                                              "stack": stack}})

    async def _run(self) -> None:
        ping_every = self.notifier.watchdog_s
        last_ping = last_status = time.monotonic()
        shown = None
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.tick_s)
            now = self.last_turn = time.monotonic()
            lag = max(0.0, now - asked - self.tick_s)
            self.lags.append(lag)
            metrics.LOOP_LAG.observe(lag)
            if ping_every is not None and now - last_ping >= ping_every:
                self.notifier.watchdog()
                last_ping = now
            if self.notifier.enabled and now - last_status >= STATUS_EVERY_S:
                last_status = now
                text = self.status()
                if text != shown:
                    self.notifier.status(text)
                    shown = text

    def stats(self) -> dict:
        """Lag of the recent ticks (up to an hour of them), milliseconds."""
        xs = sorted(self.lags)
        if not xs:
            return {"samples": 0, "tick_ms": self.tick_s * 1000}
        n = len(xs)
        return {"samples": n, "tick_ms": self.tick_s * 1000, "p50_ms": round(xs[n // 2] * 1000, 3),
                "p99_ms": round(xs[min(n - 1, int(0.99 * n))] * 1000, 3), "max_ms": round(xs[-1] * 1000, 3)}

    def reset(self) -> None:
        self.lags.clear()
