"""dsecd.native against the real kernel: container sandboxes on a busybox rootfs.

Needs root (namespaces, mounts, cgroups). Every test gets its own cgroups
(/sys/fs/cgroup/<ctrl>/dsecd-test-<random>/), its own tmp dir and its own
sandbox; finalizers kill only the processes the test started (by pidfd), reap
them, remove only the cgroups the test made and delete the tmp dirs, also when
the test fails. The overlay lives in the sandbox's mount namespace only, so
it goes away with the sandbox; nothing is mounted on the host.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

native = pytest.importorskip("dsecd.native", reason="dsecd._native is not built (pip install -e .)")

BUSYBOX = "/bin/busybox"
NAMESPACES = ("mnt", "pid", "uts", "ipc", "net", "cgroup")
V1_CONTROLLERS = ("pids", "memory", "cpu")
CAP_NET_BIND_SERVICE = 10


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: creates namespaces, mounts and cgroups"
    if not os.access(BUSYBOX, os.X_OK):
        return f"{BUSYBOX} missing (apt-get install busybox-static)"
    if native.probe_pidfd() != 0:
        return "kernel has no pidfd_open"
    return None


pytestmark = [pytest.mark.root, pytest.mark.skipif(_skip_reason() is not None,
                                                   reason=str(_skip_reason()))]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _sigterm_runs_finalizers():
    """`timeout` ends a run with SIGTERM, which skips finalizers; as a
    KeyboardInterrupt it does not, so sandboxes and cgroups still go away."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


def _reap(pid: int, timeout: float = 10.0) -> int:
    """waitpid, but fail instead of hanging the run if the process never exits."""
    fd = os.pidfd_open(pid)
    try:
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError(f"pid {pid} did not exit within {timeout} s")
    finally:
        os.close(fd)
    return os.waitpid(pid, 0)[1]


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.01)


