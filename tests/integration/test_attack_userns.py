"""Sandbox root is an unprivileged host uid (per-sandbox user namespace).

Each forbidden thing is asserted to fail with its errno or outcome, next to
an allowed neighbour that must still work (docs/hardening.md "User
namespaces"). Sandboxes come from the module's daemon, which runs with the
default `[sandbox] userns = true`.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from attack_kit import upper_dir

pytestmark = pytest.mark.attack

USERNS_SIZE = 65536


def host_ids(pid: int) -> tuple[list[int], list[int]]:
    """Real, effective, saved and fs uids and gids of a host pid, as the host sees them."""
    uids = gids = []
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            uids = [int(x) for x in line.split()[1:]]
        elif line.startswith("Gid:"):
            gids = [int(x) for x in line.split()[1:]]
    return uids, gids


def sandbox_pids(sb) -> list[int]:
    """Host pids of every process of the sandbox, from its cgroup."""
    info = sb.inspect()
    procs = Path(next(iter(info["cgroups"].values()))) / "cgroup.procs"
    return [int(p) for p in procs.read_text().split()]


def uid_base(sb) -> int:
    line = Path(f"/proc/{sb.inspect()['init_pid']}/uid_map").read_text().split()
    assert line[0] == "0" and int(line[2]) == USERNS_SIZE, line
    return int(line[1])


def run(sb, script: str, **kw):
    return sb.exec(["sh", "-c", script], **kw)


def bind_host_root_file(sb, target: str) -> None:
    """As host root, in the sandbox's mount namespace: a root-owned 0644 file
    in a root-owned 0755 dir, bind-mounted onto `target` (what a careless
    volume mount would look like). It dies with the sandbox's namespace."""
    run(sb, f"touch {target}")
    script = ("mkdir -m 755 /tmp/.host && echo host > /tmp/.host/file && chmod 644 /tmp/.host/file "
              f"&& mount --bind /tmp/.host/file {target}")
    subprocess.run(["nsenter", "-t", str(sb.inspect()["init_pid"]), "-m", "sh", "-c", script],
                   check=True, capture_output=True)


def test_root_inside_is_unprivileged_uid_on_host(sandbox):
    r = run(sandbox, "id -u; id -g; sleep 30 >/dev/null 2>&1 &")
    assert r.stdout.split() == [b"0", b"0"]
    base = uid_base(sandbox)
    assert base >= USERNS_SIZE                  # nowhere near host root or host users
    pids = sandbox_pids(sandbox)
    assert len(pids) >= 2                       # init and the background sleep
    for pid in pids:
        uids, gids = host_ids(pid)
        assert uids == [base] * 4 and gids == [base] * 4, (pid, uids, gids)


def test_exec_as_other_user_maps_into_the_range(sandbox):
    base = uid_base(sandbox)
    r = run(sandbox, "id -u; sleep 30 >/dev/null 2>&1 &", user=1000)
    assert r.stdout.split() == [b"1000"]
    assert any(host_ids(p)[0] == [base + 1000] * 4 for p in sandbox_pids(sandbox))


def test_user_outside_the_range_is_a_bad_request(sandbox, client):
    from dsecd.errors import BadRequest

    with pytest.raises(BadRequest, match="user namespace maps"):
        sandbox.exec(["true"], user=USERNS_SIZE)
    with pytest.raises(BadRequest, match="userns_size"):
        client.create(image="busybox", user=USERNS_SIZE + 5)
    assert sandbox.exec(["id", "-u"], user=USERNS_SIZE - 1).stdout == b"%d\n" % (USERNS_SIZE - 1)


def test_host_device_nodes_cannot_be_changed(sandbox):
    """/dev/null & co. are binds of the host's own nodes: root of the host could
    chmod them for the whole machine; sandbox root must not."""
    before = os.stat("/dev/null")
    for cmd in ("chmod 600 /dev/null", "chown 1:1 /dev/null", "touch -d 2001-01-01 /dev/null"):
        r = run(sandbox, f"{cmd} 2>&1; echo rc=$?")
        assert b"rc=0" not in r.stdout and b"not permitted" in r.stdout, (cmd, r.stdout)
    after = os.stat("/dev/null")
    assert (after.st_mode, after.st_uid, after.st_mtime) == (before.st_mode, before.st_uid, before.st_mtime)
    # Neighbour: the same operations on a file of the sandbox's own succeed.
    assert run(sandbox, "touch /tmp/f && chmod 600 /tmp/f && chown 1:1 /tmp/f && "
                        "touch -d 2001-01-01 /tmp/f").exit_code == 0
    # And the node itself still works for writing.
    assert run(sandbox, "echo x > /dev/null").exit_code == 0


