"""Background processes survive a daemon restart (dsecd/engine/procs.py):
init holds their pipes while no daemon runs, and the next daemon takes them
back and reads on, and learns their end from init's queued report."""

from __future__ import annotations

import os
import re
import signal
import struct
import threading
import time

import msgpack
import pytest

from dsecd import protocol

TICKER = "i=0; while [ $i -lt 40 ]; do echo line $i; i=$((i+1)); sleep 0.1; done; exit 4"


def _wait_for_output(proc, least: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while proc.status().output_bytes < least:
        assert time.monotonic() < deadline, "no output"
        time.sleep(0.05)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_process_survives_a_restart(daemon_factory, busybox_rootfs, how):
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    ticker = sb.spawn(TICKER)
    short = sb.spawn("sleep 0.5; echo while-down; exit 6")       # ends while no daemon runs
    reader = sb.spawn("read l; echo got $l")
    done = sb.spawn("echo done-before; exit 2")                   # ends, and is read, before the stop
    assert done.wait().exit_code == 2
    _wait_for_output(ticker, len("line 0\n"))
    c.close()
    d.stop(how)
    time.sleep(1.0)                  # output piles up in the pipes meanwhile
    d.start()
    c = d.client()
    sb = c.get(sb.id)
    by_pid = {p.pid: p for p in sb.processes()}
    assert set(by_pid) >= {ticker.pid, short.pid, reader.pid}
    # The process that ended while the daemon was down: its status, and its output still in the pipe.
    short = sb.process(short.pid)
    assert short.wait().exit_code == 6
    assert b"".join(ch.data for ch in short.output()) == b"while-down\n"
    # The output of one that ended before: back with the ring a clean stop saved.
    done = list(sb.process(done.pid).output())
    if how == signal.SIGTERM:
        assert [(ch.fd, ch.data) for ch in done] == [(1, b"done-before\n")], done
    else:
        assert b"".join(ch.data for ch in done) == b"" and done[0].lost_before is not None, done
    # Stdin still reaches the reader.
    reader = sb.process(reader.pid)
    reader.write(b"again\n")
    assert reader.wait().exit_code == 0
    assert b"".join(ch.data for ch in reader.output()) == b"got again\n"
    # The ticker: what it wrote while no daemon ran, then new lines, then its exit code.
    ticker = sb.process(ticker.pid)
    chunks = list(ticker.output(follow=True))
    text = b"".join(ch.data for ch in chunks).decode()
    numbers = [int(n) for n in re.findall(r"line (\d+)", text)]
    if how == signal.SIGTERM:
        # What the daemon before read came back with the ring it saved: all of it.
        assert [ch for ch in chunks if not ch.data] == [], chunks[:2]
        assert numbers == list(range(40)), text
    else:
        # What the daemon that died read went with it, in an amount nobody knows.
        notice = chunks[0]
        assert (notice.fd, notice.data) == (0, b""), chunks[:2]
        assert notice.dropped == 0 and notice.lost_before is not None, notice
        logs = d.cli("logs", sb.id, str(ticker.pid))
        assert b"if any, is lost: the daemon restarted then" in logs.stderr, logs.stderr
        assert numbers == list(range(numbers[0], 40)), text     # in order, none lost since the restart
        assert numbers[0] <= 10            # lines written while the daemon was down are there
    st = ticker.wait()
    assert (st.state, st.exit_code) == ("exited", 4)
    # A new daemon's processes work as before; init let go of every pipe it held.
    assert sb.spawn("echo fresh").wait().exit_code == 0
    init_pid = sb.inspect()["init_pid"]
    deadline = time.monotonic() + 5
    while _pipes_held(init_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pipes_held(init_pid) == []
    c.close()


def test_output_still_draining_at_a_clean_stop_is_read_by_the_next_daemon(daemon_factory, busybox_rootfs):
    """A process that exited while a child of it still held its stdout: the
    daemon reads on for limits.exec_drain_grace_s. A clean stop in that
    window left what came after in the pipe init held, and the next daemon
    let init drop it unread; now it reads the pipe to its end first."""
    d = daemon_factory("[limits]\nexec_drain_grace_s = 60\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    proc = sb.spawn("echo before; (sleep 2; echo after) & exit 3")
    assert proc.wait().exit_code == 3
    _wait_for_output(proc, len("before\n"))
    c.close()
    d.stop(signal.SIGTERM)      # the child still holds the pipe: the daemon was draining it
    time.sleep(2.5)             # "after" is written while no daemon runs
    d.start()
    c = d.client()
    sb = c.get(sb.id)
    proc = sb.process(proc.pid)
    chunks = list(proc.output(follow=True))     # ends once the pipe is drained
    # The ring the daemon before saved, then what it left in the pipe.
    assert b"".join(ch.data for ch in chunks) == b"before\nafter\n", chunks
    assert not any(ch.dropped or ch.lost_before for ch in chunks), chunks
    st = proc.wait()
    assert (st.state, st.exit_code) == ("exited", 3)
    init_pid = sb.inspect()["init_pid"]
    deadline = time.monotonic() + 5
    while _pipes_held(init_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pipes_held(init_pid) == []          # init let go once the pipe was read to its end
    c.close()


def test_a_follower_resuming_since_its_last_chunk_is_told_of_no_loss(daemon_factory, busybox_rootfs):
    """A follower cut off by a clean restart takes up the output again with
    what was read after the last chunk it got (`since` is inclusive: just
    past that chunk's time): what the daemon before read is older, so none
    of it comes again and nothing is reported lost, and the lines go on
    where they stopped."""
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    # Two lines, then nothing until its stdin says: the daemon stopped has read all it wrote before.
    ticker = sb.spawn("echo line 0; echo line 1; read go; i=2; while [ $i -lt 6 ]; do echo line $i; "
                      "i=$((i+1)); done")
    _wait_for_output(ticker, len("line 0\nline 1\n"))
    last = list(ticker.output(follow=False))[-1]
    c.close()
    d.stop(signal.SIGTERM)
    d.start()
    c = d.client()
    ticker = c.get(sb.id).process(ticker.pid)
    ticker.write(b"go\n")
    chunks = list(ticker.output(follow=True, since=last.time + 0.001))
    assert [ch for ch in chunks if not ch.data] == [], chunks[:2]
    assert b"".join(ch.data for ch in chunks) == b"line 2\nline 3\nline 4\nline 5\n"
    assert ticker.status().dropped == 0        # the ring the daemon before saved came back whole
    c.close()


def test_a_follower_since_the_time_of_its_last_chunk_gets_that_chunk_again(daemon_factory, busybox_rootfs):
    """`since` is inclusive: a follower asking again from the very time of
    the last chunk it got gets that chunk again, from the ring the daemon
    before saved; what it read before then was not asked for."""
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    ticker = sb.spawn("echo line 0; sleep 0.3; echo line 1; read go; echo line 2")
    _wait_for_output(ticker, len("line 0\nline 1\n"))
    last = list(ticker.output(follow=False))[-1]
    assert last.data == b"line 1\n", last
    c.close()
    d.stop(signal.SIGTERM)
    d.start()
    c = d.client()
    ticker = c.get(sb.id).process(ticker.pid)
    ticker.write(b"go\n")
    chunks = list(ticker.output(follow=True, since=last.time))
    assert [ch for ch in chunks if not ch.data] == [], chunks[:2]
    assert b"".join(ch.data for ch in chunks) == b"line 1\nline 2\n"
    c.close()


class _Follow:
    """proc_logs followed on a raw connection of its own, read only when
    asked: what it does not read waits in the daemon (the client library
    reads every frame as it comes)."""

    def __init__(self, socket_path: str, sandbox: str, pid: int):
        import socket

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        self.sock.settimeout(60)
        self.sock.connect(socket_path)
        self.got = 0                    # the offset past the last byte that came
        self.ended = False              # the request's answer came: the output is over
        self._send({"id": 0, "op": "hello", "args": {"protocol": protocol.PROTOCOL_VERSION, "client": "test"}})
        assert "result" in self._recv()
        self._send({"id": 1, "op": "proc_logs", "args": {"sandbox": sandbox, "pid": pid, "follow": True}})

    def _send(self, obj: dict) -> None:
        self.sock.sendall(protocol.encode_frame(obj))

    def _exactly(self, n: int) -> bytes | None:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                return None
            out += chunk
        return bytes(out)

    def _recv(self) -> dict | None:
        head = self._exactly(4)
        if head is None:
            return None
        return msgpack.unpackb(self._exactly(struct.unpack(">I", head)[0]), raw=False)

    def read(self, until: int | None = None) -> None:
        """Read until `until` bytes of output came, or (None) to the end of the connection."""
        while until is None or self.got < until:
            frame = self._recv()
            if frame is None:
                return
            if frame.get("id") == 1 and ("result" in frame or "error" in frame):
                self.ended = True
            stream = frame.get("stream") or {}
            self.got += stream.get("dropped", 0) + len(stream.get("data", b""))


def test_a_follower_of_a_process_draining_at_a_clean_stop_is_not_told_it_is_over(daemon_factory,
                                                                                  busybox_rootfs):
    """A process that exited while a child of it holds its stdout is read on
    for limits.exec_drain_grace_s. When that read-on ended while a clean stop
    waited for a slow follower, the follower was answered that the output was
    over, though the rest (left in the pipe for the next daemon) was still to
    come. The stop leaves the read-on to the next daemon: the follower's
    connection just closes, and it follows on there."""
    d = daemon_factory('[limits]\nproc_output_bytes = "8M"\nexec_drain_grace_s = 1\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    size = 3_000_000
    proc = sb.spawn(f"yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c {size}; (sleep 3; echo tail) & exit 0",
                    stdin=False)
    follow = _Follow(d.socket, sb.id, proc.pid)
    follow.read(until=1)
    assert proc.wait().exit_code == 0       # the read-on's second starts
    _wait_for_output(proc, size)
    c.close()
    try:
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(1.5)                     # the stop waits for the follower past the read-on's end
        follow.read()
    finally:
        follow.sock.close()
    assert follow.got == size and not follow.ended
    d.stop()
    d.start()
    c = d.client()
    text = b"".join(ch.data for ch in c.get(sb.id).process(proc.pid).output(follow=True))
    assert len(text) == size + len(b"tail\n") and text.endswith(b"tail\n")
    c.close()


def test_a_clean_stop_sends_a_follower_all_it_read_first(daemon_factory, busybox_rootfs):
    """What the daemon had read of a process's output and not yet sent to
    its followers went with it at a clean stop (its connections closed
    first): a follower taking the output up on the next daemon was told
    of it as dropped. The daemon stops reading the pipes first (what the
    process writes then waits there for the next one), and sends what it
    holds before it closes the connections (and saves it for the next
    daemon)."""
    d = daemon_factory('[limits]\nproc_output_bytes = "8M"\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    size = 3_000_000
    proc = sb.spawn(f"yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c {size}; sleep 600", stdin=False)
    follow = _Follow(d.socket, sb.id, proc.pid)
    follow.read(until=1)
    _wait_for_output(proc, size)        # all read into the ring; most of it not sent: the follower reads nothing
    c.close()
    try:
        d.proc.send_signal(signal.SIGTERM)
        follow.read()                   # reads again as the daemon stops
    finally:
        follow.sock.close()
    d.stop()
    d.start()
    c = d.client()
    again = list(c.get(sb.id).process(proc.pid).output(follow=False))
    assert [ch.dropped for ch in again] == [0] * len(again)         # what the daemon before read is back
    assert sum(len(ch.data) for ch in again) == size
    assert follow.got == size
    c.close()


def _pipes_held(pid: int) -> list[str]:
    fds = os.listdir(f"/proc/{pid}/fd")
    return [t for t in (os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds) if t.startswith("pipe:")]


def test_destroy_after_a_restart_kills_them(daemon_factory, busybox_rootfs):
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    proc = sb.spawn("sleep 300")
    c.close()
    d.stop()
    d.start()
    c = d.client()
    sb = c.get(sb.id)
    assert [p.state for p in sb.processes() if p.pid == proc.pid] == ["running"]
    sb.process(proc.pid).kill("TERM")
    assert sb.process(proc.pid).wait().signal == signal.SIGTERM
    c.close()


def test_a_restart_with_exec_via_helper_keeps_them(daemon_factory, busybox_rootfs):
    """exec_via picks how new execs start; a restart that switches it to the
    helper still watches, feeds and signals the processes init runs."""
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    reader = sb.spawn("read l; echo got $l; exit 5")
    sleeper = sb.spawn("sleep 300")
    c.close()
    d.stop(signal.SIGTERM)
    d.config.write_text(d.config.read_text().replace("[sandbox]\n", '[sandbox]\nexec_via = "helper"\n', 1))
    d.start()
    c = d.client()
    sb = c.get(sb.id)
    assert {p.pid: p.state for p in sb.processes()} == {reader.pid: "running", sleeper.pid: "running"}
    reader = sb.process(reader.pid)
    reader.write(b"back\n")
    assert reader.wait().exit_code == 5
    assert b"".join(ch.data for ch in reader.output()) == b"got back\n"
    sleeper = sb.process(sleeper.pid)
    sleeper.kill("TERM")
    assert sleeper.wait().signal == signal.SIGTERM
    assert sb.exec(["sh", "-c", "echo $PPID"]).stdout == b"0\n"      # new execs: by the helper, as configured
    assert sb.spawn("echo new").wait().exit_code == 0                 # background ones: by init, as always
    c.close()


def _running(sb) -> list[str]:
    """The command lines running in the sandbox (zombies left out)."""
    out = sb.exec(["ps", "-o", "stat,args"]).stdout.decode().splitlines()[1:]
    return [line.split(None, 1)[1] for line in out if not line.lstrip().startswith("Z")]


def _wait_gone(sb, args: str, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while args in (running := _running(sb)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


@pytest.mark.parametrize("via", ["init", "helper"])
def test_execs_of_a_daemon_that_died_are_killed_at_the_restart(daemon_factory, busybox_rootfs, via):
    """An exec running when the daemon is SIGKILLed lost its client with
    that daemon's connections: the next daemon kills it (and its group),
    whether init (told to prune what it runs but the background processes)
    or the daemon's helper forked it. Background processes run on, and so
    does what an earlier exec left behind (`cmd &`), even detached into a
    session of its own (`setsid`, as a service's start script does)."""
    d = daemon_factory(f'exec_via = "{via}"\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    kept = ["sleep 301", "sleep 302"]
    if via == "init":                  # background processes need init's channel
        sb.spawn("sleep 300")
        kept.append("sleep 300")
    sb.exec(["sh", "-c", "sleep 301 >/dev/null 2>&1 &"])
    sb.exec(["sh", "-c", "setsid sleep 302 >/dev/null 2>&1 &"])
    ended = threading.Event()
    lost: list[ConnectionError] = []

    def foreground() -> None:
        try:
            sb.exec(["sleep", "100"], key="sleep-100")
        except ConnectionError as err:      # the daemon dies under it
            lost.append(err)
        ended.set()

    threading.Thread(target=foreground, daemon=True).start()
    deadline = time.monotonic() + 10
    while sb.info["execs_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "sleep 100" in _running(sb)
    d.stop(signal.SIGKILL)
    d.start()
    # Its client sent it again with its idempotency key (the caller's: the
    # SDK makes none for an exec on a local socket) once the next daemon
    # answered, which knows the one before began it: never run twice, it
    # fails as lost.
    assert ended.wait(30)
    assert len(lost) == 1 and "stopped before it ended" in str(lost[0]), lost
    c.close()
    c = d.client()
    sb = c.get(sb.id)
    running = _wait_gone(sb, "sleep 100")
    assert "sleep 100" not in running, running
    assert all(k in running for k in kept), running
    assert sb.info["execs_running"] == 0
    if via == "helper":                # init's are pruned by init, which says nothing
        assert "killed 1 exec(s) the daemon before left running" in d.log.read_text()
    c.close()


def test_a_clean_restart_kills_nothing_an_exec_left_behind(daemon_factory, busybox_rootfs):
    """A graceful stop ends its own execs: the next daemon looks for none,
    so a process an exec detached into a session of its own (setsid, as
    a service's start script does) runs on."""
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    sb.exec(["sh", "-c", "setsid sleep 302 >/dev/null 2>&1 &"])
    c.close()
    d.stop(signal.SIGTERM)
    d.start()
    c = d.client()
    sb = c.get(sb.id)
    assert "sleep 302" in _running(sb)
    assert "left running" not in d.log.read_text()
    c.close()
