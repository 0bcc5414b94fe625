"""The lazy pager: start, adopt, supervise and stop dsec-pager (csrc/pager/).

dsec-pager is a FUSE daemon that shows every blob of the store directory as a
read-only file ``<mountpoint>/<hex>`` and pages it in by chunks through a
persistent local cache (docs/pager.md). This module runs it for the daemon:

* ``Pager.start()`` spawns it and returns once the mount answers, or adopts a
  pager a previous daemon left running on the same mountpoint (layers mounted
  over its files stay valid across daemon restarts), found by its mount or,
  when that mount is in another mount namespace, by the pid it recorded;
* ``Pager.supervise()`` waits for it to die and restarts it on the same
  mountpoint (lazy-unmounting the dead FUSE mount first), calling back so the
  daemon can remount the layers that sat on the dead mount;
* ``Pager.stats()`` reads its counters from ``<mountpoint>/.stats``;
* ``Pager.stop()`` stops it (SIGTERM: unmount, cache closed cleanly).

Every call blocks (process waits, mounts, file reads on a FUSE mount): call
them from a worker thread, never from the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from dsecd import native, pinned, sysfs

log = logging.getLogger("dsecd.fs.pager")

FSTYPE = "fuse.dsec-pager"
HEX_RE = re.compile(r"^[0-9a-f]{64}$")


class PagerError(OSError):
    """The pager did not start, or its mount cannot be used."""


def pager_binary_path() -> str:
    """dsecd/libexec/dsec-pager, built by setup.py from csrc/pager/, as the
    daemon's copy of its code holds it (dsecd/pinned.py)."""
    return str(pinned.libexec("dsec-pager"))


def blob_hex(digest: str) -> str:
    """'sha256:<hex>' or '<hex>' -> '<hex>'; anything else is a ValueError."""
    hexpart = digest.removeprefix("sha256:")
    if not HEX_RE.match(hexpart):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexpart


# pager.cache_max_bytes = "auto": the cache may fill this share of the file
# system it is on. The state dir's file system holds the journal too (a
# write that fails there fails creates), and by default the image store:
# an uncapped cache of a big image set filled it.
CACHE_AUTO_SHARE = 0.25


def cache_cap(value: int | str, cache_dir: str) -> int:
    """pager.cache_max_bytes in bytes (0: no cap): "auto" is CACHE_AUTO_SHARE
    of the size of the file system that holds `cache_dir` (or, before it is
    made, its nearest existing parent), else the size given."""
    from ..config import parse_size

    if value != "auto":
        return parse_size(value)
    where = Path(cache_dir)
    while not where.exists() and where != where.parent:
        where = where.parent
    st = os.statvfs(where)
    return max(1, int(st.f_blocks * st.f_frsize * CACHE_AUTO_SHARE))


