"""The pieces of dsecd/engine/procs.py that need no sandbox: the output
ring's bounds and drop counts, signal names, and the order a microVM
process's inputs take its stdin in."""

from __future__ import annotations

import asyncio
import signal
import struct

import pytest

from dsecd.engine.procs import Ring
from dsecd.errors import BadRequest
from dsecd.execio import parse_signal


def test_ring_keeps_the_latest_bytes_and_counts_the_rest():
    ring = Ring(10)
    for i in range(5):
        ring.append(1, b"%d%d%d" % (i, i, i), float(i))
    assert ring.size <= 10 and ring.written == 15
    lost, chunks = ring.after(0)
    assert lost == ring.dropped == 15 - ring.size == 6
    assert b"".join(c[3] for c in chunks) == b"222333444"


def test_ring_keeps_the_tail_of_a_chunk_larger_than_itself():
    ring = Ring(4)
    ring.append(2, b"abcdefgh", 1.0)
    lost, chunks = ring.after(0)
    assert (lost, [c[3] for c in chunks], ring.dropped) == (4, [b"efgh"], 4)


def test_a_follower_reads_from_where_it_was():
    ring = Ring(100)
    ring.append(1, b"one\n", 1.0)
    _, chunks = ring.after(0)
    pos = chunks[-1][0] + len(chunks[-1][3])
    ring.append(2, b"two\n", 2.0)
    lost, chunks = ring.after(pos)
    assert (lost, [(c[2], c[3]) for c in chunks]) == (0, [(2, b"two\n")])


def test_a_vm_agents_pushes_repeat_and_skip_by_offset():
    """Ring.put: a re-attach repeats what the ring has (kept once), a gap
    (bytes the agent's own ring dropped) counts as dropped."""
    ring = Ring(100)
    ring.put(0, 1, b"abc", 1.0)
    ring.put(0, 1, b"abcdef", 2.0)               # repeated from offset 0: only "def" is new
    ring.put(3, 1, b"def", 2.0)                  # all seen
    assert ring.written == 6 and b"".join(c[3] for c in ring.after(0)[1]) == b"abcdef"
    ring.put(10, 2, b"xyz", 3.0)                 # bytes 6..9 fell out of the agent's ring
    lost, chunks = ring.after(0)
    assert (ring.written, ring.dropped, lost, [c[3] for c in chunks]) == (13, 10, 10, [b"xyz"])


def test_bytes_dropped_before_what_a_follower_asks_since_are_not_reported_lost():
    """A follower that resumes with `since` (the time of the last chunk it
    got) asked for nothing older: bytes that fell out of the ring before
    that time are no loss to it, while a newer one is."""
    ring = Ring(10)
    for i in range(5):
        ring.append(1, b"%d%d%d" % (i, i, i), float(i))      # "000" and "111" fall out
    assert ring.after(0, since=2.0)[0] == 0
    assert ring.after(0, since=1.0)[0] == 3                # "111" was read at 1.0: asked for, lost
    assert ring.after(0, since=0.5)[0] == 6                # at most "000" and "111": times not kept
    assert ring.after(0)[0] == 6
    assert ring.after(4, since=1.0)[0] == 2                # past "000" and "1": "11" lost


def test_a_follower_since_the_time_of_the_newest_bytes_dropped_is_told_of_those_only():
    """`since` is inclusive: since exactly the time the newest of the
    bytes that fell out were read, those bytes were asked for and are lost,
    the older ones were not. A daemon that stopped cleanly journals how many
    it read at its last time (skip_to's `last`)."""
    ring = Ring(8)
    ring.append(1, b"aaaa", 1.0)
    ring.append(1, b"bb", 2.0)
    ring.append(2, b"cc", 2.0)
    ring.append(1, b"dddddddd", 3.0)          # all three fall out
    assert ring.after(0, since=2.0)[0] == 4 and ring.after(0, since=2.5)[0] == 0
    ring = Ring(100)
    ring.append(1, b"aaaa", 1.0)
    ring.append(1, b"bb", 2.0)
    ring.append(2, b"cc", 2.0)
    assert (ring.read_until, ring.read_until_bytes) == (2.0, 4)
    stopped = Ring(100)
    stopped.skip_to(ring.written, ring.read_until, ring.read_until_bytes)
    assert stopped.after(0, since=2.0)[0] == 4 and stopped.after(0, since=1.0)[0] == 8
    unknown = Ring(100)
    unknown.skip_to(8, 2.0)                   # by a daemon that did not say how many: all of it
    assert unknown.after(0, since=2.0)[0] == 8


