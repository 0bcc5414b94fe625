"""The Python face of dsecd._native: validated specs in, pids and fds out.

The rest of dsecd calls only this module, never ``_native``. C returns
``-errno`` (and, for the spawns, the failing step and path: see
csrc/ERRORS.md); here that becomes a `NativeError`, an `OSError` whose
message reads "verb `object`: strerror; hint". The error's class also derives
from the builtin OSError subclass of its errno, so ``except
ProcessLookupError`` or ``except FileNotFoundError`` work as with ``os``.

Every call blocks (clone, mount, exec) and releases the GIL while in C:
call them from worker threads, never on the event loop. All of them are
thread-safe and leave no fd or mapping behind, on success or failure.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from dataclasses import dataclass
from typing import NoReturn

from . import pinned
from ._native import ffi, lib
from .imageconfig import DEFAULT_PATH

# What the rest of the daemon may use (tests/unit/test_import_graph.py checks
# that nothing else, and nothing private, is used from outside).
__all__ = [
    # errors
    "NativeError", "native_error", "raise_error", "add_hints", "describe_errno", "STEPS",
    # container spawn and execs (spawn.c, init.c)
    "ContainerSpec", "TooManyLayers", "ExecSpec", "spawn_container", "spawn_exec", "check_exec_request", "init_exec_error",
    "cgroup_make",
    "init_binary_path", "INIT_MAGIC", "INIT_OP_START", "INIT_OP_KILL", "INIT_OP_COPY", "INIT_OP_RELEASE", "INIT_OP_PRUNE",
    "INIT_START_CTTY",
    "INIT_START_HOLD", "INIT_START_POLICY", "INIT_START_GROUPS", "INIT_START_OWN_IPC", "MAX_GROUPS",
    "check_groups", "POLICY_MAGIC", "POLICY_MAX_BYTES", "POLICY_MAX_CHILDREN",
    "INIT_STARTED", "INIT_EXITED", "INIT_MAX_STRINGS", "INIT_PEER_FD", "INIT_REQ_SIZE", "INIT_REPLY_SIZE",
    "INIT_REPLY_ERR_OFFSET",
    "UPPER_FD",
    # files, mounts, the writable layer
    "openat2", "fs_magic", "vmsplice", "KERNEL_FS_MAGICS", "mount_erofs", "umount", "mount_idmapped",
    "upperfs_create", "upperfs_attach", "RESOLVE_IN_ROOT", "RESOLVE_NO_MAGICLINKS", "RESOLVE_NO_SYMLINKS",
    "peer_tree", "attach_tree",
    "DEVPTS_SUPER_MAGIC", "TIOCSPTLCK", "TIOCGPTPEER",
    "RESOLVE_BENEATH", "RESOLVE_NO_XDEV", "RESOLVE_CACHED", "TarErofs", "TarErofsError",
    # processes and namespaces
    "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "pidfd_kill_group", "netns_create", "userns_create",
    "fs_ids", "reader_ids", "Reader", "kill_uid_in", "sched_set_idle", "sched_core_create", "sched_core_share_from",
    "PAGE_SIZE", "root_ns",
    "RootEntry", "vm_root", "MS_RDONLY", "MS_NOSUID", "MS_NODEV", "MS_NOEXEC",
    # memory
    "MADV_WILLNEED", "MADV_COLD", "MADV_PAGEOUT", "MadviseResult", "process_madvise", "process_populate",
    "swapon", "swapoff", "ioprio_idle",
    # probes: each returns 0 or -errno (probe_kvm: a dict; see its docstring)
    "probe_sched_core", "probe_landlock_abi", "probe_seccomp", "probe_bpf_cgroup", "probe_kvm",
    "probe_openat2", "probe_pidfd", "probe_clone3", "probe_pidfd_group_signal", "probe_project_quota",
    "probe_upperfs",
]

RESOLVE_NO_XDEV: int = lib.RESOLVE_NO_XDEV
RESOLVE_NO_MAGICLINKS: int = lib.RESOLVE_NO_MAGICLINKS
RESOLVE_NO_SYMLINKS: int = lib.RESOLVE_NO_SYMLINKS
DEVPTS_SUPER_MAGIC: int = lib.DEVPTS_SUPER_MAGIC
TIOCSPTLCK: int = lib.TIOCSPTLCK      # lock (1) or unlock (0) a pty's slave
TIOCGPTPEER: int = lib.TIOCGPTPEER    # open a pty master's slave (Python's termios has neither)
RESOLVE_BENEATH: int = lib.RESOLVE_BENEATH
RESOLVE_IN_ROOT: int = lib.RESOLVE_IN_ROOT
RESOLVE_CACHED: int = lib.RESOLVE_CACHED
MS_RDONLY: int = lib.MS_RDONLY
MS_NOSUID: int = lib.MS_NOSUID
MS_NODEV: int = lib.MS_NODEV
MS_NOEXEC: int = lib.MS_NOEXEC

# enum dsec_step, by number: DSEC_STEP_MOUNT_OVERLAY -> "mount_overlay".
STEPS: dict[int, str] = dict(sorted({
    getattr(lib, name): name.removeprefix("DSEC_STEP_").lower()
    for name in dir(lib) if name.startswith("DSEC_STEP_")
}.items()))

PATH_MAX = 4096
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
HOSTNAME_MAX = 64

# What each step was doing, as the verb of "verb `object`: strerror".
_VERBS = {
    "none": "spawn", "open_init": "open init binary", "open_cgroup": "open",
    "stack": "map clone stack for", "clone": "clone", "cgroup_join": "join cgroup via",
    "cgroup_ns": "unshare cgroup namespace of", "mount_private": "make mounts private under",
    "mount_overlay": "mount overlay on", "chdir_rootfs": "enter rootfs",
    "mkdir": "create directory", "mount_proc": "mount proc on", "mount_dev": "mount /dev (scratch tmpfs) on",
    "dev_node": "bind device node", "mount_devpts": "mount devpts on",
    "mount_shm": "mount /dev/shm (scratch tmpfs) on", "dev_link": "create symlink",
    "mount_tmp": "mount /tmp (scratch tmpfs) on", "hostname": "set hostname", "loopback": "bring up",
    "pivot_root": "pivot_root into", "stdio": "set up stdio of", "close_fds": "close fds of",
    "no_new_privs": "set no_new_privs for", "caps": "set capabilities of",
    "exec_init": "exec", "setns": "enter namespaces of", "setsid": "setsid for",
    "ids": "set uid/gid to", "chdir": "chdir to", "exec": "exec", "exec_interp": "exec",
    "sched_idle": "set SCHED_IDLE for", "sched_core": "set core-scheduling cookie of",
    "seccomp": "install seccomp filter for", "upper_fd": "hand the upper tmpfs to",
    "userns_map": "write id map of user namespace", "userns_fsids": "set fs uid/gid of",
    "userns_sysctl": "write sysctl", "userns_enter": "enter user namespace of",
    "netns_join": "join the pooled network namespace of",
    "peer_ns": "enter the client's mount namespace to reach", "peer_tree": "reach",
    "peer_ids": "take the client's ids to reach", "peer_open": "open, as the client,",
    "ctl_fd": "hand the exec channel to", "init_request": "have the sandbox's init start",
    "root_ns": "set up the sandbox root's mount namespace at",
    "vm_root": "set up the VM's root on", "vm_root_bind": "bind into the VM's root at",
    "cgroup_mkdir": "create cgroup", "cgroup_write": "write the limits of a new cgroup to",
    "oom_score": "reset the OOM score of",
    "ctty": "make the pty the controlling terminal of",
    "landlock": "apply the task policy (Landlock) at",
    "park_layers": "attach the idmapped layer clones at",
    "ipc_ns": "unshare an IPC namespace for",
}

_MOUNT_STEPS = {"mount_private", "mount_overlay", "mount_proc", "mount_dev", "dev_node",
                "mount_devpts", "mount_shm", "mount_tmp", "pivot_root", "vm_root", "vm_root_bind",
                "park_layers"}

# Errnos that mislead on their own. Looked up as (step, errno), then
# ("mount", errno) for the mount steps; probes use their own name as step.
_HINTS: dict[tuple[str, int], str] = {
    ("open_init", errno.ENOENT): "dsec-init is built into dsecd/libexec/ by `pip install .`",
    ("open_cgroup", errno.ENOENT): "the cgroup does not exist (not created yet, or removed)",
    ("cgroup_join", errno.EBUSY): "cgroup v2 'no internal processes' rule: this cgroup has "
        "controllers in cgroup.subtree_control, so processes must go to a leaf below it",
    ("cgroup_join", errno.ENOSPC): "a v1 cpuset cgroup with an empty cpuset.cpus or "
        "cpuset.mems accepts no process: set both first",
    ("cgroup_join", errno.EOPNOTSUPP): "the cgroup v2 is of type 'domain invalid' "
        "(see its cgroup.type)",
    ("clone", errno.EPERM): "new namespaces need CAP_SYS_ADMIN: run dsecd as root",
    ("clone", errno.ENOSPC): "a namespace count limit was hit (/proc/sys/user/max_*_namespaces)",
    ("clone", errno.EAGAIN): "a pids.max of a joined cgroup, or RLIMIT_NPROC, was reached",
    ("clone", errno.ECHILD): "the exec helper died before reporting (killed, OOM?)",
    ("mount_overlay", errno.EINVAL): "overlayfs refused the options: upperdir and workdir must "
        "be distinct, on one filesystem that supports xattrs and d_type, and no layer may "
        "be the upper or work dir of another mounted overlay; an image of more layers than "
        "fit in 255 bytes of lowerdir needs Linux 6.8 or later (lowerdir+)",
    ("mount_overlay", errno.ENOENT): "a lowerdir, the upperdir or the workdir does not exist",
    ("mount_overlay", errno.EBUSY): "upperdir or workdir is in use by another overlay "
        "(a previous sandbox still dying?)",
    ("mount_idmapped", errno.EINVAL): "this file system cannot be idmapped (no FS_ALLOW_IDMAP "
        "in this kernel); run sandboxes without user namespaces: [sandbox] userns = false",
    ("userns_map", errno.EPERM): "writing id maps needs CAP_SETUID/CAP_SETGID: run dsecd as root",
    ("mount", errno.ENOSPC): "too many mounts in the mount namespace (sysctl fs.mount-max)",
    ("mount", errno.ENODEV): "the kernel lacks this filesystem type (module not loaded?)",
    ("mount", errno.EPERM): "mounting needs CAP_SYS_ADMIN: run dsecd as root",
    ("mkdir", errno.ENOTDIR): "the image has a non-directory (a symlink?) where a mount "
        "point must be; refused so the mount cannot be redirected",
    ("mkdir", errno.EROFS): "the overlay came up read-only (upperdir on a read-only fs?)",
    ("pivot_root", errno.EINVAL): "the host root is an initramfs (rootfs), which cannot be "
        "pivoted away from",
    ("hostname", errno.EINVAL): f"hostnames are at most {HOSTNAME_MAX} bytes",
    ("setns", errno.ESRCH): "the sandbox's PID 1 has exited",
    ("setns", errno.EINVAL): "not a pidfd of a live process (setns on pidfds needs Linux 5.8)",
    ("setns", errno.EBADF): "the pidfd is closed",
    ("exec:clone", errno.ENOMEM): "the sandbox's PID namespace is dying: its PID 1 has exited",
    ("exec_interp", errno.ENOENT): "the file exists, but its ELF interpreter (e.g. "
        "/lib64/ld-linux-x86-64.so.2) or its #! interpreter is missing in the sandbox",
    ("exec", errno.EACCES): "not executable for this uid, a directory, or on a noexec mount",
    ("exec", errno.ENOEXEC): "not an ELF binary and no #! line",
    ("exec", errno.E2BIG): "argv plus env exceed the kernel's limit (ARG_MAX)",
    ("exec", errno.ETXTBSY): "the file is open for writing",
    ("chdir", errno.ENOENT): "the working directory does not exist in the sandbox",
    ("chdir", errno.EACCES): "the working directory is not searchable by this uid",
    ("caps", errno.EPERM): "cap_keep asks for a capability dsecd itself does not hold",
    ("openat2", errno.EXDEV): "the path leaves the root (RESOLVE_BENEATH) or crosses a mount "
        "(RESOLVE_NO_XDEV)",
    ("openat2", errno.ELOOP): "a symlink loop, or a symlink or magic link (/proc/*/root, "
        "/proc/*/fd/*) refused by RESOLVE_NO_SYMLINKS or RESOLVE_NO_MAGICLINKS",
    ("openat2", errno.EAGAIN): "concurrent renames or mounts kept racing the lookup",
    ("openat2", errno.ENOSYS): "the kernel lacks openat2 (Linux 5.6)",
    ("openat2", errno.E2BIG): "the kernel does not know this struct open_how (too old)",
    ("openat2", errno.EINVAL): "unknown flags or resolve bits, or a mode without O_CREAT",
    ("pidfd_open", errno.ESRCH): "the process has exited (and been reaped)",
    ("pidfd_open", errno.EINVAL): "not a thread-group leader, or bad flags",
    ("pidfd_send_signal", errno.ESRCH): "the process has exited",
    ("sched_core", errno.EINVAL): "the kernel was built without CONFIG_SCHED_CORE",
    ("sched_core", errno.ENODEV): "no SMT on this host: core scheduling has nothing to isolate",
    ("sched_core", errno.EPERM): "sharing a cookie needs ptrace access to the source process",
    ("sched_core", errno.ESRCH): "the process to take the cookie from has exited",
    ("sched_idle", errno.EPERM): "the target process belongs to another user",
    ("landlock", errno.EOPNOTSUPP): "landlock is built in but disabled: add it to the lsm= "
        "boot parameter",
    ("landlock", errno.ENOSYS): "the kernel was built without CONFIG_SECURITY_LANDLOCK",
    ("exec:landlock", errno.ELOOP): "a path the task policy names (or leads to a named one) is, or "
        "goes through, a symlink; name the real path in the policy: granting a link's target could "
        "give a hidden path's rights away",
    ("exec:landlock", errno.E2BIG): "a directory beside a hidden or narrowed path of the task policy "
        "has more entries than DSEC_POLICY_MAX_CHILDREN, each needing a rule of its own; hide or "
        "narrow a path in a smaller directory",
    ("exec:landlock", errno.EINVAL): "the kernel refused the ruleset or a rule: a Landlock ABI below "
        "the one `dsec info` reported?",
    ("exec:landlock", errno.EPERM): "landlock_restrict_self needs no_new_privs or CAP_SYS_ADMIN",
    ("seccomp", errno.EINVAL): "the kernel was built without CONFIG_SECCOMP_FILTER",
    ("seccomp", errno.EOPNOTSUPP): "the kernel lacks SECCOMP_RET_KILL_PROCESS (Linux 4.14)",
    ("bpf_cgroup", errno.EPERM): "needs CAP_BPF and CAP_NET_ADMIN (or CAP_SYS_ADMIN); on "
        "kernels before 5.11 also a high enough RLIMIT_MEMLOCK",
    ("bpf_cgroup", errno.EBADF): "not a cgroup v2 directory",
    ("kvm", errno.ENOENT): "no /dev/kvm: kvm module not loaded, or no hardware virtualization",
    ("kvm", errno.EINVAL): "the host refuses this VM type (nested virtualization off?)",
    ("clone3", errno.ENOSYS): "the kernel is older than 5.3",
    ("clone3", errno.EPERM): "clone3 is blocked by a seccomp filter (container runtime?)",
}


# ---------------------------------------------------------------- errors


class NativeError(OSError):
    """An errno from csrc/, with the step that failed and the path it failed on.

    ``str(e)`` is the message ("verb `object`: strerror; hint"); ``e.errno``,
    ``e.step`` (a name from `STEPS`, or the function for single calls) and
    ``e.path`` are there for code that branches.
    """

    def __init__(self, err: int, message: str, step: str | None = None,
                 path: str | None = None):
        super().__init__(err, message)
        self.step = step
        self.path = path

    def __str__(self) -> str:
        return self.strerror


def _errno_classes() -> dict[int, type[NativeError]]:
    """errno -> NativeError subclass that is also FileNotFoundError etc."""
    by_base: dict[type, type[NativeError]] = {}
    by_errno: dict[int, type[NativeError]] = {}
    for num in errno.errorcode:
        base = type(OSError(num, ""))
        if base is OSError:
            continue
        if base not in by_base:
            by_base[base] = type(f"Native{base.__name__}", (NativeError, base),
                                 {"__module__": __name__, "__doc__": NativeError.__doc__})
        by_errno[num] = by_base[base]
    return by_errno


_ERRNO_CLASSES = _errno_classes()


def hint_for(step: str, err: int, kind: str = "") -> str | None:
    """The hint for errno `err` at `step`, or None. `kind` ("exec",
    "container") narrows it where one step means two things."""
    return (_HINTS.get((f"{kind}:{step}", err)) or _HINTS.get((step, err))
            or (_HINTS.get(("mount", err)) if step in _MOUNT_STEPS else None))


def add_hints(hints: dict[tuple[str, int], str]) -> None:
    """Hints for the steps of another module's C calls (seccomp.py): (step, errno) -> what to do."""
    _HINTS.update(hints)


