"""Background processes (dsecd/engine/procs.py): spawn, list, logs (kept,
followed, --since, ring overflow), stdin, kill, wait, eviction, the end with
the sandbox, no leaked daemon fds; through the SDK (async and sync), the
protocol and the CLI. The tests that mean the same for both run on a
container and on a microVM (the module's one shared VM; its guest agent
keeps the processes: dsecd/engine/vmprocs.py). The restart cases are in
test_procs_restart.py, a VM's pause and restarts in test_procs_vm.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import threading
import time

import pytest
from conftest import VENV_BIN, sandbox_on, shared_vm

from dsecd import Client
from dsecd.errors import BadRequest, Conflict, LimitExceeded, NotFound

# Its VMs start from the run's templates (conftest.VM_TEMPLATES): none of its tests is about how one is built.
pytestmark = pytest.mark.shared_vm_templates

BACKENDS = ["container", "microvm"]


@pytest.fixture(scope="module")
def vm(daemon):
    yield from shared_vm(daemon)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def any_sandbox(request, backend, client):
    """A new container, or the module's VM with its processes of earlier tests killed."""
    yield from sandbox_on(backend, request, client, "true")
    if backend == "microvm":
        sb = request.getfixturevalue("vm")
        for p in sb.processes():
            if p.state == "running":
                with contextlib.suppress(Conflict):     # it ended meanwhile
                    sb.process(p.pid).kill()


def collect(proc, follow: bool = True, since: float | None = None) -> tuple[bytes, bytes, int]:
    """(stdout, stderr, bytes said dropped) of a SyncProcess's output."""
    out = {1: [], 2: []}
    dropped = 0
    for chunk in proc.output(follow=follow, since=since):
        if chunk.dropped:
            dropped += chunk.dropped
        else:
            out[chunk.fd].append(chunk.data)
    return b"".join(out[1]), b"".join(out[2]), dropped


def test_spawn_returns_at_once_and_wait_gives_the_exit_code(any_sandbox):
    sandbox = any_sandbox
    proc = sandbox.spawn("read l; echo out; echo err >&2; exit 3")
    assert proc.pid > 1
    assert proc.status().state == "running"      # the answer came before its end: it waits for input
    proc.write(b"go\n")
    st = proc.wait()
    assert (st.state, st.exit_code, st.signal) == ("exited", 3, None)
    out, err, dropped = collect(proc)
    assert (out, err, dropped) == (b"out\n", b"err\n", 0)


def test_list_shows_running_and_exited(any_sandbox):
    sandbox = any_sandbox
    before = sandbox.inspect()["procs_running"]
    a = sandbox.spawn(["sleep", "30"])
    b = sandbox.spawn(["sh", "-c", "echo hello"])
    b.wait()
    by_pid = {p.pid: p for p in sandbox.processes()}
    assert by_pid[a.pid].state == "running" and by_pid[a.pid].argv == ["sleep", "30"]
    assert by_pid[b.pid].state == "exited" and by_pid[b.pid].exit_code == 0
    assert by_pid[b.pid].output_bytes == 6 and by_pid[b.pid].dropped == 0
    assert sandbox.inspect()["procs_running"] == before + 1           # `dsec ps`'s PROCS
    a.kill()
    assert a.wait().signal == signal.SIGKILL
    assert sandbox.inspect()["procs_running"] == before


def test_follow_sees_lines_as_they_come(any_sandbox):
    sandbox = any_sandbox
    proc = sandbox.spawn("for i in 1 2 3 4 5; do echo line $i; sleep 0.2; done")
    seen = []
    for chunk in proc.output(follow=True):
        seen.append((time.monotonic(), chunk.data))
    text = b"".join(d for _, d in seen)
    assert text == b"".join(b"line %d\n" % i for i in range(1, 6))
    # followed, not collected at the end: the chunks came spread over the run
    assert seen[-1][0] - seen[0][0] > 0.5


def test_logs_without_follow_end_at_once(any_sandbox):
    sandbox = any_sandbox
    proc = sandbox.spawn("echo early; sleep 30")
    deadline = time.monotonic() + 5
    while sandbox.processes()[-1].output_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    out, _, _ = collect(proc, follow=False)
    assert out == b"early\n" and time.monotonic() - t0 < 1
    proc.kill("TERM")
    assert proc.wait().signal == signal.SIGTERM


