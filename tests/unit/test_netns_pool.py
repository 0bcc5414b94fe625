"""The netns pool's thread (dsecd/net/pool.py) also runs the network
records' compaction; a compaction that keeps failing (the state dir's disk
full) is retried after a pause, not in a loop that takes a core."""

from __future__ import annotations

import time

from dsecd.net.pool import NetnsPool


def test_a_failing_housekeeping_is_retried_after_a_pause():
    tries = []

    def compact():
        tries.append(time.monotonic())
        raise OSError(28, "No space left on device")

    pool = NetnsPool(0, make=lambda: None, destroy=lambda r: None, housekeeping=compact, wanted=lambda: True)
    try:
        deadline = time.monotonic() + 10
        while not tries and time.monotonic() < deadline:      # the thread's first try, however late
            time.sleep(0.01)
        time.sleep(0.5)
    finally:
        pool.close()
    assert 1 <= len(tries) <= 2, len(tries)
