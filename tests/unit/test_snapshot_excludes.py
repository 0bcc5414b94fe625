"""A snapshot's exclude paths (dsecd/fs/erofs.py, images.py): however a
path is spelt, what mkfs.erofs leaves out is what the size bound and the
no-change check leave out. No root; needs mkfs.erofs."""

from __future__ import annotations

import os
import shutil
import threading
import time
from types import SimpleNamespace

import pytest

from dsecd.engine.images import check_excludes
from dsecd.errors import BadRequest
from dsecd.fs import erofs
from dsecd.fs.images import ImageError, check_apparent_size, has_changes

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")

SPELLINGS = ["work/a", "/work/a", "/work/a/", "//work//a", "/work/./a", "./work/a"]


def _tree(tmp_path):
    top = tmp_path / "upper"
    (top / "work" / "a" / "b").mkdir(parents=True)
    (top / "work" / "a" / "b" / "f").write_bytes(b"x" * 100_000)
    (top / "work" / "keep").write_text("k")
    return top


@pytest.mark.parametrize("spelt", SPELLINGS)
def test_every_spelling_leaves_the_same_out(tmp_path, spelt):
    top = _tree(tmp_path)
    erofs.build(top, tmp_path / "plain.erofs", ["work/a"])
    erofs.build(top, tmp_path / "spelt.erofs", [spelt])
    erofs.build(top, tmp_path / "all.erofs", [])
    plain = (tmp_path / "plain.erofs").read_bytes()
    assert (tmp_path / "spelt.erofs").read_bytes() == plain
    assert (tmp_path / "all.erofs").read_bytes() != plain
    # The bound on what is packed counts what is packed: 1 byte, not 100 KB.
    assert check_apparent_size(top, [spelt], 10) == 1
    assert has_changes(top, [spelt, "work/keep"]) is False


@pytest.mark.parametrize("whole", ["/", "", ".", "//", "/./"])
def test_an_exclude_of_the_whole_root_is_refused(whole):
    with pytest.raises(BadRequest, match="the whole sandbox") as info:
        check_excludes([whole])
    assert info.value.detail == {"exclude": whole}


def test_a_full_disk_names_the_file_system_to_free(tmp_path, monkeypatch):
    """mkfs.erofs says only "Could not format the device: No space left on
    device"; the error names the file system the layer is written to, not
    just the tree it reads."""
    fake = tmp_path / "mkfs.erofs"
    fake.write_text("#!/bin/sh\necho '<E> erofs: \tCould not format the device : "
                    "[Error 28] No space left on device' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(erofs, "MKFS", str(fake))
    out = tmp_path / "store" / "tmp" / "x.erofs"
    with pytest.raises(erofs.ErofsError) as err:
        erofs.build(_tree(tmp_path), out)
    assert err.value.code == "io"
    assert f"free space on the file system of {out.parent}" in str(err.value)


def test_a_cancel_stops_mkfs_and_removes_its_half_written_layer(tmp_path, monkeypatch):
    """A cancelled snapshot does not wait for mkfs.erofs to write the rest
    of a layer nobody will store: it is killed, its file removed."""
    fake = tmp_path / "mkfs.erofs"
    fake.write_text('#!/bin/sh\necho part > "$5"\nexec sleep 60\n')      # $5: the output file
    fake.chmod(0o755)
    monkeypatch.setattr(erofs, "MKFS", str(fake))
    out = tmp_path / "x.erofs"
    cancelled = threading.Event()

    def cancel_once_written() -> None:
        while not out.exists():
            time.sleep(0.01)
        cancelled.set()

    threading.Thread(target=cancel_once_written, daemon=True).start()
    with pytest.raises(erofs.ErofsError) as err:
        erofs.build(_tree(tmp_path), out, cancelled=cancelled)
    assert err.value.code == "conflict" and not out.exists()


def test_a_failing_progress_report_kills_mkfs_and_removes_its_layer(tmp_path, monkeypatch):
    """A `written` that raises (its event loop gone) ended build() only once
    mkfs.erofs had written the whole layer, which was then left behind."""
    fake = tmp_path / "mkfs.erofs"
    fake.write_text('#!/bin/sh\necho part > "$5"\nexec sleep 60\n')      # $5: the output file
    fake.chmod(0o755)
    monkeypatch.setattr(erofs, "MKFS", str(fake))
    out = tmp_path / "x.erofs"

    def written(n: int) -> None:
        raise RuntimeError("Event loop is closed")

    with pytest.raises(RuntimeError):
        erofs.build(_tree(tmp_path), out, written=written)
    assert not out.exists()


def test_a_long_mkfs_tells_how_much_of_the_layer_it_has_written(tmp_path, monkeypatch):
    """While mkfs.erofs runs, `written` hears the size of the layer so far:
    a snapshot of gigabytes shows how far its pack has come. (The fake
    mkfs.erofs runs the real one once it has been heard, so the build ends
    with an image its uuid can be stamped in, or fails after 30 s.)"""
    flag = tmp_path / "heard"
    fake = tmp_path / "mkfs.erofs"
    fake.write_text(f'#!/bin/sh\nhead -c 5000 /dev/zero > "$5"\nn=0\nwhile [ ! -e {flag} ]; do\n'
                    f'  n=$((n+1)); [ $n -gt 600 ] && exit 1; sleep 0.05\ndone\nexec mkfs.erofs "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(erofs, "MKFS", str(fake))
    heard = []

    def written(n: int) -> None:
        heard.append(n)
        if n == 5000:
            flag.touch()

    erofs.build(_tree(tmp_path), tmp_path / "x.erofs", written=written)
    assert heard and heard[-1] == 5000


def test_hard_links_count_once_toward_the_size_bound(tmp_path):
    """A file with several names is one inode, which the layer stores once
    (conda and `git clone --local` link files by the thousand): its bytes
    count once toward images.max_snapshot_bytes, not once per name."""
    top = tmp_path / "upper"
    top.mkdir()
    (top / "model.bin").write_bytes(b"m" * 1000)
    for name in ("a", "b"):
        os.link(top / "model.bin", top / name)
    assert check_apparent_size(top, [], 2000) == 1000


@pytest.mark.parametrize("max_bytes, total", [(0, None), (10_000, 1000)])
def test_a_snapshot_walks_its_tree_for_a_bound_only(tmp_path, max_bytes, total):
    """The walk that checks images.max_snapshot_bytes also gives the pack's
    progress its total; with no bound (0) no walk is made for the total
    alone: the sandbox is frozen meanwhile, for as long as it has files."""
    import contextlib

    from dsecd.fs.images import ImageStore

    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "f").write_bytes(b"x" * 1000)
    seen = {}

    def build_layer(upper, total=None, **kw):
        seen["total"] = total
        raise ImageError("conflict", "stop here")

    store = object.__new__(ImageStore)
    store.name_free = lambda name: name
    store.pinning = lambda: contextlib.nullcontext(lambda digest: None)
    store._hold_existing = lambda hold, layers: None
    store.build_layer = build_layer
    with pytest.raises(ImageError, match="stop here"):
        store.snapshot(upper, SimpleNamespace(layers=[]), "n", [], max_bytes=max_bytes)
    assert seen == {"total": total}
