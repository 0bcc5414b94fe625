"""Pty execs: a terminal in the sandbox (job control, ^C, window size), through
the SDK, the raw protocol, and the real `dsec exec -it` on a real terminal."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import threading
import time

import pytest
from conftest import VENV_BIN, shared_vm

from dsecd.errors import BadRequest, Conflict, NotFound

# Its VMs start from the run's templates (conftest.VM_TEMPLATES): none of its tests is about how one is built.
pytestmark = pytest.mark.shared_vm_templates

WAIT_S = 10.0


class Screen:
    """A pty exec's output, read by a thread; `expect` waits for a pattern."""

    def __init__(self, stream):
        self.stream = stream
        self.out = b""
        self.cond = threading.Condition()
        self.done = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for fd, data in self.stream:
                assert fd == 1, f"a pty exec's output is one stream, got fd {fd}"
                with self.cond:
                    self.out += data
                    self.cond.notify_all()
        except BaseException as err:       # shown by expect/wait
            self.error = err
        finally:
            self.done.set()
            with self.cond:
                self.cond.notify_all()

    def expect(self, pattern: bytes, since: int = 0, timeout: float = WAIT_S) -> re.Match:
        with self.cond:
            deadline = time.monotonic() + timeout
            while not (m := re.compile(pattern).search(self.out, since)):
                left = deadline - time.monotonic()
                assert left > 0 and not self.done.is_set(), \
                    f"no {pattern!r} in the terminal's output {self.out[since:]!r} (error: {self.error!r})"
                self.cond.wait(left)
            return m

    def mark(self) -> int:
        with self.cond:
            return len(self.out)

    def wait(self, timeout: float = WAIT_S):
        assert self.done.wait(timeout), f"the exec did not end; output {self.out!r}"
        if self.error is not None:
            raise self.error
        return self.stream.result


