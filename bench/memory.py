"""`make bench-memory`: what pausing gives back, what resuming costs, jobs of 500.

Through private daemons (bench/harness.py), one per swap backend: first
with a swap file of the daemon's own on local disk (memory.swapfile, the
realistic configuration for a host with a local disk), then with a zram
device (memory.zram). Anonymous pages leave RAM only through swap.

* paused_reclaimed_fraction (swap file) / paused_reclaimed_fraction_zram:
  N idle sandboxes each hold 20 MiB of anonymous memory (half runs of one
  byte, half base64 of random bytes: lz4 gets 2.0:1 out of it) and 20 MiB
  of page cache (a file they wrote and read). Host memory freed by pausing
  them all over what their memory cgroups held before, from the owners'
  counters: what left the sandboxes' memcgs minus what every zram device
  grew by in RAM (a swap file takes none). `..._host` is the same from
  /proc/meminfo: MemTotal - MemFree - the per-CPU free lists, before and
  after; it is host-wide, so every other process on the host moves it
  (0.66-1.19 for the same 0.99 in docs/memory.md). The log shows where the
  held memory was and went.
* resume_first_exec_p50_ms / _p99_ms (swap file): exec `true` on each paused
  sandbox (the exec resumes it first: thaw, then prefetch behind the request).
* job_pause_500_s / job_resume_500_s (swap file): `job pause` / `job resume`
  of 500 idle sandboxes labelled with one job.
* damon_available: what `dsec info` says (false on a host whose DAMON
  interface another owner's kdamond holds).
* kernel_floor_creates_per_s / fork_floor_calls_per_s: this host's floors
  (bench/floors.py), medians of rounds taken before the fill, between the
  pause and the resumes and after them (first backend only): how fast the
  host was during this run, next to its figures.
* swap_backend: the backend of the unsuffixed figures.

Last line of stdout: one JSON object with those names.
Run as root: .venv/bin/python bench/memory.py [--quick] [--swap swapfile|zram|both]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time

import harness
import peers
from floors import Floors

import dsecd
from dsecd.mem.swapfile import Swapfile, SwapfileConfig
from dsecd.mem.zram import ZramConfig, ZramSwap, active_swaps, swap_areas

HOLD = ("mkdir -p /work; (x=\"$(head -c 10485760 /dev/zero | tr '\\0' a)$(head -c 7864320 /dev/urandom | base64)\"; "
        "head -c 20971520 /dev/urandom > /work/f; cat /work/f > /dev/null; echo ok > /tmp/ready; "
        # Not `sleep` last: ash would exec it in place of the shell that holds x.
        "exec 0<&- 1>&- 2>&-; sleep 100000; echo \"${#x}\") > /dev/null 2>&1 &")
log = harness.log


def pcp_free() -> int:
    """Bytes on the per-CPU free page lists (/proc/zoneinfo pagesets `count`).
    They are free but not in MemFree, and a bulk free (a pause) fills them:
    on this host they hold 50-250 MiB, moving with every bulk free."""
    pages = 0
    with open("/proc/zoneinfo") as f:
        for line in f:
            key, _, value = line.strip().partition(":")
            if key == "count":
                pages += int(value)
    return pages * os.sysconf("SC_PAGE_SIZE")


def host_used() -> tuple[int, int]:
    """Host memory in use: (MemTotal - MemFree - per-CPU free lists, MemTotal - MemFree).
    MemFree, not MemAvailable: the page cache a pause reclaims is "available"
    before and after, so MemAvailable would not see it leave; zram's
    compressed store is counted as used, so the figure is net of swap."""
    fields = harness.meminfo()
    used = fields["MemTotal"] - fields["MemFree"]
    return used - pcp_free(), used


STAT_KEYS = ("rss", "cache", "mapped_file", "shmem", "dirty", "writeback", "swap", "inactive_anon",
             "active_anon", "inactive_file", "active_file", "unevictable")
MEMINFO_KEYS = ("MemFree", "Cached", "Buffers", "AnonPages", "Shmem", "SwapCached", "Slab", "SReclaimable",
                "SUnreclaim", "PageTables", "KernelStack", "Dirty", "Writeback", "Mapped")


def group_stats(infos: list[dict]) -> dict[str, int]:
    """Sum over the sandboxes' memory cgroups of memory.stat (v1 names), the
    usage and the kernel memory charged to them: where the held bytes are."""
    out = dict.fromkeys(STAT_KEYS + ("usage", "kmem"), 0)
    for info in infos:
        out["usage"] += cgroup_usage(info)          # v1 or v2
        d = info["cgroups"].get("memory")
        if not d:
            continue
        with open(f"{d}/memory.stat") as f:
            for line in f:
                key, value = line.split()
                if key in out:
                    out[key] += int(value)
        try:
            with open(f"{d}/memory.kmem.usage_in_bytes") as f:
                out["kmem"] += int(f.read())
        except OSError:
            pass
    return out


def swaps() -> str:
    """Used swap per area, and zram's mm_stat (orig, compressed, used), in MiB."""
    out = []
    for name, area in swap_areas().items():
        extra = ""
        if name.startswith("/dev/zram"):
            orig, compr, mem_used = (v >> 20 for v in zram_mm_stat(name)[:3])
            extra = f" (zram orig {orig} compr {compr} used {mem_used} MiB)"
        out.append(f"{name} used {area['used'] >> 20} MiB{extra}")
    return "; ".join(out) or "no swap"


