"""Pause/resume, zram and process_madvise on the real kernel.

Each test gets its own cgroup subtree (`dsecd-test-mem-<random>`) with one
process the test started, which holds anonymous memory and has read a file
into the page cache. Finalizers thaw, kill that process by pid, remove the
groups, and turn off and remove any zram swap or swap file the test made,
even on failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from dsecd import cgroup, native
from dsecd.mem import pause as mp
from dsecd.mem import swapfile as sf
from dsecd.mem.zram import ZramConfig, ZramSwap, active_swaps

MIB = 1 << 20
WORKLOAD = r"""
import os, sys
buf = bytearray(os.urandom(2048) * (int(sys.argv[1]) * 512))
with open(sys.argv[2], "rb") as f:
    while f.read(1 << 20):
        pass
print("ready", flush=True)
for line in sys.stdin:
    s = sum(buf[i] for i in range(0, len(buf), 4096))
    print("touched", flush=True)
"""


class Box:
    def __init__(self, tmp: Path, anon_mib: int = 16, file_mib: int = 16):
        self.layout = cgroup.detect_layout()
        self.root = f"dsecd-test-mem-{secrets.token_hex(4)}"
        self.group = cgroup.Group(self.layout, f"{self.root}/sb")
        self.group.create()
        self.group.set_limits(cgroup.Limits(cpu=1.0, memory_bytes=256 * MIB, pids=32))
        data = tmp / "data"
        with open(data, "wb") as f:
            f.write(os.urandom(file_mib * MIB))
            os.fsync(f.fileno())
        fd = os.open(data, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        procs = self.group.procs_files()

        def join():
            for p in procs:
                with open(p, "w") as fh:
                    fh.write("0")

        self.proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(anon_mib), str(data)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=join)
        assert self.proc.stdout.readline().strip() == "ready"

    def touch(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "touched"

    def cleanup(self) -> None:
        with contextlib.suppress(OSError):
            mp.Freezer.of(self.group).thaw()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.group.remove()
        for mnt in self.layout.hierarchies().values():
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(mnt / self.root)


@pytest.fixture
def box(tmp_path):
    b = Box(tmp_path)
    yield b
    b.cleanup()


@pytest.fixture
def zram():
    z = ZramSwap(ZramConfig(enabled=True, size_bytes=256 * MIB, algorithm="lzo"))
    if not z.available()[0]:
        pytest.skip(z.available()[1])
    try:
        yield z
    finally:
        z.teardown()
        assert z.device is None


def test_a_zram_device_left_half_made_by_a_killed_daemon_is_removed_at_the_next_start(tmp_path):
    """A daemon killed -9 right after hot_add (before the device is swap):
    the next start finds the device by its record and removes it."""
    import json
    from types import SimpleNamespace

    from dsecd.config import load_config
    from dsecd.engine.memory import MemoryService

    if not ZramSwap(ZramConfig()).available()[0]:
        pytest.skip("no zram module")

    def service(enabled: bool) -> MemoryService:
        cfg = load_config(overrides={"daemon": {"state_dir": str(tmp_path)},
                                     "memory": {"zram": {"enabled": enabled, "size": "16M", "algorithm": "lzo"}}})
        svc = MemoryService(cfg, "dsecd-unit", SimpleNamespace(by_id={}), None, None)
        svc.mem_pool.shutdown()
        return svc

    pid = os.fork()
    if pid == 0:
        try:
            svc = service(True)
            svc.zram._set_algorithm = lambda: os._exit(9)      # killed before the device is set up
            svc.start()
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    dev = json.loads((tmp_path / "zram.json").read_text())["device"]
    assert dev != 0 and Path(f"/sys/block/zram{dev}").exists()
    service(False).start()
    left = Path(f"/sys/block/zram{dev}").exists()
    if left:            # the test's own device (nothing removed it, so its number was not handed out again)
        ZramSwap(ZramConfig()).remove_leftover(dev)
    assert not left
    assert not (tmp_path / "zram.json").exists()


@pytest.fixture
def swapfile(tmp_path):
    """A dsecd swap file in the test's tmp dir; always swapped off and deleted."""
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=str(tmp_path / "swapfile"), size_bytes=128 * MIB))
    fstype, _ = sf.fs_type(tmp_path)
    if fstype in sf.NO_SWAP_FS:
        pytest.skip(f"{tmp_path} is on {fstype}, which cannot hold swap")
    try:
        yield s
    finally:
        if s.path in active_swaps():
            native.swapoff(s.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(s.path)


def test_swapfile_is_made_private_allocated_swapped_on_and_removed(box, swapfile):
    path = swapfile.setup()
    st = os.stat(path)
    assert path in active_swaps() and swapfile.active
    assert st.st_mode & 0o777 == 0o600 and st.st_blocks * 512 >= 128 * MIB      # no holes
    assert sf.read_label(path) == sf.LABEL
    assert swapfile.usage()["size"] >= 127 * MIB
    rec = mp.pause(box.group)
    assert rec.before["anon"] - rec.after["anon"] >= 12 * MIB         # anon left RAM for the file
    assert mp.usage(box.group).swap >= 12 * MIB
    if not active_swaps() - {path}:                 # else another swap area may share the pages
        assert swapfile.usage()["used"] >= 12 * MIB
    res = mp.resume(box.group, rec)
    assert res.prefetched_bytes >= 12 * MIB
    box.touch()
    # A second daemon finds the file still on (paused sandboxes kept it) and adopts it.
    again = sf.Swapfile(swapfile.cfg)
    assert again.setup() == path and again.active and path in active_swaps()
    again.teardown()
    assert path not in active_swaps() and not os.path.exists(path)
    again.teardown()                                                   # repeatable


def test_swapfile_left_off_by_a_previous_daemon_is_made_afresh(swapfile):
    swapfile.setup()
    native.swapoff(swapfile.path)
    assert os.path.exists(swapfile.path)
    fresh = sf.Swapfile(swapfile.cfg)
    fresh.setup()
    assert fresh.path in active_swaps()
    fresh.teardown()
    assert not os.path.exists(fresh.path)


def test_a_daemon_never_takes_the_swap_file_another_daemon_made(tmp_path, swapfile):
    """Two daemons configured with one memory.swapfile.path: the second
    refuses it, and neither swaps it off nor deletes it."""
    first = sf.Swapfile(swapfile.cfg, owner=str(tmp_path / "first-state"))
    path = first.setup()
    second = sf.Swapfile(swapfile.cfg, owner=str(tmp_path / "second-state"))
    with pytest.raises(sf.SwapfileError) as exc:
        second.setup()
    assert exc.value.errno == errno.EBUSY and f"state dir {tmp_path / 'first-state'}" in str(exc.value)
    assert not second.adopt()
    second.teardown()
    assert path in active_swaps() and os.path.exists(path)
    first.teardown()
    assert path not in active_swaps() and not os.path.exists(path)


def test_swapfile_on_tmpfs_is_refused_before_anything_is_made():
    fstype, point = sf.fs_type("/dev/shm")
    if fstype != "tmpfs":
        pytest.skip(f"/dev/shm is {fstype or 'not mounted'} here")
    path = f"/dev/shm/dsecd-test-swap-{secrets.token_hex(4)}"
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=path, size_bytes=16 * MIB))
    with pytest.raises(sf.SwapfileError) as exc:
        s.setup()
    assert exc.value.errno == errno.EINVAL and "tmpfs" in str(exc.value)
    assert not os.path.exists(path) and path not in active_swaps()