def describe_errno(step: str, err: int) -> str:
    """ "strerror; hint" for a probe result or step, for logs and `dsec info`."""
    err = abs(err)
    hint = hint_for(step, err)
    return f"{os.strerror(err)}; {hint}" if hint else os.strerror(err)


def native_error(err: int, verb: str, obj: str, step: str | None = None,
                 path: str | None = None, hint: str | None = None) -> NativeError:
    """Build the error for a positive errno: "verb `obj`: strerror; hint"."""
    message = f"{verb} `{obj}`: {os.strerror(err)}"
    hint = hint or hint_for(step or "", err)
    if hint:
        message += f"; {hint}"
    return _ERRNO_CLASSES.get(err, NativeError)(err, message, step=step, path=path)


def raise_error(err: int, verb: str, obj: str, step: str, path: str | None = None,
                hint: str | None = None) -> NoReturn:
    """Raise native_error(...) for a positive errno, chained to the plain OSError."""
    cause = OSError(err, os.strerror(err))
    raise native_error(err, verb, obj, step, path, hint) from cause


# ---------------------------------------------------------------- validation


def _path(name: str, value: str | os.PathLike, forbidden: str = "") -> bytes:
    text = os.fspath(value)
    if not isinstance(text, str) or not text.startswith("/"):
        raise ValueError(f"{name} must be an absolute path, got {value!r}")
    bad = [c for c in "\0" + forbidden if c in text]
    if bad:
        raise ValueError(f"{name} {text!r} contains {bad[0]!r}, which is not allowed there")
    raw = os.fsencode(text)
    if len(raw) >= PATH_MAX:
        raise ValueError(f"{name} is longer than PATH_MAX ({PATH_MAX - 1} bytes)")
    return raw


