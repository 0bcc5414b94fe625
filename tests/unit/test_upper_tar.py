"""dsecd/fs/uppertar.py: a microVM's writable layer, as its guest agent's tar,
unpacked into the directory the layer builder reads."""

from __future__ import annotations

import errno
import io
import os
import stat
import tarfile

import pytest

from dsecd import tarsafe
from dsecd.fs import uppertar


def _entry(name: str, kind: bytes, data: bytes = b"", linkname: str = "", mode: int = 0o644) -> tuple:
    m = tarfile.TarInfo(name)
    m.type, m.mode, m.linkname, m.size = kind, mode, linkname, len(data)
    return m, data


def _tar(tmp_path, entries) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for m, data in entries:
            tf.addfile(m, io.BytesIO(data) if data else None)
    path = tmp_path / "upper.tar"
    path.write_bytes(buf.getvalue())
    return str(path)


def _unpack(tmp_path, entries):
    dest = tmp_path / "tree"
    dest.mkdir()
    return dest, uppertar.unpack(_tar(tmp_path, entries), dest)


def test_hard_links_are_one_inode_with_its_link_count(tmp_path):
    """The agent sends each further name of a file, FIFO or symlink as a tar
    hard link to its first: unpacked, all the names are one inode."""
    dest, out = _unpack(tmp_path, [
        _entry("./", tarfile.DIRTYPE, mode=0o755),
        _entry("d/", tarfile.DIRTYPE, mode=0o755),
        _entry("d/f", tarfile.REGTYPE, b"shared", mode=0o640),
        _entry("d/g", tarfile.LNKTYPE, linkname="d/f"),
        _entry("h", tarfile.LNKTYPE, linkname="./d/f"),
        _entry("s", tarfile.SYMTYPE, linkname="d/f"),
        _entry("s2", tarfile.LNKTYPE, linkname="s"),
        _entry("p", tarfile.FIFOTYPE),
        _entry("p2", tarfile.LNKTYPE, linkname="p"),
    ])
    f, g, h = (os.lstat(dest / n) for n in ("d/f", "d/g", "h"))
    assert f.st_ino == g.st_ino == h.st_ino and f.st_nlink == 3
    assert stat.S_IMODE(h.st_mode) == 0o640 and (dest / "h").read_bytes() == b"shared"
    s, s2 = os.lstat(dest / "s"), os.lstat(dest / "s2")
    assert stat.S_ISLNK(s2.st_mode) and s.st_ino == s2.st_ino and s.st_nlink == 2
    p, p2 = os.lstat(dest / "p"), os.lstat(dest / "p2")
    assert stat.S_ISFIFO(p2.st_mode) and p.st_ino == p2.st_ino
    assert out == {"entries": 9, "bytes": 6}


@pytest.mark.parametrize("entries, why", [
    ([_entry("h", tarfile.LNKTYPE, linkname="missing")], "not an earlier"),
    ([_entry("d/", tarfile.DIRTYPE), _entry("h", tarfile.LNKTYPE, linkname="d")], "not an earlier"),
    ([_entry("h", tarfile.LNKTYPE, linkname="../etc/passwd")], "'..'"),
    ([_entry("h", tarfile.LNKTYPE, linkname="/etc/passwd")], "absolute"),
    ([_entry("w", tarfile.CHRTYPE), _entry("h", tarfile.LNKTYPE, linkname="w")], "not an earlier"),
    ([_entry("h", tarfile.LNKTYPE, linkname="h")], "not an earlier"),
])
def test_a_hard_link_to_anything_but_an_earlier_entry_is_refused(tmp_path, entries, why):
    """A link may name only a file, FIFO or symlink the archive made before it
    (not a directory, a whiteout, itself, or a path out of the layer)."""
    dest = tmp_path / "tree"
    dest.mkdir()
    with pytest.raises(tarsafe.Refused, match=why):
        uppertar.unpack(_tar(tmp_path, entries), dest)
    assert not (dest / "h").exists()


