"""Unpack image archives into one directory per layer: `docker save` and
OCI-layout tarballs or their unpacked directories, and plain root file
system tarballs (one layer), and OCI layer blobs a pull downloaded. From a
multi-platform index, the image for this host's platform is taken.

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
import platform
import re
import stat
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from .. import imageconfig

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
# The read size of a streamed tar (tarfile's bufsize). Small on purpose: each
# read from the stream keeps what it did not return by slicing, a copy of up
# to this many bytes per header and per small file. At 1 MiB, unpacking the
# pull bench's 7 layers (9,300 files, 240 MiB) into tmpfs took 2.8-4.7 s
# (1.8-2.1 CPU-s of user time); at 64 KiB 1.4-1.6 s (0.95-1.1).
TAR_STREAM_BUFFER = 64 << 10
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
            with tarfile.open(fileobj=tar, mode="r|", bufsize=TAR_STREAM_BUFFER) as tf:
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


# ---------------------------------------------------------------- image archives
#
# What a build source is. A tarball or directory whose top level holds only
# an image archive's files is that archive: `manifest.json` (a JSON list of
# {Config, Layers}) makes it a docker save, `index.json` + `oci-layout` +
# `blobs/` an OCI image layout (a newer `docker save` has both; the docker
# manifest is read then). Anything else is a root file system, imported as
# one layer. Both at once (say `etc/` beside `manifest.json`) is refused
# rather than guessed, and so is an archive missing a part it needs.

DOCKER_SAVE = "docker-save"
OCI_LAYOUT = "oci-layout"
ROOTFS = "rootfs"
ARCHIVE_NAMES = {"manifest.json", "index.json", "oci-layout", "repositories", "blobs"}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")       # the layer directories of an older docker save
INDEX_TYPES = {"application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json"}
MAX_INDEX_DEPTH = 4                          # an index of indexes of ...: deeper is refused


def _norm(name: str) -> str:
    """A member name as a path from the archive's top: "./etc/x" -> "etc/x"."""
    return "/".join(p for p in name.split("/") if p not in ("", "."))


def _archive_name(name: str) -> bool:
    """Whether a top-level name belongs in an image archive."""
    return name in ARCHIVE_NAMES or name.endswith(".json") or bool(_HEX64.match(name))


class _TarSource:
    """The files of an image tarball."""

    def __init__(self, tf: tarfile.TarFile, where: str):
        self.tf = tf
        self.where = where
        self.members = {_norm(m.name): m for m in tf.getmembers()}
        self.members.pop("", None)
        self.top = {name.split("/", 1)[0] for name in self.members}

    def is_file(self, name: str) -> bool:
        m = self.members.get(_norm(name))
        return m is not None and (m.isfile() or m.issym() or m.islnk())

    def open(self, name: str):
        m = self.members.get(_safe_name(name).as_posix())
        if m is None:
            raise TarError(f"{name} is missing")
        f = self.tf.extractfile(m)
        if f is None:
            raise TarError(f"{name} is not a regular file")
        return f


class _DirSource:
    """The files of an unpacked image archive (a docker save or OCI layout untarred)."""

    def __init__(self, root: Path):
        self.root = root
        self.real = os.path.realpath(root)
        self.where = f"directory {root}"
        self.top = set(os.listdir(root))

    def _path(self, name: str) -> str:
        path = os.path.realpath(os.path.join(self.root, _safe_name(name).as_posix()))
        if not path.startswith(self.real + os.sep):
            raise TarError(f"{name} leads out of {self.root} (through a symlink)")
        return path

    def is_file(self, name: str) -> bool:
        return os.path.isfile(self._path(name))

    def open(self, name: str):
        try:
            return open(self._path(name), "rb")
        except FileNotFoundError:
            raise TarError(f"{name} is missing") from None
        except IsADirectoryError:
            raise TarError(f"{name} is not a regular file") from None


def _read_json(src, name: str):
    with src.open(name) as f:
        try:
            return json.load(f)
        except ValueError as err:
            raise TarError(f"{name} is not valid JSON: {err}") from err


def _json_or_none(src, name: str):
    try:
        return _read_json(src, name)
    except TarError:
        return None


def _is_index(doc) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("manifests"), list)


