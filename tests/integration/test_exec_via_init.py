"""Execs forked by the sandbox's dsec-init (sandbox.exec_via = "init", the
default where the kernel has PIDFD_SIGNAL_PROCESS_GROUP; csrc/init.c,
dsecd/initlink.py), and the daemon's helper where init cannot take one.

Which path ran shows in the exec's parent pid inside the sandbox: 1 when
init forked it, 0 when the helper did (its parent, the daemon, is outside
the sandbox's pid namespace)."""

from __future__ import annotations

import asyncio
import signal
import time
import tomllib
from pathlib import Path

import pytest

import dsecd
from dsecd import native
from dsecd.backends.container import cap_mask
from dsecd.errors import DsecError, NotFound

pytestmark = pytest.mark.skipif(native.probe_pidfd_group_signal() != 0,
                                reason="no PIDFD_SIGNAL_PROCESS_GROUP (Linux < 6.9): execs use the helper")

PPID = ["sh", "-c", "echo $PPID"]
SLEEPERS = ["sh", "-c", "ps -o comm | grep -c sleep || true"]     # how many `sleep` run in the sandbox


def _sleepers_once_reaped(sandbox, within_s: float = 5.0) -> bytes:
    """SLEEPERS' count once it is 0, or the last count after `within_s`.

    A group's SIGKILL is sent when the exec's answer comes, but a killed
    process that was not the exec's leader is a zombie (which `ps` lists)
    until the sandbox's init has reaped it: on a loaded host that can come
    after the next exec's `ps`."""
    deadline = time.monotonic() + within_s
    while True:
        left = sandbox.exec(SLEEPERS).stdout.strip()
        if left == b"0" or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _caps(status: bytes) -> dict[str, int]:
    return {k.decode(): int(v, 16) for k, v in (line.split(b":\t") for line in status.splitlines())
            if k.startswith(b"Cap")}


def _default_cap_names() -> list[str]:
    """The embedded default (the test daemons configure no capabilities)."""
    return tomllib.loads((Path(dsecd.__file__).parent / "default.toml").read_text())["sandbox"]["capabilities"]


def _configured_caps() -> int:
    return cap_mask(_default_cap_names())


def _sandbox_then_stop(d, rootfs: str, ppid: bytes, sig: int = signal.SIGTERM) -> str:
    """A sandbox of daemon `d` whose exec has parent pid `ppid` (b"1": forked
    by init, b"0": by the helper); then `d` is stopped with `sig`."""
    c = d.client()
    c.import_image(rootfs, "busybox")
    sb = c.create(image="busybox")
    assert sb.exec(PPID).stdout == ppid + b"\n"
    c.close()
    d.stop(sig)
    return sb.id


def test_a_plain_exec_is_forked_by_init(sandbox):
    assert sandbox.exec(PPID).stdout == b"1\n"


def test_stdin_and_streaming_execs_are_forked_by_init_traced_ones_by_the_helper(sandbox):
    r = sandbox.exec(["sh", "-c", "cat; echo $PPID"], stdin=b"in\n")
    assert r.stdout == b"in\n1\n"
    assert b"".join(d for fd, d in sandbox.exec_stream(PPID) if fd == 1) == b"1\n"
    r = sandbox.exec(PPID, trace=True)
    assert r.stdout == b"0\n" and r.trace is not None


def test_a_streaming_exec_s_timeout_kills_its_group(sandbox):
    t0 = time.monotonic()
    chunks = list(sandbox.exec_stream(["sh", "-c", "echo start; sleep 30 & sleep 30"], timeout=1))
    assert (1, b"start\n") in chunks and time.monotonic() - t0 < 5
    assert _sleepers_once_reaped(sandbox) == b"0"


def test_a_request_too_big_for_one_packet_uses_the_helper(sandbox):
    big = "x" * (native.INIT_MAX_STRINGS + 1)
    r = sandbox.exec(["sh", "-c", "echo $PPID ${#1}", "sh", big])
    assert r.stdout == f"0 {len(big)}\n".encode()


def test_the_exec_gets_the_configured_caps_and_init_holds_none_in_effect(sandbox):
    want = _configured_caps()
    for user, kept in ((0, want), (65534, want & cap_mask(["NET_BIND_SERVICE"]))):    # non-root: as docker's
        caps = _caps(sandbox.exec(["cat", "/proc/self/status"], user=user).stdout)
        assert (caps["CapEff"], caps["CapPrm"], caps["CapBnd"], caps["CapAmb"]) == (kept, kept, kept, kept), user
    init = _caps(sandbox.exec(["cat", "/proc/1/status"]).stdout)
    assert init["CapEff"] == 0 and init["CapInh"] == 0 and init["CapAmb"] == 0
    assert init["CapPrm"] == want | cap_mask(["SETUID", "SETGID", "SETPCAP"]) == init["CapBnd"]


def test_ids_cwd_env_umask_and_a_session_of_its_own(sandbox):
    r = sandbox.exec(["sh", "-c", "id -u; id -g; pwd; echo $FOO; umask; cut -d' ' -f6 /proc/self/stat; echo $$"],
                     env={"FOO": "bar"}, cwd="/tmp", user=1234)
    uid, gid, cwd, foo, umask, session, pid = r.stdout.split()
    assert (uid, gid, cwd, foo, umask) == (b"1234", b"1234", b"/tmp", b"bar", b"0022")
    assert session == pid                  # setsid: its own session and process group


