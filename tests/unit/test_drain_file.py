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
