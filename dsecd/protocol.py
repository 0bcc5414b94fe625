"""Wire protocol: length-prefixed msgpack frames and the closed set of typed requests.

A frame is a 4-byte big-endian payload length followed by one msgpack map.

    client -> server  {"id": int, "op": str, "args": {...}}
    server -> client  {"id": int, "result": {...}}            final
                      {"id": int, "error": {code, message, detail}}   final
                      {"id": int, "stream": {...}}            zero or more before the final one

The first request on a connection must be `hello`. Each op's arguments decode
into a frozen dataclass below; unknown fields, missing required fields and
wrong types are `bad_request`. docs/protocol.md documents every op and is
checked against this module by tests/unit/test_protocol_doc.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import struct
import types
import typing
from dataclasses import dataclass, field

import msgpack

from .errors import BadRequest, LimitExceeded

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
MAX_ID = 2**63 - 1


# ---------------------------------------------------------------- frame codec

# A payload may carry the bytes of a file_write's `data`, or of a
# file_read's answer, raw after its map instead of inside it (a "tail"):
# the daemon then hands the frame's own buffer to the sandbox's copier, and
# the client joins the chunks of a file straight from its frames, where
# decoding or encoding a msgpack bin would copy them. Such a payload starts
# with TAILED (0xc1, a byte msgpack never uses), then the map's length (4
# bytes, big-endian), the map, whose tailed value is the extension
# TAIL_EXT, and the bytes. A client sends one, or asks for one (file_read's
# `tail`), only of a daemon whose hello lists the capability "frame.tail";
# the daemon takes one for file_write's data alone.
TAILED = 0xC1
TAIL_EXT = 1
TAIL_MIN = 64 << 10          # smaller values stay in the map: a tail saves a copy, not a frame
TAIL_FIELDS = {("file_write", "data")}
_MAP_LEN = struct.Struct(">I")


class _Tail:
    """Where the tail goes, in a decoded map."""


_TAIL = _Tail()


class AsTail:
    """An answer's `data` to send as the frame's tail (encode_frame_parts)."""

    __slots__ = ("data",)

    def __init__(self, data):
        self.data = data


def encode_frame(obj: dict, max_bytes: int | None = None) -> bytes:
    return b"".join(encode_frame_parts(obj, max_bytes))


def encode_frame_parts(obj: dict, max_bytes: int | None = None) -> tuple[bytes, ...]:
    """(header, payload) of a frame, for a writer's writelines: joining them
    would copy the payload (4 MiB of a file chunk: ~1.4 ms, four times the
    encoding itself, most of it page faults on the new buffer)."""
    result = obj.get("result")
    if isinstance(result, dict) and isinstance(result.get("data"), AsTail):
        data = result["data"].data
        if len(data) >= TAIL_MIN:
            marked = {**obj, "result": {**result, "data": msgpack.ExtType(TAIL_EXT, b"")}}
            return _tailed(marked, data, max_bytes)
        obj = {**obj, "result": {**result, "data": data}}
    payload = _packb(obj)
    _check_size(len(payload), max_bytes)
    return HEADER.pack(len(payload)), payload


# Names of a sandbox's files are bytes, as Linux has them, and Python holds
# one that is not UTF-8 as the str os.fsdecode makes (its odd bytes as
# surrogates), which a msgpack str cannot carry: such a str travels as
# bytes (bin), and as escaped text (\xff) in an error's message. A request's
# path (PATH_FIELDS) may so come as bytes, and is the str again once decoded.
PATH_FIELDS = {"file_read": ("path",), "file_write": ("path",), "file_list": ("path",), "file_stat": ("path",),
               "file_mkdir": ("path",), "file_remove": ("path",), "file_rename": ("src", "dst"),
               "file_set_attrs": ("path",),
               "file_watch": ("path",), "file_tar_put": ("path",), "file_tar_get": ("path",),
               # The working directory a command starts in, a path in the sandbox too.
               "exec": ("cwd",), "proc_start": ("cwd",), "create": ("cwd",)}

# A command's arguments and environment are bytes to execve as well: an
# argument naming such a file, or a value read from one, may come as bytes
# (bin) in place of a str: each item of these lists, each key and value of
# these maps (ARG_FIELDS), is the str os.fsdecode makes of it once decoded,
# and the exec paths give the kernel its bytes again (os.fsencode). A
# create's env is the default of its sandbox's execs: the same holds.
ARG_FIELDS = {"exec": ("argv", "env"), "proc_start": ("argv", "env"), "call": ("argv", "args", "env"),
              "create": ("env",)}


def _packb(obj: dict) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except UnicodeEncodeError:          # rare: walk it only then
        return msgpack.packb({k: _sendable(v, k != "error") for k, v in obj.items()}, use_bin_type=True)


def _sendable(obj, as_bytes: bool):
    """obj with each str that is not UTF-8 as bytes (as_bytes) or escaped text."""
    if isinstance(obj, str):
        try:
            obj.encode()
            return obj
        except UnicodeEncodeError:
            raw = os.fsencode(obj)
            return raw if as_bytes else raw.decode(errors="backslashreplace")
    if isinstance(obj, dict):
        # A key too: an environment variable's name is bytes to execve, and
        # an escaped one would name another variable.
        return {_sendable(k, as_bytes): _sendable(v, as_bytes) for k, v in obj.items()}
    if isinstance(obj, list) or type(obj) is tuple:     # not an ExtType, a namedtuple
        return [_sendable(v, as_bytes) for v in obj]
    return obj


def _tailed(marked: dict, data, max_bytes: int | None) -> tuple[bytes, ...]:
    """(header, head, data) of a tailed frame whose map `marked` holds the
    TAIL_EXT extension where `data` goes."""
    head = _packb(marked)
    size = 1 + _MAP_LEN.size + len(head) + len(data)
    _check_size(size, max_bytes)
    return HEADER.pack(size), bytes((TAILED,)) + _MAP_LEN.pack(len(head)) + head, data


def encode_tailed_request(obj: dict, max_bytes: int | None = None) -> tuple[bytes, ...]:
    """encode_frame_parts of a request whose args' `data` goes as a tail
    (one of TAIL_FIELDS, at least TAIL_MIN bytes; else as usual):
    (header, head, data), data neither copied nor encoded."""
    data = obj["args"].get("data")
    if (obj.get("op"), "data") not in TAIL_FIELDS or data is None or len(data) < TAIL_MIN:
        return encode_frame_parts(obj, max_bytes)
    return _tailed({**obj, "args": {**obj["args"], "data": msgpack.ExtType(TAIL_EXT, b"")}}, data, max_bytes)


def _check_size(size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise LimitExceeded(f"frame of {size} bytes exceeds the {max_bytes}-byte limit",
                            {"size": size, "max": max_bytes})


def decode_payload(payload) -> dict:
    """One frame's payload (bytes, or a bytearray a frame reader filled) ->
    a dict; anything else is bad_request. A tailed payload's tail comes as a
    memoryview of the payload, in the field its extension marks."""
    if payload[:1] == bytes((TAILED,)):
        return _decode_tailed(payload)
    return _decode_map(payload)


def _decode_map(payload, ext_hook=None) -> dict:
    try:
        if ext_hook is None:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        else:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=ext_hook)
    except Exception as err:  # msgpack raises several unrelated types
        raise BadRequest(f"frame is not valid msgpack: {type(err).__name__}") from err
    if not isinstance(obj, dict):
        raise BadRequest(f"frame must be a msgpack map, got {type(obj).__name__}")
    return obj


def _decode_tailed(payload) -> dict:
    view = memoryview(payload)
    if len(view) < 1 + _MAP_LEN.size:
        raise BadRequest("tailed frame shorter than its map length")
    (head_len,) = _MAP_LEN.unpack_from(view, 1)
    start = 1 + _MAP_LEN.size
    if head_len > len(view) - start:
        raise BadRequest(f"tailed frame: its map of {head_len} bytes is longer than the frame")

    def ext_hook(code: int, data: bytes):
        if code != TAIL_EXT or data:
            raise ValueError(f"unknown msgpack extension {code}")
        return _TAIL

    obj = _decode_map(view[start:start + head_len], ext_hook)
    # A request's tail is file_write's data; an answer's, its result's data.
    holder = obj.get("args") if "op" in obj else obj.get("result")
    if not (isinstance(holder, dict) and holder.get("data") is _TAIL
            and ("op" not in obj or (obj["op"], "data") in TAIL_FIELDS)
            and sum(v is _TAIL for v in holder.values()) == 1):
        raise BadRequest("a frame's tail is only for the data of a file_write request or of an answer")
    holder["data"] = view[start + head_len:]
    return obj


class FrameDecoder:
    """Incremental decoder for a byte stream (used by the client and by tests)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buf)
            if size > self.max_bytes:
                raise LimitExceeded(f"frame of {size} bytes exceeds the {self.max_bytes}-byte limit",
                                    {"size": size, "max": self.max_bytes})
            if len(self._buf) < HEADER.size + size:
                break
            payload = bytes(self._buf[HEADER.size:HEADER.size + size])
            del self._buf[:HEADER.size + size]
            out.append(decode_payload(payload))
        return out