def test_host_root_file_bound_in_cannot_be_written(sandbox):
    bind_host_root_file(sandbox, "/tmp/bound")
    r = run(sandbox, "cat /tmp/bound; echo x >> /tmp/bound; echo rc=$?; chmod 666 /tmp/bound; echo rc=$?; "
                     "rm -f /tmp/.host/file; echo rc=$?")
    out = r.stdout.decode()
    assert out.startswith("host\n") and out.count("rc=1") == 3, (out, r.stderr)   # readable, no more
    assert b"Permission denied" in r.stderr and b"not permitted" in r.stderr
    assert run(sandbox, "cat /tmp/bound").stdout == b"host\n"
    # Neighbour: sandbox root writes its own files in the same directory.
    assert run(sandbox, "echo mine > /tmp/own && cat /tmp/own").stdout == b"mine\n"


def test_root_work_inside_succeeds_and_keeps_sandbox_ids_on_disk(sandbox):
    """apt-like work as sandbox root: append to image files owned by root,
    create and chown files for other users, enter their 0700 home."""
    script = ("echo 'u:x:1000:1000::/home/u:/bin/sh' >> /etc/passwd && "
              "mkdir -p /home/u && chown 1000:1000 /home/u && chmod 700 /home/u && "
              "echo hi > /home/u/by-root && touch /etc/new-by-root && "
              "chown 1000:1000 /home/u/by-root && stat -c '%u:%g' /etc/passwd /home/u/by-root")
    r = run(sandbox, script)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == [b"0:0", b"1000:1000"]
    # On disk (the upper dir pack_diff reads) the files carry in-sandbox ids, not host ids.
    upper = upper_dir(sandbox.inspect())
    assert os.stat(upper / "etc/new-by-root").st_uid == 0
    assert os.stat(upper / "etc/passwd").st_uid == 0
    st = os.stat(upper / "home/u/by-root")
    assert (st.st_uid, st.st_gid) == (1000, 1000)
    assert stat.S_IMODE(os.stat(upper / "home/u").st_mode) == 0o700


def test_snapshot_records_sandbox_ids_not_host_ids(client):
    """pack_diff of a userns sandbox, restored into another one (another host
    range): owners are the in-sandbox ids, as the first sandbox saw them."""
    sb = client.create(image="busybox")
    try:
        script = ("mkdir -p /work/u && touch /work/by-root /work/u/f && chown -R 1000:1001 /work/u && "
                  "chown 0:0 /work/by-root && rm /etc/hostname 2>/dev/null; true")
        assert run(sb, script).exit_code == 0
        sb.snapshot("userns-snap")
        sb2 = client.create(image="userns-snap")
        try:
            assert uid_base(sb2) != uid_base(sb)
            out = run(sb2, "stat -c %u:%g /work/by-root /work/u /work/u/f").stdout.split()
            assert out == [b"0:0", b"1000:1001", b"1000:1001"]
            assert run(sb2, "test -e /etc/hostname").exit_code == 1          # whiteout kept
        finally:
            sb2.destroy(force=True)
    finally:
        sb.destroy(force=True)
        client.request("image_rm", name="userns-snap")


def test_daemon_file_ops_act_as_sandbox_root(sandbox):
    sandbox.write_file("/etc/written-by-daemon", b"x", parents=True)
    sandbox.write_file("/newdir/sub/f", b"y", parents=True)
    assert sandbox.stat("/etc/written-by-daemon")["uid"] == 0
    assert run(sandbox, "stat -c %u:%g /etc/written-by-daemon /newdir/sub /newdir/sub/f").stdout.split() == \
        [b"0:0"] * 3
    upper = upper_dir(sandbox.inspect())
    assert os.stat(upper / "etc/written-by-daemon").st_uid == 0
    # A file of another in-sandbox user is reported with its in-sandbox id.
    run(sandbox, "touch /tmp/u && chown 1000:1000 /tmp/u")
    st = sandbox.stat("/tmp/u")
    assert (st["uid"], st["gid"]) == (1000, 1000)
    assert {e["name"]: e["uid"] for e in sandbox.list_files("/tmp")}["u"] == 1000


