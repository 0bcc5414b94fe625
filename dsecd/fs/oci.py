"""Unpack `docker save` and OCI-layout tarballs, and OCI layer blobs a pull
downloaded, into one directory per layer.

Each tar layer is extracted into its own directory, with the OCI whiteouts
turned into what overlayfs understands in a lower layer: `.wh.NAME` becomes
a 0:0 character device NAME, `.wh..wh..opq` sets trusted.overlay.opaque=y on
its directory. Every entry is checked before it touches the disk: no
absolute names, no `..`, no hard link to outside the layer, and no entry
whose parent is a symlink (which could redirect the write onto the host).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import os
import stat
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

try:        # Debian's python3-zstandard (scripts/setup.sh): zstd layers of pulled images
    import zstandard
except ImportError:        # pragma: no cover - the install has it; said when a zstd layer comes
    zstandard = None

# What a damaged archive raises (disk errors such as ENOSPC stay OSErrors).
CORRUPT = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError,
           *((zstandard.ZstdError,) if zstandard else ()))
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
STREAM_BUFFER = 1 << 20
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class TarError(Exception):
    pass


def _safe_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts:
        raise TarError(f"entry {name!r} is absolute or has '..'")
    parts = [x for x in p.parts if x not in (".", "")]
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


def _check_parents(root: Path, rel: PurePosixPath) -> Path:
    """Create missing parent dirs; refuse a parent that is a symlink or not a dir."""
    cur = root
    for part in rel.parts[:-1]:
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            os.mkdir(cur, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise TarError(f"entry {str(rel)!r}: parent {part!r} is not a directory (symlink or file)")
    return root / rel


def _remove(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        import shutil

        shutil.rmtree(path)
    else:
        os.unlink(path)


def _extract_member(tf: tarfile.TarFile, m: tarfile.TarInfo, root: Path) -> None:
    rel = _safe_name(m.name)
    if rel == PurePosixPath("."):
        return
    base = rel.name
    if base == OPAQUE:
        d = _check_parents(root, rel).parent
        d.mkdir(exist_ok=True)
        os.setxattr(d, "trusted.overlay.opaque", b"y")
        return
    if base.startswith(WHITEOUT):
        target = _check_parents(root, rel.parent / base[len(WHITEOUT):])
        _remove(target)
        os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        return
    path = _check_parents(root, rel)
    if m.isdir():
        if not path.is_dir() or path.is_symlink():
            _remove(path)
            os.mkdir(path)
    else:
        _remove(path)
        if m.isreg():
            src = tf.extractfile(m)
            with open(path, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        elif m.issym():
            os.symlink(m.linkname, path)
        elif m.islnk():
            target = _safe_name(m.linkname)
            tpath = root / target
            if not os.path.lexists(tpath) or os.path.islink(tpath.parent):
                raise TarError(f"hard link {m.name!r} -> {m.linkname!r}: target not in this layer")
            os.link(tpath, path)
            return
        elif m.ischr() or m.isblk():
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            os.mknod(path, kind | (m.mode & 0o7777), os.makedev(m.devmajor, m.devminor))
        elif m.isfifo():
            os.mkfifo(path, m.mode & 0o7777)
        else:
            raise TarError(f"entry {m.name!r} has an unsupported type {m.type!r}")
    os.lchown(path, m.uid, m.gid)
    if not m.issym():
        os.chmod(path, m.mode & 0o7777)


def extract_layer(fileobj, root: Path) -> int:
    """Extract one layer tar (plain, gzip or bz2/xz) into root; returns entries."""
    n = 0
    try:
        with tarfile.open(fileobj=fileobj, mode="r:*") as tf:
            for m in tf:
                _extract_member(tf, m, root)
                n += 1
    except CORRUPT as err:
        raise TarError(f"corrupt or truncated layer: {err}") from err
    return n


class _Hashing:
    """A reader that hashes what passes through it."""

    def __init__(self, source):
        self.source = source
        self.sha = hashlib.sha256()
        self.bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self.source.read(size)
        self.sha.update(data)
        self.bytes += len(data)
        return data

    def drain(self) -> None:
        while self.read(STREAM_BUFFER):
            pass

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def _decompressed(blob: _Hashing, magic: bytes, what: str):
    """The tar stream inside a layer blob: gzip and zstd by their magic bytes
    (whatever the media type says), anything else read as a plain tar."""
    if magic.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=blob, mode="rb")
    if magic.startswith(ZSTD_MAGIC):
        if zstandard is None:
            raise TarError(f"{what} is zstd-compressed and this host lacks the zstd decompressor "
                           "(apt-get install python3-zstandard)")
        return zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True)
    return blob


def extract_blob(path: Path, digest: str, diff_id: str, root: Path) -> int:
    """Extract a downloaded OCI layer blob (gzip, zstd or plain tar) into
    `root` in one streaming pass, with the same entry checks and whiteout
    handling as a tarball's layers, while checking both digests: the blob's
    against `digest` (the manifest's) and the uncompressed tar's against
    `diff_id` (the image config's). Returns the number of entries; TarError
    names the layer and what did not match."""
    what = f"layer {digest}"
    n = 0
    try:
        with open(path, "rb") as raw:
            blob = _Hashing(raw)
            tar = _Hashing(_decompressed(blob, raw.peek(4)[:4], what))
            with tarfile.open(fileobj=tar, mode="r|", bufsize=STREAM_BUFFER) as tf:
                for m in tf:
                    _extract_member(tf, m, root)
                    n += 1
            tar.drain()             # the end-of-archive padding counts in the diff_id
            blob.drain()
    except CORRUPT as err:
        raise TarError(f"{what} is corrupt or truncated: {err}") from err
    except TarError as err:
        raise TarError(f"{what}: {err}") from err
    if blob.digest() != digest:
        raise TarError(f"{what}: the downloaded blob hashes to {blob.digest()}, not to the digest "
                       "the manifest names; the registry sent other bytes")
    if tar.digest() != diff_id:
        raise TarError(f"{what}: its uncompressed content hashes to {tar.digest()}, but the image "
                       f"config's diff_id is {diff_id}")
    return n


def _config_of(cfg: dict) -> dict:
    c = cfg.get("config") or {}
    env = dict(e.split("=", 1) for e in c.get("Env") or [] if "=" in e)
    user = c.get("User") or "0"
    return {"env": env, "cwd": c.get("WorkingDir") or "/",
            "user": int(user) if str(user).isdigit() else 0,
            "entrypoint": (c.get("Entrypoint") or []) + (c.get("Cmd") or [])}


def _read_json(tf: tarfile.TarFile, name: str) -> dict | list:
    try:
        f = tf.extractfile(name)
    except KeyError:
        raise TarError(f"{name} is missing") from None
    try:
        return json.load(f)
    except ValueError as err:
        raise TarError(f"{name} is not valid JSON: {err}") from err


def _layer_paths(tf: tarfile.TarFile) -> tuple[list[str], dict]:
    names = set(tf.getnames())
    if "manifest.json" in names:                  # docker save (and OCI+docker hybrids)
        manifest = _read_json(tf, "manifest.json")
        if not isinstance(manifest, list) or not manifest:
            raise TarError("manifest.json has no images")
        entry = manifest[0]
        cfg = _read_json(tf, entry["Config"]) if entry.get("Config") in names else {}
        return list(entry["Layers"]), cfg
    if "index.json" in names:                     # OCI image layout
        index = _read_json(tf, "index.json")
        digest = index["manifests"][0]["digest"]
        blob = lambda d: "blobs/" + d.replace(":", "/")   # noqa: E731
        manifest = _read_json(tf, blob(digest))
        if "manifests" in manifest:              # an index of indexes: take the first
            manifest = _read_json(tf, blob(manifest["manifests"][0]["digest"]))
        cfg = _read_json(tf, blob(manifest["config"]["digest"]))
        return [blob(layer["digest"]) for layer in manifest["layers"]], cfg
    raise TarError("neither manifest.json (docker save) nor index.json (OCI layout) found")


def unpack_image(path: Path, work: Path, progress: Callable[[dict], None] | None = None) -> tuple[list[Path], dict]:
    """Extract every layer of the image tarball at `path` into work/layer-N."""
    try:
        with tarfile.open(path, mode="r:*") as tf:
            return _unpack(tf, work, progress)
    except CORRUPT as err:
        raise TarError(f"corrupt or truncated archive: {err}") from err


def _unpack(tf: tarfile.TarFile, work: Path, progress) -> tuple[list[Path], dict]:
    try:
        layers, cfg = _layer_paths(tf)
    except (KeyError, IndexError, TypeError) as err:
        raise TarError(f"malformed image metadata: {err!r}") from err
    dirs = []
    for i, name in enumerate(layers):
        d = work / f"layer-{i}"
        d.mkdir()
        try:
            member = tf.extractfile(_safe_name(name).as_posix())
        except KeyError:
            raise TarError(f"layer {name} listed in the manifest is missing") from None
        if member is None:
            raise TarError(f"layer {name} is not a regular file in the archive")
        n = extract_layer(member, d)
        if progress:
            progress({"step": "unpack", "layer": i + 1, "of": len(layers), "entries": n})
        dirs.append(d)
    return dirs, _config_of(cfg) if isinstance(cfg, dict) else {}
