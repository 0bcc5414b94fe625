"""The reaper's OOM-kill check (dsecd/engine/memory.py): round-robin, a bounded
number of cgroup reads per pass, every sandbox seen in turn (no root)."""

from __future__ import annotations

from types import SimpleNamespace

from dsecd.engine import memory
from dsecd.engine.memory import MemoryService


def _node(n: int):
    sbs = {f"sb{i}": SimpleNamespace(id=f"sb{i}", state="running", oom_kills=0,
                                     handle=SimpleNamespace(group=f"sb{i}")) for i in range(n)}
    node = SimpleNamespace(registry=SimpleNamespace(by_id=sbs), sandboxes=sbs, _oom_cursor=0, published=[])
    node.events = SimpleNamespace(publish=lambda kind, sb_id, **kw: node.published.append((kind, sb_id, kw)))
    node.report_oom = lambda sb, n: MemoryService.report_oom(node, sb, n)
    return node


def _pass(node) -> list[tuple[str, int]]:
    """One reaper pass: the check in its worker, then the report on the loop."""
    before = len(node.published)
    for sb, n in MemoryService.oom_check(node):
        node.report_oom(sb, n)
    return [(sb_id, kw["kills"]) for _, sb_id, kw in node.published[before:]]


def test_each_pass_reads_a_bounded_slice_and_every_sandbox_comes_round(monkeypatch):
    monkeypatch.setattr(memory, "OOM_CHECKS_PER_PASS", 4)
    kills = {"sb7": 2}
    read: list[str] = []

    def oom_kills(group):
        read.append(group)
        return kills.get(group, 0)

    monkeypatch.setattr(memory.pause, "oom_kills", oom_kills)
    node = _node(10)
    found = []
    for _ in range(3):
        found += _pass(node)
    assert read[:4] == ["sb0", "sb1", "sb2", "sb3"] and len(read) == 12
    assert set(read) == set(node.sandboxes)           # all 10 within 3 passes of 4
    assert found == [("sb7", 2)]
    read.clear()
    kills["sb7"] = 3
    assert _pass(node) + _pass(node) + _pass(node) == [("sb7", 1)]


def test_no_sandboxes_no_reads(monkeypatch):
    monkeypatch.setattr(memory.pause, "oom_kills", lambda g: 1 / 0)
    assert MemoryService.oom_check(_node(0)) == []


def test_a_sandbox_at_its_end_reports_kills_its_turn_had_not_come_to(monkeypatch):
    # dsecd/engine/lifecycle.py stop_counting_oom: the count is read before stop removes the cgroups.
    from dsecd.engine.lifecycle import LifecycleService

    calls = []
    monkeypatch.setattr(memory.pause, "oom_kills", lambda group: calls.append(("read", group)) or 3)
    node = _node(2)
    sb = node.sandboxes["sb1"]
    sb.oom_kills = 1
    ops = SimpleNamespace(backend=SimpleNamespace(stop=lambda sb_id, h: calls.append(("stop", sb_id))),
                          memory=SimpleNamespace(oom_count=lambda group: MemoryService.oom_count(node, group)))
    kills = LifecycleService.stop_counting_oom(ops, "sb1", sb.handle)
    assert calls == [("read", "sb1"), ("stop", "sb1")] and kills == 3
    MemoryService.report_oom(node, sb, kills)
    assert node.published == [("oom", "sb1", {"kills": 2})] and sb.oom_kills == 3
    MemoryService.report_oom(node, sb, kills)                              # nothing new: nothing published
    assert LifecycleService.stop_counting_oom(ops, "sb0", None) is None         # no handle: nothing to read
    assert len(node.published) == 1


def test_an_unreadable_count_is_none_not_an_error(monkeypatch):
    def gone(group):
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(memory.pause, "oom_kills", gone)
    assert MemoryService.oom_count(_node(1), "sb0") is None


def test_a_kill_seen_by_both_the_reaper_and_a_destroy_is_reported_once(monkeypatch):
    monkeypatch.setattr(memory.pause, "oom_kills", lambda group: {"sb1": 2}.get(group, 0))
    node = _node(2)
    sb = node.sandboxes["sb1"]
    seen = MemoryService.oom_check(node)                                    # the reaper's worker read it ...
    node.report_oom(sb, MemoryService.oom_count(node, sb.handle.group))     # ... a destroy reported it meanwhile ...
    for s, n in seen:                                                 # ... then the reaper's results arrive
        node.report_oom(s, n)
    assert node.published == [("oom", "sb1", {"kills": 2})]
