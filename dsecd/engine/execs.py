"""Execs in a sandbox: argument checks, the start (by the sandbox's init or
the daemon's helper: starts.py), output streamed or collected, stdin, the
timeout, and `dsec trace`'s ptrace record.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .. import tracing, userns
from ..errors import BadRequest, Conflict, DsecError, NotFound, io_error, run_error
from ..execio import ChildWatch, Collector, ExecIO, PtyIO, kill_and_reap
from ..initlink import InitExec
from .denials import DenialService, ExecRef
from .policies import Applied, PolicyService
from .sandboxes import Sandbox, SandboxRegistry
from .starts import ProcessStarter
from .workers import Workers

# Waits before retrying an exec that failed with ETXTBSY (ExecService.exec).
ETXTBSY_RETRY_S = (0.002, 0.01, 0.03, 0.1)


# A pty exec's window size when the request gives none, and the bound of
# each side (struct winsize holds unsigned shorts).
DEFAULT_WINDOW = (24, 80)
MAX_WINDOW_SIDE = 65535


def check_window(rows: int, cols: int) -> None:
    for name, value in (("rows", rows), ("cols", cols)):
        if not 1 <= value <= MAX_WINDOW_SIDE:
            raise BadRequest(f"{name} must be in [1, {MAX_WINDOW_SIDE}], got {value}",
                             {name: value, "max": MAX_WINDOW_SIDE})


def check_pty(req) -> None:
    """A pty exec's options: it streams, is not traced; rows and cols go with pty, together."""
    if not req.pty:
        if req.rows is not None or req.cols is not None:
            raise BadRequest("rows and cols are the window size of a terminal: give them with pty=true")
        return
    if not req.stream:
        raise BadRequest("a pty exec streams its output (one stream, fd 1): drop stream=false")
    if req.trace:
        raise BadRequest("a pty exec cannot be traced: the tracer's start-up stub has no terminal; "
                         "drop trace=true or pty=true")
    if (req.rows is None) != (req.cols is None):
        raise BadRequest("give both rows and cols of the window, or neither (default 24 x 80)")
    if req.rows is not None:
        check_window(req.rows, req.cols)


def check_env(env: dict) -> None:
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise BadRequest(f"bad environment variable name or value: {k!r}")


def exec_target(sb: Sandbox, req, backend) -> tuple[list[str], str, int]:
    """(env, cwd, user) of an exec or background process request (argv,
    env, cwd, user) in `sb`, checked: BadRequest names what is wrong."""
    if not req.argv or not all(req.argv):
        raise BadRequest("argv must be a non-empty list of non-empty strings")
    if any("\0" in a for a in req.argv):
        raise BadRequest("argv must not contain NUL bytes")
    check_env(req.env)
    cwd = req.cwd or sb.cwd
    if not cwd.startswith("/"):
        raise BadRequest(f"cwd must be an absolute path inside the sandbox, got {cwd!r}")
    user = sb.user if req.user is None else req.user
    idmap = userns.IdMap.from_record(sb.idmap)
    if idmap and not 0 <= user < idmap.count:
        raise BadRequest(f"user {user} does not exist in sandbox {sb.id}: its user namespace maps "
                         f"uids 0..{idmap.count - 1}", {"user": user, "userns_size": idmap.count})
    return backend.exec_env({"HOSTNAME": sb.hostname, **sb.env}, req.env), cwd, user


def _with_options(start, ctty: bool, applied: Applied | None, backend):
    """A backend's start or spawn with the options this exec needs (none: as it is)."""
    options: dict = {"ctty": True} if ctty else {}
    if applied is not None:
        if applied.plan is not None:
            options["policy"] = applied.plan
        if (caps := applied.cap_keep(backend.caps)) is not None:
            options["cap_keep"] = caps
    return functools.partial(start, **options) if options else start


@dataclass(frozen=True)
class ExecLimits:
    max_timeout_s: float           # limits.max_exec_timeout_s (0: none)
    drain_grace_s: float           # limits.exec_drain_grace_s
    max_output: int                # limits.max_exec_output_bytes
    max_trace: int                 # limits.max_trace_bytes

    @classmethod
    def from_config(cls, cfg) -> ExecLimits:
        limits = cfg.section("limits")
        return cls(limits["max_exec_timeout_s"], limits["exec_drain_grace_s"],
                   cfg.size("limits", "max_exec_output_bytes"), cfg.size("limits", "max_trace_bytes"))


