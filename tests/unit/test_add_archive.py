"""ADD of a local archive (dsecd/build/copyin.py, extract_archive) into a
directory standing in for a build sandbox's root: what it refuses names
the archive as the Dockerfile does, and the entry at fault. No root."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

import pytest

from dsecd.build import copyin


def _archive(members: list[tarfile.TarInfo]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for m in members:
            tf.addfile(m, io.BytesIO(b"x" * m.size) if m.isreg() else None)
    buf.seek(0)
    return buf


def _entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname = kind, link
    m.size = 1 if kind == tarfile.REGTYPE else 0
    return m


@pytest.mark.parametrize("members,words", [
    ([_entry("../../escape")], "entry '../../escape' has a '..' component"),
    ([_entry("/etc/x")], "entry '/etc/x' has an absolute name"),
    ([_entry("h", tarfile.LNKTYPE, "/etc/passwd")], "hard link h -> /etc/passwd: entry '/etc/passwd' has an absolute"),
    ([_entry("h", tarfile.LNKTYPE, "nothing")], "hard link h -> nothing: the target is not a file the archive"),
])
def test_a_refused_entry_names_the_archive_and_the_entry(tmp_path, members, words):
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(copyin.CopyError) as err:
            copyin.extract_archive(root, _archive(members), "pkg/app.tar", "/dst", (os.getuid(), os.getgid()),
                                   lambda uid, gid: (uid, gid), None)
    finally:
        os.close(root)
    assert str(err.value).startswith("pkg/app.tar: ") and words in str(err.value)


def test_a_full_writable_layer_names_the_limits_that_bound_it(tmp_path, monkeypatch):
    """ENOSPC while writing a step's files is its writable layer's cap, which
    the daemon's [build] settings set: the error says which, not only
    "No space left on device"."""
    import errno

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(copyin, "_write_file", full)
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(copyin.CopyError) as err:
            copyin.extract_archive(root, _archive([_entry("big")]), "big.tar", "/dst", (os.getuid(), os.getgid()),
                                   lambda uid, gid: (uid, gid), None)
    finally:
        os.close(root)
    assert "big.tar: /dst/big: No space left on device" in str(err.value)
    assert "[build] disk and memory" in str(err.value)


def test_a_source_gone_during_the_copy_is_named_by_its_context_path(tmp_path):
    """The daemon reads the context where it attached it (a path of its
    own); a file removed from the context between the plan and the copy is
    named as the Dockerfile names it, below the context."""
    from dsecd.build.context import BuildContext

    ctx, root = tmp_path / "ctx", tmp_path / "root"
    (ctx / "src" / "pkg").mkdir(parents=True)
    (ctx / "src" / "pkg" / "mod.py").write_text("x\n")
    root.mkdir()
    sources = BuildContext.open(str(ctx)).sources("src")
    (ctx / "src" / "pkg" / "mod.py").unlink()
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(copyin.CopyError) as err:
            copyin.copy_sources(rootfd, sources, "/app/", None, None)
    finally:
        os.close(rootfd)
    assert str(err.value) == "src/pkg/mod.py was removed from the build context during the build"


def test_a_copy_that_reads_other_bytes_than_its_key_fails_and_the_digest_is_forgotten(tmp_path):
    """A file rewritten within its times' granularity (or through a
    mapping) keeps its size and times: the cached digest is stale. The copy
    reads other bytes than the key hashed: it fails, naming the file, and
    the digest goes from the cache so that the next build hashes it anew."""
    from dsecd.build.context import BuildContext, DigestCache

    ctx, root = tmp_path / "ctx", tmp_path / "root"
    ctx.mkdir()
    root.mkdir()
    f = ctx / "app.py"
    f.write_text("old\n")
    context = BuildContext.open(str(ctx))
    cache = DigestCache()
    key = context.digest(context.sources("app.py"), cache)
    f.write_text("new\n")
    st = os.stat(f)
    # A write the times did not show: the cache holds the old bytes' digest
    # under the file's size and times as they are now.
    cache._cache[(st.st_dev, st.st_ino)] = ((st.st_size, st.st_mtime_ns, st.st_ctime_ns),
                                            hashlib.sha256(b"old\n").hexdigest())
    sources = context.sources("app.py")
    assert context.digest(sources, cache) == key                # stale: the old bytes' key
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(copyin.ChangedSinceHashed) as err:
            copyin.copy_sources(rootfd, sources, "/app/", None, None)
    finally:
        os.close(rootfd)
    assert "app.py changed in the build context during the build, after it was hashed" in str(err.value)
    assert err.value.file == (st.st_dev, st.st_ino)
    cache.forget(err.value.file)
    sources = context.sources("app.py")
    assert context.digest(sources, cache) != key                # hashed anew
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        copyin.copy_sources(rootfd, sources, "/app/", None, None)
    finally:
        os.close(rootfd)
    assert (root / "app" / "app.py").read_text() == "new\n"


@pytest.mark.parametrize("error,says", [
    (FileNotFoundError(2, "No such file or directory"), "app.py was removed while the build read the context"),
    (PermissionError(13, "Permission denied"), "app.py: cannot read it: Permission denied"),
])
def test_a_source_that_cannot_be_hashed_is_named_by_its_context_path(tmp_path, monkeypatch, error, says):
    """Hashing a COPY's files for the step cache: a file gone meanwhile, or
    one the daemon may not read (root squashed on NFS, say), is named below
    the context, not by the daemon's path to it nor as the whole context."""
    from dsecd.build import context as buildctx

    (tmp_path / "app.py").write_text("x\n")
    ctx = buildctx.BuildContext.open(str(tmp_path))
    sources = ctx.sources("app.py")

    def fail(self, fd, stop=None, max_bytes=0):
        raise error

    monkeypatch.setattr(buildctx.DigestCache, "file_digest", fail)
    with pytest.raises(buildctx.ContextError) as err:
        ctx.digest(sources, buildctx.DigestCache())
    assert str(err.value) == says


