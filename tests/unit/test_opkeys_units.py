"""The idempotency keys of exec, proc_start and snapshot (dsecd/engine/opkeys.py):
what a key answers with, how long and how many it is kept, what a lost
connection and a cancel leave of the request under it, and what a daemon
that follows another finds of it in the journal."""

from __future__ import annotations

import asyncio
import json
import time
import types

import pytest
from journal_kit import MemoryJournal

from dsecd import protocol
from dsecd.engine import opkeys
from dsecd.engine.execs import exec_summary
from dsecd.engine.opkeys import KEY_TTL_S, KEYS_PER_SANDBOX, OpKeys
from dsecd.engine.procs import _not_written_yet
from dsecd.engine.sandboxes import Sandbox, SandboxRegistry
from dsecd.errors import BadRequest, Conflict


class _Ctx:
    """A request's context: why it would be cancelled (RequestContext.why_cancelled)."""

    def __init__(self, why: str = "cancel"):
        self.why = why

    def why_cancelled(self) -> str:
        return self.why


class _Hearing(_Ctx):
    """A request's context that keeps the frames sent to its client."""

    def __init__(self, why: str = "gone"):
        super().__init__(why)
        self.frames: list[dict] = []

    def emit_nowait(self, frame: dict) -> None:
        self.frames.append(frame)


class _Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class World:
    def __init__(self):
        self.journal = MemoryJournal()
        self.registry = SandboxRegistry(self.journal)
        self.clock = _Clock()
        self.registry.op_keys = OpKeys(self.registry, self.clock)
        self.sb = Sandbox(id="sb1", image="busybox", state="running", created=0.0,
                          limits={"cpu": 1.0, "memory": 1 << 20})
        self.registry.add(self.sb)
        self.runs: list[list[str]] = []
        self.unwound: list[list[str]] = []        # runs whose cancel unwound them

    def exec(self, argv: list[str], key: str | None, out: bytes = b"out\n", ctx: _Ctx | None = None,
             until: asyncio.Event | None = None):
        """An exec of `argv` under `key` whose run is counted in `runs` and
        answers `out` (after `until` is set, if given)."""
        req = protocol.Exec(sandbox=self.sb.id, argv=argv, stream=False, key=key)

        async def run() -> dict:
            self.runs.append(argv)
            try:
                if until is not None:
                    await until.wait()
            except asyncio.CancelledError:
                # Undone in a worker thread, as a snapshot's thaw is: it takes turns of the loop.
                await asyncio.to_thread(time.sleep, 0)
                self.unwound.append(argv)
                raise
            return {"exit_code": 3, "signal": None, "stdout": out, "stderr": b"", "timed_out": False}

        return self.registry.op_keys.once(self.sb, "exec", req, ctx or _Ctx(), run, exec_summary)


def test_a_key_answers_with_its_first_run_until_it_is_older_than_its_ttl():
    w = World()

    async def go():
        first = await w.exec(["echo"], "k")
        w.clock.now += KEY_TTL_S - 1
        again = await w.exec(["echo"], "k")
        w.clock.now += 2
        after = await w.exec(["echo"], "k")
        return first, again, after

    first, again, after = asyncio.run(go())
    assert "existing" not in first and again == {**first, "existing": True}
    assert "existing" not in after and len(w.runs) == 2, w.runs


def test_a_sandbox_keeps_the_keys_of_its_latest_requests_only():
    w = World()

    async def go():
        for n in range(KEYS_PER_SANDBOX + 1):
            await w.exec(["echo", str(n)], f"k{n}")
        await w.exec(["echo", "1"], "k1")        # still kept: answered, not run
        await w.exec(["echo", "0"], "k0")        # the oldest, forgotten: run anew

    asyncio.run(go())
    assert [argv[1] for argv in w.runs] == [str(n) for n in range(KEYS_PER_SANDBOX + 1)] + ["0"]
    journaled = w.journal.records["sb1"]["op_keys"]
    assert len(journaled) == KEYS_PER_SANDBOX and "k0" in journaled and "k1" not in journaled


