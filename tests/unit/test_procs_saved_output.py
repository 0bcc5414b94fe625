"""A clean stop saves each background process's output ring (procs.save_ring)
and the next daemon reads it back at re-adoption (procs.output_back), so
`proc_logs` after a restart or an upgrade has what was read before. The
records and files here are as each daemon version writes them: one that
saves rings, one older that only journals how much it read (output_seen,
output_seen_at, output_seen_last), one that died (no count at all)."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest

from dsecd.engine.procs import BgProc, Ring, output_back, save_ring

SB = "3f2a9c1b7d4e"


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _record(**extra) -> dict:
    """A running process's journal record (Sandbox.procs), as readopt gets it."""
    return {"id": 7, "pid": 3, "state": "running", "argv": ["sh", "-c", "echo"], "started": 1.0,
            "inodes": [11, 12, 13], **extra}


def _stopped(loop, tmp_path, ring_bytes: int = 100) -> tuple[BgProc, dict]:
    """A process whose ring holds three lines when the daemon stops cleanly:
    its file saved and its record as ProcessService.close leaves them."""
    proc = BgProc(loop, _record(), ring_bytes)
    for i, at in enumerate((1.0, 2.0, 2.0)):
        proc.ring.append(1 if i != 1 else 2, b"line %d\n" % i, at)
    save_ring(tmp_path, SB, proc)
    rec = dict(proc.rec, output_seen=proc.ring.written, output_seen_at=proc.ring.read_until,
               output_seen_last=proc.ring.read_until_bytes)
    return proc, rec


def _output(ring: Ring) -> list[tuple[int, float, int, bytes]]:
    return ring.after(0)[1]


def test_a_ring_saved_at_a_clean_stop_is_read_back_whole(loop, tmp_path):
    before, rec = _stopped(loop, tmp_path)
    after = BgProc(loop, rec, 100)
    output_back(tmp_path, SB, after, now=10.0)
    assert _output(after.ring) == _output(before.ring)
    assert (after.ring.written, after.ring.dropped, after.ring.lost_before) == (21, 0, None)
    assert "output_seen" not in after.rec          # journaled again without it: a crash must not reuse it
    assert list(tmp_path.iterdir()) == []          # nor the file


def test_a_saved_ring_larger_than_the_new_cap_keeps_its_newest_bytes(loop, tmp_path):
    _before, rec = _stopped(loop, tmp_path)
    after = BgProc(loop, rec, 10)                  # limits.proc_output_bytes lowered across the restart
    output_back(tmp_path, SB, after, now=10.0)
    assert after.ring.written == 21 and after.ring.size <= 10
    assert b"".join(c[3] for c in _output(after.ring)) == b"line 2\n"
    assert after.ring.after(0)[0] == 14            # the rest counted as dropped


def test_the_record_of_a_daemon_that_saved_no_ring_counts_what_it_read_as_dropped(loop, tmp_path):
    """An upgrade from a daemon older than the saved rings: its record has
    the count, no file is there."""
    after = BgProc(loop, _record(output_seen=21, output_seen_at=2.0, output_seen_last=14), 100)
    output_back(tmp_path, SB, after, now=10.0)
    assert (after.ring.after(0)[0], _output(after.ring), after.ring.written) == (21, [], 21)
    assert after.ring.after(0, since=2.0)[0] == 14


def test_a_file_older_than_the_record_is_not_used(loop, tmp_path, caplog):
    """A downgrade and back: the older daemon read on past the saved ring and
    journaled its own count; the file, left by the newer one, is stale."""
    _before, rec = _stopped(loop, tmp_path)
    after = BgProc(loop, dict(rec, output_seen=40, output_seen_at=5.0, output_seen_last=19), 100)
    with caplog.at_level(logging.WARNING):
        output_back(tmp_path, SB, after, now=10.0)
    assert (after.ring.after(0)[0], _output(after.ring), after.ring.written) == (40, [], 40)
    assert "ends at byte 21, the record at 40" in caplog.text and SB in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_daemon_that_died_leaves_an_uncounted_loss_and_no_file_is_used(loop, tmp_path):
    _before, rec = _stopped(loop, tmp_path)
    for key in ("output_seen", "output_seen_at", "output_seen_last"):
        rec.pop(key)                               # re-adopted once, journaled again, then killed
    after = BgProc(loop, rec, 100)
    output_back(tmp_path, SB, after, now=10.0)
    assert (_output(after.ring), after.ring.lost_before) == ([], 10.0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", [b"\xc1", b"", msgpack.packb({"version": 99}),
                                    msgpack.packb({"version": 1, "written": 21})])
def test_a_damaged_or_foreign_file_falls_back_to_the_count(loop, tmp_path, caplog, damage):
    _before, rec = _stopped(loop, tmp_path)
    (tmp_path / f"{SB}-7").write_bytes(damage)
    after = BgProc(loop, rec, 100)
    with caplog.at_level(logging.WARNING):
        output_back(tmp_path, SB, after, now=10.0)
    assert (after.ring.after(0)[0], _output(after.ring), after.ring.written) == (21, [], 21)
    assert "background process 3" in caplog.text
