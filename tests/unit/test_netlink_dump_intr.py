"""Netlink dumps the kernel flags NLM_F_DUMP_INTR (its table changed while
it was dumped: entries may be missing or doubled) are read again, a bounded
number of times, instead of being used as if complete: the rtnetlink ones
(nldump: the host side's addresses, the links, the routes) and the
conntrack one (ctdump). Fed hand-built replies through a stand-in socket."""

from __future__ import annotations

import errno
import socket
import struct

import pytest
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg

from dsecd.net import ctdump, nldump, plumbing
from dsecd.net.plumbing import Plumbing

HDR = struct.Struct("=IHHII")
NLM_F_MULTI, INTR = 0x2, nldump.NLM_F_DUMP_INTR


class Kernel:
    """A netlink socket's stand-in: each request sent is answered with the
    next of `replies`, a list of (type, flags, body) messages, as one
    datagram carrying the request's sequence number, then NLMSG_DONE
    (flagged as `done_flags` of the reply says, its payload `done_errno`:
    the kernel's 0, or the negative errno a dump that failed part way
    ends with)."""

    def __init__(self, replies: list[tuple[list[tuple[int, int, bytes]], int]], done_errno: int = 0):
        self.replies = list(replies)
        self.done_errno = done_errno
        self.requests: list[bytes] = []
        self.queue: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.requests.append(data)
        seq = HDR.unpack_from(data)[3]
        msgs, done_flags = self.replies.pop(0)
        out = b""
        for typ, flags, body in msgs:
            out += HDR.pack(HDR.size + len(body), typ, flags | NLM_F_MULTI, seq, 0) + body
        self.queue.append(out)
        self.queue.append(HDR.pack(HDR.size + 4, nldump.NLMSG_DONE, NLM_F_MULTI | done_flags, seq, 0)
                          + struct.pack("=i", self.done_errno))
        return len(data)

    def recvmsg(self, _size: int) -> tuple[bytes, list, int, None]:
        return self.queue.pop(0), [], 0, None

    def bind(self, _addr) -> None:
        pass

    def close(self) -> None:
        pass


def _addr(address: str, index: int, prefixlen: int = 24) -> bytes:
    m = ifaddrmsg()
    m["family"], m["prefixlen"], m["index"] = socket.AF_INET, prefixlen, index
    m["attrs"] = [["IFA_LOCAL", address], ["IFA_ADDRESS", address]]
    m.encode()
    return bytes(m.data[HDR.size:])       # the body: the header is the stand-in's


def _addresses(*addrs: str, flags: int = 0) -> list[tuple[int, int, bytes]]:
    return [(nldump.RTM_NEWADDR, flags, _addr(a, 2)) for a in addrs]


def test_an_interrupted_address_dump_is_read_again():
    # The first dump missed 192.0.2.9 (added between two of its datagrams).
    kernel = Kernel([(_addresses("192.0.2.5") + _addresses("198.51.100.1", flags=INTR), INTR),
                     (_addresses("192.0.2.5", "192.0.2.9", "198.51.100.1"), 0)])
    got = [a.get_attr("IFA_LOCAL") for a in nldump.addresses(kernel)]
    assert got == ["192.0.2.5", "192.0.2.9", "198.51.100.1"]
    assert len(kernel.requests) == 2


def test_a_dump_flagged_on_its_done_message_only_is_read_again():
    kernel = Kernel([(_addresses("192.0.2.5"), INTR), (_addresses("192.0.2.5", "192.0.2.9"), 0)])
    assert [a.get_attr("IFA_LOCAL") for a in nldump.addresses(kernel)] == ["192.0.2.5", "192.0.2.9"]


def test_a_dump_interrupted_every_time_is_an_error_not_a_partial_table():
    kernel = Kernel([(_addresses("192.0.2.5", flags=INTR), INTR)] * nldump.DUMP_TRIES)
    with pytest.raises(nldump.DumpInterrupted) as info:
        nldump.addresses(kernel, "list the host side's addresses")
    assert info.value.errno == errno.EAGAIN and "list the host side's addresses" in str(info.value)
    assert len(kernel.requests) == nldump.DUMP_TRIES


def test_a_dump_that_ends_with_an_error_is_an_error_not_a_partial_table():
    """A dump the kernel could not finish (its callback failed after the
    first datagrams: an entry too big for the buffer, no memory) ends with
    NLMSG_DONE carrying the negative errno, as iproute2 reads it."""
    kernel = Kernel([(_addresses("192.0.2.5"), 0)], done_errno=-errno.EMSGSIZE)
    with pytest.raises(OSError) as info:
        nldump.addresses(kernel, "list the host side's addresses")
    assert info.value.errno == errno.EMSGSIZE and "list the host side's addresses" in str(info.value)


