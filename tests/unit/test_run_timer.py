"""RunTimer: an exec's timeout counts the time its sandbox runs (no root)."""

import time

from dsecd.execio import PAUSED_LOOK_S, RunTimer


class Pauses:
    """A sandbox's paused_for: the time paused so far, a pause going on included."""

    def __init__(self):
        self.total, self.since = 0.0, None

    def pause(self):
        self.since = time.monotonic()

    def resume(self):
        self.total, self.since = self(), None

    def __call__(self):
        return self.total + (time.monotonic() - self.since if self.since is not None else 0.0)


def test_paused_time_does_not_count_and_looks_have_a_floor():
    pauses = Pauses()
    timer = RunTimer(0.05, pauses)
    time.sleep(0.03)
    pauses.pause()
    time.sleep(0.06)
    assert not timer.expired()           # 90 ms of wall time, 30 of them run
    assert timer.until_next_look() >= PAUSED_LOOK_S    # not a wake-up per millisecond left
    pauses.resume()
    time.sleep(0.03)
    assert timer.expired()


def test_an_unpaused_run_times_out_on_time():
    timer = RunTimer(0.02)
    assert 0 < timer.until_next_look() <= 0.02
    time.sleep(0.03)
    assert timer.expired() and timer.until_next_look() == 0.0
