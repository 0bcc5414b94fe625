"""`make bench-images`: lazy vs eager images, and image pulls, through a real daemon.

The workload image (>= 2 GiB, two layers): a Debian bookworm rootfs
(`debootstrap --variant=minbase`, cached in /var/cache/dsecd/; if debootstrap
cannot reach a mirror, the busybox rootfs instead, said on stderr and in the
JSON) plus a synthetic tree under /opt/synth, generated from a seed and cached:
packages (directories) of many small files, some medium ones and a few
MB-sized ones, plus a few large files (weights, a dataset, a git pack). The
first exec of a sandbox (QoS "ls", see TIMED_ARGS) reads ~6% of the image's
bytes: whole packages (the way an import or a test run reads a package) and
some scattered files, listed on stdin to `xargs -P 8 cat` (parallel readers,
like a test runner).

Each cold run starts a daemon of its own on fresh state dirs (no layer mount,
no pager chunk cache, no eager copy) over the same blob store, drops the
host's caches (`echo 3 > drop_caches`, once per cold run), then times
create + first exec. The store is throttled to 1 Gbit/s + 1 ms per fetch
([pager] bandwidth_bps / latency_us; they pace eager copies too).

Figures (last line of stdout, one JSON object):

* eager_first_exec_s, lazy_first_exec_s (medians), lazy_speedup (eager/lazy);
* fetched_over_read: bytes the pager fetched from the store (all layers,
  metadata and the binaries of the exec included) / bytes of the files the
  workload read;
* second_sandbox_hit_ratio: after the first sandbox, the host page cache is
  dropped and a second sandbox does the same reads: pager chunk hits /
  (hits + misses) during its run;
* shared_cache_ratio: host page cache of the image's files (fincore: the
  files read, in the layer mount, plus the store blobs and the pager's .data
  caches) with 50 sandboxes having read the same files / with one;
  shared_cache_ratio_meminfo: the same from /proc/meminfo Cached - Shmem over
  its level after the drop (noisier: the host's other tenants count too);
* snapshot_s, restore_create_ms: snapshot of a sandbox that wrote 200 MiB
  (1,600 x 64 KiB + 10 x 10 MiB), then create from that snapshot (medians).

Lazy runs are repeated for two chunk sizes (1 MiB, the default, and 64 KiB);
the headline lazy figures are those of the chunk size that meets the
fetched_over_read target (else the one closest), both are in `by_chunk`.

Image pulls (bench/imagepull.py has the details): pull_speed_ratio (our
whole pull's MiB/s, conversion to EROFS included, over `skopeo copy`'s of the
same image from a registry on loopback), pull_download_ratio (our download
alone), pull_convert_s, pull_to_first_exec_s, base_stored_once.

Run as root: `.venv/bin/python bench/images.py [--quick] [--phases lazy,pull]`;
`--phases pull` runs the pull figures alone (a minute or two).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import harness
import imagepull
import uvloop

import dsecd

MIB = 1 << 20
CACHE = Path("/var/cache/dsecd")
DEBIAN = CACHE / "rootfs-debian-bookworm-minbase"
MIRROR = "http://deb.debian.org/debian"
SYNTH_FORMAT = 1
SYNTH_MIB = 2048
SEED = 20260611
READ_FRACTION = 0.06
LINK_BPS = 125_000_000          # 1 Gbit/s
LATENCY_US = 1000
CHUNKS = {"1M": 1 << 20, "64K": 64 << 10}
FETCHED_TARGET = 1.5
READERS = 8                     # xargs -P: parallel readers of the first exec
OP_TIMEOUT_S = 600
SB_ARGS = {"cpu": 1.0, "memory": "1G"}
# Timed sandboxes are latency-sensitive: a best-effort one (the default QoS)
# runs SCHED_IDLE and gets only the CPU nobody else wants, which on a shared
# 2-core host measures the other tenants, not the images (~1.8 s vs ~1.1 s for
# the same cold reads from a direct layer at load 6). Both modes use it.
TIMED_ARGS = {**SB_ARGS, "qos": "ls"}
CONFIG = """[cpu]
oversubscription = 0
memory_oversubscription = 0
ls_max_load = 0
[images]
mode = "{mode}"
store = "{store}"
layer_grace_s = 3600.0
[pager]
chunk_size = {chunk}
bandwidth_bps = {bps}
latency_us = {latency}
readahead_chunks = {readahead}
"""

log = harness.log


# ------------------------------------------------------------------ the image


def ensure_debian() -> tuple[Path | None, str]:
    """The cached debootstrap rootfs, built once (~3 min); (None, why) if it cannot be."""
    if DEBIAN.is_dir():
        return DEBIAN, "debian bookworm minbase (cached)"
    if shutil.which("debootstrap") is None:
        return None, "debootstrap is not installed (apt-get install debootstrap)"
    tmp = DEBIAN.with_name(f"{DEBIAN.name}.tmp-{os.getpid()}")
    log(f"debootstrap --variant=minbase bookworm {tmp} (once; cached as {DEBIAN})")
    try:
        proc = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(tmp), MIRROR],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return None, f"debootstrap failed (exit {proc.returncode}): {' | '.join(tail)}"
        os.rename(tmp, DEBIAN)
        return DEBIAN, "debian bookworm minbase (debootstrap)"
    except subprocess.TimeoutExpired:
        return None, "debootstrap did not finish in 20 min"
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(lo * (hi / lo) ** rng.random())


def synth_plan(seed: int, total: int) -> list[tuple[str, int]]:
    """(path under the tree, size) of every synthetic file, from the seed alone."""
    rng = random.Random(seed)
    large = [("data/weights-0.safetensors", 224 * MIB), ("data/weights-1.safetensors", 160 * MIB),
             ("data/dataset.arrow", 256 * MIB), ("repo/.git/objects/pack/pack-0.pack", 96 * MIB)]
    plan = [(f"opt/synth/{p}", s) for p, s in large]
    used = sum(s for _, s in large)
    pkg = 0
    while used < total:
        subdirs = ["", *(f"sub{i}/" for i in range(rng.randint(0, 3)))]
        for i in range(rng.randint(4, 80)):
            r = rng.random()
            if r < 0.75:
                size = log_uniform(rng, 256, 16 << 10)         # sources, configs, metadata
            elif r < 0.985:
                size = log_uniform(rng, 16 << 10, MIB)          # bigger modules, data files
            else:
                size = log_uniform(rng, MIB, 16 * MIB)          # shared objects
            plan.append((f"opt/synth/pkgs/p{pkg:04d}/{rng.choice(subdirs)}f{i:03d}.bin", size))
            used += size
        pkg += 1
    return plan


def ensure_synth(seed: int, total_mib: int) -> tuple[Path, list[tuple[str, int]]]:
    """The synthetic tree (cached by format, seed and size): (tree root, plan)."""
    top = CACHE / f"synth-v{SYNTH_FORMAT}-s{seed}-{total_mib}m"
    plan = synth_plan(seed, total_mib * MIB)
    if (top / "tree").is_dir():
        return top / "tree", plan
    tmp = top.with_name(f"{top.name}.tmp-{os.getpid()}")
    log(f"generating the synthetic tree ({total_mib} MiB, {len(plan)} files) in {top} (once)")
    content = random.Random(seed + 1)
    try:
        for rel, size in plan:
            path = tmp / "tree" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                left = size
                while left:
                    n = min(left, 4 * MIB)
                    f.write(content.randbytes(n))
                    left -= n
        os.rename(tmp, top)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return top / "tree", plan


def choose_reads(plan: list[tuple[str, int]], target: int, seed: int) -> list[tuple[str, int]]:
    """~target bytes of whole files: 80% as whole packages, the rest scattered."""
    rng = random.Random(seed + 2)
    pkgs: dict[str, list[tuple[str, int]]] = {}
    for rel, size in plan:
        if "/pkgs/" in rel:
            pkgs.setdefault(rel.split("/")[3], []).append((rel, size))
    names = sorted(pkgs)
    rng.shuffle(names)
    picked: list[tuple[str, int]] = []
    total = 0
    while total < 0.8 * target:
        files = sorted(pkgs[names.pop()])
        picked += files
        total += sum(s for _, s in files)
    rest = [f for n in names for f in pkgs[n]]
    rng.shuffle(rest)
    for rel, size in rest:
        if total >= target:
            break
        if total + size <= target * 1.02:
            picked.append((rel, size))
            total += size
    return picked


# ------------------------------------------------------------------ host helpers


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def meminfo_cached() -> int:
    """Cached - Shmem (file pages, not tmpfs), bytes."""
    fields = harness.meminfo()
    return fields["Cached"] - fields["Shmem"]


def fincore_bytes(paths: list[Path]) -> int:
    total = 0
    for i in range(0, len(paths), 500):
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES",
                              *map(str, paths[i:i + 500])],
                             check=True, capture_output=True, text=True).stdout
        total += sum(int(x) for x in out.split())
    return total


class ImagesDaemon(harness.BenchDaemon):
    """A BenchDaemon whose pager (in <cgroup_root>/.pager, outliving the daemon
    by design) is stopped with SIGTERM - a clean FUSE unmount - before the
    cgroup subtree is removed (which would SIGKILL it)."""

    def _remove_cgroups(self) -> None:
        for mnt in harness.cgroup_mounts():
            for pid in harness.read_pids(Path(mnt) / self.cgroup_root / ".pager" / "cgroup.procs"):
                stop_pid(pid)
        super()._remove_cgroups()


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        os.kill(pid, signal.SIGTERM)
        if not select.select([fd], [], [], timeout)[0]:
            log(f"pid {pid} ignored SIGTERM for {timeout} s: SIGKILL")
            os.kill(pid, signal.SIGKILL)
            select.select([fd], [], [], timeout)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def daemon_on(tmp: Path, name: str, mode: str, store: Path, chunk: int = 1 << 20, throttle: bool = True,
              readahead: int = 4):
    """A daemon on fresh state (tmp/name) over the shared store; all of it gone on exit."""
    run = tmp / name
    run.mkdir()
    cfg = CONFIG.format(mode=mode, store=store, chunk=chunk, bps=LINK_BPS if throttle else 0,
                        latency=LATENCY_US if throttle else 0, readahead=readahead)
    d = ImagesDaemon(run, None, cfg)
    try:
        d.start()
        yield d
    except Exception:
        if d.proc is not None and d.proc.poll() is None:
            log(f"last lines of the daemon's log:\n{d.log_tail()}")
        raise
    finally:
        try:
            d.stop()
        finally:
            harness.remove_tmp(run)


# ------------------------------------------------------------------ phases


async def op(aw):
    return await asyncio.wait_for(aw, OP_TIMEOUT_S)


def workload_argv() -> list[str]:
    return ["sh", "-c", f"xargs -P {READERS} -n 16 cat | wc -c"]


async def run_workload(sb, stdin: bytes, expect: int) -> None:
    r = await op(sb.exec(workload_argv(), timeout=OP_TIMEOUT_S, stdin=stdin))
    got = r.stdout.decode().strip()
    if r.exit_code != 0 or got != str(expect):
        raise RuntimeError(f"workload: exit {r.exit_code}, read {got!r} bytes, expected {expect}; "
                           f"stderr {r.stderr[-500:]!r}")


async def pager_totals(c) -> dict:
    info = await op(c.inspect_image("work"))
    blobs = info.get("pager") or {}
    if "error" in blobs:
        raise RuntimeError(f"pager stats: {blobs['error']}")
    keys = ("fetched_bytes", "kernel_read_bytes", "chunk_hits", "chunk_misses", "fetches")
    return {k: sum(b[k] for b in blobs.values()) for k in keys}


async def first_exec(c, stdin: bytes, expect: int) -> tuple[float, object]:
    t0 = time.perf_counter()
    sb = await op(c.create(image="work", **TIMED_ARGS))
    await run_workload(sb, stdin, expect)
    return time.perf_counter() - t0, sb


async def cold_run(sock: str, w: dict, lazy: bool, extras: bool, state: Path) -> dict:
    async with dsecd.Client(sock) as c:
        drop_caches()
        base_cached = meminfo_cached()
        elapsed, sb = await first_exec(c, w["stdin"], w["bytes"])
        out = {"s": elapsed}
        if not lazy:
            return out
        stats = await pager_totals(c)
        out.update(fetched=stats["fetched_bytes"], kernel_read=stats["kernel_read_bytes"],
                   fetched_over_read=stats["fetched_bytes"] / w["bytes"])
        if extras:
            out.update(await shared_cache(c, w, state, base_cached))
            out.update(await second_sandbox(c, w, stats))
        return out


def image_path_files(state: Path, store: Path, layers: list[str], read: list[str]) -> list[Path]:
    """Every file whose page cache reading the image can fill: the files read,
    in the layer mount (overlay has no page cache of its own for lower files),
    and under them the store blobs and the pager's .data chunk caches."""
    top = state / "layers" / layers[-1]
    return ([top / rel for rel in read] + [store / "blobs" / "sha256" / h for h in layers]
            + [p for h in layers if (p := state / "pager-cache" / f"{h}.data").exists()])