# ---------------------------------------------------------------- typed requests

REQUESTS: dict[str, type] = {}

# Sandbox states (see docs/protocol.md): which states accept each op is in `states`.
RUNNING = ("running",)
# Exec and file ops on a paused sandbox resume it first (memory.auto_resume).
ACTIVE = ("running", "paused")
ANY_STATE = ("creating", "running", "paused", "stopping", "dead")


def request(op: str, states: tuple[str, ...] = (), stream: bool = False):
    """Register a request dataclass for `op`; `states` = sandbox states it accepts."""

    def wrap(cls):
        cls = dataclass(frozen=True)(cls)
        cls.OP = op
        cls.STATES = states
        cls.STREAMS = stream
        REQUESTS[op] = cls
        return cls

    return wrap


@request("hello")
class Hello:
    protocol: int
    client: str = ""


@request("ping")
class Ping:
    pass


@request("info")
class Info:
    pass


@request("image_build", stream=True)
class ImageBuild:
    source: str                  # on the daemon's host: a root file system or an image archive (dir or tarball)
    name: str
    parent: str | None = None    # an image whose layers go below the new one
    # Image config (dsecd/imageconfig.py); None: the archive's, or the parent's.
    env: dict[str, str] | None = None      # merged over the image's
    cwd: str | None = None
    user: int | str | None = None          # "name", "uid", "name:group", "uid:gid" (an int: a uid)
    entrypoint: list[str] | None = None    # a new entrypoint without a new cmd clears cmd
    cmd: list[str] | None = None
    labels: dict[str, str] | None = None   # merged over the image's
    exposed_ports: list[str] | None = None  # "8080", "8080/tcp", "53/udp"


