"""Burst admission: a bounded create queue, fair across jobs, and its figures.

At most `max_active` creates run at once (they compete for the worker
threads and the kernel's mount and cgroup locks anyway; more in parallel only
adds latency). The others wait in one FIFO per job (label `job`; unlabelled
creates share the job ""), and a freed slot goes to the next job in
round-robin order, so two jobs bursting together both progress whatever their
sizes. At most `max_queued` creates wait: past that a create fails at once
with `busy` and a `retry_after_s` estimated from the recent create rate, so
memory stays bounded and no caller waits forever.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from contextlib import asynccontextmanager

from . import metrics
from .errors import Busy


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class CreateQueue:
    def __init__(self, max_active: int, max_queued: int, window: int = 2048):
        if max_active < 1 or max_queued < 0:
            raise ValueError("admission.max_active_creates must be >= 1 and max_queued_creates >= 0")
        self.max_active = max_active
        self.max_queued = max_queued
        self.active = 0
        self.queued = 0
        self._jobs: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()
        self._waits: deque[float] = deque(maxlen=window)       # seconds waited, recent creates
        self._done: deque[float] = deque(maxlen=window)        # monotonic end times, recent creates
        self.admitted = 0
        self.rejected = 0
        self.max_wait_s = 0.0

    # ------------------------------------------------------------ figures

    def rate(self) -> float:
        """Creates finished per second over the recent window (0 when unknown)."""
        if len(self._done) < 2:
            return 0.0
        span = time.monotonic() - self._done[0]
        return len(self._done) / span if span > 0 else 0.0

    def retry_after(self, ahead: int) -> float:
        rate = self.rate()
        est = ahead / rate if rate > 0 else 1.0
        return round(min(max(est, 0.05), 60.0), 3)

    def info(self) -> dict:
        waits = list(self._waits)
        return {"active": self.active, "queued": self.queued, "max_active": self.max_active,
                "max_queued": self.max_queued,
                "queued_by_job": {job: len(q) for job, q in self._jobs.items()},
                "admitted": self.admitted, "rejected_busy": self.rejected,
                "wait_p50_ms": round(_percentile(waits, 0.5) * 1000, 3),
                "wait_p99_ms": round(_percentile(waits, 0.99) * 1000, 3),
                "wait_max_ms": round(self.max_wait_s * 1000, 3),
                "creates_per_s": round(self.rate(), 1)}

    # ------------------------------------------------------------ slots

    def reject(self, message: str, detail: dict) -> Busy:
        self.rejected += 1
        return Busy(message, detail)

    @asynccontextmanager
    async def slot(self, job: str):
        """Hold one create slot for the body; waits (fairly) or raises Busy."""
        start = time.monotonic()
        if self.active < self.max_active and not self.queued:
            self.active += 1
        else:
            if self.queued >= self.max_queued:
                raise self.reject(
                    f"create queue is full ({self.queued} waiting, admission.max_queued_creates "
                    f"{self.max_queued}); retry later or on another host",
                    {"queued": self.queued, "max_queued": self.max_queued,
                     "retry_after_s": self.retry_after(self.queued + self.active)})
            fut = asyncio.get_running_loop().create_future()
            self._jobs.setdefault(job, deque()).append(fut)
            self.queued += 1
            try:
                await fut            # resolved by _release: the slot is handed over, active unchanged
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release()  # we were handed a slot just as we were cancelled
                else:
                    self._forget(job, fut)
                raise
        waited = time.monotonic() - start
        metrics.ADMISSION_WAIT.observe(waited)
        self._waits.append(waited)
        self.max_wait_s = max(self.max_wait_s, waited)
        self.admitted += 1
        try:
            yield waited
        finally:
            self._done.append(time.monotonic())
            self._release()

    def _forget(self, job: str, fut: asyncio.Future) -> None:
        q = self._jobs.get(job)
        if q is not None and fut in q:
            q.remove(fut)
            self.queued -= 1
            if not q:
                del self._jobs[job]

    def set_max_active(self, max_active: int) -> None:
        """A new cap on the creates running at once (a config reload). Raised,
        the creates waiting take the new slots now; lowered, those running
        go on, and the slots they free are not handed on until fewer than
        the new cap run."""
        if max_active < 1:
            raise ValueError("admission.max_active_creates must be >= 1")
        self.max_active = max_active
        while self.active < self.max_active and self._hand_over():
            self.active += 1

    def _release(self) -> None:
        """Hand the slot to the head of the next job in round-robin order, or
        free it: freed too while more run than the cap (lowered meanwhile)."""
        if self.active > self.max_active or not self._hand_over():
            self.active -= 1

    def _hand_over(self) -> bool:
        """Give a slot to the head of the next job in round-robin order;
        False when no create waits for one."""
        while self._jobs:
            job, q = next(iter(self._jobs.items()))
            fut = q.popleft()
            self.queued -= 1
            if q:
                self._jobs.move_to_end(job)
            else:
                del self._jobs[job]
            if not fut.done():
                fut.set_result(None)
                return True
        return False
