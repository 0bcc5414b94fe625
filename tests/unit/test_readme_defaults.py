"""The README says which limits a sandbox gets when its create gives none,
and what caps an exec's output, with figures: they are default.toml's."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_states_the_defaults_a_create_and_an_exec_get():
    readme = " ".join((REPO / "README.md").read_text().split())
    cfg = tomllib.loads((REPO / "dsecd" / "default.toml").read_text())
    sb, limits = cfg["sandbox"], cfg["limits"]
    m = re.search(r"\(`sandbox.cpu`, `memory` and `pids`: ([\d.]+) CPU, (\w+) of memory, (\d+) processes", readme)
    assert m, "the README names the limits of a create that gives none"
    assert (float(m.group(1)), m.group(2), int(m.group(3))) == (sb["cpu"], sb["memory"], sb["pids"])
    m = re.search(r"/tmp and /dev/shm share a tmpfs of (\w+)", readme)
    assert m, "the README says how big /tmp is"
    assert int(m.group(1)[:-1]) == int(sb["tmp_size"][:-1]) + int(sb["shm_size"][:-1]), m.group(1)
    m = re.search(r"`limits.max_exec_output_bytes` \((\w+)\)", readme)
    assert m and m.group(1) == limits["max_exec_output_bytes"], "the README gives the exec output cap"
    m = re.search(r"`limits.proc_output_bytes`, (\w+)\)", readme)
    assert m and m.group(1) == limits["proc_output_bytes"], "the README gives a background process's ring"
