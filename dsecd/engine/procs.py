"""Background processes: started detached in a sandbox (`dsec exec -d`,
`sb.spawn`), named by their pid in the sandbox, their output kept in a
bounded ring per process for `proc_logs`, fed stdin by `proc_input`,
signalled by `proc_kill` and waited for by `proc_wait`.

Each one is an exec the sandbox's init forks (dsecd/initlink.py), with
stdin, stdout and stderr pipes whose other ends the daemon reads and writes.
The daemon also sends init its own ends, which init holds until the daemon
releases them (csrc/init.c, DSEC_INIT_START_HOLD). So when the daemon stops,
the pipes stay open: the process blocks on a full pipe instead of dying of
SIGPIPE, and what it writes meanwhile stays in the pipe (1 MiB each,
F_SETPIPE_SZ). Each process is journaled with its sandbox (its exec id, pid,
host pid and start time, and the inode numbers of its pipes); a restarted
daemon takes the ends back from init by those inodes (pidfd_getfd) and
registers the exec ids with the sandbox's channel, so init's report of the
end (queued while no daemon ran) is read. A clean stop first stops reading
the pipes and lets followers send what the ring holds (quiesce), then
writes each ring to a file of the state dir (OUTPUT_DIR), which the next
daemon reads back: `proc_logs` after a restart or an upgrade still has
what was read before. What the ring of a daemon that died held is lost
with it.

A process's record lives until it is evicted: at most
limits.max_procs_per_sandbox per sandbox, exited ones evicted oldest first,
so `proc_wait` and `proc_logs` work after the end. They end with their
sandbox (the kernel kills them with its pid namespace); pause and resume
leave them alone (frozen with the sandbox).

A microVM's processes are kept by its guest agent instead, output and end
included: the requests go to dsecd/engine/vmprocs.py, and the views here
read the mirror of the agent's ring it keeps.

A process that exited while a child of it still holds its output pipes is
read on for limits.exec_drain_grace_s (`draining` in its record). A stop in
that window leaves the rest in the pipes init holds: the next daemon takes
them back and reads them to their end (or for the grace) before init lets
go of them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import functools
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgpack

from .. import native
from ..backends.container import proc_start_time
from ..errors import BadRequest, Conflict, LimitExceeded, NotFound, Unsupported, io_error, run_error
from ..execio import READ_CHUNK, _decode_status, parse_signal
from ..fds import close_quietly, read_ready
from ..fs import users
from ..initlink import KILLED, InitExec, InitLink, start_strings
from ..turns import Turn, Turns
from .denials import DenialService
from .execs import exec_target, request_user
from .policies import PolicyService
from .sandboxes import Sandbox, SandboxRegistry
from .vmfiles import VmFiles
from .vmprocs import VmProcs
from .workers import Workers

log = logging.getLogger(__name__)

PIPE_SIZE = 1 << 20           # what a process may write while no daemon reads (F_SETPIPE_SZ)
STDIN, STDOUT, STDERR = 1, 2, 4      # init's release mask (csrc/init.c release_held)
# How long after a restart a process found gone may wait for init's report
# of its end (queued on the channel, read as soon as the loop runs).
LOST_END_S = 1.0
# How long a clean stop lets followers send what the daemon read and they
# have not sent yet (quiesce), before it closes their connections anyway:
# a client that reads nothing must not hold the stop.
QUIESCE_S = 5.0
# Where a clean stop leaves each container process's ring for the next
# daemon (under daemon.state_dir): one file per process, named
# `<sandbox id>-<exec id>`, read back and removed at re-adoption.
OUTPUT_DIR = "proc-output"
RING_FILE_VERSION = 1


@dataclass(frozen=True)
class ProcLimits:
    output_bytes: int          # limits.proc_output_bytes: the ring of each process
    max_per_sandbox: int       # limits.max_procs_per_sandbox: records kept, running or exited
    drain_grace_s: float       # limits.exec_drain_grace_s: output read after the end

    @classmethod
    def from_config(cls, cfg) -> ProcLimits:
        limits = cfg.section("limits")
        return cls(cfg.size("limits", "proc_output_bytes"), limits["max_procs_per_sandbox"],
                   limits["exec_drain_grace_s"])


class Ring:
    """A process's latest output, at most `cap` bytes: chunks (offset, time,
    fd, data), where offset counts every byte the process wrote before it.
    What falls out of the front is counted in `dropped`."""

    def __init__(self, cap: int):
        self.cap = cap
        self.chunks: collections.deque[tuple[int, float, int, bytes]] = collections.deque()
        self.size = 0
        self.written = 0           # offset past the last byte read from the process
        self.dropped = 0           # bytes that fell out (= the offset of the oldest kept byte)
        # When the newest of them was read (None: unknown): a follower asking
        # only for output read since a later time wanted none of them, and
        # one asking since that very time only those read then, the last
        # `dropped_at_until` bytes dropped (`since` is inclusive).
        self.dropped_until: float | None = None
        self.dropped_at_until = 0
        # When this daemon followed one that left no count of what it read
        # (it died, or predates the count): what the process wrote before,
        # if anything, went with that daemon, uncounted. None: nothing unknown is lost.
        self.lost_before: float | None = None

    def skip_to(self, offset: int, at: float | None = None, last: int | None = None) -> None:
        """Empty, with `offset` bytes counted as written and dropped: what a
        daemon that stopped cleanly had read (ProcessService.close), the
        last `last` bytes of it at time `at` (None: unknown; all of them
        are then counted as read at `at`)."""
        self.chunks.clear()
        self.size = 0
        self.written = self.dropped = offset
        self.dropped_until = at
        self.dropped_at_until = offset if last is None else min(last, offset)

    def saved(self) -> dict:
        """What restore() needs to make this ring again (ProcessService.close)."""
        return {"version": RING_FILE_VERSION, "written": self.written, "dropped": self.dropped,
                "dropped_until": self.dropped_until, "dropped_at_until": self.dropped_at_until,
                "lost_before": self.lost_before, "chunks": [list(chunk) for chunk in self.chunks]}

    def restore(self, saved: dict) -> None:
        """The ring a daemon that stopped saved (saved()), trimmed to this
        ring's cap (limits.proc_output_bytes may have shrunk meanwhile).
        ValueError (the ring left empty) if it is not one: another
        version's, or damaged."""
        try:
            if saved["version"] != RING_FILE_VERSION:
                raise ValueError(f"version {saved['version']!r}, this daemon reads {RING_FILE_VERSION}")
            self.skip_to(int(saved["dropped"]), saved["dropped_until"], int(saved["dropped_at_until"]))
            for offset, at, fd, data in saved["chunks"]:
                if offset != self.written or not isinstance(data, bytes):
                    raise ValueError(f"a chunk at offset {offset!r} where the ring ends at {self.written}")
                self.append(int(fd), data, float(at))
            if self.written != saved["written"]:
                raise ValueError(f"its chunks end at {self.written}, it says {saved['written']!r}")
            self.lost_before = saved["lost_before"]
        except (KeyError, TypeError) as err:
            self.skip_to(0)
            raise ValueError(f"not a saved ring: {err!r}") from err
        except ValueError:
            self.skip_to(0)
            raise

    def _fell_out(self, at: float, n: int) -> None:
        """`n` bytes read at `at` fell out: dropped_until and its count."""
        if self.dropped_until is None or at > self.dropped_until:
            self.dropped_until, self.dropped_at_until = at, n
        elif at == self.dropped_until:
            self.dropped_at_until += n

    @property
    def read_until(self) -> float | None:
        """When the newest byte written was read (None: unknown, or none)."""
        return self.chunks[-1][1] if self.chunks else self.dropped_until

    @property
    def read_until_bytes(self) -> int:
        """How many of the newest bytes written were read at `read_until`."""
        at = self.read_until
        n = 0
        for _offset, chunk_at, _fd, data in reversed(self.chunks):
            if chunk_at != at:
                return n
            n += len(data)
        return n + (self.dropped_at_until if at is not None and self.dropped_until == at else 0)

    def append(self, fd: int, data: bytes, at: float) -> None:
        offset = self.written
        self.written += len(data)
        if len(data) > self.cap:            # only its tail fits
            offset += len(data) - self.cap
            self._fell_out(at, len(data) - self.cap)
            data = data[-self.cap:]
        self.chunks.append((offset, at, fd, data))
        self.size += len(data)
        while self.size > self.cap:
            _, old_at, _, old = self.chunks.popleft()
            self.size -= len(old)
            self._fell_out(old_at, len(old))
        self.dropped = self.chunks[0][0] if self.chunks else self.written

    def put(self, offset: int, fd: int, data: bytes, at: float) -> None:
        """A chunk that starts at `offset` (a microVM agent's push, which may
        repeat what the ring has after a re-attach, or skip what the agent's
        own ring dropped: then what is kept before the gap goes too, so
        `dropped` stays the offset of the oldest byte kept)."""
        end = offset + len(data)
        if end <= self.written:
            return
        if offset < self.written:
            data = data[self.written - offset:]
        elif offset > self.written:
            # The gap was written before this chunk was read: no later than
            # `at`, so since `at` every byte dropped may have been asked for.
            self.chunks.clear()
            self.size = 0
            self.written = offset
            self.dropped_until, self.dropped_at_until = at, offset
        self.append(fd, data, at)

    def after(self, pos: int, since: float | None = None) -> tuple[int, list[tuple[int, float, int, bytes]]]:
        """(bytes lost past `pos` because they fell out, the chunks from `pos`
        on); with `since`, a follower's who wants only what was read at or
        after that time, none are lost when all were read before it."""
        out = []
        for chunk in reversed(self.chunks):          # a follower near the end reads few
            if chunk[0] < pos:
                break
            out.append(chunk)
        out.reverse()
        lost = max(0, self.dropped - pos)
        if since is not None and self.dropped_until is not None:
            if self.dropped_until < since:
                return 0, out
            if self.dropped_until == since:          # only the newest ones, read at `since`
                return min(lost, self.dropped_at_until), out
        return lost, out


