"""The unix-socket server: connections, frames, request tasks, streams.

One asyncio task reads each connection; every request runs as its own task
so one connection can have many in flight (up to max_requests_per_client).
Frames are written whole with one transport write, so frames of concurrent
requests never interleave. Only root and members of `socket_group` may
connect (socket mode 0660 and an SO_PEERCRED check on every connection).

Every answer is counted by op and result (dsecd_requests_total). Errors that
may be the daemon's own are logged: `internal` (a bug) with its traceback at
error, `io` (a host or in-sandbox operation failed) at warning; the errors a
client causes (bad_request, not_found, busy, ...) only at debug, and
connections come and go at debug too.
"""

from __future__ import annotations

import asyncio
import errno
import grp
import logging
import os
import select
import socket
import struct
from collections.abc import Awaitable, Callable

from . import doing, framing, metrics, protocol, unixsock
from .errors import (
    BadRequest,
    Conflict,
    DsecError,
    Internal,
    LimitExceeded,
    PermissionDenied,
    Unsupported,
)
from .onloop import cancel_once
from .turns import Turn, Turns

log = logging.getLogger(__name__)
# The largest frame before a connection's hello is done: a hello is a few
# dozen bytes, and an unauthenticated peer must not make the daemon hold
# max_frame_bytes per connection.
HELLO_MAX_FRAME = 64 << 10
# How often a half-closed connection's running requests look whether the
# client has gone altogether.
HANGUP_POLL_S = 1.0


# <asm-generic/socket.h> (Linux >= 4.13); Python's socket module lacks it.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_PEER_GROUPS = 256       # Python's getsockopt takes at most 1024 bytes


# <asm-generic/socket.h> (Linux >= 6.5).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


# How long a worker waits for the loop to take the client's pidfd: the loop
# answers within its next turn unless it is stalled (see looplag.py).
PEER_PIDFD_WAIT_S = 30.0


def peer_pidfd(sock, pid: int) -> int | None:
    """A pidfd of the process that connected: SO_PEERPIDFD (Linux >= 6.5),
    which names that very process even if its pid was reused since; on an
    older kernel, pidfd_open of its SO_PEERCRED pid. None when the peer has
    no pid in our pid namespace (SO_PEERCRED says 0). ProcessLookupError
    when it is gone (6.5 to 6.15 answer EINVAL for that). The caller closes
    the pidfd."""
    if pid == 0:
        return None     # SO_PEERPIDFD would still answer, with a pidfd whose pid is not visible here
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.ESRCH):
            raise ProcessLookupError(errno.ESRCH, "the client exited") from err
        if err.errno != errno.ENOPROTOOPT:
            raise
    if pid < 0:
        return None
    return os.pidfd_open(pid)


