"""Files inside a sandbox, from the host side: read, write, list, stat,
mkdir, remove, rename.

Every path is resolved with openat2(RESOLVE_IN_ROOT) against the sandbox's
root fd (dsecd/fs/files.py), under the sandbox's user-namespace ids
(dsecd/userns.py file_op), in a worker thread. The bytes of a write are
written by a copier of the sandbox (dsecd/engine/copier.py), so that they are
charged to its memory cgroup.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import stat
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from .. import fds, protocol, tarsafe, userns
from ..errors import BadRequest, Conflict, DsecError, LimitExceeded, io_error
from ..fs import copytemps
from ..fs import files as sbfiles
from ..fs.copytemps import CopyTemps
from ..initlink import InitExec
from . import copier
from .events import EventBus
from .execs import owner_ids
from .sandboxes import Sandbox, SandboxRegistry, in_root
from .vmfiles import VmFiles
from .workers import Workers

log = logging.getLogger(__name__)

# copy_by_init(loop, handle, src, dst): the backend's (dsecd/backends/container.py).
CopyByInit = Callable[[object, object, int, int], "InitExec | None"]

# How long the start waits on a microVM's guest to remove a temporary the
# daemon before left (a stat and a remove).
VM_SWEEP_TIMEOUT_S = 30.0


class FileService:
    """`file_read`, `file_write`, `file_list`, `file_stat`, `file_mkdir`,
    `file_remove`, `file_rename`, `file_set_attrs`. `ensure_running(sb,
    why)` resumes a paused sandbox first (the memory service's); `max_chunk`
    is limits.max_file_chunk_bytes, the most one request moves;
    `copy_by_init` starts a sandbox's copier."""

    def __init__(self, registry: SandboxRegistry, workers: Workers,
                 ensure_running: Callable[[Sandbox, str], Awaitable[None]], max_chunk: int,
                 copy_by_init: CopyByInit, vm_files: VmFiles | None = None, temps: CopyTemps | None = None,
                 events: EventBus | None = None):
        self.registry = registry
        self.temps = temps
        # A write's temporary file (file_write temporary), recorded until its
        # rename or remove, until the connection that made it closes, or until
        # its sandbox is destroyed: (sandbox, path) -> its record, and what
        # forgets its connection's hook.
        self._temp_records: dict[tuple[str, str], tuple[Path, Callable[[], None]]] = {}
        # MicroVMs that were paused when a temporary of theirs was left
        # (its client gone, or the daemon before dead): its record waits for
        # the VM's resume, which removes it (_remove_left).
        self._vm_left: set[str] = set()
        self._removing: set[asyncio.Task] = set()
        if events is not None:
            events.listeners.append(self._on_event)
        self.workers = workers
        self.ensure_running = ensure_running
        self.max_chunk = max_chunk
        self.copy_by_init = copy_by_init
        self.vm_files = vm_files

    async def _file_op(self, req, verb: str, fn, *args, opens: bool = False,
                       stop: threading.Event | None = None):
        """fn(rootfd, *args) in a worker, its errors said as the protocol's;
        what it creates belongs to the request's `owner`, if it names one.
        opens: fn returns an fd; if the request is cancelled while fn runs
        (the work goes on), the fd it opens is closed when it returns.
        stop: an event fn checks as it goes; a cancel sets it and waits for
        fn to return."""
        sb = self.registry.get(req.sandbox, req)
        await self.ensure_running(sb, f"a file {verb}")
        owner = await owner_ids(sb, getattr(req, "owner", None), self.workers, self.vm_files)
        if sb.backend == "microvm":
            return await self.vm_files.file_op(sb, req, owner)
        root = sb.root_copy()           # the worker's: closed when it is done, or dropped with it
        op = functools.partial(userns.file_op, owner=owner)
        idmap = userns.IdMap.from_record(sb.idmap)
        try:
            if opens:       # shielded: run to its end, as the fd it opens is closed after it
                return await self.workers.run_shielded(_close_opened, fds.call_closing, root, op, idmap, fn,
                                                       root, *args)
            if stop is not None:
                return await self.workers.run_stoppable(stop, fds.call_closing, root, op, idmap, fn, root, *args)
            return await self.workers.run_owning(root, op, idmap, fn, root, *args)
        except sbfiles.PathError as err:
            raise BadRequest(f"{verb} {sb.id}:{_where(req)}: {err}", {"path": _where(req)}) from err
        except RecursionError as err:        # a tree deeper than a walk goes (remove, list)
            raise LimitExceeded(f"{verb} {sb.id}:{_where(req)}: the tree is deeper than this request "
                                "walks; remove or list its deeper parts first", {"path": _where(req)}) from err
        except OSError as err:
            raise io_error(verb, f"{sb.id}:{_where(req)}", err) from err

    async def read(self, req, ctx) -> dict:
        chunk = self.max_chunk
        length = chunk if req.length is None else req.length
        where = f"read {req.sandbox}:{req.path}"
        if length < 0 or req.offset < 0:
            raise BadRequest(f"{where}: offset and length must be >= 0, got offset {req.offset} length {length}",
                             {"path": req.path})
        if length > chunk:
            raise LimitExceeded(f"{where}: length {length} exceeds {chunk}; read in chunks at their offsets",
                                {"max_file_chunk_bytes": chunk, "path": req.path})
        if req.length is None:        # a VM's agent is sent the length: the default's, given
            req = dataclasses.replace(req, length=length)
        out = await self._file_op(req, "read", sbfiles.read_file, req.path, req.offset, length)
        if req.same_as is not None and out.get("file", req.same_as) != req.same_as:
            raise Conflict(f"read {req.sandbox}:{req.path}: the file was replaced since the chunk before was "
                           "read; read it again from the start", {"path": req.path, "replaced": True})
        if req.tail:
            out["data"] = protocol.AsTail(out["data"])
        return out

    async def write(self, req, ctx) -> dict:
        chunk = self.max_chunk
        where = f"write {req.sandbox}:{req.path}"
        if len(req.data) > chunk:
            raise LimitExceeded(f"{where}: data of {len(req.data)} bytes exceeds {chunk}; write in chunks at "
                                "their offsets (or with append=true)", {"max_file_chunk_bytes": chunk,
                                                                         "path": req.path})
        if not 0 <= req.mode <= 0o7777:
            raise BadRequest(f"{where}: mode must be in [0, 0o7777], got {req.mode:#o}", {"path": req.path})
        if req.offset is not None and (req.append or req.offset < 0):
            raise BadRequest(f"{where}: offset must be >= 0 and not given with append, got offset {req.offset} "
                             f"append {req.append}")
        keep = req.append or req.offset is not None
        sb = self.registry.get(req.sandbox, req)
        if sb.backend == "microvm":
            await self.ensure_running(sb, "a file write")
            owner = await owner_ids(sb, req.owner, self.workers, self.vm_files)
            # Held from before its first chunk is sent: a client killed while
            # it is written (the agent writes it all the same) leaves it too.
            release = self.hold_vm_temporary(sb.id, req.path, ctx) if req.temporary and not keep else None
            try:
                out = await self.vm_files.file_op(sb, req, owner)
            except DsecError:
                if release is not None:     # not made, or the writer removes it itself: no longer ours to remove
                    release()
                raise
            if release is not None:
                await self.journal_vm_temporary(sb, req.path)
            return out
        # With same_as, nothing is truncated before the file is known to be that one.
        fd = await self._file_op(req, "write", sbfiles.open_for_write, req.path, req.append,
                                 keep or req.same_as is not None, req.mode, req.parents, req.same_as is None,
                                 opens=True)
        try:
            st = os.fstat(fd)
            file_id = f"{st.st_dev}:{st.st_ino}"
            if req.same_as is not None:
                if file_id != req.same_as:
                    # A later chunk of a file that was removed and made again
                    # meanwhile (a temporary file its connection's end
                    # removed): the chunks before it are not in this one.
                    raise Conflict(f"{where}: the file was replaced since the chunk before was written; write "
                                   "it again from the start", {"path": req.path, "replaced": True})
                if not keep:
                    os.ftruncate(fd, 0)
            if req.temporary and not keep:
                self.hold_temporary(sb.id, req.path, st, ctx)
            if req.offset is not None:
                os.lseek(fd, req.offset, os.SEEK_SET)        # the copier writes from the fd's position
            await self._write_data(self.registry.get(req.sandbox, req), fd, req.data, f"{req.sandbox}:{req.path}")
            if req.data and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                # The copier's write cleared them (the kernel does at a write
                # by a process without CAP_FSETID over the file); the write is
                # the sandbox root's, whose writes keep them.
                os.fchmod(fd, stat.S_IMODE(st.st_mode))
            return {"size": os.fstat(fd).st_size, "file": file_id}
        finally:
            os.close(fd)

    async def _write_data(self, sb: Sandbox, fd: int, data: bytes, where: str) -> None:
        """data into the open file fd: by the sandbox's copier, charged to the
        sandbox; by a worker of the daemon if the sandbox has none. Returns
        only once nothing uses fd any more (the caller closes it), even when
        cancelled."""
        if not data:
            return
        async with sb.copy_lock:
            copier.check_room(sb.handle and sb.handle.group, len(data), where)
            try:
                await self._copy(sb, fd, data, where)
            except DsecError as err:
                gone = self.registry.destroyed_error(sb, f"write {where}")
                if gone is None:
                    raise
                raise gone from err

    async def _copy(self, sb: Sandbox, fd: int, data: bytes, where: str) -> None:
        loop, handle = self.workers.loop, sb.handle
        started: list[InitExec] = []

        def start(src: int, dst: int) -> InitExec | None:
            run = None if handle is None else self.copy_by_init(loop, handle, src, dst)
            if run is not None:
                started.append(run)
            return run

        if len(data) <= copier.PIPE_BYTES:
            if await copier.copy_small(start, fd, data, where):
                return
        else:
            work = asyncio.ensure_future(
                self.workers.run(copier.copy_chunks_from_thread, loop, start, fd, (data,), where, True))
            try:
                if await asyncio.shield(work):
                    return
            except asyncio.CancelledError:
                # The worker may still be about to hand fd to init: it must be
                # done before the caller closes fd (whose number could then
                # name another file). The copier's kill ends it soon.
                for run in started:
                    run.kill()
                await asyncio.wait({work})
                if not work.cancelled():
                    work.exception()        # the copier this kill ended: no error of the write's
                raise
        try:
            await self.workers.run(sbfiles.write_data, fd, data)
        except OSError as err:
            raise io_error("write", where, err) from err

    async def list(self, req, ctx) -> dict:
        if not 1 <= req.depth <= 64:
            raise BadRequest(f"depth must be between 1 and 64, got {req.depth}")
        return await self._file_op(req, "list", sbfiles.list_dir, req.path, req.depth)

    async def stat(self, req, ctx) -> dict:
        return await self._file_op(req, "stat", sbfiles.stat_path, req.path, req.follow)

    async def mkdir(self, req, ctx) -> dict:
        if not 0 <= req.mode <= 0o7777:
            raise BadRequest(f"mode must be in [0, 0o7777], got {req.mode:#o}")
        return await self._file_op(req, "mkdir", sbfiles.make_dir, req.path, req.parents, req.mode)

    async def remove(self, req, ctx) -> dict:
        # A cancel (or the client's end) stops a recursive remove between two
        # entries and is answered once it has stopped: nothing is deleted after.
        stop = threading.Event()
        out = await self._file_op(req, "remove", sbfiles.remove, req.path, req.recursive, stop, stop=stop)
        self._drop_temp(req, req.path)
        return out

    async def rename(self, req, ctx) -> dict:
        if req.keep_attrs and not req.overwrite:
            raise BadRequest("keep_attrs applies to a file replaced by the rename: give overwrite too")
        out = await self._file_op(req, "rename", sbfiles.rename, req.src, req.dst, req.overwrite,
                                  req.keep_attrs)
        self._drop_temp(req, req.src)
        return out

    async def set_attrs(self, req, ctx) -> dict:
        if req.mode is None and req.mtime is None:
            raise BadRequest(f"set attributes of {req.sandbox}:{req.path}: give mode, mtime or both",
                             {"path": req.path})
        if req.mode is not None and not 0 <= req.mode <= 0o7777:
            raise BadRequest(f"mode must be in [0, 0o7777], got {req.mode:#o}")
        # Any time a time_t holds, as a copy in takes a tar's (tarsafe.mtime_ns):
        # os.utime takes it as a count of nanoseconds past 64 bits, and the
        # file system clamps it to its own range (ext4: 1901 to 2446). What a
        # time_t does not hold is no time a file can have.
        if req.mtime is not None and not (math.isfinite(req.mtime) and abs(req.mtime) < tarsafe.MAX_TIME_T):
            raise BadRequest(f"set attributes of {req.sandbox}:{req.path}: mtime must be seconds since the epoch "
                             f"that a time_t holds (less than 2**63 either way), got {req.mtime!r}",
                             {"path": req.path})
        return await self._file_op(req, "set attributes of", sbfiles.set_attrs, req.path, req.mode, req.mtime,
                                   req.follow)

    def temporaries(self, sb_id: str) -> list[str]:
        """The paths of sandbox sb_id that clients are writing under a
        temporary name now (hold_temporary, hold_vm_temporary): parts of
        their files, not the sandbox's, which a snapshot leaves out. A path
        that is bytes (not UTF-8) as os.fsdecode gives it."""
        return [os.fsdecode(path) for sb, path in self._temp_records if sb == sb_id]

    def hold_temporary(self, sb_id: str, path: str, st: os.stat_result, ctx) -> None:
        """Record `path` of sandbox sb_id (inode `st`), made by a client under
        a temporary name (a write's part, a directory copy's landing), until
        that client renames or removes it: a client gone first (killed, its
        connection cut) will never finish, and its part goes at once; one
        left by the daemon's death goes at the next start (sweep_temps)."""
        if self.temps is None or (sb_id, path) in self._temp_records:
            return
        rec = self.temps.record(sb_id, path, st)
        if rec is not None:
            forget = ctx.at_close(functools.partial(self._temp_orphaned, sb_id, path, st.st_dev, st.st_ino))
            self._temp_records[(sb_id, path)] = (rec, forget)

    def hold_vm_temporary(self, sb_id: str, path: str, ctx, tree: bool = False):
        """hold_temporary for a microVM's `path` (a whole directory if
        `tree`), from before it is made: removed if the connection that
        made it closes before renaming or removing it. Once made,
        journal_vm_temporary records it for a restarted daemon. Returns what
        lets go of it (the path not made after all), or None if it was
        already held."""
        if (sb_id, path) in self._temp_records:
            return None
        forget = ctx.at_close(functools.partial(self._vm_temp_orphaned, sb_id, path, tree))
        self._temp_records[(sb_id, path)] = (None, forget)
        return functools.partial(self._forget_temp, sb_id, path)

    async def journal_vm_temporary(self, sb: Sandbox, path: str) -> None:
        """A microVM's temporary `path`, held (hold_vm_temporary) and now
        made, recorded by its guest's device and inode numbers (its agent's
        stat), so that the next daemon removes it if this one dies before
        its client renames or removes it (sweep_temps). Not recorded when
        the guest's agent reports no inode numbers (an older one) or the
        stat fails: the copy goes on, only a crash would leave it."""
        key = (sb.id, path)
        entry = self._temp_records.get(key)
        if self.temps is None or entry is None or entry[0] is not None:
            return
        try:
            ids = await self.vm_files.identity(sb, path)
        except DsecError as err:
            log.debug("sandbox %s: %s, a temporary, not recorded: %s", sb.id, path, err)
            return
        if ids is None or self._temp_records.get(key) is not entry:     # let go of meanwhile
            return
        rec = self.temps.record_ids(sb.id, path, *ids)
        if rec is not None:
            self._temp_records[key] = (rec, entry[1])

    async def end_vm_temporary(self, sb_id: str, path: str, tree: bool = False) -> None:
        """A microVM's temporary `path` (held by hold_vm_temporary) whose
        request was cancelled while its client stays connected: that client
        was told it failed and will not rename or remove it, so it goes now,
        not when the connection closes (which may be hours on, for an SDK's)."""
        entry = self._temp_records.get((sb_id, path))
        if entry is None:
            return
        entry[1]()              # the connection's end has nothing left to remove
        await self._vm_temp_orphaned(sb_id, path, tree, "its request was cancelled")

    def _forget_temp(self, sb_id: str, path: str) -> None:
        entry = self._temp_records.pop((sb_id, path), None)
        if entry is not None:
            rec, forget = entry
            forget()
            if rec is not None:
                self.temps.drop(rec)

    async def _vm_temp_orphaned(self, sb_id: str, path: str, tree: bool,
                                why: str = "its client left unfinished") -> None:
        """The connection that made a microVM's temporary `path` closed
        before renaming or removing it: removed now, if the VM runs (a pause
        takes its agent's channel: the sandbox's lock orders them)."""
        entry = self._temp_records.pop((sb_id, path), None)
        if entry is None:
            return
        rec = entry[0]
        sb = self.registry.by_id.get(sb_id)
        if sb is None or self.vm_files is None:
            if rec is not None:
                await self.workers.run(self.temps.drop, rec)
            return
        async with sb.lock:
            if sb.state != "running" or sb.handle is None:
                if rec is not None and sb.state == "paused":      # its record stays: the resume removes it
                    self._vm_left.add(sb_id)
                    log.info("sandbox %s: %s, the temporary copy of a write %s, goes at its resume",
                             sb_id, path, why)
                    return
                log.warning("sandbox %s: %s, the temporary copy of a write %s, stays (the sandbox is %s); "
                            "remove it with dsec rm -r %s:%s", sb_id, path, why, sb.state, sb_id, path)
                if rec is not None:     # its VM never runs again (dead, or going): nothing to remove it by
                    await self.workers.run(self.temps.drop, rec)
                return
            try:
                await self.vm_files.file_op(sb, protocol.FileRemove(sandbox=sb_id, path=path, recursive=tree))
            except DsecError as err:
                if err.code != "not_found":
                    log.warning("sandbox %s: cannot remove %s, the temporary copy of a write %s: %s; remove it "
                                "with dsec rm -r %s:%s", sb_id, path, why, err, sb_id, path)
            else:
                log.info("sandbox %s: removed %s, the temporary copy of a write %s", sb_id, path, why)
            finally:
                if rec is not None:
                    await self.workers.run(self.temps.drop, rec)

    def _drop_temp(self, req, path: str) -> None:
        """A write's temporary `path` renamed or removed by its writer: its
        record goes. (Records are keyed by the sandbox's id, which a request
        may give as a prefix: looked up only when there are records.)"""
        if not self._temp_records:
            return
        try:
            sb_id = self.registry.get(req.sandbox, req).id
        except DsecError:           # destroyed meanwhile (its records went with it), or stopping
            return
        self._forget_temp(sb_id, path)

    def _on_event(self, ev: dict) -> None:
        """A destroyed sandbox's temporary files went with it: their records
        go now, not when their writers' connections close (days, for an
        SDK's). A resumed microVM's left while it was paused go now too."""
        if ev["event"] == "resumed" and ev["sandbox"] in self._vm_left:
            self._vm_left.discard(ev["sandbox"])
            task = self.workers.loop.create_task(self._remove_left(ev["sandbox"]))
            self._removing.add(task)
            task.add_done_callback(self._removing.discard)
            return
        if ev["event"] != "destroyed":
            return
        if ev["sandbox"] in self._vm_left:
            # Its temporaries left while it was paused went with it: their
            # records (held by no connection, kept for the resume) go too.
            self._vm_left.discard(ev["sandbox"])
            task = self.workers.loop.create_task(self._drop_records(ev["sandbox"]))
            self._removing.add(task)
            task.add_done_callback(self._removing.discard)
        if not self._temp_records:
            return
        for key in [k for k in self._temp_records if k[0] == ev["sandbox"]]:
            rec, forget = self._temp_records.pop(key)
            forget()
            if rec is not None:
                self.workers.behind(self.temps.drop, rec)

    async def _temp_orphaned(self, sb_id: str, path: str, dev: int, ino: int) -> None:
        """The connection that wrote temporary file `path` closed before
        renaming or removing it: removed now, as a restart would."""
        entry = self._temp_records.pop((sb_id, path), None)
        if entry is None:
            return
        sb = self.registry.by_id.get(sb_id)
        if sb is not None and sb.handle is not None:
            await self._remove_temp(sb, path, dev, ino, "its client left unfinished")
        await self.workers.run(self.temps.drop, entry[0])

    async def _remove_temp(self, sb: Sandbox, path: str, dev: int, ino: int, why: str) -> None:
        """Remove temporary `path` of `sb` if it is still inode (dev, ino); logged."""
        try:
            removed = await in_root(self.workers, sb, copytemps.remove_if_same, path, dev, ino)
        except Conflict:        # being destroyed: the temporary goes with it
            return
        except (OSError, sbfiles.PathError) as err:
            log.warning("sandbox %s: cannot remove %s, the temporary copy of a write %s: %s; remove it with "
                        "dsec rm -r %s:%s", sb.id, path, why, err, sb.id, path)
        else:
            if removed:
                log.info("sandbox %s: removed %s, the temporary copy of a write %s", sb.id, path, why)

    async def sweep_temps(self) -> None:
        """At start, once sandboxes are re-adopted: remove the temporary
        files and directories of the copies the daemon before was making
        when it died (dsecd/fs/copytemps.py), and forget their records.
        A paused microVM's are kept (its guest cannot be asked now): its
        resume removes them."""
        if self.temps is None:
            return
        for rec_path, rec in await self.workers.run(self.temps.load):
            sb = self.registry.by_id.get(rec["sandbox"]) if rec else None
            if sb is not None and sb.backend == "microvm":
                if sb.state == "paused":
                    self._vm_left.add(sb.id)
                    continue        # kept: the VM's resume removes it
                if sb.state == "running" and sb.handle is not None:
                    await self._remove_vm_temp(sb, rec["path"], rec["dev"], rec["ino"])
            elif sb is not None and sb.handle is not None:
                await self._remove_temp(sb, rec["path"], rec["dev"], rec["ino"],
                                        "the daemon before left unfinished")
            await self.workers.run(self.temps.drop, rec_path)

    async def _remove_left(self, sb_id: str) -> None:
        """The temporaries of microVM sb_id recorded while it was paused and
        held by no connection any more: removed now that it runs (if they
        are still the files recorded), their records dropped. Which are held
        is looked at after the records are read: a client's write in the
        resumed VM may record its temporary meanwhile, and its hold is taken
        on the loop in the same step as its record is made."""
        try:
            recs = await self.workers.run(self.temps.load)
        except OSError as err:
            log.warning("sandbox %s: cannot read the records of its temporaries: %s", sb_id, err)
            return
        for rec_path, rec in recs:
            if rec is None or rec["sandbox"] != sb_id:
                continue
            if any(entry[0] == rec_path for entry in self._temp_records.values()):
                continue
            sb = self.registry.by_id.get(sb_id)
            if sb is None:
                return
            async with sb.lock:
                if sb.state != "running" or sb.handle is None:      # paused again meanwhile: its next resume
                    self._vm_left.add(sb_id)
                    return
                await self._remove_vm_temp(sb, rec["path"], rec["dev"], rec["ino"], "its client left unfinished")
            await self.workers.run(self.temps.drop, rec_path)

    async def _drop_records(self, sb_id: str) -> None:
        """Drop the records of destroyed sandbox sb_id's temporaries."""
        def drop() -> None:
            for rec_path, rec in self.temps.load():
                if rec is not None and rec["sandbox"] == sb_id:
                    self.temps.drop(rec_path)
        try:
            await self.workers.run(drop)
        except OSError as err:
            log.warning("sandbox %s: cannot drop the records of its temporaries: %s (the next start does)",
                        sb_id, err)

    async def _remove_vm_temp(self, sb: Sandbox, path: str, dev: int, ino: int,
                              why: str = "the daemon before left unfinished") -> None:
        """Remove a microVM's temporary `path` (a whole directory) that was
        left (`why`), if its guest's stat still gives (dev, ino): not a file
        of the sandbox's own that took the name meanwhile. Bounded
        (VM_SWEEP_TIMEOUT_S): a guest that does not answer costs the start
        no more; logged either way."""
        try:
            async with asyncio.timeout(VM_SWEEP_TIMEOUT_S):
                if await self.vm_files.identity(sb, path) != (dev, ino):
                    return
                await self.vm_files.file_op(sb, protocol.FileRemove(sandbox=sb.id, path=path, recursive=True))
        except (DsecError, TimeoutError) as err:
            if not isinstance(err, DsecError) or err.code != "not_found":
                log.warning("sandbox %s: cannot remove %s, the temporary copy of a write %s: %s; remove it "
                            "with dsec rm -r %s:%s", sb.id, path, why, str(err) or "no answer", sb.id, path)
            return
        log.info("sandbox %s: removed %s, the temporary copy of a write %s", sb.id, path, why)


def _close_opened(fut: asyncio.Future) -> None:
    """The fd an open returned after its request was cancelled: nobody else will close it."""
    if not fut.cancelled() and fut.exception() is None:
        os.close(fut.result())


def _where(req) -> str:
    """The path(s) a file request names, for its errors."""
    return req.path if hasattr(req, "path") else f"{req.src} -> {req.dst}"
