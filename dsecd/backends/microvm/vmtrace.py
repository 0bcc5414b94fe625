"""A traced exec's record from a microVM: the guest tracer's raw records
(csrc/guest/agent.c, trace_main; fd 3 of the exec's output) turned into the
same `trace` as a container's (dsecd/trace.py: Recorder, call_event).

The stream is  u32 length | u64 ns since the start | u64 pid | u64 kind | fields
per record, fields in the channel's encoding (wire.Reader). The guest is
untrusted: a record longer than one the limits allow, or one that does not
parse, ends the reading (`error` is set, what came before stays) and costs
the host at most one such record's bytes.
"""

from __future__ import annotations

import struct

from ... import trace
from . import wire

TR_SYSCALL, TR_SIGNAL, TR_FORK, TR_EXIT, TR_ERROR = 1, 2, 3, 4, 5


class GuestTrace:
    """Feed it the exec's fd-3 bytes as they come; `finish` gives the record."""

    def __init__(self, limits: trace.Limits):
        self.limits = limits
        self.trace = trace.Trace(pid=0)
        self.recorder = trace.Recorder(self.trace, limits)
        self.buf = bytearray()
        self.error: str | None = None
        self.root: int | None = None        # the first pid recorded: the command's
        self.root_ended = False
        # The longest record the limits allow: every string and argv entry
        # at its bound, with its length field, and the fixed fields.
        self.max_record = 256 + (limits.max_argv + 1) * (limits.max_string + 4) + 128

    def feed(self, data: bytes) -> None:
        if self.error is not None:
            return
        self.buf += data
        at = 0
        while len(self.buf) - at >= 4:
            (length,) = struct.unpack_from(">I", self.buf, at)
            if not 24 <= length <= self.max_record:
                self._fail(f"guest tracer record of {length} bytes (allowed 24..{self.max_record})")
                return
            if len(self.buf) - at - 4 < length:
                break
            body = bytes(self.buf[at + 4:at + 4 + length])
            at += 4 + length
            try:
                self._record(wire.Reader(body))
            except (ValueError, struct.error) as err:
                self._fail(f"malformed guest tracer record: {err}")
                return
        del self.buf[:at]

    def _fail(self, why: str) -> None:
        self.error = why
        self.buf.clear()

    def _record(self, r: wire.Reader) -> None:
        t, pid, kind = r.u64() / 1e9, r.u64(), r.u64()
        if self.root is None:
            self.root = self.trace.pid = pid
        if kind == TR_SYSCALL:
            nr, rax = r.u64(), r.u64()
            name = trace.RECORDED.get(nr)
            if name is None:
                raise ValueError(f"syscall {nr} is not one the tracer records")
            args = tuple(r.u64() for _ in range(6))
            path, path_cut = self._string(r)
            argc = r.u64()
            if argc > self.limits.max_argv:
                raise ValueError(f"{argc} argv entries, more than the {self.limits.max_argv} asked for")
            argv = [self._string(r, flag=False)[0] for _ in range(argc)]
            argv_cut = bool(r.u64())
            data = r.bytes()[:128]
            call = trace.RawCall(name, args, path, path_cut, argv, argv_cut, data)
            event = trace.call_event(call, self.limits)
            kind_name = event.pop("kind")
            self.recorder.record(t, pid, kind_name, **event, result=trace.syscall_result(rax))
        elif kind == TR_SIGNAL:
            self.recorder.record(t, pid, "signal", signal=trace.signal_name(r.u64()))
        elif kind == TR_FORK:
            how = trace.FORK_EVENTS.get(r.u64())   # the guest sends ptrace's event number
            if how is None:
                raise ValueError("unknown fork event")
            self.recorder.record(t, pid, "fork", how=how, child=r.u64())
        elif kind == TR_EXIT:
            root = pid == self.root
            self.recorder.exit(t, pid, r.u64() & 0xFFFF, root)
            if root:
                self.root_ended = True
                self.trace.duration_s = round(t, 6)
        elif kind == TR_ERROR:
            code = r.u64()
            self.error = f"guest tracer: {r.str()}: errno {code}"
        else:
            raise ValueError(f"record kind {kind}")

    def _string(self, r: wire.Reader, flag: bool = True) -> tuple[bytes, bool]:
        text = r.bytes()
        if len(text) > self.limits.max_string:
            raise ValueError(f"a string of {len(text)} bytes, more than the {self.limits.max_string} asked for")
        return text, bool(r.u64()) if flag else False

    def finish(self, timed_out: bool) -> dict:
        """The record (`trace.Trace.to_dict`), or {"error": ...} as the
        container's helper gives when the tracer failed before recording
        the command's end."""
        if self.error is not None and not self.root_ended:
            return {"error": self.error}
        if not self.root_ended:
            return {"error": "the guest tracer sent no end of the command (it died, or was stopped)"}
        self.trace.timed_out = timed_out
        return self.trace.to_dict()
