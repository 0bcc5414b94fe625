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
            try:
                fn()
            except Exception:
                log.exception("%s: undo step %r failed", self.what, name)
