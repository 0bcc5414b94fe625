"""Operations: the metrics endpoint, the daemon's log, systemd's notify
protocol, `dsec top` piped, and what systemd/dsecd.service relies on.

systemd does not run as PID 1 on the test machines, so the unit itself is
not started here (tests/unit/test_systemd_unit.py verifies it offline).
What it relies on is tested instead: sandboxes live outside the daemon's
cgroup and survive its SIGTERM even when everything left in that cgroup is
killed afterwards (what KillMode=process spares them), the daemon works
with the unit's capability bounding set and no_new_privs (setpriv) and
restarts in a new mount namespace as the unit's directives make one
(unit_namespace.sh), and it speaks the notify protocol to a socket of the
test's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import _kill_and_remove_cgroups
from prometheus_client.parser import text_string_to_metric_families

from dsecd.config import with_setting
from dsecd.errors import DsecError, NotFound

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- helpers

def http_get(sock_path: str, path: str = "/metrics", method: str = "GET") -> tuple[int, bytes]:
    """One HTTP/1.0 request over a unix socket: (status, body)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(sock_path)
        s.sendall(f"{method} {path} HTTP/1.0\r\nHost: dsecd\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def samples(text: str) -> dict:
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(snap: dict, name: str, **labels) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, lab), v in snap.items() if n == name and labels.items() <= dict(lab).items())


