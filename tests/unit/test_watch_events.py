"""dsecd/fs/watch.py on a host directory: inotify records become the wire's
events, a queue the reader let overflow is reported, and a directory that
goes ends the watch."""

from __future__ import annotations

import os

import pytest

from dsecd.fs import libc
from dsecd.fs import watch as fswatch


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "w").mkdir()
    rootfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    t = fswatch.TreeWatch(rootfd, "/w", fswatch.top_identity(rootfd, "/w"), True, 16)
    t.add_tree("", False)
    yield t, tmp_path / "w"
    t.close()


def events(t: fswatch.TreeWatch) -> list[dict]:
    out = []
    for record in t.read():
        event, grow = t.translate(*record)
        if event:
            out.append(event)
        if grow:
            out.extend(t.add_tree(grow, True))
    return out


def test_kinds_and_paths(tree):
    t, top = tree
    (top / "f").write_bytes(b"x")
    (top / "d" / "e").mkdir(parents=True)
    kinds = [(e["kind"], e["path"], e.get("scanned", False)) for e in events(t)]
    # e was made before d was watched: the scan of d finds it.
    assert kinds == [("create", "/w/f", False), ("modify", "/w/f", False), ("create", "/w/d", False),
                     ("create", "/w/d/e", True)]
    os.rename(top / "f", top / "d" / "e" / "g")
    moves = events(t)
    assert [(e["kind"], e["path"]) for e in moves] == [("move_from", "/w/f"), ("move_to", "/w/d/e/g")]
    assert moves[0]["cookie"] == moves[1]["cookie"]
    os.rename(top / "d", top / "d2")            # a directory moved in the tree is watched under its new name
    events(t)
    assert "d2/e" in t.wds and "d/e" not in t.wds


def test_a_symlinked_directory_is_not_entered(tree, tmp_path):
    t, top = tree
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", top / "link")
    events(t)
    (tmp_path / "outside" / "secret").write_bytes(b"x")
    assert events(t) == [] and "link" not in t.wds


def test_overflow_is_reported(tree):
    t, top = tree
    limit = int(open("/proc/sys/fs/inotify/max_queued_events").read())
    if limit > 50_000:
        pytest.skip(f"fs.inotify.max_queued_events is {limit}: too many files to overflow it")
    for i in range(limit + 10):
        os.close(os.open(top / str(i), os.O_CREAT | os.O_WRONLY))
    got = events(t)
    assert got[-1]["kind"] == "overflow" and "lost" in got[-1]["message"]


def test_the_cap_on_directories(tree):
    t, top = tree
    for i in range(20):
        (top / f"d{i}").mkdir()
    with pytest.raises(fswatch.WatchLimit, match="max_watch_dirs"):
        events(t)


def test_deleting_the_top_stops_the_watch(tree):
    t, top = tree
    os.rmdir(top)
    events(t)
    assert t.stopped == "deleted"


def test_parse_of_an_overflow_record():
    raw = fswatch.EVENT.pack(-1, libc.IN_Q_OVERFLOW, 0, 0)
    assert fswatch.parse_events(raw) == [(-1, libc.IN_Q_OVERFLOW, 0, "")]
