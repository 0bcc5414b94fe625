"""How `dsec` runs a command: COMMANDS maps each command's name to its
handler, a coroutine `handler(client, args)` that returns the exit status.
run_command checks what argparse cannot (check_usage), runs the handler
against the daemon's Client (`dsec fleet`: through fleet_cli.py, which
takes COMMANDS), and turns how it ended, a status, an error or a signal,
into dsec's exit status and, with --json, the error object."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from .. import fleet_cli, rpcrelay, sigint
from ..cliargs import (
    EXIT_BROKEN_PIPE,
    EXIT_DSEC_ERROR,
    EXIT_USAGE,
    GIVES_A_STATUS,
    RUNS_A_COMMAND,
    _closed_outputs,
    _interrupted,
    _local_error,
    _print_error,
    _silence_stdout,
    parsed,
)
from ..client import Client, default_socket
from ..clitext import UsageError, env_vars
from ..clitext import kv as _kv
from ..errors import ConnectionLost, DsecError, HostsDown, io_error
from ..fleet import fleet_target
from ..localcopy import LocalCopyError
from ..remote import SshOptions
from ..tarsafe import Refused, TooLarge
from .common import _cancelled_by_ending_signals, _split_remote
from .copies import _cp_sides, cmd_cp
from .execs import cmd_call, cmd_exec, cmd_run
from .files import cmd_cat, cmd_ls, cmd_watch
from .host import cmd_drain, cmd_events, cmd_info, cmd_policy, cmd_top
from .images import _absolute_excludes, _check_image_build, cmd_image, cmd_snapshot
from .jobs import cmd_job, cmd_pause_resume, cmd_pool, cmd_renew
from .network import cmd_net, cmd_port
from .procs import cmd_attach, cmd_kill, cmd_logs, cmd_proc, cmd_wait, parse_since
from .sandboxes import cmd_create, cmd_inspect, cmd_ps, cmd_rm

# Each command (its name as cliargs parses it) -> its handler: a coroutine
# taking the client and the parsed arguments, returning the exit status.
# `dsec fleet` runs the same handlers (fleet_cli.run is given this table).
COMMANDS = {"policy": cmd_policy, "info": cmd_info, "image": cmd_image, "snapshot": cmd_snapshot,
            "pause": cmd_pause_resume, "resume": cmd_pause_resume, "renew": cmd_renew, "job": cmd_job,
            "events": cmd_events,
            "net": cmd_net, "port": cmd_port, "trace": cmd_exec, "create": cmd_create, "run": cmd_run,
            "exec": cmd_exec, "call": cmd_call, "pool": cmd_pool, "drain": cmd_drain, "undrain": cmd_drain,
            "cp": cmd_cp,
            "ps": cmd_ps, "inspect": cmd_inspect, "rm": cmd_rm, "top": cmd_top, "ls": cmd_ls, "cat": cmd_cat,
            "watch": cmd_watch, "proc": cmd_proc, "logs": cmd_logs, "attach": cmd_attach, "kill": cmd_kill,
            "wait": cmd_wait}


def named_sandboxes(a) -> list[str]:
    """The sandbox ids a command names: `dsec fleet` sends it to their host."""
    if a.cmd == "cp":
        src_sb, _, dst_sb, _ = _cp_sides(a)
        return [sb for sb in (src_sb, dst_sb) if sb]
    if a.cmd in ("ls", "watch"):
        return [_split_remote(a.target)[0] or a.target]
    if a.cmd == "cat":
        return [_split_remote(t)[0] or t for t in a.targets]
    if a.cmd in ("rm", "pause", "resume", "renew"):
        return [_split_remote(s)[0] or s for s in a.sandboxes]
    sb = getattr(a, "sandbox", None)
    return [sb] if sb else []


def ssh_options(a) -> SshOptions:
    """How --host and fleet reach hosts: the environment, then the options."""
    return SshOptions.from_env(config=a.ssh_config, remote_dsec=a.remote_dsec,
                               remote_socket=a.socket if (a.host or a.fleet) else None)


def make_client(a) -> Client:
    if a.host:
        c = Client(fleet_target(a.host), name=f"dsec {a.cmd}", ssh=ssh_options(a))
    else:
        c = Client(a.socket or default_socket(), name=f"dsec {a.cmd}",
                   silence_timeout=getattr(a, "silence_timeout", None))
    c.lost_advice = "run the command again once the daemon answers"
    return c


async def _run(a) -> int:
    """The command, ended by SIGTERM or SIGHUP (a `timeout`, a closed
    terminal) as ^C ends it: the command is cancelled (its requests with
    it) and _EndedBySignal raised, unless the command handles these
    signals itself (cp, run, exec -t replace this handler while they run)."""
    ended: list[int] = []
    try:
        with _cancelled_by_ending_signals(ended):
            if a.fleet:
                return await fleet_cli.run(a, COMMANDS, named_sandboxes, ssh_options(a))
            async with make_client(a) as c:
                return await COMMANDS[a.cmd](c, a)
    except asyncio.CancelledError:
        if not ended:
            raise
        raise _EndedBySignal(ended[0]) from None


def check_usage(a: argparse.Namespace) -> None:
    """What argparse cannot say, checked before the daemon is asked anything."""
    if a.cmd in ("exec", "trace") and not a.argv:
        raise UsageError(f"dsec {a.cmd}: give a command after the sandbox id, e.g. dsec {a.cmd} SB -- ls /")
    if getattr(a, "detach", False) and (a.tty or a.interactive or a.timeout is not None):
        raise UsageError(f"dsec {a.cmd}: -d runs the command in the background: drop -t, -i and --timeout "
                         "(send input with dsec attach, end it with dsec kill)")
    if a.cmd == "run" and a.detach and a.rm:
        raise UsageError("dsec run: -d leaves the command running in a sandbox that stays until dsec rm: "
                         "drop --rm (--ttl or --idle-ttl bound its life)")
    if a.cmd == "logs":
        a.since_ts = None if a.since is None else parse_since(a.since)
    if (a.cmd == "events" and a.sandbox and a.sandbox_id        # an id and a prefix of it name one sandbox
            and not (a.sandbox.startswith(a.sandbox_id) or a.sandbox_id.startswith(a.sandbox))):
        raise UsageError(f"dsec events: two sandboxes, {a.sandbox_id} and --sandbox {a.sandbox}: "
                         "give one (events of every sandbox: give neither)")
    if getattr(a, "tty", False) and not (sys.stdin is not None and os.isatty(0)):
        raise UsageError(f"dsec {a.cmd}: -t needs a terminal, but the input device is not a TTY; "
                         "drop -t (with -i alone the command reads piped input)")
    if a.cmd == "call" and not a.argv and not a.code_file:
        raise UsageError("dsec call: give a command after --, or --code-file FILE")
    if hasattr(a, "env_file"):          # docker's forms: K=V, K alone, files
        env_vars(a)
    else:
        _kv(getattr(a, "env", None), "--env")
    _kv(getattr(a, "label", None), "--label")
    if a.cmd == "snapshot":
        _absolute_excludes(a.exclude or [])
    if a.cmd == "cp":
        _cp_sides(a)
    if a.cmd == "rm":
        # No sandbox id has a colon: SB:path with a relative path is a path
        # given wrongly, not an id to look for.
        for spec in a.sandboxes:
            if ":" in spec and _split_remote(spec)[0] is None:
                raise UsageError(f"dsec rm: a sandbox's path must be absolute: give SANDBOX:/path, got {spec!r}")
    if a.cmd == "image" and a.image_cmd == "build":
        _check_image_build(a)


def _oserror_text(err: OSError) -> str:
    where = f": {err.filename}" if err.filename else ""
    return f"{err.strerror or err}{where}"


def _connection_error(err: ConnectionError) -> dict:
    detail = {}
    if isinstance(err, ConnectionLost):
        detail = {"target": err.target, "op": err.op, "sent": err.sent}
    elif isinstance(err, HostsDown):
        detail = err.detail
    return _local_error("unreachable", str(err), detail)


def _oserror_wire(a, err: OSError) -> dict:
    """A local OSError (a file of dsec's side) as the daemon codes one: the
    errno's closest code, the errno's name in detail."""
    if err.errno is None:
        return _local_error("io", _oserror_text(err))
    wire = io_error(a.cmd, str(err.filename or ""), err).to_wire()
    detail = {"errno": wire["detail"]["errno"], "path": err.filename}
    return _local_error(wire["code"], _oserror_text(err), {k: v for k, v in detail.items() if v})


def _failed_status(a, err: DsecError) -> int:
    """The exit status of a command dsec failed: for one that runs a command
    line, 127 when its program was not found and 126 when it could not be
    executed (the errors name it: detail argv0), as a shell and docker give
    them; else 125 (RUNS_A_COMMAND, GIVES_A_STATUS) or 1."""
    if a.cmd in RUNS_A_COMMAND and "argv0" in err.detail:
        if err.code == "not_found":
            return 127
        if err.code == "permission":
            return 126
    return EXIT_DSEC_ERROR if a.cmd in GIVES_A_STATUS else 1


class _EndedBySignal(BaseException):
    """SIGTERM or SIGHUP ended a command (_run): main prints the
    `interrupted` error --json promises and exits 128+signal, where the
    signal's default would have killed dsec where it stood."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: list[str] | None = None) -> None:
    """`dsec ARGV`: exits with the command's status. A ^C is said and exits
    130 whenever it comes: held (sigint.py) until the command starts, a
    KeyboardInterrupt while it runs, held again while dsec says how it
    ended."""
    found = signal.getsignal(signal.SIGINT)
    sigint.hold()          # already, if started by the console script (cliboot)
    try:
        run_command(parsed(sys.argv[1:] if argv is None else list(argv)))
    finally:
        sigint.restore(found)


def run_command(a: argparse.Namespace) -> None:
    """The command `a` (cliargs.parsed), and how it ended: exits with its status."""
    if a.cmd == "rpc":
        rpcrelay.run(a)
    fail = EXIT_DSEC_ERROR if a.cmd in GIVES_A_STATUS else 1
    try:
        with sigint.raised():    # a ^C held since the start raises here: the command does not start
            check_usage(a)
            status = asyncio.run(_run(a))
            sys.stdout.flush()   # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError as err:
        closed = _closed_outputs()
        if not closed:                   # the daemon's socket broke, not our reader
            _print_error(a, _local_error("unreachable", f"connection to dsecd lost: {err.strerror}"))
            print(f"dsec: connection to dsecd lost: {err.strerror}", file=sys.stderr)
            sys.exit(fail)
        _silence_stdout(tuple(closed))   # stdout or stderr: as a shell's command, quietly 141
        status = EXIT_BROKEN_PIPE
    except UsageError as err:
        _print_error(a, _local_error("bad_request", str(err)))
        print(err, file=sys.stderr)
        status = EXIT_DSEC_ERROR if a.cmd in GIVES_A_STATUS else EXIT_USAGE
    except DsecError as err:
        _print_error(a, err.to_wire())
        print(f"dsec {a.cmd}: {err.code}: {err.message}", file=sys.stderr)
        status = _failed_status(a, err)
    except ConnectionError as err:
        _print_error(a, _connection_error(err))
        print(f"dsec: {err}", file=sys.stderr)
        status = fail
    except (LocalCopyError, Refused, TooLarge) as err:      # a directory copy's local side
        _print_error(a, _local_error("limit" if isinstance(err, TooLarge) else "bad_request", str(err)))
        print(f"dsec {a.cmd}: {err}", file=sys.stderr)
        status = fail
    except OSError as err:
        _print_error(a, _oserror_wire(a, err))
        print(f"dsec {a.cmd}: {_oserror_text(err)}", file=sys.stderr)
        status = fail
    except ValueError as err:           # a value only the SDK could check (an ssh:// address, a path)
        _print_error(a, _local_error("bad_request", str(err)))
        print(f"dsec {a.cmd}: {err}", file=sys.stderr)
        status = fail
    except KeyboardInterrupt:
        # ^C: the command was cancelled (a copy's with its temporary file);
        # said as the other ending signals are, not left for a failure.
        _interrupted(a, signal.SIGINT, "interrupted (SIGINT)")
        if not getattr(a, "said_how_it_ended", False):     # attach: that it detached
            print(f"dsec {a.cmd}: interrupted (SIGINT)", file=sys.stderr)
        status = 130
    except _EndedBySignal as ended:
        name = signal.Signals(ended.signum).name
        _interrupted(a, ended.signum, f"interrupted ({name})")
        if not getattr(a, "said_how_it_ended", False):
            print(f"dsec {a.cmd}: interrupted ({name})", file=sys.stderr)
        status = 128 + ended.signum
    except Exception as err:            # a bug: its traceback as without --json, after the error object
        _print_error(a, _local_error("internal", f"{type(err).__name__}: {err}"))
        raise
    sys.exit(status)
