"""A whole conntrack table's entries, read over ctnetlink with only the
fields a destroy needs, and deleted one by one.

Why not pyroute2's Conntrack, which dsecd uses for filtered dumps
(nat.py): it decodes every attribute of every entry and runs an asyncio
loop per message, ~0.43 ms per entry on a 2-vCPU host. A destroy with
an IPv6 address reads the whole IPv6 table (the kernel's IPv6 tuple
filter is inverted: nat.forget_address), so with 2,000 entries each
destroy took 0.87 s of a worker's CPU. Here an entry whose message
lacks the address's bytes costs a substring search, one that holds them
the parse of its original tuple, and an entry is deleted by sending back
the bytes the kernel gave: 14-22 ms for that table.

Message layout (include/uapi/linux/netfilter/nfnetlink_conntrack.h): a
netlink header, a 4-byte nfgenmsg (family, version, res_id), then
attributes; CTA_TUPLE_ORIG nests CTA_TUPLE_IP, which nests the
addresses.
"""

from __future__ import annotations

import errno
import socket
import struct
from dataclasses import dataclass

from .nldump import DUMP_TRIES, Replies

NETLINK_NETFILTER = 12
_CT_GET = (1 << 8) | 1          # NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_GET
_CT_DELETE = (1 << 8) | 2       # ... | IPCTNL_MSG_CT_DELETE
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP = 0x1, 0x4, 0x300
_CTA_TUPLE_ORIG, _CTA_ID, _CTA_ZONE = 1, 12, 18
_CTA_TUPLE_IP = 1
_ADDR_ATTRS = {socket.AF_INET: (1, 2), socket.AF_INET6: (3, 4)}     # CTA_IP_V4_SRC/DST, CTA_IP_V6_SRC/DST
_NLA_TYPE_MASK = 0x3FFF         # without NLA_F_NESTED and NLA_F_NET_BYTEORDER
_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big-endian, 0)
_NLA = struct.Struct("=HH")     # nlattr: len, type


class CtError(OSError):
    """A ctnetlink request the kernel refused (errno, what was asked)."""


@dataclass(frozen=True)
class Entry:
    """One conntrack entry: its original direction's addresses (packed, as
    socket.inet_pton gives them) and the attributes that name it for a
    delete (the original tuple, its id and zone, as the kernel sent them)."""
    src: bytes
    dst: bytes
    key: bytes


def _attrs(buf: bytes, start: int, end: int):
    """(type, value start, value end, attribute start, attribute end) of each
    attribute in buf[start:end]."""
    while start + 4 <= end:
        length, kind = _NLA.unpack_from(buf, start)
        if length < 4 or start + length > end:      # malformed or cut: nothing past it is read
            return
        yield kind & _NLA_TYPE_MASK, start + 4, start + length, start, start + ((length + 3) & ~3)
        start += (length + 3) & ~3


def _children(buf: bytes, span: tuple[int, int] | None) -> dict[int, tuple[int, int]]:
    """type -> (value start, value end) of the attributes nested in the
    value at `span` (the first of each type); {} for no span."""
    out: dict[int, tuple[int, int]] = {}
    for kind, vs, ve, _a0, _a1 in _attrs(buf, *span) if span else ():
        out.setdefault(kind, (vs, ve))
    return out


def parse_entry(buf: bytes, start: int, end: int, family: int) -> Entry | None:
    """The entry of one CT_NEW message body (after its nfgenmsg), or None if
    it has no original tuple with both addresses."""
    orig, key = None, []
    for kind, vs, ve, a0, a1 in _attrs(buf, start, end):
        if kind == _CTA_TUPLE_ORIG:
            orig = (vs, ve)
        if kind in (_CTA_TUPLE_ORIG, _CTA_ID, _CTA_ZONE):
            key.append(buf[a0:a1])
    addrs = _children(buf, _children(buf, orig).get(_CTA_TUPLE_IP))
    src, dst = (addrs.get(a) for a in _ADDR_ATTRS[family])
    if src is None or dst is None:
        return None
    return Entry(bytes(buf[src[0]:src[1]]), bytes(buf[dst[0]:dst[1]]), b"".join(key))


class CtSocket:
    """A ctnetlink socket (opened by the caller in the netns it is for)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.seq = 0
        self.interrupted = False        # a reply of the last request carried NLM_F_DUMP_INTR
        sock.bind((0, 0))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> CtSocket:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, kind: int, flags: int, family: int, body: bytes = b"") -> int:
        self.seq += 1
        payload = _NFGEN.pack(family, 0, 0) + body
        self.sock.send(_HDR.pack(_HDR.size + len(payload), kind, flags, self.seq, 0) + payload)
        return self.seq

    def _messages(self, seq: int):
        """(type, buffer, body start, end) of each reply to request `seq`,
        until its end (nldump.Replies: CtError for an error reply, or for a
        dump's NLMSG_DONE carrying an errno). Sets `interrupted` if any of
        them (NLMSG_DONE too) says the table changed during the dump."""
        self.interrupted = False
        replies = Replies(self.sock, seq, "conntrack", CtError, 1 << 16)
        yield from replies
        self.interrupted = replies.interrupted

    def dump(self, family: int, containing: bytes = b"") -> list[Entry]:
        """The entries of the table of `family` (AF_INET or AF_INET6) whose
        message holds the bytes `containing` anywhere (a packed address: a
        substring search skips the parse of all others; the caller checks
        the fields it wants). A dump whose replies say the table changed
        meanwhile (NLM_F_DUMP_INTR: entries may be missing) is done again,
        at most DUMP_TRIES times; CtError (EAGAIN) if each was."""
        for _ in range(DUMP_TRIES):
            seq = self._send(_CT_GET, _NLM_F_REQUEST | _NLM_F_DUMP, family)
            out = []
            for _kind, buf, start, end in self._messages(seq):
                if containing and buf.find(containing, start, end) < 0:
                    continue
                entry = parse_entry(buf, start + _NFGEN.size, end, family)
                if entry is not None:
                    out.append(entry)
            if not self.interrupted:
                return out
        raise CtError(errno.EAGAIN, f"conntrack: the table changed during each of {DUMP_TRIES} dumps "
                      "(NLM_F_DUMP_INTR)")

    def delete(self, family: int, entry: Entry) -> bool:
        """Delete `entry` (by its original tuple, id and zone: not a later
        entry of the same tuple); False if it has gone meanwhile."""
        seq = self._send(_CT_DELETE, _NLM_F_REQUEST | _NLM_F_ACK, family, entry.key)
        try:
            for _ in self._messages(seq):
                pass
        except CtError as err:
            if err.errno == errno.ENOENT:
                return False
            raise
        return True
