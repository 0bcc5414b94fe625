"""The node's create path: idempotency keys, burst admission, warm pools.

A mixin of Node (dsecd/node.py), whose `create_now` does the actual create.
`op_create` here, in order:

1. **key**: a create with an idempotency key that was seen before answers
   with the same sandbox (or waits for the create still making it); the key
   is journaled with the sandbox, so this holds across a daemon restart. A
   key is free again once its sandbox is destroyed or its create failed.
2. **warm pool**: a create that matches a pool's (image, shape) takes one of
   its ready sandboxes: labels, env, cwd, user, TTLs, lease and key are set
   on it, and it is out of the pool for good (never handed out twice).
3. **full host**: live sandboxes + queued creates at `limits.max_sandboxes`
   is `busy` at once, with `retry_after_s`.
4. **queue**: dsecd/admission.py, bounded and fair across jobs.

Pools (`pool_set`, `pool_ls`) are kept in `<state_dir>/pools.json`; their
sandboxes are ordinary journaled sandboxes labelled `dsec.pool=<pool>`,
re-adopted after a restart like any other, and count against capacity. A
refiller tops each pool up to its target at `pool.refill_per_s` overall,
through the same create queue (as job `dsec.pool`), so user bursts keep
their share.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field

from . import protocol
from .admission import CreateQueue
from .config import ConfigError, parse_duration, parse_size
from .errors import BadRequest, Busy, DsecError, NotFound

log = logging.getLogger(__name__)

POOL_LABEL = "dsec.pool"
POOL_JOB = "dsec.pool"


@dataclass
class Pool:
    name: str
    image: str
    cpu: float
    memory: int
    min: int
    max: int
    ready: deque = field(default_factory=deque)    # sandbox ids, oldest first
    creating: int = 0
    taken: int = 0
    created: int = 0
    failed: int = 0
    error: str | None = None
    takes: deque = field(default_factory=lambda: deque(maxlen=4096))   # monotonic times of takes

    def target(self, window: float) -> int:
        """min, plus what was taken in the last `window` seconds (demand), up to max."""
        now = time.monotonic()
        while self.takes and now - self.takes[0] > window:
            self.takes.popleft()
        return max(self.min, min(self.max, self.min + len(self.takes)))

    def config(self) -> dict:
        return {"image": self.image, "cpu": self.cpu, "memory": self.memory, "min": self.min, "max": self.max}

    def public(self, window: float) -> dict:
        return {"name": self.name, **self.config(), "ready": len(self.ready), "creating": self.creating,
                "target": self.target(window), "taken": self.taken, "created": self.created,
                "failed": self.failed, "error": self.error}


def pool_name(image: str, cpu: float, memory: int) -> str:
    return f"{image}@{cpu:g}cpu-{memory >> 20}M"


class CreateOps:
    """Needs from Node: cfg, limits, sb_defaults, sandboxes, live_count, loop, create_now, _limits_for, _journal,
    net_service, cpu, check_cwd."""

    def init_admission(self, cfg) -> None:
        a = cfg.section("admission")
        self.admission = CreateQueue(a["max_active_creates"], a["max_queued_creates"])
        self.adm_cfg = a
        self.pool_cfg = cfg.section("pool")
        self.pools: dict[str, Pool] = {}
        self.create_keys: dict[str, str | asyncio.Future] = {}
        self._pools_path = cfg.state_dir / "pools.json"
        self._pool_task: asyncio.Task | None = None
        self._refills: set[asyncio.Task] = set()

    async def start_admission(self) -> None:
        """After the journal was re-adopted: keys and pool membership from the records."""
        for sb in self.sandboxes.values():
            if sb.key:
                self.create_keys[sb.key] = sb.id
        try:
            saved = json.loads(self._pools_path.read_text())
        except FileNotFoundError:
            saved = {}
        except ValueError as err:
            log.error("ignoring unreadable %s: %s", self._pools_path, err)
            saved = {}
        for name, conf in saved.items():
            self.pools[name] = Pool(name=name, **conf)
        for sb in sorted(self.sandboxes.values(), key=lambda s: s.created):
            name = sb.labels.get(POOL_LABEL)
            if name is None or sb.state != "running":
                continue
            if name in self.pools:
                self.pools[name].ready.append(sb.id)
            else:        # its pool was removed meanwhile
                self.loop.create_task(self._destroy_quiet(sb))
        self._pool_task = self.loop.create_task(self._refill_loop())

    def close_admission(self) -> None:
        for task in (self._pool_task, *self._refills):
            if task:
                task.cancel()

    def free_key(self, sb) -> None:
        """A destroyed sandbox's key is free again (a create with it makes a new one)."""
        if sb.key and self.create_keys.get(sb.key) == sb.id:
            del self.create_keys[sb.key]

    def admission_info(self) -> dict:
        return {**self.admission.info(), "keys": len(self.create_keys),
                "pools": {n: {"ready": len(p.ready), "creating": p.creating, "taken": p.taken}
                          for n, p in self.pools.items()}}

    # ------------------------------------------------------------ create

    async def op_create(self, req, ctx) -> dict:
        if req.key is not None and not 1 <= len(req.key) <= 256:
            raise BadRequest("key must be 1 to 256 characters")
        if req.labels.get(POOL_LABEL) is not None:
            raise BadRequest(f"label {POOL_LABEL} is reserved for warm pools")
        if not req.key:
            return await self._create_admitted(req)
        known = self.create_keys.get(req.key)
        if isinstance(known, str) and known in self.sandboxes:
            return {**self.sandboxes[known].public(), "existing": True}
        if isinstance(known, asyncio.Future):
            return {**await asyncio.shield(known), "existing": True}
        fut = self.loop.create_future()
        self.create_keys[req.key] = fut
        try:
            result = await self._create_admitted(req)
        except BaseException as err:
            self.create_keys.pop(req.key, None)
            fut.set_exception(err if isinstance(err, Exception) else DsecError("create cancelled",
                                                                            code="conflict"))
            fut.exception()      # retrieved: nobody else may be waiting
            raise
        self.create_keys[req.key] = result["id"]
        fut.set_result(result)
        return result

    async def _create_admitted(self, req) -> dict:
        limits = self._limits_for(req)        # a bad request fails before it queues
        taken = await self._take_from_pool(req, limits)
        if taken is not None:
            return taken
        live = self.live_count()
        cap = self.limits["max_sandboxes"]
        queue = self.admission
        if live + queue.queued >= cap:
            raise queue.reject(
                f"host is full: {live} sandboxes and {queue.queued} queued creates of max {cap}; "
                "retry later or on another host",
                {"sandboxes": live, "queued": queue.queued, "max": cap,
                 "retry_after_s": self.adm_cfg["full_retry_after_s"]})
        async with queue.slot(req.labels.get("job", "")) as waited:
            try:
                result = await self.create_now(req, None)
            except Busy as err:         # CPU/memory admission, or full after the wait
                err.detail.setdefault("retry_after_s", self.adm_cfg["full_retry_after_s"])
                raise
        result["queued_ms"] = round(waited * 1000, 3)
        return result

    # ------------------------------------------------------------ warm pools

    def _pool_match(self, req, limits) -> Pool | None:
        if (req.pids is not None or req.cpu_quota is not None or req.hostname is not None or req.allow
                or req.disk is not None
                or (req.qos or self.cpu.cfg["default_qos"]) != self.cpu.cfg["default_qos"]
                or (req.net or self.net_service.net_cfg["default_mode"])
                != self.net_service.net_cfg["default_mode"]):
            return None
        return self.pools.get(pool_name(req.image, limits.cpu, limits.memory_bytes))

    async def _take_from_pool(self, req, limits) -> dict | None:
        pool = self._pool_match(req, limits)
        if pool is None:
            return None
        self.check_process(req)
        ttl, idle_ttl = parse_duration(req.ttl, "ttl"), parse_duration(req.idle_ttl, "idle_ttl")
        lease = parse_duration(req.lease, "lease")
        while pool.ready:
            sb = self.sandboxes.get(pool.ready.popleft())
            if sb is None or sb.state != "running" or sb.labels.get(POOL_LABEL) != pool.name:
                continue
            try:
                await self.check_cwd(sb, req.cwd)
            except BaseException:
                self._return_to_pool(pool, sb)
                raise
            if sb.state != "running" or sb.id not in self.sandboxes:     # gone while we checked
                continue
            # Out of the pool for good: the label goes, the caller's settings come.
            sb.labels, sb.env, sb.cwd, sb.user = dict(req.labels), dict(req.env), req.cwd, req.user
            sb.ttl, sb.idle_ttl, sb.lease, sb.key = ttl, idle_ttl, lease, req.key
            sb.created = time.time()
            sb.last_active = time.monotonic()
            sb.lease_deadline = sb.last_active + lease if lease else None
            self._journal(sb)
            pool.taken += 1
            pool.takes.append(time.monotonic())
            return {**sb.public(), "pool": pool.name}
        return None

    def _return_to_pool(self, pool: Pool, sb) -> None:
        """A sandbox taken out of `pool` but not handed out goes back, if the
        pool still exists and has room (it may have been removed or shrunk
        meanwhile); else it goes."""
        if self.pools.get(pool.name) is pool and len(pool.ready) < pool.max:
            pool.ready.appendleft(sb.id)
        else:
            self.loop.create_task(self._destroy_quiet(sb))

    async def op_pool_set(self, req, ctx) -> dict:
        d = self.sb_defaults
        cpu = float(d["cpu"] if req.cpu is None else req.cpu)
        try:
            memory = parse_size(d["memory"] if req.memory is None else req.memory)
        except ConfigError as err:
            raise BadRequest(f"memory: {err}") from err
        if not 0 <= req.min <= req.max <= self.limits["max_sandboxes"]:
            raise BadRequest(f"need 0 <= min <= max <= limits.max_sandboxes "
                             f"({self.limits['max_sandboxes']}), got min {req.min} max {req.max}")
        # Same validation as a create of this shape.
        self._limits_for(protocol.Create(image=req.image, cpu=cpu, memory=memory))
        try:
            await self.run_blocking(self.images.get, req.image)
        except Exception as err:
            raise NotFound(f"no image {req.image!r}", {"image": req.image}) from err
        name = pool_name(req.image, cpu, memory)
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = Pool(name=name, image=req.image, cpu=cpu, memory=memory,
                                           min=req.min, max=req.max)
        pool.min, pool.max, pool.error = req.min, req.max, None
        self._save_pools()
        # Shrink now: ready sandboxes past max go (a pool with max 0 is removed).
        while len(pool.ready) > pool.max:
            sb = self.sandboxes.get(pool.ready.pop())
            if sb is not None:
                self.loop.create_task(self._destroy_quiet(sb))
        if pool.max == 0:
            del self.pools[name]
            self._save_pools()
            return {**pool.public(self.pool_cfg["demand_window_s"]), "removed": True}
        return pool.public(self.pool_cfg["demand_window_s"])

    async def op_pool_list(self, req, ctx) -> dict:
        return {"pools": [p.public(self.pool_cfg["demand_window_s"]) for p in self.pools.values()]}

    def _save_pools(self) -> None:
        tmp = self._pools_path.with_name(".pools.json.tmp")
        tmp.write_text(json.dumps({n: p.config() for n, p in self.pools.items() if p.max > 0}))
        os.replace(tmp, self._pools_path)

    async def _destroy_quiet(self, sb) -> None:
        try:
            await self._destroy(sb, True)
        except DsecError as err:
            log.warning("destroy pool sandbox %s: %s", sb.id, err)

    async def _refill_loop(self) -> None:
        interval = self.pool_cfg["refill_interval_s"]
        budget = 0.0
        while True:
            await asyncio.sleep(interval)
            budget = min(budget + self.pool_cfg["refill_per_s"] * interval, self.pool_cfg["refill_per_s"])
            for pool in list(self.pools.values()):
                need = pool.target(self.pool_cfg["demand_window_s"]) - len(pool.ready) - pool.creating
                while need > 0 and budget >= 1 and self.admission.queued < self.admission.max_queued // 2:
                    need -= 1
                    budget -= 1
                    pool.creating += 1
                    task = self.loop.create_task(self._refill_one(pool))
                    self._refills.add(task)
                    task.add_done_callback(self._refills.discard)

    async def _refill_one(self, pool: Pool) -> None:
        req = protocol.Create(image=pool.image, cpu=pool.cpu, memory=pool.memory,
                              labels={POOL_LABEL: pool.name})
        try:
            async with self.admission.slot(POOL_JOB):
                result = await self.create_now(req, None)
        except Busy:
            return                   # full: the next round tries again
        except DsecError as err:
            pool.failed += 1
            if pool.error != str(err):
                log.error("refill pool %s: %s", pool.name, err)
            pool.error = str(err)
            return
        finally:
            pool.creating -= 1
        pool.created += 1
        if self.pools.get(pool.name) is pool and len(pool.ready) < pool.max:
            pool.ready.append(result["id"])
        else:
            sb = self.sandboxes.get(result["id"])
            if sb is not None:
                await self._destroy_quiet(sb)
