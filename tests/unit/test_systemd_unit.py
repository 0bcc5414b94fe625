"""systemd/dsecd.service, checked offline: `systemd-analyze verify` passes,
`systemd-analyze security` rates it no worse than the unit says, and what it
relies on is there (the notify protocol, KillMode=process, a Documentation=
file the install steps put in place). Nothing is installed or started: the
host's systemd is never touched. Skipped where systemd-analyze is absent."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "dsecd.service"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (package systemd)")


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def unit_here(tmp_path: Path) -> Path:
    """The unit with ExecStart= pointing at this checkout's dsecd, so verify
    checks the command without /usr/local/bin/dsecd on this host."""
    dsecd = Path(sys.executable).parent / "dsecd"
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={dsecd}", UNIT.read_text(), flags=re.M)
    out = tmp_path / "dsecd.service"
    out.write_text(text)
    return out


@needs_analyze
def test_the_unit_verifies(tmp_path):
    r = subprocess.run([ANALYZE, "verify", str(unit_here(tmp_path))], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


@needs_analyze
def test_the_security_score_is_the_one_the_unit_states(tmp_path):
    r = subprocess.run([ANALYZE, "security", "--offline=yes", str(unit_here(tmp_path))], capture_output=True,
                       text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr
    stated = re.search(r"rates this unit (\d+\.\d)", UNIT.read_text())
    assert stated, "the unit's comment states its score"
    assert float(m.group(1)) <= float(stated.group(1)), f"score {m.group(1)}, the unit says {stated.group(1)}"


# The directives that put the daemon in a mount namespace of systemd's making.
MOUNT_NAMESPACE_DIRECTIVES = ("PrivateMounts", "PrivateTmp", "PrivateDevices", "ProtectSystem", "ProtectHome",
                              "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
                              "ProtectControlGroups", "ProtectProc", "ProcSubset", "RootDirectory",
                              "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "TemporaryFileSystem",
                              "BindPaths", "BindReadOnlyPaths")


def test_the_restart_tests_reproduce_the_units_mount_namespace():
    """tests/integration/unit_namespace.sh stands in for systemd where it is
    not PID 1: it must reproduce exactly the unit's mount-namespace directives."""
    unit = directives(UNIT.read_text())
    in_unit = {f"{k}={v}" for k in MOUNT_NAMESPACE_DIRECTIVES for v in unit.get(k, [])}
    script = (ROOT / "tests" / "integration" / "unit_namespace.sh").read_text()
    in_script = set(re.findall(r"^#   (\w+=\S+)", script, re.M))
    assert in_unit and in_script == in_unit


def test_the_unit_keeps_sandboxes_and_speaks_the_notify_protocol():
    d = directives(UNIT.read_text())
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["KillMode"] == ["process"], "a restart must leave the sandboxes running"
    assert d["WatchdogSec"] and d["Restart"] == ["on-failure"]
    assert d["SyslogIdentifier"] == ["dsecd"]
    assert d["ExecStart"] == ["/usr/local/bin/dsecd"], "where scripts/demo.sh links it"


def test_documentation_is_where_the_install_steps_put_the_readme():
    doc = directives(UNIT.read_text())["Documentation"][0]
    assert doc.startswith("file://")
    path = doc.removeprefix("file://")
    assert path in (ROOT / "scripts" / "demo.sh").read_text(), "demo.sh installs the README there"
    assert path in (ROOT / "docs" / "operations.md").read_text(), "the install steps name it"


def capability_set(text: str) -> list[str]:
    return [c.removeprefix("CAP_").lower() for v in directives(text)["CapabilityBoundingSet"] for c in v.split()]


def test_the_capability_set_keeps_what_sandbox_processes_are_given():
    """Without user namespaces (sandbox.userns = false) sandbox processes keep
    sandbox.capabilities within the daemon's bounding set: every one must be in it."""
    import tomllib

    caps = set(capability_set(UNIT.read_text()))
    defaults = tomllib.loads((ROOT / "dsecd" / "default.toml").read_text())
    assert {c.lower() for c in defaults["sandbox"]["capabilities"]} <= caps


def test_the_state_dir_systemd_makes_is_the_daemons_alone():
    """StateDirectory= makes /var/lib/dsecd before the daemon starts, 0755
    unless told: every local user could then read the image store under it
    (layers, snapshots of sandboxes) and the writable layers of
    writable_layer = "dir". The daemon makes its state dir 0700 itself
    (lock_state_dir), and the tests run it so."""
    d = directives(UNIT.read_text())
    assert d["StateDirectory"] == ["dsecd"] and d.get("StateDirectoryMode") == ["0700"], d.get("StateDirectoryMode")


def test_journald_keeps_every_lifecycle_line_of_a_busy_host():
    """One line per create and per destroy at info (docs/operations.md,
    section 3): a 2-core host's 200-400 creates/s make 400-800 lines/s,
    past journald's default per-unit limit (RateLimitBurst=10000 per
    RateLimitIntervalSec=30s: 333/s), which would drop them, and the
    warnings among them, as "Suppressed N messages"."""
    d = directives(UNIT.read_text())
    assert d.get("LogRateLimitIntervalSec") == ["0"], d.get("LogRateLimitIntervalSec")


def test_the_daemon_starts_after_the_hosts_network_file_systems():
    """images.store is, in production, a mount of a file system shared by
    every host (dsecd/default.toml): a daemon started before it is mounted
    finds the empty mount point, makes a store of its own on the local
    disk under it and lists none of the fleet's images."""
    d = directives(UNIT.read_text())
    after = " ".join(d.get("After", [])).split()
    assert "remote-fs.target" in after and "local-fs.target" in after, after


def test_systemctl_reload_sends_the_daemon_sighup():
    """`systemctl reload dsecd` was refused ("Job type reload is not
    applicable"): the unit had no ExecReload=. SIGHUP is the daemon's
    reload (dsecd/configreload.py); Type=notify-reload would send it
    itself, but needs systemd 253 and Debian 12 has 252."""
    d = directives(UNIT.read_text())
    assert d.get("ExecReload") == ["/bin/kill -HUP $MAINPID"], d.get("ExecReload")
    assert d["Type"] == ["notify"]


def test_a_stop_that_left_work_is_a_failure_not_a_reason_to_restart():
    """The daemon's status for a stop that left work under way
    (stopclock.LEFT_WORK_STATUS): listed as failed, never restarted on."""
    from dsecd import stopclock

    d = directives(UNIT.read_text())
    assert d["RestartPreventExitStatus"] == [str(stopclock.LEFT_WORK_STATUS)]
    assert str(stopclock.LEFT_WORK_STATUS) not in d.get("SuccessExitStatus", [""])[0].split()
