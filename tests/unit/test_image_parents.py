"""Image parents (dsecd/fs/images.py): every way of making an image
records the name it was made from with the manifest that name stood for
then, so a name made from the image it replaces (a rebuild in place, a tag
promoting a child) is allowed and its lineage never loops; refs that
already loop (written before the manifest was recorded) end the walk
instead of hanging it (no root; needs mkfs.erofs)."""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from dsecd.fs.images import ImageStore

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


def test_a_build_records_its_parents_manifest(images):
    base, app = images.get("base"), images.get("app")
    assert (app.parent, app.parent_manifest) == ("base", base.manifest)
    assert app.to_dict()["parent_manifest"] == base.manifest
    assert images.ancestors(app) == (["base"], "none")
    assert images.ancestors(base) == ([], "none")


def test_a_build_from_the_name_it_replaces_names_the_image_it_was(tmp_path, images):
    """`dsec image build DIR --from app --name app`: made, and its parent
    is app as it was, which the walk says was moved on (not a loop)."""
    before = images.get("app")
    again = images.build_from_dir(_src(tmp_path, "two"), "app", parent="app")
    assert (again.parent, again.parent_manifest) == ("app", before.manifest)
    assert images.get("app").manifest == again.manifest != before.manifest
    assert images.ancestors(images.get("app")) == (["app"], "replaced")


def test_tagging_a_child_as_its_parent_promotes_it(tmp_path, images):
    """`dsec image tag app2 app`, app2 made from app: app now names app2's
    image, whose parent is the app that was."""
    old_app = images.get("app")
    images.build_from_dir(_src(tmp_path, "two"), "app2", parent="app")
    promoted = images.tag("app2", "app")
    assert promoted.manifest == images.get("app2").manifest
    assert (promoted.parent, promoted.parent_manifest) == ("app", old_app.manifest)
    assert images.ancestors(images.get("app")) == (["app"], "replaced")
    assert images.ancestors(images.get("app2")) == (["app"], "replaced")


def test_a_snapshot_may_take_back_its_removed_base_name(tmp_path, images):
    """A sandbox made from `app` outlives the name: its snapshot may take
    it back, its parent the image the sandbox was made of."""
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "g").write_text("changed")
    base = images.get_manifest(images.get("app").manifest, "app")
    images.remove("app")
    snap = images.snapshot(upper, base, "app", [])
    assert (snap.parent, snap.parent_manifest) == ("app", base.manifest)
    assert images.ancestors(snap) == (["app"], "replaced")


def test_a_removed_parent_ends_the_chain(tmp_path, images):
    images.build_from_dir(_src(tmp_path, "two"), "app2", parent="app")
    images.remove("app")
    assert images.ancestors(images.get("app2")) == (["app"], "removed")


def test_a_build_from_a_descendant_under_an_ancestors_name_does_not_loop(tmp_path, images):
    """base -> app -> app2, then base rebuilt from app2: each name's chain
    stops where a name was moved on."""
    images.build_from_dir(_src(tmp_path, "two"), "app2", parent="app")
    images.build_from_dir(_src(tmp_path, "three"), "base", parent="app2")
    assert images.ancestors(images.get("base")) == (["app2", "app", "base"], "replaced")
    assert images.ancestors(images.get("app2")) == (["app", "base"], "replaced")


def _write_ref(images: ImageStore, name: str, manifest: str, parent: str | None) -> None:
    (images.refs / name).write_text(json.dumps({"manifest": manifest, "created": 0.0, "parent": parent}))


def test_a_cycle_already_on_disk_ends_the_walk(tmp_path, images):
    """Refs written before parents had their manifest recorded: a <-> b,
    and c its own parent. Walking their chains ends, naming where it
    looped; building on them works, and records the manifest."""
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
    assert out["a"] == (["b", "a"], "loop")
    assert out["c"] == (["c"], "loop")
    assert out["d"].parent_manifest == manifest and out["d-chain"] == (["a", "b", "a"], "loop")
    assert [i.name for i in images.list()[0]] == ["a", "app", "b", "base", "c", "d"]
