"""Image tarballs for the tests: docker-save archives and OCI layouts built
from tar members."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path


def _tar_bytes(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name, data=b"", mode=0o644):
    ti = tarfile.TarInfo(name)
    ti.mode = mode
    return ti, data


def _entry(name, kind, **kw):
    ti = tarfile.TarInfo(name)
    ti.type = kind
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti, None


def docker_save(path: Path, layers: list[bytes], config: dict | None = None) -> None:
    members = []
    names = []
    for i, data in enumerate(layers):
        names.append(f"l{i}/layer.tar")
        members.append(_file(names[-1], data))
    cfg = json.dumps({"config": config or {}}).encode()
    members.append(_file("config.json", cfg))
    members.append(_file("manifest.json", json.dumps(
        [{"Config": "config.json", "RepoTags": ["t:latest"], "Layers": names}]).encode()))
    path.write_bytes(_tar_bytes(members))


def rootfs_layer(rootfs: str) -> bytes:
    """A directory as one uncompressed tar layer."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(rootfs, arcname=".")
    return buf.getvalue()


def layer_of(files: dict[str, bytes | None], mode: int = 0o644) -> bytes:
    """A layer tar from path -> content (None: a directory)."""
    members = []
    for name, data in files.items():
        if data is None:
            members.append(_entry(name, tarfile.DIRTYPE, mode=0o755))
        else:
            members.append(_file(name, data, mode))
    return _tar_bytes(members)


def _blob(blobs: dict[str, bytes], data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def oci_layout(path: Path, images: list[tuple[dict | None, list[bytes], dict]], nested: bool = True) -> None:
    """An OCI image layout tarball of images (platform or None, layers, config:
    OCI's config object). nested: index.json points at one image index that
    lists the images (what buildx writes for several platforms); else
    index.json lists them itself."""
    blobs: dict[str, bytes] = {}
    manifests = []
    for platform, layers, config in images:
        doc = {"os": "linux", "architecture": (platform or {}).get("architecture", "amd64"), "config": config,
               "rootfs": {"type": "layers", "diff_ids": []}}
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": _blob(blobs, json.dumps(doc).encode(), "application/vnd.oci.image.config.v1+json"),
                    "layers": [_blob(blobs, data, "application/vnd.oci.image.layer.v1.tar") for data in layers]}
        desc = _blob(blobs, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
        if platform:
            desc["platform"] = {k: v for k, v in platform.items() if v}
        manifests.append(desc)
    top = manifests
    if nested:
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests}
        top = [_blob(blobs, json.dumps(index).encode(), "application/vnd.oci.image.index.v1+json")]
    members = [_file("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
               _file("index.json", json.dumps({"schemaVersion": 2, "manifests": top}).encode()),
               _entry("blobs", tarfile.DIRTYPE, mode=0o755), _entry("blobs/sha256", tarfile.DIRTYPE, mode=0o755)]
    members += [_file(f"blobs/sha256/{digest[7:]}", data) for digest, data in blobs.items()]
    path.write_bytes(_tar_bytes(members))


def unpack(tarball: Path, dest: Path) -> Path:
    """An image tarball unpacked into dest, by tar as a user would."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-C", str(dest), "-xf", str(tarball)], check=True)
    return dest
