"""`dsec`'s command line: its parsers, where its words go, and what a
usage error, --help, or a ^C before the command prints.

Everything `dsec --help` or a usage error needs, and no more: this module
imports neither the client nor asyncio, so those answer without paying for
them (dsecd/cliboot.py parses with it before importing the package dsecd/cli/,
which runs the command). `dsec fleet`'s parse imports what checks its hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import shlex
import signal
import sys

from . import __version__, sigint
from .clitext import print_json as _print_json

EXIT_DSEC_ERROR = 125
EXIT_TIMEOUT = 124
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 128 + 13      # what a shell reports for a process SIGPIPE killed

# Commands that run a command line: their failures and usage errors exit 125,
# so a caller can tell dsec's own failure from the command's status.
RUNS_A_COMMAND = ("exec", "trace", "call", "run")
# Commands whose exit status is a background process's: their own failures exit 125 too.
GIVES_A_STATUS = (*RUNS_A_COMMAND, "wait", "attach")


def _policy_arg(text: str) -> str | dict:
    """--policy NAME, or an inline policy as a JSON object."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not a policy name nor a JSON object: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("an inline policy is a JSON object")
    return value



class _Parser(argparse.ArgumentParser):
    """dsec's parsers: every command and subcommand takes --json, so it may
    stand before or after the command's name."""

    def __init__(self, *args, **kwargs):
        # No abbreviated options: split_command must know every option by its full name.
        super().__init__(*args, allow_abbrev=False, **kwargs)
        # SUPPRESS: a subcommand's parser leaves a --json given before it alone.
        self.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                          help="machine-readable output")

    def error(self, message: str):
        # A missing subcommand is said by its choices, not by the name the
        # parser stores it under ("required: image_cmd").
        for action in self._actions:
            if (isinstance(action, argparse._SubParsersAction)
                    and message == f"the following arguments are required: {action.dest}"):
                message = f"give a command: {', '.join(action.choices)} (--help says what each does)"
        _usage_error.append(f"{self.prog}: {message}")      # for --json (main)
        super().error(message)

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", _SubParser)
        return super().add_subparsers(**kwargs)


class _Version(argparse.Action):
    """--version: `dsec VERSION`, or with --json (before or after it, as any
    command takes it) `{"version": VERSION}`, the key `dsec info --json`
    gives the daemon's under."""

    def __call__(self, parser, namespace, values, option_string=None):
        if "--json" in _dsec_words(_parsing):
            _print_json({"version": __version__})
        else:
            print(f"dsec {__version__}")
        parser.exit()


# The words parse_args is parsing (for _Version, which argparse hands none of them).
_parsing: list[str] = []


