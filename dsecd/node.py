"""The host: admission, the sandbox registry, the journal, and lifecycle.

The node owns all state. Handlers (one per protocol op, named `op_<op>`) take a
typed request from dsecd.protocol and a per-request context from the server,
and return a result dict or raise a DsecError. Blocking work (clone, mount,
cgroup and file I/O, copies) runs in the worker pool, never on the event loop.

Sandbox states:
    creating -> running -> stopping -> (gone)
                  |
                  +-> dead (its init exited on its own; only inspect/destroy accept it)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__, cgroup, protocol, tracing, userns
from .backends.container import ContainerBackend, Handle, close_handle
from .callops import CallOps
from .config import Config, ConfigError, parse_duration, parse_size
from .cpu.manager import CpuHost
from .createops import CreateOps
from .errors import (
    BadRequest,
    Busy,
    Conflict,
    DsecError,
    LimitExceeded,
    NotFound,
    Unsupported,
    exec_error,
    image_error,
    io_error,
    run_error,
)
from .execio import ChildWatch, Collector, ExecIO, kill_and_reap
from .fds import close_quietly
from .features import Features, suid_dumpable_hazard
from .fs import files as sbfiles
from .fs import upper as upperfs
from .fs.images import ImageError
from .imageops import ImageOps
from .initlink import InitExec
from .journal import Journal
from .mem import pause
from .memops import MemOps
from .native import NativeError
from .netops import NetOps

log = logging.getLogger(__name__)


@dataclass
class Sandbox:
    id: str
    image: str
    state: str
    created: float
    limits: dict
    env: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    hostname: str = ""
    cwd: str = "/"
    user: int = 0
    backend: str = "container"
    handle: Handle | None = None
    # Runtime only (not journaled): pause/resume/destroy serialisation and clocks.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    last_active: float = 0.0          # monotonic; the idle TTL counts from here
    paused_at: float | None = None
    paused_total: float = 0.0
    lease_deadline: float | None = None
    oom_kills: int = 0                # the memory cgroup's OOM-kill count last seen
    execs: int = 0
    exit_status: int | None = None
    died: float | None = None
    manifest: str = ""          # image manifest digest: what snapshot and gc go by
    layers: list = field(default_factory=list)   # layer digests, bottom first
    ttl: float | None = None        # max lifetime, seconds
    idle_ttl: float | None = None   # stop after this long without requests (paused time excluded)
    lease: float | None = None      # a client must `renew` within this many seconds
    pause_record: dict | None = None   # what pause did (dsecd/mem/pause.py), for resume
    net: dict | None = None            # {"mode": "default", "lease": {...}}; None = loopback only
    qos: str = "be"             # CPU class (dsecd/cpu/qos.py)
    core_sched: str = "off"     # on | off | unavailable
    key: str | None = None      # idempotency key of the create (dsecd/createops.py)
    idmap: dict | None = None   # user-namespace id range (dsecd/userns.py); None = host ids

    def record(self) -> dict:
        h = self.handle
        return {"id": self.id, "image": self.image, "state": self.state, "created": self.created,
                "limits": self.limits, "env": self.env, "labels": self.labels,
                "hostname": self.hostname, "cwd": self.cwd, "user": self.user, "backend": self.backend,
                "init_pid": h.init_pid if h else None, "init_start": h.init_start if h else None,
                "died": self.died, "qos": self.qos, "core_sched": self.core_sched,
                "manifest": self.manifest, "layers": self.layers, "ttl": self.ttl,
                "idle_ttl": self.idle_ttl, "lease": self.lease, "pause_record": self.pause_record,
                "net": self.net, "key": self.key, "idmap": self.idmap}

    def public(self) -> dict:
        out = self.record()
        out.pop("init_start")
        out.pop("pause_record")
        out["execs_running"] = self.execs
        return out


class Node(CreateOps, ImageOps, MemOps, NetOps, CallOps):
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
        self.pool = ThreadPoolExecutor(cfg.section("daemon")["worker_threads"], "dsecd-worker")
        self.max_exec_output = cfg.size("limits", "max_exec_output_bytes")     # parsed once, used per exec
        self.journal = Journal(state, fsync=cfg.section("journal")["fsync"], compact_with=self.pool.submit)
        self.init_images(cfg)
        self.init_memory(cfg)
        self.init_net(cfg)
        self.backend = ContainerBackend(layout, self.sb_defaults, state, {
            "tmp": cfg.size("sandbox", "tmp_size"), "shm": cfg.size("sandbox", "shm_size")}, upper_mode,
            execs_by_init)
        self.sandboxes: dict[str, Sandbox] = {}
        self.id_ranges = self._init_userns(state)
        # Dead sandboxes in the registry, so the live count each create checks
        # is len() - this, not a scan of thousands of sandboxes per create.
        self._dead = 0
        self.cpu = CpuHost(cfg.section("cpu"), layout, features, self.sb_defaults["cgroup_root"])
        # Stdin of collected execs and zygote calls: one /dev/null, shared (a
        # spawn dup2s it, SCM_RIGHTS gives init or a zygote its own copy).
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.init_calls(cfg)
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
        return await self.loop.run_in_executor(self.pool, fn, *args)

    async def run_shielded(self, on_abandoned, fn, *args):
        """fn(*args) in a worker, like run_blocking, for work that makes
        something (a process, a sandbox): the caller may be cancelled (client
        gone, `cancel`), the work is not, and on_abandoned(future) runs once it
        is over, to undo what it made."""
        fut = self.loop.run_in_executor(self.pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(on_abandoned)
            raise

    # ------------------------------------------------------------ start / stop

    async def start(self) -> None:
        """Re-adopt journaled sandboxes, clean up what died or was half-made."""
        self.loop = asyncio.get_running_loop()
        await self.run_blocking(upperfs.sweep_views, self.cfg.state_dir / upperfs.VIEWS_DIR)
        await self.run_blocking(self.start_images)
        records = await self.run_blocking(self.journal.load_all)
        for sb_id, rec in records.items():
            await self._recover(sb_id, rec)
        orphans = await self.run_blocking(self.backend.orphans, set(self.sandboxes))
        for sb_id in orphans:
            log.warning("removing orphaned sandbox resources %s (no journal record)", sb_id)
            await self.run_blocking(self.backend.destroy, sb_id, None)
        await self.start_calls()
        await self.start_admission()
        self._cpu_task = self.loop.create_task(self.cpu.run(self._cpu_entries, self.run_blocking))
        self.start_layer_sweeper()
        await self.run_blocking(self.start_memory)
        await self.readopt_net()
        self.start_reaper()

    def _cpu_entries(self) -> dict[str, tuple[str, bool]]:
        return {s.id: (s.qos, bool(s.limits.get("cpu_quota"))) for s in self.sandboxes.values()
                if s.state == "running"}

    def live_count(self) -> int:
        return len(self.sandboxes) - self._dead

    def _live_limits(self) -> list[dict]:
        return [s.limits for s in self.sandboxes.values() if s.state != "dead"]

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
        self.sandboxes[sb_id] = sb
        self._reserve_ids(sb)
        if sb.state == "dead":
            self._dead += 1
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
        await self.close_calls()      # call sandboxes belong to this daemon: they go
        for task in (self._cpu_task, self._sweep_task, self._reaper_task):
            if task:
                task.cancel()
        await self.close_net()
        await self.run_blocking(self.close_memory)
        drained = not any(s.handle is not None for s in self.sandboxes.values())
        await self.run_blocking(self.stop_images, drained)
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
        self.pool.shutdown(wait=False, cancel_futures=True)
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
        # A record is one line appended to the log (dsecd/journal.py): cheap
        # enough for the event loop. With journal.fsync on, each write waits
        # for the disk; use a slower but crash-proof config knowingly.
        self.journal.write(sb.id, sb.record())

    def _get(self, sb_id: str, op_cls) -> Sandbox:
        sb = self.sandboxes.get(sb_id)
        if sb is None:
            matches = [s for k, s in self.sandboxes.items() if k.startswith(sb_id)] if len(sb_id) >= 4 else []
            if len(matches) == 1:
                sb = matches[0]
            elif len(matches) > 1:
                raise BadRequest(f"sandbox prefix {sb_id!r} is ambiguous", {"matches": [s.id for s in matches]})
            else:
                raise NotFound(f"no sandbox {sb_id!r} (see `dsec ps`)", {"sandbox": sb_id})
        if op_cls.STATES and sb.state not in op_cls.STATES:
            raise Conflict(f"sandbox {sb.id} is {sb.state}; {op_cls.OP} needs it {' or '.join(op_cls.STATES)}",
                           {"sandbox": sb.id, "state": sb.state})
        return sb

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
        if sb.state != "dead" and self.sandboxes.get(sb.id) is sb:
            self._dead += 1
        sb.state = "dead"
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
                self._report_oom(sb, kills)
            await self.detach_net(sb)      # frees its lease and policy; the veth died with the netns
        finally:
            self._journal(sb)

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
                "images": await self.run_blocking(self.images_info),
                "net": self.net_info(),
                "memory": await self.run_blocking(self.memory_info),
                "fncall": self.calls_info(),
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
        net_mode = self.net_mode(req)
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
        self.sandboxes[sb_id] = sb
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
            ready = await self.take_netns(net_mode)      # a pooled netns for PID 1 to join, or None
            spawning = True
            sb.handle = await self.spawn_joining(functools.partial(self.backend.create, disk=disk), ready, release,
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
                self.release_netns(ready)         # attach_net would have consumed it
                raise
            await self.attach_net(sb, net_mode, req.allow, ready)
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
        self.on_created(sb)
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
        if self.damon_running or sb.state == "paused":     # else before_destroy has nothing to do
            await self.run_blocking(self.before_destroy, sb)
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
            self._report_oom(sb, kills)
        await self.detach_net(sb)
        if self.sandboxes.pop(sb.id, None) is sb and prev == "dead":
            self._dead -= 1
        self.journal.delete(sb.id)
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
        kills = self.oom_count(group) if group is not None else None
        self.backend.stop(sb_id, h)
        return kills

    async def op_destroy_all(self, req, ctx) -> dict:
        targets = [s for s in self.sandboxes.values()
                   if _labels_match(s, req.labels) and s.state in ("running", "paused", "dead")]
        results = await asyncio.gather(*(self._destroy(s, req.force) for s in targets), return_exceptions=True)
        destroyed = [r["id"] for r in results if isinstance(r, dict)]
        failed = {s.id: str(r) for s, r in zip(targets, results, strict=True) if isinstance(r, BaseException)}
        return {"destroyed": destroyed, "failed": failed}

    # ------------------------------------------------------------ ops: exec

    async def op_exec(self, req, ctx) -> dict:
        sb = self._get(req.sandbox, req)
        if not req.argv or not all(req.argv):
            raise BadRequest("argv must be a non-empty list of non-empty strings")
        _check_env(req.env)
        timeout = req.timeout
        max_t = self.limits["max_exec_timeout_s"]
        if timeout is not None and not 0 < timeout <= (max_t or float("inf")):
            raise BadRequest(f"timeout must be in (0, {max_t}] seconds, got {timeout}")
        cwd = req.cwd or sb.cwd
        if not cwd.startswith("/"):
            raise BadRequest(f"cwd must be an absolute path inside the sandbox, got {cwd!r}")
        if any("\0" in a for a in req.argv):
            raise BadRequest("argv must not contain NUL bytes")
        user = sb.user if req.user is None else req.user
        idmap = userns.IdMap.from_record(sb.idmap)
        if idmap and not 0 <= user < idmap.count:
            raise BadRequest(f"user {user} does not exist in sandbox {sb.id}: its user namespace maps "
                             f"uids 0..{idmap.count - 1}", {"user": user, "userns_size": idmap.count})
        env = self.backend.exec_env({"HOSTNAME": sb.hostname, **sb.env}, req.env)
        await self.ensure_running(sb, "exec")
        if not (req.stream or req.stdin or req.trace):
            # ETXTBSY: the program is open for writing somewhere for a moment
            # (a write_file just answered, whose fd a spawn child copied with the
            # daemon's fd table before closing it: csrc/spawn.c fds_own; or the
            # sandbox's own writer). Nothing ran, so a short wait and a retry are safe.
            for delay in (*ETXTBSY_RETRY_S, None):
                try:
                    return await self._exec_collected(sb, list(req.argv), env, cwd, user, timeout, ctx)
                except DsecError as err:
                    if delay is None or err.detail.get("errno") != "ETXTBSY":
                        raise
                await asyncio.sleep(delay)
        collected: dict[int, list[bytes]] = {1: [], 2: []}

        async def emit(stream: int, data: bytes) -> None:
            if req.stream:
                await ctx.emit({"fd": stream, "data": data})
            else:
                collected[stream].append(data)

        io = ExecIO(self.loop, self.max_exec_output, emit, req.stdin)
        sb.execs += 1
        ctx.register_exec(io)
        try:
            argv = tracing.traced_argv(req.argv) if req.trace else list(req.argv)
            # A traced exec needs the daemon's helper: the tracer attaches to the daemon's child.
            tracer = None
            watch = None if req.trace else self._start_by_init(sb, argv, env, cwd, user, io, io.child_fds())
            if watch is None:
                pid = await self._spawn_exec(sb, argv, env, cwd, user, io.child_fds(), io)
                if req.trace:
                    tracer = await self._start_tracer(pid, timeout)
                watch = ChildWatch(self.loop, pid)
            try:
                result = await io.run(watch, timeout, self.limits["exec_drain_grace_s"])
            except OSError as err:
                raise run_error(err, sb.id, argv[0], cwd) from err
            if tracer is not None:
                result["trace"] = await self.run_blocking(tracing.collect, tracer)
        finally:
            io.close()
            sb.execs -= 1
            sb.last_active = time.monotonic()
            ctx.unregister_exec()
        if not req.stream:
            result["stdout"] = b"".join(collected[1])
            result["stderr"] = b"".join(collected[2])
        return result

    async def _exec_collected(self, sb: Sandbox, argv: list[str], env: dict, cwd: str, user: int,
                              timeout: float | None, ctx) -> dict:
        """An exec whose output comes back whole and that takes no stdin (most
        of them): collected by loop callbacks (dsecd/execio.py Collector), not
        by ExecIO's task per pipe; stdin is the daemon's /dev/null."""
        # kill_grace: the watch's (an exec of our own is waited for however long after its kill).
        run = Collector(self.loop, self.max_exec_output, self.limits["exec_drain_grace_s"], None)
        sb.execs += 1
        ctx.register_exec(run)
        watch = None
        try:
            stdio = (self._devnull, *run.child_ends)
            watch = self._start_by_init(sb, argv, env, cwd, user, run, stdio)
            if watch is None:
                watch = ChildWatch(self.loop, await self._spawn_exec(sb, argv, env, cwd, user, stdio, run))
            # Sent to init, the timeout counts from the send: a start init cannot finish is killed too.
            run.kill_grace = watch.kill_grace
            run.start(watch.exited, watch.kill, timeout)
            try:
                return await run.done
            except OSError as err:
                raise run_error(err, sb.id, argv[0], cwd) from err
        except BaseException:
            # Cancelled (client gone, `cancel`, daemon stopping): the process group goes.
            if watch is not None and not watch.exited.done():
                watch.abandon()
            raise
        finally:
            if watch is not None:
                watch.stop()
            run.close()
            sb.execs -= 1
            sb.last_active = time.monotonic()
            ctx.unregister_exec()

    def _start_by_init(self, sb: Sandbox, argv: list[str], env: list[str], cwd: str, user: int, io,
                       stdio: tuple[int, int, int]) -> InitExec | None:
        """The exec sent to the sandbox's init (dsecd/initlink.py), or None:
        the daemon's helper must start it (no channel: exec_via = helper, a
        sandbox of an older daemon, or one whose init lacks this daemon's
        capabilities; or the channel cannot take this one: too big, init
        busy). `io` owns the child ends in stdio, closed once sent. Whether it
        started shows in its `exited` (a failed start: errors.run_error)."""
        if sb.handle is None:
            return None
        return self.send_to_init(self.backend.start_by_init, sb.handle, argv, env, cwd, user, io, stdio)

    async def _spawn_exec(self, sb: Sandbox, argv: list[str], env: dict, cwd: str, user: int,
                          fds: tuple[int, int, int], io) -> int:
        return await self.spawn_by_helper(io, None, self.backend.spawn, sb.handle, argv, env, cwd, user, fds)

    # The two ways a process starts in a sandbox (or a call sandbox: callops.py),
    # with their argument and start errors as the protocol's.

    def send_to_init(self, start_by_init, handle, argv: list[str], env: list[str], cwd: str, user: int, io,
                     stdio: tuple[int, int, int], what: str = "exec") -> InitExec | None:
        """start_by_init(loop, handle, argv, env, cwd, user, stdio) (a
        backend's): its InitExec, or None when the channel cannot take it.
        `io` owns the child ends in stdio, closed once sent."""
        try:
            started = start_by_init(self.loop, handle, argv, env, cwd, user, stdio)
        except ValueError as err:     # as the helper's argument checks (spawn_by_helper)
            raise BadRequest(f"{what}: {err}") from err
        if started is not None:
            io.close_child_ends()     # sent: init holds them now
        return started

    async def spawn_by_helper(self, io, after_abandoned, spawn, handle, argv: list[str], env: list[str], cwd: str,
                              user: int, fds: tuple[int, int, int], what: str = "exec") -> int:
        """spawn(handle, argv, env, cwd, user, fds) (a backend's) through
        spawn_handed_over: the pid of the daemon's new child."""
        try:
            return await self.spawn_handed_over(io, after_abandoned, spawn, handle, argv, env, cwd, user, fds)
        except NativeError as err:
            raise exec_error(err, argv[0], cwd) from err
        except ValueError as err:       # the native layer's argument checks (sizes, NULs)
            raise BadRequest(f"{what}: {err}") from err

    async def spawn_handed_over(self, io, after_abandoned, spawn, *args) -> int:
        """spawn(*args) -> pid in a worker thread; `io` (ExecIO or Collector)
        owns the child ends passed in args, closed once the spawn returned.

        A request cancelled meanwhile (client gone, `cancel`) must not close
        them while the worker may still hand them to the child: another thread
        could reuse the numbers and the process would write into, say, another
        client's socket. The ends are taken from `io` and closed when the spawn
        is over, a process it made anyway is killed and reaped, and then
        after_abandoned() (if given) runs: what the caller must not release
        before that (a call's uid) is released there."""
        ends: list[int] = []          # filled at a cancel, before the callback can run
        try:
            return await self.run_shielded(functools.partial(self._spawn_abandoned, ends, after_abandoned),
                                           spawn, *args)
        except asyncio.CancelledError:
            ends.extend(io.take_child_ends())
            raise
        finally:
            io.close_child_ends()      # nothing left to close if they were taken

    def _spawn_abandoned(self, ends: list[int], after_abandoned, fut: asyncio.Future) -> None:
        for fd in ends:
            os.close(fd)
        made = not (fut.cancelled() or fut.exception() is not None)
        reaped = kill_and_reap(self.loop, fut.result()) if made else None
        if after_abandoned is None:
            return
        if reaped is None:
            after_abandoned()
        else:
            reaped.add_done_callback(lambda _reaped: after_abandoned())

    async def _start_tracer(self, pid: int, timeout: float | None):
        try:
            return await self.run_blocking(tracing.start_tracer, pid, timeout,
                                           self.cfg.size("limits", "max_trace_bytes"))
        except OSError as err:
            kill_and_reap(self.loop, pid)     # it is stopped, waiting for a tracer that will not come
            raise io_error("start the tracer for", f"pid {pid}", err) from err

    async def op_exec_input(self, req, ctx) -> dict:
        io = ctx.exec_for(req.exec_id)
        if io is None:
            raise NotFound(f"no running exec with id {req.exec_id} on this connection")
        if not io.takes_stdin:
            raise Conflict(f"exec {req.exec_id} was started without stdin")
        await io.feed_stdin(req.data, req.eof)
        return {}

    # ------------------------------------------------------------ ops: files

    async def _file_op(self, req, verb: str, fn, *args):
        sb = self._get(req.sandbox, req)
        await self.ensure_running(sb, f"file {verb}")
        try:
            return await self.run_blocking(userns.file_op, userns.IdMap.from_record(sb.idmap), fn,
                                           sb.handle.rootfd, *args)
        except sbfiles.PathError as err:
            raise BadRequest(str(err), {"path": req.path}) from err
        except OSError as err:
            raise io_error(verb, f"{sb.id}:{req.path}", err) from err

    async def op_file_read(self, req, ctx) -> dict:
        chunk = self.cfg.size("limits", "max_file_chunk_bytes")
        length = chunk if req.length is None else req.length
        if not 0 <= length <= chunk or req.offset < 0:
            raise LimitExceeded(f"file_read length must be in [0, {chunk}] and offset >= 0; read in chunks",
                                {"max_file_chunk_bytes": chunk})
        return await self._file_op(req, "read", sbfiles.read_file, req.path, req.offset, length)

    async def op_file_write(self, req, ctx) -> dict:
        chunk = self.cfg.size("limits", "max_file_chunk_bytes")
        if len(req.data) > chunk:
            raise LimitExceeded(f"file_write data of {len(req.data)} bytes exceeds {chunk}; write in chunks "
                                "with append=true", {"max_file_chunk_bytes": chunk})
        if not 0 <= req.mode <= 0o7777:
            raise BadRequest(f"mode must be in [0, 0o7777], got {req.mode:o}")
        return await self._file_op(req, "write", sbfiles.write_file, req.path, req.data, req.append,
                                   req.mode, req.parents)

    async def op_file_list(self, req, ctx) -> dict:
        return await self._file_op(req, "list", sbfiles.list_dir, req.path)

    async def op_file_stat(self, req, ctx) -> dict:
        return await self._file_op(req, "stat", sbfiles.stat_path, req.path)

    # ------------------------------------------------------------ counters for tests and bench

    def resource_counts(self) -> dict:
        return {"sandboxes": len(self.sandboxes),
                "cgroups": cgroup.count_groups(self.layout, self.sb_defaults["cgroup_root"]),
                "dirs": len(os.listdir(Path(self.cfg.state_dir) / "sandboxes"))}


def _labels_match(sb: Sandbox, labels: dict) -> bool:
    return all(sb.labels.get(k) == v for k, v in labels.items())


def _check_env(env: dict) -> None:
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise BadRequest(f"bad environment variable name or value: {k!r}")


def _check_process(req) -> None:
    """A create's settings of the sandbox's processes (env, cwd, user)."""
    _check_env(req.env)
    if not req.cwd.startswith("/"):
        raise BadRequest(f"cwd must be absolute, got {req.cwd!r}")
    if not 0 <= req.user < 2**32 - 1:
        raise BadRequest(f"user must be a uid in [0, 2^32-1), got {req.user}")


# Waits before retrying an exec that failed with ETXTBSY (op_exec).
ETXTBSY_RETRY_S = (0.002, 0.01, 0.03, 0.1)

