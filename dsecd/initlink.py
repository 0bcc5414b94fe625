"""The exec channel to a sandbox's dsec-init, which forks the execs itself.

Why: an exec forked by the sandbox's PID 1 inherits its namespaces, cgroups,
CPU QoS and the seccomp filter compiled once for init. The daemon's exec
helper (csrc/spawn.c) sets each of these up again per exec: setns, a
cgroup.procs write per hierarchy, a JIT compile of the filter, a copy of the
daemon's fd table (docs/burst.md, round 5).

One SOCK_SEQPACKET socketpair per sandbox, made at create; init's end is its
fd 4 (csrc/init.c; the message layouts are in csrc/dsec_native.h). This side
lives on the event loop: `spawn` sends one request, stdio passed with
SCM_RIGHTS, and returns a `Started` whose `pidfd` future resolves once init
answered (or fails with the NativeError of a step before execve) and whose
`exited` future resolves to {"status": wait status} once init reaped it.

What init says is believed about its own sandbox only: the one fd it may send
is used as a pidfd to kill that exec's process group, nothing else. An answer
that breaks the protocol closes the channel; later execs of that sandbox go
through the daemon's helper. A sandbox adopted after a daemon restart has no
channel (its init still holds the old, closed end) and does the same.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import struct

from . import native

log = logging.getLogger(__name__)

# struct dsec_init_req: magic, id, uid, gid, cap_keep, argc, envc, strings_len, reserved
_REQ = struct.Struct("=IIIIQIIII")
# struct dsec_init_reply up to its err: magic, kind, id, pid, status, reserved; then err.err
_REPLY_HEAD = struct.Struct("=IIIiii")
_ERRNO = struct.Struct("=i")
assert _REQ.size == native.INIT_REQ_SIZE and _REPLY_HEAD.size == native.INIT_REPLY_ERR_OFFSET

KILLED = signal.SIGKILL        # wait status of a process killed by SIGKILL


class Started:
    """One exec sent to init. `pidfd` and `exited` are loop futures."""

    __slots__ = ("link", "id", "request", "pidfd", "exited", "_fd", "_abandoned")

    def __init__(self, link: InitLink, exec_id: int, request: tuple):
        self.link = link
        self.id = exec_id
        self.request = request         # (argv0, env, uid, cwd): what an error names
        self.pidfd: asyncio.Future = link.loop.create_future()
        self.exited: asyncio.Future = link.loop.create_future()
        self._fd = -1
        self._abandoned = False

    def kill(self) -> None:
        """SIGKILL the exec's process group (it leads its own session)."""
        if self._fd >= 0:
            try:
                native.pidfd_kill_group(self._fd, signal.SIGKILL)
            except OSError:       # gone already (ESRCH), or a lying init's non-pidfd
                pass

    def abandon(self) -> None:
        """Its request is gone (cancelled): kill it now, or as soon as it
        starts; nobody waits for its futures any more."""
        self._abandoned = True
        self.kill()
        for fut in (self.pidfd, self.exited):
            fut.cancel()

    def _on_started(self, fd: int) -> None:
        self._fd = fd
        if self._abandoned:
            self.kill()
        if not self.pidfd.done():
            self.pidfd.set_result(fd)

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class InitLink:
    """The daemon's end of one sandbox's exec channel.

    Made in a worker thread (create), used on the event loop from the first
    exec on. `close` may be called from any thread and any number of times."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sock.setblocking(False)
        self.loop: asyncio.AbstractEventLoop | None = None     # set by the first spawn
        self.pending: dict[int, Started] = {}
        self.next_id = 1
        self.closed = False

    # ------------------------------------------------------------ requests

    def spawn(self, loop: asyncio.AbstractEventLoop, argv: list[str], env: list[str], cwd: str, uid: int,
              cap_keep: int, stdio: tuple[int, int, int]) -> Started | None:
        """Ask init to start argv; None if this channel cannot take it (closed,
        too big for one packet, init not reading): use the daemon's helper.
        The stdio fds are in the kernel's hands once this returns: the caller
        may close its copies. ValueError for strings or ids execve cannot take."""
        if self.closed:
            return None
        native.check_exec_request(argv, env, cwd, uid, uid)     # ValueError: as the helper's
        strings = b"\0".join(os.fsencode(s) for s in (cwd, *argv, *env)) + b"\0"
        if len(strings) > native.INIT_MAX_STRINGS:
            return None
        if self.loop is None:
            self.loop = loop
            loop.add_reader(self.sock.fileno(), self._on_readable)
        exec_id = self.next_id
        self.next_id = self.next_id % 0xFFFFFFFF + 1
        head = _REQ.pack(native.INIT_MAGIC, exec_id, uid, uid, cap_keep, len(argv), len(env), len(strings), 0)
        try:
            socket.send_fds(self.sock, [head, strings], list(stdio))
        except BlockingIOError:
            return None            # init's queue is full: it is busy or frozen
        except OSError as err:     # init is gone
            self.close(f"send: {err}")
            return None
        started = Started(self, exec_id, (argv[0], env, uid, cwd))
        self.pending[exec_id] = started
        return started

    # ------------------------------------------------------------ answers

    def _on_readable(self) -> None:
        while not self.closed:
            try:
                data, fds, flags, _addr = socket.recv_fds(self.sock, native.INIT_REPLY_SIZE + 1, 1,
                                                          socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                return
            except OSError as err:
                self.close(f"receive: {err}")
                return
            if not data:
                self.close(None)           # init exited: the sandbox is gone
                for fd in fds:
                    os.close(fd)
                return
            why = self._answer(data, fds, flags)
            if why is not None:
                for fd in fds:
                    os.close(fd)
                log.warning("sandbox init channel: %s; execs go through the daemon's helper", why)
                self.close(f"protocol: {why}")
                return

    def _answer(self, data: bytes, fds: list[int], flags: int) -> str | None:
        """Apply one answer; the reason it breaks the protocol, or None."""
        if len(data) != native.INIT_REPLY_SIZE or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            return f"an answer of {len(data)} bytes"
        magic, kind, exec_id, _pid, status, _ = _REPLY_HEAD.unpack_from(data)
        started = self.pending.get(exec_id)
        if magic != native.INIT_MAGIC or started is None:
            return f"an answer for unknown exec {exec_id}"
        if kind == native.INIT_STARTED and started._fd < 0:
            (err_no,) = _ERRNO.unpack_from(data, native.INIT_REPLY_ERR_OFFSET)
            if err_no:
                if fds:
                    return "an fd with a failed start"
                del self.pending[exec_id]
                if not started.pidfd.done():      # else abandoned: nobody waits
                    started.pidfd.set_exception(native.init_exec_error(data[native.INIT_REPLY_ERR_OFFSET:],
                                                                       *started.request))
                return None
            if len(fds) != 1:
                return f"{len(fds)} fds with a start"
            started._on_started(fds.pop())
            return None
        if kind == native.INIT_EXITED and not fds and (started._fd >= 0):
            del self.pending[exec_id]
            started._close()         # its pid is free now: no kill through it any more
            if not started.exited.done():
                started.exited.set_result({"status": status})
            return None
        return f"answer kind {kind} out of order for exec {exec_id}"

    # ------------------------------------------------------------ end

    def close(self, why: str | None) -> None:
        """Stop using the channel. why None: the sandbox is going (init exits
        or is killed), so every exec still running ends by SIGKILL; else the
        channel broke while they may still run: they are killed, and fail."""
        if self.loop is not None and not _on_loop(self.loop):
            self.loop.call_soon_threadsafe(self.close, why)
            return
        if self.closed:
            return
        self.closed = True
        if self.loop is not None:
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        pending, self.pending = self.pending, {}
        for started in pending.values():
            started.kill()
            started._close()
            gone = OSError(errno.EPIPE, f"lost the exec channel to the sandbox's init ({why})")
            if not started.pidfd.done():      # not started: the caller waits on pidfd only
                started.pidfd.set_exception(gone if why else OSError(errno.ESRCH, "the sandbox's init exited"))
                started.exited.cancel()
            elif not started.exited.done():
                if why is None:
                    started.exited.set_result({"status": KILLED})
                else:
                    started.exited.set_exception(gone)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def pair() -> tuple[socket.socket, socket.socket]:
    """(the daemon's end, init's end): close-on-exec, as socketpair makes them."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

