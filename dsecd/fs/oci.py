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

import bz2
import gzip
import hashlib
import json
import lzma
import os
import platform
import re
import shutil
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
# An OCI layout's tag of an image, in its index.json descriptor's annotations.
REF_NAME = "org.opencontainers.image.ref.name"
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Older docker saves may hold bzip2 or xz layers (docker load takes them).
BZIP2_MAGIC = b"BZh"
XZ_MAGIC = b"\xfd7zX"        # the first 4 of its 6 (what a peek gives)
STREAM_BUFFER = 1 << 20
# A streamed tar's reads for headers and small files (_TarStream): a header
# is sliced out of a buffer of this many bytes, so it bounds the copy per header.
HEADER_READ = 64 << 10
# A file's bytes go from the decompressor to the file in reads of this size.
COPY_CHUNK = 1 << 20
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class TarError(Exception):
    pass


class HostLacks(TarError):
    """A layer this host cannot read (its decompressor is not installed):
    neither the image's fault nor the registry's."""


class DigestMismatch(TarError):
    """A blob whose bytes are not those of the digest that names it: the
    source (a registry) sent other bytes, not a bad image."""


class LayerTooLarge(TarError):
    """A layer that unpacks to more than the configured bound
    (images.max_layer_bytes): a few KiB of gzip or a sparse entry can stand
    for terabytes, and every byte of them would be written to the scratch
    disk and the blob store."""


def too_large(max_bytes: int, detail: str) -> LayerTooLarge:
    """The error for a layer past `max_bytes`; its message reads after the layer's name."""
    return LayerTooLarge(f"unpacks to more than images.max_layer_bytes ({max_bytes} bytes; {detail}); "
                         "use another image, or raise images.max_layer_bytes if it is meant to be this large")


def _safe_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts:
        raise TarError(f"entry {name!r} is absolute or has '..'")
    parts = [x for x in p.parts if x not in (".", "")]
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


def _entry_parts(name: str) -> list[str]:
    """A member's name as its path components below the layer's root ([] is
    the root itself), as _safe_name reads it but without building paths:
    this runs once per entry of every layer a pull converts."""
    if name.startswith("/"):
        raise TarError(f"entry {name!r} is absolute or has '..'")
    parts = [x for x in name.split("/") if x not in (".", "")]
    if ".." in parts:
        raise TarError(f"entry {name!r} is absolute or has '..'")
    return parts


