"""Directory copies into and out of a sandbox as tar streams, from the host.

Into the sandbox (`put_tree`): the client's tar is read entry by entry and
each entry checked (dsecd/tarsafe.py) before it touches the disk. It is
extracted into a new directory beside the destination, opened with openat2
(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS below it, so no symlink, the
archive's or one the sandbox plants meanwhile, is ever followed), and
renamed into place with RENAME_NOREPLACE at the end; on any failure it is
removed, so a refused or broken copy leaves nothing. File bytes go through
files.write_regular.

Out of the sandbox (`TreeTar`): a tar of the tree, walked with
O_NOFOLLOW fds: symlinks are stored as symlinks, never followed, and a
file's further names as hard links to its first; FIFOs,
sockets, devices and kernel filesystems are skipped and listed in the result.
All functions block: run them in a worker, as the sandbox's root.
"""

from __future__ import annotations

import errno
import functools
import os
import secrets
import stat
import tarfile

from .. import native, tarsafe
from . import libc
from .files import (
    BENEATH,
    PathError,
    _open,
    _remove_at,
    _split,
    _type_of,
    check_path,
    write_regular,
)

BLOCK = tarfile.BLOCKSIZE
READ = 1 << 20


# ---------------------------------------------------------------- into the sandbox

def put_tree(rootfd: int, dst: str, fileobj, max_entries: int, max_bytes: int, fill=None, made=None,
             dirs: int = 0) -> dict:
    """Extract the tar read from `fileobj` as the new directory `dst`; the
    bytes of its files are written by fill(fd, chunks, size=) (see
    files.write_regular). made(path, stat) is told the temporary directory
    it extracts into, once made. With `dirs` (a budget of bytes), the
    result lists the archive's directory entries too (dir_entries)."""
    dst = check_path(dst)
    if dst == "/":
        raise PathError("cannot copy a directory onto /; name a new directory below it")
    parent, name = _split(dst)
    pfd = _open(rootfd, parent, os.O_PATH | os.O_DIRECTORY)
    try:
        try:
            os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            raise FileExistsError(errno.EEXIST, f"{dst} exists; remove it first or copy to a new path")
        tmp = f".dsec-put-{secrets.token_hex(6)}"
        os.mkdir(tmp, 0o700, dir_fd=pfd)
        try:
            if made is not None:
                made(f"{parent.rstrip('/')}/{tmp}", os.stat(tmp, dir_fd=pfd, follow_symlinks=False))
            seen = tarsafe.Seen(max_entries, max_bytes)
            counts = _extract_into(pfd, tmp, fileobj, seen, fill)
            libc.rename_noreplace(pfd, tmp, pfd, name)
            if dirs:
                counts["dirs"] = dir_entries(seen, dirs)
        except BaseException:
            _remove_at(pfd, tmp, True, f"{parent.rstrip('/')}/{tmp}")
            raise
        return {"path": dst, **counts}
    finally:
        os.close(pfd)


# The first bytes of compressed streams: a .tar.gz given where a tar goes
# (docker cp and put_archive take one) is said to be one.
COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))


class _Head:
    """A stream read through, keeping its first bytes."""

    def __init__(self, fileobj):
        self.fileobj = fileobj
        self.head = b""

    def read(self, n: int = -1) -> bytes:
        data = self.fileobj.read(n)
        if len(self.head) < 8:
            self.head += data[:8 - len(self.head)]
        return data


def dir_entries(seen: tarsafe.Seen, budget: int) -> list[list] | None:
    """A put's `dirs`: the archive's directory entries, [name, mode, mtime]
    each (the top ""), as a client merging the copy sets them; None when
    their names take more than `budget` bytes (a result must fit in a
    frame: the put itself stands, the client is told they are not listed)."""
    if sum(len(rel.encode(errors="surrogateescape")) + 32 for rel in seen.dir_entries) > budget:
        return None
    return [[rel, mode, mtime] for rel, (mode, mtime) in sorted(seen.dir_entries.items())]


