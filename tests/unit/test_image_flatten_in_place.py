"""An in-place `image flatten NAME` (fs/images.py) moves NAME only if it
still names the image flattened when the flat one is published: a build
or tag that moved the name meanwhile is not overwritten (no root beyond
chown to one's own owner; needs mkfs.erofs)."""

from __future__ import annotations

import contextlib
import shutil

import pytest

from dsecd.fs import images as images_mod
from dsecd.fs.images import ImageError, ImageStore

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def _src(tmp_path, name: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / name).write_text(name)
    return str(d)


def test_a_name_moved_while_its_flat_ref_is_written_is_not_overwritten(tmp_path, monkeypatch):
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    images.build_from_dir(_src(tmp_path, "root"), "base")
    images.build_from_dir(_src(tmp_path, "one"), "app", parent="base")
    images.build_from_dir(_src(tmp_path, "two"), "other")
    deep, other = images.get("app"), images.get("other")
    dirs = [str(tmp_path / "root"), str(tmp_path / "one")]       # the layers, as their mounts show them

    write_durable = images_mod.write_durable
    moved = []

    def write_then_move(path, data):
        write_durable(path, data)
        if not moved:                       # the flat image's ref is written: another request moves app
            moved.append(True)
            images.tag("other", "app")
    monkeypatch.setattr(images_mod, "write_durable", write_then_move)
    with pytest.raises(ImageError) as info:
        images.flatten("app", None, lambda _digests: contextlib.nullcontext(dirs))
    assert moved and info.value.code == "conflict" and "nothing published" in str(info.value)
    assert images.get("app").manifest == other.manifest != deep.manifest


def test_an_in_place_flatten_moves_the_name_it_flattened(tmp_path):
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    images.build_from_dir(_src(tmp_path, "root"), "base")
    images.build_from_dir(_src(tmp_path, "one"), "app", parent="base")
    deep = images.get("app")
    dirs = [str(tmp_path / "root"), str(tmp_path / "one")]
    flat = images.flatten("app", None, lambda _digests: contextlib.nullcontext(dirs))
    assert len(flat.layers) == 1 and flat.extra["replaced"] == deep.manifest
    assert images.get("app").manifest == flat.manifest
    assert (flat.parent, flat.parent_manifest) == (deep.parent, deep.parent_manifest)
