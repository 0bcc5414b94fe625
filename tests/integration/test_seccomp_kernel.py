"""The sandbox seccomp profile, on the real kernel (root).

Each test forks a child that makes its own mount namespace (so a mount that
succeeds stays in it), optionally installs the profile, runs the probes of
seccomp_py and reports "ok" or an errno name per  The same
probes run in a control child without the filter: every forbidden call must
fail with EPERM under the filter *and* not fail with EPERM without it, so a
test cannot pass because the kernel refused for another reason.

The probes make raw syscalls (ctypes, tests only: the product goes through
dsecd.native) with harmless arguments: wrong magic for reboot, bad fds or
NULL pointers the kernel checks only after the filter, and mounts only in
the child's private mount namespace.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import shutil
import tempfile
import threading

import pytest

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

NR = {  # x86_64 numbers (the tests skip on other architectures)
    "getpid": 39, "ioctl": 16, "clone": 56, "mount": 165, "umount2": 166, "swapon": 167,
    "reboot": 169, "init_module": 175, "ptrace": 101, "unshare": 272, "setns": 308,
    "perf_event_open": 298, "open_by_handle_at": 304, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "keyctl": 250, "pivot_root": 155, "fsopen": 430, "clone3": 435,
    "io_uring_setup": 425, "process_vm_readv": 310, "socket": 41,
}
X32_BIT = 0x40000000
CLONE_NEWUSER, CLONE_NEWUTS, CLONE_NEWNS, CLONE_NEWNET = 0x10000000, 0x04000000, 0x20000, 0x40000000
CLONE_FILES, SIGCHLD = 0x400, 17
TIOCSTI, TCGETS, FIONREAD = 0x5412, 0x5401, 0x541B
XFS_IOC_SWAPEXT = 0xC0C0586D   # _IOWR('X', 109, struct xfs_swapext): size bits vary, filter ignores them
EXT4_IOC_MOVE_EXT = 0xC028660F  # _IOWR('f', 15, struct move_extent)
KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING = 0, -3
PTRACE_PEEKDATA = 2
AF_UNIX, AF_VSOCK, SOCK_STREAM = 1, 40, 1


def sys(name: str, *args, nr: int | None = None) -> int:
    """Raw syscall -> 0 (or the positive result) on success, -errno on failure."""
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(NR[name] if nr is None else nr),
                      *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return -ctypes.get_errno() if rc == -1 else rc


def err(rc: int) -> str:
    return "ok" if rc >= 0 else errno.errorcode.get(-rc, str(-rc))


def _clone_flags(flags: int) -> str:
    """clone(2) fork-style (no new stack); the new child exits at once."""
    rc = sys("clone", flags | SIGCHLD, 0, 0, 0, 0)
    if rc == 0:
        os._exit(0)
    if rc > 0:
        os.waitpid(rc, 0)
    return err(rc)


def _fork() -> str:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    return "ok" if os.waitstatus_to_exitcode(status) == 7 else "bad-status"


def _thread() -> str:
    out = []
    t = threading.Thread(target=lambda: out.append(os.getpid()))
    t.start()
    t.join()
    return "ok" if out else "no-thread"


def run_probes(scratch: str) -> dict[str, str]:
    """name -> "ok" or errno name, in the calling (already set up) process."""
    master, slave = os.openpty()
    rfd, wfd = os.pipe()
    fpath = os.path.join(scratch, "f")
    fd = os.open(fpath, os.O_RDWR | os.O_CREAT, 0o600)
    uts = os.open("/proc/self/ns/uts", os.O_RDONLY)
    mnt_target = os.path.join(scratch, "m")
    os.makedirs(mnt_target, exist_ok=True)
    c = ctypes.c_char_p
    out = {
        # forbidden (expected EPERM with the filter; ENOSYS for clone3)
        "mount": err(sys("mount", c(b"none"), c(mnt_target.encode()), c(b"tmpfs"), 0, 0)),
        "umount2": err(sys("umount2", c(b"/nonexistent-dsec"), 0)),
        "pivot_root": err(sys("pivot_root", c(b"/nonexistent-a"), c(b"/nonexistent-b"))),
        "fsopen": err(sys("fsopen", c(b"no-such-fs-dsec"), 0)),
        "unshare_newuts": err(sys("unshare", CLONE_NEWUTS)),
        "unshare_newnet": err(sys("unshare", CLONE_NEWNET)),
        "clone_newuser": _clone_flags(CLONE_NEWUSER),
        "clone_newns": _clone_flags(CLONE_NEWNS),
        "clone3": err(sys("clone3", 0, 0)),
        "setns": err(sys("setns", uts, CLONE_NEWUTS)),
        "bpf": err(sys("bpf", 9999, 0, 0)),
        "perf_event_open": err(sys("perf_event_open", 0, 0, -1, -1, 0)),
        "kexec_file_load": err(sys("kexec_file_load", -1, -1, 0, 0, 0xFFFF)),
        "init_module": err(sys("init_module", 0, 0, c(b""))),
        "swapon": err(sys("swapon", c(b"/nonexistent-dsec"), 0)),
        "reboot": err(sys("reboot", 0, 0, 0, 0)),  # wrong magic: EINVAL without a filter
        "keyctl": err(sys("keyctl", KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0)),
        "open_by_handle_at": err(sys("open_by_handle_at", -1, 0, 0)),
        "userfaultfd": err(sys("userfaultfd", os.O_CLOEXEC)),
        "ptrace": err(sys("ptrace", PTRACE_PEEKDATA, 1, 0, 0)),
        "process_vm_readv": err(sys("process_vm_readv", 1, 0, 0, 0, 0, 0)),
        "io_uring_setup": err(sys("io_uring_setup", 1, 0)),
        "ioctl_tiocsti": err(sys("ioctl", slave, TIOCSTI, c(b"x"))),
        "ioctl_tiocsti_high_bits": err(sys("ioctl", slave, TIOCSTI | 1 << 32, c(b"x"))),
        "ioctl_xfs_swapext": err(sys("ioctl", fd, XFS_IOC_SWAPEXT, 0)),
        "ioctl_xfs_swapext_other_size": err(sys("ioctl", fd, (XFS_IOC_SWAPEXT & 0xC000FFFF) | 8 << 16, 0)),
        "ioctl_ext4_move_ext": err(sys("ioctl", fd, EXT4_IOC_MOVE_EXT, 0)),
        "x32_getpid": err(sys("getpid", nr=X32_BIT | NR["getpid"])),
        "socket_vsock": err(sys("socket", AF_VSOCK, SOCK_STREAM, 0)),
        "socket_vsock_high_bits": err(sys("socket", 1 << 32 | AF_VSOCK, SOCK_STREAM, 0)),
        # allowed neighbours (expected "ok" with the filter)
        "getpid": err(sys("getpid")),
        "unshare_files": err(sys("unshare", CLONE_FILES)),
        "fork": _fork(),
        "clone_plain": _clone_flags(0),
        "thread": _thread(),
        "ioctl_tcgets": err(sys("ioctl", slave, TCGETS, ctypes.create_string_buffer(64))),
        "ioctl_fionread": err(sys("ioctl", rfd, FIONREAD, ctypes.byref(ctypes.c_int()))),
        "open_read": "ok" if open("/proc/self/status").read() else "empty",
        "socket_unix": err(sys("socket", AF_UNIX, SOCK_STREAM, 0)),
    }
    # Last: without a filter this really enters a new user namespace, where
    # the caller has no capabilities left for the probes above.
    out["unshare_newuser"] = err(sys("unshare", CLONE_NEWUSER))
    for f in (master, slave, rfd, wfd, fd, uts):
        os.close(f)
    return out


pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="the profile and the probes are x86_64")

FORBIDDEN = {
    "mount": "EPERM", "umount2": "EPERM", "pivot_root": "EPERM", "fsopen": "EPERM",
    "unshare_newuts": "EPERM", "unshare_newuser": "EPERM", "unshare_newnet": "EPERM",
    "clone_newuser": "EPERM", "clone_newns": "EPERM", "clone3": "ENOSYS", "setns": "EPERM",
    "bpf": "EPERM", "perf_event_open": "EPERM", "kexec_file_load": "EPERM",
    "init_module": "EPERM", "swapon": "EPERM", "reboot": "EPERM", "keyctl": "EPERM",
    "open_by_handle_at": "EPERM", "userfaultfd": "EPERM", "ptrace": "EPERM",
    "process_vm_readv": "EPERM", "io_uring_setup": "EPERM", "ioctl_tiocsti": "EPERM",
    "ioctl_tiocsti_high_bits": "EPERM", "ioctl_xfs_swapext": "EPERM",
    "ioctl_xfs_swapext_other_size": "EPERM", "ioctl_ext4_move_ext": "EPERM",
    "x32_getpid": "EPERM", "socket_vsock": "EPERM", "socket_vsock_high_bits": "EPERM",
}
ALLOWED = ("getpid", "unshare_files", "fork", "clone_plain", "thread", "ioctl_tcgets",
           "ioctl_fionread", "open_read", "socket_unix")


def _run_child(filtered: bool) -> dict[str, str]:
    # Made and removed here, in the parent: the filtered child may not clean up.
    scratch = tempfile.mkdtemp(prefix="dsecd-test-seccomp-")
    try:
        return _probe_in_child(filtered, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _probe_in_child(filtered: bool, scratch: str) -> dict[str, str]:
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(rfd)
            assert sys("unshare", CLONE_NEWNS) == 0
            # MS_REC|MS_PRIVATE on /: nothing mounted here reaches the host.
            assert sys("mount", ctypes.c_char_p(b"none"), ctypes.c_char_p(b"/"),
                             0, 0x40000 | 0x4000, 0) == 0
            if filtered:
                from dsecd import seccomp

                seccomp.apply("default")
            result = run_probes(scratch)
        except BaseException as err:
            result = {"error": repr(err)}
        os.write(wfd, json.dumps(result).encode())
        os._exit(0)
    os.close(wfd)
    data = b""
    while chunk := os.read(rfd, 1 << 16):
        data += chunk
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result = json.loads(data)
    assert "error" not in result, result
    return result


@pytest.fixture(scope="module")
def outcomes():
    return _run_child(filtered=False), _run_child(filtered=True)


@pytest.mark.parametrize("name", sorted(FORBIDDEN))
def test_forbidden_call_fails_with_errno(outcomes, name):
    control, filtered = outcomes
    assert filtered[name] == FORBIDDEN[name], f"{name}: {filtered[name]} under the filter"
    if control[name] == FORBIDDEN[name]:
        # Some kernels refuse a call themselves (6.18.44 answers EPERM to
        # EXT4_IOC_MOVE_EXT for root): the filter's refusal cannot be told apart.
        pytest.skip(f"{name}: this kernel answers {control[name]} without the filter too")
    # Without the filter the kernel answers otherwise: the filter is what refused.


@pytest.mark.parametrize("name", ALLOWED)
def test_allowed_neighbour_succeeds(outcomes, name):
    control, filtered = outcomes
    assert control[name] == "ok"
    assert filtered[name] == "ok", f"{name}: {filtered[name]} under the filter"


def test_install_needs_no_new_privs_without_cap_sys_admin():
    """Unprivileged, without no_new_privs, the kernel refuses the filter:
    spawn.c must install it after its no_new_privs step."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            from dsecd import seccomp

            seccomp.prepare()
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            try:
                seccomp.apply(no_new_privs=False)
                code = 2
            except PermissionError as err:
                code = 3 if "no_new_privs" in str(err) else 4
            seccomp.apply(no_new_privs=True)
            code = code * 10 + (sys("unshare", CLONE_NEWUSER) == -errno.EPERM)
        finally:
            os.write(wfd, bytes([code]))
            os._exit(0)
    os.close(wfd)
    code = os.read(rfd, 1)[0]
    os.close(rfd)
    os.waitpid(pid, 0)
    # 3: refused with a hint; then installed with no_new_privs; 1: it denies.
    assert code == 31


