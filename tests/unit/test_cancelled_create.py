"""A create cancelled while its spawn runs in a worker (dsecd/engine/workers.py
run_shielded, engine/network.py _abandoned_create): the sandbox the worker still
makes is destroyed once it exists, not left running unrecorded (no root: a
fake backend). Likewise execs and plain calls (dsecd/engine/starts.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from call_kit import call_service, holding_capacity, images_of, room_as_it_is
from loop_kit import workers_on_loop
from proc_kit import running

from dsecd.config import load_config
from dsecd.engine.calls import CallService
from dsecd.engine.execs import ExecLimits, ExecService
from dsecd.engine.idranges import IdRanges
from dsecd.engine.network import NetworkService
from dsecd.engine.starts import ProcessStarter
from dsecd.fs.users import ProcessIds


class _Backend:
    def __init__(self):
        self.destroyed: list[tuple[str, object]] = []
        self.done = threading.Event()

    def destroy(self, sb_id, handle):
        self.destroyed.append((sb_id, handle))
        self.done.set()


async def _cancel_soon(task: asyncio.Future, after: float = 0.05, once=None) -> None:
    """Cancel the request `after` seconds in, or as soon as `once()` is true
    (its spawn has started in the worker: on a loaded host a fixed delay can
    end before the worker even picked the spawn up), and let it end."""
    if once is None:
        await asyncio.sleep(after)
    else:
        for _ in range(3000):
            if once() or task.done():
                break
            await asyncio.sleep(0.01)
        assert once(), "the spawn never started"
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def _ops(workers, backend) -> NetworkService:
    """The network service, whose spawn_joining a create goes through."""
    cfg = SimpleNamespace(section=load_config().section, state_dir=None)
    return NetworkService(cfg, None, "dsecd-test", 1, None, workers, backend)


def test_a_cancelled_create_destroys_what_its_worker_made():
    backend = _Backend()

    started = []

    def slow_create(sb_id, netns_fd):
        started.append(sb_id)
        time.sleep(0.2)
        return f"handle-of-{sb_id}"

    released = []

    async def go():
        with workers_on_loop() as workers:
            ops = _ops(workers, backend)
            after = lambda: released.append(list(backend.destroyed))    # noqa: E731
            await _cancel_soon(asyncio.ensure_future(ops.spawn_joining(slow_create, None, after, "sb1")),
                               once=lambda: started)
            assert released == []                 # its id range and layers: not while the worker runs
            await asyncio.get_running_loop().run_in_executor(None, backend.done.wait, 5)
            await _until(lambda: released)

    asyncio.run(go())
    assert backend.destroyed == [("sb1", "handle-of-sb1")]
    assert released == [[("sb1", "handle-of-sb1")]]   # released once, after the destroy


def test_an_uncancelled_create_returns_its_handle_and_destroys_nothing():
    backend = _Backend()

    async def go():
        with workers_on_loop() as workers:
            ops = _ops(workers, backend)
            return await ops.spawn_joining(lambda sb_id, netns_fd: f"handle-of-{sb_id}", None,
                                           lambda: 1 / 0, "sb2")

    assert asyncio.run(go()) == "handle-of-sb2" and backend.destroyed == []


def _slow_spawn(seen: dict, fds) -> int:
    """A spawn during which the request is cancelled: it notes whether its
    child ends were still open, then makes a session leader that lives on."""
    import os

    seen["spawning"] = True
    time.sleep(0.2)
    seen["fds_open"] = all(_is_open(fd) for fd in fds[1:])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()                      # as the exec child does before it execs
        os.write(w, b"x")
        time.sleep(30)
        os._exit(0)
    os.read(r, 1)                        # the spawn returns once the child is set up
    os.close(r)
    os.close(w)
    seen["pid"] = pid
    return pid


async def _until(cond) -> None:
    for _ in range(100):
        if cond():
            return
        await asyncio.sleep(0.05)


def test_an_exec_cancelled_during_its_spawn_keeps_its_fds_until_the_spawn_is_over():
    # dsecd/engine/starts.py spawn_handed_over: the child ends go only once the worker
    # is done with them, and the process it made anyway is killed and reaped.
    from types import SimpleNamespace

    from dsecd.execio import Collector

    seen = {}

    class Backend:
        def spawn(self, handle, argv, env, cwd, user, fds, ctty=False, gid=None):
            return _slow_spawn(seen, fds)

    async def go():
        loop = asyncio.get_running_loop()
        with workers_on_loop() as workers:
            execs = ExecService(None, workers, ProcessStarter(workers), Backend(), None, None, -1, None)
            run = Collector(loop, 1 << 20, 0.1, None)
            fds = (0, *run.child_ends)
            sb = SimpleNamespace(handle=None)
            await _cancel_soon(asyncio.ensure_future(execs._spawn_exec(sb, ["x"], [], "/", ProcessIds(0, 0), fds, run)),
                               once=lambda: "spawning" in seen)
            run.close()                           # the request's own clean-up: must not close the ends
            await _until(lambda: "pid" in seen and not running(seen["pid"]))

    asyncio.run(go())
    assert seen["fds_open"]                       # the worker still had its fds
    assert not running(seen["pid"])                # killed and reaped


def test_a_plain_call_cancelled_during_its_spawn_frees_its_uid_only_after_the_kill():
    # dsecd/engine/calls.py _plain_call: the call's uid must not go to the next
    # call while a process the spawn made anyway may still run under it.
    from types import SimpleNamespace

    from dsecd.backends.fncall import CallBox

    seen = {"removed": []}
    box = CallBox(id="box1", image="py", layers=[], handle=None, free_uids=[7001])

    class FnCall:
        containers = SimpleNamespace(exec_env=lambda base, env: [f"{k}={v}" for k, v in {**base, **env}.items()])
        kill_leftovers = staticmethod(lambda h, uid, own_range=True: 0)     # the call left nothing running
        remove_shm_files = staticmethod(lambda h, uid: True)
        remove_ipc = staticmethod(lambda h, uid: True)
        own_ipc = staticmethod(lambda h: False)      # the call sandbox's IPC namespace: cleaned up after it
        remove_mqueues = staticmethod(lambda fd, uid: True)

        def make_private_dir(self, h, name, uid):
            return f"/tmp/{name}"

        def start_plain_by_init(self, loop, h, argv, env, cwd, uid, fds):
            return None           # no exec channel: the helper spawns it

        def spawn_plain(self, h, argv, env, cwd, uid, fds):
            pid = _slow_spawn(seen, fds)
            seen["uid_free_after_spawn"] = uid in box.free_uids
            return pid

        def remove_private_dir(self, h, name):
            seen["removed"].append(name)
            seen["alive_at_release"] = running(seen["pid"])
            return True

    async def go():
        with workers_on_loop() as workers:
            node = _call_node(workers, FnCall())
            await _cancel_soon(asyncio.ensure_future(node._plain_call(box, ["x"], {}, b"", 5)),
                               once=lambda: "spawning" in seen)
            seen["uid_free_at_cancel"] = 7001 in box.free_uids
            await _until(lambda: 7001 in box.free_uids and seen["removed"])

    asyncio.run(go())
    assert seen["fds_open"] and not seen["uid_free_at_cancel"] and not seen["uid_free_after_spawn"]
    assert box.free_uids == [7001] and len(seen["removed"]) == 1
    assert seen["alive_at_release"] is False      # the late process was gone before its uid came back


def test_a_plain_call_cancelled_while_it_runs_frees_its_uid_only_once_reaped():
    # dsecd/execio.py ExecIO.run kills a cancelled run and reaps it in a
    # thread (`reaped`); _plain_call releases the uid and dir after that.
    import os

    from dsecd.backends.fncall import CallBox

    seen = {"removed": []}

    class Uids(list):
        def append(self, uid):
            seen["reaped_at_uid_back"] = not os.path.exists(f"/proc/{seen['pid']}")
            super().append(uid)

    box = CallBox(id="box1", image="py", layers=[], handle=None, free_uids=Uids([7002]))

    class FnCall:
        containers = _plain_call_fncall().containers
        kill_leftovers = staticmethod(lambda h, uid, own_range=True: 0)     # the call left nothing running
        remove_shm_files = staticmethod(lambda h, uid: True)
        remove_ipc = staticmethod(lambda h, uid: True)
        own_ipc = staticmethod(lambda h: False)      # the call sandbox's IPC namespace: cleaned up after it
        remove_mqueues = staticmethod(lambda fd, uid: True)
        make_private_dir = staticmethod(lambda h, name, uid: f"/tmp/{name}")
        start_plain_by_init = staticmethod(lambda *args: None)     # the helper spawns it

        def spawn_plain(self, h, argv, env, cwd, uid, fds):
            pid = os.fork()
            if pid == 0:
                os.setsid()
                time.sleep(30)
                os._exit(0)
            seen["pid"] = pid
            return pid

        def remove_private_dir(self, h, name):
            seen["removed"].append(name)
            return True

    async def go():
        with workers_on_loop() as workers:
            node = _call_node(workers, FnCall())
            await _cancel_soon(asyncio.ensure_future(node._plain_call(box, ["x"], {}, b"", 30)), after=0.3)
            await _until(lambda: 7002 in box.free_uids and seen["removed"])

    asyncio.run(go())
    assert box.free_uids == [7002] and len(seen["removed"]) == 1
    assert seen["reaped_at_uid_back"]             # killed and reaped before the uid came back


def test_a_plain_call_forked_by_init_and_cancelled_frees_its_uid_only_once_init_says_it_ended():
    # An InitExec's abandon() returns its `over` future, done when init
    # reports the end (dsecd/initlink.py): until then the uid stays taken.
    from dsecd.backends.fncall import CallBox

    seen = {"removed": [], "over_at_uid_back": None}
    box = CallBox(id="box1", image="busybox", layers=[], handle=None, free_uids=[7003])

    class FnCall:
        containers = _plain_call_fncall().containers
        kill_leftovers = staticmethod(lambda h, uid, own_range=True: 0)     # the call left nothing running
        remove_shm_files = staticmethod(lambda h, uid: True)
        remove_ipc = staticmethod(lambda h, uid: True)
        own_ipc = staticmethod(lambda h: False)      # the call sandbox's IPC namespace: cleaned up after it
        remove_mqueues = staticmethod(lambda fd, uid: True)
        make_private_dir = staticmethod(lambda h, name, uid: f"/tmp/{name}")

        def start_plain_by_init(self, loop, h, argv, env, cwd, uid, fds):
            seen["watch"] = _FakeInitExec(loop)
            return seen["watch"]

        def spawn_plain(self, *args):
            raise AssertionError("a call init took must not go through the helper")

        def remove_private_dir(self, h, name):
            seen["removed"].append(name)
            seen["over_at_uid_back"] = seen["watch"].over.done()
            return True

    async def go():
        with workers_on_loop() as workers:
            node = _call_node(workers, FnCall())
            await _cancel_soon(asyncio.ensure_future(node._plain_call(box, ["x"], {}, b"", 30)), after=0.1)
            await asyncio.sleep(0.2)
            seen["uid_free_before_end"] = 7003 in box.free_uids
            seen["watch"].over.set_result(None)       # init: EXITED
            await _until(lambda: 7003 in box.free_uids and seen["removed"])
            seen["stats"] = node.call_stats

    asyncio.run(go())
    assert seen["watch"].killed and not seen["uid_free_before_end"]
    assert (seen["stats"]["plain_calls"], seen["stats"]["plain_calls_by_init"]) == (1, 1)
    assert box.free_uids == [7003] and seen["removed"] and seen["over_at_uid_back"]


def test_a_plain_call_whose_channel_broke_keeps_its_uid_and_retires_its_call_sandbox():
    # Init's channel broke while the call ran: the process may still run under
    # its uid, so the uid never comes back; the call sandbox goes instead.
    import errno

    from dsecd.backends.fncall import CallBox
    from dsecd.errors import IOFailure

    seen = {"removed": []}
    box = CallBox(id="box1", image="busybox", layers=[], handle=None, free_uids=[7004])

    class FnCall:
        containers = _plain_call_fncall().containers
        kill_leftovers = staticmethod(lambda h, uid, own_range=True: 0)     # the call left nothing running
        remove_shm_files = staticmethod(lambda h, uid: True)
        remove_ipc = staticmethod(lambda h, uid: True)
        own_ipc = staticmethod(lambda h: False)      # the call sandbox's IPC namespace: cleaned up after it
        remove_mqueues = staticmethod(lambda fd, uid: True)
        make_private_dir = staticmethod(lambda h, name, uid: f"/tmp/{name}")

        def start_plain_by_init(self, loop, h, argv, env, cwd, uid, fds):
            seen["watch"] = _FakeInitExec(loop)
            loop.call_later(0.05, seen["watch"].exited.set_exception,
                            OSError(errno.EPIPE, "lost the exec channel to the sandbox's init (test)"))
            return seen["watch"]

        def remove_private_dir(self, h, name):
            seen["removed"].append(name)
            return True

    async def go():
        with workers_on_loop() as workers:
            node = _call_node(workers, FnCall())
            node.call_stats["zygotes_replaced"] = 0
            node.call_boxes = {"busybox": box}
            with pytest.raises(IOFailure) as e:
                await node._plain_call(box, ["x"], {}, b"", 30)
            seen["error"] = str(e.value)
            await asyncio.sleep(0.1)
            seen["boxes"] = dict(node.call_boxes)

    asyncio.run(go())
    assert "lost track" in seen["error"] and "retry" in seen["error"]
    assert box.free_uids == [] and seen["removed"] == []      # the uid stays taken
    assert seen["boxes"] == {}                                 # the call sandbox was retired


class _FakeInitExec:
    """What dsecd/initlink.py InitExec gives a run: exited, over, kill, abandon, stop."""

    kill_grace = 10.0

    def __init__(self, loop):
        self.exited, self.over = loop.create_future(), loop.create_future()
        self.killed = False

    def kill(self):
        self.killed = True

    def abandon(self):
        self.kill()
        self.exited.cancel()
        return self.over

    def stop(self):
        pass


def _call_node(workers, fncall) -> CallService:
    """A call service with what _plain_call uses (a fake fncall backend), and nothing else."""
    limits = ExecLimits(max_timeout_s=0, drain_grace_s=0.1, max_output=1 << 20, max_trace=0)
    capacity = SimpleNamespace(room_for_call_sandbox=room_as_it_is, hold_call_sandbox=lambda box_id, cpu, memory: None,
                               release_call_sandbox=lambda box_id: None)
    return CallService(fncall, {}, {}, 100_000, None, None, workers, ProcessStarter(workers), limits, -1,
                       IdRanges(None), capacity)


def _plain_call_fncall():
    from types import SimpleNamespace

    return SimpleNamespace(containers=SimpleNamespace(
        exec_env=lambda base, env: [f"{k}={v}" for k, v in {**base, **env}.items()]))


def _is_open(fd: int) -> bool:
    import fcntl
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
        return True
    except OSError:
        return False




def test_a_plain_calls_uid_whose_leftovers_stay_awhile_comes_back_once_they_go(monkeypatch):
    """Another call can keep what a call left in place for a while (a file
    in its own writable dir): the uid is held and tried again, not lost,
    and given back once the cleanup finds nothing left."""
    from types import SimpleNamespace

    from dsecd.backends.fncall import CallBox
    from dsecd.engine import calls

    monkeypatch.setattr(calls, "CLEANUP_RETRY_S", 0.01)
    box = CallBox(id="box1", image="busybox", layers=[], handle=None, free_uids=[])
    box.host_ids = lambda uid: (uid, uid)
    tries = []

    def remove_shm_files(h, uid):
        tries.append(uid)
        return len(tries) >= 3              # gone at the third look

    fncall = SimpleNamespace(kill_leftovers=lambda h, uid, own_range=True: 0, remove_shm_files=remove_shm_files,
                             remove_ipc=lambda h, uid: True, own_ipc=lambda h: False, remove_mqueues=lambda fd, uid: True,
                             remove_private_dir=lambda h, name: True)

    async def go():
        with workers_on_loop() as workers:
            node = _call_node(workers, fncall)
            await node._give_back(box, 7003, "call-x")

    asyncio.run(go())
    assert box.free_uids == [7003] and len(tries) == 3


def test_a_call_sandbox_made_for_a_cancelled_request_is_destroyed_once_made():
    """The first call of an image makes its call sandbox in a worker, which
    a cancel cannot stop: what it makes then is destroyed, its message
    queue fd closed, its id range and layers given back."""
    import os
    from types import SimpleNamespace


    seen = {"destroyed": [], "released": [], "given_back": []}
    mq_fd = os.open(os.devnull, os.O_RDONLY)

    class FnCall:
        def create_box(self, box_id, lowerdirs, limits, plan, idmap):
            time.sleep(0.3)
            return SimpleNamespace(box=box_id)

        def mqueue_dir(self, handle):
            return mq_fd

        def destroy_box(self, box_id, handle):
            seen["destroyed"].append((box_id, handle.box))

    image = SimpleNamespace(layer_digests=["sha256:l1"], config={}, source=None)
    images = images_of(lambda name: image, seen["released"].append)
    ranges = SimpleNamespace(take=lambda: "range-1", give_back=lambda idmap: seen["given_back"].append(idmap))
    held: dict[str, tuple] = {}
    capacity = holding_capacity(held)

    async def go():
        with workers_on_loop() as workers:
            node = call_service(workers, FnCall(), images, capacity, ranges)
            making = asyncio.ensure_future(node._make_box("py", image))
            await _until(lambda: held)
            assert list(held.values()) == [(1.0, 64 << 20)]     # counted while it is made
            await _cancel_soon(making)
            await _until(lambda: seen["given_back"])

    asyncio.run(go())
    assert [b for _, b in seen["destroyed"]] == [seen["destroyed"][0][0]] and seen["given_back"] == ["range-1"]
    assert seen["released"] == [["sha256:l1"]]
    assert not held             # and no longer once it is destroyed
    try:
        os.fstat(mq_fd)
        raise AssertionError("the message queue fd of the abandoned box is still open")
    except OSError:
        pass


def test_a_create_waiting_on_its_keys_create_that_is_cancelled_makes_the_sandbox_itself():
    """A create sent again with its key (a caller's retry after its
    timeout) waits for the first create of the key still running. That
    first one cancelled (its caller gave up) made nothing: the retry was
    answered `conflict: create cancelled`, which no retry of a create
    should get. It now makes the sandbox; a create that failed still
    gives its waiters its error."""
    from dsecd import protocol
    from dsecd.engine.creates import CreateService
    from dsecd.errors import Busy

    made = []

    async def go(first_fails: BaseException | None):
        svc = object.__new__(CreateService)
        svc.registry = SimpleNamespace(by_id={}, keys={})
        svc.workers = SimpleNamespace(loop=asyncio.get_running_loop())
        svc._key_args_creating = {}
        started = asyncio.Event()

        async def create_admitted(req):
            if not made:
                made.append("first")
                started.set()
                await asyncio.sleep(0.1)
                raise first_fails
            made.append("retry")
            return {"id": "sb-retry"}

        svc._create_admitted = create_admitted
        req = protocol.Create(image="busybox", key="k")
        first = asyncio.ensure_future(svc.create(req, None))
        await started.wait()
        retry = asyncio.ensure_future(svc.create(req, None))
        await asyncio.sleep(0.01)
        if first_fails is None:
            first.cancel()
        results = await asyncio.gather(first, retry, return_exceptions=True)
        return results, svc.registry.keys

    (first, retry), keys = asyncio.run(go(None))
    assert isinstance(first, asyncio.CancelledError)
    assert retry == {"id": "sb-retry"} and keys == {"k": "sb-retry"} and made == ["first", "retry"]
    made.clear()
    (first, retry), keys = asyncio.run(go(Busy("the host is full")))
    assert isinstance(first, Busy) and isinstance(retry, Busy) and made == ["first"] and keys == {}


def test_a_dropped_call_sandbox_goes_after_its_plain_calls_clean_ups(monkeypatch):
    """A plain call's clean-up runs in workers on its call sandbox's fds and
    uid range: a box dropped meanwhile (idle, replaced, its zygote gone) is
    destroyed, its fds closed and its range given back, only once its
    clean-ups have stopped, and none runs after."""
    from types import SimpleNamespace

    from dsecd.backends.fncall import CallBox
    from dsecd.engine import calls

    monkeypatch.setattr(calls, "CLEANUP_RETRY_S", 0.01)
    steps = []
    box = CallBox(id="box1", image="busybox", layers=[], handle=SimpleNamespace(), free_uids=[])
    box.host_ids = lambda uid: (uid, uid)

    def remove_shm_files(h, uid):
        steps.append("clean")
        return False                        # what it left stays: tried again and again

    fncall = SimpleNamespace(kill_leftovers=lambda h, uid, own_range=True: 0, remove_shm_files=remove_shm_files,
                             remove_ipc=lambda h, uid: True, own_ipc=lambda h: False, remove_mqueues=lambda fd, uid: True,
                             remove_private_dir=lambda h, name: True,
                             destroy_box=lambda box_id, h: steps.append("destroyed"))

    async def go():
        with workers_on_loop() as workers:
            node = _call_node(workers, fncall)
            node.image_service = SimpleNamespace(layers=SimpleNamespace(release=lambda layers: None))
            cleanup = asyncio.ensure_future(node._give_back(box, 7003, "call-x"))
            box.cleanups.add(cleanup)
            cleanup.add_done_callback(box.cleanups.discard)
            await _until(lambda: steps.count("clean") >= 2)
            await node._drop_box(box, "test")
            assert cleanup.done()
            await asyncio.sleep(0.1)

    asyncio.run(go())
    assert steps[-1] == "destroyed" and steps.count("destroyed") == 1, steps
    assert box.free_uids == []


def _dropping_node(workers, destroy_box, seen: dict) -> CallService:
    """A call service whose boxes' destroys are `destroy_box`, recording what it gives back."""
    fncall = SimpleNamespace(destroy_box=destroy_box)
    node = _call_node(workers, fncall)
    node.image_service = SimpleNamespace(layers=SimpleNamespace(release=lambda layers: seen["released"].append(layers)))
    node.id_ranges = SimpleNamespace(give_back=lambda idmap: seen["given_back"].append(idmap))
    node.capacity = SimpleNamespace(release_call_sandbox=lambda box_id: seen["slots"].append(box_id))
    return node


