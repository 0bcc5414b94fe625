"""The sandbox registry on disk: one JSON record per sandbox, written atomically.

A record is written (temp file + rename in the same directory, optionally
fsync'ed) at each state change, so after a crash - kill -9 included - every
record is either the old or the new version, never a torn one. A restarted
daemon reads them all back and re-adopts or cleans up what they describe.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def write_file_atomic(final: Path, data: bytes, fsync: bool) -> None:
    """Replace `final` with `data`: a temp file beside it (fsync'ed if asked), renamed over it."""
    tmp = final.with_name(f".{final.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)


class Journal:
    def __init__(self, directory: Path, fsync: bool = False):
        self.dir = Path(directory)
        self.fsync = fsync
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad journal key {key!r}")
        return self.dir / f"{key}.json"

    def write(self, key: str, record: dict) -> None:
        write_file_atomic(self._path(key), json.dumps(record, sort_keys=True).encode(), self.fsync)
        if self.fsync:
            self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        if self.fsync:
            self._fsync_dir()

    def load_all(self) -> dict[str, dict]:
        """Every readable record; temp files of interrupted writes are removed."""
        out: dict[str, dict] = {}
        for entry in os.scandir(self.dir):
            if entry.name.startswith("."):
                os.unlink(entry.path)      # a write that never reached its rename
                continue
            if not entry.name.endswith(".json"):
                continue
            try:
                with open(entry.path, "rb") as f:
                    out[entry.name[:-5]] = json.load(f)
            except (OSError, ValueError) as err:
                log.error("journal record %s unreadable (%s); moving it aside", entry.path, err)
                os.rename(entry.path, entry.path + ".corrupt")
        return out
