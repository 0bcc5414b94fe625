"""`dsec`'s command line without a daemon: where options may stand, --json
after any command, usage exit codes, and the messages of a refused socket."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsecd import cli
from dsecd.clitext import create_args
from dsecd.config import parse_duration
from dsecd.errors import BadRequest, DsecError, NotFound

DSEC = [sys.executable, "-m", "dsecd.cli"]


@pytest.mark.parametrize("words,positionals,want", [
    (["SB", "--", "ls", "-l"], 1, (["SB"], ["ls", "-l"])),
    (["SB", "--timeout", "2", "--", "sleep", "10"], 1, (["SB", "--timeout", "2"], ["sleep", "10"])),
    (["--timeout", "2", "SB", "sleep", "10"], 1, (["--timeout", "2", "SB"], ["sleep", "10"])),
    (["SB", "-i", "--user", "5", "cat", "-n"], 1, (["SB", "-i", "--user", "5"], ["cat", "-n"])),
    (["SB", "--timeout=2", "sh", "-c", "x --"], 1, (["SB", "--timeout=2"], ["sh", "-c", "x --"])),
    (["SB", "-o", "f", "--", "true"], 1, (["SB", "-o", "f"], ["true"])),
    (["SB", "--env", "--", "--", "true"], 1, (["SB", "--env", "--"], ["true"])),   # "--" as a value
    (["--image", "img", "--", "echo", "hi"], 0, (["--image", "img"], ["echo", "hi"])),
    (["--image", "img", "echo", "--image"], 0, (["--image", "img"], ["echo", "--image"])),
    (["SB"], 1, (["SB"], [])),
])
def test_split_command(words, positionals, want):
    assert cli.split_command(words, positionals) == want


def test_a_runs_unknown_options_after_the_image_are_its_command_as_dockers():
    a = cli.parse_args(["run", "--entrypoint", "/bin/sh", "busybox", "-c", "echo hi"])
    assert (a.image, a.entrypoint, a.argv) == ("busybox", "/bin/sh", ["-c", "echo hi"])
    a = cli.parse_args(["run", "app", "--version"])
    assert (a.image, a.argv) == ("app", ["--version"])
    a = cli.parse_args(["run", "busybox", "-i", "--timeout=5", "-c", "x"])      # its own still go first
    assert (a.interactive, a.timeout, a.argv) == (True, 5.0, ["-c", "x"])
    a = cli.parse_args(["run", "busybox", "-eK=V", "-i", "sh"])
    assert (a.env, a.interactive, a.argv) == (["K=V"], True, ["sh"])
    a = cli.parse_args(["run", "busybox", "-it", "sh"])       # run's -i and -t, run together
    assert (a.interactive, a.tty, a.argv) == (True, True, ["sh"])
    a = cli.parse_args(["run", "busybox", "-ix", "sh"])       # not all of them run's: the command's
    assert a.argv == ["-ix", "sh"]
    with pytest.raises(SystemExit):                         # before a "--": dsec's, mistyped
        cli.parse_args(["run", "busybox", "--bogus", "--", "true"])


def test_run_detach_keeps_the_sandbox_unless_rm_is_asked_for():
    a = cli.parse_args(["run", "-d", "busybox", "sleep", "9"])
    assert (a.detach, a.rm, a.argv) == (True, None, ["sleep", "9"])
    assert cli.parse_args(["run", "busybox", "true"]).rm is None      # cmd_run: removed unless --no-rm


@pytest.mark.parametrize("args, says", [
    (["run", "-d", "--rm", "busybox", "true"], "drop --rm"),
    (["run", "-d", "-t", "busybox", "sh"], "drop -t, -i and --timeout"),
    (["run", "-d", "--timeout", "5", "busybox", "sleep", "9"], "drop -t, -i and --timeout"),
])
def test_run_detach_usage_errors_say_what_to_drop(args, says):
    r = _dsec(*args)
    assert r.returncode == 125 and "dsec run: -d " in r.stderr and says in r.stderr, r.stderr


def _leaf_parsers(parser: argparse.ArgumentParser, path=()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaf_parsers(child, (*path, name))


def test_valued_options_match_the_parser():
    parser = cli.build_parser()
    leaves = dict(_leaf_parsers(parser))
    for verb in cli.RUNS_A_COMMAND:
        for action in leaves[(verb,)]._actions:
            for opt in action.option_strings:
                takes_value = action.nargs != 0
                assert (opt in cli.VALUED_OPTIONS) == takes_value, f"dsec {verb} {opt}"


# A valid argument list per command, to which --json is appended.
MINIMAL = {("image", "build"): ["d", "--name", "n"], ("image", "import"): ["d", "--name", "n"],
           ("image", "inspect"): ["n"], ("image", "rm"): ["n"], ("image", "pull"): ["r"], ("image", "tag"): ["s", "n"], ("image", "flatten"): ["n"],
           ("create",): ["--image", "i"], ("run",): ["i", "--", "true"],
           ("pool", "set"): ["--image", "i", "--min", "0", "--max", "1"], ("exec",): ["SB", "--", "true"],
           ("trace",): ["SB", "--", "true"], ("call",): ["--image", "i", "--", "true"], ("cp",): ["a", "b"],
           ("pause",): ["SB"], ("resume",): ["SB"], ("renew",): ["SB"], ("job", "pause"): ["j"], ("job", "resume"): ["j"],
           ("job", "rm"): ["j"], ("net", "show"): ["SB"], ("net", "set"): ["SB"], ("port",): ["SB", "8080"],
           ("snapshot",): ["SB", "--name", "n"], ("inspect",): ["SB"], ("ls",): ["SB:/x"], ("cat",): ["SB:/x"],
           ("watch",): ["SB:/x"],
           ("proc", "ls"): ["SB"], ("logs",): ["SB", "7"], ("attach",): ["SB", "7"], ("kill",): ["SB", "7"],
           ("wait",): ["SB", "7"], ("fleet",): ["--hosts", "h1,h2", "ps"]}


def test_json_is_accepted_before_and_after_every_command():
    for path, _ in _leaf_parsers(cli.build_parser()):
        args = [*path, *MINIMAL.get(path, [])]
        end = args.index("--") if "--" in args else len(args)       # after `--`: the command's words
        assert cli.parse_args([*args[:end], "--json", *args[end:]]).json is True, path
        assert cli.parse_args(["--json", *args]).json is True, path
        assert cli.parse_args(args).json is False, path
    # After `--` it is the command's, not dsec's.
    a = cli.parse_args(["exec", "SB", "--", "tool", "--json"])
    assert a.json is False and a.argv == ["tool", "--json"]


def test_global_options_with_values_stand_before_the_command():
    a = cli.parse_args(["--host", "ssh://h1", "--remote-dsec", "/opt/dsec", "exec", "SB", "--", "true"])
    assert (a.host, a.remote_dsec, a.cmd, a.argv, a.fleet) == ("ssh://h1", "/opt/dsec", "exec", ["true"], None)
    assert cli.find_verb(["--socket", "/s", "--ssh-config", "/c", "ps"]) == 4


def test_the_silence_timeout_reaches_the_client_and_off_turns_the_watch_off(monkeypatch):
    monkeypatch.delenv("DSEC_SILENCE_TIMEOUT", raising=False)
    a = cli.parse_args(["--silence-timeout", "2s", "ps"])
    assert (a.silence_timeout, a.cmd, cli.find_verb(["--silence-timeout", "2s", "ps"])) == (2.0, "ps", 2)
    assert cli.make_client(a).keepalive[0] * cli.make_client(a).keepalive[1] == pytest.approx(2.0)
    assert cli.make_client(cli.parse_args(["--silence-timeout", "off", "ps"])).keepalive is None
    assert cli.parse_args(["ps"]).silence_timeout is None
    with pytest.raises(SystemExit):
        cli.parse_args(["--silence-timeout", "soon", "ps"])


def test_fleet_takes_its_hosts_then_any_command():
    a = cli.parse_args(["fleet", "--hosts", "h1, ssh://root@h2:22", "exec", "SB", "--timeout", "2", "--", "ls"])
    assert (a.fleet, a.cmd, a.sandbox, a.timeout, a.argv) == (["h1", "ssh://root@h2:22"], "exec", "SB", 2.0,
                                                              ["ls"])
    a = cli.parse_args(["--json", "fleet", "--hosts", "h1", "job", "pause", "j"])
    assert (a.json, a.cmd, a.job_cmd, a.job) == (True, "job", "pause", "j")
    assert cli.named_sandboxes(cli.parse_args(["cp", "x", "SB:/tmp/x"])) == ["SB"]


@pytest.mark.parametrize("args,why", [(["fleet", "ps"], "--hosts"), (["fleet", "--hosts", "h1"], "give a command"),
                                      (["fleet", "--hosts", "h1", "rpc", "--stdio"], "does not run across"),
                                      (["--host", "ssh://h", "fleet", "--hosts", "h1", "ps"], "--host names one")])
def test_fleet_usage_errors(args, why, capsys, monkeypatch):
    monkeypatch.delenv("DSEC_HOSTS", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.parse_args(args)
    assert e.value.code == 2 and why in capsys.readouterr().err


@pytest.mark.parametrize("hosts,why", [
    ("h1,run/dsecd.sock", "'run/dsecd.sock' is neither a host nor a socket path: give ssh://[user@]host[:port]"),
    ("h1,h2:x", "'ssh://h2:x': the port must be a number from 1 to 65535"),
    ("ssh://h1/x", "'ssh://h1/x': an ssh:// address is ssh://[user@]host[:port], nothing more")])
def test_a_host_that_cannot_be_one_is_a_usage_error_of_hosts(hosts, why, capsys):
    """Found only at connect, it was said as the command's failure (`dsec
    ps: ...`, exit 1), and a relative socket path as a bad ssh:// address."""
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["fleet", "--hosts", hosts, "ps"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"dsec fleet: error: --hosts: {why}" in err, err


@pytest.mark.parametrize("args,fix", [
    (["ps", "--connect-timeout", "5"], "dsec fleet --hosts h1,h2 --connect-timeout 5 ps"),
    (["ps", "--connect-timeout=5", "--json"], "dsec fleet --hosts h1,h2 --connect-timeout=5 ps --json"),
    (["run", "busybox", "--connect-timeout", "5", "--", "echo", "hi"],
     "dsec fleet --hosts h1,h2 --connect-timeout 5 run busybox -- echo ..."),
    (["exec", "SB", "--hosts", "h3", "--", "ls"], "dsec fleet --hosts h1,h2 --hosts h3 exec SB -- ls")])
def test_a_fleet_option_after_the_command_says_where_it_goes(args, fix, capsys, monkeypatch):
    """They were refused by the command's own parser, as an option it does
    not know, with no word of the fleet."""
    monkeypatch.delenv("DSEC_HOSTS", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["fleet", "--hosts", "h1,h2", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is an option of dsec fleet" in err and f"before the command: {fix}\n" in err, err


def test_a_fleet_option_in_the_command_it_runs_is_the_commands():
    a = cli.parse_args(["fleet", "--hosts", "h1", "exec", "SB", "--", "prog", "--hosts", "x"])
    assert (a.fleet, a.argv) == (["h1"], ["prog", "--hosts", "x"])
    a = cli.parse_args(["fleet", "--hosts", "h1", "run", "busybox", "prog", "--connect-timeout", "3"])
    assert (a.fleet, a.argv, a.connect_timeout) == (["h1"], ["prog", "--connect-timeout", "3"], 15.0)
    assert cli.parse_args(["fleet", "--hosts", "h1", "ps", "--json"]).json is True


def test_fleet_runs_with_dsec_host_set_for_plain_commands(monkeypatch):
    """DSEC_HOST exported for `dsec ps` and the like does not stop `dsec
    fleet --hosts ...`: only a --host given with it is a usage error."""
    monkeypatch.setenv("DSEC_HOST", "ssh://h9")
    a = cli.parse_args(["fleet", "--hosts", "h1,h2", "ps"])
    assert (a.fleet, a.host, a.cmd) == (["h1", "h2"], None, "ps")
    assert cli.parse_args(["ps"]).host == "ssh://h9"


def test_docker_style_env_workdir_and_user_options(tmp_path, monkeypatch):
    """-e, --env-file, -w/--workdir and -u, as docker run and exec take them:
    the files first, --env over them, K alone from our environment."""
    env_file = tmp_path / "env"
    env_file.write_text("# comment\n\nA=from-file\nB=kept \"quoted\"\nOURS\nMISSING\n")
    monkeypatch.setenv("OURS", "ours")
    monkeypatch.delenv("MISSING", raising=False)
    monkeypatch.setenv("K", "k-ours")
    for verb in (["exec", "SB"], ["run", "img"], ["create", "--image", "img"]):
        a = cli.parse_args([*verb, "--env-file", str(env_file), "-e", "A=over", "-e", "K", "-w", "/srv",
                            "-u", "app", *(["--", "true"] if verb[0] != "create" else [])])
        assert cli.env_vars(a) == {"A": "over", "B": 'kept "quoted"', "OURS": "ours", "K": "k-ours"}, verb
        assert (a.cwd, a.user) == ("/srv", "app")
    a = cli.parse_args(["exec", "--workdir", "/x", "SB", "-e", "Z=1", "pwd"])
    assert (a.cwd, a.sandbox, a.argv, a.env) == ("/x", "SB", ["pwd"], ["Z=1"])
    bad = tmp_path / "bad"
    bad.write_text("NO SPACES=x\n")
    with pytest.raises(cli.UsageError, match=r"--env-file .*bad, line 1 must look like KEY=VALUE"):
        cli.env_vars(cli.parse_args(["exec", "SB", "--env-file", str(bad), "true"]))
    with pytest.raises(cli.UsageError, match="--env-file .*nosuch"):
        cli.env_vars(cli.parse_args(["exec", "SB", "--env-file", str(tmp_path / "nosuch"), "true"]))


def test_exec_options_before_and_after_the_sandbox_id():
    a = cli.parse_args(["exec", "SB", "--timeout", "2", "-i", "--user", "7", "--", "sleep", "10"])
    assert (a.sandbox, a.timeout, a.interactive, a.user, a.argv) == ("SB", 2.0, True, "7", ["sleep", "10"])
    b = cli.parse_args(["exec", "--timeout", "2", "-i", "--user", "7", "SB", "sleep", "10"])
    assert (b.sandbox, b.timeout, b.interactive, b.user, b.argv) == ("SB", 2.0, True, "7", ["sleep", "10"])
    t = cli.parse_args(["trace", "SB", "-o", "f", "--", "true"])
    assert (t.sandbox, t.output, t.argv) == ("SB", "f", ["true"])


def test_since_takes_durations_timestamps_and_iso_times():
    now = 1_700_000_000.0
    assert cli.parse_since("90s", now) == now - 90
    assert cli.parse_since("5m", now) == now - 300
    assert cli.parse_since("30", now) == now - 30
    assert cli.parse_since("1700000123.5", now) == 1700000123.5
    assert cli.parse_since("2024-05-01T12:00:00+00:00", now) == 1714564800.0
    with pytest.raises(cli.UsageError, match="--since"):
        cli.parse_since("yesterday", now)


def test_detach_takes_no_terminal_input_or_timeout():
    for extra in (["-t"], ["-i"], ["--timeout", "3"]):
        a = cli.parse_args(["exec", "-d", *extra, "SB", "--", "true"])
        with pytest.raises(cli.UsageError, match="-d runs the command in the background"):
            cli.check_usage(a)


def _dsec(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*DSEC, "--socket", "/nonexistent/dsecd.sock", *args], capture_output=True,
                          text=True, timeout=30, **kw)


@pytest.mark.parametrize("args", [["exec", "SB"], ["exec", "SB", "--bogus", "--", "true"], ["exec"],
                                  ["exec", "SB", "--time", "5", "sleep", "9"],    # no abbreviations
                                  ["trace", "SB"], ["call", "--image", "i"], ["exec", "SB", "--env", "=x", "true"]])
def test_usage_errors_of_commands_that_run_a_command_exit_125(args):
    r = _dsec(*args)
    assert r.returncode == 125, r.stderr
    assert "cannot connect" not in r.stderr          # said before the daemon is asked anything


@pytest.mark.parametrize("value, says", [
    ("8080:80", "takes the sandbox's port alone, got '8080:80': the daemon picks the host port "
                "(net.publish_ports); to choose it, `dsec port SB 80 --host-port 8080` after the create"),
    ("5353:53/udp", "takes the sandbox's port alone, got '5353:53/udp': the daemon picks the host port "
                    "(net.publish_ports); to choose it, `dsec port SB 53/udp --host-port 5353` after the create"),
    ("53/sctp", "takes a TCP or UDP port (PORT, PORT/tcp or PORT/udp), got '53/sctp': protocol 'sctp' is not "
                "tcp or udp"),
    ("http", "takes a port of the sandbox (1-65535), as PORT, PORT/tcp or PORT/udp, got 'http'"),
])
def test_publish_takes_the_sandbox_port_and_says_so(value, says):
    r = _dsec("create", "--image", "img", "--net", "default", "--publish", value)
    assert r.returncode == 2 and f"argument --publish: {says}" in r.stderr, r.stderr


@pytest.mark.parametrize("value, says", [
    ("53/sctp", "takes a TCP or UDP port (PORT, PORT/tcp or PORT/udp), got '53/sctp': protocol 'sctp' is not "
                "tcp or udp"),
    ("53/", "takes a TCP or UDP port (PORT, PORT/tcp or PORT/udp), got '53/': protocol '' is not tcp or udp"),
    ("70000", "takes a port of the sandbox (1-65535), as PORT, PORT/tcp or PORT/udp, got '70000'"),
    ("8080:80", "takes the sandbox's port alone, got '8080:80': give the host port with --host-port 8080"),
])
def test_port_takes_the_sandbox_port_and_says_so(value, says):
    r = _dsec("port", "SB", value)
    assert r.returncode == 2 and f"argument port: {says}" in r.stderr, r.stderr


@pytest.mark.parametrize("value, want", [("53", 53), ("53/tcp", 53), ("53/TCP", 53), ("53/udp", "53/udp"),
                                         ("53/UDP", "53/udp"),
                                         (" 53/udp", "53/udp"), ("53/udp ", "53/udp"), (" 53 ", 53)])
def test_publish_takes_a_tcp_or_udp_port(value, want):
    """TCP is the default; a UDP port is sent as "PORT/udp" (create's publish).
    Spaces around it are dropped, as the daemon drops them."""
    from dsecd import cli

    assert cli._sandbox_port(value) == want
    assert cli._port_to_publish(value) == (53, "tcp" if want == 53 else "udp")


@pytest.mark.parametrize("spec, want", [(8080, (8080, "tcp")), ("8080", (8080, "tcp")), ("8080/tcp", (8080, "tcp")),
                                        ("5353/udp", (5353, "udp")), ("5353/Udp", (5353, "udp"))])
def test_a_published_port_of_create_names_its_protocol(spec, want):
    from dsecd import protocol

    assert protocol.published_port(spec) == want


@pytest.mark.parametrize("spec", ["5353/sctp", "5353/", "udp", "/udp", True])
def test_a_published_port_of_another_protocol_is_a_bad_request(spec):
    from dsecd import protocol
    from dsecd.errors import BadRequest

    with pytest.raises(BadRequest, match="is not"):
        protocol.published_port(spec)


def test_usage_errors_of_other_commands_exit_2():
    assert _dsec("ps", "--bogus").returncode == 2
    r = _dsec("cp", "a", "b")
    assert r.returncode == 2 and "SANDBOX:/absolute/path" in r.stderr


def test_help_into_a_closed_pipe_is_quiet():
    r_fd, w_fd = os.pipe()
    os.close(r_fd)
    try:
        r = subprocess.run([*DSEC, "exec", "--help"], stdout=w_fd, stderr=subprocess.PIPE, timeout=30)
    finally:
        os.close(w_fd)
    assert (r.returncode, r.stderr) == (cli.EXIT_BROKEN_PIPE, b"")


def test_no_daemon_is_a_failure_that_names_the_socket():
    r = _dsec("ps")
    assert r.returncode == 1 and "/nonexistent/dsecd.sock" in r.stderr
    assert _dsec("exec", "SB", "--", "true").returncode == 125


@pytest.mark.parametrize("text,seconds", [("90", 90), ("1.5", 1.5), ("90s", 90), ("5M", 300), ("2h", 7200),
                                          ("1d", 86400), ("1h30m", 5400), ("1m30s", 90), ("2h0m5s", 7205),
                                          ("1.5h", 5400), ("500ms", 0.5), (" 1h30m ", 5400)])
def test_durations_take_docker_and_go_forms(text, seconds):
    assert parse_duration(text, "ttl") == seconds
    assert cli.parse_args(["exec", "SB", "--timeout", text, "--", "true"]).timeout == seconds
    assert cli.parse_since(text, 10_000_000.0) == 10_000_000.0 - seconds


@pytest.mark.parametrize("text", ["1h30", "h", "1x", "30m1", "1h 30m", "", "m5"])
def test_a_bad_duration_is_refused(text):
    with pytest.raises(BadRequest, match="must be seconds or a duration like 90s, 5m, 1h30m"):
        parse_duration(text, "ttl")


def test_top_interval_takes_a_duration():
    assert cli.parse_args(["top", "--interval", "1s"]).interval == 1.0
    assert cli.parse_args(["top", "-d", "500ms"]).interval == 0.5
    assert cli.parse_args(["top", "--interval", "1m"]).interval == 60.0
    assert _dsec("top", "--interval", "0s").returncode == 2


@pytest.mark.parametrize("words,choices", [([], "info, image, create"), (["image"], "build, import, pull, ls"),
                                           (["net"], "show, sets, set"), (["job"], "pause, resume, rm")])
def test_a_missing_subcommand_is_said_by_its_choices(words, choices):
    r = _dsec(*words)
    assert r.returncode == 2 and f"error: give a command: {choices}" in r.stderr, r.stderr
    assert "_cmd" not in r.stderr and "required: cmd" not in r.stderr, r.stderr


@pytest.mark.parametrize("args,bad", [(["cp", "/etc/hostname", "SB:tmp/x"], "SB:tmp/x"),
                                      (["cp", "SB:tmp/x", "/tmp/"], "SB:tmp/x"),
                                      (["cp", "/etc/hostname", "SB:"], "SB:"),
                                      (["rm", "SB:/ok", "SB:tmp/x"], "SB:tmp/x"),
                                      (["rm", "-rf", "SB:"], "SB:")])
def test_a_relative_sandbox_path_is_said_to_be_one(args, bad):
    """Not "exactly one side must be SANDBOX:/absolute/path" of a cp that
    has a sandbox side, nor "no sandbox 'SB:tmp/x'" of an rm."""
    r = _dsec(*args)
    assert r.returncode == 2, r.stderr
    assert f"a sandbox's path must be absolute: give SANDBOX:/path, got {bad!r}" in r.stderr, r.stderr


def test_zero_duration_message():
    with pytest.raises(BadRequest, match=r"ttl must be more than 0 s and at most 365 days, got '0'"):
        parse_duration("0", "ttl")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the client as another user")
@pytest.mark.parametrize("group", [0, 65534])
def test_a_refused_socket_says_who_may_connect(group):
    """A 0660 socket the user cannot open: the message names the socket and
    what the user needs (root, or the socket's group)."""
    with tempfile.TemporaryDirectory() as top:      # 0700 like pytest's: open it for the other user
        os.chmod(top, 0o755)
        _check_refused_socket(Path(top), group)


def _check_refused_socket(tmp_path: Path, group: int) -> None:
    path = tmp_path / "dsecd.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    os.chown(path, 0, group)
    os.chmod(path, 0o660)
    try:
        r = subprocess.run([*DSEC, "--socket", str(path), "ps"], capture_output=True, text=True, timeout=30,
                           user=65533, group=65533, extra_groups=[],
                           env={**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[2])})
    finally:
        listener.close()
    assert r.returncode == 1
    assert f"cannot connect to dsecd at {path}: permission denied" in r.stderr
    if group == 0:
        assert "admits root only" in r.stderr and "socket_group" in r.stderr
    else:
        assert "members of group" in r.stderr and "usermod -aG" in r.stderr


def test_policy_is_a_name_or_an_inline_json_object():
    a = cli.parse_args(["exec", "--policy", "grader", "SB", "--", "cat", "/grader/x"])
    assert (a.policy, a.sandbox, a.argv) == ("grader", "SB", ["cat", "/grader/x"])
    a = cli.parse_args(["exec", "SB", "--policy", '{"hidden": ["/g"], "rest": "writable"}', "ls"])
    assert a.policy == {"hidden": ["/g"], "rest": "writable"} and a.argv == ["ls"]
    assert cli.parse_args(["create", "--image", "busybox", "--policy", "agent"]).policy == "agent"
    a = cli.parse_args(["events", "SB", "--replay", "--no-follow"])
    assert (a.sandbox_id, a.replay, a.follow) == ("SB", True, False)
    with pytest.raises(SystemExit):
        cli.parse_args(["create", "--image", "busybox", "--policy", "{not json"])


def test_disk_is_a_create_and_run_option():
    a = cli.parse_args(["create", "--image", "busybox", "--disk", "1T"])
    assert a.disk == "1T" and create_args(a)["disk"] == "1T"
    a = cli.parse_args(["run", "--disk", "64M", "busybox", "--", "df", "/"])
    assert (a.disk, a.image, a.argv) == ("64M", "busybox", ["df", "/"])
    assert create_args(cli.parse_args(["create", "--image", "busybox"]))["disk"] is None


def test_backend_is_a_create_and_run_option():
    """`dsec run --backend microvm` was "unrecognized arguments: --backend"."""
    assert cli.parse_args(["create", "--image", "busybox", "--backend", "microvm"]).backend == "microvm"
    a = cli.parse_args(["run", "--backend", "microvm", "busybox", "--", "uname", "-r"])
    assert (a.backend, a.image, a.argv) == ("microvm", "busybox", ["uname", "-r"])
    assert cli.parse_args(["run", "busybox"]).backend is None


@pytest.mark.parametrize("args,usage", [
    (["ps", "nosuch"], "usage: dsec ps"),
    (["create", "--image", "busybox", "--bogus", "1T"], "usage: dsec create"),
    (["image", "rm", "x", "--bogus"], "usage: dsec image rm"),
])
def test_unknown_words_are_the_subcommands_usage_error(args, usage, capsys):
    """Said with the command's own usage, not dsec's top-level one."""
    with pytest.raises(SystemExit) as e:
        cli.parse_args(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and usage in err and "unrecognized arguments" in err, err
    assert "usage: dsec [-h]" not in err, err


def test_an_unknown_option_of_exec_is_its_usage_error_exit_125(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["exec", "SB", "--bogus", "--", "true"])
    err = capsys.readouterr().err
    assert e.value.code == 125 and "usage: dsec exec" in err and "--bogus" in err, err


def test_negative_sizes_and_numbers_are_values_not_options():
    """`--memory -5M` reaches the daemon, whose check says what is wrong with it."""
    a = cli.parse_args(["create", "--image", "busybox", "--memory", "-5M", "--disk", "-1G", "--cpu", "-0.5",
                        "--pids", "-3", "--ttl", "-5m"])
    assert (a.memory, a.disk, a.cpu, a.pids, a.ttl) == ("-5M", "-1G", -0.5, -3, "-5m")
    a = cli.parse_args(["run", "--memory", "-5M", "busybox", "--", "echo", "--memory", "-5M"])
    assert (a.memory, a.image, a.argv) == ("-5M", "busybox", ["echo", "--memory", "-5M"])
    a = cli.parse_args(["exec", "SB", "--timeout", "-2", "--", "sleep", "1"])
    assert (a.timeout, a.argv) == (-2.0, ["sleep", "1"])
    # Only those options, and only a value that starts like a number.
    assert cli.join_signed_values(["--memory", "-5M", "--env", "-5M", "--cpu", "-x", "--", "--pids", "-1"]) == \
        ["--memory=-5M", "--env", "-5M", "--cpu", "-x", "--", "--pids", "-1"]


def test_the_options_a_new_user_asked_about_have_help():
    leaves = dict(_leaf_parsers(cli.build_parser()))
    wanted = {("create",): ["--image", "--cpu", "--pids", "--label", "--disk", "--memory"],
              ("run",): ["--disk"], ("rm",): ["--all"], ("net", "set"): ["--add", "--remove"],
              ("call",): ["--image"], ("snapshot",): ["--name"], ("events",): ["--sandbox"],
              ("logs",): ["--follow"], ("exec",): ["--user", "--env", "--cwd"]}
    for path, options in wanted.items():
        helps = {o: act.help for act in leaves[path]._actions for o in act.option_strings}
        for option in options:
            assert helps[option] and helps[option] != "the same, as an option", (path, option)
    helps = {o: act.help for act in leaves[("create",)]._actions for o in act.option_strings}
    assert "fractions" in helps["--cpu"] and "CPU" in helps["--cpu"]
    assert "UID" in {o: act.help for act in leaves[("exec",)]._actions for o in act.option_strings}["--user"]
    assert cli.parse_args(["exec", "SB", "--user", "1000", "--", "id"]).user == "1000"        # the daemon resolves it, as docker does
    assert cli.parse_args(["exec", "SB", "--user", "app:staff", "--", "id"]).user == "app:staff"


class _FileSandbox:
    """A sandbox whose every file holds `data`; or whose read fails midway."""

    def __init__(self, data: bytes, fail_after: bool = False):
        self.data, self.fail_after = data, fail_after

    async def read_file_to(self, path, f):
        f.write(self.data)
        if self.fail_after:
            from dsecd.errors import NotFound
            raise NotFound(f"read sb:{path}: the sandbox was destroyed")
        return len(self.data)


def _copy_out(sb, dst, mode=None):
    import asyncio
    return asyncio.run(cli._copy_out(sb, "/f", str(dst), mode))


def test_a_failed_local_copy_names_the_users_path(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        _copy_out(_FileSandbox(b"data"), tmp_path / "nonexist-dir" / "x")
    assert e.value.filename == str(tmp_path / "nonexist-dir" / "x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").mkdir()                   # a directory where the file would go
    with pytest.raises(OSError) as e:
        _copy_out(_FileSandbox(b"data"), tmp_path / "d" / "x")
    assert e.value.filename == str(tmp_path / "d" / "x") and ".dsec-tmp" not in str(e.value), e.value
    assert os.listdir(tmp_path / "d") == ["x"]        # no temporary file left
    assert _copy_out(_FileSandbox(b"data"), tmp_path / "d" / "y", 0o750) == 4
    assert (tmp_path / "d" / "y").read_bytes() == b"data"
    assert (tmp_path / "d" / "y").stat().st_mode & 0o777 == 0o750


def test_a_copy_out_cut_midway_leaves_the_old_file_and_no_part(tmp_path):
    from dsecd.errors import ConnectionLost, NotFound

    (tmp_path / "y").write_bytes(b"old")
    with pytest.raises(NotFound, match="destroyed"):
        _copy_out(_FileSandbox(b"part", fail_after=True), tmp_path / "y")
    assert os.listdir(tmp_path) == ["y"] and (tmp_path / "y").read_bytes() == b"old"

    class Lost(_FileSandbox):          # the daemon restarted mid-copy: a ConnectionError, an OSError
        async def read_file_to(self, path, f):
            f.write(b"part")
            raise ConnectionLost("connection lost: the daemon closed it", target="/run/dsecd.sock",
                                 op="file_read", sent=True)

    with pytest.raises(ConnectionLost, match="connection lost"):       # not a TypeError of its re-raise
        _copy_out(Lost(b""), tmp_path / "y")
    assert os.listdir(tmp_path) == ["y"]


def test_packing_a_directory_that_does_not_exist_says_so(tmp_path):
    import io

    from dsecd import localcopy

    with pytest.raises(FileNotFoundError) as e:
        localcopy.pack(str(tmp_path / "nonexist"), io.BytesIO())
    assert e.value.filename == str(tmp_path / "nonexist")
    (tmp_path / "f").write_text("x")
    with pytest.raises(localcopy.LocalCopyError, match="is not a directory"):
        localcopy.pack(str(tmp_path / "f"), io.BytesIO())


@pytest.mark.parametrize("exit_code, sig, status", [(0, None, 0), (7, None, 7), (None, 15, 143), (None, None, 125)])
def test_a_background_process_status_as_the_shell_gives_it(capsys, exit_code, sig, status):
    from dsecd.client import ProcStatus

    st = ProcStatus(pid=9, state="exited", exit_code=exit_code, signal=sig, argv=["x"], started=0.0, ended=1.0,
                    output_bytes=0, dropped=0, stdin_open=False)
    assert cli._exit_of(st) == status
    assert ("does not know" in capsys.readouterr().err) == (status == 125)


@pytest.mark.parametrize("hosts, said", [("h1,h1", "h1 is given twice"), ("h1,ssh://h1", "ssh://h1 is given twice"),
                                         (" , ", "names no host")])
def test_fleet_hosts_given_twice_or_none_are_a_usage_error_of_dsec_fleet(hosts, said, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["fleet", "--hosts", hosts, "ps"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "dsec fleet: error:" in err and said in err, err


def test_a_directory_build_of_a_dockerfile_project_warns(tmp_path, capsys):
    """`dsec image build . --name app` (docker build's habit) imports the
    directory as a root file system; where it holds a Dockerfile, stderr
    says so and how to build from it. -f, `image import` and a host's
    own paths (--host) are left alone."""
    (tmp_path / "Dockerfile").write_text("FROM busybox\n")
    cli.check_usage(cli.parse_args(["image", "build", str(tmp_path), "--name", "app"]))
    err = capsys.readouterr().err
    assert f"{tmp_path} holds a Dockerfile" in err
    assert f"dsec image build -f {tmp_path}/Dockerfile {tmp_path} --name app" in err
    for args in (["image", "build", "-f", str(tmp_path / "Dockerfile"), str(tmp_path), "--name", "app"],
                 ["image", "import", str(tmp_path), "--name", "app"],
                 ["--host", "ssh://h", "image", "build", str(tmp_path), "--name", "app"]):
        cli.check_usage(cli.parse_args(args))
        assert capsys.readouterr().err == "", args
    (tmp_path / "Dockerfile").unlink()
    cli.check_usage(cli.parse_args(["image", "build", str(tmp_path), "--name", "app"]))
    assert capsys.readouterr().err == ""


def test_build_warnings_reach_stderr_off_a_terminal(capsys):
    """Off a terminal the build prints its result alone on stdout; its
    warnings (a COPY glob that copies nothing, unused build args) still go
    to stderr, or a CI log never shows that files were left out."""
    import asyncio

    class Fake:
        async def build_dockerfile(self, *args, progress=None, **kw):
            progress({"event": "step", "step": 1, "of": 2, "line": 1, "instruction": "FROM busybox"})
            progress({"event": "warning", "step": 2, "message": "line 2: COPY *.txt: no file matches it"})
            progress({"event": "output", "step": 2, "fd": 1, "data": b"run output\n"})
            return {"name": "app", "layers": [], "bytes": 0, "manifest": "sha256:" + "0" * 64, "steps": [],
                    "seconds": 0.1}

    for json_out in (False, True):
        a = cli.parse_args(["image", "build", "-f", "Dockerfile", ".", "--name", "app", *(["--json"] * json_out)])
        assert asyncio.run(cli.cmd_image_dockerfile(Fake(), a)) == 0
        out, err = capsys.readouterr()
        assert err == "dsec image build: warning: line 2: COPY *.txt: no file matches it\n"
        assert "warning" not in out and "run output" not in out


def test_a_dockerfile_on_stdin_with_f_dash(monkeypatch, capsys):
    """`-f -` reads the Dockerfile from stdin, as docker build does; its
    errors name it <stdin>."""
    import asyncio
    import io

    seen = {}

    class Fake:
        async def build_dockerfile(self, context, name, dockerfile=None, text=None, **kw):
            seen.update(dockerfile=dockerfile, text=text)
            return {"name": name, "layers": [], "bytes": 0, "manifest": "sha256:" + "0" * 64, "steps": [],
                    "seconds": 0.1}

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"FROM busybox\nRUN true\n")))
    a = cli.parse_args(["image", "build", "-f", "-", ".", "--name", "app"])
    assert asyncio.run(cli.cmd_image_dockerfile(Fake(), a)) == 0
    assert seen == {"dockerfile": "<stdin>", "text": "FROM busybox\nRUN true\n"}
    # Not UTF-8 (a binary piped by mistake): said as a Dockerfile file's is,
    # not as the codec's complaint when the request is encoded.
    seen.clear()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe garbage"), errors="surrogateescape"))
    with pytest.raises(BadRequest, match=r"the Dockerfile on stdin \(-f -\) is not UTF-8 text \(byte 0"):
        asyncio.run(cli.cmd_image_dockerfile(Fake(), a))
    assert seen == {}


@pytest.mark.parametrize("stop", [KeyboardInterrupt, asyncio.CancelledError])
def test_an_interrupted_build_closes_its_terminal_view(monkeypatch, stop):
    """Ctrl-C during a build on a terminal: the step view is closed (rich
    shows the cursor again and ends the live line), not left hiding the
    terminal's cursor after dsec exits."""
    import io

    from dsecd import buildview

    closed = []

    class View:
        def __init__(self):
            pass

        def __call__(self, event):
            pass

        def close(self):
            closed.append(True)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    class Fake:
        async def build_dockerfile(self, *args, **kw):
            raise stop()

    monkeypatch.setattr(buildview, "BuildView", View)
    monkeypatch.setattr("sys.stdout", Tty())
    a = cli.parse_args(["image", "build", "-f", "Dockerfile", ".", "--name", "app"])
    with pytest.raises(stop):
        asyncio.run(cli.cmd_image_dockerfile(Fake(), a))
    assert closed == [True]


@pytest.mark.parametrize("argv", [["create", "busybox"], ["create", "--image", "busybox"],
                                  ["create", "--cpu", "0.5", "busybox", "--memory", "64M"],
                                  ["fleet", "--hosts", "h1", "create", "busybox"]])
def test_create_takes_its_image_as_docker_create_does_or_as_an_option(argv):
    assert cli.parse_args(argv).image == "busybox"


@pytest.mark.parametrize("argv, words", [(["create"], "error: an image is needed: dsec create IMAGE"),
                                         (["create", "a", "--image", "b"], "two images given")])
def test_create_without_an_image_or_with_two_says_so(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err
    # create's usage, not the list of every command's
    assert err.startswith("usage: dsec create [options] IMAGE") and "dsec create: error:" in err, err


def test_info_prints_the_cgroup_dirs_one_per_line(capsys):
    """`dsec info`'s paths: the cgroup dir of each hierarchy on a line of
    its own, not a Python dict."""
    class Info:
        async def info(self):
            return {"version": "0.1.0", "protocol": 1, "pid": 1, "uptime_s": 5.0, "kernel": "6.1",
                    "cgroup_mode": "v2", "cgroup_controllers": {"cpu": "v2"}, "features": {}, "limits": {},
                    "sandboxes": {}, "paths": {"cgroup_dirs": {"cpu": "/sys/fs/cgroup/cpu/dsecd",
                                                               "memory": "/sys/fs/cgroup/memory/dsecd"},
                                               "socket": "/run/dsecd/dsecd.sock"}}

    assert asyncio.run(cli.cmd_info(Info(), cli.parse_args(["info"]))) == 0
    out = capsys.readouterr().out
    assert "{" not in out, out
    lines = [line.split() for line in out.splitlines()]
    assert ["cpu", "/sys/fs/cgroup/cpu/dsecd"] in lines and ["memory", "/sys/fs/cgroup/memory/dsecd"] in lines, out
    assert ["socket", "/run/dsecd/dsecd.sock"] in lines, out


CP_FROM_STDIN = """
import asyncio, sys
from dsecd import cli
from dsecd.errors import NotFound
class Sandbox:
    id = "sbx"
    async def stat(self, path):
        raise NotFound(path)
    async def write_file(self, path, data, **kw):
        async for chunk in data:
            pass
class Client:
    async def get(self, sb_id):
        return Sandbox()
a = cli.parse_args(["cp", "-", "sbx:/tmp/x"])
print("ready", flush=True, file=sys.stderr)
sys.exit(asyncio.run(cli.cmd_cp(Client(), a)))
"""


def test_cp_from_stdin_ends_at_sigterm_while_stdin_stays_open(tmp_path):
    """`producer | timeout 60 dsec cp - SB:/x`: the SIGTERM cancels the copy
    at once, though stdin is still open (its read runs beside the loop)."""
    import signal
    import time

    r, w = os.pipe()                       # a producer that never ends
    p = subprocess.Popen([sys.executable, "-c", CP_FROM_STDIN], stdin=r, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[2])})
    os.close(r)
    try:
        assert p.stderr.readline() == b"ready\n"
        time.sleep(0.3)                    # in the read by now
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 128 + signal.SIGTERM
        assert b"SIGTERM: the copy was cancelled" in p.stderr.read()
    finally:
        os.close(w)
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("cmd, err, status", [
    ("exec", NotFound("exec 'x': no such file", {"argv0": "x"}), 127),
    ("run", NotFound("exec 'x': no such file", {"argv0": "x"}), 127),
    ("trace", DsecError("exec 'x': permission denied", {"argv0": "x", "step": "exec"}, code="permission"), 126),
    ("exec", NotFound("no sandbox sb-1", {"sandbox": "sb-1"}), 125),
    ("exec", DsecError("exec: working directory '/root': permission denied", {"step": "chdir"},
                       code="permission"), 125),
    ("ps", NotFound("exec 'x': no such file", {"argv0": "x"}), 1),
])
def test_a_command_that_cannot_start_exits_127_or_126_as_a_shell_says(cmd, err, status):
    a = argparse.Namespace(cmd=cmd)
    assert cli._failed_status(a, err) == status


class _CallClient:
    """Answers `call` with a set CallResult."""

    def __init__(self, result):
        self.result = result

    async def call(self, image, **kw):
        return self.result


def _call_result(**kw):
    from dsecd.client import CallResult

    fields = dict(exit_code=0, signal=None, stdout=b"", stderr=b"", truncated=False, timed_out=False,
                  cancelled=False, duration_ms=1.0, path="zygote")
    return CallResult(**{**fields, **kw})


def test_call_says_its_output_was_truncated(tmp_path, capfd):
    """As exec does: the cut output and the SIGPIPE the call then got are the daemon's cap, said so."""
    code = tmp_path / "c.py"
    code.write_text("print('x' * (1 << 30))\n")
    a = cli.parse_args(["call", "--image", "py", "--code-file", str(code)])
    r = _call_result(exit_code=None, signal=13, stdout=b"x" * 10, truncated=True)
    assert asyncio.run(cli.cmd_call(_CallClient(r), a)) == 128 + 13
    out, err = capfd.readouterr()
    assert out == "x" * 10
    assert "output truncated at the daemon's limits.max_exec_output_bytes" in err


def test_call_reads_its_code_file_as_python_reads_a_script(tmp_path):
    """By its coding declaration (PEP 263), else UTF-8 whatever the locale;
    bytes it cannot decode are an error naming the file."""
    class Recorder(_CallClient):
        async def call(self, image, **kw):
            self.code = kw["code"]
            return self.result

    code = tmp_path / "latin.py"
    code.write_bytes(b"# -*- coding: latin-1 -*-\nprint('caf\xe9')\n")
    c = Recorder(_call_result())
    assert asyncio.run(cli.cmd_call(c, cli.parse_args(["call", "--image", "py", "--code-file", str(code)]))) == 0
    assert c.code == "# -*- coding: latin-1 -*-\nprint('caf\u00e9')\n"
    for text, why in ((b"\n\nprint('caf\xe9')\n", r"not UTF-8 text \(byte 12: invalid continuation byte\)"),
                      (b"print('caf\xe9')\n", "invalid or missing encoding declaration"),
                      (b"# coding: nosuch\n", "unknown encoding: nosuch")):
        code.write_bytes(text)
        with pytest.raises(BadRequest, match=f"--code-file {code}: {why}; save it as UTF-8 or declare"):
            asyncio.run(cli.cmd_call(c, cli.parse_args(["call", "--image", "py", "--code-file", str(code)])))


def test_call_reads_a_code_file_that_is_a_pipe(tmp_path):
    """`--code-file /dev/stdin` (a heredoc) or `<(...)`: read once, not seeked."""
    class Recorder(_CallClient):
        async def call(self, image, **kw):
            self.code = kw["code"]
            return self.result

    r, w = os.pipe()
    try:
        os.write(w, b"# -*- coding: latin-1 -*-\nprint('caf\xe9')\n")
        os.close(w)
        c = Recorder(_call_result())
        args = cli.parse_args(["call", "--image", "py", "--code-file", f"/dev/fd/{r}"])
        assert asyncio.run(cli.cmd_call(c, args)) == 0
        assert c.code == "# -*- coding: latin-1 -*-\nprint('caf\u00e9')\n"
    finally:
        os.close(r)


def test_a_build_arg_without_a_value_is_taken_from_the_environment(monkeypatch):
    """`--build-arg HTTP_PROXY`, as docker build takes it: the value of that
    variable here, and no value at all when it is unset."""
    seen = {}

    class Fake:
        async def build_dockerfile(self, context, name, dockerfile=None, text=None, build_args=None, **kw):
            seen.update(build_args)
            return {"name": name, "layers": [], "bytes": 0, "manifest": "sha256:" + "0" * 64, "steps": [],
                    "seconds": 0.1}

    monkeypatch.setenv("DSEC_TEST_PROXY", "http://proxy:3128")
    monkeypatch.delenv("DSEC_TEST_UNSET", raising=False)
    a = cli.parse_args(["image", "build", "-f", "Dockerfile", ".", "--name", "app", "--build-arg", "V=2",
                        "--build-arg", "DSEC_TEST_PROXY", "--build-arg", "DSEC_TEST_UNSET", "--json"])
    cli.check_usage(a)
    assert asyncio.run(cli.cmd_image_dockerfile(Fake(), a)) == 0
    assert seen == {"V": "2", "DSEC_TEST_PROXY": "http://proxy:3128"}


def test_a_snapshot_exclude_that_looks_like_a_pattern_warns(capsys):
    """--exclude takes paths: `/root/*` leaves out an entry named `*`, not
    everything in /root, so the CLI says so instead of packing it all."""
    seen = {}

    class Sandbox:
        async def snapshot(self, name, exclude, progress=None):
            seen["exclude"] = exclude
            return {"name": name, "layers": [], "bytes": 0, "manifest": "sha256:" + "0" * 64}

    class Fake:
        async def get(self, sandbox_id):
            return Sandbox()

    a = cli.parse_args(["snapshot", "sb1", "--name", "snap", "--exclude", "/root/*", "--exclude", "/root/.cache"])
    cli.check_usage(a)
    assert asyncio.run(cli.cmd_snapshot(Fake(), a)) == 0
    err = capsys.readouterr().err
    assert seen["exclude"] == ["/root/*", "/root/.cache"]
    assert "--exclude '/root/*' is a path, not a pattern" in err and ".cache" not in err


HELD_DAEMON = """
import asyncio, sys
from standin_kit import hello_then_say_and_hold
async def main():
    server = await asyncio.start_unix_server(hello_then_say_and_hold, sys.argv[1])
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_command_ended_by_sigterm_says_interrupted_and_exits_128_plus(tmp_path, signame):
    """`timeout 60 dsec --json exec ...` killed dsec where it stood: exit
    -15 and no `interrupted` error on stdout, which --json promises for a
    command a signal ended."""
    import signal

    sock = str(tmp_path / "d.sock")
    with _stand_in(HELD_DAEMON, sock) as (env, held):
        p = subprocess.Popen([sys.executable, "-m", "dsecd.cli", "--json", "--socket", sock, "exec", "sb1", "--",
                              "true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        _wait_for_request(held, p)             # waiting for its answer now
        p.send_signal(getattr(signal, signame))
        out, err = p.communicate(timeout=10)
    signum = getattr(signal, signame)
    assert p.returncode == 128 + signum, (p.returncode, err)
    error = json.loads(out)["error"]
    assert error["code"] == "interrupted" and error["detail"]["signal"] == signame, out
    assert f"interrupted ({signame})".encode() in err


@pytest.mark.parametrize("words", [["exec", "sb1", "--", "true"], ["cp", "/etc/hostname", "sb1:/tmp/x"], ["ps"]])
def test_a_command_ended_by_ctrl_c_says_interrupted_and_exits_130(tmp_path, words):
    """^C ended any command with status 130 and not a word on stderr: a
    user could not tell it from a command that failed on its own. One line
    says what ended it, and no traceback."""
    import signal

    sock = str(tmp_path / "d.sock")
    with _stand_in(HELD_DAEMON, sock) as (env, held):
        # As a terminal's ^C finds it: a shell's background job (as pytest may
        # be) ignores SIGINT, and a Python started so never sees one.
        p = subprocess.Popen([sys.executable, "-m", "dsecd.cli", "--socket", sock, *words], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        _wait_for_request(held, p)             # waiting for its answer now
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
    assert p.returncode == 130, (p.returncode, err)
    assert err == f"dsec {words[0]}: interrupted (SIGINT)\n".encode(), err


def test_a_timeout_takes_a_duration_as_a_ttl_does():
    """`--ttl 5m` worked and `--timeout 5m` was "invalid float value": a
    command's timeout takes the same seconds or durations."""
    for verb, rest in ((["exec", "SB"], ["--", "true"]), (["run", "busybox"], ["true"]),
                       (["call", "--image", "i"], ["--", "true"])):
        for given, seconds in (("90", 90.0), ("1.5", 1.5), ("2m", 120.0), ("1h", 3600.0)):
            a = cli.parse_args([verb[0], "--timeout", given, *verb[1:], *rest])
            assert a.timeout == seconds, (verb, given, a.timeout)
    with pytest.raises(SystemExit):
        cli.parse_args(["exec", "--timeout", "soon", "SB", "--", "true"])


def test_the_sdks_exec_timeout_takes_a_duration_as_its_ttl_does():
    from dsecd.client import Sandbox

    sb = Sandbox(None, "0123456789ab", {})
    assert sb._exec_args(["true"], None, None, None, "2m", False, False)["timeout"] == 120.0
    assert sb._exec_args(["true"], None, None, None, 1.5, False, False)["timeout"] == 1.5


WRITE_HELD_DAEMON = """
import asyncio, sys
from dsecd import protocol
from standin_kit import serving
async def answer(frame, writer):
    op, rid = frame["op"], frame["id"]
    print("request", op, flush=True)
    if op == "inspect":
        writer.write(protocol.encode_frame({"id": rid, "result": {"id": "0123456789ab", "state": "running"}}))
    elif op == "file_stat" or (op == "file_remove" and sys.argv[2:] == ["removes"]):
        writer.write(protocol.encode_frame({"id": rid, "error": {"code": "not_found", "message": "no", "detail": {}}}))
    return False        # a write, and (unless told) the removal of its temporary file after a cancel: never answered
async def main():
    server = await asyncio.start_unix_server(serving(answer), sys.argv[1])
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


@contextlib.contextmanager
def _stand_in(script: str, sock: str, *args: str):
    """A stand-in daemon (`script`, on `sock`) while the block runs: the env a
    dsec process run against it takes, and the stand-in's process (whose
    stdout says "request OP" as each request comes: _wait_for_request)."""
    env = {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[2])}
    held = subprocess.Popen([sys.executable, "-c", script, sock, *args], stdout=subprocess.PIPE,
                            env={**env, "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], str(Path(__file__).parent)])})
    try:
        assert held.stdout.readline() == b"ready\n"
        yield env, held
    finally:
        held.kill()
        held.wait()
        held.stdout.close()


def _wait_for_request(held: subprocess.Popen, client: subprocess.Popen, op: str | None = None,
                      timeout: float = 60.0) -> None:
    """Until the stand-in `held` says a request `op` (any op: None) came
    from `client`, a dsec process: by then its signal handlers are in place
    and it waits for the answer. A fixed sleep in its place raced the
    client's start-up (a second and more on a loaded host)."""
    import select
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.poll() is not None:
            raise AssertionError(f"dsec ended before its request: {client.returncode}, {client.stderr.read()!r}")
        if select.select([held.stdout], [], [], 0.1)[0]:
            words = held.stdout.readline().split()
            assert words[:1] == [b"request"], words
            if op is None or words[1:] == [op.encode()]:
                return
    raise AssertionError(f"no {op or 'request'} came from dsec within {timeout} s")


def _ends_within(p: subprocess.Popen, t0: float, seconds: float) -> None:
    import signal
    import time

    try:
        p.communicate(timeout=15)
    finally:
        if p.poll() is None:            # hung: not left behind
            p.kill()
            p.wait()
    assert p.returncode == 128 + signal.SIGTERM and time.monotonic() - t0 < seconds, (p.returncode,
                                                                                     time.monotonic() - t0)


def test_a_second_sigterm_ends_a_command_whose_clean_up_waits(tmp_path):
    """The first SIGTERM cancels a copy, whose clean-up (the removal of its
    temporary file) waits on a daemon that answers nothing more; a second
    ends dsec at once, as a second ^C does, instead of being noted only."""
    import signal
    import time

    sock = str(tmp_path / "d.sock")
    src = tmp_path / "f"
    src.write_bytes(b"x" * 1000)
    with _stand_in(WRITE_HELD_DAEMON, sock) as (env, held):
        p = subprocess.Popen([sys.executable, "-m", "dsecd.cli", "--socket", sock, "cp", str(src), "sb1:/work/f"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        _wait_for_request(held, p, "file_write")      # its first chunk sent, waiting for the answer
        p.send_signal(signal.SIGTERM)
        _wait_for_request(held, p, "file_remove")     # cancelled, removing its temporary file
        assert p.poll() is None, p.communicate()
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _ends_within(p, t0, 3)


@pytest.mark.parametrize("writer_opens", [True, False])
def test_a_copy_from_a_fifo_nobody_writes_ends_at_sigterm(tmp_path, writer_opens):
    """dsec cp FIFO SB:/f read the FIFO in an executor's thread, which the
    interpreter waits for at exit: cancelled by SIGTERM, dsec then hung
    until the FIFO's writer wrote or closed; and with no writer at all its
    open blocked the event loop, where no signal's handler ran."""
    import signal
    import time

    sock = str(tmp_path / "d.sock")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = None
    try:
        with _stand_in(WRITE_HELD_DAEMON, sock, "removes") as (env, held):
            p = subprocess.Popen([sys.executable, "-m", "dsecd.cli", "--socket", sock, "cp", str(fifo),
                                  "sb1:/work/f"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            if writer_opens:
                writer = os.open(fifo, os.O_WRONLY)      # open, and silent: the copy waits on its first read
            _wait_for_request(held, p)
            time.sleep(0.5)                              # on to the FIFO, whose read or open then waits
            t0 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            _ends_within(p, t0, 3)
    finally:
        if writer is not None:
            os.close(writer)


def test_the_parser_offers_every_order_dsec_top_has():
    """cliargs names them so that the parser need not import topview (and asyncio)."""
    from dsecd import cliargs, topview

    assert sorted(cliargs.TOP_SORTS) == sorted(topview.SORTS)


def test_version_says_dsecs_own(capsys):
    """`dsec --version`, as most commands take it, rather than a usage error."""
    import dsecd

    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"dsec {dsecd.__version__}\n"


@pytest.mark.parametrize("argv", [["--json", "--version"], ["--version", "--json"]])
def test_version_with_json_is_a_json_object(capsys, argv):
    """--json before or after --version, as with any command: one object,
    the version under the key `dsec info --json` gives the daemon's."""
    import dsecd

    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(argv)
    assert exit_.value.code == 0 and json.loads(capsys.readouterr().out) == {"version": dsecd.__version__}


def test_info_says_one_setting_in_the_singular():
    from dsecd import cli

    one = cli._reload_text({"ok": True, "at": 0.0, "applied": ["daemon.log_level"], "restart_needed": []})
    two = cli._reload_text({"ok": True, "at": 0.0, "applied": ["a", "b"], "restart_needed": []})
    assert ": 1 setting applied" in one and ": 2 settings applied" in two


def test_events_of_two_sandboxes_at_once_is_refused():
    """`dsec events A --sandbox B` followed B alone, saying nothing of A."""
    with pytest.raises(cli.UsageError, match="two sandboxes, a1 and --sandbox b2"):
        cli.check_usage(cli.parse_args(["events", "a1", "--sandbox", "b2"]))
    for args in (["events", "a1"], ["events", "--sandbox", "b2"], ["events", "a1", "--sandbox", "a1"], ["events"],
                 ["events", "a1b2c3", "--sandbox", "a1"], ["events", "a1", "--sandbox", "a1b2c3"]):
        cli.check_usage(cli.parse_args(args))


@pytest.mark.parametrize("path", ["node_modules", "./work/a", "root/.cache"])
def test_a_relative_snapshot_exclude_is_refused_naming_the_absolute_path(path):
    """The daemon reads a relative exclude from the sandbox's root, where a
    command line's reader expects the working directory: `node_modules` in a
    sandbox working in /app would leave nothing out. The CLI asks for the
    absolute path before the daemon is asked anything."""
    a = cli.parse_args(["snapshot", "sb1", "--name", "snap", "--exclude", "/root/.cache", "--exclude", path])
    with pytest.raises(cli.UsageError) as info:
        cli.check_usage(a)
    assert f"--exclude {path!r} is relative" in str(info.value)
    assert f" /{path.removeprefix('./')} from its root" in str(info.value)
    cli.check_usage(cli.parse_args(["snapshot", "sb1", "--name", "snap", "--exclude", "/root/.cache"]))


class _ExecClient:
    """Answers `exec` with set output and result, as an ExecStream does."""

    def __init__(self, chunks, result):
        self.chunks, self.result = chunks, result

    async def get(self, sandbox):
        return self

    def exec_stream(self, argv, **kw):
        client = self

        class _Stream:
            result = None

            async def __aiter__(self):
                for chunk in client.chunks:
                    yield chunk
                self.result = client.result

        return _Stream()


@pytest.mark.parametrize("json_output", [False, True])
def test_exec_says_the_output_a_cut_link_lost(capfd, json_output):
    """Over ssh:// a keyed exec is taken up after a cut link; output the
    daemon no longer had is a gap in what is printed: said, not silent."""
    from dsecd.client import ExecResult

    r = ExecResult(exit_code=0, signal=None, stdout=b"", stderr=b"", truncated=False, timed_out=False,
                   cancelled=False, duration_ms=1.0, lost_output=4096)
    a = cli.parse_args(["exec", *(["--json"] if json_output else []), "sb-1", "--", "make"])
    assert asyncio.run(cli.cmd_exec(_ExecClient([(1, b"end\n")], r), a)) == 0
    out, err = capfd.readouterr()
    assert "4096 bytes of the command's output were lost" in err
    if json_output:
        assert json.loads(out)["lost_output"] == 4096
    else:
        assert out == "end\n"
