"""InitLink (dsecd/initlink.py), the daemon's side of the exec channel to a
sandbox's dsec-init: requests as init reads them, answers as init sends them,
and what a broken or lying init does to pending execs. The test plays init
on the other end of a real SOCK_SEQPACKET socketpair."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import struct
import subprocess

import pytest

from dsecd import native
from dsecd.initlink import InitLink, pair

REQ = struct.Struct("=IIIIQIIII")
REPLY_HEAD = struct.Struct("=IIIiii")
ERR = struct.Struct(f"=ii{native.INIT_REPLY_SIZE - native.INIT_REPLY_ERR_OFFSET - 8}s")


def _reply(kind: int, exec_id: int, pid: int = 0, status: int = 0, err: int = 0, step: int = 0,
           path: bytes = b"", magic: int = native.INIT_MAGIC) -> bytes:
    return REPLY_HEAD.pack(magic, kind, exec_id, pid, status, 0) + ERR.pack(err, step, path)


def _read_request(init: socket.socket) -> tuple[tuple, list[bytes], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(init, 1 << 17, 8)
    head = REQ.unpack_from(data)
    return head, data[REQ.size:].split(b"\0")[:-1], fds


def _stdio() -> tuple[list[int], tuple[int, int, int]]:
    r, w = os.pipe()
    return [r, w], (r, w, w)


def _close(fds):
    for fd in fds:
        os.close(fd)


def _link():
    ours, init = pair()
    return InitLink(ours), init


def _on_link(body) -> None:
    """Run `await body(link, init)` on a fresh InitLink and init's end of its
    channel; both are closed however the body ends."""
    async def go():
        link, init = _link()
        try:
            await body(link, init)
        finally:
            link.close(None)
            init.close()
    asyncio.run(go())


def test_a_request_carries_ids_caps_strings_and_three_fds():
    async def go(link, init):
        mine, stdio = _stdio()
        started = link.spawn(asyncio.get_running_loop(), ["echo", "hi"], ["PATH=/bin", "A=b"], "/tmp", 1000,
                             0x5, stdio)
        _close(mine)
        head, strings, fds = _read_request(init)
        magic, exec_id, uid, gid, caps, argc, envc, slen, _ = head
        assert (magic, exec_id, uid, gid, caps, argc, envc) == (native.INIT_MAGIC, started.id, 1000, 1000, 5, 2, 2)
        assert strings == [b"/tmp", b"echo", b"hi", b"PATH=/bin", b"A=b"]
        assert slen == sum(len(s) + 1 for s in strings)
        assert len(fds) == 3
        _close(fds)
    _on_link(go)


def _pidfd_of_sleeper() -> tuple[subprocess.Popen, int]:
    """A process leading its own group, as an exec does, and a pidfd of it."""
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    return proc, os.pidfd_open(proc.pid)


async def _reaped(proc: subprocess.Popen) -> int:
    return await asyncio.get_running_loop().run_in_executor(None, proc.wait, 5)


async def _until(cond, tries: int = 100) -> None:
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.01)


def _reported_started(init, run) -> subprocess.Popen:
    """Play init answering STARTED for `run`: a process leading its own group
    stands for the exec, its pidfd goes with the answer."""
    proc, pidfd = _pidfd_of_sleeper()
    socket.send_fds(init, [_reply(native.INIT_STARTED, run.id, pid=proc.pid)], [pidfd])
    os.close(pidfd)
    return proc


def _nothing_sent(init) -> None:
    init.setblocking(False)
    with pytest.raises(BlockingIOError):
        init.recv(1)


def _sent(link, init, argv=("true",)):
    mine, stdio = _stdio()
    run = link.spawn(asyncio.get_running_loop(), list(argv), [], "/", 0, 0, stdio)
    _close(mine)
    _close(_read_request(init)[2])
    return run


def test_groups_follow_the_strings_and_come_before_the_policy():
    async def go(link, init):
        mine, stdio = _stdio()
        plan = b"P" * 24
        started = link.spawn(asyncio.get_running_loop(), ["id"], [], "/", 1000, 0, stdio, gid=1001,
                             policy=plan, groups=(50, 1001, 3000))
        _close(mine)
        data, fds, _flags, _addr = socket.recv_fds(init, 1 << 17, 8)
        _close(fds)
        head = REQ.unpack_from(data)
        assert head[1] == started.id and (head[2], head[3]) == (1000, 1001)
        assert head[-1] == native.INIT_OP_START | native.INIT_START_GROUPS | native.INIT_START_POLICY
        after = data[REQ.size + head[7]:]
        assert struct.unpack_from("=4I", after) == (3, 50, 1001, 3000)
        assert after[16:] == plan
    _on_link(go)


def test_no_groups_no_flag_and_too_many_are_refused_before_sending():
    async def go(link, init):
        mine, stdio = _stdio()
        link.spawn(asyncio.get_running_loop(), ["id"], [], "/", 0, 0, stdio)
        head, _strings, fds = _read_request(init)
        _close(fds)
        assert head[-1] == native.INIT_OP_START
        with pytest.raises(ValueError, match=f"at most {native.MAX_GROUPS} supplementary groups"):
            link.spawn(asyncio.get_running_loop(), ["id"], [], "/", 0, 0, stdio,
                       groups=tuple(range(native.MAX_GROUPS + 1)))
        _close(mine)
    _on_link(go)


def test_prune_names_the_ids_init_keeps_and_carries_no_fds():
    async def go(link, init):
        link.attach(asyncio.get_running_loop())
        link.prune([7, 0xFFFFFFFE])
        data, fds, _flags, _addr = socket.recv_fds(init, 1 << 17, 8)
        head = REQ.unpack_from(data)
        assert (head[0], head[5], head[7], head[-1], fds) == (native.INIT_MAGIC, 2, 8, native.INIT_OP_PRUNE, [])
        assert struct.unpack_from("=2I", data, REQ.size) == (7, 0xFFFFFFFE) and len(data) == REQ.size + 8
        # What this link started itself is never pruned (a retry after a full queue).
        mine, stdio = _stdio()
        started = link.spawn(asyncio.get_running_loop(), ["true"], [], "/", 0, 0, stdio)
        _close(mine)
        _head, _strings, fds = _read_request(init)
        _close(fds)
        link.prune([7])
        data, _fds, _flags, _addr = socket.recv_fds(init, 1 << 17, 8)
        assert sorted(struct.unpack_from("=2I", data, REQ.size)) == sorted([7, started.id])
    _on_link(go)


def test_started_then_exited_resolve_status_and_the_pidfd_kills_the_group():
    async def go(link, init):
        run = _sent(link, init)
        proc = _reported_started(init, run)
        await _until(lambda: run.running)
        run.kill()
        assert await _reaped(proc) == -signal.SIGKILL
        assert not run.over.done()
        init.send(_reply(native.INIT_EXITED, run.id, status=signal.SIGKILL))
        assert await asyncio.wait_for(run.exited, 2) == {"status": signal.SIGKILL, "reported": True}
        assert run.over.done() and not link.pending
    _on_link(go)


def test_a_kill_before_init_answered_asks_init_and_then_uses_the_pidfd():
    async def go(link, init):
        run = _sent(link, init, ["sleep", "9"])
        run.kill()
        run.kill()                     # asked once
        head, strings, fds = _read_request(init)
        assert (head[0], head[1], head[-1], strings, fds) == (native.INIT_MAGIC, run.id, native.INIT_OP_KILL, [], [])
        _nothing_sent(init)
        # Init could not kill it (or had not read the kill): its STARTED does.
        proc = _reported_started(init, run)
        assert await _reaped(proc) == -signal.SIGKILL
    _on_link(go)


def test_a_failed_start_is_the_native_error_of_its_step():
    async def go(link, init):
        mine, stdio = _stdio()
        run = link.spawn(asyncio.get_running_loop(), ["nosuch"], ["PATH=/bin"], "/", 0, 0, stdio)
        _close(mine)
        _close(_read_request(init)[2])
        init.send(_reply(native.INIT_STARTED, run.id, err=errno.ENOENT, step=44, path=b"/bin/nosuch"))
        with pytest.raises(native.NativeError) as e:
            await asyncio.wait_for(run.exited, 2)
        assert e.value.errno == errno.ENOENT and e.value.step == "exec"
        assert "not found in PATH=/bin" in str(e.value)
        assert run.over.done()             # nothing runs: what waits for its end may go on
        assert not link.pending and not link.closed
    _on_link(go)


@pytest.mark.parametrize("bad", ["magic", "exited first", "two fds", "no fd", "not a pidfd", "short"])
def test_an_answer_that_breaks_the_protocol_closes_the_channel(bad):
    async def go():
        link, init = _link()
        run = _sent(link, init)
        r, w = os.pipe()
        if bad == "magic":
            init.send(_reply(native.INIT_STARTED, run.id, magic=1))
        elif bad == "exited first":
            init.send(_reply(native.INIT_EXITED, run.id))
        elif bad == "two fds":
            socket.send_fds(init, [_reply(native.INIT_STARTED, run.id)], [r, w])
        elif bad == "no fd":
            init.send(_reply(native.INIT_STARTED, run.id))
        elif bad == "not a pidfd":
            socket.send_fds(init, [_reply(native.INIT_STARTED, run.id)], [r])
        else:
            init.send(b"x" * 10)
        with pytest.raises(OSError) as e:
            await asyncio.wait_for(run.exited, 2)
        assert e.value.errno == errno.EPIPE
        assert link.closed and not link.pending
        # Later execs are refused here: the caller uses the daemon's helper.
        mine, stdio = _stdio()
        assert link.spawn(asyncio.get_running_loop(), ["true"], [], "/", 0, 0, stdio) is None
        _close(mine + [r, w])
        init.close()
    asyncio.run(go())


def test_answers_for_ids_it_never_used_are_dropped_with_their_fds():
    # After a restart: the daemon before sent these; this link starts at a random id.
    async def go(link, init):
        run = _sent(link, init)
        r, w = os.pipe()
        before = len(os.listdir("/proc/self/fd"))
        socket.send_fds(init, [_reply(native.INIT_STARTED, run.id + 7)], [r])
        init.send(_reply(native.INIT_EXITED, run.id + 8, status=0))
        await asyncio.sleep(0.1)
        assert not link.closed and run.id in link.pending
        assert len(os.listdir("/proc/self/fd")) == before       # the fd that came was closed
        _close([r, w])
    _on_link(go)


def test_init_exiting_ends_its_execs_as_killed():
    async def go():
        link, init = _link()
        running = _sent(link, init, ["sleep", "9"])
        waiting = _sent(link, init, ["sleep", "9"])
        proc = _reported_started(init, running)
        await _until(lambda: running.running)
        init.close()               # init exits: the kernel kills the sandbox's processes
        # not init's report: the status the kernel's kill of the sandbox implies
        assert await asyncio.wait_for(running.exited, 2) == {"status": signal.SIGKILL, "reported": False}
        with pytest.raises(OSError) as e:       # never started: no status to report
            await asyncio.wait_for(waiting.exited, 2)
        assert e.value.errno == errno.ESRCH
        assert link.closed and running.over.done() and waiting.over.done()
        proc.kill()
        proc.wait()
    asyncio.run(go())


def test_an_abandoned_exec_is_killed_and_forgotten_once_init_reports_it():
    async def go(link, init):
        run = _sent(link, init, ["sleep", "9"])
        proc = _reported_started(init, run)
        await _until(lambda: run.running)
        over = run.abandon()       # the request was cancelled
        assert run.exited.cancelled() and over is run.over
        assert await _reaped(proc) == -signal.SIGKILL
        # Killed, but gone only once init says so: a call's uid waits for this.
        await asyncio.sleep(0.05)
        assert not over.done()
        init.send(_reply(native.INIT_EXITED, run.id, status=signal.SIGKILL))
        await asyncio.wait_for(over, 2)
        assert not link.pending and not link.closed
    _on_link(go)


def test_a_broken_channel_fails_its_execs_and_marks_them_over():
    async def go(link, init):
        run = _sent(link, init, ["sleep", "9"])
        proc = _reported_started(init, run)
        await _until(lambda: run.running)
        over = run.abandon()
        link.close("protocol: test")       # the channel broke while it may still run
        assert await _reaped(proc) == -signal.SIGKILL      # killed through its pidfd
        await asyncio.wait_for(over, 2)
        assert link.closed
    _on_link(go)


def test_a_request_too_big_for_one_packet_is_left_to_the_helper():
    async def go(link, init):
        mine, stdio = _stdio()
        assert link.spawn(asyncio.get_running_loop(), ["echo", "x" * native.INIT_MAX_STRINGS], [], "/", 0, 0,
                          stdio) is None
        assert not link.pending and not link.closed
        _close(mine)
    _on_link(go)


def test_bad_strings_are_refused_before_anything_is_sent():
    async def go(link, init):
        mine, stdio = _stdio()
        for argv, env, cwd in ((["a\0b"], [], "/"), (["true"], ["NOEQUALS"], "/"), (["true"], [], "rel")):
            with pytest.raises(ValueError):
                link.spawn(asyncio.get_running_loop(), argv, env, cwd, 0, 0, stdio)
        _close(mine)
        _nothing_sent(init)
    _on_link(go)


def test_answers_unread_at_close_have_their_exec_killed():
    async def go():
        link, init = _link()
        run = _sent(link, init, ["sleep", "9"])
        proc = _reported_started(init, run)
        link.close("test")         # before the loop read the STARTED
        assert await _reaped(proc) == -signal.SIGKILL
        with pytest.raises(OSError):
            await asyncio.wait_for(run.exited, 2)
        init.close()
    asyncio.run(go())


def test_close_from_another_thread_runs_on_the_loop():
    async def go():
        link, init = _link()
        run = _sent(link, init)
        await asyncio.get_running_loop().run_in_executor(None, link.close, None)
        with pytest.raises(OSError):
            await asyncio.wait_for(run.exited, 2)
        assert link.closed
        init.close()
    asyncio.run(go())


@pytest.mark.parametrize("value, unsafe", [("0\n", False), ("1\n", True), ("2\n", False), (None, False)])
def test_a_host_with_suid_dumpable_1_is_refused(tmp_path, value, unsafe):
    # Spawn children share their parent's memory until execve (dsecd/features.py).
    from dsecd.features import suid_dumpable_hazard

    path = tmp_path / "suid_dumpable"
    if value is not None:
        path.write_text(value)
    why = suid_dumpable_hazard(str(path))
    assert (why is not None) == unsafe
    if unsafe:
        assert "sysctl -w fs.suid_dumpable=0" in why


def _holder(fd_at_5: int) -> tuple[subprocess.Popen, int]:
    """A process holding `fd_at_5` as its fd 5, as a sandbox's init holds the
    daemon's end of the channel; and a pidfd of it."""
    proc = subprocess.Popen(["sleep", "30"], pass_fds=(5,), preexec_fn=lambda: os.dup2(fd_at_5, 5))
    return proc, os.pidfd_open(proc.pid)