def test_the_key_of_a_request_that_begins_does_not_push_out_an_ended_one():
    """KEYS_PER_SANDBOX keys of ended requests are kept besides those under
    way: a request that begins is not counted among the ended ones (it was,
    and each one that began took the place of the oldest ended key while it
    ran); once it ended, the first ended key goes."""
    w = World()

    async def go():
        for n in range(KEYS_PER_SANDBOX):
            await w.exec(["echo", str(n)], f"k{n}")
        release = asyncio.Event()
        long = asyncio.ensure_future(w.exec(["sleep"], "long", until=release))
        await asyncio.sleep(0)
        kept = await w.exec(["echo", "0"], "k0")    # still kept while `long` runs: answered, not run
        while_running = set(w.journal.records["sb1"]["op_keys"])
        release.set()
        await long
        anew = await w.exec(["echo", "0"], "k0")    # the first ended, forgotten as `long` ended: run anew
        return kept, while_running, anew

    kept, while_running, anew = asyncio.run(go())
    assert kept["existing"] is True and "existing" not in anew
    assert while_running == {f"k{n}" for n in range(KEYS_PER_SANDBOX)} | {"long"}, sorted(while_running)
    assert [argv[-1] for argv in w.runs] == [str(n) for n in range(KEYS_PER_SANDBOX)] + ["sleep", "0"]
    assert len(w.sb.op_keys) == KEYS_PER_SANDBOX and "k1" not in w.sb.op_keys


def test_a_request_that_began_first_and_ended_last_keeps_its_key():
    """The ended keys go in the order their requests ended: a long request
    that began before KEYS_PER_SANDBOX shorter ones is answered when sent
    again after it ended, not forgotten as it ends."""
    w = World()

    async def go():
        release = asyncio.Event()
        long = asyncio.ensure_future(w.exec(["sleep"], "long", until=release))
        await asyncio.sleep(0)
        for n in range(KEYS_PER_SANDBOX):
            await w.exec(["echo", str(n)], f"k{n}")
        release.set()
        first = await long
        return first, await w.exec(["sleep"], "long")

    first, again = asyncio.run(go())
    assert again == {**first, "existing": True} and w.runs.count(["sleep"]) == 1, w.runs
    assert len(w.sb.op_keys) == KEYS_PER_SANDBOX and "k0" not in w.sb.op_keys and "long" in w.sb.op_keys


def test_a_request_that_ran_longer_than_the_ttl_keeps_its_key_after_it_ended():
    """A key is kept KEY_TTL_S from its request's end, not its beginning: an
    exec that ran longer than that, sent again as it ended (its link was
    cut near the end), is answered, not run a second time."""
    w = World()

    async def go():
        release = asyncio.Event()
        long = asyncio.ensure_future(w.exec(["sleep"], "long", until=release))
        await asyncio.sleep(0)
        w.clock.now += KEY_TTL_S + 60
        release.set()
        first = await long
        return first, await w.exec(["sleep"], "long")

    first, again = asyncio.run(go())
    assert again == {**first, "existing": True} and w.runs.count(["sleep"]) == 1, w.runs


def test_the_traces_of_keyed_execs_count_against_what_the_daemon_keeps(monkeypatch):
    """A traced exec's answer holds its trace (up to limits.max_trace_bytes,
    1 MiB, of the tracer's JSON) beside its output: kept uncounted, a
    daemon's traced keyed execs of no output held up to 1 MiB each, 32 per
    sandbox, whatever KEPT_OUTPUT_BYTES said."""
    trace = {"execs": [{"argv": ["/bin/true"], "path": "/bin/true" * 8}] * 4}
    monkeypatch.setattr(opkeys, "KEPT_OUTPUT_BYTES", len(json.dumps(trace)) + 10)
    w = World()

    async def traced(n: int) -> dict:
        req = protocol.Exec(sandbox="sb1", argv=["true", str(n)], stream=False, trace=True, key=f"k{n}")

        async def run() -> dict:
            w.runs.append(req.argv)
            return {"exit_code": 0, "signal": None, "stdout": b"", "stderr": b"", "timed_out": False,
                    "trace": trace}

        return await w.registry.op_keys.once(w.sb, "exec", req, _Ctx(), run, exec_summary)

    async def go():
        await traced(1)
        await traced(2)                     # the two traces are past the cap: the first's goes
        with pytest.raises(Conflict) as e:
            await traced(1)
        return e.value, await traced(2)

    err, kept = asyncio.run(go())
    assert err.detail["outcome"] == "output_lost" and kept["trace"] == trace and kept["existing"] is True
    assert "output of 0 bytes and its trace are no longer kept" in err.message and err.detail["traced"] is True
    assert len(w.runs) == 2


