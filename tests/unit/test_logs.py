"""The daemon's log lines (dsecd/logs.py): one JSON object or one logfmt
line per record, whatever the message or exception holds, with the syslog
priority journald reads when stderr is the journal's stream."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading

import pytest

from dsecd import logs


def _record(msg="sandbox created", level=logging.INFO, fields=None, exc=None) -> logging.LogRecord:
    rec = logging.LogRecord("dsecd.lifecycle", level, __file__, 1, msg, (), exc)
    if fields is not None:
        rec.fields = fields
    return rec


def test_json_line_has_the_standard_fields_then_the_records_own():
    line = logs.JsonFormatter().format(_record(fields={"event": "created", "sandbox": "ab12", "cpu": 0.5,
                                                       "labels": {"job": "7"}}))
    doc = json.loads(line)
    assert list(doc)[:4] == ["ts", "level", "logger", "msg"]
    assert doc["level"] == "info" and doc["logger"] == "dsecd.lifecycle" and doc["msg"] == "sandbox created"
    assert doc["event"] == "created" and doc["cpu"] == 0.5 and doc["labels"] == {"job": "7"}
    assert doc["ts"].endswith("Z") and "T" in doc["ts"]


def test_a_field_named_like_a_standard_one_does_not_replace_it():
    doc = json.loads(logs.JsonFormatter().format(_record(fields={"msg": "sneaky", "level": "x"})))
    assert doc["msg"] == "sandbox created" and doc["field_msg"] == "sneaky" and doc["field_level"] == "x"


def test_an_exception_stays_on_the_line():
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        rec = _record("boom", logging.ERROR, exc=sys.exc_info())
    for fmt in (logs.JsonFormatter(), logs.LogfmtFormatter()):
        line = fmt.format(rec)
        assert "\n" not in line and "ValueError" in line


def test_logfmt_quotes_what_needs_it():
    line = logs.LogfmtFormatter().format(_record('a "quoted" msg', fields={
        "sandbox": "ab12", "n": 3, "ok": True, "none": None, "labels": {"job": "a b"}, "path": "x=y"}))
    assert 'msg="a \\"quoted\\" msg"' in line
    assert " sandbox=ab12 n=3 ok=true none= " in line
    assert 'labels="{\\"job\\":\\"a b\\"}"' in line and 'path="x=y"' in line


@pytest.mark.parametrize("level,prefix", [(logging.DEBUG, "<7>"), (logging.INFO, "<6>"),
                                          (logging.WARNING, "<4>"), (logging.ERROR, "<3>"),
                                          (logging.CRITICAL, "<2>")])
def test_journal_lines_carry_their_syslog_priority(level, prefix):
    line = logs.make_formatter("json", journal=True).format(_record(level=level))
    assert line.startswith(prefix) and json.loads(line[len(prefix):])["msg"] == "sandbox created"


def test_stderr_is_the_journal_only_when_journal_stream_names_it(tmp_path):
    with open(tmp_path / "f", "w") as f:
        st = os.fstat(f.fileno())
        assert logs.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, f.fileno())
        assert not logs.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}, f.fileno())
        assert not logs.stderr_is_journal({}, f.fileno())
        assert not logs.stderr_is_journal({"JOURNAL_STREAM": "junk"}, f.fileno())


def test_setup_routes_warnings_and_library_chatter(monkeypatch):
    # setup() changes process-wide state: put every piece back afterwards.
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(logging.getLogger("dsecd"), "level", logging.NOTSET)
    for owner, name in ((sys, "excepthook"), (threading, "excepthook"), (sys, "unraisablehook")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    out = io.StringIO()
    try:
        logs.setup("debug", "json", out)
        logging.getLogger("dsecd.x").debug("ours")
        logging.getLogger("pyroute2.netlink").debug("theirs")      # below INFO for libraries
        import warnings

        warnings.warn("careful", UserWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [d["msg"] for d in lines if d["logger"] == "dsecd.x"] == ["ours"]
    assert not any(d["logger"].startswith("pyroute2") for d in lines)
    assert any(d["logger"] == "py.warnings" and "careful" in d["msg"] for d in lines)


def test_setup_refuses_an_unknown_format_or_level():
    with pytest.raises(ValueError, match="log_format"):
        logs.make_formatter("xml", False)
    with pytest.raises(ValueError, match="log_level"):
        logs.setup("loud", "json", io.StringIO())


def _line(msg, args=(), fields=None) -> dict:
    rec = logging.LogRecord("dsecd", logging.ERROR, __file__, 1, msg, args, None)
    if fields is not None:
        rec.fields = fields
    return json.loads(logs.JsonFormatter().format(rec))


@pytest.mark.parametrize("msg, args, sandbox", [
    ("sandbox %s: destroy failed (%s)", ("3f2a", "EBUSY"), "3f2a"),
    ("dropping call sandbox %s of %s: %s", ("fn-1", "py", "idle"), "fn-1"),
    ("%d%% of %s left; sandbox %s goes", (5, "disk", "ab12"), "ab12"),
    ("%(n)s seen in sandbox %(sb)s", ({"n": 1, "sb": "ab12"},), None),   # a mapping's: not guessed
    ("sandbox %s went", (7,), None),                      # not an id
    ("sandbox %s went", (), None),                        # no argument for it
    ("%s of sandboxes", ("3",), None),
])
def test_a_line_naming_a_sandbox_carries_its_id_as_the_sandbox_field(msg, args, sandbox):
    assert _line(msg, args).get("sandbox") == sandbox


def test_a_records_own_sandbox_field_is_kept():
    assert _line("sandbox %s moved", ("ab12",), fields={"sandbox": "cd34"})["sandbox"] == "cd34"
