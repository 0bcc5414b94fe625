"""file_set_attrs's mtime on a microVM (VmFiles, SETATTR): the time
its guest agent sets is the one a container's os.utime gets, int(mtime *
1e9) ns, past 2262 and before 1677 too; an agent that cannot take such a
time gets no request, and the client a bad_request saying why."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from vm_kit import vm_files

from dsecd.backends.microvm import wire
from dsecd.engine.files import FileService
from dsecd.errors import BadRequest, Unsupported
from dsecd.protocol import FileSetAttrs

FAR = 10413792000.123456789         # 2300-01-01 00:00:00.123 UTC: past 2**63 ns
LONG_AGO = -11676096000.25          # 1600-01-01 00:00:00.25 UTC: before -2**63 ns
NEAR = (1600000000.5, -12.5, 9223372036.0, -9223372036.0)   # within 64-bit nanoseconds


class _Link:
    """A guest agent of `agent_version` that answers every request OK and
    keeps what it was sent."""
    closed = False

    def __init__(self, agent_version: int):
        self.agent_version = agent_version
        self.sent: list[tuple[int, bytes]] = []

    async def request(self, kind, *fields):
        self.sent.append((kind, b"".join(fields)))
        return wire.Reader(b"")


def _set_attrs(agent_version: int | _Link, **args) -> _Link:
    link = agent_version if isinstance(agent_version, _Link) else _Link(agent_version)
    svc, _ = vm_files(agent=lambda sb: link)
    sb = SimpleNamespace(id="vm1", limits={"memory": 256 << 20})
    asyncio.run(svc.file_op(sb, FileSetAttrs(sandbox="vm1", path="/work/f", **args)))
    return link


def _agent_sets(body: bytes) -> tuple[int, int, tuple[int, int] | None]:
    """What do_setattr (csrc/guest/agent.c) makes of a SETATTR's body:
    flags, mode, and the mtime as (tv_sec, tv_nsec), None if it sets none.
    The body must be all fields, no byte more."""
    r = wire.Reader(body)
    assert r.str() == "/work/f"
    flags, mode, mtime = r.u64(), r.u64(), r.u64()
    signed = mtime - 2**64 if mtime >= 2**63 else mtime
    if flags & wire.SETATTR_TS:
        nsec = r.u64()
        assert nsec < 10**9
        when = (signed, nsec)
    else:
        when = divmod(signed, 10**9)            # ns_time: floored, before 1970 too
    assert r.at == len(body)
    return flags, mode, when if flags & wire.SETATTR_MTIME else None


@pytest.mark.parametrize("mtime", [FAR, LONG_AGO, *NEAR])
def test_an_agent_of_wide_times_sets_the_time_a_containers_os_utime_does(mtime):
    """Signed nanoseconds in a u64 wrapped 2300 to 1715; told SETATTR_TS
    the agent takes seconds and nanoseconds apart, as os.utime splits them."""
    link = _set_attrs(wire.WIDE_SETATTR_AGENT_VERSION, mtime=mtime, mode=0o640)
    [(kind, body)] = link.sent
    assert kind == wire.SETATTR
    flags, mode, when = _agent_sets(body)
    assert (flags & ~wire.SETATTR_TS, mode) == (wire.SETATTR_MODE | wire.SETATTR_MTIME, 0o640)
    assert when == divmod(int(mtime * 1e9), 10**9)


def test_a_mode_alone_sends_no_time():
    [(_, body)] = _set_attrs(wire.WIDE_SETATTR_AGENT_VERSION, mode=0o600).sent
    assert _agent_sets(body) == (wire.SETATTR_MODE, 0o600, None)


@pytest.mark.parametrize("version", [wire.TIMES_AGENT_VERSION, wire.WIDE_SETATTR_AGENT_VERSION - 1])
def test_an_agent_of_64_bit_nanoseconds_gets_them_within_their_range(version):
    """No SETATTR_TS to an agent that would ignore it and take the seconds as nanoseconds."""
    for mtime in NEAR:
        [(_, body)] = _set_attrs(version, mtime=mtime).sent
        assert _agent_sets(body) == (wire.SETATTR_MTIME, 0, divmod(int(mtime * 1e9), 10**9))


@pytest.mark.parametrize("version, mtime", [(wire.ATTRS_AGENT_VERSION, FAR),
                                            (wire.TIMES_AGENT_VERSION, FAR), (wire.TIMES_AGENT_VERSION, LONG_AGO),
                                            (wire.WIDE_SETATTR_AGENT_VERSION - 1, FAR),
                                            (wire.WIDE_SETATTR_AGENT_VERSION - 1, LONG_AGO)])
def test_a_time_past_64_bit_nanoseconds_is_refused_to_an_agent_that_would_wrap_it(version, mtime):
    """Refused before anything is sent, naming the path, the time, the
    range and what to do."""
    link = _Link(version)
    with pytest.raises(BadRequest, match=rf"vm1:/work/f: mtime {mtime!r} s since 1970 is outside 1677-09-21 to "
                                         rf"2262-04-11, the times this microVM's guest agent \(version {version}\) "
                                         r"can set \(version 14 sets any\): recreate the sandbox") as exc:
        _set_attrs(link, mtime=mtime)
    assert exc.value.detail == {"path": "/work/f", "mtime": mtime, "agent_version": version}
    assert link.sent == []


def test_an_agent_of_unsigned_nanoseconds_is_still_refused_a_time_before_1970():
    with pytest.raises(Unsupported, match=r"\(version 8\) cannot set an mtime before 1970 \(version 9 can\)"):
        _set_attrs(wire.TIMES_AGENT_VERSION - 1, mtime=LONG_AGO)


def _file_service(sent: list) -> FileService:
    async def file_op(sb, req, owner=None):
        sent.append(req.mtime)
        return {"path": req.path}

    async def ensure_running(sb, why):
        pass

    svc = object.__new__(FileService)
    sb = SimpleNamespace(id="vm1", backend="microvm")
    svc.ensure_running, svc.workers = ensure_running, None
    svc.registry = SimpleNamespace(get=lambda sid, req: sb)
    svc.vm_files = SimpleNamespace(file_op=file_op)
    return svc


@pytest.mark.parametrize("mtime", [FAR, LONG_AGO, 2.0**63 - 1024, -(2.0**63 - 1024)])
def test_file_set_attrs_takes_any_time_a_time_t_holds(mtime):
    """It refused past +-9223372036 s (64-bit nanoseconds), times a
    container's os.utime and a copy in set; the file system clamps."""
    sent: list = []
    asyncio.run(_file_service(sent).set_attrs(FileSetAttrs(sandbox="vm1", path="/f", mtime=mtime), None))
    assert sent == [mtime]


@pytest.mark.parametrize("mtime", [2.0**63, -(2.0**63), 1e20, float("inf"), float("nan")])
def test_file_set_attrs_refuses_a_time_no_time_t_holds(mtime):
    sent: list = []
    with pytest.raises(BadRequest, match=r"vm1:/f: mtime must be seconds since the epoch that a time_t holds"):
        asyncio.run(_file_service(sent).set_attrs(FileSetAttrs(sandbox="vm1", path="/f", mtime=mtime), None))
    assert sent == []
