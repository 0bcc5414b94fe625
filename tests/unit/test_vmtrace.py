"""A microVM's trace: the guest tracer's raw records (csrc/guest/agent.c,
trace_main; encoded here as it does) become dsecd/trace.py's record, with its
bounds, and records the guest should not send end the reading."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct

import pytest

from dsecd import trace
from dsecd.backends.microvm.vmtrace import (
    TR_ERROR,
    TR_EXIT,
    TR_FORK,
    TR_SIGNAL,
    TR_SYSCALL,
    GuestTrace,
)

NR = {name: nr for nr, name in trace.RECORDED.items()}
ENOENT = (1 << 64) - 2


def u64(v: int) -> bytes:
    return struct.pack(">Q", v)


def bstr(v: bytes) -> bytes:
    return struct.pack(">I", len(v)) + v


def record(t_ns: int, pid: int, kind: int, *fields: bytes) -> bytes:
    body = u64(t_ns) + u64(pid) + u64(kind) + b"".join(fields)
    return struct.pack(">I", len(body)) + body


def syscall(t_ns, pid, name, rax, args=(0,) * 6, path=b"", path_cut=False, argv=(), argv_cut=False, data=b""):
    return record(t_ns, pid, TR_SYSCALL, u64(NR[name]), u64(rax), *map(u64, args), bstr(path), u64(path_cut),
                  u64(len(argv)), *map(bstr, argv), u64(argv_cut), bstr(data))


def exited(t_ns, pid, status):
    return record(t_ns, pid, TR_EXIT, u64(status))


def test_records_become_the_container_format_whatever_the_chunking():
    sin = struct.pack("<H", socket.AF_INET) + struct.pack(">H", 9) + socket.inet_aton("127.0.0.1") + b"\0" * 8
    stream = b"".join([
        syscall(1000, 7, "execve", 0, path=b"/bin/sh", argv=[b"sh", b"-c", b"x"]),
        syscall(2000, 7, "openat", ENOENT, args=((1 << 64) - 100, 0, os.O_RDONLY, 0, 0, 0), path=b"/nope"),
        record(3000, 7, TR_FORK, u64(1), u64(8)),
        syscall(4000, 8, "connect", (1 << 64) - 111, args=(3, 0, 16, 0, 0, 0), data=sin),
        record(5000, 7, TR_SIGNAL, u64(signal.SIGUSR1)),
        exited(6000, 8, 0),
        exited(7000, 7, signal.SIGUSR1),
    ])
    whole, byte_by_byte = GuestTrace(trace.Limits()), GuestTrace(trace.Limits())
    whole.feed(stream)
    for i in range(len(stream)):
        byte_by_byte.feed(stream[i:i + 1])
    rec = whole.finish(timed_out=False)
    assert byte_by_byte.finish(timed_out=False) == rec
    assert rec["pid"] == 7 and rec["signal"] == "SIGUSR1" and rec["exit_code"] is None
    assert rec["events"] == [
        {"t": 1e-06, "pid": 7, "kind": "exec", "syscall": "execve", "path": "/bin/sh", "argv": ["sh", "-c", "x"],
         "result": 0},
        {"t": 2e-06, "pid": 7, "kind": "open", "syscall": "openat", "path": "/nope", "flags": 0, "result": "ENOENT"},
        {"t": 3e-06, "pid": 7, "kind": "fork", "how": "fork", "child": 8},
        {"t": 4e-06, "pid": 8, "kind": "connect", "fd": 3, "address": "127.0.0.1:9", "result": "ECONNREFUSED"},
        {"t": 5e-06, "pid": 7, "kind": "signal", "signal": "SIGUSR1"},
        {"t": 6e-06, "pid": 8, "kind": "exit", "code": 0},
        {"t": 7e-06, "pid": 7, "kind": "exit", "signal": "SIGUSR1"},
    ]
    assert rec["bytes"] == sum(len(json.dumps(e, separators=(",", ":"))) + 1 for e in rec["events"])
    assert rec["duration_s"] == 7e-06


def test_the_record_is_bounded_and_cut_strings_are_marked():
    limits = trace.Limits(max_events=2, max_string=4, max_argv=2)
    gt = GuestTrace(limits)
    gt.feed(syscall(1, 5, "execve", 0, path=b"/bin", path_cut=True, argv=[b"a", b"b"]))
    for i in range(5):
        gt.feed(syscall(2 + i, 5, "open", 3, path=b"/x"))
    gt.feed(exited(10, 5, 0))
    rec = gt.finish(timed_out=True)
    assert rec["events"][0]["path_truncated"] and rec["events"][0]["argv_truncated"]   # argv at max_argv
    assert len(rec["events"]) == 2 and rec["truncated"] and rec["dropped"] == 5
    assert rec["exit_code"] == 0 and rec["timed_out"]


@pytest.mark.parametrize("bad", [
    struct.pack(">I", 1 << 31),                                               # a length to make the host buffer
    record(1, 5, 99),                                                         # no such kind
    syscall(1, 5, "open", 0)[:-4] + struct.pack(">I", 1000),                   # a string past its record
    syscall(1, 5, "execve", 0, argv=[b"a"] * 3),                              # more argv than asked for
    syscall(1, 5, "open", 0, path=b"x" * 5),                                  # a longer string than asked for
])
def test_a_record_the_guest_should_not_send_ends_the_reading(bad):
    gt = GuestTrace(trace.Limits(max_string=4, max_argv=2))
    gt.feed(syscall(1, 5, "open", 3, path=b"/ok") + bad + exited(2, 5, 0))
    assert "error" in gt.finish(timed_out=False)
    assert not gt.buf


def test_a_tracer_that_failed_or_never_ended_gives_an_error():
    gt = GuestTrace(trace.Limits())
    gt.feed(record(1, 5, TR_ERROR, u64(1), bstr(b"seize the command")))
    assert gt.finish(timed_out=False) == {"error": "guest tracer: seize the command: errno 1"}
    gt = GuestTrace(trace.Limits())
    gt.feed(syscall(1, 5, "open", 3, path=b"/x"))
    assert "no end" in gt.finish(timed_out=False)["error"]
