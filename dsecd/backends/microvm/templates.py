"""Template snapshots of microVMs: the files and the memory of each template.

A template is a guest of one (image, shape) booted to its agent and stopped
there, so that later creates of that (image, shape) restore it instead of
booting (engine/vmtemplates.py decides when; backend.py runs QEMU). It is:

  - its RAM, in a memfd the daemon holds. The template's QEMU maps it shared
    (`memory-backend-file,share=on`), so the guest's memory is the memfd's
    pages; once that QEMU has exited the memfd is sealed (F_SEAL_WRITE,
    SHRINK, GROW, SEAL) and every restored VM maps it privately
    (`share=off`): it reads the template's pages, one copy on the host for
    all of them, and gets a copy of each page it writes, charged to its own
    cgroup;
  - its device state: QEMU's migration stream written with the capability
    x-ignore-shared, which leaves out RAM mapped shared (the guest RAM here,
    and the layers' pmem), so it holds devices and CPU state only (~1 MiB).

Why a sealed memfd rather than the RAM file itself: QEMU 7.2 opens the
backing file read-write even for share=off, so every restored VM's QEMU
(each under its own uid) would need write access to a file all of them
map; and when such a guest gives memory back (virtio-balloon free-page
reporting or inflation) QEMU 7.2 punches a hole in the backing file, even
for a private mapping, zeroing the page under every other VM restored from
it. A sealed memfd can be opened read-write by anyone holding it (mode 0666)
but refuses writes, truncation and hole punching (EPERM) from every opener:
no VM can change what the others read. Templates and their restores run
the balloon without free-page reporting for that reason (a discard would
fail and QEMU would log it every few seconds).

On disk, <state>/vm-templates/<key>/ holds `ram` (sparse: the memfd's data
extents only), `state` and `meta.json`, so a restarted daemon loads a
template (one read of its RAM into a new memfd) instead of booting it again.
The key is a hash of everything the restore must match: QEMU's command line
(devices, memory, vCPUs, kernel arguments: the writable layer's size is one),
the layers' digests, the guest kernel and initramfs (the guest build's
digest) and the QEMU binary; a change to any of them is a new key, and the
old template is stale (removed at the daemon's start or by `image gc`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ... import fds

log = logging.getLogger(__name__)

DIR_NAME = "vm-templates"
FORMAT = 1                 # bump when a template's files change meaning: every template is rebuilt
MFD_NOEXEC_SEAL = 0x8      # Linux 6.3+: the memfd is not executable (and says so without a warning)
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class TemplateError(OSError):
    """A template could not be built, stored or loaded; the message says what and where."""


def qemu_identity(qemu: str) -> str:
    """The QEMU binary as far as a migration stream cares: path, size, mtime
    (a package upgrade changes them; the stream's format may change with it)."""
    st = os.stat(qemu)
    return f"{qemu}|{st.st_size}|{st.st_mtime_ns}"


def key_of(argv: list[str], layer_digests: list[str], guest_digest: str, qemu_id: str) -> str:
    """The template key: `argv` is QEMU's command line with the per-VM paths
    replaced by placeholders (backend.MicroVMBackend.template_argv)."""
    text = json.dumps({"format": FORMAT, "argv": argv, "layers": list(layer_digests), "guest": guest_digest,
                       "qemu": qemu_id}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def new_ram(size: int) -> int:
    """An empty memfd of `size` bytes for a template's guest RAM (sealable, not executable)."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        fd = os.memfd_create("dsec-vm-template", flags | MFD_NOEXEC_SEAL)
    except OSError as err:
        if err.errno != errno.EINVAL:           # a kernel before 6.3: no MFD_NOEXEC_SEAL
            raise
        fd = os.memfd_create("dsec-vm-template", flags)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fds.park(fd)


def seal(fd: int) -> None:
    """No more writes, resizes or seals, through any fd or mapping. EBUSY
    while a writable shared mapping exists: the template's QEMU must be gone."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)


def _extents(fd: int, size: int):
    """(start, end) of each data extent of `fd` (SEEK_DATA / SEEK_HOLE)."""
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as err:
            if err.errno == errno.ENXIO:        # no data past off
                return
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end
        off = end


MADV_POPULATE_READ = 22     # Linux 5.14+: fault a range in for reading


def _holes(fd: int, size: int):
    """(start, end) of each hole of `fd` below `size`."""
    at = 0
    for start, end in _extents(fd, size):
        if start > at:
            yield at, start
        at = end
    if at < size:
        yield at, size


def _mapped_by(pid: int, st: os.stat_result) -> bool:
    """Whether process `pid` maps the file of `st` (its /proc/PID/maps)."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) > 4 and fields[4] == str(st.st_ino) and fields[3] == dev:
                    return True
    except OSError:
        return False
    return False


def copy_sparse(src: int, dst: int) -> int:
    """Copy src's data extents to the same offsets of dst (sendfile: no
    copy through user space), dst sized as src. Returns the bytes copied."""
    size, copied = os.fstat(src).st_size, 0
    os.ftruncate(dst, size)
    for start, end in _extents(src, size):
        os.lseek(dst, start, os.SEEK_SET)
        at = start
        while at < end:
            n = os.sendfile(dst, src, at, min(end - at, 1 << 30))
            if n == 0:
                raise TemplateError(errno.EIO, f"short copy at {at} of {end}")
            at += n
        copied += end - start
    return copied


@dataclass
class Template:
    key: str
    dir: Path
    ram_fd: int                 # the sealed memfd; -1 once dropped
    ram_size: int
    meta: dict = field(default_factory=dict)
    last_used: float = 0.0

    @property
    def state(self) -> Path:
        return self.dir / "state"


class TemplateStore:
    """The templates of this daemon: on disk under <state>/vm-templates and,
    once used, in memory (their sealed memfds). Thread-safe: its blocking
    methods run in worker threads."""

    def __init__(self, state_dir: Path, guest_digest: str, qemu_id: str, max_templates: int):
        self.root = Path(state_dir) / DIR_NAME
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.guest_digest, self.qemu_id = guest_digest, qemu_id
        self.max_templates = max(1, max_templates)
        self._loaded: dict[str, Template] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ lookup

    def get(self, key: str) -> Template | None:
        """The template `key`, loaded into memory if it is only on disk; None if there is none."""
        with self._lock:
            t = self._loaded.get(key)
            if t is not None:
                t.last_used = time.monotonic()
                return t
        d = self.root / key
        try:
            meta = json.loads((d / "meta.json").read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            log.warning("VM template %s is unreadable (%s): removing it", key, err)
            shutil.rmtree(d, ignore_errors=True)
            return None
        t = self._load(key, d, meta)
        with self._lock:
            other = self._loaded.get(key)
            if other is not None:            # loaded by another thread meanwhile: keep one
                fds.close_quietly(t.ram_fd)
                return other
            self._loaded[key] = t
        return t

    def _load(self, key: str, d: Path, meta: dict) -> Template:
        size = int(meta["memory"])
        ram = new_ram(size)
        try:
            src = os.open(d / "ram", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if os.fstat(src).st_size != size:
                    raise TemplateError(errno.EINVAL, f"VM template {d}: ram is {os.fstat(src).st_size} bytes, "
                                        f"meta.json says {size}; remove the directory (or run `dsec image gc`)")
                copy_sparse(src, ram)
            finally:
                os.close(src)
            seal(ram)
        except BaseException:
            os.close(ram)
            raise
        return Template(key=key, dir=d, ram_fd=ram, ram_size=size, meta=meta, last_used=time.monotonic())

    # ------------------------------------------------------------ build

    def commit(self, key: str, ram_fd: int, state_file: Path, meta: dict) -> Template:
        """Make a built template usable and durable: seal its RAM (its QEMU
        has exited), write it sparse beside the device state, then publish
        the directory by rename (a crash leaves a .tmp- directory, swept at
        the next start). Takes over ram_fd."""
        try:
            seal(ram_fd)
        except OSError as err:
            os.close(ram_fd)
            raise TemplateError(err.errno, f"seal the RAM of VM template {key[:16]}: {err.strerror} "
                                "(its QEMU still maps it?)") from err
        tmp = self.root / f".tmp-{key}-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(mode=0o700)
            dst = os.open(tmp / "ram", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                meta = {**meta, "ram_data_bytes": copy_sparse(ram_fd, dst)}
                os.fsync(dst)
            finally:
                os.close(dst)
            os.replace(state_file, tmp / "state")
            meta = {**meta, "key": key, "guest": self.guest_digest, "qemu": self.qemu_id, "format": FORMAT,
                    "memory": os.fstat(ram_fd).st_size, "state_bytes": (tmp / "state").stat().st_size}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
            final = self.root / key
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            os.close(ram_fd)
            raise
        t = Template(key=key, dir=final, ram_fd=ram_fd, ram_size=meta["memory"], meta=meta,
                     last_used=time.monotonic())
        with self._lock:
            old = self._loaded.pop(key, None)
            self._loaded[key] = t
        if old is not None:
            fds.close_quietly(old.ram_fd)
        self._evict_over_max()
        return t

    def _evict_over_max(self) -> None:
        """Keep at most max_templates on disk: the least recently used go."""
        keys = self.keys()
        if len(keys) <= self.max_templates:
            return
        with self._lock:
            used = {k: t.last_used for k, t in self._loaded.items()}
        for key in sorted(keys, key=lambda k: used.get(k, 0.0))[:len(keys) - self.max_templates]:
            log.info("VM template %s: dropped, least recently used of more than %d", key[:16], self.max_templates)
            self.drop(key)

    def fill_holes(self, key: str, qemu_pid: int) -> int:
        """Blocking: make the pages of template `key`'s RAM that it never
        wrote (the memfd's holes), charged to this process's cgroup, if
        QEMU `qemu_pid` maps that very memfd; the bytes made. A pause of a
        VM restored from it saves all of its RAM, reading every page of its
        private mapping of the memfd, and a read of a hole makes the page in
        the memfd (shmem: it stays there, for every VM of the template, as
        long as the memfd does). Made by that QEMU, they would be charged
        to the sandbox paused first, left by the LRU without swap, kept after
        its resume against its memory limit, and counted as its own.
        Only that accounting depends on it: a failure is logged and 0
        returned, and the save goes on."""
        try:
            return self._fill_holes(key, qemu_pid)
        except Exception as err:
            log.warning("VM template %s: cannot make its unwritten pages before a save (%s); the VM saved "
                        "makes them, charged to its sandbox", key[:16], err)
            return 0

    def _fill_holes(self, key: str, qemu_pid: int) -> int:
        # Mapped under the lock (a drop meanwhile would close the fd; the
        # mapping keeps the memfd), its pages made outside it (~1 s per
        # GiB): creates restoring templates meanwhile do not wait for it.
        with self._lock:
            t = self._loaded.get(key)
            if t is None or t.ram_fd < 0 or not _mapped_by(qemu_pid, os.fstat(t.ram_fd)):
                return 0
            holes = list(_holes(t.ram_fd, t.ram_size))
            if not holes:
                return 0
            # Private: kernels before 6.7 refuse a shared mapping of a memfd
            # sealed against writes (EPERM), read-only or not. A read fault
            # of a private mapping of shmem makes the page in the memfd all
            # the same (as QEMU's reads do), and maps it until a write.
            m = mmap.mmap(t.ram_fd, t.ram_size, mmap.MAP_PRIVATE, mmap.PROT_READ)
        with m:
            for start, end in holes:
                try:
                    m.madvise(MADV_POPULATE_READ, start, end - start)
                except OSError as err:
                    # EINVAL: a kernel before 5.14, a read of each page
                    # instead. Any other (EFAULT: a page that could not be
                    # made) would kill a reader with SIGBUS.
                    if err.errno != errno.EINVAL:
                        raise
                    for off in range(start, end, mmap.PAGESIZE):
                        m[off]
        return sum(end - start for start, end in holes)

    # ------------------------------------------------------------ removal

    def drop(self, key: str) -> None:
        """Remove template `key` (memory and disk). VMs restored from it keep
        their own mappings of its RAM: they run on, unaffected."""
        with self._lock:
            t = self._loaded.pop(key, None)
        if t is not None:
            fds.close_quietly(t.ram_fd)
            t.ram_fd = -1
        shutil.rmtree(self.root / key, ignore_errors=True)

    def keys(self) -> list[str]:
        return [e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")]

    def sweep(self) -> list[str]:
        """At the daemon's start: remove half-written templates (.tmp-*) and
        templates of another guest build, QEMU binary or format. Returns the
        keys removed."""
        removed = []
        for e in os.scandir(self.root):
            if e.name.startswith(".tmp-"):
                shutil.rmtree(e.path, ignore_errors=True)
                continue
            try:
                meta = json.loads((Path(e.path) / "meta.json").read_text())
                stale = (meta.get("guest"), meta.get("qemu"), meta.get("format")) != (
                    self.guest_digest, self.qemu_id, FORMAT)
            except (OSError, ValueError):
                stale = True
            if stale:
                self.drop(e.name)
                removed.append(e.name)
        return removed

    def gc(self, live_layers: set[str]) -> list[str]:
        """`image gc`: remove templates whose layers are not all in
        `live_layers` (the store's blobs after its gc), and stale ones."""
        removed = self.sweep()
        for key in self.keys():
            try:
                meta = json.loads((self.root / key / "meta.json").read_text())
            except (OSError, ValueError):
                meta = {}
            if not set(meta.get("layers", ())) <= live_layers or not meta.get("layers"):
                self.drop(key)
                removed.append(key)
        return removed

    def info(self) -> list[dict]:
        """Each template on disk. `ram_data_bytes`: the RAM its boot wrote
        (its file's data); `held_bytes`: what its memfd holds in memory now
        (0 if not loaded): the whole guest RAM from the first pause of a VM
        restored from it on (fill_holes), less what host reclaim freed
        since. The pages fill_holes makes are clean (read faults of holes:
        zeros, never written), and reclaim that reaches them frees them
        without swap (shrink_folio_list drops a clean shmem folio; DAMON's
        pageout does, the LRU's skips swap-backed pages when there is no
        swap); the memfd's st_blocks falls with it. The next pause makes
        them again."""
        out = []
        with self._lock:
            held = {k: os.fstat(t.ram_fd).st_blocks * 512 if t.ram_fd >= 0 else 0 for k, t in self._loaded.items()}
        for key in sorted(self.keys()):
            try:
                meta = json.loads((self.root / key / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            out.append({"key": key, "layers": meta.get("layers", []), "memory": meta.get("memory"),
                        "ram_data_bytes": meta.get("ram_data_bytes"), "state_bytes": meta.get("state_bytes"),
                        "created": meta.get("created"), "loaded": key in held,
                        "held_bytes": held.get(key, 0)})
        return out

    def close(self) -> None:
        """Daemon shutdown: the memfds go (restored VMs keep their mappings)."""
        with self._lock:
            loaded, self._loaded = list(self._loaded.values()), {}
        for t in loaded:
            fds.close_quietly(t.ram_fd)
