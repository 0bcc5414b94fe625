"""systemd's service notification protocol (sd_notify(3)), for Type=notify.

The protocol is one datagram of "KEY=VALUE" lines sent to the AF_UNIX socket
named by $NOTIFY_SOCKET (a path, or "@name" for the abstract namespace);
systemd documents it as stable, and it is all dsecd needs: READY=1 once the
socket serves, STATUS= with live counts, WATCHDOG=1 while the event loop
turns, STOPPING=1 at shutdown. Written out here (a few lines) rather than
taken from python3-systemd, whose sd_notify is the same datagram behind a C
extension and libsystemd: one dependency less on every host, and the
daemon does not need the rest of that library.

Without $NOTIFY_SOCKET (not under systemd, or a unit without Type=notify)
every call does nothing. A send that fails is logged once and not retried:
systemd then times the start out or kills a silent service, which says more
than a daemon that stops serving because its supervisor went away.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ=os.environ):
        addr = environ.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]          # abstract namespace
        self.address = addr or None
        self._sock: socket.socket | None = None
        self._failed = False
        self.watchdog_s = watchdog_interval(environ)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields) -> bool:
        """One notification: send(READY=1, STATUS="..."). True if it was sent."""
        if self.address is None or self._failed:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self.address)
            return True
        except OSError as err:
            self._failed = True
            log.error("notify systemd through NOTIFY_SOCKET %s: %s; no further notifications",
                      self.address.replace("\0", "@"), err)
            return False

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ=os.environ) -> float | None:
    """Seconds between WATCHDOG=1 pings, or None when no watchdog is armed for
    this process: half of WatchdogSec= (WATCHDOG_USEC), as sd_watchdog_enabled(3)
    advises; WATCHDOG_PID, when set, must be ours (a child that inherited the
    environment must not ping for us)."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    pid = environ.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2e6
