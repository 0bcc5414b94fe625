"""A microVM resume that fails once its new QEMU runs (the saved state
loaded, the agent never answering): that QEMU is ended, the VM stays
paused in its saved state, and a later resume starts one of its own."""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsecd.backends.microvm.backend import Machine, VmError
from dsecd.engine.microvms import MicroVMService
from dsecd.errors import DsecError


class _Workers:
    async def run(self, fn, *args):
        return fn(*args)


class _Backend:
    def __init__(self):
        self.calls: list[str] = []

    def respawn(self, h, *args):
        self.calls.append("respawn")
        h.pidfd = 99            # its new QEMU

    async def restore(self, h, *args, **kw):
        self.calls.append("restore")
        raise VmError(errno.EIO, "microVM v1: the guest agent did not answer within 120s")

    def end_process(self, h):
        self.calls.append("end_process")
        h.pidfd = -1


def test_a_failed_resume_ends_the_qemu_it_started(tmp_path):
    backend = _Backend()
    svc = object.__new__(MicroVMService)
    svc.backend, svc.workers, svc.store_path = backend, _Workers(), lambda d: Path("/blobs") / d
    h = SimpleNamespace(machine=Machine(), vm_dir=tmp_path, pidfd=-1)
    sb = SimpleNamespace(id="v1", handle=h, layers=["sha256:aa"], limits={"cpu": 1.0, "disk": 1 << 20},
                         idmap=None, hostname="sb-v1", vm={}, net=None)
    svc.uid_fallback = 1000
    with pytest.raises(DsecError, match="its saved state stays"):
        asyncio.run(svc.resume(sb, {"vm_image": str(tmp_path / "paused.ram")}))
    assert backend.calls == ["respawn", "restore", "end_process"]
    assert h.pidfd == -1


def test_a_qemu_child_that_outlives_its_sigkill_is_said_not_to_have_exited(tmp_path):
    """end_process of a QEMU stuck in the kernel (D state: hung storage):
    Popen.wait's TimeoutExpired escaped it as an internal error, after the
    pause had saved the state; it now returns False, as for a re-adopted
    QEMU, and logs it."""
    import subprocess

    from dsecd.backends.microvm.backend import MicroVMBackend, VmHandle

    class StuckPopen:
        def wait(self, timeout=None):
            raise subprocess.TimeoutExpired("qemu", timeout)

    backend = object.__new__(MicroVMBackend)
    backend.destroy_timeout = 0.01
    h = VmHandle(init_pid=4242, init_start=0, pidfd=-1, group=None, vm_dir=tmp_path, is_child=True,
                 accel="tcg", popen=StuckPopen())
    assert backend.end_process(h) is False
    h.popen = SimpleNamespace(wait=lambda timeout=None: 0)
    assert backend.end_process(h) is True


def test_a_pause_whose_qemu_does_not_exit_says_so_and_what_to_do(tmp_path):
    from dsecd.engine.microvms import MicroVMService

    class Saving(_Backend):
        async def save(self, h, image, run):
            return 1 << 20

        def end_process(self, h):
            return False

    svc = object.__new__(MicroVMService)
    svc.backend, svc.workers, svc.watch, svc.net = Saving(), _Workers(), None, None
    svc._requests, svc._watches = {}, {}
    svc.workers.loop = SimpleNamespace(remove_reader=lambda fd: None)
    h = SimpleNamespace(machine=Machine(), vm_dir=tmp_path, pidfd=5, init_pid=4242, group=None)
    sb = SimpleNamespace(id="v1", handle=h, net=None, vm={}, execs=0)
    with pytest.raises(DsecError, match=r"QEMU \(pid 4242\) did not exit after SIGKILL.*destroy the sandbox"):
        asyncio.run(svc.pause(sb))


def test_the_wait_for_a_guest_ends_when_a_destroy_ends_its_qemu(tmp_path):
    """A destroy takes no sandbox lock: one during a resume's wait for the
    new QEMU's monitor removed the loop's reader of the handle's pidfd (the
    one the wait watched), closed the fd and killed QEMU, so the wait went
    on to the monitor's connect timeout: the resume hung for 120 s. The wait
    watches a pidfd of its own, and ends when QEMU does."""
    import os
    import subprocess

    from dsecd.backends.microvm.backend import _unless_exits

    qemu = subprocess.Popen(["sleep", "600"])
    h = SimpleNamespace(pidfd=os.pidfd_open(qemu.pid), pidfd_lock=threading.Lock())

    async def destroy_meanwhile():
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        loop.remove_reader(h.pidfd)             # LifecycleService._teardown
        qemu.kill()                             # MicroVMBackend.stop
        os.close(h.pidfd)                       # MicroVMBackend.release
        h.pidfd = -1

    async def go():
        destroy = asyncio.ensure_future(destroy_meanwhile())
        try:
            # The work stands for the monitor's connect, retried until its timeout.
            with pytest.raises(VmError, match="QEMU exited"):
                await asyncio.wait_for(_unless_exits(h, asyncio.sleep(3600)), 30)
        finally:
            await destroy

    try:
        asyncio.run(go())
    finally:
        qemu.kill()
        qemu.wait()


