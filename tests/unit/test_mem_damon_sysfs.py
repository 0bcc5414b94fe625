"""dsecd.mem.damon against a fake /sys/kernel/mm/damon/admin in tmp_path.

The tree is laid out like the kernel's (Linux 6.18: ops_filters, core_filters,
allow; or the older single `filters` dir without `allow`), files the kernel
fills in included. `FakeKernel` wraps the file I/O the controller uses and
does what the kernel does on the writes that have side effects: nr_* files
create numbered dirs (and delete the old ones), `state` turns kdamonds on and
off (EBUSY / EINVAL as the kernel answers), `commit` validates memcg paths,
the update_* commands fill stats and tried regions.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from dsecd.mem.damon import (
    Availability,
    DamonConfig,
    DamonController,
    DamonError,
    DamonUnavailable,
    SandboxScheme,
    SysfsIO,
    system_ram,
)

IOMEM = """\
00000000-00000fff : Reserved
00001000-0009fbff : System RAM
000a0000-000fffff : Reserved
00100000-bfffffff : System RAM
  01000000-01ffffff : Kernel code
100000000-63fffffff : System RAM
"""

SCHEME_FILES = {
    "action": "stat", "apply_interval_us": "0", "target_nid": "-1",
    "access_pattern/sz/min": "0", "access_pattern/sz/max": "0",
    "access_pattern/nr_accesses/min": "0", "access_pattern/nr_accesses/max": "0",
    "access_pattern/age/min": "0", "access_pattern/age/max": "0",
    "quotas/ms": "0", "quotas/bytes": "0", "quotas/reset_interval_ms": "0",
    "quotas/effective_bytes": "0", "quotas/goals/nr_goals": "0",
    "quotas/weights/sz_permil": "0", "quotas/weights/nr_accesses_permil": "0",
    "quotas/weights/age_permil": "0",
    "watermarks/metric": "none", "watermarks/interval_us": "0", "watermarks/high": "0",
    "watermarks/mid": "0", "watermarks/low": "0", "dests/nr_dests": "0",
    "stats/nr_tried": "0", "stats/sz_tried": "0", "stats/nr_applied": "0",
    "stats/sz_applied": "0", "stats/qt_exceeds": "0", "stats/sz_ops_filter_passed": "0",
    "tried_regions/total_bytes": "0",
}
FILTER_FILES = {"type": "anon", "matching": "N", "allow": "N", "memcg_path": "",
                "addr_start": "0", "addr_end": "0", "damon_target_idx": "0", "min": "0", "max": "0"}
CTX_FILES = {
    "operations": "vaddr", "addr_unit": "1",
    "monitoring_attrs/intervals/sample_us": "5000", "monitoring_attrs/intervals/aggr_us": "100000",
    "monitoring_attrs/intervals/update_us": "1000000",
    "monitoring_attrs/nr_regions/min": "10", "monitoring_attrs/nr_regions/max": "1000",
    "targets/nr_targets": "0", "schemes/nr_schemes": "0",
}


def _files(d: Path, files: dict[str, str]) -> None:
    for rel, value in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(value + "\n")


class FakeKernel(SysfsIO):
    """The kernel's side of DAMON sysfs, for the writes that have effects."""

    def __init__(self, root: Path, ops: str = "paddr vaddr", split_filters: bool = True,
                 memcgs: tuple[str, ...] = ()):
        self.root, self.ops, self.split, self.memcgs = root, ops, split_filters, set(memcgs)
        self.writes: list[tuple[str, str]] = []
        self.fail_next: dict[str, int] = {}     # file name -> errno to raise once
        self.stats = {"nr_tried": 7, "sz_tried": 7 << 20, "nr_applied": 3, "sz_applied": 3 << 20}
        (root / "kdamonds").mkdir(parents=True)
        (root / "kdamonds" / "nr_kdamonds").write_text("0\n")

    # -- the machine's own kdamond, made the way its owner would
    def add_foreign(self, on: bool = True) -> None:
        self.write(self.root / "kdamonds" / "nr_kdamonds", "1")
        kd = self.root / "kdamonds" / "0"
        self.write(kd / "contexts" / "nr_contexts", "1")
        (kd / "contexts" / "0" / "operations").write_text("paddr\n")
        if on:
            (kd / "state").write_text("on\n")
            (kd / "pid").write_text("71\n")
        self.writes.clear()

    def write(self, path: Path, value: str) -> None:
        self.writes.append((str(path.relative_to(self.root)), value))
        if path.name in self.fail_next:
            raise OSError(self.fail_next.pop(path.name), "injected")
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, str(path))
        handler = getattr(self, f"_on_{path.name}", None)
        if handler:
            handler(path, value.strip())
        else:
            path.write_text(value + "\n")

    def _renumber(self, parent: Path, n: int, make) -> None:
        for child in parent.iterdir():
            if child.is_dir() and child.name.isdigit():
                shutil.rmtree(child)
        for i in range(n):
            (parent / str(i)).mkdir()
            make(parent / str(i))

    def _on_nr_kdamonds(self, path: Path, value: str) -> None:
        kds = path.parent
        if any((d / "state").read_text().strip() == "on" for d in kds.iterdir() if d.is_dir()):
            raise OSError(errno.EBUSY, "kdamond running")
        self._renumber(kds, int(value), lambda d: _files(d, {"state": "off", "pid": "-1",
                                                             "refresh_ms": "0",
                                                             "contexts/nr_contexts": "0"}))
        path.write_text(value + "\n")

    def _on_nr_contexts(self, path: Path, value: str) -> None:
        if int(value) > 1:
            raise OSError(errno.EINVAL, "one context per kdamond")
        self._renumber(path.parent, int(value),
                       lambda d: _files(d, {**CTX_FILES, "avail_operations": self.ops}))
        path.write_text(value + "\n")

    def _on_nr_targets(self, path: Path, value: str) -> None:
        self._renumber(path.parent, int(value),
                       lambda d: _files(d, {"pid_target": "0", "regions/nr_regions": "0"}))
        path.write_text(value + "\n")

    def _on_nr_regions(self, path: Path, value: str) -> None:
        if path.parent.name == "regions":
            self._renumber(path.parent, int(value), lambda d: _files(d, {"start": "0", "end": "0"}))
        path.write_text(value + "\n")

    def _on_nr_schemes(self, path: Path, value: str) -> None:
        dirs = ["core_filters", "ops_filters", "filters"] if self.split else ["filters"]
        files = {**SCHEME_FILES, **{f"{d}/nr_filters": "0" for d in dirs}}
        self._renumber(path.parent, int(value), lambda d: _files(d, files))
        path.write_text(value + "\n")

    def _on_nr_filters(self, path: Path, value: str) -> None:
        files = dict(FILTER_FILES) if self.split else {k: v for k, v in FILTER_FILES.items()
                                                       if k != "allow"}
        self._renumber(path.parent, int(value), lambda d: _files(d, files))
        path.write_text(value + "\n")

    def _on_operations(self, path: Path, value: str) -> None:
        if value not in self.ops.split():
            raise OSError(errno.EINVAL, "operations")
        path.write_text(value + "\n")

    def _on_state(self, path: Path, value: str) -> None:
        kd = path.parent
        on = path.read_text().strip() == "on"
        if value == "on":
            if on:
                raise OSError(errno.EBUSY, "already on")
            self._validate(kd)
            path.write_text("on\n")
            (kd / "pid").write_text("4242\n")
        elif value == "off":
            if not on:
                raise OSError(errno.EINVAL, "not on")
            path.write_text("off\n")
            (kd / "pid").write_text("-1\n")
        elif not on:
            raise OSError(errno.EINVAL, "kdamond not running")
        elif value == "commit":
            self._validate(kd)
        elif value == "update_schemes_stats":
            for scheme in self._schemes(kd):
                for k, v in self.stats.items():
                    (scheme / "stats" / k).write_text(f"{v}\n")
        elif value == "update_schemes_tried_regions":
            for scheme in self._schemes(kd):
                regions = [(4 << 30, (4 << 30) + (2 << 20), 0, 320), (5 << 30, (5 << 30) + 4096, 0, 400)]
                self._renumber(scheme / "tried_regions", len(regions), lambda d: None)
                for i, (s, e, acc, age) in enumerate(regions):
                    _files(scheme / "tried_regions" / str(i), {
                        "start": str(s), "end": str(e), "nr_accesses": str(acc), "age": str(age),
                        "sz_filter_passed": str(e - s)})
        else:
            raise OSError(errno.EINVAL, value)

    def _schemes(self, kd: Path):
        base = kd / "contexts" / "0" / "schemes"
        n = int((base / "nr_schemes").read_text())
        return [base / str(i) for i in range(n)]

    def _validate(self, kd: Path) -> None:
        """What damon_sysfs commit checks that we can check: memcg paths exist."""
        for scheme in self._schemes(kd):
            for where in ("ops_filters", "filters"):
                base = scheme / where
                if not (base / "nr_filters").exists():
                    continue
                for i in range(int((base / "nr_filters").read_text())):
                    f = base / str(i)
                    if (f / "type").read_text().strip() == "memcg" and \
                            (f / "memcg_path").read_text().strip() not in self.memcgs:
                        raise OSError(errno.EINVAL, "no such memcg")


