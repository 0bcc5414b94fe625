"""What a call's uid leaves in /dev/shm goes before the uid is handed out
again (zygote_main.remove_owned): whole entries it owns, its files inside
other uids' directories, trees of any depth, nothing followed."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import time

import pytest

from dsecd.backends import zygote_main
from dsecd.backends.zygote_main import remove_owned, remove_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="files of other uids are made with chown: root")

CALL, OTHER = 60123, 60124


@pytest.fixture
def shm(tmp_path):
    """A stand-in /dev/shm, removed whole at any depth after the test (a
    chain left behind would make pytest's own rmtree of old runs recurse
    past Python's limit)."""
    top = tmp_path / "shm"
    top.mkdir()
    yield top
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        moved = []
        zygote_main._remove_tree(fd, "shm", True, fd, moved)
        while moved:
            zygote_main._remove_tree(fd, moved.pop(), True, fd, moved)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _zygote(base: str = "/nonexistent", uid_count: int = 2):
    """A Zygote object in this process (its loop never run, so nothing it
    forks or walks is the host's), its fds and socket closed after."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    z = zygote_main.Zygote(theirs, base, 0, 60000, uid_count, {})
    try:
        yield z
    finally:
        for fd in (z.children_fd, z.own_children_fd, z.shm_fd, z.sigchld_fd, *z.ipc_fds.values()):
            if fd >= 0:
                os.close(fd)
        ours.close()
        theirs.close()


@pytest.fixture
def only_the_dir(monkeypatch):
    """A freed uid's cleanup left with its call's dir alone: /dev/shm,
    message queues and SysV IPC found clean."""
    monkeypatch.setattr(zygote_main, "remove_owned", lambda fd, uid: True)
    monkeypatch.setattr(zygote_main, "remove_ipc", lambda uid, **_: True)


def _owned(path, uid, kind="file"):
    if kind == "dir":
        os.mkdir(path, 0o777)
    else:
        with open(path, "w") as f:
            f.write("x")
    os.chown(path, uid, uid, follow_symlinks=False)


def _walk(top):
    return sorted(os.path.relpath(os.path.join(d, n), top) for d, ds, fs in os.walk(top) for n in ds + fs)


def _remove(top, uid) -> bool:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return remove_owned(fd, uid)
    finally:
        os.close(fd)


def test_only_what_the_uid_owns_goes_and_links_are_not_followed(shm, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    _owned(outside / "target", CALL)
    _owned(shm / "mine", CALL)
    _owned(shm / "mydir", CALL, "dir")
    _owned(shm / "mydir" / "theirs-inside-mine", OTHER)
    _owned(shm / "theirs", OTHER)
    _owned(shm / "theirdir", OTHER, "dir")
    _owned(shm / "theirdir" / "mine-inside-theirs", CALL)
    _owned(shm / "theirdir" / "kept", OTHER)
    os.symlink(outside, shm / "link")
    os.lchown(shm / "link", CALL, CALL)
    os.symlink(outside, shm / "theirlink")
    os.lchown(shm / "theirlink", OTHER, OTHER)
    assert _remove(shm, CALL)
    assert _walk(shm) == ["theirdir", "theirdir/kept", "theirlink", "theirs"]
    assert _walk(outside) == ["target"]


def _chain(top, depth, uid) -> str:
    """A chain of `depth` directories owned by `uid` under `top`, made fd by fd."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", 0o777, dir_fd=fd)
        os.chown("d", uid, uid, dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    return "d"


def test_a_tree_deeper_than_recursion_and_fds_allow_goes_whole(shm):
    # Deeper than Python's recursion limit and than the walk's open fds:
    # recursion would raise and the uid would be held for good.
    _chain(shm, 1500, CALL)
    _owned(shm / "theirs", OTHER)
    assert _remove(shm, CALL)
    assert os.listdir(shm) == ["theirs"]


def test_another_uids_deep_tree_is_looked_through_to_the_limit_then_called_unfinished(shm):
    # Past MAX_OPEN_DIRS levels of another uid's tree the walk does not
    # look: the uid may own something there, so the cleanup is not done.
    _chain(shm, 1500, OTHER)
    shallow = shm / "/".join(["d"] * 3)
    _owned(shallow / "mine", CALL)
    assert not _remove(shm, CALL)
    assert not (shallow / "mine").exists()
    assert (shallow / "d").is_dir(), "another uid's tree was removed"
    shallow_tree = shm / "/".join(["d"] * (zygote_main.MAX_OPEN_DIRS - 2))
    for d in list(shm.iterdir()):
        os.rename(d, shm / "gone")                           # its call ended: the tree went
    fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_tree(fd, "gone")
    finally:
        os.close(fd)
    _chain(shm, zygote_main.MAX_OPEN_DIRS - 3, OTHER)
    assert shallow_tree.parent.exists()
    assert _remove(shm, CALL), "a tree the walk sees whole is no reason to hold the uid"


def test_a_tree_too_deep_for_one_cleanup_is_left_unfinished_not_walked_for_ever(shm, monkeypatch):
    # Another call still running can deepen a tree as fast as it goes.
    monkeypatch.setattr(zygote_main, "MAX_MOVED", 2)
    _chain(shm, 1500, CALL)
    assert not _remove(shm, CALL)
    monkeypatch.setattr(zygote_main, "MAX_MOVED", 256)
    assert _remove(shm, CALL) and os.listdir(shm) == []


def test_a_directory_swapped_in_under_an_owned_name_is_left_alone(shm):
    # Listed as the call's, then another call renamed its own dir there.
    _owned(shm / "theirs", OTHER, "dir")
    _owned(shm / "theirs" / "keep", OTHER)
    fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert not zygote_main._remove_tree(fd, "theirs", True, fd, [], owner=CALL)
    finally:
        os.close(fd)
    assert (shm / "theirs" / "keep").exists()


def test_an_entry_that_cannot_be_removed_says_so(shm, monkeypatch):
    _owned(shm / "mine", CALL)
    real = os.unlink

    def refused(name, dir_fd=None):
        raise PermissionError(1, "refused", name)

    monkeypatch.setattr(zygote_main.os, "unlink", refused)
    assert not _remove(shm, CALL)
    monkeypatch.setattr(zygote_main.os, "unlink", real)
    assert _remove(shm, CALL) and os.listdir(shm) == []


def test_a_uid_whose_ipc_cleanup_could_not_fork_is_tried_again(monkeypatch):
    """Removing a call's SysV IPC objects forks a child (it drops to the
    uid): when no pid is free (another call holds the pids limit) the uid
    waits and is tried again, rather than being lost for good."""

    from dsecd.backends import zygote_main

    with _zygote() as z:
        z.uids.clear()
        monkeypatch.setattr(zygote_main, "remove_owned", lambda fd, uid: True)
        monkeypatch.setattr(z, "kill_leftovers", lambda uid: 0)     # (the host's pid 1 is no call sandbox's)
        monkeypatch.setattr(z, "kill_uid", lambda uid: True)        # (nor is the host's uid 60000 a call's)

        def no_pid(uid, **_):
            raise BlockingIOError(11, "Resource temporarily unavailable")

        monkeypatch.setattr(zygote_main, "remove_ipc", no_pid)
        z.free_uid(60001)
        assert (z.uids, z.held) == ([], [60001])
        z.recheck_held()                                 # still no pid
        assert (z.uids, z.held) == ([], [60001])
        monkeypatch.setattr(zygote_main, "remove_ipc", lambda uid, **_: True)
        z.recheck_held()
        assert (z.uids, z.held) == ([60001], [])
        monkeypatch.setattr(zygote_main, "remove_ipc", lambda uid, **_: False)    # not removed: tried again later
        z.free_uid(60000)
        assert (z.uids, z.held, list(z.unclean)) == ([60001], [], [60000])


def test_remove_tree_takes_a_call_dir_whole_at_any_depth_following_nothing(shm, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    call = shm / "call"
    call.mkdir()
    _chain(call, 1500, CALL)
    (call / "link").symlink_to(outside)
    (call / "filelink").symlink_to(outside / "keep")
    fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_tree(fd, "call")
        assert remove_tree(fd, "call")          # gone already: nothing to do
    finally:
        os.close(fd)
    assert os.listdir(shm) == [] and (outside / "keep").read_text() == "x"


def test_a_uid_whose_leftovers_stay_is_tried_again_then_given_up(monkeypatch):
    """What another call keeps in place (a tree it deepens, a file in its
    writable dir) holds a freed uid back, not for good: it is tried again
    every CLEANUP_RETRY_MS, and given up after CLEANUP_TRIES."""

    with _zygote() as z:
        z.uids.clear()
        clean = {"now": False}
        monkeypatch.setattr(zygote_main, "remove_owned", lambda fd, uid: clean["now"])
        monkeypatch.setattr(zygote_main, "remove_ipc", lambda uid, **_: True)
        monkeypatch.setattr(zygote_main, "CLEANUP_RETRY_MS", 0)
        z.free_uid(60001)
        assert z.uids == [] and z.unclean[60001][1] == 1 and z.unclean_wait_ms() is not None
        z.retry_unclean()
        assert z.uids == [] and z.unclean[60001][1] == 2
        clean["now"] = True
        z.retry_unclean()
        assert (z.uids, z.unclean, z.lost) == ([60001], {}, set())
        clean["now"] = False
        z.free_uid(60000)
        for _ in range(zygote_main.CLEANUP_TRIES):
            z.retry_unclean()
        assert (z.uids, z.unclean, z.lost) == ([60001], {}, {60000})


def test_a_worker_without_a_pidfd_is_seen_to_end_even_if_it_ended_at_once(monkeypatch):
    """A worker whose pidfd could not be opened (Python 3.8 has no
    pidfd_open; EMFILE elsewhere) is watched on SIGCHLD, whose wakeup is
    installed for it then: one that ended before that is found all the
    same, and fork_worker itself survives it."""
    import signal
    import socket

    monkeypatch.setattr(zygote_main, "worker", lambda link, tmp, uid, rlimits, isolation: os._exit(3))
    monkeypatch.setattr(zygote_main, "remove_ipc", lambda uid, **_: True)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    z = zygote_main.Zygote(theirs, "/nonexistent", 0, 60000, 1, {})   # on a host with pidfds
    monkeypatch.setattr(zygote_main, "_pidfd", lambda pid: -1)         # then one cannot be opened
    real_fork = os.fork

    def fork_that_ends_first():             # the worker is gone before fork_worker goes on
        pid = real_fork()
        if pid:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        return pid

    monkeypatch.setattr(zygote_main.os, "fork", fork_that_ends_first)
    monkeypatch.setattr(z, "kill_leftovers", lambda uid: 0)     # (the host's pid 1 is no call sandbox's)
    monkeypatch.setattr(z, "kill_uid", lambda uid: True)        # (nor is the host's uid 60000 a call's)
    os.close(z.shm_fd)
    z.shm_fd = -1
    try:
        w = z.fork_worker()
        assert z.sigchld_fd >= 0
        assert [fd for fd, _ in z.poll.poll(2000) if fd == z.sigchld_fd] == [z.sigchld_fd]
        z.on_sigchld()
        assert z.unwatched == {} and z.uids == [60000]
        assert not os.path.exists(f"/proc/{w['pid']}")          # reaped
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (z.children_fd, z.own_children_fd, z.sigchld_fd, *z.ipc_fds.values()):
            if fd >= 0:
                os.close(fd)
        ours.close()
        theirs.close()


def test_a_walk_sees_every_entry_while_another_listing_of_the_same_fd_is_open(shm):
    # The daemon keeps one fd of a box's message queue dir and cleans up
    # after several calls at once: a dup would share the read offset, and
    # a walk starting at another's end would see nothing and say done.
    _owned(shm / "mine", CALL)
    _owned(shm / "theirs", OTHER)
    fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(fd) as other_walk:
            next(other_walk)                 # under way: the offset it shares is past every entry
            assert remove_owned(fd, CALL)
        assert os.listdir(shm) == ["theirs"]
    finally:
        os.close(fd)


def test_every_part_of_a_calls_leftovers_is_removed_whatever_another_part_did(tmp_path, monkeypatch):
    """The zygote's cleanup of a freed uid: its call's dir (left for it by
    worker_gone, after what the call left running is killed), /dev/shm,
    message queues and SysV IPC are each tried; one that stays does not
    keep the others in place."""

    base = tmp_path / "fncall-x"
    base.mkdir()
    (base / "w60001-1" / "sub").mkdir(parents=True)
    (base / "w60001-1" / "sub" / "f").write_text("x")
    ipc_asked = []
    monkeypatch.setattr(zygote_main, "remove_owned", lambda fd, uid: False)    # /dev/shm: something stays
    monkeypatch.setattr(zygote_main, "remove_ipc", lambda uid, **_: ipc_asked.append(uid) or True)
    with _zygote(str(base)) as z:
        z.dirs[60001] = "w60001-1"
        assert not z.remove_left(60001)
        assert ipc_asked == [60001] and os.listdir(base) == [zygote_main.TRASH] and z.dirs == {}
        z.sweep()
        assert os.listdir(base / zygote_main.TRASH) == []
        monkeypatch.setattr(zygote_main, "remove_owned", lambda fd, uid: True)
        assert z.remove_left(60001)


def test_a_large_call_dir_goes_out_of_reach_at_once_and_is_removed_a_slice_a_turn(tmp_path, only_the_dir):
    """A call that left 100,000 files in its dir stopped the zygote's loop
    while it removed them all, and with it every call and every kill it
    relays. The dir goes at once into a root-only trash dir no call can
    enter (its uid is free again), and is removed SWEEP_STEPS entries per
    turn of the loop."""
    base = tmp_path / "fncall-x"
    (base / "w60001-1" / "sub").mkdir(parents=True)
    for i in range(1000):
        (base / "w60001-1" / "sub" / str(i)).write_bytes(b"")
    with _zygote(str(base)) as z:
        z.dirs[60001] = "w60001-1"
        assert z.remove_left(60001)
        trash = base / zygote_main.TRASH
        assert os.listdir(base) == [zygote_main.TRASH] and z.dirs == {}
        assert os.stat(trash).st_mode & 0o777 == 0o700 and os.stat(trash).st_uid == 0
        left = [len(os.listdir(trash / "w60001-1.0" / "sub"))]
        while z.sweeping:
            z.sweep()
            if (trash / "w60001-1.0" / "sub").exists():
                left.append(len(os.listdir(trash / "w60001-1.0" / "sub")))
        assert left[0] == 1000 and len(left) >= 1000 // zygote_main.SWEEP_STEPS
        assert all(0 < a - b <= zygote_main.SWEEP_STEPS for a, b in zip(left, left[1:], strict=False))
        assert os.listdir(trash) == []


IPC_PROBE = """
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from dsecd.backends.zygote_main import SYSV_IPC, ipc_owned
fds = {k: os.open(f"/proc/sysvipc/{k}", os.O_RDONLY) for k in SYSV_IPC}
seen = [ipc_owned(0, fds)]
# More than a page of /proc/sysvipc/shm (~180 bytes a segment), which a
# seq_file hands out a page per read.
ids = [subprocess.run(["ipcmk", flag, *size], capture_output=True, text=True, check=True).stdout.split()[-1]
       for flag, size in [("-M", ["4096"])] * 60 + [("-S", ["2"]), ("-Q", [])]]
seen += [sorted(ipc_owned(0, fds)), sorted(ipc_owned(0)), ipc_owned(1234, fds)]
for flag, ident in zip(["-m"] * 60 + ["-s", "-q"], ids):
    subprocess.run(["ipcrm", flag, ident], check=True)
seen.append(ipc_owned(0, fds))
print(repr((seen, [int(i) for i in ids])))
"""


def test_ipc_objects_are_found_through_files_kept_open_as_through_new_ones():
    """The zygote reads /proc/sysvipc from fds kept open, from their start
    each time: what was made and removed since is seen as a fresh open
    sees it (a private IPC namespace: nothing of the host's)."""
    import ast
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(["unshare", "--ipc", sys.executable, "-c", IPC_PROBE, repo],
                         capture_output=True, text=True, check=True).stdout
    (before, kept, fresh, other, after), ids = ast.literal_eval(out)
    assert before == [] and after == [] and other == []
    assert kept == fresh == sorted([("shm", i) for i in ids[:60]] + [("sem", ids[60]), ("msg", ids[61])])


def test_a_childrens_list_longer_than_a_page_is_read_whole():
    """init_children through a kept fd: a seq_file hands out a page per read,
    so a process with more children than a page lists (~680 pids) must be
    read to its end, or leftovers past the first page escape the kill."""
    import subprocess

    parent = subprocess.Popen(["sh", "-c", "for i in $(seq 900); do sleep 60 & done; wait"])
    try:
        path = f"/proc/{parent.pid}/task/{parent.pid}/children"
        deadline = time.monotonic() + 30
        while len(open(path).read().split()) < 900:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert len(zygote_main.init_children(parent.pid, fd=fd)) == 900
        finally:
            os.close(fd)
    finally:
        for pid in open(f"/proc/{parent.pid}/task/{parent.pid}/children").read().split():
            os.kill(int(pid), signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_a_zygote_in_the_hosts_user_namespace_kills_by_no_uid():
    """Without a user namespace (sandbox.userns = false) a call's uid is a
    host uid: kill(-1) as it would reach the host's processes. No reaper is
    forked, and the uid is not held back for want of one (every call's uid
    was, and after uid_count calls every call was busy)."""
    with _zygote() as z:
        assert z.kill_by_uid is False
        assert z.kill_uid(60000) is True and z.reaper is None


def test_a_trashed_dir_not_all_gone_is_swept_again(tmp_path, only_the_dir):
    """A call still running may write into a part of a trashed dir it held
    open while the sweep went past: that part was left in TRASH for good.
    It is swept again, CLEANUP_RETRY_MS later."""
    base = tmp_path / "fncall-x"
    (base / "w60001-1" / "shared").mkdir(parents=True)
    for i in range(10):
        (base / "w60001-1" / "shared" / str(i)).write_bytes(b"")
    with _zygote(str(base)) as z:
        z.dirs[60001] = "w60001-1"
        held = os.open(base / "w60001-1" / "shared", os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert z.remove_left(60001)
            z.sweep(steps=3)                    # "shared" listed and under way
            fd = os.open("late", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=held)
            os.close(fd)
        finally:
            os.close(held)
        z.sweep()
        trash = base / zygote_main.TRASH
        assert os.listdir(trash / "w60001-1.0" / "shared") == ["late"]
        assert len(z.sweeping) == 1 and z.sweep_wait_ms() > 0      # again, CLEANUP_RETRY_MS later
        z.sweeping[0][3] = 0.0
        z.sweep()
        assert z.sweeping == [] and os.listdir(trash) == []


class _Stop(Exception):
    pass


def test_while_the_trash_is_swept_a_failed_fork_keeps_its_pace(monkeypatch):
    """The loop polls without waiting while the trash is swept; the pace of
    a spare's fork after one failed (FORK_RETRY_MS: a call holding the
    pids limit makes every fork copy the page tables, then fail) was the
    poll's timeout, so it was tried at every turn."""
    clock = [1000.0]

    class Clock:
        @staticmethod
        def monotonic():
            return clock[0]

        monotonic_ns = staticmethod(lambda: int(clock[0] * 1e9))

    monkeypatch.setattr(zygote_main, "time", Clock)
    with _zygote() as z:
        def forever():
            while True:
                yield

        z.spares = 2
        z.sweeping.append([forever(), "x", 0, 0.0])
        forks = []

        def fork_fails(n=1):
            forks.append(clock[0])
            raise OSError(errno.EAGAIN, "pids.max")

        z.fork_workers = fork_fails
        turns = []

        class Poll:
            def poll(self, wait):
                turns.append(wait)
                if len(turns) > 300:
                    raise _Stop
                clock[0] += 0.001           # each turn takes 1 ms
                return []

        z.poll = Poll()
        with pytest.raises(_Stop):
            z.run()
    assert set(turns) == {0}, "the sweep keeps the loop turning"
    assert 1 <= len(forks) <= 1 + 300 // zygote_main.FORK_RETRY_MS, forks


def test_a_flat_trashed_dir_is_listed_over_several_turns(tmp_path, only_the_dir):
    """One step of the sweep listed a whole directory: 200,000 entries took
    ~0.1 s of the loop in one go, millions past fncall.kill_grace_s. The
    listing is a step per LIST_STEPS entries."""
    base = tmp_path / "fncall-x"
    (base / "w60001-1").mkdir(parents=True)
    n = 5 * zygote_main.LIST_STEPS
    for i in range(n):
        (base / "w60001-1" / str(i)).write_bytes(b"")
    with _zygote(str(base)) as z:
        z.dirs[60001] = "w60001-1"
        assert z.remove_left(60001)
        listing = 0
        while len(os.listdir(base / zygote_main.TRASH / "w60001-1.0")) == n:
            z.sweep(steps=1)
            listing += 1
        assert listing >= n // zygote_main.LIST_STEPS
        while z.sweeping:
            z.sweep()
        assert os.listdir(base / zygote_main.TRASH) == []


def test_parts_of_a_deep_trashed_dir_moved_up_are_swept_again(tmp_path, monkeypatch, only_the_dir):
    """Past MAX_OPEN_DIRS levels a removal moves deeper parts up into the
    trash, and stops after MAX_MOVED of them: a retry named only the dir
    itself, gone by then, and the parts stayed for good."""
    monkeypatch.setattr(zygote_main, "MAX_OPEN_DIRS", 2)
    monkeypatch.setattr(zygote_main, "MAX_MOVED", 1)
    base = tmp_path / "fncall-x"
    deep = base / "w60001-1"
    for _ in range(12):
        deep = deep / "d"
    deep.mkdir(parents=True)
    with _zygote(str(base)) as z:
        z.dirs[60001] = "w60001-1"
        assert z.remove_left(60001)
        for _ in range(200):
            if not z.sweeping:
                break
            for entry in z.sweeping:
                entry[3] = 0.0              # its retry is due
            z.sweep()
        assert z.sweeping == [] and os.listdir(base / zygote_main.TRASH) == []


def _reap(workers) -> None:
    """Wait for workers forked by a test (each exits at once) and close what the zygote holds of them."""
    for w in workers:
        os.waitpid(w["pid"], 0)
        w["link"].close()
        if w["pidfd"] >= 0:
            os.close(w["pidfd"])


def test_a_low_zygote_forks_every_missing_spare_in_one_turn():
    """Once fewer than half the spares are left, the missing ones are forked
    back to back in one turn of the loop: each fork write-protects the
    zygote's memory again, and the loop's own pages are then copied once per
    batch, not once per call."""
    with _zygote(uid_count=16) as z:
        z.spares = 8
        z.idle = [{"pid": 0}] * 3
        asked = []

        def fork_workers(n):
            asked.append(n)
            return [{"pid": 0}] * n

        z.fork_workers = fork_workers

        class Poll:
            turns = 0

            def poll(self, wait):
                Poll.turns += 1
                if Poll.turns > 1:
                    raise _Stop
                return []

        z.poll = Poll()
        with pytest.raises(_Stop):
            z.run()
    assert asked == [5] and len(z.idle) == 8


def test_a_batch_whose_fork_fails_keeps_the_workers_forked_before_it(monkeypatch):
    """A fork that fails in a batch (the pids limit) ends it: the workers
    forked before it are listed, the uids of the others come back unused,
    and their socket pairs are closed."""
    monkeypatch.setattr(zygote_main, "worker", lambda link, tmp, uid, rlimits, isolation: os._exit(0))
    real_fork = os.fork
    forks = []

    def fork_twice_then_fail():
        forks.append(1)
        if len(forks) > 2:
            raise OSError(errno.EAGAIN, "pids.max")
        return real_fork()

    monkeypatch.setattr(zygote_main.os, "fork", fork_twice_then_fail)
    with _zygote(uid_count=4) as z:
        before = len(os.listdir("/proc/self/fd"))
        workers = z.fork_workers(4)
        try:
            assert len(workers) == 2 and len(forks) == 3
            assert sorted(z.uids + [w["uid"] for w in workers]) == [60000, 60001, 60002, 60003]
            held = [fd for w in workers for fd in (w["link"].fileno(), w["pidfd"]) if fd >= 0]
            assert len(os.listdir("/proc/self/fd")) - before == len(held)     # no other end left open
        finally:
            _reap(workers)



def test_a_batch_short_of_fds_forks_what_it_could_pair_and_loses_no_uid(monkeypatch):
    """A socket pair that cannot be made (the zygote out of fds or memory)
    ends the batch before its forks: the workers paired before it are
    forked, and no uid is lost, neither its own nor those of the pairs made
    before it (a lost uid is never handed out again: each failed batch
    would shrink the zygote's calls for good). With no pair made, the
    batch fails, every uid still free."""
    import socket

    monkeypatch.setattr(zygote_main, "worker", lambda link, tmp, uid, rlimits, isolation: os._exit(0))
    real_pair = socket.socketpair
    left = [2]          # pairs that can be made

    def pair(*args):
        if not left[0]:
            raise OSError(errno.EMFILE, "Too many open files")
        left[0] -= 1
        return real_pair(*args)

    with _zygote(uid_count=4) as z:
        monkeypatch.setattr(zygote_main.socket, "socketpair", pair)
        workers = z.fork_workers(4)
        try:
            assert len(workers) == 2
            assert sorted(z.uids + [w["uid"] for w in workers]) == [60000, 60001, 60002, 60003]
            free = sorted(z.uids)
            with pytest.raises(OSError) as caught:
                z.fork_workers(2)
            assert caught.value.errno == errno.EMFILE and sorted(z.uids) == free
        finally:
            _reap(workers)


def test_a_low_zygote_refills_its_spares_in_a_turn_that_had_calls_too():
    """Under load every poll has calls for the zygote, and a zygote that
    forked only in a turn without any forked no spare again: each call then
    got a worker forked for it alone, and the loop's pages were copied again
    at every one. Once low, it refills in the same turn."""
    with _zygote(uid_count=16) as z:
        z.spares = 8
        z.idle = [{"pid": 0}] * 3
        asked = []

        def fork_workers(n):
            asked.append(n)
            return [{"pid": 0}] * n

        z.fork_workers = fork_workers
        z.on_request = lambda: z.idle.pop()          # a call takes a spare

        class Poll:
            turns = 0

            def poll(self, wait):
                Poll.turns += 1
                if Poll.turns > 1:
                    raise _Stop
                return [(z.sock.fileno(), select.POLLIN)]

        z.poll = Poll()
        with pytest.raises(_Stop):
            z.run()
    assert asked == [6] and len(z.idle) == 8
