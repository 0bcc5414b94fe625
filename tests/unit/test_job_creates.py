"""Job ops (job_pause, job_resume, job_rm) and the creates of the job still
under way when they begin: a create that ends after the op began joins it
(its sandbox paused, resumed, or destroyed and the create refused), as the
sandboxes the op found running did."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from journal_kit import MemoryJournal

from dsecd.admission import CreateQueue
from dsecd.engine import memory as memory_mod
from dsecd.engine.creates import CreateService
from dsecd.engine.lifecycle import LifecycleService
from dsecd.engine.memory import MemoryService
from dsecd.engine.sandboxes import Sandbox, SandboxRegistry
from dsecd.errors import Conflict, NotFound
from dsecd.mem import pause


class _Workers:
    loop: asyncio.AbstractEventLoop

    async def run(self, fn, *args):
        return await asyncio.to_thread(fn, *args)


def _sandbox(sb_id: str, job: str = "j") -> Sandbox:
    return Sandbox(id=sb_id, image="busybox", state="running", created=0.0, limits={"cpu": 1.0, "memory": 1 << 20},
                   labels={"job": job}, handle=SimpleNamespace(group=object(), init_pid=1, init_start=0))


class World:
    """A registry, the memory and lifecycle services' job ops (freezes and
    destroys stood in for), and a create service whose create itself waits
    for `made` (a slow create: its image pulled, its layers mounted)."""

    def __init__(self, monkeypatch, *sbs: Sandbox):
        self.registry = SandboxRegistry(MemoryJournal())
        for sb in sbs:
            self.registry.add(sb)
        self.workers = _Workers()
        self.destroyed: list[tuple[str, str]] = []
        self.frozen: list[str] = []

        mem = object.__new__(MemoryService)
        mem.workers, mem.registry, mem._behind, mem.mem_pool, mem.vms = self.workers, self.registry, {}, None, None
        mem.pause_cfg = SimpleNamespace(freeze_timeout_s=1.0, prefetch_mode="none")
        mem.events = SimpleNamespace(publish=lambda *a, **k: None)
        self.memory = mem
        monkeypatch.setattr(memory_mod.pause.Freezer, "of", staticmethod(lambda group: group))
        monkeypatch.setattr(memory_mod.pause, "freeze_all", lambda fs, timeout: [])
        monkeypatch.setattr(memory_mod.pause, "thaw_all", lambda fs, timeout: [])
        monkeypatch.setattr(memory_mod.pause, "reclaim_frozen", lambda group, cfg: pause.PauseRecord())

        def pause_one(group, cfg):
            self.frozen.append(next(s.id for s in self.registry.by_id.values() if s.handle.group is group))
            return pause.PauseRecord()

        monkeypatch.setattr(memory_mod.pause, "pause", pause_one)

        life = object.__new__(LifecycleService)
        life.registry = self.registry

        async def destroy_sandbox(sb, force, reason="request"):
            self.destroyed.append((sb.id, reason))
            sb.state = "stopping"
            self.registry.by_id.pop(sb.id)
            return {"id": sb.id, "previous_state": "running"}

        life.destroy_sandbox = destroy_sandbox
        self.lifecycle = life

        creates = object.__new__(CreateService)
        creates.registry, creates.memory, creates.lifecycle, creates.workers = \
            self.registry, mem, life, self.workers
        creates.limits = {"max_sandboxes": 100}
        creates.adm_cfg = {"full_retry_after_s": 1.0}
        creates.admission = CreateQueue(4, 10)
        creates._limits_for = lambda req: None
        creates.policy_for_create = lambda policy: None

        async def no_pool(req, limits):
            return None

        creates._take_from_pool = no_pool
        self.made = asyncio.Event()
        self.creating = asyncio.Event()

        async def create_now(req, ctx, image=None):
            self.creating.set()
            await self.made.wait()
            sb = _sandbox("new", req.labels["job"])
            self.registry.add(sb)
            return sb.public()

        creates.create_now = create_now
        self.creates = creates

    async def create_under_way(self, job: str = "j") -> asyncio.Task:
        """A create of `job`, waiting for `made`."""
        self.workers.loop = asyncio.get_running_loop()
        req = SimpleNamespace(labels={"job": job}, hostname=None, policy=None, image="busybox")
        task = asyncio.ensure_future(self.creates._create_admitted(req))
        await self.creating.wait()
        return task


def test_a_create_under_way_when_its_job_is_paused_is_paused_once_made(monkeypatch):
    w = World(monkeypatch, _sandbox("old"))

    async def main():
        create = await w.create_under_way()
        r = await w.memory.job_pause(SimpleNamespace(job="j"), None)
        assert r["paused"] == ["old"]
        w.made.set()
        return await create

    made = asyncio.run(main())
    assert made["id"] == "new" and made["state"] == "paused", made
    assert w.registry.by_id["new"].state == "paused" and w.frozen == ["new"]


def test_a_create_under_way_when_its_job_is_removed_is_destroyed_and_refused(monkeypatch):
    w = World(monkeypatch, _sandbox("old"))

    async def main():
        create = await w.create_under_way()
        r = await w.lifecycle.job_rm(SimpleNamespace(job="j", force=False), None)
        assert r["destroyed"] == ["old"]
        w.made.set()
        with pytest.raises(Conflict, match="job j was removed .* while this create ran"):
            await create

    asyncio.run(main())
    assert w.destroyed == [("old", "job"), ("new", "job")]
    assert "new" not in w.registry.by_id


def test_a_job_whose_only_sandbox_is_being_made_is_not_missing(monkeypatch):
    """job_pause of a job with nothing made yet but a create under way is
    no not_found: that create's sandbox is the job's, paused once made."""
    w = World(monkeypatch)

    async def main():
        with pytest.raises(NotFound):
            await w.memory.job_pause(SimpleNamespace(job="j"), None)
        create = await w.create_under_way()
        r = await w.memory.job_pause(SimpleNamespace(job="j"), None)
        assert r["paused"] == []
        w.made.set()
        return await create

    assert asyncio.run(main())["state"] == "paused"


def test_the_last_job_op_wins_and_other_jobs_and_later_creates_are_left_alone(monkeypatch):
    """A pause then a resume during the create: it runs, never paused. A
    create of another job, or one begun after the op, is not the op's."""
    w = World(monkeypatch, _sandbox("old"), _sandbox("other", job="k"))

    async def main():
        create = await w.create_under_way()
        await w.memory.job_pause(SimpleNamespace(job="j"), None)
        await w.memory.job_resume(SimpleNamespace(job="j"), None)
        await w.memory.job_pause(SimpleNamespace(job="k"), None)
        w.made.set()
        made = await create
        assert made["state"] == "running" and w.frozen == []
        w.registry.by_id.pop("new")
        w.made.clear()
        w.creating.clear()
        create = await w.create_under_way("k")     # begun after k's pause
        w.made.set()
        return await create

    assert asyncio.run(main())["state"] == "running"
    assert w.frozen == []


