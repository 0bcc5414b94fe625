"""File requests run in workers, and a destroy (which takes no sandbox lock)
closes the sandbox's root fd meanwhile; parked fds reuse the lowest free
number, so another sandbox's root may hold it by the time the worker runs.
A worker works on a copy of the root taken on the loop, never through the
handle's number, and closes that copy when it is done."""

from __future__ import annotations

import asyncio
import functools
import os
from types import SimpleNamespace

from dsecd import fds
from dsecd.engine.files import FileService
from dsecd.engine.sandboxes import Sandbox
from dsecd.protocol import FileMkdir


class _RacingWorkers:
    """Workers whose job finds the sandbox destroyed (its root closed) and
    the number taken by `other`'s root, as a concurrent destroy and create
    leave it; it runs the job on the loop's thread."""

    def __init__(self, handle, other: str):
        self.handle, self.other, self.taken = handle, other, -1

    def _race(self, fn, *args):
        number = self.handle.rootfd
        os.close(number)
        self.handle.rootfd = -1
        self.taken = os.open(self.other, os.O_PATH | os.O_DIRECTORY)
        assert self.taken == number
        return fn(*args)

    async def run(self, fn, *args):
        return self._race(fn, *args)

    async def run_shielded(self, on_abandoned, fn, *args):
        return self._race(fn, *args)

    async def run_stoppable(self, stop, fn, *args):
        return self._race(fn, *args)

    async def run_owning(self, fd, fn, *args):
        return self._race(fds.call_closing, fd, fn, *args)


def test_a_file_request_across_a_destroy_never_lands_in_another_sandbox(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    handle = SimpleNamespace(rootfd=os.open(mine, os.O_PATH | os.O_DIRECTORY))
    sb = SimpleNamespace(id="sb1", backend="container", state="running", idmap=None, handle=handle)
    sb.root_copy = functools.partial(Sandbox.root_copy, sb)
    workers = _RacingWorkers(handle, str(other))
    registry = SimpleNamespace(get=lambda sb_id, req: sb)

    async def ensure_running(sb, why):
        pass

    svc = FileService(registry, workers, ensure_running, 1 << 20, copy_by_init=None)
    fds_before = set(os.listdir("/proc/self/fd"))
    try:
        asyncio.run(svc.mkdir(FileMkdir(sandbox="sb1", path="/made", parents=False, mode=0o755), None))
        assert (mine / "made").is_dir()
        assert not (other / "made").exists()
    finally:
        os.close(workers.taken)
    assert set(os.listdir("/proc/self/fd")) <= fds_before | {str(handle.rootfd)}     # the copy is closed


def test_a_root_copy_whose_work_was_dropped_before_it_started_is_closed():
    """A request cancelled while its work waits for a worker drops the work
    (as Workers.run does): the root's copy it owned is closed then."""
    import threading

    from dsecd.engine.workers import Workers

    async def run():
        workers = Workers(1)
        workers.start(asyncio.get_running_loop())
        gate = threading.Event()
        try:
            busy = asyncio.ensure_future(workers.run(gate.wait))          # the only worker, held
            copy = os.open("/", os.O_PATH)
            queued = asyncio.ensure_future(workers.run_owning(copy, lambda: "ran"))
            await asyncio.sleep(0.05)
            queued.cancel()
            await asyncio.sleep(0)
            gate.set()
            await busy
            try:
                os.fstat(copy)
                raise AssertionError("the dropped work's copy is still open")
            except OSError:
                pass
        finally:
            gate.set()
            workers.pool.shutdown(wait=True)
    asyncio.run(run())


def test_a_daemon_out_of_fds_says_so_for_a_root_copy(monkeypatch):
    """No fd left for the root's copy: a limit the client can act on, not
    an internal error."""
    import errno as errno_mod

    import pytest

    from dsecd.engine import sandboxes
    from dsecd.errors import LimitExceeded

    def no_fd(fd):
        raise OSError(errno_mod.EMFILE, "Too many open files")
    monkeypatch.setattr(sandboxes.os, "dup", no_fd)
    sb = SimpleNamespace(id="sb1", state="running", handle=SimpleNamespace(rootfd=3))
    with pytest.raises(LimitExceeded, match="RLIMIT_NOFILE"):
        Sandbox.root_copy(sb)
