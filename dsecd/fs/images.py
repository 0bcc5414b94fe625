"""Images: ordered EROFS layers in the blob store, a manifest, and a name.

    manifest (a blob, canonical JSON):
        {"schema": 1, "layers": [{"digest": "sha256:..", "size": n, "index": "sha256:.."}, ...],
         (bottom first; "index": the layer's chunk index blob, store.py; absent in old images)
         "config": {"env", "cwd", "user", "entrypoint", "cmd", "exposed_ports", "labels"}}
         (dsecd/imageconfig.py; configs stored by older daemons are read through its normalise)
    name  -> <store>/refs/<name>: {"manifest": "sha256:..", "created": t}

Names live in the store too, so every host sharing the store sees an image
built on any of them. A build writes its layer and manifest blobs first and
publishes the name last (atomic rename), so a failed or interrupted build
never leaves a half-built image visible under a name.

Everything here blocks (mkfs, hashing, copying): call it from a worker thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .. import imageconfig
from . import erofs, oci
from .store import BlobStore, StoreError, check_digest

NAME_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}$")
Progress = Callable[[dict], None]


class ImageError(Exception):
    """code: one of the protocol error codes."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Image:
    name: str
    manifest: str
    layers: list[dict]
    config: dict
    created: float
    size: int = 0
    parent: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def layer_digests(self) -> list[str]:
        return [layer["digest"] for layer in self.layers]

    def to_dict(self) -> dict:
        return {"name": self.name, "manifest": self.manifest, "layers": self.layers,
                "config": self.config, "created": self.created, "bytes": self.size,
                "parent": self.parent, "kind": "erofs", **self.extra}


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class ImageStore:
    def __init__(self, store_root: Path, scratch: Path):
        self.store = BlobStore(store_root)
        self.refs = Path(store_root) / "refs"
        self.refs.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(scratch)      # local disk, for unpacking tarballs
        self.scratch.mkdir(parents=True, exist_ok=True)
        # digest -> parsed manifest. Content-addressed, so never stale: every
        # create resolves its image, and need not re-read and re-hash the blob.
        self._manifests: dict[str, dict] = {}
        self._indexes: dict[str, str] = {}      # layer digest -> its chunk index digest
        # name -> ((inode, mtime ns, size) of its ref file, parsed ref). A ref is
        # replaced by rename (a new inode), possibly by another daemon on the
        # same store: a stat tells whether the parsed copy is still current,
        # instead of an open, read and JSON parse on every create.
        self._refs: dict[str, tuple[tuple[int, int, int], dict]] = {}
        # Blobs a build in progress has written or relies on but no name
        # reaches yet: gc keeps them. One lock orders pins against a whole gc
        # pass (found by fuzzing: image_build beside image_gc lost its fresh
        # layer or manifest and answered `internal` or `not_found`). Pins are
        # per daemon: hosts sharing a store must not run gc concurrently with
        # builds elsewhere (a store-level lease is future work).
        self._gc_lock = threading.Lock()
        self._pins: Counter[str] = Counter()

    # ------------------------------------------------------------ names

    @staticmethod
    def check_name(name: str) -> None:
        if not NAME_RE.match(name):
            raise ImageError("bad_request", f"bad image name {name!r}: use 1-128 of [A-Za-z0-9._-], "
                             "starting with a letter or digit")

    def _ref(self, name: str) -> Path:
        self.check_name(name)
        return self.refs / name

    def get(self, name: str) -> Image:
        try:
            ref = self._read_ref(name)
        except FileNotFoundError:
            raise ImageError("not_found", f"no image named {name!r} (see `dsec image ls`)") from None
        manifest = self._manifest(ref["manifest"])
        size = sum(layer["size"] for layer in manifest["layers"])
        return Image(name=name, manifest=ref["manifest"], layers=manifest["layers"],
                     config=manifest["config"], created=ref["created"], size=size,
                     parent=ref.get("parent"))

    def _read_ref(self, name: str) -> dict:
        path = self._ref(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._refs.pop(name, None)      # removed, here or by another host's daemon
            raise
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._refs.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        ref = json.loads(path.read_text())
        self._refs[name] = (key, ref)
        return ref

    def get_manifest(self, digest: str, name: str = "") -> Image:
        """The image a manifest digest describes, whatever names point at it now."""
        manifest = self._manifest(digest)
        return Image(name=name, manifest=digest, layers=manifest["layers"], config=manifest["config"],
                     created=0.0, size=sum(layer["size"] for layer in manifest["layers"]))

    def _manifest(self, digest: str) -> dict:
        cached = self._manifests.get(digest)
        if cached is not None:
            return cached
        try:
            manifest = json.loads(self.store.read_bytes(digest))
        except StoreError as err:
            raise ImageError(err.code, str(err)) from err
        # Read in today's form whatever dsecd version wrote it (the cached copy
        # only: the blob is never rewritten, its digest is its name).
        manifest["config"] = imageconfig.normalise(manifest.get("config"))
        self._manifests[digest] = manifest
        for layer in manifest.get("layers", []):
            if layer.get("index"):
                self._indexes[layer["digest"]] = layer["index"]
        return manifest

    def layer_index(self, layer_digest: str) -> str | None:
        """The chunk index digest of a layer of any manifest read so far (a create
        reads its image's manifest before it mounts the layers); None: it has none."""
        return self._indexes.get(layer_digest)

    @staticmethod
    def _blobs_of(manifest: dict) -> set[str]:
        """Every blob a manifest needs: its layers and their chunk indexes."""
        return {d for layer in manifest["layers"] for d in (layer["digest"], layer.get("index")) if d}

    def list(self) -> list[Image]:
        out = []
        for entry in sorted(os.scandir(self.refs), key=lambda e: e.name):
            if NAME_RE.match(entry.name):
                try:
                    out.append(self.get(entry.name))
                except ImageError:
                    continue     # a name whose manifest is gone: shown by `gc`, not here
        return out

    def _publish(self, name: str, manifest_digest: str, parent: str | None) -> None:
        tmp = self.store.temp_path(".ref")
        tmp.write_text(json.dumps({"manifest": manifest_digest, "created": time.time(), "parent": parent}))
        try:
            os.link(tmp, self._ref(name))      # fails if the name exists: no silent overwrite
        except FileExistsError:
            raise ImageError("conflict", f"image {name!r} exists; remove it first (`dsec image rm {name}`)") from None
        finally:
            tmp.unlink(missing_ok=True)

    def remove(self, name: str) -> Image:
        image = self.get(name)
        try:
            self._ref(name).unlink()
        except FileNotFoundError:     # a concurrent rm of the same name won
            raise ImageError("not_found", f"no image named {name!r} (removed meanwhile)") from None
        finally:
            self._refs.pop(name, None)
        return image

    # ------------------------------------------------------------ building

    @contextlib.contextmanager
    def _pinning(self) -> Iterator[Callable[[str], None]]:
        """A build's pins: `hold(digest)` keeps a blob from gc until the build
        ends (by then its name is published, or it failed)."""
        held: list[str] = []

        def hold(digest: str) -> None:
            with self._gc_lock:
                self._pins[digest] += 1
            held.append(digest)

        try:
            yield hold
        finally:
            with self._gc_lock:
                self._pins.subtract(held)
                for digest in held:
                    if self._pins[digest] <= 0:
                        del self._pins[digest]

    def _hold_existing(self, hold: Callable[[str], None], layers: list[dict]) -> None:
        """Pin the layers a build stacks on (its parent's); one collected
        before the pin (the parent removed meanwhile) is `not_found`."""
        for layer in layers:
            hold(layer["digest"])
            if not self.store.exists(layer["digest"]):
                raise ImageError("not_found", f"layer {layer['digest']} of the parent image was removed "
                                 "from the store meanwhile (image_rm + image_gc); build the parent again")

    def build_layer(self, src: Path, exclude: list[str] = (), progress: Progress | None = None,
                    hold: Callable[[str], None] | None = None) -> dict:
        """One EROFS layer from a directory tree, stored by digest (and pinned
        with `hold` until the caller's build is published)."""
        if progress:
            progress({"step": "mkfs.erofs", "source": str(src)})
        tmp = self.store.temp_path(".erofs")
        try:
            erofs.build(src, tmp, exclude)
            size = tmp.stat().st_size      # of the temp file: the blob may be shared (and collected) later
        except erofs.ErofsError as err:
            tmp.unlink(missing_ok=True)
            raise ImageError(err.code, str(err)) from err
        try:
            digest, added, index = self.store.ingest_layer(tmp, hold)
        except StoreError as err:
            raise ImageError(err.code, str(err)) from err
        if progress:
            progress({"step": "layer", "digest": digest, "bytes": size, "new": added})
        return {"digest": digest, "size": size, "index": index}

    def _commit(self, name: str, layers: list[dict], config: dict, parent: str | None,
                hold: Callable[[str], None]) -> Image:
        manifest = {"schema": 1, "layers": layers, "config": imageconfig.normalise(config)}
        digest = self.store.put_bytes(_canonical(manifest), hold)
        self._publish(name, digest, parent)
        return self.get(name)

    def build_from_dir(self, src: str, name: str, parent: str | None = None,
                       config: dict | None = None, progress: Progress | None = None) -> Image:
        """Image `name` from `src`: a root file system (a directory or a
        tarball: one layer), or a docker save or OCI layout (a tarball or its
        unpacked directory: one layer per image layer, and its config), on
        top of `parent`'s layers. `config`: fields that override the config
        (imageconfig.overrides), which is else the archive's own, or the
        parent's for a root file system."""
        self.check_name(name)
        if self._ref(name).exists():
            raise ImageError("conflict", f"image {name!r} exists; remove it first (`dsec image rm {name}`)")
        path = Path(src)
        if not path.is_absolute():
            raise ImageError("bad_request", f"build source must be an absolute path, got {src!r}")
        base = self.get(parent) if parent else None
        with self._pinning() as hold:
            if base:
                self._hold_existing(hold, base.layers)
            if path.is_dir():
                unpacked = self._unpacked_layers(oci.unpack_dir, path, f"directory {path}", progress, hold)
                if unpacked is None:         # a root file system: the directory is the layer
                    unpacked = [self.build_layer(path, progress=progress, hold=hold)], None
            elif path.is_file():
                unpacked = self._unpacked_layers(oci.unpack_image, path, f"image tarball {path}", progress, hold)
            else:
                raise ImageError("not_found", f"build source {src!r} is neither a directory nor a file")
            layers, own_config = unpacked
            below = own_config if own_config is not None else (base.config if base else imageconfig.default())
            all_layers = (base.layers if base else []) + layers
            return self._commit(name, all_layers, imageconfig.stack(below, config or {}), parent, hold)

    def _unpacked_layers(self, unpack, path: Path, what: str, progress: Progress | None,
                         hold: Callable[[str], None]) -> tuple[list[dict], dict | None] | None:
        """(one EROFS layer per layer of the archive at `path`, its config or
        None for a root file system tarball), by `unpack` (oci.unpack_image or
        oci.unpack_dir) in a scratch directory; None: `unpack` found a root
        file system directory, to be built as it is."""
        work = Path(tempfile.mkdtemp(prefix="unpack-", dir=self.scratch))
        try:
            try:
                unpacked = unpack(path, work, progress)
            except oci.TarError as err:
                raise ImageError("bad_request", f"{what}: {err}") from err
            if unpacked is None:
                return None
            dirs, config = unpacked
            return [self.build_layer(d, progress=progress, hold=hold) for d in dirs], config
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def snapshot(self, upper: Path, base: Image, name: str, exclude: list[str],
                 progress: Progress | None = None, max_bytes: int = 0) -> Image:
        """pack_diff: the sandbox's upper dir as a new top layer over `base`.
        `max_bytes` (0 = none) bounds the files' apparent size, checked first."""
        self.check_name(name)
        if self._ref(name).exists():
            raise ImageError("conflict", f"image {name!r} exists; remove it first (`dsec image rm {name}`)")
        if max_bytes:
            check_apparent_size(upper, exclude, max_bytes)
        with self._pinning() as hold:
            self._hold_existing(hold, base.layers)
            layer = self.build_layer(upper, exclude=exclude, progress=progress, hold=hold)
            return self._commit(name, base.layers + [layer], base.config, base.name, hold)

    # ------------------------------------------------------------ accounting

    def referenced(self) -> tuple[set[str], set[str]]:
        """(manifest digests, layer and chunk index digests) reachable from names."""
        manifests, layers = set(), set()
        for entry in os.scandir(self.refs):
            if not NAME_RE.match(entry.name):
                continue
            try:
                digest = self._read_ref(entry.name)["manifest"]
                manifests.add(digest)
                layers.update(self._blobs_of(self._manifest(digest)))
            except (OSError, ValueError, KeyError, ImageError):
                continue
        return manifests, layers

    def gc(self, in_use_layers: set[str], in_use_manifests: set[str]) -> dict:
        """Remove blobs no name, no live sandbox of this host and no build in
        progress uses. The whole pass holds the pin lock: a build pins a blob
        either before it (kept) or after it (and then finds it gone and stores
        it again), and unpins only after its name is published."""
        with self._gc_lock:
            manifests, layers = self.referenced()
            keep = manifests | layers | in_use_layers | in_use_manifests | set(self._pins)
            for m in in_use_manifests:
                try:
                    keep.update(self._blobs_of(self._manifest(m)))
                except ImageError:
                    pass
            removed, freed = [], 0
            for digest in sorted(self.store.all_digests() - keep):
                freed += self.store.remove(digest)
                self._manifests.pop(digest, None)
                removed.append(digest)
        self.store.sweep_tmp()
        return {"removed": removed, "freed_bytes": freed}

    def du(self) -> dict:
        manifests, layers = self.referenced()
        total = shared = 0
        counts: dict[str, int] = {}
        for image in self.list():
            for digest in image.layer_digests:
                counts[digest] = counts.get(digest, 0) + 1
        sizes = {}
        for d in self.store.all_digests():
            try:
                sizes[d] = self.store.size(d)
            except FileNotFoundError:     # collected by a gc since the listing
                continue
        total = sum(sizes.values())
        shared = sum(sizes.get(d, 0) for d, n in counts.items() if n > 1)
        unreferenced = sum(s for d, s in sizes.items() if d not in manifests | layers)
        return {"blobs": len(sizes), "bytes": total, "shared_layer_bytes": shared,
                "unreferenced_bytes": unreferenced,
                "images": [{"name": i.name, "bytes": i.size, "layers": len(i.layers)} for i in self.list()]}


def check_apparent_size(top: Path, exclude: list[str], max_bytes: int) -> int:
    """Sum of st_size of the regular files under `top` (paths in `exclude`
    left out); `limit` past max_bytes. A sandbox makes a sparse file of any
    size for free (`truncate -s 1T`), but mkfs.erofs reads and stores every
    byte of it: measured, a 2 GiB sparse file became a 2 GiB blob in 20 s.
    Without this bound one snapshot could fill the blob store (shared by
    every host) and keep a worker thread busy for hours."""
    skip = {os.path.normpath(os.path.join(top, rel.strip("/"))) for rel in exclude}
    total = 0
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if path in skip:
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > max_bytes:
                    raise ImageError("limit", f"snapshot: the sandbox's changed files add up to more than "
                                     f"images.max_snapshot_bytes ({max_bytes} bytes; {path[len(str(top)):]} "
                                     f"alone is {st.st_size}); remove large or sparse files, or exclude them")
    return total


__all__ = ["Image", "ImageError", "ImageStore", "check_digest"]
