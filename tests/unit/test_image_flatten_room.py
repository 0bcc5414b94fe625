"""A flatten (fs/images.py, fs/flatten.py) checks first that its merged
tree and the EROFS layer packed from it fit on the scratch dir's file
system, bytes and inodes, and refuses up front, saying how much it needs
and how much is free where, if they do not; one whose room goes meanwhile
(another writer fills the disk) stops with ENOSPC. Either way nothing is
left in the scratch dir or the store's temp dir. The store and scratch dir
are on a small tmpfs of the test's own (root; needs mkfs.erofs)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path

import pytest

from dsecd import native
from dsecd.fs import flatten
from dsecd.fs.images import ImageError, ImageStore

pytestmark = [pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils"),
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")]

MiB = 1 << 20
FS_BYTES = 64 * MiB
FILE = 4 * MiB
FS_INODES = 1024


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of FS_BYTES on tmp_path/fs, unmounted after the test."""
    yield from _tmpfs(tmp_path, 4096)


@pytest.fixture
def few_inodes(tmp_path):
    """A tmpfs of FS_BYTES and FS_INODES inodes on tmp_path/fs, unmounted
    after the test."""
    yield from _tmpfs(tmp_path, FS_INODES)


def _tmpfs(tmp_path, inodes: int):
    where = tmp_path / "fs"
    where.mkdir()
    fd = native.upperfs_create(FS_BYTES, inodes)
    try:
        native.upperfs_attach(fd, str(where))
    finally:
        os.close(fd)
    try:
        yield where
    finally:
        native.umount(str(where), detach=True)


def _chain(tmp_path, fs, *layers: dict[str, int | None]) -> tuple[ImageStore, list[str]]:
    """An image `app` of `layers` (bottom first; a file of size None: a
    whiteout), stored on `fs`, and their trees as their mounts show them."""
    images = ImageStore(fs / "store", fs / "scratch")
    dirs, parent = [], None
    for n, files in enumerate(layers):
        d = tmp_path / f"l{n}"
        d.mkdir()
        for rel, size in files.items():
            if size is None:
                os.mknod(d / rel, 0o20000 | 0o600, 0)
            else:
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


def _refused_before_the_merge(images: ImageStore, dirs: list[str]) -> ImageError:
    """Flatten `dirs` as "flat": its error, an ENOSPC `io` raised before
    the merge began writing."""
    steps = []
    with pytest.raises(ImageError) as info:
        images.flatten("app", "flat", lambda _digests: contextlib.nullcontext(dirs), steps.append)
    err = info.value
    assert err.code == "io" and (err.detail or {}).get("errno") == "ENOSPC", (err, err.detail)
    assert "merge" not in {s["step"] for s in steps}, f"the flatten started writing the merged tree: {err}"
    return err


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


