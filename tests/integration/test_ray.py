"""dsecd.ray on a local Ray cluster: two Ray nodes on this machine (a head
and one more raylet, ray.cluster_utils.Cluster), each advertising the
`dsec` resource, each node's actor talking to a test daemon of its own.
Creates, execs, files, every kind of stream (as it comes) and a job's
pause and resume go through RayFleet; an actor killed with ray.kill marks
its host down with its sandboxes lost, and the host rejoins with a new
actor; a third dsec node joining later is found and used, and its host
is marked down when it leaves; a raylet removed and started again (a new
node id) takes its host down and back.

Ray is an optional extra: these tests skip without it (`pip install
dsecd[ray]`, or DSECD_SETUP_RAY=1 scripts/setup.sh). The cluster's
processes are the ones Cluster started, stopped by Cluster.shutdown (by
their pids). Ray listens on this machine's own address (Cluster given
node_ip_address 127.0.0.1 never saw its GCS come up with Ray 2.60), so
its traffic stays on this machine. Ray's files, its address file included, go to a private
RAY_TMPDIR, so another Ray on this machine is neither seen nor touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from conftest import Daemon

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'dsecd[ray]' "
                                        "(or DSECD_SETUP_RAY=1 scripts/setup.sh)")

SMALL = {"cpu": 0.1, "memory": "64M"}
DOWN_BOUND_S = 10.0        # an actor's death is seen at the next heartbeat (0.5 s here); slack for a loaded host


@pytest.fixture(scope="module")
def cluster(busybox_rootfs):
    """Two daemons with busybox, and a Ray cluster of two dsec nodes."""
    from ray.cluster_utils import Cluster

    # Two daemons for the nodes there from the start, one for a node that joins later.
    daemons = [Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-"))) for _ in range(3)]
    # Short: Ray's unix sockets live under it (108 bytes at most).
    ray_tmp = tempfile.mkdtemp(prefix="dsr-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    c = None
    try:
        for d in daemons:
            d.start()
            client = d.client()
            client.import_image(busybox_rootfs, "busybox")
            client.close()
        node_args = {"num_cpus": 1, "resources": {"dsec": 1}}
        c = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
        second = c.add_node(**node_args)
        ray.init(address=c.address, logging_level="warning", log_to_driver=False)
        ids = [c.head_node.node_id, second.node_id]
        # Nodes not named in sockets: a path no daemon serves (never the machine's default socket).
        yield {"sockets": {nid: d.socket for nid, d in zip(ids, daemons, strict=False)}, "daemons": daemons,
               "unused_socket": str(Path(ray_tmp, "no-daemon.sock")),
               "node_ids": ids, "cluster": c, "second": second, "node_args": node_args}
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        for d in daemons:
            d.cleanup()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(ray_tmp, ignore_errors=True)


async def next_event(events, want: str, timeout: float) -> dict:
    async with asyncio.timeout(timeout):
        async for ev in events:
            if ev["event"] == want:
                return ev
    raise AssertionError(f"the fleet's events ended before {want}")


def test_ray_fleet_places_execs_pauses_and_survives_a_killed_actor(cluster):
    import dsecd.ray

    async def go():
        fleet = dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["unused_socket"], heartbeat_s=0.5,
                                   down_after_s=3.0, rejoin_s=0.5)
        async with fleet:
            targets = sorted(fleet.hosts)
            assert len(targets) == 2 and all(s["up"] for s in fleet.status()), fleet.status()
            # The fleet's own placement: one job's sandboxes spread evenly over the two nodes.
            sbs = await asyncio.gather(*(fleet.create(image="busybox", labels={"job": "rj"}, **SMALL)
                                         for _ in range(4)))
            per_host = {t: sum(sb.host == t for sb in sbs) for t in targets}
            assert per_host == {t: 2 for t in targets}, per_host
            results = await asyncio.gather(*(sb.exec(["echo", sb.id]) for sb in sbs))
            assert [r.stdout for r in results] == [f"{sb.id}\n".encode() for sb in sbs]
            data = os.urandom(3 << 20)
            await sbs[0].write_file("/tmp/blob", data)
            assert await sbs[0].read_file("/tmp/blob") == data
            streamed = [chunk async for _fd, chunk in sbs[1].exec_stream(["sh", "-c", "echo a; echo b"])]
            assert b"".join(streamed) == b"a\nb\n"

            paused = await fleet.job_pause("rj")
            assert sorted(paused["paused"]) == sorted(sb.id for sb in sbs), paused
            assert {r["state"] for r in await fleet.list({"job": "rj"})} == {"paused"}
            resumed = await fleet.job_resume("rj")
            assert sorted(resumed["resumed"]) == sorted(sb.id for sb in sbs), resumed
            assert (await sbs[2].exec("true")).exit_code == 0

            # Kill one host's actor: Ray reports it dead, the fleet marks the host down.
            victim = fleet.hosts[targets[0]]
            on_victim = sorted(sb.id for sb in sbs if sb.host == victim.target)
            events = fleet.events()
            started = time.monotonic()
            ray.kill(victim.client._actor, no_restart=True)
            down = await next_event(events, "host_down", DOWN_BOUND_S)
            detect_s = time.monotonic() - started
            assert down["host"] == victim.target and sorted(down["sandboxes"]) == on_victim, down
            assert not victim.up
            # Placement avoids it meanwhile.
            extra = await fleet.create(image="busybox", **SMALL)
            assert extra.host == targets[1]
            # A new actor on the same node: the host is back with its sandboxes.
            up = await next_event(events, "host_up", 20.0)
            assert up["host"] == victim.target and sorted(up["back"]) == on_victim, up
            back_sb = next(sb for sb in sbs if sb.host == victim.target)
            assert (await back_sb.exec("true")).exit_code == 0
            await events.aclose()
            await extra.destroy(force=True)
            gone = await fleet.job_rm("rj", force=True)
            assert sorted(gone["destroyed"]) == sorted(sb.id for sb in sbs), gone
            print(f"ray: actor death seen in {detect_s:.2f} s")

    asyncio.run(go())


def test_ray_fleet_streams_as_they_come_fed_and_endless(cluster):
    """Every streamed op goes through the actor as its frames come, with
    the SDK interface of a local Client: an exec's output before it ends
    (it waits for a file the test writes after reading the first line), an
    exec fed stdin and a pty exec typed into, a background process's
    output followed, the daemon's events followed, a directory watched, a
    directory up and down as tar streams, a snapshot's progress. Leaving
    an endless stream early cancels it at the daemon (its exec is killed)."""
    import dsecd.ray

    async def go():
        async with dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["unused_socket"]) as fleet:
            sb = await fleet.create(image="busybox", **SMALL)
            try:
                async with asyncio.timeout(120):
                    await streams(sb)
            finally:
                await sb.destroy(force=True)

    async def streams(sb):
        # As it comes: the second line is written only after the first arrived here.
        script = "echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second"
        seen = []
        async for _fd, chunk in sb.exec_stream(["sh", "-c", script]):
            seen.append(chunk)
            if chunk == b"first\n":
                await sb.write_file("/tmp/go", b"")
        assert b"".join(seen) == b"first\nsecond\n"

        # Fed: stdin (more than one chunk of the actor's batches) and a pty.
        data = os.urandom(3 << 20)
        r = await sb.exec(["sh", "-c", "cat | md5sum"], stdin=data)
        assert r.exit_code == 0 and r.stdout.split()[0].decode() == hashlib.md5(data).hexdigest(), r
        stream = sb.exec_stream(["sh", "-c", "read line; echo got:$line; stty size"], pty=True, rows=30, cols=100)
        typing = asyncio.ensure_future(stream.write(b"typed\n"))     # sent once the exec is
        out = b"".join([chunk async for _fd, chunk in stream])
        await typing
        assert b"got:typed" in out and b"30 100" in out, out

        # Followed: a background process's output, the daemon's events.
        proc = await sb.spawn(["sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.1; done"], stdin=False)
        lines = b"".join([o.data async for o in proc.output(follow=True)])
        assert lines == b"line1\nline2\nline3\n", lines
        events = sb.client.events(sandbox=sb.id)
        waiter = asyncio.ensure_future(anext_kind(events, "event", "paused"))
        await asyncio.sleep(0.5)            # the events stream is open at the daemon
        await sb.pause()
        assert (await waiter)["event"] == "paused"
        await events.aclose()
        await sb.resume()

        # A directory watched.
        await sb.mkdir("/tmp/w")
        watch = sb.watch("/tmp/w")
        assert (await anext_kind(watch, "kind", "ready"))["kind"] == "ready"
        await sb.exec(["touch", "/tmp/w/new"])
        assert (await anext_kind(watch, "kind", "create"))["path"] == "/tmp/w/new"
        await watch.aclose()

        # Tar streams both ways.
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp, "src")
            (src / "sub").mkdir(parents=True)
            blob = os.urandom(2 << 20)
            (src / "sub" / "blob").write_bytes(blob)
            (src / "note").write_text("hi")
            put = await sb.upload_dir(str(src), "/tmp/up")
            assert put["count"] >= 4, put
            got = await sb.download_dir("/tmp/up", str(Path(tmp, "back")))
            assert Path(tmp, "back", "sub", "blob").read_bytes() == blob, got
            assert Path(tmp, "back", "note").read_text() == "hi"

        # A snapshot's progress frames reach the callback before its result.
        progress = []
        snap = await sb.snapshot("ray-snap", progress=progress.append)
        assert snap["name"] == "ray-snap" and progress, (snap, progress)
        await sb.client.remove_image("ray-snap")

        # Left early: the exec is cancelled at the daemon, its process killed.
        async for _fd, chunk in sb.exec_stream(["sh", "-c", "echo started; exec sleep 1000"]):
            assert chunk == b"started\n"
            break
        await _sleep_gone(sb)

    asyncio.run(go())


async def anext_kind(stream, field: str, want: str) -> dict:
    """The first item of `stream` whose `field` is `want` (others skipped)."""
    async for item in stream:
        if item.get(field) == want:
            return item
    raise AssertionError(f"the stream ended before an item with {field}={want}")


def test_ray_fleet_takes_a_late_node_and_loses_it(cluster):
    """A dsec node that joins the cluster after the RayFleet was made is
    found by its discovery (host_added, host_up) and placement uses it; when
    the node leaves (its raylet stopped, by pid), the host is marked down
    with its sandboxes reported lost."""
    import dsecd.ray

    async def go():
        late_daemon = cluster["daemons"][2]
        fleet = dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=late_daemon.socket, discover_s=0.5,
                                   heartbeat_s=0.5, down_after_s=3.0, rejoin_s=0.5)
        async with fleet:
            assert len(fleet.hosts) == 2, fleet.status()
            events = fleet.events()
            # In this thread: Ray sets signal handlers there. The loop waits the seconds it takes.
            late = cluster["cluster"].add_node(**cluster["node_args"])
            try:
                added = await next_event(events, "host_added", 60.0)
                assert added["host"].endswith(late_daemon.socket), added
                up = await next_event(events, "host_up", 60.0)
                assert up["host"] == added["host"], up
                # One job over three hosts: one sandbox each, the late one's included.
                sbs = await asyncio.gather(*(fleet.create(image="busybox", labels={"job": "late"}, **SMALL)
                                             for _ in range(3)))
                assert sorted(sb.host for sb in sbs) == sorted(fleet.hosts), [sb.host for sb in sbs]
                on_late = next(sb for sb in sbs if sb.host == added["host"])
                assert (await on_late.exec(["echo", "late"])).stdout == b"late\n"
            finally:
                await asyncio.to_thread(cluster["cluster"].remove_node, late)
            down = await next_event(events, "host_down", 60.0)
            assert down["host"] == added["host"] and down["sandboxes"] == [on_late.id], down
            lost = await next_event(events, "sandbox_lost", 10.0)
            assert lost["sandbox"] == on_late.id
            await events.aclose()
            await fleet.job_rm("late", force=True)
        with late_daemon.client() as c:             # the daemon outlived its node: clean up there
            c.destroy_all(force=True)

    asyncio.run(go())


def test_ray_fleet_host_of_a_restarted_raylet_rejoins(cluster):
    """The second node's raylet goes (Cluster.remove_node: its processes,
    by pid) and a new one starts: Ray gives it a new node id. The host (the
    daemon's socket on this machine) rejoins through an actor on whichever
    dsec node at this machine's address Ray has alive first (the head here,
    or the new raylet), its sandbox still running."""
    import dsecd.ray

    async def go():
        # The new raylet is not named in sockets: its daemon is the second one's.
        fleet = dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["daemons"][1].socket,
                                   heartbeat_s=0.5, down_after_s=3.0, rejoin_s=0.5)
        async with fleet:
            second = cluster["daemons"][1].socket
            host = next(h for h in fleet.hosts.values() if h.target.endswith(second))
            sb = await fleet.create(image="busybox", labels={"job": "rn"}, **SMALL)
            while sb.host != host.target:           # one on the second node's daemon
                sb = await fleet.create(image="busybox", labels={"job": "rn"}, **SMALL)
            events = fleet.events()
            old_node = host.client.node_id
            await asyncio.to_thread(cluster["cluster"].remove_node, cluster["second"])
            down = await next_event(events, "host_down", 60.0)
            assert down["host"] == host.target and sb.id in down["sandboxes"], down
            # In this thread: Ray sets signal handlers there. The loop waits the seconds it takes.
            cluster["second"] = cluster["cluster"].add_node(**cluster["node_args"])
            up = await next_event(events, "host_up", 60.0)
            assert up["host"] == host.target and sb.id in up["back"], up
            assert host.client.node_id != old_node
            assert (await sb.exec(["echo", "back"])).stdout == b"back\n"
            await events.aclose()
            await fleet.job_rm("rn", force=True)

    asyncio.run(go())


def test_ray_fleet_caller_cancels_undo_at_the_daemon(cluster):
    """A create or an exec the driver cancels (a task cancelled, a timeout)
    is cancelled at the daemon too, as on a local Client: a create leaves no
    sandbox (one the daemon made before the cancel landed is destroyed), and
    an exec's process is killed."""
    import dsecd.ray

    def live(daemon) -> list[str]:
        with daemon.client() as c:
            return [r["id"] for r in c.list({"job": "cx"}) if r["state"] != "dead"]

    async def go():
        async with dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["unused_socket"]) as fleet:
            kept = []
            # Cancelled before the actor runs it, while it runs, and after
            # it ended with its answer on the way to the driver.
            for delay in [i * 0.004 for i in range(25)]:
                task = asyncio.ensure_future(fleet.create(image="busybox", labels={"job": "cx"}, **SMALL))
                await asyncio.sleep(delay)
                task.cancel()
                try:
                    kept.append((await task).id)        # it was done before the cancel: the caller holds it
                except asyncio.CancelledError:
                    pass
            daemons = cluster["daemons"][:2]
            for _ in range(150):
                left = sorted(sb for d in daemons for sb in live(d))
                if left == sorted(kept):
                    break
                await asyncio.sleep(0.1)
            assert left == sorted(kept), (left, kept)

            sb = await fleet.create(image="busybox", **SMALL)
            task = asyncio.ensure_future(sb.exec(["sh", "-c", "exec sleep 1000"]))
            for _ in range(100):
                if b"sleep 1000" in (await sb.exec(["ps", "-o", "args"])).stdout:
                    break
                await asyncio.sleep(0.1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await _sleep_gone(sb)
            if kept:
                await fleet.job_rm("cx", force=True)
            await sb.destroy(force=True)

    asyncio.run(go())


def test_ray_cancelled_create_leaves_its_sandbox_to_a_retry_of_its_key(cluster, monkeypatch):
    """A create with a key cancelled while its actor call runs, and sent
    again with the key (the caller's retry after a timeout): the daemon
    answers the retry with the sandbox the first one makes, so the undo of
    the first must leave it to the retry, not destroy it under the caller.
    The caller's wait for the undo is 0 here, as for a create slower than
    ABANDONED_CREATE_WAIT_S (one queued for admission)."""
    import dsecd.ray

    monkeypatch.setattr(dsecd.ray, "ABANDONED_CREATE_WAIT_S", 0.0)

    async def go():
        async with dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["unused_socket"]) as fleet:
            client = next(h.client for h in fleet.hosts.values() if h.up)
            got = []
            for i in range(4):
                args = {"key": f"retry-{i}", "labels": {"job": "rk"}, **SMALL}
                first = asyncio.ensure_future(client.create("busybox", **args))
                await asyncio.sleep(0)          # its actor call is on its way
                first.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await first
                got.append((await client.create("busybox", **args)).id)
            while client._undoing:
                await asyncio.wait(set(client._undoing))
            live = sorted(r["id"] for r in await client.list({"job": "rk"}) if r["state"] != "dead")
            if live:
                await fleet.job_rm("rk", force=True)
            return sorted(got), live

    got, live = asyncio.run(go())
    assert live == got, f"the retries' sandboxes {got}, of which these are left: {live}"


