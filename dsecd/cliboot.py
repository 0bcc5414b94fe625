"""The `dsec` command's entry point (pyproject.toml, [project.scripts]).

It holds SIGINT before anything else (sigint.py): most of dsec's start is
imports, and a ^C in them is said as `dsec CMD: interrupted (SIGINT)`,
exit 130, not as a traceback. That is why this module imports nothing but
sigint until main runs, and why the package's __init__ imports nothing
either. main then reads the command line with cliargs, which needs neither
the client nor asyncio (`dsec --help` and a usage error pay for neither),
and imports the CLI only to run the command (`dsec rpc`, a relay of
bytes, needs none of it: rpcrelay.py).
"""

import sys

from . import sigint

sigint.hold()


def main() -> None:
    # Imported here, not above: these imports are the part of the start a ^C must not break.
    from .cliargs import parsed

    a = parsed(sys.argv[1:])
    if a.cmd == "rpc":          # a relay, run per ssh:// connection: none of the CLI's imports
        from .rpcrelay import run

        run(a)
    from .cli import run_command

    run_command(a)
