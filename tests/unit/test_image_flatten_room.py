"""A flatten (fs/images.py, fs/flatten.py) checks first that its merged
tree and the EROFS layer packed from it fit on the scratch dir's file
system, and refuses up front, saying how much it needs and how much is
free where, if they do not; one whose room goes meanwhile (another writer
fills the disk) stops with ENOSPC. Either way nothing is left in the
scratch dir or the store's temp dir. The store and scratch dir are on a
small tmpfs of the test's own (root; needs mkfs.erofs)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

import pytest

from dsecd import native
from dsecd.fs import flatten
from dsecd.fs.images import ImageError, ImageStore

pytestmark = [pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils"),
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")]

MiB = 1 << 20
FS_BYTES = 64 * MiB
FILE = 4 * MiB


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of FS_BYTES on tmp_path/fs, unmounted after the test."""
    where = tmp_path / "fs"
    where.mkdir()
    fd = native.upperfs_create(FS_BYTES, 4096)
    try:
        native.upperfs_attach(fd, str(where))
    finally:
        os.close(fd)
    try:
        yield where
    finally:
        native.umount(str(where), detach=True)


def _chain(tmp_path, fs, *layers: dict[str, int]) -> tuple[ImageStore, list[str]]:
    """An image `app` of `layers` (bottom first), stored on `fs`, and their
    trees as their mounts show them."""
    images = ImageStore(fs / "store", fs / "scratch")
    dirs, parent = [], None
    for n, files in enumerate(layers):
        d = tmp_path / f"l{n}"
        d.mkdir()
        for rel, size in files.items():
            (d / rel).write_bytes(os.urandom(size))
        dirs.append(str(d))
        images.build_from_dir(dirs[-1], "app" if n == len(layers) - 1 else f"l{n}", parent=parent)
        parent = f"l{n}"
    return images, dirs


def _free(fs) -> int:
    st = os.statvfs(fs)
    return st.f_bavail * st.f_frsize


