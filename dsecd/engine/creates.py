"""Creates: idempotency keys, burst admission, warm pools, and the create
itself (create_now). `create` here, in order:

1. **key**: a create with an idempotency key that was seen before answers
   with the same sandbox (or waits for the create still making it, and
   makes it itself if that one is cancelled); the key is journaled with the
   sandbox, so this holds across a daemon restart. A key is free again once
   its sandbox is destroyed or its create failed. A key stands for one
   create: given again with other arguments (another image, shape, env...)
   it is a conflict, not the first one's sandbox.
2. **warm pool**: a create that matches a pool's (image, shape) takes one of
   its ready sandboxes: labels, env, cwd, user, TTLs, lease and key are set
   on it, and it is out of the pool for good (never handed out twice).
3. **full host**: live sandboxes + queued creates at `limits.max_sandboxes`
   is `busy` at once, with `retry_after_s`.
4. **queue**: dsecd/admission.py, bounded and fair across jobs.

What a sandbox's processes get by default (env, cwd, uid and gid) is its
image's config under the create's: `process_settings`, for a fresh sandbox
and a pooled one alike. A create runs no command: the image's Entrypoint
and Cmd are what `dsec run` (the SDK's Client.run) starts in an exec.

A **drained** host (`drain`, `dsec drain`) refuses every `create` that would
make a sandbox, pooled or not, with `busy` naming the drain, and refills no
pool, until `undrain`; a keyed create whose sandbox exists still gets it,
and the sandboxes already there run on. A Dockerfile build's steps
(`create_of`) are not refused: their sandboxes go with the build. The drain is kept in
`<state_dir>/drain.json`, so it holds across restarts.

Pools (`pool_set`, `pool_ls`) are kept in `<state_dir>/pools.json`; their
sandboxes are ordinary journaled sandboxes labelled `dsec.pool=<pool>`,
re-adopted after a restart like any other, and count against capacity. A
refiller tops each pool up to its target at `pool.refill_per_s` overall,
through the same create queue (as job `dsec.pool`), so user bursts keep
their share.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

from .. import cgroup, doing, imageconfig, protocol, userns
from ..admission import CreateQueue
from ..backends.microvm.backend import upper_cap, upper_inodes
from ..config import ConfigError, parse_duration, parse_size, size_texts
from ..cpu import qos
from ..cpu.manager import CpuHost
from ..errors import (
    BadRequest,
    Busy,
    Conflict,
    DsecError,
    NotFound,
    Unsupported,
    image_error,
    io_error,
)
from ..fs import files as sbfiles
from ..fs import upper as upperfs
from ..fs import users
from ..fs.images import Image, ImageError
from ..fs.layers import overlay_lowerdirs
from ..native import HOSTNAME_MAX, NativeError
from ..steps import AsyncSteps
from .execs import check_env, mapped_groups, sandbox_identity
from .idranges import IdRanges
from .images import ImageService, check_platform
from .lifecycle import LifecycleService
from .memory import MemoryService
from .microvms import MicroVMService
from .network import NetworkService
from .opkeys import args_digest
from .sandboxes import Sandbox, SandboxRegistry, in_root
from .vmfiles import VmFiles
from .workers import Workers, to_the_end

log = logging.getLogger(__name__)

# Undo steps of a create that other steps refer to by name (AsyncSteps).
UNDO_IDS = "release its id range"
UNDO_LAYERS = "release its layers"
UNDO_NETNS = "release the pooled netns"

HOSTNAME_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")      # fullmatch: RFC 1123

POOL_LABEL = "dsec.pool"
POOL_JOB = "dsec.pool"
# In the state dir while the host is drained: {"reason", "since"}.
DRAIN_FILE = "drain.json"
# Longest drain reason: it is repeated in every create a drained host refuses.
DRAIN_REASON_MAX = 256
# retry_after_s of a create a drained host refuses: a drain lasts as long as
# the operator's work on the host, and a fleet places the create elsewhere.
DRAIN_RETRY_AFTER_S = 60.0
BUILD_LABEL = "dsec.build"       # on every build sandbox (engine/builds.py): the image being built


# How often a create drops idle call sandboxes for room that others took
# before it was back (CreateService._room), before it is refused.
RECLAIM_TRIES = 3

REFILL_BACKOFF_MIN_S = 1.0
REFILL_BACKOFF_MAX_S = 60.0


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
    error_is_busy: bool = False  # `error` says the host was full: gone once the pool no longer waits
    # Monotonic times of the matching creates (its demand), taken from it or not.
    takes: deque = field(default_factory=lambda: deque(maxlen=4096))
    image_changes: int = 0       # how often its image name was rebuilt or removed (this daemon)
    # After a refill failed for a reason that is no full host (its image gone):
    # no refill before retry_at (monotonic), backing off 1 s, 2 s ... 60 s.
    backoff: float = 0.0
    retry_at: float = 0.0

    def refill_failed(self) -> None:
        """A refill failed: the next waits twice as long as the last wait.
        The other refills of the same round failing count once."""
        now = time.monotonic()
        if now >= self.retry_at:
            self.backoff = min(max(2 * self.backoff, REFILL_BACKOFF_MIN_S), REFILL_BACKOFF_MAX_S)
            self.retry_at = now + self.backoff

    def refill_may_work(self) -> None:
        """A refill worked, or its image changed: refills go on at once."""
        self.backoff = self.retry_at = 0.0

    def target(self, window: float) -> int:
        """min, plus the matching creates of the last `window` seconds (demand), up to max."""
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


@dataclass(frozen=True)
class ProcessSettings:
    """What a sandbox's processes get unless an exec says otherwise."""

    env: dict[str, str]
    cwd: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def apply(self, sb: Sandbox) -> None:
        sb.env, sb.cwd, sb.user, sb.gid = dict(self.env), self.cwd, self.uid, self.gid
        sb.groups = list(self.groups)


def check_hostname(name: str) -> None:
    """A sandbox's hostname: an RFC 1123 host name (labels of 1-63 letters,
    digits and hyphens, not starting or ending with a hyphen, joined by
    dots) of at most HOSTNAME_MAX bytes, the kernel's UTS limit. The
    default, sb-<id>, is one."""
    labels = name.split(".")
    if len(name) > HOSTNAME_MAX or not all(HOSTNAME_LABEL.fullmatch(label) for label in labels):
        raise BadRequest(f"hostname {name!r} is not a host name: it takes 1 to {HOSTNAME_MAX} characters in "
                         "dot-separated labels of 1 to 63 letters, digits and hyphens, each starting and "
                         "ending with a letter or digit (e.g. web-1 or db.internal)", {"hostname": name})