def test_no_new_user_namespace_inside(sandbox):
    r = run(sandbox, "unshare -U true 2>&1; echo rc=$?; unshare -r true 2>&1; echo rc=$?")
    assert r.stdout.count(b"rc=") == 2 and b"rc=0" not in r.stdout, r.stdout
    assert b"not permitted" in r.stdout
    # Neighbour: other unprivileged work (a new process group) still runs.
    assert run(sandbox, "setsid true").exit_code == 0


def test_sandbox_root_owns_nothing_of_its_namespaces(sandbox):
    """The mount, net and uts namespaces belong to the host's user namespace, so
    sandbox root holds no CAP_SYS_ADMIN / NET_ADMIN over them (a second wall
    behind seccomp). Binding a low port still works: the spawn sets the
    sandbox's net.ipv4.ip_unprivileged_port_start to 0."""
    r = run(sandbox, "hostname evil 2>&1; echo rc=$?; ip link set lo down 2>&1; echo rc=$?")
    assert b"rc=0" not in r.stdout, r.stdout
    r = run(sandbox, "nc -l -p 80 & sleep 0.3; netstat -ltn | grep -c ':80 '; kill %1")
    assert r.stdout.strip() == b"1", (r.stdout, r.stderr)


def test_ranges_are_distinct_and_survive_a_restart(daemon_factory, busybox_rootfs):
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    a, b = c.create(image="busybox"), c.create(image="busybox")
    base_a, base_b = uid_base(a), uid_base(b)
    assert abs(base_a - base_b) >= USERNS_SIZE
    c.close()
    d.stop()
    d.start()
    c = d.client()
    third = c.create(image="busybox")
    assert uid_base(third) not in (base_a, base_b)    # the journal kept both ranges taken
    a2 = c.get(a.id)
    assert a2.exec(["id", "-u"]).stdout == b"0\n"         # execs still join the namespace
    assert uid_base(a2) == base_a
    for sb in (a2, c.get(b.id), third):
        sb.destroy(force=True)
    c.close()


def test_two_daemons_with_one_userns_base_never_share_host_ids(daemon_factory, busybox_rootfs):
    """Two daemons of the host configured with the same userns_base (two
    slots fit above it): the second passes over the range the first's
    sandbox holds, also after the first is killed -9 and started again
    (its sandbox claims it again)."""
    import signal

    from dsecd.errors import Busy

    base = 2**32 - 1 - 2 * USERNS_SIZE
    first, second = daemon_factory(f"userns_base = {base}\n"), daemon_factory(f"userns_base = {base}\n")
    c1, c2 = first.client(), second.client()
    for c in (c1, c2):
        c.import_image(busybox_rootfs, "busybox")
    a = c1.create(image="busybox")
    b = c2.create(image="busybox")
    assert uid_base(a) == base
    assert uid_base(b) == base + USERNS_SIZE
    c1.close()
    first.stop(signal.SIGKILL)
    first.start()
    c1 = first.client()
    b.destroy(force=True)
    b2 = c2.create(image="busybox")         # round robin comes to the first slot: still the first daemon's
    assert uid_base(b2) == base + USERNS_SIZE
    with pytest.raises(Busy, match=rf"1 of them held by another daemon \(pid {first.proc.pid}\)"):
        c2.create(image="busybox")
    assert uid_base(c1.get(a.id)) == base
    for sb in (c1.get(a.id), b2):
        sb.destroy(force=True)
    c1.close()
    c2.close()


def test_userns_off_keeps_host_root(daemon_factory, busybox_rootfs):
    d = daemon_factory("userns = false\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox")
    assert host_ids(sb.inspect()["init_pid"])[0] == [0] * 4
    assert Path(f"/proc/{sb.inspect()['init_pid']}/uid_map").read_text().split()[:2] == ["0", "0"]
    # What the user namespace prevents: host root's DAC_OVERRIDE writes a host-root file.
    bind_host_root_file(sb, "/tmp/bound")
    assert sb.exec(["sh", "-c", "echo x >> /tmp/bound && cat /tmp/bound"]).stdout == b"host\nx\n"
    sb.destroy(force=True)
    c.close()

