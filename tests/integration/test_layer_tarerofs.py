"""A layer blob written straight into EROFS (dsecd/fs/tarerofs.py, csrc/tarerofs.c)
against the old path (oci.extract_blob into a directory, then mkfs.erofs):
both images mounted (file-backed EROFS) and their trees compared, fsck.erofs
on the new one, and hostile layers refused with nothing left behind."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from dsecd import native
from dsecd.fs import erofs, oci, store, tarerofs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting EROFS and keeping owners and devices: root")

try:
    import zstandard
except ImportError:         # pragma: no cover - scripts/setup.sh installs it
    zstandard = None


def _info(name: str, kind=tarfile.REGTYPE, **attrs) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = attrs.pop("mode", 0o644)
    info.mtime = attrs.pop("mtime", 1_700_000_000)
    for key, value in attrs.items():
        setattr(info, key, value)
    return info


def _tar(entries, fmt=tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _f(name: str, data: bytes, **attrs):
    return _info(name, **attrs), data


def _e(name: str, kind, **attrs):
    return _info(name, kind, **attrs), None


def every_kind_layer() -> bytes:
    """A layer with every entry kind the importer handles, in the formats
    layers come in (PAX and GNU headers), and names that come twice."""
    long_dir = "l" * 90 + "/" + "m" * 90
    entries = [
        _e("./", tarfile.DIRTYPE, mode=0o755),
        _e("etc", tarfile.DIRTYPE, mode=0o750, uid=3, gid=4),
        _f("etc/empty", b""),
        _f("etc/one", b"1"),
        _f("etc/block", b"b" * 4096, mode=0o600),
        _f("etc/block1", b"c" * 4097),
        _f("etc/big", os.urandom(300_000), uid=1000, gid=1000),
        _f("usr/lib/deep/implied", b"parents were never listed\n"),
        _f("bin/su", b"#!/bin/sh\n", mode=0o4755),
        _f("bin/sgid", b"x", mode=0o2711),
        _e("tmp", tarfile.DIRTYPE, mode=0o1777),
        _f("home/far", b"far", uid=70000, gid=70001),
        _e("bin/sh", tarfile.SYMTYPE, linkname="busybox", mode=0o777),
        _e("bin/longlink", tarfile.SYMTYPE, linkname="/" + "t" * 3000),
        _e("bin/escape", tarfile.SYMTYPE, linkname="../../../../etc/shadow"),
        _e("bin/hard-su", tarfile.LNKTYPE, linkname="bin/su"),
        _e("bin/hard-sh", tarfile.LNKTYPE, linkname="bin/sh"),
        _e("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666),
        _e("dev/sda1", tarfile.BLKTYPE, devmajor=8, devminor=1, mode=0o660, gid=6),
        _e("dev/big", tarfile.CHRTYPE, devmajor=300, devminor=70000),
        _e("run/fifo", tarfile.FIFOTYPE, mode=0o620),
        _f(".wh.gone", b""),
        _f("var/.wh.cache", b""),
        _f("opq/.wh..wh..opq", b""),
        _f("opq/kept", b"kept"),
        _e("opq2", tarfile.DIRTYPE, mode=0o700),
        _f("opq2/.wh..wh..opq", b""),
        _f(".wh..wh..opq", b""),
        _f(f"{long_dir}/file-with-a-long-path", b"long path"),
        _e("bin/long-target", tarfile.SYMTYPE, linkname=f"{long_dir}/file-with-a-long-path"),
        _f("utf/d\u00e9j\u00e0-vu \u2603", b"snow"),
        _f("dup", b"first"),
        _f("dup", b"second, which wins", mode=0o640),
        _f("wasdir/inner", b"gone with its directory"),
        _f("wasdir", b"now a file"),
        _f("wasfile", b"then a directory"),
        _e("wasfile", tarfile.DIRTYPE, mode=0o711),
        _f("wasfile/in", b"in"),
        _f("orig", b"linked, then replaced"),
        _e("orig-link", tarfile.LNKTYPE, linkname="orig"),
        _f("orig", b"the new orig"),
        _e("redecl", tarfile.DIRTYPE, mode=0o700),
        _f("redecl/x", b"x"),
        _e("redecl", tarfile.DIRTYPE, mode=0o755, uid=9),
        _f("unhidden", b"hidden then made again"),
        _f(".wh.unhidden", b""),
        _f("unhidden", b"back"),
        _f("sort/-dash", b""), _f("sort/+plus", b""), _f("sort/ space", b""), _f("sort/.dot", b""),
        _f("sort/\x7fdel", b""), _f("sort/\u00ff", b""),
    ]
    entries += [_f(f"many/{'n' * 60}-{i:04d}", b"%d" % i) for i in range(400)]      # several dir blocks
    entries += [_e(f"subs/d{i}", tarfile.DIRTYPE) for i in range(20)]               # nlink of a dir
    return _tar(entries)


def gnu_layer() -> bytes:
    """GNU long names and long link targets (././@LongLink members)."""
    name = "g" * 120 + "/" + "h" * 120
    return _tar([_f(f"{name}/file", b"gnu"),
                 _e("glink", tarfile.LNKTYPE, linkname=f"{name}/file"),
                 _e("gsym", tarfile.SYMTYPE, linkname="s" * 200)], fmt=tarfile.GNU_FORMAT)


def _compress(tar: bytes, kind: str) -> bytes:
    if kind == "gzip":
        return gzip.compress(tar, mtime=0)
    if kind == "zstd":
        return zstandard.ZstdCompressor().compress(tar)
    return tar


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def old_image(tmp: Path, blob: bytes, tar: bytes) -> Path:
    """The layer as pull.py converted every layer before: unpacked into a
    mkdtemp directory, mkfs.erofs on it."""
    path = tmp / "old.blob"
    path.write_bytes(blob)
    tree = Path(tempfile.mkdtemp(prefix="tree-", dir=tmp))
    oci.extract_blob(path, _sha(blob), _sha(tar), tree)
    out = tmp / "old.erofs"
    erofs.build(tree, out)
    shutil.rmtree(tree)
    return out


def new_image(tmp: Path, blob: bytes, name: str = "new.erofs") -> tuple[Path, int, str, str]:
    out = tmp / name
    n, blob_digest, tar_digest = tarerofs.convert_blob(io.BytesIO(blob), out, "test layer")
    return out, n, blob_digest, tar_digest


def tree_of(root: Path) -> dict:
    """Everything a lower layer shows of each path, hard links as groups."""
    out = {}
    first_of_inode: dict[int, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in ["", *sorted(dirnames), *sorted(filenames)] if dirpath == str(root) else \
                [*sorted(dirnames), *sorted(filenames)]:
            path = os.path.join(dirpath, name) if name else dirpath
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            entry = {"mode": oct(st.st_mode), "uid": st.st_uid, "gid": st.st_gid, "nlink": st.st_nlink,
                     "mtime": st.st_mtime_ns, "xattrs": sorted(
                         (k, os.getxattr(path, k, follow_symlinks=False))
                         for k in os.listxattr(path, follow_symlinks=False))}
            if stat.S_ISREG(st.st_mode):
                entry["size"] = st.st_size
                entry["sha"] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                entry["target"] = os.readlink(path)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                entry["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
            if not stat.S_ISDIR(st.st_mode):
                entry["same_as"] = first_of_inode.setdefault(st.st_ino, rel)
            out[rel] = entry
    return out


def mounted_tree(image: Path, tmp: Path) -> dict:
    mnt = Path(tempfile.mkdtemp(prefix="mnt-", dir=tmp))
    native.mount_erofs(str(image), str(mnt))
    try:
        return tree_of(mnt)
    finally:
        native.umount(str(mnt))
        mnt.rmdir()


def fsck(image: Path) -> None:
    if shutil.which("fsck.erofs") is None:
        pytest.skip("fsck.erofs is not installed (erofs-utils)")
    proc = subprocess.run(["fsck.erofs", "--extract", str(image)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("kind", ["gzip", "zstd", "tar"])
def test_every_entry_kind_reads_as_the_unpack_and_mkfs_image(tmp_path, kind):
    if kind == "zstd" and zstandard is None:
        pytest.skip("python3-zstandard is not installed")
    tar = every_kind_layer()
    blob = _compress(tar, kind)
    image, n, blob_digest, tar_digest = new_image(tmp_path, blob)
    assert (blob_digest, tar_digest) == (_sha(blob), _sha(tar))
    assert n == len(tarfile.open(fileobj=io.BytesIO(tar)).getmembers())
    assert image.stat().st_size % erofs.PMEM_ALIGN == 0
    fsck(image)
    new = mounted_tree(image, tmp_path)
    old = mounted_tree(old_image(tmp_path, blob, tar), tmp_path)
    assert new == old
    # the cases themselves, not only their agreement
    assert new["dup"]["sha"] == hashlib.sha256(b"second, which wins").hexdigest()
    assert new["gone"]["mode"] == oct(stat.S_IFCHR) and new["gone"]["rdev"] == (0, 0)
    assert new["opq"]["xattrs"] == [("trusted.overlay.opaque", b"y")]
    assert new["."]["xattrs"] == [("trusted.overlay.opaque", b"y")]
    assert new["bin/hard-su"]["same_as"] == "bin/hard-su" or new["bin/su"]["same_as"] == \
        new["bin/hard-su"]["same_as"]
    assert new["bin/su"]["mode"] == oct(stat.S_IFREG | 0o4755)
    assert (new["home/far"]["uid"], new["home/far"]["gid"]) == (70000, 70001)
    assert new["dev/big"]["rdev"] == (300, 70000)
    assert new["orig-link"]["nlink"] == 1 and new["subs"]["nlink"] == 22


@pytest.mark.parametrize("kind", ["gzip", "tar"])
def test_chunk_hashes_made_while_writing_match_the_finished_image(tmp_path, kind):
    # Several MiB of data among every entry kind, a big file linked and then
    # replaced, names that come twice: what the writer puts below its final
    # mark while fed must be what the finished image holds there.
    big = [_f(f"data/blob{i}", os.urandom(700_000 + 90_001 * i)) for i in range(6)]
    layer = _tar([*big, _e("data/link", tarfile.LNKTYPE, linkname="data/blob2"),
                  _f("data/blob2", os.urandom(1_500_000)), _f(".wh.gone", b""), _f("opq/.wh..wh..opq", b"")])
    for tar in (layer, every_kind_layer()):
        out = tmp_path / f"image-{len(tar)}.erofs"
        chunks = store.ChunkHasher()
        tarerofs.convert_blob(io.BytesIO(_compress(tar, kind)), out, "test layer", chunks=chunks)
        assert chunks.hashes or len(tar) < 2 * store.INDEX_BLOCK, "nothing was hashed while writing"
        assert store.digest_and_index(out, chunks) == store.digest_and_index(out)


def test_gnu_long_names_and_links_read_as_the_old_image(tmp_path):
    tar = gnu_layer()
    blob = _compress(tar, "gzip")
    image = new_image(tmp_path, blob)[0]
    fsck(image)
    assert mounted_tree(image, tmp_path) == mounted_tree(old_image(tmp_path, blob, tar), tmp_path)


def test_an_empty_layer_is_an_empty_root(tmp_path):
    tar = _tar([])
    image = new_image(tmp_path, _compress(tar, "gzip"))[0]
    fsck(image)
    assert list(mounted_tree(image, tmp_path)) == ["."]


def test_the_same_layer_gives_the_same_bytes(tmp_path):
    blob = _compress(every_kind_layer(), "gzip")
    a = new_image(tmp_path, blob, "a.erofs")[0]
    b = new_image(tmp_path, blob, "b.erofs")[0]
    assert a.read_bytes() == b.read_bytes()


HOSTILE = [
    ([_f("../evil", b"x")], "absolute or has '..'"),
    ([_f("a/../../evil", b"x")], "absolute or has '..'"),
    ([_f("/etc/passwd", b"x")], "absolute or has '..'"),
    ([_e("l", tarfile.SYMTYPE, linkname="/etc"), _f("l/passwd", b"x")], "not a directory"),
    ([_f("f", b"x"), _f("f/under", b"x")], "not a directory"),
    ([_e("h", tarfile.LNKTYPE, linkname="../../etc/passwd")], "absolute or has '..'"),
    ([_e("h", tarfile.LNKTYPE, linkname="not-made")], "not a file, symlink or device"),
    ([_e("d", tarfile.DIRTYPE), _e("h", tarfile.LNKTYPE, linkname="d")], "not a file, symlink or device"),
    ([_e("l", tarfile.SYMTYPE, linkname="/etc"), _e("h", tarfile.LNKTYPE, linkname="l/passwd")],
     "not a file, symlink or device"),
    ([_f(".wh.", b"")], "whiteout of ''"),
    ([_f("d/.wh..", b"")], "whiteout of '.'"),
    ([_f(".wh...", b"")], "whiteout of '..'"),
    ([_e("s", tarfile.SYMTYPE, linkname="")], "empty target"),
    ([_f("x" * 256, b"")], "NAME_MAX"),
]


HOSTILE.append(([_f("\u00e9" * 100 + "/../x", b"")], "absolute or has '..'"))   # a long, escaped message


@pytest.mark.parametrize("entries,match", HOSTILE, ids=[m for _, m in HOSTILE])
def test_hostile_entries_are_refused_and_leave_nothing(tmp_path, entries, match):
    blob = _compress(_tar(entries), "gzip")
    out = tmp_path / "hostile.erofs"
    with pytest.raises(oci.TarError, match=match) as err:
        tarerofs.convert_blob(io.BytesIO(blob), out, "layer X")
    assert str(err.value).startswith("layer X")
    assert not out.exists()
    assert os.listdir(tmp_path) == []


def test_a_layer_of_more_entries_than_allowed_is_refused(tmp_path):
    blob = _compress(_tar([_f(f"f{i}", b"") for i in range(11)]), "gzip")
    assert tarerofs.convert_blob(io.BytesIO(blob), tmp_path / "ok.erofs", "layer X", max_entries=11)[0] == 11
    with pytest.raises(oci.TarError, match="more than 10 entries"):
        tarerofs.convert_blob(io.BytesIO(blob), tmp_path / "x.erofs", "layer X", max_entries=10)
    assert os.listdir(tmp_path) == ["ok.erofs"]


@pytest.mark.parametrize("record", [b"99 path=abc\n", b"0000000005 \n", b"12 path_abc\n"])
def test_a_malformed_pax_record_is_refused(tmp_path, record):
    info = _info("plain")
    info.pax_headers = {"path": "abc"}
    tar = _tar([(info, b"x")])
    assert tar.count(b"12 path=abc\n") == 1
    bad = tar.replace(b"12 path=abc\n", record)
    with pytest.raises(oci.TarError, match="PAX header"):
        tarerofs.convert_blob(io.BytesIO(bad), tmp_path / "x.erofs", "layer X")
    assert os.listdir(tmp_path) == []


def test_a_truncated_or_corrupt_blob_is_refused(tmp_path):
    tar = every_kind_layer()
    blob = _compress(tar, "gzip")
    for bad in (blob[: len(blob) // 2], blob[:100] + b"\0" * 50 + blob[150:]):
        with pytest.raises(oci.TarError, match="corrupt or truncated"):
            tarerofs.convert_blob(io.BytesIO(bad), tmp_path / "x.erofs", "layer X")
        assert not (tmp_path / "x.erofs").exists()
    with pytest.raises(oci.TarError, match="truncated"):       # a plain tar cut inside a file
        tarerofs.convert_blob(io.BytesIO(tar[:4000]), tmp_path / "x.erofs", "layer X")
    assert os.listdir(tmp_path) == []


def test_what_the_writer_does_not_serve_is_said_for_the_old_path(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "x"}) as tf:
        tf.addfile(_info("a", size=1), io.BytesIO(b"a"))
    with pytest.raises(tarerofs.Unserved, match="global header"):
        tarerofs.convert_blob(io.BytesIO(buf.getvalue()), tmp_path / "x.erofs", "layer X")
    assert not (tmp_path / "x.erofs").exists()


def test_refused_content_under_another_blobs_digest_is_the_registrys_fault(tmp_path):
    """Bytes the writer refuses (a `..` entry) that are not the bytes of the
    digest they came under: the digest is said to be wrong (the registry
    sent other bytes), not the image to be unsafe."""
    good = _tar([(_info("a", size=1), b"a")])
    evil = _tar([(_info("../evil", size=1), b"e")])
    digest = "sha256:" + hashlib.sha256(good).hexdigest()
    with pytest.raises(oci.DigestMismatch, match="not to the digest the manifest names"):
        tarerofs.convert_blob(io.BytesIO(evil), tmp_path / "x.erofs", "layer X", digest=digest)
    with pytest.raises(oci.TarError, match=r"'\.\./evil'") as info:       # its own digest: the image's fault
        tarerofs.convert_blob(io.BytesIO(evil), tmp_path / "x.erofs", "layer X",
                              digest="sha256:" + hashlib.sha256(evil).hexdigest())
    assert not isinstance(info.value, oci.DigestMismatch)
    assert os.listdir(tmp_path) == []
