"""dsecd.trace pieces that need no tracee: sockaddr decoding, results, limits, text."""

from __future__ import annotations

import socket
import struct

import pytest

from dsecd import trace


def test_sockaddr_in_and_in6():
    sin = struct.pack("<H", socket.AF_INET) + struct.pack(">H", 8080) + socket.inet_aton("10.1.2.3")
    assert trace.decode_sockaddr(sin + b"\0" * 8) == "10.1.2.3:8080"
    sin6 = (struct.pack("<H", socket.AF_INET6) + struct.pack(">H", 443) + b"\0" * 4
            + socket.inet_pton(socket.AF_INET6, "2001:db8::1") + b"\0" * 4)
    assert trace.decode_sockaddr(sin6) == "[2001:db8::1]:443"


def test_sockaddr_unix_path_abstract_and_junk():
    fam = struct.pack("<H", socket.AF_UNIX)
    assert trace.decode_sockaddr(fam + b"/run/dsecd/dsecd.sock\0garbage") == "unix:/run/dsecd/dsecd.sock"
    assert trace.decode_sockaddr(fam + b"\0hidden") == "unix:@hidden"
    assert trace.decode_sockaddr(b"\x01") == "?"
    assert trace.decode_sockaddr(struct.pack("<H", 16) + b"\xaa" * 10).startswith("family 16: aaaa")
    # a truncated AF_INET (addrlen too short) is not misread
    assert trace.decode_sockaddr(struct.pack("<H", socket.AF_INET) + b"\0\x50").startswith("family 2")


def test_results_are_numbers_or_errno_names():
    assert trace.syscall_result(3) == 3
    assert trace.syscall_result((1 << 64) - 2) == "ENOENT"
    assert trace.syscall_result((1 << 64) - 111) == "ECONNREFUSED"
    assert trace.syscall_result(0x7F0000001000) == 0x7F0000001000


@pytest.mark.parametrize("field", ["max_events", "max_bytes", "max_string", "max_argv"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        trace.Limits(**{field: 0})


def test_text_form_says_truncated_and_how_it_ended():
    tr = trace.Trace(pid=7, events=[
        {"t": 0.1, "pid": 7, "kind": "exec", "syscall": "execve", "path": "/bin/sh",
         "argv": ["sh"], "result": 0},
        {"t": 0.2, "pid": 7, "kind": "connect", "fd": 3, "address": "127.0.0.1:80",
         "result": "ECONNREFUSED"},
        {"t": 0.3, "pid": 7, "kind": "signal", "signal": "SIGTERM"}],
        truncated=True, dropped=4, bytes=300, signal="SIGTERM", duration_s=0.4)
    text = tr.to_text()
    assert "exec '/bin/sh' ['sh'] = 0" in text
    assert "connect fd=3 127.0.0.1:80 = ECONNREFUSED" in text
    assert text.rstrip().endswith("TRUNCATED, 4 dropped")
    assert "killed by SIGTERM" in text.splitlines()[-1]


def test_helper_needs_pid_or_command():
    with pytest.raises(SystemExit):
        trace.main([])
    with pytest.raises(SystemExit):
        trace.main(["--pid", "1", "--", "true"])


def test_the_backstop_counts_only_slices_that_ran_at_both_ends(monkeypatch):
    """dsecd/trace.py _run_timer with a freezer that says paused at every
    other look: no slice ran at both ends, so no time counts; then running
    throughout, the timer ends after its seconds."""
    import threading
    import time

    monkeypatch.setattr(trace, "FROZEN_LOOK_S", 0.01)
    looks = {"n": 0}

    def flapping():
        looks["n"] += 1
        return looks["n"] % 2 == 0

    expired, done = threading.Event(), threading.Event()
    trace._run_timer(0.05, expired.set, flapping, done)
    time.sleep(0.3)
    assert not expired.is_set(), "paused-at-one-end slices were counted"
    done.set()
    expired2 = threading.Event()
    trace._run_timer(0.05, expired2.set, lambda: False, threading.Event())
    assert expired2.wait(2)
