"""file_stat's and file_list's mtime on a microVM (VmFiles, STAT and
LIST): from an agent that takes STAT_TS and LIST_TS the time comes as
seconds and nanoseconds, and is the float a container's os.stat gives,
past 2262 and before 1677 too; an older agent, which would ignore the
flags, is sent none and read as before."""

from __future__ import annotations

import asyncio
import os
import struct
from types import SimpleNamespace

import pytest
from vm_kit import vm_files

from dsecd.backends.microvm import wire
from dsecd.engine.vmfiles import VmFiles
from dsecd.protocol import FileList, FileStat

FAR = (10413792000, 123456789)          # 2300-01-01 00:00:00.123456789 UTC: past 2**63 ns
LONG_AGO = (-11676096000, 250000000)    # 1600-01-01 00:00:00.25 UTC: before -2**63 ns
NEAR = [(1600000000, 500000000), (-13, 500000000), (0, 1), (9223372036, 854775807), (-9223372037, 145224192)]


class _Agent:
    """A guest agent of `version` holding one file and one directory of
    mtime `when` (tv_sec, tv_nsec), answering STAT and LIST as do_stat and
    do_list in csrc/guest/agent.c do; it keeps what it was sent."""
    closed = False

    def __init__(self, version: int, when: tuple[int, int]):
        self.agent_version, self.when = version, when
        self.sent: list[tuple[int, bytes]] = []

    def _stat_fields(self, kind: str, ts: bool) -> bytes:
        sec, nsec = self.when
        head = wire.bstr(kind) + wire.u64(2) + wire.u64(0o644) + wire.u64(0) + wire.u64(0)
        if ts:              # put_stat's STAT_TS: tv_sec in two's complement, then tv_nsec
            return head + struct.pack(">qQ", sec, nsec)
        return head + wire.u64((sec * 10**9 + nsec) & (2**64 - 1))      # a uint64_t's arithmetic: wraps

    async def request(self, kind, *fields):
        body = b"".join(fields)
        self.sent.append((kind, body))
        r = wire.Reader(body)
        r.str()
        if kind == wire.STAT:
            flags = r.u64() if r.more() else 0
            ts = bool(flags & wire.STAT_TS) and self.agent_version >= wire.WIDE_STAT_AGENT_VERSION
            return wire.Reader(self._stat_fields("file", ts) + wire.u64(1) + wire.u64(2))
        assert kind == wire.LIST
        r.u64()
        flags = r.u64() if r.more() else 0
        ts = bool(flags & wire.LIST_TS) and self.agent_version >= wire.WIDE_STAT_AGENT_VERSION
        entries = b"".join(wire.bstr(name) + self._stat_fields(k, ts) for name, k in (("f", "file"), ("d", "dir")))
        return wire.Reader(entries + wire.u64(2) + wire.u64(0))


def _service(agent: _Agent) -> tuple[VmFiles, SimpleNamespace]:
    svc, _ = vm_files(agent=lambda sb: agent)
    return svc, SimpleNamespace(id="vm1", limits={"memory": 256 << 20})


def _stat_and_list(agent: _Agent) -> tuple[float, list[float]]:
    svc, sb = _service(agent)
    st = asyncio.run(svc.file_op(sb, FileStat(sandbox="vm1", path="/work/f")))
    listing = asyncio.run(svc.file_op(sb, FileList(sandbox="vm1", path="/work")))
    return st["mtime"], [e["mtime"] for e in listing["entries"]]


def _containers_mtime(tmp_path, when: tuple[int, int]) -> float:
    """What a container's file_stat gives for a file of mtime `when`: os.stat's
    st_mtime of such a file here, where the file system holds the time;
    where it clamps it (ext4 holds 1901 to 2446), CPython's own formula
    for st_mtime (fill_time: tv_sec + tv_nsec * 1e-9, in doubles)."""
    f = tmp_path / "f"
    f.touch()
    ns = when[0] * 10**9 + when[1]
    os.utime(f, ns=(ns, ns))
    st = os.stat(f)
    return st.st_mtime if st.st_mtime_ns == ns else float(when[0]) + when[1] * 1e-9


@pytest.mark.parametrize("when", [FAR, LONG_AGO, *NEAR])
def test_an_agent_of_wide_times_gives_the_mtime_a_containers_stat_does(tmp_path, when):
    """64-bit nanoseconds wrapped 2300 to 1715; told STAT_TS and LIST_TS the
    agent sends seconds and nanoseconds apart, as os.stat has them."""
    agent = _Agent(wire.WIDE_STAT_AGENT_VERSION, when)
    want = _containers_mtime(tmp_path, when)
    assert _stat_and_list(agent) == (want, [want, want])
    (stat_kind, stat_body), (list_kind, list_body) = agent.sent
    assert (stat_kind, stat_body) == (wire.STAT, wire.bstr("/work/f") + wire.u64(wire.STAT_TS))
    assert (list_kind, list_body) == (wire.LIST, wire.bstr("/work") + wire.u64(1) + wire.u64(wire.LIST_TS))


def test_a_follow_keeps_its_flag_beside_stat_ts():
    agent = _Agent(wire.WIDE_STAT_AGENT_VERSION, FAR)
    svc, sb = _service(agent)
    asyncio.run(svc.file_op(sb, FileStat(sandbox="vm1", path="/work/f", follow=True)))
    assert agent.sent == [(wire.STAT, wire.bstr("/work/f") + wire.u64(wire.STAT_FOLLOW | wire.STAT_TS))]


@pytest.mark.parametrize("version", [wire.STAT_AGENT_VERSION, wire.WIDE_STAT_AGENT_VERSION - 1])
def test_an_older_agent_is_sent_no_flag_and_read_in_nanoseconds(tmp_path, version):
    """It would ignore STAT_TS and LIST_TS and answer nanoseconds, which
    hold 1677-09-21 to 2262-04-11 (past them they wrap, and nothing in
    the value says so)."""
    for when in NEAR:
        agent = _Agent(version, when)
        want = _containers_mtime(tmp_path, when)
        assert _stat_and_list(agent) == (want, [want, want])
        assert agent.sent == [(wire.STAT, wire.bstr("/work/f") + wire.u64(0)),
                              (wire.LIST, wire.bstr("/work") + wire.u64(1))]


def test_an_agent_before_stat_flags_is_sent_none():
    agent = _Agent(wire.STAT_AGENT_VERSION - 1, NEAR[0])
    _stat_and_list(agent)
    assert agent.sent[0] == (wire.STAT, wire.bstr("/work/f"))


def test_nanoseconds_past_a_second_are_no_stat():
    """The guest is not trusted: such a field is a broken answer, not a time."""
    with pytest.raises(ValueError, match="1000000000 nanoseconds past its second"):
        wire.ts_seconds(5, 10**9)
