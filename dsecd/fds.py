"""The daemon's long-lived fds, kept at high numbers ("parked").

The daemon holds a few fds for every live sandbox (its PID 1's pidfd, a root
fd for file operations, the mount fd of its upper tmpfs): thousands during a
burst. Every spawn child (csrc/spawn.c) shares the daemon's fd table and
then takes a private copy of just the fds below the highest one it needs
(`fd_table_private`). Fds made for a spawn (pipes, cgroup files, mount fds)
take the lowest free numbers, so with the long-lived ones parked above
`base` that copy stays small, and so do the close at execve and at exit.

Parking only changes fd numbers, never what a child can reach: a child
copies fds below what it needs, and closes every one of them (close_range)
or marks them close-on-exec before it runs sandbox code. If parking fails
(the high range is full), the fd stays where it was: spawns get slower,
nothing breaks.
"""

from __future__ import annotations

import fcntl
import os
import resource

# Parked fds start at a quarter of the fd limit, leaving the low quarter to
# the fds that come and go (connections, exec pipes, spawn fds), and at most
# at _MAX_BASE: the table grows to the highest fd, and every fork of the
# daemon (pager, mkfs, tracer) copies a table that size.
_LOW_SHARE = 4
_MIN_BASE = 64
_MAX_BASE = 65536

_base: int | None = None


def init_parking() -> None:
    """Set the parking base from RLIMIT_NOFILE (call after raising it); none if the limit is too low."""
    global _base
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    base = min(soft // _LOW_SHARE, _MAX_BASE)
    _base = base if base >= _MIN_BASE else None


def park(fd: int) -> int:
    """Move a long-lived fd (close-on-exec) to the parked range; the fd to use from now on."""
    if _base is None or fd >= _base:
        return fd
    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _base)
    except OSError:         # EMFILE: the parked range is full; EINVAL: base above the limit
        return fd
    os.close(fd)
    return high


def call_closing(fd: int, fn, *args):
    """fn(*args), then close `fd`, which the caller handed over: a worker's
    own copy of a long-lived fd (a sandbox's root), closed when the worker
    is done with it, whether or not anyone still waits for its answer."""
    try:
        return fn(*args)
    finally:
        os.close(fd)


def close_quietly(fd: int) -> None:
    """Close fd if it is one (>= 0); an error closing it is nothing to act on."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


def read_ready(fd: int, size: int) -> bytes | None:
    """What a nonblocking fd has now: up to `size` bytes, b"" at its end (a
    read error ends it too: nothing more will come), None while it has none."""
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError:
        return b""
