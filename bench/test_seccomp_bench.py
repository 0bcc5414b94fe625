"""Cost of the sandbox seccomp profile per syscall (pytest-benchmark).

    .venv/bin/pytest bench/test_seccomp_bench.py --benchmark-only -s

A filter is irreversible, so each round forks a child that (optionally)
installs the profile and makes CALLS syscalls in a loop; the benchmark times
the whole round (fork included), and the child's own per-call figure goes to
`extra_info["ns_per_call"]`. Compare the filtered and unfiltered rows of one
syscall: the difference is what the filter costs it. `getppid` has a
constant verdict (allow), which the kernel caches per syscall number since
Linux 5.11 (no BPF run at all); `ioctl` has argument checks, so the BPF
program runs on every call; `unshare` is refused by the filter before any
kernel work, against an unfiltered EINVAL.
"""

from __future__ import annotations

import fcntl
import os
import struct
import termios
import time

import pytest

from dsecd import seccomp

CALLS = 200_000


def _loop(kind: str, n: int) -> int:
    """ns per call of `kind`, measured in this process."""
    if kind == "getppid":
        call = os.getppid
    elif kind == "ioctl":
        rfd, _wfd = os.pipe()
        buf = bytearray(4)
        def call():
            fcntl.ioctl(rfd, termios.FIONREAD, buf)
    elif kind == "unshare":
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        # unshare(CLONE_NEWUTS | 1): EINVAL unfiltered (bad flag), EPERM filtered
        def call():
            libc.syscall(272, 0x04000000 | 1)
    start = time.perf_counter_ns()
    for _ in range(n):
        call()
    return (time.perf_counter_ns() - start) // n


def _round(kind: str, filtered: bool) -> int:
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        if filtered:
            seccomp.apply()
        os.write(wfd, struct.pack("q", _loop(kind, CALLS)))
        os._exit(0)
    os.close(wfd)
    (ns,) = struct.unpack("q", os.read(rfd, 8))
    os.close(rfd)
    os.waitpid(pid, 0)
    return ns


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "filtered"])
@pytest.mark.parametrize("kind", ["getppid", "ioctl", "unshare"])
def test_syscall_cost(benchmark, kind, filtered):
    seccomp.prepare()
    per_call: list[int] = []
    benchmark.pedantic(lambda: per_call.append(_round(kind, filtered)), rounds=5, iterations=1)
    benchmark.extra_info["ns_per_call"] = min(per_call)
    print(f"\n{kind:8} {'filtered' if filtered else 'plain':8} {min(per_call)} ns/call (min of 5)")


def test_build_profile(benchmark):
    """What dsec_seccomp_build costs once at daemon start (libseccomp + export)."""
    from dsecd._native import lib

    # The build is cached after the first call; time the uncached work through
    # export_pfc, which runs the same libseccomp rule generation.
    benchmark(seccomp.export_pfc)
    assert lib.dsec_seccomp_build(0) > 0
