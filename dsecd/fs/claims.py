"""Claim files: one host at a time does a piece of work in a shared store.

A claim is a file made with O_CREAT|O_EXCL (atomic on local disks and on the
network file systems a shared store runs on), holding who made it:
{"host", "pid", "start", "token"}. Its holder touches it every few seconds
(the heartbeat) and removes it when done. Anyone else who finds it waits
until it goes, then looks again at what the holder left (a pull: the image is
there, and nothing is downloaded twice).

A claim whose holder is gone is broken, so a crash never blocks the work:
on this host, a holder whose pid no longer runs (or runs another program:
its start time differs); on another host, a claim whose heartbeat is older
than `stale_s`. Breaking renames the claim to a unique name first, so of
two hosts breaking one claim at once only one removes it, and neither
removes a fresh claim made meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

HEARTBEATS_PER_STALE = 4


def process_start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Claim:
    """`with Claim(path, stale_s).held(on_wait, cancelled):` does the work
    while holding the claim at `path`; `on_wait(holder)` is called while
    another live holder has it (about once per poll)."""

    def __init__(self, path: Path, stale_s: float, poll_s: float = 0.5):
        self.path = Path(path)
        self.stale_s = stale_s
        self.poll_s = poll_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()

    def _mine(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "start": process_start_time(pid), "token": self.token}

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        # fsync: another host's holder() reads who made it; on a network file
        # system the bytes may sit in this client's cache past close.
        with os.fdopen(fd, "w") as f:
            json.dump(self._mine(), f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def holder(self) -> dict | None:
        """Who holds the claim now (with `age_s`, since its last heartbeat); None if nobody."""
        try:
            st = os.stat(self.path)
            data = json.loads(self.path.read_text() or "{}")
        except FileNotFoundError:
            return None
        except ValueError:         # being written this instant: its maker is alive
            data = {}
        return {**data, "age_s": time.time() - st.st_mtime}

    def _stale(self, holder: dict) -> bool:
        if holder.get("host") == socket.gethostname() and holder.get("pid"):
            start = process_start_time(int(holder["pid"]))
            if start is None or (holder.get("start") and start != holder["start"]):
                return True
        return holder["age_s"] > self.stale_s

    def _break(self) -> None:
        aside = self.path.with_name(f"{self.path.name}.broken-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        # Another host may have broken the stale claim and made a fresh one
        # between our look and the rename: that fresh one is not ours to break.
        try:
            moved = json.loads(aside.read_text() or "{}")
            if time.time() - aside.stat().st_mtime <= self.stale_s and not self._stale(
                    {**moved, "age_s": time.time() - aside.stat().st_mtime}):
                with contextlib.suppress(OSError):
                    os.link(aside, self.path)      # put it back (fails if yet another exists)
        except (OSError, ValueError):
            pass
        with contextlib.suppress(OSError):
            aside.unlink()

    def acquire(self, on_wait: Callable[[dict], None] | None = None,
                cancelled: threading.Event | None = None, timeout_s: float = 3600.0) -> None:
        """Take the claim, waiting for a live holder and breaking a dead one's.
        TimeoutError after `timeout_s`; InterruptedError when `cancelled` is set."""
        deadline = time.monotonic() + timeout_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._try_create():
            holder = self.holder()
            if holder is None:
                continue
            if self._stale(holder):
                self._break()
                continue
            if on_wait is not None:
                on_wait(holder)
            if cancelled is not None and cancelled.is_set():
                raise InterruptedError(errno.EINTR, "cancelled while waiting for a claim", str(self.path))
            if time.monotonic() > deadline:
                raise TimeoutError(errno.ETIMEDOUT, f"claim held by {holder.get('host')} pid "
                                   f"{holder.get('pid')} all the {timeout_s:.0f} s we waited", str(self.path))
            time.sleep(self.poll_s)
        self._stop.clear()
        threading.Thread(target=self._heartbeat, name="dsecd-claim-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.stale_s / HEARTBEATS_PER_STALE):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Remove the claim if it is still ours (a claim broken as stale is another's now)."""
        self._stop.set()
        holder = self.holder()
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    @contextlib.contextmanager
    def held(self, on_wait: Callable[[dict], None] | None = None,
             cancelled: threading.Event | None = None, timeout_s: float = 3600.0):
        self.acquire(on_wait, cancelled, timeout_s)
        try:
            yield self
        finally:
            self.release()
