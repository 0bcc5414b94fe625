"""Keystroke-to-echo latency of a pty exec, through the Python SDK.

One sandbox runs `cat` on a terminal in raw mode without the line
discipline's echo (`stty raw -echo`), so every echoed byte made the whole
trip: client -> exec_input -> the daemon writes it into the master -> the
slave -> cat reads it and writes it back -> the master -> the daemon's
reader -> a stream frame -> client. Each sample types one byte and waits for
it to come back; the exec_input's own answer is awaited after the clock
stops (a terminal user sees the echo, not the answer).

pty_roundtrip_p50_ms / _p99_ms over `n` samples, after a warm-up. Called by
bench/core.py against its private daemon.
"""

from __future__ import annotations

import asyncio
import time

import harness
import peers

import dsecd

OP_TIMEOUT_S = 30          # one echo; a hung daemon fails the bench instead of hanging it
WARMUP = 50
READY = b"pty-ready"
SETUP = f"stty raw -echo && echo {READY.decode()} && exec cat"


async def _read_until(frames, wanted: bytes) -> float:
    """Read output chunks until `wanted` showed; the time it arrived (perf_counter_ns)."""
    seen = b""
    while wanted not in seen:
        _fd, data = await asyncio.wait_for(frames.__anext__(), OP_TIMEOUT_S)
        seen = seen[-len(wanted):] + data
    return time.perf_counter_ns()


async def _samples(stream, frames, n: int) -> list[float]:
    latencies: list[float] = []
    for i in range(-WARMUP, n):
        key = b"abcdefghijklmnopqrstuvwxyz"[i % 26:i % 26 + 1]
        t0 = time.perf_counter_ns()
        typed = asyncio.ensure_future(stream.write(key))
        t1 = await _read_until(frames, key)
        await asyncio.wait_for(typed, OP_TIMEOUT_S)
        if i >= 0:
            latencies.append((t1 - t0) / 1e6)
    return latencies


async def measure_pty_roundtrip(sock: str, n: int, create_args: dict) -> dict:
    """n keystrokes into `cat` on a terminal in one sandbox."""
    harness.log(f"pty round trip: {n} keystrokes to echo (+{WARMUP} warm-up)")
    async with dsecd.Client(sock) as c:
        sb = await asyncio.wait_for(c.create(**create_args), OP_TIMEOUT_S * 4)
        try:
            stream = sb.exec_stream(["sh", "-c", SETUP], pty=True)
            frames = stream.__aiter__()
            try:
                await _read_until(frames, READY)
                latencies = await _samples(stream, frames, n)
            finally:
                await frames.aclose()          # cancels the exec: cat never ends by itself
        finally:
            await asyncio.wait_for(sb.destroy(force=True), OP_TIMEOUT_S * 4)     # the cancelled cat may linger
    out = {"pty_roundtrip_p50_ms": peers.pct(latencies, 50), "pty_roundtrip_p99_ms": peers.pct(latencies, 99)}
    harness.log(f"  {out}")
    return out
