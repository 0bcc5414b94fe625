"""Pause and resume a sandbox's memory: freeze, reclaim, prefetch, thaw.

    rec = pause(group, PauseConfig())      # freeze, remember the working set, reclaim
    ...                                    # rec.to_json() goes into the journal
    resume(group, rec)                     # prefetch the working set, then thaw

Freezing uses v2 `cgroup.freeze` (a core file of every non-root v2 group, so
it works in the empty v2 tree of a hybrid host too) and the v1 freezer
otherwise. Reclaim depends on where the memory controller is:

* v2: `memory.reclaim` (Linux >= 5.19) asks for the group's whole usage.
* v1 has no memory.reclaim. What frees memory here, measured in
  docs/memory.md: MADV_PAGEOUT through process_madvise on every mapping of
  every process (anon to swap, privately mapped file pages dropped), then a
  temporarily lowered `memory.limit_in_bytes` that pushes out the page cache
  the sandbox read but does not map. `memory.force_empty` is the same
  reclaim loop as the limit but gives up sooner; `memory.soft_limit_in_bytes`
  frees nothing until the host is under global pressure.

Anonymous memory only leaves with swap (dsecd.mem.zram). Without swap,
pause frees the page cache only, and says so in its result.

Resume faults the working set recorded at pause back in (process_vm_readv
of one byte per page, and/or MADV_WILLNEED) while the sandbox is still
frozen, then thaws, so its first request does not fault page by page.

Every function blocks (sysfs writes, reclaim, swap-in): call them from worker
threads. All are idempotent: pausing a frozen sandbox or resuming a thawed one
does nothing and says so.
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import cgroup, native, sysfs

PAGE = native.PAGE_SIZE
PREFETCH_MODES = ("populate", "willneed", "both", "none")
# Mappings that are not the process's memory (or not a VMA at all).
_SPECIAL = ("[vsyscall]", "[vvar]", "[vvar_vclock]", "[vdso]", "[uprobes]")


class PauseError(OSError):
    pass


def _err(num: int, message: str) -> PauseError:
    return PauseError(num, message)


def _write(path: Path, value: str) -> None:
    sysfs.write(path, value, PauseError)


def _read(path: Path) -> str:
    return sysfs.read(path, PauseError)


# ---------------------------------------------------------------- freeze / thaw


@dataclass(frozen=True)
class Freezer:
    """Where a group is frozen: v2 `cgroup.freeze` or the v1 freezer."""

    version: str      # "v2" | "v1"
    dir: Path

    @classmethod
    def of(cls, group: cgroup.Group) -> Freezer:
        v2 = group.dirs.get(cgroup.V2)
        if v2 is not None and (v2 / "cgroup.freeze").exists():
            return cls("v2", v2)
        v1 = group.dir_for("freezer")
        if v1 is not None and v1[0] == "v1" and (v1[1] / "freezer.state").exists():
            return cls("v1", v1[1])
        raise _err(errno.EOPNOTSUPP, f"freeze cgroup `{group.rel}`: neither v2 cgroup.freeze "
                   "nor a v1 freezer hierarchy is available")

    def state(self) -> str:
        """"FROZEN", "THAWED" or "FREEZING" (v1 transitional, or v2 asked but not done)."""
        if self.version == "v1":
            return _read(self.dir / "freezer.state").strip()
        asked = _read(self.dir / "cgroup.freeze").strip() == "1"
        frozen = _events(self.dir).get("frozen") == 1
        if frozen:
            return "FROZEN"
        return "FREEZING" if asked else "THAWED"

    def asked_file(self) -> Path:
        """The file that says whether the group is asked to be frozen: v1
        freezer.state ("FROZEN" or "FREEZING"), v2 cgroup.freeze ("1"). For
        a reader outside the daemon (the exec tracer, dsecd/trace.py)."""
        return self.dir / ("cgroup.freeze" if self.version == "v2" else "freezer.state")

    def request_freeze(self) -> None:
        """Ask for the freeze without waiting (see freeze_all)."""
        if self.version == "v2":
            _write(self.dir / "cgroup.freeze", "1")
        else:
            _write(self.dir / "freezer.state", "FROZEN")

    def freeze(self, timeout: float) -> float:
        """Freeze and wait until every task is frozen; seconds waited. On
        timeout the group is thawed again and EBUSY raised: a sandbox is
        never left half-frozen."""
        start = time.monotonic()
        self.request_freeze()
        delay = 0.0002
        while self.state() != "FROZEN":
            if time.monotonic() - start > timeout:
                self.thaw(timeout)
                raise _err(errno.EBUSY, f"freeze `{self.dir}`: tasks not frozen after "
                           f"{timeout:g}s (in uninterruptible sleep?); thawed again")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
            if self.version == "v1":
                # A v1 freeze that met a task in a non-freezable state stays
                # FREEZING; writing FROZEN again retries the stragglers.
                _write(self.dir / "freezer.state", "FROZEN")
        return time.monotonic() - start

    def request_thaw(self) -> None:
        """Ask for the thaw without waiting (see thaw_all)."""
        if self.version == "v2":
            _write(self.dir / "cgroup.freeze", "0")
        else:
            _write(self.dir / "freezer.state", "THAWED")

    def thaw(self, timeout: float = 5.0) -> None:
        self.request_thaw()
        self.wait_thawed(timeout)

    def wait_thawed(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.state() != "THAWED":
            if time.monotonic() > deadline:
                raise _err(errno.EBUSY, f"thaw `{self.dir}`: still {self.state()} after {timeout:g}s")
            time.sleep(0.001)


def freeze_all(freezers: list[Freezer], timeout: float) -> list[Freezer]:
    """Freeze many groups at once (a job): ask all, then wait for each, so the
    kernel freezes them in parallel. Returns the ones that did not freeze in
    time, already thawed again."""
    for f in freezers:
        f.request_freeze()
    deadline = time.monotonic() + timeout
    failed = []
    for f in freezers:
        try:
            f.freeze(max(0.0, deadline - time.monotonic()))   # re-asks: idempotent
        except PauseError:
            failed.append(f)
    return failed


def thaw_all(freezers: list[Freezer], timeout: float) -> list[Freezer]:
    """Thaw many groups at once (a job resume): ask all, then wait for each.
    Returns the ones still not thawed at the deadline (or whose files failed)."""
    failed, asked = [], []
    for f in freezers:
        try:
            f.request_thaw()
            asked.append(f)
        except PauseError:
            failed.append(f)
    deadline = time.monotonic() + timeout
    for f in asked:
        try:
            f.wait_thawed(max(0.0, deadline - time.monotonic()))
        except PauseError:
            failed.append(f)
    return failed


def _events(d: Path) -> dict[str, int]:
    out = {}
    for line in _read(d / "cgroup.events").splitlines():
        key, _, value = line.partition(" ")
        out[key] = int(value)
    return out


# ---------------------------------------------------------------- memory accounting


@dataclass(frozen=True)
class MemUsage:
    """A group's charged memory, bytes (anon and file from memory.stat)."""

    total: int
    anon: int
    file: int
    swap: int

    def to_dict(self) -> dict:
        return {"total": self.total, "anon": self.anon, "file": self.file, "swap": self.swap}


