"""A file watch looks up its top directory in a worker, and a destroy
(which takes no sandbox lock) may close the sandbox's root meanwhile; the
number it freed may be another sandbox's root by the time the lookup runs.
The watch works on a copy of the root taken before it waits, so it watches
the tree it was asked for or fails, never another sandbox's."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

from dsecd.engine.watches import WatchService


class _RacingWorkers:
    """Workers whose first job finds the sandbox destroyed and its root's
    number reused by `other`'s root, as a concurrent destroy and create
    would leave it."""

    def __init__(self, rootfd: int, other: str):
        self.rootfd, self.other = rootfd, other

    async def run(self, fn, *args):
        return self._race(fn, *args)

    async def run_shielded(self, on_abandoned, fn, *args):
        return self._race(fn, *args)

    def _race(self, fn, *args):
        os.close(self.rootfd)
        reused = os.open(self.other, os.O_PATH | os.O_DIRECTORY)
        assert reused == self.rootfd
        return fn(*args)


def test_a_watch_opened_across_a_destroy_never_watches_another_sandbox(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    (mine / "work").mkdir(parents=True)
    (other / "work").mkdir(parents=True)
    rootfd = os.open(mine, os.O_PATH | os.O_DIRECTORY)
    svc = WatchService(SimpleNamespace(), _RacingWorkers(rootfd, str(other)), SimpleNamespace(),
                       None, max_watches=4, max_dirs=16)
    tree = asyncio.run(svc._open(rootfd, "/work", False, "sb:/work"))
    try:
        st = os.stat(mine / "work")
        assert tree.top_id == (st.st_dev, st.st_ino)
    finally:
        tree.close()
        os.close(rootfd)


def test_a_watch_of_a_kernel_interface_is_refused_as_a_bad_request():
    """The lookup in the worker refuses /proc (a PathError): a bad request,
    and the root's copy is closed."""
    from dsecd.errors import BadRequest

    class Workers:
        async def run_shielded(self, on_abandoned, fn, *args):
            return fn(*args)

    rootfd = os.open("/", os.O_PATH | os.O_DIRECTORY)        # the host's own /proc below it
    svc = WatchService(SimpleNamespace(), Workers(), SimpleNamespace(), None, max_watches=4, max_dirs=16)
    before = set(os.listdir("/proc/self/fd"))
    try:
        try:
            asyncio.run(svc._open(rootfd, "/proc", False, "sb:/proc"))
            raise AssertionError("a watch of /proc was not refused")
        except BadRequest:
            pass
    finally:
        os.close(rootfd)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_watch_of_a_sandbox_destroyed_while_it_resumed_is_a_conflict(tmp_path):
    """The resume a watch waits for first (ensure_running) may see the
    sandbox's destroy begin, which takes its handle: the watch is refused
    as a file request is then, not failed as an internal error."""
    import functools

    import pytest

    from dsecd.engine.sandboxes import Sandbox
    from dsecd.errors import Conflict
    from dsecd.protocol import FileWatch

    sb = SimpleNamespace(id="sb1", backend="container", state="paused",
                         handle=SimpleNamespace(rootfd=os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)))
    sb.root_copy = functools.partial(Sandbox.root_copy, sb)
    rootfd = sb.handle.rootfd

    async def ensure_running(sb, why):
        sb.state, sb.handle = "stopping", None       # a destroy's first step, on the loop

    svc = WatchService(SimpleNamespace(get=lambda sb_id, req: sb), SimpleNamespace(),
                       SimpleNamespace(subscribers=set()), ensure_running, max_watches=4, max_dirs=16)
    try:
        with pytest.raises(Conflict, match="stopping"):
            asyncio.run(svc.watch(FileWatch(sandbox="sb1", path="/"), None))
    finally:
        os.close(rootfd)
    assert svc.active == 0


def test_a_watch_whose_sandbox_was_destroyed_while_it_looked_up_its_top_ends(tmp_path):
    """A destroy that ends while the watch looks up its top directory in a
    worker (its `destroyed` event sent then): the watch ends, saying so,
    instead of following a tree its own copy of the root keeps mounted
    until its client gives up."""
    import functools

    from dsecd.engine.sandboxes import Sandbox
    from dsecd.protocol import FileWatch

    (tmp_path / "work").mkdir()
    sb = SimpleNamespace(id="sb1", backend="container", state="running",
                         handle=SimpleNamespace(rootfd=os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)))
    sb.root_copy = functools.partial(Sandbox.root_copy, sb)
    rootfd = sb.handle.rootfd
    events = SimpleNamespace(subscribers=set())

    class Workers:
        looked_up = False

        async def run_shielded(self, on_abandoned, fn, *args):
            if not self.looked_up:        # the top's lookup: the destroy runs to its end meanwhile
                self.looked_up = True
                sb.state, sb.handle = "stopping", None
                for sub in list(events.subscribers):
                    sub.push({"sandbox": "sb1", "event": "destroyed"})
            return fn(*args)

    async def ensure_running(sb, why):
        pass

    sent = []

    class Ctx:
        async def emit(self, frame):
            sent.append(frame)

    async def run():
        svc = WatchService(SimpleNamespace(get=lambda sb_id, req: sb), Workers(), events, ensure_running,
                           max_watches=4, max_dirs=16)
        task = asyncio.ensure_future(svc.watch(FileWatch(sandbox="sb1", path="/work"), Ctx()))
        for _ in range(100):            # loop turns, no clock: a watch that ends needs a few
            if task.done():
                break
            await asyncio.sleep(0)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise AssertionError(f"the watch of a destroyed sandbox goes on (sent {sent})")
        return task.result()

    try:
        assert asyncio.run(run()) == {"reason": "sandbox destroyed"}
    finally:
        os.close(rootfd)
    assert sent[-1]["kind"] == "stopped"
    assert not events.subscribers
