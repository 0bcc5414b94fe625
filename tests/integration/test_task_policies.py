"""Task policies (dsecd/policy.py, csrc/policy_steps.h): an agent and its
grader share a sandbox, not its secrets.

One sandbox per test module whose default policy is `agent` (the shipped
one: /grader hidden, /usr and /etc read-only, /workspace writable, TCP
connects to 53, 80, 443 only, signals and abstract sockets scoped); a
grader exec runs in it under `grader`. Every forbidden action is checked
with its errno next to an allowed neighbour that must succeed, by the probe
binary (attack_probe.c: one syscall, prints `ok` or the errno's name), and
the same action is checked to work for the grader, so no test passes
because the probe or the setup is broken.
"""

from __future__ import annotations

import json
import time

import pytest
from attack_kit import PROBE_IN_SANDBOX, make_armed

from dsecd.errors import BadRequest, DsecError, NotFound

pytestmark = pytest.mark.attack

SECRET = b"the expected answer\n"


@pytest.fixture(scope="module")
def task(admin, probe_binary):
    """A sandbox with the agent policy as its default, /grader written by the
    host (the file API is not limited by any policy: dsec cp)."""
    sb = make_armed(admin, probe_binary, policy="agent")
    sb.write_file("/grader/secret", SECRET)
    sb.write_file("/grader/tests/test_answer.py", b"assert True\n")
    sb.write_file("/workspace/mine", b"the agent's own\n")
    yield sb
    try:
        sb.destroy(force=True)
    except DsecError:
        pass


def probe(sb, *args, policy=None, user=None) -> str:
    """The probe's verdict for one action: `ok` or an errno name."""
    r = sb.exec([PROBE_IN_SANDBOX, *map(str, args)], policy=policy, user=user, timeout=30)
    assert r.exit_code == 0, f"probe {args} under {policy}: exit {r.exit_code}: {r.stderr!r}"
    return r.stdout.decode().split()[-1]


def sh(sb, script: str, policy=None) -> tuple[int, str]:
    r = sb.exec(["sh", "-c", script], policy=policy, timeout=30)
    return r.exit_code, (r.stdout + r.stderr).decode()


def listening(proc, timeout: float = 10.0) -> None:
    """Wait until a background probe printed `listening`."""
    deadline = time.monotonic() + timeout
    for chunk in proc.output(follow=True):
        if b"listening" in chunk.data:
            return
        assert time.monotonic() < deadline, "the listener did not come up"
    raise AssertionError(f"the listener ended first: {proc.status()}")


# ------------------------------------------------------------ files


def test_agent_cannot_read_a_hidden_file_but_reads_its_own(task):
    assert probe(task, "open", "/workspace/mine") == "ok"
    assert probe(task, "open", "/grader/secret") == "EACCES"
    assert probe(task, "open", "/grader/tests/test_answer.py") == "EACCES"
    assert probe(task, "open", "/grader/secret", policy="grader") == "ok"
    assert task.exec(["cat", "/grader/secret"], policy="grader").stdout == SECRET


def test_agent_cannot_list_a_hidden_dir_but_lists_its_own(task):
    assert probe(task, "list", "/workspace") == "ok"
    assert probe(task, "list", "/usr") == "ok"
    assert probe(task, "list", "/grader") == "EACCES"
    assert probe(task, "list", "/grader/tests") == "EACCES"
    # The price of hiding /grader: / itself gets no rights (docs/hardening.md).
    assert probe(task, "list", "/") == "EACCES"
    assert probe(task, "list", "/grader", policy="grader") == "ok"


def test_agent_cannot_execute_a_hidden_program(task):
    task.write_file("/grader/run", b"#!/bin/sh\necho graded\n", mode=0o755)
    assert task.exec(["/bin/echo", "runs"]).stdout == b"runs\n"
    with pytest.raises(DsecError) as exc:
        task.exec(["/grader/run"])
    assert exc.value.code == "permission"
    assert task.exec(["/grader/run"], policy="grader").stdout == b"graded\n"


@pytest.mark.xfail(strict=True, reason="Landlock (ABI <= 7) does not mediate stat(2): a hidden path's "
                   "existence, size and mode still show to root in the sandbox; the next test is the remedy")
def test_agent_cannot_stat_a_hidden_path(task):
    assert probe(task, "stat", "/grader/secret") == "EACCES"


# The agent policy without capabilities, for an agent run as a non-root user.
BARE_AGENT = {"read_only": ["/usr", "/etc"], "writable": ["/workspace", "/tmp", "/dev"], "hidden": ["/grader"],
              "scope_signals": True, "scope_abstract_unix": True, "capabilities": []}


