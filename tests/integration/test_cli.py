"""The `dsec` CLI against a real daemon: the commands of the README."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import VENV_BIN

from dsecd import protocol


def test_create_exec_cp_ps_rm(daemon, tmp_path):
    r = daemon.cli("create", "--image", "busybox", "--cpu", "0.5", "--memory", "256M", "--pids", "128",
                   "--env", "K=V", "--label", "job=42")
    assert r.returncode == 0, r.stderr
    sb = r.stdout.decode().strip()

    r = daemon.cli("exec", sb, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, b"out\n", b"err\n")

    r = daemon.cli("exec", "--timeout", "1", sb, "--", "sleep", "10")
    assert r.returncode == 124 and b"timed out" in r.stderr

    r = daemon.cli("exec", "-i", sb, "--", "cat", input=b"data\n")
    assert (r.returncode, r.stdout) == (0, b"data\n")

    r = daemon.cli("exec", sb, "--", "sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + 15

    r = daemon.cli("exec", sb, "--", "no-such-command")
    assert r.returncode == 127 and b"not_found" in r.stderr
    r = daemon.cli("exec", sb, "--", "/etc/passwd")                  # exists, not executable
    assert r.returncode == 126 and b"permission" in r.stderr

    src = tmp_path / "a.py"
    src.write_text("print('hi')\n")
    assert daemon.cli("cp", str(src), f"{sb}:/work/a.py").returncode == 0
    assert daemon.cli("exec", sb, "--", "sh", "-c", "cat /work/a.py > /work/out.txt").returncode == 0
    r = daemon.cli("cp", f"{sb}:/work/out.txt", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.txt").read_text() == "print('hi')\n"

    r = daemon.cli("--json", "ps")
    listed = json.loads(r.stdout)
    assert any(s["id"] == sb and s["labels"] == {"job": "42"} for s in listed)
    assert sb.encode() in daemon.cli("ps").stdout

    r = daemon.cli("inspect", sb)
    assert json.loads(r.stdout)["limits"]["pids"] == 128

    assert daemon.cli("rm", sb).returncode == 0
    r = daemon.cli("rm", sb)
    assert r.returncode == 1 and b"not_found" in r.stderr


def test_rm_all_and_info(daemon):
    for _ in range(3):
        assert daemon.cli("create", "--image", "busybox").returncode == 0
    r = daemon.cli("--json", "rm", "--all")
    assert len(json.loads(r.stdout)["destroyed"]) >= 3
    info = json.loads(daemon.cli("--json", "info").stdout)
    assert info["features"]["sched_core"]["available"] is False or info["features"]["sched_core"]["detail"]
    assert {"overlayfs", "pidfd", "openat2", "damon", "bpf_cgroup", "landlock", "seccomp", "kvm",
            "swap", "erofs_file_backed", "fuse"} <= set(info["features"])
    text = daemon.cli("info").stdout.decode()
    assert "kernel" in text and "features:" in text and "\nnet: " in text


def test_bad_cli_input_is_reported(daemon):
    r = daemon.cli("create", "--image", "busybox", "--env", "BAD KEY=x")
    assert r.returncode != 0 and b"KEY=VALUE" in r.stderr
    r = daemon.cli("cp", "a", "b")
    assert r.returncode != 0 and b"SANDBOX" in r.stderr


def test_rpc_stdio_bridges_the_protocol(daemon):
    dsec = Path(sys.executable).parent / "dsec"
    frames = protocol.encode_frame({"id": 1, "op": "hello", "args": {"protocol": 1}}) + \
        protocol.encode_frame({"id": 2, "op": "ping", "args": {}})
    r = subprocess.run([str(dsec), "--socket", daemon.socket, "rpc", "--stdio"], input=frames,
                       capture_output=True, timeout=20)
    dec = protocol.FrameDecoder(1 << 24)
    out = dec.feed(r.stdout)
    assert [f["id"] for f in out] == [1, 2] and "time" in out[1]["result"]


def _rpc_frames(*reqs: dict) -> bytes:
    return b"".join(protocol.encode_frame(r) for r in [{"id": 1, "op": "hello", "args": {"protocol": 1}}, *reqs])


def test_rpc_stdio_answers_what_was_sent_before_its_input_ended(daemon, client):
    """Input that ends (ssh's stdin closed) ends only the requests to come:
    a pipelined exec and destroy are both answered, then the bridge exits."""
    keep, gone = client.create(image="busybox"), client.create(image="busybox")
    frames = _rpc_frames(
        {"id": 2, "op": "exec", "args": {"sandbox": keep.id, "argv": ["sh", "-c", "sleep 1; echo done"],
                                          "stream": False}},
        {"id": 3, "op": "destroy", "args": {"sandbox": gone.id, "force": True}})
    dsec = Path(sys.executable).parent / "dsec"
    r = subprocess.run([str(dsec), "--socket", daemon.socket, "rpc", "--stdio"], input=frames,
                       capture_output=True, timeout=30)
    out = {f["id"]: f for f in protocol.FrameDecoder(1 << 24).feed(r.stdout)}
    assert r.returncode == 0, r.stderr
    assert out[2]["result"]["stdout"] == b"done\n", out[2]
    assert out[3]["result"]["id"] == gone.id, out[3]
    assert [s["id"] for s in client.list()] == [keep.id]
    keep.destroy(force=True)


def test_rpc_stdio_whose_reader_is_gone_ends_and_its_exec_dies(daemon, client):
    """A client gone altogether (nobody reads the bridge's stdout, as when
    an ssh session drops) is not a half close: the bridge closes the socket
    at once and the daemon kills the exec, instead of running it for nobody."""
    sb = client.create(image="busybox")
    dsec = Path(sys.executable).parent / "dsec"
    p = subprocess.Popen([str(dsec), "--socket", daemon.socket, "rpc", "--stdio"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        p.stdin.write(_rpc_frames({"id": 2, "op": "exec", "args": {"sandbox": sb.id, "argv": ["sleep", "60"],
                                                                    "stream": False}}))
        p.stdin.flush()
        dec = protocol.FrameDecoder(1 << 24)
        assert dec.feed(p.stdout.read1(1 << 16))[0]["id"] == 1          # the hello's answer
        deadline = time.monotonic() + 10
        while client.get(sb.id).info["execs_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        p.stdout.close()                     # the reader goes; the bridge's input stays open
        assert p.wait(timeout=10) == 141
        while client.get(sb.id).info["execs_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get(sb.id).info["execs_running"] == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdin.close()
        sb.destroy(force=True)


def test_socket_is_0660_root(daemon):
    import os
    import stat

    st = os.stat(daemon.socket)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_uid == 0


def _as_nobody(fn) -> int:
    import os

    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_non_root_peer_is_refused(daemon):
    import os
    import socket

    import msgpack

    def connect() -> int:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(daemon.socket)
        except PermissionError:
            return 10
        s.settimeout(5)
        data = s.recv(65536)
        err = msgpack.unpackb(data[4:], raw=False).get("error", {})
        return 20 if err.get("code") == "permission" else 30

    # The 0660 root-owned socket keeps non-members out at connect() ...
    assert _as_nobody(connect) == 10
    # ... and SO_PEERCRED refuses them even if the file mode is loosened by mistake.
    # (The test's temp dir is 0700; let nobody traverse it for this check.)
    os.chmod(daemon.tmp, 0o711)
    os.chmod(daemon.socket, 0o666)
    try:
        assert _as_nobody(connect) == 20
    finally:
        os.chmod(daemon.socket, 0o660)
        os.chmod(daemon.tmp, 0o700)


def test_options_after_the_sandbox_id(daemon, tmp_path):
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    try:
        r = daemon.cli("exec", sb, "--timeout", "1", "--", "sleep", "10")
        assert r.returncode == 124 and b"timed out" in r.stderr
        r = daemon.cli("exec", sb, "-i", "--user", "5", "--", "sh", "-c", "id -u; cat", input=b"in\n")
        assert (r.returncode, r.stdout) == (0, b"5\nin\n"), r.stderr
        r = daemon.cli("exec", sb, "--env", "A=b", "sh", "-c", "echo $A")       # no `--`: the first word
        assert (r.returncode, r.stdout) == (0, b"b\n"), r.stderr
        out = tmp_path / "trace.txt"
        r = daemon.cli("trace", sb, "-o", str(out), "--", "true")
        assert r.returncode == 0 and out.stat().st_size > 0, r.stderr
        r = daemon.cli("exec", sb)
        assert r.returncode == 125 and b"give a command" in r.stderr
    finally:
        daemon.cli("rm", "--force", sb)


def test_json_after_the_command(daemon):
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    try:
        assert any(s["id"] == sb for s in json.loads(daemon.cli("ps", "--json").stdout))
        assert any(i["name"] == "busybox" for i in json.loads(daemon.cli("image", "ls", "--json").stdout))
        assert json.loads(daemon.cli("image", "inspect", "busybox", "--json").stdout)["name"] == "busybox"
        r = daemon.cli("events", "--replay", "--no-follow", "--json")
        events = [json.loads(line) for line in r.stdout.splitlines()]
        assert r.returncode == 0 and any(e["event"] == "created" and e["sandbox"] == sb for e in events)
    finally:
        daemon.cli("rm", sb)


def test_commands_that_run_a_command_print_one_json_object_with_its_output(daemon):
    """exec, run and call with --json: stdout is the result alone, the
    command's output in it, and the exit status is still the command's."""
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    try:
        script = ["sh", "-c", "echo out; echo err >&2; exit 3"]
        for args in (["exec", sb, "--", *script], ["run", "busybox", "--", *script],
                     ["call", "--image", "busybox", "--", *script]):
            r = daemon.cli("--json", *args)
            result = json.loads(r.stdout)
            assert (r.returncode, result["exit_code"], result["stdout"], result["stderr"]) == (3, 3, "out\n", "err\n"), \
                (args, r.stdout, r.stderr)
            assert r.stderr == b"", (args, r.stderr)
        r = daemon.cli("exec", "--json", "--policy", '{"hidden": ["/etc"]}', sb, "--", "cat", "/etc/passwd")
        result = json.loads(r.stdout)
        assert (r.returncode, result["policy"]) == (1, "inline") and result["denials"] >= 1, r.stdout
    finally:
        daemon.cli("rm", sb)


def test_replayed_events_are_filtered_like_live_ones(daemon):
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    daemon.cli("rm", sb)
    r = daemon.cli("events", "--replay", "--no-follow", "--json", "--sandbox", sb)      # destroyed: its history
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["event"] for e in events] == ["created", "destroyed"] and {e["sandbox"] for e in events} == {sb}


def test_events_of_a_sandbox_that_is_not_there_are_refused_at_once(daemon):
    """A name that matches nothing would wait for nothing; a live sandbox's
    prefix names it."""
    for follow in ([], ["--no-follow"]):
        r = daemon.cli("events", "--sandbox", "nosuch", *follow, timeout=10)
        assert r.returncode == 1 and b"no sandbox 'nosuch'" in r.stderr, r
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    try:
        r = daemon.cli("events", "--replay", "--no-follow", "--json", "--sandbox", sb[:6])
        assert [json.loads(line)["sandbox"] for line in r.stdout.splitlines()] == [sb]
    finally:
        daemon.cli("rm", sb)


def test_a_closed_stdout_ends_quietly(daemon):
    import os

    for _ in range(3):
        daemon.cli("create", "--image", "busybox")
    r_fd, w_fd = os.pipe()
    os.close(r_fd)                    # nobody reads: the first write fails with EPIPE
    try:
        p = subprocess.run([str(Path(sys.executable).parent / "dsec"), "--socket", daemon.socket, "ps"],
                           stdout=w_fd, stderr=subprocess.PIPE, timeout=30)
    finally:
        os.close(w_fd)
        daemon.cli("rm", "--all")
    assert (p.returncode, p.stderr) == (141, b"")


def test_impossible_creates_are_bad_requests_not_busy(daemon):
    before = json.loads(daemon.cli("ps", "--json").stdout)
    for args, words in ((["--cpu", "1000"], b"more than this host can ever give"),
                        (["--memory", "100T"], b"more than this host can ever give"),
                        (["--cwd", "/nonexist"], b"'/nonexist' is not a directory in image 'busybox'"),
                        (["--cwd", "/etc/passwd"], b"is not a directory"),
                        (["--ttl", "0"], b"more than 0 s")):
        r = daemon.cli("create", "--image", "busybox", *args)
        assert r.returncode == 1 and b"bad_request" in r.stderr and words in r.stderr, (args, r.stderr)
    assert json.loads(daemon.cli("ps", "--json").stdout) == before          # nothing left behind
    sb = daemon.cli("create", "--image", "busybox", "--cwd", "/work").stdout.decode().strip()
    try:
        assert daemon.cli("exec", sb, "--", "pwd").stdout == b"/work\n"
    finally:
        daemon.cli("rm", sb)


def _dsec(*args) -> list[str]:
    return [str(Path(sys.executable).parent / "dsec"), *args]


def _one_json_error(r, code: str) -> dict:
    """The error object that is the whole of stdout, with this code."""
    out = json.loads(r.stdout)
    assert set(out) == {"error"} and out["error"]["code"] == code, (r.stdout, r.stderr)
    assert set(out["error"]) == {"code", "message", "detail"}, out
    return out["error"]


def _running_exec(daemon, sb: str, *dsec_args: str) -> subprocess.Popen:
    """`dsec [dsec_args] exec SB -- sleep 30` started, returned once the daemon counts the exec."""
    p = subprocess.Popen(_dsec("--socket", daemon.socket, *dsec_args, "exec", sb, "--", "sleep", "30"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        listed = json.loads(daemon.cli("--json", "ps").stdout)
        if any(s["id"] == sb and s["execs_running"] for s in listed):
            return p
        assert p.poll() is None, p.communicate()
        time.sleep(0.1)
    p.kill()
    p.wait()
    raise AssertionError("the exec did not start")


def test_json_rm_of_a_missing_or_busy_sandbox_prints_the_error(daemon):
    r = daemon.cli("--json", "rm", "nosuch")
    assert r.returncode == 1 and b"not_found" in r.stderr
    assert _one_json_error(r, "not_found")["detail"]["sandbox"] == "nosuch"

    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    p = _running_exec(daemon, sb)
    try:
        r = daemon.cli("--json", "rm", sb)
        assert r.returncode == 1, r.stderr
        err = _one_json_error(r, "conflict")
        assert err["detail"]["sandbox"] == sb and "dsec rm --force / -f" in err["message"], err
        r = daemon.cli("rm", sb)                     # text: the stderr line alone, naming the flag
        assert (r.returncode, r.stdout) == (1, b"") and b"dsec rm --force / -f" in r.stderr, r.stderr
        r = daemon.cli("--json", "rm", f"{sb}:/no/such/file")
        assert r.returncode == 1
        err = _one_json_error(r, "not_found")
        assert err["detail"]["sandbox"] == sb and err["detail"]["path"].endswith("/no/such/file"), err
        r = daemon.cli("--json", "rm", "-f", sb)
        assert r.returncode == 0 and json.loads(r.stdout)["id"] == sb, r.stderr
    finally:
        p.kill()
        p.wait()
        daemon.cli("rm", "-f", sb)


def test_json_exec_interrupted_by_sigint_prints_the_error(daemon):
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    try:
        p = _running_exec(daemon, sb, "--json")
        p.send_signal(signal.SIGINT)
        try:
            out, errout = p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 130, (out, errout)
        err = _one_json_error(subprocess.CompletedProcess(p.args, p.returncode, out, errout), "interrupted")
        assert (err["detail"]["signal"], err["detail"]["stdout"], err["detail"]["stderr"]) == ("SIGINT", "", "")
    finally:
        daemon.cli("rm", "-f", sb)


# A command that says when its handler is in place and when it handled a
# SIGTERM, in files (--json prints nothing before the end) and on stdout;
# given an exit status, the first SIGTERM ends it with that status.
def _trapping(exit_status: int | None) -> list[str]:
    action = "touch /tmp/got; echo got TERM" + (f"; exit {exit_status}" if exit_status is not None else "")
    return ["sh", "-c", f'trap "{action}" TERM; touch /tmp/ready; while :; do sleep 0.1; done']


def _run_when_ready(daemon, *args: str) -> tuple[subprocess.Popen, str]:
    """`dsec ... run busybox ARGS` started; returned with its sandbox once the command's handler is set."""
    before = {s["id"] for s in json.loads(daemon.cli("--json", "ps").stdout)}
    p = subprocess.Popen(_dsec("--socket", daemon.socket, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while True:
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        for sb in {s["id"] for s in json.loads(daemon.cli("--json", "ps").stdout)} - before:
            if daemon.cli("cat", f"{sb}:/tmp/ready").returncode == 0:
                return p, sb
        time.sleep(0.1)


def _gone(daemon, sb: str) -> bool:
    return sb not in {s["id"] for s in json.loads(daemon.cli("--json", "ps").stdout)}


def _terminated(p: subprocess.Popen, between=None) -> tuple[bytes, bytes]:
    """SIGTERM to a running `dsec run` (and a second once `between()` returned); its output."""
    try:
        p.send_signal(signal.SIGTERM)
        if between is not None:
            between()
            p.send_signal(signal.SIGTERM)
        return p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_run_forwards_a_signal_to_its_command(daemon):
    """As docker run's --sig-proxy: the command's own handler decides the end."""
    p, sb = _run_when_ready(daemon, "run", "busybox", "--", *_trapping(3))
    out, errout = _terminated(p)
    assert (p.returncode, out) == (3, b"got TERM\n"), errout
    assert _gone(daemon, sb)


def test_json_run_ended_by_a_second_signal_prints_the_error(daemon):
    """The first signal is the command's to handle; a second kills it and removes its sandbox."""
    p, sb = _run_when_ready(daemon, "--json", "run", "busybox", "--", *_trapping(None))

    def handled() -> None:      # the forwarded one, which did not end it: the next is dsec's
        deadline = time.monotonic() + 30
        while daemon.cli("cat", f"{sb}:/tmp/got").returncode != 0:
            assert time.monotonic() < deadline and p.poll() is None, "the command did not get the first SIGTERM"
            time.sleep(0.1)

    out, errout = _terminated(p, handled)
    assert p.returncode == 128 + signal.SIGTERM and b"SIGTERM: the command was killed" in errout, errout
    err = _one_json_error(subprocess.CompletedProcess(p.args, p.returncode, out, errout), "interrupted")
    assert (err["detail"]["signal"], err["detail"]["sandbox"]) == ("SIGTERM", sb), err
    assert _gone(daemon, sb)


def test_json_connection_failure_prints_the_error(daemon, tmp_path):
    missing = str(tmp_path / "nosuch.sock")
    r = subprocess.run(_dsec("--socket", missing, "--json", "ps"), capture_output=True, timeout=30)
    assert r.returncode == 1 and b"cannot connect to dsecd" in r.stderr, r.stderr
    assert missing in _one_json_error(r, "unreachable")["message"]
    r = subprocess.run(_dsec("--socket", missing, "ps"), capture_output=True, timeout=30)
    assert (r.returncode, r.stdout) == (1, b"") and r.stderr.startswith(b"dsec: cannot connect"), r.stderr


def test_json_usage_errors_print_the_error(daemon):
    r = daemon.cli("--json", "rm")
    assert r.returncode == 2 and b"give sandbox ids" in r.stderr
    assert "give sandbox ids" in _one_json_error(r, "bad_request")["message"]
    r = daemon.cli("create", "--json")                           # argparse's: --image is required
    assert r.returncode == 2 and b"--image" in r.stderr
    assert "--image" in _one_json_error(r, "bad_request")["message"]
    r = daemon.cli("--json", "exec", "nosuch")
    assert r.returncode == 125 and "give a command" in _one_json_error(r, "bad_request")["message"]
    r = daemon.cli("exec", "nosuch", "--", "echo", "--json")      # the command's --json, not dsec's
    assert (r.returncode, r.stdout) == (125, b"") and b"not_found" in r.stderr


def test_run_of_an_image_without_a_command_says_the_cli_form(daemon):
    r = daemon.cli("run", "busybox")
    assert (r.returncode, r.stdout) == (125, b""), r.stderr
    assert b"after the image's name: dsec run busybox COMMAND" in r.stderr and b"args=" not in r.stderr, r.stderr
    r = daemon.cli("--json", "run", "busybox")
    assert r.returncode == 125
    err = _one_json_error(r, "bad_request")
    assert "dsec run busybox COMMAND" in err["message"] and "args=" not in err["message"], err


def test_run_detached_leaves_its_command_running_in_a_sandbox_that_stays(daemon):
    r = daemon.cli("--json", "run", "-d", "-e", "K=V", "--label", "run=detached", "busybox", "--",
                   "sh", "-c", "echo up $K; sleep 600")
    assert r.returncode == 0, r.stderr
    started = json.loads(r.stdout)
    sb, pid = started["sandbox"], started["pid"]
    try:
        deadline = time.monotonic() + 10
        while daemon.cli("logs", sb, str(pid)).stdout != b"up V\n":
            assert time.monotonic() < deadline, daemon.cli("logs", sb, str(pid))
            time.sleep(0.1)
        procs = json.loads(daemon.cli("proc", "ls", sb, "--json").stdout)
        assert [(p["pid"], p["state"]) for p in procs] == [(pid, "running")], procs
        r = daemon.cli("run", "-d", "busybox", "sleep", "600")        # text: the id alone on stdout
        assert r.returncode == 0 and f"dsec logs {r.stdout.decode().strip()} ".encode() in r.stderr, r.stderr
        daemon.cli("rm", "-f", r.stdout.decode().strip())
        # A command that cannot start leaves no sandbox behind.
        r = daemon.cli("--json", "run", "-d", "--label", "run=detached", "busybox", "--", "/no/such/program")
        assert r.returncode == 127 and _one_json_error(r, "not_found")["detail"]["argv0"] == "/no/such/program"
        listed = json.loads(daemon.cli("ps", "--label", "run=detached", "--json").stdout)
        assert [s["id"] for s in listed] == [sb], listed
    finally:
        daemon.cli("rm", "-f", sb)


def test_json_cp_and_image_rm_print_their_result(daemon, tmp_path):
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    try:
        src = tmp_path / "f.txt"
        src.write_text("hi\n")
        r = daemon.cli("--json", "cp", str(src), f"{sb}:/work/f.txt")
        assert r.returncode == 0 and json.loads(r.stdout)["size"] == 3, (r.stdout, r.stderr)
        r = daemon.cli("--json", "cp", f"{sb}:/work/f.txt", "-")
        assert r.returncode == 0 and json.loads(r.stdout)["data"] == "hi\n", (r.stdout, r.stderr)
        r = daemon.cli("--json", "cp", f"{sb}:/work/nosuch", str(tmp_path / "x"))
        assert r.returncode == 1 and _one_json_error(r, "not_found")
        r = daemon.cli("--json", "image", "rm", "nosuch-image")
        assert r.returncode == 1 and _one_json_error(r, "not_found")
    finally:
        daemon.cli("rm", "-f", sb)


def test_create_and_run_take_a_disk_cap(daemon):
    upperfs = json.loads(daemon.cli("--json", "info").stdout)["features"]["upperfs"]["available"]
    r = daemon.cli("create", "--image", "busybox", "--disk", "64M")
    if not upperfs:              # the daemon's refusal, not a usage error
        assert r.returncode == 1 and b"unsupported" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    sb = r.stdout.decode().strip()
    try:
        assert json.loads(daemon.cli("inspect", sb).stdout)["limits"]["disk"] == 64 << 20
    finally:
        daemon.cli("rm", "-f", sb)
    r = daemon.cli("run", "--no-rm", "--disk", "64M", "busybox", "--", "true")
    assert r.returncode == 0, r.stderr
    sb = r.stderr.decode().split("sandbox ", 1)[1].split()[0]          # "dsec run: sandbox ID (kept: --no-rm)"
    try:
        assert json.loads(daemon.cli("inspect", sb).stdout)["limits"]["disk"] == 64 << 20
    finally:
        daemon.cli("rm", "-f", sb)


def test_usage_and_value_errors_name_the_command(daemon):
    """An unknown word is the subcommand's usage error; a negative size or
    number reaches the daemon, whose check says what is wrong with it."""
    r = daemon.cli("create", "--image", "busybox", "--bogus", "1T")
    assert r.returncode == 2 and b"usage: dsec create" in r.stderr and b"--bogus" in r.stderr, r.stderr
    r = daemon.cli("ps", "nosuch")
    assert r.returncode == 2 and b"usage: dsec ps" in r.stderr and b"nosuch" in r.stderr, r.stderr
    before = json.loads(daemon.cli("ps", "--json").stdout)
    r = daemon.cli("create", "--image", "busybox", "--memory", "-5M")
    assert r.returncode == 1 and b"bad_request: memory" in r.stderr and b"-5M" in r.stderr, r.stderr
    r = daemon.cli("create", "--image", "busybox", "--pids", "-5")
    assert r.returncode == 1 and b"pids must be between" in r.stderr, r.stderr
    assert json.loads(daemon.cli("ps", "--json").stdout) == before


def test_cp_into_a_directory_and_errors_that_name_the_users_path(daemon, tmp_path):
    """As cp(1): an existing directory, or a symlink to one, receives the copy
    under the source's name; a failure names the path given, never dsec's
    temporary files."""
    small = tmp_path / "small.txt"
    small.write_text("small\n")
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    try:
        r = daemon.cli("cp", str(small), f"{sb}:/etc")
        assert r.returncode == 0, r.stderr
        assert daemon.cli("cat", f"{sb}:/etc/small.txt").stdout == b"small\n"
        r = daemon.cli("--json", "cp", str(small), f"{sb}:/work/")     # a trailing / as before
        assert r.returncode == 0 and json.loads(r.stdout)["path"] == "/work/small.txt", r.stderr
        r = daemon.cli("cp", "-", f"{sb}:/etc", input=b"x")         # a directory takes a tar, as docker cp -
        assert r.returncode == 1 and b"not a valid archive" in r.stderr, r.stderr
        assert b"name a file to write stdin's bytes to: SB:/etc/NAME" in r.stderr
        r = daemon.cli("exec", sb, "--", "sh", "-c", "mkdir /d; ln -s /d /to-dir; echo f > /f; ln -s /f /to-file")
        assert r.returncode == 0, r.stderr
        r = daemon.cli("cp", str(small), f"{sb}:/to-dir")            # a symlink to a directory: into it
        assert r.returncode == 0 and daemon.cli("cat", f"{sb}:/d/small.txt").stdout == b"small\n", r.stderr
        r = daemon.cli("cp", str(small), f"{sb}:/to-file")           # to anything else: replaced
        assert r.returncode == 0 and daemon.cli("cat", f"{sb}:/f").stdout == b"f\n", r.stderr
        assert daemon.cli("cat", f"{sb}:/to-file").stdout == b"small\n"

        r = daemon.cli("cp", str(small), f"{sb}:/proc/version")      # its copy cannot be made in /proc
        assert r.returncode == 1 and b"/proc/version" in r.stderr and b".dsec-" not in r.stderr, r.stderr
        for local in (tmp_path / "nonexist-dir" / "x", Path("/proc/version")):
            r = daemon.cli("cp", f"{sb}:/etc/passwd", str(local))
            assert r.returncode == 1 and str(local).encode() in r.stderr, r.stderr
            assert b".dsec-tmp" not in r.stderr, r.stderr
        r = daemon.cli("--json", "cp", f"{sb}:/etc/passwd", str(tmp_path / "nonexist-dir" / "x"))
        assert _one_json_error(r, "not_found")["detail"]["path"] == str(tmp_path / "nonexist-dir" / "x")
        assert not (tmp_path / "nonexist-dir").exists()

        r = daemon.cli("cp", "-r", str(tmp_path / "nonexist"), f"{sb}:/work")
        assert r.returncode == 1 and b"No such file or directory" in r.stderr, r.stderr
        assert str(tmp_path / "nonexist").encode() in r.stderr and b"is not a directory" not in r.stderr
        r = daemon.cli("cp", "-r", str(small), f"{sb}:/work")       # a file, copied as cp -r copies one
        assert r.returncode == 0, r.stderr
        assert daemon.cli("cat", f"{sb}:/work/small.txt").stdout == small.read_bytes()
    finally:
        daemon.cli("rm", "-f", sb)


def test_cat_goes_on_past_a_file_it_cannot_read(daemon):
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    try:
        r = daemon.cli("exec", sb, "--", "sh", "-c", "echo A > /a; echo B > /b")
        assert r.returncode == 0, r.stderr
        r = daemon.cli("cat", f"{sb}:/a", f"{sb}:/nope", f"{sb}:/b")
        assert (r.returncode, r.stdout) == (1, b"A\nB\n"), r.stderr
        assert r.stderr.count(b"dsec cat: not_found") == 1 and b"/nope" in r.stderr, r.stderr
        r = daemon.cli("--json", "cat", f"{sb}:/a", f"{sb}:/nope", f"{sb}:/b")
        lines = [json.loads(line) for line in r.stdout.splitlines()]
        assert r.returncode == 1 and [x.get("data") for x in lines] == ["A\n", None, "B\n"], r.stdout
        assert lines[1]["error"]["code"] == "not_found" and lines[1]["error"]["detail"]["path"].endswith("/nope")
        r = daemon.cli("cat", f"{sb}:/a", "nosuch:/b")         # a sandbox that is not there: the same
        assert (r.returncode, r.stdout) == (1, b"A\n") and b"nosuch" in r.stderr, r.stderr
    finally:
        daemon.cli("rm", "-f", sb)


def test_exec_user_takes_a_name(daemon):
    """As docker exec --user, a uid with an /etc/passwd line takes its gid and
    home; one without has a gid of the same number (docker's would be 0: no
    unknown user gets root's group here) and HOME=/."""
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    try:
        assert daemon.cli("exec", sb, "--", "sh", "-c", "echo 'svc:x:1002:50:svc:/home/svc:/bin/sh' >> /etc/passwd"
                          ).returncode == 0
        assert daemon.cli("exec", sb, "--user", "nobody", "--", "id", "-u").stdout == b"65534\n"
        assert daemon.cli("exec", sb, "--user", "1000", "--", "sh", "-c", "id -g; echo $HOME").stdout == b"1000\n/\n"
        for user in ("svc", "1002"):
            r = daemon.cli("exec", sb, "--user", user, "--", "sh", "-c", "id -u; id -g; echo $HOME")
            assert r.stdout == b"1002\n50\n/home/svc\n", (user, r)
        r = daemon.cli("exec", sb, "--user", "ghost", "--", "true")
        assert r.returncode == 125 and b"ghost" in r.stderr, r
    finally:
        daemon.cli("rm", sb)


def test_an_exec_killed_by_the_memory_limit_says_so(daemon):
    sb = daemon.cli("create", "--image", "busybox", "--memory", "32M").stdout.decode().strip()
    try:
        hog = ["sh", "-c", 'x=aaaaaaaaaaaaaaaa; while :; do x="$x$x"; done']
        r = daemon.cli("exec", sb, "--", *hog)
        assert r.returncode == 137 and b"dsec: killed: the sandbox reached its memory limit" in r.stderr, r
        r = daemon.cli("exec", "--json", sb, "--", *hog)
        assert json.loads(r.stdout)["killed_by"] == "oom"
    finally:
        daemon.cli("rm", sb)


def test_exec_i_ends_with_its_command_not_with_our_stdin(daemon):
    """`sleep 8 | dsec exec -i SB -- sh -c 'echo quick; exit 3'` ends when sh
    does, as `docker exec -i` does, not when our stdin closes."""
    sb = daemon.cli("create", "--image", "busybox").stdout.decode().strip()
    p = subprocess.Popen([str(VENV_BIN / "dsec"), "--socket", daemon.socket, "exec", "-i", sb, "--",
                          "sh", "-c", "echo quick; exit 3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.wait(timeout=15) == 3          # our stdin is still open
        assert p.stdout.read() == b"quick\n"
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()
        assert daemon.cli("rm", "--force", sb).returncode == 0


def test_output_that_cannot_be_written_is_an_error_never_a_short_file(daemon, client):
    """A file's bytes to a reader that left end in a quiet 141, to a full
    disk in an error, never in a silent short write; so does a command's
    stderr whose reader left."""
    sb = client.create(image="busybox")
    dsec = [str(VENV_BIN / "dsec"), "--socket", daemon.socket]
    try:
        sb.exec(["sh", "-c", "head -c 3000000 /dev/zero > /big"])
        for argv in (["cat", f"{sb.id}:/big"], ["cp", f"{sb.id}:/big", "-"]):
            p = subprocess.run(["bash", "-c", '"$@" | head -c 10 > /dev/null; exit "${PIPESTATUS[0]}"', "-",
                                *dsec, *argv], capture_output=True, timeout=60)
            assert (p.returncode, p.stderr) == (141, b""), argv
            with open("/dev/full", "wb") as full:
                p = subprocess.run([*dsec, *argv], stdout=full, stderr=subprocess.PIPE, timeout=60)
            assert p.returncode == 1 and b"No space left on device" in p.stderr, (argv, p.stderr)
        p = subprocess.run(["bash", "-c", '"$@" 2>&1 >/dev/null | head -1 > /dev/null; exit "${PIPESTATUS[0]}"',
                            "-", *dsec, "exec", sb.id, "--", "sh", "-c", "yes >&2"], timeout=60)
        assert p.returncode == 141
    finally:
        sb.destroy(force=True)


def test_cp_out_keeps_a_files_permission_bits_but_never_setuid(daemon, client, tmp_path):
    """As docker cp: a file's mode comes with it; a sandbox's setuid or
    setgid bit does not (the copy belongs to whoever ran dsec)."""
    sb = client.create(image="busybox")
    try:
        sb.exec(["sh", "-c", "echo x > /f && chmod 750 /f && cp /f /s && chmod 6755 /s"])
        for name, want in (("f", 0o750), ("s", 0o755)):
            assert daemon.cli("cp", f"{sb.id}:/{name}", str(tmp_path)).returncode == 0
            assert (tmp_path / name).stat().st_mode & 0o7777 == want, name
    finally:
        sb.destroy(force=True)


def test_cp_out_of_a_symlink_gives_what_cp_gives(daemon, client, tmp_path):
    """As cp(1): a plain copy follows a symlink named as the source, inside
    the sandbox, and gives its target's content and permission bits (never
    a host symlink a sandbox could aim at the host's own files); with -r or
    -P it comes out as a symlink with the same target, dangling or not, as
    cp -a and docker cp give it; -L follows it with -r too."""
    sb = client.create(image="busybox")
    try:
        sb.exec(["sh", "-c", "mkdir -p /t/sub && echo hi > /t/f && chmod 751 /t/f && ln -s f /t/lf && "
                             "ln -s /t/f /t/abs && ln -s sub /t/ld && ln -s nowhere /t/dang && echo y > /t/sub/y && "
                             "ln -s /etc/hostname /t/host && echo sandbox-name > /etc/hostname"])
        out = tmp_path / "host"
        assert daemon.cli("cp", f"{sb.id}:/t/host", str(out)).returncode == 0
        assert not out.is_symlink() and out.read_text() == "sandbox-name\n"      # the sandbox's, not ours
        for name, target in (("lf", "f"), ("abs", "/t/f"), ("ld", "sub"), ("dang", "nowhere")):
            for flags in (["-P"], ["-r"]):
                out = tmp_path / f"{name}{''.join(flags)}"
                r = daemon.cli("cp", *flags, f"{sb.id}:/t/{name}", str(out))
                assert r.returncode == 0, (name, flags, r.stderr)
                assert out.is_symlink() and os.readlink(out) == target, (name, flags)
        (tmp_path / "into").mkdir()
        r = daemon.cli("cp", "-P", "--json", f"{sb.id}:/t/lf", str(tmp_path / "into"))
        assert r.returncode == 0 and json.loads(r.stdout)["target"] == "f", r
        assert os.readlink(tmp_path / "into" / "lf") == "f"
        for name, flags in (("lf", []), ("abs", []), ("lf", ["-L"]), ("abs", ["-r", "-L"])):
            out = tmp_path / f"{name}-followed{''.join(flags)}"
            assert daemon.cli("cp", *flags, f"{sb.id}:/t/{name}", str(out)).returncode == 0
            assert not out.is_symlink() and out.read_text() == "hi\n"
            assert out.stat().st_mode & 0o7777 == 0o751, name
        assert daemon.cli("cp", "-r", "-L", f"{sb.id}:/t/ld", str(tmp_path / "ld-L")).returncode == 0
        assert (tmp_path / "ld-L" / "y").read_text() == "y\n"
        assert daemon.cli("cp", "-r", f"{sb.id}:/t", str(tmp_path / "tree")).returncode == 0
        assert os.readlink(tmp_path / "tree" / "lf") == "f"
        assert (tmp_path / "tree" / "f").stat().st_mode & 0o7777 == 0o751
        r = daemon.cli("cp", f"{sb.id}:/t/dang", str(tmp_path / "dang-L"))
        assert r.returncode == 1 and b"/t/dang" in r.stderr and b"No such file" in r.stderr, r
        sb.exec(["sh", "-c", "ln -s \"$(printf '\\377')x\" /t/raw"])       # a target that is not UTF-8
        assert daemon.cli("cp", "-P", f"{sb.id}:/t/raw", str(tmp_path / "raw")).returncode == 0
        assert os.readlink(os.fsencode(tmp_path / "raw")) == b"\xffx"
    finally:
        sb.destroy(force=True)


def test_cp_into_a_sandbox_of_a_symlink_gives_what_cp_gives(daemon, client, tmp_path):
    """The same rules into a sandbox: with -r or -P a host symlink named as
    the source arrives as a symlink with the same target (it sent its
    target's bytes, or -r of a link to a directory failed); a plain copy,
    -L or LINK/ follow it, dsec reading the target; a link inside a copied
    tree stays a link, /etc/shadow's never sent."""
    sb = client.create(image="busybox")
    try:
        src = tmp_path / "src"
        (src / "sub").mkdir(parents=True)
        (src / "f").write_text("hi\n")
        (src / "f").chmod(0o751)
        (src / "sub" / "y").write_text("y\n")
        for name, target in (("lf", "f"), ("ld", "sub"), ("dang", "nowhere"), ("shadow", "/etc/shadow"),
                             ("raw", os.fsdecode(b"\xffx"))):
            (src / name).symlink_to(target)
        sb.exec(["mkdir", "/in"])
        for name, target in (("lf", "f"), ("ld", "sub"), ("dang", "nowhere"), ("shadow", "/etc/shadow"),
                             ("raw", os.fsdecode(b"\xffx"))):          # the SDK's stat: os.fsdecode's str
            for flags in (["-P"], ["-r"]):
                dst = f"/in/{name}{''.join(flags)}"
                r = daemon.cli("cp", *flags, str(src / name), f"{sb.id}:{dst}")
                assert r.returncode == 0, (name, flags, r.stderr)
                st = sb.stat(dst)
                assert (st["type"], st["target"]) == ("symlink", target), (name, flags, st)
        r = daemon.cli("cp", "-P", "--json", str(src / "lf"), f"{sb.id}:/in")          # into a directory
        assert r.returncode == 0 and json.loads(r.stdout)["target"] == "f", r
        assert sb.stat("/in/lf")["target"] == "f"
        for flags in ([], ["-L"], ["-r", "-L"]):
            dst = f"/in/lf-followed{''.join(flags)}"
            assert daemon.cli("cp", *flags, str(src / "lf"), f"{sb.id}:{dst}").returncode == 0
            st = sb.stat(dst)
            assert st["type"] == "file" and st["mode"] & 0o7777 == 0o751 and sb.read_file(dst) == b"hi\n"
        for flags, name in ((["-r", "-L"], "ld"), (["-r"], "ld/")):
            r = daemon.cli("cp", *flags, f"{src}/{name}", f"{sb.id}:/in/ld-followed{len(flags)}")
            assert r.returncode == 0, r.stderr
            assert sb.read_file(f"/in/ld-followed{len(flags)}/y") == b"y\n"
        assert daemon.cli("cp", "-r", str(src), f"{sb.id}:/tree").returncode == 0
        assert sb.stat("/tree/shadow")["target"] == "/etc/shadow" and sb.stat("/tree/ld")["type"] == "symlink"
        r = daemon.cli("cp", str(src / "dang"), f"{sb.id}:/in/dang-followed")
        assert r.returncode == 1 and b"dang" in r.stderr and b"No such file" in r.stderr, r
        sb.exec(["mkdir", "-p", "/in/d/lf"])
        r = daemon.cli("cp", "-P", str(src / "lf"), f"{sb.id}:/in/d")          # a directory of that name there
        assert r.returncode == 1 and b"/in/d/lf: Is a directory" in r.stderr and b".dsec" not in r.stderr, r
        r = daemon.cli("cp", "-P", str(src / "lf"), f"{sb.id}:/proc/")
        assert r.returncode == 1 and b"/proc/lf" in r.stderr and b".dsec" not in r.stderr, r
    finally:
        sb.destroy(force=True)


def test_a_failed_merge_into_a_directory_names_that_directory(daemon, client, tmp_path):
    """`dsec cp -r DIR SB:/work` into an existing /work/DIR that fails (its
    disk full) named the copy's landing directory, `.dsec-cp-<pid>-<hex>`,
    a name the user never gave and that is gone by then."""
    sb = client.create(image="busybox", memory="128M", disk="4M")
    try:
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "big").write_bytes(os.urandom(6 << 20))
        sb.mkdir("/work/sub")
        r = daemon.cli("cp", "-r", str(tmp_path / "sub"), f"{sb.id}:/work")
        assert r.returncode == 1 and b"/work/sub: No space left" in r.stderr and b".dsec" not in r.stderr, r
        assert sb.list_files("/work/sub") == []
    finally:
        sb.destroy(force=True)


def test_ls_of_a_file_or_symlink_lists_that_entry_as_ls_does(daemon, client):
    """It failed with `not_found: ... Not a directory`, for a file that is there."""
    sb = client.create(image="busybox")
    try:
        sb.exec(["sh", "-c", "echo hi > /f && ln -s f /lf"])
        for name, kind in (("f", "file"), ("lf", "symlink")):
            r = daemon.cli("ls", "--json", f"{sb.id}:/{name}")
            assert r.returncode == 0, r.stderr
            [entry] = json.loads(r.stdout)
            assert (entry["name"], entry["type"]) == (name, kind)
        r = daemon.cli("ls", f"{sb.id}:/f")
        assert r.returncode == 0 and r.stdout.split(b"\n")[1].split()[0] == b"file", r
        r = daemon.cli("ls", f"{sb.id}:/f/below")
        assert r.returncode == 1 and b"list " in r.stderr and b"Not a directory" in r.stderr, r
        sb.exec(["ln", "-s", "nowhere", "/dang"])             # a dangling link: ls lists the link too
        r = daemon.cli("ls", "--json", f"{sb.id}:/dang")
        assert r.returncode == 0 and [(e["name"], e["type"]) for e in json.loads(r.stdout)] == \
            [("dang", "symlink")], r
        r = daemon.cli("ls", f"{sb.id}:/nowhere")
        assert r.returncode == 1 and b"list " in r.stderr and b"No such file" in r.stderr, r
    finally:
        sb.destroy(force=True)


def test_a_cp_ended_by_sigterm_leaves_no_temporary_file_in_the_sandbox(daemon, client, tmp_path):
    """`timeout 60 dsec cp BIG SB:/dir/` that ran out left the upload's
    `.dsec-<hex>` part in /dir: SIGTERM killed dsec before it removed it."""
    sb = client.create(image="busybox", memory="1G")
    try:
        sb.mkdir("/dir")
        big = tmp_path / "big"
        big.write_bytes(os.urandom(1 << 20) * 300)
        p = subprocess.Popen([str(VENV_BIN / "dsec"), "--socket", daemon.socket, "cp", str(big), f"{sb.id}:/dir/"],
                             stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not sb.list_files("/dir"):
            assert time.monotonic() < deadline and p.poll() is None, p.poll()
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        if p.returncode == 0:
            pytest.skip("the copy ended before the signal came")
        assert p.returncode == 128 + signal.SIGTERM and b"SIGTERM: the copy was cancelled" in err, (p.returncode, err)
        assert sb.list_files("/dir") == []
    finally:
        sb.destroy(force=True)


def test_cp_and_cat_say_what_to_do_with_a_directory_and_take_r_for_a_file(daemon, client, tmp_path):
    """cp -r copies a file as cp(1) does; a directory read as a file, and a
    missing directory as the destination, say what to do."""
    sb = client.create(image="busybox")
    try:
        (tmp_path / "f").write_text("local\n")
        assert daemon.cli("cp", "-r", str(tmp_path / "f"), f"{sb.id}:/f").returncode == 0
        assert daemon.cli("cp", "-r", f"{sb.id}:/f", str(tmp_path / "back")).returncode == 0
        assert (tmp_path / "back").read_text() == "local\n"
        sb.exec(["ln", "-s", "/f", "/f-link"])
        assert daemon.cli("cp", "-r", "-L", f"{sb.id}:/f-link", str(tmp_path / "via-link")).returncode == 0
        assert (tmp_path / "via-link").read_text() == "local\n"
        for argv in (["cat", f"{sb.id}:/etc"], ["cp", f"{sb.id}:/etc", str(tmp_path / "etc")]):
            r = daemon.cli(*argv)
            assert r.returncode == 1 and b"/etc is a directory" in r.stderr and b"dsec cp -r" in r.stderr, r
        r = daemon.cli("cp", f"{sb.id}:/f", str(tmp_path / "newd") + "/")
        assert r.returncode != 0 and b"newd/: no such directory" in r.stderr, r
        pid = sb.spawn("sleep 60").pid
        r = daemon.cli("kill", sb.id, str(pid), "--signal", "0")
        assert r.returncode == 1 and b"signal 0 sends nothing" in r.stderr, r
    finally:
        sb.destroy(force=True)


def test_cp_r_of_dir_dot_copies_its_contents_into_an_existing_directory(daemon, client, tmp_path):
    """docker cp's `SRC/.`: the contents of SRC go into DST, both ways,
    merged into what DST holds; a directory against a file is refused
    before anything moves."""
    sb = client.create(image="busybox")
    try:
        src = tmp_path / "src"
        (src / "sub").mkdir(parents=True)
        (src / "a.txt").write_text("a\n")
        (src / "sub" / "b.txt").write_text("b\n")
        (src / "link").symlink_to("a.txt")
        sb.exec(["mkdir", "-p", "/dst"])
        assert daemon.cli("cp", "-r", f"{src}/.", f"{sb.id}:/dst").returncode == 0
        assert sb.exec(["sh", "-c", "cd /dst && ls -A && cat a.txt sub/b.txt && readlink link"]).stdout == \
            b"a.txt\nlink\nsub\na\nb\na.txt\n"
        # Again, changed on both sides: merged, files replaced, what only DST holds kept.
        (src / "a.txt").write_text("a2\n")
        (src / "sub" / "c.txt").write_text("c\n")
        sb.exec(["sh", "-c", "echo keep > /dst/sub/keep"])
        assert daemon.cli("cp", "-r", f"{src}/.", f"{sb.id}:/dst").returncode == 0
        assert sb.exec(["sh", "-c", "cd /dst && ls -A . sub && cat a.txt sub/keep"]).stdout == \
            b".:\na.txt\nlink\nsub\n\nsub:\nb.txt\nc.txt\nkeep\na2\nkeep\n"
        sb.exec(["sh", "-c", "rm /dst/sub/b.txt && mkdir /dst/sub/b.txt"])
        (src / "a.txt").write_text("a3\n")
        r = daemon.cli("cp", "-r", f"{src}/.", f"{sb.id}:/dst")
        assert r.returncode == 1 and b"cannot overwrite directory with non-directory" in r.stderr, r
        assert sb.exec(["sh", "-c", "cat /dst/a.txt; ls -A /dst"]).stdout == b"a2\na.txt\nlink\nsub\n"
        sb.exec(["rmdir", "/dst/sub/b.txt"])
        # A directory copied onto its namesake merges into it too.
        assert daemon.cli("cp", "-r", str(src), f"{sb.id}:/").returncode == 0
        assert daemon.cli("cp", "-r", str(src), f"{sb.id}:/").returncode == 0
        assert sb.exec(["sh", "-c", "ls -A /src /src/sub"]).stdout == \
            b"/src:\na.txt\nlink\nsub\n\n/src/sub:\nb.txt\nc.txt\n"
        back = tmp_path / "back"
        back.mkdir()
        (back / "kept").write_text("k\n")
        assert daemon.cli("cp", "-r", f"{sb.id}:/dst/.", str(back)).returncode == 0
        assert sorted(p.name for p in back.iterdir()) == ["a.txt", "kept", "link", "sub"]
        assert (back / "sub" / "keep").read_text() == "keep\n" and os.readlink(back / "link") == "a.txt"
        assert sb.exec(["ls", "-A", "/dst"]).stdout == b"a.txt\nlink\nsub\n"     # no landing dir left
        (back / "a.txt").write_text("old\n")
        r = daemon.cli("--json", "cp", "-r", f"{sb.id}:/dst/.", str(back))
        assert r.returncode == 0 and json.loads(r.stdout)["replaced"] == 4, r     # a.txt, link, sub/c.txt, sub/keep
        assert (back / "a.txt").read_text() == "a2\n" and (back / "kept").read_text() == "k\n"
        (back / "sub" / "keep").unlink()
        (back / "sub" / "keep").mkdir()
        r = daemon.cli("cp", "-r", f"{sb.id}:/dst/.", str(back))
        assert r.returncode == 1 and b"cannot overwrite directory with non-directory" in r.stderr, r
        assert sorted(p.name for p in back.iterdir()) == ["a.txt", "kept", "link", "sub"]     # no landing dir left
        # What a directory copy leaves out (a FIFO) is said, and the rest all comes.
        sb.exec(["sh", "-c", "mkdir -m 555 /s && cd /s && echo x > a && mkfifo b && echo y > c"])
        more = tmp_path / "more"
        more.mkdir()
        r = daemon.cli("cp", "-r", f"{sb.id}:/s/.", str(more))
        assert r.returncode == 0 and b"not copied: /s/b (fifo)" in r.stderr, r
        assert sorted(p.name for p in more.iterdir()) == ["a", "c"]
    finally:
        sb.destroy(force=True)



def _json_lines(out: bytes) -> list[dict]:
    """What a command that takes several sandboxes prints with --json: one
    JSON object per line, each sandbox's result or error."""
    return [json.loads(line) for line in out.decode().splitlines()]


def test_pause_and_resume_go_on_past_a_sandbox_they_cannot_take(daemon, client):
    a, b = client.create(image="busybox"), client.create(image="busybox")
    try:
        r = daemon.cli("pause", a.id, "nosuch", b.id)
        assert r.returncode == 1 and b"nosuch" in r.stderr
        assert a.inspect()["state"] == "paused" and b.inspect()["state"] == "paused"
        r = daemon.cli("--json", "resume", "nosuch", a.id, b.id)
        assert r.returncode == 1
        assert a.inspect()["state"] == "running" and b.inspect()["state"] == "running"
        objs = _json_lines(r.stdout)
        assert objs[0]["error"]["code"] == "not_found" and objs[0]["error"]["detail"]["sandbox"] == "nosuch"
        assert [o["id"] for o in objs[1:]] == [a.id, b.id]
    finally:
        a.destroy()
        b.destroy()


def test_json_rm_of_several_sandboxes_prints_a_line_for_each(daemon, client):
    a, b = client.create(image="busybox"), client.create(image="busybox")
    try:
        a.write_file("/tmp/f", b"x")
        r = daemon.cli("--json", "rm", f"{a.id}:/tmp/f", f"{a.id}:/tmp/nosuch")
        assert r.returncode == 1
        done, failed = _json_lines(r.stdout)
        assert failed["error"]["detail"]["path"].endswith("/tmp/nosuch") and "error" not in done, r.stdout
        r = daemon.cli("--json", "rm", a.id, "nosuch", b.id)
        assert r.returncode == 1
        objs = _json_lines(r.stdout)
        assert [o.get("id") or o["error"]["detail"]["sandbox"] for o in objs] == [a.id, "nosuch", b.id], objs
    finally:
        for sb in (a, b):
            with contextlib.suppress(Exception):
                sb.destroy()


def test_rm_f_of_a_missing_path_is_no_failure_as_rm_f(daemon, client):
    sb = client.create(image="busybox")
    try:
        sb.exec(["sh", "-c", "mkdir -p /work/d/e && echo x > /work/f"])
        r = daemon.cli("rm", "-rf", f"{sb.id}:/work/d", f"{sb.id}:/work/nosuch", f"{sb.id}:/no/such/dir")
        assert (r.returncode, r.stdout, r.stderr) == (0, b"", b""), r
        assert [e["name"] for e in sb.list_files("/work")] == ["f"]
        r = daemon.cli("rm", f"{sb.id}:/work/nosuch")          # without -f: said, and a failure
        assert r.returncode == 1 and b"No such file or directory" in r.stderr, r
        r = daemon.cli("rm", "-f", f"{sb.id}:/work/f/x")       # not a directory: as rm -f, a failure
        assert r.returncode == 1 and b"Not a directory" in r.stderr, r
        r = daemon.cli("rm", "-f", "nosuch:/work/f")           # no such sandbox: a failure
        assert r.returncode == 1 and b"no sandbox 'nosuch'" in r.stderr, r
    finally:
        sb.destroy()


def test_cp_r_of_a_directory_to_stdout_is_a_tar_not_a_directory_named_dash(daemon, client, tmp_path):
    import io
    import tarfile

    def cp(*args):          # from tmp_path, where a directory named "-" would land
        return subprocess.run([str(VENV_BIN / "dsec"), "--socket", daemon.socket, "cp", *args], cwd=tmp_path,
                              capture_output=True, timeout=60)

    sb = client.create(image="busybox")
    try:
        r = cp("-r", f"{sb.id}:/etc", "-")                  # as docker cp SB:/etc -
        assert r.returncode == 0, r
        assert "etc/passwd" in tarfile.open(fileobj=io.BytesIO(r.stdout)).getnames()
        assert not (tmp_path / "-").exists()
        r = cp("-r", f"{sb.id}:/etc/passwd", "-")           # a file: its bytes, as before
        assert r.returncode == 0 and r.stdout.startswith(b"root:"), r
    finally:
        sb.destroy()


def test_renew_keeps_a_leased_sandbox_and_says_what_it_could_not_renew(daemon, client):
    """A sandbox made with `dsec create --lease` could be renewed only from
    the SDK; `dsec renew` does it, by id prefix too."""
    leased = client.create(image="busybox", lease="3s")
    plain = client.create(image="busybox")
    try:
        for _ in range(3):                      # 4.5 s in all: past its lease, renewed within it
            time.sleep(1.5)
            r = daemon.cli("renew", leased.id[:8])
            assert (r.returncode, r.stdout) == (0, f"{leased.id} renewed\n".encode()), r
        assert leased.inspect()["state"] == "running"
        r = daemon.cli("renew", plain.id)                  # lives on without one: no failure
        assert r.returncode == 0 and f"{plain.id} has no lease to renew".encode() in r.stderr, r
        r = daemon.cli("--json", "renew", leased.id, plain.id, "nosuch")
        assert r.returncode == 1
        assert b"nosuch" in r.stderr and f"{plain.id} has no lease to renew".encode() in r.stderr, r.stderr
        *errors, answer = _json_lines(r.stdout)
        assert [e["error"]["detail"]["sandbox"] for e in errors] == ["nosuch"], errors
        assert answer == {"renewed": [leased.id], "missing": [], "no_lease": [plain.id]}, answer
    finally:
        leased.destroy()
        plain.destroy()
