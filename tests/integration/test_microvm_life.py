"""A microVM's life beyond its requests: daemon restarts, job pause and
resume, a guest that panics or hangs, QEMU killed by its memory limit, and
what the guest cannot reach of the host.

One or two VMs at a time (TCG); no timings asserted, only bounds generous
enough for a loaded 2-core host. The tests share one daemon (its first VM
builds the template, later ones restore it in well under a second instead
of a boot of seconds each), each with a client of its own: the restart test
stops and starts that daemon. Each test destroys its own VMs.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import microvm_daemon, skip_unless_microvm

import dsecd
from dsecd.errors import DsecError

WATCHDOG = "[microvm]\nwatchdog_interval_s = 1.0\nwatchdog_timeout_s = 5.0\n"


@pytest.fixture(scope="module")
def watchdog_daemon(busybox_rootfs):
    """The module's daemon (watchdog every second, a hang after 5 s), with
    busybox and the run's VM templates (conftest.VM_TEMPLATES)."""
    yield from microvm_daemon(busybox_rootfs, WATCHDOG, shared_vm_templates=True)


@pytest.fixture
def vmd(watchdog_daemon):
    """(daemon, a client of this test's own)."""
    c = watchdog_daemon.client()
    yield watchdog_daemon, c
    c.close()


def _vm(c, **kw):
    args = {"backend": "microvm", "memory": "256M", "net": "none", "disk": "64M", **kw}
    return c.create("busybox", **args)


def _events(d, sb_id: str) -> list[dict]:
    async def replay():
        async with dsecd.Client(d.socket) as ac:
            return [ev async for ev in ac.events(sandbox=sb_id, replay=True, follow=False)]
    return asyncio.run(replay())


def _wait_dead(c, sb_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = c.get(sb_id).inspect()
        if info["state"] == "dead":
            return info
        time.sleep(0.25)
    raise AssertionError(f"sandbox {sb_id} not reported dead within {timeout:.0f}s")


def _gone(d, sb_id: str, pid: int, cgroups: list[str]) -> None:
    """The VM's QEMU, cgroups and directory are gone."""
    for _ in range(100):
        if not os.path.exists(f"/proc/{pid}") and not any(os.path.exists(g) for g in cgroups) \
                and not (d.state / "vms" / sb_id).exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"left behind: QEMU {os.path.exists(f'/proc/{pid}')}, "
                         f"cgroups {[g for g in cgroups if os.path.exists(g)]}, dir {(d.state / 'vms' / sb_id).exists()}")


def test_a_restarted_daemon_readopts_running_and_paused_vms(vmd):
    d, c = vmd
    a, b = _vm(c), _vm(c)
    a.write_file("/tmp/a", b"still here")
    b.write_file("/tmp/b", b"saved in the pause")
    b.pause()
    qemu = a.inspect()["vm"]["qemu_pid"]
    c.close()
    d.stop(signal.SIGTERM)
    assert os.path.exists(f"/proc/{qemu}"), "a daemon stop must leave VMs running"
    d.start()
    c2 = d.client()
    try:
        a2, b2 = c2.get(a.id), c2.get(b.id)
        assert (a2.inspect()["state"], b2.inspect()["state"]) == ("running", "paused")
        assert a2.inspect()["vm"]["qemu_pid"] == qemu
        assert a2.read_file("/tmp/a") == b"still here"
        assert a2.exec(["hostname"]).stdout == f"sb-{a.id}\n".encode()
        assert b2.resume()["state"] == "running"
        assert b2.read_file("/tmp/b") == b"saved in the pause"
        a2.destroy()
        b2.destroy()
    finally:
        c2.close()


def test_a_vm_that_died_while_no_daemon_ran_is_dead_after_the_restart(vmd):
    d, c = vmd
    sb, qemu, cgroups = _vm_and_its_qemu(c)
    c.close()
    d.stop(signal.SIGTERM)
    os.kill(qemu, signal.SIGKILL)            # the daemon's own QEMU, by pid
    for _ in range(100):
        if not os.path.exists(f"/proc/{qemu}"):
            break
        time.sleep(0.05)
    d.start()
    c2 = d.client()
    try:
        info = c2.get(sb.id).inspect()
        assert info["state"] == "dead"
        assert info["death"] == {"reason": "gone", "detail": "its VM ended while no daemon ran"}, info
        assert any(ev["event"] == "died" for ev in _events(d, sb.id))
        c2.get(sb.id).destroy()
        _gone(d, sb.id, qemu, cgroups)
        assert c2.create("busybox", memory="64M").exec(["true"]).exit_code == 0   # the daemon is fine
    finally:
        c2.close()


