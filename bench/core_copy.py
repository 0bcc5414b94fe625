"""File copy throughput into and out of a sandbox, against a `docker cp`-like peer.

dsecd: `write_file` and `read_file` of 64 MiB of random bytes in one
sandbox's /tmp, through the Python SDK (chunked by the SDK at
limits.max_file_chunk_bytes; the bytes of a write go through the sandbox's
copier, charged to its memory cgroup). write_file_mib_s / read_file_mib_s:
the median over `runs`. write_small_p50_ms: one 4 KiB write_file, the fixed
cost of a write (a copier started by the sandbox's init per request).

Peer (what `docker cp` does: a tar stream into and out of the container's
mount namespace), with the same bytes from a host tmpfs: `tar -c | bwrap ...
tar -x` into a fresh bubblewrap sandbox's /tmp, and `bwrap ... tar -c |
cat >/dev/null` out of one whose /tmp/data holds the file. Each includes its
bubblewrap start (a few ms, < 2% at 64 MiB). peer_write_mib_s /
peer_read_mib_s and the ratios dsecd / peer (> 1 = dsecd faster).

Called by bench/core.py against its private daemon; the peer runs on the
host while that daemon idles.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import tempfile
import time

import harness

import dsecd

MiB = 1 << 20
SIZE = 64 * MiB
OP_TIMEOUT_S = 120
CREATE_ARGS = {"image": "busybox", "cpu": 1, "memory": "512M"}


def _mib_s(seconds: float) -> float:
    return round(SIZE / MiB / seconds, 1)


async def _timed(aw) -> float:
    t0 = time.perf_counter()
    await asyncio.wait_for(aw, OP_TIMEOUT_S)
    return time.perf_counter() - t0


async def measure_dsecd_copy(sock: str, runs: int, small: int) -> dict:
    harness.log(f"file copy: {runs} x write_file/read_file of {SIZE // MiB} MiB, {small} small writes")
    data = os.urandom(SIZE)
    async with dsecd.Client(sock) as c:
        sb = await asyncio.wait_for(c.create(**CREATE_ARGS), OP_TIMEOUT_S)
        try:
            writes, reads = [], []
            for _ in range(runs):
                writes.append(await _timed(sb.write_file("/tmp/big", data)))
                t0 = time.perf_counter()
                got = await asyncio.wait_for(sb.read_file("/tmp/big"), OP_TIMEOUT_S)
                reads.append(time.perf_counter() - t0)
                if got != data:
                    raise RuntimeError("read_file returned other bytes than write_file wrote")
            page = os.urandom(4096)
            lat = [await _timed(sb.write_file(f"/tmp/small{i % 16}", page)) * 1e3 for i in range(small)]
        finally:
            await sb.destroy(force=True)
    out = {"write_file_mib_s": _mib_s(statistics.median(writes)),
           "read_file_mib_s": _mib_s(statistics.median(reads)),
           "write_small_p50_ms": round(statistics.median(lat), 3)}
    harness.log(f"  {out}")
    return out


def _pipeline(left: list[str], right: list[str]) -> float:
    """Seconds for `left | right`; both must succeed."""
    t0 = time.perf_counter()
    producer = subprocess.Popen(left, stdout=subprocess.PIPE)
    consumer = subprocess.run(right, stdin=producer.stdout, stdout=subprocess.DEVNULL, check=False)
    producer.stdout.close()
    if producer.wait() != 0 or consumer.returncode != 0:
        raise RuntimeError(f"peer pipeline failed: {left} | {right}")
    return time.perf_counter() - t0


def measure_peer_copy(rootfs: str, runs: int) -> dict:
    harness.log(f"peer copy: {runs} x tar | bwrap tar of {SIZE // MiB} MiB")
    bwrap = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", rootfs, "/", "--proc", "/proc",
             "--dev", "/dev", "--tmpfs", "/tmp"]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as src:
        with open(os.path.join(src, "big"), "wb") as f:
            f.write(os.urandom(SIZE))
        into = [_pipeline(["tar", "-C", src, "-cf", "-", "big"], [*bwrap, "/bin/tar", "-C", "/tmp", "-xf", "-"])
                for _ in range(runs)]
        out = [_pipeline([*bwrap, "--ro-bind", src, "/tmp/data", "/bin/tar", "-C", "/tmp/data", "-cf", "-", "big"],
                         ["cat"]) for _ in range(runs)]
    res = {"peer_write_mib_s": _mib_s(statistics.median(into)), "peer_read_mib_s": _mib_s(statistics.median(out))}
    harness.log(f"  {res}")
    return res


def ratios(results: dict) -> dict:
    return {"write_file_ratio": round(results["write_file_mib_s"] / results["peer_write_mib_s"], 2),
            "read_file_ratio": round(results["read_file_mib_s"] / results["peer_read_mib_s"], 2)}
