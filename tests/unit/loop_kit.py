"""The daemon's worker threads for unit tests that run services on an event loop."""

from __future__ import annotations

import asyncio
import contextlib

from dsecd.engine.workers import Workers


@contextlib.contextmanager
def workers_on_loop(threads: int = 2):
    """`threads` worker threads on the running loop, joined at the end."""
    workers = Workers(threads)
    workers.start(asyncio.get_running_loop())
    try:
        yield workers
    finally:
        workers.pool.shutdown(wait=True)
