"""The ssh:// transport's pieces that need no host: addresses, the ssh
command line, what an ended ssh says, and a Client over a stand-in `ssh`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from standin_kit import hello_then_drop, serving

from dsecd import Client, ConnectionLost, SshOptions
from dsecd.remote import SshLink, SshTarget


@pytest.mark.parametrize("text,want", [
    ("ssh://h1", SshTarget("h1")),
    ("ssh://root@h1:2222", SshTarget("h1", "root", 2222)),
    ("ssh://[fd00::1]:22", SshTarget("fd00::1", None, 22)),
    ("ssh://me@10.0.0.1", SshTarget("10.0.0.1", "me")),
])
def test_addresses(text, want):
    assert SshTarget.parse(text) == want
    assert SshTarget.parse(want.url()) == want


@pytest.mark.parametrize("text", ["h1", "ssh://", "ssh://h1/path", "ssh://h1?x=1", "ssh://u:pw@h1",
                                  "ssh://h1:99999", "ssh://h1:0", "ssh://[::1", "ssh://h1]:22"])
def test_bad_addresses_say_what_an_address_is(text):
    with pytest.raises(ValueError, match="ssh://"):
        SshTarget.parse(text)


@pytest.mark.parametrize("text", ["ssh://-oProxyCommand=id", "ssh://root@-h1:22"])
def test_a_host_name_starting_with_a_dash_is_refused(text):
    """ssh itself refuses it ("hostname contains invalid characters"), but
    the error's `ssh ... HOST true` to try it by hand then ran the host as
    ssh's option: with -oProxyCommand=..., that command."""
    with pytest.raises(ValueError, match="a host name cannot begin with '-'"):
        SshTarget.parse(text)


def test_the_ssh_command_line():
    o = SshOptions(command=["ssh", "-i", "k"], config="/c", remote_dsec="/opt/venv/bin/dsec",
                   remote_socket="/run/x.sock", keepalive_s=2, keepalive_count=4, options=["Compression=yes"])
    argv = o.argv(SshTarget("h1", "root", 2222))
    assert argv[:3] == ["ssh", "-i", "k"]
    assert "BatchMode=yes" in argv and "ServerAliveInterval=2" in argv and "ServerAliveCountMax=4" in argv
    assert argv[argv.index("-F") + 1] == "/c" and argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-l") + 1] == "root" and "Compression=yes" in argv
    assert argv[-3:] == ["--", "h1", "/opt/venv/bin/dsec --socket /run/x.sock rpc --stdio"]


def test_options_from_the_environment_then_given():
    env = {"DSEC_SSH_COMMAND": "nsenter --net=/run/netns/x ssh", "DSEC_SSH_CONFIG": "/cfg",
           "DSEC_REMOTE_DSEC": "sudo -n dsec"}
    o = SshOptions.from_env(env, config="/mine")
    assert o.command == ["nsenter", "--net=/run/netns/x", "ssh"]
    assert (o.config, o.remote_dsec) == ("/mine", "sudo -n dsec")
    assert o.remote_command() == "sudo -n dsec rpc --stdio"


def _fake_ssh(tmp_path, body: str) -> list[str]:
    """A stand-in for ssh: a script that gets ssh's arguments."""
    script = tmp_path / "fake-ssh"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return [str(script)]


def _reason(tmp_path, body: str) -> str:
    async def go():
        c = Client("ssh://h1", ssh=SshOptions(command=_fake_ssh(tmp_path, body)), connect_timeout=10)
        with pytest.raises(ConnectionError) as e:
            await c.connect()
        return str(e.value)

    return asyncio.run(go())


def test_ssh_failing_says_so_and_how_to_check(tmp_path):
    text = _reason(tmp_path, """
        import sys
        print("root@h1: Permission denied (publickey).", file=sys.stderr)
        sys.exit(255)
        """)
    assert "ssh to ssh://h1 failed: root@h1: Permission denied (publickey)" in text
    assert "BatchMode=yes h1 true" in text


