"""The drain kept in <state_dir>/drain.json (CreateService): a file that
cannot be read, or holds no usable start, still drains the host and never
stops the daemon's start or a create's refusal."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from dsecd.engine.creates import DRAIN_FILE, CreateService
from dsecd.errors import Busy


def _service(state) -> CreateService:
    svc = object.__new__(CreateService)
    svc._drain_path = state / DRAIN_FILE
    svc._pools_path = state / "pools.json"
    svc.pools = {}
    svc.registry = SimpleNamespace(by_id={}, keys={})
    svc.image_service = SimpleNamespace(images=SimpleNamespace(key=lambda name: name))
    return svc


async def _start(svc: CreateService) -> None:
    async def run_now(fn, *args):
        return fn(*args)

    async def refill_loop():
        pass

    svc.workers = SimpleNamespace(loop=asyncio.get_running_loop(), run=run_now)
    svc._refill_loop = refill_loop
    await svc.start()
    await asyncio.sleep(0)


@pytest.mark.parametrize("content", [
    b'{"reason": "r\xff", "since": 1}',           # not UTF-8
    b'{"reason": "disk swap", "since": 1e300}',   # past any date
    b'{"reason": "disk swap", "since": Infinity}',
    b'{"reason": "disk swap", "since": NaN}',
    b'{"reason": "disk swap", "since": -1e20}',
    b'{"reason": "disk swap", "since": "soon"}',
    b'[' * 100000,                                # nested past the parser's recursion limit
], ids=["not-utf8", "1e300", "inf", "nan", "-1e20", "string", "deep"])
def test_a_damaged_drain_file_still_drains_with_a_sane_start(tmp_path, content):
    (tmp_path / DRAIN_FILE).write_bytes(content)
    svc = _service(tmp_path)
    before = time.time()
    asyncio.run(_start(svc))
    since = svc.drained["since"]
    assert math.isfinite(since) and before <= since <= time.time(), svc.drained
    with pytest.raises(Busy, match="host is drained") as err:
        svc._refuse_if_drained()
    assert err.value.detail["since"] == since
    assert svc.drain_info()["drained"] is True


def test_a_sound_drain_file_keeps_its_reason_and_start(tmp_path):
    (tmp_path / DRAIN_FILE).write_text('{"reason": "kernel update", "since": 1700000000.5}')
    svc = _service(tmp_path)
    asyncio.run(_start(svc))
    assert svc.drained == {"reason": "kernel update", "since": 1700000000.5}
    with pytest.raises(Busy, match=r"since 2023-11-14T22:13:20Z: kernel update"):
        svc._refuse_if_drained()


def test_drains_and_undrains_at_once_write_one_at_a_time_and_agree_with_the_file(tmp_path):
    """On the daemon's worker threads, drains and undrains at once shared
    one temp file (one's rename found it gone: answered as not_found) and
    could leave the file saying other than the host did."""
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dsecd import protocol

    svc = _service(tmp_path)
    write = svc._write_drain
    active, overlapped, waited = [0], [], []
    lock = threading.Lock()
    entered = threading.Event()

    def watched_write(d):
        with lock:
            active[0] += 1
            if active[0] > 1:
                overlapped.append(d)
                entered.set()
        try:
            # The first write waits for a second to come in beside it: a
            # second one does unless the writes are one at a time.
            if not waited:
                waited.append(d)
                entered.wait(1)
            write(d)
        finally:
            with lock:
                active[0] -= 1

    svc._write_drain = watched_write

    async def run():
        pool = ThreadPoolExecutor(8)
        loop = asyncio.get_running_loop()

        async def in_thread(fn, *args):
            return await loop.run_in_executor(pool, fn, *args)

        svc.workers = SimpleNamespace(loop=loop, run=in_thread)
        reqs = [svc.drain(protocol.Drain(reason=f"r{i}"), None) if i % 3 else svc.undrain(None, None)
                for i in range(8)]
        try:
            return await asyncio.gather(*reqs)
        finally:
            pool.shutdown()

    asyncio.run(run())
    assert overlapped == []
    path = tmp_path / DRAIN_FILE
    on_disk = json.loads(path.read_text()) if path.exists() else None
    assert on_disk == svc.drained
    assert [p.name for p in tmp_path.iterdir()] in ([], [DRAIN_FILE])


def test_a_drained_hosts_pools_drop_spares_that_are_gone_and_say_why_none_come(tmp_path):
    """`dsec drain; dsec rm --all`: the refiller skipped its pools while
    drained, so pool ls, info and metrics went on counting spares that no
    longer existed."""
    from dsecd.engine.creates import Pool

    pool = Pool(name="p", image="busybox", cpu=1.0, memory=1 << 20, min=2, max=2)
    pool.ready.extend(["gone", "kept"])
    svc = _service(tmp_path)
    svc.drained = {"reason": "kernel update", "since": 1700000000.0}
    svc.pools = {"p": pool}
    svc.pool_cfg = {"refill_interval_s": 0.01, "refill_per_s": 10.0, "demand_window_s": 60.0}
    svc.admission = SimpleNamespace(queued=0, max_queued=100)
    svc.registry = SimpleNamespace(by_id={"kept": SimpleNamespace(state="running", labels={})}, keys={})

    async def run():
        svc.workers = SimpleNamespace(loop=asyncio.get_running_loop())
        loop = asyncio.ensure_future(svc._refill_loop())
        for _ in range(500):
            await asyncio.sleep(0.01)
            if list(pool.ready) == ["kept"] and pool.error:
                break
        loop.cancel()

    asyncio.run(run())
    assert list(pool.ready) == ["kept"]
    assert pool.creating == 0
    assert "not refilled" in pool.error and "host is drained" in pool.error and pool.error_is_busy, pool.error


@pytest.mark.parametrize("reason", ["x" * 100000, "two\nlines", ["a", "list"], {"a": 1}, 7])
def test_a_drain_files_reason_a_drain_could_not_take_is_not_repeated(tmp_path, reason):
    """A reason is said in dsec info and in every refusal: one drain.json
    edited or damaged to hold a huge one made every info answer too big a
    frame. Such a reason is not taken; the host stays drained."""
    import json

    (tmp_path / DRAIN_FILE).write_text(json.dumps({"reason": reason, "since": 1700000000.0}))
    svc = _service(tmp_path)
    asyncio.run(_start(svc))
    assert svc.drained == {"reason": f"{DRAIN_FILE} unreadable", "since": 1700000000.0}


@pytest.mark.parametrize("op", ["drain", "undrain"])
def test_a_drain_cancelled_while_its_file_is_written_still_says_what_the_file_does(tmp_path, op):
    """A drain's caller gone (its client, a `cancel`) while its worker
    thread wrote drain.json: the file changed, and the host went on doing
    what it did before (a drain a restart then found, or an undrain that
    only half happened)."""
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dsecd import protocol

    svc = _service(tmp_path)
    if op == "undrain":
        svc.drained = {"reason": "before", "since": 1700000000.0}
        (tmp_path / DRAIN_FILE).write_text(json.dumps(svc.drained))
    write = svc._write_drain
    writing, go = threading.Event(), threading.Event()

    def held_write(d):
        writing.set()
        go.wait(10)
        write(d)

    svc._write_drain = held_write

    async def run():
        pool = ThreadPoolExecutor(1)
        loop = asyncio.get_running_loop()

        async def in_thread(fn, *args):
            return await loop.run_in_executor(pool, fn, *args)

        svc.workers = SimpleNamespace(loop=loop, run=in_thread)
        task = asyncio.ensure_future(svc.drain(protocol.Drain(reason="now"), None) if op == "drain"
                                     else svc.undrain(None, None))
        await loop.run_in_executor(None, writing.wait, 10)
        task.cancel()
        await asyncio.sleep(0)
        go.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        pool.shutdown()

    asyncio.run(run())
    path = tmp_path / DRAIN_FILE
    on_disk = json.loads(path.read_text()) if path.exists() else None
    assert on_disk == svc.drained
    assert (svc.drained is None) == (op == "undrain")
