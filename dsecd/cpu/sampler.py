"""Usage sampling: per-sandbox CPU, throttling and memory from cgroup files,
host figures from psutil and PSI, once per `cpu.sample_interval_s`.

Per sandbox it reads two or three small files (v1: cpuacct.usage, or the v2
group's cpu.stat where there is one (a hybrid host), memory.usage_in_bytes,
and v1's cpu.stat only for a sandbox with a CFS quota, since nothing else is
ever throttled; v2: cpu.stat has usage and throttling, plus memory.current)
with raw os.open/os.read: no Path objects, no buffered
I/O, because the pass runs every second over thousands of groups (bench/cpu.py
measures it on 4,000 real cgroups). Files are opened per pass rather than
held open: pread on a held fd is ~6x cheaper, but 3 fds per sandbox would
hit RLIMIT_NOFILE at ~4,000. Past SAMPLE_BUDGET sandboxes a pass reads a
round-robin share of the BE ones. Rates are deltas between
two passes; "recent" figures are exponential averages with a configured
half-life, which is what the placement hint and LS admission look at.

Blocking file I/O: run `Sampler.sample` in a worker thread. It is the only
writer of its state; readers take `Sampler.latest`, swapped in whole.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import psutil

from .. import cgroup
from ..sysfs import read_small

# Memory use is read every this many passes only: it is shown by `top` and
# changes slowly, while opening a cgroup file is most of a pass's cost (~10 us
# in kernfs per open on the CI VM), so this saves ~40% of the sampler's CPU.
MEMORY_EVERY = 5
# Sandboxes whose files one pass reads at most (new and LS sandboxes always,
# BE ones round-robin in what is left): at 2,000 sandboxes a full pass took
# ~360 ms of a 1 s interval during a burst, ~5% of the host's CPU. Past this
# many, a BE sandbox's own figures are up to n / SAMPLE_BUDGET passes old;
# rates and averages stay right (they divide by the real interval).
SAMPLE_BUDGET = 500


def parse_flat_keyed(data: bytes) -> dict[bytes, int]:
    """'key value\\n' lines (cpu.stat, v1 and v2) -> {key: int}."""
    words = data.split()
    return {k: int(v) for k, v in zip(words[::2], words[1::2], strict=False)}


# (path, dir_fd): the path is relative to dir_fd, or absolute with dir_fd None.
File = tuple[str, int | None]


@dataclass(frozen=True)
class StatFiles:
    """Where one group's figures live: paths resolved once per sandbox."""

    usage: File | None        # v1 cpuacct.usage (ns) or v2 cpu.stat (usage_usec)
    usage_v2: bool
    throttle: File | None     # cpu.stat with nr_periods/nr_throttled/throttled_{time,usec}
    throttle_v2: bool         # throttle is v2's cpu.stat (usec), else v1's (ns)
    memory: File | None       # memory.usage_in_bytes or memory.current


def stat_files(layout: cgroup.Layout, rel: str, quota: bool = True, base=None) -> StatFiles:
    """The files of group `rel`. `base(mount)` may give (dir, dir_fd) to open
    them relative to: a held fd of the subtree root saves ~20% of each open
    (fewer path components to walk in kernfs)."""
    def where(mnt, name: str) -> File:
        if base is not None:
            prefix, fd = base(mnt)
            if fd is not None:
                return f"{os.path.relpath(rel, prefix)}/{name}", fd
        return str(mnt / rel / name), None

    usage, throttle = None, None
    cpu = layout.controller_dir("cpu")
    throttle_v2 = bool(cpu) and cpu[0] == "v2"
    if layout.cpu_usage_from_v2:
        usage = where(layout.v2, "cpu.stat")
    elif acct := layout.controller_dir("cpuacct"):
        usage = where(acct[1], "cpuacct.usage")
    if cpu and (quota or throttle_v2):
        throttle = usage if throttle_v2 else where(cpu[1], "cpu.stat")
    mem = layout.controller_dir("memory")
    memory = None
    if mem:
        memory = where(mem[1], "memory.current" if mem[0] == "v2" else "memory.usage_in_bytes")
    return StatFiles(usage, layout.cpu_usage_from_v2, throttle, throttle_v2, memory)


@dataclass
class Raw:
    """One reading of one group's counters; None where a file was missing."""

    usage_ns: int | None = None
    nr_periods: int = 0
    nr_throttled: int = 0
    throttled_ns: int = 0
    memory: int | None = None


def read_group(f: StatFiles, memory: bool = True) -> Raw:
    raw = Raw()
    data = read_small(*f.usage) if f.usage else None
    usage_stat = parse_flat_keyed(data) if data and f.usage_v2 else None
    if data:
        raw.usage_ns = usage_stat.get(b"usage_usec", 0) * 1000 if usage_stat is not None else int(data)
    if f.throttle is not None and f.throttle == f.usage:
        stat = usage_stat           # v2's one cpu.stat has usage and throttling: read once
    else:
        data = read_small(*f.throttle) if f.throttle else None
        stat = parse_flat_keyed(data) if data else None
    if stat:
        raw.throttled_ns = (stat.get(b"throttled_usec", 0) * 1000 if f.throttle_v2
                            else stat.get(b"throttled_time", 0))
        raw.nr_periods = stat.get(b"nr_periods", 0)
        raw.nr_throttled = stat.get(b"nr_throttled", 0)
    if memory and f.memory:
        data = read_small(*f.memory)
        raw.memory = int(data) if data else None
    return raw


