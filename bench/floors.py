"""This host's floors, measured in the same run as dsecd's figures.

On a shared 2-core VM a rate moves by 3-5x with what the neighbours run, so a
dsecd figure means something only next to the bare kernel's, measured in
the same minutes. The benches alternate floor rounds with their own rounds
(`Floors.round` between them) and report both and their ratio.

* kernel floor (`kernel_floor`): `unshare` of the namespaces a sandbox gets
  (user, mount, pid, net, ipc, uts, cgroup) + fork + exec of /bin/true, in
  a bash loop, two loops at once: what a create + exec can never beat here.
  The same loop as /work/shared/tools/floor.py.
* fork floor (`fork_floor`): a Python process with the stdlib imported forks
  a child per call that writes `sum(range(10))` to a pipe and exits, two at
  once: a fresh worker per call with no isolation at all. Also floor.py's.
* isolated fork floor (`fork_floor(isolated=True)`): the same loop, each
  child first doing what a zygote's worker does before its call
  (dsecd/backends/zygote_main.py `worker`): its own process group, a 0700
  dir of its own under a private tmp dir (made, chowned, entered; removed
  by the parent after the child's exit), the call's five rlimits, nice
  19, an IPC namespace of its own, then a uid of its own (one of 64, as
  calls take turns). What a call's isolation costs without dsecd's
  request, zygote loop or report: its rate over the fork floor's is the
  most fncall_floor_ratio could be with that isolation kept.
* create stages (`create_stages`, bench/floor_create.c): the kernel's part of
  a sandbox create and exec without dsecd, made the way csrc/spawn.c makes
  it, level by level (namespaces; + cgroups; + mounts; + pivot_root; +
  seccomp): creates per second and the CPU ms of each create (the program
  and all its children; kworkers not counted), so the difference between
  two levels is what that step costs.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

from dsecd import cgroup

BENCH = Path(__file__).resolve().parent
UNSHARE = ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork",
           "--net", "--ipc", "--uts", "--cgroup", "/bin/true"]
STAGES = ("ns", "cgroups", "mounts", "root", "seccomp")


def kernel_floor(n: int = 400) -> float:
    """Creates per second of floor.py's loop: n unshare runs over two bash loops."""
    loop = f"for i in $(seq {n // 2}); do {' '.join(UNSHARE)}; done"
    t0 = time.monotonic()
    procs = [subprocess.Popen(["bash", "-c", loop]) for _ in range(2)]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"kernel floor loop exited {p.returncode}")
    return n / (time.monotonic() - t0)


FORK_CODE = (
    "import os, sys, json, time\n"
    "n = {n}\n"
    "t0 = time.monotonic()\n"
    "for _ in range(n):\n"
    "    r, w = os.pipe()\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        os.write(w, str(sum(range(10))).encode()); os._exit(0)\n"
    "    os.close(w); os.read(r, 64); os.close(r); os.waitpid(pid, 0)\n"
    "print(n / (time.monotonic() - t0))\n")


# The isolated fork floor's loop: FORK_CODE with a worker's set-up in the
# child (zygote_main.worker's steps and the default [fncall] rlimits) and
# its dir removed by the parent, as the zygote removes an empty one.
ISOLATED_FORK_CODE = (
    "import ctypes, os, resource, sys, tempfile, time\n"
    "n, base, uid0 = {n}, tempfile.mkdtemp(prefix='dsecd-floor-fork-'), {uid0}\n"
    "unshare = ctypes.CDLL(None, use_errno=True).unshare\n"
    "LIMITS = ((resource.RLIMIT_AS, 1 << 30), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, 64 << 20),\n"
    "          (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_NPROC, 512))\n"
    "t0 = time.monotonic()\n"
    "for i in range(n):\n"
    "    uid, tmp = uid0 + i % 64, f'{{base}}/{{i}}'\n"
    "    r, w = os.pipe()\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        os.setpgid(0, 0); os.mkdir(tmp, 0o700); os.chown(tmp, uid, uid); os.chdir(tmp)\n"
    "        for what, value in LIMITS: resource.setrlimit(what, (value, value))\n"
    "        os.nice(19)\n"
    "        if unshare(0x08000000) != 0: os._exit(3)\n"
    "        os.setgroups([]); os.setgid(uid); os.setuid(uid)\n"
    "        os.write(w, str(sum(range(10))).encode()); os._exit(0)\n"
    "    os.close(w); out = os.read(r, 64); os.close(r)\n"
    "    if os.waitpid(pid, 0)[1] != 0 or not out: sys.exit(f'isolated child {{i}} failed')\n"
    "    os.rmdir(tmp)\n"
    "elapsed = time.monotonic() - t0\n"
    "os.rmdir(base)\n"
    "print(n / elapsed)\n")