def _extract_into(pfd: int, tmp: str, fileobj, seen: tarsafe.Seen, fill) -> dict:
    fileobj = _Head(fileobj)
    topfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
    dir_modes: dict[str, tuple[int, int | None]] = {"": (0o755, None)}   # ns; None: keeps its own mtime
    made = {""}
    try:
        with tarfile.open(fileobj=fileobj, mode="r|", errorlevel=2, tarinfo=tarsafe.Member) as tf:
            for m in tf:
                rel = tarsafe.check(m, seen)
                if seen.replaces == "itself":
                    continue
                if seen.replaces in ("file", "other") or (seen.replaces == "dir" and not m.isdir()):
                    _remove_replaced(topfd, rel, seen.replaces == "dir")
                    made.discard(rel)
                    dir_modes.pop(rel, None)
                if m.isdir():
                    dir_modes[rel] = (m.mode & tarsafe.KEPT_MODE, tarsafe.mtime_ns(m))
                    _make_dirs(topfd, rel, made)
                    continue
                _make_dirs(topfd, rel.rpartition("/")[0], made)
                _extract_one(topfd, rel, m, tf, fill)
            tarsafe.check_end(tf)
        while fileobj.read(READ):               # the zero padding after the archive, up to the input's end
            pass
        # Last, deepest first: a read-only directory must not stop what goes in it.
        # One the archive has no entry for gets 0755, as tar(1) and docker cp make it.
        for rel in sorted(made, key=lambda rel: -rel.count("/") - bool(rel)):
            _set_dir(topfd, rel, *dir_modes.get(rel, (0o755, None)))
    except tarsafe.Refused as err:
        raise PathError(str(err)) from err
    except (tarfile.TarError, EOFError) as err:
        kind = next((k for magic, k in COMPRESSED if fileobj.head.startswith(magic)), None)
        if kind is not None and not seen.entries:
            raise PathError(f"the tar stream is not a valid archive: it is a {kind}-compressed stream; a "
                            "directory copy takes an uncompressed tar: decompress it first") from err
        raise PathError(f"the tar stream is not a valid archive: {err}") from err
    finally:
        os.close(topfd)
    return {"count": seen.entries, "bytes": seen.bytes}


def _parent_fd(topfd: int, rel: str) -> tuple[int, str]:
    """(an fd of the directory holding `rel`, its last name); no symlink followed."""
    parent, _, leaf = rel.rpartition("/")
    if not parent:
        return os.dup(topfd), leaf
    return native.openat2(topfd, parent, os.O_PATH | os.O_DIRECTORY, 0, BENEATH), leaf


def _remove_replaced(topfd: int, rel: str, is_dir: bool) -> None:
    """Remove what an earlier entry made at `rel`, which a later one of the
    same name replaces (tarsafe: a directory then has nothing in it); a
    symlink is removed, never followed."""
    dfd, leaf = _parent_fd(topfd, rel)
    try:
        if is_dir:
            os.rmdir(leaf, dir_fd=dfd)
        else:
            os.unlink(leaf, dir_fd=dfd)
    finally:
        os.close(dfd)


def _make_dirs(topfd: int, rel: str, made: set[str]) -> None:
    """mkdir each missing directory of `rel` (mode 0700 until the end)."""
    path = ""
    for part in rel.split("/") if rel else ():
        path = f"{path}/{part}" if path else part
        if path in made:
            continue
        dfd, leaf = _parent_fd(topfd, path)
        try:
            os.mkdir(leaf, 0o700, dir_fd=dfd)
        finally:
            os.close(dfd)
        made.add(path)


