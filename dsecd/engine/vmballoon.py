"""The idle balloon of running microVMs: an idle guest is made as small as
its working set, an op or pressure gives it its RAM back.

Every `microvm.balloon_interval_s` each running VM's balloon is read (its
size, the guest's memory statistics) and the policy (dsecd/mem/balloon.py)
decides its target. An op on the VM (exec, file op, directory copy, watch,
snapshot of its writable layer, a resume) calls `wake` first: the target
goes back to the whole RAM with one QMP command sent in the background, so
the op waits for nothing (the guest deflates while the op starts; a guest
that needs memory faster takes it from the balloon itself, deflate-on-oom).

Why not DAMON: where the host's DAMON belongs to the machine (a kdamond
dsecd did not start), dsecd must not touch it; the balloon needs only the
guest's cooperation.

Not ballooned, with the reason in `view` (and so in inspect and top):
  - VMs restored from a template and not paused since ("template RAM"):
    their RAM is a private mapping of the template's sealed memfd, and QEMU
    7.2 discards an inflated page by punching a hole in the RAM's file
    (fallocate), refused by the seal (EPERM), before it would drop the
    page from its own mapping (madvise): a page given to the balloon stays
    in QEMU's memory. Inflating them would only take memory from the guest
    and fill QEMU's log; their memory goes back when they are paused (the
    resumed VM runs on anonymous RAM and is ballooned) or destroyed.
  - VMs whose balloon does not answer (a guest without the driver): the
    error, once.
Not pinged: VMs not running, or with their lock held (pause, resume or
snapshot under way), as the watchdog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ..backends.microvm import balloon as qballoon
from ..backends.microvm.qmp import QMPError
from ..config import Config, ConfigError
from ..mem.balloon import BalloonSettings, Decision, Observation, decide, working_set
from .sandboxes import Sandbox, SandboxRegistry

log = logging.getLogger(__name__)

SKIP_TEMPLATE = ("template RAM: its inflated pages would not leave QEMU (QEMU 7.2 discards by punching holes in "
                 "the template's sealed memfd, refused); ballooned once paused and resumed")


def settings_from(cfg: Config) -> BalloonSettings:
    """The policy's settings from the [microvm] section (default.toml says what each is)."""
    vm = cfg.section("microvm")
    try:
        return BalloonSettings(idle_s=float(vm["balloon_idle_s"]), headroom=cfg.size("microvm", "balloon_headroom"),
                               floor=cfg.size("microvm", "balloon_floor"),
                               low_available=cfg.size("microvm", "balloon_low_available"),
                               interval_s=float(vm["balloon_interval_s"]))
    except ValueError as err:        # settings that contradict each other: the start says which
        raise ConfigError(f"microvm: {err}") from None


@dataclass
class VmBalloon:
    """What the service knows of one VM's balloon (runtime only)."""

    qmp: object = None                 # the monitor it was set up on: a new QEMU (resume) is set up again
    ram: int = 0
    target: int = 0                    # last asked for (ram: not ballooned)
    actual: int = 0
    deflate_on_oom: bool = False
    used: int | None = None            # the guest's working set at the last look
    available: int | None = None
    last_op: float = 0.0               # monotonic: the last wake (ops the sandbox's clock misses: file ops)
    skipped: str | None = None         # why it is not ballooned
    inflates: int = 0
    deflates: dict = field(default_factory=dict)     # why -> count
    last_change: str = ""              # the last decision's reason


