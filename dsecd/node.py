"""The engine's composition root: builds each service of dsecd/engine/ with
what it needs, starts and stops them in order, routes every request type to
the service that owns it (SERVICE_ROUTES), and answers the host-wide
requests itself (ping, info).

A handler takes a typed request from dsecd.protocol and a per-request
context from the server, and returns a result dict or raises a DsecError.
Blocking work (clone, mount, cgroup and file I/O, copies) runs through
Workers, never on the event loop. Sandbox states: dsecd/engine/sandboxes.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from . import __version__, cgroup, metrics, pinned, protocol
from .backends.container import ContainerBackend
from .backends.microvm import guestimg
from .backends.microvm.backend import MicroVMBackend
from .backends.microvm.templates import TemplateStore, qemu_identity
from .config import Config, ConfigError, call_uid_base, parse_size
from .cpu.manager import CpuHost
from .denials import Monitor
from .engine import lifelog
from .engine.builds import BuildService
from .engine.calls import CallService, fncall_backend
from .engine.creates import CreateService
from .engine.denials import DenialService
from .engine.dircopies import DirCopyService
from .engine.events import EventBus
from .engine.execs import ExecLimits, ExecService
from .engine.files import FileService
from .engine.idranges import IdRanges
from .engine.images import ImageService
from .engine.lifecycle import LifecycleService
from .engine.lifetimes import LifetimeService
from .engine.memory import MemoryService
from .engine.microvms import MicroVMService
from .engine.network import NetworkService
from .engine.policies import PolicyService
from .engine.procs import OUTPUT_DIR as PROC_OUTPUT_DIR
from .engine.procs import ProcessService, ProcLimits
from .engine.sandboxes import SandboxRegistry
from .engine.starts import ProcessStarter
from .engine.vmballoon import BalloonService, settings_from
from .engine.vmfiles import VmFiles
from .engine.vmtemplates import TemplateService
from .engine.vmwatchdog import VmWatchdog
from .engine.watches import WatchService
from .engine.workers import Workers, finish_under_way
from .fds import close_quietly
from .feature import Feature
from .features import Features, probe_swap, suid_dumpable_hazard
from .fs import copytemps
from .fs import upper as upperfs
from .fs.copytemps import CopyTemps
from .journal import Journal
from .net.network import bpf_cache_dir
from .stopclock import StopClock

log = logging.getLogger(__name__)

# In the state dir while a daemon runs; a clean stop removes it. Found at
# start, it says the daemon before died (killed, crashed) with its execs
# still running, so re-adoption kills them (LifecycleService.recover_all).
RUNNING_MARK = "dsecd.running"

# How often a running daemon looks for an install under it (code_info: a
# stat of each of its ~200 files, ~1 ms), so the log says so without
# waiting for an `info` or a metrics scrape.
CODE_CHECK_S = 60.0

# The steps of a stop's close (Node.close), in the order they run: each
# keeps time for the ones after it (StopClock.for_step), so a step that
# hangs still leaves the network, swap, DAMON and the pager to be closed.
CLOSE_STEPS = ("VM template builds", "destroying call sandboxes", "closing the network",
               "stopping DAMON and swap", "stopping the pager", "unmounting idle layers")

# The order sandbox states are counted in systemd's STATUS= line.
STATUS_ORDER = ("running", "paused", "dead", "creating", "stopping")

# Requests the server answers itself (dsecd/server.py), not routed to a service.
SERVER_OPS = ("hello", "cancel")

# The service that owns each request type: op -> (the node's attribute holding
# it, its handler). "node" is the node itself, for the host-wide requests.
SERVICE_ROUTES = {
    "ping": ("node", "ping"), "info": ("node", "info"),
    "create": ("create_service", "create"), "pool_set": ("create_service", "pool_set"),
    "pool_list": ("create_service", "pool_list"),
    "drain": ("create_service", "drain"), "undrain": ("create_service", "undrain"),
    "list": ("lifecycle", "list"), "inspect": ("lifecycle", "inspect"), "top": ("lifecycle", "top"),
    "destroy": ("lifecycle", "destroy"), "destroy_all": ("lifecycle", "destroy_all"),
    "job_rm": ("lifecycle", "job_rm"),
    "exec": ("exec_service", "exec"), "exec_input": ("exec_service", "exec_input"),
    "exec_resize": ("exec_service", "exec_resize"), "exec_signal": ("exec_service", "exec_signal"),
    "proc_start": ("procs", "start"), "proc_list": ("procs", "list"), "proc_logs": ("procs", "logs"),
    "proc_input": ("procs", "input"), "proc_kill": ("procs", "kill"), "proc_wait": ("procs", "wait"),
    "file_read": ("file_service", "read"), "file_write": ("file_service", "write"),
    "file_list": ("file_service", "list"), "file_stat": ("file_service", "stat"),
    "file_mkdir": ("file_service", "mkdir"), "file_remove": ("file_service", "remove"),
    "file_rename": ("file_service", "rename"), "file_set_attrs": ("file_service", "set_attrs"),
    "file_watch": ("watch_service", "watch"),
    "file_tar_put": ("dir_copies", "put"), "file_tar_input": ("dir_copies", "put_input"),
    "file_tar_get": ("dir_copies", "get"),
    "image_build": ("image_service", "build"), "image_list": ("image_service", "list"),
    "image_build_dockerfile": ("builds", "build"),
    "image_inspect": ("image_service", "inspect"), "image_rm": ("image_service", "rm"),
    "image_tag": ("image_service", "tag"), "image_flatten": ("image_service", "flatten"),
    "image_gc": ("image_service", "gc"), "image_du": ("image_service", "du"),
    "image_pull": ("image_service", "pull"),
    "snapshot": ("image_service", "snapshot"),
    "net_show": ("net_service", "show"), "net_set": ("net_service", "set"),
    "net_publish": ("net_service", "publish"), "net_unpublish": ("net_service", "unpublish"),
    "net_sets": ("net_service", "sets"),
    "pause": ("memory", "pause"), "resume": ("memory", "resume"),
    "job_pause": ("memory", "job_pause"), "job_resume": ("memory", "job_resume"),
    "renew": ("lifetimes", "renew"), "events": ("events", "stream"),
    "call": ("call_service", "call"), "policy_list": ("policies", "list"),
}


class Node:
    def __init__(self, cfg: Config, features: Features, layout: cgroup.Layout):
        self.cfg = cfg
        self.features = features
        self.layout = layout
        self.limits = cfg.section("limits")
        self.sb_defaults = sb = cfg.section("sandbox")
        state = cfg.state_dir
        root = sb["cgroup_root"]
        # First: a setting this host cannot honour stops the daemon before it changes anything.
        hazard = suid_dumpable_hazard()
        if hazard:
            raise ConfigError(hazard)
        try:
            upper_mode = upperfs.pick_mode(sb["writable_layer"], features)
        except upperfs.UpperError as err:
            raise ConfigError(str(err)) from err
        disk_default = cfg.size("sandbox", "disk")
        if upper_mode == "tmpfs":               # checked with the config too (daemon.check_services)
            try:
                upperfs.check_default_cap(disk_default, sb["disk_inodes"])
            except upperfs.UpperError as err:
                raise ConfigError(str(err)) from err
        execs_by_init = pick_exec_via(sb["exec_via"], features)

        self.workers = Workers(cfg.section("daemon")["worker_threads"])
        self.journal = Journal(state, fsync=cfg.section("journal")["fsync"], compact_with=self.workers.submit)
        self.registry = SandboxRegistry(self.journal)
        self.registry.op_keys.orphan_s = self.limits["keyed_orphan_s"]
        self.events = EventBus(named=lambda sb_id: self.registry.named(sb_id).id)
        self.events.listeners.append(lifelog.on_event)        # a log line and counters per event
        self.policies = PolicyService(cfg.raw.get("policy", {}), features.landlock_abi)
        self.denials = DenialService(
            Monitor(bpf_cache_dir(cfg.section("net"), state), self.limits["max_sandboxes"])
            if sb["policy_denials"] else None, sb["policy_denial_events"], layout, self.registry,
            self.workers, self.events)
        self.backend = ContainerBackend(layout, sb, state, {
            "tmp": cfg.size("sandbox", "tmp_size"), "shm": cfg.size("sandbox", "shm_size")}, upper_mode,
            execs_by_init)
        self.id_ranges = IdRanges.from_config(sb, state)
        self.cpu = CpuHost(cfg.section("cpu"), layout, features, root)
        # Stdin of collected execs and zygote calls: one /dev/null, shared (a
        # spawn dup2s it, SCM_RIGHTS gives init or a zygote its own copy).
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

        self.image_service = ImageService(cfg, features, layout, root, self.registry, self.workers,
                                          float(cfg.section("memory")["freeze_timeout_s"]))
        self.vms = make_microvm_service(cfg, features, layout, self.workers, self.image_service.images.store.path)
        vm_cfg = cfg.section("microvm")
        self.vm_watchdog = VmWatchdog(self.registry, vm_cfg["watchdog_interval_s"], vm_cfg["watchdog_timeout_s"])
        self.vm_balloon = BalloonService(self.registry, settings_from(cfg), bool(vm_cfg["balloon"]))
        self.vms.balloon = self.vm_balloon
        self.vm_files = VmFiles(self.vms.agent, self.vms.request_running, self.vms.watch_started, self.workers,
                                cfg.size("limits", "max_exec_output_bytes"), self.vm_balloon)
        self.memory = MemoryService(cfg, root, self.registry, self.workers, self.events, self.vms)
        self.net_service = NetworkService(cfg, layout, root, self.limits["max_sandboxes"], self.registry,
                                          self.workers, self.backend)
        self.net_service.events = self.events
        self.procs = ProcessService(self.registry, self.workers, self.backend, self.memory.ensure_running,
                                    ProcLimits.from_config(cfg), self.policies, self.vms,
                                    self.denials, output_dir=state / PROC_OUTPUT_DIR, vm_files=self.vm_files)
        self.lifecycle = LifecycleService(self.registry, self.workers, self.backend, self.image_service.layers,
                                          self.net_service, self.memory, self.events, self.cpu, self.id_ranges,
                                          self.procs, self.vms)
        self.vms.watch = self.lifecycle.watch
        self.vms.net = self.net_service
        self.vms.relinked = self.procs.vm.linked
        self.image_service.after_gc = self.vms.gc_templates
        self.image_service.vm_upper = self.vm_files.upper_tree
        self.lifetimes = LifetimeService(self.registry, self.workers, self.events, self.memory,
                                         self.lifecycle.destroy_sandbox)
        self.create_service = CreateService(cfg, self.registry, self.workers, self.backend, self.image_service,
                                            self.net_service, self.memory, self.cpu, self.id_ranges,
                                            self.lifecycle, disk_default, self.policies.for_create, self.vms,
                                            self.vm_files)
        self.starter = ProcessStarter(self.workers)
        exec_limits = ExecLimits.from_config(cfg)
        self.exec_service = ExecService(self.registry, self.workers, self.starter, self.backend,
                                        self.memory.ensure_running, exec_limits, self._devnull, self.policies,
                                        self.denials, self.vms, self.memory.oom_killed_since, self.vm_files)
        self.builds = BuildService(cfg, self.registry, self.workers, self.image_service, self.create_service,
                                   self.exec_service, self.lifecycle.destroy_sandbox, upper_mode == "tmpfs")
        copy_temps = CopyTemps(state / copytemps.DIR)
        self.file_service = FileService(self.registry, self.workers, self.memory.ensure_running,
                                        cfg.size("limits", "max_file_chunk_bytes"), self.backend.copy_by_init,
                                        self.vm_files, copy_temps, self.events)
        self.watch_service = WatchService(self.registry, self.workers, self.events, self.memory.ensure_running,
                                          self.limits["max_watches"], self.limits["max_watch_dirs"], self.vm_files,
                                          self.vms.watch_over)
        self.dir_copies = DirCopyService(self.registry, self.workers, self.memory.ensure_running,
                                         cfg.size("limits", "max_file_chunk_bytes"), self.limits["max_tar_entries"],
                                         cfg.size("limits", "max_tar_bytes"), self.limits["max_tar_puts"],
                                         float(self.limits["frame_timeout_s"]), self.backend.copy_by_init,
                                         self.vm_files, copy_temps, self.file_service.hold_temporary,
                                         self.file_service.hold_vm_temporary, self.events,
                                         self.file_service.journal_vm_temporary,
                                         self.file_service.end_vm_temporary)
        files, copies = self.file_service, self.dir_copies
        self.image_service.temporaries = lambda sb_id: files.temporaries(sb_id) + copies.landings(sb_id)
        fn_cfg = {**cfg.section("fncall"), "uid_base": call_uid_base(cfg)}      # 0 picked by userns
        self.call_service = CallService(fncall_backend(cfg, layout, self.backend), fn_cfg,
                                        CallService.sizes_from(cfg), sb["cpu_period_us"], self.image_service,
                                        self.cpu, self.workers, self.starter, exec_limits, self._devnull,
                                        self.id_ranges, self.create_service)
        # Creates on a host whose room idle call sandboxes hold drop them
        # (CreateService._room); calls.py depends on creates.py, not back.
        self.create_service.reclaim_idle_calls = self.call_service.drop_idle_for_create
        self._cpu_task: asyncio.Task | None = None
        self._code_task: asyncio.Task | None = None
        self.started = time.time()
        self._said_code_changed = False     # code_info logs an install under it once
        self.default_memory = parse_size(sb["memory"])
        self.loop_monitor = None        # dsecd/looplag.py LoopMonitor, set by the daemon
        self.reloader = None            # dsecd/configreload.py Reloader, set by the daemon

    def routes(self) -> dict[str, Callable]:
        """Each request type's handler, by op name, for dsecd/server.py."""
        out = {}
        for op in protocol.REQUESTS:
            if op not in SERVER_OPS:
                service, method = SERVICE_ROUTES[op]
                owner = self if service == "node" else getattr(self, service)
                out[op] = getattr(owner, method)
        return out

    # ------------------------------------------------------------ start / stop

    async def start(self) -> None:
        """Re-adopt journaled sandboxes, clean up what died or was half-made,
        then start the background work of every service."""
        loop = asyncio.get_running_loop()
        self.workers.start(loop)
        await self.workers.run(upperfs.sweep_views, self.cfg.state_dir / upperfs.VIEWS_DIR)
        await self.workers.run(self.image_service.client_paths.sweep)
        await self.workers.run(self.image_service.start)
        after_death = await self.workers.run(_mark_running, self.cfg.state_dir)
        await self.lifecycle.recover_all(after_death)
        await self.file_service.sweep_temps()
        self.denials.start()
        await self.call_service.start()
        await self.create_service.start()
        self._cpu_task = loop.create_task(self.cpu.run(self._cpu_entries, self.workers.run))
        self._code_task = loop.create_task(self._watch_code())
        self.image_service.start_layer_sweeper()
        await self.workers.run(self.memory.start)
        # Probed before the daemon's own zram device or swap file was on: again.
        self.features.items["swap"] = await self.workers.run(probe_swap)
        await self.net_service.readopt_net()
        await self.builds.start()          # after readopt_net: a RUN with --allow had a network
        self.lifetimes.start()
        if self.vms.backend is not None:
            self.vm_watchdog.start()
            self.vm_balloon.start()

    def _cpu_entries(self) -> dict[str, tuple[str, bool]]:
        return {s.id: (s.qos, bool(s.limits.get("cpu_quota"))) for s in self.registry.by_id.values()
                if s.state == "running"}

    async def close(self, requests_ended: Callable[[float], Awaitable[int]] | None = None,
                    clock: StopClock | None = None) -> int:
        """Daemon shutdown: stop watching, close fds, leave sandboxes running.
        `requests_ended(timeout)`: waits for the requests the server's stop
        cancelled to end (Server.wait_stopped), None when none ran. Every
        wait ends by `clock`'s deadlines (daemon.stop_timeout_s from the
        stop's start when None; dsecd/stopclock.py): what does not end in
        time is logged and left. How many things it left (0: everything
        ended); the caller removes the running mark only then
        (forget_running_mark)."""
        if clock is None:
            clock = StopClock(self.cfg.section("daemon")["stop_timeout_s"])
        # A pause or resume under way finishes and writes its record first
        # (a VM's save can take seconds), a cancelled snapshot thaws its
        # sandbox; one that does not end in time is finished or undone by
        # the next daemon's re-adoption. The requests the server's stop
        # cancelled finish their undoing, and keyed requests whose client
        # went (still running for its return) end as the others did: all
        # are waited for at once, until the requests' deadline, as an exec's
        # group is killed through init's channel, a copy's temp files are
        # removed through a worker, and the stop closes both below.
        waits = [self.registry.op_keys.close(clock.for_requests()), finish_under_way(clock.for_requests()),
                 self.workers.finish_running(clock.for_requests())]
        if requests_ended is not None:
            waits.append(requests_ended(clock.for_requests()))     # it logs what it leaves, naming them
        keyed, under_way, _, *requests = await asyncio.gather(*waits)
        if under_way:
            log.warning("stopping with %d pause(s), resume(s) or snapshot(s) still under way %.0f s into the "
                        "stop (%s); the next daemon takes their sandboxes back as it finds them", len(under_way),
                        clock.elapsed(), "; ".join(under_way),
                        extra={"fields": {"event": "stop_left_changes", "changes": under_way}})
        if keyed:
            names = self.registry.op_keys.under_way()
            log.warning("stopping with %d keyed request(s) (%s) not ended %.0f s into the stop; the next daemon "
                        "takes their sandboxes back as it finds them, and their keys answer that their outcome "
                        "is unknown", keyed, "; ".join(names), clock.elapsed(),
                        extra={"fields": {"event": "stop_left_keyed", "requests": names}})
        # Workers still in one piece of work (a blocking call that does not
        # return) are left to it: the steps below get workers of their own.
        # Not counted as left: one that was only slow (a layer sweep begun
        # late in the wait) ends before the stop's end and changes nothing;
        # one truly stuck is still running there (end_what_is_left), and the
        # stop then exits as after a death.
        self.workers.set_aside_stuck()
        left = keyed + len(under_way) + sum(requests)
        # First: from here on, output and ends of background processes stay in
        # init's pipes for the next daemon; what this one read would be lost.
        self.procs.close()
        self.create_service.close()
        clock.plan_closes(CLOSE_STEPS, after_late=lambda: self.workers.set_aside_stuck(busy_s=0))
        if self.vms.templates is not None:
            await clock.step("VM template builds", self.vms.templates.close())
        # Call sandboxes belong to this daemon: they go (the next start
        # removes those a stop cut short leaves).
        await clock.step("destroying call sandboxes", self.call_service.close())
        self.image_service.stop_layer_sweeper()
        self.lifetimes.stop()
        self.vm_watchdog.stop()
        self.vm_balloon.stop()
        if self._cpu_task:
            self._cpu_task.cancel()
        if self._code_task:
            self._code_task.cancel()
        await clock.step("closing the network", self.net_service.close_net())
        await clock.step("stopping DAMON and swap", self.workers.run(self.memory.close))
        self.denials.close()
        drained = not any(s.handle is not None for s in self.registry.by_id.values())
        await clock.step("stopping the pager", self.workers.run(self.image_service.stop, drained))
        self.lifecycle.close()
        if self.vms.templates is not None:
            self.vms.templates.store.close()     # VMs restored from templates keep their own mappings
        # Layers no running sandbox uses are unmounted; the others stay for
        # their sandboxes and are re-counted by the next daemon.
        try:
            await clock.step("unmounting idle layers", self.workers.run(self.image_service.layers.sweep, True))
        except Exception:
            log.exception("unmount idle layers at shutdown")
        self.workers.shutdown()
        # Every record is in the file already (written before the answer
        # that depends on it): the close only gives the fd back, and does
        # not wait on a compaction stuck in a worker for it.
        self.journal.close(timeout=clock.for_closes())
        close_quietly(self._devnull)
        self._devnull = -1
        return left + len(clock.late)

    def forget_running_mark(self) -> None:
        """The stop is over and left nothing under way: the next start takes
        it for a clean one (RUNNING_MARK). Last: a stop that fails before
        here, or leaves work under way, is taken for a death by the next
        daemon, which kills the execs left running."""
        try:
            os.unlink(self.cfg.state_dir / RUNNING_MARK)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------ host-wide requests

    async def ping(self, req, ctx) -> dict:
        return {"time": time.time()}

    def hello_result(self) -> dict:
        return {"server": "dsecd", "version": __version__, "protocol": protocol.PROTOCOL_VERSION,
                "capabilities": self.capabilities(), "limits": self.wire_limits()}

    def capabilities(self) -> list[str]:
        # files.temporary: file_write and file_tar_put take `temporary`;
        # image.list.stream: image_list takes `stream`; files.attrs:
        # file_set_attrs is served and file_tar_put takes `dirs` (an older
        # daemon refuses a field or request it does not know); op.keys:
        # exec, proc_start and snapshot take `key` (dsecd/engine/opkeys.py);
        # op.keys.stream: a streamed exec takes `key` too, and `stream_from`.
        caps = ["exec.stream", "exec.stdin", "files", "files.watch", "files.tar", "files.temporary",
                "backend.container", "image.dir", "backend.fncall", "proc", "frame.tail", "policy",
                "image.list.stream", "files.attrs", "op.keys", "op.keys.stream"]
        if self.vms.backend is not None:
            caps.append("backend.microvm")
        return caps

    def wire_limits(self) -> dict:
        return {"max_frame_bytes": self.cfg.size("limits", "max_frame_bytes"),
                "max_file_chunk_bytes": self.cfg.size("limits", "max_file_chunk_bytes"),
                "max_exec_output_bytes": self.cfg.size("limits", "max_exec_output_bytes"),
                "max_requests_per_client": self.limits["max_requests_per_client"],
                "max_connections": self.limits["max_connections"],
                "max_sandboxes": self.limits["max_sandboxes"]}

    async def info(self, req, ctx) -> dict:
        states: dict[str, int] = {}
        for sb in self.registry.by_id.values():
            states[sb.state] = states.get(sb.state, 0) + 1
        d = self.cfg.section("daemon")
        root = self.sb_defaults["cgroup_root"]
        # Read in workers, each within the metrics' deadline: with every
        # worker stuck (a hung store) or a read hanging, info still answers,
        # saying what it could not read.
        unread: list[str] = []
        images, memory, vm_templates, code = await asyncio.gather(
            metrics.read_source("images", lambda: self.workers.run(self.image_service.info), unread),
            metrics.read_source("memory", lambda: self.workers.run(self.memory.info), unread),
            metrics.read_source("vm_templates", lambda: self.workers.run(self.vms.template_info), unread),
            metrics.read_source("code", lambda: self.workers.run(self.code_info), unread))
        microvm = self.vms.info()
        if vm_templates:
            microvm["template_store"] = vm_templates
        out = {"version": __version__, "protocol": protocol.PROTOCOL_VERSION, "pid": os.getpid(),
               "uptime_s": round(time.time() - self.started, 3), **self.features.to_dict(),
               "limits": self.wire_limits(), "sandboxes": states,
               "cpu": self.cpu_info(),
               "images": images,
               "net": self.net_service.net_info(),
               "memory": memory,
               "fncall": self.call_service.info(),
               "backends": {"container": {"available": True}, "microvm": microvm},
               "admission": self.create_service.info(),
               "drain": self.create_service.drain_info(),
               "userns": self.id_ranges.info(),
               "policy": {**self.policies.info(), "denials": self.denials.info()},
               "paths": {"socket": d["socket"], "state_dir": str(self.cfg.state_dir), "cgroup_root": root,
                         "cgroup_dirs": {k: str(v / root) for k, v in self.layout.hierarchies().items()}},
               "daemon": {"config": self.cfg.path, "log_level": d["log_level"], "log_format": d["log_format"],
                          "metrics": self.cfg.section("metrics")["listen"] or None,
                          "loop_lag": self.loop_monitor.stats() if self.loop_monitor else None,
                          "code": code,
                          **(self.reloader.state() if self.reloader else
                             {"config_loaded_at": None, "last_reload": None})}}
        if unread:
            out["unread"] = unread
        return out

    async def _watch_code(self, interval: float = CODE_CHECK_S) -> None:
        """Look for an install under this daemon every `interval` s until
        one was said in the log (code_info says it once)."""
        while not self._said_code_changed and pinned.current() is not None:
            await asyncio.sleep(interval)
            try:
                await self.workers.run(self.code_info)
            except OSError as err:          # a file unreadable now: looked at again next time
                log.debug("looking for an install under the daemon: %s", err)

    def code_info(self) -> dict | None:
        """Where this daemon's code runs from and what an install changed
        since its start (dsecd/pinned.py); said once in the log too. None
        when not pinned (a node built in-process by a test or a tool)."""
        pin = pinned.current()
        if pin is None:
            return None
        out = pin.info()
        if out["installed_changed_count"] and not self._said_code_changed:
            self._said_code_changed = True
            log.warning("installed code differs from the running daemon's (%d files changed since its start, "
                        "e.g. %s): it runs on from its copy %s; restart it to finish the upgrade "
                        "(sandboxes survive a restart)", out["installed_changed_count"],
                        ", ".join(out["installed_changed"][:3]), out["running_from"],
                        extra={"fields": {"event": "code_changed", "files": out["installed_changed"]}})
        return out

    def cpu_info(self) -> dict:
        """CPU figures and the admission state (info's `cpu`, the metrics'),
        counting everything a create meets: a drain, CPU, memory and the number
        of sandboxes (the live ones and the creates queued, as a create counts them;
        the idle call sandboxes a create would drop apart)."""
        return self.cpu.info(self.registry.requested(), self.sb_defaults["cpu"], self.default_memory,
                             self.limits["max_sandboxes"], self.create_service.admission.queued,
                             self.create_service.drained is not None,
                             self.registry.held(self.call_service.idle_ids()))

    def status_line(self, connections: int) -> str:
        """One line for systemd's STATUS= (`systemctl status dsecd`)."""
        states = dict.fromkeys(STATUS_ORDER, 0)
        for sb in self.registry.by_id.values():
            states[sb.state] = states.get(sb.state, 0) + 1
        live = ", ".join(f"{n} {s}" for s, n in states.items() if n) or "none"
        q = self.create_service.admission
        drained = "; DRAINED (dsec undrain takes creates again)" if self.create_service.drained else ""
        return f"sandboxes: {live}; creates: {q.active} running, {q.queued} queued; {connections} clients{drained}"

    # ------------------------------------------------------------ counters for tests and bench

    def resource_counts(self) -> dict:
        return {"sandboxes": len(self.registry.by_id),
                "cgroups": cgroup.count_groups(self.layout, self.sb_defaults["cgroup_root"]),
                "dirs": len(os.listdir(Path(self.cfg.state_dir) / "sandboxes"))}


