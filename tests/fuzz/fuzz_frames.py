"""Hypothesis strategies for hostile dsecd clients: frames, requests, sessions.

Requests are derived from `dsecd.protocol.REQUESTS`, so a new op or field is
fuzzed without touching this file. Each field gets, most of the time, a
*plausible* value (right type, often naming a live sandbox, a real image, a
real in-sandbox path, a harmless command), else garbage (any msgpack value,
huge or negative numbers, NaN, unicode, nested lists and maps). On top:
missing and unknown fields, bad ids, duplicate ids, unknown ops, payloads
that are not msgpack or not maps, and session endings that lie about the
frame length, cut a frame short or drop the connection.

Host safety: the fields that name a *host* path (HOST_PATH_FIELDS: what
image_build copies into the store, the context a Dockerfile build reads) are drawn from IMPORT_PATHS only, and the
harness checks every frame once more as the daemon will decode it
(`host_safe`), because a mutated byte can shorten "/tmp/x/tiny" to "/".
Commands come from SAFE_ARGV or are random names that do not exist.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field

import msgpack
from hypothesis import strategies as st

from dsecd import protocol

# Filled by the harness before a run (paths under its own temp dir).
IMPORT_PATHS: list[str] = ["/nonexistent-dsecd-fuzz"]
# op -> field naming a path on the daemon's host that the op reads.
HOST_PATH_FIELDS = {"image_build": "source", "image_import": "path", "image_build_dockerfile": "context"}


def host_safe(obj) -> bool:
    """False if this decoded frame would make the daemon read a host path
    outside IMPORT_PATHS (or anything that exists, relative to our cwd)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("args"), dict):
        return True
    op = obj.get("op")
    name = HOST_PATH_FIELDS.get(op) if isinstance(op, str) else None
    value = obj["args"].get(name) if name else None
    if not isinstance(value, str) or value in IMPORT_PATHS:
        return True
    try:
        return not os.path.lexists(value) and not os.path.lexists(os.path.join("/", value))
    except (ValueError, OSError):   # NUL bytes: no such file
        return True

NASTY_TEXT = [
    "", " ", "/", "//", ".", "..", "../..", "/..", "/../../etc/shadow", "/etc/shadow",
    "/proc/self/root", "/proc/1/root/etc", "/dev/../../..", "a\x00b", "/tmp/\x00x", "\u202e",
    "🙂" * 10, "x" * 300, "/" + "d/" * 200, "%s%n", "${IFS}", "\n\r\t", "\\", "busybox",
    "busybox\x00", "BUSYBOX", "-1", "NaN", "1e309", "256M", "0", "-5M", "999999999999T",
    "1.5G", "dsecd", "../dsecd.sock", "lowerdir=/,upperdir=/", "*", "?", "a:b,c",
]
IN_SANDBOX_PATHS = [
    "/", "/tmp", "/tmp/f", "/tmp/d/e/f", "/etc/passwd", "/proc/1/root", "/proc/self/mem",
    "/proc/kcore", "/dev/null", "/bin/sh", "/tmp/link", "relative", "/tmp/../..", "/a\x00b",
    "/" + "x" * 255, "/" + "y" * 5000, "/sys/kernel", "/tmp/" + "é" * 100,
]
SAFE_ARGV = [
    ["true"], ["false"], ["echo", "fuzz"], ["sh", "-c", "exit 3"], ["cat"], ["sleep", "0.05"],
    ["sh", "-c", "echo err >&2"], ["ls", "/"], ["/bin/true"], ["no-such-cmd-dsec"],
    ["/tmp"], [""], ["sh", "-c", "kill -9 $$"], ["cat", "/etc/passwd"],
]
HUGE_INTS = [0, 1, -1, 7, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, 2**32, 2**53 + 1,
             2**63 - 1, 2**63, 2**64 - 1, -(2**31), -(2**63), 0o7777, 0o10000, 4 << 20,
             (4 << 20) + 1, 16 << 20]
