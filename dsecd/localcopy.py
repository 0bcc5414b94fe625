"""The client's side of directory copies: a local tree packed as a tar
(`pack`), a sandbox's tar unpacked as a new local directory (`unpack`).
Blocking: the async SDK runs them in a thread.

`unpack` checks every entry with dsecd/tarsafe.py (the daemon's rules) and
is as strict as tarfile's 'data' filter or more: nothing absolute, no `..`,
nothing written through a symlink (each directory is opened with
O_NOFOLLOW), no devices or FIFOs, no setuid/setgid, owners not kept. It
extracts into a temporary directory beside the destination and renames it
into place at the end; on failure it is removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import tarfile
import threading

from . import tarsafe
from .fs import libc

READ = 1 << 20


class LocalCopyError(ValueError):
    """A local tree that cannot be copied as asked (a FIFO in it, an existing destination)."""


def pack(top: str, out) -> int:
    """Write a tar of directory `top` to binary file `out`; the number of entries.
    Symlinks are stored as symlinks, a file's further names in the tree as
    hard links to the first; FIFOs, sockets and devices are refused
    (LocalCopyError, as a `top` that is not a directory; FileNotFoundError:
    there is none)."""
    if not os.path.lexists(top):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), top)
    if not os.path.isdir(top) or os.path.islink(top):
        raise LocalCopyError(f"{top} is not a directory; copy a single file without -r")
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(_info(tf, top, "."))
        n = 1
        for dirpath, dirnames, filenames in os.walk(top):      # symlinked directories: entries, not entered
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, top)
            for name in sorted(dirnames + filenames):
                path = os.path.join(dirpath, name)
                rel = os.path.normpath(os.path.join(rel_dir, name))
                info = _info(tf, path, rel)
                if info.isreg():
                    with open(path, "rb") as f:
                        tf.addfile(info, f)
                else:
                    tf.addfile(info)
                n += 1
    return n


def _info(tf: tarfile.TarFile, path: str, rel: str) -> tarfile.TarInfo:
    st = os.lstat(path)
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise LocalCopyError(f"{path} is not a file, directory or symlink (a FIFO, socket or device): "
                             "it cannot be copied; remove it or copy the files around it")
    info = tf.gettarinfo(path, rel)         # a file's second name: a hard link to its first, as tar(1) has it
    info.mode &= tarsafe.KEPT_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class Stopped(Exception):
    """unpack was told to stop (its caller was cancelled): nothing was left."""


def unpack(src, dst: str, max_entries: int = 10**7, max_bytes: int = 1 << 62,
           stop: threading.Event | None = None) -> int:
    """Extract the tar in binary file `src` as the new directory `dst`; the
    number of entries. `stop`, once set, ends it (Stopped) before the next
    entry or the rename into place, with its temporary directory removed."""
    dst = os.path.abspath(dst)
    if os.path.lexists(dst):
        raise LocalCopyError(f"{dst} exists; remove it first or copy to a new path")
    parent = os.path.dirname(dst)
    tmp = os.path.join(parent, f".dsec-get-{secrets.token_hex(6)}")
    os.mkdir(tmp, 0o700)
    seen = tarsafe.Seen(max_entries, max_bytes)
    dir_modes: dict[str, tuple[int, int]] = {}     # rel -> (mode, mtime in ns)
    try:
        with tarfile.open(fileobj=src, mode="r|") as tf:
            for m in tf:
                _check_stop(stop)
                rel = tarsafe.check(m, seen)
                if seen.replaces == "itself":
                    continue
                path = _below(tmp, rel)
                if seen.replaces in ("file", "other") or (seen.replaces == "dir" and not m.isdir()):
                    # A later entry of the name wins (tarsafe): what the earlier made goes.
                    (os.rmdir if seen.replaces == "dir" else os.unlink)(path)
                    dir_modes.pop(rel, None)
                if m.isdir():
                    os.makedirs(path, 0o700, exist_ok=True)
                    dir_modes[rel] = (m.mode & tarsafe.KEPT_MODE, tarsafe.mtime_ns(m))
                    continue
                os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
                if m.issym():
                    os.symlink(m.linkname, path)
                    os.utime(path, ns=(tarsafe.mtime_ns(m),) * 2, follow_symlinks=False)
                elif m.islnk():
                    os.link(_below(tmp, tarsafe.entry_name(m.linkname)), path, follow_symlinks=False)
                else:
                    _write(tf.extractfile(m), path, m)
        for rel, (mode, mtime_ns) in sorted(dir_modes.items(), key=lambda kv: -kv[0].count("/") - bool(kv[0])):
            path = _below(tmp, rel)
            os.chmod(path, mode)
            os.utime(path, ns=(mtime_ns, mtime_ns))
        if "" not in dir_modes:
            os.chmod(tmp, 0o755)
        _check_stop(stop)
        try:
            # Not a plain rename: it would replace an empty directory made at
            # `dst` since the check above.
            libc.rename_noreplace(libc.AT_FDCWD, tmp, libc.AT_FDCWD, dst)
        except FileExistsError:
            raise LocalCopyError(f"{dst} exists (made while the copy ran); remove it first or copy to a "
                                 "new path") from None
    except BaseException:
        remove_tree(tmp)        # its directories have the archive's modes by the end
        raise
    return seen.entries


def remove_tree(top: str) -> None:
    """Remove the local directory `top` and what it holds, after a failed
    copy or merge. Its directories may have the copy's modes (0555, say),
    which would not let a user other than root remove what is in them:
    each is made writable first, before its entries are listed. Nothing it
    fails on is raised: the caller raises the error that stopped the copy."""
    with contextlib.suppress(OSError):
        os.chmod(top, 0o700)
    for root, dirs, _files in os.walk(top):
        for name in dirs:
            path = os.path.join(root, name)
            if not os.path.islink(path):            # os.walk lists a link to a directory with them
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
    shutil.rmtree(top, ignore_errors=True)


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise Stopped("the copy was cancelled")


def _below(tmp: str, rel: str) -> str:
    """The path of `rel` under `tmp`, after checking no directory on the way
    is a symlink (tarsafe already refuses entries below the archive's own
    symlinks; this also covers a link someone else put there meanwhile)."""
    path = tmp
    for part in rel.split("/")[:-1] if rel else ():
        path = os.path.join(path, part)
        if os.path.islink(path):
            raise tarsafe.Refused(f"entry {rel!r}: {path} is a symlink; nothing is written through one")
    return os.path.join(path, rel.rpartition("/")[2]) if rel else tmp


def _write(data, path: str, m: tarfile.TarInfo) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 m.mode & tarsafe.KEPT_MODE)
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(data, out, READ)
    os.utime(path, ns=(tarsafe.mtime_ns(m),) * 2)
