"""Sandbox state changes as events: published by the services that make
them, streamed to `events` subscribers, the recent ones kept for replay, and
handed to listeners (the log line and counters of each: lifelog.py)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

EVENT_KINDS = ("created", "paused", "reclaimed", "resumed", "expired", "oom", "died", "destroyed", "denied",
               "net_lost")


class EventBus:
    """Fan-out of state changes to `events` subscribers, each with a bounded queue;
    the `events` request (stream) is one subscriber.

    A subscriber that does not keep up loses the oldest events, and the next
    event it gets says how many it lost: the daemon never blocks on a reader."""

    def __init__(self, per_subscriber: int = 1024, history: int = 256,
                 named: Callable[[str], str] | None = None):
        """named: the full id of the live sandbox an `events` request names
        (an id or a prefix), raising NotFound for none."""
        self.named = named
        self.max = per_subscriber
        self.subscribers: set[Subscriber] = set()
        self.recent: deque[dict] = deque(maxlen=history)
        self.seq = 0
        # Called with every event, on the loop, before any subscriber sees it.
        self.listeners: list[Callable[[dict], None]] = []

    def publish(self, kind: str, sandbox: str, **detail) -> None:
        self.seq += 1
        ev = {"seq": self.seq, "time": time.time(), "event": kind, "sandbox": sandbox, **detail}
        self.recent.append(ev)
        for fn in self.listeners:
            fn(ev)
        for sub in self.subscribers:
            sub.push(ev)

    async def stream(self, req, ctx) -> dict:
        """Stream state changes until the client cancels or disconnects. A
        sandbox named must be live or in the history kept (a sandbox
        destroyed a moment ago): a name that matches nothing would wait
        forever for nothing."""
        sandbox = req.sandbox
        if sandbox and self.named is not None and not any(ev["sandbox"] == sandbox for ev in self.recent):
            sandbox = self.named(sandbox)

        def wanted(ev: dict) -> bool:          # one filter for the replay and the live stream
            return not sandbox or ev["sandbox"] == sandbox

        sub = Subscriber(self)
        # The history and the subscription are taken together, before the
        # replay's first await: what is published while the replay is sent
        # is queued for after it, none missed and none twice.
        history = list(self.recent) if req.replay else []
        if req.follow:
            self.subscribers.add(sub)
        try:
            for ev in history:
                if wanted(ev):
                    await ctx.emit(ev)
            if not req.follow:
                return {}
            while True:
                await sub.wake.wait()
                sub.wake.clear()
                while sub.queue:
                    ev = sub.queue.popleft()
                    if not wanted(ev):
                        continue
                    # Told with the next event it sends: those it drops would
                    # swallow the count (what was lost may have been wanted).
                    if sub.lost:
                        ev = {**ev, "lost_before": sub.lost}
                        sub.lost = 0
                    await ctx.emit(ev)
        finally:
            self.subscribers.discard(sub)


class Subscriber:
    def __init__(self, bus: EventBus):
        self.queue: deque[dict] = deque(maxlen=bus.max)
        self.lost = 0
        self.wake = asyncio.Event()

    def push(self, ev: dict) -> None:
        if len(self.queue) == self.queue.maxlen:
            self.lost += 1
        self.queue.append(ev)
        self.wake.set()