def test_only_stdio_is_open_and_the_seccomp_filter_is_init_s(sandbox):
    r = sandbox.exec(["sh", "-c", "ls /proc/self/fd; grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status"])
    lines = r.stdout.split(b"\n")
    assert sorted(lines[:4]) == [b"0", b"1", b"2", b"3"]   # 3: ls's own directory fd
    assert b"Seccomp:\t2" in r.stdout and b"NoNewPrivs:\t1" in r.stdout
    assert sandbox.exec(["unshare", "-U", "true"]).exit_code != 0      # the filter denies new namespaces


def _status_and_more(sandbox, via_helper: bool) -> list[bytes]:
    """An exec's view of itself: /proc/self/status lines that differ by how a
    process was set up, its cgroups, its OOM score, umask, parent. A request
    over init's packet size goes to the helper."""
    pad = ["x" * (native.INIT_MAX_STRINGS + 1)] if via_helper else []
    script = ("grep -E '^(Uid|Gid|Groups|NoNewPrivs|Seccomp|SigBlk|SigIgn|Cap[A-Za-z]+):' /proc/self/status; "
              "cat /proc/self/cgroup; echo oom $(cat /proc/self/oom_score_adj); "
              "echo ppid $PPID; echo umask $(umask)")
    return sandbox.exec(["sh", "-c", script, "sh", *pad], user=1234).stdout.splitlines()


def test_an_exec_by_init_is_set_up_as_one_by_the_helper(sandbox):
    by_init, by_helper = _status_and_more(sandbox, False), _status_and_more(sandbox, True)
    assert b"ppid 1" in by_init and b"ppid 0" in by_helper
    assert b"oom 0" in by_init and b"umask 0022" in by_init and b"Uid:\t1234\t1234\t1234\t1234" in by_init
    assert ([x for x in by_init if not x.startswith(b"ppid")] ==
            [x for x in by_helper if not x.startswith(b"ppid")])


def test_an_exec_cannot_lower_its_oom_score(sandbox):
    for user in (0, 1234):
        r = sandbox.exec(["sh", "-c", "echo -1 > /proc/self/oom_score_adj"], user=user)
        assert r.exit_code != 0, user


def test_a_path_entry_that_cannot_run_is_skipped_and_init_keeps_serving(sandbox):
    # A non-executable `true` earlier in PATH: the search goes on to /bin/true.
    sandbox.exec(["sh", "-c", "mkdir -p /usr/local/bin && echo x > /usr/local/bin/true && chmod 644 /usr/local/bin/true"])
    try:
        r = sandbox.exec(["true"])
        assert (r.exit_code, r.signal) == (0, None)
        assert sandbox.exec(PPID).stdout == b"1\n"
    finally:
        sandbox.exec(["rm", "-f", "/usr/local/bin/true"])


def test_errors_before_execve_name_their_step(sandbox):
    with pytest.raises(NotFound, match="no such file or command"):
        sandbox.exec(["no-such-command"])
    with pytest.raises(NotFound, match="working directory"):
        sandbox.exec(["true"], cwd="/no/such/dir")
    sandbox.exec(["sh", "-c", "echo x > /tmp/f; chmod 644 /tmp/f"])
    with pytest.raises(DsecError, match="permission denied"):
        sandbox.exec(["/tmp/f"])
    assert sandbox.exec(PPID).stdout == b"1\n"           # the channel is still up


def test_exit_codes_signals_and_output(sandbox):
    r = sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (r.exit_code, r.signal, r.stdout, r.stderr) == (7, None, b"out\n", b"err\n")
    r = sandbox.exec(["sh", "-c", "kill -TERM $$"])
    assert (r.exit_code, r.signal) == (None, 15)


def test_a_timeout_kills_the_exec_s_whole_group(sandbox):
    t0 = time.monotonic()
    r = sandbox.exec(["sh", "-c", "sleep 30 & sleep 30"], timeout=1)
    assert r.timed_out and r.signal == 9 and time.monotonic() - t0 < 5
    assert _sleepers_once_reaped(sandbox) == b"0"


def test_many_execs_at_once_each_get_their_own_answer(daemon):
    async def go():
        async with dsecd.Client(daemon.socket) as c:
            sb = await c.create(image="busybox", memory="128M")
            try:
                results = await asyncio.gather(*(sb.exec(["sh", "-c", f"echo {i}; exit {i % 5}"])
                                                 for i in range(200)))
                for i, r in enumerate(results):
                    assert (r.stdout, r.exit_code) == (f"{i}\n".encode(), i % 5)
            finally:
                await sb.destroy(force=True)
    asyncio.run(go())


