"""dsecd.ray without Ray installed says how to get it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_importing_dsecd_ray_without_ray_names_the_extra():
    r = subprocess.run([sys.executable, "-c", "import dsecd.ray"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "ModuleNotFoundError: dsecd.ray needs Ray" in r.stderr and "dsecd[ray]" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", "import dsecd; print(dsecd.Client.__name__)"],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "Client\n"), r.stderr    # nothing else in dsecd imports Ray