@pytest.fixture
def iomem(tmp_path) -> str:
    p = tmp_path / "iomem"
    p.write_text(IOMEM)
    return str(p)


def make(tmp_path, iomem, **kw) -> tuple[FakeKernel, DamonController]:
    fake_kw = {k: kw.pop(k) for k in ("ops", "split_filters", "memcgs") if k in kw}
    kernel = FakeKernel(tmp_path / "admin", **fake_kw)
    cfg = DamonConfig(enabled=True, sysfs_root=str(tmp_path / "admin"), iomem=iomem,
                      state_file=str(tmp_path / "damon.json"), **kw)
    return kernel, DamonController(cfg, kernel)


def read(kernel: FakeKernel, rel: str) -> str:
    return (kernel.root / rel).read_text().strip()


SB = [SandboxScheme("sb1", "/dsecd/sb1"), SandboxScheme("sb2", "/dsecd/sb2", quota_bytes=1 << 20)]
S0 = "kdamonds/0/contexts/0/schemes/0"


# ---------------------------------------------------------------- availability


def test_free_interface_is_available(tmp_path, iomem):
    _kernel, d = make(tmp_path, iomem)
    assert d.probe() == Availability(True, "DAMON sysfs free", (), ())


def test_missing_sysfs_is_unavailable_with_reason(tmp_path, iomem):
    d = DamonController(DamonConfig(sysfs_root=str(tmp_path / "nope"), iomem=iomem))
    a = d.probe()
    assert not a.available and "CONFIG_DAMON_SYSFS" in a.detail