@pytest.mark.parametrize("kw", [{}, {"stdin": b"x"}, {"user": 1234}], ids=["collected", "with-stdin", "non-root"])
def test_a_cancelled_exec_is_killed(daemon, kw):
    async def go():
        async with dsecd.Client(daemon.socket) as c:
            sb = await c.create(image="busybox", memory="128M")
            try:
                other = dsecd.Client(daemon.socket)
                await other.connect()
                task = asyncio.create_task(dsecd.client.Sandbox(other, sb.id, {}).exec(["sleep", "1000"], **kw))
                for _ in range(100):
                    if (await sb.exec(SLEEPERS)).stdout == b"1\n":
                        break
                    await asyncio.sleep(0.05)
                await other.close()          # the client goes: its exec is cancelled
                task.cancel()
                for _ in range(100):
                    left = (await sb.exec(SLEEPERS)).stdout
                    if left == b"0\n":
                        break
                    await asyncio.sleep(0.05)
                assert left == b"0\n"
            finally:
                await sb.destroy(force=True)
    asyncio.run(go())


def test_destroy_ends_a_running_exec_as_killed(daemon):
    async def go():
        async with dsecd.Client(daemon.socket) as c:
            sb = await c.create(image="busybox", memory="128M")
            run = asyncio.create_task(sb.exec(["sleep", "1000"]))
            await asyncio.sleep(0.5)
            await sb.destroy(force=True)
            r = await asyncio.wait_for(run, 10)
            assert (r.exit_code, r.signal) == (None, 9)
    asyncio.run(go())


def test_exec_via_helper_uses_the_helper_also_after_a_restart_with_init(daemon_factory, busybox_rootfs):
    d = daemon_factory('exec_via = "helper"\n')
    sb_id = _sandbox_then_stop(d, busybox_rootfs, b"0")
    # Restarted with the default exec_via = "init": that init has no channel to take back.
    d.config.write_text(d.config.read_text().replace('exec_via = "helper"\n', ""))
    d.start()
    c = d.client()
    r = c.get(sb_id).exec(PPID)
    assert (r.stdout, r.exit_code) == (b"0\n", 0)
    assert c.create(image="busybox").exec(PPID).stdout == b"1\n"
    c.close()


def test_a_restarted_daemon_takes_the_channel_back(daemon_factory, busybox_rootfs):
    d = daemon_factory()
    sb_id = _sandbox_then_stop(d, busybox_rootfs, b"1", signal.SIGKILL)    # the worst case: no clean shutdown
    d.start()                # adopts the sandbox and takes init's channel back
    c = d.client()
    sb = c.get(sb_id)
    for _ in range(3):
        r = sb.exec(PPID)
        assert (r.stdout, r.exit_code) == (b"1\n", 0)
    r = sb.exec(["sh", "-c", "sleep 30"], timeout=0.5)
    assert r.timed_out and r.signal == 9
    c.close()


def test_a_restart_with_wider_capabilities_leaves_init_to_the_helper(daemon_factory, busybox_rootfs):
    d = daemon_factory()
    sb_id = _sandbox_then_stop(d, busybox_rootfs, b"1")
    wider = [*_default_cap_names(), "NET_RAW"]
    d.config.write_text(d.config.read_text().replace("[sandbox]\n", f"[sandbox]\ncapabilities = {wider!r}\n", 1)
                        .replace("'", '"'))
    d.start()
    c = d.client()
    r = c.get(sb_id).exec(["sh", "-c", "echo $PPID; grep CapEff /proc/self/status"])
    ppid, caps = r.stdout.split(b"\n")[:2]
    assert ppid == b"0"                         # init holds the old set: the helper gives the new one
    assert _caps(caps + b"\n")["CapEff"] == cap_mask(wider)
    c.close()


def test_a_bad_exec_via_stops_the_daemon(daemon_factory):
    d = daemon_factory('exec_via = "zygote"\n', start=False)
    with pytest.raises(RuntimeError, match="exec_via must be init or helper"):
        d.start()


def test_an_older_init_leaves_supplementary_groups_to_the_helper(daemon_factory, busybox_rootfs):
    """A sandbox re-adopted with an init that is not this build's (its binary
    replaced since: an upgrade) may refuse the groups flag: an exec with
    groups then goes by the daemon's helper (its parent outside the sandbox:
    $PPID 0) and gets them; one without stays with init ($PPID 1)."""
    import os
    import shutil

    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    sb.exec(["sh", "-c", "echo 'agent:x:2000:2001::/:/bin/sh' >> /etc/passwd; echo 'team:x:3000:agent' >> /etc/group"])
    c.close()
    d.stop()
    # The init the daemon starts is in its copy of its code (dsecd/pinned.py),
    # which the next start of the same version uses again.
    [init] = d.state.glob("code/*/dsecd/libexec/dsec-init")
    fresh = init.with_name(".dsec-init.test")
    shutil.copy2(init, fresh)
    os.replace(fresh, init)              # the same bytes, another file: the running init is not it
    d.start()
    c = d.client()
    sb = c.get(sb.id)
    r = sb.exec(["sh", "-c", "echo $PPID; grep ^Groups: /proc/self/status"], user="agent")
    assert r.stdout.split() == [b"0", b"Groups:", b"2001", b"3000"], r
    assert sb.exec(["sh", "-c", "echo $PPID"]).stdout == b"1\n"
    c.close()
