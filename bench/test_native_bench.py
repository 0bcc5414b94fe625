"""Micro-benchmarks of dsecd.native; figures, not pass/fail. Needs root.

    .venv/bin/pytest bench/test_native_bench.py

Target (DESIGN: thousands of execs per second per host): spawn_exec of
/bin/true well under 1 ms, C part included. The sandbox fixtures come from
the integration tests, so setup and cleanup are the same as there.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

import test_native_spawn as spawn_tests  # noqa: E402
from dsecd._native import ffi, lib  # noqa: E402

from dsecd import native  # noqa: E402

# The same fixtures (and root/busybox skips) as the integration tests.
pytestmark = spawn_tests.pytestmark
busybox_lower = spawn_tests.busybox_lower
workdir = spawn_tests.workdir
cgroups = spawn_tests.cgroups
sandbox = spawn_tests.sandbox
_destroy, _make_sandbox, _reap = spawn_tests._destroy, spawn_tests._make_sandbox, spawn_tests._reap

ROUNDS = 300


@pytest.fixture
def devnull():
    fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    yield fd
    os.close(fd)


def test_spawn_exec_and_wait_true(benchmark, sandbox, devnull):
    """What a client sees for `exec true`, minus the protocol: spawn + reap."""
    spec = sandbox.spec(["/bin/true"], fds=(devnull,) * 3)

    def run():
        _, status = os.waitpid(native.spawn_exec(spec), 0)
        assert status == 0

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=10)


def _reap_between_rounds(pids: list[int]):
    """pedantic setup (untimed): reap the previous round's child."""
    def setup():
        while pids:
            os.waitpid(pids.pop(), 0)
    return setup


def test_spawn_exec_true(benchmark, sandbox, devnull):
    """spawn_exec alone (returns once the child has exec'ed), Python included."""
    spec = sandbox.spec(["/bin/true"], fds=(devnull,) * 3)
    pids: list[int] = []
    try:
        benchmark.pedantic(lambda: pids.append(native.spawn_exec(spec)),
                           setup=_reap_between_rounds(pids), rounds=ROUNDS)
    finally:
        _reap_between_rounds(pids)()


def test_spawn_exec_true_c_only(benchmark, sandbox, devnull):
    """dsec_spawn_exec with the args struct built once: the C time."""
    keep = [ffi.new("char[]", p.encode()) for p in sandbox.procs]
    keep += [ffi.new("char[]", b"/bin/true"), ffi.new("char[]", b"PATH=/bin"),
             ffi.new("char[]", b"/")]
    args = ffi.new("struct dsec_exec_args *")
    procs = ffi.new("char *[]", [*keep[:len(sandbox.procs)], ffi.NULL])
    argv = ffi.new("char *[]", [keep[-3], ffi.NULL])
    envp = ffi.new("char *[]", [keep[-2], ffi.NULL])
    args.pidfd, args.cgroup_procs, args.n_cgroups = sandbox.pidfd, procs, len(sandbox.procs)
    args.argv, args.envp, args.cwd = argv, envp, keep[-1]
    args.stdin_fd = args.stdout_fd = args.stderr_fd = devnull
    err = ffi.new("struct dsec_err *")
    pids: list[int] = []

    def spawn():
        pid = lib.dsec_spawn_exec(args, err)
        assert pid > 0, ffi.string(err.path)
        pids.append(pid)

    try:
        benchmark.pedantic(spawn, setup=_reap_between_rounds(pids), rounds=ROUNDS)
    finally:
        _reap_between_rounds(pids)()


def test_spawn_container(benchmark, busybox_lower, workdir, cgroups):
    """A whole sandbox: namespaces, overlay, /proc, /dev, /tmp, lo, pivot, init."""
    live = []

    def setup():
        if live:
            _destroy(live.pop())
        top = workdir / f"sb{len(os.listdir(workdir))}"
        top.mkdir()
        return (busybox_lower, top, cgroups), {}

    try:
        benchmark.pedantic(lambda *a: live.append(_make_sandbox(*a)), setup=setup, rounds=20)
    finally:
        for sb in live:
            _destroy(sb)


def test_destroy_sandbox(benchmark, busybox_lower, workdir, cgroups):
    """SIGKILL to init until it is reaped (the namespace teardown)."""
    made = []

    def setup():
        top = workdir / f"sb{len(made)}"
        top.mkdir()
        made.append(_make_sandbox(busybox_lower, top, cgroups))
        return (made[-1],), {}

    def destroy(sb):
        native.pidfd_send_signal(sb.pidfd, signal.SIGKILL)
        _reap(sb.pid)
        sb.pid = -1

    try:
        benchmark.pedantic(destroy, setup=setup, rounds=20)
    finally:
        for sb in made:
            _destroy(sb)
            shutil.rmtree(sb.dir, ignore_errors=True)
