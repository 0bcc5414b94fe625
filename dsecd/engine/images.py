"""Images: the image requests (build, pull, list, inspect, rm, gc, du,
snapshot) and the layer mounts and pager behind every sandbox's image.

The blob store and layer mounts belong to dsecd/fs/; this service turns
requests into calls on them, in worker threads, streams their progress to
the client, and picks where each layer is mounted from (images.mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from .. import cgroup, imageconfig, metrics, native, protocol, sysfs
from ..config import ConfigError
from ..errors import BadRequest, Conflict, DsecError, IOFailure, image_error
from ..features import Features
from ..fs import clientpaths, erofs
from ..fs import upper as upperfs
from ..fs.clientpaths import ClientPathError, ClientPaths
from ..fs.httpstop import Stop
from ..fs.images import UNPACK_PREFIX, Image, ImageError, ImageStore
from ..fs.layers import LayerMounts, distinct_layers
from ..fs.pager import Pager, PagerConfig, PagerError, cache_cap
from ..fs.pull import Puller, PullSettings, host_os_arch
from ..fs.registry import RegistryConfig
from ..fs.store import INDEX_BLOCK, StoreError, check_index, unreachable_hint
from ..mem import pause
from .dircopies import busy
from .network import NET_FILES
from .sandboxes import SandboxRegistry
from .workers import Workers, before_stop, outcome

log = logging.getLogger(__name__)


# Store file systems where paging layers in by chunks pays: each read crosses a
# network. On local disk the pager only adds FUSE round trips (measured: +9 ms
# per create+exec+destroy on this host), so auto mounts local blobs directly.
REMOTE_FS = {"nfs", "nfs4", "ceph", "cifs", "smb3", "9p", "glusterfs", "lustre", "gpfs", "beegfs", "fuse"}
# File systems the kernel cannot back a file-backed EROFS mount with (shmem has
# no read_folio: the mount fails with ENOTBLK). A store there is paged through
# the pager's FUSE files instead.
NO_FILE_BACKED_EROFS = {"tmpfs", "ramfs"}


# The most bytes of entries one frame of a streamed image_list carries (less
# when max_frame_bytes is smaller): frames this size keep the other requests
# on the connection moving between them.
LIST_FRAME_BYTES = 1 << 20
# What a frame holds besides its entries: its id, the field names.
LIST_FRAME_ENVELOPE = 1024


def listing_frames(images: list[dict], unreadable: list[dict], max_frame: int) -> list[dict]:
    """An image_list's images and unreadable names as stream payloads
    ({"images": [...], "unreadable": [...]}), each of at most
    min(LIST_FRAME_BYTES, max_frame) bytes of entries, in the listing's
    order. An image whose entry alone is past a frame (a config of
    megabytes) cannot be sent: it is listed as unreadable, saying so."""
    room = min(LIST_FRAME_BYTES, max_frame - LIST_FRAME_ENVELOPE)
    frames: list[dict] = []
    batch: dict[str, list[dict]] = {"images": [], "unreadable": []}
    used = 0

    def add(field: str, entry: dict, size: int) -> None:
        nonlocal batch, used
        if used + size > room and (batch["images"] or batch["unreadable"]):
            frames.append(batch)
            batch, used = {"images": [], "unreadable": []}, 0
        batch[field].append(entry)
        used += size

    for image in images:
        size = len(protocol.encode_frame(image)) - protocol.HEADER.size
        if size > room:
            add("unreadable", {"name": image["name"], "error": f"its listing entry is {size} bytes, more than "
                               f"one frame holds ({room}; limits.max_frame_bytes): see `dsec image inspect "
                               f"{image['name']}`"}, 512)
        else:
            add("images", image, size)
    for entry in unreadable:
        add("unreadable", entry, len(protocol.encode_frame(entry)) - protocol.HEADER.size)
    if batch["images"] or batch["unreadable"] or not frames:
        frames.append(batch)
    return frames


def store_fstype(path: Path) -> str:
    """The type of the file system holding `path`."""
    return sysfs.fs_type(path)[0] or "unknown"


@contextlib.contextmanager
def count_image_op(kind: str):
    """Count an image build (a directory, an import), a Dockerfile build, a
    pull or a snapshot in the metrics: the body calls the yielded function
    with the image it made; leaving without it is a failure."""
    t0 = time.monotonic()
    made = []
    try:
        yield made.append
    finally:
        result = "ok" if made else "failed"
        metrics.IMAGE_BUILDS.labels(kind, result).inc()
        if made:
            metrics.IMAGE_BUILD_SECONDS.labels(kind).observe(time.monotonic() - t0)
            metrics.IMAGE_BUILD_BYTES.labels(kind).inc(made[0].size or 0)


def check_excludes(paths: list[str]) -> None:
    """A snapshot's `exclude`: paths inside the sandbox, absolute or from its
    root (`tmp` is `/tmp`, as images.snapshot_exclude writes them); a `..`
    or a NUL would reach mkfs.erofs's command line. Either backend's."""
    for path in paths:
        if ".." in path.split("/") or "\0" in path:
            raise BadRequest(f"snapshot: exclude paths must not hold '..' or NUL, got {path!r}",
                             {"exclude": path})
        if not erofs.exclude_rel(path):
            raise BadRequest(f"snapshot: exclude path {path!r} is the sandbox's root, which would leave the "
                             "whole sandbox out; name a path inside it", {"exclude": path})


# A client path's errno -> the protocol's code (the rest: io).
_CLIENT_PATH_CODES = {errno.ENOENT: "not_found", errno.ENOTDIR: "not_found", errno.EACCES: "permission",
                      errno.EPERM: "permission", errno.ELOOP: "bad_request", errno.ENAMETOOLONG: "bad_request",
                      errno.EINVAL: "bad_request"}


def check_platform(name: str, image: Image) -> None:
    """An image pulled for another platform (`image pull --platform`) cannot
    run here: its programs would fail with "exec format error" (and a
    microVM's guest is this host's architecture too). Nor can it be the base
    of a build: the image made would not say its platform."""
    platform = (image.source or {}).get("platform")
    host = host_os_arch()
    if platform and "/".join(str(platform).split("/")[:2]) != host:
        raise BadRequest(f"image {name!r} is for {platform} (pulled with --platform); this host runs {host}, "
                         f"where its programs cannot run: pull it for {host} (without --platform) to run it here",
                         {"image": name, "platform": platform, "host_platform": host})


def check_pager_config(cfg) -> None:
    """ConfigError for a pager setting the lazy pager cannot run with."""
    chunk = cfg.size("pager", "chunk_size")
    if not 4096 <= chunk <= 1 << 30 or chunk & (chunk - 1):        # as dsec-pager checks its --chunk-size
        raise ConfigError(f"pager.chunk_size must be a power of two from 4K to 1G, got {chunk} bytes: "
                          "dsec-pager takes no other")
    if cfg.section("images")["verify"] and chunk % INDEX_BLOCK:
        raise ConfigError(f"pager.chunk_size must be a multiple of {INDEX_BLOCK // 1024}K while "
                         "images.verify is on (chunks are checked in blocks of that size)")
    p, state = cfg.section("pager"), cfg.state_dir
    try:        # the rest as the pager's config takes them (its keys are pager's)
        PagerConfig(store_dir="/", cache_dir=str(state / "pager-cache"), mountpoint=str(state / "pager"),
                    chunk_size=chunk, readahead_chunks=p["readahead_chunks"],
                    bandwidth_bps=cfg.size("pager", "bandwidth_bps"), latency_us=p["latency_us"],
                    log_max_bytes=cfg.size("pager", "log_max_bytes"))
    except ValueError as err:
        raise ConfigError(f"pager.{err}") from None


def _image_made(image: dict) -> dict:
    """What a keyed snapshot's key keeps of its answer (dsecd/engine/opkeys.py):
    the image's name and manifest, whose image a snapshot sent again answers with."""
    return {"name": image["name"], "manifest": image["manifest"]}


