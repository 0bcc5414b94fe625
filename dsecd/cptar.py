"""`dsec cp - SB:/dir` and `dsec cp SB:/dir -`: a tree as a tar stream on
dsec's stdin or stdout, as `docker cp -` takes and gives one.

Into a sandbox, stdin's tar (gzip, xz or bzip2 compressed too: undone here,
a piece at a time, as the daemon takes an uncompressed tar) goes through
the SDK's upload_tar unchanged: the daemon checks and extracts it as it
arrives, never spooled. Out of one, the daemon's tar of the tree
(file_tar_get) is spooled to a temporary file as download_dir spools it,
and written out again while it arrives, its entries renamed below the
source's base name as docker names them; it is read from the spool, so a
reader slower than the daemon holds up nothing but disk. In memory, either
way, a few chunks at most: in, a BATCH being gathered, the piece being
sent and a PIECE of decompressed bytes; out, one frame of the daemon's
(limits.max_file_chunk_bytes) and tarfile's buffers.
"""

from __future__ import annotations

import asyncio
import bz2
import contextlib
import lzma
import os
import posixpath
import tarfile
import tempfile
import threading
import zlib
from collections.abc import AsyncIterator

from . import tarsafe
from .errors import BadRequest

PIECE = 1 << 20          # the most decompressed bytes made from one step
BATCH = 4 << 20          # stdin's tar sent in pieces of this (limits.max_file_chunk_bytes' default)...
PATIENCE = 1.0           # ...or of what came in this many seconds, if less

# The first bytes of the compressed streams a tar may come in, and what undoes them.
_FORMATS = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))


def _decompressor(kind: str):
    if kind == "gzip":
        return zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    if kind == "xz":
        return lzma.LZMADecompressor()
    if kind == "bzip2":
        return bz2.BZ2Decompressor()
    raise BadRequest(f"stdin is a {kind}-compressed stream, which dsec cp does not undo: decompress it first "
                     f"(e.g. {kind} -dc FILE | dsec cp - SB:/dir)")


class _Undo:
    """A compressed stream undone as it comes, its output in pieces of at
    most PIECE bytes (a few KiB of gzip may stand for gigabytes). Streams
    that follow one another (pigz, pbzip2, `cat a.gz b.gz`) are undone one
    after the other; anything else after the last is ignored, as gzip(1)
    ignores trailing zeros. xz streams are read as `xz -d` reads them: null
    bytes after a stream are its stream padding, which must come in
    multiples of 4, and anything else after one is refused. Whether another
    stream follows is known only once its magic has come: a read may end
    where a stream does, or within the next one's first bytes (a writer that
    writes one stream at a time)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.magic = next(m for m, k in _FORMATS if k == kind)
        self.d = _decompressor(kind)
        self.rest = b""             # after a stream's end: the bytes come since
        self.padding = 0            # after an xz stream's end: the null bytes come since
        self.over = False

    def feed(self, data: bytes):
        while not self.over:
            if self.d is None:      # a stream ended: does another follow?
                data, self.rest = self.rest + data, b""
                if self.kind == "xz":
                    rest = data.lstrip(b"\0")
                    self.padding += len(data) - len(rest)
                    data = rest
                    if not data:
                        return
                if len(data) < len(self.magic) and self.magic.startswith(data):
                    self.rest = data        # the next read says
                    return
                if not data.startswith(self.magic):
                    if self.kind == "xz":
                        raise BadRequest("stdin's xz stream is followed by bytes that are neither stream "
                                         "padding nor another xz stream: the archive cannot be read")
                    self.over = True
                    return
                self._check_padding()
                self.d = _decompressor(self.kind)
            try:
                out = self.d.decompress(data, PIECE)
            except (zlib.error, lzma.LZMAError, OSError) as err:     # bz2 says OSError
                raise BadRequest(f"stdin's {self.kind} stream is damaged ({err}): the archive cannot be "
                                 "read") from None
            if self.kind == "gzip":
                data = self.d.unconsumed_tail
                more = bool(data) or len(out) == PIECE
            else:
                data = b""
                more = not self.d.needs_input and not self.d.eof
            if out:
                yield out
            if self.d.eof:
                data, self.d, more = self.d.unused_data + data, None, True
            if not more:
                return

    def _check_padding(self) -> None:
        if self.padding % 4:
            raise BadRequest(f"stdin's xz stream padding of {self.padding} null bytes is not a multiple of 4 "
                             "(as xz -d requires): the input is damaged")
        self.padding = 0

    def end(self) -> None:
        if not self.over and self.d is not None and not self.d.eof:
            raise BadRequest(f"stdin's {self.kind} stream ends before its end: the archive is cut short")
        if self.kind == "xz" and self.d is None:
            if self.rest:
                raise BadRequest("stdin's xz input ends inside the next stream's first bytes: the archive is "
                                 "cut short")
            self._check_padding()


async def decompressed(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`chunks` as they come, or undone where they begin as a compressed
    stream does. A tar begins with its first entry's name, which may begin
    as a magic does (`BZh9...`): a first block that is a ustar header is a
    tar, whatever its first bytes."""
    head = b""
    async for chunk in chunks:
        head += chunk
        if len(head) >= tarfile.BLOCKSIZE:
            break
    tar = head[257:262] == b"ustar"
    kind = None if tar else next((k for magic, k in _FORMATS if head.startswith(magic)), None)
    if kind is None:
        if head:
            yield head
        async for chunk in chunks:
            yield chunk
        return
    undo = _Undo(kind)
    for out in undo.feed(head):
        yield out
    async for chunk in chunks:
        for out in undo.feed(chunk):
            yield out
    undo.end()


