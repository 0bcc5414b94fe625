"""Forensics for reward hacking: run one command under ptrace and record what it did.

`dsec trace SB -- CMD` (docs/hardening.md, section 3) records, for the command and everything it
forks: every execve/execveat (path and argv), open/openat/openat2/creat
path, connect target (AF_INET, AF_INET6 and AF_UNIX decoded), signal
delivered, fork and exit, each with the pid, the time since the start and
the result (an errno name when the call failed). The record is bounded
(`Limits`: events, serialized bytes, bytes per string, argv entries); what
does not fit is counted in `dropped` and `truncated` is set, while the
command itself keeps running to its end, traced but unrecorded.

How a process gets traced. The tracer must see the first execve, so the
process must be *stopped before it execs* when the tracer seizes it:

* `trace_command(argv)` forks a child that stops itself (SIGSTOP), then
  seizes it and lets it exec: for tests and for a host-side `dsec trace`.
* `trace_pid(pid)` seizes a process some other code started and stopped
  (the daemon: see docs/hardening.md for the stop-then-exec stub).
* `trace_spawn(start)` calls `start()`, which returns the pid of such a
  stopped process, then traces it.

Seizing (PTRACE_SEIZE) a process in group-stop needs no extra SIGSTOP: the
kernel hands the stop to the tracer, which resumes it with PTRACE_SYSCALL.
Forks, vforks and clones are followed (PTRACE_O_TRACE*), and
PTRACE_O_EXITKILL kills every tracee if the tracer dies, so a command never
runs on untraced because the tracer crashed.

Waiting: ptrace stops are collected with waitpid(-1, __WALL), the only way to
wait for all tracees at once. That also reaps *any other child* of the
tracing process, so the tracer must run in a process with no other children:
the daemon runs it as a helper (`python -m dsecd.trace --pid N --json`),
never in its own process. All ptrace requests must come from one thread.

x86_64 only (syscall numbers and registers).

A microVM's command runs in its guest's kernel, where the guest agent's
tracer records the same raw fields (csrc/guest/agent.c, trace_main);
`Recorder` and `call_event` here turn them into this record's events, so a
VM's trace and a container's are one format
(dsecd/backends/microvm/vmtrace.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ptrace.binding import func as ptrace_func
from ptrace.error import PtraceError
from ptrace.syscall import SYSCALL_NAMES

PTRACE_SEIZE = 0x4206
PTRACE_EVENT_STOP = 128
_WALL = 0x40000000
OPTIONS = (ptrace_func.PTRACE_O_TRACESYSGOOD | ptrace_func.PTRACE_O_TRACEFORK
           | ptrace_func.PTRACE_O_TRACEVFORK | ptrace_func.PTRACE_O_TRACECLONE
           | ptrace_func.PTRACE_O_TRACEEXEC | 0x00100000)   # PTRACE_O_EXITKILL
FORK_EVENTS = {ptrace_func.PTRACE_EVENT_FORK: "fork", ptrace_func.PTRACE_EVENT_VFORK: "vfork",
               ptrace_func.PTRACE_EVENT_CLONE: "clone"}
# python-ptrace's table also has the x32 entries (512 and up) under the same
# names: keep the native x86_64 numbers.
_NUMBERS = {name: nr for nr, name in SYSCALL_NAMES.items() if nr < 512}
# The syscalls recorded: number -> name.
RECORDED = {_NUMBERS[name]: name for name in (
    "execve", "execveat", "open", "openat", "openat2", "creat", "connect")}
AT_FDCWD = -100


@dataclass(frozen=True)
class Limits:
    """Bounds of one trace record."""

    max_events: int = 10_000
    max_bytes: int = 1 << 20        # serialized JSON of all recorded events
    max_string: int = 4096          # bytes of one path or argv entry
    max_argv: int = 256             # argv entries recorded per exec

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive int, got {value!r}")


@dataclass
class Trace:
    """What one traced command did. `events` are dicts with at least `t`
    (seconds since the start), `pid` and `kind` (exec, open, connect, signal,
    fork, exit)."""

    pid: int
    events: list[dict] = field(default_factory=list)
    truncated: bool = False
    dropped: int = 0                # events not recorded because a limit was hit
    bytes: int = 0                  # serialized size of `events`
    exit_code: int | None = None    # of the first process
    signal: str | None = None       # that killed the first process
    timed_out: bool = False
    duration_s: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_text(self) -> str:
        lines = [f"{e['t']:9.6f} {e['pid']:>7} {_describe(e)}" for e in self.events]
        end = (f"killed by {self.signal}" if self.signal else f"exit {self.exit_code}")
        lines.append(f"# pid {self.pid}: {end} after {self.duration_s:.3f}s; {len(self.events)} "
                     f"events, {self.bytes} bytes" + (f"; TRUNCATED, {self.dropped} dropped"
                                                      if self.truncated else "")
                     + ("; timed out" if self.timed_out else ""))
        return "\n".join(lines) + "\n"


class Recorder:
    """Events into a Trace within its Limits: what does not fit is counted
    in `dropped` and sets `truncated`."""

    def __init__(self, trace: Trace, limits: Limits):
        self.trace, self.limits = trace, limits

    def record(self, t: float, pid: int, kind: str, **fields) -> None:
        event = {"t": round(t, 6), "pid": pid, "kind": kind, **fields}
        size = len(json.dumps(event, separators=(",", ":"))) + 1
        tr = self.trace
        if len(tr.events) >= self.limits.max_events or tr.bytes + size > self.limits.max_bytes:
            tr.truncated = True
            tr.dropped += 1
            return
        tr.events.append(event)
        tr.bytes += size

    def exit(self, t: float, pid: int, status: int, root: bool) -> None:
        """A process's end from its wait status; the root's is the trace's."""
        if os.WIFSIGNALED(status):
            sig = signal_name(os.WTERMSIG(status))
            self.record(t, pid, "exit", signal=sig)
            if root:
                self.trace.signal = sig
        else:
            code = os.WEXITSTATUS(status)
            self.record(t, pid, "exit", code=code)
            if root:
                self.trace.exit_code = code