def _datagrams(*datagrams: bytes) -> socket.socket:
    """A datagram socket with `datagrams` queued to read, each as sent."""
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with writer:
        for datagram in datagrams:
            writer.send(datagram)
    reader.settimeout(5)            # a reader that waits for more fails rather than hangs the run
    return reader


def _messages(seq: int, *msgs: tuple[int, int, bytes]) -> bytes:
    return b"".join(HDR.pack(HDR.size + len(body), typ, flags | NLM_F_MULTI, seq, 0) + body
                    for typ, flags, body in msgs)


def test_a_datagram_longer_than_the_read_is_an_error_not_a_shorter_table():
    """A read cuts a longer datagram where it ends, the messages past the
    cut gone with only MSG_TRUNC to say so: the dump is refused rather than
    read as a table without them."""
    first = _messages(7, *_addresses("192.0.2.5", "192.0.2.9"))
    done = _messages(7, (nldump.NLMSG_DONE, 0, struct.pack("=i", 0)))
    whole = len(_messages(7, *_addresses("192.0.2.5")))      # the read holds the first message only
    with _datagrams(first, done) as sock, pytest.raises(OSError) as info:
        list(nldump.Replies(sock, 7, "list the addresses", recv_bytes=whole))
    assert info.value.errno == errno.EMSGSIZE and "list the addresses" in str(info.value)


def test_a_message_longer_than_its_datagram_is_an_error():
    msg = _messages(7, *_addresses("192.0.2.5"))
    bad = HDR.pack(len(msg) + 64, *HDR.unpack_from(msg)[1:]) + msg[HDR.size:]
    done = _messages(7, (nldump.NLMSG_DONE, 0, struct.pack("=i", 0)))
    with _datagrams(bad, done) as sock, pytest.raises(OSError) as info:
        list(nldump.Replies(sock, 7, "list the addresses"))
    assert info.value.errno == errno.EPROTO and f"length {len(msg) + 64}" in str(info.value)


def test_the_host_side_s_addresses_come_from_a_dump_nothing_interrupted(monkeypatch):
    """Plumbing.local_addresses (the egress fences) reads the whole table again."""
    kernel = Kernel([(_addresses("192.0.2.5", flags=INTR), INTR), (_addresses("192.0.2.5", "192.0.2.9"), 0)])
    monkeypatch.setattr(plumbing, "netlink_socket", lambda *_a, **_k: kernel)
    p = object.__new__(Plumbing)
    p.ns_path = None
    assert [str(a) for a in p.local_addresses()] == ["192.0.2.5", "192.0.2.9"]
    assert len(kernel.requests) == 2


def _ct_entry(src: bytes, dst: bytes) -> bytes:
    def attr(kind: int, value: bytes, nested: bool = False) -> bytes:
        raw = struct.pack("=HH", 4 + len(value), kind | (0x8000 if nested else 0)) + value
        return raw + b"\0" * (-len(raw) % 4)

    ip = attr(1, attr(3, src) + attr(4, dst), nested=True)
    return struct.pack("=BBH", socket.AF_INET6, 0, 0) + attr(1, ip, nested=True)


def test_an_interrupted_conntrack_dump_is_read_again():
    a, b, c = (socket.inet_pton(socket.AF_INET6, f"fd00::{i}") for i in (1, 2, 3))
    new = (1 << 8) | 0                  # IPCTNL_MSG_CT_NEW
    kernel = Kernel([([(new, 0, _ct_entry(a, c))], INTR),
                     ([(new, 0, _ct_entry(a, c)), (new, 0, _ct_entry(b, c))], 0)])
    with ctdump.CtSocket(kernel) as ct:
        assert [e.src for e in ct.dump(socket.AF_INET6)] == [a, b]
    assert len(kernel.requests) == 2
    kernel = Kernel([([(new, INTR, _ct_entry(a, c))], INTR)] * nldump.DUMP_TRIES)
    with ctdump.CtSocket(kernel) as ct, pytest.raises(ctdump.CtError) as info:
        ct.dump(socket.AF_INET6)
    assert info.value.errno == errno.EAGAIN


def test_a_conntrack_dump_that_ends_with_an_error_is_an_error():
    a, c = (socket.inet_pton(socket.AF_INET6, f"fd00::{i}") for i in (1, 3))
    kernel = Kernel([([((1 << 8) | 0, 0, _ct_entry(a, c))], 0)], done_errno=-errno.ENOMEM)
    with ctdump.CtSocket(kernel) as ct, pytest.raises(ctdump.CtError) as info:
        ct.dump(socket.AF_INET6)
    assert info.value.errno == errno.ENOMEM
