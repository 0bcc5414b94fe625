"""A snapshot's view of a sandbox's capped upper tmpfs is mounted in a
worker, and a destroy (which takes no sandbox lock) closes the handle's
upper fd meanwhile; the number may then be another sandbox's upper tmpfs.
The view is made from a copy of the fd taken on the loop, so it shows this
sandbox's writable layer or nothing, never another's."""

from __future__ import annotations

import os
from pathlib import Path

from dsecd.backends.container import Handle
from dsecd.fs import upper as upperfs


def _tmpfs_with(name: str) -> int:
    fd = upperfs.create_tmpfs(upperfs.Cap(disk_bytes=1 << 20, inodes=64))
    top = os.open("upper", os.O_PATH, dir_fd=fd)
    try:
        os.close(os.open(name, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=top))
    finally:
        os.close(top)
    return fd


def test_a_view_made_across_a_destroy_shows_this_sandboxs_layer(tmp_path):
    mine = _tmpfs_with("mine")
    made = _tmpfs_with("other")             # the next create's
    h = Handle(init_pid=0, init_start=0, pidfd=-1, rootfd=-1, group=None, dir=None, is_child=False, upperfd=mine)
    view = h.upper_view()                   # on the loop
    number = h.upperfd
    os.close(number)                        # the destroy's release (which sets -1 after it)
    other = os.dup2(made, number)           # parked where the closed one was
    os.close(made)
    try:
        upper, undo = view(tmp_path / "views")      # the worker
        try:
            assert sorted(os.listdir(upper)) == ["mine"]
        finally:
            undo()
    finally:
        os.close(other)
    assert not any(Path(tmp_path / "views").iterdir())