def test_a_resume_a_destroy_cut_short_ends_the_qemu_it_started(tmp_path):
    """A destroy during the restore takes the sandbox's handle (sb.handle
    None): the failed resume's clean-up reached for QEMU through it and
    failed with AttributeError. It ends the QEMU it started, through its own
    handle."""
    class Destroyed(_Backend):
        async def restore(self, h, *args, **kw):
            self.calls.append("restore")
            sb.handle = None                 # LifecycleService._teardown
            raise VmError(errno.ESRCH, "QEMU exited")

        def end_process(self, h):
            assert h is handle
            return super().end_process(h)

    backend = Destroyed()
    svc = object.__new__(MicroVMService)
    svc.backend, svc.workers, svc.store_path = backend, _Workers(), lambda d: Path("/blobs") / d
    svc.uid_fallback, svc.net = 1000, None
    handle = SimpleNamespace(machine=Machine(), vm_dir=tmp_path, pidfd=-1)
    sb = SimpleNamespace(id="v1", handle=handle, layers=["sha256:aa"], limits={"cpu": 1.0, "disk": 1 << 20},
                         idmap=None, hostname="sb-v1", vm={}, net=None)
    with pytest.raises(DsecError, match="QEMU exited"):
        asyncio.run(svc.resume(sb, {"vm_image": str(tmp_path / "paused.ram")}))
    assert backend.calls == ["respawn", "restore", "end_process"]


def test_a_pause_whose_save_a_destroy_cut_short_leaves_the_dead_vm_unwatched(tmp_path):
    """A destroy during the save took the handle: the pause's error path
    watched the sandbox's QEMU again through sb.handle and failed with
    AttributeError. Only a handle still the sandbox's is watched again."""
    from dsecd.backends.microvm.qmp import QMPError

    class Cut(_Backend):
        async def save(self, h, image, run):
            sb.handle = None                 # LifecycleService._teardown
            raise QMPError("microVM v1: QMP monitor closed")

    watched = []
    svc = object.__new__(MicroVMService)
    svc.backend, svc.workers, svc.watch, svc.net = Cut(), _Workers(), watched.append, None
    svc._requests, svc._watches = {}, {}
    svc.workers.loop = SimpleNamespace(remove_reader=lambda fd: None)
    h = SimpleNamespace(machine=Machine(), vm_dir=tmp_path, pidfd=5, init_pid=4242, group=None)
    sb = SimpleNamespace(id="v1", handle=h, net=None, vm={}, execs=0)
    with pytest.raises(DsecError, match="monitor closed"):
        asyncio.run(svc.pause(sb))
    assert watched == []


def test_a_command_on_a_closed_monitor_is_a_qmp_error():
    """A destroy closes the VM's monitor under a pause's or resume's next
    command: under uvloop (the daemon's loop) the write raised RuntimeError,
    which no caller maps. It is a QMPError (an OSError), as a monitor that
    QEMU closed is."""
    import socket

    import uvloop

    from dsecd.backends.microvm.qmp import QMP, QMPError

    async def go():
        ours, qemus = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        qmp = QMP(reader, writer, "microVM v1")
        qmp.close()
        await writer.wait_closed()
        try:
            for send in (lambda: qmp.command("query-migrate"), lambda: qmp.send_fd("state-out", 0)):
                with pytest.raises(QMPError, match="monitor closed"):
                    await send()
        finally:
            qemus.close()

    uvloop.run(go())


@pytest.mark.parametrize("execs,copies,said", [(1, 1, "1 directory copy under way"), (2, 0, "2 running exec(s)"),
                                                (3, 1, "2 running exec(s) and 1 directory copy under way")])
def test_a_pause_refused_for_a_copy_under_way_says_so(tmp_path, execs, copies, said):
    """A directory copy runs as an exec of the guest agent, and a pause it
    refused said the VM had a running exec, which the user had not
    started: it names the copies apart."""
    from dsecd.errors import Conflict

    svc = object.__new__(MicroVMService)
    svc.backend = _Backend()
    h = SimpleNamespace(machine=Machine(), vm_dir=tmp_path, pidfd=5, init_pid=4242, group=None)
    sb = SimpleNamespace(id="v1", handle=h, net=None, vm={}, execs=execs, copies=copies)
    with pytest.raises(Conflict) as err:
        asyncio.run(svc.pause(sb))
    assert f"has {said};" in err.value.message, err.value.message


def test_the_wait_for_a_guest_whose_qemu_was_already_ended_closes_its_work():
    """A destroy that ended QEMU before the wait began (its pidfd closed):
    the wait fails at once, and the work it was given, a coroutine never
    started, was left unawaited (a RuntimeWarning at its collection). It is
    closed."""
    import gc
    import inspect
    import warnings

    from dsecd.backends.microvm.backend import _unless_exits

    h = SimpleNamespace(pidfd=-1, pidfd_lock=threading.Lock())
    work = asyncio.sleep(3600)
    with pytest.raises(VmError, match="ended meanwhile"):
        asyncio.run(_unless_exits(h, work))
    state = inspect.getcoroutinestate(work)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del work
        gc.collect()
    assert state == inspect.CORO_CLOSED
    assert not [w for w in seen if "never awaited" in str(w.message)]
