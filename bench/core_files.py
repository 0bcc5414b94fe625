"""File API figures for bench/core.py: listing a big directory, and how
soon a watch reports a change.

list_10k_files_ms: median time of one file_list (depth 1) of a directory
holding 10,000 empty files, made by an exec in the sandbox, over `runs`
lists after two warm-up ones.

watch_event_lag_p99_ms: a recursive file_watch on one connection, writes on
another (both clients in this process, on one event loop and one
perf_counter clock). Each write's clock starts just before its file_write
request is sent; the lag is the time until that file's `create` event
arrives. It is an upper bound of the watch's own lag: it includes the write
request's trip to the daemon and the write itself. Writes are 5 ms apart,
so each event is timed alone, not behind a queue of others.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time

import harness
import peers

import dsecd

MAKE_10K = ("mkdir -p /work/many && cd /work/many && i=0; "
            "while [ $i -lt 10000 ]; do : > f$i; i=$((i+1)); done")


async def measure_list_10k(sock: str, create_args: dict, runs: int) -> dict:
    async with dsecd.Client(sock) as c:
        sb = await c.create(**create_args)
        try:
            r = await sb.exec(["sh", "-c", MAKE_10K], timeout=300)
            assert r.ok, r.stderr
            times = []
            for i in range(runs + 2):
                t0 = time.perf_counter()
                entries = await sb.list_files("/work/many")
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1000)
            assert len(entries) == 10_000, len(entries)
        finally:
            await sb.destroy(force=True)
    median = round(statistics.median(times), 2)
    harness.log(f"  file_list of 10,000 files: median {median} ms over {runs} runs")
    return {"list_10k_files_ms": median}


async def measure_watch_lag(sock: str, create_args: dict, n: int) -> dict:
    async with dsecd.Client(sock) as writer, dsecd.Client(sock) as watcher:
        sb = await writer.create(**create_args)
        try:
            await sb.mkdir("/work/w/sub")
            seen = await watch_while_writing(sb.id, writer, watcher, n)
        finally:
            await sb.destroy(force=True)
    p50, p99 = peers.pct(seen, 50), peers.pct(seen, 99)
    harness.log(f"  watch event lag over {n} writes: p50 {p50} ms, p99 {p99} ms, max {round(max(seen), 2)} ms")
    return {"watch_event_lag_p50_ms": p50, "watch_event_lag_p99_ms": p99}


async def watch_while_writing(sb_id: str, writer, watcher, n: int) -> list[float]:
    sent: dict[str, float] = {}
    lags: list[float] = []
    ready = asyncio.Event()
    done = asyncio.Event()
    wsb = await watcher.get(sb_id)

    async def watch() -> None:
        async with contextlib.aclosing(wsb.watch("/work/w", recursive=True)) as events:
            async for ev in events:
                now = time.perf_counter()
                if ev["kind"] == "ready":
                    ready.set()
                elif ev["kind"] == "create" and ev["path"] in sent:
                    lags.append((now - sent.pop(ev["path"])) * 1000)
                    if len(lags) == n:
                        done.set()
                        return

    task = asyncio.get_running_loop().create_task(watch())
    await asyncio.wait_for(ready.wait(), 30)
    wsb_writer = await writer.get(sb_id)
    for i in range(n):
        path = f"/work/w/sub/f{i}"
        sent[path] = time.perf_counter()
        await wsb_writer.write_file(path, b"x", atomic=False)     # in place: `create` names the path
        await asyncio.sleep(0.005)
    await asyncio.wait_for(done.wait(), 30)
    await task
    return lags


async def measure_files(sock: str, create_args: dict, quick: bool) -> dict:
    harness.log("file API: list 10k files, watch lag")
    out = await measure_list_10k(sock, create_args, 5 if quick else 20)
    out.update(await measure_watch_lag(sock, create_args, 100 if quick else 500))
    return out
