"""dsecd/fs/clientpaths.py and server.peer_pidfd: a path reached as the
client sees it, attached and detached again, and never a file of the
client's removed on the way (as root: it mounts)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest

from dsecd import server
from dsecd.fs.clientpaths import ClientPathError, ClientPaths, point_name

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
        path = str(cp._attach(pidfd, str(src)))    # never detached: what a killed daemon leaves
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
