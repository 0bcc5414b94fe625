"""What bounds `image flatten` (fs/images.py, fs/flatten.py): its flat
layer is held to images.max_layer_bytes as a pull's or a build's is, and
it stops before a file the scratch dir has no room for; each refusal names
the bound and leaves nothing in the scratch dir (no root beyond chown to one's own owner;
needs mkfs.erofs)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil

import pytest

from dsecd.fs import flatten
from dsecd.fs.images import ImageError, ImageStore, _FlattenRoom

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def _layer(tmp_path, name: str, files: dict[str, int]) -> str:
    d = tmp_path / name
    d.mkdir()
    for rel, size in files.items():
        (d / rel).write_bytes(b"x" * size)
    return str(d)


def _chain(tmp_path, *layers: dict[str, int]) -> tuple[ImageStore, list[str]]:
    """An image `app` of `layers` (bottom first), and their trees as their mounts show them."""
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    dirs, parent = [], None
    for n, files in enumerate(layers):
        dirs.append(_layer(tmp_path, f"l{n}", files))
        images.build_from_dir(dirs[-1], "app" if n == len(layers) - 1 else f"l{n}", parent=parent)
        parent = f"l{n}"
    return images, dirs


def test_a_flat_layer_past_max_layer_bytes_is_refused_naming_the_bound(tmp_path):
    images, dirs = _chain(tmp_path, {"a": 600}, {"b": 500})
    images.max_layer_bytes = 1000
    before = images.get("app").manifest
    with pytest.raises(ImageError) as info:
        images.flatten("app", "flat", lambda _digests: contextlib.nullcontext(dirs))
    assert info.value.code == "limit", info.value
    assert "images.max_layer_bytes (1000 bytes)" in str(info.value) and "/b" in str(info.value)
    assert os.listdir(tmp_path / "scratch") == [] and images.get("app").manifest == before
    with pytest.raises(ImageError):
        images.get("flat")


def test_a_file_a_layer_replaces_counts_once(tmp_path):
    """A chain of snapshots that rewrites one big file flattens to that file once."""
    images, dirs = _chain(tmp_path, {"a": 600}, {"a": 600}, {"a": 600, "b": 300})
    images.max_layer_bytes = 1000
    flat = images.flatten("app", "flat", lambda _digests: contextlib.nullcontext(dirs))
    assert len(flat.layers) == 1


def test_a_whiteout_frees_what_it_removes(tmp_path):
    tree = tmp_path / "tree"
    low = _layer(tmp_path, "low", {"a": 600})
    top = tmp_path / "top"
    top.mkdir()
    os.mknod(top / "a", 0o20000 | 0o600, 0)             # a whiteout: a 0:0 character device
    (top / "b").write_bytes(b"x" * 600)
    flatten.merge([low, str(top)], tree, max_bytes=1000)
    assert sorted(os.listdir(tree)) == ["b"]


def test_a_file_the_scratch_dir_has_no_room_for_stops_the_flatten_first(tmp_path, monkeypatch):
    """The room checked before the flatten starts goes meanwhile (another writer)."""
    images, dirs = _chain(tmp_path, {"a": 100}, {"b": 5000})
    read = _FlattenRoom.read

    def plenty(scratch, layer_dir) -> _FlattenRoom:         # the check before the merge
        return dataclasses.replace(read(scratch, layer_dir), scratch_bytes=1 << 40, layer_bytes=1 << 40)

    monkeypatch.setattr(_FlattenRoom, "read", plenty)
    monkeypatch.setattr(_FlattenRoom, "scratch_bytes_now", lambda self: 4096)      # then, before each file
    with pytest.raises(ImageError) as info:
        images.flatten("app", "flat", lambda _digests: contextlib.nullcontext(dirs))
    assert info.value.code == "io" and "/b (5000 bytes)" in str(info.value), info.value
    assert str(tmp_path / "scratch") in str(info.value) and "Free space on that file system" in str(info.value)
    assert info.value.detail["errno"] == "ENOSPC"
    assert os.listdir(tmp_path / "scratch") == []