async def batched(chunks: AsyncIterator[bytes], size: int = BATCH, patience: float = PATIENCE) -> AsyncIterator[bytes]:
    """`chunks` gathered into pieces of `size` bytes (a pipe's reads are
    64K: one frame each would cost a round trip each), but never held for
    more than `patience` seconds once some are waiting: a stream that
    trickles in still reaches the daemon, which drops a copy that sends
    nothing for limits.frame_timeout_s."""
    loop = asyncio.get_running_loop()
    it = aiter(chunks)
    buf = bytearray()
    since = 0.0                 # when the oldest byte in buf came
    nxt: asyncio.Future | None = None
    try:
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(anext(it))
            if buf:
                done, _ = await asyncio.wait([nxt], timeout=max(0.0, since + patience - loop.time()))
                if not done:
                    yield bytes(buf)
                    buf.clear()
                    continue
            try:
                got = await nxt
            except StopAsyncIteration:
                nxt = None
                break
            nxt = None
            if not buf:
                since = loop.time()
            buf += got
            while len(buf) >= size:
                yield bytes(buf[:size])
                del buf[:size]
        if buf:
            yield bytes(buf)
    finally:
        if nxt is not None:
            nxt.cancel()


async def in_a_thread_of_its_own(fn, *args):
    """fn(*args) (a read of stdin, a write to stdout: either may block for
    as long as the other end likes) in a daemon thread, so that the loop
    runs meanwhile: cmd_cp's SIGTERM handler cancels the copy at once, and
    dsec exits without waiting for the thread."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            out = True, fn(*args)
        except BaseException as err:       # handed to the caller
            out = False, err
        with contextlib.suppress(RuntimeError):        # the loop ended meanwhile
            loop.call_soon_threadsafe(settle, *out)

    threading.Thread(target=run, name="dsec-cp-io", daemon=True).start()
    return await fut


def _write_all(fd: int, data) -> None:
    """Every byte of `data` to `fd` (a pipe, or a file short of room, takes a part at a time)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class _Stopped(Exception):
    """The copy ended before the spool did: its reader stops."""


class _Spool:
    """The daemon's tar, appended on the loop as it comes, read by the
    writer's thread behind it (each read waits for what is not there yet)."""

    def __init__(self):
        self.file = tempfile.TemporaryFile()
        self.fd = self.file.fileno()
        self.size = self.pos = 0
        self.ended = self.stopped = False
        self.cond = threading.Condition()

    def append(self, data: bytes) -> None:
        _write_all(self.fd, data)
        with self.cond:
            self.size += len(data)
            self.cond.notify()

    def end(self, stopped: bool = False) -> None:
        with self.cond:
            self.ended = True
            self.stopped = self.stopped or stopped
            self.cond.notify()

    def read(self, n: int = -1) -> bytes:
        with self.cond:
            while self.pos >= self.size and not self.ended:
                self.cond.wait()
            if self.stopped:
                raise _Stopped()
            n = self.size - self.pos if n < 0 else min(n, self.size - self.pos)
        data = os.pread(self.fd, n, self.pos) if n else b""
        self.pos += len(data)
        return data


class _FdWriter:
    """Writes go straight to `fd`, whole (stdout: a pipe takes a part at a time)."""

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, data) -> int:
        _write_all(self.fd, data)
        return len(data)


