"""FnCall: the `call` request (stateless function calls, no sandbox to manage).

The mechanism is dsecd/backends/fncall.py.
One call sandbox per image, made on the first call and kept until no call
used it for [fncall] idle_ttl_s, or until it is the idle one used least
recently when another image needs one past [fncall] max_boxes or a create
needs the room it holds on a full host (drop_idle_for_create); in it, when
the image has python3, one zygote. Routing:

- `code`, or argv `python3 -c CODE ARGS...`: forked from the zygote (the
  interpreter and [fncall] modules already imported); `code` on an image
  without a zygote is `unsupported`.
- any other argv: forked from the zygote and exec'ed when there is one (the
  same fresh tmp dir and uid drop), else a plain exec in the call sandbox
  (works for any image).

Every call runs under a uid of its own (one per running call, from
[fncall] uid_base) in a fresh dir under /tmp that is its cwd, HOME and
TMPDIR and is removed afterwards; its output is capped like an exec's;
zygote calls also take the per-call rlimits of [fncall] (RLIMIT_CPU from the
timeout). The whole call sandbox is bounded by its cgroup ([fncall] cpu,
memory, pids).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import signal
import socket
import time

from .. import cgroup, metrics
from ..backends.container import Handle
from ..backends.fncall import CallBox, FnCallBackend, Zygote, ZygoteDied
from ..backends.zygote_main import CLEANUP_RETRY_MS, CLEANUP_TRIES, cannot_run
from ..config import parse_size
from ..cpu.manager import CpuHost
from ..errors import (
    BadRequest,
    Busy,
    DsecError,
    IOFailure,
    LimitExceeded,
    Unsupported,
    exec_error,
    image_error,
    io_error,
    started_by_step,
)
from ..execio import ChildWatch, Collector, ExecIO, reap
from ..fs import upper as upperfs
from ..fs.images import Image, ImageError
from ..fs.layers import overlay_lowerdirs
from ..mem import pause
from ..native import NativeError
from .execs import ExecLimits, check_env
from .idranges import IdRanges
from .images import ImageService, check_platform
from .starts import ProcessStarter
from .workers import Workers

log = logging.getLogger(__name__)

INLINE_MAX = 48 * 1024     # a call packet up to this size carries the request itself
# What a plain call left running is looked for this often, this many times,
# before its uid goes back (each look kills what it finds).
LEFTOVER_RECHECK_S = 0.01
LEFTOVER_LOOKS = 500
CLEANUP_RETRY_S = CLEANUP_RETRY_MS / 1000      # the zygote's pace for leftovers that stay, on this route too
# A dropped call sandbox whose destroy failed (a process it could not kill,
# a cgroup that would not go) is destroyed again: first this many seconds
# later, then twice as long each time, up to the second figure.
DESTROY_RETRY_S = (1.0, 60.0)
# The longest a create waits for the idle call sandboxes dropped for it to
# be destroyed (drop_idle_for_create); a destroy takes milliseconds, one
# that failed is tried again DESTROY_RETRY_S later.
DROP_WAIT_S = 5.0


def fncall_backend(cfg, layout: cgroup.Layout, containers) -> FnCallBackend:
    """The call sandboxes' backend, from the config and the container backend
    (`containers`: its writable-layer mode and exec route)."""
    sb_defaults = cfg.section("sandbox")
    # Call sandboxes get the same writable-layer cap as sandboxes (sandbox.disk).
    disk = (upperfs.Cap(cfg.size("sandbox", "disk"), sb_defaults["disk_inodes"])
            if containers.upper_mode == "tmpfs" else None)
    return FnCallBackend(layout, sb_defaults, cfg.section("fncall"), cfg.state_dir, {
        "tmp": cfg.size("fncall", "tmp_size"), "shm": cfg.size("sandbox", "shm_size")}, disk,
        containers.execs_by_init)


class CallService:
    """`call`. `fncall` makes call sandboxes and zygotes (fncall_backend);
    `sizes` are the byte limits of [fncall] (CallService.sizes_from);
    `images` gives their layers, `cpu` their QoS plan, `id_ranges` their user
    namespaces' ranges; `capacity` (CreateService: hold_call_sandbox,
    release_call_sandbox) admits and counts them as the host's sandboxes;
    `devnull` is the stdin of calls that take none."""

    def __init__(self, fncall: FnCallBackend, fn_cfg: dict, sizes: dict, cpu_period_us: int,
                 images: ImageService, cpu: CpuHost, workers: Workers, starter: ProcessStarter,
                 exec_limits: ExecLimits, devnull: int, id_ranges: IdRanges, capacity):
        self.fncall = fncall
        self.fn_cfg = fn_cfg
        self._call_sizes = sizes
        self.cpu_period_us = cpu_period_us
        self.image_service = images
        self.cpu = cpu
        self.workers = workers
        self.starter = starter
        self.exec_limits = exec_limits
        self.devnull = devnull
        self.id_ranges = id_ranges
        self.capacity = capacity
        self.call_boxes: dict[str, CallBox] = {}
        # Retired, dropped when their running calls end: id -> (box, why).
        self._draining: dict[str, tuple[CallBox, str]] = {}
        self._box_locks: dict[str, asyncio.Lock] = {}
        self._making = 0        # call sandboxes being made
        # Images whose call sandbox is being made -> whether the name was
        # rebuilt or removed since (_image_changed).
        self._rebuilt: dict[str, bool] = {}
        self._sweeper: asyncio.Task | None = None
        self._closing = asyncio.Event()     # set by close(): a destroy that fails is left to the next start
        if images is not None:
            images.images.changed.append(self._image_changed)
        self.call_stats = {"calls": 0, "inflight": 0, "zygote_calls": 0, "plain_calls": 0, "plain_calls_by_init": 0,
                           "zygotes_started": 0, "zygotes_replaced": 0, "busy": 0, "dropped_for_creates": 0,
                           "dropped_for_calls": 0}

    @staticmethod
    def sizes_from(cfg) -> dict:
        """[fncall]'s byte sizes, read per call: parsed once."""
        return {"stdin": cfg.size("fncall", "max_stdin_bytes"), "code": cfg.size("fncall", "max_code_bytes"),
                "rlimit_as": cfg.size("fncall", "rlimit_as"), "rlimit_fsize": cfg.size("fncall", "rlimit_fsize")}

    async def start(self) -> None:
        for box_id in await self.workers.run(self.fncall.leftovers):
            log.info("removing call sandbox %s of an earlier daemon", box_id)
            await self.workers.run(self.fncall.destroy_box, box_id, None)
        self.set_idle_ttl(self.fn_cfg["idle_ttl_s"])

    def set_idle_ttl(self, ttl: float) -> None:
        """Sweep call sandboxes idle for `ttl` seconds (fncall.idle_ttl_s; 0:
        none): at start, and anew at a config reload."""
        self.fn_cfg["idle_ttl_s"] = ttl
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if ttl > 0:
            self._sweeper = self.workers.loop.create_task(self._sweep_idle())

    async def _sweep_idle(self) -> None:
        """Drop the call sandboxes no call has used for fncall.idle_ttl_s
        (their zygote, memory, layers and id range), looking every quarter
        of it (at most every 30 s)."""
        ttl = self.fn_cfg["idle_ttl_s"]
        while True:
            await asyncio.sleep(min(ttl / 4, 30.0))
            now = time.monotonic()
            for box in list(self.call_boxes.values()):
                if not box.claims and now - box.last_used >= ttl:
                    self._retire(box, f"no call for fncall.idle_ttl_s ({ttl:g} s)")

    def _make_room(self) -> list[asyncio.Task]:
        """Room for one more call sandbox under fncall.max_boxes: the idle
        ones used least recently are dropped; Busy when every one has calls.
        Retired ones still draining are not counted: they go as their
        running calls end, and counting them would make every call of a
        recycled image wait for its longest call. The drops of those it
        dropped, for the caller to wait for: each holds its slot of the
        host's admission until its sandbox is destroyed."""
        cap = self.fn_cfg["max_boxes"]
        drops = []
        while cap and len(self.call_boxes) + self._making >= cap:
            idle = self._idle_boxes()
            if not idle:
                self.call_stats["busy"] += 1
                raise Busy(f"{cap} call sandboxes (fncall.max_boxes), each with calls running; retry shortly",
                           {"max": cap, "retry_after_s": 0.05})
            drop = self._retire(idle[0], f"the least recently used idle one of fncall.max_boxes ({cap})")
            if drop is not None:
                drops.append(drop)
        return drops

    def _idle_boxes(self) -> list[CallBox]:
        """The call sandboxes no call claims, least recently used first: those
        dropped for room."""
        return sorted((b for b in self.call_boxes.values() if not b.claims), key=lambda b: b.last_used)

    def idle_ids(self) -> list[str]:
        """The ids of the call sandboxes no call claims: those a create may drop."""
        return [b.id for b in self._idle_boxes()]

    async def drop_idle_for_create(self, enough, drop: bool = True, purpose: str = "create") -> bool:
        """Room for a create the host has none for (CreateService._room):
        the idle call sandboxes (no call claims them), least recently used
        first, as few as `enough(ids)` says make the room were those ids
        destroyed. They leave call_boxes at once (the next call of their
        image makes a new one, admitted as any), and this waits until they
        are destroyed and their holdings given back, or DROP_WAIT_S at most
        (a destroy that fails keeps them held while it is tried again).
        True once they are destroyed. False, dropping none, when even every
        idle one would not make room; False as well when their destroys
        did not end within DROP_WAIT_S: the caller is then refused rather
        than dropping more of them while the first still hold the room.
        Without `drop`, whether they would make room, and none goes.
        `purpose`: "create", or "call" for another image's new call
        sandbox (counted apart)."""
        chosen: list[CallBox] = []
        for box in self._idle_boxes():
            chosen.append(box)
            if enough([b.id for b in chosen]):
                break
        else:
            return False
        if not drop:
            return True
        drops = [task for b in chosen if (task := self._retire(b, f"room for a {purpose} on a full host")) is not None]
        self.call_stats[f"dropped_for_{purpose}s"] += len(chosen)
        if drops:
            # asyncio.wait: a cancel of the create stops no drop.
            _done, pending = await asyncio.wait(drops, timeout=DROP_WAIT_S)
            if pending:
                log.warning("%d call sandboxes dropped for room on a full host not destroyed after %g s; "
                            "the %s waiting for their room is refused", len(pending), DROP_WAIT_S, purpose)
                return False
        return True

    async def close(self) -> None:
        self._closing.set()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        boxes, self.call_boxes = [*self.call_boxes.values(), *(b for b, _why in self._draining.values())], {}
        self._draining = {}
        await asyncio.gather(*(self._drop_box(b, "daemon shutdown") for b in boxes), return_exceptions=True)

    def info(self) -> dict:
        return {**self.call_stats, "max_boxes": self.fn_cfg["max_boxes"], "idle_ttl_s": self.fn_cfg["idle_ttl_s"],
                "boxes": [
            {"image": b.image, "id": b.id, "calls": b.calls, "running": b.running,
             "zygote_pid": b.zygote.pid if b.zygote and b.zygote.alive else None,
             "modules": (b.zygote.info.get("modules") if b.zygote else None),
             # [fncall] modules the zygote could not import: name -> why (else only in the log)
             "modules_failed": (b.zygote.info.get("failed") if b.zygote else None),
             "zygote_error": b.zygote_error} for b in self.call_boxes.values()]}

    # ------------------------------------------------------------ the op

    async def call(self, req, ctx) -> dict:
        started = time.monotonic()
        argv, code = self._call_route(req)
        timeout = self._call_timeout(req.timeout)
        stdin = req.stdin or b""
        if len(stdin) > self._call_sizes["stdin"]:
            raise LimitExceeded(f"stdin of {len(stdin)} bytes exceeds fncall.max_stdin_bytes",
                                {"max": self._call_sizes["stdin"]})
        stats = self.call_stats
        cap = self.fn_cfg["max_inflight"]
        if stats["inflight"] >= cap:
            stats["busy"] += 1
            raise Busy(f"{stats['inflight']} calls in flight (fncall.max_inflight {cap}); retry shortly",
                       {"inflight": stats["inflight"], "max": cap, "retry_after_s": 0.05})
        stats["inflight"] += 1
        box = None
        try:
            # Claimed (not dropped as idle, nor to make room) until this call is done with it.
            box = await self._call_box(self.image_service.images.key(req.image))
            zyg = await self._zygote(box)
            if zyg is None and req.argv is not None:
                argv, code = list(req.argv), None       # `python3 -c` without a zygote: as any argv
            if zyg is None and code is not None:
                raise Unsupported(f"image {req.image!r} has no Python zygote ({box.zygote_error}); "
                                  "code calls need python3 in the image (argv calls work)",
                                  {"image": req.image})
            box.running += 1
            oom_before = box.oom_kills
            try:
                if zyg is not None:
                    result = await self._zygote_call(box, zyg, argv, code, req.env, stdin, timeout)
                else:
                    result = await self._plain_call(box, argv, req.env, stdin, timeout)
                await self._why_killed(box, result, oom_before)
            finally:
                box.running -= 1
                box.calls += 1
                if zyg is not None and zyg.calls >= self.fn_cfg["zygote_max_calls"]:
                    self._retire(box, "recycled after fncall.zygote_max_calls calls", drain=True)
                if box.id in self._draining and not box.running:
                    _box, why = self._draining.pop(box.id)
                    self.workers.loop.create_task(self._drop_box(box, f"{why}; its last call ended"))
        finally:
            stats["inflight"] -= 1
            if box is not None:
                box.claims -= 1
                box.last_used = time.monotonic()
        stats["calls"] += 1
        result["image"] = req.image
        elapsed = time.monotonic() - started
        result["total_ms"] = round(elapsed * 1000, 3)
        metrics.CALL_SECONDS.labels("zygote" if zyg is not None else "plain").observe(elapsed)
        return result

    async def _why_killed(self, box: CallBox, result: dict, oom_before: int) -> None:
        """A call that ended by SIGKILL, not at its timeout, says `killed_by`
        "oom" when its call sandbox's OOM kill count grew while it ran, as an
        exec does. One cgroup read, for SIGKILLed calls only; the count a
        call started from is the one the last such read saw."""
        if result.get("signal") != signal.SIGKILL or result.get("timed_out") or box.handle is None:
            return
        try:
            n = await self.workers.run(pause.oom_kills, box.handle.group)
        except OSError:
            return
        if n > oom_before:
            result["killed_by"] = "oom"
        box.oom_kills = max(box.oom_kills, n)

    def _call_route(self, req) -> tuple[list[str], str | None]:
        """(argv, code): code is None for an argv call; argv is sys.argv for a code call."""
        if (req.argv is None) == (req.code is None):
            raise BadRequest("call needs exactly one of argv or code")
        check_env(req.env)
        if req.code is not None:
            if len(req.code.encode()) > self._call_sizes["code"]:
                raise LimitExceeded("code exceeds fncall.max_code_bytes", {"max": self._call_sizes["code"]})
            return ["-c", *(req.args or [])], req.code
        if req.args:
            raise BadRequest("args go with code (argv calls carry their own arguments)")
        argv = list(req.argv)
        if not argv or not all(argv) or any("\0" in a for a in argv):
            raise BadRequest("argv must be a non-empty list of non-empty strings without NUL bytes")
        # `python3 -c CODE ARGS...` is a code call: no interpreter start-up.
        # Only under the name the zygote's interpreter was started by, and in
        # the image's PATH: another name (python2, a venv's python, a path)
        # or a PATH of the call's own may find another interpreter.
        if len(argv) >= 3 and argv[0] == self.fn_cfg["python"] and argv[1] == "-c" and "PATH" not in (req.env or {}):
            return ["-c", *argv[3:]], argv[2]
        return argv, None

    def _call_timeout(self, timeout: float | None) -> float:
        top = self.fn_cfg["max_timeout_s"]
        if timeout is None:
            return min(self.fn_cfg["default_timeout_s"], top)
        if not 0 < timeout <= top:
            raise BadRequest(f"timeout must be in (0, {top}] seconds (fncall.max_timeout_s), got {timeout}")
        return float(timeout)

    # ------------------------------------------------------------ call sandboxes and zygotes

    async def _call_box(self, image_name: str) -> CallBox:
        """The image's call sandbox, made if it has none, claimed by the
        caller (CallBox.claims), who gives it back at the call's end."""
        box = self.call_boxes.get(image_name)
        if box is None:
            lock = self._box_locks.setdefault(image_name, asyncio.Lock())
            async with lock:
                box = self.call_boxes.get(image_name)
                while box is None:
                    # Set by _image_changed if the name is rebuilt or removed meanwhile.
                    self._rebuilt[image_name] = False
                    try:
                        # The image first: a call naming one that is not there
                        # (or not for this host) must not drop another's box.
                        image = await self._image_for_box(image_name)
                        drops = self._make_room()
                        self._making += 1
                        try:
                            # The host's admission counts a dropped one until it
                            # is destroyed: on a host it filled, the new one is
                            # admitted in the slot it frees, once it is freed.
                            # asyncio.wait: a cancel of this call stops no drop.
                            if drops:
                                await asyncio.wait(drops)
                            box = await self._make_box(image_name, image)
                        finally:
                            self._making -= 1
                    finally:
                        rebuilt = self._rebuilt.pop(image_name)
                    if rebuilt:
                        # Made of what the name stood for before: kept, it
                        # would serve every later call. Made again of what
                        # it stands for now (not_found if removed).
                        self.workers.loop.create_task(
                            self._drop_box(box, "its image name was rebuilt or removed while it was made"))
                        box = None
                        continue
                    self.call_boxes[image_name] = box
        box.claims += 1
        return box

    async def _image_for_box(self, image_name: str) -> Image:
        """The image a call sandbox is made of; not_found or bad_request
        if it is not there or not for this host."""
        try:
            image = await self.workers.run(self.image_service.images.get, image_name)
        except ImageError as err:
            raise image_error(err) from err
        check_platform(image_name, image)
        return image

    async def _make_box(self, image_name: str, image: Image) -> CallBox:
        fc = self.fn_cfg
        limits = cgroup.Limits(cpu=float(fc["cpu"]), memory_bytes=parse_size(fc["memory"]), pids=fc["pids"],
                               cpu_hard_quota=False, cpu_period_us=self.cpu_period_us)
        plan = self.cpu.plan(fc["qos"])
        box_id = f"fn-{secrets.token_hex(5)}"
        # On a full host, idle call sandboxes of other images give way.
        await self.capacity.room_for_call_sandbox(limits.cpu, limits.memory_bytes)
        # What the box holds, given back in reverse if it is not made; a
        # cancel hands all of it to _undo_abandoned_box instead.
        with contextlib.ExitStack() as held:
            try:
                self.capacity.hold_call_sandbox(box_id, limits.cpu, limits.memory_bytes)
            except Busy:            # the host is full, or its CPU or memory
                self.call_stats["busy"] += 1
                raise
            held.callback(self.capacity.release_call_sandbox, box_id)
            try:
                mounts = await self.workers.run(self.image_service.layers.acquire, image.layer_digests)
            except OSError as err:
                raise io_error("mount layers of image", image_name, err) from err
            held.callback(self.image_service.layers.release, image.layer_digests)
            idmap = self.id_ranges.take()
            held.callback(self.id_ranges.give_back, idmap)
            # In a worker, which a cancelled request cannot stop: what it makes
            # then is undone once it is made (_undo_abandoned_box).
            made = asyncio.ensure_future(self.workers.run(self._new_box, box_id, overlay_lowerdirs(mounts), limits,
                                                          plan, idmap))
            try:
                handle, mq_fd = await asyncio.shield(made)
            except asyncio.CancelledError:
                held.pop_all()
                made.add_done_callback(functools.partial(self._undo_abandoned_box, box_id, idmap,
                                                         image.layer_digests))
                raise
            except (NativeError, OSError) as err:
                raise IOFailure(f"create call sandbox for {image_name}: {err}",
                                {"errno": getattr(err, "errno", None)}) from err
            held.pop_all()
        log.info("call sandbox %s for image %s", box_id, image_name)
        uids = list(range(fc["uid_base"] + fc["uid_count"] - 1, fc["uid_base"] - 1, -1))   # lowest last
        return CallBox(id=box_id, image=image_name, layers=image.layer_digests, handle=handle, free_uids=uids,
                       env=dict(image.config.get("env") or {}), idmap=idmap, mq_fd=mq_fd)

    def _new_box(self, box_id: str, lowerdirs, limits, plan, idmap) -> tuple[Handle, int]:
        """A call sandbox and the fd of its message-queue directory (-1 when
        none can be made); in a worker."""
        handle = self.fncall.create_box(box_id, lowerdirs, limits, plan, idmap)
        try:
            mq_fd = self.fncall.mqueue_dir(handle)
        except OSError as err:
            log.warning("call sandbox %s: no fd of its message queues (%s): what calls leave there stays", box_id, err)
            mq_fd = -1
        return handle, mq_fd

    def _undo_abandoned_box(self, box_id: str, idmap, layers: list[str], made: asyncio.Future) -> None:
        """A call sandbox made for a request cancelled meanwhile: destroyed,
        its id range and layers given back (those of one never made at once)."""
        if made.cancelled() or made.exception() is not None:
            self._release_box(box_id, layers, idmap)
            return
        handle, mq_fd = made.result()
        if mq_fd >= 0:
            os.close(mq_fd)

        log.info("call sandbox %s was made for a cancelled request: destroying it", box_id)
        self.workers.loop.create_task(self._destroy_and_give_back(box_id, handle, layers, idmap))

    async def _destroy_and_give_back(self, box_id: str, handle: Handle, layers: list[str], idmap) -> None:
        """Destroy a call sandbox, then give back its layers, id range and
        slot of the host. A destroy that fails is tried again (DESTROY_RETRY_S)
        until it succeeds, with all of them held meanwhile: its processes or
        groups may still be there. One that fails once the daemon is stopping
        is left, held, to the next start's sweep of earlier call sandboxes."""
        delay, longest = DESTROY_RETRY_S
        while True:
            try:
                await self.workers.run(self.fncall.destroy_box, box_id, handle)
                break
            except Exception as err:       # noqa: BLE001 -- retried, or left to the next start
                if self._closing.is_set():
                    log.error("call sandbox %s: destroy failed (%s); the daemon is stopping: its next start "
                              "removes it", box_id, err)
                    return
                log.error("call sandbox %s: destroy failed (%s); its slot, layers and id range stay held, "
                          "trying again in %g s", box_id, err, delay)
            try:
                await asyncio.wait_for(self._closing.wait(), delay)
            except TimeoutError:
                pass
            delay = min(delay * 2, longest)
        self._release_box(box_id, layers, idmap)

    def _release_box(self, box_id: str, layers: list[str], idmap) -> None:
        """What a call sandbox held, once it is gone or was never made: its
        id range, its image's layers, its slot of the host."""
        self.id_ranges.give_back(idmap)
        self.image_service.layers.release(layers)
        self.capacity.release_call_sandbox(box_id)

    async def _zygote(self, box: CallBox) -> Zygote | None:
        if box.zygote is not None and box.zygote.alive:
            return box.zygote
        if not self.fn_cfg["zygote"] or box.zygote_error:
            box.zygote_error = box.zygote_error or "disabled by fncall.zygote = false"
            return None
        lock = self._box_locks.setdefault(box.image, asyncio.Lock())
        async with lock:
            if box.zygote is not None and box.zygote.alive:
                return box.zygote
            if box.zygote_error:
                return None
            if box.start_failed:
                raise IOFailure(f"fncall zygote for {box.image} did not start ({box.start_failed}); retry")
            try:
                box.zygote = await self._start_zygote(box)
            except NativeError as err:
                if err.errno == errno.ENOENT:     # no python3 in the image: argv calls only
                    box.zygote_error = f"no {self.fn_cfg['python']} in the image"
                    return None
                raise IOFailure(f"start zygote for {box.image}: {err}") from err
            return box.zygote

    async def _start_zygote(self, box: CallBox) -> Zygote:
        fc = self.fn_cfg
        conf = {"modules": list(fc["modules"]), "spares": fc["spares"], "uid_base": fc["uid_base"],
                "uid_count": fc["uid_count"], "own_ipc": self.fncall.own_ipc(box.handle),
                "own_net": fc["own_net"] and self.fncall.own_ipc(box.handle),
                "rlimits": {"as": self._call_sizes["rlimit_as"], "core": 0,
                            "fsize": self._call_sizes["rlimit_fsize"], "nofile": fc["rlimit_nofile"],
                            "nproc": fc["rlimit_nproc"]}}
        sock, pid = await self.workers.run(self.fncall.spawn_zygote, box.handle, conf, box.env)
        if box.mq_fd >= 0:      # first, so before any call: where the calls' message queues are
            sock.sendmsg([b'{"op": "mqueue"}'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [box.mq_fd]))])
        sock.setblocking(False)
        zyg = Zygote(sock=sock, pid=pid, pidfd=os.pidfd_open(pid), ready=self.workers.loop.create_future())
        self.workers.loop.add_reader(sock.fileno(), zyg.on_readable)
        self.workers.loop.add_reader(zyg.pidfd, lambda: self._on_zygote_exit(box, zyg))
        self.call_stats["zygotes_started"] += 1
        limit = self.fn_cfg["zygote_start_timeout_s"]
        try:
            info = await asyncio.wait_for(asyncio.shield(zyg.ready), limit)
        except (TimeoutError, ZygoteDied) as err:
            why = str(err) or f"not ready within fncall.zygote_start_timeout_s ({limit:g} s)"
            zyg.fail(f"zygote did not start: {why}")
            self._close_zygote(zyg)
            # Maybe only a busy host: the next call starts over in a new call
            # sandbox. Calls waiting for this start fail with the same reason.
            box.start_failed = why
            self._retire(box, f"its zygote did not start ({why})")
            raise IOFailure(f"fncall zygote for {box.image} did not start ({why}); retry") from err
        if info.get("failed"):
            log.warning("zygote for %s could not import %s", box.image, info["failed"])
        if conf["own_ipc"] and not info.get("own_ipc"):
            log.warning("zygote for %s cannot give calls an IPC namespace each (its python3 has neither "
                        "os.unshare nor ctypes, or unshare failed): its calls share SysV IPC and message "
                        "queues while they run", box.image)
        if fc["own_net"] and not info.get("own_net"):
            log.warning("zygote for %s cannot give calls a net namespace each (fncall.own_net needs "
                        "sandbox.userns, the default seccomp profile, and os.unshare or ctypes in the image's "
                        "python3): its calls share the call sandbox's loopback while they run", box.image)
        log.info("zygote %d for image %s ready (modules %s)", pid, box.image, info.get("modules"))
        return zyg

    def _image_changed(self, key: str) -> None:
        """An image name now stands for another manifest, or for none (from
        the thread that changed it): its next call makes a call sandbox of
        what it names now; calls running in the old one end there, and one
        being made of the old one is made again (_call_box)."""
        def retire() -> None:
            if key in self._rebuilt:
                self._rebuilt[key] = True
            box = self.call_boxes.get(key)
            if box is not None:
                self._retire(box, "its image name was rebuilt or removed", drain=True)

        self.workers.loop.call_soon_threadsafe(retire)

    def _on_zygote_exit(self, box: CallBox, zyg: Zygote) -> None:
        zyg.fail(f"zygote {zyg.pid} exited")
        self._close_zygote(zyg)
        # Its running children now belong to the sandbox's init: only dropping
        # the whole call sandbox ends them. The next call makes a new one.
        self._retire(box, "zygote exited")

    def _close_zygote(self, zyg: Zygote) -> None:
        if zyg.pidfd >= 0:
            self.workers.loop.remove_reader(zyg.pidfd)
            os.close(zyg.pidfd)
            zyg.pidfd = -1
            self.workers.behind(reap, zyg.pid)
        if zyg.sock.fileno() >= 0:
            self.workers.loop.remove_reader(zyg.sock.fileno())
            zyg.sock.close()

    def _retire(self, box: CallBox, why: str, drain: bool = False) -> asyncio.Task | None:
        """The next call of its image makes a new call sandbox; this one goes
        now, with the calls running in it, or with `drain` (a recycle: the
        zygote is sound) once the last of them has ended. The task dropping
        it now, if it does."""
        if self.call_boxes.get(box.image) is box:
            del self.call_boxes[box.image]
            self.call_stats["zygotes_replaced"] += 1 if box.zygote else 0
            if drain and box.running:
                log.info("call sandbox %s of %s: %s; it goes once its %d running calls end",
                         box.id, box.image, why, box.running)
                self._draining[box.id] = (box, why)
                return None
            return self.workers.loop.create_task(self._drop_box(box, why))
        return None

    async def _drop_box(self, box: CallBox, why: str) -> None:
        log.info("dropping call sandbox %s of %s: %s", box.id, box.image, why)
        if box.zygote:
            box.zygote.fail(why)
            self._close_zygote(box.zygote)
        # Its plain calls' clean-ups stop at their next step; what one runs
        # in a worker meanwhile uses the fds closed below, and the ids its
        # range (given back below) may soon name in another sandbox.
        box.dropping = True
        if box.cleanups:
            await asyncio.gather(*list(box.cleanups), return_exceptions=True)
        h, box.handle = box.handle, None
        if h is None:
            return
        if box.mq_fd >= 0:
            os.close(box.mq_fd)
            box.mq_fd = -1
        await self._destroy_and_give_back(box.id, h, box.layers, box.idmap)

    # ------------------------------------------------------------ one call

    def _call_io(self, stdin: bytes) -> tuple[ExecIO, dict]:
        collected: dict[int, list[bytes]] = {1: [], 2: []}

        async def emit(stream: int, data: bytes) -> None:
            collected[stream].append(data)

        io = ExecIO(self.workers.loop, self.exec_limits.max_output, emit, bool(stdin))
        return io, collected

    async def _zygote_call(self, box: CallBox, zyg: Zygote, argv: list[str], code: str | None,
                           env: dict, stdin: bytes, timeout: float) -> dict:
        run = Collector(self.workers.loop, self.exec_limits.max_output, self.exec_limits.drain_grace_s,
                        self.fn_cfg["kill_grace_s"], path="zygote")
        call_id = zyg.calls = zyg.calls + 1
        extra = []          # memfds of this call (stdin, large code), closed once sent
        try:
            # stdin as a memfd: the whole input is there before the call starts,
            # so there is no feeder to run and no pipe to keep full.
            stdin_fd = _memfd("fncall-stdin", stdin, extra) if stdin else self.devnull
            fds = [stdin_fd, *run.child_ends]
            msg = {"op": "call", "id": call_id, "argv": argv, "code": code is not None,
                   "cpu_s": int(timeout) + 1, "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", **box.env, **env}}
            data = json.dumps({**msg, "src": code} if code is not None else msg).encode()
            if len(data) > INLINE_MAX:
                # The zygote and the worker read packets of at most 64 KiB: a
                # larger request (its code, argv or env) is read from a memfd.
                fds.append(_memfd("fncall-call", data, extra))
                data = json.dumps({"op": "call", "id": call_id, "in_memfd": True}).encode()
            exited = self.workers.loop.create_future()
            zyg.pending[call_id] = exited
            try:
                await zyg.send_call(data, fds)
            except OSError as err:
                zyg.pending.pop(call_id, None)
                zyg.fail(f"send to zygote {zyg.pid}: {err}")
                self._retire(box, "its socket failed")
                raise IOFailure(f"fncall zygote for {box.image} is gone; retry") from err
            except ZygoteDied as err:
                raise IOFailure(f"fncall zygote for {box.image} died before the call started ({err}); "
                                "retry") from err
            except asyncio.CancelledError:
                zyg.pending.pop(call_id, None)
                raise
        except BaseException:
            run.close()
            raise
        finally:
            for fd in extra:
                os.close(fd)
        run.close_child_ends()

        def kill() -> None:
            if zyg.alive:
                try:
                    zyg.send({"op": "kill", "id": call_id})
                except OSError:
                    pass

        self.call_stats["zygote_calls"] += 1
        run.start(exited, kill, timeout)
        try:
            return await run.done
        except asyncio.CancelledError:
            kill()
            raise
        except TimeoutError as err:
            # This call's end is no longer awaited: out of pending before the
            # fail, which would set an error on it that nothing retrieves.
            zyg.pending.pop(call_id, None)
            zyg.fail(f"zygote {zyg.pid} did not end call {call_id} after a kill")
            self._retire(box, "unresponsive zygote")
            raise IOFailure(f"fncall zygote for {box.image} stopped answering; retry") from err
        except ZygoteDied as err:
            raise IOFailure(f"fncall zygote for {box.image} died during the call ({err}); retry") from err
        except OSError as err:        # the zygote could not fork
            why = (f"fncall: the zygote for {box.image} could not fork a worker for the call ({err}): its call "
                   "sandbox is at fncall.pids or fncall.memory (shared by every call of the image), or every "
                   "fncall uid is in use; retry")
            if err.errno == errno.EAGAIN:      # no pid or uid until running calls end: as a plain call's
                raise Busy(why, {"retry_after_s": 0.05}) from err
            raise DsecError(why, code="io") from err
        finally:
            zyg.pending.pop(call_id, None)
            run.close()

    async def _start_plain(self, box: CallBox, argv: list[str], envl: list[str], cwd: str, uid: int,
                           io: ExecIO, release):
        """The plain call's watch: sent to the call sandbox's init when its
        channel takes it (no thread, no entering the sandbox), else spawned
        by the daemon's helper (`release`: see spawn_handed_over)."""
        watch = self.starter.send_to_init(self.fncall.start_plain_by_init, box.handle, argv, envl, cwd, uid, io,
                                  io.child_fds(), "call")
        if watch is not None:
            self.call_stats["plain_calls_by_init"] += 1
            return watch
        pid = await self.starter.spawn_by_helper(io, release, self.fncall.spawn_plain, box.handle, argv, envl, cwd, uid,
                                         io.child_fds(), "call")
        return ChildWatch(self.workers.loop, pid)

    async def _plain_call(self, box: CallBox, argv: list[str], env: dict, stdin: bytes, timeout: float) -> dict:
        h = box.handle
        name = f"call-{secrets.token_hex(6)}"
        if not box.free_uids:
            raise Busy(f"every fncall uid of {box.image} is in use", {"retry_after_s": 0.05})
        uid = box.free_uids.pop()
        try:
            cwd = await self.workers.run(self.fncall.make_private_dir, h, name, box.host_ids(uid))
        except OSError as err:
            box.free_uids.append(uid)
            raise io_error("make the private dir of a call in", box.id, err) from err
        io, out = self._call_io(stdin)

        def release() -> None:
            cleanup = self.workers.loop.create_task(self._give_back(box, uid, name))
            box.cleanups.add(cleanup)
            cleanup.add_done_callback(box.cleanups.discard)

        abandoned = False
        try:
            envl = self.fncall.containers.exec_env({**box.env, "HOSTNAME": "fncall"},
                                                   {"HOME": cwd, "TMPDIR": cwd, **env})
            try:
                watch = await self._start_plain(box, argv, envl, cwd, uid, io, release)
            except asyncio.CancelledError:
                # Only the helper's spawn awaits: it goes on in its worker, and
                # `release` runs once a process it made anyway is killed and reaped.
                abandoned = True
                raise
            except DsecError as err:            # the helper's spawn: exec_error of its NativeError
                ended = _ended_as_sh_says(err.__cause__, argv[0], envl)
                if ended is None:
                    raise
                return ended
            if stdin:
                await io.feed_stdin(stdin, True)
            self.call_stats["plain_calls"] += 1
            try:
                result = await io.run(watch, timeout, self.exec_limits.drain_grace_s)
            except OSError as err:
                if not isinstance(err, NativeError):
                    # Not "init could not start it": its channel broke, or its
                    # end never came after a kill. It may still run under this
                    # uid, so the uid is never handed out again: the call
                    # sandbox goes (and the process with it).
                    abandoned = True
                    self._retire(box, f"lost track of a plain call: {err}")
                ended = _ended_as_sh_says(err, argv[0], envl)
                if ended is not None:
                    return ended
                raise _plain_run_error(err, box, argv[0], cwd) from err
        finally:
            io.close()
            if io.reaped is not None:        # cancelled while it ran: killed, gone once this is done
                io.reaped.add_done_callback(lambda _fut: release())
            elif not abandoned:
                release()
        result.update(stdout=b"".join(out[1]), stderr=b"".join(out[2]), path="exec",
                      run_ms=result["duration_ms"])
        return result


    async def _give_back(self, box: CallBox, uid: int, private_dir: str) -> None:
        """A plain call's uid back to its box, once nothing it started runs
        and what it left (its dir /tmp/`private_dir`, /dev/shm, SysV IPC,
        message queues) is gone, removed after its leftovers are killed (one
        could write on meanwhile): what it left running
        (reparented to the call sandbox's init) is killed first, and the uid
        waits while any of it, or what that in turn leaves to init, is still
        there. In a worker: it reads the status of each of init's children,
        as many as plain calls run."""
        host_uid = box.host_ids(uid)[0]
        for _ in range(LEFTOVER_LOOKS):
            if box.dropping:        # its sandbox goes, and what runs in it
                return
            if not await self.workers.run(self.fncall.kill_leftovers, box.handle, host_uid, box.idmap is not None):
                await self._give_back_clean(box, uid, host_uid, private_dir)
                return
            await asyncio.sleep(LEFTOVER_RECHECK_S)
        log.warning("call sandbox %s: uid %d still runs processes after %d kills; it is not handed out again",
                    box.id, uid, LEFTOVER_LOOKS)

    async def _give_back_clean(self, box: CallBox, uid: int, host_uid: int, private_dir: str) -> None:
        """The uid back once what its call left is removed, tried again every
        CLEANUP_RETRY_S (another call can keep it in place for a while: a
        file in that call's writable dir, a tree it deepens), and given up
        after CLEANUP_TRIES (as the zygote does)."""
        for _ in range(CLEANUP_TRIES):
            if box.dropping:
                return
            if await self.workers.run(self._remove_left, box, host_uid, private_dir):
                box.free_uids.append(uid)
                return
            await asyncio.sleep(CLEANUP_RETRY_S)
        log.warning("call sandbox %s: what uid %d left in its dir, /dev/shm, SysV IPC or message queues could not "
                    "be removed in %d tries; it is not handed out again", box.id, uid, CLEANUP_TRIES)

    def _remove_left(self, box: CallBox, host_uid: int, private_dir: str) -> bool:
        """What a plain call left in its dir, /dev/shm, SysV IPC and message
        queues, removed (a worker). In an IPC namespace of its own (own_ipc:
        FnCallBackend.spawn_plain) its SysV objects and message queues went
        with its last process, killed before this: only its dir and /dev/shm
        are left to look at."""
        own = self.fncall.remove_private_dir(box.handle, private_dir)
        ipc = mq = True
        if not self.fncall.own_ipc(box.handle):
            try:
                ipc = self.fncall.remove_ipc(box.handle, host_uid)
            except OSError:
                ipc = False
            mq = self.fncall.remove_mqueues(box.mq_fd, host_uid)
        return self.fncall.remove_shm_files(box.handle, host_uid) and ipc and mq and own