def classify(src) -> tuple[str, object]:
    """(DOCKER_SAVE, its manifest.json), (OCI_LAYOUT, its index.json) or
    (ROOTFS, None); TarError for a source that is neither cleanly.

    A manifest.json that is a JSON list marks a docker save, an index.json
    holding a "manifests" list an OCI layout; other files of those names
    (a web app's manifest.json) are a root file system's own. Dot-names at
    the top (.git) are left out of the question."""
    other = sorted(n for n in src.top if not _archive_name(n) and not n.startswith("."))

    def both(marker: str) -> TarError:
        shown = ", ".join(other[:6]) + (", ..." if len(other) > 6 else "")
        return TarError(f"holds an image archive ({marker}) and also other top-level entries ({shown}): "
                        "expected either a docker save / OCI image layout, or a root file system, not both; "
                        "remove the one you do not mean")

    manifest = _json_or_none(src, "manifest.json") if src.is_file("manifest.json") else None
    if isinstance(manifest, list):
        if not manifest or not all(isinstance(e, dict) and isinstance(e.get("Layers"), list) for e in manifest):
            raise TarError("manifest.json lists no image: expected a docker save's manifest, a JSON list "
                           "of {Config, RepoTags, Layers}")
        listed = {_norm(str(name)).split("/", 1)[0] for e in manifest for name in [e.get("Config"), *e["Layers"]]
                  if name}
        other = [n for n in other if n not in listed]
        if other:
            raise both("manifest.json of a docker save")
        return DOCKER_SAVE, manifest
    index = _json_or_none(src, "index.json") if src.is_file("index.json") else None
    if _is_index(index):
        if other:
            raise both("index.json of an OCI image layout")
        missing = [what for what, there in (("the oci-layout file", src.is_file("oci-layout")),
                                            ("the blobs/ directory", "blobs" in src.top)) if not there]
        if missing:
            raise TarError(f"has index.json but not {' or '.join(missing)}: expected an OCI image layout "
                           "(oci-layout, index.json, blobs/sha256/...)")
        return OCI_LAYOUT, index
    if not other and src.top & {"oci-layout", "blobs"}:
        raise TarError("has " + " and ".join(sorted(src.top & {"oci-layout", "blobs"}))
                       + " but no OCI index.json: expected an OCI image layout (oci-layout, index.json, blobs/)")
    return ROOTFS, None


# ---------------------------------------------------------------- platforms

# platform.machine() -> (OCI architecture, variant or None). Names not here pass as they are.
MACHINES = {"x86_64": ("amd64", None), "amd64": ("amd64", None), "aarch64": ("arm64", "v8"),
            "arm64": ("arm64", "v8"), "armv8l": ("arm", "v8"), "armv7l": ("arm", "v7"),
            "armv6l": ("arm", "v6"), "armv5tel": ("arm", "v5"), "i386": ("386", None), "i486": ("386", None),
            "i586": ("386", None), "i686": ("386", None), "ppc64le": ("ppc64le", None),
            "s390x": ("s390x", None), "riscv64": ("riscv64", None), "loongarch64": ("loong64", None),
            "mips64": ("mips64", None)}


def host_platform() -> dict:
    """This host's OCI platform: {"os", "architecture", "variant" (or None)}."""
    arch, variant = MACHINES.get(platform.machine(), (platform.machine(), None))
    return {"os": "linux", "architecture": arch, "variant": variant}


def platform_name(p: dict) -> str:
    return "/".join(x for x in (p.get("os"), p.get("architecture"), p.get("variant")) if x)


def _variant_rank(wanted: dict, offered: str | None) -> int | None:
    """How well an image of variant `offered` fits the host (lower is
    better; None: it does not run here). An image without a variant fits
    any host of its architecture; an arm host runs older arm variants
    (v7 runs v6); an amd64 variant above v1 needs CPU features not checked."""
    host = wanted.get("variant")
    if offered in (None, "", host):
        return 0 if offered == host else 1
    if wanted["architecture"] == "amd64" and offered == "v1":
        return 1
    if wanted["architecture"] in ("arm", "arm64") and host and offered[1:].isdigit() and host[1:].isdigit():
        if int(offered[1:]) <= int(host[1:]):
            return 2 + int(host[1:]) - int(offered[1:])
    return None


class PlatformError(TarError):
    """An index without an image for the wanted platform."""


def choose_manifest(descriptors: list, where: str, wanted: dict | None = None) -> dict:
    """The descriptor of `descriptors` (an index's "manifests") for the
    platform `wanted` (default: this host's). Descriptors without a platform
    are single images (an OCI layout's tags): the first is taken when no
    platform matches. PlatformError lists what the index offers instead."""
    wanted = wanted or host_platform()
    if not descriptors or not all(isinstance(d, dict) for d in descriptors):
        raise TarError(f"{where} lists no manifests")
    ranked = []
    for i, d in enumerate(descriptors):
        p = d.get("platform")
        if not isinstance(p, dict):
            continue
        if p.get("os") == wanted["os"] and p.get("architecture") == wanted["architecture"]:
            rank = _variant_rank(wanted, p.get("variant"))
            if rank is not None:
                ranked.append((rank, i, d))
    if ranked:
        return min(ranked, key=lambda x: x[:2])[2]
    plain = [d for d in descriptors if not isinstance(d.get("platform"), dict)]
    if plain:
        return plain[0]
    offered = sorted({platform_name(d["platform"]) for d in descriptors})
    raise PlatformError(f"{where} has no image for this host's platform {platform_name(wanted)}; it has "
                        f"{', '.join(offered)}: pull or save the image for {platform_name(wanted)}")


