"""`bench/mem.py`: what pausing a sandbox frees, and what resuming it costs.

No daemon: the bench makes its own cgroup subtree (`dsecd-bench-<random>` in
every hierarchy) with one group per "sandbox", and in each a process it
starts itself that holds ANON MiB of anonymous memory (each page
--anon-random-percent random bytes, the rest text: the compression ratio of
zram follows it) and has read FILE MiB of its own file
into the page cache. Then, once without swap and once with a zram swap device
the bench makes (hot_add) and removes:

* pause every group (dsecd.mem.pause.pause: freeze, record the working set,
  reclaim) and measure what left the groups (memcg usage) and the host
  (MemAvailable), net of what the zram device itself holds;
* resume half of them with prefetch and half without, then time the first
  "request": the process touches every anon page again and answers.

`--job N` also pauses and resumes N small sandboxes (one `sleep` each)
through a thread pool, as the node would for a job: freeze-all, thaw-all,
pause-all and resume-all seconds.

`--compare-methods` also measures each v1 reclaim method alone (soft limit,
force_empty, lowered limit, MADV_PAGEOUT, MADV_PAGEOUT + limit), with and
without zram: the table in docs/memory.md.

Progress goes to stderr; the last stdout line is one JSON object. Whatever
happens, the bench thaws and kills the processes it started (by pid), removes
its groups, turns its swap off and removes its zram device.

Run as root: `.venv/bin/python bench/mem.py [--sandboxes 8] [--anon-mib 20]
[--file-mib 20] [--compare-methods]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import harness

from dsecd import cgroup
from dsecd.mem import pause as mp
from dsecd.mem.zram import ZramConfig, ZramSwap

MIB = 1 << 20

# The workload: allocate, read a file, say "ready"; on each stdin line touch
# every anon page and say "touched".
HOG = r"""
import os, sys
anon_mib, path, rnd = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
text = b"the quick brown fox jumps over the lazy dog " * 94
chunk = os.urandom(rnd) + text[: 4096 - rnd]
buf = bytearray(chunk * (anon_mib * 256))
if path != "-":
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
print("ready", flush=True)
for line in sys.stdin:
    s = 0
    for i in range(0, len(buf), 4096):
        s += buf[i]
    print("touched", flush=True)
