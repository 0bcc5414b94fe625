"""How long a daemon's stop may take, and every wait within it.

A stop (SIGTERM, SIGINT; dsecd/daemon.py) waits for what is under way: the
requests it cancelled finishing their undoing, pauses, resumes and
snapshots writing their records, keyed requests, then each service's close
(call sandboxes destroyed, networking, memory, the pager, idle layers
unmounted), then the tasks and threads left. Each of those waits ends by
one deadline, `daemon.stop_timeout_s` after the stop began, whatever hangs
(a worker in a read on a hung file system, a cgroup write that blocks, a
kill through a wedged guest agent): systemd kills a daemon whose stop takes
longer than its TimeoutStopSec (90 s), and then nothing of the stop's own
end (the journal closed, the log's account of what was left) happens.

Of the budget, the requests get the first part (up to `CLOSE_SHARE` from
its end), the services' close the next (up to `LAST_SHARE` from its end),
and the last part is for the tasks still running, cancelled, and the
threads still at work. Within the close, each step keeps some time for
the steps after it (StopClock.for_step), so one that hangs does not keep
swap from being turned off or DAMON from being stopped. What does not
end in its part is logged, naming what it was doing (the request, the
sandbox, the call a thread is in), and left: the stop goes on. A thread
still in a blocking call at the end would hold the interpreter's exit
forever (it joins every worker thread), so the daemon then ends with
os._exit (exit_now), its log flushed. A last resort
(StopClock.backstop) ends the process a few seconds past the deadline
should the stop's own thread, the event loop's, be held in a blocking call.

A stop that left anything exits with LEFT_WORK_STATUS, not 0. What was
left is found by the next start as after a death: the stop keeps
the state dir's running mark (node.RUNNING_MARK), so the execs left
running are killed; a sandbox whose create was cut short has no journal
record, or one in state `creating`, and is removed; the journal holds every
record written before the exit (each is written before the answer that
depends on it, dsecd/journal.py).
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine

from . import doing, journal

log = logging.getLogger("dsecd")

# The share of the budget, from its end, that the requests' wait leaves
# to what follows it (the services' close, then the last part, LAST_SHARE):
# the requests get 60 s of the default 75, the close until 71.25 s.
CLOSE_SHARE = 0.2
# The share, from its end, that the services' close leaves to the tasks and
# threads still running.
LAST_SHARE = 0.05
# What each close step still to come keeps of the close's time, at most
# (less when the time left is short: an equal share): a step that hangs (a
# kill waiting on a hung file system) must not take the time of the ones
# after it, which turn swap off, stop DAMON and unmount.
STEP_RESERVE_S = 1.0
# How often the end of the stop looks whether the threads' work is over.
THREAD_POLL_S = 0.02
# How long after the deadline the last resort (StopClock.backstop) ends a
# stop whose own thread, the event loop's, is held in a blocking call.
BACKSTOP_S = 5.0
# The exit status of a stop that left work under way (a request, a close
# step, a thread in a blocking call): not 0, so systemd lists the unit as
# failed (`systemctl status`, `--failed`) and an operator looks at the log;
# the next start takes such a stop for a death (dsecd.running stays), and
# cleans up after it. EX_TEMPFAIL of sysexits.h (systemd prints
# "75/TEMPFAIL"): 1 is a start that failed, 2 a usage error, and 3 would
# read "NOTIMPLEMENTED". The unit does not restart on it
# (RestartPreventExitStatus): the stop was asked for.
LEFT_WORK_STATUS = 75


class StopClock:
    """A stop's deadlines, from the moment it is made."""

    def __init__(self, budget_s: float, now: Callable[[], float] = time.monotonic):
        self.budget = float(budget_s)
        self._now = now
        self.began = now()
        self.requests_end = self.began + self.budget * (1 - CLOSE_SHARE)
        self.closes_end = self.began + self.budget * (1 - LAST_SHARE)
        self.end = self.began + self.budget
        self.late: list[str] = []       # the close steps that did not end in their time
        self.close_steps: tuple[str, ...] = ()     # the close's steps, in order (plan_closes)
        self._after_late: Callable[[], object] = lambda: None

    def backstop(self) -> None:
        """The last resort: a thread that ends the process BACKSTOP_S after
        the deadline if it still runs then. Every wait of the stop ends by
        the deadline, but the stop's own steps on the event loop's thread
        (a ring or the journal written, an fd closed) are blocking calls no
        deadline of the loop's can end: on a hung state dir one never
        returns. It says where that thread is and exits, keeping the flocks:
        that thread is the one that writes the state dir (the journal,
        the rings), and its call may still land when the kernel lets it
        return; the locks go with the process, after that call."""
        loop_thread = threading.get_ident()

        def watch() -> None:
            time.sleep(max(0.0, self.end + BACKSTOP_S - self._now()))
            _say_stuck_loop(loop_thread, self)
            os._exit(LEFT_WORK_STATUS)

        threading.Thread(target=watch, name="dsecd-stop-backstop", daemon=True).start()

    def elapsed(self) -> float:
        return self._now() - self.began

    def for_requests(self) -> float:
        """Seconds left for what the requests under way do."""
        return max(0.0, self.requests_end - self._now())

    def for_closes(self) -> float:
        """Seconds left for the services' close."""
        return max(0.0, self.closes_end - self._now())

    def plan_closes(self, steps: tuple[str, ...], after_late: Callable[[], object] = lambda: None) -> None:
        """The names of the close's steps, in the order they run: each
        keeps time for the ones after it (for_step). `after_late` runs
        after a step that did not end in its time: the work it left in the
        worker threads (a destroy each, in a hung read) may hold all of
        them, and the next steps need workers of their own
        (Workers.set_aside_stuck)."""
        self.close_steps = tuple(steps)
        self._after_late = after_late

    def for_step(self, what: str) -> float:
        """Seconds the close step `what` may take: what is left of the
        close's time, less what each planned step after it keeps
        (STEP_RESERVE_S, or an equal share of a short time left). What a
        step ends early of its time goes to the ones after it."""
        left = self.for_closes()
        after = len(self.close_steps) - self.close_steps.index(what) - 1 if what in self.close_steps else 0
        return left - after * min(STEP_RESERVE_S, left / (after + 1))

    def for_last(self) -> float:
        """Seconds left for the tasks and threads still running."""
        return max(0.0, self.end - self._now())

    async def step(self, what: str, aw: Coroutine | Awaitable) -> bool:
        """Await `aw`, a step of the services' close named `what` (one of
        plan_closes's), for its time (for_step). True once it ended (its
        error, if any, is raised); False when it had not: it is logged
        (with the workers still in its work) and cancelled without waiting,
        and the stop goes on. Work it hands to workers is labelled
        `daemon stop: what`."""
        if what not in self.close_steps:
            # A step left out of the plan (node.CLOSE_STEPS; a unit test
            # checks it) still runs, with the whole of what is left, as
            # the last one would: a stop goes on whatever its own bug.
            log.error("stopping: close step %r is not among the planned ones %s; it runs with the close's "
                      "time left", what, self.close_steps)
        timeout = self.for_step(what)
        label = f"daemon stop: {what}"
        if asyncio.iscoroutine(aw):
            context = contextvars.copy_context()
            context.run(doing.for_work, label)
            task = asyncio.get_running_loop().create_task(aw, name=label, context=context)
        else:
            task = asyncio.ensure_future(aw)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if done:
            task.result()
            return True
        task.cancel()
        self.late.append(what)
        busy = [f"{name}: {job.describe()} at {where}" for name, job, where in doing.running_jobs()
                if job.doing is not None and job.doing.startswith(label)]     # (", sandbox X" after it)
        log.warning("stopping: %s not done %.1f s into the stop%s; the stop goes on without it (the next "
                    "start takes up what it leaves)", what, self.elapsed(),
                    f" (still in it: {'; '.join(busy)})" if busy else "",
                    extra={"fields": {"event": "stop_step_late", "step": what, "workers": busy}})
        self._after_late()
        return False


