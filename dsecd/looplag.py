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
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from . import metrics
from .sdnotify import Notifier

TICK_S = 0.1
STATUS_EVERY_S = 5.0
WINDOW = 36000          # samples kept for stats(): an hour at TICK_S


class LoopMonitor:
    def __init__(self, notifier: Notifier, status: Callable[[], str], tick_s: float = TICK_S):
        self.notifier = notifier
        self.status = status
        self.tick_s = tick_s
        self.lags: deque[float] = deque(maxlen=WINDOW)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        ping_every = self.notifier.watchdog_s
        last_ping = last_status = time.monotonic()
        shown = None
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
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