def signal_name(sig: int) -> str:
    return signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)


@dataclass
class RawCall:
    """A recorded syscall's arguments as read from the tracee at its entry:
    registers, the path string, argv, and `data` (connect: the sockaddr, at
    most 128 bytes; openat2: struct open_how). `*_cut`: the string (any argv
    string) reached Limits.max_string."""

    name: str
    args: tuple[int, ...]                   # rdi, rsi, rdx, r10, r8, r9
    path: bytes = b""
    path_cut: bool = False
    argv: list[bytes] = field(default_factory=list)
    argv_cut: bool = False
    data: bytes = b""


def call_event(call: RawCall, limits: Limits) -> dict:
    """The event fields (kind first, no result) of a recorded syscall."""
    name, a = call.name, call.args
    path = {"path": os.fsdecode(call.path), "path_truncated": True} if call.path_cut \
        else {"path": os.fsdecode(call.path)}
    if name in ("execve", "execveat"):
        argv = [os.fsdecode(x) for x in call.argv]
        ev = {"kind": "exec", "syscall": name, **path, "argv": argv}
        if name == "execveat":
            ev["dirfd"] = _signed(a[0])
        if call.argv_cut or len(argv) == limits.max_argv:
            ev["argv_truncated"] = True
        return ev
    if name in ("open", "creat"):
        flags = a[1] if name == "open" else os.O_CREAT | os.O_WRONLY | os.O_TRUNC
        return {"kind": "open", "syscall": name, **path, "flags": flags}
    if name in ("openat", "openat2"):
        if name == "openat2":   # struct open_how { u64 flags, mode, resolve }
            flags = struct.unpack_from("<Q", call.data)[0] if len(call.data) >= 8 else 0
        else:
            flags = a[2]
        ev = {"kind": "open", "syscall": name, **path, "flags": flags}
        if _signed(a[0]) != AT_FDCWD:
            ev["dirfd"] = _signed(a[0])
        return ev
    if name == "connect":
        return {"kind": "connect", "fd": _signed(a[0]), "address": decode_sockaddr(call.data)}
    raise ValueError(f"syscall {name!r} is not recorded")


