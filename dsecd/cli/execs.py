"""`dsec exec`, `trace`, `run` and `call`: a command line run in a sandbox,
its output streamed (or kept for --json), and its end as a shell's exit
status. With -t the command's pty is driven from our terminal: terminal.py."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import sys

from ..cliargs import EXIT_TIMEOUT, _interrupted
from ..client import Client
from ..clitext import create_args, env_vars
from ..clitext import kv as _kv
from ..clitext import print_json as _print_json
from ..errors import BadRequest, DsecError
from .common import CommandOutput, _stdin_as_it_comes
from .terminal import _ENDING_SIGNALS, _on_terminal, _window_size


def _read_code(path: str) -> str:
    """A --code-file's text, decoded as python3 decodes a script: by its
    coding declaration (PEP 263), else as UTF-8, whatever our locale."""
    import tokenize

    with open(path, "rb") as f:         # once, not tokenize.open's seek: a pipe or <(...) is read too
        raw = f.read()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (UnicodeDecodeError, SyntaxError) as err:
        # SyntaxError: its first two lines (where a declaration goes) did not decode, or name no codec
        why = (f"not UTF-8 text (byte {err.start}: {err.reason})" if isinstance(err, UnicodeDecodeError)
               else err.msg.replace(f" for {path!r}", ""))
        raise BadRequest(f"--code-file {path}: {why}; save it as UTF-8 or declare its encoding "
                         "(# -*- coding: NAME -*-)", {"code_file": path}) from None


async def cmd_call(c: Client, a) -> int:
    code = _read_code(a.code_file) if a.code_file else None
    stdin = None
    if a.stdin == "-":
        stdin = sys.stdin.buffer.read()
    elif a.stdin:
        with open(a.stdin, "rb") as f:
            stdin = f.read()
    r = await c.call(a.image, argv=None if code is not None else a.argv, code=code,
                     args=a.argv if code is not None else None, stdin=stdin, env=_kv(a.env, "--env"),
                     timeout=a.timeout)
    out = CommandOutput(a.json)
    out.write(1, r.stdout)
    out.write(2, r.stderr)
    if a.json:
        _print_json({"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                     "killed_by": r.killed_by, "destroyed_by": r.destroyed_by,
                     "truncated": r.truncated, "path": r.path, "run_ms": r.run_ms, "total_ms": r.total_ms,
                     **out.fields()})
    _say_truncated(r)
    return _exit_status(r, f"dsec: call timed out after {a.timeout}s; its process group was killed")


def _say_truncated(r) -> None:
    """A command's output past the daemon's cap is cut and its pipes closed
    (it then mostly dies of SIGPIPE): said, or the end looks like its own."""
    if r.truncated:
        print("dsec: output truncated at the daemon's limits.max_exec_output_bytes; "
              "the command's pipes were closed", file=sys.stderr)


def _say_lost(r) -> None:
    """Output a keyed exec taken up after a cut link (over ssh://) missed,
    the daemon no longer having it (ExecResult.lost_output): a gap in what
    was printed, said, or the output reads as whole."""
    if r.lost_output:
        print(f"dsec: {r.lost_output} bytes of the command's output were lost: the link to the daemon was "
              "cut and the daemon no longer had them (it keeps the last 4 MiB for the exec taken up again)",
              file=sys.stderr)


# Why the daemon says a command was SIGKILLed (ExecResult.killed_by).
KILLED_BY = {"oom": "the sandbox reached its memory limit (the kernel's OOM killer took it)",
             "destroy": "its sandbox was destroyed"}


# Why that destroy came (ExecResult.destroyed_by), as a later request on the
# sandbox says it (dsecd/engine/sandboxes.py DESTROYED_BECAUSE).
DESTROYED_BY = {"ttl": "its ttl ran out", "idle_ttl": "it was idle past its idle_ttl",
                "lease": "its lease was not renewed", "request": "by a destroy request", "job": "by a job rm",
                "all": "by a destroy of all sandboxes", "pool": "by its warm pool",
                "build": "by its image build, whose step it ran"}


def _exit_status(r, timeout_msg: str) -> int:
    """The shell's exit status for a command's result: 124 on timeout, 128+N
    if killed by signal N (and why, when the daemon knows)."""
    if r.timed_out:
        print(timeout_msg, file=sys.stderr)
        return EXIT_TIMEOUT
    if r.signal:
        if r.killed_by in KILLED_BY:
            why = f": {DESTROYED_BY[r.destroyed_by]}" if r.destroyed_by in DESTROYED_BY else ""
            print(f"dsec: killed: {KILLED_BY[r.killed_by]}{why}", file=sys.stderr)
        return 128 + r.signal
    return r.exit_code or 0


async def cmd_exec(c: Client, a) -> int:
    sb = await c.get(a.sandbox)
    if getattr(a, "detach", False):
        proc = await sb.spawn(a.argv, env=env_vars(a), cwd=a.cwd, user=a.user, policy=a.policy)
        _print_json({"pid": proc.pid, "sandbox": sb.id}) if a.json else print(proc.pid)
        return 0
    if getattr(a, "tty", False):
        return await _exec_on_terminal(sb, a)
    tracing = a.cmd == "trace"
    stream = sb.exec_stream(a.argv, timeout=a.timeout, env=env_vars(a), cwd=a.cwd, user=a.user,
                            stdin=_stdin_as_it_comes() if a.interactive else None, trace=tracing, policy=a.policy)
    out = a.kept_output = CommandOutput(a.json and not tracing)
    async for fd, data in stream:
        out.write(fd, data)
    r = stream.result
    if tracing:
        _print_trace(r.trace or {}, a.json, a.output)
    elif a.json:
        _print_json({"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                     "killed_by": r.killed_by, "destroyed_by": r.destroyed_by,
                     "truncated": r.truncated, "duration_ms": r.duration_ms, "policy": r.policy,
                     "denials": r.denials, "lost_output": r.lost_output, **out.fields()})
    _say_truncated(r)
    _say_lost(r)
    return _exit_status(r, f"dsec: timed out after {a.timeout}s; the command's process group was killed")


async def _exec_on_terminal(sb, a) -> int:
    """`dsec exec -t`: the command on a pty in the sandbox (_on_terminal)."""
    rows, cols = _window_size(sys.stdin.fileno())
    stream = sb.exec_stream(a.argv, timeout=a.timeout, env=env_vars(a), cwd=a.cwd, user=a.user,
                            pty=True, rows=rows, cols=cols)
    ended_by = await _on_terminal(stream, a)
    if ended_by is not None:              # the terminal is ours again: --json's error on it
        _interrupted(a, ended_by, f"{signal.Signals(ended_by).name}: the exec was cancelled")
        return 128 + ended_by
    return _terminal_status(stream.result, a)


def _terminal_status(r, a) -> int:
    if a.json:
        _print_json({"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                     "killed_by": r.killed_by, "destroyed_by": r.destroyed_by,
                     "duration_ms": r.duration_ms})
    return _exit_status(r, f"dsec: timed out after {a.timeout}s; the command's process group was killed")


async def _say_published(sb, a) -> None:
    """`dsec run --publish PORT`: where the host reaches each port (a host port
    the daemon picked), on stderr as the command starts: the user knows no
    id of the sandbox to ask `dsec port` with."""
    if not getattr(a, "publish", None):
        return
    for p in (await sb.net_show()).get("ports", []):
        name = p["port"] if p.get("protocol", "tcp") == "tcp" else f"{p['port']}/{p['protocol']}"
        print(f"dsec run: port {name} of sandbox {sb.id} is published on {p['host']}", file=sys.stderr,
              flush=True)


async def cmd_run(c: Client, a) -> int:
    """`dsec run IMAGE [ARG...]`, as `docker run --rm`: a sandbox of the
    image, its Entrypoint and Cmd (ARGs replace Cmd) run with the output
    streamed, and the sandbox removed however that ends: the command's end,
    an error, or signals. The first of SIGINT, SIGTERM, SIGHUP, SIGQUIT is
    forwarded to the command, as docker run's --sig-proxy does (^C reaches
    it as SIGINT, and its own handling decides the end); a second one kills
    it and ends the run, and more do not cut the removal short. A signal
    that comes before the command has started ends the run at once."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    signals: list[int] = []       # those that ended the run
    forwarded: list[asyncio.Task] = []

    def on_signal(signum: int) -> None:
        if not forwarded and not signals and run.stream is not None:
            forwarded.append(loop.create_task(_forward_signal(run.stream, signum)))
            return
        if not signals:
            main.cancel()
        signals.append(signum)

    if a.detach:
        return await _run_detached(c, a)
    a.rm = a.rm is not False              # --rm is the default without -d
    if a.tty:
        return await _run_on_terminal(c, a)
    stdin = _stdin_as_it_comes() if a.interactive else None
    out = a.kept_output = CommandOutput(a.json)
    run = c.run_stream(a.image, a.argv or None, a.entrypoint, a.timeout, stdin, a.rm, backend=a.backend,
                       **create_args(a))
    for signum in _ENDING_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        async with run:
            if not a.rm:
                print(f"dsec run: sandbox {run.sandbox.id} (kept: --no-rm)", file=sys.stderr, flush=True)
            await _say_published(run.sandbox, a)
            async for fd, data in run:
                # In a thread: a reader that stalls our stdout must not stall the
                # loop, which renews the sandbox's lease meanwhile.
                await loop.run_in_executor(None, out.write, fd, data)
    except asyncio.CancelledError:
        if not signals:
            raise
        message = (f"{signal.Signals(signals[0]).name}: the command was killed"
                   + (" and its sandbox removed" if a.rm else ""))
        _interrupted(a, signals[0], message, sandbox=run.sandbox.id if run.sandbox else None)
        print(f"dsec run: {message}", file=sys.stderr)
        return 128 + signals[0]
    except BadRequest as err:
        _cli_run_hint(err, a.image)
        raise
    finally:
        for signum in _ENDING_SIGNALS:
            loop.remove_signal_handler(signum)
        for task in forwarded:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    r = run.result
    if a.json:
        _print_json({"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                     "killed_by": r.killed_by, "destroyed_by": r.destroyed_by,
                     "truncated": r.truncated, "duration_ms": r.duration_ms, "sandbox": run.sandbox.id,
                     **_fleet_host(a, run.sandbox), "argv": run.argv, "lost_output": r.lost_output,
                     **out.fields()})
    _say_truncated(r)
    _say_lost(r)
    return _exit_status(r, f"dsec: timed out after {a.timeout}s; the command's process group was killed")


