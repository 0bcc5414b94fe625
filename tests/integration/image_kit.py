"""Image tarballs for the tests: docker-save archives built from tar members."""

from __future__ import annotations

import io
import json
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
