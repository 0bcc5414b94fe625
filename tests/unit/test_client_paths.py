"""The SDK gives back names that are not UTF-8 as os.fsdecode's str, the
way os.listdir does: the paths a file op echoes and a symlink's target."""

from __future__ import annotations

from dsecd.client import _paths


def test_paths_and_a_link_target_that_are_not_utf8_come_as_fsdecode_strings():
    out = _paths({"path": b"/work/\xff", "target": b"/data/\xfe", "type": "symlink"})
    assert out == {"path": "/work/\udcff", "target": "/data/\udcfe", "type": "symlink"}
