"""Warm pools' state (CreateService): after a daemon restart the ready
sandboxes go back to their pool only while its image name still stands for
the manifest they were made of (the others are destroyed, as a change of
the image while the daemon ran would have done); the error `pool ls` shows
says what holds the pool back now, not what once did."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from dsecd.engine.creates import POOL_LABEL, CreateService, pool_name
from dsecd.engine.sandboxes import Sandbox
from dsecd.fs.images import ImageError


def _sandbox(sb_id: str, pool: str, manifest: str, created: float) -> Sandbox:
    return Sandbox(id=sb_id, image="busybox", state="running", created=created, limits={},
                   labels={POOL_LABEL: pool}, manifest=manifest)


def test_ready_sandboxes_of_an_image_that_changed_go(tmp_path):
    web, gone = pool_name("busybox", 1.0, 1 << 20), pool_name("removed", 1.0, 1 << 20)
    pools = tmp_path / "pools.json"
    pools.write_text(json.dumps({
        web: {"image": "busybox", "cpu": 1.0, "memory": 1 << 20, "min": 2, "max": 2},
        gone: {"image": "removed", "cpu": 1.0, "memory": 1 << 20, "min": 1, "max": 1}}))
    sbs = [_sandbox("old", web, "sha256:before", 1.0), _sandbox("new", web, "sha256:now", 2.0),
           _sandbox("orphan", gone, "sha256:x", 3.0)]

    def get(name):
        if name == "removed":
            raise ImageError("not_found", f"no image named {name!r}")
        return SimpleNamespace(manifest="sha256:now")

    destroyed = []

    async def run():
        svc = object.__new__(CreateService)
        svc._pools_path = pools
        svc._drain_path = pools.with_name("drain.json")
        svc.pools = {}
        svc.registry = SimpleNamespace(by_id={s.id: s for s in sbs}, keys={})
        async def run_now(fn, *args):
            return fn(*args)

        svc.workers = SimpleNamespace(loop=asyncio.get_running_loop(), run=run_now)
        svc.image_service = SimpleNamespace(images=SimpleNamespace(get=get, key=lambda name: name))

        async def destroy_quiet(sb):
            destroyed.append(sb.id)

        async def refill_loop():
            pass

        svc._destroy_quiet = destroy_quiet
        svc._refill_loop = refill_loop
        await svc.start()
        await asyncio.sleep(0)
        return svc

    svc = asyncio.run(run())
    assert list(svc.pools[web].ready) == ["new"]
    assert list(svc.pools[gone].ready) == []
    assert sorted(destroyed) == ["old", "orphan"]


def test_a_pool_no_longer_short_drops_its_host_full_error():
    """The host was full when the pool wanted more; then its demand fell
    so that it holds its target without a refill: `pool ls` no longer says
    it waits for room."""
    from dsecd.engine.creates import Pool

    pool = Pool(name="p", image="busybox", cpu=1.0, memory=1 << 20, min=1, max=4, error="the host is full",
                error_is_busy=True)
    pool.ready.append("sb1")

    async def run():
        svc = object.__new__(CreateService)
        svc.pools = {"p": pool}
        svc.pool_cfg = {"refill_interval_s": 0.01, "refill_per_s": 10.0, "demand_window_s": 60.0}
        svc.admission = SimpleNamespace(queued=0, max_queued=100)
        svc.registry = SimpleNamespace(by_id={"sb1": SimpleNamespace(state="running", labels={})})
        loop = asyncio.ensure_future(svc._refill_loop())
        await asyncio.sleep(0.1)
        loop.cancel()

    asyncio.run(run())
    assert (pool.error, pool.error_is_busy) == (None, False)


def test_pools_that_cannot_be_saved_under_new_names_do_not_stop_the_start(tmp_path, caplog):
    """A pool saved under a name an older daemon gave it is saved again at
    start under today's; a state dir that cannot take the write (full,
    read-only) failed the daemon's start with a traceback."""
    now = pool_name("busybox", 1.0, 1 << 20)
    pools = tmp_path / "pools.json"
    pools.write_text(json.dumps({"busybox@1cpu-1M-old": {"image": "busybox", "cpu": 1.0, "memory": 1 << 20,
                                                         "min": 1, "max": 1}}))

    async def run():
        svc = object.__new__(CreateService)
        svc._pools_path = pools
        svc._drain_path = pools.with_name("drain.json")
        svc.pools = {}
        svc.registry = SimpleNamespace(by_id={}, keys={})

        async def run_now(fn, *args):
            return fn(*args)

        async def refill_loop():
            pass

        svc.workers = SimpleNamespace(loop=asyncio.get_running_loop(), run=run_now)
        svc.image_service = SimpleNamespace(images=SimpleNamespace(key=lambda name: name))
        svc._refill_loop = refill_loop

        def full():
            raise OSError(28, "No space left on device")

        svc._save_pools = full
        await svc.start()
        await asyncio.sleep(0)
        return svc

    svc = asyncio.run(run())
    assert list(svc.pools) == [now]
    assert "No space left on device" in caplog.text and str(pools) in caplog.text


