"""The journal the unit tests keep in memory (journal_kit.py) holds what
the daemon's Journal (dsecd/journal.py) reads back after the same writes
and deletes."""

from __future__ import annotations

from journal_kit import MemoryJournal

from dsecd.journal import Journal


def _same_steps(journal) -> None:
    journal.write("a", {"state": "creating"})
    journal.write_many([("a", {"state": "running"}), ("b", {"state": "paused"}), ("c", {"state": "running"})])
    journal.delete("c")
    journal.delete("never-written")


def _read_back(tmp_path) -> dict[str, dict]:
    journal = Journal(tmp_path)
    try:
        return journal.load_all()
    finally:
        journal.close()


def test_a_memory_journal_holds_what_a_journal_reads_back(tmp_path):
    real, fake = Journal(tmp_path), MemoryJournal()
    try:
        _same_steps(real)
    finally:
        real.close()
    _same_steps(fake)
    assert fake.records == _read_back(tmp_path) == {"a": {"state": "running"}, "b": {"state": "paused"}}
    assert fake.deleted == ["c", "never-written"]