def test_a_copy_past_the_steps_layer_bound_is_refused_as_it_writes(tmp_path):
    """The plan bounds a step's sources by their sizes; a source that grew
    since is held to the bound by the copy itself, over all its files."""
    from dsecd.build.context import BuildContext

    ctx, root = tmp_path / "ctx", tmp_path / "root"
    (ctx / "src").mkdir(parents=True)
    root.mkdir()
    for name in ("a", "b"):
        (ctx / "src" / name).write_bytes(b"x" * 600)
    sources = BuildContext.open(str(ctx)).sources("src")
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(copyin.CopyTooLarge) as err:
            copyin.copy_sources(rootfd, sources, "/app/", None, None, budget=copyin.LayerBudget(1000))
    finally:
        os.close(rootfd)
    assert err.value.max_bytes == 1000
    assert str(err.value).startswith("/app/b: what the step writes adds up to more than a step's layer may hold "
                                     "(images.max_layer_bytes (1000 bytes))")


def test_an_archive_that_unpacks_past_the_steps_layer_bound_is_refused(tmp_path):
    """A few bytes of gzip unpack to far more: ADD's extraction is held to
    the step's bound as it writes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("zeros")
        info.size = 1 << 20
        tf.addfile(info, io.BytesIO(bytes(1 << 20)))
    assert len(buf.getvalue()) < 4096
    buf.seek(0)
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(copyin.CopyTooLarge) as err:
            copyin.extract_archive(root, buf, "zeros.tgz", "/dst", (os.getuid(), os.getgid()),
                                   lambda uid, gid: (uid, gid), None, budget=copyin.LayerBudget(64 << 10))
    finally:
        os.close(root)
    assert str(err.value).startswith("zeros.tgz: /dst/zeros: what the step writes adds up to more than")