def zram_mm_stat(dev: str) -> list[int]:
    with open(f"/sys/block/{dev[5:]}/mm_stat") as f:
        return [int(x) for x in f.read().split()]


def breakdown(before: dict, after: dict) -> str:
    return ", ".join(f"{k} {before[k] / 2**20:.0f}->{after[k] / 2**20:.0f}" for k in before)


def cgroup_usage(info: dict) -> int:
    d = info["cgroups"].get("memory")
    if d:
        with open(f"{d}/memory.usage_in_bytes") as f:
            return int(f.read())
    with open(f"{info['cgroups']['unified']}/memory.current") as f:
        return int(f.read())


async def gather_limited(coros, limit: int = 16):
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


async def wait_ready(sb, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if await sb.read_file("/tmp/ready") == b"ok\n":
                return
        except dsecd.DsecError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"sandbox {sb.id} did not finish filling its memory in {timeout}s")


def swap_ram() -> int:
    """RAM that swap uses now: every active zram device's compressed store and
    metadata (mem_used_total; all of them, since the kernel puts pages on the
    highest-priority area, which need not be our daemon's); a swap file
    uses none (its swap cache pages stay charged to the sandboxes' memcgs)."""
    return sum(zram_mm_stat(name)[2] for name in active_swaps() if name.startswith("/dev/zram"))


async def reclaim_and_resume(sock: str, n: int, backend: str, resume: bool = True,
                             floors: Floors | None = None) -> dict:
    async with dsecd.Client(sock) as c:
        log(f"[{backend}] {n} sandboxes holding 20 MiB anon + 20 MiB page cache each")
        sbs = await gather_limited([c.create(image="busybox", memory="256M") for _ in range(n)])
        await gather_limited([sb.exec(["sh", "-c", HOLD]) for sb in sbs], limit=2)
        await gather_limited([wait_ready(sb) for sb in sbs])     # the fills run in the background
        # Read each file once more: with 200 fills taking minutes on a shared
        # host, the first sandboxes' page cache had partly been dropped by
        # then (200 x 20 MiB written, 1.8-3.3 GiB still cached), and the figure
        # is about sandboxes that hold 20 MiB of it each.
        await gather_limited([sb.exec(["sh", "-c", "cat /work/f > /dev/null"]) for sb in sbs], limit=8)
        await asyncio.sleep(1)
        infos = await gather_limited([sb.inspect() for sb in sbs])
        g_before, m_before, z_before = group_stats(infos), harness.meminfo(), swap_ram()
        held = g_before["usage"]
        before, before_raw = host_used()
        t0 = time.perf_counter()
        await gather_limited([sb.pause() for sb in sbs], limit=8)
        pause_s = time.perf_counter() - t0
        await asyncio.sleep(2)
        after, after_raw = host_used()
        g_after, m_after, z_after = group_stats(infos), harness.meminfo(), swap_ram()
        log(f"  memcgs (MiB, sum): {breakdown(g_before, g_after)}")
        log("  host (MiB): " + breakdown({k: m_before[k] for k in MEMINFO_KEYS},
                                        {k: m_after[k] for k in MEMINFO_KEYS}))
        log(f"  swap: {swaps()}")
        fraction = (before - after) / held
        # The same quantity from the owners' counters: what left the memcgs minus
        # what the swap backend grew by in RAM. MemFree is host-wide and moves
        # with every other process on the host; these do not.
        accounted = (g_before["usage"] - g_after["usage"] - (z_after - z_before)) / held
        log(f"  held {held / 2**20:.0f} MiB; host used {before / 2**20:.0f} -> {after / 2**20:.0f} MiB "
            f"after pausing (in {pause_s:.1f} s): fraction {fraction:.3f} (MemFree + per-CPU lists), "
            f"{(before_raw - after_raw) / held:.3f} (MemFree alone), {accounted:.3f} "
            f"(memcgs - swap RAM: {(g_before['usage'] - g_after['usage']) / 2**20:.0f} - "
            f"{(z_after - z_before) / 2**20:.0f} MiB)")
        sfx = "" if backend == "swapfile" else f"_{backend}"
        out = {f"paused_reclaimed_fraction{sfx}": round(accounted, 3),
               f"paused_reclaimed_fraction{sfx}_host": round(fraction, 3)}
        if resume:
            if floors is not None:
                await asyncio.to_thread(floors.round)
            lat = []
            for sb in sbs:
                t = time.perf_counter()
                r = await sb.exec(["true"])
                lat.append((time.perf_counter() - t) * 1000)
                assert r.exit_code == 0, r
            log(f"  resume + first exec: p50 {statistics.median(lat):.1f} ms, p99 {peers.percentile(lat, 99):.1f} "
                f"ms, max {max(lat):.1f} ms")
            out.update({"resume_first_exec_p50_ms": round(statistics.median(lat), 2),
                        "resume_first_exec_p99_ms": round(peers.percentile(lat, 99), 2)})
            if floors is not None:
                await asyncio.to_thread(floors.round)
        await gather_limited([sb.destroy(force=True) for sb in sbs])
        return out


