"""Numbers (sandbox host ids, bridge addresses, published host ports)
claimed host-wide, so that two dsecd daemons of one host never hand out the
same one."""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Iterable


def pids_note(pids: Iterable[int]) -> str:
    """" (pid 12, 34)": the holders named in a message, those of `pids` that
    are known (0: one let go meanwhile); "" if none is."""
    known = ", ".join(str(p) for p in sorted(pids) if p)
    return f" (pid {known})" if known else ""


class HostClaims:
    """Numbers claimed host-wide, among every dsecd daemon of the host: a
    POSIX record lock on bytes start..start+count-1 of one file per kind of
    number (sandbox host ids: dsecd/userns.py; addresses on a bridge:
    dsecd/net/ipam.py; published host ports: dsecd/net/nat.py PortClaims).
    Another daemon's claim on any of those bytes makes them taken, however
    each daemon is configured; but shared claims (read locks) of one byte
    coexist, for numbers that several daemons may use at once as long as
    none holds it exclusively (a host port on single addresses: PortClaims). The locks are the daemon
    process's own: held while it lives, not inherited by the children it
    forks (the zygote), and gone with it however it ends (kill -9 too), so a
    claim never outlives its daemon and the next start claims what its
    journal holds again. The files are on /run (a tmpfs): no claim outlives
    a reboot either.

    A process loses all its record locks on a file when it closes any fd of
    that file: each file is opened once per process (kept in _FDS) and
    never closed."""

    _FDS: dict[str, int] = {}

    def __init__(self, path: str):
        self.path = path
        if path not in self._FDS:
            self._FDS[path] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.fd = self._FDS[path]

    def claim(self, start: int, count: int, shared: bool = False) -> int | None:
        """Claim start..start+count-1: None once they are this process's,
        else the pid of a process holding some of them (0 if it let go
        meanwhile: they were taken a moment ago, so the range is not handed
        out either). A `shared` claim (a read lock) coexists with other
        shared ones and excludes only exclusive ones; this process's own
        claim on those bytes is turned into the kind asked for."""
        try:
            fcntl.lockf(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB, count, start)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return self.holder(start, count, shared)
        return None

    def give_up(self, start: int, count: int) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN, count, start)

    def holder(self, start: int, count: int, shared: bool = False) -> int:
        """The pid of another process whose claim on some of
        start..start+count-1 excludes a claim of this kind (`shared`: only
        an exclusive one does); 0 if none does (F_GETLK does not see this
        process's own claims)."""
        # struct flock: l_type, l_whence, l_start, l_len, l_pid (and padding).
        kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
        arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, start, count, 0)
        l_type, _, _, _, pid = struct.unpack("hhqqi4x", fcntl.fcntl(self.fd, fcntl.F_GETLK, arg))
        return 0 if l_type == fcntl.F_UNLCK else pid