async def shared_cache(c, w: dict, state: Path, base_cached: int) -> dict:
    """Page cache with 1 sandbox having read the files, then 50.

    Headline: fincore over the image's files (image_path_files), exact and
    blind to the other tenants of the host. Also /proc/meminfo Cached - Shmem
    over its level after the drop: everything, the other tenants' file I/O
    meanwhile and each sandbox's own files (journal, upper dir) included."""
    info = await op(c.inspect_image("work"))
    layers = [layer["digest"].split(":", 1)[1] for layer in info["layers"]]
    files = image_path_files(state, w["store"], layers, [rel for rel, _ in w["files"]])
    one = (meminfo_cached() - base_cached, fincore_bytes(files))
    sems = asyncio.Semaphore(8)

    async def another():
        async with sems:
            sb = await op(c.create(image="work", **SB_ARGS))
            await run_workload(sb, w["stdin"], w["bytes"])

    async with asyncio.TaskGroup() as tg:
        for _ in range(49):
            tg.create_task(another())
    fifty = (meminfo_cached() - base_cached, fincore_bytes(files))
    log(f"  page cache, 1 sandbox: {one[0] / MIB:.1f} MiB (meminfo), {one[1] / MIB:.1f} MiB (fincore); "
        f"50: {fifty[0] / MIB:.1f}, {fifty[1] / MIB:.1f}")
    await op(c.destroy_all(force=True))
    return {"shared_cache_ratio": fifty[1] / one[1], "shared_cache_ratio_meminfo": fifty[0] / one[0],
            "page_cache_one_mib": one[1] / MIB, "page_cache_fifty_mib": fifty[1] / MIB,
            "meminfo_one_mib": one[0] / MIB, "meminfo_fifty_mib": fifty[0] / MIB}


