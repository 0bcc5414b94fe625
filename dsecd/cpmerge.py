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
import shutil
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .errors import DsecError, Unsupported
from .fs.libc import AT_FDCWD, rename_noreplace

# Renames in flight at once when the moves go to a sandbox: each is one
# request, and a tree re-copied over itself replaces every file.
MOVES_IN_FLIGHT = 32

ListDir = Callable[[str], Awaitable[dict[str, bool]]]     # path -> {name: is a directory}


@dataclass(frozen=True)
class Move:
    src: str          # in the landing directory
    dst: str          # its place in the destination
    replace: bool     # a non-directory is there already


async def plan(list_dir: ListDir, join: Callable[[str, str], str], landing: str, dst: str,
               merged: list[tuple[str, str]] | None = None) -> list[Move]:
    """The moves that merge the tree at `landing` into the existing
    directory `dst`; IsADirectoryError or NotADirectoryError (nothing moved)
    where a directory meets a non-directory. `merged`, if given, gets each
    pair of directories both hold (landing's, dst's; the tops first)."""
    moves: list[Move] = []
    pending = [(landing, dst)]
    while pending:
        src_dir, dst_dir = pending.pop()
        if merged is not None:
            merged.append((src_dir, dst_dir))
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


async def into_sandbox(sb, landing: str, dst: str, dirs: list | None = (),
                       note: Callable[[str], None] | None = None) -> int:
    """Merge `landing` (a directory in sandbox `sb`) into its directory
    `dst`, then remove what is left of `landing` (the directories that
    were merged into); returns how many names were replaced. On a failure
    `landing` stays, for the caller to remove.

    `dirs`: the archive's directory entries ([name below landing, mode,
    mtime], a put's `dirs`; None: the put had too many to list, which
    note(message) says). A directory dst held already that one of them
    names takes its mode and mtime once the moves into it are done, as GNU
    tar (--overwrite-dir, its default) sets an existing directory's from
    the archive's entry, the top's (".") included; one without an entry
    keeps its own. Owners are not the archive's, as in any copy. The
    landing (inside dst, or below it) goes first: its removal would
    change the mtime of the directory that holds it. A sandbox that cannot
    set them (a microVM whose guest agent is older) leaves them as they
    were, and note(message) says so."""

    async def list_dir(path: str) -> dict[str, bool]:
        entries = await sb.list_files(path)
        if entries.truncated:
            raise OSError(errno.E2BIG, "more names than one listing holds (100,000): copy it to a new "
                                       "directory instead", path)
        return {e["name"]: e["type"] == "dir" for e in entries}

    merged: list[tuple[str, str]] = []
    try:
        moves = await plan(list_dir, posixpath.join, landing, dst, merged)
    except (OSError, DsecError) as err:
        if not _sandbox_failure(err) or not _names(err, landing):   # a directory against a non-directory
            raise
        raise stopped(err, landing, dst, None, [], 0) from err
    done: list[Move] = []
    try:
        for i in range(0, len(moves), MOVES_IN_FLIGHT):
            batch = moves[i:i + MOVES_IN_FLIGHT]
            results = await asyncio.gather(*(sb.rename(m.src, m.dst, overwrite=m.replace) for m in batch),
                                           return_exceptions=True)
            # Each move of the batch ran to its end: those that did not fail are in place.
            done += [m for m, res in zip(batch, results, strict=True) if not isinstance(res, BaseException)]
            for m, res in zip(batch, results, strict=True):
                if _sandbox_failure(res):
                    raise stopped(res, landing, dst, m, done, len(moves)) from res
                if isinstance(res, BaseException):
                    raise res
    except asyncio.CancelledError:
        # ^C (or SIGTERM) between or during the moves: what moved in stays,
        # the caller removes the rest with the landing.
        if note is not None and moves:
            in_flight = min(MOVES_IN_FLIGHT, len(moves) - len(done))
            note(f"cancelled while merging into {dst}: {_moved_in(done, len(moves))}, and up to "
                 f"{in_flight} more whose moves were under way; the rest of the copy was not made")
        raise
    await sb.remove(landing, recursive=True)
    if dirs is None and note is not None:
        note("the tar names more directories than one result lists: the existing directories keep their "
             "modes and mtimes")
    entries = {name: (mode, mtime) for name, mode, mtime in dirs or ()}
    sets = []
    for src_dir, dst_dir in merged:
        rel = posixpath.relpath(src_dir, landing)
        attrs = entries.get("" if rel == "." else rel)
        if attrs is not None:
            sets.append((dst_dir, *attrs))
    try:
        # dst may be a symlink to the directory (its moves go through it), as
        # tar -C follows one; below it, both hold only real directories.
        for i in range(0, len(sets), MOVES_IN_FLIGHT):
            await asyncio.gather(*(sb.set_attrs(path, mode=mode, mtime=mtime, follow=path == dst)
                                   for path, mode, mtime in sets[i:i + MOVES_IN_FLIGHT]))
    except Unsupported as err:
        if note is not None:
            note(f"the existing directories keep their modes and mtimes: {err.message}")
    return sum(m.replace for m in moves)