def test_job_pause_and_resume_cover_vms(vmd):
    d, c = vmd
    sbs = [_vm(c, labels={"job": "vmjob"}) for _ in range(2)]
    for i, sb in enumerate(sbs):
        sb.write_file("/tmp/n", str(i).encode())
    out = c.job_pause("vmjob")
    assert sorted(out["paused"]) == sorted(s.id for s in sbs)
    # The state is saved behind the answer (each QEMU then ends); wait for one.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (d.state / "vms" / sbs[0].id / "paused.ram").exists():
        time.sleep(0.2)
    out = c.job_resume("vmjob")
    assert sorted(out["resumed"]) == sorted(s.id for s in sbs)
    for i, sb in enumerate(sbs):
        assert sb.read_file("/tmp/n") == str(i).encode()
        assert sb.exec(["echo", "up"]).stdout == b"up\n"
    # A resume right after the pause finds the vCPUs only stopped, or the state saved: either works.
    c.job_pause("vmjob")
    c.job_resume("vmjob")
    assert all(sb.exec(["true"]).exit_code == 0 for sb in sbs)
    for sb in sbs:
        sb.destroy()


def _memory(sb) -> tuple[int, int]:
    """(what the sandbox's memory cgroup is charged, its page cache of
    files: shmem left out)."""
    groups = sb.inspect()["cgroups"]
    d = groups.get("memory") or groups.get("unified")
    stat = dict(line.split() for line in open(os.path.join(d, "memory.stat")).read().splitlines())
    if os.path.exists(os.path.join(d, "memory.current")):
        return int(open(os.path.join(d, "memory.current")).read()), int(stat["file"]) - int(stat["shmem"])
    return (int(open(os.path.join(d, "memory.usage_in_bytes")).read()),
            int(stat["cache"]) - int(stat["shmem"]))


def test_a_pause_reports_what_the_host_got_back_and_keeps_no_cache_of_its_state(vmd):
    """A VM's pause said it freed the whole --memory, whatever its QEMU had
    held, and the state file QEMU wrote stayed in the page cache charged to
    the sandbox's cgroup: the paused VM held about its state's size of the
    host's memory. The pause reports how much the cgroup's charge dropped
    and what it still holds, and the state file's pages are written out
    and dropped."""
    d, c = vmd
    sb = _vm(c)
    try:
        sb.write_file("/tmp/f", os.urandom(16 << 20))           # pages of its own to save
        before, _ = _memory(sb)
        out = sb.pause()
        held, cached = _memory(sb)
        assert out["image_bytes"] > 16 << 20, out
        assert cached < out["image_bytes"] // 4, (cached, out)
        assert out["freed_bytes"] <= before + (8 << 20), (before, out)
        assert abs(out["held_bytes"] - held) <= 8 << 20, (held, out)
        paused = [e for e in _events(d, sb.id) if e["event"] == "paused"]
        assert paused[-1]["freed_bytes"] == out["freed_bytes"]
        sb.resume()
        assert sb.exec(["sh", "-c", "wc -c < /tmp/f"]).stdout == b"16777216\n"
    finally:
        sb.destroy(force=True)


LEAVER = """
import io, sys, tarfile, time
from dsecd import SyncClient
c = SyncClient(sys.argv[1]); c.connect()
sb = c.get(sys.argv[2])
c.request("file_write", sandbox=sb.id, path="/work/.dsec-0123456789ab", data=b"part", temporary=True)
tar = io.BytesIO()
with tarfile.open(fileobj=tar, mode="w") as tf:
    info = tarfile.TarInfo("a"); info.size = 4; tf.addfile(info, io.BytesIO(b"data"))
sb.upload_tar(tar.getvalue(), "/work/.dsec-cp-0123456789ab", temporary=True)
print("made", flush=True)
time.sleep(600)
"""


def test_the_temporaries_of_a_client_killed_mid_copy_are_removed(vmd, tmp_path):
    """A client killed between an atomic write's first chunk and its rename
    (or between a `cp -r`'s landing directory and its rename) left the
    temporary in a microVM for good: the daemon removed a container's when
    the connection closed, and ignored `temporary` for a VM. A VM's are
    removed too once their client's connection is gone."""
    d, c = vmd
    sb = _vm(c)
    try:
        sb.mkdir("/work", parents=True)

        def made() -> None:
            names = sorted(e["name"] for e in sb.list_files("/work"))
            assert names == [".dsec-0123456789ab", ".dsec-cp-0123456789ab"], names
        _with_a_leaver(d, sb.id, tmp_path, made)
        _work_holds(sb, [])
    finally:
        sb.destroy(force=True)