class ImageService:
    """`images` (the store of names and manifests) and `layers` (their mounts)
    are what sandboxes are made from; `freeze_timeout_s` bounds a snapshot's
    freeze (memory.freeze_timeout_s)."""

    def __init__(self, cfg, features: Features, layout: cgroup.Layout, cgroup_root: str,
                 registry: SandboxRegistry, workers: Workers, freeze_timeout_s: float):
        self.features = features
        self.layout = layout
        self.cgroup_root = cgroup_root
        self.registry = registry
        self.workers = workers
        self.freeze_timeout_s = freeze_timeout_s
        # Set by the node: what else goes with removed layers (the microVM
        # templates of them); given the digests the store keeps, answers a list.
        self.after_gc = None
        # Set by the node: a microVM's writable layer as a host dir for snapshot
        # (VmFiles.upper_tree).
        self.vm_upper = None
        # Set by the node: the paths of a sandbox that clients are writing
        # under a temporary name now (FileService.temporaries), and that
        # directory copies under way extract into (DirCopyService.landings).
        self.temporaries = None
        self.state_dir = cfg.state_dir
        section = cfg.section("images")
        store = Path(section["store"]) if section["store"] else cfg.state_dir / "store"
        try:
            self.images = ImageStore(store, cfg.state_dir / "scratch", section["default_registry"])
            self.images.max_layer_bytes = cfg.size("images", "max_layer_bytes")
            # The most entries a client's directory copy (_read_as_client)
            # makes: as many as a directory copy into a sandbox may hold.
            self.max_copy_entries = int(cfg.section("limits")["max_tar_entries"])
        except OSError as err:
            where = f" ({err.filename})" if err.filename else ""
            raise ConfigError(f"images.store {store}: {err.strerror or err}{where}; it must name a directory "
                              "the daemon can write (under systemd: outside /usr, /etc, /home and /root, "
                              "or in a ReadWritePaths= of a drop-in)") from None
        if int(section["pull_parallel_layers"]) < 1:
            raise ConfigError(f"images.pull_parallel_layers must be at least 1, not {section['pull_parallel_layers']}")
        try:
            registries = RegistryConfig.from_section(section)
        except ValueError as err:       # images.mirrors as the registry client cannot take it
            raise ConfigError(str(err)) from None
        self.puller = Puller(self.images, registries, PullSettings(
            parallel_layers=int(section["pull_parallel_layers"]),
            tmpfs_bytes=cfg.size("images", "pull_tmpfs"), max_layer_bytes=cfg.size("images", "max_layer_bytes"),
            claim_stale_s=float(section["pull_claim_stale_s"]), timeout_s=float(section["pull_timeout_s"])))
        if int(section["max_pulls"]) < 1:
            raise ConfigError(f"images.max_pulls must be at least 1, not {section['max_pulls']}")
        self._pull_slots = asyncio.Semaphore(int(section["max_pulls"]))
        # Flattens at once: each writes the whole merged image into the
        # scratch dir before mkfs.erofs packs it. More wait their turn.
        self.max_flattens = int(section["max_flattens"])
        self._flatten_slots = asyncio.Semaphore(self.max_flattens)
        self.image_mode = self._pick_mode(section["mode"])
        self.pager = self._make_pager(cfg) if self.image_mode == "lazy" else None
        self.eager_dir = cfg.state_dir / "eager"
        # eager: the local copies are that mode's layer cache, capped as the
        # pager's is (pager.cache_max_bytes; "auto" on their file system).
        self.eager_cap = (cache_cap(cfg.section("pager")["cache_max_bytes"], str(self.eager_dir))
                          if self.image_mode == "eager" else 0)
        self.client_paths = ClientPaths(cfg.state_dir / clientpaths.DIR)
        # The store throttle of [pager] also paces eager copies, so that both
        # modes see the same emulated remote store.
        self.store_throttle = (cfg.size("pager", "bandwidth_bps"), cfg.section("pager")["latency_us"])
        self.verify_layers = bool(section["verify"])
        self._verified: set[str] = set()      # layers hashed whole by this daemon (direct mode)
        self._verify_lock = threading.Lock()
        source = {"lazy": self._lazy_source, "eager": self._eager_copy,
                  "direct": self._direct_source}[self.image_mode]
        self.layers = LayerMounts(cfg.state_dir / "layers", source, section["layer_grace_s"])
        self.snapshot_exclude = list(section["snapshot_exclude"])
        self.max_snapshot_bytes = cfg.size("images", "max_snapshot_bytes")
        self.max_frame = cfg.size("limits", "max_frame_bytes")
        self._sweep_task: asyncio.Task | None = None
        self._pager_stop = threading.Event()

    def _pick_mode(self, wanted: str) -> str:
        fstype = store_fstype(self.images.store.root)       # one mountinfo read for every choice below
        if wanted == "auto":
            remote = fstype in REMOTE_FS or fstype.startswith("fuse.")
            wanted = "lazy" if remote or fstype in NO_FILE_BACKED_EROFS else "direct"
            log.info("images.mode auto: the store is on %s, so layers are mounted %s", fstype, wanted)
        if wanted == "lazy" and not self.features.has("fuse"):
            fallback = "eager" if fstype in NO_FILE_BACKED_EROFS else "direct"
            log.warning("images.mode = lazy needs FUSE (%s); layers are mounted %s instead",
                        self.features.items["fuse"].detail, fallback)
            return fallback
        if wanted == "direct" and fstype in NO_FILE_BACKED_EROFS:
            raise ConfigError(f"images.mode = direct cannot mount layers from a store on "
                             f"{fstype} ({self.images.store.root}): the "
                             "kernel cannot back EROFS with such files; use lazy or eager")
        return wanted

    def _make_pager(self, cfg) -> Pager:
        p = cfg.section("pager")
        state = cfg.state_dir
        check_pager_config(cfg)
        group = cgroup.Group(self.layout, f"{self.cgroup_root}/.pager")
        self.pager_group = group
        procs = str(group.dirs[cgroup.V2] / "cgroup.procs") if cgroup.V2 in group.dirs else None
        return Pager(PagerConfig(
            store_dir=str(self.images.store.blobs), cache_dir=str(state / "pager-cache"),
            mountpoint=str(state / "pager"), chunk_size=cfg.size("pager", "chunk_size"),
            cache_max_bytes=cache_cap(p["cache_max_bytes"], str(state / "pager-cache")),
            readahead_chunks=p["readahead_chunks"],
            bandwidth_bps=cfg.size("pager", "bandwidth_bps"), latency_us=p["latency_us"],
            direct_io=p["direct_io"], log_path=str(state / "pager.log"),
            log_max_bytes=cfg.size("pager", "log_max_bytes"), cgroup_procs=procs))

    # Layer sources: the file a layer is mounted from, per images.mode. Each
    # one is where that mode checks the layer against its digest (images.verify;
    # docs/pager.md, "Integrity"), so a corrupt store copy fails the mount (EIO,
    # "corrupt" in the message) or, lazily, the read of the damaged chunk.

    def _eager_copy(self, digest: str) -> Path:
        """eager: the whole blob copied to local disk before its first mount,
        hashed on the way, after room was made for it under the cap. Runs
        with the layer mounts' lock held (LayerMounts.source)."""
        local = self.eager_dir / digest.split(":", 1)[1]
        if local.exists():
            with contextlib.suppress(OSError):
                os.utime(local)         # its last mount: the copies unused longest go first
        else:
            self.eager_dir.mkdir(parents=True, exist_ok=True)
            self._make_room_for_eager(digest)
            tmp = local.with_name(local.name + ".tmp")
            try:
                self.images.store.copy_out(digest, tmp, *self.store_throttle, verify=self.verify_layers)
            except StoreError as err:
                tmp.unlink(missing_ok=True)
                raise OSError(errno.EIO, f"{err}; rebuild the image or repair the store") from err
            os.rename(tmp, local)
        return local

    def _eager_copies(self) -> list[tuple[float, int, str]]:
        """(mtime, size, name) of each file in the eager dir, half-made copies too."""
        out = []
        try:
            entries = list(os.scandir(self.eager_dir))
        except FileNotFoundError:
            return out
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                st = e.stat(follow_symlinks=False)
                out.append((st.st_mtime, st.st_size, e.name))
        return out

    def _make_room_for_eager(self, digest: str) -> None:
        """Remove the copies of layers no mount holds, least recently mounted
        first, until `digest`'s copy fits under the cap with the rest. The
        copies the mounts hold may take it past the cap: said, never refused
        (a create must get its layers, as the pager serves what is pinned)."""
        if not self.eager_cap:
            return
        try:
            need = self.images.store.size(digest)
        except OSError:
            return                      # the copy fails on it, saying why
        copies = sorted(self._eager_copies())
        used = sum(size for _, size, _ in copies)
        held = {d.split(":", 1)[1] for d in self.layers.held_locked()}
        for _, size, name in copies:
            if used + need <= self.eager_cap:
                break
            if name in held or name.endswith(".tmp"):
                continue
            log.info("removing the eager copy %s (%d bytes), unused longest, to keep the copies under "
                     "pager.cache_max_bytes (%d)", name, size, self.eager_cap)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.eager_dir / name)
            used -= size
        if used + need > self.eager_cap:
            log.warning("eager copies take %d bytes with the copy of %s, past pager.cache_max_bytes (%d): "
                        "the layers mounted need the rest", used + need, digest, self.eager_cap)

    def _direct_source(self, digest: str) -> Path:
        """direct: the store file itself, hashed whole before its first mount by
        this daemon (a local store: one sequential read per layer and daemon)."""
        if self.verify_layers and digest not in self._verified:
            with self._verify_lock:
                if digest not in self._verified:
                    try:
                        self.images.store.verify(digest)
                    except StoreError as err:
                        raise OSError(errno.EIO, f"{err}; rebuild the image or repair the store") from err
                    self._verified.add(digest)
        return self.images.store.path(digest)

    def _lazy_source(self, digest: str) -> str:
        """lazy: the pager's file, after placing the layer's chunk index where the
        pager loads it at open (<cache>/<hex>.idx), so each fetch is checked."""
        if self.verify_layers:
            self._place_chunk_index(digest)
        return self.pager.blob_path(digest)

    def _place_chunk_index(self, digest: str) -> None:
        hexpart = digest.split(":", 1)[1]
        target = Path(self.pager.config.cache_dir) / f"{hexpart}.idx"
        if target.exists():        # placed earlier (the cache dir is local and ours)
            return
        index = self.images.layer_index(digest)
        if index is None:
            log.warning("layer %s has no chunk index (built by an older dsecd): the pager cannot "
                        "check what it fetches; rebuild the image to get one", digest)
            return
        try:
            data = self.images.store.read_bytes(index)      # checked against its digest
            check_index(data, self.images.store.size(digest))
        except (StoreError, OSError) as err:
            raise OSError(errno.EIO, f"chunk index {index} of layer {digest}: {err}; rebuild the image "
                          "or repair the store") from err
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.rename(tmp, target)

    def start(self) -> None:
        """Sweep the store's temp files of writes that died; start (or adopt)
        the pager and its supervisor. Blocking, in a thread."""
        swept = self.images.store.sweep_tmp()
        if swept:
            log.info("removed %d temp file(s) of writes that died from %s", len(swept), self.images.store.tmp)
        self._sweep_eager_temps()
        if self.pager is None:
            return
        try:
            self.pager_group.create()
        except OSError as err:
            if err.errno != errno.EEXIST:
                raise
        self.pager.start()
        log.info("pager on %s (pid %s, generation %d)", self.pager.config.mountpoint, self.pager.pid,
                 self.pager.generation)

        def supervise() -> None:
            try:
                self.pager.supervise(self._pager_stop, self._on_pager_restart)
            except Exception:
                log.exception("pager supervision gave up; lazy layers are unavailable until a restart")

        threading.Thread(target=supervise, name="dsecd-pager-supervisor", daemon=True).start()

    def set_cache_max(self, value: int | str) -> None:
        """pager.cache_max_bytes anew (a config reload; blocking): the running
        pager takes the new cap as an adopted one does (Pager.set_cache_max:
        SIGUSR2), and so will its next start; eager copies are capped by it
        from their next copy. OSError when the pager does not take it, which
        keeps its cap then."""
        if self.image_mode == "eager":
            self.eager_cap = cache_cap(value, str(self.eager_dir))
        if self.pager is None:
            return
        cap = cache_cap(value, self.pager.config.cache_dir)
        if not self.pager.stats().cache_max_settable:
            raise PagerError(errno.ENOTSUP, f"pager pid {self.pager.pid} was built before a running pager could "
                                            "take another cache cap")
        self.pager.set_cache_max(cap)
        self.pager.config = dataclasses.replace(self.pager.config, cache_max_bytes=cap)

    def _sweep_eager_temps(self) -> None:
        """eager: remove the half-made copies (<hex>.tmp) of a daemon killed
        while it copied a layer. No copy runs at start; a gc keeps them while
        their layer is in the store, so nothing else would."""
        try:
            entries = [e for e in os.scandir(self.eager_dir) if e.name.endswith(".tmp")]
        except FileNotFoundError:
            return
        for e in entries:
            log.info("removing the half-made eager copy %s of a daemon that died", e.name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)

    def _on_pager_restart(self, generation: int) -> None:
        done = self.layers.remount_all()
        # This runs in the pager's supervisor thread: a copy of the registry
        # in one step (a create or destroy on the loop meanwhile would end
        # an iteration of the dict itself with RuntimeError).
        users = [s.id for s in list(self.registry.by_id.values()) if set(s.layers) & set(done)]
        log.error("pager restarted (generation %d): remounted %d layer(s); sandboxes %s may see EIO "
                  "on pages their layers had not cached", generation, len(done), users)

    def stop(self, drained: bool) -> None:
        """Daemon shutdown (blocking): stop supervising. With sandboxes left, the
        pager keeps serving their layers and the next daemon adopts it; with none
        (drained), it is stopped and its mount goes."""
        self._pager_stop.set()
        if drained and self.pager is not None:
            try:
                self.layers.sweep(force=True)
                self.pager.stop()
                self.pager_group.remove()
            except OSError as err:
                log.error("stop the pager: %s", err)

    def start_layer_sweeper(self) -> None:
        async def sweep() -> None:
            period = max(1.0, self.layers.grace_s / 2)
            while True:
                await asyncio.sleep(period)
                try:
                    await self.workers.run(self.layers.sweep)
                except Exception:
                    log.exception("layer sweep failed")
                if self.pager is not None:      # its log, which it writes for as long as it lives
                    try:
                        await self.workers.run(self.pager.rotate_log)
                    except OSError as err:
                        log.warning("rotate the pager's log: %s", err)

        self._sweep_task = self.workers.loop.create_task(sweep())

    def stop_layer_sweeper(self) -> None:
        if self._sweep_task:
            self._sweep_task.cancel()

    def info(self) -> dict:
        out = {"mode": self.image_mode, "store": str(self.images.store.root)}
        if self.image_mode == "eager":
            out["eager"] = {"cache_max": self.eager_cap,
                            "cache_used": sum(size for _, size, _ in self._eager_copies())}
        if self.pager is not None:
            try:
                stats = self.pager.stats()
                out["pager"] = {"pid": self.pager.pid, "generation": self.pager.generation,
                                **dataclasses.asdict(stats)}
            except OSError as err:
                out["pager"] = {"error": str(err)}
        return out

    def _progress(self, ctx):
        def progress(p: dict) -> None:
            self.workers.loop.call_soon_threadsafe(ctx.emit_nowait, {"progress": p})

        return progress

    async def _publishing_call(self, op: str, fn, *args, slot: asyncio.Semaphore | None = None) -> dict:
        """fn(*args, cancelled) in a worker (_images_call; once `slot` is
        taken, if given), counted as image op `op`, for work that ends by
        publishing an image's name: a cancel sets `cancelled`, which fn
        looks at last just before it publishes, so a cancelled request
        publishes nothing. The image, as answered."""
        cancelled = threading.Event()
        with count_image_op(op) as done:
            try:
                image = await self._images_call(fn, *args, cancelled, slot=slot, on_cancel=cancelled.set)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            done(image)
        return image.to_dict()

    async def _images_call(self, fn, *args, slot: asyncio.Semaphore | None = None, on_cancel=None):
        """fn(*args) in a worker (holding `slot` while it runs, workers.run_in_slot),
        its store errors as the protocol's."""
        try:
            if slot is not None:
                return await self.workers.run_in_slot(slot, on_cancel, fn, *args)
            return await self.workers.run(fn, *args)
        except ImageError as err:
            raise image_error(err) from err
        except OSError as err:
            # Mostly the store's file system failing under a request (a shared
            # store whose servers went away: ENOTCONN, EIO, ESTALE): an `io`
            # error naming the file and what to check, not `internal`.
            where = f" {err.filename}" if err.filename else ""
            raise IOFailure(f"{getattr(fn, '__name__', 'image request')}:{where}: "
                            f"{err.strerror or err}; {unreachable_hint(self.images.store.root)}") from err

    async def build(self, req, ctx) -> dict:
        try:
            config = imageconfig.overrides(env=req.env, cwd=req.cwd, user=req.user, entrypoint=req.entrypoint,
                                           cmd=req.cmd, labels=req.labels, exposed_ports=req.exposed_ports)
        except imageconfig.ConfigError as err:
            raise BadRequest(f"image_build: {err}") from err
        return await self._publishing_call("build", self._build_from_client_path, ctx, req, config,
                                           self._progress(ctx))

    def _build_from_client_path(self, ctx, req, config: dict, progress,
                                cancelled: threading.Event) -> Image:
        """build_from_dir on req.source as the client of request context
        `ctx` sees it (fs/clientpaths.py; its pidfd is asked for here, in the
        worker, so that a request cancelled before it runs opens nothing). Messages and
        progress name the client's path, not where it is attached. Blocking."""
        if not os.path.isabs(req.source):
            raise ImageError("bad_request", f"build source must be an absolute path, got {req.source!r}")
        if req.parent:
            check_platform(req.parent, self.images.get(req.parent))
        reader = native.Reader(*ctx.peer_ids) if ctx.peer_ids is not None else None
        with self.client_path(ctx, req.source, "build source", "source") as source, \
                self._read_as_client(source, req.source, reader, cancelled) as source:
            def shown(text: str) -> str:
                return text.replace(source, req.source) if source != req.source else text

            def progress_shown(p: dict) -> None:
                progress({k: shown(v) if isinstance(v, str) else v for k, v in p.items()})

            try:
                return self.images.build_from_dir(source, req.name, req.parent, config, progress_shown,
                                                  cancelled=cancelled)
            except ImageError as err:
                raise ImageError(err.code, shown(str(err)), err.detail) from err

    @contextlib.contextmanager
    def _read_as_client(self, source: str, path: str, reader: native.Reader | None,
                        cancelled: threading.Event):
        """Where to build from for a client that reads `source` (attached;
        the client's `path`) as `reader`: a directory's copy in the scratch
        dir, made reading it as the client (clientpaths.copy_as), for the
        with block. mkfs.erofs and the layout reader read as root, by path,
        and the client may rename in its tree while they do. A file (a
        tarball) is the one inode the client opened, attached: read in place;
        so is everything for root (no `reader`). The copy's files may add up
        to images.max_layer_bytes, as an imported tarball's unpacking may:
        it writes every byte of a sparse file (`limit` past it)."""
        if reader is None or not os.path.isdir(source):
            yield source
            return
        # The copy's top takes the tree's owner and mode: it goes in a
        # directory of root's alone, so that the client cannot reach the
        # copy (whatever the state dir's mode) while it is read as root.
        holder = tempfile.mkdtemp(prefix=UNPACK_PREFIX, dir=self.images.scratch)
        try:
            copy = os.path.join(holder, "tree")
            os.mkdir(copy, 0o700)
            top = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                clientpaths.copy_as(top, copy, reader, cancelled.is_set, self.images.max_layer_bytes,
                                    self.max_copy_entries)
            except PermissionError as err:
                where = os.path.join(path, err.filename) if err.filename not in (None, ".") else path
                raise ImageError("permission", f"build source {path}: uid {reader.uid} (the client) may not read "
                                 f"{where}; the daemon reads for a client only what the client could read itself",
                                 {"source": path}) from None
            except clientpaths.CopyTooLarge as err:
                raise ImageError("limit", f"build source {path}: its files add up to more than "
                                 f"images.max_layer_bytes ({err.max_bytes} bytes; {os.path.join(path, err.rel)} "
                                 f"alone is {err.size}): a sparse file counts in full, as the layer holds it; "
                                 "remove large or sparse files, or raise images.max_layer_bytes",
                                 {"source": path}) from None
            except clientpaths.CopyTooMany as err:
                raise ImageError("limit", f"build source {path}: it holds more than limits.max_tar_entries "
                                 f"({err.max_entries}) files, directories and links (the copy was at "
                                 f"{os.path.join(path, err.rel)}); build from a smaller tree, or raise "
                                 "limits.max_tar_entries", {"source": path, "max_entries": err.max_entries}) \
                    from None
            except clientpaths.CopyFailed as err:
                # The client's file or the scratch dir failing (ENOSPC, EIO),
                # not the image store: said as the copy's, naming both.
                num = err.error.errno or errno.EIO
                raise ImageError("io", f"build source {path}: copying it into the daemon's scratch dir "
                                 f"({self.images.scratch}) failed at {os.path.join(path, err.rel)}: "
                                 f"{err.error.strerror or err.error}",
                                 {"source": path, "path": os.path.join(path, err.rel),
                                  "errno": errno.errorcode.get(num, "EIO")}) from None
            except clientpaths.KernelFileError as err:
                raise ImageError("permission", f"build source {path}: {err.shown(path)}", {"source": path}) from None
            except clientpaths.TreeChanged as err:
                raise ImageError("conflict", f"build source {path}: {err}; build it again when it holds still",
                                 {"source": path}) from None
            except InterruptedError:
                raise ImageError("conflict", f"build from {path} cancelled: nothing published") from None
            finally:
                os.close(top)
            yield copy
        finally:
            shutil.rmtree(holder, ignore_errors=True)

    @contextlib.contextmanager
    def client_path(self, ctx, path: str, what: str, field: str):
        """ClientPaths.reach for the client of request context `ctx`, its
        failures as ImageErrors naming `what`, with the errno and the path
        (under `field`) in their detail. Blocking."""
        reader = native.Reader(*ctx.peer_ids) if ctx.peer_ids is not None else None
        try:
            with self.client_paths.reach(ctx.peer_pidfd, path, reader) as source:
                yield source
        except ClientPathError as err:      # only reach() raises it: the body never does
            raise ImageError(_CLIENT_PATH_CODES.get(err.errno, "io"), f"{what} {err}",
                             {"errno": errno.errorcode.get(err.errno, str(err.errno)), field: path}) from err

    async def pull(self, req, ctx) -> dict:
        """A registry image into the store (fs/pull.py), at most images.max_pulls
        running at once. A cancelled request stops the download (what was
        fetched is kept for the next pull) and, like a failed one, publishes
        nothing; its slot stays taken until the pull's worker is done (layers
        it was converting finish first)."""
        cancelled = Stop()        # also ends the pull's requests under way (fs/httpstop.py)
        with count_image_op("pull") as done:
            image, stats = await self._images_call(self.puller.pull, req.ref, req.platform, self._progress(ctx),
                                                   cancelled, slot=self._pull_slots, on_cancel=cancelled.set)
            done(image)
        return {**image.to_dict(), "pull": stats}

    async def list(self, req, ctx) -> dict:
        """Every image and every name that cannot be read. With `stream`,
        they come in stream frames (listing_frames) and the result counts
        them: one answer of hundreds of images of deep layer chains is past
        max_frame_bytes, and the connection would only carry its error."""
        images, unreadable = await self._images_call(self.images.list)
        entries = [i.to_dict() for i in images]
        if not req.stream:
            return {"images": entries, "unreadable": unreadable}
        frames = await self.workers.run(listing_frames, entries, unreadable, self.max_frame)
        for frame in frames:
            await ctx.emit(frame)       # waits while the client has not read the frames before
        return {"count": sum(len(f["images"]) for f in frames),
                "unreadable_count": sum(len(f["unreadable"]) for f in frames)}

    async def inspect(self, req, ctx) -> dict:
        image = await self._images_call(self.images.get, req.name)
        ancestors, end = await self._images_call(self.images.ancestors, image)
        users = [s.id for s in self.registry.by_id.values() if s.manifest == image.manifest]
        mounted = {d: self.layers.is_mounted(d) for d in image.layer_digests}
        out = {**image.to_dict(), "sandboxes": users, "layers_mounted": mounted, "mode": self.image_mode,
               "ancestors": ancestors, "ancestors_end": end}
        if self.pager is not None:
            try:
                blobs = (await self.workers.run(self.pager.stats)).blobs
                out["pager"] = {d: dataclasses.asdict(blobs[d[7:]]) for d in image.layer_digests
                                if d[7:] in blobs}
            except OSError as err:
                out["pager"] = {"error": str(err)}
        return out

    async def rm(self, req, ctx) -> dict:
        """Removes the name only; layers stay until `image_gc`, which keeps those
        a live sandbox uses, so sandboxes on the image are unaffected. The
        result names those sandboxes: until they end, a gc frees nothing of it."""
        image = await self._images_call(self.images.remove, req.name)
        users = [s.id for s in self.registry.by_id.values()
                 if image.manifest is not None and s.manifest == image.manifest and s.state != "dead"]
        return {**image.to_dict(), "sandboxes": users}

    async def flatten(self, req, ctx) -> dict:
        """An image as one layer (ImageStore.flatten), its progress streamed;
        at most images.max_flattens at once, the others waiting their turn
        (told so: a `queued` progress step). A cancel stops it short of
        publishing, or before it begins."""
        progress = self._progress(ctx)
        if self._flatten_slots.locked():
            progress({"step": "queued", "max": self.max_flattens})
        return await self._publishing_call("flatten", self.images.flatten, req.name, req.as_name, self._mounted,
                                           progress, slot=self._flatten_slots)

    @contextlib.contextmanager
    def _mounted(self, digests: list[str]):
        """The mount dirs of an image's layers (bottom first, each once),
        held mounted for the with block as a sandbox holds them."""
        distinct = distinct_layers(digests)
        mounts = self.layers.acquire(distinct)
        try:
            yield mounts
        finally:
            self.layers.release(distinct)

    async def tag(self, req, ctx) -> dict:
        """A second name for an image (docker tag): the name moves at once if
        taken, as a build's does."""
        image = await self._images_call(self.images.tag, req.source, req.name)
        return image.to_dict()

    def _in_use(self) -> tuple[set[str], set[str]]:
        live = [s for s in self.registry.by_id.values() if s.state != "dead"]
        return {d for s in live for d in s.layers}, {s.manifest for s in live if s.manifest}

    async def gc(self, req, ctx) -> dict:
        layers, manifests = self._in_use()
        await self.workers.run(self.layers.sweep, True)
        out = await self._images_call(self.images.gc, layers, manifests)
        if self.after_gc is not None or self.image_mode == "eager":
            listed = time.time()
            live = await self.workers.run(self.images.store.all_digests)
            if self.image_mode == "eager":
                await self.workers.run(self._sweep_eager, live, listed)
            if self.after_gc is not None:
                out["vm_templates_removed"] = await self.after_gc(live)
        return out

    def _sweep_eager(self, live: set[str], listed: float) -> None:
        """eager: remove the local copies (and half-made ones) of layers the
        store no longer holds, removed by this gc or another host's, and
        that no mount of this host uses. A copy written since the store was
        listed (`listed`) is of a layer stored since, maybe being mounted:
        it stays."""
        keep = live | set(self.layers.in_use())
        try:
            entries = list(os.scandir(self.eager_dir))
        except FileNotFoundError:
            return
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                if e.stat(follow_symlinks=False).st_mtime >= listed - 1:
                    continue
            if f"sha256:{e.name.removesuffix('.tmp')}" not in keep:
                log.info("image gc: removing the eager copy %s (its layer left the store)", e.name)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)

    async def du(self, req, ctx) -> dict:
        out = await self._images_call(self.images.du, *self._in_use())
        out["mounted_layers"] = self.layers.in_use()
        out["cached_layers"] = await self._cached_layers()
        return out

    async def _cached_layers(self) -> dict[str, float]:
        """Layers paged in (images.mode lazy): digest -> the share of its
        chunks in this host's pager cache. With a shared store every host
        lists every image; this says which host already holds an image's
        bytes (dsecd.Fleet places there). Empty without a pager, or when its
        stats cannot be read (a pager restarting): nothing is known cached."""
        if self.pager is None:
            return {}
        try:
            blobs = (await self.workers.run(self.pager.stats)).blobs
        except OSError as err:
            log.debug("image_du: pager stats: %s", err)
            return {}
        return {f"sha256:{h}": round(b.cached_chunks / b.chunks, 4) for h, b in blobs.items()
                if b.chunks and b.cached_chunks}

    async def snapshot(self, req, ctx) -> dict:
        """pack_diff: freeze the sandbox, pack its upper dir as a layer, thaw
        (a paused one is packed as it is, and stays paused)."""
        check_excludes(req.exclude)
        sb = self.registry.get(req.sandbox, req)
        if req.key is None:
            return await self._snapshot_busy(sb, req, self._progress(ctx))
        at = (sb.id, req.key)
        return await self.registry.op_keys.once(sb, "snapshot", req, ctx,
                                                lambda: self._snapshot_busy(sb, req, self._keyed_progress(at)),
                                                _image_made, self._snapshot_again)

    def _keyed_progress(self, at: tuple[str, str]):
        """The progress callback (called in a worker) of the keyed snapshot
        `at` (sandbox id, key): each event goes, as it comes, to the
        requests of its key waiting for it (OpKeys.tell), not to the one
        that began it alone, whose connection may have gone (the SDK sends
        it again, and the one sent again waits for it)."""
        def progress(p: dict) -> None:
            self.workers.loop.call_soon_threadsafe(self.registry.op_keys.tell, at, {"progress": p})

        return progress

    async def _snapshot_busy(self, sb, req, progress) -> dict:
        # Busy as a directory copy out is: its idle TTL must not end the
        # sandbox while its layer is packed, and starts again at the end.
        busy(sb, 1)
        try:
            return await self._snapshot(sb, req, progress)
        finally:
            busy(sb, -1)

    async def _snapshot_again(self, made: dict) -> dict:
        """The answer of a keyed snapshot a daemon before made (`made`: its
        image's name and manifest), from the image as it is now."""
        try:
            image = await self._images_call(self.images.get, made["name"], False)
        except DsecError as err:
            if err.code != "not_found":
                raise
            image = None
        if image is None or image.manifest != made["manifest"]:
            raise Conflict(f"snapshot: the image {made['name']!r} this key made ({made['manifest']}) was since "
                           "removed or replaced; send the snapshot under another key to make it again",
                           {"name": made["name"], "manifest": made["manifest"]})
        return image.to_dict()

    async def _snapshot(self, sb, req, progress) -> dict:
        # A name taken is said before the sandbox is frozen for nothing (and
        # checked again at the commit, for one taken meanwhile).
        await self._images_call(self.images.name_free, req.name)
        base = await self._images_call(self.images.get_manifest, sb.manifest, sb.image)
        # What dsecd wrote into a networked sandbox (its resolver, its hosts) is not its image's.
        networked = bool(sb.net) and sb.net.get("mode") == "default"
        exclude = self.snapshot_exclude + list(req.exclude) + (list(NET_FILES) if networked else [])
        if sb.backend == "microvm":
            if sb.state == "paused":      # its guest is stopped or saved: no agent to stream its layer
                raise Conflict(f"sandbox {sb.id} is a paused microVM; resume it first (dsec resume {sb.id})",
                               {"sandbox": sb.id, "state": sb.state})
            async with self.vm_upper(sb, self.images.scratch, self.max_snapshot_bytes, exclude) as upper:
                image = await self._pack(upper, base, req.name, exclude + self._temporaries(sb), progress)
            return image.to_dict()
        async with self.frozen_upper(sb) as upper:
            with count_image_op("snapshot") as done:
                image = await self._pack(upper, base, req.name, exclude + self._temporaries(sb), progress)
                done(image)
        return image.to_dict()

    def _temporaries(self, sb) -> list[str]:
        """What a snapshot leaves out besides its excludes: the files clients
        are writing into the sandbox under a temporary name (an atomic
        write_file's `.dsec-<hex>`, a directory copy's landing). Those
        writes run on the host side, which a freeze does not stop; a part
        of one is not the sandbox's file, and would stay in every sandbox
        made from the image. Taken once the sandbox is frozen and its layer
        is in view, just before the pack."""
        return self.temporaries(sb.id) if self.temporaries is not None else []

    async def _pack(self, upper, base: Image, name: str, exclude: list[str], progress) -> Image:
        """images.snapshot of `upper` in a worker, its events to `progress`
        (called in the worker). Cancelled, the pack is
        stopped (its mkfs.erofs killed) or, past that, kept from publishing
        the image, and waited for: the view it reads is removed, and the
        sandbox thawed, only after it has ended, and the request's final
        frame comes after that."""
        cancelled = threading.Event()
        packing = asyncio.ensure_future(self._images_call(self.images.snapshot, upper, base, name, exclude,
                                                          progress, self.max_snapshot_bytes,
                                                          cancelled))
        try:
            return await asyncio.shield(packing)
        except asyncio.CancelledError:
            cancelled.set()
            await outcome(packing)
            raise

    @contextlib.asynccontextmanager
    async def frozen_upper(self, sb):
        """The sandbox's writable layer (its overlay upper dir) at a host path,
        the sandbox frozen meanwhile and no pause or resume in between: what
        snapshot and each filesystem step of a Dockerfile build pack."""
        async with sb.lock:
            if sb.state not in ("running", "paused") or sb.handle is None:   # changed during the awaits
                raise Conflict(f"sandbox {sb.id} is {sb.state}; snapshot needs it running or paused",
                               {"sandbox": sb.id, "state": sb.state})
            # A paused sandbox is frozen already, and stays so: packed as it is.
            was_paused = sb.state == "paused"
            # The daemon's stop cancels this request, and its thaw and the
            # view's unmount below go through the worker pool the stop then
            # shuts down: the stop waits for this request's end first.
            before_stop(asyncio.current_task())
            handle = sb.handle
            freezer = pause.Freezer.of(handle.group)
            # Frozen, its execs stand still: their run-time timeouts
            # (Sandbox.paused_for) must not count the pack, as under a pause.
            if not was_paused:
                sb.paused_at = time.monotonic()
                freezing = self.workers.behind(freezer.freeze, self.freeze_timeout_s)
                try:
                    await asyncio.shield(freezing)
                except OSError as err:      # destroyed meanwhile: its cgroup is gone
                    sb.end_paused_time()
                    raise Conflict(f"snapshot of sandbox {sb.id}: cannot freeze it ({err}); is it being destroyed?",
                                   {"sandbox": sb.id}) from err
                except asyncio.CancelledError:
                    # The freeze goes on in its thread: thawed after it, the
                    # lock still held, or the sandbox would stay frozen while
                    # its state says running (unless a job pause, which takes
                    # no lock, marked it paused meanwhile: as below).
                    await outcome(freezing)
                    await self._thaw_after_pack(sb, freezer)
                    raise
            try:
                # A destroy takes no sandbox's lock: one that came while it
                # froze has taken its handle (and is removing its layers).
                if sb.handle is not handle:
                    raise _destroyed_mid_snapshot(sb)
                # The view and the thaw are waited for whatever cancels this
                # meanwhile (a `cancel`, then the client's connection closing):
                # a worker's work not yet started would be dropped by the
                # cancel, leaving a view mounted or the sandbox frozen while
                # its state says running.
                viewing = self.workers.behind(handle.upper_view(), self.state_dir / upperfs.VIEWS_DIR)
                try:
                    upper, undo = await asyncio.shield(viewing)
                except OSError as err:
                    if sb.handle is not handle:
                        raise _destroyed_mid_snapshot(sb) from err
                    raise
                except asyncio.CancelledError:
                    made = await outcome(viewing)
                    if not isinstance(made, BaseException) and made[1] is not None:
                        await outcome(self.workers.behind(made[1]))
                    raise
                try:
                    yield upper
                finally:
                    if undo is not None:
                        undone = await outcome(self.workers.behind(undo))
                        if isinstance(undone, Exception):
                            raise undone
            finally:
                if not was_paused:
                    thawed = await self._thaw_after_pack(sb, freezer)
                    # A destroy (which does not wait for the lock) removed its
                    # cgroup meanwhile: nothing is left to thaw, and what was
                    # packed is published.
                    if isinstance(thawed, OSError) and sb.state != "stopping" and self.registry.listed(sb):
                        raise thawed

    async def _thaw_after_pack(self, sb, freezer):
        """Thaw a sandbox frozen for a pack, unless a job pause (which takes
        no sandbox's lock) came meanwhile, found it frozen and marked it
        paused: it stays frozen. The thaw's outcome (None: no thaw)."""
        if sb.state == "paused":
            return None
        thawed = await outcome(self.workers.behind(freezer.thaw))
        sb.end_paused_time()
        return thawed


def _destroyed_mid_snapshot(sb) -> Conflict:
    return Conflict(f"snapshot of sandbox {sb.id}: it was destroyed while its snapshot began",
                    {"sandbox": sb.id, "state": sb.state})
