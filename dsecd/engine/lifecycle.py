"""A sandbox's life after its create: watched until its init exits (then
dead), destroyed on request (alone, all, a job's) or when it expires, listed
and inspected, and re-adopted from the journal when a daemon starts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from .. import execio
from ..backends.container import Handle, close_handle
from ..backends.microvm.backend import SAVED_STATE, guest_panic, how_qemu_ended
from ..config import ConfigError
from ..cpu.manager import CpuHost
from ..errors import Conflict, io_error
from ..fs import upper as upperfs
from ..fs.layers import LayerMounts
from ..mem import pause
from . import lifelog
from .events import EventBus
from .idranges import IdRanges
from .memory import MemoryService
from .microvms import MicroVMService
from .network import NetworkService
from .procs import ProcessService
from .sandboxes import Sandbox, SandboxRegistry
from .workers import Workers

log = logging.getLogger(__name__)

# The journaled fields a re-adopted sandbox is rebuilt from (Sandbox.record).
RECORD_FIELDS = ("image", "state", "created", "limits", "env", "labels", "hostname", "cwd", "user", "gid", "groups",
                 "backend",
                 "died", "death", "qos", "core_sched", "manifest", "layers", "ttl", "idle_ttl", "lease", "pause_record",
                 "net", "key", "key_args", "op_keys", "idmap", "procs", "policy", "vm")


def labels_match(sb: Sandbox, labels: dict) -> bool:
    return all(sb.labels.get(k) == v for k, v in labels.items())


class LifecycleService:
    """`destroy`, `destroy_all`, `job_rm`, `list`, `inspect`, `top`; the watch
    on every sandbox's init; re-adoption at start (recover_all)."""

    def __init__(self, registry: SandboxRegistry, workers: Workers, backend, layers: LayerMounts,
                 net: NetworkService, memory: MemoryService, events: EventBus, cpu: CpuHost, id_ranges: IdRanges,
                 procs: ProcessService, vms: MicroVMService | None = None):
        self.registry = registry
        self.workers = workers
        self.backend = backend
        self.vms = vms if vms is not None else MicroVMService(None, "not set up", workers, None, {}, 0, 0)
        self.layers = layers
        self.net = net
        self.memory = memory
        self.events = events
        self.cpu = cpu
        self.id_ranges = id_ranges
        self.procs = procs

    # ------------------------------------------------------------ start / stop

    async def recover_all(self, after_death: bool = False) -> None:
        """Re-adopt journaled sandboxes; clean up what died or was half-made,
        and what no record names (orphans of a crash mid-create).
        after_death: the daemon before did not stop cleanly, so the execs it
        ran may still run: they are killed (_kill_leftover_execs)."""
        records = await self.workers.run(self.registry.journal.load_all)
        vms = {sb_id: rec for sb_id, rec in records.items() if rec.get("backend") == "microvm"}
        self._check_vms_adoptable(vms)
        for sb_id, rec in records.items():
            if sb_id not in vms:
                await self._recover(sb_id, rec, after_death)
        # A VM's channels are reached again with a timeout of their own (30 s
        # for a guest that does not answer): one after the other, a host's
        # hung VMs would hold the socket closed that many times over.
        ended = await asyncio.gather(*(self._recover(sb_id, rec, after_death)
                                       for sb_id, rec in vms.items()), return_exceptions=True)
        for err in ended:
            if isinstance(err, BaseException):
                raise err
        journaled = set(self.registry.by_id) | set(records)     # a record left above is no orphan
        for backend, what in ((self.backend, "sandbox resources"), (self.vms.backend, "microVM")):
            if backend is None:
                continue
            for sb_id in await self.workers.run(backend.orphans, journaled):
                log.warning("removing orphaned %s %s (no journal record)", what, sb_id)
                try:
                    await self.workers.run(backend.destroy, sb_id, None)
                except OSError as err:
                    log.error("could not remove orphaned %s %s: %s; the next start tries again", what, sb_id, err)
        if self.vms.templates is not None:
            await self.workers.run(self.vms.templates.sweep_builds)

    def _check_vms_adoptable(self, vms: dict[str, dict]) -> None:
        """ConfigError when microVMs are journaled and live but this start has
        no microVM backend (QEMU or the guest image gone, a config changed):
        re-adopting them without it would take their QEMUs for dead, and the
        container backend's teardown would kill them. They are left as they
        are, and the start stops, saying so."""
        live = sorted(sb_id for sb_id, rec in vms.items() if rec.get("state") != "dead")
        if live and self.vms.backend is None:
            raise ConfigError(
                f"{len(live)} microVM sandbox(es) are journaled ({', '.join(live[:5])}"
                f"{', ...' if len(live) > 5 else ''}) but the microVM backend is not available: {self.vms.why}. "
                "Their VMs are left as they are; make the backend available again and start the "
                "daemon, then `dsec rm` the VMs to give up")

    async def _recover(self, sb_id: str, rec: dict, after_death: bool = False) -> None:
        sb = Sandbox(id=sb_id, **{k: rec[k] for k in RECORD_FIELDS if k in rec})
        if sb.state in ("creating", "stopping"):
            # Interrupted mid-create or mid-destroy: finish tearing it down.
            log.info("sandbox %s was %s when the daemon stopped; removing it", sb_id, sb.state)
            try:
                await self.workers.run(self.backend_of(sb).destroy, sb_id, None)
            except OSError as err:
                # A cgroup still busy after destroy_timeout_s (a process in D
                # state on a hung store): not this start's to wait for. Its
                # record stays (the orphan sweep skips journaled ids) and the
                # next start tries again.
                log.error("sandbox %s: could not remove it: %s; the next daemon start tries again", sb_id, err)
                return
            self.registry.journal.delete(sb_id)
            return
        self.registry.add(sb)
        self.id_ranges.reserve(sb)
        if sb.state == "dead":
            if sb.lease:        # a lease clock restarts with the daemon, a dead sandbox's too
                sb.lease_deadline = time.monotonic() + sb.lease
            return
        if sb.backend == "microvm":
            await self._recover_vm(sb, rec)
            return
        handle = await self.workers.run(self.backend.adopt, sb_id, rec.get("init_pid"), rec.get("init_start"),
                                        bool(sb.limits.get("disk")))
        if handle is None:
            await self._mark_dead_found(sb, "its init exited while no daemon ran")
            return
        taken = await self.workers.run(self.procs.take_back, sb, handle)
        if handle.init_link is not None:
            handle.init_link.attach(self.workers.loop)      # read what init sent while we were down
        sb.handle = handle
        self.procs.readopt(sb, handle, taken)    # before the loop reads init's answers: no await between
        if sb.state == "running":
            # A kill -9 between a pause's freeze and its journal write leaves a
            # "running" sandbox frozen: thaw it, or its next exec hangs joining it.
            await self.workers.run(lambda: pause.Freezer.of(handle.group).thaw())
        elif sb.state == "paused" and await self.workers.run(lambda: pause.Freezer.of(handle.group).state()) \
                == "THAWED":
            # A kill -9 between a resume's thaw and its journal write (a job
            # resume's takes a while) leaves a "paused" sandbox running: it
            # is recorded as it is, or it would run while listed as paused
            # and a pause would take it for paused already.
            log.warning("sandbox %s was journaled paused but runs (its resume was not recorded): running",
                        sb_id)
            sb.state, sb.pause_record = "running", None
            self.registry.save(sb)
        if after_death:
            await self._kill_leftover_execs(sb, handle)
        sb.last_active = time.monotonic()          # idle and lease clocks restart with the daemon
        if sb.lease:
            sb.lease_deadline = sb.last_active + sb.lease
        self.layers.readopt(sb.layers)
        self.cpu.bind(handle, self.cpu.plan(sb.qos))
        self.watch(sb)
        lifelog.adopted(sb_id, state=sb.state, init_pid=handle.init_pid, image=sb.image,
                        job=sb.labels.get("job"))

    async def _kill_leftover_execs(self, sb: Sandbox, handle) -> None:
        """The execs the helper of a daemon that died left running (init's
        are pruned by init: ProcessService.readopt): their connections went
        with it, so no client reads, times out or cancels them. They are
        killed like the execs of a client that is gone; the journaled
        background processes (proc_start) run on. A graceful stop kills its
        execs itself, so this /proc scan runs only after a death."""
        background = {rec["pid"] for rec in sb.procs if rec.get("state") == "running"}
        try:
            killed = await self.workers.run(self.backend.kill_leftover_execs, handle, background)
        except OSError as err:
            log.error("sandbox %s: cannot look for the execs the daemon before left running: %s; they may "
                      "still run (dsec exec %s -- ps shows them)", sb.id, err, sb.id)
            return
        if killed:
            log.warning("sandbox %s: killed %d exec(s) the daemon before left running when it died "
                        "(pids %s in the sandbox): their clients went with it", sb.id, len(killed),
                        ", ".join(map(str, killed)))

    async def _recover_vm(self, sb: Sandbox, rec: dict) -> None:
        """A microVM sandbox after a restart: its QEMU, and both channels again."""
        handle = None
        # A job pause stops the vCPUs first and saves the state behind its
        # answer: a VM paused only that far still has its QEMU, adopted below.
        saved = sb.state == "paused" and not (sb.pause_record or {}).get("vm_stopped")
        saved = saved or bool((sb.pause_record or {}).get("vm_image"))
        resumed_unrecorded = False
        # The backend is there: a start without it stopped before (_check_vms_adoptable).
        if saved:
            try:
                handle = await self._resumed_unrecorded(sb)
            except OSError as err:
                await self._mark_dead_found(sb, f"the QEMU of a resume its record does not show could not be "
                                                f"ended ({err})")
                return
            resumed_unrecorded = handle is not None
            if handle is None and await self._adopt_paused_vm(sb):
                return
        else:
            handle = await self.workers.run(self.vms.backend.adopt, sb.id, rec.get("init_pid"),
                                            rec.get("init_start"))
            if handle is None and await self._adopt_paused_vm(sb, unrecorded=True):
                return
        if handle is not None:
            try:
                await self.vms.reconnect(sb, handle)
            except Exception as err:
                log.error("sandbox %s: its VM runs but cannot be reached again (%s): destroying it", sb.id, err)
                try:
                    await self.workers.run(self.vms.backend.destroy, sb.id, handle)
                except OSError as destroy_err:      # its remains: _mark_dead_found below says so
                    log.error("sandbox %s: destroy its VM: %s", sb.id, destroy_err)
                handle = None
            else:
                if resumed_unrecorded:
                    self.registry.save(sb)      # running, its new QEMU's pid
                if sb.state == "running":       # a state file of a pause that did not end it is stale
                    await self.vms.saved_state_done(sb)
        if handle is None:
            log.warning("sandbox %s (microVM) died while the daemon was down", sb.id)
            await self._mark_dead_found(sb, "its VM ended while no daemon ran")
            return
        self.vms.adopted(sb, handle)
        sb.handle = handle
        self.procs.readopt_vm(sb)
        sb.last_active = time.monotonic()
        if sb.lease:
            sb.lease_deadline = sb.last_active + sb.lease
        self.watch(sb)
        log.info("re-adopted sandbox %s (microVM, QEMU pid %d)", sb.id, handle.init_pid)

    async def _mark_dead_found(self, sb: Sandbox, why: str) -> None:
        """_mark_dead for a sandbox found dead at re-adoption. Remains the
        host will not let go of (a cgroup still busy after
        destroy_timeout_s: a process in D state on a hung store) are logged,
        not waited for: it is listed dead, `dsec rm` tries again, and the
        start and every other sandbox go on."""
        try:
            await self._mark_dead(sb, None, why)
        except OSError as err:
            log.error("sandbox %s: %s, and its remains could not be removed: %s; it is listed dead, and "
                      "`dsec rm %s` tries again", sb.id, why, err, sb.id)

    async def _resumed_unrecorded(self, sb: Sandbox):
        """The QEMU of a resume the daemon died in before the record said
        running (MicroVMBackend.found_qemu), if its load had finished and the
        VM runs: the sandbox runs again, recorded so once it is reached.
        None otherwise; such a QEMU whose load had not finished is killed,
        and the VM stays paused, from its state file (whose guest never ran
        past it). OSError if it will not die."""
        backend = self.vms.backend
        found = await self.workers.run(backend.found_qemu, sb.id)
        if found is None:
            return None
        try:
            await backend.connect(found, f"microVM {sb.id}", sb.hostname, 5.0, hello=False)
            status = (await found.qmp.command("query-status")).get("status")
        except Exception as err:
            status = f"unreachable: {err}"
        finally:
            if found.qmp is not None:       # QEMU's monitor takes one client: reconnect's, next
                found.qmp.close()
                found.qmp = None
        if status == "running":
            log.warning("sandbox %s (microVM): its resume ran, but its record did not say so; re-adopted "
                        "running", sb.id)
            sb.state, sb.pause_record = "running", None
            return found
        log.warning("sandbox %s (microVM): killing the QEMU of a resume its record does not show (%s); it stays "
                    "paused, from its saved state", sb.id, status)
        await self.workers.run(backend.kill_found, found)
        return None

    async def _adopt_paused_vm(self, sb: Sandbox, unrecorded: bool = False) -> bool:
        """A VM re-adopted paused, from the state file in its dir; False if
        there is none. unrecorded: its record says otherwise (running, or
        vCPUs stopped), but its QEMU is gone and its state was saved: a
        pause ended it and the daemon died before the record said so. It is
        recorded paused, as that pause would have left it."""
        handle = await self.workers.run(self.vms.backend.paused_handle, sb.id, sb.limits["memory"])
        if handle is None:
            return False
        if unrecorded:
            log.warning("sandbox %s (microVM): its QEMU ended in a pause its record does not show; re-adopted "
                        "paused, from its saved state", sb.id)
            sb.state, sb.pause_record = "paused", {"vm_image": str(handle.vm_dir / SAVED_STATE)}
            self.registry.save(sb)
        self.vms.adopted(sb, handle)
        sb.handle = handle          # no QEMU until resumed: nothing to watch
        self.procs.readopt_vm(sb)   # attached at its resume
        log.info("re-adopted sandbox %s (microVM, paused)", sb.id)
        return True

    def backend_of(self, sb: Sandbox):
        return self.vms.backend if sb.backend == "microvm" and self.vms.backend is not None else self.backend

    def close(self) -> None:
        """Daemon shutdown: stop watching and close the handles' fds; the
        sandboxes keep running for the next daemon."""
        for sb in self.registry.by_id.values():
            if sb.handle and sb.handle.pidfd >= 0:
                self.workers.loop.remove_reader(sb.handle.pidfd)
                if sb.backend == "microvm":
                    self.vms.detach(sb.handle)
                else:
                    close_handle(sb.handle)

    # ------------------------------------------------------------ init exits

    def watch(self, sb: Sandbox) -> None:
        """Notice when a sandbox's init exits on its own."""
        loop = self.workers.loop
        loop.add_reader(sb.handle.pidfd, lambda: loop.create_task(self._on_init_exit(sb)))

    async def _on_init_exit(self, sb: Sandbox) -> None:
        h = sb.handle
        if h is None or h.pidfd < 0:
            return
        self.workers.loop.remove_reader(h.pidfd)
        if sb.state in ("stopping",):
            return
        await self._mark_dead(sb, h, f"its init (pid {h.init_pid}) exited")

    async def _mark_dead(self, sb: Sandbox, h: Handle | None, why: str) -> None:
        """Release the cgroups and fds of a sandbox whose init is gone; keep its record."""
        self.registry.mark_dead(sb)
        sb.died = time.time()
        if sb.backend == "microvm":
            # "hung": the watchdog killed it (engine/vmwatchdog.py); "agent_protocol":
            # its guest broke the agent's protocol and QEMU was killed (backend.end_broken,
            # `detail` says what it sent); else its QEMU exited (a guest panic, a kill,
            # its memory limit: an "oom" event follows). How QEMU ended (a
            # signal, an exit code) goes with it: an exit of QEMU's own
            # (code 1) is no guest's doing.
            # "gone": found dead at a start, `why` saying how (no QEMU, or one
            # that would not end).
            if h is None:
                why, detail = "gone", {"detail": why}
            else:
                extra = getattr(h, "extra", {})
                why = extra.get("died_because", "exited")
                detail = ({"detail": extra["died_why"]} if "died_why" in extra else {}) | how_qemu_ended(h)
            panic = guest_panic(h.vm_dir / "serial.log") if why == "exited" else None
            if panic:
                # Its kernel said why (e.g. "System is deadlocked on memory"):
                # a few KiB read here, before _vm_dead removes the directory.
                why, detail = "panic", detail | {"detail": panic}
                log.warning("sandbox %s: its guest kernel panicked: %s", sb.id, panic)
        else:
            # A dsec-init runs with oom_score_adj -1000, so no OOM kill ends
            # it: it dies of a signal from outside (a host's kill -9) or of
            # a fault of its own.
            detail = execio.how_child_ended(h.pidfd) if h is not None and h.is_child else {}
        sb.death = {"reason": why} | detail
        self.events.publish("died", sb.id, reason=why, **detail)
        sb.handle = None
        if sb.backend == "microvm":
            self.procs.vm_died(sb)       # its background processes died with its guest
            await self._vm_dead(sb, h)
            return
        if h is not None:      # a live sandbox held its layer mounts (re-adopted ones too)
            self.layers.release(sb.layers)

        def release():
            if h is not None:
                if h.is_child:
                    try:
                        os.waitpid(h.init_pid, 0)
                    except ChildProcessError:
                        pass
                close_handle(h)
            # PID 1 may have died of its memory limit. No handle: stop kills by
            # cgroup membership and removes the groups.
            return self.stop_counting_oom(sb.id, None, self.backend.group_for(sb.id))

        try:
            kills = await self.workers.run(release)
            if kills is not None:
                self.memory.report_oom(sb, kills)
            await self.net.detach_net(sb)      # frees its lease and policy; the veth died with the netns
        finally:
            self._save_dead(sb)

    async def _vm_dead(self, sb: Sandbox, h) -> None:
        """A microVM whose QEMU exited (a guest panic, an OOM kill of QEMU):
        its cgroups and directory go, its record stays, as dead."""
        try:
            kills = await self.workers.run(self.stop_counting_oom, sb.id, h, self.backend.group_for(sb.id),
                                           self.backend_of(sb))
            if kills is not None:
                self.memory.report_oom(sb, kills)
            if sb.oom_kills and sb.death is not None:
                # QEMU is the VM's one process: its memory cgroup's OOM kills
                # are what it died of, or what its guest's death followed.
                sb.death["oom_kills"] = sb.oom_kills
            if self.vms.backend is not None:
                await self.workers.run(self.vms.backend.release, sb.id, h)
            await self.net.detach_net(sb)      # its tap died with QEMU; its policy and lease go
        finally:
            self._save_dead(sb)

    def _save_dead(self, sb: Sandbox) -> None:
        """Journal a sandbox as dead, unless a destroy (a client reacting to
        its "died" event, a TTL) took it while its remains were released:
        the destroy deleted its record, and one written now would bring it
        back as a ghost at the next start."""
        if self.registry.listed(sb):
            self.registry.save(sb)

    # ------------------------------------------------------------ views

    async def top(self, req, ctx) -> dict:
        shown = [s for s in self.registry.by_id.values() if labels_match(s, req.labels)]
        rows = [{"id": s.id, "state": s.state, "qos": s.qos, "cpu": s.limits["cpu"],
                 "memory_limit": s.limits["memory"], "vm_balloon": self._balloon_row(s)}
                for s in shown]
        out = self.cpu.top(rows)
        # The sampler reads running sandboxes only: a paused one's memory
        # (what its pause left charged: a container's resident pages, a
        # saved VM's what its ended QEMU left) is read here, once per top,
        # and the CPU figures of its last sample, from before the pause,
        # are not shown.
        paused = {s.id: s.handle.group for s in shown if s.state == "paused" and s.handle is not None}
        # Swap is read here too, for every sandbox shown, once per top: the
        # sampler's passes (which serve admission and metrics too) do not pay
        # for a figure only top shows.
        groups = {s.id: s.handle.group for s in shown if s.handle is not None}
        memory, swap = await self.workers.run(lambda: (pause.charged(paused), pause.swapped(groups)))
        for row in out["sandboxes"]:
            row["swap"] = swap.get(row["id"])
            if row["id"] in paused:
                row.update(cpu_pct=None, throttled_pct=None, throttled_ms=None, memory=memory.get(row["id"]))
        return out

    def _balloon_row(self, sb: Sandbox) -> dict | None:
        """A microVM's guest size against its RAM (engine/vmballoon.py), for
        top's BALLOON column; None for a container or a VM not looked at yet."""
        balloon = getattr(self.vms, "balloon", None) if sb.backend == "microvm" else None
        view = balloon.view(sb.id) if balloon is not None else None
        if view is None:
            return None
        return {"guest_size": view["guest_size"], "ram": view["ram"], "skipped": view["skipped"] is not None}

    async def list(self, req, ctx) -> dict:
        return {"sandboxes": [s.public() for s in self.registry.by_id.values() if labels_match(s, req.labels)]}

    async def inspect(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        out = sb.public()
        if out.get("net") and out["net"].get("mode") == "default":
            # What is published lives in the Network (and its record), not
            # in the sandbox's: asked for here, as `docker inspect` shows it.
            out["net"] = {**out["net"], "ports": await self.net.published(sb)}
        if sb.handle and sb.backend == "microvm":
            out["cgroups"] = {k: str(v) for k, v in sb.handle.group.dirs.items()}
            out["vm"] = self.vms.inspect(sb)
        elif sb.handle:
            out["cgroups"] = {k: str(v) for k, v in sb.handle.group.dirs.items()}
            if sb.handle.dir is not None:
                out["dir"] = str(sb.handle.dir)
            if sb.handle.upperfd >= 0:
                out["disk"] = upperfs.usage(sb.handle.upperfd)
        return out

    # ------------------------------------------------------------ destroy

    async def destroy(self, req, ctx) -> dict:
        return await self.destroy_sandbox(self.registry.get(req.sandbox, req), req.force)

    async def destroy_sandbox(self, sb: Sandbox, force: bool, reason: str = "request") -> dict:
        """`reason` (request, job, all, ttl, lease, idle_ttl, pool) goes into
        the `destroyed` event, the log line and the metrics."""
        if sb.state == "stopping":
            raise Conflict(f"sandbox {sb.id} is already being destroyed", {"sandbox": sb.id})
        if sb.state == "creating":
            raise Conflict(f"sandbox {sb.id} is still being created; retry", {"sandbox": sb.id})
        if sb.execs and not force:
            how = "dsec job rm --force JOB" if reason == "job" else "dsec rm --force / -f"
            raise Conflict(f"sandbox {sb.id} has {sb.execs} running exec(s); to kill them, destroy "
                           f"it with force=True ({how})", {"sandbox": sb.id, "execs": sb.execs})
        # No journal write for "stopping": a crash mid-destroy leaves the record
        # as it was, and the next daemon re-adopts the sandbox or marks it dead.
        prev, sb.state = sb.state, "stopping"
        sb.stopping_by = reason
        # Once accepted, a destroy finishes even if its request is cancelled
        # (client gone, `cancel`): the client gave up on the answer, not on the
        # destroy, and a half-done one would leave the sandbox "stopping" forever.
        return await asyncio.shield(self._teardown(sb, prev, reason))

    async def _teardown(self, sb: Sandbox, prev: str, reason: str) -> dict:
        # The state stays "stopping" meanwhile: a second destroy (a TTL, a
        # retry) is refused rather than tearing the sandbox down twice.
        if self.memory.damon_running or prev == "paused":     # else before_destroy has nothing to do
            await self.workers.run(self.memory.before_destroy, sb, prev == "paused")
        h, sb.handle = sb.handle, None
        if h and h.pidfd >= 0:
            self.workers.loop.remove_reader(h.pidfd)
        try:
            kills = await self.workers.run(self.stop_counting_oom, sb.id, h, None, self.backend_of(sb))
        except OSError as err:
            log.error("destroy sandbox %s: %s", sb.id, err)
            sb.state = prev
            sb.handle = h
            self.registry.save(sb)
            raise io_error("destroy sandbox", sb.id, err) from err
        if kills is not None:
            self.memory.report_oom(sb, kills)
        await self.net.detach_net(sb)
        try:
            self.registry.remove(sb, reason)       # its record, and its idempotency key
            unrecorded = False
        except OSError as err:
            # Its processes are gone: the release goes on, and the record
            # left behind is found dead at the next start.
            log.error("sandbox %s is destroyed, but its journal record could not be deleted (%s): the next "
                      "daemon start lists it as dead; `dsec rm` it then", sb.id, err)
            unrecorded = True
        self.procs.forget(sb.id)             # its background processes died with it
        if not unrecorded:
            # Its processes are gone: stop() waited for them. A record left
            # behind still names the range, and the next start reserves it
            # again: handed out now, two sandboxes would share its host ids.
            self.id_ranges.release(sb)
        if prev != "dead" and sb.backend != "microvm":   # a dead sandbox gave its layers back already
            self.layers.release(sb.layers)
        self.workers.behind(self.backend_of(sb).release, sb.id, h)
        self.events.publish("destroyed", sb.id, previous_state=prev, reason=reason)
        return {"id": sb.id, "previous_state": prev}

    def stop_counting_oom(self, sb_id: str, h: Handle | None, group=None, backend=None) -> int | None:
        """backend.stop (the container backend's unless given), with the OOM
        kill count read before it removes the cgroups: of `group`, else of
        the handle's (neither: not read)."""
        group = group if group is not None else (h.group if h is not None else None)
        kills = self.memory.oom_count(group) if group is not None else None
        (backend or self.backend).stop(sb_id, h)
        return kills

    async def _destroy_many(self, sbs: list[Sandbox], force: bool, reason: str) -> tuple[list[str], dict[str, str]]:
        results = await asyncio.gather(*(self.destroy_sandbox(s, force, reason) for s in sbs),
                                       return_exceptions=True)
        destroyed = [r["id"] for r in results if isinstance(r, dict)]
        failed = {s.id: str(r) for s, r in zip(sbs, results, strict=True) if isinstance(r, BaseException)}
        return destroyed, failed

    async def job_rm(self, req, ctx) -> dict:
        # After a job op under way (a job_pause's freeze): a destroy does not
        # kill what is being frozen, nor a pause mark what is being destroyed.
        async with self.registry.job_lock(req.job):
            destroyed, failed = await self._destroy_many(
                self.registry.job_op_begun(req.job, "rm", ("running", "paused", "dead")), req.force, "job")
        return {"job": req.job, "destroyed": destroyed, "failed": failed}

    async def destroy_all(self, req, ctx) -> dict:
        targets = [s for s in self.registry.by_id.values()
                   if labels_match(s, req.labels) and s.state in ("running", "paused", "dead")]
        destroyed, failed = await self._destroy_many(targets, req.force, "all")
        return {"destroyed": destroyed, "failed": failed}
