"""A zram swap device that dsecd makes, owns and removes.

Paused sandboxes can only give back anonymous memory if it has somewhere to
go; zram is compressed swap in RAM (no disk, and DSec's idle sandboxes hold
mostly compressible anon pages). Off by default (`[memory.zram] enabled`).

    z = ZramSwap(ZramConfig(enabled=True, size_bytes=4 << 30, algorithm="lz4"))
    z.setup()          # hot_add -> comp_algorithm -> disksize -> swap header -> swapon
    z.stats()          # the kernel's mm_stat: stored vs compressed vs used
    z.teardown()       # swapoff -> reset -> hot_remove; safe to repeat

dsecd only ever touches the device number that `hot_add` handed it (kept in
`device`, recorded by the node as soon as hot_add answers, so a restarted
daemon can `adopt` it or, left half made, `remove_leftover` it): a host's
existing /dev/zram0 is never read, reset or swapped on. The swap header
names the state dir of the daemon that made the device: daemons of one
host each take back only their own.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from .. import native, sysfs

log = logging.getLogger(__name__)

SWAP_MAGIC = b"SWAPSPACE2"
LABEL = b"dsecd-zram"
OWNER_PREFIX = b"dsecd state dir "     # then the owner's state dir, in the swap header's bootbits
MM_STAT_FIELDS = ("orig_data_size", "compr_data_size", "mem_used_total", "mem_limit",
                  "mem_used_max", "same_pages", "pages_compacted", "huge_pages")


class ZramError(OSError):
    pass


@dataclass(frozen=True)
class ZramConfig:
    enabled: bool = False
    size_bytes: int = 4 << 30        # uncompressed capacity of the swap area
    algorithm: str = "lz4"           # must be listed in the device's comp_algorithm
    priority: int = 32767            # above any disk swap: zram is used first
    mem_limit_bytes: int = 0         # cap on RAM the device may use (0 = none)

    @classmethod
    def from_section(cls, z: dict) -> ZramConfig:
        """From the [memory.zram] table of the daemon config (docs/memory.md)."""
        from ..config import parse_size

        priority = int(z["priority"])
        if not -1 <= priority <= 32767:
            raise ValueError(f"memory.zram.priority must be -1..32767, got {priority}")
        size = parse_size(z["size"])
        # A swap area is a header page and at least 9 more (swap_header): a
        # smaller one would fail only at start, after hot_add, as a traceback.
        if size < 10 * native.PAGE_SIZE:
            raise ValueError(f"memory.zram.size must be at least 10 pages, got {z['size']!r}")
        return cls(enabled=bool(z["enabled"]), size_bytes=size,
                   algorithm=str(z["algorithm"]), priority=priority,
                   mem_limit_bytes=parse_size(z["mem_limit"]))


def swap_header(size_bytes: int, page_size: int = native.PAGE_SIZE, label: bytes = LABEL,
                owner: str = "") -> bytes:
    """Page 0 of a v1 swap area, as mkswap(8) writes it (include/linux/swap.h
    union swap_header): version 1, last_page, no bad pages, uuid, a label
    (volume_name, <= 16 bytes: dsecd's own areas are recognised by it), magic
    at the end. `owner`, the state dir of the daemon that made the area, goes
    in the first 1024 bytes (bootbits, which the kernel never reads): daemons
    share the label, and each only takes back its own areas."""
    if len(label) > 16:
        raise ValueError(f"a swap label has at most 16 bytes, got {label!r}")
    pages = size_bytes // page_size
    if pages < 10:
        raise ValueError(f"a swap area needs at least 10 pages, got {size_bytes} bytes")
    uuid = os.urandom(16)
    info = struct.pack("<III16s16s", 1, pages - 1, 0, uuid, label.ljust(16, b"\0"))
    page = bytearray(page_size)
    if owner:
        marker = _owner_mark(owner)
        page[:len(marker)] = marker
    page[1024:1024 + len(info)] = info
    page[page_size - len(SWAP_MAGIC):] = SWAP_MAGIC
    return bytes(page)


def _header_page(path: str | Path, page_size: int) -> bytes | None:
    """The first page of the swap area at `path` if it is a swap header,
    else None (no file, or none there)."""
    try:
        with open(path, "rb") as f:
            page = f.read(page_size)
    except FileNotFoundError:
        return None
    if len(page) < page_size or not page.endswith(SWAP_MAGIC):
        return None
    return page


def read_header(path: str | Path, page_size: int = native.PAGE_SIZE) -> tuple[bytes, str] | None:
    """(read_label's answer, read_owner's answer) of the swap area at `path`
    from one read of its header; None without a swap header (or file)."""
    page = _header_page(path, page_size)
    if page is None:
        return None
    boot = page[:1024].split(b"\0", 1)[0]
    owner = os.fsdecode(boot[len(OWNER_PREFIX):]) if boot.startswith(OWNER_PREFIX) else ""
    # version, last_page, nr_badpages (3 x u32), uuid[16], then volume_name[16].
    return page[1024 + 28:1024 + 44].rstrip(b"\0"), owner


def read_label(path: str | Path, page_size: int = native.PAGE_SIZE) -> bytes | None:
    """The label (volume_name) of the v1 swap header at `path`, or None if
    there is no swap header (or no file)."""
    header = read_header(path, page_size)
    return None if header is None else header[0]


def read_owner(path: str | Path, page_size: int = native.PAGE_SIZE) -> str | None:
    """The state dir of the daemon that made the swap area at `path` (see
    swap_header); "" for an area without one (made before dsecd wrote it, or
    not by dsecd), None without a swap header (or file)."""
    header = read_header(path, page_size)
    return None if header is None else header[1]


def _owner_mark(owner: str) -> bytes:
    """What swap_header writes for `owner`: NUL-ended in the 1024 bytes (a
    longer state dir is cut short)."""
    return (OWNER_PREFIX + os.fsencode(owner))[:1023]


def made_by(found: str, owner: str) -> bool:
    """Whether `found` (read_owner's answer) names the daemon of state dir `owner`."""
    return found == os.fsdecode(_owner_mark(owner)[len(OWNER_PREFIX):])


def owner_pid(state_dir: str) -> int | None:
    """The pid the daemon of `state_dir` wrote in its lock file, while a
    process of that pid is there (None: no daemon of it runs, as far as a
    pid says; a pid reused since counts as running, the safe side)."""
    try:
        pid = int(Path(state_dir, "dsecd.lock").read_text())
    except (OSError, ValueError):
        return None
    return pid if os.path.exists(f"/proc/{pid}") else None


def owner_said(state_dir: str) -> str:
    """The daemon of another state dir, as a message names it: with the pid
    its lock file holds while that process is there."""
    pid = owner_pid(state_dir)
    return f"state dir {state_dir}" if pid is None else f"state dir {state_dir} (pid {pid})"


def swap_areas(proc_swaps: str = "/proc/swaps") -> dict[str, dict[str, int]]:
    """Every active swap area, {name: {"size": bytes, "used": bytes}}, from /proc/swaps."""
    areas = {}
    with open(proc_swaps) as f:
        for line in f.read().splitlines()[1:]:
            parts = line.split()
            if parts:
                areas[parts[0]] = {"size": int(parts[2]) * 1024, "used": int(parts[3]) * 1024}
    return areas


def active_swaps(proc_swaps: str = "/proc/swaps") -> set[str]:
    return set(swap_areas(proc_swaps))


class ZramSwap:
    def __init__(self, cfg: ZramConfig, sys_root: str | Path = "/sys", dev_root: str | Path = "/dev",
                 owner: str = ""):
        self.cfg = cfg
        self.sys = Path(sys_root)
        self.dev_root = Path(dev_root)
        self.owner = owner          # the daemon's state dir, written in the swap header
        self.device: int | None = None

    @property
    def control(self) -> Path:
        return self.sys / "class" / "zram-control"

    def block(self) -> Path:
        return self.sys / "block" / f"zram{self.device}"

    def dev_path(self) -> str:
        return str(self.dev_root / f"zram{self.device}")

    # ------------------------------------------------------------ setup

    def available(self) -> tuple[bool, str]:
        if not (self.control / "hot_add").exists():
            return False, f"{self.control}/hot_add missing: zram module not loaded (modprobe zram)"
        return True, "zram hot_add present"

    def setup(self, on_added=None) -> int:
        """Make the device and swap on it; returns its number. `on_added(n)`
        is called as soon as hot_add has handed out device n, before it is
        set up: to record it where a daemon killed meanwhile finds it. On any
        failure what was done is undone (swapoff, reset, hot_remove) before
        raising."""
        if self.device is not None:
            return self.device
        ok, why = self.available()
        if not ok:
            raise ZramError(errno.ENODEV, why)
        self.device = int(_read(self.control / "hot_add"))
        try:
            if on_added is not None:
                on_added(self.device)
            self._set_algorithm()
            if self.cfg.mem_limit_bytes:
                _write(self.block() / "mem_limit", str(self.cfg.mem_limit_bytes))
            _write(self.block() / "disksize", str(self.cfg.size_bytes))
            self._write_header()
            native.swapon(self.dev_path(), self.cfg.priority)
        except BaseException:
            self.teardown()
            raise
        log.info("zram%d: %d MiB swap (%s), priority %d", self.device, self.cfg.size_bytes >> 20,
                 self.cfg.algorithm, self.cfg.priority)
        return self.device

    def _set_algorithm(self) -> None:
        listed = _read(self.block() / "comp_algorithm").replace("[", "").replace("]", "").split()
        if self.cfg.algorithm not in listed:
            raise ZramError(errno.EINVAL, f"zram algorithm {self.cfg.algorithm!r} is not offered "
                            f"by this kernel (it has: {' '.join(listed)})")
        _write(self.block() / "comp_algorithm", self.cfg.algorithm)

    def _write_header(self) -> None:
        path = self.dev_path()
        deadline = time.monotonic() + 2.0
        while not os.path.exists(path):        # devtmpfs adds the node asynchronously
            if time.monotonic() > deadline:
                raise ZramError(errno.ENOENT, f"`{path}` did not appear after hot_add")
            time.sleep(0.005)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_EXCL)
            try:
                os.pwrite(fd, swap_header(self.cfg.size_bytes, owner=self.owner), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            raise ZramError(err.errno, f"write swap header to `{path}`: {os.strerror(err.errno)}") from err

    # ------------------------------------------------------------ state

    def is_swap_on(self) -> bool:
        return self.device is not None and self.dev_path() in active_swaps()

    def usage(self) -> dict[str, int]:
        """{"size": bytes, "used": bytes} of the swap area from /proc/swaps; {} when not on."""
        return {} if self.device is None else swap_areas().get(self.dev_path(), {})

    def stats(self) -> dict[str, int]:
        if self.device is None:
            return {}
        values = [int(v) for v in _read(self.block() / "mm_stat").split()]
        return dict(zip(MM_STAT_FIELDS, values, strict=False))  # newer kernels add fields

    def adopt(self, device: int) -> bool:
        """Take back a device a previous daemon made and left on (its number
        from the state file): only if it is still swap and its header carries
        dsecd's label and names this daemon (or no daemon: an older dsecd's),
        since the number may have been reused by someone else."""
        self.device = device
        if not (self.block().exists() and self.is_swap_on()
                and (header := read_header(self.dev_path())) is not None and header[0] == LABEL
                and (header[1] == "" or made_by(header[1], self.owner))):
            self.device = None
            return False
        return True

    def remove_leftover(self, device: int) -> bool:
        """Remove a device this daemon recorded in this boot but cannot adopt:
        one left before it was swap (the daemon was killed while setting it
        up) or swapped off since. Only if it is not swap and has no swap
        header, or dsecd's naming this daemon; never device 0 (a host's own
        is zram0, and hot_add hands out a free number). A device made by
        someone else since its number was freed is left alone. True if
        removed; OSError if its reset or hot_remove fails."""
        if device == 0 or self.device is not None:
            return False
        self.device = device
        try:
            if not self.block().exists() or self.is_swap_on():
                return False
            try:
                header = read_header(self.dev_path())
            except OSError:
                return False
            if header is not None and (header[0] != LABEL or not made_by(header[1], self.owner)):
                return False
            self.teardown()
            return True
        finally:
            self.device = None

    # ------------------------------------------------------------ teardown

    def teardown(self) -> None:
        """swapoff (pages every swapped page back in), reset, hot_remove.
        Safe to repeat and to call on a half-made device."""
        if self.device is None:
            return
        if self.is_swap_on():
            native.swapoff(self.dev_path())
        if self.block().exists():
            # reset frees the compressed store; hot_remove refuses a device with
            # a disksize or an open fd (EBUSY), so retry briefly after swapoff.
            _write(self.block() / "reset", "1", retry_busy=True)
            _write(self.control / "hot_remove", str(self.device), retry_busy=True)
        self.device = None


def _read(path: Path) -> str:
    return sysfs.read(path, ZramError)


def _write(path: Path, value: str, retry_busy: bool = False) -> None:
    # reset and hot_remove answer EBUSY while swapoff's last references drain.
    sysfs.write(path, value, ZramError, {errno.EBUSY: "the device is still open or still swap"},
                retry_busy_s=2.0 if retry_busy else 0.0)
