"""Watching a directory (and with `recursive` its whole tree) inside a
sandbox with inotify, from the host.

Each watch has its own inotify instance. The directories are opened with
openat2 against the sandbox root (the top one with RESOLVE_IN_ROOT, every
one below it relative to the top with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS,
so no symlink is ever followed and nothing outside the tree is watched) and
handed to inotify_add_watch as /proc/self/fd/N: the kernel follows that magic
link to the very inode opened, never re-resolving a path a sandbox could
swap. Directories on kernel filesystems (proc, sysfs, ...) are not watched.

No directory stays open: an open directory is not deleted until it is
closed, and its IN_DELETE_SELF (which ends the watch) would wait for that.
The top is reopened by path for each new subdirectory and must still be the
same inode.

Nothing here blocks for long except `add_tree` (opens, scandirs: run it in a
worker); `read` and `translate` are cheap and run on the event loop.
"""

from __future__ import annotations

import errno
import os
import stat
import struct

from .. import native
from . import libc
from .files import BENEATH, PathError, _open

MASK = (libc.IN_CREATE | libc.IN_MODIFY | libc.IN_ATTRIB | libc.IN_DELETE | libc.IN_MOVED_FROM
        | libc.IN_MOVED_TO | libc.IN_DELETE_SELF | libc.IN_MOVE_SELF | libc.IN_ONLYDIR | libc.IN_EXCL_UNLINK)
# What each inotify bit is called on the wire (docs/protocol.md, file_watch).
KINDS = ((libc.IN_CREATE, "create"), (libc.IN_MODIFY, "modify"), (libc.IN_ATTRIB, "attrib"),
         (libc.IN_DELETE, "delete"), (libc.IN_MOVED_FROM, "move_from"), (libc.IN_MOVED_TO, "move_to"))
EVENT = struct.Struct("iIII")          # struct inotify_event: wd, mask, cookie, len; then the name


class WatchLimit(Exception):
    """More directories than the watch may hold (limits.max_watch_dirs)."""


def parse_events(buf: bytes) -> list[tuple[int, int, int, str]]:
    """Raw inotify records -> (wd, mask, cookie, name)."""
    out, pos = [], 0
    while pos + EVENT.size <= len(buf):
        wd, mask, cookie, size = EVENT.unpack_from(buf, pos)
        pos += EVENT.size
        name = buf[pos:pos + size].split(b"\0", 1)[0]
        pos += size
        out.append((wd, mask, cookie, os.fsdecode(name)))
    return out


