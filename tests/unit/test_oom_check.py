"""The reaper's OOM-kill check (dsecd/memops.py): round-robin, a bounded
number of cgroup reads per pass, every sandbox seen in turn (no root)."""

from __future__ import annotations

from types import SimpleNamespace

from dsecd import memops
from dsecd.memops import MemOps


def _node(n: int):
    sbs = {f"sb{i}": SimpleNamespace(id=f"sb{i}", state="running", oom_kills=0,
                                     handle=SimpleNamespace(group=f"sb{i}")) for i in range(n)}
    return SimpleNamespace(sandboxes=sbs, _oom_cursor=0)


def test_each_pass_reads_a_bounded_slice_and_every_sandbox_comes_round(monkeypatch):
    monkeypatch.setattr(memops, "OOM_CHECKS_PER_PASS", 4)
    kills = {"sb7": 2}
    read: list[str] = []

    def oom_kills(group):
        read.append(group)
        return kills.get(group, 0)

    monkeypatch.setattr(memops.pause, "oom_kills", oom_kills)
    node = _node(10)
    found = []
    for _ in range(3):
        found += MemOps._oom_check(node)
    assert read[:4] == ["sb0", "sb1", "sb2", "sb3"] and len(read) == 12
    assert set(read) == set(node.sandboxes)           # all 10 within 3 passes of 4
    assert found == [("sb7", 2)]
    read.clear()
    kills["sb7"] = 3
    assert MemOps._oom_check(node) + MemOps._oom_check(node) + MemOps._oom_check(node) == [("sb7", 1)]


def test_no_sandboxes_no_reads(monkeypatch):
    monkeypatch.setattr(memops.pause, "oom_kills", lambda g: 1 / 0)
    assert MemOps._oom_check(_node(0)) == []