def test_the_check_command_tries_the_same_port_user_and_config(tmp_path):
    """The `ssh ... true` to try names what the link used: a refused port
    22 would say nothing about the port 2222 that failed."""
    fake = _fake_ssh(tmp_path, """
        import sys
        print("ssh: connect to host h1 port 2222: Connection refused", file=sys.stderr)
        sys.exit(255)
        """)

    async def go():
        c = Client("ssh://bob@h1:2222", ssh=SshOptions(command=fake, config="/etc/fleet ssh"), connect_timeout=10)
        with pytest.raises(ConnectionError) as e:
            await c.connect()
        return str(e.value)

    text = asyncio.run(go())
    assert f"`{fake[0]} -o BatchMode=yes -F '/etc/fleet ssh' -p 2222 -l bob h1 true`" in text


def test_no_dsec_on_the_host_says_how_to_name_it(tmp_path):
    text = _reason(tmp_path, """
        import sys
        print("bash: line 1: dsec: command not found", file=sys.stderr)
        sys.exit(127)
        """)
    assert "'dsec' was not found on ssh://h1" in text and "DSEC_REMOTE_DSEC" in text


def test_the_relay_finding_no_daemon_says_what_to_check(tmp_path, capsys):
    """What `dsec rpc --stdio` says on the host reaches the client as the
    connection's error: it names the socket and how to name another."""
    from dsecd import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--socket", str(tmp_path / "none.sock"), "rpc", "--stdio"])
    err = capsys.readouterr().err
    assert e.value.code == 1
    assert f"cannot connect to dsecd at {tmp_path / 'none.sock'}: No such file or directory" in err
    assert "is the daemon running on this host?" in err and "DSEC_REMOTE_SOCKET" in err


@contextlib.contextmanager
def _one_connection_daemon(path: str, serve):
    """A unix socket at `path` whose first connection `serve(conn)` answers
    in a thread (and closes), for the relay to reach as its daemon."""
    import socket
    import threading

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def one() -> None:
        conn, _ = server.accept()
        with conn:
            serve(conn)

    t = threading.Thread(target=one)
    t.start()
    try:
        yield
    finally:
        t.join()
        server.close()


def test_the_relay_starts_without_the_clis_imports(tmp_path):
    """`dsec rpc --stdio` runs once per ssh:// connection: it relays bytes,
    and importing the client and the protocol's types for it (~0.15 s)
    delayed every remote connect."""
    path = str(tmp_path / "d.sock")
    # As the console script runs it (dsecd/cliboot.py), then which modules it had loaded.
    script = textwrap.dedent(f"""
        import atexit, sys
        atexit.register(lambda: sys.stderr.write(repr(sorted(
            m for m in sys.modules if m in ("asyncio", "msgpack", "dsecd.cli", "dsecd.client")))))
        sys.argv = ["dsec", "--socket", {path!r}, "rpc", "--stdio"]
        from dsecd.cliboot import main
        main()
        """)
    with _one_connection_daemon(path, lambda conn: conn.sendall(b"hello")):
        r = subprocess.run([sys.executable, "-c", script], input=b"", capture_output=True, timeout=30)
    assert (r.returncode, r.stdout, r.stderr) == (0, b"hello", b"[]"), r


def test_the_relay_ends_as_the_daemon_does_when_it_drops_bytes_unread(tmp_path):
    """A daemon killed with a request of ours not yet read resets the
    socket: the relay died with "dsec: [Errno 104] Connection reset by
    peer" (exit 1), which the client printed as the remote dsec failing.
    Its end is the daemon's: the relay ends as at the daemon's close."""
    path = str(tmp_path / "d.sock")
    # The relay's input lands in our receive buffer, unread, before the close.
    with _one_connection_daemon(path, lambda conn: time.sleep(0.5)):
        r = subprocess.run([sys.executable, "-m", "dsecd.cli", "--socket", path, "rpc", "--stdio"],
                           input=b"x" * 4096, capture_output=True, timeout=30)
    assert (r.returncode, r.stderr) == (0, b""), r


