"""A COPY or ADD of a cancelled build stops (dsecd/build/copyin.py): its
stop is checked before each entry and each chunk of a file's bytes."""

from __future__ import annotations

import io
import os
import tarfile
import threading

import pytest
from stop_kit import SetAfter

from dsecd.build import copyin
from dsecd.build.context import BuildContext, DigestCache


@pytest.fixture
def dirs(tmp_path):
    ctx, root = tmp_path / "ctx", tmp_path / "root"
    ctx.mkdir()
    root.mkdir()
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    yield ctx, root, rootfd
    os.close(rootfd)


def test_a_stop_ends_a_copy_between_files(dirs):
    ctx, root, rootfd = dirs
    (ctx / "src").mkdir()
    for i in range(10):
        (ctx / "src" / f"f{i}").write_bytes(b"x")
    sources = BuildContext.open(str(ctx)).sources("src")
    with pytest.raises(copyin.CopyStopped):
        copyin.copy_sources(rootfd, sources, "/app/", None, None, SetAfter(6))
    # Each file looks at the stop three times: before it is put, before its
    # one chunk and before the read that finds its end.
    assert sorted(os.listdir(root / "app")) == ["f0", "f1"]


@pytest.mark.parametrize("hashed", [True, False], ids=["checked-against-its-key", "sent"])
def test_a_stop_ends_a_copy_within_a_large_file(dirs, hashed):
    ctx, root, rootfd = dirs
    (ctx / "big").write_bytes(b"y" * (8 * copyin.COPY_CHUNK))
    context = BuildContext.open(str(ctx))
    sources = context.sources("big")
    if hashed:
        context.digest(sources, DigestCache())
    # Looked at before the file (1), then before each of its chunks: two written.
    with pytest.raises(copyin.CopyStopped):
        copyin.copy_sources(rootfd, sources, "/big", None, None, SetAfter(3))
    assert os.path.getsize(root / "big") == 2 * copyin.COPY_CHUNK


def test_a_stop_ends_an_archives_extraction(dirs):
    _, root, rootfd = dirs
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(5):
            info = tarfile.TarInfo(f"f{i}")
            info.size = 1
            tf.addfile(info, io.BytesIO(b"z"))
    buf.seek(0)
    stop = threading.Event()
    hashed = copyin.HashedReader(buf, None, "a.tar", stop)
    with pytest.raises(copyin.CopyStopped):
        copyin.extract_archive(rootfd, hashed, "a.tar", "/x", (os.getuid(), os.getgid()),
                               lambda uid, gid: (uid, gid), None, SetAfter(4))
    assert sorted(os.listdir(root / "x")) == ["f0", "f1"]
    stop.set()
    with pytest.raises(copyin.CopyStopped):
        hashed.check()