def test_what_a_stopped_daemon_read_is_no_loss_to_a_follower_since_later():
    """skip_to: the output a daemon that stopped cleanly read went with it,
    up to the time it read the last of it; unknown time: always reported."""
    ring = Ring(100)
    ring.skip_to(24, 5.0)
    assert ring.after(0, since=5.5)[0] == 0 and ring.after(0, since=4.0)[0] == 24
    ring = Ring(100)
    ring.skip_to(24)
    assert ring.after(0, since=5.5)[0] == 24


@pytest.mark.parametrize("given, want", [("KILL", 9), ("sigterm", 15), ("9", 9), (2, 2), (" HUP ", 1)])
def test_signals_by_name_or_number(given, want):
    assert parse_signal(given) == signal.Signals(want)


@pytest.mark.parametrize("given", ["NOPE", "0x9", "999", "", "SIG"])
def test_unknown_signals_are_bad_requests(given):
    with pytest.raises(BadRequest, match="unknown signal"):
        parse_signal(given)


def test_a_vm_process_request_takes_the_channel_every_vm_op_takes():
    """Start, input and kill reach a microVM's agent through
    MicroVMService.agent, the call that wakes a ballooned VM for an op."""
    from types import SimpleNamespace

    from dsecd.engine.vmprocs import VmProcs

    asked, link, sb = [], object(), object()
    procs = VmProcs(SimpleNamespace(vms=SimpleNamespace(agent=lambda s: asked.append(s) or link)))
    assert procs._link(sb) is link and asked == [sb]


def _vm_process_service(attach: asyncio.Future):
    """A ProcessService with one running microVM process (sandbox "vm", pid
    7, stdin open), whose agent takes inputs as agent.c's do_proc_input
    does: an offset past what it took is refused, what it took is skipped.
    The attach of the VM's current channel runs until `attach` is done."""
    from types import SimpleNamespace

    from dsecd.backends.microvm import wire
    from dsecd.engine.procs import BgProc, ProcessService, ProcLimits

    loop = asyncio.get_running_loop()
    sb = SimpleNamespace(id="vm", backend="microvm")
    taken = bytearray()

    class Agent:
        async def request(self, kind, pid, offset, eof, data):
            assert kind == wire.PROC_INPUT
            await asyncio.sleep(0)                  # the channel's round trip
            at, data = struct.unpack(">Q", offset)[0], data[4:]
            if at > len(taken):
                raise AssertionError(f"input at offset {at} past the {len(taken)} bytes taken")
            taken.extend(data[len(taken) - at:])

    async def running(_sb, _why):
        pass

    svc = ProcessService(SimpleNamespace(get=lambda _name, _req=None: sb), SimpleNamespace(loop=loop), None,
                         running, ProcLimits(1 << 16, 3, 1.0), None, SimpleNamespace(agent=lambda _sb: Agent()))
    svc.tables["vm"] = {7: BgProc(loop, {"pid": 7, "state": "running", "vm": True, "argv": ["cat"]}, 1 << 16)}
    svc.vm.attaching["vm"] = attach
    return svc, taken


def test_vm_inputs_take_the_stdin_in_the_order_they_came_across_the_end_of_an_attach():
    """An input that came while the attach of a VM's new channel ran waits
    for it; the next one, come just as it ended, waited for nothing and
    took the process's stdin first: refused as past the bytes written."""
    from dsecd.protocol import ProcInput

    async def go():
        attach = asyncio.get_running_loop().create_future()
        svc, taken = _vm_process_service(attach)
        first = asyncio.ensure_future(svc.input(ProcInput(sandbox="vm", pid=7, data=b"one ", offset=0), None))
        await asyncio.sleep(0)                      # it waits for the attach
        attach.set_result(None)
        second = asyncio.ensure_future(svc.input(ProcInput(sandbox="vm", pid=7, data=b"two", offset=4), None))
        answers = await asyncio.gather(first, second)
        assert [a["skipped"] for a in answers] == [0, 0] and bytes(taken) == b"one two"
        assert not svc._input_turns                 # none kept once they are through

    asyncio.run(go())
