"""Background processes through the Python SDK (dsecd/engine/procs.py).

* spawn_p50_ms / _p99_ms: `sb.spawn(["true"])` until it returns the pid
  (init forked and exec'd it), in one running sandbox; each process is
  waited for after the clock stops.
* logs_follow_lag_p50_ms / _p99_ms: from a line written by a process in the
  sandbox to its arrival at a client following its output. The process (a
  static C program written into the sandbox) prints its CLOCK_MONOTONIC
  every INTERVAL_US; sandboxes have no time namespace, so the client
  compares each value with its own time.monotonic() when the line arrives.
  The lag covers the pipe, the daemon's reader and ring, the follower's
  wake-up, the frame and the client's reader.

Called by bench/core.py against its private daemon.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from pathlib import Path

import harness
import peers

import dsecd

OP_TIMEOUT_S = 30
WARMUP = 20
INTERVAL_US = 2000
CLOCK = "/bench-clock"

# Prints its CLOCK_MONOTONIC once per interval, one write() per line, after
# a start-up pause that lets the follower attach first.
CLOCK_SRC = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    long n = atol(argv[1]), interval_us = atol(argv[2]);
    char line[64];

    usleep(200000);
    for (long i = 0; i < n; i++) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int len = snprintf(line, sizeof(line), "%ld.%09ld\n", (long)ts.tv_sec, ts.tv_nsec);
        if (write(1, line, len) != len)
            return 1;
        usleep(interval_us);
    }
    return 0;
}
"""


def build_clock() -> bytes:
    """The clock printer, static (the image has no libc to link against)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "clock.c", Path(tmp) / "clock"
        src.write_text(CLOCK_SRC)
        subprocess.run(["cc", "-O2", "-static", "-Wall", "-o", str(out), str(src)], check=True)
        return out.read_bytes()


async def measure_spawn(sock: str, n: int, create_args: dict) -> dict:
    harness.log(f"spawn: {n} background `true` in one sandbox (+{WARMUP} warm-up)")
    latencies: list[float] = []
    async with dsecd.Client(sock) as c:
        sb = await asyncio.wait_for(c.create(**create_args), OP_TIMEOUT_S * 4)
        try:
            for i in range(-WARMUP, n):
                t0 = time.perf_counter_ns()
                proc = await asyncio.wait_for(sb.spawn(["true"], stdin=False), OP_TIMEOUT_S)
                t1 = time.perf_counter_ns()
                await asyncio.wait_for(proc.wait(), OP_TIMEOUT_S)
                if i >= 0:
                    latencies.append((t1 - t0) / 1e6)
        finally:
            await asyncio.wait_for(sb.destroy(force=True), OP_TIMEOUT_S * 4)
    out = {"spawn_p50_ms": peers.pct(latencies, 50), "spawn_p99_ms": peers.pct(latencies, 99)}
    harness.log(f"  {out}")
    return out


async def measure_follow_lag(sock: str, n: int, create_args: dict) -> dict:
    harness.log(f"logs follow lag: {n} lines, one per {INTERVAL_US} us (+{WARMUP} warm-up)")
    clock = build_clock()
    lags: list[float] = []
    async with dsecd.Client(sock) as c:
        sb = await asyncio.wait_for(c.create(**create_args), OP_TIMEOUT_S * 4)
        try:
            await sb.write_file(CLOCK, clock, mode=0o755)
            proc = await sb.spawn([CLOCK, str(n + WARMUP), str(INTERVAL_US)], stdin=False)
            pending = b""
            seen = 0
            async for chunk in proc.output(follow=True):
                now = time.monotonic()
                lines = (pending + chunk.data).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if seen >= WARMUP:
                        lags.append((now - float(line)) * 1000)
                    seen += 1
            st = await asyncio.wait_for(proc.wait(), OP_TIMEOUT_S)
            if st.exit_code != 0 or len(lags) != n:
                raise RuntimeError(f"clock printer: exit {st.exit_code}, {len(lags)} of {n} lines")
        finally:
            await asyncio.wait_for(sb.destroy(force=True), OP_TIMEOUT_S * 4)
    out = {"logs_follow_lag_p50_ms": peers.pct(lags, 50), "logs_follow_lag_p99_ms": peers.pct(lags, 99)}
    harness.log(f"  {out}")
    return out
