"""EROFS layers: build one with mkfs.erofs, mount one file-backed, unmount.

Builds are reproducible: the same tree gives the same bytes (fixed timestamp
-T0, a UUID made of the image's own bytes, stamp_uuid; mkfs.erofs sorts
directory entries itself), so a layer's sha256 identifies its content and
identical layers deduplicate in the store. mtimes are therefore not kept
(every file reads as 1970-01-01): the price of content addressing, the
same one reproducible image builders pay.

Overlay whiteouts (0:0 character devices) and opaque directories (the
trusted.overlay.opaque xattr) in the source tree are copied as they are, so
an overlay upper dir packed as a layer keeps its deletions when it is used as
a lower layer later (pack_diff).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

MKFS = "mkfs.erofs"
# What mkfs.erofs is given; stamp_uuid then replaces it with one of the image's content.
NULL_UUID = "00000000-0000-0000-0000-000000000000"
# Every layer file is padded (sparse zeros: no disk) to a multiple of this, so
# the microVM backend can hand the very same blob to a guest as a virtio-pmem
# device: the guest's nd_pmem driver refuses a region that is not 2 MiB
# aligned ("misaligned, unable to map"), and QEMU maps a file only whole.
# EROFS ignores bytes past its last block, so a host mount reads it the same.
PMEM_ALIGN = 2 << 20
# How often a build looks whether it was cancelled while mkfs.erofs runs.
CANCEL_POLL_S = 0.2


# The superblock, at byte 1024 of every EROFS image: its magic, then (at +12)
# log2 of the block size and (at +36) the image's length in blocks.
SUPER_OFFSET = 1024
SUPER_MAGIC = 0xE0F5E1E2
# Further fields stamp_uuid sets: the superblock's crc32c (at +4, kept when
# feature_compat, at +8, has SB_CHKSUM: mkfs.erofs sets it) and the uuid (+48).
SUPER_CHECKSUM = 4
SUPER_COMPAT = 8
SUPER_UUID = 48
COMPAT_SB_CHKSUM = 0x1
HASH_CHUNK = 1 << 20


def data_size(path: Path) -> int | None:
    """The length of the EROFS image in the file at `path` as its superblock
    says it (blocks x block size): the file without the zeros pad_to_pmem
    added, which are sparse and hold nothing. None: no EROFS superblock."""
    with open(path, "rb") as f:
        f.seek(SUPER_OFFSET)
        sb = f.read(40)
        length = os.fstat(f.fileno()).st_size
    if len(sb) < 40 or not _is_superblock(sb):
        return None
    n = int.from_bytes(sb[36:40], "little") << sb[12]
    return n if 0 < n <= length else None


def _is_superblock(sb: bytes) -> bool:
    """The start of an EROFS superblock: its magic, and a block size (log2 at +12) of 512 B to 64 KiB."""
    return int.from_bytes(sb[0:4], "little") == SUPER_MAGIC and 9 <= sb[12] <= 16


def stamp_uuid(path: Path, cancelled: threading.Event | None = None) -> bytes:
    """Give the EROFS image at `path`, built with a null uuid, a uuid made of
    its own bytes (the first 16 of their sha256), and its superblock the
    checksum that goes with it. Returns the uuid.

    Why every layer needs one of its own: overlayfs marks a copied-up file
    (trusted.overlay.origin) with its lower inode's file handle and the
    uuid of that inode's file system, and nothing else says which lower
    layer it was. A microVM's guest keeps no user.* xattrs in its writable
    layer (a tmpfs of Linux 6.1), so its agent gives a copied-up file those
    of its image inode, found by that handle; with several layers of one
    (null) uuid, a renamed file's was not found and its snapshot lost them.
    Made of the content, the uuid keeps builds reproducible: the same tree
    gives the same bytes, and two layers differ in it unless they are the
    same layer (which an image attaches once)."""
    with open(path, "r+b") as f:
        f.seek(SUPER_OFFSET)
        sb = bytearray(f.read(SUPER_UUID + 16))
        if len(sb) < SUPER_UUID + 16 or not _is_superblock(sb):
            raise OSError(errno.EINVAL, f"{path} holds no EROFS superblock")
        if any(sb[SUPER_UUID:SUPER_UUID + 16]):
            raise OSError(errno.EINVAL, f"{path} already has a uuid")
        f.seek(0)
        digest = hashlib.sha256()
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            if cancelled is not None and cancelled.is_set():
                return b""      # build drops the image
        uuid = digest.digest()[:16]
        f.seek(SUPER_OFFSET + SUPER_UUID)
        f.write(uuid)
        if int.from_bytes(sb[SUPER_COMPAT:SUPER_COMPAT + 4], "little") & COMPAT_SB_CHKSUM:
            # The kernel's check: crc32c(~0) of the superblock's block from
            # byte 1024 on (the block less 1024, for blocks past 1024), the
            # checksum field zero, no final inversion.
            size = 1 << sb[12]
            f.seek(SUPER_OFFSET)
            block = bytearray(f.read(size - SUPER_OFFSET if size > SUPER_OFFSET else size))
            block[SUPER_CHECKSUM:SUPER_CHECKSUM + 4] = bytes(4)
            f.seek(SUPER_OFFSET + SUPER_CHECKSUM)
            f.write(_crc32c(block).to_bytes(4, "little"))
    return uuid


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


CRC32C_TABLE = _crc32c_table()


def _crc32c(data: bytes, crc: int = 0xFFFFFFFF) -> int:
    """CRC-32C (Castagnoli), started at `crc` and not inverted at the end:
    what EROFS's superblock checksum is (the kernel's crc32c(~0, ...))."""
    for b in data:
        crc = CRC32C_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


def pad_to_pmem(path: Path) -> None:
    size = path.stat().st_size
    if size % PMEM_ALIGN:
        os.truncate(path, size + PMEM_ALIGN - size % PMEM_ALIGN)


class ErofsError(Exception):
    """code: a protocol error code; detail: the error's detail (errno, path), if any."""

    def __init__(self, code: str, message: str, detail: dict | None = None):
        super().__init__(message)
        self.code = code
        self.detail = detail


