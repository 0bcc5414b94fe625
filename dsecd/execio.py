"""A running process's output, cap, timeout and end, seen from the daemon.

Two ways, one cap. `Collector` gathers the whole output with loop callbacks
alone (a reader per pipe, a timer, a done callback on the exit): no task per
stream, so it is what most execs (no stdin, no streaming) and every FnCall
use. `ExecIO` runs a coroutine per stream, for execs that stream their output
(each chunk awaits the client's socket: backpressure) or take stdin.

Both are told how the process ends and is killed by a watch: `ChildWatch`
for a process the daemon's helper started (our child, CLONE_PARENT: its exit
seen on a pidfd registered with the event loop, its status collected with
waitpid), dsecd/initlink.py `InitExec` for one the sandbox's init forked (its
exit reported by init). Either gives `exited` ({"status": wait status}),
`kill()` (the process group), `signal(signum)` (any signal to the process
group, False once it ended), `abandon()` (the request is gone: kill it,
and for our child reap it in a thread; returns a future done once it is
gone, or None if it was already), `stop()` and `kill_grace` (how long its
end may take after a kill; None: however long).

ExecIO reads output from non-blocking pipes by one coroutine per stream; each
chunk is handed to `emit`, which may await (the client's socket drains), so a
slow client slows the reader and the pipe fills and the process blocks:
memory stays bounded.

Output cap: stdout and stderr together may deliver `cap` bytes. Past it both
read ends are closed, so the process sees EPIPE/SIGPIPE on its next write
(like `yes | head`) and the result says `truncated`.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import math
import os
import signal
import struct
import sys
import termios
import time
from collections.abc import Awaitable, Callable

from . import native
from .doing import job_of, run_job
from .errors import BadRequest
from .fds import close_quietly, read_ready

Emit = Callable[[int, bytes], Awaitable[None]]
READ_CHUNK = 64 * 1024
# A pty exec's window size when the request gives none, and the bound of
# each side (struct winsize holds unsigned shorts); both backends use them.
DEFAULT_WINDOW = (24, 80)
MAX_WINDOW_SIDE = 65535
# Output a pty may hold for its master beyond what FIONREAD counts (its
# flip buffers), with room: PtyIO._held.
PTY_UNSEEN_BYTES = 64 * 1024


class ExecIO:
    has_tty = False              # exec_resize asks: only PtyIO has a window size

    def __init__(self, loop: asyncio.AbstractEventLoop, cap: int, emit: Emit, want_stdin: bool):
        self.loop = loop
        self.cap = cap
        self.emit = emit
        self.delivered = 0
        self.truncated = False
        self.timed_out = False
        self.cancelled = False
        self.watch = None            # the process's watch, once run() has it (exec_signal)
        # Set when run() was cancelled: the watch's abandon(), done once the
        # process is gone (our child reaped in a thread, or init's report of
        # its end); what it used (a call's uid) must not be handed on before.
        self.reaped: asyncio.Future | None = None
        self._stdin_q: asyncio.Queue[bytes | None] | None = asyncio.Queue(maxsize=64) if want_stdin else None
        self.stdin_r = self.stdin_w = self.out_r = self.out_w = self.err_r = self.err_w = -1
        # Time the pumps spent handing on output written before the exit
        # (emit waiting for a slow client): not counted in the drain grace
        # (_drain). Bytes read from each stream, and how many of them were
        # written before the exit (set as the drain begins: what had been
        # read and what the pipe held then).
        self._read = {1: 0, 2: 0}
        self._owed = {1: math.inf, 2: math.inf}
        self._emitting = 0
        self._emit_began = 0.0
        self._emit_time = 0.0
        try:
            self._open_ends(want_stdin)
        except BaseException:
            self.close()
            raise

    def signal(self, signum: int) -> bool:
        """Send signum to the process group (exec_signal); False when there
        is none to send it to: not started yet, or ended."""
        return self.watch is not None and self.watch.signal(signum)

    def _open_ends(self, want_stdin: bool) -> None:
        """The pipes: child ends are handed to the start, parent ends stay here."""
        self.stdin_r, self.stdin_w = os.pipe2(os.O_CLOEXEC) if want_stdin else (os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1)
        self.out_r, self.out_w = os.pipe2(os.O_CLOEXEC)
        self.err_r, self.err_w = os.pipe2(os.O_CLOEXEC)
        for fd in (self.out_r, self.err_r) + ((self.stdin_w,) if want_stdin else ()):
            os.set_blocking(fd, False)

    def child_fds(self) -> tuple[int, int, int]:
        return self.stdin_r, self.out_w, self.err_w

    def close_child_ends(self) -> None:
        for name in ("stdin_r", "out_w", "err_w"):
            close_quietly(getattr(self, name))
            setattr(self, name, -1)

    def take_child_ends(self) -> list[int]:
        """Hand the child ends over (a spawn still in flight uses them): close() leaves them alone."""
        ends = [fd for fd in (self.stdin_r, self.out_w, self.err_w) if fd >= 0]
        self.stdin_r = self.out_w = self.err_w = -1
        return ends

    @property
    def takes_stdin(self) -> bool:
        return self._stdin_q is not None

    async def feed_stdin(self, data: bytes, eof: bool) -> None:
        """Queue input for the process; blocks (bounded queue) while it is not reading."""
        if self._stdin_q is None:
            raise RuntimeError("this exec was started without stdin")
        if data:
            await self._stdin_q.put(bytes(data))
        if eof:
            await self._stdin_q.put(None)

    async def run(self, watch, timeout: float | None, drain_grace: float,
                  paused_for: Callable[[], float] | None = None) -> dict:
        """Wait for the process (`watch`: ChildWatch or InitExec) and its
        output; kill its process group on timeout (paused_for: as
        RunTimer's). Raises what its `exited` raises (an exec init could not
        start: its NativeError), and TimeoutError when the end does not come
        watch.kill_grace after a kill."""
        started = time.monotonic()
        self.watch = watch
        exited = watch.exited
        pumps = [asyncio.ensure_future(self._pump(fd, stream))
                 for fd, stream in ((self.out_r, 1), (self.err_r, 2)) if fd >= 0]
        feeder = asyncio.ensure_future(self._feed()) if self._stdin_q is not None else None
        status = None
        try:
            try:
                await _wait_run(exited, timeout if timeout is None else RunTimer(timeout, paused_for))
            except TimeoutError:
                self.timed_out = True
                watch.kill()
                try:
                    await asyncio.wait_for(asyncio.shield(exited), watch.kill_grace)
                except TimeoutError:
                    raise TimeoutError(errno.ETIMEDOUT, "the run did not end after a kill") from None
            status = exited.result()["status"]
            await self._drain(pumps, drain_grace)
        finally:
            watch.stop()
            for task in pumps + ([feeder] if feeder else []):
                task.cancel()
            await asyncio.gather(*pumps, *([feeder] if feeder else []), return_exceptions=True)
            if status is None and not exited.done():
                # Cancelled (client gone, `cancel`, daemon stopping).
                self.reaped = watch.abandon()
            self.close()
        code, sig, self.timed_out = ended(status, self.timed_out)
        return {"exit_code": code, "signal": sig, "timed_out": self.timed_out,
                "truncated": self.truncated, "cancelled": self.cancelled,
                "duration_ms": round((time.monotonic() - started) * 1000, 3)}

    async def _drain(self, pumps: list[asyncio.Task], grace: float) -> None:
        """After the exit: read the pipes to their end. Background children
        may hold them open, so reading stops once `grace` s went by, not
        counting the time output written before the exit waited to be handed
        on (emit blocked by a slow client's backpressure): that output, still
        in the pipes, reaches the client however slow its link. What comes
        after the exit (a background child writing on) is read for the grace
        only, its wait for the client counted: else a child that writes
        without end to a client slower than it would keep the exec from
        ending."""
        for fd, stream in ((self.out_r, 1), (self.err_r, 2)):
            if fd >= 0:
                self._owed[stream] = self._read[stream] + self._held(fd)
        left = grace
        while left > 0:
            began, emitted = time.monotonic(), self._emitted_for()
            _done, pending = await asyncio.wait(pumps, timeout=left)
            if not pending:
                return
            left -= (time.monotonic() - began) - (self._emitted_for() - emitted)

    def _held(self, fd: int) -> int:
        """How many bytes read end `fd` holds, not read yet."""
        try:
            return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
        except OSError:
            return 0

    def _emitted_for(self) -> float:
        """Seconds the pumps have spent in emit, of output written before
        the exit, so far (at least one of them)."""
        now = self._emit_time
        if self._emitting:
            now += time.monotonic() - self._emit_began
        return now

    async def _emit(self, stream: int, data: bytes) -> None:
        owed = self._read[stream] < self._owed[stream]      # written before the exit
        self._read[stream] += len(data)
        if not owed:
            await self.emit(stream, data)
            return
        if not self._emitting:
            self._emit_began = time.monotonic()
        self._emitting += 1
        try:
            await self.emit(stream, data)
        finally:
            self._emitting -= 1
            if not self._emitting:
                self._emit_time += time.monotonic() - self._emit_began

    async def _readable(self, fd: int) -> None:
        fut = self.loop.create_future()
        self.loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self.loop.remove_reader(fd)

    async def _pump(self, fd: int, stream: int) -> None:
        while True:
            data = read_ready(fd, READ_CHUNK)
            if data is None:
                await self._readable(fd)
                continue
            if not data:
                return
            room = self.cap - self.delivered
            if len(data) > room:
                data = data[:room]
                self.truncated = True
            if data:
                self.delivered += len(data)
                await self._emit(stream, data)
            if self.truncated:
                # Close both read ends: the writer gets EPIPE instead of filling the host.
                self._close_reads()
                return

    def _close_reads(self) -> None:
        for name in ("out_r", "err_r"):
            fd = getattr(self, name)
            if fd >= 0:
                self.loop.remove_reader(fd)
                close_quietly(fd)
                setattr(self, name, -1)

    async def _feed(self) -> None:
        assert self._stdin_q is not None
        try:
            while (chunk := await self._stdin_q.get()) is not None:
                view = memoryview(chunk)
                while view:
                    try:
                        n = os.write(self.stdin_w, view)
                        view = view[n:]
                    except BlockingIOError:
                        fut = self.loop.create_future()
                        self.loop.add_writer(self.stdin_w, lambda f=fut: f.done() or f.set_result(None))
                        try:
                            await fut
                        finally:
                            self.loop.remove_writer(self.stdin_w)
        except (BrokenPipeError, OSError):
            pass   # the process closed its stdin or exited: drop the rest
        finally:
            close_quietly(self.stdin_w)
            self.stdin_w = -1

    def close(self) -> None:
        self._close_reads()
        for name in ("stdin_r", "stdin_w", "out_w", "err_w"):
            close_quietly(getattr(self, name))
            setattr(self, name, -1)


class PtyIO(ExecIO):
    """ExecIO over a pseudo-terminal: the slave is the process's stdin,
    stdout and stderr (and, by the start's ctty flag, its controlling
    terminal); the daemon keeps the master. What the process writes comes
    back as one stream (1), echo and line editing included; exec_input data
    is typed into the master, so ^C (0x03) reaches the foreground process
    group as SIGINT through the line discipline.

    The master is read through `out_r` and written through `stdin_w`, a
    second fd of the same open file, so ExecIO's pump, feeder and close work
    unchanged. Its read fails with EIO once no process holds the slave any
    more: that is the end of the output. An `eof` from the client only stops
    the input (the terminal stays; a program that wants an end of input is
    sent ^D as data).

    No output cap: a terminal session streams with backpressure (each chunk
    awaits the client's socket), so the daemon's memory stays bounded, and
    a cap would hang up a long interactive session."""

    has_tty = True

    def __init__(self, loop: asyncio.AbstractEventLoop, emit: Emit, rows: int, cols: int, pty: tuple[int, int]):
        """pty: (master, slave) of a new pty from the devpts instance the
        terminal is to come from (the sandbox's own: ContainerBackend.open_pty);
        this owns both from here on, failure included."""
        self.window = (rows, cols)
        self.pty = pty
        super().__init__(loop, sys.maxsize, emit, True)

    def _open_ends(self, want_stdin: bool) -> None:
        (self.out_r, self.stdin_r), self.pty = self.pty, (-1, -1)
        set_window_size(self.out_r, *self.window)
        self.stdin_w = os.dup(self.out_r)                 # close-on-exec, as os.dup makes it
        os.set_blocking(self.out_r, False)       # one open file: stdin_w is non-blocking too

    def child_fds(self) -> tuple[int, int, int]:
        return self.stdin_r, self.stdin_r, self.stdin_r

    def _held(self, fd: int) -> int:
        """FIONREAD on the master counts only its line discipline's buffer
        (4 KiB); what the process wrote before its exit may wait before it in
        the pty's flip buffers too (up to 16 KiB more, measured on Linux
        6.18), which nothing counts: PTY_UNSEEN_BYTES is counted for them."""
        return super()._held(fd) + PTY_UNSEEN_BYTES

    def resize(self, rows: int, cols: int) -> None:
        """TIOCSWINSZ on the master; the kernel sends SIGWINCH to the
        terminal's foreground process group when the size changed."""
        if self.out_r < 0:
            raise OSError(errno.EBADF, "the terminal is closed: the exec has ended")
        set_window_size(self.out_r, rows, cols)


def open_pty_peer(master: int) -> int:
    """The slave of a new pty master: unlocked, then opened from the master
    itself (TIOCGPTPEER), with no path lookup, so it is the master's own peer
    whatever the devpts instance's mount shows. O_NOCTTY: it never becomes
    the daemon's controlling terminal; close-on-exec."""
    fcntl.ioctl(master, native.TIOCSPTLCK, struct.pack("i", 0))
    return fcntl.ioctl(master, native.TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)


def set_window_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def kill_group(pid: int) -> None:
    """SIGKILL an exec's process group (the exec made itself a session leader)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def parse_signal(value: int | str) -> int:
    """A signal number from 9, "9", "KILL", "SIGKILL" (any case); BadRequest otherwise."""
    text = str(value).strip()
    if text.isdigit() and int(text) == 0:
        raise BadRequest("signal 0 sends nothing: `dsec proc ls` (proc_list) says whether the process runs",
                         {"signal": value})
    try:
        if text.isdigit():
            return signal.Signals(int(text)).value
        name = text.upper()
        return signal.Signals[name if name.startswith("SIG") else "SIG" + name].value
    except (KeyError, ValueError):
        raise BadRequest(f"unknown signal {value!r}: give a number (9) or a name (KILL, TERM, INT, HUP, ...)",
                         {"signal": value}) from None


# Our children a ChildWatch waits for (and reaps): reap_strays leaves them alone.
WATCHED: set[int] = set()


def reap_strays(pidns: int) -> int:
    """Reap our exited children in the pid namespace of inode `pidns` (a
    sandbox's being destroyed) that no ChildWatch waits for. A process the
    daemon's helper started is our child (CLONE_PARENT), and so is what it
    starts with clone(CLONE_PARENT): nobody else waits for those, and the
    sandbox's init cannot finish exiting while one is left unreaped. How
    many were reaped."""
    return _reap_in({pidns: True})


def _reap_in(namespaces: dict[int, bool]) -> int:
    """reap_strays for several pid namespaces in one look at our children:
    {pid namespace inode: leaders}. An exec being started is our child
    before its watch is made: where `leaders` is False, session leaders (as
    every exec of the helper is) are left alone."""
    reaped = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            continue            # a thread that ended meanwhile
        for pid in pids:
            if pid in WATCHED:
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:        # the wait is on the pidfd: only the process it was opened on is reaped
                leaders = namespaces.get(os.stat(f"/proc/{pid}/ns/pid").st_ino)
                if leaders is None or not (leaders or os.getsid(pid) != pid):
                    continue
                if _is_ns_init(pid):
                    continue        # the sandbox's init: its end is waited for, its status read, elsewhere
                if os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG) is not None:
                    reaped += 1
            except OSError:
                continue
            finally:
                os.close(pidfd)
    return reaped


PF_EXITING = 0x4           # /proc/PID/stat flags: the process is exiting


def reap_strays_of_helped(init_pids: list[int]) -> None:
    """Once a second, for the sandboxes whose execs went through the
    daemon's helper (their inits' pids): reap what those execs cloned onto
    the daemon and has ended, in one look at our children. Session leaders
    too where the init is exiting: it finishes exiting, and so can be seen
    to have died, only once every process of its pid namespace is reaped,
    and no exec can start there any more. (Done after every helper exec,
    the look took 2.7 ms of CPU an exec.)"""
    namespaces = {}
    for pid in init_pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                flags = int(f.read().rpartition(")")[2].split()[6])
            namespaces[os.stat(f"/proc/{pid}/ns/pid").st_ino] = bool(flags & PF_EXITING)
        except (OSError, ValueError, IndexError):
            continue
    if namespaces:
        _reap_in(namespaces)


def _is_ns_init(pid: int) -> bool:
    """Whether `pid` is pid 1 of its own pid namespace (NSpid's last id)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return line.split()[-1] == "1"
    return False


def reap(pid: int) -> int:
    try:
        _, status = os.waitpid(pid, 0)
        return status
    except ChildProcessError:
        return 0


def kill_and_reap(loop: asyncio.AbstractEventLoop, pid: int) -> asyncio.Future:
    """SIGKILL an abandoned exec's process group and reap it in a thread (a
    dying process may take a moment); the future is done once it is reaped."""
    kill_group(pid)
    return loop.run_in_executor(None, run_job, job_of(reap, (pid,)))


def _decode_status(status: int) -> tuple[int | None, int | None]:
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.WEXITSTATUS(status), None


def ended(status: int, timed_out: bool) -> tuple[int | None, int | None, bool]:
    """(exit code, signal, timed out) of a run that ended with wait status
    `status` after its timeout's kill was sent (`timed_out`) or not. An
    exit of its own that came before the kill took is no timeout: the run
    went to its end."""
    code, sig = _decode_status(status)
    return code, sig, timed_out and sig is not None


def how_child_ended(pidfd: int) -> dict:
    """How an exited child of this process ended, read without reaping it
    (WNOWAIT: whoever reaps it still can): {"signal": "SIGKILL"} or
    {"exit_code": n}; {} when it has not exited, or is not our child (one
    adopted after a restart) or was reaped already."""
    try:
        st = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except OSError:
        return {}
    if st is None:
        return {}
    if st.si_code == os.CLD_EXITED:
        return {"exit_code": st.si_status}
    try:
        return {"signal": signal.Signals(st.si_status).name}
    except ValueError:
        return {"signal": str(st.si_status)}


# How often a run whose sandbox was paused past its timeout looks again
# whether it has run that long (RunTimer.until_next_look).
PAUSED_LOOK_S = 0.25


async def _wait_run(exited: asyncio.Future, timer: RunTimer | None) -> None:
    """Wait for `exited` (not cancelling it) until `timer` runs out: TimeoutError."""
    if timer is None:
        await asyncio.shield(exited)
        return
    while True:
        try:
            await asyncio.wait_for(asyncio.shield(exited), timer.until_next_look())
            return
        except TimeoutError:
            if timer.expired():
                raise


class RunTimer:
    """How long a run has left before its timeout: the timeout counts the
    time its sandbox runs, not the time it spends paused. A frozen command
    makes no progress, and a pause (a trainer's GPUs preempted) must not
    turn into a kill of the commands it froze. `paused_for()`: the
    sandbox's paused time so far, a pause in progress included
    (Sandbox.paused_for); None for runs that are never paused (calls)."""

    def __init__(self, timeout: float, paused_for: Callable[[], float] | None = None):
        self.timeout = timeout
        self._paused_for = paused_for or (lambda: 0.0)
        self._started = time.monotonic()
        self._paused_at_start = self._paused_for()
        self._paused_meanwhile = False

    def left(self) -> float:
        ran = time.monotonic() - self._started - (self._paused_for() - self._paused_at_start)
        return self.timeout - ran

    def expired(self) -> bool:
        """Whether the run has used its timeout; when not, the sandbox was
        paused meanwhile, and later looks come at most every PAUSED_LOOK_S."""
        if self.left() > 0:
            self._paused_meanwhile = True
            return False
        return True

    def until_next_look(self) -> float:
        """How long to wait before asking `expired` (again). While the
        sandbox is paused what is left stands still, however little: a
        floor keeps a pause begun just before the timeout from waking the
        loop without end."""
        left = self.left()
        return max(left, PAUSED_LOOK_S) if self._paused_meanwhile else max(left, 0.0)


class Collector:
    """One run's capped output, timeout, kill and end, driven by loop callbacks.

    The process writes to `child_ends` (stdout, stderr pipes). `start` is
    given a future that resolves to the exit message ({"status": wait
    status, ...}; the zygote's also carries "run_ms"), a kill function and a
    timeout. `done` resolves to the result dict once the exit is known and
    both pipes reached EOF (or `drain_grace` after the exit, when a
    background child still holds them). It fails with the exit future's
    error (a dead zygote, OSError) and with TimeoutError when the end does
    not come `kill_grace` after a kill."""

    takes_stdin = False          # exec_input asks; streams and stdin take ExecIO
    has_tty = False              # exec_resize asks; pty execs take PtyIO
    cancelled = False            # set by a `cancel` of its request (server.py)

    def __init__(self, loop: asyncio.AbstractEventLoop, cap: int, drain_grace: float, kill_grace: float | None,
                 path: str | None = None):
        self.loop = loop
        self.cap = cap
        self.drain_grace = drain_grace
        self.kill_grace = kill_grace            # None: wait for the end after a kill, however long
        self.path = path                        # "zygote": named in the result
        self.delivered = 0
        self.truncated = self.timed_out = False
        self.out: dict[int, list[bytes]] = {1: [], 2: []}
        self.reads: dict[int, int] = {}         # read end -> stream
        self.child_ends: list[int] = []
        try:
            for stream in (1, 2):
                r, w = os.pipe2(os.O_CLOEXEC)
                self.reads[r] = stream
                self.child_ends.append(w)
                os.set_blocking(r, False)
        except BaseException:
            self.close()
            raise
        self.exit: dict | None = None
        self.done: asyncio.Future = loop.create_future()
        self.started = 0.0                      # set by start()
        self._timers: list[asyncio.TimerHandle] = []
        self._timer: RunTimer | None = None
        self._deadline: asyncio.TimerHandle | None = None     # the timeout's (replaced while paused)
        self._watching = False
        self._kill: Callable[[], None] | None = None
        self._exited: asyncio.Future | None = None
        # The process's watch, set by an exec that has one (not a call):
        # what exec_signal reaches.
        self.watch = None

    def close_child_ends(self) -> None:
        for fd in self.child_ends:
            os.close(fd)
        self.child_ends = []

    def take_child_ends(self) -> list[int]:
        """Hand the child ends over (a spawn still in flight uses them): close() leaves them alone."""
        ends, self.child_ends = self.child_ends, []
        return ends

    def signal(self, signum: int) -> bool:
        """Send signum to the process group (exec_signal); False when there
        is none to send it to: not started yet, ended, or a call's worker."""
        return self.watch is not None and self.watch.signal(signum)

    def start(self, exited: asyncio.Future, kill: Callable[[], None], timeout: float | None,
              paused_for: Callable[[], float] | None = None) -> None:
        """Watch the pipes, the exit and the clock (timeout None: no limit;
        paused_for: as RunTimer's)."""
        self.started = time.monotonic()
        self._kill = kill
        self._exited = exited
        self._watching = True
        for fd, stream in self.reads.items():
            self.loop.add_reader(fd, self._on_readable, fd, stream)
        exited.add_done_callback(self._on_exited)
        if timeout is not None:
            self._timer = RunTimer(timeout, paused_for)
            self._deadline = self.loop.call_later(timeout, self._on_timeout)

    def _on_readable(self, fd: int, stream: int) -> None:
        data = read_ready(fd, READ_CHUNK)
        if data is None:
            return
        if not data:
            self._close_read(fd)
            self._check()
            return
        room = self.cap - self.delivered
        if len(data) > room:
            self.truncated = True
            data = data[:room]
        self.delivered += len(data)
        self.out[stream].append(data)
        if self.truncated:
            # Past the cap both read ends go: the writer gets EPIPE, the host keeps its memory.
            self.close_reads()
            self._check()

    def _on_exited(self, fut: asyncio.Future) -> None:
        if self.done.done() or fut.cancelled():
            return
        err = fut.exception()
        if err is not None:
            self.done.set_exception(err)
            return
        self.exit = fut.result()
        if self.reads:
            self._timers.append(self.loop.call_later(self.drain_grace, self._drained))
        self._check()

    def _drained(self) -> None:
        self.close_reads()
        self._check()

    def _on_timeout(self) -> None:
        # The exit future, not self.exit: it is set (and the pid reaped) one
        # loop turn before _on_exited runs.
        if self._exited.done() or self.done.done():
            return
        if not self._timer.expired():           # the sandbox was paused meanwhile
            self._deadline = self.loop.call_later(self._timer.until_next_look(), self._on_timeout)
            return
        self.timed_out = True
        self._kill()
        if self.kill_grace is not None:
            self._timers.append(self.loop.call_later(self.kill_grace, self._kill_ignored))

    def _kill_ignored(self) -> None:
        if self.exit is None and not self.done.done():
            self.done.set_exception(TimeoutError(errno.ETIMEDOUT, "the run did not end after a kill"))

    def _check(self) -> None:
        if self.exit is None or self.reads or self.done.done():
            return
        code, sig, self.timed_out = ended(self.exit["status"], self.timed_out)
        result = {"exit_code": code, "signal": sig, "timed_out": self.timed_out, "truncated": self.truncated,
                  "cancelled": False, "duration_ms": round((time.monotonic() - self.started) * 1000, 3),
                  "stdout": b"".join(self.out[1]), "stderr": b"".join(self.out[2])}
        if self.path is not None:        # the zygote's: where the call ran, its own run time
            result["path"] = self.path
            result["run_ms"] = round(self.exit.get("run_ms", 0.0), 3)
        self.done.set_result(result)

    def _close_read(self, fd: int) -> None:
        if self.reads.pop(fd, None) is not None:
            if self._watching:
                self.loop.remove_reader(fd)
            os.close(fd)

    def close_reads(self) -> None:
        for fd in list(self.reads):
            self._close_read(fd)

    def close(self) -> None:
        """Everything goes, whatever state the run is in (idempotent)."""
        for t in self._timers:
            t.cancel()
        self._timers = []
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.close_reads()
        self.close_child_ends()


class ChildWatch:
    """How our child `pid` (started by the daemon's helper) ends and is
    killed; see the module docstring for what a watch gives."""

    kill_grace = None         # our child is reaped here: its end always comes

    def __init__(self, loop: asyncio.AbstractEventLoop, pid: int):
        self.loop = loop
        self.pid = pid
        WATCHED.add(pid)
        self.exited, self._stop = watch_exit(loop, pid)
        self.exited.add_done_callback(lambda _: WATCHED.discard(pid))
        self.stopped = False     # no longer watched: reaped elsewhere (abandon) or by the watch

    def stop(self) -> None:
        self.stopped = True
        self._stop()
        WATCHED.discard(self.pid)

    def kill(self) -> None:
        kill_group(self.pid)

    def signal(self, signum: int) -> bool:
        """signum to its process group; False once it may have been reaped
        (its pid may be another's by then) or no member is left. Until then
        it is our unreaped child, so the pid is still its own."""
        if self.exited.done() or self.stopped:
            return False
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def abandon(self) -> asyncio.Future | None:
        """Kill it and reap it in a thread, since a dying process may take a
        moment to exit; the future is done once it is reaped. None if the
        watch reaped it already (its pid may be another's by then)."""
        self.stop()           # from here the thread reaps it, never the loop
        if self.exited.done():
            return None
        return kill_and_reap(self.loop, self.pid)


def watch_exit(loop: asyncio.AbstractEventLoop, pid: int) -> tuple[asyncio.Future, Callable[[], None]]:
    """A future of our child `pid`'s exit ({"status": wait status}), seen on a
    pidfd and reaped at once; and what stops watching (the pidfd's close)."""
    pidfd = os.pidfd_open(pid)
    exited = loop.create_future()

    def on_exit() -> None:
        # Off at the first wake-up: a pidfd stays readable once its process exited.
        stop()
        if not exited.done():
            exited.set_result({"status": reap(pid)})

    def stop() -> None:
        nonlocal pidfd
        if pidfd >= 0:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            pidfd = -1

    loop.add_reader(pidfd, on_exit)
    return exited, stop
