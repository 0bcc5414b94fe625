"""Image sizes (dsecd/fs/images.py): what an image's `bytes` and each layer's
`bytes` count is the data its EROFS layers hold, not the zeros their blob
files are padded with to a multiple of 2 MiB for microVM pmem (sparse: no
disk, no data); the same number in answers, `image du`, `image gc` and the
build's progress (no root; needs mkfs.erofs)."""

from __future__ import annotations

import shutil

import pytest

from dsecd.fs import erofs
from dsecd.fs.images import ImageStore

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def _src(tmp_path, name: str, size: int):
    d = tmp_path / name
    d.mkdir()
    (d / "f").write_bytes(b"x" * size)
    return str(d)


def _image_length(path) -> int:
    """An EROFS image's length as its superblock (at byte 1024) says it:
    blocks (at +36) times the block size (log2 at +12)."""
    with open(path, "rb") as f:
        f.seek(1024)
        sb = f.read(40)
    assert int.from_bytes(sb[:4], "little") == 0xE0F5E1E2
    return int.from_bytes(sb[36:40], "little") << sb[12]


def test_sizes_count_the_layers_data_not_their_padding(tmp_path):
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    shown = []
    base = images.build_from_dir(_src(tmp_path, "base", 100_000), "base", progress=shown.append)
    app = images.build_from_dir(_src(tmp_path, "app", 10), "app", parent="base")
    files = [images.store.path(d) for d in app.layer_digests]
    assert [f.stat().st_size for f in files] == [erofs.PMEM_ALIGN] * 2       # the blobs, padded
    data = [_image_length(f) for f in files]
    assert 100_000 < data[0] < 200_000 and 0 < data[1] <= 16 << 10
    listed = {i.name: i.to_dict() for i in images.list()[0]}
    assert [layer["bytes"] for layer in listed["app"]["layers"]] == data
    assert [layer["size"] for layer in listed["app"]["layers"]] == [erofs.PMEM_ALIGN] * 2   # the manifest's, as stored
    assert listed["app"]["bytes"] == sum(data) == app.size
    assert listed["base"]["bytes"] == data[0] == base.size
    assert [p["bytes"] for p in shown if p.get("step") == "layer"] == [data[0]]
    assert images.get_manifest(app.manifest).size == sum(data)
    fresh = ImageStore(tmp_path / "store", tmp_path / "scratch2")       # nothing cached: read from the blobs
    assert fresh.get("app").size == sum(data) and fresh.get("app").layer_bytes == data
    du = fresh.du(set(), set())
    assert {i["name"]: i["bytes"] for i in du["images"]} == {"app": sum(data), "base": data[0]}
    assert sum(data) < du["bytes"] < sum(data) + (64 << 10)          # plus the manifests and chunk indexes
    images.remove("app")
    gc = images.gc(set(), set())
    assert data[1] <= gc["freed_bytes"] < data[1] + (64 << 10)
    assert [erofs.data_size(f) for f in files[:1]] == data[:1]
