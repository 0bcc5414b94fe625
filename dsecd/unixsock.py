"""Unix sockets the daemon listens on, created with their final mode."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
import tempfile

DEFAULT_SOCKET = "/run/dsecd/dsecd.sock"
# <sys/socket.h> struct ucred: pid, uid, gid.
_UCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket (as
    it was when it connected, or listened for the connection)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)


def default_socket() -> str:
    """The daemon socket a client reaches when it names none: DSEC_SOCKET, else the default."""
    return os.environ.get("DSEC_SOCKET") or DEFAULT_SOCKET


# The longest path a socket is reached at: a unix socket's address (sun_path)
# holds 108 bytes, the last a NUL for clients written in C.
ADDRESS_MAX = 107
# bind_private binds in a mkdtemp dir beside the path (this prefix and 8
# random characters), as "sock".
_STAGING_PREFIX = ".dsecd-bind-"
_STAGED_EXTRA = len(f"/{_STAGING_PREFIX}{'x' * 8}/sock")


def address_problem(path: str) -> str | None:
    """Why no server of bind_private's could serve clients at `path` (as
    a sentence's end), None if one can: past ADDRESS_MAX a rename puts the
    socket there all the same, but no client can connect to it."""
    n = len(os.fsencode(path))
    if n > ADDRESS_MAX:
        return f"is {n} bytes: a unix socket's address takes at most {ADDRESS_MAX}"
    staged = len(os.fsencode(os.path.dirname(path) or ".")) + _STAGED_EXTRA
    if staged > ADDRESS_MAX:
        return (f"is in a directory whose name is too long: the socket is bound in it first, under a name "
                f"of {staged} bytes, and a unix socket's address takes at most {ADDRESS_MAX}")
    return None


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
    private = tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=os.path.dirname(path) or ".")    # 0700
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