class RawNameTarInfo(tarfile.TarInfo):
    """A member whose PAX records (a name or link target that is not
    UTF-8, say) hold their bytes as they are, without the hdrcharset=BINARY
    record tarfile adds for them: GNU tar (1.34) knows no hdrcharset and
    warns of it once a member, while it takes a path record that is not
    UTF-8 as its bytes, and so do tarfile (which falls back to its
    encoding, with surrogateescape the bytes themselves) and the daemon's
    extraction. A name that is UTF-8 is written as before."""

    @classmethod
    def _create_pax_generic_header(cls, pax_headers, type, encoding):
        if type != tarfile.XHDTYPE or all(_utf8(value) for value in pax_headers.values()):
            return super()._create_pax_generic_header(pax_headers, type, encoding)
        records = b""
        for keyword, value in pax_headers.items():
            record = b" " + keyword.encode("utf-8") + b"=" + value.encode("utf-8", "surrogateescape") + b"\n"
            n = len(record)
            while len(str(n)) + len(record) != n:       # the length counts its own digits
                n = len(str(n)) + len(record)
            records += str(n).encode("ascii") + record
        info = {"name": "././@PaxHeader", "type": type, "size": len(records), "magic": tarfile.POSIX_MAGIC}
        return cls._create_header(info, tarfile.USTAR_FORMAT, "ascii", "replace") + cls._create_payload(records)


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _retar(src, top: str, fd: int) -> None:
    """The tar read from `src` (the daemon's: "." its top, the rest below
    it) written to `fd`, each entry checked again as download_dir checks it
    and renamed below `top` ("" keeps the names)."""
    seen = tarsafe.Seen(1 << 62, 1 << 62)           # the daemon counted them against its limits
    with tarfile.open(fileobj=src, mode="r|", encoding="utf-8", errors="surrogateescape",
                      tarinfo=RawNameTarInfo) as tin, \
            tarfile.open(fileobj=_FdWriter(fd), mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8",
                         errors="surrogateescape") as tout:
        for m in tin:
            rel = tarsafe.check(m, seen)
            m.name = posixpath.join(top, rel) if top else rel or "."
            if m.islnk():
                m.linkname = posixpath.join(top, tarsafe.entry_name(m.linkname))
            mtime_ns = tarsafe.mtime_ns(m)
            m.pax_headers = {}              # its old path would name it still; the writer adds what it needs
            tarsafe.set_mtime_ns(m, mtime_ns)       # the fraction as the daemon's record had it, not a float's
            tout.addfile(m, tin.extractfile(m) if m.isreg() else None)


def one_file_tar(info: RawNameTarInfo, fileobj, fd: int = 1) -> None:
    """A tar of the one entry `info`, its bytes read from `fileobj`, written to `fd`."""
    with tarfile.open(fileobj=_FdWriter(fd), mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tout:
        tout.addfile(info, fileobj)


async def tar_to_fd(sb, path: str, top: str, fd: int = 1) -> dict:
    """Directory `path` of sandbox `sb` as a tar on `fd` (its entries below
    `top`, the directory's own entry `top` itself), written while it comes;
    the daemon's result (count, bytes, skipped). A failure after some of it
    was written leaves a tar without its end on `fd`, which a reader says
    is cut short."""
    spool = _Spool()
    writer = asyncio.ensure_future(in_a_thread_of_its_own(_retar, spool, top, fd))

    async def download() -> dict:
        async with contextlib.aclosing(sb.client.frames("file_tar_get", sandbox=sb.id, path=path)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return frame["__result__"]
                spool.append(frame["data"])
        raise ConnectionError("file_tar_get: no final frame")

    users = [2]

    def done(f: asyncio.Future) -> None:
        if not f.cancelled():
            f.exception()           # taken: one the copy's own error stands in front of is no news
        users[0] -= 1
        if not users[0]:            # neither the writer's thread reads it nor the download writes it
            spool.file.close()

    writer.add_done_callback(done)
    fetch = asyncio.ensure_future(download())
    fetch.add_done_callback(done)
    try:
        await asyncio.wait([fetch, writer], return_when=asyncio.FIRST_EXCEPTION)
        if writer.done() and writer.exception() is not None:
            raise writer.exception()        # stdout closed (BrokenPipeError), or a refused entry
        result = await fetch
        spool.end()
        await writer
        return result
    except BaseException:
        spool.end(stopped=True)
        fetch.cancel()
        with contextlib.suppress(BaseException):
            await fetch
        raise
