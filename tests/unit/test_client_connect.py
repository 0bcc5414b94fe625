"""dsecd.Client.connect against sockets that are not a serving daemon."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

import pytest
from standin_kit import hello_then_drop

from dsecd import Client, protocol


def test_a_socket_nobody_serves_is_a_connection_error_after_the_timeout(tmp_path):
    """Held open but never accepted (what a dead daemon's leftover process
    holding its listening socket looks like): connect() gives up."""
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)            # connections queue; nobody ever accepts or answers

    async def go():
        c = Client(path, connect_timeout=0.3)
        t = time.monotonic()
        with pytest.raises(ConnectionError) as e:
            await c.connect()
        return time.monotonic() - t, str(e.value)

    try:
        took, message = asyncio.run(go())
    finally:
        listener.close()
    assert 0.3 <= took < 5 and "did not answer in 0.3 s" in message and path in message


def test_no_socket_is_a_connection_error_at_once(tmp_path):
    async def go():
        with pytest.raises(ConnectionError) as e:
            await Client(str(tmp_path / "none.sock")).connect()
        return str(e.value)

    assert "is the daemon running?" in asyncio.run(go())


def test_a_socket_another_program_serves_is_said_to_be_one(tmp_path):
    """DSEC_SOCKET pointed at another server's socket (an HTTP one here):
    its answer is said to be no dsecd's, not a frame over the limit."""
    path = str(tmp_path / "http.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)

    async def go():
        loop = asyncio.get_running_loop()
        listener.setblocking(False)

        async def serve():
            peer, _ = await loop.sock_accept(listener)
            with peer:
                await loop.sock_sendall(peer, b"HTTP/1.1 400 Bad Request\r\n\r\n")
                await asyncio.sleep(5)

        server = asyncio.create_task(serve())
        try:
            with pytest.raises(ConnectionError) as e:
                await Client(path, connect_timeout=10).connect()
        finally:
            server.cancel()
        return str(e.value)

    try:
        message = asyncio.run(go())
    finally:
        listener.close()
    assert "not dsecd frames (they begin b'HTTP')" in message and f"is {path} another program's socket?" in message


def test_a_closed_sync_client_says_a_new_one_is_needed(tmp_path):
    """A closed SyncClient's loop thread is gone: unlike an async Client,
    connect() cannot bring it back, and every call says so."""
    from dsecd import SyncClient

    c = SyncClient(str(tmp_path / "none.sock"))
    c.close()
    for call in (c.list, c.connect):
        with pytest.raises(ConnectionError) as e:
            call()
        assert str(e.value) == "this SyncClient is closed: make a new SyncClient to talk to the daemon again"


def test_a_client_never_connected_says_how_to_connect_in_its_own_terms(tmp_path):
    """SyncClient's advice is `with`, the async Client's `async with`."""
    from dsecd import SyncClient

    path = str(tmp_path / "none.sock")
    c = SyncClient(path)
    try:
        with pytest.raises(ConnectionError) as e:
            c.list()
        assert str(e.value) == f"list: not connected to dsecd at {path}: call connect() first (or use `with`)"
        with pytest.raises(ConnectionError, match=r"^events: not connected .*\(or use `with`\)$"):
            next(iter(c.events()))
        assert not c.connected
    finally:
        c.close()

    async def go():
        with pytest.raises(ConnectionError) as e:
            await Client(path).list()
        return str(e.value)

    assert asyncio.run(go()).endswith("call connect() first (or use `async with`)")


def test_a_lost_connections_advice_is_its_owners(tmp_path):
    """A stand-in daemon answers hello, then drops the connection at the
    first request: the SDK's own Client says to connect() again, a Fleet's
    that the fleet connects again, the CLI's to run the command again."""
    from types import SimpleNamespace

    from dsecd import ConnectionLost, Fleet
    from dsecd.cli import make_client

    path = str(tmp_path / "d.sock")

    async def lost(c) -> str:
        await c.connect()
        with pytest.raises(ConnectionLost) as e:
            await c.request("list")
        await c.close()
        return str(e.value)

    async def go():
        server = await asyncio.start_unix_server(hello_then_drop, path)
        try:
            fleet = Fleet([path])
            cli = make_client(SimpleNamespace(host=None, socket=path, cmd="ps"))
            return await lost(Client(path)), await lost(fleet.hosts[path].client), await lost(cli)
        finally:
            server.close()

    sdk, fleet, cli = asyncio.run(go())
    assert sdk.endswith("the next request connects again")
    assert fleet.endswith(f"the fleet connects to {path} again once it answers (Fleet.status(); event host_up); "
                          "retry then")
    assert cli.endswith("run the command again once the daemon answers")
    # dsec --host: its ssh:// client reconnects within a command, but the
    # command sends no request after the one that failed.
    over_ssh = make_client(SimpleNamespace(host="ssh://h1", socket=None, cmd="cp", fleet=None,
                                           ssh_config=None, remote_dsec=None))
    said = str(over_ssh._lost_error(ConnectionResetError("reset"), "file_put", sent=True))
    assert said.endswith("run the command again once the daemon answers"), said


def test_a_sync_client_whose_connect_fails_in_with_leaves_no_thread(tmp_path):
    """`with SyncClient(target)` that cannot connect raises, and its loop's
    thread is stopped: a script retrying a host that is down does not
    gather one thread (and event loop) per try."""
    import threading

    from dsecd import SyncClient

    before = {t.ident for t in threading.enumerate()}
    for _ in range(3):
        with pytest.raises(ConnectionError), SyncClient(str(tmp_path / "none.sock")):
            pass
    left = [t.name for t in threading.enumerate() if t.ident not in before]
    assert left == [], left


def test_a_lost_connection_names_the_idempotency_key_only_for_a_create():
    from dsecd import Client

    c = Client("/nonexistent/dsecd.sock")
    create = str(c._lost_error(ConnectionResetError("reset"), "create", sent=True))
    events = str(c._lost_error(ConnectionResetError("reset"), "events", sent=True))
    assert "idempotency key" in create and "may have been carried out" in create
    assert "idempotency key" not in events and "changes nothing, so it is safe to send again" in events
    exec_ = str(c._lost_error(ConnectionResetError("reset"), "exec", sent=True))
    assert "idempotency key" not in exec_ and "may have been carried out" in exec_
    # Whether the command runs on is what its caller must know next: it does not.
    assert "no longer runs" in exec_ and "kills the execs" in exec_ and "spawn" in exec_, exec_
    assert "carried out" not in str(c._lost_error(ConnectionResetError("reset"), "create", sent=False))


def test_a_request_whose_send_fails_says_why_the_connection_ended(tmp_path, monkeypatch):
    """The write of a request fails as the connection ends, before the
    reader has seen the end: the error is the reader's reason (over ssh,
    what ssh said), not the bare "connection lost" of the failed write."""
    from dsecd import ConnectionLost, protocol

    path = str(tmp_path / "d.sock")
    served = []

    async def daemon(reader, writer):
        served.append(writer)
        dec = protocol.FrameDecoder(1 << 20)
        while data := await reader.read(65536):
            for f in dec.feed(data):
                writer.write(protocol.encode_frame({"id": f["id"], "result": {"limits": {}}}))

    async def go():
        server = await asyncio.start_unix_server(daemon, path)
        try:
            c = Client(path)
            await c.connect()

            async def send(conn, parts):
                # The daemon goes as this request is written.
                asyncio.get_running_loop().call_soon(served[0].transport.abort)
                raise ConnectionResetError("connection lost")

            monkeypatch.setattr(c, "_send", send)
            with pytest.raises(ConnectionLost) as e:
                await c.request("proc_kill")        # one not sent again (CHANGES_NOTHING)
            await c.close()
            return str(e.value)
        finally:
            server.close()

    said = asyncio.run(go())
    assert said.startswith(f"proc_kill on {path}: connection lost: the daemon closed it"), said


async def _answer_everything(reader, writer) -> None:
    dec = protocol.FrameDecoder(1 << 20)
    while data := await reader.read(65536):
        for f in dec.feed(data):
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"limits": {}, "sandboxes": []}}))


