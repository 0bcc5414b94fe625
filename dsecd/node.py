"""The host: the composition root of the engine, and the handlers not yet
moved into a service of dsecd/engine/.

Handlers (one per protocol op, named `op_<op>`) take a typed request from
dsecd.protocol and a per-request context from the server, and return a
result dict or raise a DsecError. Blocking work (clone, mount, cgroup and
file I/O, copies) runs through Workers, never on the event loop. Sandbox
states: dsecd/engine/sandboxes.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from . import __version__, cgroup, protocol, userns
from .backends.container import ContainerBackend, Handle, close_handle
from .config import Config, ConfigError, parse_duration, parse_size
from .cpu.manager import CpuHost
from .createops import CreateOps
from .engine.calls import CallService, fncall_backend
from .engine.events import EventBus
from .engine.execs import ExecLimits, ExecService, check_env
from .engine.files import FileService
from .engine.images import ImageService
from .engine.lifetimes import LifetimeService
from .engine.memory import MemoryService
from .engine.network import NetworkService
from .engine.sandboxes import Sandbox, SandboxRegistry
from .engine.starts import ProcessStarter
from .engine.workers import Workers
from .errors import (
    BadRequest,
    Busy,
    Conflict,
    DsecError,
    Unsupported,
    image_error,
    io_error,
)
from .fds import close_quietly
from .features import Features, suid_dumpable_hazard
from .fs import files as sbfiles
from .fs import upper as upperfs
from .fs.images import ImageError
from .journal import Journal
from .mem import pause
from .native import NativeError

log = logging.getLogger(__name__)

# Requests the server answers itself (dsecd/server.py), not routed to a service.
SERVER_OPS = ("hello", "cancel")

# The service that owns each request type: op -> (the node's attribute holding
# it, its handler). Ops not listed are still handled by the node's op_<name>.
SERVICE_ROUTES = {
    "exec": ("exec_service", "exec"), "exec_input": ("exec_service", "exec_input"),
    "file_read": ("file_service", "read"), "file_write": ("file_service", "write"),
    "file_list": ("file_service", "list"), "file_stat": ("file_service", "stat"),
    "image_build": ("image_service", "build"), "image_list": ("image_service", "list"),
    "image_inspect": ("image_service", "inspect"), "image_rm": ("image_service", "rm"),
    "image_gc": ("image_service", "gc"), "image_du": ("image_service", "du"),
    "snapshot": ("image_service", "snapshot"),
    "net_show": ("net_service", "show"), "net_set": ("net_service", "set"),
    "pause": ("memory", "pause"), "resume": ("memory", "resume"),
    "job_pause": ("memory", "job_pause"), "job_resume": ("memory", "job_resume"),
    "renew": ("lifetimes", "renew"), "events": ("events", "stream"),
    "call": ("call_service", "call"),
}


class Node(CreateOps):
    def __init__(self, cfg: Config, features: Features, layout: cgroup.Layout):
        self.cfg = cfg
        self.features = features
        self.layout = layout
        self.limits = cfg.section("limits")
        self.sb_defaults = cfg.section("sandbox")
        state = cfg.state_dir
        # First: a setting this host cannot honour stops the daemon before it changes anything.
        hazard = suid_dumpable_hazard()
        if hazard:
            raise ConfigError(hazard)
        try:
            upper_mode = upperfs.pick_mode(self.sb_defaults["writable_layer"], features)
        except upperfs.UpperError as err:
            raise ConfigError(str(err)) from err
        self.disk_default = cfg.size("sandbox", "disk")
        if upper_mode == "tmpfs" and not (self.disk_default >= 1 << 20 and self.sb_defaults["disk_inodes"] >= 16):
            raise ConfigError("sandbox.disk must be at least 1M and sandbox.disk_inodes at least 16 "
                              "(a tmpfs takes 0 as unlimited)")
        execs_by_init = self._pick_exec_via(self.sb_defaults["exec_via"], features)
        self.workers = Workers(cfg.section("daemon")["worker_threads"])
        self.pool = self.workers.pool
        self.max_exec_output = cfg.size("limits", "max_exec_output_bytes")     # parsed once, used per exec
        self.journal = Journal(state, fsync=cfg.section("journal")["fsync"], compact_with=self.workers.submit)
        self.registry = SandboxRegistry(self.journal)
        self.sandboxes = self.registry.by_id
        self.image_service = ImageService(cfg, features, layout, self.sb_defaults["cgroup_root"], self.registry,
                                          self.workers, float(cfg.section("memory")["freeze_timeout_s"]))
        # What the create path and the mixins not yet services use of it.
        self.images, self.layers = self.image_service.images, self.image_service.layers
        self.events = EventBus()
        self.memory = MemoryService(cfg, self.sb_defaults["cgroup_root"], self.registry, self.workers, self.events)
        self.lifetimes = LifetimeService(self.registry, self.workers, self.events, self.memory, self._destroy)
        self.backend = ContainerBackend(layout, self.sb_defaults, state, {
            "tmp": cfg.size("sandbox", "tmp_size"), "shm": cfg.size("sandbox", "shm_size")}, upper_mode,
            execs_by_init)
        self.id_ranges = self._init_userns(state)
        self.cpu = CpuHost(cfg.section("cpu"), layout, features, self.sb_defaults["cgroup_root"])
        # Stdin of collected execs and zygote calls: one /dev/null, shared (a
        # spawn dup2s it, SCM_RIGHTS gives init or a zygote its own copy).
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.net_service = NetworkService(cfg, layout, self.sb_defaults["cgroup_root"],
                                          self.limits["max_sandboxes"], self.registry, self.workers, self.backend)
        self.starter = ProcessStarter(self.workers)
        exec_limits = ExecLimits.from_config(cfg)
        self.exec_service = ExecService(self.registry, self.workers, self.starter, self.backend,
                                        self.memory.ensure_running, exec_limits, self._devnull)
        self.file_service = FileService(self.registry, self.workers, self.memory.ensure_running,
                                 cfg.size("limits", "max_file_chunk_bytes"))
        self.call_service = CallService(fncall_backend(cfg, layout, self.backend), cfg.section("fncall"),
                                        CallService.sizes_from(cfg), self.sb_defaults["cpu_period_us"],
                                        self.image_service, self.cpu, self.workers, self.starter,
                                        exec_limits, self._devnull)
        self.init_admission(cfg)
        self._cpu_task: asyncio.Task | None = None
        self.started = time.time()
        self.loop: asyncio.AbstractEventLoop | None = None

    def _init_userns(self, state: Path) -> userns.RangeAllocator | None:
        """The id-range allocator, after checking that the upper dirs' file
        system can be idmapped (a sandbox could not be created otherwise)."""
        if not self.sb_defaults["userns"]:
            log.warning("sandbox.userns is false: sandbox root is host root (with reduced capabilities)")
            return None
        why = userns.probe_idmap(str(state))
        if why:
            raise ConfigError(f"sandbox.userns = true, but the state dir {state} cannot be idmapped: {why}; "
                              "set sandbox.userns = false or move state_dir to ext4, xfs, btrfs or tmpfs")
        try:
            return userns.RangeAllocator(int(self.sb_defaults["userns_base"]), int(self.sb_defaults["userns_size"]))
        except ValueError as err:
            raise ConfigError(str(err)) from err

    def userns_info(self) -> dict:
        r = self.id_ranges
        if r is None:
            return {"enabled": False}
        return {"enabled": True, "base": r.base, "size": r.size, "slots": r.slots, "used": len(r.used)}

    def _allocate_ids(self, sb: Sandbox) -> None:
        if self.id_ranges is None:
            return
        try:
            sb.idmap = self.id_ranges.allocate().record()
        except userns.RangesExhausted as err:
            raise Busy(f"{err}; retry once a sandbox is destroyed",
                       {"userns_slots": self.id_ranges.slots}) from err

    def _release_ids(self, sb: Sandbox) -> None:
        if self.id_ranges is not None:
            self.id_ranges.release(userns.IdMap.from_record(sb.idmap))

    def _reserve_ids(self, sb: Sandbox) -> None:
        idmap = userns.IdMap.from_record(sb.idmap)
        if idmap is None or self.id_ranges is None:
            return
        try:
            self.id_ranges.reserve(idmap)
        except ValueError as err:
            # The sandbox keeps running in its namespace; only new ranges could overlap it.
            log.error("sandbox %s: %s", sb.id, err)

    async def run_blocking(self, fn, *args):
        return await self.workers.run(fn, *args)

    async def run_shielded(self, on_abandoned, fn, *args):
        return await self.workers.run_shielded(on_abandoned, fn, *args)

    # ------------------------------------------------------------ start / stop

    async def start(self) -> None:
        """Re-adopt journaled sandboxes, clean up what died or was half-made."""
        self.loop = asyncio.get_running_loop()
        self.workers.start(self.loop)
        await self.run_blocking(upperfs.sweep_views, self.cfg.state_dir / upperfs.VIEWS_DIR)
        await self.run_blocking(self.image_service.start)
        records = await self.run_blocking(self.journal.load_all)
        for sb_id, rec in records.items():
            await self._recover(sb_id, rec)
        orphans = await self.run_blocking(self.backend.orphans, set(self.sandboxes))
        for sb_id in orphans:
            log.warning("removing orphaned sandbox resources %s (no journal record)", sb_id)
            await self.run_blocking(self.backend.destroy, sb_id, None)
        await self.call_service.start()
        await self.start_admission()
        self._cpu_task = self.loop.create_task(self.cpu.run(self._cpu_entries, self.run_blocking))
        self.image_service.start_layer_sweeper()
        await self.run_blocking(self.memory.start)
        await self.net_service.readopt_net()
        self.lifetimes.start()

    def _cpu_entries(self) -> dict[str, tuple[str, bool]]:
        return {s.id: (s.qos, bool(s.limits.get("cpu_quota"))) for s in self.sandboxes.values()
                if s.state == "running"}

    def live_count(self) -> int:
        return self.registry.live_count()

    def _live_limits(self) -> list[dict]:
        return self.registry.live_limits()

    async def _recover(self, sb_id: str, rec: dict) -> None:
        fields = {k: rec[k] for k in ("image", "state", "created", "limits", "env", "labels",
                                      "hostname", "cwd", "user", "backend", "died", "qos", "core_sched",
                                      "manifest", "layers", "ttl", "idle_ttl", "lease", "pause_record",
                                      "net", "key", "idmap")
                  if k in rec}
        sb = Sandbox(id=sb_id, **fields)
        if sb.state in ("creating", "stopping"):
            # Interrupted mid-create or mid-destroy: finish tearing it down.
            log.info("sandbox %s was %s when the daemon stopped; removing it", sb_id, sb.state)
            await self.run_blocking(self.backend.destroy, sb_id, None)
            self.journal.delete(sb_id)
            return
        self.registry.add(sb)
        self._reserve_ids(sb)
        if sb.state == "dead":
            return
        handle = await self.run_blocking(self.backend.adopt, sb_id, rec.get("init_pid"), rec.get("init_start"),
                                         bool(sb.limits.get("disk")))
        if handle is None:
            log.warning("sandbox %s died while the daemon was down", sb_id)
            await self._mark_dead(sb, None)
            return
        if handle.init_link is not None:
            handle.init_link.attach(self.loop)      # read what init sent while we were down
        sb.handle = handle
        if sb.state == "running":
            # A kill -9 between a pause's freeze and its journal write leaves a
            # "running" sandbox frozen: thaw it, or its next exec hangs joining it.
            await self.run_blocking(lambda: pause.Freezer.of(handle.group).thaw())
        sb.last_active = time.monotonic()          # idle and lease clocks restart with the daemon
        if sb.lease:
            sb.lease_deadline = sb.last_active + sb.lease
        self.layers.readopt(sb.layers)
        self.cpu.bind(handle, self.cpu.plan(sb.qos))
        self._watch(sb)
        log.info("re-adopted sandbox %s (init pid %d)", sb_id, handle.init_pid)

    async def close(self) -> None:
        """Daemon shutdown: stop watching, close fds, leave sandboxes running."""
        self.close_admission()
        await self.call_service.close()      # call sandboxes belong to this daemon: they go
        self.image_service.stop_layer_sweeper()
        self.lifetimes.stop()
        for task in (self._cpu_task,):
            if task:
                task.cancel()
        await self.net_service.close_net()
        await self.run_blocking(self.memory.close)
        drained = not any(s.handle is not None for s in self.sandboxes.values())
        await self.run_blocking(self.image_service.stop, drained)
        for sb in self.sandboxes.values():
            if sb.handle and sb.handle.pidfd >= 0:
                self.loop.remove_reader(sb.handle.pidfd)
                close_handle(sb.handle)
        # Layers no running sandbox uses are unmounted; the others stay for
        # their sandboxes and are re-counted by the next daemon.
        try:
            await self.run_blocking(self.layers.sweep, True)
        except Exception:
            log.exception("unmount idle layers at shutdown")
        self.workers.shutdown()
        self.journal.close()
        close_quietly(self._devnull)
        self._devnull = -1

    @staticmethod
    def _pick_exec_via(configured: str, features: Features) -> bool:
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

    # ------------------------------------------------------------ helpers

    def _journal(self, sb: Sandbox) -> None:
        self.registry.save(sb)

    def _get(self, sb_id: str, op_cls) -> Sandbox:
        return self.registry.get(sb_id, op_cls)

    def _watch(self, sb: Sandbox) -> None:
        """Notice when a sandbox's init exits on its own."""
        h = sb.handle
        self.loop.add_reader(h.pidfd, lambda: self.loop.create_task(self._on_init_exit(sb)))

    async def _on_init_exit(self, sb: Sandbox) -> None:
        h = sb.handle
        if h is None or h.pidfd < 0:
            return
        self.loop.remove_reader(h.pidfd)
        if sb.state in ("stopping",):
            return
        log.warning("sandbox %s: init %d exited", sb.id, h.init_pid)
        await self._mark_dead(sb, h)

    async def _mark_dead(self, sb: Sandbox, h: Handle | None) -> None:
        """Release the cgroups and fds of a sandbox whose init is gone; keep its record."""
        self.registry.mark_dead(sb)
        sb.died = time.time()
        self.events.publish("died", sb.id)
        sb.handle = None
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
            return self._stop_counting_oom(sb.id, None, self.backend.group_for(sb.id))

        try:
            kills = await self.run_blocking(release)
            if kills is not None:
                self.memory.report_oom(sb, kills)
            await self.net_service.detach_net(sb)      # frees its lease and policy; the veth died with the netns
        finally:
            self._journal(sb)

    # ------------------------------------------------------------ routing

    def routes(self) -> dict[str, Callable]:
        """Each request type's handler, by op name, for dsecd/server.py: the
        service SERVICE_ROUTES names, or, until it moves into one, this node's
        op_<name>. `hello` and `cancel` are the server's own."""
        out = {}
        for op in protocol.REQUESTS:
            if op in SERVER_OPS:
                continue
            service, method = SERVICE_ROUTES.get(op, (None, f"op_{op}"))
            out[op] = getattr(getattr(self, service) if service else self, method)
        return out

    # ------------------------------------------------------------ ops: session and host

    async def op_ping(self, req, ctx) -> dict:
        return {"time": time.time()}

    def hello_result(self) -> dict:
        return {"server": "dsecd", "version": __version__, "protocol": protocol.PROTOCOL_VERSION,
                "capabilities": self.capabilities(), "limits": self.wire_limits()}

    def capabilities(self) -> list[str]:
        caps = ["exec.stream", "exec.stdin", "files", "backend.container", "image.dir", "backend.fncall"]
        return caps

    def wire_limits(self) -> dict:
        return {"max_frame_bytes": self.cfg.size("limits", "max_frame_bytes"),
                "max_file_chunk_bytes": self.cfg.size("limits", "max_file_chunk_bytes"),
                "max_exec_output_bytes": self.max_exec_output,
                "max_requests_per_client": self.limits["max_requests_per_client"],
                "max_connections": self.limits["max_connections"],
                "max_sandboxes": self.limits["max_sandboxes"]}

    async def op_info(self, req, ctx) -> dict:
        states: dict[str, int] = {}
        for sb in self.sandboxes.values():
            states[sb.state] = states.get(sb.state, 0) + 1
        d = self.cfg.section("daemon")
        return {"version": __version__, "protocol": protocol.PROTOCOL_VERSION, "pid": os.getpid(),
                "uptime_s": round(time.time() - self.started, 3), **self.features.to_dict(),
                "limits": self.wire_limits(), "sandboxes": states,
                "cpu": self.cpu.info(self._live_limits(), self.sb_defaults["cpu"],
                                     parse_size(self.sb_defaults["memory"])),
                "images": await self.run_blocking(self.image_service.info),
                "net": self.net_service.net_info(),
                "memory": await self.run_blocking(self.memory.info),
                "fncall": self.call_service.info(),
                "admission": self.admission_info(),
                "userns": self.userns_info(),
                "paths": {"socket": d["socket"], "state_dir": str(self.cfg.state_dir),
                          "cgroup_root": self.sb_defaults["cgroup_root"],
                          "cgroup_dirs": {k: str(v / self.sb_defaults["cgroup_root"])
                                          for k, v in self.layout.hierarchies().items()}}}

    # ------------------------------------------------------------ ops: sandboxes

    def _limits_for(self, req) -> cgroup.Limits:
        d = self.sb_defaults
        cpu = d["cpu"] if req.cpu is None else req.cpu
        if not 0.01 <= cpu <= 1024:
            raise BadRequest(f"cpu must be between 0.01 and 1024, got {cpu}")
        try:
            memory = parse_size(d["memory"] if req.memory is None else req.memory)
        except ConfigError as err:
            raise BadRequest(f"memory: {err}") from err
        if memory < 4 << 20:
            raise BadRequest(f"memory must be at least 4M, got {memory} bytes")
        pids = d["pids"] if req.pids is None else req.pids
        if not 8 <= pids <= 1 << 22:
            raise BadRequest(f"pids must be between 8 and 4194304, got {pids}")
        self.cpu.check_possible(cpu, memory, req.qos)
        quota = d["cpu_hard_quota"] if req.cpu_quota is None else req.cpu_quota
        ratio = float(d["swap_per_memory"])
        return cgroup.Limits(cpu=float(cpu), memory_bytes=memory, pids=pids,
                             cpu_hard_quota=quota, cpu_period_us=d["cpu_period_us"],
                             swap_bytes=None if ratio < 0 else int(memory * ratio))

    def _disk_for(self, req) -> upperfs.Cap | None:
        """The writable layer's cap, or None where layers are uncapped dirs."""
        if self.backend.upper_mode != "tmpfs":
            if req.disk is not None:
                raise Unsupported("this host cannot cap the writable layer (see `dsec info`, "
                                  "feature upperfs); create without `disk`")
            return None
        try:
            size = self.disk_default if req.disk is None else parse_size(req.disk)
        except ConfigError as err:
            raise BadRequest(f"disk: {err}") from err
        if not 1 << 20 <= size <= 1 << 50:
            raise BadRequest(f"disk must be between 1M and 1P, got {size} bytes")
        return upperfs.Cap(size, self.sb_defaults["disk_inodes"])

    def _admit(self) -> None:
        live = self.live_count()
        cap = self.limits["max_sandboxes"]
        if live >= cap:
            raise Busy(f"host is full: {live} sandboxes of max {cap}; retry later or on another host",
                       {"sandboxes": live, "max": cap})

    def check_process(self, req) -> None:
        """A create's settings of the sandbox's processes, fresh or pooled."""
        _check_process(req)
        if self.id_ranges and req.user >= self.id_ranges.size:
            raise BadRequest(f"user must be below sandbox.userns_size {self.id_ranges.size} (the ids a "
                             f"sandbox's user namespace maps), got {req.user}")

    async def check_cwd(self, sb: Sandbox, cwd: str) -> None:
        """A create's cwd must be a directory of the sandbox's image: else every exec in it fails."""
        if cwd == "/":
            return
        try:
            found = await self.run_blocking(userns.file_op, userns.IdMap.from_record(sb.idmap),
                                            sbfiles.is_directory, sb.handle.rootfd, cwd)
        except sbfiles.PathError as err:
            raise BadRequest(f"cwd: {err}", {"cwd": cwd}) from err
        except OSError as err:
            raise io_error("check the cwd of", f"{sb.id}:{cwd}", err) from err
        if not found:
            raise BadRequest(f"cwd {cwd!r} is not a directory in image {sb.image!r}: give one that "
                             "exists, or create without --cwd and make it with an exec", {"cwd": cwd})

    async def create_now(self, req, ctx) -> dict:
        """The create itself; op_create (dsecd/createops.py) does keys, pools and the queue first."""
        limits = self._limits_for(req)
        plan = self.cpu.plan(req.qos)
        self.check_process(req)
        net_mode = self.net_service.net_mode(req)
        disk = self._disk_for(req)
        try:
            image = await self.run_blocking(self.images.get, req.image)
        except ImageError as err:
            raise image_error(err) from err
        self._admit()
        self.cpu.admit(self._live_limits, limits.cpu, limits.memory_bytes, plan)
        sb_id = secrets.token_hex(6)
        hostname = req.hostname or f"sb-{sb_id}"
        if len(hostname) > 63:
            raise BadRequest("hostname must be at most 63 characters")
        sb = Sandbox(id=sb_id, image=req.image, state="creating", created=time.time(),
                     limits={"cpu": limits.cpu, "memory": limits.memory_bytes, "pids": limits.pids,
                             "cpu_quota": limits.cpu_hard_quota,
                             "disk": disk.disk_bytes if disk else None,
                             "disk_inodes": disk.inodes if disk else None},
                     env=dict(req.env), labels=dict(req.labels), hostname=hostname, cwd=req.cwd,
                     user=req.user, qos=plan.qos, core_sched=plan.core_sched,
                     manifest=image.manifest, layers=image.layer_digests,
                     ttl=parse_duration(req.ttl, "ttl"), idle_ttl=parse_duration(req.idle_ttl, "idle_ttl"),
                     lease=parse_duration(req.lease, "lease"), key=req.key)
        if sb.lease:
            sb.lease_deadline = time.monotonic() + sb.lease
        self._allocate_ids(sb)
        self.registry.add(sb)
        # The record is written once the sandbox runs. A crash before that leaves
        # a directory and cgroups without a record: the next start finds them as
        # orphans, kills what is in the cgroups and removes them.
        try:
            # Each layer mounted once per host; overlay wants the top layer first.
            mounts = (self.layers.acquire_mounted(sb.layers)
                      or await self.run_blocking(self.layers.acquire, sb.layers))
        except OSError as err:
            self.sandboxes.pop(sb_id, None)
            self._release_ids(sb)
            raise io_error("mount layers of image", req.image, err) from err
        def release() -> None:
            self._release_ids(sb)
            self.layers.release(sb.layers)

        spawning = False
        try:
            ready = await self.net_service.take_netns(net_mode)      # a pooled netns for PID 1 to join, or None
            spawning = True
            sb.handle = await self.net_service.spawn_joining(functools.partial(self.backend.create, disk=disk), ready, release,
                                                 sb_id, mounts[::-1], limits, hostname, plan,
                                                 userns.IdMap.from_record(sb.idmap))
        except BaseException as err:
            self.sandboxes.pop(sb_id, None)
            if not (spawning and isinstance(err, asyncio.CancelledError)):
                release()           # else once the worker is done and its sandbox destroyed (spawn_joining)
            if isinstance(err, (NativeError, OSError)):
                log.error("create sandbox %s failed: %s", sb_id, err)
                raise DsecError(f"create sandbox: {err}", {"errno": getattr(err, "errno", None),
                                "step": getattr(err, "step", None)}, code="io") from err
            raise
        try:
            try:
                await self.check_cwd(sb, sb.cwd)
            except BaseException:
                self.net_service.release_netns(ready)     # attach_net would have consumed it
                raise
            await self.net_service.attach_net(sb, net_mode, req.allow, ready)
        except BaseException:
            # No sandbox whose execs could not start, nor without its network policy: undo the container.
            self.sandboxes.pop(sb_id, None)
            await self.run_blocking(self.backend.destroy, sb_id, sb.handle)
            self._release_ids(sb)
            self.layers.release(sb.layers)
            raise
        sb.state = "running"
        self._journal(sb)
        self._watch(sb)
        self.memory.on_created(sb)
        return sb.public()

    async def op_top(self, req, ctx) -> dict:
        rows = [{"id": s.id, "state": s.state, "qos": s.qos, "cpu": s.limits["cpu"],
                 "memory_limit": s.limits["memory"]}
                for s in self.sandboxes.values() if _labels_match(s, req.labels)]
        return self.cpu.top(rows)

    async def op_list(self, req, ctx) -> dict:
        return {"sandboxes": [s.public() for s in self.sandboxes.values() if _labels_match(s, req.labels)]}

    async def op_inspect(self, req, ctx) -> dict:
        sb = self._get(req.sandbox, req)
        out = sb.public()
        if sb.handle:
            out["cgroups"] = {k: str(v) for k, v in sb.handle.group.dirs.items()}
            if sb.handle.dir is not None:
                out["dir"] = str(sb.handle.dir)
            if sb.handle.upperfd >= 0:
                out["disk"] = upperfs.usage(sb.handle.upperfd)
        return out

    async def op_destroy(self, req, ctx) -> dict:
        sb = self._get(req.sandbox, req)
        return await self._destroy(sb, req.force)

    async def _destroy(self, sb: Sandbox, force: bool) -> dict:
        if sb.state == "stopping":
            raise Conflict(f"sandbox {sb.id} is already being destroyed", {"sandbox": sb.id})
        if sb.state == "creating":
            raise Conflict(f"sandbox {sb.id} is still being created; retry", {"sandbox": sb.id})
        if sb.execs and not force:
            raise Conflict(f"sandbox {sb.id} has {sb.execs} running exec(s); use force to kill them",
                           {"sandbox": sb.id, "execs": sb.execs})
        # No journal write for "stopping": a crash mid-destroy leaves the record
        # as it was, and the next daemon re-adopts the sandbox or marks it dead.
        prev, sb.state = sb.state, "stopping"
        # Once accepted, a destroy finishes even if its request is cancelled
        # (client gone, `cancel`): the client gave up on the answer, not on the
        # destroy, and a half-done one would leave the sandbox "stopping" forever.
        return await asyncio.shield(self._teardown(sb, prev))

    async def _teardown(self, sb: Sandbox, prev: str) -> dict:
        sb.state = prev                        # before_destroy looks at paused or not
        if self.memory.damon_running or sb.state == "paused":     # else before_destroy has nothing to do
            await self.run_blocking(self.memory.before_destroy, sb)
        sb.state = "stopping"
        h, sb.handle = sb.handle, None
        if h and h.pidfd >= 0:
            self.loop.remove_reader(h.pidfd)
        try:
            kills = await self.run_blocking(self._stop_counting_oom, sb.id, h)
        except OSError as err:
            log.error("destroy sandbox %s: %s", sb.id, err)
            sb.state = prev
            sb.handle = h
            self._journal(sb)
            raise io_error("destroy sandbox", sb.id, err) from err
        if kills is not None:
            self.memory.report_oom(sb, kills)
        await self.net_service.detach_net(sb)
        self.registry.remove(sb, prev)
        self.free_key(sb)
        self._release_ids(sb)        # its processes are gone: stop() waited for them
        if prev != "dead":          # a dead sandbox gave its layers back already
            self.layers.release(sb.layers)
        self.loop.run_in_executor(self.pool, self.backend.release, sb.id, h)
        self.events.publish("destroyed", sb.id, previous_state=prev)
        return {"id": sb.id, "previous_state": prev}

    def _stop_counting_oom(self, sb_id: str, h: Handle | None, group=None) -> int | None:
        """backend.stop, with the OOM kill count read before it removes the
        cgroups: of `group`, else of the handle's (neither: not read)."""
        group = group if group is not None else (h.group if h is not None else None)
        kills = self.memory.oom_count(group) if group is not None else None
        self.backend.stop(sb_id, h)
        return kills

    async def op_job_rm(self, req, ctx) -> dict:
        sbs = self.registry.of_job(req.job, ("running", "paused", "dead"))
        results = await asyncio.gather(*(self._destroy(s, req.force) for s in sbs), return_exceptions=True)
        return {"job": req.job, "destroyed": [r["id"] for r in results if isinstance(r, dict)],
                "failed": {s.id: str(r) for s, r in zip(sbs, results, strict=True) if isinstance(r, BaseException)}}

    async def op_destroy_all(self, req, ctx) -> dict:
        targets = [s for s in self.sandboxes.values()
                   if _labels_match(s, req.labels) and s.state in ("running", "paused", "dead")]
        results = await asyncio.gather(*(self._destroy(s, req.force) for s in targets), return_exceptions=True)
        destroyed = [r["id"] for r in results if isinstance(r, dict)]
        failed = {s.id: str(r) for s, r in zip(targets, results, strict=True) if isinstance(r, BaseException)}
        return {"destroyed": destroyed, "failed": failed}

    # ------------------------------------------------------------ counters for tests and bench

    def resource_counts(self) -> dict:
        return {"sandboxes": len(self.sandboxes),
                "cgroups": cgroup.count_groups(self.layout, self.sb_defaults["cgroup_root"]),
                "dirs": len(os.listdir(Path(self.cfg.state_dir) / "sandboxes"))}


def _labels_match(sb: Sandbox, labels: dict) -> bool:
    return all(sb.labels.get(k) == v for k, v in labels.items())


def _check_process(req) -> None:
    """A create's settings of the sandbox's processes (env, cwd, user)."""
    check_env(req.env)
    if not req.cwd.startswith("/"):
        raise BadRequest(f"cwd must be absolute, got {req.cwd!r}")
    if not 0 <= req.user < 2**32 - 1:
        raise BadRequest(f"user must be a uid in [0, 2^32-1), got {req.user}")