class _Unpacker:
    """Extracts the entries of one layer tar into `root`, an empty directory.

    Every entry is checked before it touches the disk: no absolute name, no
    `..`, no parent that is a symlink or file of the layer, no hard link to
    outside it. What the layer made so far is kept as a tree of dicts (a
    directory is the dict of its children, anything else None): the layer
    is the only writer of `root`, so this tree is what lstat would find,
    and a parent is checked with one dict lookup per component instead of
    one lstat and a pathlib object per component (pulling the bench's
    1,500-file layers spent most of its unpack time there)."""

    def __init__(self, root: Path, max_bytes: int = 0):
        self.root = str(root)
        if os.listdir(self.root):
            raise TarError(f"unpacking into {root}: the directory is not empty; a layer is unpacked into a new one")
        self.tree: dict = {}
        # Regular files' apparent sizes, bounded by max_bytes (0: no bound)
        # before a byte of the file is written: a sparse member is written
        # whole, as mkfs.erofs stores it.
        self.max_bytes = max_bytes
        self.file_bytes = 0

    def _path(self, parts: list[str]) -> str:
        return self.root + "/" + "/".join(parts) if parts else self.root

    def _parent(self, parts: list[str], rel: str) -> dict:
        """The directory holding parts[-1], its missing ancestors made
        (0755, as a tar extractor makes them); TarError if one of them is
        a symlink or file of the layer."""
        node = self.tree
        for i, part in enumerate(parts[:-1]):
            child = node.get(part, _ABSENT)
            if child is _ABSENT:
                os.mkdir(self._path(parts[:i + 1]), 0o755)
                child = node[part] = {}
            elif child is None:
                raise TarError(f"entry {rel!r}: parent {part!r} is not a directory (symlink or file)")
            node = child
        return node

    def _remove(self, parent: dict, name: str, path: str) -> None:
        """Remove what the layer made at `path` (a child `name` of `parent`), if anything."""
        child = parent.pop(name, _ABSENT)
        if child is _ABSENT:
            return
        if child is None:
            os.unlink(path)
        else:
            shutil.rmtree(path)

    def entry(self, m: tarfile.TarInfo, write_data: Callable[[int], None]) -> None:
        """Extract member `m`; write_data(fd) writes a regular file's bytes to fd."""
        parts = _entry_parts(m.name)
        if not parts:
            return
        base = parts[-1]
        if base == OPAQUE:
            self._parent(parts, m.name)
            os.setxattr(self._path(parts[:-1]), "trusted.overlay.opaque", b"y")
            return
        if base.startswith(WHITEOUT):
            hidden = base[len(WHITEOUT):]
            if hidden in ("", ".", ".."):
                raise TarError(f"entry {m.name!r} is a whiteout of {hidden!r}, which names no file")
            parts[-1] = hidden
            parent = self._parent(parts, m.name)
            path = self._path(parts)
            self._remove(parent, hidden, path)
            os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))
            parent[hidden] = None
            return
        parent = self._parent(parts, m.name)
        path = self._path(parts)
        if m.isdir():
            if not isinstance(parent.get(base), dict):
                self._remove(parent, base, path)
                os.mkdir(path)
                parent[base] = {}
        else:
            self._remove(parent, base, path)
            if m.isreg():
                self._count(m)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
                try:
                    parent[base] = None
                    write_data(fd)
                finally:
                    os.close(fd)
            elif m.issym():
                os.symlink(m.linkname, path)
                parent[base] = None
            elif m.islnk():
                self._link(m, path)
                parent[base] = None
                return
            elif m.ischr() or m.isblk():
                kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
                os.mknod(path, kind | (m.mode & 0o7777), os.makedev(m.devmajor, m.devminor))
                parent[base] = None
            elif m.isfifo():
                os.mkfifo(path, m.mode & 0o7777)
                parent[base] = None
            else:
                raise TarError(f"entry {m.name!r} has an unsupported type {m.type!r}")
        os.lchown(path, m.uid, m.gid)
        if not m.issym():
            os.chmod(path, m.mode & 0o7777)

    def _count(self, m: tarfile.TarInfo) -> None:
        self.file_bytes += m.size
        if self.max_bytes and self.file_bytes > self.max_bytes:
            raise too_large(self.max_bytes, f"its files add up to {self.file_bytes} bytes "
                            f"at {m.name!r}, {m.size} bytes{' (sparse)' if m.issparse() else ''}")

    def _link(self, m: tarfile.TarInfo, path: str) -> None:
        """A hard link to a non-directory this layer made earlier, the link
        itself if that is a symlink (never what it points to)."""
        target = _entry_parts(m.linkname)
        node = self.tree
        for part in target[:-1]:
            node = node.get(part)
            if not isinstance(node, dict):
                break
        if not target or not isinstance(node, dict) or node.get(target[-1], _ABSENT) is not None:
            raise TarError(f"hard link {m.name!r} -> {m.linkname!r}: the target is not a file, symlink "
                           "or device this layer made earlier")
        os.link(self._path(target), path, follow_symlinks=False)


_ABSENT = object()


def _copy_member(tf: tarfile.TarFile, m: tarfile.TarInfo, fd: int) -> None:
    """A member's bytes from a tarfile opened for random access, into fd."""
    src = tf.extractfile(m)
    while chunk := src.read(COPY_CHUNK):
        _write_all(fd, chunk)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _unpack_tarfile(tf: tarfile.TarFile, root: Path, max_bytes: int = 0) -> int:
    unpacker = _Unpacker(root, max_bytes)
    n = 0
    try:
        for m in tf:
            unpacker.entry(m, lambda fd, m=m: _copy_member(tf, m, fd))
            n += 1
    except LayerTooLarge as err:
        raise LayerTooLarge(f"the root file system {err}") from err
    return n


class _Hashing:
    """A reader that hashes what passes through it."""

    def __init__(self, source):
        self.source = source
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.ahead = b""        # read by peek(), not yet returned

    def peek(self, size: int) -> bytes:
        """The next `size` bytes (fewer at the end), left to be read."""
        while len(self.ahead) < size and (more := self.source.read(size - len(self.ahead))):
            self.ahead += more
        return self.ahead[:size]

    def read(self, size: int = -1) -> bytes:
        if self.ahead:
            cut = len(self.ahead) if size < 0 else size
            data, self.ahead = self.ahead[:cut], self.ahead[cut:]
        else:
            data = self.source.read(size)
        self.sha.update(data)
        self.bytes += len(data)
        return data

    def drain(self, limit: int = 0) -> None:
        """Read to the end; LayerTooLarge once more than `limit` bytes (0: no
        bound) passed through, counting what was read before."""
        while self.read(STREAM_BUFFER):
            if limit and self.bytes > limit:
                raise too_large(limit, f"its tar passed {limit} bytes")

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


