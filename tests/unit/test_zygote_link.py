"""The daemon's end of a zygote's socket (dsecd/backends/fncall.py Zygote):
a full queue (net.unix.max_dgram_qlen packets, 10 by default) makes a call
wait, not fail. A real SOCK_SEQPACKET pair; the test reads the zygote's end."""

from __future__ import annotations

import asyncio
import os
import socket

from dsecd.backends.fncall import Zygote, ZygoteDied


def _pair():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    zyg = Zygote(sock=ours, pid=0, pidfd=-1)
    return zyg, theirs


def _fill(zyg: Zygote) -> int:
    """Packets sent until the zygote's queue is full."""
    n = 0
    while True:
        try:
            zyg.send_raw(b"x")
        except BlockingIOError:
            return n
        n += 1


def test_a_call_waits_for_room_in_a_full_queue():
    async def go():
        zyg, theirs = _pair()
        queued = _fill(zyg)
        r, w = os.pipe()
        sent = asyncio.create_task(zyg.send_call(b'{"op": "call"}', [r, w]))
        await asyncio.sleep(0.05)
        assert not sent.done()              # waits: the zygote has not read yet
        got = [theirs.recvmsg(1 << 16, socket.CMSG_SPACE(16)) for _ in range(queued)]
        await asyncio.wait_for(sent, 2)
        msg, anc, _flags, _addr = theirs.recvmsg(1 << 16, socket.CMSG_SPACE(16))
        for fd in (r, w):
            os.close(fd)
        for _level, _kind, data in anc:       # the fds came along
            for i in range(0, len(data), 4):
                os.close(int.from_bytes(data[i:i + 4], "little"))
        theirs.close()
        zyg.sock.close()
        return len(got), msg, len(anc)

    n, msg, fds = asyncio.run(go())
    assert n > 0 and msg == b'{"op": "call"}' and fds == 1


def test_a_kill_sent_to_a_full_queue_goes_once_there_is_room():
    async def go():
        zyg, theirs = _pair()
        queued = _fill(zyg)
        zyg.send({"op": "kill", "id": 7})      # no error, and not lost
        for _ in range(queued):
            theirs.recv(1 << 16)
        await asyncio.sleep(0.05)
        theirs.setblocking(False)
        msg = theirs.recv(1 << 16)
        theirs.close()
        zyg.sock.close()
        return msg

    assert asyncio.run(go()) == b'{"op": "kill", "id": 7}'


def test_a_call_waiting_for_room_fails_when_the_zygote_dies():
    async def go():
        zyg, theirs = _pair()
        _fill(zyg)
        sent = asyncio.create_task(zyg.send_call(b"call", []))
        await asyncio.sleep(0.02)
        zyg.fail("zygote exited")
        done, _ = await asyncio.wait([sent], timeout=2)
        theirs.close()
        zyg.sock.close()
        return sent.exception() if done else None

    assert isinstance(asyncio.run(go()), ZygoteDied)


def test_a_worker_that_could_not_be_forked_gives_its_uid_back(monkeypatch):
    """The zygote (dsecd/backends/zygote_main.py) at a full pids limit: the
    fork fails, and the uid it took for the worker goes back to the free ones."""
    from dsecd.backends import zygote_main

    z = zygote_main.Zygote.__new__(zygote_main.Zygote)
    z.uids, z.forked, z.base = [100001, 100000], 0, "/nonexistent"

    def no_pid():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(zygote_main.os, "fork", no_pid)
    for _ in range(3):
        try:
            z.fork_worker()
        except BlockingIOError:
            pass
    assert sorted(z.uids) == [100000, 100001]


def test_a_zygote_silent_after_a_kill_leaves_no_unretrieved_error():
    """A call whose kill the zygote never answers fails with `io`, and the
    zygote is dropped; the call's own end (failed with the zygote) is not
    left for the loop to log as 'Future exception was never retrieved'."""
    import gc

    from dsecd.backends.fncall import CallBox
    from dsecd.engine.calls import CallService
    from dsecd.engine.execs import ExecLimits
    from dsecd.engine.idranges import IdRanges
    from dsecd.engine.starts import ProcessStarter
    from dsecd.engine.workers import Workers
    from dsecd.errors import IOFailure

    unhandled = []

    async def go():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: unhandled.append(ctx.get("message")))
        workers = Workers(1)
        workers.start(loop)
        devnull = os.open(os.devnull, os.O_RDWR)
        zyg, theirs = _pair()
        box = CallBox(id="box1", image="py", layers=[], handle=None, zygote=zyg)
        limits = ExecLimits(max_timeout_s=0, drain_grace_s=0.05, max_output=1 << 20, max_trace=0)
        node = CallService(None, {"kill_grace_s": 0.1}, {}, 100_000, None, None, workers,
                           ProcessStarter(workers), limits, devnull, IdRanges(None), None)
        node.call_boxes = {"py": box}
        try:
            await node._zygote_call(box, zyg, ["-c"], "pass", {}, b"", 0.05)
        except IOFailure as err:
            error = str(err)
        await asyncio.sleep(0.05)
        gc.collect()
        await asyncio.sleep(0)
        theirs.close()
        os.close(devnull)
        workers.pool.shutdown(wait=True)
        return error, zyg.alive

    error, alive = asyncio.run(go())
    assert "stopped answering" in error and not alive
    assert unhandled == []


def test_a_new_worker_is_in_its_own_process_group_at_once(monkeypatch):
    """A call's kill is a killpg on its worker's group, which may come
    before the worker ran its first step: the zygote makes the group too."""
    import select
    import signal
    import time

    from dsecd.backends import zygote_main

    def slow_worker(link, tmp, uid, rlimits):      # not yet at its setpgid when the kill comes
        time.sleep(0.5)
        os._exit(0)

    monkeypatch.setattr(zygote_main, "worker", slow_worker)
    z = zygote_main.Zygote.__new__(zygote_main.Zygote)
    z.uids, z.forked, z.base, z.rlimits, z.by_fd = [100000], 0, "/nonexistent", {}, {}
    z.poll = select.poll()
    z.sock, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    w = z.fork_worker()
    try:
        os.killpg(w["pid"], signal.SIGKILL)       # ProcessLookupError if the group is not there yet
    finally:
        try:
            os.kill(w["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(w["pid"], 0)
        os.close(w["pidfd"])
        w["link"].close()
        z.sock.close()
        other.close()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