def test_a_dropped_call_sandbox_whose_destroy_fails_is_destroyed_again(monkeypatch):
    """A destroy that fails (a process it could not kill) is tried again; the
    box's layers, id range and slot of the host are given back once it went,
    never while it may still be there."""
    from dsecd.backends.fncall import CallBox
    from dsecd.engine import calls

    monkeypatch.setattr(calls, "DESTROY_RETRY_S", (0.05, 0.1))
    seen = {"destroys": 0, "released": [], "given_back": [], "slots": []}

    def destroy_box(box_id, h):
        seen["destroys"] += 1
        if seen["destroys"] < 3:
            raise OSError(16, "Device or resource busy")

    box = CallBox(id="fn-1", image="busybox", layers=["sha256:l1"], handle=SimpleNamespace(), free_uids=[],
                  idmap="range-1")

    async def go():
        with workers_on_loop() as workers:
            node = _dropping_node(workers, destroy_box, seen)
            drop = asyncio.ensure_future(node._drop_box(box, "test"))
            await _until(lambda: seen["destroys"] >= 2)
            assert seen["slots"] == [] and seen["given_back"] == []     # held while it may be there
            await asyncio.wait_for(drop, 5)

    asyncio.run(go())
    assert seen == {"destroys": 3, "released": [["sha256:l1"]], "given_back": ["range-1"], "slots": ["fn-1"]}


def test_a_destroy_that_keeps_failing_does_not_hold_the_daemons_stop(monkeypatch):
    """At close() a call sandbox that cannot be destroyed is left to the next
    start's sweep, held: the stop does not wait for it."""
    from dsecd.backends.fncall import CallBox
    from dsecd.engine import calls

    monkeypatch.setattr(calls, "DESTROY_RETRY_S", (30.0, 60.0))
    seen = {"destroys": 0, "released": [], "given_back": [], "slots": []}

    def destroy_box(box_id, h):
        seen["destroys"] += 1
        raise OSError(16, "Device or resource busy")

    box = CallBox(id="fn-2", image="busybox", layers=["sha256:l1"], handle=SimpleNamespace(), free_uids=[],
                  idmap="range-2")

    async def go():
        with workers_on_loop() as workers:
            node = _dropping_node(workers, destroy_box, seen)
            node.call_boxes = {"busybox": box}
            await asyncio.wait_for(node.close(), 5)

    asyncio.run(go())
    assert seen == {"destroys": 1, "released": [], "given_back": [], "slots": []}
