"""An SDK client kept open across daemon restarts, as a trainer keeps one:
what it had sent fails saying it may have run, what it had not sent waits
for the daemon and goes out on the new connection."""

from __future__ import annotations

import asyncio
import signal

import pytest

import dsecd
from dsecd import ConnectionLost


@pytest.fixture
def restartable(daemon_factory, busybox_rootfs):
    # Few slots per connection, so that most requests queue in the client.
    d = daemon_factory("[limits]\nmax_requests_per_client = 16\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.close()
    return d


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill9"])
def test_execs_queued_in_the_client_run_after_a_daemon_restart(restartable, sig):
    d = restartable

    async def go():
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="busybox")
            # Each exec that ran writes its number to /tmp/ran first.
            async def one(n):
                try:
                    r = await sb.exec(f"echo {n} >> /tmp/ran; sleep 0.5; echo {n}")
                    return r
                except ConnectionLost as err:
                    return err

            tasks = [asyncio.create_task(one(n)) for n in range(40)]
            # Looked at over a connection of its own: on this one it would queue behind them.
            async with dsecd.Client(d.socket) as watcher:
                seen = await watcher.get(sb.id)
                while not (await seen.exec("cat /tmp/ran 2>/dev/null || true")).stdout:
                    await asyncio.sleep(0.05)
            await asyncio.to_thread(d.stop, sig)
            await asyncio.to_thread(d.start)
            results = await asyncio.gather(*tasks)
            ran = (await sb.exec("cat /tmp/ran")).stdout.split()
            return results, [int(n) for n in ran]

    results, ran = asyncio.run(go())
    lost = {n: r for n, r in enumerate(results) if isinstance(r, ConnectionLost)}
    done = {n: r for n, r in enumerate(results) if not isinstance(r, ConnectionLost)}
    # None failed unsent: those the client held went out once it was back.
    assert all(err.sent and "may have been carried out" in str(err) for err in lost.values()), lost
    assert all(r.exit_code == 0 and r.stdout == f"{n}\n".encode() for n, r in done.items())
    # Those that failed had been sent, at most the slots the daemon gives one
    # connection; nothing ran twice (nothing sent was sent again).
    assert 0 < len(lost) <= 16 and set(done) <= set(ran) and len(ran) == len(set(ran))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill9"])
def test_a_process_waited_for_across_a_daemon_restart_is_waited_for_still(restartable, sig):
    """A background process outlives the daemon; Process.wait() only reads,
    so the wait the old daemon had goes again to the new one and returns
    the process's end, not ConnectionLost."""
    d = restartable

    async def go():
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="busybox")
            proc = await sb.spawn("while [ ! -e /tmp/go ]; do sleep 0.05; done; exit 5")
            waited = asyncio.create_task(proc.wait())
            async with dsecd.Client(d.socket) as other:       # the wait is under way on c's connection
                while not any(p.pid == proc.pid for p in await (await other.get(sb.id)).processes()):
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)          # for the wait to be sent: one lost unsent goes again too
            await asyncio.to_thread(d.stop, sig)
            await asyncio.to_thread(d.start)
            async with dsecd.Client(d.socket) as other:
                await (await other.get(sb.id)).write_file("/tmp/go", b"")
            return await waited

    status = asyncio.run(go())
    assert (status.state, status.exit_code) == ("exited", 5)


@pytest.mark.parametrize("more", [True, False], ids=["next_piece", "rename"])
def test_a_write_file_cut_by_a_daemon_restart_says_so(daemon_factory, busybox_rootfs, more):
    """write_file's first piece made its temporary file on the old daemon's
    connection, which removed it; the next piece (or the rename, if there
    is no other) goes to the new daemon. Its failure is the lost
    connection, naming the caller's path, which is left as it was, not
    that the file is not found."""
    d = daemon_factory('[limits]\nmax_file_chunk_bytes = "64K"\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.close()
    restarted = asyncio.Event()

    async def source(size):
        yield b"a" * size                # the first piece, whole: it goes at once
        await restarted.wait()
        if more:
            yield b"b" * size

    async def go():
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="busybox")
            await sb.write_file("/tmp/out", b"old")
            size = sb._chunk_size()
            writing = asyncio.create_task(sb.write_file("/tmp/out", source(size)))
            async with dsecd.Client(d.socket) as other:     # the first piece is there, as a temporary file
                seen = await other.get(sb.id)
                while not any(e["name"].startswith(".dsec-") and e["size"] == size
                              for e in await seen.list_files("/tmp")):
                    await asyncio.sleep(0.05)
            await asyncio.to_thread(d.stop)
            await asyncio.to_thread(d.start)
            restarted.set()
            with pytest.raises(ConnectionLost) as e:
                await writing
            return str(e.value), await sb.read_file("/tmp/out"), [x["name"] for x in await sb.list_files("/tmp")]

    said, data, names = asyncio.run(go())
    assert "connection lost while writing" in said and ":/tmp/out" in said and "is as it was" in said, said
    assert data == b"old" and names == ["out"]


