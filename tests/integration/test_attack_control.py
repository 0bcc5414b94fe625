"""Adversarial suite, part 2: the control plane and the other sandboxes are
out of reach.

* Nothing of the daemon is visible or reachable inside: its socket, state
  dir, journal, log and config do not exist there, no fd of it is inherited,
  no in-sandbox control socket exists to forge requests on.
* The daemon's own file API, racing a sandbox that swaps symlinks under it,
  never reads, writes or lists anything outside that sandbox.
* One sandbox cannot see or signal another's processes, read its files or
  reach its network.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from attack_kit import facts, make_armed, outcome, run_probe, upper_dir

from dsecd.errors import BadRequest, DsecError

pytestmark = pytest.mark.attack


@pytest.fixture(scope="module")
def pair(admin, probe_binary):
    """Two sandboxes of the same image: an attacker and its victim."""
    a = make_armed(admin, probe_binary, memory="64M")
    b = make_armed(admin, probe_binary, memory="64M")
    yield a, b
    for sb in (a, b):
        try:
            sb.destroy(force=True)
        except DsecError:
            pass


def test_daemon_files_are_not_visible_inside(armed, daemon):
    assert outcome(armed, "stat", "/etc/passwd") == "ok"         # neighbour
    journal = daemon.state / "journal.log"
    # The sandboxes' dir (with a capped writable layer a sandbox has no dir of its
    # own there: its overlay is mounted on sandboxes/.mnt in its own namespace).
    sbdir = Path(armed.inspect().get("dir") or daemon.state / "sandboxes" / ".mnt")
    for host_path in (daemon.socket, daemon.state, journal, daemon.log, daemon.config, sbdir,
                      os.path.dirname(daemon.socket)):
        assert os.path.exists(host_path), host_path                 # it is there on the host ...
        assert outcome(armed, "stat", host_path) == "ENOENT", host_path   # ... and not inside


def test_no_daemon_socket_or_fd_reaches_the_sandbox(armed, daemon):
    lines = run_probe(armed, "fds")
    assert facts(lines)["extra"] == "0", lines                      # only stdin, stdout, stderr
    # The sandbox's PID 1 holds /dev/null on 0-2, with a capped writable
    # layer that layer's own mount as fd 3 (for a restarted daemon), and when
    # it forks execs (sandbox.exec_via = init) both ends of the exec channel
    # as fds 4 and 5 (the daemon's, for a restarted daemon) and a signalfd.
    # It is non-dumpable, so no sandbox process can follow those fds.
    capped = bool(armed.inspect().get("disk"))
    via_init = armed.exec(["sh", "-c", "echo $PPID"]).stdout == b"1\n"
    # (Uncapped, the signalfd takes the free fd 3.)
    want = [str(fd).encode() for fd in range(3 + capped + (3 if via_init else 0))]
    # Init closes an exec's stdio once it has exec'ed, which may be just after
    # the exec (here `ls`) looks: what init keeps is what stays.
    for _ in range(50):
        held = armed.exec(["ls", "/proc/1/fd"]).stdout.split()
        if held == want:
            break
        time.sleep(0.02)
    assert held == want
    for fd in (0, 4, 5):
        assert outcome(armed, "open", f"/proc/1/fd/{fd}") == "EACCES"
    # Unix sockets in the sandbox's view: none is the daemon's (or any host) socket.
    unix = armed.exec(["cat", "/proc/net/unix"]).stdout.decode()
    assert daemon.socket not in unix and "dsecd" not in unix, unix
    env = armed.exec(["cat", "/proc/self/environ"]).stdout.decode()
    assert "DSEC" not in env and daemon.socket not in env, env


def test_forged_rpc_has_nowhere_to_go(armed, daemon):
    # The protocol socket is a path in the host's mount namespace only; the
    # same path inside (even created by the sandbox) is just a file of its own.
    sock = daemon.socket
    r = armed.exec(["sh", "-c", f"mkdir -p {os.path.dirname(sock)} && echo forged > {sock}; "
                                f"nc -U {sock} </dev/null 2>&1; echo rc=$?"])
    assert b"rc=0" not in r.stdout
    assert daemon.client().request("ping")          # the real one is unaffected
    assert Path(sock).is_socket()                   # and still a socket, not the sandbox's file


# ---------------------------------------------------------------- file API races

SWAP_LOOP = """
cd /tmp
echo sandbox > plain; mkdir -p mine; touch mine/sandbox-entry
while :; do
  ln -sfn {secret} x.l; mv -fT x.l x
  echo sandbox > x.r; mv -fT x.r x
  ln -sfn ../../../../../../..{secret} x.l; mv -fT x.l x
  ln -sfn /etc/shadow x.l; mv -fT x.l x
  ln -sfn {hostdir} p.l; mv -fT p.l p
  ln -sfn /tmp/mine p.l; mv -fT p.l p
  ln -sfn ../../../../../..{hostdir} p.l; mv -fT p.l p
  ln -sfn /tmp/mine p.l; mv -fT p.l p
