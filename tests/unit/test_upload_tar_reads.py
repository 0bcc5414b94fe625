"""Sandbox.upload_tar (dsecd/client/files.py) sends the whole tar whatever size
the file object's reads come back in (no daemon, no root)."""

from __future__ import annotations

import asyncio
import io

import pytest

from dsecd.client import Sandbox


class _Recorder:
    """What upload_tar's feeder sends: each file_tar_input's data and eof."""

    def __init__(self):
        self.inputs: list[tuple[bytes, bool]] = []

    async def request(self, op: str, **args) -> dict:
        assert op == "file_tar_input"
        self.inputs.append((bytes(args["data"]), args["eof"]))
        return {}


class _Trickle(io.RawIOBase):
    """A raw stream (a pipe, a socket, an HTTP body) whose reads return at
    most `step` bytes: short reads that are not its end."""

    def __init__(self, data: bytes, step: int):
        self.data, self.step = data, step

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), self.step, len(self.data))
        buf[:n], self.data = self.data[:n], self.data[n:]
        return n


def _feed(fileobj, chunk: int) -> list[tuple[bytes, bool]]:
    client = _Recorder()
    sb = Sandbox(client, "abc123def456", {})

    async def run():
        sent = asyncio.Event()
        sent.set()
        await sb._feed_tar(1, sent, fileobj, chunk)

    asyncio.run(run())
    return client.inputs


def test_short_reads_are_not_the_end_of_the_tar():
    data = bytes(range(256)) * 40                  # 10,240 bytes
    inputs = _feed(_Trickle(data, step=1000), chunk=4096)
    assert b"".join(d for d, _ in inputs) == data
    assert [eof for _, eof in inputs] == [False] * (len(inputs) - 1) + [True]


def test_a_buffered_file_is_sent_in_whole_chunks():
    data = b"x" * 10_000
    inputs = _feed(io.BytesIO(data), chunk=4096)
    assert [(len(d), eof) for d, eof in inputs] == [(4096, False), (4096, False), (1808, True)]


@pytest.mark.parametrize("error", [OSError, ConnectionResetError])
def test_a_read_that_fails_cancels_the_copy_at_once(error):
    """The file object's read raises part way (a broken download): the
    daemon would wait for more of the tar until its frame timeout (30 s),
    and the caller with it. The copy is cancelled, and the read's error
    raised at once."""
    import time

    from dsecd.errors import Conflict

    class Broken(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buf) -> int:
            raise error("the download broke")

    class Puts:
        server: dict = {"limits": {"max_file_chunk_bytes": 4096}}

        def __init__(self):
            self.requests: list[tuple[str, dict]] = []
            self.cancelled = asyncio.Event()

        def new_id(self) -> int:
            return 7

        async def request(self, op: str, **args) -> dict:
            self.requests.append((op, args))
            if op == "cancel":
                self.cancelled.set()
                await asyncio.sleep(0.5)            # the put's end comes first
            return {}

        async def frames_with_id(self, rid, op, args, sent=None):
            sent.set()
            await self.cancelled.wait()             # the daemon waits for the rest of the tar
            raise Conflict("request cancelled")
            yield

    async def go():
        client = Puts()
        t = time.monotonic()
        with pytest.raises(error, match="the download broke"):
            await asyncio.wait_for(Sandbox(client, "sb-1", {}).upload_tar(Broken(), "/work/t"), 5)
        return time.monotonic() - t, client.requests

    took, requests = asyncio.run(go())
    assert took < 2, took
    assert ("cancel", {"target": 7}) in requests


async def _pieces(*sizes: int):
    for i, size in enumerate(sizes):
        yield bytes([i]) * size


@pytest.mark.parametrize("sizes,expect", [
    ((1000, 5000, 0, 1192), [(1000, False), (4096, False), (904, False), (1192, False), (0, True)]),
    ((4096, 8192), [(4096, False), (4096, False), (4096, False), (0, True)]),
    ((), [(0, True)]),
])
def test_an_async_iterable_is_sent_as_it_comes(sizes, expect):
    """A tar streamed from elsewhere (dsec cp - SB:/dir reads stdin as it
    comes): each piece goes when it comes, split under the frame limit,
    none held back for the next to fill a chunk (a slow stream would
    look stalled to the daemon); every byte once, in order, then eof."""
    inputs = _feed(_pieces(*sizes), chunk=4096)
    assert [(len(d), eof) for d, eof in inputs] == expect
    assert b"".join(d for d, _ in inputs) == b"".join(bytes([i]) * s for i, s in enumerate(sizes))


def test_upload_tar_takes_an_async_iterable():
    """Not refused as a wrong type before anything is sent (upload_tar checks its argument first)."""
    sb = Sandbox(None, "abc123def456", {})
    with pytest.raises(TypeError, match="upload_tar: give a binary file object"):
        asyncio.run(sb.upload_tar(object(), "/work/x"))
    with pytest.raises(AttributeError):             # past the check: the (missing) client's turn
        asyncio.run(sb.upload_tar(_pieces(10), "/work/x"))


def test_an_async_iterable_left_half_read_is_closed():
    """A put that ends before the caller's async generator does (the daemon
    refused the tar, the copy was cancelled) closes it: its finally runs
    now, not at garbage collection."""
    closed = []

    class Refusing(_Recorder):
        async def request(self, op: str, **args) -> dict:
            raise ConnectionResetError("the put was refused")

    async def tar():
        try:
            for _ in range(10):
                yield b"x" * 100
        finally:
            closed.append(True)

    async def run():
        sent = asyncio.Event()
        sent.set()
        sb = Sandbox(Refusing(), "abc123def456", {})
        chunks = tar()
        with pytest.raises(ConnectionResetError):
            await sb._feed_tar(1, sent, chunks, 4096)
        return closed[:]

    assert asyncio.run(run()) == [True]
