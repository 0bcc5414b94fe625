"""Leases and idle TTLs (dsecd/engine/lifetimes.py): a new lease length
outlives a daemon restart; a copy running keeps a sandbox busy (no root)."""

from __future__ import annotations

import asyncio

from dsecd.engine.lifetimes import LifetimeService
from dsecd.engine.sandboxes import Sandbox, SandboxRegistry
from dsecd.journal import Journal
from dsecd.protocol import Renew


def _service(tmp_path) -> tuple[LifetimeService, SandboxRegistry]:
    registry = SandboxRegistry(Journal(tmp_path))
    return LifetimeService(registry, None, None, None, None), registry


def _sandbox(registry: SandboxRegistry, lease: float | None) -> Sandbox:
    sb = Sandbox(id="abc123def456", image="busybox", state="running", created=0.0,
                 limits={"cpu": 1.0, "memory": 1 << 28}, lease=lease)
    registry.add(sb)
    registry.save(sb)
    return sb


def test_a_new_lease_length_is_journaled(tmp_path):
    lifetimes, registry = _service(tmp_path)
    sb = _sandbox(registry, lease=3.0)
    out = asyncio.run(lifetimes.renew(Renew(sandboxes=[sb.id], lease="60s"), None))
    assert out == {"renewed": [sb.id], "missing": [], "no_lease": []}
    registry.journal.close()
    # What the next daemon re-adopts it with: the lease the client asked for,
    # not the create's 3 s, which would end it before the client renews again.
    assert Journal(tmp_path).load_all()[sb.id]["lease"] == 60.0


def test_a_lease_given_by_renew_alone_is_journaled(tmp_path):
    lifetimes, registry = _service(tmp_path)
    sb = _sandbox(registry, lease=None)
    asyncio.run(lifetimes.renew(Renew(sandboxes=[sb.id], lease=30), None))
    registry.journal.close()
    assert Journal(tmp_path).load_all()[sb.id]["lease"] == 30.0


def test_a_renew_of_the_same_length_writes_nothing(tmp_path):
    lifetimes, registry = _service(tmp_path)
    sb = _sandbox(registry, lease=30.0)
    lines = registry.journal.lines
    for _ in range(3):
        asyncio.run(lifetimes.renew(Renew(sandboxes=[sb.id], lease=30), None))
        asyncio.run(lifetimes.renew(Renew(sandboxes=[sb.id]), None))
    assert registry.journal.lines == lines


def test_a_directory_copy_keeps_the_idle_clock_at_zero(tmp_path):
    _, registry = _service(tmp_path)
    sb = _sandbox(registry, lease=None)
    sb.idle_ttl, sb.last_active = 2.0, 100.0
    assert LifetimeService.expired(sb, 103.0) == "idle_ttl"
    sb.copies = 1                  # a cp -r in or out, begun at 100 and running on
    assert LifetimeService.expired(sb, 103.0) is None


def test_a_dead_sandbox_goes_when_its_ttl_or_lease_runs_out(tmp_path):
    # Its init exited on its own: the record stays for inspect and its
    # processes' logs, but a TTL or a lease a vanished client left still ends it.
    _, registry = _service(tmp_path)
    sb = _sandbox(registry, lease=None)
    sb.state = "dead"
    sb.ttl = 10.0
    assert LifetimeService.expired(sb, 0.0) == "ttl"          # created at 0 (the epoch): long past
    sb.ttl, sb.lease, sb.lease_deadline = None, 3.0, 100.0
    assert LifetimeService.expired(sb, 99.0) is None
    assert LifetimeService.expired(sb, 101.0) == "lease"
    sb.lease, sb.lease_deadline, sb.idle_ttl, sb.last_active = None, None, 2.0, 100.0
    assert LifetimeService.expired(sb, 1000.0) is None        # no requests come: idle means nothing


def test_a_sandbox_without_a_lease_is_said_to_have_none(tmp_path):
    """It was in neither `renewed` nor `missing`: a renew of it looked like
    one that went nowhere."""
    lifetimes, registry = _service(tmp_path)
    sb = _sandbox(registry, lease=None)
    out = asyncio.run(lifetimes.renew(Renew(sandboxes=[sb.id, "gone"]), None))
    assert out == {"renewed": [], "missing": ["gone"], "no_lease": [sb.id]}
    registry.journal.close()


def test_a_job_rm_refused_for_running_execs_names_the_job_command():
    """A job's destroy refused for running execs said to use `dsec rm
    --force`, which takes one sandbox, not the job."""
    import pytest

    from dsecd.engine.lifecycle import LifecycleService
    from dsecd.errors import Conflict

    svc = object.__new__(LifecycleService)
    sb = Sandbox(id="abc123def456", image="busybox", state="running", created=0.0, limits={}, execs=2)
    with pytest.raises(Conflict, match=r"dsec job rm --force JOB"):
        asyncio.run(svc.destroy_sandbox(sb, False, reason="job"))
    with pytest.raises(Conflict, match=r"dsec rm --force / -f"):
        asyncio.run(svc.destroy_sandbox(sb, False))
