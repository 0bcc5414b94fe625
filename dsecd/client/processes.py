"""Background processes in a sandbox (Sandbox.spawn): Process, its status
and output, and where a follow of its output is, to take it up again
after a lost connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import Conflict, ConnectionLost, NotFound
from .refollow import _Refollow
from .wire import _reconnects

if TYPE_CHECKING:
    from .sandbox import Sandbox


@dataclass
class ProcOutput:
    """A chunk of a background process's output: `fd` 1 or 2, `data`, and
    `time` (seconds since the epoch) when the daemon read it. A notice that
    output fell out of the daemon's ring, or was dropped by this client for
    a follower that fell behind by more than FOLLOWED_OUTPUT_BYTES, has fd
    0, no data and `dropped` > 0,
    or `lost_before`: the daemon was replaced at that time without a count
    of what it had read (it died, or was older than that count), and what
    the process wrote before it, if anything, is gone uncounted."""

    fd: int
    data: bytes
    time: float = 0.0
    dropped: int = 0
    lost_before: float | None = None


@dataclass
class ProcStatus:
    """A background process as `proc_list` shows it."""

    pid: int
    state: str               # "running" or "exited"
    exit_code: int | None
    signal: int | None
    argv: list[str]
    started: float
    ended: float | None
    output_bytes: int        # kept in the daemon's ring
    dropped: int             # fell out of it
    stdin_open: bool
    lost_before: float | None = None   # output before this time went, uncounted, with the daemon before

    @classmethod
    def from_wire(cls, r: dict) -> ProcStatus:
        # An argument that is not UTF-8 comes as bytes: os.fsdecode's str, as sys.argv holds one.
        argv = [os.fsdecode(a) if isinstance(a, bytes) else a for a in r.get("argv") or []]
        return cls(**{**{k: r.get(k) for k in cls.__dataclass_fields__}, "argv": argv})


class Process:
    """A background process in a sandbox (Sandbox.spawn, Sandbox.process):
    named by its pid in the sandbox, so any client may take it up again."""

    def __init__(self, sb: Sandbox, pid: int, stdin_at: int | None = None):
        self.sb = sb
        self.pid = pid
        # The offset of the next input in all this process's input (spawn's
        # Process: 0, and counted by write), sent with each proc_input so
        # that one whose connection was lost goes again and the daemon skips
        # what it already wrote. None: unknown (a process taken up by pid, or
        # after a write that failed): inputs go unchecked, once.
        self._stdin_at = stdin_at
        # Done when the last input sent at an offset has ended (_input).
        self._last_input: asyncio.Future | None = None

    def __repr__(self) -> str:
        return f"<Process {self.pid} in {self.sb.id}>"

    def _args(self, **more) -> dict:
        return {"sandbox": self.sb.id, "pid": self.pid, **more}

    async def status(self) -> ProcStatus:
        for p in await self.sb.processes():
            if p.pid == self.pid:
                return p
        raise NotFound(f"no background process with pid {self.pid} in sandbox {self.sb.id}")

    async def wait(self) -> ProcStatus:
        """Its status once it exited (`exit_code`, or `signal` if killed)."""
        return ProcStatus.from_wire(await self.sb.client.request("proc_wait", **self._args()))

    async def output(self, follow: bool = True, since: float | None = None) -> AsyncIterator[ProcOutput]:
        """Its output kept by the daemon, then (follow) new output as it
        comes, until it exited and its output drained; since: only chunks
        read at or after this time (seconds since the epoch). A loop that
        reads slower than the process writes loses what comes while it is
        FOLLOWED_OUTPUT_BYTES behind: a ProcOutput with `dropped` counts it.

        The process outlives a daemon restart, and so does this loop: on a
        client that reconnects (the default), a lost connection is followed
        again on the next one from where it was. Nothing comes twice; what
        the daemon that went had read and not sent is gone with it (a
        container's ring is the daemon's), and comes as a ProcOutput with
        `dropped` (its count, after a clean stop, which sends what it read
        first: only what its connection did not take within 5 s) or
        `lost_before` (after one that died: uncounted, perhaps nothing). A microVM's agent keeps
        its ring, so nothing of it is lost. Where the client does not
        reconnect, the next daemon does not answer, or the follow was lost
        FOLLOW_LOST_MAX times in a row with nothing of it come (a daemon
        that drops the request), ConnectionLost says that the process runs
        on and how to follow it again."""
        client = self.sb.client
        args = self._args(follow=follow, **({"since": since} if since is not None else {}))
        follower = _Follower(since is None)
        refollow = _Refollow()
        while True:
            follower.attach()
            refollow.attach()
            came = False
            try:
                async with contextlib.aclosing(client.frames("proc_logs", **args)) as frames:
                    async for frame in frames:
                        came = True
                        if "__result__" in frame:
                            return
                        for chunk in follower.take(frame):
                            yield chunk
                return
            except ConnectionLost as err:
                # Not sent: the daemon did not answer again (reconnect_timeout).
                if not (err.sent and _reconnects(client)):
                    raise self._runs_on(err, follower) from None
                try:
                    await refollow.lost(err, came)
                except ConnectionLost as given_up:
                    raise self._runs_on(given_up, follower) from None
                args = self._args(follow=follow, **follower.resume_args(since))

    def _runs_on(self, err: ConnectionLost, follower: _Follower) -> ConnectionLost:
        """The error that ends output() on a lost connection it does not
        follow again: the process runs on, and how to follow it."""
        text = (f"{err}; process {self.pid} in sandbox {self.sb.id} runs on (a lost connection or a daemon "
                "restart does not end it)")
        if getattr(self.sb.client, "lost_advice", None) is None:       # else its owner's advice says what to do
            # Just past the last chunk given: what the daemon read after it
            # (and a count of what went with a daemon since, none of it given).
            at = (f"since={math.nextafter(follower.last_time, math.inf)!r}" if follower.last_time is not None
                  else "")
            text += (f": follow it again with sb.process({self.pid}).output({at})"
                     + (", from just past the last chunk it gave" if at else ""))
        return ConnectionLost(text, target=err.target, op="proc_logs", sent=err.sent)

    async def write(self, data: bytes) -> None:
        """Input for its stdin (waits while it does not read)."""
        await self._input(bytes(data), False)

    async def close_stdin(self) -> None:
        await self._input(b"", True)

    async def _input(self, data: bytes, eof: bool) -> None:
        args = self._args(data=data) if data else self._args()
        if eof:
            args["eof"] = True
        before = mine = None
        if self._stdin_at is not None:
            # Taken at the call, in the order the requests go out.
            args["offset"] = self._stdin_at
            self._stdin_at += len(data)
            before, mine = self._last_input, asyncio.get_running_loop().create_future()
            self._last_input = mine
        try:
            try:
                await self.sb.client.request("proc_input", **args)
            except Conflict as err:
                # An input the daemon refused for its in-flight limit goes
                # again a moment later (Client.frames_with_id), so the one
                # sent after it can come first and be refused as past the
                # bytes written: sent again once the one before it ended.
                taken = err.detail.get("taken")
                if before is None or not isinstance(taken, int) or taken >= args["offset"]:
                    raise
                await asyncio.wait([before])
                await self.sb.client.request("proc_input", **args)
        except BaseException:
            self._stdin_at = None       # how much of it went in is not known here
            raise
        finally:
            if mine is not None:
                mine.set_result(None)
                if self._last_input is mine:
                    self._last_input = None

    async def kill(self, signal: int | str = "KILL") -> dict:
        """Signal its process group: a number or a name ("TERM", "SIGINT")."""
        sig = int(signal) if not isinstance(signal, str) else signal
        return await self.sb.client.request("proc_kill", **self._args(signal=sig))


class _Follower:
    """Where Process.output() is in a process's output, to follow it again
    on a new connection from there.

    `offset` is where the next byte is in the daemon's count of every byte
    the process wrote (the first frame's `dropped` is the offset of its
    first chunk, and each chunk or later `dropped` moves it on); None where
    a `since` passed over chunks uncounted. Known, it is followed again
    from the daemon's whole ring, passing over what came already: a
    microVM's ring (and one the same daemon still holds) has it all again,
    and the next daemon of a container counts on from what the one before
    read, so a first chunk past `offset` tells exactly what went with that
    daemon. Unknown, it asks for what was read after the last chunk that
    came. A daemon that died and left no count (`lost_before` after the
    last chunk) numbers its bytes from 0: all it holds is new."""

    def __init__(self, counted: bool):
        self.offset: int | None = 0 if counted else None
        self.last_time: float | None = None
        self.again = False            # this attach follows again after a loss
        self.first = True             # its first frame is next
        self.cursor = 0               # the offset of its next chunk, in its daemon's count

    def attach(self) -> None:
        self.first = True

    def resume_args(self, since: float | None) -> dict:
        """proc_logs' `since` for the next attach."""
        self.again = True
        if self.offset is not None:
            return {}
        if self.last_time is None:
            return {} if since is None else {"since": since}
        return {"since": math.nextafter(self.last_time, math.inf)}

    def take(self, frame: dict) -> list[ProcOutput]:
        """What a stream frame of proc_logs gives the caller."""
        if "dropped" in frame:
            dropped, gap = frame["dropped"], frame.get("lost_before")
            first, self.first = self.first, False
            if not first:
                # Lost on the way (a follower too slow): counted past what came already.
                before, self.cursor = self.cursor, self.cursor + dropped
                if self.offset is not None:
                    dropped = max(0, self.cursor - max(self.offset, before))
            elif not self.again:
                self.cursor = dropped
            elif gap is not None and (self.last_time is None or gap > self.last_time):
                # A daemon that died since: it counts from 0, and all it holds is new.
                self.cursor = dropped
                if self.offset is not None:
                    self.offset = dropped
                return [ProcOutput(0, b"", 0.0, dropped, gap)]
            else:
                self.cursor = dropped
                gap = None                        # the follower was told before, or it is older
                if self.offset is not None:
                    dropped = max(0, dropped - self.offset)
            if self.offset is not None:
                self.offset = max(self.offset, self.cursor)
            return [ProcOutput(0, b"", 0.0, dropped, gap)] if dropped or gap is not None else []
        data, at = frame["data"], self.cursor
        self.cursor += len(data)
        if self.offset is not None:
            if self.cursor <= self.offset:
                return []                       # it came before the loss
            data = data[max(0, self.offset - at):]
            self.offset = self.cursor
        self.last_time = frame["time"]
        return [ProcOutput(frame["fd"], data, frame["time"])]
