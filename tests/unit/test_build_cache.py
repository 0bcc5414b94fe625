"""The store's side of Dockerfile builds (dsecd/fs/images.py, buildcache.py):
cache entries, what `gc` keeps of them, names replaced, pins, and which
writable layers count as no change. No root; needs mkfs.erofs."""

from __future__ import annotations

import shutil

import pytest

from dsecd.fs.images import ImageStore, has_changes

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")

KEY_A = "sha256:" + "a" * 64
KEY_B = "sha256:" + "b" * 64


def tree(tmp_path, name: str, files: dict[str, str]):
    root = tmp_path / name
    root.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_what_counts_as_no_change(tmp_path):
    assert not has_changes(tree(tmp_path, "empty", {}), [])
    resolv = tree(tmp_path, "resolv", {"etc/resolv.conf": "nameserver 10.0.0.1\n"})
    assert not has_changes(resolv, ["etc/resolv.conf"])
    assert has_changes(resolv, [])
    (resolv / "etc" / "hosts").write_text("x")
    assert has_changes(resolv, ["etc/resolv.conf"])
    assert has_changes(tree(tmp_path, "dir", {"app/.keep": ""}), ["app/.keep", "other"]) is False
    (tmp_path / "emptydir" / "new").mkdir(parents=True)
    assert has_changes(tmp_path / "emptydir", [])       # a new empty directory is a change


def test_cache_entries_gc_and_replaced_names(tmp_path):
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    pins = images.pins()
    base = images.build_from_dir(str(tree(tmp_path, "base", {"bin/sh": "x"})), "base")
    layer = images.pack_layer(tree(tmp_path, "upper", {"app/main.py": "print(1)"}), [], pins.hold)
    assert images.pack_layer(tree(tmp_path, "nothing", {}), [], pins.hold) is None
    step = images.put_manifest(base.layers + [layer], {"cwd": "/app"}, pins.hold)
    meta = images.put_manifest(base.layers, {"cwd": "/"}, pins.hold)
    images.cache_record(KEY_A, step)
    images.cache_record(KEY_B, meta)
    assert images.cache_lookup(KEY_A, pins.hold).manifest == step
    pins.hold(step)                              # held twice: release copes
    pins.release()

    # Nothing names the step's layer: gc drops its entry and then its blobs;
    # the entry whose layers the base image has stays, with its manifest.
    out = images.gc(set(), set())
    assert out["cache_removed"] == 1 and step in out["removed"] and layer["digest"] in out["removed"]
    assert meta not in out["removed"]
    assert images.cache_lookup(KEY_A, images.pins().hold) is None
    assert images.cache_lookup(KEY_B, images.pins().hold).manifest == meta

    # A name keeps them; replacing the name says what it named before.
    pins = images.pins()
    layer = images.pack_layer(tmp_path / "upper", [], pins.hold)
    step = images.put_manifest(base.layers + [layer], {"cwd": "/app"}, pins.hold)
    images.cache_record(KEY_A, step)
    image, before = images.publish("app", step, "base", replace=True)
    assert before is None and image.manifest == step
    assert images.publish("app", meta, "base", replace=True)[1] == step
    assert images.get("app").manifest == meta
    images.publish("app", step, "base", replace=True)
    pins.release()
    assert images.gc(set(), set())["cache_removed"] == 0
    assert images.cache_lookup(KEY_A, images.pins().hold).manifest == step


def test_a_lookup_whose_layer_is_gone_is_a_miss(tmp_path):
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    pins = images.pins()
    layer = images.pack_layer(tree(tmp_path, "upper", {"f": "1"}), [], pins.hold)
    step = images.put_manifest([layer], {}, pins.hold)
    images.cache_record(KEY_A, step)
    images.store.remove(layer["digest"])
    assert images.cache_lookup(KEY_A, pins.hold) is None
    assert images.build_cache.get(KEY_A) is None       # the entry went with it
    pins.release()
