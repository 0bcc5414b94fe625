"""Kernel feature probe, run once at daemon start into a frozen `Features`.

Each probe uses the real mechanism (a syscall, a mount type, a sysfs file)
and records what it found and why; call sites branch on the result and
`dsec info` prints it. A missing optional feature is logged as a visible
degradation; a missing required one (namespaces, overlayfs, pidfd, openat2)
stops the daemon with a clear error.
"""

from __future__ import annotations

import errno
import logging
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import cgroup, native, userns
from .feature import Feature

log = logging.getLogger(__name__)

REQUIRED = ("namespaces", "overlayfs", "pidfd", "openat2")


@dataclass(frozen=True)
class Features:
    kernel: str
    cgroup_mode: str
    cgroup_controllers: dict[str, str]          # controller -> "v1" | "v2"
    items: dict[str, Feature] = field(default_factory=dict)
    landlock_abi: int = 0                       # the Landlock ABI version; 0: none (task policies)

    def has(self, name: str) -> bool:
        f = self.items.get(name)
        return bool(f and f.available)

    def missing_required(self) -> list[str]:
        return [n for n in REQUIRED if not self.has(n)]

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "cgroup_mode": self.cgroup_mode,
                "cgroup_controllers": self.cgroup_controllers,
                "features": {k: asdict(v) for k, v in self.items.items()}}


def _filesystems() -> set[str]:
    try:
        return {line.split()[-1] for line in Path("/proc/filesystems").read_text().splitlines() if line}
    except OSError:
        return set()


def _errno_feature(rc: int, ok: str, what: str, hints: dict[int, str] | None = None) -> Feature:
    if rc == 0:
        return Feature(True, ok)
    name = errno.errorcode.get(abs(rc), str(rc))
    hint = (hints or {}).get(abs(rc))
    return Feature(False, f"{what}: {name} ({os.strerror(abs(rc))})" + (f"; {hint}" if hint else ""))


# What the errnos of prctl(PR_SCHED_CORE) mean (they are misleading on their own).
SCHED_CORE_HINTS = {
    errno.EINVAL: "the kernel lacks core scheduling (needs CONFIG_SCHED_CORE=y, Linux >= 5.14)",
    errno.ENODEV: "core scheduling is built in but this CPU has no SMT siblings",
    errno.EPERM: "not allowed to set core-scheduling cookies (needs CAP_SYS_ADMIN or ptrace access)",
}


def probe_namespaces() -> Feature:
    missing = [ns for ns in ("mnt", "pid", "uts", "ipc", "net", "cgroup", "user")
               if not os.path.exists(f"/proc/self/ns/{ns}")]
    return Feature(not missing, "all of mnt pid uts ipc net cgroup user" if not missing
                   else f"missing: {' '.join(missing)}")


def probe_erofs(fs: set[str]) -> Feature:
    if "erofs" not in fs:
        return Feature(False, "erofs not in /proc/filesystems")
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    # File-backed mounts (mount -t erofs /path/to/file) arrived in Linux 6.12.
    if (major, minor) < (6, 12):
        return Feature(False, "erofs present but kernel < 6.12 has no file-backed mounts")
    return Feature(True, "erofs registered; kernel >= 6.12 mounts image files directly")


def probe_damon(root: str = "/sys/kernel/mm/damon/admin") -> Feature:
    kd = Path(root) / "kdamonds"
    if not kd.is_dir():
        return Feature(False, f"{root} absent (no DAMON sysfs)")
    try:
        n = int((kd / "nr_kdamonds").read_text())
    except (OSError, ValueError) as err:
        return Feature(False, f"read nr_kdamonds: {err}")
    running = []
    for i in range(n):
        try:
            if (kd / str(i) / "state").read_text().strip() == "on":
                running.append(i)
        except OSError:
            continue
    if running:
        return Feature(False, f"busy: kdamond(s) {running} run and are not ours; "
                       "dsecd never writes under a kdamond it did not create")
    return Feature(True, f"free ({n} idle kdamond dirs)")


def probe_swap() -> Feature:
    try:
        lines = Path("/proc/swaps").read_text().splitlines()[1:]
    except OSError:
        return Feature(False, "/proc/swaps unreadable")
    return Feature(bool(lines), f"{len(lines)} swap device(s) on" if lines else "no swap on")


