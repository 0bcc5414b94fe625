"""An image's layers, each once: overlay's lowerdir list and a microVM's devices (fs/layers.py)."""

from __future__ import annotations

from dsecd.fs.layers import distinct_layers, overlay_lowerdirs


def test_top_first():
    assert overlay_lowerdirs(["/l/base", "/l/mid", "/l/top"]) == ["/l/top", "/l/mid", "/l/base"]


def test_a_repeated_layer_keeps_only_its_topmost_place():
    # overlayfs refuses a directory given twice (ELOOP); the lower copy is redundant.
    assert overlay_lowerdirs(["/l/empty", "/l/base", "/l/empty", "/l/app", "/l/base"]) == \
        ["/l/base", "/l/app", "/l/empty"]


def test_distinct_layers_stay_bottom_first():
    # What a microVM attaches, one pmem device per layer.
    assert distinct_layers(["sha256:e", "sha256:b", "sha256:e", "sha256:a"]) == ["sha256:b", "sha256:e", "sha256:a"]
    assert distinct_layers([]) == []