def _loop_in_a_thread():
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


@contextlib.contextmanager
def _answering_in_a_thread(path: str):
    """A fake daemon answering every request at `path`, served by a loop in
    a thread of its own (the loop, yielded), all stopped after."""
    loop, thread = _loop_in_a_thread()
    try:
        server = asyncio.run_coroutine_threadsafe(asyncio.start_unix_server(_answer_everything, path), loop).result()
        yield loop
        server.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_a_client_used_from_another_event_loop_says_so_at_once(tmp_path):
    """Connected in one thread's loop and called from another loop (a
    scaffold's worker threads, each with its own asyncio.run): its answers
    would be handed to a loop that nobody wakes, and the request would hang
    until something else woke that loop. It fails at once instead, saying
    what to use."""
    path = str(tmp_path / "d.sock")
    with _answering_in_a_thread(path) as loop:
        c = Client(path)
        asyncio.run_coroutine_threadsafe(c.connect(), loop).result(5)

        async def elsewhere():
            return await asyncio.wait_for(c.request("list"), 5)

        t = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            asyncio.run(elsewhere())
        assert time.monotonic() - t < 2
        assert str(e.value).startswith(f"list on {path}: this Client is connected in another event loop"), e.value
        assert "SyncClient" in str(e.value)
        # Its own loop goes on using it.
        assert asyncio.run_coroutine_threadsafe(c.request("list"), loop).result(5) == {"limits": {}, "sandboxes": []}
        asyncio.run_coroutine_threadsafe(c.close(), loop).result(5)


