"""The daemon's stop cancels the requests in flight, and the node's close
comes only once their undoing is done (an exec's group killed, a copy's
temp files removed), since it closes what that undoing goes through (init's
channels, the worker pool): Server.stop, then Server.wait_stopped, bounded."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from types import SimpleNamespace

from dsecd import protocol
from dsecd.server import Server

LIMITS = {"max_requests_per_client": 8, "max_connections": 8, "frame_timeout_s": 10, "hello_timeout_s": 10}


def _server(tmp_path, handler) -> Server:
    """A server whose `ping` is `handler`, serving no socket path: a test
    hands it one end of a socket pair (serve)."""
    node = SimpleNamespace(routes=lambda: {"ping": handler}, hello_result=lambda: {"server": "stand-in"})
    return Server(node, str(tmp_path / "dsecd.sock"), "", LIMITS, 1 << 20)


async def _serve_ping(server: Server) -> asyncio.StreamWriter:
    """A client connected to `server` through a socket pair, its `ping` sent
    after its hello was answered."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    await asyncio.get_running_loop().connect_accepted_socket(server._new_protocol, sock=theirs)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    writer.write(protocol.encode_frame({"id": 1, "op": "hello", "args": {"protocol": protocol.PROTOCOL_VERSION}}))
    dec = protocol.FrameDecoder(1 << 20)
    while not dec.feed(await reader.read(65536)):
        pass
    writer.write(protocol.encode_frame({"id": 2, "op": "ping"}))
    return writer


def _undoing_in_turns(events: list[str], started: asyncio.Event, turns: int, undoing: asyncio.Event | None = None,
                      until: asyncio.Event | None = None):
    """A handler that runs until cancelled, then undoes over `turns` loop
    turns (as a streamed exec's kill waits for its pipe readers first), and
    until `until` is set if given; `undoing` is set as that begins."""
    async def handler(req, ctx) -> dict:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if undoing is not None:
                undoing.set()
            for _ in range(turns):
                await asyncio.sleep(0)
            if until is not None:
                await until.wait()
            events.append("undone")
            raise
        return {}
    return handler


def test_the_stop_waits_for_the_undoing_of_the_requests_it_cancelled(tmp_path):
    async def scenario() -> tuple[list[str], int]:
        events: list[str] = []
        started = asyncio.Event()
        server = _server(tmp_path, _undoing_in_turns(events, started, 5))
        client = await _serve_ping(server)
        await asyncio.wait_for(started.wait(), 10)
        await server.stop()
        left = await server.wait_stopped(10)
        events.append("node closes")         # what the daemon does next (Node.close)
        client.close()
        return events, left

    events, left = asyncio.run(scenario())
    assert events == ["undone", "node closes"]
    assert left == 0


def _cancelled_then_stopped(tmp_path, cancels: int) -> list[str]:
    """A request named by `cancels` cancel requests (the later ones while
    the first's undoing runs), then the server's stop: what happened, in
    order ("undone" once its undoing ran whole)."""
    async def scenario() -> list[str]:
        events: list[str] = []
        started = asyncio.Event()
        undoing = asyncio.Event()
        all_sent = asyncio.Event()          # the undoing outlasts every cancel
        server = _server(tmp_path, _undoing_in_turns(events, started, 0, undoing, until=all_sent))
        client = await _serve_ping(server)
        await asyncio.wait_for(started.wait(), 10)
        for n in range(cancels):
            client.write(protocol.encode_frame({"id": 3 + n, "op": "cancel", "args": {"target": 2}}))
            if n == 0:
                await asyncio.wait_for(undoing.wait(), 10)
        for _ in range(50):                    # the cancels are read and handled
            await asyncio.sleep(0)
        all_sent.set()
        await server.stop()
        await server.wait_stopped(10)
        events.append("node closes")
        client.close()
        return events

    return asyncio.run(scenario())


def test_a_cancel_named_request_is_not_cut_short_by_the_stop(tmp_path):
    """A request whose undoing a `cancel` began is not cancelled again by the
    stop: a second CancelledError would land in its undoing."""
    assert _cancelled_then_stopped(tmp_path, 1) == ["undone", "node closes"]


def test_a_request_whose_client_went_is_not_cut_short_by_the_stop(tmp_path):
    """A connection whose client went is closing: it cancelled its requests
    and waits for them. The stop leaves it to that (a cancel of its task
    would cancel their undoing again) and waits for it too."""
    async def scenario() -> list[str]:
        events: list[str] = []
        started, undoing = asyncio.Event(), asyncio.Event()
        server = _server(tmp_path, _undoing_in_turns(events, started, 5, undoing))
        client = await _serve_ping(server)
        await asyncio.wait_for(started.wait(), 10)
        client.close()
        await asyncio.wait_for(undoing.wait(), 10)
        await server.stop()
        await server.wait_stopped(10)
        events.append("node closes")
        return events

    assert asyncio.run(scenario()) == ["undone", "node closes"]


def test_an_undoing_that_does_not_end_is_waited_for_only_so_long(tmp_path, caplog):
    async def scenario() -> int:
        started = asyncio.Event()
        hang = asyncio.Event()

        async def handler(req, ctx) -> dict:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await hang.wait()        # a kill through a wedged guest agent
                raise
            return {}

        server = _server(tmp_path, handler)
        client = await _serve_ping(server)
        await asyncio.wait_for(started.wait(), 10)
        await server.stop()
        left = await server.wait_stopped(0.2)
        hang.set()                       # let it end: the loop closes clean
        await server.wait_stopped(10)
        client.close()
        return left

    with caplog.at_level(logging.WARNING, logger="dsecd.server"):
        assert asyncio.run(scenario()) == 1
    # Each named by op, id and client: which request of whom was left.
    assert re.search(r"1 request\(s\) \(ping #2 of pid=\d+ uid=\d+ gid=\d+\) of 1 connection\(s\) not ended 0 s "
                     r"after they were cancelled", caplog.text), caplog.text


def test_a_connection_the_loop_took_up_after_the_stop_is_not_served(tmp_path):
    """A connection accepted just before the stop reaches the server a loop
    turn or two later (asyncio makes its transport, then calls
    connection_made): after the stop it is closed unserved, not answered,
    and its requests do not run while the node closes."""
    async def scenario() -> tuple[bytes, int]:
        ran = []

        async def handler(req, ctx) -> dict:
            ran.append(req.OP)
            return {}

        server = _server(tmp_path, handler)
        await server.stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        await asyncio.get_running_loop().connect_accepted_socket(server._new_protocol, sock=theirs)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        writer.write(protocol.encode_frame({"id": 1, "op": "hello", "args": {"protocol": protocol.PROTOCOL_VERSION}}))
        writer.write(protocol.encode_frame({"id": 2, "op": "ping"}))
        try:
            got = await asyncio.wait_for(reader.read(65536), 10)
        except ConnectionError:          # closed under the client's writes: nothing came back
            got = b""
        await server.wait_stopped(10)
        writer.close()
        return got, len(ran)

    assert asyncio.run(scenario()) == (b"", 0)


def test_a_second_cancel_of_one_request_does_not_cut_its_undoing_short(tmp_path):
    """A client that sends `cancel` again (its first answer was slow, or it
    retried after a cut) names a request whose undoing the first began: a
    second CancelledError would land in that undoing."""
    assert _cancelled_then_stopped(tmp_path, 2) == ["undone", "node closes"]
