"""A conversion tmpfs left mounted in the scratch directory by a killed
daemon is unmounted and removed when the next one starts, and so are a
blob file it fetched for unpack-and-mkfs, a tree it unpacked on the disk,
and unclaimed downloads under
pulls/ (fs/pull.py)."""

from __future__ import annotations

import os

import pytest

from dsecd import native
from dsecd.fs.images import ImageStore
from dsecd.fs.pull import BLOB_PREFIX, MEM_PREFIX, TREE_PREFIX, Puller, PullSettings
from dsecd.fs.registry import RegistryConfig

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def test_a_leftover_conversion_tmpfs_and_blob_file_are_removed_at_start(tmp_path):
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    left = images.scratch / f"{MEM_PREFIX}killed"
    left.mkdir()
    fd = native.upperfs_create(1 << 20, 64)
    try:
        native.upperfs_attach(fd, str(left))
    finally:
        os.close(fd)
    try:
        (left / "file").write_bytes(b"x" * 4096)
        other = images.scratch / "unpack-keep"
        other.mkdir()
        blob = images.scratch / f"{BLOB_PREFIX}killed"
        blob.write_bytes(b"half a blob")
        tree = images.scratch / f"{TREE_PREFIX}killed"
        (tree / "usr" / "lib").mkdir(parents=True)
        (tree / "usr" / "lib" / "half.so").write_bytes(b"x")
        pulls = images.store.root / "pulls"
        (pulls / "ab12" / "blobs").mkdir(parents=True)          # an old download, unclaimed
        (pulls / "cd34" / "blobs").mkdir(parents=True)          # one whose pull runs now
        (pulls / "cd34.claim").write_text("{}")
        Puller(images, RegistryConfig(), PullSettings())
        assert not os.path.ismount(left) and not left.exists()
        assert not blob.exists(), "the killed pull's blob file is left"
        assert not tree.exists(), "the killed pull's unpacked tree is left"
        assert not (pulls / "ab12").exists() and (pulls / "cd34").is_dir() and (pulls / "cd34.claim").exists()
        assert other.is_dir(), "a directory not of a conversion was removed"
    finally:
        if os.path.ismount(left):
            native.umount(str(left), detach=True)