def peer_groups(sock: socket.socket) -> set[int]:
    """Supplementary gids the peer had when it connected (SO_PEERGROUPS): so a
    member of socket_group by `usermod -aG` or `sg`/`newgrp` is recognised by
    what its process holds, not only by /etc/group. Empty if the kernel lacks it."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _MAX_PEER_GROUPS)
    except OSError:
        return set()
    return set(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


class RequestContext:
    """What a handler may do besides returning: stream frames, register an exec."""

    def __init__(self, conn: Connection, rid: int):
        self.conn = conn
        self.rid = rid

    async def emit(self, payload: dict) -> None:
        await self.conn.send({"id": self.rid, "stream": payload})

    def emit_nowait(self, payload: dict) -> None:
        self.conn.send_nowait({"id": self.rid, "stream": payload})

    async def drained(self) -> None:
        """Wait while the connection holds more than its buffer's limit
        unsent (emit_nowait and this are emit)."""
        await self.conn.drained()

    def register_exec(self, io) -> None:
        self.conn.execs[self.rid] = io
        self.conn.begun(self.rid)

    def unregister_exec(self) -> None:
        self.conn.execs.pop(self.rid, None)

    def why_cancelled(self) -> str:
        """Why the request is being cancelled: "gone" (its client went: its
        connection ended), "cancel" (a `cancel` request named it), else
        "stop" (the daemon stops)."""
        if self.conn.gone:
            return "gone"
        return "cancel" if self.rid in self.conn.cancels else "stop"

    async def exec_for(self, exec_id: int):
        """The running exec of request `exec_id` on this connection, or None;
        one not started yet is waited for (Connection.started)."""
        return await self.conn.started(exec_id, self.conn.execs)

    def exec_now(self, exec_id: int):
        """The exec of request `exec_id` registered on this connection now, or None."""
        return self.conn.execs.get(exec_id)

    def register_input(self, sink) -> None:
        """This request takes data from later requests naming its id (file_tar_input)."""
        self.conn.inputs[self.rid] = sink
        self.conn.begun(self.rid)

    def unregister_input(self) -> None:
        self.conn.inputs.pop(self.rid, None)

    def at_close(self, fn: Callable[[], Awaitable[None]]) -> Callable[[], None]:
        """await fn() once this connection closes (its requests ended);
        returns what forgets it, for when the work no longer needs it."""
        key = object()
        self.conn.closing[key] = fn
        return lambda: self.conn.closing.pop(key, None)

    def peer_pidfd(self) -> int | None:
        """A pidfd of the client's process (server.peer_pidfd), for reaching
        host paths it names as it sees them (fs/clientpaths.py); any thread
        may ask (a worker waits for the loop to answer). The caller closes
        it. ProcessLookupError once the connection is closing: the client
        is gone.

        Asked on the loop, where the socket's fd is known to be this
        connection's while its transport is open: a worker asking through
        the fd number itself could find it closed (the transport closes on
        a read error, or at the connection's end while a cancelled
        request's worker runs on) and reused by the next client's
        connection, and would reach that client's files."""
        loop = self.conn.loop
        if not loop.is_running():       # stopped: the daemon is ending, nobody would answer
            raise ProcessLookupError(errno.ESRCH, "the daemon is shutting down")
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            return self._peer_pidfd_now()

        async def asked() -> int | None:
            return self._peer_pidfd_now()

        try:
            fut = asyncio.run_coroutine_threadsafe(asked(), loop)
        except RuntimeError:        # the loop is closed: the daemon is ending
            raise ProcessLookupError(errno.ESRCH, "the daemon is shutting down") from None
        try:
            return fut.result(PEER_PIDFD_WAIT_S)
        except TimeoutError:
            # Answered later after all: closed, nobody will.
            fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() or f.result() is None
                                  else os.close(f.result()))
            raise ProcessLookupError(errno.ESRCH, f"no answer from the daemon's loop in "
                                                  f"{PEER_PIDFD_WAIT_S:.0f} s") from None

    def _peer_pidfd_now(self) -> int | None:
        conn = self.conn
        if conn.writer.transport.is_closing():
            raise ProcessLookupError(errno.ESRCH, "the client went away")
        if conn.sock is None:
            return None
        return peer_pidfd(conn.sock, conn.pid)

    @property
    def peer_ids(self) -> tuple[int, int, tuple[int, ...]] | None:
        """(uid, gid, supplementary gids) of a client other than root, whose
        own access the daemon checks before it reads a host path the
        client names (fs/clientpaths.py); None for root."""
        return self.conn.ids

    async def input_for(self, rid: int):
        """The input sink request `rid` registered, or None; one not
        registered yet is waited for (Connection.started)."""
        return await self.conn.started(rid, self.conn.inputs)


class _StartGate(Turn):
    """Where requests feeding request N wait while N has not registered
    what takes their data (Connection.started): `begun` is set once it
    did, or ended."""

    def __init__(self):
        super().__init__()
        self.begun = asyncio.Event()