def test_a_create_the_daemon_had_when_it_died_is_sent_again(restartable):
    """Both creates are written to a daemon that is stopped, then killed:
    each goes again to the next daemon with its idempotency key, the
    caller's or the one the SDK gave the create that had none, and each
    makes one sandbox, its caller's."""
    d = restartable

    async def go():
        async with dsecd.Client(d.socket) as c:
            d.proc.send_signal(signal.SIGSTOP)       # it reads nothing more: both wait in its socket
            try:
                keyed = asyncio.create_task(c.create(image="busybox", key="trainer-7", labels={"k": "1"}))
                plain = asyncio.create_task(c.create(image="busybox", labels={"k": "1"}))
                await asyncio.sleep(0.2)
            finally:
                await asyncio.to_thread(d.stop, signal.SIGKILL)
            await asyncio.to_thread(d.start)
            made = await asyncio.gather(keyed, plain, return_exceptions=True)
            return made, await c.list(labels={"k": "1"})

    made, listed = asyncio.run(go())
    assert all(isinstance(sb, dsecd.Sandbox) for sb in made), made
    assert sorted(s["id"] for s in listed) == sorted(sb.id for sb in made)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill9"])
def test_a_followed_process_is_followed_on_across_a_daemon_restart(restartable, sig):
    """The process runs on across the restart, and so does Process.output():
    it follows it again on the next daemon, with every line once and in
    order. It had ended with ConnectionLost as if the output had."""
    d = restartable

    async def go():
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="busybox")
            proc = await sb.spawn("for i in 1 2 3; do echo $i; done; "
                                  "while [ ! -e /tmp/go ]; do sleep 0.05; done; for i in 4 5 6; do echo $i; done")
            got: list = []
            three = asyncio.Event()

            async def follow():
                async for chunk in proc.output():
                    got.append(chunk)
                    if b"3\n" in b"".join(ch.data for ch in got):
                        three.set()

            following = asyncio.create_task(follow())
            await asyncio.wait_for(three.wait(), 30)
            await asyncio.to_thread(d.stop, sig)
            await asyncio.to_thread(d.start)
            async with dsecd.Client(d.socket) as other:
                await (await other.get(sb.id)).write_file("/tmp/go", b"")
            await asyncio.wait_for(following, 60)
            return got, await proc.wait()

    got, status = asyncio.run(go())
    assert b"".join(ch.data for ch in got) == b"1\n2\n3\n4\n5\n6\n"
    # Nothing the old daemon read was left unsent; one that died says it may have been.
    notices = [ch for ch in got if ch.fd == 0]
    assert all(not ch.dropped for ch in notices)
    assert (sig == signal.SIGKILL) == any(ch.lost_before for ch in notices), notices
    assert (status.state, status.exit_code) == ("exited", 0)


def test_a_followed_process_is_followed_on_through_connections_cut_in_a_row(restartable):
    """The follow's connection cut five times in a row, each as soon as the
    client had connected again (before the daemon could answer the follow
    sent again): Process.output() goes on from its offset, as events() and
    watch() do, with every numbered line once and in order. It gave up at
    the first cut that came before the daemon's answer."""
    d = restartable

    async def go():
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="busybox")
            proc = await sb.spawn("for i in 1 2 3; do echo line $i; done; "
                                  "while [ ! -e /tmp/go ]; do sleep 0.05; done; "
                                  "for i in 4 5 6; do echo line $i; done")
            got: list = []
            three = asyncio.Event()

            async def follow():
                async for chunk in proc.output():
                    got.append(chunk)
                    if b"line 3\n" in b"".join(ch.data for ch in got):
                        three.set()

            following = asyncio.create_task(follow())
            await asyncio.wait_for(three.wait(), 30)
            for _ in range(5):
                # The follow connects again at its next attach and sends
                # its request in the same step: cut at the loop's next turn,
                # before the daemon could answer it. A follow that gave up
                # does not connect again, and its error ends the test below.
                while not c.connected and not following.done():
                    await asyncio.sleep(0)
                await c.abort("cut by the test")
            async with dsecd.Client(d.socket) as other:
                await (await other.get(sb.id)).write_file("/tmp/go", b"")
            await asyncio.wait_for(following, 60)
            status = await proc.wait()
            await sb.destroy(force=True)
            return got, status

    got, status = asyncio.run(go())
    assert b"".join(ch.data for ch in got) == b"".join(b"line %d\n" % n for n in range(1, 7)), got
    assert not [ch for ch in got if ch.fd == 0], got          # nothing dropped or lost
    assert (status.state, status.exit_code) == ("exited", 0)