def test_the_temporaries_a_client_left_while_its_vm_was_paused_go_at_its_resume(vmd, tmp_path):
    """A write's temporary file and a `cp -r`'s landing directory whose
    client went while their microVM was paused stayed in it for good: the
    daemon could not reach the guest then, and nothing tried again. They
    go at the VM's resume."""
    d, c = vmd
    sb = _vm(c)
    try:
        sb.mkdir("/work", parents=True)
        _with_a_leaver(d, sb.id, tmp_path, sb.pause)
        # The daemon has taken the client's end (the VM paused): its log says what it did with each.
        deadline = time.monotonic() + 60
        told: list = []
        while len(told) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            told = [line for line in d.log.read_text(errors="replace").splitlines()
                    if sb.id in line and "the temporary copy of a write its client left unfinished" in line]
        assert len(told) == 2, told
        sb.resume()
        _work_holds(sb, [])
    finally:
        sb.destroy(force=True)


def test_the_temporaries_a_killed_daemon_held_are_removed_by_the_next(vmd, tmp_path):
    """A write's temporary file and a `cp -r`'s landing directory in a
    microVM were held for removal in the daemon's memory only (the guest's
    agent reported no inode numbers to check a path against later): a
    daemon killed before their client renamed or removed them left them in
    the guest for good. They are recorded by the guest's inode numbers, and
    the next daemon removes them."""
    d, c = vmd
    sb = _vm(c)
    try:
        sb.mkdir("/work", parents=True)
        sb.write_file("/work/kept", b"the user's")
        # Killed with its client still connected: nothing of the daemon removes them.
        _with_a_leaver(d, sb.id, tmp_path, lambda: d.stop(signal.SIGKILL))
        c.close()
        _restarted_work_holds(d, sb.id, ["kept"])
    finally:
        _destroy_after_restart(d, sb.id)


def test_a_daemon_killed_mid_copy_leaves_no_copy_directory_in_the_vm(vmd, tmp_path):
    """A daemon killed while a `cp -r` into a microVM was under way left the
    guest's copy waiting for the rest of its archive for good, and its
    directory (.dsec-put-<hex>, beside the destination) with it: nothing
    else knows that name to be a copy's. The next daemon's HELLO ends the
    copy's input, and the copy removes what it made."""
    d, c = vmd
    sb = _vm(c, memory="512M", disk="128M")
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(24):
        (tree / f"f{i}").write_bytes(os.urandom(1 << 20))
    try:
        sb.mkdir("/work", parents=True)
        threading.Thread(target=lambda: _quietly(lambda: sb.upload_dir(str(tree), "/work/tree")),
                         daemon=True).start()
        deadline = time.monotonic() + 60        # the guest's copy made its directory: it is under way
        while time.monotonic() < deadline and not any(e["name"].startswith(".dsec-put-")
                                                      for e in sb.list_files("/work")):
            time.sleep(0.05)
        assert any(e["name"].startswith(".dsec-put-") for e in sb.list_files("/work"))
        d.stop(signal.SIGKILL)
        c.close()
        _restarted_work_holds(d, sb.id, [])
    finally:
        _destroy_after_restart(d, sb.id)


