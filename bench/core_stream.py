"""Streamed exec output through the Python SDK, with and without an
idempotency key.

A keyed streamed exec's frames go through the daemon's KeyedStream
(dsecd/engine/keyedstream.py: a lock and a kept tail per frame), so that
the request sent again after a lost link takes the output up where it
stopped; an unkeyed one goes straight to its connection. One sandbox
writes `head -c SIZE /dev/zero` to stdout (under the daemon's default
8 MiB output cap, limits.max_exec_output_bytes), read whole by the
client, EXECS_PER_SAMPLE times a sample, in rounds alternating unkeyed and
keyed (a noisy host moves both alike).

exec_stream_mib_s / exec_stream_keyed_mib_s (medians over the rounds) and
exec_stream_keyed_ratio (keyed over unkeyed). Called by bench/core.py
against its private daemon; `python bench/core_stream.py` runs it alone
with a daemon of its own and prints the same JSON object.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import harness

import dsecd

SIZE = 6 << 20
EXECS_PER_SAMPLE = 4
OP_TIMEOUT_S = 120
IMAGE = "busybox"


async def _sample(sb, key: str | None) -> float:
    """MiB/s of EXECS_PER_SAMPLE execs' whole output to the client, one after another."""
    started = time.perf_counter()
    for n in range(EXECS_PER_SAMPLE):
        got = 0
        stream = sb.exec_stream(["head", "-c", str(SIZE), "/dev/zero"], key=key and f"{key}-{n}")
        async for _fd, data in stream:
            got += len(data)
        if got != SIZE or stream.result.exit_code != 0:
            raise RuntimeError(f"exec streamed {got} of {SIZE} bytes, exit {stream.result.exit_code}")
    return EXECS_PER_SAMPLE * SIZE / (time.perf_counter() - started) / 2**20


async def measure_stream(sock: str, rounds: int, create_args: dict) -> dict:
    harness.log(f"streamed exec: {rounds} rounds of {EXECS_PER_SAMPLE} x {SIZE >> 20} MiB, unkeyed then keyed")
    plain, keyed = [], []
    async with dsecd.Client(sock) as c:
        sb = await asyncio.wait_for(c.create(**create_args), OP_TIMEOUT_S)
        try:
            await asyncio.wait_for(_sample(sb, None), OP_TIMEOUT_S)        # warm-up
            for n in range(rounds):
                plain.append(await asyncio.wait_for(_sample(sb, None), OP_TIMEOUT_S))
                keyed.append(await asyncio.wait_for(_sample(sb, f"bench-stream-{n}"), OP_TIMEOUT_S))
        finally:
            await asyncio.wait_for(sb.destroy(force=True), OP_TIMEOUT_S)
    out = {"exec_stream_mib_s": round(statistics.median(plain), 1),
           "exec_stream_keyed_mib_s": round(statistics.median(keyed), 1)}
    out["exec_stream_keyed_ratio"] = round(out["exec_stream_keyed_mib_s"] / out["exec_stream_mib_s"], 3)
    harness.log(f"  {out}")
    return out


def main() -> int:
    rootfs = harness.build_rootfs()
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    with harness.private_daemon(rootfs, IMAGE) as daemon:
        results = asyncio.run(measure_stream(daemon.sock, rounds, {"image": IMAGE, "memory": "256M"}))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    harness.run(main)
