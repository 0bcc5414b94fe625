"""`import dsecd` is cheap, and the package still offers every name it documents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _in_a_fresh_interpreter(code: str):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_importing_the_package_imports_none_of_its_modules():
    """The daemon and `dsec` import `dsecd.<module>`: the package itself
    must not drag in the client, asyncio and the protocol before they do."""
    loaded = _in_a_fresh_interpreter(
        "import json, sys; import dsecd; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('dsecd.') or m == 'asyncio')))")
    assert loaded == []


def test_every_documented_name_and_module_is_there_on_first_use():
    got = _in_a_fresh_interpreter("""
import json, dsecd
from dsecd import *                                # noqa: F403
from dsecd import Client, NotFound, SyncClient, protocol
out = {
    "all": sorted(n for n in dsecd.__all__ if n not in globals()),
    "client": Client is dsecd.client.Client and Client.__module__.startswith("dsecd.client."), "not_found": issubclass(NotFound, dsecd.DsecError),
    "sync": SyncClient is dsecd.sync.SyncClient, "protocol": protocol is dsecd.protocol,
    "errors": dsecd.errors.DsecError is dsecd.DsecError,
    "dir": sorted(set(dsecd.__all__) - set(dir(dsecd))),
}
try:
    dsecd.nosuch
    out["nosuch"] = "found"
except AttributeError as err:
    out["nosuch"] = str(err)
print(json.dumps(out))
""")
    assert got == {"all": [], "client": True, "not_found": True, "sync": True, "protocol": True,
                   "errors": True, "dir": [], "nosuch": "module 'dsecd' has no attribute 'nosuch'"}
