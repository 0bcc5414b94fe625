"""The balloon policy against a fake VM backend (no VM backend exists yet)."""

import pytest

from dsecd.mem.balloon import BalloonPolicy

MiB = 1 << 20


class FakeBalloon:
    """A guest with `memory` bytes that can give back at most `givable` of them."""

    def __init__(self, memory: int, givable: int):
        self.memory, self.givable, self.held = memory, givable, 0
        self.targets: list[int] = []

    def guest_memory(self) -> int:
        return self.memory

    def inflated(self) -> int:
        return self.held

    def set_target(self, target: int) -> int:
        self.targets.append(target)
        self.held = min(target, self.givable)
        return self.held


def test_pause_inflates_to_the_floor_and_resume_deflates():
    b = FakeBalloon(1024 * MiB, givable=2048 * MiB)
    pol = BalloonPolicy(floor_bytes=64 * MiB)
    assert pol.on_pause(b) == 960 * MiB
    assert b.held == 960 * MiB
    assert pol.on_resume(b) == 960 * MiB and b.held == 0


def test_a_guest_that_gives_less_is_reported_truthfully():
    b = FakeBalloon(1024 * MiB, givable=300 * MiB)
    assert BalloonPolicy().on_pause(b) == 300 * MiB


def test_pressure_takes_a_share_of_free_memory_and_never_deflates():
    b = FakeBalloon(1024 * MiB, givable=2048 * MiB)
    pol = BalloonPolicy(floor_bytes=64 * MiB, pressure_share=0.5)
    assert pol.on_pressure(b, guest_free=400 * MiB) == 200 * MiB
    assert pol.on_pressure(b, guest_free=0) == 0 and b.held == 200 * MiB
    assert pol.on_pressure(b, guest_free=10_000 * MiB) == 760 * MiB    # capped at memory - floor


@pytest.mark.parametrize("kw", [{"floor_bytes": -1}, {"pressure_share": 1.5}])
def test_bad_policy(kw):
    with pytest.raises(ValueError):
        BalloonPolicy(**kw)
