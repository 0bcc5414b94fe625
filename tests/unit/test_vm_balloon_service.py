"""The idle-balloon service (dsecd/engine/vmballoon.py) without QEMU: a fake
monitor whose guest reaches each target at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from dsecd.engine.vmballoon import BalloonService
from dsecd.mem.balloon import BalloonSettings

MiB = 1 << 20
S = BalloonSettings(idle_s=10, headroom=64 * MiB, floor=64 * MiB, low_available=16 * MiB, interval_s=1)


class FakeQMP:
    """A 256 MiB guest that uses `used` bytes of its size and goes to each target."""

    def __init__(self, used: int = 40 * MiB):
        self.actual, self.used, self.commands = 256 * MiB, used, []
        self.gate: asyncio.Event | None = None      # set: query-balloon waits for it (a slow answer)

    async def command(self, name, args=None):
        self.commands.append((name, args))
        if name == "query-balloon":
            if self.gate is not None:
                await self.gate.wait()
            return {"actual": self.actual}
        if name == "qom-get" and args["property"] == "guest-stats":
            return {"stats": {"stat-available-memory": self.actual - self.used}, "last-update": 1}
        if name == "qom-get" and args["property"] == "deflate-on-oom":
            return True
        if name == "balloon":
            self.actual = args["value"]
        return {}

    def targets(self) -> list[int]:
        return [a["value"] >> 20 for n, a in self.commands if n == "balloon"]


def _sb(ram: str = "anon", idle: float = 60.0):
    qmp = FakeQMP()
    h = SimpleNamespace(qmp=qmp, guest_memory=256 * MiB, machine=SimpleNamespace(ram=ram))
    return SimpleNamespace(id="vm1", backend="microvm", state="running", lock=asyncio.Lock(), handle=h,
                           last_active=time.monotonic() - idle, execs=0, limits={"memory": 256 * MiB})


def _service(sb) -> BalloonService:
    return BalloonService(SimpleNamespace(by_id={sb.id: sb}), S, enabled=True)


def test_idle_balloons_and_a_wake_deflates_in_the_background():
    sb = _sb()

    async def run():
        svc = _service(sb)
        await svc.check(time.monotonic())
        assert sb.handle.qmp.targets() == [104]                # 40 used + 64 headroom
        assert svc.view(sb.id)["ballooned"] and svc.info()["held_bytes"] == 0   # seen before the guest got there
        svc.wake(sb)                                           # returns at once; the command follows
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert sb.handle.qmp.targets() == [104, 256]
        assert svc.view(sb.id)["deflates"] == {"wake": 1}
        await svc.check(time.monotonic())                      # just used: not ballooned again
        assert sb.handle.qmp.targets() == [104, 256]

    asyncio.run(run())


def test_a_wake_while_the_policy_waits_for_qemu_wins():
    sb = _sb()

    async def run():
        svc = _service(sb)
        await svc.check(time.monotonic())                      # set up; ballooned to 104
        svc.wake(sb)
        await asyncio.sleep(0)
        sb.last_active = time.monotonic() - 60                 # idle again
        qmp = sb.handle.qmp
        qmp.gate = asyncio.Event()
        check = asyncio.ensure_future(svc.check(time.monotonic()))
        await asyncio.sleep(0.01)                              # the pass waits on query-balloon
        svc.wake(sb)                                           # an exec starts meanwhile
        qmp.gate.set()
        await check
        assert qmp.targets()[-1] == 256, qmp.targets()

    asyncio.run(run())


def test_a_template_restore_is_skipped_and_never_sent_a_target():
    sb = _sb(ram="private")

    async def run():
        svc = _service(sb)
        await svc.check(time.monotonic())
        view = svc.view(sb.id)
        assert "template" in view["skipped"] and not view["ballooned"]
        assert sb.handle.qmp.commands == []
        assert svc.info()["skipped"] == 1

    asyncio.run(run())


def test_a_resumed_vm_gets_its_ram_back():
    sb = _sb()

    async def run():
        svc = _service(sb)
        await svc.check(time.monotonic())
        sb.handle.qmp = FakeQMP()                              # the new QEMU of a resume,
        sb.handle.qmp.actual = 104 * MiB                       # its balloon as the state left it
        await svc.resumed(sb)
        assert sb.handle.qmp.targets() == [256]
        assert svc.view(sb.id)["target"] == 256 * MiB

    asyncio.run(run())