async def into_local(landing: str, dst: str, top: tuple[int, int] | None = None) -> int:
    """Merge the local directory `landing` into the local directory `dst`,
    then remove what is left of `landing`; returns how many names were
    replaced. On a failure `landing` stays, for the caller to remove
    (localcopy.remove_tree: its directories may be read-only).

    A directory dst held already takes the mode and mtime of the copy's
    directory of that name once the moves into it are done, as docker cp
    gives them (and as into_sandbox does); `top`: (mode, mtime in ns) for
    `dst` itself, the copied directory's (None: dst keeps its own, as
    SRC/. copies only the contents). The landing (inside dst, or below it)
    goes first: its removal would change the mtime of the directory that
    holds it."""

    async def list_dir(path: str) -> dict[str, bool]:
        with os.scandir(path) as it:
            return {e.name: e.is_dir(follow_symlinks=False) for e in it}

    merged: list[tuple[str, str]] = []
    try:
        moves = await plan(list_dir, os.path.join, landing, dst, merged)
    except OSError as err:
        if not _names(err, landing):         # a directory against a non-directory: dst's path
            raise
        raise stopped(err, landing, dst, None, [], 0) from err
    # Read before the moves, which change the mtime of each they leave.
    sets = [(dst, *top)] if top is not None else []
    for src_dir, dst_dir in merged:
        if src_dir != landing:
            st = os.lstat(src_dir)
            sets.append((dst_dir, stat.S_IMODE(st.st_mode), st.st_mtime_ns))
    # The copied directories keep their modes (0555, say), which would not
    # let a user other than root move entries out of them, nor move them (a
    # directory's move rewrites its ".."): writable for the move, then as
    # they came.
    for d in {os.path.dirname(m.src) for m in moves} | {src_dir for src_dir, _ in merged}:
        os.chmod(d, 0o700)
    done: list[Move] = []
    for m in moves:
        try:
            st = os.lstat(m.src)
            locked = stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IWUSR
            if locked:
                os.chmod(m.src, stat.S_IMODE(st.st_mode) | stat.S_IWUSR)
            if m.replace:
                os.replace(m.src, m.dst)
            else:
                rename_noreplace(AT_FDCWD, m.src, AT_FDCWD, m.dst)      # relative paths are the cwd's
        except OSError as err:
            raise stopped(err, landing, dst, m, done, len(moves)) from err
        done.append(m)
        if locked:
            os.chmod(m.dst, stat.S_IMODE(st.st_mode))
    shutil.rmtree(landing)
    # Deepest first: a directory made unreadable must not stop those below it.
    for path, mode, mtime_ns in sorted(sets, key=lambda s: -s[0].count(os.sep)):
        os.chmod(path, mode)
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return sum(m.replace for m in moves)


def _sandbox_failure(err: BaseException) -> bool:
    """Whether `err` is what a request of the sandbox's answered (said
    again by stopped()), not the connection to the daemon lost (a
    ConnectionError, the client's own failure, which callers tell as such:
    the daemon removes the landing then, a temporary put's)."""
    return isinstance(err, DsecError) or (isinstance(err, OSError) and not isinstance(err, ConnectionError))


def _names(err: OSError | DsecError, path: str) -> bool:
    """Whether `err` says `path` (a landing directory) anywhere."""
    text = err.message if isinstance(err, DsecError) else f"{err.strerror} {err.filename}"
    return path in text


SHOWN_MOVES = 5     # names a failed merge lists of those that had moved in


def _moved_in(done: list[Move], total: int) -> str:
    """"2 of 7 names had moved in (/d/a, /d/b)": the changes a merge cut
    short made, the first SHOWN_MOVES of them named."""
    if not done:
        return f"none of its {total} names had moved in"
    names = ", ".join(m.dst for m in done[:SHOWN_MOVES]) + (", ..." if len(done) > SHOWN_MOVES else "")
    replaced = sum(m.replace for m in done)
    return (f"{len(done)} of {total} names had moved in ({names}"
            + (f"; {replaced} of them replaced a file" if replaced else "") + ")")


def stopped(err: OSError | DsecError, landing: str, dst: str, failed: Move | None, done: list[Move],
            total: int) -> OSError | DsecError:
    """`err`, which stopped a merge at the move `failed` (None: before any
    move), said in the user's terms: the destination and the name that
    failed rather than the landing directory (which the caller removes
    with what it still holds), and which names had moved into `dst`
    already, those being the changes the copy made. Same class, code and
    errno."""
    if isinstance(err, DsecError):
        reason = err.message
        if failed is not None:
            reason = reason.split(f"{failed.src} -> {failed.dst}: ", 1)[-1]
    else:
        reason = err.strerror or str(err)
        if err.filename and failed is None:
            reason = f"{reason}: {err.filename}"
    reason = reason.replace(landing, dst)
    if failed is None:
        text = f"copy into {dst} stopped: {reason}; nothing of {dst} was changed"
    else:
        text = (f"copy into {dst} stopped at {failed.dst}: {reason}; {_moved_in(done, total)}; the rest of "
                "the copy was not made")
    if isinstance(err, DsecError):
        out = type(err)(text, {**err.detail, "path": dst})
        out.code = err.code
        return out
    return OSError(err.errno, text)
