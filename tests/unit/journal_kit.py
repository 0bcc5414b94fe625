"""A journal kept in memory, for unit tests of services over a
SandboxRegistry that need no state dir."""

from __future__ import annotations


class MemoryJournal:
    """What dsecd/journal.py's Journal does for the registry (write,
    write_many, delete), in memory: `records` holds each key's record as
    last written (the object given, not a copy), `deleted` the keys deleted,
    in order."""

    def __init__(self):
        self.records: dict[str, dict] = {}
        self.deleted: list[str] = []

    def write(self, key: str, record: dict) -> None:
        self.records[key] = record

    def write_many(self, items: list[tuple[str, dict]]) -> None:
        for key, record in items:
            self.write(key, record)

    def delete(self, key: str) -> None:
        self.records.pop(key, None)
        self.deleted.append(key)