# The entry point spawn.c will call, in the context it will call it from: a
# CLONE_VM|CLONE_VFORK child on its own stack, with the program built in the
# parent before the clone. Compiled from csrc/seccomp.c with the system cc.
VFORK_CHILD_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include "dsec_native.h"

static volatile int install_rc = 1, unshare_errno = -1, getpid_ok = 0;

static int child(void *arg)
{
    if (syscall(SYS_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        _exit(2);
    install_rc = dsec_seccomp_install(DSEC_SECCOMP_DEFAULT);
    unshare_errno = syscall(SYS_unshare, CLONE_NEWUTS) < 0 ? errno : 0;
    getpid_ok = syscall(SYS_getpid) > 0;
    char *argv[] = {"true", NULL}, *envp[] = {NULL};
    execve("/bin/true", argv, envp);   /* allowed: the child must still exec */
    _exit(3);
}

int main(void)
{
    int n = dsec_seccomp_build(DSEC_SECCOMP_DEFAULT), status = 0;
    size_t size = 256 * 1024;
    char *stack = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    pid_t pid = clone(child, stack + size, CLONE_VM | CLONE_VFORK | SIGCHLD, NULL);
    waitpid(pid, &status, 0);
    /* the parent (same memory, no filter) may still unshare */
    int parent_unshare = syscall(SYS_unshare, CLONE_NEWUTS) < 0 ? errno : 0;
    printf("%d %d %d %d %d %d\n", n > 0, install_rc, unshare_errno, getpid_ok,
           WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), parent_unshare);
    return 0;
}
"""


def test_install_from_a_clone_vm_vfork_child(tmp_path):
    import shutil
    import subprocess
    from pathlib import Path

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (scripts/setup.sh installs build-essential)")
    csrc = Path(__file__).resolve().parents[2] / "csrc"
    src = tmp_path / "vfork_child.c"
    src.write_text(VFORK_CHILD_C)
    exe = tmp_path / "vfork_child"
    subprocess.run([cc, "-O2", "-I", str(csrc), "-o", str(exe), str(src), str(csrc / "seccomp.c"),
                    "-lseccomp", "-lpthread"], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30)
    built, install_rc, unshare_errno, getpid_ok, exit_code, parent_unshare = map(int, out.stdout.split())
    assert built == 1 and install_rc == 0
    assert unshare_errno == errno.EPERM and getpid_ok == 1
    assert exit_code == 0                 # /bin/true ran under the filter
    assert parent_unshare == 0            # the filter stayed in the child