def exclude_rel(path: str) -> str:
    """An exclude path as mkfs.erofs matches it: relative to the tree's top
    and normalised ("//work/./a/" is "work/a"); "" names the top itself.
    The size bound and the no-change check (fs/images.py) read excludes
    through this too, so that they leave out exactly what the layer does."""
    return os.path.normpath("/" + path).lstrip("/")


def build(src: Path, out: Path, exclude: Iterable[str] = (), cancelled: threading.Event | None = None,
          written: Callable[[int], None] | None = None) -> None:
    """mkfs.erofs `out` from directory `src`; `exclude` are paths relative to src.
    `cancelled`, once set, kills mkfs.erofs and removes `out`: ErofsError
    `conflict`. A half-written image is of no use, and the caller (a
    cancelled snapshot) should not wait for the rest of it to be written.
    `written` is told, every CANCEL_POLL_S while mkfs.erofs runs, how many
    bytes of `out` it has written so far (a long pack's progress)."""
    # noinline_data: every regular file's data in whole blocks of its own
    # (EROFS_INODE_FLAT_PLAIN). A guest kernel maps a file of a layer on
    # virtio-pmem straight from the host's page cache (DAX) only in that
    # layout; with the default tail packing, files whose size is not a block
    # multiple (almost all) were read into each guest's own page cache. It
    # costs the tail block's slack: +5.7% on /usr/lib/python3.11.
    cmd = [MKFS, "--quiet", "-T0", f"-U{NULL_UUID}", "-Enoinline_data"]
    for path in exclude:
        # mkfs.erofs 1.5 matches exclusions against the path relative to src, as spelt.
        if rel := exclude_rel(path):
            cmd.append(f"--exclude-path={rel}")
    cmd += [str(out), str(src)]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        raise ErofsError("unsupported", f"{MKFS} is not installed (apt-get install erofs-utils)") from None
    deadline = time.monotonic() + 3600
    with proc:
        try:
            while True:
                try:
                    stdout, stderr = proc.communicate(timeout=CANCEL_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if cancelled is not None and cancelled.is_set():
                        raise ErofsError("conflict", f"mkfs.erofs {src}: cancelled") from None
                    if time.monotonic() > deadline:
                        raise ErofsError("io", f"mkfs.erofs {src}: still running after an hour; killed") from None
                    if written is not None:
                        with contextlib.suppress(FileNotFoundError):
                            written(out.stat().st_size)
        except BaseException:
            # Cancelled, too slow, or `written` failing (its loop gone): a
            # half-written image is of no use, and waiting for the rest of it
            # (what leaving `with proc` does) could take minutes.
            proc.kill()
            proc.communicate()
            out.unlink(missing_ok=True)
            raise
    if proc.returncode != 0:
        msg = (stderr or stdout).strip().splitlines()
        detail = msg[-1] if msg else f"exit {proc.returncode}"
        if "No space" in detail or "ENOSPC" in detail:
            # The device mkfs.erofs names is `out`, not the `src` it reads:
            # say which file system to free space on.
            raise ErofsError("io", f"mkfs.erofs {src}: {detail} writing {out}; free space "
                             f"on the file system of {out.parent}", {"errno": "ENOSPC", "path": str(out.parent)})
        raise ErofsError("bad_request", f"mkfs.erofs {src}: {detail}")
    try:
        stamp_uuid(out, cancelled)
    except OSError as err:
        out.unlink(missing_ok=True)
        raise ErofsError("io", f"mkfs.erofs {src}: cannot give {out} the uuid of its content: {err.strerror}; "
                         "nothing was stored, build it again", {"errno": errno.errorcode.get(err.errno, "EIO"),
                                                                "path": str(out)}) from err
    if cancelled is not None and cancelled.is_set():
        out.unlink(missing_ok=True)
        raise ErofsError("conflict", f"mkfs.erofs {src}: cancelled")
    pad_to_pmem(out)