def test_a_shell_printing_to_stdout_is_named(tmp_path):
    text = _reason(tmp_path, """
        import os, sys, time
        os.write(1, b"Welcome to h1! Have a nice day\\n")
        time.sleep(5)
        """)
    assert "not dsecd frames" in text and "shell start-up file" in text


def test_the_ssh_program_missing(tmp_path):
    async def go():
        c = Client("ssh://h1", ssh=SshOptions(command=[str(tmp_path / "no-ssh")]))
        with pytest.raises(ConnectionError, match="was not found; install openssh-client"):
            await c.connect()

    asyncio.run(go())


def test_a_host_silent_within_the_connect_timeout_is_not_said_to_have_taken_the_connection(tmp_path):
    """Over ssh the wait covers ssh's own connect and login too: a host
    whose link is cut never took any connection, and "is the daemon
    stuck?" sent the user to the wrong place."""
    async def go():
        c = Client("ssh://h1", ssh=SshOptions(command=_fake_ssh(tmp_path, """
            import time
            time.sleep(60)
            """)), connect_timeout=0.3)
        with pytest.raises(ConnectionError) as e:
            await c.connect()
        return str(e.value)

    text = asyncio.run(go())
    assert "did not answer in 0.3 s" in text and "took the connection" not in text, text
    assert "ssh -o BatchMode=yes h1 true" in text, text


def test_a_connect_cancelled_before_the_hello_leaves_nothing(tmp_path):
    """A caller's timeout (dsecd.Fleet's reconnects to a dead host) cancels
    connect() while the stand-in ssh says nothing: its process is killed and
    reaped, and none of the connection's fds stay."""
    pidfile = tmp_path / "ssh.pid"

    async def go():
        c = Client("ssh://h1", ssh=SshOptions(command=_fake_ssh(tmp_path, f"""
            import os, time
            open({str(pidfile)!r}, "w").write(str(os.getpid()))
            time.sleep(60)
            """)), connect_timeout=30)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            pidfile.unlink(missing_ok=True)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(c.connect(), 0.5)
        return before, len(os.listdir("/proc/self/fd"))

    before, after = asyncio.run(go())
    assert after == before
    pid = int(pidfile.read_text())
    assert not os.path.exists(f"/proc/{pid}"), "the stand-in ssh was left running or unreaped"


RELAY = """
    # Stands in for `ssh host dsec rpc --stdio`: relays to the unix socket named
    # in FAKE_DSEC_SOCKET, counting its starts in FAKE_STARTS.
    import os, socket, sys, threading
    with open(os.environ["FAKE_STARTS"], "a") as f:
        f.write("x")
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.environ["FAKE_DSEC_SOCKET"])
    def up():
        while data := os.read(0, 65536):
            s.sendall(data)
        s.shutdown(socket.SHUT_WR)
    threading.Thread(target=up, daemon=True).start()
    while data := s.recv(65536):
        os.write(1, data)
    """


def test_a_lost_connection_fails_what_is_in_flight_and_the_next_request_reconnects(tmp_path, monkeypatch):
    """A stand-in daemon answers hello and pings, holds a `sleep` request
    forever, and drops the first connection when asked: the request in flight
    fails with ConnectionLost (sent), the next request starts ssh again."""
    from dsecd import protocol

    sock_path = str(tmp_path / "d.sock")
    starts = tmp_path / "starts"
    monkeypatch.setenv("FAKE_DSEC_SOCKET", sock_path)
    monkeypatch.setenv("FAKE_STARTS", str(starts))
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        dec = protocol.FrameDecoder(1 << 20)
        while data := await reader.read(65536):
            for f in dec.feed(data):
                if f["op"] == "hello":
                    writer.write(protocol.encode_frame({"id": f["id"], "result": {"limits": {}}}))
                elif f["op"] == "ping":
                    writer.write(protocol.encode_frame({"id": f["id"], "result": {"pid": os.getpid()}}))
                elif f["op"] == "drop":
                    writer.transport.abort()
                    return

    async def go():
        server = await asyncio.start_unix_server(serve, sock_path)
        c = Client("ssh://h1", ssh=SshOptions(command=_fake_ssh(tmp_path, RELAY)))
        async with server:
            await c.connect()
            assert (await c.request("ping"))["pid"] == os.getpid()
            held = asyncio.ensure_future(c.request("sleep"))
            await asyncio.sleep(0.2)
            await asyncio.gather(c.request("drop"), return_exceptions=True)
            with pytest.raises(ConnectionLost) as e:
                await held
            assert e.value.sent and e.value.op == "sleep" and e.value.target == "ssh://h1"
            assert "connects again" in str(e.value)
            assert (await c.request("ping"))["pid"] == os.getpid()
            await c.close()
        return starts.read_text()

    assert asyncio.run(go()) == "xx"


