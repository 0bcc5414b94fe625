"""The build plan: a parsed Dockerfile turned into steps, before anything runs.

Everything an instruction means that does not depend on the files of the
image is decided here, for every step at once: ARG scopes and --build-arg
values, ENV, the expansion of each argument, WORKDIR paths, the image
config after each step, the argv and environment of each RUN. So a typo on
the last line fails the build before its first RUN starts, and the builder
(dsecd/engine/builds.py) only has files to deal with.

Docker's rules kept: ARGs before FROM are in scope for FROM only (an `ARG
NAME` after FROM takes their value again); ENV wins over an ARG of the same
name; ENTRYPOINT resets a CMD inherited from the base image; shell forms run
as SHELL (default ["/bin/sh", "-c"]) with the text. The image config holds
exactly the keys of CONFIG_KEYS.

Pure Python, no I/O.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field, replace

from ..imageconfig import DEFAULT_PATH
from .dockerfile import (
    NAME_RE,
    Dockerfile,
    DockerfileError,
    Instruction,
    expand,
    expanded_word,
    expanded_words,
    key_values,
    split_words,
)

DEFAULT_SHELL = ["/bin/sh", "-c"]
# The image config a Dockerfile build writes; the create reads these keys.
CONFIG_KEYS = ("env", "cwd", "user", "entrypoint", "cmd", "exposed_ports", "labels")
PROTOCOLS = ("tcp", "udp", "sctp")
MAX_EXPOSED = 4096      # ports one EXPOSE range may add ("1-65535" would be 65535 entries)

# What kind of work each step is for the builder.
META = "meta"           # the image config only: ENV, ARG, USER, LABEL, EXPOSE, CMD, ...
RUN = "run"             # a command in a sandbox of the image so far
COPY = "copy"           # files of the context into the image (COPY, ADD)
WORKDIR = "workdir"     # the working directory made if missing


@dataclass(frozen=True)
class ImageConfig:
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "/"
    user: str = "0"
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    exposed_ports: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: dict) -> ImageConfig:
        """The config of a base image, whichever way it was built (an
        imported image has a numeric user and no cmd)."""
        user = cfg.get("user", 0)
        return cls(env=dict(cfg.get("env") or {}), cwd=cfg.get("cwd") or "/",
                   user=str(user) if user not in (None, "") else "0",
                   entrypoint=list(cfg.get("entrypoint") or []), cmd=list(cfg.get("cmd") or []),
                   exposed_ports=sorted(cfg.get("exposed_ports") or []),
                   labels=dict(cfg.get("labels") or {}))

    def to_dict(self) -> dict:
        return {"env": dict(self.env), "cwd": self.cwd, "user": self.user,
                "entrypoint": list(self.entrypoint), "cmd": list(self.cmd),
                "exposed_ports": list(self.exposed_ports), "labels": dict(self.labels)}


@dataclass(frozen=True)
class Step:
    """One instruction as the builder runs it. `text` is the instruction
    after expansion, in a normal form: it is what the cache key hashes (with
    the parent image and, for COPY/ADD, the files) and what progress shows."""

    n: int
    instruction: Instruction
    kind: str
    text: str
    config: ImageConfig                      # the image config after this step
    argv: list[str] = field(default_factory=list)        # RUN
    env: dict[str, str] = field(default_factory=dict)    # RUN: ARGs in scope and ENV
    sources: list[str] = field(default_factory=list)     # COPY/ADD, as written, expanded
    dest: str = ""                           # COPY/ADD (absolute; a trailing / kept), WORKDIR
    chown: str | None = None                 # COPY/ADD --chown, as written
    chmod: int | None = None                 # COPY/ADD --chmod
    add: bool = False                        # ADD: local tar archives are extracted

    @property
    def line(self) -> int:
        return self.instruction.line


@dataclass
class Plan:
    base: str                                # the FROM image
    base_line: int
    steps: list[Step]                        # after FROM
    unused_build_args: list[str]


class _Scope:
    """What the instructions so far set: the config, ARG values, SHELL."""

    def __init__(self, config: ImageConfig, global_args: dict[str, str | None],
                 build_args: dict[str, str]):
        self.config = config
        self.global_args = global_args
        self.build_args = build_args
        self.args: dict[str, str | None] = {}        # declared after FROM: name -> value (None: unset)
        self.shell = list(DEFAULT_SHELL)
        self.cmd_set_here = False

    def env(self) -> dict[str, str]:
        """The variables expansion and RUN see: ARGs with a value, then ENV over them."""
        out = {k: v for k, v in self.args.items() if v is not None}
        out.update(self.config.env)
        return out


def plan(dockerfile: Dockerfile, build_args: dict[str, str], base_config_of=None) -> Plan:
    """The steps of a single-stage Dockerfile. `base_config_of(name)` gives
    the config dict of the FROM image (the builder looks it up in the
    store); without it the base config is empty (tests, dry runs)."""
    esc = dockerfile.escape
    instructions = dockerfile.instructions
    declared: set[str] = set()
    global_args: dict[str, str | None] = {}
    i = 0
    while i < len(instructions) and instructions[i].cmd == "ARG":
        ins = instructions[i]
        for name, value in _arg_pairs(ins, global_args_env(global_args), esc):
            declared.add(name)
            global_args[name] = build_args.get(name, value)
        i += 1
    if i >= len(instructions) or instructions[i].cmd != "FROM":
        bad = instructions[i] if i < len(instructions) else instructions[-1]
        raise DockerfileError(bad.line, f"the first instruction must be FROM (only ARG may come "
                              f"before it), not {bad.cmd}")
    base, base_line = _from(instructions[i], global_args_env(global_args), esc), instructions[i].line
    config = ImageConfig.of(base_config_of(base) if base_config_of else {})
    if "PATH" not in config.env:
        # As BuildKit: `ENV PATH=/opt/bin:$PATH` on a base without one (an
        # imported directory) must not make a PATH of "/opt/bin:" alone.
        config = replace(config, env={"PATH": DEFAULT_PATH, **config.env})
    scope = _Scope(config, global_args, build_args)
    steps = []
    for n, ins in enumerate(instructions[i + 1:], start=2):
        if ins.cmd == "FROM":
            raise DockerfileError(ins.line, "a second FROM: multi-stage builds are not supported by dsec "
                                  "builds; build each stage as an image of its own", "unsupported")
        step = _step(n, ins, scope, esc, declared)
        scope.config = step.config
        steps.append(step)
    unused = sorted(set(build_args) - declared)
    return Plan(base, base_line, steps, unused)


def global_args_env(args: dict[str, str | None]) -> dict[str, str]:
    return {k: v for k, v in args.items() if v is not None}


def _from(ins: Instruction, env: dict[str, str], esc: str) -> str:
    if "platform" in ins.flags:
        raise DockerfileError(ins.line, "FROM --platform is not supported: dsec builds run on this "
                              "host's architecture", "unsupported")
    words = expanded_words(ins.line, "FROM", ins.args, env, esc)
    if len(words) == 3 and words[1].lower() == "as":
        words = words[:1]           # a stage name: nothing refers to it in a single-stage build
    if len(words) != 1:
        raise DockerfileError(ins.line, f"FROM takes an image and optionally AS NAME, got {ins.args!r}")
    if words[0] == "scratch":
        raise DockerfileError(ins.line, "FROM scratch is not supported: dsec builds start from an image; "
                              "import a root file system first (`dsec image build DIR --name base`) "
                              "and start FROM base", "unsupported")
    if not words[0]:
        raise DockerfileError(ins.line, f"FROM {ins.args!r} names no image (is a build argument unset?)")
    return words[0]


def _arg_pairs(ins: Instruction, env: dict[str, str], esc: str) -> list[tuple[str, str | None]]:
    pairs: list[tuple[str, str | None]] = []
    try:
        for word in split_words(ins.args, esc):
            name, eq, value = word.partition("=")
            name = expand(name, env, esc)
            if not NAME_RE.fullmatch(name):
                raise DockerfileError(ins.line, f"ARG name {name!r} is not a valid variable name")
            pairs.append((name, expand(value, env, esc) if eq else None))
    except ValueError as err:
        if isinstance(err, DockerfileError):
            raise
        raise DockerfileError(ins.line, f"ARG: {err}") from None
    if not pairs:
        raise DockerfileError(ins.line, "ARG needs a NAME or NAME=DEFAULT")
    return pairs


def _command(ins: Instruction, shell: list[str]) -> list[str]:
    """The argv of RUN, CMD or ENTRYPOINT: the exec form as written, or the
    shell form's text given to the shell."""
    if ins.form is not None:
        return list(ins.form)
    return [*shell, ins.args]


