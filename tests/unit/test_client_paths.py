"""The SDK gives back names that are not UTF-8 as os.fsdecode's str, the
way os.listdir does: the paths a file op echoes and a symlink's target."""

from __future__ import annotations

import asyncio

import pytest

from dsecd.client import Client, _paths


def test_paths_and_a_link_target_that_are_not_utf8_come_as_fsdecode_strings():
    out = _paths({"path": b"/work/\xff", "target": b"/data/\xfe", "type": "symlink"})
    assert out == {"path": "/work/\udcff", "target": "/data/\udcfe", "type": "symlink"}


def test_a_dockerfile_build_over_ssh_refuses_a_relative_context(tmp_path, monkeypatch):
    """`dsec --host ssh://h1 image build -f Dockerfile . --name x` made "."
    this machine's cwd, and h1's daemon read that path on h1: not found, or
    another directory of the same name built. As for build_image, a
    relative path is refused before anything is sent."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Dockerfile").write_text("FROM busybox\n")
    client = Client("ssh://h1")
    with pytest.raises(ValueError, match="must be an absolute path on that host"):
        asyncio.run(client.build_dockerfile(".", "x"))