def test_a_client_whose_event_loop_ended_says_so(tmp_path):
    """connect() in one asyncio.run, a request in the next: that first loop's
    end cancelled the connection's reader. By default the request connects
    again in the new loop; with reconnect=False it fails, saying what ended
    the connection (the client did not close it)."""
    from dsecd import ConnectionLost

    path = str(tmp_path / "d.sock")
    with _answering_in_a_thread(path) as loop:
        c = Client(path)
        asyncio.run(c.connect())

        async def list_and_close():
            try:
                return await c.request("list")
            finally:
                await c.close()

        assert asyncio.run(list_and_close()) == {"limits": {}, "sandboxes": []}
        c = Client(path, reconnect=False)
        asyncio.run(c.connect())
        with pytest.raises(ConnectionLost) as e:
            asyncio.run(c.request("list"))
        assert "the client closed it" not in str(e.value), e.value
        assert "the event loop it was connected in ended" in str(e.value), e.value

        async def again():
            await c.connect()
            return await list_and_close()

        assert asyncio.run(again()) == {"limits": {}, "sandboxes": []}
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)


def _in_a_forked_child(call) -> str:
    """What call() raises in a child forked now (multiprocessing's default
    start on Linux), or "hung" when it has not returned in 5 s."""
    import os
    import select
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                # the child: report, and never return into pytest
        try:
            try:
                call()
                said = "no error"
            except BaseException as e:          # noqa: BLE001 - anything, to the parent
                said = f"{type(e).__name__}: {e}"
            os.write(w, said.encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 5)
        return os.read(r, 65536).decode() if ready else "hung"
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_client_used_in_a_forked_child_says_so(tmp_path):
    """A scaffold makes its client, then forks workers (a multiprocessing
    Pool): a SyncClient's loop thread is not in the child, so a call there
    waited forever, and an async Client would share its socket with the
    parent. Both refuse at once, saying to make a client in the child."""
    from dsecd import SyncClient

    path = str(tmp_path / "d.sock")
    with _answering_in_a_thread(path) as loop:
        with SyncClient(path) as c:
            said = _in_a_forked_child(c.list)
            assert said.startswith(f"RuntimeError: this SyncClient of {path} was made in process "), said
            assert "make one in the child" in said, said
            # Streams (events, a sandbox's watch) wait on the same loop.
            said = _in_a_forked_child(lambda: next(iter(c.events(follow=False))))
            assert said.startswith("RuntimeError: this SyncClient"), said
            assert c.list() == []               # the parent's goes on
        c = Client(path)
        asyncio.run_coroutine_threadsafe(c.connect(), loop).result(5)
        said = _in_a_forked_child(lambda: asyncio.run(c.request("list")))
        assert said.startswith(f"RuntimeError: list on {path}: this Client was connected in process "), said
        asyncio.run_coroutine_threadsafe(c.close(), loop).result(5)


def test_a_client_whose_loop_was_closed_under_it_says_so_instead_of_hanging(tmp_path):
    """connect() run on a loop that is then closed without closing the
    Client: nothing reads its connection any more; a request from a new
    loop raises at once, and connect() there makes a new one."""
    path = str(tmp_path / "d.sock")
    with _answering_in_a_thread(path):
        c = Client(path)
        old = asyncio.new_event_loop()
        old.run_until_complete(c.connect())
        old.close()

        async def use():
            with pytest.raises(ConnectionError, match="closed without closing the Client"):
                await asyncio.wait_for(c.request("list"), 5)
            await c.connect()
            try:
                return await asyncio.wait_for(c.request("list"), 5)
            finally:
                await c.close()

        assert asyncio.run(use())["sandboxes"] == []


def test_after_a_daemon_restart_the_next_request_connects_again(tmp_path):
    """A daemon restart drops every connection while the sandboxes run on:
    the request in flight fails (it may have been carried out), the next
    one is sent on a new connection. reconnect=False keeps failing."""
    from dsecd import ConnectionLost

    path = str(tmp_path / "d.sock")
    conns = []

    async def daemon(reader, writer):
        conns.append(writer)
        if len(conns) == 1:
            return await hello_then_drop(reader, writer)
        dec = protocol.FrameDecoder(1 << 20)
        while data := await reader.read(65536):
            for f in dec.feed(data):
                result = {"limits": {}} if f["op"] == "hello" else {"time": 1.0}
                writer.write(protocol.encode_frame({"id": f["id"], "result": result}))

    async def go(reconnect):
        conns.clear()
        server = await asyncio.start_unix_server(daemon, path)
        try:
            async with Client(path, reconnect=reconnect) as c:
                with pytest.raises(ConnectionLost):
                    await c.request("proc_kill")
                try:
                    return await c.request("proc_kill"), len(conns)
                except ConnectionLost as err:
                    return str(err), len(conns)
        finally:
            server.close()

    assert asyncio.run(go(None)) == ({"time": 1.0}, 2)
    said, made = asyncio.run(go(False))
    assert made == 1 and said.endswith("call connect() again (or make the Client with reconnect=True) to go on")