def probe_kvm() -> Feature:
    r = native.probe_kvm()
    if r.get("api") is None:
        return Feature(False, f"/dev/kvm: {r.get('detail', 'unavailable')}")
    ok = r.get("create_vm") == 0 and r.get("create_vcpu") == 0
    if not ok:
        return Feature(False, r.get("detail", "KVM_CREATE_VM/VCPU failed"))
    if r.get("run") != 0:
        return Feature(False, f"{r['detail']}, but KVM_RUN of a one-instruction guest failed: "
                       f"{r.get('run_detail', 'unknown')}")
    return Feature(True, f"{r['detail']}; a one-instruction real-mode guest ran to HLT")


@dataclass(frozen=True)
class MicroVMFeature(Feature):
    """The microVM backend: whether it can run here, and under which accelerator."""

    accel: str = ""          # "kvm" | "tcg" | "" (unavailable)
    qemu: str = ""
    guest_kernel: str = ""
    own_root: Feature = Feature(False, "not probed")   # each QEMU in its own mount namespace (vmroot.py)


def probe_microvm(kvm: Feature, qemu: str, guest_dir: str) -> tuple[Feature, MicroVMFeature]:
    """(kvm, microvm). KVM is said available only when a real guest kernel
    boots under it (dsecd/backends/microvm/accel.py); else microVMs use TCG."""
    import shutil

    from .backends.microvm import accel, guestimg, vmroot

    path = shutil.which(qemu)
    try:
        guest = guestimg.load(Path(guest_dir))
    except guestimg.GuestImageError as err:
        guest = None
        why = str(err)
    if kvm.available:
        if guest is None or path is None:
            kvm = Feature(False, f"{kvm.detail}; a real guest boot was not probed ("
                          f"{'no ' + qemu if path is None else why}), so KVM is not counted on")
        else:
            ok, detail = accel.boot_probe(path, guest, Path(guest_dir))
            kvm = Feature(ok, f"{kvm.detail}; {detail}")
    if path is None:
        return kvm, MicroVMFeature(False, f"{qemu} not found (apt-get install qemu-system-x86; scripts/setup.sh)")
    if guest is None:
        return kvm, MicroVMFeature(False, why, qemu=path)
    mode = "kvm" if kvm.available else "tcg"
    reason = ("KVM boots a real guest" if kvm.available else f"KVM unusable ({kvm.detail}): QEMU's TCG emulator")
    return kvm, MicroVMFeature(True, f"accel {mode}: {reason}", accel=mode, qemu=path,
                               guest_kernel=guest.version, own_root=vmroot.probe(path, guest))


def probe_nft_nat() -> Feature:
    """A real masquerade rule loads through libnftables, in a throwaway netns (the
    host's ruleset is never touched). net.uplink and published ports need it."""
    from .net import nat

    try:
        fd = native.netns_create()
    except OSError as err:
        return Feature(False, f"create a scratch netns: {err}")
    try:
        nat.probe(f"/proc/self/fd/{fd}")
    except OSError as err:
        return Feature(False, str(err))
    finally:
        os.close(fd)
    return Feature(True, "nftables (libnftables JSON) loads a masquerade rule")


def probe_bpf_cgroup(layout: cgroup.Layout, scratch_rel: str) -> Feature:
    if layout.v2 is None:
        return Feature(False, "no cgroup v2 hierarchy to attach to")
    d = layout.v2 / scratch_rel
    try:
        os.makedirs(d, exist_ok=True)
        rc = native.probe_bpf_cgroup(str(d))
    finally:
        try:
            os.rmdir(d)
        except OSError:
            pass
    return _errno_feature(rc, f"cgroup_skb program loaded and attached under {layout.v2}", "bpf attach")


# What the errnos of the writable-layer probes mean.
UPPERFS_HINTS = {
    errno.EINVAL: "overlayfs refuses an upper dir on a detached mount before Linux 6.15",
    errno.ENOSYS: "no new mount API (fsopen/fsmount, Linux >= 5.2)",
}
PROJECT_QUOTA_HINTS = {
    errno.ENOSYS: "the kernel is built without CONFIG_QUOTA/CONFIG_QUOTACTL",
    errno.ESRCH: "project quotas are not on for this file system (a kernel with CONFIG_QUOTA and a prjquota mount are both needed)",
    errno.ENOTTY: "this file system has no quota support",
}


def probe_upperfs() -> Feature:
    """A size-capped writable layer: overlayfs over a detached tmpfs (csrc/upperfs.c)."""
    import tempfile

    lower = tempfile.mkdtemp(prefix="dsecd-upperfs-probe-")
    try:
        rc = native.probe_upperfs(lower)
    finally:
        os.rmdir(lower)
    return _errno_feature(rc, "overlay upper on a detached size-capped tmpfs works",
                          "overlay over a detached tmpfs", UPPERFS_HINTS)


