"""The daemon's structured log records in a test: each record the daemon
logs with `extra={"fields": {"event": ...}}` (dsecd/logs.py) carries its
event name in `record.fields`."""

from __future__ import annotations

import logging


def records_of(caplog, event: str) -> list[logging.LogRecord]:
    """The records pytest's caplog captured whose event is `event`."""
    return [r for r in caplog.records if getattr(r, "fields", {}).get("event") == event]