def _limited_hello(slots: int) -> dict:
    """A hello's answer whose in-flight limit leaves the client `slots` for its requests."""
    from dsecd import client

    return {"limits": {"max_requests_per_client": slots + client.CONTROL_SLOTS}}


async def _requests_after_hello(reader, writer, hello: dict):
    """A stand-in daemon's side of a connection: the hello answered with
    `hello`, each request frame after it yielded."""
    dec = protocol.FrameDecoder(1 << 20)
    while data := await reader.read(65536):
        for f in dec.feed(data):
            if f["op"] == "hello":
                writer.write(protocol.encode_frame({"id": f["id"], "result": hello}))
                continue
            yield f


def _stand_in(path: str, servers: list, got: list, hello: dict, goes_after: int | None = None,
              answer=None):
    """A stand-in daemon's connection handler: it answers the hello with
    `hello`, puts each request's frame in `got`, answers it with
    `answer(frame)` if given, and after `goes_after` requests goes away as a
    restarting daemon does: its listener (servers[0]) closed and its socket
    removed first, then the connection aborted."""
    async def handle(reader, writer):
        async for f in _requests_after_hello(reader, writer, hello):
            got.append(f)
            if goes_after is not None and len(got) == goes_after:
                servers[0].close()
                os.unlink(path)
                writer.transport.abort()
                return
            if answer is not None:
                writer.write(protocol.encode_frame({"id": f["id"], "result": answer(f)}))
    return handle


def test_requests_queued_when_the_daemon_restarts_go_out_on_the_new_connection(tmp_path):
    """Requests waiting in the client for a slot never reached the daemon:
    when it restarts, they wait for it to answer again and are sent on the
    new connection; those it had been sent fail, saying they may have run."""
    from dsecd import ConnectionLost

    path = str(tmp_path / "d.sock")
    first_got: list[dict] = []
    second_got: list[dict] = []
    servers = []
    # The old daemon: two requests in flight, then it goes; the new one answers.
    first = _stand_in(path, servers, first_got, _limited_hello(2), goes_after=2)
    second = _stand_in(path, servers, second_got, _limited_hello(2), answer=lambda f: {"n": f["args"]["n"]})

    async def go():
        servers.append(await asyncio.start_unix_server(first, path))
        async with Client(path, connect_timeout=20) as c:
            async def one(n):
                try:
                    return (await c.request("proc_kill", n=n))["n"]
                except ConnectionLost as err:
                    return err
            tasks = [asyncio.create_task(one(n)) for n in range(6)]
            while len(first_got) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            server = await asyncio.start_unix_server(second, path)
            try:
                return await asyncio.gather(*tasks)
            finally:
                server.close()

    results = asyncio.run(go())
    lost = [r for r in results if isinstance(r, ConnectionLost)]
    assert sorted(f["args"]["n"] for f in first_got) == [0, 1]
    assert sorted(f["args"]["n"] for f in second_got) == [2, 3, 4, 5]
    assert results[2:] == [2, 3, 4, 5]
    assert len(lost) == 2 and all(e.sent for e in lost)
    assert all("may have been carried out" in str(e) for e in lost)


def test_a_queued_request_fails_unsent_when_the_daemon_does_not_come_back(tmp_path):
    """Waiting for the daemon is bounded by connect_timeout; then the
    request fails with sent=False, saying it did not run and why."""
    from dsecd import ConnectionLost

    path = str(tmp_path / "d.sock")
    got: list[dict] = []
    servers = []
    daemon = _stand_in(path, servers, got, _limited_hello(2), goes_after=2)

    async def go():
        servers.append(await asyncio.start_unix_server(daemon, path))
        async with Client(path, connect_timeout=0.5) as c:
            tasks = [asyncio.create_task(c.request("proc_kill", n=n)) for n in range(3)]
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(go())
    assert [f["args"]["n"] for f in got] == [0, 1] and all(isinstance(r, ConnectionLost) for r in results)
    assert results[0].sent and results[1].sent and not results[2].sent
    said = str(results[2])
    assert "did not answer again within 0.5 s" in said and "not sent, so it did not run" in said
    assert "No such file or directory" in said


def _two_requests_across_a_restart(path: str, send, answer: dict) -> tuple[list, list]:
    """A stand-in daemon at `path` that takes the two requests `send(client)`
    makes (tasks), then goes (its socket removed, the connection aborted);
    0.3 s later a new one answers every request with `answer`. Returns the
    two requests' outcomes and, per frame the daemons got, (1 or 2: the old
    or the new daemon, the frame)."""
    old_got: list[dict] = []
    new_got: list[dict] = []
    servers = []
    old = _stand_in(path, servers, old_got, {"limits": {}}, goes_after=2)
    new = _stand_in(path, servers, new_got, {"limits": {}}, answer=lambda f: answer)

    async def go():
        servers.append(await asyncio.start_unix_server(old, path))
        async with Client(path, connect_timeout=20) as c:
            tasks = send(c)
            while len(old_got) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            servers.append(await asyncio.start_unix_server(new, path))
            try:
                return await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                servers[1].close()

    return asyncio.run(go()), [(1, f) for f in old_got] + [(2, f) for f in new_got]


