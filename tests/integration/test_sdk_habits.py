"""The SDK the way agent scaffolds use it: shell strings, output callbacks,
sandboxes scoped to a `with` block, many requests on one client, one
SyncClient shared by threads, a daemon-wide default TTL, and SyncClient's
counterparts of every Client method (images, events, run_stream, hold, abort)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

import dsecd
from dsecd.errors import NotFound


def test_a_string_command_runs_through_the_shell(client, sandbox):
    r = sandbox.exec("echo hi; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"hi\n", b"err\n")
    assert sandbox.exec(["echo", "$HOME;"]).stdout == b"$HOME;\n"      # a list is not a shell line
    call = client.call("busybox", argv="echo from a call | tr a-z A-Z")
    assert call.stdout == b"FROM A CALL\n"


def test_env_of_the_wrong_type_says_which_key(sandbox):
    with pytest.raises(TypeError, match=r"env\['A'\] must be a str, got int"):
        sandbox.exec(["true"], env={"A": 1})


@pytest.mark.parametrize("stdin, says", [("abc", "got str: encode it"), ([b"a"], "got list")])
def test_stdin_of_the_wrong_type_fails_at_once(sandbox, stdin, says):
    """Not a hang with the command left waiting for input that never comes."""
    with pytest.raises(TypeError, match=f"stdin must be bytes or an async iterator of bytes, {says}"):
        sandbox.exec(["cat"], stdin=stdin)
    assert sandbox.inspect()["execs_running"] == 0


def test_output_callbacks_get_each_chunk(daemon):
    async def go():
        async with dsecd.Client(daemon.socket) as c:
            async with c.sandbox(image="busybox", memory="64M") as sb:
                out, err = [], []

                async def on_err(chunk):
                    err.append(chunk)

                r = await sb.exec("for i in 1 2 3; do echo $i; echo e$i >&2; done", on_stdout=out.append,
                                  on_stderr=on_err)
                return r, b"".join(out), b"".join(err), sb.id

    r, out, err, sb_id = asyncio.run(go())
    assert (r.exit_code, r.stdout, r.stderr) == (0, b"1\n2\n3\n", b"e1\ne2\ne3\n")
    assert (out, err) == (r.stdout, r.stderr)
    c = daemon.client()
    try:
        assert sb_id not in {s["id"] for s in c.list()}            # the with block destroyed it
    finally:
        c.close()


def test_an_output_callback_that_raises_ends_the_exec_before_its_error_is_raised(daemon):
    """The exec's stream was left to the garbage collector: the command ran
    on after exec() raised, and a destroy without force right then was
    refused for it."""
    async def go():
        async with dsecd.Client(daemon.socket) as c:
            async with c.sandbox(image="busybox", memory="64M") as sb:
                def broken(chunk):
                    raise ValueError("the callback broke")

                with pytest.raises(ValueError, match="the callback broke"):
                    await sb.exec("echo hi; sleep 60", on_stdout=broken)
                assert (await sb.inspect())["execs_running"] == 0
                await sb.destroy()

    asyncio.run(go())


def test_sync_sandbox_context_destroys_on_exit_even_after_an_error(client):
    with pytest.raises(RuntimeError), client.sandbox(image="busybox", memory="64M") as sb:
        assert sb.exec("true").exit_code == 0
        sb_id = sb.id
        raise RuntimeError("the agent failed")
    assert sb_id not in {s["id"] for s in client.list()}
    with client.sandbox(image="busybox", memory="64M") as sb:
        sb.destroy()                        # destroyed inside: leaving the block is fine


def test_a_fleets_sandbox_block_places_it_and_destroys_it_even_after_an_error(daemon):
    """Fleet.sandbox and SyncFleet.sandbox, as Client.sandbox: a trainer
    moving from one host to a fleet keeps its `async with`."""
    async def go():
        async with dsecd.Fleet([daemon.socket]) as fleet:
            with pytest.raises(RuntimeError):
                async with fleet.sandbox(image="busybox", memory="64M") as sb:
                    assert (await sb.exec("echo hi")).stdout == b"hi\n"
                    assert sb.host == daemon.socket
                    first = sb.id
                    raise RuntimeError("the agent failed")
            return first, [r["id"] for r in await fleet.list()]

    first, left = asyncio.run(go())
    assert first not in left
    with dsecd.SyncFleet([daemon.socket]) as fleet:
        with fleet.sandbox(image="busybox", memory="64M") as sb:
            assert sb.exec("echo hi").stdout == b"hi\n"
        assert sb.id not in {r["id"] for r in fleet.list()}


def test_more_requests_than_the_daemon_takes_at_once_queue_in_the_client(daemon, sandbox):
    """300 execs on one client against limits.max_requests_per_client = 256."""
    async def go():
        async with dsecd.Client(daemon.socket) as c:
            assert c.server["limits"]["max_requests_per_client"] < 300
            sb = await c.get(sandbox.id)
            return await asyncio.gather(*(sb.exec(["echo", str(i)]) for i in range(300)))

    results = asyncio.run(go())
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(300)]


def test_requests_queue_in_the_client_while_large_answers_drain(daemon):
    """The daemon counts a request in flight until its answer has drained
    to the socket: with large reads under way, the client's next request
    may come while answers it has already read still count. It waits its
    turn instead of failing with `limit`."""
    async def go():
        async with dsecd.Client(daemon.socket) as c:
            async with c.sandbox(image="busybox", memory="1G") as sb:
                big = os.urandom(12 << 20)
                await sb.write_file("/work/big", big)
                results = await asyncio.gather(*(sb.read_file("/work/big") for _ in range(40)),
                                               *(sb.write_file(f"/work/s/{i}", b"x" * i) for i in range(600)),
                                               return_exceptions=True)
                return big, results

    big, results = asyncio.run(go())
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert results[:40] == [big] * 40 and results[40:] == list(range(600))


def test_following_requests_leave_slots_for_those_that_end_them(daemon):
    """More output followers than the client's slots: the stdin that ends
    their processes, and any short request, still go through at once."""
    async def go():
        async with dsecd.Client(daemon.socket) as c:
            cap = c.server["limits"]["max_requests_per_client"]
            boxes = [await c.create(image="busybox", memory="64M") for _ in range(cap // 50 + 1)]
            procs = await asyncio.gather(*(boxes[i % len(boxes)].spawn("read x; echo got $x") for i in range(cap)))

            async def followed(p):
                return b"".join([o.data async for o in p.output()])

            outputs = [asyncio.ensure_future(followed(p)) for p in procs]
            await asyncio.sleep(0.5)                     # every follower holds, or waits for, a slot
            await asyncio.wait_for(c.list(), 10)
            await asyncio.wait_for(asyncio.gather(*(p.write(b"1\n") for p in procs)), 60)
            try:
                return await asyncio.wait_for(asyncio.gather(*outputs), 60)
            finally:
                await asyncio.gather(*(b.destroy(force=True) for b in boxes))

    assert set(asyncio.run(go())) == {b"got 1\n"}


def test_one_sync_client_shared_by_threads(daemon, sandbox):
    c = daemon.client()
    sb = c.get(sandbox.id)
    seen: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            seen[n] = [sb.exec(["echo", f"{n}-{i}"]).stdout for i in range(20)]
        except BaseException as err:          # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        c.close()
    assert not errors
    assert seen == {n: [f"{n}-{i}\n".encode() for i in range(20)] for n in range(8)}


def test_a_default_ttl_ends_forgotten_sandboxes(daemon_factory, busybox_rootfs):
    d = daemon_factory('default_ttl = "2s"\n')        # the test config's [sandbox] table goes on
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        forgotten = c.create("busybox", memory="64M")
        kept = c.create("busybox", memory="64M", ttl="1h")
        assert forgotten.info["ttl"] == 2 and kept.info["ttl"] == 3600
        deadline = time.monotonic() + 15
        while forgotten.id in {s["id"] for s in c.list()} and time.monotonic() < deadline:
            time.sleep(0.2)
        ids = {s["id"] for s in c.list()}
        assert forgotten.id not in ids and kept.id in ids
    finally:
        c.close()


def test_a_bad_default_ttl_stops_the_daemon_at_start(daemon_factory):
    d = daemon_factory('default_ttl = "soon"\n', start=False)
    with pytest.raises(RuntimeError, match="sandbox.default_ttl must be seconds or a duration"):
        d.start(timeout=10)


def test_many_execs_with_stdin_on_one_client_all_finish(daemon, sandbox):
    """Each holds two of the daemon's per-client slots (itself and its stdin)."""
    async def go():
        async with dsecd.Client(daemon.socket) as c:
            sb = await c.get(sandbox.id)
            return await asyncio.gather(*(asyncio.wait_for(sb.exec(["cat"], stdin=f"{i}".encode()), 120)
                                          for i in range(300)))

    results = asyncio.run(go())
    assert [r.stdout for r in results] == [f"{i}".encode() for i in range(300)]


