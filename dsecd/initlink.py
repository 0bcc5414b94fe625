"""The exec channel to a sandbox's dsec-init, which forks the execs itself.

Why: an exec forked by the sandbox's PID 1 inherits its namespaces, cgroups,
CPU QoS and the seccomp filter compiled once for init. The daemon's exec
helper (csrc/spawn.c) sets each of these up again per exec: setns, a
cgroup.procs write per hierarchy, a JIT compile of the filter, a copy of the
daemon's fd table (docs/burst.md, "Execs by init").

One SOCK_SEQPACKET socketpair per sandbox, made at create; init's end is its
fd 4 (csrc/init.c; the message layouts are in csrc/dsec_native.h). This side
lives on the event loop: `spawn` sends one request, stdio passed with
SCM_RIGHTS, and returns an `InitExec` whose `exited` future resolves to
{"status": wait status} once init reaped the exec, or fails with the
NativeError of a step before execve. Its `kill` works from the moment it is
sent: before init said it started, by asking init (OP_KILL) and again through
the pidfd when init's STARTED comes; after, through that pidfd, on the exec's
whole process group.

What init says is believed about its own sandbox only: the one fd it may send
must be a pidfd, and is only used to kill that exec's group, which the kernel
confines to init's pid namespace. An answer that breaks the protocol closes
the channel; later execs of that sandbox go through the daemon's helper.

Init also keeps the daemon's end (its fd 5, never used by init), so a
restarted daemon takes the channel back with pidfd_getfd (`take_back`).
Answers for execs of the daemon before (ids this one never used: each link
starts at a random id) are dropped, except for the background processes the
daemon before journaled, which the new one registers again (`adopt`).

A background process (`spawn` with `hold`) is a detached exec: init also
holds the daemon's ends of its pipes until `release`, and a daemon that stops
leaves it running (close(None) at shutdown does not kill it).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import signal
import socket
import stat
import struct
import threading

from . import fds as fdtable
from . import native

log = logging.getLogger(__name__)

# struct dsec_init_req: magic, id, uid, gid, cap_keep, argc, envc, strings_len, op
_REQ = struct.Struct("=IIIIQIIII")
# struct dsec_init_reply up to its err: magic, kind, id, pid, status, reserved; then err.err
_REPLY_HEAD = struct.Struct("=IIIiii")
_ERRNO = struct.Struct("=i")
assert _REQ.size == native.INIT_REQ_SIZE and _REPLY_HEAD.size == native.INIT_REPLY_ERR_OFFSET

KILLED = signal.SIGKILL        # wait status of a process killed by SIGKILL
# Send errors that mean init's end is gone (it exited): its execs died with it.
_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)


# How long an exec sent to init may take to end after its kill. Init reaps it
# and reports; a sandbox that stopped its own init (csrc/init.c start) would
# otherwise keep the request waiting for good.
KILL_GRACE_S = 10.0


class InitExec:
    """One exec sent to init: a watch as dsecd/execio.py describes
    (`exited` a loop future, kill, abandon, stop, kill_grace)."""

    kill_grace = KILL_GRACE_S

    __slots__ = ("link", "id", "request", "exited", "over", "running", "pid", "detached", "_fd", "_kill_sent",
                 "_started_fut")

    def __init__(self, link: InitLink, exec_id: int, request: tuple):
        self.link = link
        self.id = exec_id
        self.request = request         # (argv0, env, uid, cwd): what an error names
        self.exited: asyncio.Future = link.loop.create_future()
        # Done once init reported its end (or a failed start, or the channel
        # closed), even after an abandon: what must wait for the process to be
        # gone (a call's uid) waits for this.
        self.over: asyncio.Future = link.loop.create_future()
        self.running = False           # init answered STARTED
        self.pid = 0                   # its pid in the sandbox's pid namespace, once STARTED
        # A background process: it outlives the daemon (close(None) at
        # shutdown leaves it running; init holds its pipes).
        self.detached = False
        self._fd = -1                  # its pidfd, while it may still run
        self._kill_sent = False
        self._started_fut: asyncio.Future | None = None

    def started(self) -> asyncio.Future:
        """A future of its pid in the sandbox once init started it; it fails
        as `exited` does when it could not start."""
        if self._started_fut is None:
            self._started_fut = self.link.loop.create_future()
            if self.running:
                self._started_fut.set_result(self.pid)
        return self._started_fut

    @property
    def pidfd(self) -> int:
        """Its pidfd while it may still run, else -1 (the link owns it)."""
        return self._fd

    def signal(self, signum: int) -> bool:
        """Send signum to its process group; False if it has ended (or has no pidfd yet)."""
        if self._fd < 0:
            return False
        try:
            native.pidfd_kill_group(self._fd, signum)
        except OSError:       # no member left (ESRCH)
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the exec's process group (it leads its own session)."""
        if self._fd >= 0:
            self.signal(signal.SIGKILL)
        elif not self.running and not self._kill_sent:
            self._kill_sent = True          # STARTED will kill it through the pidfd too
            self.link.send_kill(self.id)

    def abandon(self) -> asyncio.Future:
        """Its request is gone (cancelled): kill it; nobody waits for its
        status any more. Init reaps it; `over` (returned) is done once init
        says so."""
        self.kill()
        self.exited.cancel()
        return self.over

    def stop(self) -> None:
        """Nothing to stop: the link reads init's answers for every exec."""

    def _started(self, pidfd: int, pid: int = 0) -> None:
        self.running = True
        self._fd = pidfd
        self.pid = pid
        if self._started_fut is not None and not self._started_fut.done():
            self._started_fut.set_result(pid)
        if self._kill_sent or self.exited.cancelled():    # killed or abandoned before it started
            self.kill()

    def _failed(self, err: Exception) -> None:
        if not self.exited.done():          # else abandoned: nobody waits
            self.exited.set_exception(err)
        if self._started_fut is not None and not self._started_fut.done():
            self._started_fut.set_exception(err)
        self._over()

    def _ended(self, status: int, *, reported: bool = True) -> None:
        """reported: init's EXITED said so (else the channel closed as the
        sandbox went, and the kernel kills what ran in it)."""
        self._close()            # it ended: the pidfd is of no more use
        if not self.exited.done():
            self.exited.set_result({"status": status, "reported": reported})
        self._over()

    def _over(self) -> None:
        if not self.over.done():
            self.over.set_result(None)

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def start_strings(argv: list[str], env: list[str], cwd: str, uid: int, gid: int) -> bytes:
    """The strings of a start request (cwd, argv, env, each NUL-ended), as
    init takes them: at most native.INIT_MAX_STRINGS bytes fit in one.
    ValueError for strings or ids execve cannot take, as the helper's."""
    raw_argv, raw_env, raw_cwd = native.check_exec_request(argv, env, cwd, uid, gid)
    return b"\0".join((raw_cwd, *raw_argv, *raw_env)) + b"\0"