def test_an_events_follower_goes_on_across_a_daemon_restart(restartable):
    """events() had ended with ConnectionLost at the restart: a trainer's
    watch for oom and died went blind. It follows the next daemon."""
    d = restartable

    async def go():
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="busybox")
            got: list[dict] = []

            async def follow():
                async for ev in c.events(sandbox=sb.id):
                    got.append(ev)
                    if ev["event"] == "resumed":
                        return

            following = asyncio.create_task(follow())
            await sb.pause()
            while not got:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(d.stop)
            await asyncio.to_thread(d.start)
            async with dsecd.Client(d.socket) as other:
                await (await other.get(sb.id)).resume()
            await asyncio.wait_for(following, 60)
            return [ev["event"] for ev in got]

    assert asyncio.run(go()) == ["paused", "resumed"]


def test_a_watch_goes_on_across_a_daemon_restart(restartable):
    """sb.watch() had ended with ConnectionLost at the restart; it watches
    the next daemon, with an overflow for what it could not see."""
    d = restartable

    async def go():
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="busybox")
            await sb.mkdir("/work")
            got: list[dict] = []

            async def follow():
                async for ev in sb.watch("/work"):
                    got.append(ev)
                    if ev["kind"] == "create" and ev["path"] == "/work/after":
                        return

            following = asyncio.create_task(follow())
            while not got:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(d.stop)
            await asyncio.to_thread(d.start)
            async with dsecd.Client(d.socket) as other:
                seen = await other.get(sb.id)
                while not any(ev["kind"] == "overflow" for ev in got) and not following.done():
                    await asyncio.sleep(0.05)
                if following.done():
                    await following             # ended: its error is the test's failure
                await seen.write_file("/work/after", b"", atomic=False)
            await asyncio.wait_for(following, 60)
            return [(ev["kind"], ev["path"]) for ev in got]

    assert asyncio.run(go()) == [("ready", "/work"), ("overflow", "/work"), ("create", "/work/after")]


def test_dsec_attach_whose_input_is_cut_by_a_restart_says_so_and_ends(restartable):
    """Its output followed on across the restart, but the stdin chunk the
    old daemon was writing failed, and the feeder ended without a word:
    what was typed after went nowhere. It ends, saying the input was cut
    and how to go on."""
    import subprocess
    import threading
    import time

    from conftest import VENV_BIN

    d = restartable
    c = d.client()
    try:
        sb = c.create(image="busybox")
        # It never reads: a chunk of input waits in the daemon for room in its pipe.
        pid = sb.spawn("echo up; sleep 600").pid
        attach = subprocess.Popen([str(VENV_BIN / "dsec"), "--socket", d.socket, "attach", sb.id, str(pid)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

        def feed():
            try:
                attach.stdin.write(b"x" * (4 << 20))
                attach.stdin.close()
            except (BrokenPipeError, ValueError):
                pass

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        # Its first line came, and its pipe is full: a chunk is in the daemon's hands.
        assert attach.stdout.readline() == b"up\n"
        while not any(p.pid == pid and p.stdin_open for p in sb.processes()):
            time.sleep(0.05)
        time.sleep(1)
        d.stop()
        d.start()
        try:
            attach.wait(timeout=60)
        except subprocess.TimeoutExpired:
            attach.kill()
            attach.wait()
            raise AssertionError("dsec attach went on with its input cut") from None
        said = attach.stderr.read().decode()
        attach.stdout.close()
        attach.stderr.close()
        assert attach.returncode == 125 and f"input to process {pid}" in said and "dsec attach" in said, said
        assert any(p.pid == pid and p.state == "running" for p in sb.processes())
    finally:
        c.close()