def test_non_root_agent_without_capabilities_cannot_stat_or_chmod_grader_files(admin, probe_binary):
    # What covers stat and chmod, which Landlock does not: file modes, with the
    # agent a non-root user holding no capability (a non-root exec keeps only
    # NET_BIND_SERVICE unless its policy names capabilities) and the grader's
    # directory root-owned 0700.
    sb = make_armed(admin, probe_binary, policy=BARE_AGENT)
    try:
        sb.mkdir("/grader", mode=0o700)
        sb.write_file("/grader/secret", SECRET)
        sb.mkdir("/workspace")
        assert sb.exec(["chmod", "1777", "/workspace"], policy="grader").exit_code == 0
        assert probe(sb, "stat", "/workspace", user=1000) == "ok"
        assert probe(sb, "stat", "/grader/secret", user=1000) == "EACCES"
        assert probe(sb, "stat", "/grader/secret", policy="grader") == "ok"
        r = sb.exec(["sh", "-c", "touch /workspace/own && chmod 600 /workspace/own && echo ok"], user=1000)
        assert r.stdout == b"ok\n", r.stderr
        r = sb.exec(["chmod", "000", "/usr/local/bin/attack-probe"], user=1000)
        assert r.exit_code == 1 and b"Operation not permitted" in r.stderr
        # The same uid under no policy holds none either; one that names DAC_OVERRIDE can.
        assert probe(sb, "stat", "/grader/secret", user=1000, policy={"rest": "writable"}) == "EACCES"
        assert probe(sb, "stat", "/grader/secret", user=1000,
                     policy={"rest": "writable", "capabilities": ["DAC_OVERRIDE"]}) == "ok"
    finally:
        sb.destroy(force=True)


def test_agent_cannot_write_a_read_only_path_but_writes_its_own(task):
    assert probe(task, "open_rw", "/workspace/mine") == "ok"
    assert probe(task, "open_rw", "/etc/passwd") == "EACCES"
    assert probe(task, "mkdir", "/workspace/new-dir") == "ok"
    assert probe(task, "mkdir", "/usr/new-dir") == "EACCES"
    assert probe(task, "truncate", "/workspace/mine") == "ok"
    assert probe(task, "truncate", "/etc/passwd") == "EACCES"
    assert task.read_file("/etc/passwd").startswith(b"root:")


def test_agent_cannot_move_or_link_a_read_only_file_out(task):
    task.write_file("/workspace/a", b"a")
    assert probe(task, "rename", "/workspace/a", "/workspace/b") == "ok"
    assert probe(task, "link", "/workspace/b", "/workspace/c") == "ok"
    # A rename or a hard link into /workspace would make /etc/passwd writable there.
    assert probe(task, "rename", "/etc/passwd", "/workspace/passwd") in ("EACCES", "EXDEV")
    assert probe(task, "link", "/etc/passwd", "/workspace/passwd") in ("EACCES", "EXDEV")
    assert probe(task, "rename", "/grader/secret", "/workspace/secret") in ("EACCES", "EXDEV")
    assert not task.exists("/workspace/passwd") and not task.exists("/workspace/secret")
    assert task.read_file("/etc/passwd").startswith(b"root:")


def test_agent_cannot_write_through_a_planted_symlink(task):
    assert probe(task, "symlink", "/workspace/mine", "/workspace/to-mine") == "ok"
    assert probe(task, "open_rw", "/workspace/to-mine") == "ok"
    # Planting the link is allowed (its own dir); following it does not widen anything.
    assert probe(task, "symlink", "/etc/passwd", "/workspace/to-passwd") == "ok"
    assert probe(task, "open_rw", "/workspace/to-passwd") == "EACCES"
    assert probe(task, "symlink", "/grader/secret", "/workspace/to-secret") == "ok"
    assert probe(task, "open", "/workspace/to-secret") == "EACCES"
    assert probe(task, "open", "/workspace/to-secret", policy="grader") == "ok"


def test_paths_made_after_an_agent_exec_get_their_level_at_the_next(task):
    # dsec-init keeps the ruleset of a plan while the paths it was built from
    # are unchanged (csrc/init.c policy_ruleset): a new entry beside /grader
    # and a named path that appears later must not keep the old one.
    assert probe(task, "open", "/workspace/mine") == "ok"            # builds and keeps agent's ruleset
    assert sh(task, "mkdir -p /later /home/u && echo x > /later/f", policy="grader")[0] == 0
    assert probe(task, "open", "/later/f") == "ok"                   # rest: read_only
    assert probe(task, "open_rw", "/later/f") == "EACCES"
    assert probe(task, "mkdir", "/home/u/made") == "ok"              # /home: writable
    assert probe(task, "open", "/grader/secret") == "EACCES"