"""


log = harness.log
meminfo = harness.meminfo


def drop_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Box:
    """One test-owned group with one test-owned process in it."""

    def __init__(self, layout: cgroup.Layout, rel: str, anon_mib: int, file_path: str,
                 limit: int, random_bytes: int):
        self.group = cgroup.Group(layout, rel)
        self.group.create()
        self.group.set_limits(cgroup.Limits(cpu=1.0, memory_bytes=limit, pids=64))
        procs = self.group.procs_files()

        def join():   # before exec, so every page the workload touches is charged here
            for p in procs:
                with open(p, "w") as f:
                    f.write("0")

        self.proc = subprocess.Popen([sys.executable, "-c", HOG, str(anon_mib), file_path,
                                      str(random_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     preexec_fn=join, text=True)

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"workload {self.proc.pid} said {line!r}")

    def touch(self) -> float:
        t0 = time.monotonic()
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if line.strip() != "touched":
            raise RuntimeError(f"workload {self.proc.pid} said {line!r}")
        return time.monotonic() - t0

    def destroy(self) -> None:
        # A frozen task does not die until thawed: thaw first.
        with contextlib.suppress(OSError):
            mp.Freezer.of(self.group).thaw()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.group.remove()


class Bench:
    def __init__(self, args):
        self.args = args
        self.layout = cgroup.detect_layout()
        self.root = f"dsecd-bench-{secrets.token_hex(4)}"
        self.tmp = Path(tempfile.mkdtemp(prefix="dsecd-bench-mem-", dir="/var/tmp"))
        self.boxes: list[Box] = []
        self.zram: ZramSwap | None = None
        self.files: list[str] = []

    # ------------------------------------------------------------ setup

    def make_files(self, n: int) -> None:
        for i in range(n):
            path = str(self.tmp / f"data{i}")
            with open(path, "wb") as f:
                for _ in range(self.args.file_mib):
                    f.write(os.urandom(MIB))
                os.fsync(f.fileno())
            self.files.append(path)

    def start_boxes(self, n: int, tag: str) -> list[Box]:
        boxes = []
        for i in range(n):
            drop_file(self.files[i])   # read from disk: charged to this group, not cached before
            box = Box(self.layout, f"{self.root}/{tag}{i}", self.args.anon_mib, self.files[i],
                      self.args.limit_mib * MIB, self.args.anon_random_percent * 4096 // 100)
            self.boxes.append(box)
            boxes.append(box)
        for box in boxes:
            box.wait_ready()
        return boxes

    def swap_on(self) -> None:
        mib = self.args.zram_mib or max(256, 2 * self.args.sandboxes * (self.args.anon_mib + 8))
        self.zram = ZramSwap(ZramConfig(enabled=True, size_bytes=mib * MIB,
                                        algorithm=self.args.zram_algorithm))
        self.zram.setup()

    def swap_off(self) -> None:
        if self.zram:
            self.zram.teardown()
            self.zram = None

    def stop_boxes(self) -> None:
        while self.boxes:
            self.boxes.pop().destroy()

    def cleanup(self) -> None:
        errors = []
        for step in (self.stop_boxes, self.swap_off, self.remove_root):
            try:
                step()
            except Exception as err:     # keep cleaning up; report at the end
                errors.append(f"{step.__name__}: {err}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        for e in errors:
            log(f"cleanup: {e}")

    def remove_root(self) -> None:
        for mnt in self.layout.hierarchies().values():
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(mnt / self.root)

    # ------------------------------------------------------------ scenarios

    def zram_used(self) -> int:
        return self.zram.stats().get("mem_used_total", 0) if self.zram else 0

    def pause_resume(self, label: str) -> dict:
        n = self.args.sandboxes
        boxes = self.start_boxes(n, f"{label}-")
        time.sleep(0.2)
        before_groups = [mp.usage(b.group) for b in boxes]
        avail0, zram0 = meminfo()["MemAvailable"], self.zram_used()
        free0 = meminfo()["MemFree"]
        t0 = time.monotonic()
        recs = [mp.pause(b.group) for b in boxes]
        pause_s = time.monotonic() - t0
        free1, zram1 = meminfo()["MemFree"], self.zram_used()
        after_groups = [mp.usage(b.group) for b in boxes]
        held = sum(u.total for u in before_groups)
        freed = sum(r.freed for r in recs)
        out = {
            "held_mib_per_sandbox": held / n / MIB,
            "anon_mib_per_sandbox": sum(u.anon for u in before_groups) / n / MIB,
            "file_mib_per_sandbox": sum(u.file for u in before_groups) / n / MIB,
            "group_freed_mib_per_sandbox": freed / n / MIB,
            "group_freed_fraction": freed / held if held else 0.0,
            "zram_used_mib_per_sandbox": (zram1 - zram0) / n / MIB,
            # What the host got back: left the groups, minus what zram now holds.
            "net_freed_mib_per_sandbox": (freed - (zram1 - zram0)) / n / MIB,
            "net_freed_fraction": (freed - (zram1 - zram0)) / held if held else 0.0,
            # MemFree gained: the same seen from the host, noisy when anything else runs.
            "host_memfree_delta_mib_per_sandbox": (free1 - free0) / n / MIB,
            "left_anon_mib_per_sandbox": sum(u.anon for u in after_groups) / n / MIB,
            "left_file_mib_per_sandbox": sum(u.file for u in after_groups) / n / MIB,
            "pause_ms_per_sandbox": pause_s / n * 1000,
            "freeze_ms_p50": statistics.median(r.frozen_s for r in recs) * 1000,
            "methods_freed_mib_per_sandbox": {
                m: sum(r.methods.get(m, 0) for r in recs) / n / MIB for m in recs[0].methods},
            "notes": sorted({note for r in recs for note in r.notes if "advised" not in note}),
            "mem_available_before_mib": avail0 / MIB,
        }
        # Resume: even boxes with prefetch, odd ones without (thaw only).
        resume_ms, touch_with, touch_without = [], [], []
        for i, (box, rec) in enumerate(zip(boxes, recs, strict=True)):
            t = time.monotonic()
            if i % 2 == 0:
                res = mp.resume(box.group, rec, mode=self.args.prefetch_mode)
                out.setdefault("prefetched_mib", 0.0)
                out["prefetched_mib"] += res.prefetched_bytes / MIB
            else:
                mp.Freezer.of(box.group).thaw()
            resume_ms.append((time.monotonic() - t) * 1000)
            (touch_with if i % 2 == 0 else touch_without).append(box.touch() * 1000)
        out["resume_prefetch_ms_p50"] = statistics.median(resume_ms[0::2])
        out["resume_thaw_only_ms_p50"] = statistics.median(resume_ms[1::2]) if n > 1 else None
        out["first_touch_after_prefetch_ms_p50"] = statistics.median(touch_with)
        out["first_touch_without_prefetch_ms_p50"] = statistics.median(touch_without) if n > 1 else None
        out["resume_plus_touch_prefetch_ms_p50"] = statistics.median(
            r + t for r, t in zip(resume_ms[0::2], touch_with, strict=True))
        out["resume_plus_touch_thaw_only_ms_p50"] = statistics.median(
            r + t for r, t in zip(resume_ms[1::2], touch_without, strict=True)) if n > 1 else None
        self.stop_boxes()
        return out

    def job(self, n: int, workers: int) -> dict:
        """A job's worth of small sandboxes (one `sleep` each): freeze all and
        thaw all; then a job pause as the node should do it (freeze_all, then
        reclaim_frozen through a thread pool) and a job resume (resume through
        the pool). Seconds for the whole job."""
        from concurrent.futures import ThreadPoolExecutor

        groups, procs = [], []
        try:
            for i in range(n):
                g = cgroup.Group(self.layout, f"{self.root}/job{i}")
                g.create()
                groups.append(g)
                files = g.procs_files()

                def join(files=files):
                    for p in files:
                        with open(p, "w") as f:
                            f.write("0")

                procs.append(subprocess.Popen(["sleep", "3600"], preexec_fn=join))
            freezers = [mp.Freezer.of(g) for g in groups]
            t0 = time.monotonic()
            if mp.freeze_all(freezers, 10.0):
                raise RuntimeError("some job sandboxes did not freeze")
            t1 = time.monotonic()
            for f in freezers:
                f.thaw()
            t2 = time.monotonic()
            with ThreadPoolExecutor(workers) as pool:
                t_freeze = time.monotonic()
                if mp.freeze_all(freezers, 10.0):
                    raise RuntimeError("some job sandboxes did not freeze")
                t_frozen = time.monotonic()
                recs = list(pool.map(mp.reclaim_frozen, groups))
                t3 = time.monotonic()
                list(pool.map(lambda gr: mp.resume(*gr, mode=self.args.prefetch_mode),
                              zip(groups, recs, strict=True)))
                t4 = time.monotonic()
            return {"sandboxes": n, "workers": workers, "freeze_all_s": t1 - t0,
                    "thaw_all_s": t2 - t1, "job_pause_freeze_s": t_frozen - t_freeze,
                    "job_pause_reclaim_s": t3 - t_frozen, "job_pause_total_s": t3 - t_freeze,
                    "job_resume_s": t4 - t3}
        finally:
            for g in groups:
                with contextlib.suppress(OSError):
                    mp.Freezer.of(g).thaw()
            for p in procs:
                p.kill()
                p.wait()
            for g in groups:
                g.remove()

    def compare_methods(self, label: str) -> dict:
        """Each v1 method alone on a fresh sandbox; MiB freed (anon, file)."""
        results = {}
        plans = {"soft_limit": None, "force_empty": ("force_empty",), "limit": ("limit",),
                 "pageout": ("pageout",), "pageout+limit": ("pageout", "limit")}
        for name, methods in plans.items():
            (box,) = self.start_boxes(1, f"{label}-{name.replace('+', '_')}-")
            time.sleep(0.2)
            mp.Freezer.of(box.group).freeze(5.0)
            u0 = mp.usage(box.group)
            t0 = time.monotonic()
            if methods is None:
                _version, d = mp.memory_dir(box.group)
                soft = d / "memory.soft_limit_in_bytes"
                old = soft.read_text().strip()
                soft.write_text("0")
                time.sleep(1.0)
                soft.write_text(old)
            else:
                mp.reclaim(box.group, replace(mp.PauseConfig(), v1_methods=methods))
            dt = time.monotonic() - t0
            u1 = mp.usage(box.group)
            results[name] = {"anon_freed_mib": (u0.anon - u1.anon) / MIB,
                             "file_freed_mib": (u0.file - u1.file) / MIB,
                             "total_freed_mib": (u0.total - u1.total) / MIB,
                             "held_mib": u0.total / MIB, "ms": dt * 1000}
            log(f"{label} {name}: {results[name]}")
            self.stop_boxes()
        return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=8)
    ap.add_argument("--anon-mib", type=int, default=20)
    ap.add_argument("--file-mib", type=int, default=20)
    ap.add_argument("--limit-mib", type=int, default=256)
    ap.add_argument("--anon-random-percent", type=int, default=50,
                    help="incompressible share of each anon page (the rest is text)")
    ap.add_argument("--zram-mib", type=int, default=0,
                    help="zram capacity (default: twice what the sandboxes' anon needs)")
    ap.add_argument("--zram-algorithm", default="lz4")
    ap.add_argument("--compare-methods", action="store_true")
    ap.add_argument("--job", type=int, default=0, metavar="N",
                    help="also pause/resume a job of N small sandboxes through a thread pool")
    ap.add_argument("--job-workers", type=int, default=8)
    ap.add_argument("--prefetch-mode", default="populate", choices=mp.PREFETCH_MODES)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/mem.py needs root (cgroups, zram, process_madvise)", file=sys.stderr)
        return 2
    if active_swap := [s for s in Path("/proc/swaps").read_text().splitlines()[1:] if s.strip()]:
        log(f"note: swap already on before the bench: {active_swap}")
    bench = Bench(args)
    # SIGTERM -> exception, so the finally below cleans up.
    signal.signal(signal.SIGTERM, harness.interrupt)
    result: dict = {"cgroup_mode": bench.layout.mode, "sandboxes": args.sandboxes,
                    "anon_mib": args.anon_mib, "file_mib": args.file_mib,
                    "zram_algorithm": args.zram_algorithm,
                    "anon_random_percent": args.anon_random_percent,
                    "prefetch_mode": args.prefetch_mode}
    try:
        bench.make_files(max(args.sandboxes, 1))
        log("pause/resume without swap")
        result["no_swap"] = bench.pause_resume("noswap")
        if args.compare_methods:
            result["methods_no_swap"] = bench.compare_methods("noswap")
        log("pause/resume with zram")
        bench.swap_on()
        result["zram"] = bench.pause_resume("zram")
        if args.compare_methods:
            result["methods_zram"] = bench.compare_methods("zram")
        if args.job:
            log(f"job of {args.job} sandboxes, {args.job_workers} workers")
            result["job"] = bench.job(args.job, args.job_workers)
        bench.swap_off()
    finally:
        bench.cleanup()
    z, ns = result["zram"], result["no_swap"]
    result.update({
        "paused_freed_mib_per_sandbox_no_swap": ns["net_freed_mib_per_sandbox"],
        "paused_freed_mib_per_sandbox_zram": z["net_freed_mib_per_sandbox"],
        "paused_reclaimed_fraction_no_swap": ns["net_freed_fraction"],
        "paused_reclaimed_fraction": z["net_freed_fraction"],
        "resume_ms_p50": z["resume_prefetch_ms_p50"],
        "resume_plus_first_touch_ms_p50": z["resume_plus_touch_prefetch_ms_p50"],
    })
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