def test_ray_request_the_actor_cannot_send_is_the_callers_error_not_the_hosts(cluster):
    """A request whose arguments the actor's Client cannot encode (a raw
    request given an object msgpack has no form for) raises that error to
    the caller, as a local Client does; it took the host down (host_down,
    every sandbox reported lost, the actor killed under the other callers),
    and as a stream it waited forever for a frame."""
    import dsecd.ray

    async def go():
        async with dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["unused_socket"],
                                      heartbeat_s=0.5) as fleet:
            sb = await fleet.create(image="busybox", **SMALL)
            events = fleet.events()
            with pytest.raises(TypeError, match="serialize"):
                await sb.client.request("ping", x=object())
            with pytest.raises(TypeError, match="serialize"):
                async with asyncio.timeout(30):
                    async for _ in sb.client.frames("exec", sandbox=sb.id, argv=["true"], x=object()):
                        pass
            assert (await sb.exec(["echo", "still"])).stdout == b"still\n"
            await asyncio.sleep(1.5)            # three heartbeats
            seen = []
            while not events._queue.empty():
                ev = events._queue.get_nowait()
                if ev["host"] == sb.host:
                    seen.append(ev["event"])
            await events.aclose()
            up = fleet.hosts[sb.host].up
            await sb.destroy(force=True)
            return seen, up

    seen, up = asyncio.run(go())
    assert "host_down" not in seen and up, seen


