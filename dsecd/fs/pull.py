"""`image_pull`: an image from an OCI distribution registry into the store.

    1. resolve   the manifest of the reference (an index: this host's platform's
                 entry), then the image config; each checked against its digest
    2. claim     <store>/pulls/<manifest hex>.claim (claims.py): of several hosts
                 pulling one image into a shared store, one downloads; the others
                 wait, then find its layers stored and download nothing
    3. download  skopeo copies the manifest's blobs into the work directory
                 <store>/pulls/<manifest hex>/ (an OCI layout). Layers the store
                 already has (by diff_id, from any image) get an empty sparse
                 placeholder of their size there first, which skopeo takes as
                 present and does not fetch. A blob appears in blobs/sha256/ only
                 once complete and checked, and the directory survives a failed
                 or cancelled pull, so a re-pull fetches only what is missing.
    4. convert   each layer while it downloads, from skopeo's temp file, when a
                 thread for that is idle (_convert_stream; which layer it is
                 shows when skopeo renames it into blobs/), else as soon as its
                 blob is complete: decompressed (gzip, zstd) and written
                 straight into an EROFS image in one streaming pass
                 (tarerofs.convert_blob: entry checks, whiteouts, both
                 digests checked; no tree on disk, no mkfs.erofs), stored and
                 recorded under its diff_id (images.py). A layer that writer
                 does not serve (a sparse file, a PAX global header) is
                 unpacked (oci.extract_blob) into a tmpfs of its own
                 (images.pull_tmpfs), or the scratch disk when too big for
                 it, and built with mkfs.erofs (see _convert)
    5. publish   our manifest, then the name (last: a failed pull leaves no
                 name), pointing at it with its source (ref, digest, platform)

Progress goes to a callback as dicts (docs/protocol.md, image_pull). skopeo
says nothing machine-readable while it runs, so the download is watched in
the work directory: a layer's blob in blobs/sha256/ is complete; bytes in
flight are skopeo's temp files (oci-put-blob*). Which temp file is which
layer skopeo does not say: live bytes are given to the layers being fetched
in the order their temp files were made (inode order), which is the order
skopeo starts them in (manifest order) but for near-simultaneous starts.
Totals are exact; each layer's count is exact once its blob is complete.

Everything here blocks: call it from a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import platform as host_platform
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .. import imageconfig, native
from . import names, oci, tarerofs
from .claims import Claim
from .images import Image, ImageError, ImageStore
from .skopeo import RegistryError, Skopeo
from .store import DIGEST_RE

Progress = Callable[[dict], None]
log = logging.getLogger(__name__)

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = {OCI_INDEX, DOCKER_LIST}
MANIFEST_TYPES = {OCI_MANIFEST, DOCKER_MANIFEST}
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd", "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
}
COPY_TAG = "pull"               # the tag skopeo writes in a work directory's index.json
TEMP_PREFIX = "oci-put-blob"    # skopeo's temp file of a blob being downloaded (in the layout's root)
PLACEHOLDERS = "placeholders"
MEM_PREFIX = "pull-mem-"       # the mount point of a converting layer's tmpfs, in the scratch dir
TRASH_PREFIX = ".discarded-"    # a published pull's work directory, being deleted (_discard)   # a work directory's list of the placeholders it holds
POLL_S = 0.2
ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x",
        "riscv64": "riscv64", "i686": "386"}


CONVERT_NICE = 10


class _BelowTheDownload:
    """A pull's conversion threads (and the mkfs.erofs of a layer the direct
    writer leaves to it) yield the CPU to skopeo while it downloads: nice is per thread on Linux.
    Converting layer i while layer i+1 downloads then costs the download
    little (measured on 2 cores: without it the download ran ~1.8x slower
    than skopeo alone), and conversion takes the cycles the download
    leaves. Once the download is over they go back to the daemon's nice:
    niced, what was left of the conversion yielded to every other process
    of a busy host too (at load 8-10 the bench's conversion after the
    download took 13-20 s for ~4.5 CPU-s)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.threads: list[tuple[int, int]] = []    # (native thread id, its nice before)
        self.over = False

    def enter(self) -> None:
        """A pool thread's initializer."""
        with self.lock:
            if self.over:
                return
            tid = threading.get_native_id()
            with contextlib.suppress(OSError):
                before = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, max(before, CONVERT_NICE))
                self.threads.append((tid, before))

    def download_over(self) -> None:
        """Back to the daemon's nice (threads still alive: their pools are not shut down yet)."""
        with self.lock:
            self.over = True
            for tid, before in self.threads:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, tid, before)
            self.threads.clear()


