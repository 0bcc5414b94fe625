"""cgroups: find the hierarchies, make one group per sandbox, set limits, remove.

cgroups are file writes, so this is plain Python, but for Group.make: a
sandbox's groups and their first writes in one native call (csrc/cgroupfs.c:
from Python every syscall hands the GIL over). A host may be pure
v2, pure v1 or hybrid (v1 controllers plus an empty v2 tree, like this
project's CI machines). Each controller is used from the v2 tree when that
tree has it and from its v1 mount otherwise; the v2 tree is used even when it
has no controllers, because cgroup eBPF programs attach there.

dsecd only ever creates, writes and removes groups below its own subtree
(`cgroup_root`, default "dsecd") in each hierarchy.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import native, sysfs

# Controllers a sandbox group uses; "freezer" is v1's name for v2's cgroup.freeze.
CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer")
V2 = "unified"


class CgroupError(OSError):
    pass


@dataclass(frozen=True)
class Layout:
    """Where each controller lives: {controller: mount dir}; v2 dir under key 'unified'."""

    v2: Path | None
    v2_controllers: frozenset[str]
    v1: dict[str, Path] = field(default_factory=dict)
    # v2 groups have `cgroup.freeze` (Linux 5.2+), which pause uses before a
    # v1 freezer: then a sandbox gets no v1 freezer group (one mkdir, one
    # rmdir and one cgroup.procs write less per sandbox, all under the
    # kernel's global cgroup_mutex that a burst queues on).
    v2_freeze: bool = False
    # v2 groups have `cpu.stat` with usage_usec whether or not the cpu
    # controller is enabled there (the core counts every group's CPU, Linux
    # 4.20+): then a hybrid host's sandbox gets no v1 cpuacct group either,
    # its CPU is read from its v2 group (dsecd/cpu/sampler.py).
    v2_cpu_stat: bool = False

    @property
    def mode(self) -> str:
        if self.v2 and not self.v1:
            return "v2"
        if self.v1 and not self.v2:
            return "v1"
        return "hybrid" if self.v1 else "none"

    def hierarchies(self) -> dict[str, Path]:
        """{key: mount dir} of every hierarchy a sandbox gets a group in."""
        out: dict[str, Path] = {}
        for ctrl in CONTROLLERS:
            # A controller enabled in v2 cannot also be mounted as v1.
            if ctrl in self.v1 and ctrl not in self.v2_controllers:
                out[ctrl] = self.v1[ctrl]
        if self.v2:
            out[V2] = self.v2
        # Two v1 controllers may share one mount (e.g. cpu,cpuacct): one group is enough.
        seen: dict[Path, str] = {}
        return {k: p for k, p in out.items() if seen.setdefault(p, k) == k}

    @functools.cached_property
    def made_hierarchies(self) -> dict[str, Path]:
        """The hierarchies a new sandbox group is made in: all but a v1
        freezer and a v1 cpuacct that v2's cgroup.freeze and cpu.stat make
        redundant. `hierarchies()` still lists them, so leftovers of older
        daemons are found and removed. Computed once (every Group asks); do
        not modify the dict."""
        return {k: p for k, p in self.hierarchies().items()
                if not (k == "freezer" and self.v2_freeze or k == "cpuacct" and self.v2_cpu_stat)}

    @property
    def cpu_usage_from_v2(self) -> bool:
        """Whether a sandbox's CPU use is read from its v2 group's cpu.stat."""
        return self.v2 is not None and ("cpu" in self.v2_controllers or self.v2_cpu_stat)

    def controller_dir(self, ctrl: str) -> tuple[str, Path] | None:
        """(version, mount) that serves `ctrl`, or None."""
        if self.v2 and ctrl in self.v2_controllers:
            return "v2", self.v2
        if ctrl in self.v1:
            return "v1", self.v1[ctrl]
        return None


def detect_layout(mountinfo: str = "/proc/self/mountinfo") -> Layout:
    v2: Path | None = None
    v1: dict[str, Path] = {}
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _src, opts = (right.split() + ["", "", ""])[:3]
            mnt = Path(sysfs.unescape_mount_field(left.split()[4]))
            if fstype == "cgroup2" and v2 is None:
                v2 = mnt
            elif fstype == "cgroup":
                for opt in opts.split(","):
                    if opt in CONTROLLERS:
                        v1.setdefault(opt, mnt)
    ctrls: frozenset[str] = frozenset()
    if v2 is not None:
        try:
            ctrls = frozenset((v2 / "cgroup.controllers").read_text().split())
        except OSError:
            ctrls = frozenset()
    return Layout(v2=v2, v2_controllers=ctrls, v1=v1,
                  v2_freeze=v2 is not None and _v2_groups_have(v2, "cgroup.freeze", (5, 2)),
                  v2_cpu_stat=v2 is not None and _v2_groups_have(v2, "cpu.stat", (4, 20)))


def _v2_groups_have(v2: Path, name: str, since: tuple[int, int]) -> bool:
    """Whether non-root v2 groups have the file `name`: looked up in an
    existing child group (the root may lack it), else from the kernel
    version that added it."""
    try:
        for entry in os.scandir(v2):
            if entry.is_dir(follow_symlinks=False):
                return os.path.exists(os.path.join(entry.path, name))
    except OSError:
        return False
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return (major, minor) >= since


def _write(path: str | Path, value: str) -> None:
    sysfs.write(path, value, CgroupError, {
        errno.EBUSY: "a v2 group with processes cannot enable controllers for children"
        if os.path.basename(path) == "cgroup.subtree_control" else "the group is busy"})


@dataclass(frozen=True)
class Limits:
    cpu: float            # CPUs: weight, and a hard quota when cpu_hard_quota
    memory_bytes: int
    pids: int
    cpu_hard_quota: bool = False
    cpu_period_us: int = 100000
    swap_bytes: int | None = None   # swap it may hold beyond memory_bytes; None = host swap is the bound


class Group:
    """One sandbox's group: the same relative path in every hierarchy."""

    def __init__(self, layout: Layout, rel: str):
        self.layout = layout
        self.rel = rel
        # The create path (mkdir, limits, cgroup.procs) works on plain strings:
        # Path objects were ~10% of the daemon's Python time in a burst.
        self._sdirs = {key: f"{mnt}/{rel}" for key, mnt in layout.made_hierarchies.items()}
        self._procs: list[str] | None = None

    @functools.cached_property
    def dirs(self) -> dict[str, Path]:
        """{hierarchy key: the group's dir} where it is made."""
        return {key: Path(d) for key, d in self._sdirs.items()}

    @functools.cached_property
    def legacy(self) -> list[Path]:
        """Hierarchies this group is not made in but an older daemon's may
        be: removal and kills look there too."""
        return [mnt / self.rel for key, mnt in self.layout.hierarchies().items() if key not in self._sdirs]

    def create(self) -> None:
        """mkdir in every hierarchy; on failure remove what was made."""
        made = []
        try:
            for d in self._sdirs.values():
                _mkdir_group(d)
                made.append(d)
        except OSError as err:
            for d in reversed(made):
                _rmdir_quiet(d)
            raise CgroupError(err.errno, f"create cgroup `{d}`: {os.strerror(err.errno)}") from err

    def make(self, lim: Limits, weight_factor: float = 1.0, cpu_idle: bool = False) -> None:
        """create() and set_limits(lim) in one native call (csrc/cgroupfs.c):
        each syscall from Python hands the GIL over, and a create made ~20 of
        them. `weight_factor` scales the CPU weight (an LS sandbox's),
        `cpu_idle` writes cpu.idle=1 after it (a BE sandbox's: the kernel
        refuses cpu.shares on an idle group, so the weight goes first). On
        failure nothing is left."""
        dirs = list(self._sdirs.values())
        for d in dirs:
            _ensure_parent(os.path.dirname(d))
        # After the parents exist: whether the kernel accounts swap is read
        # from the parent's files (_swap_writes), once for the daemon's life.
        writes = self.make_writes(lim, weight_factor, cpu_idle)
        try:
            try:
                native.cgroup_make(dirs, writes)
            except FileNotFoundError as err:
                if err.step != "cgroup_mkdir":
                    raise
                # A parent removed behind our back: make it again, once.
                _parents_made.difference_update(os.path.dirname(d) for d in dirs)
                for d in dirs:
                    _ensure_parent(os.path.dirname(d))
                native.cgroup_make(dirs, writes)
        except OSError as err:
            raise CgroupError(err.errno, str(err)) from err

    def procs_files(self) -> list[str]:
        # Built once: every exec in the sandbox passes them to the spawn.
        if self._procs is None:
            self._procs = [f"{d}/cgroup.procs" for d in self._sdirs.values()]
        return self._procs

    def _sdir_for(self, ctrl: str) -> tuple[str, str] | None:
        """dir_for as a string (the create path)."""
        where = self.layout.controller_dir(ctrl)
        if where is None:
            return None
        version, mnt = where
        return version, f"{mnt}/{self.rel}"

    @functools.cached_property
    def oom_events_file(self) -> str | None:
        """The file whose `oom_kill` line counts the group's OOM kills (v2
        memory.events, v1 memory.oom_control); None without a memory controller."""
        where = self._sdir_for("memory")
        if where is None:
            return None
        version, d = where
        return f"{d}/{'memory.events' if version == 'v2' else 'memory.oom_control'}"

    def dir_for(self, ctrl: str) -> tuple[str, Path] | None:
        where = self._sdir_for(ctrl)
        return None if where is None else (where[0], Path(where[1]))

    def make_writes(self, lim: Limits, weight_factor: float = 1.0, cpu_idle: bool = False) -> list[tuple[str, str]]:
        """What make() writes, in order: the limits, then cpu.idle."""
        writes = self.limit_writes(lim, weight_factor)
        if cpu_idle:
            cpu = self._sdir_for("cpu")
            if cpu is not None:
                writes.append((f"{cpu[1]}/cpu.idle", "1"))
        return writes

    def set_limits(self, lim: Limits) -> None:
        for path, value in self.limit_writes(lim):
            _write(path, value)

    def limit_writes(self, lim: Limits, weight_factor: float = 1.0) -> list[tuple[str, str]]:
        """The (file, value) writes that set `lim`, in order; the CPU weight
        scaled by `weight_factor` (an LS sandbox's, dsecd/cpu/qos.py)."""
        out = self._cpu_writes(lim, weight_factor)
        mem = self._sdir_for("memory")
        if mem:
            version, d = mem
            out.append((f"{d}/{'memory.max' if version == 'v2' else 'memory.limit_in_bytes'}", str(lim.memory_bytes)))
            if lim.swap_bytes is not None:
                out.extend(self._swap_writes(version, d, lim))
        pids = self._sdir_for("pids")
        if pids:
            out.append((f"{pids[1]}/pids.max", str(lim.pids)))
        return out

    @staticmethod
    def _swap_writes(version: str, d: str, lim: Limits) -> list[tuple[str, str]]:
        """Bound swap too: without it a sandbox's anonymous memory past its
        limit goes to swap until the host's swap is full (found by
        test_memory_oom_stays_in_the_sandbox with a host swap file on). v1
        caps memory + swap together (memsw, written after the memory limit:
        it must never be below it); v2 caps swap alone. Pause's reclaim moves
        at most the memory limit's worth to swap, so swap_bytes >= memory_bytes
        never gets in its way. Without swap accounting (no memsw files) there
        is nothing to set."""
        name = "memory.swap.max" if version == "v2" else "memory.memsw.limit_in_bytes"
        target = f"{d}/{name}"
        value = lim.swap_bytes if version == "v2" else lim.memory_bytes + lim.swap_bytes
        # Swap accounting is the same for every group of a boot: looked up once
        # per parent (all sandboxes share one), not per create. The parent's
        # own file says it (a group being made has no files yet).
        key = (os.path.dirname(d), name)
        has = _swap_files.get(key)
        if has is None:
            has = _swap_files[key] = os.path.exists(f"{os.path.dirname(d)}/{name}")
        return [(target, str(value))] if has else []

    def _cpu_writes(self, lim: Limits, weight_factor: float) -> list[tuple[str, str]]:
        cpu = self._sdir_for("cpu")
        if not cpu:
            return []
        version, d = cpu
        quota = int(lim.cpu * lim.cpu_period_us)
        if version == "v2":
            weight = max(1, min(10000, round(lim.cpu * 100)))
            out = [(f"{d}/cpu.weight", str(max(1, min(10000, round(weight * weight_factor)))))]
            if lim.cpu_hard_quota:
                out.append((f"{d}/cpu.max", f"{quota} {lim.cpu_period_us}"))
            return out
        shares = max(2, round(lim.cpu * 1024))
        out = [(f"{d}/cpu.shares", str(max(2, min(262144, round(shares * weight_factor)))))]
        if lim.cpu_hard_quota:
            out.append((f"{d}/cpu.cfs_period_us", str(lim.cpu_period_us)))
            out.append((f"{d}/cpu.cfs_quota_us", str(quota)))
        return out

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in [*self.dirs.values(), *self.legacy]:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                continue
        return out

    def kill_all(self) -> None:
        """SIGKILL every process in the group (all are the sandbox's own)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, timeout: float = 10.0) -> None:
        """rmdir in every hierarchy, waiting for exiting tasks to leave (EBUSY)."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        for d in [*self.dirs.values(), *self.legacy]:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    if err.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise CgroupError(err.errno, f"remove cgroup `{d}`: {os.strerror(err.errno)}"
                                          f" (tasks: {sorted(self.pids())[:8]})") from err
                    self.kill_all()
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)

    def exists(self) -> bool:
        return any(d.is_dir() for d in [*self.dirs.values(), *self.legacy])