def test_ray_requests_after_the_fleet_closed_say_so(cluster):
    """A sandbox's request in flight when its RayFleet closes, and one made
    after, fail saying the fleet was closed, not that it connects to the
    host again once it answers: nothing would."""
    import dsecd
    import dsecd.ray

    async def go():
        fleet = dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["unused_socket"])
        await fleet.start()
        sb = await fleet.create(image="busybox", **SMALL)
        try:
            running = asyncio.ensure_future(sb.exec(["sleep", "30"]))
            await asyncio.sleep(0.5)
        finally:
            await fleet.close()
        errors = []
        with pytest.raises(dsecd.ConnectionLost) as lost:
            await running
        errors.append(str(lost.value))
        with pytest.raises(dsecd.ConnectionLost) as lost:
            await sb.exec("true")
        errors.append(str(lost.value))
        for d in cluster["daemons"][:2]:
            with d.client() as c, contextlib.suppress(dsecd.NotFound):
                c.request("destroy", sandbox=sb.id, force=True)
        return errors

    for text in asyncio.run(go()):
        assert "RayFleet.close" in text and "again once it answers" not in text, text


def test_ray_fleet_host_whose_daemon_is_killed_says_so_and_rejoins(cluster):
    """A host's daemon killed (SIGKILL) under an exec: the exec fails with
    ConnectionLost saying what happened there and what to do (the fleet
    reconnects; it says so once, and not the actor's own client's advice),
    the host goes down with its sandbox lost, and once the daemon is
    started again the host rejoins with the sandbox, which runs execs."""
    import dsecd.ray

    async def go():
        victim = cluster["daemons"][0]
        fleet = dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["unused_socket"], heartbeat_s=0.5,
                                   rejoin_s=0.5)
        async with fleet:
            host = next(h for h in fleet.hosts.values() if h.target.endswith(victim.socket))
            sb = await fleet.create(image="busybox", labels={"job": "dk"}, **SMALL)
            while sb.host != host.target:
                sb = await fleet.create(image="busybox", labels={"job": "dk"}, **SMALL)
            events = fleet.events()
            running = asyncio.ensure_future(sb.exec(["sleep", "60"]))
            await asyncio.sleep(0.5)
            victim.proc.kill()
            victim.proc.wait()
            with pytest.raises(dsecd.ConnectionLost) as lost:
                await running
            text = str(lost.value)
            assert text.startswith(f"exec on {host.target}: ") and "the daemon closed it" in text, text
            assert text.count("may have been carried out") == 1, text
            assert "next request connects again" not in text and "the fleet connects to" in text, text
            down = await next_event(events, "host_down", DOWN_BOUND_S)
            assert down["host"] == host.target and sb.id in down["sandboxes"], down
            with pytest.raises(dsecd.ConnectionLost) as refused:
                await sb.exec("true")
            assert "the fleet connects to" in str(refused.value), refused.value
            victim.start()
            up = await next_event(events, "host_up", 60.0)
            assert up["host"] == host.target and sb.id in up["back"], up
            assert (await sb.exec(["echo", "back"])).stdout == b"back\n"
            await events.aclose()
            await fleet.job_rm("dk", force=True)

    asyncio.run(go())


