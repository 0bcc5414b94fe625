"""A snapshot cancelled once its layer is made (fs/images.py): a cancel
that comes while the manifest and ref are written still keeps the name
from being published (no root; needs mkfs.erofs)."""

from __future__ import annotations

import shutil
import threading

import pytest

from dsecd.fs.images import ImageError, ImageStore

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def test_a_cancel_while_the_manifest_is_written_publishes_nothing(tmp_path):
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    src = tmp_path / "root"
    src.mkdir()
    (src / "f").write_text("base")
    base = images.build_from_dir(str(src), "base")
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "g").write_text("changed")
    cancelled = threading.Event()
    put_bytes = images.store.put_bytes

    def put_then_cancel(data, hold=None):
        digest = put_bytes(data, hold)
        if data.startswith(b'{"config":'):      # the manifest (not a chunk index): the layer is made
            cancelled.set()         # the client's cancel, just after the layer was checked
        return digest
    images.store.put_bytes = put_then_cancel
    with pytest.raises(ImageError) as info:
        images.snapshot(upper, base, "snap", [], cancelled=cancelled)
    assert info.value.code == "conflict" and "nothing published" in str(info.value)
    assert images.names() == ["base"]
