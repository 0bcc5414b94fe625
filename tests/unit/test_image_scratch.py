"""The scratch dir (dsecd/fs/images.py): what a killed daemon left there
unpacking a tarball or a microVM's writable layer goes at the next start,
and an imported layer is bounded before it is unpacked there."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from dsecd.fs.images import ImageError, ImageStore


def test_a_killed_daemons_unpack_trees_go_when_the_store_opens(tmp_path):
    scratch = tmp_path / "scratch"
    for name in ("unpack-abc123/layer-0/d", "vm-upper-sb1-x9/upper/etc"):
        (scratch / name).mkdir(parents=True)
        (scratch / name / "f").write_bytes(b"x" * 4096)
    (scratch / "unpack-abc123" / "layer-0" / "d").chmod(0o500)     # as an image's own mode may be
    ImageStore(tmp_path / "store", scratch)
    assert list(scratch.iterdir()) == []


def _zeros_tar(size: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("zeros")
        info.size = size
        tf.addfile(info, io.BytesIO(bytes(size)))
    return buf.getvalue()


def _docker_save(path: Path, layers: list[bytes], config: dict | None = None) -> None:
    with tarfile.open(path, "w") as tf:
        names = []
        for i, data in enumerate(layers):
            names.append(f"l{i}/layer.tar")
            info = tarfile.TarInfo(names[-1])
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, data in (("config.json", json.dumps(config or {"config": {}}).encode()), ("manifest.json", json.dumps(
                [{"Config": "config.json", "RepoTags": ["t:1"], "Layers": names}]).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("kind", ["docker-save", "rootfs"])
def test_an_imported_layer_past_max_layer_bytes_is_refused_before_it_is_written(tmp_path, kind):
    # Like a pulled layer: a tarball of a few KiB (gzip, or one sparse
    # member) can stand for terabytes the unpack would write to the scratch disk.
    big = _zeros_tar(2 << 20)
    src = tmp_path / "image.tar"
    if kind == "rootfs":
        src.write_bytes(big)
    else:
        _docker_save(src, [_zeros_tar(1000), big])
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    store.max_layer_bytes = 1 << 20
    with pytest.raises(ImageError) as e:
        store.build_from_dir(str(src), "big")
    assert e.value.code == "limit", e.value
    assert "images.max_layer_bytes (1048576 bytes" in str(e.value) and str(src) in str(e.value), e.value
    assert ("layer 2 of 2" in str(e.value)) == (kind == "docker-save"), e.value
    assert list((tmp_path / "scratch").iterdir()) == []


def test_an_archive_of_an_image_for_another_platform_is_refused(tmp_path):
    """A docker save of an image for another architecture: its programs
    cannot run here, as a pull of it says; nothing is unpacked or named.
    A config that names no architecture (some tools write none) is taken."""
    from dsecd.fs.oci import host_platform

    other = "s390x" if host_platform()["architecture"] != "s390x" else "amd64"
    src = tmp_path / "image.tar"
    _docker_save(src, [_zeros_tar(1000)], {"architecture": other, "os": "linux", "config": {}})
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    with pytest.raises(ImageError) as e:
        store.build_from_dir(str(src), "foreign")
    assert e.value.code == "bad_request" and f"linux/{other}" in str(e.value), e.value
    assert list((tmp_path / "scratch").iterdir()) == []
    _docker_save(src, [_zeros_tar(1000)], {"config": {}})
    assert store.build_from_dir(str(src), "plain").name == "plain"
