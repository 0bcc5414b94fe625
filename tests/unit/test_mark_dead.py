"""A sandbox whose init exits is kept, as dead, until destroyed
(LifecycleService._mark_dead): a destroy that comes while its remains are
released must not be undone by the dead record written after it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dsecd.engine.lifecycle import LifecycleService
from dsecd.engine.sandboxes import Sandbox, SandboxRegistry
from dsecd.journal import Journal


class _Workers:
    async def run(self, fn, *args):
        return fn(*args)


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
