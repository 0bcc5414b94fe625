"""`dsec info`'s admission state against every limit a create meets."""

from __future__ import annotations

import pytest

from dsecd.errors import Busy


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
    one is busy; once it is made, a create past the limit is."""
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
        with pytest.raises(Busy, match="host is full"):
            c.create(image="busybox", memory="64M")
    finally:
        c.close()


def test_a_call_sandbox_past_the_hosts_memory_capacity_is_busy(daemon_factory, busybox_rootfs):
    """With memory oversubscription set, a call sandbox whose [fncall]
    memory does not fit beside the live sandboxes' is refused, as a create
    would be; the sandboxes' memory counts against calls and back."""
    mem_total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo")
                     if line.startswith("MemTotal:"))
    d = daemon_factory(f"[cpu]\nmemory_oversubscription = {(300 << 20) / mem_total!r}\n"
                       "[fncall]\nmemory = \"200M\"\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", memory="150M")
        with pytest.raises(Busy, match="host at capacity for memory"):
            c.call("busybox", argv=["true"])
        sb.destroy()
        assert c.call("busybox", argv=["true"]).exit_code == 0
        with pytest.raises(Busy, match="host at capacity for memory"):
            c.create(image="busybox", memory="150M")
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
