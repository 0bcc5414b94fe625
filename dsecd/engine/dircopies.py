"""Directory copies as tar streams: `file_tar_put` (a client's tar becomes a
new directory in a sandbox; its bytes come in `file_tar_input` requests)
and `file_tar_get` (a directory of a sandbox streamed out as a tar).

The archive is read and written in a worker as the sandbox's root
(dsecd/fs/tarcopy.py). A put holds its worker for as long as the client
sends (the tar is parsed as it arrives, never spooled), so at most
limits.max_tar_puts run at once, and one whose client sends nothing for
limits.frame_timeout_s is dropped. A get holds no worker between chunks.
The bytes of the files a put makes are written by the sandbox's copier, so
they are charged to its memory cgroup (dsecd/engine/copier.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import time

from .. import fds, tarsafe, userns
from ..errors import BadRequest, Conflict, DsecError, LimitExceeded, NotFound, io_error
from ..fs import files as sbfiles
from ..fs import tarcopy
from ..fs.copytemps import CopyTemps
from ..initlink import InitExec
from . import copier
from .events import EventBus
from .execs import owner_ids
from .files import CopyByInit
from .sandboxes import Sandbox, SandboxRegistry
from .vmfiles import VmFiles
from .workers import Workers

log = logging.getLogger(__name__)


class Aborted(Exception):
    """The put ended before its archive did (cancel, error, silence)."""


class ChunkPipe:
    """Bytes from `file_tar_input` requests (event loop) to the extracting
    worker (`read`). One chunk at most waits: a client is answered only once
    its previous chunk is taken, which is the put's flow control."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_timeout: float):
        self.loop = loop
        self.idle_timeout = idle_timeout
        self._q: queue.Queue = queue.Queue()
        self._buf = b""
        self._eof = False
        self.taken = asyncio.Event()
        self.taken.set()
        self.ended: str | None = None          # why no more input is wanted

    async def feed(self, data: bytes, eof: bool) -> None:
        await self.taken.wait()
        if self.ended:
            raise Conflict(f"the directory copy is over ({self.ended}); this input was not used")
        self.taken.clear()
        self._q.put(data)
        if eof:
            self._q.put(None)

    def end(self, why: str) -> None:
        """No more input: a worker waiting in read() stops, feeders are told."""
        self.ended = why
        self._q.put(Aborted(why))
        self.taken.set()

    def read(self, n: int = -1) -> bytes:
        """Up to n bytes (tarfile's stream mode asks for what it needs); b"" at eof."""
        while not self._buf and not self._eof:
            try:
                item = self._q.get(timeout=self.idle_timeout)
            except queue.Empty:
                raise Aborted(f"no input for {self.idle_timeout:g} s (limits.frame_timeout_s)") from None
            if isinstance(item, Aborted):
                raise item
            self.loop.call_soon_threadsafe(self.taken.set)
            if item is None:
                self._eof = True
            else:
                self._buf = item
        if n < 0 or n >= len(self._buf):
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:n], self._buf[n:]
        return out


def _retrieved(fut: asyncio.Future) -> None:
    """A done callback: the future's outcome taken, so that an abandoned
    one's error is not logged as never retrieved."""
    if not fut.cancelled():
        fut.exception()


