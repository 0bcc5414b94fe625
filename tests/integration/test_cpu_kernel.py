"""CPU QoS, admission and sampling against a real daemon and kernel.

What is checked is what the kernel reports: cpu.idle and cpu.shares in the
sandbox's cgroup, the scheduling policy of processes in /proc/PID/stat (field
41), usage in `top` while a sandbox really burns CPU.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from dsecd.errors import DsecError

SCHED_OTHER, SCHED_IDLE = 0, 5


def _policy(stat_line: str) -> int:
    """Field 41 (policy) of a /proc/PID/stat line; comm (field 2) may hold spaces."""
    return int(stat_line[stat_line.rindex(")") + 2:].split()[38])


def _cpu_dir(sb_info: dict) -> Path:
    dirs = sb_info["cgroups"]
    return Path(dirs.get("cpu") or dirs["unified"])


def _policies_in(sb) -> tuple[int, int]:
    """(policy of an exec'd sh, policy of a child it forks), read inside the sandbox."""
    r = sb.exec(["sh", "-c", "cat /proc/$$/stat; cat /proc/self/stat"], timeout=10)
    assert r.exit_code == 0, r.stderr
    own, child = r.stdout.decode().splitlines()
    return _policy(own), _policy(child)


def test_be_sandbox_is_idle_everywhere(client):
    sb = client.create(image="busybox", memory="64M", qos="be")
    try:
        info = sb.inspect()
        assert info["qos"] == "be" and info["core_sched"] == "off"
        assert (_cpu_dir(info) / "cpu.idle").read_text().strip() == "1"
        init = Path(f"/proc/{info['init_pid']}/stat").read_text()
        assert _policy(init) == SCHED_IDLE
        assert _policies_in(sb) == (SCHED_IDLE, SCHED_IDLE)
        # A background child outliving its exec (reparented to init) stays idle too.
        sb.exec(["sh", "-c", "sleep 30 >/dev/null 2>&1 &"], timeout=10)
        r = sb.exec(["sh", "-c", "for p in /proc/[0-9]*; do cat $p/stat; done"], timeout=10)
        sleeps = [line for line in r.stdout.decode().splitlines() if "(sleep)" in line]
        assert sleeps and all(_policy(line) == SCHED_IDLE for line in sleeps)
    finally:
        sb.destroy(force=True)


def test_ls_sandbox_normal_policy_larger_weight_core_sched_reported(client):
    feats = client.info()
    core = feats["features"]["sched_core"]
    sb = client.create(image="busybox", memory="64M", qos="ls", cpu=0.5)
    be = client.create(image="busybox", memory="64M", qos="be", cpu=0.5)
    try:
        info = sb.inspect()
        assert info["qos"] == "ls"
        assert info["core_sched"] == ("on" if core["available"] else "unavailable")
        d = _cpu_dir(info)
        assert (d / "cpu.idle").read_text().strip() == "0"
        factor = feats["cpu"]["ls_weight_factor"]
        if (d / "cpu.shares").exists():
            ls_w, be_w = int((d / "cpu.shares").read_text()), int((_cpu_dir(be.inspect()) / "cpu.shares").read_text())
            # An idle group reports the kernel's idle weight (3) whatever was written.
            assert ls_w == round(512 * factor) and be_w == 3
        assert _policies_in(sb) == (SCHED_OTHER, SCHED_OTHER)
        if not core["available"]:
            assert feats["cpu"]["core_sched"].startswith("unavailable: ")
            assert core["detail"] in feats["cpu"]["core_sched"]
    finally:
        sb.destroy(force=True)
        be.destroy(force=True)


def test_default_qos_is_be_and_bad_qos_is_refused(client):
    sb = client.create(image="busybox", memory="64M")
    try:
        assert sb.info["qos"] == "be"
    finally:
        sb.destroy(force=True)
    with pytest.raises(DsecError) as info:
        client.create(image="busybox", qos="realtime")
    assert info.value.code == "bad_request" and "qos" in info.value.message


def test_cpu_quota_per_create(client):
    hard = client.create(image="busybox", memory="64M", cpu=0.5, cpu_quota=True)
    soft = client.create(image="busybox", memory="64M", cpu=0.5)
    try:
        hd, sd = _cpu_dir(hard.inspect()), _cpu_dir(soft.inspect())
        if (hd / "cpu.cfs_quota_us").exists():
            assert int((hd / "cpu.cfs_quota_us").read_text()) == 50000
            assert int((sd / "cpu.cfs_quota_us").read_text()) == -1
        else:
            assert (hd / "cpu.max").read_text().split()[0] == "50000"
            assert (sd / "cpu.max").read_text().split()[0] == "max"
        assert hard.info["limits"]["cpu_quota"] is True and soft.info["limits"]["cpu_quota"] is False
    finally:
        hard.destroy(force=True)
        soft.destroy(force=True)


def test_admission_by_oversubscription(daemon_factory, busybox_rootfs):
    cpus = len(os.sched_getaffinity(0))
    mem_total = psutil.virtual_memory().total
    # Capacity: 1.0 CPU and 300 MiB of memory limits.
    d = daemon_factory(f"[cpu]\noversubscription = {1.0 / cpus!r}\n"
                       f"memory_oversubscription = {(300 << 20) / mem_total!r}\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        first = c.create(image="busybox", cpu=0.6, memory="128M")
        with pytest.raises(DsecError) as info:
            c.create(image="busybox", cpu=0.6, memory="16M")
        err = info.value
        assert err.code == "busy"
        assert err.detail["resource"] == "cpu" and err.detail["requested"] == 0.6
        assert err.detail["capacity"] == pytest.approx(1.0) and err.detail["asking"] == 0.6
        assert err.detail["ratio"] == pytest.approx(1.0 / cpus)
        second = c.create(image="busybox", cpu=0.3, memory="128M")       # fits: 0.9 CPU, 256M
        with pytest.raises(DsecError) as info:
            c.create(image="busybox", cpu=0.05, memory="64M")            # 320M > 300M
        assert info.value.code == "busy" and info.value.detail["resource"] == "memory"
        adm = c.info()["cpu"]["admission"]
        assert adm["state"] == "full" and adm["cpu"]["requested"] == pytest.approx(0.9)
        assert adm["memory"]["requested"] == 256 << 20
        # Destroying frees capacity at once.
        first.destroy()
        c.create(image="busybox", cpu=0.6, memory="32M").destroy()
        second.destroy()
    finally:
        c.close()


def test_top_and_info_report_sampled_use(daemon_factory, busybox_rootfs):
    d = daemon_factory("[cpu]\nsample_interval_s = 0.2\nrecent_half_life_s = 1.0\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        # The busy one is LS: a BE loop may get next to nothing on a loaded host.
        busy = c.create(image="busybox", memory="64M", qos="ls", labels={"t": "busy"})
        idle = c.create(image="busybox", memory="64M", qos="be", labels={"t": "idle"})
        busy.exec(["sh", "-c", "while :; do :; done >/dev/null 2>&1 &"], timeout=10)
        deadline = time.monotonic() + 10
        row = None
        while time.monotonic() < deadline:
            time.sleep(0.3)
            top = c.top()
            rows = {s["id"]: s for s in top["sandboxes"]}
            row = rows[busy.id]
            if row["cpu_pct"] is not None and row["cpu_pct"] > 20 and rows[idle.id]["cpu_pct"] is not None:
                break
        # One busy loop: ~100% of a CPU on a quiet host, its fair share on a busy one.
        assert row["cpu_pct"] > 20, top
        assert rows[idle.id]["cpu_pct"] < 5 and rows[idle.id]["qos"] == "be"
        assert row["qos"] == "ls" and row["memory"] > 0 and row["memory_limit"] == 64 << 20
        assert isinstance(row["swap"], int) and row["swap"] >= 0, row      # nothing pushed it out
        assert top["host"]["cpus"] == len(os.sched_getaffinity(0)) and top["host"]["cpu_pct"] > 0
        assert [s["id"] for s in c.top({"t": "idle"})["sandboxes"]] == [idle.id]
        cpu = c.info()["cpu"]
        assert cpu["used"]["sandbox_cores"]["ls"] > 0.1
        hint = cpu["placement"]
        assert hint["ready"] and hint["ls_recent_cores"] > 0.05 and hint["be_recent_cores"] < 0.05
        assert hint["ls_headroom_cores"] <= cpu["cpus"] - hint["ls_recent_cores"] + 1e-9
        # The CLI: a table, and --json after the subcommand.
        r = d.cli("top")
        assert r.returncode == 0 and busy.id in r.stdout.decode() and "QOS" in r.stdout.decode()
        assert "SWAP" in r.stdout.decode().splitlines()[1]
        r = d.cli("top", "--json")
        assert r.returncode == 0 and {s["id"] for s in json.loads(r.stdout)["sandboxes"]} == {busy.id, idle.id}
        r = d.cli("info")
        assert r.returncode == 0 and "admission" in r.stdout.decode()
        r = d.cli("create", "--image", "busybox", "--qos", "ls", "--memory", "32M")
        assert r.returncode == 0, r.stderr
        assert c.get(r.stdout.decode().strip()).info["qos"] == "ls"
    finally:
        c.close()


def test_qos_survives_a_daemon_restart(daemon_factory, busybox_rootfs):
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb_id = c.create(image="busybox", memory="64M", qos="be").id
    c.close()
    d.stop()
    d.start()
    c = d.client()
    try:
        sb = c.get(sb_id)
        assert sb.info["qos"] == "be"
        assert _policies_in(sb) == (SCHED_IDLE, SCHED_IDLE)   # the re-adopted handle still execs idle
    finally:
        c.close()
