"""Task policies: which files, TCP ports, signals and abstract unix sockets
one exec may use, enforced by Landlock (docs/hardening.md, "Task policies").

An RL agent and its grader share a sandbox but not its secrets: the agent's
execs run under a policy that hides the grader's files, keeps the system
read-only and scopes signals and abstract sockets to the exec's own
processes, while a grader exec in the same sandbox runs under another one.

A policy is a [policy.<name>] table of the daemon's config or an inline
dict in a request, with these fields (all optional):

    read_only            paths that may be read, listed and executed, not changed
    writable             paths with every file right (create, write, remove, rename, ...)
    hidden               paths with no right at all: not read, listed, executed or changed
    rest                 what every path not named gets: "read_only" (default), "writable", "hidden"
    tcp_bind             TCP ports the exec may bind; absent: any
    tcp_connect          TCP ports the exec may connect to; absent: any
    scope_signals        true: no signal reaches a process outside the exec's own
    scope_abstract_unix  true: no connect or send to an abstract unix socket
                         of a process outside the exec's own
    capabilities         the capabilities the exec keeps, a subset of
                         sandbox.capabilities (absent: all of those); not
                         Landlock, but what closes its gaps below

A path takes the level of the longest named path it is under (or `rest`).
`parse` validates (errors name the field), `Policy.needs` says which Landlock
ABI each field in use needs, `compile` turns a policy into the rule plan that
csrc/policy_steps.h applies in the exec's child before execve.

How "hidden" is built. Landlock only grants: a process's rights on a path
are the union of the rules on the path and on every directory above it, so
no rule can take back below a directory what a rule on it gave. A hidden
path's ancestors therefore get no rule that would reach it: they keep only
the rights every named path below them shares (for a hidden path: none),
and the rights their other children should have are granted on each of
those children, one rule each (`CHILDREN` in the plan: the exec's child
lists the directory when it starts, so the set is the one it finds then).
The same holds for any path that gets fewer rights than its parent (a
read-only dir inside a writable one). The price: a hidden path's ancestors
themselves cannot be listed, nor can anything be created, removed or renamed
directly in them (`ls /` fails for an agent that has `/grader` hidden), and
an entry that appears in them after the exec started gets no rights for
that exec.

What Landlock does not cover, up to ABI 7 (the kernel decides, not this
module): stat(2) and path walks (a hidden path's existence, size and mode
show to stat), chdir, and metadata changes (chmod, chown, utimes, xattrs)
of files the caller owns or holds CAP_FOWNER/CAP_CHOWN over: root in the
sandbox can still chmod a read-only or hidden file. Where that matters, run
the agent as a non-root user (create --user) under a policy with
`capabilities = []` and keep the grader's files root-owned 0700: file modes
then refuse the stat and the chmod. Only TCP is covered by `tcp_*` (UDP is not).
"""

from __future__ import annotations

import posixpath
import re
import struct
from dataclasses import dataclass

from .caps import cap_mask

# ---------------------------------------------------------------- Landlock ABI (linux/landlock.h)

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13        # ABI 2: link or rename across directories
FS_TRUNCATE = 1 << 14     # ABI 3: truncate, open(O_TRUNC), ftruncate
NET_BIND_TCP = 1 << 0     # ABI 4
NET_CONNECT_TCP = 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX = 1 << 0   # ABI 6
SCOPE_SIGNAL = 1 << 1          # ABI 6

# Every file right a policy handles. IOCTL_DEV (ABI 5) is left unhandled:
# device ioctls are not part of a policy's vocabulary, and handling it would
# take them away from read-only /dev/tty users. Handled rights nobody is
# granted are denied, so read-only must include truncate's denial: that is
# why file rules need ABI 3 (before it, truncate(2) was not checked at all).
FS_ALL = (1 << 15) - 1
READ_ONLY = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
LEVELS = {"hidden": 0, "read_only": READ_ONLY, "writable": FS_ALL}
# What a rule on a non-directory may carry (the kernel refuses directory rights there).
FS_FILE = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE

# The Landlock ABI each field needs when it restricts anything (`dsec info`).
FIELD_ABI = {"read_only": 3, "writable": 3, "hidden": 3, "rest": 3, "tcp_bind": 4, "tcp_connect": 4,
             "scope_signals": 6, "scope_abstract_unix": 6}
