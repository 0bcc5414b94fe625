"""Blocking work off the event loop.

Clone, mount, cgroup writes, file copies and BPF compiles block; the event
loop must not. Every service runs such work through one Workers: a bounded
thread pool (`daemon.worker_threads`) and the loop the answers go back to.

Each piece of work a worker runs is a doing.Job, listed while it runs with
what it calls and the request and sandbox it is for (dsecd/doing.py): a
stop that cannot wait for a worker stuck in a blocking call names it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .. import doing, fds
from ..doing import Job, job_of, run_job, running_jobs

log = logging.getLogger(__name__)

POOL_NAME = "dsecd-worker"
# A worker in one piece of work this long when the daemon's stop is done
# waiting for requests is stuck (set_aside_stuck).
STUCK_S = 1.0
# How often finish_running looks whether the work is over.
POLL_S = 0.02


class Workers:
    def __init__(self, threads: int):
        self.threads = threads
        self._prefix = POOL_NAME
        self.pool = ThreadPoolExecutor(threads, POOL_NAME)
        self.loop: asyncio.AbstractEventLoop | None = None      # set by start(), on the daemon's loop

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def _submit(self, fn, *args, dropped=None) -> asyncio.Future:
        """fn(*args) in a worker, as a future of the loop: what
        loop.run_in_executor does, without its per-call checks (an
        inspect.iscoroutinefunction of fn) and asyncio.wrap_future's general
        chaining; a burst makes several of these per create. Cancelling the
        future cancels the work only if it has not started; dropped() then
        runs (what the work would have released)."""
        loop = self.loop
        fut = loop.create_future()
        work = self.pool.submit(run_job, job_of(fn, args))
        work.add_done_callback(lambda w: None if loop.is_closed() else loop.call_soon_threadsafe(_settle, fut, w))

        def on_cancel(f: asyncio.Future) -> None:
            if f.cancelled() and work.cancel() and dropped is not None:
                dropped()
        fut.add_done_callback(on_cancel)
        return fut

    async def run(self, fn, *args):
        """fn(*args) in a worker; cancelling the caller leaves the work running."""
        return await self._submit(fn, *args)

    async def run_owning(self, fd: int, fn, *args):
        """fn(*args) in a worker that owns `fd` (a copy of a sandbox's root
        taken on the loop): closed once fn returns, or at once if the
        caller is cancelled before the work started (then dropped, as
        run's is). Cancelled later, the work runs on and closes it."""
        return await self._submit(fds.call_closing, fd, fn, *args, dropped=lambda: os.close(fd))

    async def run_shielded(self, on_abandoned, fn, *args):
        """fn(*args) in a worker, for work that makes something (a process, a
        sandbox): the caller may be cancelled (client gone, `cancel`), the work
        is not, and on_abandoned(future) runs once it is over, to undo what it
        made."""
        fut = self._submit(fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(on_abandoned)
            raise

    async def run_in_slot(self, slot: asyncio.Semaphore, on_cancel, fn, *args):
        """fn(*args) in a worker once `slot` is acquired, holding it until fn
        has returned, even when the caller is cancelled first: a bound such
        as images.max_pulls limits the work running, and work a cancel only
        asks to stop (on_cancel(), on the loop) may run on for a while.
        Cancelled while waiting for the slot, nothing runs."""
        await slot.acquire()
        try:
            fut = self._submit(fn, *args)
        except BaseException:
            slot.release()
            raise
        fut.add_done_callback(lambda f: _release_after(slot, f))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            on_cancel()
            raise

    async def run_stoppable(self, stop: threading.Event, fn, *args):
        """fn(*args) in a worker that checks `stop` as it goes: cancelling the
        caller sets it and waits for fn to return, so the work has stopped
        (nothing more of it happens) once the caller's cancel is through;
        a second cancel meanwhile (a `cancel`, then the client's connection
        closing) does not end that wait."""
        fut = self._submit(fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            stop.set()
            await outcome(fut)      # the stop's own error taken: the caller was told of its cancel
            raise

    def behind(self, fn, *args) -> asyncio.Future:
        """fn(*args) in a worker, nobody waiting for it (clean-up behind an answer)."""
        return self._submit(fn, *args)

    def submit(self, fn, *args) -> Future:
        """fn(*args) in a worker from any thread (the journal's compaction)."""
        return self.pool.submit(run_job, job_of(fn, args))

    def busy(self) -> list[tuple[str, Job, str]]:
        """running_jobs() of this pool's threads."""
        mine = self._prefix + "_"          # ThreadPoolExecutor's names: prefix_N
        return [(name, job, where) for name, job, where in running_jobs() if name.startswith(mine)]

    async def finish_running(self, timeout: float) -> None:
        """Daemon stop: wait up to `timeout` s for the work this pool runs
        now (a layer sweep, a journal compaction, a request's step) to return."""
        running = {job for _name, job, _where in self.busy()}
        deadline = time.monotonic() + timeout
        while running and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            running &= {job for _name, job, _where in self.busy()}

    def set_aside_stuck(self, busy_s: float | None = None) -> int:
        """Daemon stop, once what it waits for had its time: when workers
        are still in one piece of work since `busy_s` (STUCK_S) or more (a blocking
        call that does not return: a read on a hung file system), the
        stop's own steps get a new pool rather than queue behind them for
        ever. The old pool is shut down without waiting: what it still
        holds queued is dropped (as a cancel before it starts), what it
        runs runs on until the daemon exits. How many workers were stuck;
        each is logged with what it is in, for which request and sandbox.
        After a close step that ran out of its time, every worker still in
        its work counts (busy_s 0): that step's destroys may fill the pool."""
        now = time.monotonic()
        busy_s = STUCK_S if busy_s is None else busy_s
        stuck = [(name, job, where) for name, job, where in self.busy() if now - job.started >= busy_s]
        if not stuck:
            return 0
        for name, job, where in stuck:
            log.warning("stopping: worker %s still in %s (at %s); the stop goes on without it",
                        name, job.describe(now), where,
                        extra={"fields": {"event": "stop_left_worker", "thread": name, "work": job.name(),
                                          "doing": job.doing, "where": where,
                                          "busy_s": round(now - job.started, 1)}})
        self._prefix = POOL_NAME + "-stop"
        old, self.pool = self.pool, ThreadPoolExecutor(self.threads, self._prefix)
        old.shutdown(wait=False, cancel_futures=True)
        return len(stuck)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# to_the_end's tasks not ended yet: the daemon's stop waits for them
# (finish_under_way) before it closes the journal their records go to.
_UNDER_WAY: set[asyncio.Task] = set()


async def to_the_end(coro, locks=()):
    """Run `coro` to its end even when the caller is cancelled (its client
    gone, a `cancel`): for a change of state that, once begun, must finish
    so the sandbox is what its state says (a pause's freeze goes on in its
    worker thread whatever the caller does). The cancelled caller waits
    for that end before it ends too, so that the request's final frame
    comes after the change: a client told its pause was cancelled, which
    then resumes, is not overtaken by the pause's freeze. An error the
    coroutine ends with then is logged. `locks` are taken first, in order,
    while a cancel still stops it all (nothing has begun: `coro` never
    runs), and held until `coro` has ended."""
    taken = []
    try:
        for lock in locks:
            await lock.acquire()
            taken.append(lock)
    except BaseException:
        for lock in reversed(taken):
            lock.release()
        coro.close()
        raise
    # Named as it is made (for a stop that cannot wait): nothing runs
    # between taking the locks and the callback that gives them back.
    task = before_stop(asyncio.get_running_loop().create_task(
        coro, name=f"{coro.__qualname__} ({doing.current() or 'no request'})"))
    if taken:
        task.add_done_callback(lambda _task: [lock.release() for lock in reversed(taken)])
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_log_abandoned)
        await outcome(task)
        raise


def before_stop(task: asyncio.Task) -> asyncio.Task:
    """`task`, a change of state with a record to write (to_the_end's, or
    one behind an answer: a job pause's VM save) or a sandbox to thaw (a
    snapshot's), is waited for by the daemon's stop (finish_under_way)."""
    _UNDER_WAY.add(task)
    task.add_done_callback(_UNDER_WAY.discard)
    return task


async def finish_under_way(timeout: float) -> list[str]:
    """Daemon stop: wait up to `timeout` s for the changes of state under
    way (pauses, resumes, job ones, snapshots; their requests cancelled by
    the server's stop) to end and write their records; the names of those
    that did not (each says what it is and its request and sandbox)."""
    if not _UNDER_WAY:
        return []
    _done, pending = await asyncio.wait(set(_UNDER_WAY), timeout=timeout)
    return sorted(task.get_name() for task in pending)


def _log_abandoned(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s (its request was cancelled meanwhile)", task.exception())


async def outcome(fut: asyncio.Future):
    """Wait for `fut` to be done, whatever cancels the waiter meanwhile;
    its result, or the exception it ended with (returned, not raised)."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            pass
        except BaseException:
            break
    if fut.cancelled():
        return asyncio.CancelledError()
    return fut.exception() or fut.result()


def _settle(fut: asyncio.Future, work: Future) -> None:
    """On the loop: the worker's outcome into the loop's future (unless that
    was cancelled meanwhile)."""
    if fut.done():
        return
    if work.cancelled():
        fut.cancel()
        return
    err = work.exception()
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(work.result())


def _release_after(slot: asyncio.Semaphore, fut: asyncio.Future) -> None:
    """On the loop, once a slot's work is over: the slot back, and the
    work's error taken, as nobody awaits it after a cancel."""
    slot.release()
    if not fut.cancelled():
        fut.exception()
