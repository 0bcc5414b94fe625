"""Blocking work off the event loop.

Clone, mount, cgroup writes, file copies and BPF compiles block; the event
loop must not. Every service runs such work through one Workers: a bounded
thread pool (`daemon.worker_threads`) and the loop the answers go back to.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor


class Workers:
    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(threads, "dsecd-worker")
        self.loop: asyncio.AbstractEventLoop | None = None      # set by start(), on the daemon's loop

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    async def run(self, fn, *args):
        """fn(*args) in a worker; cancelling the caller leaves the work running."""
        return await self.loop.run_in_executor(self.pool, fn, *args)

    async def run_shielded(self, on_abandoned, fn, *args):
        """fn(*args) in a worker, for work that makes something (a process, a
        sandbox): the caller may be cancelled (client gone, `cancel`), the work
        is not, and on_abandoned(future) runs once it is over, to undo what it
        made."""
        fut = self.loop.run_in_executor(self.pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(on_abandoned)
            raise

    def behind(self, fn, *args) -> asyncio.Future:
        """fn(*args) in a worker, nobody waiting for it (clean-up behind an answer)."""
        return self.loop.run_in_executor(self.pool, fn, *args)

    def submit(self, fn, *args) -> Future:
        """fn(*args) in a worker from any thread (the journal's compaction)."""
        return self.pool.submit(fn, *args)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