def test_pause_freezes_reclaims_cache_and_resume_thaws(box):
    u0 = mp.usage(box.group)
    assert u0.file >= 12 * MIB and u0.anon >= 12 * MIB
    rec = mp.pause(box.group)
    freezer = mp.Freezer.of(box.group)
    assert freezer.state() == "FROZEN" and not rec.already_paused
    assert rec.before["file"] - rec.after["file"] >= 12 * MIB       # page cache left the group
    assert rec.working_set and rec.freed >= 12 * MIB
    again = mp.pause(box.group)                                      # idempotent
    assert again.already_paused
    res = mp.resume(box.group, rec)
    assert not res.already_running and res.prefetched_bytes > 0
    assert freezer.state() == "THAWED"
    assert mp.resume(box.group, rec).already_running
    box.touch()                                                      # it runs again


def test_pause_with_zram_swaps_anon_out_and_prefetch_brings_it_back(box, zram):
    dev = zram.setup()
    path = f"/dev/zram{dev}"
    assert dev != 0 and path in active_swaps()
    rec = mp.pause(box.group)
    assert rec.before["anon"] - rec.after["anon"] >= 12 * MIB         # anon went to zram
    assert mp.usage(box.group).swap >= 12 * MIB
    if not active_swaps() - {path}:                 # else another swap area may share the pages
        assert zram.stats()["orig_data_size"] >= 12 * MIB
    res = mp.resume(box.group, rec)                                  # mode "populate"
    assert res.prefetched_bytes >= 12 * MIB
    assert mp.usage(box.group).anon >= 12 * MIB                       # mapped again, before any touch
    box.touch()
    other = ZramSwap(zram.cfg)                                       # a restarted daemon
    assert not other.adopt(0) and other.device is None               # not ours: never taken
    assert other.adopt(dev) and other.device == dev
    zram.teardown()
    assert not ZramSwap(zram.cfg).adopt(dev)                         # gone: nothing to adopt
    assert path not in active_swaps() and not Path(f"/sys/block/zram{dev}").exists()
    assert Path("/sys/block/zram0").exists()                         # the host's device untouched


