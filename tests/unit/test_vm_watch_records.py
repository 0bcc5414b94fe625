"""A microVM's file_watch on the daemon's side (dsecd/engine/watches.py,
_follow_vm): the guest child's records become the container backend's
events and errors, and a backlog a slow client left becomes one `overflow`
instead of growing the daemon."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dsecd.engine import watches
from dsecd.errors import BadRequest, Conflict, LimitExceeded


def rec(*fields: str) -> bytes:
    body = b"".join(f.encode() + b"\0" for f in fields)
    return len(body).to_bytes(4, "big") + body


class FakeRun:
    def __init__(self, chunks: list[bytes], end=None):
        self.events: asyncio.Queue = asyncio.Queue()
        for c in chunks:
            self.events.put_nowait(("out", 1, c))
        if end is not None:
            self.events.put_nowait(end)
        self.done = False
        self.killed = False
        self.stopped_by = None

    async def next_event(self):
        return await self.events.get()

    def kill(self):
        self.killed = True


class Ctx:
    def __init__(self):
        self.got: list[dict] = []

    async def emit(self, ev: dict) -> None:
        self.got.append(ev)


def follow(chunks: list[bytes], end=None, max_dirs: int = 8, stopped_by: str | None = None):
    run = FakeRun(chunks, end)
    run.stopped_by = stopped_by
    link = SimpleNamespace(forget=lambda r: setattr(r, "done", True))

    async def start_watch(sb, path, recursive, max_dirs):
        return link, run

    svc = watches.WatchService(None, None, SimpleNamespace(subscribers=set()), None, 4, max_dirs,
                               SimpleNamespace(start_watch=start_watch), lambda sb, r: None)
    ctx = Ctx()

    async def main():
        return await svc._follow_vm(SimpleNamespace(id="s1"), "/work/w", True, "s1:/work/w", ctx)

    try:
        result = asyncio.run(main())
    except Exception as err:
        return err, ctx.got, run
    return result, ctx.got, run


def test_records_become_events():
    stream = (rec("ready", "2") + rec("ev", "create", "1", "0", "1", "d") + rec("ev", "move_from", "0", "7", "0", "d/f")
              + rec("stopped", "deleted"))
    # split mid-record: records span output chunks
    result, got, run = follow([stream[:5], stream[5:30], stream[30:]])
    assert result == {"reason": "deleted"}
    assert got == [{"kind": "ready", "path": "/work/w", "is_dir": True, "dirs": 2},
                   {"kind": "create", "path": "/work/w/d", "is_dir": True, "scanned": True},
                   {"kind": "move_from", "path": "/work/w/d/f", "is_dir": False, "cookie": 7},
                   {"kind": "stopped", "path": "/work/w", "is_dir": True, "reason": "deleted"}]
    assert run.done


def test_errors_are_the_containers():
    err, _, run = follow([rec("kernel", str(0x9FA0))])
    assert isinstance(err, BadRequest) and "kernel interface" in str(err) and run.killed
    err, _, _ = follow([rec("ready", "1"), rec("limit", "dirs", "a/b")], max_dirs=3)
    assert isinstance(err, LimitExceeded) and "more than 3 directories" in str(err)
    err, _, _ = follow([rec("err", "2", ".")])
    assert err.code == "not_found"


@pytest.mark.parametrize("n", [watches.MAX_BACKLOG_CHUNKS // 2, watches.MAX_BACKLOG_CHUNKS * 3])
def test_backlog_becomes_one_overflow(n):
    chunks = [rec("ready", "1")] + [rec("ev", "modify", "0", "0", "0", f"f{i}") for i in range(n)]
    result, got, _ = follow(chunks + [rec("stopped", "moved")])
    kinds = [e["kind"] for e in got]
    assert kinds[0] == "ready" and kinds[-1] == "stopped" and result == {"reason": "moved"}
    if n < watches.MAX_BACKLOG_CHUNKS:
        assert kinds.count("modify") == n and "overflow" not in kinds
    else:
        assert kinds.count("overflow") == 1 and kinds.count("modify") < n
        assert "lost" in got[1]["message"]


def test_a_watch_its_pause_ended_says_so_at_once():
    """Its child killed by the pause (MicroVMService._end_watches), a watch
    ends with a conflict naming the pause, not after GONE_GRACE_S with "ended
    without saying why"."""
    err, got, _ = follow([rec("ready", "1")], ("exited", 9), stopped_by="pause")
    assert isinstance(err, Conflict) and "paused" in str(err), err
    assert got[0]["kind"] == "ready"


def test_a_watch_started_by_the_vms_files_is_the_pauses_to_end_until_it_is_over():
    """The guest child VmFiles.start_watch starts is recorded by the
    MicroVMService it was given (watch_started), whose pause ends it; a
    watch's end (watch_over) takes it back."""
    from vm_kit import vm_files

    run = FakeRun([])

    class Link:
        async def start_exec(self, argv, env, cwd, uid, stdin, flags):
            assert argv == ["/work", "1", "8"], argv
            return run

    async def main():
        files, vms = vm_files(agent=lambda sb: Link())
        sb = SimpleNamespace(id="vm1")
        _, started = await files.start_watch(sb, "/work", True, 8)
        assert started is run
        watching = vms.watching(sb)
        vms.watch_over(sb, run)
        return watching, vms.watching(sb)

    assert asyncio.run(main()) == (1, 0)
