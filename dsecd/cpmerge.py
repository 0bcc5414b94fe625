"""`dsec cp -r` into a directory that already holds some of the names, as
`docker cp` does: the copy is merged in.

A directory copy arrives whole in a landing directory first (the daemon's
and the client's directory copies only ever make a new directory, so a
failed transfer leaves nothing half-written). The merge then moves it into
place: a name the destination lacks moves whole (one rename, however big
its subtree), a directory both hold is merged into, entry by entry, and a
non-directory replaces a non-directory. A directory against a
non-directory is refused before anything moves, in docker's words.

The same plan serves both directions: `list_dir` and `join` are the
sandbox's (file_list, posixpath) or the local file system's.
"""

from __future__ import annotations

import asyncio
import errno
import os
import posixpath
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .fs.libc import rename_noreplace

# Renames in flight at once when the moves go to a sandbox: each is one
# request, and a tree re-copied over itself replaces every file.
MOVES_IN_FLIGHT = 32
AT_FDCWD = -100

ListDir = Callable[[str], Awaitable[dict[str, bool]]]     # path -> {name: is a directory}


@dataclass(frozen=True)
class Move:
    src: str          # in the landing directory
    dst: str          # its place in the destination
    replace: bool     # a non-directory is there already


async def plan(list_dir: ListDir, join: Callable[[str, str], str], landing: str, dst: str) -> list[Move]:
    """The moves that merge the tree at `landing` into the existing
    directory `dst`; IsADirectoryError or NotADirectoryError (nothing moved)
    where a directory meets a non-directory."""
    moves: list[Move] = []
    pending = [(landing, dst)]
    while pending:
        src_dir, dst_dir = pending.pop()
        there = await list_dir(dst_dir)
        for name, is_dir in sorted((await list_dir(src_dir)).items()):
            s, d = join(src_dir, name), join(dst_dir, name)
            if name not in there:
                moves.append(Move(s, d, False))
            elif is_dir and there[name]:
                pending.append((s, d))
            elif not is_dir and not there[name]:
                moves.append(Move(s, d, True))
            elif is_dir:
                raise NotADirectoryError(errno.ENOTDIR, "cannot overwrite non-directory with directory", d)
            else:
                raise IsADirectoryError(errno.EISDIR, "cannot overwrite directory with non-directory", d)
    return moves


async def into_sandbox(sb, landing: str, dst: str) -> int:
    """Merge `landing` (a directory in sandbox `sb`) into its directory
    `dst`; returns how many names were replaced. `landing` is left with
    the directories that were merged into, for the caller to remove."""

    async def list_dir(path: str) -> dict[str, bool]:
        entries = await sb.list_files(path)
        if entries.truncated:
            raise OSError(errno.E2BIG, "more names than one listing holds (100,000): copy it to a new "
                                       "directory instead", path)
        return {e["name"]: e["type"] == "dir" for e in entries}

    moves = await plan(list_dir, posixpath.join, landing, dst)
    for i in range(0, len(moves), MOVES_IN_FLIGHT):
        await asyncio.gather(*(sb.rename(m.src, m.dst, overwrite=m.replace)
                               for m in moves[i:i + MOVES_IN_FLIGHT]))
    return sum(m.replace for m in moves)


async def into_local(landing: str, dst: str) -> int:
    """Merge the local directory `landing` into the local directory `dst`;
    returns how many names were replaced."""

    async def list_dir(path: str) -> dict[str, bool]:
        with os.scandir(path) as it:
            return {e.name: e.is_dir(follow_symlinks=False) for e in it}

    moves = await plan(list_dir, os.path.join, landing, dst)
    # The copied directories keep their modes (0555, say), which would not
    # let a user other than root move entries out of them, nor move them (a
    # directory's move rewrites its ".."): writable for the move, then as
    # they came.
    for d in {os.path.dirname(m.src) for m in moves}:
        os.chmod(d, 0o700)
    for m in moves:
        st = os.lstat(m.src)
        locked = stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IWUSR
        if locked:
            os.chmod(m.src, stat.S_IMODE(st.st_mode) | stat.S_IWUSR)
        if m.replace:
            os.replace(m.src, m.dst)
        else:
            rename_noreplace(AT_FDCWD, m.src, AT_FDCWD, m.dst)      # relative paths are the cwd's
        if locked:
            os.chmod(m.dst, stat.S_IMODE(st.st_mode))
    return sum(m.replace for m in moves)