class Connection:
    def __init__(self, server: Server, frames: framing.FrameProtocol, writer: asyncio.StreamWriter):
        self.server = server
        self.frames = frames
        self.writer = writer
        self.tasks: dict[int, asyncio.Task] = {}
        self.execs: dict[int, object] = {}
        # Requests in flight that take input from later requests (exec,
        # file_tar_put) and have not registered what takes it yet, and the
        # gates those later requests wait at (started).
        self.starting: set[int] = set()
        self.gates: Turns[int, _StartGate] = Turns(_StartGate)
        self.inputs: dict[int, object] = {}
        self.closing: dict[object, Callable[[], Awaitable[None]]] = {}   # RequestContext.at_close
        self.loop = asyncio.get_running_loop()
        self.sock = None       # the connection's socket and the peer's pid (SO_PEERCRED), once known
        self.pid = -1
        # (uid, gid, supplementary gids) of a peer other than root, as it
        # connected (SO_PEERCRED, SO_PEERGROUPS); None for root.
        self.ids: tuple[int, int, tuple[int, ...]] | None = None
        self.max_frame = server.max_frame
        self.peer = "?"
        self.client = ""
        self.gone = False      # its client went: the requests still running are cancelled for that
        self.task = asyncio.current_task()     # what serves it (Server._on_connect), which the stop waits for
        self.cancels: set[int] = set()      # the requests a `cancel` named, while they end

    def send_nowait(self, frame: dict) -> None:
        if self.writer.is_closing():
            return
        try:
            parts = protocol.encode_frame_parts(frame, self.max_frame)
        except DsecError as err:
            parts = protocol.encode_frame_parts({"id": frame.get("id"), "error": err.to_wire()})
        self.writer.writelines(parts)

    async def send(self, frame: dict) -> None:
        self.send_nowait(frame)
        await self.drained()

    async def drained(self) -> None:
        try:
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            pass

    async def read_frame(self, idle_timeout: float | None = None) -> dict | None:
        """The next frame, or None at EOF. A connection may idle between frames
        (up to `idle_timeout`, None = forever), but once a frame's first byte
        is in, the whole frame must follow within frame_timeout_s: a client
        trickling bytes (slowloris) or stopping mid-frame holds a connection
        slot and a partial buffer, so it is told `limit` and dropped."""
        try:
            payload = await self.frames.read_payload(idle_timeout, self.server.frame_timeout)
        except framing.IdleTimeout:
            raise LimitExceeded(f"no `hello` within {idle_timeout:g} s of connecting",
                                {"timeout_s": idle_timeout}) from None
        except framing.FrameTimeout:
            raise LimitExceeded(f"frame not complete {self.server.frame_timeout:g} s after its first byte "
                                "(limits.frame_timeout_s); closing the connection",
                                {"timeout_s": self.server.frame_timeout}) from None
        except framing.FrameTooBig as err:
            # The stream cannot be trusted to resynchronise cheaply: say why, then drop it.
            raise LimitExceeded(f"frame of {err.size} bytes exceeds the {err.limit}-byte limit; "
                                "split large files into chunks", {"size": err.size, "max": err.limit}) from None
        if payload is None:
            return None
        return protocol.decode_payload(payload)

    async def _backpressure(self) -> bool:
        """Stop reading requests while the client is not reading answers.

        Errors for bad frames are written without waiting (send_nowait), so a
        client pipelining garbage and never reading would grow the daemon's
        write buffer without bound. The transport pauses its writer above its
        high-water mark; until the client drains it, nothing more is read from
        it. A client that reads nothing for frame_timeout_s is dropped.
        False: drop the connection."""
        transport = self.writer.transport
        if not transport.is_closing() and transport.get_write_buffer_size() == 0:
            return True                      # nothing unread: no wait, no timer
        try:
            async with asyncio.timeout(self.server.frame_timeout):
                await self.writer.drain()
            return True
        except (ConnectionError, RuntimeError):
            return False
        except TimeoutError:
            log.warning("dropping %s: it has not read its answers for %g s", self.peer, self.server.frame_timeout)
            return False

    async def serve(self) -> None:
        try:
            if not await self._handshake():
                return
            self.frames.max_frame = self.max_frame        # past hello: the configured limit
            while True:
                try:
                    frame = await self.read_frame()
                except LimitExceeded as err:
                    await self.send({"id": None, "error": err.to_wire()})
                    return
                except BadRequest as err:
                    await self.send({"id": None, "error": err.to_wire()})
                    continue
                if frame is None:
                    await self._finish_after_half_close()
                    return
                self._dispatch(frame)
                if not await self._backpressure():
                    return
        finally:
            await self._close()

    async def _finish_after_half_close(self) -> None:
        """The client sent its last request. A client that only shut down its
        sending side (`dsec rpc --stdio` at the end of its input, a script
        that sends and then reads) still reads: its requests run to their
        answers. One that is gone (the socket hung up) does not: _close
        cancels them, so a vanished client's execs die with it. Checked every
        HANGUP_POLL_S while they run."""
        while self.tasks and not self._hung_up():
            await asyncio.wait(list(self.tasks.values()), timeout=HANGUP_POLL_S)

    def _hung_up(self) -> bool:
        """Whether the peer closed its socket (POLLHUP: both directions shut),
        not just its sending side."""
        sock = self.writer.get_extra_info("socket")
        if sock is None or self.writer.is_closing():
            return True
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return any(ev & (select.POLLHUP | select.POLLERR) for _fd, ev in poller.poll(0))

    async def _handshake(self) -> bool:
        try:
            frame = await self.read_frame(idle_timeout=self.server.hello_timeout)
        except DsecError as err:
            await self.send({"id": None, "error": err.to_wire()})
            return False
        if frame is None:
            return False
        try:
            rid, req = protocol.parse_request(frame)
            if not isinstance(req, protocol.Hello):
                raise BadRequest(f"the first request must be `hello`, got {req.OP!r}")
            if req.protocol != protocol.PROTOCOL_VERSION:
                raise Unsupported(f"protocol version {req.protocol} is not supported; this server speaks "
                                  f"{protocol.PROTOCOL_VERSION}", {"supported": [protocol.PROTOCOL_VERSION]})
        except DsecError as err:
            await self.send({"id": frame.get("id") if isinstance(frame.get("id"), int) else None,
                             "error": err.to_wire()})
            return False
        self.client = req.client[:64]
        log.debug("hello from %s (%s)", self.peer, self.client)
        await self.send({"id": rid, "result": self.server.node.hello_result()})
        return True

    def begun(self, rid: int) -> None:
        """Request `rid` registered what takes its input, or ended: its waiters go on."""
        self.starting.discard(rid)
        gate = self.gates.get(rid)
        if gate is not None:
            gate.begun.set()

    async def started(self, rid: int, registry: dict):
        """What request `rid` registered in `registry` (execs, inputs), or
        None. A request still on its way there (an exec or a copy resuming
        a paused sandbox first) is waited for: a client sends input right
        behind its request, and input answered "no such request" is lost.
        Callers go on in the order they came (the gate's lock is FIFO, and
        one that comes while earlier ones still wait queues behind them),
        so input sent in order is taken in order: each caller queues its
        data before it yields again."""
        if self.gates.get(rid) is None:
            found = registry.get(rid)
            if found is not None or rid not in self.starting:
                return found
        async with self.gates.taken(rid) as gate:
            if rid in self.starting:
                await gate.begun.wait()
            return registry.get(rid)

    def _dispatch(self, frame: dict) -> None:
        try:
            rid, req = protocol.parse_request(frame)
        except DsecError as err:
            rid = frame.get("id")
            self.send_nowait({"id": rid if isinstance(rid, int) else None, "error": err.to_wire()})
            return
        if rid in self.tasks:
            self.send_nowait({"id": rid, "error": BadRequest(f"request id {rid} is already in flight").to_wire()})
            return
        if len(self.tasks) >= self.server.max_requests:
            # `in_flight`: refused before it ran, so the SDK sends it again.
            # A request counts until its answer has drained to the socket,
            # which may be after the client has read it.
            self.send_nowait({"id": rid, "error": LimitExceeded(
                f"{len(self.tasks)} requests in flight on this connection (max {self.server.max_requests})",
                {"max": self.server.max_requests, "in_flight": len(self.tasks)}).to_wire()})
            return
        # Named by its op, id and sandbox: what a stop that could not wait for it logs.
        task = asyncio.get_running_loop().create_task(
            self._run(rid, req), name=doing.request_label(req.OP, rid, getattr(req, "sandbox", None)))
        self.tasks[rid] = task
        if isinstance(req, (protocol.Exec, protocol.FileTarPut)):
            self.starting.add(rid)
        task.add_done_callback(lambda t, rid=rid: self._finished(rid, t))

    def _finished(self, rid: int, task: asyncio.Task) -> None:
        """A task cancelled before it ever ran skips _run's own except/finally:
        its final frame and its slot are settled here (found by fuzzing)."""
        if self.tasks.get(rid) is task:
            del self.tasks[rid]
            self.begun(rid)
            if task.cancelled():
                self.send_nowait({"id": rid, "error": Conflict("request cancelled").to_wire()})

    async def _run(self, rid: int, req) -> None:
        ctx = RequestContext(self, rid)
        doing.for_request(req.OP, rid, self.peer, getattr(req, "sandbox", None))
        try:
            if isinstance(req, protocol.Cancel):
                result = self._cancel(req.target)
            elif isinstance(req, protocol.Hello):
                raise BadRequest("hello was already done on this connection")
            else:
                handler = self.server.routes[req.OP]
                result = await handler(req, ctx)
            metrics.REQUESTS.labels(req.OP, "ok").inc()
            await self.send({"id": rid, "result": result})
        except asyncio.CancelledError:
            metrics.REQUESTS.labels(req.OP, "cancelled").inc()
            self.send_nowait({"id": rid, "error": Conflict("request cancelled").to_wire()})
            raise
        except DsecError as err:
            metrics.REQUESTS.labels(req.OP, err.code).inc()
            self._log_error(req, rid, err)
            await self.send({"id": rid, "error": err.to_wire()})
        except Exception as err:  # a bug: log it whole, tell the client only that it happened
            metrics.REQUESTS.labels(req.OP, "internal").inc()
            log.exception("internal error in %s (request %d from %s)", req.OP, rid, self.peer,
                          extra={"fields": {"op": req.OP, "code": "internal", "peer": self.peer,
                                            "sandbox": getattr(req, "sandbox", None)}})
            await self.send({"id": rid, "error": Internal(
                f"{req.OP} failed: {type(err).__name__}: {err}; see the daemon log").to_wire()})
        finally:
            self.cancels.discard(rid)
            if self.tasks.get(rid) is asyncio.current_task():
                del self.tasks[rid]
                self.begun(rid)          # an exec that ended before it started: its waiters go on

    def _log_error(self, req, rid: int, err: DsecError) -> None:
        level = {"internal": logging.ERROR, "io": logging.WARNING}.get(err.code, logging.DEBUG)
        if log.isEnabledFor(level):
            log.log(level, "%s failed: %s: %s", req.OP, err.code, err.message, extra={"fields": {
                "op": req.OP, "code": err.code, "request": rid, "peer": self.peer,
                "sandbox": getattr(req, "sandbox", None), "detail": err.detail}},
                exc_info=err if err.code == "internal" else None)

    def _cancel(self, target: int) -> dict:
        task = self.tasks.get(target)
        if task is None:
            raise BadRequest(f"no request {target} in flight on this connection")
        io = self.execs.get(target)
        if io is not None:
            io.cancelled = True
        self.cancels.add(target)
        cancel_once(task)              # named again (a retried `cancel`): its undoing runs on whole
        return {"cancelled": target}

    async def _close(self) -> None:
        # A vanished client's requests die with it: execs are killed, streams
        # end; those under an idempotency key run on (dsecd/engine/opkeys.py).
        self.gone = True
        for task in list(self.tasks.values()):
            cancel_once(task)               # one a `cancel` or the stop named is undoing already
        if self.tasks:
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        while self.closing:
            _, fn = self.closing.popitem()
            try:
                await fn()
            except Exception:           # a bug: the other closers still run
                log.exception("cleanup of connection %s failed", self.peer)
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


