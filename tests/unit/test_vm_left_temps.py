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
        svc = FileService(SimpleNamespace(by_id={"v1": sb}), Workers(), None, 1 << 20, None, vms=guest,
                          temps=temps)
        temps.add_ids("v1", LEFT, *guest.ids[LEFT])         # left while it was paused
        await svc._remove_left("v1")

    asyncio.run(run())
    assert guest.removed == [LEFT]
    assert [rec["path"] for _, rec in temps.load()] == [LIVE]