class _SubParser(_Parser):
    """A command's parser: words it does not know are its usage error, said
    with its own usage (`dsec ps nosuch`), not passed up to the top-level
    parser, which would print dsec's usage instead."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


# The options of the commands in RUNS_A_COMMAND that take a value. Splitting
# `dsec exec SB --timeout 2 sleep 10` into dsec's words and the command must
# know that "2" belongs to --timeout (tests/unit/test_cli_args.py checks this
# list against the parser).
VALUED_OPTIONS = frozenset({"--timeout", "--env", "-e", "--env-file", "--cwd", "-w", "--workdir", "--user", "-u",
                            "--output", "-o",
                            "--image", "--code-file", "--stdin", "--policy",
                            # dsec run's: create's and its own
                            "--cpu", "--memory", "--pids", "--disk", "--label", "--hostname", "--net", "--allow",
                            "--publish", "--ttl", "--idle-ttl", "--qos", "--entrypoint", "--backend"})


# Options whose value is a number or a size: a negative one ("--memory -5M")
# is their value, not an unknown option, so the daemon's check can say what
# is wrong with it (join_signed_values).
SIGNED_VALUE_OPTIONS = frozenset({"--cpu", "--memory", "--pids", "--disk", "--ttl", "--idle-ttl", "--lease",
                                  "--timeout", "--min", "--max", "--depth", "--host-port", "--interval"})


def join_signed_values(words: list[str]) -> list[str]:
    """`--memory -5M` as `--memory=-5M` (argparse takes a word starting with
    '-' for an option of its own, unless it is a plain negative number), for
    the options of SIGNED_VALUE_OPTIONS; nothing after `--` is touched."""
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return [*out, *words[i:]]
        value = words[i + 1] if i + 1 < len(words) else ""
        if word in SIGNED_VALUE_OPTIONS and len(value) > 1 and value[0] == "-" and value[1] in "0123456789.":
            out.append(f"{word}={value}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def split_command(words: list[str], positionals: int,
                  known: frozenset[str] | None = None) -> tuple[list[str], list[str]]:
    """(dsec's words, the command) of a RUNS_A_COMMAND command's arguments.
    The command follows `--`, or else starts at the first word past
    `positionals` positional words (the sandbox id, the image) that is
    neither an option nor an option's value; options may come before and
    after the sandbox id. With `known` (the verb's option strings), a word
    past the positionals that looks like an option dsec does not have, with
    no `--` after it, starts the command, as with docker run: `dsec run
    --entrypoint sh IMG -c 'echo hi'`, `dsec run IMG --version` (to the
    image's entrypoint)."""
    seen = i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return words[:i], words[i + 1:]
        if word.startswith("-") and word != "-":
            if known is not None and seen == positionals and not _is_option(word, known) \
                    and "--" not in words[i:]:
                return words[:i], words[i:]
            i += 2 if word in VALUED_OPTIONS else 1      # "--timeout=2" is one word
            continue
        if seen == positionals:
            return words[:i], words[i:]
        seen += 1
        i += 1
    return words, []


def _is_option(word: str, known: frozenset[str]) -> bool:
    """Whether `word` is one of `known` options: as it is, as --name=value, as
    short flags run together (-it), or as a short option with its value
    attached (-eK=V)."""
    if word.startswith("--"):
        return word.split("=", 1)[0] in known
    if word in known:
        return True
    return word[:2] in known and (word[:2] in VALUED_OPTIONS or all(f"-{ch}" in known for ch in word[1:]))


def verb_options(parser: argparse.ArgumentParser, verb: str) -> frozenset[str]:
    """The option strings of `dsec VERB` (its subparser's, -h included)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and verb in action.choices:
            return frozenset(s for a in action.choices[verb]._actions for s in a.option_strings)
    return frozenset()


# dsec's global options that take a value, and `dsec fleet`'s.
GLOBAL_VALUED = frozenset({"--socket", "--host", "--ssh-config", "--remote-dsec", "--silence-timeout"})
FLEET_VALUED = frozenset({"--hosts", "--connect-timeout"})


def find_verb(argv: list[str], valued: frozenset[str] = GLOBAL_VALUED) -> int | None:
    """Where the command's name stands in dsec's argv, past the global options."""
    i = 0
    while i < len(argv):
        if argv[i] in valued:
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            return i
    return None


def _exec_options(ex: argparse.ArgumentParser, verb: str) -> None:
    ex.add_argument("-i", "--interactive", action="store_true", help="pass stdin to the command")
    if verb == "exec":
        ex.add_argument("-t", "--tty", action="store_true",
                        help="run the command on a terminal (with -i: ours, in raw mode, is its keyboard)")
        ex.add_argument("-d", "--detach", action="store_true",
                        help="run it in the background and print its pid (see dsec proc, logs, attach, kill, wait)")
    ex.add_argument("--timeout", type=_timeout_arg, help="seconds or a duration (5m); the process group is killed after it")
    ex.add_argument("-e", "--env", action="append", metavar="K=V",
                    help="an environment variable, over the sandbox's; K alone: ours (repeatable)")
    ex.add_argument("--env-file", action="append", metavar="FILE",
                    help="KEY=VALUE lines, as docker reads them; --env goes over them (repeatable)")
    ex.add_argument("-w", "--cwd", "--workdir", dest="cwd", metavar="DIR",
                    help="working directory, an absolute path (default: the sandbox's)")
    ex.add_argument("-u", "--user", metavar="USER",
                    help="NAME, UID, NAME:GROUP or UID:GID, as docker exec --user: a UID's gid and home come "
                         "from its line in the sandbox's /etc/passwd if it has one, and without a GROUP the "
                         "groups /etc/group lists it in (default: the sandbox's user)")
    ex.add_argument("--policy", type=_policy_arg, metavar="NAME|JSON",
                    help="the task policy it runs under: a name (dsec policy ls) or an inline JSON "
                         "object (default: the sandbox's)")
    if verb == "trace":
        ex.add_argument("--output", "-o", metavar="FILE", help="write the record here (default: stderr)")
    ex.add_argument("sandbox")


def _timeout_arg(text: str) -> float:
    """A command's --timeout: seconds or a duration (90, 1.5, 90s, 5m,
    1h30m), as --ttl takes them; the daemon checks its range (a negative
    one too)."""
    from .config import duration_seconds

    try:
        return duration_seconds(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be seconds or a duration like 90s, 5m, 1h30m; "
                                         f"got {text!r}") from None


def _positive_seconds(text: str) -> float:
    """An interval of dsec's own (top, fleet's connect timeout): seconds or
    a duration (2, 0.5, 2s, 1m), from 0.1 s to an hour."""
    from .config import duration_seconds

    try:
        value = duration_seconds(text)
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be seconds or a duration (2, 2s, 1m) between 0.1 and 3600 s, "
                                         f"got {text!r}")
    return value


def _silence_arg(text: str) -> float:
    """--silence-timeout: 0 or off (no watch), else as _positive_seconds."""
    return 0.0 if text in ("0", "off") else _positive_seconds(text)


def _port_and_protocol(text: str) -> tuple[int, str]:
    """PORT, PORT/tcp or PORT/udp (docker's forms) -> (port, protocol); spaces
    around it are dropped, as the daemon drops them."""
    number, sep, proto = text.strip().partition("/")
    if not number.isdigit() or not 1 <= int(number) <= 65535:
        raise argparse.ArgumentTypeError(f"takes a port of the sandbox (1-65535), as PORT, PORT/tcp or PORT/udp, "
                                         f"got {text!r}")
    if sep and proto.lower() not in ("tcp", "udp"):
        raise argparse.ArgumentTypeError(f"takes a TCP or UDP port (PORT, PORT/tcp or PORT/udp), got {text!r}: "
                                         f"protocol {proto!r} is not tcp or udp")
    return int(number), (proto.lower() if sep else "tcp")


def _sandbox_port(text: str) -> int | str:
    """--publish PORT[/tcp|/udp]: the sandbox's port alone (a TCP port as its
    number, what create takes, else "PORT/udp"); docker's HOST:PORT is refused
    saying what dsec takes instead."""
    m = re.fullmatch(r"(?:[\d.]+:)?(\d+):(\d+(?:/\w*)?)", text)
    if m:
        raise argparse.ArgumentTypeError(
            f"takes the sandbox's port alone, got {text!r}: the daemon picks the host port "
            f"(net.publish_ports); to choose it, `dsec port SB {m.group(2)} --host-port "
            f"{m.group(1)}` after the create")
    port, proto = _port_and_protocol(text)
    return port if proto == "tcp" else f"{port}/{proto}"


def _port_to_publish(text: str) -> tuple[int, str]:
    """`dsec port SB PORT[/tcp|/udp]`: the sandbox's port and its protocol;
    docker's HOST:PORT is refused saying what to give instead."""
    m = re.fullmatch(r"(?:[\d.]+:)?(\d+):(\d+(?:/\w*)?)", text)
    if m:
        raise argparse.ArgumentTypeError(f"takes the sandbox's port alone, got {text!r}: give the host port "
                                         f"with --host-port {m.group(1)}")
    return _port_and_protocol(text)


def _backend_option(p: argparse.ArgumentParser) -> None:
    """--backend of `dsec create` and `dsec run` (`dsec fleet create` has its own)."""
    p.add_argument("--backend", choices=["container", "microvm"], help="container: namespaces and cgroups; "
                   "microvm: a QEMU guest of its own (default: the daemon's sandbox.backend; `dsec info` "
                   "says whether microvm is available here, and its accelerator)")


def _create_options(p: argparse.ArgumentParser) -> None:
    """The options of a create, shared by `dsec create`, `dsec run` and `dsec fleet create`
    (clitext.create_args)."""
    p.add_argument("--cpu", type=float, metavar="CPUS", help="CPUs, fractions allowed: 0.5, 2; its CPU "
                   "weight and admission share, a hard cap with --cpu-quota (default: sandbox.cpu)")
    p.add_argument("--memory", metavar="SIZE", help="memory limit, e.g. 256M, 2G (default: sandbox.memory)")
    p.add_argument("--pids", type=int, metavar="N", help="most processes and threads at once (default: "
                   "sandbox.pids)")
    p.add_argument("--disk", metavar="SIZE", help="size cap of its writable layer, e.g. 20G (default: "
                   "sandbox.disk; needs the upperfs feature, see dsec info)")
    p.add_argument("-e", "--env", action="append", metavar="K=V", help="over the image's environment; K alone: "
                   "ours (repeatable)")
    p.add_argument("--env-file", action="append", metavar="FILE",
                   help="KEY=VALUE lines, as docker reads them; --env goes over them (repeatable)")
    p.add_argument("--label", action="append", metavar="K=V", help="a label to find it by: dsec ps --label, "
                   "rm --all --label; job=J groups it for dsec job (repeatable)")
    p.add_argument("--hostname")
    p.add_argument("-w", "--cwd", "--workdir", dest="cwd", help="working directory of its processes (default: "
                   "the image's)")
    p.add_argument("-u", "--user", help="user of its processes: NAME, UID, NAME:GROUP or UID:GID, names from the "
                   "image's /etc/passwd and /etc/group, which also give a user without a GROUP its "
                   "supplementary groups (default: the image's)")
    p.add_argument("--net", choices=["none", "default"], help="none: loopback only; default: bridge + "
                   "address + egress allowlist (default: the daemon's net.default_mode)")
    p.add_argument("--allow", action="append", metavar="RULE", help="egress rule (CIDR or host name, "
                   "'*.name' for every name below: ADDR[:port[-port]][/tcp|udp]) "
                   "or rule-set name (repeatable)")
    p.add_argument("--publish", action="append", type=_sandbox_port, metavar="PORT[/udp]", help="make this port "
                   "of the sandbox (TCP, or PORT/udp) reachable from the host (on a host port the daemon picks; "
                   "`dsec net show`, `dsec port`); needs --net default (repeatable)")
    p.add_argument("--ttl", help="max lifetime, e.g. 2h, 1h30m, 90s")
    p.add_argument("--idle-ttl", help="destroy after this long without requests, e.g. 5m (paused time excluded)")
    p.add_argument("--qos", choices=["be", "ls"], help="best-effort or latency-sensitive (default: cpu.default_qos)")
    p.add_argument("--cpu-quota", action=argparse.BooleanOptionalAction,
                   help="--cpu is also a hard CFS quota (default: sandbox.cpu_hard_quota)")
    p.add_argument("--policy", type=_policy_arg, metavar="NAME|JSON",
                   help="the task policy of every exec in it (a name, see dsec policy ls, or an inline "
                        "JSON object); an exec may name another")


# `dsec top --sort`: the orders dsecd/topview.py's SORTS defines (named here
# so the parser need not import topview, and asyncio with it; a unit test
# checks they are the same).
TOP_SORTS = ("cpu", "mem", "swap", "throttled", "id", "state", "qos")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dsec", description="Drive the local dsecd daemon, another host's over ssh "
                "(--host), or many hosts' (dsec fleet --hosts H1,H2 COMMAND ...).")
    p.add_argument("--socket", help="daemon socket (env DSEC_SOCKET; default /run/dsecd/dsecd.sock); "
                   "with --host: the socket on that host")
    p.add_argument("--host", default=os.environ.get("DSEC_HOST") or None, metavar="ssh://[USER@]HOST[:PORT]",
                   help="drive that host's daemon over ssh, through `dsec rpc --stdio` there (env DSEC_HOST; "
                   "ssh as configured for you: ~/.ssh/config, agent, known_hosts)")
    p.add_argument("--ssh-config", metavar="FILE", help="ssh config file for --host and fleet (ssh -F; "
                   "env DSEC_SSH_CONFIG)")
    p.add_argument("--remote-dsec", metavar="COMMAND", help="the dsec command on remote hosts (env "
                   "DSEC_REMOTE_DSEC; default: dsec on their PATH)")
    p.add_argument("--silence-timeout", type=_silence_arg, metavar="SECONDS",
                   help="give up on the local daemon once it sent nothing for this long while requests "
                        "wait and pings go unanswered (stopped, or wedged); 0 or off: never (env "
                        "DSEC_SILENCE_TIMEOUT; default 10s)")
    p.add_argument("--version", action=_Version, nargs=0, default=argparse.SUPPRESS,
                   help="this dsec's version (the daemon's: dsec info)")
    p.set_defaults(json=False)
    sub = p.add_subparsers(dest="cmd", required=True)

    sub.add_parser("info", help="version, kernel features, limits, paths, CPU capacity")

    img = sub.add_parser("image", help="manage images").add_subparsers(dest="image_cmd", required=True)
    for verb, text in (("build", "build an image from a directory or tarball (a root file system, a docker "
                                 "save or an OCI layout), or from a Dockerfile (-f)"),
                       ("import", "build without --from or -f: a directory or tarball (a root file system, "
                                  "a docker save or an OCI layout) as an image")):
        imp = img.add_parser(verb, help=text)
        imp.add_argument("path", help="a directory or tarball on the daemon's host" + (
            "; with -f, the build context (a directory the daemon reads COPY and ADD sources from, in place)"
            if verb == "build" else ""))
        imp.add_argument("--name", required=True)
        if verb == "build":
            imp.add_argument("--from", dest="parent", help="put the new layer on top of this image")
            imp.add_argument("-f", "--file", metavar="DOCKERFILE",
                             help="build from this Dockerfile ('-': stdin; FROM a local image; RUN in "
                             "sandboxes; steps cached); replaces an image of that name")
            imp.add_argument("--build-arg", action="append", metavar="K=V",
                             help="with -f: an ARG's value (K alone: $K's value here, as docker build)")
            imp.add_argument("--allow", action="append", metavar="RULE", help="with -f: egress rule or "
                             "rule-set name for RUN steps, e.g. pypi (repeatable; none: RUN has no network)")
            imp.add_argument("--no-cache", action="store_true", help="with -f: run every step again")
        imp.add_argument("--env", action="append", metavar="K=V",
                         help="image config: environment (over the image's)")
        imp.add_argument("--cwd", help="image config: working directory")
        imp.add_argument("--user", help="image config: user: NAME, UID, NAME:GROUP or UID:GID")
        imp.add_argument("--entrypoint", metavar="ARGV",
                         help="image config: entrypoint, as shell words ('python3 -m app') or a JSON array "
                         "(clears cmd unless --cmd)")
        imp.add_argument("--cmd", dest="cmd_args", metavar="ARGV",
                         help="image config: cmd, the entrypoint's default arguments, as shell words or a "
                         "JSON array")
        imp.add_argument("--label", action="append", metavar="K=V", help="image config: a label")
        imp.add_argument("--expose", action="append", metavar="PORT[/PROTO]",
                         help="image config: an exposed port (repeatable)")
    pull = img.add_parser("pull", help="pull an image from a registry (python:3.11, "
                          "registry/namespace/name:tag, name@sha256:...)")
    pull.add_argument("ref")
    pull.add_argument("--platform", help="os/arch[/variant] to take from a multi-platform image "
                      "(default: this host's)")
    img.add_parser("ls", help="list images")
    img.add_parser("gc", help="remove blobs no image and no live sandbox or build of this daemon uses "
                   "(on a shared store, not other hosts')")
    img.add_parser("du", help="disk use of the blob store")
    for name in ("inspect", "rm"):
        x = img.add_parser(name)
        x.add_argument("name")
    x = img.add_parser("tag", help="name an image again (docker tag): the same image, nothing copied; "
                       "an image of that name is replaced")
    x.add_argument("source", help="the image to name")
    x.add_argument("name", help="its new name")
    x = img.add_parser("flatten", help="make an image one layer (its layers merged, as a sandbox sees "
                       "them): a deep chain of snapshots or builds becomes a flat image, the same config")
    x.add_argument("name", help="the image to flatten")
    x.add_argument("--as", dest="as_name", metavar="NEW",
                   help="name the flat image NEW (a name no image has; its parent is NAME); "
                   "default: NAME itself moves to it")

    cr = sub.add_parser("create", help="create a sandbox; prints its id (it runs nothing: see dsec run)",
                        usage="dsec create [options] IMAGE (or --image IMAGE)")
    image_help = "the image to make it of (a name dsec image ls lists; dsec image pull fetches one)"
    cr.add_argument("image_pos", nargs="?", metavar="IMAGE", help=image_help + ", as docker create takes it")
    cr.add_argument("--image", help=image_help + ", as an option")
    _create_options(cr)
    cr.add_argument("--lease", help="destroy unless renewed (SDK: Client.hold) within this long")
    cr.add_argument("--key", help="idempotency key: a retried create with it returns the same sandbox")
    _backend_option(cr)

    run = sub.add_parser("run", help="run an image's command in a new sandbox, removed afterwards "
                         "(docker run --rm)", usage="dsec run [options] IMAGE [--] [ARG...] "
                         "(ARGs replace the image's Cmd)")
    run.add_argument("-i", "--interactive", action="store_true", help="pass stdin to the command")
    run.add_argument("-t", "--tty", action="store_true",
                     help="run the command on a terminal (with -i: ours, in raw mode, is its keyboard)")
    run.add_argument("-d", "--detach", action="store_true",
                     help="start the command in the background and print the sandbox's id; the sandbox stays "
                     "until dsec rm (bound it with --ttl; --idle-ttl counts requests, not the command running); "
                     "dsec logs, attach, wait take the command")
    run.add_argument("--rm", action=argparse.BooleanOptionalAction, default=None,
                     help="remove the sandbox when the command ends (default without -d; --no-rm keeps it)")
    run.add_argument("--entrypoint", metavar="PROGRAM", help="run this instead of the image's Entrypoint "
                     "(its Cmd is dropped: ARGs follow PROGRAM)")
    run.add_argument("--timeout", type=_timeout_arg, help="seconds or a duration (5m); the process group is killed after it")
    _create_options(run)
    _backend_option(run)
    run.add_argument("image")

    pol = sub.add_parser("policy", help="task policies (Landlock): file, port, signal rules per exec")
    pol.add_subparsers(dest="policy_cmd", required=True).add_parser(
        "ls", help="the daemon's named policies, their fields and what the kernel can enforce")

    pool = sub.add_parser("pool", help="warm pools of ready sandboxes").add_subparsers(dest="pool_cmd",
                                                                                      required=True)
    x = pool.add_parser("set", help="keep MIN..MAX ready sandboxes of (image, shape); --max 0 removes the pool")
    x.add_argument("--image", required=True)
    x.add_argument("--min", type=int, required=True)
    x.add_argument("--max", type=int, required=True)
    x.add_argument("--cpu", type=float)
    x.add_argument("--memory", help="e.g. 256M")
    pool.add_parser("ls", help="pools: shape, bounds, ready, taken")

    dr = sub.add_parser("drain", help="refuse new creates and pool refills on this host (kept across daemon "
                        "restarts); its sandboxes keep working")
    dr.add_argument("--reason", help="why, shown by dsec info and in the refusals (e.g. 'kernel update')")
    sub.add_parser("undrain", help="take creates and refill pools again after a drain")

    for verb, text in (("exec", "run a command in a sandbox"),
                       ("trace", "run a command under ptrace and record its execve, opens, connects, signals")):
        ex = sub.add_parser(verb, help=text, usage=f"dsec {verb} [options] SANDBOX [--] COMMAND [ARG...]")
        _exec_options(ex, verb)

    call = sub.add_parser("call", help="stateless function call (FnCall): dsec call --image IMG -- CMD...",
                          usage="dsec call [options] --image IMAGE [--] COMMAND [ARG...] "
                                "(with --code-file: the code's sys.argv[1:])")
    call.add_argument("--image", required=True, help="the image the call runs in (a name dsec image ls lists)")
    call.add_argument("--code-file", help="Python source to run through the image's zygote")
    call.add_argument("--stdin", metavar="FILE", help="file fed to the call's stdin ('-': dsec's own stdin)")
    call.add_argument("--timeout", type=_timeout_arg, help="seconds or a duration (5m); the call's process group is killed after it")
    call.add_argument("--env", action="append", metavar="K=V")

    cp = sub.add_parser("cp", help="copy a file: LOCAL SB:/path or SB:/path LOCAL ('-' = stdin/stdout: a "
                                   "file's bytes, or a directory's tar as docker cp -); -r: a directory")
    cp.add_argument("-r", "--recursive", action="store_true",
                    help="copy a directory tree (symlinks as symlinks; FIFOs and devices are not copied)")
    cp.add_argument("-L", "--follow-link", action="store_true",
                    help="a SOURCE that is a symlink is followed (its target's content and mode) with -r too")
    cp.add_argument("-P", "--no-dereference", action="store_true",
                    help="a SOURCE that is a symlink is copied as a symlink (as with -r); without -r or -P "
                         "a plain copy follows it (out of a sandbox: inside the sandbox)")
    cp.add_argument("--tar", action="store_true",
                    help="with '-', always a tar, as docker cp - has it: SB:/file - writes a tar of the one file "
                         "(without: its bytes); - SB:/dir requires a directory that exists")
    cp.add_argument("--owner", metavar="USER",
                    help="into a sandbox: who what the copy makes belongs to, a uid, NAME, UID:GID or NAME:GROUP "
                         "of the sandbox (default: its root, as docker cp gives it)")
    cp.add_argument("src")
    cp.add_argument("dst")

    watch = sub.add_parser("watch", help="print changes under a directory: SB:/path (until interrupted)")
    watch.add_argument("target", metavar="SB:/path")
    watch.add_argument("-r", "--recursive", action="store_true", help="subdirectories too, new ones included")

    for verb, text in (("pause", "freeze sandboxes and give their memory back"),
                       ("resume", "prefetch and thaw paused sandboxes")):
        x = sub.add_parser(verb, help=text)
        x.add_argument("sandboxes", nargs="+")

    x = sub.add_parser("renew", help="renew the leases of sandboxes made with --lease (SDK: Client.hold)")
    x.add_argument("sandboxes", nargs="+")
    x.add_argument("--lease", help="a new lease length (e.g. 10m; default: each sandbox's own)")

    job = sub.add_parser("job", help="all sandboxes labelled job=JOB").add_subparsers(dest="job_cmd", required=True)
    for verb in ("pause", "resume", "rm"):
        x = job.add_parser(verb)
        x.add_argument("job")
        if verb == "rm":
            x.add_argument("--force", "-f", action="store_true")

    net = sub.add_parser("net", help="a sandbox's egress policy").add_subparsers(dest="net_cmd", required=True)
    x = net.add_parser("show", help="rules, allowed counters per rule, and what was denied")
    x.add_argument("sandbox")
    net.add_parser("sets", help="the rule sets --allow NAME takes (the daemon's [net.rule_sets])")
    x = net.add_parser("set", help="change the policy atomically")
    x.add_argument("sandbox")
    x.add_argument("--replace", action="store_true", help="the --allow rules become the whole policy")
    x.add_argument("--allow", action="append", metavar="RULE", help="with --replace: the new policy")
    x.add_argument("--add", action="append", metavar="RULE",
                   help="allow this too: an egress rule or rule-set name (repeatable; --allow does the same)")
    x.add_argument("--remove", action="append", metavar="RULE",
                   help="drop a rule or rule-set name the policy has, as it was added (repeatable)")

    x = sub.add_parser("port", help="publish a sandbox's TCP or UDP port on the host side (prints host:port); "
                       "without a port, list what is published")
    x.add_argument("sandbox")
    x.add_argument("port", type=_port_to_publish, nargs="?",
                   help="the sandbox's port: PORT or PORT/tcp, PORT/udp for UDP (none: list its published ports, "
                   "PORT/PROTOCOL -> HOST:PORT)")
    x.add_argument("--host-port", type=int, help="the host port (default: a free one of net.publish_ports)")
    x.add_argument("--bind", help="a local non-loopback IPv4 address of the daemon's host side "
                   "(default: all of them)")
    x.add_argument("--remove", "--rm", action="store_true", help="unpublish it")

    ev = sub.add_parser("events", help="stream state changes and policy denials (one per line with --json)")
    ev.add_argument("sandbox_id", nargs="?", metavar="SANDBOX", help="only this sandbox's events")
    ev.add_argument("--sandbox", help="only this sandbox's events (its id or a prefix of it), as SANDBOX")
    ev.add_argument("--replay", action="store_true", help="first the recent history")
    ev.add_argument("--no-follow", dest="follow", action="store_false",
                    help="end after the replayed history instead of following live events")

    snap = sub.add_parser("snapshot", help="pack a sandbox's changes as a new image (pack_diff)")
    snap.add_argument("sandbox")
    snap.add_argument("--name", required=True, help="name of the new image (a name no image has yet)")
    snap.add_argument("--exclude", action="append", metavar="PATH",
                      help="leave out this absolute path in the sandbox, a file or a directory: no pattern "
                      "(repeatable)")

    proc = sub.add_parser("proc", help="background processes (dsec exec -d)").add_subparsers(dest="proc_cmd",
                                                                                          required=True)
    x = proc.add_parser("ls", help="pid, state, exit code, command, start, output kept and dropped")
    x.add_argument("sandbox")
    x = sub.add_parser("logs", help="a background process's output: stdout to ours, stderr to ours")
    x.add_argument("sandbox")
    x.add_argument("pid", type=int)
    x.add_argument("-f", "--follow", action="store_true",
                   help="keep printing new output until the process exits")
    x.add_argument("--since", metavar="DURATION|TIME",
                   help="only output since then: 90s, 5m, 2h back, a Unix timestamp or an ISO 8601 time")
    x = sub.add_parser("attach", help="our stdin to a background process, its output to ours (Ctrl-D: its "
                       "end of input; Ctrl-C detaches, it keeps running); exits with its status")
    x.add_argument("sandbox")
    x.add_argument("pid", type=int)
    x = sub.add_parser("kill", help="signal a background process's group")
    x.add_argument("sandbox")
    x.add_argument("pid", type=int)
    x.add_argument("--signal", "-s", default="KILL", help="a name (TERM, INT, HUP, KILL) or number (default KILL)")
    x = sub.add_parser("wait", help="wait for a background process; exit with its exit code (128+N if "
                       "signal N killed it)")
    x.add_argument("sandbox")
    x.add_argument("pid", type=int)

    ps = sub.add_parser("ps", help="list sandboxes")
    ps.add_argument("--label", action="append", metavar="K=V")

    top = sub.add_parser("top", help="sampled CPU, throttling and memory per sandbox; host totals (live on a "
                         "terminal: keys c m t i s o sort, r reverses, q quits; one snapshot when piped)")
    top.add_argument("--label", action="append", metavar="K=V")
    top.add_argument("--interval", "-d", type=_positive_seconds, default=2.0, metavar="SECONDS",
                     help="seconds between refreshes of the live view (default 2)")
    top.add_argument("--sort", choices=sorted(TOP_SORTS), default="cpu", help="order of the rows (default cpu)")
    top.add_argument("--once", action="store_true", help="print one snapshot even on a terminal")

    ls = sub.add_parser("ls", help="list a directory in a sandbox: dsec ls SB:/path")
    ls.add_argument("target", metavar="SANDBOX:/path")
    ls.add_argument("--depth", type=int, default=1, help="subdirectories too, down to this depth")
    cat = sub.add_parser("cat", help="print files of a sandbox: dsec cat SB:/file ...")
    cat.add_argument("targets", nargs="+", metavar="SANDBOX:/path")

    ins = sub.add_parser("inspect", help="one sandbox as JSON")
    ins.add_argument("sandbox")

    rm = sub.add_parser("rm", help="destroy sandboxes, or remove SANDBOX:/paths inside one")
    rm.add_argument("sandboxes", nargs="*", metavar="SANDBOX|SANDBOX:/path")
    rm.add_argument("--recursive", "-r", action="store_true", help="with SANDBOX:/path: a directory and its contents")
    rm.add_argument("--all", action="store_true", help="destroy every sandbox (with --label: only those "
                    "labelled so)")
    rm.add_argument("--force", "-f", action="store_true",
                    help="kill running execs; with SANDBOX:/path: one that does not exist is no failure, as rm -f")
    rm.add_argument("--label", action="append", metavar="K=V", help="with --all: only these")

    rpc = sub.add_parser("rpc", help="bridge the protocol over stdin/stdout (for ssh)")
    rpc.add_argument("--stdio", action="store_true")

    # Only for --help: `dsec fleet` is parsed by parse_args, which hands the
    # command after the fleet's options to this parser again.
    sub.add_parser("fleet", help="a command across hosts: dsec fleet --hosts H1,H2 COMMAND ... "
                   "(dsec fleet --help)", add_help=False)
    return p


