"""Leaving `async with client.sandbox(...)` (and the SyncClient's `with`)
on an error or a cancel while the sandbox's destroy fails too, against a
stand-in daemon on a unix socket whose connection drops at each destroy."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from standin_kit import serving

from dsecd import protocol
from dsecd.client import Client
from dsecd.sync import SyncClient


async def _destroy_drops(f: dict, writer) -> bool:
    if f["op"] == "create":
        writer.write(protocol.encode_frame({"id": f["id"], "result": {"id": "sb1", "state": "running"}}))
        return False
    writer.transport.abort()                 # the daemon goes under the destroy
    return True


def test_a_cancel_that_ends_the_block_is_not_turned_into_the_destroys_error(tmp_path, caplog):
    """asyncio.timeout around the block raised ConnectionLost, not
    TimeoutError (and a TaskGroup saw a task fail instead of being
    cancelled): the destroy's error replaced the cancel."""
    sock_path = str(tmp_path / "d.sock")

    async def go():
        server = await asyncio.start_unix_server(serving(_destroy_drops), sock_path)
        async with server:
            async with Client(sock_path) as c:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2), c.sandbox("busybox"):
                        await asyncio.sleep(30)

    with caplog.at_level(logging.WARNING, logger="dsecd.client"):
        asyncio.run(go())
    assert "sb1" in caplog.text and "dsec rm --force sb1" in caplog.text     # what is left, said


def test_the_blocks_own_error_is_the_one_raised(tmp_path, caplog):
    sock_path = str(tmp_path / "d.sock")

    listening = threading.Event()

    async def serve(stop: asyncio.Event):
        server = await asyncio.start_unix_server(serving(_destroy_drops), sock_path)
        async with server:
            listening.set()
            await stop.wait()

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(stop),))
    thread.start()
    try:
        assert listening.wait(30)
        with SyncClient(sock_path) as c, caplog.at_level(logging.WARNING, logger="dsecd.client"):
            with pytest.raises(ValueError, match="the agent failed"), c.sandbox("busybox"):
                raise ValueError("the agent failed")
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join()
        loop.close()
    assert "dsec rm --force sb1" in caplog.text
