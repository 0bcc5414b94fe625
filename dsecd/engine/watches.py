"""`file_watch`: a directory inside a sandbox watched with inotify, its
changes streamed to the client until it cancels, the directory goes, or the
sandbox does.

One inotify instance per watch, read on the event loop (loop.add_reader):
no thread per watch. Directories are opened and scanned in a worker
(dsecd/fs/watch.py). A client that reads slowly is not buffered for: the
reader is off while events are sent, so new ones wait in the kernel's queue,
and when that overflows the client gets an `overflow` event.

A microVM sandbox's files are in its guest: there a child of the guest
agent watches them by the same rules and sends records (_follow_vm).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Callable

from .. import native
from ..backends.microvm.agent import AgentExec
from ..errors import BadRequest, Conflict, DsecError, LimitExceeded, io_error
from ..fs import files as sbfiles
from ..fs import watch as fswatch
from .events import EventBus
from .sandboxes import Sandbox, SandboxRegistry
from .vmfiles import VmFiles
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
                 max_watches: int, max_dirs: int, vm_files: VmFiles | None = None,
                 vm_watch_over: Callable[[Sandbox, AgentExec], None] | None = None):
        self.registry = registry
        self.vm_files = vm_files        # a microVM sandbox's watch runs in its guest (VmFiles)
        self.vm_watch_over = vm_watch_over      # MicroVMService.watch_over: a pause no longer ends its child
        self.workers = workers
        self.events = events
        self.ensure_running = ensure_running
        self.max_watches = max_watches
        self.max_dirs = max_dirs
        self.active = 0

    async def watch(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        await self.ensure_running(sb, "a file watch")
        if self.active >= self.max_watches:
            raise LimitExceeded(f"{self.active} file watches are running on this host (limits.max_watches); "
                                "cancel one first", {"max_watches": self.max_watches})
        self.active += 1
        try:
            where = f"{sb.id}:{req.path}"
            if sb.backend == "microvm":
                return await self._follow_vm(sb, req.path, req.recursive, where, ctx)
            # Heard from before the lookup of the top waits: a destroy that
            # ends meanwhile would not say so again, and the tree, held by
            # the watch's copy of the root, stays mounted with no end to hear.
            gone = _SandboxGone(sb.id, asyncio.Event())
            self.events.subscribers.add(gone)
            try:
                # Through root_copy, as a file request: the resume above may
                # have let a destroy begin, which takes the handle (a Conflict).
                root = sb.root_copy()
                try:
                    tree = await self._open(root, req.path, req.recursive, where)
                finally:
                    os.close(root)          # _open took its own copy before it waited
                return await self._follow(sb, tree, where, ctx, gone)
            finally:
                self.events.subscribers.discard(gone)
        finally:
            self.active -= 1

    async def _open(self, rootfd: int, path: str, recursive: bool, where: str) -> fswatch.TreeWatch:
        """The watch of `path`, not yet watching anything."""
        # A copy of the root before the first await: a destroy meanwhile
        # (it takes no sandbox lock) closes the sandbox's rootfd, and its
        # number may be another sandbox's root by the time the lookup ends.
        try:
            path = sbfiles.check_path(path)
        except sbfiles.PathError as err:
            raise BadRequest(f"watch {where}: {err}", {"path": path}) from err
        try:
            own_root = os.dup(rootfd)
        except OSError as err:
            raise io_error("watch", where, err) from err
        try:
            # Cancelled: the copy is closed once the lookup is done with it.
            top_id = await self.workers.run_shielded(lambda _fut: os.close(own_root),
                                                     fswatch.top_identity, own_root, path)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            os.close(own_root)
            if isinstance(err, sbfiles.PathError):
                raise BadRequest(f"watch {where}: {err}", {"path": path}) from err
            if isinstance(err, OSError):
                raise io_error("watch", where, err) from err
            raise
        try:
            return fswatch.TreeWatch(own_root, path, top_id, recursive, self.max_dirs)
        except OSError as err:
            os.close(own_root)
            if err.errno in (errno.EMFILE, errno.ENFILE):      # its inotify instance
                raise LimitExceeded(_no_instance(where, "this host"),
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
            raise LimitExceeded(_too_deep(where), {"path": where}) from err
        except OSError as err:
            raise io_error("watch", where, err) from err

    async def _follow(self, sb, tree: fswatch.TreeWatch, where: str, ctx, gone: _SandboxGone) -> dict:
        """Stream the tree's events until it stops or the request is
        cancelled; `gone` (subscribed by the caller) wakes it at the
        sandbox's end."""
        loop = asyncio.get_running_loop()
        wake = gone.wake

        def readable() -> None:
            # Off until these events are sent: the loop must not spin on a
            # readable fd while a slow client holds us in emit.
            loop.remove_reader(tree.ifd)
            wake.set()

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
                if tree.stopped == "unmounted" and sb.state in ("stopping", "dead"):
                    # A mount of its own (/tmp, /dev/shm) that went with the
                    # sandbox, before the event saying so.
                    tree.stopped = "sandbox destroyed" if sb.state == "stopping" else "sandbox died"
                if tree.stopped:
                    await ctx.emit({"kind": "stopped", "path": tree.top, "is_dir": True, "reason": tree.stopped})
                    return {"reason": tree.stopped}
        finally:
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

    # ------------------------------------------------------------ microVM sandboxes

    async def _follow_vm(self, sb, path: str, recursive: bool, where: str, ctx) -> dict:
        """A microVM sandbox's files are in its guest: a child of the guest
        agent watches them by the same rules (csrc/guest/agent.c,
        watch_main) and writes one record per event to its stdout; they
        become the same events here. Cancelling the request kills the child."""
        try:
            path = sbfiles.check_path(path)
        except sbfiles.PathError as err:
            raise BadRequest(f"watch {where}: {err}", {"path": path}) from err
        wake = asyncio.Event()
        gone = _SandboxGone(sb.id, wake)
        self.events.subscribers.add(gone)
        try:
            link, run = await self.vm_files.start_watch(sb, path, recursive, self.max_dirs)
        except BaseException:
            self.events.subscribers.discard(gone)
            raise
        waker = asyncio.ensure_future(wake.wait())
        getter = None
        buf = bytearray()
        lagging = told = False
        try:
            while True:
                getter = asyncio.ensure_future(run.next_event())
                await asyncio.wait((getter, waker), return_when=asyncio.FIRST_COMPLETED)
                if gone.gone:
                    return await _stopped(ctx, path, gone.gone)
                ev = getter.result()
                if ev[0] == "out" and ev[1] == 1:
                    # The exec's output window bounds what waits here (a slow
                    # client holds the guest's child back); past a backlog of
                    # chunks its events are dropped, as a container's kernel
                    # queue drops them, until this loop has caught up.
                    lagging = lagging or run.events.qsize() > MAX_BACKLOG_CHUNKS
                    buf += ev[2]
                    for fields in _records(buf):
                        if lagging and fields[0] == "ev":
                            if not told:
                                await ctx.emit({"kind": "overflow", "path": path, "is_dir": True,
                                                "message": fswatch.OVERFLOW})
                                told = True
                            continue
                        done = await self._vm_record(fields, path, where, ctx)
                        if done is not None:
                            return done
                    if run.events.qsize() == 0:
                        lagging = told = False
                elif ev[0] == "error":
                    raise io_error("watch", where, ev[1])
                elif ev[0] in ("exited", "gone"):
                    if run.stopped_by == "pause":
                        raise Conflict(f"watch {where}: the sandbox was paused, which ends a microVM's file "
                                       "watches (its guest's watcher does not outlive the pause); watch again "
                                       "(that resumes it), and rescan what may have changed meanwhile",
                                       {"sandbox": sb.id, "path": path})
                    if ev[0] == "gone":
                        # The channel closed: the VM is going. The destroy or
                        # death that closed it publishes its event once torn down.
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(asyncio.shield(waker), GONE_GRACE_S)
                        if gone.gone:
                            return await _stopped(ctx, path, gone.gone)
                    raise DsecError(f"watch {where}: the guest's watch ended ({ev[0]}, status {ev[1]!r}) without "
                                    "saying why; watch again", code="io")
        finally:
            for fut in (getter, waker):
                if fut is not None and not fut.done():
                    fut.cancel()
            self.events.subscribers.discard(gone)
            if not run.done:
                with contextlib.suppress(Exception):
                    run.kill()
            link.forget(run)
            self.vm_watch_over(sb, run)

    async def _vm_record(self, f: list[str], top: str, where: str, ctx) -> dict | None:
        """One record of the guest's watch child; the request's result once it is the last."""
        tag = f[0]
        if tag == "ev" and len(f) == 6:
            event = {"kind": f[1], "path": fswatch.shown(top, f[5]), "is_dir": f[2] == "1"}
            if f[3] != "0":
                event["cookie"] = int(f[3])
            if f[4] == "1":
                event["scanned"] = True
            await ctx.emit(event)
        elif tag == "ready" and len(f) == 2:
            await ctx.emit({"kind": "ready", "path": top, "is_dir": True, "dirs": int(f[1])})
        elif tag == "overflow":
            await ctx.emit({"kind": "overflow", "path": top, "is_dir": True, "message": fswatch.OVERFLOW})
        elif tag == "stopped" and len(f) == 2:
            return await _stopped(ctx, top, f[1])
        elif tag == "err" and len(f) == 3:
            num = int(f[1]) or errno.EIO
            raise io_error("watch", where, OSError(num, os.strerror(num)))
        elif tag == "kernel" and len(f) == 2:
            kind = native.KERNEL_FS_MAGICS.get(int(f[1]), "a kernel filesystem")
            raise BadRequest(f"watch {where}: {fswatch.on_kernel_fs(top, kind)}", {"path": top})
        elif tag == "limit" and len(f) == 3:
            if f[1] == "dirs":
                raise LimitExceeded(fswatch.too_many_dirs(top, self.max_dirs), {"max_watch_dirs": self.max_dirs})
            if f[1] == "inotify":
                raise LimitExceeded(fswatch.no_watches_left(fswatch.shown(top, f[2]), "guest"),
                                    {"max_watch_dirs": self.max_dirs})
            if f[1] == "instances":
                raise LimitExceeded(_no_instance(where, "the guest"), {"errno": "EMFILE"})
            raise LimitExceeded(_too_deep(where), {"path": where})
        else:
            raise DsecError(f"watch {where}: the guest's watch sent a record this daemon does not know "
                            f"({tag!r}); the guest agent and the daemon differ: restart the sandbox", code="io")
        return None


