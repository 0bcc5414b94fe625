"""The daemon's log: one line per record on stderr, as JSON (the default) or
logfmt (`daemon.log_format`), so that journald, a log shipper or `jq` reads
every field without a parser for prose.

A record's fields: `ts` (UTC, ISO 8601 with milliseconds), `level`, `logger`,
`msg` (the formatted message), then the record's own fields, given as
`extra={"fields": {...}}`, e.g. the lifecycle lines of
dsecd/engine/lifelog.py:

    {"ts": "2026-01-02T03:04:05.678Z", "level": "info", "logger": "dsecd.lifecycle",
     "msg": "sandbox created", "event": "created", "sandbox": "3f2a...", "duration_ms": 41.2}

A record whose message names a sandbox as "sandbox %s" (as most lines about
one do: `log.error("sandbox %s: ...", sb.id, ...)`) carries that argument
as its `sandbox` field too, unless the record gives one itself, so a log
reader can pick one sandbox's lines (`jq 'select(.sandbox == "3f2a...")'`)
without every such call site repeating the id in `extra`.

A record with an exception carries its traceback in `exc` (one JSON string:
the line stays one line).

Under systemd (JOURNAL_STREAM names our stderr) each line starts with its
syslog priority, `<6>` for info: journald takes it off and files the line at
that priority (SyslogLevelPrefix=, on by default), so `journalctl -p warning`
shows warnings and worse.

Also routed here: Python warnings (logging.captureWarnings) and exceptions
that reach no handler (sys.excepthook), so nothing the daemon says on stderr
is left unparsable.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import traceback

FORMATS = ("json", "logfmt")
LEVELS = ("debug", "info", "warning", "error")

# syslog(3) priorities journald reads from a "<N>" line prefix.
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}
_LEVEL_NAME = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
               logging.ERROR: "error", logging.CRITICAL: "critical"}


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


# A printf conversion of a log message (%% included, which takes no argument).
_CONVERSION = re.compile(r"%(?:%|(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa])")
_NAMES_SANDBOX = "sandbox %s"


def sandbox_named(record: logging.LogRecord) -> str | None:
    """The argument a record's message names as "sandbox %s", if it is a
    string (a sandbox's or a call sandbox's id); else None."""
    msg, args = record.msg, record.args
    if not isinstance(msg, str) or not isinstance(args, tuple) or _NAMES_SANDBOX not in msg:
        return None
    at = msg.index(_NAMES_SANDBOX) + len(_NAMES_SANDBOX) - 2
    i = 0
    for conv in _CONVERSION.finditer(msg):
        if conv.start() == at:
            return args[i] if i < len(args) and isinstance(args[i], str) else None
        if conv.group() != "%%":
            i += 1
    return None


def record_fields(record: logging.LogRecord) -> dict:
    """A record as the ordered fields of its line."""
    out = {"ts": _timestamp(record.created), "level": _LEVEL_NAME.get(record.levelno, record.levelname.lower()),
           "logger": record.name, "msg": record.getMessage()}
    extra = getattr(record, "fields", None)
    if extra:
        for key, value in extra.items():
            out[key if key not in out else f"field_{key}"] = value
    if "sandbox" not in out:
        sb_id = sandbox_named(record)
        if sb_id is not None:
            out["sandbox"] = sb_id
    if record.exc_info:
        out["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
    elif record.stack_info:
        out["stack"] = record.stack_info
    return out


def _jsonable(value):
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    return str(value)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(record_fields(record), default=_jsonable, ensure_ascii=False, separators=(",", ":"))


def _logfmt_value(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (dict, list, tuple)):
        value = json.dumps(value, default=_jsonable, separators=(",", ":"))
    text = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
    if text and not any(c in text for c in ' "=\\') and text.isprintable():
        return text
    # Quoted, with the escapes of a JSON string: one line whatever the text holds.
    return json.dumps(text, ensure_ascii=False)


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in record_fields(record).items())


class PriorityPrefix(logging.Formatter):
    """Another formatter's line, with the "<N>" syslog priority journald reads."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return f"<{_PRIORITY.get(record.levelno, 6)}>{self.inner.format(record)}"


def stderr_is_journal(environ=os.environ, fd: int = 2) -> bool:
    """Whether our stderr is the journald stream systemd gave us: JOURNAL_STREAM
    is "device:inode" of that stream, and a child whose stderr was redirected
    elsewhere inherits the variable without the stream (systemd.exec(5))."""
    value = environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    try:
        st = os.fstat(fd)
        return bool(ino) and (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError):
        return False


def make_formatter(fmt: str, journal: bool) -> logging.Formatter:
    if fmt not in FORMATS:
        raise ValueError(f"daemon.log_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    inner = JsonFormatter() if fmt == "json" else LogfmtFormatter()
    return PriorityPrefix(inner) if journal else inner


def setup(level: str, fmt: str, stream=None) -> logging.Handler:
    """Route every log record, warning and stray exception of this process to
    `stream` (stderr), one line each. Returns the handler."""
    if level not in LEVELS:
        raise ValueError(f"daemon.log_level must be one of {', '.join(LEVELS)}, got {level!r}")
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(make_formatter(fmt, stream is sys.stderr and stderr_is_journal()))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    set_level(level)
    # A line carries none of the caller's file, line, thread or process:
    # the logging module then skips looking them up for every record (its
    # documented switches; _srcfile = None skips the stack walk of
    # findCaller). One line per create and per destroy made that a third of
    # each record's cost in a burst.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda a: _log_uncaught(a.exc_type, a.exc_value, a.exc_traceback,
                                                   f"uncaught exception in thread {a.thread.name if a.thread else '?'}")
    sys.unraisablehook = _log_unraisable
    return handler


def set_level(level: str) -> None:
    """The level of dsecd's records (at start, and at a config reload)."""
    if level not in LEVELS:
        raise ValueError(f"daemon.log_level must be one of {', '.join(LEVELS)}, got {level!r}")
    # `level` is dsecd's own; other libraries' debug chatter (pyroute2's every
    # netlink message, asyncio's selector choice) is noise at it.
    logging.getLogger("dsecd").setLevel(level.upper())
    logging.getLogger().setLevel(max(logging.INFO, logging.getLevelName(level.upper())))


def _log_uncaught(kind, value, tb, what: str = "uncaught exception") -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("dsecd").critical(what, exc_info=(kind, value, tb))


def _log_unraisable(u) -> None:
    """An exception Python could not raise (in a __del__, a finalizer): logged
    instead of the interpreter's multi-line "Exception ignored in" text."""
    where = f" in {u.object!r}" if u.object is not None else ""
    logging.getLogger("dsecd").error("%s%s", u.err_msg or "exception ignored", where,
                                     exc_info=(u.exc_type, u.exc_value, u.exc_traceback))
