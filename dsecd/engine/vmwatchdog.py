"""The liveness check of running microVMs: a guest that hangs is ended.

A guest that panics ends its QEMU at once (panic=-1 with -no-reboot), and
the pidfd watch (LifecycleService.watch) reports it dead. A guest that hangs
(its kernel deadlocked, its agent stuck, QEMU itself stopped) does not: so
every `microvm.watchdog_interval_s` each running VM's agent is pinged
(agent wire PING), and one that has not answered for
`microvm.watchdog_timeout_s` has its QEMU killed (SIGKILL by pidfd); the
watch then reports it dead, with reason "hung", and cleans it up like any
VM whose QEMU exited.

Not pinged: VMs not running (creating, paused, stopping) and VMs whose lock
is held (a pause, resume or snapshot is under way: a snapshot's agent is
busy streaming the writable layer and answers nothing else meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..backends.microvm import wire
from ..backends.microvm.agent import AgentError
from .sandboxes import SandboxRegistry

log = logging.getLogger(__name__)


class VmWatchdog:
    def __init__(self, registry: SandboxRegistry, interval: float, timeout: float):
        self.registry = registry
        self.interval, self.timeout = float(interval), float(timeout)
        self._task: asyncio.Task | None = None
        self._pings: dict[str, asyncio.Task] = {}
        self._last_answer: dict[str, float] = {}

    def start(self) -> None:
        if self.interval > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in self._pings.values():
            t.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.check(time.monotonic())
            except Exception:
                log.exception("microVM watchdog")

    def check(self, now: float) -> None:
        """One pass: ping the running VMs that have no ping in flight; kill
        those silent for longer than the timeout."""
        live = set()
        for sb in list(self.registry.by_id.values()):
            h = sb.handle
            if sb.backend != "microvm" or sb.state != "running" or h is None or sb.lock.locked():
                continue
            if h.agent is None or h.agent.closed or h.pidfd < 0:
                continue
            live.add(sb.id)
            last = self._last_answer.setdefault(sb.id, now)
            if now - last > self.timeout:
                self._kill(sb, now - last)
                continue
            if sb.id not in self._pings:
                task = asyncio.get_running_loop().create_task(self._ping(sb.id, h.agent))
                self._pings[sb.id] = task
                task.add_done_callback(lambda _t, i=sb.id: self._pings.pop(i, None))
        for sb_id in list(self._last_answer):
            if sb_id not in live:          # gone, paused or busy: its clock starts again when it runs
                self._last_answer.pop(sb_id, None)

    async def _ping(self, sb_id: str, link) -> None:
        try:
            await link.request(wire.PING)
        except AgentError:
            pass                           # an answer all the same (an agent older than PING says ENOSYS)
        except (OSError, asyncio.CancelledError):
            return                         # the channel closed: the VM's end is reported by its watch
        self._last_answer[sb_id] = time.monotonic()

    def _kill(self, sb, silent_s: float) -> None:
        h = sb.handle
        log.error("sandbox %s: its microVM's agent has not answered for %.0f s (microvm.watchdog_timeout_s "
                  "%.0f): the guest hangs; killing QEMU %d (serial log: %s)", sb.id, silent_s, self.timeout,
                  h.init_pid, h.vm_dir / "serial.log")
        h.extra["died_because"] = "hung"
        self._last_answer.pop(sb.id, None)
        try:
            h.kill()
        except OSError as err:
            log.error("sandbox %s: kill QEMU %d: %s", sb.id, h.init_pid, err)
