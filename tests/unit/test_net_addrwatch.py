"""Which address notifications wake the fences' refresh (dsecd/net/addrwatch.py)."""

import struct

from dsecd.net import addrwatch as W

RTM_NEWLINK = 16


def _msg(kind: int, scope: int, family: int = 2) -> bytes:
    body = W._IFADDRMSG.pack(family, 32, 0, scope, 7) + b"\x08\x00\x01\x00\xc6\x12\x4d\x01"   # IFA_ADDRESS
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 0, 0) + body


def test_a_global_or_site_address_added_or_removed_wakes_it():
    assert W.fenceable_change(_msg(W.RTM_NEWADDR, 0))
    assert W.fenceable_change(_msg(W.RTM_DELADDR, 0, family=10))
    assert W.fenceable_change(_msg(W.RTM_NEWADDR, W.RT_SCOPE_SITE))


def test_link_local_and_host_addresses_and_other_messages_do_not():
    assert not W.fenceable_change(_msg(W.RTM_NEWADDR, 253, family=10))     # a veth's fe80::
    assert not W.fenceable_change(_msg(W.RTM_NEWADDR, 254))                # loopback's
    assert not W.fenceable_change(_msg(RTM_NEWLINK, 0))
    assert not W.fenceable_change(b"")


def test_every_message_of_a_datagram_is_read():
    assert W.fenceable_change(_msg(W.RTM_NEWADDR, 253) + _msg(W.RTM_NEWADDR, 0))
    assert not W.fenceable_change(_msg(W.RTM_NEWADDR, 253) * 3)


def test_a_malformed_length_stops_the_reading():
    assert not W.fenceable_change(struct.pack("=IHHII", 0, W.RTM_NEWADDR, 0, 0, 0) + _msg(W.RTM_NEWADDR, 0))