def test_a_key_given_again_with_other_arguments_or_to_another_op_is_a_conflict():
    w = World()

    async def go():
        await w.exec(["echo", "one"], "k")
        with pytest.raises(Conflict) as other_args:
            await w.exec(["echo", "two"], "k")
        snap = protocol.Snapshot(sandbox="sb1", name="img", key="k")
        with pytest.raises(Conflict) as other_op:
            await w.registry.op_keys.once(w.sb, "snapshot", snap, _Ctx(), None, dict)
        return other_args.value, other_op.value

    other_args, other_op = asyncio.run(go())
    assert "key 'k'" in other_args.message and "other arguments" in other_args.message
    assert other_args.detail == {"key": "k", "sandbox": "sb1"}
    assert "another request" in other_op.message and len(w.runs) == 1


def test_a_key_is_one_to_256_characters():
    w = World()
    with pytest.raises(BadRequest):
        asyncio.run(w.exec(["true"], ""))
    with pytest.raises(BadRequest):
        asyncio.run(w.exec(["true"], "k" * 257))
    assert w.runs == []


def test_an_exec_whose_output_is_no_longer_kept_says_how_many_bytes_were_lost(monkeypatch):
    """The daemon keeps KEPT_OUTPUT_BYTES of keyed execs' output in all: an
    older one's goes first, and sent again it gets its status and the
    count of bytes lost, not a second run."""
    first_out = b"x" * 6
    monkeypatch.setattr(opkeys, "KEPT_OUTPUT_BYTES", len(first_out) + 4)
    w = World()

    async def go():
        await w.exec(["first"], "a", out=first_out)
        await w.exec(["second"], "b", out=b"y" * 5)        # together past the cap: the first's goes
        with pytest.raises(Conflict) as e:
            await w.exec(["first"], "a", out=first_out)
        kept = await w.exec(["second"], "b", out=b"y" * 5)
        return e.value, kept

    err, kept = asyncio.run(go())
    assert err.detail["lost_bytes"] == len(first_out) and err.detail["exit_code"] == 3
    assert f"output of {len(first_out)} bytes is no longer kept" in err.message and "exit 3" in err.message
    assert kept["stdout"] == b"y" * 5 and kept["existing"] is True
    assert w.runs == [["first"], ["second"]]


def test_a_request_whose_connection_goes_runs_on_and_answers_the_one_sent_again():
    w = World()

    async def go():
        release = asyncio.Event()
        first = asyncio.ensure_future(w.exec(["sleep"], "k", ctx=_Ctx("gone"), until=release))
        await asyncio.sleep(0)
        first.cancel()                           # the server's, as its client's connection ended
        with pytest.raises(asyncio.CancelledError):
            await first
        again = asyncio.ensure_future(w.exec(["sleep"], "k", until=release))
        await asyncio.sleep(0)
        release.set()
        return await again

    answer = asyncio.run(go())
    assert answer["stdout"] == b"out\n" and answer["existing"] is True and w.runs == [["sleep"]]


