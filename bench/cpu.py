"""`make bench-cpu`: DSec's CPU-isolation experiment on this host, and the cost
of usage sampling.

A latency-sensitive (LS) sandbox runs a periodic step - a fixed amount of CPU
work (calibrated to `--step-ms` alone), then `--sleep-ms` of sleep - and
measures each step's latency inside the sandbox (bench/cpu_load.c, static).
It runs alone, then beside two best-effort (BE) sandboxes whose burners
(`ncpu` processes each, duty-cycled with random phase) together demand ~50%
and ~100% of the host's CPU. Configurations:

* unprotected: every sandbox normal (SCHED_OTHER, same weight, no idle cgroup);
* protected: BE sandboxes with qos "be" (cpu.idle=1, SCHED_IDLE for every process);
* protected + core scheduling: only where the kernel has it, else null.

inflation = step latency with load / alone - 1, computed per repetition
(alone and loaded runs interleaved, so slow drift on a shared host cancels)
and reported as the median over repetitions; min..max goes to stderr.
be_work_retained = BE work done while the LS sandbox is idle, protected /
unprotected (SCHED_IDLE must not cost BE throughput when nobody else wants
the CPU). sampler_cpu_pct_4000 = CPU time of one dsecd sampling pass over
4,000 real cgroups (made in a `dsecd-bench-<random>` subtree, removed after)
per `cpu.sample_interval_s` of 1 s, in % of one CPU.

Last stdout line: one JSON object. Run as root: `.venv/bin/python bench/cpu.py [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import harness
import psutil
import uvloop

import dsecd
from dsecd import cgroup
from dsecd.cpu import sampler as cpu_sampler

log = harness.log
IMAGE = "busybox"
LOAD = "/cpu_load"
BE_SANDBOXES = 2
PERIOD_US = 10000          # BE burner duty-cycle period
RAMP_S = 0.3               # burners run this long before the LS steps start
# The bench's daemon: admission off (the bench packs more CPU than the host
# has on purpose) and core scheduling off unless a configuration asks for it.
DAEMON_CONFIG = '[cpu]\noversubscription = 0\nmemory_oversubscription = 0\ncore_sched = "{core}"\n'


def build_load(tmp: Path) -> bytes:
    out = tmp / "cpu_load"
    subprocess.run(["cc", "-O2", "-static", "-Wall", "-o", str(out), str(Path(__file__).with_name("cpu_load.c"))],
                   check=True)
    return out.read_bytes()


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def run(sb, argv: list[str], timeout: float) -> str:
    r = await sb.exec(argv, timeout=timeout)
    if r.exit_code != 0:
        raise RuntimeError(f"{argv} in {sb.id}: exit {r.exit_code} signal {r.signal} {r.stderr[-300:]!r}")
    return r.stdout.decode()


def host_busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


class Experiment:
    def __init__(self, c, args, ncpu: int, load: bytes, cgroup_root: str):
        self.c, self.args, self.ncpu, self.load = c, args, ncpu, load
        self.iters = 0
        # The daemon's whole sandbox subtree: host CPU minus this = foreign load.
        self.subtree = cpu_sampler.stat_files(cgroup.detect_layout(), cgroup_root, quota=False)

    async def sandbox(self, qos: str):
        sb = await self.c.create(image=IMAGE, cpu=1.0, memory="256M", qos=qos)
        await sb.write_file(LOAD, self.load, mode=0o755)
        return sb

    async def calibrate(self, ls) -> None:
        self.iters = int(await run(ls, [LOAD, "calib", str(int(self.args.step_ms * 1000))], 60))
        log(f"step: {self.iters} iterations = {self.args.step_ms} ms alone, then {self.args.sleep_ms} ms sleep")

    async def steps(self, ls) -> list[float]:
        a = self.args
        out = await run(ls, [LOAD, "step", str(self.iters), str(int(a.sleep_ms * 1000)), str(a.steps)], 300)
        return [int(x) / 1e6 for x in out.split()]

    async def burn(self, bes, total_load: float, seconds: float, nproc: int | None = None) -> list:
        """Start the BE burners: `total_load` of the host's CPU, split evenly
        over the sandboxes, each running `nproc` (default ncpu) processes."""
        nproc = nproc or self.ncpu
        duty = total_load * self.ncpu / (len(bes) * nproc)
        argv = [LOAD, "burn", f"{duty:.4f}", str(PERIOD_US), f"{seconds:.3f}", str(nproc)]
        return [asyncio.ensure_future(run(sb, argv, seconds + 60)) for sb in bes]

    async def loaded(self, ls, bes, total_load: float) -> list[float]:
        a = self.args
        seconds = RAMP_S + a.steps * (a.step_ms * 3 + a.sleep_ms) / 1000 + 1
        burners = await self.burn(bes, total_load, seconds)
        try:
            await asyncio.sleep(RAMP_S)
            return await self.steps(ls)
        finally:
            await asyncio.gather(*burners)

    async def be_work(self, bes) -> tuple[int, float, float]:
        """BE iterations while the LS sandbox sits idle: one always-busy
        process per core in all (pure throughput, no duty-cycle collisions);
        and the foreign load meanwhile (cores busy outside our sandboxes),
        which a SCHED_IDLE BE yields to and a normal one shares with; and
        the CPU seconds our sandboxes used meanwhile."""
        nproc = max(1, self.ncpu // len(bes))
        t0, h0, s0 = time.monotonic(), host_busy_s(), cpu_sampler.read_group(self.subtree).usage_ns
        burners = await self.burn(bes, nproc * len(bes) / self.ncpu, self.args.be_seconds, nproc)
        work = sum(int(x) for x in await asyncio.gather(*burners))
        ours = (cpu_sampler.read_group(self.subtree).usage_ns - s0) / 1e9
        return work, max(0.0, (host_busy_s() - h0 - ours) / (time.monotonic() - t0)), ours


def inflation(loaded: list[float], alone: list[float], q: float) -> float:
    return quantile(loaded, q) / quantile(alone, q) - 1


async def measure(sock: str, cgroup_root: str, args, load: bytes, configs: list[str]) -> dict:
    """configs: which of "unprotected", "protected", "core" this daemon runs."""
    ncpu = len(os.sched_getaffinity(0))
    async with dsecd.Client(sock) as c:
        ex = Experiment(c, args, ncpu, load, cgroup_root)
        ls = await ex.sandbox("ls")
        # "unprotected" BE sandboxes are plain normal sandboxes: qos "ls" gives
        # them the same policy and weight as the LS one (with core_sched off).
        bes = {cfg: [await ex.sandbox("ls" if cfg == "unprotected" else "be") for _ in range(BE_SANDBOXES)]
               for cfg in configs}
        await ex.calibrate(ls)
        per: dict[str, dict[str, list[float]]] = {cfg: {} for cfg in configs}
        for rep in range(args.reps):
            for cfg in configs:
                # The baseline brackets the loaded runs (alone, 50%, 100%,
                # alone, pooled): a burst of foreign load on a shared host
                # during one alone run then moves the baseline only halfway.
                alone = await ex.steps(ls)
                loaded = {pct: await ex.loaded(ls, bes[cfg], pct / 100) for pct in (50, 100)}
                alone += await ex.steps(ls)
                row = per[cfg]
                for load_pct, lat in loaded.items():
                    for q in (50, 99):
                        row.setdefault(f"p{q}_{load_pct}", []).append(inflation(lat, alone, q))
                row.setdefault("alone_p50_ms", []).append(quantile(alone, 50))
            # BE throughput of the configurations back to back, order
            # alternating, so that other load on a shared host hits both alike.
            for cfg in configs if rep % 2 == 0 else configs[::-1]:
                work, foreign, cpu_s = await ex.be_work(bes[cfg])
                per[cfg].setdefault("be_work", []).append(work)
                per[cfg].setdefault("foreign_cores", []).append(foreign)
                per[cfg].setdefault("be_work_per_cpu_s", []).append(work / cpu_s if cpu_s > 0 else 0.0)
            log(f"  rep {rep + 1}/{args.reps}: " + "; ".join(
                f"{cfg} p50 +{per[cfg]['p50_50'][-1]:.3f}/+{per[cfg]['p50_100'][-1]:.3f}" for cfg in configs))
    return per


def be_retained(per: dict, quiet: float = 0.1) -> dict:
    """Median of protected / unprotected BE work over the repetitions; and
    over the repetitions where the host ran < `quiet` cores of foreign work
    in both windows (SCHED_IDLE rightly yields to foreign load, which a
    shared host has and the experiment does not mean to measure); null if none."""
    pro, unp = per["protected"], per["unprotected"]
    pairs = list(zip(pro["be_work"], unp["be_work"], pro["foreign_cores"], unp["foreign_cores"], strict=True))
    quiet_ratios = [p / u for p, u, fp, fu in pairs if fp < quiet and fu < quiet]
    log(f"  be_work_retained: {len(quiet_ratios)} of {len(pairs)} repetitions had < {quiet} foreign cores")
    # Work per CPU-second the BE sandboxes got: what protection costs them in
    # efficiency (preemptions, cache), independent of how much foreign load took.
    eff = [p / u for p, u in zip(pro["be_work_per_cpu_s"], unp["be_work_per_cpu_s"], strict=True) if u > 0]
    return {"be_work_retained": round(statistics.median(p / u for p, u, _, _ in pairs), 4),
            "be_work_per_cpu_retained": round(statistics.median(eff), 4) if eff else None,
            "be_work_retained_quiet": round(statistics.median(quiet_ratios), 4) if quiet_ratios else None,
            "be_foreign_cores_median": round(statistics.median(fp for _, _, fp, _ in pairs), 3)}


def summarize(per: dict) -> dict:
    out = {}
    for cfg, row in per.items():
        for key, values in row.items():
            med = statistics.median(values)
            out[f"{cfg}.{key}"] = med
            log(f"  {cfg:<12} {key:<13} median {med:10.4f}   min {min(values):10.4f}   max {max(values):10.4f}"
                f"   n={len(values)}")
    return out


# -------------------------------------------------------------------- sampler cost


def sampler_cost(n: int, passes: int = 2 * cpu_sampler.MEMORY_EVERY) -> dict:
    """Sampling passes over n real, empty cgroups, as the daemon runs them:
    the mean CPU time per pass (memory is read every MEMORY_EVERY passes, so
    the mean covers both kinds) and the slowest pass's wall time."""
    layout = cgroup.detect_layout()
    root = f"dsecd-bench-{secrets.token_hex(4)}"
    groups = [cgroup.Group(layout, f"{root}/{i}") for i in range(n)]
    made = []
    log(f"sampler: creating {n} cgroups under {root} in {len(layout.hierarchies())} hierarchies")
    try:
        for g in groups:
            g.create()
            made.append(g)
        s = cpu_sampler.Sampler(layout, root, half_life_s=10.0)
        entries = {str(i): ("be", False) for i in range(n)}
        s.sample(entries)                      # first pass resolves paths, as after a create
        cpu, wall = [], []
        for _ in range(passes):
            t0, c0 = time.perf_counter(), time.thread_time()
            snap = s.sample(entries)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
        assert len(snap.sandboxes) == n and all(v["cpu_pct"] is not None for v in snap.sandboxes.values())
        s.close()
    finally:
        for g in reversed(made):
            g.remove(5)
        for d in {mnt / root for mnt in layout.hierarchies().values()}:
            try:
                d.rmdir()
            except OSError:
                pass
    out = {f"sampler_cpu_pct_{n}": round(statistics.mean(cpu) * 100, 2),
           f"sampler_pass_max_ms_{n}": round(max(wall) * 1000, 1)}
    log(f"  {out} (mean CPU per pass as % of one CPU at one pass per second; passes "
        f"{min(cpu) * 1000:.0f}..{max(cpu) * 1000:.0f} ms CPU)")
    return out