async def second_sandbox(c, w: dict, before: dict) -> dict:
    drop_caches()
    elapsed, _sb = await first_exec(c, w["stdin"], w["bytes"])
    after = await pager_totals(c)
    hits = after["chunk_hits"] - before["chunk_hits"]
    misses = after["chunk_misses"] - before["chunk_misses"]
    log(f"  second sandbox (page cache dropped, chunk cache warm): {elapsed:.2f} s, "
        f"{hits} chunk hits, {misses} misses, {(after['fetched_bytes'] - before['fetched_bytes']) / MIB:.1f}"
        " MiB fetched")
    return {"second_s": elapsed, "second_sandbox_hit_ratio": hits / max(1, hits + misses)}


async def snapshots(sock: str, reps: int) -> dict:
    """A sandbox writes 200 MiB; snapshot it, create from the snapshot; `reps` times."""
    write = ("set -e; mkdir -p /work/small /work/big; i=0; while [ $i -lt 1600 ]; do "
             "head -c 65536 /dev/urandom > /work/small/f$i; i=$((i+1)); done; "
             "for j in 0 1 2 3 4 5 6 7 8 9; do head -c 10485760 /dev/urandom > /work/big/b$j; done")
    snap_s, create_ms = [], []
    async with dsecd.Client(sock) as c:
        sb = await op(c.create(image="work", **SB_ARGS))
        r = await op(sb.exec(["sh", "-c", write], timeout=OP_TIMEOUT_S))
        if r.exit_code != 0:
            raise RuntimeError(f"writing 200 MiB: exit {r.exit_code}: {r.stderr[-300:]!r}")
        for i in range(reps):
            # A different byte each time: a new layer digest, not a dedup hit.
            await op(sb.exec(["sh", "-c", f"echo {i} > /work/rep"]))
            t0 = time.perf_counter()
            await op(sb.snapshot(f"snap-{i}"))
            snap_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            restored = await op(c.create(image=f"snap-{i}", **SB_ARGS))
            create_ms.append((time.perf_counter() - t0) * 1000)
            r = await op(restored.exec(["sh", "-c", "cat /work/rep; du -sk /work | cut -f1"]))
            rep, kib = r.stdout.decode().split()
            if rep != str(i) or int(kib) < 200 * 1024:
                raise RuntimeError(f"restored snapshot {i}: rep {rep}, {kib} KiB in /work")
            await op(restored.destroy())
            log(f"  snapshot {i}: {snap_s[-1]:.2f} s, create from it {create_ms[-1]:.0f} ms")
    return {"snapshot_s": round(statistics.median(snap_s), 3),
            "restore_create_ms": round(statistics.median(create_ms), 1),
            "snapshot_s_all": [round(x, 3) for x in snap_s]}


