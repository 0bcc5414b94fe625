"""Member offsets of kernel structs, read from the kernel's own BTF
(/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF).

bcc compiles BPF programs against the kernel headers it finds, which on a
host whose kernel has no headers package are another version's (this CI
kernel: Debian's 6.1 headers for a 6.18 kernel), so a program must not
take a struct layout from them. The few offsets the denial monitor needs
(dsecd/denials.py) come from here instead and are passed as -D constants;
the compiled object's cache key includes them.

The file is parsed once (about 0.5 s of Python for 5 MB); `offsets` stops at
the last struct it was asked for.
"""

from __future__ import annotations

import struct
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")
MAGIC = 0xEB9F
_HEADER = struct.Struct("<HBBIIIII")      # magic, version, flags, hdr_len, type_off, type_len, str_off, str_len
_TYPE = struct.Struct("<III")             # name_off, info, size or type
_MEMBER = struct.Struct("<III")           # name_off, type, offset (bits; with kind_flag: bitfield size << 24)

STRUCT, UNION = 4, 5
# Bytes that follow a struct btf_type, by kind, apart from its vlen entries.
_EXTRA = {1: 4, 3: 12, 14: 4, 17: 4}      # INT, ARRAY, VAR, DECL_TAG
_PER_VLEN = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}   # STRUCT, UNION, ENUM, FUNC_PROTO, DATASEC, ENUM64


SIZE = "sizeof"                           # the key of a struct's own size in `offsets`' answer


class BtfError(OSError):
    pass


def offsets(wanted: dict[str, tuple[str, ...]], path: Path = VMLINUX) -> dict[str, dict[str, int]]:
    """{struct: {member: byte offset, SIZE: the struct's size}} for each
    wanted struct and top-level member (one inside an anonymous struct or
    union is not found). BtfError if the file is missing or malformed, or a
    struct or member is not in it."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise BtfError(err.errno, f"read kernel BTF {path}: {err.strerror}; the kernel needs "
                                  "CONFIG_DEBUG_INFO_BTF") from err
    if len(data) < _HEADER.size:
        raise BtfError(22, f"kernel BTF {path}: {len(data)} bytes, shorter than its header")
    magic, _ver, _flags, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BtfError(22, f"kernel BTF {path}: bad magic {magic:#x}")
    types = memoryview(data)[hdr_len + type_off:hdr_len + type_off + type_len]
    strs = data[hdr_len + str_off:hdr_len + str_off + str_len]

    def name(off: int) -> str:
        return strs[off:strs.index(b"\0", off)].decode()

    want_names = {n.encode() for n in wanted}
    found: dict[str, dict[str, int]] = {}
    off = 0
    while off + _TYPE.size <= len(types) and len(found) < len(wanted):
        name_off, info, size = _TYPE.unpack_from(types, off)
        kind, vlen, kind_flag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        off += _TYPE.size
        if kind in (STRUCT, UNION) and name_off:
            n = strs[name_off:strs.index(b"\0", name_off)]
            if n in want_names and n.decode() not in found:
                members = {SIZE: size}
                for i in range(vlen):
                    m_name, _m_type, m_off = _MEMBER.unpack_from(types, off + i * _MEMBER.size)
                    bits = m_off & 0xFFFFFF if kind_flag else m_off
                    if m_name:               # anonymous members are not looked into
                        members[name(m_name)] = bits // 8
                found[n.decode()] = members
        off += _PER_VLEN.get(kind, 0) * vlen + _EXTRA.get(kind, 0)
    out = {}
    for struct_name, members in wanted.items():
        have = found.get(struct_name)
        if have is None:
            raise BtfError(2, f"kernel BTF {path}: no struct {struct_name}")
        missing = [m for m in members if m not in have]
        if missing:
            raise BtfError(2, f"kernel BTF {path}: struct {struct_name} has no member {', '.join(missing)}")
        out[struct_name] = {SIZE: have[SIZE], **{m: have[m] for m in members}}
    return out
