"""A name that comes again in a tar (`tar -rf` appends a newer copy of a
file; a directory named twice) replaces what the earlier entry made, as
GNU tar extracts it: in a directory copy into a sandbox (dsecd/fs/tarcopy.py,
run against a plain directory as the root) and in the client's unpack
(dsecd/localcopy.py), by the rules of dsecd/tarsafe.py."""

from __future__ import annotations

import io
import os
import stat
import tarfile

import pytest

from dsecd import localcopy, tarsafe
from dsecd.fs import tarcopy
from dsecd.fs.files import PathError

R, D, S, L = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE


def _tar(*entries) -> bytes:
    """entries: (name, type, data or link target[, mode])."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, data, *mode in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.mode = mode[0] if mode else 0o755 if kind == D else 0o644
            info.mtime = 1_000_000
            if kind in (S, L):
                info.linkname = data
                tf.addfile(info)
            elif kind == R:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    return buf.getvalue()


def _put(root, data: bytes) -> str:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        tarcopy.put_tree(fd, "/copy", io.BytesIO(data), 100, 1 << 20)
    finally:
        os.close(fd)
    return os.path.join(root, "copy")


def _unpack(root, data: bytes) -> str:
    localcopy.unpack(io.BytesIO(data), os.path.join(root, "copy"))
    return os.path.join(root, "copy")


EXTRACT = pytest.mark.parametrize("extract", [_put, _unpack], ids=["into-sandbox", "local"])


@EXTRACT
def test_a_file_appended_again_replaces_the_earlier_copy(tmp_path, extract):
    top = extract(tmp_path, _tar(("a", R, b"old"), ("b", R, b"b"), ("a", R, b"newer", 0o600)))
    with open(os.path.join(top, "a"), "rb") as f:
        assert f.read() == b"newer"
    assert stat.S_IMODE(os.stat(os.path.join(top, "a")).st_mode) == 0o600
    assert sorted(os.listdir(top)) == ["a", "b"]


@EXTRACT
def test_a_directory_named_again_takes_the_later_mode(tmp_path, extract):
    top = extract(tmp_path, _tar(("d", D, None, 0o755), ("d/f", R, b"x"), ("d", D, None, 0o700)))
    assert stat.S_IMODE(os.stat(os.path.join(top, "d")).st_mode) == 0o700
    assert os.listdir(os.path.join(top, "d")) == ["f"]


@EXTRACT
def test_a_type_change_replaces_the_earlier_entry(tmp_path, extract):
    top = extract(tmp_path, _tar(("f2d", R, b"x"), ("f2d", D, None), ("f2d/in", R, b"in"),
                                 ("l2f", S, "/etc/passwd"), ("l2f", R, b"mine"),
                                 ("f2l", R, b"x"), ("f2l", S, "elsewhere"),
                                 ("d2f", D, None), ("d2f", R, b"file"),
                                 ("l2d", S, "/"), ("l2d", D, None), ("l2d/in", R, b"in")))
    with open(os.path.join(top, "f2d/in"), "rb") as f:
        assert f.read() == b"in"
    assert not os.path.islink(os.path.join(top, "l2f"))
    with open(os.path.join(top, "l2f"), "rb") as f:
        assert f.read() == b"mine"
    assert os.readlink(os.path.join(top, "f2l")) == "elsewhere"
    assert os.path.isfile(os.path.join(top, "d2f"))
    assert not os.path.islink(os.path.join(top, "l2d")) and os.listdir(os.path.join(top, "l2d")) == ["in"]


@EXTRACT
def test_hard_links_keep_the_file_they_were_made_to(tmp_path, extract):
    """A hard link names the file its target was when it came; a link that
    names its own entry leaves the file as it is (GNU tar does so)."""
    top = extract(tmp_path, _tar(("a", R, b"first"), ("b", L, "a"), ("a", R, b"second"),
                                 ("c", R, b"c"), ("c", L, "c"), ("d", R, b"d"), ("d", L, "a")))
    read = {n: open(os.path.join(top, n), "rb").read() for n in "abcd"}
    assert read == {"a": b"second", "b": b"first", "c": b"c", "d": b"second"}
    assert os.stat(os.path.join(top, "d")).st_ino == os.stat(os.path.join(top, "a")).st_ino


def test_a_directory_with_entries_is_not_replaced_and_the_entry_is_named(tmp_path):
    """GNU tar fails there too ("Cannot open: File exists"); the copy is
    refused and leaves nothing."""
    with pytest.raises(PathError, match="entry 'd' comes again as a file where the archive made a directory "
                                        "with entries in it"):
        _put(tmp_path, _tar(("d", D, None), ("d/f", R, b"x"), ("d", R, b"file")))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("entries", [
    (("l", D, None), ("l", S, "/"), ("l/etc/evil", R, b"x")),
    (("l", R, b"x"), ("l", S, ".."), ("l/evil", R, b"x")),
    (("l", S, "/"), ("l", S, "/tmp"), ("l/evil", R, b"x")),
], ids=["dir-then-symlink", "file-then-symlink", "symlink-again"])
def test_an_entry_below_a_symlink_that_replaced_a_name_is_refused(tmp_path, entries):
    with pytest.raises(PathError, match="which the archive made a symlink or file"):
        _put(tmp_path, _tar(*entries))
    assert os.listdir(tmp_path) == []


def test_a_symlink_replaced_by_a_file_is_not_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"untouched")
    root = tmp_path / "root"
    root.mkdir()
    top = _put(root, _tar(("l", S, str(outside)), ("l", R, b"mine")))
    assert outside.read_bytes() == b"untouched"
    assert not os.path.islink(os.path.join(top, "l"))



def _records(data: bytes, agent_version: int | None = None) -> list[tuple[str, str, int]]:
    """The records a microVM put sends its guest for the tar `data`: (kind, name, mode)."""
    import struct

    from dsecd.engine.vmfiles import _put_records

    out = bytearray()
    kw = {} if agent_version is None else {"agent_version": agent_version}
    _put_records(io.BytesIO(data), lambda chunk, eof: out.extend(chunk), 100, 1 << 20, **kw)
    records, pos = [], 0
    while pos < len(out):                   # kind, name length, name, mode, mtime, size, data
        kind = out[pos:pos + 1].decode()
        (n,) = struct.unpack(">I", out[pos + 1:pos + 5])
        mode, _, size = struct.unpack(">IQQ", out[pos + 5 + n:pos + 25 + n])
        records.append((kind, out[pos + 5:pos + 5 + n].decode(), mode))
        pos += 25 + n + size
    return records


def test_a_microvm_put_removes_what_a_later_entry_replaces_before_making_it():
    records = _records(_tar(("a", R, b"1"), ("a", S, "x"), ("e", D, None), ("e", R, b"2"), ("l", R, b"l"),
                            ("l", L, "l"), ("d", D, None), ("d/f", R, b"f"), ("d", D, None, 0o700)))
    assert records == [("f", "a", 0o644), ("r", "a", 0), ("s", "a", 0), ("d", "e", 0), ("r", "e", 1),
                       ("f", "e", 0o644), ("f", "l", 0o644), ("d", "d", 0), ("f", "d/f", 0o644),
                       ("D", "d", 0o700), ("D", "", 0o755), ("E", "", 0)]


def test_a_microvm_put_refuses_a_replacement_its_older_agent_cannot_make():
    with pytest.raises(tarsafe.Refused, match=r"entry 'a' comes again in the archive, and this microVM's guest "
                                              r"agent \(version 5\) cannot replace"):
        _records(_tar(("a", R, b"1"), ("a", R, b"2")), agent_version=5)
    assert _records(_tar(("d", D, None), ("d", D, None)), agent_version=5)[-1][0] == "E"      # dirs: as before
