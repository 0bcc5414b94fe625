"""The microVM guest dir is shared by checkouts of different agents: each
daemon loads the guest built for its own agent binary, and pruning keeps
what the recent builds name."""

import json
import os
import time

import pytest

from dsecd.backends.microvm import guestimg


def _fake_build(d, agent: bytes, tag: str) -> dict:
    kernel, initramfs = d / "vmlinuz", d / f"initramfs-{tag}.cpio"
    kernel.write_bytes(b"k")
    initramfs.write_bytes(tag.encode())
    img = {"kernel": str(kernel), "initramfs": str(initramfs), "version": "v", "digest": tag}
    guestimg._meta_for(d, agent).write_text(json.dumps(img))
    return img


def test_each_agent_loads_its_own_build(tmp_path):
    a, b = tmp_path / "agent-a", tmp_path / "agent-b"
    a.write_bytes(b"agent a")
    b.write_bytes(b"agent b")
    _fake_build(tmp_path, b"agent a", "aaaa")
    _fake_build(tmp_path, b"agent b", "bbbb")
    assert guestimg.load(tmp_path, a).digest == "aaaa"
    assert guestimg.load(tmp_path, b).digest == "bbbb"
    c = tmp_path / "agent-c"
    c.write_bytes(b"agent c")
    with pytest.raises(guestimg.GuestImageError, match="no guest built for this agent"):
        guestimg.load(tmp_path, c)


def test_prune_keeps_the_recent_builds_and_what_they_name(tmp_path):
    for i in range(6):
        _fake_build(tmp_path, f"agent {i}".encode(), f"t{i}")
        meta = guestimg._meta_for(tmp_path, f"agent {i}".encode())
        os.utime(meta, (time.time() - 100 + i, time.time() - 100 + i))
    (tmp_path / "initramfs-orphan.cpio").write_bytes(b"x")
    guestimg._prune(tmp_path, keep=4)
    left = sorted(p.name for p in tmp_path.glob("initramfs-*.cpio"))
    assert left == [f"initramfs-t{i}.cpio" for i in range(2, 6)]
    assert len(list(tmp_path.glob("guest-*.json"))) == 4
