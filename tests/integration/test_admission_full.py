"""`dsec info`'s admission state against every limit a create meets."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from dsecd.errors import BadRequest, Busy, NotFound


def _memory_capacity(nbytes: int) -> str:
    """A [cpu] table that makes the host's memory capacity `nbytes`."""
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    return f"[cpu]\nmemory_oversubscription = {nbytes / total!r}\n"


def test_admission_is_full_once_the_host_holds_max_sandboxes(daemon_factory, busybox_rootfs):
    """`admission.state` "open" says a sandbox of the default size would be
    admitted; at limits.max_sandboxes none is, whatever CPU and memory are
    left, and info says so (as does dsecd_admission_open, from the same
    figures)."""
    d = daemon_factory("[limits]\nmax_sandboxes = 1\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        assert c.info()["cpu"]["admission"]["state"] == "open"
        c.create(image="busybox", memory="64M")
        with pytest.raises(Busy, match="host is full"):
            c.create(image="busybox", memory="64M")
        adm = c.info()["cpu"]["admission"]
        assert (adm["state"], adm["full_on"]) == ("full", "sandboxes"), adm
        assert adm["sandboxes"] == {"live": 1, "call_sandboxes": 0, "queued": 0, "max": 1}, adm
        assert b"admission   full (full on sandboxes" in d.cli("info").stdout
    finally:
        c.close()


def test_a_call_sandbox_takes_a_slot_and_the_capacity_it_asks_for(daemon_factory, busybox_rootfs):
    """A call sandbox (one per image, made by the image's first call) is a
    sandbox of the host: it takes a slot of limits.max_sandboxes and counts
    its [fncall] cpu and memory. On a full host the call that would make
    one is busy."""
    d = daemon_factory("[limits]\nmax_sandboxes = 1\n[fncall]\ncpu = 0.5\nmemory = \"96M\"\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", memory="64M")
        with pytest.raises(Busy, match="host is full"):
            c.call("busybox", argv=["true"])
        sb.destroy()
        assert c.call("busybox", argv=["echo", "hi"]).stdout == b"hi\n"
        adm = c.info()["cpu"]["admission"]
        assert adm["sandboxes"] == {"live": 1, "call_sandboxes": 1, "queued": 0, "max": 1}, adm
        assert (adm["cpu"]["requested"], adm["memory"]["requested"]) == (0.5, 96 << 20), adm
    finally:
        c.close()


def test_a_call_sandbox_past_the_hosts_memory_capacity_is_busy(daemon_factory, busybox_rootfs):
    """With memory oversubscription set, a call sandbox whose [fncall]
    memory does not fit beside the live sandboxes' is refused, as a create
    would be."""
    d = daemon_factory(_memory_capacity(300 << 20) + "[fncall]\nmemory = \"200M\"\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", memory="150M")
        with pytest.raises(Busy, match="host at capacity for memory"):
            c.call("busybox", argv=["true"])
        sb.destroy()
        assert c.call("busybox", argv=["true"]).exit_code == 0
    finally:
        c.close()


def test_a_call_evicting_an_idle_call_sandbox_on_a_full_host_takes_its_slot(daemon_factory, busybox_rootfs):
    """At fncall.max_boxes a call of another image drops the idle call
    sandbox used least recently to make room: on a host that sandbox
    filled, the new one takes the slot it frees, not `busy` (with the idle
    one dropped all the same)."""
    d = daemon_factory("[limits]\nmax_sandboxes = 2\n[fncall]\nmax_boxes = 1\nzygote = false\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        c.import_image(busybox_rootfs, "busybox2")
        c.create(image="busybox", memory="64M")
        assert c.call("busybox", argv=["echo", "one"]).stdout == b"one\n"
        assert c.call("busybox2", argv=["echo", "two"]).stdout == b"two\n"
        boxes = c.info()["fncall"]["boxes"]
        assert [b["image"] for b in boxes] == ["busybox2"], boxes
        adm = c.info()["cpu"]["admission"]
        assert adm["sandboxes"] == {"live": 2, "call_sandboxes": 1, "queued": 0, "max": 2}, adm
    finally:
        c.close()


def test_a_create_on_a_host_an_idle_call_sandbox_filled_takes_its_slot(daemon_factory, busybox_rootfs):
    """A create refused only for the room an idle call sandbox holds drops
    it, waits until it is destroyed, and takes its slot; info counts the
    drop, and the image's next call needs room of its own again."""
    d = daemon_factory("[limits]\nmax_sandboxes = 1\n[fncall]\ncpu = 0.5\nmemory = \"96M\"\nzygote = false\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        assert c.call("busybox", argv=["echo", "hi"]).stdout == b"hi\n"
        adm = c.info()["cpu"]["admission"]         # open: the idle one gives way
        assert (adm["state"], adm["idle_call_sandboxes"]["sandboxes"]) == ("open", 1), adm
        c.create(image="busybox", memory="64M")
        info = c.info()
        assert info["fncall"]["boxes"] == [] and info["fncall"]["dropped_for_creates"] == 1, info["fncall"]
        assert info["cpu"]["admission"]["sandboxes"] == {"live": 1, "call_sandboxes": 0, "queued": 0, "max": 1}
        assert b"call sandboxes dropped for creates 1," in d.cli("info").stdout
        with pytest.raises(Busy, match="host is full"):
            c.call("busybox", argv=["true"])
    finally:
        c.close()


def test_a_call_of_another_image_takes_the_room_of_an_idle_call_sandbox(daemon_factory, busybox_rootfs):
    """On a host an idle call sandbox filled, another image's first call
    drops it and makes its own in its room; one with a call in flight
    stays, and the other image's call is then refused busy."""
    d = daemon_factory("[limits]\nmax_sandboxes = 1\n[fncall]\ncpu = 0.5\nmemory = \"96M\"\nzygote = false\n")
    c = d.client()
    caller = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        c.import_image(busybox_rootfs, "other")
        assert c.call("busybox", argv=["echo", "a"]).stdout == b"a\n"
        assert c.call("other", argv=["echo", "b"]).stdout == b"b\n"
        info = c.info()["fncall"]
        assert [b["image"] for b in info["boxes"]] == ["other"], info
        assert (info["dropped_for_calls"], info["dropped_for_creates"]) == (1, 0), info
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(caller.call, "other", argv=["sh", "-c", "sleep 3; echo done"])
            while not any(b["running"] for b in c.info()["fncall"]["boxes"]):
                assert not running.done(), running.result()
                time.sleep(0.02)
            with pytest.raises(Busy, match="host is full"):
                c.call("busybox", argv=["true"])
            assert running.result().stdout == b"done\n"
        assert c.info()["fncall"]["dropped_for_calls"] == 1
    finally:
        caller.close()
        c.close()


def test_a_create_on_a_full_host_leaves_a_call_sandbox_with_a_call_in_flight(daemon_factory, busybox_rootfs):
    """A call sandbox with a call running is not dropped for a create: the
    create is refused as on any full host, and the call ends as it would."""
    d = daemon_factory("[limits]\nmax_sandboxes = 1\n[fncall]\ncpu = 0.5\nmemory = \"96M\"\nzygote = false\n")
    c = d.client()
    caller = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(caller.call, "busybox", argv=["sh", "-c", "sleep 3; echo done"])
            while not any(b["running"] for b in c.info()["fncall"]["boxes"]):     # in its call sandbox
                assert not running.done(), running.result()
                time.sleep(0.02)
            assert c.info()["cpu"]["admission"]["full_on"] == "sandboxes"
            with pytest.raises(Busy, match="host is full"):
                c.create(image="busybox", memory="64M")
            r = running.result()
            assert r.stdout == b"done\n", r
        info = c.info()["fncall"]
        assert [b["image"] for b in info["boxes"]] == ["busybox"] and info["dropped_for_creates"] == 0, info
    finally:
        caller.close()
        c.close()


def test_a_create_past_the_memory_an_idle_call_sandbox_holds_drops_it(daemon_factory, busybox_rootfs):
    """Past the host's memory capacity, as at limits.max_sandboxes: the
    idle call sandbox goes and the create is admitted; a create that would
    not fit even without it is refused, and drops nothing."""
    d = daemon_factory(_memory_capacity(300 << 20) + "[fncall]\nmemory = \"200M\"\nzygote = false\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        c.create(image="busybox", memory="100M")
        assert c.call("busybox", argv=["true"]).exit_code == 0
        with pytest.raises(Busy, match="host at capacity for memory"):
            c.create(image="busybox", memory="250M")
        assert [b["image"] for b in c.info()["fncall"]["boxes"]] == ["busybox"]
        c.create(image="busybox", memory="150M")
        info = c.info()["fncall"]
        assert info["boxes"] == [] and info["dropped_for_creates"] == 1, info
    finally:
        c.close()


def test_a_pool_refill_on_a_host_an_idle_call_sandbox_filled_drops_none(daemon_factory, busybox_rootfs):
    """A warm pool's spare is made ahead of any create: it does not drop
    a call sandbox between its calls (a call cannot drop a spare back),
    and waits for room as on any full host, its pool saying why."""
    d = daemon_factory("[limits]\nmax_sandboxes = 1\n[fncall]\ncpu = 0.5\nmemory = \"96M\"\nzygote = false\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        assert c.call("busybox", argv=["true"]).exit_code == 0
        name = c.pool_set("busybox", 1, 1, cpu=0.5, memory="64M")["name"]
        while not ((pool := next(p for p in c.pool_list() if p["name"] == name))["ready"] or pool["error"]):
            time.sleep(0.05)
        assert pool["ready"] == 0 and "host is full" in pool["error"], pool
        info = c.info()["fncall"]
        assert [b["image"] for b in info["boxes"]] == ["busybox"] and info["dropped_for_creates"] == 0, info
        assert c.call("busybox", argv=["echo", "hi"]).stdout == b"hi\n"
    finally:
        c.close()


def test_a_create_that_fails_its_checks_drops_no_idle_call_sandbox(daemon_factory, busybox_rootfs):
    """Idle call sandboxes go for a create only once it is known to be
    made: a create of an image that is not there, with a cwd that is not
    absolute or a ttl that is no duration, on the host they fill leaves
    them."""
    d = daemon_factory("[limits]\nmax_sandboxes = 1\n[fncall]\ncpu = 0.5\nmemory = \"96M\"\nzygote = false\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        assert c.call("busybox", argv=["true"]).exit_code == 0
        with pytest.raises(NotFound):
            c.create(image="no-such-image", memory="64M")
        with pytest.raises(BadRequest, match="cwd must be absolute"):
            c.create(image="busybox", memory="64M", cwd="work")
        with pytest.raises(BadRequest, match="ttl"):
            c.create(image="busybox", memory="64M", ttl="soon")
        info = c.info()["fncall"]
        assert [b["image"] for b in info["boxes"]] == ["busybox"] and info["dropped_for_creates"] == 0, info
    finally:
        c.close()
