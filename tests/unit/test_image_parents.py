"""Image parents (dsecd/fs/images.py): no way of making an image lets a
name become its own parent or ancestor, and a cycle already in the refs on
disk ends the walk of a chain instead of looping (no root; needs
mkfs.erofs)."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from dsecd.fs.images import ImageError, ImageStore

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def _src(tmp_path, name: str):
    d = tmp_path / name
    d.mkdir()
    (d / "f").write_text(name)
    return str(d)


@pytest.fixture
def images(tmp_path):
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    images.build_from_dir(_src(tmp_path, "root"), "base")
    images.build_from_dir(_src(tmp_path, "one"), "app", parent="base")
    return images


def _refused(err: ImageError, *names: str) -> None:
    assert err.code == "conflict"
    for name in names:
        assert repr(name) in str(err)


def test_a_build_from_the_name_it_replaces_is_refused_and_the_name_kept(tmp_path, images):
    before = images.get("app")
    with pytest.raises(ImageError) as info:
        images.build_from_dir(_src(tmp_path, "two"), "app", parent="app")
    _refused(info.value, "app")
    assert "its parent" in str(info.value) and "dsec image tag app app-base" in str(info.value)
    assert images.get("app").manifest == before.manifest and images.get("app").parent == "base"


def test_a_build_from_a_descendant_is_refused(tmp_path, images):
    images.build_from_dir(_src(tmp_path, "two"), "app2", parent="app")
    with pytest.raises(ImageError) as info:
        images.build_from_dir(_src(tmp_path, "three"), "base", parent="app2")
    _refused(info.value, "base", "app2")
    assert "app2 -> app -> base" in str(info.value)
    assert info.value.detail["chain"] == ["app2", "app", "base"]
    assert images.get("base").parent is None


def test_tagging_a_child_as_its_ancestor_is_refused(tmp_path, images):
    images.build_from_dir(_src(tmp_path, "two"), "app2", parent="app")
    for ancestor in ("app", "base"):
        with pytest.raises(ImageError) as info:
            images.tag("app2", ancestor)
        _refused(info.value, "app2", ancestor)
        assert "tag" in str(info.value)
    assert images.get("app").parent == "base"
    assert images.tag("app2", "app2-stable").parent == "app"     # a name outside the chain is fine


def test_a_snapshot_named_as_its_removed_base_is_refused(tmp_path, images):
    """A sandbox made from `app` outlives the name: a snapshot of it may not
    take the name back, its parent being that same name."""
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "g").write_text("changed")
    base = images.get_manifest(images.get("app").manifest, "app")
    images.remove("app")
    with pytest.raises(ImageError) as info:
        images.snapshot(upper, base, "app", [])
    _refused(info.value, "app")
    assert images.snapshot(upper, base, "app-1", []).parent == "app"


def test_a_removed_parent_name_still_counts(tmp_path, images):
    """app2 names app as its parent after app is removed: an image made from
    app2 may not take the name app, which would make each the other's parent."""
    images.build_from_dir(_src(tmp_path, "two"), "app2", parent="app")
    images.remove("app")
    assert images.ancestors(images.get("app2")) == (["app"], None)
    with pytest.raises(ImageError) as info:
        images.build_from_dir(_src(tmp_path, "three"), "app", parent="app2")
    _refused(info.value, "app", "app2")
    images.build_from_dir(_src(tmp_path, "four"), "app", parent="base")      # from elsewhere: no cycle


def test_a_publish_checks_too(images):
    """What every way of naming an image goes through: a build's layers made
    before the name is published are refused there all the same."""
    with pytest.raises(ImageError) as info:
        images.publish("base", images.get("app").manifest, "app", replace=True)
    _refused(info.value, "base", "app")
    assert images.get("base").parent is None


def _write_ref(images: ImageStore, name: str, manifest: str, parent: str | None) -> None:
    (images.refs / name).write_text(json.dumps({"manifest": manifest, "created": 0.0, "parent": parent}))


def test_a_cycle_already_on_disk_ends_the_walk(tmp_path, images):
    """Refs an older daemon wrote: a <-> b, and c a self-parent. Walking
    their chains ends, naming where it looped; building on them works."""
    manifest = images.get("app").manifest
    _write_ref(images, "a", manifest, "b")
    _write_ref(images, "b", manifest, "a")
    _write_ref(images, "c", manifest, "c")
    out: dict = {}

    def walk():
        out["a"] = images.ancestors(images.get("a"))
        out["c"] = images.ancestors(images.get("c"))
        out["d"] = images.build_from_dir(_src(tmp_path, "two"), "d", parent="a")
        out["d-chain"] = images.ancestors(out["d"])
    walker = threading.Thread(target=walk, daemon=True)
    walker.start()
    walker.join(30)
    assert not walker.is_alive(), "walking a chain with a cycle did not end"
    assert out["a"] == (["b"], "a")
    assert out["c"] == ([], "c")
    assert out["d"].parent == "a" and out["d-chain"] == (["a", "b"], "a")
    with pytest.raises(ImageError) as info:
        images.build_from_dir(_src(tmp_path, "three"), "b", parent="a")
    _refused(info.value, "b", "a")
    assert [i.name for i in images.list()[0]] == ["a", "app", "b", "base", "c", "d"]
