"""What a directory copy into a sandbox says of a stream that is not a tar
(dsecd/fs/tarcopy.py put_tree), run against a plain directory as the root."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import stat
import tarfile

import pytest

from dsecd.fs import tarcopy
from dsecd.fs.files import PathError


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("hello.txt")
        info.size = 5
        tf.addfile(info, io.BytesIO(b"hello"))
    return buf.getvalue()


def _put(root, data: bytes) -> dict:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return tarcopy.put_tree(fd, "/copy", io.BytesIO(data), 100, 1 << 20)
    finally:
        os.close(fd)


@pytest.mark.parametrize("compress,name", [(gzip.compress, "gzip"), (bz2.compress, "bzip2"),
                                           (lzma.compress, "xz")])
def test_a_compressed_tar_is_refused_saying_so(tmp_path, compress, name):
    """docker cp and put_archive take a .tar.gz; this copy takes a plain tar,
    and says so rather than only "invalid header"."""
    with pytest.raises(PathError) as info:
        _put(tmp_path, compress(_tar()))
    assert f"a {name}-compressed stream" in str(info.value), info.value
    assert "decompress it first" in str(info.value)
    assert os.listdir(tmp_path) == []               # nothing left


def test_garbage_is_not_called_compressed(tmp_path):
    with pytest.raises(PathError) as info:
        _put(tmp_path, b"garbage" * 100)
    assert str(info.value).startswith("the tar stream is not a valid archive"), info.value
    assert "compressed" not in str(info.value)


def _tar_of(n: int) -> bytes:
    """n files of 3 bytes: each entry its header block and one data block."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(n):
            info = tarfile.TarInfo(f"f{i}")
            info.size = 3
            tf.addfile(info, io.BytesIO(b"abc"))
    return buf.getvalue()


# Where a tar of three entries (1024 bytes each) may be cut: at the second
# entry's header, inside it, and where the end-of-archive block should begin.
CUTS = [1024, 1024 + 100, 3 * 1024]


@pytest.mark.parametrize("cut", CUTS)
def test_a_tar_cut_at_or_in_a_header_is_refused(tmp_path, cut):
    """tarfile's stream reader ends quietly where its input does at an
    entry's header: the copy must not pass for a whole one of fewer files."""
    with pytest.raises(PathError, match="cut short"):
        _put(tmp_path, _tar_of(3)[:cut])
    assert os.listdir(tmp_path) == []


def test_a_whole_tar_without_its_padding_is_taken(tmp_path):
    """One zero block is the end; the rest of the record is padding a writer may leave out."""
    assert _put(tmp_path, _tar_of(3)[:3 * 1024 + 512])["count"] == 3
    assert sorted(os.listdir(tmp_path / "copy")) == ["f0", "f1", "f2"]


@pytest.mark.parametrize("cut", CUTS)
def test_a_microvm_put_refuses_a_cut_tar_too(cut):
    """The microVM backend reads the tar on the host the same way
    (engine/vmfiles.py _put_records) before its records reach the guest."""
    from dsecd.engine.vmfiles import _put_records

    sent: list[tuple[bytes, bool]] = []
    with pytest.raises(tarfile.ReadError, match="cut short"):
        _put_records(io.BytesIO(_tar_of(3)[:cut]), lambda data, eof: sent.append((data, eof)), 100, 1 << 20)
    assert not any(eof for _, eof in sent)          # no end record: the guest's child removes what it made
    _put_records(io.BytesIO(_tar_of(3)), lambda data, eof: sent.append((data, eof)), 100, 1 << 20)
    assert sent[-1][1]


def _only_a_file() -> bytes:
    """`tar -cf - a/b/f` names the file alone: no entries for a or a/b."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("a/b/f")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"hi"))
    return buf.getvalue()


def test_directories_the_archive_does_not_name_get_0755(tmp_path):
    """Made 0700 while the copy runs; left so, a sandbox's non-root user
    could not reach the files in them."""
    _put(tmp_path, _only_a_file())
    modes = {rel: stat.S_IMODE(os.stat(tmp_path / "copy" / rel).st_mode) for rel in ("", "a", "a/b")}
    assert modes == {"": 0o755, "a": 0o755, "a/b": 0o755}


def test_a_microvm_put_gives_them_0755_too():
    import struct

    from dsecd.engine.vmfiles import _put_records

    out = bytearray()
    _put_records(io.BytesIO(_only_a_file()), lambda data, eof: out.extend(data), 100, 1 << 20)
    modes, pos = {}, 0
    while pos < len(out):                   # kind, name length, name, mode, mtime, size, data
        kind = out[pos:pos + 1]
        (n,) = struct.unpack(">I", out[pos + 1:pos + 5])
        name = out[pos + 5:pos + 5 + n].decode()
        mode, _, size = struct.unpack(">IQQ", out[pos + 5 + n:pos + 25 + n])
        pos += 25 + n + size               # a file's bytes follow its record, as other kinds' data
        if kind == b"D":
            modes[name] = mode
    assert modes == {"": 0o755, "a": 0o755, "a/b": 0o755}


def _damaged_second_header() -> bytes:
    """A tar of three entries whose second header block is not a header (its
    checksum does not match: a corrupt or spliced stream)."""
    data = bytearray(_tar_of(3))
    data[1024:1024 + 8] = b"garbage!"
    return bytes(data)


def test_a_tar_whose_header_is_damaged_is_refused(tmp_path):
    """tarfile's stream reader also ends quietly at a block after the first
    that is no header: the copy must not pass for a whole one of the
    entries before it."""
    with pytest.raises(PathError, match="not a valid archive"):
        _put(tmp_path, _damaged_second_header())
    assert os.listdir(tmp_path) == []


def test_a_microvm_put_refuses_a_damaged_header_too():
    from dsecd.engine.vmfiles import _put_records

    sent: list[tuple[bytes, bool]] = []
    with pytest.raises(tarfile.ReadError):
        _put_records(io.BytesIO(_damaged_second_header()), lambda data, eof: sent.append((data, eof)), 100, 1 << 20)
    assert not any(eof for _, eof in sent)