def test_a_request_that_changes_nothing_is_sent_again_after_a_restart(tmp_path):
    """A proc_wait (Process.wait) the daemon had when it restarted is sent
    again on the new connection: it only reads. A request that changes
    something fails, saying it may have been carried out."""
    from dsecd import ConnectionLost

    def send(c):
        return [asyncio.create_task(c.request("proc_wait", sandbox="s", pid=2)),
                asyncio.create_task(c.request("proc_kill", sandbox="s", pid=2, signal="TERM"))]

    (waited, killed), got = _two_requests_across_a_restart(str(tmp_path / "d.sock"), send, {"state": "exited"})
    ops = [(nth, f["op"]) for nth, f in got]
    assert waited == {"state": "exited"} and (2, "proc_wait") in ops and (2, "proc_kill") not in ops
    assert isinstance(killed, ConnectionLost) and killed.sent and "may have been carried out" in str(killed)


def test_a_create_with_an_idempotency_key_lost_in_a_restart_is_sent_again(tmp_path):
    """A create the old daemon had, with a key, is sent again to the new
    one, which answers with what the key made. One given no key has one
    the SDK made, sent both times: it is the same create, and its sandbox
    the caller's, not one left to nobody (nor `existing`: it is its own)."""

    def send(c):
        return [asyncio.create_task(c.create(image="busybox", key="job-7")),
                asyncio.create_task(c.create(image="busybox"))]

    (keyed, plain), got = _two_requests_across_a_restart(
        str(tmp_path / "d.sock"), send, {"id": "5b1d", "state": "running", "existing": True})
    assert keyed.id == "5b1d" and keyed.info["existing"] is True
    made = [f["args"]["key"] for nth, f in got if f["args"].get("key") != "job-7"]
    assert [nth for nth, f in got if f["args"].get("key") == "job-7"] == [1, 2]
    assert len(made) == 2 and made[0] == made[1] and made[0].startswith("sdk-"), got
    assert plain.id == "5b1d" and "existing" not in plain.info


def test_an_exec_a_spawn_a_snapshot_and_an_input_lost_in_a_restart_are_sent_again_as_they_were(tmp_path):
    """A daemon whose hello lists op.keys takes a key on a collected exec,
    a proc_start and a snapshot, and an offset on a proc_input: each goes
    with its key (the caller's for the exec, one the SDK made for the
    others), and lost after it was sent goes again with the same, answered
    by the next daemon (not `existing` to its caller: the request is its
    own). On a local socket the SDK makes no key for an exec (over ssh://
    it does: test_fleet); a daemon that does not list op.keys gets none."""
    from dsecd.client import Process, Sandbox

    path = str(tmp_path / "d.sock")
    old_got: list[dict] = []
    new_got: list[dict] = []
    servers = []
    hello = {"limits": {}, "capabilities": ["op.keys"]}
    answers = {"exec": {"exit_code": 0, "stdout": b"ran\n", "stderr": b"", "existing": True},
               "proc_start": {"pid": 9, "started": 1.0, "existing": True},
               "snapshot": {"name": "img", "manifest": "m", "existing": True},
               "proc_input": {"pid": 9, "written": 2, "skipped": 2}}
    old = _stand_in(path, servers, old_got, hello, goes_after=4)
    new = _stand_in(path, servers, new_got, hello, answer=lambda f: answers[f["op"]])

    async def go():
        servers.append(await asyncio.start_unix_server(old, path))
        async with Client(path, connect_timeout=20) as c:
            sb = Sandbox(c, "sb1", {})
            proc = Process(sb, 9, stdin_at=0)
            tasks = [asyncio.create_task(sb.exec("true", key="mine")), asyncio.create_task(sb.spawn("sleep 1")),
                     asyncio.create_task(sb.snapshot("img")), asyncio.create_task(proc.write(b"in"))]
            while len(old_got) < 4:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            servers.append(await asyncio.start_unix_server(new, path))
            try:
                return await asyncio.gather(*tasks)
            finally:
                servers[1].close()

    ran, spawned, snap, _ = asyncio.run(go())
    assert ran.stdout == b"ran\n" and spawned.pid == 9 and snap == {"name": "img", "manifest": "m"}
    sent = {f["op"]: f["args"] for f in old_got}
    again = {f["op"]: f["args"] for f in new_got}
    assert sent == again, (sent, again)
    assert sent["exec"]["key"] == "mine"
    assert all(sent[op]["key"].startswith("sdk-") for op in ("proc_start", "snapshot"))
    assert sent["proc_input"]["offset"] == 0 and "key" not in sent["proc_input"]

    for name, daemon_hello in (("local.sock", hello), ("older.sock", {"limits": {}})):
        got: list[dict] = []
        plain = _stand_in(str(tmp_path / name), [], got, daemon_hello, answer=lambda f: answers[f["op"]])

        async def exec_unkeyed(sock=str(tmp_path / name), plain=plain):
            async with await asyncio.start_unix_server(plain, sock):
                async with Client(sock) as c:
                    await Sandbox(c, "sb1", {}).exec("true")

        asyncio.run(exec_unkeyed())
        assert "key" not in got[0]["args"], (name, got)