FIELDS = (*FIELD_ABI, "capabilities")       # capabilities: enforced by the exec's capability sets

# ---------------------------------------------------------------- the plan's wire format
# (csrc/dsec_native.h: struct dsec_policy_head, _port, _path; applied by csrc/policy_steps.h)

MAGIC = 0x64737031            # "dsp1"
RULE, CHILDREN = 0, 1         # DSEC_POLICY_RULE, DSEC_POLICY_CHILDREN
MAX_BYTES = 16384             # DSEC_POLICY_MAX_BYTES
MAX_PATHS = 256               # named paths in one policy
_HEAD = struct.Struct("=IIIIQQQ")    # magic, n_ports, n_paths, restrict_flags, handled fs, net, scoped
_PORT = struct.Struct("=QQ")         # port, access
_PATH = struct.Struct("=QIIII")      # access, kind, n_except, strings_len, reserved

NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
INLINE = "inline"             # the name events and errors give a policy sent in a request


class PolicyError(ValueError):
    """A policy that is malformed (`field` names what is wrong, as
    `policy.<name>.<field>[i]`), or that this kernel cannot enforce
    (`unsupported`: the fields and the ABI they need)."""

    def __init__(self, message: str, field: str, unsupported: dict | None = None):
        super().__init__(message)
        self.field = field
        self.unsupported = unsupported