@request("image_pull", stream=True)
class ImagePull:
    ref: str                     # a registry reference: python:3.11, ghcr.io/org/app@sha256:...
    platform: str | None = None  # os/arch[/variant] to take from a multi-platform index; None = the host's
@request("image_build_dockerfile", stream=True)
class ImageBuildDockerfile:
    context: str                 # a directory on the daemon's host: COPY and ADD read it in place
    dockerfile: str              # the Dockerfile's text
    name: str
    dockerfile_name: str = "Dockerfile"      # how errors name it: "Dockerfile:12: ..."
    build_args: dict[str, str] = field(default_factory=dict)
    allow: list[str] = field(default_factory=list)   # RUN's egress rules (then --net default); none: --net none
    no_cache: bool = False


@request("image_gc")
class ImageGc:
    pass


@request("image_du")
class ImageDu:
    pass


@request("snapshot", states=ACTIVE, stream=True)
class Snapshot:
    sandbox: str
    name: str
    exclude: list[str] = field(default_factory=list)
    key: str | None = None   # idempotency key: sent again, answered with the image it made


@request("image_list", stream=True)
class ImageList:
    # The images in stream frames, as many as the listing takes: one result
    # of every image may be past max_frame_bytes (hundreds of images of deep
    # layer chains). Without it, all in the result (as before).
    stream: bool = False


@request("image_inspect")
class ImageInspect:
    name: str


@request("image_rm")
class ImageRemove:
    name: str


@request("image_tag")
class ImageTag:
    source: str                  # the image to name again
    name: str                    # its new name (one taken is moved to it)


@request("image_flatten", stream=True)
class ImageFlatten:
    name: str                    # the image to flatten
    as_name: str | None = None   # a new name for the flat image; None: `name` moves to it


