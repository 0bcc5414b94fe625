"""Bytes the daemon writes into a sandbox, written by the sandbox.

A page of page cache or tmpfs is charged to the memory cgroup of the task
that allocates it. Written by a daemon thread, a client's file would land in
the daemon's cgroup, outside the sandbox's `--memory`: a client could fill a
host with files no sandbox limit sees. So the daemon opens the file itself
(every path check stays in dsecd/fs/files.py) and hands the fd to a copier
that the sandbox's init forks (csrc/init.c, DSEC_INIT_OP_COPY): a process in
the sandbox's cgroups that splices a pipe, which the daemon fills from the
event loop, into the file. Its pages are the sandbox's, counted against its
limit like a `dd` inside it; the tmpfs size cap of its writable layer holds
either way. A copy that takes the sandbox past its memory limit is OOM-killed
first (its oom_score_adj is 1000) and fails with limit_exceeded.

A sandbox without an init channel (exec_via = "helper", one whose init
cannot serve, or one whose init predates the copier) has its files written
by the daemon, uncharged.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import select
import signal
from collections.abc import Callable

from ..errors import LimitExceeded, io_error
from ..initlink import InitExec

# Pipe buffer between the daemon and the copier: fewer wakeups per MiB than
# the 64 KiB default. The most an unprivileged pipe gets (fs.pipe-max-size).
PIPE_BYTES = 1 << 20
# A copier that takes no bytes for this long is stopped (the sandbox froze or
# SIGSTOPped it) and the write fails: a worker of the daemon must not wait on
# a sandbox for ever.
STALL_S = 30.0


async def copy_into(start_copy: Callable[[int, int], InitExec | None], dst: int, data: bytes,
                    where: str) -> bool:
    """Write `data` into the open file `dst` through a copier of the sandbox.
    start_copy(src, dst) sends the request (the backend's copy_by_init for
    this sandbox). False if no copier could be started (the caller writes
    itself); raises the protocol error (DsecError) if the copy failed."""
    rd, wr = os.pipe2(os.O_CLOEXEC)
    try:
        if data:
            fcntl.fcntl(wr, fcntl.F_SETPIPE_SZ, min(PIPE_BYTES, max(len(data), 4096)))
        os.set_blocking(wr, False)
        copier = start_copy(rd, dst)
    except BaseException:
        os.close(wr)
        raise
    finally:
        os.close(rd)            # sent, or not: the copier has its own
    if copier is None:
        os.close(wr)
        return False
    try:
        await _feed(wr, data, copier, where)
    except asyncio.CancelledError:
        copier.abandon()
        raise
    finally:
        _close_quietly(wr)
    try:
        out = await copier.exited
    except OSError as err:      # it did not start, or the channel broke
        if getattr(err, "step", None) == "init_request" and err.errno == errno.EINVAL:
            return False        # an init older than the copier (a sandbox adopted after an upgrade)
        raise io_error("write", where, err) from err
    _check_status(out["status"], where)
    return True


async def _feed(wr: int, data: bytes, copier: InitExec, where: str) -> None:
    """Write data into the pipe as the copier drains it; return when all is
    in the pipe or the copier ended early (its status then says why).
    Closing `wr` afterwards is the copier's end of file."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    progress = loop.create_future()

    def writable() -> None:
        nonlocal view
        try:
            while view:
                view = view[os.write(wr, view[:PIPE_BYTES]):]
        except BlockingIOError:
            pass
        except OSError:          # EPIPE: the copier is gone; its status says why
            view = view[:0]
        if not progress.done():
            progress.set_result(None)

    while view and not copier.exited.done():
        progress = loop.create_future()
        loop.add_writer(wr, writable)
        try:
            done, _ = await asyncio.wait({progress, copier.exited}, timeout=STALL_S,
                                       return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_writer(wr)
        if not done:
            copier.kill()
            raise LimitExceeded(f"write {where}: the sandbox's copier took no bytes for {STALL_S:.0f} s with "
                                f"{len(view)} left (is the sandbox frozen, or stopping it?); the write was "
                                "stopped", {"path": where, "stall_s": STALL_S})


def copy_chunks_from_thread(loop: asyncio.AbstractEventLoop, start_copy: Callable[[int, int], InitExec | None],
                            dst: int, chunks, where: str) -> bool:
    """copy_into for a worker thread whose bytes come as an iterable of
    chunks read on that thread (a file of a tar stream): the copier is
    started and waited for on `loop`, the pipe is filled here, blocking,
    each write given STALL_S. False if no copier could be started."""
    rd, wr = os.pipe2(os.O_CLOEXEC)
    try:
        fcntl.fcntl(wr, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        copier = asyncio.run_coroutine_threadsafe(_start(start_copy, rd, dst), loop).result()
    except BaseException:
        os.close(wr)
        raise
    finally:
        os.close(rd)
    if copier is None:
        os.close(wr)
        return False
    try:
        _fill_blocking(wr, chunks, where)
    except BaseException:
        loop.call_soon_threadsafe(copier.kill)
        raise
    finally:
        os.close(wr)
    try:
        out = asyncio.run_coroutine_threadsafe(_exited(copier), loop).result()
    except OSError as err:
        raise io_error("write", where, err) from err
    _check_status(out["status"], where)
    return True


async def _start(start_copy, rd: int, dst: int) -> InitExec | None:
    return start_copy(rd, dst)           # on the loop: the init link is the loop's


async def _exited(copier: InitExec) -> dict:
    return await copier.exited


def _fill_blocking(wr: int, chunks, where: str) -> None:
    """Every chunk into the pipe; stops early (quietly) if the copier is
    gone: its status then says why."""
    poller = select.poll()
    poller.register(wr, select.POLLOUT)
    os.set_blocking(wr, False)
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            if not poller.poll(STALL_S * 1000):
                raise LimitExceeded(f"write {where}: the sandbox's copier took no bytes for {STALL_S:.0f} s "
                                    "(is the sandbox frozen, or stopping it?); the copy was stopped",
                                    {"path": where, "stall_s": STALL_S})
            try:
                view = view[os.write(wr, view[:PIPE_BYTES]):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                return


def _check_status(status: int, where: str) -> None:
    """The copier's wait status: 0, an errno as its exit code, or a signal."""
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        if code == 0:
            return
        if code == errno.ENOMEM:
            raise _over_memory(where)
        raise io_error("write", where, OSError(code, os.strerror(code)))
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    if sig == signal.SIGKILL:
        raise _killed(where)
    raise io_error("write", where, OSError(errno.EIO, f"the sandbox's copier ended by signal {sig}"))


def _over_memory(where: str) -> LimitExceeded:
    return LimitExceeded(f"write {where}: the sandbox's memory limit was reached by this write (it is "
                         "charged to the sandbox); the file is partly written. Write less, free memory in the "
                         "sandbox, or create it with more --memory", {"path": where})


def _killed(where: str) -> LimitExceeded:
    """SIGKILL: the OOM killer's pick (oom_score_adj 1000) when the write took
    the sandbox past its memory limit; or a process of the sandbox killed it."""
    return LimitExceeded(f"write {where}: the sandbox's copier was killed, most likely by the OOM killer as "
                         "this write took the sandbox past its memory limit (it is charged to the sandbox); the "
                         "file is partly written. Write less, free memory in the sandbox, or create it with more "
                         "--memory", {"path": where})


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
