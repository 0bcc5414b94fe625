"""Python SDK: an asyncio client, and `SyncClient` for scripts.

    async with dsecd.Client() as c:
        r = await c.run("busybox", ["echo", "hi"])      # like docker run --rm: r.exit_code, r.stdout
        sb = await c.create(image="busybox", cpu=0.5, memory="256M")
        r = await sb.exec(["sh", "-c", "echo hi"], timeout=10)
        async for fd, data in sb.exec_stream(["make"]):   # streaming
            ...
        await sb.write_file("/work/a.py", b"print(1)")
        await sb.destroy()

One connection carries many requests at once (each has its own id); a reader
task routes every incoming frame to the request that owns its id. Errors from
the daemon are raised as dsecd.errors.DsecError subclasses.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import grp
import inspect
import io
import itertools
import logging
import math
import os
import posixpath
import secrets
import tempfile
import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from . import framing, imageconfig, localcopy, protocol, remote, unixsock
from .config import parse_duration
from .errors import BadRequest, Conflict, ConnectionLost, DsecError, LimitExceeded, NotFound
from .unixsock import DEFAULT_SOCKET, default_socket  # noqa: F401 (the SDK's names, as before)

DEFAULT_CHUNK = 4 << 20
# File chunks in flight at once in write_file and read_file: two overlap one
# chunk's trip with the daemon's (or the sandbox copier's) work on the other;
# more only contend for a small host's cores (64 MiB on 2 cores, written:
# 249-463 MiB/s one at a time, 337-558 two, 326-416 three; read as frame
# tails: 406-438 one at a time, 446-463 two).
PIPELINE = 2
# How many times read_file reads a file again that was replaced while it read it.
READ_AGAIN = 3
# A server frame may exceed max_frame_bytes by its envelope (id, field names).
FRAME_SLACK = 4096
# Big-frame buffers a connection keeps for reuse (framing.FrameProtocol).
FRAME_BUFFERS_KEPT = 4
# Requests that steer others (stdin for an exec, a cancel) never wait for a
# slot: the requests they serve may hold every slot. This many of the
# daemon's per-connection limit are kept for them.
CONTROL_OPS = ("exec_input", "exec_resize", "exec_signal", "file_tar_input", "cancel")
CONTROL_SLOTS = 8
# Requests that follow something until it ends or they are closed (a
# watch, events, a background process's output): they may take all but
# this many of the other slots, so that they can never leave none for the
# requests that end them (a process's stdin, a destroy).
SHORT_SLOTS = 32
# The lease of a sandbox Client.run makes and removes: renewed while the
# command runs, so a client that dies without removing it (SIGKILL, a lost
# host) leaves it to the daemon, which destroys it this long after.
RUN_LEASE_S = 60.0
# A request the daemon refused for its in-flight limit is sent again after
# this long, doubled at each refusal up to the max.
REFUSED_AGAIN_S = 0.005
REFUSED_AGAIN_MAX_S = 0.2
# A create abandoned after it was sent (cancelled, timed out): how long the
# caller's cancel waits for the daemon's answer and, if the sandbox was made
# all the same, for its destroy (one or two round trips, normally).
ABANDONED_CREATE_WAIT_S = 10.0
# Requests whose abandonment (a cancel, a timeout) waits for their final
# frame, as a create's does: an exec's comes once the daemon no longer
# counts it as running (a destroy without force right after is not refused
# for it); a directory copy's once the daemon has removed its partial
# tree; a remove's once it has stopped; a snapshot's once its pack has ended unpublished and the sandbox
# is thawed; a pause's or resume's (of a sandbox or a job: once begun, they
# finish) once it has, so that the next request is not overtaken by its
# freeze or thaw; a background process's may say it was started (the
# daemon was done before the cancel landed), and it is then killed. So the
# caller's cancel returns with nothing of it left or under way. Waited for
# ABANDONED_CREATE_WAIT_S at most (close() waits for the rest).
SETTLED_WHEN_ABANDONED = ("exec", "file_tar_put", "file_remove", "proc_start", "snapshot", "pause", "resume",
                          "job_pause", "job_resume")
# Requests that only read (file ops resume a paused sandbox, memory.auto_resume:
# sent again, they find it running): one whose connection was lost after it
# was sent is sent again, once, on the next connection (reconnect=True), as
# one never sent is, so that a Process.wait() or an inspect outlives a daemon
# restart. Those that stream what they read (FOLLOWS_ONLY) are not: what came
# before the loss would come again; their error says they are safe to send again.
CHANGES_NOTHING = ("ping", "info", "image_du", "image_list", "image_inspect", "policy_list", "top", "list",
                   "inspect", "proc_list", "proc_wait", "file_read", "file_list", "file_stat", "net_show",
                   "net_sets", "pool_list")
FOLLOWS_ONLY = ("proc_logs", "events", "file_watch", "file_tar_get")
# Requests that change something, but whose second run changes nothing more
# (the daemon's pause of a paused sandbox, resume of a running one; a renew
# sets each lease to end `lease` from now, as a renew made then would):
# sent again, once, as those that only read are, the sandbox ends as asked.
# So Client.hold's renew in flight at a daemon restart renews on the next
# daemon instead of failing.
IDEMPOTENT = ("pause", "resume", "renew")
# Requests the daemon takes an idempotency key for (an exec without stdin
# or pty): one lost after it was sent goes again, once, with its key, and
# the daemon answers it with what the first one did (a create's sandbox, an
# exec's result, the process started, the image made) instead of doing it
# twice; a streamed exec goes again after each loss a frame came before,
# taking its output up where it stopped (frames_with_id). The SDK gives
# each one a key of its own (_made_key) where the daemon takes them: a
# create always, the others where its hello lists "op.keys" (a streamed
# exec: "op.keys.stream"), an exec over ssh:// only (Client.key_execs).
KEYED = ("create", "exec", "proc_start", "snapshot")
# Of those, ones whose frames before the result are progress only: the
# request sent again streams the progress of the one under way from there
# on (the daemon sends it to every request of the key waiting), so they
# tell nothing false.
PROGRESS_FRAMES = ("snapshot",)
# A lost connection is made again at the next request (reconnect=True):
# while the daemon does not answer (a restart: no socket, or refused), tries
# this far apart at first, doubled after each failure up to the max, for
# the Client's reconnect_timeout at most.
RECONNECT_GAP_S = 0.05
RECONNECT_GAP_MAX_S = 1.0
# A follow taken up again after each lost connection (Client.events,
# Sandbox.watch, Process.output) ends once it was lost this many times in
# a row with no frame of it come: the daemon takes the connection and
# drops the request, every time (it fails on it), and asking again would
# go on for ever. A daemon restart with nothing since is such a loss too,
# so a few in a row are let through; an attach that lived
# FOLLOW_ATTACHED_S before its loss was a follow the daemon took, and
# counts again from none.
FOLLOW_LOST_MAX = 8
FOLLOW_ATTACHED_S = 10.0
# A local daemon that sends nothing while requests wait on it (stopped by
# SIGSTOP, state T; its event loop wedged) held them for ever: a unix
# socket does not time out. The Client gives its connection up after this
# long of such silence, its pings unanswered (_watch_silence; the Client's
# silence_timeout, DSEC_SILENCE_TIMEOUT). A busy daemon answers a ping from
# its event loop: during a 2,000-sandbox burst on a 2-core host, within
# 126-212 ms at most while creating, 424-520 ms while destroying them all
# (bench/ping_in_burst.py, 16 and 64 clients). 10 s is also how long a loop
# goes without turning before the daemon reports itself stalled
# (looplag.STALL_REPORT_S).
LOCAL_SILENCE_S = 10.0
# The pings sent in that window: one after each 1/LOCAL_PINGS of it.
LOCAL_PINGS = 5
# How soon Client.hold renews again after a renew found the connection gone.
HOLD_RETRY_S = 1.0
# The most bytes of a followed background process's output (Process.output)
# a client holds for a reader that is behind: past it, what comes is
# dropped and counted, as the daemon's own ring (limits.proc_output_bytes,
# 1M by default) drops what a follower too slow for it missed.
FOLLOWED_OUTPUT_BYTES = 16 << 20
# What a frame held for such a reader counts besides its data (its dict, its
# bytes object, its place in the queue).
PENDING_FRAME_COST = 512

# A command as exec, exec_stream, spawn and call take it (command_argv): a
# string run by /bin/sh -c, or a list (or tuple) of arguments, each a str or
# bytes.
Command = str | Sequence[str | bytes]
# An exec's stdin: bytes-like, or an async iterable of bytes (ExecStream).
Stdin = bytes | bytearray | memoryview | AsyncIterable[bytes]

log = logging.getLogger(__name__)


def _who_may_connect(path: str) -> str:
    """What a refused user needs, from the socket's group (the daemon sets its
    mode 0660, group `daemon.socket_group`, and checks SO_PEERCRED the same way)."""
    try:
        gid = os.stat(path).st_gid
    except OSError:
        return (f"this user may not enter {os.path.dirname(path) or '.'}, where the socket is: "
                "run dsec as root")
    if gid == 0:
        return ("the daemon's socket admits root only: run dsec as root, or set daemon.socket_group "
                "in the daemon's config and join that group")
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return (f"the daemon's socket admits root and members of group {group!r} "
            f"(daemon.socket_group): run dsec as root, or `usermod -aG {group} USER` and log in again")


def local_silence_timeout(given: float | str | None = None) -> float:
    """The silence watch's window on a local socket (LOCAL_SILENCE_S): `given`
    (seconds, or a duration such as "30s"), else DSEC_SILENCE_TIMEOUT, else
    the default; 0 (or "off") turns the watch off."""
    what = "silence_timeout"
    if given is None:
        given, what = os.environ.get("DSEC_SILENCE_TIMEOUT") or None, "DSEC_SILENCE_TIMEOUT"
    if given is None:
        return LOCAL_SILENCE_S
    if given in (0, "0", "off"):
        return 0.0
    return parse_duration(given, f"{what} (0 or off: no watch)")


def command_argv(command) -> list[str | bytes]:
    """A command as the daemon's argv: a list, tuple or other sequence of
    strings (Command) as it is, a string run by /bin/sh -c (as `docker exec
    SB sh -c '...'` would). An argument may be bytes (a file name that is
    not UTF-8, as os.listdir(b".") gives it), or the str os.fsdecode makes
    of them: both reach execve as those bytes."""
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    # A sequence of arguments, not one of bytes' ints (b"ls" is no command).
    words = isinstance(command, Sequence) and not isinstance(command, (bytes, bytearray, memoryview))
    if words and all(isinstance(a, (str, bytes)) for a in command):
        return list(command)
    raise TypeError(f"a command must be a list of strings or a shell string (an argument may be bytes), "
                    f"got {type(command).__name__}"
                    + (f" holding {type(next(a for a in command if not isinstance(a, (str, bytes)))).__name__}"
                       if words else ""))


def _read_dockerfile(path: str, default: bool) -> str:
    """The Dockerfile at `path` (CONTEXT/Dockerfile where `default`), read
    here, on the client's side; an error names it and how it was found."""
    if default:
        where = " (without -f, the build reads CONTEXT/Dockerfile; give another with -f)"
    elif not os.path.isabs(path):
        where = f" (a relative -f is read from the current directory, {os.getcwd()})"
    else:
        where = ""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise BadRequest(f"the Dockerfile {path} is not UTF-8 text (byte {err.start}: {err.reason}); "
                         "is it the Dockerfile?", {"dockerfile": path}) from None
    except FileNotFoundError:
        raise NotFound(f"read the Dockerfile {path}: No such file or directory{where}",
                       {"dockerfile": path}) from None
    except OSError as err:
        raise BadRequest(f"read the Dockerfile {path}: {err.strerror or err}{where}",
                         {"dockerfile": path}) from None


def string_map(values: dict | None, what: str, raw: bool = False) -> dict[str, str]:
    """`values` (env, labels) checked to be str -> str, with the key and type
    that is not. raw: bytes are strings too (a command's environment: what
    execve takes is bytes, and a value read from a file need not be UTF-8)."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise TypeError(f"{what} must be a dict of str to str, got {type(values).__name__}")
    kinds = (str, bytes) if raw else str
    for key, value in values.items():
        if not isinstance(key, kinds):
            raise TypeError(f"{what} keys must be str, got {type(key).__name__} {key!r}")
        if not isinstance(value, kinds):
            raise TypeError(f"{what}[{key!r}] must be a str, got {type(value).__name__} {value!r}; "
                            f"convert it, e.g. str({value!r})")
    return dict(values)


def file_data(data, what: str) -> bytes | bytearray | memoryview:
    """`data` checked to be bytes-like: a str (or anything else) is a
    TypeError saying how to make bytes of it, not memoryview's own."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    if isinstance(data, str):
        raise TypeError(f"{what}: data must be bytes (got str): encode it, e.g. data.encode()")
    raise TypeError(f"{what}: data must be bytes (got {type(data).__name__}): convert it, e.g. bytes(data)")


def file_pieces(data, size: int, what: str) -> AsyncIterator[bytes | memoryview]:
    """What write_file takes (bytes-like; a binary file open for reading; an
    async iterable of bytes) as pieces of `size` bytes, the last one
    shorter: one empty piece for no bytes at all. Only bytes-like data is
    held whole; from a file or an iterable, one piece at a time."""
    if inspect.iscoroutinefunction(getattr(data, "read", None)):
        # An asyncio StreamReader (a subprocess's stdout): read by size. Its
        # own iteration goes by lines, and fails on 64 KiB without a newline.
        return _reader_pieces(data, size, what)
    if hasattr(data, "__aiter__"):
        return _regrouped(data, size, what)
    if hasattr(data, "read"):
        return _file_pieces(data, size, what)
    return _view_pieces(file_data(data, what), size)


async def _view_pieces(data, size: int) -> AsyncIterator[memoryview]:
    view = memoryview(data)
    for start in range(0, max(len(view), 1), size):
        yield view[start:start + size]


def _file_pieces(f, size: int, what: str) -> AsyncIterator[bytes]:
    """A file's reads as pieces of `size` bytes (_reader_pieces)."""
    return _reader_pieces(_InThreads(f, what), size, what)


class _InThreads:
    """A binary file's read as a coroutine, each in a thread (a pipe's may
    block, a disk's take a while): the loop runs meanwhile. (asyncio.run
    waits for that thread at its end: a read of a pipe nobody writes to
    holds it up.)"""

    def __init__(self, f, what: str):
        self.f, self.what = f, what

    async def read(self, n: int) -> bytes:
        loop = asyncio.get_running_loop()
        while True:
            got = await loop.run_in_executor(None, self.f.read, n)
            if got is None:             # a non-blocking file with nothing yet
                await asyncio.sleep(0.01)
                continue
            if not isinstance(got, (bytes, bytearray)):
                raise TypeError(f"{self.what}: the file must be opened in binary mode ('rb'); its read gave "
                                f"{type(got).__name__}")
            return got


async def _reader_pieces(reader, size: int, what: str) -> AsyncIterator[bytes]:
    """`await reader.read(n)` until it gives b"", as pieces of `size` bytes."""
    piece, given = bytearray(), False
    while True:
        got = file_data(await reader.read(size - len(piece)), what)
        piece += got
        if len(piece) == size or (not got and (piece or not given)):
            yield bytes(piece)
            piece, given = bytearray(), True
        if not got:
            return


async def _as_they_come(chunks, size: int) -> AsyncIterator[bytes | bytearray | memoryview]:
    """An async iterable's chunks as they come, none empty, one past `size` in
    pieces of it. The iterable is closed (aclose) when this ends, read to its
    end or not: a put that failed half way leaves no generator of the
    caller's suspended until garbage collection."""
    try:
        async for got in chunks:
            got = file_data(got, "upload_tar")
            for start in range(0, len(got), size):
                yield got[start:start + size]
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


async def _regrouped(chunks, size: int, what: str) -> AsyncIterator[bytes]:
    """An async iterable's chunks of any size as pieces of `size` bytes."""
    buf, given = bytearray(), False
    async for got in chunks:
        buf += file_data(got, what)
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
            given = True
    if buf or not given:
        yield bytes(buf)


# What the daemon's write errors say of a file a failed write left part of
# (engine/copier.py, engine/vmfiles.py).
PARTLY_WRITTEN = "the file is partly written"


class Listing(list):
    """list_files' entries, and whether the listing was cut short (`truncated`)."""

    truncated = False


def _paths(result: dict) -> dict:
    """A file op's result (or a listing's entry, a watch event) with the
    paths and names it holds as os.listdir gives them: one that is not
    UTF-8 comes from the daemon as bytes, and is os.fsdecode's str again."""
    for key in ("path", "src", "dst", "target", "name"):
        if isinstance(result.get(key), bytes):
            result[key] = os.fsdecode(result[key])
    return result


def _protocol_arg(proto: str) -> dict:
    """net_publish's and net_unpublish's `protocol`, sent only when it is not
    TCP (the default): a daemon that publishes TCP only knows no such field
    and would refuse the request for it."""
    proto = protocol.check_protocol(proto)
    return {} if proto == "tcp" else {"protocol": proto}


def _port_arg(port: int | str, proto: str | None) -> tuple[int, str]:
    """A sandbox's port as the SDK takes it: 5353 with `proto` (TCP when
    None), or "5353/udp" as create's `publish` and `dsec port` take it, whose
    protocol `proto` must then not contradict. BadRequest, before anything
    is sent, for anything else."""
    number, named = protocol.published_port(port)
    if proto is None:
        return number, named
    proto = protocol.check_protocol(proto)
    if isinstance(port, str) and "/" in port and named != proto:
        raise BadRequest(f"port {port!r} is {named}, but protocol {proto!r} was given", {"port": port})
    return number, proto


