"""A microVM's temporaries left while it was paused (their clients gone)
are removed at its resume (FileService._remove_left), by their records.
A temporary a client makes in the resumed VM meanwhile, recorded while
the records are read, is that client's: it stays."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dsecd.engine.files import FileService
from dsecd.fs.copytemps import CopyTemps

LEFT = "/work/.dsec-left"
LIVE = "/work/.dsec-live"


class Guest:
    def __init__(self):
        self.ids = {LEFT: (1, 10), LIVE: (1, 11)}
        self.removed: list[str] = []

    async def identity(self, sb, path):
        return self.ids.get(path)

    async def file_op(self, sb, req, owner=None):
        self.removed.append(req.path)
        self.ids.pop(req.path, None)
        return {"path": req.path}


def test_a_temporary_recorded_while_a_resume_reads_the_records_stays(tmp_path):
    temps = CopyTemps(tmp_path / "temps")
    guest = Guest()
    sb = SimpleNamespace(id="v1", backend="microvm", state="running", handle=object(), lock=None)
    svc = None

    class Workers:
        async def run(self, fn, *args):
            if fn == temps.load:
                # A client's write in the resumed VM, journaled on the loop
                # while the worker reads the records.
                release = svc.hold_vm_temporary("v1", LIVE, SimpleNamespace(at_close=lambda fn: lambda: None))
                assert release is not None
                await svc.journal_vm_temporary(sb, LIVE)
            return fn(*args)

    async def run():
        nonlocal svc
        sb.lock = asyncio.Lock()
        svc = FileService(SimpleNamespace(by_id={"v1": sb}), Workers(), None, 1 << 20, None, vm_files=guest,
                          temps=temps)
        temps.add_ids("v1", LEFT, *guest.ids[LEFT])         # left while it was paused
        await svc._remove_left("v1")

    asyncio.run(run())
    assert guest.removed == [LEFT]
    assert [rec["path"] for _, rec in temps.load()] == [LIVE]


def _left_while_paused(tmp_path, state: str):
    """A FileService whose VM v1 (in `state`) had temporary LEFT made, and
    its client's connection closed then."""
    temps = CopyTemps(tmp_path / "temps")
    guest = Guest()
    sb = SimpleNamespace(id="v1", backend="microvm", state="running", handle=object(), lock=None)

    class Workers:
        loop = None

        async def run(self, fn, *args):
            return fn(*args)

        def behind(self, fn, *args):
            fn(*args)

    closing = []
    ctx = SimpleNamespace(at_close=lambda fn: closing.append(fn) or (lambda: None))

    async def make():
        sb.lock = asyncio.Lock()
        workers = Workers()
        workers.loop = asyncio.get_running_loop()
        svc = FileService(SimpleNamespace(by_id={"v1": sb}), workers, None, 1 << 20, None, vm_files=guest, temps=temps)
        svc.hold_vm_temporary("v1", LEFT, ctx)
        await svc.journal_vm_temporary(sb, LEFT)
        assert [rec["path"] for _, rec in temps.load()] == [LEFT]
        sb.state = state
        await closing[0]()              # its client's connection closes
        return svc

    return temps, guest, make


def test_the_record_of_a_paused_vms_left_temporary_goes_with_the_sandbox(tmp_path):
    temps, guest, make = _left_while_paused(tmp_path, "paused")

    async def run():
        svc = await make()
        assert len(temps.load()) == 1           # kept for its resume
        svc._on_event({"event": "destroyed", "sandbox": "v1"})
        for _ in range(20):
            await asyncio.sleep(0)

    asyncio.run(run())
    assert guest.removed == []
    assert temps.load() == []


def test_the_record_of_a_dead_vms_left_temporary_goes(tmp_path):
    """A dead VM never runs again: nothing will remove its temporary, and
    its record serves nobody."""
    temps, guest, make = _left_while_paused(tmp_path, "dead")
    asyncio.run(make())
    assert guest.removed == []
    assert temps.load() == []