def log_lines(d) -> list[dict]:
    """Every line of the daemon's log, each parsed as JSON (a line that is not fails the test)."""
    out = []
    for n, line in enumerate(d.log.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except ValueError:
            pytest.fail(f"{d.log} line {n} is not JSON: {line[:300]!r}")
    return out


def wait_for(what, timeout: float = 10.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


OOM_LOOP = 'x=aaaaaaaaaaaaaaaa; while :; do x="$x$x"; done'


@pytest.fixture
def metrics_daemon(daemon_factory, busybox_rootfs, tmp_path):
    sock = tmp_path / "run" / "metrics.sock"          # its directory made by the daemon, as the socket's is
    d = daemon_factory(f'[metrics]\nlisten = "{sock}"\n')
    d.metrics = str(sock)
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.close()
    return d


# ---------------------------------------------------------------- metrics

def test_counters_move_with_create_exec_pause_and_destroy(metrics_daemon):
    d = metrics_daemon
    assert stat.S_IMODE(os.stat(d.metrics).st_mode) == 0o660
    status, body = http_get(d.metrics)
    assert status == 200
    before = samples(body.decode())
    c = d.client()
    sb = c.create(image="busybox", memory="64M", labels={"job": "m1"})
    assert sb.exec(["true"]).exit_code == 0
    sb.pause()
    mid = samples(http_get(d.metrics)[1].decode())
    assert total(mid, "dsecd_sandboxes", state="paused") == 1
    sb.resume()
    assert sb.exec(["true"]).exit_code == 0
    sb.destroy()
    with pytest.raises(NotFound):
        c.request("exec", sandbox="000000000000", argv=["true"])
    c.close()
    after = samples(http_get(d.metrics)[1].decode())

    def moved(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("dsecd_sandboxes_created_total") == 1
    assert moved("dsecd_create_duration_seconds_count") == 1
    assert moved("dsecd_exec_duration_seconds_count") == 2
    assert moved("dsecd_pauses_total") == 1 and moved("dsecd_resumes_total") == 1
    assert moved("dsecd_pause_reclaimed_bytes_total") >= 0
    assert moved("dsecd_resume_duration_seconds_count") == 1
    assert moved("dsecd_sandboxes_destroyed_total", reason="request") == 1
    assert moved("dsecd_requests_total", op="create", result="ok") == 1
    assert moved("dsecd_requests_total", op="exec", result="not_found") == 1
    assert moved("dsecd_admission_wait_seconds_count") == 1
    assert moved("dsecd_journal_appends_total", log="journal") >= 3
    assert total(after, "dsecd_sandboxes") == 0
    # The loop monitor's first sample comes one tick (0.1 s) after start-up,
    # which a quick create-to-destroy can beat.
    assert wait_for(lambda: total(samples(http_get(d.metrics)[1].decode()),
                                  "dsecd_event_loop_lag_seconds_count") > 0, timeout=5)
    assert total(after, "dsecd_committed_cpu_cores") == 0 and total(after, "dsecd_capacity_cpu_cores") > 0
    assert total(after, "process_resident_memory_bytes") > 0          # the library's process collector
    assert http_get(d.metrics, "/nothing")[0] == 404
    assert http_get(d.metrics, method="POST")[0] == 405
    status, body = http_get(d.metrics, method="HEAD")
    assert status == 200 and body == b""


def test_an_oom_kill_is_counted(metrics_daemon):
    d = metrics_daemon
    before = samples(http_get(d.metrics)[1].decode())
    c = d.client()
    sb = c.create(image="busybox", memory="32M")
    sb.exec(["sh", "-c", OOM_LOOP], timeout=60)
    assert wait_for(lambda: total(samples(http_get(d.metrics)[1].decode()), "dsecd_oom_kills_total")
                    > total(before, "dsecd_oom_kills_total"))
    sb.destroy()
    c.close()


def test_dockerfile_builds_are_counted(metrics_daemon, tmp_path):
    d = metrics_daemon
    before = samples(http_get(d.metrics)[1].decode())
    c = d.client()
    c.build_dockerfile(str(tmp_path), "configured", text="FROM busybox\nENV STAGE=metrics\n")
    with pytest.raises(DsecError):
        c.build_dockerfile(str(tmp_path), "broken", text="FROM no-such-image\n")
    c.close()
    after = samples(http_get(d.metrics)[1].decode())

    def moved(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("dsecd_image_builds_total", kind="dockerfile", result="ok") == 1
    assert moved("dsecd_image_builds_total", kind="dockerfile", result="failed") == 1
    assert moved("dsecd_image_build_duration_seconds_count", kind="dockerfile") == 1
    assert moved("dsecd_image_builds_total", kind="build") == 0


def test_task_policy_denials_are_counted_by_policy_and_kind(metrics_daemon):
    """Real Landlock denials under the shipped `agent` policy: a hidden file
    (file), a TCP port it may not connect to (socket), a signal to a process
    outside the exec (signal)."""
    d = metrics_daemon
    before = samples(http_get(d.metrics)[1].decode())
    c = d.client()
    sb = c.create(image="busybox", memory="64M")
    sb.write_file("/grader/secret", b"the expected answer\n")
    results = {
        "file": sb.exec(["cat", "/grader/secret"], policy="agent"),
        "socket": sb.exec(["nc", "-w", "1", "127.0.0.1", "8080"], policy="agent"),
        "signal": sb.exec(["kill", "-0", "1"], policy="agent"),
    }
    for kind, r in results.items():
        assert r.exit_code != 0 and r.denials >= 1, (kind, r.exit_code, r.stderr, r.denials)
    assert sb.exec(["cat", "/grader/secret"], policy="grader").exit_code == 0    # not denied, not counted
    mid = samples(http_get(d.metrics)[1].decode())
    sb.destroy()
    after = samples(http_get(d.metrics)[1].decode())
    c.close()

    def moved(name, **labels):
        return total(mid, name, **labels) - total(before, name, **labels)

    for kind in results:
        assert moved("dsecd_policy_denials_total", policy="agent", kind=kind) >= 1, kind
    assert moved("dsecd_policy_denials_total") == sum(r.denials for r in results.values())
    assert total(mid, "dsecd_policy_denials_total", policy="grader") == 0
    assert total(mid, "dsecd_policy_denial_monitor", state="on") == 1
    assert total(mid, "dsecd_policy_denial_monitor") == 1                  # one state at a time
    assert total(mid, "dsecd_policy_watched_sandboxes") == 1
    assert total(after, "dsecd_policy_watched_sandboxes") == 0
    assert ("dsecd_policy_denials_lost_total", ()) in after


def test_lazy_paged_reads_move_the_pager_series(daemon_factory, busybox_rootfs, tmp_path):
    """A sandbox of a lazily paged image reads a file: its chunks are fetched
    (and timed); the same chunks read again through the pager are hits."""
    sock = tmp_path / "metrics.sock"
    d = daemon_factory(f'[metrics]\nlisten = "{sock}"\n[images]\nmode = "lazy"\n'
                       '[pager]\nreadahead_chunks = 0\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")

    def scrape():
        return samples(http_get(str(sock))[1].decode())

    before = scrape()
    assert total(before, "dsecd_pager_fetch_seconds_count") == total(before, "dsecd_pager_fetches_total")
    sb = c.create(image="busybox")
    assert sb.exec(["cat", "/bin/busybox"]).exit_code == 0
    mid = scrape()
    fetched = total(mid, "dsecd_pager_fetches_total") - total(before, "dsecd_pager_fetches_total")
    assert fetched > 0 and total(mid, "dsecd_pager_fetched_bytes_total") > total(before,
                                                                                 "dsecd_pager_fetched_bytes_total")
    assert total(mid, "dsecd_pager_fetch_seconds_count") == total(mid, "dsecd_pager_fetches_total")
    assert total(mid, "dsecd_pager_fetch_seconds_sum") > total(before, "dsecd_pager_fetch_seconds_sum")
    assert total(mid, "dsecd_pager_fetch_seconds_bucket", le="+Inf") == total(mid, "dsecd_pager_fetches_total")
    assert total(mid, "dsecd_pager_chunk_lookups_total", result="miss") > total(
        before, "dsecd_pager_chunk_lookups_total", result="miss")
    # The layers the sandbox read, read again through the pager's own files:
    # the chunks it fetched are in the cache now.
    opened = [f.name.removesuffix(".bitmap") for f in (d.state / "pager-cache").glob("*.bitmap")]
    assert opened
    for hexd in opened:
        with open(d.state / "pager" / hexd, "rb") as f:
            while f.read(1 << 20):
                pass
    after = scrape()
    assert total(after, "dsecd_pager_chunk_lookups_total", result="hit") >= total(
        mid, "dsecd_pager_chunk_lookups_total", result="hit") + fetched
    assert total(after, "dsecd_pager_fetch_seconds_count") == total(after, "dsecd_pager_fetches_total")
    sb.destroy()
    c.close()


# ---------------------------------------------------------------- the log

def test_every_log_line_is_json_through_create_exec_oom_pause_destroy(daemon_factory, busybox_rootfs):
    d = daemon_factory()        # log_level debug (conftest), log_format json (the default)
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="32M", cpu=0.5, labels={"job": "j1"})
    assert sb.exec(["echo", "hi"]).stdout == b"hi\n"
    sb.exec(["sh", "-c", OOM_LOOP], timeout=60)
    sb.pause()
    sb.resume()
    with pytest.raises(NotFound):
        c.request("exec", sandbox="000000000000", argv=["true"])
    wait_for(lambda: any(ln.get("event") == "oom" for ln in log_lines(d)), timeout=5)
    sb.destroy()
    c.close()
    d.stop()
    lines = log_lines(d)
    for ln in lines:
        assert {"ts", "level", "logger", "msg"} <= ln.keys(), ln
        assert ln["level"] in ("debug", "info", "warning", "error", "critical"), ln
    events = {ln["event"]: ln for ln in lines if ln.get("logger") == "dsecd.lifecycle"}
    created = events["created"]
    assert created["sandbox"] == sb.id and created["image"] == "busybox" and created["job"] == "j1"
    assert created["qos"] == "be" and created["cpu"] == 0.5 and created["memory"] == 32 << 20
    assert created["duration_ms"] > 0 and created["level"] == "info"
    assert events["oom"]["kills"] >= 1 and events["oom"]["level"] == "warning"
    assert events["paused"]["freed_bytes"] >= 0 and events["resumed"]["duration_ms"] >= 0
    assert events["destroyed"]["reason"] == "request" and events["destroyed"]["previous_state"] == "running"
    assert any(ln.get("event") == "ready" for ln in lines)
    conns = [ln for ln in lines if ln["msg"].startswith("connection from")]
    assert conns and all(ln["level"] == "debug" for ln in conns)
    refused = [ln for ln in lines if ln.get("op") == "exec" and ln.get("code") == "not_found"]
    assert refused and refused[0]["level"] == "debug", "a client's own error is debug chatter"


def test_logfmt_lines(daemon_factory, busybox_rootfs):
    d = daemon_factory(start=False)
    d.config.write_text(d.config.read_text().replace('log_level = "debug"\n',
                                                     'log_level = "debug"\nlog_format = "logfmt"\n'))
    d.start()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.create(image="busybox").destroy()
    c.close()
    d.stop()
    lines = d.log.read_text().splitlines()
    assert lines
    for line in lines:
        assert re.match(r'^ts=\S+ level=\w+ logger=\S+ msg=("(?:[^"\\]|\\.)*"|\S*)( \w+=("(?:[^"\\]|\\.)*"|\S*))*$',
                        line), line
    assert any("event=created" in line for line in lines) and any("reason=request" in line for line in lines)


# ---------------------------------------------------------------- systemd's notify protocol

def _datagrams(srv: socket.socket, until, timeout: float = 15.0) -> list[dict]:
    """Notifications received until `until(list)` is true."""
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while not until(got) and time.monotonic() < deadline:
        srv.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            data = srv.recv(4096)
        except TimeoutError:
            break
        got.append(dict(line.split("=", 1) for line in data.decode().splitlines()))
    return got


def test_ready_after_readoption_then_status_watchdog_and_stopping(daemon_factory, busybox_rootfs, tmp_path):
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    kept = c.create(image="busybox")
    c.close()
    d.stop()
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        # A watchdog of 0.6 s: the daemon pings every 0.3 s.
        d.env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "600000"}
        d.start()
        got = _datagrams(srv, lambda g: any("READY" in n for n in g))
        ready = next(n for n in got if "READY" in n)
        assert ready["READY"] == "1" and ready["MAINPID"] == str(d.proc.pid)
        assert "1 running" in ready["STATUS"], "READY comes after re-adoption"
        assert d.client(connect_timeout=5), "READY comes after the socket serves"
        pings = _datagrams(srv, lambda g: sum("WATCHDOG" in n for n in g) >= 3, timeout=5)
        assert sum("WATCHDOG" in n for n in pings) >= 3
        c = d.client()
        c.create(image="busybox")
        c.close()
        status = _datagrams(srv, lambda g: any("2 running" in n.get("STATUS", "") for n in g), timeout=15)
        assert any("2 running" in n.get("STATUS", "") for n in status)
        d.proc.send_signal(signal.SIGTERM)
        bye = _datagrams(srv, lambda g: any("STOPPING" in n for n in g), timeout=15)
        assert any(n.get("STOPPING") == "1" for n in bye)
        d.proc.wait(15)
    d.env = None
    d.start()
    c = d.client()
    assert c.get(kept.id).exec(["true"]).exit_code == 0
    c.close()


def reloaded(d, config: str, count: int = 1) -> dict:
    """`config` written as the daemon's file, SIGHUP, and the daemon's
    account of its `count`th reload since the start (info's last_reload)."""
    d.config.write_text(config)
    d.proc.send_signal(signal.SIGHUP)
    done = wait_for(lambda: [line for line in log_lines(d) if line.get("event") in ("reloaded", "reload_refused")]
                    [count - 1:], timeout=15)
    assert d.proc.poll() is None, "SIGHUP ended the daemon"
    assert done, f"no reload logged; see {d.log}"
    c = d.client()
    try:
        return c.info()["daemon"]["last_reload"]
    finally:
        c.close()


def test_sighup_applies_the_settings_a_running_daemon_can_take(daemon_factory, busybox_rootfs):
    """SIGHUP only logged that nothing was reloaded: a change of the log
    level or of admission's limits took a restart. It reads the file again
    and applies those at once, one line each."""
    d = daemon_factory('[daemon]\nlog_level = "info"\n[limits]\nmax_sandboxes = 1\n')
    before = d.config.read_text()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.create(image="busybox")               # the host is full: max_sandboxes 1
    loaded = c.info()["daemon"]["config_loaded_at"]
    assert loaded and c.info()["daemon"]["last_reload"] is None
    c.close()
    new = before.replace('log_level = "info"', 'log_level = "debug"') + (
        "\n[admission]\nmax_active_creates = 3\nmax_queued_creates = 5\nfull_retry_after_s = 7.5\n"
        "\n[fncall]\nmax_boxes = 2\n")
    r = reloaded(d, new)
    assert r["ok"] and r["error"] is None and r["config"] == str(d.config), r
    assert sorted(r["applied"]) == ["admission.full_retry_after_s", "admission.max_active_creates",
                                    "admission.max_queued_creates", "daemon.log_level", "fncall.max_boxes"], r
    assert r["restart_needed"] == [], r
    said = {line["key"]: line for line in log_lines(d) if line.get("event") == "setting_changed"}
    assert said["admission.max_active_creates"]["msg"] == "admission.max_active_creates changed: now 3 (was 16)"
    c = d.client()
    info = c.info()
    assert info["daemon"]["log_level"] == "debug" and info["daemon"]["config_loaded_at"] > loaded
    assert (info["admission"]["max_active"], info["admission"]["max_queued"]) == (3, 5)
    assert info["fncall"]["max_boxes"] == 2
    with pytest.raises(DsecError) as full:
        c.create(image="busybox")
    assert full.value.code == "busy" and full.value.detail["retry_after_s"] == 7.5, full.value
    c.close()
    # At debug, each connection is logged: the one above was.
    assert any(line.get("level") == "debug" and "connection from" in line["msg"] for line in log_lines(d))


def test_sighup_sweeps_idle_call_sandboxes_by_the_new_idle_ttl(daemon_factory, busybox_rootfs):
    """fncall.idle_ttl_s, reloaded from 0 (no sweep) to a second: the call
    sandbox no call uses goes, as it would have under that setting from the start."""
    d = daemon_factory("[fncall]\nidle_ttl_s = 0.0\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    assert c.call("busybox", argv=["true"]).exit_code == 0
    assert len(c.info()["fncall"]["boxes"]) == 1
    c.close()
    r = reloaded(d, d.config.read_text().replace("idle_ttl_s = 0.0", "idle_ttl_s = 1.0"))
    assert r["ok"] and r["applied"] == ["fncall.idle_ttl_s"], r
    c = d.client()
    try:
        assert c.info()["fncall"]["idle_ttl_s"] == 1.0
        assert wait_for(lambda: not c.info()["fncall"]["boxes"], timeout=15), c.info()["fncall"]
    finally:
        c.close()


def test_a_reload_that_raises_the_log_level_still_says_what_it_did(daemon_factory):
    """daemon.log_level reloaded to warning hid the reload's own info lines
    that came after it: each setting applied, and the summary."""
    d = daemon_factory()
    r = reloaded(d, d.config.read_text().replace('log_level = "debug"', 'log_level = "warning"')
                 + "\n[fncall]\nmax_boxes = 3\n")
    assert r["ok"] and sorted(r["applied"]) == ["daemon.log_level", "fncall.max_boxes"], r
    said = [line.get("key") for line in log_lines(d) if line.get("event") == "setting_changed"]
    assert sorted(said) == ["daemon.log_level", "fncall.max_boxes"], said
    c = d.client()
    try:
        assert c.info()["daemon"]["log_level"] == "warning"
    finally:
        c.close()


def test_a_reload_that_lowers_the_log_level_says_what_it_did(daemon_factory):
    """daemon.log_level reloaded from warning to info was set after the
    reload's own info lines, which the old level hid: the operator who
    asked for them saw nothing of that reload."""
    d = daemon_factory(start=False)
    d.config.write_text(d.config.read_text().replace('log_level = "debug"', 'log_level = "warning"'))
    d.start()
    d.config.write_text(d.config.read_text().replace('log_level = "warning"', 'log_level = "info"')
                        + "\n[fncall]\nmax_boxes = 3\n")
    d.proc.send_signal(signal.SIGHUP)
    c = d.client()
    try:
        r = wait_for(lambda: c.info()["daemon"]["last_reload"], timeout=15)
        assert r and r["ok"] and sorted(r["applied"]) == ["daemon.log_level", "fncall.max_boxes"], r
        assert c.info()["daemon"]["log_level"] == "info"
    finally:
        c.close()
    said = [line.get("key") for line in log_lines(d) if line.get("event") == "setting_changed"]
    assert sorted(said) == ["daemon.log_level", "fncall.max_boxes"], said
    assert [line for line in log_lines(d) if line.get("event") == "reloaded"]


def test_sighup_refuses_a_bad_config_and_says_what_waits_for_a_restart(daemon_factory, busybox_rootfs):
    """A file that fails the check `dsecd --check-config` makes changes
    nothing, in one error line; a valid one's settings that a running
    daemon cannot take are each said to wait for the next start."""
    d = daemon_factory()
    good = d.config.read_text()
    r = reloaded(d, good + "\n[admission]\nmax_active_creates = 2\n[limits]\nmax_sandboxes = 0\n")
    assert not r["ok"] and r["key"] == "limits.max_sandboxes" and "above zero" in r["error"], r
    assert r["applied"] == [] and r["restart_needed"] == [], r
    refused = [line for line in log_lines(d) if line.get("event") == "reload_refused"]
    assert len(refused) == 1 and refused[0]["level"] == "error", refused
    assert "max_sandboxes" in refused[0]["msg"] and "the running settings stay" in refused[0]["msg"], refused
    c = d.client()
    info = c.info()
    c.close()
    assert info["admission"]["max_active"] == 16 and info["limits"]["max_sandboxes"] == 4096
    assert info["daemon"]["last_reload"]["ok"] is False

    r = reloaded(d, with_setting(good, "sandbox", "memory", "1G") + "\n[limits]\nmax_sandboxes = 9\n", count=2)
    assert r["ok"] and r["applied"] == [] and r["restart_needed"] == ["limits.max_sandboxes", "sandbox.memory"], r
    waiting = {line["key"]: line for line in log_lines(d) if line.get("event") == "setting_needs_restart"}
    assert waiting["limits.max_sandboxes"]["level"] == "warning"
    assert waiting["limits.max_sandboxes"]["msg"] == \
        "limits.max_sandboxes changed: takes effect at the next start; still 4096"
    assert waiting["sandbox.memory"]["msg"] == 'sandbox.memory changed: takes effect at the next start; still "512M"'
    c = d.client()
    assert c.info()["limits"]["max_sandboxes"] == 4096
    c.import_image(busybox_rootfs, "busybox")
    assert c.create(image="busybox").exec(["true"]).exit_code == 0
    c.close()


def test_a_metrics_address_in_use_stops_the_start_cleanly(daemon_factory, busybox_rootfs):
    """The endpoint is bound after the sandboxes are adopted and the socket
    serves: a start that fails there must still stop as a clean stop does,
    or the next daemon takes it for a death (its background processes'
    output marked lost, their execs killed) and the socket file stays."""
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="64M")
    sb.spawn("sleep 300")
    c.close()
    d.stop()
    good = d.config.read_text()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        d.config.write_text(good + f'\n[metrics]\nlisten = "127.0.0.1:{taken.getsockname()[1]}"\n')
        with contextlib.suppress(RuntimeError):    # its socket may serve a moment before the failure
            d.start()
        assert d.proc.wait(15) == 1
    failed = [line for line in log_lines(d) if line.get("event") == "start_failed"]
    assert failed and "address already in use" in failed[-1]["msg"], failed
    assert not os.path.exists(d.socket), "the failed start left its socket file"
    assert not (d.state / "dsecd.running").exists(), "the failed start left the mark of a running daemon"
    d.config.write_text(good)
    d.start()
    c = d.client()
    procs = c.request("proc_list", sandbox=sb.id)["processes"]
    assert [p["state"] for p in procs] == ["running"] and not procs[0].get("lost_before"), procs
    c.close()


def test_ready_counts_the_sandboxes_adopted_not_those_found_dead(daemon_factory, busybox_rootfs):
    """A sandbox whose init ended while no daemon ran is logged `died` at
    the start, not `adopted`: the ready line's count agrees with the
    adopted lines and dsecd_sandboxes_adopted_total."""
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    kept, gone = c.create(image="busybox", memory="64M"), c.create(image="busybox", memory="64M")
    init_pid = c.request("inspect", sandbox=gone.id)["init_pid"]
    c.close()
    d.stop(signal.SIGKILL)
    os.kill(init_pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{init_pid}"))
    d.start()
    lines = log_lines(d)
    ready = [line for line in lines if line.get("event") == "ready"][-1]
    adopted = [line["sandbox"] for line in lines if line.get("event") == "adopted"]
    died = [line["sandbox"] for line in lines if line.get("event") == "died"]
    assert adopted == [kept.id] and died == [gone.id], (adopted, died)
    assert ready["adopted"] == 1, ready


def test_a_second_daemon_on_the_same_cgroup_root_is_refused(daemon_factory, busybox_rootfs):
    """A daemon destroys at start every group below its sandbox.cgroup_root
    that its own journal does not name: a second daemon (its own state dir
    and socket, the default cgroup_root, say a test run beside the service)
    killed every sandbox of the first. It is refused, naming the root."""
    first = daemon_factory()
    c = first.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="64M")
    second = daemon_factory(f'[sandbox]\ncgroup_root = "{first.cgroup_root}"\n', start=False)
    with pytest.raises(RuntimeError, match="exited 1"):
        second.start()
    failed = [line for line in log_lines(second) if line.get("event") == "start_failed"]
    assert failed and f"sandbox.cgroup_root '{first.cgroup_root}'" in failed[0]["msg"], failed
    assert "orphan" not in second.log.read_text()
    assert sb.exec(["true"]).exit_code == 0
    c.close()
    first.stop()
    second.start()                     # the root is free again once the first has stopped
    second.stop()



def test_a_cgroup_root_changed_under_live_sandboxes_stops_the_start_saying_why(daemon_factory, busybox_rootfs):
    """Sandboxes made under one sandbox.cgroup_root cannot be taken back
    by a daemon configured with another (it could not freeze, limit or kill
    them): the start stops naming the sandbox and the root it was made
    under, not with a traceback from the first cgroup call; with the root
    set back, the next start adopts it."""
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="64M")
    c.close()
    d.stop()
    good, old = d.config.read_text(), d.cgroup_root
    new = f"dsecd-test-{secrets.token_hex(4)}"
    d.config.write_text(good.replace(old, new))
    try:
        with pytest.raises(RuntimeError, match="exited 1"):
            d.start()
    finally:
        d.cgroup_root = new
        _kill_and_remove_cgroups(d.cgroup_dirs())
        d.cgroup_root = old
    failed = [line for line in log_lines(d) if line.get("event") == "start_failed"]
    assert failed and f"sandbox {sb.id}" in failed[-1]["msg"] and f"sandbox.cgroup_root '{old}'" in failed[-1]["msg"] \
        and "set it back" in failed[-1]["msg"], failed
    assert not [line for line in log_lines(d) if "exc" in line], "a traceback"
    d.config.write_text(good)
    d.start()
    c = d.client()
    assert c.request("inspect", sandbox=sb.id)["state"] == "running"
    c.close()


# ---------------------------------------------------------------- dsec top

def test_top_piped_prints_one_snapshot(daemon, client):
    sb = client.create(image="busybox", memory="64M")
    try:
        r = daemon.cli("top")
        assert r.returncode == 0, r.stderr
        out = r.stdout.decode()
        assert b"\x1b" not in r.stdout, "no terminal codes in a pipe"
        lines = out.splitlines()
        assert lines[0].startswith("host:") and lines[1].split()[:3] == ["ID", "QOS", "STATE"]
        assert any(line.startswith(sb.id) for line in lines[2:])
        r = daemon.cli("top", "--sort", "mem", "--interval", "0.5")
        assert r.returncode == 0 and sb.id.encode() in r.stdout
        top = json.loads(daemon.cli("top", "--json").stdout)
        assert any(s["id"] == sb.id for s in top["sandboxes"])
        r = daemon.cli("top", "--sort", "nonsense")
        assert r.returncode == 2 and b"--sort" in r.stderr
    finally:
        sb.destroy()


# ---------------------------------------------------------------- what the unit relies on

def _cgroup2_mount() -> Path | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[fields.index("-") + 1] == "cgroup2":
                return Path(fields[4])
    return None


def _pids_in(group: Path) -> list[int]:
    out = []
    for dirpath, _dirs, _files in os.walk(group):
        out += [int(p) for p in Path(dirpath, "cgroup.procs").read_text().split()]
    return out


def test_sandboxes_outlive_the_daemon_and_everything_left_in_its_cgroup(daemon_factory, busybox_rootfs):
    """The unit's KillMode=process signals only the daemon; its sandboxes must
    not depend on that. The daemon runs in a cgroup of the test's own (as a
    unit's would be), is stopped with SIGTERM, then everything still in that
    cgroup is killed (what KillMode=control-group would do): the sandboxes
    and their background processes live on, and the next daemon adopts them."""
    v2 = _cgroup2_mount()
    if v2 is None:
        pytest.skip("no cgroup v2 hierarchy mounted")
    unit = v2 / f"dsecd-test-{secrets.token_hex(4)}-unit"
    unit.mkdir()
    try:
        d = daemon_factory(start=False)
        d.preexec = lambda: (unit / "cgroup.procs").write_text("0")
        d.start()
        c = d.client()
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox")
        proc = sb.spawn(["sleep", "600"])
        init = sb.inspect()["init_pid"]
        for pid in (init, proc.pid):
            line = next(x for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if x.startswith("0::"))
            assert not line[3:].startswith(f"/{unit.name}"), f"pid {pid} is in the daemon's cgroup: {line}"
        assert d.proc.pid in _pids_in(unit)
        c.close()
        d.stop(signal.SIGTERM)
        for pid in _pids_in(unit):                # what is left of the "unit": killed
            os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not _pids_in(unit), timeout=10)
        assert os.path.exists(f"/proc/{init}")
        d.preexec = None
        d.start()
        c = d.client()
        again = c.get(sb.id)
        assert again.info["state"] == "running" and again.exec(["true"]).exit_code == 0
        assert any(p["pid"] == proc.pid and p["state"] == "running" for p in c.request(
            "proc_list", sandbox=sb.id)["processes"])
        again.destroy(force=True)
        c.close()
    finally:
        for pid in _pids_in(unit) if unit.exists() else []:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not unit.exists() or not _pids_in(unit), timeout=10)
        if unit.exists():
            unit.rmdir()


