"""The seccomp profile as built (no root needed): what it names, not what it does.

What it does on the kernel is tests/integration/test_seccomp_kernel.py.
"""

from __future__ import annotations

import re

import pytest

from dsecd import seccomp

AUDIT_ARCH_X86_64 = 0xC000003E


@pytest.fixture(scope="module")
def pfc() -> str:
    return seccomp.export_pfc("default")


def test_prepare_is_idempotent_and_fits():
    n = seccomp.prepare()
    assert 0 < n <= seccomp.MAX_INSNS
    assert seccomp.prepare("default") == n


def test_unknown_profile_is_a_value_error():
    with pytest.raises(ValueError, match="unknown seccomp profile"):
        seccomp.prepare("nope")
    with pytest.raises(ValueError):
        seccomp.apply("nope")


def test_every_listed_syscall_is_in_the_filter(pfc):
    named = set(re.findall(r'filter for syscall "(\w+)"', pfc))
    assert set(seccomp.DENIED_SYSCALLS) <= named
    # the ones with argument checks, plus clone3 (ENOSYS)
    assert {"unshare", "clone", "clone3", "ioctl", "socket"} <= named
    assert named - set(seccomp.DENIED_SYSCALLS) == {"unshare", "clone", "clone3", "ioctl", "socket"}


def test_denials_are_eperm_and_clone3_enosys(pfc):
    actions = set(re.findall(r"action (\w+\(?\d*\)?);", pfc))
    assert actions == {"ERRNO(1)", "ERRNO(38)", "ALLOW"}
    clone3 = pfc.split('filter for syscall "clone3"')[1].split("# filter")[0]
    assert "ERRNO(38)" in clone3


def test_foreign_architectures_are_refused(pfc):
    assert f"if ($arch == {AUDIT_ARCH_X86_64})" in pfc
    tail = pfc.split("# invalid architecture action")[1]
    assert "action ERRNO(1)" in tail


def test_ioctl_checks_ignore_the_upper_32_bits(pfc):
    # The kernel truncates ioctl's request to 32 bits: a 64-bit comparison
    # could be passed with TIOCSTI | 1 << 32.
    ioctl = pfc.split('filter for syscall "ioctl"')[1].split("# default action")[0]
    assert "$a1.hi32 & 0x00000000 == 0" in ioctl
    assert "$a1.lo32 & 0xffffffff == 21522" in ioctl   # TIOCSTI
    assert "$a1.lo32 & 0x0000ffff == 22637" in ioctl   # XFS_IOC_SWAPEXT, any size


def test_clone_checks_every_namespace_flag_but_not_the_exit_signal(pfc):
    clone = pfc.split('filter for syscall "clone"')[1].split("# filter")[0]
    unshare = pfc.split('filter for syscall "unshare"')[1].split("# filter")[0]
    for flag in (0x10000000, 0x20000, 0x20000000, 0x40000000, 0x4000000, 0x8000000, 0x2000000):
        assert f"& 0x{flag:08x} == {flag}" in clone
        assert f"& 0x{flag:08x} == {flag}" in unshare
    assert "& 0x00000080 == 128" in unshare      # CLONE_NEWTIME
    assert "& 0x00000080" not in clone           # clone's low byte is the exit signal


def test_the_fncall_profile_lets_unshare_make_ipc_and_net_namespaces_alone(pfc):
    """Call sandboxes' profile: "default" but for unshare(CLONE_NEWIPC) and
    unshare(CLONE_NEWNET), which their zygote uses; clone with them, and
    unshare with any other namespace flag, stay denied."""
    fncall = seccomp.export_pfc("fncall")
    clone = fncall.split('filter for syscall "clone"')[1].split("# filter")[0]
    unshare = fncall.split('filter for syscall "unshare"')[1].split("# filter")[0]
    for flag in (0x8000000, 0x40000000):
        assert f"& 0x{flag:08x} == {flag}" not in unshare
        assert f"& 0x{flag:08x} == {flag}" in clone
    for flag in (0x10000000, 0x20000, 0x20000000, 0x4000000, 0x2000000, 0x80):
        assert f"& 0x{flag:08x} == {flag}" in unshare
    named = set(re.findall(r'filter for syscall "(\w+)"', fncall))
    assert named == set(re.findall(r'filter for syscall "(\w+)"', pfc))
    assert 0 < seccomp.prepare("fncall") <= seccomp.MAX_INSNS


def test_vsock_sockets_are_refused_whatever_the_upper_32_bits(pfc):
    # vsock is not network-namespaced; socket() reads its family as an int.
    assert seccomp.DENIED_SOCKET_FAMILIES == ("AF_VSOCK",)
    sock = pfc.split('filter for syscall "socket"')[1].split("# filter")[0].split("# default action")[0]
    assert "$a0.hi32 & 0x00000000 == 0" in sock
    assert "$a0.lo32 & 0xffffffff == 40" in sock