# Uids for the isolated children, far above the host's users and every
# range dsecd hands out (userns.py's slots, [fncall] uid_base).
ISOLATED_UID_BASE = 3_900_000_000


def fork_floor(n: int = 800, isolated: bool = False) -> float:
    """Calls per second of floor.py's fork loop: two Python processes (json,
    asyncio, subprocess and hashlib imported) forking n children each;
    `isolated`: each child isolated as a call's worker is first (root only)."""
    if isolated:
        loops = [ISOLATED_FORK_CODE.format(n=n, uid0=ISOLATED_UID_BASE + 64 * i) for i in range(2)]
    else:
        loops = [FORK_CODE.format(n=n)] * 2
    procs = [subprocess.Popen([sys.executable, "-c", "import json, asyncio, subprocess, hashlib\n" + loop],
                              stdout=subprocess.PIPE, text=True) for loop in loops]
    rates = [p.communicate()[0] for p in procs]
    for p in procs:
        if p.returncode != 0:
            raise RuntimeError(f"{'isolated ' if isolated else ''}fork floor loop exited {p.returncode}")
    return sum(float(r) for r in rates)


class CreateStages:
    """bench/floor_create.c, built once, run level by level in two streams,
    with cgroups under a private parent in each hierarchy (removed by close())."""

    def __init__(self, rootfs: str):
        self.rootfs = rootfs
        self.tmp = Path(tempfile.mkdtemp(prefix="dsecd-floor-"))
        self.exe = self.tmp / "floor_create"
        src = BENCH.parent / "csrc"
        subprocess.run(["cc", "-O2", "-Wall", "-I", str(src), "-o", str(self.exe), str(BENCH / "floor_create.c"),
                        str(src / "userns.c"), str(src / "upperfs.c"), str(src / "seccomp.c"), "-lseccomp"],
                       check=True)
        # A private parent in each hierarchy a sandbox gets a group in.
        self.name = f"dsecd-bench-floor-{os.getpid()}"
        self.parents = []
        for mnt in cgroup.detect_layout().made_hierarchies.values():
            path = os.path.join(mnt, self.name)
            os.makedirs(path, exist_ok=True)
            self.parents.append(path)
        self.mnt = [self.tmp / f"mnt{i}" for i in range(2)]
        for d in self.mnt:
            d.mkdir()

    def run(self, level: int, n: int) -> dict:
        """n creates at `level` in each of two streams: creates/s and CPU ms per create."""
        t0 = time.monotonic()
        procs = []
        for i in range(2):
            parents = ",".join(f"{p}/s{i}" for p in self.parents)
            for p in self.parents:
                os.makedirs(f"{p}/s{i}", exist_ok=True)
            procs.append(subprocess.Popen([str(self.exe), str(level), str(n), self.rootfs, parents, "1",
                                           str(self.mnt[i])], stdout=subprocess.PIPE, text=True))
        cpu = 0.0
        for p in procs:
            out, _ = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"floor_create level {level} exited {p.returncode}")
            cpu += float(out.split()[2])
        wall = time.monotonic() - t0
        return {"per_s": round(2 * n / wall, 1), "cpu_ms": round(cpu * 1000 / (2 * n), 3)}

    def close(self) -> None:
        for p in self.parents:
            for sub in ("s0", "s1", ""):
                try:
                    os.rmdir(os.path.join(p, sub) if sub else p)
                except FileNotFoundError:
                    pass
                except OSError as err:
                    harness.log(f"cannot remove cgroup {p}/{sub}: {err.strerror}")
        for d in self.mnt:
            d.rmdir()
        self.exe.unlink(missing_ok=True)
        self.tmp.rmdir()


