"""Bytes the daemon writes into a sandbox, written by the sandbox.

A page of page cache or tmpfs is charged to the memory cgroup of the task
that allocates it. Written by a daemon thread, a client's file would land in
the daemon's cgroup, outside the sandbox's `--memory`: a client could fill a
host with files no sandbox limit sees. So the daemon opens the file itself
(every path check stays in dsecd/fs/files.py) and hands the fd to a copier
that the sandbox's init forks (csrc/init.c, DSEC_INIT_OP_COPY): a process in
the sandbox's cgroups that splices a pipe into the file, while a worker of
the daemon fills the pipe: with a request's bytes mapped in (vmsplice, no
copy), or with the chunks of a file of a tar stream as it reads them. The
written pages are the sandbox's, counted against its
limit like a `dd` inside it; the tmpfs size cap of its writable layer holds
either way. A write that would not fit under the limit (less a reserve for
the sandbox's processes) is refused before it starts (`check_room`); one
that gets there all the same, the sandbox allocating meanwhile, is
OOM-killed first (its oom_score_adj is 1000). Both fail with `limit`.

A sandbox without an init channel (exec_via = "helper", one whose init
cannot serve, or one whose init predates the copier) has its files written
by the daemon, uncharged.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import select
import signal
from collections.abc import Callable

from .. import native
from ..config import size_text
from ..errors import Conflict, DsecError, LimitExceeded, init_refused_request, io_error
from ..initlink import InitExec
from ..mem import pause

log = logging.getLogger(__name__)

# Pipe buffer between a worker and the copier: the most fs.pipe-max-size
# allows by default, for fewer wakeups per MiB than the 64 KiB default.
PIPE_BYTES = 1 << 20
# What a write must leave free of the memory limit, for the sandbox's own
# processes: a 16th of the limit, within these bounds.
RESERVE_MIN = 2 << 20
RESERVE_MAX = 64 << 20
# A copier that takes no bytes for this long is stopped (the sandbox froze or
# SIGSTOPped it) and the write fails: a worker of the daemon must not wait on
# a sandbox for ever.
STALL_S = 30.0


def check_room(group, size: int, where: str) -> None:
    """Refuse (`limit`) a write of `size` bytes that would take the
    sandbox's memory group (None: it has none) past its limit, less a
    reserve; page cache that reclaim can drop counts as free. A write the
    copier starts and the limit stops would leave the group full of tmpfs
    pages no OOM kill frees: the next allocation of any of its processes,
    init's included, would be killed, until the file is removed. The
    sandbox's own concurrent allocations can still fill it; then the OOM
    killer picks the copier first."""
    if group is None or (charged := pause.charge(group)) is None:
        return
    limit, used = charged
    reserve = min(max(RESERVE_MIN, limit // 16), RESERVE_MAX)
    if size <= limit - used - reserve:
        return                  # fits without counting the cache reclaim could drop (memory.stat)
    left = limit - used + pause.droppable_cache(group)
    if size > left - reserve:
        raise LimitExceeded(f"write {where}: {size_text(size)} would take the sandbox past its memory limit "
                            f"({size_text(limit)}; {size_text(max(0, left))} left, less {size_text(reserve)} kept "
                            "for its processes). "
                            "What the daemon writes into a sandbox counts against its --memory: write less, "
                            "free memory in the sandbox, or create it with more --memory",
                            {"path": where, "size": size, "left": max(0, left), "reserve": reserve})


async def copy_small(start_copy: Callable[[int, int], InitExec | None], dst: int, data: bytes,
                     where: str) -> bool:
    """copy_chunks_from_thread for data that fits in the pipe (at most
    PIPE_BYTES), on the loop: the pipe is filled at once, before the copier
    starts, with no worker and no wait for room. Same results."""
    rd, wr = os.pipe2(os.O_CLOEXEC)
    try:
        try:
            fcntl.fcntl(wr, fcntl.F_SETPIPE_SZ, max(len(data), 4096))
            os.write(wr, data)             # fits: the pipe holds it all
        finally:
            os.close(wr)
        copier = start_copy(rd, dst)
    finally:
        os.close(rd)
    if copier is None:
        return False
    try:
        out = await asyncio.wait_for(asyncio.shield(copier.exited), STALL_S)
    except asyncio.CancelledError:
        copier.abandon()
        raise
    except TimeoutError:
        copier.kill()
        raise _stalled(where) from None
    except OSError as err:
        return _start_failed(err, where)
    _check_status(out["status"], where)
    return True


def _start_failed(err: OSError, where: str) -> bool:
    """A copier that did not start or whose channel broke: False (the caller
    writes itself) for an init older than the copier (a sandbox adopted
    after an upgrade refuses the op with EINVAL); else the error."""
    if init_refused_request(err):
        return False
    raise io_error("write", where, err) from err


def copy_chunks_from_thread(loop: asyncio.AbstractEventLoop, start_copy: Callable[[int, int], InitExec | None],
                            dst: int, chunks, where: str, mapped: bool = False) -> bool:
    """Write the bytes of `chunks` (an iterable, read on this worker thread:
    a request's data, the file of a tar stream) into the open file `dst`
    through a copier of the sandbox. start_copy(src, dst) sends the request
    (the backend's copy_by_init for this sandbox); the copier is started and
    waited for on `loop`, the pipe is filled here. A copier that takes no
    bytes for STALL_S, or does not end STALL_S after the last, is killed.
    `mapped`: the chunks are vmspliced, not copied, into the pipe; this
    returns only once the copier is over, so the caller may then free them.
    False if no copier could be started and nothing was taken from `chunks`
    (a tuple: the caller writes them itself); raises the protocol error
    (DsecError) if the copy failed."""
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
        _fill_blocking(wr, chunks, where, native.vmsplice if mapped else os.write)
    except BaseException:
        os.close(wr)
        asyncio.run_coroutine_threadsafe(_end(copier), loop).result()
        raise
    os.close(wr)
    try:
        out = asyncio.run_coroutine_threadsafe(_exited(copier, where), loop).result()
    except OSError as err:      # it did not start, or the channel broke
        if not isinstance(chunks, tuple):
            # Chunks went into the pipe of a copier that never ran: they are
            # gone from an iterator, so the caller cannot write them itself.
            raise io_error("write", where, err) from err
        return _start_failed(err, where)
    _check_status(out["status"], where)
    return True


async def _start(start_copy, rd: int, dst: int) -> InitExec | None:
    return start_copy(rd, dst)           # on the loop: the init link is the loop's


async def _exited(copier: InitExec, where: str) -> dict:
    """The copier's end, given STALL_S once its input is complete."""
    try:
        return await asyncio.wait_for(asyncio.shield(copier.exited), STALL_S)
    except TimeoutError:
        await _end(copier)
        raise _stalled(where) from None


async def _end(copier: InitExec) -> None:
    """Kill the copier and wait (within its kill grace) until it is over:
    nothing may still read pages of the request's bytes mapped into its pipe
    once the caller lets them go."""
    copier.kill()
    try:
        await asyncio.wait_for(asyncio.shield(copier.over), copier.kill_grace)
    except TimeoutError:
        log.warning("a copier did not end %g s after its kill (is its sandbox's init stopped?)",
                    copier.kill_grace)


def _stalled(where: str) -> DsecError:
    return Conflict(f"write {where}: the sandbox's copier made no progress for {STALL_S:.0f} s (is the "
                    "sandbox frozen, or a process of it stopping the copier?); the write was stopped",
                    {"path": where, "stall_s": STALL_S})


def _fill_blocking(wr: int, chunks, where: str, write) -> None:
    """Every chunk into the pipe by write(fd, view) -> count; stops early
    (quietly) if the copier is gone: its status then says why."""
    poller = select.poll()
    poller.register(wr, select.POLLOUT)
    os.set_blocking(wr, False)
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            if not poller.poll(STALL_S * 1000):
                raise _stalled(where)
            try:
                view = view[write(wr, view):]
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
