"""What the daemon's tasks and threads are doing (dsecd/doing.py): the
request and sandbox a request's task works for, taken along by the work it
hands to a thread, so that a stop which cannot wait for that thread says
which call it is in, for which request and sandbox, and where."""

from __future__ import annotations

import asyncio
import functools
import threading

from dsecd import doing, fds
from dsecd.engine.workers import Workers


def test_work_handed_to_a_worker_is_listed_with_its_request_and_sandbox():
    started, release = threading.Event(), threading.Event()

    def copy_into_sandbox() -> None:
        started.set()
        release.wait()

    async def run():
        workers = Workers(1)
        workers.start(asyncio.get_running_loop())
        try:
            async def create() -> None:
                doing.for_request("create", 4, "pid=9 uid=0 gid=0", None)
                doing.on_sandbox("5c0ffee")             # as the create makes its id
                await workers.run(copy_into_sandbox)

            task = asyncio.ensure_future(create())
            while not started.is_set():
                await asyncio.sleep(0.001)
            listed = doing.running_jobs()
            release.set()
            await task
            return listed, doing.running_jobs()
        finally:
            release.set()
            workers.shutdown()

    listed, after = asyncio.run(run())
    assert len(listed) == 1 and after == []
    name, job, where = listed[0]
    assert name == "dsecd-worker_0"
    assert job.name().endswith("copy_into_sandbox")
    assert job.doing == "create #4 of pid=9 uid=0 gid=0, sandbox 5c0ffee"
    assert "in wait" in where                      # the frame it blocks in


def test_a_task_a_request_starts_takes_its_label_and_keeps_its_own_changes():
    """A shielded step or work behind an answer runs in a task of its own,
    with a copy of its request's label: a sandbox it names is its own."""
    async def run():
        async def step() -> tuple[str | None, str | None]:
            inherited = doing.current()
            doing.on_sandbox("77aa")
            return inherited, doing.current()

        before = doing.current()
        doing.for_request("exec", 1, "pid=1 uid=0 gid=0", None)
        inherited, changed = await asyncio.ensure_future(step())
        return before, inherited, changed, doing.current()

    assert asyncio.run(run()) == (None, "exec #1 of pid=1 uid=0 gid=0", "exec #1 of pid=1 uid=0 gid=0, sandbox 77aa",
                                  "exec #1 of pid=1 uid=0 gid=0")


def test_a_job_is_named_by_the_function_doing_the_work():
    def pack_layer() -> None:
        pass

    assert doing.Job(fds.call_closing, (5, pack_layer), None).name().endswith("pack_layer")
    assert doing.Job(functools.partial(pack_layer), (), None).name().endswith("pack_layer")
    assert doing.Job(pack_layer, (), "create #1 of pid=1 uid=0 gid=0").describe().endswith(
        "pack_layer (create #1 of pid=1 uid=0 gid=0)")


def test_a_request_task_is_named_by_op_id_and_sandbox():
    assert doing.request_label("exec", 7, "3f2a") == "exec #7 on sandbox 3f2a"
    assert doing.request_label("create", 2) == "create #2"