def _blob(digest: str) -> str:
    algo, sep, hexpart = str(digest).partition(":")
    if not sep or not algo.isalnum() or not hexpart.isalnum():
        raise TarError(f"bad digest {digest!r} (expected ALGORITHM:HEX)")
    return f"blobs/{algo}/{hexpart}"


def _oci_manifest(src, index: dict, wanted: dict | None) -> dict:
    """The image manifest an OCI layout's index.json leads to for the wanted platform."""
    where = "index.json"
    for _ in range(MAX_INDEX_DEPTH):
        desc = choose_manifest(index["manifests"], where, wanted)
        where = f"index {desc.get('digest')}"
        doc = _read_json(src, _blob(desc.get("digest")))
        if desc.get("mediaType") not in INDEX_TYPES and not _is_index(doc):
            return doc
        if not _is_index(doc):
            raise TarError(f"{where} is not an image index (no 'manifests' list)")
        index = doc
    raise TarError(f"index.json nests indexes more than {MAX_INDEX_DEPTH} deep")


def _layers_of(src, kind: str, meta, wanted: dict | None) -> tuple[list[str], dict]:
    """(layer member names, bottom first; the image's config JSON)."""
    if kind == DOCKER_SAVE:
        entry = meta[0]
        config = entry.get("Config")
        cfg = _read_json(src, config) if config and src.is_file(config) else {}
        return [str(layer) for layer in entry["Layers"]], cfg
    manifest = _oci_manifest(src, meta, wanted)
    cfg = _read_json(src, _blob(manifest["config"]["digest"]))
    return [_blob(layer["digest"]) for layer in manifest["layers"]], cfg


# ---------------------------------------------------------------- unpacking

# (one directory per layer, bottom first; the image's config, None for a root file system)
Unpacked = tuple[list[Path], dict | None]


def unpack_image(path: Path, work: Path, progress: Callable[[dict], None] | None = None,
                 wanted: dict | None = None) -> Unpacked:
    """A tarball (plain, gzip, bz2 or xz) into work/layer-N: a docker save or
    OCI layout one layer per image layer (for the platform `wanted`, default
    this host's), a root file system as one layer (and no config)."""
    try:
        with tarfile.open(path, mode="r:*") as tf:
            src = _TarSource(tf, f"image tarball {path}")
            kind, meta = classify(src)
            if kind == ROOTFS:
                d = work / "layer-0"
                d.mkdir()
                members = tf.getmembers()
                for m in members:
                    _extract_member(tf, m, d)
                if progress:
                    progress({"step": "unpack", "layer": 1, "of": 1, "entries": len(members)})
                return [d], None
            return _unpack(src, kind, meta, work, progress, wanted)
    except CORRUPT as err:
        raise TarError(f"corrupt or truncated archive (expected a tarball of a docker save, an OCI image "
                       f"layout or a root file system): {err}") from err


def unpack_dir(path: Path, work: Path, progress: Callable[[dict], None] | None = None,
               wanted: dict | None = None) -> Unpacked | None:
    """An unpacked docker save or OCI layout directory into work/layer-N as
    its tarball would be; None when `path` is a root file system (to be
    built as it is)."""
    src = _DirSource(path)
    kind, meta = classify(src)
    if kind == ROOTFS:
        return None
    return _unpack(src, kind, meta, work, progress, wanted)


def _unpack(src, kind: str, meta, work: Path, progress, wanted: dict | None) -> Unpacked:
    try:
        layers, cfg = _layers_of(src, kind, meta, wanted)
        config = imageconfig.from_oci(cfg)
    except imageconfig.ConfigError as err:
        raise TarError(f"image config: {err}") from err
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise TarError(f"malformed image metadata ({kind}): {err!r}") from err
    dirs = []
    for i, name in enumerate(layers):
        d = work / f"layer-{i}"
        d.mkdir()
        try:
            member = src.open(name)
        except TarError as err:
            raise TarError(f"layer {i + 1} of {len(layers)} listed in the manifest: {err}") from None
        with member:
            n = extract_layer(member, d)
        if progress:
            progress({"step": "unpack", "layer": i + 1, "of": len(layers), "entries": n})
        dirs.append(d)
    return dirs, config
