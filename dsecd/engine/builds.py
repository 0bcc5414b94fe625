"""Dockerfile builds (`image_build_dockerfile`): a Dockerfile and a build
context on this host -> a named image, one layer per filesystem step.

The Dockerfile is parsed and planned whole first (dsecd/build/plan.py), and
every COPY/ADD source is found and hashed (dsecd/build/context.py), so a
mistake anywhere fails before anything runs. Then, step by step:

- a step whose key is in the build cache takes the cached image
  (dsecd/fs/buildcache.py). The key is the sha256 of the parent image's
  manifest digest, the instruction after expansion (and for RUN the
  environment it runs with), and for COPY/ADD the content hash of the files
  it copies: a change reruns that step and every step after it, nothing
  before;
- a config step (ENV, ARG, USER, LABEL, EXPOSE, CMD, ENTRYPOINT, SHELL)
  writes a manifest with the same layers and the new config;
- a filesystem step (RUN, COPY, ADD, WORKDIR) makes a sandbox of the image
  so far through the create service (the create queue, isolation, limits of
  [build]; RUN gets `--net default` with the build's allow rules when it has
  some, else `--net none`), runs the command through the exec service as
  the USER so far (output streamed to the client) or writes the files from
  the host (dsecd/build/copyin.py), then packs the sandbox's writable layer
  as the step's layer, as a snapshot does, and destroys the sandbox.

The name is published last and replaces an image of that name (as `docker
build -t`); sandboxes of the old image keep it. Blobs the build relies on
are pinned against `image gc` until then. Progress is streamed as events
(docs/protocol.md, image_build_dockerfile).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .. import fds, native, protocol, userns
from ..build import context as buildctx
from ..build import copyin
from ..build.dockerfile import DockerfileError, parse
from ..build.plan import COPY, META, RUN, WORKDIR, ImageConfig, Plan, Step, plan
from ..config import ConfigError, parse_size
from ..errors import BadRequest, DsecError, LimitExceeded, image_error, io_error
from ..fs import users
from ..fs.images import Image, ImageError, Pins
from .creates import BUILD_LABEL, CreateService
from .execs import ExecService, mapped_groups
from .images import ImageService, check_platform, count_image_op
from .network import NET_FILES
from .sandboxes import DESTROYED_BECAUSE, Sandbox, SandboxRegistry
from .workers import Workers, outcome

log = logging.getLogger(__name__)

BUILD_JOB = "dsec.build"         # their create-queue job
OUTPUT_TAIL = 4096               # bytes of a failed RUN's output its error carries
KEY_VERSION = 1                  # bump when what a step key hashes changes


@dataclass(frozen=True)
class BuildLimits:
    """[build]: the sandboxes of filesystem steps."""

    cpu: float
    memory: int
    disk: int
    run_timeout_s: float

    @classmethod
    def from_config(cls, cfg) -> BuildLimits:
        b = cfg.section("build")
        try:
            return cls(float(b["cpu"]), parse_size(b["memory"]), parse_size(b["disk"]), float(b["run_timeout_s"]))
        except ConfigError as err:
            raise ConfigError(f"[build]: {err}") from err


def step_key(parent: str, step: Step, content: str | None) -> str:
    """The build cache key of `step` on the image with manifest `parent`."""
    material = {"v": KEY_VERSION, "parent": parent, "text": step.text,
                "env": step.env if step.kind == RUN else None, "content": content}
    return "sha256:" + hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


class BuildService:
    """`image_build_dockerfile`. `destroy(sb, force)` is the lifecycle's."""

    def __init__(self, cfg, registry: SandboxRegistry, workers: Workers, images: ImageService,
                 creates: CreateService, execs: ExecService, destroy: Callable[[Sandbox, bool, str], Awaitable],
                 capped_layers: bool):
        self.registry = registry
        self.workers = workers
        self.images = images
        self.creates = creates
        self.execs = execs
        self.destroy = destroy
        self.limits = BuildLimits.from_config(cfg)
        self.rule_sets_cfg = cfg.section("net").get("rule_sets", {})    # what --allow NAME may name
        self.capped_layers = capped_layers        # writable layers are capped tmpfs: `disk` applies
        self.digests = buildctx.DigestCache()     # context file hashes, kept across builds

    async def start(self) -> None:
        """Remove the step sandboxes of builds a killed daemon ran: a build
        ends with its daemon, so nothing would use or destroy them before
        their TTL."""
        for sb in [s for s in self.registry.by_id.values() if BUILD_LABEL in s.labels]:
            log.info("removing sandbox %s of build %s, which ended with an earlier daemon",
                     sb.id, sb.labels[BUILD_LABEL])
            try:
                await self.destroy(sb, True, "build")
            except DsecError as err:
                log.error("build %s: destroy step sandbox %s: %s", sb.labels[BUILD_LABEL], sb.id, err)

    def check_allow(self, name: str, allow: list[str]) -> None:
        """BadRequest for a build's --allow rule that is no rule or rule
        set, at its start: not at its first RUN, after the steps before."""
        # Not at import: dsecd.net loads the BPF side.
        from ..net import rules as R

        try:
            R.merge((), R.parse_rule_sets(self.rule_sets_cfg), replace=list(allow))
        except DsecError as err:
            raise BadRequest(f"build of {name!r}: --allow: {err.message}", err.detail) from err

    async def build(self, req, ctx) -> dict:
        with count_image_op("dockerfile") as done:
            b = _Build(self, req, ctx)
            result = await b.run()
            done(b.named)
        return result


