"""The lazy pager's log (<state_dir>/pager.log) is rotated by the daemon
while the pager runs on: it is the pager's stderr for as long as it lives."""

from __future__ import annotations

import time


def test_the_daemon_rotates_the_pagers_log_past_its_cap(daemon_factory):
    d = daemon_factory('[images]\nmode = "lazy"\nlayer_grace_s = 2.0\n[pager]\nlog_max_bytes = 1000\n')
    c = d.client()
    try:
        pid = c.info()["images"]["pager"]["pid"]
        log, old = d.state / "pager.log", d.state / "pager.log.1"
        with open(log, "ab") as f:          # lines as the pager writes them, past the cap
            f.write(b"dsec-pager: read store blob 00: Input/output error\n" * 40)
        # A hang guard, not a measure: the daemon checks every layer_grace_s / 2.
        deadline = time.monotonic() + 30
        while not old.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert old.read_bytes().count(b"Input/output error") == 40
        assert log.stat().st_size < 1000
        assert c.info()["images"]["pager"]["pid"] == pid        # the same pager writes on
    finally:
        c.close()


def test_the_pagers_cache_is_capped_by_default(daemon_factory):
    """pager.cache_max_bytes = "auto" (the default): a quarter of the state
    dir's file system, which the pager is started with and reports."""
    import os

    from dsecd.fs.pager import CACHE_AUTO_SHARE

    d = daemon_factory('[images]\nmode = "lazy"\n')
    c = d.client()
    try:
        st = os.statvfs(d.state)
        assert c.info()["images"]["pager"]["cache_max"] == int(st.f_blocks * st.f_frsize * CACHE_AUTO_SHARE)
    finally:
        c.close()


def test_an_adopted_pager_takes_the_configured_cache_cap(daemon_factory, busybox_rootfs):
    """The pager outlives a daemon restart while sandboxes use its layers:
    a restart with another pager.cache_max_bytes gives the running pager
    the new cap (it kept the one it was started with), and `dsec info`
    shows it."""
    d = daemon_factory('[images]\nmode = "lazy"\n[pager]\ncache_max_bytes = "0"\n')
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        c.create(image="busybox", memory="48M")
        pid = c.info()["images"]["pager"]["pid"]
    finally:
        c.close()
    d.stop()
    d.config.write_text(d.config.read_text().replace('cache_max_bytes = "0"', 'cache_max_bytes = "1G"'))
    d.start()
    c = d.client()
    try:
        pager = c.info()["images"]["pager"]
        assert (pager["pid"], pager["cache_max"]) == (pid, 1 << 30)
    finally:
        c.close()
    assert "capped its cache at nothing: now at 1073741824 (pager.cache_max_bytes)" in d.log.read_text()
    assert "pager cache: cap 1.0G, " in d.cli("info").stdout.decode()


def test_a_config_reload_gives_the_running_pager_the_new_cache_cap(daemon_factory):
    """pager.cache_max_bytes changed in the file and SIGHUP: the running
    pager takes the new cap at once (as an adopted one does at a restart),
    not at its next start."""
    import json
    import signal
    import time

    d = daemon_factory('[images]\nmode = "lazy"\n[pager]\ncache_max_bytes = "0"\n')
    c = d.client()
    try:
        pid = c.info()["images"]["pager"]["pid"]
        d.config.write_text(d.config.read_text().replace('cache_max_bytes = "0"', 'cache_max_bytes = "1G"'))
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while c.info()["daemon"]["last_reload"] is None and time.monotonic() < deadline:
            time.sleep(0.1)
        info = c.info()
    finally:
        c.close()
    r = info["daemon"]["last_reload"]
    assert r["ok"] and r["applied"] == ["pager.cache_max_bytes"] and r["restart_needed"] == [], r
    assert (info["images"]["pager"]["pid"], info["images"]["pager"]["cache_max"]) == (pid, 1 << 30)
    said = [json.loads(line) for line in d.log.read_text().splitlines() if '"setting_changed"' in line]
    assert [line["msg"] for line in said] == ['pager.cache_max_bytes changed: now "1G" (was "0")'], said
