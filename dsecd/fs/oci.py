"""Unpack `docker save` and OCI-layout tarballs into one directory per layer.

Each tar layer is extracted into its own directory, with the OCI whiteouts
turned into what overlayfs understands in a lower layer: `.wh.NAME` becomes
a 0:0 character device NAME, `.wh..wh..opq` sets trusted.overlay.opaque=y on
its directory. Every entry is checked before it touches the disk: no
absolute names, no `..`, no hard link to outside the layer, and no entry
whose parent is a symlink (which could redirect the write onto the host).
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import stat
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from .. import imageconfig

# What a damaged archive raises (disk errors such as ENOSPC stay OSErrors).
CORRUPT = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError)
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
        config = imageconfig.from_oci(cfg)
    except imageconfig.ConfigError as err:
        raise TarError(f"image config: {err}") from err
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
    return dirs, config
