"""rtnetlink dumps (links, addresses, routes) read whole, and read again
when the kernel says the table changed while it was being dumped.

A dump is answered in as many datagrams as the table takes, each filled
by a separate pass over the table; a link, address or route added or
removed between two passes may be missed or seen twice. The kernel says
so: it sets NLM_F_DUMP_INTR on every message of the dump from that change
on, the closing NLMSG_DONE included. pyroute2 (0.9) does not look at the
flag (its NetlinkDumpInterrupted is never raised) and drops NLMSG_DONE,
so the dumps the daemon relies on (the host side's addresses, which the
egress fences hold; the links a start sweeps; the default route of
net.uplink = "auto") are read here: a dump with the flag on any of its
messages is done again, at most DUMP_TRIES times in all, and then is an
error rather than a partial table; so is a dump whose NLMSG_DONE
carries an errno (the kernel could not finish it). The replies are
decoded with pyroute2's message classes, so callers read them as before
(`get_attr`, `msg["prefixlen"]`).
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import struct

from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

NLM_F_REQUEST, NLM_F_DUMP, NLM_F_DUMP_INTR = 0x1, 0x300, 0x10
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWADDR, RTM_GETADDR = 20, 22
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
# A table that changes on every pass of a dump (a host adding and deleting
# links without pause) is not waited for: the caller's error says so.
DUMP_TRIES = 8
# One datagram of a dump holds whole messages, and the kernel makes it as
# large as its largest message needs (a link with many SR-IOV VFs is past
# 64 KiB); a read shorter than the datagram cuts it (Replies refuses the
# dump then). Dumps are not hot: a buffer this large costs nothing that matters.
RECV_BYTES = 1 << 20

_HDR = struct.Struct("=IHHII")          # nlmsghdr: len, type, flags, seq, pid
_IFINFO = struct.Struct("=BxHiII")      # ifinfomsg: family, pad, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")       # ifaddrmsg: family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")    # rtmsg: family, dst_len, src_len, tos, table, proto, scope, type, flags
_DECODE = {RTM_NEWLINK: ifinfmsg, RTM_NEWADDR: ifaddrmsg, RTM_NEWROUTE: rtmsg}
_seq = itertools.count(1)


class DumpInterrupted(OSError):
    """Every try of a dump was interrupted by a change of its table."""


class Replies:
    """The replies to netlink request `seq` on `sock`, as (type, buffer,
    body start, end) of each message, until the request's end: NLMSG_DONE
    of a dump, or the ack of a request that asked for one. Messages of other
    requests are passed over. `error` (an OSError class, raised as
    error(errno, "<what>: ...")) for an error reply, a malformed header, or
    a dump's NLMSG_DONE carrying an errno (the kernel could not finish it:
    netlink_dump's dump_done_errno; what came is part of the table only).
    `interrupted` says, once iterated, whether any of them (NLMSG_DONE too)
    carried NLM_F_DUMP_INTR: the table changed during the dump."""

    def __init__(self, sock: socket.socket, seq: int, what: str, error: type[OSError] = OSError,
                 recv_bytes: int = RECV_BYTES):
        self.sock, self.seq, self.what, self.error, self.recv_bytes = sock, seq, what, error, recv_bytes
        self.interrupted = False

    def __iter__(self):
        while True:
            data = self._datagram()
            at = 0
            while at + _HDR.size <= len(data):
                length, typ, flags, mseq, _pid = _HDR.unpack_from(data, at)
                if length < _HDR.size or at + length > len(data):
                    raise self.error(errno.EPROTO, f"{self.what}: a netlink reply of length {length} in a "
                                     f"datagram of {len(data)} bytes (at {at})")
                end = at + length
                if mseq == self.seq:
                    self.interrupted = self.interrupted or bool(flags & NLM_F_DUMP_INTR)
                    if typ in (NLMSG_DONE, NLMSG_ERROR):
                        # Its payload: 0 (a dump's end, an ack), or a negative errno.
                        code = -struct.unpack_from("=i", data, at + _HDR.size)[0] \
                            if length >= _HDR.size + 4 else 0
                        if code > 0:
                            why = "the dump ended early: " if typ == NLMSG_DONE else ""
                            raise self.error(code, f"{self.what}: {why}{os.strerror(code)}")
                        return
                    yield typ, data, at + _HDR.size, end
                at = (end + 3) & ~3

    def _datagram(self) -> bytes:
        """The next datagram, whole. One longer than `recv_bytes` would be
        cut, with nothing but MSG_TRUNC to say so, and the messages past
        the cut lost from the table: refused instead."""
        data, _anc, msg_flags, _addr = self.sock.recvmsg(self.recv_bytes)
        if msg_flags & socket.MSG_TRUNC:
            raise self.error(errno.EMSGSIZE, f"{self.what}: a netlink reply datagram was longer than the "
                             f"{self.recv_bytes} bytes read: it was cut, so the dump would be incomplete")
        return data


def _dump_once(sock: socket.socket, kind: int, body: bytes, what: str) -> tuple[list, bool]:
    """One dump: (its messages decoded, whether any carried NLM_F_DUMP_INTR)."""
    seq = next(_seq) & 0xFFFFFFFF
    sock.send(_HDR.pack(_HDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body)
    replies, out = Replies(sock, seq, what), []
    for typ, data, start, end in replies:
        cls = _DECODE.get(typ)
        if cls is not None:
            msg = cls(data[start - _HDR.size:end])
            msg.decode()
            out.append(msg)
    return out, replies.interrupted


def dump(sock: socket.socket, kind: int, body: bytes, what: str, tries: int = DUMP_TRIES) -> list:
    """The messages of an rtnetlink dump request `kind` (RTM_GET*) with the
    family header `body`, over `sock` (a NETLINK_ROUTE socket of the netns
    to read), from a dump no change of the table interrupted.
    DumpInterrupted (EAGAIN) if each of `tries` was."""
    for _ in range(tries):
        msgs, interrupted = _dump_once(sock, kind, body, what)
        if not interrupted:
            return msgs
    raise DumpInterrupted(errno.EAGAIN, f"{what}: the table changed during each of {tries} netlink dumps "
                          "(NLM_F_DUMP_INTR); try again")


def links(sock: socket.socket, what: str = "list the links") -> list:
    return dump(sock, RTM_GETLINK, _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0), what)


def addresses(sock: socket.socket, what: str = "list the addresses") -> list:
    return dump(sock, RTM_GETADDR, _IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, 0), what)


def routes(sock: socket.socket, family: int, what: str = "list the routes") -> list:
    return dump(sock, RTM_GETROUTE, _RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0), what)
