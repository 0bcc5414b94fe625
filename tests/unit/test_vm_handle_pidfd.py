"""A VM handle's pidfd is used and closed by more than one thread (a
destroy's and a pause's end of QEMU run in two workers, the watchdog on the
loop): once closed, its number may be another process's pidfd, which a
late kill through the handle must never reach."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from dsecd import native
from dsecd.backends.microvm.backend import VmHandle


def _handle(proc: subprocess.Popen) -> VmHandle:
    return VmHandle(init_pid=proc.pid, init_start=0, pidfd=native.pidfd_open(proc.pid), group=None,
                    vm_dir=Path("/nonexistent"), is_child=False, accel="tcg")


def test_a_kill_after_the_close_reaches_no_process_that_took_the_number():
    qemu = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])
    h = _handle(qemu)
    try:
        number = h.pidfd
        h.close_pidfd()
        reused = native.pidfd_open(other.pid)
        assert reused == number             # the lowest free number: the one just closed
        h.kill()
        h.close_pidfd()                     # again: nothing
        assert other.poll() is None
    finally:
        for p in (qemu, other):
            p.kill()
            p.wait()


def test_a_wait_for_the_exit_outlives_a_close_in_another_thread():
    qemu = subprocess.Popen(["sleep", "60"])
    h = _handle(qemu)
    try:
        closer = threading.Timer(0.2, h.close_pidfd)
        killer = threading.Timer(0.4, qemu.kill)
        closer.start()
        killer.start()
        assert h.exited(30)                 # on its own copy of the pidfd
        assert h.exited(0)                  # no pidfd any more
    finally:
        qemu.kill()
        qemu.wait()
