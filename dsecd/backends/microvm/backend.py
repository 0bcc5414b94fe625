"""MicroVM backend: one QEMU guest per sandbox, its PID 1 the guest agent.

A sandbox is one QEMU process (q35 machine, direct kernel boot of the cloud
kernel and the generated initramfs, guestimg.py) with:
  - the image's EROFS layer blobs, the very files of the store that the
    container backend mounts, as read-only virtio-pmem devices (the guest
    mounts them with DAX: it reads the host's page cache of each blob, so
    every VM and container on the host shares one copy), layer i at PCI slot
    PMEM_SLOT0 + i, the order the agent mounts them in (bottom first);
  - a virtio-serial port "dsec.agent" for the agent's channel (agent.py),
    served by QEMU as a unix socket in the VM's directory;
  - a QMP monitor socket (qmp.py) for stop/cont, migration and the balloon;
  - virtio-balloon with free-page reporting (memory the guest frees goes back
    to the host) and deflate-on-oom (a guest short of memory takes pages
    back from its balloon before its OOM killer runs: the idle policy,
    engine/vmballoon.py, may have made it small);
  - the serial console in <vm dir>/serial.log, QEMU's stderr in qemu.log.

QEMU runs inside the sandbox's own cgroups (joined before exec by a tiny
shell step, so every page it ever touches is charged there; memory.max is
the guest's RAM plus MEMORY_OVERHEAD), in a mount namespace of its own whose
root holds only what it needs (vmroot.py; entered by nsenter, where the host
can make one: `dsec info`, feature microvm_root), as an unprivileged uid
(setpriv, no_new_privs, no capabilities), under QEMU's own seccomp filter
(`-sandbox on`, with spawning, privilege raising and obsolete syscalls
denied), with `-nodefaults -nographic`.

The blocking parts (directories, cgroups, spawning and killing QEMU) run in
worker threads; the channel and the monitor (`connect`) are asyncio.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ... import cgroup, execio, fds, native
from ...feature import Feature
from ...steps import Steps
from ..container import proc_start_time
from . import vmroot
from .agent import AgentLink, ChardevTransport
from .guestimg import GuestImage
from .qmp import QMP
from .vmroot import VmRoots

log = logging.getLogger(__name__)

# A paused VM's state (RAM and devices) in its dir: written as SAVED_STATE +
# ".part" and renamed when whole, so that one that exists is complete; renamed
# to SAVED_STATE + ".loaded" once a resume has loaded it and runs the VM.
SAVED_STATE = "paused.ram"

# query-migrate states of a migration (a save) still under way.
MIGRATING = ("setup", "active", "pre-switchover", "device", "wait-unplug", "cancelling")

PMEM_SLOT0 = 0x10          # PCI slot of the bottom layer; layer i at PMEM_SLOT0 + i
NIC_MAC = "52:54:00:00:00:01"   # every VM's NIC until its agent sets the VM's own; the tap drops frames from it
# A template's NIC: a hub port with no other port (a dead end). The template
# never sends; its restores get a tap (devices match, backends need not).
TEMPLATE_NETDEV = "hubport,id=net0,hubid=0"
# Up to slot 0x1e: q35 has its ICH9 LPC bridge (and SATA, SMBus) at 0x1f.
MAX_LAYERS = 0x1F - PMEM_SLOT0
MIN_GUEST_MEMORY = 128 << 20   # the cloud kernel and the agent boot in less, barely


# What of a guest's RAM its files can never have: what its kernel keeps
# from the start (outside MemTotal: its image, the page structs, reserved
# ranges; ~34 MiB of a 128M guest and of a 256M one) and what the kernel
# and the agent use once booted (~22 MiB). MemAvailable after a boot: 70 MiB
# of a 128M guest, 196 MiB of a 256M one.
GUEST_FIXED = 64 << 20


def guest_room(guest_memory: int) -> int:
    """What a guest of `guest_memory` bytes of RAM has for its files and
    processes (MIN_GUEST_MEMORY keeps it positive)."""
    return guest_memory - GUEST_FIXED


def upper_cap(guest_memory: int) -> int:
    """The most a VM's writable layer may hold, whatever its `disk`: half
    its room (guest_room). The layer is a tmpfs in guest RAM, and no swap
    or OOM kill frees a tmpfs page: a layer let grow to the RAM (a 300 MiB
    `dsec cp` into a 256M guest, written by the agent) leaves the guest's
    kernel nothing to reclaim or kill, and it panics ("System is deadlocked
    on memory"). Half of the RAM itself was not enough: the layer, /tmp and
    /dev/shm filled to their caps by the guest's own commands left a 256M
    guest 4 MiB, and it panicked so."""
    return guest_room(guest_memory) // 2


def upper_inodes(guest_memory: int, configured: int) -> int:
    """The inodes a VM's writable layer may hold: sandbox.disk_inodes, and
    at most one for every two pages of its room (guest_room). Each costs the
    guest's kernel about 1 KiB that the layer's size cap does not count (a
    tmpfs inode and its dentry, neither reclaimable): so they take at most
    an eighth of the room, as the kernel's own default (half the RAM's
    pages) would of its RAM."""
    return max(1, min(configured, guest_room(guest_memory) // 8192))


def tmp_cap(guest_memory: int) -> int:
    """The most a VM's /tmp, and its /dev/shm, (tmpfs each) may hold,
    whatever sandbox.tmp_size and shm_size: an eighth of its room each, so
    that they and the writable layer (upper_cap) together leave its kernel
    and processes a quarter of it (the reason upper_cap gives)."""
    return guest_room(guest_memory) // 8


# QEMU's own processes run in the sandbox's cgroup too: TCG's translation
# cache (tb-size), device models, its heap and the page tables of guest RAM.
QEMU_PIDS = 256            # QEMU's threads (vCPUs, I/O, RCU, worker pools) count in pids.max
# Guest kernel arguments. swiotlb=noforce: no bounce buffers (no DMA limits
# here), saving 64 MiB of guest RAM; tsc_early_khz: TCG's TSC needs no
# calibration loop at boot; panic=-1 with -no-reboot: a dead agent ends QEMU.
KERNEL_ARGS = "console=ttyS0 swiotlb=noforce tsc_early_khz=2000000 panic=-1 quiet loglevel=4"


NOT_PROBED = Feature(False, "not probed: QEMU runs in the host's mount namespace")


class VmError(OSError):
    """A VM could not be made or run; the message says what and where to look."""


@dataclass(frozen=True)
class Machine:
    """What of a VM's QEMU command line its shape does not say: where its RAM
    lives and whether its balloon reports free pages. A saved state loads
    only into a QEMU of the same devices, so a sandbox's Machine is journaled
    (Sandbox.vm) and its resume starts QEMU with it.

    ram:  "anon"     memory-backend-ram (a booted VM; a resumed one)
          "shared"   a template's memfd, mapped shared: the template's build
          "private"  a template's sealed memfd, mapped private (copy on
                     write): a VM restored from the template
          "legacy"   plain -m (VMs started before RAM had an explicit backend)
    reporting: free-page reporting (off for templates and their restores:
          templates.py says why).
    net: a virtio-net NIC. Its MAC on the command line is the same for every
          VM (NIC_MAC: a template's restores share its device state anyway);
          the agent gives the NIC the VM's own (wire.NET)."""

    ram: str = "anon"
    reporting: bool = True
    net: bool = False          # a virtio-net NIC (--net default): on a tap, or a template's dead-end hub port

    def to_record(self) -> dict:
        return {"ram": self.ram, "reporting": self.reporting, "net": self.net}

    @classmethod
    def from_record(cls, rec: dict | None) -> Machine:
        if not rec:
            return cls(ram="legacy")
        return cls(ram=rec.get("ram", "legacy"), reporting=bool(rec.get("reporting", True)),
                   net=bool(rec.get("net", False)))

    def resumed(self) -> Machine:
        """The machine a resume starts: the saved state has all the RAM, so it
        goes to anonymous memory (a template's mapping is not needed again)."""
        return self if self.ram == "legacy" else Machine(ram="anon", reporting=self.reporting, net=self.net)


@dataclass
class VmHandle:
    """A live VM: the QEMU process and the two channels to it. The fields a
    container Handle has that the engine reads generically (init_pid,
    init_start, pidfd, group) mean the same here, for the QEMU process; the
    container-only ones are neutral."""

    init_pid: int                  # QEMU's pid
    init_start: int
    pidfd: int
    group: cgroup.Group
    vm_dir: Path
    is_child: bool
    accel: str
    popen: subprocess.Popen | None = None
    qmp: QMP | None = None
    agent: AgentLink | None = None
    guest_memory: int = 0
    # What the container Handle has and a VM does not (files go through the agent).
    dir: Path | None = None
    rootfd: int = -1
    upperfd: int = -1
    init_link: None = None
    sched_idle: bool = False
    core_sched: bool = False
    userns: bool = False
    paused_image: Path | None = None    # the RAM image of a paused VM (pause.py)
    machine: Machine = field(default_factory=Machine)
    template: str | None = None         # the key of the template it was restored from
    extra: dict = field(default_factory=dict)
    # Held while the pidfd is used or closed: a destroy and a pause's end
    # of QEMU run in two worker threads, and a pidfd one of them closed
    # whose number an open elsewhere took meanwhile would send the other's
    # SIGKILL to an unrelated process (another sandbox's).
    pidfd_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def kill(self) -> None:
        """SIGKILL QEMU through its pidfd; nothing once the pidfd is closed."""
        with self.pidfd_lock:
            if self.pidfd >= 0:
                native.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close_pidfd(self) -> None:
        """Close the pidfd (safe to repeat, from any thread)."""
        with self.pidfd_lock:
            fd, self.pidfd = self.pidfd, -1
        fds.close_quietly(fd)

    def exited(self, timeout: float) -> bool:
        """Blocking: wait up to `timeout` s for QEMU to exit, on a copy of
        its pidfd (the pidfd may be closed meanwhile); True if it has no
        pidfd any more."""
        with self.pidfd_lock:
            fd = os.dup(self.pidfd) if self.pidfd >= 0 else -1
        if fd < 0:
            return True
        try:
            return _exited(fd, timeout)
        finally:
            os.close(fd)


class QemuFiles:
    """What QEMU opens, as it names it (`refs`), and the fds Popen passes
    it (`fds`; closed here on exit: QEMU has its copies).

    With `roots` (its own mount namespace, vmroot.py): the VM's dir, guest
    and layers are binds at fixed paths of its root, and `ns` is the fd of
    that namespace, which the spawn enters. Without: each is opened here (as
    root) and named /proc/self/fd/N, a link the kernel follows without the
    directories' permissions (QEMU's uid cannot traverse the state dir, 0700,
    to its VM dir or the blob store); the files themselves are readable by it
    (blobs 0444, the kernel and initramfs 0644, its own dir).
    Either way a template's RAM memfd and a NIC's tap are fds."""

    def __init__(self, vm_dir: Path, layers: list[Path], guest: GuestImage, ram_fd: int = -1, tap_fd: int = -1,
                 roots: VmRoots | None = None):
        self.vm_dir, self.layers, self.guest, self.ram_fd, self.tap_fd = vm_dir, layers, guest, ram_fd, tap_fd
        self.roots = roots
        self.fds: list[int] = []
        self.refs: dict = {"name": vm_dir.name}
        self.ns = -1

    def _open(self, path, flags: int) -> str:
        fd = os.open(path, flags | os.O_CLOEXEC)
        self.fds.append(fd)
        return f"/proc/self/fd/{fd}"

    def __enter__(self) -> QemuFiles:
        try:
            if self.roots is not None:
                self.ns = self.roots.make(self.vm_dir, self.layers, self.guest)
                self.fds.append(self.ns)
                self.refs.update(vmroot.refs(len(self.layers)))
            else:
                self.refs["dir"] = self._open(self.vm_dir, os.O_PATH | os.O_DIRECTORY)
                self.refs["kernel"] = self._open(self.guest.kernel, os.O_RDONLY)
                self.refs["initramfs"] = self._open(self.guest.initramfs, os.O_RDONLY)
                self.refs["layers"] = [self._open(p, os.O_RDONLY) for p in self.layers]
            if self.ram_fd >= 0:       # a template's memfd: a copy, so a template dropped meanwhile is no matter
                fd = os.dup(self.ram_fd)
                self.fds.append(fd)
                self.refs["ram"] = f"/proc/self/fd/{fd}"
            if self.tap_fd >= 0:       # QEMU reads and writes the tap's frames through it
                fd = os.dup(self.tap_fd)
                self.fds.append(fd)
                self.refs["netdev"] = f"tap,id=net0,fd={fd}"
            else:
                self.refs["netdev"] = TEMPLATE_NETDEV
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def aligned_size(path: Path) -> int:
    """The pmem size of a layer blob: its own size, which must be a multiple of
    2 MiB (dsecd/fs/erofs.py pads every layer it builds)."""
    size = path.stat().st_size
    if size % (2 << 20):
        raise VmError(errno.EINVAL, f"layer blob {path} is {size} bytes, not a multiple of 2 MiB: it was built "
                      "before microVM support padded layers; rebuild the image (dsec image build) to use it "
                      "with --backend microvm")
    return size


class MicroVMBackend:
    name = "microvm"

    def __init__(self, layout: cgroup.Layout, cfg: dict, sandbox_cfg: dict, state_dir: Path, guest: GuestImage,
                 accel: str, memory_overhead: int, tmp_size: int, own_root: Feature = NOT_PROBED,
                 shm_size: int = 64 << 20):
        """own_root: whether each QEMU runs in a mount namespace of its own
        (vmroot.py): the probe's answer (features.probe_microvm)."""
        self.layout = layout
        self.cfg = cfg
        self.cgroup_root = sandbox_cfg["cgroup_root"]
        self.destroy_timeout = float(sandbox_cfg["destroy_timeout_s"])
        self.disk_inodes = int(sandbox_cfg["disk_inodes"])
        self.root = Path(state_dir) / "vms"
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)       # QEMU's uid reaches its own dir, lists none
        self.guest = guest
        self.accel = accel
        self.memory_overhead = memory_overhead
        self.tmp_size = tmp_size
        self.shm_size = shm_size
        self.qemu = shutil.which(cfg["qemu"]) or cfg["qemu"]
        # Every VM's namespace mounts its root's tmpfs here (in itself only): an empty dir.
        self.own_root = own_root
        self.roots = VmRoots(self.root / ".root", self.qemu, kvm=accel == "kvm") if own_root.available else None
        self.nsenter = shutil.which("nsenter") or "nsenter"

    def group_for(self, sb_id: str) -> cgroup.Group:
        return cgroup.Group(self.layout, f"{self.cgroup_root}/{sb_id}")

    # ------------------------------------------------------------ create

    def vcpus(self, cpu: float) -> int:
        return max(1, min(math.ceil(cpu), os.cpu_count() or 1, int(self.cfg["max_vcpus"])))

    def qemu_argv(self, refs: dict, layers: list[Path], guest_memory: int, vcpus: int, disk: int,
                  incoming: bool = False, machine: Machine = Machine()) -> list[str]:
        """refs: the paths QEMU opens, as it sees them (QemuFiles.refs)."""
        mib = guest_memory >> 20
        vm_dir = refs["dir"]
        pmem = [(ref, aligned_size(p)) for ref, p in zip(refs["layers"], layers, strict=True)]
        maxmem = mib + sum(s >> 20 for _, s in pmem) + 1024
        accel = (f"tcg,tb-size={int(self.cfg['tcg_tb_size_mib'])}" if self.accel == "tcg" else "kvm")
        if machine.ram == "legacy":
            ram = []
            machine_opt = "q35"
        else:
            # The RAM block's name ("ram0") is the same for every kind, so a
            # state saved from one loads into another (a restored VM's pause
            # resumes into anonymous memory).
            if machine.ram == "anon":
                obj = f"memory-backend-ram,id=ram0,size={mib}M"
            elif machine.ram in ("shared", "private"):
                share = "on" if machine.ram == "shared" else "off"
                obj = f"memory-backend-file,id=ram0,size={mib}M,mem-path={refs['ram']},share={share}"
            else:
                raise ValueError(f"unknown guest RAM kind {machine.ram!r}")
            ram = ["-object", obj]
            machine_opt = "q35,memory-backend=ram0"
        reporting = "on" if machine.reporting else "off"
        argv = [self.qemu, "-nodefaults", "-nographic", "-no-user-config", "-no-reboot",
                "-name", f"dsec-{refs['name']},debug-threads=on",
                "-machine", machine_opt, "-accel", accel, "-cpu", "max" if self.accel == "tcg" else "host",
                "-smp", str(vcpus), "-m", f"{mib}M,slots=4,maxmem={maxmem}M", *ram,
                "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
                "-kernel", refs["kernel"], "-initrd", refs["initramfs"],
                "-append", f"{KERNEL_ARGS} dsec.layers={len(layers)} "
                f"dsec.disk={min(disk, upper_cap(guest_memory))} "
                f"dsec.inodes={upper_inodes(guest_memory, self.disk_inodes)} "
                f"dsec.tmp={min(self.tmp_size, tmp_cap(guest_memory))} "
                f"dsec.shm={min(self.shm_size, tmp_cap(guest_memory))}",
                "-serial", f"file:{vm_dir}/serial.log",
                "-qmp", f"unix:{vm_dir}/qmp.sock,server=on,wait=off",
                "-device", "virtio-serial-pci,id=vs0",
                "-chardev", f"socket,id=agent,path={vm_dir}/agent.sock,server=on,wait=off",
                "-device", "virtserialport,chardev=agent,name=dsec.agent",
                "-device", f"virtio-balloon-pci,id=balloon0,free-page-reporting={reporting},deflate-on-oom=on"]
        if machine.net:
            argv += ["-netdev", refs["netdev"], "-device", f"virtio-net-pci,netdev=net0,id=nic0,mac={NIC_MAC}"]
        for i, (path, size) in enumerate(pmem):
            argv += ["-object", f"memory-backend-file,id=layer{i},share=on,readonly=on,mem-path={path},size={size}",
                     "-device", f"virtio-pmem-pci,memdev=layer{i},id=pmem{i},addr={PMEM_SLOT0 + i:#x}.0"]
        if incoming:
            argv += ["-incoming", "defer"]
        return argv

    def template_argv(self, layers: list[Path], guest_memory: int, cpu: float, disk: int,
                      net: bool = False) -> list[str]:
        """The command line a template of this shape is built with, its
        per-VM paths as placeholders: what a template key hashes
        (templates.key_of). Whatever changes it (a device, a kernel argument,
        the guest's RAM or vCPUs, the writable layer's size) makes a new key."""
        refs = {"name": "@name", "dir": "@dir", "kernel": "@kernel", "initramfs": "@initramfs",
                "layers": [f"@layer{i}" for i in range(len(layers))], "ram": "@ram", "netdev": "@netdev"}
        return self.qemu_argv(refs, layers, guest_memory, self.vcpus(cpu), disk, incoming=True,
                              machine=Machine(ram="shared", reporting=False, net=net))

    def create(self, sb_id: str, layers: list[Path], limits: cgroup.Limits, disk: int, uid: int,
               incoming: bool = False, machine: Machine = Machine(), ram_fd: int = -1,
               tap_fd: int = -1) -> VmHandle:
        """Start QEMU for sandbox `sb_id` (blocking): its dir, cgroups, the
        process. The guest then boots on its own; `connect` waits for it.
        incoming: QEMU waits for a migration stream (a template's restore).
        ram_fd: the template memfd a "shared" or "private" machine maps.
        tap_fd: the tap of a machine with a NIC (none: a template's hub port)."""
        if not 1 <= len(layers) <= MAX_LAYERS:
            raise VmError(errno.E2BIG, f"an image of {len(layers)} layers cannot boot as a microVM: "
                          f"1 to {MAX_LAYERS} layers (one virtio-pmem device each); flatten it first")
        guest_memory = limits.memory_bytes
        group = self.group_for(sb_id)
        vm_dir = self.root / sb_id
        with Steps(f"create microVM {sb_id}") as steps:
            os.mkdir(vm_dir, 0o700)
            steps.undo("remove the VM dir", lambda: shutil.rmtree(vm_dir, ignore_errors=True))
            os.chown(vm_dir, uid, uid)
            group.create()
            steps.undo("remove cgroups", lambda: group.remove(self.destroy_timeout))
            group.set_limits(cgroup.Limits(cpu=limits.cpu, memory_bytes=guest_memory + self.memory_overhead,
                                           pids=QEMU_PIDS, cpu_hard_quota=limits.cpu_hard_quota,
                                           cpu_period_us=limits.cpu_period_us, swap_bytes=limits.swap_bytes))
            with QemuFiles(vm_dir, layers, self.guest, ram_fd, tap_fd, self.roots) as files:
                argv = self.qemu_argv(files.refs, layers, guest_memory, self.vcpus(limits.cpu), disk, incoming,
                                      machine)
                popen = self._spawn(argv, group, vm_dir, uid, files)
            steps.undo("kill QEMU", lambda: _kill_wait(popen))
            start = proc_start_time(popen.pid)
            if start is None:
                raise VmError(errno.ESRCH, f"QEMU for {sb_id} exited at once: {_tail(vm_dir / 'qemu.log')}")
            pidfd = fds.park(native.pidfd_open(popen.pid))
            steps.commit()
        return VmHandle(init_pid=popen.pid, init_start=start, pidfd=pidfd, group=group, vm_dir=vm_dir,
                        is_child=True, accel=self.accel, popen=popen, guest_memory=guest_memory, machine=machine)

    def _spawn(self, argv: list[str], group: cgroup.Group, vm_dir: Path, uid: int,
               files: QemuFiles) -> subprocess.Popen:
        """QEMU in `group` from its first instruction, as `uid`: a shell joins
        the cgroups (as root: cgroup.procs is root's), nsenter enters the
        VM's own mount namespace (if it has one: files.ns; setns puts its
        root and cwd at that namespace's root), then setpriv drops to the uid
        with no capabilities and no_new_privs, then execs QEMU. The caller
        closes files.ns after this: QEMU alone keeps the namespace alive."""
        join = 'for f; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 111; shift; done; shift; exec "$@"'
        enter = [self.nsenter, f"--mount=/proc/self/fd/{files.ns}", "--"] if files.ns >= 0 else []
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                "--inh-caps=-all", "--bounding-set=-all", "--"]
        with open(vm_dir / "qemu.log", "ab") as logf:
            os.fchown(logf.fileno(), uid, uid)
            return subprocess.Popen(["/bin/sh", "-c", join, "dsec-vm", *group.procs_files(), "--", *enter, *drop,
                                     *argv],
                                    stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, cwd=vm_dir,
                                    start_new_session=True, close_fds=True, pass_fds=files.fds)

    async def connect(self, h: VmHandle, what: str, hostname: str, timeout: float,
                      hello: bool = True, sandbox_id: str = "", wake: bool = False) -> None:
        """The monitor and the agent's channel; with hello, wait for the agent
        (the guest booted and mounted its root). wake: first run the vCPUs
        if they are stopped (run_if_stopped). Raises VmError with the tails
        of the serial and QEMU logs when it does not come."""
        async def channels() -> None:
            h.qmp = await QMP.connect(str(h.vm_dir / "qmp.sock"), what, timeout)
            if wake:
                await self.run_if_stopped(h, what)
            if hello:
                h.agent = await self.connect_agent(h, what, hostname, timeout, sandbox_id)

        try:
            await _unless_exits(h, channels())
        except (TimeoutError, OSError) as err:
            raise VmError(errno.EIO, f"{what}: {err}; serial log: {_tail(h.vm_dir / 'serial.log')}; "
                          f"QEMU: {_tail(h.vm_dir / 'qemu.log')}") from err

    async def run_if_stopped(self, h: VmHandle, what: str) -> None:
        """A VM re-adopted as running whose vCPUs are stopped: a daemon died
        between a pause's QMP stop (or during or after its save) or a job
        pause's freeze and the journal record saying paused. A save still
        under way is cancelled (its file is partial, paused.ram.part), and
        the vCPUs run again, as the record says; else the agent never
        answers."""
        await self._run_again(h, what, "a pause its record does not show")

    async def _run_again(self, h: VmHandle, what: str, why: str) -> None:
        """Cancel a save under way and run the vCPUs if they are stopped;
        `why` they were stopped, for the log."""
        migration = (await h.qmp.command("query-migrate")).get("status", "none")
        if migration in MIGRATING:
            log.warning("%s: cancelling the save of %s (%s)", what, why, migration)
            await h.qmp.command("migrate_cancel")
            deadline = time.monotonic() + 30.0
            while migration in MIGRATING:
                if time.monotonic() > deadline:
                    raise VmError(errno.ETIMEDOUT, f"{what}: its save under way did not cancel in 30 s")
                await asyncio.sleep(0.05)
                migration = (await h.qmp.command("query-migrate")).get("status", "none")
        status = (await h.qmp.command("query-status")).get("status")
        if status in ("paused", "postmigrate", "finish-migrate"):
            log.warning("%s: its vCPUs were stopped (%s) by %s; running them", what, status, why)
            await h.qmp.command("cont")

    async def connect_agent(self, h: VmHandle, what: str, hostname: str, timeout: float,
                            sandbox_id: str = "") -> AgentLink:
        return await AgentLink.connect(ChardevTransport(str(h.vm_dir / "agent.sock")), what, hostname, timeout,
                                       sandbox_id, on_broken=lambda why: self.end_broken(h, what, why))

    def end_broken(self, h: VmHandle, what: str, why: str) -> None:
        """The guest broke the agent's protocol (root in it wrote to the
        channel): its channel is closed and cannot be trusted again, and a
        VM whose agent is unreachable serves nothing. QEMU is killed; the
        sandbox's watch reports it dead, reason "agent_protocol", and cleans
        it up (a VM being created fails instead)."""
        log.error("%s: %s; killing QEMU %d (serial log: %s)", what, why, h.init_pid, h.vm_dir / "serial.log")
        h.extra["died_because"] = "agent_protocol"
        h.extra["died_why"] = why
        try:
            h.kill()
        except OSError as err:
            log.error("%s: kill QEMU %d: %s", what, h.init_pid, err)

    # ------------------------------------------------------------ pause / resume

    async def _ignore_shared(self, h: VmHandle, on: bool) -> None:
        """x-ignore-shared: a migration leaves out RAM mapped shared (a
        template's guest RAM, the layers' pmem). Both ends must agree: the
        stream says which it was written with, and a load with the other
        setting fails."""
        await h.qmp.command("migrate-set-capabilities",
                            {"capabilities": [{"capability": "x-ignore-shared", "state": on}]})

    async def _migrate_out(self, h: VmHandle, image: Path, timeout: float) -> int:
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            await h.qmp.send_fd("state-out", fd)
        finally:
            os.close(fd)
        await h.qmp.command("migrate", {"uri": "fd:state-out"})
        await h.qmp.migrate_wait(timeout)
        return image.stat().st_size

    async def save(self, h: VmHandle, image: Path, run, timeout: float = 120.0) -> int:
        """Pause: stop the vCPUs and write the VM's state (RAM and devices)
        to `image` through QMP migration to an fd, on disk and out of the
        page cache (settle_saved, through `run`: a worker); the caller then
        ends QEMU. Returns the image's size."""
        # Written whole under another name first: a paused.ram that exists
        # is complete (re-adoption takes a VM with one for paused).
        part = image.with_name(image.name + ".part")
        await h.qmp.command("stop")
        try:
            # A VM restored from a template had x-ignore-shared on for its
            # load; its RAM is private, saved either way, but the setting
            # must match at resume: off, as a resume sets it.
            await self._ignore_shared(h, False)
            size = await self._migrate_out(h, part, timeout)
            await run(settle_saved, part)
            os.rename(part, image)
        except BaseException:
            # Not saved: the VM is still recorded running, and its agent
            # answers only if its vCPUs run.
            try:
                part.unlink(missing_ok=True)
            except OSError as err:
                log.warning("%s: cannot remove the partial state of a failed save: %s", part, err)
            try:
                await self._run_again(h, str(h.vm_dir), "a pause that failed")
            except Exception as err:        # the save's own error says why the pause failed
                log.error("%s: cannot run the vCPUs again after a failed save: %s", h.vm_dir, err)
            raise
        return size

    async def snapshot(self, h: VmHandle, state: Path, timeout: float = 120.0) -> int:
        """A template: stop the vCPUs (the agent is idle, waiting for its next
        request) and write the device state to `state`, leaving out the RAM
        (shared: it is the template's memfd). Returns the state's size."""
        await h.qmp.command("stop")
        await self._ignore_shared(h, True)
        return await self._migrate_out(h, state, timeout)

    async def restore(self, h: VmHandle, image: Path, what: str, hostname: str, timeout: float = 120.0,
                      sandbox_id: str = "", ignore_shared: bool = False) -> None:
        """Into `h`, a QEMU started with incoming=True: load `image`, run the
        vCPUs, reach the agent again. Its HELLO gives the guest its identity:
        the clock it slept through (a resume) or a new hostname, clock,
        entropy and id (a restore from a template, ignore_shared: its RAM is
        the template's, not in the stream)."""
        await self.connect(h, what, hostname, timeout, hello=False)
        if ignore_shared:
            await self._ignore_shared(h, True)
        # No self-announcement after the load: QEMU would broadcast RARP
        # frames with the NIC's MAC (and have the guest send gratuitous ARPs),
        # which the tap's program drops (no ARP, or a MAC not yet the VM's).
        # The bridge learns the VM's MAC from its first frame anyway.
        await h.qmp.command("migrate-set-parameters", {"announce-rounds": 0})
        fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
        try:
            await h.qmp.send_fd("state-in", fd)
        finally:
            os.close(fd)
        await h.qmp.command("migrate-incoming", {"uri": "fd:state-in"})
        await h.qmp.migrate_wait(timeout)
        await h.qmp.command("cont")
        h.agent = await self.connect_agent(h, what, hostname, timeout, sandbox_id)

    def end_process(self, h: VmHandle) -> bool:
        """Blocking: end a VM's QEMU (its state saved), keep its dir and
        cgroups; whether it exited within destroy_timeout_s."""
        for link in (h.agent, h.qmp):
            if link is not None:
                link.close()
        h.agent = h.qmp = None
        try:
            h.kill()
        except OSError:
            pass
        # A re-adopted QEMU is not our child: its pidfd says when it is gone.
        # A resume must not start the next QEMU in the same dir while this
        # one still holds its sockets (the new monitor's connect would reach
        # the dying one's and be reset).
        if h.popen is not None:
            try:
                h.popen.wait(self.destroy_timeout)
                exited = True
            except subprocess.TimeoutExpired:
                exited = False
        else:
            exited = h.exited(self.destroy_timeout)
        if not exited:
            log.error("QEMU %d did not exit %.0fs after SIGKILL (stuck in the kernel: hung storage?)",
                      h.init_pid, self.destroy_timeout)
        h.close_pidfd()
        return exited

    def respawn(self, h: VmHandle, layers: list[Path], cpu: float, disk: int, uid: int, tap_fd: int = -1) -> None:
        """Blocking: a new QEMU for a paused VM's dir and cgroups, waiting
        for its saved state (restore); `h` now names it. tap_fd: a new tap
        for its NIC (the old one went with the old QEMU)."""
        h.machine = h.machine.resumed()
        with QemuFiles(h.vm_dir, layers, self.guest, tap_fd=tap_fd, roots=self.roots) as files:
            argv = self.qemu_argv(files.refs, layers, h.guest_memory, self.vcpus(cpu), disk, incoming=True,
                                  machine=h.machine)
            popen = self._spawn(argv, h.group, h.vm_dir, uid, files)
        start = proc_start_time(popen.pid)
        if start is None:
            raise VmError(errno.ESRCH, f"QEMU exited at once: {_tail(h.vm_dir / 'qemu.log')}")
        h.popen, h.init_pid, h.init_start, h.is_child = popen, popen.pid, start, True
        h.pidfd = fds.park(native.pidfd_open(popen.pid))

    # ------------------------------------------------------------ destroy

    def stop(self, sb_id: str, h: VmHandle | None) -> None:
        """Kill QEMU and remove the cgroups; safe to repeat. No handle: kill
        what is in the cgroups (an orphan)."""
        group = h.group if h else self.group_for(sb_id)
        if h:
            for link in (h.agent, h.qmp):
                if link is not None:
                    link.close()
            try:
                h.kill()
            except OSError:
                pass
            if h.popen is not None:
                try:
                    h.popen.wait(self.destroy_timeout)
                except subprocess.TimeoutExpired:
                    log.error("QEMU %d of sandbox %s did not exit %.0fs after SIGKILL", h.init_pid, sb_id,
                              self.destroy_timeout)
        else:
            group.kill_all()
        group.remove(self.destroy_timeout)

    def release(self, sb_id: str, h: VmHandle | None) -> None:
        """Closes the handle's fd and removes the VM's dir (logs, a paused RAM image)."""
        if h is not None:
            h.close_pidfd()
        shutil.rmtree(self.root / sb_id, ignore_errors=True)

    def destroy(self, sb_id: str, h: VmHandle | None) -> None:
        self.stop(sb_id, h)
        self.release(sb_id, h)

    def adopt(self, sb_id: str, init_pid: int, init_start: int, upper_tmpfs: bool = False) -> VmHandle | None:
        """After a daemon restart: the QEMU of sandbox `sb_id` if it still
        runs (same pid and start time). The channels are reconnected by
        `connect` (execs in flight were lost with the old daemon)."""
        if not init_pid or proc_start_time(init_pid) != init_start:
            return None
        try:
            pidfd = fds.park(native.pidfd_open(init_pid))
        except OSError:
            return None
        if proc_start_time(init_pid) != init_start:
            os.close(pidfd)
            return None
        return VmHandle(init_pid=init_pid, init_start=init_start, pidfd=pidfd, group=self.group_for(sb_id),
                        vm_dir=self.root / sb_id, is_child=False, accel=self.accel)

    def paused_handle(self, sb_id: str, guest_memory: int) -> VmHandle | None:
        """After a daemon restart: a paused VM (no QEMU; its saved state in
        its dir), or None if that state is gone."""
        vm_dir = self.root / sb_id
        if not (vm_dir / SAVED_STATE).exists():
            return None
        return VmHandle(init_pid=0, init_start=0, pidfd=-1, group=self.group_for(sb_id), vm_dir=vm_dir,
                        is_child=False, accel=self.accel, guest_memory=guest_memory)

    def found_qemu(self, sb_id: str) -> VmHandle | None:
        """Blocking. After a daemon restart: the process in the cgroups of a
        VM recorded paused, which has no QEMU of its own: the QEMU of a
        resume the daemon died in before the record said running. None if
        there is none."""
        for pid in sorted(self.group_for(sb_id).pids()):
            start = proc_start_time(pid)
            handle = self.adopt(sb_id, pid, start) if start is not None else None
            if handle is not None:
                return handle
        return None

    def kill_found(self, h: VmHandle) -> None:
        """Blocking: end a QEMU found_qemu gave (its load had not finished:
        the VM stays paused, from its state file), waiting for it to exit
        so that a resume's new QEMU does not run beside it. VmError if it
        does not exit within destroy_timeout_s (a process stuck in D state)."""
        pid = h.init_pid
        if not self.end_process(h):
            raise VmError(errno.EBUSY, f"QEMU {pid} did not exit {self.destroy_timeout:.0f}s after SIGKILL")

    def drop_saved_state(self, sb_id: str) -> None:
        """Blocking: the state files of a VM that runs again (its resume is
        recorded, or it was re-adopted running): GiBs of disk, no longer
        wanted. Best effort: a file left is removed with the VM's dir."""
        vm_dir = self.root / sb_id
        for name in (SAVED_STATE, SAVED_STATE + ".part", SAVED_STATE + ".loaded"):
            try:
                (vm_dir / name).unlink(missing_ok=True)
            except OSError as err:
                log.error("microVM %s: remove %s: %s", sb_id, vm_dir / name, err)

    def template_build_leftovers(self) -> set[str]:
        """The VM dirs and cgroups of template builds (`.template-<key>`)
        that a daemon crash interrupted."""
        dirs = {e.name for e in os.scandir(self.root) if e.name.startswith(".template-")}
        groups = {n for n in cgroup.list_children(self.layout, self.cgroup_root) if n.startswith(".template-")}
        return dirs | groups

    def orphans(self, known: set[str]) -> set[str]:
        """VM dirs without a journal record (their cgroups are found by the
        container backend's sweep: the same cgroup root)."""
        return {e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")} - known


def settle_saved(path: Path) -> None:
    """Blocking: a state file QEMU wrote, on disk and its pages out of the
    page cache. QEMU wrote it from the sandbox's cgroups, so its page cache
    is charged there (dirty at first, which reclaim cannot drop until it is
    written back): a paused VM would hold about its state's size of the
    host's memory, and be charged for it, until the kernel reclaimed it.
    Written out first: POSIX_FADV_DONTNEED drops clean pages only."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def _unless_exits(h: VmHandle, work) -> None:
    """Await `work`, failing at once if QEMU exits meanwhile (a bad option,
    a guest that panicked) instead of at the end of a timeout."""
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    # A copy of the pidfd of our own: a destroy meanwhile (which takes no
    # sandbox lock) removes the loop's reader of h.pidfd, closes it and sets
    # it to -1, which would leave this wait to the work's own timeout.
    try:
        with h.pidfd_lock:
            if h.pidfd < 0:
                raise VmError(errno.ESRCH, "its QEMU was ended meanwhile")
            pidfd = os.dup(h.pidfd)
    except BaseException:
        if asyncio.iscoroutine(work):
            work.close()    # never started: closed, not left unawaited
        raise
    loop.add_reader(pidfd, lambda: gone.done() or gone.set_result(None))
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # Cancelled (a create whose client went, a daemon stop): the wait
        # for the guest ends with us, not later on its own with an error
        # nobody reads.
        task.cancel()
        raise
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise VmError(errno.ESRCH, "QEMU exited")
    task.result()


def _exited(pidfd: int, timeout: float) -> bool:
    """Blocking: wait up to `timeout` s for the process of `pidfd` to exit
    (its pidfd turns readable); whether it did."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def _kill_wait(popen: subprocess.Popen) -> None:
    try:
        popen.kill()
    except ProcessLookupError:
        pass
    try:
        popen.wait(10)
    except subprocess.TimeoutExpired:
        log.error("QEMU %d did not exit 10s after SIGKILL", popen.pid)


def guest_panic(serial_log: Path, n: int = 16 << 10) -> str | None:
    """The guest kernel's panic line ("Kernel panic - not syncing: ...") at
    the end of its serial log, if it panicked; a dead VM's reason."""
    try:
        with open(serial_log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        at = line.find("Kernel panic - not syncing")
        if at >= 0:
            found = line[at:].strip()[:300]
    return found


def how_qemu_ended(h: VmHandle) -> dict:
    """How a dead VM's QEMU ended, for its "died" event: {"signal": "SIGKILL"}
    (the kernel's OOM killer, the watchdog, a SIGKILL from outside) or
    {"exit_code": n}: 1 for an error of QEMU's own, 0 for a guest panic or
    power-off, and 0 too for a SIGTERM, SIGINT or SIGHUP from outside,
    which QEMU catches and exits on ("terminating on signal N from pid P").
    With an exit code, the last lines of QEMU's stderr, where it says
    which, in "qemu_said" (when it wrote any). Read without reaping it
    (WNOWAIT: the stop that follows, MicroVMBackend.stop, waits for it);
    {} for a QEMU that is not the daemon's child (re-adopted after a
    restart) or that has not exited."""
    with h.pidfd_lock:
        if not h.is_child or h.pidfd < 0:
            return {}
        how = execio.how_child_ended(h.pidfd)
    if "exit_code" in how:
        said = _tail(h.vm_dir / "qemu.log", missing="")
        return how | ({"qemu_said": said} if said else {})
    return how


def _tail(path: Path, n: int = 600, missing: str | None = None) -> str:
    """The last lines of a log, joined by " | "; `missing` (if given) for
    one that is empty or unreadable, else a note saying which."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            text = f.read().decode(errors="replace").strip()
    except OSError:
        return f"({path} unreadable)" if missing is None else missing
    lines = " | ".join(line for line in text.splitlines()[-6:] if line.strip())
    return lines or ("(empty)" if missing is None else missing)