@dataclass
class Track:
    """What the sampler remembers of one sandbox between passes."""

    t: float
    raw: Raw
    cpu_pct: float | None = None         # 100 = one CPU, over the last interval
    recent_cores: float = 0.0            # exponential average of cores in use
    throttled_pct: float | None = None   # of CFS periods in the last interval
    throttled_ms: float = 0.0            # time throttled in the last interval


def advance(prev: Track, now: float, raw: Raw, half_life_s: float) -> Track:
    """The next Track from the previous one and a new reading."""
    dt = now - prev.t
    tr = Track(now, raw, recent_cores=prev.recent_cores)
    if dt <= 0 or raw.usage_ns is None or prev.raw.usage_ns is None:
        return tr
    cores = max(0.0, (raw.usage_ns - prev.raw.usage_ns) / 1e9 / dt)
    tr.cpu_pct = round(cores * 100, 2)
    # Weight of the old average after dt seconds: 1/2 per half-life.
    keep = math.exp(-dt * math.log(2) / half_life_s) if half_life_s > 0 else 0.0
    tr.recent_cores = prev.recent_cores * keep + cores * (1 - keep)
    periods = raw.nr_periods - prev.raw.nr_periods
    if periods > 0:
        tr.throttled_pct = round(100 * (raw.nr_throttled - prev.raw.nr_throttled) / periods, 2)
    tr.throttled_ms = round(max(0, raw.throttled_ns - prev.raw.throttled_ns) / 1e6, 3)
    return tr


def read_psi(path: str = "/proc/pressure/cpu") -> dict | None:
    """{"some_avg10": %, "some_avg60": %} of CPU pressure, or None without PSI."""
    data = read_small(path)
    if not data:
        return None
    for line in data.decode().splitlines():
        if line.startswith("some "):
            kv = dict(x.split("=") for x in line.split()[1:])
            return {"some_avg10": float(kv["avg10"]), "some_avg60": float(kv["avg60"])}
    return None


def round_robin(items: list, cursor: int, n: int) -> tuple[list, int]:
    """Up to n items from `cursor` on, wrapping around; and where the next turn starts."""
    start = cursor % len(items) if items else 0
    batch = (items[start:] + items[:start])[:n]
    return batch, start + len(batch)


def _row(qos: str, tr: Track) -> dict:
    """A sandbox's figures in a snapshot, from its latest reading."""
    return {"qos": qos, "cpu_pct": tr.cpu_pct, "recent_cores": round(tr.recent_cores, 4),
            "throttled_pct": tr.throttled_pct, "throttled_ms": tr.throttled_ms, "memory": tr.raw.memory}


@dataclass
class Snapshot:
    """One pass: per-sandbox figures and the host's, ready to serve."""

    t: float = 0.0
    duration_ms: float = 0.0
    sandboxes: dict[str, dict] = field(default_factory=dict)
    host: dict = field(default_factory=dict)


