"""Execs in a sandbox: argument checks, the start (by the sandbox's init or
the daemon's helper: starts.py), output streamed or collected, stdin, the
timeout, and `dsec trace`'s ptrace record.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .. import metrics, tracing, userns
from ..errors import (
    BadRequest,
    Conflict,
    DsecError,
    NotFound,
    Unsupported,
    exec_error,
    io_error,
    run_error,
)
from ..execio import (
    DEFAULT_WINDOW,
    MAX_WINDOW_SIDE,
    ChildWatch,
    Collector,
    ExecIO,
    PtyIO,
    kill_and_reap,
    parse_signal,
)
from ..fs import users
from ..imageconfig import ConfigError
from ..initlink import InitExec
from ..mem import pause
from ..protocol import FileRead
from .denials import DenialService, ExecRef
from .keyedstream import KeyedStream, check_stream_from
from .microvms import MicroVMService
from .opkeys import output_bytes
from .policies import Applied, PolicyService
from .sandboxes import Sandbox, SandboxRegistry, in_root
from .starts import ProcessStarter
from .vmfiles import VmFiles
from .workers import Workers

# Waits before retrying an exec that failed with ETXTBSY (ExecService.exec).
ETXTBSY_RETRY_S = (0.002, 0.01, 0.03, 0.1)


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
            raise BadRequest(f"bad environment variable {k!r}: a name must be non-empty, without '=' or NUL, "
                             "and a value without NUL", {"name": k})


async def named_user(sb: Sandbox, spec: str, workers: Workers, vm_files: VmFiles) -> users.Identity:
    """The ids (and home) of an exec's user given as a string ("app",
    "app:staff", "1000", "1000:50"), as `docker exec --user` takes it:
    looked up in the sandbox's own /etc/passwd and /etc/group as they are
    now (a sandbox may have added users since its create). A microVM must
    be running."""
    if not spec:
        raise BadRequest("user must not be empty: give a uid, a name, name:group or uid:gid, or none for "
                         "the sandbox's user", {"user": spec})
    try:
        return await sandbox_identity(sb, spec, workers, vm_files, "the sandbox")
    except ConfigError as err:              # parse_user's: it names the spec
        raise BadRequest(str(err), {"user": spec}) from err
    except users.UserError as err:
        raise BadRequest(f"sandbox {sb.id} cannot run as user {spec!r}: {err}",
                         {"sandbox": sb.id, "user": spec}) from err


async def owner_ids(sb: Sandbox, owner: int | str | None, workers: Workers,
                    vm_files: VmFiles | None) -> tuple[int, int] | None:
    """The sandbox (uid, gid) that the entries a file request makes belong
    to: its `owner` as an exec's `user` is given (a uid, whose gid is the
    same number; or "name", "uid", "name:group", "uid:gid" looked up in the
    sandbox's /etc/passwd and /etc/group as they are now); None for the
    sandbox's root, the default. A microVM must be running."""
    if owner is None:
        return None
    if isinstance(owner, str):
        if not owner:
            raise BadRequest("owner must not be empty: give a uid, a name, name:group or uid:gid, or none for "
                             "root", {"owner": owner})
        try:
            ident = await sandbox_identity(sb, owner, workers, vm_files, "the sandbox")
        except ConfigError as err:
            raise BadRequest(str(err).replace("user", "owner", 1), {"owner": owner}) from err
        except users.UserError as err:
            raise BadRequest(f"sandbox {sb.id} cannot give files to owner {owner!r}: {err}",
                             {"sandbox": sb.id, "owner": owner}) from err
        uid, gid = ident.uid, ident.gid
    else:
        uid = gid = owner
    idmap = userns.IdMap.from_record(sb.idmap)
    top = idmap.count if idmap else 1 << 32
    for what, value in (("uid", uid), ("gid", gid)):
        if not 0 <= value < top:
            raise BadRequest(f"owner {what} {value} does not exist in sandbox {sb.id}: its ids are 0 to {top - 1}",
                             {"sandbox": sb.id, "owner": owner})
    return uid, gid


