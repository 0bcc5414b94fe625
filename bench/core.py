"""`make bench-core`: the core figures of dsecd on this host, against its peers.

It starts a private daemon (own socket, state dir and cgroup subtree in a temp
dir), imports the busybox rootfs as image "busybox", and measures through the
Python SDK:

* create_exec_p50_ms / _p99_ms: sequential create + exec `true` + destroy;
* creates_per_s: 16 concurrent clients creating and destroying a fixed
  number of sandboxes, over the wall time of the whole batch;
* exec_rtt_p50_ms / _p99_ms: exec `true` in one running sandbox;
* pty_roundtrip_p50_ms / _p99_ms: one keystroke into `cat` on a pty exec
  until its echo comes back (bench/core_pty.py);
* exec_stream_mib_s / exec_stream_keyed_mib_s / exec_stream_keyed_ratio:
  a streamed exec's output to the client, without and with an idempotency
  key (bench/core_stream.py);
* write_file_mib_s / read_file_mib_s: 64 MiB into and out of a sandbox's
  /tmp, and write_small_p50_ms: one 4 KiB write (bench/core_copy.py);
* spawn_p50_ms / _p99_ms: a background process's start until its pid, and
  logs_follow_lag_p50_ms / _p99_ms: a line written by a background process
  until a following client has it (bench/core_proc.py);
* idle_host_mib_per_sandbox: host memory per idle sandbox, reclaimable
  kernel memory included (method at `host_used_bytes`), and
  idle_host_mib_per_sandbox_unreclaimable without it;
* list_10k_files_ms: median file_list of a 10,000-file directory, and
  watch_event_lag_p50_ms / _p99_ms: file_write to its file_watch event
  (bench/core_files.py, which says how each is measured);
* loop_lag_p50_ms / _p99_ms / _max_ms: how late the daemon's event loop ran
  its 100 ms timer over all of the above (dsecd/looplag.py, read from `dsec
  info` at the end). With --scrape-interval N a thread scrapes the daemon's
  metrics endpoint every N seconds meanwhile (scrapes, scrape_p50_ms,
  scrape_p99_ms: a scrape's wall time as the scraper sees it), so two runs,
  with and without, give the loop-lag cost of a scraper;

then, with the daemon stopped, the same unit of work in bubblewrap and crun
(bench/peers.py): bwrap_p50_ms, crun_p50_ms, and the ratios
create_exec_p50_ms / peer_p50_ms (bwrap_ratio, crun_ratio; > 1 = dsecd slower),
and the same 64 MiB through `tar | bwrap ... tar -x` and back (a `docker cp`
peer: peer_write_mib_s, peer_read_mib_s; write_file_ratio, read_file_ratio,
> 1 = dsecd faster).

Progress goes to stderr; the last line of stdout is one JSON object with those
names. Whatever happens (failure, Ctrl-C, SIGTERM), the bench removes its
sandboxes (`dsec rm --all`), stops its daemon, unmounts what the daemon left
mounted in the temp dir, removes its cgroup subtree and the temp dir.

Run as root: `.venv/bin/python bench/core.py [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import threading
import time
import urllib.request

import core_copy
import core_files
import core_proc
import core_pty
import core_stream
import harness
import peers
import uvloop

import dsecd

IMAGE = "busybox"
CREATE_ARGS = {"image": IMAGE, "cpu": 0.5, "memory": "256M"}
NO_ADMISSION = "[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n"
OP_TIMEOUT_S = 120  # one create/exec/destroy; a hung daemon fails the bench instead of hanging it
WARMUP = 5


log = harness.log


pct = peers.pct


async def op(aw):
    """Await one SDK call with the per-operation time limit."""
    return await asyncio.wait_for(aw, OP_TIMEOUT_S)


async def exec_true(sb) -> None:
    r = await op(sb.exec(["true"], timeout=10))
    if r.exit_code != 0 or r.timed_out:
        raise RuntimeError(f"exec true: exit {r.exit_code}, signal {r.signal}, stderr {r.stderr!r}")


async def destroy_all(sandboxes: list) -> None:
    """Destroy sandboxes popped from the list until it is empty (several of
    these may share one list). A failure is reported and the rest go on:
    `dsec rm --all` at the end catches what is left."""
    while sandboxes:
        sb = sandboxes.pop()
        try:
            await op(sb.destroy())
        except Exception as err:
            log(f"destroy failed: {err}")


async def open_clients(stack: contextlib.AsyncExitStack, sock: str, n: int) -> list:
    """n SDK connections (hello done), closed when `stack` closes."""
    return [await op(stack.enter_async_context(dsecd.Client(sock))) for _ in range(n)]


# -------------------------------------------------------------------- phases


async def measure_create_exec(sock: str, n: int) -> dict:
    """Sequential create + exec `true` + destroy, one client, timed per cycle."""
    log(f"create+exec+destroy: {n} sequential (+{WARMUP} warm-up)")
    latencies: list[float] = []
    async with dsecd.Client(sock) as c:
        for i in range(-WARMUP, n):
            t0 = time.perf_counter_ns()
            sb = await op(c.create(**CREATE_ARGS))
            try:
                await exec_true(sb)
            finally:
                await op(sb.destroy())
            if i >= 0:
                latencies.append((time.perf_counter_ns() - t0) / 1e6)
    out = {"create_exec_p50_ms": pct(latencies, 50), "create_exec_p99_ms": pct(latencies, 99)}
    log(f"  {out}")
    return out


async def measure_exec_rtt(sock: str, n: int) -> dict:
    """exec `true` n times in one running sandbox."""
    log(f"exec round trip: {n} in one sandbox (+{WARMUP * 2} warm-up)")
    latencies: list[float] = []
    async with dsecd.Client(sock) as c:
        sb = await op(c.create(**CREATE_ARGS))
        try:
            for i in range(-WARMUP * 2, n):
                t0 = time.perf_counter_ns()
                await exec_true(sb)
                if i >= 0:
                    latencies.append((time.perf_counter_ns() - t0) / 1e6)
        finally:
            await op(sb.destroy())
    out = {"exec_rtt_p50_ms": pct(latencies, 50), "exec_rtt_p99_ms": pct(latencies, 99)}
    log(f"  {out}")
    return out


async def measure_create_rate(sock: str, clients: int, total: int) -> dict:
    """`clients` connections, each creating and destroying sandboxes one after
    the other until `total` creates are done; the rate is total / wall time
    (connections are opened before the clock starts)."""
    log(f"create rate: {total} creates+destroys over {clients} concurrent clients")
    remaining = total

    async def worker(c) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1  # no await in between: the event loop makes this atomic
            sb = await op(c.create(**CREATE_ARGS))
            await op(sb.destroy())

    async with contextlib.AsyncExitStack() as stack:
        conns = await open_clients(stack, sock, clients)
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:  # a failing worker cancels the others
            for c in conns:
                tg.create_task(worker(c))
        elapsed = time.perf_counter() - t0
    out = {"creates_per_s": round(total / elapsed, 1)}
    log(f"  {out} ({elapsed:.2f} s)")
    return out


def host_used_bytes() -> tuple[int, int]:
    """(all, unreclaimable) host memory in use, bytes, from /proc/meminfo.

    all = MemTotal - MemFree - Buffers - (Cached - Shmem): everything but the
    file page cache, so reclaimable slab (dentries, inodes of the sandboxes'
    mounts) counts too - the conservative figure. unreclaimable = MemTotal -
    MemAvailable, what the kernel could not give back under pressure."""
    fields = harness.meminfo()
    every = (fields["MemTotal"] - fields["MemFree"] - fields["Buffers"]
             - (fields["Cached"] - fields["Shmem"]))
    return every, fields["MemTotal"] - fields["MemAvailable"]


async def sample_used(samples: int = 5, interval_s: float = 0.5) -> tuple[int, int]:
    values = []
    for _ in range(samples):
        values.append(host_used_bytes())
        await asyncio.sleep(interval_s)
    return (int(statistics.median(v[0] for v in values)),
            int(statistics.median(v[1] for v in values)))


async def measure_idle_memory(sock: str, clients: int, n: int) -> dict:
    """Host memory per idle sandbox.

    Method: host "used" memory = MemTotal - MemAvailable (/proc/meminfo), the
    median of 5 samples 0.5 s apart, before creating n idle sandboxes and
    again 2 s after the last create; (after - before) / n. Caches are not
    dropped (that would disturb the host): the delta is everything the host
    spends on the sandboxes that the kernel does not count as reclaimable —
    their processes, page tables, cgroups, mounts, namespaces and the
    daemon's own bookkeeping. Other activity on the host adds noise, which
    500 sandboxes amortize. If the daemon refuses more sandboxes (busy/limit),
    the figure is over the ones it created, said on stderr.
    """
    log(f"idle memory: {n} idle sandboxes over {clients} clients")
    before = await sample_used()
    created: list = []
    refused: list[BaseException] = []
    remaining = n

    async def worker(c) -> None:
        nonlocal remaining
        while remaining > 0 and not refused:
            remaining -= 1
            try:
                created.append(await op(c.create(**CREATE_ARGS)))
            except Exception as err:
                if getattr(err, "code", None) not in ("busy", "limit"):
                    raise
                refused.append(err)

    async with contextlib.AsyncExitStack() as stack:
        conns = await open_clients(stack, sock, clients)
        try:
            async with asyncio.TaskGroup() as tg:
                for c in conns:
                    tg.create_task(worker(c))
            if refused:
                log(f"  the daemon refused sandbox {len(created) + 1}: {refused[0]}")
            count = len(created)
            if count < min(n, 10):
                raise RuntimeError(f"only {count} idle sandboxes could be created")
            await asyncio.sleep(2)
            after = await sample_used()
            log(f"  destroying {count} sandboxes")
            async with asyncio.TaskGroup() as tg:
                for _ in range(clients):
                    tg.create_task(destroy_all(created))
        finally:
            await destroy_all(created)
    out = {"idle_host_mib_per_sandbox": round((after[0] - before[0]) / count / 2**20, 3),
           "idle_host_mib_per_sandbox_unreclaimable": round((after[1] - before[1]) / count / 2**20, 3)}
    log(f"  {out} (host used {before[0] / 2**20:.0f} -> {after[0] / 2**20:.0f} MiB)")
    return out


class Scraper:
    """A thread that GETs the metrics endpoint every `interval` s, as a
    Prometheus server would, and times each scrape."""

    def __init__(self, url: str, interval: float):
        self.url = url
        self.interval = interval
        self.times_ms: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=10) as r:
                    r.read()
                self.times_ms.append((time.perf_counter() - t0) * 1000)
            except OSError:
                self.failures += 1

    def results(self) -> dict:
        if self.failures:
            log(f"  {self.failures} scrapes failed")
        return {"scrapes": len(self.times_ms), "scrape_p50_ms": pct(self.times_ms, 50),
                "scrape_p99_ms": pct(self.times_ms, 99)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def loop_lag(sock: str) -> dict:
    async with dsecd.Client(sock) as c:
        lag = (await op(c.info()))["daemon"]["loop_lag"]
    out = {f"loop_lag_{k}": lag[k] for k in ("p50_ms", "p99_ms", "max_ms")}
    log(f"  event loop lag over {lag['samples']} ticks of {lag['tick_ms']:g} ms: {out}")
    return out


async def measure_dsecd(sock: str, args) -> dict:
    with contextlib.ExitStack() as stack:
        scraper = stack.enter_context(Scraper(args.metrics_url, args.scrape_interval)) \
            if args.scrape_interval else None
        results = await measure_dsecd_phases(sock, args)
    results.update(await loop_lag(sock))
    if scraper is not None:
        results.update(scraper.results())
    return results


async def measure_dsecd_phases(sock: str, args) -> dict:
    results = {}
    results.update(await measure_create_exec(sock, args.n_seq))
    results.update(await measure_exec_rtt(sock, args.n_rtt))
    results.update(await core_pty.measure_pty_roundtrip(sock, args.n_pty, CREATE_ARGS))
    results.update(await core_stream.measure_stream(sock, args.n_stream, CREATE_ARGS))
    results.update(await core_copy.measure_dsecd_copy(sock, args.n_copy, args.n_small))
    results.update(await core_proc.measure_spawn(sock, args.n_spawn, CREATE_ARGS))
    results.update(await core_proc.measure_follow_lag(sock, args.n_follow, CREATE_ARGS))
    results.update(await measure_create_rate(sock, args.clients, args.n_rate))
    results.update(await measure_idle_memory(sock, args.clients, args.n_idle))
    results.update(await core_files.measure_files(sock, CREATE_ARGS, args.quick))
    return results


def measure_peers(rootfs: str, n: int) -> dict:
    out = {}
    for name, fn in (("bwrap", peers.bench_bwrap), ("crun", peers.bench_crun)):
        log(f"peer {name}: {n} runs of /bin/true")
        lat = fn(rootfs, n)
        out[f"{name}_p50_ms"] = pct(lat, 50)
        log(f"  {name}: p50 {pct(lat, 50)} ms, p99 {pct(lat, 99)} ms")
    return out


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-seq", type=int, default=200, help="sequential create+exec+destroy")
    p.add_argument("--n-rtt", type=int, default=300, help="execs in one sandbox")
    p.add_argument("--n-pty", type=int, default=2000, help="keystrokes into a pty exec")
    p.add_argument("--n-stream", type=int, default=9, help="rounds of streamed execs, unkeyed and keyed")
    p.add_argument("--n-copy", type=int, default=5, help="64 MiB copies each way (and per peer)")
    p.add_argument("--n-small", type=int, default=300, help="4 KiB write_file calls")
    p.add_argument("--n-spawn", type=int, default=1000, help="background processes started in one sandbox")
    p.add_argument("--n-follow", type=int, default=2000, help="lines of a followed background process")
    p.add_argument("--n-rate", type=int, default=400, help="creates in the concurrent batch")
    p.add_argument("--n-idle", type=int, default=500, help="idle sandboxes for the memory figure")
    p.add_argument("--n-peers", type=int, default=200, help="runs per peer")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--rootfs", help="rootfs to import (default: scripts/mkrootfs.sh's cache)")
    p.add_argument("--daemon-config", help="dsecd --config file (default: a private cgroup_root)")
    p.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    p.add_argument("--scrape-interval", type=float, default=0.0, metavar="SECONDS",
                   help="turn the daemon's metrics endpoint on and scrape it every SECONDS during "
                        "the dsecd phases (0: no endpoint, no scraper)")
    args = p.parse_args(argv)
    if args.quick:
        args.n_seq, args.n_rtt, args.n_rate, args.n_idle, args.n_peers = 20, 30, 64, 50, 20
        args.n_pty, args.n_copy, args.n_small, args.n_stream = 300, 2, 50, 3
        args.n_spawn, args.n_follow = 200, 500
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        log("must run as root")
        return 1
    rootfs = args.rootfs or harness.build_rootfs()
    # Admission off: this bench measures footprint and speed with hundreds of
    # sandboxes on a small host, past any sane oversubscription of its cores.
    extra = NO_ADMISSION
    if args.scrape_interval:
        port = free_port()
        args.metrics_url = f"http://127.0.0.1:{port}/metrics"
        extra += f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    with harness.private_daemon(rootfs, IMAGE, args.daemon_config, extra) as daemon:
        results = uvloop.run(measure_dsecd(daemon.sock, args))

    # The daemon is gone: the peers run on the same quiet host.
    results.update(measure_peers(rootfs, args.n_peers))
    results.update(core_copy.measure_peer_copy(rootfs, args.n_copy))
    results.update(core_copy.ratios(results))
    results["bwrap_ratio"] = round(results["create_exec_p50_ms"] / results["bwrap_p50_ms"], 2)
    results["crun_ratio"] = round(results["create_exec_p50_ms"] / results["crun_p50_ms"], 2)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    harness.run(main)