# ------------------------------------------------------------------ main


async def build_images(sock: str, base: Path, synth: Path) -> dict:
    async with dsecd.Client(sock) as c:
        t0 = time.perf_counter()
        await op(c.build_image(str(base), "base"))
        img = await op(c.build_image(str(synth), "work", parent="base"))
        log(f"built image work: {len(img['layers'])} layers, {img['bytes'] / MIB:.0f} MiB, "
            f"{time.perf_counter() - t0:.0f} s")
        return img


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f}, min {min(xs):.3f}, max {max(xs):.3f}, n {len(xs)}"


def run_mode(tmp: Path, store: Path, w: dict, label: str, mode: str, chunk: int, reps: int) -> list[dict]:
    runs = []
    for i in range(reps):
        with daemon_on(tmp, f"{label}-{i}", mode, store, chunk) as d:
            r = uvloop.run(cold_run(d.sock, w, mode == "lazy", i == 0, Path(d.state)))
        runs.append(r)
        log(f"{label} cold run {i}: " + ", ".join(
            f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, float)))
    return runs


def summarize_lazy(runs: list[dict], eager_s: float) -> dict:
    s = statistics.median(r["s"] for r in runs)
    extras = runs[0]
    return {"lazy_first_exec_s": round(s, 3), "lazy_speedup": round(eager_s / s, 2),
            "fetched_over_read": round(statistics.median(r["fetched_over_read"] for r in runs), 3),
            "fetched_over_kernel_read": round(statistics.median(
                r["fetched"] / r["kernel_read"] for r in runs), 3),
            "second_sandbox_hit_ratio": round(extras["second_sandbox_hit_ratio"], 4),
            "second_sandbox_first_exec_s": round(extras["second_s"], 3),
            "shared_cache_ratio": round(extras["shared_cache_ratio"], 3),
            "shared_cache_ratio_meminfo": round(extras["shared_cache_ratio_meminfo"], 3),
            **{k: round(extras[k], 1) for k in ("page_cache_one_mib", "page_cache_fifty_mib",
                                                 "meminfo_one_mib", "meminfo_fifty_mib")}}


