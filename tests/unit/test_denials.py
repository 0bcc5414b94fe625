"""dsecd/denials.py decodes the records of bpf/policy_denials.c; dsecd/btf.py
reads struct member offsets from BTF (the kernel side is in
tests/integration/test_task_policies.py)."""

from __future__ import annotations

import socket
import struct

import pytest

from dsecd import btf, denials

REC = struct.Struct("=QQIiII6Q16s256s128s128s")


def record(nr: int, ret: int = -13, args=(0,) * 6, path=b"", path2=b"", addr=b"", comm=b"cat") -> bytes:
    return REC.pack(77, (4242 << 32) | 4243, 5, ret, nr, 0, *args, comm, path, path2, addr)


def test_record_size_matches_the_program():
    assert REC.size == denials._RECORD.size == 608


def test_open_of_a_hidden_file():
    d = denials.decode(record(257, args=(2**32 - 100, 0, 0, 0, 0, 0), path=b"/grader/secret"))
    assert (d.cgroup, d.pid, d.session, d.comm, d.syscall, d.errno) == (77, 4242, 5, "cat", "openat", "EACCES")
    assert d.public() == {"syscall": "openat", "errno": "EACCES", "comm": "cat", "path": "/grader/secret"}


def test_a_relative_path_names_its_dirfd():
    d = denials.decode(record(257, args=(3, 0, 0, 0, 0, 0), path=b"secret"))
    assert d.detail == {"path": "secret", "dirfd": 3}


def test_rename_carries_both_paths():
    d = denials.decode(record(316, args=(2**32 - 100, 0, 2**32 - 100, 0, 0, 0), path=b"/etc/passwd",
                              path2=b"/workspace/p"))
    assert d.detail == {"path": "/etc/passwd", "path2": "/workspace/p"}


def test_connect_addresses():
    v4 = struct.pack("<H", socket.AF_INET) + struct.pack(">H", 9000) + socket.inet_aton("127.0.0.1")
    assert denials.decode(record(42, addr=v4)).detail == {"address": "127.0.0.1:9000"}
    v6 = (struct.pack("<H", socket.AF_INET6) + struct.pack(">H", 443) + b"\0" * 4
          + socket.inet_pton(socket.AF_INET6, "::1"))
    assert denials.decode(record(42, addr=v6)).detail == {"address": "[::1]:443"}
    abstract = struct.pack("<H", socket.AF_UNIX) + b"\0grader-sock"
    assert denials.decode(record(42, ret=-1, addr=abstract)).public()["address"] == "unix:@grader-sock"
    assert denials.decode(record(42, ret=-1, addr=abstract)).errno == "EPERM"


def test_kill_names_target_and_signal():
    d = denials.decode(record(62, ret=-1, args=(17, 9, 0, 0, 0, 0)))
    assert d.detail == {"target": 17, "signal": 9}
    assert denials.decode(record(234, ret=-1, args=(17, 18, 15, 0, 0, 0))).detail == {"target": 18, "signal": 15}


@pytest.mark.parametrize("nr,kind", [(257, "file"), (59, "file"), (316, "file"), (77, "file"), (42, "socket"),
                                     (49, "socket"), (46, "socket"), (62, "signal"), (424, "signal"),
                                     (999, "other")])
def test_kind_of_call(nr, kind):
    assert denials.decode(record(nr)).kind == kind


def test_every_reported_syscall_has_a_kind():
    assert {denials.kind_of(name) for name in denials.SYSCALLS.values()} == set(denials.KINDS)


def test_short_records_are_dropped():
    assert denials.decode(b"\0" * 100) is None


def _btf(structs: dict[str, list[tuple[str, int]]]) -> bytes:
    """A BTF blob of an int and the given structs (members: name, byte offset)."""
    strings = b"\0"
    names: dict[str, int] = {}

    def s(n: str) -> int:
        nonlocal strings
        if n not in names:
            names[n] = len(strings)
            strings += n.encode() + b"\0"
        return names[n]

    types = struct.pack("<III", s("int"), 1 << 24, 4) + struct.pack("<I", 32)     # INT, id 1
    for name, members in structs.items():
        types += struct.pack("<III", s(name), (4 << 24) | len(members), 64)
        for m, off in members:
            types += struct.pack("<III", s(m) if m else 0, 1, off * 8)
    hdr = struct.pack("<HBBIIIII", btf.MAGIC, 1, 0, 24, 0, len(types), len(types), len(strings))
    return hdr + types + strings


def test_btf_offsets_of_named_members(tmp_path):
    path = tmp_path / "vmlinux"
    path.write_bytes(_btf({"pid": [("", 0), ("level", 4), ("numbers", 48)], "upid": [("nr", 0)]}))
    got = btf.offsets({"pid": ("level", "numbers"), "upid": ("nr",)}, path)
    assert got == {"pid": {btf.SIZE: 64, "level": 4, "numbers": 48}, "upid": {btf.SIZE: 64, "nr": 0}}
    with pytest.raises(btf.BtfError, match="no member numbers"):
        btf.offsets({"upid": ("numbers",)}, path)
    with pytest.raises(btf.BtfError, match="no struct task_struct"):
        btf.offsets({"task_struct": ("signal",)}, path)


def test_btf_missing_or_corrupt(tmp_path):
    with pytest.raises(btf.BtfError, match="CONFIG_DEBUG_INFO_BTF"):
        btf.offsets({"pid": ("level",)}, tmp_path / "none")
    (tmp_path / "bad").write_bytes(b"\0" * 64)
    with pytest.raises(btf.BtfError, match="bad magic"):
        btf.offsets({"pid": ("level",)}, tmp_path / "bad")
