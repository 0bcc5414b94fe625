"""A call sandbox is admitted as a create's sandbox is (CreateService.hold_call_sandbox)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from journal_kit import MemoryJournal

from dsecd.engine.creates import CreateService
from dsecd.engine.sandboxes import SandboxRegistry
from dsecd.errors import Busy


def _service(max_sandboxes: int, queued: int, cpu_busy: bool = False) -> CreateService:
    svc = CreateService.__new__(CreateService)
    svc.registry = SandboxRegistry(MemoryJournal())
    svc.limits = {"max_sandboxes": max_sandboxes}
    svc.admission = SimpleNamespace(queued=queued)
    svc.adm_cfg = {"full_retry_after_s": 2.5}

    def admit(requested, cpu, memory, ls):
        if cpu_busy:
            raise Busy("host at capacity for cpu", {"resource": "cpu"})

    svc.cpu = SimpleNamespace(admit=admit)
    return svc


def test_a_call_sandbox_takes_no_slot_a_queued_create_was_let_in_for():
    svc = _service(max_sandboxes=2, queued=1)
    svc.registry.hold("fn-a", 1.0, 1 << 20)
    with pytest.raises(Busy, match="host is full: 1 sandboxes and 1 queued creates of max 2") as err:
        svc.hold_call_sandbox("fn-b", 1.0, 1 << 20)
    assert err.value.detail["retry_after_s"] == 2.5
    assert svc.registry.live_count() == 1


def test_a_call_sandbox_refused_for_cpu_or_memory_says_when_to_retry():
    svc = _service(max_sandboxes=8, queued=0, cpu_busy=True)
    with pytest.raises(Busy) as err:
        svc.hold_call_sandbox("fn-a", 1.0, 1 << 20)
    assert err.value.detail == {"resource": "cpu", "retry_after_s": 2.5}
    assert svc.registry.live_count() == 0


def test_an_admitted_call_sandbox_is_counted_until_released():
    svc = _service(max_sandboxes=1, queued=0)
    svc.hold_call_sandbox("fn-a", 0.5, 1 << 20)
    assert svc.registry.requested().call_sandboxes == 1
    svc.release_call_sandbox("fn-a")
    assert svc.registry.live_count() == 0


def test_a_create_drops_idle_call_sandboxes_only_when_the_host_has_no_room():
    """CreateService._room asks for idle call sandboxes to go only when the
    host refuses the create, and only as many as `enough` says make room:
    here the slot of one of the two held ones; without `drop` it only asks
    whether they would make it."""
    import asyncio

    svc = _service(max_sandboxes=3, queued=0)
    svc.registry.hold("fn-a", 1.0, 1 << 20)
    svc.registry.hold("fn-b", 1.0, 1 << 20)
    asked = []

    async def reclaim(enough, drop, purpose):
        asked.append([enough(["fn-a"]), enough(["fn-a", "fn-b"]), drop, purpose])
        if drop:
            svc.release_call_sandbox("fn-a")
        return True

    svc.reclaim_idle_calls = reclaim
    assert asyncio.run(svc._room(lambda gone: svc._full_with_queued(len(gone)))) is None
    assert asked == []                  # room: the call sandboxes are not looked at
    svc.registry.hold("fn-c", 1.0, 1 << 20)
    assert asyncio.run(svc._room(lambda gone: svc._full_with_queued(len(gone)), drop=False)) is None
    assert asked == [[True, True, False, "create"]] and svc.registry.live_count() == 3
    assert asyncio.run(svc._room(lambda gone: svc._full_with_queued(len(gone)))) is None
    assert asked[1:] == [[True, True, True, "create"]] and svc.registry.live_count() == 2