def _step(n: int, ins: Instruction, scope: _Scope, esc: str, declared: set[str]) -> Step:
    config = scope.config
    env = scope.env()
    cmd = ins.cmd
    make = lambda kind, text, new=config, **kw: Step(n, ins, kind, text, new, **kw)   # noqa: E731
    if cmd == "RUN":
        if ins.flags:
            flag = next(iter(ins.flags))
            why = {"network": "the build's network is `dsec image build --allow`",
                   "mount": "drop it: a RUN sees only the image so far",
                   "security": "drop it: a RUN runs unprivileged in its sandbox"}.get(flag, "drop it")
            raise DockerfileError(ins.line, f"RUN --{flag} is not supported by dsec builds ({why})", "unsupported")
        argv = _command(ins, scope.shell)
        if not argv or not argv[0]:
            raise DockerfileError(ins.line, "RUN's exec form needs a program: [\"prog\", \"arg\", ...]")
        return make(RUN, f"RUN {json.dumps(argv)}", argv=argv, env=env)
    if cmd == "ARG":
        pairs = _arg_pairs(ins, env, esc)
        for name, value in pairs:
            declared.add(name)
            if name in scope.build_args:
                value = scope.build_args[name]
            elif value is None:
                value = scope.global_args.get(name)
            scope.args[name] = value
        return make(META, "ARG " + json.dumps({k: scope.args[k] for k, _ in pairs}, sort_keys=True))
    if cmd == "ENV":
        pairs = key_values(ins.line, cmd, ins.args, env, esc)
        new = replace(config, env={**config.env, **dict(pairs)})
        return make(META, "ENV " + json.dumps(pairs), new)
    if cmd in ("LABEL", "MAINTAINER"):
        pairs = (key_values(ins.line, cmd, ins.args, env, esc) if cmd == "LABEL"
                 else [("maintainer", ins.args)])
        new = replace(config, labels={**config.labels, **dict(pairs)})
        return make(META, "LABEL " + json.dumps(pairs), new)
    if cmd == "USER":
        user = expanded_word(ins.line, cmd, ins.args, env, esc).strip()
        if not user or user.startswith(":") or user.endswith(":") or " " in user:
            raise DockerfileError(ins.line, f"USER {ins.args!r}: give a user, user:group, uid or uid:gid")
        return make(META, f"USER {user}", replace(config, user=user))
    if cmd == "WORKDIR":
        path = expanded_word(ins.line, cmd, ins.args, env, esc).strip()
        if not path:
            raise DockerfileError(ins.line, "WORKDIR needs a path")
        cwd = posixpath.normpath(posixpath.join(config.cwd, path))
        cwd = "/" + cwd.lstrip("/")
        return make(WORKDIR, f"WORKDIR {cwd}", replace(config, cwd=cwd), dest=cwd)
    if cmd == "EXPOSE":
        ports = set(config.exposed_ports)
        for word in expanded_words(ins.line, cmd, ins.args, env, esc):
            ports.update(_ports(ins.line, word))
        return make(META, "EXPOSE " + " ".join(sorted(ports)), replace(config, exposed_ports=sorted(ports)))
    if cmd == "CMD":
        argv = _command(ins, scope.shell)
        scope.cmd_set_here = True
        return make(META, f"CMD {json.dumps(argv)}", replace(config, cmd=argv))
    if cmd == "ENTRYPOINT":
        argv = _command(ins, scope.shell)
        # Docker: an ENTRYPOINT resets a CMD that came from the base image.
        new = replace(config, entrypoint=argv, cmd=config.cmd if scope.cmd_set_here else [])
        return make(META, f"ENTRYPOINT {json.dumps(argv)}", new)
    if cmd == "SHELL":
        if ins.form is None or not ins.form:
            raise DockerfileError(ins.line, 'SHELL takes the exec form only: SHELL ["/bin/bash", "-c"]')
        scope.shell = list(ins.form)
        return make(META, f"SHELL {json.dumps(ins.form)}")
    if cmd in ("COPY", "ADD"):
        return _copy(n, ins, scope, env, esc)
    raise DockerfileError(ins.line, f"{cmd} is not handled by dsec builds")    # parse() lets no other through


