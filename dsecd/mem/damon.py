"""DAMON controller: cold-page reclaim per sandbox memcg, through DAMON sysfs.

DAMON (Documentation/admin-guide/mm/damon/usage.rst) samples memory accesses
in a kernel thread, a *kdamond*, and applies DAMOS *schemes* ("page out
regions not accessed for 30 s") to what it finds. dsecd runs one kdamond of
its own with one scheme per sandbox: action `pageout`, an access pattern for
"cold", a memcg filter so it only touches that sandbox's pages, a quota so
reclaim never takes more than a slice of CPU, and watermarks so it only works
when free memory is getting low.

    d = DamonController(DamonConfig(enabled=True))
    a = d.probe()                 # Availability: can dsecd have DAMON here? why not?
    d.start([SandboxScheme("sb1", "/dsecd/sb1")])
    d.set_schemes([...])          # rewrite the schemes, apply with `commit`
    d.stats(); d.tried_regions()  # the kernel's per-scheme counters and regions
    d.stop()

The sysfs interface has one awkward property that decides the whole policy:
kdamonds are made only by writing `kdamonds/nr_kdamonds`, which deletes and
recreates *every* kdamond directory, and which the kernel refuses (EBUSY)
while any kdamond runs. So dsecd can only have DAMON when nobody else uses
it: `probe` reports it unavailable, with the reason, as soon as a kdamond
exists that dsecd did not create (on the CI machines kdamond 0 runs for the
host). Every write goes through one guard that refuses any path outside the
kdamonds dsecd created, and `nr_kdamonds` is only written when every
existing kdamond is dsecd's and none runs.

A restarted daemon finds its kdamond again through `state_file` (index and
kdamond pid), so a daemon restart does not make DAMON look foreign.

Writes to `state` block until the kdamond acts on them (an aggregation
interval or more for `update_schemes_tried_regions`): call this module from
worker threads.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..feature import Feature

DEFAULT_ROOT = "/sys/kernel/mm/damon/admin"
OPERATIONS = ("paddr", "vaddr")
STAT_FIELDS = ("nr_tried", "sz_tried", "nr_applied", "sz_applied", "qt_exceeds",
               "sz_ops_filter_passed")
REGION_FIELDS = ("start", "end", "nr_accesses", "age", "sz_filter_passed")


class DamonError(OSError):
    pass


class DamonUnavailable(DamonError):
    pass


class SysfsIO:
    """The only code that touches the files: tests wrap it to act as the kernel."""

    def read(self, path: Path) -> str:
        return path.read_text()

    def write(self, path: Path, value: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def exists(self, path: Path) -> bool:
        return path.exists()


@dataclass(frozen=True)
class DamonConfig:
    enabled: bool = False
    sysfs_root: str = DEFAULT_ROOT
    operations: str = "paddr"            # "vaddr" where the kernel offers it
    sample_us: int = 5_000
    aggr_us: int = 100_000
    update_us: int = 1_000_000
    min_nr_regions: int = 10
    max_nr_regions: int = 1_000
    cold_age_us: int = 30_000_000        # not accessed for this long = cold
    max_nr_accesses: int = 0             # accesses per aggregation interval still "cold"
    min_region_bytes: int = 4096
    quota_ms: int = 10                   # CPU time per reset interval, per scheme
    quota_bytes: int = 64 << 20          # bytes paged out per reset interval, per scheme
    quota_reset_ms: int = 1_000
    quota_weight_age_permil: int = 1000  # oldest regions first when the quota bites
    wmark_metric: str = "free_mem_rate"  # "none" = always active
    wmark_interval_us: int = 5_000_000
    wmark_high_permil: int = 500         # free memory above 50%: schemes idle
    wmark_mid_permil: int = 400          # below 40%: schemes work
    wmark_low_permil: int = 50           # below 5%: idle again (direct reclaim's turn)
    state_file: str = ""                 # where the owned kdamond is recorded ("" = nowhere)
    iomem: str = "/proc/iomem"

    def __post_init__(self):
        # Named as the [memory.damon] keys they come from: the memory service
        # turns these into the config error that stops the start.
        if self.operations not in OPERATIONS:
            raise ValueError(f"memory.damon.operations must be one of {OPERATIONS}, got {self.operations!r}")
        if not self.sample_us <= self.aggr_us <= self.update_us:
            raise ValueError(f"memory.damon.sample_us <= aggr_us <= update_us must hold, got {self.sample_us}, "
                             f"{self.aggr_us}, {self.update_us}")
        if not 0 < self.min_nr_regions <= self.max_nr_regions:
            raise ValueError(f"memory.damon.min_nr_regions must be above 0 and at most max_nr_regions, got "
                             f"{self.min_nr_regions} and {self.max_nr_regions}")
        if not self.wmark_low_permil <= self.wmark_mid_permil <= self.wmark_high_permil <= 1000:
            raise ValueError(f"memory.damon.wmark_low <= wmark_mid <= wmark_high <= 1000 must hold (per mille), "
                             f"got {self.wmark_low_permil}, {self.wmark_mid_permil}, {self.wmark_high_permil}")
        if self.wmark_metric not in ("none", "free_mem_rate"):
            raise ValueError(f"memory.damon.wmark_metric must be none or free_mem_rate, got {self.wmark_metric!r}")

    @classmethod
    def from_section(cls, d: dict, state_dir: str | os.PathLike) -> DamonConfig:
        """From the [memory.damon] table of the daemon config (docs/memory.md)."""
        from ..config import parse_size

        plain = ("enabled", "sysfs_root", "operations", "sample_us", "aggr_us", "update_us",
                 "min_nr_regions", "max_nr_regions", "max_nr_accesses", "quota_ms",
                 "quota_reset_ms", "wmark_metric", "wmark_interval_us")
        return cls(**{k: d[k] for k in plain},
                   cold_age_us=int(float(d["cold_age_s"]) * 1_000_000),
                   quota_bytes=parse_size(d["quota_bytes"]),
                   wmark_high_permil=int(d["wmark_high"]), wmark_mid_permil=int(d["wmark_mid"]),
                   wmark_low_permil=int(d["wmark_low"]),
                   state_file=os.path.join(os.fspath(state_dir), "damon.json"))

    @property
    def cold_age(self) -> int:
        """The age threshold in aggregation intervals, DAMON's unit."""
        return max(1, self.cold_age_us // self.aggr_us)


@dataclass(frozen=True)
class SandboxScheme:
    key: str                       # the sandbox id
    memcg_path: str                # its memory cgroup, from the memory hierarchy's root
    pids: tuple[int, ...] = ()     # vaddr only: the processes to monitor
    quota_bytes: int | None = None


@dataclass(frozen=True)
class Availability(Feature):
    """Feature, plus what the probe found of DAMON's kdamonds."""

    foreign: tuple[int, ...] = ()           # kdamond indexes dsecd did not create
    operations: tuple[str, ...] = ()        # avail_operations, where readable


@dataclass(frozen=True)
class SchemeStats:
    nr_tried: int = 0
    sz_tried: int = 0
    nr_applied: int = 0
    sz_applied: int = 0
    qt_exceeds: int = 0
    sz_ops_filter_passed: int = 0


@dataclass(frozen=True)
class TriedRegion:
    start: int
    end: int
    nr_accesses: int
    age: int
    sz_filter_passed: int = 0


@dataclass
class _Owned:
    index: int
    pid: int = 0
    schemes: list[SandboxScheme] = field(default_factory=list)


class DamonController:
    def __init__(self, cfg: DamonConfig, io: SysfsIO | None = None):
        self.cfg = cfg
        self.io = io or SysfsIO()
        self.root = Path(cfg.sysfs_root)
        self.kdamonds = self.root / "kdamonds"
        self.owned: _Owned | None = None

    # ------------------------------------------------------------ probe

    def probe(self) -> Availability:
        """Whether dsecd can run its own kdamond here, and why not. Reads only."""
        nr_file = self.kdamonds / "nr_kdamonds"
        if not self.io.exists(nr_file):
            return Availability(False, f"no DAMON sysfs interface at {self.root} "
                                "(kernel without CONFIG_DAMON_SYSFS?)")
        try:
            n = int(self._read(nr_file))
        except (DamonError, ValueError) as err:
            return Availability(False, f"cannot read {nr_file}: {err}")
        mine = self._recorded()
        foreign, described = [], []
        for i in range(n):
            state = self._read_quiet(self._kd(i) / "state")
            pid = self._read_quiet(self._kd(i) / "pid")
            if mine is not None and mine.get("index") == i and state == "on" \
                    and pid == str(mine.get("pid")):
                continue
            foreign.append(i)
            described.append(f"kdamond {i} is {state or '?'}" + (f" (pid {pid})" if state == "on" else ""))
        ops = self._avail_operations(range(n))
        if foreign:
            running = any("is on" in d for d in described)
            why = (f"{'; '.join(described)}, not created by dsecd: DAMON sysfs makes kdamonds only "
                   "by rewriting kdamonds/nr_kdamonds, which "
                   + ("the kernel refuses (EBUSY) while a kdamond runs and which "
                      if running else "")
                   + "would discard the other owner's kdamonds; DAMON is left to its owner")
            return Availability(False, f"DAMON interface busy: {why}", tuple(foreign), ops)
        if n and mine is None:
            return Availability(False, "DAMON interface busy: kdamonds exist that dsecd did not "
                                "create", tuple(range(n)), ops)
        return Availability(True, "DAMON sysfs free" if n == 0 else
                            f"dsecd's kdamond {mine['index']} found running (pid {mine['pid']})",
                            (), ops)

    def _avail_operations(self, indexes) -> tuple[str, ...]:
        for i in indexes:
            text = self._read_quiet(self._kd(i) / "contexts" / "0" / "avail_operations")
            if text:
                return tuple(text.split())
        return ()

    # ------------------------------------------------------------ start / stop

    def start(self, schemes: list[SandboxScheme] = ()) -> None:
        """Create (or re-adopt) dsecd's kdamond, set it up, turn it on."""
        if self.owned is not None:
            self.set_schemes(list(schemes))
            return
        avail = self.probe()
        if not avail.available:
            raise DamonUnavailable(errno.EBUSY, avail.detail)
        recorded = self._recorded()
        n = int(self._read(self.kdamonds / "nr_kdamonds"))
        if n and recorded is not None:                   # our kdamond from a previous daemon
            self.owned = _Owned(recorded["index"], recorded["pid"])
            self.set_schemes(list(schemes))
            return
        self._set_nr_kdamonds(1)
        self.owned = _Owned(0)
        try:
            self._setup_context()
            self._write_schemes(list(schemes))
            self._w(self._kd(0) / "state", "on")
            self.owned.pid = int(self._read(self._kd(0) / "pid"))
            self.owned.schemes = list(schemes)
            self._record()
        except BaseException:
            self._discard()
            raise

    def stop(self) -> None:
        """Turn dsecd's kdamond off and remove it; safe to repeat."""
        if self.owned is None:
            return
        if self._read_quiet(self._kd(self.owned.index) / "state") == "on":
            self._w(self._kd(self.owned.index) / "state", "off")
        self._discard()

    def _discard(self) -> None:
        """nr_kdamonds back to 0: only ever after our kdamond is off, and only
        if it is still the only one (nobody can add one while ours runs)."""
        kd = self._kd(self.owned.index)
        try:
            if self._read_quiet(kd / "state") == "on":
                self._w(kd / "state", "off")
            if self._read_quiet(self.kdamonds / "nr_kdamonds") == "1" and self.owned.index == 0:
                self._set_nr_kdamonds(0)
        finally:
            self.owned = None
            self._forget()

    @property
    def running(self) -> bool:
        return self.owned is not None and \
            self._read_quiet(self._kd(self.owned.index) / "state") == "on"

    # ------------------------------------------------------------ schemes

    def set_schemes(self, schemes: list[SandboxScheme]) -> None:
        """Replace every scheme and apply them with `commit`. On EINVAL the
        kernel keeps running the previous schemes; the error names the memcgs
        that no longer exist when that is the cause."""
        owned = self._need_owned()
        self._write_schemes(schemes)
        try:
            self._w(self._kd(owned.index) / "state", "commit")
        except DamonError as err:
            if err.errno == errno.EINVAL:
                raise DamonError(errno.EINVAL, f"{err.strerror}; {self._diagnose(schemes)}") from err
            raise
        owned.schemes = list(schemes)

    def add(self, scheme: SandboxScheme) -> None:
        owned = self._need_owned()
        self.set_schemes([s for s in owned.schemes if s.key != scheme.key] + [scheme])

    def remove(self, key: str) -> None:
        owned = self._need_owned()
        self.set_schemes([s for s in owned.schemes if s.key != key])

    def _diagnose(self, schemes: list[SandboxScheme]) -> str:
        return ("the kernel refused the new schemes and keeps the previous ones (a memcg_path "
                "that names no memory cgroup, e.g. a sandbox destroyed meanwhile: "
                f"{[s.memcg_path for s in schemes]}, or an out-of-range value)")

    # ------------------------------------------------------------ results

    def stats(self) -> dict[str, SchemeStats]:
        """Per sandbox, the kernel's counters (after `update_schemes_stats`)."""
        owned = self._need_owned()
        kd = self._kd(owned.index)
        self._w(kd / "state", "update_schemes_stats")
        out = {}
        for i, s in enumerate(owned.schemes):
            d = self._scheme_dir(i) / "stats"
            out[s.key] = SchemeStats(**{f: self._int_quiet(d / f) for f in STAT_FIELDS})
        return out

    def tried_regions(self) -> dict[str, list[TriedRegion]]:
        """Per sandbox, the regions its scheme was tried on in the last
        aggregation (`update_schemes_tried_regions`; blocks until filled)."""
        owned = self._need_owned()
        self._w(self._kd(owned.index) / "state", "update_schemes_tried_regions")
        out = {}
        for i, s in enumerate(owned.schemes):
            d = self._scheme_dir(i) / "tried_regions"
            regions, j = [], 0
            while self.io.exists(d / str(j)):
                r = d / str(j)
                regions.append(TriedRegion(**{f: self._int_quiet(r / f) for f in REGION_FIELDS}))
                j += 1
            out[s.key] = regions
        return out

    # ------------------------------------------------------------ writing the tree

    def _setup_context(self) -> None:
        cfg, ctx = self.cfg, self._ctx()
        self._w(self._kd(0) / "contexts" / "nr_contexts", "1")
        ops = self._read(ctx / "avail_operations").split()
        if cfg.operations not in ops:
            raise DamonError(errno.EOPNOTSUPP, f"DAMON operations {cfg.operations!r} not offered "
                             f"by this kernel (avail_operations: {' '.join(ops)})")
        self._w(ctx / "operations", cfg.operations)
        attrs = ctx / "monitoring_attrs"
        self._w(attrs / "intervals" / "sample_us", str(cfg.sample_us))
        self._w(attrs / "intervals" / "aggr_us", str(cfg.aggr_us))
        self._w(attrs / "intervals" / "update_us", str(cfg.update_us))
        # max before min: the kernel checks min <= max on each write.
        self._w(attrs / "nr_regions" / "max", str(cfg.max_nr_regions))
        self._w(attrs / "nr_regions" / "min", str(cfg.min_nr_regions))
        if cfg.operations == "paddr":
            self._write_paddr_target()

    def _write_paddr_target(self) -> None:
        """paddr has no address space to discover: give it System RAM."""
        targets = self._ctx() / "targets"
        self._w(targets / "nr_targets", "1")
        ranges = system_ram(self.cfg.iomem)
        if not ranges:
            raise DamonError(errno.ENOENT, f"no System RAM ranges in {self.cfg.iomem} (not root?)")
        regions = targets / "0" / "regions"
        self._w(regions / "nr_regions", str(len(ranges)))
        for i, (start, end) in enumerate(ranges):
            self._w(regions / str(i) / "start", str(start))
            self._w(regions / str(i) / "end", str(end))

    def _write_vaddr_targets(self, schemes: list[SandboxScheme]) -> dict[str, list[int]]:
        targets = self._ctx() / "targets"
        pids = [p for s in schemes for p in s.pids]
        self._w(targets / "nr_targets", str(len(pids)))
        index: dict[str, list[int]] = {}
        for i, pid in enumerate(pids):
            self._w(targets / str(i) / "pid_target", str(pid))
        i = 0
        for s in schemes:
            index[s.key] = list(range(i, i + len(s.pids)))
            i += len(s.pids)
        return index

    def _write_schemes(self, schemes: list[SandboxScheme]) -> None:
        keys = [s.key for s in schemes]
        if len(set(keys)) != len(keys):
            raise ValueError("one scheme per sandbox: duplicate keys")
        targets = self._write_vaddr_targets(schemes) if self.cfg.operations == "vaddr" else {}
        # nr_schemes recreates every scheme dir with defaults: rewrite them all.
        self._w(self._ctx() / "schemes" / "nr_schemes", str(len(schemes)))
        for i, s in enumerate(schemes):
            self._write_scheme(i, s, targets.get(s.key, []))

    def _write_scheme(self, i: int, s: SandboxScheme, target_idx: list[int]) -> None:
        cfg, d = self.cfg, self._scheme_dir(i)
        self._w(d / "action", "pageout")
        pattern = {"sz": (cfg.min_region_bytes, 2**64 - 1),
                   "nr_accesses": (0, cfg.max_nr_accesses), "age": (cfg.cold_age, 2**32 - 1)}
        for name, (lo, hi) in pattern.items():
            self._w(d / "access_pattern" / name / "max", str(hi))
            self._w(d / "access_pattern" / name / "min", str(lo))
        q = d / "quotas"
        self._w(q / "ms", str(cfg.quota_ms))
        self._w(q / "bytes", str(s.quota_bytes if s.quota_bytes is not None else cfg.quota_bytes))
        self._w(q / "reset_interval_ms", str(cfg.quota_reset_ms))
        self._w(q / "weights" / "sz_permil", "0")
        self._w(q / "weights" / "nr_accesses_permil", "0")
        self._w(q / "weights" / "age_permil", str(cfg.quota_weight_age_permil))
        w = d / "watermarks"
        self._w(w / "metric", cfg.wmark_metric)
        self._w(w / "interval_us", str(cfg.wmark_interval_us))
        for name in ("high", "mid", "low"):
            self._w(w / name, str(getattr(cfg, f"wmark_{name}_permil")))
        self._write_filters(d, s, target_idx)

    def _write_filters(self, d: Path, s: SandboxScheme, target_idx: list[int]) -> None:
        """Only this sandbox's pages. Linux >= 6.15 splits filters into
        ops_filters (memcg) and core_filters (target); >= 6.14 has `allow`,
        where one allow filter means "only these" (pages no filter matched
        get the opposite of the last filter). Before `allow`, filters only
        reject: "reject pages NOT in this memcg" is the same thing."""
        split = self.io.exists(d / "ops_filters" / "nr_filters")
        specs: list[tuple[str, dict]] = []
        if self.cfg.operations == "paddr":
            specs.append(("ops_filters" if split else "filters",
                          {"type": "memcg", "memcg_path": s.memcg_path}))
        else:
            specs += [("core_filters" if split else "filters",
                       {"type": "target", "damon_target_idx": str(t)}) for t in target_idx]
        groups: dict[str, list[dict]] = {}
        for where, spec in specs:
            groups.setdefault(where, []).append(spec)
        for where, items in groups.items():
            self._w(d / where / "nr_filters", str(len(items)))
            has_allow = self.io.exists(d / where / "0" / "allow")
            if not has_allow and len(items) > 1:
                raise DamonError(errno.EOPNOTSUPP, "several target filters per scheme need "
                                 "DAMOS allow filters (Linux >= 6.14)")
            for j, spec in enumerate(items):
                f = d / where / str(j)
                self._w(f / "type", spec.pop("type"))
                for key, value in spec.items():
                    self._w(f / key, value)
                if has_allow:
                    self._w(f / "matching", "Y")
                    self._w(f / "allow", "Y")
                else:
                    self._w(f / "matching", "N")

    # ------------------------------------------------------------ the guard

    def _kd(self, i: int) -> Path:
        return self.kdamonds / str(i)

    def _ctx(self) -> Path:
        return self._kd(self._need_owned().index) / "contexts" / "0"

    def _scheme_dir(self, i: int) -> Path:
        return self._ctx() / "schemes" / str(i)

    def _need_owned(self) -> _Owned:
        if self.owned is None:
            raise DamonError(errno.ENODEV, "dsecd has no kdamond running (start() first)")
        return self.owned

    def _w(self, path: Path, value: str) -> None:
        """Every write but nr_kdamonds: only below the kdamond dsecd made."""
        owned = self.owned
        if owned is None or ".." in path.parts or not path.is_relative_to(self._kd(owned.index)):
            raise DamonError(errno.EPERM, f"refusing to write `{path}`: not under a kdamond "
                             "dsecd created")
        self._write(path, value)

    def _set_nr_kdamonds(self, n: int) -> None:
        """Re-checked right before the write: never while any kdamond runs,
        never when one exists that is not ours (the write would discard it)."""
        nr_file = self.kdamonds / "nr_kdamonds"
        current = int(self._read(nr_file))
        ours = {self.owned.index} if self.owned is not None else set()
        for i in range(current):
            if i not in ours:
                raise DamonError(errno.EPERM, f"refusing to write `{nr_file}`: kdamond {i} is "
                                 "not dsecd's")
            if self._read_quiet(self._kd(i) / "state") == "on":
                raise DamonError(errno.EBUSY, f"refusing to write `{nr_file}`: kdamond {i} runs")
        self._write(nr_file, str(n))

    def _write(self, path: Path, value: str) -> None:
        try:
            self.io.write(path, value)
        except OSError as err:
            hint = {errno.EBUSY: "; a kdamond is running", errno.EINVAL: "; value refused"}
            raise DamonError(err.errno, f"write {value!r} to `{path}`: {os.strerror(err.errno)}"
                             f"{hint.get(err.errno, '')}") from err

    def _read(self, path: Path) -> str:
        try:
            return self.io.read(path).strip()
        except OSError as err:
            raise DamonError(err.errno, f"read `{path}`: {os.strerror(err.errno)}") from err

    def _read_quiet(self, path: Path) -> str:
        try:
            return self.io.read(path).strip()
        except OSError:
            return ""

    def _int_quiet(self, path: Path) -> int:
        try:
            return int(self._read_quiet(path) or 0)
        except ValueError:
            return 0

    # ------------------------------------------------------------ ownership record

    def _recorded(self) -> dict | None:
        if not self.cfg.state_file:
            return None
        try:
            d = json.loads(Path(self.cfg.state_file).read_text())
        except (OSError, ValueError):
            return None
        return d if d.get("root") == str(self.root) else None

    def _record(self) -> None:
        if self.cfg.state_file and self.owned is not None:
            tmp = Path(self.cfg.state_file + ".tmp")
            tmp.write_text(json.dumps({"root": str(self.root), "index": self.owned.index,
                                       "pid": self.owned.pid}))
            os.replace(tmp, self.cfg.state_file)

    def _forget(self) -> None:
        if self.cfg.state_file:
            try:
                os.unlink(self.cfg.state_file)
            except FileNotFoundError:
                pass


def system_ram(iomem: str = "/proc/iomem", min_bytes: int = 1 << 20) -> list[tuple[int, int]]:
    """Top-level "System RAM" ranges [start, end) of at least min_bytes.
    /proc/iomem shows zeros to non-root readers: those give an empty list."""
    out = []
    with open(iomem) as f:
        for line in f:
            if line.startswith(" ") or not line.rstrip().endswith(": System RAM"):
                continue
            lo, _, hi = line.split(" : ")[0].partition("-")
            start, end = int(lo, 16), int(hi, 16) + 1
            if end - start >= min_bytes:
                out.append((start, end))
    return out
