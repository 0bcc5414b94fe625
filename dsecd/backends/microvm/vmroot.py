"""A microVM's root: the only files its QEMU can name.

QEMU runs a guest's device models; a guest that breaks one runs code as
that QEMU. Its uid (unprivileged, its own per sandbox) and `-sandbox on`
limit what it may do; its mount namespace limits what it can see. Each QEMU
starts in a new mount namespace (private: nothing propagates to or from the
host's) whose root is a small read-only tmpfs holding:

  /usr                 the host's, read-only: QEMU, its libraries (Debian 12
                       is usr-merged: /lib, /lib64, /bin, /sbin are the same
                       symlinks into it as on the host; a host that is not
                       gets read-only binds of them), and its firmware and
                       option ROMs (/usr/share/qemu, /usr/share/seabios,
                       /usr/lib/ipxe/qemu)
  /etc/ld.so.cache     read-only: the loader finds libraries outside its
                       default dirs through it; nothing else of /etc is read
  /dev/null, zero, random, urandom; /dev/kvm only under KVM (a NIC's tap
                       comes as an open fd, so no /dev/net/tun)
  /proc                a procfs of its own with hidepid=invisible and
                       subset=pid: its own processes only, no /proc/sys,
                       /proc/kcore and the like. QEMU opens a template's
                       RAM memfd by /proc/self/fd/N
  /vm                  the VM's dir, read-write: its QMP and agent sockets,
                       serial log (and nothing of any other VM)
  /guest/kernel, /guest/initramfs, /layers/<i>
                       read-only binds of the guest kernel, the initramfs and
                       the image's EROFS layer blobs

Absent: /sys, /tmp, /var, /home, /root, the rest of /etc, the daemon's state
dir and socket, other VMs' dirs and the blob store. The daemon keeps using
host paths (the sockets are the same inodes seen from both sides); state
files of pause, restore and templates reach QEMU as fds over QMP.

The namespace is made before QEMU starts (dsec_vm_root, csrc/spawn.c: one
clone, mounts by path, pivot_root) and entered by QEMU's spawn chain
(nsenter) before it drops to its uid. The daemon closes its fd right after
the spawn, so the namespace, and every mount in it, ends with QEMU: on
destroy, on a crash, whatever the daemon does meanwhile. Nothing of it is on
the host side but one empty directory, the tmpfs's mount point.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ... import native
from ...feature import Feature
from .guestimg import GuestImage

# Where QEMU finds what the command line names (backend.qemu_argv's refs).
VM_DIR = "/vm"
KERNEL = "/guest/kernel"
INITRAMFS = "/guest/initramfs"
LAYER = "/layers/{}"
# Top-level host dirs that usr-merged hosts have as symlinks into /usr.
SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEV_NODES = ("null", "zero", "random", "urandom")
PROC_OPTIONS = "hidepid=invisible,subset=pid"
LD_CACHE = "/etc/ld.so.cache"

RO_FILES = native.MS_RDONLY | native.MS_NOSUID | native.MS_NODEV | native.MS_NOEXEC
NO_SPECIAL = native.MS_NOSUID | native.MS_NODEV | native.MS_NOEXEC
DEVICE = native.MS_NOSUID | native.MS_NOEXEC


def system_entries(qemu: str) -> list[native.RootEntry]:
    """/usr, the top-level links or dirs into it, the loader's cache. The
    QEMU binary must be under /usr (it is where its ROMs are looked up too)."""
    real = os.path.realpath(qemu)
    if not real.startswith("/usr/"):
        raise OSError(f"QEMU {qemu} is {real}, outside /usr: a VM's root binds only /usr of the host's programs")
    entries = [native.RootEntry("bind_dir", "usr", "/usr", native.MS_RDONLY | native.MS_NOSUID | native.MS_NODEV)]
    for name in SYSTEM_DIRS:
        host = Path("/") / name
        if host.is_symlink():
            entries.append(native.RootEntry("symlink", name, os.readlink(host)))
        elif host.is_dir():
            entries.append(native.RootEntry("bind_dir", name, str(host),
                                            native.MS_RDONLY | native.MS_NOSUID | native.MS_NODEV))
    if os.path.isfile(LD_CACHE):
        entries += [native.RootEntry("dir", "etc"),
                    native.RootEntry("bind_file", LD_CACHE[1:], LD_CACHE, RO_FILES)]
    return entries


def dev_entries(kvm: bool) -> list[native.RootEntry]:
    names = DEV_NODES + (("kvm",) if kvm else ())
    return [native.RootEntry("dir", "dev")] + [native.RootEntry("bind_file", f"dev/{n}", f"/dev/{n}", DEVICE)
                                               for n in names]


def vm_entries(vm_dir: Path, layers: list[Path], guest: GuestImage) -> list[native.RootEntry]:
    """The VM's own: its dir (read-write), the guest and the layers (read-only)."""
    return [native.RootEntry("proc", "proc", PROC_OPTIONS, NO_SPECIAL),
            native.RootEntry("bind_dir", VM_DIR[1:], str(vm_dir), NO_SPECIAL),
            native.RootEntry("dir", "guest"),
            native.RootEntry("bind_file", KERNEL[1:], str(guest.kernel), RO_FILES),
            native.RootEntry("bind_file", INITRAMFS[1:], str(guest.initramfs), RO_FILES),
            native.RootEntry("dir", "layers")] + [
        native.RootEntry("bind_file", LAYER.format(i)[1:], str(p), RO_FILES) for i, p in enumerate(layers)]


def refs(n_layers: int) -> dict:
    """The paths of backend.qemu_argv's refs as QEMU sees them in its root."""
    return {"dir": VM_DIR, "kernel": KERNEL, "initramfs": INITRAMFS,
            "layers": [LAYER.format(i) for i in range(n_layers)]}


class VmRoots:
    """Makes each VM's root namespace. `mount_dir`: an empty directory of
    the host's that every new namespace mounts its tmpfs on (in itself only)."""

    def __init__(self, mount_dir: Path, qemu: str, kvm: bool):
        self.mount_dir = Path(mount_dir)
        self.mount_dir.mkdir(mode=0o755, exist_ok=True)
        self.common = system_entries(qemu) + dev_entries(kvm)

    def make(self, vm_dir: Path, layers: list[Path], guest: GuestImage) -> int:
        """The fd of a new namespace for this VM's QEMU (close it once QEMU
        has entered it). NativeError naming the entry that failed."""
        return native.vm_root(str(self.mount_dir), self.common + vm_entries(vm_dir, layers, guest))


def probe(qemu: str, guest: GuestImage | None) -> Feature:
    """Whether a VM's root can be made here: one made (with the guest's
    files, no layers) and dropped. Needs nsenter (util-linux), CAP_SYS_ADMIN
    and procfs's subset=pid (Linux 5.8)."""
    if shutil.which("nsenter") is None:
        return Feature(False, "QEMU runs in the host's mount namespace: no nsenter to enter its own "
                              "(apt-get install util-linux)")
    scratch = Path(tempfile.mkdtemp(prefix="dsecd-vmroot-probe-"))
    try:
        (scratch / "vm").mkdir()
        roots = VmRoots(scratch / "root", qemu, kvm=False)
        entries = roots.common + (vm_entries(scratch / "vm", [], guest) if guest is not None else [])
        os.close(native.vm_root(str(roots.mount_dir), entries))
    except (OSError, ValueError) as err:
        return Feature(False, f"QEMU runs in the host's mount namespace: {err}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Feature(True, "each QEMU in a mount namespace of its own whose root holds only /usr, its VM's "
                         "dir, guest and layers (docs/hardening.md)")
