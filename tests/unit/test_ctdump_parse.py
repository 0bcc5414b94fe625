"""ctdump's parse of a ctnetlink entry's attributes, on hand-built bytes."""

from __future__ import annotations

import socket
import struct

from dsecd.net import ctdump


def _attr(kind: int, value: bytes, nested: bool = False) -> bytes:
    raw = struct.pack("=HH", 4 + len(value), kind | (0x8000 if nested else 0)) + value
    return raw + b"\0" * (-len(raw) % 4)


def _entry_body(src: bytes, dst: bytes, ids: bytes = b"") -> bytes:
    """Addresses of 4 bytes as IPv4's attributes, of 16 as IPv6's."""
    s_attr, d_attr = (1, 2) if len(src) == 4 else (3, 4)
    ip = _attr(1, _attr(s_attr, src) + _attr(d_attr, dst), nested=True)
    proto = _attr(2, _attr(1, b"\x06"), nested=True)
    return _attr(1, ip + proto, nested=True) + _attr(3, b"\0\0\0\x0a") + ids


def test_the_original_tuples_addresses_and_the_delete_key():
    src, dst = socket.inet_pton(socket.AF_INET6, "fd00::7"), socket.inet_pton(socket.AF_INET6, "fd01::1")
    ident = _attr(12, b"\0\0\0\x2a")
    body = _entry_body(src, dst, ident)
    entry = ctdump.parse_entry(body, 0, len(body), socket.AF_INET6)
    assert (entry.src, entry.dst) == (src, dst)
    # The key is the original tuple and the id as sent: not the status.
    tuple_orig = body[:body.index(_attr(3, b"\0\0\0\x0a"))]
    assert entry.key == tuple_orig + ident


def test_an_entry_without_both_addresses_is_none():
    body = _attr(1, _attr(1, _attr(3, b"\0" * 16), nested=True), nested=True)
    assert ctdump.parse_entry(body, 0, len(body), socket.AF_INET6) is None


def test_a_zero_length_or_cut_attribute_ends_the_parse():
    src, dst = b"\x0a\0\0\x02", b"\x0a\0\0\x03"
    body = struct.pack("=HH", 0, 1) + _entry_body(src, dst)
    assert ctdump.parse_entry(body, 0, len(body), socket.AF_INET) is None
    whole = _entry_body(src, dst)
    tuple_len = len(whole) - 8                          # the status attribute is 8 bytes
    assert ctdump.parse_entry(whole, 0, len(whole) - 3, socket.AF_INET).src == src     # only the status cut
    assert ctdump.parse_entry(whole, 0, tuple_len - 2, socket.AF_INET) is None       # the tuple cut