class TreeWatch:
    """The inotify instance of one watch and the directories it watches, by
    watch descriptor and by path relative to the top ("" is the top)."""

    def __init__(self, rootfd: int, top: str, top_id: tuple[int, int], recursive: bool, max_dirs: int):
        self.rootfd = rootfd               # the sandbox root, owned (a dup: outlives a destroy race)
        self.top = top                     # the watched path inside the sandbox
        self.top_id = top_id               # its (st_dev, st_ino)
        self.recursive = recursive
        self.max_dirs = max_dirs
        self.ifd = libc.inotify_init()
        self.paths: dict[int, str] = {}
        self.wds: dict[str, int] = {}
        self.stopped: str | None = None    # why the watch ended, once it has
        self.close_deferred = False        # a worker still uses ifd: it closes the tree when done

    def close(self) -> None:
        for fd in (self.ifd, self.rootfd):
            if fd >= 0:
                os.close(fd)
        self.ifd = self.rootfd = -1

    # ------------------------------------------------------------ directories (worker thread)

    def add_tree(self, rel: str, report: bool) -> list[dict]:
        """Watch directory `rel` (and with `recursive` every directory below
        it). With `report`, the entries found in it are returned as `create`
        events: they were made before the watch existed (a directory created
        and filled at once), so inotify told nobody. An entry made between the
        watch and the scan is reported twice. Raises WatchLimit."""
        found: list[dict] = []
        try:
            fd = self._open(rel)
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV, errno.EACCES):
                return found            # gone, replaced by a file or symlink, or a mount: not watched
            raise
        if fd < 0:
            return found                # the top itself was replaced: its IN_DELETE/MOVE_SELF ends the watch
        try:
            if rel and native.fs_magic(fd, self._shown(rel)) in native.KERNEL_FS_MAGICS:
                return found            # /proc, /sys and friends: kernel files, no inotify events
            self._watch(fd, rel)
            if not self.recursive:
                return found
            with os.scandir(fd) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        finally:
            os.close(fd)
        for name, is_dir in entries:
            sub = f"{rel}/{name}" if rel else name
            if report:
                found.append({"kind": "create", "path": self._shown(sub), "is_dir": is_dir, "scanned": True})
            if is_dir:
                found.extend(self.add_tree(sub, report))
        return found

    def _open(self, rel: str) -> int:
        """An fd of directory `rel` under the top, or -1 if the top is no longer the one watched."""
        top = open_top(self.rootfd, self.top)
        st = os.fstat(top)
        if (st.st_dev, st.st_ino) != self.top_id:
            os.close(top)
            return -1
        if not rel:
            return top
        try:
            return native.openat2(top, rel, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, BENEATH)
        finally:
            os.close(top)

    def _watch(self, fd: int, rel: str) -> None:
        if rel not in self.wds and len(self.paths) >= self.max_dirs:
            raise WatchLimit(too_many_dirs(self.top, self.max_dirs))
        try:
            wd = libc.inotify_add_watch(self.ifd, f"/proc/self/fd/{fd}", MASK)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise WatchLimit(no_watches_left(self._shown(rel), "host")) from err
            raise
        old = self.paths.get(wd)
        if old is not None:             # the same directory under a new name (moved in the tree)
            self.wds.pop(old, None)
        self.paths[wd] = rel
        self.wds[rel] = wd

    # ------------------------------------------------------------ events (event loop)

    def read(self) -> list[tuple[int, int, int, str]]:
        """Every record queued on the inotify fd now (never blocks)."""
        raw = bytearray()
        while True:
            try:
                chunk = os.read(self.ifd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            raw += chunk
        return parse_events(bytes(raw))

    def translate(self, wd: int, mask: int, cookie: int, name: str) -> tuple[dict | None, str | None]:
        """One record -> (the event for the client or None, the directory to
        add watches under, relative, or None). Sets `stopped` when the watch
        is over; drops the watches of directories deleted or moved away."""
        if mask & libc.IN_Q_OVERFLOW:
            return {"kind": "overflow", "path": self.top, "is_dir": True, "message": OVERFLOW}, None
        rel = self.paths.get(wd)
        if rel is None:
            return None, None           # a watch removed a moment ago
        if mask & libc.IN_IGNORED:
            self._forget(rel, remove=False)
            if rel == "":
                self.stopped = self.stopped or "gone"
            return None, None
        if mask & (libc.IN_DELETE_SELF | libc.IN_MOVE_SELF | libc.IN_UNMOUNT):
            if rel == "":
                self.stopped = ("deleted" if mask & libc.IN_DELETE_SELF else
                                "moved" if mask & libc.IN_MOVE_SELF else "unmounted")
            return None, None           # below the top the parent's delete / move_from says it
        kind = next((k for bit, k in KINDS if mask & bit), None)
        if kind is None:
            return None, None
        child = f"{rel}/{name}" if rel else name
        is_dir = bool(mask & libc.IN_ISDIR)
        event = {"kind": kind, "path": self._shown(child), "is_dir": is_dir}
        if cookie:
            event["cookie"] = cookie    # pairs a move_from with its move_to
        if is_dir and kind in ("delete", "move_from"):
            self._forget(child, remove=True)
        grow = child if is_dir and self.recursive and kind in ("create", "move_to") else None
        return event, grow

    def _forget(self, rel: str, remove: bool) -> None:
        """Stop watching `rel` and everything under it."""
        for path in [p for p in self.wds if p == rel or p.startswith(rel + "/")] if rel else list(self.wds):
            wd = self.wds.pop(path)
            self.paths.pop(wd, None)
            if remove:
                libc.inotify_rm_watch(self.ifd, wd)

    def _shown(self, rel: str) -> str:
        return shown(self.top, rel)


def shown(top: str, rel: str) -> str:
    """The path inside the sandbox of `rel` under the watched `top`."""
    return f"{top.rstrip('/')}/{rel}" if rel else top


def too_many_dirs(top: str, max_dirs: int) -> str:
    return (f"watching {top} needs more than {max_dirs} directories (limits.max_watch_dirs); "
            "watch a smaller tree, or raise the limit")


def no_watches_left(path: str, where: str) -> str:
    return (f"watching {path}: the {where}'s inotify watches are used up (sysctl fs.inotify.max_user_watches); "
            "watch a smaller tree")


def on_kernel_fs(path: str, kind: str) -> str:
    return (f"{path} is on {kind}, a kernel interface: its files change without inotify events; "
            "poll it with an exec instead")


OVERFLOW = "the kernel's event queue overflowed: events were lost; list the tree again to catch up"


def top_identity(rootfd: int, path: str) -> tuple[int, int]:
    """(st_dev, st_ino) of the directory to watch; errors as open_top."""
    fd = open_top(rootfd, path)
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def open_top(rootfd: int, path: str) -> int:
    """The directory to watch, resolved in the sandbox root (a symlink inside
    the sandbox is followed, as every file op does), refused on a kernel
    filesystem."""
    fd = _open(rootfd, path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        kind = native.KERNEL_FS_MAGICS.get(native.fs_magic(fd, path))
        if kind is not None:
            raise PathError(on_kernel_fs(path, kind))
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a directory")
    except BaseException:
        os.close(fd)
        raise
    return fd