@dataclass(frozen=True)
class Policy:
    name: str
    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    rest: str = "read_only"
    tcp_bind: tuple[int, ...] | None = None        # None: not restricted
    tcp_connect: tuple[int, ...] | None = None
    scope_signals: bool = False
    scope_abstract_unix: bool = False
    capabilities: tuple[str, ...] | None = None    # None: the sandbox's

    def spec(self) -> dict:
        """The policy as a request or a journal record carries it (no name)."""
        out: dict = {"read_only": list(self.read_only), "writable": list(self.writable),
                     "hidden": list(self.hidden), "rest": self.rest,
                     "scope_signals": self.scope_signals, "scope_abstract_unix": self.scope_abstract_unix}
        for key in ("tcp_bind", "tcp_connect", "capabilities"):
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value)
        return out

    def cap_keep(self, sandbox_caps: int) -> int:
        """The capability mask an exec under it keeps: the sandbox's, narrowed."""
        if self.capabilities is None:
            return sandbox_caps
        return sandbox_caps & cap_mask(list(self.capabilities), f"policy.{self.name}.capabilities")

    def restricts(self) -> bool:
        """Whether it takes anything away (else an exec runs without Landlock)."""
        return bool(self.handled_fs() or self.tcp_bind is not None or self.tcp_connect is not None
                    or self.scope_signals or self.scope_abstract_unix)

    def handled_fs(self) -> int:
        """The file rights the ruleset restricts: all of them once anything is
        narrower than writable, none otherwise (`writable` alone is a no-op)."""
        return FS_ALL if self.rest != "writable" or self.read_only or self.hidden else 0

    def needs(self) -> dict[str, int]:
        """Field -> the Landlock ABI it needs, for the fields that restrict something."""
        used = {}
        if self.handled_fs():
            used.update((f, FIELD_ABI[f]) for f in ("read_only", "writable", "hidden", "rest")
                        if f == "rest" or getattr(self, f))
        for f in ("tcp_bind", "tcp_connect"):
            if getattr(self, f) is not None:
                used[f] = FIELD_ABI[f]
        for f in ("scope_signals", "scope_abstract_unix"):
            if getattr(self, f):
                used[f] = FIELD_ABI[f]
        return used

    def check(self, abi: int) -> None:
        """PolicyError (with `unsupported`) if the kernel's Landlock ABI (0 or
        less: none) cannot enforce every field in use: a policy is enforced
        whole or not at all."""
        short = {f: need for f, need in self.needs().items() if need > abi}
        if short:
            have = f"Landlock ABI {abi}" if abi > 0 else "no Landlock"
            what = ", ".join(f"{f} (ABI >= {need})" for f, need in sorted(short.items()))
            raise PolicyError(f"policy {self.name!r} cannot be enforced on this kernel ({have}): it uses "
                              f"{what}; drop those fields or run it on a newer kernel (see `dsec info`)",
                              f"policy.{self.name}", {"abi": abi, "needs": short})

    def plan(self) -> list[tuple[int, str, int, tuple[str, ...]]]:
        """The rules, as (kind, path, access, except): RULE grants `access` on
        `path` (and beneath it); CHILDREN grants it on each entry of the
        directory `path` but the names in `except` (see the module's
        docstring). Applied in order by csrc/policy_steps.h."""
        if not self.handled_fs():
            return []
        want = {"/": LEVELS[self.rest]}
        for level in ("read_only", "writable", "hidden"):
            for p in getattr(self, level):
                want[p] = LEVELS[level]
        kids: dict[str, set[str]] = {}         # the trie of named paths: dir -> next names below it
        for p in want:
            while p != "/":
                parent, name = posixpath.split(p)
                kids.setdefault(parent, set()).add(name)
                p = parent
        out: list[tuple[int, str, int, tuple[str, ...]]] = []

        def below(node: str) -> int:
            """The rights every named path strictly below node has (all, if none)."""
            acc = FS_ALL
            for name in kids.get(node, ()):
                child = posixpath.join(node, name)
                acc &= want.get(child, FS_ALL) & below(child)
            return acc

        def visit(node: str, granted: int, level: int) -> None:
            floor = level & below(node)      # what may be granted on node itself
            if floor & ~granted:
                out.append((RULE, node, floor & ~granted, ()))
            names = tuple(sorted(kids.get(node, ())))
            if floor != level:
                out.append((CHILDREN, node, level & ~floor, names))
            for name in names:
                child = posixpath.join(node, name)
                visit(child, floor, want.get(child, level))

        visit("/", 0, want["/"])
        return out

    def compile(self) -> bytes | None:
        """The plan in the wire format csrc/policy_steps.h reads (struct
        dsec_policy_head, then ports, then paths); None if the policy restricts
        nothing (the exec then runs without a Landlock domain)."""
        if not self.restricts():
            return None
        ports: dict[int, int] = {}
        for key, right in (("tcp_bind", NET_BIND_TCP), ("tcp_connect", NET_CONNECT_TCP)):
            for port in getattr(self, key) or ():
                ports[port] = ports.get(port, 0) | right
        handled_net = ((NET_BIND_TCP if self.tcp_bind is not None else 0)
                       | (NET_CONNECT_TCP if self.tcp_connect is not None else 0))
        scoped = ((SCOPE_SIGNAL if self.scope_signals else 0)
                  | (SCOPE_ABSTRACT_UNIX if self.scope_abstract_unix else 0))
        plan = self.plan()
        parts = [_HEAD.pack(MAGIC, len(ports), len(plan), 0, self.handled_fs(), handled_net, scoped)]
        parts += [_PORT.pack(port, access) for port, access in sorted(ports.items())]
        for kind, path, access, names in plan:
            strings = b"".join(s.encode() + b"\0" for s in (path, *names))
            strings += b"\0" * (-len(strings) % 8)           # each entry starts 8-byte aligned
            parts.append(_PATH.pack(access, kind, len(names), len(strings), 0) + strings)
        blob = b"".join(parts)
        if len(blob) > MAX_BYTES:
            raise PolicyError(f"policy {self.name!r} compiles to {len(blob)} bytes of rules, more than "
                              f"{MAX_BYTES}: name fewer or shorter paths", f"policy.{self.name}")
        return blob


# ---------------------------------------------------------------- parsing and validation