def test_ray_fleet_paths_are_the_hosts_own(cluster):
    """A path the daemon reads on its host (an image's root file system)
    must be absolute through the actor, as over ssh://: a relative one is
    refused on the driver, not made absolute against the driver's cwd,
    which names nothing on another machine."""
    import dsecd.ray

    async def go():
        async with dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["unused_socket"]) as fleet:
            found = await fleet.each_host(lambda c: c.build_image("rootfs", "relative"))
            assert found and all(isinstance(r, ValueError) and "must be an absolute path on that host" in str(r)
                                 for r in found.values()), found

    asyncio.run(go())


def test_ray_fleet_says_how_to_name_a_daemon_it_cannot_reach(cluster):
    """No daemon on the socket a node's host names: the host is down, and
    its reason says what to change in RayFleet (not dsec's own --socket)."""
    import dsecd.ray

    async def go():
        async with dsecd.ray.RayFleet(socket=cluster["unused_socket"], rejoin_s=60) as fleet:
            return fleet.status()

    status = asyncio.run(go())
    assert status and not any(s["up"] for s in status), status
    for s in status:
        assert f"no daemon at {cluster['unused_socket']}" in s["reason"], s["reason"]
        assert "RayFleet(socket=" in s["reason"] and "--socket" not in s["reason"], s["reason"]