UNIT_NAMESPACE = Path(__file__).resolve().parent / "unit_namespace.sh"


def _mount_ns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/mnt")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_restart_in_a_new_mount_namespace_keeps_sandboxes_on_lazy_layers(daemon_factory, busybox_rootfs):
    """Each start of the unit is a new mount namespace (its PrivateMounts=,
    ProtectSystem=, ...), so the next daemon sees neither the layer mounts nor
    the pager's FUSE mount of the one before. unit_namespace.sh makes such a
    namespace per start: the restarted daemon adopts the same pager (through
    its pid) and its sandboxes, which keep reading their lazily paged layers,
    and a new sandbox on the same image reads it too."""
    d = daemon_factory('[images]\nmode = "lazy"\n', start=False)
    d.wrapper = [str(UNIT_NAMESPACE), str(d.tmp)]
    d.start()
    first_ns = _mount_ns(d.proc.pid)
    assert first_ns != _mount_ns(os.getpid())
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="64M")
    sb.write_file("/work/f", b"kept")
    digest = sb.exec(["md5sum", "/bin/busybox"]).stdout
    pager = c.info()["images"]["pager"]["pid"]
    try:
        c.close()
        d.stop(signal.SIGTERM)
        assert _alive(pager), "the pager outlives the daemon while sandboxes use it"
        d.config.write_text(d.config.read_text() + '[pager]\ncache_max_bytes = "123M"\n')
        d.start()
        assert _mount_ns(d.proc.pid) not in (first_ns, _mount_ns(os.getpid()))
        c = d.client()
        adopted = c.info()["images"]["pager"]
        assert adopted["pid"] == pager, "the same pager, adopted"
        assert adopted["cache_max"] == 123 << 20, "given the new cap through its root"
        old = c.get(sb.id)
        assert old.read_file("/work/f") == b"kept"
        assert old.exec(["md5sum", "/bin/busybox"]).stdout == digest
        new = c.create(image="busybox", memory="64M")
        assert new.exec(["md5sum", "/bin/busybox"]).stdout == digest
        new.destroy()
        old.destroy()
        c.close()
        d.stop(signal.SIGTERM)          # no sandbox left: the daemon stops the pager it adopted
        assert wait_for(lambda: not _alive(pager), timeout=15), f"pager pid {pager} still runs"
    finally:
        if _alive(pager):           # a failed restart cannot stop the pager it did not adopt
            os.kill(pager, signal.SIGKILL)


