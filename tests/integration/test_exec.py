"""exec in a real container sandbox: output, status, timeout, stdin, caps."""

import asyncio
import contextlib
import os
import signal
import threading
import time

import pytest
from attack_kit import install_probe, run_probe

import dsecd
from dsecd.errors import Conflict, DsecError, NotFound


def test_streams_both_and_exit_code(sandbox):
    r = sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
    assert not r.timed_out and not r.truncated


def test_streaming_iterator_yields_chunks_in_order(sandbox):
    chunks = list(sandbox.exec_stream(["sh", "-c", "for i in 1 2 3; do echo $i; done; echo e >&2"]))
    out = b"".join(d for fd, d in chunks if fd == 1)
    assert out == b"1\n2\n3\n"
    assert (2, b"e\n") in chunks


def test_timeout_kills_the_whole_process_group(sandbox):
    t0 = time.monotonic()
    r = sandbox.exec(["sh", "-c", "sleep 30 & sleep 30"], timeout=1)
    assert r.timed_out and r.signal == 9 and r.exit_code is None
    assert time.monotonic() - t0 < 5
    # Killed ones init has not reaped yet show as zombies (stat Z): not running.
    ps = sandbox.exec(["sh", "-c", "ps -o stat,comm | grep -v '^Z' | grep -c sleep || true"])
    assert ps.stdout.strip() == b"0"


def test_stdin_is_passed(sandbox):
    r = sandbox.exec(["cat"], stdin=b"data\n" * 1000)
    assert r.stdout == b"data\n" * 1000


def test_input_to_an_exec_started_without_stdin_says_how_to_give_it(sandbox):
    stream = sandbox.exec_stream(["sleep", "1"])
    chunks = threading.Thread(target=lambda: list(stream))
    chunks.start()
    try:
        time.sleep(0.3)
        with pytest.raises(Conflict, match=r"was started without stdin; to write to it, start it with stdin "
                                           r"\(SDK: exec_stream\(\.\.\., stdin=\.\.\.\) or pty=True"):
            stream.write(b"x")
    finally:
        chunks.join()


def test_env_cwd_user(sandbox):
    r = sandbox.exec(["sh", "-c", "echo $FOO; pwd; id -u"], env={"FOO": "bar"}, cwd="/tmp", user=65534)
    assert r.stdout.split() == [b"bar", b"/tmp", b"65534"]


def test_arguments_and_environment_that_are_not_utf8_reach_the_command_as_bytes(daemon, sandbox, tmp_path):
    """A file name with latin-1 bytes (as sys.argv or os.listdir(b".") give
    it) is an argument as any other: through the SDK (as os.fsdecode's str
    or as bytes), collected or streamed, in the background, and from the CLI."""
    name = os.fsdecode(b"caf\xe9")
    show = 'printf "%s|%s|" "$1" "$V"; test -e "/work/$1" && echo there'
    sandbox.exec(["mkdir", "-p", "/work"])
    sandbox.exec(["touch", f"/work/{name}"])
    assert sandbox.list_files("/work")[0]["name"] == name
    r = sandbox.exec(["sh", "-c", show, "x", name], env={"V": name})
    assert (r.exit_code, r.stdout) == (0, b"caf\xe9|caf\xe9|there\n"), r
    r = sandbox.exec([b"sh", "-c", show, "x", b"caf\xe9"], env={b"V": b"\xfe"}, on_stdout=lambda _: None)
    assert (r.exit_code, r.stdout) == (0, b"caf\xe9|\xfe|there\n"), r
    proc = sandbox.spawn(["sh", "-c", 'printf %s "$1$V"', "x", name], env={"V": name})
    assert proc.wait().exit_code == 0
    assert b"".join(c.data for c in proc.output() if c.fd == 1) == b"caf\xe9caf\xe9"
    assert next(p for p in sandbox.processes() if p.pid == proc.pid).argv[-1] == name
    r = daemon.cli("exec", "-e", f"V={name}", sandbox.id, "--", "sh", "-c", show, "x", name)
    assert (r.returncode, r.stdout) == (0, b"caf\xe9|caf\xe9|there\n"), r
    sandbox.exec(["mkdir", f"/work/{name}.d"])       # a working directory is a path like any other
    r = sandbox.exec(["pwd"], cwd=f"/work/{name}.d")
    assert (r.exit_code, r.stdout) == (0, b"/work/caf\xe9.d\n"), r
    r = daemon.cli("exec", "-w", f"/work/{name}.d", sandbox.id, "--", "pwd")
    assert (r.returncode, r.stdout) == (0, b"/work/caf\xe9.d\n"), r
    (tmp_path / "env").write_bytes(b"V=\xfe\n")
    r = daemon.cli("exec", "--env-file", str(tmp_path / "env"), sandbox.id, "--", "sh", "-c", show, "x", name)
    assert (r.returncode, r.stdout) == (0, b"caf\xe9|\xfe|there\n"), r
    r = daemon.cli("proc", "ls", sandbox.id)
    assert r.returncode == 0 and b" caf\xe9caf\xe9" not in r.stdout and b"x caf\xe9\n" in r.stdout, r