def test_a_create_given_no_key_names_the_one_it_was_sent_with_when_the_daemon_stays_away(tmp_path):
    """Its caller never saw the key the SDK made: the error says it, so
    that a create with it finds the sandbox the lost one may have made."""
    from dsecd import ConnectionLost

    path = str(tmp_path / "d.sock")
    got: list[dict] = []
    servers = []
    daemon = _stand_in(path, servers, got, {"limits": {}}, goes_after=1)

    async def go():
        servers.append(await asyncio.start_unix_server(daemon, path))
        async with Client(path, connect_timeout=0.5) as c:
            with pytest.raises(ConnectionLost) as e:
                await c.create(image="busybox")
            return e.value

    err = asyncio.run(go())
    key = got[0]["args"]["key"]
    assert err.sent and err.op == "create" and "may have been carried out" in str(err)
    assert f"key={key!r}" in str(err) and "dsec create --key" in str(err), str(err)


def test_a_keyed_create_sent_again_says_it_may_have_run_when_the_daemon_stays_away(tmp_path):
    """The create was sent before the loss: if no daemon answers again in
    connect_timeout, its error says it may have been carried out (sent),
    not that it did not run."""
    from dsecd import ConnectionLost

    path = str(tmp_path / "d.sock")
    servers = []
    daemon = _stand_in(path, servers, [], {"limits": {}}, goes_after=1)

    async def go():
        servers.append(await asyncio.start_unix_server(daemon, path))
        async with Client(path, connect_timeout=0.5) as c:
            with pytest.raises(ConnectionLost) as e:
                await c.create(image="busybox", key="job-7")
            return e.value

    err = asyncio.run(go())
    assert err.sent and "did not answer again within 0.5 s" in str(err)
    assert "may have been carried out" in str(err) and "did not run" not in str(err)


def test_a_write_to_an_exec_that_was_never_sent_raises_instead_of_waiting(tmp_path):
    """stream.write() waits for the exec to be on the wire; an exec that
    failed before it was (its connection gone, reconnect=False) makes the
    write raise, not wait for ever."""
    from dsecd import ConnectionLost
    from dsecd.client import Sandbox

    path = str(tmp_path / "d.sock")

    async def go():
        server = await asyncio.start_unix_server(hello_then_drop, path)
        try:
            async with Client(path, reconnect=False) as c:
                with pytest.raises(ConnectionLost):
                    await c.request("proc_kill")            # the connection goes
                stream = Sandbox(c, "5b1d", {}).exec_stream(["cat"])
                writer = asyncio.create_task(stream.write(b"x"))
                with pytest.raises(ConnectionLost):
                    async for _ in stream:
                        pass
                for _ in range(10):                         # the writer's turn to wake
                    await asyncio.sleep(0)
                assert writer.done(), "write() still waits for an exec that will never be sent"
                return writer.exception()
        finally:
            server.close()

    err = asyncio.run(go())
    assert isinstance(err, ConnectionLost) and not err.sent and "was never sent, so it did not run" in str(err)


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_the_wait_for_a_restarted_daemon_has_a_timeout_of_its_own(tmp_path, sync):
    """connect_timeout bounds one connect (the socket and the daemon's hello);
    reconnect_timeout how long requests wait for a daemon that went to
    answer again (a restart), which may well be longer. Without it, that
    wait is connect_timeout, as it was."""
    from dsecd import ConnectionLost, SyncClient

    path = str(tmp_path / "d.sock")
    servers = []
    daemon = _stand_in(path, servers, [], {"limits": {}}, goes_after=1, answer=lambda f: {})

    async def serve():
        servers.append(await asyncio.start_unix_server(daemon, path))

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(serve())
        if sync:
            import threading
            thread = threading.Thread(target=loop.run_forever, daemon=True)
            thread.start()
            try:
                c = SyncClient(path, connect_timeout=20, reconnect_timeout=0.3)
                with c, pytest.raises(ConnectionLost) as e:
                    c.info()
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join()
        else:
            async def go():
                async with Client(path, connect_timeout=20, reconnect_timeout=0.3) as c:
                    assert (c.connect_timeout, c.reconnect_timeout) == (20, 0.3)
                    assert Client(path, connect_timeout=7).reconnect_timeout == 7
                    with pytest.raises(ConnectionLost) as e:
                        await c.info()
                    return e
            e = loop.run_until_complete(go())
    finally:
        loop.close()
    said = str(e.value)
    assert "did not answer again within 0.3 s (the Client's reconnect_timeout)" in said, said