ODD_FLOATS = [0.0, -0.0, 1e-300, 1e300, math.nan, math.inf, -math.inf, -1.0, 0.001, 86400.0,
              86400.5, 1e9, 0.5, 2.0, 4096.0]

ints = st.one_of(st.sampled_from(HUGE_INTS), st.integers(-(2**63), 2**64 - 1),
                 st.integers(-10, 10))
floats = st.one_of(st.sampled_from(ODD_FLOATS), st.floats())
texts = st.one_of(st.sampled_from(NASTY_TEXT), st.text(max_size=24))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.binary(max_size=64))
garbage = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)), max_leaves=8)


def run_passes(body, n: int, per_example: float, seed: int) -> None:
    """Run `body(data)` under hypothesis until it has reported n inputs.

    `body` returns how many inputs it used. A hypothesis run cannot be cut
    short without confusing its replay of earlier prefixes (a test that stops
    drawing early is reported as a flaky strategy), so the loop runs whole
    passes of max_examples sized from the inputs still due, each with the
    next seed: the same seed always replays the same passes.
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed

    done = [0]

    def test(data):
        done[0] += body(data)

    while done[0] < n:
        examples = max(5, int((n - done[0]) / per_example) + 1)
        run = settings(max_examples=examples, database=None, deadline=None,
                       phases=[Phase.generate], suppress_health_check=list(HealthCheck))(
            hyp_seed(seed)(given(st.data())(test)))
        run()
        seed += 1


@dataclass
class Context:
    """What the harness knows about the daemon: plausible names to aim at."""

    sandboxes: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=lambda: ["busybox"])


def _by_type(hint) -> st.SearchStrategy:
    """A value of type `hint`, with edge cases."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_by_type(h) for h in typing.get_args(hint)])
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return ints
    if hint is float:
        return st.one_of(floats, ints)
    if hint is str:
        return texts
    if hint is bytes:
        return st.binary(max_size=512)
    if origin is list:
        return st.lists(_by_type(typing.get_args(hint)[0]), max_size=6)
    if origin is dict:
        k, v = typing.get_args(hint)
        return st.dictionaries(_by_type(k), _by_type(v), max_size=4)
    return garbage


def _plausible(name: str, hint, ctx: Context) -> st.SearchStrategy:
    """A value aimed at the handler's real paths for well-known field names."""
    if name == "sandbox":
        ids = ctx.sandboxes or ["0123456789ab"]
        return st.one_of(st.sampled_from(ids), st.sampled_from([i[:4] for i in ids]),
                         st.sampled_from(["abc", "", "zzzzzzzzzzzz"]), texts)
    if name in ("image", "name"):
        return st.one_of(st.sampled_from(ctx.images), st.sampled_from(["fuzz-img", "busybox-2"]),
                         texts)
    if name in HOST_PATH_FIELDS.values():
        return st.sampled_from(IMPORT_PATHS)
    if name == "path" and hint is str:
        return st.one_of(st.sampled_from(IN_SANDBOX_PATHS), st.sampled_from(IMPORT_PATHS), texts)
    if name == "argv":
        return st.one_of(st.sampled_from(SAFE_ARGV), st.lists(texts, max_size=4))
    if name == "timeout":
        return st.one_of(st.none(), st.sampled_from([0.05, 0.5, 1.0]), floats, ints)
    if name == "memory":
        return st.one_of(st.none(), st.sampled_from(["64M", "128M", "1", "0", "-1", "1T",
                                                     "256Q", ""]), ints)
    if name in ("cpu", "pids"):
        return st.one_of(st.none(), st.sampled_from([0.5, 1, 0, -1, 1e9]), _by_type(hint))
    if name in ("env", "labels"):
        return st.one_of(st.just({}), st.dictionaries(texts, texts, max_size=3),
                         st.just({"job": "fuzz"}))
    if name == "user":
        return st.one_of(st.sampled_from([0, 1000, 65534, 2**32 - 1, 2**32, -1]), _by_type(hint))
    if name in ("exec_id", "target"):
        return st.one_of(st.integers(1, 40), ints)
    if name == "protocol":
        return st.one_of(st.just(protocol.PROTOCOL_VERSION), ints)
    return _by_type(hint)