class BalloonService:
    def __init__(self, registry: SandboxRegistry, settings: BalloonSettings, enabled: bool):
        self.registry = registry
        self.settings = settings
        self.enabled = enabled
        self._vms: dict[str, VmBalloon] = {}
        self._task: asyncio.Task | None = None
        self._wakes: set[asyncio.Task] = set()
        self.totals = {"inflates": 0, "deflates_wake": 0, "deflates_pressure": 0}

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in list(self._wakes):
            t.cancel()

    # ------------------------------------------------------------ ops

    def wake(self, sb: Sandbox) -> None:
        """An op is about to use the VM: its guest gets its whole RAM back.
        Returns at once; the QMP command goes in the background (the op need
        not wait for the guest to deflate)."""
        st = self._vms.get(sb.id)
        if st is None:
            return
        st.last_op = time.monotonic()
        h = sb.handle
        if st.target >= st.ram or h is None or h.qmp is None or h.qmp is not st.qmp:
            return
        task = asyncio.get_running_loop().create_task(self._apply(sb.id, h.qmp, st, Decision(st.ram, "wake")))
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    async def resumed(self, sb: Sandbox) -> None:
        """A resumed VM (a new QEMU, its balloon as the saved state left it):
        a resume is an op, so the guest gets its whole RAM back, as a wake
        would give it; the policy balloons it again once it is idle."""
        if not self.enabled:
            return
        try:
            st = await self._set_up(sb, self._vms.get(sb.id))
            st.last_op = time.monotonic()
            if not st.skipped and st.target < st.ram:
                await self._apply(sb.id, sb.handle.qmp, st, Decision(st.ram, "wake"))
        except (QMPError, OSError, KeyError, TypeError) as err:
            log.warning("sandbox %s: its balloon after the resume does not answer (%s)", sb.id, err)

    # ------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.check(time.monotonic())
            except Exception:
                log.exception("microVM balloon policy")

    async def check(self, now: float) -> None:
        """One pass over the running VMs, one after the other (a QMP round
        trip each, a few ms)."""
        live = set()
        for sb in list(self.registry.by_id.values()):
            h = sb.handle
            if sb.backend != "microvm" or h is None:
                continue
            live.add(sb.id)
            if sb.state != "running" or sb.lock.locked() or h.qmp is None:
                continue
            try:
                await self._check_one(sb, now)
            except (QMPError, OSError, KeyError, TypeError) as err:
                st = self._vms.get(sb.id)
                if st is not None and st.skipped is None:
                    log.warning("sandbox %s: its balloon does not answer (%s); not ballooned", sb.id, err)
                    st.skipped = f"balloon unreadable: {err}"
        for sb_id in set(self._vms) - live:
            del self._vms[sb_id]

    async def _check_one(self, sb: Sandbox, now: float) -> None:
        h = sb.handle
        st = self._vms.get(sb.id)
        if st is None or st.qmp is not h.qmp:
            st = await self._set_up(sb, st)
        if st.skipped:
            return
        last_actual = st.actual
        st.actual = await qballoon.actual(h.qmp)
        stats = await qballoon.guest_stats(h.qmp)
        # Read after QEMU answered, and nothing awaits from here to the
        # target's change (_apply): an op that came meanwhile counts.
        idle_from = max(sb.last_active, st.last_op)
        obs = Observation(ram=st.ram, actual=st.actual, last_actual=last_actual, target=st.target,
                          available=stats.available, idle_for=now - idle_from, busy=sb.execs > 0)
        st.used, st.available = working_set(obs), stats.available
        d = decide(self.settings, obs)
        if d is None:
            return
        if d.why == "pressure":
            st.last_op = now          # busy for another idle_s: its working set grew
        await self._apply(sb.id, h.qmp, st, d)

    async def _set_up(self, sb: Sandbox, old: VmBalloon | None) -> VmBalloon:
        """A VM seen for the first time, or its new QEMU (a resume): the
        guest reports its statistics; the size it has now is the target (a
        VM re-adopted by a restarted daemon may be ballooned)."""
        h = sb.handle
        st = VmBalloon(qmp=h.qmp, ram=h.guest_memory or sb.limits["memory"],
                       last_op=old.last_op if old else 0.0)
        self._vms[sb.id] = st
        if h.machine.ram in ("private", "shared"):
            st.skipped = SKIP_TEMPLATE
            st.target = st.actual = st.ram
            return st
        await qballoon.poll_stats(h.qmp, max(1, round(self.settings.interval_s)))
        st.deflate_on_oom = await qballoon.deflates_on_oom(h.qmp)
        st.actual = await qballoon.actual(h.qmp)
        st.target = st.actual if st.actual < st.ram else st.ram
        return st

    async def _apply(self, sb_id: str, qmp, st: VmBalloon, d: Decision) -> None:
        """Send the target. It is the VM's target before the command goes, so
        that a wake meanwhile sees a ballooned VM and sends its deflate after
        (QMP commands go in order)."""
        before, st.target = st.target, d.target
        try:
            await qballoon.set_target(qmp, d.target)
        except (QMPError, OSError) as err:
            log.warning("sandbox %s: set its balloon to %d MiB (%s): %s", sb_id, d.target >> 20, d.why, err)
            if st.target == d.target:
                st.target = before
            return
        if d.why == "idle":
            st.inflates += 1
            self.totals["inflates"] += 1
        else:
            st.deflates[d.why] = st.deflates.get(d.why, 0) + 1
            if d.why in ("wake", "pressure"):
                self.totals[f"deflates_{d.why}"] += 1
        st.last_change = d.why
        log.info("sandbox %s: balloon target %d -> %d MiB (%s; guest uses %s MiB, RAM %d MiB)", sb_id,
                 before >> 20, d.target >> 20, d.why, "?" if st.used is None else st.used >> 20, st.ram >> 20)

    # ------------------------------------------------------------ reports

    def held(self, sb_id: str) -> int:
        """Guest RAM its balloon holds now (0: none, or not known): the guest
        gets it back on a wake or, short of memory, by itself."""
        st = self._vms.get(sb_id)
        if st is None or st.skipped or not st.actual:
            return 0
        return max(0, st.ram - st.actual)

    def _current(self, sb_id: str) -> VmBalloon | None:
        """The VM's balloon as last seen, if that was of the QEMU it has now:
        a pause that saved the VM ended that QEMU (and its balloon), and a
        resume's new one is set up again (resumed)."""
        st = self._vms.get(sb_id)
        sb = self.registry.by_id.get(sb_id)
        h = None if sb is None else sb.handle
        if st is None or h is None or h.qmp is None or h.qmp is not st.qmp:
            return None
        return st

    def view(self, sb_id: str) -> dict | None:
        """One VM's balloon for inspect and top (None: not seen yet, or its
        QEMU ended by a pause)."""
        st = self._current(sb_id)
        if st is None:
            return None
        return {"ram": st.ram, "guest_size": st.actual, "target": st.target, "deflate_on_oom": st.deflate_on_oom,
                "ballooned": st.target < st.ram, "guest_used": st.used, "guest_available": st.available,
                "skipped": st.skipped, "inflates": st.inflates, "deflates": dict(st.deflates),
                "last_change": st.last_change or None}

    def info(self) -> dict:
        """Totals for the metrics."""
        seen = [st for sb_id in self._vms if (st := self._current(sb_id)) is not None]
        return {"enabled": self.enabled, "vms": len(seen),
                "ballooned": sum(1 for s in seen if s.target < s.ram),
                "skipped": sum(1 for s in seen if s.skipped),
                "held_bytes": sum(max(0, s.ram - s.actual) for s in seen if not s.skipped),
                **self.totals}