def measure(tmp: Path, args) -> dict:
    results = {}
    if "pull" in args.phases:
        results.update(imagepull.measure_pull(tmp / "pull", harness.build_rootfs(), args.pull_reps, args.seed,
                                              args.pull_parallel_layers))
    if "lazy" in args.phases:
        results.update(measure_lazy(tmp, args))
    return results


def measure_lazy(tmp: Path, args) -> dict:
    debian, base_note = (None, "busybox (--busybox)") if args.busybox else ensure_debian()
    if debian is None:
        log(f"NO DEBIAN ROOTFS: {base_note}; falling back to the busybox rootfs")
        base = Path(harness.build_rootfs())
        base_note = f"busybox (fallback: {base_note})"
    else:
        base = debian
    synth, plan = ensure_synth(args.seed, args.synth_mib)
    store = tmp / "store"
    with daemon_on(tmp, "build", "direct", store, throttle=False) as d:
        img = uvloop.run(build_images(d.sock, base, synth))
    files = choose_reads(plan, int(img["bytes"] * READ_FRACTION), args.seed)
    w = {"files": files, "bytes": sum(s for _, s in files), "store": store,
         "stdin": "".join(f"/{rel}\n" for rel, _ in files).encode()}
    log(f"workload: {len(files)} files, {w['bytes'] / MIB:.1f} MiB = "
        f"{100 * w['bytes'] / img['bytes']:.2f}% of the image, {READERS} parallel readers")

    results = {"image_bytes": img["bytes"], "image_base": base_note, "workload_bytes": w["bytes"],
               "workload_files": len(files)}
    eager = run_mode(tmp, store, w, "eager", "eager", 1 << 20, args.eager_reps)
    eager_s = statistics.median(r["s"] for r in eager)
    log(f"eager first exec: {spread([r['s'] for r in eager])}")
    by_chunk = {}
    for label, chunk in CHUNKS.items():
        runs = run_mode(tmp, store, w, f"lazy-{label}", "lazy", chunk, args.lazy_reps)
        log(f"lazy {label} first exec: {spread([r['s'] for r in runs])}; fetched/read: "
            f"{spread([r['fetched_over_read'] for r in runs])}")
        by_chunk[label] = summarize_lazy(runs, eager_s)
    ok = [k for k, v in by_chunk.items() if v["fetched_over_read"] <= FETCHED_TARGET]
    pick = max(ok, key=lambda k: by_chunk[k]["lazy_speedup"]) if ok else \
        min(by_chunk, key=lambda k: by_chunk[k]["fetched_over_read"])
    log(f"headline chunk size: {pick}")
    with daemon_on(tmp, "snapshot", "lazy", store, CHUNKS[pick]) as d:
        snap = uvloop.run(snapshots(d.sock, args.snapshot_reps))
    results.update({"eager_first_exec_s": round(eager_s, 3), **by_chunk[pick], "chunk_size": pick,
                    **snap, "by_chunk": by_chunk,
                    "eager_first_exec_s_all": [round(r["s"], 3) for r in eager]})
    return results


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eager-reps", type=int, default=3)
    p.add_argument("--lazy-reps", type=int, default=5, help="cold runs per chunk size")
    p.add_argument("--snapshot-reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--synth-mib", type=int, default=SYNTH_MIB)
    p.add_argument("--busybox", action="store_true", help="busybox base instead of Debian")
    p.add_argument("--phases", default="lazy,pull", type=lambda s: set(s.split(",")),
                   help="comma-separated: lazy (lazy vs eager, snapshots), pull (image pull figures)")
    p.add_argument("--pull-reps", type=int, default=5, help="timed rounds of the pull figures (after a warm-up)")
    p.add_argument("--pull-parallel-layers", type=int, default=None,
                   help="images.pull_parallel_layers (default: the config default)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.eager_reps, args.lazy_reps, args.snapshot_reps, args.pull_reps = 1, 2, 1, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        log("must run as root")
        return 1
    signal.signal(signal.SIGTERM, harness.interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="dsecd-bench-images-"))
    try:
        results = measure(tmp, args)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        harness.remove_tmp(tmp)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    harness.run(main)
