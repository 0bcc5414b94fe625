"""Template snapshots of microVMs: keys, the store's files, its sealed memory.

No QEMU here: a template's RAM is a memfd whatever wrote it, so these tests
write one themselves (tests/integration/test_microvm.py restores real ones).
"""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from dsecd.backends.microvm import templates
from dsecd.backends.microvm.backend import Machine
from dsecd.backends.microvm.templates import TemplateStore

MIB = 1 << 20


def _key(**change) -> str:
    args = {"argv": ["qemu", "-m", "256M"], "layer_digests": ["sha256:aa"], "guest_digest": "g1", "qemu_id": "q1"}
    args.update(change)
    return templates.key_of(**args)


def test_key_changes_with_whatever_a_restore_must_match():
    base = _key()
    assert _key() == base
    assert _key(argv=["qemu", "-m", "512M"]) != base               # shape, devices, kernel arguments
    assert _key(layer_digests=["sha256:ab"]) != base                # the image
    assert _key(guest_digest="g2") != base                          # kernel, initramfs, agent
    assert _key(qemu_id="q2") != base                               # the QEMU binary


def _ram(size: int = 4 * MIB) -> int:
    """A template RAM memfd with data in two places and holes elsewhere."""
    fd = templates.new_ram(size)
    os.pwrite(fd, b"A" * 4096, 0)
    os.pwrite(fd, b"B" * 8192, 3 * MIB)
    return fd


def _state(tmp_path):
    state = tmp_path / "state.bin"
    state.write_bytes(b"device state")
    return state


@pytest.fixture
def store(tmp_path):
    s = TemplateStore(tmp_path / "state", "g1", "q1", max_templates=2)
    yield s
    s.close()


def test_commit_seals_the_ram_and_keeps_it_sparse(store, tmp_path):
    t = store.commit("k1", _ram(), _state(tmp_path), {"layers": ["sha256:aa"]})
    with pytest.raises(OSError) as err:
        os.pwrite(t.ram_fd, b"x", 0)
    assert err.value.errno == errno.EPERM
    # What QEMU 7.2 does to discard guest RAM, even in a private mapping: refused.
    with pytest.raises(OSError) as err:
        _punch(t.ram_fd, 0, 4096)
    assert err.value.errno == errno.EPERM
    with pytest.raises(OSError):
        os.ftruncate(t.ram_fd, 0)
    # Reopened through /proc (what QEMU does with mem-path=/proc/self/fd/N): the seals hold.
    again = os.open(f"/proc/self/fd/{t.ram_fd}", os.O_RDWR)
    try:
        with pytest.raises(OSError) as err:
            os.pwrite(again, b"x", 0)
        assert err.value.errno == errno.EPERM
    finally:
        os.close(again)
    ram = t.dir / "ram"
    assert ram.stat().st_size == 4 * MIB and ram.stat().st_blocks * 512 < MIB
    meta = json.loads((t.dir / "meta.json").read_text())
    assert (meta["guest"], meta["qemu"], meta["ram_data_bytes"]) == ("g1", "q1", 3 * 4096)
    assert (t.dir / "state").read_bytes() == b"device state"