def _publish_spec(spec: int | str) -> int | str:
    """A port of create's `publish` as sent: a TCP port as its number (what
    every daemon takes), else "PORT/PROTOCOL"."""
    port, proto = protocol.published_port(spec)
    return port if proto == "tcp" else f"{port}/{proto}"


def _sandbox_info(info: dict) -> dict:
    """A sandbox's create, inspect or list entry with its env and cwd as
    create took them: a name, value or path that is not UTF-8 comes as
    bytes, and is os.fsdecode's str again (what os.environ would hold)."""
    if isinstance(info.get("cwd"), bytes):
        info["cwd"] = os.fsdecode(info["cwd"])
    env = info.get("env")
    if isinstance(env, dict) and any(isinstance(k, bytes) or isinstance(v, bytes) for k, v in env.items()):
        info["env"] = {os.fsdecode(k) if isinstance(k, bytes) else k: os.fsdecode(v) if isinstance(v, bytes) else v
                       for k, v in env.items()}
    return info


def named_as(err: DsecError, tmp: str, path: str, removed: bool = False,
             verb: tuple[str, str] | None = None) -> DsecError:
    """`err`, met on a temporary path `tmp` (an atomic write's file, a
    copy's landing directory), as the caller sees it: naming `path`, the one
    they gave; same class, code and detail
    (`errno` kept), `detail["path"]` the target's (the daemon's spelling,
    `sandbox:path`, where it gave one). removed: `tmp` was removed, so what
    the daemon said was "partly written" is gone and `path` is as it was.
    verb: (the request's, the caller's), e.g. ("rename", "write"): the
    message's first word said as what the caller asked for."""
    def rename(text: str) -> str:
        return text.replace(f"{tmp} -> {path}", path).replace(tmp, path)

    message = err.message
    if verb is not None and message.startswith(f"{verb[0]} "):
        message = f"{verb[1]} {message[len(verb[0]) + 1:]}"
    if removed:
        message = message.replace(PARTLY_WRITTEN, f"{path} is as it was (the part written was removed)")
    detail = {k: rename(v) if isinstance(v, str) else v for k, v in err.detail.items()}
    detail.setdefault("path", path)
    named = type(err)(rename(message), detail)
    named.code = err.code
    return named


def _count_output(got: list[int], frame: dict) -> None:
    """Add a streamed exec's output frame to `got`, the bytes of [stdout,
    stderr] that came (a `lost` count included: the daemon takes the
    stream up after it)."""
    fd = frame.get("fd")
    if fd in (1, 2):
        got[fd - 1] += len(frame["data"]) if frame.get("data") is not None else frame.get("lost", 0)


def _given(args: dict, /, **optional) -> dict:
    """`args` plus those optional arguments that were given (not None): the daemon applies its defaults."""
    args.update((k, v) for k, v in optional.items() if v is not None)
    return args


def lost_after_sending(op: str, key: str | None = None) -> str:
    """What a connection lost after `op` was sent leaves open, for its error;
    `key`: its idempotency key, if it was sent with one."""
    if op == "create":
        return "; the create may have been carried out (sent again with the same idempotency key, it is safe)"
    if key and op in KEYED:
        return (f"; the request may have been carried out, and runs on if it was: sent again with its "
                f"idempotency key {key!r} (key={key!r}), it is answered with what it did, or waits for it, "
                "instead of running again")
    if op in CHANGES_NOTHING or op in FOLLOWS_ONLY:
        return "; it changes nothing, so it is safe to send again"
    if op in IDEMPOTENT:
        return "; it may have been carried out, and is safe to send again (done twice, it is done once)"
    if op == "exec":
        # The daemon kills the execs of a connection that ends, and the next
        # daemon those of one that died: none outlives its connection.
        return ("; the request may have been carried out: the command may have run, in part, and no longer "
                "runs (the daemon kills the execs of a connection that ends; a background process, "
                "spawn or dsec exec -d, outlives it)")
    return "; the request may have been carried out"


def _made_key() -> str:
    """An idempotency key for a create (or an exec, proc_start or snapshot:
    KEYED) given none. The daemon answers a request of a key it has seen
    with what that key's request did, so the SDK may send such a request
    again after losing its connection (a daemon restart, an ssh:// link
    cut) without doing it twice; without a key, a create whose answer was
    lost leaves a sandbox nobody knows the id of, and an exec's command may
    have run, or not."""
    return f"sdk-{secrets.token_hex(10)}"


def _with_key(args: dict, key: str | None, make: bool) -> bool:
    """Put idempotency key `key` in a request's `args`, or, given none and
    `make` (the daemon takes one), a key the SDK makes: whether it made it."""
    made = make and key is None
    if made:
        key = _made_key()
    if key is not None:
        args["key"] = key
    return made


def _sent_or_not(op: str, sent: bool, key: str | None = None) -> str:
    """What a lost connection leaves open of `op` (sent with idempotency key
    `key`, if any), for its error: whether it may have run (`sent`), or that
    it did not."""
    return lost_after_sending(op, key) if sent else "; the request was not sent, so it did not run"


@dataclass
class ExecResult:
    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    cancelled: bool
    duration_ms: float
    trace: dict | None = None        # with exec(trace=True): the ptrace record
    policy: str | None = None        # the task policy it ran under (a name, "inline"; None: none)
    denials: int | None = None       # its policy denials, when counted (dsec info: policy.denials)
    killed_by: str | None = None     # SIGKILLed, not at its timeout: "oom" (memory limit), "destroy", None: unknown
    destroyed_by: str | None = None  # with killed_by "destroy", why: "ttl", "idle_ttl", "lease", "request", ...
    # A streamed exec taken up again after a lost connection: bytes of its
    # output the daemon no longer had for it (not in stdout, stderr, or given to a callback).
    lost_output: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @classmethod
    def from_result(cls, r: dict, stdout: bytes = b"", stderr: bytes = b"") -> ExecResult:
        return cls(exit_code=r.get("exit_code"), signal=r.get("signal"),
                   stdout=r.get("stdout", stdout), stderr=r.get("stderr", stderr),
                   truncated=r.get("truncated", False), timed_out=r.get("timed_out", False),
                   cancelled=r.get("cancelled", False), duration_ms=r.get("duration_ms", 0.0),
                   trace=r.get("trace"), policy=r.get("policy"), denials=r.get("denials"),
                   killed_by=r.get("killed_by"), destroyed_by=r.get("destroyed_by"))


@dataclass
class CallResult(ExecResult):
    """A FnCall: an exec's result plus where it ran and how long it took."""

    path: str = ""           # "zygote" (forked from the pre-imported interpreter) or "exec"
    run_ms: float = 0.0      # the call's process lifetime
    total_ms: float = 0.0    # the whole request in the daemon

    @classmethod
    def from_call(cls, r: dict) -> CallResult:
        base = ExecResult.from_result(r)
        return cls(**vars(base), path=r.get("path", ""), run_ms=r.get("run_ms", 0.0),
                   total_ms=r.get("total_ms", 0.0))


def _follows(op: str, args: dict) -> bool:
    """A request that lasts until what it follows ends (SHORT_SLOTS)."""
    return op == "file_watch" or (op in ("events", "proc_logs") and args.get("follow", True) is not False)


def _answer_error(error: dict, op: str, args: dict) -> DsecError:
    """The error a daemon answered `op` with. Where it refused a request or
    a field this client knows, it runs an older dsecd than this client: one
    installed over and not restarted yet (an upgrade's `git pull` and setup
    change the client at once, the daemon at its restart), or another
    host's. The error then says so, and what to do; the daemon's own
    message says only that it does not know the name."""
    err = DsecError.from_wire(error)
    request = protocol.REQUESTS.get(op)
    if err.code != "bad_request" or request is None:
        return err
    ops, allowed = err.detail.get("ops"), err.detail.get("allowed")
    if isinstance(ops, list) and op not in ops:
        what = f"the request {op!r}"
    elif isinstance(allowed, list):
        ours = {f.name for f in dataclasses.fields(request)}
        newer = sorted(name for name in args if name in ours and name not in allowed)
        if not newer:
            return err
        what = f"the field(s) {', '.join(newer)} of {op!r}"
    else:
        return err
    err.message = (f"{err.message}: the daemon runs an older dsecd than this client, which sends {what}; "
                   "restart the daemon on the version installed (`systemctl restart dsecd`, which keeps "
                   "the sandboxes), or use a client of the daemon's version")
    err.detail = {**err.detail, "older_daemon": True}
    return err


def _refused_in_flight(error: dict) -> bool:
    """Whether an error answer is the daemon's refusal of a request over its
    in-flight limit, which it gives before the request runs."""
    return error.get("code") == "limit" and "in_flight" in (error.get("detail") or {})


class _Budget:
    """Units of the daemon's per-connection request limit, handed out first
    come first served; acquire(n) takes n units at once, never part of them
    (an exec with stdin needs two: itself and its exec_input)."""

    def __init__(self, units: int):
        self.free = units
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        # Waiters handed their units whose tasks have not run on yet. One
        # that comes meanwhile queues behind them: taking free units at
        # once, it would send its request before theirs, which came first
        # (a Process's inputs are numbered in the order they came).
        self._handed = 0

    async def acquire(self, n: int) -> None:
        if not self._waiters and not self._handed and self.free >= n:
            self.free -= n
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._handed -= 1
                self.release(n)             # granted just as we were cancelled
            elif entry in self._waiters:    # release() may have dropped it already
                self._waiters.remove(entry)
                self.release(0)             # those behind it may fit now
            raise
        self._handed -= 1
        self.release(0)                     # ones that queued behind it while it was handed its units

    def release(self, n: int) -> None:
        self.free += n
        while self._waiters and self._waiters[0][0] <= self.free:
            m, fut = self._waiters.popleft()
            if not fut.done():
                self.free -= m
                self._handed += 1
                fut.set_result(None)


