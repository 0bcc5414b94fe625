"""A destroy whose network detach fails (a veth or a DNAT rule the kernel
would not delete yet) keeps the sandbox's address leased and its record;
the sandbox leaves the registry, so nobody calls detach for it again:
NetworkService.detach_net retries it in the background, a bounded number
of times (no root: a fake Network)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dsecd.config import load_config
from dsecd.engine.network import NetworkService
from dsecd.engine.workers import Workers

TRIES = 5


class _Net:
    """Fails the first `failures` detaches of a sandbox, as a stuck veth does."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls: list[tuple[str, str]] = []

    def _once(self, how: str, sb_id: str) -> None:
        self.calls.append((how, sb_id))
        if len(self.calls) <= self.failures:
            raise OSError(16, "delete veth: Device or resource busy")

    def detach(self, sb_id: str) -> None:
        self._once("detach", sb_id)

    def retry_detach(self, sb_id: str) -> None:
        self._once("retry", sb_id)


async def _detach(net: _Net) -> NetworkService:
    workers = Workers(1)
    workers.start(asyncio.get_running_loop())
    cfg = SimpleNamespace(section=load_config().section, state_dir=None)
    ops = NetworkService(cfg, None, "dsecd-test", 1, None, workers, None)
    ops.net = net
    ops.detach_retry_s = (0.0,) * TRIES
    await ops.detach_net(SimpleNamespace(id="sb1", net={"mode": "default"}))
    await asyncio.gather(*getattr(ops, "_detach_retries", {}).values())
    workers.pool.shutdown(wait=True)
    return ops


def test_a_failed_detach_is_retried_until_it_succeeds():
    net = _Net(failures=3)
    ops = asyncio.run(_detach(net))
    assert net.calls == [("detach", "sb1")] + [("retry", "sb1")] * 3
    assert ops._detach_retries == {}                 # none left running


def test_a_detach_that_keeps_failing_is_retried_a_bounded_number_of_times():
    net = _Net(failures=100)
    ops = asyncio.run(_detach(net))
    assert net.calls == [("detach", "sb1")] + [("retry", "sb1")] * TRIES
    assert ops._detach_retries == {}                 # none left running


def test_a_detach_that_succeeds_is_not_retried():
    net = _Net(failures=0)
    asyncio.run(_detach(net))
    assert net.calls == [("detach", "sb1")]


def test_a_stop_waits_for_a_retry_under_way_before_it_closes_the_network():
    """A stop cancels the retries; one under way in a worker went on
    beside the network's close, with the fds the close shuts."""
    import threading

    order: list[str] = []
    release = threading.Event()

    class Net(_Net):
        def retry_detach(self, sb_id: str) -> None:
            order.append("retry begins")
            release.wait(10)
            order.append("retry ends")

        def close(self) -> None:
            order.append("close")

    async def go() -> None:
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        cfg = SimpleNamespace(section=load_config().section, state_dir=None)
        ops = NetworkService(cfg, None, "dsecd-test", 1, None, workers, None)
        ops.net = Net(failures=1)
        ops.detach_retry_s = (0.0,)
        await ops.detach_net(SimpleNamespace(id="sb1", net={"mode": "default"}))
        while order != ["retry begins"]:
            await asyncio.sleep(0.01)
        asyncio.get_running_loop().call_later(0.2, release.set)
        await ops.close_net()
        workers.pool.shutdown(wait=True)

    asyncio.run(go())
    assert order == ["retry begins", "retry ends", "close"]


def test_a_gone_sandbox_s_leftovers_a_start_could_not_remove_are_retried(monkeypatch, tmp_path):
    """A restart between a failed detach's tries: the record it kept names
    the leftovers, and the start's readopt removes them. What it could not
    remove then (`held`) is retried in the background as the destroy's
    detach was, not left until yet another restart."""
    import dsecd.net

    retried: list[str] = []

    class Net:
        dns_enabled = False

        def __init__(self, *args, **kwargs):
            pass

        def readopt(self, live: dict) -> dict:
            return {"adopted": [], "released": [], "failed": {}, "sealed": [], "held": ["sb1"]}

        def retry_detach(self, sb_id: str) -> None:
            retried.append(sb_id)

    class Service(NetworkService):
        def _watch_host_addresses(self, net) -> None:
            pass

    monkeypatch.setattr(dsecd.net, "Network", Net)

    async def go() -> None:
        workers = Workers(1)
        workers.start(asyncio.get_running_loop())
        cfg = SimpleNamespace(section=load_config().section, state_dir=tmp_path)
        ops = Service(cfg, SimpleNamespace(v2=tmp_path), "dsecd-test", 1, SimpleNamespace(by_id={}), workers, None)
        ops.detach_retry_s = (0.0,)
        await ops.network()
        await asyncio.gather(*ops._detach_retries.values())
        workers.pool.shutdown(wait=True)

    asyncio.run(go())
    assert retried == ["sb1"]