def make_microvm_service(cfg: Config, features: Features, layout: cgroup.Layout, workers: Workers,
                         store_path) -> MicroVMService:
    """The microVM backend where the probe found it usable (features.probe_microvm), else
    a service that refuses VM creates with the probe's reason."""
    vm_cfg = cfg.section("microvm")
    probed = features.items.get("microvm")
    backend = None
    why = probed.detail if probed else "not probed"
    if probed is not None and probed.available:
        try:
            guest = guestimg.load(Path(vm_cfg["guest_dir"]))
            backend = MicroVMBackend(layout, vm_cfg, cfg.section("sandbox"), cfg.state_dir, guest, probed.accel,
                                     cfg.size("microvm", "memory_overhead"), cfg.size("sandbox", "tmp_size"),
                                     probed.own_root if vm_cfg["own_root"] else Feature(
                                         False, "microvm.own_root is false: QEMU runs in the host's mount "
                                                "namespace"),
                                     shm_size=cfg.size("sandbox", "shm_size"))
        except (guestimg.GuestImageError, OSError) as err:
            why = str(err)
            log.warning("backend microvm unavailable: %s", why)
    tmpl = None
    if backend is not None and vm_cfg["templates"]:
        store = TemplateStore(cfg.state_dir, backend.guest.digest, qemu_identity(backend.qemu),
                              int(vm_cfg["templates_max"]))
        tmpl = TemplateService(backend, store, workers, float(vm_cfg["boot_timeout_s"]), int(vm_cfg["uid"]))
    return MicroVMService(backend, why, workers, store_path, vm_cfg, cfg.size("limits", "max_exec_output_bytes"),
                          int(vm_cfg["uid"]), tmpl, cfg.size("limits", "max_trace_bytes"))


def _mark_running(state_dir: Path) -> bool:
    """Mark the state dir as in use by a running daemon (RUNNING_MARK);
    whether the daemon before left its mark there, having died without a
    clean stop. A state dir of a daemon older than the mark counts as
    stopped cleanly."""
    path = Path(state_dir) / RUNNING_MARK
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return True
    os.close(fd)
    return False


def pick_exec_via(configured: str, features: Features) -> bool:
    """sandbox.exec_via: whether sandbox inits fork execs (dsecd/initlink.py)."""
    if configured not in ("init", "helper"):
        raise ConfigError(f"sandbox.exec_via must be init or helper, got {configured!r}")
    if configured == "helper":
        return False
    if not features.has("pidfd_group_signal"):
        probed = features.items.get("pidfd_group_signal")
        log.warning("sandbox.exec_via = init, but %s: execs use the daemon's helper",
                    probed.detail if probed else "pidfd_group_signal was not probed")
        return False
    return True
