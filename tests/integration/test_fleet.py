"""dsecd beyond one host, on a simulated fleet (fleet_kit.SimFleet): each
host a network namespace with its own sshd and dsecd, reached the way a
real one is, through `ssh host dsec rpc --stdio`.

The SDK over ssh:// (requests and streams multiplexed on one connection, a
dropped connection failing what is in flight and reconnecting), and `dsec
--host`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from fleet_kit import SimFleet, kill_tree, sshd_skip_reason

import dsecd
from dsecd import ConnectionLost, protocol

pytestmark = pytest.mark.skipif(sshd_skip_reason() is not None, reason=sshd_skip_reason() or "")

SMALL = {"cpu": 0.1, "memory": "64M"}
DSEC = [sys.executable, "-m", "dsecd.cli"]


@pytest.fixture(scope="module")
def sim(busybox_rootfs):
    f = SimFleet(3, busybox_rootfs)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def fleet_env(sim):
    """The fleet, every host up and empty, before and after the test."""
    for host in sim.hosts:
        host.heal()
        host.start()
    sim.clear()
    yield sim
    for host in sim.hosts:
        host.heal()
        host.start()
    sim.clear()


def all_rows(sim: SimFleet) -> list[dict]:
    """Every sandbox of every running daemon, asked through its local socket."""
    rows = []
    for host in sim.hosts:
        c = host.daemon.client()
        try:
            rows += [{**r, "host": host.target} for r in c.list()]
        finally:
            c.close()
    return rows


# ---------------------------------------------------------------- one remote host


def test_client_over_ssh_multiplexes_requests_streams_and_files(fleet_env):
    async def go():
        async with dsecd.Client("ssh://h1", ssh=fleet_env.ssh) as c:
            assert c.remote and c.server["server"] == "dsecd"
            sb = await c.create(image="busybox", **SMALL)
            assert sb.host == "ssh://h1"
            # Many requests at once on the one connection, a stream among them.
            stream = sb.exec_stream(["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.1; done"])
            chunks = []

            async def read_stream():
                async for _fd, data in stream:
                    chunks.append(data)

            results = await asyncio.gather(read_stream(), *(sb.exec(["echo", str(i)]) for i in range(20)))
            assert [r.stdout for r in results[1:]] == [f"{i}\n".encode() for i in range(20)]
            assert b"".join(chunks) == b"1\n2\n3\n" and stream.result.exit_code == 0
            data = os.urandom(9 << 20)                  # three chunks: tails and pipelining over ssh
            await sb.write_file("/tmp/blob", data)
            assert await sb.read_file("/tmp/blob") == data
            r = await sb.exec("cat > /tmp/in; wc -c < /tmp/in", stdin=b"x" * 100000)
            assert r.stdout.strip() == b"100000"
            await sb.destroy()

    asyncio.run(go())
    with dsecd.SyncClient("ssh://h2", ssh=fleet_env.ssh) as c:
        sb = c.create(image="busybox", **SMALL)
        assert c.info()["sandboxes"] == {"running": 1} and sb.host == "ssh://h2"
        assert sb.exec(["hostname"]).stdout.startswith(b"sb-")
        sb.destroy()


def test_rpc_stdio_over_ssh_answers_what_was_sent_before_stdin_closed(fleet_env):
    """ssh's stdin ends right after a pipelined exec and destroy: both are
    answered (nothing cancelled), then the session ends."""
    c = fleet_env.hosts[0].daemon.client()
    try:
        keep, gone = c.create(image="busybox", **SMALL), c.create(image="busybox", **SMALL)
        frames = b"".join(protocol.encode_frame(f) for f in [
            {"id": 1, "op": "hello", "args": {"protocol": 1}},
            {"id": 2, "op": "exec", "args": {"sandbox": keep.id, "argv": ["sh", "-c", "sleep 1; echo done"],
                                             "stream": False}},
            {"id": 3, "op": "destroy", "args": {"sandbox": gone.id, "force": True}}])
        argv = fleet_env.ssh.argv(dsecd.remote.SshTarget("h1"))
        r = subprocess.run(argv, input=frames, capture_output=True, timeout=60)
        out = {f["id"]: f for f in protocol.FrameDecoder(1 << 24).feed(r.stdout)}
        assert r.returncode == 0, r.stderr
        assert out[2]["result"]["stdout"] == b"done\n" and out[3]["result"]["id"] == gone.id
        assert [s["id"] for s in c.list()] == [keep.id]
    finally:
        c.close()


def test_a_dropped_connection_fails_in_flight_requests_and_the_next_one_reconnects(fleet_env):
    host = fleet_env.hosts[0]

    async def go():
        async with dsecd.Client("ssh://h1", ssh=fleet_env.ssh) as c:
            sb = await c.create(image="busybox", key="kept-1", **SMALL)
            running = asyncio.ensure_future(sb.exec(["sleep", "60"]))
            await asyncio.sleep(0.5)
            # The network path dies: sshd and its sessions are killed (the daemon lives).
            await asyncio.to_thread(kill_tree, host.sshd)
            with pytest.raises(ConnectionLost) as e:
                await asyncio.wait_for(running, 10)
            assert e.value.sent and e.value.op == "exec" and "connects again" in str(e.value)
            await asyncio.to_thread(host.start_sshd)
            again = await c.create(image="busybox", key="kept-1", **SMALL)      # retried safely
            assert again.id == sb.id and again.info.get("existing") is True
            for _ in range(100):        # the daemon saw its client go: the exec is killed
                if (await sb.inspect())["execs_running"] == 0:
                    break
                await asyncio.sleep(0.1)
            assert sb.info["execs_running"] == 0

    asyncio.run(go())


def test_dsec_with_host_runs_the_commands_over_ssh(fleet_env, tmp_path):
    env = fleet_env.env()

    def dsec(*args, input=None, host="ssh://h2", code=0):
        r = subprocess.run([*DSEC, "--host", host, *args], input=input, capture_output=True, env=env,
                           timeout=120, cwd=tmp_path)
        assert r.returncode == code, (args, r.stderr.decode())
        return r.stdout.decode()

    sb = dsec("create", "--image", "busybox", "--cpu", "0.1", "--memory", "64M", "--label", "job=cli").strip()
    assert dsec("exec", sb, "--", "sh", "-c", "echo out; exit 3", code=3) == "out\n"
    assert dsec("exec", "-i", sb, "--", "cat", input=b"piped\n") == "piped\n"
    (tmp_path / "a.txt").write_text("hello\n")
    dsec("cp", "a.txt", f"{sb}:/tmp/a.txt")
    assert dsec("cat", f"{sb}:/tmp/a.txt") == "hello\n"
    dsec("cp", f"{sb}:/tmp/a.txt", "back.txt")
    assert (tmp_path / "back.txt").read_text() == "hello\n"
    assert "a.txt" in dsec("ls", f"{sb}:/tmp")
    assert sb in dsec("ps") and "busybox" in dsec("image", "ls")
    dsec("pause", sb)
    dsec("resume", sb)
    assert "kernel" in dsec("info")
    # DSEC_HOST does what --host does; a relative image path cannot name a file over there.
    r = subprocess.run([*DSEC, "ps"], capture_output=True, env={**env, "DSEC_HOST": "ssh://h2"}, timeout=60)
    assert r.returncode == 0 and sb in r.stdout.decode()
    r = subprocess.run([*DSEC, "--host", "ssh://h2", "image", "build", "rel/dir", "--name", "x"],
                       capture_output=True, env=env, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and b"absolute path on that host" in r.stderr
    dsec("rm", "--force", sb)
    assert sb not in dsec("ps")
    # A host that cannot be reached says why and what to check.
    r = subprocess.run([*DSEC, "--host", "ssh://nosuchhost", "ps"], capture_output=True, env=env, timeout=60)
    assert r.returncode == 1 and b"ssh to ssh://nosuchhost failed" in r.stderr, r.stderr
