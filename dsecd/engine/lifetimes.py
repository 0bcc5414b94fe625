"""How long a sandbox lives: its TTL (max lifetime), idle TTL (paused time
excluded) and lease (a client must `renew` it), checked once a second by a
reaper that destroys what expired; the same pass reports new OOM kills.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..config import parse_duration
from ..errors import DsecError
from ..execio import reap_strays_of_helped
from .events import EventBus
from .memory import MemoryService
from .sandboxes import Sandbox, SandboxRegistry
from .workers import Workers

log = logging.getLogger(__name__)


class LifetimeService:
    """`renew`, and the reaper. `destroy(sb, force, reason=)` is the lifecycle's
    destroy; `memory` counts OOM kills (its oom_check, report_oom)."""

    def __init__(self, registry: SandboxRegistry, workers: Workers, events: EventBus, memory: MemoryService,
                 destroy: Callable[..., Awaitable[dict]]):
        self.registry = registry
        self.workers = workers
        self.events = events
        self.memory = memory
        self.destroy = destroy
        self._reaper_task: asyncio.Task | None = None

    def start(self) -> None:
        self._reaper_task = self.workers.loop.create_task(self._reap_loop())

    def stop(self) -> None:
        if self._reaper_task:
            self._reaper_task.cancel()

    async def renew(self, req, ctx) -> dict:
        lease = parse_duration(req.lease, "lease")
        renewed, missing, no_lease = [], [], []
        for sb_id in req.sandboxes:
            sb = self.registry.by_id.get(sb_id)
            if sb is None:
                missing.append(sb_id)
                continue
            if lease and lease != sb.lease:
                sb.lease = lease
                # Journaled, as a create's lease is: a restarted daemon that
                # brought the old length back would end the sandbox before a
                # client renewing at a third of the new one comes again.
                if sb.state in ("running", "paused", "dead"):
                    self.registry.save(sb)
            if sb.lease:
                sb.lease_deadline = time.monotonic() + sb.lease
                renewed.append(sb_id)
            else:                   # nothing to renew: it lives on without one (its TTLs aside)
                no_lease.append(sb_id)
        return {"renewed": renewed, "missing": missing, "no_lease": no_lease}

    @staticmethod
    def expired(sb: Sandbox, now: float) -> str | None:
        """Why `sb` must go now (ttl, lease, idle_ttl), or None. A dead one
        (its init exited) too, but for idleness: its record would otherwise
        stay, holding its id range, long after its TTL or the client that
        held its lease."""
        if sb.state not in ("running", "paused", "dead"):
            return None
        if sb.ttl and time.time() - sb.created > sb.ttl:
            return "ttl"
        if sb.lease_deadline and now > sb.lease_deadline:
            return "lease"
        if sb.idle_ttl and sb.state == "running" and not sb.execs and not sb.copies:
            if now - sb.last_active > sb.idle_ttl:
                return "idle_ttl"
        return None

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for sb, n in await self.workers.run(self.memory.oom_check):
                self.memory.report_oom(sb, n)
            helped = [sb.handle.init_pid for sb in self.registry.by_id.values()
                      if sb.helper_execs and sb.handle is not None and sb.backend != "microvm"]
            if helped:
                await self.workers.run(reap_strays_of_helped, helped)
            now = time.monotonic()
            for sb in list(self.registry.by_id.values()):
                why = self.expired(sb, now)
                if why is None:
                    # Expired once, its destroy failed, and it is no longer
                    # (renewed, active again): a later expiry is said again.
                    sb.expired = False
                    continue
                # Announced before its destroy, and once: a follower that
                # stops at `destroyed` has seen why.
                if not sb.expired:
                    sb.expired = True
                    self.events.publish("expired", sb.id, reason=why)
                try:
                    await self.destroy(sb, True, reason=why)
                except DsecError as err:
                    log.warning("expire sandbox %s (%s): %s", sb.id, why, err)
                except Exception:       # a bug must not end the expiry of every sandbox after it
                    log.exception("expire sandbox %s (%s)", sb.id, why)