def test_reclaim_methods_on_v1_limit_restores_the_limit(box):
    version, d = mp.memory_dir(box.group)
    if version != "v1":
        pytest.skip("memory controller is v2 here: memory.reclaim is used")
    limit = (d / "memory.limit_in_bytes").read_text()
    mp.Freezer.of(box.group).freeze(5.0)
    freed = mp.reclaim(box.group, mp.PauseConfig(v1_methods=("limit",)))
    assert freed["limit"] >= 12 * MIB
    assert (d / "memory.limit_in_bytes").read_text() == limit


def test_process_madvise_errors(box):
    with pytest.raises(ValueError):
        native.process_madvise(0, [(4097, 4096)], native.MADV_WILLNEED)
    with pytest.raises(ValueError):
        native.process_madvise(0, [(4096, 4096)], 12345)
    fd = native.pidfd_open(box.proc.pid)
    try:
        # a range that is not mapped is skipped and counted, not fatal
        res = native.process_madvise(fd, [(mp.PAGE, mp.PAGE)], native.MADV_WILLNEED)
        assert res.nr_failed == 1 and res.first_err == errno.ENOMEM and res.bytes == 0
        res = native.process_populate(box.proc.pid, [(mp.PAGE, mp.PAGE)])
        assert res.nr_failed == 1 and res.first_err == errno.EFAULT and res.bytes == 0
        box.proc.kill()
        box.proc.wait()
        with pytest.raises(ProcessLookupError):
            native.process_populate(box.proc.pid, [(mp.PAGE, mp.PAGE)])
        with pytest.raises(ProcessLookupError) as exc:
            native.process_madvise(fd, [(mp.PAGE, mp.PAGE)], native.MADV_WILLNEED)
        assert exc.value.step == "process_madvise" and "exited" in str(exc.value)
    finally:
        os.close(fd)


def test_swap_errors_name_the_device(tmp_path):
    with pytest.raises(OSError) as exc:
        native.swapon(str(tmp_path / "nope"))
    assert exc.value.errno == errno.ENOENT
    with pytest.raises(OSError) as exc:
        native.swapoff("/dev/null")
    assert exc.value.errno in (errno.EINVAL, errno.ENOTBLK)


def test_pause_resume_a_daemon_sandbox(daemon, sandbox):
    """A real container sandbox (dsec-init, its own pid namespace): its cgroup
    freezes, its /tmp (shmem, charged to it) stays put without swap, and
    after resume an exec runs. The daemon does not know about the pause (the
    node integration does not exist yet), so the test resumes before exec:
    an exec into a frozen sandbox would join the frozen cgroup and freeze."""
    r = sandbox.exec(["sh", "-c", "head -c 8000000 /dev/zero > /tmp/blob && (sleep 300 >/dev/null 2>&1 &)"])
    assert r.exit_code == 0
    group = cgroup.Group(cgroup.detect_layout(), f"{daemon.cgroup_root}/{sandbox.id}")
    rec = mp.pause(group)
    try:
        assert mp.Freezer.of(group).state() == "FROZEN"
        assert len(group.pids()) >= 2 and rec.working_set      # init + the sleep
    finally:
        res = mp.resume(group, rec)
    assert not res.already_running and mp.Freezer.of(group).state() == "THAWED"
    r = sandbox.exec(["wc", "-c", "/tmp/blob"])
    assert r.exit_code == 0 and r.stdout.split()[0] == b"8000000"


def test_a_process_joining_a_frozen_group_freezes(box):
    """Why the node must resume before exec: the exec helper joins the
    sandbox's cgroups first, and a task joining a frozen group freezes on the
    spot (with CLONE_VFORK the daemon's worker thread would wait with it)."""
    import select

    freezer = mp.Freezer.of(box.group)
    freezer.freeze(5.0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # child: join, then report
        try:
            for p in box.group.procs_files():
                with open(p, "w") as fh:
                    fh.write("0")
            os.write(w, b"x")
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert select.select([r], [], [], 0.3)[0] == []     # frozen before it could report
        freezer.thaw()
        assert select.select([r], [], [], 5.0)[0] == [r] and os.read(r, 1) == b"x"
    finally:
        freezer.thaw()
        os.close(r)
        os.waitpid(pid, 0)
