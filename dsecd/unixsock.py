"""Unix sockets the daemon listens on, created with their final mode."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import tempfile


def remove_dead_socket(path: str) -> None:
    """Remove the socket file a dead server left at `path`. A file that is
    not a socket, or a socket a server still answers on, stays: ValueError
    naming it, since bind_private would rename the new socket over it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        err = probe.connect_ex(path)
    finally:
        probe.close()
    if err == 0:
        raise ValueError(f"a server already serves on {path}")
    if err not in (errno.ECONNREFUSED, errno.ENOENT):
        raise OSError(err, os.strerror(err), path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def bind_private(path: str, gid: int) -> socket.socket:
    """A unix socket bound at `path`, mode 0660 and group `gid` before anyone
    can reach it: bound in a fresh 0700 dir beside `path`, fixed there, and
    renamed into place. (Not by setting the umask around the bind: the umask
    is the whole process's, and the daemon's worker threads may be making
    files and dirs at that moment.)"""
    private = tempfile.mkdtemp(prefix=".dsecd-bind-", dir=os.path.dirname(path) or ".")    # 0700
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        staged = os.path.join(private, "sock")
        sock.bind(staged)
        os.chown(staged, os.geteuid(), gid)
        os.chmod(staged, 0o660)
        os.rename(staged, path)
    except BaseException:
        sock.close()
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(private, "sock"))
        os.rmdir(private)
    return sock


async def serve_private(path: str, gid: int, start_server):
    """start_server(sock) (an asyncio server on a socket of bind_private's);
    the socket is closed if that fails."""
    sock = bind_private(path, gid)
    try:
        return await start_server(sock)
    except BaseException:
        sock.close()
        raise
