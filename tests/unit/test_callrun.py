"""Collector (dsecd/execio.py) as FnCall uses it: one zygote call's output, end, timeout
and kill, driven by loop callbacks. Real pipes, a fake zygote answer."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from dsecd.backends.fncall import ZygoteDied
from dsecd.execio import Collector


def _run(cap=1 << 20, drain=0.2, kill_grace=0.2):
    return Collector(asyncio.get_running_loop(), cap, drain, kill_grace, path="zygote")


def _started(run, keep: int = 1):
    """The process's side: copies of the first `keep` pipe ends (stdout,
    stderr), the run's own closed; the run watching a fresh exit future."""
    ends = [os.dup(fd) for fd in run.child_ends[:keep]]
    run.close_child_ends()
    exited = asyncio.get_running_loop().create_future()
    run.start(exited, lambda: None, 5)
    return ends, exited


def test_output_and_exit_status():
    async def go():
        run = _run()
        (out_w, err_w), exited = _started(run, keep=2)
        os.write(out_w, b"hello ")
        os.write(err_w, b"oops")
        await asyncio.sleep(0.01)
        os.write(out_w, b"world")
        exited.set_result({"op": "exit", "status": 3 << 8, "run_ms": 1.5})
        os.close(out_w)
        os.close(err_w)
        result = await run.done
        run.close()
        return result

    r = asyncio.run(go())
    assert (r["stdout"], r["stderr"], r["exit_code"], r["signal"]) == (b"hello world", b"oops", 3, None)
    assert not r["timed_out"] and not r["truncated"] and r["run_ms"] == 1.5


def test_output_past_the_cap_is_cut_and_the_pipes_closed():
    async def go():
        run = _run(cap=10)
        (out_w,), exited = _started(run)
        os.write(out_w, b"x" * 25)
        await asyncio.sleep(0.05)
        with pytest.raises(BrokenPipeError):      # the writer sees EPIPE, as `yes | head` would
            os.write(out_w, b"more")
        os.close(out_w)
        exited.set_result({"status": signal.SIGPIPE})
        result = await run.done
        run.close()
        return result

    r = asyncio.run(go())
    assert r["truncated"] and r["stdout"] == b"x" * 10 and r["signal"] == signal.SIGPIPE


def test_timeout_asks_for_a_kill_and_a_silent_zygote_is_an_error():
    async def go():
        run = _run(kill_grace=0.1)
        run.close_child_ends()
        kills = []
        run.start(asyncio.get_running_loop().create_future(), lambda: kills.append(1), 0.05)
        with pytest.raises(TimeoutError):
            await run.done
        run.close()
        return kills, run.timed_out

    kills, timed_out = asyncio.run(go())
    assert kills == [1] and timed_out


@pytest.mark.parametrize("status, timed_out", [(0, False), (3 << 8, False), (signal.SIGKILL, True)])
def test_a_run_that_ended_before_its_timeouts_kill_did_not_time_out(status, timed_out):
    """The timeout's kill crossed the end: a run that exited by itself (its
    own status, not the kill's SIGKILL) says so, not both exit 0 and
    timed_out."""
    async def go():
        run = _run()
        run.close_child_ends()
        exited = asyncio.get_running_loop().create_future()
        run.start(exited, lambda: exited.set_result({"status": status}), 0.05)
        result = await asyncio.wait_for(run.done, 2)
        run.close()
        return result

    r = asyncio.run(go())
    assert r["timed_out"] is timed_out and (r["exit_code"], r["signal"]) == (
        (None, signal.SIGKILL) if status == signal.SIGKILL else (status >> 8, None))


def test_a_background_holder_of_the_pipes_does_not_hold_the_answer():
    """The exit is reported while something still holds stdout open: the
    result comes drain_grace later with what was read so far."""
    async def go():
        run = _run(drain=0.05)
        (holder,), exited = _started(run)
        os.write(holder, b"partial")
        exited.set_result({"status": 0})
        result = await asyncio.wait_for(run.done, 2)
        run.close()
        os.close(holder)
        return result

    r = asyncio.run(go())
    assert (r["stdout"], r["exit_code"]) == (b"partial", 0)


def test_a_dead_zygote_fails_the_call_and_close_frees_every_fd():
    async def go():
        before = len(os.listdir("/proc/self/fd"))
        run = _run()
        exited = asyncio.get_running_loop().create_future()
        run.start(exited, lambda: None, 5)
        exited.set_exception(ZygoteDied("gone"))
        with pytest.raises(ZygoteDied):
            await run.done
        run.close()
        run.close()            # idempotent
        return before, len(os.listdir("/proc/self/fd"))

    before, after = asyncio.run(go())
    assert after == before


def test_an_exec_child_collected_through_its_pidfd():
    # The plain-exec use (dsecd/node.py _exec_collected): the exit comes from
    # watch_exit (a pidfd, reaped at once), the output from real pipes.
    from dsecd.execio import watch_exit

    async def go():
        loop = asyncio.get_running_loop()
        run = Collector(loop, 1 << 20, 0.2, 0.2)
        pid = os.fork()
        if pid == 0:
            os.write(run.child_ends[0], b"out")
            os._exit(7)
        run.close_child_ends()
        exited, stop = watch_exit(loop, pid)
        run.start(exited, lambda: os.kill(pid, signal.SIGKILL), None)
        result = await run.done
        stop()
        run.close()
        return result

    r = asyncio.run(go())
    assert (r["exit_code"], r["stdout"], r["stderr"]) == (7, b"out", b"") and "path" not in r


@pytest.mark.parametrize("status, timed_out", [(0, False), (signal.SIGKILL, True)])
def test_an_exec_that_ended_before_its_timeouts_kill_did_not_time_out(status, timed_out):
    """The same crossing for an exec with stdin or streamed output (ExecIO)."""
    from dsecd.execio import ExecIO

    class Watch:
        kill_grace = 2.0

        def __init__(self, loop):
            self.exited = loop.create_future()

        def kill(self):
            self.exited.set_result({"status": status})

        def stop(self):
            pass

    async def emit(stream, data):
        pass

    async def go():
        loop = asyncio.get_running_loop()
        io = ExecIO(loop, 1 << 20, emit, False)
        io.close_child_ends()
        return await asyncio.wait_for(io.run(Watch(loop), 0.05, 0.1), 2)

    r = asyncio.run(go())
    assert r["timed_out"] is timed_out, r