def memory_dir(group: cgroup.Group) -> tuple[str, Path]:
    where = group.dir_for("memory")
    if where is None:
        raise _err(errno.EOPNOTSUPP, f"memory of `{group.rel}`: no memory controller on this host")
    return where


def usage(group: cgroup.Group) -> MemUsage:
    version, d = memory_dir(group)
    stat = _stat(d)
    if version == "v2":
        return MemUsage(int(_read(d / "memory.current")), stat.get("anon", 0), stat.get("file", 0),
                        _int_or_zero(d / "memory.swap.current"))
    # v1: rss is anon (incl. transparent huge pages), cache the page cache and shmem.
    return MemUsage(int(_read(d / "memory.usage_in_bytes")), stat.get("rss", 0),
                    stat.get("cache", 0), stat.get("swap", 0))


def charged(groups: dict[str, cgroup.Group]) -> dict[str, int]:
    """What each group is charged now (memory.current, v1
    memory.usage_in_bytes); a group whose file cannot be read is left out."""
    out = {}
    for key, group in groups.items():
        try:
            version, d = memory_dir(group)
            out[key] = int(_read(d / ("memory.current" if version == "v2" else "memory.usage_in_bytes")))
        except (OSError, ValueError):
            continue
    return out


def swapped(groups: dict[str, cgroup.Group]) -> dict[str, int]:
    """What each group has in swap now: v2 memory.swap.current, v1
    memory.memsw.usage_in_bytes less memory.usage_in_bytes (two small
    reads, not memory.stat's parse). A group whose files cannot be read
    (gone, or a kernel without swap accounting) is left out."""
    out = {}
    for key, group in groups.items():
        try:
            version, d = memory_dir(group)
            if version == "v2":
                out[key] = int(_read(d / "memory.swap.current"))
            else:
                out[key] = max(0, int(_read(d / "memory.memsw.usage_in_bytes"))
                               - int(_read(d / "memory.usage_in_bytes")))
        except (OSError, ValueError):
            continue
    return out


