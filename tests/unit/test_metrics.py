"""The metrics (dsecd/metrics.py): series from the figures the services keep,
the lifecycle counters fed by events, the endpoint's address parsing."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsecd import metrics
from dsecd.engine import lifelog


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(text: str, name: str, **labels) -> float:
    return _samples(text)[(name, tuple(sorted(labels.items())))]


SNAPSHOT = metrics.Snapshot(
    states={("running", "be"): 3, ("paused", "ls"): 1},
    cpu={"admission": {"state": "open", "cpu": {"requested": 4.0, "capacity": 128.0},
                       "memory": {"requested": 1 << 30, "capacity": 4 << 30}},
         "used": {"sandbox_cores": {"be": 0.5, "ls": 0.25}, "host_cpu_pct": 40.0}},
    admission={"active": 2, "queued": 5, "max_active": 16, "max_queued": 100, "admitted": 40,
               "rejected_busy": 3, "pools": {"busybox@1cpu-512M": {"ready": 2, "creating": 1, "taken": 9}},
               "drain": {"drained": True, "reason": "kernel update", "since": 1.0}},
    fncall={"zygote_calls": 7, "plain_calls": 2, "busy": 1, "inflight": 0, "zygotes_started": 1,
            "zygotes_replaced": 0},
    memory={"zram": {"on": True, "size": 4096, "used": 1024,
                     "stats": {"orig_data_size": 1000, "compr_data_size": 300, "mem_used_total": 400, "mem_limit": 0}},
            "swapfile": {"on": False}},
    images={"pager": {"cache_used": 10, "cache_max": 0, "blobs": {
        "aa": {"fetches": 2, "fetched_bytes": 100, "chunk_hits": 5, "chunk_misses": 2, "kernel_read_bytes": 80,
               "evictions": 0, "errors": 0, "corrupt": 0},
        "bb": {"fetches": 1, "fetched_bytes": 50, "chunk_hits": 1, "chunk_misses": 1, "kernel_read_bytes": 40,
               "evictions": 0, "errors": 0, "corrupt": 0}},
        "fetch_latency": {"bounds_ns": (100_000, 1_000_000, 10_000_000), "counts": (1, 1, 0, 1),
                          "sum_ns": 30_000_000}}},
    net={"denied_connect": 4, "denied_sendmsg": 1, "dropped_packets": 0, "dns": {"queries": 9, "refused": 2}},
    denials={"monitor": "on", "total": 5, "unattributed": 1, "lost": 2, "watched_sandboxes": 3,
             "by_policy_kind": {"agent": {"file": 3, "signal": 1}, "inline": {"socket": 1}},
             "unattributed_by_kind": {"file": 1}},
    connections=6)


def test_the_figures_services_keep_become_series(monkeypatch):
    monkeypatch.setattr(metrics.COLLECTOR, "snapshot", SNAPSHOT)
    body, ctype = metrics.render()
    text = body.decode()
    assert ctype.startswith("text/plain")
    assert _value(text, "dsecd_sandboxes", state="running", qos="be") == 3
    assert _value(text, "dsecd_sandboxes", state="paused", qos="ls") == 1
    assert _value(text, "dsecd_committed_cpu_cores") == 4 and _value(text, "dsecd_capacity_cpu_cores") == 128
    assert _value(text, "dsecd_committed_memory_bytes") == 1 << 30
    assert _value(text, "dsecd_create_queue", what="queued") == 5
    assert _value(text, "dsecd_admission_rejected_total") == 3
    assert _value(text, "dsecd_drained") == 1
    assert _value(text, "dsecd_pool_taken_total", pool="busybox@1cpu-512M") == 9
    assert _value(text, "dsecd_calls_total", path="zygote") == 7
    assert _value(text, "dsecd_zram_bytes", what="orig") == 1000
    assert _value(text, "dsecd_zram_bytes", what="mem_used") == 400
    # How full it is (an alert before paused sandboxes' pages have nowhere to go).
    assert _value(text, "dsecd_zram_bytes", what="size") == 4096
    assert _value(text, "dsecd_zram_bytes", what="used") == 1024
    assert _value(text, "dsecd_pager_fetched_bytes_total") == 150
    assert _value(text, "dsecd_pager_chunk_lookups_total", result="hit") == 6
    assert _value(text, "dsecd_net_denied_total", reason="connect") == 4
    assert _value(text, "dsecd_dns_total", outcome="refused") == 2
    assert _value(text, "dsecd_connections") == 6
    assert _value(text, "dsecd_pager_fetch_seconds_bucket", le="0.001") == 2
    assert _value(text, "dsecd_pager_fetch_seconds_bucket", le="0.01") == 2
    assert _value(text, "dsecd_pager_fetch_seconds_bucket", le="+Inf") == 3
    assert _value(text, "dsecd_pager_fetch_seconds_count") == 3
    assert _value(text, "dsecd_pager_fetch_seconds_sum") == pytest.approx(0.03)
    assert _value(text, "dsecd_policy_denials_total", policy="agent", kind="file") == 3
    assert _value(text, "dsecd_policy_denials_total", policy="inline", kind="socket") == 1
    assert _value(text, "dsecd_policy_denials_unattributed_total", kind="file") == 1
    assert _value(text, "dsecd_policy_denials_lost_total") == 2
    assert _value(text, "dsecd_policy_denial_monitor", state="on") == 1
    assert _value(text, "dsecd_policy_denial_monitor", state="off") == 0
    assert _value(text, "dsecd_policy_watched_sandboxes") == 3
    assert not any(name.startswith("dsecd_sandbox_cpu_percent") for name, _ in _samples(text))


def test_sandbox_counts_go_back_to_zero_when_none_are_left(monkeypatch):
    # A state with no sandbox left must read 0, not vanish: a vanished series
    # is "no data" to Prometheus, and the last paused sandbox resumed would
    # leave the dashboard's paused line at its old value until it went stale.
    monkeypatch.setattr(metrics.COLLECTOR, "snapshot", metrics.Snapshot())
    text = metrics.render()[0].decode()
    for state in ("creating", "running", "paused", "stopping"):
        for qos in ("be", "ls"):
            assert _value(text, "dsecd_sandboxes", state=state, qos=qos) == 0


def test_per_sandbox_series_only_when_asked(monkeypatch):
    snap = metrics.Snapshot(sandboxes=[{"id": "ab12", "qos": "be", "cpu_pct": 12.5, "throttled_pct": None,
                                        "memory": 4096, "memory_limit": 1 << 20}])
    monkeypatch.setattr(metrics.COLLECTOR, "snapshot", snap)
    text = metrics.render()[0].decode()
    assert _value(text, "dsecd_sandbox_cpu_percent", sandbox="ab12", qos="be") == 12.5
    assert _value(text, "dsecd_sandbox_memory_bytes", sandbox="ab12") == 4096


def test_the_idle_balloon_of_microvms(monkeypatch):
    snap = metrics.Snapshot(balloon={"enabled": True, "vms": 4, "ballooned": 2, "skipped": 1,
                                     "held_bytes": 300 << 20, "inflates": 5, "deflates_wake": 3,
                                     "deflates_pressure": 1},
                            sandboxes=[{"id": "vm1", "qos": "be", "cpu_pct": None, "throttled_pct": None,
                                        "memory": None, "memory_limit": 256 << 20, "vm_guest_size": 128 << 20}])
    monkeypatch.setattr(metrics.COLLECTOR, "snapshot", snap)
    text = metrics.render()[0].decode()
    assert _value(text, "dsecd_vm_balloon_vms", state="ballooned") == 2
    assert _value(text, "dsecd_vm_balloon_vms", state="full") == 1
    assert _value(text, "dsecd_vm_balloon_vms", state="skipped") == 1
    assert _value(text, "dsecd_vm_balloon_held_bytes") == 300 << 20
    assert _value(text, "dsecd_vm_balloon_changes_total", kind="pressure") == 1
    assert _value(text, "dsecd_sandbox_vm_guest_bytes", sandbox="vm1") == 128 << 20
    monkeypatch.setattr(metrics.COLLECTOR, "snapshot", metrics.Snapshot(balloon={"enabled": False}))
    assert "dsecd_vm_balloon" not in metrics.render()[0].decode()


def test_a_pager_without_the_histogram_and_a_monitor_that_is_off(monkeypatch):
    pager = {k: v for k, v in SNAPSHOT.images["pager"].items() if k != "fetch_latency"}
    snap = metrics.Snapshot(images={"pager": pager}, denials={"monitor": "off: sandbox.policy_denials = false",
                                                              "total": 0, "unattributed": 0, "lost": 0,
                                                              "watched_sandboxes": 0})
    monkeypatch.setattr(metrics.COLLECTOR, "snapshot", snap)
    text = metrics.render()[0].decode()
    assert _value(text, "dsecd_pager_fetches_total") == 3
    assert not any(name.startswith("dsecd_pager_fetch_seconds") for name, _ in _samples(text))
    assert _value(text, "dsecd_policy_denial_monitor", state="off") == 1
    assert _value(text, "dsecd_policy_denial_monitor", state="on") == 0


def test_openmetrics_when_the_scraper_asks():
    body, ctype = metrics.render("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and body.rstrip().endswith(b"# EOF")


def _count(name: str, **labels) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_lifecycle_events_move_their_counters():
    c0, d0 = _count("dsecd_sandboxes_created_total", qos="ls"), _count("dsecd_sandboxes_destroyed_total",
                                                                       reason="ttl")
    r0, o0 = _count("dsecd_pause_reclaimed_bytes_total"), _count("dsecd_oom_kills_total")
    n0 = _count("dsecd_resume_duration_seconds_count")
    lifelog.on_event({"event": "created", "sandbox": "a", "qos": "ls", "duration_ms": 40.0})
    lifelog.on_event({"event": "destroyed", "sandbox": "a", "reason": "ttl"})
    lifelog.on_event({"event": "paused", "sandbox": "a", "freed_bytes": 4096})
    lifelog.on_event({"event": "resumed", "sandbox": "a", "prefetched_bytes": 0, "duration_ms": 3.0})
    lifelog.on_event({"event": "oom", "sandbox": "a", "kills": 2})
    assert _count("dsecd_sandboxes_created_total", qos="ls") == c0 + 1
    assert _count("dsecd_sandboxes_destroyed_total", reason="ttl") == d0 + 1
    assert _count("dsecd_pause_reclaimed_bytes_total") == r0 + 4096
    assert _count("dsecd_oom_kills_total") == o0 + 2
    assert _count("dsecd_resume_duration_seconds_count") == n0 + 1


def test_millisecond_execs_and_calls_fall_in_buckets_of_their_size():
    # An exec or a call through the zygote takes 1-2 ms: with 5 ms as the
    # smallest bucket every one of them fell in it, and the dashboard's p99
    # (histogram_quantile) read ~5 ms whatever they took.
    for hist, name in ((metrics.EXEC_SECONDS, "dsecd_exec_duration_seconds"),
                       (metrics.CALL_SECONDS, "dsecd_call_duration_seconds")):
        hist.labels("bucket-test").observe(0.0012)
        hist.labels("bucket-test").observe(0.0018)
        label = "backend" if hist is metrics.EXEC_SECONDS else "path"
        assert _count(f"{name}_bucket", **{label: "bucket-test", "le": "0.001"}) == 0
        assert _count(f"{name}_bucket", **{label: "bucket-test", "le": "0.0025"}) == 2


@pytest.mark.parametrize("value,want", [("127.0.0.1:9464", ("127.0.0.1", 9464)), ("[::1]:9464", ("::1", 9464)),
                                        ("localhost:1", ("localhost", 1)), ("/run/dsecd/metrics.sock",
                                                                            "/run/dsecd/metrics.sock")])
def test_listen_takes_host_port_or_a_socket_path(value, want):
    assert metrics.parse_listen(value) == want


@pytest.mark.parametrize("value", ["9464", ":9464", "host:", "host:0", "host:70000", "relative.sock"])
def test_listen_refuses_what_it_cannot_bind(value):
    with pytest.raises(ValueError, match="metrics.listen"):
        metrics.parse_listen(value)


def test_the_grafana_dashboard_names_only_series_the_daemon_serves(monkeypatch):
    """ops/grafana-dsecd.json: every metric its queries name is one a scrape
    has (with every source present), so a renamed metric fails here."""
    import json
    import re
    from pathlib import Path

    monkeypatch.setattr(metrics.COLLECTOR, "snapshot", SNAPSHOT)
    for hist, labels in ((metrics.EXEC_SECONDS, ("init",)), (metrics.CALL_SECONDS, ("zygote",)),
                         (metrics.JOURNAL_FSYNC, ("journal",)), (metrics.IMAGE_BUILD_SECONDS, ("build",))):
        hist.labels(*labels)                          # labelled series exist once used
    metrics.DESTROYS.labels("request")
    metrics.CREATES.labels("burst")
    metrics.REQUESTS.labels("create", "ok")
    metrics.IMAGE_BUILDS.labels("build", "ok")
    served = {s.name for fam in text_string_to_metric_families(metrics.render()[0].decode()) for s in fam.samples}
    dash = json.loads((Path(__file__).resolve().parents[2] / "ops" / "grafana-dsecd.json").read_text())
    named = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"\b(?:dsecd|process)_\w+", t["expr"])}
    assert named and named <= served, sorted(named - served)


def _start_endpoint(path) -> metrics.MetricsServer:
    import asyncio

    async def start():
        server = metrics.MetricsServer(None, str(path), False, set)
        await server.start()
        await server.stop()

    asyncio.run(start())


def test_a_socket_path_naming_a_file_leaves_the_file_alone(tmp_path):
    """metrics.listen naming a file that is not a socket (a typo, the
    journal) stops the start, saying so; the file is kept as it was."""
    kept = tmp_path / "journal"
    kept.write_text("records\n")
    with pytest.raises(ValueError, match="not a socket"):
        _start_endpoint(kept)
    assert kept.read_text() == "records\n"


def test_a_socket_path_something_serves_is_not_taken_over(tmp_path):
    """metrics.listen naming the daemon's own socket (or another server's)
    stops the start; the socket stays with the server that has it."""
    import socket

    path = tmp_path / "dsecd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        with pytest.raises(ValueError, match="already serves"):
            _start_endpoint(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))
            assert live.accept()[0] is not None


def test_a_socket_a_dead_daemon_left_is_replaced(tmp_path):
    import socket

    path = tmp_path / "metrics.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))
    _start_endpoint(path)
    assert not path.exists()


@pytest.mark.parametrize("listen,url", [("127.0.0.1:9464", "http://127.0.0.1:9464/metrics"),
                                        ("[::1]:9464", "http://[::1]:9464/metrics"),
                                        ("/run/dsecd/metrics.sock", "/run/dsecd/metrics.sock")])
def test_the_endpoint_is_described_as_a_url_curl_takes(listen, url):
    """The `ready` log line and the "metrics on" line name it so."""
    assert metrics.MetricsServer(None, listen, False, set).describe() == url


def test_every_series_served_is_in_the_operations_doc(monkeypatch):
    """docs/operations.md, section 4, names each dsecd_ family a scrape can
    hold (with every source present); `_name` after a full name shares its
    prefix (`dsecd_pager_fetches_total`, `_errors_total`)."""
    import dataclasses
    import re
    from pathlib import Path

    monkeypatch.setattr(metrics.COLLECTOR, "snapshot", dataclasses.replace(SNAPSHOT, balloon={
        "enabled": True, "vms": 1, "ballooned": 0, "skipped": 0, "held_bytes": 0, "inflates": 0,
        "deflates_wake": 0, "deflates_pressure": 0}))
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    named = set()
    for row in re.findall(r"^\| (`.*?) \|", doc, re.M):
        prefix = ""
        for name in re.findall(r"`(_?\w+)", row):
            if name.startswith("dsecd_"):
                prefix = name.removesuffix("_total").rpartition("_")[0]
            elif name.startswith("_") and prefix:
                name = prefix + name
            named.add(name.removesuffix("_total"))
    served = {fam.name for fam in text_string_to_metric_families(metrics.render()[0].decode())
              if fam.name.startswith("dsecd_") and not fam.name.endswith("_created")}
    per_sandbox = {"dsecd_sandbox_cpu_percent", "dsecd_sandbox_throttled_percent", "dsecd_sandbox_memory_bytes",
                   "dsecd_sandbox_memory_limit_bytes", "dsecd_sandbox_vm_guest_bytes"}    # named in the text
    assert served - per_sandbox <= named, sorted(served - per_sandbox - named)


def test_counters_of_known_labels_are_served_at_zero_before_their_first_event():
    """A series that first shows up at 1 has no earlier sample: increase()
    and rate() over it miss that first event (an alert on the first expiry
    or failed build after each daemon start never fires), and a dashboard
    shows "no data" instead of 0. Read from a fresh interpreter: in this
    one other tests' events make the series."""
    import subprocess
    import sys

    code = "from dsecd import metrics; import sys; sys.stdout.write(metrics.render()[0].decode())"
    text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    samples = _samples(text)
    want = [("dsecd_sandboxes_created_total", {"qos": q}) for q in ("be", "ls")]
    want += [("dsecd_sandboxes_destroyed_total", {"reason": r})
             for r in ("request", "job", "all", "ttl", "lease", "idle_ttl", "pool")]
    want += [("dsecd_sandboxes_expired_total", {"reason": r}) for r in ("ttl", "lease", "idle_ttl")]
    want += [("dsecd_image_builds_total", {"kind": k, "result": r})
             for k in ("build", "dockerfile", "pull", "snapshot") for r in ("ok", "failed")]
    missing = [(name, labels) for name, labels in want if samples.get((name, tuple(sorted(labels.items())))) != 0]
    assert not missing, missing