def test_a_request_whose_client_went_for_good_ends_after_the_orphan_time():
    """Nobody asked for it again within orphan_s (limits.keyed_orphan_s):
    the client went for good, and its request ends as an exec of no key
    does with its connection; its key says so."""
    w = World()
    w.registry.op_keys.orphan_s = 0.01

    async def go():
        first = asyncio.ensure_future(w.exec(["sleep"], "k", ctx=_Ctx("gone"), until=asyncio.Event()))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        under_way = w.registry.op_keys._running[("sb1", "k")]
        assert await under_way is None              # ended by the orphan timer, not answered
        with pytest.raises(Conflict) as e:
            await w.exec(["sleep"], "k")
        return e.value

    err = asyncio.run(go())
    assert err.detail["outcome"] == "cancelled" and "its client went" in err.message, err.message
    assert "limits.keyed_orphan_s" in err.message and w.runs == [["sleep"]]


def test_what_is_told_of_a_keyed_request_goes_to_each_request_waiting_for_it_once():
    """A keyed snapshot's progress (OpKeys.tell) goes to the requests of
    its key waiting for it as it comes: the one that began it, the one sent
    again on another connection, both while both wait, and the one sent
    again alone once the first's connection went; nobody once it ended."""
    w = World()
    at = ("sb1", "k")

    async def go():
        until = asyncio.Event()
        began, again = _Hearing(), _Hearing()
        first = asyncio.ensure_future(w.exec(["pack"], "k", ctx=began, until=until))
        await asyncio.sleep(0)
        w.registry.op_keys.tell(at, {"progress": 1})
        second = asyncio.ensure_future(w.exec(["pack"], "k", ctx=again))
        await asyncio.sleep(0)
        w.registry.op_keys.tell(at, {"progress": 2})
        first.cancel()                           # its connection went: the pack runs on
        with pytest.raises(asyncio.CancelledError):
            await first
        w.registry.op_keys.tell(at, {"progress": 3})
        until.set()
        answer = await second
        w.registry.op_keys.tell(at, {"progress": 4})
        return began.frames, again.frames, answer

    began, again, answer = asyncio.run(go())
    assert began == [{"progress": 1}, {"progress": 2}], began
    assert again == [{"progress": 2}, {"progress": 3}], again
    assert answer["existing"] and w.runs == [["pack"]]
    assert w.registry.op_keys._waiting == {}


def test_a_cancelled_request_ends_and_its_key_says_so():
    w = World()

    async def go():
        first = asyncio.ensure_future(w.exec(["sleep"], "k", until=asyncio.Event()))
        await asyncio.sleep(0)
        first.cancel()                           # a `cancel`: the connection is still there
        with pytest.raises(asyncio.CancelledError):
            await first
        # Told cancelled only once it unwound (a snapshot's sandbox thawed, an exec's group killed).
        assert w.unwound == [["sleep"]]
        with pytest.raises(Conflict) as e:
            await w.exec(["sleep"], "k")
        return e.value

    err = asyncio.run(go())
    assert err.detail["outcome"] == "cancelled" and "may have run, in part" in err.message
    assert w.journal.records["sb1"]["op_keys"]["k"]["cancelled"] == "cancel"
    assert w.registry.op_keys._tasks == {} and w.runs == [["sleep"]]


def test_the_daemons_stop_waits_for_the_keyed_requests_it_ends_to_be_undone():
    """close() (the daemon's stop) cancels the keyed requests under way,
    one whose client went included, and comes back once their undoing (an
    exec's group killed, a snapshot's sandbox thawed) is over: the stop
    goes on to close what that undoing goes through."""
    w = World()

    async def go():
        orphan = asyncio.ensure_future(w.exec(["sleep", "1"], "gone", ctx=_Ctx("gone"), until=asyncio.Event()))
        await asyncio.sleep(0)
        orphan.cancel()                          # its client went: it runs on, waited for by nobody
        with pytest.raises(asyncio.CancelledError):
            await orphan
        waited = asyncio.ensure_future(w.exec(["sleep", "2"], "here", ctx=_Ctx("stop"), until=asyncio.Event()))
        while ["sleep", "2"] not in w.runs:
            await asyncio.sleep(0)
        left = await w.registry.op_keys.close(5.0)
        unwound = list(w.unwound)
        with pytest.raises(asyncio.CancelledError):
            await waited
        return left, unwound

    left, unwound = asyncio.run(go())
    assert left == 0 and sorted(unwound) == [["sleep", "1"], ["sleep", "2"]], unwound
    assert w.registry.op_keys._tasks == {} and w.registry.op_keys._orphans == {}


