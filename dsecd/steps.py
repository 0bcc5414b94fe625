"""Setup as a checklist: named steps, each registering its undo as it goes.

    with Steps("create sandbox abc") as steps:
        make_dir(); steps.undo("remove dir", remove_dir)
        ...
        steps.commit()          # keep everything

If the block raises before commit(), the undos run in reverse order (each one's
own failure is logged, not raised, so one stuck resource cannot hide the rest)
and the original error propagates.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class Steps:
    def __init__(self, what: str):
        self.what = what
        self._undos: list[tuple[str, Callable[[], object]]] = []
        self._committed = False

    def undo(self, name: str, fn: Callable[[], object]) -> None:
        self._undos.append((name, fn))

    def commit(self) -> None:
        self._committed = True

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._committed or exc_type is None:
            return
        for name, fn in reversed(self._undos):
            self._run_undo(name, fn)

    def _run_undo(self, name: str, fn: Callable[[], object]) -> object:
        """fn()'s result; its failure logged, not raised, so the other undos still run."""
        try:
            return fn()
        except Exception:
            log.exception("%s: undo step %r failed", self.what, name)
            return None


class AsyncSteps(Steps):
    """Steps for an async setup (a create): an undo may return an awaitable,
    and some undos can be handed over to work that outlives the request.

        async with AsyncSteps("create sandbox abc") as steps:
            allocate(); steps.undo("release ids", release_ids)
            release = steps.hand_over("release ids")   # a spawn's abandon handler runs it once
            ...
            steps.commit()

    On an exception before commit() the undos run in reverse order; each
    one's failure is logged, not raised, and the original error propagates.
    A cancelled request runs them too, shielded from a second cancel.
    """

    def drop(self, name: str) -> None:
        """The step's undo is no longer this checklist's (another step took the thing over)."""
        self._undos = [(n, f) for n, f in self._undos if n != name]

    def hand_over(self, *names: str) -> Callable[[], None]:
        """The undos `names` (synchronous ones), taken out of this checklist,
        as one callable that runs them in reverse order, once, whoever calls
        it first: for work that may outlive this request and must release
        them only when it is over."""
        taken = [(n, f) for n, f in self._undos if n in names]
        missing = set(names) - {n for n, _ in taken}
        if missing:
            raise ValueError(f"{self.what}: no undo step named {sorted(missing)}")
        self._undos = [(n, f) for n, f in self._undos if n not in names]
        done = False

        def run() -> None:
            nonlocal done
            if done:
                return
            done = True
            for name, fn in reversed(taken):
                self._run_undo(name, fn)

        return run

    async def __aenter__(self) -> AsyncSteps:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self._committed or exc_type is None:
            return
        await asyncio.shield(self._rollback())

    async def _rollback(self) -> None:
        for name, fn in reversed(self._undos):
            result = self._run_undo(name, fn)
            if inspect.isawaitable(result):
                try:
                    await result
                except Exception:
                    log.exception("%s: undo step %r failed", self.what, name)