def host_os_arch() -> str:
    machine = host_platform.machine()
    return f"linux/{ARCH.get(machine, machine)}"


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class PullError(ImageError):
    """A pull that failed; code as for ImageError."""


@dataclass
class PullSettings:
    convert_threads: int = 1
    tmpfs_bytes: int = 1 << 30      # cap of the tmpfs a layer is unpacked into (0: the scratch disk)
    claim_stale_s: float = 60.0
    timeout_s: float = 3600.0


@dataclass
class Resolved:
    """What step 1 found: the image manifest to copy and its config."""

    name: names.ImageName
    platform: str
    manifest_digest: str
    manifest: dict
    config: dict
    index_digest: str | None = None

    @property
    def layers(self) -> list[dict]:
        return self.manifest["layers"]

    @property
    def diff_ids(self) -> list[str]:
        return self.config["rootfs"]["diff_ids"]


class _Layer:
    """One layer's part of a pull, and what the progress reports of it."""

    def __init__(self, index: int, desc: dict, diff_id: str):
        self.index = index
        self.digest = desc["digest"]
        self.size = int(desc["size"])
        self.diff_id = diff_id
        self.state = "waiting"       # waiting downloading downloaded converting stored | reused
        self.bytes = 0
        self.resumed = False         # its blob was in the work directory from an earlier try
        self.stored: dict | None = None
        self.future: Future | None = None
        self.reported: tuple = ()

    def event(self, of: int) -> dict:
        return {"step": "pull", "layer": self.index, "of": of, "digest": self.digest, "size": self.size,
                "bytes": self.bytes, "state": self.state}


STREAM_POLL_S = 0.01           # a converting temp file's reader, at its end, looks again after this
# Temp files converting at once: every blob skopeo downloads at a time (its
# own bound is 6). A conversion writes its EROFS image as the bytes come
# (tarerofs: ~2 MiB of buffers, no tmpfs) and mostly waits for them, so each
# layer's conversion keeps pace with its download instead of queueing
# behind one slot and running after the download (measured: docs/notes/log.md, 2026-12-02).
STREAM_SLOTS = 6


class _Abandoned(Exception):
    """A temp file that will not become a blob: skopeo stopped, or dropped it."""


class _Streams:
    """A download's conversions of temp files (Puller._convert_stream), by inode."""

    def __init__(self, pool: ThreadPoolExecutor, slots: int):
        self.pool = pool
        self.slots = slots              # conversions of temp files at once; 0: none
        self.by_ino: dict[int, Future] = {}
        self.over = threading.Event()   # skopeo has exited: no temp file becomes a blob any more

    def idle(self) -> bool:
        """Whether a thread for temp files has nothing to do."""
        return sum(not f.done() for f in self.by_ino.values()) < self.slots


class _GrowingBlob:
    """A blob read from skopeo's temp file while skopeo writes it: read()
    waits at the file's end until more is written or the file is complete.
    Complete is when skopeo has renamed it into blobs/ (it does once the
    whole blob is written and its digest checked): the layer whose blob has
    this inode is then `layer`. _Abandoned when no layer's blob ever will."""

    def __init__(self, fd: int, temp: Path, blobs: Path, layers: list[_Layer], over: threading.Event):
        self.fd = fd
        self.temp = temp
        self.blobs = blobs
        self.layers = layers
        self.over = over
        st = os.fstat(fd)
        self.ino = (st.st_dev, st.st_ino)
        self.layer: _Layer | None = None
        self.complete = False

    def read(self, size: int = -1) -> bytes:
        size = size if size >= 0 else 1 << 20
        while True:
            data = os.read(self.fd, size)
            if data or self.complete:
                return data
            self._wait()

    def _wait(self) -> None:
        """At the file's end: the layer once the file is complete (then reads
        go on to its true end), else a short sleep; _Abandoned when skopeo is done."""
        over = self.over.is_set()       # before the look: skopeo renames nothing after its exit
        if self.temp.exists():
            if over:
                raise _Abandoned(f"{self.temp} is still a temp file after the download ended")
            time.sleep(STREAM_POLL_S)
            return
        self.layer = self._find()
        if self.layer is None:
            raise _Abandoned(f"{self.temp} was removed without becoming a blob")
        self.complete = True

    def _find(self) -> _Layer | None:
        for layer in self.layers:
            try:
                st = os.stat(self.blobs / layer.digest.split(":", 1)[1])
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) == self.ino:
                return layer
        return None

    def known_layer(self) -> _Layer | None:
        """The layer this file is, waiting for the download to tell; None if it is none."""
        while not self.complete:
            try:
                self._wait()
            except _Abandoned:
                return None
        return self.layer

    def close(self) -> None:
        os.close(self.fd)