def test_a_keyed_request_cancelled_by_its_stop_and_by_close_is_undone_whole():
    """The daemon's stop cancels the request (its connection's) and the
    keyed requests (close()) alike: the run is cancelled once, so the
    undoing the first cancel began is not cut short by the second."""
    w = World()
    req = protocol.Exec(sandbox="sb1", argv=["sleep"], stream=False, key="k")
    undone = []

    async def go():
        undoing, release = asyncio.Event(), asyncio.Event()

        async def run() -> dict:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                undoing.set()
                await release.wait()            # the undoing takes turns of the loop
                undone.append("sleep")
                raise

        request = asyncio.ensure_future(w.registry.op_keys.once(w.sb, "exec", req, _Ctx("stop"), run, exec_summary))
        await asyncio.sleep(0)
        request.cancel()                         # its connection's cancel began the undoing
        await undoing.wait()
        closing = asyncio.ensure_future(w.registry.op_keys.close(5.0))
        await asyncio.sleep(0.01)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await request
        return await closing

    assert asyncio.run(go()) == 0
    assert undone == ["sleep"], undone


def test_the_daemons_stop_waits_for_a_keyed_request_a_bounded_time():
    """An undoing that hangs (a thaw whose cgroup write blocks) must not
    keep the daemon from stopping: close() gives up after its timeout and
    says how many requests had not ended."""
    w = World()
    req = protocol.Exec(sandbox="sb1", argv=["sleep"], stream=False, key="stuck")

    async def go():
        unstuck = asyncio.Event()

        async def run() -> dict:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await unstuck.wait()
                raise

        request = asyncio.ensure_future(w.registry.op_keys.once(w.sb, "exec", req, _Ctx("gone"), run, exec_summary))
        await asyncio.sleep(0)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        started = time.monotonic()
        left = await w.registry.op_keys.close(0.05)
        took = time.monotonic() - started
        unstuck.set()
        assert await w.registry.op_keys._running[("sb1", "stuck")] is None
        return left, took

    left, took = asyncio.run(go())
    assert left == 1 and took < 5.0, (left, took)


def test_a_request_that_failed_frees_its_key():
    w = World()

    async def go():
        async def refused():
            w.runs.append(["refused"])
            raise BadRequest("no such cwd")
        req = protocol.Exec(sandbox="sb1", argv=["true"], stream=False, key="k")
        for _ in range(2):
            with pytest.raises(BadRequest):
                await w.registry.op_keys.once(w.sb, "exec", req, _Ctx(), refused, exec_summary)

    asyncio.run(go())
    assert w.runs == [["refused"], ["refused"]] and w.sb.op_keys == {}


def test_a_request_that_failed_on_a_bug_says_so_when_sent_again_not_that_a_daemon_stopped():
    """An error other than a DsecError (a bug: the client got `internal`)
    may come after the request did something: its key stays taken, and
    answers that it failed here, on this daemon, journaled for the next,
    never that the daemon before stopped under it."""
    w = World()

    async def go():
        async def broken():
            w.runs.append(["broken"])
            raise RuntimeError("a bug")
        req = protocol.Exec(sandbox="sb1", argv=["true"], stream=False, key="k")
        with pytest.raises(RuntimeError):
            await w.registry.op_keys.once(w.sb, "exec", req, _Ctx(), broken, exec_summary)
        with pytest.raises(Conflict) as e:
            await w.registry.op_keys.once(w.sb, "exec", req, _Ctx(), broken, exec_summary)
        return e.value

    err = asyncio.run(go())
    assert err.detail["outcome"] == "failed" and "RuntimeError" in err.message, err.message
    assert "stopped" not in err.message and w.runs == [["broken"]]
    assert w.journal.records["sb1"]["op_keys"]["k"]["failed"] == "RuntimeError"