@request("create")
class Create:
    image: str
    cpu: float | None = None
    memory: int | str | None = None
    pids: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    hostname: str | None = None
    cwd: str | None = None          # None = the image's WorkingDir, else /
    user: int | str | None = None   # uid, or "name", "uid:gid", "name:group"; None = the image's User
    qos: str | None = None          # "be" | "ls"; None = cpu.default_qos
    cpu_quota: bool | None = None   # hard CFS quota of `cpu`; None = sandbox.cpu_hard_quota
    ttl: float | str | None = None        # max lifetime: seconds or "2h"
    idle_ttl: float | str | None = None   # destroyed after this long without requests
    lease: float | str | None = None      # destroyed unless `renew`ed within this long
    net: str | None = None                # "none" (loopback only) | "default"; None = net.default_mode
    allow: list[str] = field(default_factory=list)   # egress allowlist: rules and rule-set names
    publish: list[int | str] = field(default_factory=list)  # sandbox ports to publish (net_publish, host port
    #                                 picked): 8080 (TCP), "8080/tcp", "5353/udp"
    key: str | None = None          # idempotency key: a retried create returns the same sandbox
    disk: int | str | None = None   # size cap of the writable layer ("20G"); None = sandbox.disk
    backend: str | None = None      # "container" | "microvm"; None = sandbox.backend
    policy: str | dict[str, typing.Any] | None = None   # default task policy of its execs (a name or inline)


@request("policy_list")
class PolicyList:
    pass


@request("top")
class Top:
    labels: dict[str, str] = field(default_factory=dict)


@request("list")
class List:
    labels: dict[str, str] = field(default_factory=dict)


@request("inspect", states=ANY_STATE)
class Inspect:
    sandbox: str


@request("exec", states=ACTIVE, stream=True)
class Exec:
    sandbox: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: int | str | None = None   # uid, or "name", "uid:gid", "name:group" (the sandbox's /etc/passwd)
    timeout: float | None = None
    stdin: bool = False      # if true, input arrives as exec_input requests
    stream: bool = True      # stream output frames; else return it in the result
    trace: bool = False      # record execve/open/connect/signals under ptrace (result `trace`)
    pty: bool = False        # a terminal as stdin/stdout/stderr: output is one stream (fd 1), input by exec_input
    rows: int | None = None  # with pty: the initial window size (default 24 x 80)
    cols: int | None = None
    policy: str | dict[str, typing.Any] | None = None   # task policy (name or inline); None = the sandbox's
    key: str | None = None   # idempotency key (no stdin or pty): sent again, answered with the first run's result
    # With key and stream, sent again: the bytes of [stdout, stderr] its client got; the rest follows.
    stream_from: list[int] | None = None


@request("exec_input")
class ExecInput:
    exec_id: int             # the id of the exec request on this connection
    data: bytes = b""
    eof: bool = False


@request("exec_resize")
class ExecResize:
    exec_id: int             # the id of a pty exec request on this connection
    rows: int
    cols: int


@request("exec_signal")
class ExecSignal:
    exec_id: int             # the id of a running exec request on this connection
    signal: int | str        # a number, or a name with or without SIG ("INT", "SIGTERM")


# Background processes (dsecd/engine/procs.py): started detached, named by
# their pid in the sandbox; their output is kept in a ring per process.
PROC_STATES = ("running", "paused", "dead")
# A microVM's "died" event reasons, and what each means (a container's
# reason is a sentence already): the daemon's errors and `dsec ps` say them.
VM_DIED_BECAUSE = {"exited": "its QEMU exited", "panic": "its guest kernel panicked",
                   "hung": "its guest agent stopped answering and its QEMU was killed",
                   "agent_protocol": "its guest broke the agent's protocol and its QEMU was killed",
                   "gone": "found dead when the daemon started"}


@request("proc_start", states=ACTIVE)
class ProcStart:
    sandbox: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: int | str | None = None   # as exec's
    stdin: bool = True       # a pipe fed by proc_input (open until eof); false: /dev/null
    policy: str | dict[str, typing.Any] | None = None   # task policy (name or inline); None = the sandbox's
    key: str | None = None   # idempotency key: sent again, answered with the process it started


@request("proc_list", states=PROC_STATES)
class ProcList:
    sandbox: str


@request("proc_logs", states=PROC_STATES, stream=True)
class ProcLogs:
    sandbox: str
    pid: int
    follow: bool = False         # then new output as it comes, until the process ended and its output drained
    since: float | None = None   # only chunks read at or after this time (seconds since the epoch)


