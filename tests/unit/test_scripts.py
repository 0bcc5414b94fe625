"""The repo's shell entry points: they parse, CI reaches the test script, and
the Makefile has the targets the docs name. No root, no network."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["scripts/setup.sh", "scripts/test.sh", "scripts/mkrootfs.sh", "scripts/fresh-host.sh", ".ci/run"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_ci_runs_the_fresh_host_check_then_the_test_script():
    text = (REPO / ".ci/run").read_text()
    assert text.startswith("#!/bin/bash\n")
    commands = re.findall(r"^bash (scripts/\S+)", text, re.M)
    assert commands == ["scripts/fresh-host.sh", "scripts/test.sh"]      # pytest's summary last
    assert re.search(r"^exit \$status$", text, re.M)
    assert os.access(REPO / ".ci/run", os.X_OK)


def test_the_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"^```\n(.*?)^```", readme, re.M | re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in (REPO / ".ci/run").read_text()


def test_test_script_fails_on_no_tests_collected():
    text = (REPO / "scripts/test.sh").read_text()
    assert re.search(r"^\s*5\).*status=1", text, re.M), "pytest exit 5 must fail the run"


def _setup_function(name: str) -> str:
    text = (REPO / "scripts/setup.sh").read_text()
    m = re.search(rf"^{name}\(\) {{\n.*?^}}\n", text, re.M | re.S)
    assert m, f"scripts/setup.sh has no function {name}"
    return m.group(0)


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian host")
def test_setup_lists_packages_dpkg_never_heard_of_as_missing():
    """On a fresh host dpkg-query exits 1 for unknown names; under pipefail
    that once emptied the list, so nothing was installed."""
    # Called where errexit holds (not in a $(...), which clears it).
    script = ("set -euo pipefail\n" + _setup_function("missing_packages")
              + "PACKAGES=(bash dsecd-no-such-package)\nmissing_packages\necho end\n")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (0, "dsecd-no-such-package\nend\n"), r.stderr


def test_setup_says_what_failed():
    """No silent exit: an ERR trap names the line and the command."""
    text = (REPO / "scripts/setup.sh").read_text()
    assert re.search(r"^set -E$", text, re.M) and "trap 'on_error" in text
    script = ("set -euo pipefail\nLOG=/dev/null\nwarn() { echo \"setup: $*\" >&2; }\n"
              + _setup_function("on_error") + "set -E\ntrap 'on_error $? $LINENO \"$BASH_COMMAND\"' ERR\nfalse\n")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "FAILED (exit 1)" in r.stderr and ": false" in r.stderr


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


def test_makefile_targets():
    assert {"setup", "build", "test", "lint", "demo", "fresh-host", "bench-core"} <= make_targets()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_bench_core_runs_the_driver():
    proc = subprocess.run(
        ["make", "-n", "-C", str(REPO), "bench-core"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert ".venv/bin/python bench/core.py" in proc.stdout


def load_peers():
    spec = importlib.util.spec_from_file_location("peers", REPO / "bench/peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_percentile_is_nearest_rank():
    peers = load_peers()
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert peers.percentile(values, 50) == 50.0
    assert peers.percentile(values, 99) == 99.0
    assert peers.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        peers.percentile([], 50)


def test_crun_config_has_no_resources_and_the_five_namespaces():
    cfg = load_peers().crun_config("/rootfs")
    assert cfg["root"] == {"path": "/rootfs", "readonly": True}
    assert "resources" not in cfg["linux"]
    assert {ns["type"] for ns in cfg["linux"]["namespaces"]} == {
        "pid", "mount", "ipc", "uts", "network",
    }  # fmt: skip


def busybox_is_static() -> bool:
    bb = Path("/bin/busybox")
    return bb.exists() and subprocess.run(["ldd", str(bb)], capture_output=True).returncode != 0


@pytest.mark.skipif(not busybox_is_static(), reason="needs Debian's busybox-static (setup.sh)")
def test_mkrootfs_builds_then_reuses(tmp_path):
    dest = tmp_path / "rootfs"
    script = str(REPO / "scripts/mkrootfs.sh")
    out = subprocess.run(["bash", script, str(dest)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(dest)
    assert os.readlink(dest / "bin/sh") == "busybox"
    assert (dest / "usr/bin/env").resolve() == (dest / "bin/busybox").resolve()
    assert "nobody:x:65534:65534:" in (dest / "etc/passwd").read_text()
    for d in ("proc", "dev", "tmp", "sys", "work", "root"):
        assert (dest / d).is_dir() and not any((dest / d).iterdir())
    assert (dest / "tmp").stat().st_mode & 0o7777 == 0o1777

    marker = dest / "etc/dsecd-rootfs"
    stamp = marker.stat().st_mtime_ns
    subprocess.run(["bash", script, str(dest)], capture_output=True, check=True)
    assert marker.stat().st_mtime_ns == stamp, "a current rootfs must be reused, not rebuilt"


def test_mkrootfs_refuses_a_foreign_dir(tmp_path):
    (tmp_path / "mine").write_text("keep me")
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/mkrootfs.sh"), str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert (tmp_path / "mine").read_text() == "keep me"