def _unit_capabilities() -> list[str]:
    caps = []
    for line in (ROOT / "systemd" / "dsecd.service").read_text().splitlines():
        if line.startswith("CapabilityBoundingSet="):
            caps += [c.removeprefix("CAP_").lower() for c in line.partition("=")[2].split()]
    assert caps, "the unit sets CapabilityBoundingSet="
    return caps


def _as_the_unit(d) -> list[str]:
    """Daemon d's command line goes after these: in a mount namespace as the
    unit's directives make one, with the unit's capability bounding set and
    no_new_privs."""
    return [str(UNIT_NAMESPACE), str(d.tmp), "setpriv", "--no-new-privs", "--bounding-set",
            "-all," + ",".join(f"+{c}" for c in _unit_capabilities())]


def test_the_daemon_works_with_the_units_capabilities_and_no_new_privs(daemon_factory, busybox_rootfs, tmp_path):
    """setpriv gives the daemon what the unit does: the capability bounding set
    (root's capabilities are then exactly these) and no_new_privs, in the
    unit's kind of mount namespace (unit_namespace.sh), /tmp its own. Creates,
    execs, a pty, files, background processes, pause, trace, snapshot and a
    build from the client's /tmp work."""
    if subprocess.run(["setpriv", "--help"], capture_output=True).returncode != 0:
        pytest.skip("setpriv (util-linux) is not installed")
    d = daemon_factory(start=False)
    d.wrapper = _as_the_unit(d)
    d.start()
    status = Path(f"/proc/{d.proc.pid}/status").read_text()
    assert re.search(r"^NoNewPrivs:\s+1$", status, re.M)
    bounding = int(re.search(r"^CapBnd:\s+(\w+)$", status, re.M).group(1), 16)
    assert not bounding & (1 << 16), "CAP_SYS_MODULE (16) is not in the unit's set"
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="64M")
    assert sb.exec(["sh", "-c", "echo ok; id -u"]).stdout == b"ok\n0\n"
    sb.write_file("/work/f", b"data")
    assert sb.read_file("/work/f") == b"data"
    p = sb.spawn(["sleep", "600"])
    c.request("proc_kill", sandbox=sb.id, pid=p.pid, signal="KILL")
    pty = sb.exec(["sh", "-c", "test -t 0 && stty size"], pty=True)      # a pty: /dev/ptmx, char-pts
    assert pty.exit_code == 0 and pty.stdout == b"24 80\r\n"
    sb.pause()
    sb.resume()
    traced = sb.exec(["cat", "/etc/passwd"], trace=True)
    assert traced.exit_code == 0 and traced.trace
    assert c.request("snapshot", sandbox=sb.id, name="caps-snap")["name"] == "caps-snap"
    sb.destroy()
    # The daemon's /tmp is its own: a build context in the client's /tmp is
    # read as the client sees it (fs/clientpaths.py).
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM busybox\nCOPY f.txt /f.txt\n")
    (ctx / "f.txt").write_text("from the client's /tmp\n")
    c.build_dockerfile(str(ctx), "from-client-tmp")
    sb = c.create(image="from-client-tmp", memory="64M")
    assert sb.exec(["cat", "/f.txt"]).stdout == b"from the client's /tmp\n"
    sb.destroy()
    c.close()