class Puller:
    def __init__(self, images: ImageStore, skopeo: Skopeo, settings: PullSettings):
        self.images = images
        self.skopeo = skopeo
        self.settings = settings
        self.root = images.store.root / "pulls"
        self.root.mkdir(parents=True, exist_ok=True)
        self._unmount_leftovers()

    def _unmount_leftovers(self) -> None:
        """Unmount and remove the conversion tmpfs a killed daemon left in
        its scratch directory (_convert_in_tmpfs): its memory is held until
        the unmount."""
        for entry in self.images.scratch.glob(f"{MEM_PREFIX}*"):
            try:
                if os.path.ismount(entry):
                    native.umount(str(entry), detach=True)
                shutil.rmtree(entry, ignore_errors=True)
            except OSError as err:
                log.warning("pull: cannot remove the leftover conversion tmpfs %s: %s", entry, err)

    def sweep(self) -> int:
        """Remove the work directories of pulls nobody runs (a failed or cancelled
        pull's download, kept for a retry): `image gc` reclaims that space too,
        at the price of a full download next time. Returns the bytes freed."""
        freed = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                if not entry.is_dir(follow_symlinks=False) or (self.root / f"{entry.name}.claim").exists():
                    continue
                for dirpath, _, files in os.walk(entry.path):
                    for f in files:
                        with contextlib.suppress(OSError):
                            freed += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                shutil.rmtree(entry.path, ignore_errors=True)
        return freed

    # ------------------------------------------------------------ 1. resolve

    def reference(self, ref: str) -> names.ImageName:
        """What `ref` names on a registry: a bare `busybox` is `busybox:latest`
        on the default registry (a local name never comes from a registry)."""
        name = self.images.parse_name(ref)
        if name.local:
            try:
                name = names.parse(f"{ref}:latest", self.images.default_registry)
            except names.BadName as err:
                raise PullError("bad_request", str(err)) from None
        return name

    def _json(self, data: bytes, what: str) -> dict:
        try:
            obj = json.loads(data)
        except ValueError as err:
            raise PullError("io", f"{what} is not JSON: {err}") from None
        if not isinstance(obj, dict):
            raise PullError("io", f"{what} is not a JSON object")
        return obj

    def _fetch_manifest(self, name: names.ImageName, digest: str | None) -> tuple[bytes, dict]:
        ref = f"{name.repo}@{digest}" if digest else str(name)
        data = self.skopeo.inspect_raw(name.registry, ref)
        if digest and _sha256(data) != digest:
            raise PullError("io", f"manifest of {ref}: the registry sent bytes hashing to {_sha256(data)}")
        return data, self._json(data, f"manifest of {ref}")

    @staticmethod
    def _kind(manifest: dict, what: str) -> str:
        media = manifest.get("mediaType") or ""
        if manifest.get("schemaVersion") == 1:
            raise PullError("unsupported", f"{what} is a docker schema 1 manifest, which nothing has pushed "
                            "since 2017; push the image again with a current client")
        if media in INDEX_TYPES or (not media and "manifests" in manifest):
            return "index"
        if media in MANIFEST_TYPES or (not media and "layers" in manifest):
            return "manifest"
        raise PullError("unsupported", f"{what} has the media type {media!r}, neither an image manifest "
                        "nor an index")

    @staticmethod
    def _pick(index: dict, wanted: str, what: str) -> str:
        """The digest of the index entry for `wanted` (os/arch[/variant])."""
        os_, arch, *variant = wanted.split("/")
        entries = index.get("manifests")
        if not isinstance(entries, list):
            raise PullError("io", f"{what} has no list of manifests")
        seen = []
        for entry in entries:
            p = entry.get("platform") or {} if isinstance(entry, dict) else {}
            seen.append("/".join(x for x in (p.get("os"), p.get("architecture"), p.get("variant")) if x))
            if p.get("os") == os_ and p.get("architecture") == arch and (
                    not variant or p.get("variant") == variant[0]):
                digest = entry.get("digest", "")
                if not DIGEST_RE.match(digest):
                    raise PullError("io", f"{what}: the {wanted} entry has a bad digest {digest!r}")
                return digest
        raise PullError("not_found", f"{what} has no image for {wanted} (it has: "
                        f"{', '.join(s for s in seen if s) or 'none'}); give another --platform")

    def resolve(self, name: names.ImageName, wanted: str) -> Resolved:
        data, top = self._fetch_manifest(name, name.digest)
        top_digest = _sha256(data)
        index_digest = None
        if self._kind(top, f"manifest of {name}") == "index":
            index_digest = top_digest
            child = self._pick(top, wanted, f"index {name}")
            if child == top_digest:
                raise PullError("io", f"index {name} lists itself as the {wanted} image; refusing to loop")
            data, top = self._fetch_manifest(name, child)
            if self._kind(top, f"manifest {child}") == "index":
                raise PullError("unsupported", f"index {name} points for {wanted} at another index ({child}); "
                                "nested indexes are refused")
            top_digest = child
        manifest = top
        what = f"manifest {top_digest} of {name}"
        layers, cfg_desc = manifest.get("layers"), manifest.get("config")
        if not isinstance(layers, list) or not layers or not isinstance(cfg_desc, dict):
            raise PullError("io", f"{what} has no layers or no config")
        for layer in layers:
            if not isinstance(layer, dict) or not DIGEST_RE.match(str(layer.get("digest"))) or \
                    not isinstance(layer.get("size"), int) or layer["size"] < 0:
                raise PullError("io", f"{what} has a layer without a sha256 digest and a size: {layer!r:.200}")
            if layer.get("mediaType") not in LAYER_TYPES:
                raise PullError("unsupported", f"{what}: layer {layer['digest']} has the media type "
                                f"{layer.get('mediaType')!r}, not a tar layer (plain, gzip or zstd)")
        cfg_digest = str(cfg_desc.get("digest"))
        if not DIGEST_RE.match(cfg_digest):
            raise PullError("io", f"{what} has a bad config digest {cfg_digest!r}")
        cfg_data = self.skopeo.inspect_raw(name.registry, f"{name.repo}@{top_digest}", config=True)
        if _sha256(cfg_data) != cfg_digest:
            raise PullError("io", f"config of {name}: the registry sent bytes hashing to {_sha256(cfg_data)}, "
                            f"the manifest names {cfg_digest}")
        config = self._json(cfg_data, f"config {cfg_digest} of {name}")
        diff_ids = (config.get("rootfs") or {}).get("diff_ids")
        if not isinstance(diff_ids, list) or len(diff_ids) != len(layers) or \
                not all(DIGEST_RE.match(str(d)) for d in diff_ids):
            raise PullError("io", f"config {cfg_digest} of {name}: rootfs.diff_ids must list one sha256 "
                            f"digest per layer ({len(layers)})")
        got = f"{config.get('os')}/{config.get('architecture')}"
        if index_digest is None and config.get("architecture") and got != "/".join(wanted.split("/")[:2]):
            raise PullError("not_found", f"{name} is an image for {got}, not for {wanted}; "
                            f"give --platform {got} to pull it anyway")
        return Resolved(name=name, platform=wanted, manifest_digest=top_digest, manifest=manifest,
                        config=config, index_digest=index_digest)

    # ------------------------------------------------------------ the pull

    def pull(self, ref: str, wanted: str | None = None, progress: Progress | None = None,
             cancelled: threading.Event | None = None) -> tuple[Image, dict]:
        """Pull `ref` for `wanted` (os/arch, default: this host's): (image, stats)."""
        t0 = time.monotonic()
        emit = progress or (lambda p: None)
        cancelled = cancelled or threading.Event()
        name = self.reference(ref)
        wanted = wanted or host_os_arch()
        if len(wanted.split("/")) not in (2, 3):
            raise PullError("bad_request", f"platform {wanted!r}: want os/arch or os/arch/variant (linux/arm64)")
        try:
            resolved = self.resolve(name, wanted)
        except RegistryError as err:
            raise PullError(err.code, str(err)) from err
        source = {"ref": str(name), "digest": resolved.manifest_digest, "platform": wanted,
                  "index": resolved.index_digest}
        total = sum(int(layer["size"]) for layer in resolved.layers)
        emit({"step": "resolve", "ref": str(name), "digest": resolved.manifest_digest, "platform": wanted,
              "layers": len(resolved.layers), "bytes": total})
        stats = {"downloaded_bytes": 0, "reused_layers": 0, "resumed_layers": 0, "streamed_layers": 0,
                 "waited_s": 0.0,
                 "download_s": 0.0, "convert_s": 0.0}
        current = self._current(name, source)
        if current is not None:
            return current, {**stats, "up_to_date": True, "total_s": time.monotonic() - t0}
        hexpart = resolved.manifest_digest.split(":", 1)[1]
        claim = Claim(self.root / f"{hexpart}.claim", self.settings.claim_stale_s)
        waited = time.monotonic()

        def on_wait(holder: dict) -> None:
            emit({"step": "wait", "holder": f"{holder.get('host')} pid {holder.get('pid')}",
                  "age_s": round(holder.get("age_s", 0.0), 1)})

        try:
            claim.acquire(on_wait, cancelled, self.settings.timeout_s)
        except InterruptedError:
            raise PullError("conflict", f"pull of {name} cancelled while another pull of it ran") from None
        except TimeoutError as err:
            raise PullError("busy", f"pull of {name}: {err.strerror}; retry later") from None
        stats["waited_s"] = time.monotonic() - waited
        try:
            image = self._pull_claimed(resolved, source, emit, cancelled, stats)
        finally:
            claim.release()
        stats["total_s"] = time.monotonic() - t0
        return image, stats

    def _current(self, name: names.ImageName, source: dict) -> Image | None:
        """The image `name` already is, if it came from the same manifest."""
        with contextlib.suppress(ImageError):
            image = self.images.get(str(name))
            if image.name == str(name) and image.source and image.source.get("digest") == source["digest"]:
                return image
        return None

    def _pull_claimed(self, r: Resolved, source: dict, emit: Progress, cancelled: threading.Event,
                      stats: dict) -> Image:
        current = self._current(r.name, source)      # published by the claim's previous holder
        if current is not None:
            stats["up_to_date"] = True
            return current
        try:                    # a config we cannot honour fails before anything is downloaded
            config = imageconfig.from_oci(r.config)
        except imageconfig.ConfigError as err:
            raise PullError("bad_request", f"pull {r.name}: {err}") from err
        work = self.root / r.manifest_digest.split(":", 1)[1]
        layers = [_Layer(i, desc, diff) for i, (desc, diff) in enumerate(zip(r.layers, r.diff_ids, strict=True))]
        keep_work = True        # a failed download keeps what it fetched, for the next try
        published = False
        threads = max(1, self.settings.convert_threads)
        # Temp files convert in threads of their own (as many): one waiting
        # for a slow download's next bytes holds up no complete blob. Their
        # pool is left (its threads joined) after the download, so before
        # the pinning ends.
        niced = _BelowTheDownload()
        streams = _Streams(ThreadPoolExecutor(max_workers=STREAM_SLOTS, thread_name_prefix="dsecd-pull-stream",
                                              initializer=niced.enter),
                           STREAM_SLOTS if self.settings.tmpfs_bytes else 0)
        with self.images.pinning() as hold, ThreadPoolExecutor(
                max_workers=threads, thread_name_prefix="dsecd-pull-convert",
                initializer=niced.enter) as pool, streams.pool:
            try:
                self._plan(work, layers, hold, stats)
                for layer in layers:
                    emit(layer.event(len(layers)))
                if any(layer.state != "reused" for layer in layers):
                    try:
                        self._download(r, work, layers, pool, hold, emit, cancelled, stats, streams)
                    finally:
                        streams.over.set()
                        niced.download_over()
                t = time.monotonic()
                for layer in layers:
                    if layer.future is not None:
                        layer.future.result()
                        emit(layer.event(len(layers)))
                stats["convert_s"] = time.monotonic() - t
                # A conversion from a temp file answers True (_convert_stream).
                stats["streamed_layers"] = sum(layer.future is not None and layer.future.result() is True
                                               for layer in layers)
                stored = [layer.stored for layer in layers]
                image = self.images.commit_pulled(str(r.name), stored, config, source, hold)
                keep_work = published = True
                return image
            except PullError:
                raise                  # the download failed or was cancelled: keep what it got
            except oci.TarError as err:
                keep_work = False      # the content is bad: fetching it again would not help
                raise PullError("bad_request", f"pull {r.name}: {err}") from err
            except ImageError:
                keep_work = False
                raise
            finally:
                for layer in layers:
                    if layer.future is not None:
                        layer.future.cancel()
                if published:
                    self._discard(work)
                elif not keep_work:
                    shutil.rmtree(work, ignore_errors=True)

    def _discard(self, work: Path) -> None:
        """Remove a published pull's work directory (its downloaded blobs, all
        converted now) off the pull's path: renamed out of the way at once, so
        a later pull of the same manifest starts afresh, and deleted by a
        thread of its own. Deleting the pull bench's 224 MiB of blobs took
        0.07-0.08 s on this host's ext4 (mounted -o discard: unlinking a big
        file discards its blocks), which the pull waited for before answering. One the
        daemon's exit cuts short is removed by `image gc` (sweep: a directory
        under pulls/ without a claim)."""
        trash = self.root / f"{TRASH_PREFIX}{work.name}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(work, trash)
        except OSError:
            shutil.rmtree(work, ignore_errors=True)
            return
        threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                         name="dsecd-pull-discard", daemon=True).start()

    def _plan(self, work: Path, layers: list[_Layer], hold, stats: dict) -> None:
        """Which layers the store has already (reused, with a placeholder so
        skopeo skips them) and which the work directory has from an earlier try."""
        blobs = work / "blobs" / "sha256"
        blobs.mkdir(parents=True, exist_ok=True)
        listed = work / PLACEHOLDERS
        with contextlib.suppress(FileNotFoundError):
            for digest in listed.read_text().split():       # an earlier try's: maybe collected since
                (blobs / digest.split(":", 1)[1]).unlink(missing_ok=True)
        for entry in os.scandir(work):
            if entry.name.startswith(TEMP_PREFIX):           # a download a kill cut short
                os.unlink(entry.path)
        placeholders = []
        for layer in layers:
            stored = self.images.layer_of_diff_id(layer.diff_id, hold)
            blob = blobs / layer.digest.split(":", 1)[1]
            if stored is not None:
                layer.stored, layer.state, layer.bytes = stored, "reused", layer.size
                stats["reused_layers"] += 1
                if not blob.exists():
                    with open(blob, "wb") as f:
                        f.truncate(layer.size)
                    placeholders.append(layer.digest)
            elif blob.exists():
                layer.resumed = True
                stats["resumed_layers"] += 1
        listed.write_text("".join(f"{d}\n" for d in placeholders))

    def _download(self, r: Resolved, work: Path, layers: list[_Layer], pool: ThreadPoolExecutor, hold,
                  emit: Progress, cancelled: threading.Event, stats: dict, streams: _Streams) -> None:
        """Run skopeo, and start each layer's conversion once its blob is complete."""
        blobs = work / "blobs" / "sha256"
        pending = [layer for layer in layers if layer.state != "reused"]
        log = work / "skopeo.log"
        ref = f"{r.name.repo}@{r.manifest_digest}"
        t = time.monotonic()
        try:
            proc = self.skopeo.copy(r.name.registry, ref, work, COPY_TAG, log)
        except RegistryError as err:
            raise PullError(err.code, str(err)) from err
        of = len(layers)
        try:
            while True:
                done = proc.poll() is not None
                self._watch(blobs, work, pending, pool, hold, emit, of, stats, streams, start=not done)
                for layer in pending:
                    if layer.future is not None and layer.future.done() and layer.future.exception():
                        raise layer.future.exception()
                if done:
                    break
                if cancelled.is_set():
                    raise PullError("conflict", f"pull of {r.name} cancelled; what was downloaded is kept "
                                    "for the next pull")
                if time.monotonic() - t > self.settings.timeout_s:
                    raise PullError("io", f"pull of {r.name}: the download took over "
                                    f"{self.settings.timeout_s:.0f} s (images.pull_timeout_s)")
                # Woken by skopeo's exit, not at the next tick: the last blob
                # then starts converting (and the download ends) at once.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(POLL_S)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            streams.over.set()      # skopeo renames no temp file any more
            stats["download_s"] = time.monotonic() - t
        if proc.returncode != 0:
            err = self.skopeo.copy_error(log, ref)
            raise PullError(err.code, str(err))
        missing = [layer.digest for layer in pending if layer.future is None]
        if missing:
            raise PullError("io", f"pull of {r.name}: skopeo finished but blobs {missing} are not in {blobs}")

    def _watch(self, blobs: Path, work: Path, pending: list[_Layer], pool: ThreadPoolExecutor, hold,
               emit: Progress, of: int, stats: dict, streams: _Streams, start: bool) -> None:
        """One look at the work directory: complete blobs start converting
        (or are found converting already, from their temp file); temp files'
        bytes go to the layers still downloading (module docstring), and
        with `start` a temp file starts converting while it downloads, if
        a conversion thread is idle (_convert_stream)."""
        for layer in pending:
            if layer.future is not None:
                continue
            try:
                ino = os.stat(blobs / layer.digest.split(":", 1)[1]).st_ino
            except FileNotFoundError:
                continue
            layer.bytes = layer.size
            if layer.state not in ("converting", "stored"):     # its temp file's conversion may be ahead
                layer.state = "downloaded"
            stats["downloaded_bytes"] += 0 if layer.resumed else layer.size
            layer.future = streams.by_ino.get(ino)
            if layer.future is None:
                layer.future = pool.submit(self._convert, layer, blobs, hold, emit, of)
        temps = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(work):
                if entry.name.startswith(TEMP_PREFIX):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat()
                        temps.append((st.st_ino, st.st_size))
                        if start and st.st_ino not in streams.by_ino and streams.idle():
                            self._start_stream(Path(entry.path), st.st_ino, blobs, pending, hold, emit, of,
                                               streams)
        temps.sort()
        fetching = [layer for layer in pending if layer.future is None]
        for layer in fetching:
            layer.bytes, layer.state = 0, "waiting"
        for (_, size), layer in zip(temps, fetching, strict=False):
            layer.bytes, layer.state = min(size, layer.size), "downloading"
        for layer in pending:
            key = (layer.state, layer.bytes)
            if key != layer.reported:
                layer.reported = key
                emit(layer.event(of))

    def _start_stream(self, temp: Path, ino: int, blobs: Path, pending: list[_Layer], hold, emit: Progress,
                      of: int, streams: _Streams) -> None:
        try:
            fd = os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:          # renamed meanwhile: its blob is complete
            return
        if os.fstat(fd).st_ino != ino:
            os.close(fd)
            return
        reader = _GrowingBlob(fd, temp, blobs, pending, streams.over)
        streams.by_ino[ino] = streams.pool.submit(self._convert_stream, reader, blobs, hold, emit, of)

    def _convert_stream(self, reader: _GrowingBlob, blobs: Path, hold, emit: Progress, of: int) -> bool:
        """Convert a blob while skopeo downloads it, from its temp file: the
        download of a 7-layer image ends with its layers at once (skopeo
        fetches 6 at a time), so waiting for complete blobs left all the
        conversion after it, and a core idle while it ran. Which layer the
        temp file is shows when skopeo renames it into blobs/ (the same
        inode): its digests are checked against that layer's then. A temp
        file that never becomes a blob (skopeo found it bad, or stopped)
        converts to nothing; a conversion that fails once its layer is
        known (a bad layer, ENOSPC) is done again from the complete blob,
        the way every layer converted before, which words the error. True
        when the layer was stored from its temp file."""
        layer = None
        unserved = False
        tmp = self.images.layer_temp_path()
        try:
            _, blob_digest, tar_digest = tarerofs.convert_blob(reader, tmp, f"the blob in {reader.temp.name}")
            layer = reader.layer
            oci.check_digests(f"layer {layer.digest}", blob_digest, tar_digest, layer.digest, layer.diff_id)
            layer.state = "converting"
            layer.reported = (layer.state, layer.bytes)
            emit(layer.event(of))
            stored = self.images.store_layer(tmp, hold=hold)
        except _Abandoned:
            return False
        except (oci.TarError, tarerofs.Unserved, ImageError, OSError) as err:
            layer = reader.known_layer()
            if layer is None:
                return False
            log.info("pull: converting layer %s while it downloaded failed (%s); converting its blob",
                     layer.digest, err)
            unserved = isinstance(err, tarerofs.Unserved)
            stored = None
        finally:
            reader.close()
            tmp.unlink(missing_ok=True)
        if stored is None:          # the except above: its layer is known
            self._convert(layer, blobs, hold, emit, of, direct=not unserved)
            return False
        self._record(layer, stored)
        return True

    def _convert(self, layer: _Layer, blobs: Path, hold, emit: Progress, of: int, direct: bool = True) -> None:
        """Convert a complete blob: straight into EROFS (_convert_direct),
        or, for a layer that writer does not serve (`direct` False when that
        is known already), unpacked into a tree and built with mkfs.erofs."""
        layer.state = "converting"
        layer.reported = (layer.state, layer.bytes)
        emit(layer.event(of))
        blob = blobs / layer.digest.split(":", 1)[1]
        stored = self._convert_direct(layer, blob, hold) if direct else None
        cap = self.settings.tmpfs_bytes
        if stored is None and cap and layer.size <= cap:
            stored = self._convert_in_tmpfs(layer, blob, hold, cap)
        if stored is None:
            tree = Path(tempfile.mkdtemp(prefix="pull-", dir=self.images.scratch))
            try:
                oci.extract_blob(blob, layer.digest, layer.diff_id, tree)
                stored = self.images.build_layer(tree, hold=hold)
            finally:
                shutil.rmtree(tree, ignore_errors=True)
        self._record(layer, stored)

    def _record(self, layer: _Layer, stored: dict) -> None:
        self.images.record_diff_id(layer.diff_id, stored)
        layer.stored, layer.state = stored, "stored"

    def _convert_direct(self, layer: _Layer, blob: Path, hold) -> dict | None:
        """The layer's blob written straight into an EROFS image
        (tarerofs.convert_blob: no tree, no mkfs.erofs), both digests checked,
        stored; None for a layer that writer leaves to unpack-and-mkfs (a
        sparse file, a PAX global header: tarerofs.Unserved)."""
        what = f"layer {layer.digest}"
        tmp = self.images.layer_temp_path()
        try:
            with open(blob, "rb") as raw:
                _, blob_digest, tar_digest = tarerofs.convert_blob(raw, tmp, what)
            oci.check_digests(what, blob_digest, tar_digest, layer.digest, layer.diff_id)
            return self.images.store_layer(tmp, hold=hold)
        except tarerofs.Unserved as err:
            log.info("pull: %s; unpacking it and running mkfs.erofs instead", err)
            return None
        except OSError as err:
            raise ImageError("io", f"{what}: writing its EROFS image {tmp}: {err}") from err
        finally:
            tmp.unlink(missing_ok=True)

    def _convert_in_tmpfs(self, layer: _Layer, blob: Path, hold, cap: int) -> dict | None:
        """The layer unpacked and built in a tmpfs (_in_tmpfs), or None."""
        def unpack_and_build(mnt: Path) -> dict:
            oci.extract_blob(blob, layer.digest, layer.diff_id, mnt)
            return self.images.build_layer(mnt, hold=hold)

        return self._in_tmpfs(f"layer {layer.digest}", cap, unpack_and_build)

    def _in_tmpfs(self, what: str, cap: int, work: Callable[[Path], dict]) -> dict | None:
        """work(root): unpack and build a layer in a tmpfs of at most `cap`
        bytes, mounted on an empty directory of the scratch disk for the
        conversion alone: the stored layer, or None when the layer's files
        did not fit (ENOSPC: the caller unpacks it on the disk) or there is
        no tmpfs here.

        Why not the scratch disk: unpacking is one file create per tar entry,
        and on ext4 a create scans the inode bitmap past every inode deleted
        in the last minute or more (`recently_deleted`), each deletion of the
        previous layer's tree making the next tree's creates slower; in the
        daemon under load that was 1-20 ms a create and 22-31 s for a 224 MiB
        image of 9,300 files, against ~4 s unpacked into tmpfs. Removing the
        tree is one unmount, not 9,300 unlinks (and no discards of a disk
        mounted with -o discard). The memory is taken only while the layer
        converts; the mount lives in this process's mount namespace, where
        nothing but the conversion uses it."""
        mnt = Path(tempfile.mkdtemp(prefix=MEM_PREFIX, dir=self.images.scratch))
        mode = os.stat(mnt).st_mode & 0o7777
        try:
            fd = native.upperfs_create(cap, max(1 << 16, cap >> 10))
            try:
                native.upperfs_attach(fd, str(mnt))
            finally:
                os.close(fd)
        except OSError as err:            # no tmpfs here (a container without mount rights)
            os.rmdir(mnt)
            log.warning("pull: no tmpfs for unpacking %s (%s); unpacking it on the scratch disk %s",
                        what, err, self.images.scratch)
            return None
        try:
            # The tree's root as on the disk path (a mkdtemp directory): the
            # same layer gives the same EROFS bytes whichever way it went.
            os.chmod(mnt, mode)
            return work(mnt)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            return None
        finally:
            native.umount(str(mnt), detach=True)
            os.rmdir(mnt)