@st.composite
def request_args(draw, op: str, ctx: Context) -> dict:
    hints, fields = protocol._schema(protocol.REQUESTS[op])
    args = {}
    for name in fields:
        required = (fields[name].default is dataclasses.MISSING
                    and fields[name].default_factory is dataclasses.MISSING)
        if draw(st.floats(0, 1)) < (0.97 if required else 0.45):
            mode = draw(st.floats(0, 1))
            if mode < 0.8:
                args[name] = draw(_plausible(name, hints[name], ctx))
            elif mode < 0.95:
                args[name] = draw(_by_type(hints[name]))
            else:
                args[name] = draw(garbage)
    if draw(st.floats(0, 1)) < 0.04:
        args[draw(texts)] = draw(garbage)
    return args


# Ops never generated: none today. `hello` after the handshake is fine (an error).
# `events` streams until the client cancels it: by design it never gets a final
# frame inside a session, so it would only make sessions wait for their deadline.
OPS = sorted(op for op in protocol.REQUESTS if op != "events")


@dataclass
class Input:
    """One generated input: how it goes on the wire, and what to expect."""

    kind: str                 # request, raw, not_map, bad_top
    data: bytes               # the whole frame, header included
    rid: int | None = None    # a well-formed id: a final frame with it must come back
    op: str | None = None
    frame: object = None      # the decoded request, for the report


def _encode(obj) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return protocol.HEADER.pack(len(payload)) + payload


@st.composite
def inputs(draw, ctx: Context, next_id) -> Input:
    """One frame after the handshake."""
    kind = draw(st.sampled_from(["request"] * 16 + ["raw", "not_map", "bad_top"]))
    if kind == "raw":
        payload = draw(st.binary(min_size=0, max_size=200))
        return Input("raw", protocol.HEADER.pack(len(payload)) + payload, frame=payload)
    if kind == "not_map":
        obj = draw(st.one_of(scalars, st.lists(garbage, max_size=4)))
        return Input("not_map", _encode(obj), frame=obj)
    op = draw(texts) if draw(st.floats(0, 1)) < 0.03 else draw(st.sampled_from(OPS))
    frame = {"id": next_id(), "op": op,
             "args": draw(request_args(op, ctx)) if op in protocol.REQUESTS else draw(garbage)}
    if kind == "bad_top":
        choice = draw(st.sampled_from(["id", "op", "args", "extra", "no_id"]))
        if choice == "no_id":
            del frame["id"]
        elif choice == "extra":
            frame[draw(texts)] = draw(garbage)
        else:
            frame[choice] = draw(garbage)
    rid = frame.get("id")
    good_id = isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= protocol.MAX_ID
    return Input(kind, _encode(frame), rid if good_id else None,
                 op if isinstance(op, str) else None, frame)


ENDINGS = ["close"] * 12 + ["drop", "oversize", "truncated", "partial_header"]


@st.composite
def sessions(draw, ctx: Context, max_inputs: int = 16) -> tuple[Input | None, list[Input], str]:
    """(hello or a bad first frame, inputs after it, how the session ends)."""
    counter = iter(range(1, 1 << 30))

    def next_id():
        # Mostly fresh ids; sometimes a repeat (in flight: bad_request) or an odd one.
        r = draw(st.floats(0, 1))
        if r < 0.9:
            return next(counter)
        return draw(st.integers(1, 5)) if r < 0.97 else draw(ints)

    if draw(st.floats(0, 1)) < 0.05:
        first = draw(inputs(ctx, next_id))
    else:
        args = {"protocol": protocol.PROTOCOL_VERSION, "client": "fuzz"}
        if draw(st.floats(0, 1)) < 0.05:
            args = draw(request_args("hello", ctx))
        first = Input("request", _encode({"id": 0, "op": "hello", "args": args}), 0, "hello", args)
    n = draw(st.integers(0, max_inputs))
    rest = [draw(inputs(ctx, next_id)) for _ in range(n)]
    return first, rest, draw(st.sampled_from(ENDINGS))
