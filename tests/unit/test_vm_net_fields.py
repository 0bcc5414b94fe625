"""The NET message's body and the link-local address the tap expects: both
must match what the guest agent (csrc/guest/agent.c do_net) and the guest's
kernel (EUI-64) make of them."""

from __future__ import annotations

import ipaddress

import pytest

from dsecd.backends.microvm import wire
from dsecd.net.policy import link_local


def _fields(body: bytes) -> list:
    r, out = wire.Reader(body), []
    out += [r.bytes(), r.u64(), r.u64(), r.u64(), r.u64()]
    while r.more():
        out += [r.bytes(), r.u64(), r.bytes()]
    return out


def test_without_an_ipv6_lease_the_body_is_the_ipv4_one():
    mac = bytes.fromhex("020a0b0c0d0e")
    body = b"".join(wire.net_fields(mac, ipaddress.IPv4Interface("10.9.4.7/16"),
                                    ipaddress.IPv4Address("10.9.0.1"), 1500))
    assert _fields(body) == [mac, int(ipaddress.IPv4Address("10.9.4.7")), 16,
                             int(ipaddress.IPv4Address("10.9.0.1")), 1500]


def test_an_ipv6_lease_trails_the_ipv4_fields():
    mac = bytes.fromhex("020a0b0c0d0e")
    v6, gw6 = ipaddress.IPv6Interface("fd00:9::407/64"), ipaddress.IPv6Address("fd00:9::1")
    body = b"".join(wire.net_fields(mac, ipaddress.IPv4Interface("10.9.4.7/16"),
                                    ipaddress.IPv4Address("10.9.0.1"), 1500, v6, gw6))
    assert _fields(body)[5:] == [v6.ip.packed, 64, gw6.packed]
    with pytest.raises(ValueError):
        wire.net_fields(mac, ipaddress.IPv4Interface("10.9.4.7/16"), ipaddress.IPv4Address("10.9.0.1"), 1500, v6)


def test_link_local_is_the_modified_eui64_of_the_mac():
    # RFC 4291 appendix A: the universal/local bit flipped, ff:fe in the middle.
    assert ipaddress.IPv6Address(link_local(bytes.fromhex("525400123456"))) == \
        ipaddress.IPv6Address("fe80::5054:ff:fe12:3456")
    assert ipaddress.IPv6Address(link_local(bytes.fromhex("020000000007"))) == \
        ipaddress.IPv6Address("fe80::ff:fe00:7")
    with pytest.raises(ValueError):
        link_local(b"\x02\x00")