def create_stages(rootfs: str, n: int = 100, rounds: int = 3) -> dict:
    """Each level `rounds` times, alternated (level 0..4, then again), so load
    that comes and goes hits every level alike; medians per level, and the
    CPU each step adds (the difference to the level below it)."""
    stages = CreateStages(rootfs)
    try:
        runs: dict[str, list[dict]] = {s: [] for s in STAGES}
        for _ in range(rounds):
            for level, name in enumerate(STAGES):
                runs[name].append(stages.run(level, n))
    finally:
        stages.close()
    out = {}
    prev = None
    for name in STAGES:
        cpu = statistics.median(r["cpu_ms"] for r in runs[name])
        out[name] = {"per_s": round(statistics.median(r["per_s"] for r in runs[name]), 1),
                     "cpu_ms": round(cpu, 3), "adds_cpu_ms": round(cpu - prev, 3) if prev is not None else None}
        prev = cpu
    return out


class Floors:
    """Floor rounds between a bench's own rounds: `round()` measures one of
    each floor named at construction; the medians and each dsecd round's
    ratio to the floor rounds on either side of it come from `ratio()`."""

    def __init__(self, kernel_n: int = 400, fork_n: int = 800, kernel: bool = True, fork: bool = True,
                 fork_isolated: bool = False):
        self.kernel_n, self.fork_n = kernel_n, fork_n
        self.kernel: list[float] = [] if kernel else None
        self.fork: list[float] = [] if fork else None
        # Each fork round followed by an isolated one: their ratio, round by round.
        self.fork_isolated: list[float] = [] if fork and fork_isolated else None

    def round(self) -> None:
        if self.kernel is not None:
            self.kernel.append(kernel_floor(self.kernel_n))
        if self.fork is not None:
            self.fork.append(fork_floor(self.fork_n))
        if self.fork_isolated is not None:
            self.fork_isolated.append(fork_floor(self.fork_n, isolated=True))
        harness.log("floor round: " + ", ".join(
            f"{name} {vals[-1]:.0f}/s" for name, vals in (("kernel", self.kernel), ("fork", self.fork),
                                                          ("fork isolated", self.fork_isolated))
            if vals is not None))

    @staticmethod
    def ratio(rates: list[float], floor: list[float]) -> float:
        """Median over dsecd's rounds of rate / mean of the floor rounds
        before and after it (floor has one round more than rates)."""
        if len(floor) != len(rates) + 1:
            raise ValueError(f"{len(rates)} rounds need {len(rates) + 1} floor rounds around them, got {len(floor)}")
        return round(statistics.median(r / ((floor[i] + floor[i + 1]) / 2) for i, r in enumerate(rates)), 3)

    def figures(self) -> dict:
        out = {}
        if self.kernel:
            out["kernel_floor_creates_per_s"] = round(statistics.median(self.kernel), 1)
            out["kernel_floor_rounds"] = [round(x, 1) for x in self.kernel]
        if self.fork:
            out["fork_floor_calls_per_s"] = round(statistics.median(self.fork), 1)
            out["fork_floor_rounds"] = [round(x, 1) for x in self.fork]
        if self.fork_isolated:
            out["fork_isolated_floor_calls_per_s"] = round(statistics.median(self.fork_isolated), 1)
            out["fncall_isolation_ceiling"] = round(statistics.median(
                iso / bare for iso, bare in zip(self.fork_isolated, self.fork, strict=True)), 3)
        return out