def test_a_request_after_close_says_the_client_closed_it(tmp_path, monkeypatch):
    """close() lets ssh end by itself, so the reader sees the stream end as
    it would if the daemon went: the error says who closed it, this client."""
    from dsecd import protocol

    sock_path = str(tmp_path / "d.sock")
    monkeypatch.setenv("FAKE_DSEC_SOCKET", sock_path)
    monkeypatch.setenv("FAKE_STARTS", str(tmp_path / "starts"))

    async def serve(reader, writer):
        dec = protocol.FrameDecoder(1 << 20)
        while data := await reader.read(65536):
            for f in dec.feed(data):
                writer.write(protocol.encode_frame({"id": f["id"], "result": {"limits": {}}}))
        writer.close()

    async def go():
        server = await asyncio.start_unix_server(serve, sock_path)
        async with server:
            c = Client("ssh://h1", ssh=SshOptions(command=_fake_ssh(tmp_path, RELAY)))
            await c.connect()
            await c.close()
            with pytest.raises(ConnectionLost) as e:
                await c.request("list")
        return str(e.value)

    said = asyncio.run(go())
    assert said.startswith("list on ssh://h1: connection lost: the client closed it"), said


CUT = RELAY + """
    # The link is cut under a working connection: ssh says so and exits 255.
    print("Connection to h1 closed by remote host.", file=sys.stderr)
    sys.exit(255)
    """


def test_a_link_cut_after_a_good_connection_is_told_as_such(tmp_path, monkeypatch):
    """on_lost (a fleet's host_down reason) and the request in flight say what ssh said."""
    told, text = _cut_after_hello(tmp_path, monkeypatch)
    assert len(told) == 1 and "Connection to h1 closed by remote host" in told[0], told
    assert "Connection to h1 closed by remote host" in text


def _cut_after_hello(tmp_path, monkeypatch) -> tuple[list[str], str]:
    """A stand-in daemon answers hello, then drops the connection; the
    stand-in ssh exits 255 saying the remote host closed it: what on_lost
    was told, and the request in flight's error."""
    sock_path = str(tmp_path / "d.sock")
    monkeypatch.setenv("FAKE_DSEC_SOCKET", sock_path)
    monkeypatch.setenv("FAKE_STARTS", str(tmp_path / "starts"))

    async def go():
        server = await asyncio.start_unix_server(hello_then_drop, sock_path)
        c = Client("ssh://h1", ssh=SshOptions(command=_fake_ssh(tmp_path, CUT)), reconnect=False)
        told = []
        c.on_lost = told.append
        async with server:
            await c.connect()
            with pytest.raises(ConnectionLost) as e:
                await c.request("list")
            await c.close()
        return told, str(e.value)

    return asyncio.run(go())


def test_a_255_after_a_good_connection_is_a_drop_not_a_login_failure(tmp_path, monkeypatch):
    told, text = _cut_after_hello(tmp_path, monkeypatch)
    assert "the ssh connection to ssh://h1 dropped after it had worked" in told[0]
    assert "check that it is up and reachable" in text
    assert "keys or agent" not in text and "BatchMode=yes h1 true" not in text


