"""dsecd.native without root: error translation, hints, spec validation.

The calls made here fail in the calling thread before any clone (a missing
file, a bad fd) or need no privilege at all (openat2 on a tmp dir, probes), so
they run as any user and leave nothing behind.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

native = pytest.importorskip("dsecd.native", reason="dsecd._native is not built (pip install -e .)")

# ---------------------------------------------------------------- NativeError


def test_native_error_is_the_matching_oserror():
    err = native.native_error(errno.ENOENT, "exec", "ls", step="exec", path="/bin/ls")
    assert isinstance(err, native.NativeError)
    assert isinstance(err, FileNotFoundError) and isinstance(err, OSError)
    assert err.errno == errno.ENOENT
    assert (err.step, err.path) == ("exec", "/bin/ls")
    assert str(err) == "exec `ls`: No such file or directory"
    assert isinstance(native.native_error(errno.ESRCH, "x", "y"), ProcessLookupError)
    assert isinstance(native.native_error(errno.EPERM, "x", "y"), PermissionError)
    plain = native.native_error(errno.EINVAL, "x", "y")
    assert type(plain) is native.NativeError


@given(num=st.sampled_from(sorted(errno.errorcode)),
       step=st.sampled_from(sorted(native.STEPS.values())))
def test_every_step_and_errno_formats(num, step):
    err = native.native_error(num, "verb", "/some/path", step=step)
    text = str(err)
    assert text.startswith(f"verb `/some/path`: {os.strerror(num)}")
    hint = native.hint_for(step, num)
    assert text.endswith(f"; {hint}") if hint else text.endswith(os.strerror(num))
    assert isinstance(err, type(OSError(num, "")))


def test_every_c_step_has_a_verb():
    # STEPS comes from the C enum; a step added in C must be named here too.
    assert set(native.STEPS.values()) == set(native._VERBS)


# ---------------------------------------------------------------- hints


@pytest.mark.parametrize("step,num,words", [
    ("sched_core", errno.EINVAL, "CONFIG_SCHED_CORE"),
    ("sched_core", errno.ENODEV, "no SMT"),
    ("cgroup_join", errno.EBUSY, "subtree_control"),
    ("cgroup_join", errno.ENOSPC, "cpuset"),
    ("mount_tmp", errno.ENOSPC, "fs.mount-max"),
    ("mount_overlay", errno.ENOSPC, "fs.mount-max"),
    ("mount_overlay", errno.EINVAL, "one filesystem"),
    ("exec_interp", errno.ENOENT, "interpreter"),
    ("setns", errno.ESRCH, "PID 1 has exited"),
    ("openat2", errno.EXDEV, "leaves the root"),
    ("openat2", errno.ELOOP, "RESOLVE_NO_MAGICLINKS"),
    ("landlock", errno.EOPNOTSUPP, "lsm="),
])
def test_misleading_errnos_get_hints(step, num, words):
    assert words in native.hint_for(step, num)
    assert native.describe_errno(step, -num).startswith(os.strerror(num) + "; ")


def test_hint_depends_on_kind():
    assert "dying" in native.hint_for("clone", errno.ENOMEM, "exec")
    assert native.hint_for("clone", errno.ENOMEM, "container") is None
    assert native.hint_for("chdir_rootfs", errno.ENOSPC) is None  # not a mount step
    assert native.describe_errno("sched_core", 0) == os.strerror(0)


# ---------------------------------------------------------------- failures in C


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _children() -> int:
    """Our children, zombies included (never waitpid(-1): it could reap another's)."""
    me, count = os.getpid(), 0
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        count += bool(stat) and int(stat[stat.rindex(")") + 2:].split()[1]) == me
    return count


def _exec_spec(**kw) -> native.ExecSpec:
    base = dict(pidfd=0, cgroup_procs=[], argv=["true"], env=["PATH=/bin"], cwd="/", uid=0,
                gid=0, stdin_fd=0, stdout_fd=1, stderr_fd=2, cap_keep=0)
    base.update(kw)
    return native.ExecSpec(**base)


def test_spawn_exec_missing_cgroup_names_the_file(tmp_path):
    procs = str(tmp_path / "gone" / "cgroup.procs")
    before = _fds()
    with pytest.raises(FileNotFoundError) as info:
        native.spawn_exec(_exec_spec(cgroup_procs=[procs]))
    err = info.value
    assert (err.step, err.path) == ("open_cgroup", procs)
    assert str(err) == (f"open `{procs}`: No such file or directory; "
                        "the cgroup does not exist (not created yet, or removed)")
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOENT
    assert _fds() == before


def test_spawn_exec_with_a_non_pidfd_fails_at_setns(tmp_path):
    # The helper is cloned, setns() refuses the fd, the helper is reaped.
    with open(tmp_path / "f", "w") as f:
        fd, fds, children = f.fileno(), _fds(), _children()
        with pytest.raises(native.NativeError) as info:
            native.spawn_exec(_exec_spec(pidfd=f.fileno()))
        assert (_fds(), _children()) == (fds, children)  # helper reaped, nothing leaked
    assert info.value.step == "setns"
    assert str(info.value).startswith(f"enter namespaces of `pidfd {fd}`:")


def test_spawn_container_missing_init(tmp_path):
    spec = native.ContainerSpec(
        rootfs=str(tmp_path / "rootfs"), lowerdirs=[str(tmp_path / "l")],
        upperdir=str(tmp_path / "u"), workdir=str(tmp_path / "w"), hostname="h",
        init_path=str(tmp_path / "no-init"), cgroup_procs=[], tmp_size_bytes=1,
        shm_size_bytes=1)
    with pytest.raises(FileNotFoundError) as info:
        native.spawn_container(spec)
    assert info.value.step == "open_init"
    assert "pip install" in str(info.value)


def test_openat2_error_message(tmp_path):
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with pytest.raises(FileNotFoundError) as info:
            native.openat2(fd, "missing/file", os.O_RDONLY)
        assert str(info.value) == "open `missing/file`: No such file or directory"
        assert (info.value.step, info.value.path) == ("openat2", "missing/file")
        (tmp_path / "ok").write_text("x")
        new = native.openat2(fd, "ok", os.O_RDONLY)
        assert os.get_inheritable(new) is False  # always O_CLOEXEC
        os.close(new)
    finally:
        os.close(fd)


def test_pidfd_of_nobody():
    with pytest.raises(ProcessLookupError) as info:
        native.pidfd_open(2**22 + 1)  # above pid_max
    assert info.value.step == "pidfd_open"
    fd = native.pidfd_open(os.getpid())
    try:
        native.pidfd_send_signal(fd, 0)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- validation


def _container(**kw) -> native.ContainerSpec:
    base = dict(rootfs="/r", lowerdirs=["/l1", "/l2"], upperdir="/u", workdir="/w",
                hostname="box", init_path="/init", cgroup_procs=["/cg/cgroup.procs"],
                tmp_size_bytes=1 << 20, shm_size_bytes=1 << 20)
    base.update(kw)
    return native.ContainerSpec(**base)


def test_container_spec_overlay_options():
    assert _container().overlay_options() == \
        b"lowerdir=/l1:/l2,upperdir=/u,workdir=/w,redirect_dir=follow,metacopy=off"


@pytest.mark.parametrize("kw,words", [
    ({"rootfs": "relative"}, "absolute"),
    ({"lowerdirs": []}, "at least one layer"),
    ({"lowerdirs": ["/a,b"]}, "','"),
    ({"lowerdirs": ["/a:b"]}, "':'"),
    ({"upperdir": "/u\\x"}, "'\\\\'"),
    ({"workdir": "/w\0"}, "'\\x00'"),
    ({"lowerdirs": ["/" + "x" * 2000, "/" + "y" * 2000, "/" + "z" * 200]}, "of fewer layers"),
    ({"hostname": ""}, "1..64"),
    ({"hostname": "h" * 65}, "1..64"),
    ({"tmp_size_bytes": 0}, "positive"),
    ({"shm_size_bytes": -1}, "positive"),
    ({"cgroup_procs": ["/c"] * 17}, "at most 16"),
    ({"init_path": "dsec-init"}, "absolute"),
])
def test_container_spec_rejects(kw, words):
    with pytest.raises(ValueError) as info:
        _container(**kw)
    assert words in str(info.value)


@pytest.mark.parametrize("kw,words", [
    ({"argv": []}, "argv[0]"),
    ({"argv": [""]}, "argv[0]"),
    ({"argv": ["ls", "a\0b"]}, "NUL"),
    ({"env": ["NOEQUALS"]}, "K=V"),
    ({"env": ["=value"]}, "K=V"),
    ({"cwd": "tmp"}, "absolute"),
    ({"uid": -1}, "uid"),
    ({"gid": 2**32 - 1}, "gid"),
    ({"stdout_fd": -1}, "stdout_fd"),
    ({"pidfd": None}, "pidfd"),
    ({"cap_keep": -1}, "64-bit"),
    ({"cap_keep": 2**64}, "64-bit"),
])
def test_exec_spec_rejects(kw, words):
    with pytest.raises(ValueError) as info:
        _exec_spec(**kw)
    assert words in str(info.value)


def test_exec_spec_accepts_the_ordinary():
    spec = _exec_spec(argv=["sh", "-c", "echo é"], env=["A=", "B=1=2"], uid=65534, gid=65534,
                      cap_keep=(1 << 41) - 1)
    assert spec.argv[0] == "sh"


# ---------------------------------------------------------------- probes, init


def test_probes_return_codes_without_raising(tmp_path):
    for probe in (native.probe_sched_core, native.probe_seccomp, native.probe_openat2,
                  native.probe_pidfd, native.probe_clone3):
        code = probe()
        assert isinstance(code, int) and code >= 0
    assert native.probe_openat2() == 0 and native.probe_pidfd() == 0  # the tests rely on both
    abi = native.probe_landlock_abi()
    assert abi >= 1 or abi < 0
    assert native.probe_bpf_cgroup(str(tmp_path)) > 0  # not a cgroup v2 dir
    kvm = native.probe_kvm()
    assert {"api", "open", "create_vm", "create_vcpu", "detail"} <= set(kvm)
    if kvm["create_vcpu"] == 0:      # a vCPU exists: the one-instruction guest was run too
        assert isinstance(kvm["run"], int) and (kvm["run"] == 0 or "run_detail" in kvm)
    assert kvm["api"] is None or kvm["api"] >= 12


def test_init_binary_is_installed_and_static():
    path = Path(native.init_binary_path())
    data = path.read_bytes()
    assert data[:5] == b"\x7fELF\x02"  # ELF64
    phoff = int.from_bytes(data[0x20:0x28], "little")
    phentsize = int.from_bytes(data[0x36:0x38], "little")
    phnum = int.from_bytes(data[0x38:0x3A], "little")
    types = [int.from_bytes(data[phoff + i * phentsize:][:4], "little") for i in range(phnum)]
    assert 3 not in types  # no PT_INTERP: needs no ld.so, runs in any rootfs


def test_kill_uid_in_refuses_root_and_a_bad_pidfd():
    """kill(-1) as root would reach every process of the namespace: refused.
    A uid no process has: nothing to kill, no error, and this thread's ids
    untouched (the kill runs in a process of its own)."""
    import errno as errno_mod
    import os

    import pytest

    from dsecd import native

    if os.geteuid() != 0:
        pytest.skip("enters a pid namespace and takes a uid: needs root")
    pidfd = os.pidfd_open(os.getpid())
    try:
        with pytest.raises(OSError) as exc:
            native.kill_uid_in(pidfd, 0)
        assert exc.value.errno == errno_mod.EINVAL
        native.kill_uid_in(pidfd, 4_000_000_000)            # no process has it
        assert os.getresuid() == (0, 0, 0)
    finally:
        os.close(pidfd)
    with pytest.raises(OSError) as exc:
        native.kill_uid_in(-1, 60000)                       # no pidfd
    assert exc.value.errno == errno_mod.EBADF