def _extract_one(topfd: int, rel: str, m: tarfile.TarInfo, tf: tarfile.TarFile, fill) -> None:
    dfd, leaf = _parent_fd(topfd, rel)
    try:
        if m.isreg():
            src = tf.extractfile(m)
            write_regular(dfd, leaf, iter(lambda: src.read(READ), b""), m.mode & tarsafe.KEPT_MODE,
                          fill=functools.partial(fill, size=m.size) if fill and m.size else None)
        elif m.issym():
            os.symlink(m.linkname, leaf, dir_fd=dfd)
        else:                                   # a hard link to a file made earlier (tarsafe checked)
            sfd, sleaf = _parent_fd(topfd, tarsafe.entry_name(m.linkname))
            try:
                os.link(sleaf, leaf, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
            finally:
                os.close(sfd)
            return
        os.utime(leaf, ns=(tarsafe.mtime_ns(m),) * 2, dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(dfd)


def _set_dir(topfd: int, rel: str, mode: int, mtime_ns: int | None) -> None:
    fd = os.dup(topfd) if not rel else native.openat2(topfd, rel, os.O_RDONLY | os.O_DIRECTORY, 0, BENEATH)
    try:
        os.fchmod(fd, mode)
        if mtime_ns is not None:      # an entry's, before 1970 too
            os.utime(fd, ns=(mtime_ns,) * 2)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- out of the sandbox

class TreeTar:
    """A tar of directory `path` made a piece at a time: each `read()` returns
    up to `chunk` bytes of it, b"" at the end; `close()` releases its fds.
    `skipped` lists what was left out and why. `rootfd` is handed over:
    closed once the top directory is open, or at `close()`."""

    def __init__(self, rootfd: int, path: str, chunk: int, max_entries: int, max_bytes: int):
        self._root = rootfd
        self.path = check_path(path)
        self.chunk = chunk
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.entries = 0
        self.bytes = 0
        self.skipped: list[dict] = []
        self._links: dict[tuple[int, int], str] = {}       # (dev, ino) of a file with more names -> its first
        self._buf = bytearray()
        self._gen = self._blocks()

    def read(self) -> bytes:
        while len(self._buf) < self.chunk:
            piece = next(self._gen, None)
            if piece is None:
                break
            self._buf += piece
        out = bytes(self._buf[:self.chunk])
        del self._buf[:self.chunk]
        return out

    def close(self) -> None:
        self._gen.close()
        self._close_root()

    def _close_root(self) -> None:
        fd, self._root = self._root, -1
        if fd >= 0:
            os.close(fd)

    def result(self) -> dict:
        return {"path": self.path, "count": self.entries, "bytes": self.bytes, "skipped": self.skipped}

    def _blocks(self):
        try:
            top = _open(self._root, self.path, os.O_RDONLY | os.O_DIRECTORY)
        finally:
            self._close_root()
        try:
            self._count("", 0)
            yield self._header("", os.fstat(top), tarfile.DIRTYPE)
            yield from self._dir(top, "")
        finally:
            os.close(top)
        yield b"\0" * (2 * BLOCK)

    def _dir(self, fd: int, prefix: str):
        """The entries under directory `fd`, depth first (as many fds open as the tree is deep)."""
        for name in sorted(os.listdir(fd)):
            rel = f"{prefix}/{name}" if prefix else name
            sub = yield from self._entry(fd, name, rel)
            if sub is not None:
                try:
                    yield from self._dir(sub, rel)
                finally:
                    os.close(sub)

    def _count(self, rel: str, size: int) -> None:
        self.entries += 1
        self.bytes += size
        if self.entries > self.max_entries or self.bytes > self.max_bytes:
            raise tarsafe.TooLarge(f"at {rel or '.'}: the tree has more than {self.max_entries} entries or "
                                   f"{self.max_bytes} bytes (limits.max_tar_entries, limits.max_tar_bytes)")

    def _header(self, rel: str, st: os.stat_result, kind: bytes, size: int = 0, link: str = "") -> bytes:
        info = tarfile.TarInfo(rel or ".")
        info.type, info.size, info.linkname = kind, size, link
        info.mode = stat.S_IMODE(st.st_mode) & tarsafe.KEPT_MODE
        tarsafe.set_mtime_ns(info, st.st_mtime_ns)        # its fraction too, in a pax record
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def _entry(self, dirfd: int, name: str, rel: str):
        """The tar blocks of one entry; returns a subdirectory's fd, to walk next."""
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return None                         # removed while we walked
        if stat.S_ISLNK(st.st_mode):
            try:
                link = os.readlink(name, dir_fd=dirfd)
            except OSError as err:
                self._replaced(rel, err)
                return
            self._count(rel, 0)
            yield self._header(rel, st, tarfile.SYMTYPE, link=link)
        elif stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            except OSError as err:
                self._replaced(rel, err)
                return
            kind = native.KERNEL_FS_MAGICS.get(native.fs_magic(sub, rel))
            if kind is not None:
                os.close(sub)
                self.skipped.append({"path": rel, "type": "dir", "reason": f"on {kind}, a kernel interface"})
                return
            try:
                self._count(rel, 0)
                yield self._header(rel, st, tarfile.DIRTYPE)
            except BaseException:               # refused, or the copy abandoned here
                os.close(sub)
                raise
            return sub
        elif stat.S_ISREG(st.st_mode):
            yield from self._file(dirfd, name, rel)
        else:
            self.skipped.append({"path": rel, "type": _type_of(st.st_mode),
                                 "reason": "not a file, directory or symlink: not copied"})

    def _replaced(self, rel: str, err: OSError) -> None:
        """An entry the sandbox swapped (or removed) between its lstat and its
        open is skipped, as one replaced while copied; any other error stands."""
        if err.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EINVAL):
            raise err
        self.skipped.append({"path": rel, "type": "unknown", "reason": "replaced while copied"})

    def _file(self, dirfd: int, name: str, rel: str):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
        except OSError as err:
            self._replaced(rel, err)
            return
        try:
            st = os.fstat(fd)
            kind = native.KERNEL_FS_MAGICS.get(native.fs_magic(fd, rel))
            if not stat.S_ISREG(st.st_mode) or kind is not None:
                self.skipped.append({"path": rel, "type": "file", "reason": f"on {kind}, a kernel interface"
                                     if kind else "replaced while copied"})
                return
            if st.st_nlink > 1:
                # A file with more than one name comes once; its other names
                # are hard links to the first, as tar(1) and docker cp give them.
                first = self._links.get((st.st_dev, st.st_ino))
                if first is not None:
                    self._count(rel, 0)
                    yield self._header(rel, st, tarfile.LNKTYPE, link=first)
                    return
                self._links[(st.st_dev, st.st_ino)] = rel
            self._count(rel, st.st_size)
            yield self._header(rel, st, tarfile.REGTYPE, size=st.st_size)
            left = st.st_size
            while left:
                data = os.read(fd, min(READ, left))
                if not data:                    # shrank while copied: the header's size still holds
                    self.skipped.append({"path": rel, "type": "file", "reason": "shrank while copied: "
                                         "zero-padded"})
                    data = b"\0" * left
                left -= len(data)
                yield data
            pad = -st.st_size % BLOCK
            if pad:
                yield b"\0" * pad
        finally:
            os.close(fd)