def test_a_scraper_that_stops_reading_is_dropped(tmp_path, monkeypatch):
    """A scraper that sends its GET and then reads nothing (stopped, hung,
    a peer gone silent) must not hold its connection and the rendered
    body for ever: past metrics.WRITE_TIMEOUT_S its connection is closed.
    The body is bigger than any socket buffer, as per-sandbox series on a
    busy host are."""
    import asyncio
    import socket

    monkeypatch.setattr(metrics, "WRITE_TIMEOUT_S", 0.5)
    ended = asyncio.Event

    async def run():
        done = ended()
        serve = metrics.MetricsServer._serve

        async def serve_and_say(self, reader, writer):
            try:
                await serve(self, reader, writer)
            finally:
                done.set()

        monkeypatch.setattr(metrics.MetricsServer, "_serve", serve_and_say)

        async def big_scrape(self, accept=""):
            return b"x" * (64 << 20), "text/plain"

        monkeypatch.setattr(metrics.MetricsServer, "scrape", big_scrape)
        path = tmp_path / "metrics.sock"
        server = metrics.MetricsServer(None, str(path), False, set)
        await server.start()
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await asyncio.get_running_loop().run_in_executor(None, stalled.connect, str(path))
            stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            # A hang guard, not a measure: without the write deadline the
            # handler waits for the reader for ever.
            await asyncio.wait_for(done.wait(), 30)
        finally:
            stalled.close()
            await server.stop()

    asyncio.run(run())


