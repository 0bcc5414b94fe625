"""The two ways a process starts in a sandbox (or a call sandbox): sent to
the sandbox's init over its channel (dsecd/initlink.py), or spawned by the
daemon's exec helper (csrc/spawn.c) as the daemon's own child, with their
argument and start errors turned into the protocol's.
"""

from __future__ import annotations

import asyncio
import functools
import os

from ..errors import BadRequest, exec_error
from ..execio import kill_and_reap
from ..initlink import InitExec
from ..native import NativeError
from .workers import Workers


class ProcessStarter:
    def __init__(self, workers: Workers):
        self.workers = workers

    def send_to_init(self, start_by_init, handle, argv: list[str], env: list[str], cwd: str, user: int, io,
                     stdio: tuple[int, int, int], what: str = "exec") -> InitExec | None:
        """start_by_init(loop, handle, argv, env, cwd, user, stdio) (a
        backend's): its InitExec, or None when the channel cannot take it.
        `io` owns the child ends in stdio, closed once sent."""
        try:
            started = start_by_init(self.workers.loop, handle, argv, env, cwd, user, stdio)
        except ValueError as err:     # as the helper's argument checks (spawn_by_helper)
            raise BadRequest(f"{what}: {err}") from err
        if started is not None:
            io.close_child_ends()     # sent: init holds them now
        return started

    async def spawn_by_helper(self, io, after_abandoned, spawn, handle, argv: list[str], env: list[str], cwd: str,
                              user: int, fds: tuple[int, int, int], what: str = "exec") -> int:
        """spawn(handle, argv, env, cwd, user, fds) (a backend's) through
        spawn_handed_over: the pid of the daemon's new child."""
        try:
            return await self.spawn_handed_over(io, after_abandoned, spawn, handle, argv, env, cwd, user, fds)
        except NativeError as err:
            raise exec_error(err, argv[0], cwd) from err
        except ValueError as err:       # the native layer's argument checks (sizes, NULs)
            raise BadRequest(f"{what}: {err}") from err

    async def spawn_handed_over(self, io, after_abandoned, spawn, *args) -> int:
        """spawn(*args) -> pid in a worker thread; `io` (ExecIO or Collector)
        owns the child ends passed in args, closed once the spawn returned.

        A request cancelled meanwhile (client gone, `cancel`) must not close
        them while the worker may still hand them to the child: another thread
        could reuse the numbers and the process would write into, say, another
        client's socket. The ends are taken from `io` and closed when the spawn
        is over, a process it made anyway is killed and reaped, and then
        after_abandoned() (if given) runs: what the caller must not release
        before that (a call's uid) is released there."""
        ends: list[int] = []          # filled at a cancel, before the callback can run
        try:
            return await self.workers.run_shielded(
                functools.partial(self._spawn_abandoned, ends, after_abandoned), spawn, *args)
        except asyncio.CancelledError:
            ends.extend(io.take_child_ends())
            raise
        finally:
            io.close_child_ends()      # nothing left to close if they were taken

    def _spawn_abandoned(self, ends: list[int], after_abandoned, fut: asyncio.Future) -> None:
        for fd in ends:
            os.close(fd)
        made = not (fut.cancelled() or fut.exception() is not None)
        reaped = kill_and_reap(self.workers.loop, fut.result()) if made else None
        if after_abandoned is None:
            return
        if reaped is None:
            after_abandoned()
        else:
            reaped.add_done_callback(lambda _reaped: after_abandoned())