def build_fleet_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dsec fleet", usage="dsec [--ssh-config F] [--remote-dsec C] fleet --hosts H1,H2[,...] "
                "COMMAND [ARGS]", description=FLEET_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default=os.environ.get("DSEC_HOSTS") or None, metavar="H1,H2,...",
                   help="the fleet: ssh://[user@]host[:port], bare host names, or local daemons' socket "
                   "paths (/run/dsecd/dsecd.sock), comma-separated (env DSEC_HOSTS)")
    p.add_argument("--connect-timeout", type=_positive_seconds, default=FLEET_CONNECT_TIMEOUT_S, metavar="S",
                   help=f"how long a host may take to answer before the command goes on without it "
                   f"(default {FLEET_CONNECT_TIMEOUT_S:g}); a host that hangs costs every command this long")
    return p


# A one-shot fleet command waits this long for each host (ssh, then the
# daemon's hello), all at once: a host that hangs delays it by that much.
FLEET_CONNECT_TIMEOUT_S = 15.0


FLEET_HELP = """\
Runs a dsec command across the hosts' daemons, reached over ssh:
  create                 placed on one host (free capacity, image, spread of its job); prints its id
  run                    its sandbox placed as create's; the command runs there, the sandbox is removed
  ps, top, info, image ls  every host's, with a HOST column
  job pause|resume|rm, rm --all, image build|import|pull|rm|gc, pool set,
  drain, undrain         on every host at once
  call                   on the least loaded host
  events                 every host's, merged (each line names its host)
  any command naming sandboxes (exec, cp, ls, cat, logs, pause, rm SB, ...)
                         goes to the host holding them
A host that is down or fails to answer is named on stderr, and a command
that lacks its part (ps, top, image ls, pool ls, the ones on every host)
exits 1, --json too, with what the other hosts gave.
"""