def charge(group: cgroup.Group) -> tuple[int, int] | None:
    """(the memory limit, what is charged) of the group; None without a limit."""
    version, d = memory_dir(group)
    raw = _read(d / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).strip()
    if raw == "max" or int(raw) >= 1 << 60:       # v1 says "no limit" with a page-rounded 2**63-1
        return None
    return int(raw), int(_read(d / ("memory.current" if version == "v2" else "memory.usage_in_bytes")))


def droppable_cache(group: cgroup.Group) -> int:
    """The group's page cache that reclaim can drop: file pages that are not
    shmem (tmpfs pages stay)."""
    version, d = memory_dir(group)
    stat = _stat(d)
    if version == "v2":
        return max(0, stat.get("file", 0) - stat.get("shmem", 0))
    return max(0, stat.get("total_cache", 0) - stat.get("total_shmem", 0))


def _stat(d: Path) -> dict[str, int]:
    stat = {}
    for line in _read(d / "memory.stat").splitlines():
        key, _, value = line.partition(" ")
        stat[key] = int(value)
    return stat


def oom_kills(group: cgroup.Group) -> int:
    """How many processes the memory limit's OOM killer has killed in the group
    (v2 memory.events `oom_kill`; v1 memory.oom_control `oom_kill`, Linux >= 4.13).
    On plain strings and one read: the OOM check reads 500 groups a second,
    and Path objects were most of its CPU."""
    path = group.oom_events_file
    if path is None:
        raise _err(errno.EOPNOTSUPP, f"memory of `{group.rel}`: no memory controller on this host")
    data = sysfs.read_small(path)
    if data is None:
        raise _err(errno.ENOENT, f"read `{path}`: the group is gone")
    start = data.find(b"oom_kill ")
    return int(data[start + 9:data.index(b"\n", start)]) if start >= 0 else 0


