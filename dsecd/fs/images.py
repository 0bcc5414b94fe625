"""Images: ordered EROFS layers in the blob store, a manifest, and a name.

    manifest (a blob, canonical JSON):
        {"schema": 1, "layers": [{"digest": "sha256:..", "size": n, "index": "sha256:.."}, ...],
         (bottom first; "index": the layer's chunk index blob, store.py; absent in old images)
         "config": {"env", "cwd", "user", "entrypoint", "cmd", "exposed_ports", "labels"}}
         (dsecd/imageconfig.py; configs stored by older daemons are read through its normalise)
    name  -> its ref file under <store>/refs/ (names.py): {"manifest": "sha256:..", "created": t,
             "parent": name | null, "source": {"ref", "digest", "platform"} (pulled images)}
    layer of an OCI diff_id -> <store>/diffids/<hex>: {"digest", "size", "index"} (pull.py)
    build cache entries -> <store>/build-cache/ (dsecd/fs/buildcache.py)

Names live in the store too, so every host sharing the store sees an image
built on any of them. A build writes its layer and manifest blobs first and
publishes the name last (atomic rename), so a failed or interrupted build
never leaves a half-built image visible under a name.

Everything here blocks (mkfs, hashing, copying): call it from a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .. import imageconfig
from . import erofs, flatten, names, oci
from .buildcache import BuildCache
from .store import BlobStore, ChunkHasher, StoreError, check_digest, unreachable_hint, write_durable

log = logging.getLogger(__name__)

# Written by overlayfs (Linux >= 6.6) on the upper root of a new mount: a random id.
OVERLAY_UUID = "trusted.overlay.uuid"
Progress = Callable[[dict], None]


class ImageError(Exception):
    """code: one of the protocol error codes; detail: the error's detail."""

    def __init__(self, code: str, message: str, detail: dict | None = None):
        super().__init__(message)
        self.code = code
        self.detail = detail


@dataclass
class Image:
    name: str
    manifest: str
    layers: list[dict]
    config: dict
    created: float
    size: int = 0
    parent: str | None = None
    # The manifest `parent` named when this image was made: a name moves on
    # (a tag, a rebuild), and the walk up the chain (ImageStore.ancestors)
    # stops where it no longer names that image. None in refs written before.
    parent_manifest: str | None = None
    source: dict | None = None       # a pulled image's origin: ref, registry manifest digest, platform
    extra: dict = field(default_factory=dict)
    # Each layer's data (ImageStore.blob_bytes), in the order of `layers`;
    # `size` is their sum. Kept apart from `layers`, which go into manifests.
    layer_bytes: list[int] = field(default_factory=list)

    @property
    def layer_digests(self) -> list[str]:
        return [layer["digest"] for layer in self.layers]

    def to_dict(self) -> dict:
        layers = [{**layer, "bytes": n} for layer, n in zip(self.layers, self.layer_bytes, strict=True)] \
            if len(self.layer_bytes) == len(self.layers) else self.layers
        return {"name": self.name, "manifest": self.manifest, "layers": layers,
                "config": self.config, "created": self.created, "bytes": self.size,
                "parent": self.parent, "parent_manifest": self.parent_manifest, "source": self.source,
                "kind": "erofs", **self.extra}


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


# How many times a ref is read that answers ESTALE (a network file system:
# another host renamed a new ref over it) before it counts as unreadable.
STALE_READS = 3
# The scratch dir's work trees, which the next start removes if a killed
# daemon left them (_remove_scratch_leftovers): a tarball or layout
# unpacked, one dir per layer, a flatten's merged tree, and a host
# directory copied to be made an image (engine/images.py).
UNPACK_PREFIX = "unpack-"
# What a flatten leaves free on the scratch dir's file system for the state
# dir and other writers there (on one smaller than 20 GiB: 5% of it).
SCRATCH_RESERVE = 1 << 30
# What a flatten leaves free of the scratch dir's file system's inodes for
# the state dir and other writers there: as many as SCRATCH_RESERVE holds at
# ext4's default of an inode per 16 KiB (mke2fs.conf's inode_ratio); 5% of
# them on a smaller file system.
SCRATCH_INODE_RESERVE = SCRATCH_RESERVE // 16384
# The fewest bytes a name takes in an EROFS layer: a 12-byte dirent and its
# name's bytes (at least one) in an uncompressed directory, as both
# mkfs.erofs (fs/erofs.py) and csrc/tarerofs.c write them, so a layer of B
# bytes holds at most B // EROFS_NAME_BYTES names.
EROFS_NAME_BYTES = 13
# What an error of a full file system under the store or scratch dir
# suggests to free space on it.
FREE_SPACE = ("remove images no longer needed (`dsec image rm NAME`, then `dsec image gc`) if the image "
              "store is on it, or other files")


