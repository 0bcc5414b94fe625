"""Data to write as pieces under the frame limit: bytes-like, a binary
file, an asyncio StreamReader or an async iterable, read one piece at a
time (write_file, upload_tar).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

# The most bytes one file request carries where the daemon's hello gives no
# limits.max_file_chunk_bytes.

DEFAULT_CHUNK = 4 << 20


def file_data(data, what: str) -> bytes | bytearray | memoryview:
    """`data` checked to be bytes-like: a str (or anything else) is a
    TypeError saying how to make bytes of it, not memoryview's own."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    if isinstance(data, str):
        raise TypeError(f"{what}: data must be bytes (got str): encode it, e.g. data.encode()")
    raise TypeError(f"{what}: data must be bytes (got {type(data).__name__}): convert it, e.g. bytes(data)")


def file_pieces(data, size: int, what: str) -> AsyncIterator[bytes | memoryview]:
    """What write_file takes (bytes-like; a binary file open for reading; an
    async iterable of bytes) as pieces of `size` bytes, the last one
    shorter: one empty piece for no bytes at all. Only bytes-like data is
    held whole; from a file or an iterable, one piece at a time."""
    if inspect.iscoroutinefunction(getattr(data, "read", None)):
        # An asyncio StreamReader (a subprocess's stdout): read by size. Its
        # own iteration goes by lines, and fails on 64 KiB without a newline.
        return _reader_pieces(data, size, what)
    if hasattr(data, "__aiter__"):
        return _regrouped(data, size, what)
    if hasattr(data, "read"):
        return _file_pieces(data, size, what)
    return _view_pieces(file_data(data, what), size)


async def _view_pieces(data, size: int) -> AsyncIterator[memoryview]:
    view = memoryview(data)
    for start in range(0, max(len(view), 1), size):
        yield view[start:start + size]


def _file_pieces(f, size: int, what: str) -> AsyncIterator[bytes]:
    """A file's reads as pieces of `size` bytes (_reader_pieces)."""
    return _reader_pieces(_InThreads(f, what), size, what)


class _InThreads:
    """A binary file's read as a coroutine, each in a thread (a pipe's may
    block, a disk's take a while): the loop runs meanwhile. (asyncio.run
    waits for that thread at its end: a read of a pipe nobody writes to
    holds it up.)"""

    def __init__(self, f, what: str):
        self.f, self.what = f, what

    async def read(self, n: int) -> bytes:
        loop = asyncio.get_running_loop()
        while True:
            got = await loop.run_in_executor(None, self.f.read, n)
            if got is None:             # a non-blocking file with nothing yet
                await asyncio.sleep(0.01)
                continue
            if not isinstance(got, (bytes, bytearray)):
                raise TypeError(f"{self.what}: the file must be opened in binary mode ('rb'); its read gave "
                                f"{type(got).__name__}")
            return got


async def _reader_pieces(reader, size: int, what: str) -> AsyncIterator[bytes]:
    """`await reader.read(n)` until it gives b"", as pieces of `size` bytes."""
    piece, given = bytearray(), False
    while True:
        got = file_data(await reader.read(size - len(piece)), what)
        piece += got
        if len(piece) == size or (not got and (piece or not given)):
            yield bytes(piece)
            piece, given = bytearray(), True
        if not got:
            return


async def _as_they_come(chunks, size: int) -> AsyncIterator[bytes | bytearray | memoryview]:
    """An async iterable's chunks as they come, none empty, one past `size` in
    pieces of it. The iterable is closed (aclose) when this ends, read to its
    end or not: a put that failed half way leaves no generator of the
    caller's suspended until garbage collection."""
    try:
        async for got in chunks:
            got = file_data(got, "upload_tar")
            for start in range(0, len(got), size):
                yield got[start:start + size]
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


async def _regrouped(chunks, size: int, what: str) -> AsyncIterator[bytes]:
    """An async iterable's chunks of any size as pieces of `size` bytes."""
    buf, given = bytearray(), False
    async for got in chunks:
        buf += file_data(got, what)
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
            given = True
    if buf or not given:
        yield bytes(buf)