def _int_or_zero(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


def set_swap(group: cgroup.Group, max_bytes: int | None) -> None:
    """Per-sandbox swap permission: None = unlimited, 0 = never swap.

    v2: memory.swap.max. v1 cannot cap swap on its own (memsw caps memory +
    swap together, which would also cap RAM): 0 sets memory.swappiness 0,
    which keeps reclaim off the group's anon pages; any other value restores
    the default swappiness (the sandbox's memory.limit_in_bytes still bounds
    what it holds in RAM)."""
    version, d = memory_dir(group)
    if version == "v2":
        _write(d / "memory.swap.max", "max" if max_bytes is None else str(max_bytes))
    else:
        _write(d / "memory.swappiness", "0" if max_bytes == 0 else str(_vm_swappiness()))


def _vm_swappiness() -> int:
    return int(Path("/proc/sys/vm/swappiness").read_text())


# ---------------------------------------------------------------- working set


_MAPS_LINE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)[ \t]*(.*)$", re.M)
# pagemap: bit 63 present, bit 62 swapped: the top byte of each little-endian
# u64 is >= 0x40 exactly when the page is resident or in swap.
_HELD = bytes(0x31 if b & 0xC0 else 0x30 for b in range(256))
# ... and < 0x80 exactly when it is not mapped (in swap, or never faulted in).
_UNMAPPED = bytes(0x30 if b & 0x80 else 0x31 for b in range(256))


