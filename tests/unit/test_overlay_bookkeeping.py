"""A sandbox's overlay (native.ContainerSpec.overlay_options) makes no
redirect and no metacopy in its upper dir, whatever the host's overlay
module defaults to (overlay.redirect_dir, overlay.metacopy): a snapshot
packs the upper dir as a layer, and such a layer is not whole (a renamed
directory's files, a chmod'ed file's data stay in the layer below), an
overlay with metacopy off refuses to read it (EPERM), and `image flatten`
refuses it. A host default of on is stood for by the same options given
ahead of dsecd's (the later one wins, as dsecd's over a module default).
Root: mounts an overlay."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess

import pytest

from dsecd import native
from dsecd.fs.images import ImageError, ImageStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting an overlay needs root")


def test_a_sandbox_overlay_renames_and_chmods_without_redirect_or_metacopy(tmp_path):
    low, upper, work, root = (tmp_path / n for n in ("low", "upper", "work", "root"))
    for d in (upper, work, root):
        d.mkdir()
    (low / "etc" / "conf.d").mkdir(parents=True)
    (low / "etc" / "conf.d" / "a").write_bytes(b"a" * 10)
    (low / "big").write_bytes(os.urandom(64 << 10))
    spec = native.ContainerSpec(rootfs=str(root), lowerdirs=[str(low)], upperdir=str(upper), workdir=str(work),
                                hostname="box", init_path="/init", cgroup_procs=[], tmp_size_bytes=1 << 20,
                                shm_size_bytes=1 << 20)
    host_default = b"redirect_dir=on,metacopy=on,"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", host_default + spec.overlay_options(), root],
                   check=True)
    try:
        with pytest.raises(OSError) as info:       # mv falls back to a copy, as tools do for EXDEV
            os.rename(root / "etc" / "conf.d", root / "etc" / "moved.d")
        assert info.value.errno == errno.EXDEV
        os.chmod(root / "big", 0o600)
    finally:
        native.umount(str(root))
    marks = {os.path.relpath(os.path.join(d, n), upper): name
             for d, dirs, files in os.walk(upper) for n in dirs + files
             for name in os.listxattr(os.path.join(d, n), follow_symlinks=False)
             if name in ("trusted.overlay.redirect", "trusted.overlay.metacopy")}
    assert marks == {}, f"the upper dir holds overlay bookkeeping a layer cannot stand on: {marks}"
    assert (upper / "big").read_bytes() == (low / "big").read_bytes(), "the chmod did not copy the data up"


@pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")
def test_a_layer_built_from_another_overlays_upper_dir_is_refused_by_flatten_saying_so(tmp_path):
    """Such a layer keeps the redirect (mkfs.erofs keeps a directory's
    xattrs); the refusal names the xattr, the path, the layer and where
    the layer came from."""
    low, upper = tmp_path / "low", tmp_path / "upper"
    (low / "etc" / "conf.d").mkdir(parents=True)
    (low / "etc" / "conf.d" / "a").write_text("a")
    (upper / "etc" / "moved.d").mkdir(parents=True)
    os.setxattr(upper / "etc" / "moved.d", "trusted.overlay.redirect", b"conf.d")
    images = ImageStore(tmp_path / "store", tmp_path / "scratch")
    images.build_from_dir(str(low), "base")
    image = images.build_from_dir(str(upper), "app", parent="base")
    with pytest.raises(ImageError) as info:
        images.flatten("app", "flat", lambda _digests: contextlib.nullcontext([str(low), str(upper)]))
    err = str(info.value)
    assert info.value.code == "unsupported", err
    assert "trusted.overlay.redirect on /etc/moved.d" in err and "layer 2 of 2" in err, err
    assert image.layers[-1]["digest"] in err and "built from a host directory" in err, err
    assert os.listdir(images.scratch) == []
