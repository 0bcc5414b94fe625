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
    def reach(self, peer_pidfd: Callable[[], int | None], path: str) -> Iterator[str]:
        """`path` (absolute) as the client sees it: a path of the daemon's
        where that tree is attached for the with block. `peer_pidfd` gives a
        pidfd of the client (closed here), None when the client has no pid
        in the daemon's pid namespace: `path` is then taken as the daemon
        sees it. ClientPathError if it cannot be reached."""
        try:
            pidfd = peer_pidfd()
        except OSError as err:
            raise _unreachable(path, err) from err
        if pidfd is None:
            yield path
            return
        try:
            point = self._attach(pidfd, path)
        finally:
            os.close(pidfd)
        try:
            yield str(point)
        finally:
            native.umount(str(point), detach=True)
            _remove_point(point)
            point.parent.rmdir()

    def _attach(self, pidfd: int, path: str) -> Path:
        try:
            tree = native.peer_tree(pidfd, path)
        except OSError as err:
            raise _unreachable(path, err) from err
        try:
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


def _unreachable(path: str, err: OSError) -> ClientPathError:
    code = err.errno or errno.EIO
    why = ("the process that connected has exited: name the path from a client that stays connected"
           if code == errno.ESRCH else os.strerror(code))
    return ClientPathError(code, f"{path}: {why} (looked up as the client sees it)")


def _remove_point(point: Path) -> None:
    """Remove an (empty, unmounted) attach point; never anything below it:
    were it still attached, what is below would be the client's files."""
    if point.is_dir() and not point.is_symlink():
        point.rmdir()
    else:
        point.unlink(missing_ok=True)