def test_the_host_file_api_is_not_limited_by_the_agent_policy(task, daemon, tmp_path):
    answers = tmp_path / "answers"
    answers.write_bytes(b"42\n")
    cp = daemon.cli("cp", str(answers), f"{task.id}:/grader/answers")
    assert cp.returncode == 0, cp.stderr
    assert task.read_file("/grader/answers") == b"42\n"
    assert probe(task, "open", "/grader/answers") == "EACCES"


# ------------------------------------------------------------ signals, sockets, ports


def test_agent_cannot_signal_the_graders_process(task):
    grader = task.spawn(["sleep", "600"], policy="grader")
    agent_bg = task.spawn(["sleep", "600"])          # the sandbox's default: agent
    try:
        assert probe(task, "fork_kill") == "ok"       # its own child
        assert probe(task, "kill", grader.pid, 15) == "EPERM"
        assert grader.status().state == "running"
        # Scoped to the exec's own processes: another agent exec's are out of scope too.
        assert probe(task, "kill", agent_bg.pid, 15) == "EPERM"
        assert probe(task, "kill", agent_bg.pid, 15, policy="grader") == "ok"
        assert probe(task, "kill", grader.pid, 15, policy="grader") == "ok"
        assert grader.wait().signal == 15
    finally:
        for p in (grader, agent_bg):
            try:
                p.kill()
            except DsecError:
                pass


def test_agent_cannot_reach_the_graders_abstract_socket(task):
    assert probe(task, "uself", "agent-own") == "ok"
    listener = task.spawn([PROBE_IN_SANDBOX, "ulisten", "grader-sock"], policy="grader")
    try:
        listening(listener)
        assert probe(task, "uconnect", "grader-sock") == "EPERM"
        assert probe(task, "uconnect", "grader-sock", policy="grader") == "ok"
        assert listener.wait().exit_code == 0
    finally:
        try:
            listener.kill()
        except DsecError:
            pass


def test_agent_connects_only_to_the_tcp_ports_its_policy_allows(task):
    allowed = task.spawn([PROBE_IN_SANDBOX, "listen", "80"], policy="grader")
    grader_port = task.spawn([PROBE_IN_SANDBOX, "listen", "9000"], policy="grader")
    try:
        listening(allowed)
        listening(grader_port)
        assert probe(task, "connect", "127.0.0.1", "80") == "ok"        # in agent's tcp_connect
        assert probe(task, "connect", "127.0.0.1", "9000") == "EACCES"
        assert probe(task, "connect", "127.0.0.1", "9000", policy="grader") == "ok"
        assert grader_port.wait().exit_code == 0 and allowed.wait().exit_code == 0
    finally:
        for p in (allowed, grader_port):
            try:
                p.kill()
            except DsecError:
                pass


def test_an_exec_binds_only_the_tcp_ports_its_policy_allows(task):
    binds_8080 = {"rest": "writable", "tcp_bind": [8080]}
    assert probe(task, "listen", "9000", policy=binds_8080) == "EACCES"
    server = task.spawn([PROBE_IN_SANDBOX, "listen", "8080"], policy=binds_8080)
    try:
        listening(server)
        assert probe(task, "connect", "127.0.0.1", "8080", policy="grader") == "ok"
        assert server.wait().exit_code == 0
    finally:
        try:
            server.kill()
        except DsecError:
            pass


# ------------------------------------------------------------ every way an exec starts


def test_background_traced_and_terminal_execs_take_the_policy(task):
    proc = task.spawn(["cat", "/grader/secret"])
    assert proc.wait().exit_code == 1
    assert task.spawn(["cat", "/grader/secret"], policy="grader").wait().exit_code == 0
    traced = task.exec(["cat", "/grader/secret"], trace=True)          # the daemon's helper starts it
    assert traced.exit_code == 1 and b"Permission denied" in traced.stderr and traced.policy == "agent"
    assert task.exec(["cat", "/grader/secret"], trace=True, policy="grader").stdout == SECRET
    tty = task.exec(["cat", "/grader/secret"], pty=True)
    assert tty.exit_code == 1 and b"Permission denied" in tty.stdout


