"""Reading length-prefixed frames off a socket without copying them around.

asyncio's StreamReader reads into a buffer of its own, copies what arrives
into it, pauses and resumes its transport every 2 x `limit` bytes, and copies
a frame out of it again: about 370 MiB/s for 4 MiB frames on a 2-core host,
which capped file_write and file_read below a `tar | bwrap tar` copy. This
protocol is an asyncio BufferedProtocol: the transport reads into buffers it
hands out. Small frames land in one scratch buffer (many per read) and are
cut out of it; a frame too big for the scratch gets a buffer of its own size,
which the kernel fills directly and which becomes the frame as it is, with
no copy (about 3 GiB/s in the same test).

Used by the server (dsecd/server.py) and the client (dsecd/client/wire.py); the
writing side stays an asyncio.StreamWriter over the same transport, for
which the protocol provides what StreamWriter asks of its protocol: flow
control (`_drain_helper`, as asyncio's FlowControlMixin, which cannot be
mixed in: it is an asyncio.Protocol, and uvloop then feeds data_received
instead of the buffers) and the future wait_closed awaits.
"""

from __future__ import annotations

import asyncio
import collections
import struct
import sys

HEADER = struct.Struct(">I")
SCRATCH_BYTES = 64 << 10
# A big frame's buffer starts at this and doubles as its bytes come, so that
# a header alone (4 bytes announcing 16 MiB) makes the daemon hold no more
# than what was sent.
BIG_START = 1 << 20
# Frames read but not yet taken, in bytes, above which the transport stops
# reading: a peer that sends faster than its frames are handled waits in its
# own socket buffer, not in this process's memory.
QUEUED_BYTES = 1 << 20