class _TarStream:
    """A layer's uncompressed tar as it streams out of the decompressor,
    hashed as it goes (the diff_id), read member by member without
    tarfile's stream mode: its headers are parsed by tarfile
    (TarInfo.fromtarfile, which reads the attributes a TarFile has and
    this class gives it), and a regular file's bytes go from the
    decompressor to the file in chunks of COPY_CHUNK, with no copy in a
    buffer between. tarfile's own stream reader keeps what it did not
    return by slicing its buffer, a copy per header and per small file.
    With _Unpacker and _Gunzip, one 40 MiB layer of the pull bench (1,500
    small files, a few big ones) unpacked into tmpfs in 0.30 CPU-s
    (gzip), 0.26 (zstd, plain), against 0.52, 0.46 and 0.48 before
    (medians of 5)."""

    def __init__(self, source):
        self.source = source
        self.sha = hashlib.sha256()
        self.buf = b""          # bytes read from source and not yet returned, from self.at
        self.at = 0
        self.pos = 0            # offset in the tar of the next byte read() returns
        # What TarInfo.fromtarfile reads and writes of its TarFile:
        self.fileobj = self
        self.encoding = tarfile.ENCODING
        self.errors = "surrogateescape"
        self.pax_headers: dict = {}
        self.offset = 0         # where the next header is (set by the header just parsed)

    def _pull(self, size: int) -> bytes:
        data = self.source.read(size)
        self.sha.update(data)
        return data

    def read(self, size: int) -> bytes:
        """`size` bytes, fewer only at the stream's end."""
        end = self.at + size
        if end <= len(self.buf):
            data = self.buf[self.at:end]
            self.at = end
        else:
            parts = [self.buf[self.at:]]
            got = len(parts[0])
            self.buf, self.at = b"", 0
            while got < size:
                chunk = self._pull(max(HEADER_READ, size - got))
                if not chunk:
                    break
                if got + len(chunk) > size:
                    self.buf, self.at = chunk, size - got
                    chunk = chunk[:size - got]
                parts.append(chunk)
                got += len(chunk)
            data = b"".join(parts)
        self.pos += len(data)
        return data

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int) -> None:
        """Forward only, by reading (tarfile's _FileInFile seeks for sparse members)."""
        if pos < self.pos:
            raise tarfile.StreamError("seeking backwards is not allowed")
        while self.pos < pos:
            if not self.read(min(COPY_CHUNK, pos - self.pos)):
                raise tarfile.ReadError("unexpected end of data")

    def copy_to(self, fd: int, size: int) -> None:
        """The next `size` bytes into fd; ReadError if the stream ends first."""
        left = size
        if self.at < len(self.buf):
            head = memoryview(self.buf)[self.at:self.at + left]
            _write_all(fd, head)
            self.at += len(head)
            left -= len(head)
        while left:
            chunk = self._pull(min(COPY_CHUNK, left) if left > HEADER_READ else HEADER_READ)
            if not chunk:
                raise tarfile.ReadError("unexpected end of data")
            if len(chunk) > left:           # the member ended inside a short read: keep the rest
                self.buf, self.at = chunk, left
                chunk = memoryview(chunk)[:left]
            _write_all(fd, chunk)
            left -= len(chunk)
        self.pos += size

    def members(self):
        """The members, as TarFile.next finds them in a stream: the end is
        the first zero block, or a bad header anywhere but the first."""
        while True:
            if self.offset != self.pos:
                self.seek(self.offset)
            try:
                m = tarfile.TarInfo.fromtarfile(self)
            except tarfile.EOFHeaderError:
                return
            except (tarfile.InvalidHeaderError, tarfile.TruncatedHeaderError) as err:
                if self.offset == 0:
                    raise tarfile.ReadError(str(err)) from None
                return
            except tarfile.EmptyHeaderError:
                if self.offset == 0:
                    raise tarfile.ReadError("empty file") from None
                return
            except tarfile.SubsequentHeaderError as err:
                raise tarfile.ReadError(str(err)) from None
            yield m

    def write_member(self, m: tarfile.TarInfo, fd: int) -> None:
        """Regular member `m`'s bytes into fd (a sparse one through tarfile, which knows its map)."""
        if m.issparse():
            src = tarfile.ExFileObject(self, m)
            while chunk := src.read(COPY_CHUNK):
                _write_all(fd, chunk)
            return
        self.seek(m.offset_data)
        self.copy_to(fd, m.size)

    def drain(self, limit: int = 0) -> None:
        """Read to the end (the padding after the end-of-archive blocks counts
        in the diff_id); LayerTooLarge once the tar passes `limit` bytes (0: no
        bound): zeros after the archive's end cost no disk, but the time to
        inflate and hash them."""
        self.pos += len(self.buf) - self.at
        self.buf, self.at = b"", 0
        while chunk := self._pull(STREAM_BUFFER):
            self.pos += len(chunk)
            if limit and self.pos > limit:
                raise too_large(limit, f"its tar passed {limit} bytes")

    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


