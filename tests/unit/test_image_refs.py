"""Image names (dsecd/fs/images.py): the parsed ref is cached per name but
never stale, also when another daemon on the same store changes it (no root;
needs mkfs.erofs)."""

from __future__ import annotations

import shutil

import pytest

from dsecd.fs.images import ImageError, ImageStore

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def _src(tmp_path, name: str, text: str):
    d = tmp_path / name
    d.mkdir()
    (d / "f").write_text(text)
    return str(d)


def test_a_name_removed_and_rebuilt_elsewhere_is_seen_at_once(tmp_path):
    store = tmp_path / "store"
    here, there = ImageStore(store, tmp_path / "s1"), ImageStore(store, tmp_path / "s2")
    first = here.build_from_dir(_src(tmp_path, "a", "one"), "img")
    assert here.get("img").manifest == first.manifest
    assert here.get("img").manifest == first.manifest        # served from the cache
    there.remove("img")                                      # another daemon on the same store
    with pytest.raises(ImageError) as info:
        here.get("img")
    assert info.value.code == "not_found"
    second = there.build_from_dir(_src(tmp_path, "b", "two"), "img")
    assert second.manifest != first.manifest
    assert here.get("img").manifest == second.manifest