def parse_args(argv: list[str]) -> argparse.Namespace:
    """dsec's arguments; the command of RUNS_A_COMMAND lands in `argv`. A usage
    error exits 2, or 125 for RUNS_A_COMMAND (argparse's SystemExit)."""
    _parsing[:] = argv
    at = find_verb(argv)
    verb = argv[at] if at is not None else None
    if verb == "fleet":
        return _parse_fleet_args(argv, at)
    command: list[str] = []
    parser = build_parser()
    if verb in RUNS_A_COMMAND:
        # An exec's words after the sandbox id stay dsec's (a mistyped option
        # is a usage error); a run's image takes the rest as docker's does.
        head, command = split_command(argv[at + 1:], positionals=0 if verb == "call" else 1,
                                      known=verb_options(parser, verb) if verb == "run" else None)
        argv = [*argv[:at + 1], *head]
    try:
        a = parser.parse_args(join_signed_values(argv))
    except SystemExit as exit_:
        if exit_.code == EXIT_USAGE and verb in GIVES_A_STATUS:
            raise SystemExit(EXIT_DSEC_ERROR) from None
        raise
    a.argv = command
    a.fleet = None
    if a.cmd == "create":
        _create_image(parser, a)
    return a


def _create_image(parser: argparse.ArgumentParser, a) -> None:
    """`dsec create IMAGE` and `dsec create --image IMAGE` are one: a.image.
    Neither, or both, is create's usage error, said with create's usage."""
    given = {i for i in (a.image_pos, a.image) if i is not None}
    if len(given) != 1:
        create = next(action for action in parser._actions
                      if isinstance(action, argparse._SubParsersAction)).choices["create"]
        create.error("an image is needed: dsec create IMAGE (or --image IMAGE)" if not given
                     else f"two images given ({a.image_pos!r} and --image {a.image!r}); give one")
    a.image = given.pop()