def test_a_flatten_whose_tree_holds_more_while_merged_is_refused_before_it_writes(tmp_path, small_fs):
    """The top layer writes a before its whiteouts remove b1 and b2: the
    finished tree and its layer fit, the tree as it is merged does not."""
    images, dirs = _chain(tmp_path, small_fs, {"b1": FILE, "b2": FILE}, {"a": FILE, "b1": None, "b2": None})
    _leave_free(small_fs, "other-writer", _reserve(small_fs) + 5 * FILE // 2)
    err = _refused_before_the_merge(images, dirs)
    assert err.detail["path"] == str(images.scratch) and err.detail["need"] == 3 * FILE, err.detail
    assert f"{3 * FILE} bytes at most while it is written, {FILE} once done" in str(err), err
    _nothing_left(images)


def test_a_flatten_stats_its_directories_once_and_the_scratch_once_a_file(tmp_path, small_fs, monkeypatch):
    """The check before the merge reads each directory's file system once,
    though it checks twice (the layers' sizes do not fit: the layers are
    measured, and what the merge writes is checked); the merge reads the
    scratch dir's free bytes again before each file it copies, once, for
    another writer may have taken them since."""
    images, dirs = _chain(tmp_path, small_fs, {"a": FILE}, {"a": FILE}, {"a": FILE}, {"a": FILE})
    _leave_free(small_fs, "other-writer", _reserve(small_fs) + 3 * FILE)
    watched = {images.scratch: "scratch", images.store.tmp: "layer dir"}
    calls: list[tuple[str, str, str]] = []
    phase = ["check"]

    def counting(call, name):
        def counted(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path) in watched:
                calls.append((phase[0], name, watched[Path(path)]))
            return call(path, *args, **kwargs)
        return counted

    merge, adding, measure, copies, measured = flatten.merge, flatten._State.adding, flatten.measure, [], []

    def merging(*args, **kwargs):
        phase[0] = "merge"
        try:
            return merge(*args, **kwargs)
        finally:
            phase[0] = "after"

    def copying(state, size, path):
        copies.extend([path] if size else [])
        return adding(state, size, path)

    def measuring(*args, **kwargs):
        measured.append(args[0])
        return measure(*args, **kwargs)

    monkeypatch.setattr(os, "stat", counting(os.stat, "stat"))
    monkeypatch.setattr(os, "statvfs", counting(os.statvfs, "statvfs"))
    monkeypatch.setattr(flatten, "merge", merging)
    monkeypatch.setattr(flatten._State, "adding", copying)
    monkeypatch.setattr(flatten, "measure", measuring)
    images.flatten("app", "flat", lambda _digests: contextlib.nullcontext(dirs))
    monkeypatch.undo()
    assert len(measured) == 1, measured
    check = sorted(c[1:] for c in calls if c[0] == "check")
    assert check == [("stat", "layer dir"), ("stat", "scratch"), ("statvfs", "scratch")], check
    during = [c[1:] for c in calls if c[0] == "merge"]
    assert during == [("statvfs", "scratch")] * len(copies) and copies, (during, copies)


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



def _tree_counts(top) -> tuple[int, int]:
    """(names under `top`, its bytes as Footprint.tree_bytes counts them:
    each file's in whole blocks once, a block for each directory)."""
    names, blocks, dirs = 0, {}, 0
    for root, ds, fs in os.walk(top):
        names += len(ds) + len(fs)
        dirs += len(ds)
        for name in fs:
            st = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(st.st_mode):
                blocks[st.st_ino] = -(-st.st_size // flatten.BLOCK) * flatten.BLOCK
    return names, sum(blocks.values()) + dirs * flatten.BLOCK


def _merge_most(layers: list[str], dest, monkeypatch) -> tuple[int, int]:
    """The most names and bytes (_tree_counts) merge(layers) had under
    `dest` at once: counted after each entry it applies (a name, a file's
    bytes, appear only as it applies one)."""
    most = [0, 0]
    tick = flatten._State.tick

    def counting(state, copied=0):
        most[:] = map(max, most, _tree_counts(dest))
        tick(state, copied)

    monkeypatch.setattr(flatten._State, "tick", counting)
    flatten.merge(layers, dest)
    return most[0], most[1]


def test_measure_counts_what_merge_holds_at_once(tmp_path, monkeypatch):
    """Files a layer adds before its whiteouts remove those of the layers
    below count at once; a file replaced, a directory merged into, or
    hidden (opaque) before what the layer puts in it, adds none."""
    low, mid, top = (tmp_path / n for n in ("low", "mid", "top"))
    for d in (low, mid, top):
        (d / "d").mkdir(parents=True)
    for n in range(5):
        (low / "d" / f"b{n}").write_bytes(b"x" * 5000)                # mid removes them after adding a*
        (mid / "d" / f"a{n}").write_bytes(b"y" * 100)
        os.mknod(mid / "d" / f"b{n}", 0o20000 | 0o600, 0)
    (low / "o").mkdir()
    for n in range(4):
        (low / "o" / f"old{n}").write_bytes(b"x" * 3000)              # top's opaque o hides them first
    (top / "o").mkdir()
    os.setxattr(top / "o", "trusted.overlay.opaque", b"y")
    for n in range(6):
        (top / "o" / f"new{n}").write_bytes(b"z" * 9000)
    (top / "d").rmdir()
    (top / "d").write_bytes(b"a file over the directory")
    layers = [str(low), str(mid), str(top)]
    tree = tmp_path / "tree"
    # low: d, 5 b*, o, 4 old*; mid adds 5 a* before removing the b*; top
    # replaces d (its a* go) and o's contents by 6 new*.
    measured = flatten.measure(layers)
    assert (measured.most_entries, measured.entries) == (11 + 5, 2 + 6)
    assert _merge_most(layers, tree, monkeypatch) == (measured.most_entries, measured.most_tree_bytes)
    assert _tree_counts(tree) == (measured.entries, measured.tree_bytes())
    assert measured.most_tree_bytes > measured.tree_bytes()


def test_measure_counts_a_layer_removing_before_it_adds_once(tmp_path, monkeypatch):
    """A layer whose whiteout sorts before what it adds holds no more at
    once than the layers below; hard links count a file's bytes once."""
    low, mid, top = (tmp_path / n for n in ("low", "mid", "top"))
    for d in (low, mid, top):
        d.mkdir()
    (low / "a").mkdir()
    for n in range(5):
        (low / "a" / f"f{n}").write_bytes(b"x" * 5000)
    os.mknod(mid / "a", 0o20000 | 0o600, 0)                           # a whiteout, before the b* added
    for n in range(3):
        (mid / f"b{n}").write_bytes(b"y" * 3000)
    (mid / "l").write_bytes(b"linked" * 1000)
    os.link(mid / "l", mid / "l2")
    (top / "b0").mkdir()                                              # a directory over a file
    (top / "b0" / "in").write_bytes(b"z")
    (top / "l").write_bytes(b"l2 keeps the file")                     # a name of a linked file replaced
    layers = [str(low), str(mid), str(top)]
    tree = tmp_path / "tree"
    measured = flatten.measure(layers)
    assert (measured.most_entries, measured.entries) == (6, 6)
    assert _merge_most(layers, tree, monkeypatch) == (measured.most_entries, measured.most_tree_bytes)
    assert _tree_counts(tree) == (measured.entries, measured.tree_bytes())
    assert measured.most_tree_bytes == flatten.BLOCK + 5 * 2 * flatten.BLOCK         # low's a and f*


# Files a layer below writes and the one above removes, as many as it adds.
SWAPPED = 200


def _swapping_chain(tmp_path, fs) -> tuple[ImageStore, list[str]]:
    """An image `app` of two layers: the bottom one's directory d holds
    SWAPPED files b*, the top one's removes them all (whiteouts) and adds
    as many a*, which merge writes first (it takes a directory's entries by
    name). The finished tree has 1 + SWAPPED names; while it is merged,
    1 + 2 * SWAPPED."""
    low, top = tmp_path / "low", tmp_path / "top"
    for d in (low, top):
        (d / "d").mkdir(parents=True)
    for n in range(SWAPPED):
        (low / "d" / f"b{n:03}").write_bytes(b"x")
        (top / "d" / f"a{n:03}").write_bytes(b"y")
        os.mknod(top / "d" / f"b{n:03}", 0o20000 | 0o600, 0)         # a whiteout
    images = ImageStore(fs / "store", fs / "scratch")
    images.build_from_dir(str(low), "low")
    images.build_from_dir(str(top), "app", parent="low")
    return images, [str(low), str(top)]


def _inodes_room(fs) -> int:
    """The inodes a flatten may take on `fs` once it made its work dir."""
    st = os.statvfs(fs)
    return st.f_favail - min(1 << 16, st.f_files // 20) - 1


def _leave_inodes(fs, left: int) -> None:
    """Another writer: empty files on `fs` until a flatten there may take
    only `left` inodes."""
    (fs / "other-writer").mkdir()
    for n in range(_inodes_room(fs) - left):
        (fs / "other-writer" / str(n)).touch()
    assert _inodes_room(fs) == left


# What the swapping chain's flatten takes at most: the tree's root, d, and
# SWAPPED b* and SWAPPED a* at once (the layer file mkfs.erofs writes on the
# same file system comes with the finished tree, smaller).
SWAP_NEEDS = 1 + 1 + 2 * SWAPPED
# What the finished tree and the layer file take: the root, d, SWAPPED a*.
FINISHED_NEEDS = 1 + 1 + SWAPPED + 1


@pytest.mark.parametrize("left", [FINISHED_NEEDS, SWAP_NEEDS - 1], ids=["finished-tree", "one-short"])
def test_a_flatten_past_the_free_inodes_is_refused_before_it_writes(tmp_path, few_inodes, left):
    """The finished tree's names fit in the free inodes; the merge's, while
    the top layer's files are written before its whiteouts remove those
    below, do not: the merge would fail midway (with FINISHED_NEEDS left,
    even past what stays free for other writers), or leave none."""
    images, dirs = _swapping_chain(tmp_path, few_inodes)
    _leave_inodes(few_inodes, left)
    err = _refused_before_the_merge(images, dirs)
    assert err.detail == {"errno": "ENOSPC", "path": str(images.scratch), "need_inodes": SWAP_NEEDS,
                          "free_inodes": left}, err.detail
    assert f"takes up to {SWAP_NEEDS} inodes in {images.scratch}" in str(err), err
    assert f"{left} are free there" in str(err) and "dsec image rm" in str(err), err
    _nothing_left(images)


def test_a_flatten_that_just_fits_in_the_free_inodes_is_done(tmp_path, few_inodes):
    """What the check counts is what the merge takes: with that many inodes
    free, the flatten gets through."""
    images, dirs = _swapping_chain(tmp_path, few_inodes)
    _leave_inodes(few_inodes, SWAP_NEEDS)
    flat = images.flatten("app", "flat", lambda _digests: contextlib.nullcontext(dirs))
    assert len(flat.layers) == 1 and os.listdir(images.scratch) == []
