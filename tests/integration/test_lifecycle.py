"""Create/destroy lifecycle, daemon restarts (SIGTERM and kill -9), and leaks."""

import os
import re
import signal
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from dsecd.errors import BadRequest, Busy, Conflict, DsecError, NotFound


def host_counts(d) -> dict:
    """What a leak would show: mounts, our cgroups, our dirs, processes."""
    # Only mounts that name this daemon's dirs (as mountpoint, source or overlay
    # option): other work on the host must not count as our leak.
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for line in f if str(d.tmp) in line)
    cgroups = 0
    for top in d.cgroup_dirs():
        for _dp, dirnames, _f in os.walk(top):
            cgroups += len([n for n in dirnames if not n.startswith(".")])   # .pager: the daemon's own
    sbdir = d.state / "sandboxes"
    dirs = len([n for n in os.listdir(sbdir) if not n.startswith(".")]) if sbdir.exists() else 0   # .mnt: shared
    return {"mounts": mounts, "cgroups": cgroups, "dirs": dirs, "pids": len(session_pids())}


def session_pids() -> list[int]:
    """Processes of this test's session: the daemon and what it runs that
    did not start a session of its own (sandboxes are counted by their
    cgroups). Other work on a shared host runs in other sessions."""
    ours = os.getsid(0)
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:                 # gone meanwhile
            continue
        if int(fields[3]) == ours:      # state, ppid, pgrp, session
            pids.append(int(p))
    return pids