def pool_name(image: str, cpu: float, memory: int) -> str:
    """`image` in its canonical form (ImageStore.key): `python:3.11` and
    `docker.io/library/python:3.11` are one pool. The shape is exact (memory
    in bytes when not whole MiB): a create takes from the pool of its name."""
    mem = f"{memory >> 20}M" if memory % (1 << 20) == 0 else f"{memory}B"
    return f"{image}@{cpu:.15g}cpu-{mem}"


class CreateService:
    """`create`, `pool_set`, `pool_list`, `drain`, `undrain`. `disk_default` is
    sandbox.disk, the writable layer's cap when a create names none."""

    drained: dict | None = None         # {"reason", "since"} while the host is drained
    _drain_lock: asyncio.Lock | None = None

    def __init__(self, cfg, registry: SandboxRegistry, workers: Workers, backend, images: ImageService,
                 net: NetworkService, memory: MemoryService, cpu: CpuHost, id_ranges: IdRanges,
                 lifecycle: LifecycleService, disk_default: int, policy_for_create,
                 vms: MicroVMService | None = None, vm_files: VmFiles | None = None):
        # policies.for_create: a create's `policy` as the sandbox records it (dsecd/engine/policies.py)
        self.policy_for_create = policy_for_create
        self.sb_defaults = cfg.section("sandbox")
        self.limits = cfg.section("limits")
        self.registry = registry
        self.workers = workers
        self.backend = backend
        self.image_service = images
        self.net = net
        self.memory = memory
        self.cpu = cpu
        self.id_ranges = id_ranges
        self.lifecycle = lifecycle
        self.disk_default = disk_default
        self.vms = vms
        self.vm_files = vm_files        # a microVM's image files: its user's ids, its cwd
        try:
            self.default_ttl = parse_duration(self.sb_defaults["default_ttl"] or None, "sandbox.default_ttl")
        except BadRequest as err:
            raise ConfigError(err.message) from err
        a = cfg.section("admission")
        self.admission = CreateQueue(a["max_active_creates"], a["max_queued_creates"])
        self.adm_cfg = a
        self.pool_cfg = cfg.section("pool")
        self.pools: dict[str, Pool] = {}
        self._pools_path = cfg.state_dir / "pools.json"
        self._drain_path = cfg.state_dir / DRAIN_FILE
        self._pool_task: asyncio.Task | None = None
        self._refills: set[asyncio.Task] = set()
        # key -> args_digest of the create under way that took it.
        self._key_args_creating: dict[str, str] = {}
        # Set by whoever builds the services (dsecd/node.py: CallService.drop_idle_for_create):
        # async (enough, drop, purpose) -> bool, dropping idle call sandboxes
        # for a create or call sandbox the host has no room for (_room). None:
        # none are dropped.
        self.reclaim_idle_calls = None
        if images is not None:
            images.images.changed.append(self._image_changed)

    async def start(self) -> None:
        """After the journal was re-adopted: keys and pool membership from the records."""
        self.drained = await self.workers.run(self._read_drain)
        if self.drained is not None:
            log.warning("host is drained (since %s%s): creates are refused until `dsec undrain`",
                        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.drained["since"])),
                        f": {self.drained['reason']}" if self.drained["reason"] else "",
                        extra={"fields": {"event": "drained", **self.drained}})
        for sb in self.registry.by_id.values():
            if sb.key:
                self.registry.keys[sb.key] = sb.id
        try:
            saved = json.loads(self._pools_path.read_text())
        except FileNotFoundError:
            saved = {}
        except ValueError as err:
            log.error("ignoring unreadable %s: %s", self._pools_path, err)
            saved = {}
        for conf in saved.values():
            # Named as its shape is named now (an older daemon cut memory to
            # whole MiB): creates find a pool by that name. Ready sandboxes
            # labelled with another name go below, and are made again.
            name = pool_name(self.image_service.images.key(conf["image"]), conf["cpu"], conf["memory"])
            self.pools[name] = Pool(name=name, **conf)
        if set(saved) != set(self.pools):
            try:
                self._save_pools()      # under the names they go by now
            except OSError as err:      # the next start names them so again: no reason not to start
                log.warning("cannot save the pools under their new names in %s: %s; it keeps the old ones "
                            "until a pool is set", self._pools_path, err)
        now_named: dict[str, str | None] = {}       # pool name -> the manifest its image names now
        for sb in sorted(self.registry.by_id.values(), key=lambda s: s.created):
            name = sb.labels.get(POOL_LABEL)
            if name is None:
                continue
            if sb.state != "running":
                # One whose init went (the host rebooted) goes: kept, it would
                # hold its journal record and id range for good.
                self._drop_if_dead(sb)
                continue
            pool = self.pools.get(name)
            if pool is not None and name not in now_named:
                now_named[name] = await self.workers.run(self._manifest_named, pool.image)
            if pool is not None and now_named[name] == sb.manifest:
                pool.ready.append(sb.id)
            else:
                # Its pool was removed, or its image name stands for another
                # manifest (rebuilt, pulled anew) since it was made, as
                # _image_changed would have found had the daemon run.
                self.workers.loop.create_task(self._destroy_quiet(sb))
        self._pool_task = self.workers.loop.create_task(self._refill_loop())

    def _manifest_named(self, image: str) -> str | None:
        """Blocking: the manifest `image` names now; None if none (removed,
        or its ref unreadable: its pool's spares go, new ones say why)."""
        try:
            return self.image_service.images.get(image).manifest
        except ImageError:
            return None
        except (OSError, ValueError) as err:
            log.error("pool image %s: %s", image, err)
            return None

    def close(self) -> None:
        for task in (self._pool_task, *self._refills):
            if task:
                task.cancel()

    def info(self) -> dict:
        return {**self.admission.info(), "keys": len(self.registry.keys), "drain": self.drain_info(),
                "pools": {n: {"ready": len(p.ready), "creating": p.creating, "taken": p.taken}
                          for n, p in self.pools.items()}}

    # ------------------------------------------------------------ create

    async def create(self, req, ctx) -> dict:
        if req.key is not None and not 1 <= len(req.key) <= 256:
            raise BadRequest("key must be 1 to 256 characters")
        if req.labels.get(POOL_LABEL) is not None:
            raise BadRequest(f"label {POOL_LABEL} is reserved for warm pools")
        if req.labels.get(BUILD_LABEL) is not None:
            raise BadRequest(f"label {BUILD_LABEL} is reserved for the sandboxes of Dockerfile builds")
        if not req.key:
            self._refuse_if_drained()
            return await self._create_admitted(req)
        keys = self.registry.keys
        while isinstance(known := keys.get(req.key), asyncio.Future):
            self._same_create(req, self._key_args_creating.get(req.key), "a create under way")
            result = await asyncio.shield(known)
            if result is not None:
                return {**result, "existing": True}
            # That create was cancelled (its caller gave up) and made nothing:
            # this one, often the caller's retry, makes the sandbox itself.
        if isinstance(known, str) and known in self.registry.by_id:
            sb = self.registry.by_id[known]
            self._same_create(req, sb.key_args, f"sandbox {sb.id}, of image {sb.image}")
            if sb.state == "stopping":
                # Not the caller's to have: it is about to go, and the key
                # with it; a retry then makes a new sandbox.
                raise Busy(f"idempotency key {req.key!r} names sandbox {sb.id}, which is being destroyed; "
                           "retry once it is gone: the key is free then",
                           {"key": req.key, "sandbox": sb.id,
                            "retry_after_s": self.adm_cfg["full_retry_after_s"]})
            return {**sb.public(), "existing": True}
        self._refuse_if_drained()
        fut = self.workers.loop.create_future()
        keys[req.key] = fut
        self._key_args_creating[req.key] = args_digest(req)
        try:
            result = await self._create_admitted(req)
        except BaseException as err:
            keys.pop(req.key, None)
            self._key_args_creating.pop(req.key, None)
            if isinstance(err, Exception):
                fut.set_exception(err)
                fut.exception()      # retrieved: nobody else may be waiting
            else:
                fut.set_result(None)
            raise
        keys[req.key] = result["id"]
        self._key_args_creating.pop(req.key, None)
        fut.set_result(result)
        return result

    @staticmethod
    def _same_create(req, key_args: str | None, first: str) -> None:
        """Conflict if `req` reuses its key with other arguments than the
        create that took it (`first`, for the message). A sandbox of an
        older daemon's create has no digest: taken as the same."""
        if key_args is not None and key_args != args_digest(req):
            raise Conflict(f"create: key {req.key!r} was given to a create of other arguments ({first}); a key "
                           "stands for one create: give the same arguments to get its sandbox, or another key",
                           {"key": req.key})

    async def create_of(self, req, image: Image) -> dict:
        """A create from an image that may have no name (a Dockerfile build's
        step: the image so far), through the create queue like any create but
        never from a warm pool; `req.image` is only what listings show."""
        return await self._create_admitted(req, image)

    async def _create_admitted(self, req, image: Image | None = None) -> dict:
        job = req.labels.get("job")
        if not job:
            return await self._create_admitted_now(req, image)
        create = self.registry.job_create_begun(job)
        try:
            result = await self._create_admitted_now(req, image)
            # Once made, to the end: a job op's sandbox left running would
            # not be what the job's op said it made of all of them.
            return await to_the_end(self._join_job_ops(result, job, create))
        finally:
            self.registry.job_create_ended(job, create)

    async def _join_job_ops(self, result: dict, job: str, create) -> dict:
        """A create's sandbox of `job` made: the job ops begun while the
        create ran (their lists of the job's sandboxes could not hold it)
        applied to it, the last one's state its answer's. A job_rm
        destroys it, and the create fails: the caller's job is gone."""
        sb = self.registry.by_id.get(result["id"])
        while sb is not None and (op := create.take()) is not None:
            if op == "rm":
                if self.registry.listed(sb) and sb.state != "stopping":
                    await self.lifecycle.destroy_sandbox(sb, True, reason="job")
                raise Conflict(f"create: job {job} was removed (job_rm) while this create ran; its sandbox "
                               f"{sb.id} was destroyed with the job's others", {"job": job, "sandbox": sb.id})
            try:
                await self.memory.join_job_op(sb, op)
            except DsecError as err:
                log.warning("sandbox %s, created during a job %s of job %s, not %sd: %s", sb.id, op, job, op, err)
        return result if sb is None else {**result, **sb.public()}

    async def _create_admitted_now(self, req, image: Image | None = None) -> dict:
        if req.hostname:                      # "" is the default, as None
            check_hostname(req.hostname)
        limits = self._limits_for(req)        # a bad request fails before it queues
        self.policy_for_create(req.policy)
        taken = None if image is not None else await self._take_from_pool(req, limits)
        if taken is not None:
            return taken
        queue = self.admission
        # Not dropped yet: the create may still fail its checks (create_now,
        # which drops them once the sandbox is about to be made).
        full = await self._room(lambda gone: self._full_with_queued(len(gone)), drop=False)
        if full is not None:
            raise queue.reject(*full)
        async with queue.slot(req.labels.get("job", "")) as waited:
            try:
                result = await self.create_now(req, None, image)
            except Busy as err:         # CPU/memory admission, or full after the wait
                err.detail.setdefault("retry_after_s", self.adm_cfg["full_retry_after_s"])
                raise
        result["queued_ms"] = round(waited * 1000, 3)
        return result

    # ------------------------------------------------------------ drain

    def drain_info(self) -> dict:
        d = self.drained
        return {"drained": d is not None, "reason": d["reason"] if d else None, "since": d["since"] if d else None}

    def _refuse_if_drained(self) -> None:
        if self.drained is not None:
            raise self._drained_error()

    def _drained_error(self) -> Busy:
        d = self.drained
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(d["since"]))
        return Busy(f"host is drained (since {since}" + (f": {d['reason']}" if d["reason"] else "")
                   + "): it makes no new sandboxes; create on another host, or `dsec undrain` it",
                   {"drained": True, "reason": d["reason"], "since": d["since"],
                    "retry_after_s": DRAIN_RETRY_AFTER_S})

    def _read_drain(self) -> dict | None:
        """Blocking: the drain the state dir holds, None if the host is not
        drained. A file that cannot be read, or holds no start (a number
        of seconds since 1970), still drains it, since now: the operator
        asked for that, and an undrain removes the file. A start ahead of
        now (the clock was set back, or the file damaged) is taken as now:
        time.gmtime, which says it in every refusal, takes no such number."""
        try:
            data = self._drain_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            log.error("cannot read %s: %s; the host stays drained until `dsec undrain`", self._drain_path, err)
            return {"reason": f"{DRAIN_FILE} unreadable: {err.strerror}", "since": time.time()}
        now = time.time()
        try:
            d = json.loads(data.decode())
            since = float(d["since"])
            if not since >= 0:         # NaN too
                raise ValueError(f"since {since!r} is no time since 1970")
            reason = d.get("reason") or ""
            if not isinstance(reason, str) or len(reason) > DRAIN_REASON_MAX or not reason.isprintable():
                # Said in dsec info and every refusal: only one a drain could take.
                log.error("%s: its reason is no line of at most %d printable characters; the host stays "
                          "drained until `dsec undrain`", self._drain_path, DRAIN_REASON_MAX)
                reason = f"{DRAIN_FILE} unreadable"
            return {"reason": reason, "since": min(since, now)}
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as err:
            log.error("unreadable %s: %s; the host stays drained until `dsec undrain`", self._drain_path, err)
            return {"reason": f"{DRAIN_FILE} unreadable", "since": now}

    def _write_drain(self, d: dict | None) -> None:
        """Blocking: record the drain (None: remove it), atomically and
        durably: the rename (or removal) is synced with its directory."""
        directory = self._drain_path.parent
        if d is None:
            try:
                os.unlink(self._drain_path)
            except FileNotFoundError:
                return
        else:
            fd, tmp = tempfile.mkstemp(prefix=f".{DRAIN_FILE}.", suffix=".tmp", dir=directory)
            try:
                with open(fd, "w") as f:
                    json.dump(d, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._drain_path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _drain_lock_now(self) -> asyncio.Lock:
        """The lock drain and undrain hold across writing the file and
        setting `drained` (to_the_end's), so that they take turns and the
        file says what the host does. Made at first use, on the loop's
        thread."""
        if self._drain_lock is None:
            self._drain_lock = asyncio.Lock()
        return self._drain_lock

    async def drain(self, req, ctx) -> dict:
        """Refuse new creates and pool refills until undrain; saved first, so
        that a drain the daemon answered holds across a restart. Draining a
        drained host keeps its `since` and takes the new reason, if any."""
        if len(req.reason) > DRAIN_REASON_MAX or not req.reason.isprintable():
            raise BadRequest(f"reason must be at most {DRAIN_REASON_MAX} printable characters (it is said in "
                             f"every create the drain refuses), got {len(req.reason)}", {"reason": req.reason[:64]})
        # To the end once begun, as undrain: a caller gone while the file is
        # written must not leave the host doing other than the file says.
        return await to_the_end(self._drain(req.reason), locks=(self._drain_lock_now(),))

    async def _drain(self, reason: str) -> dict:
        d = {"reason": reason or (self.drained or {}).get("reason") or "",
             "since": self.drained["since"] if self.drained else time.time()}
        try:
            await self.workers.run(self._write_drain, d)
        except OSError as err:
            raise io_error("write", str(self._drain_path), err) from err
        first = self.drained is None
        self.drained = d
        log.info("host drained: creates refused until `dsec undrain`" + (f" ({d['reason']})" if d["reason"] else ""),
                 extra={"fields": {"event": "drained", "reason": d["reason"], "first": first}})
        return self.drain_info()

    async def undrain(self, req, ctx) -> dict:
        return await to_the_end(self._undrain(), locks=(self._drain_lock_now(),))

    async def _undrain(self) -> dict:
        try:
            await self.workers.run(self._write_drain, None)
        except OSError as err:
            raise io_error("remove", str(self._drain_path), err) from err
        if self.drained is not None:
            log.info("host undrained: creates taken again", extra={"fields": {"event": "undrained"}})
        self.drained = None
        return self.drain_info()

    # ------------------------------------------------------------ warm pools

    def _pool_match(self, req, limits) -> Pool | None:
        if (self._backend_of(req) != "container" or req.pids is not None or req.cpu_quota is not None or req.hostname is not None or req.allow
                or req.publish or req.disk is not None
                or (req.qos or self.cpu.cfg["default_qos"]) != self.cpu.cfg["default_qos"]
                or (req.net or self.net.net_cfg["default_mode"]) != self.net.net_cfg["default_mode"]):
            return None
        return self.pools.get(pool_name(self.image_service.images.key(req.image), limits.cpu,
                                        limits.memory_bytes))

    async def _take_from_pool(self, req, limits) -> dict | None:
        pool = self._pool_match(req, limits)
        if pool is None:
            return None
        self.check_process(req)
        ttl, idle_ttl = self._ttl(req), parse_duration(req.idle_ttl, "idle_ttl")
        lease = parse_duration(req.lease, "lease")
        # Demand, served from the pool or not: else a pool with min 0 would never fill.
        pool.takes.append(time.monotonic())
        while pool.ready:
            sb = self.registry.by_id.get(pool.ready.popleft())
            if sb is None or sb.state != "running" or sb.labels.get(POOL_LABEL) != pool.name:
                self._drop_if_dead(sb)
                continue
            try:
                settings = await self.process_settings(sb, await self._config_of(sb), req)
            except BaseException:
                self._return_to_pool(pool, sb)
                raise
            if sb.state != "running" or sb.id not in self.registry.by_id:     # gone while we checked
                continue
            # Out of the pool for good: the label goes, the caller's settings come.
            sb.labels = dict(req.labels)
            settings.apply(sb)
            sb.ttl, sb.idle_ttl, sb.lease, sb.key = ttl, idle_ttl, lease, req.key
            sb.key_args = args_digest(req) if req.key else None
            sb.policy = self.policy_for_create(req.policy)
            sb.created = time.time()
            sb.last_active = time.monotonic()
            sb.lease_deadline = sb.last_active + lease if lease else None
            try:
                self.registry.save(sb)
            except OSError as err:
                # Its record still says pool spare: it goes, rather than run
                # as the caller's with a record a restart would hand out again.
                self.workers.loop.create_task(self._destroy_quiet(sb))
                raise io_error("write the journal record of", f"sandbox {sb.id}", err) from err
            pool.taken += 1
            return {**sb.public(), "pool": pool.name}
        return None

    def _return_to_pool(self, pool: Pool, sb) -> None:
        """A sandbox taken out of `pool` but not handed out goes back, if the
        pool still exists and has room (it may have been removed or shrunk
        meanwhile); else it goes."""
        if self.pools.get(pool.name) is pool and len(pool.ready) < pool.max:
            pool.ready.appendleft(sb.id)
        else:
            self.workers.loop.create_task(self._destroy_quiet(sb))

    async def pool_set(self, req, ctx) -> dict:
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
            await self.workers.run(self.image_service.images.get, req.image)
        except Exception as err:
            raise NotFound(f"no image {req.image!r}", {"image": req.image}) from err
        name = pool_name(self.image_service.images.key(req.image), cpu, memory)
        pool = self.pools.get(name)
        if pool is None and req.max == 0:
            shapes = [p.name for p in self.pools.values() if p.image == req.image]
            raise NotFound(f"no pool {name} to remove: a pool is named by its image, cpu and memory"
                           + (f"; {req.image} has {', '.join(shapes)} (give the cpu and memory of the one to "
                              "remove)" if shapes else f"; {req.image} has none"),
                           {"pool": name, "pools": shapes})
        if pool is None:
            pool = self.pools[name] = Pool(name=name, image=req.image, cpu=cpu, memory=memory,
                                           min=req.min, max=req.max)
        pool.min, pool.max, pool.error = req.min, req.max, None
        pool.refill_may_work()              # set again: tried again now
        self._save_pools()
        # Shrink now: ready sandboxes past max go (a pool with max 0 is removed).
        while len(pool.ready) > pool.max:
            sb = self.registry.by_id.get(pool.ready.pop())
            if sb is not None:
                self.workers.loop.create_task(self._destroy_quiet(sb))
        if pool.max == 0:
            del self.pools[name]
            self._save_pools()
            return {**pool.public(self.pool_cfg["demand_window_s"]), "removed": True}
        return pool.public(self.pool_cfg["demand_window_s"])

    async def pool_list(self, req, ctx) -> dict:
        return {"pools": [p.public(self.pool_cfg["demand_window_s"]) for p in self.pools.values()]}

    def _save_pools(self) -> None:
        tmp = self._pools_path.with_name(".pools.json.tmp")
        tmp.write_text(json.dumps({n: p.config() for n, p in self.pools.items() if p.max > 0}))
        os.replace(tmp, self._pools_path)

    def _prune(self, pool: Pool) -> None:
        """Ready spares that are no longer (one whose init died, one paused or
        destroyed by hand) leave `ready`, so they are neither counted there
        nor handed out, and the refiller replaces them; dead ones go."""
        gone = [i for i in pool.ready if (s := self.registry.by_id.get(i)) is None or s.state != "running"]
        for sb_id in gone:
            pool.ready.remove(sb_id)
            self._drop_if_dead(self.registry.by_id.get(sb_id))

    def _drop_if_dead(self, sb) -> None:
        """Destroy a pool spare that died (no client ever held it)."""
        if sb is not None and sb.state == "dead" and POOL_LABEL in sb.labels:
            self.workers.loop.create_task(self._destroy_quiet(sb))

    async def _destroy_quiet(self, sb) -> None:
        try:
            await self.lifecycle.destroy_sandbox(sb, True, reason="pool")
        except DsecError as err:
            log.warning("destroy pool sandbox %s: %s", sb.id, err)

    async def _refill_loop(self) -> None:
        interval = self.pool_cfg["refill_interval_s"]
        budget = 0.0
        while True:
            await asyncio.sleep(interval)
            budget = min(budget + self.pool_cfg["refill_per_s"] * interval, self.pool_cfg["refill_per_s"])
            for pool in list(self.pools.values()):
                self._prune(pool)           # drained too: what pool ls counts must be there
                if self.drained is not None:    # a drained host makes no sandboxes, spares neither
                    if pool.target(self.pool_cfg["demand_window_s"]) > len(pool.ready) + pool.creating:
                        pool.error = f"not refilled: {self._drained_error().message}"
                        pool.error_is_busy = True
                    continue
                if pool.retry_at > time.monotonic():       # failing: not 20 failed creates a second
                    continue
                need = pool.target(self.pool_cfg["demand_window_s"]) - len(pool.ready) - pool.creating
                if need <= 0 and pool.error_is_busy:      # full or not, it no longer waits for room
                    pool.error, pool.error_is_busy = None, False
                while need > 0 and budget >= 1 and self.admission.queued < self.admission.max_queued // 2:
                    need -= 1
                    budget -= 1
                    pool.creating += 1
                    task = self.workers.loop.create_task(self._refill_one(pool))
                    self._refills.add(task)
                    task.add_done_callback(self._refills.discard)

    def _image_changed(self, key: str) -> None:
        """An image name now stands for another manifest, or none (from the
        thread that changed it): the ready sandboxes of its pools, made of
        what it named before, go, and so do the refills under way; the
        refiller makes new ones of what it names now."""
        def drop_stale() -> None:
            for pool in self.pools.values():
                if self.image_service.images.key(pool.image) != key:
                    continue
                pool.image_changes += 1
                pool.refill_may_work()          # a missing image may be there now
                while pool.ready:
                    sb = self.registry.by_id.get(pool.ready.popleft())
                    if sb is not None:
                        self.workers.loop.create_task(self._destroy_quiet(sb))

        self.workers.loop.call_soon_threadsafe(drop_stale)

    async def _refill_one(self, pool: Pool) -> None:
        # Containers whatever sandbox.backend says: only a container create takes from a pool.
        req = protocol.Create(image=pool.image, cpu=pool.cpu, memory=pool.memory, backend="container",
                              labels={POOL_LABEL: pool.name})
        image_changes = pool.image_changes
        try:
            async with self.admission.slot(POOL_JOB):
                self._refuse_if_drained()       # drained while this refill waited for its slot
                # A spare is made ahead of any create: it waits for room,
                # and drops no call sandbox between its calls for it.
                result = await self.create_now(req, None, drop_idle_calls=False)
        except Busy as err:
            pool.error, pool.error_is_busy = str(err), True   # full: the next round tries again; `pool ls` says why
            return
        except DsecError as err:
            pool.failed += 1
            pool.refill_failed()
            if pool.error != str(err):
                log.error("refill pool %s: %s; trying again in %.0fs", pool.name, err, pool.backoff)
            pool.error, pool.error_is_busy = str(err), False
            return
        finally:
            pool.creating -= 1
        pool.created += 1
        pool.refill_may_work()
        pool.error, pool.error_is_busy = None, False      # what failed before (its image gone, say) no longer does
        if self.pools.get(pool.name) is pool and len(pool.ready) < pool.max and pool.image_changes == image_changes:
            pool.ready.append(result["id"])
        else:
            sb = self.registry.by_id.get(result["id"])
            if sb is not None:
                await self._destroy_quiet(sb)

    # ------------------------------------------------------------ the create itself

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

    def _backend_of(self, req) -> str:
        backend = req.backend or self.sb_defaults["backend"]
        if backend not in ("container", "microvm"):
            raise BadRequest(f"backend must be container or microvm, got {backend!r}")
        return backend

    def _disk_size(self, req) -> int:
        """The writable layer's size a create asks for (`disk`), else the default."""
        try:
            size = self.disk_default if req.disk is None else parse_size(req.disk)
        except ConfigError as err:
            raise BadRequest(f"disk: {err}") from err
        if not 1 << 20 <= size <= 1 << 50:
            # In the units parse_size takes: it has no P.
            raise BadRequest(f"disk must be between 1M and 1024T, got {size_texts(size, 1 << 20, 1 << 50)[0]}")
        return size

    def _vm_disk_for(self, req, memory: int) -> int:
        """A microVM's writable layer: a tmpfs in the guest, capped at this:
        `disk`, and at most half the guest's room (upper_cap says why). The
        record (inspect) holds the cap the guest really has."""
        size = self._disk_size(req)
        return min(size, upper_cap(memory))

    def _disk_for(self, req) -> upperfs.Cap | None:
        """The writable layer's cap, or None where layers are uncapped dirs."""
        if self.backend.upper_mode != "tmpfs":
            if req.disk is not None:
                raise Unsupported("this host cannot cap the writable layer (see `dsec info`, "
                                  "feature upperfs); create without `disk`")
            return None
        size = self._disk_size(req)
        return upperfs.Cap(size, self.sb_defaults["disk_inodes"])

    def _refusal(self, cpu: float, memory: int, ls: bool, gone: tuple[str, ...] = (),
                 count_queued: bool = True) -> Busy | None:
        """Why a sandbox of `cpu` and `memory` is not admitted now (None: it
        is): the host is full (limits.max_sandboxes; with `count_queued`, the
        creates queued for a slot count too, as for anything that does not
        hold one), or its CPU or memory would pass the host's capacity with
        it (`ls`: an LS sandbox, under the rule on recent load). `gone`: as
        if the call sandboxes of these ids were destroyed."""
        full = self._full_with_queued(len(gone), count_queued)
        if full is not None:
            return Busy(*full)
        try:
            self.cpu.admit(self.registry.requested(gone), cpu, memory, ls=ls)
        except Busy as err:
            err.detail.setdefault("retry_after_s", self.adm_cfg["full_retry_after_s"])
            return err
        return None

    async def _room(self, refusal, drop: bool = True, purpose: str = "create"):
        """`refusal(gone)`: why the host has no room for a create were the
        call sandboxes of ids `gone` destroyed (None: it has room). Where it
        has none now but idle call sandboxes hold what is missing, the least
        recently used of them go, as few as make the room, and the create
        waits until they are destroyed (reclaim_idle_calls); tried again
        while that drops some, since a create or call may take the room
        freed before this one is back. What refuses the create then, or
        None. Without `drop`, None where dropping them would make the room,
        and none goes. The call sandboxes are only looked at on a host with
        no room. `purpose`: what the room is for ("create", or "call" for a
        new call sandbox), as the drops are counted."""
        why = refusal(())
        for _ in range(RECLAIM_TRIES):
            if why is None or self.reclaim_idle_calls is None or not self.registry.requested().call_sandboxes:
                break
            if not await self.reclaim_idle_calls(lambda ids: refusal(tuple(ids)) is None, drop, purpose):
                break
            if not drop:
                return None
            why = refusal(())
        return why

    def _full_with_queued(self, gone: int = 0, count_queued: bool = True) -> tuple[str, dict] | None:
        """(message, detail) of `busy` when the live sandboxes, and the creates
        queued for a slot unless not `count_queued` (a create that holds its
        slot), reach limits.max_sandboxes, else None; `gone`: as if that many
        call sandboxes were destroyed."""
        live, cap = self.registry.live_count() - gone, self.limits["max_sandboxes"]
        queued = self.admission.queued if count_queued else 0
        if live + queued < cap:
            return None
        if not count_queued:
            return (f"host is full: {live} sandboxes of max {cap}; retry later or on another host",
                    {"sandboxes": live, "max": cap})
        return (f"host is full: {live} sandboxes and {queued} queued creates of max {cap}; "
                "retry later or on another host",
                {"sandboxes": live, "queued": queued, "max": cap,
                 "retry_after_s": self.adm_cfg["full_retry_after_s"]})

    def hold_call_sandbox(self, box_id: str, cpu: float, memory: int) -> None:
        """Admit a call sandbox (engine/calls.py) as a create's sandbox is
        admitted, and count it until release_call_sandbox: busy when the
        host is full (limits.max_sandboxes) or its CPU or memory would pass
        the host's capacity with it. Not refused by a drain, nor by the LS
        rule on recent load (`cpu.ls_max_load`): calls in flight come and go
        in seconds, and a call sandbox is dropped when idle
        (fncall.idle_ttl_s), and at once for a create that needs the room
        it holds (_room). The creates queued for a slot count against
        limits.max_sandboxes, as they do for a new create: a call sandbox
        takes no slot a queued create was let in for."""
        refused = self._refusal(cpu, memory, False)
        if refused is not None:
            raise refused
        self.registry.hold(box_id, cpu, memory)

    async def room_for_call_sandbox(self, cpu: float, memory: int) -> None:
        """Before a call sandbox is made on a host with no room for it: the
        idle call sandboxes of other images that hold the room it needs go,
        least recently used first, as for a create (_room).
        hold_call_sandbox still decides whether it is admitted."""
        await self._room(functools.partial(self._refusal, cpu, memory, False), purpose="call")

    def release_call_sandbox(self, box_id: str) -> None:
        self.registry.release(box_id)

    def check_process(self, req) -> None:
        """A create's settings of the sandbox's processes, fresh or pooled, as
        far as they can be checked before its image is at hand (a user name
        is resolved in process_settings)."""
        check_env(req.env)
        if req.cwd is not None and not req.cwd.startswith("/"):
            raise BadRequest(f"cwd must be absolute, got {req.cwd!r}")
        if req.user is not None:
            try:
                user, group = imageconfig.parse_user(imageconfig.user_spec(req.user))
            except imageconfig.ConfigError as err:
                raise BadRequest(str(err), {"user": req.user}) from err
            for part, what in ((user, "user"), (group, "group")):
                if part and imageconfig.is_id(part):
                    self._check_id(int(part), what, req.user)

    def _check_id(self, n: int, what: str, spec) -> None:
        """A uid or gid the sandbox's user namespace maps (sandbox.userns_size)."""
        size = self.id_ranges.size
        if size is not None and n >= size:
            raise BadRequest(f"{what} id {n} (of user {spec!r}) must be below sandbox.userns_size {size} "
                             "(the ids a sandbox's user namespace maps)", {"user": spec, "userns_size": size})

    async def _config_of(self, sb: Sandbox) -> dict:
        """The config of the image a sandbox was made from (by manifest: its
        name may have been rebuilt since)."""
        try:
            return (await self.workers.run(self.image_service.images.get_manifest, sb.manifest, sb.image)).config
        except ImageError as err:
            raise image_error(err) from err

    async def process_settings(self, sb: Sandbox, config: dict, req) -> ProcessSettings:
        """The image's config (dsecd/imageconfig.py) under the create's: env
        merged (the create's wins), cwd and user replaced where the create
        gives them. The user is resolved against the image's /etc/passwd and
        /etc/group (dsecd/fs/users.py), whose home directory becomes HOME
        unless env sets it. The image's WorkingDir is made if the image lacks
        it, as docker does; a cwd the create names must exist. Nothing has
        run in `sb` yet (fresh, or waiting in a pool): its files are the image's."""
        env = {**config["env"], **req.env}
        check_env(env)
        if req.user is not None:
            spec, source = imageconfig.user_spec(req.user), "the create's user"
        else:
            spec, source = config["user"], "the image's User"
        ident = await self._identity(sb, spec, source)
        self._check_id(ident.uid, "user", spec)
        self._check_id(ident.gid, "group", spec)
        if "HOME" not in env:
            if ident.home:
                env["HOME"] = ident.home
            elif ident.uid != 0:
                env["HOME"] = "/"       # a uid without a home: not root's (docker gives / too, as an exec's)
        cwd = req.cwd or config["cwd"]
        await self.check_cwd(sb, cwd, make=req.cwd is None)
        return ProcessSettings(env, cwd, ident.uid, ident.gid, mapped_groups(ident.groups, self.id_ranges.size))

    async def _identity(self, sb: Sandbox, spec: str, source: str) -> users.Identity:
        """`spec` -> ids, in the image's /etc/passwd and /etc/group (nothing has run in `sb` yet)."""
        try:
            return await sandbox_identity(sb, spec, self.workers, self.vm_files, "the image")
        except imageconfig.ConfigError as err:
            raise BadRequest(f"image {sb.image!r}: {source} {spec!r}: {err}", {"user": spec}) from err
        except users.UserError as err:
            raise BadRequest(f"image {sb.image!r} cannot run as {source} {spec!r}: {err}",
                             {"image": sb.image, "user": spec}) from err

    async def check_cwd(self, sb: Sandbox, cwd: str, make: bool = False) -> None:
        """A create's cwd must be a directory of the sandbox's image: else
        every exec in it fails. `make`: the image's own WorkingDir, made
        (with its parents, mode 0755, owned by root) where the image lacks it.
        A microVM's through its guest agent (it runs by now)."""
        if cwd == "/":
            return
        if sb.backend == "microvm":
            return await self.vm_files.check_cwd(sb, cwd, make)
        try:
            # On copies of the root: a cancelled create's undo closes the handle's.
            found = await in_root(self.workers, sb, sbfiles.is_directory, cwd)
            if not found and make:
                await in_root(self.workers, sb, sbfiles.make_dir, cwd, True, 0o755)
                return
        except sbfiles.PathError as err:
            raise BadRequest(f"cwd: {err}", {"cwd": cwd}) from err
        except OSError as err:
            raise io_error("make" if make else "check", f"the cwd {sb.id}:{cwd}", err) from err
        if not found:
            raise BadRequest(f"cwd {cwd!r} is not a directory in image {sb.image!r}: give one that "
                             "exists, or create without --cwd and make it with an exec", {"cwd": cwd})

    def _ttl(self, req) -> float | None:
        """The create's ttl, or sandbox.default_ttl when it names none."""
        return self.default_ttl if req.ttl is None else parse_duration(req.ttl, "ttl")

    async def _mount_layers(self, sb: Sandbox) -> list:
        """The image's layers mounted (each once per host), top layer first for overlay."""
        layers = self.image_service.layers
        try:
            mounts = layers.acquire_mounted(sb.layers) or await self.workers.run(layers.acquire, sb.layers)
        except OSError as err:
            raise io_error("mount layers of image", sb.image, err) from err
        return overlay_lowerdirs(mounts)

    async def _spawn(self, steps: AsyncSteps, sb: Sandbox, ready, mounts: list, limits: cgroup.Limits,
                     hostname: str, plan, disk: upperfs.Cap | None):
        """The container itself (backend.create, PID 1 joining `ready`'s netns).
        A request cancelled meanwhile leaves its id range and layers to the
        spawn's abandon handler, which releases them once the worker is done
        and what it made is destroyed (NetworkService.spawn_joining)."""
        release = steps.hand_over(UNDO_IDS, UNDO_LAYERS)
        try:
            handle = await self.net.spawn_joining(functools.partial(self.backend.create, disk=disk), ready, release,
                                                  sb.id, mounts, limits, hostname, plan,
                                                  userns.IdMap.from_record(sb.idmap))
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            release()
            if isinstance(err, (NativeError, OSError)):
                log.error("create sandbox %s failed: %s", sb.id, err)
                raise DsecError(f"create sandbox: {err}", {"errno": getattr(err, "errno", None),
                                "step": getattr(err, "step", None)}, code="io") from err
            raise
        steps.undo("release its id range and layers", release)
        return handle

    def _record(self, sb: Sandbox) -> None:
        """The sandbox's journal record: a create's last step that can fail,
        inside its undo steps, since a sandbox the journal does not hold
        would run on unknown to a restarted daemon."""
        sb.state = "running"
        try:
            self.registry.save(sb)
        except OSError as err:
            sb.state = "creating"
            raise io_error("write the journal record of", f"sandbox {sb.id}", err) from err

    def _now_running(self, sb: Sandbox, started: float) -> dict:
        """A create's end, whatever the backend, once recorded: watched, announced."""
        self.lifecycle.watch(sb)
        self.memory.on_created(sb, time.monotonic() - started)
        return sb.public()

    async def _create_vm(self, sb: Sandbox, req, image: Image, limits: cgroup.Limits, disk: int,
                         net_mode: str, started: float) -> dict:
        """A microVM sandbox (dsecd/engine/microvms.py): its policy, lease and
        published ports first (--net default), then its QEMU, booted or
        restored to its agent; then what its processes get (env, cwd, user:
        process_settings), as a container's, read from its guest."""
        allow, publish = list(req.allow), list(req.publish or [])
        async with AsyncSteps(f"create sandbox {sb.id}") as steps:
            self.id_ranges.allocate(sb)
            steps.undo(UNDO_IDS, lambda: self.id_ranges.release(sb))
            self.registry.add(sb)
            steps.undo("forget the sandbox", lambda: self.registry.forget(sb.id))
            if net_mode == "default":
                await self.net.attach_vm_net(sb, allow)
                steps.undo("detach networking", lambda: self.net.detach_net(sb))
                if publish:
                    await self.net.publish_at_create(sb, publish)
            sb.handle = await self.vms.create(sb, limits, disk)
            steps.undo("destroy the VM", lambda: self.workers.run(self.vms.backend.destroy, sb.id, sb.handle))
            (await self.process_settings(sb, image.config, req)).apply(sb)
            self._record(sb)
            steps.commit()
        return self._now_running(sb, started)

    async def create_now(self, req, ctx, image: Image | None = None, drop_idle_calls: bool = True) -> dict:
        """The create itself; `create` does keys, pools and the queue first.
        `image`: the image to make it of, already resolved (else `req.image`'s);
        `drop_idle_calls`: idle call sandboxes may go for its room (_room)."""
        started = time.monotonic()
        limits = self._limits_for(req)
        plan = self.cpu.plan(req.qos)
        self.check_process(req)
        backend = self._backend_of(req)
        if backend == "microvm":
            if self.vms is None:
                raise Unsupported("backend microvm is not set up in this daemon")
            self.vms.check_create(req, limits.memory_bytes)
            net_mode = self.net.net_mode(req)
            disk = upperfs.Cap(self._vm_disk_for(req, limits.memory_bytes),
                               upper_inodes(limits.memory_bytes, self.sb_defaults["disk_inodes"]))
        else:
            net_mode = self.net.net_mode(req)
            disk = self._disk_for(req)
        if image is None:
            try:
                image = await self.workers.run(self.image_service.images.get, req.image)
            except ImageError as err:
                raise image_error(err) from err
        check_platform(req.image, image)
        if backend == "microvm":
            self.vms.check_layers(req.image, image.layer_digests)
        sb_id = secrets.token_hex(6)
        doing.on_sandbox(sb_id)         # what a stop that cannot wait for this create's work names
        hostname = req.hostname or f"sb-{sb_id}"
        check_hostname(hostname)
        sb = Sandbox(id=sb_id, image=req.image, state="creating", created=time.time(),
                     # A microVM's pids are not limited (check_create): null, not the default it lacks.
                     limits={"cpu": limits.cpu, "memory": limits.memory_bytes,
                             "pids": None if backend == "microvm" else limits.pids,
                             "cpu_quota": limits.cpu_hard_quota,
                             "disk": disk.disk_bytes if disk else None,
                             "disk_inodes": disk.inodes if disk else None},
                     labels=dict(req.labels), hostname=hostname, qos=plan.qos, core_sched=plan.core_sched,
                     manifest=image.manifest, layers=image.layer_digests,
                     ttl=self._ttl(req), idle_ttl=parse_duration(req.idle_ttl, "idle_ttl"),
                     lease=parse_duration(req.lease, "lease"), key=req.key,
                     key_args=args_digest(req) if req.key else None, backend=backend,
                     policy=self.policy_for_create(req.policy))
        # Admitted once every setting was read: idle call sandboxes may be
        # dropped for its room, and must not be for a create that then fails.
        admit = functools.partial(self._refusal, limits.cpu, limits.memory_bytes, plan.qos == qos.LS,
                                  count_queued=False)        # it holds its slot of the queue
        refused = await self._room(admit) if drop_idle_calls else admit()
        if refused is not None:
            raise refused
        if sb.lease:
            sb.lease_deadline = time.monotonic() + sb.lease
        if backend == "microvm":
            return await self._create_vm(sb, req, image, limits, disk.disk_bytes, net_mode, started)
        # The record is written once the sandbox runs. A crash before that leaves
        # a directory and cgroups without a record: the next start finds them as
        # orphans, kills what is in the cgroups and removes them.
        async with AsyncSteps(f"create sandbox {sb_id}") as steps:
            self.id_ranges.allocate(sb)
            steps.undo(UNDO_IDS, lambda: self.id_ranges.release(sb))
            self.registry.add(sb)
            steps.undo("forget the sandbox", lambda: self.registry.forget(sb_id))
            mounts = await self._mount_layers(sb)
            steps.undo(UNDO_LAYERS, lambda: self.image_service.layers.release(sb.layers))
            ready = await self.net.take_netns(net_mode)      # a pooled netns for PID 1 to join, or None
            sb.handle = await self._spawn(steps, sb, ready, mounts, limits, hostname, plan, disk)
            steps.undo("destroy the container", lambda: self.workers.run(self.backend.destroy, sb_id, sb.handle))
            steps.undo(UNDO_NETNS, lambda: self.net.release_netns(ready))
            (await self.process_settings(sb, image.config, req)).apply(sb)
            steps.drop(UNDO_NETNS)       # attach_net consumes it, and removes it if it fails
            await self.net.attach_net(sb, net_mode, req.allow, ready)
            steps.undo("detach networking", lambda: self.net.detach_net(sb))
            if req.publish:
                await self.net.publish_at_create(sb, req.publish)
            self._record(sb)
            steps.commit()
        return self._now_running(sb, started)
