"""`image_pull`: an image from an OCI distribution registry into the store.

    1. resolve   the manifest of the reference (an index: this host's platform's
                 entry), then the image config; each checked against its digest
    2. claim     <store>/pulls/<manifest hex>.claim (claims.py): of several hosts
                 pulling one image into a shared store, one downloads; the others
                 wait, then find its layers stored and download nothing
    3. fetch     every layer the store lacks (by diff_id, from any image;
                 one that another pull of this daemon is fetching is waited
                 for, not fetched twice), `images.pull_parallel_layers` at
                 once, each in one streaming
                 pass: its bytes read from the registry (registry.py) as they
                 arrive, decompressed (gzip, zstd) and written straight into an
                 EROFS image (tarerofs.convert_blob: entry checks, whiteouts,
                 both digests checked; no blob file, no tree on disk, no
                 mkfs.erofs), then stored and recorded under its diff_id
                 (images.py) at once. A layer that writer does not serve (a
                 sparse file, a PAX global header) is fetched again into a file
                 on the scratch disk, unpacked (oci.extract_blob) into a tmpfs of
                 its own (images.pull_tmpfs), or the scratch disk when too big
                 for it, and built with mkfs.erofs (_convert_blob_file)
    4. publish   our manifest, then the name (last: a failed pull leaves no
                 name), pointing at it with its source (ref, digest, platform)

A failed or cancelled pull keeps the layers it stored: the next pull finds
them by diff_id and fetches only the rest (a layer cut short starts again;
within a pull, a dropped connection resumes where it stopped, registry.py).

Progress goes to a callback as dicts (docs/protocol.md, image_pull): each
layer's bytes as read from the registry, exact, and its state.

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
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

from .. import imageconfig, native
from . import names, oci, tarerofs
from .claims import Claim
from .httpstop import Stop
from .images import Image, ImageError, ImageStore
from .registry import (
    DOCKER_LIST,
    DOCKER_MANIFEST,
    OCI_INDEX,
    OCI_MANIFEST,
    Registry,
    RegistryConfig,
    RegistryError,
)
from .store import DIGEST_RE, ChunkHasher

Progress = Callable[[dict], None]
log = logging.getLogger(__name__)

INDEX_TYPES = {OCI_INDEX, DOCKER_LIST}
MANIFEST_TYPES = {OCI_MANIFEST, DOCKER_MANIFEST}
LAYER_TYPES = {
    "application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd", "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
}
MEM_PREFIX = "pull-mem-"       # the mount point of a converting layer's tmpfs, in the scratch dir
BLOB_PREFIX = "pull-blob-"     # a blob fetched into a file for unpack-and-mkfs, in the scratch dir
TREE_PREFIX = "pull-tree-"     # a layer unpacked on the scratch disk (too big for its tmpfs)
POLL_S = 0.2                   # how often progress is reported and a cancel looked for
READ_PIECE = 1 << 20
ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x",
        "riscv64": "riscv64", "i686": "386"}


# One part of an os/arch/variant platform, as image indexes spell them.
PLATFORM_PART_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")


def host_os_arch() -> str:
    machine = host_platform.machine()
    return f"linux/{ARCH.get(machine, machine)}"


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class PullError(ImageError):
    """A pull that failed; code as for ImageError."""


@dataclass
class PullSettings:
    parallel_layers: int = 3        # layers fetched and converted at once
    tmpfs_bytes: int = 1 << 30      # cap of the tmpfs a layer is unpacked into (0: the scratch disk)
    max_layer_bytes: int = 0        # the most a layer may unpack to (0: no bound)
    claim_stale_s: float = 60.0
    timeout_s: float = 3600.0


@dataclass
class Resolved:
    """What step 1 found: the image manifest to fetch and its config."""

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
    """One layer's part of a pull, and what the progress reports of it.
    Written by the thread fetching it, read by the one reporting progress."""

    def __init__(self, index: int, desc: dict, diff_id: str):
        self.index = index
        self.digest = desc["digest"]
        self.size = int(desc["size"])
        self.diff_id = diff_id
        self.state = "waiting"       # waiting downloading converting stored | reused
        self.bytes = 0               # of its blob, read from the registry by the current try
        self.received = 0            # every byte of it read from the registry (a refetch counts twice)
        self.fetched_at: float | None = None    # time.monotonic() when its last byte came
        self.stored: dict | None = None
        self.future: Future | None = None
        self.reported: tuple = ()

    def event(self, of: int) -> dict:
        return {"step": "pull", "layer": self.index, "of": of, "digest": self.digest, "size": self.size,
                "bytes": self.bytes, "state": self.state}


class _Final(PullError):
    """A pull's end whatever the source: a cancel, the claim wait's or the
    pull's timeout (a mirror's failure otherwise sends the pull on)."""


class _Stopped(Exception):
    """The pull stopped (cancelled, timed out, another layer failed): a
    layer's fetch ends at its next piece."""