@request("proc_input", states=PROC_STATES)
class ProcInput:
    sandbox: str
    pid: int
    data: bytes = b""
    eof: bool = False        # close its stdin after data
    # Where `data` begins in all the input sent to its stdin (what earlier
    # proc_inputs wrote): bytes of it already written are not written again,
    # so an input sent again after a lost connection is safe. None: unchecked.
    offset: int | None = None


@request("proc_kill", states=PROC_STATES)
class ProcKill:
    sandbox: str
    pid: int
    signal: int | str = "KILL"   # a number, or a name with or without SIG ("TERM", "SIGINT")


@request("proc_wait", states=PROC_STATES)
class ProcWait:
    sandbox: str
    pid: int


@request("cancel")
class Cancel:
    target: int              # the id of an in-flight request on this connection


@request("file_read", states=ACTIVE)
class FileRead:
    sandbox: str
    path: str
    offset: int = 0
    length: int | None = None
    tail: bool = False              # the answer's data may come as the frame's tail (TAILED)
    same_as: str | None = None      # the `file` of an earlier chunk's answer: conflict if it was replaced


@request("file_write", states=ACTIVE)
class FileWrite:
    sandbox: str
    path: str
    data: bytes
    append: bool = False
    mode: int = 0o644
    parents: bool = False
    offset: int | None = None       # write at this offset, neither truncating nor appending
    temporary: bool = False         # a new file renamed or removed next (recorded: removed after a crash)
    owner: int | str | None = None  # who a file (and parents) it makes belongs to: as exec's user; None = root
    same_as: str | None = None      # the file must be this one (a write's `file`): never made, never another


@request("file_list", states=ACTIVE)
class FileList:
    sandbox: str
    path: str
    depth: int = 1               # > 1: subdirectories too, down to this depth


@request("file_stat", states=ACTIVE)
class FileStat:
    sandbox: str
    path: str
    follow: bool = False         # stat, not lstat: what a symlink leads to (containers)


@request("file_mkdir", states=ACTIVE)
class FileMkdir:
    sandbox: str
    path: str
    parents: bool = False        # mkdir -p: missing parents too, and no error if it exists
    mode: int = 0o755
    owner: int | str | None = None   # who the directories it makes belong to: as file_write's


@request("file_remove", states=ACTIVE)
class FileRemove:
    sandbox: str
    path: str
    recursive: bool = False      # rm -r: a directory and everything in it


@request("file_rename", states=ACTIVE)
class FileRename:
    sandbox: str
    src: str
    dst: str
    overwrite: bool = False      # replace an existing dst
    keep_attrs: bool = False     # a file replacing a file takes its owner, group and mode


@request("file_set_attrs", states=ACTIVE)
class FileSetAttrs:
    sandbox: str
    path: str                    # a file or directory; a symlink (as its last name) is not followed
    mode: int | None = None      # chmod: permission bits, sticky, setuid/setgid
    mtime: float | None = None   # its modification and access times (seconds since the epoch)
    follow: bool = False         # a symlink as its last name: what it leads to (inside the sandbox)


@request("file_watch", states=ACTIVE, stream=True)
class FileWatch:
    sandbox: str
    path: str                    # a directory
    recursive: bool = False      # its whole tree, directories made later included


@request("file_tar_put", states=ACTIVE)
class FileTarPut:
    sandbox: str
    path: str                    # the new directory; must not exist
    # A client's landing directory, renamed or removed by it later: removed by
    # the daemon if the client's connection closes first (containers).
    temporary: bool = False
    owner: int | str | None = None   # who every entry it makes belongs to: as file_write's
    # The result lists the archive's directory entries (name, mode, mtime):
    # what a client merging the copy into an existing tree sets there.
    dirs: bool = False


@request("file_tar_input")
class FileTarInput:
    put_id: int                  # the id of the file_tar_put request on this connection
    data: bytes = b""
    eof: bool = False


@request("file_tar_get", states=ACTIVE, stream=True)
class FileTarGet:
    sandbox: str
    path: str                    # a directory


@request("pause", states=ACTIVE)
class Pause:
    sandbox: str


@request("resume", states=ACTIVE)
class Resume:
    sandbox: str


@request("job_pause")
class JobPause:
    job: str                 # sandboxes labelled job=<job>


@request("job_resume")
class JobResume:
    job: str


