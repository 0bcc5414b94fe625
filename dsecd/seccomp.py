"""The sandbox seccomp profile (csrc/seccomp.c): build once, install per exec.

The filter is built by libseccomp in the daemon, once, at start
(`prepare`), into static storage of the C module; an exec child then
installs it with one raw seccomp(2) (`dsec_seccomp_install`, called by
spawn.c just before execve, after no_new_privs). The child never allocates:
it shares the daemon's memory until it execs.

`apply` does the same from Python, for a process that is about to exec and
is not a CLONE_VM child (tests, a forked fncall worker). What the profile
denies, and why, is in docs/hardening.md; everything denied fails with EPERM
(clone3 with ENOSYS, so libc falls back to clone(2), whose flags the filter
can see), never with a kill.
"""

from __future__ import annotations

import errno
import os

from . import native
from ._native import lib  # the three seccomp entry points (native.py does not wrap them)

# "fncall" is "default" that lets unshare make an IPC or a net namespace:
# call sandboxes run under it in place of "default" (FnCallBackend), where
# their zygote, the one process there with CAP_SYS_ADMIN, gives each call an
# IPC namespace (and with fncall.own_net a net namespace) of its own
# (docs/burst.md, "What concurrent calls share").
PROFILES: dict[str, int] = {"default": lib.DSEC_SECCOMP_DEFAULT, "fncall": lib.DSEC_SECCOMP_FNCALL}
MAX_INSNS: int = lib.DSEC_SECCOMP_MAX_INSNS

# What csrc/seccomp.c denies, for docs, `dsec info` and the tests that check
# each one really fails. The C lists are the filter; these are their mirror.
DENIED_SYSCALLS = (
    "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr", "setns", "bpf", "perf_event_open", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "swapon", "swapoff",
    "reboot", "acct", "quotactl", "quotactl_fd", "syslog", "settimeofday", "clock_settime",
    "clock_adjtime", "iopl", "ioperm", "lookup_dcookie", "fanotify_init", "keyctl", "add_key",
    "request_key", "open_by_handle_at", "userfaultfd", "ptrace", "process_vm_readv",
    "process_vm_writev", "pidfd_getfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
)
DENIED_NS_FLAGS = ("CLONE_NEWUSER", "CLONE_NEWNS", "CLONE_NEWPID", "CLONE_NEWNET",
                   "CLONE_NEWUTS", "CLONE_NEWIPC", "CLONE_NEWCGROUP", "CLONE_NEWTIME")
DENIED_SOCKET_FAMILIES = ("AF_VSOCK",)
DENIED_IOCTLS = ("XFS_IOC_SWAPEXT", "XFS_IOC_EXCHANGE_RANGE", "FIFREEZE", "FITHAW",
                 "EXT4_IOC_MOVE_EXT", "EXT4_IOC_SWAP_BOOT", "TIOCSTI", "TIOCLINUX", "TIOCCONS",
                 "TIOCSETD")

native.add_hints({
    ("seccomp_build", errno.EINVAL): "libseccomp does not know a syscall of the deny list "
        "(libseccomp older than the kernel's syscall table?)",
    ("seccomp_build", errno.E2BIG): f"the filter has more than {MAX_INSNS} BPF instructions",
    ("seccomp_install", errno.ENOENT): "the profile was never built: call seccomp.prepare() "
        "in the daemon before forking",
    ("seccomp_install", errno.EACCES): "installing a filter needs no_new_privs or "
        "CAP_SYS_ADMIN",
    ("seccomp_install", errno.EINVAL): "the kernel was built without CONFIG_SECCOMP_FILTER",
})


def profile_number(name: str) -> int:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown seccomp profile {name!r}; known: {sorted(PROFILES)}") from None


def prepare(name: str = "default") -> int:
    """Build profile `name` into the C module's static storage (idempotent,
    thread-safe); returns its length in BPF instructions. Call once in the
    daemon at start, before any exec child may install it."""
    rc = lib.dsec_seccomp_build(profile_number(name))
    if rc < 0:
        native.raise_error(-rc, "build seccomp profile", name, "seccomp_build")
    return rc


def apply(name: str = "default", no_new_privs: bool = True) -> None:
    """Install profile `name` on the calling thread (builds it first if
    needed). For a process about to exec; irreversible. With `no_new_privs`
    (the default) sets PR_SET_NO_NEW_PRIVS first, which an unprivileged
    caller needs anyway."""
    prepare(name)
    if no_new_privs:
        rc = lib.dsec_seccomp_no_new_privs()
        if rc < 0:
            native.raise_error(-rc, "set no_new_privs for", f"pid {os.getpid()}", "no_new_privs")
    rc = lib.dsec_seccomp_install(profile_number(name))
    if rc < 0:
        native.raise_error(-rc, "install seccomp profile", name, "seccomp_install")


def export_pfc(name: str = "default") -> str:
    """The profile as libseccomp's pseudo-C (readable; for docs and debugging)."""
    with open(os.memfd_create("dsec-pfc", os.MFD_CLOEXEC), "w+b") as out:
        rc = lib.dsec_seccomp_export_pfc(profile_number(name), out.fileno())
        if rc < 0:
            native.raise_error(-rc, "export seccomp profile", name, "seccomp_build")
        out.seek(0)
        return out.read().decode()