def _fleet_host(a, sb) -> dict:
    """{"host": where `sb` was placed} for `dsec fleet run --json` (a
    script needs it to reach the sandbox again); {} for a local run."""
    return {"host": sb.host} if getattr(a, "fleet", None) else {}


async def _run_detached(c: Client, a) -> int:
    """`dsec run -d`: the sandbox's id on stdout (as docker run -d prints the
    container's), where its command runs on stderr."""
    proc = await c.run_detached(a.image, a.argv or None, a.entrypoint, backend=a.backend, **create_args(a))
    sb = proc.sb.id
    if a.json:
        _print_json({"sandbox": sb, **_fleet_host(a, proc.sb), "pid": proc.pid})
    else:
        print(sb)
        # Over ssh (--host, a fleet's placement), a bare `dsec` would ask this machine's daemon.
        dsec = f"dsec --host {proc.sb.client.target}" if a.host or getattr(a, "fleet", None) else "dsec"
        print(f"dsec run: process {proc.pid} in {sb}: {dsec} logs {sb} {proc.pid}; {dsec} rm --force {sb} ends it",
              file=sys.stderr)
    return 0


async def _run_on_terminal(c: Client, a) -> int:
    """`dsec run -t`: the image's command on a pty of a sandbox of its own,
    driven from our terminal as `dsec exec -t` does (^C is a key, typed into
    it), the sandbox removed however it ends."""
    rows, cols = _window_size(sys.stdin.fileno())
    run = c.run_stream(a.image, a.argv or None, a.entrypoint, a.timeout, None, a.rm, pty=True, rows=rows,
                       cols=cols, backend=a.backend, **create_args(a))
    try:
        async with run:
            if not a.rm:
                print(f"dsec run: sandbox {run.sandbox.id} (kept: --no-rm)", file=sys.stderr, flush=True)
            await _say_published(run.sandbox, a)
            ended_by = await _on_terminal(run.stream, a)
    except BadRequest as err:
        _cli_run_hint(err, a.image)
        raise
    if ended_by is not None:
        message = f"{signal.Signals(ended_by).name}: the command was killed" + \
            (" and its sandbox removed" if a.rm else "")
        _interrupted(a, ended_by, message, sandbox=run.sandbox.id)
        print(f"dsec run: {message}", file=sys.stderr)
        return 128 + ended_by
    return _terminal_status(run.result, a)


async def _forward_signal(stream, signum: int) -> None:
    """`dsec run`'s signal to its command; one that ended meanwhile needs none."""
    with contextlib.suppress(DsecError, ConnectionError):
        await stream.signal(signum)


def _cli_run_hint(err: BadRequest, image: str) -> None:
    """`dsec run IMAGE` of an image without a command: say where the CLI
    takes it, in place of the SDK's `(args=)`."""
    if err.detail.get("needs") == "command" and err.message.endswith(" (args=)"):
        err.message = err.message[:-len(" (args=)")] + f" (after the image's name: dsec run {image} COMMAND [ARG...])"
        err.args = (err.message,)


def _print_trace(rec: dict, as_json: bool, path: str | None) -> None:
    """The record of `dsec trace`: to --output, else to stderr (stdout is the command's)."""
    if "error" in rec:
        print(f"dsec trace: {rec['error']}", file=sys.stderr)
        return
    if as_json:
        text = json.dumps(rec, sort_keys=True) + "\n"
    else:
        from ..trace import Trace

        text = Trace(**rec).to_text()
    if path:
        with open(path, "w") as f:
            f.write(text)
    else:
        sys.stderr.write(text)
