"""Burst admission through the daemon: idempotency keys, busy with retry-after,
the bounded create queue, and warm pools."""

from __future__ import annotations

import asyncio
import time

import pytest

from dsecd import Client
from dsecd.errors import BadRequest, Busy, Conflict


def _live(client) -> list[dict]:
    return [s for s in client.list() if s["state"] != "dead"]


def test_same_key_same_sandbox_even_when_concurrent(daemon):
    async def run():
        async with Client(daemon.socket) as c:
            # One of another shape under the same key while the first is made: refused.
            *sbs, odd = await asyncio.gather(*(c.create("busybox", key="k-concurrent", memory="64M")
                                               for _ in range(8)),
                                             c.create("busybox", key="k-concurrent", memory="96M"),
                                             return_exceptions=True)
            assert isinstance(odd, Conflict) and "other arguments" in odd.message, odd
            again = await c.create("busybox", key="k-concurrent", memory="64M")
            with pytest.raises(Conflict, match=r"key 'k-concurrent' was given to a create of other arguments "
                                               r"\(sandbox \w+, of image busybox\)"):
                await c.create("busybox", key="k-concurrent", memory="64M", env={"A": "1"})
            other = await c.create("busybox", key="k-other", memory="64M")
            return sbs, again, other

    sbs, again, other = asyncio.run(run())
    assert len({s.id for s in sbs}) == 1
    assert again.id == sbs[0].id and again.info.get("existing") is True
    assert other.id != sbs[0].id
    c = daemon.client()
    try:
        assert sum(1 for s in _live(c) if s["id"] == sbs[0].id) == 1
        assert c.info()["admission"]["keys"] >= 2
        c.get(sbs[0].id).destroy(force=True)
        fresh = c.create("busybox", key="k-concurrent", memory="64M")   # destroyed: the key is free
        assert fresh.id != sbs[0].id
        fresh.destroy(force=True)
        c.get(other.id).destroy(force=True)
    finally:
        c.close()


def test_a_key_whose_sandbox_is_being_destroyed_is_busy_then_free(daemon):
    """A create whose key names a sandbox being destroyed (a trainer's
    retry after a destroy it gave up waiting for) is not answered with that
    sandbox, about to be gone, as its own: it is busy, with when to retry,
    and once the destroy is done the key makes a new sandbox."""
    async def go() -> None:
        async with Client(daemon.socket) as c:
            sb = await c.create(image="busybox", key="k-stopping")
            destroying = asyncio.ensure_future(sb.destroy())
            await asyncio.sleep(0)                  # the destroy goes out first
            with pytest.raises(Busy, match="being destroyed") as err:
                await c.create(image="busybox", key="k-stopping")
            assert err.value.detail["sandbox"] == sb.id and err.value.detail["retry_after_s"] > 0
            await destroying
            again = await c.create(image="busybox", key="k-stopping")
            assert again.id != sb.id and not again.info.get("existing")
            await again.destroy()

    asyncio.run(go())


def test_key_survives_a_daemon_restart(daemon_factory, busybox_rootfs):
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create("busybox", key="job7-task3", memory="64M")
    c.close()
    d.stop()
    d.start()
    c = d.client()
    again = c.create("busybox", key="job7-task3", memory="64M")
    assert again.id == sb.id and again.info["existing"] is True
    with pytest.raises(Conflict, match="other arguments"):      # what the key stood for was journaled too
        c.create("busybox", key="job7-task3", memory="128M")
    assert len(_live(c)) == 1
    c.close()