def test_a_creates_environment_may_hold_values_that_are_not_utf8(daemon, client):
    """A sandbox's env is its execs' default: bytes too, as execve takes
    them, given to the SDK as os.fsdecode's str (or bytes) and given back so."""
    name = os.fsdecode(b"caf\xe9")
    sb = client.create(image="busybox", memory="128M", env={"V": name, b"W\xff": b"\xfe"})
    try:
        assert sb.info["env"]["V"] == name and sb.inspect()["env"][os.fsdecode(b"W\xff")] == os.fsdecode(b"\xfe")
        assert next(s for s in client.list() if s["id"] == sb.id)["env"]["V"] == name
        r = sb.exec(["env"])
        lines = (b"\n" + r.stdout).split(b"\n")
        assert r.exit_code == 0 and b"V=caf\xe9" in lines and b"W\xff=\xfe" in lines, r
    finally:
        sb.destroy(force=True)
    r = daemon.cli("run", "--env", f"V={name}", "busybox", "--", "sh", "-c", 'printf %s "$V"')
    assert (r.returncode, r.stdout) == (0, b"caf\xe9"), r


def test_a_non_root_exec_may_still_serve_a_low_port(sandbox):
    """It keeps NET_BIND_SERVICE (docker opens the low ports with a sysctl)."""
    r = sandbox.exec(["sh", "-c", "nc -l -p 80 & sleep 0.3; netstat -ltn | grep -c ':80 '; kill $!"],
                     user=1000)
    assert r.stdout == b"1\n", r


def test_missing_program_and_cwd_are_not_found(sandbox):
    with pytest.raises(NotFound, match="no-such-prog"):
        sandbox.exec(["no-such-prog"])
    with pytest.raises(NotFound, match="working directory '/does/not/exist' does not exist"):
        sandbox.exec(["true"], cwd="/does/not/exist")
    with pytest.raises(NotFound, match="working directory '/etc/passwd' is not a directory"):
        sandbox.exec(["true"], cwd="/etc/passwd")
    sandbox.exec(["sh", "-c", "printf '#!/no/such/shell\\necho\\n' > /s; chmod +x /s"])
    with pytest.raises(NotFound, match="'/s': no such file .*its #! interpreter or its dynamic loader does not"):
        sandbox.exec(["/s"])


