"""Requests the caller gives up on (a cancel, a timeout, a Ctrl-C in a
SyncClient's call), against a stand-in daemon on a unix socket: the daemon
is told to cancel them, and a create it finished before the cancel landed
is destroyed, not left for nobody to find."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from dsecd import Client, Sandbox, SyncClient, protocol


class StandInDaemon:
    """Answers hello; holds each create and exec until its cancel comes (an
    exec's answer is then `conflict`, a create's  as `on_cancel` says: "made" (the create had finished: its result goes
    first, and the cancel finds nothing in flight), "existing" (the same,
    the key's sandbox from before) or "cancelled" (conflict). Notes every
    request's op and args."""

    def __init__(self, path: str, on_cancel: str):
        self.path = path
        self.on_cancel = on_cancel
        self.seen: list[tuple[str, dict]] = []
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> StandInDaemon:
        self.server = await asyncio.start_unix_server(self._serve, self.path)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    def ops(self, op: str) -> list[dict]:
        return [args for o, args in self.seen if o == op]

    async def _serve(self, reader, writer) -> None:
        """Every frame noted, hello answered, the others to answer()."""
        dec = protocol.FrameDecoder(1 << 20)
        held: dict = {}             # this connection's requests answer() keeps for later
        while data := await reader.read(65536):
            for f in dec.feed(data):
                op, rid, args = f["op"], f["id"], f.get("args", {})
                self.seen.append((op, args))
                if op == "hello":
                    writer.write(protocol.encode_frame({"id": rid, "result": {"limits": {}}}))
                else:
                    self.answer(op, rid, args, held, writer)
            await writer.drain()

    def answer(self, op: str, rid: int, args: dict, held: dict, writer) -> None:
        if op in ("create", "exec", "proc_start"):
            held[rid] = op
        elif op == "cancel":
            target = args["target"]
            what = held.pop(target, None)
            if self.on_cancel == "cancelled" or what == "exec":
                writer.write(protocol.encode_frame(
                    {"id": target, "error": {"code": "conflict", "message": "request cancelled"}}))
                writer.write(protocol.encode_frame({"id": rid, "result": {"cancelled": target}}))
                return
            if what == "proc_start":
                made = {"pid": 42, "started": 1.0}
            else:
                made = {"id": "sb-late", **({"existing": True} if self.on_cancel == "existing" else {})}
            writer.write(protocol.encode_frame({"id": target, "result": made}))
            writer.write(protocol.encode_frame({"id": rid, "error": {
                "code": "bad_request", "message": f"no request {target} in flight on this connection"}}))
        elif op == "destroy":
            writer.write(protocol.encode_frame({"id": rid, "result": {"id": args["sandbox"]}}))
        elif op == "proc_kill":
            writer.write(protocol.encode_frame({"id": rid, "result": {"pid": args["pid"], "signal": 9,
                                                                      "sent": True}}))

def cancelled_create(tmp_path, on_cancel: str, close_at_once: bool = False) -> StandInDaemon:
    """A create that times out (asyncio.wait_for) against the stand-in daemon:
    what the daemon saw by the time the timeout reached the caller (or, with
    close_at_once, by the time the client's close() returned)."""
    daemon = StandInDaemon(str(tmp_path / "d.sock"), on_cancel)

    async def go():
        async with daemon:
            c = Client(daemon.path)
            await c.connect()
            try:
                create = c.create("busybox", key="k1")
                if close_at_once:
                    task = asyncio.ensure_future(create)
                    await asyncio.sleep(0.1)
                    task.cancel()
                    await asyncio.sleep(0)         # the cancel lands; close() must wait for the undo
                else:
                    with pytest.raises(TimeoutError):
                        await asyncio.wait_for(create, 0.1)
                    return [op for op, _ in daemon.seen]
            finally:
                await c.close()
            return [op for op, _ in daemon.seen]

    daemon.seen_by_then = asyncio.run(go())
    return daemon


def test_a_create_made_before_its_cancel_landed_is_destroyed(tmp_path):
    daemon = cancelled_create(tmp_path, "made")
    assert daemon.seen_by_then == ["hello", "create", "cancel", "destroy"]
    assert daemon.ops("destroy") == [{"sandbox": "sb-late", "force": True}]


def test_closing_the_client_waits_for_the_undo_of_a_cancelled_create(tmp_path):
    daemon = cancelled_create(tmp_path, "made", close_at_once=True)
    assert daemon.ops("destroy") == [{"sandbox": "sb-late", "force": True}]


def test_a_create_the_daemon_cancelled_destroys_nothing(tmp_path):
    daemon = cancelled_create(tmp_path, "cancelled")
    assert daemon.seen_by_then == ["hello", "create", "cancel"] and daemon.ops("destroy") == []


def test_the_sandbox_of_a_key_from_an_earlier_create_is_not_destroyed(tmp_path):
    """`existing`: the key's sandbox, made and handed out before; not this create's to undo."""
    daemon = cancelled_create(tmp_path, "existing")
    assert daemon.seen_by_then == ["hello", "create", "cancel"] and daemon.ops("destroy") == []


def cancelled_spawn(tmp_path, on_cancel: str) -> StandInDaemon:
    """A spawn that times out (asyncio.wait_for) against the stand-in
    daemon: what the daemon saw by the time the timeout reached the caller."""
    daemon = StandInDaemon(str(tmp_path / "d.sock"), on_cancel)

    async def go():
        async with daemon:
            async with Client(daemon.path) as c:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(Sandbox(c, "sb-1", {}).spawn("sleep 100"), 0.1)
                return [op for op, _ in daemon.seen]

    daemon.seen_by_then = asyncio.run(go())
    return daemon


def test_a_process_started_before_its_cancel_landed_is_killed(tmp_path):
    """A spawn the caller gave up on (a step's timeout) that the daemon had
    started: its pid reached nobody, so it is killed, not left running."""
    daemon = cancelled_spawn(tmp_path, "made")
    assert daemon.seen_by_then == ["hello", "proc_start", "cancel", "proc_kill"]
    assert daemon.ops("proc_kill") == [{"sandbox": "sb-1", "pid": 42, "signal": "KILL"}]


def test_a_spawn_the_daemon_cancelled_kills_nothing(tmp_path):
    daemon = cancelled_spawn(tmp_path, "cancelled")
    assert daemon.seen_by_then == ["hello", "proc_start", "cancel"] and daemon.ops("proc_kill") == []


def interrupted_sync_call(tmp_path, on_cancel: str, call) -> StandInDaemon:
    """call(sync_client) interrupted by a SIGINT to this thread while it
    waits: what the daemon saw soon after the KeyboardInterrupt came out
    (before the client's close, which would end the request anyway)."""
    daemon = StandInDaemon(str(tmp_path / "d.sock"), on_cancel)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()

    async def serve():
        async with daemon:
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(5)
    main = threading.get_ident()
    c = SyncClient(daemon.path)
    try:
        c.connect()
        timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        t = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            call(c)
        daemon.took = time.monotonic() - t
        # The cancel has been sent; give the stand-in a moment to read it.
        for _ in range(100):
            if "cancel" in [op for op, _ in daemon.seen]:
                break
            time.sleep(0.01)
        daemon.seen_by_then = [op for op, _ in daemon.seen]
    finally:
        c.close()
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)
        loop.close()
    return daemon


def test_an_exec_interrupted_by_ctrl_c_in_a_sync_client_is_cancelled(tmp_path):
    def call(c):
        c.request("exec", sandbox="sb1", argv=["sleep", "60"])

    daemon = interrupted_sync_call(tmp_path, "cancelled", call)
    assert daemon.seen_by_then == ["hello", "exec", "cancel"] and daemon.took < 5


def test_a_create_interrupted_by_ctrl_c_in_a_sync_client_leaves_nothing(tmp_path):
    daemon = interrupted_sync_call(tmp_path, "made", lambda c: c.create("busybox"))
    assert daemon.seen_by_then == ["hello", "create", "cancel", "destroy"]
    assert daemon.ops("destroy") == [{"sandbox": "sb-late", "force": True}]


class SlowKeyDaemon(StandInDaemon):
    """A create of a key is made, but answered only when a create of the
    same key comes again (after the first one's cancel): first the
    first one's result, then the second's, the key's sandbox (`existing`)."""

    def answer(self, op: str, rid: int, args: dict, held: dict, writer) -> None:
        if op == "create" and args["key"] not in held:
            held[args["key"]] = rid
        elif op == "create":
            sb = f"sb-{args['key']}"
            writer.write(protocol.encode_frame({"id": held.pop(args["key"]), "result": {"id": sb}}))
            writer.write(protocol.encode_frame({"id": rid, "result": {"id": sb, "existing": True}}))
        elif op == "cancel":
            writer.write(protocol.encode_frame({"id": rid, "error": {
                "code": "bad_request", "message": "no request in flight"}}))
        elif op == "destroy":
            writer.write(protocol.encode_frame({"id": rid, "result": {"id": args["sandbox"]}}))

def test_a_timed_out_create_whose_key_was_asked_again_leaves_the_sandbox_to_that_create(tmp_path, monkeypatch):
    """A create timed out on a slow daemon; the caller sent it again with
    its key while the first one's answer had not come. The daemon had made
    the sandbox, and answered the retry with it (`existing`); the undo of
    the first then destroyed it under the caller, who held the retry's
    handle. A sandbox of a key asked for again is the retry's."""
    from dsecd.client import wire

    monkeypatch.setattr(wire, "ABANDONED_CREATE_WAIT_S", 0.2)
    daemon = SlowKeyDaemon(str(tmp_path / "d.sock"), "made")

    async def go():
        async with daemon:
            async with Client(daemon.path) as c:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(c.create("busybox", key="k1"), 0.1)
                sb = await c.create("busybox", key="k1")
                await asyncio.sleep(0.3)             # the first one's undo has seen its answer by now
                return sb.id

    assert asyncio.run(go()) == "sb-k1"
    assert [op for op, _ in daemon.seen] == ["hello", "create", "cancel", "create"]
