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
        assert adm["sandboxes"] == {"live": 1, "queued": 0, "max": 1}, adm
        assert b"admission   full (full on sandboxes" in d.cli("info").stdout
    finally:
        c.close()
