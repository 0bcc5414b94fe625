"""The host side's addresses, watched, so that the egress fences follow them.

The Network fences the host's own addresses (a sandbox allowed 0.0.0.0/0
does not reach the host's services through them, Network._host_nets).
Those addresses change while the daemon runs: an interface comes up, a
lease is renewed to another address, a tunnel appears. HostAddressWatch
holds a NETLINK_ROUTE socket in the bridge's netns subscribed to address
changes of both families; a change of an address the fences can hold
(scope global or site: not loopback's, not link-local ones, which every
sandbox veth's host side gets) wakes the daemon's loop, which has the
Network fence them again (Network.refresh_host_fences) on a worker
thread. Changes that come while a refresh runs are taken by one more
refresh after it; notifications lost to an overrun of the socket's buffer
(ENOBUFS) wake it too. While some sandbox's policy could not be rewritten,
it is retried every RETRY_S. Nothing else runs: a refresh dumps every
address of the netns (one per sandbox veth too), so it is not polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import struct

from .plumbing import netlink_socket

log = logging.getLogger(__name__)

RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV6_IFADDR = 0x100
RTM_NEWADDR, RTM_DELADDR = 20, 21
RT_SCOPE_SITE = 200                  # scopes above it: link (253), host (254), nowhere (255)
RETRY_S = 30.0
RECV_BYTES = 1 << 16

_NLMSG = struct.Struct("=IHHII")     # nlmsghdr: len, type, flags, seq, pid
_IFADDRMSG = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefixlen, flags, scope, index


def fenceable_change(data: bytes) -> bool:
    """Whether a datagram of address notifications adds or removes an
    address of scope global or site (one a fence can hold)."""
    off = 0
    while off + _NLMSG.size <= len(data):
        length, kind = _NLMSG.unpack_from(data, off)[:2]
        if length < _NLMSG.size:
            break                    # malformed: stop reading it (the periodic check still runs)
        body = off + _NLMSG.size
        if kind in (RTM_NEWADDR, RTM_DELADDR) and body + _IFADDRMSG.size <= len(data):
            scope = _IFADDRMSG.unpack_from(data, body)[3]
            if scope <= RT_SCOPE_SITE:
                return True
        off += (length + 3) & ~3
    return False


class HostAddressWatch:
    """`refresh()` (blocking: Network.refresh_host_fences) run through
    `run_blocking` whenever the host side's addresses change, and every
    RETRY_S while `pending()` says a policy still waits for its rewrite."""

    def __init__(self, ns_path: str | None, refresh, pending, run_blocking, loop: asyncio.AbstractEventLoop):
        self.ns_path = ns_path
        self.refresh = refresh
        self.pending = pending
        self.run_blocking = run_blocking
        self.loop = loop
        self.changes = 0                 # refreshes that changed the fences
        self._sock: socket.socket | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False

    def start(self) -> None:
        sock = netlink_socket(self.ns_path, RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR)
        sock.setblocking(False)
        self._sock = sock
        self.loop.add_reader(sock.fileno(), self._readable)
        self._wake.set()                 # what changed between the Network's start and now
        self._task = self.loop.create_task(self._run())

    def _readable(self) -> None:
        """Drain the socket; wake the refresher if a fenceable address changed."""
        wake = False
        while True:
            try:
                data = self._sock.recv(RECV_BYTES)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno != errno.ENOBUFS:
                    raise
                wake = True              # notifications were lost: look at all of them
                continue
            wake = wake or fenceable_change(data)
        if wake:
            self._wake.set()

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RETRY_S if self.pending() else None)
            self._wake.clear()
            if self._closing:
                break
            try:
                if await self.run_blocking(self.refresh):
                    self.changes += 1
            except Exception:
                log.exception("fence the host's addresses again")

    async def close(self) -> None:
        """Stop watching; a refresh under way ends first (the Network it
        rewrites is closed after this)."""
        if self._sock is not None:
            self.loop.remove_reader(self._sock.fileno())
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        if self._sock is not None:
            self._sock.close()
            self._sock = None
