"""dsec cp -'s stdin side (dsecd/cptar.py): a compressed tar undone a piece
at a time, and stdin's reads gathered into frames without holding a slow
stream back (no daemon)."""

from __future__ import annotations

import asyncio
import bz2
import gzip
import lzma
import os

import pytest

from dsecd import cptar
from dsecd.errors import BadRequest


async def _chunks(data: bytes, step: int):
    for start in range(0, len(data), step):
        yield data[start:start + step]


def _undone(data: bytes, step: int = 1000) -> list[bytes]:
    async def run() -> list[bytes]:
        return [piece async for piece in cptar.decompressed(_chunks(data, step))]

    return asyncio.run(run())


TAR_LIKE = os.urandom(50_000) + b"\0" * 100_000


@pytest.mark.parametrize("compress", [gzip.compress, lzma.compress, bz2.compress, lambda d: d],
                         ids=["gzip", "xz", "bzip2", "plain"])
def test_each_form_comes_out_as_the_bytes_it_holds(compress):
    assert b"".join(_undone(compress(TAR_LIKE))) == TAR_LIKE


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress], ids=["gzip", "bzip2", "xz"])
def test_streams_one_after_another_are_undone_in_turn(compress):
    """pigz, pbzip2, cat a.gz b.gz: one stream after the other."""
    assert b"".join(_undone(compress(b"first ") + compress(b"second"), step=7)) == b"first second"


def test_what_a_little_gzip_stands_for_comes_in_bounded_pieces():
    pieces = _undone(gzip.compress(b"\0" * (20 << 20)), step=1 << 20)
    assert sum(map(len, pieces)) == 20 << 20 and max(map(len, pieces)) <= cptar.PIECE


@pytest.mark.parametrize("compress,name", [(gzip.compress, "gzip"), (lzma.compress, "xz"), (bz2.compress, "bzip2")])
def test_a_compressed_stream_cut_short_is_said_to_be(compress, name):
    with pytest.raises(BadRequest, match=f"stdin's {name} stream ends before its end"):
        _undone(compress(TAR_LIKE)[:-30])


def test_zstd_is_named_and_refused():
    with pytest.raises(BadRequest, match="zstd-compressed stream, which dsec cp does not undo"):
        _undone(b"\x28\xb5\x2f\xfd" + b"\0" * 100)


def _batches(pieces, size: int, patience: float, pause: float = 0.0) -> list[bytes]:
    async def source():
        for i, piece in enumerate(pieces):
            if i and pause:
                await asyncio.sleep(pause)
            yield piece

    async def run() -> list[bytes]:
        return [b async for b in cptar.batched(source(), size, patience)]

    return asyncio.run(run())


def test_reads_are_gathered_into_whole_batches():
    assert _batches([b"a" * 3, b"b" * 4, b"c" * 5], size=5, patience=60) == [b"aaabb", b"bbccc", b"cc"]


def test_a_stream_that_trickles_in_is_not_held_back_for_a_batch():
    """What came goes on once it waited `patience`, though the batch is not full."""
    assert _batches([b"a", b"b", b"c"], size=1 << 20, patience=0.01, pause=0.3) == [b"a", b"b", b"c"]


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress], ids=["gzip", "bzip2", "xz"])
@pytest.mark.parametrize("cut", [0, 1, 2], ids=["at", "1-after", "2-after"])
def test_a_read_that_ends_where_a_stream_does_does_not_end_the_undoing(compress, cut):
    """pbzip2 writes one stream at a time: a pipe's read often ends with
    one, or a byte or two of the next's magic, and the next read brings
    the rest of the next stream."""
    first = compress(b"first ")
    whole = first + compress(b"second")
    at = len(first) + cut

    async def chunks():
        yield whole[:at]
        yield whole[at:]

    async def run() -> bytes:
        return b"".join([piece async for piece in cptar.decompressed(chunks())])

    assert asyncio.run(run()) == b"first second"


@pytest.mark.parametrize("magic,name", [(b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2")])
def test_a_damaged_compressed_stream_is_said_to_be(magic, name):
    """Bytes that begin as a compressed stream does but are none: the error
    says what stdin is, not the decompressor's own exception (which the CLI
    would show as a traceback)."""
    with pytest.raises(BadRequest, match=f"stdin's {name} stream is damaged"):
        _undone(magic + b"garbage" * 10)


def test_a_stream_damaged_after_its_start_is_said_to_be():
    data = bytearray(gzip.compress(TAR_LIKE))
    data[len(data) // 2:len(data) // 2 + 64] = b"\xff" * 64
    with pytest.raises(BadRequest, match="stdin's gzip stream is damaged"):
        _undone(bytes(data))


def test_a_plain_tar_whose_first_name_begins_as_a_magic_does_is_not_undone():
    """A tar begins with its first entry's name: `tar -cf - BZh9-notes`
    begins as a bzip2 stream does, but its header says it is a tar."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo("BZh91AY&SY")
        info.size = 5
        tf.addfile(info, io.BytesIO(b"hello"))
    assert b"".join(_undone(buf.getvalue(), step=100)) == buf.getvalue()


@pytest.mark.parametrize("step", [1, 3, 1000], ids=["bytewise", "odd-reads", "one-read"])
def test_xz_stream_padding_between_and_after_streams_is_read_as_xz_reads_it(step):
    """xz -d takes null bytes after a stream, a multiple of 4 of them,
    before the next stream or the input's end (xz's stream padding)."""
    data = lzma.compress(b"first ") + b"\0" * 8 + lzma.compress(b"second") + b"\0" * 4
    assert b"".join(_undone(data, step=step)) == b"first second"


@pytest.mark.parametrize("tail", [b"\0" * 3, b"\0" * 5 + lzma.compress(b"second")], ids=["at-end", "between"])
def test_xz_stream_padding_not_a_multiple_of_4_is_refused(tail):
    with pytest.raises(BadRequest, match="xz stream padding of .* not a multiple of 4"):
        _undone(lzma.compress(b"first ") + tail, step=5)


def test_bytes_after_an_xz_stream_that_are_no_stream_are_refused():
    """xz -d refuses what follows a stream and is neither padding nor a
    stream: the rest of the input would be lost without a word."""
    with pytest.raises(BadRequest, match="xz stream is followed by bytes that are"):
        _undone(lzma.compress(b"first ") + b"\0" * 4 + b"garbage")


@pytest.mark.parametrize("size", [1, 80, 86, 87, 88, 200, 994, 995, 996])
def test_a_name_that_is_not_utf8_is_written_as_its_bytes_without_hdrcharset(tmp_path, size):
    """GNU tar knows no hdrcharset record and warns of one: the name's
    bytes go into the path record alone, whose length (its own digits
    counted) tarfile and tar check; tarfile reads the bytes back. Sizes
    cross the lengths where the record's count gains a digit."""
    import io
    import tarfile

    name = os.fsdecode(b"\xff" * size)
    info = cptar.RawNameTarInfo(name)
    info.size = 2
    out = tmp_path / "t.tar"
    with open(out, "wb") as f:
        cptar.one_file_tar(info, io.BytesIO(b"ab"), f.fileno())
    data = out.read_bytes()
    assert b"hdrcharset" not in data
    with tarfile.open(out, encoding="utf-8", errors="surrogateescape") as tf:
        (m,) = tf.getmembers()
        assert os.fsencode(m.name) == b"\xff" * size and tf.extractfile(m).read() == b"ab"
