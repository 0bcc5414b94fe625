"""Regression (fuzz finding 6, docs/hardening.md): `image_build` racing
`image_gc` lost the build's fresh layer or manifest to the collector and
answered `internal` (FileNotFoundError stat'ing the layer) or `not_found`.
A build pins what it writes until its name is published."""

from __future__ import annotations

import threading
import time

import pytest

from dsecd.errors import DsecError
from dsecd.fs.images import ImageError, ImageStore


@pytest.fixture
def store(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("layer content")
    return ImageStore(tmp_path / "store", tmp_path / "scratch"), src


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_gc_at_the_worst_moment_keeps_the_build(store, nth):
    """gc runs right after the nth blob of a build is stored (its chunk
    index, its layer, its manifest: in that order today), before its name is
    published: exactly the windows the fuzzer hit, made deterministic."""
    images, src = store
    real = images.store.ingest
    calls = []

    def ingest_then_gc(*args, **kw):
        out = real(*args, **kw)
        calls.append(out[0])
        if len(calls) == nth:
            images.gc(set(), set())
        return out

    images.store.ingest = ingest_then_gc
    image = images.build_from_dir(str(src), "img")
    images.store.ingest = real
    assert len(calls) >= nth, calls                         # the window was really hit
    for digest in calls:                                    # every blob the build stored survived
        assert images.store.exists(digest), digest
    assert images.get("img").layers == image.layers
    # Once published, the name keeps it; once removed, gc takes it.
    assert images.gc(set(), set())["removed"] == []
    images.remove("img")
    assert set(calls) <= set(images.gc(set(), set())["removed"])


def test_parent_collected_before_the_build_pins_it_is_not_found(store):
    images, src = store
    images.build_from_dir(str(src), "parent")
    parent = images.get("parent")
    real_get = images.get

    def get_then_collect(name):
        image = real_get(name)
        if name == "parent":                 # removed and collected between lookup and pin
            images.get = real_get
            images.remove("parent")
            images.gc(set(), set())
        return image

    images.get = get_then_collect
    (src / "g").write_text("more")
    with pytest.raises(ImageError) as e:
        images.build_from_dir(str(src), "child", parent="parent")
    assert e.value.code == "not_found" and parent.layer_digests[0] in str(e.value)


def test_image_build_beside_image_gc_through_the_daemon(daemon_factory, tmp_path):
    d = daemon_factory()
    src = tmp_path / "src"
    src.mkdir()
    stop = threading.Event()
    gc_errors: list[str] = []

    def collect() -> None:
        c = d.client()
        while not stop.is_set():
            try:
                c.request("image_gc")
            except DsecError as err:
                gc_errors.append(f"{err.code}: {err.message}")
        c.close()

    collector = threading.Thread(target=collect)
    collector.start()
    answers: dict[str, int] = {}
    c = d.client()
    try:
        deadline = time.monotonic() + 3
        i = 0
        while time.monotonic() < deadline:
            (src / "f").write_text(str(i))          # a new layer (and manifest) every time
            try:
                c.request("image_build", source=str(src), name=f"img{i}")
                c.request("image_rm", name=f"img{i}")
                key = "ok"
            except DsecError as err:
                key = f"{err.code}: {err.message}"
            answers[key] = answers.get(key, 0) + 1
            i += 1
    finally:
        stop.set()
        collector.join()
        c.close()
    assert set(answers) == {"ok"}, answers
    assert answers["ok"] >= 10 and not gc_errors, (answers, gc_errors[:3])
