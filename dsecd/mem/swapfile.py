"""A disk swap file that dsecd makes, owns and deletes.

zram keeps swapped pages in RAM (compressed), so a paused sandbox whose
heap compresses badly gives back little with zram alone. A swap file on
local disk takes anonymous pages out of RAM entirely; it costs disk space
and a disk read per page at resume. Off by default (`[memory.swapfile]`).

    s = Swapfile(SwapfileConfig(enabled=True, path="/var/lib/dsecd/swapfile", size_bytes=8 << 30))
    s.setup()          # check fs -> create 0600 -> fallocate (no holes) -> header -> swapon
    s.usage()          # size and used bytes from /proc/swaps
    s.teardown()       # swapoff -> delete; safe to repeat

Only a file dsecd made is ever swapped on, off or deleted: its swap header
carries the label `dsecd-swap`. A file at the path without that label is
refused (EEXIST), never overwritten. A file left active by a daemon that
stopped with paused sandboxes (swapoff would have paged them all back in)
is adopted by the next setup() of that daemon: the header also names the
state dir of the daemon that made it, and a file another daemon made (two
configured with one memory.swapfile.path) is refused (EBUSY), never swapped
off or deleted, since its sandboxes may hold pages in it; unless it is off
and no daemon of its state dir runs (state_dir moved, the path kept): then
it holds nothing and is made afresh.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .. import native
from ..sysfs import fs_type
from .zram import (
    active_swaps,
    made_by,
    owner_pid,
    owner_said,
    read_label,
    read_owner,
    swap_areas,
    swap_header,
)

log = logging.getLogger(__name__)

LABEL = b"dsecd-swap"
# Filesystems whose files the kernel cannot swap to: no ->swap_activate and
# no bmap (tmpfs, ramfs and overlay hold no blocks of their own; FUSE and the
# read-only image filesystems cannot be written or mapped to blocks).
NO_SWAP_FS = {"tmpfs", "ramfs", "overlay", "fuse", "squashfs", "erofs", "proc", "sysfs",
              "devtmpfs", "cgroup", "cgroup2", "iso9660", "9p", "virtiofs"}
SWAP_FS_HINT = "put memory.swapfile.path on a local disk filesystem (ext4, xfs)"


# Disk a swap file leaves free on its filesystem: the smaller of 1 GiB and
# 5% of the filesystem (the state dir's journal and images, logs, every
# other writer on it).
RESERVE_MAX = 1 << 30
RESERVE_SHARE = 0.05


def free_reserve(fs_bytes: int) -> int:
    """Bytes a swap file must leave free on a filesystem of `fs_bytes`."""
    return min(RESERVE_MAX, int(fs_bytes * RESERVE_SHARE))


class SwapfileError(OSError):
    pass


@dataclass(frozen=True)
class SwapfileConfig:
    enabled: bool = False
    path: str = "/var/lib/dsecd/swapfile"
    size_bytes: int = 8 << 30
    priority: int = 10              # below zram's 32767: with both on, zram fills first

    @classmethod
    def from_section(cls, s: dict, state_dir: str | Path) -> SwapfileConfig:
        """From the [memory.swapfile] table (docs/memory.md); path "" = <state_dir>/swapfile."""
        from ..config import parse_size

        priority = int(s["priority"])
        if not -1 <= priority <= 32767:
            raise ValueError(f"memory.swapfile.priority must be -1..32767, got {priority}")
        size = parse_size(s["size"])
        if size < 10 * native.PAGE_SIZE:
            raise ValueError(f"memory.swapfile.size must be at least 10 pages, got {s['size']!r}")
        path = str(s["path"]) or str(Path(state_dir) / "swapfile")
        if not os.path.isabs(path):
            raise ValueError(f"memory.swapfile.path must be absolute, got {path!r}")
        return cls(enabled=bool(s["enabled"]), path=path, size_bytes=size - size % native.PAGE_SIZE,
                   priority=priority)


class Swapfile:
    def __init__(self, cfg: SwapfileConfig, mountinfo: str = "/proc/self/mountinfo", owner: str = ""):
        self.cfg = cfg
        self.path = cfg.path
        self.mountinfo = mountinfo
        self.owner = owner        # the daemon's state dir, written in the header of the file it makes
        self.active = False       # swapped on by this object (made or adopted)

    def other_owner(self) -> str | None:
        """The state dir of another daemon whose file is at the path; None
        if it is this daemon's, or has no owner written (an older dsecd's)."""
        try:
            owner = read_owner(self.path)
        except OSError:             # a directory, unreadable: not a file of ours either way
            return None
        return owner if owner and not made_by(owner, self.owner) else None

    # ------------------------------------------------------------ checks

    def check_fs(self) -> str:
        """Refuse a directory on a filesystem that cannot hold swap; its type."""
        parent = os.path.dirname(self.path)
        fstype, point = fs_type(parent, self.mountinfo)
        if fstype in NO_SWAP_FS:
            raise SwapfileError(errno.EINVAL, f"swap file `{self.path}`: `{point}` is {fstype}, which "
                                f"cannot hold swap (no blocks of its own for the kernel to map); {SWAP_FS_HINT}")
        if not os.path.isdir(parent):
            raise SwapfileError(errno.ENOENT, f"swap file `{self.path}`: directory `{parent}` does not exist")
        return fstype

    # ------------------------------------------------------------ setup

    def setup(self) -> str:
        """Make the file and swap on it (or adopt ours if it is still on); the
        path. On any failure after creating the file it is deleted again."""
        if self.active:
            return self.path
        fstype = self.check_fs()
        if os.path.lexists(self.path):
            if read_label(self.path) != LABEL:
                raise SwapfileError(errno.EEXIST, f"swap file `{self.path}`: a file not made by dsecd is "
                                    "there; dsecd does not touch it (remove it or pick another path)")
            if (other := self.other_owner()) is not None:
                if self.path in active_swaps() or owner_pid(other) is not None:
                    raise SwapfileError(errno.EBUSY, f"swap file `{self.path}` is the one of the dsecd daemon "
                                        f"with {owner_said(other)}; two daemons cannot share a swap file (one "
                                        "would swap off or delete what the other's sandboxes use): give this one "
                                        "a memory.swapfile.path of its own (\"\" is <state_dir>/swapfile)")
                # Off, and no daemon of that state dir runs (state_dir moved,
                # the path kept): no page is in it and nobody will switch it
                # on, so it is made afresh for this daemon.
                log.warning("swap file %s: left off by the daemon of state dir %s, which no longer runs; "
                            "made afresh for this one", self.path, other)
            elif self.adopt():                # a previous daemon's, left on for its paused sandboxes
                log.info("swap file %s: adopted (still on)", self.path)
                return self.path
            os.unlink(self.path)            # left off (ours, or a gone daemon's): made afresh
        self._create(fstype)                # removes its own half-made file on failure
        try:
            self.swapon()
        except BaseException:
            self._delete()
            raise
        self.active = True
        log.info("swap file %s: %d MiB on %s, priority %d", self.path, self.cfg.size_bytes >> 20, fstype,
                 self.cfg.priority)
        return self.path

    def _create(self, fstype: str) -> None:
        """The file, allocated and with a swap header (O_EXCL: never someone
        else's file); deleted again if any step after its creation fails."""
        self._check_free_space()
        # 0600 from the first byte: swapped pages are other processes' memory.
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as err:
            raise SwapfileError(err.errno, f"create swap file `{self.path}`: {os.strerror(err.errno)}") from err
        try:
            self._fill(fd, fstype)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)

    def _check_free_space(self) -> None:
        """Refuse a size the filesystem cannot hold and keep free_reserve()
        free. posix_fallocate on ext4 allocates block after block until
        ENOSPC: a file too big would fill the disk that the state dir and
        every other writer share before failing (and being deleted); one
        that fits exactly would leave them nothing for as long as it lives."""
        parent = os.path.dirname(self.path)
        st = os.statvfs(parent)
        free = st.f_bavail * st.f_frsize
        keep = free_reserve(st.f_blocks * st.f_frsize)
        if self.cfg.size_bytes > free - keep:
            raise SwapfileError(errno.ENOSPC, f"swap file `{self.path}`: memory.swapfile.size is "
                                f"{self.cfg.size_bytes >> 20} MiB, but `{parent}` has {free >> 20} MiB free "
                                f"and {keep >> 20} MiB of it stay free for the state dir and other writers; "
                                f"not enough free disk space (nothing was allocated): make the size at most "
                                f"{max(0, free - keep) >> 20} MiB or free space there")

    def _fill(self, fd: int, fstype: str) -> None:
        os.fchmod(fd, 0o600)            # whatever the umask
        try:
            # Real blocks, not a sparse file: the kernel refuses swap files with holes.
            os.posix_fallocate(fd, 0, self.cfg.size_bytes)
        except OSError as err:
            hint = "not enough free disk space" if err.errno == errno.ENOSPC else f"{fstype} refused it"
            raise SwapfileError(err.errno, f"allocate {self.cfg.size_bytes >> 20} MiB for swap file "
                                f"`{self.path}`: {os.strerror(err.errno)}; {hint}") from err
        st = os.fstat(fd)
        if st.st_blocks * 512 < self.cfg.size_bytes:
            raise SwapfileError(errno.EINVAL, f"swap file `{self.path}`: {st.st_blocks * 512} of "
                                f"{self.cfg.size_bytes} bytes allocated (holes); {SWAP_FS_HINT}")
        os.pwrite(fd, swap_header(self.cfg.size_bytes, label=LABEL, owner=self.owner), 0)
        os.fsync(fd)

    def swapon(self) -> None:
        try:
            native.swapon(self.path, self.cfg.priority)
        except OSError as err:
            if err.errno == errno.EINVAL:
                raise SwapfileError(errno.EINVAL, f"swapon `{self.path}`: the kernel refused the file "
                                    f"(a filesystem without swap support, a copy-on-write file, or "
                                    f"extents it cannot map); {SWAP_FS_HINT}") from err
            raise

    def adopt(self) -> bool:
        """Take over the file at the path if it is ours and still on (this
        daemon's previous run left it on for its paused sandboxes), so that
        teardown() takes it down; also with the swap file no longer enabled."""
        if not self.active:
            try:
                ours = read_label(self.path) == LABEL
            except OSError:             # a directory, unreadable: not a file of ours
                ours = False
            self.active = ours and self.other_owner() is None and self.path in active_swaps()
        return self.active

    # ------------------------------------------------------------ state

    def usage(self) -> dict[str, int]:
        """{"size": bytes, "used": bytes} from /proc/swaps; {} when not on."""
        return swap_areas().get(self.path, {})

    # ------------------------------------------------------------ teardown

    def teardown(self) -> None:
        """swapoff (pages every swapped page back in: seconds per GiB) and
        delete. Safe to repeat; only ever touches a file with our label,
        and not one another daemon made."""
        if read_label(self.path) != LABEL or self.other_owner() is not None:
            self.active = False
            return
        if self.path in active_swaps():
            native.swapoff(self.path)
        self.active = False
        self._delete()

    def _delete(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode):
            os.unlink(self.path)
