"""flatten.merge (dsecd/fs/flatten.py) on hand-made layer trees: what an
overlay of the layers shows is what the merged tree holds."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="trusted.* xattrs need root")

from dsecd.fs import flatten  # noqa: E402


def test_an_escaped_overlay_xattr_is_kept_and_not_taken_as_opaque(tmp_path):
    """A layer's trusted.overlay.overlay.* xattrs are a nested overlay's
    (an image holding an overlay's upper dir): the sandbox's overlay shows
    them as trusted.overlay.* and does not act on them. Only its own
    trusted.overlay.* (opaque, here acted on) are left out."""
    low, top = tmp_path / "low", tmp_path / "top"
    (low / "nest").mkdir(parents=True)
    (low / "nest" / "kept").write_text("below")
    (top / "nest").mkdir(parents=True)
    os.setxattr(top / "nest", "trusted.overlay.overlay.opaque", b"y")
    os.setxattr(top / "nest", "user.note", b"n")
    (top / "hid").mkdir()
    os.setxattr(top / "hid", "trusted.overlay.opaque", b"y")
    out = tmp_path / "out"
    flatten.merge([str(low), str(top)], out)
    assert (out / "nest" / "kept").read_text() == "below"            # escaped: not opaque
    assert sorted(os.listxattr(out / "nest")) == ["trusted.overlay.overlay.opaque", "user.note"]
    assert os.getxattr(out / "nest", "trusted.overlay.overlay.opaque") == b"y"
    assert os.listxattr(out / "hid") == []


@pytest.mark.parametrize("xattr, value, kind", [
    ("trusted.overlay.redirect", b"/a", "file"),       # a renamed directory's: on the directory itself
    ("trusted.overlay.whiteout", b"", "file"),
    ("trusted.overlay.opaque", b"x", "dir"),           # a directory holding such whiteouts
    ("trusted.overlay.metacopy", b"", "file"),
])
def test_overlay_bookkeeping_flatten_cannot_reproduce_is_refused(tmp_path, xattr, value, kind):
    """A layer built from a host directory may carry overlay's own
    bookkeeping, which the sandbox's overlay acts on (it follows a
    redirect to another directory's contents, hides a file marked as a
    whiteout in a directory marked "x"): a merge that ignored it would
    not show what a sandbox of the image shows, so it is refused, naming
    the path."""
    low, top = tmp_path / "low", tmp_path / "top"
    (low / "a").mkdir(parents=True)
    (low / "a" / "x").write_text("x")
    (top / "b").mkdir(parents=True)
    marked = top / "b" if kind == "dir" or xattr.endswith("redirect") else top / "b" / "f"
    if marked.name == "f":
        marked.write_text("")
    os.setxattr(marked, xattr, value)
    with pytest.raises(flatten.Unsupported) as info:
        flatten.merge([str(low), str(top)], tmp_path / "out")
    assert xattr in str(info.value) and str(marked.relative_to(top)) in str(info.value)
    assert info.value.layer == 2 and "built from a host directory" in str(info.value), info.value
