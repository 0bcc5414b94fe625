"""Destroys that meet other lifecycle steps (LifecycleService): a death's
dead record, written after its remains are released, must not undo a
destroy that came meanwhile; a second destroy while the first one thaws
a paused sandbox is refused, not run twice."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from dsecd.engine.lifecycle import LifecycleService
from dsecd.engine.sandboxes import Sandbox, SandboxRegistry
from dsecd.errors import Conflict
from dsecd.journal import Journal


class _Workers:
    async def run(self, fn, *args):
        return fn(*args)


class _ThreadWorkers:
    async def run(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

    def behind(self, fn, *args):
        pass


def _service(tmp_path, on_release) -> LifecycleService:
    svc = object.__new__(LifecycleService)
    svc.workers = _Workers()
    svc.registry = SandboxRegistry(Journal(tmp_path))
    svc.events = SimpleNamespace(publish=lambda *a, **k: None)
    svc.backend = SimpleNamespace(group_for=lambda sb_id: None)
    svc.layers = SimpleNamespace(release=lambda layers: None)
    svc.net = SimpleNamespace(detach_net=on_release)
    svc.stop_counting_oom = lambda sb_id, h, group: None
    return svc


def _sandbox() -> Sandbox:
    return Sandbox(id="sb1", image="busybox", state="running", created=0.0, limits={"cpu": 1, "memory": 1 << 20})


def test_a_sandbox_destroyed_while_it_is_marked_dead_stays_destroyed(tmp_path):
    sb = _sandbox()

    async def destroy_meanwhile(s):         # a client reacting to "died", or a TTL
        svc.registry.remove(s)

    svc = _service(tmp_path, destroy_meanwhile)
    svc.registry.add(sb)
    svc.registry.save(sb)
    asyncio.run(svc._mark_dead(sb, None, "its init exited"))
    assert "sb1" not in svc.registry.journal.load_all()


def test_a_dead_sandbox_keeps_its_record(tmp_path):
    sb = _sandbox()

    async def nothing(s):
        pass

    svc = _service(tmp_path, nothing)
    svc.registry.add(sb)
    svc.registry.save(sb)
    asyncio.run(svc._mark_dead(sb, None, "its init exited"))
    assert svc.registry.journal.load_all()["sb1"]["state"] == "dead"


def test_a_second_destroy_while_the_first_thaws_is_refused(tmp_path):
    sb = _sandbox()
    sb.state = "paused"
    thawing, thawed = threading.Event(), threading.Event()
    destroyed = []

    async def nothing(s):
        pass

    svc = _service(tmp_path, nothing)
    svc.workers = _ThreadWorkers()
    svc.memory = SimpleNamespace(damon_running=False, report_oom=lambda sb, n: None,
                                 before_destroy=lambda s, paused: (thawing.set(), thawed.wait(5)))
    svc.stop_counting_oom = lambda sb_id, h, group, backend: None
    svc.backend_of = lambda s: SimpleNamespace(release=None)
    svc.procs = SimpleNamespace(forget=lambda sb_id: None)
    svc.id_ranges = SimpleNamespace(release=lambda s: None)
    svc.events = SimpleNamespace(publish=lambda kind, sb_id, **k: destroyed.append(kind))
    svc.registry.add(sb)

    async def run():
        first = asyncio.ensure_future(svc.destroy_sandbox(sb, True))
        await asyncio.to_thread(thawing.wait, 5)
        try:
            await svc.destroy_sandbox(sb, True, "ttl")
        finally:
            thawed.set()
            await first

    with pytest.raises(Conflict, match="already being destroyed"):
        asyncio.run(run())
    assert destroyed == ["destroyed"]


def test_a_destroy_whose_record_cannot_be_deleted_still_releases_everything(tmp_path):
    """The state dir's disk full at a destroy: the sandbox is gone and its
    layers and event come as for any destroy; its record stays, and with it
    its id range (the next start reserves it again for the dead record)."""
    import errno

    sb = _sandbox()
    released = []

    async def nothing(s):
        pass

    svc = _service(tmp_path, nothing)
    svc.workers = _ThreadWorkers()
    svc.memory = SimpleNamespace(damon_running=False, report_oom=lambda sb, n: None)
    svc.stop_counting_oom = lambda sb_id, h, group, backend: None
    svc.backend_of = lambda s: SimpleNamespace(release=None)
    svc.procs = SimpleNamespace(forget=lambda sb_id: released.append("procs"))
    svc.id_ranges = SimpleNamespace(release=lambda s: released.append("ids"))
    svc.layers = SimpleNamespace(release=lambda layers: released.append("layers"))
    svc.events = SimpleNamespace(publish=lambda kind, sb_id, **k: released.append(kind))
    svc.registry.add(sb)
    svc.registry.save(sb)

    def full(key):
        raise OSError(errno.ENOSPC, "No space left on device")

    svc.registry.journal.delete = full
    assert asyncio.run(svc.destroy_sandbox(sb, True)) == {"id": "sb1", "previous_state": "running"}
    assert released == ["procs", "layers", "destroyed"]       # its id range stays with its record
    assert "sb1" not in svc.registry.by_id
