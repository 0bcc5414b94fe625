"""An install under a running daemon (docs/operations.md, "Upgrading in
place"): the daemon runs from its own tree, whose files are then replaced
as `git pull && scripts/setup.sh` would, and what it execs afterwards must
still be its own code (dsecd/pinned.py), while `dsec info` says a restart
finishes the upgrade."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import VENV_BIN, Daemon

REPO = Path(__file__).resolve().parents[2]


def _copy_tree(dst: Path) -> Path:
    """The code a daemon runs, as an install leaves it: dsecd/ (with its
    built library and libexec/) and bpf/."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "dsecd", dst / "dsecd", ignore=ignore)
    shutil.copytree(REPO / "bpf", dst / "bpf", ignore=ignore)
    return dst


def _replace(path: Path, text: str, mode: int = 0o644) -> None:
    """As an install writes a file: a new one renamed over the old."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.rename(tmp, path)


def _install_new_version(tree: Path) -> None:
    """A version whose init, tracer and BPF helper do not work with the
    running daemon: each one, run from disk, would fail the test."""
    _replace(tree / "dsecd/libexec/dsec-init", "#!/bin/sh\nexit 3\n", 0o755)
    _replace(tree / "dsecd/trace.py", 'raise SystemExit("the tracer of another version")\n')
    bpfobj = tree / "dsecd/net/bpfobj.py"
    text = bpfobj.read_text()
    assert "hashlib.sha256(MAGIC)" in text
    _replace(bpfobj, text.replace("hashlib.sha256(MAGIC)", 'hashlib.sha256(MAGIC + b"v2")'))
    for name in ("net_policy.c", "policy_denials.c"):     # a new key: the object is not in the cache
        src = tree / "bpf" / name
        _replace(src, src.read_text() + "\n/* a newer version */\n")


@pytest.fixture
def tree_daemon(busybox_rootfs):
    tmp = Path(tempfile.mkdtemp(prefix="dsecd-test-"))
    tree = _copy_tree(tmp / "tree")
    # The BPF programs of networking loaded by the first --net default
    # create, not at start: after the install.
    d = Daemon(tmp, "[net]\npreload = false\n")
    d.env = {**os.environ, "PYTHONPATH": str(tree)}
    d.preexec = lambda: os.chdir("/")       # as under systemd: no checkout in its working directory
    try:
        d.start()
        with d.client() as c:
            c.import_image(busybox_rootfs, "busybox")
        yield d, tree
    finally:
        d.cleanup()      # removes tmp, the tree with it


def test_a_daemon_runs_its_own_code_after_an_install_under_it(tree_daemon):
    d, tree = tree_daemon
    _install_new_version(tree)
    with d.client() as c:
        sb = c.create(image="busybox", memory="128M")     # the new init would exit at once
        try:
            r = sb.exec(["sh", "-c", "echo hi"])
            assert (r.exit_code, r.stdout) == (0, b"hi\n")
            r = sb.exec(["cat", "/etc/passwd"], trace=True)
            assert r.exit_code == 0, r
            assert any(e["kind"] == "exec" and e["argv"][:1] == ["cat"] for e in r.trace["events"]), r.trace
        finally:
            sb.destroy(force=True)
        # The networking's BPF object, compiled by the helper now.
        net = c.create(image="busybox", memory="128M", net="default")
        try:
            assert net.exec(["ip", "-4", "addr", "show", "eth0"]).exit_code == 0
        finally:
            net.destroy(force=True)
        info = c.info()
    code = info["daemon"]["code"]
    assert set(code["installed_changed"]) == {"bpf/net_policy.c", "bpf/policy_denials.c", "dsecd/libexec/dsec-init",
                                              "dsecd/net/bpfobj.py", "dsecd/trace.py"}
    assert code["installed"] == str(tree)
    assert code["running_from"].startswith(str(d.state / "code") + "/")
    log = d.log.read_text()
    assert "stale: built for key" not in log
    assert "installed code differs from the running daemon's" in log
    out = subprocess.run([str(VENV_BIN / "dsec"), "--socket", d.socket, "info"], capture_output=True, text=True,
                         check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("code:"))
    assert "restart it to finish the upgrade (sandboxes survive a restart)" in line, line