class _Build:
    """One build: its plan, pins, the image so far and what each step did."""

    def __init__(self, svc: BuildService, req, ctx):
        self.svc = svc
        self.req = req
        self.ctx = ctx
        self.store = svc.images.images
        self.filename = req.dockerfile_name or "Dockerfile"
        self.pins: Pins | None = None
        self.results: list[dict] = []
        self.total = 0
        self.named: Image | None = None          # the image published, once it is
        # The build context as the client sees it, attached while the build
        # runs (fs/clientpaths.py), when a COPY or ADD reads it. The lock
        # orders attach and detach, which run in workers: a build cancelled
        # while it attaches detaches after, and one detached attaches nothing.
        self._attached = contextlib.ExitStack()
        self._attach_lock = threading.Lock()
        self._detached = False

    # ------------------------------------------------------------ errors and events

    def _error(self, line: int, message: str, code: str = "bad_request", **detail) -> DsecError:
        return DsecError(f"{self.filename}:{line}: {message}", {"line": line, "file": self.filename, **detail},
                         code=code)

    async def _emit(self, event: str, **fields) -> None:
        await self.ctx.emit({"event": event, **fields})

    # ------------------------------------------------------------ the build

    async def run(self) -> dict:
        started = time.monotonic()
        req = self.req
        try:
            self.store.new_name(req.name)
        except ImageError as err:
            raise image_error(err) from err
        try:
            dockerfile = parse(req.dockerfile)
        except DockerfileError as err:
            raise self._error(err.line, err.message, err.code) from err
        self.svc.check_allow(req.name, req.allow)
        base_images: dict[str, Image] = {}
        try:
            build_plan = await self.svc.workers.run(plan, dockerfile, dict(req.build_args),
                                                    lambda name: self._base(name, base_images).config)
        except DockerfileError as err:
            raise self._error(err.line, err.message, err.code) from err
        except ImageError as err:
            line = next(i.line for i in dockerfile.instructions if i.cmd == "FROM")
            raise self._error(line, f"FROM: {err}", err.code) from err
        try:
            check_platform(build_plan.base, base_images[build_plan.base])
        except DsecError as err:
            raise self._error(build_plan.base_line, f"FROM {err.message}", err.code, **err.detail) from err
        try:
            sources = await self._find_sources(build_plan)
            self.total = 1 + len(build_plan.steps)
            for step in build_plan.steps:
                for pattern in sources[step.n][2] if step.n in sources else ():
                    await self._emit("warning", step=step.n, message=f"line {step.line}: {step.instruction.cmd} "
                                     f"{pattern}: no file of the build context matches it (or .dockerignore "
                                     "excludes them); nothing is copied for it")
            if build_plan.unused_build_args:
                await self._emit("warning", message="build arguments no ARG declares: "
                                 + ", ".join(build_plan.unused_build_args))
            self.pins = self.store.pins()
            try:
                image = await self._from(build_plan, base_images[build_plan.base])
                for step in build_plan.steps:
                    image = await self._step(step, image, sources.get(step.n))
                named, before = await self._publish(image, build_plan.base, base_images[build_plan.base])
                self.named = named
            finally:
                # Submitted at once and shielded: a cancelled build still unpins.
                await asyncio.shield(self.svc.workers.behind(self.pins.release))
        finally:
            # Submitted at once and shielded, as the unpin above.
            await asyncio.shield(self.svc.workers.behind(self._detach_context))
        return {**named.to_dict(), "steps": self.results, "seconds": round(time.monotonic() - started, 3),
                "replaced": before if before != named.manifest else None,
                "unused_build_args": build_plan.unused_build_args}

    def _base(self, name: str, found: dict[str, Image]) -> Image:
        """The FROM image (in a worker, from the planner)."""
        found[name] = self.store.get(name)
        return found[name]

    async def _publish(self, image: Image, base: str, base_image: Image) -> tuple[Image, str | None]:
        """Name the built image `req.name` (moved if taken): (the image, the
        manifest the name had). The publish runs on in its worker when the
        build is cancelled; the event it is given, set then, is looked at
        just before the name is linked: a cancel that comes before that
        publishes nothing."""
        cancelled = threading.Event()
        try:
            return await self._store_call(self.store.publish, self.req.name, image.manifest, base, True,
                                          cancelled, base_image.manifest)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def _store_call(self, fn, *args):
        try:
            return await self.svc.workers.run(fn, *args)
        except ImageError as err:
            raise image_error(err) from err

    async def _find_sources(self, build_plan: Plan) -> dict[int, tuple[list[buildctx.Source], str, list[str]]]:
        """Step number -> (its sources, their content hash, its globs that
        matched nothing), for every COPY/ADD, found and hashed before the
        first step runs."""
        copies = [s for s in build_plan.steps if s.kind == COPY]
        req = self.req

        # Attached and opened even with no COPY: a context that is no
        # directory (a typo) is said now, as docker build says it, not
        # taken for one nothing was copied from.
        where = await self._attach_context()

        # A client other than root: everything below the context's top is
        # looked up, listed and opened with its ids, now and when a COPY
        # reads it (context.ContextRoot).
        reader = native.Reader(*self.ctx.peer_ids) if self.ctx.peer_ids is not None else None
        # Set when the build is cancelled (its client gone, or a cancel):
        # the hashing, which may read a lot, ends at its next chunk.
        stop = threading.Event()
        max_layer_bytes = self.store.max_layer_bytes

        def find() -> dict:
            context = buildctx.BuildContext.open(where, shown=req.context, reader=reader)
            out = {}
            for step in copies:
                try:
                    matched = [(pattern, context.sources(pattern)) for pattern in step.sources]
                    found = [src for _, srcs in matched for src in srcs]
                    if len(found) > 1 and not step.dest.endswith("/"):
                        raise buildctx.ContextError(
                            f"{len(found)} sources ({', '.join(s.rel for s in found[:4])}"
                            f"{', ...' if len(found) > 4 else ''}): the destination must be a directory "
                            f"ending in /, not {step.instruction.args.split()[-1]!r}")
                    out[step.n] = (found, context.digest(found, self.svc.digests, stop, max_layer_bytes),
                                   [pattern for pattern, srcs in matched if not srcs])
                except buildctx.SourcesTooLarge as err:
                    raise LimitExceeded(f"{self.filename}:{step.line}: {step.instruction}: {err}",
                                        {"line": step.line, "file": self.filename, "files": err.files,
                                         "size": err.size, "max_bytes": err.max_bytes}) from err
                except buildctx.SourceTooLarge as err:
                    raise LimitExceeded(f"{self.filename}:{step.line}: {step.instruction.cmd} {err}",
                                        {"line": step.line, "file": self.filename, "path": err.rel,
                                         "size": err.size, "max_bytes": err.max_bytes}) from err
                except buildctx.ContextError as err:
                    raise self._error(step.line, f"{step.instruction.cmd} {err}") from err
            return out

        try:
            return await self.svc.workers.run_stoppable(stop, find)
        except buildctx.ContextError as err:      # the context itself (not a directory, ...)
            raise BadRequest(str(err), {"context": req.context}) from err
        except OSError as err:
            raise io_error("read the build context", req.context, err) from err

    async def _attach_context(self) -> str:
        """Where the daemon reads the build context: the client's path as the
        client sees it, attached until the build ends (fs/clientpaths.py)."""
        context = self.req.context
        if not os.path.isabs(context):
            raise BadRequest(f"the build context must be an absolute path on the daemon's host, got {context!r}",
                             {"context": context})

        def attach() -> str:
            with self._attach_lock:
                if self._detached:
                    raise ImageError("conflict", "the build ended before its context was attached")
                return self._attached.enter_context(self.svc.images.client_path(self.ctx, context,
                                                                                "build context", "context"))

        try:
            return await self.svc.workers.run(attach)
        except ImageError as err:
            raise DsecError(str(err), err.detail or {"context": context}, code=err.code) from err

    def _detach_context(self) -> None:
        with self._attach_lock:
            self._detached = True
            self._attached.close()

    async def _from(self, build_plan: Plan, base: Image) -> Image:
        """Step 1: the base image, with its config in the form builds write."""
        t0 = time.monotonic()
        await self._emit("step", step=1, of=self.total, line=build_plan.base_line,
                         instruction=f"FROM {build_plan.base}")

        def pin_base() -> Image:
            for layer in base.layers:
                self.pins.hold(layer["digest"])
                if not self.store.store.exists(layer["digest"]):
                    raise ImageError("not_found", f"layer {layer['digest']} of image {base.name!r} is missing "
                                     "from the store; build that image again")
            digest = self.store.put_manifest(base.layers, ImageConfig.of(base.config).to_dict(), self.pins.hold)
            return self.store.get_manifest(digest, self._display())

        try:
            image = await self.svc.workers.run(pin_base)
        except ImageError as err:
            raise self._error(build_plan.base_line, f"FROM {build_plan.base}: {err}", err.code) from err
        await self._done(1, build_plan.base_line, f"FROM {build_plan.base}", True, t0, None)
        return image

    def _display(self) -> str:
        return f"build:{self.req.name}"

    async def _done(self, n: int, line: int, text: str, cached: bool, t0: float, layer: str | None) -> None:
        seconds = round(time.monotonic() - t0, 3)
        self.results.append({"step": n, "line": line, "instruction": text, "cached": cached,
                             "seconds": seconds, "layer": layer})
        await self._emit("step_done", step=n, of=self.total, cached=cached, seconds=seconds, layer=layer)

    async def _step(self, step: Step, image: Image, sources) -> Image:
        t0 = time.monotonic()
        shown = str(step.instruction)
        await self._emit("step", step=step.n, of=self.total, line=step.line, instruction=shown)
        key = step_key(image.manifest, step, sources[1] if sources else None)
        if not self.req.no_cache:
            cached = await self._store_call(self.store.cache_lookup, key, self.pins.hold)
            if cached is not None:
                await self._done(step.n, step.line, shown, True, t0, self._new_layer(image, cached))
                return cached
        layer = None
        if step.kind != META:
            layer = await self._in_sandbox(step, image, sources[0] if sources else [])
        layers = image.layers + ([layer] if layer else [])
        manifest = await self._store_call(self.store.put_manifest, layers, step.config.to_dict(), self.pins.hold)
        await self.svc.workers.run(self.store.cache_record, key, manifest)
        new = await self._store_call(self.store.get_manifest, manifest, self._display())
        await self._done(step.n, step.line, shown, False, t0, layer["digest"] if layer else None)
        return new

    @staticmethod
    def _new_layer(parent: Image, child: Image) -> str | None:
        return child.layers[-1]["digest"] if len(child.layers) > len(parent.layers) else None

    # ------------------------------------------------------------ filesystem steps

    async def _in_sandbox(self, step: Step, image: Image, sources: list[buildctx.Source]) -> dict | None:
        """Run a filesystem step in a fresh sandbox of `image`; its layer, or
        None when it changed nothing."""
        networked = step.kind == RUN and bool(self.req.allow)
        sb = await self._sandbox(step, image, networked)
        try:
            if step.kind == RUN:
                await self._run(sb, step)
            elif step.kind == COPY:
                await self._copy(sb, step, sources)
            elif step.kind == WORKDIR:
                await self._workdir(sb, step)
            exclude = list(self.svc.images.snapshot_exclude) + (list(NET_FILES) if networked else [])
            try:
                async with self.svc.images.frozen_upper(sb) as upper:
                    return await self._pack(upper, exclude)
            except DsecError as err:
                # A destroy from outside the build (`dsec rm --all`, a job's
                # rm) took the step's sandbox before or while it was frozen:
                # the freeze's or the state check's own words would not say so.
                if self.svc.registry.destroyed_error(sb, "") is not None:
                    raise self._error(step.line, f"pack the changes of {step.instruction.cmd}: the step's "
                                      f"sandbox {sb.id} was destroyed meanwhile", err.code, sandbox=sb.id) from err
                raise self._error(step.line, f"pack the changes of {step.instruction.cmd}: {err.message}",
                                  err.code) from err
        finally:
            # One destroyed from outside the build meanwhile is not the
            # build's to destroy: a second destroy is refused ("already being
            # destroyed"), which is no error of this daemon to log.
            if self.svc.registry.destroyed_error(sb, "") is None:
                try:
                    await self.svc.destroy(sb, True, "build")
                except DsecError as err:
                    log.error("build %s: destroy step sandbox %s: %s", self.req.name, sb.id, err)

    async def _pack(self, upper, exclude: list[str]) -> dict | None:
        """The step's layer, packed from `upper` in a worker. Cancelled, the
        pack (mkfs.erofs, which this lets run to its end) is waited for: the
        view of the sandbox's layer it reads is removed, and the sandbox
        destroyed, only once it has ended."""
        packing = asyncio.ensure_future(self._store_call(self.store.pack_layer, upper, exclude, self.pins.hold,
                                                         None, self.svc.images.max_snapshot_bytes))
        try:
            return await asyncio.shield(packing)
        except asyncio.CancelledError:
            await outcome(packing)
            raise

    async def _sandbox(self, step: Step, image: Image, networked: bool) -> Sandbox:
        limits = self.svc.limits
        ttl = limits.run_timeout_s + 600 if limits.run_timeout_s else None
        create = protocol.Create(image=self._display(), cpu=limits.cpu, memory=limits.memory,
                                 disk=limits.disk if self.svc.capped_layers else None,
                                 net="default" if networked else "none",
                                 allow=list(self.req.allow) if networked else [],
                                 labels={BUILD_LABEL: self.req.name, "job": BUILD_JOB}, ttl=ttl)
        try:
            made = await self.svc.creates.create_of(create, image)
        except DsecError as err:
            raise self._error(step.line, f"{step.instruction.cmd}: make the step's sandbox: {err.message}",
                              err.code, **err.detail) from err
        return self.svc.registry.by_id[made["id"]]

    async def _files(self, sb: Sandbox, step: Step, fn, *args, stop: threading.Event | None = None):
        """fn(root, *args), a copyin function on `sb`'s root, as its root
        user, in a worker. A cancel (the client gone, `cancel`) sets `stop`,
        which a copy checks between entries and chunks, and waits for fn to
        return: the step's sandbox is destroyed (what fn wrote goes with it)
        only once nothing writes any more. `root` is the worker's own copy
        of the sandbox's root fd (Sandbox.root_copy), closed when fn
        returns: a destroy from elsewhere (all, a job's) closes the
        handle's, whose number another sandbox's root may take."""
        idmap = userns.IdMap.from_record(sb.idmap)
        try:
            root = sb.root_copy()
        except DsecError as err:
            # A destroy from outside the build (`dsec rm --all`, a job's rm)
            # took the step's sandbox, or the daemon is out of fds.
            if self.svc.registry.destroyed_error(sb, "") is not None:
                raise self._error(step.line, f"{step.instruction.cmd}: the step's sandbox {sb.id} was destroyed "
                                  "meanwhile", err.code, sandbox=sb.id) from err
            raise self._error(step.line, f"{step.instruction.cmd}: {err.message}", err.code, **err.detail) from err

        def call():
            with userns.as_sandbox_root(idmap):
                return fn(root, *args)

        try:
            return await self.svc.workers.run_stoppable(stop or threading.Event(), fds.call_closing, root, call)
        except copyin.CopyTooLarge as err:
            raise LimitExceeded(f"{self.filename}:{step.line}: {step.instruction}: {err}",
                                {"line": step.line, "file": self.filename, "max_bytes": err.max_bytes}) from err
        except (copyin.CopyError, buildctx.ContextError) as err:     # ContextError: a source opened again
            raise self._error(step.line, f"{step.instruction.cmd}: {err}") from err
        except OSError as err:
            raise self._error(step.line, f"{step.instruction.cmd}: {err.strerror or err}", "io",
                              errno=getattr(err, "errno", None)) from err

    @staticmethod
    def _ids(sb: Sandbox, spec: str, ids: tuple[int, int]) -> tuple[int, int, int, int]:
        """(uid, gid) `ids` of a USER or --chown `spec` in the image, and the
        host ids `sb` stores them as (its user namespace's mapping)."""
        uid, gid = ids
        idmap = userns.IdMap.from_record(sb.idmap)
        if idmap is None:
            return uid, gid, uid, gid
        if uid >= idmap.count or gid >= idmap.count:
            raise copyin.CopyError(f"{spec}: ids {uid}:{gid} are past the ids a sandbox maps "
                                   f"(0..{idmap.count - 1}, sandbox.userns_size)")
        return uid, gid, idmap.uid + uid, idmap.gid + gid

    async def _run(self, sb: Sandbox, step: Step) -> None:
        accounts = await self._files(sb, step, copyin.Accounts.read)
        try:
            named = accounts.process_ids(step.config.user)
            uid, gid = self._ids(sb, step.config.user, (named.uid, named.gid))[:2]
            idmap = userns.IdMap.from_record(sb.idmap)
            ids = users.ProcessIds(uid, gid, mapped_groups(named.groups, idmap.count if idmap else None))
        except copyin.CopyError as err:
            raise self._error(step.line, f"RUN as USER {step.config.user}: {err}") from err
        env = dict(step.env)
        env.setdefault("HOME", accounts.home(step.config.user) or ("/root" if uid == 0 else "/"))
        tail = bytearray()

        async def output(fd: int, data: bytes) -> None:
            tail.extend(data)
            del tail[:-OUTPUT_TAIL]
            await self._emit("output", step=step.n, fd=fd, data=bytes(data))

        timeout = self.svc.limits.run_timeout_s or None
        try:
            result = await self.svc.execs.run_streamed(sb, step.argv, env, step.config.cwd, ids, timeout,
                                                       output)
        except DsecError as err:
            raise self._error(step.line, f"RUN {step.argv[-1] if step.instruction.form is None else step.argv}: "
                              f"{err.message}", err.code, **err.detail) from err
        text = bytes(tail).decode(errors="replace")
        if result.get("timed_out"):
            raise self._error(step.line, f"RUN did not finish in {timeout:g} s ([build] run_timeout_s); "
                              "it was killed", "io", output_tail=text)
        if result.get("killed_by") == "destroy":
            # By a destroy from outside the build (`dsec rm --all`, a job's
            # rm, its TTL): no failure of the command's own.
            by = result.get("destroyed_by")
            why = f", {DESTROYED_BECAUSE.get(by, by)}" if by else ""
            raise self._error(step.line, f"RUN: the step's sandbox {sb.id} was destroyed meanwhile{why}", "conflict",
                              sandbox=sb.id, destroyed=by, output_tail=text)
        if result.get("killed_by") == "oom":
            raise self._error(step.line, "RUN was killed at the step sandbox's memory limit ([build] memory = "
                              f"{self.svc.limits.memory / 2**20:g} MiB; the kernel's OOM killer took it): raise "
                              f"[build] memory or make the RUN use less: {step.instruction.args[:200]}", "io",
                              exit_code=None, signal=result.get("signal"), killed_by="oom", output_tail=text)
        if result.get("exit_code") != 0:
            how = (f"exit code {result['exit_code']}" if result.get("exit_code") is not None
                   else f"signal {result.get('signal')}")
            raise self._error(step.line, f"RUN failed with {how}: {step.instruction.args[:200]}", "io",
                              exit_code=result.get("exit_code"), signal=result.get("signal"), output_tail=text)

    async def _workdir(self, sb: Sandbox, step: Step) -> None:
        """The WORKDIR made where missing, owned by the USER so far (as BuildKit
        makes it; root's when there is none)."""
        owner = None
        if step.config.user.partition(":")[0] not in ("0", "root"):
            accounts = await self._files(sb, step, copyin.Accounts.read)
            try:
                owner = self._ids(sb, step.config.user, accounts.owner(step.config.user))[2:]
            except copyin.CopyError as err:
                raise self._error(step.line, f"WORKDIR as USER {step.config.user}: {err}") from err
        await self._files(sb, step, copyin.make_dirs, step.dest, 0o755, owner)

    async def _copy(self, sb: Sandbox, step: Step, sources: list[buildctx.Source]) -> None:
        owner = None
        if step.chown is not None:
            accounts = await self._files(sb, step, copyin.Accounts.read)
            try:
                owner = self._ids(sb, step.chown, accounts.owner(step.chown))[2:]
            except copyin.CopyError as err:
                raise self._error(step.line, f"{step.instruction.cmd} --chown: {err}") from err
        idmap = userns.IdMap.from_record(sb.idmap)

        def to_host(uid: int, gid: int) -> tuple[int, int]:
            return (idmap.uid + uid, idmap.gid + gid) if idmap else (uid, gid)

        # Set by a cancel of the build: the copy stops at its next entry or chunk.
        stop = threading.Event()
        budget = copyin.LayerBudget(self.store.max_layer_bytes)

        def copy(rootfd: int) -> copyin.Counts:
            total = copyin.Counts()
            for src in sources:
                counts = None
                if step.add and not src.is_dir:
                    with open(src.open(src.entries[0]), "rb") as f:
                        if copyin.is_archive(f):
                            hashed = copyin.HashedReader(f, src.digests.get(""), src.rel, stop)
                            try:
                                counts = copyin.extract_archive(rootfd, hashed, src.rel, step.dest, owner,
                                                                to_host, idmap.count if idmap else None, stop,
                                                                budget)
                                hashed.check()
                            except copyin.CopyStopped:
                                raise
                            except Exception:
                                # check() reads the archive to its end only after
                                # the extraction: one that failed first may have
                                # read other bytes than the step's key hashed,
                                # under the times the cached digest was kept by.
                                st = os.fstat(f.fileno())
                                self.svc.digests.forget((st.st_dev, st.st_ino))
                                raise
                            total.skipped.extend(counts.skipped)
                if counts is None:
                    counts = copyin.copy_sources(rootfd, [src], step.dest, owner, step.chmod, stop, budget)
                total.files += counts.files
                total.bytes += counts.bytes
            return total

        def checked_copy(rootfd: int) -> copyin.Counts:
            try:
                return copy(rootfd)
            except copyin.ChangedSinceHashed as err:
                self.svc.digests.forget(err.file)      # the next build hashes it again
                raise

        counts = await self._files(sb, step, checked_copy, stop=stop)
        if counts.skipped:
            await self._emit("warning", step=step.n, message=f"line {step.line}: {len(counts.skipped)} archive "
                             f"entries are devices or FIFOs and were not extracted: {', '.join(counts.skipped[:5])}")
