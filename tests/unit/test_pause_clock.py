"""A pause's clock (Sandbox.paused_for, which exec timeouts subtract): it
runs from the freeze on, through the reclaim that follows it, and a pause
that fails adds its frozen time but leaves the sandbox running."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from dsecd.engine import memory as memory_mod
from dsecd.engine.memory import MemoryService
from dsecd.engine.sandboxes import Sandbox, SandboxRegistry
from dsecd.errors import Conflict, DsecError
from dsecd.mem import pause


class _Workers:
    async def run(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

    def behind(self, fn, *args):
        return asyncio.ensure_future(asyncio.to_thread(fn, *args))


class _Registry(SimpleNamespace):
    """The registry's attributes a test gives, and its real destroyed check."""
    listed = SandboxRegistry.listed
    destroyed_error = SandboxRegistry.destroyed_error
    job_lock = SandboxRegistry.job_lock

    def __init__(self, **kw):
        super().__init__(_job_locks={}, **kw)


def _service(*sbs) -> MemoryService:
    svc = object.__new__(MemoryService)
    svc.workers = _Workers()
    svc._behind = {}
    svc.pause_cfg = None
    svc.registry = _Registry(save=lambda sb: None, by_id={sb.id: sb for sb in sbs})
    svc.events = SimpleNamespace(publish=lambda *a, **k: None)
    return svc


def _sandbox() -> Sandbox:
    return Sandbox(id="sb1", image="busybox", state="running", created=0.0, limits={},
                   handle=SimpleNamespace(group=None))


def test_paused_time_counts_from_the_freeze_through_the_reclaim(monkeypatch):
    sb, seen = _sandbox(), []

    def slow_pause(group, cfg):           # freezes, then reclaims for a while
        time.sleep(0.3)
        seen.append(sb.paused_for())
        return pause.PauseRecord(frozen_s=0.0, reclaim_s=0.3)

    monkeypatch.setattr(memory_mod.pause, "pause", slow_pause)
    asyncio.run(_service(sb)._pause(sb))
    assert sb.state == "paused"
    assert seen[0] >= 0.29, "the reclaim's time counted as run time"
    assert sb.paused_for() >= 0.3


def test_a_pause_that_fails_keeps_its_frozen_time_and_the_sandbox_running(monkeypatch):
    sb = _sandbox()

    def failing_pause(group, cfg):
        time.sleep(0.2)
        raise pause.PauseError(16, "tasks not frozen after 0.2s; thawed again")

    monkeypatch.setattr(memory_mod.pause, "pause", failing_pause)
    with pytest.raises(DsecError):
        asyncio.run(_service(sb)._pause(sb))
    _ran_on_with_its_frozen_time(sb, 0.19)


def test_a_cancelled_pause_request_still_pauses_the_sandbox(monkeypatch):
    """Its client gone during a long reclaim: the request is cancelled, but
    the freeze goes on in its worker thread, so the pause finishes: the
    sandbox's state says paused, as its freezer does, and its clock runs."""
    sb = _sandbox()
    go_on = threading.Event()

    def slow_pause(group, cfg):
        go_on.wait(5)
        return pause.PauseRecord(frozen_s=0.0, reclaim_s=0.1)

    monkeypatch.setattr(memory_mod.pause, "pause", slow_pause)

    async def go():
        # The reclaim ends after the cancel: the cancelled request ends after it.
        asyncio.get_running_loop().call_later(0.1, go_on.set)
        await _cancelled_meanwhile(_service(sb)._pause(sb))
        assert sb.state == "paused"

    asyncio.run(go())
    assert sb.state == "paused" and sb.paused_at is not None


def test_a_cancelled_job_pause_still_pauses_the_job(monkeypatch):
    sb = _sandbox()
    sb.handle = SimpleNamespace(group=object(), init_pid=1, init_start=0)
    svc = _service()
    svc.registry = _Registry(job_op_begun=lambda job, op, states: [sb], by_id={"sb1": sb},
                             journal=SimpleNamespace(write_many=lambda records: None))
    svc.pause_cfg = SimpleNamespace(freeze_timeout_s=1.0)
    go_on = threading.Event()
    monkeypatch.setattr(memory_mod.pause.Freezer, "of", staticmethod(lambda group: "f1"))
    monkeypatch.setattr(memory_mod.pause, "freeze_all", lambda fs, timeout: go_on.wait(5) and [])
    monkeypatch.setattr(memory_mod.pause, "reclaim_frozen", lambda group, cfg: pause.PauseRecord())

    async def go():
        svc.workers.loop = asyncio.get_running_loop()
        svc.vms = None
        # The freeze ends after the cancel: the cancelled request ends after it.
        svc.workers.loop.call_later(0.1, go_on.set)
        await _cancelled_meanwhile(svc.job_pause(SimpleNamespace(job="j"), None))
        assert sb.state == "paused"
        await asyncio.sleep(0.05)           # the reclaim behind the answer

    asyncio.run(go())
    assert sb.state == "paused" and sb.paused_at is not None


