"""Re-adoption at start (LifecycleService.recover_all): the microVMs' channels
are reached again side by side, each with its own timeout, so a host's VMs
that do not answer cost one timeout before the socket serves, not one each;
a sandbox that cannot be re-adopted or cleaned up stops neither the others
nor the start."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dsecd.engine.lifecycle import LifecycleService


class _Workers:
    async def run(self, fn, *args):
        return fn(*args)


def _service(records: dict) -> LifecycleService:
    svc = object.__new__(LifecycleService)
    svc.workers = _Workers()
    svc.registry = SimpleNamespace(journal=SimpleNamespace(load_all=lambda: records), by_id={})
    svc.backend = SimpleNamespace(orphans=lambda known: [])
    svc.vms = SimpleNamespace(backend=SimpleNamespace(orphans=lambda known: []), templates=None, why="")
    return svc


def _records() -> dict:
    return {"c1": {"backend": "container"}, "v1": {"backend": "microvm"}, "v2": {"backend": "microvm"},
            "c2": {}, "v3": {"backend": "microvm"}}


def test_vms_are_recovered_side_by_side_after_the_containers(monkeypatch):
    svc = _service(_records())
    log, waiting = [], []

    async def run():
        gate = asyncio.Event()      # set once every VM's recovery has begun

        async def recover(self, sb_id, rec, after_death=False):
            log.append(("start", sb_id))
            if rec.get("backend") == "microvm":
                waiting.append(sb_id)
                if len(waiting) == 3:
                    gate.set()
                await asyncio.wait_for(gate.wait(), 5)   # one after the other, the first times out here
            log.append(("end", sb_id))

        monkeypatch.setattr(LifecycleService, "_recover", recover)
        await svc.recover_all()

    asyncio.run(run())
    assert log[:4] == [("start", "c1"), ("end", "c1"), ("start", "c2"), ("end", "c2")]
    assert log[4:7] == [("start", "v1"), ("start", "v2"), ("start", "v3")]


def test_a_vm_whose_recovery_fails_fails_the_start_after_the_others_ended(monkeypatch):
    svc = _service(_records())
    ended = []

    async def recover(self, sb_id, rec, after_death=False):
        if sb_id == "v1":
            raise RuntimeError("journal record of v1 is broken")
        await asyncio.sleep(0.01)
        ended.append(sb_id)

    monkeypatch.setattr(LifecycleService, "_recover", recover)
    with pytest.raises(RuntimeError, match="v1"):
        asyncio.run(svc.recover_all())
    assert ended == ["c1", "c2", "v2", "v3"]


def test_live_vms_without_their_backend_stop_the_start_untouched(monkeypatch):
    """No microVM backend at this start (QEMU removed, say): journaled VMs
    are neither marked dead nor torn down by the container backend; the
    start stops, naming them and why."""
    from dsecd.config import ConfigError

    records = {"c1": {}, "v1": {"backend": "microvm", "state": "running"},
               "v2": {"backend": "microvm", "state": "paused"}, "v3": {"backend": "microvm", "state": "dead"}}
    svc = _service(records)
    svc.vms = SimpleNamespace(backend=None, templates=None, why="qemu-system-x86_64 not found")
    touched = []

    async def recover(self, sb_id, rec, after_death=False):
        touched.append(sb_id)

    monkeypatch.setattr(LifecycleService, "_recover", recover)
    with pytest.raises(ConfigError, match=r"2 microVM sandbox\(es\) are journaled \(v1, v2\).*qemu-system-x86_64 "
                                          "not found"):
        asyncio.run(svc.recover_all())
    assert touched == []


def test_dead_vms_alone_do_not_need_the_backend(monkeypatch):
    svc = _service({"c1": {}, "v3": {"backend": "microvm", "state": "dead"}})
    svc.vms = SimpleNamespace(backend=None, templates=None, why="qemu-system-x86_64 not found")
    touched = []

    async def recover(self, sb_id, rec, after_death=False):
        touched.append(sb_id)

    monkeypatch.setattr(LifecycleService, "_recover", recover)
    asyncio.run(svc.recover_all())
    assert touched == ["c1", "v3"]


def test_a_sandbox_the_host_will_not_let_go_of_does_not_stop_the_start(tmp_path):
    """A cgroup still busy after the destroy timeout (a process in D state):
    a sandbox caught mid-create keeps its record for the next start, one
    that died while no daemon ran is listed dead; the others are
    re-adopted, and the orphan sweep leaves the journaled ids alone."""
    from dsecd.cgroup import CgroupError
    from dsecd.engine.sandboxes import SandboxRegistry
    from dsecd.journal import Journal

    base = {"image": "busybox", "created": 0.0, "limits": {"cpu": 1, "memory": 1 << 20}}
    journal = Journal(tmp_path)
    journal.write_many([("half", {**base, "state": "creating"}), ("died", {**base, "state": "running"})])
    svc = _service({})
    svc.registry = SandboxRegistry(journal)
    svc.id_ranges = SimpleNamespace(reserve=lambda sb: None)
    swept_with = []

    def busy(*args):
        raise CgroupError(16, "remove cgroup dsecd/x: Device or resource busy after 10s")

    svc.backend = SimpleNamespace(destroy=busy, stop=busy, adopt=lambda *a: None, group_for=lambda sb_id: None,
                                  orphans=lambda known: swept_with.append(set(known)) or [])
    svc.events = SimpleNamespace(publish=lambda *a, **k: None)
    svc.memory = SimpleNamespace(oom_count=lambda group: None)
    svc.net = SimpleNamespace(detach_net=None)
    asyncio.run(svc.recover_all())
    assert svc.registry.by_id["died"].state == "dead"
    assert "half" not in svc.registry.by_id
    assert journal.load_all()["half"]["state"] == "creating"      # the next start tries again
    assert journal.load_all()["died"]["state"] == "dead"
    assert {"half", "died"} <= swept_with[0]
