"""An image's layer mounts as overlay's lowerdir list (fs/layers.py)."""

from __future__ import annotations

from dsecd.fs.layers import overlay_lowerdirs


def test_top_first():
    assert overlay_lowerdirs(["/l/base", "/l/mid", "/l/top"]) == ["/l/top", "/l/mid", "/l/base"]


def test_a_repeated_layer_keeps_only_its_topmost_place():
    # overlayfs refuses a directory given twice (ELOOP); the lower copy is redundant.
    assert overlay_lowerdirs(["/l/empty", "/l/base", "/l/empty", "/l/app", "/l/base"]) == \
        ["/l/base", "/l/app", "/l/empty"]
