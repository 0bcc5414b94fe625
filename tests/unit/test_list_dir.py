"""A listing of a sandbox directory (dsecd/fs/files.py list_dir) while the
sandbox or the daemon removes entries from it, run against a plain
directory as the root."""

from __future__ import annotations

import contextlib
import os

from dsecd.fs import files


def _list(root, path: str, depth: int = 1) -> list[str]:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return [e["name"] for e in files.list_dir(fd, path, depth)["entries"]]
    finally:
        os.close(fd)


def test_an_entry_removed_between_reading_and_stat_is_left_out(tmp_path, monkeypatch):
    """The daemon removing a client's temporary file while that client's
    directory is listed failed the whole listing with "No such file or
    directory" on the directory, which was there."""
    (tmp_path / "work").mkdir()
    for name in ("a", "gone", "z"):
        (tmp_path / "work" / name).write_bytes(b"x")
    real_scandir = os.scandir

    @contextlib.contextmanager
    def scandir_then_remove(fd):
        with real_scandir(fd) as it:
            read = list(it)             # names read first, as getdents does
        (tmp_path / "work" / "gone").unlink()
        yield iter(read)

    monkeypatch.setattr(files.os, "scandir", scandir_then_remove)
    assert _list(tmp_path, "/work") == ["a", "z"]
