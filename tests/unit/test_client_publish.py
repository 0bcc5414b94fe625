"""What the SDK sends to publish a port, against a stand-in daemon on a
unix socket: a TCP port's requests carry no `protocol` (a daemon that
publishes TCP only refuses a field it does not know), a UDP port's do."""

from __future__ import annotations

import asyncio

import pytest
from standin_kit import serving

from dsecd import protocol
from dsecd.client import Client, Sandbox
from dsecd.errors import BadRequest
from dsecd.sync import SyncSandbox


def _sent(tmp_path, call) -> list[dict]:
    """The args of the requests `await call(sandbox)` sends, each answered {}."""
    sock_path = str(tmp_path / "d.sock")
    seen: list[dict] = []

    async def answer(f: dict, writer) -> bool:
        seen.append({"op": f["op"], **f.get("args", {})})
        result = {"id": "sb1", "ports": []} if f["op"] != "net_publish" else {"host": "10.88.0.1:30000"}
        writer.write(protocol.encode_frame({"id": f["id"], "result": result}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                await asyncio.wait_for(call(Sandbox(c, "sb1", {"id": "sb1"})), 10)

    asyncio.run(go())
    return seen


def test_a_tcp_port_is_asked_for_as_a_daemon_that_publishes_tcp_only_takes_it(tmp_path):
    async def call(sb):
        await sb.publish(8080)
        await sb.unpublish(8080, protocol="TCP")
        await sb.get_host(8080)

    sent = _sent(tmp_path, call)
    assert [(f["op"], "protocol" in f) for f in sent] == [("net_publish", False), ("net_unpublish", False),
                                                          ("net_show", False), ("net_publish", False)]


def test_a_udp_port_is_asked_for_with_its_protocol(tmp_path):
    async def call(sb):
        await sb.publish(5353, protocol="udp")
        await sb.unpublish(5353, protocol="UDP")
        await sb.get_host(5353, protocol="udp")

    sent = _sent(tmp_path, call)
    assert [(f["op"], f.get("protocol")) for f in sent] == [("net_publish", "udp"), ("net_unpublish", "udp"),
                                                            ("net_show", None), ("net_publish", "udp")]


def test_another_protocol_is_refused_before_anything_is_sent(tmp_path):
    async def call(sb):
        with pytest.raises(BadRequest, match="protocol 'sctp' of a published port is not tcp or udp"):
            await sb.publish(5353, protocol="sctp")

    assert _sent(tmp_path, call) == []


def test_a_port_named_with_its_protocol_is_asked_for_as_that_protocol(tmp_path):
    """"5353/udp", as create's publish and `dsec port` take it, is 5353 over
    UDP; "8080" and "8080/tcp" are TCP ports."""
    async def call(sb):
        await sb.publish("5353/udp")
        await sb.unpublish("5353/UDP")
        await sb.get_host("5353/udp")
        await sb.publish("8080")
        await sb.publish("8080/tcp", protocol="tcp")

    sent = _sent(tmp_path, call)
    assert [(f["op"], f.get("port"), f.get("protocol")) for f in sent] == [
        ("net_publish", 5353, "udp"), ("net_unpublish", 5353, "udp"), ("net_show", None, None),
        ("net_publish", 5353, "udp"), ("net_publish", 8080, None), ("net_publish", 8080, None)]


def test_a_port_whose_protocol_contradicts_the_one_given_is_refused(tmp_path):
    async def call(sb):
        with pytest.raises(BadRequest, match="port '5353/udp' is udp, but protocol 'tcp' was given"):
            await sb.publish("5353/udp", protocol="tcp")
        with pytest.raises(BadRequest, match="is not a port"):
            await sb.publish("dns")

    assert _sent(tmp_path, call) == []


def test_the_sync_sdk_takes_a_port_named_with_its_protocol(tmp_path):
    """SyncSandbox passed protocol="tcp" on whenever none was given, so
    "5353/udp" there was refused as contradicting it."""
    sent: list[tuple] = []

    class Recorder:
        target = "stand-in"

        async def request(self, op, **args):
            sent.append((op, args.get("port"), args.get("protocol")))
            return {"ports": []} if op == "net_show" else {"host": "10.88.0.1:30000"}

    class Owner:
        def _run(self, coro):
            return asyncio.run(coro)

    sb = SyncSandbox(Owner(), Sandbox(Recorder(), "sb1", {"id": "sb1"}))
    sb.publish("5353/udp")
    sb.unpublish("5353/udp")
    assert sb.get_host("5353/udp") == "10.88.0.1:30000"
    sb.publish(8080)
    sb.publish(5353, protocol="udp")
    assert sent == [("net_publish", 5353, "udp"), ("net_unpublish", 5353, "udp"), ("net_show", None, None),
                    ("net_publish", 5353, "udp"), ("net_publish", 8080, None), ("net_publish", 5353, "udp")]