def test_a_sync_client_called_from_its_own_callback_says_so(client, sandbox):
    errors = []

    def on_stdout(chunk):
        try:
            client.list()
        except RuntimeError as err:
            errors.append(str(err))

    r = sandbox.exec("echo hi", on_stdout=on_stdout)
    assert r.exit_code == 0 and errors and "cannot be called from its own callbacks" in errors[0]


def test_write_file_keeps_owner_and_mode_both_ways(sandbox):
    sandbox.exec(["sh", "-c", "echo old > /work/owned && chown 1000:1000 /work/owned && chmod 600 /work/owned"])
    ino = sandbox.exec(["stat", "-c", "%i", "/work/owned"]).stdout
    sandbox.write_file("/work/owned", b"new\n", atomic=False)          # in place: the same inode
    st = sandbox.stat("/work/owned")
    assert (st["uid"], st["gid"], st["mode"], sandbox.read_file("/work/owned")) == (1000, 1000, 0o600, b"new\n")
    assert sandbox.exec(["stat", "-c", "%i", "/work/owned"]).stdout == ino
    sandbox.write_file("/work/owned", b"newer\n", mode=0o644)          # atomic (the default): a new inode
    st = sandbox.stat("/work/owned")
    assert (st["uid"], st["gid"], st["mode"], sandbox.read_file("/work/owned")) == (1000, 1000, 0o600, b"newer\n")
    assert sandbox.exec(["stat", "-c", "%i", "/work/owned"]).stdout != ino
    sandbox.write_file("/work/fresh", b"x", mode=0o640)                # a new file gets `mode`
    assert (sandbox.stat("/work/fresh")["uid"], sandbox.stat("/work/fresh")["mode"]) == (0, 0o640)
    assert [e["name"] for e in sandbox.list_files("/work")] == ["fresh", "owned"]     # no temporary left
    with pytest.raises(ValueError, match="absolute path of a file"):
        sandbox.write_file("relative.txt", b"x", atomic=True)


