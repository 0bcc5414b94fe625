"""A sandbox's files (a base of Sandbox): write, read, list, stat, make,
remove and rename them; directory copies in and out as tar streams; a
directory's changes watched.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import io
import os
import posixpath
import secrets
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from .. import localcopy
from ..errors import Conflict, ConnectionLost, DsecError, NotFound
from .conn import _Conn
from .pieces import DEFAULT_CHUNK, _as_they_come, file_data, file_pieces
from .refollow import _Refollow
from .wire import _cancel, _reconnects

if TYPE_CHECKING:
    from .core import Client


# File chunks in flight at once in write_file and read_file: two overlap one
# chunk's trip with the daemon's (or the sandbox copier's) work on the other;
# more only contend for a small host's cores (64 MiB on 2 cores, written:
# 249-463 MiB/s one at a time, 337-558 two, 326-416 three; read as frame
# tails: 406-438 one at a time, 446-463 two).
PIPELINE = 2
# How many times read_file reads a file again that was replaced while it read it.
READ_AGAIN = 3


# What the daemon's write errors say of a file a failed write left part of
# (engine/copier.py, engine/vmfiles.py).
PARTLY_WRITTEN = "the file is partly written"


class Listing(list):
    """list_files' entries, and whether the listing was cut short (`truncated`)."""

    truncated = False


def _paths(result: dict) -> dict:
    """A file op's result (or a listing's entry, a watch event) with the
    paths and names it holds as os.listdir gives them: one that is not
    UTF-8 comes from the daemon as bytes, and is os.fsdecode's str again."""
    for key in ("path", "src", "dst", "target", "name"):
        if isinstance(result.get(key), bytes):
            result[key] = os.fsdecode(result[key])
    return result


def named_as(err: DsecError, tmp: str, path: str, removed: bool = False,
             verb: tuple[str, str] | None = None) -> DsecError:
    """`err`, met on a temporary path `tmp` (an atomic write's file, a
    copy's landing directory), as the caller sees it: naming `path`, the one
    they gave; same class, code and detail
    (`errno` kept), `detail["path"]` the target's (the daemon's spelling,
    `sandbox:path`, where it gave one). removed: `tmp` was removed, so what
    the daemon said was "partly written" is gone and `path` is as it was.
    verb: (the request's, the caller's), e.g. ("rename", "write"): the
    message's first word said as what the caller asked for."""
    def rename(text: str) -> str:
        return text.replace(f"{tmp} -> {path}", path).replace(tmp, path)

    message = err.message
    if verb is not None and message.startswith(f"{verb[0]} "):
        message = f"{verb[1]} {message[len(verb[0]) + 1:]}"
    if removed:
        message = message.replace(PARTLY_WRITTEN, f"{path} is as it was (the part written was removed)")
    detail = {k: rename(v) if isinstance(v, str) else v for k, v in err.detail.items()}
    detail.setdefault("path", path)
    named = type(err)(rename(message), detail)
    named.code = err.code
    return named


