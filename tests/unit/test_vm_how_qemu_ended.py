"""A dead VM's "died" event says how its QEMU ended, read from its pidfd
without reaping it: a QEMU killed (the OOM killer, the watchdog) is told
apart from one that exited with an error of its own, whose stderr says
which."""

from __future__ import annotations

import select
import subprocess
from pathlib import Path

from dsecd import native
from dsecd.backends.microvm.backend import VmHandle, how_qemu_ended


def _started(tmp_path: Path, script: str, is_child: bool = True) -> tuple[subprocess.Popen, VmHandle]:
    with open(tmp_path / "qemu.log", "ab") as log:
        proc = subprocess.Popen(["sh", "-c", script], stderr=log)
    h = VmHandle(init_pid=proc.pid, init_start=0, pidfd=native.pidfd_open(proc.pid), group=None,
                 vm_dir=tmp_path, is_child=is_child, accel="tcg", popen=proc)
    return proc, h


def _ended(h: VmHandle) -> None:
    """Wait as the daemon's watch does: the pidfd turns readable."""
    assert select.select([h.pidfd], [], [], 30)[0]


def test_a_killed_qemu_is_named_by_its_signal_and_left_to_be_reaped(tmp_path):
    proc, h = _started(tmp_path, "sleep 60")
    try:
        proc.kill()
        _ended(h)
        assert how_qemu_ended(h) == {"signal": "SIGKILL"}
        assert how_qemu_ended(h) == {"signal": "SIGKILL"}   # not reaped: read again
        assert proc.wait(5) == -9                            # the release still reaps it
    finally:
        h.close_pidfd()


def test_an_error_of_qemus_own_comes_with_its_last_words(tmp_path):
    proc, h = _started(tmp_path, "echo 'qemu-system-x86_64: cannot set up guest memory: out of memory' >&2; exit 1")
    try:
        _ended(h)
        ended = how_qemu_ended(h)
        assert ended["exit_code"] == 1
        assert "cannot set up guest memory" in ended["qemu_said"]
    finally:
        proc.wait(5)
        h.close_pidfd()


def test_an_exit_on_a_caught_signal_says_what_qemu_said_of_it(tmp_path):
    """QEMU exits 0 on a SIGTERM from outside, as after a guest panic: its
    stderr tells the two apart."""
    proc, h = _started(tmp_path, "echo 'qemu-system-x86_64: terminating on signal 15 from pid 4242 (kill)' >&2; "
                                 "exit 0")
    try:
        _ended(h)
        assert how_qemu_ended(h) == {"exit_code": 0, "qemu_said": "qemu-system-x86_64: terminating on signal 15 "
                                                                  "from pid 4242 (kill)"}
    finally:
        proc.wait(5)
        h.close_pidfd()


def test_an_exit_with_nothing_on_stderr_says_only_its_code(tmp_path):
    proc, h = _started(tmp_path, "exit 0")
    try:
        _ended(h)
        assert how_qemu_ended(h) == {"exit_code": 0}
    finally:
        proc.wait(5)
        h.close_pidfd()


def test_nothing_is_said_of_a_qemu_that_runs_is_adopted_or_has_no_pidfd(tmp_path):
    proc, h = _started(tmp_path, "sleep 60")
    adopted = VmHandle(init_pid=proc.pid, init_start=0, pidfd=native.pidfd_open(proc.pid), group=None,
                       vm_dir=tmp_path, is_child=False, accel="tcg")
    try:
        assert how_qemu_ended(h) == {}           # still running
        proc.kill()
        _ended(h)
        assert how_qemu_ended(adopted) == {}     # not the daemon's child: nothing to read
        h.close_pidfd()
        assert how_qemu_ended(h) == {}
    finally:
        proc.wait(5)
        h.close_pidfd()
        adopted.close_pidfd()
