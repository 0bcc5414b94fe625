"""Memory of sandboxes: pause and resume (with reclaim and prefetch), job
pause and resume, the swap backends and DAMON dsecd runs, OOM kills.

The mechanisms live in dsecd/mem/ (freezer, reclaim, prefetch, zram, DAMON);
this service decides when to call them and keeps the sandbox states, the
journal and the events in step.

States added here: running <-> paused. A paused sandbox is frozen and its
memory reclaimed; any exec or file request resumes it first when
memory.auto_resume is on (else it is refused with `conflict`). Paused time
does not count towards the idle TTL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from .. import native
from ..config import ConfigError
from ..cpu.sampler import round_robin
from ..doing import job_of, run_job
from ..errors import Conflict, DsecError, io_error
from ..journal import write_file_atomic
from ..mem import damon, pause, swapfile, zram
from .events import EventBus
from .sandboxes import SandboxRegistry
from .workers import Workers, before_stop, to_the_end

log = logging.getLogger(__name__)

# Sandboxes whose OOM-kill counter one reaper pass (each second) reads.
OOM_CHECKS_PER_PASS = 500


def boot_id() -> str:
    """This boot's id (a reboot makes zram devices and their numbers anew)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class MemoryService:
    """Pause, resume and job pause/resume (`pause`, `resume`, `job_pause`,
    `job_resume`); the resume an exec or file request needs first
    (ensure_running); the swap backends and DAMON dsecd runs; OOM kills."""

    def __init__(self, cfg, cgroup_root: str, registry: SandboxRegistry, workers: Workers, events: EventBus,
                 vms=None):
        self.cgroup_root = cgroup_root
        self.state_dir = cfg.state_dir
        self.registry = registry
        self.workers = workers
        self.events = events
        self.vms = vms          # MicroVMService: a microVM pauses by saving its state (dsecd/engine/microvms.py)
        mem = cfg.section("memory")
        # Settings out of range or contradicting each other (ValueError naming
        # the key): a config error, which stops the start in one log line.
        try:
            self.pause_cfg = pause.PauseConfig.from_section(mem)
            zram_cfg = zram.ZramConfig.from_section(mem["zram"])
            swapfile_cfg = swapfile.SwapfileConfig.from_section(mem["swapfile"], cfg.state_dir)
            damon_cfg = damon.DamonConfig.from_section(mem["damon"], cfg.state_dir)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.auto_resume = mem["auto_resume"]
        self.zram = zram.ZramSwap(zram_cfg, owner=str(cfg.state_dir))
        self.swapfile = swapfile.Swapfile(swapfile_cfg, owner=str(cfg.state_dir))
        self.swap_errors: dict[str, str] = {}
        # Work nobody waits for (reclaim after a job pause, prefetch after a
        # resume) runs on its own small pool: on the request pool, 500
        # reclaims waiting on swap writeback held a job resume's thaws up
        # for 8 s, and disk prefetches held on-demand resumes up 200 ms.
        self.mem_pool = ThreadPoolExecutor(int(mem["background_threads"]), "dsecd-mem",
                                           initializer=_background_io)
        self._behind: dict[str, asyncio.Future] = {}
        self._oom_cursor = 0          # where the next OOM check pass starts (oom_check)
        self.damon = damon.DamonController(damon_cfg)
        self.damon_running = False

    # ------------------------------------------------------------ start / stop

    def start(self) -> None:
        """Swap (zram, swap file) and DAMON at start, as configured (blocking;
        in a thread). A swap backend that fails is a logged degradation shown
        in `dsec info`: pause then frees less, it does not fail."""
        if self.zram.cfg.enabled:
            try:
                self._start_zram()
            except OSError as err:
                self.swap_errors["zram"] = str(err)
                log.error("zram swap not set up (memory.zram.enabled): %s", err)
        elif (rec := self._recorded_zram()) is not None:
            if self.zram.adopt(rec[0]):
                log.warning("zram swap on /dev/zram%d: left on by the previous daemon for its paused sandboxes; "
                            "memory.zram is not enabled: it is removed at a stop with no sandbox left", rec[0])
            else:
                self._drop_recorded_zram(*rec)
        if self.swapfile.cfg.enabled:
            try:
                self.swapfile.setup()
            except OSError as err:
                self.swap_errors["swapfile"] = str(err)
                log.error("swap file not set up (memory.swapfile.enabled): %s", err)
        elif self.swapfile.adopt():
            log.warning("swap file %s: left on by the previous daemon for its paused sandboxes; "
                        "memory.swapfile is not enabled: it is removed at a stop with no sandbox left",
                        self.swapfile.path)
        if self.damon.cfg.enabled:
            avail = self.damon.probe()
            if not avail.available:
                log.warning("DAMON not used: %s", avail.detail)
                return
            live = [s.id for s in self.registry.by_id.values() if s.state in ("running", "paused")]
            self.damon.start([self._scheme(i) for i in live])
            self.damon_running = True

    def _start_zram(self) -> None:
        """Adopt the device a previous daemon left on for its paused sandboxes
        (its number in <state_dir>/zram.json), else make one, recorded as
        soon as hot_add hands it out: without the record every restart, and
        every daemon killed while making it, would leave one more device
        behind."""
        rec = self._recorded_zram()
        if rec is not None:
            if self.zram.adopt(rec[0]):
                log.info("zram swap on /dev/zram%d: adopted from the previous daemon", rec[0])
                return
            self._drop_recorded_zram(*rec)
        try:
            dev = self.zram.setup(on_added=self._record_zram)
        except BaseException:
            if self.zram.device is None:        # undone: nothing left to record
                (self.state_dir / "zram.json").unlink(missing_ok=True)
            raise
        log.info("zram swap on /dev/zram%d", dev)

    def _record_zram(self, dev: int) -> None:
        # Not fsynced: a kill leaves the page cache, and a reboot no device, behind.
        write_file_atomic(self.state_dir / "zram.json", json.dumps({"device": dev, "boot_id": boot_id()}).encode(),
                          fsync=False)

    def _recorded_zram(self) -> tuple[int, bool] | None:
        """The number of the zram device a previous daemon made (<state_dir>/zram.json),
        and whether the record is of this boot (an older dsecd's has no boot id);
        None, and the record dropped, for one of an earlier boot (a reboot removes
        the devices, and their numbers are handed out afresh)."""
        try:
            rec = json.loads((self.state_dir / "zram.json").read_text())
            dev = rec["device"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if rec.get("boot_id", None) not in (None, boot_id()):
            (self.state_dir / "zram.json").unlink(missing_ok=True)
            return None
        return (dev, "boot_id" in rec) if isinstance(dev, int) else None

    def _drop_recorded_zram(self, dev: int, this_boot: bool) -> None:
        """The recorded device, which could not be adopted: removed if it is
        this daemon's (left half made by a daemon killed while making it,
        or swapped off since), and the record dropped either way. Only a
        record of this boot (written as hot_add answered) is trusted with a
        removal; an older dsecd's record is dropped, as that dsecd did."""
        try:
            if this_boot and self.zram.remove_leftover(dev):
                log.warning("zram%d: removed; a daemon stopped before it was set up as swap", dev)
        except OSError as err:
            log.error("zram%d, left by a daemon stopped while making it, could not be removed (remove it "
                      "with `echo %d > /sys/class/zram-control/hot_remove` once unused): %s", dev, dev, err)
        (self.state_dir / "zram.json").unlink(missing_ok=True)

    def _scheme(self, sb_id: str) -> damon.SandboxScheme:
        return damon.SandboxScheme(sb_id, f"/{self.cgroup_root}/{sb_id}")

    def close(self) -> None:
        """Shutdown (blocking): drop background reclaims and prefetches not
        started, stop our kdamond; take our swap down only when no sandbox
        is left (the next daemon adopts what is left on). swapoff pages
        every swapped page back in, charged to its sandbox's memcg: a paused
        sandbox's whole memory, and a running one's past its limit (swap
        holds up to sandbox.swap_per_memory more), which does not fit, so
        the OOM killer took its processes, init too. A backend no longer enabled
        whose area a previous daemon left on was adopted at start: it goes
        too, or nothing would ever take it down."""
        self.mem_pool.shutdown(wait=False, cancel_futures=True)
        if self.damon_running:
            try:
                self.damon.stop()
            except OSError as err:
                log.error("stop DAMON: %s", err)
        swaps = [(name, backend) for name, backend, on in (("swap file", self.swapfile, self.swapfile.active),
                                                           ("zram", self.zram, self.zram.device is not None))
                 if backend.cfg.enabled or on]
        if self.registry.by_id:
            if swaps:
                log.warning("swap left on for the next daemon: %d sandbox(es) live on, which may hold pages "
                            "in it", len(self.registry.by_id))
            return
        for name, backend in swaps:
            try:
                backend.teardown()
            except OSError as err:
                log.error("%s teardown: %s", name, err)
        if self.zram.device is None:
            (self.state_dir / "zram.json").unlink(missing_ok=True)

    def info(self) -> dict:
        """For `dsec info` (blocking: sysfs and /proc/swaps reads): the swap
        backends dsecd manages and what they hold."""
        out = {}
        z = self.zram
        out["zram"] = {"enabled": z.cfg.enabled, "device": None if z.device is None else f"/dev/zram{z.device}",
                       "on": z.is_swap_on(), **z.usage()}
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
        fut = self.workers.loop.run_in_executor(self.mem_pool, run_job, job_of(fn, args))
        self._behind[sb.id] = fut
        fut.add_done_callback(lambda f, i=sb.id: self._behind.pop(i) if self._behind.get(i) is f else None)
        return fut

    def _cancel_behind(self, sb_id: str) -> None:
        fut = self._behind.pop(sb_id, None)
        if fut is not None:
            fut.cancel()        # only takes effect if it has not started

    # ------------------------------------------------------------ hooks of a sandbox's create and destroy

    def on_created(self, sb, duration_s: float) -> None:
        """A create's last step; `duration_s` is its wall time (for the event)."""
        sb.last_active = time.monotonic()
        if self.damon_running:
            try:
                self.damon.add(self._scheme(sb.id))
            except OSError as err:
                log.error("DAMON scheme for sandbox %s: %s", sb.id, err)
        self.events.publish("created", sb.id, image=sb.image, labels=sb.labels, job=sb.labels.get("job"),
                            qos=sb.qos, cpu=sb.limits["cpu"], memory=sb.limits["memory"],
                            pids=sb.limits["pids"], duration_ms=round(duration_s * 1000, 3))

    def before_destroy(self, sb, paused: bool) -> None:
        """Blocking: drop the DAMON scheme before the memcg goes (else commit is
        EINVAL), and thaw a sandbox that was `paused` (a frozen v1 task only
        dies thawed)."""
        self.workers.loop.call_soon_threadsafe(self._cancel_behind, sb.id)
        if self.damon_running:
            try:
                self.damon.remove(sb.id)
            except OSError as err:
                log.error("remove DAMON scheme of sandbox %s: %s", sb.id, err)
        if paused and sb.handle is not None:
            try:
                pause.Freezer.of(sb.handle.group).thaw()
            except OSError as err:
                log.warning("thaw sandbox %s before destroy: %s", sb.id, err)

    async def ensure_running(self, sb, why: str) -> None:
        """Called before exec and file ops: resume a paused sandbox (or refuse)."""
        sb.last_active = time.monotonic()
        if (_is_vm(sb) or sb.pausing) and sb.lock.locked():
            # A pause (or, for a VM, a resume or snapshot) under way: a VM's
            # pause saves the guest and ends its QEMU, with the agent's
            # channel, and a container's freezes it and reclaims (seconds into
            # swap), while its state still says running: an exec sent in
            # then would stand frozen until someone resumed it. Wait for it,
            # then resume it below if paused.
            async with sb.lock:
                pass
        if sb.state != "paused":
            return
        if not self.auto_resume:
            raise Conflict(f"sandbox {sb.id} is paused; resume it (dsec resume {sb.id}) before {why}: "
                           "memory.auto_resume is off",
                           {"sandbox": sb.id, "state": "paused"})
        if _is_vm(sb):
            await self._resume(sb)
            return
        # On demand: thaw first, so the request is not held up by the prefetch,
        # which then runs behind it. The record is read before: resume clears it.
        rec = pause.PauseRecord.from_json(sb.pause_record or {})
        await self._resume(sb, mode="none")
        if rec.working_set and self.pause_cfg.prefetch_mode != "none":
            self._behind_answer(sb, pause.prefetch, rec.working_set, self.pause_cfg.prefetch_mode,
                                sb.handle.group)

    # ------------------------------------------------------------ pause / resume

    async def _pause(self, sb) -> dict:
        """Pause a sandbox. Once begun a pause finishes, recorded, even if
        its request is cancelled (its client gone, a `cancel`): its freeze
        goes on in a worker thread either way, and a sandbox frozen while
        its state says running would hang every exec. So do a resume and a
        job's pause and resume."""
        return await to_the_end(self._pause_locked(sb), [sb.lock])

    async def _pause_locked(self, sb) -> dict:
        if sb.state == "paused":
            return {"id": sb.id, "state": "paused", "already": True}
        if sb.state != "running":
            raise Conflict(f"sandbox {sb.id} is {sb.state}; only a running sandbox can be paused")
        sb.pausing = True                   # requests that come meanwhile wait for its end (ensure_running)
        try:
            return await self._pause_running(sb)
        finally:
            sb.pausing = False

    async def _pause_running(self, sb) -> dict:
        self._cancel_behind(sb.id)          # a prefetch still queued would undo the reclaim
        if _is_vm(sb):
            try:
                rec = await self.vms.pause(sb)
            except Exception as err:
                # A destroy that came meanwhile ended its QEMU under it (the
                # monitor closed mid-save, the handle taken): that is the
                # news, not how the cut step failed.
                gone = self.registry.destroyed_error(sb, "pause")
                if gone is None:
                    raise
                raise gone from err
            self._check_not_destroyed(sb, "pause")
            try:
                return self._mark_vm_paused(sb, rec)
            except OSError as err:
                raise await self._unpause(sb, lambda: self.vms.resume(sb, rec), err) from err
        # Paused time from the freeze on: the reclaim after it can take
        # seconds, during which the sandbox's execs are frozen but their
        # run-time timeouts (Sandbox.paused_for) would still count.
        sb.paused_at = time.monotonic()
        try:
            rec = await self.workers.run(pause.pause, sb.handle.group, self.pause_cfg)
            self._check_not_destroyed(sb, "pause")
        except OSError as err:
            sb.end_paused_time()
            raise DsecError(f"pause sandbox {sb.id}: {err}", code="busy" if err.errno == 16 else "io") from err
        except Exception:
            sb.end_paused_time()
            raise
        try:
            return self._mark_paused(sb, rec)
        except OSError as err:
            raise await self._unpause(sb, lambda: self.workers.run(
                pause.resume, sb.handle.group, rec, self.pause_cfg.freeze_timeout_s, "none"), err) from err

    def _check_not_destroyed(self, sb, what: str) -> None:
        """Conflict if a destroy (which takes no sandbox lock) came while the
        sandbox was being paused or resumed: its record is gone from the
        journal, and one written now would be adopted as a ghost."""
        gone = self.registry.destroyed_error(sb, what)
        if gone is not None:
            raise gone

    async def _unpause(self, sb, resume, err: OSError) -> DsecError:
        """A pause whose journal record could not be written (the state dir's
        disk full, say) is undone, so that the sandbox runs as its record says
        and a restarted daemon finds it as it is; returns the error to raise."""
        try:
            await resume()
        except (OSError, DsecError) as undo_err:
            log.error("sandbox %s: undo a pause the journal did not record: %s", sb.id, undo_err)
        else:
            sb.state, sb.pause_record = "running", None
            sb.end_paused_time()
        return io_error("record the pause of", f"sandbox {sb.id}", err)

    def _mark_vm_paused(self, sb, rec: dict, journal: bool = True) -> dict:
        """A microVM paused (dsecd/engine/microvms.py): its state in a file,
        its QEMU gone; or (a job pause, until its save behind the answer)
        only its vCPUs stopped: {"vm_stopped": True}."""
        sb.state = "paused"
        sb.paused_at = time.monotonic()
        sb.pause_record = rec
        if journal:
            self.registry.save(sb)
        freed = rec.get("freed_bytes") or 0
        self.events.publish("paused", sb.id, freed_bytes=freed)
        return {"id": sb.id, "state": "paused", "frozen_s": rec.get("save_s", 0.0), "reclaim_s": rec.get("stop_s", 0.0),
                "freed_bytes": freed, "methods": ["vm-save"], "image_bytes": rec.get("image_bytes", 0),
                "held_bytes": rec.get("held_bytes")}

    def _mark_paused(self, sb, rec: pause.PauseRecord, journal: bool = True) -> dict:
        """journal False: a job pause's, whose reclaim comes behind the
        answer: its event has no duration (null, as a job resume's)."""
        sb.state = "paused"
        if sb.paused_at is None:            # set before the freeze by a pause of its own (_pause)
            sb.paused_at = time.monotonic()
        sb.pause_record = rec.to_json()
        if journal:
            self.registry.save(sb)
        self.events.publish("paused", sb.id, freed_bytes=rec.freed,
                            duration_ms=round((rec.frozen_s + rec.reclaim_s) * 1000, 3) if journal else None)
        return {"id": sb.id, "state": "paused", "frozen_s": round(rec.frozen_s, 4),
                "reclaim_s": round(rec.reclaim_s, 4), "freed_bytes": rec.freed, "methods": rec.methods}

    async def _resume(self, sb, mode: str | None = None) -> dict:
        """Resume a paused sandbox; once begun, to its end (see _pause)."""
        return await to_the_end(self._resume_locked(sb, mode), [sb.lock])

    async def _resume_locked(self, sb, mode: str | None) -> dict:
        if sb.state != "paused":
            return {"id": sb.id, "state": sb.state, "already": True}
        self._cancel_behind(sb.id)          # a reclaim still queued after a job pause
        if _is_vm(sb):
            try:
                res = await self.vms.resume(sb, sb.pause_record or {})
            except Exception as err:
                # A destroy that came meanwhile ended its QEMU under it (the
                # monitor closed mid-load, the handle taken): that is the
                # news, not how the cut step failed.
                gone = self.registry.destroyed_error(sb, "resume")
                if gone is None:
                    raise
                raise gone from err
            self._check_not_destroyed(sb, "resume")
            if self._mark_resumed(sb, 0):
                await self.vms.saved_state_done(sb)
            return {"id": sb.id, "state": "running", "prefetch_s": 0.0, "thaw_s": res["restore_s"],
                    "prefetched_bytes": 0}
        rec = pause.PauseRecord.from_json(sb.pause_record or {})
        try:
            res = await self.workers.run(pause.resume, sb.handle.group, rec, self.pause_cfg.freeze_timeout_s,
                                         mode or self.pause_cfg.prefetch_mode)
        except OSError as err:
            raise DsecError(f"resume sandbox {sb.id}: {err}", code="io") from err
        self._check_not_destroyed(sb, "resume")
        self._mark_resumed(sb, res.prefetched_bytes, duration_s=res.thaw_s + res.prefetch_s)
        return {"id": sb.id, "state": "running", "prefetch_s": round(res.prefetch_s, 4),
                "thaw_s": round(res.thaw_s, 4), "prefetched_bytes": res.prefetched_bytes}

    def _mark_resumed(self, sb, prefetched_bytes: int, journal: bool = True,
                      duration_s: float | None = None) -> bool:
        """True when the record says running now (journal: written here)."""
        recorded = journal
        sb.state = "running"
        sb.end_paused_time()
        sb.pause_record = None
        sb.last_active = time.monotonic()
        if journal:
            try:
                self.registry.save(sb)
            except OSError as err:
                # It runs: what asked for the resume (an exec, say) goes on.
                # Its record says paused until the next write succeeds.
                log.error("sandbox %s resumed, but its journal record could not say so: %s", sb.id, err)
                recorded = False
        self.events.publish("resumed", sb.id, prefetched_bytes=prefetched_bytes,
                            duration_ms=None if duration_s is None else round(duration_s * 1000, 3))
        return recorded

    async def pause(self, req, ctx) -> dict:
        return await self._pause(self.registry.get(req.sandbox, req))

    async def resume(self, req, ctx) -> dict:
        return await self._resume(self.registry.get(req.sandbox, req))

    async def join_job_op(self, sb, op: str) -> None:
        """A sandbox whose create ran while a job_pause (op "pause") or
        job_resume ("resume") of its job began: paused or resumed as the
        job's others were (CreateService). Already so: nothing to do."""
        if op == "pause" and sb.state == "running":
            await self._pause(sb)
        elif op == "resume" and sb.state == "paused":
            await self._resume(sb)

    # ------------------------------------------------------------ jobs (label job=<id>)

    def _journal_job(self, sbs: list) -> None:
        """Journal a job op's sandboxes before the answer, in one append (one
        write, one fdatasync with journal.fsync; dsecd/journal.py put_many).
        Records are taken on the loop, so none can be older than one the
        loop writes later (a thread writing behind the answer could put a
        stale "paused" after a resume's "running")."""
        # One destroyed meanwhile (a destroy does not wait for a job op) is not
        # written back: a restarted daemon would adopt it as a ghost.
        self.registry.journal.write_many([(s.id, s.record()) for s in sbs if self.registry.listed(s)])

    async def job_pause(self, req, ctx) -> dict:
        """Freeze the whole job at once (what the caller waits for), answer, and
        reclaim each sandbox's memory behind the answer. Once begun, to its
        end (see _pause)."""
        async with self.registry.job_lock(req.job):
            everyone = sorted(self.registry.job_op_begun(req.job, "pause", ("running",)), key=lambda s: s.id)
            # Serialised with pause/resume/snapshot of each, as job_resume is,
            # in the same (id) order.
            return await to_the_end(self._job_pause_locked(req, everyone), [s.lock for s in everyone])

    async def _job_pause_locked(self, req, everyone: list) -> dict:
        # Paused or destroyed by a request the locks waited for.
        everyone = [s for s in everyone if s.state == "running" and s.handle is not None]
        for s in everyone:
            s.pausing = True        # an exec or file request waits for the freeze's end (ensure_running)
        try:
            return await self._job_pause(req, everyone)
        finally:
            for s in everyone:
                s.pausing = False

    async def _job_pause(self, req, everyone: list) -> dict:
        sbs = [s for s in everyone if not _is_vm(s)]
        vms = [s for s in everyone if _is_vm(s)]
        freezers = [pause.Freezer.of(s.handle.group) for s in sbs]
        t0 = time.monotonic()
        # Paused time from the freeze on, as a pause of one sandbox counts
        # it: freeze_all waits for the slowest group (up to freeze_timeout_s)
        # while the others stand frozen. A snapshot's freeze may have begun it.
        for s in sbs:
            if s.paused_at is None:
                s.paused_at = t0
        # A microVM freezes by stopping its vCPUs (QMP stop, a few ms), at the
        # same time as the containers' freezers; its state is saved and its
        # QEMU ended behind the answer (save_stopped_vm), as a container's
        # memory is reclaimed behind it.
        frozen, stops = await asyncio.gather(
            self.workers.run(pause.freeze_all, freezers, self.pause_cfg.freeze_timeout_s),
            asyncio.gather(*(self.vms.stop_vcpus(s) for s in vms), return_exceptions=True))
        freeze_s = time.monotonic() - t0
        failed_ids = {s.id for s, f in zip(sbs, freezers, strict=True) if f in frozen}
        for s in sbs:
            if s.id in failed_ids:
                s.end_paused_time()         # thawed again: it runs on, its frozen time kept
        for s, r in zip(vms, stops, strict=True):
            if isinstance(r, BaseException):
                log.warning("job %s: microVM %s not stopped: %s", req.job, s.id, r)
                failed_ids.add(s.id)
        paused = [s for s in everyone if s.id not in failed_ids and self.registry.listed(s)
                  and s.state == "running"]       # not destroyed or paused alone meanwhile
        for s in paused:
            if _is_vm(s):
                self._mark_vm_paused(s, {"vm_stopped": True}, journal=False)
            else:
                self._mark_paused(s, pause.PauseRecord(), journal=False)
        self._journal_job(paused)
        for s in paused:
            if _is_vm(s):
                before_stop(self.workers.loop.create_task(self._save_stopped_vm(s),
                                                          name=f"job pause's save of VM {s.id}"))
        paused_ctr = [s for s in paused if not _is_vm(s)]

        async def reclaim(s) -> None:
            try:
                rec = await self._behind_answer(s, pause.reclaim_frozen, s.handle.group, self.pause_cfg)
            except asyncio.CancelledError:
                return                          # resumed (or destroyed) before its turn
            except OSError as err:
                log.warning("reclaim of paused sandbox %s: %s", s.id, err)
                return
            # The job pause's own event said 0: what was freed is said now.
            self.events.publish("reclaimed", s.id, freed_bytes=rec.freed,
                                duration_ms=round(rec.reclaim_s * 1000, 3))
            if s.state == "paused":
                s.pause_record = rec.to_json()
                try:
                    self._journal_job([s])
                except OSError as err:      # e.g. the log closed at shutdown: the record stays as it was
                    log.error("journal paused sandbox %s: %s", s.id, err)

        for s in paused_ctr:
            self._cancel_behind(s.id)
            self.workers.loop.create_task(reclaim(s))
        return {"job": req.job, "paused": [s.id for s in paused], "failed": sorted(failed_ids),
                "freeze_s": round(freeze_s, 4)}

    async def _save_stopped_vm(self, sb) -> None:
        """Behind a job pause's answer: a microVM whose vCPUs it stopped has
        its state saved and its QEMU ended, all of its memory back to the
        host, unless a resume or destroy came first (the sandbox's lock
        orders them)."""
        async with sb.lock:
            if sb.state != "paused" or not (sb.pause_record or {}).get("vm_stopped") or sb.handle is None:
                return
            if sb.execs or self.vms.watching(sb) or self.vms.requests_under_way(sb):
                # A save would end them (a watch) or is refused (an exec), or
                # would wait for requests the stopped guest cannot answer:
                # stopped, they go on after the job's resume.
                log.info("job-paused microVM %s keeps its QEMU (vCPUs stopped): %d exec(s), %d file "
                         "watch(es) and %d file or process request(s) wait for its resume on its agent's "
                         "channel", sb.id, sb.execs, self.vms.watching(sb), self.vms.requests_under_way(sb))
                return
            try:
                rec = await self.vms.pause(sb)
            except Exception as err:
                if self.registry.destroyed_error(sb, "save") is not None:
                    # A destroy (which takes no sandbox lock) ended QEMU under the save.
                    log.debug("job-paused microVM %s was destroyed during its save (%s)", sb.id, err)
                    return
                if not isinstance(err, DsecError):
                    raise
                if err.detail.get("qemu_stuck"):        # saved, but its QEMU outlived SIGKILL: the error says
                    log.error("job-paused microVM %s: %s", sb.id, err)
                else:
                    log.warning("job-paused microVM %s: its state could not be saved (%s); it stays stopped "
                                "in its QEMU", sb.id, err)
                return
            # The job pause's own event said 0: what the save freed is said now.
            self.events.publish("reclaimed", sb.id, freed_bytes=rec.get("freed_bytes") or 0,
                                duration_ms=round((rec.get("save_s", 0.0) + rec.get("stop_s", 0.0)) * 1000, 3))
            sb.pause_record = rec
            try:
                self._journal_job([sb])
            except OSError as err:
                log.error("journal paused sandbox %s: %s", sb.id, err)

    async def job_resume(self, req, ctx) -> dict:
        """Thaw the whole job at once (what the caller waits for: one blocking
        call that asks every group, then waits, as freeze_all does; a thaw per
        sandbox through the pool took 2.2 s for 500), then bring each one's
        working set back behind the answer, as an on-demand resume does.
        Once begun, to its end (see _pause)."""
        async with self.registry.job_lock(req.job):
            sbs = sorted(self.registry.job_op_begun(req.job, "resume", ("paused",)), key=lambda s: s.id)
            # Serialised with pause/exec/destroy of each.
            return await to_the_end(self._job_resume_locked(req, sbs), [s.lock for s in sbs])

    async def _job_resume_locked(self, req, sbs: list) -> dict:
        everyone = [s for s in sbs if s.state == "paused" and s.handle is not None]
        sbs = [s for s in everyone if not _is_vm(s)]
        vms = [s for s in everyone if _is_vm(s)]
        for s in sbs:
            self._cancel_behind(s.id)   # reclaims still queued after the job pause
        freezers = [pause.Freezer.of(s.handle.group) for s in sbs]
        t0 = time.monotonic()
        # microVMs: vCPUs stopped (cont) or state saved (a new QEMU loads it), in parallel.
        thawed, vm_results = await asyncio.gather(
            self.workers.run(pause.thaw_all, freezers, self.pause_cfg.freeze_timeout_s),
            asyncio.gather(*(self.vms.resume(s, s.pause_record or {}) for s in vms), return_exceptions=True))
        thaw_s = time.monotonic() - t0
        failed_ids = {s.id for s, f in zip(sbs, freezers, strict=True) if f in thawed}
        for s, r in zip(vms, vm_results, strict=True):
            if isinstance(r, BaseException):
                log.warning("job %s: microVM %s not resumed: %s", req.job, s.id, r)
                failed_ids.add(s.id)
        sbs = everyone
        if failed_ids:
            log.warning("job %s: %d sandbox(es) not thawed within %gs, left paused: %s", req.job,
                        len(failed_ids), self.pause_cfg.freeze_timeout_s, sorted(failed_ids)[:8])
        resumed = [s for s in sbs if s.id not in failed_ids and self.registry.listed(s)
                   and s.state == "paused"]   # not destroyed meanwhile
        for s in resumed:
            if _is_vm(s):
                self._mark_resumed(s, 0, journal=False)
                continue
            rec = pause.PauseRecord.from_json(s.pause_record or {})
            self._mark_resumed(s, 0, journal=False)
            if rec.working_set and self.pause_cfg.prefetch_mode != "none":
                self._behind_answer(s, pause.prefetch, rec.working_set, self.pause_cfg.prefetch_mode,
                                    s.handle.group)
        self._journal_job(resumed)
        await asyncio.gather(*(self.vms.saved_state_done(s) for s in resumed if _is_vm(s)))
        return {"job": req.job, "resumed": [s.id for s in resumed], "thaw_s": round(thaw_s, 4),
                "failed": {i: "not thawed in time (see the daemon log)" for i in sorted(failed_ids)}}

    # ------------------------------------------------------------ OOM kills

    def oom_check(self) -> list[tuple[object, int]]:
        """(sandbox, its OOM kill count) for each whose count grew; blocking
        (cgroup reads, in a worker). The loop reports them (report_oom).

        At most OOM_CHECKS_PER_PASS sandboxes a pass, round-robin: one cgroup
        file read per sandbox per second was ~2% of a 2,000-sandbox burst's
        CPU; past that many sandboxes, an OOM event comes up to
        n / OOM_CHECKS_PER_PASS seconds late instead (or at the sandbox's
        end: oom_count)."""
        out = []
        batch, self._oom_cursor = round_robin(list(self.registry.by_id.values()), self._oom_cursor,
                                              OOM_CHECKS_PER_PASS)
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

    def report_oom(self, sb, n: int) -> None:
        """Publish the kills past those already reported. Only on the loop, so
        the reaper and a sandbox's end (oom_count) never report one twice."""
        if n > sb.oom_kills:
            self.events.publish("oom", sb.id, kills=n - sb.oom_kills)
            sb.oom_kills = n

    async def oom_killed_since(self, sb, before: int) -> bool:
        """Whether a container's OOM kill count grew past `before` (its
        sb.oom_kills when an exec started): an exec that then ended by
        SIGKILL was the OOM killer's victim, or went with it. New kills are
        reported here, as the reaper would report them."""
        if sb.backend != "container" or sb.handle is None or sb.state != "running":
            return False
        try:
            n = await self.workers.run(pause.oom_kills, sb.handle.group)
        except OSError:
            return False
        self.report_oom(sb, n)
        return n > before

    def oom_count(self, group) -> int | None:
        """A sandbox's OOM kill count, read at its end just before its cgroups
        are removed (blocking): kills the round-robin check (oom_check) had
        not come round to yet are then reported (report_oom), not lost with
        the sandbox. None if it cannot be read."""
        try:
            return pause.oom_kills(group)
        except OSError:
            return None


def _background_io() -> None:
    """A memory-pool thread's I/O goes to the idle class: a prefetch's swap-in
    (the whole working set of a resumed sandbox, read behind the request that
    resumed it) then waits for the page faults of the sandboxes running now,
    the next resumed one among them, instead of queueing ahead of them. The
    CPU priority stays: a low-priority thread holding the GIL would hold up
    the event loop."""
    try:
        native.ioprio_idle()
    except OSError as err:
        log.warning("memory pool thread keeps its I/O priority: %s", err)


def _is_vm(sb) -> bool:
    """A microVM sandbox: it pauses by saving its state (MicroVMService), not by the freezer."""
    return getattr(sb, "backend", "container") == "microvm"