def test_a_cancel_that_came_as_the_request_ended_leaves_its_answer_standing():
    """A cancel whose request had just ended (its answer made, not yet
    taken) cancels nothing: the key must answer what it did, not that it
    was cancelled, here and for the daemon after (its journal)."""
    w = World()
    req = protocol.ProcStart(sandbox="sb1", argv=["sleep"], key="p")

    async def go():
        request = asyncio.current_task()

        async def started():
            request.cancel()                # the cancel comes as the start ends
            return {"pid": 7, "started": 5.0}

        with pytest.raises(asyncio.CancelledError):
            await w.registry.op_keys.once(w.sb, "proc_start", req, _Ctx("cancel"), started, dict, _as_it_was)

    async def after():
        again = World()
        again.sb.op_keys = json.loads(json.dumps(w.journal.records["sb1"]))["op_keys"]
        return await again.registry.op_keys.once(again.sb, "proc_start", req, _Ctx(), None, dict, _as_it_was)

    asyncio.run(go())
    assert asyncio.run(after()) == {"pid": 7, "started": 5.0, "existing": True}


def test_a_key_whose_journal_write_failed_is_free_again(monkeypatch):
    """A key is journaled before its request runs; when that write fails
    (a full disk) the request is refused without running, and the key
    must not stay behind saying a daemon stopped under it."""
    w = World()
    write = w.journal.write

    def full(key, record):
        raise OSError(28, "No space left on device")

    async def go():
        monkeypatch.setattr(w.journal, "write", full)
        with pytest.raises(OSError):
            await w.exec(["echo"], "k")
        monkeypatch.setattr(w.journal, "write", write)
        return await w.exec(["echo"], "k")         # the disk freed: sent again, it runs

    answer = asyncio.run(go())
    assert "existing" not in answer and w.runs == [["echo"]]


def test_a_daemon_that_follows_answers_from_the_journal_or_says_the_outcome_went():
    """The journal carries each key from before its request ran: a
    proc_start's answer is made again from its summary; an exec the daemon
    before began and never ended (it stopped under it, or died) is an
    error, never a second run."""
    w = World()

    async def go():
        await w.registry.op_keys.once(w.sb, "proc_start", protocol.ProcStart(sandbox="sb1", argv=["sleep"], key="p"),
                                      _Ctx(), _started, dict, _as_it_was)
        ended = asyncio.ensure_future(w.exec(["sleep"], "e", ctx=_Ctx("stop"), until=asyncio.Event()))
        await asyncio.sleep(0)
        ended.cancel()                          # the daemon stops: the exec is killed, its end not told
        with pytest.raises(asyncio.CancelledError):
            await ended
        record = json.loads(json.dumps(w.journal.records["sb1"]))    # as the daemon left it

        after = World()
        after.sb.op_keys = record["op_keys"]
        again = await after.registry.op_keys.once(
            after.sb, "proc_start", protocol.ProcStart(sandbox="sb1", argv=["sleep"], key="p"), _Ctx(), None, dict,
            _as_it_was)
        with pytest.raises(Conflict) as e:
            await after.exec(["sleep"], "e")
        return again, e.value, after.runs

    again, err, runs = asyncio.run(go())
    assert again == {"pid": 7, "started": 5.0, "existing": True}
    assert err.detail["outcome"] == "unknown" and "stopped before it ended" in err.message and runs == []


async def _started() -> dict:
    return {"pid": 7, "started": 5.0}


async def _as_it_was(answer: dict) -> dict:
    return answer


def test_an_input_at_a_negative_offset_is_refused_not_cut():
    """An offset before the input's start is no offset at all: taken as
    one, `data[taken - offset:]` dropped its first bytes unwritten and
    answered that they were skipped."""
    proc = types.SimpleNamespace(pid=7)
    req = protocol.ProcInput(sandbox="sb1", pid=7, data=b"hello world", offset=-5)
    with pytest.raises(BadRequest) as e:
        _not_written_yet(World().sb, proc, req, 0)
    assert "offset" in e.value.message and e.value.detail["offset"] == -5
