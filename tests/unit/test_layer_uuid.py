"""Every built layer's EROFS uuid is made of its content (dsecd/fs/erofs.py
stamp_uuid): overlayfs names a copied-up file's lower layer only by that
uuid, and a microVM's agent finds a renamed file's image xattrs by it. No
root; needs erofs-utils (mkfs.erofs, fsck.erofs, dump.erofs)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from dsecd.fs import erofs

pytestmark = pytest.mark.skipif(not all(shutil.which(t) for t in ("mkfs.erofs", "fsck.erofs", "dump.erofs")),
                                reason="needs erofs-utils")


def _tree(top: Path, text: str) -> Path:
    (top / "etc").mkdir(parents=True)
    (top / "etc" / "f").write_text(text)
    return top


def _uuid_of(image: Path) -> uuid.UUID:
    """The uuid as erofs-utils reads the superblock (not our own parser)."""
    out = subprocess.run(["dump.erofs", "-s", str(image)], check=True, capture_output=True, text=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("Filesystem UUID:"))
    return uuid.UUID(line.split(":", 1)[1].strip())


def test_the_uuid_is_made_of_the_content_and_the_superblock_checksum_fits(tmp_path):
    src = _tree(tmp_path / "a", "one\n")
    erofs.build(src, tmp_path / "a1.erofs")
    erofs.build(src, tmp_path / "a2.erofs")
    erofs.build(_tree(tmp_path / "b", "two\n"), tmp_path / "b.erofs")
    a1 = (tmp_path / "a1.erofs").read_bytes()
    assert a1 == (tmp_path / "a2.erofs").read_bytes(), "the same tree gave other bytes"
    a, b = _uuid_of(tmp_path / "a1.erofs"), _uuid_of(tmp_path / "b.erofs")
    assert a.int and b.int and a != b
    # The uuid is the sha256 of the image mkfs.erofs wrote (null uuid, no padding).
    subprocess.run(["mkfs.erofs", "--quiet", "-T0", f"-U{erofs.NULL_UUID}", "-Enoinline_data",
                    str(tmp_path / "plain.erofs"), str(src)], check=True)
    assert a.bytes == hashlib.sha256((tmp_path / "plain.erofs").read_bytes()).digest()[:16]
    # fsck.erofs 1.5 exits 0 on a wrong superblock checksum; it says so on stderr.
    for image in ("a1.erofs", "b.erofs"):
        r = subprocess.run(["fsck.erofs", str(tmp_path / image)], capture_output=True, text=True)
        assert r.returncode == 0 and "chksum" not in r.stderr and "checksum" not in r.stderr, r.stderr
    # A checksum left as mkfs.erofs made it (for the null uuid) is what fsck reports.
    stale = bytearray(a1)
    stale[erofs.SUPER_OFFSET + erofs.SUPER_CHECKSUM:erofs.SUPER_OFFSET + erofs.SUPER_CHECKSUM + 4] = \
        (tmp_path / "plain.erofs").read_bytes()[erofs.SUPER_OFFSET + erofs.SUPER_CHECKSUM:][:4]
    (tmp_path / "stale.erofs").write_bytes(stale)
    r = subprocess.run(["fsck.erofs", str(tmp_path / "stale.erofs")], capture_output=True, text=True)
    assert "chksum" in r.stderr


def test_an_image_that_has_a_uuid_is_not_stamped_again(tmp_path):
    src = _tree(tmp_path / "a", "one\n")
    erofs.build(src, tmp_path / "a.erofs")
    with pytest.raises(OSError) as err:
        erofs.stamp_uuid(tmp_path / "a.erofs")
    assert "already has a uuid" in str(err.value)
    (tmp_path / "junk").write_bytes(os.urandom(8192))
    with pytest.raises(OSError, match="holds no EROFS superblock"):
        erofs.stamp_uuid(tmp_path / "junk")