def _parse_fleet_args(argv: list[str], at: int) -> argparse.Namespace:
    """`dsec [globals] fleet --hosts H1,H2 COMMAND ...`: the fleet's options,
    then the command parsed as dsec's own."""
    rest = argv[at + 1:]
    inner_at = find_verb(rest, FLEET_VALUED)
    own, inner = (rest, []) if inner_at is None else (rest[:inner_at], rest[inner_at:])
    f = build_fleet_parser().parse_args(own)
    if not inner:
        build_fleet_parser().error("give a command after the fleet's options, e.g. dsec fleet --hosts h1,h2 ps")
    if inner[0] in ("fleet", "rpc"):
        build_fleet_parser().error(f"`{inner[0]}` does not run across a fleet")
    option = _fleet_option_after_command(inner)
    if option is not None:
        i = inner.index(option)
        span = 1 if "=" in option or i + 1 == len(inner) else 2       # --opt=value, or --opt value
        rest = inner[:i] + inner[i + span:]
        build_fleet_parser().error(
            f"{option.split('=')[0]} is an option of dsec fleet, not of `{inner[0]}`: give it before the "
            f"command: dsec fleet {shlex.join([*own, *inner[i:i + span], *rest[:4]])}"
            f"{' ...' if len(rest) > 4 else ''}")
    if not f.hosts:
        build_fleet_parser().error("--hosts H1,H2,... is required (or DSEC_HOSTS)")
    a = parse_args([*argv[:at], *inner])
    if any(w == "--host" or w.startswith("--host=") for w in argv[:at]):
        build_fleet_parser().error("--host names one host; a fleet's are in --hosts")
    a.host = None            # DSEC_HOST, set for plain commands, is not the fleet's
    a.fleet = [h.strip() for h in f.hosts.split(",") if h.strip()]
    if not a.fleet:
        build_fleet_parser().error(f"--hosts {f.hosts!r} names no host: give H1,H2,...")
    # The client's modules, imported for a fleet's hosts only (not for its
    # --help): checking them needs these, and the command uses them anyway.
    from .fleet import fleet_target
    from .remote import SshTarget, is_remote

    seen: set[str] = set()
    for host in a.fleet:
        # Here, not at connect: a host that cannot be one is the command line's error.
        try:
            target = fleet_target(host)
            if is_remote(target):
                SshTarget.parse(target)
        except ValueError as err:
            build_fleet_parser().error(f"--hosts: {err}")
        if target in seen:
            build_fleet_parser().error(f"--hosts: {host} is given twice (a bare name is ssh://name)")
        seen.add(target)
    a.json = a.json or getattr(f, "json", False)
    a.connect_timeout = f.connect_timeout
    return a


