"""Adversarial suite, part 3: exhausting what a sandbox is given.

Each flood must end inside the sandbox that started it (an errno, or its
own memory cgroup's OOM kill) while the daemon and a neighbour sandbox keep
working. Also marked `attack` elsewhere: test_lifecycle.py (pids limit,
memory OOM) and test_exec.py (`yes` output cap).
"""

from __future__ import annotations

import os
import time

import pytest
from attack_kit import facts, make_armed, run_probe

from dsecd.errors import LimitExceeded, NotFound

pytestmark = pytest.mark.attack


@pytest.fixture
def flooder(admin, probe_binary):
    sb = make_armed(admin, probe_binary, memory="64M", pids=64)
    yield sb
    try:
        sb.destroy(force=True)
    except NotFound:          # the test destroyed it itself
        pass


def _others_fine(admin, armed) -> None:
    assert admin.request("ping")
    assert armed.exec(["echo", "fine"]).stdout == b"fine\n"


def test_fork_bomb_hits_the_pids_limit(flooder, admin, armed):
    lines = run_probe(flooder, "forkbomb", "100000")
    assert lines[-1] == "EAGAIN", lines
    assert int(facts(lines)["forked"]) < 64
    _others_fine(admin, armed)
    assert flooder.exec(["echo", "alive"]).stdout == b"alive\n"   # the bomb's children are gone


@pytest.mark.parametrize("where", ["/tmp", "/dev"])
def test_inode_flood_stays_in_the_sandbox(flooder, admin, armed, daemon, where):
    """/tmp and /dev are dirs of the sandbox's own scratch tmpfs (csrc/spawn.c
    scratch_mount): its inodes are memory charged to the sandbox's memory
    cgroup, so the flood ends there (ENOSPC, ENOMEM or the group's OOM kill),
    not on the host's file systems."""
    host = os.statvfs(daemon.state)
    r = flooder.exec(["attack-probe", "files", where, "3000000"], timeout=60)
    out = r.stdout.decode().split()
    assert r.signal == 9 or (out and out[-1] in ("ENOSPC", "ENOMEM")), (r.signal, out)
    after = os.statvfs(daemon.state)
    assert host.f_ffree - after.f_ffree < 10000, "the flood reached the host's inodes"
    _others_fine(admin, armed)
    flooder.destroy(force=True)           # the flooded sandbox can still be torn down


def test_output_after_exit_and_on_both_streams_is_bounded(daemon_factory, busybox_rootfs):
    """`yes` on stdout and stderr, from background processes that outlive the
    exec's main process: the cap counts both streams, the result comes back,
    and the writers die of SIGPIPE instead of running on."""
    d = daemon_factory('[limits]\nmax_exec_output_bytes = "1M"\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="64M")
    try:
        r = sb.exec(["sh", "-c", "yes out & yes err >&2 & wait"], timeout=30)
        assert r.truncated and not r.timed_out
        assert len(r.stdout) + len(r.stderr) == 1 << 20
        r = sb.exec(["sh", "-c", "yes & yes >&2 & exit 0"], timeout=30)
        assert r.exit_code == 0 and len(r.stdout) + len(r.stderr) <= 1 << 20
        deadline = time.monotonic() + 5
        while b"yes" in sb.exec(["ps", "-o", "comm"]).stdout and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b"yes" not in sb.exec(["ps", "-o", "comm"]).stdout       # no writer left running
        assert sb.exec(["echo", "ok"]).stdout == b"ok\n"                 # neighbour
    finally:
        sb.destroy(force=True)
        c.close()


def test_sparse_file_cannot_blow_up_a_snapshot(daemon_factory, busybox_rootfs):
    """`truncate -s 1T` costs the sandbox nothing, but pack_diff's mkfs.erofs
    would read and store every byte (a 2 GiB sparse file: a 2 GiB blob in
    20 s). images.max_snapshot_bytes bounds the apparent size up front."""
    d = daemon_factory('[images]\nmax_snapshot_bytes = "64M"\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="64M")
    blobs = d.state / "store" / "blobs" / "sha256"
    store0 = sum(f.stat().st_size for f in blobs.iterdir())
    try:
        # 1 GiB, not 1 TiB: were the bound missing, this test must still end.
        r = sb.exec(["sh", "-c", "truncate -s 1073741824 /work/sparse && echo small > /work/keep"])
        assert r.exit_code == 0, r.stderr
        with pytest.raises(LimitExceeded, match="max_snapshot_bytes"):
            sb.snapshot("attack-sparse")
        assert sum(f.stat().st_size for f in blobs.iterdir()) - store0 < 1 << 20   # nothing stored
        assert sb.snapshot("attack-excluded", exclude=["work/sparse"])["name"] == "attack-excluded"
        # However the exclude is spelt, what the bound leaves out the layer leaves out.
        assert sb.snapshot("attack-spelt", exclude=["//work/./sparse"])["name"] == "attack-spelt"
        assert sum(f.stat().st_size for f in blobs.iterdir()) - store0 < 8 << 20
        sb.exec(["rm", "/work/sparse"])
        assert sb.snapshot("attack-small")["name"] == "attack-small"               # neighbour
    finally:
        sb.destroy(force=True)
        c.close()