@pytest.mark.parametrize("kind", ["pipe", "stream socket", "/dev/null"])
def test_take_back_refuses_what_is_not_the_channel(kind):
    # An init made by an older daemon may hold anything at fd 5 (its signalfd).
    from dsecd.initlink import take_back

    if kind == "pipe":
        keep = list(os.pipe())
    elif kind == "stream socket":
        a, b = socket.socketpair()
        keep = [a.detach(), b.detach()]
    else:
        keep = [os.open("/dev/null", os.O_RDONLY)]
    proc, pidfd = _holder(keep[0])
    try:
        before = len(os.listdir("/proc/self/fd"))
        assert take_back(pidfd) is None
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        proc.kill()
        proc.wait()
        os.close(pidfd)
        _close(keep)


def test_take_back_returns_the_channel():
    from dsecd.initlink import take_back

    async def go():
        ours, init = pair()
        proc, pidfd = _holder(ours.fileno())
        link = take_back(pidfd)
        assert link is not None and link.attach(asyncio.get_running_loop())
        run = _sent(link, init)          # a request through the taken end reaches init
        assert run.id in link.pending
        link.close("test")               # given up: shut down for init too
        init.settimeout(2)
        assert init.recv(1) == b""       # init's end sees the channel gone
        proc.kill()
        proc.wait()
        os.close(pidfd)
        ours.close()
        init.close()
    asyncio.run(go())