def _fleet_option_after_command(inner: list[str]) -> str | None:
    """A fleet option (--hosts, --connect-timeout, or --opt=value) among the
    words of the command `inner`, which the command does not have. A
    command's arguments (after `--`, or the words a run or exec runs) are
    not looked at."""
    verb, words = inner[0], inner[1:]
    parser = build_parser()
    if verb in RUNS_A_COMMAND:
        words, _ = split_command(words, positionals=0 if verb == "call" else 1,
                                 known=verb_options(parser, verb) if verb == "run" else None)
    own = verb_options(parser, verb)
    for word in words:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if name in FLEET_VALUED and name not in own:
            return word
    return None



def _closed_outputs() -> list[int]:
    """Which of our stdout and stderr nobody reads any more (a pipe's write
    end polls POLLERR then)."""
    poll = select.poll()
    for fd in (1, 2):
        poll.register(fd, select.POLLOUT)
    return [fd for fd, events in poll.poll(0) if events & (select.POLLERR | select.POLLHUP)]


def _flush_stdout() -> bool:
    """Flush stdout; False (and stdout silenced) if nobody reads it any more."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return False
    return True


def _silence_stdout(fds: tuple[int, ...] = (1,)) -> None:
    """Point stdout (or `fds`) at /dev/null, so the interpreter's last flush of
    a closed pipe raises nothing at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        os.dup2(devnull, fd)
    os.close(devnull)



