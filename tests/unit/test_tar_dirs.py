"""A directory copy's `dirs` (file_tar_put dirs=True): the archive's own
directory entries, which `dsec cp -` gives the directories it merges into,
as GNU tar sets an existing directory's mode and mtime from its entry."""

from __future__ import annotations

import io
import os
import tarfile

from dsecd.engine.vmfiles import _put_records
from dsecd.fs import tarcopy


def _tar(*entries) -> bytes:
    """entries: (name, type, mode, mtime)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, mode, mtime in entries:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = kind, mode, mtime
            tf.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    return buf.getvalue()


D, R = tarfile.DIRTYPE, tarfile.REGTYPE
ARCHIVE = _tar(("./", D, 0o750, 100), ("a", D, 0o755, 200), ("a", D, 0o700, 300), ("implicit/b/f", R, 0o644, 1),
               ("gone", D, 0o755, 400), ("gone", R, 0o644, 500), ("x", R, 0o644, 600), ("x", D, 0o1777, 700))
WANT = [["", 0o750, 100], ["a", 0o700, 300], ["x", 0o1777, 700]]


def _put(root, budget: int) -> dict:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return tarcopy.put_tree(fd, "/copy", io.BytesIO(ARCHIVE), 100, 1 << 20, dirs=budget)
    finally:
        os.close(fd)


def test_a_put_lists_the_last_entry_of_each_directory_the_archive_names(tmp_path):
    assert _put(tmp_path, 1 << 20)["dirs"] == WANT


def test_a_microvm_put_reads_them_the_same_way():
    seen = _put_records(io.BytesIO(ARCHIVE), lambda data, eof: None, 100, 1 << 20)
    assert tarcopy.dir_entries(seen, 1 << 20) == WANT


def test_too_many_to_list_in_one_result_are_none_and_the_copy_stands(tmp_path):
    r = _put(tmp_path, 64)
    assert r["dirs"] is None and r["count"] == 8 and os.path.isdir(tmp_path / "copy" / "x")


def test_a_put_not_asked_lists_none(tmp_path):
    assert "dirs" not in _put(tmp_path, 0)
