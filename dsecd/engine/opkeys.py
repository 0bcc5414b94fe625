"""Idempotency keys of the requests that do something each time they run in
a sandbox: an `exec` without stdin or pty, `proc_start` and `snapshot`. A request whose
connection was lost after it was sent (an ssh:// link cut, a daemon restart)
may have run: sent again with the same key, it is answered with what the
first one did (its result, `existing: true`), or waits for it if it still
runs, instead of running the command, starting the process or packing the
snapshot a second time. Given again with other arguments, the key is a
conflict. As a create's key (dsecd/engine/creates.py), but per sandbox.

What is kept, and for how long:

- Each key is journaled with its sandbox (Sandbox.op_keys: its op, a digest
  of its arguments, when it began) before the request runs, so a daemon
  that follows one that died or stopped under it knows it began. Once a
  proc_start or a snapshot ended, a summary of its answer is journaled with
  its key (the pid and start; the image's name and manifest), and the next
  daemon answers from it. An exec's end is not journaled (the key's entry
  is the sandbox's whole record written again: one write per exec is the
  cost), so an exec a daemon before began is an error for the next one
  saying its outcome went with that daemon (it may have run, in part),
  never run again.
- A request that failed on an error other than a DsecError (a bug) may
  have done something: its key stays, marked failed (journaled), and
  answers so.
- At most KEYS_PER_SANDBOX keys of ended requests per sandbox besides
  those under way, the one that ended first forgotten first, and none
  KEY_TTL_S after its request ended: a key forgotten is free again (a
  request with it runs anew).
  A key also goes with its sandbox.
- A collected exec's whole answer (its output, and its trace if traced) is
  kept in memory, at most KEPT_OUTPUT_BYTES of output and traces over the
  daemon, the oldest dropped first; an exec sent again after its output was
  dropped gets its status and an error saying how many bytes of output
  were lost. A streamed exec's output goes to its client as it comes, and
  the tail of it is kept (keyedstream.py) for the request sent again, which
  takes it up from the bytes its client got: while it runs, and with its
  answer once it ended, counted in KEPT_OUTPUT_BYTES then.

A request under a key does not die with its connection (a lost link is what
the key is for): it runs on, and its answer waits for the request sent
again; once no request of its key has waited for it for
limits.keyed_orphan_s, its client is taken as gone for good and it ends, as
an exec of no key does with its connection. A `cancel` of it, or a daemon
stop, ends it at once; the key then answers that it was cancelled (it may
have run, in part).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import MISSING, fields

from ..errors import BadRequest, Conflict, DsecError
from ..onloop import cancel_once
from .keyedstream import KeyedStream

KEYS_PER_SANDBOX = 32
KEY_TTL_S = 3600.0
KEPT_OUTPUT_BYTES = 32 << 20
KEY_MAX_CHARS = 256
# How long a keyed request whose client went runs on with no request of its
# key waiting for it (limits.keyed_orphan_s sets it).
ORPHAN_S = 60.0


def check_key(op: str, key: str | None) -> None:
    if key is not None and not 1 <= len(key) <= KEY_MAX_CHARS:
        raise BadRequest(f"{op}: key must be 1 to {KEY_MAX_CHARS} characters", {"key": key})


# Fields a key's digest leaves out: the key itself, and where a streamed
# exec sent again takes its output up (keyedstream.py), which differs each
# time it is sent.
UNDIGESTED = ("key", "stream_from")


def args_digest(req) -> str:
    """A digest of a keyed request's arguments besides its key, as sent: a
    retry of the same request has the same (the SDK and the CLI send the
    same request again), another request under the same key has not. Only
    the fields that differ from their defaults count: a field a later daemon
    adds (with a default) leaves the digests of journaled keys as they were.
    (The request's fields are flat: plain values, lists and dicts, taken as
    they are; dataclasses.asdict's deep copy was ~50 us of the loop per call.)"""
    args = {}
    for name, default in _digested_fields(type(req)):
        value = getattr(req, name)
        if default is MISSING or value != default:
            args[name] = value
    return hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()[:32]


@functools.cache
def _digested_fields(cls) -> tuple[tuple[str, object], ...]:
    """(name, default) of the fields of request type `cls` a key's digest
    covers (all but UNDIGESTED); MISSING as the default of a required field."""
    return tuple((f.name, f.default if f.default is not MISSING
                  else f.default_factory() if f.default_factory is not MISSING else MISSING)
                 for f in fields(cls) if f.name not in UNDIGESTED)


def output_bytes(result: dict) -> int:
    """The bytes of output a collected exec's answer holds."""
    return len(result.get("stdout") or b"") + len(result.get("stderr") or b"")


def kept_bytes(answer: dict) -> int:
    """What an ended request's answer kept in memory counts against
    KEPT_OUTPUT_BYTES: its output, and a traced exec's trace (up to
    limits.max_trace_bytes of the tracer's JSON, often more than its
    output), as that JSON."""
    trace = answer.get("trace")
    return output_bytes(answer) + (len(json.dumps(trace, default=str)) if trace else 0)


class OpKeys:
    """The keys of the sandboxes' keyed requests (see the module's doc).
    `clock`: wall time, when a key began (journaled)."""

    def __init__(self, registry, clock: Callable[[], float] = time.time):
        self.registry = registry
        self.clock = clock
        # (sandbox id, key) -> the request under way, done with its answer
        # (None: it failed or was cancelled).
        self._running: dict[tuple[str, str], asyncio.Future] = {}
        # (sandbox id, key) -> the whole answer of an ended request and its
        # kept_bytes (counted once), oldest first.
        self._answers: collections.OrderedDict[tuple[str, str], tuple[dict, int]] = collections.OrderedDict()
        self._answer_bytes = 0
        # (sandbox id, key) -> a streamed exec's output (its tail), for the
        # request sent again, while it runs and with its kept answer.
        self._streams: dict[tuple[str, str], KeyedStream] = {}
        # (sandbox id, key) -> the summary of an ended exec, not journaled.
        self._summaries: dict[tuple[str, str], dict] = {}
        # (sandbox id, key) -> the task of the request under way: a lost
        # connection leaves it to run, for `orphan_s` while no request of its
        # key waits for it; a cancel or close() (the daemon's stop) ends it.
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}
        # (sandbox id, key) -> the contexts of the requests waiting for the
        # request under way (the one that began it, and any sent again since
        # its connection was lost): what `tell` sends goes to them.
        self._waiting: dict[tuple[str, str], list] = {}
        self._orphans: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self.orphan_s = ORPHAN_S

    async def once(self, sb, op: str, req, ctx, run: Callable[[], Awaitable[dict]],
                   summary: Callable[[dict], dict],
                   again: Callable[[dict], Awaitable[dict]] | None = None,
                   stream: KeyedStream | None = None) -> dict:
        """The answer of `req` (op `op`, whose `key` may be None) in `sb`:
        run() once per key. `summary(answer)`: what of it is kept once it
        ended; `again(summary)`: the answer made again from that summary,
        journaled at once (None: the answer is kept in memory only, and its
        summary goes to the journal with the sandbox's next record).
        `stream`: a streamed exec's output, which run() emits to: a request
        sent again is sent it from its `stream_from` (keyedstream.py)."""
        if req.key is None:
            return await run()
        check_key(op, req.key)
        digest = args_digest(req)
        at = (sb.id, req.key)
        got = getattr(req, "stream_from", None)
        self._expire(sb)
        while (fut := self._running.get(at)) is not None:
            self._same(req, op, sb.op_keys.get(req.key), digest)
            answer = await self._waited(sb, at, ctx, fut, resent_from=got or [0, 0])
            if answer is not None:
                return {**answer, "existing": True}
        entry = sb.op_keys.get(req.key)
        if entry is not None:
            self._same(req, op, entry, digest)
            answer = await self._answer_of(sb, op, req.key, entry, again, got)
            if (kept := self._streams.get(at)) is not None:
                await kept.attach(ctx, got)
            return {**answer, "existing": True}
        if got and any(got):
            # Its client got output of a run under this key that this daemon
            # does not know (a daemon before began it, or the key was forgotten):
            # run again, its output would come twice.
            raise Conflict(f"{op} with key {req.key!r} in sandbox {sb.id}: its client got output of a run "
                           "this daemon does not know (begun by a daemon that stopped, or its key was "
                           "forgotten): whether it ended, and how, is unknown; look at what it would have done "
                           "before sending it again under another key",
                           {"key": req.key, "sandbox": sb.id, "op": op, "outcome": "unknown"})
        sb.op_keys[req.key] = {"op": op, "args": digest, "at": self.clock()}
        self._trim(sb, req.key)
        try:
            self.registry.save(sb)
        except BaseException:
            # Not journaled (a full disk), so not run: the key is free again
            # for the request sent once the journal takes it.
            sb.op_keys.pop(req.key, None)
            raise
        fut = asyncio.get_running_loop().create_future()
        self._running[at] = fut
        if stream is not None:
            self._streams[at] = stream
        task = self._tasks[at] = asyncio.ensure_future(run())
        task.set_name(f"{op} with key {req.key!r} on sandbox {sb.id}")     # for a stop that cannot wait
        task.add_done_callback(lambda t: self._ended(sb, at, t, fut, summary, again is not None))
        return await self._waited(sb, at, ctx, task)

    async def _waited(self, sb, at: tuple[str, str], ctx, under_way: asyncio.Future,
                      resent_from: list[int] | None = None) -> dict | None:
        """`under_way`'s outcome, for a request of its key (`resent_from`:
        one sent again, a streamed exec's taking its output up from there).
        The request cancelled: a lost connection leaves it to run, its answer
        waiting for the request sent again (for `orphan_s` once no request of
        its key waits: a client that went for good leaves nothing running,
        as with an exec of no key); a cancel or the daemon's stop ends it.
        Cancelled, its key says so; ended by a stop, the key stays as
        journaled: begun, its end unknown to the next daemon. While it
        waits, the request hears what `tell` sends for the key."""
        stream = self._streams.get(at)
        self._waiting.setdefault(at, []).append(ctx)
        if (timer := self._orphans.pop(at, None)) is not None:
            timer.cancel()
        try:
            if stream is not None and resent_from is not None:
                await stream.attach(ctx, resent_from)
            if stream is not None:
                # A request of the key sent meanwhile on another connection
                # (its client cannot tell a link cut from one still up)
                # takes the output over: this one's client gets no more of it.
                taken = stream.taken(ctx)
                await asyncio.wait({under_way, taken}, return_when=asyncio.FIRST_COMPLETED)
                if not under_way.done():
                    raise Conflict(f"exec with key {at[1]!r} in sandbox {sb.id}: another request with its key "
                                   "took its output over (the same exec sent again, on another connection); "
                                   "the rest of its output and its result go to that request",
                                   {"key": at[1], "sandbox": sb.id, "op": "exec", "outcome": "taken_over"})
            return await asyncio.shield(under_way)
        except asyncio.CancelledError:
            why = ctx.why_cancelled()
            if why == "gone" and stream is not None:
                stream.detach(ctx)
            if why != "gone" and (task := self._tasks.get(at)) is not None:
                if why == "cancel" and (entry := sb.op_keys.get(at[1])) is not None:
                    entry["cancelled"] = "cancel"
                cancel_once(task)          # close() may have cancelled it already
                # Its undoing (a snapshot's sandbox thawed, an exec's group
                # killed) is over before the request's own end is told, as
                # when it ran in the request.
                await asyncio.wait({task})
            raise
        finally:
            self._waiting[at].remove(ctx)
            if not self._waiting[at]:
                del self._waiting[at]
                task = self._tasks.get(at)
                if task is not None and not task.done() and not task.cancelling():
                    self._orphans[at] = asyncio.get_running_loop().call_later(self.orphan_s, self._orphaned,
                                                                              sb, at)

    def tell(self, at: tuple[str, str], frame: dict) -> None:
        """Send `frame` (a snapshot's progress event) to the requests of
        the key `at` (sandbox id, key) waiting for its request under way:
        the one that began it, and one sent again after its connection was
        lost (whose client would else hear nothing more until the answer).
        Each hears a frame once, as it comes: none is told again, and a
        request sent again hears the frames from then on."""
        for ctx in self._waiting.get(at, ()):
            ctx.emit_nowait(frame)

    def _orphaned(self, sb, at: tuple[str, str]) -> None:
        """No request of its key came for it within `orphan_s` of its client's going: it ends."""
        del self._orphans[at]
        if (entry := sb.op_keys.get(at[1])) is not None:
            entry["cancelled"] = "orphaned"
        self._tasks[at].cancel()

    def _ended(self, sb, at: tuple[str, str], task: asyncio.Task, fut: asyncio.Future, summary,
               journal_end: bool) -> None:
        del self._running[at]
        del self._tasks[at]
        if (timer := self._orphans.pop(at, None)) is not None:
            timer.cancel()
        entry = sb.op_keys.get(at[1])
        stream = self._streams.pop(at, None)
        if stream is not None:
            stream.end()
        if task.cancelled():
            if entry is not None:
                self._ended_last(sb, at[1])
                if entry.get("cancelled"):
                    self._save(sb)
            fut.set_result(None)
            return
        if (err := task.exception()) is not None:
            # An error is answered before anything ran (a bad request, a
            # start that failed, a snapshot that made no image): the key is
            # free again, for the request corrected or retried.
            if isinstance(err, DsecError) and sb.op_keys.get(at[1]) is entry:
                sb.op_keys.pop(at[1], None)
                self._save(sb)
            elif entry is not None:
                # Another (a bug, answered `internal`) may come after the
                # request did something: the key stays taken and says so.
                entry["failed"] = type(err).__name__
                self._ended_last(sb, at[1])
                self._save(sb)
            fut.set_result(None)
            return
        answer = task.result()
        if entry is not None and self.registry.listed(sb):    # else destroyed meanwhile: nobody can ask again
            # A cancel (or orphaning) that came as it ended, or that it got
            # past (its answer made regardless), cancelled nothing: what it
            # did is the key's answer.
            cancelled = entry.pop("cancelled", None)
            self._ended_last(sb, at[1])
            if journal_end:
                entry["result"] = summary(answer)
                self._save(sb)
            else:
                # An exec's summary only says what an answer dropped from
                # memory was: kept there, not journaled (each key's journal
                # entry is the sandbox's record written again: a write per
                # exec is enough).
                self._summaries[at] = summary(answer)
                if stream is not None:
                    self._summaries[at]["bytes"] = sum(stream.ends())
                if cancelled:
                    self._save(sb)
            self._keep(at, answer, stream)
        fut.set_result(answer)

    def _save(self, sb) -> None:
        """Journal the sandbox's keys, unless it is going (its record is gone)."""
        if self.registry.listed(sb) and sb.state in ("running", "paused", "dead"):
            self.registry.save(sb)

    async def _answer_of(self, sb, op: str, key: str, entry: dict, again,
                         got: list[int] | None = None) -> dict:
        """The answer of an ended keyed request, or the error saying why
        there is none (`got`: the output a streamed exec's client has)."""
        kept = self._answers.get((sb.id, key))
        if kept is not None:
            return kept[0]
        what = f"{op} with key {key!r} in sandbox {sb.id}"
        detail = {"key": key, "sandbox": sb.id, "op": op}
        if entry.get("cancelled"):
            why = ("cancelled" if entry["cancelled"] == "cancel" else
                   f"ended: its client went and no request of its key came within {self.orphan_s:g} s "
                   "(limits.keyed_orphan_s)")
            raise Conflict(f"{what} was {why} (it may have run, in part); to run it again, send it under "
                           "another key", {**detail, "outcome": "cancelled"})
        if entry.get("failed"):
            raise Conflict(f"{what} failed with an internal error ({entry['failed']}: see the daemon log); it "
                           "may have run, in part: look at what it would have done before sending it again "
                           "under another key", {**detail, "outcome": "failed"})
        summary = entry.get("result") or self._summaries.get((sb.id, key))
        if summary is None:
            raise Conflict(f"{what} was begun by a daemon that stopped before it ended (a restart): whether "
                           "it ran, and its answer, went with that daemon; look at what it would have "
                           "done before sending it again under another key", {**detail, "outcome": "unknown"})
        if again is not None:
            return await again(summary)
        lost = max(0, summary.get("bytes", 0) - sum(got or ()))
        trace = " and its trace are" if summary.get("traced") else " is"
        raise Conflict(f"{what} ended ({_status(summary)}), but its output of {lost} bytes{trace} no longer "
                       f"kept (the daemon keeps the last {KEPT_OUTPUT_BYTES >> 20} MiB of keyed execs' "
                       "output and traces): that many bytes were lost; send it under another key to run it "
                       "again",
                       {**detail, **summary, "outcome": "output_lost", "lost_bytes": lost})

    @staticmethod
    def _same(req, op: str, entry: dict | None, digest: str) -> None:
        if entry is not None and (entry["op"] != op or entry["args"] != digest):
            first = "another request" if entry["op"] != op else "other arguments"
            raise Conflict(f"{op}: key {req.key!r} was given to {entry['op']} of {first} in sandbox "
                           f"{req.sandbox}; a key stands for one request: give the same arguments to get its "
                           "answer, or another key", {"key": req.key, "sandbox": req.sandbox})

    def _keep(self, at: tuple[str, str], answer: dict, stream: KeyedStream | None) -> None:
        size = kept_bytes(answer) + (stream.kept_bytes if stream is not None else 0)
        if stream is not None:
            self._streams[at] = stream
        self._answers[at] = (answer, size)
        self._answer_bytes += size
        while self._answer_bytes > KEPT_OUTPUT_BYTES and self._answers:
            self._drop_answer(next(iter(self._answers)))

    def _drop_answer(self, at: tuple[str, str]) -> None:
        kept = self._answers.pop(at, None)
        if kept is not None:
            self._answer_bytes -= kept[1]
        self._streams.pop(at, None)

    def _expire(self, sb) -> None:
        """Forget the sandbox's keys of ended requests older than KEY_TTL_S."""
        before = self.clock() - KEY_TTL_S
        old = [k for k, e in sb.op_keys.items() if e["at"] < before and (sb.id, k) not in self._running]
        for key in old:
            self._forget(sb, key)
        if old:
            self._save(sb)

    def _trim(self, sb, begun: str | None = None) -> None:
        """At most KEYS_PER_SANDBOX keys of ended requests, besides those
        under way: the one that ended first goes first. `begun`: the key of
        a request about to run, not yet in `_running`, not an ended one."""
        ended = [k for k in sb.op_keys if (sb.id, k) not in self._running and k != begun]
        for key in ended[:max(0, len(ended) - KEYS_PER_SANDBOX)]:
            self._forget(sb, key)

    def _ended_last(self, sb, key: str) -> None:
        """`key`'s request ended and its key stays: the newest of the
        sandbox's ended keys, so the last forgotten however long it ran (a
        key that began first but ended last is still there for the request
        sent again). One too many ended keys, the first ended goes: in
        memory now, from the journal with the sandbox's next record. Its
        KEY_TTL_S counts from now too: a request that ran longer than that
        is still answered when sent again as it ended."""
        entry = sb.op_keys[key] = sb.op_keys.pop(key)
        entry["at"] = self.clock()
        self._trim(sb)

    def _forget(self, sb, key: str) -> None:
        del sb.op_keys[key]
        self._drop_answer((sb.id, key))
        self._summaries.pop((sb.id, key), None)

    def forget_sandbox(self, sb_id: str) -> None:
        """The sandbox is destroyed: its kept answers go (its keys went with its record)."""
        for at in [at for at in (*self._answers, *self._summaries) if at[0] == sb_id]:
            self._drop_answer(at)
            self._summaries.pop(at, None)

    async def close(self, timeout: float) -> int:
        """The daemon stops: the keyed requests under way end as those of
        connections do, and are waited for up to `timeout` s, so that their
        undoing (an exec's process group killed, a snapshot's sandbox
        thawed) is done before the stop closes what it goes through (init's
        channels, the worker pool). Bounded: an undoing that hangs (a thaw
        whose cgroup write blocks, a kill through a wedged init) must not
        keep the daemon from stopping; what it leaves, the next daemon's
        re-adoption finds as after a death. How many had not ended."""
        for timer in self._orphans.values():
            timer.cancel()
        self._orphans.clear()
        tasks = set(self._tasks.values())
        for task in tasks:
            cancel_once(task)                 # one its request's stop cancelled is undoing already
        if not tasks:
            return 0
        _done, pending = await asyncio.wait(tasks, timeout=timeout)
        return len(pending)

    def under_way(self) -> list[str]:
        """The keyed requests not ended, by name (op, key, sandbox), for
        the log of a stop that could not wait for them."""
        return sorted(task.get_name() for task in self._tasks.values() if not task.done())


def _status(summary: dict) -> str:
    if summary.get("timed_out"):
        return "timed out"
    if summary.get("signal"):
        return f"killed by signal {summary['signal']}"
    return f"exit {summary.get('exit_code')}"