def test_a_microvm_runs_as_the_unit_runs_the_daemon(daemon_factory, busybox_rootfs):
    """The microVM backend in the unit's mount namespace and capabilities:
    QEMU's own root namespace is made from the daemon's, its files read
    through /usr made read-only; the VM boots, runs, pauses and resumes."""
    from conftest import skip_unless_microvm

    d = daemon_factory(start=False, shared_vm_templates=True)
    d.wrapper = _as_the_unit(d)
    d.start()
    c = d.client()
    skip_unless_microvm(c)
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", backend="microvm", memory="256M", net="none", disk="64M")
    assert sb.exec(["echo", "in the vm"]).stdout == b"in the vm\n"
    sb.pause()
    sb.resume()
    assert sb.exec(["echo", "after"]).stdout == b"after\n"
    sb.destroy()
    c.close()


def test_networking_works_with_the_units_capabilities(world, daemon_factory, busybox_rootfs):
    """--net default as the unit runs the daemon: the bridge and veths
    (NET_ADMIN), the eBPF allowlist (BPF), the resolver on port 53
    (NET_BIND_SERVICE)."""
    from test_net_daemon import _toml_net
    from test_net_kit import bpf_skip_reason

    if bpf_skip_reason():
        pytest.skip(bpf_skip_reason())
    d = daemon_factory(_toml_net(dict(world.cfg, ipv4_pool=f"10.{world.octet}.5.0/24")), start=False)
    d.wrapper = _as_the_unit(d)
    d.start()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", net="default")
    r = sb.exec(["sh", "-c", "nslookup example.org; nc -w 1 192.0.2.1 80 </dev/null"], timeout=30)
    assert b"REFUSED" in r.stdout + r.stderr, r           # the resolver answered (and refused the name)
    assert b"not permitted" in r.stderr, r                # the allowlist refused the connect
    shown = c.request("net_show", sandbox=sb.id)
    assert shown["default"]["denied_connect"] >= 1 and shown["dns"]["refused"] >= 1
    sb.destroy()
    c.close()


