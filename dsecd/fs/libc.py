"""The few Linux calls the file API needs that neither `os` nor dsecd._native
wrap: inotify (watches) and renameat2(RENAME_NOREPLACE) (a directory copy
moved into place without replacing what is there). ctypes on the C library:
each is one plain system call that returns -1 and sets errno.
"""

from __future__ import annotations

import ctypes
import errno
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

RENAME_NOREPLACE = 1
AT_FDCWD = -100          # <fcntl.h>: a path relative to the working directory


def _check(ret: int, what: str, obj: str = "") -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", obj or None)
    return ret


def inotify_init() -> int:
    """A non-blocking, close-on-exec inotify fd."""
    return _check(_libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")


def inotify_add_watch(ifd: int, path: str, mask: int) -> int:
    return _check(_libc.inotify_add_watch(ifd, os.fsencode(path), mask), "inotify_add_watch", path)


def inotify_rm_watch(ifd: int, wd: int) -> None:
    """Remove a watch; one the kernel already dropped (its directory gone) is no error."""
    if _libc.inotify_rm_watch(ifd, wd) < 0 and ctypes.get_errno() != errno.EINVAL:
        _check(-1, "inotify_rm_watch")


def rename_noreplace(src_dirfd: int, src: str, dst_dirfd: int, dst: str) -> None:
    """rename(2) that fails with EEXIST instead of replacing `dst` (a plain
    rename silently replaces an empty directory)."""
    _check(_libc.renameat2(src_dirfd, os.fsencode(src), dst_dirfd, os.fsencode(dst), RENAME_NOREPLACE),
           "renameat2", dst)