done
"""


def _race(seconds: float, op, want: set[str]) -> dict:
    """Run `op` for `seconds`, longer (up to 5x) until every outcome in `want`
    was seen: on a loaded host the swap loop may get little CPU."""
    counts: dict[str, int] = {}
    start = time.monotonic()
    while True:
        try:
            key = op()
        except DsecError as err:
            key = err.code
        counts[key] = counts.get(key, 0) + 1
        spent = time.monotonic() - start
        if spent > 5 * seconds or (spent > seconds and want <= set(counts)):
            return counts


def test_file_api_racing_symlink_swaps_stays_inside(admin, tmp_path):
    """A loop in the sandbox renames symlinks to host paths (absolute,
    `../../..`, /etc/shadow) over the paths the daemon reads, writes and
    lists; whatever the interleaving, the daemon only ever touches the
    sandbox's own files (openat2 RESOLVE_IN_ROOT)."""
    hostdir = tmp_path / "host-dir"
    hostdir.mkdir()
    (hostdir / "host-only-entry").write_text("host")
    secret = tmp_path / "host-secret"
    secret.write_text("HOST SECRET")
    shadow = Path("/etc/shadow").read_bytes() if os.path.exists("/etc/shadow") else None
    # qos "ls": a best-effort sandbox runs SCHED_IDLE, and the client and daemon
    # hammering the file API kept both cores busy enough to starve its swap loop
    # (5,446 listings in 5 s, not one swap seen).
    sb = admin.create(image="busybox", memory="64M", qos="ls")
    try:
        loop = SWAP_LOOP.format(secret=secret, hostdir=hostdir)
        sb.write_file("/root/swap.sh", loop.encode())
        r = sb.exec(["sh", "-c", "setsid sh /root/swap.sh </dev/null >/dev/null 2>&1 & echo started"])
        assert r.stdout == b"started\n"
        deadline = time.monotonic() + 10
        while sb.exec(["test", "-L", "/tmp/p"]).exit_code != 0 and time.monotonic() < deadline:
            time.sleep(0.05)                             # the loop is running

        def read() -> str:
            data = sb.read_file("/tmp/x")
            assert data == b"sandbox\n" and data != shadow, data[:64]
            return "sandbox-data"

        def listing() -> str:
            names = {e["name"] for e in sb.list_files("/tmp/p")}
            assert "host-only-entry" not in names, names
            return "listed-sandbox" if "sandbox-entry" in names else "listed-other"

        def write() -> str:
            sb.write_file("/tmp/p/dropped", b"from the daemon", parents=False)
            sb.write_file("/tmp/x", b"sandbox\n")
            return "written"

        reads = _race(1.0, read, {"sandbox-data", "not_found"})
        lists = _race(1.0, listing, {"listed-sandbox", "not_found"})
        writes = _race(1.0, write, {"written"})
        # The race really ran: both sides of each swap were seen.
        assert reads.get("sandbox-data") and reads.get("not_found"), reads
        assert lists.get("listed-sandbox") and lists.get("not_found"), lists
        assert writes.get("written"), writes
        assert set(reads) | set(lists) | set(writes) <= {"sandbox-data", "listed-sandbox", "listed-other",
                                                          "written", "not_found"}
        assert secret.read_text() == "HOST SECRET"
        assert sorted(os.listdir(hostdir)) == ["host-only-entry"]
        assert not os.path.exists(Path("/tmp/mine/dropped"))
        assert sb.read_file("/tmp/mine/dropped") == b"from the daemon"     # where it belongs
    finally:
        sb.destroy(force=True)


def test_file_api_does_not_read_or_write_kernel_interfaces(admin):
    """procfs files are S_IFREG, but the daemon touches them with all its
    privileges: a planted symlink /root/out -> /proc/1/comm (or /proc/mtrr,
    ...) would make a client's innocent write_file a kernel write, and
    /root/ks -> /proc/kallsyms would read real kernel addresses (hidden from
    the sandbox itself). The file API refuses files on kernel file systems."""
    sb = admin.create(image="busybox", memory="64M")
    try:
        sb.exec(["sh", "-c", "ln -s /proc/1/comm /root/out; ln -s /proc/meminfo /root/ks; "
                             "ln -s ../../proc/1/status /root/st"])
        sb.write_file("/root/plain", b"data")                          # neighbour
        assert sb.read_file("/root/plain") == b"data"
        with pytest.raises(BadRequest, match="kernel interface"):
            sb.write_file("/root/out", b"pwned", atomic=False)          # in place: refused
        sb.write_file("/root/out", b"pwned", atomic=True)          # atomic: the link is replaced
        assert sb.exec(["cat", "/proc/1/comm"]).stdout == b"dsec-init\n"
        assert sb.stat("/root/out")["type"] == "file" and sb.read_file("/root/out") == b"pwned"
        for path in ("/root/ks", "/root/st", "/proc/1/environ", "/proc/meminfo", "/proc/self/status"):
            with pytest.raises(BadRequest, match="kernel interface"):
                sb.read_file(path)
        with pytest.raises(BadRequest):         # masked inside by a /dev/null bind: not a file
            sb.read_file("/proc/kallsyms")
        assert sb.exec(["head", "-c", "1", "/proc/meminfo"]).exit_code == 0   # inside: its own view
    finally:
        sb.destroy(force=True)


