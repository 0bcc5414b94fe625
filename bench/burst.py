"""`make bench-burst`: FnCall, warm pools and burst admission on this host.

It starts a private daemon (bench/harness.py), imports the busybox rootfs as
"busybox" and the host's python3 (scripts/mkpyrootfs.sh) as "py", and
measures through the Python SDK:

* fncall_p50_ms / _p99_ms: sequential `call(py, python3 -c 'print(1)')`,
  through the zygote, client-observed;
* fresh_python_p50_ms: the same program as an exec in a running container
  sandbox of the same image (a fresh interpreter each time), and
  fncall_speedup = fresh / fncall;
* fncall_per_s: `--clients` clients calling at once, over the batch's wall
  time; the batch runs in `--fncall-rounds` rounds, each between two rounds
  of the fork floor (bench/floors.py: a Python process forking a child per
  call, two at once), and fncall_floor_ratio is the median over the rounds
  of calls/s over the mean of the floor rounds on either side;
  fork_floor_calls_per_s is the floor rounds' median (all of them in
  fork_floor_rounds); each fork floor round is followed by one of the
  isolated fork floor (each child set up as a call's worker is: its own
  process group, dir, rlimits, nice, IPC namespace and uid; bench/floors.py),
  fork_isolated_floor_calls_per_s, and fncall_isolation_ceiling is the
  median of isolated / bare over the rounds: the most fncall_floor_ratio
  can be while each call keeps that isolation;
* pool_create_p50_ms / _p99_ms: sequential creates served by a warm pool
  (`pool_set` min `--pool`), client-observed;
* burst_2000_s: `--burst` creates (with idempotency keys, from `--clients`
  clients in two jobs, a tenth of them sent twice as a retrying client would)
  from the first request until every sandbox has answered an exec `true`;
  burst_creates_per_s: creates answered per second over the same burst. The
  burst runs in `--rounds` rounds of equal size (the sandboxes of earlier
  rounds stay up), each between two rounds of the kernel floor
  (bench/floors.py: `unshare` of the sandbox's namespaces + exec of
  /bin/true, two loops at once); burst_floor_ratio is the median over the
  rounds of creates/s over the mean of the floor rounds on either side
  (burst_rounds_per_s, kernel_floor_rounds; kernel_floor_creates_per_s is
  their median);
  burst_create_p99_ms: one create's latency (queue wait and busy retries
  included); burst_busy_retries: `busy` answers that were retried after
  retry_after_s;
* lost_or_duplicated: keys without exactly one live sandbox, plus sandboxes
  of the burst that no key owns (must be 0);
* exec_per_s / exec_host_ms: `--execs` execs of `true` from `--clients`
  clients (4 in flight each) spread over 100 running sandboxes: execs per
  second and the host's busy CPU ms per exec (every process: execs forked by
  the sandboxes' inits run outside the daemon). The same work against a
  second daemon with `sandbox.exec_via = "helper"` (the daemon's spawn helper
  enters the sandbox for each exec) gives exec_helper_per_s and
  exec_helper_host_ms; exec_by_init_cpu_ratio = helper / init host CPU per
  exec (> 1: init's fork is cheaper);
* create_breakdown_cpu_ms: CPU ms of one create + exec. `floor`: the
  kernel's part without dsecd, step by step (bench/floor_create.c, run by
  floors.create_stages before the burst: namespaces, then what cgroups,
  mounts, pivot_root and seccomp add; each level `--stage-n` creates in two
  streams, three alternated runs, medians; their rates in
  floor_rates_per_s), and floor_total; `dsecd`: a burst sandbox's CPU by
  who ran it (the daemon, the sandbox's own cgroup, the client; medians of
  the rounds), dsecd_total and dsecd_over_floor;
* burst_sandbox_floor_ratio: burst_creates_per_s over the rate of the
  kernel's whole create (floor_rates_per_s.seccomp: the same namespaces,
  cgroups, mounts, root switch and seccomp filter, exec of busybox's
  `true`, no dsecd). Unlike burst_floor_ratio it is not interleaved with
  the burst (the stages run once, before it) and the stages make each
  sandbox among none live, so it reads high on a host whose load rises
  during the burst; it says how far dsecd is from a create with the same
  isolation, where burst_floor_ratio compares with one without cgroups,
  mounts or a filter; burst_isolation_ceiling: that rate over
  kernel_floor_creates_per_s, the most burst_floor_ratio can be while each
  sandbox keeps its isolation (the same caveat: measured once, before);
* burst_perf_split (with `--perf`, where perf is installed): the last burst
  round under `perf record -g` of the daemon and this client, samples by
  who ran them (daemon loop, daemon workers, spawn children before
  dsec-init, dsec-init, the exec, the client) and by outermost syscall or
  binary, in % of all (bench/perfsplit.py);
* burst_destroy_s / burst_destroys_per_s / burst_destroy_host_ms: the
  burst's sandboxes destroyed with one `destroy_all`: wall time, rate, and
  the host's busy CPU ms per sandbox, counted until the host is quiet again
  (the kernel frees a removed cgroup in kworkers, after the rmdir returned:
  docs/burst.md, 'A destroy'); burst_destroy_failed: destroys that failed (0);
* fncall_cpu_ms / burst_cpu_ms: where the CPU time of the concurrent fncall
  batch (per call) and of the burst (per sandbox, create + exec) went
  (medians of the rounds): the daemon (all threads, plus the exec and spawn
  children it reaped), the call sandbox's cgroup (zygote and its workers;
  also split into the zygote itself and the workers it reaped) or, for the
  burst, every sandbox's cgroup, this benchmark's own client process,
  and the whole host's busy CPU (`host`, from /proc/stat: everything above
  plus the sandboxes' own processes, and whatever else runs here). The
  per-process figures leave other sessions out, so they are comparable
  across runs where the wall-clock rates are not.

Progress goes to stderr; the last line of stdout is one JSON object. Clean-up
as in bench/core.py. Run as root: `.venv/bin/python bench/burst.py [--quick]
[--perf]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import time

import floors
import harness
import peers
import uvloop
from floors import Floors
from perfsplit import PerfRecorder

import dsecd
from dsecd.errors import Busy

# The burst asks for far more sandboxes than 2 cores x the default
# oversubscription admit: admission by CPU/memory off, max_sandboxes above it.
CONFIG = ("[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n"
          "[limits]\nmax_sandboxes = 8192\nmax_requests_per_client = 1024\n")
SHAPE = {"cpu": 0.1, "memory": "64M"}
OP_TIMEOUT_S = 300
log = harness.log


pct = peers.pct


class CpuMeter:
    """CPU seconds used by the daemon, a call sandbox's cgroup and this client."""

    def __init__(self, info: dict, below_root: str | None = None, zygote: int | None = None):
        self.pid = info["pid"]
        self.zygote = zygote
        # The group's CPU counter: v1 cpuacct.usage (ns), else v2 cpu.stat
        # usage_usec. Looked up at each sample: the group may not exist yet
        # (the daemon makes <cgroup_root> with the first sandbox).
        self.usage = []
        if below_root is not None:
            dirs = info["paths"]["cgroup_dirs"]
            self.usage = [f"{d}/{below_root}/cpuacct.usage" for d in dirs.values()]
            self.usage += [f"{d}/{below_root}/cpu.stat" for k, d in dirs.items() if k == "unified"]

    def sample(self) -> dict:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        out = {"daemon": sum(int(x) for x in fields[11:15]) / tick}    # utime stime cutime cstime
        if self.zygote:     # the zygote itself, and the workers it reaped
            with open(f"/proc/{self.zygote}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out["zygote"] = sum(int(x) for x in fields[11:13]) / tick
            out["workers"] = sum(int(x) for x in fields[13:15]) / tick
        if self.usage:
            out["sandbox"] = 0.0
            for path in self.usage:
                try:
                    text = open(path).read()
                except FileNotFoundError:
                    continue
                out["sandbox"] = (int(text) / 1e9 if path.endswith("usage")
                                  else int(text.split("usage_usec")[1].split()[0]) / 1e6)
                break
        r = resource.getrusage(resource.RUSAGE_SELF)
        out["client"] = r.ru_utime + r.ru_stime
        out["host"] = host_busy_s()
        return out

    @staticmethod
    def per(before: dict, after: dict, n: int) -> dict:
        return {k: round((after[k] - before[k]) * 1000 / n, 3) for k in before}


def host_busy_s() -> float:
    """CPU seconds the host spent busy (user, nice, system, irq, softirq), all CPUs."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")


def host_busy_until_quiet(busy_cpus_below: float = 0.25, window_s: float = 0.5, max_s: float = 30.0) -> float:
    """host_busy_s() when the host went quiet: at the start of the first
    `window_s` in which less than `busy_cpus_below` CPUs' worth was busy (an
    absolute amount, not a share of all CPUs: the kernel's deferred cgroup
    work runs under one mutex, on one CPU at a time), or after `max_s`. Work
    the kernel queued for later is done by then, and the quiet window's own
    noise is left out."""
    end = time.monotonic() + max_s
    before = host_busy_s()
    while time.monotonic() < end:
        time.sleep(window_s)
        now = host_busy_s()
        if (now - before) / window_s < busy_cpus_below:
            break
        before = now
    return before


def build_py_rootfs() -> str:
    out = subprocess.run(["bash", str(harness.REPO / "scripts" / "mkpyrootfs.sh")], check=True,
                         stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


async def measure_fncall(sock: str, n: int, clients: int, total: int, floors: Floors, rounds: int) -> dict:
    argv = ["python3", "-c", "print(1)"]
    async with dsecd.Client(sock) as c:
        for _ in range(20):                    # call sandbox + zygote start, warm caches
            r = await c.call("py", argv=argv)
        if (r.exit_code, r.stdout, r.path) != (0, b"1\n", "zygote"):
            raise RuntimeError(f"fncall warm-up: {r}")
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            r = await c.call("py", argv=argv)
            lat.append((time.perf_counter() - t) * 1000)
            if r.stdout != b"1\n":
                raise RuntimeError(f"fncall: {r}")
        log(f"fncall: p50 {pct(lat, 50)} ms, p99 {pct(lat, 99)} ms")
        sb = await c.create("py", cpu=1, memory="512M")
        fresh = []
        for i in range(max(n // 5, 10) + 3):
            t = time.perf_counter()
            r = await sb.exec(argv, timeout=30)
            if i >= 3:
                fresh.append((time.perf_counter() - t) * 1000)
            if r.stdout != b"1\n":
                raise RuntimeError(f"fresh python exec: {r}")
        await sb.destroy(force=True)
        log(f"fresh python exec: p50 {pct(fresh, 50)} ms")
    async with dsecd.Client(sock) as c:
        info = await c.info()
    box = next(b for b in info["fncall"]["boxes"] if b["image"] == "py")
    # The call sandbox's group sits below `<cgroup_root>/.fncall/` (dsecd/backends/fncall.py).
    meter = CpuMeter(info, f".fncall/{box['id']}", box["zygote_pid"])

    async def one(cl, _i: int) -> None:
        r = await cl.call("py", argv=argv)
        if r.stdout != b"1\n":
            raise RuntimeError(f"fncall (concurrent): {r}")

    # The batch in rounds, each between two fork-floor rounds (bench/floors.py).
    per = max(total // rounds, 1)
    walls, rates, cpus = [], [], []
    await asyncio.to_thread(floors.round)
    for _ in range(rounds):
        wall, cpu = await run_batch(sock, clients, per, one, meter)
        walls.append(wall)
        rates.append(per / wall)
        cpus.append(cpu)
        await asyncio.to_thread(floors.round)
    cpu = {k: round(statistics.median(c[k] for c in cpus), 3) for k in cpus[0]}
    log(f"fncall: {per * rounds} calls from {clients} clients in {sum(walls):.2f} s "
        f"({', '.join(f'{r:.0f}' for r in rates)}/s by round); CPU ms per call {cpu}")
    return {"fncall_p50_ms": pct(lat, 50), "fncall_p99_ms": pct(lat, 99),
            "fresh_python_p50_ms": pct(fresh, 50),
            "fncall_speedup": round(pct(fresh, 50) / max(pct(lat, 50), 1e-6), 1),
            "fncall_per_s": round(per * rounds / sum(walls), 1),
            "fncall_floor_ratio": Floors.ratio(rates, floors.fork), "fncall_cpu_ms": cpu}


async def run_batch(sock: str, clients: int, total: int, one, meter: CpuMeter) -> tuple[float, dict]:
    """`total` requests `one(client, i)` from `clients` connections, four in
    flight on each (many per connection, as the SDK allows): the wall time
    and the CPU ms per request."""
    conns = [dsecd.Client(sock) for _ in range(clients)]
    for cl in conns:
        await cl.connect()
    left = [total]

    async def worker(cl) -> None:
        while left[0] > 0:
            left[0] -= 1
            await one(cl, left[0])

    cpu0 = meter.sample()
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(worker(cl) for cl in conns for _ in range(4))), OP_TIMEOUT_S)
        return time.perf_counter() - t0, meter.per(cpu0, meter.sample(), total)
    finally:
        for cl in conns:
            await cl.close()


async def measure_pool(sock: str, n: int) -> dict:
    async with dsecd.Client(sock) as c:
        pool = await c.pool_set("busybox", n, n * 2, **SHAPE)
        deadline = time.monotonic() + OP_TIMEOUT_S
        while (await c.pool_list())[0]["ready"] < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"pool {pool['name']} not filled in {OP_TIMEOUT_S} s")
            await asyncio.sleep(0.1)
        lat, taken = [], []
        for _ in range(n):
            t = time.perf_counter()
            sb = await c.create("busybox", labels={"bench": "pool"}, **SHAPE)
            lat.append((time.perf_counter() - t) * 1000)
            if sb.info.get("pool") != pool["name"]:
                raise RuntimeError("a create matching the pool was not served by it")
            taken.append(sb)
        r = await taken[-1].exec(["true"], timeout=10)
        if r.exit_code != 0:
            raise RuntimeError(f"exec in a pool sandbox: {r}")
        await c.pool_set("busybox", 0, 0, **SHAPE)
        await c.destroy_all(force=True, labels={"bench": "pool"})
    log(f"pool create: p50 {pct(lat, 50)} ms, p99 {pct(lat, 99)} ms")
    return {"pool_create_p50_ms": pct(lat, 50), "pool_create_p99_ms": pct(lat, 99)}


async def measure_burst(sock: str, total: int, clients: int, floors: Floors, rounds: int,
                        perf: PerfRecorder | None = None) -> dict:
    """`total` creates + execs in `rounds` rounds, each between two
    kernel-floor rounds; the sandboxes of earlier rounds stay up, so the last
    round creates among total * (rounds - 1) / rounds live ones."""
    conns = [dsecd.Client(sock) for _ in range(clients)]
    for cl in conns:
        await cl.connect()
    keys = [f"burst-{i}" for i in range(total)]
    owners: dict[str, set[str]] = {k: set() for k in keys}
    lat: list[float] = []
    busy = [0]
    answered = [0.0]
    rng = random.Random(7)
    retried = set(rng.sample(keys, total // 10))
    async with dsecd.Client(sock) as c:
        # "sandbox": the CPU of every sandbox's cgroup (the parent of theirs):
        # the spawn child's steps once it joined them, dsec-init, the execs.
        meter = CpuMeter(await c.info(), "")

    async def create_and_exec(cl, key: str, job: str) -> None:
        t = time.perf_counter()
        while True:
            try:
                sb = await cl.create("busybox", key=key, labels={"job": job, "bench": "burst"}, **SHAPE)
                break
            except Busy as err:
                busy[0] += 1
                await asyncio.sleep(err.detail.get("retry_after_s", 0.1))
        lat.append((time.perf_counter() - t) * 1000)
        answered[0] = time.perf_counter()
        owners[key].add(sb.id)
        r = await sb.exec(["true"], timeout=60)
        if r.exit_code != 0:
            raise RuntimeError(f"exec true in {sb.id}: {r}")

    async def worker(i: int, cl, queue: list[str]) -> None:
        job = f"job{i % 2}"
        while queue:
            key = queue.pop()
            if key in retried:       # a client that retries without waiting for the answer
                await asyncio.gather(create_and_exec(cl, key, job), create_and_exec(cl, key, job))
            else:
                await create_and_exec(cl, key, job)

    per = total // rounds
    rates, spans, created, cpus = [], [], [], []
    await asyncio.to_thread(floors.round)
    for r in range(rounds):
        queue = keys[r * per:(r + 1) * per if r < rounds - 1 else total]
        n = len(queue)
        if perf is not None and r == rounds - 1:
            perf.start()
        cpu0 = meter.sample()
        t0 = time.perf_counter()
        # 8 requests in flight per client connection.
        await asyncio.wait_for(asyncio.gather(*(worker(i, cl, queue) for i, cl in enumerate(conns) for _ in range(8))),
                               OP_TIMEOUT_S * 4)
        spans.append(time.perf_counter() - t0)
        cpus.append(meter.per(cpu0, meter.sample(), n))
        if perf is not None and r == rounds - 1:
            perf.stop()
        created.append(answered[0] - t0)
        rates.append(n / created[-1])
        await asyncio.to_thread(floors.round)
    creates_s = sum(created)
    cpu = {k: round(statistics.median(c[k] for c in cpus), 3) for k in cpus[0]}
    async with dsecd.Client(sock) as c:
        live = [s for s in await c.list({"bench": "burst"}) if s["state"] == "running"]
        info = (await c.info())["admission"]
    ids = {s["id"] for s in live}
    owned = set().union(*owners.values())
    bad = sum(1 for k in keys if len(owners[k]) != 1) + len(ids - owned) + len(owned - ids)
    log(f"burst: {total} sandboxes answered an exec after {sum(spans):.2f} s; creates {total / creates_s:.0f}/s "
        f"({', '.join(f'{x:.0f}' for x in rates)}/s by round); busy retries {busy[0]}; queue wait p99 "
        f"{info['wait_p99_ms']} ms; lost or duplicated {bad}; CPU ms per sandbox {cpu}")
    for cl in conns:
        await cl.close()
    return {"burst_2000_s": round(sum(spans), 3), "burst_creates_per_s": round(total / creates_s, 1),
            "burst_floor_ratio": Floors.ratio(rates, floors.kernel),
            "burst_rounds_per_s": [round(x, 1) for x in rates],
            "burst_create_p50_ms": pct(lat, 50), "burst_create_p99_ms": pct(lat, 99),
            "burst_busy_retries": busy[0], "burst_sandboxes": len(ids), "lost_or_duplicated": bad,
            "burst_cpu_ms": cpu}


async def measure_exec_rate(sock: str, total: int, clients: int, prefix: str = "exec") -> dict:
    """`total` execs of `true` spread over 100 running sandboxes, `clients`
    connections with 4 in flight each: execs per second, host CPU per exec."""
    async with dsecd.Client(sock) as c:
        sbs = await asyncio.gather(*(c.create("busybox", **SHAPE) for _ in range(100)))
        meter = CpuMeter(await c.info())

    async def one(cl, i: int) -> None:
        sb = dsecd.client.Sandbox(cl, sbs[i % len(sbs)].id, {})
        r = await sb.exec(["true"], timeout=60)
        if r.exit_code != 0:
            raise RuntimeError(f"exec true in {sb.id}: {r}")

    took, cpu = await run_batch(sock, clients, total, one, meter)
    log(f"{prefix}: {total} execs in {took:.2f} s, {total / took:.0f}/s; CPU ms per exec {cpu}")
    await teardown(sock)     # its figures unused; it also waits out the kernel's clean-up before the next run
    return {f"{prefix}_per_s": round(total / took, 1), f"{prefix}_host_ms": cpu["host"]}


async def teardown(sock: str) -> dict:
    """Destroy every sandbox at once (`destroy_all`): the wall time, the
    number destroyed and the host's busy CPU ms per sandbox (the daemon's
    own figure would count each reaped init's whole life)."""
    async with dsecd.Client(sock) as c:
        busy0 = host_busy_s()
        t = time.perf_counter()
        r = await c.destroy_all(force=True)
        took = time.perf_counter() - t
        n = len(r["destroyed"])
        # The kernel frees a removed cgroup in kworkers after rmdir returns:
        # count their CPU too.
        busy1 = await asyncio.to_thread(host_busy_until_quiet)
        host_ms = (busy1 - busy0) * 1000 / max(n, 1)
        log(f"destroyed {n} sandboxes in {took:.1f} s; host CPU {host_ms:.2f} ms per sandbox")
        if r["failed"]:
            log(f"destroy_all failed for {len(r['failed'])} sandboxes: {r['failed']}")
        return {"seconds": took, "destroyed": n, "failed": len(r["failed"]), "host_ms": round(host_ms, 3)}