def test_ray_fleet_says_a_stuck_daemon_is_stuck_not_the_node(cluster):
    """A daemon that takes the connection but does not answer (stopped):
    its host's reason names the daemon, not the actor's node, which is up.
    The driver gave up on the hello first and asked whether the node was
    alive (ray status), which sent the user to the wrong machine part."""
    import dsecd.ray

    stuck = cluster["daemons"][0]

    async def go():
        async with dsecd.ray.RayFleet(sockets=cluster["sockets"], socket=cluster["unused_socket"],
                                      connect_timeout=2, rejoin_s=60) as fleet:
            return fleet.hosts[next(t for t in fleet.hosts if t.endswith(stuck.socket))].reason

    os.kill(stuck.proc.pid, signal.SIGSTOP)
    try:
        reason = asyncio.run(go())
    finally:
        os.kill(stuck.proc.pid, signal.SIGCONT)
    assert "is the daemon stuck" in reason and "ray status" not in reason, reason


def test_an_input_naming_no_stream_leaves_nothing_in_the_actor(daemon, monkeypatch):
    """The actor's table of the driver's streams keeps no entry for an
    exec_input whose exec never came (a wrong id): it answers bad_request
    after NAMED_WAIT_S, and forgets the id."""
    import dsecd.ray as dray

    monkeypatch.setattr(dray, "NAMED_WAIT_S", 0.2)

    async def go():
        actor = dray.DaemonActor(daemon.socket, "t")
        try:
            answer = await actor.request("exec_input", {"exec_id": 424242, "data": b"x"})
            return answer, dict(actor.streams)
        finally:
            await actor.client.close()

    answer, streams = asyncio.run(go())
    assert answer["error"]["code"] == "bad_request" and "424242" in answer["error"]["message"], answer
    assert streams == {}


