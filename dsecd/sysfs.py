"""Kernel control files (cgroupfs, sysfs, procfs): one write, one read, clear errors.

A control file must be written with a single write(2) of the whole value
(the kernel parses each write on its own), and its errno is the answer, so
the error names the value, the file and a hint where the errno misleads.
"""

from __future__ import annotations

import errno
import os
import re
import time
from pathlib import Path


def write(path: str | Path, value: str, exc: type[OSError] = OSError, hints: dict[int, str] | None = None,
          retry_busy_s: float = 0.0) -> None:
    """Write `value` in one write(2); raise `exc(errno, "write 'v' to `path`: strerror[; hint]")`.
    With retry_busy_s, EBUSY is retried that long (a device or group still draining)."""
    deadline = time.monotonic() + retry_busy_s
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
            return
        except OSError as err:
            if err.errno == errno.EBUSY and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            hint = (hints or {}).get(err.errno)
            raise exc(err.errno, f"write {value!r} to `{path}`: {os.strerror(err.errno)}"
                      + (f"; {hint}" if hint else "")) from err


def read(path: str | Path, exc: type[OSError] = OSError) -> str:
    # os.open/os.read: a buffered file object costs an fstat, an ioctl and an
    # lseek more per read, and some of these files are read for every sandbox.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError as err:
        raise exc(err.errno, f"read `{path}`: {os.strerror(err.errno)}") from err
    return b"".join(chunks).decode()


def read_small(path: str, dir_fd: int | None = None) -> bytes | None:
    """A small cgroup or /proc file in one read, or None once it is gone (its
    group destroyed, its process exited: a race, not an error)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def unescape_mount_field(field: str) -> str:
    """A path field of /proc/self/mountinfo as the path it is (octal escapes: space, tab, newline, backslash)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_points_under(top: str | Path, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The mount points strictly below directory `top`, deepest first (the
    order to unmount them in)."""
    prefix = str(top).rstrip("/") + "/"
    with open(mountinfo) as f:
        points = [p for line in f if (p := unescape_mount_field(line.split()[4])).startswith(prefix)]
    return sorted(points, key=len, reverse=True)


def fs_type(path: str | Path, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str]:
    """(filesystem type, mount point) of the mount that holds `path`: the longest mount point that is a prefix of its real path.
    The last mount wins on ties: it is the one on top."""
    real = os.path.realpath(path)
    best, best_fs = "", ""
    with open(mountinfo) as f:
        for line in f:
            parts = line.split()
            point = unescape_mount_field(parts[4])
            fstype = parts[parts.index("-") + 1]
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, best_fs = point, fstype
    return best_fs, best