class _Gate:
    """A freeze_all that stands until `open`: `freezing` is set once it began."""

    def __init__(self, monkeypatch, events: list):
        self.freezing = asyncio.Event()
        self.opened = threading.Event()
        loop = asyncio.get_running_loop()

        def freeze_all(fs, timeout):
            loop.call_soon_threadsafe(self.freezing.set)
            self.opened.wait(10)
            events.append("frozen")
            return []

        monkeypatch.setattr(memory_mod.pause, "freeze_all", freeze_all)


def test_a_job_resume_sent_during_a_job_pause_resumes_what_it_paused(monkeypatch):
    """job_resume listed the job's paused sandboxes while a job_pause was
    still freezing them (their state said running): it resumed none, and
    the job stayed paused although the resume came last."""
    w = World(monkeypatch, _sandbox("old"))
    events: list = []

    async def main():
        w.workers.loop = asyncio.get_running_loop()
        gate = _Gate(monkeypatch, events)
        paused = asyncio.ensure_future(w.memory.job_pause(SimpleNamespace(job="j"), None))
        await gate.freezing.wait()
        resumed = asyncio.ensure_future(w.memory.job_resume(SimpleNamespace(job="j"), None))
        await asyncio.sleep(0)
        gate.opened.set()
        return await paused, await resumed

    paused, resumed = asyncio.run(main())
    assert paused["paused"] == ["old"] and resumed["resumed"] == ["old"], (paused, resumed)
    assert w.registry.by_id["old"].state == "running"


def test_a_request_during_a_job_pauses_freeze_waits_for_it_then_resumes(monkeypatch):
    """An exec or file request (ensure_running) that came while a job pause
    froze its sandbox went ahead, its state still running, and its process
    then stood frozen; it waits for the freeze's end, and resumes it."""
    w = World(monkeypatch, _sandbox("old"))
    w.memory.auto_resume = True
    monkeypatch.setattr(memory_mod.pause, "resume",
                        lambda group, rec, timeout, mode: SimpleNamespace(prefetched_bytes=0, thaw_s=0.0,
                                                                          prefetch_s=0.0))
    events: list = []

    async def main():
        w.workers.loop = asyncio.get_running_loop()
        gate = _Gate(monkeypatch, events)
        paused = asyncio.ensure_future(w.memory.job_pause(SimpleNamespace(job="j"), None))
        await gate.freezing.wait()
        sb = w.registry.by_id["old"]
        request = asyncio.ensure_future(w.memory.ensure_running(sb, "exec"))
        request.add_done_callback(lambda _: events.append(f"request goes on, {sb.state}"))
        await asyncio.sleep(0)
        gate.opened.set()
        await paused
        await request

    asyncio.run(main())
    assert events == ["frozen", "request goes on, running"], events


def test_a_job_rm_during_a_job_pause_destroys_after_the_freeze(monkeypatch):
    w = World(monkeypatch, _sandbox("old"))
    events: list = []

    async def main():
        w.workers.loop = asyncio.get_running_loop()
        gate = _Gate(monkeypatch, events)
        paused = asyncio.ensure_future(w.memory.job_pause(SimpleNamespace(job="j"), None))
        await gate.freezing.wait()
        removed = asyncio.ensure_future(w.lifecycle.job_rm(SimpleNamespace(job="j", force=True), None))
        removed.add_done_callback(lambda _: events.append("removed"))
        await asyncio.sleep(0)
        gate.opened.set()
        return await paused, await removed

    paused, removed = asyncio.run(main())
    assert paused["paused"] == ["old"] and removed["destroyed"] == ["old"]
    assert events == ["frozen", "removed"]