def probe_project_quota(state_dir: str | None) -> Feature:
    """Reported only (dsecd caps the writable layer with upperfs): could project
    quotas on the state dir's file system do it instead?"""
    if state_dir is None:
        return Feature(False, "not probed (no state dir given)")
    os.makedirs(state_dir, exist_ok=True)
    return _errno_feature(native.probe_project_quota(state_dir), f"project quotas on for {state_dir}",
                          f"quotactl_fd(Q_GETINFO, PRJQUOTA) on {state_dir}", PROJECT_QUOTA_HINTS)


def suid_dumpable_hazard(path: str = "/proc/sys/fs/suid_dumpable") -> str | None:
    """Why this host is unsafe for dsecd's spawns, or None.

    A spawn child shares the memory of its parent (the daemon's exec helper,
    dsec-init's vfork) until it execs. When it changes its uid, the kernel
    makes that shared memory dumpable again as fs.suid_dumpable says: with 1,
    a sandbox process of the new uid could open /proc/<child>/mem, i.e. the
    daemon's (host root) or init's memory. 0 and 2 are safe."""
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:
        return None
    if value == "1":
        return (f"{path} is 1: a sandbox process could read and write the daemon's memory through a spawn "
                "child that changes uid; set it to 0 (or 2): sysctl -w fs.suid_dumpable=0")
    return None


def probe_all(cgroup_root: str = "dsecd", state_dir: str | None = None,
              microvm: dict | None = None) -> Features:
    """microvm: the [microvm] config (qemu, guest_dir); None: not probed."""
    layout = cgroup.detect_layout()
    fs = _filesystems()
    items: dict[str, Feature] = {
        "namespaces": probe_namespaces(),
        "overlayfs": Feature("overlay" in fs, "overlay in /proc/filesystems" if "overlay" in fs else "absent"),
        "erofs_file_backed": probe_erofs(fs),
        "fuse": Feature("fuse" in fs and os.path.exists("/dev/fuse"),
                        "fuse registered, /dev/fuse present" if "fuse" in fs else "fuse absent"),
        "pidfd": _errno_feature(native.probe_pidfd(), "pidfd_open works", "pidfd_open"),
        "openat2": _errno_feature(native.probe_openat2(), "openat2 RESOLVE_IN_ROOT works", "openat2"),
        "clone3": _errno_feature(native.probe_clone3(), "clone3 present", "clone3"),
        # dsec-init forks execs only where their group can be killed by pidfd (dsecd/initlink.py)
        "pidfd_group_signal": _errno_feature(native.probe_pidfd_group_signal(),
                                             "pidfd_send_signal(PIDFD_SIGNAL_PROCESS_GROUP) works",
                                             "pidfd_send_signal(PIDFD_SIGNAL_PROCESS_GROUP)",
                                             {errno.EINVAL: "Linux < 6.9: execs use the daemon's helper"}),
        "seccomp": _errno_feature(native.probe_seccomp(), "seccomp filters available", "seccomp"),
        "sched_core": _errno_feature(native.probe_sched_core(), "PR_SCHED_CORE works", "prctl(PR_SCHED_CORE)",
                                     SCHED_CORE_HINTS),
        "damon": probe_damon(),
        "bpf_cgroup": probe_bpf_cgroup(layout, f"{cgroup_root}-probe-{os.getpid()}"),
        "nft_nat": probe_nft_nat(),
        "kvm": probe_kvm(),
        "swap": probe_swap(),
        "upperfs": probe_upperfs(),
        "project_quota": probe_project_quota(state_dir),
    }
    if microvm is not None and microvm.get("enabled", True):
        items["kvm"], items["microvm"] = probe_microvm(items["kvm"], microvm["qemu"], microvm["guest_dir"])
    else:
        items["microvm"] = MicroVMFeature(False, "microvm.enabled is false")
    items["idmapped_mounts"] = userns.probe_idmap("/")
    abi = native.probe_landlock_abi()
    items["landlock"] = Feature(abi > 0, f"ABI v{abi}" if abi > 0 else
                                f"landlock_create_ruleset: {errno.errorcode.get(-abi, abi)}")
    ctrls = {c: v for c in cgroup.CONTROLLERS if (w := layout.controller_dir(c)) for v in (w[0],)}
    feats = Features(kernel=platform.release(), cgroup_mode=layout.mode, cgroup_controllers=ctrls, items=items,
                     landlock_abi=max(abi, 0))
    for name, f in items.items():
        if not f.available:
            log.info("feature %s unavailable: %s", name, f.detail)
    return feats
