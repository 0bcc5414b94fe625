"""dsecd/fs/clientpaths.py and server.peer_pidfd: a path reached as the
client sees it, attached and detached again, and never a file of the
client's removed on the way (as root: it mounts)."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsecd import native, server
from dsecd.fs.clientpaths import (
    COPY_CHUNK,
    ClientPathError,
    ClientPaths,
    CopyTooLarge,
    KernelFileError,
    copy_as,
    point_name,
    unreadable_below,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="attaching a tree needs root")


def _mounted(path: str) -> bool:
    """From mountinfo: os.path.ismount misses a bind on the same file system."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def _pid_of(pidfd: int) -> int:
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Pid:")))


def test_the_peer_pidfd_names_the_connected_process():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        fd = server.peer_pidfd(a, -1)
        assert fd is not None
        try:
            assert _pid_of(fd) == os.getpid()
        finally:
            os.close(fd)


def test_a_client_gone_is_said_so(tmp_path):
    def gone():
        raise ProcessLookupError(errno.ESRCH, "the client exited")

    with pytest.raises(ClientPathError) as exc:
        with ClientPaths(tmp_path / "cp").reach(gone, "/somewhere"):
            pass
    assert exc.value.errno == errno.ESRCH and "the process that connected has exited" in str(exc.value)


def test_without_a_pidfd_the_path_is_the_daemons_own(tmp_path):
    with ClientPaths(tmp_path / "cp").reach(lambda: None, "/somewhere") as path:
        assert path == "/somewhere"
    assert not (tmp_path / "cp").exists()


@needs_root
def test_a_directory_and_a_file_are_attached_under_their_names_and_detached(tmp_path):
    src = tmp_path / "ctx"
    src.mkdir()
    (src / "a.txt").write_text("a")
    (tmp_path / "image.tar").write_bytes(b"tar bytes")
    cp = ClientPaths(tmp_path / "cp")
    me = os.getpid()
    # Earlier tests' garbage (sockets, files) closed by a collection during
    # this test would count as fds this one closed: collected first.
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    with cp.reach(lambda: os.pidfd_open(me), str(src)) as path:
        assert path.startswith(str(cp.root) + "/") and path.endswith("/ctx")
        assert _mounted(path) and os.listdir(path) == ["a.txt"]
        with pytest.raises(OSError) as ro:
            open(os.path.join(path, "new"), "w")
        assert ro.value.errno == errno.EROFS, "what a client names is read, never written"
    with cp.reach(lambda: os.pidfd_open(me), str(tmp_path / "image.tar")) as path:
        assert path.endswith("/image.tar") and open(path, "rb").read() == b"tar bytes"
    with pytest.raises(ClientPathError) as exc:
        with cp.reach(lambda: os.pidfd_open(me), str(tmp_path / "missing")):
            pass
    assert exc.value.errno == errno.ENOENT and "(looked up as the client sees it)" in str(exc.value)
    assert os.listdir(cp.root) == []
    assert len(os.listdir("/proc/self/fd")) == fds, "no pidfd, root or tree fd left open"
    assert (src / "a.txt").read_text() == "a"


@needs_root
def test_sweep_detaches_what_a_dead_daemon_left_and_removes_none_of_its_files(tmp_path):
    src = tmp_path / "ctx"
    src.mkdir()
    (src / "keep.txt").write_text("the client's")
    cp = ClientPaths(tmp_path / "cp")
    pidfd = os.pidfd_open(os.getpid())
    try:
        path = str(cp._attach(pidfd, str(src), None))    # never detached: what a killed daemon leaves
    finally:
        os.close(pidfd)
    assert _mounted(path)
    assert cp.sweep() == 1
    assert not cp.root.exists() or os.listdir(cp.root) == []
    assert (src / "keep.txt").read_text() == "the client's"