SLOW_CUT = RELAY + """
    # As ssh does on the channel's EOF: it shuts down the sending side of its
    # output (a socket) at once, and says why and exits a moment later.
    import time
    socket.socket(fileno=os.dup(1)).shutdown(socket.SHUT_WR)
    time.sleep(0.4)
    print("Connection to h1 closed by remote host.", file=sys.stderr)
    sys.exit(255)
    """


def test_a_request_made_while_ssh_is_exiting_says_what_ssh_said(tmp_path, monkeypatch):
    """A request (a fleet's heartbeat) sent between the end of the stream
    and ssh's exit fails with ssh's reason, not a guess: the first of the
    two to reach a Fleet becomes the host_down reason."""
    sock_path = str(tmp_path / "d.sock")
    monkeypatch.setenv("FAKE_DSEC_SOCKET", sock_path)
    monkeypatch.setenv("FAKE_STARTS", str(tmp_path / "starts"))

    async def go():
        server = await asyncio.start_unix_server(hello_then_drop, sock_path)
        c = Client("ssh://h1", ssh=SshOptions(command=_fake_ssh(tmp_path, SLOW_CUT)), reconnect=False)
        async with server:
            await c.connect()
            held = asyncio.ensure_future(c.request("list"))
            while c.connected:
                await asyncio.sleep(0.01)
            with pytest.raises(ConnectionLost) as e:
                await c.request("ping")
            with contextlib.suppress(ConnectionLost):
                await held
            await c.close()
        return str(e.value)

    text = asyncio.run(go())
    assert "Connection to h1 closed by remote host" in text and "the daemon closed it" not in text


def _gone(pid: int, within: float) -> bool:
    """Whether process `pid` exited (or is a zombie nobody reaped yet) within `within` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _started(pidfile) -> int:
    """The stand-in ssh's pid, once it is running."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int(pidfile.read_text())
        time.sleep(0.05)
    raise AssertionError("the stand-in ssh did not start in 10 s")


def _kill_if_left(pidfile) -> None:
    """The test's own stand-in ssh, by its pid, if a failing test left it."""
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        os.kill(int(pidfile.read_text()), signal.SIGKILL)


# Like ssh once its input ended: still there, waiting for the host to end what was sent.
LINGERING_SSH = """
    import os, time
    open(os.environ["FAKE_SSH_PID"], "w").write(str(os.getpid()))
    while os.read(0, 65536):
        pass
    time.sleep(60)
    """


def test_ssh_dies_with_the_client_process(tmp_path):
    """A client process killed (SIGKILL: no close, no finally) takes its ssh
    with it; an ssh left running would keep the host's relay, hence the
    client's execs there, going."""
    pidfile = tmp_path / "ssh.pid"
    program = textwrap.dedent(f"""
        import asyncio, sys, time
        from dsecd.remote import SshLink, SshOptions, SshTarget

        async def main():
            link = SshLink(SshTarget("h1"), SshOptions(command={_fake_ssh(tmp_path, LINGERING_SSH)!r}))
            await link.open(asyncio.Protocol)
            print("open", flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """)
    client = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE,
                              env={**os.environ, "FAKE_SSH_PID": str(pidfile)})
    try:
        assert client.stdout.readline() == b"open\n"
        ssh_pid = _started(pidfile)
        client.kill()
        client.wait()
        assert _gone(ssh_pid, 5), "ssh outlived the client process that started it"
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        _kill_if_left(pidfile)


# Answers hello, holds every other request (a long exec), and lingers once
# its input ended, as ssh does while the host still runs what was sent.
HOLDING_SSH = """
    import os, time
    from dsecd import protocol
    open(os.environ["FAKE_SSH_PID"], "w").write(str(os.getpid()))
    frames = protocol.FrameDecoder(1 << 20)
    while data := os.read(0, 65536):
        for f in frames.feed(data):
            if f["op"] == "hello":
                os.write(1, protocol.encode_frame({"id": f["id"], "result": {"limits": {}}}))
    time.sleep(60)
    """