@dataclass(frozen=True)
class PagerConfig:
    store_dir: str          # the blobs, one file per digest: <store_dir>/<hex>
    cache_dir: str          # chunk cache: <hex>.data (sparse) + <hex>.bitmap
    mountpoint: str
    chunk_size: int = 1 << 20
    cache_max_bytes: int = 0        # 0 = no cap
    readahead_chunks: int = 4
    readahead_threads: int = 2
    threads: int = 16               # FUSE worker threads
    bandwidth_bps: int = 0          # store throttle (benches): 0 = none
    latency_us: int = 0             # store throttle per fetch
    direct_io: bool = True          # no page cache on the FUSE files: the EROFS mount
                                    # above caches (else the host holds pages twice)
    log_path: str | None = None     # the pager's stderr (appended); None = the daemon's
    log_max_bytes: int = 0          # past it the log is rotated (rotate_log); 0 = never
    cgroup_procs: str | None = None  # cgroup.procs the pager is moved to once spawned (a
                                     # group outside the daemon's, so that it outlives it)
    start_timeout_s: float = 10.0
    max_restarts: int = 5           # within restart_window_s, then supervise() gives up
    restart_window_s: float = 60.0

    @property
    def pid_file(self) -> str:
        """Where a started pager's pid is recorded: <mountpoint>.pid. A daemon
        that systemd restarts gets a new mount namespace (the unit's
        PrivateMounts=, ProtectSystem=, ...) and cannot see the FUSE mount of
        the pager it should adopt: it finds the pager by this pid instead."""
        return self.mountpoint.rstrip("/") + ".pid"

    def __post_init__(self):
        for name in ("store_dir", "cache_dir", "mountpoint"):
            if not os.path.isabs(getattr(self, name)):
                raise ValueError(f"{name} must be an absolute path: {getattr(self, name)!r}")
        cs = self.chunk_size
        if cs < 4096 or cs > 1 << 30 or cs & (cs - 1):
            raise ValueError(f"chunk_size must be a power of two in [4096, 1 GiB]: {cs}")
        for name in ("cache_max_bytes", "readahead_threads", "bandwidth_bps", "latency_us", "log_max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0 <= self.readahead_chunks <= 1024:
            raise ValueError("readahead_chunks must be in [0, 1024]")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")

    def argv(self, binary: str, ready_fd: int) -> list[str]:
        return [
            binary,
            "--store", self.store_dir,
            "--cache", self.cache_dir,
            "--chunk-size", str(self.chunk_size),
            "--cache-max", str(self.cache_max_bytes),
            "--readahead", str(self.readahead_chunks),
            "--readahead-threads", str(self.readahead_threads),
            "--threads", str(self.threads),
            "--bandwidth", str(self.bandwidth_bps),
            "--latency-us", str(self.latency_us),
            "--ready-fd", str(ready_fd),
            *(["--direct-io"] if self.direct_io else []),
            *(["--log", self.log_path] if self.log_path else []),
            self.mountpoint,
        ]


@dataclass(frozen=True)
class BlobStats:
    size: int
    chunks: int
    cached_chunks: int
    kernel_read_bytes: int   # bytes the kernel read through the pager
    reads: int
    fetched_bytes: int       # bytes read from the store (misses and read-ahead)
    fetches: int
    chunk_hits: int
    chunk_misses: int
    readahead_chunks: int
    evictions: int
    errors: int              # failed fetches (the store's I/O, a truncated blob)
    uncached: int = 0        # fetched chunks its cache could not keep (its disk full); a read's was served
    verified_bytes: int = 0  # fetched bytes checked against the layer's chunk index
    corrupt: int = 0         # fetched blocks that did not match it (readers got EIO)
    verified: bool = False   # the blob has a chunk index loaded: fetches are checked


@dataclass(frozen=True)
class LatencyHistogram:
    """The pager's fetch latency: `counts[i]` fetches took <= `bounds_ns[i]`
    (and more than the bound before), the last count took longer than every
    bound; not cumulative. Since the pager started."""

    bounds_ns: tuple[int, ...]
    counts: tuple[int, ...]        # len(bounds_ns) + 1
    sum_ns: int

    @property
    def count(self) -> int:
        return sum(self.counts)

    @classmethod
    def parse(cls, doc: dict) -> LatencyHistogram:
        bounds = tuple(int(b) for b in doc["bounds_ns"])
        counts = tuple(int(c) for c in doc["counts"])
        if len(counts) != len(bounds) + 1 or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"malformed latency histogram in .stats: {len(bounds)} bounds "
                             f"(must increase), {len(counts)} counts (must be one more)")
        return cls(bounds, counts, int(doc["sum_ns"]))


@dataclass(frozen=True)
class PagerStats:
    pid: int
    chunk_size: int
    cache_max: int
    cache_used: int
    blobs: dict[str, BlobStats]
    # Wall time of each successful fetch (docs/pager.md); None from a pager
    # older than the histogram (one adopted across an upgrade).
    fetch_latency: LatencyHistogram | None = None
    # It reopens its log (--log) on SIGUSR1; False from a pager older than
    # that, which SIGUSR1 would kill.
    log_reopen: bool = False
    # It takes a new cache cap on SIGUSR2 (Pager.set_cache_max); False from
    # an older pager, which SIGUSR2 would kill.
    cache_max_settable: bool = False


def parse_stats(text: str) -> PagerStats:
    """Parse the JSON of <mountpoint>/.stats (version 1)."""
    doc = json.loads(text)
    if doc.get("version") != 1:
        raise ValueError(f"unknown .stats version {doc.get('version')!r}")
    names = [f.name for f in fields(BlobStats)]
    # The integrity fields came later: a pager adopted across an upgrade lacks them.
    optional = {"verified_bytes", "corrupt", "verified", "uncached"}
    blobs = {h: BlobStats(**{n: bool(b[n]) if n == "verified" else int(b[n])
                             for n in names if n in b or n not in optional}) for h, b in doc["blobs"].items()}
    latency = doc.get("fetch_latency")          # so did the histogram
    return PagerStats(int(doc["pid"]), int(doc["chunk_size"]), int(doc["cache_max"]),
                      int(doc["cache_used"]), blobs,
                      LatencyHistogram.parse(latency) if latency is not None else None,
                      bool(doc.get("log_reopen", False)), bool(doc.get("cache_max_settable", False)))