@request("job_rm")
class JobRemove:
    job: str
    force: bool = False


@request("renew")
class Renew:
    sandboxes: list[str]
    lease: float | str | None = None   # new lease length; default: each sandbox's own


@request("events", stream=True)
class Events:
    sandbox: str | None = None   # only this sandbox's events
    replay: bool = False         # first the recent history the daemon keeps
    follow: bool = True          # then live events; False: end after the replay


@request("net_show", states=ACTIVE)
class NetShow:
    sandbox: str


@request("net_sets")
class NetSets:
    pass


@request("net_set", states=ACTIVE)
class NetSet:
    sandbox: str
    add: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    replace: list[str] | None = None


@request("net_publish", states=ACTIVE)
class NetPublish:
    sandbox: str
    port: int                       # the sandbox's port
    host_port: int | None = None    # None = a free one of net.publish_ports
    bind: str = ""                  # a local IPv4 address of the bridge netns; "" = all non-loopback ones
    protocol: str = "tcp"           # "tcp" | "udp": a TCP and a UDP port of one number are two publications


PUBLISH_PROTOCOLS = ("tcp", "udp")


def check_protocol(protocol: str) -> str:
    """The protocol of a published port: "tcp" or "udp" (any case), lowered;
    BadRequest for anything else."""
    p = protocol.lower() if isinstance(protocol, str) else protocol
    if p not in PUBLISH_PROTOCOLS:
        raise BadRequest(f"protocol {protocol!r} of a published port is not tcp or udp", {"protocol": protocol})
    return p


def published_port(spec: int | str) -> tuple[int, str]:
    """A port of create's `publish` (and of `dsec port`): 8080 (TCP), "8080",
    "8080/tcp" or "5353/udp" -> (port, protocol); BadRequest for anything
    else (the range is the publish's to check)."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec, "tcp"
    number, sep, protocol = str(spec).strip().partition("/")
    if not number.isdigit() or (sep and not protocol):
        raise BadRequest(f"publish: {spec!r} is not a port (8080, 8080/tcp or 5353/udp)", {"publish": spec})
    return int(number), check_protocol(protocol or "tcp")


@request("net_unpublish", states=ACTIVE)
class NetUnpublish:
    sandbox: str
    port: int
    protocol: str = "tcp"           # "tcp" | "udp"


@request("pool_set")
class PoolSet:
    image: str
    min: int
    max: int
    cpu: float | None = None             # the shape a create must ask for to take from the pool
    memory: int | str | None = None


@request("pool_list")
class PoolList:
    pass


@request("drain")
class Drain:
    reason: str = ""                     # why, for info and the refusals: "kernel update", a ticket


@request("undrain")
class Undrain:
    pass


@request("call")
class Call:
    image: str
    argv: list[str] | None = None       # a command; `python3 -c CODE ...` goes through the zygote
    code: str | None = None             # Python source run by a fork of the image's zygote
    args: list[str] | None = None       # sys.argv[1:] of a code call
    stdin: bytes | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None        # seconds; None = fncall.default_timeout_s


@request("destroy", states=ANY_STATE)
class Destroy:
    sandbox: str
    force: bool = False


@request("destroy_all", states=ANY_STATE)
class DestroyAll:
    force: bool = False
    labels: dict[str, str] = field(default_factory=dict)


@functools.cache
def _checker(hint) -> typing.Callable[[object], bool]:
    """A check of values against a field's type hint, built once per hint:
    walking the hint with typing.get_origin/get_args at every request was
    most of a request's validation time."""
    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return lambda v: True
    if origin in (typing.Union, types.UnionType):
        subs = tuple(_checker(h) for h in typing.get_args(hint))
        return lambda v: any(c(v) for c in subs)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if origin is list:
        item = _checker(typing.get_args(hint)[0])
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict:
        ka, va = (_checker(h) for h in typing.get_args(hint))
        return lambda v: isinstance(v, dict) and all(ka(a) and va(b) for a, b in v.items())
    if hint is bytes:       # a tail (see TAILED) is a memoryview of its frame
        return lambda v: isinstance(v, (bytes, memoryview))
    return lambda v: isinstance(v, hint)


