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


@pytest.mark.parametrize("answer", ["ok", "fails"])
def test_a_destroy_whose_caller_is_cancelled_twice_is_neither_lost_nor_unheard(tmp_path, caplog, answer):
    """The first cancel ends the block and starts the (shielded) destroy;
    a second one ends the wait for it. The destroy went on unseen: a
    failure of it was never retrieved, and the client's close right after
    cut it off. The close now waits for it, and its failure is logged."""
    sock_path = str(tmp_path / "d.sock")
    order: list[str] = []
    destroying = asyncio.Event()
    release = asyncio.Event()

    async def handle(reader, writer):
        dec = protocol.FrameDecoder(1 << 20)

        async def answer_destroy(f):
            await release.wait()
            if answer == "ok":
                writer.write(protocol.encode_frame({"id": f["id"], "result": {"id": "sb1"}}))
            else:
                writer.write(protocol.encode_frame({"id": f["id"], "error": {
                    "code": "internal", "message": "destroy sb1: the cgroup is busy", "detail": {}}}))
            order.append("answered")

        while data := await reader.read(65536):
            for f in dec.feed(data):
                if f["op"] == "hello":
                    writer.write(protocol.encode_frame({"id": f["id"], "result": {"limits": {}}}))
                elif f["op"] == "create":
                    writer.write(protocol.encode_frame({"id": f["id"], "result": {"id": "sb1", "state": "running"}}))
                elif f["op"] == "destroy":
                    destroying.set()
                    asyncio.ensure_future(answer_destroy(f))
        order.append("closed")

    async def go():
        server = await asyncio.start_unix_server(handle, sock_path)
        async with server:
            async with Client(sock_path) as c:
                made = asyncio.Event()

                async def block():
                    async with c.sandbox("busybox"):
                        made.set()
                        await asyncio.sleep(30)

                task = asyncio.create_task(block())
                await made.wait()
                task.cancel()
                await destroying.wait()
                task.cancel()                   # the caller gives up on the destroy too
                with pytest.raises(asyncio.CancelledError):
                    await task
                closing = asyncio.create_task(c.close())
                await asyncio.sleep(0.1)
                release.set()
                await closing
            while "closed" not in order:
                await asyncio.sleep(0.01)

    with caplog.at_level(logging.WARNING, logger="dsecd.client"):
        asyncio.run(go())
    assert order == ["answered", "closed"]          # the destroy was answered before the client left
    if answer == "fails":
        assert "the cgroup is busy" in caplog.text and "dsec rm --force sb1" in caplog.text, caplog.text
        assert caplog.text.count("dsec rm --force sb1") == 1
    else:
        assert "sb1" not in caplog.text


def test_a_sync_blocks_destroy_interrupted_by_a_second_ctrl_c_goes_on_and_is_heard(tmp_path, caplog):
    """`with c.sandbox(...)`: a ^C ends the block, and a second one, while
    its destroy runs, cancelled the destroy on the loop (the sandbox left
    behind, nothing said). The destroy goes on; its failure is logged."""
    import os
    import signal

    sock_path = str(tmp_path / "d.sock")
    ops: list[str] = []
    listening = threading.Event()
    destroying = threading.Event()

    async def serve(stop: asyncio.Event, release: asyncio.Event):
        async def handle(reader, writer):
            dec = protocol.FrameDecoder(1 << 20)

            async def answer_destroy(f):
                await release.wait()
                writer.write(protocol.encode_frame({"id": f["id"], "error": {
                    "code": "internal", "message": "destroy sb1: the cgroup is busy", "detail": {}}}))

            while data := await reader.read(65536):
                for f in dec.feed(data):
                    ops.append(f["op"])
                    if f["op"] == "hello":
                        writer.write(protocol.encode_frame({"id": f["id"], "result": {"limits": {}}}))
                    elif f["op"] == "create":
                        writer.write(protocol.encode_frame({"id": f["id"], "result": {"id": "sb1"}}))
                    elif f["op"] == "destroy":
                        asyncio.ensure_future(answer_destroy(f))
                        destroying.set()

        server = await asyncio.start_unix_server(handle, sock_path)
        async with server:
            listening.set()
            await stop.wait()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    loop = asyncio.new_event_loop()
    stop, release = asyncio.Event(), asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(stop, release),))
    thread.start()
    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        assert listening.wait(30)
        ctrl_c = threading.Thread(target=lambda: destroying.wait(30) and os.kill(os.getpid(), signal.SIGUSR1))
        ctrl_c.start()
        with caplog.at_level(logging.WARNING, logger="dsecd.client"):
            c = SyncClient(sock_path)
            with c:
                with pytest.raises(KeyboardInterrupt), c.sandbox("busybox"):
                    raise KeyboardInterrupt           # the first ^C
                loop.call_soon_threadsafe(release.set)
        ctrl_c.join()
    finally:
        signal.signal(signal.SIGUSR1, old)
        loop.call_soon_threadsafe(stop.set)
        thread.join()
        loop.close()
    assert "cancel" not in ops, ops
    assert "the cgroup is busy" in caplog.text and "dsec rm --force sb1" in caplog.text, caplog.text


