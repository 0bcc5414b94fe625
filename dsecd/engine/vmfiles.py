"""A microVM sandbox's files, reached through its guest agent's channel:
file requests (read, write, list, stat, mkdir, remove, rename, set
attributes), directory copies as tar streams (a child of the agent writes
or makes the tree), file watches (a child of the agent watching), a
create's cwd, and the writable layer read for a snapshot. The mechanism is
dsecd/backends/microvm/ and csrc/guest/agent.c.

The services that own an op (files, dircopies, watches, creates' cwd,
images' snapshot; execs and procs read a VM's account files through
file_op) keep its checks and hand a VM sandbox to the method here, so both
backends answer with the same semantics, errors and advice: a file error
carries `detail.errno` and reads as a container's (_as_a_containers), a
full layer says which cap it met (_full).

What it needs of MicroVMService comes as single methods: the agent's
channel of a running VM (`agent`, which also wakes its balloon), the count
a pause waits for (`request_running`) and the record of a watch's guest
child, which a pause ends (`watch_started`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import struct
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .. import tarsafe
from ..backends.microvm import wire
from ..backends.microvm.agent import AgentError, AgentExec, AgentGone, AgentLink
from ..backends.microvm.backend import GUEST_FIXED, tmp_cap, upper_cap
from ..config import size_text
from ..errors import BadRequest, Conflict, DsecError, LimitExceeded, NotFound, Unsupported, io_error
from ..execio import _decode_status
from ..fs import erofs, tarcopy, uppertar
from ..fs import files as sbfiles
from ..protocol import FileMkdir
from .microvms import run_over
from .sandboxes import Sandbox
from .workers import Workers

log = logging.getLogger(__name__)

# What a file write or copy into a VM must leave of the guest's available
# memory, for its kernel and processes: a 16th of its RAM, within these
# bounds (as engine/copier.py keeps for a container's).
GUEST_RESERVE_MIN = 16 << 20
GUEST_RESERVE_MAX = 64 << 20
# A file of a directory copy at least this big is checked against the
# guest's memory before it is sent (smaller ones meet the layer's cap).
PUT_CHECK_BYTES = 1 << 20
PUT_END_S = 30.0        # a cancelled put's guest child ends by then (it writes what came, or removes it)


class VmFiles:
    """File requests, directory copies, file watches, a create's cwd and
    the writable layer of microVM sandboxes. `agent(sb)` is the channel of
    a running VM (MicroVMService.agent), `request_running(sb)` counts a
    request a pause waits for (MicroVMService.request_running),
    `watch_started(sb, run)` records a watch's guest child for a pause to
    end (MicroVMService.watch_started); `max_output` bounds what a copy
    child's reports may fill (limits.max_exec_output_bytes); `balloon`
    (BalloonService) says what the VM's balloon holds."""

    def __init__(self, agent: Callable[[Sandbox], AgentLink],
                 request_running: Callable[[Sandbox], contextlib.AbstractContextManager],
                 watch_started: Callable[[Sandbox, AgentExec], None], workers: Workers, max_output: int,
                 balloon=None):
        self.agent = agent
        self.request_running = request_running
        self.watch_started = watch_started
        self.workers = workers
        self.max_output = max_output
        self.balloon = balloon

    # ------------------------------------------------------------ the writable layer

    @contextlib.asynccontextmanager
    async def upper_tree(self, sb: Sandbox, scratch: Path, max_bytes: int, exclude: list[str] = ()):
        """The VM's writable layer (the overlay's upper dir in the guest) as
        a host directory, for snapshot: the agent streams it as a tar (every
        guest process frozen meanwhile), unpacked under `scratch`
        (dsecd/fs/uppertar.py); removed on exit. No pause or resume runs
        meanwhile (the sandbox's lock). The `exclude`d paths are left out
        by the agent, so they count neither in the tar nor against
        `max_bytes` (the container's bound leaves them out too): past
        that, `limit`."""
        self.agent(sb)
        work = Path(tempfile.mkdtemp(prefix=f"vm-upper-{sb.id}-", dir=scratch))
        try:
            tar, tree = work / "upper.tar", work / "upper"
            fd = os.open(tar, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            failed: list[OSError] = []

            def on_data(data: bytes) -> None:       # on the loop, from the link's reader: never raise
                if failed:
                    return
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                except OSError as err:
                    failed.append(err)

            try:
                async with sb.lock:
                    if sb.state == "paused":        # by a pause this waited for: its channel went
                        raise Conflict(f"sandbox {sb.id} is a paused microVM; resume it first (dsec resume "
                                       f"{sb.id})", {"sandbox": sb.id, "state": sb.state})
                    skip = sorted({rel for rel in map(erofs.exclude_rel, exclude) if rel})
                    link = self.agent(sb)
                    # The agent freezes the guest's processes while it
                    # streams: their execs' run-time timeouts
                    # (Sandbox.paused_for) must not count it, as a
                    # container's do not count its snapshot's freeze.
                    clock = sb.paused_at is None
                    if clock:
                        sb.paused_at = time.monotonic()
                    try:
                        r = await link.stream(wire.TAR, on_data, wire.u64(max_bytes), wire.u64(len(skip)),
                                              *map(wire.bstr, skip))
                    finally:
                        if clock:
                            sb.end_paused_time()
            except AgentError as err:
                if err.errno == errno.EFBIG:
                    raise LimitExceeded(f"snapshot: the sandbox's changed files add up to more than "
                                        f"images.max_snapshot_bytes ({max_bytes} bytes; {err.step}); remove large "
                                        "or sparse files, or exclude them", {"sandbox": sb.id}) from err
                raise io_error("read the writable layer of", sb.id, err) from err
            except AgentGone as err:
                raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err
            finally:
                os.close(fd)
            if failed:
                raise io_error("store the writable layer of", f"{sb.id} in {tar}", failed[0])
            entries, file_bytes, skipped = r.u64(), r.u64(), r.u64()
            log.info("sandbox %s: writable layer read, %d entries, %d bytes of files, %d skipped (sockets, "
                     "devices)", sb.id, entries, file_bytes, skipped)
            tree.mkdir(0o700)
            try:
                await self.workers.run(uppertar.unpack, tar, tree)
            except (ValueError, OSError) as err:
                raise DsecError(f"snapshot of sandbox {sb.id}: its writable layer's tar: {err}", code="io") from err
            tar.unlink()
            yield tree
        finally:
            await self.workers.run(shutil.rmtree, work, True)

    # ------------------------------------------------------------ directory copies

    async def tar_get(self, sb: Sandbox, path: str, max_entries: int, max_bytes: int, ctx) -> dict:
        """file_tar_get: a child of the guest agent walks the directory and
        writes the tar to its stdout (csrc/guest/agent.c, tar_get_main), by
        the container backend's rules; its chunks go to the client as they
        come."""
        path = _check(path, f"copy out of {sb.id}:{path}")
        where = f"{sb.id}:{path}"

        async def emit(data: bytes) -> None:
            await ctx.emit({"data": data})

        code, reports = await self._copy(sb, "copy out of", where, [path, str(max_entries), str(max_bytes)],
                                         wire.EXEC_TAR_GET, emit)
        if code == 0 and "done" in reports:
            count, size = reports["done"]
            return {"path": path, "count": int(count), "bytes": int(size), "skipped": reports["skip"]}
        raise self._copy_failed("copy out of", where, code, reports, max_entries, max_bytes)

    async def tar_put(self, sb: Sandbox, path: str, pipe, max_entries: int, max_bytes: int,
                      owner: tuple[int, int] | None = None, dirs: int = 0) -> dict:
        """file_tar_put: the client's tar (`pipe`, a dircopies.ChunkPipe) is
        read and checked here (dsecd/tarsafe.py, in a worker) and its entries
        sent as records to a child of the guest agent that makes them under a
        new directory and renames it into place (agent.c, tar_put_main).
        `dirs`: the budget of tarcopy.dir_entries (0: not listed). A
        refused or broken copy leaves nothing: the child removes what it made
        when its input ends before the end record."""
        path = _check(path, f"copy into {sb.id}:{path}")
        where = f"{sb.id}:{path}"
        if path == "/":
            raise BadRequest(f"copy into {where}: cannot copy a directory onto /; name a new directory below it",
                             {"path": path})
        # The put child's argv: the directory, then its owner's ids (agent.c),
        # then how its records give their mtimes to an agent that takes them
        # finer than in seconds (_put_records).
        ids = owner if self._owner_fields(sb, owner, f"copy into {where}") else None
        version = self.agent(sb).agent_version
        if version >= wire.TIMES_AGENT_VERSION:
            argv = [path, *(str(i) for i in ids or (0, 0)), "ts" if version >= wire.WIDE_TIMES_AGENT_VERSION else "ns"]
        else:
            argv = [path, *(str(i) for i in ids)] if ids else [path]
        loop = asyncio.get_running_loop()
        started: asyncio.Future = loop.create_future()

        def send(data: bytes, eof: bool) -> None:          # from the worker
            run = started.result()
            asyncio.run_coroutine_threadsafe(run.send_stdin(data, eof), loop).result()
            if not eof and (run.ended or run.done):
                raise _CopyEnded()

        def room(size: int) -> None:                     # from the worker, before a big file's record
            asyncio.run_coroutine_threadsafe(self.check_room(sb, size, where), loop).result()

        async def records() -> tarsafe.Seen:
            run = await started
            try:
                return await self.workers.run(_put_records, pipe, send, max_entries, max_bytes, room,
                                              self.agent(sb).agent_version)
            except BaseException:
                # Refused, broken or abandoned: the child's input ends before
                # the end record, so it removes what it made and exits.
                with contextlib.suppress(AgentGone):
                    run.close_stdin_nowait()
                raise

        feeding = loop.create_task(records())
        try:
            code, reports = await self._copy(sb, "copy into", where, argv, wire.EXEC_TAR_PUT, None, started)
        except BaseException:
            feeding.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        finally:
            if not started.done():
                started.cancel()
            pipe.end("the copy request ended")        # the worker, if still reading, stops
        seen, failed = None, None
        try:
            seen = await feeding
        except Exception as err:
            failed = err
        if code == 0 and "done" in reports and seen is not None:
            out = {"path": path, "count": seen.entries, "bytes": seen.bytes}
            if dirs:
                out["dirs"] = tarcopy.dir_entries(seen, dirs)
            return out
        if isinstance(failed, tarsafe.Refused):
            raise BadRequest(f"copy into {where}: {failed}", {"path": where}) from failed
        if isinstance(failed, tarsafe.TooLarge):
            raise LimitExceeded(f"copy into {where}: {failed} (limits.max_tar_entries, limits.max_tar_bytes)",
                                {"max_entries": max_entries, "max_bytes": max_bytes}) from failed
        if isinstance(failed, (tarfile.TarError, EOFError)):
            raise BadRequest(f"copy into {where}: the tar stream is not a valid archive: {failed}",
                             {"path": where}) from failed
        if type(failed).__name__ == "Aborted" and reports.get("err", (str(errno.ECONNABORTED),))[0] == str(
                errno.ECONNABORTED):
            # (dircopies.Aborted: the request was cancelled or its client sent nothing in time)
            raise Conflict(f"copy into {where}: {failed}; nothing was left behind") from failed
        if failed is not None and not isinstance(failed, (_CopyEnded, OSError)) and type(failed).__name__ != "Aborted":
            raise failed
        raise self._copy_failed("copy into", where, code, reports, max_entries, max_bytes, sb)

    async def _copy(self, sb: Sandbox, verb: str, where: str, argv: list[str], flags: int, on_out,
                    started: asyncio.Future | None = None) -> tuple[int | None, dict]:
        """Run one copy child to its end: its stdout to on_out, its reports
        (NUL-separated fields on stderr) parsed; (exit code, reports). It
        counts as a running exec (no pause, no idle expiry meanwhile); a
        cancel ends its input (a put's child then removes what it made) and
        kills it."""
        link = self.agent(sb)
        put = bool(flags & wire.EXEC_TAR_PUT)
        sb.execs += 1
        run = None
        err_out = bytearray()
        try:
            run = await link.start_exec(argv, [], "/", 0, put, flags)
            if started is not None:
                started.set_result(run)
            status = None
            while status is None:
                ev = await run.next_event()
                if ev[0] == "out":
                    if ev[1] == 1 and on_out is not None:
                        await on_out(ev[2])
                    elif ev[1] == 2 and len(err_out) < self.max_output:
                        err_out += ev[2]
                elif ev[0] == "exited":
                    status = ev[1]
                elif ev[0] == "error":
                    raise io_error(verb, where, ev[1])
                elif ev[0] == "gone":
                    raise Conflict(f"sandbox {sb.id} is exiting; the directory copy ended with its VM",
                                   {"sandbox": sb.id})
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err
        except BaseException:
            if run is not None and not run.done:
                with contextlib.suppress(AgentGone):
                    run.close_stdin_nowait()
                    if not put:
                        run.kill()
                if put:
                    # Its child, its input ended, either renames the whole
                    # copy into place (all of it came) or removes it: the
                    # request ends after that, so that what its end triggers
                    # (a temporary's removal when its client is gone) finds
                    # the copy where it will stay.
                    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                        await asyncio.wait_for(run.over.wait(), PUT_END_S)
            raise
        finally:
            run_over(sb, link, run)
        code, _sig = _decode_status(status)
        return code, _reports(bytes(err_out), put)

    @staticmethod
    def _copy_failed(verb: str, where: str, code: int | None, reports: dict, max_entries: int,
                     max_bytes: int, sb: Sandbox | None = None) -> DsecError:
        if "err" in reports:
            num, what = reports["err"]
            num = int(num) or errno.EIO
            if code == 3:
                return LimitExceeded(f"{verb} {where}: {what} (limits.max_tar_entries, limits.max_tar_bytes)",
                                     {"max_entries": max_entries, "max_bytes": max_bytes})
            if num == errno.ENOSPC and sb is not None:
                return VmFiles._full(verb, where, sb, "nothing of the copy is left")
            if num == errno.EEXIST and what.startswith("exists"):
                return io_error(verb, where, OSError(num, f"{where.partition(':')[2]} {what}"))
            return io_error(verb, where, OSError(num, f"{os.strerror(num)} (at {what or '.'})"))
        return DsecError(f"{verb} {where}: the guest's copy ended with status {code} and no report",
                         code="io")

    # ------------------------------------------------------------ file watches

    async def start_watch(self, sb: Sandbox, path: str, recursive: bool, max_dirs: int):
        """Start file_watch's child in the guest (csrc/guest/agent.c,
        watch_main); (link, AgentExec): its records come on the exec's
        stdout (dsecd/engine/watches.py reads them)."""
        link = self.agent(sb)
        start = asyncio.ensure_future(link.start_exec([path, "1" if recursive else "0", str(max_dirs)], [], "/",
                                                      0, False, wire.EXEC_WATCH))

        def kill_orphan(fut: asyncio.Future) -> None:
            # A request cancelled while its start was being sent: the child
            # would watch on with nobody reading it. The agent takes frames
            # in order, so the kill finds it started.
            if not fut.cancelled() and fut.exception() is None:
                run = fut.result()
                with contextlib.suppress(AgentGone):
                    run.kill()
                link.forget(run)

        try:
            run = await asyncio.shield(start)
        except asyncio.CancelledError:
            start.add_done_callback(kill_orphan)
            raise
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err
        self.watch_started(sb, run)        # the caller ends with MicroVMService.watch_over
        return link, run

    # ------------------------------------------------------------ files

    async def _file(self, sb: Sandbox, verb: str, where: str, kind: int, *fields: bytes) -> wire.Reader:
        # Counted, as file_op is: not every file request comes through it
        # (the stat that records a temporary by its guest's inode, a
        # create's cwd check), and a pause must not cut one on its way.
        link = self.agent(sb)
        try:
            with self.request_running(sb):
                return await link.request(kind, *fields)
        except AgentError as err:
            if err.errno == errno.EINVAL and err.step == "open" and kind in (wire.READ, wire.WRITE):
                await self._refuse_irregular(sb, verb, where)     # the agent's require_regular
            failed = io_error(verb, f"{sb.id}:{where}", _as_a_containers(err, where))
            failed.detail["guest_step"] = err.step
            raise failed from err
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err

    async def _refuse_irregular(self, sb: Sandbox, verb: str, path: str) -> None:
        """BadRequest, in a container's words (fs/files.py _require_regular),
        if `path` is a FIFO, socket or device: the guest agent reads and
        writes regular files only and says EINVAL of the others."""
        try:
            kind = (await self.stat_path(sb, path))["type"]
        except DsecError:
            return
        if kind not in ("file", "dir"):
            raise BadRequest(f"{verb} {sb.id}:{path}: {path} is a {kind}, not a regular file", {"path": path})

    async def check_room(self, sb: Sandbox, size: int, where: str) -> None:
        """Refuse (`limit`) writing `size` bytes of files into the VM when
        they would not fit in its guest's available memory (less a reserve):
        a VM's files are tmpfs pages of its RAM, which nothing reclaims, as a
        container's are charged to its --memory (copier.check_room). The
        layer's cap (upper_cap) is what keeps the guest alive whatever this
        says (its processes allocate meanwhile; a guest may fake its
        /proc/meminfo and fool only itself); this makes the common case a
        clear refusal before anything is written."""
        if size <= 0:
            return
        available = await self._guest_available(sb)
        if available is None:
            return
        memory = sb.limits["memory"]
        reserve = min(max(GUEST_RESERVE_MIN, memory // 16), GUEST_RESERVE_MAX)
        if size > available - reserve:
            raise LimitExceeded(
                f"write {where}: {size_text(size)} would take the sandbox past its memory limit "
                f"({size_text(memory)} of guest RAM; {size_text(max(0, available))} available, less "
                f"{size_text(reserve)} kept for its kernel and processes). "
                "A microVM's files are kept in its RAM: write less, free memory or remove files in the sandbox, "
                "or create it with more --memory",
                {"path": where, "size": size, "left": max(0, available), "reserve": reserve})

    async def _guest_available(self, sb: Sandbox) -> int | None:
        """The guest's MemAvailable (its /proc/meminfo, read by the agent)
        plus what its balloon holds (given back on use); None if unknown."""
        link = self.agent(sb)
        try:
            r = await link.request(wire.READ, wire.bstr("/proc/meminfo"), wire.u64(0), wire.u64(16 << 10))
        except AgentError as err:
            log.debug("sandbox %s: its /proc/meminfo is unreadable (%s); a write is not checked against its "
                      "memory", sb.id, err)
            return None
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err
        r.u64()
        available = _mem_available(r.bytes())
        if available is None:
            return None
        return available + (0 if self.balloon is None else self.balloon.held(sb.id))

    @staticmethod
    def _full(verb: str, where: str, sb: Sandbox, left: str = "the file is partly written") -> LimitExceeded:
        """ENOSPC from the guest: its writable layer or /tmp is full. `left`:
        what the failed request left behind. The advice names the cap that
        was met: the layer's is --disk where that is below upper_cap."""
        memory, disk = sb.limits["memory"], sb.limits.get("disk")
        most = upper_cap(memory)
        bigger = (f"a larger --disk (up to {most} bytes) or, for /tmp, more --memory"
                  if disk is not None and disk < most else "more --memory")
        inodes = sb.limits.get("disk_inodes")
        files = f" and {inodes} files and directories (sandbox.disk_inodes)" if inodes else ""
        return LimitExceeded(
            f"{verb} {where}: no space left in the sandbox. A microVM's files are kept in its RAM: its "
            f"writable layer is capped at {disk} bytes (--disk, and at most half of its --memory of "
            f"{memory} less {GUEST_FIXED >> 20}M for the guest's kernel){files}, /tmp at {tmp_cap(memory)} bytes "
            f"(an eighth of the same); {left}. Remove files in the sandbox, or create it with {bigger}",
            {"path": where, "errno": "ENOSPC"})

    async def _require_replaceable(self, sb: Sandbox, dst: str) -> None:
        try:
            kind = (await self.stat_path(sb, dst))["type"]
        except DsecError as err:
            if err.code == "not_found":
                return
            raise
        why = sbfiles.unreplaceable(dst, kind)
        if why:
            raise BadRequest(why, {"sandbox": sb.id, "path": dst})

    async def stat_path(self, sb: Sandbox, path: str, follow: bool = False) -> dict:
        """As the container's sbfiles.stat_path: lstat, a symlink with its
        `target` (from an agent of STAT_AGENT_VERSION on); with `follow`
        what it leads to, inside the guest's root. Its mtime is any time a
        time_t holds from an agent of WIDE_STAT_AGENT_VERSION on (an older
        one's wraps past 2262 and before 1677)."""
        path = _check(path, f"stat {sb.id}:{path}")
        version = self.agent(sb).agent_version
        if follow and version < wire.STAT_AGENT_VERSION:
            # bad_request, as it was before any agent could (dsec cp falls back on it)
            raise BadRequest(f"stat {sb.id}:{path}: this microVM's guest agent (version {version}) cannot follow "
                             f"a symlink (version {wire.STAT_AGENT_VERSION} can): stat the target's own path, "
                             "or recreate the sandbox on this daemon's guest image",
                             {"sandbox": sb.id, "agent_version": version})
        ts = version >= wire.WIDE_STAT_AGENT_VERSION
        flags = (wire.STAT_FOLLOW if follow else 0) | (wire.STAT_TS if ts else 0)
        fields = (wire.u64(flags),) if version >= wire.STAT_AGENT_VERSION else ()
        r = await self._file(sb, "stat", path, wire.STAT, wire.bstr(path), *fields)
        out = {**r.stat(ts), "path": path}
        if r.more():
            r.u64(), r.u64()                    # its device and inode numbers (identity)
        if out["type"] == "symlink" and r.more():
            out["target"] = sbfiles.name_text(r.bytes())
        return out

    async def identity(self, sb: Sandbox, path: str) -> tuple[int, int] | None:
        """The guest's (device, inode) numbers of `path` (not followed): what
        a temporary a copy made is recorded by, so that a restarted daemon
        removes that path only while it is still the same file. None when
        the guest's agent predates reporting them. Raises as stat does."""
        path = _check(path, f"stat {sb.id}:{path}")
        r = await self._file(sb, "stat", path, wire.STAT, wire.bstr(path))
        r.stat()
        if not r.more():
            return None
        return r.u64(), r.u64()

    async def file_op(self, sb: Sandbox, req, owner: tuple[int, int] | None = None) -> dict:
        """file_read, file_write, file_list, file_stat, file_mkdir,
        file_remove, file_rename (their checks done by FileService);
        `owner`: the (uid, gid) what a write or mkdir makes belongs to
        (None: root). Counted before its first await, so that a pause that
        takes the sandbox's lock after the caller's ensure_running waits for it."""
        with self.request_running(sb):
            return await self._file_op(sb, req, self._owner_fields(sb, owner, f"{req.OP} {sb.id}"))

    def _owner_fields(self, sb: Sandbox, owner: tuple[int, int] | None, what: str) -> tuple[bytes, ...]:
        """A write's, mkdir's or put's owner as the agent's trailing fields
        (none for root, which every agent gives files); `unsupported` from
        an agent older than OWNER_AGENT_VERSION, which would ignore them."""
        if owner is None or owner == (0, 0):
            return ()
        version = self.agent(sb).agent_version
        if version < wire.OWNER_AGENT_VERSION:
            raise Unsupported(f"{what}: this microVM's guest agent (version {version}) cannot give files an "
                              f"owner (version {wire.OWNER_AGENT_VERSION} can): leave owner out and chown "
                              "them with an exec, or recreate the sandbox on this daemon's guest image",
                              {"sandbox": sb.id, "agent_version": version})
        return wire.u64(owner[0]), wire.u64(owner[1])

    async def _file_op(self, sb: Sandbox, req, owner_fields: tuple[bytes, ...] = ()) -> dict:
        op = req.OP
        if op == "file_stat":
            return await self.stat_path(sb, req.path, req.follow)
        if op == "file_rename":
            src = _check(req.src, f"rename {sb.id}:{req.src} -> {req.dst}")
            dst = _check(req.dst, f"rename {sb.id}:{req.src} -> {req.dst}")
            _refuse_root("rename", f"{sb.id}:{src} -> {dst}", src, dst)
            flags = ((wire.RENAME_OVERWRITE if req.overwrite else 0)
                     | (wire.RENAME_KEEP_ATTRS if req.keep_attrs else 0))
            if req.keep_attrs:             # an atomic write's: as a container's (sbfiles.rename)
                await self._require_replaceable(sb, dst)
            await self._file(sb, "rename", f"{src} -> {dst}", wire.RENAME, wire.bstr(src), wire.bstr(dst),
                             wire.u64(flags))
            return {"src": src, "dst": dst}
        path = _check(req.path, f"{FILE_VERBS.get(op, op)} {sb.id}:{req.path}")
        if op == "file_read":
            r = await self._file(sb, "read", path, wire.READ, wire.bstr(path), wire.u64(req.offset),
                                 wire.u64(req.length))
            size, data = r.u64(), r.bytes()
            return {"data": data, "size": size, "eof": req.offset + len(data) >= size}
        if op == "file_write":
            _refuse_root("write", f"{sb.id}:{path}", path)
            if req.same_as is not None:         # its writes give no `file` to name
                raise BadRequest(f"write {sb.id}:{path}: same_as is not available for a microVM sandbox's files")
            flags = ((wire.WRITE_APPEND if req.append else 0) | (wire.WRITE_PARENTS if req.parents else 0)
                     | (wire.WRITE_KEEP if req.offset is not None else 0))
            where = f"{sb.id}:{path}"
            if len(req.data) >= PUT_CHECK_BYTES:      # a smaller one meets the layer's cap (upper_cap)
                await self.check_room(sb, len(req.data), where)
            try:
                r = await self._file(sb, "write", path, wire.WRITE, wire.bstr(path), wire.u64(flags),
                                     wire.u64(req.mode),
                                     wire.u64(wire.NO_OFFSET if req.offset is None else req.offset),
                                     wire.bstr(bytes(req.data)), *owner_fields)
            except DsecError as err:
                if err.detail.get("errno") == "ENOSPC":
                    raise self._full("write", where, sb) from err
                raise
            return {"size": r.u64()}
        if op == "file_list":
            # Each mtime as seconds and nanoseconds where the agent can (as stat_path).
            ts = self.agent(sb).agent_version >= wire.WIDE_STAT_AGENT_VERSION
            flags = (wire.u64(wire.LIST_TS),) if ts else ()
            r = await self._file(sb, "list", path, wire.LIST, wire.bstr(path), wire.u64(req.depth), *flags)
            entries = []
            body_end = len(r.body) - 16           # the count and the truncated flag close the body
            while r.at < body_end:
                name = r.str()
                entries.append({"name": name, **r.stat(ts)})
            r.u64()
            truncated = bool(r.u64())
            entries.sort(key=lambda e: e["name"])
            return {"path": path, "entries": entries, "truncated": truncated}
        if op == "file_mkdir":
            r = await self._file(sb, "mkdir", path, wire.MKDIR, wire.bstr(path), wire.u64(1 if req.parents else 0),
                                 wire.u64(req.mode), *owner_fields)
            return {"path": path, "created": bool(r.u64())}
        if op == "file_set_attrs":
            version = self.agent(sb).agent_version
            if version < wire.ATTRS_AGENT_VERSION:
                raise Unsupported(f"set attributes of {sb.id}:{path}: this microVM's guest agent (version "
                                  f"{version}) cannot set a file's mode or mtime (version "
                                  f"{wire.ATTRS_AGENT_VERSION} can)", {"sandbox": sb.id, "agent_version": version})
            mtime_flags, mtime_fields = _setattr_mtime(sb.id, path, req.mtime, version)
            flags = ((wire.SETATTR_MODE if req.mode is not None else 0) | mtime_flags
                     | (wire.SETATTR_FOLLOW if req.follow else 0))
            try:
                await self._file(sb, "set attributes of", path, wire.SETATTR, wire.bstr(path), wire.u64(flags),
                                 wire.u64(req.mode or 0), *mtime_fields)
            except DsecError as err:
                if err.detail.get("guest_step") != "not a file or directory":
                    raise
                kind = (await self.stat_path(sb, path))["type"]
                raise BadRequest(f"set attributes of {sb.id}:{path}: {path} is a {kind}, not a file or "
                                 "directory", {"path": path}) from err
            return {"path": path}
        if op == "file_remove":
            _refuse_root("remove", f"{sb.id}:{path}", path)
            r = await self._file(sb, "remove", path, wire.REMOVE, wire.bstr(path),
                                 wire.u64(1 if req.recursive else 0))
            return {"path": path, "removed": r.u64()}
        raise Unsupported(f"{op} is not available for backend microvm yet")

    # ------------------------------------------------------------ a create's cwd

    async def check_cwd(self, sb: Sandbox, cwd: str, make: bool = False) -> None:
        """As CreateService.check_cwd, in the guest: one stat, and the
        directory made (with its parents, 0755) where `make` says so and the
        image lacks it."""
        if cwd == "/":
            return
        try:
            st = await self.stat_path(sb, cwd)
        except NotFound:
            if make:
                await self.file_op(sb, FileMkdir(sandbox=sb.id, path=cwd, parents=True, mode=0o755))
                return
            st = None
        except DsecError:
            st = None
        if st is None or st["type"] != "dir":
            raise BadRequest(f"cwd {cwd!r} is not a directory in image {sb.image!r}: give one that "
                             "exists, or create without --cwd and make it with an exec", {"cwd": cwd})


class _CopyEnded(Exception):
    """A put's child ended before its input did (it reported why)."""


PUT_CHUNK = 256 << 10       # records go to the guest in stdin chunks of about this size


def _put_records(pipe, send, max_entries: int, max_bytes: int, room=None,
                 agent_version: int = wire.REPLACE_AGENT_VERSION) -> tarsafe.Seen:
    """Read the tar from `pipe` (in a worker), check each entry as the
    container backend does (tarsafe.check) and send(data, eof) its records
    (csrc/guest/agent.c, put_record): missing parent directories first,
    the removal of what an earlier entry of a name made before a later
    one replaces it, directories' modes last, deepest first, then the end.
    room(size), if given, raises when a file of PUT_CHECK_BYTES or more
    would not fit in the guest (VmFiles.check_room); the records
    before it are sent first. An agent older than REPLACE_AGENT_VERSION
    has no removal: such an archive is refused. mtimes go to the agent as
    _mtime_field says: from WIDE_TIMES_AGENT_VERSION on (its argv says
    "ts") exactly, whatever the time; from TIMES_AGENT_VERSION (its argv
    says "ns") as 64-bit nanoseconds, a time outside them refused; to an
    older agent as whole seconds, one before 1970 as 0."""
    seen = tarsafe.Seen(max_entries, max_bytes)
    out = bytearray()
    made = {""}
    dir_modes: dict[str, tuple[int, int | None]] = {"": (0o755, None)}     # mtimes in ns

    def record(kind: bytes, rel: str, mode: int = 0, mtime_ns: int | None = None, data: bytes = b"",
               size: int | None = None) -> None:
        name = rel.encode(errors="surrogateescape")
        out.extend(kind + struct.pack(">I", len(name)) + name + struct.pack(">I", mode)
                   + _mtime_field(rel, mtime_ns, agent_version)
                   + struct.pack(">Q", len(data) if size is None else size) + data)
        if len(out) >= PUT_CHUNK:
            flush()

    def flush(eof: bool = False) -> None:
        if out or eof:
            send(bytes(out), eof)
            out.clear()

    def make_dirs(rel: str) -> None:
        path = ""
        for part in rel.split("/") if rel else ():
            path = f"{path}/{part}" if path else part
            if path not in made:
                record(b"d", path)
                made.add(path)

    with tarfile.open(fileobj=pipe, mode="r|", errorlevel=2, tarinfo=tarsafe.Member) as tf:
        for m in tf:
            rel = tarsafe.check(m, seen)
            if seen.replaces == "itself":
                continue
            if seen.replaces in ("file", "other") or (seen.replaces == "dir" and not m.isdir()):
                if agent_version < wire.REPLACE_AGENT_VERSION:
                    raise tarsafe.Refused(f"entry {m.name!r} comes again in the archive, and this microVM's guest "
                                          f"agent (version {agent_version}) cannot replace what the earlier one "
                                          f"made (version {wire.REPLACE_AGENT_VERSION} can): leave out the "
                                          "earlier one")
                record(b"r", rel, 1 if seen.replaces == "dir" else 0)
                made.discard(rel)
                dir_modes.pop(rel, None)
            if m.isdir():
                dir_modes[rel] = (m.mode & tarsafe.KEPT_MODE, tarsafe.mtime_ns(m))
                _mtime_field(rel, dir_modes[rel][1], agent_version)     # refused now, not after the tree
                make_dirs(rel)
                continue
            make_dirs(rel.rpartition("/")[0])
            if m.isreg():
                if room is not None and m.size >= PUT_CHECK_BYTES:
                    flush()
                    room(m.size)
                record(b"f", rel, m.mode & tarsafe.KEPT_MODE, tarsafe.mtime_ns(m), size=m.size)
                src = tf.extractfile(m)
                left = m.size
                while left:
                    piece = src.read(min(PUT_CHUNK, left))
                    if not piece:
                        raise EOFError(f"the archive ends inside {m.name!r}")
                    out.extend(piece)
                    left -= len(piece)
                    if len(out) >= PUT_CHUNK:
                        flush()
            elif m.issym():
                record(b"s", rel, 0, tarsafe.mtime_ns(m), m.linkname.encode(errors="surrogateescape"))
            else:
                record(b"h", rel, data=tarsafe.entry_name(m.linkname).encode(errors="surrogateescape"))
        tarsafe.check_end(tf)
    while pipe.read(1 << 20):               # the zero padding after the archive, up to the input's end
        pass
    # One the archive has no entry for gets 0755, as tar(1) and docker cp make it.
    for rel in sorted(made, key=lambda rel: -rel.count("/") - bool(rel)):
        record(b"D", rel, *dir_modes.get(rel, (0o755, None)))
    record(b"E", "")
    flush(eof=True)
    return seen


def _setattr_mtime(sb_id: str, path: str, mtime: float | None, agent_version: int) -> tuple[int, tuple[bytes, ...]]:
    """A SETATTR's mtime (None: none) as an agent of `agent_version` takes
    it (csrc/guest/agent.c, do_setattr): its flags, and its fields from the
    mtime's on. The time is the container backend's, int(mtime * 1e9) ns
    (wire.mtime_ns). From WIDE_SETATTR_AGENT_VERSION on it goes as signed
    seconds with the nanoseconds last (SETATTR_TS): any time a time_t holds.
    An older agent takes signed nanoseconds in 64 bits, which would wrap a
    time before 1677-09-21 or past 2262-04-11 (2300 became 1715): refused
    as bad_request, as a copy in refuses it (_mtime_field); one older than
    TIMES_AGENT_VERSION takes no time before 1970 either."""
    if mtime is None:
        return 0, (wire.u64(0),)
    ns = wire.mtime_ns(mtime)
    if agent_version >= wire.WIDE_SETATTR_AGENT_VERSION:
        sec, nsec = divmod(ns, tarsafe.NS)                  # floor: before 1970 too, as os.utime splits it
        return wire.SETATTR_MTIME | wire.SETATTR_TS, (wire.s64(sec), wire.u64(nsec))
    where = f"set attributes of {sb_id}:{path}"
    if ns < 0 and agent_version < wire.TIMES_AGENT_VERSION:
        raise Unsupported(f"{where}: this microVM's guest agent (version {agent_version}) cannot set an mtime "
                          f"before 1970 (version {wire.TIMES_AGENT_VERSION} can): recreate the sandbox on this "
                          "daemon's guest image", {"sandbox": sb_id, "agent_version": agent_version})
    if not -(2**63) <= ns < 2**63:
        raise BadRequest(f"{where}: mtime {mtime!r} s since 1970 is outside 1677-09-21 to 2262-04-11, the times "
                         f"this microVM's guest agent (version {agent_version}) can set (version "
                         f"{wire.WIDE_SETATTR_AGENT_VERSION} sets any): recreate the sandbox on this daemon's guest "
                         "image, or give a time in that range",
                         {"path": path, "mtime": mtime, "agent_version": agent_version})
    return wire.SETATTR_MTIME, (wire.s64(ns),)


def _mtime_field(rel: str, mtime_ns: int | None, agent_version: int) -> bytes:
    """A put record's mtime (None: none) as an agent of `agent_version`
    takes it (csrc/guest/agent.c, put_record): signed seconds and
    nanoseconds ("ts"), signed nanoseconds in 64 bits ("ns"), or seconds.
    A time 64-bit nanoseconds do not hold (before 1677-09-21, past
    2262-04-11), which a container's copy sets, is refused to an agent
    that takes no other: it would wrap to another time."""
    if agent_version >= wire.WIDE_TIMES_AGENT_VERSION:
        if mtime_ns is None:
            return struct.pack(">qI", 0, wire.PUT_TS_NO_MTIME)
        return struct.pack(">qI", *divmod(mtime_ns, tarsafe.NS))       # floor: before 1970 too
    if agent_version >= wire.TIMES_AGENT_VERSION:
        if mtime_ns is None:
            return struct.pack(">Q", wire.PUT_NO_MTIME)
        if not -(2**63) < mtime_ns < 2**63:                 # -2**63 itself is PUT_NO_MTIME
            raise tarsafe.Refused(
                f"entry {rel or '.'!r}: its mtime, {mtime_ns / tarsafe.NS:.0f} s since 1970, is outside "
                f"1677-09-21 to 2262-04-11, the times this microVM's guest agent (version {agent_version}) "
                f"can set (version {wire.WIDE_TIMES_AGENT_VERSION} sets any): recreate the sandbox on this "
                "daemon's guest image, or give the entry a time in that range")
        return wire.s64(mtime_ns)
    return struct.pack(">Q", 2**64 - 1 if mtime_ns is None else max(0, mtime_ns // tarsafe.NS))


def _mem_available(meminfo: bytes) -> int | None:
    """MemAvailable of a /proc/meminfo, in bytes (None: not there)."""
    for line in meminfo.decode(errors="replace").splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            parts = value.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return None


def _reports(data: bytes, put: bool) -> dict:
    """A copy child's stderr: "skip" type reason path, "done" (a get's:
    entries bytes), "err" errno what; NUL-separated fields."""
    fields = [f.decode(errors="surrogateescape") for f in data.split(b"\0")]
    out: dict = {"skip": []}
    i = 0
    while i < len(fields):
        tag = fields[i]
        if tag == "skip" and i + 3 < len(fields):
            out["skip"].append({"type": fields[i + 1], "reason": fields[i + 2], "path": fields[i + 3]})
            i += 4
        elif tag == "done":
            out["done"] = () if put else tuple(fields[i + 1:i + 3])
            i += 1 if put else 3
        elif tag == "err" and i + 2 < len(fields):
            out["err"] = (fields[i + 1], fields[i + 2])
            i += 3
        else:
            i += 1
    return out


def _as_a_containers(err: AgentError, where: str) -> OSError:
    """A guest agent's file error in the words a container's gets
    (dsecd/fs/files.py), so that a client reads the same advice whatever
    the backend; the agent's step goes to the error's detail."""
    if err.errno == errno.EISDIR:
        return OSError(err.errno, f"{where} is a directory, not a regular file (`dsec ls` lists it, "
                       "`dsec cp -r` copies it)")
    if err.errno == errno.EEXIST and err.step == "rename":
        return OSError(err.errno, f"{where.rpartition(' -> ')[2]} exists; rename with overwrite to replace it")
    if err.errno == errno.ENOTEMPTY:
        return OSError(err.errno, f"{where} is a directory that is not empty; remove it recursively "
                       "(`dsec rm -r`, SDK remove(path, recursive=True))")
    return OSError(err.errno, f"{err.step} `{where}`: {os.strerror(err.errno)}")


# The verb a file op's errors start with, as FileService's for a container.
FILE_VERBS = {"file_read": "read", "file_write": "write", "file_list": "list", "file_mkdir": "mkdir",
              "file_set_attrs": "set attributes of",
              "file_remove": "remove"}


def _check(path: str, what: str = "") -> str:
    """`path` checked as a container's file ops check it; `what` (e.g.
    "read <sandbox>:<path>") goes first in the error, as theirs has it."""
    try:
        return sbfiles.check_path(path)
    except sbfiles.PathError as err:
        raise BadRequest(f"{what}: {err}" if what else str(err), {"path": path}) from err


def _refuse_root(verb: str, where: str, *paths: str) -> None:
    """BadRequest, as a container's file ops give it, if one of `paths` is /."""
    try:
        sbfiles.refuse_root(verb, *paths)
    except sbfiles.PathError as err:
        raise BadRequest(f"{verb} {where}: {err}", {"path": where.partition(":")[2]}) from err
