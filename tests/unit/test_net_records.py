"""The network record log (dsecd/net/records.py): replay, torn writes, compaction (no root)."""

from __future__ import annotations

from dsecd.net import records
from dsecd.net.records import RecordLog


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
    monkeypatch.setattr(records, "COMPACT_MIN", 10)
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
