"""The record logs (dsecd/journal.py): replay, torn writes, compaction, the
sandbox journal and its migration from a file per record (no root)."""

from __future__ import annotations

import json
import threading

import pytest

from dsecd import journal
from dsecd.journal import Journal, RecordLog, read_records


def test_last_record_wins_and_deletes_replay(tmp_path):
    path = tmp_path / "records.log"
    log = RecordLog(path)
    log.put("a", {"terms": ["pypi"]})
    log.put("b", {"terms": []})
    log.put("a", {"terms": ["dns"]})
    log.delete("b")
    log.delete("never-there")          # no line for an unknown id
    log.close()
    again = RecordLog(path)
    assert again.records == {"a": {"terms": ["dns"]}}
    assert again.lines == 4


def test_torn_write_is_skipped_and_does_not_swallow_the_next(tmp_path):
    path = tmp_path / "records.log"
    log = RecordLog(path)
    log.put("a", {"n": 1})
    log.close()
    with open(path, "ab") as f:
        f.write(b'\n{"id":"b","r":{"n":')          # a write cut short by a crash
    log = RecordLog(path)
    log.put("c", {"n": 3})                          # starts with its own newline
    log.close()
    assert RecordLog(path).records == {"a": {"n": 1}, "c": {"n": 3}}


def test_compaction_keeps_live_records_only(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "COMPACT_MIN", 10)
    path = tmp_path / "records.log"
    log = RecordLog(path)
    for i in range(12):
        log.put("a", {"n": i})
    log.put("b", {"n": 0})
    assert log.needs_compaction()
    log.compact()
    assert not log.needs_compaction() and log.lines == 2
    log.put("b", {"n": 1})                          # appends to the new file
    log.close()
    assert RecordLog(path).records == {"a": {"n": 11}, "b": {"n": 1}}
    assert not list(tmp_path.glob(".*"))


def test_compaction_runs_behind_the_writer_once_needed(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "COMPACT_MIN", 10)
    started: list[threading.Thread] = []

    def in_thread(work):
        t = threading.Thread(target=work)
        started.append(t)
        t.start()

    log = RecordLog(tmp_path / "records.log", compact_with=in_thread)
    for i in range(11):
        log.put(f"k{i % 3}", {"n": i})
    assert len(started) == 1                        # the 11th line crossed max(10, 2 x 3)
    started[0].join()
    assert log.lines == 3 and not log.needs_compaction()
    log.put("k0", {"n": 99})
    log.close()
    assert read_records(tmp_path / "records.log") == {"k0": {"n": 99}, "k1": {"n": 10}, "k2": {"n": 8}}


def test_compaction_after_close_leaves_the_log_alone(tmp_path):
    log = RecordLog(tmp_path / "records.log")
    log.put("a", {"n": 1})
    log.close()
    log.compact()                                   # a compaction that lost the race with shutdown
    assert read_records(tmp_path / "records.log") == {"a": {"n": 1}}