def _ports(line: int, word: str) -> list[str]:
    spec, _, proto = word.partition("/")
    proto = (proto or "tcp").lower()
    if proto not in PROTOCOLS:
        raise DockerfileError(line, f"EXPOSE {word!r}: the protocol must be tcp, udp or sctp")
    lo, dash, hi = spec.partition("-")
    try:
        first, last = int(lo), int(hi if dash else lo)
    except ValueError:
        raise DockerfileError(line, f"EXPOSE {word!r} is not a port, port/protocol or range") from None
    if not 1 <= first <= last <= 65535:
        raise DockerfileError(line, f"EXPOSE {word!r}: ports are 1 to 65535, low to high")
    if last - first >= MAX_EXPOSED:
        raise DockerfileError(line, f"EXPOSE {word!r}: at most {MAX_EXPOSED} ports in one range")
    return [f"{p}/{proto}" for p in range(first, last + 1)]


def _copy(n: int, ins: Instruction, scope: _Scope, env: dict[str, str], esc: str) -> Step:
    cmd = ins.cmd
    for flag in ins.flags:
        if flag == "from":
            raise DockerfileError(ins.line, f"{cmd} --from: multi-stage builds are not supported by dsec "
                                  "builds; copy from the build context", "unsupported")
        if flag not in ("chown", "chmod", "link"):
            raise DockerfileError(ins.line, f"{cmd} --{flag} is not supported by dsec builds", "unsupported")
    chmod = None
    if "chmod" in ins.flags:
        text = ins.flags["chmod"]
        try:
            chmod = int(text, 8)
        except ValueError:
            raise DockerfileError(ins.line, f"{cmd} --chmod={text!r}: give octal permission bits, "
                                  "e.g. 755") from None
        if not 0 <= chmod <= 0o7777:
            raise DockerfileError(ins.line, f"{cmd} --chmod={text!r}: permission bits are 0 to 7777")
    chown = None
    if "chown" in ins.flags:
        chown = expanded_word(ins.line, cmd, ins.flags["chown"], env, esc)
        if not chown or chown.startswith(":") or chown.count(":") > 1:
            raise DockerfileError(ins.line, f"{cmd} --chown={ins.flags['chown']!r}: give user, user:group, "
                                  "uid or uid:gid")
    if ins.form is not None:
        try:
            words = [expand(w, env, esc) for w in ins.form]
        except ValueError as err:
            raise DockerfileError(ins.line, f"{cmd}: {err}") from None
    else:
        words = expanded_words(ins.line, cmd, ins.args, env, esc)
    if len(words) < 2:
        raise DockerfileError(ins.line, f"{cmd} needs at least one source and a destination")
    sources, dest = words[:-1], words[-1]
    if not dest:
        raise DockerfileError(ins.line, f"{cmd} has an empty destination")
    for src in sources:
        if "://" in src or src.startswith("git@"):
            raise DockerfileError(ins.line, f"{cmd} {src}: remote sources are not supported by dsec builds; "
                                  "download it in a RUN (with `dsec image build --allow` for its host) "
                                  "or put it in the build context", "unsupported")
        if not src:
            raise DockerfileError(ins.line, f"{cmd} has an empty source")
    is_dir = dest.endswith("/") or dest in (".", "..") or dest.endswith("/.")
    absolute = posixpath.normpath(posixpath.join(scope.config.cwd, dest))
    absolute = "/" + absolute.lstrip("/")
    if is_dir and absolute != "/":
        absolute += "/"
    flags = "".join(f" --{k}={v}" for k, v in (("chown", chown), ("chmod", ins.flags.get("chmod")))
                    if v is not None)
    text = f"{cmd}{flags} {json.dumps(sources)} {absolute}"
    return Step(n, ins, COPY, text, scope.config, sources=sources, dest=absolute, chown=chown,
                chmod=chmod, add=cmd == "ADD")
