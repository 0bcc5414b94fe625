"""Layer mounts: each EROFS layer mounted once per host, shared by every sandbox.

A layer in use is mounted read-only at <state>/layers/<hex> straight from
its blob file (a file-backed EROFS mount), so the page cache of its files is
shared by all sandboxes stacking it as an overlay lowerdir. Mounts are
reference counted by sandbox; an unused one is unmounted after a grace
period (a burst of creates on the same image keeps it mounted). After a
daemon restart, mounts still present are reused and re-counted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from .. import native

log = logging.getLogger(__name__)


def distinct_layers(layers: list[str]) -> list[str]:
    """An image's layers (bottom first) with a layer the image repeats (older
    images repeat an empty one) kept only at its topmost place. The lower
    copy changes nothing: every path it holds, and every whiteout, the upper
    copy holds too, above whatever lay between them."""
    seen: set[str] = set()
    out = []
    for d in reversed(layers):
        if d not in seen:
            seen.add(d)
            out.append(d)
    out.reverse()
    return out


def overlay_lowerdirs(mounts: list[str]) -> list[str]:
    """An image's layer mounts (bottom first) as overlay's lowerdir list: top
    first, each dir once (overlayfs refuses a directory given twice: ELOOP)."""
    return distinct_layers(mounts)[::-1]


class LayerMounts:
    def __init__(self, mount_root: Path, source, grace_s: float = 60.0):
        self.root = Path(mount_root)
        self.root.mkdir(parents=True, exist_ok=True)
        # digest -> the file to mount: the store blob (direct), its pager file
        # (lazy) or a local copy (eager); may block (the eager copy). Called
        # with the lock held: one source at a time.
        self.source = source
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._refs: dict[str, int] = {}
        self._idle_since: dict[str, float] = {}
        # Counted in _refs but not mounted here (readopt): acquire() mounts them.
        self._unmounted: set[str] = set()

    def _dir(self, digest: str) -> Path:
        return self.root / digest.split(":", 1)[1]

    def is_mounted(self, digest: str) -> bool:
        d = self._dir(digest)
        return d.is_dir() and os.path.ismount(d)

    def acquire(self, digests: list[str]) -> list[str]:
        """Mount what is not mounted yet; return the mount dirs, same order."""
        out = []
        done: list[str] = []
        try:
            with self._lock:
                for digest in digests:
                    d = self._dir(digest)
                    if not self.is_mounted(digest):
                        d.mkdir(exist_ok=True)
                        native.mount_erofs(str(self.source(digest)), str(d))
                    self._unmounted.discard(digest)
                    self._refs[digest] = self._refs.get(digest, 0) + 1
                    self._idle_since.pop(digest, None)
                    done.append(digest)
                    out.append(str(d))
        except BaseException:
            self.release(done)
            raise
        return out

    def acquire_mounted(self, digests: list[str]) -> list[str] | None:
        """acquire() without any syscall when every layer is mounted already (the
        common case: a burst on one image), so the caller can skip a worker-thread
        hop; None when something must be mounted first."""
        with self._lock:
            if not all(self._refs.get(d) and d not in self._unmounted for d in digests):
                return None
            for d in digests:
                self._refs[d] += 1
            return [str(self._dir(d)) for d in digests]

    def release(self, digests: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for digest in digests:
                n = self._refs.get(digest, 0) - 1
                if n > 0:
                    self._refs[digest] = n
                else:
                    self._refs.pop(digest, None)
                    self._idle_since[digest] = now

    def readopt(self, digests: list[str]) -> None:
        """Count the layers of a re-adopted sandbox. The sandbox holds the
        mounts an earlier daemon made, but that daemon may have run in
        another mount namespace (systemd gives the unit a new one at every
        start): a layer not mounted here is left to the next create that
        needs it (acquire() mounts it then), so that a start does not mount,
        nor in direct mode hash, every layer in use."""
        with self._lock:
            for digest in digests:
                self._refs[digest] = self._refs.get(digest, 0) + 1
                if not self.is_mounted(digest):
                    self._unmounted.add(digest)

    def sweep(self, force: bool = False) -> list[str]:
        """Unmount layers idle for longer than the grace period (all idle ones if force)."""
        now = time.monotonic()
        removed = []
        with self._lock:
            mounted = {"sha256:" + e.name for e in os.scandir(self.root) if e.is_dir()}
            for digest in mounted:
                if self._refs.get(digest):
                    continue
                since = self._idle_since.setdefault(digest, now)
                if not force and now - since < self.grace_s:
                    continue
                d = self._dir(digest)
                try:
                    if os.path.ismount(d):
                        native.umount(str(d))
                    os.rmdir(d)
                    removed.append(digest)
                    self._idle_since.pop(digest, None)
                except OSError as err:
                    log.warning("unmount idle layer %s: %s", digest, err)
        return removed

    def remount_all(self) -> list[str]:
        """After the pager restarted, every layer mount sits on a dead FUSE file.

        Each is detached (sandboxes using it keep the old superblock, and see EIO
        on pages that were never cached) and mounted afresh at the same path, so
        new sandboxes get a working layer. Returns the digests remounted."""
        done = []
        with self._lock:
            for e in os.scandir(self.root):
                digest = "sha256:" + e.name
                if not os.path.ismount(e.path):
                    continue
                try:
                    native.umount(e.path, detach=True)
                    native.mount_erofs(str(self.source(digest)), e.path)
                    done.append(digest)
                except OSError as err:
                    log.error("remount layer %s after a pager restart: %s", digest, err)
        return done

    def in_use(self) -> dict[str, int]:
        with self._lock:
            return dict(self._refs)

    def held_locked(self) -> set[str]:
        """The layers counted or mounted (or being mounted): their source
        files must stay. Only for `source`, which runs with the lock held."""
        return set(self._refs) | {"sha256:" + e.name for e in os.scandir(self.root) if e.is_dir()}
