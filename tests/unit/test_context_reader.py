"""A Dockerfile build's context read as a client other than root
(dsecd/build/context.py ContextRoot with a reader): what it may not have
read for it (as root: it mounts and changes the thread's ids)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from dsecd import native
from dsecd.build.context import BuildContext, ContextError, DigestCache

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="binding /proc into a context needs root")

NOBODY = native.Reader(65534, 65534)


@pytest.fixture
def ctx():
    """A context anyone may read (tmp_path's parents are root's alone)."""
    top = Path(tempfile.mkdtemp(prefix="dsecd-test-context-", dir="/tmp"))
    top.chmod(0o755)
    (top / "a.txt").write_text("a")
    (top / "fdinfo").mkdir()
    (top / "status").touch()
    yield top
    shutil.rmtree(top)


@pytest.fixture
def bound(ctx):
    """The test process's /proc/PID/fdinfo and status bound into the context,
    as a client in a mount namespace of its own binds the daemon's."""
    made = []
    try:
        for name in ("fdinfo", "status"):
            subprocess.run(["mount", "--bind", f"/proc/{os.getpid()}/{name}", str(ctx / name)], check=True)
            made.append(ctx / name)
        yield ctx
    finally:
        for path in made:
            subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("pattern,named", [("fdinfo/0", "fdinfo/0"), ("status", "status"), ("fdinfo", "fdinfo"),
                                           ("fdinfo/*", "fdinfo"), (".", "fdinfo")])
def test_a_kernel_file_in_the_context_is_refused_for_a_client(bound, pattern, named):
    """The context is read in a thread of the daemon's own process, where
    /proc/<its pid> passes the kernel's ptrace check as its own: nothing
    on a kernel file system is opened for a client, whatever its ids."""
    context = BuildContext.open(str(bound), reader=NOBODY)
    with pytest.raises(ContextError, match=f"^{named} is on proc, a kernel interface"):
        context.digest(context.sources(pattern), DigestCache())
    assert [s.rel for s in context.sources("a.txt")] == ["a.txt"], "the rest is read"


def test_a_kernel_file_as_the_dockerignore_is_refused_for_a_client(ctx):
    (ctx / ".dockerignore").write_text("*.log\n")
    subprocess.run(["mount", "--bind", f"/proc/{os.getpid()}/status", str(ctx / ".dockerignore")], check=True)
    try:
        with pytest.raises(ContextError, match=r"^\.dockerignore is on proc, a kernel interface"):
            BuildContext.open(str(ctx), reader=NOBODY)
        BuildContext.open(str(ctx))         # root's build reads what root names
    finally:
        subprocess.run(["umount", str(ctx / ".dockerignore")], check=True)


def _mount_link_on(link: Path, magic: str) -> None:
    """The proc magic link `magic` itself (not where it points) mounted on
    the symlink `link`: open_tree(OPEN_TREE_CLONE | AT_SYMLINK_NOFOLLOW)
    and move_mount, as a client in namespaces of its own can."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    tree = libc.syscall(428, -100, magic.encode(), 1 | 0x80000 | 0x100)    # open_tree: CLONE, CLOEXEC, NOFOLLOW
    if tree < 0:
        raise OSError(ctypes.get_errno(), "open_tree", magic)
    try:
        if libc.syscall(429, tree, b"", -100, str(link).encode(), 0x4) < 0:      # move_mount F_EMPTY_PATH
            raise OSError(ctypes.get_errno(), "move_mount", str(link))
    finally:
        os.close(tree)


def _unmount_link(link: Path) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(str(link).encode(), 2 | 8) != 0:           # MNT_DETACH | UMOUNT_NOFOLLOW
        raise OSError(ctypes.get_errno(), "umount2", str(link))


def test_a_proc_link_mounted_on_a_symlink_is_not_read_for_a_client(ctx, tmp_path):
    """The walks read a symlink's target as the reader; /proc/PID/cwd (exe,
    root, ns/*) mounted on a symlink of the tree passes proc's ptrace check
    in the daemon's own thread: its target (a path the client may not
    read) went into the image. It is refused, the link named."""
    from dsecd.fs.clientpaths import KernelFileError, copy_as

    link = ctx / "leak"
    link.symlink_to("a.txt")
    _mount_link_on(link, f"/proc/{os.getpid()}/cwd")
    try:
        with pytest.raises(ContextError, match=r"^leak is on proc, a kernel interface"):
            BuildContext.open(str(ctx), reader=NOBODY).sources(".")
        fd = os.open(ctx, os.O_RDONLY | os.O_DIRECTORY)
        try:
            (tmp_path / "copy").mkdir()
            with pytest.raises(KernelFileError) as err:
                copy_as(fd, str(tmp_path / "copy"), NOBODY)
            assert (err.value.rel, err.value.kind) == ("leak", "proc")
        finally:
            os.close(fd)
        BuildContext.open(str(ctx)).sources(".")            # root's build reads what root names
    finally:
        _unmount_link(link)