def _with_a_leaver(d, sb_id: str, tmp_path, then) -> None:
    """Run LEAVER on VM `sb_id` (a client that makes a write's temporary
    and a `cp -r` landing directory in /work, then waits), then() once it
    has, and kill it."""
    script = tmp_path / "leaver.py"
    script.write_text(LEAVER)
    child = subprocess.Popen([sys.executable, str(script), d.socket, sb_id], stdout=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert child.stdout.readline() == b"made\n"
        then()
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def _work_holds(sb, names: list[str]) -> None:
    """Wait (60 s at most) until the VM's /work holds just `names` (what
    the daemon removes goes meanwhile)."""
    deadline = time.monotonic() + 60
    seen = ["?"]
    while seen != names and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = sorted(e["name"] for e in sb.list_files("/work"))
    assert seen == names, seen


def _restarted_work_holds(d, sb_id: str, names: list[str]) -> None:
    """Start the killed daemon again and wait until the VM's /work holds
    just `names` (_work_holds)."""
    d.start()
    c = d.client()
    try:
        _work_holds(c.get(sb_id), names)
    finally:
        c.close()


def _destroy_after_restart(d, sb_id: str) -> None:
    """Destroy the VM on a client of the (restarted) daemon's own."""
    c = d.client()
    try:
        c.get(sb_id).destroy(force=True)
    finally:
        c.close()


def test_a_directory_copy_under_way_resumes_its_job_paused_vm(vmd, tmp_path):
    """A job pause stops a VM's vCPUs: a directory copy into (or out of) it
    under way stood still, its client waiting, until someone resumed the
    job (a single-file write's next chunk resumes the VM, and a container's
    copy is the sandbox's op as well). The copy resumes the VM and ends."""
    d, c = vmd
    sb = _vm(c, memory="512M", disk="128M", labels={"job": "copying"})
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(24):
        (tree / f"f{i}").write_bytes(os.urandom(1 << 20))
    done: list = []
    copier = threading.Thread(target=lambda: done.append(sb.upload_dir(str(tree), "/tree")))
    try:
        copier.start()
        deadline = time.monotonic() + 60        # the guest's copy makes its directory: it is under way
        while time.monotonic() < deadline and not any(e["name"].startswith(".dsec-put-") for e in sb.list_files("/")):
            time.sleep(0.05)
        assert c.job_pause("copying")["paused"] == [sb.id]
        copier.join(120)
        assert done and done[0]["count"] == 25, done
        assert sb.inspect()["state"] == "running"
        assert sb.exec(["sh", "-c", "ls /tree | wc -l"]).stdout == b"24\n"
    finally:
        c.job_resume("copying")
        copier.join(120)
        sb.destroy(force=True)


GONE_ONCE_SENT = """
import io, os, sys, tarfile
import dsecd.client
from dsecd import SyncClient
feed = dsecd.client.Sandbox._feed_tar
async def feed_then_die(self, *args, **kw):
    await feed(self, *args, **kw)
    os._exit(0)         # the whole archive sent, its put not yet answered
dsecd.client.Sandbox._feed_tar = feed_then_die
c = SyncClient(sys.argv[1]); c.connect()
tar = io.BytesIO()
with tarfile.open(fileobj=tar, mode="w") as tf:
    info = tarfile.TarInfo("a"); info.size = 4; tf.addfile(info, io.BytesIO(b"data"))
c.get(sys.argv[2]).upload_tar(tar.getvalue(), "/work/.dsec-cp-0123456789ab", temporary=True)
"""


def test_a_copy_whose_client_dies_once_it_sent_it_all_is_removed(vmd, tmp_path):
    """A `cp -r`'s landing directory in a microVM was held for removal only
    once its put had returned: a client killed after the whole archive had
    reached the guest (its copy made all the same) left it for good."""
    d, c = vmd
    sb = _vm(c)
    try:
        sb.mkdir("/work", parents=True)
        script = tmp_path / "gone.py"
        script.write_text(GONE_ONCE_SENT)
        subprocess.run([sys.executable, str(script), d.socket, sb.id], check=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        # Its request ends once the guest's copy has: the removal comes after.
        deadline = time.monotonic() + 60
        names = ["?"]
        while names and time.monotonic() < deadline:
            time.sleep(0.5)
            names = [e["name"] for e in sb.list_files("/work")]
        assert names == [], names
    finally:
        sb.destroy(force=True)


def test_a_pause_during_a_file_write_waits_for_it_and_the_vm_resumes(vmd):
    """A pause that ended QEMU while a file_write's frame was still on its
    way to the guest left the agent holding half a frame: the resume's HELLO
    was read as the rest of it, never answered, and the VM could not be
    resumed (the agent did not answer within 120s). The pause waits for the
    VM's file requests under way; the write's later chunks resume it."""
    d, c = vmd
    sb = _vm(c, memory="512M", disk="128M")
    data = os.urandom(1 << 20) * 48
    done: list = []
    try:
        writer = threading.Thread(target=lambda: done.append(sb.write_file("/work/big", data)))
        writer.start()
        time.sleep(0.5)
        sb.pause()
        writer.join(120)
        assert done == [len(data)]
        out = sb.exec(["sh", "-c", "md5sum < /work/big"], timeout=60).stdout
        assert out.split()[0] == hashlib.md5(data).hexdigest().encode()
    finally:
        sb.destroy(force=True)


def test_a_pause_racing_background_starts_and_kills_waits_for_them(vmd):
    """A pause that ended QEMU while a background process's start (or its
    kill) was on its way to the agent failed that request with "exiting",
    and a start cannot be sent again (it may have run). The pause waits
    for them, as for file requests: both succeed, every round."""
    d, c = vmd
    sb = _vm(c)

    async def rounds():
        async with dsecd.Client(d.socket) as ac:
            vm = await ac.get(sb.id)
            for i in range(4):
                proc, paused = await asyncio.gather(vm.spawn(["sleep", "600"]), vm.pause())
                assert paused["state"] == "paused" and proc.pid > 0, (i, paused)
                await vm.resume()
                sent, paused = await asyncio.gather(proc.kill(), vm.pause())
                assert paused["state"] == "paused", (i, paused)
                await vm.resume()

    try:
        asyncio.run(rounds())
    finally:
        sb.destroy(force=True)


def test_a_destroy_during_a_pause_or_resume_is_what_that_request_reports(vmd):
    """A destroy takes no sandbox lock: one that ends QEMU in the middle of
    a pause's save or a resume's load made that request fail as `internal`
    (a write to the closed monitor, the resume's clean-up reaching for the
    handle the destroy had taken). The request now says the sandbox was
    destroyed (meanwhile, or before it came), or succeeds if it finished
    first, and nothing is left. The destroy comes at several points of
    each, so that some rounds cut it."""
    d, c = vmd
    for op in ("pause", "resume"):
        for delay in (0.05, 0.15, 0.3, 0.5):
            sb, qemu, cgroups = _vm_and_its_qemu(c)
            if op == "resume":
                sb.pause()
            outcome: list = []

            def request(sb=sb, op=op, outcome=outcome):
                try:
                    outcome.append(getattr(sb, op)()["state"])
                except DsecError as err:
                    outcome.append(err)

            t = threading.Thread(target=request)
            t.start()
            time.sleep(delay)
            sb.destroy(force=True)
            t.join(90)
            assert len(outcome) == 1, (op, delay)
            got = outcome[0]
            if isinstance(got, DsecError):
                # (not_found, or "is stopping": the destroy came before the request did.)
                assert got.code in ("conflict", "not_found"), (op, delay, got)
            _gone(d, sb.id, qemu, cgroups)


def test_a_daemon_killed_during_a_file_write_leaves_a_vm_the_next_one_reaches(vmd):
    """The killed daemon's connection ended in the middle of a write's
    frame; the agent drops what it held of it when its host goes, so the
    next daemon's HELLO is read as a frame of its own, and the VM is
    re-adopted and answers."""
    d, c = vmd
    sb = _vm(c, memory="512M", disk="128M")
    data = os.urandom(1 << 20) * 48
    threading.Thread(target=lambda: _quietly(lambda: sb.write_file("/work/big", data)), daemon=True).start()
    time.sleep(0.3)                 # the whole write takes ~1 s
    d.stop(signal.SIGKILL)
    c.close()
    d.start()
    c2 = d.client()
    try:
        again = c2.get(sb.id)
        assert again.inspect()["state"] == "running"
        assert again.exec(["echo", "answers"], timeout=60).stdout == b"answers\n"
        again.destroy(force=True)
    finally:
        c2.close()


def _qmp(d, sb_id: str, *commands, save_to=None) -> None:
    """Run QMP `commands` on a VM's monitor while no daemon holds it, as a
    daemon killed mid-pause left it; save_to: then save the VM's state
    there and end QEMU, as a pause does (MicroVMBackend.save, end_process)."""
    from dsecd.backends.microvm.qmp import QMP

    async def run():
        qmp = await QMP.connect(str(d.state / "vms" / sb_id / "qmp.sock"), f"microVM {sb_id}", 10)
        try:
            for name in commands:
                await qmp.command(name)
            if save_to is not None:
                await qmp.command("migrate-set-capabilities",
                                  {"capabilities": [{"capability": "x-ignore-shared", "state": False}]})
                fd = os.open(save_to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    await qmp.send_fd("state-out", fd)
                finally:
                    os.close(fd)
                await qmp.command("migrate", {"uri": "fd:state-out"})
                await qmp.migrate_wait(120)
                await qmp.command("quit")
        finally:
            qmp.close()

    asyncio.run(run())


def _stuck_save(d, sb_id: str):
    """Start a save of a VM (as a pause does) into a socket nobody reads,
    so it stays under way, as when a daemon dies during one; returns the
    socket's other end, to close once done."""
    import socket

    from dsecd.backends.microvm.qmp import QMP

    async def run():
        qmp = await QMP.connect(str(d.state / "vms" / sb_id / "qmp.sock"), f"microVM {sb_id}", 10)
        ours, qemus = socket.socketpair()
        try:
            await qmp.command("stop")
            await qmp.send_fd("state-out", qemus.fileno())
            await qmp.command("migrate", {"uri": "fd:state-out"})
            for _ in range(100):
                if (await qmp.command("query-migrate")).get("status") == "active":
                    return ours
                await asyncio.sleep(0.05)
            raise AssertionError("the save did not start")
        finally:
            qemus.close()
            qmp.close()

    return asyncio.run(run())


def _wait_gone(pid: int) -> None:
    for _ in range(200):
        if not os.path.exists(f"/proc/{pid}"):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


def test_a_pause_the_killed_daemon_did_not_record_is_undone_or_finished(vmd):
    """A daemon killed between a pause's QMP stop and its record (a job
    pause's freeze takes seconds) left a "running" VM with stopped vCPUs:
    the next daemon runs them again, instead of waiting for an agent that
    cannot answer and destroying the VM; killed during the save, the save
    is cancelled first. Killed after the pause saved the state and ended
    QEMU: the VM is re-adopted paused, and resumes."""
    d, c = vmd
    stopped, saved, saving = _vm(c), _vm(c), _vm(c)
    stopped.write_file("/tmp/a", b"stopped, not lost")
    saved.write_file("/tmp/b", b"saved, not lost")
    saving.write_file("/tmp/s", b"saving, not lost")
    saved_qemu = saved.inspect()["vm"]["qemu_pid"]
    c.close()
    d.stop(signal.SIGKILL)
    _qmp(d, stopped.id, "stop")
    _qmp(d, saved.id, "stop", save_to=d.state / "vms" / saved.id / "paused.ram")
    _wait_gone(saved_qemu)
    unread = _stuck_save(d, saving.id)
    try:
        d.start()
    finally:
        # Read now: a save not cancelled would finish and stop the VM again.
        threading.Thread(target=lambda: [None for _ in iter(lambda: unread.recv(1 << 20), b"")],
                         daemon=True).start()
    c2 = d.client()
    try:
        a, b, s = c2.get(stopped.id), c2.get(saved.id), c2.get(saving.id)
        assert a.inspect()["state"] == "running"
        assert a.exec(["cat", "/tmp/a"], timeout=60).stdout == b"stopped, not lost"
        assert s.inspect()["state"] == "running"
        time.sleep(1)           # what was left of a save not cancelled is read by now
        assert s.exec(["cat", "/tmp/s"], timeout=30).stdout == b"saving, not lost"
        s.destroy()
        unread.close()
        assert b.inspect()["state"] == "paused"
        assert b.resume()["state"] == "running"
        assert b.exec(["cat", "/tmp/b"], timeout=60).stdout == b"saved, not lost"
        assert not (d.state / "vms" / saved.id / "paused.ram").exists()
        a.destroy()
        b.destroy()
    finally:
        c2.close()


def test_a_resume_the_killed_daemon_did_not_record_leaves_the_vm_paused(vmd):
    """A daemon killed between a resume's new QEMU and its record: the
    next daemon finds the record paused, the state file kept and a process
    in the VM's cgroups (here a stand-in for that QEMU). The process is
    killed, not leaked beside the QEMU of the next resume; the VM resumes
    from its state file."""
    d, c = vmd
    sb = _vm(c)
    sb.write_file("/tmp/c", b"paused, not lost")
    cgroups = list(sb.inspect()["cgroups"].values())
    sb.pause()
    c.close()
    d.stop(signal.SIGKILL)
    stray = subprocess.Popen(["sleep", "300"])
    try:
        for group in cgroups:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(stray.pid))
        d.start()
        assert stray.wait(timeout=30) == -signal.SIGKILL
    finally:
        stray.kill()
        stray.wait()
    c2 = d.client()
    try:
        again = c2.get(sb.id)
        assert again.inspect()["state"] == "paused"
        assert again.resume()["state"] == "running"
        assert again.exec(["cat", "/tmp/c"], timeout=60).stdout == b"paused, not lost"
        again.destroy()
    finally:
        c2.close()


def test_a_daemon_killed_during_a_resume_leaves_one_qemu_and_the_vms_state(vmd):
    """Whatever moment of a resume the kill hits (before its new QEMU,
    during the load, after it, before or after its record), the next
    daemon has the VM paused or running, with one QEMU at most, its files
    intact, and no state file left once it runs."""
    d, c = vmd
    sb = _vm(c)
    sb.write_file("/tmp/d", b"resumed, not lost")
    cgroups = list(sb.inspect()["cgroups"].values())
    sb.pause()
    resuming = threading.Thread(target=lambda: _quietly(sb.resume), daemon=True)
    resuming.start()
    time.sleep(0.15)        # within the resume (0.1-0.3 s here: QEMU's start, the load, the agent's HELLO)
    d.stop(signal.SIGKILL)
    resuming.join(30)
    c.close()
    d.start()
    c2 = d.client()
    try:
        again = c2.get(sb.id)
        state = again.inspect()["state"]
        assert state in ("paused", "running"), state
        if state == "paused":
            assert again.resume()["state"] == "running"
        assert again.exec(["cat", "/tmp/d"], timeout=60).stdout == b"resumed, not lost"
        qemus = {int(p) for g in cgroups for p in open(os.path.join(g, "cgroup.procs")).read().split()}
        assert qemus == {again.inspect()["vm"]["qemu_pid"]}, qemus
        assert not list((d.state / "vms" / sb.id).glob("paused.ram*"))
        again.destroy()
    finally:
        c2.close()


def test_a_vm_readopted_after_a_kill_pauses_and_resumes_at_once(vmd):
    """A re-adopted QEMU is not the daemon's child: a pause must wait for it
    to be gone before a resume starts the next QEMU in its dir, or the
    resume's monitor connection reaches the dying one's socket and is reset."""
    d, c = vmd
    sb = _vm(c)
    sb.write_file("/work/kept", b"before the kill")
    c.close()
    d.stop(signal.SIGKILL)
    d.start()
    c2 = d.client()
    try:
        again = c2.get(sb.id)
        assert again.pause()["state"] == "paused"
        assert again.exec(["cat", "/work/kept"], timeout=60).stdout == b"before the kill"
        again.destroy(force=True)
    finally:
        c2.close()


def _quietly(fn):
    try:
        fn()
    except Exception:
        pass


def _vm_and_its_qemu(c):
    """A new VM, its QEMU's pid and its cgroup dirs (to check they go)."""
    sb = _vm(c)
    info = sb.inspect()
    return sb, info["vm"]["qemu_pid"], list(info["cgroups"].values())


def test_a_guest_that_panics_is_reported_dead_and_cleaned_up(vmd):
    d, c = vmd
    sb, pid, cgroups = _vm_and_its_qemu(c)
    with pytest.raises(DsecError):
        sb.exec(["sh", "-c", "echo c > /proc/sysrq-trigger; sleep 30"], timeout=60)
    _wait_dead(c, sb.id)
    _gone(d, sb.id, pid, cgroups)
    died = [e for e in _events(d, sb.id) if e["event"] == "died"]
    # The guest's kernel said why in its serial log: the event says it too.
    assert died and died[0]["reason"] == "panic" and "sysrq" in died[0]["detail"], died
    assert died[0]["exit_code"] == 0, died           # -no-reboot: QEMU exits by itself
    death = sb.inspect()["death"]
    assert death == {k: died[0][k] for k in death} and death["reason"] == "panic", (death, died)
    assert death["exit_code"] == 0 and "sysrq" in death["detail"], death
    sb.destroy()


def test_files_bigger_than_the_guest_holds_are_refused_and_it_lives_on(vmd, tmp_path):
    """A VM's files are tmpfs pages of its RAM, which nothing reclaims: a
    300M copy into a 256M guest (its writable layer sized at the default
    disk, 10G) filled it, its kernel panicked ("System is deadlocked on
    memory") and the copy failed with a bare ConnectionResetError. The layer
    is capped at half the guest's room (its RAM less 64M its kernel keeps),
    and a write or directory copy that does not fit is refused (`limit`,
    naming --memory); the VM serves on."""
    d, c = vmd
    sb = c.create("busybox", backend="microvm", memory="256M", net="none")
    try:
        assert sb.inspect()["limits"]["disk"] == 96 << 20
        # /tmp and /dev/shm, tmpfs in RAM too: an eighth of its room each, at most.
        sizes = sb.exec(["sh", "-c", "df -k /tmp /dev/shm | tail -n 2"]).stdout.split()
        assert [int(sizes[1]), int(sizes[7])] == [24 << 10, 24 << 10], sizes
        big = tmp_path / "big"
        with open(big, "wb") as f:
            f.truncate(300 << 20)
        r = d.cli("cp", str(big), f"{sb.id}:/root/f", timeout=300)
        assert r.returncode != 0 and b"limit:" in r.stderr and b"--memory" in r.stderr, r.stderr
        (tmp_path / "dir").mkdir()
        os.link(big, tmp_path / "dir" / "big")
        r = d.cli("cp", "-r", str(tmp_path / "dir"), f"{sb.id}:/work/d", timeout=300)
        assert r.returncode != 0 and b"limit:" in r.stderr and b"--memory" in r.stderr, r.stderr
        assert sb.exec(["sh", "-c", "test ! -e /work/d && echo ok"]).stdout == b"ok\n"
        assert sb.inspect()["state"] == "running"
        assert not [e for e in _events(d, sb.id) if e["event"] == "died"]
    finally:
        sb.destroy(force=True)


def test_a_vm_whose_own_commands_fill_its_files_lives_on(vmd):
    """The writable layer at half the guest's RAM and /tmp and /dev/shm at
    an eighth each, all filled by the guest's own commands, left a 256M
    guest 4 MiB: its OOM killer found nothing to free (tmpfs pages) and its
    kernel panicked ("System is deadlocked on memory"), the VM dead; a 128M
    one died so from its layer and /tmp. The caps are fractions of what the
    guest has once booted: each fill ends with ENOSPC and the VM serves on."""
    d, c = vmd
    for memory in ("128M", "256M"):
        sb = c.create("busybox", backend="microvm", memory=memory, net="none")
        try:
            for path in ("/big", "/tmp/big", "/dev/shm/big"):
                r = sb.exec(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=512"], timeout=300)
                assert r.exit_code == 1 and b"No space left" in r.stderr, (memory, path, r)
            assert sb.exec(["echo", "alive"], timeout=120).stdout == b"alive\n"
            assert sb.inspect()["state"] == "running"
            assert not [e for e in _events(d, sb.id) if e["event"] == "died"]
        finally:
            sb.destroy(force=True)


def test_a_guest_that_hangs_is_killed_and_reported_dead(vmd):
    d, c = vmd
    sb, pid, cgroups = _vm_and_its_qemu(c)
    os.kill(pid, signal.SIGSTOP)          # the whole VM stops answering: a hang, from outside
    try:
        _wait_dead(c, sb.id, timeout=90)
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGCONT)
    _gone(d, sb.id, pid, cgroups)
    died = [e for e in _events(d, sb.id) if e["event"] == "died"]
    assert died and died[0]["reason"] == "hung" and died[0]["signal"] == "SIGKILL", died
    sb.destroy()


def test_the_guest_cannot_reach_qemus_sockets(vmd):
    """QEMU's monitor and the agent's socket are unix sockets in the VM's
    dir on the host: no path of the guest leads there, no guest socket is
    them, and the guest's end of the agent's channel is the agent's alone."""
    d, c = vmd
    sb = _vm(c)
    try:
        vm_dir = sb.inspect()["vm"]["dir"]
        r = sb.exec(["sh", "-c", f"ls {vm_dir}/qmp.sock {vm_dir}/agent.sock"])
        assert r.exit_code != 0
        unix = sb.exec(["cat", "/proc/net/unix"]).stdout.decode()
        assert "qmp" not in unix and "agent.sock" not in unix
        ports = sb.exec(["sh", "-c", "ls /dev/vport*"]).stdout.decode().split()
        assert ports, "the guest has no virtio-serial port (the agent's channel)"
        for port in ports:
            r = sb.exec(["sh", "-c", f"cat {port} </dev/null"])
            assert r.exit_code != 0 and b"busy" in r.stderr.lower(), r.stderr
        assert sb.exec(["echo", "agent fine"]).stdout == b"agent fine\n"
    finally:
        sb.destroy()


def test_qemu_killed_by_its_memory_limit_is_an_oom_event(daemon_factory, busybox_rootfs):
    # QEMU may use little beyond the guest's RAM here: a guest that writes
    # most of its RAM takes QEMU past memory.max, and the kernel's OOM killer
    # ends it. A booted VM (no template): every page its guest touched is
    # charged to its cgroup, so the host's limit comes well before the
    # guest's own memory runs out (whose OOM killer would end only the dd).
    # Its files hold at most 96M (upper_cap): a dd's buffer touches the rest.
    d = daemon_factory("[microvm]\nmemory_overhead = \"16M\"\nwatchdog_interval_s = 0\ntemplates = false\n")
    c = d.client()
    try:
        skip_unless_microvm(c)
        c.import_image(busybox_rootfs, "busybox")
        sb = _vm(c, disk="240M")
        pid = sb.inspect()["vm"]["qemu_pid"]
        try:
            r = sb.exec(["sh", "-c", "dd if=/dev/zero of=/fill bs=1M count=180; "
                                     "dd if=/dev/zero of=/dev/null bs=160M count=1; sleep 30"], timeout=120)
        except DsecError:
            pass
        else:
            raise AssertionError(f"the guest filled its memory and QEMU lived: {r.exit_code} {r.stderr!r}")
        _wait_dead(c, sb.id)
        # Reported dead once its exit is seen; reaped by the release that
        # follows in a worker (a zombie until then, on a loaded host).
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}")
        kinds = {e["event"]: e for e in _events(d, sb.id)}
        said = [ln for ln in d.log.read_text(errors="replace").splitlines() if sb.id in ln][-12:]
        assert "oom" in kinds and kinds["oom"]["kills"] >= 1, f"{kinds}\n" + "\n".join(said)
        assert kinds["died"]["reason"] == "exited", f"{kinds['died']}"
        assert kinds["died"].get("signal") == "SIGKILL", f"{kinds['died']}"
        # inspect keeps what the event said, with the OOM kills counted.
        kills = sum(e["kills"] for e in _events(d, sb.id) if e["event"] == "oom")
        assert sb.inspect()["death"] == {"reason": "exited", "signal": "SIGKILL", "oom_kills": kills}
        sb.destroy()
    finally:
        c.close()