class _Gunzip:
    """A gzip stream's content (members one after the other, zero padding
    between them skipped, as gzip.GzipFile reads it), inflated by zlib with
    its gzip wrapper (wbits 31: zlib checks each member's CRC and length).
    GzipFile reads its input 8 KiB at a time and computes the CRC with a
    call of its own per read: 4,600 of each for a 35 MiB layer; this reads
    STREAM_BUFFER at a time."""

    def __init__(self, raw):
        self.raw = raw
        self.inflate = zlib.decompressobj(wbits=31)
        self.input = b""

    def read(self, size: int) -> bytes:
        """Up to `size` bytes; b"" at the end of the last member."""
        while True:
            if self.inflate.eof:
                rest = self.inflate.unused_data
                while not (rest := rest.lstrip(b"\0")):
                    rest = self.raw.read(STREAM_BUFFER)
                    if not rest:
                        return b""
                self.inflate, self.input = zlib.decompressobj(wbits=31), rest
            if not self.input:
                self.input = self.raw.read(STREAM_BUFFER)
                if not self.input:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
            out = self.inflate.decompress(self.input, size)
            self.input = self.inflate.unconsumed_tail
            if out:
                return out


class _Bunzip2:
    """A bzip2 stream's content. bz2 says bad data with a bare OSError
    ("Invalid data stream", no errno), which would read as an I/O failure:
    it is a corrupt layer (TarError). An OSError with an errno is the
    reader's own, and stays one."""

    def __init__(self, blob):
        self.inner = bz2.BZ2File(blob)

    def read(self, size: int = -1) -> bytes:
        try:
            return self.inner.read(size)
        except OSError as err:
            if err.errno is None:
                raise TarError(f"corrupt bzip2 data: {err}") from err
            raise


def _decompressed(blob: _Hashing, magic: bytes, what: str):
    """The tar stream inside a layer blob: gzip, zstd, bzip2 and xz by their
    magic bytes (whatever the media type says), anything else read as a
    plain tar."""
    if magic.startswith(GZIP_MAGIC):
        return _Gunzip(blob)
    if magic.startswith(BZIP2_MAGIC):
        return _Bunzip2(blob)
    if magic.startswith(XZ_MAGIC):
        return lzma.LZMAFile(blob)
    if magic.startswith(ZSTD_MAGIC):
        if zstandard is None:
            raise HostLacks(f"{what} is zstd-compressed and this host lacks the zstd decompressor "
                           "(apt-get install python3-zstandard)")
        return zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True)
    return blob


def tar_reader(blob: _Hashing, what: str) -> _Hashing:
    """The tar inside `blob`, hashed as it is read (its digest is the
    diff_id). A plain tar is `blob` itself: its blob digest is its diff_id,
    so one sha256 pass serves both (a pass is ~20 ms of CPU per 40 MiB)."""
    inner = _decompressed(blob, blob.peek(4), what)
    return blob if inner is blob else _Hashing(inner)


