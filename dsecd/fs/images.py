"""Directory images: a named, immutable copy of a root file system on local disk.

This is the first image kind (the EROFS layer store replaces it in the images
issue). `import_dir` copies a directory tree into the store - symlinks kept as
links, special files other than directories, regular files and symlinks
skipped and counted - then publishes a manifest by atomic rename, so a
half-copied image is never visible. Sandboxes use the copy as their overlay
lowerdir, read-only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}$")


class ImageError(Exception):
    """code: 'bad_request' | 'not_found' | 'conflict' | 'io'"""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Image:
    name: str
    kind: str
    rootfs: str
    created: float
    files: int
    bytes: int
    skipped: int

    def to_dict(self) -> dict:
        return asdict(self)


Progress = Callable[[dict], None]


class ImageStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.blobs = self.root / "dirs"
        self.manifests = self.root / "manifests"
        for d in (self.blobs, self.manifests):
            d.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def check_name(name: str) -> None:
        if not NAME_RE.match(name):
            raise ImageError("bad_request", f"bad image name {name!r}: use 1-128 of [A-Za-z0-9._-], "
                             "starting with a letter or digit")

    def _manifest(self, name: str) -> Path:
        self.check_name(name)
        return self.manifests / f"{name}.json"

    def get(self, name: str) -> Image:
        try:
            with open(self._manifest(name)) as f:
                return Image(**json.load(f))
        except FileNotFoundError:
            raise ImageError("not_found", f"no image named {name!r} (see `dsec image ls`)") from None

    def list(self) -> list[Image]:
        out = []
        for entry in sorted(os.scandir(self.manifests), key=lambda e: e.name):
            if entry.name.endswith(".json"):
                with open(entry.path) as f:
                    out.append(Image(**json.load(f)))
        return out

    def import_dir(self, src: str, name: str, progress: Progress | None = None) -> Image:
        """Copy `src` into the store as image `name` (blocking: run it in a thread)."""
        self.check_name(name)
        if self._manifest(name).exists():
            raise ImageError("conflict", f"image {name!r} exists; remove it first (`dsec image rm {name}`)")
        srcp = Path(src)
        if not srcp.is_absolute():
            raise ImageError("bad_request", f"image source must be an absolute path, got {src!r}")
        if not srcp.is_dir():
            raise ImageError("not_found", f"image source {src!r} is not a directory")
        dest = self.blobs / f"{name}-{uuid.uuid4().hex[:8]}"
        try:
            counts = _copy_tree(srcp, dest, progress)
        except OSError as err:
            shutil.rmtree(dest, ignore_errors=True)
            raise ImageError("io", f"copy {err.filename or src}: {err.strerror}") from err
        image = Image(name=name, kind="dir", rootfs=str(dest), created=time.time(), **counts)
        tmp = self.manifests / f".{name}.json.tmp"
        tmp.write_text(json.dumps(image.to_dict()))
        try:
            os.link(tmp, self._manifest(name))     # fails if a concurrent import won
        except FileExistsError:
            shutil.rmtree(dest, ignore_errors=True)
            raise ImageError("conflict", f"image {name!r} was imported concurrently") from None
        finally:
            tmp.unlink(missing_ok=True)
        return image

    def remove(self, name: str) -> Image:
        image = self.get(name)
        self._manifest(name).unlink()
        shutil.rmtree(image.rootfs, ignore_errors=True)
        return image


def _copy_tree(src: Path, dest: Path, progress: Progress | None) -> dict:
    """Copy keeping modes, owners, times and symlinks; skip devices, fifos, sockets."""
    files = nbytes = skipped = 0
    last = time.monotonic()
    os.makedirs(dest)
    shutil.copystat(src, dest)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target_dir = dest / rel if rel != "." else dest
        for d in dirnames:
            s, t = os.path.join(dirpath, d), target_dir / d
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), t)
                continue
            os.mkdir(t, stat.S_IMODE(st.st_mode))
            os.chown(t, st.st_uid, st.st_gid)
        for fname in filenames:
            s, t = os.path.join(dirpath, fname), target_dir / fname
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), t)
                os.chown(t, st.st_uid, st.st_gid, follow_symlinks=False)
            elif stat.S_ISREG(st.st_mode):
                shutil.copy2(s, t)
                os.chown(t, st.st_uid, st.st_gid)
                nbytes += st.st_size
            else:
                skipped += 1
                continue
            files += 1
            if progress and time.monotonic() - last > 0.25:
                last = time.monotonic()
                progress({"files": files, "bytes": nbytes})
        # Directory modes and times last, after their contents were written.
    for dirpath, dirnames, _ in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        for d in dirnames:
            s = os.path.join(dirpath, d)
            if not os.path.islink(s):
                shutil.copystat(s, dest / rel / d)
    if progress:
        progress({"files": files, "bytes": nbytes})
    return {"files": files, "bytes": nbytes, "skipped": skipped}
