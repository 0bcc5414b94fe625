"""The node's memory and lifecycle ops: pause/resume (with reclaim and
prefetch), jobs, TTLs and leases, and the events stream.

A mixin of Node (dsecd/node.py). The mechanisms live in dsecd/mem/ (freezer,
reclaim, prefetch, zram, DAMON); this module decides when to call them and
keeps the sandbox states, the journal and the event stream in step.

States added here: running <-> paused. A paused sandbox is frozen and its
memory reclaimed; any exec or file request resumes it first when
memory.auto_resume is on (else it is refused with `conflict`). Paused time
does not count towards the idle TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from .config import parse_duration
from .cpu.sampler import round_robin
from .errors import Conflict, DsecError, NotFound
from .journal import write_file_atomic
from .mem import damon, pause, swapfile, zram

log = logging.getLogger(__name__)

# Sandboxes whose OOM-kill counter one reaper pass (each second) reads.
OOM_CHECKS_PER_PASS = 500

EVENT_KINDS = ("created", "paused", "resumed", "expired", "oom", "died", "destroyed")


class EventBus:
    """Fan-out of state changes to `events` subscribers, each with a bounded queue.

    A subscriber that does not keep up loses the oldest events, and the next
    event it gets says how many it lost: the daemon never blocks on a reader."""

    def __init__(self, per_subscriber: int = 1024, history: int = 256):
        self.max = per_subscriber
        self.subscribers: set[Subscriber] = set()
        self.recent: deque[dict] = deque(maxlen=history)
        self.seq = 0

    def publish(self, kind: str, sandbox: str, **detail) -> None:
        self.seq += 1
        ev = {"seq": self.seq, "time": time.time(), "event": kind, "sandbox": sandbox, **detail}
        self.recent.append(ev)
        for sub in self.subscribers:
            sub.push(ev)


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


class MemOps:
    """Needs from Node: cfg, sandboxes, loop, pool, run_blocking, _get, _journal, _destroy."""

    def init_memory(self, cfg) -> None:
        mem = cfg.section("memory")
        self.pause_cfg = pause.PauseConfig.from_section(mem)
        self.auto_resume = mem["auto_resume"]
        self.zram = zram.ZramSwap(zram.ZramConfig.from_section(mem["zram"]))
        self.swapfile = swapfile.Swapfile(swapfile.SwapfileConfig.from_section(mem["swapfile"], cfg.state_dir))
        self.swap_errors: dict[str, str] = {}
        # Work nobody waits for (reclaim after a job pause, prefetch after a
        # resume) runs on its own small pool: on the request pool, 500
        # reclaims waiting on swap writeback held a job resume's thaws up
        # for 8 s, and disk prefetches held on-demand resumes up 200 ms.
        self.mem_pool = ThreadPoolExecutor(int(mem["background_threads"]), "dsecd-mem")
        self._behind: dict[str, asyncio.Future] = {}
        self._oom_cursor = 0          # where the next OOM check pass starts (_oom_check)
        self.damon = damon.DamonController(damon.DamonConfig.from_section(mem["damon"], cfg.state_dir))
        self.damon_running = False
        self.events = EventBus()
        self._reaper_task: asyncio.Task | None = None

    # ------------------------------------------------------------ start / stop

    def start_memory(self) -> None:
        """Swap (zram, swap file) and DAMON at start, as configured (blocking;
        in a thread). A swap backend that fails is a logged degradation shown
        in `dsec info`: pause then frees less, it does not fail."""
        if self.zram.cfg.enabled:
            try:
                self._start_zram()
            except OSError as err:
                self.swap_errors["zram"] = str(err)
                log.error("zram swap not set up (memory.zram.enabled): %s", err)
        if self.swapfile.cfg.enabled:
            try:
                self.swapfile.setup()
            except OSError as err:
                self.swap_errors["swapfile"] = str(err)
                log.error("swap file not set up (memory.swapfile.enabled): %s", err)
        if self.damon.cfg.enabled:
            avail = self.damon.probe()
            if not avail.available:
                log.warning("DAMON not used: %s", avail.reason)
                return
            live = [s.id for s in self.sandboxes.values() if s.state in ("running", "paused")]
            self.damon.start([self._scheme(i) for i in live])
            self.damon_running = True

    def _start_zram(self) -> None:
        """Adopt the device a previous daemon left on for its paused sandboxes
        (its number in <state_dir>/zram.json), else make one and record it:
        without the record every restart would leave one more device behind."""
        state = self.cfg.state_dir / "zram.json"
        try:
            dev = json.loads(state.read_text())["device"]
        except (OSError, ValueError, KeyError, TypeError):
            dev = None
        if isinstance(dev, int) and self.zram.adopt(dev):
            log.info("zram swap on /dev/zram%d: adopted from the previous daemon", dev)
            return
        dev = self.zram.setup()
        write_file_atomic(state, json.dumps({"device": dev}).encode(), fsync=False)
        log.info("zram swap on /dev/zram%d", dev)

    def _scheme(self, sb_id: str) -> damon.SandboxScheme:
        return damon.SandboxScheme(sb_id, f"/{self.sb_defaults['cgroup_root']}/{sb_id}")

    def close_memory(self) -> None:
        """Shutdown (blocking): drop background reclaims and prefetches not
        started, stop our kdamond; take our swap down only when no sandbox
        is paused (swapoff would page all their memory back in; the next
        daemon adopts a swap file left on)."""
        self.mem_pool.shutdown(wait=False, cancel_futures=True)
        if self.damon_running:
            try:
                self.damon.stop()
            except OSError as err:
                log.error("stop DAMON: %s", err)
        if any(s.state == "paused" for s in self.sandboxes.values()):
            log.warning("swap left on: paused sandboxes hold pages in it")
            return
        for name, backend in (("swap file", self.swapfile), ("zram", self.zram)):
            if backend.cfg.enabled:
                try:
                    backend.teardown()
                except OSError as err:
                    log.error("%s teardown: %s", name, err)
        if self.zram.device is None:
            (self.cfg.state_dir / "zram.json").unlink(missing_ok=True)

    def memory_info(self) -> dict:
        """For `dsec info` (blocking: sysfs and /proc/swaps reads): the swap
        backends dsecd manages and what they hold."""
        out = {}
        z = self.zram
        out["zram"] = {"enabled": z.cfg.enabled, "device": None if z.device is None else f"/dev/zram{z.device}",
                       "on": z.is_swap_on()}
        try:
            if z.device is not None:
                out["zram"]["stats"] = z.stats()
        except OSError as err:              # removed behind dsecd's back: say so, info still answers
            out["zram"]["error"] = str(err)
        f = self.swapfile
        out["swapfile"] = {"enabled": f.cfg.enabled, "path": f.path, "on": f.active, **f.usage()}
        for name, err in self.swap_errors.items():
            out[name]["error"] = err
        return out

    def _behind_answer(self, sb, fn, *args) -> asyncio.Future:
        """Run `fn` on the memory pool for `sb`, behind an answer already given.
        A newer piece of work for the same sandbox cancels an older one that
        has not started (a resume makes a pending reclaim pointless)."""
        self._cancel_behind(sb.id)
        fut = self.loop.run_in_executor(self.mem_pool, fn, *args)
        self._behind[sb.id] = fut
        fut.add_done_callback(lambda f, i=sb.id: self._behind.pop(i) if self._behind.get(i) is f else None)
        return fut

    def _cancel_behind(self, sb_id: str) -> None:
        fut = self._behind.pop(sb_id, None)
        if fut is not None:
            fut.cancel()        # only takes effect if it has not started

    def start_reaper(self) -> None:
        self._reaper_task = self.loop.create_task(self._reap_loop())

    # ------------------------------------------------------------ hooks called by node.py

    def on_created(self, sb) -> None:
        sb.last_active = time.monotonic()
        if self.damon_running:
            try:
                self.damon.add(self._scheme(sb.id))
            except OSError as err:
                log.error("DAMON scheme for sandbox %s: %s", sb.id, err)
        self.events.publish("created", sb.id, image=sb.image, labels=sb.labels)

    def before_destroy(self, sb) -> None:
        """Blocking: drop the DAMON scheme before the memcg goes (else commit is
        EINVAL), and thaw a frozen sandbox (a frozen v1 task only dies thawed)."""
        self.loop.call_soon_threadsafe(self._cancel_behind, sb.id)
        if self.damon_running:
            try:
                self.damon.remove(sb.id)
            except OSError as err:
                log.error("remove DAMON scheme of sandbox %s: %s", sb.id, err)
        if sb.state == "paused" and sb.handle is not None:
            try:
                pause.Freezer.of(sb.handle.group).thaw()
            except OSError as err:
                log.warning("thaw sandbox %s before destroy: %s", sb.id, err)

    async def ensure_running(self, sb, why: str) -> None:
        """Called before exec and file ops: resume a paused sandbox (or refuse)."""
        sb.last_active = time.monotonic()
        if sb.state != "paused":
            return
        if not self.auto_resume:
            raise Conflict(f"sandbox {sb.id} is paused; resume it before {why} (memory.auto_resume is off)",
                           {"sandbox": sb.id, "state": "paused"})
        # On demand: thaw first, so the request is not held up by the prefetch,
        # which then runs behind it. The record is read before: resume clears it.
        rec = pause.PauseRecord.from_json(sb.pause_record or {})
        await self._resume(sb, mode="none")
        if rec.working_set and self.pause_cfg.prefetch_mode != "none":
            self._behind_answer(sb, pause.prefetch, rec.working_set, self.pause_cfg.prefetch_mode)

    # ------------------------------------------------------------ pause / resume

    async def _pause(self, sb) -> dict:
        async with sb.lock:
            if sb.state == "paused":
                return {"id": sb.id, "state": "paused", "already": True}
            if sb.state != "running":
                raise Conflict(f"sandbox {sb.id} is {sb.state}; only a running sandbox can be paused")
            self._cancel_behind(sb.id)          # a prefetch still queued would undo the reclaim
            try:
                rec = await self.run_blocking(pause.pause, sb.handle.group, self.pause_cfg)
            except OSError as err:
                raise DsecError(f"pause sandbox {sb.id}: {err}", code="busy" if err.errno == 16 else "io") from err
            return self._mark_paused(sb, rec)

    def _mark_paused(self, sb, rec: pause.PauseRecord, journal: bool = True) -> dict:
        sb.state = "paused"
        sb.paused_at = time.monotonic()
        sb.pause_record = rec.to_json()
        if journal:
            self._journal(sb)
        self.events.publish("paused", sb.id, freed_bytes=rec.freed)
        return {"id": sb.id, "state": "paused", "frozen_s": round(rec.frozen_s, 4),
                "reclaim_s": round(rec.reclaim_s, 4), "freed_bytes": rec.freed, "methods": rec.methods}

    async def _resume(self, sb, mode: str | None = None) -> dict:
        async with sb.lock:
            if sb.state != "paused":
                return {"id": sb.id, "state": sb.state, "already": True}
            self._cancel_behind(sb.id)          # a reclaim still queued after a job pause
            rec = pause.PauseRecord.from_json(sb.pause_record or {})
            try:
                res = await self.run_blocking(pause.resume, sb.handle.group, rec, self.pause_cfg.freeze_timeout_s,
                                              mode or self.pause_cfg.prefetch_mode)
            except OSError as err:
                raise DsecError(f"resume sandbox {sb.id}: {err}", code="io") from err
            self._mark_resumed(sb, res.prefetched_bytes)
            return {"id": sb.id, "state": "running", "prefetch_s": round(res.prefetch_s, 4),
                    "thaw_s": round(res.thaw_s, 4), "prefetched_bytes": res.prefetched_bytes}

    def _mark_resumed(self, sb, prefetched_bytes: int, journal: bool = True) -> None:
        sb.state = "running"
        if sb.paused_at is not None:
            sb.paused_total += time.monotonic() - sb.paused_at
        sb.paused_at = None
        sb.pause_record = None
        sb.last_active = time.monotonic()
        if journal:
            self._journal(sb)
        self.events.publish("resumed", sb.id, prefetched_bytes=prefetched_bytes)

    async def op_pause(self, req, ctx) -> dict:
        return await self._pause(self._get(req.sandbox, req))

    async def op_resume(self, req, ctx) -> dict:
        return await self._resume(self._get(req.sandbox, req))

    # ------------------------------------------------------------ jobs (label job=<id>)

    def _job(self, job: str, states: tuple[str, ...]) -> list:
        sbs = [s for s in self.sandboxes.values() if s.labels.get("job") == job and s.state in states]
        if not sbs and not any(s.labels.get("job") == job for s in self.sandboxes.values()):
            raise NotFound(f"no sandbox has label job={job}")
        return sbs

    def _journal_job(self, sbs: list) -> None:
        """Journal a job op's sandboxes before the answer, in one append (one
        write, one fdatasync with journal.fsync; dsecd/journal.py put_many).
        Records are taken on the loop, so none can be older than one the
        loop writes later (a thread writing behind the answer could put a
        stale "paused" after a resume's "running")."""
        # One destroyed meanwhile (a destroy does not wait for a job op) is not
        # written back: a restarted daemon would adopt it as a ghost.
        self.journal.write_many([(s.id, s.record()) for s in sbs if self.sandboxes.get(s.id) is s])

    async def op_job_pause(self, req, ctx) -> dict:
        """Freeze the whole job at once (what the caller waits for), answer, and
        reclaim each sandbox's memory behind the answer."""
        sbs = self._job(req.job, ("running",))
        freezers = [pause.Freezer.of(s.handle.group) for s in sbs]
        t0 = time.monotonic()
        failed = await self.run_blocking(pause.freeze_all, freezers, self.pause_cfg.freeze_timeout_s)
        freeze_s = time.monotonic() - t0
        failed_ids = {s.id for s, f in zip(sbs, freezers, strict=True) if f in failed}
        paused = [s for s in sbs if s.id not in failed_ids and self.sandboxes.get(s.id) is s
                  and s.state == "running"]       # not destroyed or paused alone meanwhile
        for s in paused:
            self._mark_paused(s, pause.PauseRecord(), journal=False)
        self._journal_job(paused)

        async def reclaim(s) -> None:
            try:
                rec = await self._behind_answer(s, pause.reclaim_frozen, s.handle.group, self.pause_cfg)
            except asyncio.CancelledError:
                return                          # resumed (or destroyed) before its turn
            except OSError as err:
                log.warning("reclaim of paused sandbox %s: %s", s.id, err)
                return
            if s.state == "paused":
                s.pause_record = rec.to_json()
                try:
                    self._journal_job([s])
                except OSError as err:      # e.g. the log closed at shutdown: the record stays as it was
                    log.error("journal paused sandbox %s: %s", s.id, err)

        for s in paused:
            self._cancel_behind(s.id)
            self.loop.create_task(reclaim(s))
        return {"job": req.job, "paused": [s.id for s in paused], "failed": sorted(failed_ids),
                "freeze_s": round(freeze_s, 4)}

    async def op_job_resume(self, req, ctx) -> dict:
        """Thaw the whole job at once (what the caller waits for: one blocking
        call that asks every group, then waits, as freeze_all does; a thaw per
        sandbox through the pool took 2.2 s for 500), then bring each one's
        working set back behind the answer, as an on-demand resume does."""
        sbs = sorted(self._job(req.job, ("paused",)), key=lambda s: s.id)
        async with contextlib.AsyncExitStack() as held:
            for s in sbs:                   # serialised with pause/exec/destroy of each
                await held.enter_async_context(s.lock)
            sbs = [s for s in sbs if s.state == "paused" and s.handle is not None]
            for s in sbs:
                self._cancel_behind(s.id)   # reclaims still queued after the job pause
            freezers = [pause.Freezer.of(s.handle.group) for s in sbs]
            t0 = time.monotonic()
            failed = await self.run_blocking(pause.thaw_all, freezers, self.pause_cfg.freeze_timeout_s)
            thaw_s = time.monotonic() - t0
            failed_ids = {s.id for s, f in zip(sbs, freezers, strict=True) if f in failed}
            if failed_ids:
                log.warning("job %s: %d sandbox(es) not thawed within %gs, left paused: %s", req.job,
                            len(failed_ids), self.pause_cfg.freeze_timeout_s, sorted(failed_ids)[:8])
            resumed = [s for s in sbs if s.id not in failed_ids and self.sandboxes.get(s.id) is s
                       and s.state == "paused"]   # not destroyed meanwhile
            for s in resumed:
                rec = pause.PauseRecord.from_json(s.pause_record or {})
                self._mark_resumed(s, 0, journal=False)
                if rec.working_set and self.pause_cfg.prefetch_mode != "none":
                    self._behind_answer(s, pause.prefetch, rec.working_set, self.pause_cfg.prefetch_mode)
            self._journal_job(resumed)
        return {"job": req.job, "resumed": [s.id for s in resumed], "thaw_s": round(thaw_s, 4),
                "failed": {i: "not thawed in time (see the daemon log)" for i in sorted(failed_ids)}}

    async def op_job_rm(self, req, ctx) -> dict:
        sbs = self._job(req.job, ("running", "paused", "dead"))
        results = await asyncio.gather(*(self._destroy(s, req.force) for s in sbs), return_exceptions=True)
        return {"job": req.job, "destroyed": [r["id"] for r in results if isinstance(r, dict)],
                "failed": {s.id: str(r) for s, r in zip(sbs, results, strict=True) if isinstance(r, BaseException)}}

    # ------------------------------------------------------------ TTLs and leases

    async def op_renew(self, req, ctx) -> dict:
        lease = parse_duration(req.lease, "lease")
        renewed, missing = [], []
        for sb_id in req.sandboxes:
            sb = self.sandboxes.get(sb_id)
            if sb is None:
                missing.append(sb_id)
                continue
            sb.lease = lease or sb.lease
            if sb.lease:
                sb.lease_deadline = time.monotonic() + sb.lease
                renewed.append(sb_id)
        return {"renewed": renewed, "missing": missing}

    def _expired(self, sb, now: float) -> str | None:
        if sb.state not in ("running", "paused"):
            return None
        if sb.ttl and time.time() - sb.created > sb.ttl:
            return "ttl"
        if sb.lease_deadline and now > sb.lease_deadline:
            return "lease"
        if sb.idle_ttl and sb.state == "running" and not sb.execs:
            if now - sb.last_active > sb.idle_ttl:
                return "idle_ttl"
        return None

    def _oom_check(self) -> list[tuple[object, int]]:
        """(sandbox, its OOM kill count) for each whose count grew; blocking
        (cgroup reads, in a worker). The loop reports them (_report_oom).

        At most OOM_CHECKS_PER_PASS sandboxes a pass, round-robin: one cgroup
        file read per sandbox per second was ~2% of a 2,000-sandbox burst's
        CPU; past that many sandboxes, an OOM event comes up to
        n / OOM_CHECKS_PER_PASS seconds late instead (or at the sandbox's
        end: oom_count)."""
        out = []
        batch, self._oom_cursor = round_robin(list(self.sandboxes.values()), self._oom_cursor, OOM_CHECKS_PER_PASS)
        for sb in batch:
            if sb.state != "running" or sb.handle is None:
                continue
            try:
                n = pause.oom_kills(sb.handle.group)
            except OSError:
                continue
            if n > sb.oom_kills:
                out.append((sb, n))
        return out

    def _report_oom(self, sb, n: int) -> None:
        """Publish the kills past those already reported. Only on the loop, so
        the reaper and a sandbox's end (oom_count) never report one twice."""
        if n > sb.oom_kills:
            self.events.publish("oom", sb.id, kills=n - sb.oom_kills)
            log.info("sandbox %s: %d process(es) killed by its memory limit", sb.id, n - sb.oom_kills)
            sb.oom_kills = n

    def oom_count(self, group) -> int | None:
        """A sandbox's OOM kill count, read at its end just before its cgroups
        are removed (blocking): kills the round-robin check (_oom_check) had
        not come round to yet are then reported (_report_oom), not lost with
        the sandbox. None if it cannot be read."""
        try:
            return pause.oom_kills(group)
        except OSError:
            return None

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for sb, n in await self.run_blocking(self._oom_check):
                self._report_oom(sb, n)
            now = time.monotonic()
            for sb in list(self.sandboxes.values()):
                why = self._expired(sb, now)
                if why is None:
                    continue
                try:
                    await self._destroy(sb, force=True)
                    self.events.publish("expired", sb.id, reason=why)
                    log.info("sandbox %s expired (%s)", sb.id, why)
                except DsecError as err:
                    log.warning("expire sandbox %s (%s): %s", sb.id, why, err)

    # ------------------------------------------------------------ events

    async def op_events(self, req, ctx) -> dict:
        """Stream state changes until the client cancels or disconnects."""
        def wanted(ev: dict) -> bool:          # one filter for the replay and the live stream
            return not req.sandbox or ev["sandbox"] == req.sandbox

        sub = Subscriber(self.events)
        for ev in list(self.events.recent) if req.replay else []:
            if wanted(ev):
                await ctx.emit(ev)
        if not req.follow:
            return {}
        self.events.subscribers.add(sub)
        try:
            while True:
                await sub.wake.wait()
                sub.wake.clear()
                while sub.queue:
                    ev = sub.queue.popleft()
                    if sub.lost:
                        ev = {**ev, "lost_before": sub.lost}
                        sub.lost = 0
                    if wanted(ev):
                        await ctx.emit(ev)
        finally:
            self.events.subscribers.discard(sub)
