"""dsecd/cpu without root: admission maths, QoS plans and the sampler on
fixture cgroup trees (plain files in a tmp dir), and the C QoS helpers on a
child process of the test."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from dsecd import cgroup
from dsecd.cpu import admission, qos, sampler

GiB = 1 << 30

# ---------------------------------------------------------------- admission


def _cap(cpu_ratio=8.0, mem_ratio=2.0, ls=1.0):
    return admission.Capacity(cpus=2, mem_total=4 * GiB, cpu_ratio=cpu_ratio, mem_ratio=mem_ratio,
                              ls_max_load=ls)


def test_capacity_is_cores_times_ratio():
    cap = _cap()
    assert cap.cpu == 16.0 and cap.memory == 8 * GiB
    assert _cap(cpu_ratio=0).cpu is None and _cap(mem_ratio=0).memory is None


def test_refusal_names_the_full_resource_with_figures():
    cap = _cap()
    req = admission.total([{"cpu": 10.0, "memory": GiB}, {"cpu": 5.5, "memory": GiB}])
    assert req == admission.Requested(15.5, 2 * GiB, 2)
    assert admission.refusal(cap, req, 0.5, GiB) is None          # exactly at capacity fits
    why = admission.refusal(cap, req, 0.6, GiB)
    assert why == {"resource": "cpu", "requested": 15.5, "asking": 0.6, "capacity": 16.0, "ratio": 8.0,
                   "cpus": 2}
    why = admission.refusal(cap, req, 0.1, 6 * GiB + 1)
    assert why["resource"] == "memory" and why["capacity"] == 8 * GiB and why["requested"] == 2 * GiB
    # Unchecked dimensions never refuse.
    assert admission.refusal(_cap(cpu_ratio=0, mem_ratio=0), req, 1000, 100 * GiB) is None


def test_a_sandbox_larger_than_the_host_never_fits():
    cap = _cap()                                 # 2 cores, 4 GiB; admits 16 CPUs and 8 GiB of requests
    assert admission.never_fits(cap, 2.0, 4 * GiB) is None        # the whole host: possible
    why = admission.never_fits(cap, 2.5, GiB)
    assert why == {"resource": "cpu", "asking": 2.5, "max": 2, "cpus": 2}
    why = admission.never_fits(cap, 1.0, 4 * GiB + 1)
    assert why["resource"] == "memory" and why["max"] == 4 * GiB
    # Capacity below the host (ratio < 1) is the bound; so is ls_max_load for LS.
    assert admission.never_fits(_cap(cpu_ratio=0.25), 0.6, GiB)["max"] == 0.5
    assert admission.never_fits(_cap(ls=0.75), 1.6, GiB, ls=True)["max"] == 1.5
    assert admission.never_fits(_cap(ls=0.75), 1.6, GiB) is None
    # Unchecked capacity still cannot give more than the host has.
    assert admission.never_fits(_cap(cpu_ratio=0, mem_ratio=0), 1000, GiB)["resource"] == "cpu"


def test_ls_admission_uses_measured_ls_load_not_requests():
    cap = _cap(ls=0.75)                                              # 1.5 cores for LS
    req = admission.Requested()
    assert admission.refusal(cap, req, 1.0, GiB, ls=True, ls_recent=0.5) is None
    why = admission.refusal(cap, req, 1.0, GiB, ls=True, ls_recent=0.6)
    assert why["resource"] == "ls_cpu" and why["capacity"] == 1.5 and why["ls_recent"] == 0.6
    assert admission.refusal(cap, req, 1.0, GiB, ls=False, ls_recent=5) is None  # BE: not this check
    assert admission.refusal(_cap(ls=0), req, 1.0, GiB, ls=True, ls_recent=5) is None


def test_admission_state_for_info():
    cap = _cap()
    st = admission.state(cap, admission.Requested(15.5, GiB, 3), 1.0, GiB)
    assert st["state"] == "full" and st["full_on"] == "cpu"
    assert st["cpu"] == {"requested": 15.5, "capacity": 16.0, "ratio": 8.0, "cpus": 2}
    assert admission.state(cap, admission.Requested(1, GiB, 1), 1.0, GiB)["state"] == "open"


# ---------------------------------------------------------------- QoS plans

CFG = {"default_qos": "be", "ls_weight_factor": 4.0, "core_sched": "auto"}


def test_plans_per_class_and_kernel():
    c = qos.Classes(CFG, cpu_idle=True, core_available=False, core_detail="EINVAL")
    be, ls = c.plan(None), c.plan("ls")
    assert (be.qos, be.cpu_idle, be.sched_idle, be.core_sched, be.weight_factor) == ("be", True, True, "off", 1.0)
    assert (ls.qos, ls.cpu_idle, ls.sched_idle, ls.core_sched, ls.weight_factor) == ("ls", False, False,
                                                                                    "unavailable", 4.0)
    assert c.info()["core_sched"] == "unavailable: EINVAL"
    assert qos.Classes(CFG, True, True, "").plan("ls").core_sched == "on"
    assert qos.Classes({**CFG, "core_sched": "off"}, True, True, "").plan("ls").core_sched == "off"
    assert qos.Classes(CFG, cpu_idle=False, core_available=False, core_detail="").plan("be").cpu_idle is False
    with pytest.raises(qos.QosError):
        c.plan("rt")
    with pytest.raises(qos.QosError):
        qos.Classes({**CFG, "default_qos": "x"}, True, True, "")


def _v1_layout(tmp_path: Path) -> cgroup.Layout:
    v1 = {c: tmp_path / c for c in ("cpu", "cpuacct", "memory")}
    return cgroup.Layout(v2=None, v2_controllers=frozenset(), v1=v1)


def _v2_layout(tmp_path: Path) -> cgroup.Layout:
    return cgroup.Layout(v2=tmp_path / "v2", v2_controllers=frozenset({"cpu", "memory"}))


def test_plan_writes_weight_then_idle(tmp_path):
    lay = _v1_layout(tmp_path)
    grp = cgroup.Group(lay, "root/sb")
    d = str(tmp_path / "cpu" / "root" / "sb")
    lim = cgroup.Limits(cpu=1.0, memory_bytes=64 << 20, pids=64)
    c = qos.Classes(CFG, True, False, "")
    ls, be = c.plan("ls"), c.plan("be")
    writes = grp.make_writes(lim, ls.weight_factor, ls.cpu_idle)
    assert (f"{d}/cpu.shares", "4096") in writes and not any(f.endswith("cpu.idle") for f, _ in writes)
    writes = grp.make_writes(lim, be.weight_factor, be.cpu_idle)
    files = [f for f, _ in writes]
    assert (f"{d}/cpu.shares", "1024") in writes and writes[-1] == (f"{d}/cpu.idle", "1")
    assert files.index(f"{d}/cpu.shares") < files.index(f"{d}/cpu.idle")


def test_plan_v2_weight_is_capped(tmp_path):
    lay = _v2_layout(tmp_path)
    d = str(tmp_path / "v2" / "root" / "sb")
    lim = cgroup.Limits(cpu=50.0, memory_bytes=64 << 20, pids=64)
    ls = qos.Classes(CFG, True, False, "").plan("ls")
    writes = cgroup.Group(lay, "root/sb").make_writes(lim, ls.weight_factor, ls.cpu_idle)
    assert (f"{d}/cpu.weight", "10000") in writes


def test_has_cpu_idle_looks_at_the_files(tmp_path):
    lay = _v2_layout(tmp_path)
    (tmp_path / "v2" / "child").mkdir(parents=True)
    assert not qos.has_cpu_idle(lay)
    (tmp_path / "v2" / "child" / "cpu.idle").write_text("0")
    assert qos.has_cpu_idle(lay)


# ---------------------------------------------------------------- sampler


def _write_v1(tmp_path, sb, usage_ns, mem, throttled=(0, 0, 0)):
    for ctrl in ("cpu", "cpuacct", "memory"):
        (tmp_path / ctrl / "root" / sb).mkdir(parents=True, exist_ok=True)
    (tmp_path / "cpuacct" / "root" / sb / "cpuacct.usage").write_text(f"{usage_ns}\n")
    (tmp_path / "memory" / "root" / sb / "memory.usage_in_bytes").write_text(f"{mem}\n")
    per, thr, t = throttled
    (tmp_path / "cpu" / "root" / sb / "cpu.stat").write_text(
        f"nr_periods {per}\nnr_throttled {thr}\nthrottled_time {t}\nnr_bursts 0\nburst_time 0\n")


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_sampler_v1_rates_throttling_and_gone_groups(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(sampler.time, "monotonic", clock)
    monkeypatch.setattr(sampler, "MEMORY_EVERY", 1)
    s = sampler.Sampler(_v1_layout(tmp_path), "root", half_life_s=1.0)
    _write_v1(tmp_path, "a", 0, 1000)
    _write_v1(tmp_path, "b", 5_000_000_000, 2000, (10, 0, 0))
    entries = {"a": ("be", False), "b": ("ls", True)}
    first = s.sample(entries)
    assert first.sandboxes["a"]["cpu_pct"] is None and first.sandboxes["a"]["memory"] == 1000
    clock.t += 2.0
    _write_v1(tmp_path, "a", 1_000_000_000, 1500)              # 1 s of CPU in 2 s: 50%
    _write_v1(tmp_path, "b", 8_000_000_000, 2000, (30, 5, 40_000_000))
    snap = s.sample(entries)
    a, b = snap.sandboxes["a"], snap.sandboxes["b"]
    assert a["cpu_pct"] == 50.0 and a["memory"] == 1500
    assert a["throttled_pct"] is None                          # no quota: cpu.stat not read
    assert b["cpu_pct"] == 150.0 and b["throttled_pct"] == 25.0 and b["throttled_ms"] == 40.0
    # Two half-lives: the recent average has moved 3/4 of the way from 0.
    assert a["recent_cores"] == pytest.approx(0.5 * 0.75, abs=1e-3)
    assert snap.host["sandbox_cores"] == {"be": 0.5, "ls": 1.5}
    # A group removed under the sampler (destroy race) reads as None, not an error.
    for ctrl in ("cpu", "cpuacct", "memory"):
        for f in (tmp_path / ctrl / "root" / "a").iterdir():
            f.unlink()
    clock.t += 1.0
    assert s.sample(entries).sandboxes["a"]["cpu_pct"] is None
    s.sample({"b": ("ls", True)})
    assert set(s.tracks) == {"b"} and set(s.files) == {"b"}


def test_hybrid_sampler_reads_cpu_from_the_v2_group_and_throttling_from_v1(tmp_path, monkeypatch):
    """Where v2 groups have cpu.stat, a hybrid host's sandbox gets no v1
    cpuacct group: its usage comes from its v2 group, its throttling (a CFS
    quota is set on v1's cpu controller) from v1's cpu.stat."""
    clock = Clock()
    monkeypatch.setattr(sampler.time, "monotonic", clock)
    monkeypatch.setattr(sampler, "MEMORY_EVERY", 1)
    v1 = {c: tmp_path / c for c in ("cpu", "cpuacct", "memory")}
    lay = cgroup.Layout(v2=tmp_path / "v2", v2_controllers=frozenset(), v1=v1, v2_cpu_stat=True)
    assert "cpuacct" not in lay.made_hierarchies and "cpuacct" in lay.hierarchies()

    def write(usage_us, throttled):
        (tmp_path / "v2" / "root" / "a").mkdir(parents=True, exist_ok=True)
        (tmp_path / "v2" / "root" / "a" / "cpu.stat").write_text(
            f"usage_usec {usage_us}\nuser_usec {usage_us}\nsystem_usec 0\nnice_usec 0\n")
        _write_v1(tmp_path, "a", 0, 4096, throttled)
        (tmp_path / "cpuacct" / "root" / "a" / "cpuacct.usage").write_text("999999999999\n")  # not read

    s = sampler.Sampler(lay, "root", half_life_s=1.0)
    write(0, (0, 0, 0))
    s.sample({"a": ("be", True)})
    clock.t += 2.0
    write(3_000_000, (20, 5, 10_000_000))
    a = s.sample({"a": ("be", True)}).sandboxes["a"]
    assert a["cpu_pct"] == 150.0 and a["memory"] == 4096
    assert a["throttled_pct"] == 25.0 and a["throttled_ms"] == 10.0


def test_sampler_reads_a_round_robin_share_past_its_budget(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(sampler.time, "monotonic", clock)
    monkeypatch.setattr(sampler, "SAMPLE_BUDGET", 3)
    s = sampler.Sampler(_v1_layout(tmp_path), "root", half_life_s=1.0)
    names = ["a", "b", "c", "d", "e"]
    for n in names:
        _write_v1(tmp_path, n, 0, 100)
    entries = {n: ("be", False) for n in names} | {"l": ("ls", False)}
    _write_v1(tmp_path, "l", 0, 100)
    s.sample(entries)                                  # all new: all read, past the budget
    reads: list[str] = []
    real = sampler.read_group
    monkeypatch.setattr(sampler, "read_group", lambda f, memory=True: reads.append(f) or real(f, memory))
    seen = set()
    for n in names:
        _write_v1(tmp_path, n, 2_000_000_000, 300)     # 2 s of CPU each
    for _ in range(3):
        clock.t += 1.0
        reads.clear()
        snap = s.sample(entries)
        assert len(reads) == 3                         # the LS one and two BE ones
        assert set(snap.sandboxes) == set(entries)     # every sandbox is in every snapshot
        seen |= {n for n in names if snap.sandboxes[n]["memory"] == 300}
    assert seen == set(names)                          # each BE one had its turn, memory included
    # Rates divide by the real interval: "a" was read after 1 s, "e" after 3.
    assert snap.sandboxes["e"]["cpu_pct"] == pytest.approx(2 / 3 * 100, abs=0.1)


def test_sampler_v2_reads_one_cpu_stat(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(sampler.time, "monotonic", clock)
    lay = _v2_layout(tmp_path)
    d = tmp_path / "v2" / "root" / "x"
    d.mkdir(parents=True)

    def write(usage_us, per, thr, thr_us, mem):
        (d / "cpu.stat").write_text(f"usage_usec {usage_us}\nuser_usec 0\nsystem_usec 0\nnr_periods {per}\n"
                                    f"nr_throttled {thr}\nthrottled_usec {thr_us}\n")
        (d / "memory.current").write_text(f"{mem}\n")

    s = sampler.Sampler(lay, "root", half_life_s=10)
    write(0, 0, 0, 0, 10)
    s.sample({"x": ("be", False)})
    clock.t += 0.5
    write(250_000, 4, 1, 3000, 20)
    x = s.sample({"x": ("be", False)}).sandboxes["x"]
    # Memory is re-read every MEMORY_EVERY passes only; CPU every pass.
    assert (x["cpu_pct"], x["throttled_pct"], x["throttled_ms"], x["memory"]) == (50.0, 25.0, 3.0, 10)
    for _ in range(sampler.MEMORY_EVERY - 2):
        clock.t += 0.5
        assert s.sample({"x": ("be", False)}).sandboxes["x"]["memory"] == 10
    clock.t += 0.5
    assert s.sample({"x": ("be", False)}).sandboxes["x"]["memory"] == 20


def test_read_psi_and_placement_hint(tmp_path):
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=12.50 avg60=3.00 avg300=1.00 total=5\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert sampler.read_psi(str(psi)) == {"some_avg10": 12.5, "some_avg60": 3.0}
    assert sampler.read_psi(str(tmp_path / "none")) is None
    snap = sampler.Snapshot(t=0.0, host={"recent_cores": 1.5, "sandbox_recent_cores": {"ls": 0.5, "be": 0.75},
                                          "psi_cpu": {"some_avg10": 20.0}})
    hint = sampler.placement_hint(snap, cpus=4)
    assert hint["other_recent_cores"] == 0.25
    assert hint["ls_headroom_cores"] == 3.25           # BE use does not count against LS
    assert hint["be_headroom_cores"] == 2.5
    assert hint["ls_score"] == pytest.approx(3.25 / 4 * 0.9, abs=1e-4)
    assert sampler.placement_hint(sampler.Snapshot(), 4) == {"ready": False}


# ---------------------------------------------------------------- C helpers


native = pytest.importorskip("dsecd.native", reason="dsecd._native is not built (pip install -e .)")


@pytest.fixture
def child():
    p = subprocess.Popen(["sleep", "30"])
    yield p.pid
    p.kill()
    p.wait()


def test_sched_set_idle_on_a_child(child):
    assert os.sched_getscheduler(child) == os.SCHED_OTHER
    native.sched_set_idle(child)
    assert os.sched_getscheduler(child) == os.SCHED_IDLE
    with pytest.raises(ProcessLookupError) as info:
        native.sched_set_idle(2**22 + 1)        # above pid_max's ceiling: never a live pid
    assert info.value.step == "sched_idle"


def test_sched_core_create_matches_the_probe(child):
    probe = native.probe_sched_core()
    if probe == 0:
        native.sched_core_create(child)         # the kernel has it: a cookie, no error
        return
    with pytest.raises(native.NativeError) as info:
        native.sched_core_create(child)
    err = info.value
    assert err.errno == probe and err.step == "sched_core"
    assert str(err).startswith(f"create core-scheduling cookie for `pid {child}`: {os.strerror(probe)}")
    if probe == errno.EINVAL:
        assert "CONFIG_SCHED_CORE" in str(err)
    elif probe == errno.ENODEV:
        assert "no SMT" in str(err)


def test_sched_core_share_from_a_missing_pid():
    probe = native.probe_sched_core()
    with pytest.raises(native.NativeError) as info:
        native.sched_core_share_from(2**22 + 1)
    # Without core scheduling the kernel rejects the command before looking up the pid.
    assert info.value.errno == (errno.ESRCH if probe == 0 else probe)
    assert info.value.step == "sched_core"


def test_admission_state_is_full_at_max_sandboxes_whatever_cpu_is_left():
    cap = _cap()
    st = admission.state(cap, admission.Requested(1, GiB, 3), 1.0, GiB, max_sandboxes=4, queued=1)
    assert (st["state"], st["full_on"]) == ("full", "sandboxes")
    assert st["sandboxes"] == {"live": 3, "call_sandboxes": 0, "queued": 1, "max": 4}
    assert admission.state(cap, admission.Requested(1, GiB, 3), 1.0, GiB, max_sandboxes=5, queued=1)["state"] == "open"


def test_admission_state_is_open_where_idle_call_sandboxes_would_give_way():
    """Idle call sandboxes go for a create that needs their room: the host
    they fill (slots, CPU or memory) is open to a sandbox of the default
    size, and info says what they hold."""
    cap = _cap()
    req = admission.Requested(15.5, GiB, 4, call_sandboxes=2)
    assert admission.state(cap, req, 1.0, GiB, max_sandboxes=4)["full_on"] == "sandboxes"
    idle = admission.Requested(1.0, GiB // 2, 1, call_sandboxes=1)
    st = admission.state(cap, req, 1.0, GiB, max_sandboxes=4, idle=idle)
    assert (st["state"], st["full_on"]) == ("open", None)
    assert st["idle_call_sandboxes"] == {"sandboxes": 1, "cpu": 1.0, "memory": GiB // 2}
    assert st["sandboxes"] == {"live": 4, "call_sandboxes": 2, "queued": 0, "max": 4}
    assert admission.state(cap, req, 1.0, GiB, max_sandboxes=4, queued=1, idle=idle)["full_on"] == "sandboxes"
