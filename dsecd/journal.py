"""Records on disk that must survive a crash: append-only logs of JSON lines.

Two logs use this: the sandbox registry (`Journal`, <state_dir>/journal.log,
a record per sandbox, written at each state change) and the network's
records (dsecd/net/network.py, <state_dir>/net/records.log).

Why a log and not a file per record replaced by rename (what the journal
once was): creating a file is a metadata change on the host's
filesystem. On ext4 every new inode is searched for past the inodes deleted
in the last 5 minutes (ext4's `recently_deleted`), so after a burst of
destroys each create paid a scan: 10% of a 1,500-sandbox burst's CPU went to
`find_inode_bit`. Measured on the 2-core CI VM under load, temp + rename took
0.5 ms p50 and 8.5 ms p99, an O_APPEND write() of the same bytes 5 us p50
and 25 us p99. A line is written before the answer that depends on it leaves
(with `fsync`, also fdatasync'ed), so nothing answered is lost.

Format: each record is "\\n" + JSON {"id": ..., "r": record-or-null} (null =
deleted); the newline comes *first* so that a write torn by a crash or a full
disk is closed off by the next record instead of swallowing it. On load the
lines are replayed in order, the last one per id wins, and a line that does
not parse (a torn write: never answered) is skipped with a warning.

The log is compacted (live records written to a temp file, renamed over the
log: atomic) once it holds more than max(COMPACT_MIN, 2 x live) lines, off
the caller's thread, so no request pays for it.

Each append is counted, and its fdatasync timed, in the metrics
(dsecd_journal_appends_total, dsecd_journal_fsync_seconds), labelled by the
log's file name without its suffix: `journal` or `records` (the network's).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from . import metrics

log = logging.getLogger(__name__)

COMPACT_MIN = 1024


def write_file_atomic(final: Path, data: bytes, fsync: bool) -> None:
    """Replace `final` with `data`: a temp file beside it (fsync'ed if asked), renamed over it."""
    tmp = final.with_name(f".{final.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, data, tmp)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)


def _write_all(fd: int, data: bytes, path: Path) -> None:
    """Every byte, or OSError naming the file (a short write on a full disk is not success)."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except OSError as err:
            raise OSError(err.errno, f"write `{path}`: {err.strerror}") from err
        view = view[n:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _line(key: str, record: dict | None) -> bytes:
    return b"\n" + json.dumps({"id": key, "r": record}, separators=(",", ":")).encode()


def read_records(path: Path) -> dict[str, dict]:
    """The live records of a log, read only (for tools and tests); {} if there is none."""
    records: dict[str, dict] = {}
    _replay(Path(path), records)
    return records


def _replay(path: Path, records: dict[str, dict]) -> int:
    """Apply the log's lines to `records`; the number of lines."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    lines = 0
    for n, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        lines += 1
        try:
            obj = json.loads(line)
            key, rec = obj["id"], obj["r"]
        except (ValueError, KeyError, TypeError) as err:
            log.warning("%s line %d unreadable (a write torn by a crash?): %s; skipped", path, n, err)
            continue
        if rec is None:
            records.pop(key, None)
        else:
            records[key] = rec
    return lines


# Every RecordLog of the process, for hold_all_for_exit.
_LOGS: weakref.WeakSet = weakref.WeakSet()


def hold_all_for_exit() -> list[str]:
    """At an exit that leaves threads stuck (dsecd/stopclock.py exit_now):
    take every log's lock and keep it, so that no thread of this process
    starts an append or a compaction from now on. The logs that could not
    be taken, or are being compacted (its copy written to the temp file,
    outside the lock, which the next daemon's compaction would open
    again): a write of this process to each is under way, and could land
    after a new daemon began writing there."""
    busy = []
    for rl in sorted(list(_LOGS), key=lambda rl: str(rl.path)):
        if not rl._lock.acquire(blocking=False) or rl._during is not None:
            busy.append(str(rl.path))
    return busy


class RecordLog:
    """Records by id, kept in memory and in an append-only log; thread-safe.

    `compact_with`: how a compaction is run off the caller's thread (given the
    work as a callable); None: the owner calls compact() itself when
    needs_compaction() says so."""

    def __init__(self, path: Path, fsync: bool = False,
                 compact_with: Callable[[Callable[[], None]], object] | None = None):
        self.path = Path(path)
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.records: dict[str, dict] = {}
        self.lines = _replay(self.path, self.records)
        # Each live record's line as appended: compaction writes these bytes,
        # i.e. what callers recorded, not their objects as they are by then.
        self._encoded = {k: _line(k, v) for k, v in self.records.items()}
        self._fd = self._open()
        self._appends = metrics.JOURNAL_APPENDS.labels(self.path.stem)
        self._fsync_seconds = metrics.JOURNAL_FSYNC.labels(self.path.stem)
        self._compact_with = compact_with
        self._compacting = False
        self._during: list[bytes] | None = None     # lines appended while a compaction copies
        _LOGS.add(self)

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def close(self, timeout: float = -1) -> None:
        """Give the fd back. `timeout` (s; -1: no bound): how long to wait
        for an append or a compaction holding the log (a write on a hung
        disk); past it the fd is left to the process's exit, said in the
        log. Nothing is lost either way: every record was written to the
        file before its append returned."""
        if not self._lock.acquire(timeout=timeout):
            log.warning("closing %s: an append or compaction still holds it after %.1f s (a write on a hung "
                        "disk?); its fd is left to the daemon's exit", self.path, timeout)
            return
        try:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        finally:
            self._lock.release()

    def get(self, key: str) -> dict | None:
        return self.records.get(key)

    def put(self, key: str, record: dict) -> None:
        self.put_many([(key, record)])

    def delete(self, key: str) -> None:
        if key in self.records:
            self._append_all([(key, None)])

    def put_many(self, items: list[tuple[str, dict]]) -> None:
        """Several records in one write (and one fdatasync with fsync on): a
        job op's hundreds of sandboxes cost one syscall, not one each."""
        if items:
            self._append_all(items)

    def _append_all(self, items: list[tuple[str, dict | None]]) -> None:
        """Append records (None = deleted) as one write, and apply them."""
        lines = [(key, record, _line(key, record)) for key, record in items]
        with self._lock:
            if self._fd < 0:
                raise OSError(9, f"write `{self.path}`: the record log is closed")
            _write_all(self._fd, b"".join(data for _, _, data in lines), self.path)
            if self.fsync:
                t0 = time.perf_counter()
                os.fdatasync(self._fd)
                self._fsync_seconds.observe(time.perf_counter() - t0)
            self._appends.inc()
            self.lines += len(lines)
            for key, record, data in lines:
                if record is None:
                    self.records.pop(key, None)
                    self._encoded.pop(key, None)
                else:
                    self.records[key] = record
                    self._encoded[key] = data
                if self._during is not None:
                    self._during.append(data)
            start = self._compact_with is not None and not self._compacting and self.needs_compaction()
            if start:
                self._compacting = True
        if start:
            try:
                self._compact_with(self._compact_behind)
            except RuntimeError:        # the pool is shut down (daemon stopping): the next start replays
                self._compacting = False

    def needs_compaction(self) -> bool:
        return self.lines > max(COMPACT_MIN, 2 * len(self.records))

    def _compact_behind(self) -> None:
        try:
            self.compact()
        except OSError as err:          # the log as it was stays valid: only longer
            log.error("compact %s: %s", self.path, err)
        finally:
            self._compacting = False

    def compact(self) -> None:
        """Rewrite the log with the live records only: a temp file, fsync'ed,
        renamed over the log, the directory fsync'ed (a compaction lost in a
        crash must not lose the registry). The bulk is written outside the
        lock, so appends go on meanwhile; they are copied in at the end."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with self._lock:
            if self._fd < 0:
                return                  # closed (shutdown) meanwhile: the next start replays it
            body = b"".join(self._encoded.values())
            live = len(self._encoded)
            self._during = []
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, body, tmp)
                os.fsync(fd)
                with self._lock:
                    if self._fd < 0:
                        return
                    tail = self._during
                    _write_all(fd, b"".join(tail), tmp)
                    os.fsync(fd)
                    new = self._open_replacement(tmp)
                    old, self._fd = self._fd, new
                    os.close(old)
                    self.lines = live + len(tail)
            finally:
                os.close(fd)
        finally:
            with self._lock:
                self._during = None
            if tmp.exists():
                tmp.unlink()
        _fsync_dir(self.path.parent)

    def _open_replacement(self, tmp: Path) -> int:
        """Rename the compacted copy over the log and open it for appends; the
        new fd is opened before the old one is given up (an EMFILE here
        leaves the old log and fd in place)."""
        fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            raise
        return fd


    def migrate_dir(self, old: Path, fix: Callable[[str, dict], dict] | None = None) -> None:
        """Records in the format before the logs (a JSON file per record in
        `old`, read_record_dir), each through `fix` if given, into this log,
        synced before the old files go; unreadable ones are set aside in
        `<old>.corrupt` for a human."""
        if not old.is_dir():
            return
        unreadable: list[str] = []
        records = read_record_dir(old, unreadable)
        self.put_many([(key, fix(key, rec) if fix else rec) for key, rec in records.items()])
        with self._lock:
            os.fsync(self._fd)          # in the log for good before the old copies go
        if unreadable:
            aside = old.with_name(old.name + ".corrupt")
            os.rename(old, aside)
            log.error("records of %s moved into %s; %d unreadable ones kept in %s",
                      old, self.path, len(unreadable), aside)
            return
        shutil.rmtree(old)
        log.info("records of %s moved into %s", old, self.path)


class Journal(RecordLog):
    """The sandbox registry: <state_dir>/journal.log, a record per sandbox.

    A daemon restarted on the same state dir reads them all back and re-adopts
    or cleans up what they describe. Records of a dsecd from before the log
    (a JSON file per sandbox in <state_dir>/journal/) are moved into it."""

    def __init__(self, state_dir: Path, fsync: bool = False,
                 compact_with: Callable[[Callable[[], None]], object] | None = None):
        super().__init__(Path(state_dir) / "journal.log", fsync, compact_with)
        self.migrate_dir(Path(state_dir) / "journal")

    def write(self, key: str, record: dict) -> None:
        self.write_many([(key, record)])

    def write_many(self, items: list[tuple[str, dict]]) -> None:
        for key, _ in items:
            if not key or "\n" in key:
                raise ValueError(f"bad journal key {key!r}")
        self.put_many(items)

    def load_all(self) -> dict[str, dict]:
        with self._lock:
            return dict(self.records)

def read_record_dir(old: Path, unreadable: list[str] | None = None) -> dict[str, dict]:
    """Records in the format before the logs: a JSON file per record (<id>.json).
    The names of files that do not parse go to `unreadable`."""
    out: dict[str, dict] = {}
    for entry in os.scandir(old):
        if entry.name.startswith(".") or not entry.name.endswith(".json"):
            continue        # temp files of writes that never reached their rename
        try:
            with open(entry.path, "rb") as f:
                out[entry.name[:-5]] = json.load(f)
        except (OSError, ValueError) as err:
            log.error("old record %s unreadable (%s)", entry.path, err)
            if unreadable is not None:
                unreadable.append(entry.name)
    return out