def test_full_host_is_busy_at_once_with_retry_after(daemon_factory, busybox_rootfs):
    d = daemon_factory("[limits]\nmax_sandboxes = 2\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.create("busybox", memory="64M")
    c.create("busybox", memory="64M")
    t = time.monotonic()
    with pytest.raises(Busy) as err:
        c.create("busybox", memory="64M")
    assert time.monotonic() - t < 1.0
    assert err.value.detail["retry_after_s"] > 0 and err.value.detail["max"] == 2
    assert c.info()["admission"]["rejected_busy"] == 1
    c.close()


def test_bounded_queue_rejects_the_overflow_and_admits_the_rest(daemon_factory, busybox_rootfs):
    d = daemon_factory("[admission]\nmax_active_creates = 1\nmax_queued_creates = 3\n")
    sync = d.client()
    sync.import_image(busybox_rootfs, "busybox")

    async def run():
        async with Client(d.socket) as c:
            return await asyncio.gather(*(c.create("busybox", memory="64M", labels={"job": f"j{i % 2}"})
                                          for i in range(12)), return_exceptions=True)

    results = asyncio.run(run())
    made = [r for r in results if not isinstance(r, BaseException)]
    busy = [r for r in results if isinstance(r, Busy)]
    assert len(made) + len(busy) == 12 and busy and len(made) >= 4
    assert all(b.detail["retry_after_s"] > 0 for b in busy)
    assert len({s.id for s in made}) == len(made) == len(_live(sync))
    adm = sync.info()["admission"]
    assert adm["queued"] == 0 and adm["active"] == 0 and adm["admitted"] == len(made)
    assert adm["wait_max_ms"] > 0 and adm["rejected_busy"] == len(busy)
    sync.close()


def _wait_ready(c, name: str, n: int, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        pool = next(p for p in c.pool_list() if p["name"] == name)
        if pool["ready"] >= n or time.monotonic() > deadline:
            return pool
        time.sleep(0.05)


def test_warm_pool_hands_out_each_sandbox_once(daemon):
    c = daemon.client()
    try:
        p = c.pool_set("busybox", 3, 6, cpu=0.5, memory="96M")
        name = p["name"]
        assert _wait_ready(c, name, 3)["ready"] >= 3
        pool_ids = {s["id"] for s in c.list({"dsec.pool": name})}
        # A create that matches the pool is checked before one is taken as a fresh one is (default userns_size 65536).
        with pytest.raises(BadRequest, match="userns_size"):
            c.create("busybox", cpu=0.5, memory="96M", user=1 << 20)
        # So is its cwd, against the image; the sandbox stays in the pool.
        with pytest.raises(BadRequest, match="not a directory in image"):
            c.create("busybox", cpu=0.5, memory="96M", cwd="/nonexist")
        assert {s["id"] for s in c.list({"dsec.pool": name})} == pool_ids
        taken = [c.create("busybox", cpu=0.5, memory="96M", labels={"job": "j"}, env={"A": "1"}, cwd="/work")
                 for _ in range(3)]
        assert all(t.info.get("pool") == name for t in taken)
        assert len({t.id for t in taken}) == 3 and {t.id for t in taken} <= pool_ids
        for t in taken:
            assert t.info["labels"] == {"job": "j"}
            r = t.exec(["sh", "-c", "echo $A; pwd"])
            assert r.stdout == b"1\n/work\n"
        # Another shape is not served by the pool.
        other = c.create("busybox", cpu=0.5, memory="64M")
        assert "pool" not in other.info
        other.destroy(force=True)
        with pytest.raises(BadRequest):
            c.create("busybox", labels={"dsec.pool": name})
        # Refilled; taken sandboxes never come back.
        pool = _wait_ready(c, name, 3)
        assert pool["taken"] == 3 and pool["ready"] >= 3
        now_in_pool = {s["id"] for s in c.list({"dsec.pool": name})}
        assert not now_in_pool & {t.id for t in taken}
        assert c.info()["admission"]["pools"][name]["taken"] == 3
        removed = c.pool_set("busybox", 0, 0, cpu=0.5, memory="96M")
        assert removed["removed"] is True
        deadline = time.monotonic() + 10
        while c.list({"dsec.pool": name}) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.list({"dsec.pool": name}) == [] and c.pool_list() == []
        for t in taken:
            t.destroy(force=True)
    finally:
        c.close()


def test_cli_pool_and_key(daemon):
    r = daemon.cli("pool", "set", "--image", "busybox", "--min", "1", "--max", "2", "--memory", "80M")
    assert r.returncode == 0, r.stderr
    r = daemon.cli("pool", "ls")
    assert r.returncode == 0 and b"busybox@" in r.stdout and b"80M" in r.stdout
    first = daemon.cli("create", "--image", "busybox", "--key", "cli-key")
    second = daemon.cli("create", "--image", "busybox", "--key", "cli-key")
    assert first.returncode == 0 and first.stdout == second.stdout
    assert daemon.cli("rm", "-f", first.stdout.decode().strip()).returncode == 0
    info = daemon.cli("info")
    assert info.returncode == 0 and b"create queue: " in info.stdout and b"wait p50" in info.stdout
    # Removing names the pool by its shape: without it, nothing is removed, and it says which there are.
    r = daemon.cli("pool", "set", "--image", "busybox", "--min", "0", "--max", "0")
    assert r.returncode == 1 and b"busybox has busybox@1cpu-80M (give the cpu and memory" in r.stderr, r
    assert b"80M" in daemon.cli("pool", "ls").stdout
    assert daemon.cli("pool", "set", "--image", "busybox", "--min", "0", "--max", "0",
                      "--memory", "80M").returncode == 0


def test_a_pool_of_a_rebuilt_image_hands_out_the_new_image(daemon, tmp_path):
    """Its ready sandboxes were made of what the name stood for then: after
    the name is rebuilt, a matching create gets a sandbox of the new image."""
    def build(value: str) -> None:
        r = daemon.cli("image", "build", str(tmp_path), "--from", "busybox", "--name", "bb-pooled",
                       "--env", f"V={value}")
        assert r.returncode == 0, r.stderr

    c = daemon.client()
    try:
        build("one")
        name = c.pool_set("bb-pooled", 2, 2, cpu=0.5, memory="96M")["name"]
        assert _wait_ready(c, name, 2)["ready"] >= 2
        assert daemon.cli("image", "rm", "bb-pooled").returncode == 0
        build("two")
        sb = c.create("bb-pooled", cpu=0.5, memory="96M")
        assert sb.exec(["sh", "-c", "echo $V"]).stdout == b"two\n"
        sb.destroy(force=True)
        assert _wait_ready(c, name, 2)["ready"] >= 2
        sb = c.create("bb-pooled", cpu=0.5, memory="96M")
        assert sb.exec(["sh", "-c", "echo $V"]).stdout == b"two\n"
        sb.destroy(force=True)
        c.pool_set("bb-pooled", 0, 0, cpu=0.5, memory="96M")
    finally:
        c.close()


def test_a_pool_that_refills_again_shows_no_error(daemon, tmp_path):
    """The error of a refill that failed (its image gone) stays in `pool ls`
    only until a refill works again: a pool that is full again is not shown
    as failing."""
    def build() -> None:
        r = daemon.cli("image", "build", str(tmp_path), "--from", "busybox", "--name", "bb-back")
        assert r.returncode == 0, r.stderr

    c = daemon.client()
    try:
        build()
        name = c.pool_set("bb-back", 1, 1, cpu=0.5, memory="80M")["name"]
        assert _wait_ready(c, name, 1)["ready"] == 1
        assert daemon.cli("image", "rm", "bb-back").returncode == 0
        deadline = time.monotonic() + 20
        while "no image named 'bb-back'" not in str(pool := c.pool_list()[0]).replace('"', "'"):
            assert time.monotonic() < deadline, pool
            time.sleep(0.05)
        build()
        pool = _wait_ready(c, name, 1)
        assert (pool["ready"], pool["error"]) == (1, None), pool
        assert b"no image" not in daemon.cli("pool", "ls").stdout
        c.pool_set("bb-back", 0, 0, cpu=0.5, memory="80M")
    finally:
        c.close()


def test_a_pool_the_full_host_keeps_short_says_why(daemon_factory, busybox_rootfs):
    """A refill the host has no room for is tried again (not a failure), but
    `pool ls` says why the pool stays below its target, until it fills."""
    d = daemon_factory("[limits]\nmax_sandboxes = 3\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        other = [c.create("busybox", memory="64M") for _ in range(2)]
        name = c.pool_set("busybox", 2, 2, cpu=0.5, memory="80M")["name"]
        deadline = time.monotonic() + 20
        while not ((pool := c.pool_list()[0])["error"] and pool["ready"] == 1):
            assert time.monotonic() < deadline, pool
            time.sleep(0.05)
        assert pool["failed"] == 0 and "host is full" in pool["error"], pool
        assert b"host is full" in d.cli("pool", "ls").stdout
        other[0].destroy(force=True)
        pool = _wait_ready(c, name, 2)
        assert (pool["ready"], pool["error"]) == (2, None), pool
    finally:
        c.close()


def test_a_pool_holds_container_sandboxes_whatever_the_default_backend(daemon_factory, busybox_rootfs):
    """Pools are of container sandboxes (a create takes from one only when it
    asks for a container): with sandbox.backend = "microvm" their refills
    must not make VMs, which no create would take, or which a container
    create would be handed."""
    d = daemon_factory('backend = "microvm"\n')
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        name = c.pool_set("busybox", 1, 1, cpu=0.5, memory="80M")["name"]
        assert _wait_ready(c, name, 1, timeout=60)["ready"] == 1
        assert [s["backend"] for s in c.list({"dsec.pool": name})] == ["container"]
        sb = c.create("busybox", cpu=0.5, memory="80M", backend="container")
        assert sb.info.get("pool") == name and sb.info["backend"] == "container"
        sb.destroy(force=True)
        c.pool_set("busybox", 0, 0, cpu=0.5, memory="80M")
    finally:
        c.close()


def test_creates_that_find_a_pool_empty_count_as_its_demand(daemon):
    """A pool's target is min plus its recent demand: the matching creates,
    served from it or not. Counting only those it served, a pool with min 0
    never filled however many creates asked for its shape."""
    c = daemon.client()
    try:
        name = c.pool_set("busybox", 0, 2, cpu=0.5, memory="72M")["name"]
        missed = [c.create("busybox", cpu=0.5, memory="72M") for _ in range(2)]
        assert "pool" not in missed[0].info
        # The first one's demand may have had a spare made before the second came.
        served = sum("pool" in sb.info for sb in missed)
        pool = _wait_ready(c, name, 2)
        assert (pool["ready"], pool["target"], pool["taken"]) == (2, 2, served), pool
        sb = c.create("busybox", cpu=0.5, memory="72M")
        assert sb.info.get("pool") == name
        for s in (*missed, sb):
            s.destroy(force=True)
        c.pool_set("busybox", 0, 0, cpu=0.5, memory="72M")
    finally:
        c.close()


def test_a_saved_pool_is_found_by_the_name_its_shape_has_now(daemon_factory, busybox_rootfs):
    """pools.json keys pools by name; one saved under an older name for its
    shape (memory cut to whole MiB) is renamed at start, or no create of that
    shape would ever find it."""
    import json

    d = daemon_factory()
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        name = c.pool_set("busybox", 1, 1, cpu=0.5, memory=100000001)["name"]
        assert name == "busybox@0.5cpu-100000001B"
        c.close()
        d.stop()
        saved = d.state / "pools.json"
        saved.write_text(json.dumps({"busybox@0.5cpu-95M": json.loads(saved.read_text())[name]}))
        d.start()
        c = d.client()
        assert [p["name"] for p in c.pool_list()] == [name]
        assert list(json.loads(saved.read_text())) == [name]      # saved as it is named now
        assert _wait_ready(c, name, 1)["ready"] == 1
        sb = c.create("busybox", cpu=0.5, memory=100000001)
        assert sb.info.get("pool") == name
    finally:
        c.close()


def test_a_spare_that_died_is_destroyed_and_replaced(daemon):
    """A ready spare whose init dies is neither counted ready nor handed
    out: it is destroyed (nobody holds it) and the refiller makes another."""
    import os
    import signal

    c = daemon.client()
    try:
        name = c.pool_set("busybox", 2, 2, cpu=0.5, memory="80M")["name"]
        assert _wait_ready(c, name, 2)["ready"] == 2
        spares = c.list({"dsec.pool": name})
        doomed = spares[0]
        os.kill(c.get(doomed["id"]).inspect()["init_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = {s["id"]: s["state"] for s in c.list({"dsec.pool": name})}
            if doomed["id"] not in now and len(now) == 2 and set(now.values()) == {"running"}:
                break
            time.sleep(0.1)
        assert doomed["id"] not in now and len(now) == 2, now
        assert _wait_ready(c, name, 2)["ready"] == 2
        c.pool_set("busybox", 0, 0, cpu=0.5, memory="80M")
    finally:
        c.close()


def test_a_spare_found_dead_at_start_is_destroyed(daemon):
    """The host rebooted (here: the daemon killed, then a spare's init): the
    next daemon finds the spare dead and destroys it, keeping no record or
    id range for it, and the pool is refilled."""
    import os
    import signal

    c = daemon.client()
    name = c.pool_set("busybox", 2, 2, cpu=0.5, memory="80M")["name"]
    assert _wait_ready(c, name, 2)["ready"] == 2
    doomed = c.list({"dsec.pool": name})[0]
    pid = c.get(doomed["id"]).inspect()["init_pid"]
    c.close()
    daemon.stop(signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    daemon.start()
    c = daemon.client()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = {s["id"]: s["state"] for s in c.list({"dsec.pool": name})}
            if doomed["id"] not in now and len(now) == 2:
                break
            time.sleep(0.1)
        assert doomed["id"] not in now and len(now) == 2, now
        c.pool_set("busybox", 0, 0, cpu=0.5, memory="80M")
    finally:
        c.close()
