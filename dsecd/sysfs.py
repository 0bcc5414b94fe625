"""Kernel control files (cgroupfs, sysfs, procfs): one write, one read, clear errors.

A control file must be written with a single write(2) of the whole value
(the kernel parses each write on its own), and its errno is the answer, so
the error names the value, the file and a hint where the errno misleads.
"""

from __future__ import annotations

import errno
import os
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
