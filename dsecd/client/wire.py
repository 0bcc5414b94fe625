"""Client's connection to a daemon and the requests on it: connect and
hello (a unix socket or ssh://), the reader that routes frames by request
id, the silence watch, reconnects, a request's frames (slots held, sent
again after a loss where that is safe, refused ones sent again), and the
undo of a request given up on after it was sent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import grp
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable

from .. import framing, protocol, remote, unixsock
from ..config import parse_duration
from ..errors import Conflict, ConnectionLost, DsecError, LimitExceeded, NotFound
from ..unixsock import default_socket
from .conn import _Budget, _Conn, _NotFrames, _Pending, _Unsent
from .ops import (
    CHANGES_NOTHING,
    IDEMPOTENT,
    KEYED,
    PROGRESS_FRAMES,
    SETTLED_WHEN_ABANDONED,
    _answer_error,
    _follows,
    _refused_in_flight,
    _sent_or_not,
)

# A server frame may exceed max_frame_bytes by its envelope (id, field names).
FRAME_SLACK = 4096
# Big-frame buffers a connection keeps for reuse (framing.FrameProtocol).
FRAME_BUFFERS_KEPT = 4
# Requests that steer others (stdin for an exec, a cancel) never wait for a
# slot: the requests they serve may hold every slot. This many of the
# daemon's per-connection limit are kept for them.
CONTROL_OPS = ("exec_input", "exec_resize", "exec_signal", "file_tar_input", "cancel")
CONTROL_SLOTS = 8
# Requests that follow something until it ends or they are closed (a
# watch, events, a background process's output): they may take all but
# this many of the other slots, so that they can never leave none for the
# requests that end them (a process's stdin, a destroy).
SHORT_SLOTS = 32
# A request the daemon refused for its in-flight limit is sent again after
# this long, doubled at each refusal up to the max.
REFUSED_AGAIN_S = 0.005
REFUSED_AGAIN_MAX_S = 0.2
# A create abandoned after it was sent (cancelled, timed out): how long the
# caller's cancel waits for the daemon's answer and, if the sandbox was made
# all the same, for its destroy (one or two round trips, normally).
ABANDONED_CREATE_WAIT_S = 10.0
# A lost connection is made again at the next request (reconnect=True):
# while the daemon does not answer (a restart: no socket, or refused), tries
# this far apart at first, doubled after each failure up to the max, for
# the Client's reconnect_timeout at most. A follow lost with nothing of it
# come waits the same gaps before it asks again (refollow.py reads them here).
RECONNECT_GAP_S = 0.05
RECONNECT_GAP_MAX_S = 1.0
# A local daemon that sends nothing while requests wait on it (stopped by
# SIGSTOP, state T; its event loop wedged) held them for ever: a unix
# socket does not time out. The Client gives its connection up after this
# long of such silence, its pings unanswered (_watch_silence; the Client's
# silence_timeout, DSEC_SILENCE_TIMEOUT). A busy daemon answers a ping from
# its event loop: during a 2,000-sandbox burst on a 2-core host, within
# 126-212 ms at most while creating, 424-520 ms while destroying them all
# (bench/ping_in_burst.py, 16 and 64 clients). 10 s is also how long a loop
# goes without turning before the daemon reports itself stalled
# (looplag.STALL_REPORT_S).
LOCAL_SILENCE_S = 10.0
# The pings sent in that window: one after each 1/LOCAL_PINGS of it.
LOCAL_PINGS = 5
# The most bytes of a followed background process's output (Process.output)
# a client holds for a reader that is behind: past it, what comes is
# dropped and counted, as the daemon's own ring (limits.proc_output_bytes,
# 1M by default) drops what a follower too slow for it missed.
FOLLOWED_OUTPUT_BYTES = 16 << 20

# The SDK's one logger, whichever of its modules logs: a caller's logging
# configuration names it.
log = logging.getLogger("dsecd.client")


def _who_may_connect(path: str) -> str:
    """What a refused user needs, from the socket's group (the daemon sets its
    mode 0660, group `daemon.socket_group`, and checks SO_PEERCRED the same way)."""
    try:
        gid = os.stat(path).st_gid
    except OSError:
        return (f"this user may not enter {os.path.dirname(path) or '.'}, where the socket is: "
                "run dsec as root")
    if gid == 0:
        return ("the daemon's socket admits root only: run dsec as root, or set daemon.socket_group "
                "in the daemon's config and join that group")
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return (f"the daemon's socket admits root and members of group {group!r} "
            f"(daemon.socket_group): run dsec as root, or `usermod -aG {group} USER` and log in again")


def local_silence_timeout(given: float | str | None = None) -> float:
    """The silence watch's window on a local socket (LOCAL_SILENCE_S): `given`
    (seconds, or a duration such as "30s"), else DSEC_SILENCE_TIMEOUT, else
    the default; 0 (or "off") turns the watch off."""
    what = "silence_timeout"
    if given is None:
        given, what = os.environ.get("DSEC_SILENCE_TIMEOUT") or None, "DSEC_SILENCE_TIMEOUT"
    if given is None:
        return LOCAL_SILENCE_S
    if given in (0, "0", "off"):
        return 0.0
    return parse_duration(given, f"{what} (0 or off: no watch)")


def _count_output(got: list[int], frame: dict) -> None:
    """Add a streamed exec's output frame to `got`, the bytes of [stdout,
    stderr] that came (a `lost` count included: the daemon takes the
    stream up after it)."""
    fd = frame.get("fd")
    if fd in (1, 2):
        got[fd - 1] += len(frame["data"]) if frame.get("data") is not None else frame.get("lost", 0)


class _Wire:
    """The base of Client: one daemon's connection (made again after a
    loss) and the requests on it. Client's docstring says what its
    arguments are; its requests (image, sandbox, job, ...) are built on
    `request`, `frames` and `frames_with_id`."""

    def __init__(self, target: str | None = None, name: str = "dsecd-sdk", connect_timeout: float = 30.0,
                 *, ssh: remote.SshOptions | None = None, reconnect: bool | None = None,
                 reconnect_timeout: float | None = None, silence_timeout: float | str | None = None):
        target = target or default_socket()
        self.remote = remote.is_remote(target)
        # Whether Sandbox.exec and exec_stream make an idempotency key for
        # an exec without stdin or pty given none (a streamed one where the
        # daemon lists "op.keys.stream"): over ssh://, where a link can drop
        # with its daemon up and the exec sent again is answered with its
        # one run (a streamed one's output taken up where it stopped). Not on a
        # local socket, nor through a Ray actor (whose connection is a local
        # socket on the daemon's node, dsecd/ray.py): a connection lost
        # there is a daemon that went, whose successor could only say the
        # exec's outcome is unknown, and each key costs the daemon a journal
        # write.
        self.key_execs = self.remote
        if self.remote:
            self._ssh_target = remote.SshTarget.parse(target)
            self.ssh = ssh or remote.SshOptions.from_env()
            self.target = self._ssh_target.url()
            self.socket_path = None
        else:
            self.socket_path = self.target = target
        self.name = name
        # How long connect() waits for the daemon's hello: a socket someone
        # holds open but nobody serves (a wedged daemon) must not hang a client.
        self.connect_timeout = connect_timeout
        self._reconnect_timeout = reconnect_timeout
        self.reconnect = True if reconnect is None else reconnect
        # Called with a reason as soon as a connection is lost (not when this
        # client closes it); dsecd.Fleet marks the host down from it.
        self.on_lost: Callable[[str], object] | None = None
        # What to do about a lost connection when this client does not
        # reconnect by itself, for whoever owns it (a Fleet, the CLI); None:
        # the SDK user's advice, connect() again.
        self.lost_advice: str | None = None
        self._last_frame_at = 0.0        # see last_frame_at
        self._ids = itertools.count(1)
        self._conn: _Conn | None = None
        self._reconnecting = asyncio.Lock()
        # When the next try to connect again may start, how far apart tries
        # are, and why the last one failed (see _connection).
        self._reconnect_at = 0.0
        self._reconnect_gap = RECONNECT_GAP_S
        self._reconnect_error: ConnectionError | None = None
        self._closed = False
        self._undoing: set[asyncio.Task] = set()      # destroys of what cancelled creates made
        # The keys of creates in flight (key -> how many), and of those being
        # undone (key -> a create of it was sent again meanwhile): see
        # _settle_abandoned_create.
        self._keyed_creates: collections.Counter[str] = collections.Counter()
        self._undone_keys: dict[str, bool] = {}
        self.server: dict = {}
        self.max_frame = 16 << 20
        # (interval s, count): with requests waiting, a ping after `interval`
        # s of silence, and the connection given up after interval x count
        # with nothing come (_watch_silence). Over ssh:// ssh's own keepalive
        # settings: a connection shared through ControlMaster rides on a
        # master that ssh's -o options never reach. On a local socket,
        # `silence_timeout` (local_silence_timeout) in LOCAL_PINGS
        # intervals: the socket never fails, but its daemon may stop
        # answering (SIGSTOPped, wedged). None: no watch.
        if self.remote:
            self.keepalive: tuple[float, int] | None = (max(1, self.ssh.keepalive_s),
                                                        max(1, self.ssh.keepalive_count))
        else:
            window = local_silence_timeout(silence_timeout)
            self.keepalive = (window / LOCAL_PINGS, LOCAL_PINGS) if window else None

    def __repr__(self) -> str:
        return f"<Client {self.target}>"

    @property
    def reconnect_timeout(self) -> float:
        """How long requests wait for a daemon that went to answer again
        (connect_timeout unless given)."""
        return self.connect_timeout if self._reconnect_timeout is None else self._reconnect_timeout

    @reconnect_timeout.setter
    def reconnect_timeout(self, seconds: float | None) -> None:
        self._reconnect_timeout = seconds

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.lost is None

    @property
    def _tails(self) -> bool:
        return self._conn is not None and self._conn.tails

    async def connect(self) -> None:
        """Open the connection and say hello (again, after a loss or close)."""
        if self.connected:
            return
        self._closed = False
        if self._conn is not None:          # the lost one: its ssh and reader go first
            await self._drop(self._conn, grace=0)
        loop = asyncio.get_running_loop()
        conn = await (self._open_ssh() if self.remote else self._open_unix())
        conn.reader = loop.create_task(self._read_loop(conn))
        try:
            # Other requests see the connection only once its hello is done:
            # the daemon takes nothing before it.
            async with asyncio.timeout(self.connect_timeout):
                self.server = await self._hello(conn)
        except TimeoutError:
            await self._drop(conn, grace=0)
            if conn.link is not None:
                # ssh's own connect and login are in this wait: the host
                # may never have taken a connection at all.
                raise ConnectionError(
                    f"dsecd at {self.target} did not answer in {self.connect_timeout:g} s (ssh's connect and "
                    f"login, then the daemon's hello): check that `{conn.link.check_command()}` answers "
                    "quickly and that the host's daemon runs") from None
            raise ConnectionError(f"dsecd at {self.target} took the connection but did not answer in "
                                  f"{self.connect_timeout:g} s: is the daemon stuck?") from None
        except ConnectionLost as err:        # ssh could not log in, or found no dsec there
            # The reader says why once ssh has exited (its status, its stderr).
            await asyncio.wait([conn.reader], timeout=2 * remote.EXIT_WAIT_S)
            await self._drop(conn, grace=0)
            raise ConnectionError(f"cannot reach dsecd at {self.target}: {conn.lost or err}") from None
        except BaseException:
            # Cancelled (a caller's timeout), or any other failure: nothing of
            # this connection may stay, an ssh process and its pipes least of all.
            await asyncio.shield(self._drop(conn, grace=0))
            raise
        if conn.link is not None:
            conn.link.established = True
        limits = self.server.get("limits", {})
        self.max_frame = limits.get("max_frame_bytes", self.max_frame)
        conn.frames.max_frame = self.max_frame + FRAME_SLACK
        conn.tails = "frame.tail" in self.server.get("capabilities", ())
        cap = limits.get("max_requests_per_client", 256)
        conn.slots = _Budget(max(2, cap - CONTROL_SLOTS))
        conn.follows = _Budget(max(1, cap - CONTROL_SLOTS - SHORT_SLOTS))
        self._conn = conn
        if self.keepalive is not None:
            conn.watchdog = loop.create_task(self._watch_silence(conn, *self.keepalive))

    async def _watch_silence(self, conn: _Conn, interval: float, count: int) -> None:
        """Give `conn` up once requests wait on it and nothing came through
        it for interval x count s, a ping sent after each `interval` of that
        silence unanswered: a link that stalled, a host that stopped
        answering, a local daemon stopped (SIGSTOP) or wedged. ssh's
        ServerAliveInterval does this for its own connection, but not for
        one shared through ControlMaster (the master's keepalives are the
        master's settings; without them a request waits for TCP to give
        up, or for ever when nothing is being sent); a unix socket never
        gives up. Progress counts either way: bytes come (of a frame
        complete or not, a ping's answer among them), or our bytes still
        leave (an upload on a slow link, which a ping waits behind). And
        only silence after a ping that went unanswered for an interval
        counts: a request the daemon has nothing to say about for minutes
        (a quiet exec, a follow) is no silence while it answers the
        pings, nor is a wake made late by this loop's own delay (a caller
        that blocked it) before a ping was asked."""
        loop = asyncio.get_running_loop()
        transport = conn.writer.transport
        quiet_since = loop.time()
        unsent = transport.get_write_buffer_size()
        pinged_at: float | None = None          # the first ping of this silence, unanswered
        while conn.lost is None and self._conn is conn:
            await asyncio.sleep(interval)
            now = loop.time()
            left = transport.get_write_buffer_size()
            if not conn.pending or left < unsent:
                quiet_since = now                   # nothing waits, or ours still leaves
            unsent = left
            heard = max(quiet_since, self.last_frame_at)
            if pinged_at is not None and heard >= pinged_at:
                pinged_at = None                    # answered, or the silence ended otherwise
            silent = now - heard
            if silent >= interval * count and pinged_at is not None and now - pinged_at >= interval:
                reason = self._silence_reason(conn, silent)
                self.abort_now(reason)
                if self.on_lost is not None:
                    with contextlib.suppress(Exception):
                        self.on_lost(reason)
                return
            if silent >= interval and not transport.is_closing():
                # Its answer is no one's (no pending entry): it only makes bytes come.
                transport.writelines(self._encode(conn, self.new_id(), "ping", {}))
                if pinged_at is None:
                    pinged_at = now

    def _silence_reason(self, conn: _Conn, silent: float) -> str:
        """Why _watch_silence gave `conn` up, and what to look at."""
        if self.remote:
            return (f"nothing came from {self.target} for {silent:.0f} s with requests waiting, "
                    "pings unanswered: the link stalled or the host stopped answering; check that "
                    "it is up and reachable (over a ControlMaster connection, the master's "
                    "ServerAliveInterval applies, not ours)")
        pid = conn.peer_pid
        which = f"dsecd (pid {pid})" if pid else "dsecd"
        status = f"/proc/{pid}/status" if pid else "/proc/PID/status"
        return (f"the daemon at {self.socket_path} sent nothing for {silent:.3g} s with requests waiting, "
                f"pings unanswered: is {which} stopped (State: T in {status}; `kill -CONT {pid or 'PID'}` "
                "resumes it) or its event loop wedged (its log reports a loop that has not turned)? "
                "The window is the Client's silence_timeout (DSEC_SILENCE_TIMEOUT, dsec --silence-timeout; "
                "0 turns the watch off)")

    async def _hello(self, conn: _Conn) -> dict:
        args = {"protocol": protocol.PROTOCOL_VERSION, "client": self.name}
        async with contextlib.aclosing(self._frames_with_id(conn, self.new_id(), "hello", args, None)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return frame["__result__"]
        raise ConnectionError("hello: no final frame")

    def _frame_protocol(self) -> framing.FrameProtocol:
        return framing.FrameProtocol(self.max_frame + FRAME_SLACK, recycle=FRAME_BUFFERS_KEPT)

    async def _open_unix(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            transport, frames = await loop.create_unix_connection(self._frame_protocol, self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            raise ConnectionError(f"cannot connect to dsecd at {self.socket_path}: {err.strerror}; "
                                  "is the daemon running? (set DSEC_SOCKET or --socket)") from err
        except PermissionError as err:
            raise ConnectionError(f"cannot connect to dsecd at {self.socket_path}: permission denied; "
                                  f"{_who_may_connect(self.socket_path)}") from err
        conn = _Conn(asyncio.StreamWriter(transport, frames, None, loop), frames, None)
        with contextlib.suppress(OSError, AttributeError):
            conn.peer_pid = unixsock.peer_credentials(transport.get_extra_info("socket"))[0] or None
        return conn

    async def _open_ssh(self) -> _Conn:
        link = remote.SshLink(self._ssh_target, self.ssh)
        transport, frames = await link.open(self._frame_protocol)
        return _Conn(asyncio.StreamWriter(transport, frames, None, asyncio.get_running_loop()), frames, link)

    async def close(self) -> None:
        """Close the connection: an ssh:// one ends after the host answered
        what was sent (ssh is killed if it has not exited 2 s later)."""
        if self._conn is not None and self._conn.pid != os.getpid():
            # A forked child's copy: the connection is its parent's to close.
            self._conn, self._closed = None, True
            return
        if self._undoing:
            # What a request given up on left to undo (a cancelled create's
            # sandbox, a block's destroy) goes first, over this connection:
            # an undo may be waiting up to reconnect_timeout for a restarted
            # daemon before its own round trip.
            await asyncio.wait(set(self._undoing), timeout=self.reconnect_timeout + ABANDONED_CREATE_WAIT_S)
        self._closed = True
        if self._conn is not None:
            await self._drop(self._conn)

    @property
    def last_frame_at(self) -> float:
        """Loop time bytes last came from the daemon, of a frame complete or
        not: the host is alive (dsecd.Fleet's heartbeat). A frame of
        megabytes (an exec's output, a file's chunk) takes seconds on a
        slow link, all of them signs of life."""
        conn = self._conn
        return max(self._last_frame_at, conn.frames.bytes_at if conn is not None else 0.0)

    @last_frame_at.setter
    def last_frame_at(self, at: float) -> None:
        self._last_frame_at = at

    def abort_now(self, reason: str) -> _Conn | None:
        """End the connection now (dsecd.Fleet, for a host that stopped
        answering): from this moment the client is not connected, and the
        requests in flight fail with ConnectionLost(reason) as soon as the
        reader sees the end. The connection to drop (see abort), if any."""
        conn = self._conn
        if conn is None or conn.lost is not None:
            return None
        conn.lost = ConnectionError(reason)
        if conn.link is not None:
            conn.link.aborted = reason
            conn.link.kill()
        conn.writer.transport.abort()
        return conn

    async def abort(self, reason: str) -> None:
        """abort_now, then wait until the requests in flight have failed and
        the connection (and its ssh) is gone; the next request (with
        `reconnect`, the default) or a later connect() connects again."""
        conn = self.abort_now(reason)
        if conn is None:
            return
        if conn.reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(conn.reader), remote.EXIT_WAIT_S * 2)
        await self._drop(conn, grace=0)

    async def _drop(self, conn: _Conn, grace: float = remote.CLOSE_GRACE_S) -> None:
        if conn.watchdog is not None:
            conn.watchdog.cancel()
        conn.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await conn.writer.wait_closed()
        if conn.reader is not None and not conn.reader.done():
            if conn.link is not None and grace:
                # Our end closed: ssh ends once the host answered what was sent.
                with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(conn.reader), grace)
            conn.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await conn.reader
        if conn.link is not None:
            await conn.link.close(grace)

    async def _read_loop(self, conn: _Conn) -> None:
        error: BaseException = ConnectionError("dsecd closed the connection")
        loop = asyncio.get_running_loop()
        cancelled = False
        try:
            while True:
                try:
                    payload = await conn.frames.read_payload()
                except framing.FrameTooBig as err:
                    if conn.link is not None:
                        raise _NotFrames(
                            f"{self.target} sent bytes that are not dsecd frames (a header announcing "
                            f"{err.size} bytes); does a shell start-up file on that host print to stdout?") from None
                    if self._conn is not conn:
                        # Before the hello's answer: no daemon sends a first
                        # frame this big, so another program serves the socket
                        # (an HTTP server's b"HTTP" reads as 1.2 GB).
                        raise _NotFrames(
                            f"it answered with bytes that are not dsecd frames (they begin "
                            f"{framing.HEADER.pack(err.size)!r}): is {self.target} another program's socket? "
                            "(set DSEC_SOCKET or --socket to dsecd's)") from None
                    raise LimitExceeded(f"server frame of {err.size} bytes exceeds the limit") from None
                if payload is None:
                    # After close() the stream ends as ssh exits, as when the daemon goes.
                    error = ConnectionError("the client closed it" if self._closed else "the daemon closed it")
                    break
                self.last_frame_at = loop.time()
                try:
                    frame = protocol.decode_payload(payload)
                except Exception as err:
                    raise _NotFrames(f"{self.target} sent a frame that does not decode ({err})") from None
                rid = frame.get("id")
                if rid is None and "error" in frame:
                    error = DsecError.from_wire(frame["error"])
                    break
                pending = conn.pending.get(rid)
                if pending is not None:
                    pending.put(frame)
        except _NotFrames as err:
            error = ConnectionError(str(err))
            conn.garbled = True
        except (asyncio.IncompleteReadError, ConnectionError) as err:
            error = ConnectionError(str(err))
        except asyncio.CancelledError:
            # Not by close() nor a reconnect (which set conn.lost first): the
            # loop is ending with the connection open (asyncio.run returning).
            error = ConnectionError("the client closed it" if self._closed else
                                    "the event loop it was connected in ended (a Client serves the loop "
                                    "it connected in)")
            cancelled = True
        except Exception as err:
            error = err
        # Set before anything awaits: a request that starts now fails (or
        # reconnects) at once instead of waiting on a dead connection. An
        # abort's reason, set first, is the one that is true.
        error = conn.lost = conn.lost or error
        conn.writer.close()
        if cancelled and conn.link is not None:
            # The connection is given up: by _drop (close()'s grace ran out,
            # an abort, a failed connect), or by asyncio.run() ending with
            # the client still open. Only closing our end would half-close
            # the remote relay, which then runs what was sent to its end; a
            # dead ssh ends its session, and the daemon cancels this
            # client's requests and kills its execs, as it does when a
            # local client's socket closes.
            conn.link.kill()
            with contextlib.suppress(Exception):
                await conn.link.close(remote.EXIT_WAIT_S)   # reaped while the loop still runs
        if not cancelled and not self._closed and not (conn.link and conn.link.aborted):
            if conn.link is not None and not isinstance(error, DsecError) and not conn.garbled:
                # ssh's exit status and last words say what went wrong (a
                # daemon that went, a link cut): read before on_lost is told,
                # so that its reason (a fleet's host_down) is that, not the
                # end of the socket pair that both look like here.
                error = conn.lost = ConnectionError(await conn.link.why_ended())
            if self.on_lost is not None:
                with contextlib.suppress(Exception):
                    self.on_lost(str(error))
        for pending in conn.pending.values():
            pending.queue.put_nowait({"__lost__": error})

    def _lost_error(self, cause: BaseException, op: str, sent: bool, key: str | None = None) -> BaseException:
        """What a request raises when its connection is gone: the daemon's own
        error (a connection-level `limit`, say) as it is, else ConnectionLost.
        `key`: the request's idempotency key, if it went with one."""
        if isinstance(cause, DsecError):
            return cause
        text = f"{op} on {self.target}: connection lost: {cause}" + _sent_or_not(op, sent, key)
        if self._closed:
            pass
        elif self.lost_advice:
            # Its owner's words: `dsec --host` sends no next request to connect again.
            text += f"; {self.lost_advice}"
        elif self.reconnect:
            text += "; the next request connects again"
        else:
            text += "; call connect() again (or make the Client with reconnect=True) to go on"
        return ConnectionLost(text, target=self.target, op=op, sent=sent)

    async def _connection(self, op: str, deadline: float | None = None, sent: bool = False,
                          key: str | None = None) -> _Conn:
        """The live connection; after a loss, a new one if `reconnect`,
        waiting for the daemon to answer again until `deadline` (loop time;
        default: reconnect_timeout from now). `sent`: the request was sent on
        a connection lost since (it is to go again), for the error, as its
        idempotency `key`."""
        conn = self._conn
        if conn is not None and conn.pid != os.getpid():
            # Its frames would interleave with the parent's on the one socket.
            raise RuntimeError(f"{op} on {self.target}: this Client was connected in process {conn.pid}; a "
                               "process forked from it (a multiprocessing Pool, say) cannot share its "
                               "connection: make a Client in the child")
        if conn is not None and conn.loop.is_closed() and conn.lost is None:
            # Its loop was closed without closing it (asyncio.run would have
            # cancelled its reader, which says so): nothing reads its answers.
            self._conn = None
            raise ConnectionError(f"{op} on {self.target}: this Client's connection was made in an event loop "
                                  "that was closed without closing the Client; call connect() again (or use "
                                  "`async with`, which closes it with its loop)")
        if conn is not None and conn.loop is not asyncio.get_running_loop() and not conn.loop.is_closed():
            # Its answers would go to futures of a loop that nobody wakes for them: a hang.
            raise RuntimeError(f"{op} on {self.target}: this Client is connected in another event loop, "
                               "the only one that may use it; share a dsecd.SyncClient among threads, "
                               "or make a Client per event loop")
        if conn is not None and conn.lost is None:
            return conn
        if conn is None:
            raise ConnectionError(f"{op}: not connected to dsecd at {self.target}: call connect() first "
                                  "(or use `async with`)")
        # A reconnect must not cancel the reader before it has told on_lost.
        await self._reason(conn)
        if not self.reconnect or self._closed:
            raise self._lost_error(conn.lost, op, sent=sent, key=key)
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.reconnect_timeout
        try:
            async with asyncio.timeout_at(deadline), self._reconnecting:
                # One request at a time tries; the others wait here for its
                # connection. A daemon that is restarting has no socket, or
                # refuses, for a while: tried again, further apart each time.
                while self._conn is conn and not self._closed:
                    wait = self._reconnect_at - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    try:
                        await self.connect()
                    except ConnectionError as err:
                        self._reconnect_error = err
                        if isinstance(err.__cause__, PermissionError):
                            raise       # not one that time mends
                        self._reconnect_gap = min(2 * self._reconnect_gap, RECONNECT_GAP_MAX_S)
                        self._reconnect_at = loop.time() + self._reconnect_gap
                    else:
                        self._reconnect_gap = RECONNECT_GAP_S
                        self._reconnect_at = 0.0
                        self._reconnect_error = None
        except TimeoutError:
            why = f" (last: {self._reconnect_error})" if self._reconnect_error is not None else ""
            raise ConnectionLost(
                f"{op} on {self.target}: connection lost: {conn.lost}; the daemon did not answer again within "
                f"{self.reconnect_timeout:g} s (the Client's reconnect_timeout){why}"
                + _sent_or_not(op, sent, key),
                target=self.target, op=op, sent=sent) from None
        conn = self._conn
        if self._closed or conn is None or conn.lost is not None:
            raise self._lost_error(conn.lost if conn else ConnectionError("closed"), op, sent=sent, key=key)
        return conn

    @staticmethod
    async def _reason(conn: _Conn) -> None:
        """Wait (a second at most) for the reader of a connection that ended
        to say why in conn.lost: over ssh it reads ssh's exit status and
        last words first. A request failing meanwhile (a fleet's heartbeat,
        whose error is the host_down reason) fails with that, not with the
        bare end of the stream or a write that failed."""
        if conn.reader is not None and not conn.reader.done():
            await asyncio.wait([conn.reader], timeout=2 * remote.EXIT_WAIT_S)

    def _encode(self, conn: _Conn, rid: int, op: str, args: dict) -> tuple[bytes, ...]:
        """The request's frame as sent. An argument msgpack cannot pack (a
        datetime.timedelta, a set) is a TypeError naming the request."""
        frame = {"id": rid, "op": op, "args": args}
        try:
            if conn.tails:
                return protocol.encode_tailed_request(frame, self.max_frame)
            return protocol.encode_frame_parts(frame, self.max_frame)
        except TypeError as err:
            raise TypeError(f"{op}: {err}: arguments go as str, bytes, int, float, bool, None and lists and "
                            "dicts of them (a duration: seconds, or a string such as \"5m\")") from None

    async def _send(self, conn: _Conn, parts: tuple[bytes, ...]) -> None:
        if conn.writer.is_closing():
            raise ConnectionError("not connected to dsecd")
        conn.writer.writelines(parts)
        await conn.writer.drain()

    def new_id(self) -> int:
        return next(self._ids)

    def frames(self, op: str, **args) -> AsyncIterator[dict]:
        """Send one request; yield its stream payloads; the final result is yielded
        last as {"__result__": result}. Errors are raised."""
        return self.frames_with_id(self.new_id(), op, args)

    async def frames_with_id(self, rid: int, op: str, args: dict,
                             sent: asyncio.Event | None = None) -> AsyncIterator[dict]:
        # A request that never left this client (it waited for a slot, or
        # was refused for the in-flight limit, when its connection was lost)
        # never reached the daemon: it goes on the next connection, once the
        # daemon answers again (reconnect_timeout from its first loss at most).
        # One that was written may have run and is not sent again, unless
        # sending it again is safe and nothing of its answer had come: one
        # that changes nothing (CHANGES_NOTHING), or a create with an
        # idempotency key (the daemon journals the key: the create it made
        # before the loss, if any, is the answer; likewise an exec's result,
        # a process started, a snapshot made: KEYED), or a pause or resume
        # (IDEMPOTENT). Once: lost again, the daemon may be failing on it.
        # A keyed streamed exec goes again after each loss that a frame came
        # before (output, or the daemon's `resumed` once it took it up
        # again), from the bytes of output that came (`stream_from`): the
        # daemon sends the rest, and answers `lost` for what it no longer has.
        key = args.get("key") if op in KEYED else None
        # A proc_input at an offset: the daemon skips what of it it wrote before.
        again_safe = (op in CHANGES_NOTHING or op in IDEMPOTENT or bool(key)
                      or (op == "proc_input" and args.get("offset") is not None))
        got = [0, 0] if op == "exec" and key and args.get("stream") else None
        deadline = None
        resent = False
        while True:
            conn = await self._connection(op, deadline, sent=resent, key=key)
            came = False
            try:
                # aclosing: a caller that stops early (break, cancel) closes the
                # inner generator at once, so the daemon is told to cancel the
                # request now.
                async with (self._slots_held(conn, op, args),
                            contextlib.aclosing(self._frames_with_id(conn, rid, op, args, sent)) as frames):
                    async for frame in frames:
                        came = True
                        if got is not None:
                            _count_output(got, frame)
                        yield frame
                return
            except _Unsent as err:
                if not self.reconnect or self._closed:
                    raise self._lost_error(err.cause, op, sent=False) from None
            except ConnectionLost:
                if got is not None and came and self.reconnect and not self._closed:
                    # A frame came since it was sent: the daemon was serving it.
                    args = {**args, "stream_from": list(got)}
                    deadline = None
                elif ((came and op not in PROGRESS_FRAMES) or resent or not again_safe or not self.reconnect
                        or self._closed):
                    raise
                resent = True
            except DsecError as err:
                if not (resent and err.detail.get("outcome") == "unknown"):
                    raise
                # Sent again to a daemon that followed the one it was sent
                # to: that one began it and stopped before its end.
                raise ConnectionLost(f"{op} on {self.target}: connection lost after it was sent; the request "
                                     f"may have been carried out: the daemon that answered again says: "
                                     f"{err.message}", target=self.target, op=op, sent=True) from None
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.reconnect_timeout

    @contextlib.asynccontextmanager
    async def _slots_held(self, conn: _Conn, op: str, args: dict) -> AsyncIterator[None]:
        """The in-flight slots a request holds on `conn` while it runs (none
        for a control op, or a daemon that sets no limit)."""
        slots = conn.slots
        if slots is None or op in CONTROL_OPS:
            yield
            return
        # Queued here past the daemon's in-flight limit; an exec with stdin
        # also holds the slot of its exec_input requests, a pty exec that of
        # its exec_resize requests too, a directory copy in that of its
        # file_tar_input requests.
        units = (1 + bool(op == "exec" and args.get("stdin")) + bool(op == "exec" and args.get("pty"))
                 + bool(op == "file_tar_put"))
        follows = conn.follows if _follows(op, args) else None
        if follows is not None:
            await follows.acquire(1)
        try:
            await slots.acquire(units)
            try:
                yield
            finally:
                slots.release(units)
        finally:
            if follows is not None:
                follows.release(1)

    async def _frames_with_id(self, conn: _Conn, rid: int, op: str, args: dict,
                              sent: asyncio.Event | None) -> AsyncIterator[dict]:
        if conn.lost is not None:
            raise _Unsent(conn.lost, self.target, op)
        # A background process's output, followed, comes as fast as the
        # process writes it; the rest is bounded by its request (without
        # follow, by the daemon's ring).
        followed = op == "proc_logs" and args.get("follow", False)
        pending = conn.pending[rid] = _Pending(FOLLOWED_OUTPUT_BYTES if followed else None)
        finished = False
        on_wire = False
        key = args.get("key") if op == "create" else None
        if key:
            self._keyed_create_sent(key)

        async def send() -> None:
            try:
                await self._send(conn, parts)
            except ConnectionError as err:
                await self._reason(conn)
                raise self._lost_error(conn.lost or err, op, sent=True, key=args.get("key")) from None

        try:
            # Packed before anything is sent: a request that cannot be fails
            # here, with nothing to cancel or wait for.
            parts = self._encode(conn, rid, op, args)
            # Once _send starts, the frame is in the transport's buffer (only
            # its drain awaits): a cancel from here on finds it sent.
            on_wire = True
            await send()
            if sent is not None:
                sent.set()
            again = REFUSED_AGAIN_S
            while True:
                frame = await pending.get()
                if "__lost__" in frame:
                    raise self._lost_error(frame["__lost__"], op, sent=True, key=args.get("key"))
                if "stream" in frame:
                    yield frame["stream"]
                    continue
                if "error" in frame and sent is None and _refused_in_flight(frame["error"]):
                    # Nothing ran: the daemon still counted answers this
                    # client has read (they were draining). Send it again;
                    # meanwhile it is not in flight, so there is nothing to
                    # cancel or undo. (Not one that others follow on the
                    # wire, `sent`: an exec's stdin would find no exec. A
                    # chunk of input is: the SDK's feeders await each
                    # chunk's answer before the next, so it overtakes none.
                    # Process.write's inputs do not wait: one sent after
                    # this one may come first, and Process._input sends
                    # it again once this one ended.)
                    on_wire = False
                    await asyncio.sleep(again)
                    if conn.lost is not None:       # gone meanwhile: it never ran
                        raise _Unsent(conn.lost, self.target, op)
                    again = min(2 * again, REFUSED_AGAIN_MAX_S)
                    on_wire = True
                    await send()
                    continue
                finished = True
                if "error" in frame:
                    raise _answer_error(frame["error"], op, args)
                yield {"__result__": frame.get("result", {})}
                return
        finally:
            abandoned = not finished and conn.lost is None and not conn.writer.is_closing()
            # An abandoned create keeps its entry: its final frame may still
            # come (the daemon finished it before the cancel landed), and what
            # it made must then be destroyed.
            undo = abandoned and on_wire and op == "create"
            settle = abandoned and on_wire and op in SETTLED_WHEN_ABANDONED
            if not (undo or settle):
                conn.pending.pop(rid, None)
            if key:
                self._keyed_create_ended(key, undo)
            if abandoned and on_wire:
                # Abandoned early (break, exception, cancel): tell the daemon to stop it.
                try:
                    await self._send(conn, self._encode(conn, next(self._ids), "cancel", {"target": rid}))
                except (ConnectionError, DsecError):
                    pass
            if undo:
                await self._undo_abandoned(self._settle_abandoned_create(conn, rid, pending, key))
            elif settle:
                await self._undo_abandoned(self._settle_abandoned(conn, rid, pending, op, args))

    async def _undo_abandoned(self, settle) -> None:
        """Run `settle`, the undo of a request the caller gave up on (a
        cancel, a timeout) after it was sent, waiting for it up to
        ABANDONED_CREATE_WAIT_S (the caller's cancel goes on after that;
        the undo goes on in the background, and close() waits for it)."""
        task = asyncio.get_running_loop().create_task(settle)
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)
        await asyncio.wait([task], timeout=ABANDONED_CREATE_WAIT_S)

    async def _settle_abandoned(self, conn: _Conn, rid: int, pending: _Pending, op: str, args: dict) -> None:
        """An abandoned request of SETTLED_WHEN_ABANDONED: its final frame
        waited for; a background process it started all the same is killed."""
        try:
            while "stream" in (frame := await pending.queue.get()):
                pass
        finally:
            conn.pending.pop(rid, None)
        if op == "proc_start" and "result" in frame:
            await self._kill_started_for_nobody(args["sandbox"], frame["result"])

    async def _kill_started_for_nobody(self, sandbox: str, info: dict) -> None:
        """Kill the background process a cancelled proc_start started (`info`: its answer)."""
        try:
            await self.request("proc_kill", sandbox=sandbox, pid=info["pid"], signal="KILL")
            log.info("proc_start on %s was cancelled after the daemon started pid %s in sandbox %s: killed it",
                     self.target, info["pid"], sandbox)
        except (NotFound, Conflict):
            pass                            # gone, or ended, already
        except (DsecError, ConnectionError) as err:
            log.warning("proc_start on %s was cancelled after the daemon started pid %s in sandbox %s, and "
                        "killing it failed (%s): `dsec kill %s %s` ends it", self.target, info["pid"], sandbox,
                        err, sandbox, info["pid"])

    async def _settle_abandoned_create(self, conn: _Conn, rid: int, pending: _Pending, key: str | None) -> None:
        try:
            while "stream" in (frame := await pending.queue.get()):
                pass
        finally:
            conn.pending.pop(rid, None)
            asked_again = self._asked_again(key)
        # Lost: nobody can tell here (the caller was told ConnectionLost, sent:
        # a create with its key sent again finds what it made). An error: nothing was made.
        if "__lost__" in frame or "error" in frame or asked_again:
            return
        await self._destroy_made_for_nobody(frame.get("result") or {})

    def _keyed_create_sent(self, key: str) -> None:
        """A create with idempotency key `key` is on its way (see _asked_again)."""
        self._keyed_creates[key] += 1
        if key in self._undone_keys:
            self._undone_keys[key] = True

    def _keyed_create_ended(self, key: str, undo: bool) -> None:
        """That create ended; `undo`: abandoned, what it made is to be destroyed."""
        self._keyed_creates[key] -= 1
        if not self._keyed_creates[key]:
            del self._keyed_creates[key]
        if undo:
            self._undone_keys[key] = self._undone_keys.get(key, False) or key in self._keyed_creates

    def _asked_again(self, key: str | None) -> bool:
        """Whether a create of `key` was sent while an abandoned one of it was
        under way (the caller's retry): it is, or will be, answered with what
        the abandoned one made, which is then not nobody's. Asked once, by
        that create's undo."""
        return key is not None and (self._undone_keys.pop(key, False) or key in self._keyed_creates)

    async def _destroy_made_for_nobody(self, info: dict) -> None:
        """Destroy the sandbox a cancelled create made (`info`: its answer),
        unless it made none or answered with the sandbox of an earlier
        create of its key, which is not this one's to undo."""
        if not info.get("id") or info.get("existing"):
            return
        try:
            await self.request("destroy", sandbox=info["id"], force=True)
            log.info("create on %s was cancelled after the daemon made sandbox %s: destroyed it",
                     self.target, info["id"])
        except NotFound:
            pass
        except (DsecError, ConnectionError) as err:
            log.warning("create on %s was cancelled after the daemon made sandbox %s, and destroying it failed "
                        "(%s): remove it with `dsec rm --force %s`", self.target, info["id"], err, info["id"])

    async def request(self, op: str, **args) -> dict:
        async with contextlib.aclosing(self.frames(op, **args)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return frame["__result__"]
        raise ConnectionError(f"{op}: no final frame")

    async def _with_progress(self, op: str, args: dict, progress: Callable[[dict], None] | None) -> dict:
        """A streamed request whose frames are {"progress": ...} until its result."""
        async with contextlib.aclosing(self.frames(op, **args)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return frame["__result__"]
                if progress and "progress" in frame:
                    progress(frame["progress"])
        raise ConnectionError(f"{op}: no final frame")


def _reconnects(client) -> bool:
    """Whether `client` connects again after a loss (a Client made with
    reconnect, not closed): a request it lost may go again on it."""
    return bool(getattr(client, "reconnect", False)) and not getattr(client, "_closed", True)


async def _cancel(client, rid: int) -> None:
    """Cancel request `rid`, whose input failed: its source's own error is
    raised once the request has ended."""
    with contextlib.suppress(DsecError, ConnectionError):
        await client.request("cancel", target=rid)
