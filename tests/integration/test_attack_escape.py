"""Adversarial suite, part 1: classic container escapes from inside a real
sandbox. Each attack must fail with the expected errno while an
allowed neighbour, run in the same sandbox just before, succeeds: so no
attack "passes" because the probe or the sandbox is broken.

The same syscalls are checked against the bare seccomp filter (outside a
sandbox) in test_seccomp_kernel.py; here they run through the daemon, in a
sandbox's namespaces, cgroups, capability set and filter together.
"""

from __future__ import annotations

import os

import pytest
from attack_kit import facts, make_armed, outcome, run_probe

pytestmark = pytest.mark.attack

# (attack, probe args, expected errno, allowed neighbour's probe args)
SYSCALL_ATTACKS = [
    ("mount_tmpfs", ["mount", "/mnt"], "EPERM", ["open", "/proc/self/mountinfo"]),
    ("umount_proc", ["umount", "/proc"], "EPERM", ["stat", "/proc/self"]),
    ("pivot_root", ["pivot_root", "/tmp", "/tmp"], "EPERM", ["stat", "/tmp"]),
    ("raw_socket", ["socket", "raw_icmp"], "EPERM", ["socket", "udp"]),
    ("raw_socket_v6", ["socket", "raw6"], "EPERM", ["socket", "tcp"]),
    ("packet_socket", ["socket", "packet"], "EPERM", ["socket", "udp"]),
    # vsock is not network-namespaced: it reaches the host's hypervisor (CID 2)
    # or other VMs whatever the sandbox's network. Only the socket is made here.
    ("vsock_socket", ["socket", "vsock"], "EPERM", ["socket", "tcp"]),
    ("vsock_socket_high_bits", ["socket", "vsock_high_bits"], "EPERM", ["socket", "tcp"]),
    ("mknod_block_device", ["mknod", "/dev/vdx", "b", "254", "0"], "EPERM", ["mknod", "/tmp/fifo1", "p", "0", "0"]),
    ("mknod_kvm", ["mknod", "/tmp/kvm", "c", "10", "232"], "EPERM", ["mknod", "/tmp/fifo2", "p", "0", "0"]),
    ("setns_net", ["setns", "/proc/self/ns/net"], "EPERM", ["open", "/proc/self/ns/net"]),
    ("setns_mnt", ["setns", "/proc/self/ns/mnt"], "EPERM", ["open", "/proc/self/ns/mnt"]),
    ("unshare_user", ["unshare", "user"], "EPERM", ["unshare", "files"]),
    ("unshare_net", ["unshare", "net"], "EPERM", ["unshare", "files"]),
    ("init_module", ["init_module"], "EPERM", ["open", "/proc/self/status"]),
    ("finit_module", ["finit_module"], "EPERM", ["open", "/proc/self/status"]),
    ("delete_module", ["delete_module", "overlay"], "EPERM", ["open", "/proc/self/status"]),
    ("bpf", ["bpf"], "EPERM", ["socket", "udp"]),
    ("perf_event_open", ["perf_event_open"], "EPERM", ["open", "/proc/self/stat"]),
    ("io_uring_setup", ["io_uring"], "EPERM", ["open", "/proc/self/stat"]),
    ("tiocsti", ["tty_ioctl", "tiocsti"], "EPERM", ["tty_ioctl", "tcgets"]),
    ("xfs_swapext", ["file_ioctl", "xfs_swapext", "/root/victim"], "EPERM",
     ["file_ioctl", "fionread", "/root/victim"]),
    ("ext4_move_ext", ["file_ioctl", "ext4_move_ext", "/root/victim"], "EPERM",
     ["file_ioctl", "fionread", "/root/victim"]),
    ("open_by_handle_at", ["open_by_handle_at"], "EPERM", ["open", "/etc/passwd"]),
]


@pytest.mark.parametrize("attack, args, errno_name, neighbour", SYSCALL_ATTACKS,
                         ids=[a[0] for a in SYSCALL_ATTACKS])
def test_syscall_attack_is_refused(armed, attack, args, errno_name, neighbour):
    assert outcome(armed, *neighbour) == "ok", f"neighbour of {attack} failed: {neighbour}"
    assert outcome(armed, *args) == errno_name, attack


def test_chroot_breakout_finds_nothing_above_the_sandbox_root(armed, daemon):
    # CAP_SYS_CHROOT is kept (the neighbour: chroot itself works). `..` past
    # the jail leaves the sandbox's root for the root of its mount
    # namespace, a copy of the daemon's empty root namespace (csrc/spawn.c
    # dsec_root_ns; or the sandbox's own / where it pivot_root'ed): the
    # daemon's state dir (a host path) does not exist there.
    assert outcome(armed, "stat", "/etc/passwd") == "ok"
    lines = run_probe(armed, "chroot_escape", "/tmp/jail", str(daemon.state))
    assert facts(lines)["chroot"] == "ok"
    assert lines[-1] == "ENOENT"
    assert os.path.isdir(daemon.state)           # it is there on the host


def test_mount_table_names_no_host_path(armed, daemon):
    # The idmapped clones of the image's layers and the scratch tmpfs's root
    # stay mounted under the overlay, out of the sandbox's sight (csrc/spawn.c
    # layers_park): its mount table lists only what lies under its root, and
    # no path of the daemon's state dir (the layers' blobs live there).
    table = armed.exec(["cat", "/proc/self/mountinfo"])
    assert table.exit_code == 0
    points = [line.split()[4] for line in table.stdout.decode().splitlines()]
    assert points[0] == "/" and "/tmp" in points and points.count("/dev") == 1, points
    assert str(daemon.state).encode() not in table.stdout
    assert b" erofs " not in table.stdout


