"""Attacks on the file systems of a container sandbox (part 1):
filling the writable layer, exhausting its inodes, reaching the fd of the
layer that PID 1 holds, /sys and the cgroup files.

The writable-layer tests need feature `upperfs` (Linux >= 6.15: an overlay
upper dir on a detached, size-capped tmpfs); the daemon's own probe decides.
"""

from __future__ import annotations

import os
import subprocess

import pytest

import dsecd.errors
from dsecd.errors import BadRequest

pytestmark = pytest.mark.attack

MiB = 1 << 20


def sh(sb, script: str, timeout: float = 30):
    return sb.exec(["sh", "-c", script], timeout=timeout)


def _require_upperfs(client) -> None:
    feat = client.info()["features"]["upperfs"]
    if not feat["available"]:
        pytest.skip(f"writable layer cannot be capped here: {feat['detail']}")


def _du(path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def test_filling_the_writable_layer_gives_enospc(daemon, client):
    """A sandbox that writes past its `disk` cap gets ENOSPC; the host's disk does not grow."""
    _require_upperfs(client)
    state_before = _du(daemon.state / "sandboxes")
    sb = client.create(image="busybox", memory="128M", disk="8M")
    try:
        assert sb.info["limits"]["disk"] == 8 * MiB
        r = sh(sb, "dd if=/dev/zero of=/big bs=1M count=32")
        assert r.exit_code != 0 and b"No space left on device" in r.stderr, r.stderr
        disk = sb.inspect()["disk"]
        assert disk["limit"] == 8 * MiB and 7 * MiB <= disk["used"] <= 8 * MiB, disk
        # Nothing of it reached the host's state dir (the layer is a tmpfs).
        assert _du(daemon.state / "sandboxes") - state_before < MiB
        # Neighbours: after freeing space, a write within the cap works, and a
        # file of the image (a copy-up) can still be changed.
        r = sh(sb, "rm /big && dd if=/dev/zero of=/ok bs=1M count=4 && echo x >> /etc/passwd && echo done")
        assert r.exit_code == 0 and r.stdout.endswith(b"done\n"), r.stderr
    finally:
        sb.destroy(force=True)


def test_default_cap_applies_and_bad_caps_are_refused(daemon, client):
    _require_upperfs(client)
    sb = client.create(image="busybox", memory="128M")
    try:
        limit = sb.inspect()["disk"]["limit"]
        assert limit == sb.info["limits"]["disk"] > 0
        r = sh(sb, "df -k / | tail -1")
        assert r.exit_code == 0          # the sandbox sees its cap as the size of /
        assert int(r.stdout.split()[1]) * 1024 == limit, r.stdout
    finally:
        sb.destroy(force=True)
    for bad in ("1K", "-5", "lots"):
        with pytest.raises(BadRequest, match="disk"):
            client.create(image="busybox", disk=bad)


def test_inode_cap(daemon_factory, busybox_rootfs):
    """Past `disk_inodes` files, creating one more gives ENOSPC; writing to existing ones works."""
    d = daemon_factory("disk_inodes = 300\n")
    c = d.client()
    try:
        _require_upperfs(c)
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", memory="128M")
        r = sh(sb, "mkdir /many && i=0; while [ $i -lt 1000 ]; do touch /many/f$i || exit 1; "
                   "i=$((i+1)); done")
        assert r.exit_code != 0 and b"No space left on device" in r.stderr, r.stderr
        assert sb.inspect()["disk"]["inodes_limit"] == 300
        r = sh(sb, "echo data > /many/f1 && cat /many/f1")
        assert r.stdout == b"data\n", r.stderr
        sb.destroy(force=True)
    finally:
        c.close()


def test_init_holds_the_layer_but_the_sandbox_cannot_reach_it(sandbox, client):
    """PID 1 keeps the layer's mount fd for a restarted daemon; /proc/1/fd is closed to the sandbox."""
    _require_upperfs(client)
    # Listing /proc/1/fd is plain DAC (uid 0 may); following a link needs ptrace
    # access, which a non-dumpable init refuses to a process without CAP_SYS_PTRACE.
    for script in ("ls /proc/1/fd/3/", "touch /proc/1/fd/3/upper/x",
                   "cat /proc/1/environ", "ls /proc/1/cwd/"):
        r = sh(sandbox, script)
        assert r.exit_code != 0 and b"Permission denied" in r.stderr, (script, r.stdout, r.stderr)
    # Neighbour: a process's own fds are listed.
    r = sh(sandbox, "ls /proc/self/fd")
    assert r.exit_code == 0 and b"0" in r.stdout.split()


def test_snapshot_and_restart_read_the_capped_layer(daemon_factory, busybox_rootfs):
    """pack_diff reads the tmpfs through the daemon's fd; a restarted daemon takes it back from PID 1."""
    d = daemon_factory()
    c = d.client()
    try:
        _require_upperfs(c)
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", memory="128M", disk="16M")
        assert sh(sb, "echo kept > /root/note && rm /bin/vi").exit_code == 0
        c.close()
        d.stop()
        d.start()
        c = d.client()
        sb = c.get(sb.id)
        assert sb.inspect()["disk"]["limit"] == 16 * MiB
        r = sh(sb, "dd if=/dev/zero of=/big bs=1M count=64")       # the cap survived the restart
        assert b"No space left on device" in r.stderr
        sh(sb, "rm /big")
        sb.snapshot("after-restart")
        sb2 = c.create(image="after-restart", memory="128M")
        r = sh(sb2, "cat /root/note; test -e /bin/vi || echo vi-gone")
        assert r.stdout == b"kept\nvi-gone\n", (r.stdout, r.stderr)
    finally:
        c.close()


def test_sys_and_cgroup_files_are_out_of_reach(sandbox):
    """/sys is not mounted (decision: docs/hardening.md); no cgroup file system is reachable
    or mountable, so no cgroup file can be written from inside."""
    r = sh(sandbox, "ls -A /sys 2>/dev/null | wc -l; grep -cE ' (sysfs|cgroup2?) ' /proc/self/mountinfo")
    assert r.stdout.split() == [b"0", b"0"], r.stdout
    for script in ("mount -t sysfs sysfs /sys", "mount -t cgroup2 none /sys",
                   "mount -t cgroup -o memory none /sys"):
        r = sh(sandbox, script)
        assert r.exit_code != 0 and (b"permission denied" in r.stderr
                                     or b"Operation not permitted" in r.stderr), (script, r.stderr)
    r = sh(sandbox, "echo 1 > /sys/fs/cgroup/cgroup.procs")
    assert r.exit_code != 0, r.stderr
    # Neighbour: the sandbox sees its own cgroup (a namespace root) in /proc.
    r = sh(sandbox, "cat /proc/self/cgroup")
    assert r.exit_code == 0 and r.stdout and all(
        line.endswith(b":/") for line in r.stdout.splitlines()), r.stdout


def test_host_state_dir_is_unchanged_by_sandbox_writes(daemon, client):
    """Neighbour check of the cap's mechanism: what a capped sandbox writes lives in memory
    charged to its own memory cgroup, not in the daemon's state dir."""
    _require_upperfs(client)
    sb = client.create(image="busybox", memory="128M", disk="64M")
    try:
        before = _du(daemon.state / "sandboxes")
        assert sh(sb, "dd if=/dev/zero of=/f bs=1M count=16").exit_code == 0
        assert _du(daemon.state / "sandboxes") - before < MiB
        memcg = [g for k, g in sb.inspect()["cgroups"].items() if "memory" in k]
        if memcg:
            usage = next((f for f in ("memory.current", "memory.usage_in_bytes")
                          if os.path.exists(os.path.join(memcg[0], f))), None)
            if usage:
                with open(os.path.join(memcg[0], usage)) as f:
                    assert int(f.read()) >= 16 * MiB
    finally:
        sb.destroy(force=True)


# A daemon as Docker would configure it: MKNOD kept and no user namespace (in
# one, mknod of a device is EPERM whatever the mounts). Then the nodev mounts
# are all that stands between a sandbox and the host's devices.
MKNOD_CONFIG = ('userns = false\ncapabilities = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SETGID", '
                '"SETUID", "MKNOD"]\n')


@pytest.fixture(scope="module")
def mknod_sandbox(busybox_rootfs):
    import tempfile
    from pathlib import Path

    from conftest import Daemon

    d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")), MKNOD_CONFIG)
    try:
        d.start()
        c = d.client()
        c.import_image(busybox_rootfs, "busybox")
        yield c.create(image="busybox", memory="128M")
        c.close()
    finally:
        d.cleanup()


@pytest.mark.parametrize("where", ["/dev", "/tmp", "/dev/shm", "/root"])
def test_device_nodes_made_inside_do_not_open(mknod_sandbox, where):
    """With CAP_MKNOD and no device cgroup, every writable mount being nodev is what keeps a
    node made inside (here a copy of /dev/null; a disk's numbers work the same) from opening:
    EACCES."""
    r = sh(mknod_sandbox, f"mknod {where}/node c 1 3 && echo made && echo x > {where}/node")
    assert r.stdout == b"made\n", (r.stdout, r.stderr)          # mknod itself is allowed here
    assert r.exit_code != 0 and b"Permission denied" in r.stderr, (r.exit_code, r.stderr)
    # Neighbour: the allowlisted nodes work.
    r = sh(mknod_sandbox, "echo x > /dev/null && head -c 4 /dev/urandom | wc -c && head -c 3 /dev/zero | wc -c")
    assert r.exit_code == 0 and r.stdout.split() == [b"4", b"3"], (r.stdout, r.stderr)


def test_file_api_writes_are_capped_too(daemon, client):
    """The daemon's file_write goes through the same overlay: past the cap it is an `io`
    error naming ENOSPC, not an internal one, and the sandbox stays usable. The
    SDK's atomic write leaves nothing behind; an in-place one leaves its part."""
    _require_upperfs(client)
    sb = client.create(image="busybox", memory="128M", disk="4M")
    try:
        sb.write_file("/small", b"y" * 1024)            # neighbour: within the cap
        with pytest.raises(dsecd.errors.DsecError) as e:
            sb.write_file("/f", b"x" * (8 << 20), atomic=True)     # the SDK sends it in chunks
        assert e.value.code == "io" and "No space left" in str(e.value), e.value
        assert sh(sb, "ls -a / | grep -c dsec- || true").stdout == b"0\n" and not sb.exists("/f")
        with pytest.raises(dsecd.errors.DsecError, match="No space left"):
            sb.write_file("/f", b"x" * (8 << 20), atomic=False)
        assert sh(sb, "rm /f && echo ok > /g && cat /g").stdout == b"ok\n"
    finally:
        sb.destroy(force=True)
