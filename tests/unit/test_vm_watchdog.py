"""The microVM watchdog (dsecd/engine/vmwatchdog.py) without QEMU: stand-in
VMs whose agent answers, answers an error, or never answers."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

from dsecd import native
from dsecd.backends.microvm.agent import AgentError
from dsecd.backends.microvm.backend import VmHandle
from dsecd.engine.vmwatchdog import VmWatchdog


class Link:
    closed = False

    def __init__(self, answer):
        self.answer = answer

    async def request(self, kind):
        if self.answer == "error":
            raise AgentError(errno.ENOSYS, "unknown request type")
        if self.answer == "never":
            await asyncio.Event().wait()


def _vm(sb_id: str, answer: str, proc: subprocess.Popen):
    h = VmHandle(init_pid=proc.pid, init_start=0, pidfd=native.pidfd_open(proc.pid), group=None,
                 vm_dir=Path("/nonexistent"), is_child=False, accel="tcg", agent=Link(answer))
    return SimpleNamespace(id=sb_id, backend="microvm", state="running", lock=asyncio.Lock(), handle=h)


def test_a_silent_agent_gets_its_qemu_killed_and_an_answer_of_any_kind_counts():
    procs = {k: subprocess.Popen(["sleep", "60"]) for k in ("ok", "error", "never")}
    sbs = {}
    try:
        sbs.update({k: _vm(k, k, p) for k, p in procs.items()})

        async def run():
            w = VmWatchdog(SimpleNamespace(by_id=sbs), interval=0.05, timeout=0.5)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and procs["never"].poll() is None:
                w.check(time.monotonic())
                await asyncio.sleep(0.05)
            w.stop()

        asyncio.run(run())
        assert procs["never"].wait(5) == -9
        assert sbs["never"].handle.extra["died_because"] == "hung"
        assert procs["ok"].poll() is None and procs["error"].poll() is None
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        for sb in sbs.values():
            os.close(sb.handle.pidfd)