def _reserve(fs) -> int:
    st = os.statvfs(fs)
    return min(1 << 30, st.f_blocks * st.f_frsize // 20)


def _leave_free(fs, name: str, left: int) -> None:
    """Another writer: a file on `fs` that leaves only `left` bytes free there."""
    take = _free(fs) - left
    assert take > 0, (take, left)
    fd = os.open(fs / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, take)
    finally:
        os.close(fd)


def _fill(fs, name: str) -> None:
    """Another writer taking every byte left on `fs`."""
    fd = os.open(fs / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for chunk in (b"\0" * MiB, b"\0" * 4096):
            try:
                while True:
                    os.write(fd, chunk)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)
    assert _free(fs) < 4096 * 2


def _nothing_left(images: ImageStore) -> None:
    assert os.listdir(images.scratch) == [], "the flatten left its merged tree in the scratch dir"
    assert os.listdir(images.store.tmp) == [], "the flatten left a layer file in the store's temp dir"
    with pytest.raises(ImageError):
        images.get("flat")


def test_a_flatten_that_cannot_fit_is_refused_before_it_writes(tmp_path, small_fs):
    images, dirs = _chain(tmp_path, small_fs, {"a": FILE}, {"b": FILE})
    # Room for the merged tree (both files) but not for it and its EROFS layer.
    _leave_free(small_fs, "other-writer", _reserve(small_fs) + 3 * FILE)
    steps = []
    with pytest.raises(ImageError) as info:
        images.flatten("app", "flat", lambda _digests: contextlib.nullcontext(dirs), steps.append)
    err = info.value
    assert err.code == "io" and err.detail["errno"] == "ENOSPC", err
    assert "merge" not in {s["step"] for s in steps}, "the flatten started writing the merged tree"
    assert err.detail["path"] == str(images.scratch) and err.detail["free"] <= 3 * FILE, err.detail
    assert err.detail["need"] > 4 * FILE > err.detail["free"], err.detail
    assert f"needs about {err.detail['need']} bytes in {images.scratch}" in str(err), err
    assert f"{err.detail['free']} are free there" in str(err) and "dsec image rm" in str(err), err
    _nothing_left(images)


def test_files_a_layer_above_replaces_count_once_in_the_room_needed(tmp_path, small_fs):
    """A chain of snapshots rewriting one file: its layers' sizes add up to
    more than is free, what the flatten writes does not."""
    images, dirs = _chain(tmp_path, small_fs, {"a": FILE}, {"a": FILE}, {"a": FILE}, {"a": FILE})
    _leave_free(small_fs, "other-writer", _reserve(small_fs) + 3 * FILE)
    assert 2 * images.get("app").size > 3 * FILE
    flat = images.flatten("app", "flat", lambda _digests: contextlib.nullcontext(dirs))
    assert len(flat.layers) == 1 and os.listdir(images.scratch) == []


@pytest.mark.parametrize("step", ["merge", "mkfs.erofs"])
def test_room_gone_after_the_check_stops_the_flatten_and_leaves_nothing(tmp_path, small_fs, step):
    """The check passes, then another writer takes the room: while the tree
    is merged (the next file does not fit), or while mkfs.erofs packs it."""
    images, dirs = _chain(tmp_path, small_fs, {"a": FILE}, {"b": FILE})
    checked = []

    def progress(p: dict) -> None:
        if p["step"] == step and not checked:
            checked.append(p)
            _fill(small_fs, "other-writer")

    with pytest.raises(ImageError) as info:
        images.flatten("app", "flat", lambda _digests: contextlib.nullcontext(dirs), progress)
    err = info.value
    assert checked, "the flatten never got to the step"
    assert err.code == "io" and (err.detail or {}).get("errno") == "ENOSPC", (err, err.detail)
    assert "flatten of 'app'" in str(err) and "free space" in str(err).lower(), err
    _nothing_left(images)


def test_measure_counts_what_merge_writes(tmp_path):
    """flatten.measure over whiteouts, opaque directories, a directory over a
    file, a file over a directory and hard links gives the files merge writes."""
    low, mid, top = (tmp_path / n for n in ("low", "mid", "top"))
    for d in (low, mid, top):
        d.mkdir()
    (low / "gone").write_bytes(b"x" * 5000)
    (low / "kept").write_bytes(b"x" * 3000)
    (low / "hidden").mkdir()
    (low / "hidden" / "old").write_bytes(b"x" * 7000)
    (low / "file-then-dir").write_bytes(b"x" * 9000)
    (low / "dir-then-file").mkdir()
    (low / "dir-then-file" / "inner").write_bytes(b"x" * 11000)
    (low / "merged").mkdir()
    (low / "merged" / "below").write_bytes(b"x" * 100)
    os.mknod(mid / "gone", 0o20000 | 0o600, 0)                 # a whiteout
    (mid / "hidden").mkdir()
    os.setxattr(mid / "hidden", "trusted.overlay.opaque", b"y")
    (mid / "hidden" / "new").write_bytes(b"x" * 200)
    (mid / "file-then-dir").mkdir()
    (mid / "file-then-dir" / "f").write_bytes(b"x" * 300)
    (mid / "linked").write_bytes(b"x" * 4000)
    os.link(mid / "linked", mid / "linked-too")
    (top / "dir-then-file").write_bytes(b"x" * 400)
    (top / "merged").mkdir()
    (top / "merged" / "above").write_bytes(b"x" * 500)
    (top / "kept").write_bytes(b"x" * 600)
    layers = [str(low), str(mid), str(top)]
    tree = tmp_path / "tree"
    flatten.merge(layers, tree)
    inodes, dirs, entries = {}, 0, 0
    for root, ds, fs in os.walk(tree):
        dirs += len(ds)
        entries += len(ds) + len(fs)
        for name in fs:
            st = os.lstat(os.path.join(root, name))
            inodes[st.st_ino] = st.st_size
    measured = flatten.measure(layers)
    assert (measured.files, measured.data, measured.dirs, measured.entries) == \
        (len(inodes), sum(inodes.values()), dirs, entries)
