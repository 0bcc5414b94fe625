"""The writable layer of a container sandbox (overlay upper + work) and its cap.

Two kinds, picked once at daemon start (`sandbox.writable_layer`):

* "tmpfs": a tmpfs of its own per sandbox, capped at `disk` bytes and
  `disk_inodes` inodes by the kernel: filling it gives ENOSPC inside, and
  nothing is written to the host's disks. It is made detached (no mount in
  any namespace; csrc/upperfs.c) and reached through its mount fd: the
  daemon keeps one (pack_diff reads the layer through it) and the sandbox's
  PID 1 keeps another as fd 3, so a restarted daemon takes it back with
  pidfd_getfd. Its pages are memory, charged to the sandbox's memory cgroup
  as the sandbox writes them: what a sandbox writes counts against its
  memory limit as well (it can go to swap, never to disk). Needs Linux >= 6.15
  (probed: feature `upperfs`).
* "dir": plain directories under state_dir, no cap (what remains where the
  kernel cannot do the above; project quotas would be the disk-backed cap,
  and are probed and reported as feature `project_quota`, not used).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import native, sysfs

log = logging.getLogger(__name__)

MODES = ("auto", "tmpfs", "dir")


class UpperError(Exception):
    pass


def pick_mode(configured: str, features) -> str:
    """The kind this daemon uses; a refused "tmpfs" stops the daemon with the reason."""
    if configured not in MODES:
        raise UpperError(f"sandbox.writable_layer must be one of {', '.join(MODES)}, got {configured!r}")
    if configured == "dir":
        log.warning("sandbox.writable_layer = dir: writable layers have NO size cap")
        return "dir"
    feat = features.items.get("upperfs")
    if feat is not None and feat.available:
        return "tmpfs"
    detail = feat.detail if feat is not None else "not probed"
    if configured == "tmpfs":
        raise UpperError(f"sandbox.writable_layer = tmpfs, but this kernel cannot: {detail}; "
                         "set it to \"dir\" (no size cap) or \"auto\"")
    log.warning("writable layers have NO size cap: %s (sandbox.writable_layer = auto falls back "
                "to dir)", detail)
    return "dir"


def check_default_cap(disk: int, inodes: int) -> None:
    """UpperError unless sandbox.disk and sandbox.disk_inodes can cap a
    tmpfs writable layer: a tmpfs takes 0 as unlimited, and fewer than 16
    inodes or 1M leave a sandbox no room to write."""
    if disk < 1 << 20:
        raise UpperError(f"sandbox.disk must be at least 1M with a tmpfs writable layer (a tmpfs takes 0 "
                         f"as unlimited), got {disk} bytes")
    if inodes < 16:
        raise UpperError(f"sandbox.disk_inodes must be at least 16 with a tmpfs writable layer (a tmpfs "
                         f"takes 0 as unlimited), got {inodes}")


@dataclass(frozen=True)
class Cap:
    disk_bytes: int
    inodes: int


def create_tmpfs(cap: Cap) -> int:
    """A detached tmpfs with the overlay's upper/ and work/ in it: its mount fd."""
    fd = native.upperfs_create(cap.disk_bytes, cap.inodes)
    try:
        os.mkdir("upper", 0o755, dir_fd=fd)
        os.mkdir("work", 0o755, dir_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


VIEWS_DIR = "upper-views"      # under state_dir: where attach() mounts its views


def attach(fd: int, views: Path) -> tuple[Path, Callable[[], None]]:
    """The upper dir at a host path, for programs that need one (mkfs.erofs
    for pack_diff), and the function that takes it away again. Blocking."""
    views.mkdir(parents=True, exist_ok=True)
    point = Path(tempfile.mkdtemp(prefix="upper-", dir=views))
    try:
        native.upperfs_attach(fd, str(point))
    except BaseException:
        point.rmdir()
        raise

    def detach() -> None:
        native.umount(str(point), detach=True)
        point.rmdir()

    return point / "upper", detach


def sweep_views(views: Path) -> int:
    """At start: unmount views a daemon killed mid-snapshot left behind (each
    pins a sandbox's layer, and its memory, until unmounted). Blocking."""
    points = sysfs.mount_points_under(views)
    for point in points:
        native.umount(point, detach=True)
        log.warning("unmounted a writable-layer view left by an earlier daemon: %s", point)
        with contextlib.suppress(OSError):
            os.rmdir(point)
    return len(points)


def take_back(pidfd: int) -> int:
    """After a daemon restart: the mount fd that the sandbox's PID 1 holds."""
    fd = native.pidfd_getfd(pidfd, native.UPPER_FD)
    if not os.path.isdir(f"/proc/self/fd/{fd}/upper"):
        os.close(fd)
        raise OSError(errno.EBADF, f"fd {native.UPPER_FD} of the sandbox init is not its upper tmpfs")
    return fd


def usage(fd: int) -> dict:
    st = os.fstatvfs(fd)
    return {"limit": st.f_blocks * st.f_frsize, "used": (st.f_blocks - st.f_bfree) * st.f_frsize,
            "inodes_limit": st.f_files, "inodes_used": st.f_files - st.f_ffree}