@pytest.mark.parametrize("op", ["pause", "resume"])
def test_a_pause_or_resume_lost_in_a_restart_is_sent_again(tmp_path, op):
    """Both are idempotent (the daemon's pause of a paused sandbox, resume
    of a running one, does nothing): sent again, the sandbox ends as the
    caller asked, instead of a ConnectionLost saying it may have been."""
    def send(c):
        from dsecd.client import Sandbox
        sb = Sandbox(c, "sb1", {})
        return [asyncio.create_task(getattr(sb, op)()),
                asyncio.create_task(c.request("proc_kill", sandbox="sb1", pid=2, signal="TERM"))]

    (done, _killed), got = _two_requests_across_a_restart(str(tmp_path / "d.sock"), send,
                                                          {"id": "sb1", "state": "paused"})
    assert done == {"id": "sb1", "state": "paused"} and (2, op) in [(nth, f["op"]) for nth, f in got]


def test_a_request_on_a_connection_gone_silent_fails_instead_of_waiting_for_ever(tmp_path):
    """Nothing comes back, not even for the pings: a local daemon stopped
    (SIGSTOP) or wedged, whose socket never fails, as a link that stalled
    under an ssh connection shared through ControlMaster (whose keepalives
    are the master's) never ends ssh. The request waited for ever; it fails
    after the window, saying which daemon (the stand-in is this process) to
    look at and how."""
    from standin_kit import hello_then_hold

    from dsecd import ConnectionLost

    path = str(tmp_path / "d.sock")

    async def go():
        server = await asyncio.start_unix_server(hello_then_hold, path)
        async with server:
            async with Client(path, silence_timeout=0.5) as c:
                t = time.monotonic()
                with pytest.raises(ConnectionLost) as e:
                    await asyncio.wait_for(c.request("proc_kill", sandbox="s", pid=2), 10)
                return e.value, time.monotonic() - t

    err, took = asyncio.run(go())
    said = str(err)
    assert err.sent and 0.5 <= took < 3, (took, said)
    assert f"the daemon at {path} sent nothing for " in said and "with requests waiting" in said, said
    assert f"State: T in /proc/{os.getpid()}/status" in said and f"kill -CONT {os.getpid()}" in said, said
    assert "wedged" in said and "the next request connects again" in said, said


def test_a_local_socket_is_watched_for_silence_unless_turned_off(monkeypatch):
    """A local daemon's window: LOCAL_SILENCE_S, else silence_timeout, else
    DSEC_SILENCE_TIMEOUT; 0 or off: no watch. An ssh:// target keeps ssh's
    keepalives."""
    from dsecd import client as client_mod
    from dsecd.errors import BadRequest
    from dsecd.remote import SshOptions

    monkeypatch.delenv("DSEC_SILENCE_TIMEOUT", raising=False)
    pings = client_mod.LOCAL_PINGS
    assert Client("/x.sock").keepalive == (client_mod.LOCAL_SILENCE_S / pings, pings)
    assert Client("/x.sock", silence_timeout="3s").keepalive == (3 / pings, pings)
    assert Client("/x.sock", silence_timeout=0).keepalive is None
    monkeypatch.setenv("DSEC_SILENCE_TIMEOUT", "off")
    assert Client("/x.sock").keepalive is None
    assert Client("/x.sock", silence_timeout=2).keepalive == (2 / pings, pings)
    monkeypatch.setenv("DSEC_SILENCE_TIMEOUT", "1m")
    assert Client("/x.sock").keepalive == (60 / pings, pings)
    assert Client("ssh://h", ssh=SshOptions(keepalive_s=2, keepalive_count=4)).keepalive == (2, 4)
    monkeypatch.setenv("DSEC_SILENCE_TIMEOUT", "soon")
    with pytest.raises(BadRequest, match="DSEC_SILENCE_TIMEOUT"):
        Client("/x.sock")


def test_a_watch_woken_late_by_its_own_blocked_loop_asks_before_giving_up(tmp_path):
    """The client's own loop blocked (a caller's synchronous call) for
    longer than the window while a request waits on a daemon that answers
    pings: on waking, the silence it finds is its own, not the daemon's. It
    pings first, and the answer keeps the connection."""
    from standin_kit import serving

    path = str(tmp_path / "d.sock")
    held: list[int] = []

    async def answer_pings(f: dict, writer) -> bool:
        if f["op"] == "ping":
            writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
        else:
            held.append(f["id"])
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer_pings), path)
        async with server:
            c = Client(path)
            c.keepalive = (0.1, 5)            # a ping after 0.1 s of silence, given up after 0.5 s
            async with c:
                request = asyncio.create_task(c.request("proc_kill", sandbox="s", pid=2))
                while not held:
                    await asyncio.sleep(0.01)
                time.sleep(1.0)               # blocks this loop: no ping goes, none is read
                await asyncio.sleep(0.5)      # a window with the pings answered
                assert not request.done(), request
                request.cancel()
                return c.connected

    assert asyncio.run(go())