async def measure(sock: str, args, rootfs: str) -> dict:
    out = {}
    fork_floor = Floors(fork_n=args.fork_n, kernel=False, fork_isolated=True)
    if "fncall" in args.parts:
        out.update(await measure_fncall(sock, args.n_calls, args.clients, args.n_calls_total, fork_floor,
                                        args.fncall_rounds))
    if "pool" in args.parts:
        out.update(await measure_pool(sock, args.pool))
    if "burst" not in args.parts:
        out.update(fork_floor.figures())
        return out
    stages = None
    if args.stage_n:
        log("create stages (bench/floor_create.c): the kernel's part of a create, level by level")
        stages = await asyncio.to_thread(floors.create_stages, rootfs, args.stage_n)
    kernel_floor = Floors(kernel_n=args.floor_n, fork=False)
    perf = None
    if args.perf and PerfRecorder.available():
        async with dsecd.Client(sock) as c:
            perf = PerfRecorder((await c.info())["pid"])
    try:
        out.update(await measure_burst(sock, args.burst, args.clients, kernel_floor, args.rounds, perf))
        if perf is not None:
            out["burst_perf_split"] = await asyncio.to_thread(perf.split)
    finally:
        if perf is not None:
            perf.close()
    out.update(fork_floor.figures())
    out.update(kernel_floor.figures())
    if stages is not None:
        out["create_breakdown_cpu_ms"] = breakdown(stages, out["burst_cpu_ms"])
        out["burst_sandbox_floor_ratio"] = round(out["burst_creates_per_s"] / stages["seccomp"]["per_s"], 3)
        out["burst_isolation_ceiling"] = round(stages["seccomp"]["per_s"] / out["kernel_floor_creates_per_s"], 3)
    gone = await teardown(sock)
    out.update(burst_destroy_s=round(gone["seconds"], 3),
               burst_destroys_per_s=round(gone["destroyed"] / gone["seconds"], 1),
               burst_destroy_host_ms=gone["host_ms"], burst_destroy_failed=gone["failed"])
    return out