@pytest.mark.attack      # DSec's agents ran `yes` until tens of GB of stdout piled up
def test_output_cap_truncates_yes(daemon_factory, busybox_rootfs):
    d = daemon_factory('[limits]\nmax_exec_output_bytes = "1M"\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox")
    r = sb.exec(["yes"], timeout=30)
    assert r.truncated and not r.timed_out
    assert len(r.stdout) == 1 << 20
    assert r.signal == 13 or r.exit_code not in (None, 0)   # SIGPIPE / EPIPE
    sb.destroy()
    c.close()


def test_exec_runs_in_sandbox_namespaces_and_cgroup(sandbox):
    r = sandbox.exec(["sh", "-c", "echo $$; hostname; cat /proc/1/comm; ls /sys/fs/cgroup 2>&1 | head -1"])
    lines = r.stdout.decode().split("\n")
    assert int(lines[0]) > 1           # pid inside the sandbox's own pid namespace
    assert lines[1].startswith("sb-")
    assert lines[2] == "dsec-init"


def test_pid1_reaps_orphans(sandbox):
    sandbox.exec(["sh", "-c", "(sleep 0.2 &) ; true"])
    time.sleep(0.6)
    r = sandbox.exec(["sh", "-c", "ps -o stat,comm | grep -c '^Z' || true"])
    assert r.stdout.strip() == b"0"


def test_capabilities_are_bounded(sandbox):
    r = sandbox.exec(["sh", "-c", "grep CapBnd /proc/self/status"])
    bnd = int(r.stdout.split()[1], 16)
    assert not bnd & (1 << 21)         # CAP_SYS_ADMIN dropped
    assert bnd & (1 << 0)              # CAP_CHOWN kept
    r = sandbox.exec(["sh", "-c", "mount -t tmpfs x /mnt 2>&1; echo rc=$?"])
    assert b"rc=0" not in r.stdout


def test_destroy_with_running_exec_needs_force(client):
    import threading

    sb = client.create(image="busybox")
    c2 = __import__("dsecd").SyncClient(client._client.socket_path)
    c2.connect()
    ended: list = []

    def run() -> None:
        try:
            ended.append(c2.get(sb.id).exec(["sleep", "30"]))
        except DsecError as err:       # destroyed before it started: "sandbox is exiting"
            ended.append(err)
    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 5
    while client.get(sb.id).info["execs_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(Conflict, match="force"):
        sb.destroy()
    sb.destroy(force=True)
    t.join(10)
    c2.close()
    assert not t.is_alive() and len(ended) == 1


@pytest.mark.parametrize("streamed", [False, True])
def test_a_timed_out_exec_no_longer_holds_its_sandbox_when_the_timeout_returns(daemon, streamed):
    """A step's timeout around an exec (asyncio.wait_for): once it has
    returned, the exec it cancelled no longer counts as running, so a
    plain destroy (no force) right after it removes the sandbox instead of
    answering conflict."""
    async def exec_until_cancelled(sb) -> None:
        if streamed:
            async for _ in sb.exec_stream(["sh", "-c", "touch /tmp/started; exec sleep 30"]):
                pass
        else:
            await sb.exec(["sh", "-c", "touch /tmp/started; exec sleep 30"])

    async def go() -> None:
        async with dsecd.Client(daemon.socket) as c:
            for _ in range(3):
                sb = await c.create(image="busybox")
                try:
                    task = asyncio.ensure_future(exec_until_cancelled(sb))
                    while not await sb.exists("/tmp/started"):
                        await asyncio.sleep(0.02)
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    assert (await sb.destroy())["id"] == sb.id
                except BaseException:
                    with contextlib.suppress(DsecError):
                        await sb.destroy(force=True)
                    raise

    asyncio.run(go())


def test_exec_on_missing_sandbox(client):
    with pytest.raises(NotFound):
        client.request("exec", sandbox="ffffffffffff", argv=["true"])


def test_every_sandbox_process_runs_under_the_seccomp_filter(sandbox):
    # The exec'd process, a child it forks, and the sandbox's PID 1.
    r = sandbox.exec(["sh", "-c", "grep '^Seccomp:' /proc/self/status; (grep '^Seccomp:' /proc/self/status); "
                                  "grep '^Seccomp:' /proc/1/status"])
    assert r.stdout.split(b"\n")[:3] == [b"Seccomp:\t2"] * 3
    r = sandbox.exec(["sh", "-c", "unshare -u true; echo rc=$?"])
    assert b"rc=0" not in r.stdout and b"Operation not permitted" in r.stdout + r.stderr


def test_an_exec_waits_out_a_brief_writer_of_its_program(sandbox):
    """ETXTBSY (the program open for writing elsewhere: e.g. a copy of a
    write_file fd that a spawn child took with the daemon's fd table) is
    retried for a short while; a writer that stays is reported."""
    sandbox.write_file("/bin/job.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    host_path = f"/proc/{sandbox.inspect()['init_pid']}/root/bin/job.sh"
    fd = os.open(host_path, os.O_WRONLY)
    threading.Timer(0.02, os.close, (fd,)).start()
    assert sandbox.exec(["/bin/job.sh"]).stdout == b"ran\n"
    fd = os.open(host_path, os.O_WRONLY)
    try:
        with pytest.raises(DsecError) as err:
            sandbox.exec(["/bin/job.sh"])
        assert err.value.detail["errno"] == "ETXTBSY"
    finally:
        os.close(fd)


def _exec_answer(client, sb_id: str, argv: list[str], **kw) -> dict:
    """The daemon's answer to a collected exec, as it is on the wire."""
    return client.request("exec", sandbox=sb_id, argv=argv, stream=False, **kw)


def test_an_exec_killed_by_the_memory_limit_says_so(daemon):
    c = daemon.client()
    sb = c.create(image="busybox", memory="32M")
    try:
        r = _exec_answer(c, sb.id, ["sh", "-c", 'x=aaaaaaaaaaaaaaaa; while :; do x="$x$x"; done'], timeout=60)
        assert (r["signal"], r.get("killed_by")) == (9, "oom"), r
        r = sb.exec(["sh", "-c", 'x=aaaaaaaaaaaaaaaa; while :; do x="$x$x"; done'], timeout=60)
        assert (r.signal, r.killed_by) == (9, "oom")
        r = _exec_answer(c, sb.id, ["sh", "-c", "kill -9 $$"])
        assert r["signal"] == 9 and "killed_by" not in r, r          # killed, but not by the limit
        r = _exec_answer(c, sb.id, ["sleep", "5"], timeout=0.5)
        assert r["timed_out"] and "killed_by" not in r, r
    finally:
        sb.destroy(force=True)
        c.close()


def test_an_exec_ended_by_its_sandboxs_destroy_says_so(daemon):
    c = daemon.client()
    sb = c.create(image="busybox")
    answer: dict = {}
    argv = ["sh", "-c", "touch /tmp/started; exec sleep 30"]
    t = threading.Thread(target=lambda: answer.update(_exec_answer(c, sb.id, argv)))
    t.start()
    # Running, not only counted: a destroy before the start answers "exiting" instead.
    deadline = time.monotonic() + 10
    while sb.exec(["test", "-e", "/tmp/started"]).exit_code != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    sb.destroy(force=True)
    t.join(15)
    assert (answer.get("signal"), answer.get("killed_by")) == (9, "destroy"), answer
    assert answer.get("destroyed_by") == "request", answer
    c.close()


def test_an_exec_ended_by_its_sandboxs_ttl_says_the_ttl(daemon):
    """A long exec whose sandbox's ttl ran out says so, not only that the
    sandbox was destroyed (which reads as someone else's doing)."""
    c = daemon.client()
    try:
        sb = c.create(image="busybox", ttl=2)
        r = sb.exec(["sleep", "30"])
        assert (r.signal, r.killed_by, r.destroyed_by) == (9, "destroy", "ttl"), r
        out = daemon.cli("exec", c.create(image="busybox", ttl=2).id, "--", "sleep", "30")
        assert out.returncode == 137 and b"killed: its sandbox was destroyed: its ttl ran out" in out.stderr, out
    finally:
        c.close()


def _daemon_children(pid: int, pidns: int) -> dict[int, str]:
    """The children of process `pid` in pid namespace `pidns`: pid -> state (R, S, Z...)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = open(f"/proc/{pid}/task/{tid}/children").read().split()
        except OSError:
            continue
        for kid in kids:
            try:
                if os.stat(f"/proc/{kid}/ns/pid").st_ino == pidns:
                    out[int(kid)] = open(f"/proc/{kid}/stat").read().rpartition(")")[2].split()[0]
            except OSError:
                pass
    return out


def test_what_a_helper_exec_clones_onto_the_daemon_is_reaped(daemon_factory, busybox_rootfs, probe_binary):
    """Started by the daemon's helper, an exec is the daemon's child, and so
    is what it makes with clone(CLONE_PARENT). Nothing reaped those: each
    stayed a zombie of the daemon, and the sandbox's init, which finishes
    exiting only once every process of its pid namespace is reaped, hung in
    its exit: a destroy waited sandbox.destroy_timeout_s and left them all,
    and an init that died was never seen to (the sandbox stayed running)."""
    d = daemon_factory('exec_via = "helper"\n')
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox")
        install_probe(sb, probe_binary)
        init_pid = sb.inspect()["init_pid"]
        pidns = os.stat(f"/proc/{init_pid}/ns/pid").st_ino
        assert run_probe(sb, "clone_parent", 3, 0, 0)[-1] == "ok"
        deadline = time.monotonic() + 5
        while "Z" in _daemon_children(d.proc.pid, pidns).values():      # ended: reaped after the exec
            assert time.monotonic() < deadline, _daemon_children(d.proc.pid, pidns)
            time.sleep(0.05)
        assert run_probe(sb, "clone_parent", 2, 60, 1)[-1] == "ok"        # outlive the exec, sessions of their own
        assert list(_daemon_children(d.proc.pid, pidns).values()).count("S") >= 3     # init and both sleepers
        start = time.monotonic()
        sb.destroy()
        assert time.monotonic() - start < 5
        deadline = time.monotonic() + 5
        while _daemon_children(d.proc.pid, pidns):                        # init too: it could end
            assert time.monotonic() < deadline, _daemon_children(d.proc.pid, pidns)
            time.sleep(0.05)
        # An init that dies meanwhile (killed here) was never seen to: it waited for them.
        sb = c.create(image="busybox")
        install_probe(sb, probe_binary)
        assert run_probe(sb, "clone_parent", 2, 60, 1)[-1] == "ok"
        init_pid = sb.inspect()["init_pid"]
        pidns = os.stat(f"/proc/{init_pid}/ns/pid").st_ino
        os.kill(init_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while sb.inspect()["state"] != "dead" or _daemon_children(d.proc.pid, pidns):
            assert time.monotonic() < deadline, (sb.inspect()["state"], _daemon_children(d.proc.pid, pidns))
            time.sleep(0.1)
        sb.destroy()
    finally:
        c.close()
