"""What the daemon's tasks and threads are doing, for a stop that cannot
wait for them to say so.

A task's label: the request it serves (op, id, client) and the sandbox it
is on. The server sets it as a request's task starts (Connection._run); a
create adds its new sandbox's id once it has one. A contextvar: each task
has its own copy, and a task started by a request (a shielded step, work
behind its answer) inherits its request's label.

A thread's Job: blocking work handed to a thread (the worker pool,
dsecd/engine/workers.py; the memory service's pool; the reaps of exec
helpers' children) runs as a Job that takes the label along and is listed
in RUNNING while it runs. A stop that cannot wait for a thread stuck in a
blocking call names the call, the request and sandbox it was for, and
where the thread is.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar

from . import fds

# (request, sandbox): request as "op #id of peer", sandbox an id; None where unknown.
_DOING: ContextVar[tuple[str | None, str | None]] = ContextVar("dsecd_doing", default=(None, None))


def request_label(op: str, rid: int | None, sandbox: str | None = None) -> str:
    """A request as the log names it: `exec #7 on sandbox 3f2a...`."""
    out = op if rid is None else f"{op} #{rid}"
    return f"{out} on sandbox {sandbox}" if sandbox else out


def for_request(op: str, rid: int, peer: str, sandbox: str | None) -> None:
    """The current task serves request `rid` (`op`) of client `peer`, on
    `sandbox` as the request names it (an id or its prefix), if it names one."""
    _DOING.set((f"{op} #{rid} of {peer}", sandbox))


def for_work(label: str) -> None:
    """The current task does the daemon's own work `label` (a step of its stop)."""
    _DOING.set((label, None))


def on_sandbox(sandbox: str) -> None:
    """The current task's work is on `sandbox` from here on (a create's new
    one, a build's step sandbox)."""
    request, _ = _DOING.get()
    _DOING.set((request, sandbox))


def current() -> str | None:
    """The current task's label: request and sandbox, either alone, or None."""
    request, sandbox = _DOING.get()
    if sandbox is None:
        return request
    return f"{request}, sandbox {sandbox}" if request else f"sandbox {sandbox}"


class Job:
    """One piece of blocking work handed to a thread: fn(*args), for
    `doing` (the request and sandbox of the task that handed it over),
    running since `started` (time.monotonic) once a thread took it."""

    __slots__ = ("fn", "args", "doing", "started")

    def __init__(self, fn: Callable, args: tuple, working_for: str | None):
        self.fn = fn
        self.args = args
        self.doing = working_for
        self.started = 0.0

    def name(self) -> str:
        """What the work calls: the function's qualified name (through
        fds.call_closing and functools.partial to the function doing it)."""
        fn, args = self.fn, self.args
        if fn is fds.call_closing and len(args) > 1:
            fn = args[1]
        while isinstance(fn, functools.partial):
            fn = fn.func
        return getattr(fn, "__qualname__", None) or type(fn).__name__

    def describe(self, now: float | None = None) -> str:
        """`ContainerBackend.create (create #3 of pid=9 uid=0 gid=0, sandbox 3f2a), 61 s in`."""
        out = self.name()
        if self.doing:
            out += f" ({self.doing})"
        if self.started:
            out += f", {(now or time.monotonic()) - self.started:.0f} s in"
        return out


# Thread ident -> the Job it runs now, for every thread that runs Jobs
# (the worker pool, the memory service's, the reaps of exec helpers' children).
RUNNING: dict[int, Job] = {}


def run_job(job: Job):
    """In a thread: job.fn(*job.args), listed in RUNNING meanwhile."""
    ident = threading.get_ident()
    job.started = time.monotonic()
    RUNNING[ident] = job
    try:
        return job.fn(*job.args)
    finally:
        del RUNNING[ident]


def job_of(fn: Callable, args: tuple) -> Job:
    """fn(*args) as a Job for the current task's request and sandbox."""
    return Job(fn, args, current())


def running_jobs() -> list[tuple[str, Job, str]]:
    """The Jobs threads run now: (thread name, job, where the thread is:
    the file, line and function of its innermost frame, and whether the
    kernel holds it in an uninterruptible wait)."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, job in list(RUNNING.items()):
        frame = frames.get(ident)
        where = (f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
                 if frame is not None else "?")
        thread = threads.get(ident)
        if thread is not None and kernel_state(thread.native_id) == "D":
            where += ", in an uninterruptible wait in the kernel"
        out.append((thread.name if thread is not None else str(ident), job, where))
    return out


def kernel_state(tid: int | None) -> str | None:
    """The state letter /proc gives the daemon's thread `tid` (R, S, D, ...);
    None when it cannot be read. "D", an uninterruptible wait (a FUSE read
    its server holds, an NFS hard mount), is one not even SIGKILL ends:
    the process lives on until that call returns."""
    if tid is None:
        return None
    try:
        with open(f"/proc/self/task/{tid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None
