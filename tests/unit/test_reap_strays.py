"""execio.reap_strays: the daemon reaps what a helper exec cloned onto it
(CLONE_PARENT), but never a sandbox's init, whose end and exit status are
waited for elsewhere (a reap here left that wait ECHILD, and a pid reused
since would have it wait for a stranger)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from dsecd import execio

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a pid namespace of its own: root")


def test_a_namespaces_init_is_told_from_the_others():
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "30"])
    kids = []
    try:
        deadline = time.monotonic() + 5
        while not (kids := open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert execio._is_ns_init(int(kids[0]))          # sleep: pid 1 of the new namespace
        assert not execio._is_ns_init(p.pid) and not execio._is_ns_init(os.getpid())
    finally:
        for pid in [*kids, p.pid]:
            os.kill(int(pid), signal.SIGKILL)
        p.wait()