def test_a_snapshot_cancelled_during_its_freeze_thaws_the_sandbox_and_stops_its_clock(monkeypatch):
    from dsecd.engine import images as images_mod
    from dsecd.engine.images import ImageService

    sb = _sandbox()
    calls = []

    class Freezer:
        def freeze(self, timeout):
            time.sleep(0.2)
            calls.append("freeze")

        def thaw(self):
            calls.append("thaw")

    monkeypatch.setattr(images_mod.pause.Freezer, "of", staticmethod(lambda group: Freezer()))
    svc = object.__new__(ImageService)
    svc.workers = _Workers()
    svc.freeze_timeout_s = 1.0

    async def snapshot():
        async with svc.frozen_upper(sb):
            raise AssertionError("packed although cancelled")

    asyncio.run(_cancelled_meanwhile(snapshot()))
    assert calls == ["freeze", "thaw"]
    assert sb.state == "running" and sb.paused_at is None


def _ran_on_with_its_frozen_time(sb, frozen_s: float) -> None:
    """A sandbox a pause froze, then thawed again: running, the time it was
    frozen (at least `frozen_s`) counted as paused, and its clock stopped."""
    assert sb.state == "running" and sb.paused_at is None
    before = sb.paused_for()
    assert before >= frozen_s
    time.sleep(0.05)
    assert sb.paused_for() == before, "the pause clock runs on"


