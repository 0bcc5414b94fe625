"""native.vm_root (csrc/spawn.c dsec_vm_root) and vmroot.py against the
real kernel: the mount namespace a microVM's QEMU runs in, without QEMU.

Needs root (a mount namespace, mounts). Every namespace made here lives in
an fd the test closes; nothing is mounted on the host.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

native = pytest.importorskip("dsecd.native", reason="dsecd._native is not built (pip install -e .)")
from dsecd.backends.microvm import vmroot  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mount namespaces")]

QEMU = "/usr/bin/qemu-system-x86_64"


def _host_mounts(under: Path) -> list[str]:
    """The host namespace's mounts at or below `under` (a leak of the VM's
    root would be there; the whole table also moves with other tests' and
    daemons' mounts running beside this one)."""
    top = str(under)
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4] == top or line.split()[4].startswith(top + "/")]


def _inside(ns_fd: int, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", f"--mount=/proc/self/fd/{ns_fd}", "--", *argv], pass_fds=[ns_fd],
                          capture_output=True, text=True)


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "vm").mkdir()
    (tmp_path / "blob").write_bytes(b"layer")
    (tmp_path / "secret").write_text("not for QEMU")
    return tmp_path


def test_a_vm_root_holds_its_entries_and_nothing_else(dirs):
    entries = vmroot.system_entries(QEMU) + vmroot.dev_entries(kvm=False) + [
        native.RootEntry("proc", "proc", vmroot.PROC_OPTIONS, vmroot.NO_SPECIAL),
        native.RootEntry("bind_dir", "vm", str(dirs / "vm"), vmroot.NO_SPECIAL),
        native.RootEntry("dir", "layers"),
        native.RootEntry("bind_file", "layers/0", str(dirs / "blob"), vmroot.RO_FILES)]
    before = _host_mounts(dirs)
    fd = native.vm_root(str(dirs / "root"), entries)
    try:
        assert _host_mounts(dirs) == before, "a mount of the VM's root reached the host's namespace"
        top = _inside(fd, "ls", "-A", "/").stdout.split()
        assert set(top) == {e.target.split("/")[0] for e in entries}
        assert _inside(fd, "cat", "/layers/0").stdout == "layer"
        assert _inside(fd, "sh", "-c", "echo x > /layers/0").returncode != 0       # read-only
        assert _inside(fd, "sh", "-c", "echo x > /new").returncode != 0            # the root too
        assert _inside(fd, "sh", "-c", "echo hi > /vm/made").returncode == 0       # its own dir is not
        assert (dirs / "vm" / "made").read_text() == "hi\n"
        assert _inside(fd, "ls", str(dirs / "secret")).returncode != 0
        assert _inside(fd, "ls", "/proc/sys").returncode != 0                      # subset=pid
    finally:
        os.close(fd)
    assert _host_mounts(dirs) == before
    assert os.listdir(dirs / "root") == []


def test_a_failed_bind_names_what_and_where_and_leaves_nothing(dirs):
    fds = len(os.listdir("/proc/self/fd"))
    missing = str(dirs / "gone")
    with pytest.raises(FileNotFoundError) as info:
        native.vm_root(str(dirs / "root"), [native.RootEntry("dir", "guest"),
                                            native.RootEntry("bind_file", "guest/kernel", missing, vmroot.RO_FILES)])
    assert str(info.value) == f"bind `{missing}` into the VM's root at `/guest/kernel`: No such file or directory"
    assert info.value.step == "vm_root_bind"
    assert len(os.listdir("/proc/self/fd")) == fds
    assert os.listdir(dirs / "root") == []


def test_entries_must_stay_inside_the_root(dirs):
    for target in ("/etc", "../x", "a/../../b", ""):
        with pytest.raises(ValueError):
            native.vm_root(str(dirs / "root"), [native.RootEntry("dir", target)])


def test_qemu_outside_usr_is_refused_with_the_reason(tmp_path):
    with pytest.raises(OSError, match="outside /usr"):
        vmroot.system_entries(str(tmp_path / "qemu"))
