"""`dsec proc`, `logs`, `wait`, `kill` and `attach`: a sandbox's background
processes (those `exec -d` and `run -d` start)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time

from ..cliargs import EXIT_DSEC_ERROR
from ..client import Client
from ..clitext import UsageError
from ..clitext import human_bytes as _human_bytes
from ..clitext import print_json as _print_json
from ..clitext import table as _table
from ..errors import ConnectionLost, DsecError
from .common import _names_as_bytes, _stdin_as_it_comes, _when, _write_flush


def parse_since(text: str, now: float | None = None) -> float:
    """--since: a duration back from now ("90s", "5m", "2h", "1d", or seconds
    below 10^9), a Unix timestamp, or an ISO 8601 time; seconds since the epoch."""
    from datetime import datetime

    from ..config import parse_duration

    now = time.time() if now is None else now
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        return value if value >= 1e9 else now - value
    try:
        return now - parse_duration(text, "--since")
    except DsecError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise UsageError(f"dsec logs: --since takes a duration (90s, 5m, 2h), a Unix timestamp or an "
                         f"ISO 8601 time (2024-05-01T12:00:00), got {text!r}") from None


def _proc_state(p) -> str:
    if p.state == "running":
        return "running"
    if not p.signal:
        return "exited"
    try:
        return f"killed ({signal.Signals(p.signal).name})"
    except ValueError:
        return f"killed (signal {p.signal})"


async def cmd_proc(c: Client, a) -> int:
    sb = await c.get(a.sandbox)
    procs = await sb.processes()
    if a.json:
        _print_json([vars(p) for p in procs])
        return 0
    _names_as_bytes()           # an argument that is not UTF-8, as ps(1) prints it
    _table([[str(p.pid), _proc_state(p), "-" if p.exit_code is None else str(p.exit_code), _when(p.started),
             _human_bytes(p.output_bytes), _human_bytes(p.dropped), " ".join(p.argv)] for p in procs],
           ["PID", "STATE", "EXIT", "STARTED", "KEPT", "DROPPED", "COMMAND"])
    return 0


def _write_output(chunk, pid: int) -> None:
    """A chunk of a process's output to our stdout or stderr, or the notice of what fell out."""
    if chunk.lost_before is not None:
        print(f"dsec: output process {pid} wrote before {_when(chunk.lost_before)}, if any, is lost: the "
              "daemon restarted then, and the one before did not say how much it had read (it died, or is "
              "older than that count)", file=sys.stderr, flush=True)
    if chunk.dropped:
        print(f"dsec: {chunk.dropped} bytes of the output of process {pid} fell out of the daemon's buffer "
              "(limits.proc_output_bytes, or a daemon restart) or of dsec's, which it was writing out slower "
              "than the process wrote them, before this", file=sys.stderr, flush=True)
    if chunk.fd == 0:
        return
    _write_flush(chunk.fd, chunk.data)


def output_chunk_json(chunk) -> str:
    """`dsec logs --json`: one line per chunk, as `watch --json` and `events
    --json` print theirs (the data as text; bytes that are not UTF-8 become U+FFFD)."""
    return json.dumps({"fd": chunk.fd, "data": chunk.data.decode("utf-8", "replace"), "time": chunk.time,
                       "dropped": chunk.dropped, "lost_before": chunk.lost_before}, sort_keys=True)


async def cmd_logs(c: Client, a) -> int:
    proc = (await c.get(a.sandbox)).process(a.pid)
    async for chunk in proc.output(follow=a.follow, since=a.since_ts):
        if a.json:
            print(output_chunk_json(chunk), flush=True)
        else:
            _write_output(chunk, a.pid)
    return 0


def _exit_of(st) -> int:
    """A background process's status as a shell's: its exit code, 128+N if
    signal N killed it; 125 when its end is not known (a daemon recorded it
    as exited without seeing its status: never a success)."""
    if st.signal:
        return 128 + st.signal
    if st.exit_code is None:
        print(f"dsec: process {st.pid} ended with a status the daemon does not know (it lost track of the "
              "process across a restart: see its log)", file=sys.stderr)
        return EXIT_DSEC_ERROR
    return st.exit_code


async def cmd_wait(c: Client, a) -> int:
    st = await (await c.get(a.sandbox)).process(a.pid).wait()
    if a.json:
        _print_json(vars(st))
    return _exit_of(st)


async def cmd_kill(c: Client, a) -> int:
    r = await (await c.get(a.sandbox)).process(a.pid).kill(a.signal)
    if a.json:
        _print_json(r)
    return 0


async def cmd_attach(c: Client, a) -> int:
    """Our stdin to the process's (our end of input closes its stdin), its
    output to ours as `logs -f`; Ctrl-C detaches and leaves it running."""
    proc = (await c.get(a.sandbox)).process(a.pid)
    cut: list[ConnectionError] = []
    following = [asyncio.current_task()]      # emptied once the output has ended
    feeder = asyncio.get_running_loop().create_task(_feed_stdin(proc, cut, following))
    try:
        async for chunk in proc.output(follow=True):
            if a.json:
                print(output_chunk_json(chunk), flush=True)
            else:
                _write_output(chunk, a.pid)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if cut and task is not None and task.cancelling() == 1:
            # Cancelled by the feeder alone: the input is what ended.
            task.uncancel()
            raise ConnectionLost(
                f"input to process {a.pid} in sandbox {a.sandbox} was cut by a lost connection ({cut[0]}): "
                "what was being written may not all have reached it. It runs on, its stdin open: "
                f"`dsec attach {a.sandbox} {a.pid}` to go on", target=c.target, op="proc_input",
                sent=True) from None
        print(f"dsec: detached from process {a.pid}; it keeps running", file=sys.stderr)
        a.said_how_it_ended = True
        raise
    finally:
        following.clear()
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
            await feeder
    st = await proc.wait()
    if a.json:                                 # the last line: its end, the fields of `wait --json`
        print(json.dumps(vars(st), sort_keys=True), flush=True)
    return _exit_of(st)


async def _feed_stdin(proc, cut: list[ConnectionError], following: list[asyncio.Task | None]) -> None:
    """Our stdin, as it comes, to the process; at its end the process's stdin
    is closed. Stops quietly where the process takes no more input. A chunk
    lost with the connection (a daemon restart) may have reached it in
    part, and nothing after it may go as if it had: its error goes in `cut`
    and the task in `following` (following the output, while it does) is
    cancelled."""
    try:
        async for data in _stdin_as_it_comes():
            await proc.write(data)
        await proc.close_stdin()
    except DsecError:
        pass          # exited, stdin closed or never open: the output still shows
    except ConnectionError as err:
        cut.append(err)
        for task in following:
            if task is not None:
                task.cancel()