async def job_of(sock: str, n: int) -> dict:
    async with dsecd.Client(sock) as c:
        log(f"a job of {n} idle sandboxes")
        sbs = await gather_limited([c.create(image="busybox", labels={"job": "bench"}) for _ in range(n)])
        t0 = time.perf_counter()
        r = await c.job_pause("bench")
        paused_s = time.perf_counter() - t0
        freeze_s = r.get("freeze_s")
        assert len(r["paused"]) == n and not r["failed"], r
        await asyncio.sleep(2)              # the reclaim runs behind the answer
        t0 = time.perf_counter()
        r = await c.job_resume("bench")
        resumed_s = time.perf_counter() - t0
        thaw_s = r.get("thaw_s")
        assert len(r["resumed"]) == n and not r["failed"], r
        log(f"  job pause {paused_s:.2f} s (freeze_all {freeze_s} s), job resume {resumed_s:.2f} s "
            f"(thaw_all {thaw_s} s)")
        await c.job_rm("bench", force=True)
        del sbs
        return {f"job_pause_{n}_s": round(paused_s, 3), f"job_resume_{n}_s": round(resumed_s, 3)}


async def main(sock: str, args, backend: str, first: bool, made: dict) -> dict:
    out = {}
    async with dsecd.Client(sock) as c:
        made.update((await c.info())["memory"]["zram"])
    floors = Floors() if first else None
    if floors is not None:
        await asyncio.to_thread(floors.round)
    if args.sandboxes:
        out.update(await reclaim_and_resume(sock, args.sandboxes, backend, resume=first, floors=floors))
    if first:
        out.update(await job_of(sock, args.job))
        async with dsecd.Client(sock) as c:
            out["damon_available"] = (await c.info())["features"]["damon"]["available"]
    if floors is not None:
        out.update({k: v for k, v in floors.figures().items() if not k.endswith("_rounds")})
    return out


# Admission off: 500 idle sandboxes are far past any sane CPU oversubscription of 2 cores.
BASE_CONFIG = ("[limits]\nmax_sandboxes = 4096\n"
               "[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n")


@contextlib.contextmanager
def own_swapfile_dir():
    """A directory on local disk for the bench daemon's swap file, outside the
    daemon's temp dir: if the daemon dies without its swapoff, the bench
    still finds the file here, turns it off and deletes it (swap we turn on
    we turn off)."""
    d = tempfile.mkdtemp(prefix="dsecd-bench-swap-", dir="/var/tmp")
    path = os.path.join(d, "swapfile")
    try:
        yield path
    finally:
        if path in active_swaps():
            log(f"daemon left {path} on: swapoff")
        Swapfile(SwapfileConfig(path=path)).teardown()     # swapoff if on, delete (our label only)
        shutil.rmtree(d, ignore_errors=True)


def remove_left_zram(z: dict) -> None:
    """Swap we turn on we turn off: if the daemon stopped without removing the
    zram device it made (its number from `dsec info`), do it here."""
    dev = z.get("device")
    if not dev or not os.path.exists(f"/sys/block/{dev[5:]}"):
        return
    log(f"daemon left {dev} behind ({'still swap' if dev in active_swaps() else 'not swap'}): removing it")
    left = ZramSwap(ZramConfig())
    left.device = int(dev[len("/dev/zram"):])
    left.teardown()                 # swapoff if on, reset, hot_remove


def backend_config(backend: str, swap_path: str) -> str:
    if backend == "swapfile":
        return f'[memory.swapfile]\nenabled = true\npath = "{swap_path}"\nsize = "8G"\n' + BASE_CONFIG
    return '[memory.zram]\nenabled = true\nsize = "8G"\n' + BASE_CONFIG


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="20 sandboxes and a job of 50")
    p.add_argument("--sandboxes", type=int, default=200)
    p.add_argument("--job", type=int, default=500)
    p.add_argument("--swap", choices=("swapfile", "zram", "both"), default="both",
                   help="swap backend(s); the first one also runs the resume and job figures")
    a = p.parse_args()
    if a.quick:
        a.sandboxes, a.job = 20, 50
    rootfs = harness.build_rootfs()
    figures = {"swap_backend": "zram" if a.swap == "zram" else "swapfile"}
    backends = ["swapfile", "zram"] if a.swap == "both" else [a.swap]
    with own_swapfile_dir() as swap_path:
        for i, backend in enumerate(backends):
            made: dict = {}
            try:
                with harness.private_daemon(rootfs, "busybox", extra_config=backend_config(backend, swap_path)) as d:
                    figures.update(asyncio.run(main(d.sock, a, backend, i == 0, made)))
            finally:
                remove_left_zram(made)
    print(json.dumps(figures))