def executable(pid: int) -> str | None:
    """The program `pid` runs (/proc/PID/exe: a path in the sandbox's own
    mount namespace, as the kernel resolves it there), or None if gone."""
    try:
        return os.fsdecode(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None


def _describe(e: dict) -> str:
    result = f" = {e['result']}" if "result" in e else ""
    kind = e["kind"]
    if kind == "exec":
        exe = f" ({e['exe']})" if "exe" in e else ""
        return f"exec {e['path']!r}{exe} {e['argv']!r}{result}"
    if kind == "open":
        return f"{e['syscall']} {e['path']!r} flags={e['flags']:#o}{result}"
    if kind == "connect":
        return f"connect fd={e['fd']} {e['address']}{result}"
    if kind == "signal":
        return f"signal {e['signal']}"
    if kind == "fork":
        return f"{e['how']} -> {e['child']}"
    if kind == "exit":
        return f"killed by {e['signal']}" if e.get("signal") else f"exit {e['code']}"
    return json.dumps(e)


# ---------------------------------------------------------------- tracee memory


class _Memory:
    """Reads of a tracee's memory through /proc/PID/mem (one pread per chunk,
    not one ptrace per word). Reopened after an exec: the fd is bound to the
    address space it was opened on."""

    def __init__(self):
        self._fds: dict[int, int] = {}

    def _fd(self, pid: int) -> int:
        fd = self._fds.get(pid)
        if fd is None:
            fd = self._fds[pid] = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def forget(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for pid in list(self._fds):
            self.forget(pid)

    def read(self, pid: int, addr: int, size: int) -> bytes:
        if addr == 0 or size <= 0:
            return b""
        try:
            return os.pread(self._fd(pid), size, addr)
        except OSError:       # unmapped (EIO), or the process is gone
            return b""

    def cstring(self, pid: int, addr: int, limit: int) -> tuple[bytes, bool]:
        """(bytes, truncated) of the NUL-terminated string at addr."""
        out = b""
        while len(out) < limit:
            # Stop at a page end: the next page may be unmapped.
            chunk = self.read(pid, addr + len(out), min(256, 4096 - (addr + len(out)) % 4096,
                                                        limit - len(out)))
            if not chunk:
                break
            nul = chunk.find(b"\0")
            if nul >= 0:
                return out + chunk[:nul], False
            out += chunk
        return out[:limit], len(out) >= limit

    def pointers(self, pid: int, addr: int, limit: int) -> list[int]:
        """The NULL-terminated pointer array at addr, at most `limit` entries."""
        raw = self.read(pid, addr, 8 * (limit + 1))
        ptrs = []
        for (p,) in struct.iter_unpack("<Q", raw[: len(raw) // 8 * 8]):
            if p == 0:
                break
            ptrs.append(p)
        return ptrs[:limit]


def decode_sockaddr(raw: bytes) -> str:
    """A sockaddr as text: "127.0.0.1:80", "[::1]:80", "unix:/path", "unix:@abstract"."""
    if len(raw) < 2:
        return "?"
    (family,) = struct.unpack_from("<H", raw)
    if family == socket.AF_INET and len(raw) >= 8:
        (port,) = struct.unpack_from(">H", raw, 2)
        return f"{socket.inet_ntop(socket.AF_INET, raw[4:8])}:{port}"
    if family == socket.AF_INET6 and len(raw) >= 24:
        (port,) = struct.unpack_from(">H", raw, 2)
        return f"[{socket.inet_ntop(socket.AF_INET6, raw[8:24])}]:{port}"
    if family == socket.AF_UNIX:
        path = raw[2:]
        if path[:1] == b"\0":
            return "unix:@" + os.fsdecode(path[1:].rstrip(b"\0"))
        return "unix:" + os.fsdecode(path.split(b"\0", 1)[0])
    return f"family {family}: {raw[2:18].hex()}"


def syscall_result(rax: int) -> int | str:
    """A syscall's return register as a number, or the errno name if it failed."""
    value = rax - (1 << 64) if rax >= 1 << 63 else rax
    if -4095 <= value < 0:
        return errno.errorcode.get(-value, str(-value))
    return value


def _signed(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


# ---------------------------------------------------------------- the tracer


class _Tracer:
    def __init__(self, root: int, limits: Limits):
        self.root = root
        self.limits = limits
        self.trace = Trace(pid=root)
        self.recorder = Recorder(self.trace, limits)
        self.mem = _Memory()
        self.in_syscall: dict[int, bool] = {}   # pid -> between entry and exit stop
        self.pending: dict[int, dict] = {}      # pid -> event decoded at syscall entry
        self.start = time.monotonic()

    # -- recording

    def record(self, pid: int, kind: str, **fields) -> None:
        self.recorder.record(time.monotonic() - self.start, pid, kind, **fields)

    def decode_entry(self, pid: int, nr: int, regs) -> dict | None:
        """The event of a recorded syscall, from its arguments at entry."""
        name = RECORDED.get(nr)
        if name is None:
            return None
        a = (regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8, regs.r9)
        call = RawCall(name, a)
        limit = self.limits.max_string
        if name in ("execve", "execveat"):
            path_arg, argv_arg = (a[0], a[1]) if name == "execve" else (a[1], a[2])
            call.path, call.path_cut = self.mem.cstring(pid, path_arg, limit)
            for ptr in self.mem.pointers(pid, argv_arg, self.limits.max_argv):
                text, cut = self.mem.cstring(pid, ptr, limit)
                call.argv.append(text)
                call.argv_cut |= cut
        elif name in ("open", "creat"):
            call.path, call.path_cut = self.mem.cstring(pid, a[0], limit)
        elif name in ("openat", "openat2"):
            call.path, call.path_cut = self.mem.cstring(pid, a[1], limit)
            if name == "openat2":
                call.data = self.mem.read(pid, a[2], 24)
        elif name == "connect":
            call.data = self.mem.read(pid, a[1], min(a[2], 128))
        return call_event(call, self.limits)

    # -- stops

    def on_syscall_stop(self, pid: int) -> None:
        regs = ptrace_func.ptrace_getregs(pid)
        if not self.in_syscall.get(pid):
            self.in_syscall[pid] = True
            event = self.decode_entry(pid, regs.orig_rax, regs)      # None: not a recorded call
            if event is not None:
                self.pending[pid] = event
            return
        self.in_syscall[pid] = False
        event = self.pending.pop(pid, None)
        if event is not None:
            kind = event.pop("kind")
            result = syscall_result(regs.rax)
            if kind == "exec" and result == 0:
                exe = executable(pid)
                if exe is not None and exe != event["path"]:
                    # The program that runs, where the path given does not say it:
                    # /proc/self/exe (busybox's shell runs its applets so), a
                    # symlink, /dev/fd/N, a relative path or an execveat's fd.
                    event["exe"] = exe
            self.record(pid, kind, **event, result=result)

    def on_event_stop(self, pid: int, event: int) -> None:
        if event in FORK_EVENTS:
            child = ptrace_func.ptrace_geteventmsg(pid)
            self.record(pid, "fork", how=FORK_EVENTS[event], child=child)
            self.in_syscall.setdefault(child, False)
        elif event == ptrace_func.PTRACE_EVENT_EXEC:
            # A new address space: the old /proc/PID/mem fd reads the old one.
            # (A non-leader thread that execs takes over the leader's pid.)
            self.mem.forget(pid)

    def on_exit(self, pid: int, status: int) -> None:
        self.recorder.exit(time.monotonic() - self.start, pid, status, pid == self.root)
        self.in_syscall.pop(pid, None)
        self.pending.pop(pid, None)
        self.mem.forget(pid)

    def resume(self, pid: int, sig: int = 0) -> None:
        try:
            ptrace_func.ptrace_syscall(pid, sig)
        except PtraceError as err:
            if err.errno != errno.ESRCH:   # killed meanwhile: its exit comes next
                raise

    def loop(self) -> None:
        """Until every tracee has exited."""
        live = {self.root}
        while live:
            try:
                pid, status = os.waitpid(-1, _WALL)
            except ChildProcessError:
                break
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                self.on_exit(pid, status)
                live.discard(pid)
                continue
            live.add(pid)   # a new child may report before its parent's fork event
            sig, event = os.WSTOPSIG(status), status >> 16
            try:
                if sig == signal.SIGTRAP | 0x80:
                    self.on_syscall_stop(pid)
                elif event:
                    # Fork/exec events; PTRACE_EVENT_STOP is a group-stop or the
                    # first stop of a seized or new tracee: resume it.
                    self.on_event_stop(pid, event)
                else:
                    # Signal-delivery stop: record it and deliver it.
                    self.record(pid, "signal", signal=signal_name(sig))
                    self.resume(pid, sig)
                    continue
            except PtraceError as err:
                if err.errno != errno.ESRCH:
                    raise
            self.resume(pid)


FROZEN_LOOK_S = 0.5      # how often a timeout that skips paused time looks at the freezer


def frozen_by(path: str) -> Callable[[], bool]:
    """Whether the group whose freezer file is `path` (v1 freezer.state,
    v2 cgroup.freeze) is paused, or being paused; False once it is gone."""
    def frozen() -> bool:
        try:
            with open(path) as f:
                return f.read().strip() in ("FROZEN", "FREEZING", "1")
        except OSError:
            return False
    return frozen


def _run_timer(seconds: float, expire: Callable[[], None], frozen: Callable[[], bool] | None,
               done: threading.Event) -> threading.Thread:
    """A thread that calls expire() once `seconds` have passed outside the
    pauses `frozen` reports (looked at every FROZEN_LOOK_S; a slice with a
    pause at either end does not count, so the timer errs towards the
    command, as a backstop should), unless `done` is set first. Without
    `frozen`, wall time."""
    def run() -> None:
        left, last = seconds, time.monotonic()
        was_frozen = frozen is not None and frozen()
        while not done.wait(left if frozen is None else min(left, FROZEN_LOOK_S)):
            now = time.monotonic()
            is_frozen = frozen is not None and frozen()
            # A slice counts only when it ran at both of its ends: one that
            # was paused at either may have been paused all but a moment.
            if not (was_frozen or is_frozen):
                left -= now - last
            last, was_frozen = now, is_frozen
            if left <= 0:
                expire()
                return
    thread = threading.Thread(target=run, name="trace-timeout", daemon=True)
    thread.start()
    return thread


def trace_pid(pid: int, limits: Limits | None = None, timeout: float | None = None,
              stop_wait: float = 5.0, frozen: Callable[[], bool] | None = None) -> Trace:
    """Trace `pid`, a process stopped (SIGSTOP) before it execs, to the exit
    of it and all it forks. Blocks; see the module doc on waitpid(-1). After
    `timeout` seconds every tracee is SIGKILLed (`timed_out`); with
    `frozen`, seconds while it says False (a paused sandbox's time does not count)."""
    _wait_stopped(pid, stop_wait)
    tracer = _Tracer(pid, limits or Limits())
    try:
        ptrace_func.ptrace(PTRACE_SEIZE, pid, 0, OPTIONS)
    except PtraceError as err:
        raise OSError(err.errno or errno.EPERM, f"seize pid {pid}: {err}") from err
    done = threading.Event()
    if timeout is not None:
        def expire():
            tracer.trace.timed_out = True
            for p in list(tracer.in_syscall) + [pid]:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _run_timer(timeout, expire, frozen, done)
    try:
        tracer.loop()
    finally:
        done.set()
        tracer.mem.close()
    tracer.trace.duration_s = round(time.monotonic() - tracer.start, 6)
    return tracer.trace


def _wait_stopped(pid: int, wait: float) -> None:
    """Until /proc/PID/stat says stopped (T): seizing a running process would
    miss what it does before the tracer catches up."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            raise ProcessLookupError(errno.ESRCH, f"trace pid {pid}: no such process") from None
        if state == "T":
            return
        if state in ("Z", "X"):
            raise ProcessLookupError(errno.ESRCH, f"trace pid {pid}: already exited")
        if time.monotonic() > deadline:
            raise TimeoutError(errno.ETIMEDOUT,
                               f"trace pid {pid}: not stopped after {wait}s (state {state})")
        time.sleep(0.001)


def trace_spawn(start: Callable[[], int], limits: Limits | None = None,
                timeout: float | None = None) -> Trace:
    """`start()` returns the pid of a process stopped before its exec; trace it."""
    return trace_pid(start(), limits, timeout)


def spawn_stopped(argv: list[str], env: dict[str, str] | None = None,
                  cwd: str | None = None) -> int:
    """Fork a child that stops itself, then execs argv (PATH searched)."""
    if not argv:
        raise ValueError("argv must not be empty")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            if cwd:
                os.chdir(cwd)
            os.kill(os.getpid(), signal.SIGSTOP)
            os.execvpe(argv[0], argv, os.environ if env is None else env)
        except BaseException as err:
            os.write(2, f"dsecd.trace: exec {argv[0]}: {err}\n".encode())
        os._exit(127)
    # Our own child: WUNTRACED says when it has stopped.
    _, status = os.waitpid(pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        raise ChildProcessError(f"trace: child {pid} exited before it stopped (status {status})")
    return pid


def trace_command(argv: list[str], limits: Limits | None = None, timeout: float | None = None,
                  env: dict[str, str] | None = None, cwd: str | None = None) -> Trace:
    """Run argv under the tracer; return the record once it and its children exit."""
    pid = spawn_stopped(argv, env, cwd)
    try:
        return trace_pid(pid, limits, timeout)
    except BaseException:
        # Never leave our stopped child behind when the tracer failed.
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass   # already reaped by the tracer's loop
        raise


# ---------------------------------------------------------------- helper process


def main(args: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsecd.trace",
                                description="Trace one command (or a stopped pid) with ptrace.")
    p.add_argument("--pid", type=int, help="trace this stopped process instead of running CMD")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.add_argument("--max-events", type=int, default=Limits.max_events)
    p.add_argument("--max-bytes", type=int, default=Limits.max_bytes)
    p.add_argument("--timeout", type=float)
    p.add_argument("--frozen-file", help="with --timeout: a cgroup freezer file (v1 freezer.state, v2 "
                   "cgroup.freeze); time while it says frozen does not count")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    ns = p.parse_args(args)
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    if (ns.pid is None) == (not cmd):
        p.error("give either --pid or a command after --")
    limits = Limits(max_events=ns.max_events, max_bytes=ns.max_bytes)
    if ns.pid is not None:
        result = trace_pid(ns.pid, limits, ns.timeout, frozen=frozen_by(ns.frozen_file) if ns.frozen_file else None)
    else:
        result = trace_command(cmd, limits, ns.timeout)
    sys.stdout.write(result.to_json() + "\n" if ns.json else result.to_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
