"""An atomic write_file whose target is a directory: its temporary file's
rename (dsecd/fs/files.py rename with keep_attrs) is refused saying the
target is a directory, and the SDK names the write, not the rename it
did under the hood. Run against a plain directory as the root."""

from __future__ import annotations

import os

import pytest

from dsecd.client import named_as
from dsecd.errors import BadRequest
from dsecd.fs import files


def test_a_file_renamed_with_keep_attrs_onto_a_directory_says_it_is_one(tmp_path):
    (tmp_path / "work" / "d").mkdir(parents=True)
    (tmp_path / "work" / ".dsec-1").write_bytes(b"x")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(files.PathError) as err:
            files.rename(fd, "/work/.dsec-1", "/work/d", overwrite=True, keep_attrs=True)
    finally:
        os.close(fd)
    assert str(err.value).startswith("/work/d is a directory, not a file: a write goes to regular files only"), \
        str(err.value)
    assert (tmp_path / "work" / "d").is_dir()


def test_a_write_files_rename_error_is_said_as_the_write():
    err = BadRequest("rename 0123456789ab:/work/.dsec-1 -> /work: /work is a directory, not a file",
                     {"path": "0123456789ab:/work/.dsec-1 -> /work"})
    said = named_as(err, "/work/.dsec-1", "/work", removed=True, verb=("rename", "write"))
    assert said.message == "write 0123456789ab:/work: /work is a directory, not a file", said.message
    assert said.detail["path"] == "0123456789ab:/work" and said.code == "bad_request"