def unpack_blob(raw, root: Path, what: str, max_bytes: int = 0) -> tuple[int, str, str]:
    """Unpack a layer blob (gzip, zstd or plain tar) read from `raw` (any
    reader with read(size)) into `root`, an empty directory, in one
    streaming pass, with the entry checks and whiteout handling of a
    tarball's layers: (entries, the blob's digest, the uncompressed tar's
    digest). TarError starts with `what` (the layer) and says what was
    wrong; LayerTooLarge when its files add up to more than `max_bytes`
    (0: no bound)."""
    n = 0
    try:
        blob = _Hashing(raw)
        tar = _TarStream(_decompressed(blob, blob.peek(4), what))
        unpacker = _Unpacker(root, max_bytes)
        for m in tar.members():
            if max_bytes and tar.pos > max_bytes:
                raise too_large(max_bytes, f"its tar passed {max_bytes} bytes")
            unpacker.entry(m, lambda fd, m=m: tar.write_member(m, fd))
            n += 1
        tar.drain(max_bytes)
        blob.drain()
    except CORRUPT as err:
        raise TarError(f"{what} is corrupt or truncated: {err}") from err
    except LayerTooLarge as err:
        raise LayerTooLarge(f"{what} {err}") from err
    except TarError as err:
        raise TarError(f"{what}: {err}") from err
    return n, blob.digest(), tar.digest()


def check_blob_digest(what: str, blob_digest: str, digest: str) -> None:
    """DigestMismatch unless the blob hashes to the manifest's `digest`."""
    if blob_digest != digest:
        raise DigestMismatch(f"{what}: the downloaded blob hashes to {blob_digest}, not to the digest "
                             "the manifest names; the registry sent other bytes")


def check_digests(what: str, blob_digest: str, tar_digest: str, digest: str, diff_id: str) -> None:
    """TarError unless the blob is the manifest's `digest` and its tar the config's `diff_id`."""
    check_blob_digest(what, blob_digest, digest)
    if tar_digest != diff_id:
        raise TarError(f"{what}: its uncompressed content hashes to {tar_digest}, but the image "
                       f"config's diff_id is {diff_id}")


def extract_blob(path: Path, digest: str, diff_id: str, root: Path, max_bytes: int = 0) -> int:
    """Extract a downloaded OCI layer blob into `root` (unpack_blob, files
    bounded by `max_bytes`), checking both digests: the blob's against
    `digest` (the manifest's) and the uncompressed tar's against `diff_id`
    (the image config's). Returns the number of entries; TarError names the
    layer and what did not match."""
    what = f"layer {digest}"
    with open(path, "rb") as raw:
        n, blob_digest, tar_digest = unpack_blob(raw, root, what, max_bytes)
    check_digests(what, blob_digest, tar_digest, digest, diff_id)
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
    if len({d.get("digest") for d in plain}) > 1:
        raise TarError(f"{where} holds {len(plain)} images ({', '.join(_ref_names(plain))}), not one image "
                       "for several platforms: make an archive of the one you want (skopeo copy "
                       "oci:DIR:TAG oci-archive:ONE.tar, or docker save of one image)")
    if plain:
        return plain[0]
    offered = sorted({platform_name(d["platform"]) for d in descriptors})
    raise PlatformError(f"{where} has no image for this host's platform {platform_name(wanted)}; it has "
                        f"{', '.join(offered)}: pull or save the image for {platform_name(wanted)}")


def _ref_names(descriptors: list[dict]) -> list[str]:
    """Each descriptor's tag (an OCI layout's ref.name annotation), else its short digest."""
    out = []
    for d in descriptors:
        annotations = d.get("annotations") if isinstance(d.get("annotations"), dict) else {}
        out.append(str(annotations.get(REF_NAME) or str(d.get("digest"))[:19]))
    return out


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
        if len({str(e.get("Config")) for e in meta}) > 1:         # two tags of one image are one entry each
            tags = [", ".join(e.get("RepoTags") or []) or str(e.get("Config"))[:24] for e in meta]
            raise TarError(f"manifest.json lists {len(meta)} images ({'; '.join(tags)}): build from a docker "
                           "save of one image (docker save NAME:TAG)")
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
                 wanted: dict | None = None, max_bytes: int = 0) -> Unpacked:
    """A tarball (plain, gzip, bz2 or xz) into work/layer-N: a docker save or
    OCI layout one layer per image layer (for the platform `wanted`, default
    this host's), a root file system as one layer (and no config).
    LayerTooLarge when a layer's files add up to more than `max_bytes`
    (0: no bound), as for a pulled layer."""
    try:
        tf = tarfile.open(path, mode="r:*")
    except (tarfile.ReadError, EOFError):
        # tarfile's own message lists every compression it tried, one per line
        raise TarError("not a tar archive (plain, gzip, bzip2 or xz): an image is built from a docker save, "
                       "an OCI image layout or a root file system, as a tarball or a directory (a Dockerfile "
                       "with -f)") from None
    try:
        with tf:
            src = _TarSource(tf, f"image tarball {path}")
            kind, meta = classify(src)
            if kind == ROOTFS:
                d = work / "layer-0"
                d.mkdir()
                n = _unpack_tarfile(tf, d, max_bytes)
                if progress:
                    progress({"step": "unpack", "layer": 1, "of": 1, "entries": n})
                return [d], None
            return _unpack(src, kind, meta, work, progress, wanted, max_bytes)
    except CORRUPT as err:
        raise TarError(f"corrupt or truncated archive (expected a tarball of a docker save, an OCI image "
                       f"layout or a root file system): {err}") from err


