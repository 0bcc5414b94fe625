"""Unpacking a pulled layer blob (oci.extract_blob): the entry checks, the
whiteouts, the digests, and gzip streams the way gzip.GzipFile reads them."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from dsecd.fs import oci

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking keeps owners and makes whiteout devices: root")


def _tar(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name: str, kind=tarfile.REGTYPE, data: bytes | None = None, **attrs):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = attrs.pop("mode", 0o644)
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data if kind == tarfile.REGTYPE else None


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _unpack(tmp_path: Path, tar: bytes, blob: bytes | None = None, digest: str | None = None) -> Path:
    blob = gzip.compress(tar, mtime=0) if blob is None else blob
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "blob"
    path.write_bytes(blob)
    root = tmp_path / "root"
    root.mkdir()
    oci.extract_blob(path, digest or _sha(blob), _sha(tar), root)
    return root


def test_files_links_whiteouts_and_owners_unpack_as_in_the_tar(tmp_path):
    big = os.urandom(3 << 20)               # spans several copy chunks
    tar = _tar([_member("d", tarfile.DIRTYPE, mode=0o750, uid=5, gid=6),
                _member("d/big", data=big, mode=0o600, uid=7, gid=8),
                _member("d/small", data=b"small"),
                _member("d/hard", tarfile.LNKTYPE, linkname="d/big"),
                _member("d/sym", tarfile.SYMTYPE, linkname="small"),
                _member("d/.wh.gone", data=b""),
                _member("o/.wh..wh..opq", data=b""),
                _member("r", data=b"a file first"),
                _member("r", tarfile.DIRTYPE, mode=0o700),
                _member("r/in", data=b"in")])
    root = _unpack(tmp_path, tar)
    assert (root / "d/big").read_bytes() == big
    st = os.lstat(root / "d/big")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_nlink) == (0o600, 7, 8, 2)
    assert os.lstat(root / "d/hard").st_ino == st.st_ino
    assert os.readlink(root / "d/sym") == "small"
    gone = os.lstat(root / "d/gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == os.makedev(0, 0)
    assert os.getxattr(root / "o", "trusted.overlay.opaque") == b"y"
    assert (root / "r/in").read_bytes() == b"in" and stat.S_IMODE(os.lstat(root / "r").st_mode) == 0o700


def test_a_hard_link_to_a_symlink_links_the_symlink_never_what_it_points_at(tmp_path):
    host = tmp_path / "host-secret"
    host.write_text("secret")
    tar = _tar([_member("s", tarfile.SYMTYPE, linkname=str(host)), _member("h", tarfile.LNKTYPE, linkname="s")])
    root = _unpack(tmp_path, tar)
    assert os.path.islink(root / "h") and os.lstat(host).st_nlink == 1


@pytest.mark.parametrize("entries, match", [
    ([_member("../x", data=b"x")], "'..'"),
    ([_member("/abs", data=b"x")], "absolute"),
    ([_member("l", tarfile.SYMTYPE, linkname="/tmp"), _member("l/x", data=b"x")], "not a directory"),
    ([_member("d", tarfile.DIRTYPE), _member("d", tarfile.SYMTYPE, linkname="/tmp"), _member("d/x", data=b"x")],
     "not a directory"),
    ([_member("h", tarfile.LNKTYPE, linkname="nothing")], "hard link"),
    ([_member("d", tarfile.DIRTYPE), _member("h", tarfile.LNKTYPE, linkname="d")], "hard link"),
    ([_member("l", tarfile.SYMTYPE, linkname="/"), _member("h", tarfile.LNKTYPE, linkname="l/etc/passwd")],
     "hard link"),
    ([_member("d/.wh.", data=b"")], "whiteout"),
    ([_member("d/.wh..", data=b"")], "whiteout"),
    ([_member(".wh...", data=b"")], "whiteout"),
])
def test_entries_that_would_leave_or_wreck_the_tree_are_refused(tmp_path, entries, match):
    with pytest.raises(oci.TarError, match=match):
        _unpack(tmp_path, _tar(entries))
    assert not os.path.exists("/tmp/x")


def test_a_blob_corrupt_or_cut_mid_stream_is_refused(tmp_path):
    tar = _tar([_member("f", data=os.urandom(1 << 20)), _member("g", data=b"g")])
    blob = gzip.compress(tar, mtime=0)
    damaged = blob[:len(blob) // 2] + bytes(64) + blob[len(blob) // 2 + 64:]
    with pytest.raises(oci.TarError, match="corrupt or truncated"):
        _unpack(tmp_path / "a", tar, damaged, _sha(blob))
    with pytest.raises(oci.TarError, match="corrupt or truncated"):
        _unpack(tmp_path / "b", tar, blob[:len(blob) // 2], _sha(blob))


@pytest.mark.parametrize("pack", ["bzip2", "xz"])
def test_bzip2_and_xz_blobs_unpack_and_a_corrupt_one_is_refused_as_such(tmp_path, pack):
    import bz2
    import lzma

    compress = bz2.compress if pack == "bzip2" else lzma.compress
    tar = _tar([_member("f", data=os.urandom(1 << 20)), _member("g", data=b"g")])
    blob = compress(tar)
    assert (_unpack(tmp_path / "ok", tar, blob, _sha(blob)) / "g").read_bytes() == b"g"
    damaged = blob[:len(blob) // 2] + bytes(64) + blob[len(blob) // 2 + 64:]
    with pytest.raises(oci.TarError, match="corrupt"):          # not an I/O error
        _unpack(tmp_path / "bad", tar, damaged, _sha(damaged))


def test_a_blob_that_is_not_the_manifests_is_refused(tmp_path):
    tar = _tar([_member("f", data=b"f")])
    with pytest.raises(oci.TarError, match="hashes to"):
        _unpack(tmp_path, tar, digest=_sha(b"other bytes"))


def test_gzip_members_and_zero_padding_read_as_gzipfile_reads_them(tmp_path):
    tar = _tar([_member("f", data=os.urandom(300_000)), _member("g", data=b"g" * 100_000)])
    cut = len(tar) // 3
    blob = gzip.compress(tar[:cut]) + b"\0" * 1000 + gzip.compress(tar[cut:]) + b"\0\0"
    assert gzip.decompress(blob) == tar
    root = _unpack(tmp_path, tar, blob)
    assert (root / "g").read_bytes() == b"g" * 100_000


def test_a_directory_that_is_not_empty_is_not_unpacked_into(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "old").write_text("x")
    tar = _tar([_member("f", data=b"f")])
    (tmp_path / "blob").write_bytes(tar)
    with pytest.raises(oci.TarError, match="not empty"):
        oci.extract_blob(tmp_path / "blob", _sha(tar), _sha(tar), tmp_path / "root")


@pytest.mark.parametrize("content", [b"hello\n", b"", b"\x1f\x8b not gzip"])
def test_a_file_that_is_no_tar_archive_says_so_in_one_line(tmp_path, content):
    path = tmp_path / "small.txt"
    path.write_bytes(content)
    (tmp_path / "work").mkdir()
    with pytest.raises(oci.TarError) as e:
        oci.unpack_image(path, tmp_path / "work")
    assert str(e.value).startswith("not a tar archive (plain, gzip, bzip2 or xz)") and "\n" not in str(e.value)
