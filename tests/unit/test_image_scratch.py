"""The scratch dir (dsecd/fs/images.py): what a killed daemon left there
unpacking a tarball or a microVM's writable layer goes at the next start."""

from __future__ import annotations

from dsecd.fs.images import ImageStore


def test_a_killed_daemons_unpack_trees_go_when_the_store_opens(tmp_path):
    scratch = tmp_path / "scratch"
    for name in ("unpack-abc123/layer-0/d", "vm-upper-sb1-x9/upper/etc"):
        (scratch / name).mkdir(parents=True)
        (scratch / name / "f").write_bytes(b"x" * 4096)
    (scratch / "unpack-abc123" / "layer-0" / "d").chmod(0o500)     # as an image's own mode may be
    ImageStore(tmp_path / "store", scratch)
    assert list(scratch.iterdir()) == []
