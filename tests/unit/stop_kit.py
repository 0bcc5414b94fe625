"""A stop flag for tests of work that checks one as it goes (a build's
hashing and copies): set once it has been looked at a given number of
times, so a test stops the work at a chosen point of it."""

from __future__ import annotations

import threading


class SetAfter(threading.Event):
    """An event that is set once it has been looked at `n` times."""

    def __init__(self, n: int):
        super().__init__()
        self.left = n

    def is_set(self) -> bool:
        self.left -= 1
        if self.left < 0:
            self.set()
        return super().is_set()
