"""dsec-pager on a real FUSE mount: content, counters, fetch-once, eviction,
restart after kill -9, throttle, error cases, and file-backed EROFS over it.

Each test has its own temp store/cache/mountpoint; the fixture stops every
pager it started and lazily unmounts whatever is left, even on failure.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from dsecd import native
from dsecd.fs import pager as pg

KIB, MIB = 1024, 1 << 20


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (FUSE and EROFS mounts)"
    if not os.path.exists("/dev/fuse") or "fuse" not in Path("/proc/filesystems").read_text():
        return "no FUSE in this kernel (/dev/fuse, /proc/filesystems)"
    if not os.access(pg.pager_binary_path(), os.X_OK):
        return f"{pg.pager_binary_path()} is not built (setup.py builds it)"
    return None


pytestmark = [pytest.mark.root, pytest.mark.timeout(120),
              pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]


def _erofs_reason() -> str | None:
    if "erofs" not in Path("/proc/filesystems").read_text():
        return "erofs not in /proc/filesystems"
    if shutil.which("mkfs.erofs") is None:
        return "mkfs.erofs missing (erofs-utils)"
    return None


class Env:
    """A store, a cache and a mountpoint under one temp dir, and the pagers and
    EROFS mounts made on them (undone by close())."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="dsec-pager-test-"))
        self.store = self.root / "store" / "blobs" / "sha256"
        self.store.mkdir(parents=True)
        self.cache = self.root / "cache"
        self.mnt = self.root / "mnt"
        self.pagers: list[pg.Pager] = []
        self.erofs: list[str] = []

    def blob(self, data: bytes) -> str:
        hexd = hashlib.sha256(data).hexdigest()
        (self.store / hexd).write_bytes(data)
        return hexd

    def pager(self, **kw) -> pg.Pager:
        cfg = pg.PagerConfig(store_dir=str(self.store), cache_dir=str(self.cache),
                             mountpoint=str(self.mnt), log_path=str(self.root / "pager.log"), **kw)
        p = pg.Pager(cfg)
        self.pagers.append(p)
        p.start()
        return p

    def mount_erofs(self, file: str, target: Path) -> None:
        target.mkdir(exist_ok=True)
        native.mount_erofs(file, str(target))
        self.erofs.append(str(target))

    def close(self) -> None:
        for target in reversed(self.erofs):
            try:
                native.umount(target, detach=True)
            except OSError:
                pass
        for p in self.pagers:
            try:
                p.stop(timeout=5)
            except OSError:
                pass
        while pg.pager_mounts(str(self.mnt)):
            native.umount(str(self.mnt), detach=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def log(self) -> str:
        path = self.root / "pager.log"
        return path.read_text() if path.exists() else ""


@pytest.fixture
def env():
    e = Env()
    try:
        yield e
    finally:
        e.close()


def pread(path: Path, size: int, off: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


def resident_bytes(path: Path) -> int:
    """Bytes of path in the page cache (util-linux fincore: mincore(2))."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def blob_stats(p: pg.Pager, hexd: str) -> pg.BlobStats:
    return p.stats().blobs[hexd]


def test_read_whole_blob_matches_store(env):
    data = os.urandom(5 * MIB + 12345)
    hexd = env.blob(data)
    p = env.pager(chunk_size=MIB)
    assert (env.mnt / hexd).stat().st_size == len(data)
    assert (env.mnt / hexd).read_bytes() == data
    st = blob_stats(p, hexd)
    assert st.kernel_read_bytes == len(data)
    assert st.fetched_bytes == len(data)          # every chunk exactly once
    assert st.fetches == st.chunks == 6 and st.cached_chunks == 6
    assert st.errors == 0
    assert hexd in os.listdir(env.mnt) and ".stats" in os.listdir(env.mnt)


def test_partial_read_fetches_only_its_chunks(env):
    data = os.urandom(16 * MIB)
    hexd = env.blob(data)
    cs, ra = 256 * KIB, 2
    p = env.pager(chunk_size=cs, readahead_chunks=ra)
    off, size = 3 * MIB + 10, 100 * KIB
    assert pread(env.mnt / hexd, size, off) == data[off:off + size]
    st = blob_stats(p, hexd)
    # The kernel may read around the request (its own read-ahead window):
    # whatever it read, fetched <= read rounded out to chunks + read-ahead.
    read_lo, read_hi = off, off + st.kernel_read_bytes
    chunks = (read_hi + cs - 1) // cs - read_lo // cs
    assert size <= st.kernel_read_bytes < 2 * MIB
    assert 0 < st.fetched_bytes <= chunks * cs + ra * cs
    assert st.fetched_bytes < len(data) // 4


def test_fetches_leave_no_store_pages_with_direct_io(env):
    """direct_io is the one-copy mode: the store file's pages go after each
    fetch, and the kernel does not read ahead on it (it used to leave ~0.8x
    the fetched bytes cached in bench/images.py)."""
    data = os.urandom(16 * MIB)
    hexd = env.blob(data)
    store_file = env.store / hexd
    fd = os.open(store_file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_bytes(store_file) == 0
    p = env.pager(chunk_size=64 * KIB, readahead_chunks=0, direct_io=True)
    for off in range(0, len(data), MIB):       # one 4 KiB read per MiB: scattered chunks
        assert pread(env.mnt / hexd, 4096, off) == data[off:off + 4096]
    assert blob_stats(p, hexd).fetches >= 16
    assert resident_bytes(store_file) == 0


def test_sequential_reads_trigger_readahead(env):
    data = os.urandom(8 * MIB)
    hexd = env.blob(data)
    p = env.pager(chunk_size=256 * KIB, readahead_chunks=4)
    with open(env.mnt / hexd, "rb") as f:
        assert f.read(2 * MIB) == data[:2 * MIB]
    st = blob_stats(p, hexd)
    assert st.readahead_chunks > 0
    # Read-ahead runs at most 4 chunks past the last read.
    assert st.fetched_bytes <= st.kernel_read_bytes + 5 * 256 * KIB


def test_concurrent_readers_fetch_a_chunk_once(env):
    data = os.urandom(4 * MIB)
    hexd = env.blob(data)
    # A slow store keeps the first fetch in flight while the others arrive.
    p = env.pager(chunk_size=MIB, readahead_chunks=0, latency_us=300_000)
    base, n = 2 * MIB, 8
    barrier, results, errors = threading.Barrier(n), {}, []

    def reader(i):
        off = base + i * 128 * KIB        # distinct pages: distinct FUSE reads
        try:
            barrier.wait()
            results[i] = pread(env.mnt / hexd, 4096, off) == data[off:off + 4096]
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(results.values()) and len(results) == n
    st = blob_stats(p, hexd)
    assert st.fetches == 1 and st.fetched_bytes == MIB
    assert st.chunk_misses >= 2, "readers were not concurrent: the test proves nothing"


def test_cache_cap_evicts_cold_chunks(env):
    data = os.urandom(2 * MIB)
    hexd = env.blob(data)
    cs, cap = 64 * KIB, 256 * KIB
    p = env.pager(chunk_size=cs, cache_max_bytes=cap, readahead_chunks=0)
    assert (env.mnt / hexd).read_bytes() == data
    s = p.stats()
    st = s.blobs[hexd]
    assert st.evictions >= 32 - cap // cs - 2
    assert s.cache_used <= cap + 2 * cs
    data_file = env.cache / f"{hexd}.data"
    assert data_file.stat().st_blocks * 512 <= cap + 4 * cs   # holes punched
    # Evicted chunks come back from the store, intact (the kernel page cache
    # would hide the pager: read with O_DIRECT-like freshness via a new pager).
    p.stop()
    p2 = env.pager(chunk_size=cs, cache_max_bytes=cap, readahead_chunks=0)
    assert (env.mnt / hexd).read_bytes() == data
    assert p2.stats().blobs[hexd].fetches >= 32 - cap // cs


def test_a_full_cache_disk_slows_reads_but_fails_none(env):
    """A fetched chunk the cache cannot keep is still served: a failed read
    of a mapped binary would be a SIGBUS in every sandbox on the layer."""
    env.cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(env.cache)], check=True)
    try:
        data = os.urandom(4 * MIB + 999)
        hexd = env.blob(data)
        p = env.pager(chunk_size=256 * KIB, readahead_chunks=4)
        assert (env.mnt / hexd).read_bytes() == data
        assert (env.mnt / hexd).read_bytes() == data          # again: what was not kept is fetched again
        st = blob_stats(p, hexd)
        # Counted as not kept, not as failed fetches; and read-ahead, which
        # could only fetch chunks to drop them, stopped once the disk was full.
        assert 0 < st.cached_chunks < st.chunks and st.uncached > 0 and st.errors == 0, st
        # Each chunk not kept fetched once per read of it (two reads), plus
        # what read-ahead had in flight as the disk filled; not again by read-ahead.
        assert st.uncached <= 2 * (st.chunks - st.cached_chunks) + 8, st
        assert "served, not cached" in env.log()
    finally:
        for pager in env.pagers:
            pager.stop(timeout=5)
        subprocess.run(["umount", "-l", str(env.cache)], check=True)


def test_missing_blob_is_enoent_and_mount_is_read_only(env):
    hexd = env.blob(b"x" * 10000)
    env.pager()
    with pytest.raises(FileNotFoundError):
        open(env.mnt / ("0" * 64), "rb")
    with pytest.raises(FileNotFoundError):
        open(env.mnt / "not-a-digest", "rb")
    with pytest.raises(OSError) as exc:
        open(env.mnt / hexd, "r+b")
    assert exc.value.errno == 30   # EROFS
    assert (env.mnt / hexd).read_bytes() == b"x" * 10000


def test_blob_truncated_in_store_mid_read_is_eio(env):
    data = os.urandom(2 * MIB)
    hexd = env.blob(data)
    p = env.pager(chunk_size=64 * KIB, readahead_chunks=0)
    assert pread(env.mnt / hexd, 4096, 0) == data[:4096]
    os.truncate(env.store / hexd, MIB)
    with pytest.raises(OSError) as exc:
        pread(env.mnt / hexd, 4096, MIB + 512 * KIB)
    assert exc.value.errno == 5    # EIO, never zeros
    assert blob_stats(p, hexd).errors >= 1
    assert pread(env.mnt / hexd, 4096, 0) == data[:4096]   # cached chunks still served
    assert "ends at" in env.log()



def test_a_line_written_while_the_log_rotates_is_kept(env, monkeypatch):
    """The log was copied to <log>.1 and then truncated: a line the pager
    wrote between the two was in neither. Each failed fetch of a store
    blob truncated under the pager writes a line naming its offset; one is
    made right after the log is moved (or copied) to <log>.1, before the
    rotation ends."""
    data = os.urandom(2 * MIB)
    hexd = env.blob(data)
    p = env.pager(chunk_size=64 * KIB, readahead_chunks=0, log_max_bytes=300)
    assert pread(env.mnt / hexd, 4096, 0) == data[:4096]      # its size taken: 2 MiB
    os.truncate(env.store / hexd, 64 * KIB)
    log, old = env.root / "pager.log", env.root / "pager.log.1"

    def failed_fetch(chunk: int) -> None:
        with pytest.raises(OSError) as exc:
            pread(env.mnt / hexd, 4096, chunk * 64 * KIB)
        assert exc.value.errno == 5

    for chunk in range(2, 6):           # the log past its cap
        failed_fetch(chunk)
    assert log.stat().st_size > 300
    replace = os.replace

    def replace_then_a_line(src, dst):
        replace(src, dst)
        if str(dst) == str(old):
            failed_fetch(9)             # the pager says it before its answer

    monkeypatch.setattr(os, "replace", replace_then_a_line)
    assert p.rotate_log() is True
    monkeypatch.undo()
    deadline = time.monotonic() + 10    # a hang guard: the pager reopens the log at once
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    failed_fetch(10)                    # and writes on in the new log
    kept, new = old.read_text(), log.read_text()
    for chunk in (2, 3, 4, 5, 9):
        assert f"ends at {chunk * 64 * KIB}," in kept + new, (kept, new)
    assert f"ends at {10 * 64 * KIB}," in new and new.count("ends at") == 1
    assert p.stats().log_reopen


def test_throttle_slows_fetches(env):
    data = os.urandom(2 * MIB)
    hexd = env.blob(data)
    p = env.pager(chunk_size=256 * KIB, readahead_chunks=0, bandwidth_bps=4 * MIB,
                  latency_us=20_000)
    t0 = time.monotonic()
    assert (env.mnt / hexd).read_bytes() == data
    elapsed = time.monotonic() - t0
    # 2 MiB at 4 MiB/s is 0.5 s on the link, plus 20 ms per fetch (8 fetches).
    assert elapsed >= 0.5
    assert blob_stats(p, hexd).fetches == 8
    t0 = time.monotonic()
    assert (env.mnt / hexd).read_bytes() == data   # hits: no store, no throttle
    assert time.monotonic() - t0 < 0.4


def test_fetch_latency_histogram_counts_every_fetch_where_its_time_falls(env):
    """Every fetch waits the throttle's 20 ms at least: all land in buckets
    above 20 ms, and the histogram counts exactly the fetches."""
    data = os.urandom(1 * MIB)
    hexd = env.blob(data)
    p = env.pager(chunk_size=256 * KIB, readahead_chunks=0, latency_us=20_000)
    before = p.stats().fetch_latency
    assert before is not None and before.count == 0 and before.sum_ns == 0
    assert (env.mnt / hexd).read_bytes() == data
    s = p.stats()
    lat = s.fetch_latency
    assert s.blobs[hexd].fetches == 4 and lat.count == 4
    assert all(n == 0 for bound, n in zip(lat.bounds_ns, lat.counts[:-1], strict=True) if bound < 20_000_000), lat
    assert lat.sum_ns >= 4 * 20_000_000
    assert (env.mnt / hexd).read_bytes() == data        # hits: no fetch, nothing observed
    assert p.stats().fetch_latency == lat


def test_hits_and_misses_count_each_chunk_a_read_needs(env):
    """Reads of one chunk each: the first pass misses every chunk once, the
    second hits every one; hits + misses = the reads (direct I/O: the kernel
    sends every read to the pager)."""
    cs, n = 64 * KIB, 12
    data = os.urandom(cs * n)
    hexd = env.blob(data)
    p = env.pager(chunk_size=cs, readahead_chunks=0, direct_io=True)
    fd = os.open(env.mnt / hexd, os.O_RDONLY)
    try:
        for _ in range(2):
            for c in range(n):
                assert os.pread(fd, cs, c * cs) == data[c * cs:(c + 1) * cs]
            st = blob_stats(p, hexd)
            assert st.chunk_misses == st.fetches == n
            assert st.chunk_hits + st.chunk_misses == st.reads
        assert st.chunk_hits >= n
    finally:
        os.close(fd)


def test_kill9_mid_read_restart_keeps_bitmap(env):
    data = os.urandom(4 * MIB)
    hexd = env.blob(data)
    cs = 64 * KIB
    kw = dict(chunk_size=cs, readahead_chunks=0, latency_us=20_000)
    p = env.pager(**kw)
    path = env.mnt / hexd
    seen: list[BaseException | bytes] = []

    def reader():
        try:
            with open(path, "rb", buffering=0) as f:
                while f.read(cs):
                    pass
                seen.append(b"eof")
        except OSError as err:
            seen.append(err)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.4)                 # ~15 of 64 chunks fetched
    os.kill(p.pid, signal.SIGKILL)
    t.join(10)
    assert not t.is_alive()
    assert isinstance(seen[0], OSError) and seen[0].errno == 107   # ENOTCONN
    with pytest.raises(OSError) as exc:
        open(path, "rb")
    assert exc.value.errno == 107   # the dead mount, until the supervisor acts

    restarted = threading.Event()
    stop = threading.Event()
    sup = threading.Thread(target=p.supervise, args=(stop, lambda gen: restarted.set()),
                           kwargs={"poll_s": 0.05})
    sup.start()
    try:
        assert restarted.wait(10), env.log()
        assert p.generation == 2 and p.restarts == 1 and p.alive()
        before = p.stats().blobs[hexd]          # reopened at start from its bitmap
        assert 0 < before.cached_chunks < 64
        assert path.read_bytes() == data
        after = p.stats().blobs[hexd]
        assert after.fetches == 64 - before.cached_chunks
        assert pg.pager_mounts(str(env.mnt)) == 1
    finally:
        stop.set()
        sup.join(5)


def test_daemon_restart_adopts_live_pager(env):
    hexd = env.blob(os.urandom(MIB))
    p = env.pager()
    q = pg.Pager(p.config)     # what a restarted daemon does
    q.start()
    assert q.pid == p.pid and q.alive() and q.generation == 1
    assert len((env.mnt / hexd).read_bytes()) == MIB
    q.stop()                   # through its pidfd: it is not q's child
    assert not p.alive() and pg.pager_mounts(str(env.mnt)) == 0



def test_an_adopted_pager_takes_the_configured_cache_cap(env):
    """The cap was an argument of the pager's start: a pager adopted by a
    daemon restarted with another pager.cache_max_bytes kept its own for
    its life. It now takes the new one, and a lower one evicts at once."""
    import dataclasses

    data = os.urandom(2 * MIB)
    hexd = env.blob(data)
    cs, cap = 64 * KIB, 256 * KIB
    p = env.pager(chunk_size=cs, readahead_chunks=0)            # no cap
    assert (env.mnt / hexd).read_bytes() == data
    assert p.stats().cache_used == 2 * MIB
    q = pg.Pager(dataclasses.replace(p.config, cache_max_bytes=cap))   # a restart with a cap
    q.start()
    assert q.pid == p.pid
    s = q.stats()
    assert s.cache_max == cap and s.cache_used <= cap
    assert (env.cache / f"{hexd}.data").stat().st_blocks * 512 <= cap + 4 * cs    # holes punched
    assert "cache cap set to 262144 bytes (was 0" in env.log()
    assert (env.mnt / hexd).read_bytes() == data                # evicted chunks come back, intact
    assert q.stats().cache_used <= cap + 2 * cs
    q.set_cache_max(0)                                          # and the cap can be lifted
    assert q.stats().cache_max == 0

def test_second_pager_on_one_cache_is_refused(env):
    env.blob(b"y" * 100)
    p = env.pager()
    other = env.root / "mnt2"
    q = pg.Pager(pg.PagerConfig(store_dir=str(env.store), cache_dir=str(env.cache),
                                mountpoint=str(other), log_path=str(env.root / "q.log")))
    with pytest.raises(pg.PagerError) as exc:
        q.start()
    assert "exited with status 1" in str(exc.value)
    assert "another dsec-pager uses this cache" in (env.root / "q.log").read_text()
    assert pg.pager_mounts(str(other)) == 0 and p.alive()


@pytest.mark.skipif(_erofs_reason() is not None, reason=_erofs_reason() or "")
def test_file_backed_erofs_over_pager(env):
    src = env.root / "src"
    (src / "sub").mkdir(parents=True)
    big = os.urandom(8 * MIB)
    (src / "big").write_bytes(big)
    (src / "sub" / "small").write_bytes(b"hello erofs\n")
    image = env.root / "layer.erofs"
    subprocess.run(["mkfs.erofs", "--quiet", "-T0", str(image), str(src)], check=True)
    hexd = env.blob(image.read_bytes())
    image.unlink()
    p = env.pager(chunk_size=256 * KIB, readahead_chunks=0)
    layer = env.root / "layer"
    env.mount_erofs(p.blob_path("sha256:" + hexd), layer)

    assert (layer / "sub" / "small").read_bytes() == b"hello erofs\n"
    st = blob_stats(p, hexd)
    assert 0 < st.fetched_bytes < 2 * MIB     # lazy: the 8 MiB file was not fetched
    assert (layer / "big").read_bytes() == big
    assert blob_stats(p, hexd).fetched_bytes >= 8 * MIB
    # direct_io: the EROFS mount holds the only page-cache copy of the data.
    assert resident_bytes(layer / "big") == len(big)
    assert resident_bytes(Path(p.blob_path(hexd))) == 0
    assert resident_bytes(env.cache / f"{hexd}.data") == 0

    # The pager dies: pages EROFS already has stay readable, others are EIO.
    os.kill(p.pid, signal.SIGKILL)
    while p.alive():
        time.sleep(0.01)
    subprocess.run(["sh", "-c", "echo 1 > /proc/sys/vm/drop_caches"], check=True)
    with pytest.raises(OSError) as exc:
        (layer / "big").read_bytes()
    assert exc.value.errno == 5
    # What the daemon does: restart the pager, mount the layer again over the new file.
    native.umount(str(layer), detach=True)
    env.erofs.remove(str(layer))
    p.restart()
    assert p.generation == 2
    env.mount_erofs(p.blob_path(hexd), layer)
    assert (layer / "big").read_bytes() == big
    assert blob_stats(p, hexd).fetches == 0      # all from the kept cache


def _set_boot_id(bitmap: Path, boot_id: bytes) -> None:
    # Header: magic[8] version u32 clean u32 chunk_size u64 blob_size u64 boot_id[40]
    with open(bitmap, "r+b") as f:
        f.seek(32)
        f.write(boot_id.ljust(40, b"\0"))


def test_bitmap_trust_after_host_crash(env):
    data = os.urandom(MIB)
    hexd = env.blob(data)
    kw = dict(chunk_size=64 * KIB, readahead_chunks=0)
    bitmap = env.cache / f"{hexd}.bitmap"
    p = env.pager(**kw)
    assert (env.mnt / hexd).read_bytes() == data
    # Clean stop: data fsynced, clean flag set -> trusted on any boot.
    p.stop()
    assert int.from_bytes(bitmap.read_bytes()[12:16], "little") == 1
    _set_boot_id(bitmap, b"another-boot")
    p = env.pager(**kw)
    assert p.stats().blobs[hexd].cached_chunks == 16
    # Crash (kill -9: not clean) and a boot id from another boot = a host crash:
    # the bits may be ahead of the data on disk, so all is dropped.
    os.kill(p.pid, signal.SIGKILL)
    while p.alive():
        time.sleep(0.01)
    assert int.from_bytes(bitmap.read_bytes()[12:16], "little") == 0
    _set_boot_id(bitmap, b"another-boot")
    p.restart()
    assert p.stats().blobs[hexd].cached_chunks == 0
    assert (env.cache / f"{hexd}.data").stat().st_blocks == 0
    assert (env.mnt / hexd).read_bytes() == data
    assert p.stats().blobs[hexd].fetches == 16


def test_many_blobs_past_a_low_fd_soft_limit(env):
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1024:
        pytest.skip(f"hard RLIMIT_NOFILE {hard} < 1024")
    # Low for the pager (it inherits it), yet above what this test process
    # already holds (earlier tests in the same process hold some): it must
    # still open the pipes and files that start the pager.
    low = max(64, len(os.listdir("/proc/self/fd")) + 16)
    # 3 fds per blob: more than the pager may open at once, however many this process holds.
    count = max(100, low // 3 + 20)
    blobs = {env.blob(os.urandom(100) + i.to_bytes(2, "big")): i for i in range(count)}
    assert 3 * len(blobs) > low
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))   # inherited by the pager
    try:
        p = env.pager()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for hexd, i in blobs.items():
        assert int.from_bytes((env.mnt / hexd).read_bytes()[-2:], "big") == i
    assert len(p.stats().blobs) == count


def test_listing_creates_no_cache_files(env):
    a, b = env.blob(b"a" * 5000), env.blob(b"b" * 7000)
    p = env.pager()
    sizes = {name: (env.mnt / name).stat().st_size for name in os.listdir(env.mnt)}
    assert sizes[a] == 5000 and sizes[b] == 7000
    assert sorted(f.name for f in env.cache.iterdir()) == [".lock"]
    assert (env.mnt / a).read_bytes() == b"a" * 5000
    assert sorted(f.name for f in env.cache.iterdir()) == [".lock", f"{a}.bitmap", f"{a}.data"]
    assert p.stats().blobs[b].cached_chunks == 0