def _ended_as_sh_says(err: BaseException | None, prog: str, envl: list[str]) -> dict | None:
    """The result of a plain call whose program could not run (`envl`: the
    environment it was given), as a call through the zygote ends
    (zygote_main.worker) and as sh says it: 127 and `not found` when it
    does not exist, 126 when it cannot be run; None for any other failure."""
    if not isinstance(err, NativeError) or "exec" not in (err.step or "") or \
            err.errno not in (errno.ENOENT, errno.EACCES, errno.ENOEXEC):
        return None
    status, message = cannot_run(prog, err.errno, next((e[5:] for e in envl if e.startswith("PATH=")), os.defpath))
    return {"exit_code": status, "signal": None, "timed_out": False, "truncated": False,
            "cancelled": False, "duration_ms": 0.0, "stdout": b"", "stderr": os.fsencode(message), "path": "exec",
            "run_ms": 0.0}


def _plain_run_error(err: OSError, box: CallBox, prog: str, cwd: str) -> DsecError:
    """A plain call that failed after it was handed to its watch: init could
    not start it (NativeError of its step, as errors.run_error), or the
    daemon lost track of it (its call sandbox is being replaced: retry)."""
    if started_by_step(err):
        return exec_error(err, prog, cwd)
    return IOFailure(f"call {prog!r}: lost track of it in call sandbox {box.id} ({err}); the call sandbox "
                     f"is replaced, retry", {"errno": errno.errorcode.get(err.errno or 0)})


def _memfd(name: str, data: bytes, opened: list[int]) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    opened.append(fd)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd

