"""dsecd.trace on real processes: exec, open, connect, signals, bounds.

The tracer waits with waitpid(-1): these tests start no other children while
a trace runs (the loopback server is a thread).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from dsecd import trace

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the tracer is x86_64")
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
SH = shutil.which("sh") or "/bin/sh"
CAT = shutil.which("cat") or "/bin/cat"


@pytest.fixture
def server():
    """A loopback TCP server that accepts one connection and keeps what it got."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)
    got: list[bytes] = []

    def serve():
        try:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(10)
                got.append(conn.recv(100))
        except OSError:
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], got
    srv.close()
    t.join(5)


def _kinds(tr: trace.Trace, kind: str) -> list[dict]:
    return [e for e in tr.events if e["kind"] == kind]


def test_records_exec_open_connect_and_forks(tmp_path, server):
    port, got = server
    secret = tmp_path / "answers.txt"
    secret.write_text("42\n")
    script = (f"import socket; open({str(secret)!r}).read(); "
              f"socket.create_connection(('127.0.0.1', {port})).sendall(b'hi')")
    tr = trace.trace_command([SH, "-c", f"{CAT} {secret} >/dev/null; exec {PY} -c \"{script}\""],
                             timeout=60)
    assert tr.exit_code == 0 and not tr.truncated and not tr.timed_out
    assert got == [b"hi"]
    execs = {e["path"]: e for e in _kinds(tr, "exec") if e["result"] == 0}
    assert execs[SH]["pid"] == tr.pid and execs[SH]["argv"][:2] == [SH, "-c"]
    # cat ran in a forked child, followed and recorded under its own pid
    cat = execs[CAT]
    assert cat["pid"] != tr.pid and cat["argv"] == [CAT, str(secret)]
    forks = _kinds(tr, "fork")
    assert any(f["pid"] == tr.pid and f["child"] == cat["pid"] for f in forks)
    # python3 replaced the shell: same pid
    assert execs[PY]["pid"] == tr.pid
    opens = [e for e in _kinds(tr, "open") if e["path"] == str(secret)]
    assert {e["pid"] for e in opens} == {cat["pid"], tr.pid}
    assert all(isinstance(e["result"], int) and e["result"] >= 0 for e in opens)
    connects = _kinds(tr, "connect")
    assert [(c["address"], c["result"]) for c in connects] == [(f"127.0.0.1:{port}", 0)]
    exits = {e["pid"]: e for e in _kinds(tr, "exit")}
    assert exits[cat["pid"]]["code"] == 0 and exits[tr.pid]["code"] == 0
    # events are in time order and JSON-serializable
    assert [e["t"] for e in tr.events] == sorted(e["t"] for e in tr.events)
    assert json.loads(tr.to_json())["events"] == tr.events


def test_an_exec_names_the_program_that_runs_where_its_path_does_not(tmp_path):
    """Through a symlink (or busybox's /proc/self/exe) the path given is not
    the program: `exe` says which one ran; an exec by its own path has none."""
    link = tmp_path / "innocent"
    link.symlink_to(os.path.realpath(CAT))
    (tmp_path / "f").write_text("x")
    tr = trace.trace_command([SH, "-c", f"{link} {tmp_path / 'f'} >/dev/null; {os.path.realpath(CAT)} /dev/null"],
                             timeout=60)
    assert tr.exit_code == 0
    execs = {e["path"]: e for e in _kinds(tr, "exec") if e["result"] == 0}
    assert execs[str(link)]["exe"] == os.path.realpath(CAT)
    assert "exe" not in execs[os.path.realpath(CAT)]
    assert f"exec {str(link)!r} ({os.path.realpath(CAT)})" in tr.to_text()