class BgProc:
    """One background process: its pipes, ring and end; `tick` is done (and
    replaced) at each change, which followers await (no polling)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rec: dict, ring_bytes: int):
        self.loop = loop
        self.rec = rec             # its journal record (dsecd/engine/sandboxes.py Sandbox.procs)
        self.pid: int = rec["pid"]
        # A microVM's process lives in its guest agent (dsecd/engine/vmprocs.py): no pipes here.
        self.vm: bool = bool(rec.get("vm"))
        self.vm_stdin: bool = self.vm and rec["state"] == "running" and rec.get("stdin", True)
        self.vm_in = 0              # input bytes the agent took (the offset of the next)
        # The agent's input request of a proc_input that was cancelled (its
        # client went: an ssh:// link cut) while the agent held its data for
        # a process that did not read: it runs on until the pipe took it,
        # and the next input waits for it (the agent takes one at a time).
        self.vm_input: asyncio.Task | None = None
        # Input bytes written to a container process's stdin (the offset of
        # the next; proc_input's `offset` is checked against it): 0 at its
        # start; journaled by a clean stop and taken off the record by the
        # next daemon, so that a later crash does not reuse it. None:
        # unknown (the daemon before died with its count).
        self.stdin_in: int | None = rec.pop("stdin_in", None)
        self.ring = Ring(ring_bytes)
        self.run: InitExec | None = None
        # The init channel and exec id under which init holds the daemon's
        # ends of its pipes (released once they are drained).
        self.held: tuple[InitLink, int] | None = None
        self.fds = {"stdin": -1, "stdout": -1, "stderr": -1}
        self.over = loop.create_future()        # done once exited and its output drained
        self.ended = loop.create_future()       # done at its exit: the status (None: unknown)
        self.tick = loop.create_future()
        self.stdin_lock = asyncio.Lock()
        self._grace: asyncio.TimerHandle | None = None
        if rec["state"] == "exited":
            self.ended.set_result(rec.get("status"))
            if not rec.get("draining"):     # else a daemon before stopped while reading its pipes
                self.over.set_result(None)

    @property
    def running(self) -> bool:
        return not self.ended.done()

    def wake(self) -> None:
        tick, self.tick = self.tick, self.loop.create_future()
        tick.set_result(None)

    def public(self) -> dict:
        code, sig = self.exit_status()
        return {"pid": self.pid, "state": "running" if self.running else "exited", "exit_code": code,
                "signal": sig, "argv": self.rec["argv"], "started": self.rec["started"],
                "ended": self.rec.get("ended"), "output_bytes": self.ring.size, "dropped": self.ring.dropped,
                "lost_before": self.ring.lost_before,
                "stdin_open": self.vm_stdin if self.vm else self.fds["stdin"] >= 0, "policy": self.rec.get("policy")}

    def exit_status(self) -> tuple[int | None, int | None]:
        if self.running or self.ended.result() is None:
            return None, None
        return _decode_status(self.ended.result())


class ProcessService:
    """`proc_start`, `proc_list`, `proc_logs`, `proc_input`, `proc_kill`,
    `proc_wait`; re-adoption after a restart (take_back, readopt) and the end
    of a sandbox's processes (forget). `ensure_running(sb, why)` resumes a
    paused sandbox first (the memory service's); `policies` says which task
    policy a process runs under, as for an exec."""

    def __init__(self, registry: SandboxRegistry, workers: Workers, backend,
                 ensure_running: Callable[[Sandbox, str], Awaitable[None]], limits: ProcLimits,
                 policies: PolicyService, vms, denials: DenialService | None = None,
                 output_dir: Path | None = None, vm_files: VmFiles | None = None):
        self.policies = policies
        # Where a clean stop saves the rings for the next daemon (OUTPUT_DIR); None: they go with it.
        self.output_dir = output_dir
        self.vms = vms              # MicroVMService: the channel to a microVM's agent
        self.vm_files = vm_files    # VmFiles: a microVM's /etc/passwd and /etc/group, for a named user
        self.denials = denials
        self.registry = registry
        self.workers = workers
        self.backend = backend
        self.ensure_running = ensure_running
        self.limits = limits
        self.tables: dict[str, dict[int, BgProc]] = {}      # sandbox id -> pid -> process, oldest first
        self.starting: dict[str, int] = {}                   # sandbox id -> starts not in its table yet
        self.closing = False
        self.seats: set[_Seat] = set()                       # the followers of proc_logs, where each is
        self._seats_moved: asyncio.Event | None = None       # set as one moves, while a stop waits (quiesce)
        # (sandbox id, pid) -> the queue of the inputs that came for the
        # process and have not yet taken its stdin_lock (_stdin_in_turn).
        self._input_turns: Turns[tuple[str, int], Turn] = Turns(Turn)
        self.vm = VmProcs(self)

    # ------------------------------------------------------------ start

    async def start(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        # Its answer is small and is its own summary: the pid and start time.
        return await self.registry.op_keys.once(sb, "proc_start", req, ctx, lambda: self._start(sb, req), dict,
                                                _as_it_was)

    async def _start(self, sb: Sandbox, req) -> dict:
        named = await request_user(sb, req, "starting a process", self.workers, self.vm_files, self.ensure_running)
        env, cwd, ids = exec_target(sb, req, self.backend, named)
        table = self.tables.setdefault(sb.id, {})
        with self._room(sb, table):
            if sb.backend == "microvm":
                return await self._start_vm(sb, req, env, cwd, ids, table)
            return await self._start_container(sb, req, env, cwd, ids, table)

    @contextlib.contextmanager
    def _room(self, sb: Sandbox, table: dict[int, BgProc]):
        """A place among the sandbox's limits.max_procs_per_sandbox records,
        held while the start awaits: starts in flight count, so concurrent
        ones cannot all pass the check before any is recorded."""
        self._make_room(sb, table)
        self.starting[sb.id] = self.starting.get(sb.id, 0) + 1
        try:
            yield
        finally:
            left = self.starting[sb.id] - 1
            if left:
                self.starting[sb.id] = left
            else:
                del self.starting[sb.id]

    async def _start_container(self, sb: Sandbox, req, env: list[str], cwd: str, ids: users.ProcessIds,
                               table: dict[int, BgProc]) -> dict:
        applied = self.policies.for_exec(sb, req.policy, "proc_start")
        h = sb.handle
        if h is None or h.init_link is None or h.init_link.closed or not h.init_starts:
            raise Conflict(f"sandbox {sb.id} cannot start background processes: its init takes no requests "
                           "(made with sandbox.exec_via = helper, by an older daemon, or before "
                           "sandbox.capabilities grew); use exec, or create a new sandbox", {"sandbox": sb.id})
        try:
            size = len(start_strings(list(req.argv), env, cwd, ids.uid, ids.gid))
        except ValueError as err:
            raise BadRequest(f"proc_start: {err}") from err
        if size > native.INIT_MAX_STRINGS:
            # Only init starts background processes, and its channel takes one
            # message: no retry can start this one.
            raise LimitExceeded(f"proc_start: its command, environment and working directory come to {size} "
                                f"bytes; the sandbox's init, which starts background processes, takes at most "
                                f"{native.INIT_MAX_STRINGS}: pass long input through its stdin or a file (an "
                                "exec takes more)", {"bytes": size, "max": native.INIT_MAX_STRINGS})
        await self.ensure_running(sb, "starting a process")
        ref = None if self.denials is None else await self.denials.exec_starting(sb, applied, req.argv[0])
        ours, theirs = _open_pipes(req.stdin)
        try:
            # Without stdin init holds a copy of the process's /dev/null in its place.
            hold = (ours["stdin"] if ours["stdin"] >= 0 else theirs[0], ours["stdout"], ours["stderr"])
            run = self.backend.start_by_init(self.workers.loop, h, list(req.argv), env, cwd, ids.uid, theirs,
                                             hold=hold, gid=ids.gid, policy=applied and applied.plan,
                                             cap_keep=applied and applied.cap_keep(self.backend.caps),
                                             background=True, groups=ids.groups)
        except ValueError as err:
            _close_all(ours.values())
            raise BadRequest(f"proc_start: {err}") from err
        finally:
            _close_all(theirs)
        if run is None:
            _close_all(ours.values())
            raise Conflict(f"sandbox {sb.id}: its init did not take the request (busy, or the request is "
                           "larger than one message of 64 KiB); retry, or use a shorter command or environment",
                           {"sandbox": sb.id})
        try:
            pid = await asyncio.shield(run.started())
        except OSError as err:
            _close_all(ours.values())
            if run.exited.done() and not run.exited.cancelled():
                run.exited.exception()      # the same error, answered here: else logged as never retrieved
            raise run_error(err, sb.id, req.argv[0], cwd, init_needs(applied is not None, ids)) from err
        except asyncio.CancelledError:
            run.kill()
            run.link.release(run.id, STDIN | STDOUT | STDERR)
            _close_all(ours.values())
            raise
        if ref is not None:
            self.denials.bind(ref, pid)
        rec = {"id": run.id, "pid": pid, "argv": list(req.argv), "started": time.time(), "state": "running",
               "policy": applied.name if applied else None,
               "inodes": [os.fstat(ours[k]).st_ino if ours[k] >= 0 else 0 for k in ("stdin", "stdout", "stderr")]}
        rec["host_pid"], rec["host_start"] = _host_identity(run.pidfd)
        proc = self.new_proc(rec)
        proc.stdin_in = 0
        old = table.pop(pid, None)              # an exited record of a pid the sandbox reused
        if old is not None:
            self._drop(old)
        table[pid] = proc
        self._watch(sb, proc, run, ours)
        self._save(sb)
        sb.last_active = time.monotonic()
        return {"pid": pid, "started": rec["started"]}

    async def _start_vm(self, sb: Sandbox, req, env: list[str], cwd: str, ids: users.ProcessIds,
                        table: dict[int, BgProc]) -> dict:
        if req.policy is not None or sb.policy is not None:
            raise Unsupported(f"sandbox {sb.id} is a microVM: task policies (Landlock in dsec-init) are "
                              "enforced in containers only")
        await self.ensure_running(sb, "starting a process")
        # A pause waits for the start and the attach after it as one: counted
        # apart, it could end QEMU between them, with the attach's request
        # on its way to the agent.
        with self.vm.request_running(sb):
            pid, rec = await self.vm.start(sb, req, env, cwd, ids)
            proc = self.new_proc(rec)
            old = table.pop(pid, None)              # an exited record of a pid the guest reused
            if old is not None:
                self._drop(old)
            table[pid] = proc
            self._save(sb)
            await asyncio.shield(self.vm.attach(sb, proc))     # followed even if the request goes now
        sb.last_active = time.monotonic()
        return {"pid": pid, "started": rec["started"]}

    def new_proc(self, rec: dict) -> BgProc:
        return BgProc(self.workers.loop, rec, self.limits.output_bytes)

    def _make_room(self, sb: Sandbox, table: dict[int, BgProc]) -> None:
        """Evict exited records, oldest first, until a new one fits beside
        those being started."""
        while len(table) + self.starting.get(sb.id, 0) >= self.limits.max_per_sandbox:
            oldest = next((p for p in table.values() if not p.running), None)
            if oldest is None:
                live = len(table) + self.starting.get(sb.id, 0)
                raise LimitExceeded(f"sandbox {sb.id} has {live} background processes running or starting, "
                                    "the most limits.max_procs_per_sandbox allows; kill or wait for one first",
                                    {"sandbox": sb.id, "max": self.limits.max_per_sandbox})
            del table[oldest.pid]
            self._drop(oldest)
            if oldest.vm:
                self.vm.forget_in_guest(sb, oldest)

    def _watch(self, sb: Sandbox, proc: BgProc, run: InitExec, fds: dict[str, int]) -> None:
        """Read its output into the ring and watch its end."""
        proc.run = run
        proc.held = (run.link, run.id)
        self._read_output(sb, proc, fds)
        if proc.fds["stdin"] >= 0:
            os.set_blocking(proc.fds["stdin"], False)
        run.exited.add_done_callback(lambda fut: self._on_exit(sb, proc, fut))
        self._maybe_over(sb, proc)

    def _read_output(self, sb: Sandbox, proc: BgProc, fds: dict[str, int]) -> None:
        """Take the daemon's ends of its pipes, and read stdout and stderr into the ring."""
        proc.fds.update(fds)
        loop = self.workers.loop
        for name, stream in (("stdout", 1), ("stderr", 2)):
            fd = proc.fds[name]
            if fd >= 0:
                os.set_blocking(fd, False)
                if not self.closing:        # else what it writes waits in the pipe for the next daemon
                    loop.add_reader(fd, self._on_output, sb, proc, name, stream)

    # ------------------------------------------------------------ output and end

    def _on_output(self, sb: Sandbox, proc: BgProc, name: str, stream: int) -> None:
        data = read_ready(proc.fds[name], READ_CHUNK)
        if data is None:
            return
        if data:
            proc.ring.append(stream, data, time.time())
        else:
            self._close_end(proc, name)
            self._maybe_over(sb, proc)
        proc.wake()

    def _on_exit(self, sb: Sandbox, proc: BgProc, fut: asyncio.Future) -> None:
        if proc.ended.done():
            return
        answer = None if fut.cancelled() or fut.exception() is not None else fut.result()
        status = None if answer is None else answer["status"]
        if self.closing:
            # The daemon stops: the process's output stays in init's pipes for
            # the next daemon, which needs its status too (init reports it once).
            if answer is not None and answer["reported"]:
                proc.rec["end_status"] = status
                self._save(sb)
            return
        self._ended(sb, proc, status)

    def _ended(self, sb: Sandbox, proc: BgProc, status: int | None, ended: float | None = None) -> None:
        """`ended`: when it ended (epoch seconds) where its sandbox says so
        (a microVM's agent); else now."""
        proc.ended.set_result(status)
        proc.rec.update(state="exited", status=status, ended=ended or time.time())
        self._close_end(proc, "stdin")
        if proc.fds["stdout"] >= 0 or proc.fds["stderr"] >= 0:
            # Journaled (below), so that a daemon stopping before the pipes
            # are drained leaves the rest to the next one (readopt), not lost.
            proc.rec["draining"] = True
            self._drain_for_grace(sb, proc)
        self._save(sb)
        self._maybe_over(sb, proc)
        proc.wake()

    def _drain_for_grace(self, sb: Sandbox, proc: BgProc) -> None:
        """Its children may hold the pipes open: read a little longer, then stop."""
        proc._grace = self.workers.loop.call_later(self.limits.drain_grace_s, self._stop_reading, sb, proc)

    def _stop_reading(self, sb: Sandbox, proc: BgProc) -> None:
        for name in ("stdout", "stderr"):
            self._close_end(proc, name)
        self._maybe_over(sb, proc)
        proc.wake()

    def _maybe_over(self, sb: Sandbox, proc: BgProc) -> None:
        """Exited and drained: init lets go of the pipes it held, followers end."""
        if proc.over.done() or proc.running or proc.fds["stdout"] >= 0 or proc.fds["stderr"] >= 0:
            return
        if proc._grace is not None:
            proc._grace.cancel()
        if not self.closing:
            self._release(proc, STDIN | STDOUT | STDERR)
            if proc.rec.pop("draining", False):
                self._save(sb)
        proc.over.set_result(None)

    @staticmethod
    def _release(proc: BgProc, mask: int) -> None:
        """Init lets go of the ends it holds of the process's pipes in `mask`."""
        if proc.held is not None:
            link, exec_id = proc.held
            link.release(exec_id, mask)

    def _close_end(self, proc: BgProc, name: str) -> None:
        fd = proc.fds[name]
        if fd < 0:
            return
        # Off the loop before the close: init holds a copy of each end, so
        # the kernel's registration would outlive the number, and a later fd
        # of that number would never be watched.
        if name == "stdin":
            self.workers.loop.remove_writer(fd)
        else:
            self.workers.loop.remove_reader(fd)
        close_quietly(fd)
        proc.fds[name] = -1

    def _drop(self, proc: BgProc) -> None:
        """An evicted or forgotten record: its fds go, init lets go of the
        pipe ends it held for it, its followers end."""
        for name in proc.fds:
            self._close_end(proc, name)
        if not self.closing and not proc.over.done():
            self._release(proc, STDIN | STDOUT | STDERR)
        if proc._grace is not None:
            proc._grace.cancel()
        if not proc.ended.done():
            proc.ended.set_result(KILLED)
        if not proc.over.done():
            proc.over.set_result(None)
        proc.wake()

    def _save(self, sb: Sandbox) -> None:
        """Journal the sandbox's process records (not once it is going: its record is gone)."""
        if not self.registry.listed(sb) or sb.state not in ("running", "paused", "dead"):
            return
        sb.procs = [p.rec for p in self.tables.get(sb.id, {}).values()]
        self.registry.save(sb)

    # ------------------------------------------------------------ views and verbs

    async def _found(self, req) -> tuple[Sandbox, BgProc]:
        """_find, once a microVM's processes are attached on its current channel."""
        sb = self.registry.get(req.sandbox, req)
        if sb.backend == "microvm":
            await self.vm.settled(sb)
        return self._find(req)

    def _find(self, req) -> tuple[Sandbox, BgProc]:
        sb = self.registry.get(req.sandbox, req)
        proc = self.tables.get(sb.id, {}).get(req.pid)
        if proc is None:
            raise NotFound(f"no background process with pid {req.pid} in sandbox {sb.id} (see `dsec proc ls "
                           f"{sb.id}`; exited ones are kept until limits.max_procs_per_sandbox newer ones "
                           "push them out)", {"sandbox": sb.id, "pid": req.pid})
        return sb, proc

    async def list(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        if sb.backend == "microvm":
            await self.vm.settled(sb)
        return {"processes": [p.public() for p in self.tables.get(sb.id, {}).values()]}

    async def wait(self, req, ctx) -> dict:
        _sb, proc = await self._found(req)
        await asyncio.shield(proc.ended)
        return proc.public()

    async def kill(self, req, ctx) -> dict:
        sb, proc = await self._found(req)
        signum = parse_signal(req.signal)
        if not proc.running:
            code, sig = proc.exit_status()
            how = f"exit code {code}" if sig is None else f"signal {sig}"
            raise Conflict(f"process {proc.pid} in sandbox {sb.id} has already exited ({how}); nothing to signal",
                           {"sandbox": sb.id, "pid": proc.pid, "state": "exited", "exit_code": code,
                            "signal": sig})
        # Paused, it would act on the signal only at its resume (a
        # container's is relayed by its init, frozen with it): resumed first,
        # as for an exec.
        await self.ensure_running(sb, "signalling a process")
        if proc.vm:
            sent = await self.vm.kill(sb, proc, signum)
        else:
            sent = proc.run is not None and proc.run.signal(signum)
        return {"pid": proc.pid, "signal": signum, "sent": sent}

    @contextlib.asynccontextmanager
    async def _stdin_in_turn(self, req):
        """(sandbox, process) of a proc_input, holding the process's
        stdin_lock, which its inputs take in the order they came: the
        client numbers them (`offset`) in the order it sends them, and one
        that overtook another would be refused as past the bytes written.
        A microVM's process is looked up only once the attach of its
        current channel is done (_found): an input that came while it ran
        waits for it and one that came just after does not, so without
        this queue the later one could reach the lock first."""
        sb = self.registry.get(req.sandbox, req)
        async with self._input_turns.taken((sb.id, req.pid)):
            sb, proc = await self._found(req)
            await proc.stdin_lock.acquire()
        try:
            yield sb, proc
        finally:
            proc.stdin_lock.release()

    async def input(self, req, ctx) -> dict:
        async with self._stdin_in_turn(req) as (sb, proc):
            if proc.vm:
                return await self._input_vm(sb, proc, req)
            data = _not_written_yet(sb, proc, req, proc.stdin_in)
            fd = proc.fds["stdin"]
            if fd < 0:
                if req.offset is not None and not data:     # all of it went in before: the request sent again
                    return {"pid": proc.pid, "written": len(req.data), "skipped": len(req.data)}
                why = "has exited" if not proc.running else "has no stdin open (closed, or started without it)"
                raise Conflict(f"process {proc.pid} in sandbox {sb.id} {why}: cannot write to its stdin",
                               {"sandbox": sb.id, "pid": proc.pid, "state": "running" if proc.running else "exited"})
            try:
                await self._write_all(proc, fd, data)
            except BrokenPipeError as err:
                self._close_stdin(proc)
                raise Conflict(f"process {proc.pid} in sandbox {sb.id} closed its stdin; nothing more reaches it",
                               {"sandbox": sb.id, "pid": proc.pid}) from err
            except OSError as err:
                raise io_error("write to the stdin of", f"process {proc.pid} in sandbox {sb.id}", err) from err
            if req.eof:
                self._close_stdin(proc)
        return {"pid": proc.pid, "written": len(req.data), "skipped": len(req.data) - len(data)}

    async def _input_vm(self, sb: Sandbox, proc: BgProc, req) -> dict:
        """A microVM process's input, under its stdin_lock."""
        if proc.vm_input is not None:
            # Its own errors went with the request that was cancelled;
            # what it took is in vm_in, or (a channel gone meanwhile)
            # the agent skips it by its offset.
            with contextlib.suppress(Exception):
                await asyncio.shield(proc.vm_input)
        # What the agent took may be more than vm_in says (a request cut
        # before its answer): the agent skips that part by its offset too.
        data = _not_written_yet(sb, proc, req, proc.vm_in)
        if not proc.vm_stdin:
            if req.offset is not None and not data:
                return {"pid": proc.pid, "written": len(req.data), "skipped": len(req.data)}
            why = "has exited" if not proc.running else "has no stdin open (closed, or started without it)"
            raise Conflict(f"process {proc.pid} in sandbox {sb.id} {why}: cannot write to its stdin",
                           {"sandbox": sb.id, "pid": proc.pid, "state": "running" if proc.running else "exited"})
        sending = asyncio.ensure_future(self.vm.input(sb, proc, data, req.eof))
        sending.add_done_callback(functools.partial(_input_sent, proc))
        proc.vm_input = sending
        try:
            # Shielded: cancelled, this request leaves its input to the
            # agent, which holds it anyway; the request sent again waits
            # for it instead of finding the agent busy with it.
            await asyncio.shield(sending)
        except BrokenPipeError as err:
            why = "has exited" if not proc.running else "closed its stdin; nothing more reaches it"
            raise Conflict(f"process {proc.pid} in sandbox {sb.id} {why}",
                           {"sandbox": sb.id, "pid": proc.pid}) from err
        return {"pid": proc.pid, "written": len(req.data), "skipped": len(req.data) - len(data)}

    async def _write_all(self, proc: BgProc, fd: int, data: bytes) -> None:
        view = memoryview(data)
        loop = self.workers.loop
        while view:
            try:
                n = os.write(fd, view)
                # Counted as it goes: a request cut while the pipe is full
                # has written this much, which the one sent again skips.
                if proc.stdin_in is not None:
                    proc.stdin_in += n
                view = view[n:]
                continue
            except BlockingIOError:
                pass
            writable = loop.create_future()
            loop.add_writer(fd, _set_once, writable)
            try:
                await asyncio.wait({writable, proc.ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if proc.fds["stdin"] == fd:      # else _close_end took it off and closed it
                    loop.remove_writer(fd)
            if proc.ended.done():
                raise BrokenPipeError(errno.EPIPE, "the process exited")

    def _close_stdin(self, proc: BgProc) -> None:
        self._close_end(proc, "stdin")
        self._release(proc, STDIN)

    async def logs(self, req, ctx) -> dict:
        """Stream {"dropped": n} first (bytes that fell out before the first
        chunk; with "lost_before": t when a daemon that crashed took an
        uncounted part of it: Ring.lost_before), then {"fd", "data", "time"}
        chunks, and {"dropped": n} again where a slow follower lost some;
        the result is the process's state."""
        _sb, proc = await self._found(req)
        seat = _Seat(proc)
        self.seats.add(seat)
        try:
            return await self._follow(proc, req, ctx, seat)
        finally:
            self.seats.discard(seat)
            self._seat_moved()

    async def _follow(self, proc: BgProc, req, ctx, seat: _Seat) -> dict:
        pos = 0
        first = True
        while True:
            tick = proc.tick            # taken before the read: nothing between them is missed
            over = proc.over.done()
            base = proc.ring.dropped
            lost, chunks = proc.ring.after(pos, req.since)
            if lost or first:
                frame: dict = {"dropped": lost}
                gap = proc.ring.lost_before
                if first and gap is not None and (req.since is None or req.since < gap):
                    frame["lost_before"] = gap
                await ctx.emit(frame)
                first = False
            pos = max(pos, base)
            for offset, at, fd, data in chunks:       # a copy: the ring may move on while we emit
                pos = offset + len(data)
                if req.since is None or at >= req.since:
                    await ctx.emit({"fd": fd, "data": data, "time": at})
            if over or not req.follow:
                return proc.public()
            seat.pos, seat.waiting = pos, True
            self._seat_moved()
            try:
                # Shared by every follower: one that is cancelled (its client
                # left) must not cancel it for the others.
                await asyncio.shield(tick)
            finally:
                seat.waiting = False

    def _seat_moved(self) -> None:
        if self._seats_moved is not None:
            self._seats_moved.set()

    async def quiesce(self, timeout: float = QUIESCE_S) -> None:
        """Daemon stop, before its connections close: stop reading the
        pipes of container processes (what they write from now on waits
        there for the next daemon, which counts on from what this one read),
        then wait, `timeout` at most, for every follower to have sent what
        the ring holds. Else what this daemon read and had not sent yet
        would go with it: a follower that takes the output up on the next
        daemon would be told of it as dropped. A microVM's ring is its
        agent's, given again to the next daemon: nothing of it is waited for."""
        self.closing = True
        loop = self.workers.loop
        for table in self.tables.values():
            for proc in table.values():
                for name in ("stdout", "stderr"):
                    if proc.fds[name] >= 0:
                        loop.remove_reader(proc.fds[name])
                if proc._grace is not None:
                    # An exited process's read-on (draining) is the next
                    # daemon's now: its end must not tell followers the
                    # output is over while the rest waits in the pipe.
                    proc._grace.cancel()
        self._seats_moved = asyncio.Event()
        deadline = loop.time() + timeout
        try:
            while behind := [s for s in self.seats if not s.proc.vm and not s.sent_all()]:
                self._seats_moved.clear()
                left = deadline - loop.time()
                try:
                    if left <= 0:
                        raise TimeoutError
                    await asyncio.wait_for(self._seats_moved.wait(), left)
                except TimeoutError:
                    log.warning("stopping with %d follower(s) of background processes' output not caught up "
                                "after %.0f s (clients not reading); what they did not get is reported to "
                                "them as dropped when they follow again", len(behind), timeout)
                    return
        finally:
            self._seats_moved = None

    # ------------------------------------------------------------ sandbox ends, daemon stops, restarts

    def forget(self, sb_id: str) -> None:
        """The sandbox is destroyed: its processes died with it."""
        for proc in self.tables.pop(sb_id, {}).values():
            self._drop(proc)
        self.vm.gone(sb_id)

    def close(self) -> None:
        """Daemon shutdown: stop reading, close our ends; init holds its own,
        so the processes run on for the next daemon. How much of each
        container process's output this daemon read is journaled, and what
        its ring holds saved (OUTPUT_DIR), for the next daemon (readopt):
        the ring again, or, where the file is not there, a `dropped` count."""
        self.closing = True
        self._clear_saved_rings()
        for sb_id, table in self.tables.items():
            for proc in table.values():
                for name in proc.fds:
                    self._close_end(proc, name)
                if proc._grace is not None:
                    proc._grace.cancel()
                if proc.vm_input is not None:       # the agent keeps the input: the next daemon's to wait for
                    proc.vm_input.cancel()
                if not proc.vm:
                    if proc.stdin_in is not None:
                        proc.rec["stdin_in"] = proc.stdin_in
                    proc.rec["output_seen"] = proc.ring.written
                    proc.rec["output_seen_at"] = proc.ring.read_until
                    proc.rec["output_seen_last"] = proc.ring.read_until_bytes
                    if self.output_dir is not None:
                        save_ring(self.output_dir, sb_id, proc)
            sb = self.registry.by_id.get(sb_id)
            if sb is not None and table:
                try:
                    self._save(sb)
                except Exception:       # the shutdown goes on: the next daemon then says the count is unknown
                    log.exception("sandbox %s: journal its processes' output counts at shutdown", sb_id)

    def _clear_saved_rings(self) -> None:
        """Before this stop saves its rings: the files no daemon read back
        (a sandbox destroyed by an older daemon that does not know them)."""
        if self.output_dir is None:
            return
        try:
            shutil.rmtree(self.output_dir)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("cannot remove the saved output of background processes in %s: %s; "
                        "a file of a process the next daemon re-adopts is checked against its record",
                        self.output_dir, err)

    def take_back(self, sb: Sandbox, h) -> dict[int, dict]:
        """After a restart, in a worker thread: for each journaled running
        process, its pipe ends held by init (found by inode among init's
        fds, taken with pidfd_getfd) and a pidfd if it still runs. Exec id ->
        {"fds": {name: fd}, "pidfd": fd or -1}."""
        running = [r for r in sb.procs if r.get("state") == "running" or r.get("draining")]
        if not running:
            return {}
        by_inode = _pipes_of(h.init_pid)
        out = {}
        for rec in running:
            fds = {}
            for name, ino in zip(("stdin", "stdout", "stderr"), rec.get("inodes", ()), strict=False):
                fds[name] = -1
                if name == "stdin" and rec.get("state") != "running":
                    continue        # an exited process's input was closed at its end
                if ino and ino in by_inode:
                    try:
                        fds[name] = native.pidfd_getfd(h.pidfd, by_inode[ino])
                    except OSError as err:
                        log.warning("sandbox %s: cannot take back the %s of process %d from init: %s",
                                    sb.id, name, rec["pid"], err)
            out[rec["id"]] = {"fds": fds, "pidfd": _pidfd_if_same(rec.get("host_pid"), rec.get("host_start"))}
        return out

    def readopt(self, sb: Sandbox, h, taken: dict[int, dict]) -> None:
        """After a restart, on the loop, right after the sandbox's channel is
        attached (before any answer of init is read): the journaled processes
        again, their exec ids registered with the channel. A process this
        daemon cannot watch (no channel) is recorded as exited, status unknown."""
        table = self.tables.setdefault(sb.id, {})
        link = h.init_link if h is not None else None
        if link is not None:
            # The foreground execs (and copies) a daemon that died left to init
            # go: their clients went with it. A clean stop left none.
            link.prune([rec["id"] for rec in sb.procs])
        now = time.time()
        for rec in sb.procs:
            proc = self.new_proc(dict(rec))
            table[proc.pid] = proc
            output_back(self.output_dir, sb.id, proc, now)
            if not proc.running:
                if rec.get("draining"):
                    self._drain_again(sb, proc, link, taken.get(rec["id"], {"fds": {}})["fds"])
                elif link is not None:
                    link.release(rec["id"], STDIN | STDOUT | STDERR)   # held still if the daemon died mid-end
                continue
            got = taken.get(rec["id"], {"fds": {}, "pidfd": -1})
            run = link.adopt(rec["id"], rec["pid"], got["pidfd"], rec["argv"][0]) if link is not None else None
            if run is None:
                _close_all(got["fds"].values())
                if got["pidfd"] >= 0 and link is None:
                    os.close(got["pidfd"])
                self._lost(sb, proc, "no exec channel to its init")
                continue
            self._watch(sb, proc, run, got["fds"])
            if "end_status" in rec:          # its end reached the daemon before, as it stopped
                link.pending.pop(rec["id"], None)
                self._ended(sb, proc, proc.rec.pop("end_status"))
            elif got["pidfd"] < 0:
                # It ended while no daemon ran: init's report is queued on the
                # channel, read at once; unless the daemon before read it and
                # stopped before journaling it.
                self.workers.loop.call_later(LOST_END_S, self._lost, sb, proc, "its end was not reported")
        self._save(sb)

    def _drain_again(self, sb: Sandbox, proc: BgProc, link, fds: dict[str, int]) -> None:
        """An exited process whose pipes the daemon before was still reading
        when it stopped (a child of it holds them): what is left in them is
        read, to their end or for limits.exec_drain_grace_s, and then init
        lets go of them. Without a channel to init, nothing can be released:
        the output stops here."""
        if link is None:
            _close_all(fds.values())
            proc.rec.pop("draining", None)
            proc.over.set_result(None)
            return
        proc.held = (link, proc.rec["id"])
        self._read_output(sb, proc, fds)
        self._drain_for_grace(sb, proc)
        self._maybe_over(sb, proc)

    def vm_died(self, sb: Sandbox) -> None:
        """A microVM died on its own: its running processes ended with it,
        as if killed (signal 9); their output is what reached the daemon."""
        self.vm.gone(sb.id)
        for proc in self.tables.get(sb.id, {}).values():
            if proc.running:
                self._ended(sb, proc, KILLED)

    def readopt_vm(self, sb: Sandbox) -> None:
        """After a restart, a microVM's journaled processes again; once its
        agent is reached (now if it runs, at its resume if paused), they are
        attached and their rings refilled from the agent's (vmprocs.py)."""
        table = self.tables.setdefault(sb.id, {})
        for rec in sb.procs:
            proc = self.new_proc(dict(rec))
            table[proc.pid] = proc
        self.vm.linked(sb)

    def _lost(self, sb: Sandbox, proc: BgProc, why: str) -> None:
        """A re-adopted process whose end this daemon cannot know: exited, status unknown."""
        if not proc.running:
            return
        log.warning("sandbox %s: background process %d: %s; recorded as exited, status unknown",
                    sb.id, proc.pid, why)
        self._ended(sb, proc, None)


class _Seat:
    """Where a follower of a process's output (proc_logs) is: `pos`, the
    offset past what it went through, once it is `waiting` for more."""

    __slots__ = ("proc", "pos", "waiting")

    def __init__(self, proc: BgProc):
        self.proc = proc
        self.pos = 0
        self.waiting = False

    def sent_all(self) -> bool:
        """Waiting for output past all the ring holds (or for the process's end)."""
        return self.waiting and self.pos >= self.proc.ring.written


def _input_sent(proc: BgProc, sending: asyncio.Task) -> None:
    """A microVM process's input request ended: the next input need not
    wait for it (its error, if any, was its request's, or nobody's once
    that was cancelled)."""
    if proc.vm_input is sending:
        proc.vm_input = None
    if not sending.cancelled():
        sending.exception()


def _not_written_yet(sb: Sandbox, proc: BgProc, req, taken: int | None) -> bytes:
    """The part of a proc_input's data that its process's stdin has not
    taken yet, by the request's `offset` (where its data begins in all the
    input) against `taken` (the bytes written so far): all of it without
    an offset."""
    if req.offset is None:
        return req.data
    where = {"sandbox": sb.id, "pid": proc.pid, "offset": req.offset}
    if req.offset < 0:
        # Taken as an offset, it would drop the data's first bytes unwritten as "skipped".
        raise BadRequest(f"proc_input: offset must be 0 or more (where the data begins in all the input "
                         f"sent to process {proc.pid}'s stdin), got {req.offset}", where)
    if taken is None:
        raise Conflict(f"process {proc.pid} in sandbox {sb.id}: how much input its stdin took is unknown (the "
                       "daemon before this one died with the count), so input at an offset cannot be checked; "
                       "send it without an offset", where)
    if req.offset > taken:
        raise Conflict(f"process {proc.pid} in sandbox {sb.id}: input at offset {req.offset} is past the {taken} "
                       f"bytes its stdin took: the bytes between were never written; send them first (from "
                       f"offset {taken})", {**where, "taken": taken})
    return req.data[taken - req.offset:]


async def _as_it_was(answer: dict) -> dict:
    return answer


def init_needs(policy: bool, ids: users.ProcessIds) -> list[str]:
    """What starting a background process with a task policy (or not) as
    `ids` asks of the sandbox's init, in the words of errors.run_error:
    what an init older than its daemon may refuse."""
    needs = ["a background process"]
    if policy:
        needs.append("under a task policy")
    if ids.groups:
        needs.append(f"with supplementary groups ({', '.join(map(str, ids.groups))})")
    return needs


def _ring_path(output_dir: Path, sb_id: str, proc: BgProc) -> Path:
    return output_dir / f"{sb_id}-{proc.rec['id']}"


def save_ring(output_dir: Path, sb_id: str, proc: BgProc) -> None:
    """At a clean stop (ProcessService.close): what the process's ring
    holds, for the next daemon (output_back). A file that cannot be written
    costs only that output: the next daemon counts it as dropped, as it
    would without."""
    if not proc.ring.chunks:
        return
    path = _ring_path(output_dir, sb_id, proc)
    try:
        output_dir.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(msgpack.packb(proc.ring.saved(), use_bin_type=True))
        os.rename(tmp, path)
    except OSError as err:
        log.warning("sandbox %s: cannot save the output of background process %d to %s: %s; "
                    "the next daemon reports its %d bytes as dropped", sb_id, proc.pid, path, err,
                    proc.ring.size)


def output_back(output_dir: Path | None, sb_id: str, proc: BgProc, now: float) -> None:
    """A re-adopted container process's output the daemon before this one
    read: its ring again if that daemon stopped cleanly and saved it
    (save_ring), else counted as dropped when it stopped cleanly and
    journaled how much it read (an older daemon, or the file lost), else
    marked as an uncounted loss before `now`. The count is taken off the
    record, which readopt journals again at once, and the file removed: a
    later crash must not reuse either."""
    seen = proc.rec.pop("output_seen", None)
    seen_at = proc.rec.pop("output_seen_at", None)
    last = proc.rec.pop("output_seen_last", None)       # None: a daemon older than the count
    saved = _saved_ring(output_dir, sb_id, proc) if output_dir is not None else None
    if seen is None:
        proc.ring.lost_before = now
        return
    if saved is not None:
        try:
            proc.ring.restore(saved)
            if proc.ring.written == int(seen):
                return
            # A daemon that does not save rings ran between (a downgrade and
            # back) and read on: the file is older than the record.
            why = f"it ends at byte {proc.ring.written}, the record at {seen}"
        except ValueError as err:
            why = str(err)
        log.warning("sandbox %s: the saved output of background process %d is not its own (%s); "
                    "what the daemon before read of it is reported dropped", sb_id, proc.pid, why)
    proc.ring.skip_to(int(seen), seen_at, None if last is None else int(last))


def _saved_ring(output_dir: Path, sb_id: str, proc: BgProc) -> dict | None:
    """The ring save_ring saved for this process (the file removed), None if none."""
    path = _ring_path(output_dir, sb_id, proc)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("sandbox %s: cannot read the saved output of background process %d in %s: %s",
                    sb_id, proc.pid, path, err)
        return None
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    try:
        saved = msgpack.unpackb(data, raw=False)
    except ValueError as err:        # msgpack raises ValueErrors for a damaged or cut file
        log.warning("sandbox %s: the saved output of background process %d in %s is damaged (%s); "
                    "what the daemon before read of it is reported dropped", sb_id, proc.pid, path, err)
        return None
    return saved if isinstance(saved, dict) else {}


def _open_pipes(want_stdin: bool) -> tuple[dict[str, int], tuple[int, int, int]]:
    """({name: the daemon's end}, the process's (stdin, stdout, stderr));
    without stdin, the process's is /dev/null and the daemon has none."""
    made: list[int] = []
    try:
        if want_stdin:
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            made += [in_r, in_w]
        else:
            in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1
            made.append(in_r)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        made += [out_r, out_w]
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        made += [err_r, err_w]
    except BaseException:
        _close_all(made)
        raise
    for fd in (out_r, err_r):
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:         # past fs.pipe-max-size for this user: the default 64 KiB
            pass
    return {"stdin": in_w, "stdout": out_r, "stderr": err_r}, (in_r, out_w, err_w)


def _set_once(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _close_all(fds) -> None:
    for fd in fds:
        close_quietly(fd)


def _host_identity(pidfd: int) -> tuple[int | None, int | None]:
    """(host pid, start time) of a pidfd's process, to find it again after a restart."""
    if pidfd < 0:
        return None, None
    try:
        with open(f"/proc/self/fdinfo/{pidfd}") as f:
            pid = next(int(line.split()[1]) for line in f if line.startswith("Pid:"))
    except (OSError, StopIteration, ValueError):
        return None, None
    if pid <= 0:
        return None, None
    return pid, proc_start_time(pid)


def _pidfd_if_same(pid: int | None, start: int | None) -> int:
    """A pidfd of `pid` if it is still the process that started at `start`; else -1."""
    if not pid or start is None:
        return -1
    try:
        fd = native.pidfd_open(pid)
    except OSError:
        return -1
    if proc_start_time(pid) != start:
        os.close(fd)
        return -1
    return fd


def _pipes_of(pid: int) -> dict[int, int]:
    """Inode -> fd number of the pipes process `pid` holds."""
    out = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("pipe:["):
            out[int(target[6:-1])] = int(name)
    return out
