"""Which pauses a directory copy under way undoes (dsecd/engine/dircopies.py
DirCopyService._on_event): a sandbox is resumed for a copy a freeze stops."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dsecd.engine.dircopies import DirCopyService
from dsecd.engine.events import EventBus


@pytest.mark.parametrize("backend,putting,resumed", [
    ("container", 1, True),         # its copier, frozen, writes the files in
    ("container", 0, False),        # a copy out is read from the host: no freeze stops it
    ("microvm", 0, True),           # the guest's agent runs a copy out too
])
def test_a_pause_is_undone_only_for_a_copy_it_stops(backend, putting, resumed):
    async def go() -> list:
        sb = SimpleNamespace(id="sb1", backend=backend, copies=1)
        asked = []

        async def ensure_running(s, why):
            asked.append((s.id, why))

        events = EventBus()
        svc = DirCopyService(SimpleNamespace(by_id={"sb1": sb}), SimpleNamespace(loop=asyncio.get_running_loop()),
                             ensure_running, 1 << 20, 100, 1 << 20, 4, 30.0, None, events=events)
        if putting:
            svc._putting["sb1"] = putting
        events.publish("paused", "sb1")
        await asyncio.sleep(0)
        await asyncio.gather(*svc._resuming)
        return asked

    assert asyncio.run(go()) == ([("sb1", "its directory copy under way")] if resumed else [])
