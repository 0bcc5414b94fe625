"""A fast slice of the daemon fuzzing: a real dsecd, a few thousand hostile
inputs, every answer checked, nothing left behind. The 100k run is `make fuzz`.

Needs root (the daemon makes namespaces and cgroups); each run gets its own
socket, state dir and cgroup subtree `dsecd-test-<random>`, removed even on
failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import fuzz_frames as ff
import fuzz_harness
import pytest

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
    findings = fuzz_harness.campaign(target, n_inputs=1200, seed=5, mutants=3, deadline_s=10)
    assert findings.inputs >= 1200
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


@pytest.mark.xfail(strict=True, reason="fuzz finding: node._destroy is not cancellation-safe; a "
                   "cancelled destroy strands the sandbox in `stopping` (docs/hardening.md)")
def test_a_cancelled_destroy_still_finishes():
    import socket
    import time

    import msgpack

    from dsecd import protocol

    def frame(obj) -> bytes:
        payload = msgpack.packb(obj, use_bin_type=True)
        return protocol.HEADER.pack(len(payload)) + payload

    t = fuzz_harness.FuzzTarget(fuzz_harness.busybox_rootfs())
    try:
        t.start()
        sb = t.target
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(t.daemon.socket)
            s.sendall(frame({"id": 0, "op": "hello", "args": {"protocol": protocol.PROTOCOL_VERSION}}))
            s.sendall(frame({"id": 1, "op": "destroy", "args": {"sandbox": sb, "force": True}})
                      + frame({"id": 2, "op": "cancel", "args": {"target": 1}}))
            time.sleep(0.5)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if sb not in {x["id"] for x in t.control("list")["sandboxes"]}:
                break
            time.sleep(0.2)
        # The client gave up on the answer, not on the destroy: it must complete.
        assert sb not in {x["id"] for x in t.control("list")["sandboxes"]}
    finally:
        t.close()
