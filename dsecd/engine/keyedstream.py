"""The output of a keyed streamed exec, kept so that the request sent again
after a lost connection takes it up where its client's output stopped
(dsecd/engine/opkeys.py).

The exec runs under a KeyedStream in place of its request's context: its
output frames go to the request now attached (the first one, then each one
sent again with the key), and the last TAIL_BYTES or so of them stay here,
stdout's and stderr's in the order they were sent. A request sent again
says how many bytes of each it got (`stream_from`); it is sent the rest of
the tail from there, in that order, then what the exec writes next. What
its client got before the tail began is answered `{"fd": n, "lost":
bytes}` (the SDK counts it in ExecResult.lost_output). A request that
takes the output over from one still connected (OpKeys._waited) has that
one answered `taken_over` rather than a result after output cut short.
While no request is attached (its connection lost, the one sent again not
come yet) the exec's output is kept for the one sent again, and the exec
goes on (and may end) up to TAIL_BYTES of it; past that its output waits:
the exec blocks on a full pipe rather than have output it wrote fall out
of the tail unsent, until a request comes or the key's orphan time ends it.
"""

from __future__ import annotations

import asyncio
import collections

from ..errors import BadRequest

# Bytes of output kept for a request sent again (whole frames: up to one
# more): what the first connection may have had in flight when it was lost
# (its socket buffers, an ssh channel's 2 MiB window), with room to spare.
TAIL_BYTES = 4 << 20
FDS = (1, 2)


def check_stream_from(stream_from: list[int] | None) -> None:
    """A request's `stream_from`: two byte counts (stdout, stderr) its client got."""
    if stream_from is None:
        return
    if (not isinstance(stream_from, list) or len(stream_from) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in stream_from)):
        raise BadRequest("exec: stream_from must be two byte counts [stdout, stderr], each >= 0, "
                         f"got {stream_from!r}", {"stream_from": stream_from})


