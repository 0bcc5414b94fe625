"""Draining a host (`dsec drain`, ops drain/undrain): new creates and pool
refills are refused with `busy` naming the drain, what runs keeps working,
`dsec info` shows it, and it holds across a daemon restart."""

from __future__ import annotations

import json
import time

import pytest

from dsecd.errors import BadRequest, Busy


def _pool(c, name: str) -> dict:
    return next(p for p in c.pool_list() if p["name"] == name)


def _wait_pool(c, name: str, ok, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not ok(pool := _pool(c, name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pool


def test_a_drained_host_refuses_creates_keeps_its_sandboxes_and_survives_a_restart(daemon_factory,
                                                                                    busybox_rootfs):
    d = daemon_factory()
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        kept = c.create(image="busybox", memory="64M", key="made-before")
        # A reason is said in every refusal: one line, bounded.
        for bad in ("x" * 257, "line\nbreak"):
            with pytest.raises(BadRequest, match="printable"):
                c.drain(bad)
        assert c.info()["drain"]["drained"] is False
        r = d.cli("drain", "--reason", "kernel update")
        assert r.returncode == 0 and b"drained since" in r.stdout and b"kernel update" in r.stdout, r
        with pytest.raises(Busy, match="host is drained .*kernel update") as err:
            c.create(image="busybox", memory="64M")
        assert err.value.detail["drained"] is True and err.value.detail["retry_after_s"] > 0
        # A keyed create whose sandbox exists gets it; a new key is a new create, refused.
        assert c.create(image="busybox", memory="64M", key="made-before").id == kept.id
        with pytest.raises(Busy, match="host is drained"):
            c.create(image="busybox", memory="64M", key="new-key")
        run = d.cli("run", "busybox", "--", "true")
        assert run.returncode == 125 and b"host is drained" in run.stderr, run
        # What runs keeps working.
        assert kept.exec(["echo", "still"]).stdout == b"still\n"
        # No pool refills: a pool set while drained stays empty, saying why.
        name = c.pool_set("busybox", 1, 1, memory="48M")["name"]
        pool = _wait_pool(c, name, lambda p: p["error"])
        assert pool["ready"] == 0 and "host is drained" in (pool["error"] or ""), pool
        info = json.loads(d.cli("info", "--json").stdout)
        assert info["drain"]["drained"] is True and info["drain"]["reason"] == "kernel update", info["drain"]
        # Admission says no create makes a sandbox (dsecd_admission_open 0, from the same figures).
        assert (info["cpu"]["admission"]["state"], info["cpu"]["admission"]["full_on"]) == ("full", "drain")
        assert b"drain: DRAINED since" in d.cli("info").stdout
        # Drained again (the SDK's way): it keeps its start and, given none, its reason.
        again = c.drain()
        assert again == {**info["drain"], "drained": True}, (again, info["drain"])
        c.close()

        d.stop()
        d.start()
        c = d.client()
        with pytest.raises(Busy, match="host is drained .*kernel update"):
            c.create(image="busybox", memory="64M")
        assert _pool(c, name)["ready"] == 0
        assert c.info()["drain"]["drained"] is True

        r = d.cli("undrain", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["drained"] is False, r
        assert c.info()["drain"] == {"drained": False, "reason": None, "since": None}
        assert c.info()["cpu"]["admission"]["state"] == "open"
        assert b"drain: no" in d.cli("info").stdout
        assert c.create(image="busybox", memory="64M").exec(["true"]).exit_code == 0
        assert _wait_pool(c, name, lambda p: p["ready"] >= 1)["ready"] == 1
    finally:
        c.close()


def test_dsec_fleet_drains_each_host_named_and_places_creates_elsewhere(daemon_factory, busybox_rootfs):
    """Two local daemons as a fleet (socket paths as hosts): `dsec fleet
    drain` drains each host it names, and fleet creates go to the others."""
    a, b = daemon_factory(), daemon_factory()
    for d in (a, b):
        c = d.client()
        c.import_image(busybox_rootfs, "busybox")
        c.close()

    def fleet(hosts, *args):
        r = a.cli("fleet", "--hosts", ",".join(h.socket for h in hosts), *args)
        assert r.returncode == 0, (args, r.stderr.decode())
        return r.stdout.decode()

    assert fleet([a], "drain", "--reason", "disk swap") == f"{a.socket}: drained (disk swap)\n"
    made = [fleet([a, b], "create", "--image", "busybox", "--memory", "48M").strip() for _ in range(3)]
    ps = b.cli("ps", "--json")
    assert sorted(s["id"] for s in json.loads(ps.stdout)) == sorted(made)
    assert fleet([a, b], "undrain").splitlines() == [f"{a.socket}: undrained", f"{b.socket}: undrained"]
    ca = a.client()
    try:
        assert ca.info()["drain"]["drained"] is False
    finally:
        ca.close()
