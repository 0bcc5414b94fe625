"""A pull cancelled once its last layer is stored (fs/pull.py): the cancel
still keeps the name from being published, as the protocol says of a
cancelled pull (no registry: the fetch is stood in for; needs
mkfs.erofs)."""

from __future__ import annotations

import shutil
import time

import pytest

from dsecd.fs.httpstop import Stop
from dsecd.fs.images import ImageStore
from dsecd.fs.pull import Puller, PullError, PullSettings
from dsecd.fs.registry import RegistryConfig

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


class _Resolved:
    def __init__(self, name, layer: dict):
        self.name = name
        self.config = {"config": {}}
        self.layers = [{"digest": "sha256:" + "a" * 64, "size": layer["size"]}]
        self.diff_ids = ["sha256:" + "b" * 64]


def test_a_pull_cancelled_after_its_last_layer_publishes_nothing(tmp_path, monkeypatch):
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    src = tmp_path / "root"
    src.mkdir()
    (src / "f").write_text("layer")
    stored = images.build_from_dir(str(src), "local").layers[0]
    puller = Puller(images, RegistryConfig(), PullSettings())
    cancelled = Stop()

    def fetch(self, registry, r, layers, hold, emit, cancelled_, stats, deadline):
        for layer in layers:
            layer.stored, layer.state = stored, "stored"
        cancelled_.set()                 # the client's cancel, as the last layer was stored
    monkeypatch.setattr(Puller, "_fetch", fetch)
    name = images.parse_name("registry.lab/a/b:v1")
    with pytest.raises(PullError) as info:
        puller._pull_claimed(None, _Resolved(name, stored), {"ref": str(name), "digest": "sha256:" + "c" * 64},
                             lambda _e: None, cancelled, {}, time.monotonic() + 60)
    assert info.value.code == "conflict" and "nothing published" in str(info.value)
    assert images.names() == ["local"]