class FrameTooBig(Exception):
    """A header announced a frame over max_frame; `size` is what it said."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"frame of {size} bytes exceeds the {limit}-byte limit")
        self.size = size
        self.limit = limit


class IdleTimeout(Exception):
    """No byte of a next frame came within the idle timeout."""


class FrameTimeout(Exception):
    """A frame began but was not complete within the frame timeout."""


class FrameProtocol(asyncio.BufferedProtocol):
    """Frames (payloads without their 4-byte big-endian length) as they
    complete, for one reader: `read_payload`. A payload is bytes, or a
    bytearray for one that had a buffer of its own (both decode alike)."""

    def __init__(self, max_frame: int, on_connected=None, recycle: int = 0):
        self._loop = asyncio.get_running_loop()
        self.max_frame = max_frame
        # Big-frame buffers kept to be filled again once nothing refers to
        # them any more (at most `recycle`): a fresh one costs page faults
        # and zeroing on every frame, ~15% of a client reading a file. Off
        # in the daemon, whose many clients would each keep theirs.
        self._recycle = recycle
        self._kept: list[bytearray] = []
        self.transport: asyncio.Transport | None = None
        self._on_connected = on_connected
        self._scratch = bytearray(SCRATCH_BYTES)
        self._fill = 0                      # bytes of the scratch in use
        self._big: bytearray | None = None  # the buffer of a big frame being read (grows)
        self._size = 0                      # that frame's size
        self._got = 0                       # bytes of it read
        self._frames: collections.deque = collections.deque()
        self._queued = 0
        self._reading_paused = False
        self._started_at: float | None = None   # when the first byte of an incomplete frame came
        self.bytes_at = 0.0                     # when bytes last came (of a frame complete or not)
        self._error: BaseException | None = None
        self._eof = False
        self._waiter: asyncio.Future | None = None
        self._closed: asyncio.Future = self._loop.create_future()
        self._writing_paused = False
        self._drain_waiters: collections.deque[asyncio.Future] = collections.deque()

    # ------------------------------------------------------------ transport side

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self._on_connected is not None:
            self._on_connected(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._got:self._size]
        return memoryview(self._scratch)[self._fill:]

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_at = self._loop.time()
        if self._started_at is None:
            self._started_at = self.bytes_at
        if self._big is not None:
            self._got += nbytes
            if self._got == self._size:
                big, self._big = self._big, None
                self._keep(big)
                self._push(big if len(big) == self._size else memoryview(big)[:self._size])
                self._started_at = None
            elif self._got == len(self._big):
                self._grow_big()
        else:
            self._fill += nbytes
            self._cut_frames()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        # Keep the transport open: the peer only stopped sending (a half
        # close) and still reads the answers to what it sent; whoever reads
        # the None closes the writer when it is done.
        return True

    def connection_lost(self, exc) -> None:
        self._eof = True
        if exc is not None and self._error is None:
            self._error = exc
        if not self._closed.done():
            self._closed.set_result(None)
        self._wake()
        self._release_writers(exc)

    # ------------------------------------------------------------ writer side (StreamWriter's)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._release_writers(None)

    def _release_writers(self, exc) -> None:
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)

    async def _drain_helper(self) -> None:
        """StreamWriter.drain: wait while the transport's buffer is over its mark."""
        if self._closed.done():
            raise ConnectionResetError("connection lost")
        if not self._writing_paused:
            return
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def _get_close_waiter(self, stream) -> asyncio.Future:
        """What StreamWriter.wait_closed awaits."""
        return self._closed

    # ------------------------------------------------------------ cutting

    def _cut_frames(self) -> None:
        """Take every complete frame out of the scratch; move the start of a
        frame too big for it into a buffer of its own; keep the rest."""
        buf, pos, end = self._scratch, 0, self._fill
        while end - pos >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > self.max_frame:
                self._fail(FrameTooBig(size, self.max_frame))
                return
            start = pos + HEADER.size
            if end - start >= size:
                self._push(bytes(buf[start:start + size]))
                pos = start + size
                continue
            if HEADER.size + size > len(buf):
                self._size, self._got = size, end - start
                self._big = self._reusable(size) or bytearray(min(size, max(BIG_START, self._got)))
                self._big[:self._got] = buf[start:end]
                pos = end
            break
        rest = end - pos
        if pos:
            buf[:rest] = buf[pos:end]
        self._fill = rest
        if not rest and self._big is None:
            self._started_at = None

    def _reusable(self, size: int) -> bytearray | None:
        """A kept buffer of at least `size` bytes that nothing else refers to
        (no payload, view or slice of it alive: each holds a reference); else
        None, and the next buffer made is kept if there is room."""
        if not self._recycle:
            return None
        for buf in self._kept:
            # The references: the list's, the loop variable's, getrefcount's argument.
            if len(buf) >= size and sys.getrefcount(buf) == 3:
                return buf
        return None

    def _keep(self, buf: bytearray) -> None:
        if self._recycle and len(self._kept) < self._recycle and all(b is not buf for b in self._kept):
            self._kept.append(buf)

    def _grow_big(self) -> None:
        """Twice the room (at most the frame's size), the bytes read kept. A
        new buffer, not a resize: the transport may still hold a view."""
        bigger = bytearray(min(self._size, 2 * len(self._big)))
        bigger[:self._got] = self._big
        self._big = bigger

    def _push(self, payload) -> None:
        self._frames.append(payload)
        self._queued += len(payload)
        if self._queued > QUEUED_BYTES and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _fail(self, err: BaseException) -> None:
        self._error = err
        if self.transport is not None:
            self.transport.pause_reading()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ------------------------------------------------------------ reader side

    async def read_payload(self, idle_timeout: float | None = None, frame_timeout: float | None = None):
        """The next frame's payload; None at the end of the stream (EOF, or
        the connection lost). Waits up to idle_timeout for a frame's first
        byte (IdleTimeout), then up to frame_timeout from that byte for the
        rest (FrameTimeout); None: no limit. FrameTooBig for a frame over
        max_frame: the stream cannot be resynchronised after it."""
        while True:
            if self._frames:
                payload = self._frames.popleft()
                self._queued -= len(payload)
                if self._reading_paused and self._queued <= QUEUED_BYTES and self.transport is not None:
                    self._reading_paused = False
                    self.transport.resume_reading()
                return payload
            if isinstance(self._error, FrameTooBig):
                raise self._error
            if self._eof:
                return None
            timeout, expired = self._deadline(idle_timeout, frame_timeout)
            self._waiter = self._loop.create_future()
            try:
                if timeout is None:
                    await self._waiter          # no timer: the common case
                else:
                    await asyncio.wait_for(self._waiter, timeout)
            except TimeoutError:
                raise expired from None
            finally:
                self._waiter = None

    def _deadline(self, idle_timeout: float | None, frame_timeout: float | None):
        """(seconds to wait, the exception when they pass) for the next wake."""
        if self._started_at is None:
            return idle_timeout, IdleTimeout()
        if frame_timeout is None:
            return None, FrameTimeout()
        return max(0.0, self._started_at + frame_timeout - self._loop.time()), FrameTimeout()