async def end_what_is_left(clock: StopClock) -> list[str]:
    """The end of a stop, after the node's close: cancel the tasks still
    running, then wait, until the clock's end, for them to end and for the
    threads' work (doing.RUNNING) to return. What still runs then,
    described: [] when nothing does."""
    me = asyncio.current_task()
    tasks = {t for t in asyncio.all_tasks() if t is not me and not t.done()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=clock.for_last())
    while doing.RUNNING and clock.for_last() > 0:
        await asyncio.sleep(THREAD_POLL_S)
    left = [f"task {t.get_name()}" for t in sorted(tasks, key=lambda t: t.get_name()) if not t.done()]
    left += [f"thread {name} in {job.describe()} at {where}" for name, job, where in doing.running_jobs()]
    return left


def exit_now(left: list[str], clock: StopClock, locks: list[int]) -> None:
    """End the process though threads are still in blocking calls and
    tasks still running (`left`, described): said in the log, atexit's
    functions run (the log flushed), `locks` (the flocks on the state dir
    and the cgroup root) given up, then os._exit(LEFT_WORK_STATUS). A normal exit would wait
    forever for those threads (the interpreter joins every worker thread)
    and tasks (asyncio cancels and awaits every task).

    Why the locks go first: a thread in an uninterruptible wait (a FUSE
    read its server holds) keeps the process, and every fd it has, until
    that call returns, though no code of it runs again (the exit kills its
    threads as they leave the kernel). Closed here, a new daemon can start
    on the state dir meanwhile. Not while a journal write is under way
    (journal.hold_all_for_exit, which also keeps any from starting): that
    one call (an append, a compaction's copy or its rename over the log)
    could still land after a new daemon began writing the journal, and put
    an old record after its own or an old log over it; the locks then go
    with the process, once that call returns."""
    log.warning("stopping: %d thing(s) still running %.1f s into the stop (daemon.stop_timeout_s %g): %s; "
                "the daemon exits anyway, leaving them as they are (the next start takes this stop for a "
                "death: it kills the execs left running and removes what a cut-short create left)",
                len(left), clock.elapsed(), clock.budget, "; ".join(left),
                extra={"fields": {"event": "stop_exit_anyway", "left": left}})
    sys.stdout.flush()
    atexit._run_exitfuncs()         # logging.shutdown among them: every line written
    # Last, just before the exit: a stuck thread that came back meanwhile
    # could have begun a journal write after any earlier look.
    writing = journal.hold_all_for_exit()
    if writing:
        _say_directly(f"stopping: a write of {', '.join(writing)} is under way; the state dir stays locked "
                      "until it returns (a new daemon cannot start on it before)",
                      logging.WARNING, {"event": "stop_keeps_state_lock", "writing": writing})
    else:
        for fd in locks:
            try:
                os.close(fd)
            except OSError:
                pass
    os._exit(LEFT_WORK_STATUS)


