"""Fakes for unit tests of call sandboxes (dsecd/engine/calls.py CallService):
the host's admission as CallService sees it (its `capacity`: CreateService's
call-sandbox side), an image store, and the service built over them."""

from __future__ import annotations

from types import SimpleNamespace

from dsecd.engine.calls import CallService
from dsecd.engine.execs import ExecLimits
from dsecd.engine.starts import ProcessStarter


async def room_as_it_is(cpu, memory) -> None:
    """Nothing to drop for a call sandbox's room."""


def holding_capacity(held: dict) -> SimpleNamespace:
    """A host that admits every call sandbox, recording it in `held`
    (box id -> (cpu, memory)) until it is released."""
    return SimpleNamespace(room_for_call_sandbox=room_as_it_is,
                           hold_call_sandbox=lambda box_id, cpu, memory: held.setdefault(box_id, (cpu, memory)),
                           release_call_sandbox=lambda box_id: held.pop(box_id))


def images_of(get, release=lambda digests: None) -> SimpleNamespace:
    """An image service whose store answers get(name), whose layers mount
    as nothing and are given back to release(digests)."""
    store = SimpleNamespace(get=get, changed=[], key=lambda name: name)
    return SimpleNamespace(images=store, layers=SimpleNamespace(acquire=lambda digests: [], release=release))


def call_service(workers, fncall, images, capacity, ranges=None) -> CallService:
    """A CallService over fakes: call sandboxes of one CPU and 64M, four
    call uids from 60000, no fncall.max_boxes; `ranges`: its id ranges
    (default: one range, given back to nobody)."""
    limits = ExecLimits(max_timeout_s=0, drain_grace_s=0.1, max_output=1 << 20, max_trace=0)
    return CallService(fncall, {"cpu": 1, "memory": "64M", "pids": 64, "qos": "be", "uid_base": 60000,
                                "uid_count": 4, "max_boxes": 0}, {}, 100_000, images,
                       SimpleNamespace(plan=lambda qos: None), workers, ProcessStarter(workers), limits, -1,
                       ranges or SimpleNamespace(take=lambda: "range", give_back=lambda idmap: None), capacity)


class FakeFnCall:
    """A fncall backend whose call sandboxes are namespaces and whose
    destroy calls on_destroy(box_id) (which may block, as a slow one does)."""

    def __init__(self, on_destroy=lambda box_id: None):
        self.on_destroy = on_destroy

    def create_box(self, box_id, lowerdirs, limits, plan, idmap):
        return SimpleNamespace(box=box_id)

    def mqueue_dir(self, handle):
        return -1

    def destroy_box(self, box_id, handle):
        self.on_destroy(box_id)
