"""Locks that the callers of one key take in the order they came, each kept
only while someone holds or waits for it: a connection's requests feeding
one not yet started (server.py, Connection.started), the inputs of one
background process on their way to its stdin (engine/procs.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar


class Turn:
    """One key's lock (asyncio.Lock wakes its waiters first come, first
    served) and `users`: how many hold or wait for it (0: it goes)."""

    def __init__(self):
        self.lock = asyncio.Lock()
        self.users = 0


K = TypeVar("K")
T = TypeVar("T", bound=Turn)


class Turns(Generic[K, T]):
    """The turns of the keys someone holds or waits for, each made by
    `make` (a Turn, or a subclass carrying more) as its first caller comes
    and dropped as its last one leaves: one per key at a time, none left
    behind by callers that went through or were cancelled waiting."""

    def __init__(self, make: Callable[[], T]):
        self._make = make
        self._by_key: dict[K, T] = {}

    def get(self, key: K) -> T | None:
        """The turn of `key` someone holds or waits for, or None."""
        return self._by_key.get(key)

    def __len__(self) -> int:
        return len(self._by_key)

    @contextlib.asynccontextmanager
    async def taken(self, key: K) -> AsyncIterator[T]:
        """Holds the lock of `key`'s turn (made if none is held or waited
        for) for the with block, after the callers that came before."""
        turn = self._by_key.get(key)
        if turn is None:
            turn = self._by_key[key] = self._make()
        turn.users += 1
        try:
            async with turn.lock:
                yield turn
        finally:
            turn.users -= 1
            if not turn.users and self._by_key.get(key) is turn:
                del self._by_key[key]