def test_foreign_running_kdamond_makes_damon_unavailable_and_nothing_is_written(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, memcgs=("/dsecd/sb1",))
    kernel.add_foreign(on=True)
    a = d.probe()
    assert not a.available and a.foreign == (0,) and a.operations == ("paddr", "vaddr")
    assert "kdamond 0 is on (pid 71)" in a.detail and "EBUSY" in a.detail
    with pytest.raises(DamonUnavailable) as exc:
        d.start(SB[:1])
    assert exc.value.errno == errno.EBUSY
    assert kernel.writes == []                      # not one write, anywhere
    assert read(kernel, "kdamonds/0/state") == "on"


def test_foreign_stopped_kdamond_is_not_discarded(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem)
    kernel.add_foreign(on=False)
    a = d.probe()
    assert not a.available and "kdamond 0 is off" in a.detail and "EBUSY" not in a.detail
    with pytest.raises(DamonUnavailable):
        d.start([])
    assert kernel.writes == [] and read(kernel, "kdamonds/0/contexts/0/operations") == "paddr"


# ---------------------------------------------------------------- start, schemes, commit


def test_start_builds_kdamond_with_schemes(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, memcgs=("/dsecd/sb1", "/dsecd/sb2"))
    d.start(SB)
    assert read(kernel, "kdamonds/nr_kdamonds") == "1"
    assert read(kernel, "kdamonds/0/state") == "on" and d.running
    ctx = "kdamonds/0/contexts/0"
    assert read(kernel, f"{ctx}/operations") == "paddr"
    # System RAM >= 1 MiB from iomem, [start, end)
    assert read(kernel, f"{ctx}/targets/0/regions/nr_regions") == "2"
    assert read(kernel, f"{ctx}/targets/0/regions/1/start") == str(0x100000000)
    assert read(kernel, f"{ctx}/targets/0/regions/1/end") == str(0x640000000)
    assert read(kernel, f"{S0}/action") == "pageout"
    assert read(kernel, f"{S0}/access_pattern/age/min") == "300"      # 30 s / 100 ms
    assert read(kernel, f"{S0}/access_pattern/nr_accesses/max") == "0"
    assert read(kernel, f"{S0}/quotas/bytes") == str(64 << 20)
    assert read(kernel, f"{S0}/watermarks/metric") == "free_mem_rate"
    assert read(kernel, f"{S0}/ops_filters/nr_filters") == "1"
    f = f"{S0}/ops_filters/0"
    assert (read(kernel, f"{f}/type"), read(kernel, f"{f}/memcg_path"),
            read(kernel, f"{f}/matching"), read(kernel, f"{f}/allow")) == ("memcg", "/dsecd/sb1", "Y", "Y")
    s1 = "kdamonds/0/contexts/0/schemes/1"
    assert read(kernel, f"{s1}/quotas/bytes") == str(1 << 20)
    assert read(kernel, f"{s1}/ops_filters/0/memcg_path") == "/dsecd/sb2"
    assert json.loads((tmp_path / "damon.json").read_text())["pid"] == 4242
    # every write but nr_kdamonds stayed below kdamond 0, which dsecd made
    assert all(p.startswith("kdamonds/0/") or p == "kdamonds/nr_kdamonds" for p, _ in kernel.writes)


