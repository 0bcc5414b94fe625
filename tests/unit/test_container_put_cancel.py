"""A container's `cp -r` (file_tar_put) whose request is cancelled
(dsecd/engine/dircopies.py): its worker goes on until it has removed the
partial directory it made, and that directory stays recorded (copy-temps,
for the next daemon to remove) as long as the worker may still write it."""

from __future__ import annotations

import asyncio
import os
import threading
from types import SimpleNamespace

import pytest

from dsecd.engine.dircopies import DirCopyService
from dsecd.fs.copytemps import CopyTemps

PARTIAL = "/work/.dsec-put-0123456789abcdef"


def _service(tmp_path, idle_timeout: float):
    """A DirCopyService over one container sandbox whose put's worker
    records its partial directory, then writes it until `gate` is set."""
    temps = CopyTemps(tmp_path / "copy-temps")
    made, gate = threading.Event(), threading.Event()
    sb = SimpleNamespace(id="sb1", backend="container", state="running", handle=None, idmap=None, copies=0,
                         last_active=0.0, root_copy=lambda: os.open(tmp_path, os.O_PATH | os.O_CLOEXEC))
    registry = SimpleNamespace(by_id={"sb1": sb}, get=lambda _id, _req: sb, destroyed_error=lambda _sb, _what: None)

    async def run(fn, root, *args):
        made_dir = args[-1]

        def put_tree():
            try:
                made_dir(PARTIAL, os.stat(tmp_path))
                made.set()
                gate.wait()         # the partial directory still being written, then removed
            finally:
                os.close(root)

        return await asyncio.get_running_loop().run_in_executor(None, put_tree)

    async def ensure_running(_sb, _why):
        pass

    workers = SimpleNamespace(loop=None, run=run)
    svc = DirCopyService(registry, workers, ensure_running, 1 << 20, 100, 1 << 20, 4, idle_timeout, None,
                         temps=temps)
    return svc, workers, temps, made, gate


class Ctx:
    def register_input(self, sink) -> None:
        pass

    def unregister_input(self) -> None:
        pass


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.001)


def test_a_second_cancel_keeps_the_put_and_its_record_until_its_worker_is_done(tmp_path):
    """A `cancel` and then the client's connection closing cancel the put
    twice: the second ended its wait for the worker, and its records were
    dropped while the worker still wrote the directory they name."""
    svc, workers, temps, made, gate = _service(tmp_path, 30.0)

    async def go():
        workers.loop = asyncio.get_running_loop()
        req = SimpleNamespace(sandbox="sb1", path=PARTIAL, temporary=False, owner=None, dirs=False)
        put = asyncio.create_task(svc.put(req, Ctx()))
        try:
            await _until(lambda: made.is_set() and temps.load())
            put.cancel()
            for _ in range(10):
                await asyncio.sleep(0)
            put.cancel()                # the connection's end
            for _ in range(10):
                await asyncio.sleep(0)
            during = (put.done(), [r["path"] for _, r in temps.load()])
        finally:
            gate.set()
        with pytest.raises(asyncio.CancelledError):
            await put
        return during, temps.load()

    during, after = asyncio.run(go())
    assert during == (False, [PARTIAL])     # still waiting for its worker, the directory recorded
    assert after == []                      # removed by the worker: its record goes


def test_a_put_whose_worker_outlasts_its_wait_keeps_its_record_until_the_worker_ends(tmp_path):
    """The request ends within limits.frame_timeout_s of its cancel, its
    worker still running (a frozen copier): the directory stays recorded
    until the worker has removed it."""
    svc, workers, temps, made, gate = _service(tmp_path, 0.0)

    async def go():
        workers.loop = asyncio.get_running_loop()
        req = SimpleNamespace(sandbox="sb1", path=PARTIAL, temporary=False, owner=None, dirs=False)
        put = asyncio.create_task(svc.put(req, Ctx()))
        try:
            await _until(lambda: made.is_set() and temps.load())
            put.cancel()
            with pytest.raises(asyncio.CancelledError):
                await put
            during = [r["path"] for _, r in temps.load()]
        finally:
            gate.set()
        await _until(lambda: not temps.load())     # a hang here: the record never dropped
        return during

    assert asyncio.run(go()) == [PARTIAL]


def test_a_put_whose_worker_outlasts_its_wait_counts_as_running_until_the_worker_ends(tmp_path):
    """A cancelled put whose wait for its worker ran out (a frozen copier)
    still writes the sandbox: it keeps its place in limits.max_tar_puts and
    keeps the sandbox busy (the idle TTL does not reap it, a pause resumes
    it) until the worker has ended."""
    svc, workers, temps, made, gate = _service(tmp_path, 0.0)
    sb = svc.registry.by_id["sb1"]

    async def go():
        workers.loop = asyncio.get_running_loop()
        req = SimpleNamespace(sandbox="sb1", path=PARTIAL, temporary=False, owner=None, dirs=False)
        put = asyncio.create_task(svc.put(req, Ctx()))
        try:
            await _until(lambda: made.is_set() and temps.load())
            put.cancel()
            with pytest.raises(asyncio.CancelledError):
                await put
            during = (svc.puts, dict(svc._putting), sb.copies)
        finally:
            gate.set()
        await _until(lambda: not svc.puts)     # a hang here: the put never counted off
        return during, (svc.puts, dict(svc._putting), sb.copies)

    during, after = asyncio.run(go())
    assert during == (1, {"sb1": 1}, 1)
    assert after == (0, {}, 0)