class _Pending:
    """Frames of one request: stream frames queue up, the final one ends it.

    `limit`: the most bytes of stream data held for a reader that is
    behind; past it, data that comes is dropped and counted (with the
    daemon's own {"dropped": n} frames meanwhile) until the reader has
    taken half of what is held, and one {"dropped": n} frame takes its
    place then (or before the final frame). The connection's
    reader reads every frame as it comes, whoever waits for them, so
    nothing slows the daemon down: without a limit, a followed process
    that writes faster than its reader reads would fill this client's
    memory. Each frame counts PENDING_FRAME_COST bytes more than its data,
    so that a stream of tiny frames is bounded too."""

    def __init__(self, limit: int | None = None):
        self.queue: asyncio.Queue[dict] = asyncio.Queue()
        self.limit = limit
        self.held = 0            # bytes of stream data in the queue, with each frame's cost
        self.skipped = 0         # bytes dropped since the last frame queued
        self.dropping = False

    @staticmethod
    def _cost(stream) -> int | None:
        """What a frame's `stream` counts against the limit; None: not counted (not a stream frame)."""
        if not isinstance(stream, dict):
            return None
        return len(stream.get("data") or b"") + PENDING_FRAME_COST

    def put(self, frame: dict) -> None:
        """A frame from the daemon (the connection's reader)."""
        if self.limit is None:              # nothing counted: most requests
            self.queue.put_nowait(frame)
            return
        stream = frame.get("stream")
        cost = self._cost(stream)
        if cost is not None:
            # Output, or the daemon's own count of output its ring lost (a
            # first frame's lost_before is kept whole).
            lost = (len(stream["data"]) if stream.get("data") is not None
                    else stream["dropped"] if "dropped" in stream and "lost_before" not in stream
                    else None)
            if lost is not None:
                if not (self.dropping and self.held > self.limit // 2):
                    self.dropping = self.held + cost > self.limit
                if self.dropping:
                    self.skipped += lost
                    return
            self.held += cost
        if self.skipped:
            notice = {"stream": {"dropped": self.skipped}}
            self.held += PENDING_FRAME_COST
            self.queue.put_nowait(notice)
            self.skipped = 0
        self.queue.put_nowait(frame)

    async def get(self) -> dict:
        frame = await self.queue.get()
        if self.limit is not None and (cost := self._cost(frame.get("stream"))) is not None:
            self.held -= cost
        return frame


class _Conn:
    """One connection to a daemon: its writer, the requests waiting for
    answers on it, why it ended. A reconnect makes a new one, so that a frame
    or the loss of the old connection never reaches requests of the new."""

    def __init__(self, writer: asyncio.StreamWriter, frames: framing.FrameProtocol,
                 link: remote.SshLink | None):
        self.writer = writer
        self.frames = frames
        self.link = link                                  # the ssh process of an ssh:// client
        self.peer_pid: int | None = None                  # a local daemon's pid (SO_PEERCRED), for errors
        # The event loop it was opened in: its reader hands every answer to
        # futures of that loop, so only that loop's tasks may use it; and
        # the process, whose forked children share its socket.
        self.loop = asyncio.get_running_loop()
        self.pid = os.getpid()
        self.pending: dict[int, _Pending] = {}
        self.reader: asyncio.Task | None = None
        self.lost: BaseException | None = None            # why it ended, once it has
        # Requests past the daemon's limits.max_requests_per_client wait here
        # for a slot instead of failing; set from the hello's limits.
        self.slots: _Budget | None = None
        self.follows: _Budget | None = None               # the slots following requests may take
        self.tails = False        # the daemon takes file_write data as a frame's tail (protocol.TAILED)
        self.garbled = False      # it ended on bytes that are not frames (said as such, not as ssh's end)
        self.watchdog: asyncio.Task | None = None         # see Client._watch_silence


class _Unsent(ConnectionLost):
    """A request's connection was lost before the request was written to it:
    the daemon never saw it, so it may go on a new connection. Raised as
    the ConnectionLost it is where nothing sends it again (the hello)."""

    def __init__(self, cause: BaseException, target: str, op: str):
        super().__init__(f"{op} on {target}: connection lost before it was sent: {cause}",
                         target=target, op=op, sent=False)
        self.cause = cause


class _NotFrames(Exception):
    """The peer sent bytes that are not the protocol's frames."""


class Client:
    """A connection to one daemon: `target` is its unix socket's path (default
    DSEC_SOCKET, else /run/dsecd/dsecd.sock) or ssh://[user@]host[:port],
    reached through `ssh host dsec rpc --stdio` (dsecd/remote.py; `ssh`:
    SshOptions, default from the environment).

    A lost connection fails the requests in flight with errors.ConnectionLost.
    With `reconnect` (the default: a daemon restart, which leaves the
    sandboxes running, or a network over ssh:// drops a connection), the
    next request connects again first, waiting up to reconnect_timeout for
    the daemon to answer, and the requests that were still queued in this
    client (never sent) go on the new connection; otherwise every later
    request fails with ConnectionLost too, until connect() is called again.

    Two timeouts: `connect_timeout` bounds one connect, the socket (ssh's
    connect and login over ssh://) and the daemon's hello, so that a daemon
    that is wedged fails a client instead of hanging it; `reconnect_timeout`
    bounds how long requests wait, after a lost connection, for the daemon
    to answer again (a restart under systemd), trying to connect again and
    again meanwhile. Not given, it is connect_timeout (as the one timeout
    of older versions was both).

    `silence_timeout` (a local socket's; over ssh://, ssh's keepalives in
    SshOptions): how long a connection may stay silent while requests wait
    on it and the pings sent meanwhile go unanswered (a daemon stopped by
    SIGSTOP, or its event loop wedged) before it is given up, its requests
    failing with ConnectionLost saying so. A daemon that answers pings is
    never silent, however long its requests run. Default
    DSEC_SILENCE_TIMEOUT, else LOCAL_SILENCE_S (10 s); 0 turns it off."""

    def __init__(self, target: str | None = None, name: str = "dsecd-sdk", connect_timeout: float = 30.0,
                 *, ssh: remote.SshOptions | None = None, reconnect: bool | None = None,
                 reconnect_timeout: float | None = None, silence_timeout: float | str | None = None):
        target = target or default_socket()
        self.remote = remote.is_remote(target)
        # Whether Sandbox.exec and exec_stream make an idempotency key for
        # an exec without stdin or pty given none (a streamed one where the
        # daemon lists "op.keys.stream"): over ssh://, where a link can drop
        # with its daemon up and the exec sent again is answered with its
        # one run (a streamed one's output taken up where it stopped). Not on a
        # local socket, nor through a Ray actor (whose connection is a local
        # socket on the daemon's node, dsecd/ray.py): a connection lost
        # there is a daemon that went, whose successor could only say the
        # exec's outcome is unknown, and each key costs the daemon a journal
        # write.
        self.key_execs = self.remote
        if self.remote:
            self._ssh_target = remote.SshTarget.parse(target)
            self.ssh = ssh or remote.SshOptions.from_env()
            self.target = self._ssh_target.url()
            self.socket_path = None
        else:
            self.socket_path = self.target = target
        self.name = name
        # How long connect() waits for the daemon's hello: a socket someone
        # holds open but nobody serves (a wedged daemon) must not hang a client.
        self.connect_timeout = connect_timeout
        self._reconnect_timeout = reconnect_timeout
        self.reconnect = True if reconnect is None else reconnect
        # Called with a reason as soon as a connection is lost (not when this
        # client closes it); dsecd.Fleet marks the host down from it.
        self.on_lost: Callable[[str], object] | None = None
        # What to do about a lost connection when this client does not
        # reconnect by itself, for whoever owns it (a Fleet, the CLI); None:
        # the SDK user's advice, connect() again.
        self.lost_advice: str | None = None
        self._last_frame_at = 0.0        # see last_frame_at
        self._ids = itertools.count(1)
        self._conn: _Conn | None = None
        self._reconnecting = asyncio.Lock()
        # When the next try to connect again may start, how far apart tries
        # are, and why the last one failed (see _connection).
        self._reconnect_at = 0.0
        self._reconnect_gap = RECONNECT_GAP_S
        self._reconnect_error: ConnectionError | None = None
        self._closed = False
        self._undoing: set[asyncio.Task] = set()      # destroys of what cancelled creates made
        # The keys of creates in flight (key -> how many), and of those being
        # undone (key -> a create of it was sent again meanwhile): see
        # _settle_abandoned_create.
        self._keyed_creates: collections.Counter[str] = collections.Counter()
        self._undone_keys: dict[str, bool] = {}
        self.server: dict = {}
        self.max_frame = 16 << 20
        # (interval s, count): with requests waiting, a ping after `interval`
        # s of silence, and the connection given up after interval x count
        # with nothing come (_watch_silence). Over ssh:// ssh's own keepalive
        # settings: a connection shared through ControlMaster rides on a
        # master that ssh's -o options never reach. On a local socket,
        # `silence_timeout` (local_silence_timeout) in LOCAL_PINGS
        # intervals: the socket never fails, but its daemon may stop
        # answering (SIGSTOPped, wedged). None: no watch.
        if self.remote:
            self.keepalive: tuple[float, int] | None = (max(1, self.ssh.keepalive_s),
                                                        max(1, self.ssh.keepalive_count))
        else:
            window = local_silence_timeout(silence_timeout)
            self.keepalive = (window / LOCAL_PINGS, LOCAL_PINGS) if window else None

    def __repr__(self) -> str:
        return f"<Client {self.target}>"

    @property
    def reconnect_timeout(self) -> float:
        """How long requests wait for a daemon that went to answer again
        (connect_timeout unless given)."""
        return self.connect_timeout if self._reconnect_timeout is None else self._reconnect_timeout

    @reconnect_timeout.setter
    def reconnect_timeout(self, seconds: float | None) -> None:
        self._reconnect_timeout = seconds

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.lost is None

    @property
    def _tails(self) -> bool:
        return self._conn is not None and self._conn.tails

    async def connect(self) -> None:
        """Open the connection and say hello (again, after a loss or close)."""
        if self.connected:
            return
        self._closed = False
        if self._conn is not None:          # the lost one: its ssh and reader go first
            await self._drop(self._conn, grace=0)
        loop = asyncio.get_running_loop()
        conn = await (self._open_ssh() if self.remote else self._open_unix())
        conn.reader = loop.create_task(self._read_loop(conn))
        try:
            # Other requests see the connection only once its hello is done:
            # the daemon takes nothing before it.
            async with asyncio.timeout(self.connect_timeout):
                self.server = await self._hello(conn)
        except TimeoutError:
            await self._drop(conn, grace=0)
            if conn.link is not None:
                # ssh's own connect and login are in this wait: the host
                # may never have taken a connection at all.
                raise ConnectionError(
                    f"dsecd at {self.target} did not answer in {self.connect_timeout:g} s (ssh's connect and "
                    f"login, then the daemon's hello): check that `{conn.link.check_command()}` answers "
                    "quickly and that the host's daemon runs") from None
            raise ConnectionError(f"dsecd at {self.target} took the connection but did not answer in "
                                  f"{self.connect_timeout:g} s: is the daemon stuck?") from None
        except ConnectionLost as err:        # ssh could not log in, or found no dsec there
            # The reader says why once ssh has exited (its status, its stderr).
            await asyncio.wait([conn.reader], timeout=2 * remote.EXIT_WAIT_S)
            await self._drop(conn, grace=0)
            raise ConnectionError(f"cannot reach dsecd at {self.target}: {conn.lost or err}") from None
        except BaseException:
            # Cancelled (a caller's timeout), or any other failure: nothing of
            # this connection may stay, an ssh process and its pipes least of all.
            await asyncio.shield(self._drop(conn, grace=0))
            raise
        if conn.link is not None:
            conn.link.established = True
        limits = self.server.get("limits", {})
        self.max_frame = limits.get("max_frame_bytes", self.max_frame)
        conn.frames.max_frame = self.max_frame + FRAME_SLACK
        conn.tails = "frame.tail" in self.server.get("capabilities", ())
        cap = limits.get("max_requests_per_client", 256)
        conn.slots = _Budget(max(2, cap - CONTROL_SLOTS))
        conn.follows = _Budget(max(1, cap - CONTROL_SLOTS - SHORT_SLOTS))
        self._conn = conn
        if self.keepalive is not None:
            conn.watchdog = loop.create_task(self._watch_silence(conn, *self.keepalive))

    async def _watch_silence(self, conn: _Conn, interval: float, count: int) -> None:
        """Give `conn` up once requests wait on it and nothing came through
        it for interval x count s, a ping sent after each `interval` of that
        silence unanswered: a link that stalled, a host that stopped
        answering, a local daemon stopped (SIGSTOP) or wedged. ssh's
        ServerAliveInterval does this for its own connection, but not for
        one shared through ControlMaster (the master's keepalives are the
        master's settings; without them a request waits for TCP to give
        up, or for ever when nothing is being sent); a unix socket never
        gives up. Progress counts either way: bytes come (of a frame
        complete or not, a ping's answer among them), or our bytes still
        leave (an upload on a slow link, which a ping waits behind). And
        only silence after a ping that went unanswered for an interval
        counts: a request the daemon has nothing to say about for minutes
        (a quiet exec, a follow) is no silence while it answers the
        pings, nor is a wake made late by this loop's own delay (a caller
        that blocked it) before a ping was asked."""
        loop = asyncio.get_running_loop()
        transport = conn.writer.transport
        quiet_since = loop.time()
        unsent = transport.get_write_buffer_size()
        pinged_at: float | None = None          # the first ping of this silence, unanswered
        while conn.lost is None and self._conn is conn:
            await asyncio.sleep(interval)
            now = loop.time()
            left = transport.get_write_buffer_size()
            if not conn.pending or left < unsent:
                quiet_since = now                   # nothing waits, or ours still leaves
            unsent = left
            heard = max(quiet_since, self.last_frame_at)
            if pinged_at is not None and heard >= pinged_at:
                pinged_at = None                    # answered, or the silence ended otherwise
            silent = now - heard
            if silent >= interval * count and pinged_at is not None and now - pinged_at >= interval:
                reason = self._silence_reason(conn, silent)
                self.abort_now(reason)
                if self.on_lost is not None:
                    with contextlib.suppress(Exception):
                        self.on_lost(reason)
                return
            if silent >= interval and not transport.is_closing():
                # Its answer is no one's (no pending entry): it only makes bytes come.
                transport.writelines(self._encode(conn, self.new_id(), "ping", {}))
                if pinged_at is None:
                    pinged_at = now

    def _silence_reason(self, conn: _Conn, silent: float) -> str:
        """Why _watch_silence gave `conn` up, and what to look at."""
        if self.remote:
            return (f"nothing came from {self.target} for {silent:.0f} s with requests waiting, "
                    "pings unanswered: the link stalled or the host stopped answering; check that "
                    "it is up and reachable (over a ControlMaster connection, the master's "
                    "ServerAliveInterval applies, not ours)")
        pid = conn.peer_pid
        which = f"dsecd (pid {pid})" if pid else "dsecd"
        status = f"/proc/{pid}/status" if pid else "/proc/PID/status"
        return (f"the daemon at {self.socket_path} sent nothing for {silent:.3g} s with requests waiting, "
                f"pings unanswered: is {which} stopped (State: T in {status}; `kill -CONT {pid or 'PID'}` "
                "resumes it) or its event loop wedged (its log reports a loop that has not turned)? "
                "The window is the Client's silence_timeout (DSEC_SILENCE_TIMEOUT, dsec --silence-timeout; "
                "0 turns the watch off)")

    async def _hello(self, conn: _Conn) -> dict:
        args = {"protocol": protocol.PROTOCOL_VERSION, "client": self.name}
        async with contextlib.aclosing(self._frames_with_id(conn, self.new_id(), "hello", args, None)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return frame["__result__"]
        raise ConnectionError("hello: no final frame")

    def _frame_protocol(self) -> framing.FrameProtocol:
        return framing.FrameProtocol(self.max_frame + FRAME_SLACK, recycle=FRAME_BUFFERS_KEPT)

    async def _open_unix(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            transport, frames = await loop.create_unix_connection(self._frame_protocol, self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as err:
            raise ConnectionError(f"cannot connect to dsecd at {self.socket_path}: {err.strerror}; "
                                  "is the daemon running? (set DSEC_SOCKET or --socket)") from err
        except PermissionError as err:
            raise ConnectionError(f"cannot connect to dsecd at {self.socket_path}: permission denied; "
                                  f"{_who_may_connect(self.socket_path)}") from err
        conn = _Conn(asyncio.StreamWriter(transport, frames, None, loop), frames, None)
        with contextlib.suppress(OSError, AttributeError):
            conn.peer_pid = unixsock.peer_credentials(transport.get_extra_info("socket"))[0] or None
        return conn

    async def _open_ssh(self) -> _Conn:
        link = remote.SshLink(self._ssh_target, self.ssh)
        transport, frames = await link.open(self._frame_protocol)
        return _Conn(asyncio.StreamWriter(transport, frames, None, asyncio.get_running_loop()), frames, link)

    async def close(self) -> None:
        """Close the connection: an ssh:// one ends after the host answered
        what was sent (ssh is killed if it has not exited 2 s later)."""
        if self._conn is not None and self._conn.pid != os.getpid():
            # A forked child's copy: the connection is its parent's to close.
            self._conn, self._closed = None, True
            return
        if self._undoing:
            # What a request given up on left to undo (a cancelled create's
            # sandbox, a block's destroy) goes first, over this connection:
            # an undo may be waiting up to reconnect_timeout for a restarted
            # daemon before its own round trip.
            await asyncio.wait(set(self._undoing), timeout=self.reconnect_timeout + ABANDONED_CREATE_WAIT_S)
        self._closed = True
        if self._conn is not None:
            await self._drop(self._conn)

    @property
    def last_frame_at(self) -> float:
        """Loop time bytes last came from the daemon, of a frame complete or
        not: the host is alive (dsecd.Fleet's heartbeat). A frame of
        megabytes (an exec's output, a file's chunk) takes seconds on a
        slow link, all of them signs of life."""
        conn = self._conn
        return max(self._last_frame_at, conn.frames.bytes_at if conn is not None else 0.0)

    @last_frame_at.setter
    def last_frame_at(self, at: float) -> None:
        self._last_frame_at = at

    def abort_now(self, reason: str) -> _Conn | None:
        """End the connection now (dsecd.Fleet, for a host that stopped
        answering): from this moment the client is not connected, and the
        requests in flight fail with ConnectionLost(reason) as soon as the
        reader sees the end. The connection to drop (see abort), if any."""
        conn = self._conn
        if conn is None or conn.lost is not None:
            return None
        conn.lost = ConnectionError(reason)
        if conn.link is not None:
            conn.link.aborted = reason
            conn.link.kill()
        conn.writer.transport.abort()
        return conn

    async def abort(self, reason: str) -> None:
        """abort_now, then wait until the requests in flight have failed and
        the connection (and its ssh) is gone; the next request (with
        `reconnect`, the default) or a later connect() connects again."""
        conn = self.abort_now(reason)
        if conn is None:
            return
        if conn.reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(conn.reader), remote.EXIT_WAIT_S * 2)
        await self._drop(conn, grace=0)

    async def _drop(self, conn: _Conn, grace: float = remote.CLOSE_GRACE_S) -> None:
        if conn.watchdog is not None:
            conn.watchdog.cancel()
        conn.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await conn.writer.wait_closed()
        if conn.reader is not None and not conn.reader.done():
            if conn.link is not None and grace:
                # Our end closed: ssh ends once the host answered what was sent.
                with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(conn.reader), grace)
            conn.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await conn.reader
        if conn.link is not None:
            await conn.link.close(grace)

    async def _read_loop(self, conn: _Conn) -> None:
        error: BaseException = ConnectionError("dsecd closed the connection")
        loop = asyncio.get_running_loop()
        cancelled = False
        try:
            while True:
                try:
                    payload = await conn.frames.read_payload()
                except framing.FrameTooBig as err:
                    if conn.link is not None:
                        raise _NotFrames(
                            f"{self.target} sent bytes that are not dsecd frames (a header announcing "
                            f"{err.size} bytes); does a shell start-up file on that host print to stdout?") from None
                    if self._conn is not conn:
                        # Before the hello's answer: no daemon sends a first
                        # frame this big, so another program serves the socket
                        # (an HTTP server's b"HTTP" reads as 1.2 GB).
                        raise _NotFrames(
                            f"it answered with bytes that are not dsecd frames (they begin "
                            f"{framing.HEADER.pack(err.size)!r}): is {self.target} another program's socket? "
                            "(set DSEC_SOCKET or --socket to dsecd's)") from None
                    raise LimitExceeded(f"server frame of {err.size} bytes exceeds the limit") from None
                if payload is None:
                    # After close() the stream ends as ssh exits, as when the daemon goes.
                    error = ConnectionError("the client closed it" if self._closed else "the daemon closed it")
                    break
                self.last_frame_at = loop.time()
                try:
                    frame = protocol.decode_payload(payload)
                except Exception as err:
                    raise _NotFrames(f"{self.target} sent a frame that does not decode ({err})") from None
                rid = frame.get("id")
                if rid is None and "error" in frame:
                    error = DsecError.from_wire(frame["error"])
                    break
                pending = conn.pending.get(rid)
                if pending is not None:
                    pending.put(frame)
        except _NotFrames as err:
            error = ConnectionError(str(err))
            conn.garbled = True
        except (asyncio.IncompleteReadError, ConnectionError) as err:
            error = ConnectionError(str(err))
        except asyncio.CancelledError:
            # Not by close() nor a reconnect (which set conn.lost first): the
            # loop is ending with the connection open (asyncio.run returning).
            error = ConnectionError("the client closed it" if self._closed else
                                    "the event loop it was connected in ended (a Client serves the loop "
                                    "it connected in)")
            cancelled = True
        except Exception as err:
            error = err
        # Set before anything awaits: a request that starts now fails (or
        # reconnects) at once instead of waiting on a dead connection. An
        # abort's reason, set first, is the one that is true.
        error = conn.lost = conn.lost or error
        conn.writer.close()
        if cancelled and conn.link is not None:
            # The connection is given up: by _drop (close()'s grace ran out,
            # an abort, a failed connect), or by asyncio.run() ending with
            # the client still open. Only closing our end would half-close
            # the remote relay, which then runs what was sent to its end; a
            # dead ssh ends its session, and the daemon cancels this
            # client's requests and kills its execs, as it does when a
            # local client's socket closes.
            conn.link.kill()
            with contextlib.suppress(Exception):
                await conn.link.close(remote.EXIT_WAIT_S)   # reaped while the loop still runs
        if not cancelled and not self._closed and not (conn.link and conn.link.aborted):
            if conn.link is not None and not isinstance(error, DsecError) and not conn.garbled:
                # ssh's exit status and last words say what went wrong (a
                # daemon that went, a link cut): read before on_lost is told,
                # so that its reason (a fleet's host_down) is that, not the
                # end of the socket pair that both look like here.
                error = conn.lost = ConnectionError(await conn.link.why_ended())
            if self.on_lost is not None:
                with contextlib.suppress(Exception):
                    self.on_lost(str(error))
        for pending in conn.pending.values():
            pending.queue.put_nowait({"__lost__": error})

    def _lost_error(self, cause: BaseException, op: str, sent: bool, key: str | None = None) -> BaseException:
        """What a request raises when its connection is gone: the daemon's own
        error (a connection-level `limit`, say) as it is, else ConnectionLost.
        `key`: the request's idempotency key, if it went with one."""
        if isinstance(cause, DsecError):
            return cause
        text = f"{op} on {self.target}: connection lost: {cause}" + _sent_or_not(op, sent, key)
        if self._closed:
            pass
        elif self.lost_advice:
            # Its owner's words: `dsec --host` sends no next request to connect again.
            text += f"; {self.lost_advice}"
        elif self.reconnect:
            text += "; the next request connects again"
        else:
            text += "; call connect() again (or make the Client with reconnect=True) to go on"
        return ConnectionLost(text, target=self.target, op=op, sent=sent)

    async def _connection(self, op: str, deadline: float | None = None, sent: bool = False,
                          key: str | None = None) -> _Conn:
        """The live connection; after a loss, a new one if `reconnect`,
        waiting for the daemon to answer again until `deadline` (loop time;
        default: reconnect_timeout from now). `sent`: the request was sent on
        a connection lost since (it is to go again), for the error, as its
        idempotency `key`."""
        conn = self._conn
        if conn is not None and conn.pid != os.getpid():
            # Its frames would interleave with the parent's on the one socket.
            raise RuntimeError(f"{op} on {self.target}: this Client was connected in process {conn.pid}; a "
                               "process forked from it (a multiprocessing Pool, say) cannot share its "
                               "connection: make a Client in the child")
        if conn is not None and conn.loop.is_closed() and conn.lost is None:
            # Its loop was closed without closing it (asyncio.run would have
            # cancelled its reader, which says so): nothing reads its answers.
            self._conn = None
            raise ConnectionError(f"{op} on {self.target}: this Client's connection was made in an event loop "
                                  "that was closed without closing the Client; call connect() again (or use "
                                  "`async with`, which closes it with its loop)")
        if conn is not None and conn.loop is not asyncio.get_running_loop() and not conn.loop.is_closed():
            # Its answers would go to futures of a loop that nobody wakes for them: a hang.
            raise RuntimeError(f"{op} on {self.target}: this Client is connected in another event loop, "
                               "the only one that may use it; share a dsecd.SyncClient among threads, "
                               "or make a Client per event loop")
        if conn is not None and conn.lost is None:
            return conn
        if conn is None:
            raise ConnectionError(f"{op}: not connected to dsecd at {self.target}: call connect() first "
                                  "(or use `async with`)")
        # A reconnect must not cancel the reader before it has told on_lost.
        await self._reason(conn)
        if not self.reconnect or self._closed:
            raise self._lost_error(conn.lost, op, sent=sent, key=key)
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.reconnect_timeout
        try:
            async with asyncio.timeout_at(deadline), self._reconnecting:
                # One request at a time tries; the others wait here for its
                # connection. A daemon that is restarting has no socket, or
                # refuses, for a while: tried again, further apart each time.
                while self._conn is conn and not self._closed:
                    wait = self._reconnect_at - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    try:
                        await self.connect()
                    except ConnectionError as err:
                        self._reconnect_error = err
                        if isinstance(err.__cause__, PermissionError):
                            raise       # not one that time mends
                        self._reconnect_gap = min(2 * self._reconnect_gap, RECONNECT_GAP_MAX_S)
                        self._reconnect_at = loop.time() + self._reconnect_gap
                    else:
                        self._reconnect_gap = RECONNECT_GAP_S
                        self._reconnect_at = 0.0
                        self._reconnect_error = None
        except TimeoutError:
            why = f" (last: {self._reconnect_error})" if self._reconnect_error is not None else ""
            raise ConnectionLost(
                f"{op} on {self.target}: connection lost: {conn.lost}; the daemon did not answer again within "
                f"{self.reconnect_timeout:g} s (the Client's reconnect_timeout){why}"
                + _sent_or_not(op, sent, key),
                target=self.target, op=op, sent=sent) from None
        conn = self._conn
        if self._closed or conn is None or conn.lost is not None:
            raise self._lost_error(conn.lost if conn else ConnectionError("closed"), op, sent=sent, key=key)
        return conn

    @staticmethod
    async def _reason(conn: _Conn) -> None:
        """Wait (a second at most) for the reader of a connection that ended
        to say why in conn.lost: over ssh it reads ssh's exit status and
        last words first. A request failing meanwhile (a fleet's heartbeat,
        whose error is the host_down reason) fails with that, not with the
        bare end of the stream or a write that failed."""
        if conn.reader is not None and not conn.reader.done():
            await asyncio.wait([conn.reader], timeout=2 * remote.EXIT_WAIT_S)

    def _encode(self, conn: _Conn, rid: int, op: str, args: dict) -> tuple[bytes, ...]:
        """The request's frame as sent. An argument msgpack cannot pack (a
        datetime.timedelta, a set) is a TypeError naming the request."""
        frame = {"id": rid, "op": op, "args": args}
        try:
            if conn.tails:
                return protocol.encode_tailed_request(frame, self.max_frame)
            return protocol.encode_frame_parts(frame, self.max_frame)
        except TypeError as err:
            raise TypeError(f"{op}: {err}: arguments go as str, bytes, int, float, bool, None and lists and "
                            "dicts of them (a duration: seconds, or a string such as \"5m\")") from None

    async def _send(self, conn: _Conn, parts: tuple[bytes, ...]) -> None:
        if conn.writer.is_closing():
            raise ConnectionError("not connected to dsecd")
        conn.writer.writelines(parts)
        await conn.writer.drain()

    def new_id(self) -> int:
        return next(self._ids)

    def frames(self, op: str, **args) -> AsyncIterator[dict]:
        """Send one request; yield its stream payloads; the final result is yielded
        last as {"__result__": result}. Errors are raised."""
        return self.frames_with_id(self.new_id(), op, args)

    async def frames_with_id(self, rid: int, op: str, args: dict,
                             sent: asyncio.Event | None = None) -> AsyncIterator[dict]:
        # A request that never left this client (it waited for a slot, or
        # was refused for the in-flight limit, when its connection was lost)
        # never reached the daemon: it goes on the next connection, once the
        # daemon answers again (reconnect_timeout from its first loss at most).
        # One that was written may have run and is not sent again, unless
        # sending it again is safe and nothing of its answer had come: one
        # that changes nothing (CHANGES_NOTHING), or a create with an
        # idempotency key (the daemon journals the key: the create it made
        # before the loss, if any, is the answer; likewise an exec's result,
        # a process started, a snapshot made: KEYED), or a pause or resume
        # (IDEMPOTENT). Once: lost again, the daemon may be failing on it.
        # A keyed streamed exec goes again after each loss that a frame came
        # before (output, or the daemon's `resumed` once it took it up
        # again), from the bytes of output that came (`stream_from`): the
        # daemon sends the rest, and answers `lost` for what it no longer has.
        key = args.get("key") if op in KEYED else None
        # A proc_input at an offset: the daemon skips what of it it wrote before.
        again_safe = (op in CHANGES_NOTHING or op in IDEMPOTENT or bool(key)
                      or (op == "proc_input" and args.get("offset") is not None))
        got = [0, 0] if op == "exec" and key and args.get("stream") else None
        deadline = None
        resent = False
        while True:
            conn = await self._connection(op, deadline, sent=resent, key=key)
            came = False
            try:
                # aclosing: a caller that stops early (break, cancel) closes the
                # inner generator at once, so the daemon is told to cancel the
                # request now.
                async with (self._slots_held(conn, op, args),
                            contextlib.aclosing(self._frames_with_id(conn, rid, op, args, sent)) as frames):
                    async for frame in frames:
                        came = True
                        if got is not None:
                            _count_output(got, frame)
                        yield frame
                return
            except _Unsent as err:
                if not self.reconnect or self._closed:
                    raise self._lost_error(err.cause, op, sent=False) from None
            except ConnectionLost:
                if got is not None and came and self.reconnect and not self._closed:
                    # A frame came since it was sent: the daemon was serving it.
                    args = {**args, "stream_from": list(got)}
                    deadline = None
                elif ((came and op not in PROGRESS_FRAMES) or resent or not again_safe or not self.reconnect
                        or self._closed):
                    raise
                resent = True
            except DsecError as err:
                if not (resent and err.detail.get("outcome") == "unknown"):
                    raise
                # Sent again to a daemon that followed the one it was sent
                # to: that one began it and stopped before its end.
                raise ConnectionLost(f"{op} on {self.target}: connection lost after it was sent; the request "
                                     f"may have been carried out: the daemon that answered again says: "
                                     f"{err.message}", target=self.target, op=op, sent=True) from None
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.reconnect_timeout

    @contextlib.asynccontextmanager
    async def _slots_held(self, conn: _Conn, op: str, args: dict) -> AsyncIterator[None]:
        """The in-flight slots a request holds on `conn` while it runs (none
        for a control op, or a daemon that sets no limit)."""
        slots = conn.slots
        if slots is None or op in CONTROL_OPS:
            yield
            return
        # Queued here past the daemon's in-flight limit; an exec with stdin
        # also holds the slot of its exec_input requests, a pty exec that of
        # its exec_resize requests too, a directory copy in that of its
        # file_tar_input requests.
        units = (1 + bool(op == "exec" and args.get("stdin")) + bool(op == "exec" and args.get("pty"))
                 + bool(op == "file_tar_put"))
        follows = conn.follows if _follows(op, args) else None
        if follows is not None:
            await follows.acquire(1)
        try:
            await slots.acquire(units)
            try:
                yield
            finally:
                slots.release(units)
        finally:
            if follows is not None:
                follows.release(1)

    async def _frames_with_id(self, conn: _Conn, rid: int, op: str, args: dict,
                              sent: asyncio.Event | None) -> AsyncIterator[dict]:
        if conn.lost is not None:
            raise _Unsent(conn.lost, self.target, op)
        # A background process's output, followed, comes as fast as the
        # process writes it; the rest is bounded by its request (without
        # follow, by the daemon's ring).
        followed = op == "proc_logs" and args.get("follow", False)
        pending = conn.pending[rid] = _Pending(FOLLOWED_OUTPUT_BYTES if followed else None)
        finished = False
        on_wire = False
        key = args.get("key") if op == "create" else None
        if key:
            self._keyed_create_sent(key)

        async def send() -> None:
            try:
                await self._send(conn, parts)
            except ConnectionError as err:
                await self._reason(conn)
                raise self._lost_error(conn.lost or err, op, sent=True, key=args.get("key")) from None

        try:
            # Packed before anything is sent: a request that cannot be fails
            # here, with nothing to cancel or wait for.
            parts = self._encode(conn, rid, op, args)
            # Once _send starts, the frame is in the transport's buffer (only
            # its drain awaits): a cancel from here on finds it sent.
            on_wire = True
            await send()
            if sent is not None:
                sent.set()
            again = REFUSED_AGAIN_S
            while True:
                frame = await pending.get()
                if "__lost__" in frame:
                    raise self._lost_error(frame["__lost__"], op, sent=True, key=args.get("key"))
                if "stream" in frame:
                    yield frame["stream"]
                    continue
                if "error" in frame and sent is None and _refused_in_flight(frame["error"]):
                    # Nothing ran: the daemon still counted answers this
                    # client has read (they were draining). Send it again;
                    # meanwhile it is not in flight, so there is nothing to
                    # cancel or undo. (Not one that others follow on the
                    # wire, `sent`: an exec's stdin would find no exec. A
                    # chunk of input is: the SDK's feeders await each
                    # chunk's answer before the next, so it overtakes none.
                    # Process.write's inputs do not wait: one sent after
                    # this one may come first, and Process._input sends
                    # it again once this one ended.)
                    on_wire = False
                    await asyncio.sleep(again)
                    if conn.lost is not None:       # gone meanwhile: it never ran
                        raise _Unsent(conn.lost, self.target, op)
                    again = min(2 * again, REFUSED_AGAIN_MAX_S)
                    on_wire = True
                    await send()
                    continue
                finished = True
                if "error" in frame:
                    raise _answer_error(frame["error"], op, args)
                yield {"__result__": frame.get("result", {})}
                return
        finally:
            abandoned = not finished and conn.lost is None and not conn.writer.is_closing()
            # An abandoned create keeps its entry: its final frame may still
            # come (the daemon finished it before the cancel landed), and what
            # it made must then be destroyed.
            undo = abandoned and on_wire and op == "create"
            settle = abandoned and on_wire and op in SETTLED_WHEN_ABANDONED
            if not (undo or settle):
                conn.pending.pop(rid, None)
            if key:
                self._keyed_create_ended(key, undo)
            if abandoned and on_wire:
                # Abandoned early (break, exception, cancel): tell the daemon to stop it.
                try:
                    await self._send(conn, self._encode(conn, next(self._ids), "cancel", {"target": rid}))
                except (ConnectionError, DsecError):
                    pass
            if undo:
                await self._undo_abandoned(self._settle_abandoned_create(conn, rid, pending, key))
            elif settle:
                await self._undo_abandoned(self._settle_abandoned(conn, rid, pending, op, args))

    async def _undo_abandoned(self, settle) -> None:
        """Run `settle`, the undo of a request the caller gave up on (a
        cancel, a timeout) after it was sent, waiting for it up to
        ABANDONED_CREATE_WAIT_S (the caller's cancel goes on after that;
        the undo goes on in the background, and close() waits for it)."""
        task = asyncio.get_running_loop().create_task(settle)
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)
        await asyncio.wait([task], timeout=ABANDONED_CREATE_WAIT_S)

    async def _settle_abandoned(self, conn: _Conn, rid: int, pending: _Pending, op: str, args: dict) -> None:
        """An abandoned request of SETTLED_WHEN_ABANDONED: its final frame
        waited for; a background process it started all the same is killed."""
        try:
            while "stream" in (frame := await pending.queue.get()):
                pass
        finally:
            conn.pending.pop(rid, None)
        if op == "proc_start" and "result" in frame:
            await self._kill_started_for_nobody(args["sandbox"], frame["result"])

    async def _kill_started_for_nobody(self, sandbox: str, info: dict) -> None:
        """Kill the background process a cancelled proc_start started (`info`: its answer)."""
        try:
            await self.request("proc_kill", sandbox=sandbox, pid=info["pid"], signal="KILL")
            log.info("proc_start on %s was cancelled after the daemon started pid %s in sandbox %s: killed it",
                     self.target, info["pid"], sandbox)
        except (NotFound, Conflict):
            pass                            # gone, or ended, already
        except (DsecError, ConnectionError) as err:
            log.warning("proc_start on %s was cancelled after the daemon started pid %s in sandbox %s, and "
                        "killing it failed (%s): `dsec kill %s %s` ends it", self.target, info["pid"], sandbox,
                        err, sandbox, info["pid"])

    async def _settle_abandoned_create(self, conn: _Conn, rid: int, pending: _Pending, key: str | None) -> None:
        try:
            while "stream" in (frame := await pending.queue.get()):
                pass
        finally:
            conn.pending.pop(rid, None)
            asked_again = self._asked_again(key)
        # Lost: nobody can tell here (the caller was told ConnectionLost, sent:
        # a create with its key sent again finds what it made). An error: nothing was made.
        if "__lost__" in frame or "error" in frame or asked_again:
            return
        await self._destroy_made_for_nobody(frame.get("result") or {})

    def _keyed_create_sent(self, key: str) -> None:
        """A create with idempotency key `key` is on its way (see _asked_again)."""
        self._keyed_creates[key] += 1
        if key in self._undone_keys:
            self._undone_keys[key] = True

    def _keyed_create_ended(self, key: str, undo: bool) -> None:
        """That create ended; `undo`: abandoned, what it made is to be destroyed."""
        self._keyed_creates[key] -= 1
        if not self._keyed_creates[key]:
            del self._keyed_creates[key]
        if undo:
            self._undone_keys[key] = self._undone_keys.get(key, False) or key in self._keyed_creates

    def _asked_again(self, key: str | None) -> bool:
        """Whether a create of `key` was sent while an abandoned one of it was
        under way (the caller's retry): it is, or will be, answered with what
        the abandoned one made, which is then not nobody's. Asked once, by
        that create's undo."""
        return key is not None and (self._undone_keys.pop(key, False) or key in self._keyed_creates)

    async def _destroy_made_for_nobody(self, info: dict) -> None:
        """Destroy the sandbox a cancelled create made (`info`: its answer),
        unless it made none or answered with the sandbox of an earlier
        create of its key, which is not this one's to undo."""
        if not info.get("id") or info.get("existing"):
            return
        try:
            await self.request("destroy", sandbox=info["id"], force=True)
            log.info("create on %s was cancelled after the daemon made sandbox %s: destroyed it",
                     self.target, info["id"])
        except NotFound:
            pass
        except (DsecError, ConnectionError) as err:
            log.warning("create on %s was cancelled after the daemon made sandbox %s, and destroying it failed "
                        "(%s): remove it with `dsec rm --force %s`", self.target, info["id"], err, info["id"])

    async def request(self, op: str, **args) -> dict:
        async with contextlib.aclosing(self.frames(op, **args)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return frame["__result__"]
        raise ConnectionError(f"{op}: no final frame")

    # ---------------------------------------------------------------- host and images

    async def info(self) -> dict:
        return await self.request("info")

    async def build_image(self, source: str, name: str, parent: str | None = None,
                          progress: Callable[[dict], None] | None = None, **config) -> dict:
        """A root file system, or a docker save or OCI layout (a directory or
        tarball on the daemon's host) -> image `name`, optionally on top of
        image `parent`; config overrides: env, cwd, user, entrypoint, cmd,
        labels, exposed_ports (dsecd/imageconfig.py). Over ssh:// `source` is
        a path on that host, so it must be absolute."""
        if self.remote and not source.startswith("/"):
            raise ValueError(f"build_image on {self.target}: {source!r} must be an absolute path on that host "
                             "(the daemon reads it there)")
        args = {"source": source if self.remote else os.path.abspath(source), "name": name, **config}
        if parent:
            args["parent"] = parent
        return await self._with_progress("image_build", args, progress)

    async def _with_progress(self, op: str, args: dict, progress: Callable[[dict], None] | None) -> dict:
        """A streamed request whose frames are {"progress": ...} until its result."""
        async with contextlib.aclosing(self.frames(op, **args)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return frame["__result__"]
                if progress and "progress" in frame:
                    progress(frame["progress"])
        raise ConnectionError(f"{op}: no final frame")

    async def pull_image(self, ref: str, progress: Callable[[dict], None] | None = None,
                         platform: str | None = None) -> dict:
        """Pull `ref` (python:3.11, registry/namespace/name@sha256:...) from its
        registry into the daemon's store; `progress` gets each progress event
        (docs/protocol.md, image_pull): per-layer bytes and states. Returns the
        image, with `pull` (bytes downloaded, layers reused, timings)."""
        args = {"ref": ref, **({"platform": platform} if platform else {})}
        return await self._with_progress("image_pull", args, progress)

    async def build_dockerfile(self, context: str, name: str, dockerfile: str | None = None,
                               text: str | None = None, build_args: dict[str, str] | None = None,
                               allow: list[str] | None = None, no_cache: bool = False,
                               progress: Callable[[dict], None] | None = None) -> dict:
        """Build image `name` from a Dockerfile. `context`: a directory on the
        daemon's host (the daemon reads COPY/ADD sources there, in place: no
        upload, so the daemon must be local). The Dockerfile is read here,
        from `dockerfile` (default: CONTEXT/Dockerfile), or given as `text`.
        `allow`: egress rules for RUN steps (rule-set names such as "pypi"
        too; without any, RUN has no network). `progress(event)` gets every
        event the build streams: {"event": "step", step, of, line, instruction},
        {"event": "output", step, fd, data}, {"event": "step_done", step, of,
        cached, seconds, layer}, {"event": "warning", message}. Result: the
        image, plus `steps` (each step's line, instruction, cached, seconds,
        layer), `seconds`, `replaced` (the manifest the name had before).
        Over ssh:// (or through a Ray actor) the daemon reads `context` on
        its host, so it must be absolute there."""
        if self.remote and not context.startswith("/"):
            # Made absolute here, it would name this machine's directory on that host.
            raise ValueError(f"build_dockerfile on {self.target}: the context {context!r} must be an absolute "
                             "path on that host (the daemon reads it there)")
        context = os.path.abspath(context)
        if text is None:
            text = _read_dockerfile(dockerfile or os.path.join(context, "Dockerfile"), dockerfile is None)
        shown = dockerfile or "Dockerfile"
        args = _given({"context": context, "dockerfile": text, "name": name, "dockerfile_name": shown,
                       "build_args": string_map(build_args, "build_args"), "no_cache": bool(no_cache)},
                      allow=list(allow) if allow else None)
        async with contextlib.aclosing(self.frames("image_build_dockerfile", **args)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return frame["__result__"]
                if progress:
                    progress(frame)
        raise ConnectionError("image_build_dockerfile: no final frame")

    async def import_image(self, path: str, name: str, progress: Callable[[dict], None] | None = None) -> dict:
        """A root directory as a one-layer image (same as build_image without a parent)."""
        return await self.build_image(path, name, progress=progress)

    async def image_gc(self) -> dict:
        return await self.request("image_gc")

    async def image_du(self) -> dict:
        return await self.request("image_du")

    async def list_images(self) -> list[dict]:
        return (await self.image_listing())["images"]

    async def image_listing(self) -> dict:
        """The image_list result: `images`, and `unreadable` (names whose
        image cannot be read, each `name` and `error`). From a daemon that
        streams it, in as many frames as it takes, so that any number of
        images lists (one frame of them all may be past the frame limit).
        An older daemon (or a client not connected yet, which the request
        tells so) gets the request of one answer."""
        if "image.list.stream" not in self.server.get("capabilities", ()):
            return await self.request("image_list")
        out: dict[str, list] = {"images": [], "unreadable": []}
        async with contextlib.aclosing(self.frames("image_list", stream=True)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return out
                out["images"].extend(frame.get("images", ()))
                out["unreadable"].extend(frame.get("unreadable", ()))
        raise ConnectionError("image_list: no final frame")

    async def inspect_image(self, name: str) -> dict:
        return await self.request("image_inspect", name=name)

    async def remove_image(self, name: str) -> dict:
        return await self.request("image_rm", name=name)

    async def tag_image(self, source: str, name: str) -> dict:
        """Name image `source` `name` too (docker tag): the same image, nothing
        copied; an image of that name is replaced. Result: the image under
        `name`, with `replaced` (the manifest the name had, or None)."""
        return await self.request("image_tag", source=source, name=name)

    async def flatten_image(self, name: str, as_name: str | None = None,
                            progress: Callable[[dict], None] | None = None) -> dict:
        """Image `name` as one layer (its layers merged as a sandbox sees
        them), the same config: under `as_name` (new; its parent is `name`),
        or `name` itself moves to it. `progress` gets each event:
        {"step": "queued", max} while it waits for one of
        images.max_flattens, {"step": "merge", layer, of, entries, bytes},
        then the pack's. Result:
        the flat image, with `flattened` (the manifest and layer count it
        was made from) and `replaced`."""
        args = {"name": name, **({"as_name": as_name} if as_name else {})}
        return await self._with_progress("image_flatten", args, progress)

    # ---------------------------------------------------------------- sandboxes

    async def create(self, image: str, cpu: float | None = None, memory: int | str | None = None,
                     pids: int | None = None, env: dict | None = None, labels: dict | None = None,
                     hostname: str | None = None, cwd: str | None = None, user: int | str | None = None,
                     ttl: float | str | None = None, idle_ttl: float | str | None = None,
                     lease: float | str | None = None, qos: str | None = None,
                     cpu_quota: bool | None = None, net: str | None = None,
                     allow: list[str] | None = None, key: str | None = None,
                     disk: int | str | None = None, publish: list[int | str] | None = None,
                     network_rules: dict[str, bool] | None = None, backend: str | None = None,
                     policy: str | dict | None = None) -> Sandbox:
        """allow: egress rules ("10.1.2.0/24:443/tcp", "pypi.org:443/tcp", "*.example.org:443")
        and rule-set names ("pypi"), with net="default".
        network_rules: the same as a dict, {"pypi": True}: the keys whose value is true join `allow`.
        publish: ports of the sandbox to make reachable from the host (Sandbox.get_host): 8080
        (TCP), "8080/tcp" or "5353/udp"; each on a host port the daemon picks.
        key: idempotency key; a retried create with the same key returns the same sandbox.
        Without one the SDK makes one (see _made_key), so a create whose
        answer a lost connection took is sent again once, and answered with
        the sandbox it made, instead of leaving that sandbox to nobody.
        disk: size cap of the writable layer ("20G"; default sandbox.disk).
        backend: "container" or "microvm" (a QEMU guest per sandbox; default sandbox.backend).
        env, cwd, user: over the image's config (env merged; default: the
        image's WorkingDir and User); user is a uid or "name", "uid:gid",
        "name:group", resolved in the image's /etc/passwd and /etc/group.
        A create runs nothing: `run` starts the image's Entrypoint and Cmd.
        policy: the task policy of every exec in it unless an exec names
        another: a name of the daemon's (`policy_list`) or an inline dict
        (docs/protocol.md, "Task policies")."""
        allow = list(allow or [])
        if network_rules is not None:
            if not isinstance(network_rules, dict):
                raise TypeError(f"network_rules must be a dict of rule -> bool, got {type(network_rules).__name__}")
            allow += [r for r, on in network_rules.items() if on and r not in allow]
        made_key = key is None
        if made_key:
            key = _made_key()
        args = _given({"image": image, "env": string_map(env, "env", raw=True), "labels": string_map(labels, "labels"),
                       "allow": allow, **({"publish": [_publish_spec(p) for p in publish]} if publish else {})},
                      cwd=cwd, user=user, cpu=cpu, memory=memory, pids=pids, hostname=hostname, ttl=ttl,
                      idle_ttl=idle_ttl, lease=lease, qos=qos, cpu_quota=cpu_quota, net=net, key=key, disk=disk,
                      backend=backend, policy=policy)
        try:
            info = _sandbox_info(await self.request("create", **args))
        except ConnectionLost as err:
            if not (made_key and err.sent):
                raise
            # Not sent again (no daemon answered in time, or lost again): the
            # caller can only settle it with the key it never saw.
            raise ConnectionLost(f"{err}; its key was {key!r}: a create of the same arguments with "
                                 f"key={key!r} (dsec create --key) answers with the sandbox it made, if any",
                                 target=err.target, op=err.op, sent=True) from None
        if made_key:
            # Its own key found again on a new connection: this create's
            # sandbox, not an earlier create's.
            info.pop("existing", None)
        return Sandbox(self, info["id"], info)

    def run_stream(self, image: str, args: list[str] | None = None, entrypoint: list[str] | str | None = None,
                   timeout: float | str | None = None, stdin: Stdin | None = None,
                   remove: bool = True, pty: bool = False, rows: int | None = None, cols: int | None = None,
                   **create_args) -> RunStream:
        """`async with c.run_stream(image, args) as run:` makes a sandbox of
        `image` (create's arguments: env, cwd, user, net, allow, memory, ...)
        and starts its command as `docker run` does: the image's Entrypoint
        and Cmd, `args` replacing Cmd, `entrypoint` replacing Entrypoint (and
        dropping Cmd). `async for fd, data in run` streams its output;
        `run.result` is its ExecResult, `run.sandbox` the sandbox. On the way
        out, however it is left (an error, a cancel), the sandbox is destroyed
        unless remove=False; meanwhile it is leased (RUN_LEASE_S), so it goes
        even if this process dies. pty: the command runs on a terminal of
        rows x cols (as exec_stream's; `run.stream.write` is its keyboard)."""
        return RunStream(self, image, args, entrypoint, timeout, stdin, remove, create_args,
                         {"pty": True, "rows": rows, "cols": cols} if pty else {})

    async def run(self, image: str, args: list[str] | None = None, entrypoint: list[str] | str | None = None,
                  timeout: float | str | None = None, stdin: Stdin | None = None,
                  on_stdout: Callable[[bytes], object] | None = None,
                  on_stderr: Callable[[bytes], object] | None = None, remove: bool = True,
                  **create_args) -> ExecResult:
        """`docker run --rm`: run_stream's command to its end, its output
        collected (on_stdout / on_stderr get each chunk as it comes); the
        sandbox is gone when this returns (unless remove=False). The
        ExecResult's exit_code is the command's."""
        async with self.run_stream(image, args, entrypoint, timeout, stdin, remove, **create_args) as run:
            return await _collect(run, on_stdout, on_stderr)

    async def run_detached(self, image: str, args: list[str] | None = None,
                           entrypoint: list[str] | str | None = None, **create_args) -> Process:
        """`docker run -d`: a sandbox of `image` (create's arguments) with
        run_stream's command started in it in the background; returns that
        Process (its `.sb` is the sandbox, which stays until destroyed:
        bound it with ttl= or lease=; idle_ttl= counts requests on the
        sandbox, not its command running, so it ends a quiet server
        too). Nothing is left if it fails."""
        return await run_detached(self, image, args, entrypoint, **create_args)

    def sandbox(self, image: str, **create_args) -> _SandboxContext:
        """`async with client.sandbox(image=...) as sb:` creates a sandbox
        (create's arguments) and destroys it on the way out, killing its
        execs; a destroy cut by a daemon restart is sent again to the next."""
        return _SandboxContext(self, image, create_args)

    async def call(self, image: str, argv: Command | None = None, code: str | None = None,
                   args: list[str] | None = None, stdin: bytes | bytearray | memoryview | None = None,
                   env: dict | None = None,
                   timeout: float | str | None = None) -> CallResult:
        """A stateless function call (FnCall backend): `argv`, or Python `code` run by a fork of
        the image's pre-imported zygote. Many may be in flight on one client."""
        if stdin is not None and not isinstance(stdin, (bytes, bytearray, memoryview)):
            raise TypeError(f"call stdin must be bytes, got {type(stdin).__name__}"
                            + (": encode it" if isinstance(stdin, str) else ""))
        if isinstance(timeout, str):        # "5m", as exec's
            timeout = parse_duration(timeout, "timeout")
        req = _given({"image": image, "env": string_map(env, "env", raw=True)},
                     argv=None if argv is None else command_argv(argv), code=code, args=args,
                     stdin=None if stdin is None else bytes(stdin), timeout=timeout)
        return CallResult.from_call(await self.request("call", **req))

    async def pool_set(self, image: str, min: int, max: int, cpu: float | None = None,
                       memory: int | str | None = None) -> dict:
        """Keep between min and max warm sandboxes of (image, cpu, memory); max=0 removes the pool."""
        args = _given({"image": image, "min": min, "max": max}, cpu=cpu, memory=memory)
        return await self.request("pool_set", **args)

    async def pool_list(self) -> list[dict]:
        return (await self.request("pool_list"))["pools"]

    async def drain(self, reason: str = "") -> dict:
        """Drain the host: it refuses new creates (`Busy`, detail `drained`) and
        refills no pool until undrain; its sandboxes run on. Kept across
        daemon restarts. Returns {drained, reason, since}."""
        return await self.request("drain", reason=reason)

    async def undrain(self) -> dict:
        """Take creates again after a drain. Returns {drained, reason, since}."""
        return await self.request("undrain")

    async def policy_list(self) -> dict:
        """The daemon's named task policies and its Landlock ABI (`dsec policy ls`)."""
        return await self.request("policy_list")

    async def net_sets(self) -> list[dict]:
        """The daemon's named rule sets for allow=[NAME]: [{name, rules}]."""
        return (await self.request("net_sets"))["sets"]

    async def job_pause(self, job: str) -> dict:
        """Pause every sandbox labelled job=<job>: frozen at once, memory reclaimed after."""
        return await self.request("job_pause", job=job)

    async def job_resume(self, job: str) -> dict:
        return await self.request("job_resume", job=job)

    async def job_rm(self, job: str, force: bool = False) -> dict:
        return await self.request("job_rm", job=job, force=force)

    async def renew(self, sandbox_ids: list[str], lease: float | str | None = None) -> dict:
        return await self.request("renew", sandboxes=list(sandbox_ids), lease=lease)

    def hold(self, sandbox_ids: list[str], lease: float | str | None,
             every: float | str | None = None) -> asyncio.Task:
        """Renew the leases of these sandboxes in the background until the task is
        cancelled or the client is closed; then they expire after `lease` seconds
        (None: each one's own lease, renewed `every` seconds). A renew that
        finds the connection gone is tried again (HOLD_RETRY_S) until it
        is back: the daemon's restart keeps the sandboxes, an ssh:// client
        reconnects, a fleet rejoins the host. Durations as create's lease:
        seconds or "90s", "5m"; one out of range is BadRequest here, not
        an end of the task behind it that nobody would see."""
        if lease is None and every is None:
            raise ValueError("hold: give the lease, or how often to renew (every=)")
        # Both checked here, whichever gives the period.
        given_every = parse_duration(every, "hold: every")
        given_lease = parse_duration(lease, "hold: lease")
        period = given_every or given_lease / 3

        async def renew_forever() -> None:
            failing = False
            while True:
                try:
                    await self.renew(sandbox_ids, lease)
                except ConnectionError as err:
                    if self._closed:
                        return
                    if not failing:
                        log.warning("hold on %s: renewing the leases failed (%s); trying again every %g s",
                                    self.target, err, min(period, HOLD_RETRY_S))
                    failing = True
                    await asyncio.sleep(min(period, HOLD_RETRY_S))
                    continue
                failing = False
                await asyncio.sleep(period)

        return asyncio.get_running_loop().create_task(renew_forever())

    async def events(self, sandbox: str | None = None, replay: bool = False,
                     follow: bool = True) -> AsyncIterator[dict]:
        """State changes (created, paused, resumed, expired, oom, died, destroyed) and task-policy
        denials (denied), as they happen; with replay, the recent history first; with
        follow=False, only that history.

        A lost connection (a daemon restart) is followed again on the next
        one, on a client that reconnects (the default): with the daemon's
        recent history (replay), so that what the next daemon published
        before then (a sandbox found dead at its start) is not missed, and
        what came already passed over (by its time and `seq`: the next
        daemon numbers from 1 again, later), as is, without replay, what
        the same daemon (reached again over ssh://) published before the
        follow began (by its time then, which a ping asks first); a
        `sandbox` prefix is asked for by the id its first event carried. No
        daemon runs meanwhile, so none is missed unless the next daemon
        published more than its history keeps (256) first. Lost
        FOLLOW_LOST_MAX times in a row with no event come (a daemon that
        drops the request), it ends with the ConnectionLost; followed
        again, a `sandbox` the next daemon no longer knows ends it with
        NotFound, saying so."""
        # `follow` only when it differs from the default, which older daemons do not know.
        extra = {} if follow else {"follow": False}
        last: tuple[float, int] | None = None          # the (time, seq) of the last event given
        if follow and not replay and _reconnects(self) and self.connected:
            # Followed again, it asks for the history, and the same daemon
            # (reached again over ssh://) has in it what came before this
            # follow began: passed over by the daemon's time now. (Not
            # connected, the request's own error says so.)
            now = (await self.request("ping")).get("time")
            if now is not None:
                last = (now, 0)
        again = False
        refollow = _Refollow()
        while True:
            args = {"sandbox": sandbox, "replay": replay or again, **extra}
            came = False
            refollow.attach()
            try:
                async with contextlib.aclosing(self.frames("events", **args)) as frames:
                    async for frame in frames:
                        came = True
                        if "__result__" in frame:
                            return
                        if sandbox and frame.get("sandbox"):
                            # Followed again, by the id the daemon resolved `sandbox` to: a
                            # prefix resolved again by the next daemon may name another
                            # sandbox by then (this one destroyed, a new one sharing it).
                            sandbox = frame["sandbox"]
                        at = (frame.get("time", 0.0), frame.get("seq", 0))
                        if again and last is not None and at <= last:
                            continue                    # given before the loss
                        last = at
                        yield frame
                return
            except ConnectionLost as err:
                # Not sent: the daemon did not answer again (reconnect_timeout).
                if not (err.sent and _reconnects(self)):
                    raise
                again = True
                await refollow.lost(err, came)
            except NotFound as err:
                if not (again and sandbox and not came):
                    raise
                # Its answer alone would read as if the follow named a
                # sandbox that never was.
                raise NotFound(f"events of sandbox {sandbox}: followed again after the connection to the daemon "
                               "was lost (a daemon restart), the daemon has no such sandbox any more (destroyed "
                               f"before the restart, or meanwhile): its events end here: {err.message}",
                               err.detail) from None

    async def get(self, sandbox_id: str) -> Sandbox:
        info = _sandbox_info(await self.request("inspect", sandbox=sandbox_id))
        return Sandbox(self, info["id"], info)

    async def list(self, labels: dict | None = None) -> list[dict]:
        return [_sandbox_info(s) for s in (await self.request("list", labels=labels or {}))["sandboxes"]]

    async def destroy_all(self, force: bool = False, labels: dict | None = None) -> dict:
        return await self.request("destroy_all", force=force, labels=labels or {})

    async def top(self, labels: dict | None = None) -> dict:
        """Sampled CPU/memory use per sandbox and for the host (see `dsec top`)."""
        return await self.request("top", labels=labels or {})


class _SandboxContext:
    """Client.sandbox() (and Fleet.sandbox(): `client` is then the fleet):
    create on enter, destroy (force) on exit."""

    def __init__(self, client, image: str, create_args: dict):
        self.client = client
        self.image = image
        self.create_args = create_args
        self.sandbox: Sandbox | None = None

    async def __aenter__(self) -> Sandbox:
        self.sandbox = await self.client.create(self.image, **self.create_args)
        return self.sandbox

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self.sandbox is not None:
            try:
                await _destroy_on_the_way_out(self.sandbox)
            except NotFound:
                pass                        # destroyed inside the block already
            except (DsecError, ConnectionError) as err:
                if exc_type is None:
                    raise
                # The block's own error (a cancel, an asyncio.timeout's)
                # is the one raised: replaced, a timeout would not be one,
                # a TaskGroup's cancelled task would fail.
                _left_behind(self.sandbox, err)


def _left_behind(sb, err: BaseException) -> None:
    """Say that the destroy of `sb`, on the way out of a sandbox() block (or
    a run) that ended by an error of its own, failed with `err`: that error
    is raised, or nobody is left to raise it to."""
    log.warning("sandbox %s on %s was not destroyed as its block ended (%s); remove it with "
                "`dsec rm --force %s`", sb.id, sb.host, err, sb.id)


async def _destroy_on_the_way_out(sb) -> dict:
    """sb.destroy(force=True) for a block or a run that ends, however it
    ends. Shielded: a cancel is one way to get here, and the sandbox must
    go all the same. A second cancel ends the caller's wait, not the
    destroy: it goes on as one of its client's undos (close() waits for
    them), and its failure is logged then, as nobody is left to raise it
    to. Its own failure is raised to a caller that waits."""
    destroy = asyncio.ensure_future(_destroy_again_if_lost(sb))
    undoing = getattr(sb.client, "_undoing", None)
    if undoing is not None:
        undoing.add(destroy)
        destroy.add_done_callback(undoing.discard)
    try:
        return await asyncio.shield(destroy)
    except asyncio.CancelledError:
        destroy.add_done_callback(lambda fut: _unheard_destroy(sb, fut))
        raise


async def _destroy_again_if_lost(sb) -> dict:
    """sb.destroy(force=True), sent again once if its connection was lost
    after it was sent (a daemon restart), on a client that reconnects: the
    first may have run, in part or whole, and the second ends what it did
    not, or finds the sandbox gone (NotFound, which the callers take as
    done), or still being destroyed by the first (the same daemon, reached
    again over ssh://: it finishes a destroy whose client went)."""
    try:
        return await sb.destroy(force=True)
    except ConnectionLost as err:
        if not (err.sent and _reconnects(sb.client)):
            raise
    try:
        return await sb.destroy(force=True)
    except Conflict:
        info = await sb.client.request("inspect", sandbox=sb.id)        # NotFound: gone since
        if info.get("state") != "stopping":
            raise
        return {"id": sb.id, "previous_state": None}


def _unheard_destroy(sb, fut: asyncio.Future) -> None:
    """The end of a destroy whose caller stopped waiting for it: a failure
    said (and retrieved), as nobody else will see it."""
    if fut.cancelled():
        _left_behind(sb, asyncio.CancelledError("its destroy was cancelled (the event loop ended?)"))
    elif (err := fut.exception()) is not None and not isinstance(err, NotFound):
        _left_behind(sb, err)


def _run_args(args: list[str] | None) -> list[str] | None:
    if args is not None and (isinstance(args, str) or not all(isinstance(a, str) for a in args)):
        raise TypeError(f"args must be a list of strings (they replace the image's Cmd), got {args!r}")
    return None if args is None else list(args)


async def _run_argv(client, image: str, args: list[str] | None, entrypoint: list[str] | str | None) -> list[str]:
    """What a run of `image` starts, as docker run says: its Entrypoint and
    Cmd, args replacing Cmd, entrypoint replacing Entrypoint (and Cmd)."""
    config = (await client.inspect_image(image))["config"]
    try:
        return imageconfig.run_argv(config, args, entrypoint)
    except imageconfig.ConfigError as err:
        raise BadRequest(f"run {image}: {err} (args=)", {"image": image, "needs": "command"}) from None


async def run_detached(client, image: str, args: list[str] | None = None,
                       entrypoint: list[str] | str | None = None, **create_args) -> Process:
    """`docker run -d` on `client` (a Client, or anything with its
    inspect_image and create: the fleet's placing one): a sandbox of `image`
    with the run's command started in it as a background process. If the
    command cannot be started the sandbox is removed again, so a failed or
    cancelled run leaves nothing behind."""
    argv = await _run_argv(client, image, _run_args(args), entrypoint)
    sb = await client.create(image, **create_args)
    try:
        return await sb.spawn(argv)
    except BaseException:
        try:
            await _destroy_on_the_way_out(sb)
        except NotFound:
            pass
        except (DsecError, ConnectionError) as err:
            _left_behind(sb, err)           # the spawn's error is the one raised
        raise


class RunStream:
    """Client.run_stream: an image's command in a sandbox of its own, which
    goes when the block ends. Iterate it for (fd, data)."""

    def __init__(self, client: Client, image: str, args: list[str] | None, entrypoint: list[str] | str | None,
                 timeout: float | None, stdin: Stdin | None, remove: bool,
                 create_args: dict, terminal: dict | None = None):
        self.client = client
        self.terminal = terminal or {}          # exec_stream's pty, rows, cols
        self.image = image
        self.args = _run_args(args)
        self.entrypoint = entrypoint
        self.timeout = timeout
        self.stdin = stdin
        self.remove = remove
        self.create_args = create_args
        self.argv: list[str] | None = None          # what runs, once the block is entered
        self.sandbox: Sandbox | None = None
        self.stream: ExecStream | None = None
        self._hold: asyncio.Task | None = None

    @property
    def result(self) -> ExecResult | None:
        return self.stream.result if self.stream is not None else None

    async def __aenter__(self) -> RunStream:
        self.argv = await _run_argv(self.client, self.image, self.args, self.entrypoint)
        create_args = dict(self.create_args)
        if self.remove:
            create_args.setdefault("lease", RUN_LEASE_S)
        self.sandbox = await self.client.create(self.image, **create_args)
        try:
            if self.remove:      # renewed at a third of the lease, to the lease it was made with
                every = parse_duration(create_args["lease"], "lease") / 3
                # The sandbox's own client: a fleet's run (dsec fleet run) made it on its host's.
                self._hold = self.sandbox.client.hold([self.sandbox.id], None, every)
            self.stream = self.sandbox.exec_stream(self.argv, timeout=self.timeout, stdin=self.stdin,
                                                   **self.terminal)
        except BaseException:
            await self._remove(True)
            raise
        return self

    async def __aiter__(self):
        assert self.stream is not None, "iterate a RunStream inside its `async with` block"
        async with contextlib.aclosing(aiter(self.stream)) as chunks:      # closed with this one
            async for chunk in chunks:
                yield chunk

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self._remove(exc_type is not None)

    async def _remove(self, failing: bool) -> None:
        if self._hold is not None:
            self._hold.cancel()
            with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
                await self._hold
        if not self.remove or self.sandbox is None:
            return
        # A cancel (Ctrl-C in `dsec run`) is what often brings us here.
        try:
            await _destroy_on_the_way_out(self.sandbox)
        except NotFound:
            pass                                   # gone already (its lease ran out, or removed by hand)
        except (DsecError, ConnectionError) as err:
            if not failing:                        # else the error that brought us here is the one to see
                raise
            _left_behind(self.sandbox, err)


class ExecStream:
    """Async iterator of (fd, bytes) output chunks; `.result` once it is exhausted.

    Iterating sends the exec. While it runs, `write` sends input (to a pty
    exec: typed into its terminal, b"\\x03" is ^C), `resize` sets a pty
    exec's window size and `signal` signals its process group; they wait
    until the exec request is on the wire, so they are called from another
    task than the one iterating (or between its chunks)."""

    def __init__(self, sb: Sandbox, args: dict, stdin: Stdin | None):
        if not (stdin is None or isinstance(stdin, (bytes, bytearray, memoryview)) or hasattr(stdin, "__aiter__")):
            hint = ": encode it" if isinstance(stdin, str) else " (b\"\".join(...) a list of chunks)"
            raise TypeError(f"stdin must be bytes or an async iterator of bytes, got {type(stdin).__name__}{hint}")
        self.sb = sb
        self.args = args
        self.stdin = stdin
        self.result: ExecResult | None = None
        self.exec_id = sb.client.new_id()        # the exec request's id: exec_input and exec_resize name it
        self._sent = asyncio.Event()
        self._iterated = False
        self._stdin_failed: Exception | None = None      # the stdin iterator's own error
        # Why the exec ended before it was sent (set then, with _sent, so
        # that write, resize and signal waiting for it end too).
        self._unsent: BaseException | None = None

    async def _until_sent(self, op: str) -> None:
        """Wait until the exec request is on the wire; raise if it ended without being sent."""
        await self._sent.wait()
        if self._unsent is not None:
            text = (f"{op}: exec {self.args['argv']!r} in {self.sb.id} was never sent, so it did not run: "
                    f"{type(self._unsent).__name__}: {self._unsent}")
            if isinstance(self._unsent, ConnectionError):
                raise ConnectionLost(text, target=self.sb.client.target, op=op, sent=False)
            raise RuntimeError(text)

    async def write(self, data: bytes) -> None:
        """Input for the running exec (one exec_input; waits while it does not read)."""
        await self._until_sent("exec_input")
        await self.sb.client.request("exec_input", exec_id=self.exec_id, data=bytes(data))

    async def resize(self, rows: int, cols: int) -> None:
        """A pty exec's window size; its foreground process group gets SIGWINCH."""
        await self._until_sent("exec_resize")
        await self.sb.client.request("exec_resize", exec_id=self.exec_id, rows=rows, cols=cols)

    async def signal(self, signal: int | str) -> None:
        """Send a signal to the running exec's process group: a number or a
        name ("INT", "SIGTERM"); one still starting gets it once it has
        started. NotFound when it has ended."""
        await self._until_sent("exec_signal")
        sig = int(signal) if not isinstance(signal, str) else signal
        await self.sb.client.request("exec_signal", exec_id=self.exec_id, signal=sig)

    async def _feed(self, exec_id: int, sent: asyncio.Event) -> None:
        """stdin as exec_input requests; a stdin iterator that fails cancels the exec."""
        c = self.sb.client
        await sent.wait()      # exec_input must follow the exec request on the wire
        chunk = c.server.get("limits", {}).get("max_file_chunk_bytes", DEFAULT_CHUNK)
        if isinstance(self.stdin, (bytes, bytearray, memoryview)):
            data = bytes(self.stdin)
            for i in range(0, len(data), chunk):
                await c.request("exec_input", exec_id=exec_id, data=data[i:i + chunk])
        elif self.stdin is not None:
            source = aiter(self.stdin)
            while True:
                try:
                    piece = await anext(source)
                    if not isinstance(piece, (bytes, bytearray, memoryview)):
                        raise TypeError(f"exec stdin: the async iterator gave a {type(piece).__name__}; give bytes"
                                        + (": encode it" if isinstance(piece, str) else ""))
                except StopAsyncIteration:
                    break
                except Exception as err:
                    # The command would wait for the rest of its input, and
                    # its caller with it: it is cancelled (killed), and
                    # __aiter__ raises the iterator's error once it has ended
                    # (which may come before the cancel's own answer).
                    self._stdin_failed = err
                    await _cancel(c, exec_id)
                    return
                await c.request("exec_input", exec_id=exec_id, data=bytes(piece))
        await c.request("exec_input", exec_id=exec_id, eof=True)

    async def __aiter__(self):
        if self._iterated:
            # Again, it would run the command a second time, under the same request id.
            raise RuntimeError(f"exec_stream {self.args['argv']!r} in {self.sb.id} runs once: it was iterated "
                               "already (its output went to that loop; .result is its result); call "
                               "exec_stream again to run the command again")
        self._iterated = True
        c = self.sb.client
        feeder = None
        rid, sent = self.exec_id, self._sent
        if self.stdin is not None:
            feeder = asyncio.get_running_loop().create_task(self._feed(rid, sent))
        failure: BaseException | None = None
        lost = 0
        try:
            async with contextlib.aclosing(c.frames_with_id(rid, "exec", self.args, sent)) as frames:
                async for frame in frames:
                    if "__result__" in frame:
                        self.result = ExecResult.from_result(frame["__result__"])
                        self.result.lost_output = lost
                        return
                    if frame.get("lost"):           # taken up again after a loss, past what the daemon kept
                        lost += frame["lost"]
                        continue
                    if "data" not in frame:         # {"resumed": true}: sent again, and taken up
                        continue
                    yield frame["fd"], frame["data"]
        except BaseException as err:
            failure = err
            raise
        finally:
            if feeder:
                if not feeder.done():
                    feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
                    await feeder
            if not sent.is_set():
                # Never sent (its connection lost for good, its arguments
                # refused here, the loop closed early): write, resize and
                # signal waiting for it raise instead of waiting for ever.
                self._unsent = failure or RuntimeError("the loop iterating it stopped first")
                sent.set()
            if feeder and self._stdin_failed is not None:
                raise self._stdin_failed


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


class _Refollow:
    """How a follow (Client.events, Sandbox.watch, Process.output) is taken
    up again after each lost connection: at once after one of which a
    frame came; else after a gap, doubled at each such loss in a row (a
    daemon that drops the connection at once is not asked in a tight loop;
    a restart drops it once), and not after FOLLOW_LOST_MAX of them (lost
    raises)."""

    def __init__(self):
        self.gap = RECONNECT_GAP_S
        self.in_a_row = 0             # losses with no frame come, none of a lived attach between
        self.began = 0.0

    def attach(self) -> None:
        self.began = asyncio.get_running_loop().time()

    async def lost(self, err: ConnectionLost, came: bool) -> None:
        """The attach begun last was lost with `err`; `came`: a frame of it came."""
        if came:
            self.in_a_row, self.gap = 0, RECONNECT_GAP_S
            return
        if asyncio.get_running_loop().time() - self.began >= FOLLOW_ATTACHED_S:
            self.in_a_row, self.gap = 0, RECONNECT_GAP_S
        self.in_a_row += 1
        if self.in_a_row >= FOLLOW_LOST_MAX:
            raise ConnectionLost(
                f"{err}; it was lost {self.in_a_row} times in a row without a frame of it coming: the daemon "
                "takes the connection and drops the request each time (see its log), so it was not asked again",
                target=err.target, op=err.op, sent=err.sent) from None
        self.gap = min(2 * self.gap, RECONNECT_GAP_MAX_S)
        await asyncio.sleep(self.gap)


def _reconnects(client) -> bool:
    """Whether `client` connects again after a loss (a Client made with
    reconnect, not closed): a request it lost may go again on it."""
    return bool(getattr(client, "reconnect", False)) and not getattr(client, "_closed", True)


async def _cancel(client, rid: int) -> None:
    """Cancel request `rid`, whose input failed: its source's own error is
    raised once the request has ended."""
    with contextlib.suppress(DsecError, ConnectionError):
        await client.request("cancel", target=rid)


class Sandbox:
    def __init__(self, client: Client, sandbox_id: str, info: dict):
        self.client = client
        self.id = sandbox_id
        self.info = info

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.get('state')} on {self.client.target}>"

    @property
    def host(self) -> str:
        """Where it lives: its daemon's socket path or ssh:// address."""
        return self.client.target

    def _exec_args(self, argv, env, cwd, user, timeout, stdin: bool, stream: bool, trace: bool = False,
                   pty: bool = False, rows: int | None = None, cols: int | None = None,
                   policy: str | dict | None = None) -> dict:
        if isinstance(timeout, str):        # "5m", as a ttl takes it
            timeout = parse_duration(timeout, "timeout")
        args = _given({"sandbox": self.id, "argv": command_argv(argv), "env": string_map(env, "env", raw=True),
                       "stdin": stdin, "stream": stream, "trace": trace}, cwd=cwd, user=user, timeout=timeout,
                      policy=policy)
        if pty:            # sent only when asked: older daemons do not know the fields
            args.update(_given({"pty": True, "stdin": True}, rows=rows, cols=cols))
        elif rows is not None or cols is not None:
            raise ValueError("rows and cols are a terminal's window size: give them with pty=True")
        return args

    async def exec(self, argv: Command, timeout: float | str | None = None, env: dict | None = None,
                   cwd: str | None = None, user: int | str | None = None, stdin: Stdin | None = None,
                   trace: bool = False, on_stdout: Callable[[bytes], object] | None = None,
                   on_stderr: Callable[[bytes], object] | None = None, pty: bool = False,
                   rows: int | None = None, cols: int | None = None,
                   policy: str | dict | None = None, key: str | None = None) -> ExecResult:
        """Run a command (an argv list, or a string run by /bin/sh -c); return
        its collected output and status (and, with trace, the ptrace record of
        what it executed, opened and connected to). on_stdout / on_stderr get
        each chunk as it arrives (a coroutine function is awaited). With pty,
        it runs on a terminal (rows x cols, default 24 x 80): `stdin` is typed
        into it, and everything it shows (echo included) is in stdout.
        policy: the task policy it runs under (a name or an inline dict;
        default: the sandbox's). user: a uid, or as `docker exec --user` a
        name, "name:group" or "uid:gid" from the sandbox's /etc/passwd and
        /etc/group (default: the sandbox's user).
        key: idempotency key of an exec without stdin or pty; without one
        the SDK makes one over an ssh:// link (where the daemon takes them),
        so an exec whose connection was lost is sent again on the next and
        answered with its one run's result (with on_stdout or on_stderr, its
        output taken up where it stopped: see exec_stream), instead of
        running twice or not at all. Given again with the same arguments,
        it is answered with that run's result. On a local socket none is
        made: a connection lost there is a daemon that stopped, whose
        successor could only say the exec's outcome is unknown (as
        ConnectionLost does), and a key costs the daemon a journal write
        per exec."""
        if stdin is None and on_stdout is None and on_stderr is None and not pty:
            args = self._exec_args(argv, env, cwd, user, timeout, False, False, trace, pty, rows, cols, policy)
            r = await self._keyed("exec", args, key, make_key=self.client.key_execs)
            return ExecResult.from_result(r)
        stream = self.exec_stream(argv, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin, trace=trace,
                                  pty=pty, rows=rows, cols=cols, policy=policy, key=key)
        return await _collect(stream, on_stdout, on_stderr)

    def exec_stream(self, argv: Command, timeout: float | str | None = None, env: dict | None = None,
                    cwd: str | None = None, user: int | str | None = None,
                    stdin: Stdin | None = None, trace: bool = False, pty: bool = False,
                    rows: int | None = None, cols: int | None = None,
                    policy: str | dict | None = None, key: str | None = None) -> ExecStream:
        """The exec as an ExecStream of (fd, data). With pty, it runs on a
        terminal of rows x cols (default 24 x 80), its output one stream (fd
        1); send keystrokes with `write`, the window size with `resize`. An
        end of `stdin` does not end a terminal's input: send b"\\x04" (^D).
        key: idempotency key of one without stdin or pty; over an ssh://
        link the SDK makes one where the daemon takes them (its hello lists
        "op.keys.stream"). A lost connection then sends it again, after each
        loss that output came before: the command runs once, and its output
        goes on from the bytes that came (those the daemon no longer had, in
        result.lost_output)."""
        if key is not None and (stdin is not None or pty):
            raise ValueError("key is for an exec without stdin or pty: sent again, its input would go twice, "
                             "or part of it be lost")
        args = self._exec_args(argv, env, cwd, user, timeout, stdin is not None, True, trace, pty, rows, cols,
                               policy)
        _with_key(args, key, stdin is None and not pty and self.client.key_execs
                  and "op.keys.stream" in self.client.server.get("capabilities", ()))
        return ExecStream(self, args, stdin)

    async def spawn(self, argv: Command, env: dict | None = None, cwd: str | None = None,
                    user: int | str | None = None, stdin: bool = True, policy: str | dict | None = None,
                    key: str | None = None) -> Process:
        """Start a background process (an argv list, or a string run by
        /bin/sh -c); returns once it runs. It outlives this client and a
        daemon restart; take it up again with `process(pid)`. stdin: a pipe
        fed by Process.write until close_stdin (False: /dev/null). policy:
        its task policy, as exec's. Cancelled, it leaves no process running.
        key: idempotency key, as exec's (the SDK makes one if none is given):
        sent again, the start answers with the process it started."""
        args = _given({"sandbox": self.id, "argv": command_argv(argv), "env": string_map(env, "env", raw=True),
                       "stdin": stdin}, cwd=cwd, user=user, policy=policy)
        r = await self._keyed("proc_start", args, key)
        # Its input counted from its start, where the daemon checks offsets
        # (op.keys); not that of a process an earlier spawn of the caller's
        # key started (`existing`), which may have had input since.
        counted = stdin and "existing" not in r and "op.keys" in self.client.server.get("capabilities", ())
        return Process(self, r["pid"], 0 if counted else None)

    async def _keyed(self, op: str, args: dict, key: str | None,
                     progress: Callable[[dict], None] | None = None, make_key: bool = True) -> dict:
        """Request `op` (KEYED) with idempotency key `key`, or (make_key)
        one the SDK makes where the daemon takes keys for it (its hello
        lists "op.keys"), so that a lost connection sends it again instead
        of leaving its outcome unknown."""
        made_key = _with_key(args, key, make_key and "op.keys" in self.client.server.get("capabilities", ()))
        # Lost and not answered again, its ConnectionLost names the key (lost_after_sending).
        if op == "snapshot":
            r = await self.client._with_progress(op, args, progress)
        else:
            r = await self.client.request(op, **args)
        if made_key:
            # Its own key found again on a new connection: this request's answer, not an earlier one's.
            r.pop("existing", None)
        return r

    def process(self, pid: int) -> Process:
        """A background process of this sandbox by its pid (from spawn, processes() or `dsec proc ls`)."""
        return Process(self, pid)

    async def processes(self) -> list[ProcStatus]:
        """Its background processes, running and exited (kept until evicted), oldest first."""
        r = await self.client.request("proc_list", sandbox=self.id)
        return [ProcStatus.from_wire(p) for p in r["processes"]]

    async def write_file(self, path: str, data, mode: int = 0o644, parents: bool = True,
                         atomic: bool = True, owner: int | str | None = None) -> int:
        """Write `data` to `path`: bytes-like, or, without holding it all in
        memory, a binary file open for reading (read from where it is to its
        end), an asyncio StreamReader (or any reader whose `read(n)` is a
        coroutine) or an async iterable of bytes (any size: chunked under
        the frame limit). The bytes written.
        Atomic (the default): written under a temporary name beside the
        target and renamed over it, so a write that fails (ENOSPC, the
        sandbox's memory limit, a lost connection, a failed read of the
        source) leaves the old file or none at `path`, never a part, and
        readers in the sandbox see the old bytes or the new ones. The
        temporary file is removed when a write fails; one cut by a lost
        connection (the client killed) is removed by the daemon when the
        connection drops, and one cut by the daemon's death by the next
        daemon at its start (it records the file while it is temporary; in
        a microVM whose guest agent predates inode numbers, such a part
        stays beside the target as `.dsec-<hex>`). A file it replaces
        passes on its owner, group and mode; a new file gets `mode`. A
        symlink at `path` is replaced, not written through, and hard links
        to the old file keep the old bytes.
        With atomic=False the bytes go into the file in place (through a
        symlink, keeping the inode), and a failure leaves what was written
        so far. `owner`: who a new file (and the parents it makes) belongs
        to, as exec's `user` names one (a uid, "name", "uid:gid",
        "name:group"); the sandbox's root by default, as `docker cp` gives
        it. Bytes-like `data` whose write a lost connection cut (a daemon
        restart) is written again whole, once, on the next connection: the
        same bytes to the same path end as one write would (a stream,
        read once, cannot be: its ConnectionLost says what became of
        `path`)."""
        try:
            return await self._write_file(path, data, mode, parents, atomic, owner)
        except ConnectionLost as err:
            if not (isinstance(data, (bytes, bytearray, memoryview)) and err.sent and _reconnects(self.client)):
                raise
        return await self._write_file(path, data, mode, parents, atomic, owner)

    async def _write_file(self, path: str, data, mode: int, parents: bool, atomic: bool,
                          owner: int | str | None) -> int:
        pieces = file_pieces(data, self._chunk_size(), "write_file")
        if not atomic:
            return await self._write_chunks(path, pieces, mode, parents, owner=owner)
        parent, _, name = posixpath.normpath(path).rpartition("/")
        if not path.startswith("/") or not name:
            raise ValueError(f"write_file: give an absolute path of a file, got {path!r}")
        tmp = f"{parent}/.dsec-{secrets.token_hex(6)}"         # short: the target's name may be 255 bytes
        made_on: list[_Conn | None] = []
        renaming = False
        try:
            size = await self._write_chunks(tmp, pieces, mode, parents, temporary=True, owner=owner,
                                            made_on=made_on)
            renaming = True
            await self.client.request("file_rename", sandbox=self.id, src=tmp, dst=path, overwrite=True,
                                      keep_attrs=True)
        except BaseException as err:
            removed = False
            with contextlib.suppress(DsecError, ConnectionError):
                await asyncio.shield(self.remove(tmp))
                removed = True
            if isinstance(err, NotFound) and made_on and self._connection_now() is not made_on[0]:
                # The connection the temporary file was made on was lost (a
                # daemon restart), and the file with it (the daemon removes
                # one whose connection ended); a later piece, or the rename,
                # went on the next connection and found it gone.
                raise self._temporary_write_lost(path, "", sent=True) from None
            if isinstance(err, ConnectionLost) and err.sent and renaming:
                raise ConnectionLost(
                    f"file_write on {self.client.target}: connection lost while renaming the file written over "
                    f"{self.id}:{path}: the rename may have replaced it (read it to know)",
                    target=self.client.target, op="file_write", sent=True) from None
            if isinstance(err, ConnectionLost):
                # Lost under a piece: the temporary file went with the
                # connection (or was removed above), never renamed over
                # `path`. (What the lost request's own error said, that it
                # may have been carried out, is not so of the write; why
                # one never sent was not is.)
                raise self._temporary_write_lost(path, "" if err.sent else f" ({err})", err.sent) from None
            if isinstance(err, DsecError):      # the caller knows no temporary file: name theirs
                raise named_as(err, tmp, path, removed, verb=("rename", "write")) from None
            raise
        return size

    def _temporary_write_lost(self, path: str, why: str, sent: bool) -> ConnectionLost:
        """The error of an atomic write_file whose temporary file went with a
        lost connection before its rename: `path` is as it was. `why`: what
        to add after the path (the loss's own error, or "")."""
        return ConnectionLost(
            f"file_write on {self.client.target}: connection lost while writing {self.id}:{path}{why}: the part "
            f"written went with it (it was written under a temporary name), and {path} is as it was; write it "
            "again", target=self.client.target, op="file_write", sent=sent)

    def _connection_now(self) -> _Conn | None:
        """The client's connection at this moment (a new one after a loss);
        None for a client that keeps none of its own."""
        return getattr(self.client, "_conn", None)

    def _sets_attrs(self) -> bool:
        """Whether the daemon serves set_attrs and lists a put's directory
        entries (upload_tar's `dirs`): capability files.attrs."""
        return "files.attrs" in self.client.server.get("capabilities", ())

    def _keeps_temporaries(self) -> bool:
        """Whether the daemon takes `temporary` on file_write and file_tar_put
        (an older one refuses the field: the copy then goes without it, its
        part left behind only if this client is killed mid-copy)."""
        return "files.temporary" in self.client.server.get("capabilities", ())

    def _chunk_size(self) -> int:
        """The most bytes one file_write or file_read request carries."""
        return self.client.server.get("limits", {}).get("max_file_chunk_bytes", DEFAULT_CHUNK)

    async def _write_chunks(self, path: str, pieces: AsyncIterator, mode: int, parents: bool,
                            temporary: bool = False, owner: int | str | None = None,
                            made_on: list | None = None) -> int:
        """The first piece truncates (or creates) the file; the others go at
        their offsets, PIPELINE requests at once, so that one piece travels
        while the sandbox's copier writes the one before (and the next is
        read from its source). The bytes written. `made_on` gets the
        connection the file was made on."""
        # A chunk whose request is cancelled goes on in the daemon (its open
        # runs in a worker) and makes the file again if it is missing: a
        # cancelled write lets the chunks in flight end before it ends, so
        # that whoever then removes the file comes after them.
        in_flight: set[asyncio.Future] = set()

        async def put(**args) -> dict:
            fut = asyncio.ensure_future(self.client.request("file_write", sandbox=self.id, path=path, **args))
            in_flight.add(fut)
            fut.add_done_callback(_settled_in(in_flight))
            return await asyncio.shield(fut)

        try:
            async with contextlib.aclosing(pieces):
                first = await anext(pieces)
                    # temporary: the daemon records the file until its rename, and a daemon
                # that dies first has the next one remove it. Sent only when true.
                # owner: on the piece that makes the file; sent only when given.
                made = await put(data=bytes(first), mode=mode, parents=parents,
                                 **({"temporary": True} if temporary and self._keeps_temporaries() else {}),
                                 **({"owner": owner} if owner is not None else {}))
                # The later pieces go into that very file (a container's
                # daemon names it): if it was removed meanwhile (a temporary
                # file whose connection ended, the client reconnecting), they
                # fail instead of making a new one without the pieces before.
                same = {"same_as": made["file"]} if made.get("file") else {}
                if made_on is not None:
                    made_on.append(self._connection_now())
                written = len(first)
                taking = asyncio.Lock()         # one writer reads the source at a time
                failed: list[Exception] = []

                async def writer() -> None:
                    nonlocal written
                    while not failed:
                        try:
                            async with taking:
                                piece = await anext(pieces, None)
                                if piece is None or failed:
                                    return
                                offset, written = written, written + len(piece)
                            await put(offset=offset, data=piece, **same)       # packed as is
                        except Exception as err:
                            failed.append(err)

                # A failure (of a write, or of the source's read) stops new
                # pieces but lets the one in flight end: whoever then removes
                # the file must not race a write still going on.
                await asyncio.gather(*(writer() for _ in range(PIPELINE)))
                if failed:
                    raise failed[0]
                return written
        except asyncio.CancelledError:
            if in_flight:
                await asyncio.wait(set(in_flight))
            raise

    async def write_at(self, path: str, offset: int, data: bytes) -> int:
        """Write `data` at `offset` of a file (made if missing), neither
        truncating nor appending; any size, in chunks at their offsets, one
        after another (a failure leaves those before it written). The
        file's size after it."""
        data = file_data(data, "write_at")
        chunk = self._chunk_size()
        view = memoryview(data)
        for start in range(0, max(len(view), 1), chunk):
            r = await self.client.request("file_write", sandbox=self.id, path=path, offset=offset + start,
                                          data=bytes(view[start:start + chunk]))
        return r["size"]

    async def read_file(self, path: str) -> bytes:
        """The whole file (read_chunks, joined once). A file replaced while
        it is read (an atomic write, a `mv` over it) is read again from the
        start, up to READ_AGAIN times, so the bytes are never part old, part
        new; a file replaced faster than that raises Conflict (detail
        "replaced"). A file changed in place (not replaced) while it is read
        is not detected: what its writer has not finished may be read."""
        again = 0
        while True:
            try:
                return await self._read_whole(path)
            except Conflict as err:
                again += 1
                if not _read_again(err, again):
                    raise

    async def read_file_to(self, path: str, file) -> int:
        """The file's bytes written into `file` (a binary file open for
        writing) as they come, never all in memory; the bytes written. A
        file replaced while it is read is read again, as read_file does,
        into a seekable `file` from where it was (what was written since
        truncated); into one that is not (a pipe), Conflict (detail
        "replaced")."""
        loop = asyncio.get_running_loop()
        start = file.tell() if file.seekable() else None
        again = 0
        while True:
            written = 0
            try:
                async with contextlib.aclosing(self.read_chunks(path)) as chunks:
                    async for piece in chunks:
                        await loop.run_in_executor(None, _write_all, file, piece)
                        written += len(piece)
                return written
            except Conflict as err:
                again += 1
                if start is None or not _read_again(err, again):
                    raise
                file.seek(start)
                file.truncate()

    async def _read_whole(self, path: str) -> bytes:
        async with contextlib.aclosing(self.read_chunks(path)) as chunks:
            parts = [piece async for piece in chunks]
        return b"".join(parts)

    async def read_chunks(self, path: str) -> AsyncIterator[bytes | memoryview]:
        """The file's bytes in order, one chunk (at most the frame limit) at a
        time, the next PIPELINE read ahead meanwhile; as frame tails (views
        of the frames) where the daemon sends them. Every chunk comes from
        the file the first came from: one replaced meanwhile raises Conflict
        (detail "replaced"), as nothing already given can be read again
        (read_file and read_file_to start again)."""
        chunk = self._chunk_size()
        tail = {"tail": True} if self.client._tails else {}

        async def read_at(offset: int, **same_as) -> dict:
            return await self.client.request("file_read", sandbox=self.id, path=path, offset=offset, length=chunk,
                                             **tail, **same_as)

        first = (await read_at(0))
        if len(first["data"]) < chunk:
            yield first["data"]
            return
        # The file the first chunk came from (a container's daemon says): the
        # others must come from it too, or the daemon answers conflict.
        same_as = {"same_as": first["file"]} if "file" in first else {}
        ahead: collections.deque[asyncio.Task] = collections.deque()
        next_offset = chunk

        def read_ahead() -> None:
            nonlocal next_offset
            while len(ahead) < PIPELINE:
                ahead.append(asyncio.ensure_future(read_at(next_offset, **same_as)))
                next_offset += chunk

        try:
            read_ahead()
            yield first["data"]
            while True:
                data = (await ahead[0])["data"]
                ahead.popleft()
                if len(data) < chunk:       # the end of the file
                    if data:
                        yield data
                    return
                read_ahead()
                yield data
        finally:
            for task in ahead:
                task.cancel()
            await asyncio.gather(*ahead, return_exceptions=True)

    async def list_files(self, path: str, depth: int = 1) -> Listing:
        """A directory's entries; with depth > 1 its subdirectories' too ("a/b").
        Names are str: one that is not UTF-8 has its odd bytes as
        surrogates, as os.listdir gives it (os.fsencode(name): its bytes),
        and is a path the other calls take as it is. A list, whose
        `truncated` is true when the directory holds more entries than one
        listing gives (100,000): only some of them are in it."""
        args = {"sandbox": self.id, "path": path}
        if depth != 1:          # sent only when asked: older daemons do not know the field
            args["depth"] = depth
        r = await self.client.request("file_list", **args)
        entries = Listing(r["entries"])
        entries.truncated = bool(r.get("truncated"))
        for e in entries:
            _paths(e)
        return entries

    async def stat(self, path: str, follow: bool = False) -> dict:
        """lstat: a symlink is itself (type "symlink", its `target`: the
        link's text, in a container); with `follow`, what it leads to
        (containers only)."""
        args = {"follow": True} if follow else {}      # sent only when asked: older daemons do not know it
        return _paths(await self.client.request("file_stat", sandbox=self.id, path=path, **args))

    async def exists(self, path: str) -> bool:
        """Whether `path` exists in the sandbox (a dangling symlink does)."""
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def mkdir(self, path: str, parents: bool = True, mode: int = 0o755,
                    owner: int | str | None = None) -> dict:
        """mkdir -p by default: the missing parents too, and no error if it
        exists. `owner`: who the directories it makes belong to (as
        write_file's; root by default)."""
        return _paths(await self.client.request("file_mkdir", sandbox=self.id, path=path, parents=parents,
                                                mode=mode, **({"owner": owner} if owner is not None else {})))

    async def remove(self, path: str, recursive: bool = False) -> dict:
        """rm, or rm -r with recursive; symlinks are removed, never followed."""
        return _paths(await self.client.request("file_remove", sandbox=self.id, path=path, recursive=recursive))

    async def rename(self, src: str, dst: str, overwrite: bool = False) -> dict:
        return _paths(await self.client.request("file_rename", sandbox=self.id, src=src, dst=dst,
                                                overwrite=overwrite))

    async def set_attrs(self, path: str, mode: int | None = None, mtime: float | None = None,
                        follow: bool = False) -> dict:
        """chmod `path` to `mode` and/or set its modification (and access)
        time to `mtime` (seconds since the epoch): a file or a directory; a
        symlink is not followed, unless `follow` (inside the sandbox)."""
        args = {k: v for k, v in (("mode", mode), ("mtime", mtime), ("follow", follow or None)) if v is not None}
        return _paths(await self.client.request("file_set_attrs", sandbox=self.id, path=path, **args))

    async def upload_dir(self, local: str, remote: str, temporary: bool = False,
                         owner: int | str | None = None, dirs: bool = False) -> dict:
        """Copy local directory `local` as the new directory `remote` in the
        sandbox (which must not exist), as a tar stream: symlinks stay
        symlinks, modes and mtimes are kept, every entry belongs to `owner`
        (as write_file's; the sandbox's root by default). The daemon checks every entry and extracts beside `remote`,
        renaming into place at the end: a refused or failed copy leaves
        nothing. A FIFO, socket or device in `local` is refused before
        anything is sent. With `temporary`, `remote` is a landing place this
        client renames or removes later: in a container, the daemon removes
        it if this client's connection closes first. Result: path, count
        (entries), bytes; with `dirs`, its directories too (as upload_tar's)."""
        with tempfile.TemporaryFile() as spool:
            await asyncio.to_thread(localcopy.pack, local, spool)
            spool.seek(0)
            return await self.upload_tar(spool, remote, temporary, owner, dirs)

    async def upload_tar(self, fileobj, remote: str, temporary: bool = False,
                         owner: int | str | None = None, dirs: bool = False) -> dict:
        """Extract an uncompressed tar read from binary file `fileobj` (or
        given as bytes, as docker's put_archive takes it, or as an async
        iterable of bytes, a stream of it) as the new directory `remote` in
        the sandbox (see upload_dir: the daemon checks every entry; a
        refused archive leaves nothing; `temporary`; `owner`). Cancelled,
        it returns once the daemon has removed what the copy made (in a
        container), so nothing of it is seen after. With `dirs`, the result
        lists the archive's directory entries, [name, mode, mtime] each, as
        `dirs` (a daemon without the capability files.attrs: left out)."""
        if isinstance(fileobj, (bytes, bytearray, memoryview)):
            fileobj = io.BytesIO(fileobj)
        elif not callable(getattr(fileobj, "read", None)) and not hasattr(fileobj, "__aiter__"):
            raise TypeError("upload_tar: give a binary file object (open(path, 'rb')) or the tar's bytes, got "
                            f"{type(fileobj).__name__}" + (" (a path: open it; a directory: upload_dir)"
                                                           if isinstance(fileobj, str) else ""))
        c = self.client
        chunk = c.server.get("limits", {}).get("max_file_chunk_bytes", DEFAULT_CHUNK)
        rid, sent = c.new_id(), asyncio.Event()
        failed: list[Exception] = []           # the file object's own error
        feeder = asyncio.get_running_loop().create_task(self._feed_tar(rid, sent, fileobj, chunk, failed))
        try:
            args = {"sandbox": self.id, "path": remote,
                    **({"temporary": True} if temporary and self._keeps_temporaries() else {}),
                    **({"owner": owner} if owner is not None else {}),
                    **({"dirs": True} if dirs and self._sets_attrs() else {})}
            async with contextlib.aclosing(c.frames_with_id(rid, "file_tar_put", args, sent)) as frames:
                async for frame in frames:
                    if "__result__" in frame:
                        result = _paths(frame["__result__"])
                        if result.get("dirs"):      # names not UTF-8 come as bytes, as a listing's
                            result["dirs"] = [[os.fsdecode(name), *rest] for name, *rest in result["dirs"]]
                        return result
        except ConnectionLost as err:
            if not err.sent:
                raise
            if "temporary" in args:
                # Held for this client: removed, whole or not, once its
                # connection ends (by the daemon, or by the next one at its start).
                raise ConnectionLost(
                    f"file_tar_put on {c.target}: connection lost while copying to {self.id}:{remote}: a "
                    "temporary copy goes with its connection: nothing of the copy is left: copy it again",
                    target=c.target, op="file_tar_put", sent=True) from None
            # The copy extracts beside `remote` and renames the whole into
            # place at its end; what a cut one made is removed (by the daemon
            # when the connection ends, or by the next one at its start).
            raise ConnectionLost(
                f"file_tar_put on {c.target}: connection lost while copying to {self.id}:{remote}: if {remote} "
                "exists, the copy ended first and it is whole; if not, nothing of the copy is left: copy it "
                "again", target=c.target, op="file_tar_put", sent=True) from None
        finally:
            if not feeder.done():
                feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
                await feeder
            if failed:
                raise failed[0]
        raise ConnectionError("file_tar_put: no final frame")

    async def _feed_tar(self, rid: int, sent: asyncio.Event, fileobj, chunk: int,
                        failed: list[Exception] | None = None) -> None:
        """The tar, a chunk per file_tar_input; the last one says eof. A
        read that fails goes into `failed`, and cancels the put. A file is
        read a whole chunk at a time; an async iterable's pieces go as they
        come (one past a chunk split), then an empty eof: a stream that
        trickles in is not held back until a chunk fills, which the daemon
        would take for a client that sends nothing (limits.frame_timeout_s)."""
        await sent.wait()          # the inputs must follow their put on the wire
        streamed = hasattr(fileobj, "__aiter__")
        pieces = _as_they_come(fileobj, chunk) if streamed else file_pieces(fileobj, chunk, "upload_tar")
        try:
            while True:
                try:
                    data = await anext(pieces, b"")     # ended on a whole chunk: an empty last one
                except Exception as err:
                    # The daemon would wait for the rest of the tar (limits.frame_timeout_s),
                    # and the caller with it: the copy is cancelled (nothing is left), and
                    # upload_tar raises the read's error once the put has ended (which
                    # may come before the cancel's own answer).
                    if failed is not None:
                        failed.append(err)
                    await _cancel(self.client, rid)
                    return
                last = not data if streamed else len(data) < chunk
                await self.client.request("file_tar_input", put_id=rid, data=data, eof=last)
                if last:
                    return
        finally:
            await pieces.aclose()

    async def download_dir(self, remote: str, local: str) -> dict:
        """Copy directory `remote` of the sandbox as the new local directory
        `local` (which must not exist). Symlinks come as symlinks, never
        followed; FIFOs, sockets, devices and kernel filesystems are left out
        and listed in the result's `skipped`. Every entry is checked again
        here, extracted beside `local` and renamed into place at the end;
        a failed or cancelled copy leaves nothing there once it returns. A
        connection lost under it (a daemon restart) has it copied again from
        the start on the next connection, once.
        Result: path, count (entries), bytes, skipped."""
        local = os.path.abspath(local)
        if os.path.lexists(local):
            raise localcopy.LocalCopyError(f"{local} exists; remove it first or copy to a new path")
        if not os.path.isdir(os.path.dirname(local)):
            # Else the spool's open below would fail naming a temporary file of its own.
            raise FileNotFoundError(errno.ENOENT, f"download_dir to {local}: no directory to make it in "
                                    "(make its parent first)", os.path.dirname(local))
        with tempfile.TemporaryFile(dir=os.path.dirname(local)) as spool:
            result = None
            args = {"sandbox": self.id, "path": remote}
            for again in (False, True):
                try:
                    async with contextlib.aclosing(self.client.frames("file_tar_get", **args)) as frames:
                        async for frame in frames:
                            if "__result__" in frame:
                                result = frame["__result__"]
                            else:
                                spool.write(frame["data"])
                    break
                except ConnectionLost as err:
                    # Nothing of it has left the spool, and it changes nothing
                    # in the sandbox: on a client that reconnects (a daemon
                    # restart), it goes again once, from the start. One never
                    # sent found no daemon within reconnect_timeout: asked
                    # again, it would wait as long once more.
                    if again or not err.sent or not _reconnects(self.client):
                        raise
                    spool.seek(0)
                    spool.truncate()
            if result is None:
                raise ConnectionError("file_tar_get: no final frame")
            spool.seek(0)
            stop = threading.Event()
            unpacking = asyncio.ensure_future(asyncio.to_thread(localcopy.unpack, spool, local, stop=stop))
            try:
                await asyncio.shield(unpacking)
            except asyncio.CancelledError:
                # The thread unpacks on: told to stop, it removes its
                # temporary directory, and is waited for, so that nothing
                # of the copy turns up after the cancel (a retry to `local`
                # would find it).
                stop.set()
                await asyncio.wait([unpacking])
                if not unpacking.cancelled():
                    unpacking.exception()       # its Stopped, taken
                raise
        return result

    async def watch(self, path: str, recursive: bool = False) -> AsyncIterator[dict]:
        """Changes under directory `path` as they happen: dicts with `kind`
        (create, modify, attrib, delete, move_from, move_to; overflow when
        the kernel lost events; ready first, once every directory is
        watched; stopped last, with a `reason`), `path` (in the sandbox) and
        `is_dir`. Runs until the loop stops (break) or the directory or the
        sandbox goes; with `recursive`, subdirectories too, new ones included.
        A `path` that is not UTF-8 is a str as list_files gives one.
        A lost connection (a daemon restart) is watched again on the next
        one, on a client that reconnects (the default); what changed while
        nothing watched is unknown, so the new watch's `ready` comes as an
        `overflow` (list the tree again to catch up); a directory (or
        sandbox) that went meanwhile ends it with `stopped` (`deleted`, or
        `sandbox destroyed`); lost FOLLOW_LOST_MAX times in a row with
        nothing come (a daemon that drops the request), it ends with the
        ConnectionLost."""
        args = {"sandbox": self.id, "path": path, "recursive": recursive}
        ready = False           # the caller had its `ready`
        top = path              # the watched directory, as its `ready` names it
        again = False           # this watch follows one whose connection was lost
        refollow = _Refollow()
        while True:
            came = False
            refollow.attach()
            try:
                async with contextlib.aclosing(self.client.frames("file_watch", **args)) as frames:
                    async for frame in frames:
                        came = True
                        if "__result__" in frame:
                            return
                        if frame.get("kind") == "ready":
                            if ready and again:
                                again = False
                                yield {"kind": "overflow", "path": _paths(frame)["path"], "is_dir": True,
                                       "message": "changes made while the connection to the daemon was lost "
                                                  "(a daemon restart) were not seen: list the tree again to "
                                                  "catch up"}
                                continue
                            ready, top = True, _paths(frame)["path"]
                        yield _paths(frame)
                return
            except ConnectionLost as err:
                # Not sent: the daemon did not answer again (reconnect_timeout).
                if not (err.sent and _reconnects(self.client)):
                    raise
                again = True
                await refollow.lost(err, came)
            except NotFound as err:
                # Watched again after a loss, the directory (or the sandbox)
                # went meanwhile: the watch ends as one that saw it go does.
                if not (again and ready and not came):
                    raise
                yield {"kind": "stopped", "path": top, "is_dir": True,
                       "reason": "sandbox destroyed" if "sandbox" in (err.detail or {}) else "deleted",
                       "message": f"it went while the connection to the daemon was lost (a daemon restart): "
                                  f"{err.message}"}
                return

    async def snapshot(self, name: str, exclude: list[str] | None = None,
                       progress: Callable[[dict], None] | None = None, key: str | None = None) -> dict:
        """pack_diff: this sandbox's changes as a new image `name` over its own image,
        leaving out the `exclude` paths: paths in the sandbox, a relative one
        read from its root (`root/.cache` is /root/.cache), never from a
        working directory. key: idempotency key, as exec's (the SDK makes
        one if none is given): sent again, the snapshot answers with the
        image it made; `progress` then hears the pack under way from where
        it is by then, each event once (a pack from its start again only if
        the first made no image: its error went with the connection, and
        the key with it)."""
        return await self._keyed("snapshot", {"sandbox": self.id, "name": name, "exclude": exclude or []}, key,
                                 progress)

    async def net_show(self) -> dict:
        """The egress policy: rules with allowed counters, and what default-deny refused."""
        return await self.client.request("net_show", sandbox=self.id)

    async def net_set(self, add: list[str] | None = None, remove: list[str] | None = None,
                      replace: list[str] | None = None) -> dict:
        """Change the policy atomically: add/remove (merge), or replace the whole of it."""
        return await self.client.request("net_set", sandbox=self.id, add=add or [], remove=remove or [],
                                         replace=replace)

    async def publish(self, port: int | str, host_port: int | None = None, bind: str = "",
                      protocol: str | None = None) -> dict:
        """Make the sandbox's `protocol` ("tcp", the default, or "udp") `port`
        (or "5353/udp") reachable from the host: {port, protocol, host_port,
        bind, host ("addr:port" to connect or send to), target}. host_port
        None = one the daemon picks; bind "" = every non-loopback address of
        the daemon's host side. A TCP and a UDP port of one number are
        published apart (and may get different host ports)."""
        number, proto = _port_arg(port, protocol)
        return await self.client.request("net_publish", sandbox=self.id, port=number, host_port=host_port,
                                         bind=bind, **_protocol_arg(proto))

    async def unpublish(self, port: int | str, protocol: str | None = None) -> dict:
        """The `protocol` `port` (or "5353/udp") no longer published; the flows
        open through it are cut."""
        number, proto = _port_arg(port, protocol)
        return await self.client.request("net_unpublish", sandbox=self.id, port=number, **_protocol_arg(proto))

    async def get_host(self, port: int | str, protocol: str | None = None) -> str:
        """"host:port" where the host reaches the sandbox's `protocol` ("tcp",
        the default, or "udp") `port` (or "5353/udp"); publishes it (on a host
        port the daemon picks) if it is not published yet."""
        number, proto = _port_arg(port, protocol)
        for p in (await self.net_show()).get("ports", []):
            if p["port"] == number and p.get("protocol", "tcp") == proto:
                return p["host"]
        return (await self.publish(number, protocol=proto))["host"]

    async def pause(self) -> dict:
        """Freeze and reclaim; any later exec or file op resumes it (auto_resume)."""
        return await self.client.request("pause", sandbox=self.id)

    async def resume(self) -> dict:
        return await self.client.request("resume", sandbox=self.id)

    async def inspect(self) -> dict:
        self.info = _sandbox_info(await self.client.request("inspect", sandbox=self.id))
        return self.info

    async def destroy(self, force: bool = False) -> dict:
        return await self.client.request("destroy", sandbox=self.id, force=force)


def _write_all(file, data) -> None:
    """All of `data` into `file`: an unbuffered one may take only part."""
    view = memoryview(data)
    while view:
        n = file.write(view)
        if n is None:
            raise BlockingIOError(errno.EAGAIN, "read_file_to: the file takes no bytes now (non-blocking): "
                                                "give a blocking one")
        view = view[n:]


def _read_again(err: Conflict, again: int) -> bool:
    """Whether a read that failed with `err` is read again from the start,
    for the `again`-th time: only for a file replaced while it was read."""
    return bool(err.detail.get("replaced")) and again <= READ_AGAIN


def _settled_in(futures: set[asyncio.Future]) -> Callable[[asyncio.Future], None]:
    """A done callback: the future leaves `futures`, its error retrieved
    (nobody may await it once its caller was cancelled)."""
    def settled(fut: asyncio.Future) -> None:
        futures.discard(fut)
        if not fut.cancelled():
            fut.exception()
    return settled


async def _collect(stream, on_stdout, on_stderr) -> ExecResult:
    """Drain an exec's stream of (fd, data): its ExecResult with the whole
    output, each chunk also handed to its fd's callback (which may be async)."""
    out: dict[int, list[bytes]] = {1: [], 2: []}
    callbacks = {1: on_stdout, 2: on_stderr}
    # aclosing: a callback that raises ends the exec (cancelled, and settled)
    # before its error goes on, not whenever the stream is collected.
    async with contextlib.aclosing(aiter(stream)) as chunks:
        async for fd, data in chunks:
            out[fd].append(data)
            if callbacks[fd] is not None:
                result = callbacks[fd](data)
                if asyncio.iscoroutine(result):
                    await result
    assert stream.result is not None
    stream.result.stdout, stream.result.stderr = b"".join(out[1]), b"".join(out[2])
    return stream.result
