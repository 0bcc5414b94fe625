"""A few seconds of bench/stress.py (`make stress` runs 64 clients for two
minutes): mixed ops from many clients, a kill -9 of the daemon in the
middle, then re-adoption, idempotent retries and leak checks."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import stress  # noqa: E402


def test_short_stress_with_kill9(daemon_factory, busybox_rootfs):
    d = daemon_factory("[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.close()

    def kill9_and_restart() -> None:
        d.stop(signal.SIGKILL)
        d.start()

    report = asyncio.run(stress.run_stress(d.socket, "busybox", clients=8, seconds=4, state_dir=d.state,
                                           cgroup_dirs=d.cgroup_dirs(), daemon_pid=lambda: d.proc.pid,
                                           kill9_and_restart=kill9_and_restart))
    assert report["failures"] == 0, report["failure_samples"]
    assert report["ops"] > 50 and report["readopted"] > 0
    assert set(report["ops_by_kind"]) >= {"create", "exec", "file", "destroy"}