class _Stop:
    """A pull's stop, set once (a cancel, the timeout, a failed layer). Every
    blob stream of the pull is opened with its httpstop.Stop (open(): a
    stream's request under way, connecting or awaiting its answer, then
    fails at once, and one retrying or backing off gives up before its next
    try), and the streams open then are aborted (BlobStream.abort), so a
    thread blocked on a stalled connection returns at once instead of after
    its timeouts and retries, and the pull (its max_pulls slot, its claim)
    ends promptly."""

    def __init__(self):
        self._event = Stop()
        self._lock = threading.Lock()
        self._open: set = set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def open(self, registry: Registry, layer: _Layer):
        """The layer's blob stream, stopped with the pull (watching() it too)."""
        return self.watching(registry.open_blob(layer.digest, layer.size, stop=self._event))

    def set(self) -> None:
        with self._lock:
            self._event.set()
            streams = list(self._open)
        for stream in streams:
            stream.abort()

    @contextlib.contextmanager
    def watching(self, stream):
        """`stream` (opened with the stop's event) for the block's time:
        aborted if the pull stops, closed after. A stop that came before
        the stream was added needs no abort: the stream's reads see its
        event set and raise."""
        with self._lock:
            self._open.add(stream)
        try:
            yield stream
        finally:
            with self._lock:
                self._open.discard(stream)
            stream.close()


class _LayerReader:
    """A layer's blob as the registry sends it, read by its converter:
    counts the bytes (the progress), marks the end of its download, and
    stops at the next piece once the pull stops. A refetch (the blob read
    again for unpack-and-mkfs) shows the larger of its count and what the
    first read had shown, so the progress never goes back."""

    def __init__(self, stream, layer: _Layer, stop: _Stop, refetch: bool = False):
        self.stream = stream
        self.layer = layer
        self.stop = stop
        self.got = 0
        if not refetch:
            layer.bytes, layer.state, layer.fetched_at = 0, "downloading", None

    def read(self, size: int = -1) -> bytes:
        if self.stop.is_set():
            raise _Stopped(f"layer {self.layer.digest}: the pull stopped")
        data = self.stream.read(size if size > 0 else READ_PIECE)
        if data:
            self.got += len(data)
            self.layer.received += len(data)
            self.layer.bytes = max(self.layer.bytes, self.got)
        elif self.layer.fetched_at is None:
            self.layer.fetched_at = time.monotonic()
            self.layer.state = "converting"     # what is left: the image's metadata, then storing it
        return data