def test_a_source_that_does_not_answer_costs_the_scrape_only_its_own_series(monkeypatch):
    """A blocking source (the memory service's sysfs reads, the pager's
    stats, BPF maps) read in a worker that never comes back (every worker
    stuck on a hung store, a read that hangs): the scrape still answers in
    bounded time with the other series and counts the source as an error,
    and later scrapes do not queue another read behind the stuck one."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from dsecd.engine.workers import Workers

    monkeypatch.setattr(metrics, "SOURCE_TIMEOUT_S", 0.2)
    release = threading.Event()
    asked = []

    def stuck_memory_info():
        asked.append(1)
        release.wait(30)
        return {"swapfile": {"on": False, "size": 4096}}

    async def drop_totals():
        return {}

    workers = Workers(4)
    node = SimpleNamespace(
        registry=SimpleNamespace(by_id={}, requested=lambda: {}), sb_defaults={"cpu": 1.0}, default_memory=1,
        cpu_info=dict, create_service=SimpleNamespace(info=dict),
        call_service=SimpleNamespace(info=dict), vm_balloon=SimpleNamespace(info=dict),
        memory=SimpleNamespace(info=stuck_memory_info), image_service=SimpleNamespace(info=dict),
        net_service=SimpleNamespace(drop_totals=drop_totals), denials=SimpleNamespace(info=dict), workers=workers)

    async def run():
        workers.start(asyncio.get_running_loop())
        try:
            # Hang guards, not measures: without the source's deadline take() waits for ever.
            first = await asyncio.wait_for(metrics.Snapshot.take(node, 3, False), 30)
            second = await asyncio.wait_for(metrics.Snapshot.take(node, 3, False), 30)
            asked_while_stuck = len(asked)
            release.set()
            await asyncio.sleep(0)
            for _ in range(300):
                third = await asyncio.wait_for(metrics.Snapshot.take(node, 3, False), 30)
                if not third.errors:
                    break
            return first, second, third, asked_while_stuck
        finally:
            release.set()

    try:
        first, second, third, asked_while_stuck = asyncio.run(run())
    finally:
        workers.pool.shutdown(wait=True)
    assert first.connections == 3 and [e.split(":")[0] for e in first.errors] == ["memory"], first.errors
    assert [e.split(":")[0] for e in second.errors] == ["memory"], second.errors
    assert third.errors == [] and third.memory["swapfile"]["size"] == 4096
    assert asked_while_stuck == 1, f"the stuck read was asked again {asked_while_stuck - 1} time(s)"
