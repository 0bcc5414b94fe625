"""In-process fuzzing of the frame codec and the typed-request parser.

Everything dsecd.protocol may raise on hostile bytes is a DsecError with
code bad_request or limit; anything else (TypeError, RecursionError,
OverflowError, ...) would become `internal` in the server. Fast: no socket.
"""

from __future__ import annotations

import random

import fuzz_frames as ff
import msgpack

from dsecd import protocol
from dsecd.errors import DsecError

ALLOWED = {"bad_request", "limit"}


def check_payload(payload: bytes) -> str | None:
    """None if decode+parse of payload behaves, else what went wrong."""
    try:
        protocol.parse_request(protocol.decode_payload(payload))
    except DsecError as err:
        if err.code not in ALLOWED:
            return f"{err.code}: {err.message}"
    except Exception as err:   # noqa: BLE001 - exactly what we look for
        return f"{type(err).__name__}: {err}"
    return None


def check_stream(data: bytes, max_bytes: int) -> str | None:
    """Feed a byte stream to FrameDecoder in random-sized pieces."""
    dec = protocol.FrameDecoder(max_bytes)
    try:
        for i in range(0, len(data), 7):
            dec.feed(data[i:i + 7])
    except DsecError as err:
        if err.code not in ALLOWED:
            return f"{err.code}: {err.message}"
    except Exception as err:   # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return None


def fuzz_decoder(n: int, seed: int) -> dict:
    """n inputs: hypothesis-generated frames, then byte mutations of them."""
    rng = random.Random(seed)
    ctx = ff.Context(sandboxes=["0123456789ab"])
    findings: list[dict] = []
    count = [0]

    def note(problem, payload):
        if problem and len(findings) < 100:
            findings.append({"problem": problem, "payload": payload[:400].hex()})

    def one(data) -> int:
        inp = data.draw(ff.inputs(ctx, lambda: rng.randrange(1 << 63)))
        payload = inp.data[protocol.HEADER.size:]
        note(check_payload(payload), payload)
        note(check_stream(inp.data + inp.data[: rng.randrange(len(inp.data) + 1)], 1 << 20),
             inp.data)
        count[0] += 2
        for _ in range(18):   # byte-level mutants of this frame
            b = bytearray(payload)
            for _ in range(rng.randint(1, 6)):
                if b and rng.random() < 0.6:
                    b[rng.randrange(len(b))] = rng.randrange(256)
                else:
                    b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
            note(check_payload(bytes(b)), bytes(b))
            count[0] += 1
        return 20

    ff.run_passes(one, n, 20, seed)
    # Deep nesting and huge declared sizes, which random mutation rarely hits.
    for depth in (10, 100, 1000, 100_000):
        for payload in (b"\x91" * depth + b"\xc0", b"\x81\xa1a" * depth + b"\xc0",
                        msgpack.packb({"id": 1, "op": "exec", "args": {"argv": [[[]]] * depth}})):
            note(check_payload(payload), payload)
            count[0] += 1
    for header in (b"\xff\xff\xff\xff", b"\x80\x00\x00\x00", b"\x00\x10\x00\x01"):
        note(check_stream(header + b"\x80", 1 << 20), header)
        count[0] += 1
    return {"inputs": count[0], "findings": findings}