# Whether the groups under a parent have their swap limit file (swap accounting on).
_swap_files: dict[tuple[str, str], bool] = {}

# Parents known to exist: every create would otherwise stat and re-mkdir the
# same few dirs in each hierarchy (~10 syscalls of a burst's every sandbox).
# A parent removed behind our back shows as ENOENT on the child's mkdir,
# which drops it from here and retries once.
_parents_made: set[str] = set()


def _ensure_parent(parent: str) -> None:
    if parent in _parents_made:
        return
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise CgroupError(err.errno, f"create cgroup `{parent}`: {os.strerror(err.errno)}") from err
    _parents_made.add(parent)


def _mkdir_group(d: str) -> None:
    parent = os.path.dirname(d)
    _ensure_parent(parent)
    try:
        os.mkdir(d)
    except FileNotFoundError:
        _parents_made.discard(parent)
        _ensure_parent(parent)
        os.mkdir(d)


def _rmdir_quiet(d: str | Path) -> None:
    try:
        os.rmdir(d)
    except OSError:
        pass


def list_children(layout: Layout, root_rel: str) -> set[str]:
    """Names of the groups directly below our subtree, in any hierarchy."""
    names: set[str] = set()
    for mnt in layout.hierarchies().values():
        try:
            names.update(e.name for e in os.scandir(mnt / root_rel) if e.is_dir())
        except FileNotFoundError:
            continue
    return names


def count_groups(layout: Layout, root_rel: str) -> int:
    """Groups below our subtree across hierarchies (the leak tests count these)."""
    n = 0
    for mnt in layout.hierarchies().values():
        for _dirpath, dirnames, _files in os.walk(mnt / root_rel):
            n += len(dirnames)
    return n