@needs_root
def test_a_chrooted_clients_path_is_looked_up_under_its_root(tmp_path):
    """setns alone would give the namespace's root: the path is the client's."""
    jail = tmp_path / "jail"
    (jail / "etc").mkdir(parents=True)
    (jail / "etc" / "marker").write_text("inside the jail")
    child = subprocess.Popen([sys.executable, "-c", f"import os, sys, time; os.chroot({str(jail)!r}); "
                              "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        with ClientPaths(tmp_path / "cp").reach(lambda: os.pidfd_open(child.pid), "/etc") as path:
            assert os.listdir(path) == ["marker"]
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("path,name", [("/a/rootfs", "rootfs"), ("/a/rootfs/", "rootfs"), ("/a/rootfs/.", "rootfs"),
                                       ("/a/sub/..", "a"), ("/", "root"), ("//", "root"), ("/..", "root"),
                                       ("/a/image.tar", "image.tar")])
def test_the_attach_point_takes_the_paths_own_name(path, name):
    assert point_name(path) == name


# ---- a client other than root reaches only what it could read itself

NOBODY = native.Reader(65534, 65534)


@pytest.fixture
def shared_dir():
    """A directory anyone may search (tmp_path's parents are root's alone)."""
    path = tempfile.mkdtemp(prefix="dsecd-test-reader-", dir="/tmp")
    os.chmod(path, 0o755)
    yield Path(path)
    shutil.rmtree(path)


def _tree(top: Path) -> Path:
    """A context readable by anyone: a file, a subdirectory, a symlink to a
    file only root may read (a symlink is never followed)."""
    ctx = top / "ctx"
    (ctx / "sub").mkdir(parents=True)
    (ctx / "sub" / "a.txt").write_text("a")
    (ctx / "shadow").symlink_to("/etc/shadow")
    for p in (ctx, ctx / "sub"):
        p.chmod(0o755)
    (ctx / "sub" / "a.txt").chmod(0o644)
    return ctx


def _reach(cp: ClientPaths, path: Path, reader) -> list[str]:
    with cp.reach(lambda: os.pidfd_open(os.getpid()), str(path), reader) as point:
        return sorted(os.listdir(point))


@needs_root
def test_a_client_other_than_root_reaches_what_it_may_read(tmp_path, shared_dir):
    ctx = _tree(shared_dir)
    assert _reach(ClientPaths(tmp_path / "cp"), ctx, NOBODY) == ["shadow", "sub"]


@needs_root
@pytest.mark.parametrize("hidden,named", [("sub/a.txt", "sub/a.txt"), ("sub", "sub")])
def test_a_file_or_directory_below_the_path_the_client_may_not_read_refuses_it(tmp_path, shared_dir, hidden,
                                                                                named):
    ctx = _tree(shared_dir)
    (ctx / hidden).chmod(0o600 if hidden.endswith(".txt") else 0o700)
    cp = ClientPaths(tmp_path / "cp")
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(ClientPathError) as exc:
        _reach(cp, ctx, NOBODY)
    assert exc.value.errno == errno.EACCES
    assert f"uid 65534 (the client) may not read {ctx}/{named};" in str(exc.value)
    assert not cp.root.exists() or os.listdir(cp.root) == [], "nothing left attached"
    assert set(os.listdir("/proc/self/fd")) <= fds, "no fd left open"
    assert _reach(cp, ctx, None) == ["shadow", "sub"], "root reads it all"


@needs_root
def test_a_path_under_a_directory_the_client_may_not_search_is_refused(tmp_path, shared_dir):
    ctx = _tree(shared_dir / "private")
    (shared_dir / "private").chmod(0o700)
    tar = shared_dir / "root-only.tar"
    tar.write_bytes(b"tar bytes")
    tar.chmod(0o600)
    cp = ClientPaths(tmp_path / "cp")
    for path in (ctx, tar):
        with pytest.raises(ClientPathError) as exc:
            _reach(cp, path, NOBODY)
        assert exc.value.errno == errno.EACCES
        assert "uid 65534 (the client) may not read it, or search a directory above it" in str(exc.value)
    with pytest.raises(ClientPathError) as exc:        # without a pidfd: the daemon's view, the same check
        with cp.reach(lambda: None, str(tar), NOBODY):
            pass
    assert exc.value.errno == errno.EACCES


@needs_root
def test_the_walk_gives_the_thread_its_own_ids_back(shared_dir):
    ctx = _tree(shared_dir)
    (ctx / "sub" / "a.txt").chmod(0o600)
    groups = os.getgroups()
    fd = os.open(ctx, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with native.reader_ids(NOBODY):
            assert unreadable_below(fd) == "sub/a.txt"
            with pytest.raises(PermissionError):
                open(ctx / "sub" / "a.txt").close()
        assert unreadable_below(fd) is None, "root again"
    finally:
        os.close(fd)
    assert os.getgroups() == groups
    with pytest.raises(ValueError):
        native.Reader(0, 0)


@needs_root
def test_reading_as_a_client_inside_fs_ids_gives_those_ids_back(shared_dir):
    """A COPY writes into a sandbox as its root (fs_ids) and opens each
    context file as the client (reader_ids) in between: after the open the
    thread writes as the sandbox's root again, not as the daemon's."""
    ctx = _tree(shared_dir)
    (ctx / "sub" / "a.txt").chmod(0o600)
    out = shared_dir / "out"
    out.mkdir()
    with native.fs_ids(4321, 4321):
        with native.reader_ids(NOBODY):
            with native.reader_ids(NOBODY):         # the same reader again: nothing changes
                pass
            with pytest.raises(PermissionError):   # still the client's ids
                open(ctx / "sub" / "a.txt").close()
            with pytest.raises(ValueError):
                native.reader_ids(native.Reader(65533, 65533)).__enter__()
        open(ctx / "sub" / "a.txt").close()         # the capabilities are back
        (out / "made").touch()
    st = os.stat(out / "made")
    assert (st.st_uid, st.st_gid) == (4321, 4321)
    (out / "after").touch()
    assert os.stat(out / "after").st_uid == 0


@needs_root
def test_a_copy_as_the_client_reads_only_what_it_may(shared_dir, tmp_path):
    ctx = _tree(shared_dir)
    (ctx / "sub" / "b.txt").write_text("b")
    os.chown(ctx / "sub" / "b.txt", 65534, 65534)
    (ctx / "sub" / "b.txt").chmod(0o4750)
    fd = os.open(ctx, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = tmp_path / "copy"
        out.mkdir()
        assert copy_as(fd, str(out), NOBODY) == 4
        assert (out / "sub" / "a.txt").read_text() == "a"
        assert os.readlink(out / "shadow") == "/etc/shadow"        # a symlink, never followed
        st = os.stat(out / "sub" / "b.txt")
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (65534, 65534, 0o4750)

        (ctx / "sub" / "a.txt").chmod(0o600)                       # root's alone now
        again = tmp_path / "again"
        again.mkdir()
        with pytest.raises(PermissionError) as exc:
            copy_as(fd, str(again), NOBODY)
        assert exc.value.filename == "sub/a.txt"
        with pytest.raises(InterruptedError):
            copy_as(fd, str(tmp_path / "again"), NOBODY, stop=lambda: True)
    finally:
        os.close(fd)
    assert open(ctx / "sub" / "a.txt").read() == "a", "root again"


@needs_root
def test_a_stop_ends_a_copy_as_the_client_within_a_large_file(shared_dir, tmp_path):
    """A member's `image build DIR` cancelled while its copy is in a large
    file stops at the next chunk, not at the file's end."""
    ctx = shared_dir / "ctx"
    ctx.mkdir(mode=0o755)
    with open(ctx / "big", "wb") as f:
        f.truncate(8 * COPY_CHUNK)
    (ctx / "big").chmod(0o644)
    asked = []

    def stop() -> bool:
        asked.append(True)
        return len(asked) > 3            # once for the entry, then before each chunk: two copied

    fd = os.open(ctx, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = tmp_path / "copy"
        out.mkdir()
        with pytest.raises(InterruptedError):
            copy_as(fd, str(out), NOBODY, stop=stop)
    finally:
        os.close(fd)
    assert os.path.getsize(out / "big") == 2 * COPY_CHUNK


def test_a_deep_tree_is_walked_without_recursion(tmp_path):
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fd = top
    for _ in range(1200):          # past Python's recursion limit
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        if fd != top:
            os.close(fd)
        fd = sub
    os.close(fd)
    try:
        assert unreadable_below(top) is None
    finally:
        os.close(top)
        subprocess.run(["rm", "-rf", "--", str(tmp_path / "d")], check=True)   # pytest's own removal recurses


@needs_root
def test_a_root_only_file_bound_over_a_fifo_of_the_tree_is_refused(tmp_path, shared_dir):
    """The clone takes the client's mounts along, and a directory entry's
    type is that of the file under a mount: a client that binds a root-only
    file over a FIFO of its tree (in a user namespace of its own) must not
    have it read because a FIFO is never opened."""
    ctx = _tree(shared_dir)
    os.mkfifo(ctx / "sub" / "shadow")
    secret = shared_dir / "secret"
    secret.write_text("root's alone")
    secret.chmod(0o600)
    subprocess.run(["mount", "--bind", str(secret), str(ctx / "sub" / "shadow")], check=True)
    try:
        with pytest.raises(ClientPathError) as exc:
            _reach(ClientPaths(tmp_path / "cp"), ctx, NOBODY)
        assert exc.value.errno == errno.EACCES and "sub/shadow" in str(exc.value)
    finally:
        subprocess.run(["umount", str(ctx / "sub" / "shadow")], check=True)


@needs_root
def test_a_processs_cwd_link_does_not_carry_the_client_past_a_directory_it_may_not_search(tmp_path, shared_dir):
    """/proc/PID/cwd is a magic link, guarded by a ptrace check that
    CAP_SYS_PTRACE passes: the client's lookup keeps no capability, so it
    cannot jump into a directory below one it may not search."""
    ctx = _tree(shared_dir / "private")
    (shared_dir / "private").chmod(0o700)
    child = subprocess.Popen(["sleep", "60"], cwd=ctx)
    try:
        with pytest.raises(ClientPathError) as exc:
            _reach(ClientPaths(tmp_path / "cp"), Path(f"/proc/{child.pid}/cwd"), NOBODY)
        assert exc.value.errno == errno.EACCES
        assert _reach(ClientPaths(tmp_path / "cp"), Path(f"/proc/{child.pid}/cwd"), None) == ["shadow", "sub"]
    finally:
        child.kill()
        child.wait()


@needs_root
@pytest.mark.parametrize("name,bound", [("fdinfo", "fdinfo"), ("status", "status")])
def test_a_kernel_file_system_in_a_clients_tree_is_refused(tmp_path, shared_dir, name, bound):
    """A client's tree is read in a thread of the daemon's own process, so
    its /proc/PID files pass the kernel's ptrace check as the daemon's own,
    whatever ids the thread reads with. A client that binds them into its
    tree (in a user and mount namespace of its own) is refused by the walk
    and by the copy, the entry named; root reads its tree as before."""
    ctx = _tree(shared_dir)
    target = ctx / "sub" / name
    if bound == "fdinfo":
        target.mkdir()
    else:
        target.touch()
    subprocess.run(["mount", "--bind", f"/proc/{os.getpid()}/{bound}", str(target)], check=True)
    try:
        with pytest.raises(ClientPathError) as exc:
            _reach(ClientPaths(tmp_path / "cp"), ctx, NOBODY)
        assert exc.value.errno == errno.EACCES
        assert f"{ctx}/sub/{name} is on proc, a kernel interface" in str(exc.value)
        fd = os.open(ctx, os.O_RDONLY | os.O_DIRECTORY)
        try:
            out = tmp_path / "copy"
            out.mkdir()
            with pytest.raises(KernelFileError) as err:
                copy_as(fd, str(out), NOBODY)
            assert (err.value.rel, err.value.kind) == (f"sub/{name}", "proc")
        finally:
            os.close(fd)
        assert _reach(ClientPaths(tmp_path / "cp"), ctx, None) == ["shadow", "sub"]
    finally:
        subprocess.run(["umount", str(target)], check=True)


@needs_root
def test_a_client_naming_a_kernel_file_is_refused(tmp_path):
    """The top itself too: a file of /proc the client may open is not
    attached for it (the build would read it as root, by path)."""
    status = f"/proc/{os.getpid()}/status"
    with pytest.raises(ClientPathError) as exc:
        with ClientPaths(tmp_path / "cp").reach(lambda: os.pidfd_open(os.getpid()), status, NOBODY):
            pass
    assert exc.value.errno == errno.EACCES and f"{status} is on proc, a kernel interface" in str(exc.value)
    assert not (tmp_path / "cp").exists() or not any((tmp_path / "cp").iterdir()), "nothing left attached"


@needs_root
def test_a_copy_as_the_client_stops_at_its_byte_bound(shared_dir, tmp_path):
    """A sparse file costs its owner nothing and its copy every byte: the
    copy refuses once the files' bytes pass `max_bytes`, naming the file."""
    ctx = _tree(shared_dir)
    with open(ctx / "sub" / "sparse", "wb") as f:
        f.truncate(1 << 30)
    (ctx / "sub" / "sparse").chmod(0o644)
    fd = os.open(ctx, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = tmp_path / "copy"
        out.mkdir()
        with pytest.raises(CopyTooLarge) as exc:
            copy_as(fd, str(out), NOBODY, max_bytes=1 << 20)
        assert (exc.value.rel, exc.value.size) == ("sub/sparse", 1 << 30)
        assert not (out / "sub" / "sparse").exists() or os.stat(out / "sub" / "sparse").st_size <= 2 << 20
        everything = tmp_path / "everything"
        everything.mkdir()
        (ctx / "sub" / "sparse").unlink()
        assert copy_as(fd, str(everything), NOBODY, max_bytes=1) == 3, "1 byte: a.txt alone"
    finally:
        os.close(fd)