def breakdown(stages: dict, burst_cpu: dict) -> dict:
    """CPU ms of one create + exec `true`: the kernel's part step by step
    (bench/floor_create.c, no live sandboxes besides), then dsecd's burst
    sandbox by who ran it (daemon: every thread, the clone of the namespaces
    included; sandbox: its PID 1 from the clone on, the setup steps, dsec-init
    and the exec it forked; client: the SDK). dsecd_over_floor is what dsecd
    adds to the kernel's work: dsec-init, the daemon's Python, the client,
    and what costs more among live sandboxes (pivot_root walks every thread)."""
    steps = {"namespaces": stages["ns"]["cpu_ms"]}
    for name, key in (("cgroups", "cgroups"), ("mounts", "mounts"), ("pivot_root", "root"), ("seccomp", "seccomp")):
        steps[name] = stages[key]["adds_cpu_ms"]
    floor_total = stages["seccomp"]["cpu_ms"]
    dsecd_total = round(burst_cpu["daemon"] + burst_cpu["sandbox"] + burst_cpu["client"], 3)
    return {"floor": steps, "floor_total": floor_total,
            "floor_rates_per_s": {k: v["per_s"] for k, v in stages.items()},
            "dsecd": {"daemon": burst_cpu["daemon"], "sandbox": burst_cpu["sandbox"], "client": burst_cpu["client"]},
            "dsecd_total": dsecd_total, "dsecd_over_floor": round(dsecd_total - floor_total, 3)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-calls", type=int, default=500, help="sequential fncalls")
    p.add_argument("--n-calls-total", type=int, default=3000, help="fncalls in the concurrent batch")
    p.add_argument("--pool", type=int, default=50, help="warm pool size and pool creates measured")
    p.add_argument("--burst", type=int, default=2000, help="sandboxes in the burst")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--execs", type=int, default=2000, help="execs in the exec-rate batch (each path)")
    p.add_argument("--rounds", type=int, default=8, help="burst rounds, each between two kernel-floor rounds")
    p.add_argument("--fncall-rounds", type=int, default=3, help="fncall batch rounds, each between two fork-floor rounds")
    # floor.py's counts: 400 unshare runs, 800 forks per stream.
    p.add_argument("--floor-n", type=int, default=400, help="unshare runs per kernel-floor round")
    p.add_argument("--fork-n", type=int, default=800, help="forks per stream per fork-floor round")
    p.add_argument("--stage-n", type=int, default=100, help="creates per stream per create-stage run (0: none)")
    p.add_argument("--perf", action="store_true", help="perf record the last burst round: burst_perf_split")
    p.add_argument("--parts", default="fncall,pool,burst,exec",
                   help="comma list of the parts to run (default: all)")
    p.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    args = p.parse_args(argv)
    args.parts = set(args.parts.split(","))
    if args.quick:
        args.n_calls, args.n_calls_total, args.pool, args.burst, args.execs = 50, 300, 10, 200, 300
        args.floor_n, args.fork_n, args.stage_n = 100, 150, 30
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        log("must run as root")
        return 1
    rootfs = harness.build_rootfs()
    py = build_py_rootfs()
    with harness.private_daemon(rootfs, "busybox", extra_config=CONFIG) as daemon:
        daemon.import_image(py, "py")
        results = uvloop.run(measure(daemon.sock, args, rootfs))
        if "exec" in args.parts:
            results.update(uvloop.run(measure_exec_rate(daemon.sock, args.execs, args.clients)))
    if "exec" in args.parts:
        # The same execs through the daemon's spawn helper, for the ratio.
        with harness.private_daemon(rootfs, "busybox", extra_config='exec_via = "helper"\n' + CONFIG,
                                    tag="-helper") as daemon:
            results.update(uvloop.run(measure_exec_rate(daemon.sock, args.execs, args.clients, "exec_helper")))
        results["exec_by_init_cpu_ratio"] = round(results["exec_helper_host_ms"] / results["exec_host_ms"], 2)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    harness.run(main)