async def _wait_through_cancels(fut: asyncio.Future, timeout: float) -> None:
    """Wait for `fut` for up to `timeout` seconds, whatever cancels the
    waiter meanwhile (the caller re-raises the cancel it handles)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not fut.done() and (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait([fut], timeout=left)
        except asyncio.CancelledError:
            pass


def _drop_records(temps: CopyTemps | None, records: list) -> None:
    """The copy-temps records of a put whose worker is done."""
    for rec in records:
        temps.drop(rec)


def busy(sb: Sandbox, n: int) -> None:
    """A directory copy of `sb` begins (+1) or ends (-1). One request may
    stream for longer than the sandbox's idle TTL: the reaper waits for it
    as for an exec, and the idle clock starts again at its end."""
    sb.copies += n
    sb.last_active = time.monotonic()


class DirCopyService:
    """`file_tar_put`, `file_tar_input`, `file_tar_get`. `ensure_running(sb,
    why)` resumes a paused sandbox first; `max_chunk` is
    limits.max_file_chunk_bytes, the most one frame carries; `copy_by_init`
    starts a sandbox's copier (the backend's); `hold_temporary(sb_id, path,
    st, ctx)` (FileService's) records a put's directory that its client
    named temporary, to be removed if the client goes before it does."""

    def __init__(self, registry: SandboxRegistry, workers: Workers, ensure_running, max_chunk: int,
                 max_entries: int, max_bytes: int, max_puts: int, idle_timeout: float, copy_by_init: CopyByInit,
                 vm_files: VmFiles | None = None, temps: CopyTemps | None = None, hold_temporary=None,
                 hold_vm_temporary=None, events: EventBus | None = None, journal_vm_temporary=None,
                 end_vm_temporary=None):
        self.registry = registry
        self._resuming: set[asyncio.Task] = set()
        self._ending: set[asyncio.Future] = set()     # removals of cancelled puts' VM temporaries, left to run
        self._putting: dict[str, int] = {}      # sandbox id -> its file_tar_puts under way
        # sandbox id -> the directories its puts under way extract into (`.dsec-put-<hex>`)
        self._landings: dict[str, list[str]] = {}
        if events is not None:
            events.listeners.append(self._on_event)
        self.temps = temps              # where a put's temporary directory is recorded while it exists
        self.hold_temporary = hold_temporary
        self.hold_vm_temporary = hold_vm_temporary      # FileService's, for a microVM's
        self.journal_vm_temporary = journal_vm_temporary    # and what records one made, for the next daemon
        self.end_vm_temporary = end_vm_temporary            # and what removes one whose request was cancelled
        self.vm_files = vm_files        # microVM sandboxes' copies run in their guests (VmFiles)
        self.copy_by_init = copy_by_init
        self.workers = workers
        self.ensure_running = ensure_running
        self.max_chunk = max_chunk
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_puts = max_puts
        self.idle_timeout = idle_timeout
        self.puts = 0

    def _on_event(self, ev: dict) -> None:
        """A pause stops a sandbox's directory copies under way: a microVM's
        vCPUs stop (its clients wait; a pause of the VM alone is refused
        while one runs), a container's copier is frozen (the copy failed
        once it made no progress for limits.frame_timeout_s). A copy is an
        op on the sandbox, as each chunk of a file write is, which resumes
        it: so it is resumed for them."""
        if ev["event"] != "paused":
            return
        sb = self.registry.by_id.get(ev["sandbox"])
        # A container's copy out (file_tar_get) reads its tree from the
        # host, which no freeze stops: only its copies in need it running.
        if sb is None or not (sb.copies if sb.backend == "microvm" else self._putting.get(sb.id)):
            return
        task = self.workers.loop.create_task(self._resume_for_copy(sb))
        self._resuming.add(task)
        task.add_done_callback(self._resuming.discard)

    async def _resume_for_copy(self, sb: Sandbox) -> None:
        try:
            await self.ensure_running(sb, "its directory copy under way")
        except DsecError as err:     # auto_resume off, or the VM going: the copy waits or ends with it
            log.warning("sandbox %s: not resumed for its directory copy under way: %s", sb.id, err)

    def _error(self, verb: str, where: str, err: BaseException):
        """The protocol error for what a copy raised."""
        if isinstance(err, sbfiles.PathError):
            return BadRequest(f"{verb} {where}: {err}", {"path": where})
        if isinstance(err, tarsafe.TooLarge):
            return LimitExceeded(f"{verb} {where}: {err} (limits.max_tar_entries, limits.max_tar_bytes)",
                                 {"max_entries": self.max_entries, "max_bytes": self.max_bytes})
        if isinstance(err, RecursionError):
            return LimitExceeded(f"{verb} {where}: the tree is deeper than a copy walks", {"path": where})
        if isinstance(err, Aborted):
            return Conflict(f"{verb} {where}: {err}; nothing was left behind")
        if isinstance(err, OSError):
            return io_error(verb, where, err)
        return None

    async def put(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        await self.ensure_running(sb, "a directory copy")
        owner = await owner_ids(sb, req.owner, self.workers, self.vm_files)
        if self.puts >= self.max_puts:
            raise LimitExceeded(f"{self.puts} directory copies into sandboxes are running (limits.max_tar_puts); "
                                "wait for one to end", {"max_tar_puts": self.max_puts})
        where = f"{sb.id}:{req.path}"
        pipe = ChunkPipe(asyncio.get_running_loop(), self.idle_timeout)
        self.puts += 1
        self._putting[sb.id] = self._putting.get(sb.id, 0) + 1
        ctx.register_input(pipe)
        busy(sb, +1)
        records: list = []
        landed: list[str] = []
        work = None
        # A client's landing place is held from the moment its directory is
        # made (its inode is the one renamed into place): a client killed
        # while the put still runs in its worker leaves it to be removed.
        hold = None
        if req.temporary and self.hold_temporary is not None:
            def hold(st) -> None:
                self.hold_temporary(sb.id, req.path, st, ctx)
        try:
            if sb.backend == "microvm":
                # Held from before the put starts: a client gone (killed) once
                # the whole archive reached the guest leaves the directory
                # made all the same (the request, cancelled, ends once the
                # guest's copy has), and it goes when the connection closes;
                # a removal that finds nothing is fine. A put that fails
                # leaves nothing (and one fails on a path that existed
                # before): not ours to remove then.
                release = None
                if req.temporary and self.hold_vm_temporary is not None:
                    release = self.hold_vm_temporary(sb.id, req.path, ctx, True)
                try:
                    out = await self.vm_files.tar_put(sb, req.path, pipe, self.max_entries, self.max_bytes, owner,
                                                      self.max_chunk if req.dirs else 0)
                    if release is not None and self.journal_vm_temporary is not None:
                        await self.journal_vm_temporary(sb, req.path)
                    return out
                except asyncio.CancelledError:
                    # Cancelled, its client still connected: a copy whose
                    # whole archive had reached the guest was renamed into
                    # place all the same (tar_put ends once the guest's copy
                    # has), and its client, told it was cancelled, will not
                    # rename or remove it. It goes before the request ends.
                    # Shielded: the removal took the path from what the
                    # connection's end removes, so a second cancel (that end,
                    # after a `cancel`) must not cut it; the request then
                    # ends without waiting for it.
                    if release is not None and self.end_vm_temporary is not None:
                        ending = asyncio.ensure_future(self.end_vm_temporary(sb.id, req.path, True))
                        try:
                            await asyncio.shield(ending)
                        except asyncio.CancelledError:
                            self._ending.add(ending)
                            ending.add_done_callback(self._ending.discard)
                            ending.add_done_callback(_retrieved)
                    raise
                except Exception:
                    if release is not None:
                        release()
                    raise
            # Its own copy of the root, closed by the worker when it is done
            # (the shield below keeps the worker going on a cancel).
            root = sb.root_copy()
            work = asyncio.ensure_future(self.workers.run(
                fds.call_closing, root, functools.partial(userns.file_op, owner=owner),
                userns.IdMap.from_record(sb.idmap),
                functools.partial(tarcopy.put_tree, dirs=self.max_chunk if req.dirs else 0), root,
                req.path, pipe, self.max_entries, self.max_bytes, self._filler(sb, where),
                self._recorder(sb, records, hold, landed)))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                # The worker goes on reading the archive: ended, it removes
                # the partial directory. The request ends after that (within
                # limits.frame_timeout_s: a frozen copier can hold it up), so
                # that a client told the copy was cancelled finds nothing of it.
                # A second cancel (a `cancel`, then the client's connection
                # closing) does not cut that wait short.
                pipe.end("the copy request was cancelled")
                await _wait_through_cancels(work, self.idle_timeout)
                work.add_done_callback(_retrieved)
                raise
        except Exception as err:
            mapped = self.registry.destroyed_error(sb, f"copy into {where}") or self._error("copy into", where, err)
            if mapped is None:
                raise
            raise mapped from err
        finally:
            # A cancelled put's worker is still reading: this stops it, and it removes what it made.
            pipe.end("the copy request ended")
            ctx.unregister_input()
            # Its temporary renamed into place or removed once the worker is
            # done, and not before: recorded until then, for the next daemon
            # to remove should this one die meanwhile. The put counts as
            # running until then too (limits.max_tar_puts, the sandbox's
            # idle TTL, its resume on a pause): its worker still writes the
            # sandbox after a cancelled request's wait ran out.
            if work is None or work.done():
                self._put_ended(sb, records, landed)
            else:
                work.add_done_callback(lambda _: self._put_ended(sb, records, landed))

    def landings(self, sb_id: str) -> list[str]:
        """The directories that puts under way into sandbox sb_id extract
        into, to be renamed into place at their end: half-made, not the
        sandbox's yet (a snapshot leaves them out)."""
        return list(self._landings.get(sb_id, ()))

    def _put_ended(self, sb: Sandbox, records: list, landed: list[str]) -> None:
        """A put whose worker (if it had one) is done: its records dropped,
        it no longer counts as running."""
        _drop_records(self.temps, records)
        held = self._landings.get(sb.id, [])
        for path in landed:
            if path in held:
                held.remove(path)
        if not held:
            self._landings.pop(sb.id, None)
        self.puts -= 1
        if self._putting[sb.id] > 1:
            self._putting[sb.id] -= 1
        else:
            del self._putting[sb.id]
        busy(sb, -1)

    def _recorder(self, sb: Sandbox, records: list, hold=None, landed: list[str] | None = None):
        """made(path, st) for put_tree: the temporary directory recorded (on
        the loop: the worker runs with the sandbox's fs ids, which may not
        write the state dir), its record kept in `records` and its path in
        `landed` and the sandbox's landings; hold(st), if given, told its
        stat there too."""
        if self.temps is None:
            return None
        loop = self.workers.loop

        def keep(path: str, st) -> None:
            if landed is not None:
                landed.append(path)
                self._landings.setdefault(sb.id, []).append(path)
            if hold is not None:
                hold(st)
            rec = self.temps.record(sb.id, path, st)
            if rec is not None:
                records.append(rec)

        def made(path: str, st) -> None:
            loop.call_soon_threadsafe(keep, path, st)

        return made

    def _filler(self, sb: Sandbox, where: str):
        """fill(fd, chunks, size) for the files of a copy into `sb`: written
        by its copier, charged to its memory cgroup, refused if they would
        take it past its limit (dsecd/engine/copier.py)."""
        loop, handle = self.workers.loop, sb.handle

        def start(src: int, dst: int) -> InitExec | None:
            return None if handle is None else self.copy_by_init(loop, handle, src, dst)

        def fill(fd: int, chunks, size: int) -> bool:
            # The sandbox's copy lock (file_write holds it on the loop), taken
            # from this worker: one copier at a time, its room checked under it.
            asyncio.run_coroutine_threadsafe(sb.copy_lock.acquire(), loop).result()
            try:
                copier.check_room(handle and handle.group, size, where)
                return copier.copy_chunks_from_thread(loop, start, fd, chunks, where)
            finally:
                loop.call_soon_threadsafe(sb.copy_lock.release)

        return fill

    async def put_input(self, req, ctx) -> dict:
        if len(req.data) > self.max_chunk:
            raise LimitExceeded(f"file_tar_input data of {len(req.data)} bytes exceeds {self.max_chunk}; "
                                "send smaller chunks", {"max_file_chunk_bytes": self.max_chunk})
        pipe = await ctx.input_for(req.put_id)
        if not isinstance(pipe, ChunkPipe):
            raise NotFound(f"no file_tar_put with id {req.put_id} running on this connection")
        await pipe.feed(req.data, req.eof)
        return {}

    async def get(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        await self.ensure_running(sb, "a directory copy")
        busy(sb, +1)
        try:
            return await self._get(sb, req, ctx)
        finally:
            busy(sb, -1)

    async def _get(self, sb: Sandbox, req, ctx) -> dict:
        if sb.backend == "microvm":
            return await self.vm_files.tar_get(sb, req.path, self.max_entries, self.max_bytes, ctx)
        where = f"{sb.id}:{req.path}"
        idmap = userns.IdMap.from_record(sb.idmap)
        root = sb.root_copy()       # the tar's: closed once its top is open, or at its close
        try:        # a bad path is refused here, before anything is read
            tar = tarcopy.TreeTar(root, req.path, self.max_chunk, self.max_entries, self.max_bytes)
        except Exception as err:
            os.close(root)
            mapped = self._error("copy out of", where, err)
            if mapped is None:
                raise
            raise mapped from err
        reading = False             # a worker is in tar.read: only it may close the tar (close_later)

        def close_later(_fut) -> None:
            tar.close()

        try:
            while True:
                reading = True
                data = await self.workers.run_shielded(close_later, userns.file_op, idmap, tar.read)
                reading = False
                if not data:
                    return tar.result()
                await ctx.emit({"data": data})
        except Exception as err:
            reading = False
            mapped = self.registry.destroyed_error(sb, f"copy out of {where}") or self._error("copy out of", where, err)
            if mapped is None:
                raise
            raise mapped from err
        finally:
            if not reading:
                tar.close()
