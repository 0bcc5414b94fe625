"""A microVM pause whose save fails after its vCPUs were stopped: the VM's
record still says running, so its vCPUs run again (else its agent never
answers), and the partial state file goes."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsecd.backends.microvm import backend as vmbackend
from dsecd.backends.microvm.backend import MicroVMBackend
from dsecd.backends.microvm.qmp import QMPError


class _QMP:
    def __init__(self, migration: list[str]):
        self.commands: list[str] = []
        self.migration = migration          # query-migrate's status, one per query (the last repeats)
        self.paused = False

    async def command(self, name: str, args=None):
        self.commands.append(name)
        if name == "stop":
            self.paused = True
        elif name == "cont":
            self.paused = False
        elif name == "migrate_cancel":
            self.migration = ["cancelled"]
        elif name == "query-migrate":
            status = self.migration.pop(0) if len(self.migration) > 1 else self.migration[0]
            return {"status": status}
        elif name == "query-status":
            return {"status": "paused" if self.paused else "running"}
        return {}

    async def send_fd(self, name: str, fd: int) -> None:
        pass

    async def migrate_wait(self, timeout: float) -> dict:
        st = await self.command("query-migrate")
        if st["status"] != "completed":
            raise QMPError(f"migration {st['status']}")
        return st


def _save(tmp_path: Path, qmp: _QMP, run):
    backend = object.__new__(MicroVMBackend)
    h = SimpleNamespace(qmp=qmp, vm_dir=tmp_path)
    return asyncio.run(backend.save(h, tmp_path / "paused.ram", run))


def test_a_save_whose_state_cannot_be_written_out_runs_the_vm_again(tmp_path):
    """fdatasync of the saved state failing (after the migration, the vCPUs
    stopped) raised out of the save without `cont`: the VM stayed stopped
    while recorded running, and every later op on it waited for an agent
    that never answered."""
    qmp = _QMP(["completed"])

    async def run(fn, *args):
        if fn is vmbackend.settle_saved:
            raise OSError(errno.EIO, "Input/output error")
        return fn(*args)
    with pytest.raises(OSError, match="Input/output error"):
        _save(tmp_path, qmp, run)
    assert not qmp.paused and qmp.commands[-1] == "cont", qmp.commands
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_save_that_did_not_finish_is_cancelled_before_the_vm_runs_again(tmp_path):
    qmp = _QMP(["active"])

    async def run(fn, *args):
        return fn(*args)
    with pytest.raises(OSError, match="migration active"):
        _save(tmp_path, qmp, run)
    assert "migrate_cancel" in qmp.commands
    assert qmp.commands.index("migrate_cancel") < qmp.commands.index("cont"), qmp.commands
    assert not qmp.paused and sorted(p.name for p in tmp_path.iterdir()) == []
