"""One connection to a daemon: its writer and reader's state (_Conn), the
frames of each request on it (_Pending), its in-flight slots (_Budget),
and the errors of a request it never sent or of bytes that are no frames.
"""

from __future__ import annotations

import asyncio
import collections
import os

from .. import framing, remote
from ..errors import ConnectionLost

# What a frame held for such a reader counts besides its data (its dict, its
# bytes object, its place in the queue).
PENDING_FRAME_COST = 512


class _Budget:
    """Units of the daemon's per-connection request limit, handed out first
    come first served; acquire(n) takes n units at once, never part of them
    (an exec with stdin needs two: itself and its exec_input)."""

    def __init__(self, units: int):
        self.free = units
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        # Waiters handed their units whose tasks have not run on yet. One
        # that comes meanwhile queues behind them: taking free units at
        # once, it would send its request before theirs, which came first
        # (a Process's inputs are numbered in the order they came).
        self._handed = 0

    async def acquire(self, n: int) -> None:
        if not self._waiters and not self._handed and self.free >= n:
            self.free -= n
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._handed -= 1
                self.release(n)             # granted just as we were cancelled
            elif entry in self._waiters:    # release() may have dropped it already
                self._waiters.remove(entry)
                self.release(0)             # those behind it may fit now
            raise
        self._handed -= 1
        self.release(0)                     # ones that queued behind it while it was handed its units

    def release(self, n: int) -> None:
        self.free += n
        while self._waiters and self._waiters[0][0] <= self.free:
            m, fut = self._waiters.popleft()
            if not fut.done():
                self.free -= m
                self._handed += 1
                fut.set_result(None)


class _Pending:
    """Frames of one request: stream frames queue up, the final one ends it.

    `limit`: the most bytes of stream data held for a reader that is
    behind; past it, data that comes is dropped and counted (with the
    daemon's own {"dropped": n} frames meanwhile) until the reader has
    taken half of what is held, and one {"dropped": n} frame takes its
    place then (or before the final frame). The connection's
    reader reads every frame as it comes, whoever waits for them, so
    nothing slows the daemon down: without a limit, a followed process
    that writes faster than its reader reads would fill this client's
    memory. Each frame counts PENDING_FRAME_COST bytes more than its data,
    so that a stream of tiny frames is bounded too."""

    def __init__(self, limit: int | None = None):
        self.queue: asyncio.Queue[dict] = asyncio.Queue()
        self.limit = limit
        self.held = 0            # bytes of stream data in the queue, with each frame's cost
        self.skipped = 0         # bytes dropped since the last frame queued
        self.dropping = False

    @staticmethod
    def _cost(stream) -> int | None:
        """What a frame's `stream` counts against the limit; None: not counted (not a stream frame)."""
        if not isinstance(stream, dict):
            return None
        return len(stream.get("data") or b"") + PENDING_FRAME_COST

    def put(self, frame: dict) -> None:
        """A frame from the daemon (the connection's reader)."""
        if self.limit is None:              # nothing counted: most requests
            self.queue.put_nowait(frame)
            return
        stream = frame.get("stream")
        cost = self._cost(stream)
        if cost is not None:
            # Output, or the daemon's own count of output its ring lost (a
            # first frame's lost_before is kept whole).
            lost = (len(stream["data"]) if stream.get("data") is not None
                    else stream["dropped"] if "dropped" in stream and "lost_before" not in stream
                    else None)
            if lost is not None:
                if not (self.dropping and self.held > self.limit // 2):
                    self.dropping = self.held + cost > self.limit
                if self.dropping:
                    self.skipped += lost
                    return
            self.held += cost
        if self.skipped:
            notice = {"stream": {"dropped": self.skipped}}
            self.held += PENDING_FRAME_COST
            self.queue.put_nowait(notice)
            self.skipped = 0
        self.queue.put_nowait(frame)

    async def get(self) -> dict:
        frame = await self.queue.get()
        if self.limit is not None and (cost := self._cost(frame.get("stream"))) is not None:
            self.held -= cost
        return frame


class _Conn:
    """One connection to a daemon: its writer, the requests waiting for
    answers on it, why it ended. A reconnect makes a new one, so that a frame
    or the loss of the old connection never reaches requests of the new."""

    def __init__(self, writer: asyncio.StreamWriter, frames: framing.FrameProtocol,
                 link: remote.SshLink | None):
        self.writer = writer
        self.frames = frames
        self.link = link                                  # the ssh process of an ssh:// client
        self.peer_pid: int | None = None                  # a local daemon's pid (SO_PEERCRED), for errors
        # The event loop it was opened in: its reader hands every answer to
        # futures of that loop, so only that loop's tasks may use it; and
        # the process, whose forked children share its socket.
        self.loop = asyncio.get_running_loop()
        self.pid = os.getpid()
        self.pending: dict[int, _Pending] = {}
        self.reader: asyncio.Task | None = None
        self.lost: BaseException | None = None            # why it ended, once it has
        # Requests past the daemon's limits.max_requests_per_client wait here
        # for a slot instead of failing; set from the hello's limits.
        self.slots: _Budget | None = None
        self.follows: _Budget | None = None               # the slots following requests may take
        self.tails = False        # the daemon takes file_write data as a frame's tail (protocol.TAILED)
        self.garbled = False      # it ended on bytes that are not frames (said as such, not as ssh's end)
        self.watchdog: asyncio.Task | None = None         # see Client._watch_silence


class _Unsent(ConnectionLost):
    """A request's connection was lost before the request was written to it:
    the daemon never saw it, so it may go on a new connection. Raised as
    the ConnectionLost it is where nothing sends it again (the hello)."""

    def __init__(self, cause: BaseException, target: str, op: str):
        super().__init__(f"{op} on {target}: connection lost before it was sent: {cause}",
                         target=target, op=op, sent=False)
        self.cause = cause


class _NotFrames(Exception):
    """The peer sent bytes that are not the protocol's frames."""
