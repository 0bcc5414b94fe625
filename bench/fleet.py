"""`make bench-fleet`: dsecd beyond one host, on a simulated fleet.

The fleet is tests/integration/fleet_kit.SimFleet: N hosts (default 4), each
a network namespace of the bench's own with an sshd and a dsecd, all on this
machine; the SDK reaches them over ssh exactly as it reaches real hosts.
Every host shares this machine's cores, so "local" figures below are taken
on the same hosts, in the same run, at the same time, never on an idle
machine. Sandboxes are busybox with cpu 0.1 and 64M (1,000 of the daemons'
default 1 CPU / 512M would pass the admission capacity of 4 x 2 cores x 64).

* fleet_creates_ratio: creates/s through one dsecd.Fleet over ssh to all
  hosts (C x N concurrent workers, each create followed by its destroy, as
  bench-core's creates_per_s) over the sum of local creates/s: the same work
  through each host's own unix socket, C workers per host, all hosts at
  once, each host's rate over its own time. Rounds alternate the two; the
  ratio is of the medians. Target >= 0.8.
* remote_exec_overhead_ms: exec `true` round trip p50 over ssh minus the same
  through the host's socket, one sandbox, blocks alternated; median of the
  rounds' differences. Target <= 1.
* placement_imbalance: 1,000 creates of one job through the fleet (32 at
  once), then max/mean sandboxes per host. Target <= 1.1.
* failover_detect_s: during a burst of creates, one host's dsecd and sshd
  (and the sshd's sessions) are killed by pid; the time until the fleet's
  host_down event. Median over --kills rounds, a different host each time.
  Target <= 5. silent_detect_s: the same for a host whose link goes down
  (nothing closes: the heartbeat's bound, down_after_s + heartbeat_s).
* lost_or_duplicated: over every failover burst, idempotency keys with no
  sandbox on any host, or with more than one, once the killed host is back.
  Must be 0. duplicates_removed: creates whose answer the kill lost, made
  again elsewhere, whose first copy the fleet destroyed when the host
  rejoined (dsecd/fleet.py, "No sandbox twice").
* ray_creates_per_s: the fleet_creates_per_s work through dsecd.ray's
  RayFleet instead: a local Ray cluster of two nodes (ray.cluster_utils,
  every node advertising the `dsec` resource, its processes stopped by
  their pids after), the simulated hosts' daemons shared out between the
  nodes, each reached by the node's actor on its unix socket. Rounds
  alternate it with local creates (ray_local_creates_per_s, as
  local_creates_per_s); ray_creates_ratio is the ratio of the medians.
* ray_stream_out_mib_s, ray_stream_in_mib_s: an exec's stdout streamed out
  of a sandbox (exec_stream of `head -c`) and an exec's stdin fed into it
  (`wc -c`), --stream-mb MiB each, through Ray's actor (a streaming
  generator) and through the host's socket (local_stream_*), blocks
  alternated on one sandbox; medians, and Ray over local (*_ratio).
  The Ray figures are absent, with ray_absent saying why, when Ray is not
  installed (the optional extra: DSECD_SETUP_RAY=1 scripts/setup.sh).

Progress on stderr; the last line of stdout is one JSON object. Whatever
happens (failure, Ctrl-C, SIGTERM), every sandbox, daemon, sshd, namespace
and temp dir the bench made is removed.

Run as root: `.venv/bin/python bench/fleet.py [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import harness
import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from fleet_kit import SimFleet, sshd_skip_reason  # noqa: E402

import dsecd  # noqa: E402

IMAGE = "busybox"
SHAPE = {"cpu": 0.1, "memory": "64M"}
log = harness.log


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


async def churn(create, workers: int, total: int) -> float:
    """`workers` loops of create + destroy until `total` creates are done
    (create(worker index) makes one); creates/s over the wall time."""
    remaining = total

    async def worker(w: int) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1          # no await in between: the event loop makes this atomic
            sb = await create(w)
            await sb.destroy()

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for w in range(workers):
            tg.create_task(worker(w))
    return total / (time.perf_counter() - t0)


async def local_rate(sim: SimFleet, clients: int, per_host: int) -> float:
    """Every host through its own socket, one connection per worker, all
    hosts at once; the sum of the hosts' creates/s (each over its own time:
    a host that finishes first leaves the others more of the machine, which
    only makes this baseline harder to match)."""
    async with contextlib.AsyncExitStack() as stack:
        conns = [[await stack.enter_async_context(dsecd.Client(host.daemon.socket)) for _ in range(clients)]
                 for host in sim.hosts]
        rates = await asyncio.gather(*(churn(lambda w, cs=cs: cs[w].create(image=IMAGE, **SHAPE), clients,
                                             per_host) for cs in conns))
        return sum(rates)


async def measure_rates(sim: SimFleet, fleet: dsecd.Fleet, args) -> dict:
    n = len(sim.hosts)
    local, remote = [], []
    for r in range(args.rounds):
        local.append(await local_rate(sim, args.clients, args.rate_creates // n))
        remote.append(await churn(lambda w: fleet.create(IMAGE, **SHAPE), args.clients * n,
                                  args.rate_creates // n * n))
        log(f"  round {r + 1}: local {local[-1]:.1f} creates/s, fleet over ssh {remote[-1]:.1f}")
    out = {"local_creates_per_s": round(statistics.median(local), 1),
           "fleet_creates_per_s": round(statistics.median(remote), 1)}
    out["fleet_creates_ratio"] = round(out["fleet_creates_per_s"] / out["local_creates_per_s"], 3)
    log(f"  {out}")
    return out


def ray_absent() -> str | None:
    """Why ray_creates_per_s cannot be measured here, or None."""
    try:
        import ray  # noqa: F401
    except ImportError as err:
        return (f"Ray is not installed ({err}); DSECD_SETUP_RAY=1 scripts/setup.sh installs the "
                "optional extra dsecd[ray]")
    return None


async def measure_ray(sim: SimFleet, args) -> dict:
    """fleet.create churn and stream throughput through RayFleet, each
    alternated with the same work through the hosts' own sockets (see the
    module's docstring)."""
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    import dsecd.ray

    ray_tmp = tempfile.mkdtemp(prefix="dsr-", dir="/tmp")     # short: Ray's sockets live under it
    os.environ.update(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    node_args = {"num_cpus": 1, "resources": {"dsec": 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    n = len(sim.hosts)
    local, rates = [], []
    try:
        nodes = [cluster.head_node, cluster.add_node(**node_args)]
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        signal.signal(signal.SIGTERM, harness.interrupt)       # ray.init put its own there
        sockets: dict[str, list[str]] = collections.defaultdict(list)
        for i, host in enumerate(sim.hosts):
            sockets[nodes[i % len(nodes)].node_id].append(host.daemon.socket)
        # Nodes not named: a path no daemon serves (never this machine's default socket).
        async with dsecd.ray.RayFleet(sockets=dict(sockets), socket=os.path.join(ray_tmp, "none.sock")) as fleet:
            for r in range(args.rounds):
                local.append(await local_rate(sim, args.clients, args.rate_creates // n))
                rates.append(await churn(lambda w: fleet.create(IMAGE, **SHAPE), args.clients * n,
                                         args.rate_creates // n * n))
                log(f"  round {r + 1}: local {local[-1]:.1f} creates/s, through Ray actors {rates[-1]:.1f}")
            log(f"stream throughput: {args.stream_mb} MiB out of and into one sandbox, local vs Ray")
            streams = await measure_ray_streams(fleet, args)
    finally:
        ray.shutdown()
        cluster.shutdown()
        signal.signal(signal.SIGTERM, harness.interrupt)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = {"ray_creates_per_s": round(statistics.median(rates), 1),
           "ray_local_creates_per_s": round(statistics.median(local), 1), "ray_nodes": len(nodes)}
    out["ray_creates_ratio"] = round(out["ray_creates_per_s"] / out["ray_local_creates_per_s"], 3)
    out.update(streams)
    log(f"  {out}")
    return out


async def measure_ray_streams(fleet, args) -> dict:
    """One sandbox, reached through Ray (its FleetSandbox) and through its
    host's socket (a local Client), blocks alternated: execs' stdout
    streamed (`head -c` of /dev/zero, exec_stream, as many execs as the
    daemon's output limit asks) and an exec's stdin fed (exec with stdin,
    `wc -c`). MiB/s medians and Ray over local."""
    size = args.stream_mb << 20
    data = b"\0" * size
    got: dict[str, list[float]] = collections.defaultdict(list)
    sb = await fleet.create(IMAGE, **SHAPE)
    try:
        socket = dsecd.ray.parse_target(sb.host)[1]
        async with dsecd.Client(socket) as local:
            ways = {"local": await local.get(sb.id), "ray": sb}
            # An exec's output stops at the daemon's limits.max_exec_output_bytes: more execs, then.
            each = min(size, local.server["limits"]["max_exec_output_bytes"])
            execs = -(-size // each)
            for r in range(args.rounds):
                for way, handle in ways.items():
                    t0 = time.perf_counter()
                    n = 0
                    for _ in range(execs):
                        async for _fd, chunk in handle.exec_stream(["head", "-c", str(each), "/dev/zero"]):
                            n += len(chunk)
                    got[f"{way}_out"].append(n / (time.perf_counter() - t0) / (1 << 20))
                    if n != each * execs:
                        raise RuntimeError(f"exec_stream {way}: {n} bytes of {each * execs}")
                    t0 = time.perf_counter()
                    r_in = await handle.exec(["wc", "-c"], stdin=data)
                    got[f"{way}_in"].append(size / (time.perf_counter() - t0) / (1 << 20))
                    if int(r_in.stdout.split()[0]) != size:
                        raise RuntimeError(f"exec stdin {way}: wc counted {r_in.stdout!r} of {size}")
                log(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f} MiB/s" for k, v in got.items()))
    finally:
        await sb.destroy(force=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    return {"ray_stream_out_mib_s": round(med["ray_out"], 1), "local_stream_out_mib_s": round(med["local_out"], 1),
            "ray_stream_out_ratio": round(med["ray_out"] / med["local_out"], 3),
            "ray_stream_in_mib_s": round(med["ray_in"], 1), "local_stream_in_mib_s": round(med["local_in"], 1),
            "ray_stream_in_ratio": round(med["ray_in"] / med["local_in"], 3)}


async def measure_exec(sim: SimFleet, args) -> dict:
    host = sim.hosts[0]
    diffs, all_local, all_ssh = [], [], []
    async with dsecd.Client(host.daemon.socket) as local, \
            dsecd.Client(host.target, ssh=sim.ssh) as remote:
        sb = await local.create(image=IMAGE, **SHAPE)
        there = await remote.get(sb.id)
        try:
            for _ in range(10):                     # warm both paths
                await sb.exec(["true"])
                await there.exec(["true"])
            for _ in range(args.rounds * 2):
                times = {}
                for name, handle in (("local", sb), ("ssh", there)):
                    lat = []
                    for _ in range(args.exec_n):
                        t0 = time.perf_counter_ns()
                        await handle.exec(["true"])
                        lat.append((time.perf_counter_ns() - t0) / 1e6)
                    times[name] = lat
                all_local += times["local"]
                all_ssh += times["ssh"]
                diffs.append(pct(times["ssh"], 50) - pct(times["local"], 50))
        finally:
            await sb.destroy(force=True)
    out = {"remote_exec_overhead_ms": round(statistics.median(diffs), 3),
           "exec_rtt_local_p50_ms": round(pct(all_local, 50), 3),
           "exec_rtt_ssh_p50_ms": round(pct(all_ssh, 50), 3),
           "exec_rtt_ssh_p99_ms": round(pct(all_ssh, 99), 3)}
    log(f"  {out}")
    return out


async def burst(fleet: dsecd.Fleet, job: str, total: int, concurrency: int, keys: list[str],
                during=None) -> list:
    """`total` creates of `job` through the fleet, `concurrency` at once;
    during() is awaited once, when a third of them are done (a kill, say)."""
    made: list = []
    todo = iter(range(total))

    async def worker() -> None:
        for i in todo:
            key = f"{job}-{i}"
            keys.append(key)
            made.append(await fleet.create(IMAGE, key=key, labels={"job": job}, **SHAPE))

    async def trigger() -> None:
        while len(made) < total // 3:
            await asyncio.sleep(0.005)
        await during()

    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
        if during is not None:
            tg.create_task(trigger())
    return made


async def measure_placement(fleet: dsecd.Fleet, args) -> dict:
    t0 = time.perf_counter()
    await burst(fleet, "place", args.placement_creates, 32, [])
    took = time.perf_counter() - t0
    per_host = collections.Counter(r["host"] for r in await fleet.list({"job": "place"}))
    counts = [per_host.get(t, 0) for t in fleet.hosts]
    out = {"placement_imbalance": round(max(counts) / statistics.mean(counts), 3),
           "placement_per_host": counts, "placement_creates_per_s": round(args.placement_creates / took, 1)}
    log(f"  {out}")
    removed = await fleet.job_rm("place", force=True)
    log(f"  removed {len(removed['destroyed'])}")
    return out


def every_key(sim: SimFleet) -> collections.Counter:
    """Idempotency keys of every sandbox on every host, asked through their own sockets."""
    keys: collections.Counter = collections.Counter()
    for host in sim.hosts:
        c = host.daemon.client()
        try:
            keys.update(r["key"] for r in c.list() if r["key"])
        finally:
            c.close()
    return keys


async def wait_for(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def measure_failover(sim: SimFleet, fleet: dsecd.Fleet, events: list, args) -> dict:
    detect, silent, bad = [], [], 0
    for r in range(args.kills):
        victim = sim.hosts[(r + 1) % len(sim.hosts)]
        target = victim.target
        keys: list[str] = []
        killed_at = {}

        async def kill(victim=victim, killed_at=killed_at) -> None:
            killed_at["t"] = time.time()
            await asyncio.to_thread(victim.kill)

        job = f"fo{r}"
        made = await burst(fleet, job, args.failover_creates, 32, keys, kill)
        down = [e for e in events if e["event"] == "host_down" and e["host"] == target
                and e["time"] >= killed_at["t"]]
        detect.append(down[0]["time"] - killed_at["t"])
        lost_reported = sum(1 for e in events if e["event"] == "sandbox_lost" and e["time"] >= killed_at["t"])
        await asyncio.to_thread(victim.start)
        back = await wait_for(lambda t=target: fleet.hosts[t].up, 60, f"{victim.name} rejoining")
        found = every_key(sim)
        lost = sum(1 for k in keys if found[k] == 0)
        dup = sum(1 for k in keys if found[k] > 1)
        bad += lost + dup
        log(f"  kill {r + 1} ({victim.name}): down after {detect[-1]:.3f} s, {lost_reported} sandboxes "
            f"reported lost, {len(made)} creates all answered, back {back:.1f} s after restart; "
            f"keys lost {lost}, duplicated {dup}")
        await fleet.job_rm(job, force=True)
    for r in range(args.kills):
        victim = sim.hosts[r % len(sim.hosts)]
        t0 = time.time()
        await asyncio.to_thread(victim.cut)
        silent.append(await wait_for(lambda v=victim: not fleet.hosts[v.target].up, 30, "silent host down"))
        await asyncio.to_thread(victim.heal)
        await wait_for(lambda v=victim: fleet.hosts[v.target].up, 60, "silent host rejoining")
        log(f"  link of {victim.name} cut: down after {silent[-1]:.3f} s (heartbeat); back "
            f"{time.time() - t0:.1f} s after the cut")
    out = {"duplicates_removed": sum(1 for e in events if e["event"] == "duplicate_removed"),
           "failover_detect_s": round(statistics.median(detect), 3),
           "failover_detect_max_s": round(max(detect), 3),
           "silent_detect_s": round(statistics.median(silent), 3),
           "lost_or_duplicated": bad}
    log(f"  {out}")
    return out


async def run(sim: SimFleet, args) -> dict:
    events: list[dict] = []
    results: dict = {}
    async with dsecd.Fleet(sim.targets, ssh=sim.ssh, on_event=events.append) as fleet:
        log(f"fleet of {len(sim.hosts)} up: {[s['up'] for s in fleet.status()]}")
        log(f"create rate: {args.rate_creates} creates+destroys per round, {args.clients} workers per host")
        results.update(await measure_rates(sim, fleet, args))
        if (absent := ray_absent()) is None:
            log(f"create rate through dsecd.ray: {args.rate_creates} creates+destroys per round")
            results.update(await measure_ray(sim, args))
        else:
            results["ray_absent"] = absent
        log(f"exec round trip: {args.exec_n} per block, local vs ssh")
        results.update(await measure_exec(sim, args))
        log(f"placement: {args.placement_creates} creates of one job")
        results.update(await measure_placement(fleet, args))
        log(f"failover: {args.kills} kills mid-burst of {args.failover_creates}, then {args.kills} cut links")
        results.update(await measure_failover(sim, fleet, events, args))
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=8, help="concurrent workers per host")
    p.add_argument("--rate-creates", type=int, default=320, help="creates per round and phase, all hosts")
    p.add_argument("--exec-n", type=int, default=100, help="execs per block")
    p.add_argument("--placement-creates", type=int, default=1000)
    p.add_argument("--failover-creates", type=int, default=300)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--stream-mb", type=int, default=64, help="MiB per stream measured through Ray and locally")
    p.add_argument("--quick", action="store_true", help="a fast smoke run (small counts)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.rate_creates, args.exec_n = 1, 64, 30
        args.placement_creates, args.failover_creates, args.kills = 100, 60, 1
        args.stream_mb = 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = sshd_skip_reason()
    if reason:
        print(json.dumps({"error": reason}))
        return 1
    signal.signal(signal.SIGTERM, harness.interrupt)
    rootfs = harness.build_rootfs()
    log(f"starting a fleet of {args.hosts} simulated hosts (netns + sshd + dsecd each)")
    sim = SimFleet(args.hosts, rootfs, log_level="info")
    try:
        results = uvloop.run(run(sim, args))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log("removing the fleet")
        sim.close()
    results.update(hosts=args.hosts, rounds=args.rounds, cpus=os.cpu_count(),
                   loadavg_1m=round(os.getloadavg()[0], 1))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    harness.run(main)