def _ids(client, labels: dict | None = None) -> set[str]:
    return {s["id"] for s in client.list(labels)}


def test_sync_client_image_methods(client, sandbox):
    sandbox.write_file("/work/snap.txt", b"snap\n")
    progress: list = []
    img = sandbox.snapshot("habits-snap", progress=progress.append)
    assert all(isinstance(p, dict) for p in progress)
    assert client.inspect_image("habits-snap")["manifest"] == img["manifest"]
    blobs = client.image_du()["blobs"]
    client.remove_image("habits-snap")
    with pytest.raises(NotFound):
        client.inspect_image("habits-snap")
    gc = client.image_gc()
    assert gc["removed"] and client.image_du()["blobs"] < blobs       # the snapshot's own blobs
    assert client.inspect_image("busybox")["name"] == "busybox"       # the others stay


def test_sync_client_events_replay_and_follow(client):
    with client.sandbox(image="busybox", memory="64M") as sb:
        sb.pause()
        sb.resume()
    kinds = [e["event"] for e in client.events(sandbox=sb.id, replay=True, follow=False)]
    assert kinds == ["created", "paused", "resumed", "destroyed"]

    events = client.events(replay=True)          # follows: ended by close() from another thread
    seen: list[dict] = []
    thread = threading.Thread(target=lambda: seen.extend(events), daemon=True)
    thread.start()
    with client.sandbox(image="busybox", memory="64M") as sb:
        deadline = time.monotonic() + 10
        while not any(e.get("sandbox") == sb.id for e in list(seen)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.is_alive()                 # still following
        events.close()
        thread.join(10)
        assert not thread.is_alive()
    assert [e["event"] for e in seen if e.get("sandbox") == sb.id] == ["created"]
    assert list(events) == []                    # closed: nothing more


def test_sync_client_run_stream(client):
    labels = {"habits": "run_stream"}
    with client.run_stream("busybox", ["sh", "-c", "echo out; echo err >&2; exit 3"], labels=labels) as run:
        assert isinstance(run.sandbox, dsecd.SyncSandbox) and _ids(client, labels) == {run.sandbox.id}
        assert run.argv == ["sh", "-c", "echo out; echo err >&2; exit 3"]
        chunks = list(run)
    assert run.result.exit_code == 3
    assert b"".join(d for fd, d in chunks if fd == 1) == b"out\n"
    assert b"".join(d for fd, d in chunks if fd == 2) == b"err\n"
    assert _ids(client, labels) == set()         # removed on the way out
    with pytest.raises(RuntimeError), client.run_stream("busybox", ["sleep", "60"], labels=labels) as run:
        raise RuntimeError("the script failed")
    assert _ids(client, labels) == set()         # an error in the block removes it too


def test_sync_client_run_detached(client):
    labels = {"habits": "run_detached"}
    proc = client.run_detached("busybox", ["sh", "-c", "read line; echo got $line"], labels=labels)
    try:
        assert isinstance(proc.sb, dsecd.SyncSandbox) and _ids(client, labels) == {proc.sb.id}
        proc.write(b"it\n")
        assert proc.wait().exit_code == 0
        assert b"".join(o.data for o in proc.output(follow=False)) == b"got it\n"
        assert _ids(client, labels) == {proc.sb.id}        # the sandbox stays after its command
    finally:
        client.destroy_all(force=True, labels=labels)


def test_sync_client_hold_renews_leases_until_cancelled(daemon, client):
    with pytest.raises(ValueError, match="give the lease"):
        client.hold(["x"], None)
    sb = client.create("busybox", memory="64M", lease=2)
    with client.hold([sb.id], lease=2) as held:
        time.sleep(4)                            # twice the lease: renewed meanwhile
        assert sb.id in _ids(client) and not held.done()
    assert held.done() and held.exception() is None
    other = daemon.client()
    kept = other.hold([sb.id], lease=2)
    other.close()                                # stops its holds
    assert kept.done()
    kept.cancel()                                # a no-op now
    deadline = time.monotonic() + 15
    while sb.id in _ids(client) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sb.id not in _ids(client)             # nobody renews it: its lease ran out


def test_sync_client_abort_and_connect_again(daemon):
    """After abort() the next request connects again (reconnect, the
    default); with reconnect=False it fails until connect() is called."""
    c = daemon.client()
    try:
        c.abort("the test's watchdog")
        assert not c.connected
        assert isinstance(c.list(), list) and c.connected
    finally:
        c.close()
    c = dsecd.SyncClient(daemon.socket, reconnect=False)
    try:
        c.connect()
        assert c.connected
        c.abort("the test's watchdog")
        assert not c.connected
        with pytest.raises(dsecd.ConnectionLost, match="the test's watchdog.*call connect\\(\\) again"):
            c.list()
        c.connect()
        assert c.connected and isinstance(c.list(), list)
    finally:
        c.close()
