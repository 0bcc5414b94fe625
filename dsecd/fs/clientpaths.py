"""Host paths a local client names, reached as that client sees them.

`image_build`'s source and a Dockerfile build's context are paths on the
daemon's host that the client names and the daemon reads in place. The
daemon need not see the same tree at that path as the client: under
systemd it runs in a mount namespace of its own, with a read-only /usr and
/etc among other things (docs/operations.md), and a client may run in a
container with mounts of its own. So the tree at such a path is looked up
in the client's mount namespace, through a pidfd of the connected process
(server.peer_pidfd), cloned with open_tree(2) and attached at
`<state_dir>/client-paths/<random>/<its name>` for as long as the request
reads it, then detached (csrc/spawn.c dsec_peer_tree). The clone is a bind
of the same files: nothing is copied.

The daemon reads as root, so a client other than root (a member of
`daemon.socket_group`) reaches only files it could read itself: its path is
looked up and opened with the client's ids and no capability (every
directory on the way searchable, the path readable by it; no magic link of
/proc taken past a directory it may not search), and everything below it is
walked so before the request reads any of it (`unreadable_below`): a
directory the client cannot list or a file it cannot open, whatever is
mounted where, refuses the request, naming it. A client other than root
whose pid the daemon cannot see is refused (its path would be read again
by name). The walk is a check before the read, not the read itself: a file
swapped into the tree between the walk and the build (by a rename the
client races against it) is read with whatever ids the reader uses. So
the reads are the client's too: a Dockerfile build reads its context as it
(build/context.py ContextRoot), and `image_build` of a directory builds
from a copy made reading the tree as it (`copy_as`): mkfs.erofs reads as
root, by path.

The client's ids are not all a kernel file system checks: those reads run
in a thread of the daemon's process, and /proc/<the daemon's pid> files
pass the ptrace check there as the process's own (fdinfo, maps, ...),
which the client's own process would fail. A client in a user and mount
namespace of its own can bind them into its tree. So for a client other
than root nothing on a kernel file system (native.KERNEL_FS_MAGICS: proc,
sysfs, cgroup, debugfs, bpf, ...) is read: each descriptor the walk, the
copy or the context opens, the top too, is checked (`refuse_kernel_fs`),
and such a file or directory refuses the request, naming it.

Every call blocks (a clone and a mount): run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import posixpath
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .. import native, sysfs

log = logging.getLogger(__name__)

DIR = "client-paths"          # under state_dir


class ClientPathError(Exception):
    """The path could not be reached as the client sees it; `errno` says why
    (ENOENT: nothing there; ESRCH: the client is gone)."""

    def __init__(self, err: int, message: str):
        super().__init__(message)
        self.errno = err


class ClientPaths:
    def __init__(self, root: Path):
        self.root = Path(root)

    def sweep(self) -> int:
        """At start: detach and remove what a daemon killed mid-request left.
        A failure is logged: it costs a directory, never the start."""
        points = sysfs.mount_points_under(self.root)
        for point in points:
            try:
                native.umount(point, detach=True)
                log.warning("detached a client's path left attached by an earlier daemon: %s", point)
            except OSError as err:
                log.error("detach a client's path left by an earlier daemon, %s: %s", point, err)
        if self.root.exists():
            for holder in self.root.iterdir():
                try:
                    for point in holder.iterdir():
                        _remove_point(point)
                    holder.rmdir()
                except OSError as err:
                    log.error("remove %s, left by an earlier daemon: %s", holder, err)
        return len(points)

    @contextlib.contextmanager
    def reach(self, peer_pidfd: Callable[[], int | None], path: str,
              reader: native.Reader | None = None) -> Iterator[str]:
        """`path` (absolute) as the client sees it: a path of the daemon's
        where that tree is attached for the with block. `peer_pidfd` gives a
        pidfd of the client (closed here), None when the client has no pid
        in the daemon's pid namespace: `path` is then taken as the daemon
        sees it. `reader`: the client's ids when it is not root (the
        module's docstring). ClientPathError if it cannot be reached, or
        (EACCES) the reader cannot read all of it."""
        try:
            pidfd = peer_pidfd()
        except OSError as err:
            raise _unreachable(path, err) from err
        if pidfd is None:
            if reader is not None:
                # Checked and then read again by name, its path could be
                # swapped between the two: not served.
                raise ClientPathError(errno.EACCES, f"{path}: uid {reader.uid} (the client) runs in a pid "
                                                    "namespace the daemon cannot see into, so the path cannot be "
                                                    "reached as it sees it; name it from a client in the "
                                                    "daemon's pid namespace, or as root")
            yield path
            return
        try:
            point = self._attach(pidfd, path, reader)
        finally:
            os.close(pidfd)
        try:
            yield str(point)
        finally:
            native.umount(str(point), detach=True)
            _remove_point(point)
            point.parent.rmdir()

    def _attach(self, pidfd: int, path: str, reader: native.Reader | None) -> Path:
        try:
            tree = native.peer_tree(pidfd, path, reader)
        except OSError as err:
            raise _unreachable(path, err, reader) from err
        try:
            if reader is not None:
                _check_below(tree, path, reader)
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            holder = Path(tempfile.mkdtemp(dir=self.root))
            point = holder / point_name(path)
            try:
                if stat.S_ISDIR(os.fstat(tree).st_mode):
                    point.mkdir()
                else:
                    point.touch()
                native.attach_tree(tree, str(point))
            except BaseException:
                with contextlib.suppress(OSError):
                    _remove_point(point)
                with contextlib.suppress(OSError):
                    holder.rmdir()
                raise
        except OSError as err:
            raise ClientPathError(err.errno or errno.EIO, f"{path}: attach it under {self.root}: "
                                  f"{err.strerror or err}") from err
        finally:
            os.close(tree)
        return point


def point_name(path: str) -> str:
    """The attach point's name: the path's own (what reads it sees a
    tarball's name and suffix), "root" for / (and for "/a/.." or "/."
    forms that name no entry)."""
    name = posixpath.basename(posixpath.normpath(path))
    return name if name not in ("", ".", "..") else "root"


def _unreachable(path: str, err: OSError, reader: native.Reader | None = None) -> ClientPathError:
    code = err.errno or errno.EIO
    if code == errno.ESRCH:
        why = "the process that connected has exited: name the path from a client that stays connected"
    elif code == errno.EACCES and reader is not None:
        why = (f"uid {reader.uid} (the client) may not read it, or search a directory above it; the daemon "
               "reads for a client only what the client could read itself")
    else:
        why = os.strerror(code)
    return ClientPathError(code, f"{path}: {why} (looked up as the client sees it)")


def _check_below(top: int, path: str, reader: native.Reader) -> None:
    """ClientPathError (EACCES) naming the first entry below open `top`
    (the client's `path`), or top itself, that the reader cannot read or
    that is on a kernel file system."""
    try:
        refuse_kernel_fs(top, ".")
        with native.reader_ids(reader):
            bad = unreadable_below(top)
    except KernelFileError as err:
        shown = err.shown(path)
        raise ClientPathError(errno.EACCES, shown if err.rel == "." else f"{path}: {shown}") from None
    except OSError as err:          # ENAMETOOLONG: deeper than a path reaches; EIO, ...
        raise ClientPathError(err.errno or errno.EIO, f"{path}: check, as uid {reader.uid} (the client), what "
                                                      f"is below it: {err.strerror or err}") from err
    if bad is not None:
        where = posixpath.join(path, bad)
        raise ClientPathError(errno.EACCES, f"{path}: uid {reader.uid} (the client) may not read {where}; the "
                                            "daemon reads for a client only what the client could read "
                                            "itself: make it readable, or leave it out of the path")


KERNEL_FS_REFUSED = ("a kernel interface, not an ordinary file: the daemon reads nothing on a kernel file "
                     "system (proc, sysfs, cgroup, ...) for a client other than root; leave it out")


class KernelFileError(Exception):
    """An entry of a client's tree (`rel`, relative to its top; "." for the
    top) is on a kernel file system (`kind`: proc, sysfs, ...), which is
    never read for a client other than root (the module's docstring)."""

    def __init__(self, rel: str, kind: str):
        super().__init__(f"{rel} is on {kind}, {KERNEL_FS_REFUSED}")
        self.rel, self.kind = rel, kind

    def shown(self, top: str) -> str:
        """The message, the entry named below the client's path `top`."""
        where = top if self.rel == "." else posixpath.join(top, self.rel)
        return f"{where} is on {self.kind}, {KERNEL_FS_REFUSED}"


def refuse_kernel_fs(fd: int, rel: str) -> None:
    """KernelFileError if open `fd` (entry `rel` of a client's tree) is on
    a kernel file system."""
    kind = native.KERNEL_FS_MAGICS.get(native.fs_magic(fd, rel))
    if kind is not None:
        raise KernelFileError(rel, kind)


def read_link(dirfd: int, name: str, rel: str) -> str:
    """The target of symlink `name` in open `dirfd` (entry `rel` of a
    client's tree), read through an O_PATH fd of the link itself, refused
    (KernelFileError) if that is on a kernel file system: a proc magic link
    (/proc/PID/cwd, exe, root, ns/*) mounted onto a symlink of the tree
    would otherwise be read by the daemon's thread, which proc's ptrace
    check lets through for the daemon's own process."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        refuse_kernel_fs(fd, rel)
        return os.readlink("", dir_fd=fd)
    finally:
        os.close(fd)


def _open_below(dirfd: int, rel: str, flags: int, resolve: int, shown: str | None = None) -> int:
    """openat2 of `rel` below `dirfd`, refused (KernelFileError naming
    `shown`, else `rel`) if what it opened is on a kernel file system."""
    fd = native.openat2(dirfd, rel, flags, resolve=resolve)
    try:
        refuse_kernel_fs(fd, shown or rel)
    except BaseException:
        os.close(fd)
        raise
    return fd


# Opens of the walk: never through a symlink, never blocking on a FIFO or
# taking a terminal (only directories and regular files are opened).
_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_BELOW = native.RESOLVE_BENEATH | native.RESOLVE_NO_SYMLINKS | native.RESOLVE_NO_MAGICLINKS


def unreadable_below(top: int) -> str | None:
    """The first entry below the open file or directory `top`, by its
    path relative to top, that the calling thread may not read (a
    directory: list; a regular file: open), None if there is none;
    KernelFileError for a directory or file below top on a kernel file
    system. Symlinks are not followed, other entries not opened; an entry that
    went, or became a symlink, while walked is passed over (the read
    after sees what is there then). Iterative: any depth."""
    if not stat.S_ISDIR(os.fstat(top).st_mode):
        return None
    pending = ["."]
    while pending:
        rel = pending.pop()
        try:
            fd = _open_below(top, rel, _DIR_OPEN, _BELOW)
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EPERM):
                return rel
            if err.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
                continue
            raise
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    name = entry.name if rel == "." else f"{rel}/{entry.name}"
                    # The type of what is there, by a stat: a directory entry's
                    # own type is of the file under a mount, and a client can
                    # bind a root-only file over a FIFO or symlink of its tree.
                    try:
                        mode = os.stat(entry.name, dir_fd=fd, follow_symlinks=False).st_mode
                    except FileNotFoundError:       # gone meanwhile
                        continue
                    if stat.S_ISDIR(mode):
                        pending.append(name)
                    elif stat.S_ISREG(mode):
                        if not _can_open(fd, entry.name, name):
                            return name
        except PermissionError:         # listed, but an entry may not be looked at
            return rel
        finally:
            os.close(fd)
    return None


def _can_open(dirfd: int, name: str, rel: str) -> bool:
    try:
        os.close(_open_below(dirfd, name, _FILE_OPEN, _BELOW, rel))
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EPERM):
            return False
        if err.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
            return True
        raise
    return True


def _remove_point(point: Path) -> None:
    """Remove an (empty, unmounted) attach point; never anything below it:
    were it still attached, what is below would be the client's files."""
    if point.is_dir() and not point.is_symlink():
        point.rmdir()
    else:
        point.unlink(missing_ok=True)


class TreeChanged(Exception):
    """copy_as: the tree changed under the copy (an entry went, or became
    something else, between its listing and its open); the message names it."""


# Lookups of copy_as below its top: no symlink, no magic link, never above
# the top; a mount below it is crossed (the clone holds the client's).
_NO_LINKS = native.RESOLVE_BENEATH | native.RESOLVE_NO_SYMLINKS | native.RESOLVE_NO_MAGICLINKS
COPY_CHUNK = 1 << 20


class CopyTooLarge(Exception):
    """copy_as: the files' bytes passed its bound; `rel` is the file the copy
    was at (relative to top), `size` that file's size."""

    def __init__(self, rel: str, size: int, max_bytes: int):
        super().__init__(f"its files add up to more than {max_bytes} bytes ({rel} alone is {size})")
        self.rel, self.size, self.max_bytes = rel, size, max_bytes


class CopyTooMany(Exception):
    """copy_as: the entries copied passed its bound (`max_entries`); `rel`
    is the entry the copy was at (relative to top)."""

    def __init__(self, rel: str, max_entries: int):
        super().__init__(f"it holds more than {max_entries} entries (the copy was at {rel})")
        self.rel, self.max_entries = rel, max_entries


class CopyFailed(Exception):
    """copy_as: an OSError other than the reader's lack of permission (a
    full or failing file system under the copy, EIO reading the client's
    file): `rel` is the entry the copy was at (relative to top), `error`
    the OSError."""

    def __init__(self, rel: str, error: OSError):
        super().__init__(f"at {rel}: {error.strerror or error}")
        self.rel, self.error = rel, error


class _Budget:
    """The bytes of files copy_as has written, and their bound (max_bytes;
    0: none): CopyTooLarge for file `rel` (`size` bytes when opened) once
    its size or its bytes written would pass it."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.used = max_bytes, 0

    def check(self, rel: str, size: int) -> None:
        if self.max_bytes and self.used + size > self.max_bytes:
            raise CopyTooLarge(rel, size, self.max_bytes)

    def take(self, n: int, rel: str, size: int) -> None:
        self.used += n
        if self.max_bytes and self.used > self.max_bytes:
            raise CopyTooLarge(rel, size, self.max_bytes)


def copy_as(top: int, dest: str, reader: native.Reader, stop: Callable[[], bool] = lambda: False,
            max_bytes: int = 0, max_entries: int = 0) -> int:
    """Copy the tree below the open directory `top` into the empty
    directory `dest` (the daemon's), reading it as `reader`: every lookup,
    listing and open below `top` with the client's ids and no capability,
    relative to a directory opened so, never through a symlink; what is
    written, as the calling thread (root), with the source's types, modes,
    owners, xattrs the reader can list, and hard links. The copy is what
    the client could read at the moment it was read, whatever it renames
    meanwhile. `stop()` is asked between entries and before each chunk of
    a file's bytes (InterruptedError): a cancelled build's copy of a large
    file ends within a chunk, not at the file's end.
    PermissionError (its filename: the entry, relative to top) for what the
    reader may not read; KernelFileError for a directory or file (top too)
    on a kernel file system; TreeChanged for what changed under the copy.
    `max_bytes` (0: no bound) bounds the bytes of the files copied, a
    file's size counted before it is copied and its bytes as they are (it
    may grow meanwhile): a sparse file is copied whole, every byte
    written, and costs the client nothing to make (`truncate -s 1T`).
    CopyTooLarge past it. `max_entries` (0: no bound) bounds the entries
    copied: empty files, or one directory bind-mounted many times in the
    tree, cost the client nothing and each takes an inode of the copy's
    file system (CopyTooMany past it, before the entry is made). Returns
    the number of entries copied. CopyFailed for any other OSError, with
    the entry the copy was at. Blocking."""
    at = ["."]
    try:
        return _copy_as(top, dest, reader, stop, max_bytes, max_entries, at)
    except (PermissionError, InterruptedError):
        raise
    except OSError as err:
        raise CopyFailed(at[0], err) from err


def _copy_as(top: int, dest: str, reader: native.Reader, stop: Callable[[], bool], max_bytes: int,
             max_entries: int, at: list[str]) -> int:
    """copy_as, setting at[0] to the entry it is at."""
    budget = _Budget(max_bytes)
    links: dict[tuple[int, int], str] = {}
    dirs: list[tuple[str, os.stat_result]] = []
    refuse_kernel_fs(top, ".")
    with native.reader_ids(reader):
        st = os.fstat(top)
        xattrs = _xattrs_of(top)
    _xattrs_put(dest, xattrs)
    dirs.append((".", st))
    pending = ["."]
    count = 0
    while pending:
        rel = pending.pop()
        at[0] = rel
        with native.reader_ids(reader):
            try:
                fd = top if rel == "." else _open_below(top, rel, _DIR_OPEN | os.O_NOFOLLOW, _NO_LINKS)
            except OSError as err:
                _raise_read(err, rel)
            try:
                names = sorted(os.listdir(fd))
            except OSError as err:
                if fd != top:
                    os.close(fd)
                _raise_read(err, rel)
        try:
            for name in names:
                if stop():
                    raise InterruptedError("the copy was stopped")
                sub = name if rel == "." else f"{rel}/{name}"
                at[0] = sub
                out = os.path.join(dest, sub)
                count += 1
                if max_entries and count > max_entries:
                    raise CopyTooMany(sub, max_entries)
                if _copy_entry(fd, name, sub, out, reader, links, budget, stop):
                    with native.reader_ids(reader):
                        try:
                            dfd = _open_below(fd, name, _DIR_OPEN | os.O_NOFOLLOW, _NO_LINKS, sub)
                        except OSError as err:
                            _raise_read(err, sub)
                        try:
                            dst = os.fstat(dfd)
                            xattrs = _xattrs_of(dfd)
                        finally:
                            os.close(dfd)
                    _xattrs_put(out, xattrs)
                    dirs.append((sub, dst))
                    pending.append(sub)
        finally:
            if fd != top:
                os.close(fd)
    # Owners, then modes (a chown clears set-id bits), deepest first: a
    # read-only directory must not stop what goes in it.
    for sub, dst in sorted(dirs, key=lambda d: -d[0].count("/") - (d[0] != ".")):
        at[0] = sub
        path = dest if sub == "." else os.path.join(dest, sub)
        os.chown(path, dst.st_uid, dst.st_gid)
        os.chmod(path, stat.S_IMODE(dst.st_mode))
    return count


def _raise_read(err: OSError, rel: str):
    if err.errno in (errno.EACCES, errno.EPERM):
        raise PermissionError(err.errno, os.strerror(err.errno), rel) from None
    if err.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
        raise TreeChanged(f"{rel} changed while the build read it (renamed, removed or replaced)") from None
    raise err


def _copy_entry(dirfd: int, name: str, rel: str, out: str, reader: native.Reader,
                links: dict[tuple[int, int], str], budget: _Budget, stop: Callable[[], bool]) -> bool:
    """Copy entry `name` of open directory `dirfd` (as `reader`) to `out`;
    True if it is a directory (made, left for the caller to fill)."""
    with native.reader_ids(reader):
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            target = read_link(dirfd, name, rel) if stat.S_ISLNK(st.st_mode) else None
        except OSError as err:
            if err.errno == errno.EINVAL:       # no longer a symlink
                err = OSError(errno.ENOENT, "changed")
            _raise_read(err, rel)
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        os.mkdir(out, 0o700)
        return True
    if stat.S_ISLNK(mode):
        os.symlink(target, out)
        os.chown(out, st.st_uid, st.st_gid, follow_symlinks=False)
        return False
    if not stat.S_ISREG(mode):
        # A device, FIFO or socket: its inode alone, never opened.
        os.mknod(out, stat.S_IFMT(mode) | 0o600, st.st_rdev)
        os.chown(out, st.st_uid, st.st_gid)
        os.chmod(out, stat.S_IMODE(mode))
        return False
    with native.reader_ids(reader):
        try:
            src = _open_below(dirfd, name, _FILE_OPEN | os.O_NOFOLLOW, _NO_LINKS, rel)
        except OSError as err:
            _raise_read(err, rel)
    try:
        st = os.fstat(src)          # what was opened is what is copied
        if not stat.S_ISREG(st.st_mode):
            raise TreeChanged(f"{rel} changed while the build read it (no longer a regular file)")
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in links:
            os.link(links[key], out)
            return False
        budget.check(rel, st.st_size)
        dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while True:
                if stop():
                    raise InterruptedError("the copy was stopped")
                n = os.sendfile(dst, src, None, COPY_CHUNK)
                if not n:
                    break
                budget.take(n, rel, st.st_size)
            with native.reader_ids(reader):
                xattrs = _xattrs_of(src)
            _xattrs_put(dst, xattrs)
            os.fchown(dst, st.st_uid, st.st_gid)
            os.fchmod(dst, stat.S_IMODE(st.st_mode))
        finally:
            os.close(dst)
        if st.st_nlink > 1:
            links[key] = out
    finally:
        os.close(src)
    return False


def _xattrs_of(src: int) -> list[tuple[str, bytes]]:
    """The xattrs of open `src` the calling thread can list and read (as
    the reader: trusted.* are not among them)."""
    try:
        names = os.listxattr(src)
    except OSError as err:
        if err.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return []
        raise
    out = []
    for name in names:
        try:
            out.append((name, os.getxattr(src, name)))
        except OSError as err:
            if err.errno in (errno.ENODATA, errno.EACCES, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                continue        # gone meanwhile, or not the reader's to read
            raise
    return out


def _xattrs_put(dst: int | str, xattrs: list[tuple[str, bytes]]) -> None:
    for name, value in xattrs:
        os.setxattr(dst, name, value)