class Puller:
    def __init__(self, images: ImageStore, registry_cfg: RegistryConfig, settings: PullSettings):
        self.images = images
        self.registry_cfg = registry_cfg
        self.settings = settings
        self.root = images.store.root / "pulls"      # the claims
        # Layers a pull of this daemon is fetching, by diff_id, each with the
        # event set when that fetch ends: a concurrent pull of another image
        # on the same base waits for it instead of downloading it again.
        self._fetching: dict[str, threading.Event] = {}
        self._fetching_lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Unmount and remove the conversion tmpfs (_in_tmpfs) and remove the
        blob files and on-disk trees (_convert_blob_file) a killed daemon
        left in its scratch directory (the tmpfs's memory is held until the
        unmount), and old downloads under pulls/."""
        for entry in self.images.scratch.glob(f"{MEM_PREFIX}*"):
            try:
                if os.path.ismount(entry):
                    native.umount(str(entry), detach=True)
                shutil.rmtree(entry, ignore_errors=True)
            except OSError as err:
                log.warning("pull: cannot remove the leftover conversion tmpfs %s: %s", entry, err)
        for entry in self.images.scratch.glob(f"{BLOB_PREFIX}*"):
            with contextlib.suppress(OSError):
                entry.unlink()
        for entry in self.images.scratch.glob(f"{TREE_PREFIX}*"):
            shutil.rmtree(entry, ignore_errors=True)
        # pulls/ holds claims only; a directory there is the download of an
        # earlier dsecd's pull (it kept one per manifest): removed unless a
        # pull of that manifest, by such a daemon on a shared store, runs now.
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                if entry.is_dir(follow_symlinks=False) and not (self.root / f"{entry.name}.claim").exists():
                    shutil.rmtree(entry.path, ignore_errors=True)

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

    def _fetch_manifest(self, registry: Registry, name: names.ImageName, digest: str | None,
                        stop: Stop | None = None) -> tuple[bytes, dict]:
        ref = f"{name.repo}@{digest}" if digest else str(name)
        data = registry.manifest(digest or name.tag, stop)
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

    def resolve(self, registry: Registry, name: names.ImageName, wanted: str, stop: Stop | None = None) -> Resolved:
        """The image manifest for `wanted` and its config, checked; `stop`
        ends a request under way (RegistryError "conflict")."""
        data, top = self._fetch_manifest(registry, name, name.digest, stop)
        top_digest = _sha256(data)
        index_digest = None
        if self._kind(top, f"manifest of {name}") == "index":
            index_digest = top_digest
            child = self._pick(top, wanted, f"index {name}")
            if child == top_digest:
                raise PullError("io", f"index {name} lists itself as the {wanted} image; refusing to loop")
            data, top = self._fetch_manifest(registry, name, child, stop)
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
        cfg_data = registry.blob(cfg_digest, stop=stop)
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
             cancelled: Stop | None = None) -> tuple[Image, dict]:
        """Pull `ref` for `wanted` (os/arch, default: this host's): (image,
        stats). From the registry's mirrors first (images.mirrors): a pull
        that fails at one goes on to the next source, unless it is _Final;
        the layers a failed source stored stay, and the next one reuses
        them. `cancelled`, set from any thread, stops the pull at once, also
        its requests under way."""
        t0 = time.monotonic()
        deadline = t0 + self.settings.timeout_s         # one for all sources
        emit = progress or (lambda p: None)
        cancelled = cancelled if cancelled is not None else Stop()
        name = self.reference(ref)
        wanted = wanted or host_os_arch()
        if len(wanted.split("/")) not in (2, 3) or not all(map(PLATFORM_PART_RE.fullmatch, wanted.split("/"))):
            raise PullError("bad_request", f"platform {wanted!r}: want os/arch or os/arch/variant, each part "
                            "lowercase letters, digits, '.', '_' or '-' (linux/amd64, linux/arm64/v8)")
        sources = self.registry_cfg.sources(name.registry, name.repository)
        stats = {"downloaded_bytes": 0}                 # from every source tried
        for i, source in enumerate(sources):
            try:
                cfg = replace(self.registry_cfg, connect_retries=0) if source.mirror else self.registry_cfg
                with Registry(cfg, source.registry, source.repository) as registry:
                    image = self._pull_from(registry, name, wanted, emit, cancelled, stats, deadline)
                break
            except _Final:
                raise
            except (PullError, RegistryError) as err:
                if cancelled.is_set() or i == len(sources) - 1:
                    if isinstance(err, RegistryError):     # a client that could not be made: its TLS files
                        raise PullError(err.code, str(err)) from err
                    raise
                if time.monotonic() > deadline:
                    raise _Final("io", f"pull of {name}: {source} failed ({err}), and the pull took over "
                                 f"{self.settings.timeout_s:.0f} s (images.pull_timeout_s)") from err
                log.warning("pull of %s: %s failed, trying %s: %s", name, source, sources[i + 1], err)
                emit({"step": "mirror", "mirror": source.registry, "next": sources[i + 1].registry,
                      "error": str(err)})
        stats["registry"] = source.registry
        stats["total_s"] = time.monotonic() - t0
        return image, stats

    def _pull_from(self, registry: Registry, name: names.ImageName, wanted: str, emit: Progress,
                   cancelled: Stop, stats: dict, deadline: float) -> Image:
        """The pull from one source; `stats` filled in (downloaded_bytes added to)."""
        stats.update(reused_layers=0, waited_s=0.0, download_s=0.0, convert_s=0.0)
        try:
            resolved = self.resolve(registry, name, wanted, cancelled)
        except RegistryError as err:
            raise PullError(err.code, str(err)) from err
        source = {"ref": str(name), "digest": resolved.manifest_digest, "platform": wanted,
                  "index": resolved.index_digest}
        total = sum(int(layer["size"]) for layer in resolved.layers)
        emit({"step": "resolve", "ref": str(name), "registry": registry.registry, "digest": resolved.manifest_digest,
              "platform": wanted, "layers": len(resolved.layers), "bytes": total})
        current = self._current(name, source)
        if current is not None:
            stats["up_to_date"] = True
            return current
        hexpart = resolved.manifest_digest.split(":", 1)[1]
        claim = Claim(self.root / f"{hexpart}.claim", self.settings.claim_stale_s)
        waited = time.monotonic()

        def on_wait(holder: dict) -> None:
            emit({"step": "wait", "holder": f"{holder.get('host')} pid {holder.get('pid')}",
                  "age_s": round(holder.get("age_s", 0.0), 1)})

        try:
            claim.acquire(on_wait, cancelled, max(0.0, deadline - time.monotonic()))
        except InterruptedError:
            raise _Final("conflict", f"pull of {name} cancelled while another pull of it ran") from None
        except TimeoutError as err:
            raise _Final("busy", f"pull of {name}: {err.strerror}; retry later") from None
        stats["waited_s"] = time.monotonic() - waited
        try:
            return self._pull_claimed(registry, resolved, source, emit, cancelled, stats, deadline)
        finally:
            claim.release()

    def _current(self, name: names.ImageName, source: dict) -> Image | None:
        """The image `name` already is, if it came from the same manifest."""
        with contextlib.suppress(ImageError):
            image = self.images.get(str(name))
            if image.name == str(name) and image.source and image.source.get("digest") == source["digest"]:
                return image
        return None

    def _pull_claimed(self, registry: Registry, r: Resolved, source: dict, emit: Progress,
                      cancelled: Stop, stats: dict, deadline: float) -> Image:
        current = self._current(r.name, source)      # published by the claim's previous holder
        if current is not None:
            stats["up_to_date"] = True
            return current
        try:                    # a config we cannot honour fails before anything is downloaded
            config = imageconfig.from_oci(r.config)
        except imageconfig.ConfigError as err:
            raise PullError("bad_request", f"pull {r.name}: {err}") from err
        layers = [_Layer(i, desc, diff) for i, (desc, diff) in enumerate(zip(r.layers, r.diff_ids, strict=True))]
        with self.images.pinning() as hold:
            for layer in layers:
                stored = self.images.layer_of_diff_id(layer.diff_id, hold)
                if stored is not None:
                    layer.stored, layer.state, layer.bytes = stored, "reused", layer.size
                    stats["reused_layers"] += 1
                emit(layer.event(len(layers)))
            try:
                self._fetch(registry, r, layers, hold, emit, cancelled, stats, deadline)
            except oci.DigestMismatch as err:       # the registry's fault, as a truncated blob is
                raise PullError("io", f"pull {r.name}: {err}") from err
            except oci.HostLacks as err:
                raise PullError("unsupported", f"pull {r.name}: {err}") from err
            except oci.LayerTooLarge as err:
                raise PullError("limit", f"pull {r.name}: {err}") from err
            except oci.TarError as err:             # the image's: unsafe entries, a diff_id that lies
                raise PullError("bad_request", f"pull {r.name}: {err}") from err
            try:
                # The cancel is looked at again just before the name is linked.
                return self.images.commit_pulled(str(r.name), [layer.stored for layer in layers], config, source,
                                                 hold, cancelled)
            except ImageError as err:
                if cancelled.is_set():
                    raise _Final("conflict", f"pull of {r.name} cancelled: nothing published; the layers it "
                                 "stored are kept for the next pull") from err
                raise

    def _fetch(self, registry: Registry, r: Resolved, layers: list[_Layer], hold, emit: Progress,
               cancelled: Stop, stats: dict, deadline: float) -> None:
        """Fetch and convert every layer not reused, pull_parallel_layers at
        once (_fetch_layer), reporting progress every POLL_S until all are
        stored. The first failure, a cancel or the timeout stops the others
        at their next piece; the layers stored by then stay (a next pull
        reuses them). A layer whose diff_id an earlier one of the image has
        too is not fetched: it takes that one's stored layer. Returns once no
        thread of it runs any more."""
        todo, repeats = self._distinct([layer for layer in layers if layer.state != "reused"])
        if not todo:
            return
        of = len(layers)
        stop = _Stop()
        t = time.monotonic()
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.settings.parallel_layers, len(todo))),
                                  thread_name_prefix="dsecd-pull")
        try:
            for layer in todo:
                layer.future = pool.submit(self._fetch_layer, registry, layer, hold, stop)
            running = {layer.future for layer in todo}
            while running:
                done, running = wait(running, timeout=POLL_S, return_when=FIRST_EXCEPTION)
                self._report(todo, emit, of)
                for future in done:
                    if future.exception() is not None:
                        raise future.exception()
                if cancelled.is_set():
                    raise _Final("conflict", f"pull of {r.name} cancelled; the layers it stored are kept "
                                 "for the next pull")
                if time.monotonic() > deadline:
                    raise _Final("io", f"pull of {r.name}: the pull took over {self.settings.timeout_s:.0f} s "
                                 "(images.pull_timeout_s); the layers it stored are kept for the next pull")
        finally:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            ends = [layer.fetched_at for layer in todo if layer.fetched_at is not None]
            stats["downloaded_bytes"] += sum(layer.received for layer in todo)
            stats["download_s"] = (max(ends) if ends else time.monotonic()) - t
            stats["convert_s"] = max(0.0, time.monotonic() - t - stats["download_s"])
        for layer, first in repeats.items():
            layer.stored, layer.state, layer.bytes = first.stored, "reused", layer.size
            stats["reused_layers"] += 1
        self._report(todo + list(repeats), emit, of)

    @staticmethod
    def _distinct(layers: list[_Layer]) -> tuple[list[_Layer], dict[_Layer, _Layer]]:
        """The layers to fetch, one per diff_id (older images repeat one, an
        empty layer say), and each repeat mapped to the layer fetched for it."""
        first: dict[str, _Layer] = {}
        repeats: dict[_Layer, _Layer] = {}
        for layer in layers:
            if layer.diff_id in first:
                repeats[layer] = first[layer.diff_id]
            else:
                first[layer.diff_id] = layer
        return list(first.values()), repeats

    @staticmethod
    def _report(layers: list[_Layer], emit: Progress, of: int) -> None:
        """An event for each layer whose state or bytes changed since its last one."""
        for layer in layers:
            key = (layer.state, layer.bytes)
            if key != layer.reported:
                layer.reported = key
                emit(layer.event(of))

    def _fetch_layer(self, registry: Registry, layer: _Layer, hold, stop: _Stop) -> None:
        """One layer, fetched and converted (_stream_layer, else
        _convert_blob_file), stored and recorded under its diff_id; or,
        when another pull of this daemon stored it meanwhile (images on one
        base pulled at once), that layer, waited for (_claim_fetch)."""
        if not self._claim_fetch(layer, hold, stop):
            return
        try:
            self._fetch_claimed(registry, layer, hold, stop)
        finally:
            with self._fetching_lock:
                self._fetching.pop(layer.diff_id).set()

    def _claim_fetch(self, layer: _Layer, hold, stop: _Stop) -> bool:
        """True once this thread is the one to fetch the layer's diff_id; False
        when it is stored by now (the layer then reused, pinned by `hold`). A
        fetch by another pull is waited for; if it failed, this one goes on."""
        while True:
            with self._fetching_lock:
                stored = self.images.layer_of_diff_id(layer.diff_id, hold)
                other = None if stored is not None else self._fetching.get(layer.diff_id)
                if stored is None and other is None:
                    self._fetching[layer.diff_id] = threading.Event()
                    return True
            if stored is not None:
                layer.stored, layer.state, layer.bytes = stored, "reused", layer.size
                return False
            while not other.wait(POLL_S):
                if stop.is_set():
                    raise _Stopped(f"layer {layer.digest}: the pull stopped")

    def _fetch_claimed(self, registry: Registry, layer: _Layer, hold, stop: _Stop) -> None:
        try:
            stored = self._stream_layer(registry, layer, hold, stop)
            if stored is None:
                stored = self._convert_blob_file(registry, layer, hold, stop)
        except RegistryError as err:
            raise PullError(err.code, str(err)) from err
        self.images.record_diff_id(layer.diff_id, stored)
        layer.stored, layer.state = stored, "stored"

    def _stream_layer(self, registry: Registry, layer: _Layer, hold, stop: _Stop) -> dict | None:
        """The layer's blob, as it arrives, written straight into an EROFS
        image (tarerofs.convert_blob: no blob file, no tree, no mkfs.erofs),
        both digests checked, stored; None for a layer that writer leaves
        to unpack-and-mkfs (a sparse file, a PAX global header: tarerofs.Unserved)."""
        what = f"layer {layer.digest}"
        tmp = self.images.layer_temp_path()
        chunks = ChunkHasher()
        try:
            with stop.open(registry, layer) as stream:
                _, blob_digest, tar_digest = tarerofs.convert_blob(
                    _LayerReader(stream, layer, stop), tmp, what, digest=layer.digest, chunks=chunks,
                    max_bytes=self.settings.max_layer_bytes)
            oci.check_digests(what, blob_digest, tar_digest, layer.digest, layer.diff_id)
            return self.images.store_layer(tmp, hold=hold, chunks=chunks)
        except tarerofs.Unserved as err:
            log.info("pull: %s; fetching its blob again to unpack it and run mkfs.erofs", err)
            return None
        except OSError as err:
            raise ImageError("io", f"{what}: writing its EROFS image {tmp}: {err.strerror or err}; free space "
                             f"on the file system of {tmp.parent}") from err
        finally:
            tmp.unlink(missing_ok=True)

    def _convert_blob_file(self, registry: Registry, layer: _Layer, hold, stop: _Stop) -> dict:
        """A layer the direct writer does not serve: its blob fetched again
        (_LayerReader's refetch) into a file on the scratch disk, unpacked
        into a tmpfs (_in_tmpfs), or the scratch disk when too big for it,
        and built with mkfs.erofs; the file and the tree removed after."""
        fd, name = tempfile.mkstemp(prefix=BLOB_PREFIX, dir=self.images.scratch)
        blob = Path(name)
        try:
            with os.fdopen(fd, "wb") as out, stop.open(registry, layer) as stream:
                reader = _LayerReader(stream, layer, stop, refetch=True)
                while piece := reader.read(READ_PIECE):
                    out.write(piece)
            cap = self.settings.tmpfs_bytes
            stored = self._convert_in_tmpfs(layer, blob, hold, cap) if cap and layer.size <= cap else None
            if stored is None:
                tree = Path(tempfile.mkdtemp(prefix=TREE_PREFIX, dir=self.images.scratch))
                try:
                    oci.extract_blob(blob, layer.digest, layer.diff_id, tree, self.settings.max_layer_bytes)
                    stored = self.images.build_layer(tree, hold=hold)
                finally:
                    shutil.rmtree(tree, ignore_errors=True)
            return stored
        finally:
            blob.unlink(missing_ok=True)

    def _convert_in_tmpfs(self, layer: _Layer, blob: Path, hold, cap: int) -> dict | None:
        """The layer unpacked and built in a tmpfs (_in_tmpfs), or None."""
        def unpack_and_build(mnt: Path) -> dict:
            oci.extract_blob(blob, layer.digest, layer.diff_id, mnt, self.settings.max_layer_bytes)
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
