"""What a directory copy into a sandbox says of a stream that is not a tar
(dsecd/fs/tarcopy.py put_tree), run against a plain directory as the root."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
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