class ExecService:
    """`exec`, `exec_input` and `exec_resize`. `ensure_running(sb, why)` resumes a paused
    sandbox first (the memory service's); `devnull` is the stdin of collected
    execs (the daemon's one read-only /dev/null); `policies` says which task
    policy each exec runs under, `denials` counts what those deny."""

    def __init__(self, registry: SandboxRegistry, workers: Workers, starter: ProcessStarter, backend,
                 ensure_running: Callable[[Sandbox, str], Awaitable[None]], limits: ExecLimits, devnull: int,
                 policies: PolicyService, denials: DenialService | None = None):
        self.policies = policies
        self.denials = denials
        self.registry = registry
        self.workers = workers
        self.starter = starter
        self.backend = backend
        self.ensure_running = ensure_running
        self.limits = limits
        self.devnull = devnull

    async def exec(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        check_pty(req)
        timeout = req.timeout
        max_t = self.limits.max_timeout_s
        if timeout is not None and not 0 < timeout <= (max_t or float("inf")):
            raise BadRequest(f"timeout must be in (0, {max_t}] seconds, got {timeout}")
        env, cwd, user = exec_target(sb, req, self.backend)
        applied = self.policies.for_exec(sb, req.policy)
        await self.ensure_running(sb, "exec")
        if not (req.stream or req.stdin or req.trace or req.pty):
            # ETXTBSY: the program is open for writing somewhere for a moment
            # (a write_file just answered, whose fd a spawn child copied with the
            # daemon's fd table before closing it: csrc/spawn.c fds_own; or the
            # sandbox's own writer). Nothing ran, so a short wait and a retry are safe.
            for delay in (*ETXTBSY_RETRY_S, None):
                try:
                    return await self._exec_collected(sb, list(req.argv), env, cwd, user, timeout, ctx, applied)
                except DsecError as err:
                    if delay is None or err.detail.get("errno") != "ETXTBSY":
                        raise
                await asyncio.sleep(delay)
        return await self._exec_streamed(sb, req, env, cwd, user, timeout, ctx, applied)

    async def _exec_streamed(self, sb: Sandbox, req, env: list[str], cwd: str, user: int,
                             timeout: float | None, ctx, applied: Applied | None) -> dict:
        """An exec that streams its output, takes stdin, is traced or has a
        terminal: one ExecIO (PtyIO for a terminal)."""
        loop = self.workers.loop
        collected: dict[int, list[bytes]] = {1: [], 2: []}

        async def emit(stream: int, data: bytes) -> None:
            if req.stream:
                await ctx.emit({"fd": stream, "data": data})
            else:
                collected[stream].append(data)

        ref = await self._counting(sb, applied, req.argv[0])
        if req.pty:
            rows, cols = DEFAULT_WINDOW if req.rows is None else (req.rows, req.cols)
            io = PtyIO(loop, emit, rows, cols)
        else:
            io = ExecIO(loop, self.limits.max_output, emit, req.stdin)
        sb.execs += 1
        ctx.register_exec(io)
        try:
            argv = tracing.traced_argv(req.argv) if req.trace else list(req.argv)
            # A traced exec needs the daemon's helper: the tracer attaches to the daemon's child.
            tracer = None
            watch = None if req.trace else self._start_by_init(sb, argv, env, cwd, user, io, io.child_fds(),
                                                               applied, req.pty)
            if watch is None:
                pid = await self._spawn_exec(sb, argv, env, cwd, user, io.child_fds(), io, applied, req.pty)
                if req.trace:
                    tracer = await self._start_tracer(pid, timeout)
                watch = ChildWatch(loop, pid)
                self._bind_helper(ref, pid)
            else:
                self._bind_init(ref, watch)
            try:
                result = await io.run(watch, timeout, self.limits.drain_grace_s)
            except OSError as err:
                raise run_error(err, sb.id, argv[0], cwd) from err
            if tracer is not None:
                result["trace"] = await self.workers.run(tracing.collect, tracer)
        finally:
            io.close()
            sb.execs -= 1
            sb.last_active = time.monotonic()
            ctx.unregister_exec()
        if not req.stream:
            result["stdout"] = b"".join(collected[1])
            result["stderr"] = b"".join(collected[2])
        self._finish(result, applied, ref)
        return result

    async def _exec_collected(self, sb: Sandbox, argv: list[str], env: list[str], cwd: str, user: int,
                              timeout: float | None, ctx, applied: Applied | None) -> dict:
        """An exec whose output comes back whole and that takes no stdin (most
        of them): collected by loop callbacks (dsecd/execio.py Collector), not
        by ExecIO's task per pipe; stdin is the daemon's /dev/null."""
        # kill_grace: the watch's (an exec of our own is waited for however long after its kill).
        ref = await self._counting(sb, applied, argv[0])
        run = Collector(self.workers.loop, self.limits.max_output, self.limits.drain_grace_s, None)
        sb.execs += 1
        ctx.register_exec(run)
        watch = None
        try:
            stdio = (self.devnull, *run.child_ends)
            watch = self._start_by_init(sb, argv, env, cwd, user, run, stdio, applied)
            if watch is None:
                watch = ChildWatch(self.workers.loop,
                                   await self._spawn_exec(sb, argv, env, cwd, user, stdio, run, applied))
                self._bind_helper(ref, watch.pid)
            else:
                self._bind_init(ref, watch)
            # Sent to init, the timeout counts from the send: a start init cannot finish is killed too.
            run.kill_grace = watch.kill_grace
            run.start(watch.exited, watch.kill, timeout)
            try:
                result = await run.done
            except OSError as err:
                raise run_error(err, sb.id, argv[0], cwd) from err
            self._finish(result, applied, ref)
            return result
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

    async def _counting(self, sb: Sandbox, applied: Applied | None, argv0: str) -> ExecRef | None:
        """Before the start: what counts this exec's policy denials (None: nothing)."""
        return None if self.denials is None else await self.denials.exec_starting(sb, applied, argv0)

    def _bind_init(self, ref: ExecRef | None, watch: InitExec) -> None:
        if ref is not None:
            watch.started().add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else self.denials.bind(ref, f.result()))

    def _bind_helper(self, ref: ExecRef | None, host_pid: int) -> None:
        if ref is not None:
            self.denials.bind(ref, self.denials.host_to_sandbox_pid(host_pid))

    def _finish(self, result: dict, applied: Applied | None, ref: ExecRef | None) -> None:
        """The policy part of an exec's result: its name, and its denials when counted."""
        result["policy"] = applied.name if applied else None
        if ref is not None and ref.policy is not None:
            result["denials"] = self.denials.ended(ref)

    def _start_by_init(self, sb: Sandbox, argv: list[str], env: list[str], cwd: str, user: int, io,
                       stdio: tuple[int, int, int], applied: Applied | None,
                       ctty: bool = False) -> InitExec | None:
        """The exec sent to the sandbox's init (dsecd/initlink.py), or None:
        the daemon's helper must start it (no channel: exec_via = helper, a
        sandbox of an older daemon, or one whose init lacks this daemon's
        capabilities; or the channel cannot take this one: too big, init
        busy). `io` owns the child ends in stdio, closed once sent. Whether it
        started shows in its `exited` (a failed start: errors.run_error).
        ctty: stdin is a pty slave, the exec's controlling terminal. applied:
        the task policy it runs under (its plan goes with the request)."""
        if sb.handle is None:
            return None
        start = _with_options(self.backend.start_by_init, ctty, applied, self.backend)
        return self.starter.send_to_init(start, sb.handle, argv, env, cwd, user, io, stdio)

    async def _spawn_exec(self, sb: Sandbox, argv: list[str], env: list[str], cwd: str, user: int,
                          fds: tuple[int, int, int], io, applied: Applied | None = None, ctty: bool = False) -> int:
        spawn = _with_options(self.backend.spawn, ctty, applied, self.backend)
        return await self.starter.spawn_by_helper(io, None, spawn, sb.handle, argv, env, cwd, user, fds)

    async def _start_tracer(self, pid: int, timeout: float | None):
        try:
            return await self.workers.run(tracing.start_tracer, pid, timeout, self.limits.max_trace)
        except OSError as err:
            kill_and_reap(self.workers.loop, pid)     # it is stopped, waiting for a tracer that will not come
            raise io_error("start the tracer for", f"pid {pid}", err) from err

    async def exec_input(self, req, ctx) -> dict:
        io = ctx.exec_for(req.exec_id)
        if io is None:
            raise NotFound(f"no running exec with id {req.exec_id} on this connection")
        if not io.takes_stdin:
            raise Conflict(f"exec {req.exec_id} was started without stdin")
        await io.feed_stdin(req.data, req.eof)
        return {}

    async def exec_resize(self, req, ctx) -> dict:
        check_window(req.rows, req.cols)
        io = ctx.exec_for(req.exec_id)
        if io is None:
            raise NotFound(f"no running exec with id {req.exec_id} on this connection")
        if not io.has_tty:
            raise Conflict(f"exec {req.exec_id} has no terminal to resize: start it with pty=true")
        try:
            io.resize(req.rows, req.cols)
        except OSError as err:
            raise Conflict(f"exec {req.exec_id}: cannot resize its terminal: {err.strerror}") from err
        return {}
