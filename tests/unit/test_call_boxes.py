"""Making an image's call sandbox (dsecd/engine/calls.py _call_box), over a
fake fncall backend: an image rebuilt meanwhile, a host that admits none."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from call_kit import FakeFnCall, call_service, holding_capacity, images_of, room_as_it_is
from loop_kit import workers_on_loop


async def _until(cond) -> None:
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never came")


def test_a_call_sandbox_made_of_an_image_rebuilt_meanwhile_is_not_kept():
    old = SimpleNamespace(layer_digests=["sha256:old"], config={}, source=None)
    new = SimpleNamespace(layer_digests=["sha256:new"], config={}, source=None)
    named = {"py": old}
    making, go_on = threading.Event(), threading.Event()
    seen = {"made": [], "destroyed": [], "released": []}

    class FnCall:
        def create_box(self, box_id, lowerdirs, limits, plan, idmap):
            seen["made"].append(box_id)
            making.set()
            go_on.wait(10)
            return SimpleNamespace(box=box_id)

        def mqueue_dir(self, handle):
            return -1

        def destroy_box(self, box_id, handle):
            seen["destroyed"].append(box_id)

    images = images_of(lambda name: named[name], seen["released"].append)
    store = images.images
    held: dict[str, tuple] = {}
    capacity = holding_capacity(held)

    async def go():
        with workers_on_loop() as workers:
            node = call_service(workers, FnCall(), images, capacity)
            calling = asyncio.ensure_future(node._call_box("py"))
            await asyncio.get_running_loop().run_in_executor(None, making.wait, 10)
            named["py"] = new                   # rebuilt while its call sandbox is made
            for hook in store.changed:
                hook("py")
            await asyncio.sleep(0.01)           # the hook's retire, on the loop
            go_on.set()
            box = await calling
            await _until(lambda: seen["destroyed"])
            return box, node.call_boxes

    box, boxes = asyncio.run(go())
    assert box.layers == ["sha256:new"] and boxes == {"py": box}
    assert seen["destroyed"] == [seen["made"][0]] and seen["released"] == [["sha256:old"]]
    assert list(held) == [box.id]


def test_a_call_refused_by_a_full_host_counts_as_busy():
    """A call whose image needs a call sandbox the host's admission refuses
    (limits.max_sandboxes, CPU or memory) is `busy`, and counted with the
    calls refused busy (info's fncall.busy, dsecd_call_busy_total) as one
    refused at fncall.max_inflight or fncall.max_boxes is."""
    import pytest

    from dsecd.errors import Busy

    image = SimpleNamespace(layer_digests=["sha256:l1"], config={}, source=None)
    images = images_of(lambda name: image)

    def full(box_id, cpu, memory):
        raise Busy("host is full: 2 sandboxes of max 2; retry later or on another host")

    capacity = SimpleNamespace(room_for_call_sandbox=room_as_it_is, hold_call_sandbox=full, release_call_sandbox=lambda box_id: None)

    async def go():
        with workers_on_loop() as workers:
            node = call_service(workers, None, images, capacity)
            with pytest.raises(Busy, match="host is full"):
                await node._call_box("py")
            return node.call_stats["busy"]

    assert asyncio.run(go()) == 1


def test_idle_call_sandboxes_go_for_a_create_once_and_never_serve_a_call_again():
    """A create on a full host drops the idle call sandbox used least
    recently (drop_idle_for_create), never one a call claims, and waits for
    its destroy; a second create at the same time does not count the same
    one (none is left for it: it drops nothing); a call of the dropped
    one's image arriving meanwhile gets a new call sandbox."""
    image = SimpleNamespace(layer_digests=["sha256:l1"], config={}, source=None)
    images = images_of(lambda name: image)
    destroying, go_on = threading.Event(), threading.Event()
    destroyed: list[str] = []

    def destroy(box_id):
        destroying.set()
        go_on.wait(10)
        destroyed.append(box_id)

    held: dict[str, tuple] = {}
    capacity = holding_capacity(held)

    async def go():
        with workers_on_loop() as workers:
            node = call_service(workers, FakeFnCall(destroy), images, capacity)
            old = await node._call_box("old")
            claimed = await node._call_box("claimed")       # a call in flight
            newer = await node._call_box("newer")
            old.claims -= 1
            newer.claims -= 1
            old.last_used, newer.last_used = 1.0, 2.0
            first = asyncio.ensure_future(node.drop_idle_for_create(lambda ids: len(ids) >= 1))
            second = asyncio.ensure_future(node.drop_idle_for_create(lambda ids: len(ids) >= 2))
            await asyncio.get_running_loop().run_in_executor(None, destroying.wait, 10)
            again = await node._call_box("old")      # a call of the dropped one's image, while it goes
            assert again is not old and again.id != old.id
            go_on.set()
            return old, claimed, newer, again, await first, await second, node

    old, claimed, newer, again, first, second, node = asyncio.run(go())
    assert (first, second) == (True, False)
    assert destroyed == [old.id] and set(held) == {claimed.id, newer.id, again.id}
    assert node.call_boxes == {"claimed": claimed, "newer": newer, "old": again}
    assert node.call_stats["dropped_for_creates"] == 1


def test_a_create_whose_dropped_call_sandbox_is_not_destroyed_in_time_drops_no_more(monkeypatch):
    """A dropped call sandbox whose destroy does not end within DROP_WAIT_S
    (one that fails is tried again later) still holds the room: the drop
    answers False, so the create is refused instead of dropping the next
    idle one, and the next."""
    from dsecd.engine import calls

    monkeypatch.setattr(calls, "DROP_WAIT_S", 0.05)
    image = SimpleNamespace(layer_digests=["sha256:l1"], config={}, source=None)
    images = images_of(lambda name: image)
    go_on = threading.Event()


    held: dict[str, tuple] = {}

    async def go():
        with workers_on_loop() as workers:
            node = call_service(workers, FakeFnCall(lambda box_id: go_on.wait(10)), images, holding_capacity(held))
            for name in ("a", "b"):
                (await node._call_box(name)).claims -= 1
            try:
                return await node.drop_idle_for_create(lambda ids: len(ids) >= 1), node
            finally:
                go_on.set()

    answer, node = asyncio.run(go())
    assert answer is False
    assert len(node.call_boxes) == 1 and node.call_stats["dropped_for_creates"] == 1