def parse(name: str, table: object, where: str | None = None) -> Policy:
    """A policy from its config table or inline dict; PolicyError naming the
    field (`where` prefixes it: "policy.agent" for a config table)."""
    where = where or f"policy.{name}"
    if not isinstance(table, dict):
        raise PolicyError(f"{where}: a policy is a table (dict) of {', '.join(FIELDS)}, "
                          f"got {type(table).__name__}", where)
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise PolicyError(f"{where}.{unknown[0]}: unknown policy field; the fields are {', '.join(FIELDS)}",
                          f"{where}.{unknown[0]}")
    lists = {level: _paths(table.get(level, []), f"{where}.{level}") for level in ("read_only", "writable",
                                                                                 "hidden")}
    seen: dict[str, str] = {}
    for level, paths in lists.items():
        for i, p in enumerate(paths):
            if p in seen:
                raise PolicyError(f"{where}.{level}[{i}]: {p!r} is also in {seen[p]}; a path has one level",
                                  f"{where}.{level}[{i}]")
            seen[p] = f"{where}.{level}"
    if sum(map(len, lists.values())) > MAX_PATHS:
        raise PolicyError(f"{where}: more than {MAX_PATHS} paths", where)
    rest = table.get("rest", "read_only")
    if rest not in LEVELS:
        raise PolicyError(f"{where}.rest: must be one of {', '.join(LEVELS)}, got {rest!r}", f"{where}.rest")
    if "/" in seen:
        raise PolicyError(f"{seen['/']}: name the level of / with `rest`, not as a path", seen["/"])
    flags = {}
    for key in ("scope_signals", "scope_abstract_unix"):
        value = table.get(key, False)
        if not isinstance(value, bool):
            raise PolicyError(f"{where}.{key}: must be true or false, got {value!r}", f"{where}.{key}")
        flags[key] = value
    return Policy(name=name, rest=rest, tcp_bind=_ports(table, "tcp_bind", where),
                  tcp_connect=_ports(table, "tcp_connect", where), capabilities=_caps(table, where),
                  **{k: tuple(v) for k, v in lists.items()}, **flags)


def _caps(table: dict, where: str) -> tuple[str, ...] | None:
    value = table.get("capabilities")
    if value is None:
        return None
    field = f"{where}.capabilities"
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise PolicyError(f"{field}: must be a list of capability names (e.g. [\"NET_BIND_SERVICE\"]; [] keeps "
                          f"none), got {value!r}", field)
    try:
        cap_mask(value, field)
    except ValueError as err:
        raise PolicyError(f"{field}: {err}", field) from err
    return tuple(sorted({c.upper().removeprefix("CAP_") for c in value}))


def _paths(value: object, where: str) -> list[str]:
    if not isinstance(value, list):
        raise PolicyError(f"{where}: must be a list of absolute paths, got {type(value).__name__}", where)
    out = []
    for i, p in enumerate(value):
        field = f"{where}[{i}]"
        if not isinstance(p, str) or not p.startswith("/"):
            raise PolicyError(f"{field}: must be an absolute path inside the sandbox, got {p!r}", field)
        if "\0" in p or len(p.encode()) >= 4096:
            raise PolicyError(f"{field}: must be a path of less than 4096 bytes without NUL, got {p[:80]!r}",
                              field)
        norm = "/" + posixpath.normpath(p).lstrip("/")     # normpath keeps a leading "//"
        if norm != p:
            raise PolicyError(f"{field}: write {p!r} as a normalized path (no '.', '..', '//' or "
                              f"trailing '/'): {norm!r}", field)
        out.append(norm)
    return out


def _ports(table: dict, key: str, where: str) -> tuple[int, ...] | None:
    value = table.get(key)
    if value is None:
        return None
    field = f"{where}.{key}"
    if not isinstance(value, list):
        raise PolicyError(f"{field}: must be a list of TCP ports (an empty list allows none; leave the "
                          f"field out to allow all), got {type(value).__name__}", field)
    for i, port in enumerate(value):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise PolicyError(f"{field}[{i}]: must be a port number in 0..65535, got {port!r}", f"{field}[{i}]")
    return tuple(sorted(set(value)))


def named(tables: object) -> dict[str, Policy]:
    """The config's [policy.<name>] tables, each parsed; PolicyError naming
    the first bad one."""
    if not isinstance(tables, dict):
        raise PolicyError("policy: must be tables [policy.<name>]", "policy")
    out = {}
    for name, table in tables.items():
        if not NAME.match(name) or name == INLINE:
            raise PolicyError(f"policy.{name}: a policy name is 1-64 lowercase letters, digits, - and _, "
                              f"starting with a letter (and not {INLINE!r})", f"policy.{name}")
        out[name] = parse(name, table)
    return out