def wait_counts(d, want: dict, slack_pids: int = 10, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got = host_counts(d)
        ok = (got["mounts"] == want["mounts"] and got["cgroups"] == want["cgroups"]
              and got["dirs"] == want["dirs"] and got["pids"] <= want["pids"] + slack_pids)
        if ok or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


@pytest.fixture
def fresh(daemon_factory, busybox_rootfs):
    # Layer mounts outlive their last sandbox by images.layer_grace_s; with 0 the
    # sweeper unmounts them within a second, so the leak counts come back even.
    d = daemon_factory("[images]\nlayer_grace_s = 0.0\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.close()
    return d


def test_create_options_are_applied(fresh):
    c = fresh.client()
    sb = c.create(image="busybox", cpu=0.5, memory="256M", pids=128, env={"K": "V"}, labels={"job": "42"})
    info = sb.inspect()
    disk = c.info()["features"]["upperfs"]["available"]
    assert info["limits"] == {"cpu": 0.5, "memory": 256 << 20, "pids": 128, "cpu_quota": False,
                              "disk": 10 << 30 if disk else None, "disk_inodes": 1 << 20 if disk else None}
    assert info["labels"] == {"job": "42"} and info["state"] == "running"
    assert sb.exec(["sh", "-c", "echo $K"]).stdout == b"V\n"
    dirs = {k: v for k, v in info["cgroups"].items()}
    if "memory" in dirs and os.path.exists(dirs["memory"] + "/memory.limit_in_bytes"):
        assert open(dirs["memory"] + "/memory.limit_in_bytes").read().strip() == str(256 << 20)
    if "pids" in dirs:
        assert open(dirs["pids"] + "/pids.max").read().strip() == "128"
    assert [s["id"] for s in c.list({"job": "42"})] == [sb.id]
    assert c.list({"job": "43"}) == []
    sb.destroy()
    with pytest.raises(NotFound):
        sb.inspect()
    c.close()


@pytest.mark.parametrize("kw, needle", [
    ({"image": "nope"}, "no image"), ({"image": "busybox", "cpu": 0}, "cpu"),
    ({"image": "busybox", "memory": "1K"}, "memory"), ({"image": "busybox", "memory": "lots"}, "memory"),
    ({"image": "busybox", "pids": 1}, "pids"), ({"image": "busybox", "env": {"A=B": "x"}}, "environment"),
    ({"image": "busybox", "hostname": "bad host!"}, "hostname 'bad host!' is not a host name"),
    ({"image": "busybox", "hostname": "h" * 65}, "1 to 64 characters"),
])
def test_bad_create_requests(fresh, kw, needle):
    c = fresh.client()
    with pytest.raises((BadRequest, NotFound), match=needle):
        c.create(**kw)
    c.close()


def test_a_host_name_given_is_set_as_it_is(fresh):
    c = fresh.client()
    sb = c.create(image="busybox", hostname="web-1.internal")
    assert sb.exec(["hostname"]).stdout == b"web-1.internal\n"
    longest = "x" * 31 + "." + "y" * 32        # 64 bytes: the kernel's limit
    assert c.create(image="busybox", hostname=longest).exec(["hostname"]).stdout == longest.encode() + b"\n"
    c.close()


def test_a_missing_images_hint_fits_the_name_and_the_request(fresh):
    """A pull is hinted only where the name is one a pull takes, and never
    for image_rm."""
    c = fresh.client()
    with pytest.raises(NotFound, match=r"`dsec image pull nosuch` fetches one"):
        c.create(image="nosuch")
    with pytest.raises(NotFound) as info:
        c.create(image="UPPER")
    assert "dsec image ls" in str(info.value) and "image pull" not in str(info.value)
    with pytest.raises(NotFound) as info:
        c.request("image_rm", name="nosuch")
    assert info.value.message == "no image named 'nosuch' (see `dsec image ls`)"
    c.close()


@pytest.mark.attack      # fork bomb (with errno and neighbours: test_attack_exhaust.py)
def test_pids_limit_is_enforced(fresh):
    c = fresh.client()
    sb = c.create(image="busybox", pids=16)
    r = sb.exec(["sh", "-c", "for i in $(seq 40); do sleep 5 & done 2>&1; wait"], timeout=20)
    assert b"fork" in r.stdout.lower() + r.stderr.lower() or r.exit_code != 0
    sb.destroy(force=True)
    c.close()


@pytest.mark.attack
def test_memory_oom_stays_in_the_sandbox(fresh):
    c = fresh.client()
    sb = c.create(image="busybox", memory="32M")
    # One process that grows until the limit kills it. A pipeline (head | tr into a
    # shell variable) keeps other processes allocating around the kill, and in 2 of
    # ~10 full runs the OOM killer took the sandbox's init as well (it keeps
    # oom_score_adj 0 without CAP_SYS_RESOURCE).
    r = sb.exec(["sh", "-c", 'x=aaaaaaaaaaaaaaaa; while :; do x="$x$x"; done'], timeout=60)
    assert r.signal == 9 or r.exit_code != 0
    assert sb.exec(["true"]).exit_code == 0        # the sandbox (and its init) survived
    sb.destroy()
    c.close()


def test_the_first_sandbox_of_a_daemon_gets_its_swap_cap(fresh):
    """sandbox.swap_per_memory (1.0: memory + swap <= 2 x memory) is written
    where the kernel accounts swap. Whether it does was looked up, and kept
    for the daemon's life, before the first create made the sandboxes'
    parent group: on a fresh cgroup root it found no file, so no sandbox got
    the cap and one past its limit went on into the host's swap."""
    c = fresh.client()
    sb = c.create(image="busybox", memory="32M")
    mem = Path(sb.inspect()["cgroups"]["memory"])
    v2 = (mem / "memory.max").exists()
    name, want = ("memory.swap.max", 32 << 20) if v2 else ("memory.memsw.limit_in_bytes", 64 << 20)
    if not (mem.parent / name).exists():
        pytest.skip(f"the kernel does not account swap here (no {name})")
    assert int((mem / name).read_text()) == want
    sb.destroy()
    c.close()


def test_admission_says_busy_when_full(daemon_factory, busybox_rootfs):
    d = daemon_factory("[limits]\nmax_sandboxes = 2\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    a, b = c.create(image="busybox"), c.create(image="busybox")
    with pytest.raises(Busy) as e:
        c.create(image="busybox")
    assert {"sandboxes": 2, "max": 2}.items() <= e.value.detail.items()
    a.destroy()
    c.create(image="busybox").destroy()
    b.destroy()
    c.close()


def test_image_name_removed_under_a_running_sandbox(fresh):
    c = fresh.client()
    sb = c.create(image="busybox")
    c.request("image_rm", name="busybox")
    assert sb.exec(["true"]).exit_code == 0
    with pytest.raises(NotFound):
        c.create(image="busybox")
    sb.destroy()
    c.close()


def test_sandboxes_survive_sigterm_and_are_readopted(fresh):
    c = fresh.client()
    sb = c.create(image="busybox")
    sb.write_file("/work/state", b"kept")
    pid = sb.inspect()["init_pid"]
    c.close()
    fresh.stop(signal.SIGTERM)
    assert os.path.exists(f"/proc/{pid}")           # sandbox outlived the daemon
    fresh.start()
    c = fresh.client()
    sb2 = c.get(sb.id)
    assert sb2.info["state"] == "running" and sb2.info["init_pid"] == pid
    assert sb2.read_file("/work/state") == b"kept"
    assert sb2.exec(["cat", "/work/state"]).stdout == b"kept"
    sb2.destroy()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    c.close()


def test_a_new_userns_base_never_overlaps_a_live_sandboxs_ids(fresh):
    """userns_base changed across a restart: a re-adopted sandbox keeps its
    ids, and no new sandbox is given any of them while it lives."""
    c = fresh.client()
    kept = c.create(image="busybox")
    first = _host_uid_base(kept)
    c.close()
    fresh.stop(signal.SIGTERM)
    fresh.config.write_text(re.sub(r"(?m)^userns_base = \d+$", f"userns_base = {first - 32768}",
                                   fresh.config.read_text(), count=1))      # half a range lower
    fresh.start()
    c = fresh.client()
    assert c.info()["userns"]["foreign"] == 1
    for _ in range(3):
        sb = c.create(image="busybox")
        start = _host_uid_base(sb)
        assert start + 65536 <= first or start >= first + 65536, (start, first)
        sb.destroy()
    c.get(kept.id).destroy()
    assert c.info()["userns"]["foreign"] == 0
    c.close()


def _host_uid_base(sb) -> int:
    """The host uid that sandbox root is (its init's uid_map)."""
    return int(open(f"/proc/{sb.inspect()['init_pid']}/uid_map").read().split()[1])


def test_a_full_state_dir_fails_creates_and_pauses_and_changes_nothing(daemon_factory, busybox_rootfs):
    """A journal record that cannot be written undoes what it would record:
    no sandbox runs unknown to the journal, none stays frozen."""
    d = daemon_factory(start=False)
    d.state.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(d.state)], check=True)  # cleanup unmounts
    d.start()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    kept = c.create(image="busybox")
    c.pool_set("busybox", 1, 1, memory="64M")
    deadline = time.monotonic() + 30
    while not c.pool_list()[0]["ready"]:
        assert time.monotonic() < deadline, c.pool_list()
        time.sleep(0.1)
    spare = next(s["id"] for s in c.list() if s["id"] != kept.id)
    filler = d.state / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)    # until ENOSPC
    made = []
    try:
        for _ in range(100):        # the journal's last page takes a few records more
            try:
                made.append(c.create(image="busybox").id)
            except DsecError as err:
                failed = err
                break
        else:
            raise AssertionError("100 creates fit on a full state dir")
        assert failed.code != "internal" and "journal" in failed.message, failed
        assert sorted(s["id"] for s in c.list()) == sorted([kept.id, spare, *made])
        with pytest.raises(DsecError) as err:       # the pool's spare: not handed out unrecorded
            c.create(image="busybox", memory="64M", labels={"took": "1"})
        assert err.value.code != "internal" and "journal" in err.value.message, err.value
        deadline = time.monotonic() + 10
        while taken := c.list({"took": "1"}):       # it goes (its destroy runs behind the answer)
            assert time.monotonic() < deadline and taken[0]["state"] == "stopping", taken
            time.sleep(0.05)
        with pytest.raises(DsecError) as err:
            kept.pause()
        assert err.value.code != "internal" and "record the pause" in err.value.message, err.value
        assert kept.inspect()["state"] == "running" and kept.exec(["true"]).exit_code == 0
    finally:
        filler.unlink()
    for sb_id in made:
        c.get(sb_id).destroy()
    c.pool_set("busybox", 0, 0, memory="64M")
    c.create(image="busybox").destroy()
    kept.pause()
    assert kept.exec(["echo", "back"]).stdout == b"back\n"
    c.close()


