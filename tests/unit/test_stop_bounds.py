"""A daemon's stop ends by its deadline (daemon.stop_timeout_s,
dsecd/stopclock.py) whatever hangs, and says what it left: the workers
stuck in a blocking call (the call, the request, the sandbox), the close
steps that did not end, the tasks that would not. A stuck worker used to
hold the stop for ever: the steps after the requests' wait queued behind
it, asyncio's last cancel waited for the tasks awaiting it, the
interpreter's exit joined it."""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import threading

from log_kit import records_of

from dsecd import doing, stopclock
from dsecd import node as node_mod
from dsecd.engine import workers as workers_mod
from dsecd.engine.workers import Workers, outcome
from dsecd.stopclock import STEP_RESERVE_S, StopClock, end_what_is_left


async def _one_worker_stuck(release: threading.Event, started: threading.Event) -> tuple[Workers, asyncio.Task]:
    """A pool of one worker, and a request's task whose work holds that
    worker (since `started`) until `release`; the caller shuts it down."""
    workers = Workers(1)
    workers.start(asyncio.get_running_loop())
    request = _stuck_worker(workers, release, started)
    while not started.is_set():
        await asyncio.sleep(0.001)
    return workers, request


def _stuck_worker(workers: Workers, release: threading.Event, started: threading.Event):
    """A request's task whose work blocks in its worker until `release`."""
    def read_on_a_hung_file_system() -> None:
        started.set()
        release.wait()

    async def request() -> None:
        doing.for_request("file_read", 7, "pid=1 uid=0 gid=0", "3f2a")
        await workers.run(read_on_a_hung_file_system)

    return asyncio.ensure_future(request())


def test_a_stuck_worker_is_named_and_the_stop_steps_get_workers_of_their_own(monkeypatch, caplog):
    monkeypatch.setattr(workers_mod, "STUCK_S", 0.0)
    release, started = threading.Event(), threading.Event()

    async def run():
        workers, request = await _one_worker_stuck(release, started)
        try:
            assert workers.set_aside_stuck() == 1
            # The only worker is stuck: without a pool of its own, this waited for ever.
            assert await asyncio.wait_for(workers.run(lambda: "closed"), 5) == "closed"
            request.cancel()
        finally:
            release.set()
            workers.shutdown()

    with caplog.at_level(logging.WARNING, logger="dsecd.engine.workers"):
        asyncio.run(run())
    said = records_of(caplog, "stop_left_worker")
    assert len(said) == 1, caplog.text
    fields = said[0].fields
    assert fields["work"].endswith("read_on_a_hung_file_system")
    assert fields["doing"] == "file_read #7 of pid=1 uid=0 gid=0, sandbox 3f2a"
    assert "in wait" in fields["where"], fields        # threading.Event.wait, where it blocks


def test_work_that_just_began_is_not_taken_for_stuck():
    """The stop takes a worker for stuck only once it has been in one piece
    of work for STUCK_S: a sweep that began a moment before is no news."""
    release, started = threading.Event(), threading.Event()

    async def run():
        workers, request = await _one_worker_stuck(release, started)
        try:
            return workers.set_aside_stuck()
        finally:
            release.set()
            await outcome(request)
            workers.shutdown()

    assert asyncio.run(run()) == 0


def test_the_stop_waits_for_the_work_running_as_it_began_only_so_long():
    release, started = threading.Event(), threading.Event()

    async def run():
        workers, request = await _one_worker_stuck(release, started)
        try:
            await asyncio.wait_for(workers.finish_running(0.05), 5)
            assert len(workers.busy()) == 1
            release.set()
            await asyncio.wait_for(workers.finish_running(5), 5)
            assert workers.busy() == []
            await request
        finally:
            release.set()
            workers.shutdown()

    asyncio.run(run())


def test_a_close_step_that_does_not_end_is_left_by_the_deadline(caplog):
    release, started = threading.Event(), threading.Event()

    def unmount_on_a_hung_store() -> None:
        started.set()
        release.wait()

    async def run():
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        try:
            clock = StopClock(0.4)
            clock.plan_closes(("quick", "unmounting idle layers"))
            assert await clock.step("quick", asyncio.sleep(0))
            began = asyncio.get_running_loop().time()
            ended = await clock.step("unmounting idle layers", workers.run(unmount_on_a_hung_store))
            took = asyncio.get_running_loop().time() - began
            assert not ended and clock.late == ["unmounting idle layers"]
            assert took < 1.0
        finally:
            release.set()
            workers.shutdown()

    with caplog.at_level(logging.WARNING, logger="dsecd"):
        asyncio.run(run())
    said = records_of(caplog, "stop_step_late")
    assert len(said) == 1, caplog.text
    # The worker in it is named, labelled as the stop's own work.
    assert "unmount_on_a_hung_store (daemon stop: unmounting idle layers)" in said[0].getMessage()


