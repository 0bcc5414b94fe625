"""The blob store: a directory of content-addressed files.

    <root>/blobs/sha256/<hex>     immutable blobs (EROFS layers, manifests)
    <root>/tmp/                   writes in progress

By default the root is on local disk; in production it is a mount of a
distributed file system shared by every host, so a layer built on one host is
usable on all of them. A blob appears under its digest only by rename(2) of a
complete, fsync'ed temp file in the same file system, so readers never see a
partial blob, and two builders of the same layer both end with one intact
copy (the second rename replaces identical bytes, or is skipped).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
CHUNK = 1 << 20


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


class BlobStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.blobs = self.root / "blobs" / "sha256"
        self.tmp = self.root / "tmp"
        for d in (self.blobs, self.tmp):
            d.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.blobs / check_digest(digest).split(":", 1)[1]

    def copy_out(self, digest: str, dst: Path, bandwidth_bps: int = 0, latency_us: int = 0) -> None:
        """Copy a blob to a local file (images.mode = eager).

        bandwidth_bps/latency_us throttle the copy like dsec-pager throttles
        its fetches ([pager] keys, benches emulating a remote store): one
        latency for the whole stream, then the bytes at the link's rate. Without
        it an eager copy from a local store would race a throttled pager."""
        start = time.monotonic() + latency_us / 1e6
        sent = 0
        try:
            with open(self.path(digest), "rb") as src, open(dst, "wb") as out:
                while piece := src.read(4 * CHUNK):
                    out.write(piece)
                    sent += len(piece)
                    if bandwidth_bps:
                        time.sleep(max(0.0, start + sent / bandwidth_bps - time.monotonic()))
        except OSError as err:
            raise StoreError("io", f"copy blob {digest} to {dst}: {err.strerror}") from err

    def exists(self, digest: str) -> bool:
        return self.path(digest).exists()

    def temp_path(self, suffix: str = "") -> Path:
        """A fresh path in the store's file system, for a blob being written."""
        return self.tmp / f"{uuid.uuid4().hex}{suffix}"

    def ingest(self, tmp_file: Path, hold: Callable[[str], None] | None = None) -> tuple[str, bool]:
        """Move a finished temp file in under its digest: (digest, newly_added).

        The file must be in self.tmp (same file system, so rename is atomic).
        `hold(digest)` runs once the digest is known and before the blob is
        looked up or published: a builder pins it there against collection
        (ImageStore.gc), so a blob found present is still present after."""
        try:
            digest = file_digest(tmp_file)
            if hold is not None:
                hold(digest)
            final = self.path(digest)
            if final.exists():
                tmp_file.unlink()
                return digest, False
            with open(tmp_file, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(tmp_file, 0o444)
            os.rename(tmp_file, final)
            return digest, True
        except OSError as err:
            tmp_file.unlink(missing_ok=True)
            raise StoreError("io", f"store blob {tmp_file}: {err.strerror}") from err

    def put_bytes(self, data: bytes, hold: Callable[[str], None] | None = None) -> str:
        tmp = self.temp_path()
        tmp.write_bytes(data)
        return self.ingest(tmp, hold)[0]

    def read_bytes(self, digest: str) -> bytes:
        try:
            data = self.path(digest).read_bytes()
        except FileNotFoundError:
            raise StoreError("not_found", f"blob {digest} is missing from the store {self.root}") from None
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

    def sweep_tmp(self, older_than_s: float = 3600) -> None:
        """Remove temp files of builds that died (a crash mid-build)."""
        import time

        now = time.time()
        for e in os.scandir(self.tmp):
            try:
                if now - e.stat(follow_symlinks=False).st_mtime > older_than_s:
                    shutil.rmtree(e.path) if e.is_dir(follow_symlinks=False) else os.unlink(e.path)
            except OSError:
                continue
