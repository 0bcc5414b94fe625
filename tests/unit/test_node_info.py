"""`info` (Node.info): what it answers when a source it reads in a worker
does not answer."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from dsecd import metrics
from dsecd.engine.workers import Workers
from dsecd.node import Node


def test_info_answers_without_a_source_that_does_not_and_says_which(monkeypatch):
    """`dsec info` is what an operator runs first when a host misbehaves:
    with every worker stuck (a hung shared store) or a read hanging, it
    must still answer, with the figures it could read and which it could
    not, rather than hang with them."""
    monkeypatch.setattr(metrics, "SOURCE_TIMEOUT_S", 0.2)
    release = threading.Event()

    def stuck_images_info():
        release.wait(30)
        return {"mode": "direct"}

    workers = Workers(2)
    info = Node.info.__get__(SimpleNamespace(
        registry=SimpleNamespace(by_id={}, requested=lambda: {}),
        cfg=SimpleNamespace(section=lambda name: {"daemon": {"socket": "/s", "log_level": "info",
                                                             "log_format": "json"},
                                                  "metrics": {"listen": ""}}[name],
                            state_dir="/state", path=None),
        sb_defaults={"cgroup_root": "dsecd", "cpu": 1.0}, default_memory=1, started=0.0,
        features=SimpleNamespace(to_dict=dict), wire_limits=dict, cpu_info=dict,
        workers=workers, image_service=SimpleNamespace(info=stuck_images_info),
        memory=SimpleNamespace(info=lambda: {"zram": {"on": False}}),
        net_service=SimpleNamespace(net_info=dict), call_service=SimpleNamespace(info=dict),
        vms=SimpleNamespace(info=dict, template_info=dict), create_service=SimpleNamespace(info=dict, drain_info=dict),
        id_ranges=SimpleNamespace(info=dict), policies=SimpleNamespace(info=dict),
        denials=SimpleNamespace(info=dict), layout=SimpleNamespace(hierarchies=dict), loop_monitor=None, code_info=lambda: None,
        reloader=None))

    async def run():
        workers.start(asyncio.get_running_loop())
        try:
            # A hang guard, not a measure: without the deadline info waits for ever.
            return await asyncio.wait_for(info(None, None), 30)
        finally:
            release.set()

    try:
        out = asyncio.run(run())
    finally:
        workers.pool.shutdown(wait=True)
    assert out["memory"] == {"zram": {"on": False}} and out["images"] == {}, out
    assert [u.split(":")[0] for u in out["unread"]] == ["images"], out["unread"]


def test_the_status_line_says_a_host_is_drained():
    """systemd's STATUS= (`systemctl status dsecd`) is where an operator sees
    a host at a glance: a drained one says so, and how to undo it."""
    def line(drained):
        return Node.status_line(SimpleNamespace(
            registry=SimpleNamespace(by_id={"a": SimpleNamespace(state="running")}),
            create_service=SimpleNamespace(admission=SimpleNamespace(active=0, queued=2), drained=drained)), 3)

    assert line(None) == "sandboxes: 1 running; creates: 0 running, 2 queued; 3 clients"
    assert line({"reason": "", "since": 1.0}).endswith("3 clients; DRAINED (dsec undrain takes creates again)")