def _type_name(hint) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def parse_request(frame: dict):
    """A decoded frame -> (id, typed request). Raises BadRequest with what is wrong."""
    unknown = set(frame) - {"id", "op", "args"}
    if unknown:
        raise BadRequest(f"unknown frame fields: {', '.join(sorted(map(str, unknown)))}")
    rid, op, args = frame.get("id"), frame.get("op"), frame.get("args", {})
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= MAX_ID:
        raise BadRequest("frame needs an integer `id` in [0, 2^63)")
    if not isinstance(op, str):
        raise BadRequest("frame needs a string `op`", {"id": rid})
    cls = REQUESTS.get(op)
    if cls is None:
        raise BadRequest(f"unknown op {op!r}", {"id": rid, "ops": sorted(REQUESTS)})
    if not isinstance(args, dict):
        raise BadRequest(f"{op}: `args` must be a map", {"id": rid})
    return rid, build_request(cls, args)


@functools.cache
def _schema(cls) -> tuple[dict, dict]:
    """(type hints, fields) of a request class, computed once: get_type_hints is slow."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


@functools.cache
def _plan(cls) -> tuple[tuple[str, typing.Callable[[object], bool], bool], ...]:
    """(field, value check, required) per field of a request class, built once."""
    hints, fields = _schema(cls)
    return tuple((name, _checker(hints[name]),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for name, f in fields.items())


def build_request(cls, args: dict):
    hints, fields = _schema(cls)
    paths = PATH_FIELDS.get(cls.OP)
    if paths and any(isinstance(args.get(name), bytes) for name in paths):
        args = {k: os.fsdecode(v) if k in paths and isinstance(v, bytes) else v for k, v in args.items()}
    raw = ARG_FIELDS.get(cls.OP)
    if raw and any(_holds_bytes(args.get(name)) for name in raw):
        args = {k: _fsdecoded(v) if k in raw else v for k, v in args.items()}
    if not args.keys() <= fields.keys():
        unknown = set(args) - set(fields)
        raise BadRequest(f"{cls.OP}: unknown fields: {', '.join(sorted(map(str, unknown)))}",
                         {"allowed": sorted(fields)})
    for name, check, required in _plan(cls):
        if name not in args:
            if required:
                raise BadRequest(f"{cls.OP}: missing required field {name!r}")
            continue
        if not check(args[name]):
            raise BadRequest(f"{cls.OP}: field {name!r} must be {_type_name(hints[name])}, "
                             f"got {_got(hints[name], args[name])}")
    return cls(**args)


def _got(hint, value) -> str:
    """What a value that failed its field's check is, naming the first item
    of a list or map that is wrong (`list with int at [2]`): the type of a
    container alone does not say what to fix."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    kinds = typing.get_args(hint) if union else (hint,)
    for kind in kinds:
        origin = typing.get_origin(kind)
        if origin is list and isinstance(value, list):
            item = _checker(typing.get_args(kind)[0])
            bad = next((i for i, v in enumerate(value) if not item(v)), None)
            if bad is not None:
                return f"list with {type(value[bad]).__name__} at [{bad}]"
        if origin is dict and isinstance(value, dict):
            ka, va = (_checker(h) for h in typing.get_args(kind))
            for k, v in value.items():
                if not ka(k):
                    return f"map with {type(k).__name__} key {k!r}"
                if not va(v):
                    return f"map with {type(v).__name__} at [{k!r}]"
    return type(value).__name__


def _holds_bytes(value) -> bool:
    if isinstance(value, list):
        return any(isinstance(v, bytes) for v in value)
    if isinstance(value, dict):
        return any(isinstance(k, bytes) or isinstance(v, bytes) for k, v in value.items())
    return False


def _fsdecoded(value):
    """An ARG_FIELDS list or map with its bytes items, keys and values as
    os.fsdecode's str; anything else as it is (the type check sees it)."""
    if isinstance(value, list):
        return [os.fsdecode(v) if isinstance(v, bytes) else v for v in value]
    if isinstance(value, dict):
        return {os.fsdecode(k) if isinstance(k, bytes) else k: os.fsdecode(v) if isinstance(v, bytes) else v
                for k, v in value.items()}
    return value


def op_fields(op: str) -> dict[str, str]:
    """{field: type name} for docs and tests."""
    cls = REQUESTS[op]
    hints = typing.get_type_hints(cls)
    return {f.name: _type_name(hints[f.name]) for f in dataclasses.fields(cls)}