def test_journal_write_load_delete(tmp_path):
    j = Journal(tmp_path, fsync=True)
    j.write("abc", {"state": "running"})
    j.write("abc", {"state": "dead"})
    j.write("def", {"state": "creating"})
    assert j.load_all() == {"abc": {"state": "dead"}, "def": {"state": "creating"}}
    j.delete("abc")
    j.delete("abc")     # idempotent
    assert set(j.load_all()) == {"def"}
    j.close()
    assert Journal(tmp_path).load_all() == {"def": {"state": "creating"}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.log"]


def test_journal_moves_records_of_a_file_per_record_daemon_into_the_log(tmp_path):
    old = tmp_path / "journal"
    old.mkdir()
    (old / "abc.json").write_text(json.dumps({"state": "running"}))
    (old / ".def.json.tmp").write_text('{"state": "dea')          # a write that never reached its rename
    (old / "bad.json").write_text("{not json")
    j = Journal(tmp_path)
    assert j.load_all() == {"abc": {"state": "running"}}
    assert not old.exists()
    assert (tmp_path / "journal.corrupt" / "bad.json").read_text() == "{not json"   # kept for a human
    j.close()
    assert read_records(tmp_path / "journal.log") == {"abc": {"state": "running"}}


def test_appends_during_a_compaction_are_kept(tmp_path, monkeypatch):
    log = RecordLog(tmp_path / "records.log")
    for i in range(200):
        log.put(f"k{i}", {"n": i})
    real_write_all = journal._write_all
    started = threading.Event()
    go_on = threading.Event()

    def slow_write_all(fd, data, path):      # the bulk copy waits while writers go on
        if not started.is_set():
            started.set()
            go_on.wait(5)
        real_write_all(fd, data, path)

    monkeypatch.setattr(journal, "_write_all", slow_write_all)
    t = threading.Thread(target=log.compact)
    t.start()
    started.wait(5)
    for i in range(0, 200, 2):
        log.put(f"k{i}", {"n": -i})              # updated while the copy is in flight
    log.delete("k1")
    log.put("new", {"n": 1})
    go_on.set()
    t.join()
    log.put("after", {"n": 2})
    log.close()
    assert read_records(tmp_path / "records.log") == log.records
    assert log.records["k0"] == {"n": 0} and log.records["k2"] == {"n": -2} and "k1" not in log.records
    assert not list(tmp_path.glob(".*"))


def test_a_short_write_is_an_error_not_a_truncated_log(tmp_path, monkeypatch):
    log = RecordLog(tmp_path / "records.log")
    log.put("a", {"n": 1})
    calls = []

    def short_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return len(data)

    monkeypatch.setattr(journal.os, "write", short_then_full)
    with pytest.raises(OSError) as exc:
        log.compact()
    assert exc.value.errno == 28 and "records.log" in str(exc.value)
    monkeypatch.undo()
    log.close()
    assert read_records(tmp_path / "records.log") == {"a": {"n": 1}}
    assert not list(tmp_path.glob(".*"))


def test_many_records_go_in_one_write_and_replay(tmp_path, monkeypatch):
    j = Journal(tmp_path)
    writes = []
    real_write = journal.os.write
    monkeypatch.setattr(journal.os, "write", lambda fd, data: writes.append(len(data)) or real_write(fd, data))
    j.write_many([(f"sb{i}", {"state": "paused", "n": i}) for i in range(50)])
    assert len(writes) == 1
    j.close()
    assert Journal(tmp_path).load_all() == {f"sb{i}": {"state": "paused", "n": i} for i in range(50)}


def test_a_bad_key_in_a_batch_writes_none_of_it(tmp_path):
    j = Journal(tmp_path)
    with pytest.raises(ValueError, match="bad journal key"):
        j.write_many([("ok", {"a": 1}), ("bad\nkey", {"a": 2})])
    assert j.load_all() == {}


def test_network_records_of_a_file_per_record_daemon_keep_the_unreadable_ones(tmp_path):
    """As the journal's: the network's old records (a file per sandbox and
    leases.json) move into its log with their address; one that does not
    parse is set aside for a human, not deleted."""
    import ipaddress
    from types import SimpleNamespace

    from dsecd.journal import RecordLog
    from dsecd.net.network import Network

    old = tmp_path / "sandboxes"
    old.mkdir()
    (old / "abc.json").write_text(json.dumps({"mode": "default"}))
    (old / "bad.json").write_text("{not json")
    (tmp_path / "leases.json").write_text(json.dumps({"leases": {"abc": "10.88.0.5"}}))
    net = object.__new__(Network)
    net.records = RecordLog(tmp_path / "records.log")
    net.ipam = SimpleNamespace(subnet=ipaddress.ip_network("10.88.0.0/16"))
    net._migrate(tmp_path)
    net.records.close()
    rec = read_records(tmp_path / "records.log")["abc"]
    assert rec["ipv4"] == "10.88.0.5/16" and rec["ifname"]
    assert (tmp_path / "sandboxes.corrupt" / "bad.json").read_text() == "{not json"
    assert not old.exists() and not (tmp_path / "leases.json").exists()


def test_a_close_does_not_wait_for_ever_on_a_compaction_holding_the_log(tmp_path, caplog):
    """A compaction stuck in its fsync (a hung disk) holds the log's lock:
    the stop's close waits `timeout` at most, leaves the fd to the exit,
    and says so. What was appended is in the file already."""
    import logging

    log = RecordLog(tmp_path / "journal.log")
    log.put("a", {"state": "running"})
    held, release = threading.Event(), threading.Event()

    def compaction() -> None:
        with log._lock:
            held.set()
            release.wait()

    t = threading.Thread(target=compaction)
    t.start()
    try:
        held.wait(5)
        with caplog.at_level(logging.WARNING, logger="dsecd.journal"):
            log.close(timeout=0.05)
        assert "an append or compaction still holds it after 0.1 s" in caplog.text
        assert read_records(tmp_path / "journal.log") == {"a": {"state": "running"}}
    finally:
        release.set()
        t.join(5)
    log.close(timeout=5)
    assert log._fd == -1