def test_an_input_that_gave_up_leaves_the_others_waiting_on_the_stream(daemon, monkeypatch):
    """Two inputs wait for the same exec; the first gives up: the second
    still gets through once the exec's stream is sent."""
    import dsecd.ray as dray

    monkeypatch.setattr(dray, "NAMED_WAIT_S", 0.3)

    async def go():
        actor = dray.DaemonActor(daemon.socket, "t")
        try:
            first = asyncio.ensure_future(actor.request("exec_signal", {"exec_id": 77, "signal": "TERM"}))
            await asyncio.sleep(0.2)
            second = asyncio.ensure_future(actor.request("exec_signal", {"exec_id": 77, "signal": "TERM"}))
            gave_up = await first
            actor._ended(77, actor._stream(77))     # the exec's stream reaches the daemon, and ends
            return gave_up, await second
        finally:
            await actor.client.close()

    gave_up, second = asyncio.run(go())
    assert gave_up["error"]["code"] == "bad_request", gave_up
    # Sent through: the daemon's own answer for an exec no longer running, not the actor's timeout.
    assert "did not reach the daemon" not in str(second), second


def test_an_input_that_gave_up_before_its_stream_was_sent_leaves_the_stream_its_entry(daemon, monkeypatch):
    """The exec's stream has begun on the actor but is not on the daemon's
    connection yet (a reconnect, say) when an input gives up: the entry
    stays, so the next input reaches the exec. One cancelled while it
    waits for a stream that never comes leaves nothing."""
    import dsecd.ray as dray

    monkeypatch.setattr(dray, "NAMED_WAIT_S", 0.2)

    async def slow_pump(self, stream, op, args, queue):
        await asyncio.sleep(0.5)            # not on the daemon's connection for a while
        stream.sent.set()
        await queue.put({"__result__": {"exit_code": 0}})

    monkeypatch.setattr(dray.DaemonActor, "_pump", slow_pump)

    async def go():
        actor = dray.DaemonActor(daemon.socket, "t")
        try:
            frames = actor.stream(5, "exec", {})
            first_batch = asyncio.ensure_future(frames.__anext__())
            await asyncio.sleep(0.05)
            entry = actor.streams[5]
            gave_up = await actor.request("exec_signal", {"exec_id": 5, "signal": "TERM"})
            kept = actor.streams.get(5) is entry
            await first_batch
            await frames.aclose()
            waiting = asyncio.ensure_future(actor.request("exec_input", {"exec_id": 99, "data": b"x"}))
            await asyncio.sleep(0.05)
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            return gave_up, kept, 99 in actor.streams
        finally:
            await actor.client.close()

    gave_up, kept, left = asyncio.run(go())
    assert gave_up["error"]["code"] == "bad_request", gave_up
    assert kept, "the input that gave up took the entry its running stream uses"
    assert not left, "a cancelled input left its entry for the actor's life"


async def _sleep_gone(sb) -> None:
    """The `sleep 1000` of a cancelled exec is gone from the sandbox (10 s at most)."""
    for _ in range(100):
        ps = await sb.exec(["ps", "-o", "args"])
        if b"sleep 1000" not in ps.stdout:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"sleep 1000 still runs: {ps.stdout}")