class InitLink:
    """The daemon's end of one sandbox's exec channel.

    Made in a worker thread (create), used on the event loop from the first
    exec on. `close` may be called from any thread and any number of times."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sock.setblocking(False)
        self.loop: asyncio.AbstractEventLoop | None = None     # set by attach (first spawn, or adopt)
        self.pending: dict[int, InitExec] = {}
        # Random start: answers still due to a daemon before a restart name ids of its own.
        self.next_id = secrets.randbits(32) % 0xFFFFFFFF + 1
        self.closed = False
        self._lock = threading.Lock()     # attaching to the loop vs a close from a worker thread

    # ------------------------------------------------------------ requests

    def spawn(self, loop: asyncio.AbstractEventLoop, argv: list[str], env: list[str], cwd: str, uid: int,
              cap_keep: int, stdio: tuple[int, int, int], ctty: bool = False,
              hold: tuple[int, int, int] | None = None, gid: int | None = None,
              policy: bytes | None = None, groups: tuple[int, ...] = (), own_ipc: bool = False) -> InitExec | None:
        """Ask init to start argv; None if this channel cannot take it (closed,
        too big for one packet, init not reading): use the daemon's helper.
        The stdio fds are in the kernel's hands once this returns: the caller
        may close its copies. ctty: stdin is a pty slave the exec takes as its
        controlling terminal. hold: the daemon's ends of the stdio pipes, which
        init holds until `release` (a background process: detached). ValueError
        for strings or ids execve cannot take. gid: None is the uid's number.
        policy: a task policy's plan (dsecd/policy.py), applied with Landlock
        before execve; groups: its supplementary gids; own_ipc: it unshares
        an IPC namespace of its own before its ids change (init must hold
        CAP_SYS_ADMIN over the sandbox's user namespace). An init older than
        any of these flags refuses the request: it never runs without them."""
        gid = uid if gid is None else gid
        strings = start_strings(argv, env, cwd, uid, gid)
        native.check_groups(groups)
        if len(strings) > native.INIT_MAX_STRINGS:
            return None
        if policy is not None and not 0 < len(policy) <= native.POLICY_MAX_BYTES:
            raise ValueError(f"a policy plan is 1..{native.POLICY_MAX_BYTES} bytes, got {len(policy)}")
        if not self.attach(loop):
            return None
        exec_id = self._next_id()
        op = (native.INIT_OP_START | (native.INIT_START_CTTY if ctty else 0)
              | (native.INIT_START_HOLD if hold is not None else 0)
              | (native.INIT_START_POLICY if policy is not None else 0)
              | (native.INIT_START_GROUPS if groups else 0)
              | (native.INIT_START_OWN_IPC if own_ipc else 0))
        head = _REQ.pack(native.INIT_MAGIC, exec_id, uid, gid, cap_keep, len(argv), len(env), len(strings), op)
        parts = [head, strings]
        if groups:
            parts.append(struct.pack(f"=I{len(groups)}I", len(groups), *groups))
        if policy is not None:
            parts.append(policy)
        started = self._request(exec_id, parts,
                                list(stdio) + list(hold or ()), (argv[0], env, uid, cwd))
        if started is not None:
            started.detached = hold is not None
        return started

    def adopt(self, exec_id: int, pid: int, pidfd: int, argv0: str) -> InitExec | None:
        """A background process the daemon before this one started (journaled):
        init's answers for its id are this link's again (its EXITED, maybe
        queued while no daemon ran). pidfd: -1 if it ended meanwhile (its
        EXITED is then due), else owned by the returned exec. None once closed."""
        if self.closed or self.loop is None:
            if pidfd >= 0:
                os.close(pidfd)
            return None
        run = InitExec(self, exec_id, (argv0, [], 0, "/"))
        run.running = True
        run.detached = True
        run.pid = pid
        run._fd = pidfd
        self.pending[exec_id] = run
        return run

    def release(self, exec_id: int, mask: int) -> None:
        """OP_RELEASE: init closes the ends it holds of a background process's
        pipes (mask: 1 stdin, 2 stdout, 4 stderr). Blocking only when init's
        queue is full, which a frozen init (a paused sandbox) can make: then
        it is retried from the loop until init reads it or the channel closes."""
        if not self.closed and not self._send_head(exec_id, mask, native.INIT_OP_RELEASE):
            assert self.loop is not None
            self.loop.call_later(0.1, self.release, exec_id, mask)

    def prune(self, keep: list[int]) -> None:
        """OP_PRUNE: init kills every exec (and copy) it runs whose id is not
        in `keep`, the journaled background processes this daemon adopts:
        what a daemon that died left running, whose clients went with it. An
        init older than the op refuses it with an answer for an id nobody
        awaits (dropped): its sandbox keeps such execs until they end.
        Retried from the loop while init's queue is full; what this daemon
        started on the channel meanwhile (its pending ids) is kept too."""
        if self.closed:
            return
        kept = sorted(set(keep) | set(self.pending))
        ids = struct.pack(f"={len(kept)}I", *kept)
        head = _REQ.pack(native.INIT_MAGIC, self._next_id(), 0, 0, 0, len(kept), 0, len(ids), native.INIT_OP_PRUNE)
        try:
            self.sock.send(head + ids)
        except BlockingIOError:
            assert self.loop is not None
            self.loop.call_later(0.1, self.prune, keep)
        except OSError as err:
            if err.errno in _GONE:
                self.close(None)

    def copy(self, loop: asyncio.AbstractEventLoop, src: int, dst: int) -> InitExec | None:
        """OP_COPY: init forks a child (in the sandbox's cgroups) that copies
        src to its end into dst and exits with 0 or an errno; None if this
        channel cannot take it. src and dst are in the kernel's hands once
        this returns: the caller may close its copies."""
        if not self.attach(loop):
            return None
        exec_id = self._next_id()
        head = _REQ.pack(native.INIT_MAGIC, exec_id, 0, 0, 0, 0, 0, 0, native.INIT_OP_COPY)
        return self._request(exec_id, [head], [src, dst], ("(the daemon's file copy)", [], 0, "/"))

    def _request(self, exec_id: int, parts: list[bytes], fds: list[int], what: tuple) -> InitExec | None:
        """Send one request that starts something, fds with it; its InitExec
        (`what`: argv0, env, uid, cwd, for its errors), or None if the
        channel cannot take it: init's queue is full (busy or frozen), the
        channel is gone, or anything else (ENOBUFS, ...)."""
        try:
            socket.send_fds(self.sock, parts, fds)
        except BlockingIOError:
            return None
        except OSError as err:
            if err.errno in _GONE:
                self.close(None)
            return None
        started = InitExec(self, exec_id, what)
        self.pending[exec_id] = started
        return started

    def _send_head(self, exec_id: int, arg: int, op: int) -> bool:
        """Send a header-only request (its uid field carries `arg`); False if
        init's queue is full. A gone channel is closed, and counts as sent:
        there is nothing left to retry."""
        try:
            self.sock.send(_REQ.pack(native.INIT_MAGIC, exec_id, arg, 0, 0, 0, 0, 0, op))
        except BlockingIOError:
            return False
        except OSError as err:
            if err.errno in _GONE:
                self.close(None)
        return True

    def attach(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Read init's answers on `loop` from now on (on the loop; again is a
        no-op); False once closed. A link taken back after a restart is
        attached at once: answers init sent meanwhile must not fill its
        buffer (a full one would block init's reaping)."""
        with self._lock:
            if self.closed:
                return False
            if self.loop is None:
                self.loop = loop
                loop.add_reader(self.sock.fileno(), self._on_readable)
            return True

    def _next_id(self) -> int:
        exec_id = self.next_id
        self.next_id = self.next_id % 0xFFFFFFFF + 1
        while exec_id in self.pending:         # an adopted background process holds it
            exec_id, self.next_id = self.next_id, self.next_id % 0xFFFFFFFF + 1
        return exec_id

    def send_kill(self, exec_id: int) -> None:
        """OP_KILL: init SIGKILLs an exec whose STARTED the daemon has not read.
        Not retried when init's queue is full: the STARTED that init sends
        once it gets to the request kills it through the pidfd."""
        if not self.closed and exec_id in self.pending:
            self._send_head(exec_id, 0, native.INIT_OP_KILL)

    # ------------------------------------------------------------ answers

    def _receive(self) -> tuple[bytes, list[int], int]:
        """One answer (one byte more than an answer's size: a longer one shows
        as too long), at most one fd, close-on-exec."""
        data, fds, flags, _addr = socket.recv_fds(self.sock, native.INIT_REPLY_SIZE + 1, 1, socket.MSG_CMSG_CLOEXEC)
        return data, fds, flags

    def _on_readable(self) -> None:
        while not self.closed:
            try:
                data, fds, flags = self._receive()
            except BlockingIOError:
                return
            except OSError as err:
                self.close(None if err.errno in _GONE else f"receive: {err}")
                return
            if not data:
                for fd in fds:
                    os.close(fd)
                self.close(None)           # init exited: the sandbox is gone
                return
            why = self._answer(data, fds, flags)
            for fd in fds:             # what _answer did not keep
                os.close(fd)
            if why is not None:
                log.warning("sandbox init channel: %s; execs go through the daemon's helper", why)
                self.close(f"protocol: {why}")
                return

    def _answer(self, data: bytes, fds: list[int], flags: int) -> str | None:
        """Apply one answer; the reason it breaks the protocol, or None. The
        fds it keeps are taken out of `fds`."""
        if len(data) != native.INIT_REPLY_SIZE or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            return f"an answer of {len(data)} bytes"
        magic, kind, exec_id, pid, status, _ = _REPLY_HEAD.unpack_from(data)
        if magic != native.INIT_MAGIC:
            return f"an answer with magic {magic:#x}"
        run = self.pending.get(exec_id)
        if run is None:
            # An exec the daemon before a restart had sent: nobody watches it
            # (no timeout, no reader of its output), so it goes.
            if kind == native.INIT_STARTED and len(fds) == 1 and _is_pidfd(fds[0]):
                _kill_quietly(fds[0])
            return None
        if kind == native.INIT_STARTED and not run.running:
            (err_no,) = _ERRNO.unpack_from(data, native.INIT_REPLY_ERR_OFFSET)
            if err_no:
                if fds:
                    return "an fd with a failed start"
                del self.pending[exec_id]
                run._failed(native.init_exec_error(data[native.INIT_REPLY_ERR_OFFSET:], *run.request))
                return None
            if len(fds) != 1 or not _is_pidfd(fds[0]):
                return "a start without a pidfd"
            run._started(fds.pop(), pid)
            return None
        if kind == native.INIT_EXITED and not fds and run.running:
            del self.pending[exec_id]
            run._ended(status)
            return None
        return f"answer kind {kind} out of order for exec {exec_id}"

    # ------------------------------------------------------------ end

    def close(self, why: str | None) -> None:
        """Stop using the channel. why None: the sandbox is going (init exits
        or is killed), so every exec still running ends by SIGKILL; else the
        channel broke while they may still run: they are killed, and fail."""
        with self._lock:
            loop = self.loop
            if loop is None:              # never used: no reader, nothing pending
                if not self.closed:
                    self.closed = True
                    self.sock.close()
                return
        if not _on_loop(loop):
            try:
                loop.call_soon_threadsafe(self.close, why)
            except RuntimeError:          # the loop is closed: nothing reads the socket any more
                self.sock.close()
            return
        if self.closed:
            return
        self.closed = True
        loop.remove_reader(self.sock.fileno())
        self._kill_unread()
        if why is not None:
            # Init keeps this end too: only a shutdown makes its end see the
            # channel gone, so that it starts nothing still queued.
            _shutdown_quietly(self.sock)
        self.sock.close()
        pending, self.pending = self.pending, {}
        lost = OSError(errno.EPIPE, f"lost the exec channel to the sandbox's init ({why})")
        for run in pending.values():
            # A running background process is not killed when the daemon stops
            # (or the sandbox goes, and the kernel kills it with the pid
            # namespace): it outlives the daemon, init keeps its pipes for the next.
            if not (why is None and run.detached and run.running):
                run.kill()
            if why is not None:
                run._close()
                run._failed(lost)
            elif run.running:               # the kernel killed it with the pid namespace
                run._ended(KILLED, reported=False)
            else:
                run._failed(OSError(errno.ESRCH, "the sandbox's init did not start it"))

    def _kill_unread(self) -> None:
        """Answers still queued when the channel closes: an exec they report
        started is killed through its pidfd, since nothing will watch it."""
        for _ in range(4096):
            try:
                data, fds, _flags = self._receive()
            except OSError:
                return
            for fd in fds:
                if _is_pidfd(fd):
                    _kill_quietly(fd)
                os.close(fd)
            if not data:
                return


def take_back(pidfd: int) -> InitLink | None:
    """After a daemon restart: the channel of the sandbox whose init `pidfd`
    names, from the daemon's end init keeps (INIT_PEER_FD); None if it has
    none (made with exec_via = helper, or by an older daemon, whose init may
    hold anything there)."""
    try:
        fd = native.pidfd_getfd(pidfd, native.INIT_PEER_FD)
    except OSError:
        return None
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.ENOTSOCK, "not the exec channel")
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return None
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        sock.close()
        return None
    return parked(sock)


def parked(sock: socket.socket) -> InitLink:
    """The daemon's end of a channel as a link, its fd parked (dsecd/fds.py)."""
    fd = fdtable.park(sock.detach())
    return InitLink(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, 0, fd))


def _kill_quietly(pidfd: int) -> None:
    try:
        native.pidfd_kill_group(pidfd, signal.SIGKILL)
    except OSError:         # no member left
        pass


def _shutdown_quietly(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _is_pidfd(fd: int) -> bool:
    """Whether fd is a pidfd: its link reads "anon_inode:[pidfd]" (released
    kernels through 6.18 at least; "pidfd:[...]" in some 6.9 release
    candidates)."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return target.startswith("pidfd:") or target == "anon_inode:[pidfd]"


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def pair() -> tuple[socket.socket, socket.socket]:
    """(the daemon's end, init's end): close-on-exec, as socketpair makes them."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