class KeyedStream:
    """A keyed streamed exec's request context (see the module's doc):
    emit, register_exec and unregister_exec as a RequestContext's, going to
    the request attached now."""

    def __init__(self, ctx):
        self._ctx = ctx                 # the request its frames go to; None while none is attached
        # The frames sent, oldest first: (fd, the offset of its first byte in its fd's output, data).
        self._tail: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self._kept = 0
        self._ends = dict.fromkeys(FDS, 0)       # bytes of each fd sent
        self._starts = dict.fromkeys(FDS, 0)     # bytes of each fd no longer kept
        self._attached = asyncio.Event()
        self._attached.set()
        # Frames go out in order: a replay and the exec's next frames do not interleave.
        self._lock = asyncio.Lock()
        self._io = None                 # the running exec, for exec_signal on the request attached
        self._registered = None         # the context it is registered with
        # Done once another request of the key takes the output over from
        # the one attached: that one's client will not get the rest.
        self._taken: asyncio.Future | None = None
        self._ended = False             # the exec ended: a request sent again is sent the tail, not kept
        self._held = 0                  # bytes kept since the last request went, sent to none
        self._sending: asyncio.Future | None = None     # _send's wait for the connection attached
        self._attaching = 0             # requests sent again waiting for the lock to take the output over

    @property
    def kept_bytes(self) -> int:
        return self._kept

    def ends(self) -> list[int]:
        """The bytes of stdout and stderr sent so far."""
        return [self._ends[fd] for fd in FDS]

    async def emit(self, payload: dict) -> None:
        fd, data = payload.get("fd"), payload.get("data")
        output = fd in self._ends and bool(data)
        while True:
            async with self._lock:
                if self._ctx is not None:
                    if output:
                        self._keep(fd, data)
                    if self._attaching:
                        # A request sent again waits for the lock to take
                        # the output over: not held up by a connection that
                        # stopped taking frames (_send), it gets the frame
                        # from the tail if its client lacks it.
                        self._ctx.emit_nowait(payload)
                        return
                    await self._send(payload)
                    return
                if output and self._held + len(data) <= TAIL_BYTES:
                    # No request attached: kept for the one sent again, and
                    # the exec goes on. Waiting here instead, an exec that
                    # ends meanwhile would have its last output dropped
                    # with its pipes (ExecIO.run stops reading them
                    # limits.exec_drain_grace_s after the exit).
                    self._keep(fd, data)
                    self._held += len(data)
                    return
            await self._attached.wait()

    async def _send(self, payload: dict) -> None:
        """`payload` to the request attached: written to its connection,
        then its connection's buffer waited for, as RequestContext.emit
        does (the exec's backpressure). A request sent again cuts that wait
        (attach): a link cut that neither end has noticed yet (ssh's, until
        TCP gives up, minutes later) would hold the lock, and the request
        sent again with it, for that long. The frame is in the tail: the
        request sent again gets it if its client lacks it."""
        self._ctx.emit_nowait(payload)
        drained = self._sending = asyncio.ensure_future(self._ctx.drained())
        try:
            await drained
        except asyncio.CancelledError:
            if not drained.cancelled() or asyncio.current_task().cancelling():
                raise
        finally:
            self._sending = None

    def _keep(self, fd: int, data: bytes) -> None:
        self._tail.append((fd, self._ends[fd], data))
        self._ends[fd] += len(data)
        self._kept += len(data)
        while self._kept - len(self._tail[0][2]) >= TAIL_BYTES:
            old_fd, at, old = self._tail.popleft()
            self._kept -= len(old)
            self._starts[old_fd] = at + len(old)

    def register_exec(self, io) -> None:
        self._io = io
        if self._ctx is not None:
            self._ctx.register_exec(io)
            self._registered = self._ctx

    def unregister_exec(self) -> None:
        self._io = None
        self._unregister()

    def _unregister(self) -> None:
        if self._registered is not None:
            self._registered.unregister_exec()
            self._registered = None

    def check(self, stream_from: list[int] | None) -> None:
        """Refuse a `stream_from` past what was sent."""
        for fd, got, end in zip(FDS, stream_from or (0, 0), self.ends(), strict=True):
            if got > end:
                raise BadRequest(f"exec: stream_from says {got} bytes of fd {fd} came, but the exec has "
                                 f"written {end}: send the byte counts of the output this key's exec gave",
                                 {"stream_from": stream_from, "sent": self.ends()})

    async def attach(self, ctx, stream_from: list[int] | None) -> None:
        """Request `ctx` (sent again with the key) takes the stream over: it
        is sent what came after `stream_from` (checked), then the rest."""
        self.check(stream_from)
        got = dict(zip(FDS, stream_from or (0, 0), strict=True))
        if self._sending is not None and self._ctx is not ctx:
            self._sending.cancel()
        self._attaching += 1
        try:
            await self._lock.acquire()
        finally:
            self._attaching -= 1
        try:
            # First, that the daemon took it up: for the SDK, a frame after
            # its send, so that a further loss sends it again (each loss
            # after which something came does), a quiet command too.
            await ctx.emit({"resumed": True})
            if self._ended:
                await self._replay(ctx, got)
                return
            self._unregister()
            self._held = 0
            if self._taken is not None and not self._taken.done():
                self._taken.set_result(None)
            self._taken = None
            self._ctx = ctx
            await self._replay(ctx, got)
            if self._io is not None:
                ctx.register_exec(self._io)
                self._registered = ctx
            self._attached.set()
        finally:
            self._lock.release()

    async def _replay(self, ctx, got: dict[int, int]) -> None:
        """Send `ctx` the output after `got` (bytes per fd), frames in the order they were first sent."""
        for fd in FDS:
            if got[fd] < self._starts[fd]:
                await ctx.emit({"fd": fd, "lost": self._starts[fd] - got[fd]})
        for fd, at, data in list(self._tail):
            if at + len(data) > got[fd]:
                await ctx.emit({"fd": fd, "data": data[max(0, got[fd] - at):]})

    def end(self) -> None:
        """The exec ended: its tail stays (with its answer, OpKeys._keep),
        the request it went to does not: kept, it would hold that request's
        connection for as long as the tail is."""
        self._ended = True
        self._ctx = None
        self._registered = None
        self._taken = None

    def taken(self, ctx) -> asyncio.Future:
        """Done once another request takes the output over from `ctx`, the
        request attached now (already done if it is not attached)."""
        if self._ctx is not ctx:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        if self._taken is None:
            self._taken = asyncio.get_running_loop().create_future()
        return self._taken

    def detach(self, ctx) -> None:
        """Request `ctx`'s connection went: the output is kept for the next (emit)."""
        if self._ctx is ctx:
            self._unregister()
            self._ctx = None
            self._taken = None
            self._attached.clear()
