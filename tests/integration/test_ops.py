"""Operations: the daemon's log, one JSON (or logfmt) line per record and
one per lifecycle event."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from dsecd.errors import NotFound

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- helpers

def log_lines(d) -> list[dict]:
    """Every line of the daemon's log, each parsed as JSON (a line that is not fails the test)."""
    out = []
    for n, line in enumerate(d.log.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except ValueError:
            pytest.fail(f"{d.log} line {n} is not JSON: {line[:300]!r}")
    return out


def wait_for(what, timeout: float = 10.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


OOM_LOOP = 'x=aaaaaaaaaaaaaaaa; while :; do x="$x$x"; done'


# ---------------------------------------------------------------- the log

def test_every_log_line_is_json_through_create_exec_oom_pause_destroy(daemon_factory, busybox_rootfs):
    d = daemon_factory()        # log_level debug (conftest), log_format json (the default)
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="32M", cpu=0.5, labels={"job": "j1"})
    assert sb.exec(["echo", "hi"]).stdout == b"hi\n"
    sb.exec(["sh", "-c", OOM_LOOP], timeout=60)
    sb.pause()
    sb.resume()
    with pytest.raises(NotFound):
        c.request("exec", sandbox="000000000000", argv=["true"])
    wait_for(lambda: any(ln.get("event") == "oom" for ln in log_lines(d)), timeout=5)
    sb.destroy()
    c.close()
    d.stop()
    lines = log_lines(d)
    for ln in lines:
        assert {"ts", "level", "logger", "msg"} <= ln.keys(), ln
        assert ln["level"] in ("debug", "info", "warning", "error", "critical"), ln
    events = {ln["event"]: ln for ln in lines if ln.get("logger") == "dsecd.lifecycle"}
    created = events["created"]
    assert created["sandbox"] == sb.id and created["image"] == "busybox" and created["job"] == "j1"
    assert created["qos"] == "be" and created["cpu"] == 0.5 and created["memory"] == 32 << 20
    assert created["duration_ms"] > 0 and created["level"] == "info"
    assert events["oom"]["kills"] >= 1 and events["oom"]["level"] == "warning"
    assert events["paused"]["freed_bytes"] >= 0 and events["resumed"]["duration_ms"] >= 0
    assert events["destroyed"]["reason"] == "request" and events["destroyed"]["previous_state"] == "running"
    assert any(ln.get("event") == "ready" for ln in lines)
    conns = [ln for ln in lines if ln["msg"].startswith("connection from")]
    assert conns and all(ln["level"] == "debug" for ln in conns)
    refused = [ln for ln in lines if ln.get("op") == "exec" and ln.get("code") == "not_found"]
    assert refused and refused[0]["level"] == "debug", "a client's own error is debug chatter"


def test_logfmt_lines(daemon_factory, busybox_rootfs):
    d = daemon_factory(start=False)
    d.config.write_text(d.config.read_text().replace('log_level = "debug"\n',
                                                     'log_level = "debug"\nlog_format = "logfmt"\n'))
    d.start()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.create(image="busybox").destroy()
    c.close()
    d.stop()
    lines = d.log.read_text().splitlines()
    assert lines
    for line in lines:
        assert re.match(r'^ts=\S+ level=\w+ logger=\S+ msg=("(?:[^"\\]|\\.)*"|\S*)( \w+=("(?:[^"\\]|\\.)*"|\S*))*$',
                        line), line
    assert any("event=created" in line for line in lines) and any("reason=request" in line for line in lines)

