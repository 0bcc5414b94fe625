"""`dsec ls`, `cat`, `watch` and `rm SANDBOX:/path`: a sandbox's files,
named as SANDBOX:/path."""

from __future__ import annotations

import contextlib
import json
import posixpath
import sys
import time

from ..client import Client
from ..clitext import UsageError
from ..clitext import print_json as _print_json
from ..clitext import table as _table
from ..cptar import in_a_thread_of_its_own as _in_a_thread_of_its_own
from ..errors import DsecError
from .common import _names_as_bytes, _print_item_error, _split_remote, _write_flush


async def _to_stdout(sb, path: str) -> int:
    """The sandbox's file onto stdout as it comes, never all in memory; the
    bytes written. A file replaced while it is read fails (Conflict) after
    what was written: a pipe cannot be written again."""
    written = 0
    async with contextlib.aclosing(sb.read_chunks(path)) as chunks:
        async for piece in chunks:
            await _in_a_thread_of_its_own(_write_flush, 1, piece)
            written += len(piece)
    return written


def _remote_path(spec: str, verb: str) -> tuple[str, str]:
    sb_id, path = _split_remote(spec)
    if sb_id is None:
        raise UsageError(f"dsec {verb}: give SANDBOX:/absolute/path, got {spec!r}")
    return sb_id, path


async def cmd_ls(c: Client, a) -> int:
    sb_id, path = _remote_path(a.target, "ls")
    sb = await c.get(sb_id)
    try:
        entries = await sb.list_files(path, a.depth)
    except DsecError as err:
        if err.detail.get("errno") not in ("ENOTDIR", "ENOENT") or path.endswith("/"):
            raise
        try:                # not a directory (or a dangling symlink): the entry itself, as ls(1) lists it
            st = await sb.stat(path)
        except DsecError:
            raise err from None         # a path below a file: the listing's own error
        st.pop("path", None)
        entries = [{**st, "name": posixpath.basename(path)}]
    if a.json:
        _print_json(entries)
        return _listed_whole(a, entries)
    _names_as_bytes()
    _table([[e["type"], f"{e['mode']:04o}", str(e["size"]), time.strftime("%Y-%m-%d %H:%M", time.localtime(e["mtime"])),
             e["name"]] for e in entries], ["TYPE", "MODE", "SIZE", "MODIFIED", "NAME"])
    return _listed_whole(a, entries)


def _listed_whole(a, entries) -> int:
    """0, or 1 and why on stderr when the listing was cut short (the most
    entries one listing gives), as ls(1) fails on a directory it could not read whole."""
    if not getattr(entries, "truncated", False):
        return 0
    print(f"dsec ls: {a.target}: only {len(entries)} of its entries are listed (the most one listing gives); "
          f"list its subdirectories one by one, or run `dsec exec SANDBOX -- ls` for all of it", file=sys.stderr)
    return 1


async def cmd_watch(c: Client, a) -> int:
    """Print changes under a directory until interrupted, or until it or its sandbox goes."""
    sb_id, path = _remote_path(a.target, "watch")
    sb = await c.get(sb_id)
    _names_as_bytes()
    async for ev in sb.watch(path, recursive=a.recursive):
        if a.json:
            print(json.dumps(ev, sort_keys=True), flush=True)
        elif ev["kind"] == "stopped":
            print(f"dsec watch: stopped: {ev['reason']}", file=sys.stderr)
        elif ev["kind"] == "ready":
            print(f"dsec watch: watching {ev['dirs']} director{'y' if ev['dirs'] == 1 else 'ies'} "
                  f"under {ev['path']}", file=sys.stderr)
        else:
            print(f"{ev['kind']:<9} {ev['path']}{'/' if ev['is_dir'] else ''}", flush=True)
    return 0


async def cmd_cat(c: Client, a) -> int:
    """The files' bytes as they are; --json: one line per file, its content as
    text (bytes that are not UTF-8 become U+FFFD, as `logs --json` prints output).
    As cat(1), a file that cannot be read is an error line and the others are
    still printed; the exit status is then 1."""
    status = 0
    for sb_id, path in [_remote_path(spec, "cat") for spec in a.targets]:
        try:
            sb = await c.get(sb_id)
            if a.json:
                data = await sb.read_file(path)
                print(json.dumps({"sandbox": sb_id, "path": path, "size": len(data),
                                  "data": data.decode("utf-8", "replace")}, sort_keys=True), flush=True)
            else:
                await _to_stdout(sb, path)      # streamed: a file of any size
        except DsecError as err:
            sys.stdout.flush()             # what came before, before the error
            _print_item_error(a, err, sandbox=sb_id, path=path)
            print(f"dsec cat: {err.code}: {err.message}", file=sys.stderr, flush=True)
            status = 1
    sys.stdout.flush()
    return status


async def _rm_paths(c: Client, a) -> int:
    """`dsec rm SANDBOX:/path...`; with -f, as rm -f: a path that does not
    exist is passed over quietly (a missing sandbox, or a file where a
    directory should be, is still a failure)."""
    status = 0
    for spec in a.sandboxes:
        sb_id, path = _remote_path(spec, "rm")
        try:
            r = await (await c.get(sb_id)).remove(path, recursive=a.recursive)
            if a.json:
                _print_json(r, line=True)
        except DsecError as err:
            if a.force and err.code == "not_found" and err.detail.get("errno") == "ENOENT":
                continue
            _print_item_error(a, err, sandbox=sb_id, path=path)
            print(f"dsec: rm {spec}: {err.code}: {err.message}", file=sys.stderr)
            status = 1
    return status