class _Files:
    """The file requests of Sandbox (a base of it), on its `client` and `id`."""

    client: Client
    id: str

    async def write_file(self, path: str, data, mode: int = 0o644, parents: bool = True,
                         atomic: bool = True, owner: int | str | None = None) -> int:
        """Write `data` to `path`: bytes-like, or, without holding it all in
        memory, a binary file open for reading (read from where it is to its
        end), an asyncio StreamReader (or any reader whose `read(n)` is a
        coroutine) or an async iterable of bytes (any size: chunked under
        the frame limit). The bytes written.
        Atomic (the default): written under a temporary name beside the
        target and renamed over it, so a write that fails (ENOSPC, the
        sandbox's memory limit, a lost connection, a failed read of the
        source) leaves the old file or none at `path`, never a part, and
        readers in the sandbox see the old bytes or the new ones. The
        temporary file is removed when a write fails; one cut by a lost
        connection (the client killed) is removed by the daemon when the
        connection drops, and one cut by the daemon's death by the next
        daemon at its start (it records the file while it is temporary; in
        a microVM whose guest agent predates inode numbers, such a part
        stays beside the target as `.dsec-<hex>`). A file it replaces
        passes on its owner, group and mode; a new file gets `mode`. A
        symlink at `path` is replaced, not written through, and hard links
        to the old file keep the old bytes.
        With atomic=False the bytes go into the file in place (through a
        symlink, keeping the inode), and a failure leaves what was written
        so far. `owner`: who a new file (and the parents it makes) belongs
        to, as exec's `user` names one (a uid, "name", "uid:gid",
        "name:group"); the sandbox's root by default, as `docker cp` gives
        it. Bytes-like `data` whose write a lost connection cut (a daemon
        restart) is written again whole, once, on the next connection: the
        same bytes to the same path end as one write would (a stream,
        read once, cannot be: its ConnectionLost says what became of
        `path`)."""
        try:
            return await self._write_file(path, data, mode, parents, atomic, owner)
        except ConnectionLost as err:
            if not (isinstance(data, (bytes, bytearray, memoryview)) and err.sent and _reconnects(self.client)):
                raise
        return await self._write_file(path, data, mode, parents, atomic, owner)

    async def _write_file(self, path: str, data, mode: int, parents: bool, atomic: bool,
                          owner: int | str | None) -> int:
        pieces = file_pieces(data, self._chunk_size(), "write_file")
        if not atomic:
            return await self._write_chunks(path, pieces, mode, parents, owner=owner)
        parent, _, name = posixpath.normpath(path).rpartition("/")
        if not path.startswith("/") or not name:
            raise ValueError(f"write_file: give an absolute path of a file, got {path!r}")
        tmp = f"{parent}/.dsec-{secrets.token_hex(6)}"         # short: the target's name may be 255 bytes
        made_on: list[_Conn | None] = []
        renaming = False
        try:
            size = await self._write_chunks(tmp, pieces, mode, parents, temporary=True, owner=owner,
                                            made_on=made_on)
            renaming = True
            await self.client.request("file_rename", sandbox=self.id, src=tmp, dst=path, overwrite=True,
                                      keep_attrs=True)
        except BaseException as err:
            removed = False
            with contextlib.suppress(DsecError, ConnectionError):
                await asyncio.shield(self.remove(tmp))
                removed = True
            if isinstance(err, NotFound) and made_on and self._connection_now() is not made_on[0]:
                # The connection the temporary file was made on was lost (a
                # daemon restart), and the file with it (the daemon removes
                # one whose connection ended); a later piece, or the rename,
                # went on the next connection and found it gone.
                raise self._temporary_write_lost(path, "", sent=True) from None
            if isinstance(err, ConnectionLost) and err.sent and renaming:
                raise ConnectionLost(
                    f"file_write on {self.client.target}: connection lost while renaming the file written over "
                    f"{self.id}:{path}: the rename may have replaced it (read it to know)",
                    target=self.client.target, op="file_write", sent=True) from None
            if isinstance(err, ConnectionLost):
                # Lost under a piece: the temporary file went with the
                # connection (or was removed above), never renamed over
                # `path`. (What the lost request's own error said, that it
                # may have been carried out, is not so of the write; why
                # one never sent was not is.)
                raise self._temporary_write_lost(path, "" if err.sent else f" ({err})", err.sent) from None
            if isinstance(err, DsecError):      # the caller knows no temporary file: name theirs
                raise named_as(err, tmp, path, removed, verb=("rename", "write")) from None
            raise
        return size

    def _temporary_write_lost(self, path: str, why: str, sent: bool) -> ConnectionLost:
        """The error of an atomic write_file whose temporary file went with a
        lost connection before its rename: `path` is as it was. `why`: what
        to add after the path (the loss's own error, or "")."""
        return ConnectionLost(
            f"file_write on {self.client.target}: connection lost while writing {self.id}:{path}{why}: the part "
            f"written went with it (it was written under a temporary name), and {path} is as it was; write it "
            "again", target=self.client.target, op="file_write", sent=sent)

    def _connection_now(self) -> _Conn | None:
        """The client's connection at this moment (a new one after a loss);
        None for a client that keeps none of its own."""
        return getattr(self.client, "_conn", None)

    def _sets_attrs(self) -> bool:
        """Whether the daemon serves set_attrs and lists a put's directory
        entries (upload_tar's `dirs`): capability files.attrs."""
        return "files.attrs" in self.client.server.get("capabilities", ())

    def _keeps_temporaries(self) -> bool:
        """Whether the daemon takes `temporary` on file_write and file_tar_put
        (an older one refuses the field: the copy then goes without it, its
        part left behind only if this client is killed mid-copy)."""
        return "files.temporary" in self.client.server.get("capabilities", ())

    def _chunk_size(self) -> int:
        """The most bytes one file_write or file_read request carries."""
        return self.client.server.get("limits", {}).get("max_file_chunk_bytes", DEFAULT_CHUNK)

    async def _write_chunks(self, path: str, pieces: AsyncIterator, mode: int, parents: bool,
                            temporary: bool = False, owner: int | str | None = None,
                            made_on: list | None = None) -> int:
        """The first piece truncates (or creates) the file; the others go at
        their offsets, PIPELINE requests at once, so that one piece travels
        while the sandbox's copier writes the one before (and the next is
        read from its source). The bytes written. `made_on` gets the
        connection the file was made on."""
        # A chunk whose request is cancelled goes on in the daemon (its open
        # runs in a worker) and makes the file again if it is missing: a
        # cancelled write lets the chunks in flight end before it ends, so
        # that whoever then removes the file comes after them.
        in_flight: set[asyncio.Future] = set()

        async def put(**args) -> dict:
            fut = asyncio.ensure_future(self.client.request("file_write", sandbox=self.id, path=path, **args))
            in_flight.add(fut)
            fut.add_done_callback(_settled_in(in_flight))
            return await asyncio.shield(fut)

        try:
            async with contextlib.aclosing(pieces):
                first = await anext(pieces)
                    # temporary: the daemon records the file until its rename, and a daemon
                # that dies first has the next one remove it. Sent only when true.
                # owner: on the piece that makes the file; sent only when given.
                made = await put(data=bytes(first), mode=mode, parents=parents,
                                 **({"temporary": True} if temporary and self._keeps_temporaries() else {}),
                                 **({"owner": owner} if owner is not None else {}))
                # The later pieces go into that very file (a container's
                # daemon names it): if it was removed meanwhile (a temporary
                # file whose connection ended, the client reconnecting), they
                # fail instead of making a new one without the pieces before.
                same = {"same_as": made["file"]} if made.get("file") else {}
                if made_on is not None:
                    made_on.append(self._connection_now())
                written = len(first)
                taking = asyncio.Lock()         # one writer reads the source at a time
                failed: list[Exception] = []

                async def writer() -> None:
                    nonlocal written
                    while not failed:
                        try:
                            async with taking:
                                piece = await anext(pieces, None)
                                if piece is None or failed:
                                    return
                                offset, written = written, written + len(piece)
                            await put(offset=offset, data=piece, **same)       # packed as is
                        except Exception as err:
                            failed.append(err)

                # A failure (of a write, or of the source's read) stops new
                # pieces but lets the one in flight end: whoever then removes
                # the file must not race a write still going on.
                await asyncio.gather(*(writer() for _ in range(PIPELINE)))
                if failed:
                    raise failed[0]
                return written
        except asyncio.CancelledError:
            if in_flight:
                await asyncio.wait(set(in_flight))
            raise

    async def write_at(self, path: str, offset: int, data: bytes) -> int:
        """Write `data` at `offset` of a file (made if missing), neither
        truncating nor appending; any size, in chunks at their offsets, one
        after another (a failure leaves those before it written). The
        file's size after it."""
        data = file_data(data, "write_at")
        chunk = self._chunk_size()
        view = memoryview(data)
        for start in range(0, max(len(view), 1), chunk):
            r = await self.client.request("file_write", sandbox=self.id, path=path, offset=offset + start,
                                          data=bytes(view[start:start + chunk]))
        return r["size"]

    async def read_file(self, path: str) -> bytes:
        """The whole file (read_chunks, joined once). A file replaced while
        it is read (an atomic write, a `mv` over it) is read again from the
        start, up to READ_AGAIN times, so the bytes are never part old, part
        new; a file replaced faster than that raises Conflict (detail
        "replaced"). A file changed in place (not replaced) while it is read
        is not detected: what its writer has not finished may be read."""
        again = 0
        while True:
            try:
                return await self._read_whole(path)
            except Conflict as err:
                again += 1
                if not _read_again(err, again):
                    raise

    async def read_file_to(self, path: str, file) -> int:
        """The file's bytes written into `file` (a binary file open for
        writing) as they come, never all in memory; the bytes written. A
        file replaced while it is read is read again, as read_file does,
        into a seekable `file` from where it was (what was written since
        truncated); into one that is not (a pipe), Conflict (detail
        "replaced")."""
        loop = asyncio.get_running_loop()
        start = file.tell() if file.seekable() else None
        again = 0
        while True:
            written = 0
            try:
                async with contextlib.aclosing(self.read_chunks(path)) as chunks:
                    async for piece in chunks:
                        await loop.run_in_executor(None, _write_all, file, piece)
                        written += len(piece)
                return written
            except Conflict as err:
                again += 1
                if start is None or not _read_again(err, again):
                    raise
                file.seek(start)
                file.truncate()

    async def _read_whole(self, path: str) -> bytes:
        async with contextlib.aclosing(self.read_chunks(path)) as chunks:
            parts = [piece async for piece in chunks]
        return b"".join(parts)

    async def read_chunks(self, path: str) -> AsyncIterator[bytes | memoryview]:
        """The file's bytes in order, one chunk (at most the frame limit) at a
        time, the next PIPELINE read ahead meanwhile; as frame tails (views
        of the frames) where the daemon sends them. Every chunk comes from
        the file the first came from: one replaced meanwhile raises Conflict
        (detail "replaced"), as nothing already given can be read again
        (read_file and read_file_to start again)."""
        chunk = self._chunk_size()
        tail = {"tail": True} if self.client._tails else {}

        async def read_at(offset: int, **same_as) -> dict:
            return await self.client.request("file_read", sandbox=self.id, path=path, offset=offset, length=chunk,
                                             **tail, **same_as)

        first = (await read_at(0))
        if len(first["data"]) < chunk:
            yield first["data"]
            return
        # The file the first chunk came from (a container's daemon says): the
        # others must come from it too, or the daemon answers conflict.
        same_as = {"same_as": first["file"]} if "file" in first else {}
        ahead: collections.deque[asyncio.Task] = collections.deque()
        next_offset = chunk

        def read_ahead() -> None:
            nonlocal next_offset
            while len(ahead) < PIPELINE:
                ahead.append(asyncio.ensure_future(read_at(next_offset, **same_as)))
                next_offset += chunk

        try:
            read_ahead()
            yield first["data"]
            while True:
                data = (await ahead[0])["data"]
                ahead.popleft()
                if len(data) < chunk:       # the end of the file
                    if data:
                        yield data
                    return
                read_ahead()
                yield data
        finally:
            for task in ahead:
                task.cancel()
            await asyncio.gather(*ahead, return_exceptions=True)

    async def list_files(self, path: str, depth: int = 1) -> Listing:
        """A directory's entries; with depth > 1 its subdirectories' too ("a/b").
        Names are str: one that is not UTF-8 has its odd bytes as
        surrogates, as os.listdir gives it (os.fsencode(name): its bytes),
        and is a path the other calls take as it is. A list, whose
        `truncated` is true when the directory holds more entries than one
        listing gives (100,000): only some of them are in it."""
        args = {"sandbox": self.id, "path": path}
        if depth != 1:          # sent only when asked: older daemons do not know the field
            args["depth"] = depth
        r = await self.client.request("file_list", **args)
        entries = Listing(r["entries"])
        entries.truncated = bool(r.get("truncated"))
        for e in entries:
            _paths(e)
        return entries

    async def stat(self, path: str, follow: bool = False) -> dict:
        """lstat: a symlink is itself (type "symlink", its `target`: the
        link's text, in a container); with `follow`, what it leads to
        (containers only)."""
        args = {"follow": True} if follow else {}      # sent only when asked: older daemons do not know it
        return _paths(await self.client.request("file_stat", sandbox=self.id, path=path, **args))

    async def exists(self, path: str) -> bool:
        """Whether `path` exists in the sandbox (a dangling symlink does)."""
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def mkdir(self, path: str, parents: bool = True, mode: int = 0o755,
                    owner: int | str | None = None) -> dict:
        """mkdir -p by default: the missing parents too, and no error if it
        exists. `owner`: who the directories it makes belong to (as
        write_file's; root by default)."""
        return _paths(await self.client.request("file_mkdir", sandbox=self.id, path=path, parents=parents,
                                                mode=mode, **({"owner": owner} if owner is not None else {})))

    async def remove(self, path: str, recursive: bool = False) -> dict:
        """rm, or rm -r with recursive; symlinks are removed, never followed."""
        return _paths(await self.client.request("file_remove", sandbox=self.id, path=path, recursive=recursive))

    async def rename(self, src: str, dst: str, overwrite: bool = False) -> dict:
        return _paths(await self.client.request("file_rename", sandbox=self.id, src=src, dst=dst,
                                                overwrite=overwrite))

    async def set_attrs(self, path: str, mode: int | None = None, mtime: float | None = None,
                        follow: bool = False) -> dict:
        """chmod `path` to `mode` and/or set its modification (and access)
        time to `mtime` (seconds since the epoch): a file or a directory; a
        symlink is not followed, unless `follow` (inside the sandbox)."""
        args = {k: v for k, v in (("mode", mode), ("mtime", mtime), ("follow", follow or None)) if v is not None}
        return _paths(await self.client.request("file_set_attrs", sandbox=self.id, path=path, **args))

    async def upload_dir(self, local: str, remote: str, temporary: bool = False,
                         owner: int | str | None = None, dirs: bool = False) -> dict:
        """Copy local directory `local` as the new directory `remote` in the
        sandbox (which must not exist), as a tar stream: symlinks stay
        symlinks, modes and mtimes are kept, every entry belongs to `owner`
        (as write_file's; the sandbox's root by default). The daemon checks every entry and extracts beside `remote`,
        renaming into place at the end: a refused or failed copy leaves
        nothing. A FIFO, socket or device in `local` is refused before
        anything is sent. With `temporary`, `remote` is a landing place this
        client renames or removes later: in a container, the daemon removes
        it if this client's connection closes first. Result: path, count
        (entries), bytes; with `dirs`, its directories too (as upload_tar's)."""
        with tempfile.TemporaryFile() as spool:
            await asyncio.to_thread(localcopy.pack, local, spool)
            spool.seek(0)
            return await self.upload_tar(spool, remote, temporary, owner, dirs)

    async def upload_tar(self, fileobj, remote: str, temporary: bool = False,
                         owner: int | str | None = None, dirs: bool = False) -> dict:
        """Extract an uncompressed tar read from binary file `fileobj` (or
        given as bytes, as docker's put_archive takes it, or as an async
        iterable of bytes, a stream of it) as the new directory `remote` in
        the sandbox (see upload_dir: the daemon checks every entry; a
        refused archive leaves nothing; `temporary`; `owner`). Cancelled,
        it returns once the daemon has removed what the copy made (in a
        container), so nothing of it is seen after. With `dirs`, the result
        lists the archive's directory entries, [name, mode, mtime] each, as
        `dirs` (a daemon without the capability files.attrs: left out)."""
        if isinstance(fileobj, (bytes, bytearray, memoryview)):
            fileobj = io.BytesIO(fileobj)
        elif not callable(getattr(fileobj, "read", None)) and not hasattr(fileobj, "__aiter__"):
            raise TypeError("upload_tar: give a binary file object (open(path, 'rb')) or the tar's bytes, got "
                            f"{type(fileobj).__name__}" + (" (a path: open it; a directory: upload_dir)"
                                                           if isinstance(fileobj, str) else ""))
        c = self.client
        chunk = c.server.get("limits", {}).get("max_file_chunk_bytes", DEFAULT_CHUNK)
        rid, sent = c.new_id(), asyncio.Event()
        failed: list[Exception] = []           # the file object's own error
        feeder = asyncio.get_running_loop().create_task(self._feed_tar(rid, sent, fileobj, chunk, failed))
        try:
            args = {"sandbox": self.id, "path": remote,
                    **({"temporary": True} if temporary and self._keeps_temporaries() else {}),
                    **({"owner": owner} if owner is not None else {}),
                    **({"dirs": True} if dirs and self._sets_attrs() else {})}
            async with contextlib.aclosing(c.frames_with_id(rid, "file_tar_put", args, sent)) as frames:
                async for frame in frames:
                    if "__result__" in frame:
                        result = _paths(frame["__result__"])
                        if result.get("dirs"):      # names not UTF-8 come as bytes, as a listing's
                            result["dirs"] = [[os.fsdecode(name), *rest] for name, *rest in result["dirs"]]
                        return result
        except ConnectionLost as err:
            if not err.sent:
                raise
            if "temporary" in args:
                # Held for this client: removed, whole or not, once its
                # connection ends (by the daemon, or by the next one at its start).
                raise ConnectionLost(
                    f"file_tar_put on {c.target}: connection lost while copying to {self.id}:{remote}: a "
                    "temporary copy goes with its connection: nothing of the copy is left: copy it again",
                    target=c.target, op="file_tar_put", sent=True) from None
            # The copy extracts beside `remote` and renames the whole into
            # place at its end; what a cut one made is removed (by the daemon
            # when the connection ends, or by the next one at its start).
            raise ConnectionLost(
                f"file_tar_put on {c.target}: connection lost while copying to {self.id}:{remote}: if {remote} "
                "exists, the copy ended first and it is whole; if not, nothing of the copy is left: copy it "
                "again", target=c.target, op="file_tar_put", sent=True) from None
        finally:
            if not feeder.done():
                feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
                await feeder
            if failed:
                raise failed[0]
        raise ConnectionError("file_tar_put: no final frame")

    async def _feed_tar(self, rid: int, sent: asyncio.Event, fileobj, chunk: int,
                        failed: list[Exception] | None = None) -> None:
        """The tar, a chunk per file_tar_input; the last one says eof. A
        read that fails goes into `failed`, and cancels the put. A file is
        read a whole chunk at a time; an async iterable's pieces go as they
        come (one past a chunk split), then an empty eof: a stream that
        trickles in is not held back until a chunk fills, which the daemon
        would take for a client that sends nothing (limits.frame_timeout_s)."""
        await sent.wait()          # the inputs must follow their put on the wire
        streamed = hasattr(fileobj, "__aiter__")
        pieces = _as_they_come(fileobj, chunk) if streamed else file_pieces(fileobj, chunk, "upload_tar")
        try:
            while True:
                try:
                    data = await anext(pieces, b"")     # ended on a whole chunk: an empty last one
                except Exception as err:
                    # The daemon would wait for the rest of the tar (limits.frame_timeout_s),
                    # and the caller with it: the copy is cancelled (nothing is left), and
                    # upload_tar raises the read's error once the put has ended (which
                    # may come before the cancel's own answer).
                    if failed is not None:
                        failed.append(err)
                    await _cancel(self.client, rid)
                    return
                last = not data if streamed else len(data) < chunk
                await self.client.request("file_tar_input", put_id=rid, data=data, eof=last)
                if last:
                    return
        finally:
            await pieces.aclose()

    async def download_dir(self, remote: str, local: str) -> dict:
        """Copy directory `remote` of the sandbox as the new local directory
        `local` (which must not exist). Symlinks come as symlinks, never
        followed; FIFOs, sockets, devices and kernel filesystems are left out
        and listed in the result's `skipped`. Every entry is checked again
        here, extracted beside `local` and renamed into place at the end;
        a failed or cancelled copy leaves nothing there once it returns. A
        connection lost under it (a daemon restart) has it copied again from
        the start on the next connection, once.
        Result: path, count (entries), bytes, skipped."""
        local = os.path.abspath(local)
        if os.path.lexists(local):
            raise localcopy.LocalCopyError(f"{local} exists; remove it first or copy to a new path")
        if not os.path.isdir(os.path.dirname(local)):
            # Else the spool's open below would fail naming a temporary file of its own.
            raise FileNotFoundError(errno.ENOENT, f"download_dir to {local}: no directory to make it in "
                                    "(make its parent first)", os.path.dirname(local))
        with tempfile.TemporaryFile(dir=os.path.dirname(local)) as spool:
            result = None
            args = {"sandbox": self.id, "path": remote}
            for again in (False, True):
                try:
                    async with contextlib.aclosing(self.client.frames("file_tar_get", **args)) as frames:
                        async for frame in frames:
                            if "__result__" in frame:
                                result = frame["__result__"]
                            else:
                                spool.write(frame["data"])
                    break
                except ConnectionLost as err:
                    # Nothing of it has left the spool, and it changes nothing
                    # in the sandbox: on a client that reconnects (a daemon
                    # restart), it goes again once, from the start. One never
                    # sent found no daemon within reconnect_timeout: asked
                    # again, it would wait as long once more.
                    if again or not err.sent or not _reconnects(self.client):
                        raise
                    spool.seek(0)
                    spool.truncate()
            if result is None:
                raise ConnectionError("file_tar_get: no final frame")
            spool.seek(0)
            stop = threading.Event()
            unpacking = asyncio.ensure_future(asyncio.to_thread(localcopy.unpack, spool, local, stop=stop))
            try:
                await asyncio.shield(unpacking)
            except asyncio.CancelledError:
                # The thread unpacks on: told to stop, it removes its
                # temporary directory, and is waited for, so that nothing
                # of the copy turns up after the cancel (a retry to `local`
                # would find it).
                stop.set()
                await asyncio.wait([unpacking])
                if not unpacking.cancelled():
                    unpacking.exception()       # its Stopped, taken
                raise
        return result

    async def watch(self, path: str, recursive: bool = False) -> AsyncIterator[dict]:
        """Changes under directory `path` as they happen: dicts with `kind`
        (create, modify, attrib, delete, move_from, move_to; overflow when
        the kernel lost events; ready first, once every directory is
        watched; stopped last, with a `reason`), `path` (in the sandbox) and
        `is_dir`. Runs until the loop stops (break) or the directory or the
        sandbox goes; with `recursive`, subdirectories too, new ones included.
        A `path` that is not UTF-8 is a str as list_files gives one.
        A lost connection (a daemon restart) is watched again on the next
        one, on a client that reconnects (the default); what changed while
        nothing watched is unknown, so the new watch's `ready` comes as an
        `overflow` (list the tree again to catch up); a directory (or
        sandbox) that went meanwhile ends it with `stopped` (`deleted`, or
        `sandbox destroyed`); lost FOLLOW_LOST_MAX times in a row with
        nothing come (a daemon that drops the request), it ends with the
        ConnectionLost."""
        args = {"sandbox": self.id, "path": path, "recursive": recursive}
        ready = False           # the caller had its `ready`
        top = path              # the watched directory, as its `ready` names it
        again = False           # this watch follows one whose connection was lost
        refollow = _Refollow()
        while True:
            came = False
            refollow.attach()
            try:
                async with contextlib.aclosing(self.client.frames("file_watch", **args)) as frames:
                    async for frame in frames:
                        came = True
                        if "__result__" in frame:
                            return
                        if frame.get("kind") == "ready":
                            if ready and again:
                                again = False
                                yield {"kind": "overflow", "path": _paths(frame)["path"], "is_dir": True,
                                       "message": "changes made while the connection to the daemon was lost "
                                                  "(a daemon restart) were not seen: list the tree again to "
                                                  "catch up"}
                                continue
                            ready, top = True, _paths(frame)["path"]
                        yield _paths(frame)
                return
            except ConnectionLost as err:
                # Not sent: the daemon did not answer again (reconnect_timeout).
                if not (err.sent and _reconnects(self.client)):
                    raise
                again = True
                await refollow.lost(err, came)
            except NotFound as err:
                # Watched again after a loss, the directory (or the sandbox)
                # went meanwhile: the watch ends as one that saw it go does.
                if not (again and ready and not came):
                    raise
                yield {"kind": "stopped", "path": top, "is_dir": True,
                       "reason": "sandbox destroyed" if "sandbox" in (err.detail or {}) else "deleted",
                       "message": f"it went while the connection to the daemon was lost (a daemon restart): "
                                  f"{err.message}"}
                return


def _write_all(file, data) -> None:
    """All of `data` into `file`: an unbuffered one may take only part."""
    view = memoryview(data)
    while view:
        n = file.write(view)
        if n is None:
            raise BlockingIOError(errno.EAGAIN, "read_file_to: the file takes no bytes now (non-blocking): "
                                                "give a blocking one")
        view = view[n:]


def _read_again(err: Conflict, again: int) -> bool:
    """Whether a read that failed with `err` is read again from the start,
    for the `again`-th time: only for a file replaced while it was read."""
    return bool(err.detail.get("replaced")) and again <= READ_AGAIN


def _settled_in(futures: set[asyncio.Future]) -> Callable[[asyncio.Future], None]:
    """A done callback: the future leaves `futures`, its error retrieved
    (nobody may await it once its caller was cancelled)."""
    def settled(fut: asyncio.Future) -> None:
        futures.discard(fut)
        if not fut.cancelled():
            fut.exception()
    return settled