# -------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7, help="repetitions of every configuration")
    p.add_argument("--steps", type=int, default=150, help="LS steps per run")
    p.add_argument("--step-ms", type=float, default=5.0, help="CPU work per step, alone")
    p.add_argument("--sleep-ms", type=float, default=5.0, help="sleep between steps")
    p.add_argument("--be-seconds", type=float, default=2.0, help="BE burn for be_work_retained")
    p.add_argument("--sampler-groups", type=int, default=4000)
    p.add_argument("--rootfs", help="rootfs to import (default: scripts/mkrootfs.sh's cache)")
    p.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.be_seconds, args.sampler_groups = 2, 50, 1.0, 500
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        log("must run as root")
        return 1
    rootfs = args.rootfs or harness.build_rootfs()
    with tempfile.TemporaryDirectory(prefix="dsecd-bench-cpu-") as tmp:
        load = build_load(Path(tmp))
    per = {}
    with harness.private_daemon(rootfs, IMAGE, extra_config=DAEMON_CONFIG.format(core="off")) as d:
        log(f"LS step vs BE load: {args.reps} reps x (unprotected, protected)")
        per.update(uvloop.run(measure(d.sock, d.cgroup_root, args, load, ["unprotected", "protected"])))
    with harness.private_daemon(rootfs, IMAGE, extra_config=DAEMON_CONFIG.format(core="auto")) as d:
        info = dsecd.SyncClient(d.sock)
        info.connect()
        core = info.info()["features"]["sched_core"]
        info.close()
        if core["available"]:
            log("protected + core scheduling")
            per.update(uvloop.run(measure(d.sock, d.cgroup_root, args, load, ["core"])))
        else:
            log(f"core scheduling unavailable: {core['detail']}")
    log("medians over repetitions (inflation = loaded / alone - 1):")
    m = summarize(per)
    r = {
        "inflation_p50_unprotected_50": round(m["unprotected.p50_50"], 4),
        "inflation_p50_protected_50": round(m["protected.p50_50"], 4),
        "inflation_p99_protected_50": round(m["protected.p99_50"], 4),
        "inflation_p50_unprotected_100": round(m["unprotected.p50_100"], 4),
        "inflation_p50_protected_100": round(m["protected.p50_100"], 4),
        "inflation_p99_unprotected_50": round(m["unprotected.p99_50"], 4),
        "inflation_p50_core_50": round(m["core.p50_50"], 4) if "core.p50_50" in m else None,
        "inflation_p50_core_100": round(m["core.p50_100"], 4) if "core.p50_100" in m else None,
        **be_retained(per),
        "step_alone_p50_ms": round(m["protected.alone_p50_ms"], 3),
        "reps": args.reps, "steps": args.steps, "cpus": len(os.sched_getaffinity(0)),
    }
    r.update(sampler_cost(args.sampler_groups))
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    harness.run(main)