def mappings(pid: int) -> list[tuple[int, int, str]]:
    """(start, end, name) of a process's VMAs, without the special ones."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return []
    out = []
    for m in _MAPS_LINE.finditer(data):
        name = m.group(5).decode(errors="replace")
        if name in _SPECIAL:
            continue
        out.append((int(m.group(1), 16), int(m.group(2), 16), name))
    return out


_PAGEMAP_SLICE = 1 << 16      # pages per pagemap read (512 KiB of entries)


def _append_run(out: list[tuple[int, int]], start: int, length: int) -> None:
    if out and out[-1][0] + out[-1][1] == start:   # a run across two slices
        out[-1] = (out[-1][0], out[-1][1] + length)
    else:
        out.append((start, length))


def _pagemap_runs(fd: int, first_page: int, end_page: int, table: bytes, out: list[tuple[int, int]]) -> bool:
    """Append to `out` the runs of pages in [first_page, end_page) whose
    pagemap entry's top byte `table` maps to "1"; False if pagemap could not
    be read there. Read in slices: a VMA may be a huge reservation (Go, JVM,
    sanitizers)."""
    for first in range(first_page, end_page, _PAGEMAP_SLICE):
        count = min(_PAGEMAP_SLICE, end_page - first)
        try:
            raw = os.pread(fd, count * 8, first * 8)
        except OSError:
            return False
        for run in re.finditer(rb"1+", raw[7::8].translate(table)):
            _append_run(out, (first + run.start()) * PAGE, (run.end() - run.start()) * PAGE)
    return True


def resident_ranges(pid: int) -> list[tuple[int, int]]:
    """(start, length) runs of pages that are in RAM or in swap, from
    /proc/<pid>/pagemap: the process's working set as the kernel sees it."""
    out: list[tuple[int, int]] = []
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return out
    try:
        for start, end, _name in mappings(pid):
            _pagemap_runs(fd, start // PAGE, end // PAGE, _HELD, out)
    finally:
        os.close(fd)
    return out


def unmapped_ranges(pid: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pages of `ranges` not mapped in `pid` now (pagemap bit 63 clear):
    those a prefetch would charge to the group when it faults them in. A
    process whose pagemap cannot be read keeps its ranges as they are."""
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ranges
    out: list[tuple[int, int]] = []
    try:
        for start, length in ranges:
            if not _pagemap_runs(fd, start // PAGE, (start + length + PAGE - 1) // PAGE, _UNMAPPED, out):
                return ranges
    finally:
        os.close(fd)
    return out


@dataclass
class PauseRecord:
    """What pause did; resume needs `working_set`. JSON-able for the journal."""

    frozen_s: float = 0.0
    reclaim_s: float = 0.0
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    methods: dict = field(default_factory=dict)        # method -> bytes freed
    working_set: dict = field(default_factory=dict)    # pid -> [[start, length], ...]
    already_paused: bool = False
    notes: list = field(default_factory=list)

    @property
    def freed(self) -> int:
        return max(0, self.before.get("total", 0) - self.after.get("total", 0))

    def to_json(self) -> dict:
        return {"frozen_s": self.frozen_s, "reclaim_s": self.reclaim_s, "before": self.before,
                "after": self.after, "methods": self.methods, "already_paused": self.already_paused,
                "notes": self.notes,
                "working_set": {str(p): [list(r) for r in rs] for p, rs in self.working_set.items()}}

    @classmethod
    def from_json(cls, d: dict) -> PauseRecord:
        rec = cls(**{k: v for k, v in d.items() if k != "working_set"})
        rec.working_set = {int(p): [tuple(r) for r in rs] for p, rs in d.get("working_set", {}).items()}
        return rec


# ---------------------------------------------------------------- reclaim


V1_METHODS = ("pageout", "limit", "force_empty")


@dataclass(frozen=True)
class PauseConfig:
    freeze_timeout_s: float = 5.0
    # v1 methods in order; v2 always uses memory.reclaim.
    v1_methods: tuple[str, ...] = ("pageout", "limit", "force_empty")
    # What the limit is lowered to; the kernel reclaims until it fits or gives up.
    v1_limit_floor_bytes: int = 0
    record_working_set: bool = True
    max_working_set_ranges: int = 65536
    prefetch_mode: str = "populate"

    def __post_init__(self):
        bad = [m for m in self.v1_methods if m not in V1_METHODS]
        if bad:
            raise ValueError(f"memory.v1_reclaim: unknown method(s) {bad}; known: {V1_METHODS}")
        if self.prefetch_mode not in PREFETCH_MODES:
            raise ValueError(f"memory.prefetch must be one of {PREFETCH_MODES}")

    @classmethod
    def from_section(cls, mem: dict) -> PauseConfig:
        """From the [memory] table of the daemon config (docs/memory.md)."""
        from ..config import parse_size

        return cls(freeze_timeout_s=float(mem["freeze_timeout_s"]),
                   v1_methods=tuple(mem["v1_reclaim"]),
                   v1_limit_floor_bytes=parse_size(mem["v1_limit_floor"]),
                   record_working_set=mem["prefetch"] != "none",
                   max_working_set_ranges=int(mem["max_prefetch_ranges"]),
                   prefetch_mode=mem["prefetch"])


def pageout(pids: set[int]) -> int:
    """MADV_PAGEOUT over every mapping of every process; bytes advised."""
    done = 0
    for pid in sorted(pids):
        ranges = [(s, e - s) for s, e, _ in mappings(pid)]
        with _pidfd(pid) as fd:
            if fd is None or not ranges:
                continue
            try:
                done += native.process_madvise(fd, ranges, native.MADV_PAGEOUT).bytes
            except ProcessLookupError:
                continue
    return done


class _pidfd:
    """`with _pidfd(pid) as fd`: fd is None if the process is gone."""

    def __init__(self, pid: int):
        self.pid, self.fd = pid, None

    def __enter__(self):
        try:
            self.fd = native.pidfd_open(self.pid)
        except ProcessLookupError:
            self.fd = None
        return self.fd

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)


def reclaim_v1_limit(d: Path, floor: int) -> str:
    """Lower memory.limit_in_bytes to `floor` and put it back. The kernel
    reclaims in SWAP_CLUSTER_MAX steps until usage fits and answers EBUSY
    when reclaim stops making progress: the expected end, not an error."""
    limit_file = d / "memory.limit_in_bytes"
    old = _read(limit_file).strip()
    try:
        _write(limit_file, str(floor))
        outcome = "reached"
    except PauseError as err:
        if err.errno != errno.EBUSY:
            raise
        outcome = "stopped (EBUSY: nothing more reclaimable)"
    finally:
        _write(limit_file, old)
    return outcome


def reclaim_v1_force_empty(d: Path) -> str:
    try:
        _write(d / "memory.force_empty", "0")
        return "emptied"
    except PauseError as err:
        if err.errno != errno.EBUSY:
            raise
        return "stopped (EBUSY)"


def reclaim_v2(d: Path, amount: int) -> str:
    """memory.reclaim of the whole usage; EAGAIN = reclaimed less than asked."""
    try:
        _write(d / "memory.reclaim", str(max(amount, PAGE)))
        return "reached"
    except PauseError as err:
        if err.errno != errno.EAGAIN:
            raise
        return "partial (EAGAIN)"


def reclaim(group: cgroup.Group, cfg: PauseConfig = PauseConfig(),
            notes: list | None = None) -> dict[str, int]:
    """Reclaim a (frozen) group's memory; {method: bytes freed by it}."""
    version, d = memory_dir(group)
    notes = notes if notes is not None else []
    freed: dict[str, int] = {}
    methods = ("reclaim",) if version == "v2" else cfg.v1_methods
    for method in methods:
        before = usage(group).total
        if method == "reclaim":
            notes.append(f"reclaim: {reclaim_v2(d, before)}")
        elif method == "pageout":
            notes.append(f"pageout: {pageout(group.pids())} bytes advised")
        elif method == "limit":
            notes.append(f"limit: {reclaim_v1_limit(d, cfg.v1_limit_floor_bytes)}")
        elif method == "force_empty":
            notes.append(f"force_empty: {reclaim_v1_force_empty(d)}")
        else:
            raise ValueError(f"unknown reclaim method {method!r}")
        freed[method] = max(0, before - usage(group).total)
    return freed


# ---------------------------------------------------------------- pause / resume


def pause(group: cgroup.Group, cfg: PauseConfig = PauseConfig()) -> PauseRecord:
    """Freeze, record the working set, reclaim. A frozen group is left alone."""
    freezer = Freezer.of(group)
    if freezer.state() == "FROZEN":
        return PauseRecord(already_paused=True)
    frozen_s = freezer.freeze(cfg.freeze_timeout_s)
    rec = reclaim_frozen(group, cfg)
    rec.frozen_s = frozen_s
    return rec


def reclaim_frozen(group: cgroup.Group, cfg: PauseConfig = PauseConfig()) -> PauseRecord:
    """The second half of pause, for groups frozen already (freeze_all of a
    job): record the working set, reclaim. Refuses a group that is not frozen
    (EBUSY): its tasks would fault pages back in as fast as they leave."""
    state = Freezer.of(group).state()
    if state != "FROZEN":
        raise _err(errno.EBUSY, f"reclaim `{group.rel}`: the group is {state}, not FROZEN")
    rec = PauseRecord()
    rec.before = usage(group).to_dict()
    if cfg.record_working_set:
        rec.working_set = _working_set(group.pids(), cfg.max_working_set_ranges, rec.notes)
    t0 = time.monotonic()
    try:
        rec.methods = reclaim(group, cfg, rec.notes)
    except OSError as err:
        # The sandbox is frozen, which is what pause promises; memory that
        # could not be reclaimed is reported, not turned into a failed pause.
        rec.notes.append(f"reclaim failed: {err}")
    rec.reclaim_s = time.monotonic() - t0
    rec.after = usage(group).to_dict()
    if not _swap_total() and rec.before.get("anon"):
        rec.notes.append("no swap on this host: anonymous memory stays resident")
    return rec


def _working_set(pids: set[int], limit: int, notes: list) -> dict[int, list[tuple[int, int]]]:
    out, n = {}, 0
    for pid in sorted(pids):
        ranges = resident_ranges(pid)
        if n + len(ranges) > limit:
            notes.append(f"working set cut at {limit} ranges")
            ranges = ranges[: max(0, limit - n)]
        n += len(ranges)
        if ranges:
            out[pid] = ranges
    return out


def _swap_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class ResumeResult:
    prefetch_s: float
    thaw_s: float
    prefetched_bytes: int
    skipped_ranges: int
    already_running: bool = False


# Of a sandbox's memory limit, what a prefetch leaves free for the sandbox
# to run in (1/PREFETCH_HEADROOM of it).
PREFETCH_HEADROOM = 8


def prefetch_room(group: cgroup.Group) -> int | None:
    """Bytes a prefetch may bring into the group: its memory limit less what
    is charged now and a headroom; None without a limit, 0 when the group
    cannot be read (destroyed meanwhile: nothing to bring back)."""
    try:
        got = charge(group)
    except (OSError, ValueError):
        return 0
    if got is None:
        return None
    limit, charged = got
    return max(0, limit - charged - limit // PREFETCH_HEADROOM)


def _within(ranges: list[tuple[int, int]], budget: int) -> tuple[list[tuple[int, int]], int]:
    """The leading ranges that fit in `budget` bytes (the last one cut at a
    page), and the budget left."""
    out = []
    for start, length in ranges:
        if budget < native.PAGE_SIZE:
            break
        take = min(length, budget - budget % native.PAGE_SIZE)
        out.append((start, take))
        budget -= take
    return out, budget


def prefetch(working_set: dict[int, list[tuple[int, int]]], mode: str = "populate",
             group: cgroup.Group | None = None) -> tuple[int, int]:
    """Bring each process's recorded ranges back; (bytes, skipped ranges).

    With `group` (the sandbox's), no more than prefetch_room(group): a
    sandbox may hold more than its memory limit, the rest in swap
    (sandbox.swap_per_memory), and its working set records all of it;
    faulting all of it in went past the limit, and the memcg's OOM killer
    took the process being resumed. What is left out comes back on demand.

    "willneed": MADV_WILLNEED through process_madvise: swap-in into the swap
    cache and file readahead, but every page still costs the process a fault.
    "populate": read one byte per page through process_vm_readv, which
    faults the pages in *mapped* (MADV_POPULATE_READ for another process).
    "both": WILLNEED first (batched I/O for file pages on disk), then populate.
    Measured in docs/memory.md."""
    if mode not in PREFETCH_MODES:
        raise ValueError(f"prefetch mode must be one of {PREFETCH_MODES}, got {mode!r}")
    total = skipped = 0
    if mode == "none":
        return total, skipped
    budget = None if group is None else prefetch_room(group)
    for pid, ranges in working_set.items():
        if budget is not None:
            if sum(n for _, n in ranges) > budget:
                # Pages still mapped cost no room: leave them out, or they spend
                # the budget that the swapped-out ones need.
                ranges = unmapped_ranges(pid, ranges)
            ranges, budget = _within(ranges, budget)
        # process_vm_readv takes a pid, not a pidfd: a pid reused in between would
        # only get its pages faulted in (the bytes read are thrown away in C).
        with _pidfd(pid) as fd:
            if fd is None or not ranges:
                continue
            try:
                if mode in ("willneed", "both"):
                    res = native.process_madvise(fd, ranges, native.MADV_WILLNEED)
                if mode in ("populate", "both"):
                    res = native.process_populate(pid, ranges)
            except ProcessLookupError:
                continue
            total += res.bytes
            skipped += res.nr_failed
    return total, skipped


def resume(group: cgroup.Group, rec: PauseRecord | None = None, timeout: float = 5.0,
           mode: str = "populate") -> ResumeResult:
    """Prefetch (still frozen: nothing races the swap-in), then thaw. Without
    a record, the swapped and resident pages of each process are prefetched."""
    freezer = Freezer.of(group)
    if freezer.state() == "THAWED":
        return ResumeResult(0.0, 0.0, 0, 0, already_running=True)
    t0 = time.monotonic()
    done = skipped = 0
    if mode != "none":       # (thaw-only resumes skip reading the group's pids)
        members = group.pids()
        # Only pids still in the group: a record may outlive its processes (and a
        # daemon restart), and a pid number may have been reused elsewhere since.
        ws = ({p: r for p, r in rec.working_set.items() if p in members} if rec and rec.working_set
              else {p: resident_ranges(p) for p in members})
        done, skipped = prefetch(ws, mode, group)
    t1 = time.monotonic()
    freezer.thaw(timeout)
    return ResumeResult(t1 - t0, time.monotonic() - t1, done, skipped)