def test_a_quiet_request_whose_pings_are_answered_is_left_to_run(tmp_path):
    """An exec that prints nothing for longer than the keepalive window is
    no silence while the daemon answers the pings sent meanwhile."""
    from standin_kit import serving

    path = str(tmp_path / "d.sock")
    pings = []

    async def answer_pings_then_the_request(f: dict, writer) -> bool:
        if f["op"] == "ping":
            pings.append(f["id"])
            writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
            if len(pings) == 6:                 # past twice the window of 3 intervals
                writer.write(protocol.encode_frame({"id": held[0], "result": {"done": True}}))
        else:
            held.append(f["id"])
        return False

    held: list[int] = []

    async def go():
        server = await asyncio.start_unix_server(serving(answer_pings_then_the_request), path)
        async with server:
            c = Client(path)
            c.keepalive = (0.1, 3)
            async with c:
                return await asyncio.wait_for(c.request("proc_kill", sandbox="s", pid=2), 10)

    assert asyncio.run(go()) == {"done": True} and len(pings) == 6


def _streaming_stand_in(got: list, sessions: list[list[dict]]):
    """A stand-in daemon (hello lists op.keys.stream) that answers the n-th
    exec it gets with the frames of sessions[n] (stream payloads, or
    {"result": ...}), then drops the connection unless one was a result."""
    hello = {"limits": {}, "capabilities": ["op.keys", "op.keys.stream"]}

    async def handle(reader, writer):
        async for f in _requests_after_hello(reader, writer, hello):
            if f["op"] != "exec":
                continue
            got.append(f["args"])
            for payload in sessions[len(got) - 1]:
                frame = {"id": f["id"], **payload} if "result" in payload else {"id": f["id"], "stream": payload}
                writer.write(protocol.encode_frame(frame))
                await writer.drain()
            if not any("result" in p for p in sessions[len(got) - 1]):
                writer.transport.abort()
                return
    return handle


def test_a_keyed_streamed_exec_is_sent_again_from_what_came_while_each_loss_brought_frames(tmp_path):
    """Each loss after output came sends the exec again, with the bytes of
    stdout and stderr that came (a `lost` count among them); one after
    which nothing came fails, saying it may have run."""
    from dsecd import ConnectionLost
    from dsecd.client import Sandbox

    result = {"result": {"exit_code": 0, "signal": None, "existing": True}}
    sessions = [[{"fd": 1, "data": b"ab"}],
                [{"fd": 1, "data": b"cd"}, {"fd": 2, "data": b"e"}],
                [{"fd": 2, "lost": 3}, {"fd": 1, "data": b"f"}, result]]

    def run(sessions):
        path = str(tmp_path / f"d{len(sessions)}.sock")
        got: list[dict] = []

        async def go():
            async with await asyncio.start_unix_server(_streaming_stand_in(got, sessions), path):
                async with Client(path, connect_timeout=5) as c:
                    try:
                        return await Sandbox(c, "sb1", {}).exec("yes", on_stdout=lambda d: None, key="k"), got
                    except ConnectionLost as err:
                        return err, got
        return asyncio.run(go())

    r, got = run(sessions)
    assert [a.get("stream_from") for a in got] == [None, [2, 0], [4, 1]], got
    assert {a["key"] for a in got} == {"k"} and all(a["stream"] for a in got)
    assert (r.stdout, r.stderr, r.lost_output) == (b"abcdf", b"e", 3), r

    err, got = run([sessions[0], []])
    assert [a.get("stream_from") for a in got] == [None, [2, 0]], got
    assert isinstance(err, ConnectionLost) and err.sent, err


def test_a_keyed_streamed_exec_is_refused_with_input():
    from dsecd.client import Sandbox

    sb = Sandbox(Client("/nonexistent.sock"), "sb1", {})
    for kwargs in ({"stdin": b"x"}, {"pty": True}):
        with pytest.raises(ValueError, match="key is for an exec without stdin or pty"):
            sb.exec_stream("cat", key="k", **kwargs)


def test_a_quiet_keyed_streamed_exec_outlives_a_cut_after_each_resume(tmp_path):
    """No output came, but the daemon said it took the exec up again
    (`resumed`): a further loss sends it again too."""
    from dsecd.client import Sandbox

    result = {"result": {"exit_code": 0, "signal": None, "existing": True}}
    sessions = [[], [{"resumed": True}], [{"resumed": True}, {"fd": 1, "data": b"x"}, result]]
    path = str(tmp_path / "d.sock")
    got: list[dict] = []

    async def go():
        async with await asyncio.start_unix_server(_streaming_stand_in(got, sessions), path):
            async with Client(path, connect_timeout=5) as c:
                return await Sandbox(c, "sb1", {}).exec("sleep 9; echo x", on_stdout=lambda d: None, key="k")

    r = asyncio.run(go())
    assert [a.get("stream_from") for a in got] == [None, None, [0, 0]], got
    assert (r.stdout, r.exit_code, r.lost_output) == (b"x", 0, 0), r