def _reserve(st: os.statvfs_result) -> int:
    """What a flatten leaves free of the bytes of a file system (statvfs)."""
    return min(SCRATCH_RESERVE, st.f_blocks * st.f_frsize // 20)


def _inode_reserve(st: os.statvfs_result) -> int:
    """What a flatten leaves free of the inodes of a file system (statvfs)."""
    return min(SCRATCH_INODE_RESERVE, st.f_files // 20)


@dataclass(frozen=True)
class _FlattenRoom:
    """The room a flatten has where it writes, each directory stat'ed once
    as it begins (read): the scratch dir for the merged tree, the store's
    temp dir (`layer_dir`) for the EROFS layer packed from it, on one file
    system (`shared`) by default. Bytes and inodes are what may still be
    taken there: the free ones less what stays free for the state dir and
    other writers (`*_reserve`). `inodes` is None on a file system with no
    fixed number of them (f_files 0: btrfs, a tmpfs without nr_inodes),
    which only its bytes bound."""

    scratch: Path
    layer_dir: Path
    shared: bool
    scratch_bytes: int
    scratch_reserve: int
    layer_bytes: int
    layer_reserve: int
    inodes: int | None
    inode_reserve: int

    @classmethod
    def read(cls, scratch: Path, layer_dir: Path) -> _FlattenRoom:
        shared = os.stat(scratch).st_dev == os.stat(layer_dir).st_dev
        st = os.statvfs(scratch)
        layer_st = st if shared else os.statvfs(layer_dir)
        return cls(scratch, layer_dir, shared,
                   st.f_bavail * st.f_frsize - _reserve(st), _reserve(st),
                   layer_st.f_bavail * layer_st.f_frsize - _reserve(layer_st), _reserve(layer_st),
                   st.f_favail - _inode_reserve(st) if st.f_files else None, _inode_reserve(st))

    def scratch_bytes_now(self) -> int:
        """The bytes the merge may still write in the scratch dir, read
        again before each file it copies (another writer may have taken
        them since the flatten began): the free ones less the reserve
        read then (a file system's size does not change under it)."""
        st = os.statvfs(self.scratch)
        return st.f_bavail * st.f_frsize - self.scratch_reserve


class ImageStore:
    """`default_registry`: where a reference without a registry lives (names.py)."""

    def __init__(self, store_root: Path, scratch: Path, default_registry: str = "docker.io"):
        self.store = BlobStore(store_root)
        self.refs = Path(store_root) / "refs"
        self.refs.mkdir(parents=True, exist_ok=True)
        self.diffids = Path(store_root) / "diffids"
        self.diffids.mkdir(parents=True, exist_ok=True)
        self.default_registry = default_registry
        self.scratch = Path(scratch)      # local disk, for unpacking tarballs
        self.scratch.mkdir(parents=True, exist_ok=True)
        self._remove_scratch_leftovers()
        # The most an imported layer (a docker save's, an OCI layout's, a
        # root file system tarball) may unpack to, as for a pulled one
        # (images.max_layer_bytes; 0: no bound).
        self.max_layer_bytes = 0
        # digest -> parsed manifest. Content-addressed, so never stale: every
        # create resolves its image, and need not re-read and re-hash the blob.
        self._manifests: dict[str, dict] = {}
        self._indexes: dict[str, str] = {}      # layer digest -> its chunk index digest
        self._bytes: dict[str, int] = {}        # blob digest -> blob_bytes (immutable, as the blob)
        # name -> ((inode, mtime ns, size) of its ref file, parsed ref). A ref is
        # replaced by rename (a new inode), possibly by another daemon on the
        # same store: a stat tells whether the parsed copy is still current,
        # instead of an open, read and JSON parse on every create.
        self._refs: dict[str, tuple[tuple[int, int, int], dict]] = {}
        # Called with a name's key (key()) once this daemon pointed it at
        # another manifest or removed it; from whichever thread did.
        self.changed: list = []
        # Blobs a build in progress has written or relies on but no name
        # reaches yet: gc keeps them. One lock orders pins against a whole gc
        # pass (found by fuzzing: image_build beside image_gc lost its fresh
        # layer or manifest and answered `internal` or `not_found`). Pins are
        # per daemon: hosts sharing a store must not run gc concurrently with
        # builds elsewhere (a store-level lease is future work).
        self._gc_lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self.build_cache = BuildCache(Path(store_root) / "build-cache", self.store.temp_path)

    # ------------------------------------------------------------ names

    def parse_name(self, name: str) -> names.ImageName:
        try:
            return names.parse(name, self.default_registry)
        except names.BadName as err:
            raise ImageError("bad_request", str(err)) from None

    def new_name(self, name: str) -> str:
        """canonical(name) for an image made here (a build, import or
        snapshot). A digest names what a registry serves under it, which an
        image made here is not: such a name is refused."""
        parsed = self.parse_name(name)
        if parsed.digest:
            raise ImageError("bad_request", f"image name {name!r} has a digest (@{parsed.digest}), which "
                             "names what a registry serves under it, not an image made here; give NAME "
                             "or NAME:TAG")
        return str(parsed)

    def canonical(self, name: str) -> str:
        """The one spelling of a name (`python:3.11` -> `docker.io/library/python:3.11`):
        what keys pools and call sandboxes, and what images are listed under."""
        return str(self.parse_name(name))

    def key(self, name: str) -> str:
        """canonical(name) for keying pools and call sandboxes, or `name` itself
        when it is no valid name (looking it up then says why)."""
        try:
            return self.canonical(name)
        except ImageError:
            return name

    def _ref(self, name: str) -> Path:
        return self.parse_name(name).ref_path(self.refs)

    def get(self, name: str, pull_hint: bool = True) -> Image:
        """The image a name stands for. A bare local name that no image has
        falls back to the reference it would be on the default registry
        (`python` -> docker.io/library/python:latest), the way `docker run
        python` finds what `docker pull python` stored. A name no image has
        is `not_found`, whose message points at `dsec image ls` and, with
        `pull_hint`, at `dsec image pull` where the name is one a pull takes."""
        parsed = self.parse_name(name)
        try:
            ref = self._read_ref(str(parsed))
        except FileNotFoundError:
            fallback = self._pulled_fallback(parsed)
            if fallback is None:
                raise ImageError("not_found", f"no image named {name!r} "
                                 f"({self._missing_hint(name, parsed, pull_hint)})") from None
            parsed, ref = fallback
        return self._image_of(str(parsed), ref)

    def _image_of(self, name: str, ref: dict) -> Image:
        """The image of `name` whose ref is `ref` (what its file holds)."""
        manifest = self._manifest(ref["manifest"])
        sizes = self._layer_sizes(manifest["layers"])
        return Image(name=name, manifest=ref["manifest"], layers=manifest["layers"],
                     config=manifest["config"], created=ref["created"], size=sum(sizes),
                     parent=ref.get("parent"), parent_manifest=ref.get("parent_manifest"),
                     source=ref.get("source"), layer_bytes=sizes)

    def blob_bytes(self, digest: str) -> int:
        """The bytes a blob holds: an EROFS layer's image as its superblock
        gives its length, without the zeros its file is padded with to a
        multiple of 2 MiB (erofs.pad_to_pmem: sparse, they take no disk and
        hold no data); any other blob's length. What image sizes, `image du`
        and `image gc` count. OSError: the blob cannot be read."""
        n = self._bytes.get(digest)
        if n is None:
            path = self.store.path(digest)
            n = erofs.data_size(path)
            if n is None:
                n = path.stat().st_size
            self._bytes[digest] = n
        return n

    def _layer_sizes(self, layers: list[dict]) -> list[int]:
        """blob_bytes of each layer; a blob that cannot be read now (a store
        that does not answer, a layer collected) counts as the manifest's
        `size` of it, its file's length: an image is still answered."""
        sizes = []
        for layer in layers:
            try:
                sizes.append(self.blob_bytes(layer["digest"]))
            except OSError:
                sizes.append(layer["size"])
        return sizes

    def _missing_hint(self, name: str, parsed: names.ImageName, pull_hint: bool) -> str:
        """Where to look for an image `name` (parsed) that is not here: the
        list, and a pull only of a name that is a registry reference (a
        bare local name is pulled as `name:latest`), never of a local name
        no registry could have (capitals, say)."""
        if not pull_hint:
            return "see `dsec image ls`"
        if parsed.local:
            try:
                names.parse(f"{name}:latest", self.default_registry)
            except names.BadName:
                return ("see `dsec image ls`; it is no registry reference (a repository is lowercase "
                        "[a-z0-9] words joined by '.', '_', '__' or '-'), so only `dsec image build` or "
                        "`dsec snapshot` makes an image of that name")
        return f"see `dsec image ls`; `dsec image pull {name}` fetches one from a registry"

    def _pulled_fallback(self, parsed: names.ImageName) -> tuple[names.ImageName, dict] | None:
        if not parsed.local:
            return None
        try:
            pulled = names.parse(f"{parsed.repository}:latest", self.default_registry)
        except names.BadName:          # a local name with capitals: never a reference
            return None
        try:
            return pulled, self._read_ref(str(pulled))
        except FileNotFoundError:
            return None

    def _read_ref(self, name: str) -> dict:
        """The ref of a canonical name (FileNotFoundError: none).

        A store that cannot be read (its servers gone: ENOTCONN, EIO, ...)
        still resolves a name this daemon has read before, to what it last
        read: sandboxes of images whose layers are mounted or cached can
        still be made through an outage. A name never read here is an `io`
        ImageError saying so."""
        path = self._ref(name)
        try:
            for attempt in range(STALE_READS):
                try:
                    st = os.stat(path)
                    key = (st.st_ino, st.st_mtime_ns, st.st_size)
                    cached = self._refs.get(name)
                    if cached is not None and cached[0] == key:
                        return cached[1]
                    ref = json.loads(path.read_text())
                    break
                except OSError as err:
                    # The ref was replaced (renamed over) by another host since
                    # this host's mount looked the name up: a new lookup finds it.
                    if err.errno != errno.ESTALE or attempt == STALE_READS - 1:
                        raise
        except FileNotFoundError:
            self._refs.pop(name, None)      # removed, here or by another host's daemon
            raise
        except (OSError, ValueError) as err:
            cached = self._refs.get(name)
            what = err.strerror if isinstance(err, OSError) else f"not JSON ({err})"
            if cached is not None and isinstance(err, OSError):
                log.warning("image %s: cannot read its ref %s (%s): using the copy read before", name,
                            path, what)
                return cached[1]
            if isinstance(err, ValueError):     # read, but not a ref: the store answers, the file is bad
                raise ImageError("io", f"image {name!r}: its ref {path} is damaged: {what}; remove the "
                                 f"name (`dsec image rm {name}`) and build or pull the image again") from err
            raise ImageError("io", f"image {name!r}: read its ref {path}: {what}; "
                             f"{unreachable_hint(self.store.root)}") from err
        self._refs[name] = (key, ref)
        return ref

    def get_manifest(self, digest: str, name: str = "") -> Image:
        """The image a manifest digest describes, whatever names point at it now."""
        manifest = self._manifest(digest)
        sizes = self._layer_sizes(manifest["layers"])
        return Image(name=name, manifest=digest, layers=manifest["layers"], config=manifest["config"],
                     created=0.0, size=sum(sizes), layer_bytes=sizes)

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

    def names(self) -> list[str]:
        """Every name in the store, sorted: local names, then references."""
        out = [e.name for e in os.scandir(self.refs) if e.is_file(follow_symlinks=False)
               and names.from_ref_path(PurePosixPath(e.name))]
        repos = self.refs / names.REPOS_DIR
        found = []
        for dirpath, _, files in os.walk(repos):
            rel = PurePosixPath(os.path.relpath(dirpath, self.refs))
            found.extend(n for f in files if (n := names.from_ref_path(rel / f)))
        return sorted(out) + sorted(found)

    def list(self) -> tuple[list[Image], list[dict]]:
        """(the images, the names that cannot be read: {"name", "error"}):
        a damaged ref, a manifest gc removed, a store that does not answer."""
        images, unreadable = [], []
        for name in self.names():
            try:
                images.append(self.get(name))
            except ImageError as err:
                if err.code != "not_found" or self._ref(name).exists():    # not removed meanwhile
                    unreadable.append({"name": name, "error": str(err)})
        return images, unreadable

    # ------------------------------------------------------------ parents

    def ancestors(self, image: Image) -> tuple[list[str], str]:
        """`image`'s parent, its parent's parent and so on, by canonical name:
        (names, end), `end` saying why the walk stopped after the last name:
        "none" (that image has no parent), "removed" (no image has the
        name now, or its image cannot be read), "replaced" (the name now
        names another image than the one its child was made from: a tag
        or a rebuild moved it on) or "loop" (the name was met before: refs
        written before parents were recorded with their manifest may form
        a cycle, e.g. `dsec image tag child parent`). A name repeats only
        in a loop: each step follows a parent's recorded manifest, and an
        image is always made after its parent's manifest was."""
        chain: list[str] = []
        seen = {image.name}
        parent, made_from = image.parent, image.parent_manifest
        while parent:
            try:
                above = self.get(parent, pull_hint=False)
            except ImageError:
                chain.append(self.key(parent))
                return chain, "removed"
            chain.append(above.name)
            if made_from is not None and above.manifest != made_from:
                return chain, "replaced"
            if above.name in seen:
                return chain, "loop"
            seen.add(above.name)
            parent, made_from = above.parent, above.parent_manifest
        return chain, "none"

    def _publish(self, name: str, manifest_digest: str, parent: str | None,
                 source: dict | None = None, replace: bool = False,
                 cancelled: threading.Event | None = None,
                 parent_manifest: str | None = None, expect: str | None = None) -> tuple[Image, str | None]:
        """Point `name` at a manifest. Without `replace` an existing name is
        `conflict`; with it (a pull moving a tag, a Dockerfile build) the name
        moves atomically (rename). Returns the image published, made from the
        ref written (not read back by name: on a shared store another host
        may have renamed its own over it, or be renaming it, by then), and
        the manifest the name had before (None: it was new). `parent`, and
        the manifest it named then (`parent_manifest`), say what the image
        was made from: a name may be made from the image it replaces.
        `cancelled`, set by the time the ref is written, publishes nothing
        (`conflict`): looked at last, so a cancel that came while the
        manifest and ref were written is not missed. `expect` (with
        `replace`): the manifest `name` must still have, read just before
        the rename, else `conflict` and nothing published (an in-place
        flatten must not overwrite a build or tag that moved the name
        meanwhile; on a shared store another host's rename may still come
        between that read and this rename: a rename cannot compare)."""
        path = self._ref(name)
        tmp = self.store.temp_path(".ref")
        ref = {"manifest": manifest_digest, "created": time.time(), "parent": parent}
        if parent and parent_manifest:
            ref["parent_manifest"] = parent_manifest
        if source is not None:
            ref["source"] = source
        try:
            write_durable(tmp, json.dumps(ref).encode())
            if cancelled is not None and cancelled.is_set():
                raise ImageError("conflict", f"image {name!r}: cancelled: nothing published")
            before = None
            if replace:
                try:
                    before = self._read_ref(name)["manifest"]
                except (FileNotFoundError, KeyError, ImageError):
                    before = None       # none, or unreadable: the rename replaces it all the same
                if expect is not None and before != expect:
                    now = f"manifest {before[:19]}" if before else "no image"
                    raise ImageError("conflict", f"image {name!r} was changed meanwhile (it names {now} now, "
                                     f"not manifest {expect[:19]}): nothing published; do it again")
            # A concurrent rm may prune the reference's empty directories between
            # the makedirs and the link: make them again.
            for attempt in range(5):
                path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    # link fails if the name exists: no silent overwrite; rename replaces.
                    os.rename(tmp, path) if replace else os.link(tmp, path)
                    break
                except FileNotFoundError:
                    if attempt == 4:
                        raise
            self._changed(name)
        except FileExistsError:
            raise ImageError("conflict", f"image {name!r} exists; remove it first (`dsec image rm {name}`)") from None
        except OSError as err:
            raise ImageError("io", f"publish image {name!r} at {path}: {err.strerror}; "
                             f"{unreachable_hint(self.store.root)}") from err
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        return self._image_of(str(self.parse_name(name)), ref), before

    def tag(self, source: str, name: str) -> Image:
        """Name the image `source` names `name` too: the same manifest, nothing
        copied or built; its parent and registry origin (a pulled image's
        platform with it) go along. An image of that name is replaced, as a
        build replaces one; `replaced` in the extra says the manifest the
        name had (None: none, or this one)."""
        name = self.new_name(name)
        with self.pinning() as hold:
            image = self.get(source)
            for digest in [image.manifest, *image.layer_digests]:
                hold(digest)
                if not self.store.exists(digest):      # collected before the pin: rm and gc meanwhile
                    raise ImageError("not_found", f"image {source!r} was removed meanwhile ({digest} is gone "
                                     "from the store)")
            tagged, before = self._publish(name, image.manifest, image.parent, image.source, replace=True,
                                           parent_manifest=image.parent_manifest)
        tagged.extra["replaced"] = before if before != image.manifest else None
        return tagged

    def remove(self, name: str) -> Image:
        """Remove a name. One whose ref or manifest cannot be read (a damaged
        ref, a manifest another host's gc collected) fails every lookup, and
        is removed all the same: rm is the way out. Its image then has no
        manifest, and extra["damaged"] says what was wrong."""
        try:
            image = self.get(name, pull_hint=False)        # removing a missing image wants no pull
        except ImageError as err:
            parsed = self.parse_name(name)
            if err.code == "bad_request" or not os.path.lexists(parsed.ref_path(self.refs)):
                raise
            log.warning("image %s cannot be read (%s); removing its name all the same", parsed, err)
            image = Image(name=str(parsed), manifest=None, layers=[], config=imageconfig.default(),
                          created=0.0, extra={"damaged": str(err)})
        path = self._ref(image.name)
        try:
            path.unlink()
        except FileNotFoundError:     # a concurrent rm of the same name won
            raise ImageError("not_found", f"no image named {name!r} (removed meanwhile)") from None
        except OSError as err:
            raise ImageError("io", f"image {image.name!r}: remove its ref {path}: {err.strerror}; "
                             f"{unreachable_hint(self.store.root)}") from err
        finally:
            self._refs.pop(image.name, None)
        self._changed(image.name)
        self._prune(path.parent)
        return image

    def _changed(self, name: str) -> None:
        key = self.key(name)
        for hook in self.changed:
            hook(key)

    def _prune(self, directory: Path) -> None:
        """Remove a reference's directories once empty, up to refs/_repos."""
        top = self.refs / names.REPOS_DIR
        while directory != top and top in directory.parents:
            try:
                directory.rmdir()
            except OSError:            # not empty (another tag), or gone
                return
            directory = directory.parent

    # ------------------------------------------------------------ building

    def pins(self) -> Pins:
        """A new set of pins for one build (see Pins)."""
        return Pins(self)

    @contextlib.contextmanager
    def pinning(self) -> Iterator[Callable[[str], None]]:
        """A build's pins: `hold(digest)` keeps a blob from gc until the build
        ends (by then its name is published, or it failed)."""
        pins = self.pins()
        try:
            yield pins.hold
        finally:
            pins.release()

    def _hold_existing(self, hold: Callable[[str], None], layers: list[dict]) -> None:
        """Pin the layers a build stacks on (its parent's); one collected
        before the pin (the parent removed meanwhile) is `not_found`."""
        for layer in layers:
            hold(layer["digest"])
            if not self.store.exists(layer["digest"]):
                raise ImageError("not_found", f"layer {layer['digest']} of the parent image was removed "
                                 "from the store meanwhile (image_rm + image_gc); build the parent again")

    def build_layer(self, src: Path, exclude: list[str] = (), progress: Progress | None = None,
                    hold: Callable[[str], None] | None = None, cancelled: threading.Event | None = None,
                    total: int | None = None) -> dict:
        """One EROFS layer from a directory tree, stored by digest (and pinned
        with `hold` until the caller's build is published). `cancelled`, once
        set before the layer is stored, stops mkfs.erofs and stores nothing
        (`conflict`). Progress: the mkfs.erofs step, then, while it runs, the
        `bytes` of the layer written so far, with `total` when the caller
        knows about how many the files hold (a snapshot: their apparent size)."""
        written = None
        if progress:
            progress({"step": "mkfs.erofs", "source": str(src)})

            def written(n: int) -> None:
                progress({"step": "mkfs.erofs", "source": str(src), "bytes": n,
                          **({"total": total} if total is not None else {})})
        tmp = self.layer_temp_path()
        try:
            erofs.build(src, tmp, exclude, cancelled, written)
            if cancelled is not None and cancelled.is_set():
                raise erofs.ErofsError("conflict", f"mkfs.erofs {src}: cancelled")
        except erofs.ErofsError as err:
            tmp.unlink(missing_ok=True)
            raise ImageError(err.code, str(err), err.detail) from err
        return self.store_layer(tmp, progress, hold)

    def layer_temp_path(self) -> Path:
        """Where a new EROFS layer is written before store_layer takes it in."""
        return self.store.temp_path(".erofs")

    def store_layer(self, tmp: Path, progress: Progress | None = None,
                    hold: Callable[[str], None] | None = None, chunks: ChunkHasher | None = None) -> dict:
        """Take in a finished EROFS file at layer_temp_path(), stored by digest
        (and pinned with `hold`): {"digest", "size", "index"}. `chunks`: its
        chunk index's hashes, made while it was written (store.ChunkHasher)."""
        try:
            size = tmp.stat().st_size      # of the temp file: the blob may be shared (and collected) later
            data = erofs.data_size(tmp) or size
            digest, added, index = self.store.ingest_layer(tmp, hold, chunks)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise ImageError("io", f"layer file {tmp}: {err.strerror}") from err
        except StoreError as err:
            raise ImageError(err.code, str(err)) from err
        self._bytes[digest] = data
        if progress:
            progress({"step": "layer", "digest": digest, "bytes": data, "new": added})
        return {"digest": digest, "size": size, "index": index}

    def _commit(self, name: str, layers: list[dict], config: dict, parent: Image | None,
                hold: Callable[[str], None], source: dict | None = None, replace: bool = False,
                cancelled: threading.Event | None = None) -> Image:
        manifest = {"schema": 1, "layers": layers, "config": imageconfig.normalise(config)}
        digest = self.store.put_bytes(_canonical(manifest), hold)
        return self._publish(name, digest, parent.name if parent else None, source, replace, cancelled,
                             parent.manifest if parent else None)[0]

    def commit_pulled(self, name: str, layers: list[dict], config: dict, source: dict,
                      hold: Callable[[str], None], cancelled=None) -> Image:
        """Publish a pulled image under its reference, replacing what the name
        pointed at before (the tag moved on the registry); nothing once
        `cancelled` (anything with is_set(), as _publish looks at it) is set."""
        return self._commit(self.canonical(name), layers, config, None, hold, source, replace=True,
                            cancelled=cancelled)

    # ------------------------------------------------------------ layers by OCI diff_id

    def layer_of_diff_id(self, diff_id: str, hold: Callable[[str], None]) -> dict | None:
        """The stored layer an OCI layer with this diff_id (its uncompressed tar's
        digest) was converted to, pinned with `hold`; None if there is none, or
        its blobs were collected since. The layer is then neither downloaded
        nor converted again: two images on one base share its blob, its mount
        and its page cache."""
        path = self.diffids / check_digest(diff_id).split(":", 1)[1]
        try:
            layer = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return None
        blobs = [d for d in (layer.get("digest"), layer.get("index")) if d]
        for digest in blobs:
            hold(digest)
        if not blobs or not all(self.store.exists(d) for d in blobs):
            return None
        return layer

    def record_diff_id(self, diff_id: str, layer: dict) -> None:
        """Remember which stored layer an OCI diff_id became (by rename: a reader
        sees the whole record or none)."""
        tmp = self.store.temp_path(".diffid")
        write_durable(tmp, json.dumps(layer).encode())
        os.rename(tmp, self.diffids / check_digest(diff_id).split(":", 1)[1])

    def _sweep_diffids(self) -> None:
        """Forget diff_ids whose layer gc removed (called under the gc lock)."""
        for entry in os.scandir(self.diffids):
            try:
                layer = json.loads(Path(entry.path).read_text())
                if not self.store.exists(layer["digest"]):
                    os.unlink(entry.path)
            except (OSError, ValueError, KeyError):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

    def build_from_dir(self, src: str, name: str, parent: str | None = None,
                       config: dict | None = None, progress: Progress | None = None,
                       cancelled: threading.Event | None = None) -> Image:
        """Image `name` from `src`: a root file system (a directory or a
        tarball: one layer), or a docker save or OCI layout (a tarball or its
        unpacked directory: one layer per image layer, and its config), on
        top of `parent`'s layers. `config`: fields that override the config
        (imageconfig.overrides), which is else the archive's own, or the
        parent's for a root file system. `cancelled`, once set, keeps the
        image from being published (`conflict`); the layers made are left to
        `image gc`. An image of that name is replaced (the name moves at
        once, as a Dockerfile build's does): its blobs stay for the
        sandboxes on it until `image gc`; `replaced` in the image's extra
        says the manifest the name had (None: none, or the same)."""
        name = self.new_name(name)
        path = Path(src)
        if not path.is_absolute():
            raise ImageError("bad_request", f"build source must be an absolute path, got {src!r}")
        base = self.get(parent) if parent else None
        parent = base.name if base else None
        with self.pinning() as hold:
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
            if cancelled is not None and cancelled.is_set():
                raise ImageError("conflict", f"build of {name!r} cancelled: nothing published")
            digest = self.put_manifest(all_layers, imageconfig.normalise(imageconfig.stack(below, config or {})),
                                       hold)
            image, before = self.publish(name, digest, parent, replace=True, cancelled=cancelled,
                                         parent_manifest=base.manifest if base else None)
            image.extra["replaced"] = before if before != digest else None
            return image

    def flatten(self, name: str, new_name: str | None,
                mounted: Callable[[list[str]], contextlib.AbstractContextManager[list[str]]],
                progress: Progress | None = None, cancelled: threading.Event | None = None) -> Image:
        """The image `name` as one layer: its layers merged as its overlay
        shows them (fs/flatten.py), in a scratch directory, packed by
        mkfs.erofs; the same config. `mounted(digests)` holds the layers
        mounted for the with block and gives their directories, bottom
        first. Under `new_name` (a name no image has) its parent is `name`;
        without one the name itself moves to the flat image (its parent
        kept), unless it was pointed elsewhere meanwhile (`conflict`).
        `cancelled`, once set, stops the work and publishes nothing."""
        image = self.get(name)
        if new_name and self.new_name(new_name) == image.name:     # --as NAME: NAME itself
            new_name = None
        if new_name:
            target, parent, made_from, replace = self.name_free(new_name), image.name, image.manifest, False
        else:
            target, parent, made_from, replace = image.name, image.parent, image.parent_manifest, True
        return self._flatten(image, target, parent, made_from, replace, mounted, progress, cancelled)

    def _check_flatten_room(self, image: Image, room: _FlattenRoom, dirs: list[str], progress: Progress | None,
                            cancelled: threading.Event | None) -> None:
        """Refuse (`io`, ENOSPC) a flatten whose merged tree and flat layer
        would not fit: the tree in the scratch dir, and the EROFS layer
        mkfs.erofs writes from it in the store's temp dir while the tree is
        still there (one file system by default); in bytes (_flatten_bytes)
        and in inodes (_flatten_inodes). The tree counts at its most while
        it is merged, more than once done when a layer removes what the
        layers below wrote (flatten.measure). The image's layers' sizes
        bound all of it (as if no layer replaced or removed a file of those
        below); only when that bound does not fit are the layers walked
        (flatten.measure) for what the merge would write: a chain of
        snapshots rewriting one big file holds it once per layer. Both
        checks go by `room`, read once as the flatten began. Called with
        the layers mounted, inside _flatten's handlers (Cancelled,
        OSError)."""
        names = image.size // EROFS_NAME_BYTES
        if self._flatten_bytes(image, room, image.size, image.size, image.size) is None and \
                self._flatten_inodes(image, room, names, names) is None:
            return
        need = flatten.measure(dirs, progress, cancelled)
        for short in (self._flatten_bytes(image, room, need.most_tree_bytes, need.tree_bytes(), need.layer_bytes()),
                      self._flatten_inodes(image, room, need.most_entries, need.entries)):
            if short is not None:
                raise short

    @staticmethod
    def _flatten_bytes(image: Image, room: _FlattenRoom, most: int, tree: int, layer: int) -> ImageError | None:
        """The error refusing a flatten whose merged tree (`most` bytes at
        most while it is written, `tree` once done) and EROFS layer (`layer`
        bytes) do not fit in the bytes `room` has; None if they do."""
        at_most = f"{most} bytes at most while it is written, {tree} once done: files a layer above " \
                  "removes are there until then" if most > tree else f"{tree} bytes"
        if room.shared and tree + layer > room.scratch_bytes:
            where, short, free, reserve = room.scratch, tree + layer, room.scratch_bytes, room.scratch_reserve
            what = (f"the merged tree ({tree} bytes) and the EROFS layer packed from it ({layer} bytes, "
                    f"in {room.layer_dir}, the same file system)")
        elif most > room.scratch_bytes:
            where, short, free, reserve = room.scratch, most, room.scratch_bytes, room.scratch_reserve
            what = f"the merged tree ({at_most})"
        elif not room.shared and layer > room.layer_bytes:
            where, short, free, reserve = room.layer_dir, layer, room.layer_bytes, room.layer_reserve
            what = f"the EROFS layer packed from the merged tree ({layer} bytes)"
        else:
            return None
        return ImageError(
            "io", f"flatten of {image.name!r} refused: it needs about {short} bytes in {where} for {what}, "
            f"and {max(0, free)} are free there (keeping {reserve} bytes free for other writers); "
            f"nothing written. Free space on that file system: {FREE_SPACE}",
            {"errno": "ENOSPC", "path": str(where), "need": short, "free": max(0, free)})

    @staticmethod
    def _flatten_inodes(image: Image, room: _FlattenRoom, most: int, final: int) -> ImageError | None:
        """The error refusing a flatten whose merge would run out of the
        inodes `room` has in the scratch dir; None if it would not. It
        takes the tree's root and its names, `most` at most while it is
        written, or, if more, `final` once done and the EROFS layer's file
        that mkfs.erofs writes next to them when the store's temp dir is on
        the same file system."""
        if room.inodes is None:
            return None
        free = room.inodes
        need = 1 + max(most, final + int(room.shared))
        if need <= free:
            return None
        return ImageError(
            "io", f"flatten of {image.name!r} refused: merging its layers takes up to {need} inodes in "
            f"{room.scratch} (one for each file, directory or other name it writes, counting those a "
            f"layer above removes while they are still there), and {max(0, free)} are free there (keeping "
            f"{room.inode_reserve} free for other writers); nothing written. Free inodes on that file system: "
            f"{FREE_SPACE}; or give the daemon's state dir a file system with more inodes (ext4 fixes their "
            "number at mkfs, -N or -i; a tmpfs's is nr_inodes)",
            {"errno": "ENOSPC", "path": str(room.scratch), "need_inodes": need, "free_inodes": max(0, free)})

    def _flatten(self, image: Image, target: str, parent: str | None, made_from: str | None, replace: bool,
                 mounted, progress: Progress | None, cancelled: threading.Event | None) -> Image:
        with self.pinning() as hold:
            hold(image.manifest)
            self._hold_existing(hold, image.layers)
            work = Path(tempfile.mkdtemp(prefix=UNPACK_PREFIX, dir=self.scratch))
            try:
                tree = work / "tree"
                with mounted(image.layer_digests) as dirs:
                    try:
                        room = _FlattenRoom.read(self.scratch, self.store.tmp)
                        self._check_flatten_room(image, room, dirs, progress, cancelled)
                        flatten.merge(dirs, tree, progress, cancelled, self.max_layer_bytes, room.scratch_bytes_now)
                    except flatten.TooLarge as err:
                        raise ImageError("limit", f"flatten of {image.name!r}: {err}: the flat layer would be "
                                         f"past images.max_layer_bytes ({err.max_bytes} bytes), which bounds "
                                         "a layer as a pull's or a build's; nothing published: raise "
                                         "images.max_layer_bytes, or remove large files in a new snapshot "
                                         "before flattening") from None
                    except flatten.NoRoom as err:
                        raise ImageError("io", f"flatten of {image.name!r}: the merged tree is written in "
                                         f"{self.scratch}, which has no room left for the next file (another "
                                         f"writer took it since the flatten started): {err}, keeping "
                                         f"{room.scratch_reserve} bytes free for other writers; nothing "
                                         f"published. Free space on that file system: {FREE_SPACE}",
                                         {"errno": "ENOSPC", "path": str(self.scratch)}) from None
                    except flatten.Cancelled:
                        raise ImageError("conflict", f"flatten of {image.name!r} cancelled: nothing "
                                         "published") from None
                    except flatten.Unsupported as err:
                        raise ImageError("unsupported", f"flatten of {image.name!r}: {err} (the layer is "
                                         f"{image.layers[err.layer - 1]['digest']})") from None
                    except OSError as err:
                        room = (f"; the file system of {self.scratch}, where the merged tree is written, "
                                "filled up meanwhile; nothing published. Free space on it: "
                                f"{FREE_SPACE}") if err.errno in (errno.ENOSPC, errno.EDQUOT) else ""
                        raise ImageError("io", f"flatten of {image.name!r}: {err.filename or tree}: "
                                         f"{err.strerror or err}{room}",
                                         {"errno": errno.errorcode.get(err.errno or 0, "EIO"),
                                          "path": str(err.filename or tree)}) from err
                try:
                    layer = self.build_layer(tree, progress=progress, hold=hold, cancelled=cancelled)
                except ImageError as err:
                    raise ImageError(err.code, f"flatten of {image.name!r}: {err}; nothing published",
                                     err.detail) from err
            finally:
                shutil.rmtree(work, ignore_errors=True)
            if cancelled is not None and cancelled.is_set():
                raise ImageError("conflict", f"flatten of {image.name!r} cancelled: nothing published")
            digest = self.put_manifest([layer], image.config, hold)
            # In place, the name moves only from the image flattened: its
            # manifest is compared just before the ref is renamed over it.
            flat, before = self.publish(target, digest, parent, replace=replace, cancelled=cancelled,
                                        parent_manifest=made_from, expect=image.manifest if replace else None)
        flat.extra["replaced"] = before if before != digest else None
        flat.extra["flattened"] = {"manifest": image.manifest, "layers": len(image.layers)}
        return flat

    def _remove_scratch_leftovers(self) -> None:
        """Remove the trees a killed daemon left unpacking a tarball
        (_unpacked_layers), merging an image's layers (_flatten) or a
        microVM's writable layer (VmFiles.upper_tree): nothing else removes
        them, and they can hold an image's every byte. The scratch dir is its
        daemon's alone (the state dir's lock), so at start none of them is a
        write still going."""
        for prefix in (UNPACK_PREFIX, "vm-upper-"):
            for entry in self.scratch.glob(f"{prefix}*"):
                shutil.rmtree(entry, ignore_errors=True)

    def _unpacked_layers(self, unpack, path: Path, what: str, progress: Progress | None,
                         hold: Callable[[str], None]) -> tuple[list[dict], dict | None] | None:
        """(one EROFS layer per layer of the archive at `path`, its config or
        None for a root file system tarball), by `unpack` (oci.unpack_image or
        oci.unpack_dir) in a scratch directory; None: `unpack` found a root
        file system directory, to be built as it is."""
        work = Path(tempfile.mkdtemp(prefix=UNPACK_PREFIX, dir=self.scratch))
        try:
            try:
                unpacked = unpack(path, work, progress, max_bytes=self.max_layer_bytes)
            except oci.LayerTooLarge as err:
                raise ImageError("limit", f"{what}: {err}") from err
            except oci.TarError as err:
                raise ImageError("bad_request", f"{what}: {err}") from err
            if unpacked is None:
                return None
            dirs, config = unpacked
            return [self.build_layer(d, progress=progress, hold=hold) for d in dirs], config
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def name_free(self, name: str) -> str:
        """`name` checked as a new image's (new_name), and taken by no image
        yet: ImageError conflict, saying how to free it."""
        name = self.new_name(name)
        if self._ref(name).exists():
            raise ImageError("conflict", f"image {name!r} exists; remove it first (`dsec image rm {name}`)")
        return name

    def snapshot(self, upper: Path, base: Image, name: str, exclude: list[str],
                 progress: Progress | None = None, max_bytes: int = 0,
                 cancelled: threading.Event | None = None) -> Image:
        """pack_diff: the sandbox's upper dir as a new top layer over `base`.
        `max_bytes` (0 = none) bounds the files' apparent size, checked first.
        `cancelled`, once set, keeps the image from being published
        (`conflict`): set while the layer is made, it stops mkfs.erofs and
        nothing is stored; set after, the layer made is left to `image gc`."""
        name = self.name_free(name)
        # The walk for the bound gives the progress its total; without a
        # bound, none is made: the sandbox is frozen meanwhile, and the walk
        # takes time with the number of files.
        total = check_apparent_size(upper, exclude, max_bytes) if max_bytes else None
        forget_overlay_uuid(upper)
        with self.pinning() as hold:
            self._hold_existing(hold, base.layers)
            layer = self.build_layer(upper, exclude=exclude, progress=progress, hold=hold, cancelled=cancelled,
                                     total=total)
            if cancelled is not None and cancelled.is_set():
                raise ImageError("conflict", f"snapshot to {name!r} cancelled: nothing published")
            return self._commit(name, base.layers + [layer], base.config, base, hold, cancelled=cancelled)

    # ------------------------------------------------------------ Dockerfile builds

    def pack_layer(self, upper: Path, exclude: list[str], hold: Callable[[str], None],
                   progress: Progress | None = None, max_bytes: int = 0) -> dict | None:
        """A sandbox's upper dir as a layer (pinned with `hold`), or None when
        the sandbox changed nothing (only `exclude`d paths, or no entry at all).

        The overlay's own id is removed first (forget_overlay_uuid)."""
        if not has_changes(upper, exclude):
            return None
        forget_overlay_uuid(upper)
        if max_bytes:
            check_apparent_size(upper, exclude, max_bytes)
        return self.build_layer(upper, exclude=exclude, progress=progress, hold=hold)

    def put_manifest(self, layers: list[dict], config: dict, hold: Callable[[str], None]) -> str:
        """The manifest blob of an image (a build step's), pinned with `hold`."""
        manifest = {"schema": 1, "layers": layers, "config": config}
        return self.store.put_bytes(_canonical(manifest), hold)

    def publish(self, name: str, manifest: str, parent: str | None, replace: bool = False,
                cancelled: threading.Event | None = None,
                parent_manifest: str | None = None, expect: str | None = None) -> tuple[Image, str | None]:
        """Name an image already in the store: (the image, the manifest the name
        had before when `replace` moved it); nothing once `cancelled` is set,
        or (`expect`) once the name no longer has that manifest.
        `parent_manifest`: the manifest `parent` named when the image was made."""
        return self._publish(name, manifest, parent, replace=replace, cancelled=cancelled,
                             parent_manifest=parent_manifest, expect=expect)

    def cache_lookup(self, key: str, hold: Callable[[str], None]) -> Image | None:
        """The image a build step with this key made before, its blobs pinned;
        None if there is no entry or a blob of it is gone (the entry goes too)."""
        digest = self.build_cache.get(key)
        if digest is None:
            return None
        hold(digest)
        try:
            image = self.get_manifest(digest)
        except ImageError:
            self.build_cache.drop(key)
            return None
        for blob in self._blobs_of({"layers": image.layers}):
            hold(blob)
            if not self.store.exists(blob):
                self.build_cache.drop(key)
                return None
        return image

    def cache_record(self, key: str, manifest: str) -> None:
        self.build_cache.put(key, manifest)

    # ------------------------------------------------------------ accounting

    def referenced(self) -> tuple[set[str], set[str]]:
        """(manifest digests, layer and chunk index digests) reachable from names.
        A name removed meanwhile, a damaged ref and a manifest no longer in
        the store name nothing to keep; a ref or manifest that cannot be read
        (the store failing) is `io`: what it keeps is unknown, so gc stops."""
        manifests, layers = set(), set()
        for name in self.names():
            try:
                digest = self._read_ref(name)["manifest"]
                manifests.add(digest)
                layers.update(self._blobs_of(self._manifest(digest)))
            except (FileNotFoundError, ValueError, KeyError):
                continue
            except ImageError as err:
                if err.code == "not_found" or isinstance(err.__cause__, ValueError):
                    continue
                raise ImageError("io", f"image gc: cannot read image {name!r} ({err}); nothing was "
                                 "removed: run it again once the store answers") from err
            except OSError as err:
                raise ImageError("io", f"image gc: cannot read image {name!r} ({err.strerror or err}); "
                                 "nothing was removed: run it again once the store answers") from err
        return manifests, layers

    def gc(self, in_use_layers: set[str], in_use_manifests: set[str]) -> dict:
        """Remove blobs no name, no live sandbox of this host and no build in
        progress uses. The whole pass holds the pin lock: a build pins a blob
        either before it (kept) or after it (and then finds it gone and stores
        it again), and unpins only after its name is published."""
        with self._gc_lock:
            keep = self._kept(in_use_layers, in_use_manifests)
            cache_removed = self._gc_build_cache(keep)
            removed, freed = [], 0
            for digest in sorted(self.store.all_digests() - keep):
                try:
                    held = self.blob_bytes(digest)
                except OSError:
                    held = 0
                if self.store.remove(digest):
                    freed += held
                self._manifests.pop(digest, None)
                self._bytes.pop(digest, None)
                removed.append(digest)
            self._sweep_diffids()
        self.store.sweep_tmp()
        return {"removed": removed, "freed_bytes": freed, "cache_removed": cache_removed}

    def _kept(self, in_use_layers: set[str], in_use_manifests: set[str]) -> set[str]:
        """The blobs a gc keeps whatever the build cache needs: those of every
        name, every live sandbox of this host and every build in progress."""
        manifests, layers = self.referenced()
        keep = manifests | layers | in_use_layers | in_use_manifests | set(self._pins)
        for m in in_use_manifests:
            try:
                keep.update(self._blobs_of(self._manifest(m)))
            except ImageError:
                pass
        return keep

    def _gc_build_cache(self, keep: set[str]) -> int:
        """Drop the build cache entries some of whose layers nothing keeps;
        add the manifests of the others to `keep`. Returns entries dropped."""
        dropped = 0
        for key, digest in list(self.build_cache.entries()):
            try:
                needed = self._blobs_of(self._manifest(digest)) if digest else None
            except ImageError:
                needed = None
            if needed is not None and needed <= keep:
                keep.add(digest)
                continue
            self.build_cache.drop(key)
            dropped += 1
        return dropped

    def du(self, in_use_layers: set[str], in_use_manifests: set[str]) -> dict:
        """Sizes; `unreferenced_bytes` is what a gc would free now (it keeps
        the blobs of live sandboxes and builds, as gc does)."""
        keep = self._kept(in_use_layers, in_use_manifests)
        for _key, digest in self.build_cache.entries():
            try:
                if digest and self._blobs_of(self._manifest(digest)) <= keep:
                    keep.add(digest)
            except ImageError:
                pass
        total = shared = 0
        counts: dict[str, int] = {}
        images, _unreadable = self.list()
        for image in images:
            for digest in image.layer_digests:
                counts[digest] = counts.get(digest, 0) + 1
        sizes = {}
        for d in self.store.all_digests():
            try:
                sizes[d] = self.blob_bytes(d)
            except FileNotFoundError:     # collected by a gc since the listing
                continue
        total = sum(sizes.values())
        shared = sum(sizes.get(d, 0) for d, n in counts.items() if n > 1)
        unreferenced = sum(s for d, s in sizes.items() if d not in keep)
        return {"blobs": len(sizes), "bytes": total, "shared_layer_bytes": shared,
                "unreferenced_bytes": unreferenced, "build_cache_entries": self.build_cache.count(),
                "images": [{"name": i.name, "bytes": i.size, "layers": len(i.layers)} for i in images]}


def forget_overlay_uuid(upper: Path) -> None:
    """Remove the overlay's own id, the xattr OVERLAY_UUID it put on the
    upper root when it was mounted, before the upper dir is packed: it is
    random per mount, so it would make every layer unique, and the same
    changes (two sandboxes of one image, a build step's) would never
    dedupe. The sandbox's overlay read it at its mount and never again; an
    overlay reads it from its upper dir only, never from a lower layer."""
    with contextlib.suppress(OSError):
        os.removexattr(upper, OVERLAY_UUID)


def check_apparent_size(top: Path, exclude: list[str], max_bytes: int) -> int:
    """Sum of st_size of the regular files under `top` (paths in `exclude`
    left out); `limit` past max_bytes (0: no bound). A sandbox makes a sparse file of any
    size for free (`truncate -s 1T`), but mkfs.erofs reads and stores every
    byte of it: measured, a 2 GiB sparse file became a 2 GiB blob in 20 s.
    Without this bound one snapshot could fill the blob store (shared by
    every host) and keep a worker thread busy for hours. A file's hard links
    count once: the layer holds its inode once."""
    skip = {os.path.join(top, rel) for rel in map(erofs.exclude_rel, exclude) if rel}
    total = 0
    linked: set[tuple[int, int]] = set()       # the files with more than one name met so far
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
                if st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in linked:
                        continue
                    linked.add((st.st_dev, st.st_ino))
                total += st.st_size
                if max_bytes and total > max_bytes:
                    raise ImageError("limit", f"snapshot: the sandbox's changed files add up to more than "
                                     f"images.max_snapshot_bytes ({max_bytes} bytes; {path[len(str(top)):]} "
                                     f"alone is {st.st_size}); remove large or sparse files, or exclude them")
    return total


def has_changes(upper: Path, exclude: list[str]) -> bool:
    """Whether an upper dir holds anything but the `exclude`d paths (and the
    directories above them, which overlay copied up to hold them)."""
    skip = {rel for rel in map(erofs.exclude_rel, exclude) if rel}
    above = {"/".join(p.split("/")[:i]) for p in skip for i in range(1, p.count("/") + 1)}
    for dirpath, dirnames, filenames in os.walk(upper):
        rel_dir = os.path.relpath(dirpath, upper)
        rel_dir = "" if rel_dir == "." else rel_dir
        for name in filenames:
            if os.path.join(rel_dir, name) not in skip:
                return True
        for name in list(dirnames):
            rel = os.path.join(rel_dir, name)
            if rel in skip:
                dirnames.remove(name)
            elif rel not in above:
                return True
    return False


class Pins:
    """Blobs one build relies on while no name reaches them: `gc` keeps a
    pinned blob. `hold` and `release` take the gc lock, which a gc pass holds
    throughout: call them from a worker thread, never on the event loop."""

    def __init__(self, images: ImageStore):
        self._images = images
        self.held: list[str] = []

    def hold(self, digest: str) -> None:
        with self._images._gc_lock:
            self._images._pins[digest] += 1
        self.held.append(digest)

    def release(self) -> None:
        images = self._images
        with images._gc_lock:
            images._pins.subtract(self.held)
            for digest in set(self.held):
                if images._pins[digest] <= 0:
                    images._pins.pop(digest, None)
        self.held = []


__all__ = ["Image", "ImageError", "ImageStore", "Pins", "check_digest"]