def test_a_pool_whose_refills_fail_backs_off():
    """A pool whose image was removed made ~20 failed creates a second, for
    as long as the daemon ran. Its refills now back off (1 s, 2 s, ... 60
    s), and go on at once when its image changes or a refill works."""
    from dsecd.engine.creates import REFILL_BACKOFF_MAX_S, Pool
    from dsecd.errors import NotFound

    pool = Pool(name="p", image="gone", cpu=1.0, memory=1 << 20, min=2, max=2)
    tries = []

    async def run():
        svc = object.__new__(CreateService)
        svc.pools = {"p": pool}
        svc.pool_cfg = {"refill_interval_s": 0.01, "refill_per_s": 100.0, "demand_window_s": 60.0}

        class Slot:
            async def __aenter__(self):
                pass

            async def __aexit__(self, *exc):
                pass

        svc.admission = SimpleNamespace(queued=0, max_queued=100, slot=lambda job: Slot())
        svc._refills = set()
        svc.workers = SimpleNamespace(loop=asyncio.get_running_loop())

        async def create_now(req, ctx, drop_idle_calls=True):
            tries.append(req.image)
            raise NotFound("no image 'gone'")

        svc.create_now = create_now
        loop = asyncio.ensure_future(svc._refill_loop())
        await asyncio.sleep(0.5)
        loop.cancel()

    asyncio.run(run())
    assert 1 <= len(tries) <= 2, len(tries)       # one round (two refills at most), then 1 s of nothing
    # Both refills of that round failed: one step of the backoff, not two.
    assert pool.failed == len(tries) and pool.backoff == 1.0 and "no image" in pool.error
    waits = []
    for _ in range(8):                            # round after round
        pool.retry_at = 0.0
        pool.refill_failed()
        waits.append(pool.backoff)
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, REFILL_BACKOFF_MAX_S, REFILL_BACKOFF_MAX_S, REFILL_BACKOFF_MAX_S]
    pool.refill_may_work()
    assert (pool.backoff, pool.retry_at) == (0.0, 0.0)


def test_a_create_key_digest_counts_only_what_was_given():
    """A key stands for one create (its other arguments' digest); a field a
    later daemon adds, left at its default, must not make the retry of a
    journaled create look like another one."""
    from dataclasses import dataclass

    from dsecd import protocol
    from dsecd.engine.opkeys import args_digest

    @dataclass(frozen=True)
    class LaterCreate(protocol.Create):
        gpus: int = 0

    first = protocol.Create(image="busybox", memory="64M", env={"A": "1"}, key="k")
    assert args_digest(first) == args_digest(LaterCreate(image="busybox", memory="64M",
                                                         env={"A": "1"}, key="k2"))
    for other in (protocol.Create(image="busybox", memory="96M", env={"A": "1"}, key="k"),
                  protocol.Create(image="busybox", memory="64M", key="k"),
                  LaterCreate(image="busybox", memory="64M", env={"A": "1"}, key="k", gpus=1)):
        assert args_digest(other) != args_digest(first), other


def test_a_key_digest_is_the_one_journaled_sandboxes_carry():
    """Sandboxes in the journal carry the digest of the create that made
    them; a retry after a daemon upgrade must compute the same one, or it
    is refused as another create under the key. The values are those of
    the first implementation (dataclasses.asdict of the request)."""
    from dsecd import protocol
    from dsecd.engine.opkeys import args_digest

    assert args_digest(protocol.Create(image="busybox", key="k")) == "d6b8fea136d02fd718b44113cbc256d1"
    full = protocol.Create(image="b", cpu=0.5, memory="1G", env={"A": "1"}, labels={"job": "j"},
                           allow=["pypi.org:443/tcp"], publish=[80], policy={"x": [1, 2]}, key="z", ttl="2h",
                           user=1000)
    assert args_digest(full) == "d4d193337a0b27cbdaa14d577f28000d"
