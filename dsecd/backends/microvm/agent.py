"""The host's end of a guest agent's channel (csrc/guest/agent.c), on asyncio.

The channel is reached through a `Transport`: today `ChardevTransport`, the
unix socket QEMU serves for the guest's virtio-serial port (this host has no
vhost-vsock; a vsock transport would only need another `open`). One reader
task per link splits frames (wire.py) and routes each by id: to the future of
a file request, or to the event queue of an exec (STARTED, OUT, EXITED, ERR).
When the channel closes (QEMU exited, the guest died) every waiter fails
with AgentGone.

The guest is untrusted: root in it can take the agent's end of the channel
(its fd, through pidfd_getfd or ptrace) and write anything. Whatever it
writes costs the host at most one frame of wire.MAX_GUEST_FRAME; bytes that
are no frame of the format end the channel and call `on_broken`, which ends
the VM (MicroVMBackend.connect_agent): a VM whose agent cannot be reached
serves nothing, and must not stay "running".
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import time
from collections.abc import Callable

from ... import native
from ...onloop import on_loop
from . import wire

log = logging.getLogger(__name__)


class AgentGone(ConnectionError):
    """The channel to the guest agent closed: the VM is gone or going."""


class AgentError(OSError):
    """The agent answered an error: `errno` and `step`, what failed in the
    guest ("exec", "chdir", "open", ...), read like a NativeError's step by
    dsecd.errors.exec_error."""

    def __init__(self, err: int, step: str):
        # An exec's last steps are named as dsec-init's: the same hints (E2BIG, ETXTBSY, ...).
        what = native.describe_errno(step, err) if step in ("chdir", "exec") else os.strerror(err)
        super().__init__(err, f"{what} (guest agent, at {step})")
        self.step = step


class Transport:
    """How the host reaches a guest agent: open() gives an asyncio stream pair."""

    async def open(self, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        raise NotImplementedError


class ChardevTransport(Transport):
    """The unix socket of QEMU's `-chardev socket,server=on` behind the
    guest's virtserialport named dsec.agent."""

    def __init__(self, path: str):
        self.path = path

    async def open(self, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                return await asyncio.open_unix_connection(self.path, limit=1 << 26)
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise AgentGone(f"no agent channel at {self.path} after {timeout:.0f}s") from None
                await asyncio.sleep(0.02)


# How far an exec's output may run ahead of its consumer (wire.EXEC_WINDOW):
# the agent stops reading the process's pipes once it has sent this many
# bytes the daemon's consumer has not taken (next_event), so the process
# blocks on its write, as a container's does when its client is slow. It
# bounds what one exec holds in the daemon (and the host enforces it:
# _route); 4 of the agent's 64 KiB reads keep a fast client's stream full
# across the credit's round trip through the guest (bench/microvm.py
# --exec-output). Credit goes back once a quarter of it was taken.
OUTPUT_WINDOW = 256 << 10


class AgentExec:
    """One exec in the guest: its events, in order, from `next_event()`:
    ("started", pid), ("out", fd, bytes), ("exited", wait status),
    ("error", AgentError) for a start that failed, ("gone", AgentGone).
    `taken` is set while no stdin it was sent waits in the agent.

    `window`: its output flow control (OUTPUT_WINDOW; 0 with an agent too
    old for it). Output the consumer takes from next_event is credited back
    to the agent, which sends at most `window` bytes past it."""

    def __init__(self, link: AgentLink, exec_id: int, window: int = 0):
        self.link, self.id = link, exec_id
        self.events: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.ended = False          # EXITED, ERR or the channel's end came: no TAKEN will
        self.taken = asyncio.Event()
        self.taken.set()
        # Why the host ended it, if it did on its own (not its consumer):
        # "pause" (MicroVMService.pause); its consumer says so.
        self.stopped_by: str | None = None
        self.over = asyncio.Event()     # set with `ended`
        self._stdin_lock = asyncio.Lock()      # exec_input requests in the order they came
        self.window = window
        self.received = 0           # OUT data bytes routed to `events`
        self.consumed = 0           # of which next_event handed out
        self.credited = 0           # the count the agent was last sent (CREDIT)
        # Clear while an agent without windows has sent more than
        # OUTPUT_WINDOW unconsumed: the link's reader waits on it.
        self.room = asyncio.Event()
        self.room.set()

    async def next_event(self) -> tuple:
        """The next event; output taken here is what the agent gets credit for."""
        ev = await self.events.get()
        if ev[0] == "out":
            self._consumed(len(ev[2]))
        return ev

    def backlog(self) -> int:
        """Output bytes received and not yet taken by next_event."""
        return self.received - self.consumed

    def _consumed(self, n: int) -> None:
        self.consumed += n
        if not self.window:
            if self.backlog() <= OUTPUT_WINDOW:
                self.room.set()
            return
        if self.consumed - self.credited >= self.window // 4 and not (self.done or self.ended or self.link.closed):
            self.credited = self.consumed
            self.link.send(wire.frame(wire.CREDIT, self.id, wire.u64(self.consumed)))

    def kill(self, sig: int = 9) -> None:
        """SIGKILL (or sig) its process group in the guest. Nothing to do
        when the channel is closed: the VM, and the process, are going (an
        exec that ends because its VM died kills it on its way out, and
        must report the VM's end, not fail here)."""
        if not self.done and not self.link.closed:
            self.link.send(wire.frame(wire.KILL, self.id, wire.u64(sig)))

    async def send_stdin(self, data: bytes, eof: bool) -> None:
        """One chunk of stdin, once the agent has put the previous one into
        the process's pipe (TAKEN): a process that does not read holds its
        sender here, as a container's bounded stdin queue does, and the
        guest never buffers more than one chunk per exec. Returns at once
        when the exec has ended (its input is dropped, as a closed pipe's)."""
        async with self._stdin_lock:
            await self._settled()
            if self.done or self.ended:
                return
            self.taken.clear()
            self.link.send(wire.frame(wire.STDIN, self.id, wire.u64(1 if eof else 0), wire.bstr(data)))
            await self.link.drain()
            await self._settled()

    def resize(self, rows: int, cols: int) -> None:
        """A pty exec's window size (the agent's TIOCSWINSZ: SIGWINCH to its foreground group)."""
        if self.done or self.ended:
            raise OSError(errno.EBADF, "the terminal is closed: the exec has ended")
        self.link.send(wire.frame(wire.RESIZE, self.id, wire.u64(rows), wire.u64(cols)))

    def close_stdin_nowait(self) -> None:
        """EOF on its stdin, without waiting (a copy abandoned, a request cancelled)."""
        if not (self.done or self.ended or self.link.closed):
            self.link.send(wire.frame(wire.STDIN, self.id, wire.u64(1), wire.bstr(b"")))

    async def _settled(self) -> None:
        while not self.taken.is_set() and not (self.done or self.ended):
            await self.taken.wait()

    def end(self) -> None:
        self.ended = True
        self.taken.set()
        self.over.set()


class AgentLink:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, what: str,
                 fresh: bool = False, on_broken: Callable[[str], None] | None = None):
        """fresh: a new connection, whose first request is HELLO: what comes
        before its READY is skipped (find_ready). on_broken(why): called once,
        on the loop, when the guest sent bytes that are no frame (a length out
        of bounds, a body its type cannot have); the channel is closed by then."""
        self.reader, self.writer, self.what = reader, writer, what
        self._fresh = fresh
        self.on_broken = on_broken
        # Request and exec ids start at a random point: the guest agent may
        # still hold execs of an earlier link under their ids (orphaned by a
        # pause's restore or a daemon restart, until they end), and an exec
        # sent under one of them would be refused (EEXIST). The first is the
        # HELLO's, whose READY a fresh link looks for (_skip_to_ready).
        self._next_id = secrets.randbits(32) % ID_SPAN + 1
        self.first_id = self._next_id
        self._pending: dict[int, asyncio.Future] = {}
        self._execs: dict[int, AgentExec] = {}
        self._streams: dict = {}            # request id -> on_data of a streamed answer (stream())
        self.closed = False
        self.agent_version = 0              # its READY's (hello); 0 until then
        self._held: AgentExec | None = None     # an exec of a window-less agent the reader waits for
        # Called (kind, wire.Reader) on the loop with each background
        # process's output or end (wire.PROC_OUT, PROC_END; id 0), once the
        # host attached to it (dsecd/engine/vmprocs.py); must not raise.
        self.on_proc = None
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._read_loop())

    @classmethod
    async def connect(cls, transport: Transport, what: str, hostname: str, timeout: float,
                      sandbox_id: str = "", on_broken: Callable[[str], None] | None = None) -> AgentLink:
        """Open the channel and say HELLO (the sandbox's identity: hostname,
        clock, entropy, id) until the agent answers READY: it answers once it
        has mounted the root, so this is also the wait for the boot."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        reader, writer = await transport.open(timeout)
        link = cls(reader, writer, what, fresh=True, on_broken=on_broken)
        try:
            await asyncio.wait_for(link.hello(hostname, sandbox_id), max(0.1, deadline - loop.time()))
        except TimeoutError:
            link.close()
            raise AgentGone(f"{what}: the guest agent did not answer within {timeout:.0f}s "
                            "(boot too slow or failed: see the sandbox's serial log)") from None
        except BaseException:
            link.close()
            raise
        return link

    async def hello(self, hostname: str, sandbox_id: str = "") -> str:
        """The agent reseeds the guest's CRNG from the 32 bytes of entropy and
        sets its clock and hostname (csrc/guest/agent.c, do_hello): what makes
        a VM restored from a template its own. Its READY names its version:
        what the execs started after may ask of it (output windows). A
        HELLO again on a link with execs running (a job resume) says it
        still follows them: else the agent lets their output go without a
        window, as nobody would credit it."""
        r = await self.request(wire.HELLO, wire.bstr(hostname), wire.u64(time.time_ns()),
                               wire.bstr(os.getrandom(32)), wire.bstr(sandbox_id), wire.u64(1 if self._execs else 0))
        text = r.str()
        self.agent_version = wire.agent_version(text)
        if self.agent_version < wire.WINDOW_AGENT_VERSION:
            log.warning("%s: guest agent %r keeps no output window (version %d wanted): an exec whose "
                        "output its consumer has not taken holds this VM's channel until it is; "
                        "a restart of the VM runs the current agent", self.what, text,
                        wire.WINDOW_AGENT_VERSION)
        return text

    @property
    def sets_groups(self) -> bool:
        """Whether the guest's agent sets an exec's supplementary groups (an
        older one would ignore them: none is sent to it)."""
        return self.agent_version >= wire.GROUPS_AGENT_VERSION

    def send(self, data: bytes) -> None:
        if self.closed:
            raise AgentGone(f"{self.what}: the agent channel is closed")
        self.writer.write(data)

    def new_id(self) -> int:
        """The next request or exec id: 1..ID_SPAN (0 is the agent's pushes'), in turn."""
        msg_id = self._next_id
        self._next_id = msg_id % ID_SPAN + 1
        return msg_id

    async def drain(self) -> None:
        """Wait until what was sent is out; AgentGone if the channel broke
        meanwhile (QEMU ended: the socket resets under a large write, which
        must say the VM went, not fail with a bare ConnectionResetError)."""
        try:
            await self.writer.drain()
        except AgentGone:
            raise
        except (ConnectionError, OSError) as err:
            raise AgentGone(f"{self.what}: the agent channel broke ({err}): the VM is gone or going") from err

    async def request(self, kind: int, *fields: bytes) -> wire.Reader:
        """A file (or hello, sync) request; the OK body, or AgentError."""
        return await self.request_with_id(self.new_id(), kind, *fields)

    async def stream(self, kind: int, on_data, *fields: bytes) -> wire.Reader:
        """A request answered by DATA frames, then OK (its body returned) or
        ERR: on_data(bytes) gets each frame's bytes, in order, on the loop
        (the writable layer's tar: M_TAR)."""
        msg_id = self.new_id()
        self._streams[msg_id] = on_data
        try:
            return await self.request_with_id(msg_id, kind, *fields)
        finally:
            self._streams.pop(msg_id, None)

    async def request_with_id(self, msg_id: int, kind: int, *fields: bytes) -> wire.Reader:
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        try:
            self.send(wire.frame(kind, msg_id, *fields))
            await self.drain()
            return await fut
        finally:
            self._pending.pop(msg_id, None)
            if fut.done() and not fut.cancelled():
                fut.exception()         # taken: a drain that broke first raised its own error

    async def start_exec(self, argv: list[str], env: list[str], cwd: str, uid: int, stdin: bool,
                         flags: int = 0, window: tuple[int, int] | None = None,
                         trace: tuple[int, int] | None = None, gid: int | None = None,
                         groups: tuple[int, ...] = ()) -> AgentExec:
        """Send the exec; its events follow on the returned AgentExec (the
        first is "started" or "error"). flags: wire.EXEC_TAR_GET or
        EXEC_TAR_PUT run a directory copy of the agent's instead of argv;
        window: (rows, cols): it runs on a terminal of that size; trace:
        (bytes per string, argv entries): it runs under the guest's tracer,
        whose records come as ("out", wire.TRACE_FD, bytes). gid: the uid's
        number when not given; groups: supplementary gids (ValueError if the
        agent cannot set them: sets_groups)."""
        if groups and not self.sets_groups:
            raise ValueError(f"{self.what}: guest agent version {self.agent_version} cannot set groups")
        windowed = self.agent_version >= wire.WINDOW_AGENT_VERSION
        run = AgentExec(self, self.new_id(), OUTPUT_WINDOW if windowed else 0)
        self._execs[run.id] = run
        log.debug("%s: exec id %d: %s", self.what, run.id, argv[0] if argv else "(a copy of the agent's)")
        try:
            self.send(wire.exec_request(run.id, argv, env, cwd, uid, uid if gid is None else gid, stdin, flags,
                                        window, trace, run.window, groups))
            await self.drain()
        except BaseException:
            self._execs.pop(run.id, None)
            raise
        return run

    def forget(self, run: AgentExec) -> None:
        """Its consumer is done with it: what it still sends is dropped here,
        so the agent is told to send it without a window (else a killed
        exec's last output would wait for credit, and its slot with it)."""
        if run.window and not (run.done or run.ended or self.closed):
            self.send(wire.frame(wire.CREDIT, run.id, wire.u64(wire.DISCARD_ALL)))
        run.done = True
        run.taken.set()
        run.room.set()
        self._execs.pop(run.id, None)

    async def _read_loop(self) -> None:
        err: BaseException = AgentGone(f"{self.what}: the agent channel closed (the VM exited)")
        left = bytearray()          # read past the READY a fresh link skipped to
        broken = ""

        async def exactly(n: int) -> bytes:
            if not left:
                return await self.reader.readexactly(n)
            out = bytes(left[:n])
            del left[:n]
            return out + await self.reader.readexactly(n - len(out)) if len(out) < n else out

        try:
            if self._fresh:
                left += await self._skip_to_ready()
            while True:
                head = await exactly(wire.HEADER.size)
                length, kind, msg_id = wire.HEADER.unpack(head)
                # Checked before the read: readexactly buffers all it is asked for.
                body = await exactly(wire.check_length(length, kind, msg_id))
                self._route(kind, msg_id, body)
                if self._held is not None:
                    # An agent without windows cannot be told to stop: the
                    # channel waits until that exec's consumer catches up.
                    await self._held.room.wait()
                    self._held = None
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            err = AgentGone(f"{self.what}: the agent link was closed by the daemon")
        except Exception as exc:        # a malformed frame: the channel cannot be trusted any more
            broken = f"bad frame from the guest agent: {exc}"
            log.error("%s: %s; ending the channel", self.what, broken)
            err = AgentGone(f"{self.what}: {broken}")
        self.closed = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        for run in self._execs.values():
            run.end()
            run.events.put_nowait(("gone", err))
        self._pending.clear()
        self._execs.clear()
        self.writer.close()
        if broken and self.on_broken is not None:
            try:
                self.on_broken(broken)
            except Exception:
                log.exception("%s: ending the VM of a broken channel", self.what)

    async def _skip_to_ready(self) -> bytes:
        """Route the READY answering this link's HELLO (its first request,
        id first_id) and return what was read past it; skip what came before. A new
        connection may first carry what an earlier host left unread: the
        tail of a frame cut when that host went, answers to its requests.
        Read as frames, they would be routed to this link's requests of the
        same ids, or break the framing."""
        buf = bytearray()
        skipped = 0
        while True:
            chunk = await self.reader.read(1 << 16)
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(buf), None)
            buf += chunk
            found = find_ready(buf, self.first_id)
            if found is not None:
                start, end = found
                skipped += start
                if skipped:
                    log.warning("%s: skipped %d bytes an earlier host left on the agent channel", self.what,
                                skipped)
                self._route(wire.READY, self.first_id, bytes(buf[start + wire.HEADER.size:end]))
                return bytes(buf[end:])
            # Bounded whatever the guest sends before its READY: only the last
            # bytes can hold the start of a READY frame still arriving.
            if len(buf) > 2 * READY_MAX:
                skipped += len(buf) - READY_MAX
                del buf[:-READY_MAX]

    def _route(self, kind: int, msg_id: int, body: bytes) -> None:
        r = wire.Reader(body)
        run = self._execs.get(msg_id)
        if run is not None:
            if kind == wire.OUT:
                fd = r.u64()
                data = r.bytes()
                run.received += len(data)
                if run.window and run.backlog() > run.window:
                    # The agent stops at its window: past it, the guest is not
                    # running the agent's code (root in it took the channel).
                    raise wire.FrameError(f"exec {msg_id} sent {run.backlog()} bytes of output past what the "
                                          f"host took, over its window of {run.window}")
                run.events.put_nowait(("out", fd, data))
                if not run.window and run.backlog() > OUTPUT_WINDOW:
                    run.room.clear()
                    self._held = run
            elif kind == wire.STARTED:
                run.events.put_nowait(("started", r.u64()))
            elif kind == wire.TAKEN:
                run.taken.set()
            elif kind == wire.EXITED:
                self._execs.pop(msg_id, None)
                run.end()
                run.events.put_nowait(("exited", r.u64()))
            elif kind == wire.ERR:
                self._execs.pop(msg_id, None)
                run.end()
                code = r.u64()
                run.events.put_nowait(("error", AgentError(code, r.str())))
            return
        if kind in (wire.PROC_OUT, wire.PROC_END):
            if self.on_proc is not None:
                self.on_proc(kind, r)
            return
        if kind == wire.DATA:
            on_data = self._streams.get(msg_id)
            if on_data is not None:
                on_data(r.bytes())
            return
        fut = self._pending.get(msg_id)
        if fut is None or fut.done():
            return              # an answer nobody waits for (a cancelled request)
        if kind in (wire.OK, wire.READY):
            fut.set_result(r)
        elif kind == wire.ERR:
            code = r.u64()
            fut.set_exception(AgentError(code or errno.EIO, r.str()))
        else:
            fut.set_exception(AgentGone(f"{self.what}: unexpected answer type {kind} from the agent"))

    def close(self) -> None:
        """Safe from any thread (a destroy's or a pause's blocking end of
        QEMU calls it in a worker): `closed` at once, the reader task and
        transport ended on the loop (onloop.py)."""
        self.closed = True
        on_loop(self._loop, self._close_on_loop)

    def _close_on_loop(self) -> None:
        if not self._task.done():
            self._task.cancel()
        try:
            self.writer.close()
        except Exception:
            pass


# Ids are u32 and 0 is no request's (the agent's pushes: PROC_OUT, PROC_END).
ID_SPAN = 0xFFFFFFFF

# The largest READY frame find_ready takes: u32 length + its 4,096 bytes.
READY_MAX = 4 + 4096


def find_ready(buf: bytes | bytearray, msg_id: int) -> tuple[int, int] | None:
    """(start, end) in `buf` of the READY frame answering request `msg_id`
    (u32 length 9..4096 | READY | id | a byte string filling the body);
    None while it is not (all) there."""
    mark = bytes([wire.READY]) + msg_id.to_bytes(4, "big")
    i = buf.find(mark, 4)
    while i >= 0:
        length = int.from_bytes(buf[i - 4:i], "big")
        if 9 <= length <= READY_MAX - 4:
            end = i + length
            if end > len(buf):
                return None            # perhaps it: wait for the rest
            if int.from_bytes(buf[i + 5:i + 9], "big") == length - 9:
                return i - 4, end
        i = buf.find(mark, i + 1)
    return None
