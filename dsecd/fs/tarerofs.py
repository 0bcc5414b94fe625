"""An OCI layer blob straight into an EROFS image, in one streaming pass.

The blob (gzip, zstd or plain tar) is read and hashed here, decompressed by
the same readers as oci.unpack_blob (zlib, python3-zstandard: both C), and
the tar's bytes go in 1 MiB chunks to csrc/tarerofs.c, which parses the tar
and writes the image: file data as it arrives, the metadata at the end.
No directory tree is made and no mkfs.erofs is run; the image reads as the
one oci.extract_blob + erofs.build give for the same layer (same names,
modes, owners, sizes, contents, links, devices, whiteouts, opaque
directories, times 0), tests/integration/test_layer_tarerofs.py compares them.

What the C writer does not serve (sparse files, PAX global headers) raises
Unserved: the caller converts that layer the old way (dsecd/fs/pull.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from .. import native
from . import oci
from .erofs import pad_to_pmem
from .store import ChunkHasher

FEED_CHUNK = 1 << 20
# Tar members a layer may have: the C writer holds every name and inode
# (~250 bytes each with malloc's overhead, plus the name, at most 255) and
# a directory's blocks while it writes them, so a hostile layer of tiny
# entries is refused before it costs the daemon ~0.3 GiB (~0.8 GiB with
# the longest names). A large distribution image has ~100,000 files in a layer.
MAX_ENTRIES = 1 << 20


class Unserved(Exception):
    """A layer the direct writer leaves to unpack-and-mkfs; the message says why."""


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022


def _check_blob_digest(blob, digest: str | None, what: str) -> None:
    """oci.DigestMismatch when `blob` (an oci._Hashing), read to its end, does
    not hash to `digest`; nothing when it does, or when its end cannot be
    read (the caller's error stands)."""
    if digest is None:
        return
    try:
        blob.drain()
    except Exception:  # noqa: BLE001 -- any failure to read on leaves the decompressor's error to report
        return
    oci.check_blob_digest(what, blob.digest(), digest)


def convert_blob(raw, out: Path, what: str, max_entries: int = MAX_ENTRIES,
                 digest: str | None = None, chunks: ChunkHasher | None = None,
                 max_bytes: int = 0) -> tuple[int, str, str]:
    """Write layer blob `raw` (a reader with read(size)) as the EROFS image
    `out` (a new file, padded for pmem like erofs.build's). Returns (tar
    members, the blob's digest, the uncompressed tar's digest); the caller
    checks them. TarError (its message starting with `what`) for bad
    content, Unserved for a layer to convert the old way; `out` is removed
    on any failure. With `digest` (the manifest's), a blob that fails to
    decompress is read to its end first, and one that is not that digest's
    bytes is said to be that: the cause, where the decompressor's error is
    its symptom. With `chunks`, the image's chunk-index hashes are made
    as its data is written (store.ChunkHasher). oci.LayerTooLarge when the
    uncompressed tar passes `max_bytes` (0: no bound): the writer serves no
    sparse member, so the tar's length bounds what the image holds."""
    umask = _umask()
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)    # read back by `chunks`
    ok = False
    try:
        # The old path's root is a mkdtemp directory (0700) and the
        # directories a tar implies are os.mkdir(0o755): both under the
        # umask, owned by this process, as are the whiteouts it mknod()s.
        writer = native.TarErofs(fd, 0o700 & ~umask, 0o755 & ~umask, os.geteuid(), os.getegid(), max_entries)
        try:
            blob = oci._Hashing(raw)
            tar = oci.tar_reader(blob, what)
            ended = False
            while not ended and (chunk := tar.read(FEED_CHUNK)):
                if max_bytes and tar.bytes > max_bytes:
                    raise oci.too_large(max_bytes, f"its tar passed {max_bytes} bytes")
                ended = writer.feed(chunk)
                if chunks is not None:
                    chunks.advance(fd, writer.final_bytes())
            tar.drain(max_bytes)     # past the archive's end: the diff_id covers every byte
            blob.drain()
            entries = writer.finish()
        except oci.LayerTooLarge as err:
            raise oci.LayerTooLarge(f"{what} {err}") from None
        except oci.CORRUPT as err:
            _check_blob_digest(blob, digest, what)
            raise oci.TarError(f"{what} is corrupt or truncated: {err}") from err
        except native.TarErofsError as err:
            if err.errno == errno.EINVAL:
                # Content the writer refuses may be other bytes than the
                # digest's (the registry's fault, not the image's): said so first.
                _check_blob_digest(blob, digest, what)
                raise oci.TarError(f"{what}: {err}") from None
            if err.errno == errno.EOPNOTSUPP:
                raise Unserved(f"{what}: {err}") from None
            raise OSError(err.errno, str(err)) from None
        finally:
            writer.close()
        pad_to_pmem(out)
        ok = True
        return entries, blob.digest(), tar.digest()
    finally:
        os.close(fd)
        if not ok:
            out.unlink(missing_ok=True)