def _cgroup_files(paths: list[str]) -> list[bytes]:
    if len(paths) > lib.DSEC_MAX_CGROUPS:
        raise ValueError(f"at most {lib.DSEC_MAX_CGROUPS} cgroup.procs files, got {len(paths)}")
    return [_path("cgroup_procs entry", p) for p in paths]


def _cstring(name: str, value: str) -> bytes:
    raw = os.fsencode(value) if isinstance(value, str) else None
    if raw is None or b"\0" in raw:
        raise ValueError(f"{name} must be a str without NUL bytes, got {value!r}")
    return raw


def _fd(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an open fd (int >= 0), got {value!r}")


def _id(name: str, value: int) -> None:
    # (u32)-1 means "unchanged" to setresuid, which would silently keep root.
    if not isinstance(value, int) or not 0 <= value < 2**32 - 1:
        raise ValueError(f"{name} must be in 0..{2**32 - 2}, got {value!r}")


def _string_array(items: list[bytes], keep: list) -> object:
    """A NULL-terminated char *[]; `keep` holds the strings alive."""
    cells = [ffi.new("char[]", s) for s in items]
    array = ffi.new("char *[]", [*cells, ffi.NULL])
    keep.extend((array, *cells))  # a struct field does not own what it points to
    return array


# ---------------------------------------------------------------- containers


@dataclass(frozen=True)
class ContainerSpec:
    """A container sandbox to create; see docs/native-api.md."""

    rootfs: str            # empty host dir: the overlay is mounted here, in the sandbox's
                           # own mount namespace only (the host never sees it)
    lowerdirs: list[str]   # image layers, top first
    upperdir: str
    workdir: str
    hostname: str
    init_path: str         # host path of the static dsec-init binary
    cgroup_procs: list[str]  # cgroup.procs files joined (by writing "0") before the
                             # cgroup namespace is unshared
    tmp_size_bytes: int    # /tmp and /dev/shm share one tmpfs (with /dev) of
    shm_size_bytes: int    # tmp + shm bytes: scratch_size_bytes()
    sched_idle: bool = False  # PID 1 (and all it forks) runs SCHED_IDLE
    core_sched: bool = False  # PID 1 gets a core-scheduling cookie of its own
    seccomp_profile: int = -1  # a filter pre-built by dsecd.seccomp.prepare(); -1 = none
    userns_fd: int = -1    # user namespace init enters last (userns_create); -1 = none
    userns_uid: int = 0    # host ids in-sandbox 0 maps to: fs ids of the setup steps
    userns_gid: int = 0
    netns_fd: int = -1  # join this network namespace (dsecd/net/pool.py); -1 = a new, empty one
    upper_fd: int = -1     # mount fd of the upper tmpfs (upperfs_create), kept open in
                           # init as fd UPPER_FD; upperdir/workdir then lie on it
    ctl_fd: int = -1       # init's end of its exec channel (dsecd/initlink.py), kept open in
                           # init as fd INIT_CTL_FD; -1: init forks nothing
    ctl_peer_fd: int = -1  # with ctl_fd: the daemon's end, which init keeps as INIT_PEER_FD
                           # for a restarted daemon
    init_caps: int = 0     # capabilities init keeps permitted (never effective) to hand to
                           # the execs it forks; only with ctl_fd
    oom_reset: bool = False  # oom_score_adj back to 0 (the daemon's own is negative)
    root_ns_fd: int = -1   # a mount namespace from root_ns(): PID 1 gets a copy of it with the overlay
                           # on its root and chroots there; -1: a copy of the caller's, pivot_root
    park_fds: tuple[int, ...] = ()  # detached mounts named in the overlay options (idmapped layer
                           # clones) that PID 1 attaches under its overlay (with root_ns_fd), to
                           # go with its mount namespace (csrc/spawn.c layers_park)
    proc_options: str = ""  # mount data of the sandbox's /proc ("hidepid=invisible,gid=N"); "": none
    root_readonly: bool = False  # the merged root read-only (/proc, /dev, /tmp, /dev/shm are not)

    def __post_init__(self):
        self.overlay_options()
        if not isinstance(self.init_caps, int) or not 0 <= self.init_caps < 2**64:
            raise ValueError(f"init_caps must be a 64-bit mask, got {self.init_caps!r}")
        if self.ctl_fd >= 0 and self.ctl_peer_fd < 0:
            raise ValueError("ctl_fd needs ctl_peer_fd: init keeps both ends of its channel")
        if self.userns_fd >= 0:
            _id("userns_uid", self.userns_uid)
            _id("userns_gid", self.userns_gid)
        _path("rootfs", self.rootfs)
        _path("init_path", self.init_path)
        _cgroup_files(self.cgroup_procs)
        _cstring("proc_options", self.proc_options)
        name = _cstring("hostname", self.hostname)
        if not 0 < len(name) <= HOSTNAME_MAX:
            raise ValueError(f"hostname must be 1..{HOSTNAME_MAX} bytes, got {self.hostname!r}")
        for field in ("tmp_size_bytes", "shm_size_bytes"):
            value = getattr(self, field)
            # size=0 means "unlimited" to tmpfs: never what a sandbox should get.
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")

    def scratch_size_bytes(self) -> int:
        """size= of the sandbox's scratch tmpfs, which holds /dev, /dev/shm and
        /tmp (csrc/spawn.c scratch_mount): one superblock, not three. /dev
        needs no share of it: its nodes, links and dirs hold no data pages."""
        return self.tmp_size_bytes + self.shm_size_bytes

    def overlay_options(self) -> bytes:
        """The overlay mount data. ',' ':' and '\\' are refused in layer paths
        rather than escaped: they are the option syntax of overlayfs."""
        if not self.lowerdirs:
            raise ValueError("lowerdirs must name at least one layer")
        lower = b":".join(_path("lowerdir", d, ",:\\") for d in self.lowerdirs)
        upper = _path("upperdir", self.upperdir, ",:\\")
        work = _path("workdir", self.workdir, ",:\\")
        # redirect_dir=follow, metacopy=off whatever the host's overlay
        # module defaults to (overlay.redirect_dir, overlay.metacopy): the
        # upper dir becomes a layer (a snapshot, a build step), and a
        # redirect (a renamed lower directory: its files stay in the layer
        # below) or a metacopy (a chmod'ed file: its data stays below) would
        # make one that is not whole; an overlay with metacopy off refuses
        # to read such a file (EPERM), and `image flatten` refuses the
        # layer. A rename of a lower directory gets EXDEV (mv then copies).
        # Redirects in a layer made elsewhere are still followed.
        opts = b"lowerdir=%s,upperdir=%s,workdir=%s,redirect_dir=follow,metacopy=off" % (lower, upper, work)
        # The spawn child copies them into a buffer of one page (csrc/spawn.c
        # DSEC_OVERLAY_OPTS_MAX), and mount(2) would take no more.
        if len(opts) >= PAGE_SIZE:
            raise TooManyLayers(len(self.lowerdirs), len(opts))
        return opts


class TooManyLayers(ValueError):
    """Overlay mount data of more layers than one page holds: an image too
    deep for a container (a long chain of snapshots or builds)."""

    def __init__(self, layers: int, size: int):
        self.layers, self.size = layers, size
        # About how many layers fit, their paths being about as long as these.
        self.fit = max(1, layers * (PAGE_SIZE - 1) // size)
        super().__init__(f"overlay options of {layers} layers are {size} bytes, past {PAGE_SIZE - 1}: "
                         f"use an image of fewer layers (about {self.fit} fit)")


# Paths through one of our fds (idmapped layers, the upper tmpfs): the spawn
# child keeps these open until it mounts (csrc/spawn.c fds_own).
_PROC_FD_PATH = re.compile(rb"/proc/self/fd/(\d+)")


def spawn_container(spec: ContainerSpec) -> int:
    """Create the sandbox; return the host pid of its PID 1 (dsec-init), a
    child of the caller, which must reap it (waitpid or a pidfd)."""
    keep: list = []
    strings = [os.fsencode(spec.rootfs), spec.overlay_options(), os.fsencode(spec.init_path),
               os.fsencode(spec.hostname), b"mode=0755,size=%d" % spec.scratch_size_bytes()]
    cells = [ffi.new("char[]", s) for s in strings]
    args = ffi.new("struct dsec_container_args *")
    args.rootfs, args.overlay_opts, args.init_path, args.hostname, args.scratch_opts = cells
    cgroups = _cgroup_files(spec.cgroup_procs)
    args.cgroup_procs, args.n_cgroups = _string_array(cgroups, keep), len(cgroups)
    args.sched_idle, args.core_sched = bool(spec.sched_idle), bool(spec.core_sched)
    args.seccomp_profile = int(spec.seccomp_profile)
    args.userns_fd = int(spec.userns_fd)
    args.userns_uid, args.userns_gid = spec.userns_uid, spec.userns_gid
    args.netns_fd = int(spec.netns_fd)
    args.upper_fd = int(spec.upper_fd)
    args.ctl_fd, args.init_caps = int(spec.ctl_fd), spec.init_caps if spec.ctl_fd >= 0 else 0
    args.ctl_peer_fd = int(spec.ctl_peer_fd) if spec.ctl_fd >= 0 else -1
    args.oom_reset = bool(spec.oom_reset)
    args.root_ns_fd = int(spec.root_ns_fd)
    args.root_readonly = bool(spec.root_readonly)
    if spec.proc_options:
        keep.append(ffi.new("char[]", _cstring("proc_options", spec.proc_options)))
        args.proc_opts = keep[-1]
    path_fds = sorted({int(n) for n in _PROC_FD_PATH.findall(b" ".join(strings[:2]))})
    if len(path_fds) > lib.DSEC_MAX_PATH_FDS:
        raise ValueError(f"{len(path_fds)} layers named through fds; a spawn takes at most {lib.DSEC_MAX_PATH_FDS}")
    keep.append(ffi.new("int[]", path_fds or [-1]))      # owned here until the spawn returns
    args.path_fds = keep[-1]
    args.n_path_fds = len(path_fds)
    if not set(spec.park_fds) <= set(path_fds):
        raise ValueError(f"park_fds {spec.park_fds} must be fds the overlay options name ({path_fds})")
    keep.append(ffi.new("int[]", list(spec.park_fds) or [-1]))
    args.park_fds = keep[-1]
    args.n_park_fds = len(spec.park_fds)
    err = ffi.new("struct dsec_err *")
    pid = lib.dsec_spawn_container(args, err)
    if pid < 0:
        init = f"sandbox init of {spec.rootfs}"
        _raise_step(err, "container", {"hostname": spec.hostname, "loopback": "lo",
                                       "stdio": init}, init, root=spec.rootfs)
    return pid


def cgroup_make(dirs: list[str], writes: list[tuple[str, str]]) -> None:
    """mkdir each of `dirs`, then write each (file, value), in one call
    (csrc/cgroupfs.c); on failure the dirs made are removed again and a
    NativeError names the step (cgroup_mkdir, cgroup_write) and path."""
    keep: list = []
    err = ffi.new("struct dsec_err *")
    rc = lib.dsec_cgroup_make(_string_array([os.fsencode(d) for d in dirs], keep), len(dirs),
                              _string_array([os.fsencode(f) for f, _ in writes], keep),
                              _string_array([v.encode() for _, v in writes], keep), len(writes), err)
    if rc < 0:
        _raise_step(err, "cgroup", {}, dirs[0] if dirs else "cgroup")


def root_ns(mount_dir: str) -> int:
    """An fd of the mount namespace sandboxes' are copied from (ContainerSpec.
    root_ns_fd): a copy of the caller's, pivot_root'ed into an empty,
    read-only tmpfs (mounted on `mount_dir`, an existing directory, in that
    copy only). Close-on-exec; it keeps the namespace alive."""
    err = ffi.new("struct dsec_err *")
    fd = lib.dsec_root_ns(_cstring("mount_dir", mount_dir), err)
    if fd < 0:
        _raise_step(err, "root_ns", {}, f"root namespace on {mount_dir}")
    return fd


@dataclass(frozen=True)
class Reader:
    """A client other than root, whose access checks a lookup makes
    (peer_tree, reader_ids): uid, primary gid, supplementary gids."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def __post_init__(self):
        if self.uid == 0:
            raise ValueError("root reads everything: give no Reader for it")
        _id("uid", self.uid)
        _id("gid", self.gid)
        for g in self.groups:
            _id("group", g)

    def _struct(self):
        """The struct dsec_reader, and the array it points to (keep both alive)."""
        groups = ffi.new("uint32_t[]", list(self.groups) or [0])
        raw = ffi.new("struct dsec_reader *", {"uid": self.uid, "gid": self.gid, "groups": groups,
                                              "n_groups": len(self.groups)})
        return raw, groups


def peer_tree(pidfd: int, path: str, reader: Reader | None = None) -> int:
    """The fd of a detached clone of the tree at absolute `path` as the
    process behind `pidfd` sees it (its mount namespace and root),
    submounts included (csrc/spawn.c dsec_peer_tree). With `reader`, the
    path is looked up and opened with the reader's ids first: EACCES when
    it could not open it itself. Close-on-exec; attach it with
    attach_tree(). NativeError naming the path on failure (ESRCH: the
    process is gone)."""
    if not path.startswith("/"):
        raise ValueError(f"path must be absolute, got {path!r}")
    raw_reader, _groups = reader._struct() if reader is not None else (ffi.NULL, None)
    rootfd = _peer_root(pidfd, path)
    try:
        err = ffi.new("struct dsec_err *")
        fd = lib.dsec_peer_tree(pidfd, rootfd, _cstring("path", path), raw_reader, err)
    finally:
        os.close(rootfd)
    if fd < 0:
        _raise_step(err, "peer_tree", {}, path)
    return fd


def _peer_root(pidfd: int, path: str) -> int:
    """An O_PATH fd of the root directory of the process behind pidfd. Its
    /proc/<pid>/root, opened while the pidfd shows that process alive both
    before and after, so that the pid cannot have named another process."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        pid = next((int(line.split()[1]) for line in f if line.startswith("Pid:")), -1)
    if pid <= 0:
        raise native_error(errno.ESRCH, "enter the client's mount namespace to reach", path, "peer_ns", path)
    try:
        rootfd = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise native_error(errno.ESRCH, "enter the client's mount namespace to reach", path, "peer_ns",
                           path) from None
    try:
        pidfd_send_signal(pidfd, 0)
    except OSError:
        os.close(rootfd)
        raise
    return rootfd


def attach_tree(tree: int, target: str) -> None:
    """Attach the detached tree `tree` (peer_tree) at `target` (an existing
    directory, or file for a file's tree) in our mount namespace."""
    rc = lib.dsec_attach_tree(tree, _path("target", target))
    if rc < 0:
        raise_error(-rc, "attach", f"a client's tree on {target}", "attach_tree", target)


@dataclass(frozen=True)
class RootEntry:
    """One entry of vm_root(): kind is "dir", "symlink" (src: the link's
    text), "bind_dir", "bind_file" (src: the host path) or "proc" (src: its
    mount options); target is relative to the new root; flags (MS_*) are
    the bind's or proc's mount flags."""

    kind: str
    target: str
    src: str = ""
    flags: int = 0


_ROOT_KINDS = {"dir": "DSEC_ROOT_DIR", "symlink": "DSEC_ROOT_SYMLINK", "bind_dir": "DSEC_ROOT_BIND_DIR",
               "bind_file": "DSEC_ROOT_BIND_FILE", "proc": "DSEC_ROOT_PROC"}


def vm_root(mount_dir: str, entries: list[RootEntry]) -> int:
    """An fd of a new mount namespace whose root is a tmpfs holding only
    `entries`, made in order (csrc/spawn.c dsec_vm_root). `mount_dir`: an
    empty directory of the caller's, where the tmpfs is mounted in the new
    namespace only. Close-on-exec; the namespace lives while the fd or a
    process in it does. A failure names the entry: "bind `<src>` into the
    VM's root at `/<target>`: <strerror>"."""
    keep: list = []
    arr = ffi.new("struct dsec_root_entry[]", max(1, len(entries)))
    for i, en in enumerate(entries):
        if en.kind not in _ROOT_KINDS:
            raise ValueError(f"unknown root entry kind {en.kind!r} (one of {', '.join(_ROOT_KINDS)})")
        if en.target.startswith("/") or ".." in en.target.split("/") or not en.target:
            raise ValueError(f"root entry target {en.target!r} must be relative, without '..'")
        src = ffi.new("char[]", os.fsencode(en.src))
        target = ffi.new("char[]", os.fsencode(en.target))
        keep += [src, target]
        arr[i].kind = getattr(lib, _ROOT_KINDS[en.kind])
        arr[i].flags = en.flags
        arr[i].src = src
        arr[i].target = target
    err = ffi.new("struct dsec_err *")
    fd = lib.dsec_vm_root(_cstring("mount_dir", mount_dir), arr, len(entries), err)
    if fd >= 0:
        return fd
    step = STEPS.get(err.step, "")
    target = os.fsdecode(ffi.string(err.path))
    entry = next((en for en in entries if en.target == target), None)
    if entry is not None and entry.kind.startswith("bind"):
        raise native_error(err.err, f"bind `{entry.src}` into the VM's root at", f"/{target}", step, target)
    if entry is not None:
        raise native_error(err.err, _VERBS.get(step, step), f"/{target} of the VM's root", step, target)
    _raise_step(err, "vm_root", {}, f"the VM's root on {mount_dir}")


def _step_error(err, kind: str, objects: dict[str, str], default: str, root: str = "",
                hint: str | None = None) -> NativeError:
    """The NativeError of a filled struct dsec_err. The object named in the
    message is objects[step] if given, else the recorded path (a relative one
    is inside `root`, the merged rootfs), else `default`."""
    step = STEPS.get(err.step, f"step {err.step}")
    path = os.fsdecode(ffi.string(err.path)) or None
    if step in objects:
        obj = objects[step]
    elif path:
        obj = path if path.startswith("/") or not root else os.path.join(root, path)
    else:
        obj = default
    error = native_error(err.err, _VERBS.get(step, step), obj, step, path, hint or hint_for(step, err.err, kind))
    error.__cause__ = OSError(err.err, os.strerror(err.err))
    return error


def _raise_step(err, kind: str, objects: dict[str, str], default: str, root: str = "",
                hint: str | None = None) -> NoReturn:
    raise _step_error(err, kind, objects, default, root, hint)


# ---------------------------------------------------------------- exec


@dataclass(frozen=True)
class ExecSpec:
    """A process to start in a running sandbox; see docs/native-api.md."""

    pidfd: int             # pidfd of the sandbox's init: setns(pidfd, NS flags)
    cgroup_procs: list[str]
    argv: list[str]        # argv[0] is searched in the PATH of env, inside the sandbox
    env: list[str]         # "K=V"
    cwd: str
    uid: int
    gid: int
    stdin_fd: int          # host fds dup2'ed onto 0, 1, 2 in the child
    stdout_fd: int
    stderr_fd: int
    cap_keep: int          # capabilities kept: bounding = permitted = effective =
                           # inheritable = ambient = cap_keep
    sched_idle: bool = False  # SCHED_IDLE before execve; its children inherit it
    core_sched: bool = False  # copy the core-scheduling cookie of the sandbox's PID 1
    seccomp_profile: int = -1  # a filter pre-built by dsecd.seccomp.prepare(); -1 = none
    userns: bool = False   # join PID 1's user namespace; uid/gid are then in-sandbox ids
    oom_reset: bool = False  # oom_score_adj back to 0 (the daemon's own is negative)
    ctty: bool = False     # stdin_fd is a pty slave: it becomes the controlling terminal
    policy: bytes | None = None   # a task policy's plan (dsecd/policy.py compile): Landlock before execve
    groups: tuple[int, ...] = ()  # supplementary gids (at most MAX_GROUPS); none by default
    own_ipc: bool = False  # unshare an IPC namespace of its own (with userns: owned by the sandbox's)

    def __post_init__(self):
        _fd("pidfd", self.pidfd)
        for name in ("stdin_fd", "stdout_fd", "stderr_fd"):
            _fd(name, getattr(self, name))
        _cgroup_files(self.cgroup_procs)
        check_exec_request(self.argv, self.env, self.cwd, self.uid, self.gid)
        check_groups(self.groups)
        if not isinstance(self.cap_keep, int) or not 0 <= self.cap_keep < 2**64:
            raise ValueError(f"cap_keep must be a 64-bit mask, got {self.cap_keep!r}")
        if self.policy is not None and not 0 < len(self.policy) <= POLICY_MAX_BYTES:
            raise ValueError(f"a policy plan is 1..{POLICY_MAX_BYTES} bytes, got {len(self.policy)}")


def check_exec_request(argv: list[str], env: list[str], cwd: str, uid: int,
                       gid: int) -> tuple[list[bytes], list[bytes], bytes]:
    """ValueError unless the exec's strings and ids can reach execve as given:
    what both ways of starting an exec (spawn_exec, dsec-init's channel) need.
    Returns argv, env and cwd encoded."""
    if not argv or not argv[0]:
        raise ValueError("argv must have a non-empty argv[0]")
    raw_argv = [_cstring("argv entry", arg) for arg in argv]
    raw_env = [_cstring("env entry", var) for var in env]
    for var, raw in zip(env, raw_env, strict=True):
        if raw.find(b"=") < 1:
            raise ValueError(f"env entries are 'K=V' with a non-empty K, got {var!r}")
    raw_cwd = _path("cwd", cwd)
    _id("uid", uid)
    _id("gid", gid)
    return raw_argv, raw_env, raw_cwd


def check_groups(groups: tuple[int, ...]) -> None:
    """ValueError unless `groups` is a supplementary group list setgroups takes."""
    if len(groups) > MAX_GROUPS:
        raise ValueError(f"at most {MAX_GROUPS} supplementary groups, got {len(groups)}")
    for gid in groups:
        _id("supplementary gid", gid)


def spawn_exec(spec: ExecSpec) -> int:
    """Start argv in the sandbox; return its host pid.

    The process is a direct child of the caller (CLONE_PARENT; reap it),
    session and process-group leader, in the sandbox's namespaces and
    cgroups. Failures before execve (ENOENT for a missing program, EACCES, a
    bad cwd, a dead sandbox) are raised here with their step, never turned
    into exit status 127.
    """
    keep: list = []
    args = ffi.new("struct dsec_exec_args *")
    args.pidfd = spec.pidfd
    cgroups = _cgroup_files(spec.cgroup_procs)
    args.cgroup_procs, args.n_cgroups = _string_array(cgroups, keep), len(cgroups)
    args.argv = _string_array([os.fsencode(a) for a in spec.argv], keep)
    args.envp = _string_array([os.fsencode(v) for v in spec.env], keep)
    cwd = ffi.new("char[]", os.fsencode(spec.cwd))
    args.cwd = cwd
    args.uid, args.gid, args.cap_keep = spec.uid, spec.gid, spec.cap_keep
    args.stdin_fd, args.stdout_fd, args.stderr_fd = spec.stdin_fd, spec.stdout_fd, spec.stderr_fd
    args.sched_idle, args.core_sched = bool(spec.sched_idle), bool(spec.core_sched)
    args.seccomp_profile = int(spec.seccomp_profile)
    args.userns = bool(spec.userns)
    args.oom_reset = bool(spec.oom_reset)
    args.ctty = bool(spec.ctty)
    args.own_ipc = bool(spec.own_ipc)
    if spec.groups:
        groups = ffi.new("uint32_t[]", list(spec.groups))
        keep.append(groups)
        args.groups, args.n_groups = groups, len(spec.groups)
    if spec.policy is not None:
        plan = ffi.new("unsigned char[]", spec.policy)
        keep.append(plan)
        args.policy, args.policy_len = plan, len(spec.policy)
    err = ffi.new("struct dsec_err *")
    pid = lib.dsec_spawn_exec(args, err)
    if pid < 0:
        _raise_exec(err, spec)
    return pid


def _raise_exec(err, spec: ExecSpec) -> NoReturn:
    raise _exec_step_error(err, spec.argv[0], spec.env, f"uid {spec.uid} gid {spec.gid}", spec.cwd,
                           f"pidfd {spec.pidfd}")


def _exec_step_error(err, argv0: str, env: list[str], ids: str, cwd: str, via: str) -> NativeError:
    hint = None
    if err.step == lib.DSEC_STEP_EXEC and err.err == errno.ENOENT and "/" not in argv0:
        search = next((v[5:] for v in env if v.startswith("PATH=")), DEFAULT_PATH)
        hint = f"not found in PATH={search} inside the sandbox"
    objects = {"setns": via, "ids": ids, "chdir": cwd, "init_request": "an exec"}
    return _step_error(err, "exec", objects, argv0, hint=hint)


def init_exec_error(raw_err: bytes, argv0: str, env: list[str], uid: int, cwd: str) -> NativeError:
    """The error of an exec dsec-init could not start: raw_err is the struct
    dsec_err of its answer (csrc/init.c), read as untrusted bytes."""
    err = ffi.new("struct dsec_err *")
    if len(raw_err) != ffi.sizeof(err[0]):
        raise ValueError(f"an init answer's error is {len(raw_err)} bytes, not {ffi.sizeof(err[0])}")
    ffi.memmove(err, raw_err, len(raw_err))
    err.path[len(err.path) - 1] = b"\0"
    return _exec_step_error(err, argv0, env, f"uid {uid} gid {uid}", cwd, "the sandbox's init")


INIT_CTL_FD: int = lib.DSEC_INIT_CTL_FD
INIT_PEER_FD: int = lib.DSEC_INIT_PEER_FD
INIT_MAGIC: int = lib.DSEC_INIT_MAGIC
INIT_STARTED: int = lib.DSEC_INIT_STARTED
INIT_EXITED: int = lib.DSEC_INIT_EXITED
INIT_OP_START: int = lib.DSEC_INIT_OP_START
INIT_OP_KILL: int = lib.DSEC_INIT_OP_KILL
INIT_OP_COPY: int = lib.DSEC_INIT_OP_COPY
INIT_START_CTTY: int = lib.DSEC_INIT_START_CTTY
INIT_OP_RELEASE: int = lib.DSEC_INIT_OP_RELEASE
INIT_OP_PRUNE: int = lib.DSEC_INIT_OP_PRUNE
INIT_START_HOLD: int = lib.DSEC_INIT_START_HOLD
INIT_START_POLICY: int = lib.DSEC_INIT_START_POLICY
INIT_START_GROUPS: int = lib.DSEC_INIT_START_GROUPS
INIT_START_OWN_IPC: int = lib.DSEC_INIT_START_OWN_IPC
MAX_GROUPS: int = lib.DSEC_MAX_GROUPS
POLICY_MAGIC: int = lib.DSEC_POLICY_MAGIC
POLICY_MAX_BYTES: int = lib.DSEC_POLICY_MAX_BYTES
POLICY_MAX_CHILDREN: int = lib.DSEC_POLICY_MAX_CHILDREN
INIT_MAX_STRINGS: int = lib.DSEC_INIT_MAX_STRINGS
INIT_REQ_SIZE: int = ffi.sizeof("struct dsec_init_req")
INIT_REPLY_SIZE: int = ffi.sizeof("struct dsec_init_reply")
INIT_REPLY_ERR_OFFSET: int = ffi.offsetof("struct dsec_init_reply", "err")


# ---------------------------------------------------------------- user namespaces


def userns_create(uid: int, gid: int, count: int) -> int:
    """An fd of a new user namespace mapping ids 0..count-1 to uid.. / gid..
    on the host (close-on-exec). For setns by a spawn, and as mount idmap."""
    for name, value in (("uid", uid), ("gid", gid)):
        _id(name, value)
    if not 0 < count < 2**32 or uid + count > 2**32 - 1 or gid + count > 2**32 - 1:
        raise ValueError(f"id range {uid}/{gid} + {count} does not fit in 32-bit ids")
    err = ffi.new("struct dsec_err *")
    fd = lib.dsec_userns_create(uid, gid, count, err)
    if fd < 0:
        _raise_step(err, "userns", {"userns_map": f"user namespace {uid}+{count}"},
                    "user namespace holder")
    return fd


def mount_idmapped(path: str, userns_fd: int) -> int:
    """A detached clone of the mount tree at `path`, idmapped through the user
    namespace `userns_fd` (close-on-exec fd; the clone lives while it is open
    or used as an overlay layer)."""
    raw = _cstring("path", path)
    fd = lib.dsec_mount_idmapped(raw, userns_fd)
    if fd < 0:
        raise_error(-fd, "make idmapped mount of", path, "mount_idmapped", path)
    return fd


# Per thread: the fs ids fs_ids gave it, (0, 0) outside of one, and the
# Reader whose ids reader_ids gave it, if any: reader_ids inside fs_ids
# gives the thread back the fs ids it had (a COPY opens a context file as
# the client while it writes as the sandbox's root), and reader_ids inside
# one of the same reader changes nothing.
_thread_ids = threading.local()


def _fs_now() -> tuple[int, int]:
    return getattr(_thread_ids, "fs", (0, 0))


class fs_ids:
    """Context manager: the calling thread's file-system uid/gid become
    (uid, gid), capabilities kept, and are set back to what they were
    (0/0 outside of another fs_ids) on exit. Files created meanwhile belong
    to those ids; other threads are not affected."""

    def __init__(self, uid: int, gid: int):
        _id("uid", uid)
        _id("gid", gid)
        self.uid, self.gid = uid, gid

    def __enter__(self):
        self._before = _fs_now()
        rc = lib.dsec_fsids_set(self.uid, self.gid)
        if rc < 0:
            lib.dsec_fsids_set(*self._before)
            raise_error(-rc, "set fs uid/gid to", f"{self.uid}/{self.gid}", "fsids")
        _thread_ids.fs = (self.uid, self.gid)
        return self

    def __exit__(self, *exc):
        _thread_ids.fs = self._before
        rc = lib.dsec_fsids_set(*self._before)
        if rc < 0:
            raise_error(-rc, "set fs uid/gid back to", "{}/{}".format(*self._before), "fsids")
        return False


def kill_uid_in(pidfd: int, uid: int) -> None:
    """SIGKILL every process of host uid `uid` (a call's, in a call
    sandbox's id range; never 0) in the pid namespace of pidfd's process
    (the call sandbox's init), with nothing of it able to outrun the kill,
    and nothing of that uid outside that namespace reached (csrc/spawn.c
    dsec_kill_uid_in)."""
    _id("uid", uid)
    rc = lib.dsec_kill_uid_in(pidfd, uid)
    if rc < 0:
        raise_error(-rc, "kill the processes of", f"uid {uid}", "kill_uid")


class reader_ids:
    """Context manager: the calling thread's lookups and opens are checked
    against a client's ids (Reader) instead of root's, with no capability
    to override them, until exit puts the thread's groups and fs ids back
    (those of an fs_ids it runs in, else root's) (csrc/userns.c
    dsec_reader_ids_set). Inside a reader_ids of the same reader it
    changes nothing. Other threads are not affected."""

    def __init__(self, reader: Reader):
        self.reader = reader

    def __enter__(self):
        active = getattr(_thread_ids, "reader", None)
        self._nested = active is not None
        if self._nested:
            if active != self.reader:
                raise ValueError(f"this thread reads as uid {active.uid} already, not as uid {self.reader.uid}")
            return self
        self._own_groups = os.getgroups()       # the thread's: every daemon thread has the same
        raw, self._keep = self.reader._struct()
        rc = lib.dsec_reader_ids_set(raw)
        if rc < 0:
            self._restore()
            raise_error(-rc, "take the ids of", f"uid {self.reader.uid}", "fsids")
        _thread_ids.reader = self.reader
        return self

    def __exit__(self, *exc):
        if not self._nested:
            _thread_ids.reader = None
            self._restore()
        return False

    def _restore(self) -> None:
        # Root's fs ids and capabilities first: setgroups needs CAP_SETGID,
        # and only they let the thread take other fs ids (those of an fs_ids
        # it runs in) again.
        groups = ffi.new("uint32_t[]", self._own_groups or [0])
        rc = lib.dsec_fsids_set(0, 0)
        if rc >= 0 and _fs_now() != (0, 0):
            rc = lib.dsec_fsids_set(*_fs_now())
        if rc >= 0:
            rc = lib.dsec_thread_groups_set(groups, len(self._own_groups))
        if rc < 0:
            raise_error(-rc, "give the daemon's ids back to", "this thread", "fsids")


# ---------------------------------------------------------------- files, pidfds


def openat2(dirfd: int, path: str, flags: int, mode: int = 0,
            resolve: int = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) -> int:
    """openat2(2); the fd is always O_CLOEXEC. With RESOLVE_IN_ROOT, "/" and
    ".." (also in symlink targets) stop at dirfd."""
    raw = _cstring("path", path)
    # EAGAIN: a rename or mount raced an IN_ROOT/BENEATH walk; the kernel asks
    # for a retry. RESOLVE_CACHED's EAGAIN means "not cached": no retry.
    tries = 1 if resolve & RESOLVE_CACHED else 8
    for _ in range(tries):
        fd = lib.dsec_file_openat2(dirfd, raw, flags | os.O_CLOEXEC, mode, resolve)
        if fd != -errno.EAGAIN:
            break
    if fd < 0:
        raise_error(-fd, "open", path, "openat2", path)
    return fd


# Kernel-interface file systems (statfs f_type): a read or write there is not
# a file operation but a kernel call (procfs, sysfs, cgroupfs, ...).
KERNEL_FS_MAGICS: dict[int, str] = {
    lib.PROC_SUPER_MAGIC: "proc", lib.SYSFS_MAGIC: "sysfs", lib.DEBUGFS_MAGIC: "debugfs",
    lib.TRACEFS_MAGIC: "tracefs", lib.SECURITYFS_MAGIC: "securityfs", lib.CGROUP_SUPER_MAGIC: "cgroup",
    lib.CGROUP2_SUPER_MAGIC: "cgroup2", lib.BPF_FS_MAGIC: "bpf", lib.DEVPTS_SUPER_MAGIC: "devpts",
    lib.NSFS_MAGIC: "nsfs", lib.EFIVARFS_MAGIC: "efivarfs", lib.PSTOREFS_MAGIC: "pstore",
    lib.BINFMTFS_MAGIC: "binfmt_misc", lib.SELINUX_MAGIC: "selinuxfs", lib.SMACK_MAGIC: "smackfs",
}


def fs_magic(fd: int, what: str) -> int:
    """statfs f_type of the file system holding an open file."""
    magic = lib.dsec_file_fs_magic(fd)
    if magic < 0:
        raise_error(-magic, "inspect", what, "fstatfs")
    return magic & 0xFFFFFFFF


def vmsplice(fd: int, data) -> int:
    """Map the bytes of `data` (bytes or a memoryview of them) into pipe fd
    without a copy; how many were mapped. The pipe refers to data's memory:
    it must stay alive and unchanged until the reader consumed it."""
    buf = ffi.from_buffer(data)
    n = lib.dsec_vmsplice(fd, buf, len(buf))
    if n < 0:
        raise OSError(-n, f"vmsplice: {os.strerror(-n)}")
    return n


def pidfd_open(pid: int) -> int:
    """A pidfd (always close-on-exec) for a process; pins its pid against reuse."""
    fd = lib.dsec_pidfd_open(pid, 0)
    if fd < 0:
        raise_error(-fd, "pidfd_open", f"pid {pid}", "pidfd_open")
    return fd


def pidfd_getfd(pidfd: int, targetfd: int) -> int:
    """A duplicate (close-on-exec) of fd `targetfd` of the process behind `pidfd`."""
    fd = lib.dsec_pidfd_getfd(pidfd, targetfd)
    if fd < 0:
        raise_error(-fd, "take fd", f"{targetfd} of pidfd {pidfd}", "pidfd_getfd")
    return fd


def netns_create() -> int:
    """An fd (close-on-exec) of a new, empty network namespace, made by the calling
    thread without leaving its own (csrc/netns.c). Closing the fd frees it."""
    fd = lib.dsec_netns_create()
    if fd < 0:
        raise_error(-fd, "create", "network namespace", "netns_create")
    return fd


def pidfd_send_signal(pidfd: int, sig: int) -> None:
    rc = lib.dsec_pidfd_send_signal(pidfd, int(sig))
    if rc < 0:
        raise_error(-rc, f"send signal {int(sig)} via", f"pidfd {pidfd}", "pidfd_send_signal")


def pidfd_kill_group(pidfd: int, sig: int) -> None:
    """sig to the process group of pidfd's process (Linux 6.9+)."""
    rc = lib.dsec_pidfd_kill_group(pidfd, int(sig))
    if rc < 0:
        raise_error(-rc, f"send signal {int(sig)} to the process group of", f"pidfd {pidfd}", "pidfd_send_signal")


# ---------------------------------------------------------------- CPU QoS
# The same C helpers the spawn children run as steps, for one existing process.


def sched_set_idle(pid: int) -> None:
    """sched_setscheduler(pid, SCHED_IDLE); pid 0 = the calling thread."""
    rc = lib.dsec_sched_set_idle(pid)
    if rc < 0:
        raise_error(-rc, "set SCHED_IDLE for", f"pid {pid}", "sched_idle")


def ioprio_idle() -> None:
    """The calling thread's I/O to the idle class (served when nothing else waits)."""
    rc = lib.dsec_ioprio_idle()
    if rc < 0:
        raise_error(-rc, "set the idle I/O class of", "this thread", "ioprio")


def sched_core_create(pid: int) -> None:
    """A new core-scheduling cookie for pid's thread group (0 = the caller's).
    EINVAL: no CONFIG_SCHED_CORE; ENODEV: no SMT (both with a hint)."""
    rc = lib.dsec_sched_core_create(pid)
    if rc < 0:
        raise_error(-rc, "create core-scheduling cookie for", f"pid {pid}", "sched_core")


def sched_core_share_from(pid: int) -> None:
    """Copy pid's core-scheduling cookie onto the calling thread."""
    rc = lib.dsec_sched_core_share_from(pid)
    if rc < 0:
        raise_error(-rc, "take core-scheduling cookie from", f"pid {pid}", "sched_core")


# ---------------------------------------------------------------- probes
# 0 = available, else the (positive) errno that says why not; never raise for
# "absent". describe_errno(name, code) turns a code into text with a hint.


def probe_sched_core() -> int:
    """prctl(PR_SCHED_CORE_GET): EINVAL = kernel lacks it, ENODEV = no SMT."""
    return -lib.dsec_probe_sched_core()


def probe_landlock_abi() -> int:
    """The landlock ABI version (>= 1), or -errno."""
    return lib.dsec_probe_landlock_abi()


def probe_seccomp() -> int:
    """Filter mode with SECCOMP_RET_KILL_PROCESS and SECCOMP_RET_ERRNO."""
    return -lib.dsec_probe_seccomp()


def probe_bpf_cgroup(cgroup_dir: str) -> int:
    """Load a pass-all cgroup_skb program, attach it to `cgroup_dir` (a
    cgroup v2 dir the caller owns) and detach it again."""
    return -lib.dsec_probe_bpf_cgroup(_path("cgroup_dir", cgroup_dir))


def probe_kvm() -> dict:
    """{"api": version or None, "open"/"create_vm"/"create_vcpu": 0 or errno,
    "detail": text}; a VM and a vCPU are really created, then closed."""
    out = ffi.new("struct dsec_kvm_probe *")
    lib.dsec_probe_kvm(out)
    result = {"api": out.api if out.api >= 0 else None, "open": -out.open_err,
              "create_vm": -out.create_vm, "create_vcpu": -out.create_vcpu}
    failed = next(((k, v) for k, v in result.items() if k != "api" and v), None)
    result["detail"] = (f"{failed[0]}: {describe_errno('kvm', failed[1])}" if failed
                        else f"api {out.api}, VM and vCPU created")
    if not failed:
        # run: 0 = the one-instruction guest reached HLT; < 0 = -errno of an
        # ioctl; > 0 = it exited for another KVM_EXIT_* reason.
        result["run"] = out.run
        if out.run < 0:
            result["run_detail"] = describe_errno("kvm", -out.run)
        elif out.run > 0:
            result["run_detail"] = f"guest exited with KVM_EXIT reason {out.run}, not HLT"
    return result


def probe_openat2() -> int:
    return -lib.dsec_probe_openat2()


def probe_pidfd() -> int:
    return -lib.dsec_probe_pidfd()


def probe_clone3() -> int:
    return -lib.dsec_probe_clone3()


def probe_pidfd_group_signal() -> int:
    return -lib.dsec_probe_pidfd_group_signal()


# ---------------------------------------------------------------- dsec-init


def init_binary_path() -> str:
    """Host path of the static dsec-init this daemon speaks to: in the copy
    of its code made at start (dsecd/pinned.py), not one installed since."""
    path = pinned.libexec("dsec-init")
    if not os.access(path, os.X_OK):
        raise_error(errno.ENOENT, "find", str(path), "open_init", str(path))
    return str(path)


# ---------------------------------------------------------------- memory (csrc/madvise.c, swap.c)

MADV_WILLNEED: int = lib.MADV_WILLNEED
MADV_COLD: int = lib.MADV_COLD
MADV_PAGEOUT: int = lib.MADV_PAGEOUT
_ADVICE_NAMES = {MADV_WILLNEED: "MADV_WILLNEED", MADV_COLD: "MADV_COLD", MADV_PAGEOUT: "MADV_PAGEOUT"}

_HINTS.update({
    ("process_madvise", errno.EPERM): "process_madvise needs CAP_SYS_NICE and ptrace read "
        "access to the target",
    ("process_madvise", errno.EINVAL): "the kernel refuses this advice for another process "
        "(process_madvise takes MADV_COLD/PAGEOUT/WILLNEED/COLLAPSE, Linux >= 5.10)",
    ("process_madvise", errno.ESRCH): "the process has exited",
    ("process_populate", errno.ESRCH): "the process has exited",
    ("process_populate", errno.EPERM): "reading another process's memory needs ptrace access",
    ("swapon", errno.EBUSY): "the device is already swap, or open exclusively (mounted?)",
    ("swapon", errno.EINVAL): "no valid swap header on the device (mkswap first)",
    ("swapon", errno.EPERM): "swapon needs CAP_SYS_ADMIN, or MAX_SWAPFILES areas are on",
    ("swapoff", errno.EINVAL): "the device is not an active swap area",
    ("swapoff", errno.ENOMEM): "not enough free memory to take the swapped pages back in",
})


@dataclass(frozen=True)
class MadviseResult:
    bytes: int        # bytes the kernel took the advice for
    nr_failed: int    # ranges skipped (unmapped since /proc/<pid>/maps was read)
    first_err: int    # errno of the first skipped range, 0 if none


def _check_ranges(ranges: list[tuple[int, int]]) -> None:
    for start, length in ranges:
        if start < 0 or length <= 0 or start % PAGE_SIZE or start + length >= 2**64:
            raise ValueError(f"range ({start:#x}, {length}) is not page-aligned and positive")


def process_madvise(pidfd: int, ranges: list[tuple[int, int]], advice: int) -> MadviseResult:
    """process_madvise(2) of `advice` over (start, length) ranges of the
    process behind `pidfd`. Ranges that vanished meanwhile are skipped and
    counted; a dead process or a refused advice raises."""
    _fd("pidfd", pidfd)
    if advice not in _ADVICE_NAMES:
        raise ValueError(f"advice must be one of {sorted(_ADVICE_NAMES.values())}, got {advice!r}")
    _check_ranges(ranges)
    starts = ffi.new("uint64_t[]", [r[0] for r in ranges] or [0])
    lens = ffi.new("uint64_t[]", [r[1] for r in ranges] or [0])
    out = ffi.new("struct dsec_madvise_result *")
    rc = lib.dsec_process_madvise(pidfd, starts, lens, len(ranges), advice, out)
    if rc < 0:
        raise_error(-rc, f"process_madvise({_ADVICE_NAMES[advice]})", f"pidfd {pidfd}",
               "process_madvise")
    return MadviseResult(out.bytes, out.nr_failed, out.first_err)


def process_populate(pid: int, ranges: list[tuple[int, int]]) -> MadviseResult:
    """Fault every page of the ranges in, mapped, in process `pid` (reads one
    byte per page through process_vm_readv). `bytes` counts pages done times
    the page size; pages that fail (unmapped, PROT_NONE) are skipped."""
    _check_ranges(ranges)
    pages = [page for start, length in ranges for page in range(start, start + length, PAGE_SIZE)]
    out = ffi.new("struct dsec_madvise_result *")
    rc = lib.dsec_process_populate(pid, ffi.new("uint64_t[]", pages or [0]), len(pages), out)
    if rc < 0:
        raise_error(-rc, "populate memory of", f"pid {pid}", "process_populate")
    return MadviseResult(out.bytes * PAGE_SIZE, out.nr_failed, out.first_err)


def swapon(path: str, priority: int = -1) -> None:
    """swapon(2) of a device with a swap header; priority 0..32767, -1 = kernel default."""
    if not isinstance(priority, int) or not -1 <= priority <= 32767:
        raise ValueError(f"swap priority must be -1..32767, got {priority!r}")
    rc = lib.dsec_swapon(_path("swap device", path), priority)
    if rc < 0:
        raise_error(-rc, "swapon", path, "swapon", path)


def swapoff(path: str) -> None:
    """swapoff(2): pages every swapped page back in first, which can take seconds."""
    rc = lib.dsec_swapoff(_path("swap device", path))
    if rc < 0:
        raise_error(-rc, "swapoff", path, "swapoff", path)


# ---------------------------------------------------------------- writable layer (csrc/upperfs.c)

UPPER_FD = lib.DSEC_INIT_UPPER_FD


def upperfs_create(size_bytes: int, nr_inodes: int) -> int:
    """A detached tmpfs of at most size_bytes and nr_inodes: its O_PATH mount fd."""
    if size_bytes <= 0 or nr_inodes <= 0:
        raise ValueError(f"upper tmpfs needs a positive size and inode count, got {size_bytes}, "
                         f"{nr_inodes} (0 would mean unlimited)")
    fd = lib.dsec_upperfs_create(size_bytes, nr_inodes)
    if fd < 0:
        raise_error(-fd, "create", f"upper tmpfs of {size_bytes} bytes, {nr_inodes} inodes", "upperfs",
               None, "the kernel lacks the new mount API (fsopen, Linux >= 5.2)"
               if -fd == errno.ENOSYS else None)
    return fd


def upperfs_attach(fd: int, target: str) -> None:
    """Mount a clone of the upper tmpfs `fd` on the host directory `target`."""
    rc = lib.dsec_upperfs_attach(fd, _path("target", target))
    if rc < 0:
        raise_error(-rc, "attach", f"upper tmpfs fd {fd} on {target}", "upperfs", target)


def probe_upperfs(lowerdir: str) -> int:
    """0 if overlayfs accepts a detached tmpfs as upper (Linux >= 6.15), else the errno."""
    return -lib.dsec_probe_upperfs(_path("lowerdir", lowerdir, ",:\\"))


def probe_project_quota(directory: str) -> int:
    """0 if project quotas are on for the file system holding `directory`, else the errno."""
    return -lib.dsec_probe_project_quota(_path("directory", directory))


# ---------------------------------------------------------------- host mounts (csrc/mount.c)

MNT_DETACH = lib.MNT_DETACH


def mount_erofs(file: str, target: str) -> None:
    """Mount the EROFS image `file` read-only on `target` (file-backed, Linux >= 6.12)."""
    rc = lib.dsec_mount_erofs(_path("file", file), _path("target", target))
    if rc < 0:
        raise_error(-rc, "mount erofs", f"{file} on {target}", "mount_erofs", target,
               "EINVAL/ENOTBLK here usually means the kernel lacks file-backed EROFS (Linux >= 6.12)"
               if -rc in (errno.EINVAL, errno.ENOTBLK) else None)


class TarErofsError(Exception):
    """What dsec_tarfs_* refused or failed at: `errno` EINVAL for bad tar
    content, EOPNOTSUPP for a layer the writer leaves to unpack-and-mkfs,
    another errno for I/O on the image; the message says what and where."""

    def __init__(self, err: int, message: str):
        super().__init__(message)
        self.errno = err


class TarErofs:
    """An EROFS image written from a tar stream (csrc/tarerofs.c): feed()
    the uncompressed tar in chunks, then finish() writes the metadata and
    the superblock. Owner of the root, of directories the tar implies and of
    whiteouts: owner_uid/gid; modes as given (the caller applies its umask).
    A tar of more than max_entries members is refused (EINVAL): every name
    is kept in memory until finish()."""

    def __init__(self, fd: int, root_mode: int, implicit_dir_mode: int, owner_uid: int, owner_gid: int,
                 max_entries: int):
        self._w = lib.dsec_tarfs_new(fd, root_mode, implicit_dir_mode, owner_uid, owner_gid, max_entries)
        if self._w == ffi.NULL:
            raise MemoryError("tarerofs: out of memory for a new image writer")

    def _check(self, rc: int) -> int:
        if rc < 0:
            raise TarErofsError(-rc, ffi.string(lib.dsec_tarfs_error(self._w)).decode(errors="replace"))
        return rc

    def feed(self, data: bytes) -> bool:
        """Whether the archive's end came (the rest is padding, not looked at)."""
        return self._check(lib.dsec_tarfs_feed(self._w, data, len(data))) == 1

    def final_bytes(self) -> int:
        """The image offset below which every byte but block 0's is final
        (written and never written again) while the tar is fed."""
        return lib.dsec_tarfs_final_bytes(self._w)

    def finish(self) -> int:
        """Write the metadata; the number of tar members."""
        self._check(lib.dsec_tarfs_finish(self._w))
        return lib.dsec_tarfs_entries(self._w)

    def close(self) -> None:
        if self._w is not None:
            lib.dsec_tarfs_free(self._w)
            self._w = None


def umount(target: str, detach: bool = False) -> None:
    rc = lib.dsec_umount(_path("target", target), MNT_DETACH if detach else 0)
    if rc < 0:
        raise_error(-rc, "umount", target, "umount", target)
