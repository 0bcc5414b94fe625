"""The blob store: a directory of content-addressed files.

    <root>/blobs/sha256/<hex>     immutable blobs (EROFS layers, manifests)
    <root>/tmp/                   writes in progress, named by their writer

By default the root is on local disk; in production it is a mount of a
distributed file system shared by every host, so a layer built on one host is
usable on all of them. A blob appears under its digest only by rename(2) of a
complete, fsync'ed temp file in the same file system, so readers never see a
partial blob, and two builders of the same layer both end with one intact
copy (the second rename replaces identical bytes, or is skipped).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import re
import shutil
import struct
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from .claims import process_start_time

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}\Z")
CHUNK = 1 << 20
# Chunk index of a layer (csrc/pager/verify.c has the format): the sha256 of
# every INDEX_BLOCK bytes, so the lazy pager can check each chunk it fetches
# without reading the whole blob. 64 KiB: the pager's default chunk size.
INDEX_BLOCK = 64 << 10
INDEX_MAGIC = b"DSECIDX1"
INDEX_HEADER = struct.Struct("<8sIIQ")


def write_durable(path: Path, data: bytes) -> None:
    """Write a small file and fsync it, before it is linked or renamed into
    place. On a shared store the fsync is what makes the bytes reach the
    servers before the name does: a network file system's client may hold
    written data in its cache past close (GlusterFS' write-behind and
    flush-behind do), so another host could otherwise open the new name and
    read a short or empty file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def unreachable_hint(root: Path) -> str:
    """What to do when a store operation fails with an I/O error (the
    distributed file system's servers gone, its mount broken)."""
    return (f"the image store {root} is unreachable or failing: check its mount "
            f"(`findmnt -T {root}`) and its servers, then retry")


