"""The idle-balloon policy's decisions (dsecd/mem/balloon.py); the service
that applies them to real guests is tested in
tests/integration/test_microvm_balloon.py."""

import pytest

from dsecd.config import load_config
from dsecd.engine.vmballoon import settings_from
from dsecd.mem.balloon import BalloonSettings, Observation, decide, working_set

MiB = 1 << 20
S = BalloonSettings(idle_s=30, headroom=64 * MiB, floor=96 * MiB, low_available=24 * MiB, interval_s=2)


def obs(**kw) -> Observation:
    kw.setdefault("last_actual", kw.get("actual", 512 * MiB))
    base = {"ram": 512 * MiB, "actual": 512 * MiB, "target": 512 * MiB, "available": 412 * MiB,
            "idle_for": 60.0, "busy": False}
    return Observation(**{**base, **kw})


def test_an_idle_guest_goes_to_its_working_set_plus_headroom():
    d = decide(S, obs(available=412 * MiB))          # uses 100 MiB of its 512
    assert (d.target, d.why) == (164 * MiB, "idle")


def test_never_below_the_floor_nor_above_the_ram():
    assert decide(S, obs(available=490 * MiB)).target == 96 * MiB
    assert decide(S, obs(available=72 * MiB)) is None          # 440 + 64: within a step of its RAM


def test_a_busy_or_recent_guest_is_not_ballooned_and_is_woken():
    assert decide(S, obs(idle_for=5.0)) is None
    assert decide(S, obs(busy=True)) is None
    d = decide(S, obs(idle_for=5.0, target=164 * MiB, actual=164 * MiB, available=64 * MiB))
    assert (d.target, d.why) == (512 * MiB, "wake")


def test_pressure_deflates_an_idle_guest():
    low = obs(target=164 * MiB, actual=164 * MiB, available=10 * MiB)
    assert decide(S, low).why == "pressure" and decide(S, low).target == 512 * MiB
    took_back = obs(target=164 * MiB, actual=300 * MiB, last_actual=290 * MiB, available=100 * MiB)
    assert decide(S, took_back).why == "pressure"          # deflate-on-oom
    inflating = obs(target=164 * MiB, actual=300 * MiB, last_actual=400 * MiB, available=200 * MiB)
    assert decide(S, inflating) is None                     # on its way down: no new target meanwhile


def test_the_working_set_is_the_guests_size_less_what_is_available():
    # The balloon's pages are not in it (the guest's size excludes them),
    # the kernel's reserve outside MemTotal is.
    assert working_set(obs(actual=164 * MiB, target=164 * MiB, available=64 * MiB)) == 100 * MiB
    assert decide(S, obs(actual=164 * MiB, target=164 * MiB, available=64 * MiB)) is None
    assert working_set(obs(available=None)) is None


def test_a_working_set_that_grew_while_idle_grows_the_target():
    d = decide(S, obs(actual=164 * MiB, target=164 * MiB, available=44 * MiB))     # uses 120 MiB, was 100
    assert (d.target, d.why) == (184 * MiB, "grow")


def test_no_statistics_no_change():
    assert decide(S, obs(available=None)) is None


@pytest.mark.parametrize("kw", [{"idle_s": 0}, {"headroom": -1}, {"low_available": 64 * MiB}])
def test_bad_settings(kw):
    with pytest.raises(ValueError):
        BalloonSettings(**{**S.__dict__, **kw})


def test_the_shipped_settings_are_the_codes_defaults():
    assert settings_from(load_config(None)) == BalloonSettings()