@pytest.mark.parametrize("ran", ["yes", "no", "under_way"])
def test_a_blocks_destroy_cut_by_a_daemon_restart_is_sent_again(tmp_path, ran):
    """The destroy as the block ends, lost in flight (a daemon restart),
    raised ConnectionLost and may have left the sandbox. Sent again to the
    next daemon, it ends what it did not, or finds the sandbox gone, or
    (the same daemon, reached again) still being destroyed."""
    sock_path = str(tmp_path / "d.sock")
    destroys: list[dict] = []

    async def answer(f: dict, writer) -> bool:
        if f["op"] == "create":
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"id": "sb1", "state": "running"}}))
            return False
        if f["op"] == "destroy":
            destroys.append(f["args"])
            if len(destroys) == 1:
                writer.transport.abort()         # the daemon goes under it
                return True
            if ran == "no":
                writer.write(protocol.encode_frame({"id": f["id"], "result": {"id": "sb1"}}))
            else:
                error = ({"code": "not_found", "message": "no sandbox sb1", "detail": {}} if ran == "yes" else
                         {"code": "conflict", "message": "sandbox sb1 is already being destroyed",
                          "detail": {"sandbox": "sb1"}})
                writer.write(protocol.encode_frame({"id": f["id"], "error": error}))
            return False
        if f["op"] == "inspect":
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"id": "sb1", "state": "stopping"}}))
            return False
        writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                async with c.sandbox("busybox"):
                    pass

    asyncio.run(asyncio.wait_for(go(), 30))
    assert destroys == [{"sandbox": "sb1", "force": True}] * 2


def test_close_waits_for_an_undo_that_waits_out_a_restart(tmp_path, monkeypatch):
    """An undo the caller gave up on (a block's destroy, a cancelled
    create's) may wait up to reconnect_timeout for a restarted daemon
    before its round trip: close() waits that long too, not only for the
    round trip, or it cuts the undo off and the sandbox is left."""
    from dsecd.client import wire

    monkeypatch.setattr(wire, "ABANDONED_CREATE_WAIT_S", 0.1)

    async def go():
        c = Client(str(tmp_path / "none.sock"), reconnect_timeout=1.0)
        undo = asyncio.get_running_loop().create_task(asyncio.sleep(0.5))    # the daemon back after 0.5 s
        c._undoing.add(undo)
        undo.add_done_callback(c._undoing.discard)
        await c.close()
        return undo.done()

    assert asyncio.run(go())


def test_an_interrupt_just_after_a_call_is_handed_to_the_loop_cancels_it(tmp_path, monkeypatch):
    """A ^C that landed after a blocking call was handed to the client's
    loop but before the wait for it began escaped without cancelling it:
    the call (a block's destroy, an exec) went on unseen, and its failure
    was never said. It is cancelled as one interrupted during the wait."""
    c = SyncClient(str(tmp_path / "no.sock"))
    finished = threading.Event()

    async def long_call():
        await asyncio.sleep(0.5)
        finished.set()

    real = c._hand

    def hand_then_interrupt(coro, awaitable):
        real(coro, awaitable)
        raise KeyboardInterrupt             # the signal handler's, between the hand-off and the wait

    monkeypatch.setattr(c, "_hand", hand_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        c._run(long_call())
    monkeypatch.undo()
    assert not finished.wait(1.5), "the interrupted call ran on"
    c.close()
