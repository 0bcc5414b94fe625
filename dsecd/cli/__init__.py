"""`dsec`: the command-line client, a thin shell over the SDK.

It talks to the local daemon socket, so `ssh host dsec ps` works on any host;
`dsec --host ssh://host ps` (or DSEC_HOST) runs a command through the SDK's
ssh:// transport, `dsec fleet --hosts h1,h2 ps` through dsecd.Fleet
(dsecd/fleet_cli.py), and `dsec rpc --stdio` bridges the raw protocol over
stdin/stdout for both and for fleet tools. Every command takes --json,
before or after its name. Options of
`exec`, `trace` and `call` go before or after the sandbox id; the command to
run follows `--` (or starts at the first word that is not an option).

Exit status: the command's own for `exec`, `trace`, `call` and `run` (and for
`wait` and `attach`, the background process's); 124 when it timed out;
128+N when it died of signal N; 127 when the program to run was not found,
126 when it could not be executed; 125 when dsec itself failed for them
(daemon error, bad input, usage). Other commands: 1 when the daemon
refused or failed, 2 on a usage error. A closed stdout (`dsec ps | head -1`)
ends dsec quietly with 141, as SIGPIPE would.

With --json, a failure prints `{"error": {"code", "message", "detail"}}` on
stdout (the stderr line as without it), with the same exit status: the
daemon's error, or dsec's own coded as the protocol's (bad_request for a
usage error, io or the errno's code for a local file), `unreachable` for no
connection to the daemon and `interrupted` for a signal (detail: signal, and
the output an exec or run had kept). `rm` prints each sandbox's or path's
result or error, `cat` a line per file, its content or its error (and goes
on to the next, as cat(1)); the streams (events, watch, logs, attach) end
with the error as one more line.

The package, one module per concern; the command modules share what
common.py holds, and none imports this file:

dispatch.py   COMMANDS: each command's name -> its handler; the usage checks
              argparse cannot make; run_command and main: the command run, and
              how it ended as an exit status and --json's error
common.py     what the commands share: the progress line, output kept for
              --json, one item's error, stdin as it comes, `SB:/path` split,
              SIGTERM and SIGHUP ending a command as ^C does
host.py       info, top, policy, events, drain, undrain: the host and its daemon
sandboxes.py  create, ps, inspect, rm: sandboxes made, listed and removed
jobs.py       pause, resume, renew, job, pool: memory, leases, jobs, warm pools
execs.py      exec, trace, run, call: a command line in a sandbox, its exit status
terminal.py   exec -t, run -t: a pty exec driven from our terminal
procs.py      proc, logs, wait, kill, attach: background processes
files.py      ls, cat, watch, rm SANDBOX:/path: a sandbox's files
copies.py     cp: files and directories into and out of a sandbox
images.py     image (build, import, pull, ls, inspect, tag, flatten, rm, gc,
              du) and snapshot
network.py    net, port: a sandbox's network rules and published ports
__main__.py   `python -m dsecd.cli ARGV`: dsec, as the `dsec` script runs it

The `dsec` script (dsecd/cliboot.py) parses the command line with
dsecd/cliargs.py before it imports this package; what these modules and
`dsec fleet` (dsecd/fleet_cli.py) both print is dsecd/clitext.py. A new
command: its parser in cliargs.py, its handler in the module of its group,
its name in dispatch.COMMANDS.
"""

# What code outside the package reaches as dsecd.cli.NAME (cliboot.py's
# run_command, the functions the unit tests call) and every command's
# handler, each from the module that holds it.
from ..cliargs import (  # noqa: F401 (parse_args and the parser's names, as dsecd.cli.NAME)
    EXIT_BROKEN_PIPE,
    EXIT_DSEC_ERROR,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    FLEET_CONNECT_TIMEOUT_S,
    GIVES_A_STATUS,
    RUNS_A_COMMAND,
    VALUED_OPTIONS,
    _port_to_publish,
    _sandbox_port,
    build_parser,
    find_verb,
    join_signed_values,
    parse_args,
    parsed,
    split_command,
)
from ..clitext import UsageError, env_vars  # noqa: F401
from .common import CommandOutput  # noqa: F401
from .copies import _copy_out, _cp_merged, cmd_cp  # noqa: F401
from .dispatch import (  # noqa: F401
    COMMANDS,
    _failed_status,
    check_usage,
    main,
    make_client,
    named_sandboxes,
    run_command,
    ssh_options,
)
from .execs import DESTROYED_BY, KILLED_BY, _run_detached, cmd_call, cmd_exec, cmd_run  # noqa: F401
from .files import cmd_cat, cmd_ls, cmd_watch  # noqa: F401
from .host import (  # noqa: F401
    _reload_text,
    cmd_drain,
    cmd_events,
    cmd_info,
    cmd_policy,
    cmd_top,
    net_info_lines,
)
from .images import _print_image_details, cmd_image, cmd_image_dockerfile, cmd_snapshot  # noqa: F401
from .jobs import _pause_summary, cmd_job, cmd_pause_resume, cmd_pool, cmd_renew  # noqa: F401
from .network import cmd_net, cmd_port, net_set_summary  # noqa: F401
from .procs import (  # noqa: F401
    _exit_of,
    cmd_attach,
    cmd_kill,
    cmd_logs,
    cmd_proc,
    cmd_wait,
    output_chunk_json,
    parse_since,
)
from .sandboxes import cmd_create, cmd_inspect, cmd_ps, cmd_rm  # noqa: F401
