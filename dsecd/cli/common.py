"""What the `dsec` commands share: the progress line of a long image job,
a command's output written through or kept for --json (CommandOutput),
one item's --json error (rm, cat, pause), our stdin read as it comes, a
`SB:/path` argument split into its sandbox and path, and SIGTERM or
SIGHUP ending a command as ^C does."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator

from ..cliargs import _print_error
from ..clitext import clock as _clock
from ..clitext import human_bytes as _human_bytes
from ..cptar import in_a_thread_of_its_own as _in_a_thread_of_its_own
from ..errors import DsecError
from ..fds import read_ready


class _ProgressBar:
    """One status line on a tty for long builds; silent otherwise (and with --json)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.shown = False

    def __call__(self, p: dict) -> None:
        if not self.enabled:
            return
        if p.get("step") == "queued":
            text = f"waiting: images.max_flattens ({p['max']}) flattens already running"
        elif p.get("step") == "unpack":
            text = f"unpacking layer {p['layer']}/{p['of']} ({p['entries']} entries)"
        elif p.get("step") == "measure":
            text = f"measuring the room needed: layer {p['layer']}/{p['of']} ({p['entries']} entries)"
        elif p.get("step") == "merge":
            text = (f"merging layer {p['layer']}/{p['of']}: {p['entries']} entries, "
                    f"{_human_bytes(p['bytes'])} copied")
        elif p.get("step") == "mkfs.erofs" and "bytes" in p:
            of = f" of ~{_human_bytes(p['total'])}" if p.get("total") else ""
            text = f"packing the layer: {_human_bytes(p['bytes'])}{of} written"
        elif p.get("step") == "layer":
            text = f"layer {p['digest'][7:19]} {_human_bytes(p['bytes'])}{'' if p['new'] else ' (exists)'}"
        else:
            text = f"{p.get('step', 'working')} {p.get('source', '')}"
        print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
        self.shown = True

    def done(self) -> None:
        if self.shown:
            print(file=sys.stderr)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class CommandOutput:
    """Where a command's output goes: to our stdout and stderr as it comes,
    or, with --json, kept for the one JSON object printed at its end (the
    command's own output before it would make stdout no longer JSON)."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.kept = {1: bytearray(), 2: bytearray()}

    def write(self, fd: int, data: bytes) -> None:
        if self.as_json:
            self.kept[fd] += data
            return
        _write_flush(fd, data)

    def fields(self) -> dict:
        """stdout and stderr for the JSON result, as text (bytes that are not
        UTF-8 become U+FFFD)."""
        return {"stdout": self.kept[1].decode("utf-8", "replace"),
                "stderr": self.kept[2].decode("utf-8", "replace")}


class _ReadQueue:
    """The chunks of fd as the event loop reads them (b"" last, at its end or
    on an error), queued; `watch` raises PermissionError for an fd epoll does
    not take (a regular file). Use as a context: the reader goes at its end."""

    def __init__(self, fd: int):
        self.fd = fd
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    def watch(self) -> _ReadQueue:
        self.loop.add_reader(self.fd, self._on_readable)
        return self

    def _on_readable(self) -> None:
        data = read_ready(self.fd, 1 << 16)
        if data is None:
            return
        if not data:
            self.loop.remove_reader(self.fd)
        self.queue.put_nowait(data)

    def __enter__(self) -> asyncio.Queue[bytes]:
        return self.queue

    def __exit__(self, *exc) -> None:
        self.loop.remove_reader(self.fd)


def _when(ts: float | None) -> str:
    return "-" if ts is None else _clock(ts)


def _write_flush(fd: int, data: bytes) -> None:
    """Every byte of `data` to our stdout (fd 1) or stderr (2), at once, after
    what was printed before. A failure raises (BrokenPipeError: nobody reads
    it; ENOSPC: a full disk): a buffered writer can report a short write of
    a large block instead, and the rest would be lost without a word."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def _stdin_as_it_comes():
    """Chunks of our stdin: by the event loop for a pipe or a terminal; a
    regular file (never blocks for long) is read by a thread."""
    try:
        reads = _ReadQueue(sys.stdin.fileno()).watch()
    except PermissionError:            # epoll takes no regular file
        async for data in _stdin_chunks():
            yield data
        return
    with reads as queue:
        while data := await queue.get():
            yield data


def _split_remote(spec: str) -> tuple[str | None, str]:
    """'SB:/path' -> (SB, /path); a local path -> (None, path). ./x:y stays local."""
    head, sep, tail = spec.partition(":")
    if sep and head and "/" not in head and tail.startswith("/"):
        return head, tail
    return None, spec


@contextlib.contextmanager
def _cancelled_by_ending_signals(signals: list[int]):
    """For the with block: SIGTERM and SIGHUP (a `timeout`, a closed
    terminal) cancel the current task, as ^C would end it, through the
    loop (a handler raising from wherever the interpreter is could land in
    one of asyncio's callbacks, which drops it); each is added to
    `signals`, whose first tells the CancelledError from any other. A
    second one ends the process at once, as a second ^C does: the clean-up
    the first started (a temporary file's removal, a cancel's answer) may
    wait on a daemon that no longer answers."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_signal(signum: int) -> None:
        if signals:
            os._exit(128 + signum)
        main.cancel()
        signals.append(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield
    finally:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(signum)


async def _stdin_chunks(fd: int = 0) -> AsyncIterator[bytes]:
    """fd 0 (or a FIFO's `fd`) as it comes, each read in a thread of its
    own (cmd_cp's SIGTERM ends the copy while one blocks: an executor's
    thread would hold the exit until the writer wrote or closed),
    unbuffered: a thread left blocked in sys.stdin's buffered read at exit
    holds its lock, and the interpreter's shutdown aborts on it."""
    while chunk := await _in_a_thread_of_its_own(os.read, fd, 1 << 20):
        yield chunk


def _names_as_bytes() -> None:
    """Print a name that is not UTF-8 (its odd bytes held as surrogates,
    os.fsdecode's) as its bytes, as ls(1) prints it into a pipe."""
    with contextlib.suppress(AttributeError):       # stdout replaced by something else (a test's)
        sys.stdout.reconfigure(errors="surrogateescape")


def _print_item_error(a, err: DsecError, **which) -> None:
    """--json: one sandbox's or path's failure (rm, cat), as the error object (naming it)."""
    wire = err.to_wire()
    wire["detail"] = {**which, **wire["detail"]}
    _print_error(a, wire)