def test_hardlinks_cannot_reach_the_host_or_the_image(admin):
    # Hard links only stay inside one file system: the overlay (its upper dir
    # on the host) and the sandbox's tmpfs; a link to a lower-layer file is
    # copied up first, so writing it through the daemon changes the sandbox's
    # copy, never the shared layer.
    sb = admin.create(image="busybox", memory="64M")
    try:
        r = sb.exec(["sh", "-c", "ln /etc/passwd /root/pw && echo ok; ln /etc/passwd /tmp/pw 2>&1; echo rc=$?"])
        assert r.stdout.startswith(b"ok\n") and b"rc=0" not in r.stdout       # EXDEV across mounts
        sb.write_file("/root/pw", b"owned::0:0::/:/bin/sh\n", atomic=False)   # in place, through the link
        assert sb.read_file("/etc/passwd") == b"owned::0:0::/:/bin/sh\n"
        other = admin.create(image="busybox", memory="64M")
        assert b"owned" not in other.read_file("/etc/passwd")
        other.destroy()
    finally:
        sb.destroy(force=True)


# ---------------------------------------------------------------- sandbox to sandbox

def _host_pids(daemon, sb_id: str) -> set[int]:
    pids = set()
    for top in daemon.cgroup_dirs():
        procs = top / sb_id / "cgroup.procs"
        if procs.exists():
            pids.update(int(p) for p in procs.read_text().split())
    return pids


def test_sandboxes_cannot_see_or_signal_each_other(pair, daemon):
    a, b = pair
    r = b.exec(["sh", "-c", "setsid sleep 731 </dev/null >/dev/null 2>&1 & echo $!"])
    inner_pid = int(r.stdout)
    victims = _host_pids(daemon, b.id)
    assert victims, "the victim's processes are in its cgroup on the host"
    ps = a.exec(["ps", "-o", "pid,args"]).stdout
    assert b"sleep 731" not in ps, ps
    assert outcome(a, "kill", "1", "0") == "ok"                 # neighbour: its own init
    for pid in victims:
        assert outcome(a, "kill", pid, "9") == "ESRCH"
        assert outcome(a, "stat", f"/proc/{pid}") == "ENOENT"
    # The victim's pid number inside its own namespace means nothing in A's.
    assert outcome(a, "stat", f"/proc/{inner_pid}/cmdline") == "ENOENT"
    assert b"sleep 731" in b.exec(["ps", "-o", "args"]).stdout     # still alive


def test_sandboxes_cannot_read_each_others_files(pair, daemon):
    a, b = pair
    b.write_file("/root/secret-7f3a", b"victim data")
    b.exec(["sh", "-c", "echo victim tmp > /tmp/secret-7f3a"])
    upper = upper_dir(b.inspect())
    assert (upper / "root" / "secret-7f3a").exists()
    r = a.exec(["sh", "-c", "find / -name 'secret-7f3a*' 2>/dev/null; grep -rs 'victim data' /root /tmp /work"])
    assert r.stdout == b"", r.stdout
    assert outcome(a, "stat", str(daemon.state / "sandboxes")) == "ENOENT"
    assert outcome(a, "stat", str(upper)) in ("ENOENT", "EACCES")   # /proc/<host pid>/...: not its pid
    assert outcome(a, "stat", "/root") == "ok"


def test_sandboxes_cannot_reach_each_others_network(pair):
    # net "none": each sandbox has a loopback of its own. A serves on
    # 127.0.0.1:7777 and reaches itself; B's 127.0.0.1 is another interface.
    a, b = pair
    a.exec(["sh", "-c", "setsid attack-probe listen 7777 </dev/null >/tmp/listen.out 2>&1 &"])
    deadline = time.monotonic() + 5
    while b"listening" not in a.read_file("/tmp/listen.out") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcome(b, "connect", "127.0.0.1", "7777") == "ECONNREFUSED"
    assert outcome(a, "connect", "127.0.0.1", "7777") == "ok"          # neighbour
