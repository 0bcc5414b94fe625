"""What a microVM's QEMU sees of the host (dsecd/backends/microvm/vmroot.py):
its own mount namespace, whose root holds /usr, its VM's dir, its guest and
layers, and nothing of the daemon or of other VMs. Looked at from the host,
through /proc/<qemu>/root and nsenter. Two VMs (template restores) at a
time; skipped where the microvm backend or its own root is unavailable.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import skip_unless_microvm

# Its VMs start from the run's templates (conftest.VM_TEMPLATES): none of its tests is about how one is built.
pytestmark = pytest.mark.shared_vm_templates


@pytest.fixture(scope="module")
def vmd(daemon):
    c = daemon.client()
    info = skip_unless_microvm(c)
    if not info.get("own_mount_namespace"):
        c.close()
        pytest.skip(f"QEMU has no mount namespace of its own here: {info.get('root')}")
    yield daemon, c
    c.close()


def _vm(c):
    return c.create("busybox", backend="microvm", memory="256M", net="none", disk="64M")


def _mnt_ns(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/mnt").st_ino


def _processes_in_ns(ns: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if _mnt_ns(int(name)) == ns:
                    found.append(int(name))
            except OSError:
                continue
    return found


def test_qemu_sees_its_own_vm_and_nothing_of_the_daemon_or_other_vms(vmd):
    d, c = vmd
    a, b = _vm(c), _vm(c)
    try:
        va, vb = a.inspect()["vm"], b.inspect()["vm"]
        pid = va["qemu_pid"]
        root = Path(f"/proc/{pid}/root")
        assert _mnt_ns(pid) != _mnt_ns(os.getpid()) != _mnt_ns(vb["qemu_pid"]) != _mnt_ns(pid)
        # What is there: the programs, its own dir (sockets, logs), guest, layers.
        assert {"usr", "dev", "proc", "vm", "guest", "layers"} <= set(os.listdir(root))
        assert {"qmp.sock", "agent.sock", "serial.log"} <= set(os.listdir(root / "vm"))
        assert os.stat(root / "vm").st_ino == os.stat(va["dir"]).st_ino
        blobs = [d.state / "store" / "blobs" / "sha256" / dg.split(":", 1)[1] for dg in a.inspect()["layers"]]
        seen = sorted(os.listdir(root / "layers"), key=int)
        assert len(seen) == len(blobs)
        for i, blob in enumerate(blobs):
            st, host = os.stat(root / "layers" / str(i)), os.stat(blob)
            assert (st.st_dev, st.st_ino) == (host.st_dev, host.st_ino)
        with pytest.raises(OSError):
            open(root / "layers" / "0", "r+b")          # read-only bind, even for root
        assert set(os.listdir(root / "dev")) == {"null", "zero", "random", "urandom"} | (
            {"kvm"} if va["accel"] == "kvm" else set())
        # What is not: the daemon's state dir and socket, the other VM, host dirs.
        for absent in (d.state, Path(d.socket), Path(vb["dir"]), Path("/home"), Path("/root"), Path("/var"),
                       Path("/tmp"), Path("/sys"), Path("/etc/passwd"), Path("/run")):
            assert not os.path.lexists(f"{root}{absent}"), f"{absent} is in QEMU's root"
        # As its own uid, in its namespace: its /proc lists its own processes only.
        uid = os.stat(f"/proc/{pid}").st_uid
        out = subprocess.run(["nsenter", "-t", str(pid), "-m", "-S", str(uid), "-G", str(uid), "--", "ls", "/proc"],
                             capture_output=True, text=True, check=True).stdout.split()
        pids = {int(n) for n in out if n.isdigit()}
        assert pid in pids and all(os.stat(f"/proc/{p}").st_uid == uid for p in pids if os.path.exists(f"/proc/{p}"))
        assert vb["qemu_pid"] not in pids and os.getpid() not in pids
        # The VM works as ever: exec, pause and resume (a new QEMU, a new root).
        assert a.exec(["echo", "in"]).stdout == b"in\n"
        a.pause()
        assert a.resume()["state"] == "running"
        pid2 = a.inspect()["vm"]["qemu_pid"]
        assert pid2 != pid and os.path.exists(f"/proc/{pid2}/root/vm/qmp.sock")
        assert a.exec(["echo", "again"]).stdout == b"again\n"
    finally:
        a.destroy(force=True)
        b.destroy(force=True)


def test_nothing_of_a_vms_root_outlives_its_qemu(vmd):
    d, c = vmd
    sb = _vm(c)
    pid = sb.inspect()["vm"]["qemu_pid"]
    ns = _mnt_ns(pid)
    assert _processes_in_ns(ns) == [pid], "the namespace's only process is QEMU"
    sb.destroy()
    assert not os.path.exists(f"/proc/{pid}")
    assert _processes_in_ns(ns) == []
    # Nor on the host: no mount of a VM's root or of the VM's dir, and the
    # tmpfs's mount point is an empty directory.
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    assert not [p for p in points if p.startswith(str(d.state / "vms"))]
    assert os.listdir(d.state / "vms" / ".root") == []


def test_with_own_root_off_info_says_qemu_shares_the_daemons_namespace(daemon_factory, busybox_rootfs):
    # A restore from the run's template (conftest.VM_TEMPLATES): its QEMU is
    # started as a booting one is, without the boot's seconds.
    d = daemon_factory("[microvm]\nown_root = false\n", shared_vm_templates=True)
    c = d.client()
    try:
        info = skip_unless_microvm(c, close=False)
        assert info["own_mount_namespace"] is False and "own_root is false" in info["root"]
        c.import_image(busybox_rootfs, "busybox")
        sb = _vm(c)
        try:
            assert _mnt_ns(sb.inspect()["vm"]["qemu_pid"]) == _mnt_ns(d.proc.pid)
        finally:
            sb.destroy()
    finally:
        c.close()
