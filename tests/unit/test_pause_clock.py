"""A pause's clock (Sandbox.paused_for, which exec timeouts subtract): it
runs from the freeze on, through the reclaim that follows it, and a pause
that fails adds its frozen time but leaves the sandbox running."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from dsecd.engine import memory as memory_mod
from dsecd.engine.memory import MemoryService
from dsecd.engine.sandboxes import Sandbox
from dsecd.errors import DsecError
from dsecd.mem import pause


class _Workers:
    async def run(self, fn, *args):
        return await asyncio.to_thread(fn, *args)


def _service() -> MemoryService:
    svc = object.__new__(MemoryService)
    svc.workers = _Workers()
    svc._behind = {}
    svc.pause_cfg = None
    svc.registry = SimpleNamespace(save=lambda sb: None)
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
    asyncio.run(_service()._pause(sb))
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
        asyncio.run(_service()._pause(sb))
    assert sb.state == "running" and sb.paused_at is None
    before = sb.paused_for()
    assert before >= 0.19
    time.sleep(0.05)
    assert sb.paused_for() == before, "the clock runs on after a failed pause"


def test_a_cancelled_pause_request_stops_its_clock(monkeypatch):
    """Its client gone during a long reclaim: the request is cancelled,
    and the clock it started before the freeze stops with it."""
    sb = _sandbox()
    started = asyncio.Event()

    async def go():
        svc = _service()

        async def slow_run(fn, *args):
            started.set()
            await asyncio.sleep(30)

        svc.workers.run = slow_run
        task = asyncio.ensure_future(svc._pause(sb))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert sb.paused_at is None and sb.state == "running"


def test_a_job_pause_counts_paused_time_from_its_freeze(monkeypatch):
    """freeze_all waits for the slowest group while the others stand
    frozen; one it thawed again runs on with that time counted as paused."""
    frozen_sb, failed_sb = _sandbox(), _sandbox()
    failed_sb.id = "sb2"
    svc = _service()
    svc.registry = SimpleNamespace(of_job=lambda job, states: [frozen_sb, failed_sb],
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
    assert failed_sb.state == "running" and failed_sb.paused_at is None
    before = failed_sb.paused_for()
    assert before >= 0.29
    time.sleep(0.05)
    assert failed_sb.paused_for() == before, "the clock runs on for a sandbox the job pause thawed again"