def test_a_close_step_that_fails_raises_as_before():
    async def fails() -> None:
        raise OSError(5, "umount: EIO")

    async def run():
        clock = StopClock(5)
        clock.plan_closes(("unmounting idle layers",))
        try:
            await clock.step("unmounting idle layers", fails())
        except OSError as err:
            return err.errno
        return None

    assert asyncio.run(run()) == 5


def test_what_is_left_at_the_end_is_named_within_the_deadline():
    """A task that will not end on a cancel (it waits for its worker's
    outcome, as run_stoppable does) and the worker it waits for: asyncio's
    own end would wait for both for ever."""
    release, started = threading.Event(), threading.Event()

    async def run():
        workers = Workers(1)
        workers.start(asyncio.get_running_loop())
        try:
            stop = threading.Event()

            def copy_chunks() -> None:
                started.set()
                release.wait()

            async def request() -> None:
                doing.for_request("file_tar_put", 3, "pid=2 uid=0 gid=0", "77aa")
                await workers.run_stoppable(stop, copy_chunks)

            task = asyncio.get_running_loop().create_task(request(), name="file_tar_put #3")
            while not started.is_set():
                await asyncio.sleep(0.001)
            clock = StopClock(0.3)
            began = asyncio.get_running_loop().time()
            left = await end_what_is_left(clock)
            took = asyncio.get_running_loop().time() - began
            release.set()
            await outcome(task)
            return left, took
        finally:
            release.set()
            workers.shutdown()

    left, took = asyncio.run(run())
    assert took < 1.0
    assert left[0] == "task file_tar_put #3", left
    assert left[1].startswith("thread dsecd-worker_0 in test_what_is_left_at_the_end_is_named_within_the_deadline"
                              ".<locals>.run.<locals>.copy_chunks (file_tar_put #3 of pid=2 uid=0 gid=0, "
                              "sandbox 77aa)"), left


def test_a_close_step_that_hangs_leaves_the_steps_after_it_their_time(caplog):
    """A kill that hangs on a hung file system used to take the whole
    close: the steps after it got no time at all, and a stop left swap on
    and DAMON running."""
    release, started = threading.Event(), threading.Event()
    ran = []

    def kill_on_a_hung_store() -> None:
        started.set()
        release.wait()

    async def swap_off() -> None:
        await asyncio.sleep(0.05)
        ran.append("swap off")

    async def run():
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        try:
            clock = StopClock(2.0)          # the close: 1.9 s
            clock.plan_closes(("destroying call sandboxes", "stopping DAMON and swap"))
            hung = await clock.step("destroying call sandboxes", workers.run(kill_on_a_hung_store))
            after = await clock.step("stopping DAMON and swap", swap_off())
            return hung, after, clock.late
        finally:
            release.set()
            workers.shutdown()

    with caplog.at_level(logging.WARNING, logger="dsecd"):
        hung, after, late = asyncio.run(run())
    assert (hung, after, late) == (False, True, ["destroying call sandboxes"])
    assert ran == ["swap off"]


def test_each_close_step_keeps_its_reserve_or_an_equal_share_of_a_short_time():
    now = [100.0]
    clock = StopClock(75, now=lambda: now[0])
    clock.plan_closes(("a", "b", "c"))
    assert clock.for_step("a") == 71.25 - 2 * STEP_RESERVE_S
    assert clock.for_step("c") == 71.25                  # the last takes what is left
    now[0] = 170.7                                        # 0.55 s of the close left
    assert abs(clock.for_step("a") - 0.55 / 3) < 1e-9
    assert abs(clock.for_step("b") - 0.55 / 2) < 1e-9


def test_a_close_step_whose_hung_work_fills_every_worker_leaves_the_next_ones_workers(caplog):
    """Call sandboxes are destroyed at once, one worker each: more of them
    hung than there are workers, and the steps after queued behind them
    for ever, whatever time they were left."""
    release = threading.Event()
    ran = []

    def destroy_on_a_hung_store() -> None:
        release.wait()

    def swap_off() -> None:
        ran.append("swap off")

    async def run():
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        try:
            clock = StopClock(2.0)
            clock.plan_closes(("destroying call sandboxes", "stopping DAMON and swap"),
                              after_late=lambda: workers.set_aside_stuck(busy_s=0))
            hung = asyncio.gather(*(workers.run(destroy_on_a_hung_store) for _ in range(3)))
            first = await clock.step("destroying call sandboxes", hung)
            after = await clock.step("stopping DAMON and swap", workers.run(swap_off))
            return first, after
        finally:
            release.set()
            workers.shutdown()

    with caplog.at_level(logging.WARNING, logger="dsecd"):
        assert asyncio.run(run()) == (False, True)
    assert ran == ["swap off"]
    assert len(records_of(caplog, "stop_left_worker")) == 2       # each worker it held, named