async def request_user(sb: Sandbox, req, why: str, workers: Workers, vm_files: VmFiles,
                       ensure_running: Callable[[Sandbox, str], Awaitable[None]]) -> users.Identity | None:
    """The user an exec or background process request names as a string
    (named_user), None for a uid or none. A microVM is resumed first: its
    files are read through its agent."""
    if not isinstance(req.user, str):
        return None
    if sb.backend == "microvm":
        await ensure_running(sb, why)
    return await named_user(sb, req.user, workers, vm_files)


async def sandbox_identity(sb: Sandbox, spec: str, workers: Workers, vm_files: VmFiles | None,
                           holder: str) -> users.Identity:
    """`spec` -> ids, reading the sandbox's /etc/passwd and /etc/group only if
    the spec needs them (a create's, before anything ran: the image's; an
    exec's: as they are now). ConfigError and users.UserError as
    users.resolve's, naming `holder`."""
    need_passwd, need_group = users.files_needed(spec)
    passwd = await account_file(sb, "/etc/passwd", workers, vm_files) if need_passwd else None
    group = await account_file(sb, "/etc/group", workers, vm_files) if need_group else None
    return users.resolve(spec, passwd, group, holder)


async def account_file(sb: Sandbox, path: str, workers: Workers, vm_files: VmFiles | None) -> str | None:
    """The text of an account file of the sandbox (its first
    users.MAX_ACCOUNT_FILE bytes), None if it has none."""
    if sb.backend == "microvm":
        try:
            r = await vm_files.file_op(sb, FileRead(sandbox=sb.id, path=path, length=users.MAX_ACCOUNT_FILE))
        except NotFound:
            return None
        return r["data"].decode("utf-8", "replace")
    try:
        return await in_root(workers, sb, users.read_account_file, path)
    except OSError as err:
        raise io_error("read", f"{sb.id}:{path}", err) from err


def exec_target(sb: Sandbox, req, backend,
                named: users.Identity | None = None) -> tuple[list[str], str, users.ProcessIds]:
    """(env, cwd, ids) of an exec or background process request (argv, env,
    cwd, user) in `sb`, checked: BadRequest names what is wrong. The
    sandbox's ids by default; a request naming a uid (an int) gets a gid of
    the same number and no supplementary groups; `named`: the user given as
    a string (named_user), whose home is HOME unless the request's env sets it."""
    if not req.argv or not all(req.argv):
        raise BadRequest("argv must be a non-empty list of non-empty strings")
    if any("\0" in a for a in req.argv):
        raise BadRequest("argv must not contain NUL bytes")
    check_env(req.env)
    cwd = req.cwd or sb.cwd
    if not cwd.startswith("/"):
        raise BadRequest(f"cwd must be an absolute path inside the sandbox, got {cwd!r}")
    home = {}
    groups: tuple[int, ...] = ()
    if named is not None:
        user, gid, groups = named.uid, named.gid, named.groups
        if named.home:
            home = {"HOME": named.home}
        elif user != 0 and "HOME" not in sb.env:
            home = {"HOME": "/"}        # a uid without a home: not root's (docker gives / too)
    elif isinstance(req.user, str):
        raise AssertionError("a user given as a string is resolved first (named_user)")
    elif req.user is None:
        user, gid, groups = sb.user, sb.user if sb.gid is None else sb.gid, tuple(sb.groups)
    else:
        user = gid = req.user
    idmap = userns.IdMap.from_record(sb.idmap)
    for what, value in (("user", user), ("group", gid)):
        if idmap and not 0 <= value < idmap.count:
            raise BadRequest(f"{what} {value} does not exist in sandbox {sb.id}: its user namespace maps "
                             f"ids 0..{idmap.count - 1}", {what: value, "userns_size": idmap.count})
    env = backend.exec_env({"HOSTNAME": sb.hostname, **sb.env, **home}, req.env)
    return env, cwd, users.ProcessIds(user, gid, mapped_groups(groups, idmap.count if idmap else None))