def test_proc_1_root_is_the_sandbox_itself(armed, daemon):
    # PID 1 of the sandbox is its own dsec-init, non-dumpable (it holds the
    # writable layer's fd for the daemon): its root, cwd and fds are EACCES.
    # A process's own root is the sandbox root, with no way out.
    assert outcome(armed, "open", "/proc/1/root/etc/passwd") == "EACCES"
    assert outcome(armed, "stat", f"/proc/1/cwd{daemon.state}") == "EACCES"
    assert outcome(armed, "open", "/proc/self/root/etc/passwd") == "ok"
    assert outcome(armed, "stat", f"/proc/self/root{daemon.state}") == "ENOENT"
    assert outcome(armed, "stat", f"/proc/self/cwd{daemon.state}") == "ENOENT"


def test_host_pids_are_invisible_untraceable_and_unsignalable(armed, daemon):
    host_pid = daemon.proc.pid              # the daemon: a host process the sandbox must not reach
    assert outcome(armed, "kill", "1", "0") == "ok"          # neighbour: its own init
    assert outcome(armed, "stat", f"/proc/{host_pid}") == "ENOENT"
    assert outcome(armed, "kill", host_pid, "9") == "ESRCH"
    assert outcome(armed, "ptrace", host_pid) == "EPERM"     # seccomp: ptrace is denied outright
    assert outcome(armed, "ptrace", "1") == "EPERM"          # ... even of its own processes
    assert outcome(armed, "vm_read", host_pid) == "EPERM"
    # kill(-1) reaches every process the sender can see: only the sandbox's own.
    armed.exec(["sh", "-c", "kill -9 -1; echo after"])
    assert daemon.proc.poll() is None and daemon.client().info()["version"]
    assert armed.exec(["true"]).exit_code == 0               # init survived too


def test_cgroup_files_are_out_of_reach(armed):
    # No cgroup file system inside; mounting one is refused, and nothing
    # under /sys/fs/cgroup can be opened for writing (absent or read-only).
    assert outcome(armed, "open", "/proc/self/cgroup") == "ok"
    mountinfo = armed.exec(["cat", "/proc/self/mountinfo"]).stdout.decode()
    assert " - cgroup" not in mountinfo, mountinfo
    r = armed.exec(["sh", "-c", "mount -t cgroup2 none /mnt 2>&1; echo rc=$?"])
    assert b"rc=0" not in r.stdout
    for path in ("/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/cgroup.procs",
                 "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        assert outcome(armed, "open_rw", path) in ("ENOENT", "EROFS", "EACCES"), path


def test_device_node_in_an_image_is_inert(admin, probe_binary, tmp_path):
    # An image may carry device nodes (a tarball can hold anything). The
    # overlay root is nodev: opening one fails, whatever the sandbox's caps.
    src = tmp_path / "devimg"
    (src / "dev2").mkdir(parents=True)
    os.mknod(src / "dev2" / "kvm", 0o666 | 0o020000, os.makedev(10, 232))
    os.mknod(src / "dev2" / "vda", 0o666 | 0o060000, os.makedev(254, 0))
    (src / "dev2" / "plain").write_text("x")
    admin.request("image_build", source=str(src), name="attack-devimg", parent="busybox")
    sb = make_armed(admin, probe_binary, image="attack-devimg")
    try:
        assert outcome(sb, "open", "/dev2/plain") == "ok"
        assert outcome(sb, "open_rw", "/dev2/kvm") == "EACCES"
        assert outcome(sb, "open", "/dev2/vda") == "EACCES"
    finally:
        sb.destroy(force=True)
        admin.request("image_rm", name="attack-devimg")


def test_overwriting_bin_busybox_only_breaks_its_own_sandbox(admin, daemon):
    """DSec's agents overwrote /bin/bash. Here every applet is /bin/busybox:
    clobbering it (in the sandbox, and through a hardlink written by the
    daemon's file API) breaks that sandbox only; the shared image layer and
    every other sandbox are untouched."""
    victim = admin.create(image="busybox", memory="64M")
    other = admin.create(image="busybox", memory="64M")
    try:
        layer = admin.request("image_inspect", name="busybox")["layers"][0]["digest"]
        r = victim.exec(["sh", "-c", "ln /bin/busybox /root/bb && echo linked"])
        assert r.stdout == b"linked\n"                   # neighbour: hardlinks in its own tree work
        # The daemon writes through the link (in place; an atomic write would replace the link).
        victim.write_file("/root/bb", b"#!/bin/false\n", mode=0o755, atomic=False)
        assert victim.read_file("/bin/busybox") == b"#!/bin/false\n"
        assert other.exec(["sh", "-c", "echo fine"]).stdout == b"fine\n"
        fresh = admin.create(image="busybox", memory="64M")
        assert fresh.exec(["busybox", "true"]).exit_code == 0
        fresh.destroy()
        blob = daemon.state / "store" / "blobs" / "sha256" / layer.split(":", 1)[1]
        from dsecd.fs.store import file_digest

        assert file_digest(blob) == layer               # the layer itself is intact
    finally:
        victim.destroy(force=True)
        other.destroy(force=True)