def test_a_close_step_not_planned_still_runs_and_is_said(caplog):
    async def run():
        clock = StopClock(5)
        clock.plan_closes(("closing the network", "stopping the pager"))
        return await clock.step("closing the netwrok", asyncio.sleep(0))

    with caplog.at_level(logging.ERROR, logger="dsecd"):
        assert asyncio.run(run())
    assert "'closing the netwrok' is not among the planned ones" in caplog.text


def test_every_close_step_of_the_node_is_planned_in_its_order():
    """Node.close names its steps as literals; each must be in CLOSE_STEPS,
    in the order they run, or it would be refused (or keep no time for
    the steps after it)."""
    named = re.findall(r'clock\.step\("([^"]+)"', inspect.getsource(node_mod.Node.close))
    assert named == list(node_mod.CLOSE_STEPS)


def test_the_budget_is_shared_requests_first_then_the_close_then_the_rest():
    now = [100.0]
    clock = StopClock(75, now=lambda: now[0])
    assert (clock.for_requests(), clock.for_closes(), clock.for_last()) == (60.0, 71.25, 75.0)
    now[0] = 170.0
    assert (clock.for_requests(), clock.for_closes(), clock.for_last()) == (0.0, 1.25, 5.0)


def test_a_stop_whose_loop_thread_is_held_is_ended_by_the_last_resort(tmp_path):
    """The stop's own steps on the event loop's thread are blocking calls
    (a ring saved, an fd closed): on a hung state dir one never returns,
    and no wait of the loop's can end it. The backstop thread ends the
    process after the deadline, saying where that thread is."""
    import json
    import subprocess
    import sys
    import time

    script = tmp_path / "held.py"
    script.write_text(
        "import threading\n"
        "from dsecd import logs, stopclock\n"
        "stopclock.BACKSTOP_S = 0.1\n"
        "logs.setup('info', 'json')\n"
        "stopclock.StopClock(0.2).backstop()\n"
        "def save_ring_on_a_hung_disk():\n"
        "    threading.Event().wait()\n"
        "save_ring_on_a_hung_disk()\n")
    began = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=20)
    took = time.monotonic() - began
    assert done.returncode == stopclock.LEFT_WORK_STATUS, done.stderr
    line = json.loads(done.stderr.strip().splitlines()[-1])
    assert line["event"] == "stop_backstop" and line["level"] == "error", line
    assert "save_ring_on_a_hung_disk" in line["where"], line
    assert took < 10, took


def test_the_default_stop_ends_before_systemd_kills_the_daemon(tmp_path):
    """systemd kills a unit whose stop outlasts TimeoutStopSec (90 s by
    default; the unit sets none), and then the stop's account of what it
    left is never written."""
    import re
    from pathlib import Path

    import pytest

    from dsecd import stopclock
    from dsecd.config import ConfigError, load_config

    unit = (Path(__file__).resolve().parents[2] / "systemd" / "dsecd.service").read_text()
    assert not re.search(r"^(TimeoutStopSec|TimeoutSec)=", unit, re.M), "the unit's stop timeout is no longer 90 s"
    budget = load_config(None).section("daemon")["stop_timeout_s"]
    assert budget + stopclock.BACKSTOP_S < 90
    bad = tmp_path / "c.toml"
    bad.write_text("[daemon]\nstop_timeout_s = 0\n")
    with pytest.raises(ConfigError, match="daemon.stop_timeout_s"):
        load_config(str(bad))


class _Exited(Exception):
    pass