def test_the_xattrs_a_layer_keeps(tmp_path):
    """trusted.* and user.* as a container's layer has them, the opaque mark,
    but none of overlayfs's own bookkeeping (a redirect or metacopy in a
    lower layer would change what every overlay over it shows)."""
    m, _ = _entry("d/", tarfile.DIRTYPE, mode=0o755)
    m.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in (
        ("trusted.t", "tt"), ("trusted.overlay.opaque", "y"), ("trusted.overlay.origin", "o"),
        ("trusted.overlay.redirect", "/x"), ("user.a", "one"), ("security.selinux", "s"))}
    dest, _ = _unpack(tmp_path, [_entry("./", tarfile.DIRTYPE, mode=0o755), (m, b"")])
    assert sorted(os.listxattr(dest / "d")) == ["trusted.overlay.opaque", "trusted.t", "user.a"]
    assert os.getxattr(dest / "d", "trusted.t") == b"tt"


def test_an_xattr_the_file_system_has_no_room_for_says_which_and_what_to_do(tmp_path, monkeypatch):
    """ext4 holds about one block of xattrs per file: a larger one fails with
    ENOSPC, which read as a full disk. The error names the xattr, its size
    and the ways round it."""
    real = os.setxattr

    def no_room(path, name, value, *args, **kwargs):
        if name == "user.big":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, name, value, *args, **kwargs)

    monkeypatch.setattr(uppertar.os, "setxattr", no_room)
    m, data = _entry("f", tarfile.REGTYPE, b"x")
    m.pax_headers = {"SCHILY.xattr.user.big": "v" * 5000}
    with pytest.raises(OSError) as got:
        _unpack(tmp_path, [_entry("./", tarfile.DIRTYPE, mode=0o755), (m, data)])
    assert got.value.errno == errno.ENOSPC
    assert "xattr user.big of 5000 bytes" in got.value.strerror and "--exclude" in got.value.strerror
    assert got.value.filename.endswith("/f")


def test_a_files_zeros_are_holes_in_the_unpacked_tree(tmp_path):
    """The agent sends a sparse file's holes as zeros (the layer stores them
    so, as a container's does); unpacked as holes, the scratch dir holds
    the file's data only, not its apparent size again beside the tar."""
    data = bytes(8 << 20) + b"end"
    dest, _ = _unpack(tmp_path, [_entry("./", tarfile.DIRTYPE, mode=0o755), _entry("sparse", tarfile.REGTYPE, data)])
    assert (dest / "sparse").read_bytes() == data
    assert os.stat(dest / "sparse").st_blocks * 512 < 1 << 20


@pytest.mark.parametrize("how", ["cut in a header", "cut at a header", "damaged header"])
def test_a_cut_or_damaged_agent_tar_is_refused_not_taken_for_a_smaller_layer(tmp_path, how):
    """tarfile ends quietly where the input runs out at or in a header, or
    where a header is damaged: the layer would lose the entries after it."""
    path = _tar(tmp_path, [_entry("a", tarfile.REGTYPE, b"x" * 10), _entry("b", tarfile.REGTYPE, b"y")])
    data = bytearray(open(path, "rb").read())
    # Entry b's header, by its name field (the format may put others before it).
    second = next(off for off in range(0, len(data), 512) if data[off:off + 2] == b"b\0")
    if how == "cut in a header":
        data = data[:second + 100]
    elif how == "cut at a header":
        data = data[:second]
    else:
        data[second + 148:second + 156] = b"1234567\0"          # a checksum that does not match
    with open(path, "wb") as f:
        f.write(data)
    dest = tmp_path / "tree"
    dest.mkdir()
    with pytest.raises(ValueError) as exc:
        uppertar.unpack(path, dest)
    assert "the agent's tar of the layer" in str(exc.value), exc.value
