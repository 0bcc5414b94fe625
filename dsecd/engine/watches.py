"""`file_watch`: a directory inside a sandbox watched with inotify, its
changes streamed to the client until it cancels, the directory goes, or the
sandbox does.

One inotify instance per watch, read on the event loop (loop.add_reader):
no thread per watch. Directories are opened and scanned in a worker
(dsecd/fs/watch.py). A client that reads slowly is not buffered for: the
reader is off while events are sent, so new ones wait in the kernel's queue,
and when that overflows the client gets an `overflow` event.
"""

from __future__ import annotations

import asyncio
import errno
import os

from ..errors import BadRequest, LimitExceeded, io_error
from ..fs import files as sbfiles
from ..fs import watch as fswatch
from .events import EventBus
from .sandboxes import SandboxRegistry
from .workers import Workers

# Sandbox events that end its watches: it is gone.
ENDS_WATCHES = ("destroyed", "died")


class _SandboxGone:
    """An EventBus subscriber that wakes a watch when its sandbox goes."""

    def __init__(self, sandbox: str, wake: asyncio.Event):
        self.sandbox = sandbox
        self.wake = wake
        self.gone: str | None = None

    def push(self, ev: dict) -> None:
        if ev["sandbox"] == self.sandbox and ev["event"] in ENDS_WATCHES:
            self.gone = f"sandbox {ev['event']}"
            self.wake.set()


class WatchService:
    """`file_watch`. `ensure_running(sb, why)` resumes a paused sandbox
    first; `max_watches` is how many may run at once on this host (each holds
    an inotify instance: the kernel allows 128 per user by default),
    `max_dirs` how many directories one may watch."""

    def __init__(self, registry: SandboxRegistry, workers: Workers, events: EventBus, ensure_running,
                 max_watches: int, max_dirs: int):
        self.registry = registry
        self.workers = workers
        self.events = events
        self.ensure_running = ensure_running
        self.max_watches = max_watches
        self.max_dirs = max_dirs
        self.active = 0

    async def watch(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        await self.ensure_running(sb, "file watch")
        if self.active >= self.max_watches:
            raise LimitExceeded(f"{self.active} file watches are running on this host (limits.max_watches); "
                                "cancel one first", {"max_watches": self.max_watches})
        self.active += 1
        try:
            where = f"{sb.id}:{req.path}"
            tree = await self._open(sb.handle.rootfd, req.path, req.recursive, where)
            return await self._follow(sb.id, tree, where, ctx)
        finally:
            self.active -= 1

    async def _open(self, rootfd: int, path: str, recursive: bool, where: str) -> fswatch.TreeWatch:
        """The watch of `path`, not yet watching anything."""
        try:
            path = sbfiles.check_path(path)
            top_id = await self.workers.run(fswatch.top_identity, rootfd, path)
        except sbfiles.PathError as err:
            raise BadRequest(str(err), {"path": path}) from err
        except OSError as err:
            raise io_error("watch", where, err) from err
        own_root = os.dup(rootfd)
        try:
            return fswatch.TreeWatch(own_root, path, top_id, recursive, self.max_dirs)
        except OSError as err:
            os.close(own_root)
            if err.errno in (errno.EMFILE, errno.ENFILE):
                raise LimitExceeded(f"watch {where}: no inotify instance left on this host (sysctl "
                                    "fs.inotify.max_user_instances); cancel other watches or raise it",
                                    {"errno": errno.errorcode[err.errno]}) from err
            raise io_error("watch", where, err) from err

    async def _grow(self, tree: fswatch.TreeWatch, rel: str, report: bool, where: str) -> list[dict]:
        """tree.add_tree in a worker. If the request is cancelled meanwhile,
        the tree is closed once the worker is done with its inotify fd (never
        under it: the fd number could be reused), and marked `close_deferred`."""
        def close_later(_fut) -> None:
            tree.close()

        try:
            return await self.workers.run_shielded(close_later, tree.add_tree, rel, report)
        except asyncio.CancelledError:
            tree.close_deferred = True
            raise
        except fswatch.WatchLimit as err:
            raise LimitExceeded(str(err), {"max_watch_dirs": self.max_dirs}) from err
        except RecursionError as err:       # a chain of directories deeper than the walk goes
            raise LimitExceeded(f"watch {where}: the tree is deeper than a recursive watch walks; watch a "
                                "directory further down", {"path": where}) from err
        except OSError as err:
            raise io_error("watch", where, err) from err

    async def _follow(self, sandbox: str, tree: fswatch.TreeWatch, where: str, ctx) -> dict:
        """Stream the tree's events until it stops or the request is cancelled."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        gone = _SandboxGone(sandbox, wake)

        def readable() -> None:
            # Off until these events are sent: the loop must not spin on a
            # readable fd while a slow client holds us in emit.
            loop.remove_reader(tree.ifd)
            wake.set()

        self.events.subscribers.add(gone)
        try:
            await self._grow(tree, "", False, where)
            await ctx.emit({"kind": "ready", "path": tree.top, "is_dir": True, "dirs": len(tree.paths)})
            while True:
                loop.add_reader(tree.ifd, readable)
                await wake.wait()
                wake.clear()
                # Woken by the sandbox's end, not by `readable`: the reader is
                # still registered. remove_reader is a no-op when it is not.
                loop.remove_reader(tree.ifd)
                if gone.gone:
                    tree.stopped = gone.gone
                else:
                    await self._deliver(tree, where, ctx)
                if tree.stopped:
                    await ctx.emit({"kind": "stopped", "path": tree.top, "is_dir": True, "reason": tree.stopped})
                    return {"reason": tree.stopped}
        finally:
            self.events.subscribers.discard(gone)
            if tree.ifd >= 0:
                # Before the fd is closed: a registration left on a closed fd
                # would swallow the next add_reader of the same number.
                loop.remove_reader(tree.ifd)
            if not tree.close_deferred:
                tree.close()

    async def _deliver(self, tree: fswatch.TreeWatch, where: str, ctx) -> None:
        """Send what inotify has queued; watch the directories that came."""
        last = None
        for record in tree.read():
            event, grow = tree.translate(*record)
            if event is not None and event != last:     # a run of writes to one file is one modify
                await ctx.emit(event)
                last = event
            if grow is not None:
                for found in await self._grow(tree, grow, True, where):
                    await ctx.emit(found)
            if tree.stopped:
                return