class StoreError(Exception):
    """code: 'not_found' | 'bad_request' | 'io' (digest mismatch, disk full, ...)"""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def check_digest(digest: str) -> str:
    if not DIGEST_RE.match(digest):
        raise StoreError("bad_request", f"bad digest {digest!r}: want sha256:<64 hex digits>")
    return digest


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class ChunkHasher:
    """The chunk index's hashes of a layer file while it is written front to
    back (tarerofs.convert_blob): chunks that lie wholly in [INDEX_BLOCK,
    final) are hashed as `final` grows, read back from the page cache, so
    that work is done while the layer downloads rather than after it.
    Chunk 0 (it holds the superblock, written last) and the chunks past
    `final` are left to digest_and_index."""

    def __init__(self):
        self.hashes: list[bytes] = []       # of chunks 1, 2, ...

    def advance(self, fd: int, final: int) -> None:
        """Hash the chunks of `fd` (readable) now wholly below `final`, CHUNK bytes a read."""
        done = (1 + len(self.hashes)) * INDEX_BLOCK
        while final - done >= INDEX_BLOCK:
            want = min(CHUNK, (final - done) // INDEX_BLOCK * INDEX_BLOCK)
            view = memoryview(os.pread(fd, want, done))
            if len(view) != want:
                raise OSError(errno.EIO, f"read back {want} bytes at {done} of a layer being written: "
                              f"got {len(view)}")
            self.hashes.extend(hashlib.sha256(view[i:i + INDEX_BLOCK]).digest()
                               for i in range(0, want, INDEX_BLOCK))
            done += want


def digest_and_index(path: str | Path, known: ChunkHasher | None = None) -> tuple[str, bytes]:
    """One pass over a layer file: its digest and its chunk index (the
    hashes of chunks 1..n that `known` has are taken from it)."""
    whole = hashlib.sha256()
    have = known.hashes if known is not None else []
    hashes = []
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            whole.update(chunk)
            view = memoryview(chunk)
            # CHUNK is a multiple of INDEX_BLOCK, so only the file's last block is short.
            for i in range(0, len(view), INDEX_BLOCK):
                n = (size + i) // INDEX_BLOCK
                hashes.append(have[n - 1] if 1 <= n <= len(have) else hashlib.sha256(view[i:i + INDEX_BLOCK]).digest())
            size += len(chunk)
    index = INDEX_HEADER.pack(INDEX_MAGIC, INDEX_BLOCK, 0, size) + b"".join(hashes)
    return "sha256:" + whole.hexdigest(), index


def check_index(index: bytes, blob_size: int) -> None:
    """Raise StoreError unless `index` is a well-formed chunk index of a blob_size-byte blob."""
    if len(index) < INDEX_HEADER.size:
        raise StoreError("io", "chunk index is truncated")
    magic, block, _, size = INDEX_HEADER.unpack_from(index)
    if magic != INDEX_MAGIC or block < 4096 or block & (block - 1):
        raise StoreError("io", "chunk index has a bad header")
    if size != blob_size:
        raise StoreError("io", f"chunk index is for a {size}-byte blob, the store blob has {blob_size}")
    if len(index) != INDEX_HEADER.size + -(-size // block) * 32:
        raise StoreError("io", "chunk index has the wrong length for its blob size")


class BlobStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.blobs = self.root / "blobs" / "sha256"
        self.tmp = self.root / "tmp"
        for d in (self.blobs, self.tmp):
            d.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.blobs / check_digest(digest).split(":", 1)[1]

    def copy_out(self, digest: str, dst: Path, bandwidth_bps: int = 0, latency_us: int = 0,
                 verify: bool = True) -> None:
        """Copy a blob to a local file (images.mode = eager), checking its digest
        on the way (verify): a corrupt store copy is an `io` StoreError.

        bandwidth_bps/latency_us throttle the copy like dsec-pager throttles
        its fetches ([pager] keys, benches emulating a remote store): one
        latency for the whole stream, then the bytes at the link's rate. Without
        it an eager copy from a local store would race a throttled pager."""
        start = time.monotonic() + latency_us / 1e6
        sent = 0
        h = hashlib.sha256()
        try:
            with open(self.path(digest), "rb") as src, open(dst, "wb") as out:
                while piece := src.read(4 * CHUNK):
                    out.write(piece)
                    if verify:
                        h.update(piece)
                    sent += len(piece)
                    if bandwidth_bps:
                        time.sleep(max(0.0, start + sent / bandwidth_bps - time.monotonic()))
        except FileNotFoundError:
            raise StoreError("not_found", f"blob {digest} is missing from the store {self.root}") from None
        except OSError as err:
            raise StoreError("io", f"copy blob {digest} to {dst}: {err.strerror}") from err
        if verify and "sha256:" + h.hexdigest() != digest:
            raise StoreError("io", f"blob {digest} in {self.root} is corrupt (content hashes to "
                             f"sha256:{h.hexdigest()})")

    def exists(self, digest: str) -> bool:
        return self.path(digest).exists()

    def temp_path(self, suffix: str = "") -> Path:
        """A fresh path in the store's file system, for a blob being written,
        named by its writer (writer_tag) so that sweep_tmp can tell a write
        whose process died on this host from one still going."""
        return self.tmp / f"{writer_tag()}{uuid.uuid4().hex}{suffix}"

    def ingest_layer(self, tmp_file: Path, hold: Callable[[str], None] | None = None,
                     chunks: ChunkHasher | None = None) -> tuple[str, bool, str]:
        """ingest() for a layer: also stores its chunk index, written before the
        layer itself. (digest, newly_added, index digest); `hold` as for
        ingest(); `chunks`: the index's hashes made while the file was written."""
        try:
            digest, index = digest_and_index(tmp_file, chunks)
        except OSError as err:
            tmp_file.unlink(missing_ok=True)
            raise StoreError("io", f"read layer {tmp_file}: {err.strerror}") from err
        try:
            index_digest = self.put_bytes(index, hold)
        except BaseException:
            tmp_file.unlink(missing_ok=True)
            raise
        return (*self.ingest(tmp_file, hold, digest), index_digest)

    def ingest(self, tmp_file: Path, hold: Callable[[str], None] | None = None,
               digest: str | None = None) -> tuple[str, bool]:
        """Move a finished temp file in under its digest: (digest, newly_added).

        The file must be in self.tmp (same file system, so rename is atomic).
        `hold(digest)` runs once the digest is known and before the blob is
        looked up or published: a builder pins it there against collection
        (ImageStore.gc), so a blob found present is still present after.
        `digest`: already computed by the caller from the same file."""
        try:
            digest = digest or file_digest(tmp_file)
            if hold is not None:
                hold(digest)
            final = self.path(digest)
            # Same digest, same bytes: keep the one in place. Unless its size
            # shows it was damaged (truncated): then the fresh copy replaces it.
            if final.exists() and final.stat().st_size == tmp_file.stat().st_size:
                tmp_file.unlink()
                return digest, False
            with open(tmp_file, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(tmp_file, 0o444)
            os.rename(tmp_file, final)
            return digest, True
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp_file.unlink(missing_ok=True)
            raise StoreError("io", f"store blob {tmp_file}: {err.strerror}; "
                             f"{unreachable_hint(self.root)}") from err

    def put_bytes(self, data: bytes, hold: Callable[[str], None] | None = None) -> str:
        tmp = self.temp_path()
        try:
            tmp.write_bytes(data)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise StoreError("io", f"store blob {tmp}: {err.strerror}; {unreachable_hint(self.root)}") from err
        return self.ingest(tmp, hold, "sha256:" + hashlib.sha256(data).hexdigest())[0]

    def read_bytes(self, digest: str) -> bytes:
        try:
            data = self.path(digest).read_bytes()
        except FileNotFoundError:
            raise StoreError("not_found", f"blob {digest} is missing from the store {self.root}") from None
        except OSError as err:
            raise StoreError("io", f"read blob {digest}: {err.strerror}; {unreachable_hint(self.root)}") from err
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise StoreError("io", f"blob {digest} in {self.root} is corrupt (its content does not match)")
        return data

    def verify(self, digest: str) -> None:
        try:
            actual = file_digest(self.path(digest))
        except FileNotFoundError:
            raise StoreError("not_found", f"blob {digest} is missing from the store {self.root}") from None
        if actual != digest:
            raise StoreError("io", f"blob {digest} in {self.root} is corrupt (content hashes to {actual})")

    def size(self, digest: str) -> int:
        return self.path(digest).stat().st_size

    def all_digests(self) -> set[str]:
        return {"sha256:" + e.name for e in os.scandir(self.blobs) if len(e.name) == 64}

    def remove(self, digest: str) -> int:
        p = self.path(digest)
        try:
            size = p.stat().st_size
            p.unlink()
            return size
        except FileNotFoundError:
            return 0

    def sweep_tmp(self, older_than_s: float = 3600) -> list[str]:
        """Remove the temp files of writes that died (a daemon killed in a
        pull, build or snapshot): at once those of a process of this host
        that no longer runs, others (another host's, or unnamed) once they
        were not written to for `older_than_s`. Returns the names removed."""
        now = time.time()
        removed = []
        for e in os.scandir(self.tmp):
            try:
                if _writer_gone(e.name) or now - e.stat(follow_symlinks=False).st_mtime > older_than_s:
                    shutil.rmtree(e.path) if e.is_dir(follow_symlinks=False) else os.unlink(e.path)
                    removed.append(e.name)
            except OSError:
                continue
        return removed


# A temp file's name starts with its writer's pid, start time and boot:
# "<pid>-<start>-<boot hash>-", then a uuid. The boot is the kernel's boot
# id, random at every boot of every machine, so no two hosts on a shared
# store take each other's files for their own (hostnames can be the same,
# and so can the machine ids of cloned VMs), with the writer's pid
# namespace: two daemons of one kernel in two pid namespaces (two pods of
# one node) see each other's pids as other processes, or as none. A pid
# is only looked up in the /proc of the boot and namespace that wrote it.
_WRITER_RE = re.compile(r"^(\d+)-(\d+)-([0-9a-f]{12})-")


@functools.cache
def _host_hash() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        boot += " " + os.readlink("/proc/self/ns/pid")
    except OSError:
        boot = ""
    if not boot:            # no procfs: a boot of no other host is known for sure, so none is claimed
        return "0" * 12
    return hashlib.sha256(boot.encode()).hexdigest()[:12]


def writer_tag() -> str:
    """The prefix of this process's temp files ("" when its start time
    cannot be read: such files are swept by age only)."""
    pid = os.getpid()
    start = process_start_time(pid)
    return f"{pid}-{start}-{_host_hash()}-" if start is not None and _host_hash() != "0" * 12 else ""


def _writer_gone(name: str) -> bool:
    """Whether `name` was written in this boot of this host by a process
    that no longer runs (its pid gone, or another program's: the start time
    differs)."""
    m = _WRITER_RE.match(name)
    return bool(m) and m[3] == _host_hash() and process_start_time(int(m[1])) != m[2]