class Sampler:
    def __init__(self, layout: cgroup.Layout, root_rel: str, half_life_s: float):
        self.layout = layout
        self.root_rel = root_rel
        self.half_life_s = half_life_s
        self.files: dict[str, StatFiles] = {}
        self.tracks: dict[str, Track] = {}
        self.host_prev: tuple[float, float] | None = None   # (t, busy cpu seconds)
        self.host_recent = 0.0
        self.passes = 0
        self._cursor = 0                      # where the next pass's BE round-robin starts
        self.dir_fds: dict[str, int] = {}     # subtree root per hierarchy, held open
        self.latest = Snapshot()

    def _base(self, mnt) -> tuple[str, int | None]:
        """(root_rel, fd of mnt/root_rel), opened on first use; None until the
        subtree exists (before the first create)."""
        key = str(mnt)
        fd = self.dir_fds.get(key)
        if fd is None:
            try:
                fd = self.dir_fds[key] = os.open(mnt / self.root_rel, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                return self.root_rel, None
        return self.root_rel, fd

    def close(self) -> None:
        for fd in self.dir_fds.values():
            os.close(fd)
        self.dir_fds.clear()

    def sample(self, entries: dict[str, tuple[str, bool]]) -> Snapshot:
        """One pass over {sandbox id: (qos, has a CFS quota)}; returns (and
        keeps) the snapshot."""
        t0 = time.monotonic()
        out: dict[str, dict] = {}
        memory_pass = self.passes % MEMORY_EVERY == 0
        self.passes += 1
        chosen = self._this_pass(entries)
        # A share per pass: memory too whenever a sandbox's turn comes (its
        # turns could otherwise keep missing the memory passes).
        memory_pass = memory_pass or len(chosen) < len(entries)
        for sb_id, (qos, quota) in entries.items():
            if sb_id not in chosen:
                out[sb_id] = _row(qos, self.tracks[sb_id])
                continue
            f = self.files.get(sb_id)
            if f is None:
                f = self.files[sb_id] = stat_files(self.layout, f"{self.root_rel}/{sb_id}", quota, self._base)
            prev = self.tracks.get(sb_id)
            raw = read_group(f, memory_pass or prev is None)
            if not (memory_pass or prev is None):
                raw.memory = prev.raw.memory
            now = time.monotonic()
            tr = advance(prev, now, raw, self.half_life_s) if prev else Track(now, raw)
            self.tracks[sb_id] = tr
            out[sb_id] = _row(qos, tr)
        for gone in set(self.tracks) - set(entries):
            self.tracks.pop(gone, None)
            self.files.pop(gone, None)
        host = self.sample_host(out)
        snap = Snapshot(time.time(), round((time.monotonic() - t0) * 1000, 3), out, host)
        self.latest = snap
        return snap

    def _this_pass(self, entries: dict[str, tuple[str, bool]]) -> set[str]:
        """The sandboxes read in this pass: new and LS ones, then BE ones
        round-robin up to SAMPLE_BUDGET."""
        if len(entries) <= SAMPLE_BUDGET:
            return set(entries)
        chosen = {k for k, (qos, _) in entries.items() if k not in self.tracks or qos != "be"}
        rest = [k for k in entries if k not in chosen]
        # A quarter of the budget stays the BE ones' even when new and LS
        # sandboxes take the rest: no BE figure freezes for good.
        batch, self._cursor = round_robin(rest, self._cursor, max(SAMPLE_BUDGET // 4, SAMPLE_BUDGET - len(chosen)))
        chosen.update(batch)
        return chosen

    def sample_host(self, sbs: dict[str, dict]) -> dict:
        now = time.monotonic()
        times = psutil.cpu_times()
        busy = times.user + times.nice + times.system + times.irq + times.softirq + getattr(times, "steal", 0)
        cpus = psutil.cpu_count() or 1
        used_cores = None
        if self.host_prev and now > self.host_prev[0]:
            used_cores = max(0.0, (busy - self.host_prev[1]) / (now - self.host_prev[0]))
            keep = math.exp(-(now - self.host_prev[0]) * math.log(2) / self.half_life_s) \
                if self.half_life_s > 0 else 0.0
            self.host_recent = self.host_recent * keep + used_cores * (1 - keep)
        self.host_prev = (now, busy)
        vm = psutil.virtual_memory()
        by_qos = {"be": 0.0, "ls": 0.0}
        recent_by_qos = {"be": 0.0, "ls": 0.0}
        for s in sbs.values():
            by_qos[s["qos"]] = by_qos.get(s["qos"], 0.0) + (s["cpu_pct"] or 0.0) / 100
            recent_by_qos[s["qos"]] = recent_by_qos.get(s["qos"], 0.0) + s["recent_cores"]
        return {"cpus": cpus, "cpu_pct": round(100 * used_cores / cpus, 2) if used_cores is not None else None,
                "recent_cores": round(self.host_recent, 4),
                "sandbox_cores": {k: round(v, 4) for k, v in by_qos.items()},
                "sandbox_recent_cores": {k: round(v, 4) for k, v in recent_by_qos.items()},
                "loadavg": [round(x, 2) for x in os.getloadavg()],
                "mem_total": vm.total, "mem_available": vm.available, "psi_cpu": read_psi()}


def placement_hint(snap: Snapshot, cpus: int) -> dict:
    """What a fleet layer needs to place the next sandbox, latency first.

    LS headroom ignores BE use (BE yields to LS at once) but counts what the
    host runs outside sandboxes (daemons, the kernel). BE pressure is the
    share of time runnable tasks waited for a CPU (PSI "some"), which on a
    host full of SCHED_IDLE work is mostly BE tasks waiting behind others.
    """
    h = snap.host
    if not h:
        return {"ready": False}
    rec = h["sandbox_recent_cores"]
    outside = max(0.0, h["recent_cores"] - rec.get("ls", 0.0) - rec.get("be", 0.0))
    ls_headroom = max(0.0, cpus - rec.get("ls", 0.0) - outside)
    be_headroom = max(0.0, cpus - h["recent_cores"])
    psi = h.get("psi_cpu") or {}
    return {"ready": True, "age_s": round(time.time() - snap.t, 3),
            "ls_recent_cores": rec.get("ls", 0.0), "be_recent_cores": rec.get("be", 0.0),
            "other_recent_cores": round(outside, 4),
            "ls_headroom_cores": round(ls_headroom, 4), "be_headroom_cores": round(be_headroom, 4),
            "be_pressure_pct": psi.get("some_avg10"),
            # 0..1, higher = better host for an LS sandbox; for sorting hosts only.
            "ls_score": round(ls_headroom / cpus * (1 - min(psi.get("some_avg10", 0.0), 100) / 200), 4)}
