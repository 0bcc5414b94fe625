"""cgroup hierarchy detection and limit files, on fixture trees (no root)."""

from pathlib import Path

import pytest

from dsecd import cgroup

FIX = Path(__file__).parent / "fixtures"


def test_hybrid_uses_v1_controllers_and_the_empty_v2_tree(monkeypatch):
    monkeypatch.setattr(Path, "read_text", lambda self: "" if self.name == "cgroup.controllers" else "")
    lay = cgroup.detect_layout(str(FIX / "mountinfo-hybrid"))
    assert lay.mode == "hybrid"
    h = lay.hierarchies()
    assert set(h) == {"cpu", "cpuacct", "memory", "pids", "freezer", "unified"}
    assert lay.controller_dir("memory") == ("v1", Path("/sys/fs/cgroup/memory"))


def test_hybrid_makes_no_v1_groups_that_v2_files_replace():
    """v2's cgroup.freeze and cpu.stat stand in for v1's freezer and cpuacct;
    both are still listed, so an older daemon's groups are found and removed."""
    v1 = {c: Path(f"/cg/{c}") for c in ("cpu", "cpuacct", "memory", "pids", "freezer")}
    old = cgroup.Layout(v2=Path("/cg/unified"), v2_controllers=frozenset(), v1=v1)
    new = cgroup.Layout(v2=Path("/cg/unified"), v2_controllers=frozenset(), v1=v1, v2_freeze=True,
                        v2_cpu_stat=True)
    assert set(old.made_hierarchies) == set(new.hierarchies()) == {*v1, "unified"}
    assert set(new.made_hierarchies) == {"cpu", "memory", "pids", "unified"}
    assert not old.cpu_usage_from_v2 and new.cpu_usage_from_v2
    # cpu and cpuacct on one v1 mount, v2 groups without cpu.stat: cpuacct.usage it is.
    joint = {**v1, "cpuacct": v1["cpu"]}
    assert not cgroup.Layout(v2=Path("/cg/unified"), v2_controllers=frozenset(), v1=joint).cpu_usage_from_v2
    assert [str(p) for p in cgroup.Group(new, "dsecd/x").legacy] == ["/cg/cpuacct/dsecd/x", "/cg/freezer/dsecd/x"]


def test_pure_v2_uses_v2_for_enabled_controllers(monkeypatch):
    monkeypatch.setattr(Path, "read_text", lambda self: "cpu memory pids io")
    lay = cgroup.detect_layout(str(FIX / "mountinfo-v2"))
    assert lay.mode == "v2"
    assert lay.hierarchies() == {"unified": Path("/sys/fs/cgroup")}
    assert lay.controller_dir("cpu") == ("v2", Path("/sys/fs/cgroup"))
    assert lay.controller_dir("freezer") is None


def test_joined_v1_mount_gets_one_group():
    lay = cgroup.detect_layout(str(FIX / "mountinfo-v1-joined"))
    assert lay.mode == "v1"
    h = lay.hierarchies()
    assert list(h.values()).count(Path("/sys/fs/cgroup/cpu,cpuacct")) == 1


def _fake_tree(tmp_path, version):
    if version == "v2":
        lay = cgroup.Layout(v2=tmp_path / "v2", v2_controllers=frozenset({"cpu", "memory", "pids"}))
    else:
        lay = cgroup.Layout(v2=None, v2_controllers=frozenset(),
                            v1={c: tmp_path / c for c in ("cpu", "memory", "pids")})
    for d in lay.hierarchies().values():
        d.mkdir(parents=True)
    return lay


@pytest.mark.parametrize("version, files", [
    ("v1", {"cpu/dsecd/x/cpu.shares": "512", "cpu/dsecd/x/cpu.cfs_quota_us": "50000",
            "cpu/dsecd/x/cpu.cfs_period_us": "100000",
            "memory/dsecd/x/memory.limit_in_bytes": str(256 << 20), "pids/dsecd/x/pids.max": "64"}),
    ("v2", {"v2/dsecd/x/cpu.weight": "50", "v2/dsecd/x/cpu.max": "50000 100000",
            "v2/dsecd/x/memory.max": str(256 << 20), "v2/dsecd/x/pids.max": "64"}),
])
def test_limits_written_to_the_right_files(tmp_path, version, files):
    lay = _fake_tree(tmp_path, version)
    g = cgroup.Group(lay, "dsecd/x")
    g.create()
    # Regular files stand in for the kernel's control files.
    for name in files:
        (tmp_path / name).touch()
    g.set_limits(cgroup.Limits(cpu=0.5, memory_bytes=256 << 20, pids=64, cpu_hard_quota=True))
    for name, value in files.items():
        assert (tmp_path / name).read_text() == value, name


def test_write_error_names_the_file(tmp_path):
    lay = _fake_tree(tmp_path, "v1")
    g = cgroup.Group(lay, "dsecd/y")
    g.create()
    with pytest.raises(cgroup.CgroupError, match="cpu.shares"):
        g.set_limits(cgroup.Limits(cpu=1, memory_bytes=1 << 30, pids=10))  # files absent -> ENOENT


def test_create_rolls_back_on_failure(tmp_path):
    lay = _fake_tree(tmp_path, "v1")
    (tmp_path / "pids" / "dsecd").mkdir()
    (tmp_path / "pids" / "dsecd" / "z").mkdir()      # pre-existing: mkdir fails EEXIST
    g = cgroup.Group(lay, "dsecd/z")
    with pytest.raises(cgroup.CgroupError, match="create cgroup"):
        g.create()
    assert not (tmp_path / "cpu" / "dsecd" / "z").exists()
