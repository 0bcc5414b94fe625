"""A microVM exec's output flow control (wire.EXEC_WINDOW): the guest agent
sends an exec's output at most a window ahead of what the daemon's consumer
took, so a client slower than the guest holds the process back (it blocks
on its write, as in a container) instead of growing the daemon; the channel
goes on serving the VM's other requests and the watchdog's ping meanwhile.
What a guest that ignores its window gets is in test_attack_microvm.py, a
collected exec cut at the default output cap there too (this module's
daemon has a cap above its stream).

One VM for the module (TCG); no timings asserted.
"""

from __future__ import annotations

import time

import pytest
from conftest import microvm_daemon, shared_vm
from stream_kit import SlowStream
from test_attack_microvm import PeakRss

# The watchdog pings every second and ends a VM silent for 5: a channel held
# by a stalled exec would end this module's VM within the stall below. The
# output cap is above the streamed output (a pipe's exec stream is capped;
# a terminal's is not, but under TCG it runs at a few hundred kB/s).
CONFIG = ("[microvm]\nwatchdog_interval_s = 1.0\nwatchdog_timeout_s = 5.0\n"
          "[limits]\nmax_exec_output_bytes = \"256M\"\n")
BLOCK_LINES = 100_000            # /tmp/f: `seq -w`, 7 bytes a line, 700 kB
BLOCKS = 96                      # the streamed output: 96 of them with a header each, ~64 MiB
# The client reads nothing this long: about twice what the guest took to
# write it all without flow control (~7 MiB/s here, under TCG).
STALL_S = 20.0


@pytest.fixture(scope="module")
def flowd(busybox_rootfs):
    yield from microvm_daemon(busybox_rootfs, CONFIG)


@pytest.fixture(scope="module")
def vm(flowd):
    for sb in shared_vm(flowd):
        sb.exec(["sh", "-c", f"seq -w 1 {BLOCK_LINES} > /tmp/f"])
        yield sb


BLOCKS_CMD = f'i=0; while [ $i -lt {BLOCKS} ]; do echo "block $i"; cat /tmp/f; i=$((i+1)); done'


def _expected_blocks() -> bytes:
    f = "".join(f"{i:06d}\n" for i in range(1, BLOCK_LINES + 1)).encode()
    return b"".join(b"block %d\n" % i + f for i in range(BLOCKS))


def _guest_has(sb, pattern: str) -> bool:
    ps = sb.exec(["ps", "-o", "pid,args"]).stdout.decode()
    return any(pattern in line for line in ps.splitlines() if "ps -o" not in line)


def test_a_stalled_stream_keeps_the_daemon_bounded_and_loses_nothing(flowd, vm):
    """A streamed exec writing ~64 MiB to a client that first reads
    nothing: the daemon's peak RSS grows by a fraction of it (without the
    window it held all of it: +74 MiB), and once read, every byte came, in
    order."""
    expected = _expected_blocks()
    with PeakRss(flowd) as rss:
        stream = SlowStream(flowd.socket, vm.id, ["sh", "-c", BLOCKS_CMD], pty=False)
        try:
            stream.read_at_least(1 << 20)
            time.sleep(STALL_S)
            result = stream.read_to_end()
        finally:
            stream.close()
    assert result["exit_code"] == 0 and not result["truncated"], result
    assert len(stream.data) == len(expected)
    assert bytes(stream.data) == expected, "the output came changed or out of order"
    assert rss.grown < len(expected) // 4, f"the daemon's peak RSS grew by {rss.grown} bytes " \
                                           f"for {len(expected)} bytes of output"


def test_a_stalled_exec_leaves_the_vm_serving(flowd, vm):
    """While one exec waits for its client (its window full, its process
    blocked), the same VM's other execs, file requests and the watchdog's
    pings go on (the VM outlives several watchdog timeouts); a client that
    goes away ends the stalled exec, whose process is then gone from the guest."""
    c = flowd.client()
    try:
        stream = SlowStream(flowd.socket, vm.id, ["cat", "/dev/zero"])
        try:
            stream.read_at_least(1)
            deadline = time.monotonic() + 3 * 5.0          # three watchdog timeouts
            while time.monotonic() < deadline:
                assert vm.exec(["echo", "still serving"], timeout=60).stdout == b"still serving\n"
                assert vm.read_file("/tmp/f")[:7] == b"000001\n"
                time.sleep(1)
            assert _guest_has(vm, "cat /dev/zero"), "the stalled exec ended by itself"
            info = c.get(vm.id).inspect()
            assert info["state"] == "running", info
        finally:
            stream.close()
        deadline = time.monotonic() + 60
        while _guest_has(vm, "cat /dev/zero"):
            assert time.monotonic() < deadline, "the abandoned exec's process is still in the guest"
            time.sleep(0.5)
        assert vm.exec(["echo", "after"]).stdout == b"after\n"
    finally:
        c.close()


def test_a_collected_exec_gets_all_its_output_past_the_window(vm):
    """Not streamed, under the output cap: every byte and the exit status."""
    r = vm.exec(["sh", "-c", "head -c 3145728 /dev/zero; echo done >&2; exit 7"], timeout=120)
    assert r.exit_code == 7 and not r.truncated
    assert r.stdout == b"\0" * 3145728 and r.stderr == b"done\n"