@pytest.mark.parametrize("setting, says", [
    ('[daemon]\nstate_dir = "/etc/passwd/state"\n', "cannot use state dir /etc/passwd/state: Not a directory"),
    ('[sandbox]\nseccomp = "strict"\n', "sandbox.seccomp: unknown seccomp profile 'strict'"),
    ('[daemon]\nsocket = "/proc/none/dsecd.sock"\n',
     "daemon.socket /proc/none/dsecd.sock: No such file or directory (/proc/none)"),
    ('[images]\nstore = "/proc/none/store"\n', "images.store /proc/none/store: No such file or directory (/proc/none)"),
    ('[images.mirrors]\n"docker.io" = "mirror.gcr.io"\n',
     "images.mirrors: the mirrors of 'docker.io' must be a list of host[:port][/path]"),
    ('[images]\nmode = "lazy"\n[pager]\nchunk_size = "4K"\n', "pager.chunk_size must be a multiple of 64K"),
    ('[memory.damon]\nwmark_high = 2000\n', "memory.damon.wmark_low <= wmark_mid <= wmark_high <= 1000"),
    ('[memory.swapfile]\npriority = 40000\n', "memory.swapfile.priority must be -1..32767"),
])
def test_a_start_that_cannot_use_a_setting_says_why(daemon_factory, setting, says):
    """One critical line naming what failed (docs/operations.md), no traceback."""
    d = daemon_factory(setting, start=False)
    with pytest.raises(RuntimeError, match="exited 1"):
        d.start()
    lines = [json.loads(line) for line in d.log.read_text().splitlines() if line.startswith("{")]
    failed = [line for line in lines if line.get("event") == "start_failed"]
    assert len(failed) == 1 and says in failed[0]["msg"], lines[-3:]
    assert "Traceback" not in d.log.read_text()