def test_a_client_left_open_when_its_loop_ends_ends_its_ssh(tmp_path, monkeypatch):
    """asyncio.run() returning with a request in flight and no close():
    the loop's end cancels the connection's reader, which kills ssh, so
    the host drops the connection and kills the execs of a client that is
    gone. Only closing its input would leave the host running them."""
    pidfile = tmp_path / "ssh.pid"
    monkeypatch.setenv("FAKE_SSH_PID", str(pidfile))
    kept = []           # a program holding its client past the loop (a global, say)

    async def go():
        c = Client("ssh://h1", ssh=SshOptions(command=_fake_ssh(tmp_path, HOLDING_SSH)))
        kept.append(c)
        await c.connect()
        asyncio.ensure_future(c.request("exec", sandbox="sb", argv=["sleep", "60"]))
        await asyncio.sleep(0.2)

    try:
        asyncio.run(go())
        assert _gone(_started(pidfile), 5), "ssh outlived the loop of a client left open"
    finally:
        _kill_if_left(pidfile)


def test_a_dropped_connection_says_sshs_words_once_stopped():
    """ssh's own line ends with a period ("closed by remote host."): the
    reason built around it reads as one sentence, not with "..""."""
    from types import SimpleNamespace

    link = SshLink(SshTarget("h1"), SshOptions())
    link.proc = SimpleNamespace(returncode=255)
    link._stderr.append("Connection to 10.0.0.11 closed by remote host.")
    link.established = True
    said = link.describe()
    assert "closed by remote host. The host, its sshd" in said and ".." not in said, said


def test_the_bytes_of_a_frame_still_coming_are_a_sign_of_life(tmp_path):
    """dsecd.Fleet marks a host down when nothing came from it for
    down_after_s. Only whole frames counted: on a slow link, an exec's
    output or a file's chunk (megabytes in one frame) took longer than that
    to arrive, and the host was marked down, the transfer cut, while its
    bytes were coming all along."""
    from dsecd import protocol

    path = str(tmp_path / "d.sock")
    big = protocol.encode_frame({"id": 2, "result": {"data": b"x" * 200_000}})

    async def answer_slowly(f: dict, writer) -> bool:
        for i in range(0, len(big), len(big) // 8):      # a slow link: the frame in pieces
            writer.write(big[i:i + len(big) // 8])
            await writer.drain()
            await asyncio.sleep(0.1)
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer_slowly), path)
        try:
            async with Client(path) as c:
                loop = asyncio.get_running_loop()
                answer = asyncio.ensure_future(c.request("info"))
                asked = loop.time()
                await asyncio.sleep(0.45)
                mid = c.last_frame_at - asked
                assert not answer.done()
                await answer
                return mid
        finally:
            server.close()

    assert asyncio.run(go()) > 0.2


@pytest.mark.parametrize("stdin, stdout, status, said", [
    ("<&-", ">/dev/null", 0, b""),                  # no stdin at all: the input has ended
    ("</dev/null", ">/dev/full", 1, b"dsec rpc: No space left on device\n"),
    ("</dev/null", ">&-", 141, b""),                # no stdout: as a reader gone
])
def test_the_relay_ends_cleanly_on_stdio_it_cannot_use(tmp_path, stdin, stdout, status, said):
    """A relay started with stdin closed, or stdout on a full disk or
    closed, ends with a status and one line at most: it died of a thread's
    AttributeError (stdin) or an OSError's traceback (stdout)."""
    path = str(tmp_path / "d.sock")
    relay = f"{sys.executable} -m dsecd.cli --socket {path} rpc --stdio {stdin} {stdout}"
    with _one_connection_daemon(path, lambda conn: conn.sendall(b"x" * 100_000)):
        r = subprocess.run(["bash", "-c", relay], capture_output=True, timeout=30)
    assert (r.returncode, r.stderr) == (status, said), r