def test_kill9_readopts_and_marks_dead(fresh):
    c = fresh.client()
    alive, doomed = c.create(image="busybox"), c.create(image="busybox")
    doomed_pid = doomed.inspect()["init_pid"]
    c.close()
    fresh.stop(signal.SIGKILL)
    os.kill(doomed_pid, signal.SIGKILL)              # dies while the daemon is down
    time.sleep(0.2)
    fresh.start()
    c = fresh.client()
    assert c.get(alive.id).exec(["true"]).exit_code == 0
    info = c.get(doomed.id).info
    assert info["state"] == "dead"
    assert info["death"] == {"reason": "its init exited while no daemon ran"}, info   # not our child: no status
    with pytest.raises(Conflict):
        c.get(doomed.id).exec(["true"])
    c.get(doomed.id).destroy()
    c.get(alive.id).destroy()
    c.close()


def test_sandbox_whose_init_dies_is_marked_dead_saying_how(fresh):
    c = fresh.client()
    sb = c.create(image="busybox")
    init_pid = sb.inspect()["init_pid"]
    os.kill(init_pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while sb.inspect()["state"] != "dead" and time.monotonic() < deadline:
        time.sleep(0.05)
    info = sb.inspect()
    assert info["state"] == "dead"
    assert info["death"] == {"reason": f"its init (pid {init_pid}) exited", "signal": "SIGKILL"}, info
    with pytest.raises(Conflict, match=r"is dead \(its init \(pid \d+\) exited; killed by SIGKILL\)") as err:
        sb.exec(["true"])
    assert err.value.detail["death"] == info["death"]
    assert re.search(rf"{sb.id} .* dead, SIGKILL ", fresh.cli("ps").stdout.decode())
    c.close()
    fresh.stop()
    fresh.start()                       # the record says it still
    c = fresh.client()
    assert c.get(sb.id).inspect()["death"] == info["death"]
    c.get(sb.id).destroy()
    c.close()


def test_no_leaks_after_200_cycles_and_a_kill9_mid_burst(fresh):
    before = host_counts(fresh)
    c = fresh.client()
    for _ in range(200):
        sb = c.create(image="busybox")
        assert sb.exec(["true"]).exit_code == 0
        sb.destroy()
    c.close()
    after = wait_counts(fresh, before)
    assert after["mounts"] == before["mounts"], after
    assert after["cgroups"] == before["cgroups"] == 0, after
    assert after["dirs"] == before["dirs"] == 0, after
    assert after["pids"] <= before["pids"] + 10, after

    # A burst of creates from 4 clients, and the daemon killed -9 in the middle of it.
    stop = threading.Event()

    def burst():
        try:
            cc = fresh.client()
            while not stop.is_set():
                cc.create(image="busybox")
        except Exception:
            pass

    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    fresh.stop(signal.SIGKILL)
    stop.set()
    for t in threads:
        t.join(10)
    fresh.start()
    c = fresh.client()
    made = c.list()
    assert made and all(s["state"] == "running" for s in made)
    c.destroy_all(force=True)
    c.close()
    final = wait_counts(fresh, before)
    assert final["mounts"] == before["mounts"], final
    assert final["cgroups"] == 0 and final["dirs"] == 0, final
    assert final["pids"] <= before["pids"] + 10, final


def test_kill9_mid_copy_leaves_no_temporary_file_once_readopted(fresh):
    """A daemon killed while an atomic write (`dsec cp FILE SB:/dir/`) or a
    directory copy was under way left its `.dsec-<hex>` file or
    `.dsec-put-<hex>` directory in the sandbox for good; the next daemon
    removes them once it re-adopts the sandbox, and nothing else: not the
    user's files of the same look, nor a file that took a temporary's name."""
    c = fresh.client()
    sb = c.create(image="busybox")
    sb.exec(["sh", "-c", "mkdir -p /work/.dsec-put-0123456789ab && echo mine > /work/.dsec-0123456789ab"])
    # What the SDK's write_file sends first: its temporary file, cut there.
    c.request("file_write", sandbox=sb.id, path="/work/.dsec-aaaaaaaaaaaa", data=b"part", mode=0o644,
              temporary=True)
    c.request("file_write", sandbox=sb.id, path="/work/.dsec-bbbbbbbbbbbb", data=b"part", mode=0o644,
              temporary=True)
    sb.exec(["sh", "-c", "mv /work/.dsec-bbbbbbbbbbbb /work/kept && echo user > /work/.dsec-bbbbbbbbbbbb"])
    # A directory copy whose tar stops half-way through a file: the daemon waits for the rest.
    r, w = os.pipe()
    head = tarfile.TarInfo("big")
    head.size = 1 << 20
    os.write(w, head.tobuf(tarfile.PAX_FORMAT) + b"x" * 4096)
    uploader = fresh.client()
    failed: list[BaseException] = []

    def upload() -> None:
        try:
            with os.fdopen(r, "rb") as f:
                uploader.get(sb.id).upload_tar(f, "/work/tree")
        except BaseException as err:       # the daemon's death
            failed.append(err)

    t = threading.Thread(target=upload)
    t.start()
    deadline = time.monotonic() + 10
    while not [e for e in sb.list_files("/work")
               if e["name"].startswith(".dsec-put-") and e["name"] != ".dsec-put-0123456789ab"]:
        assert time.monotonic() < deadline, sb.list_files("/work")
        time.sleep(0.05)
    fresh.stop(signal.SIGKILL)      # its connections open: a closed one has its temporaries removed at once
    c.close()
    os.close(w)
    t.join(30)
    uploader.close()
    assert failed and not t.is_alive()
    fresh.start()
    c = fresh.client()
    sb = c.get(sb.id)
    assert sorted(e["name"] for e in sb.list_files("/work")) == [".dsec-0123456789ab", ".dsec-bbbbbbbbbbbb",
                                                                  ".dsec-put-0123456789ab", "kept"]
    assert sb.read_file("/work/.dsec-bbbbbbbbbbbb") == b"user\n"
    assert os.listdir(fresh.state / "copy-temps") == []
    sb.destroy()
    c.close()
