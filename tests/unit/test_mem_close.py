"""MemoryService.close: what it says about the swap it leaves at a stop."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from dsecd.config import load_config
from dsecd.engine.memory import MemoryService


def _service(tmp_path, overrides: dict, states: list[str]) -> MemoryService:
    cfg = load_config(overrides={"daemon": {"state_dir": str(tmp_path)}, **overrides})
    sbs = {str(i): SimpleNamespace(state=s) for i, s in enumerate(states)}
    return MemoryService(cfg, "dsecd-unit", SimpleNamespace(by_id=sbs), None, None)


def test_no_swap_is_said_to_be_left_on_when_dsecd_has_none(tmp_path, caplog):
    svc = _service(tmp_path, {}, ["paused"])
    with caplog.at_level(logging.WARNING, "dsecd.engine.memory"):
        svc.close()
    assert not [r for r in caplog.records if "swap" in r.getMessage()], caplog.records


@pytest.mark.parametrize("states", [["paused", "running"], ["running"]])
def test_a_swap_file_with_sandboxes_left_is_left_on_and_said_so(tmp_path, caplog, monkeypatch, states):
    """Running sandboxes too: one past its memory limit holds the rest in
    swap, which a swapoff would charge back to it (an OOM kill)."""
    svc = _service(tmp_path, {"memory": {"swapfile": {"enabled": True}}}, states)
    monkeypatch.setattr(svc.swapfile, "teardown", lambda: (_ for _ in ()).throw(AssertionError("torn down")))
    with caplog.at_level(logging.WARNING, "dsecd.engine.memory"):
        svc.close()
    assert [f"swap left on for the next daemon: {len(states)} sandbox(es) live on, which may hold pages in it"] \
        == [r.getMessage() for r in caplog.records]