@pytest.fixture
def helper_sandbox(daemon_factory, busybox_rootfs):
    """A sandbox whose execs the daemon's helper starts (csrc/spawn.c), not its init."""
    d = daemon_factory('exec_via = "helper"\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    yield sb
    c.close()


@pytest.fixture(scope="module")
def vm_sandbox(daemon):
    yield from shared_vm(daemon)


@pytest.fixture(params=["init", "helper", "microvm"])
def any_sandbox(request):
    """The same test through every start: the sandbox's init, the daemon's
    helper, and a microVM's guest agent."""
    name = {"init": "sandbox", "helper": "helper_sandbox", "microvm": "vm_sandbox"}[request.param]
    return request.getfixturevalue(name)


def test_shell_echoes_runs_and_exits_with_its_status(any_sandbox):
    screen = Screen(any_sandbox.exec_stream(["sh"], pty=True))
    screen.stream.write(b"echo h''i\n")
    screen.expect(rb"echo h''i\r\n")          # the terminal's echo of what was typed
    screen.expect(rb"\r\nhi\r\n")              # and the command's output, with onlcr's \r
    screen.stream.write(b"exit 3\n")
    r = screen.wait()
    assert (r.exit_code, r.signal, r.timed_out) == (3, None, False)


def test_ctrl_c_interrupts_the_foreground_job_and_the_shell_survives(any_sandbox):
    screen = Screen(any_sandbox.exec_stream(["sh"], pty=True))
    screen.stream.write(b"sleep 100; echo after-sleep $?\n")
    screen.expect(rb"sleep 100; echo after-sleep \$\?\r\n")
    time.sleep(0.3)                          # sleep is running in the foreground
    t0 = time.monotonic()
    screen.stream.write(b"\x03")             # ^C: SIGINT by the line discipline
    at = screen.mark()
    screen.stream.write(b"echo alive\n")     # the shell itself reads on
    screen.expect(rb"\r\nalive\r\n", since=at)
    assert time.monotonic() - t0 < 5
    screen.stream.write(b"exit\n")
    assert screen.wait().exit_code == 0


def test_pty_is_the_controlling_terminal_with_the_asked_size(any_sandbox):
    r = any_sandbox.exec(["sh", "-c", "test -t 0 && test -t 1 && test -t 2 && echo tty; stty size; "
                                      "exec 0</dev/null; echo in > /dev/tty; exit 5"], pty=True, rows=40, cols=100)
    assert r.exit_code == 5, r
    # /dev/tty opens the controlling terminal, whatever stdin is.
    assert r.stdout == b"tty\r\n40 100\r\nin\r\n"


def test_the_terminal_is_one_of_the_sandboxs_own_ptys(any_sandbox):
    """ttyname() finds it in the sandbox's /dev/pts (`tty` names it: a pty
    of the host's devpts has no name there), and it is the exec user's."""
    r = any_sandbox.exec(["sh", "-c", 't=$(tty) && echo "name $t" && ls -ln "$t" && ls /dev/pts'], pty=True,
                         user=1000)
    assert r.exit_code == 0, r
    lines = r.stdout.decode().split("\r\n")
    name = lines[0].removeprefix("name ")
    assert re.fullmatch(r"/dev/pts/\d+", name), r.stdout
    assert lines[1].split()[2:4] == ["1000", "1000"], r.stdout        # owner and group
    assert name.rsplit("/", 1)[1] in lines[2].split(), r.stdout


def test_resize_sets_the_size_and_signals_the_foreground_group(any_sandbox):
    screen = Screen(any_sandbox.exec_stream(["sh"], pty=True))
    screen.stream.write(b"stty size\n")
    screen.expect(rb"\r\n24 80\r\n")
    screen.stream.resize(50, 132)
    at = screen.mark()
    screen.stream.write(b"stty size\n")
    screen.expect(rb"\r\n50 132\r\n", since=at)
    # SIGWINCH reaches the foreground process group, here a child shell's.
    at = screen.mark()
    screen.stream.write(b"sh -c 'trap \"echo got-winch; exit 7\" WINCH; echo ready; "
                        b"while :; do sleep 0.05; done'; echo status $?\n")
    screen.expect(rb"\r\nready\r\n", since=at)
    screen.stream.resize(30, 90)
    screen.expect(rb"got-winch\r\nstatus 7\r\n", since=at)
    screen.stream.write(b"exit\n")
    screen.wait()


def test_timeout_and_end_leave_no_daemon_fds(daemon, sandbox, client):
    list(sandbox.exec_stream(["true"], pty=True))          # warm up whatever is made once
    before = daemon.open_fds()
    for _ in range(3):
        r = sandbox.exec(["sh", "-c", "echo x"], pty=True)
        assert r.stdout == b"x\r\n"
    r = sandbox.exec(["sh", "-c", "sleep 30 & sleep 30"], pty=True, timeout=0.5)
    assert r.timed_out and r.signal == 9
    # Cancelled while running: the client stops iterating.
    stream = sandbox.exec_stream(["sh"], pty=True)
    for _fd, _data in stream:
        break
    deadline = time.monotonic() + WAIT_S
    while daemon.open_fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.open_fds() <= before      # none left (one of before may have closed meanwhile)


def test_bad_pty_requests_say_what_is_wrong(sandbox, client):
    with pytest.raises(NotFound, match="no running exec with id 987654"):
        client.request("exec_resize", exec_id=987654, rows=10, cols=10)
    with pytest.raises(BadRequest, match="rows must be in"):
        client.request("exec_resize", exec_id=1, rows=0, cols=10)
    with pytest.raises(BadRequest, match="cols must be in"):
        client.request("exec_resize", exec_id=1, rows=10, cols=70000)
    with pytest.raises(BadRequest, match="streams its output"):
        client.request("exec", sandbox=sandbox.id, argv=["true"], pty=True, stream=False)
    with pytest.raises(BadRequest, match="cannot be traced"):
        client.request("exec", sandbox=sandbox.id, argv=["true"], pty=True, trace=True)
    with pytest.raises(BadRequest, match="with pty=true"):
        client.request("exec", sandbox=sandbox.id, argv=["true"], rows=10, cols=10)
    with pytest.raises(BadRequest, match="both rows and cols"):
        client.request("exec", sandbox=sandbox.id, argv=["true"], pty=True, rows=10)
    with pytest.raises(BadRequest, match="rows must be in"):
        client.request("exec", sandbox=sandbox.id, argv=["true"], pty=True, rows=-1, cols=10)
    with pytest.raises(ValueError, match="with pty=True"):
        sandbox.exec(["true"], rows=10, cols=10)
    # A running exec without a terminal has no window.
    screen = Screen(sandbox.exec_stream(["cat"], stdin=_input_forever()))
    with pytest.raises(Conflict, match="no terminal to resize: start it with pty=true"):
        screen.stream.resize(10, 10)


async def _input_forever():
    """stdin that never ends: the exec stays running until the sandbox goes."""
    await asyncio.Event().wait()
    yield b""


# ---------------------------------------------------------------- the real CLI


class Terminal:
    """`dsec exec -it` run on the slave of a pty pair, as a user's terminal
    would: its session's controlling terminal, so SIGWINCH comes on a resize."""

    def __init__(self, daemon, *args: str, rows: int = 24, cols: int = 80):
        self.master, slave = os.openpty()
        _set_size(self.master, rows, cols)
        self.before = termios.tcgetattr(slave)
        self.proc = subprocess.Popen([str(VENV_BIN / "dsec"), "--socket", daemon.socket, *args],
                                     stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                                     preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.out = b""

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def expect(self, pattern: bytes, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.out):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} on the terminal: {self.out!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    self.out += os.read(self.master, 4096)
                except OSError:                      # EIO: the CLI is gone
                    raise AssertionError(f"the CLI ended before {pattern!r}: {self.out!r}") from None

    def resize(self, rows: int, cols: int) -> None:
        _set_size(self.master, rows, cols)          # the kernel sends SIGWINCH to the CLI

    def wait(self) -> int:
        code = self.proc.wait(WAIT_S)
        with_slave_attrs = termios.tcgetattr(self.master)   # the slave's settings, read through the master
        os.close(self.master)
        return code, with_slave_attrs


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def test_cli_exec_it_is_a_terminal_session(daemon, sandbox):
    term = Terminal(daemon, "exec", "-it", sandbox.id, "--", "sh")
    try:
        term.expect(rb"# ")                        # the prompt: dsec made our terminal raw before the exec
        term.type(b"echo h''i\r")                  # raw mode: Enter is \r, the sandbox's ICRNL makes it \n
        term.expect(rb"echo h''i\r\n")
        term.expect(rb"\r\nhi\r\n")
        term.type(b"stty size\r")
        term.expect(rb"\r\n24 80\r\n")
        term.resize(50, 132)
        time.sleep(0.3)                            # the CLI's resize request is on its way
        term.type(b"stty size\r")
        term.expect(rb"\r\n50 132\r\n")
        term.type(b"sleep 100; echo after $?\r")
        term.expect(rb"sleep 100; echo after \$\?\r\n")
        time.sleep(0.3)
        term.type(b"\x03")                         # ^C as a byte: raw mode keeps it from our own line discipline
        term.type(b"echo alive\r")               # read by the shell only once sleep is gone
        term.expect(rb"\r\nalive\r\n")            # well before sleep 100 would have ended
        term.type(b"exit 3\r")
        code, attrs = term.wait()
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait()
    assert code == 3
    assert attrs == term.before, "dsec left the terminal in raw mode"


def test_cli_restores_the_terminal_when_killed(daemon, sandbox):
    term = Terminal(daemon, "exec", "-it", sandbox.id, "--", "sh")
    term.expect(rb"# ")
    term.type(b"echo started\r")
    term.expect(rb"\r\nstarted\r\n")
    term.proc.terminate()
    code, attrs = term.wait()
    assert code == 128 + 15
    assert attrs == term.before, "dsec left the terminal in raw mode"
    # Its exec went with it (cancelled): its shell is gone from the sandbox.
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        ps = sandbox.exec(["sh", "-c", "ps -o args | grep -c '^sh$' || true"])
        if ps.stdout.strip() == b"0":
            break
        time.sleep(0.1)
    assert ps.stdout.strip() == b"0"


def test_cli_tty_without_a_terminal_is_a_clear_error(daemon, sandbox):
    r = daemon.cli("exec", "-it", sandbox.id, "--", "sh", input=b"echo hi\n")
    assert r.returncode == 125
    assert b"the input device is not a TTY" in r.stderr


def test_cli_run_it_is_a_terminal_session_in_a_sandbox_of_its_own(daemon, client):
    """`dsec run -it IMAGE sh`, as docker users type it: the image's command
    on a terminal, ^C typed into it, its exit status ours, its sandbox gone."""
    before = {s["id"] for s in client.list()}
    term = Terminal(daemon, "run", "-it", "busybox", "sh")
    try:
        term.expect(rb"# ")
        term.type(b"stty size; tty\r")
        term.expect(rb"\r\n24 80\r\n/dev/pts/\d+\r\n")
        term.type(b"sleep 100; echo after $?\r")
        term.expect(rb"sleep 100; echo after \$\?\r\n")
        time.sleep(0.3)
        term.type(b"\x03")                         # to the sandbox's terminal, not a signal to dsec run
        term.type(b"echo alive\r")
        term.expect(rb"\r\nalive\r\n")
        term.type(b"exit 4\r")
        code, attrs = term.wait()
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait()
    assert code == 4
    assert attrs == term.before, "dsec left the terminal in raw mode"
    assert {s["id"] for s in client.list()} == before          # removed, as docker run --rm
    r = daemon.cli("run", "-it", "busybox", "sh", input=b"echo hi\n")
    assert r.returncode == 125 and b"dsec run: -t needs a terminal" in r.stderr