async def _cancelled_meanwhile(coro) -> None:
    """Run `coro` as a request, cancel it 50 ms in; its caller sees the cancel."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_job_pause_counts_paused_time_from_its_freeze(monkeypatch):
    """freeze_all waits for the slowest group while the others stand
    frozen; one it thawed again runs on with that time counted as paused."""
    frozen_sb, failed_sb = _sandbox(), _sandbox()
    failed_sb.id = "sb2"
    svc = _service()
    svc.registry = _Registry(job_op_begun=lambda job, op, states: [frozen_sb, failed_sb],
                             by_id={"sb1": frozen_sb, "sb2": failed_sb},
                             journal=SimpleNamespace(write_many=lambda records: None))
    svc.mem_pool = None
    for sb in (frozen_sb, failed_sb):
        sb.handle = SimpleNamespace(group=object(), init_pid=1, init_start=0)
    freezers = {id(frozen_sb.handle.group): "f1", id(failed_sb.handle.group): "f2"}
    monkeypatch.setattr(memory_mod.pause.Freezer, "of", staticmethod(lambda group: freezers[id(group)]))
    monkeypatch.setattr(memory_mod.pause, "reclaim_frozen", lambda group, cfg: pause.PauseRecord())

    def slow_freeze_all(fs, timeout):       # the slowest group takes its time, then is thawed again
        time.sleep(0.3)
        return ["f2"]

    monkeypatch.setattr(memory_mod.pause, "freeze_all", slow_freeze_all)
    svc.pause_cfg = SimpleNamespace(freeze_timeout_s=0.3)

    async def main():
        svc.workers.loop = asyncio.get_running_loop()
        svc.vms = None
        r = await svc.job_pause(SimpleNamespace(job="j"), None)
        await asyncio.sleep(0.05)           # the reclaim behind the answer
        return r

    r = asyncio.run(main())
    assert r["paused"] == ["sb1"] and r["failed"] == ["sb2"]
    assert frozen_sb.state == "paused" and frozen_sb.paused_for() >= 0.29, "the freeze's wait counted as run time"
    _ran_on_with_its_frozen_time(failed_sb, 0.29)


def test_a_pause_cancelled_before_it_began_never_runs(monkeypatch):
    """Queued behind a snapshot (which holds the sandbox's lock), a pause
    whose client gives up is called off: it does not pause the sandbox
    once the lock is free."""
    sb = _sandbox()
    ran = []
    monkeypatch.setattr(memory_mod.pause, "pause", lambda group, cfg: ran.append(1) or pause.PauseRecord())

    async def go():
        await sb.lock.acquire()
        task = asyncio.ensure_future(_service(sb)._pause(sb))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        sb.lock.release()
        await asyncio.sleep(0.1)
        return sb.lock.locked()

    assert asyncio.run(go()) is False
    assert ran == [] and sb.state == "running" and sb.paused_at is None


def test_a_pause_that_outlives_a_destroy_writes_no_record(monkeypatch):
    """A destroy takes no sandbox lock: one that came during the freeze has
    deleted the sandbox's journal record, and a pause recorded after it
    would make the next daemon adopt a ghost."""
    sb = _sandbox()
    svc = _service(sb)
    saved = []
    svc.registry.save = saved.append

    def pause_while_destroyed(group, cfg):
        sb.state = "stopping"
        svc.registry.by_id.pop(sb.id)
        return pause.PauseRecord()

    monkeypatch.setattr(memory_mod.pause, "pause", pause_while_destroyed)
    with pytest.raises(Conflict, match="pause: sandbox .* was destroyed meanwhile"):
        asyncio.run(svc._pause(sb))
    assert saved == [] and sb.paused_at is None


def test_a_snapshot_cancelled_twice_still_thaws_its_sandbox(monkeypatch, tmp_path):
    """A `cancel`, then the client's connection closing, cancel a snapshot
    twice: its thaw, queued behind a busy worker, must not be dropped."""
    from dsecd.engine import images as images_mod
    from dsecd.engine.images import ImageService
    from dsecd.engine.workers import Workers

    calls = []

    class Freezer:
        def freeze(self, timeout):
            calls.append("freeze")

        def thaw(self):
            calls.append("thaw")

    monkeypatch.setattr(images_mod.pause.Freezer, "of", staticmethod(lambda group: Freezer()))
    sb = _sandbox()
    sb.handle.upper_view = lambda: lambda views: ("/upper", lambda: calls.append("undo"))
    svc = object.__new__(ImageService)
    svc.workers = Workers(1)
    svc.freeze_timeout_s = 1.0
    svc.state_dir = tmp_path
    svc.registry = _Registry(by_id={sb.id: sb})
    busy = threading.Event()

    async def snapshot():
        async with svc.frozen_upper(sb):
            svc.workers.behind(busy.wait, 0.5)      # the pool's one thread taken meanwhile
            await asyncio.sleep(10)

    async def go():
        svc.workers.start(asyncio.get_running_loop())
        task = asyncio.ensure_future(snapshot())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(go())
    finally:
        svc.workers.shutdown()
    assert calls == ["freeze", "undo", "thaw"]
    assert sb.state == "running" and sb.paused_at is None and not sb.lock.locked()


@pytest.mark.parametrize("op", ["pause", "resume"])
def test_a_vm_pause_or_resume_a_destroy_cut_short_says_so(op):
    """A destroy takes no sandbox lock: one during a microVM's save or load
    ends its QEMU under it, and the step that then fails (a write to the
    closed monitor, say) made the request an `internal` error. It is a
    conflict saying the sandbox was destroyed meanwhile; a failure with no
    destroy behind it is still itself."""
    from dsecd.backends.microvm.qmp import QMPError

    for destroyed in (True, False):
        sb = _sandbox()
        sb.backend = "microvm"
        if op == "resume":
            sb.state, sb.pause_record = "paused", {"vm_image": "/nonexistent"}
        svc = _service(sb)
        svc.auto_resume = True

        async def cut(*args, sb=sb, svc=svc, destroyed=destroyed):
            if destroyed:
                sb.state = "stopping"
                svc.registry.by_id.pop(sb.id)
            raise QMPError("microVM sb1: QMP monitor closed")

        svc.vms = SimpleNamespace(pause=cut, resume=cut)
        run = svc._pause(sb) if op == "pause" else svc._resume(sb)
        if destroyed:
            with pytest.raises(Conflict, match=f"{op}: sandbox sb1 was destroyed meanwhile"):
                asyncio.run(run)
        else:
            with pytest.raises(QMPError, match="monitor closed"):
                asyncio.run(run)


@pytest.mark.parametrize("failure", ["monitor closed", "handle taken"])
def test_a_job_paused_vm_destroyed_during_its_save_is_let_go_quietly(failure, caplog):
    """Behind a job pause's answer a microVM's state is saved; a destroy
    meanwhile (it takes no sandbox lock) ends QEMU under the save, which
    then logged that the VM "stays stopped in its QEMU" (a QEMU gone with
    the sandbox), or, where the save failed on the taken handle, left an
    exception no task retrieved. A destroyed VM's save is let go quietly."""
    from dsecd.backends.microvm.qmp import QMPError

    sb = _sandbox()
    sb.backend, sb.state, sb.pause_record = "microvm", "paused", {"vm_stopped": True}
    svc = _service(sb)

    async def save(s):
        s.state = "stopping"
        svc.registry.by_id.pop(s.id)
        if failure == "monitor closed":
            raise DsecError(f"pause sandbox {s.id}: {QMPError('QMP monitor closed')}", code="io")
        raise ValueError("Invalid file descriptor: -1")

    svc.vms = SimpleNamespace(pause=save, watching=lambda s: 0, requests_under_way=lambda s: 0)
    with caplog.at_level("DEBUG", logger="dsecd.engine.memory"):
        asyncio.run(svc._save_stopped_vm(sb))
    assert [r for r in caplog.records if r.levelno >= 30] == []