def test_since_filters_by_time(any_sandbox):
    sandbox = any_sandbox
    proc = sandbox.spawn("echo before; sleep 0.6; echo after")
    proc.wait()
    chunks = list(proc.output(follow=False))
    times = {c.data: c.time for c in chunks if c.data}
    assert set(times) == {b"before\n", b"after\n"}
    cut = times[b"before\n"] + 0.3
    out, _, _ = collect(proc, follow=False, since=cut)
    assert out == b"after\n"


def test_ring_overflow_is_counted(daemon_factory, busybox_rootfs):
    d = daemon_factory('[limits]\nproc_output_bytes = "64K"\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    proc = sb.spawn("head -c 300000 /dev/zero")
    assert proc.wait().exit_code == 0
    # The exit can come before the last of the pipe is read: follow the output
    # to its end first, then replay what the ring kept.
    collect(proc)
    out, _, dropped = collect(proc, follow=False)
    st = proc.status()
    assert len(out) == st.output_bytes and len(out) <= 64 * 1024
    assert dropped == st.dropped == 300000 - len(out) > 0
    c.close()


def test_stdin_write_and_close(any_sandbox):
    sandbox = any_sandbox
    proc = sandbox.spawn(["sh", "-c", "while read l; do echo got $l; done; echo eof"])
    proc.write(b"one\ntwo\n")
    proc.close_stdin()
    assert proc.wait().exit_code == 0
    assert collect(proc)[0] == b"got one\ngot two\neof\n"
    with pytest.raises(Conflict, match="has exited"):
        proc.write(b"late\n")


def test_spawn_without_stdin_reads_dev_null(any_sandbox):
    sandbox = any_sandbox
    proc = sandbox.spawn("cat; echo done; exec sleep 30", stdin=False)
    deadline = time.monotonic() + 5
    while proc.status().output_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(Conflict, match="no stdin open"):
        proc.write(b"x")
    proc.kill()
    assert proc.wait().signal == signal.SIGKILL
    assert collect(proc)[0] == b"done\n"


def test_bad_input(any_sandbox):
    sandbox = any_sandbox
    with pytest.raises(NotFound, match="no background process with pid 4242"):
        sandbox.process(4242).wait()
    with pytest.raises(NotFound):
        list(sandbox.process(4242).output())
    proc = sandbox.spawn("sleep 30")
    with pytest.raises(BadRequest, match="unknown signal 'NOPE'"):
        proc.kill("NOPE")
    assert proc.kill("sigterm")["signal"] == signal.SIGTERM
    assert proc.wait().signal == signal.SIGTERM
    with pytest.raises(Conflict, match="already exited"):
        proc.kill()
    with pytest.raises(NotFound):
        sandbox.spawn(["/no/such/program"])
    with pytest.raises(BadRequest):
        sandbox.spawn([""])


def test_a_command_too_long_for_init_is_a_limit_not_a_conflict_to_retry(sandbox):
    """A background process is started by the sandbox's init, whose channel
    takes one message: a longer command (a prompt passed as an argument)
    can never start, so it is `limit` saying so, not a `conflict` saying to
    retry. An exec of the same command runs."""
    long_arg = "x" * 100_000
    with pytest.raises(LimitExceeded, match="its stdin or a file") as err:
        sandbox.spawn(["sh", "-c", "echo ${#0}", long_arg])
    assert err.value.detail["max"] < err.value.detail["bytes"]
    assert sandbox.processes() == []
    assert sandbox.exec(["sh", "-c", "echo ${#0}", long_arg]).stdout == b"100000\n"


def test_eviction_and_the_limit(daemon_factory, busybox_rootfs):
    d = daemon_factory("[limits]\nmax_procs_per_sandbox = 3\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    first = sb.spawn("exit 1")
    first.wait()
    running = [sb.spawn("sleep 30") for _ in range(2)]
    fourth = sb.spawn("sleep 30")            # the exited one makes room
    assert first.pid not in {p.pid for p in sb.processes()}
    with pytest.raises(LimitExceeded, match="max_procs_per_sandbox"):
        sb.spawn("sleep 30")
    for p in [*running, fourth]:
        p.kill()
        p.wait()
    sb.spawn("true")                         # exited ones are evicted again
    c.close()

    async def at_once():                     # starts in flight count: none overtakes the limit
        async with Client(d.socket) as ac:
            box = await ac.create(image="busybox", memory="128M")
            got = await asyncio.gather(*(box.spawn("sleep 30") for _ in range(8)), return_exceptions=True)
            return [type(g).__name__ for g in got], len(await box.processes())

    kinds, listed = asyncio.run(at_once())
    assert sorted(kinds) == ["LimitExceeded"] * 5 + ["Process"] * 3 and listed == 3, kinds


def test_destroy_ends_followers_and_waiters(client):
    sb = client.create(image="busybox", memory="128M")
    proc = sb.spawn("while true; do echo tick; sleep 0.1; done")

    result = {}

    def follow():
        result["out"] = collect(proc)

    t = threading.Thread(target=follow)
    t.start()
    time.sleep(0.3)
    sb.destroy(force=True)
    t.join(10)
    assert not t.is_alive() and result["out"][0].startswith(b"tick\n")


def test_a_follower_that_leaves_leaves_the_others_following(daemon, client):
    """Followers of one process share its wake-up: one that is cancelled (a
    `dsec logs -f | head -1` whose pipe closed) must not end the others,
    nor the followers that come after it."""
    sb = client.create(image="busybox", memory="128M")
    pid = sb.spawn("while read l; do echo got $l; done").pid

    async def first_line(proc) -> bytes:
        async for chunk in proc.output(follow=True):
            if chunk.data:
                return chunk.data
        return b""

    async def run() -> tuple[bytes, bytes]:
        async with Client(daemon.socket) as c:
            proc = (await c.get(sb.id)).process(pid)
            staying = asyncio.ensure_future(first_line(proc))
            leaving = asyncio.ensure_future(first_line(proc))
            await asyncio.sleep(0.3)                  # both wait on the process's next output
            leaving.cancel()
            await asyncio.sleep(0.3)
            late = asyncio.ensure_future(first_line(proc))
            await asyncio.sleep(0.3)
            await proc.write(b"x\n")
            return await asyncio.wait_for(staying, 10), await asyncio.wait_for(late, 10)

    try:
        assert asyncio.run(run()) == (b"got x\n", b"got x\n")
    finally:
        sb.destroy(force=True)


def test_pause_leaves_them_alone(any_sandbox):
    sandbox = any_sandbox
    proc = sandbox.spawn("read l; echo woke $l")
    sandbox.pause()
    time.sleep(0.5)
    assert [p.state for p in sandbox.processes() if p.pid == proc.pid] == ["running"]
    sandbox.resume()
    proc.write(b"up\n")
    assert proc.wait().exit_code == 0
    assert collect(proc)[0] == b"woke up\n"


def test_no_daemon_fds_leak(daemon, sandbox):
    sandbox.spawn("true").wait()             # warm up whatever the first one opens
    before = daemon.open_fds()
    procs = [sandbox.spawn("echo x; read l") for _ in range(5)]
    assert daemon.open_fds() >= before + 15        # the daemon's ends of their pipes
    for p in procs:
        p.close_stdin()
        p.wait()
    deadline = time.monotonic() + 5
    while daemon.open_fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.open_fds() <= before      # none left (one of before may have closed meanwhile)


def test_async_sdk_and_a_second_client(daemon):
    asyncio.run(_async_sdk_and_a_second_client(daemon))


async def _async_sdk_and_a_second_client(daemon):
    async with Client(daemon.socket) as c1, Client(daemon.socket) as c2:
        async with c1.sandbox(image="busybox", memory="128M") as sb:
            proc = await sb.spawn("read l; echo $l; exit 7")
            other = (await c2.get(sb.id)).process(proc.pid)        # taken up from another client
            await other.write(b"hi\n")
            st = await proc.wait()
            assert st.exit_code == 7
            chunks = [c async for c in other.output()]
            assert b"".join(c.data for c in chunks) == b"hi\n"


# ---------------------------------------------------------------- CLI

def test_cli_verbs(daemon, any_sandbox):
    sandbox = any_sandbox
    r = daemon.cli("exec", "-d", sandbox.id, "--", "sh", "-c", "echo out; echo err >&2; read l; exit $l")
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout)
    r = daemon.cli("proc", "ls", sandbox.id)
    assert r.returncode == 0 and str(pid) in r.stdout.decode() and "running" in r.stdout.decode()
    rows = json.loads(daemon.cli("proc", "ls", sandbox.id, "--json").stdout)
    assert [p["state"] for p in rows if p["pid"] == pid] == ["running"]
    r = daemon.cli("attach", sandbox.id, str(pid), input=b"5\n")
    assert (r.returncode, r.stdout, r.stderr) == (5, b"out\n", b"err\n")
    # --json: a line per chunk as `logs --json`, then its end as `wait --json`.
    pid2 = int(daemon.cli("exec", "-d", sandbox.id, "--", "sh", "-c", "read l; echo got $l; exit 4").stdout)
    r = daemon.cli("attach", "--json", sandbox.id, str(pid2), input=b"x\n")
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 4, r
    assert [(c["fd"], c["data"]) for c in lines[:-1]] == [(1, "got x\n")], lines
    assert (lines[-1]["pid"], lines[-1]["state"], lines[-1]["exit_code"]) == (pid2, "exited", 4), lines
    r = daemon.cli("wait", sandbox.id, str(pid))
    assert r.returncode == 5
    r = daemon.cli("logs", sandbox.id, str(pid))
    assert (r.returncode, r.stdout, r.stderr) == (0, b"out\n", b"err\n")
    r = daemon.cli("logs", sandbox.id, str(pid), "--since", str(time.time() + 60))
    assert (r.returncode, r.stdout) == (0, b"")
    r = daemon.cli("logs", sandbox.id, str(pid), "--since", "1h")
    assert r.stdout == b"out\n"


def test_cli_kill_wait_and_errors(daemon, any_sandbox):
    sandbox = any_sandbox
    pid = int(daemon.cli("exec", "-d", sandbox.id, "sleep", "30").stdout)
    r = daemon.cli("kill", sandbox.id, str(pid), "--signal", "BOGUS")
    assert r.returncode == 1 and b"unknown signal" in r.stderr
    assert daemon.cli("kill", sandbox.id, str(pid), "--signal", "TERM").returncode == 0
    assert daemon.cli("wait", sandbox.id, str(pid)).returncode == 128 + signal.SIGTERM
    r = daemon.cli("kill", sandbox.id, str(pid))
    assert r.returncode == 1 and b"already exited" in r.stderr
    r = daemon.cli("logs", sandbox.id, "99999")
    assert r.returncode == 1 and b"not_found" in r.stderr
    r = daemon.cli("wait", sandbox.id, "99999")
    assert r.returncode == 125 and b"not_found" in r.stderr
    r = daemon.cli("logs", sandbox.id, str(pid), "--since", "yesterday")
    assert r.returncode == 2 and b"--since" in r.stderr


def test_a_background_start_that_fails_is_answered_and_not_logged_as_an_error(daemon, any_sandbox):
    """A missing program is the caller's mistake: its answer says so, and the
    daemon's log gets no error (an unanswered future's traceback) for it."""
    r = daemon.cli("exec", "-d", any_sandbox.id, "/nope")
    assert r.returncode == 127 and b"/nope" in r.stderr
    assert daemon.cli("inspect", any_sandbox.id).returncode == 0       # the run is dropped by now
    assert "never retrieved" not in daemon.log.read_text()


def test_cli_logs_follow_and_attach_detach(daemon, any_sandbox):
    sandbox = any_sandbox
    pid = int(daemon.cli("exec", "-d", sandbox.id, "--", "sh", "-c",
                         "for i in 1 2 3; do echo $i; sleep 0.2; done").stdout)
    r = daemon.cli("logs", "-f", sandbox.id, str(pid))
    assert (r.returncode, r.stdout) == (0, b"1\n2\n3\n")
    pid = int(daemon.cli("exec", "-d", sandbox.id, "--", "sh", "-c",
                         "while true; do echo t; sleep 0.1; done").stdout)
    p = subprocess.Popen([str(VENV_BIN / "dsec"), "--socket", daemon.socket, "attach",
                          sandbox.id, str(pid)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    first = p.stdout.readline()                 # attached: its output comes
    p.send_signal(signal.SIGINT)                # detach: the process runs on
    out, err = p.communicate(timeout=10)
    assert p.returncode == 130 and first == b"t\n"
    # One line on how it ended, not a second one for the ^C itself.
    assert err == f"dsec: detached from process {pid}; it keeps running\n".encode(), err
    assert [x.state for x in sandbox.processes() if x.pid == pid] == ["running"]
    sandbox.process(pid).kill()