def _kill_if_tracer_ends_first(loop: asyncio.AbstractEventLoop, tracer_pid: int,
                               watch: ChildWatch) -> Callable[[], None]:
    """A traced command waits, stopped, until its tracer seizes it, and the
    tracer records until the command ends: a tracer that exits while the
    command has not (it failed to start, or died) would leave it stopped
    for good. Its end kills the command; tracing.collect then gives the
    tracer's error as the exec's trace. Returns what stops the watch (the
    tracer is reaped by collect, not here)."""
    pidfd = os.pidfd_open(tracer_pid)

    def tracer_ended() -> None:
        loop.remove_reader(pidfd)
        try:
            # WNOWAIT: look without reaping, which the command's watch does.
            ended = os.waitid(os.P_PID, watch.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            ended = True
        if not ended:
            watch.kill()

    loop.add_reader(pidfd, tracer_ended)

    def stop() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return stop


def mapped_groups(groups: tuple[int, ...], size: int | None) -> tuple[int, ...]:
    """The supplementary groups a sandbox's user namespace of `size` ids maps
    (None: host ids, all of them). One it does not map owns no file there
    (such a file shows the overflow gid), so leaving it out takes nothing;
    setgroups would refuse the whole list for it."""
    return groups if size is None else tuple(g for g in groups if g < size)


def _with_options(start, ctty: bool, ids: users.ProcessIds, applied: Applied | None, backend):
    """A backend's start or spawn with the options this exec needs: its
    terminal, its group and supplementary groups, and its task policy's plan
    and capabilities."""
    options: dict = {"ctty": ctty, "gid": ids.gid}
    if ids.groups:
        options["groups"] = ids.groups
    if applied is not None:
        if applied.plan is not None:
            options["policy"] = applied.plan
        if (caps := applied.cap_keep(backend.caps)) is not None:
            options["cap_keep"] = caps
    return functools.partial(start, **options)


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


def exec_summary(result: dict) -> dict:
    """What a keyed exec's key keeps of its result once the output is gone
    (dsecd/engine/opkeys.py): its end and how many bytes of output it had."""
    summary = {"exit_code": result.get("exit_code"), "signal": result.get("signal"),
               "timed_out": bool(result.get("timed_out")), "bytes": output_bytes(result)}
    if result.get("trace"):
        summary["traced"] = True        # its trace went with its output
    return summary


async def _no_oom_count(sb: Sandbox, before: int) -> bool:
    return False


# How long exec_signal waits for an exec that is still starting (a start
# takes milliseconds: one not started by then is not coming).
SIGNAL_START_WAIT_S = 5.0


class ExecService:
    """`exec`, `exec_input`, `exec_resize` and `exec_signal`. `ensure_running(sb, why)` resumes a paused
    sandbox first (the memory service's); `devnull` is the stdin of collected
    execs (the daemon's one read-only /dev/null); `oom_killed_since(sb, n)`
    whether its OOM kill count grew past n (the memory service's)."""

    def __init__(self, registry: SandboxRegistry, workers: Workers, starter: ProcessStarter, backend,
                 ensure_running: Callable[[Sandbox, str], Awaitable[None]], limits: ExecLimits, devnull: int,
                 policies: PolicyService, denials: DenialService | None = None, vms: MicroVMService | None = None,
                 oom_killed_since: Callable[[Sandbox, int], Awaitable[bool]] | None = None,
                 vm_files: VmFiles | None = None):
        self.oom_killed_since = oom_killed_since or _no_oom_count
        self.policies = policies
        self.denials = denials
        self.registry = registry
        self.workers = workers
        self.starter = starter
        self.backend = backend
        self.ensure_running = ensure_running
        self.limits = limits
        self.devnull = devnull
        self.vms = vms
        self.vm_files = vm_files        # a microVM's /etc/passwd and /etc/group, for a named user

    async def exec(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        stream = None
        if req.key is not None:
            if req.stdin or req.pty:
                raise BadRequest("exec: a key is for an exec without stdin or a terminal: sent again, its "
                                 "input would be sent twice, or part of it lost; drop the key",
                                 {"key": req.key})
            check_stream_from(req.stream_from)
            if req.stream:
                # Its output, kept for the request sent again to take up (keyedstream.py).
                stream = KeyedStream(ctx)
        elif req.stream_from is not None:
            raise BadRequest("exec: stream_from is for a keyed streamed exec sent again; give its key",
                             {"stream_from": req.stream_from})
        return await self.registry.op_keys.once(sb, "exec", req, ctx, lambda: self._exec(sb, req, stream or ctx),
                                                exec_summary, stream=stream)

    async def _exec(self, sb: Sandbox, req, ctx) -> dict:
        check_pty(req)
        timeout = req.timeout
        max_t = self.limits.max_timeout_s
        if timeout is not None and not 0 < timeout <= (max_t or float("inf")):
            raise BadRequest(f"timeout must be in (0, {max_t}] seconds, got {timeout}")
        named = await request_user(sb, req, "an exec", self.workers, self.vm_files, self.ensure_running)
        env, cwd, ids = exec_target(sb, req, self.backend, named)
        if sb.backend == "microvm" and (req.policy is not None or sb.policy is not None):
            raise Unsupported(f"sandbox {sb.id} is a microVM: task policies (Landlock in dsec-init) are "
                              "enforced in containers only")
        applied = self.policies.for_exec(sb, req.policy)
        started = time.monotonic()
        await self.ensure_running(sb, "an exec")
        oom_before = sb.oom_kills
        if sb.backend == "microvm":
            result = await self.vms.exec(sb, req, env, cwd, ids, timeout, ctx)
            metrics.EXEC_SECONDS.labels("microvm").observe(time.monotonic() - started)
            return await self._why_killed(sb, result, oom_before)
        via: list[str] = []        # who started the process: "init" or "helper" (the metrics' label)
        if not (req.stream or req.stdin or req.trace or req.pty):
            # ETXTBSY: the program is open for writing somewhere for a moment
            # (a write_file just answered, whose fd a spawn child copied with the
            # daemon's fd table before closing it: csrc/spawn.c fds_own; or the
            # sandbox's own writer). Nothing ran, so a short wait and a retry are safe.
            for delay in (*ETXTBSY_RETRY_S, None):
                try:
                    result = await self._exec_collected(sb, list(req.argv), env, cwd, ids, timeout,
                                                         ctx, via, applied)
                    break
                except DsecError as err:
                    if delay is None or err.detail.get("errno") != "ETXTBSY":
                        raise
                await asyncio.sleep(delay)
        else:
            result = await self._exec_streamed(sb, req, env, cwd, ids, timeout, ctx, via, applied)
        metrics.EXEC_SECONDS.labels(via[-1] if via else "").observe(time.monotonic() - started)
        return await self._why_killed(sb, result, oom_before)

    async def _why_killed(self, sb: Sandbox, result: dict, oom_before: int) -> dict:
        """An exec that ended by SIGKILL, not at its timeout, says why when
        the daemon knows: `killed_by` "destroy" (the sandbox is being
        destroyed; `destroyed_by` its reason: ttl, request, ...) or "oom"
        (its memory limit: the sandbox's OOM kill count grew while the exec
        ran). One cgroup read, for SIGKILLed execs only."""
        if result.get("signal") != signal.SIGKILL or result.get("timed_out"):
            return result
        if sb.state == "stopping":               # a destroy; "dead" is a death of its own, not said
            result["killed_by"] = "destroy"
            if sb.stopping_by:
                result["destroyed_by"] = sb.stopping_by
        elif await self.oom_killed_since(sb, oom_before):
            result["killed_by"] = "oom"
        return result

    async def _exec_streamed(self, sb: Sandbox, req, env: list[str], cwd: str, ids: users.ProcessIds,
                             timeout: float | None, ctx, via: list[str], applied: Applied | None) -> dict:
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
            io = PtyIO(loop, emit, rows, cols, self._open_pty(sb, ids))
        else:
            io = ExecIO(loop, self.limits.max_output, emit, req.stdin)
        ctx.register_exec(io)
        try:
            result = await self._run_io(sb, io, list(req.argv), env, cwd, ids, timeout, req.pty, req.trace, via,
                                        applied, ref)
        finally:
            ctx.unregister_exec()
        if not req.stream:
            result["stdout"] = b"".join(collected[1])
            result["stderr"] = b"".join(collected[2])
        self._finish(result, applied, ref)
        return result

    def _open_pty(self, sb: Sandbox, ids: users.ProcessIds) -> tuple[int, int]:
        """A new pty of the sandbox's own devpts, the exec user's
        (ContainerBackend.open_pty). On the loop, as the pipes of other execs
        are made: the client may send input right behind the request, so the
        exec is registered before the loop turns. The open cannot block: its
        walk meets only the mounts dsecd made at the sandbox's /dev and
        /dev/pts (tmpfs and devpts, no I/O), which sandboxes cannot unmount
        or cover (their seccomp filter denies every mount call)."""
        h = sb.handle
        if h is None:
            raise Conflict(f"sandbox {sb.id} is exiting", {"sandbox": sb.id})
        try:
            return self.backend.open_pty(h, userns.IdMap.from_record(sb.idmap), ids.uid, ids.gid)
        except OSError as err:
            raise io_error("open a terminal (its /dev/pts/ptmx) in", f"sandbox {sb.id}", err) from err

    async def run_streamed(self, sb: Sandbox, argv: list[str], env: dict[str, str], cwd: str,
                           ids: users.ProcessIds, timeout: float | None,
                           emit: Callable[[int, bytes], Awaitable[None]]) -> dict:
        """An exec the daemon runs for itself (a Dockerfile build's RUN): no
        stdin, its output handed to `emit(fd, data)` as it comes, with
        backpressure and no cap (the build's client reads it as a stream).
        Result (with `killed_by`) and errors as `exec`'s; cancelling it kills
        the process group."""
        io = ExecIO(self.workers.loop, 1 << 62, emit, False)
        oom_before = sb.oom_kills
        result = await self._run_io(sb, io, argv, self.backend.exec_env({"HOSTNAME": sb.hostname, **sb.env}, env),
                                    cwd, ids, timeout)
        return await self._why_killed(sb, result, oom_before)

    async def _run_io(self, sb: Sandbox, io, argv: list[str], env: list[str], cwd: str, ids: users.ProcessIds,
                      timeout: float | None, pty: bool = False, trace: bool = False,
                      via: list[str] | None = None, applied: Applied | None = None,
                      ref: ExecRef | None = None) -> dict:
        """Start `argv` with `io`'s pipes (or terminal) and wait for its end and output;
        `via` gets who started it ("init" or "helper", the metrics' label); `applied`:
        its task policy, whose denials `ref` counts."""
        loop = self.workers.loop
        sb.execs += 1
        prog = argv[0]
        try:
            argv = tracing.traced_argv(argv) if trace else argv
            # A traced exec needs the daemon's helper: the tracer attaches to the daemon's child.
            tracer = None
            watch = None if trace else self._start_by_init(sb, argv, env, cwd, ids, io, io.child_fds(),
                                                           applied, pty)
            if via is not None:
                via.append("init" if watch is not None else "helper")
            if watch is None:
                pid = await self._spawn_exec(sb, argv, env, cwd, ids, io.child_fds(), io, applied, pty)
                if trace:
                    tracer = await self._start_tracer(sb, pid, timeout)
                watch = ChildWatch(loop, pid)
                if tracer is not None:
                    stop_watching_tracer = _kill_if_tracer_ends_first(loop, tracer.pid, watch)
                self._bind_helper(ref, pid)
            else:
                self._bind_init(ref, watch)
            try:
                result = await io.run(watch, timeout, self.limits.drain_grace_s, sb.paused_for)
            except OSError as err:
                raise run_error(err, sb.id, argv[0], cwd) from err
            finally:
                if tracer is not None:
                    stop_watching_tracer()
            if tracer is not None:
                result["trace"] = await self.workers.run(tracing.collect, tracer)
                failed = tracing.start_failure(result)
                if failed is not None:                      # answered as an untraced exec's would be
                    err = OSError(getattr(errno, failed), os.strerror(getattr(errno, failed)))
                    err.step = "exec"
                    raise exec_error(err, prog, cwd)
            return result
        finally:
            io.close()
            sb.execs -= 1
            sb.last_active = time.monotonic()

    async def _exec_collected(self, sb: Sandbox, argv: list[str], env: list[str], cwd: str,
                              ids: users.ProcessIds, timeout: float | None, ctx, via: list[str],
                              applied: Applied | None) -> dict:
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
            watch = self._start_by_init(sb, argv, env, cwd, ids, run, stdio, applied)
            via.append("init" if watch is not None else "helper")
            if watch is None:
                watch = ChildWatch(self.workers.loop,
                                   await self._spawn_exec(sb, argv, env, cwd, ids, stdio, run, applied))
                self._bind_helper(ref, watch.pid)
            else:
                self._bind_init(ref, watch)
            run.watch = watch
            # Sent to init, the timeout counts from the send: a start init cannot finish is killed too.
            run.kill_grace = watch.kill_grace
            run.start(watch.exited, watch.kill, timeout, sb.paused_for)
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

    def _start_by_init(self, sb: Sandbox, argv: list[str], env: list[str], cwd: str, ids: users.ProcessIds, io,
                       stdio: tuple[int, int, int], applied: Applied | None = None,
                       ctty: bool = False) -> InitExec | None:
        """The exec sent to the sandbox's init (dsecd/initlink.py), or None:
        the daemon's helper must start it (no channel: exec_via = helper, a
        sandbox of an older daemon, or one whose init lacks this daemon's
        capabilities; or the channel cannot take this one: too big, init
        busy). `io` owns the child ends in stdio, closed once sent. Whether it
        started shows in its `exited` (a failed start: errors.run_error).
        ctty: stdin is a pty slave, the exec's controlling terminal.
        applied: the task policy it runs under (its plan goes with the request)."""
        if sb.handle is None:
            return None
        start = _with_options(self.backend.start_by_init, ctty, ids, applied, self.backend)
        return self.starter.send_to_init(start, sb.handle, argv, env, cwd, ids.uid, io, stdio)

    async def _spawn_exec(self, sb: Sandbox, argv: list[str], env: list[str], cwd: str, ids: users.ProcessIds,
                          fds: tuple[int, int, int], io, applied: Applied | None = None, ctty: bool = False) -> int:
        spawn = _with_options(self.backend.spawn, ctty, ids, applied, self.backend)
        # What the exec clones with CLONE_PARENT is our child: reaped once it
        # ends by the reaper's pass once a second (execio.reap_strays_of_helped),
        # the rest when the sandbox ends (its stop).
        sb.helper_execs = True
        return await self.starter.spawn_by_helper(io, None, spawn, sb.handle, argv, env, cwd, ids.uid, fds)

    async def _start_tracer(self, sb: Sandbox, pid: int, timeout: float | None):
        try:
            frozen_file = str(pause.Freezer.of(sb.handle.group).asked_file())
        except OSError:
            frozen_file = None          # no freezer, so no pause either: wall time is run time
        try:
            return await self.workers.run(tracing.start_tracer, pid, timeout, self.limits.max_trace, frozen_file)
        except OSError as err:
            kill_and_reap(self.workers.loop, pid)     # it is stopped, waiting for a tracer that will not come
            raise io_error("start the tracer for", f"pid {pid}", err) from err

    async def exec_input(self, req, ctx) -> dict:
        io = await ctx.exec_for(req.exec_id)
        if io is None:
            raise NotFound(f"no running exec with id {req.exec_id} on this connection")
        if not io.takes_stdin:
            raise Conflict(f"exec {req.exec_id} was started without stdin; to write to it, start it with stdin "
                           "(SDK: exec_stream(..., stdin=...) or pty=True; CLI: dsec exec -i)")
        await io.feed_stdin(req.data, req.eof)
        return {}

    async def exec_resize(self, req, ctx) -> dict:
        check_window(req.rows, req.cols)
        io = await ctx.exec_for(req.exec_id)
        if io is None:
            raise NotFound(f"no running exec with id {req.exec_id} on this connection")
        if not io.has_tty:
            raise Conflict(f"exec {req.exec_id} has no terminal to resize: start it with pty=true")
        try:
            io.resize(req.rows, req.cols)
        except OSError as err:
            raise Conflict(f"exec {req.exec_id}: cannot resize its terminal: {err.strerror}") from err
        return {}

    async def exec_signal(self, req, ctx) -> dict:
        """A signal for a running exec's process group (`dsec run` forwards
        its ^C this way, as `docker run` does)."""
        signum = parse_signal(req.signal)
        io = await ctx.exec_for(req.exec_id)
        if io is None:
            raise NotFound(f"no running exec with id {req.exec_id} on this connection")
        # An exec still starting (its spawn in flight, init not yet answered)
        # has no process to signal: wait for it while the request stands.
        deadline = time.monotonic() + SIGNAL_START_WAIT_S
        while not io.signal(signum):
            if ctx.exec_now(req.exec_id) is not io or time.monotonic() > deadline:
                raise NotFound(f"exec {req.exec_id} has no process left to signal: it has ended",
                               {"exec_id": req.exec_id})
            await asyncio.sleep(0.01)
        return {}
