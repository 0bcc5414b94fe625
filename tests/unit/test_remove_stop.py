"""A recursive remove (dsecd/fs/files.py remove) stops between two entries
once its request is cancelled, run against a plain directory as the root."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from dsecd.fs import files


def test_a_set_stop_ends_a_recursive_remove_before_its_next_entry(tmp_path, monkeypatch):
    tree = tmp_path / "work" / "tree"
    tree.mkdir(parents=True)
    for i in range(50):
        (tree / str(i)).write_bytes(b"x")
    stop = threading.Event()
    real_unlink = os.unlink
    unlinked = []

    def unlink_then_cancel(name, *, dir_fd=None):
        real_unlink(name, dir_fd=dir_fd)
        unlinked.append(name)
        if len(unlinked) == 10:
            stop.set()                      # the request is cancelled here

    monkeypatch.setattr(os, "unlink", unlink_then_cancel)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(InterruptedError) as info:
            files.remove(fd, "/work/tree", True, stop)
    finally:
        os.close(fd)
    assert info.value.errno == errno.EINTR and "cancelled" in str(info.value)
    assert len(unlinked) == 10 and len(os.listdir(tree)) == 40


def test_without_a_stop_a_recursive_remove_removes_the_whole_tree(tmp_path):
    tree = tmp_path / "work" / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_bytes(b"x")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert files.remove(fd, "/work/tree", True, threading.Event())["removed"] == 3
    finally:
        os.close(fd)
    assert not tree.exists()
