"""A microVM's `cp -r` landing directory (file_tar_put with `temporary`)
whose request is cancelled while its client stays connected
(dsecd/engine/dircopies.py, dsecd/engine/files.py): the guest made it all
the same when the whole archive had reached it, and it goes when the
request ends, not when the connection closes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dsecd import protocol
from dsecd.engine.dircopies import DirCopyService
from dsecd.engine.files import FileService

LANDING = "/work/.dsec-cp-0123456789ab"


class GuestFiles:
    """What a VM's file operations reach: a put makes its directory and
    then waits (the guest's copy had all of its archive, its request not
    yet answered); a remove takes the path away."""

    def __init__(self):
        self.paths: set[str] = set()
        self.made = asyncio.Event()

    async def tar_put(self, sb, path, pipe, max_entries, max_bytes, owner, dirs=False):
        self.paths.add(path)
        self.made.set()
        await asyncio.Event().wait()

    async def file_op(self, sb, req, owner=None):
        assert isinstance(req, protocol.FileRemove) and req.recursive, req
        self.paths.discard(req.path)
        return {"path": req.path, "removed": 1}


class Ctx:
    """A request's context on a connection that stays open."""

    def __init__(self):
        self.closing: dict = {}

    def register_input(self, sink) -> None:
        pass

    def unregister_input(self) -> None:
        pass

    def at_close(self, fn):
        key = object()
        self.closing[key] = fn
        return lambda: self.closing.pop(key, None)


async def _put_under_way():
    """A put of a directory into a microVM sandbox (a stand-in guest), started
    and waiting with its landing directory made: (sandbox, guest, the
    request's context, the put's task)."""
    sb = SimpleNamespace(id="sb1", backend="microvm", state="running", handle=object(), lock=asyncio.Lock(),
                         copies=0, last_active=0.0)
    registry = SimpleNamespace(by_id={"sb1": sb}, get=lambda _id, _req: sb,
                               destroyed_error=lambda _sb, _what: None)

    async def run(fn, *args):
        return fn(*args)

    async def ensure_running(_sb, _why):
        pass

    workers = SimpleNamespace(loop=asyncio.get_running_loop(), run=run)
    guest = GuestFiles()
    files = FileService(registry, workers, ensure_running, 1 << 20, None, vm_files=guest)
    copies = DirCopyService(registry, workers, ensure_running, 1 << 20, 100, 1 << 20, 4, 30.0, None,
                            vm_files=guest, hold_vm_temporary=files.hold_vm_temporary,
                            journal_vm_temporary=files.journal_vm_temporary,
                            end_vm_temporary=files.end_vm_temporary)
    ctx = Ctx()
    req = SimpleNamespace(sandbox="sb1", path=LANDING, temporary=True, owner=None, dirs=False)
    put = asyncio.create_task(copies.put(req, ctx))
    await guest.made.wait()
    return sb, guest, ctx, put


def test_a_cancelled_put_leaves_no_landing_directory_while_its_client_stays():
    async def go():
        sb, guest, ctx, put = await _put_under_way()
        put.cancel()
        try:
            await put
        except asyncio.CancelledError:
            pass
        return guest.paths, ctx.closing

    paths, closing = asyncio.run(go())
    assert paths == set()           # removed by the request's end, the connection still open
    assert closing == {}            # and nothing is left for the connection's end to do


def test_a_put_cancelled_again_while_it_removes_its_landing_directory_still_removes_it():
    """A `cancel` and then the client's connection closing (its CLI gone
    at ^C) cancel the put twice: the second comes while the first's
    removal waits for the sandbox's lock. The removal had already taken
    the directory from what the connection's end removes, so it must end
    all the same."""
    async def go():
        sb, guest, ctx, put = await _put_under_way()
        await sb.lock.acquire()             # a pause, say: the removal waits for it
        put.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not put.done()
        put.cancel()                        # the connection's end
        for fn in list(ctx.closing.values()):
            await fn()
        sb.lock.release()
        try:
            await put
        except asyncio.CancelledError:
            pass
        for _ in range(10):
            await asyncio.sleep(0)
        return guest.paths

    assert asyncio.run(go()) == set()