# Commands whose --json output is a stream of one-line objects: an error ends
# it as one more line. rm, pause, resume and renew take several sandboxes (or
# paths) and go on past one that fails: one line for each, its result or its
# error, so that the whole is read as lines, never as documents run together.
JSON_LINES = ("events", "watch", "logs", "attach", "cat", "rm", "pause", "resume", "renew")


def _print_error(a, error: dict) -> None:
    """With --json, `{"error": {"code", "message", "detail"}}` on stdout: the
    daemon's wire error, or one of dsec's own failures (_local_error). The
    stderr line is printed as without --json. `rpc`'s stdout is the protocol:
    nothing goes there."""
    if not a.json or a.cmd == "rpc":
        return
    if a.cmd in JSON_LINES:
        print(json.dumps({"error": error}, sort_keys=True), flush=True)
    else:
        _print_json({"error": error})


def _local_error(code: str, message: str, detail: dict | None = None) -> dict:
    """A failure of dsec's own, in the daemon's wire shape. Its code is the
    protocol's (dsecd/errors.py) where one fits; two never come from a daemon:
    `unreachable` (no connection to it, or it was lost) and `interrupted`
    (SIGINT, or the signal that ended `dsec run` or `dsec exec -t`)."""
    return {"code": code, "message": message, "detail": detail or {}}