def _exit_now_keeps(tmp_path, monkeypatch, hold_journal: bool, compacting: bool = False) -> bool:
    """Run exit_now with one lock fd, os._exit and atexit stubbed, this
    test's journal the process's only one: whether the fd is still open
    after it (the lock kept)."""
    import atexit
    import os
    import threading
    import weakref

    from dsecd import journal, stopclock

    monkeypatch.setattr(stopclock.os, "_exit", lambda status: (_ for _ in ()).throw(_Exited(status)))
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: None)
    monkeypatch.setattr(journal, "_LOGS", weakref.WeakSet())      # exit_now keeps the locks it takes
    rl = journal.RecordLog(tmp_path / "sandboxes.log")
    if compacting:
        rl._during = []               # its copy being written to the temp file, outside the lock
    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    holding, release = threading.Event(), threading.Event()

    def stuck_append() -> None:          # a write on a hung disk, under the log's lock
        with rl._lock:
            holding.set()
            release.wait(10)

    t = threading.Thread(target=stuck_append)
    if hold_journal:
        t.start()
        holding.wait(10)
    try:
        stopclock.exit_now(["thread w in a read"], stopclock.StopClock(1), [fd])
    except _Exited:
        pass
    release.set()
    if hold_journal:
        t.join()
    try:
        os.fstat(fd)
    except OSError:
        return False
    os.close(fd)
    return True


def test_a_stop_that_exits_with_a_journal_write_under_way_keeps_the_state_dir_locked(tmp_path, monkeypatch):
    """A thread stuck in an append or a compaction's rename may still land
    its one call after the exit: a new daemon must not start writing the
    journal before it has."""
    assert _exit_now_keeps(tmp_path, monkeypatch, hold_journal=True)


def test_a_stop_that_exits_with_threads_stuck_elsewhere_gives_up_its_locks(tmp_path, monkeypatch):
    assert not _exit_now_keeps(tmp_path, monkeypatch, hold_journal=False)


def test_a_stop_that_exits_mid_compaction_keeps_the_state_dir_locked(tmp_path, monkeypatch):
    """A compaction writes its copy to a temp file of a fixed name outside
    the log's lock: a late write of it could land in the next daemon's own
    compaction of that name."""
    assert _exit_now_keeps(tmp_path, monkeypatch, hold_journal=False, compacting=True)


def test_no_journal_write_starts_after_a_stop_gave_up_its_locks(tmp_path, monkeypatch):
    """A stuck thread that comes back after the exit's look must not begin
    an append then: exit_now keeps every log's lock."""
    import weakref

    from dsecd import journal

    monkeypatch.setattr(journal, "_LOGS", weakref.WeakSet())
    rl = journal.RecordLog(tmp_path / "sandboxes.log")
    assert journal.hold_all_for_exit() == []
    assert not rl._lock.acquire(blocking=False)


def _stop_daemon_with(node_close, reload_close=None):
    """dsecd.daemon.stop_daemon on stand-ins: what it marked, how long it
    gave the config reload and the exit status it returned. `node_close`:
    the node's close."""
    from types import SimpleNamespace
    from unittest import mock

    from dsecd import daemon, stopclock

    seen = {"forgot": False, "reload_timeout": None, "status": None}

    async def reloader_close(timeout):
        seen["reload_timeout"] = timeout

    async def nothing(*_args, **_kw):
        return None

    def forget():
        seen["forgot"] = True

    node = SimpleNamespace(cfg=SimpleNamespace(section=lambda name: {"stop_timeout_s": 75}),
                           reloader=SimpleNamespace(close=reloader_close),
                           registry=SimpleNamespace(by_id={}), procs=SimpleNamespace(quiesce=nothing),
                           close=node_close, forget_running_mark=forget)
    server = SimpleNamespace(stop=nothing, wait_stopped=nothing)
    monitor = SimpleNamespace(stop=lambda: None)
    notifier = SimpleNamespace(stopping=lambda text: None, close=lambda: None)
    # No last resort here: its thread would end this test process (os._exit)
    # 80 s on.
    with mock.patch.object(stopclock.StopClock, "backstop", lambda self: None):
        seen["status"] = asyncio.run(daemon.stop_daemon(node, server, monitor, None, notifier, []))
    return seen


def test_a_stop_with_nothing_left_forgets_the_running_mark_and_gives_a_reload_a_short_wait():
    async def close(requests_ended, clock):
        return 0

    seen = _stop_daemon_with(close)
    assert seen["forgot"] and seen["status"] == 0
    assert seen["reload_timeout"] <= 5.0, seen      # not the requests' 60 s


def test_a_close_step_that_fails_leaves_the_running_mark_and_the_stop_ends(caplog):
    """A bug in a close step: the stop goes on to its end (bounded) rather
    than into asyncio's unbounded cancel of the tasks left, and the next
    start takes it for a death."""
    async def close(requests_ended, clock):
        raise RuntimeError("a close step's bug")

    with caplog.at_level(logging.ERROR, logger="dsecd"):
        seen = _stop_daemon_with(close)
    assert not seen["forgot"] and seen["status"] == stopclock.LEFT_WORK_STATUS != 0
    assert "closing the daemon's services failed" in caplog.text