class Server:
    def __init__(self, node, socket_path: str, group: str, limits: dict, max_frame: int):
        self.node = node
        self.routes = node.routes()       # op name -> the handler of the service that owns it
        self.path = socket_path
        self.group = group
        self.gid = _group_id(group)
        self.max_frame = max_frame
        self.max_requests = limits["max_requests_per_client"]
        self.max_connections = limits["max_connections"]
        self.frame_timeout = float(limits["frame_timeout_s"])
        self.hello_timeout = float(limits["hello_timeout_s"])
        self.connections: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._connecting: set[asyncio.Task] = set()      # connection tasks (a strong reference each)
        self._stopped = False

    async def start(self) -> None:
        _remove_stale_socket(self.path)
        loop = asyncio.get_running_loop()
        try:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o755, exist_ok=True)
            self._server = await unixsock.serve_private(
                self.path, self.gid if self.gid is not None else 0,
                lambda sock: loop.create_unix_server(self._new_protocol, sock=sock,
                                                     backlog=min(self.max_connections, 4096)))
        except OSError as err:
            where = f" ({err.filename})" if err.filename else ""
            raise SystemExit(f"dsecd: daemon.socket {self.path}: {err.strerror or err}{where}; it must name "
                             "a path in a directory the daemon can write") from None
        log.info("listening on %s (group %s)", self.path, self.group or "root")

    def _allowed(self, uid: int, gid: int, groups: set[int]) -> bool:
        if uid == 0 or uid == os.geteuid():
            return True
        if self.gid is None:
            return False
        if gid == self.gid or self.gid in groups:
            return True
        import pwd

        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            return False
        return name in grp.getgrgid(self.gid).gr_mem

    def _new_protocol(self) -> framing.FrameProtocol:
        """A connection's protocol; serving it starts once it is connected.
        Frames are capped at HELLO_MAX_FRAME until its hello is done."""
        return framing.FrameProtocol(HELLO_MAX_FRAME, self._connected)

    def _connected(self, frames: framing.FrameProtocol) -> None:
        if self._stopped:
            # Accepted before the stop closed the socket, made a transport a
            # loop turn or two after: its requests would run while the node
            # closes, and an idle client would hold the stop's wait.
            frames.transport.close()
            return
        loop = asyncio.get_running_loop()
        writer = asyncio.StreamWriter(frames.transport, frames, None, loop)
        task = loop.create_task(self._on_connect(frames, writer))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _on_connect(self, frames: framing.FrameProtocol, writer: asyncio.StreamWriter) -> None:
        conn = Connection(self, frames, writer)
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, gid = unixsock.peer_credentials(sock)
        except OSError:
            pid = uid = gid = -1
        conn.peer = f"pid={pid} uid={uid} gid={gid}"
        conn.sock, conn.pid = sock, pid
        asyncio.current_task().set_name(f"connection of {conn.peer}")     # for a stop that cannot wait
        groups = peer_groups(sock) if uid not in (0, -1) else set()
        if uid > 0:
            conn.ids = (uid, gid, tuple(sorted(groups)))
        if not self._allowed(uid, gid, groups):
            log.warning("refused connection from %s: not root or in group %r", conn.peer, self.group)
            await conn.send({"id": None, "error": PermissionDenied(
                f"uid {uid} may not use dsecd; ask for membership of group {self.group or 'root'}").to_wire()})
            writer.close()
            return
        if len(self.connections) >= self.max_connections:
            await conn.send({"id": None, "error": LimitExceeded(
                f"{len(self.connections)} connections open (max {self.max_connections})").to_wire()})
            writer.close()
            return
        log.debug("connection from %s", conn.peer)
        self.connections.add(conn)
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)

    async def stop(self) -> None:
        """Stop serving: no new connection, and every request in flight
        cancelled (one under an idempotency key runs on until the node's
        close ends it: OpKeys.close). Their undoing takes loop turns and
        workers (a streamed exec's group is killed once its pipes' readers
        have ended, a copy's temp files are removed through a worker, a
        microVM exec is killed through its guest's agent): `wait_stopped`
        waits for it."""
        self._stopped = True
        if self._server:
            self._server.close()
        # Every connection's task: one accepted but not yet started never
        # serves; the others end as their requests do, below. One closing
        # already (its client went) is left to end: a cancel would cut
        # short its wait for its requests, cancelling their undoing again,
        # and its closers (Connection._close).
        closing = {conn.task for conn in self.connections if conn.gone}
        for task in self._connecting - closing:
            task.cancel()
        for conn in list(self.connections):
            for task in conn.tasks.values():
                cancel_once(task)               # one a `cancel` named is undoing already
            conn.writer.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def wait_stopped(self, timeout: float) -> int:
        """After `stop`: wait up to `timeout` s for every connection to end,
        its cancelled requests' undoing done (an exec's process group
        killed, a copy's temp files removed) and its closers run, before the
        node's close takes away what they go through (init's channels, the
        worker pool, the journal). Bounded: an undoing that hangs (a kill
        through a wedged guest agent, a removal on a hung file system) must
        not keep the daemon from stopping. How many requests had not ended."""
        if not self._connecting:
            return 0
        _done, pending = await asyncio.wait(set(self._connecting), timeout=timeout)
        if not pending:
            return 0
        left = sorted(f"{task.get_name()} of {conn.peer}" for conn in self.connections
                      for task in conn.tasks.values())
        log.warning("stopping with %d request(s) (%s) of %d connection(s) not ended %.0f s after they were "
                    "cancelled; what they started may be left running in their sandboxes (`dsec top` shows it)",
                    len(left), "; ".join(left) or "none: their closes", len(pending), timeout,
                    extra={"fields": {"event": "stop_left_requests", "requests": left}})
        return len(left)


def _group_id(group: str) -> int | None:
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise SystemExit(f"dsecd: daemon.socket_group {group!r} does not exist; create it or unset it") from None


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead daemon; refuse if one is still
    listening, or if the file is not a socket (the bind would replace it)."""
    try:
        unixsock.remove_dead_socket(path)
    except ValueError as err:
        raise SystemExit(f"dsecd: {err}; daemon.socket (--socket) must name a socket path of this daemon's "
                         "own (stop the daemon serving there, or pick another --socket)") from None
