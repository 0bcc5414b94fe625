"""Micro figures of dsec-pager (no daemon): `make bench-pager`.

On a temp store/cache/mountpoint (removed, pager stopped, mounts cleared
whatever happens), with a random blob of BLOB_MIB:

* cold_seq_mib_s   sequential read of the whole blob, store unthrottled
* warm_seq_mib_s   the same again: every chunk a hit (pager cache, direct_io)
* sparse_<chunk>_* store throttled to 1 Gbit/s + 1 ms per fetch; 128 KiB runs
                   (files) at random offsets covering ~6% of the blob, with
                   1 MiB and 64 KiB chunks: time, bytes fetched over bytes the
                   kernel read, and the time to copy the whole blob through the
                   same link (the eager mode's floor) over that time
* erofs_<chunk>_*  an EROFS layer of a synthetic tree (files of 1 KiB .. 1 MiB,
                   log-uniform) mounted file-backed over the pager, throttled
                   store; 6% of its bytes read as whole random files

Progress on stderr, one JSON object as the last line of stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsecd import native  # noqa: E402
from dsecd.fs import pager as pg  # noqa: E402

MIB = 1 << 20
BLOB_MIB = int(os.environ.get("PAGER_BENCH_MIB", "128"))
LINK_BPS = 125_000_000          # 1 Gbit/s
LATENCY_US = 1000
RUN = 128 * 1024                # bytes of one sparse read run (a file)
READAHEAD = int(os.environ.get("PAGER_BENCH_READAHEAD", "4"))   # chunks


def log(msg: str) -> None:
    print(f"bench-pager: {msg}", file=sys.stderr, flush=True)


def read_all(path: Path) -> float:
    t0 = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.read(MIB):
            pass
    return time.monotonic() - t0


def sparse(tmp: Path, pager, hexd: str, chunk: int) -> dict:
    p = pager(tmp / f"cache-{chunk}", chunk_size=chunk, bandwidth_bps=LINK_BPS,
              latency_us=LATENCY_US, readahead_chunks=READAHEAD)
    try:
        rng = random.Random(1)
        size = BLOB_MIB * MIB
        runs = int(size * 0.06) // RUN
        offsets = [rng.randrange(0, (size - RUN) // 4096) * 4096 for _ in range(runs)]
        fd = os.open(tmp / "mnt" / hexd, os.O_RDONLY)
        t0 = time.monotonic()
        try:
            for off in offsets:
                for o in range(off, off + RUN, 32 * 1024):
                    os.pread(fd, 32 * 1024, o)
        finally:
            os.close(fd)
        elapsed = time.monotonic() - t0
        st = p.stats().blobs[hexd]
    finally:
        p.stop()
    eager = BLOB_MIB * MIB / LINK_BPS + LATENCY_US / 1e6
    k = f"sparse_{chunk // 1024}k"
    log(f"6% as {RUN // 1024} KiB runs, {chunk // 1024} KiB chunks: {elapsed:.2f} s "
        f"(eager copy floor {eager:.2f} s), fetched/read "
        f"{st.fetched_bytes / st.kernel_read_bytes:.2f}")
    return {f"{k}_s": round(elapsed, 3), f"{k}_fetched_over_read":
            round(st.fetched_bytes / st.kernel_read_bytes, 2),
            f"{k}_speedup_vs_eager": round(eager / elapsed, 1)}


def make_tree(root: Path, rng: random.Random) -> list[tuple[str, int]]:
    """A synthetic layer: files of log-uniform sizes (1 KiB .. 1 MiB) in 50 dirs."""
    files, total = [], 0
    while total < BLOB_MIB * MIB:
        size = int(2 ** rng.uniform(10, 20))
        rel = f"d{len(files) % 50}/f{len(files)}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rng.randbytes(size))
        files.append((rel, size))
        total += size
    return files


def erofs_workload(tmp: Path, chunk: int, image_hex: str, files, picks) -> dict:
    """Mount the layer file-backed over the pager (throttled store) and read the
    picked files whole, as a first exec would: time and fetched / read."""
    p = pg.Pager(pg.PagerConfig(str(tmp / "store"), str(tmp / f"ecache-{chunk}"),
                                str(tmp / "mnt"), chunk_size=chunk, bandwidth_bps=LINK_BPS,
                                latency_us=LATENCY_US, readahead_chunks=READAHEAD,
                                log_path=str(tmp / "pager.log")))
    p.start()
    layer = tmp / "layer"
    layer.mkdir(exist_ok=True)
    try:
        native.mount_erofs(p.blob_path(image_hex), str(layer))
        try:
            t0 = time.monotonic()
            read = sum(len((layer / files[i][0]).read_bytes()) for i in picks)
            elapsed = time.monotonic() - t0
        finally:
            native.umount(str(layer))
        st = p.stats().blobs[image_hex]
    finally:
        p.stop()
    k = f"erofs_{chunk // 1024}k"
    log(f"EROFS layer, 6% of the bytes as whole files, {chunk // 1024} KiB chunks: "
        f"{elapsed:.2f} s, fetched/read {st.fetched_bytes / read:.2f}")
    return {f"{k}_s": round(elapsed, 3), f"{k}_fetched_over_read": round(st.fetched_bytes / read, 2)}


def erofs_bench(tmp: Path) -> dict:
    rng = random.Random(2)
    src = tmp / "tree"
    files = make_tree(src, rng)
    image = tmp / "layer.erofs"
    subprocess.run(["mkfs.erofs", "--quiet", "-T0", str(image), str(src)], check=True)
    shutil.rmtree(src)
    hexd = hashlib.sha256(image.read_bytes()).hexdigest()
    size = image.stat().st_size
    image.rename(tmp / "store" / hexd)
    total = sum(s for _, s in files)
    order = list(range(len(files)))
    rng.shuffle(order)
    picks, got = [], 0
    for i in order:
        if got >= 0.06 * total:
            break
        picks.append(i)
        got += files[i][1]
    out = {"erofs_files": len(files), "erofs_image_mib": round(size / MIB),
           "erofs_eager_floor_s": round(size / LINK_BPS + LATENCY_US / 1e6, 3)}
    for chunk in (MIB, 256 * 1024, 64 * 1024):
        out.update(erofs_workload(tmp, chunk, hexd, files, picks))
    return out


def run(tmp: Path) -> dict:
    store, cache, mnt = tmp / "store", tmp / "cache", tmp / "mnt"
    store.mkdir()
    data = os.urandom(BLOB_MIB * MIB)
    hexd = hashlib.sha256(data).hexdigest()
    (store / hexd).write_bytes(data)
    del data
    out: dict = {"blob_mib": BLOB_MIB, "readahead_chunks": READAHEAD}

    def pager(cache_dir: Path, **kw) -> pg.Pager:
        p = pg.Pager(pg.PagerConfig(str(store), str(cache_dir), str(mnt),
                                    log_path=str(tmp / "pager.log"), **kw))
        p.start()
        return p

    p = pager(cache)
    try:
        cold = read_all(mnt / hexd)
        st = p.stats().blobs[hexd]
        warm = read_all(mnt / hexd)
        out.update(cold_seq_mib_s=round(BLOB_MIB / cold), warm_seq_mib_s=round(BLOB_MIB / warm),
                   cold_fetched_over_read=round(st.fetched_bytes / st.kernel_read_bytes, 3))
        log(f"sequential: cold {out['cold_seq_mib_s']} MiB/s, warm {out['warm_seq_mib_s']} MiB/s")
    finally:
        p.stop()

    # A first exec reads whole files: runs of RUN bytes at random offsets.
    for chunk in (MIB, 64 * 1024):
        out.update(sparse(tmp, pager, hexd, chunk))
    if shutil.which("mkfs.erofs") and "erofs" in Path("/proc/filesystems").read_text():
        out.update(erofs_bench(tmp))
    return out


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-pager-"))
    try:
        result = run(tmp)
    finally:
        if (tmp / "layer").is_dir() and os.path.ismount(tmp / "layer"):
            native.umount(str(tmp / "layer"), detach=True)
        while pg.pager_mounts(str(tmp / "mnt")):
            native.umount(str(tmp / "mnt"), detach=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
