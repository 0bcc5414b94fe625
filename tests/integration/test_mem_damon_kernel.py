"""DAMON on the real kernel: only where the interface is free for dsecd.

The real probe decides; where a kdamond dsecd did not create exists (as on the
CI machines, where kdamond 0 runs for the host), the probe's reason is the
skip reason, and the test checks that probing and a refused start wrote
nothing: the other kdamond keeps running, nr_kdamonds is unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsecd.mem.damon import (
    DEFAULT_ROOT,
    DamonConfig,
    DamonController,
    DamonUnavailable,
    SandboxScheme,
)

ROOT = Path(DEFAULT_ROOT)


def _snapshot() -> dict[str, str]:
    out = {"nr": (ROOT / "kdamonds" / "nr_kdamonds").read_text()}
    for i in range(int(out["nr"])):
        out[f"{i}/state"] = (ROOT / "kdamonds" / str(i) / "state").read_text()
        out[f"{i}/pid"] = (ROOT / "kdamonds" / str(i) / "pid").read_text()
    return out


@pytest.fixture
def damon(tmp_path):
    d = DamonController(DamonConfig(enabled=True, state_file=str(tmp_path / "damon.json")))
    yield d
    d.stop()


def test_busy_interface_is_reported_and_left_alone(damon):
    if not (ROOT / "kdamonds" / "nr_kdamonds").exists():
        pytest.skip(damon.probe().detail)
    before = _snapshot()
    a = damon.probe()
    if a.available:
        pytest.skip("DAMON is free on this host; the busy path cannot be exercised")
    assert a.detail.startswith("DAMON interface busy") and a.foreign
    with pytest.raises(DamonUnavailable):
        damon.start([])
    assert _snapshot() == before


def test_own_kdamond_on_real_kernel(damon):
    a = damon.probe()
    if not a.available:
        pytest.skip(f"DAMON unavailable here: {a.detail}")
    memcg = Path("/sys/fs/cgroup/memory")
    rel = f"dsecd-test-damon-{os.getpid()}"
    made = None
    for base in (memcg, Path("/sys/fs/cgroup")):
        if (base / "cgroup.procs").exists():
            made = base / rel
            made.mkdir()
            break
    try:
        damon.start([SandboxScheme("t", f"/{rel}")])
        assert damon.running
        assert "t" in damon.stats()
        damon.remove("t")
        damon.stop()
        assert not damon.running
    finally:
        if made:
            made.rmdir()