def _say_stuck_loop(loop_thread: int, clock: StopClock) -> None:
    """The last resort's one line, written without the logging module's
    locks: the thread it is about may hold one, blocked in a write."""
    frame = sys._current_frames().get(loop_thread)
    where = "".join(traceback.format_stack(frame, limit=4)).strip() if frame is not None else "?"
    _say_directly(f"stopping: the event loop's thread is still in a blocking call {clock.elapsed():.1f} s into "
                  f"the stop (daemon.stop_timeout_s {clock.budget:g}); the daemon exits now, leaving it (the next "
                  f"start takes this stop for a death): {where}",
                  logging.ERROR, {"event": "stop_backstop", "where": where})


def _say_directly(message: str, level: int, fields: dict) -> None:
    """One log line in the daemon's format, written to stderr with one
    write(2): neither through the logging module's locks (a stuck thread
    may hold one) nor after its shutdown (exit_now runs atexit first)."""
    record = log.makeRecord(log.name, level, __file__, 0, "%s", (message,), None)
    record.fields = fields
    handlers = logging.getLogger().handlers         # the daemon's one (dsecd/logs.py), on stderr
    try:
        line = handlers[0].format(record) if handlers else record.getMessage()
    except Exception:               # a formatter that fails: the message as it is
        line = record.getMessage()
    try:
        os.write(2, (line + "\n").encode(errors="replace"))
    except OSError:
        pass