def test_schemes_change_with_commit(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, memcgs=("/dsecd/sb1", "/dsecd/sb2", "/dsecd/sb3"))
    d.start(SB[:1])
    kernel.writes.clear()
    d.add(SandboxScheme("sb3", "/dsecd/sb3"))
    assert ("kdamonds/0/state", "commit") in kernel.writes
    assert read(kernel, "kdamonds/0/contexts/0/schemes/nr_schemes") == "2"
    d.remove("sb1")
    assert read(kernel, f"{S0}/ops_filters/0/memcg_path") == "/dsecd/sb3"
    assert [s.key for s in d.owned.schemes] == ["sb3"]


def test_commit_einval_keeps_previous_schemes_and_names_cause(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, memcgs=("/dsecd/sb1",))
    d.start(SB[:1])
    with pytest.raises(DamonError) as exc:
        d.add(SandboxScheme("gone", "/dsecd/gone"))
    assert exc.value.errno == errno.EINVAL
    assert "/dsecd/gone" in str(exc.value) and "keeps the previous" in str(exc.value)
    assert [s.key for s in d.owned.schemes] == ["sb1"] and d.running


def test_start_failure_rolls_back_to_no_kdamond(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, memcgs=())       # sb1's memcg does not exist: `on` fails
    with pytest.raises(DamonError) as exc:
        d.start(SB[:1])
    assert exc.value.errno == errno.EINVAL
    assert read(kernel, "kdamonds/nr_kdamonds") == "0" and d.owned is None
    assert not (tmp_path / "damon.json").exists()


def test_ebusy_on_nr_kdamonds_from_a_racing_owner(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem)
    kernel.fail_next["nr_kdamonds"] = errno.EBUSY      # someone started a kdamond after probe
    with pytest.raises(DamonError) as exc:
        d.start([])
    assert exc.value.errno == errno.EBUSY and "a kdamond is running" in str(exc.value)
    assert d.owned is None