# How many output chunks of a VM's watch child (each at most 64 KiB, the
# agent's OUT_CHUNK) may wait in the daemon for a slow client before its
# events are dropped for an `overflow`: at most about 4 MiB per watch.
MAX_BACKLOG_CHUNKS = 64

# After a VM's agent channel closes, how long a watch waits for the event
# (destroyed, died) that says why, to end with it as a container's would.
GONE_GRACE_S = 30.0


async def _stopped(ctx, top: str, reason: str) -> dict:
    await ctx.emit({"kind": "stopped", "path": top, "is_dir": True, "reason": reason})
    return {"reason": reason}


def _records(buf: bytearray) -> list[list[str]]:
    """The whole records at the front of `buf` (taken out of it): each a
    big-endian u32 length and NUL-terminated fields (agent.c, wrec)."""
    out = []
    while len(buf) >= 4:
        size = int.from_bytes(buf[:4], "big")
        if len(buf) < 4 + size:
            break
        body = bytes(buf[4:4 + size])
        del buf[:4 + size]
        out.append([os.fsdecode(x) for x in body.split(b"\0")[:-1]])
    return out


def _no_instance(where: str, on: str) -> str:
    return (f"watch {where}: no inotify instance left on {on} (sysctl fs.inotify.max_user_instances); "
            "cancel other watches or raise it")


def _too_deep(where: str) -> str:
    return f"watch {where}: the tree is deeper than a recursive watch walks; watch a directory further down"