def test_helper_started_execs_take_the_policy(daemon_factory, busybox_rootfs, probe_binary):
    d = daemon_factory('exec_via = "helper"\n')
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        sb = make_armed(c, probe_binary, policy="agent")
        sb.write_file("/grader/secret", SECRET)
        assert probe(sb, "open", "/workspace") in ("ok", "ENOENT")
        assert probe(sb, "open", "/etc/passwd") == "ok"
        assert probe(sb, "open", "/grader/secret") == "EACCES"
        assert probe(sb, "open", "/grader/secret", policy="grader") == "ok"
    finally:
        c.close()


def test_a_sandboxs_policy_holds_across_a_daemon_restart(daemon_factory, busybox_rootfs, probe_binary):
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = make_armed(c, probe_binary, policy="agent")
    sb.write_file("/grader/secret", SECRET)
    assert probe(sb, "open", "/grader/secret") == "EACCES"
    c.close()
    d.stop()
    d.start()
    c = d.client()
    try:
        sb = c.get(sb.id)
        assert sb.info["policy"]["name"] == "agent"
        assert probe(sb, "open", "/etc/passwd") == "ok"
        assert probe(sb, "open", "/grader/secret") == "EACCES"
        assert probe(sb, "open", "/grader/secret", policy="grader") == "ok"
    finally:
        c.close()


# ------------------------------------------------------------ denials, errors, listing


def test_a_denial_shows_in_events_and_counts(task, daemon):
    before = task.inspect()["denials"].get("by_policy", {}).get("agent", 0)
    r = task.exec(["cat", "/grader/secret"])
    assert r.exit_code == 1 and r.denials >= 1 and r.policy == "agent"
    ok = task.exec(["cat", "/grader/secret"], policy="grader")
    assert ok.exit_code == 0 and ok.denials is None            # a grader's exec is not counted
    after = task.inspect()["denials"]
    assert after["by_policy"]["agent"] >= before + 1 and "grader" not in after["by_policy"]
    out = daemon.cli("events", task.id, "--replay", "--no-follow", "--json")
    assert out.returncode == 0, out.stderr
    denied = [e for e in map(json.loads, out.stdout.decode().splitlines()) if e["event"] == "denied"]
    assert any(e.get("path") == "/grader/secret" and e["syscall"] in ("open", "openat") and e["errno"] == "EACCES"
               and e["policy"] == "agent" and e["argv0"] == "cat" for e in denied), denied
    info = daemon.cli("info", "--json")
    assert json.loads(info.stdout)["policy"]["denials"]["monitor"] == "on"


def test_inline_policies_and_their_errors(task):
    inline = {"rest": "writable", "hidden": ["/workspace"]}
    r = task.exec(["cat", "/workspace/mine"], policy=inline)
    assert r.exit_code == 1 and r.policy == "inline"
    assert task.exec(["cat", "/grader/secret"], policy=inline).stdout == SECRET
    with pytest.raises(BadRequest) as exc:
        task.exec(["true"], policy={"hidden": ["relative"]})
    assert exc.value.detail["field"] == "exec: policy.hidden[0]"
    with pytest.raises(NotFound):
        task.exec(["true"], policy="no-such-policy")


def test_a_symlink_where_a_policy_names_a_path_fails_the_exec(task):
    assert sh(task, "ln -sfn /grader /workspace/link-to-grader", policy="grader")[0] == 0
    real = {"rest": "writable", "hidden": ["/workspace/real"]}
    assert task.exec(["true"], policy=real).exit_code == 0
    with pytest.raises(DsecError) as exc:
        task.exec(["true"], policy={"rest": "writable", "hidden": ["/workspace/link-to-grader"]})
    assert exc.value.detail.get("step") == "landlock" and exc.value.detail.get("errno") == "ELOOP"


def test_policy_ls_and_info_say_what_is_enforced(daemon):
    out = daemon.cli("policy", "ls")
    assert out.returncode == 0, out.stderr
    assert "agent" in out.stdout.decode() and "unrestricted" in out.stdout.decode()
    listing = json.loads(daemon.cli("policy", "ls", "--json").stdout)
    agent = next(p for p in listing["policies"] if p["name"] == "agent")
    assert agent["enforceable"] and agent["needs"]["scope_signals"] == 6 and agent["hidden"] == ["/grader"]
    fields = json.loads(daemon.cli("info", "--json").stdout)["policy"]["fields"]
    assert fields["tcp_connect"] == {"abi": 4, "available": True}