def _punch(fd: int, off: int, length: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    falloc_fl_keep_size, falloc_fl_punch_hole = 1, 2
    if libc.fallocate(fd, falloc_fl_keep_size | falloc_fl_punch_hole, ctypes.c_long(off), ctypes.c_long(length)):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def test_a_new_store_loads_templates_from_disk(store, tmp_path):
    store.commit("k1", _ram(), _state(tmp_path), {"layers": ["sha256:aa"]})
    fresh = TemplateStore(tmp_path / "state", "g1", "q1", max_templates=2)
    try:
        t = fresh.get("k1")
        assert t is not None and fresh.get("k1") is t
        assert os.pread(t.ram_fd, 4096, 0) == b"A" * 4096
        assert os.pread(t.ram_fd, 8192, 3 * MIB) == b"B" * 8192
        assert os.pread(t.ram_fd, 4096, MIB) == bytes(4096)
        with pytest.raises(OSError):
            os.pwrite(t.ram_fd, b"x", 0)
        assert fresh.get("no-such-key") is None
    finally:
        fresh.close()


def test_sweep_drops_templates_of_another_guest_or_qemu(store, tmp_path):
    store.commit("k1", _ram(), _state(tmp_path), {"layers": ["sha256:aa"]})
    (store.root / ".tmp-half-written").mkdir()
    assert TemplateStore(tmp_path / "state", "g1", "q1", 2).sweep() == []
    assert not (store.root / ".tmp-half-written").exists()
    assert TemplateStore(tmp_path / "state", "g2", "q1", 2).sweep() == ["k1"]     # a new guest build
    assert store.keys() == []


def test_gc_drops_templates_whose_layers_are_gone(store, tmp_path):
    store.commit("k1", _ram(), _state(tmp_path), {"layers": ["sha256:aa"]})
    store.commit("k2", _ram(), _state(tmp_path), {"layers": ["sha256:bb"]})
    assert store.gc({"sha256:aa"}) == ["k2"]
    assert store.keys() == ["k1"]


def test_the_least_recently_used_goes_past_the_cap(store, tmp_path):
    store.commit("k1", _ram(), _state(tmp_path), {"layers": ["sha256:aa"]})
    store.commit("k2", _ram(), _state(tmp_path), {"layers": ["sha256:aa"]})
    store.get("k1")                       # k2 is now the least recently used
    store.commit("k3", _ram(), _state(tmp_path), {"layers": ["sha256:aa"]})
    assert sorted(store.keys()) == ["k1", "k3"]


def test_machine_records_and_resumes():
    assert Machine.from_record(None) == Machine(ram="legacy")            # VMs from before explicit RAM
    m = Machine(ram="private", reporting=False)
    assert Machine.from_record(m.to_record()) == m
    # A resume loads all the RAM from the pause's image: anonymous memory, same devices.
    assert m.resumed() == Machine(ram="anon", reporting=False)
    assert Machine(ram="legacy").resumed() == Machine(ram="legacy")


def test_a_daemon_stop_ends_a_template_build_under_way():
    """The build's guest does not answer yet when the daemon stops: close()
    ends it, its QEMU destroyed while the workers still run (after their
    shutdown the build's cleanup could not run, and its QEMU, VM dir and
    cgroups would outlive the daemon)."""
    import asyncio
    from types import SimpleNamespace

    from dsecd.engine.vmtemplates import TemplateService
    from dsecd.engine.workers import Workers

    destroyed = []

    class Backend:
        def create(self, name, *args):
            return SimpleNamespace(vm_dir=None)

        async def connect(self, *args):
            await asyncio.sleep(3600)          # a guest still booting

        def destroy(self, name, handle):
            destroyed.append(name)

    async def main():
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        service = TemplateService(Backend(), SimpleNamespace(get=lambda key: None), workers, 60.0, 0)
        limits = SimpleNamespace(memory_bytes=4 * MIB)
        creating = asyncio.ensure_future(service.get("k" * 64, [], [], limits, 1 << 20))
        await asyncio.sleep(0.1)
        creating.cancel()                      # the server's stop cancels the create's request
        await service.close()
        workers.shutdown()
        return creating

    creating = asyncio.run(main())
    assert creating.cancelled()
    assert destroyed == [".template-" + "k" * 16]


@pytest.mark.parametrize("slow_step", ["create", "commit"])
def test_a_daemon_stop_during_a_build_step_in_a_worker_cleans_up_after_it(slow_step):
    """A stop that came while the build's QEMU was being created left that
    QEMU running (the clean-up found no handle yet); one that came while
    the template was committed destroyed the VM dir and closed the RAM fd
    under the commit. The step now ends first, and the clean-up after it
    knows what it made."""
    import asyncio
    import os
    import threading
    from pathlib import Path
    from types import SimpleNamespace

    from dsecd.engine.vmtemplates import TemplateService
    from dsecd.engine.workers import Workers

    events = []
    in_step, go_on = threading.Event(), threading.Event()

    def slow(what):
        events.append(f"{what} begins")
        in_step.set()
        go_on.wait(10)
        events.append(f"{what} ends")

    class Backend:
        def create(self, name, *args):
            if slow_step == "create":
                slow("create")
            return SimpleNamespace(vm_dir=Path("/nonexistent"))     # only joined

        async def connect(self, *args):
            pass

        async def snapshot(self, handle, state):
            pass

        def stop(self, name, handle):
            pass

        def destroy(self, name, handle):
            events.append(f"destroy {handle is not None}")

    class Store:
        def get(self, key):
            return None

        def commit(self, key, ram, state, meta):
            slow("commit")
            os.close(ram)                       # taken over, as the real store's
            return SimpleNamespace(meta={})

    async def main():
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        service = TemplateService(Backend(), Store(), workers, 60.0, 0)
        limits = SimpleNamespace(memory_bytes=4 * MIB)
        creating = asyncio.ensure_future(service.get("k" * 64, [], [], limits, 1 << 20))
        while not in_step.is_set():
            assert not creating.done(), creating.exception()
            await asyncio.sleep(0.01)
        closing = asyncio.ensure_future(service.close())
        await asyncio.sleep(0.2)
        go_on.set()
        await closing
        workers.shutdown()
        return creating

    creating = asyncio.run(main())
    if slow_step == "create":       # a boot that never starts
        with pytest.raises(templates.TemplateError, match="not built: the daemon is stopping"):
            creating.result()
    else:                           # committed whole: the next daemon has it
        assert creating.result() is not None
    assert events == [f"{slow_step} begins", f"{slow_step} ends", "destroy True"], events


def test_a_stop_during_the_snapshot_says_the_daemon_stops_not_a_failed_snapshot():
    """The cut snapshot's error was wrapped as an EIO snapshot failure, so a
    create waiting for the build booted a VM without a template while the
    daemon stopped (microvms.create takes ECANCELED as busy)."""
    import asyncio
    from pathlib import Path
    from types import SimpleNamespace

    from dsecd.engine.vmtemplates import TemplateService
    from dsecd.engine.workers import Workers

    class Backend:
        def create(self, name, *args):
            return SimpleNamespace(vm_dir=Path("/nonexistent"))

        async def connect(self, *args):
            pass

        async def snapshot(self, handle, state):
            await asyncio.sleep(3600)

        def destroy(self, name, handle):
            pass

    async def main():
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        service = TemplateService(Backend(), SimpleNamespace(get=lambda key: None), workers, 60.0, 0)
        creating = asyncio.ensure_future(service.get("k" * 64, [], [], SimpleNamespace(memory_bytes=4 * MIB),
                                                     1 << 20))
        await asyncio.sleep(0.2)
        await service.close()
        workers.shutdown()
        return creating

    creating = asyncio.run(main())
    with pytest.raises(templates.TemplateError) as info:
        creating.result()
    assert info.value.errno == errno.ECANCELED and "the daemon is stopping" in str(info.value)


def test_a_cancelled_wait_for_the_guest_ends_its_channel_task():
    """A create or template build cancelled while its guest boots: the task
    that waits for the monitor and the agent ends with it, instead of failing
    later on its own ("Task exception was never retrieved" in the log)."""
    import asyncio
    from types import SimpleNamespace

    from dsecd import native
    from dsecd.backends.microvm.backend import _unless_exits

    seen = []

    async def channels():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main():
        pidfd = native.pidfd_open(os.getpid())        # a QEMU that runs on
        try:
            waiting = asyncio.ensure_future(_unless_exits(SimpleNamespace(pidfd=pidfd, pidfd_lock=threading.Lock()), channels()))
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await asyncio.sleep(0)
            assert seen == ["cancelled"]
        finally:
            os.close(pidfd)

    asyncio.run(main())


def _restored(store, tmp_path):
    """A committed template and a private mapping of its memfd in this
    process, as a restored VM's QEMU has: fill_holes acts for a process
    that maps that very memfd."""
    import mmap

    t = store.commit("k1", _ram(), _state(tmp_path), {"layers": ["sha256:aa"]})
    return t, mmap.mmap(t.ram_fd, t.ram_size, mmap.MAP_PRIVATE, mmap.PROT_READ)


def _before_linux_6_7(real_mmap):
    """mmap as kernels before 6.7 do it: a shared mapping of a memfd sealed
    against writes is refused (EPERM) even read-only."""
    import fcntl
    import mmap

    def refusing(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, *args, **kw):
        if flags & mmap.MAP_SHARED and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_mmap(fd, length, flags, prot, *args, **kw)
    return refusing


def test_fill_holes_fills_a_sealed_memfd_on_kernels_before_6_7(store, tmp_path, monkeypatch):
    """fill_holes mapped the sealed memfd shared (read-only), which kernels
    before 6.7 refuse with EPERM: every pause of a VM restored from a
    template failed there. A private read-only mapping faults the memfd's
    pages in the same way."""
    t, qemu = _restored(store, tmp_path)
    with qemu:
        monkeypatch.setattr(templates.mmap, "mmap", _before_linux_6_7(templates.mmap.mmap))
        assert store.fill_holes("k1", os.getpid()) == t.ram_size - 3 * 4096
        assert list(templates._holes(t.ram_fd, t.ram_size)) == []
        assert os.pread(t.ram_fd, 4096, 0) == b"A" * 4096


def test_a_fill_holes_that_fails_is_logged_and_the_save_goes_on(store, tmp_path, monkeypatch, caplog):
    """Making the template's pages is an accounting nicety: a failure of it
    (here: no mapping) is logged and fill_holes returns, the save goes on."""
    t, qemu = _restored(store, tmp_path)

    def no_mapping(*args, **kw):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    with qemu:
        monkeypatch.setattr(templates.mmap, "mmap", no_mapping)
        assert store.fill_holes("k1", os.getpid()) == 0
    assert "Cannot allocate memory" in caplog.text


FILL_ON_A_FULL_TMPFS = """
import logging, mmap, os, sys
from pathlib import Path
from dsecd.backends.microvm.templates import Template, TemplateStore
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
root = Path(sys.argv[1])
fd = os.open(root / "ram", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 8 << 20)                  # larger than its tmpfs: its holes cannot all be made
os.pwrite(fd, b"A" * 4096, 0)
store = TemplateStore(root / "state", "g1", "q1", 2)
store._loaded["k1"] = Template(key="k1", dir=root, ram_fd=fd, ram_size=8 << 20)
with mmap.mmap(fd, 8 << 20, mmap.MAP_PRIVATE, mmap.PROT_READ):
    print("made", store.fill_holes("k1", os.getpid()), flush=True)
"""


def test_a_page_fill_holes_cannot_make_ends_the_fill_not_the_daemon(tmp_path):
    """MADV_POPULATE_READ fails with EFAULT where a page cannot be made (no
    room for it), and fill_holes then read each page itself, which the
    same failure kills with SIGBUS: the daemon died at a pause. It falls
    back to reading only where the kernel has no MADV_POPULATE_READ
    (EINVAL); any other failure is logged and the save goes on. Here the
    template's RAM is a file on a tmpfs smaller than it."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs in a mount namespace of its own")
    script = tmp_path / "fill.py"
    script.write_text(FILL_ON_A_FULL_TMPFS)
    root = tmp_path / "small"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$0" "$2" "$1"',
                          sys.executable, str(root), str(script)], env=env, capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0 and "cannot change root filesystem propagation" in out.stderr:
        # A chroot (the fresh-host check's root): its / is no mount, so no
        # mount namespace of its own can be made private, and a tmpfs
        # mounted without that would show on the host's side too.
        pytest.skip("no private mount namespace here (/ is not a mount point)")
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert "made 0" in out.stdout and "cannot make its unwritten pages" in out.stdout, out.stdout


def test_fill_holes_makes_the_pages_without_holding_the_store(store, tmp_path, monkeypatch):
    """Making a template's pages takes ~1 s per GiB; fill_holes held the
    store's lock meanwhile, so every create restoring a template (get)
    waited for it. The memfd is mapped under the lock (a drop meanwhile
    closes its fd; the mapping keeps the memfd), its pages made after."""
    t, qemu = _restored(store, tmp_path)
    locked = []

    class Watched(templates.mmap.mmap):
        def madvise(self, *args):
            locked.append(store._lock.locked())
            return super().madvise(*args)
    with qemu:
        monkeypatch.setattr(templates.mmap, "mmap", Watched)
        assert store.fill_holes("k1", os.getpid()) == t.ram_size - 3 * 4096
    assert locked and not any(locked), locked
    assert list(templates._holes(t.ram_fd, t.ram_size)) == []


def test_a_template_dropped_while_its_pages_are_made_loses_nothing(store, tmp_path, monkeypatch):
    """A drop while fill_holes makes the pages (outside the store's lock)
    closes the template's fd; the mapping fill_holes made keeps the memfd."""
    t, qemu = _restored(store, tmp_path)
    fd = os.dup(t.ram_fd)

    class Dropping(templates.mmap.mmap):
        def madvise(self, *args):
            store.drop("k1")
            return super().madvise(*args)
    try:
        with qemu:
            monkeypatch.setattr(templates.mmap, "mmap", Dropping)
            assert store.fill_holes("k1", os.getpid()) == 4 * MIB - 3 * 4096
        assert store.keys() == []
        assert list(templates._holes(fd, 4 * MIB)) == []
    finally:
        os.close(fd)


def test_the_listing_says_what_a_loaded_templates_memory_holds_now(store, tmp_path):
    """A loaded template's memfd holds the pages its boot wrote until the
    first pause of a VM restored from it, then the whole guest RAM: the
    listing said only the first (ram_data_bytes, from its build)."""
    t, qemu = _restored(store, tmp_path)
    with qemu:
        [before] = store.info()
        assert before["ram_data_bytes"] == before["held_bytes"] == 3 * 4096
        store.fill_holes("k1", os.getpid())
    [after] = store.info()
    assert after["ram_data_bytes"] == 3 * 4096 and after["held_bytes"] == t.ram_size
    store.drop("k1")
    store.commit("k2", _ram(), _state(tmp_path), {"layers": ["sha256:aa"]})
    assert TemplateStore(tmp_path / "state", "g1", "q1", 2).info()[0]["held_bytes"] == 0     # not loaded
