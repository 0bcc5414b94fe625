"""A fake of the host's admission as CallService sees it (its `capacity`:
CreateService's call-sandbox side), for unit tests of call sandboxes."""

from __future__ import annotations

from types import SimpleNamespace


async def room_as_it_is(cpu, memory) -> None:
    """Nothing to drop for a call sandbox's room."""


def holding_capacity(held: dict) -> SimpleNamespace:
    """A host that admits every call sandbox, recording it in `held`
    (box id -> (cpu, memory)) until it is released."""
    return SimpleNamespace(room_for_call_sandbox=room_as_it_is,
                           hold_call_sandbox=lambda box_id, cpu, memory: held.setdefault(box_id, (cpu, memory)),
                           release_call_sandbox=lambda box_id: held.pop(box_id))