def _interrupted(a, signum: int, message: str, **detail) -> None:
    """--json: the error of a command a signal ended, with the output it kept (CommandOutput)."""
    kept = getattr(a, "kept_output", None)
    fields = kept.fields() if kept is not None and kept.as_json else {}
    _print_error(a, _local_error("interrupted", message,
                                 {"signal": signal.Signals(signum).name, **detail, **fields}))



# Usage errors argparse reports (_Parser.error): the last one, for --json.
_usage_error: list[str] = []


def _dsec_words(argv: list[str]) -> list[str]:
    """The words of argv that are dsec's, not the command's (RUNS_A_COMMAND):
    where a --json means dsec's output."""
    at = find_verb(argv)
    if at is None:
        return argv
    verb = argv[at]
    if verb == "fleet":
        rest = argv[at + 1:]
        inner_at = find_verb(rest, FLEET_VALUED)
        return argv if inner_at is None else [*argv[:at + 1], *rest[:inner_at], *_dsec_words(rest[inner_at:])]
    if verb in RUNS_A_COMMAND:
        head, _ = split_command(argv[at + 1:], positionals=0 if verb == "call" else 1)
        return [*argv[:at + 1], *head]
    return argv


def _usage_failed(argv: list[str], code) -> None:
    """A usage error argparse found (exit 2, or 125): with --json, its message as the error object."""
    if code in (0, None) or not _usage_error or "--json" not in _dsec_words(argv):
        return
    words = _dsec_words(argv)
    at = find_verb(words)
    a = argparse.Namespace(json=True, cmd=words[at] if at is not None else None)
    _print_error(a, _local_error("bad_request", _usage_error[-1]))



def _interrupted_before_parsing(argv: list[str]) -> None:
    """A ^C held while dsec started, said before its arguments are read:
    they might be wrong, and what they ask is not to be done."""
    words = _dsec_words(argv)
    at = find_verb(words)
    a = argparse.Namespace(json="--json" in words, cmd=words[at] if at is not None else None)
    _interrupted(a, signal.SIGINT, "interrupted (SIGINT)")
    print(f"dsec{f' {a.cmd}' if a.cmd else ''}: interrupted (SIGINT)", file=sys.stderr)
    sys.exit(130)


def parsed(argv: list[str]) -> argparse.Namespace:
    """dsec's arguments, or the exit a usage error, --help or a ^C held
    since the start (sigint.py) asks for, said as main says them."""
    if sigint.held():
        _interrupted_before_parsing(argv)
    try:
        return parse_args(argv)
    except BrokenPipeError:             # --help into a closed pipe
        _silence_stdout()
        sys.exit(EXIT_BROKEN_PIPE)
    except SystemExit as exit_:         # --help or a usage error; its text may still be buffered
        with contextlib.suppress(BrokenPipeError):
            _usage_failed(argv, exit_.code)
        if not _flush_stdout():
            sys.exit(EXIT_BROKEN_PIPE)
        raise