def unpack_dir(path: Path, work: Path, progress: Callable[[dict], None] | None = None,
               wanted: dict | None = None, max_bytes: int = 0) -> Unpacked | None:
    """An unpacked docker save or OCI layout directory into work/layer-N as
    its tarball would be; None when `path` is a root file system (to be
    built as it is)."""
    src = _DirSource(path)
    kind, meta = classify(src)
    if kind == ROOTFS:
        return None
    return _unpack(src, kind, meta, work, progress, wanted, max_bytes)


_BLOB_NAME = re.compile(r"blobs/sha256/([0-9a-f]{64})\Z")


def _diff_ids(cfg: dict, layers: int) -> list[str]:
    """The config's rootfs.diff_ids, one per layer; [] when it lists none
    (nothing to check them against); TarError when it lists another number."""
    ids = (cfg.get("rootfs") or {}).get("diff_ids") if isinstance(cfg, dict) else None
    if not ids:
        return []
    if not isinstance(ids, list) or len(ids) != layers:
        raise TarError(f"the image config lists {len(ids) if isinstance(ids, list) else ids!r} diff_ids for "
                       f"{layers} layers; the archive is inconsistent")
    return [str(i) for i in ids]


def _check_platform(cfg: dict, wanted: dict) -> None:
    """PlatformError for an image whose config names another os/architecture
    (a docker save, or an OCI layout's single image, made for another
    host): its programs cannot run here, as a pull of it says. A config
    that names none is taken."""
    got = {"os": cfg.get("os"), "architecture": cfg.get("architecture")} if isinstance(cfg, dict) else {}
    if got.get("architecture") and (got["os"] or "linux", got["architecture"]) != (wanted["os"],
                                                                                    wanted["architecture"]):
        got["os"] = got["os"] or "linux"
        raise PlatformError(f"the image is for {platform_name(got)}, not for this host's "
                            f"{platform_name(wanted)}: its programs cannot run here; save or pull the image "
                            f"for {platform_name(wanted)}")


def _unpack(src, kind: str, meta, work: Path, progress, wanted: dict | None, max_bytes: int) -> Unpacked:
    try:
        layers, cfg = _layers_of(src, kind, meta, wanted)
        _check_platform(cfg, wanted or host_platform())
        config = imageconfig.from_oci(cfg)
    except imageconfig.ConfigError as err:
        raise TarError(f"image config: {err}") from err
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise TarError(f"malformed image metadata ({kind}): {err!r}") from err
    diff_ids = _diff_ids(cfg, len(layers))
    dirs = []
    for i, name in enumerate(layers):
        d = work / f"layer-{i}"
        d.mkdir()
        what = f"layer {i + 1} of {len(layers)} ({name})"
        try:
            member = src.open(name)
        except TarError as err:
            raise TarError(f"layer {i + 1} of {len(layers)} listed in the manifest: {err}") from None
        with member:
            # As a pulled blob: gzip, zstd or plain, by its magic bytes.
            n, blob_digest, tar_digest = unpack_blob(member, d, what, max_bytes)
        # What the archive says of its bytes, checked as a pull checks a
        # registry's: a blob named by its digest (an OCI layout's, a newer
        # docker save's) must hash to it, and its tar to the config's diff_id.
        named = _BLOB_NAME.match(_norm(name))
        if named and blob_digest != f"sha256:{named[1]}":
            raise TarError(f"{what}: its bytes hash to {blob_digest}, not to the digest it is named by; the "
                           "archive was changed or damaged after it was written")
        if diff_ids and tar_digest != diff_ids[i]:
            raise TarError(f"{what}: its content hashes to {tar_digest}, but the image config's diff_id is "
                           f"{diff_ids[i]}; the archive was changed or damaged after it was written")
        if progress:
            progress({"step": "unpack", "layer": i + 1, "of": len(layers), "entries": n})
        dirs.append(d)
    return dirs, config
