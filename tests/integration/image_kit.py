"""Images for the tests: docker-save archives and OCI layouts built from
tar members, and OCI image layouts (gzip, zstd and plain layers,
multi-platform indexes) pushed to a registry with skopeo."""

from __future__ import annotations

import gzip
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


# ---------------------------------------------------------------- OCI layouts and registries

GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
TAR = "application/vnd.oci.image.layer.v1.tar"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def compress(tar: bytes, kind: str) -> tuple[bytes, str]:
    """A tar layer as a blob: (bytes, media type); kind is gzip, zstd or tar.
    Fixed mtime in the gzip header: the same tar gives the same blob."""
    if kind == "gzip":
        return gzip.compress(tar, mtime=0), GZIP
    if kind == "zstd":
        import zstandard

        return zstandard.ZstdCompressor().compress(tar), ZSTD
    return tar, TAR


class Layout:
    """An OCI image layout directory the tests fill with images, then push."""

    def __init__(self, root: Path):
        self.root = Path(root)
        (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.tags: dict[str, dict] = {}

    def blob(self, data: bytes, media_type: str) -> dict:
        digest = sha256(data)
        (self.root / "blobs" / "sha256" / digest[7:]).write_bytes(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def image(self, layers: list[tuple[bytes, str]], config: dict | None = None, arch: str = "amd64") -> dict:
        """A manifest of `layers` ((tar bytes, gzip|zstd|tar), bottom first):
        its descriptor, with its platform."""
        blobs = [compress(tar, kind) for tar, kind in layers]
        cfg = {"architecture": arch, "os": "linux", "config": config or {},
               "rootfs": {"type": "layers", "diff_ids": [sha256(tar) for tar, _ in layers]}}
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST,
                    "config": self.blob(json.dumps(cfg).encode(), CONFIG),
                    "layers": [self.blob(data, mt) for data, mt in blobs]}
        desc = self.blob(json.dumps(manifest).encode(), MANIFEST)
        return {**desc, "platform": {"architecture": arch, "os": "linux"}}

    def index(self, manifests: list[dict]) -> dict:
        """A multi-platform index of image descriptors."""
        return self.blob(json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}).encode(),
                         INDEX)

    def tag(self, name: str, desc: dict) -> None:
        self.tags[name] = desc
        entries = [{**{k: v for k, v in d.items() if k != "platform"},
                    "annotations": {"org.opencontainers.image.ref.name": t}} for t, d in self.tags.items()]
        (self.root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": entries}))


def push(layout: Layout, tag: str, dest: str, *args: str) -> None:
    """skopeo copy of a tagged image (all platforms) to docker://dest; `args`:
    more skopeo options (--dest-creds, --dest-cert-dir, --dest-tls-verify)."""
    cmd = ["skopeo", "copy", "--quiet", "--all", "--preserve-digests", "--dest-tls-verify=false",
           *args, f"oci:{layout.root}:{tag}", f"docker://{dest}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")

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
