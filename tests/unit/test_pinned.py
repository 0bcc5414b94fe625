"""dsecd/pinned.py: a daemon's code copied at start, imports and helpers
taken from the copy, and an install under it noticed. Each case runs in a
child Python on a copy of the checkout, whose files the test then rewrites
as an install would."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("dsecd", "bpf"):
        shutil.copytree(REPO / name, tree / name, ignore=ignore)
    return tree


def _run(tree: Path, code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         cwd="/", env={**os.environ, "PYTHONPATH": str(tree)}, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


PIN_THEN_INSTALL = """
    import json, os
    from pathlib import Path
    from dsecd import pinned
    state, tree = {state!r}, {tree!r}
    pin = pinned.pin(state)
    # An install under it: a module the daemon has not imported yet, rewritten.
    errors = Path(tree) / "dsecd" / "errors.py"
    new = errors.with_name("errors.py.new")
    new.write_text("raise SystemExit('the module of another version')\\n")
    os.rename(new, errors)
    import dsecd.errors
    print(json.dumps({{"root": str(pinned.root()), "errors_from": dsecd.errors.__file__,
                      "changed": pin.changed(), "init": str(pinned.root() / "dsecd/libexec/dsec-init"),
                      "helper_cwd": pinned.helper_options()["cwd"]}}))
"""


def test_late_imports_and_helpers_come_from_the_copy_made_at_start(tmp_path):
    tree, state = _tree(tmp_path), tmp_path / "state"
    out = _run(tree, PIN_THEN_INSTALL.format(state=str(state), tree=str(tree)))
    root = out["root"]
    assert root.startswith(str(state / "code") + "/")
    assert out["errors_from"] == f"{root}/dsecd/errors.py"
    assert out["changed"] == ["dsecd/errors.py"]
    assert out["helper_cwd"] == root
    assert os.access(out["init"], os.X_OK)


def test_a_restart_of_the_same_version_reuses_the_copy_and_drops_others(tmp_path):
    tree, state = _tree(tmp_path), tmp_path / "state"
    stale = state / "code" / "0123456789abcdef"
    stale.mkdir(parents=True)
    code = f"""
        import json
        from dsecd import pinned
        pin = pinned.pin({str(state)!r})
        print(json.dumps({{"root": str(pin.root), "changed": pin.changed()}}))
    """
    first, second = _run(tree, code), _run(tree, code)
    assert first == second and first["changed"] == []
    assert sorted(p.name for p in (state / "code").iterdir()) == [Path(first["root"]).name]


def test_a_running_daemon_looks_for_an_install_under_it_until_it_has_said_so(monkeypatch):
    """Without an `info` or a metrics scrape, an install under a daemon was
    never said in its log: it looks on a timer (Node._watch_code), until
    code_info has said it once."""
    import asyncio

    from dsecd import node, pinned

    monkeypatch.setattr(pinned, "current", lambda: object())
    looks: list[int] = []

    class _Workers:
        @staticmethod
        async def run(fn):
            return fn()

    class _Node:
        _said_code_changed = False
        workers = _Workers()

        def code_info(self):
            looks.append(1)
            if len(looks) == 3:             # the third look finds the install and says it
                self._said_code_changed = True

    asyncio.run(asyncio.wait_for(node.Node._watch_code(_Node(), interval=0.01), 10))
    assert len(looks) == 3