def test_failed_open_and_refused_connect_carry_errno_names(tmp_path):
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))      # bound, not listening: connect is refused
    port = refused.getsockname()[1]
    missing = tmp_path / "missing"
    script = (f"import socket\ntry: open({str(missing)!r})\nexcept OSError: pass\n"
              f"socket.socket(socket.AF_INET6).connect_ex(('::1', {port}))\n"
              f"socket.socket().connect_ex(('127.0.0.1', {port}))\n"
              f"socket.socket(socket.AF_UNIX).connect_ex('\\0dsec-test-abstract')\n")
    try:
        tr = trace.trace_command([PY, "-c", script], timeout=60)
    finally:
        refused.close()
    assert [e["result"] for e in _kinds(tr, "open") if e["path"] == str(missing)] == ["ENOENT"]
    assert [(c["address"], c["result"]) for c in _kinds(tr, "connect")] == [
        (f"[::1]:{port}", "ECONNREFUSED"), (f"127.0.0.1:{port}", "ECONNREFUSED"),
        ("unix:@dsec-test-abstract", "ECONNREFUSED")]


def test_signals_are_recorded_and_delivered():
    tr = trace.trace_command([SH, "-c", "kill -USR1 $$; sleep 5"], timeout=60)
    assert tr.signal == "SIGUSR1" and tr.exit_code is None
    assert any(e["kind"] == "signal" and e["signal"] == "SIGUSR1" and e["pid"] == tr.pid
               for e in tr.events)
    assert tr.duration_s < 4     # the signal was delivered, not swallowed


def test_event_limit_truncates_but_the_command_runs_on(tmp_path):
    out = tmp_path / "done"
    tr = trace.trace_command([SH, "-c", f"{CAT} /etc/hostname >/dev/null; echo ok > {out}"],
                             limits=trace.Limits(max_events=3), timeout=60)
    assert len(tr.events) == 3 and tr.truncated and tr.dropped > 0
    assert tr.exit_code == 0 and out.read_text() == "ok\n"
    assert "TRUNCATED" in tr.to_text()


def test_byte_limit_bounds_the_record():
    tr = trace.trace_command([SH, "-c", f"{CAT} /etc/hostname >/dev/null"],
                             limits=trace.Limits(max_bytes=400, max_string=64), timeout=60)
    assert tr.truncated and 0 < tr.bytes <= 400
    assert len(json.dumps(tr.events, separators=(",", ":"))) <= 400 + len(tr.events)


def test_long_strings_and_argv_are_cut():
    tr = trace.trace_command([PY, "-c", "pass", "x" * 500, *["a"] * 20],
                             limits=trace.Limits(max_string=100, max_argv=5), timeout=60)
    ex = next(e for e in _kinds(tr, "exec") if e["result"] == 0)
    assert len(ex["argv"]) == 5 and ex["argv_truncated"]
    tr = trace.trace_command([PY, "-c", "pass", "x" * 500],
                             limits=trace.Limits(max_string=100), timeout=60)
    ex = next(e for e in _kinds(tr, "exec") if e["result"] == 0)
    assert ex["argv"][3] == "x" * 100 and ex["argv_truncated"]


def test_timeout_kills_every_tracee():
    t0 = time.monotonic()
    tr = trace.trace_command([SH, "-c", "sleep 30 & sleep 30; wait"], timeout=0.5)
    assert tr.timed_out and tr.signal == "SIGKILL"
    assert time.monotonic() - t0 < 10
    sleepers = {e["child"] for e in _kinds(tr, "fork")}
    for pid in sleepers:   # reaped by the tracer: nothing left running
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] in "ZX"


def test_trace_spawn_takes_a_stopped_process_from_a_callable():
    started = []

    def start() -> int:
        pid = trace.spawn_stopped(["/bin/true"])
        started.append(pid)
        return pid

    tr = trace.trace_spawn(start, timeout=60)
    assert tr.pid == started[0] and tr.exit_code == 0
    assert _kinds(tr, "exec")[0]["path"] == "/bin/true"


def test_a_running_process_is_refused_not_half_traced():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(TimeoutError, match="not stopped"):
            trace.trace_pid(proc.pid, stop_wait=0.2)
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ProcessLookupError):
        trace.trace_pid(proc.pid, stop_wait=0.2)


def test_helper_process_prints_json():
    out = subprocess.run([sys.executable, "-m", "dsecd.trace", "--json", "--", "/bin/true"],
                         capture_output=True, text=True, timeout=60, check=True)
    doc = json.loads(out.stdout.splitlines()[-1])
    assert doc["exit_code"] == 0 and doc["events"][0]["kind"] == "exec"