def test_guard_refuses_nr_kdamonds_while_ours_runs(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem)
    d.start([])
    with pytest.raises(DamonError) as exc:
        d._set_nr_kdamonds(2)
    assert exc.value.errno == errno.EBUSY
    assert read(kernel, "kdamonds/nr_kdamonds") == "1"


def test_guard_refuses_writes_outside_owned_kdamond(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem)
    with pytest.raises(DamonError) as exc:
        d._w(kernel.root / "kdamonds" / "0" / "state", "off")
    assert exc.value.errno == errno.EPERM and kernel.writes == []


def test_stats_and_tried_regions(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, memcgs=("/dsecd/sb1", "/dsecd/sb2"))
    d.start(SB)
    stats = d.stats()
    assert set(stats) == {"sb1", "sb2"}
    assert stats["sb1"].sz_applied == 3 << 20 and stats["sb2"].nr_tried == 7
    regions = d.tried_regions()
    assert [r.age for r in regions["sb1"]] == [320, 400]
    assert regions["sb2"][0].end - regions["sb2"][0].start == 2 << 20


def test_stop_removes_only_our_kdamond_and_is_repeatable(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, memcgs=("/dsecd/sb1",))
    d.start(SB[:1])
    d.stop()
    assert read(kernel, "kdamonds/nr_kdamonds") == "0" and not d.running
    assert not (tmp_path / "damon.json").exists()
    d.stop()
    with pytest.raises(DamonError):
        d.stats()


def test_restarted_daemon_adopts_its_kdamond(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, memcgs=("/dsecd/sb1", "/dsecd/sb2"))
    d.start(SB[:1])
    d2 = DamonController(d.cfg, kernel)                 # a new daemon, same state file
    assert d2.probe().available
    kernel.writes.clear()
    d2.start(SB)
    assert ("kdamonds/nr_kdamonds", "1") not in kernel.writes
    assert ("kdamonds/0/state", "commit") in kernel.writes
    assert [s.key for s in d2.owned.schemes] == ["sb1", "sb2"]


def test_vaddr_uses_target_filters(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, operations="vaddr")
    d.start([SandboxScheme("sb1", "/dsecd/sb1", pids=(100, 101)), SandboxScheme("sb2", "/x", pids=(200,))])
    ctx = "kdamonds/0/contexts/0"
    assert read(kernel, f"{ctx}/operations") == "vaddr"
    assert [read(kernel, f"{ctx}/targets/{i}/pid_target") for i in range(3)] == ["100", "101", "200"]
    assert read(kernel, f"{S0}/core_filters/nr_filters") == "2"
    assert read(kernel, f"{S0}/core_filters/1/damon_target_idx") == "1"
    assert read(kernel, f"{ctx}/schemes/1/core_filters/0/damon_target_idx") == "2"


def test_vaddr_missing_in_kernel_is_clear_and_rolled_back(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, operations="vaddr", ops="paddr")
    with pytest.raises(DamonError) as exc:
        d.start([])
    assert exc.value.errno == errno.EOPNOTSUPP and "avail_operations: paddr" in str(exc.value)
    assert read(kernel, "kdamonds/nr_kdamonds") == "0"


def test_old_kernel_filters_reject_other_memcgs(tmp_path, iomem):
    kernel, d = make(tmp_path, iomem, split_filters=False, memcgs=("/dsecd/sb1",))
    d.start(SB[:1])
    f = f"{S0}/filters/0"
    assert read(kernel, f"{f}/type") == "memcg" and read(kernel, f"{f}/matching") == "N"


def test_config_validation():
    with pytest.raises(ValueError):
        DamonConfig(operations="fvaddr")
    with pytest.raises(ValueError):
        DamonConfig(sample_us=10, aggr_us=5)
    with pytest.raises(ValueError):
        DamonConfig(wmark_low_permil=600)


def test_system_ram_parses_top_level_ranges(iomem):
    assert system_ram(iomem) == [(0x100000, 0xC0000000), (0x100000000, 0x640000000)]
