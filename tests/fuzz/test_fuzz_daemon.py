"""A fast slice of the daemon fuzzing: a real dsecd, a few thousand hostile
inputs, every answer checked, nothing left behind. The 100k run is `make fuzz`.

Needs root (the daemon makes namespaces and cgroups); each run gets its own
socket, state dir and cgroup subtree `dsecd-test-<random>`, removed even on
failure.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import fuzz_frames as ff
import fuzz_harness
import msgpack
import pytest

from dsecd import protocol

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/bin/busybox").exists(),
    reason="daemon fuzzing needs root and busybox-static (like tests/integration)")


@pytest.fixture(scope="module")
def target():
    t = fuzz_harness.FuzzTarget(fuzz_harness.busybox_rootfs())
    try:
        t.start()
        yield t
    finally:
        t.close()


def _report(findings: fuzz_harness.Findings) -> str:
    return "\n".join(f"{kind}: {item}" for kind in ("internal", "malformed", "hangs", "crashes")
                     for item in getattr(findings, kind)[:5])


def test_hostile_sessions_get_documented_answers_only(target):
    findings = fuzz_harness.campaign(target, n_inputs=800, seed=5, mutants=3, deadline_s=10)
    assert findings.inputs >= 800
    assert findings.answers > findings.sessions        # the daemon did answer
    assert findings.problems() == 0, _report(findings)
    assert findings.orphans == []


def test_nothing_leaks_after_the_run(target):
    findings = fuzz_harness.campaign(target, n_inputs=300, seed=6, mutants=1, deadline_s=10)
    assert findings.problems() == 0, _report(findings)
    leaks = target.leaks()
    assert leaks == {"sandboxes": [], "images": [], "cgroups": [], "mounts": [],
                     "child_processes": [], "fd_growth": 0}
    target.ensure_target()


def test_the_oracle_flags_internal_and_malformed_answers():
    # The checks must be able to fail: feed them answers a buggy daemon would send.
    f = fuzz_harness.Findings()
    sent = {4: ff.Input("request", b"", 4, "ping", {"id": 4, "op": "ping"})}
    fuzz_harness._check_frame({"id": 4, "error": {"code": "internal", "message": "x",
                                                  "detail": {}}}, f, sent)
    fuzz_harness._check_frame({"id": 5, "error": {"code": "oops", "message": "x"}}, f, sent)
    fuzz_harness._check_frame({"id": 6, "result": {}, "error": {}}, f, sent)
    fuzz_harness._check_frame([1, 2], f, sent)
    assert len(f.internal) == 1 and "'op': 'ping'" in f.internal[0]["request"]
    assert len(f.malformed) == 3


def _frame(obj) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return protocol.HEADER.pack(len(payload)) + payload


def _ask(target, frames: list[dict], wait: float = 5.0) -> list[dict]:
    """Send hello + frames on a raw connection; the final answers, in order."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(target.daemon.socket)
        s.settimeout(wait)
        s.sendall(_frame({"id": 0, "op": "hello",
                          "args": {"protocol": protocol.PROTOCOL_VERSION}}))
        s.sendall(b"".join(_frame(f) for f in frames))
        dec, out = protocol.FrameDecoder(1 << 26), []
        while len(out) < len(frames) + 1:
            data = s.recv(1 << 20)
            if not data:
                break
            out += [f for f in dec.feed(data) if "stream" not in f]
    return out[1:]


# Fuzz findings, reduced to one request each (docs/hardening.md).
@pytest.mark.parametrize("args", [{"cwd": "relative"}, {"cwd": "/a\0b"}, {"user": -9},
                                  {"user": 2**32}],
                         ids=["relative-cwd", "nul-cwd", "negative-user", "huge-user"])
def test_bad_exec_fields_are_bad_request(target, args):
    target.ensure_target()
    (answer,) = _ask(target, [{"id": 1, "op": "exec", "args": {
        "sandbox": target.target, "argv": ["true"], "stream": False, **args}}])
    assert answer["error"]["code"] == "bad_request", answer


# Fuzz finding, fixed: a cancel read in the same burst as its target cancelled a
# task that never started: no final frame, id stuck in flight (server.py).
def test_a_request_cancelled_before_it_starts_still_gets_its_final_frame(target):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(target.daemon.socket)
        s.settimeout(3)
        s.sendall(_frame({"id": 0, "op": "hello", "args": {"protocol": protocol.PROTOCOL_VERSION}}))
        # One write: the server reads both frames before either task runs.
        s.sendall(_frame({"id": 2, "op": "cancel", "args": {"target": 4}})
                  + _frame({"id": 4, "op": "ping", "args": {}}))
        dec, got = protocol.FrameDecoder(1 << 24), {}
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not {2, 4} <= set(got):
            try:
                data = s.recv(1 << 20)
            except TimeoutError:
                break
            got.update({f["id"]: f for f in dec.feed(data)})
    assert 4 in got, f"request 4 got no final frame; answers: {sorted(got, key=str)}"


# Fuzz finding, fixed: a cancelled destroy stranded the sandbox in `stopping`.
def test_a_cancelled_destroy_still_finishes(target):
    # Last in this module: when it fails, the module's daemon keeps a stuck sandbox.
    target.ensure_target()
    sb = target.target
    answers = _ask(target, [{"id": 1, "op": "destroy", "args": {"sandbox": sb, "force": True}},
                            {"id": 2, "op": "cancel", "args": {"target": 1}}])
    assert {a["id"] for a in answers} == {1, 2}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and \
            sb in {x["id"] for x in target.control("list")["sandboxes"]}:
        time.sleep(0.2)
    # The client gave up on the answer, not on the destroy: it must complete.
    assert sb not in {x["id"] for x in target.control("list")["sandboxes"]}
