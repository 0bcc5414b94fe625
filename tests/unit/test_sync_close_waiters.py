"""A SyncClient closed while other threads wait on it (a stream's next
chunk, a followed process's output, a request), against a stand-in daemon
on a unix socket that answers hello and nothing else: every waiting thread
ends with a ConnectionError instead of waiting forever on a loop that
stopped under it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from standin_kit import hello_then_hold

from dsecd.client import Process, Sandbox
from dsecd.sync import SyncClient, SyncExecStream, SyncProcess, SyncSandbox


@pytest.fixture
def standin(tmp_path):
    sock_path = str(tmp_path / "d.sock")
    loop = asyncio.new_event_loop()
    listening, stop = threading.Event(), asyncio.Event()

    async def serve():
        server = await asyncio.start_unix_server(hello_then_hold, sock_path)
        async with server:
            listening.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    assert listening.wait(30)
    yield sock_path
    loop.call_soon_threadsafe(stop.set)
    thread.join()
    loop.close()


@pytest.mark.parametrize("rounds", range(5))
def test_threads_waiting_on_a_sync_client_end_when_it_is_closed(standin, rounds):
    c = SyncClient(standin)
    c.connect()
    sb = Sandbox(c._client, "sb", {})
    waits = {
        "exec": lambda: SyncSandbox(c, sb).exec("sleep 30"),
        "exec_stream": lambda: list(SyncExecStream(c, sb.exec_stream("sleep 30"))),
        "output": lambda: list(SyncProcess(c, Process(sb, 3)).output()),
        "watch": lambda: list(SyncSandbox(c, sb).watch("/tmp")),
    }
    ended: dict[str, BaseException | None] = {}
    started = threading.Barrier(len(waits) + 1)

    def wait(name):
        started.wait()
        try:
            waits[name]()
            ended[name] = None
        except BaseException as err:
            ended[name] = err

    threads = [threading.Thread(target=wait, args=(name,), daemon=True) for name in waits]
    for t in threads:
        t.start()
    started.wait()
    # Each thread's request is on the loop before the close: the stand-in
    # answers none of them.
    while len(c._client._conn.pending) < len(waits):
        time.sleep(0.01)
    c.close()
    for t in threads:
        t.join(20)                   # a guard against a hang, not a measure
    assert [name for name, t in zip(waits, threads, strict=True) if t.is_alive()] == []
    assert all(isinstance(err, ConnectionError) for err in ended.values()), ended