def _rmdir_retry(path: Path, timeout: float = 5.0) -> None:
    """A cgroup stays busy until its last process is fully released."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _cgroup_dirs(name: str) -> list[Path]:
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():  # pure cgroup v2 host
        return [root / name]
    return [root / c / name for c in V1_CONTROLLERS if (root / c / "cgroup.procs").exists()]


@pytest.fixture(scope="module")
def busybox_lower():
    """A read-only lower layer: bin/busybox plus a symlink per applet."""
    top = Path(tempfile.mkdtemp(prefix="dsecd-test-lower-"))
    try:
        top.chmod(0o755)  # the sandbox's "/": mkdtemp's 0700 would lock out non-root uids
        (top / "bin").mkdir()
        shutil.copy2(BUSYBOX, top / "bin" / "busybox")
        applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True,
                                 check=True).stdout.split()
        for applet in applets:
            if applet != "busybox":
                (top / "bin" / applet).symlink_to("busybox")
        (top / "etc").mkdir()
        (top / "etc" / "hostname").write_text("image\n")
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def workdir():
    top = Path(tempfile.mkdtemp(prefix="dsecd-test-"))
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def cgroups():
    """Fresh cgroups of this test; removed even if the test fails."""
    name = f"dsecd-test-{secrets.token_hex(4)}"
    dirs = _cgroup_dirs(name)
    made: list[Path] = []
    try:
        for d in dirs:
            d.mkdir()
            made.append(d)
        yield made
    finally:
        for d in reversed(made):
            _rmdir_retry(d)


@dataclass
class Sandbox:
    """A live sandbox and everything a test started in it."""

    pid: int
    pidfd: int
    cgroups: list[Path]
    dir: Path
    hostname: str
    children: list[int] = field(default_factory=list)

    @property
    def procs(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.cgroups]

    def spec(self, argv: list[str], **kw) -> native.ExecSpec:
        fds = kw.pop("fds", (0, 1, 2))
        base = dict(pidfd=self.pidfd, cgroup_procs=self.procs, argv=argv,
                    env=["PATH=/bin", "HOME=/"], cwd="/", uid=0, gid=0, stdin_fd=fds[0],
                    stdout_fd=fds[1], stderr_fd=fds[2], cap_keep=0)
        base.update(kw)
        return native.ExecSpec(**base)

    def spawn(self, argv: list[str], **kw) -> int:
        pid = native.spawn_exec(self.spec(argv, **kw))
        self.children.append(pid)
        return pid

    def wait(self, pid: int) -> int:
        status = _reap(pid)
        self.children.remove(pid)
        return status

    def run(self, argv: list[str], **kw) -> tuple[int, str]:
        """Run to completion; (exit code or -signal, stdout+stderr)."""
        with open(os.devnull, "rb") as stdin, tempfile.TemporaryFile() as out:
            pid = self.spawn(argv, fds=(stdin.fileno(), out.fileno(), out.fileno()), **kw)
            status = self.wait(pid)
            out.seek(0)
            text = out.read().decode()
        code = os.waitstatus_to_exitcode(status)
        return code, text

    def sh(self, script: str, **kw) -> str:
        code, text = self.run(["sh", "-c", script], **kw)
        assert code == 0, f"{script!r} exited {code}: {text}"
        return text


def _make_sandbox(lower: Path, top: Path, cgroups: list[Path], hostname: str = "sbx-test", **spec_kw):
    for sub in ("upper", "work", "rootfs"):
        (top / sub).mkdir()
    spec = native.ContainerSpec(
        rootfs=str(top / "rootfs"), lowerdirs=[str(lower)], upperdir=str(top / "upper"),
        workdir=str(top / "work"), hostname=hostname, init_path=native.init_binary_path(),
        cgroup_procs=[str(d / "cgroup.procs") for d in cgroups], tmp_size_bytes=64 << 20,
        shm_size_bytes=16 << 20, **spec_kw)
    return _make_sandbox_spec(spec, top, cgroups)


def _make_sandbox_spec(spec: native.ContainerSpec, top: Path, cgroups: list[Path]) -> Sandbox:
    pid = native.spawn_container(spec)
    try:
        pidfd = native.pidfd_open(pid)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return Sandbox(pid, pidfd, cgroups, top, spec.hostname)


def _destroy(sb: Sandbox) -> None:
    """SIGKILL to a pid namespace's init kills all of it. Reap the exec'd
    processes first: a dying PID 1 cannot be reaped before every process of
    its namespace is, and those are our children (CLONE_PARENT)."""
    try:
        native.pidfd_send_signal(sb.pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in [*sb.children, sb.pid]:
        if pid <= 0:  # already reaped by the test
            continue
        try:
            _reap(pid)
        except (ChildProcessError, ProcessLookupError):
            pass
    os.close(sb.pidfd)


@pytest.fixture
def sandbox(busybox_lower, workdir, cgroups):
    sb = _make_sandbox(busybox_lower, workdir, cgroups)
    try:
        yield sb
    finally:
        _destroy(sb)


def _zombie_children_of(ppid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z" and int(fields[1]) == ppid:
            found.append(int(entry))
    return found


# ---------------------------------------------------------------- container


def test_namespaces_differ_from_host(sandbox):
    pid = sandbox.spawn(["sleep", "30"])
    for ns in NAMESPACES:
        host = os.readlink(f"/proc/self/ns/{ns}")
        init = os.readlink(f"/proc/{sandbox.pid}/ns/{ns}")
        assert init != host, ns
        assert os.readlink(f"/proc/{pid}/ns/{ns}") == init, f"exec not in the sandbox's {ns} ns"


def test_pid1_is_dsec_init(sandbox):
    assert sandbox.sh("cat /proc/1/cmdline") == "dsec-init\0"
    assert sandbox.sh("cat /proc/1/comm") == "dsec-init\n"
    host_exe = os.readlink(f"/proc/{sandbox.pid}/exe")
    assert host_exe == str(Path(native.init_binary_path()).resolve())


def test_init_has_no_capabilities_and_no_new_privs(sandbox):
    status = Path(f"/proc/{sandbox.pid}/status").read_text()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, cap
    assert fields["NoNewPrivs"].strip() == "1"


def test_hostname(sandbox):
    assert sandbox.sh("hostname") == f"{sandbox.hostname}\n"
    assert os.uname().nodename != sandbox.hostname


def test_proc_shows_the_sandbox_pid_namespace(sandbox):
    out = sandbox.sh("echo $$; ls /proc | grep -E '^[0-9]+$' | sort -n")
    own, *pids = [int(x) for x in out.split()]
    assert 1 < own < 100
    assert pids[0] == 1 and set(pids) <= {1, *range(own, own + 10)}
    assert "proc /proc proc" in sandbox.sh("cat /proc/mounts")


def test_proc_sysctls_read_only_for_sandbox_root(sandbox):
    code, text = sandbox.run(["sh", "-c", "echo 1 > /proc/sys/kernel/ns_last_pid"])
    assert code != 0 and "Read-only file system" in text
    assert sandbox.sh("cat /proc/sys/kernel/ostype") == "Linux\n"  # reading still works


def test_dev_nodes(sandbox):
    names = set(sandbox.sh("ls -a /dev").split()) - {".", ".."}
    assert names == {"null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx", "shm",
                     "fd", "stdin", "stdout", "stderr"}
    sandbox.sh("for n in null zero full random urandom tty; do test -c /dev/$n; done")
    assert sandbox.sh("readlink /dev/ptmx; readlink /dev/fd") == "pts/ptmx\n/proc/self/fd\n"
    assert sandbox.sh("head -c 5 /dev/zero | wc -c").strip() == "5"
    assert sandbox.sh("head -c 16 /dev/urandom | wc -c").strip() == "16"
    code, text = sandbox.run(["sh", "-c", "echo x > /dev/full"])
    assert code != 0 and "No space left on device" in text
    mounts = sandbox.sh("cat /proc/mounts")
    assert "devpts /dev/pts devpts" in mounts and "tmpfs /dev/shm tmpfs" in mounts


def test_tmp_is_a_private_tmpfs(sandbox):
    assert sandbox.sh("stat -c %a /tmp") == "1777\n"
    line = next(m for m in sandbox.sh("cat /proc/mounts").splitlines() if " /tmp " in m)
    size_k = ((64 << 20) + (16 << 20)) >> 10      # tmp + shm: one tmpfs for both
    assert line.startswith("tmpfs /tmp tmpfs") and f"size={size_k}k" in line, line
    sandbox.sh("echo hi > /tmp/x")
    assert not (sandbox.dir / "upper" / "tmp" / "x").exists()


def test_dev_shm_tmp_and_proc_masks_share_one_tmpfs_whose_root_is_nowhere(sandbox):
    """One superblock per sandbox for all four, not four (each one slows every memory cgroup
    removal on the host: docs/burst.md, "A destroy"), and the scratch's own root is not mounted
    anywhere in the sandbox: each place sees only its own dir of it."""
    _check_scratch_layout(sandbox)


def _check_scratch_layout(sandbox) -> None:
    fields = [line.split() for line in sandbox.sh("cat /proc/self/mountinfo").splitlines()]
    by_point = {f[4]: f for f in fields}
    scratch = by_point["/tmp"][2]             # major:minor of the scratch tmpfs
    on_scratch = {f[4]: f[3] for f in fields if f[2] == scratch}     # mount point -> root in it
    masked = {f"/proc/{d}": "/empty" for d in ("acpi", "scsi", "asound") if os.path.isdir(f"/proc/{d}")}
    assert on_scratch == {"/dev": "/dev", "/dev/shm": "/shm", "/tmp": "/tmp", **masked}, on_scratch
    assert sandbox.sh("stat -c %a /dev /dev/shm /tmp") == "755\n1777\n1777\n"
    # Neighbours: what lands in one dir shows in no other; a mask is empty and read-only.
    sandbox.sh("echo a > /tmp/t && echo b > /dev/shm/s")
    assert sandbox.sh("ls -A /tmp; echo -; ls -A /dev/shm") == "t\n-\ns\n"
    opts = {f[4]: set(f[5].split(",")) for f in fields}
    for point in masked:
        assert sandbox.sh(f"ls -A {point}") == ""
        code, text = sandbox.run(["sh", "-c", f"touch {point}/x"])
        assert code != 0 and "Read-only file system" in text, (point, code, text)
        assert {"ro", "nosuid", "nodev", "noexec"} <= opts[point], (point, opts[point])
    # /dev stays noexec, /tmp and /dev/shm do not (as before: only nosuid,nodev).
    assert {"rw", "nosuid", "nodev", "noexec"} <= opts["/dev"]
    for point in ("/tmp", "/dev/shm"):
        assert {"rw", "nosuid", "nodev"} <= opts[point] and "noexec" not in opts[point], (point, opts[point])


def test_loopback_is_up(sandbox):
    out = sandbox.sh("ip -o link show lo")
    assert "UP" in out.split("<", 1)[1].split(">", 1)[0].split(",")
    assert sandbox.sh("ip -o link | wc -l").strip() == "1"  # no host interfaces


def test_overlay_is_invisible_to_the_host(sandbox):
    sandbox.sh("echo data > /written")
    assert (sandbox.dir / "upper" / "written").read_text() == "data\n"
    assert not (sandbox.dir / "rootfs" / "written").exists()
    assert str(sandbox.dir) not in Path("/proc/self/mountinfo").read_text()


def test_sigterm_to_init_ends_the_sandbox(sandbox):
    sleeper = sandbox.spawn(["sleep", "100"])
    native.pidfd_send_signal(sandbox.pidfd, signal.SIGTERM)
    # The kernel kills the rest of the namespace; reap it before init (see _destroy).
    assert os.waitstatus_to_exitcode(sandbox.wait(sleeper)) == -signal.SIGKILL
    assert os.waitstatus_to_exitcode(_reap(sandbox.pid)) == 0
    sandbox.pid = -1  # reaped here


def test_zombies_are_reaped_by_init(sandbox):
    # The subshell exits at once, so its `sleep` is orphaned to the sandbox's PID 1.
    # 2 s: on a loaded host a shorter one was gone before it was looked for.
    sandbox.sh("(sleep 2 &) ; true")
    # Re-parented at once, but it may not have exec'd `sleep` yet (comm still "sh").
    deadline = time.monotonic() + 1.5
    while not (orphans := [p for p in _children_of(sandbox.pid) if _comm(p) == "sleep"]) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert orphans, "the orphan was not re-parented to dsec-init"
    for pid in orphans:
        _wait_gone(pid)
        assert not os.path.exists(f"/proc/{pid}"), "orphan left as a zombie"
    assert _zombie_children_of(sandbox.pid) == []


def _children_of(ppid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == ppid]


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_container_failure_names_the_step(busybox_lower, workdir, cgroups):
    for sub in ("upper", "work", "rootfs"):
        (workdir / sub).mkdir()
    missing = workdir / "no-such-layer"
    spec = native.ContainerSpec(
        rootfs=str(workdir / "rootfs"), lowerdirs=[str(missing), str(busybox_lower)],
        upperdir=str(workdir / "upper"), workdir=str(workdir / "work"), hostname="x",
        init_path=native.init_binary_path(), cgroup_procs=[str(d / "cgroup.procs") for d in cgroups],
        tmp_size_bytes=1 << 20, shm_size_bytes=1 << 20)
    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(native.NativeError) as info:
        native.spawn_container(spec)
    err = info.value
    assert err.step == "mount_overlay" and err.errno == errno.ENOENT
    assert str(err).startswith(f"mount overlay on `{workdir / 'rootfs'}`: No such file")
    assert "lowerdir" in str(err)
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert _zombie_children_of(os.getpid()) == []  # the failed child was reaped


def test_container_refuses_symlinked_mount_point(busybox_lower, workdir, cgroups):
    # An image whose /dev is a symlink to a host path must not redirect the mount.
    layer = workdir / "evil-layer"
    layer.mkdir()
    (layer / "dev").symlink_to("/")
    for sub in ("upper", "work", "rootfs"):
        (workdir / sub).mkdir()
    spec = native.ContainerSpec(
        rootfs=str(workdir / "rootfs"), lowerdirs=[str(layer), str(busybox_lower)],
        upperdir=str(workdir / "upper"), workdir=str(workdir / "work"), hostname="x",
        init_path=native.init_binary_path(), cgroup_procs=[], tmp_size_bytes=1 << 20,
        shm_size_bytes=1 << 20)
    with pytest.raises(NotADirectoryError) as info:
        native.spawn_container(spec)
    assert info.value.step == "mkdir" and info.value.path == "dev"


# ---------------------------------------------------------------- exec


def test_exec_runs_as_uid_in_the_sandbox_cgroups(sandbox):
    assert sandbox.sh("id -u; id -g; id -G", uid=1000, gid=1001) == "1000\n1001\n1001\n"
    pid = sandbox.spawn(["sleep", "30"], uid=1000, gid=1001)
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for d in sandbox.cgroups:
        assert any(line.endswith(f"/{d.name}") for line in lines), (d, lines)
    # Inside, the cgroup namespace is rooted at the sandbox's own cgroup.
    assert all(line.endswith(":/") for line in sandbox.sh("cat /proc/self/cgroup").splitlines())


def test_exec_is_session_leader_and_our_child(sandbox):
    pid = sandbox.spawn(["sleep", "30"])
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid
    assert _ppid(pid) == os.getpid()  # CLONE_PARENT: the daemon reaps it
    assert sandbox.sh("cat /proc/self/stat").split()[5] != "0"  # has a session id
    os.kill(pid, signal.SIGKILL)
    assert os.waitstatus_to_exitcode(sandbox.wait(pid)) == -signal.SIGKILL


def test_exec_capabilities(sandbox):
    def caps(**kw) -> dict[str, int]:
        out = sandbox.sh("grep -E '^(Cap|NoNewPrivs)' /proc/self/status", **kw)
        return {k: int(v, 16) for k, v in (line.split(":\t") for line in out.splitlines())}

    root = caps()
    assert root["CapEff"] == root["CapBnd"] == root["CapPrm"] == 0 and root["NoNewPrivs"] == 1
    keep = 1 << CAP_NET_BIND_SERVICE
    user = caps(uid=1000, gid=1000, cap_keep=keep)
    assert user["CapEff"] == user["CapPrm"] == user["CapAmb"] == user["CapBnd"] == keep


def test_exec_gets_default_signals_and_only_stdio(sandbox):
    # Python ignores SIGPIPE; that must not leak into the sandbox.
    code, out = sandbox.run(["grep", "-E", "^Sig(Ign|Blk|Cgt)", "/proc/self/status"])
    assert code == 0 and all(int(line.split()[1], 16) == 0 for line in out.splitlines()), out
    leak = os.open("/dev/null", os.O_RDONLY)  # inheritable on purpose
    os.set_inheritable(leak, True)
    # And one far above the fds a spawn uses, where dsecd/fds.py parks the
    # daemon's long-lived ones: the child's table never holds it at all.
    high = fcntl.fcntl(leak, fcntl.F_DUPFD, 900)
    os.set_inheritable(high, True)
    try:
        code, out = sandbox.run(["ls", "/proc/self/fd"])
        fds = out.split()
    finally:
        os.close(leak)
        os.close(high)
    assert set(fds) <= {"0", "1", "2", "3"}  # 3 is ls's own directory fd


def test_container_init_holds_only_stdio(busybox_lower, workdir, cgroups):
    # Inheritable fds of the daemon, low and parked high (dsecd/fds.py), while
    # a container is spawned: its PID 1 holds /dev/null on 0-2 and nothing else.
    low = os.open("/dev/null", os.O_RDONLY)
    high = fcntl.fcntl(low, fcntl.F_DUPFD, 900)
    for fd in (low, high):
        os.set_inheritable(fd, True)
    try:
        sb = _make_sandbox(busybox_lower, workdir, cgroups)
    finally:
        os.close(low)
        os.close(high)
    try:
        # Until it exec'd dsec-init (which names itself so) the child may still
        # be closing what it inherited: only init's own fds count.
        deadline = time.monotonic() + 5
        while _comm(sb.pid) != "dsec-init" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(os.listdir(f"/proc/{sb.pid}/fd"), key=int) == ["0", "1", "2"]
    finally:
        _destroy(sb)


def test_root_namespace_gives_the_overlay_as_root_and_nothing_above(busybox_lower, workdir, cgroups):
    # What the daemon gives every sandbox (dsecd/backends/container.py): a
    # copy of the root namespace (native.root_ns: a read-only tmpfs with six
    # device nodes) with the overlay on its "/", chroot'ed into. The other
    # tests here spawn without one (the pivot_root fallback).
    ns = native.root_ns(str(workdir))
    try:
        sb = _make_sandbox(busybox_lower, workdir, cgroups, root_ns_fd=ns)
    finally:
        os.close(ns)                 # each sandbox holds its own copy
    try:
        # The exec helper's setns lands on the overlay (the mounts stacked on
        # the namespace's root are followed), as init's chroot did.
        first = sb.sh("cat /proc/self/mountinfo").splitlines()[0].split()
        assert first[4] == "/" and first[first.index("-") + 1] == "overlay"
        assert "busybox" in sb.sh("ls /bin")
        # Nothing above the root: init's root is the overlay, and the root
        # namespace's tmpfs shows in no mount table the sandbox can read.
        assert "tmpfs ro" not in sb.sh("cat /proc/1/mountinfo 2>/dev/null; cat /proc/self/mountinfo")
        # The scratch's root, parked under the overlay (never unmounted:
        # csrc/spawn.c scratch_park), is nowhere the sandbox can see.
        _check_scratch_layout(sb)
    finally:
        _destroy(sb)


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return sorted(line.split()[4] for line in f if line.split()[4].startswith(str(path)))


def test_parked_layer_clones_propagate_nothing_from_a_shared_state_dir(busybox_lower, workdir, cgroups):
    """As the daemon spawns (an id-mapped sandbox in a copy of the root
    namespace, its layer clones parked under the overlay), with the layers on
    a shared mount, as / is under systemd: the sandbox's mounts stay in its
    own namespace. A clone that kept the layer mount's peer group made the
    host's layer mount show the sandbox's merged root (and every mount of
    the sandbox stay on the host after it ended), and the next create of the
    same image failed to idmap the layer."""
    from dsecd import userns
    from dsecd.backends.container import _IdmappedLayers

    shared = workdir / "shared"
    shared.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(shared)], check=True)
    try:
        subprocess.run(["mount", "--make-shared", str(shared)], check=True)
        layer = shared / "layer"
        layer.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(layer)],   # an EROFS layer's stand-in
                       check=True)
        shutil.copytree(busybox_lower, layer, symlinks=True, dirs_exist_ok=True)
        before, listing = _mounts_under(shared), sorted(os.listdir(layer))
        ns = native.root_ns(str(workdir))
        idmap = userns.IdMap(slot=0, uid=2_000_000_000, gid=2_000_000_000, count=65536)
        try:
            for i in range(2):                          # the second needs the layer as it was
                top = workdir / f"sb{i}"
                for sub in ("upper", "work", "rootfs"):
                    (top / sub).mkdir(parents=True)
                with _IdmappedLayers(idmap, [str(layer)], top / "upper", top / "work") as layers:
                    sb = _make_sandbox_spec(native.ContainerSpec(
                        rootfs=str(top / "rootfs"), lowerdirs=layers.lowerdirs, upperdir=layers.upperdir,
                        workdir=layers.workdir, hostname=f"sb{i}", init_path=native.init_binary_path(),
                        cgroup_procs=[str(d / "cgroup.procs") for d in cgroups], tmp_size_bytes=1 << 20,
                        shm_size_bytes=1 << 20, userns_fd=layers.userns_fd, userns_uid=idmap.uid, userns_gid=idmap.gid,
                        root_ns_fd=ns, park_fds=layers.clone_fds), top, cgroups)
                try:
                    assert "busybox" in sb.sh("ls /bin")        # neighbour: the sandbox works
                    assert _mounts_under(shared) == before
                    assert sorted(os.listdir(layer)) == listing
                    assert sorted(os.listdir(top)) == ["rootfs", "upper", "work"]
                finally:
                    _destroy(sb)
                assert _mounts_under(shared) == before
        finally:
            os.close(ns)
    finally:
        subprocess.run(["umount", "-R", str(shared)], check=False)


def test_exec_missing_program_raises_enoent(sandbox):
    with pytest.raises(FileNotFoundError) as info:
        sandbox.spawn(["no-such-program", "x"])
    err = info.value
    assert isinstance(err, native.NativeError) and err.step == "exec"
    assert str(err) == ("exec `no-such-program`: No such file or directory; "
                        "not found in PATH=/bin inside the sandbox")
    with pytest.raises(FileNotFoundError) as info:
        sandbox.spawn(["/bin/no-such-program"])
    assert info.value.step == "exec" and info.value.path == "/bin/no-such-program"
    assert _zombie_children_of(os.getpid()) == []


def test_exec_missing_interpreter_is_told_apart(sandbox):
    sandbox.sh("printf '#!/no/such/interp\\n' > /tmp/script; chmod +x /tmp/script")
    with pytest.raises(FileNotFoundError) as info:
        sandbox.spawn(["/tmp/script"])
    assert info.value.step == "exec_interp"
    assert "#! interpreter is missing" in str(info.value)
    with pytest.raises(FileNotFoundError) as info:  # the same, found through PATH
        sandbox.spawn(["script"], env=["PATH=/nonexistent:/tmp:/bin"])
    assert (info.value.step, info.value.path) == ("exec_interp", "/tmp/script")


def test_exec_bad_cwd_and_permission(sandbox):
    with pytest.raises(FileNotFoundError) as info:
        sandbox.spawn(["true"], cwd="/no/such/dir")
    assert info.value.step == "chdir" and info.value.path == "/no/such/dir"
    sandbox.sh("mkdir /private && chmod 700 /private")
    with pytest.raises(PermissionError) as info:
        sandbox.spawn(["true"], cwd="/private", uid=1000, gid=1000)
    assert info.value.step == "chdir"
    assert sandbox.run(["true"], cwd="/private")[0] == 0  # root may (DAC owner)


def test_exec_into_a_dead_sandbox(sandbox):
    native.pidfd_send_signal(sandbox.pidfd, signal.SIGKILL)
    _reap(sandbox.pid)
    sandbox.pid = -1
    with pytest.raises(ProcessLookupError) as info:
        sandbox.spawn(["true"])
    assert info.value.step == "setns" and "PID 1 has exited" in str(info.value)


def test_exec_from_many_threads_leaks_nothing(sandbox):
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def maps() -> int:
        return len(Path("/proc/self/maps").read_text().splitlines())

    errors: list[BaseException] = []

    def worker():
        try:
            for _ in range(15):
                with open(os.devnull, "rb") as null:
                    spec = sandbox.spec(["true"], fds=(null.fileno(),) * 3)
                    status = _reap(native.spawn_exec(spec))
                assert os.waitstatus_to_exitcode(status) == 0
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def round_of_threads():
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []

    round_of_threads()  # warms glibc's cache of thread stacks
    fds_before, maps_before = fds(), maps()
    # Each thread keeps its two clone stacks (4 mappings with their guard
    # pages) until it exits: a leak would add 32 mappings a round. Where
    # glibc's cached thread stacks land moves from round to round, and with
    # it which freed neighbours merge: the count moves by a few.
    for _ in range(3):
        round_of_threads()
        assert fds() == fds_before
        assert maps() <= maps_before + 8  # 120 spawns a round, their stacks unmapped with their threads


# ---------------------------------------------------------------- openat2


@pytest.fixture
def tree(workdir):
    """A fake sandbox root with traps pointing out of it."""
    root = workdir / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("inside\n")
    (root / "abs").symlink_to("/etc/passwd")
    (root / "rel").symlink_to("../../../../../../etc/passwd")
    (root / "loop1").symlink_to("loop2")
    (root / "loop2").symlink_to("loop1")
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    yield root, fd
    os.close(fd)


def _read(dirfd: int, path: str, **kw) -> str:
    fd = native.openat2(dirfd, path, os.O_RDONLY, **kw)
    try:
        assert os.get_inheritable(fd) is False
        return os.read(fd, 100).decode()
    finally:
        os.close(fd)


def test_openat2_in_root_cannot_escape(tree):
    root, fd = tree
    assert Path("/etc/passwd").read_text() != "inside\n"
    assert _read(fd, "etc/passwd") == "inside\n"  # the allowed neighbour
    assert _read(fd, "../../../../etc/passwd") == "inside\n"  # `..` stops at the root
    assert _read(fd, "/etc/passwd") == "inside\n"
    assert _read(fd, "abs") == "inside\n"  # absolute symlink resolved in the root
    assert _read(fd, "rel") == "inside\n"
    (root / "etc" / "passwd").unlink()
    for path in ("abs", "rel", "../../etc/passwd"):
        with pytest.raises(FileNotFoundError):
            _read(fd, path)  # and never falls back to the host's file


def test_openat2_symlink_loops_and_strict_modes(tree):
    _, fd = tree
    with pytest.raises(native.NativeError) as info:
        _read(fd, "loop1")
    assert info.value.errno == errno.ELOOP and str(info.value).startswith("open `loop1`:")
    with pytest.raises(native.NativeError) as info:
        _read(fd, "../etc/passwd", resolve=native.RESOLVE_BENEATH)
    assert info.value.errno == errno.EXDEV and "leaves the root" in str(info.value)
    with pytest.raises(native.NativeError) as info:
        _read(fd, "abs", resolve=native.RESOLVE_IN_ROOT | native.RESOLVE_NO_SYMLINKS)
    assert info.value.errno == errno.ELOOP
    assert _read(fd, "etc/passwd", resolve=native.RESOLVE_BENEATH) == "inside\n"


def test_openat2_refuses_magic_links():
    proc = os.open(f"/proc/{os.getpid()}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with pytest.raises(native.NativeError) as info:
            _read(proc, "root/etc/hostname", resolve=native.RESOLVE_NO_MAGICLINKS)
        assert info.value.errno == errno.ELOOP
        assert _read(proc, "comm", resolve=native.RESOLVE_NO_MAGICLINKS)  # a plain file
    finally:
        os.close(proc)


def test_openat2_on_a_live_sandbox_root(sandbox):
    sandbox.sh("ln -s /../../../../etc/hostname /tmp/evil; ln -s /proc/1/root /tmp/magic")
    root = os.open(f"/proc/{sandbox.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        assert _read(root, "etc/hostname") == "image\n"
        assert _read(root, "tmp/evil") == "image\n"  # the sandbox's file, not the host's
        with pytest.raises(native.NativeError) as info:
            _read(root, "tmp/magic/etc/hostname")
        assert info.value.errno == errno.ELOOP
    finally:
        os.close(root)


# ---------------------------------------------------------------- probes


def test_probe_bpf_cgroup_on_own_v2_dir():
    unified = Path("/sys/fs/cgroup/unified")
    if not (unified / "cgroup.procs").exists():
        unified = Path("/sys/fs/cgroup")
    if not (unified / "cgroup.controllers").exists():
        pytest.skip("no cgroup v2 hierarchy mounted")
    d = unified / f"dsecd-test-{secrets.token_hex(4)}"
    d.mkdir()
    try:
        rc = native.probe_bpf_cgroup(str(d))
        assert rc == 0, native.describe_errno("bpf_cgroup", rc)
        assert native.probe_bpf_cgroup("/tmp") != 0  # not a cgroup: an errno, no raise
    finally:
        _rmdir_retry(d)


# ---------------------------------------------------------------- CPU QoS (dsecd/cpu)


def _policy(stat_line: str) -> int:
    """Field 41 of /proc/PID/stat: the scheduling policy (5 = SCHED_IDLE)."""
    return int(stat_line[stat_line.rindex(")") + 2:].split()[38])


def test_exec_sched_idle_reaches_the_child_and_its_children(sandbox):
    script = "cat /proc/$$/stat; cat /proc/self/stat"
    own, child = sandbox.sh(script, sched_idle=True).splitlines()
    assert (_policy(own), _policy(child)) == (os.SCHED_IDLE, os.SCHED_IDLE)
    own, child = sandbox.sh(script).splitlines()
    assert (_policy(own), _policy(child)) == (os.SCHED_OTHER, os.SCHED_OTHER)


def test_container_init_sched_idle(busybox_lower, workdir, cgroups):
    sb = _make_sandbox(busybox_lower, workdir, cgroups, sched_idle=True)
    try:
        assert os.sched_getscheduler(sb.pid) == os.SCHED_IDLE
    finally:
        _destroy(sb)


def test_core_sched_follows_the_kernel(sandbox, busybox_lower, tmp_path, cgroups):
    """With core scheduling, an exec shares PID 1's cookie; without it (this
    CI kernel: EINVAL), the exec fails at step sched_core with the hint and
    leaves no child behind, and so does a container create."""
    probe = native.probe_sched_core()
    if probe == 0:
        assert sandbox.sh("true", core_sched=True) == ""
        return
    children = len(_zombie_children_of(os.getpid()))
    with pytest.raises(native.NativeError) as info:
        sandbox.spawn(["true"], core_sched=True)
    err = info.value
    assert (err.errno, err.step) == (probe, "sched_core")
    assert native.hint_for("sched_core", probe) in str(err)
    with pytest.raises(native.NativeError) as info:
        _make_sandbox(busybox_lower, tmp_path, cgroups, hostname="sbx-core", core_sched=True)
    assert (info.value.errno, info.value.step) == (probe, "sched_core")
    assert len(_zombie_children_of(os.getpid())) == children


# ---------------------------------------------------------------- userns holder

_HOLDER_MAKER = """
import os, sys
from dsecd import native
os.open(sys.argv[1], os.O_RDONLY)      # stands for the daemon's state-dir lock
print("ready", flush=True)
while True:
    os.close(native.userns_create(1500000000, 1500000000, 65536))
"""


def _holding(path: str) -> list[int]:
    """Pids of processes with `path` open."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd")):
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_a_userns_holder_dies_with_the_process_that_made_it(tmp_path):
    """dsec_userns_create's holder shares its maker's memory and fd table
    (csrc/userns.c). A maker killed between the holder's clone and its kill
    (a daemon's kill -9 mid-create) must not leave the holder behind with all
    its fds: a daemon's would keep the state dir locked and its socket open
    for good. Makers that create namespaces back to back are killed at random
    moments, most of them inside that window."""
    marker = str(tmp_path / "lock")
    Path(marker).write_text("")
    rng = __import__("random").Random(11)
    try:
        for _ in range(30):
            maker = subprocess.Popen([sys.executable, "-c", _HOLDER_MAKER, marker], stdout=subprocess.PIPE)
            try:
                assert maker.stdout.readline() == b"ready\n"
                time.sleep(rng.uniform(0.002, 0.03))
            finally:
                maker.kill()
                maker.wait()
                maker.stdout.close()
        deadline = time.monotonic() + 2
        while _holding(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _holding(marker) == []
    finally:
        for pid in _holding(marker):      # leaked holders: ours, found by our own file
            os.kill(pid, signal.SIGKILL)