def pager_mounts(mountpoint: str, mountinfo: str = "/proc/self/mountinfo") -> int:
    """How many dsec-pager FUSE mounts are stacked on mountpoint."""
    target = os.path.realpath(mountpoint)
    count = 0
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts = left.split()
            if len(parts) > 4 and sysfs.unescape_mount_field(parts[4]) == target \
                    and right.split(" ", 1)[0] == FSTYPE:
                count += 1
    return count


class Pager:
    """One dsec-pager on one mountpoint. Not thread-safe (one owner thread), but
    for rotate_log, which the daemon's periodic check calls too."""

    def __init__(self, config: PagerConfig, binary: str | None = None):
        self.config = config
        self.binary = binary or pager_binary_path()
        self.generation = 0      # +1 at every (re)start or adoption; layers remember it
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        # The pager's pidfd, our child's as an adopted one's: every signal
        # goes through it. It names that one process until closed, reaped or
        # not, so a signal after its exit fails (ESRCH) rather than reaching
        # a process that reused the pid; the supervising thread reaps our
        # child without the log's lock, between a rotation's look and its signal.
        self._pidfd: int | None = None
        self._pid: int | None = None
        # "" while the pager's mount is in our mount namespace; "/proc/<pid>/root"
        # for a pager adopted from another one, whose mount we reach through its root.
        self._view = ""
        # rotate_log runs on the thread that (re)starts the pager and on
        # the daemon's periodic check: they take turns, one temp copy each;
        # and the process is forgotten (its pidfd closed) only between two
        # rotations, never under one's signal.
        self._log_lock = threading.RLock()

    # ---------------------------------------------------------- paths, state

    def blob_path(self, digest: str) -> str:
        """The file to mount a layer from: <mountpoint>/<hex>, as this process reaches it."""
        return os.path.join(self._mount_path(), blob_hex(digest))

    def _mount_path(self) -> str:
        return self._view + self.config.mountpoint

    @property
    def pid(self) -> int | None:
        return self._pid

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        if self._pidfd is not None:
            return not _readable(self._pidfd, 0)
        return False

    def stats(self) -> PagerStats:
        try:
            with open(os.path.join(self._mount_path(), ".stats")) as f:
                return parse_stats(f.read())
        except OSError as err:
            raise PagerError(err.errno, f"read pager stats `{self.config.mountpoint}/.stats`: "
                                        f"{os.strerror(err.errno or errno.EIO)}") from err

    # ---------------------------------------------------------- its log

    def rotate_log(self) -> bool:
        """Blocking: once the log is past `log_max_bytes`, move it to
        `<log>.1` (replacing the one before), so that it and its copy
        together hold at most about twice that. The pager lives for days,
        across daemon restarts, with the log as its stderr. One that reopens
        its log (`--log`, said in its stats) has it renamed and is sent
        SIGUSR1: its lines go to the renamed file until it has reopened the
        path, none is lost. Otherwise (no pager known to be running, or one
        built before the reopen) the log is copied and truncated: its writer
        is O_APPEND, so its next line goes at the start of the empty file,
        and a line written between the copy and the truncation is lost.
        When the rename or the copy cannot be done (the disk full) the log
        is truncated all the same: it must not be what fills the disk.
        Whether it rotated; a log that is no regular file (a FIFO, say:
        nothing a copy could cap) is left as it is, and one that cannot be
        looked at or truncated is logged and left, never an error: the
        pager starts and serves without it."""
        path, cap = self.config.log_path, self.config.log_max_bytes
        if not path or not cap:
            return False
        with self._log_lock:
            return self._rotate_log(path, cap)

    def _rotate_log(self, path: str, cap: int) -> bool:
        try:
            if not stat.S_ISREG((st := os.stat(path)).st_mode) or st.st_size <= cap:
                return False
        except FileNotFoundError:
            return False
        except OSError as err:
            log.warning("pager log %s: %s; not rotated", path, err.strerror or err)
            return False
        old = path + ".1"
        if self._reopens_log():
            try:
                os.replace(path, old)
            except OSError as err:
                log.warning("pager log %s: cannot move it to %s (%s); truncating it instead",
                            path, old, err.strerror or err)
            else:
                try:
                    self._signal(signal.SIGUSR1)
                except OSError as err:      # it died meanwhile: the next one opens the path anew
                    log.warning("pager log %s: tell pager pid %s to reopen it: %s",
                                path, self._pid, err.strerror or err)
                return True
            return self._truncate_log(path)
        tmp = path + ".1.tmp"
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, old)
        except OSError as err:
            log.warning("pager log %s: cannot keep a copy in %s (%s); truncating it without one",
                        path, old, err.strerror or err)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return self._truncate_log(path)

    def _reopens_log(self) -> bool:
        """Whether a pager runs that reopens its log on SIGUSR1."""
        if not self.alive():
            return False
        try:
            return self.stats().log_reopen
        except (OSError, ValueError):
            return False

    def _truncate_log(self, path: str) -> bool:
        try:
            os.truncate(path, 0)
        except OSError as err:
            log.warning("pager log %s: cannot truncate it: %s", path, err.strerror or err)
            return False
        return True

    # ---------------------------------------------------------- start / stop

    def start(self) -> None:
        """Adopt a live pager on the mountpoint or start one; return once mounted."""
        cfg = self.config
        if self._try_adopt():
            self.rotate_log()
            return
        self.rotate_log()       # none answers: no pager writes the log now
        # Before touching the mountpoint: stat(2) on a dead FUSE mount is ENOTCONN.
        self._clear_dead_mounts()
        os.makedirs(cfg.mountpoint, exist_ok=True)
        os.makedirs(cfg.cache_dir, mode=0o700, exist_ok=True)
        if not os.access(self.binary, os.X_OK):
            raise PagerError(errno.ENOENT, f"exec `{self.binary}`: not built "
                                           "(setup.py builds it from csrc/pager/)")
        logfd = _open_log(cfg.log_path) if cfg.log_path else None
        rfd, wfd = os.pipe2(os.O_CLOEXEC)
        try:
            # Own session: a signal to the daemon's process group (^C) must not
            # take the pager, and the mounts under it, down too.
            self._proc = subprocess.Popen(cfg.argv(self.binary, wfd), pass_fds=(wfd,),
                                          stdin=subprocess.DEVNULL, stdout=logfd, stderr=logfd,
                                          start_new_session=True)
        finally:
            os.close(wfd)
            if logfd is not None:
                os.close(logfd)
        self._pid = self._proc.pid
        try:
            # Not reaped yet (only this thread waits for it): the pid is still its.
            self._pidfd = os.pidfd_open(self._pid)
            if cfg.cgroup_procs:
                # Before it mounts: the pager allocates little until then.
                with open(cfg.cgroup_procs, "w") as f:
                    f.write(str(self._pid))
            self._wait_ready(rfd)
        except BaseException:
            self._kill_child()
            self._forget_process()
            self._clear_dead_mounts()   # killed after mounting (timeout)
            raise
        finally:
            os.close(rfd)
        self._record_pid()
        self.generation += 1
        log.info("pager pid %d mounted on %s (generation %d)", self._pid, cfg.mountpoint,
                 self.generation)

    def _record_pid(self) -> None:
        """Write the pid file (atomically); a failure only costs a later
        daemon in another mount namespace the adoption, so it is logged."""
        tmp = f"{self.config.pid_file}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{self._pid}\n")
            os.replace(tmp, self.config.pid_file)
        except OSError as err:
            log.warning("record the pager's pid in %s: %s", self.config.pid_file, err)

    def _recorded_pid(self) -> int | None:
        try:
            with open(self.config.pid_file) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def _wait_ready(self, rfd: int) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        data = b""
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(rfd, left):
                raise PagerError(errno.ETIMEDOUT, f"start pager on `{self.config.mountpoint}`: "
                                                  f"not mounted after {self.config.start_timeout_s} s")
            chunk = os.read(rfd, 64)
            if not chunk:
                code = self._proc.wait(timeout=5) if self._proc else None
                raise PagerError(errno.EIO, f"start pager on `{self.config.mountpoint}`: "
                                            f"exited with status {code} before mounting "
                                            f"(its stderr: {self.config.log_path or 'daemon log'})")
            data += chunk

    def _try_adopt(self) -> bool:
        """A pager left by a previous daemon answers .stats: keep it (its files
        back mounted layers). Its mount is ours to see when that daemon ran in
        our mount namespace, and its answer names its pid; otherwise the pid it
        recorded leads to it, through /proc/<pid>/root. A dead one leaves
        ENOTCONN: cleared by the caller."""
        if self.alive():
            return True
        if pager_mounts(self.config.mountpoint):
            view, pid = "", self._answering_pid()
        else:
            pid = self._recorded_pid()
            view = f"/proc/{pid}/root"
        return pid is not None and self._adopt(view, pid)

    def _answering_pid(self) -> int | None:
        try:
            return self.stats().pid
        except (OSError, ValueError):
            return None

    def _adopt(self, view: str, pid: int) -> bool:
        """Adopt pager `pid`, whose mount is reached at view + mountpoint: its
        .stats must answer with that pid while a pidfd holds it."""
        self._view = view
        pidfd = None
        try:
            pidfd = os.pidfd_open(pid)
            stats = self.stats()
            if stats.pid != pid:
                raise ValueError(f"the pager answering is pid {stats.pid}, not {pid}")
            # Alive from the pidfd's opening to after its answer: the pid named
            # this one process all along, not a process that reused it.
            if _readable(pidfd, 0):
                raise ValueError(f"pager pid {pid} exited")
        except (OSError, ValueError):
            if pidfd is not None:
                os.close(pidfd)
            self._view = ""
            return False
        if stats.chunk_size != self.config.chunk_size:
            log.warning("adopted pager on %s runs with chunk size %d, not %d: restart it to "
                        "change", self.config.mountpoint, stats.chunk_size, self.config.chunk_size)
        self._pidfd, self._pid, self._proc = pidfd, stats.pid, None
        self.generation += 1
        log.info("adopted pager pid %d on %s%s", stats.pid, self.config.mountpoint,
                 f" (its mount seen through {view})" if view else "")
        if stats.cache_max != self.config.cache_max_bytes:
            # Its cap was an argument of its start: a pager another daemon (or
            # another config) started has its own, uncapped perhaps.
            self._take_cache_max(stats)
        return True

    def _take_cache_max(self, stats: PagerStats) -> None:
        """Give an adopted pager the configured cache cap in place of the one
        it was started with; one that cannot take it keeps its own, said."""
        want, was = self.config.cache_max_bytes, stats.cache_max
        if not stats.cache_max_settable:
            log.warning("adopted pager on %s caps its cache at %s, not %d (pager.cache_max_bytes), and "
                        "was built before a running pager could take another: the new cap takes effect "
                        "when the pager is restarted (a daemon stop with no sandbox left stops it)",
                        self.config.mountpoint, was or "nothing", want)
            return
        try:
            self.set_cache_max(want)
        except (OSError, ValueError) as err:
            log.warning("adopted pager on %s caps its cache at %s, not %d (pager.cache_max_bytes): "
                        "setting it failed (%s); it keeps its own until it is restarted",
                        self.config.mountpoint, was or "nothing", want, err)
            return
        log.info("adopted pager on %s capped its cache at %s: now at %d (pager.cache_max_bytes)",
                 self.config.mountpoint, was or "nothing", want)

    def set_cache_max(self, cap: int, timeout: float = 10.0) -> None:
        """Blocking: set the running pager's cache cap (0: none): written to
        <cache_dir>/.cache-max, then SIGUSR2, on which the pager reads it,
        and, lower than what it holds, evicts down to it at once. Returns
        once its stats show the cap; TimeoutError if they do not in
        `timeout` seconds."""
        if cap < 0:
            raise ValueError(f"cache cap must be >= 0: {cap}")
        where = self._view + self.config.cache_dir
        tmp = os.path.join(where, ".cache-max.tmp")
        with open(tmp, "w") as f:
            f.write(f"{cap}\n")
        os.replace(tmp, os.path.join(where, ".cache-max"))
        self._signal(signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while self.stats().cache_max != cap:
            if time.monotonic() > deadline:
                raise TimeoutError(errno.ETIMEDOUT, f"pager pid {self._pid} did not take cache cap {cap} "
                                                    f"in {timeout} s")
            time.sleep(0.01)

    def _clear_dead_mounts(self) -> None:
        """Lazy-unmount dead pager mounts: a busy one (layers mounted over its
        files, open fds) cannot be unmounted otherwise, and lazily it goes once
        those are gone."""
        for _ in range(pager_mounts(self.config.mountpoint)):
            native.umount(self.config.mountpoint, detach=True)
            log.warning("lazily unmounted a dead pager mount on %s", self.config.mountpoint)

    def _kill_child(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the pager unmounts and closes its cache cleanly), SIGKILL
        after timeout, then lazily unmount whatever mount is left."""
        if self.alive():
            self._signal(signal.SIGTERM)
            if not self._wait_exit(timeout):
                log.warning("pager pid %d ignored SIGTERM for %s s: SIGKILL", self._pid, timeout)
                self._signal(signal.SIGKILL)
                self._wait_exit(None)
        self._forget_process()
        self._clear_dead_mounts()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.config.pid_file)

    def _signal(self, sig: int) -> None:
        """Through the pager's pidfd (ESRCH once it has exited), never by pid."""
        if self._pidfd is None:
            raise ProcessLookupError(errno.ESRCH, "no pager")
        native.pidfd_send_signal(self._pidfd, sig)

    def restart(self) -> None:
        """Start again after the pager died (reaped here): clears the dead mount."""
        if self.alive():
            raise PagerError(errno.EBUSY, f"restart pager on `{self.config.mountpoint}`: "
                                          f"pid {self._pid} is alive")
        self._wait_exit(0)
        self._forget_process()
        self.start()
        self.restarts += 1

    def _wait_exit(self, timeout: float | None) -> bool:
        if self._proc is not None:
            try:
                self._proc.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        if self._pidfd is not None:
            return _readable(self._pidfd, timeout)
        return True

    def _forget_process(self) -> None:
        with self._log_lock:
            if self._pidfd is not None:
                os.close(self._pidfd)
            self._proc = self._pidfd = self._pid = None
            self._view = ""

    # ---------------------------------------------------------- supervision

    def supervise(self, stop: threading.Event,
                  on_restart: Callable[[int], None] | None = None,
                  poll_s: float = 0.5) -> None:
        """Restart the pager whenever it dies, until stop is set. After each
        restart, on_restart(generation) runs: the daemon must remount the layers
        whose EROFS mounts sat on the dead FUSE mount (docs/pager.md). Gives up
        (PagerError) after max_restarts within restart_window_s.

        The thread running this owns the Pager meanwhile: to shut down, set
        stop, join the thread, then call stop()."""
        recent: list[float] = []
        while not stop.is_set():
            if not self._wait_exit(poll_s):
                continue
            if stop.is_set():
                break
            code = self._proc.returncode if self._proc is not None else None
            log.error("pager pid %s on %s died (status %s): restarting", self._pid,
                      self.config.mountpoint, code)
            now = time.monotonic()
            recent = [t for t in recent if now - t < self.config.restart_window_s] + [now]
            if len(recent) > self.config.max_restarts:
                raise PagerError(errno.EIO, f"pager on `{self.config.mountpoint}` died "
                                            f"{len(recent)} times in "
                                            f"{self.config.restart_window_s} s: giving up")
            self.restart()
            if on_restart is not None:
                # Its failure is the daemon's to report; supervision goes on
                # (a pager that dies again must still be restarted).
                try:
                    on_restart(self.generation)
                except Exception:
                    log.exception("pager on %s restarted (generation %d): the daemon's follow-up failed",
                                  self.config.mountpoint, self.generation)


def _open_log(path: str) -> int | None:
    """An fd appending to the pager's log at `path` (made if missing), or None
    (the pager then writes to the daemon's stderr) when `path` is no regular
    file or cannot be opened, which is logged. O_NONBLOCK: the open of a FIFO
    that nobody reads would block for good (the daemon's start with it). A
    FIFO, a socket or a device is refused even when it opens: nothing could
    cap it, and a pipe's reader gone would kill the pager with SIGPIPE at its
    next line."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC, 0o640)
    except OSError as err:
        if err.errno == errno.ENXIO:        # a FIFO nobody reads (or a socket)
            kind = "a FIFO" if _is_fifo(path) else "not a regular file"
            log.error("pager log %s is %s, not a regular file: the pager writes to the daemon's "
                      "log instead; remove it for the pager's next start to make its own", path, kind)
        else:
            log.error("pager log %s: %s; the pager writes to the daemon's log instead",
                      path, err.strerror or err)
        return None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a special file"
        log.error("pager log %s is %s, not a regular file: the pager writes to the daemon's log "
                  "instead; remove it for the pager's next start to make its own", path, kind)
        return None
    os.set_blocking(fd, True)
    return fd


def _is_fifo(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _readable(fd: int, timeout: float) -> bool:
    """Whether fd is readable within timeout seconds. poll, not select: select
    fails on fd numbers >= 1024, which a daemon holding a few fds per sandbox
    reaches."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(max(0, math.ceil(timeout * 1000))))
