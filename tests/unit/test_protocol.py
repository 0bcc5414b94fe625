"""Frame codec and typed request decoding (no root, no daemon)."""

import os

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsecd import protocol
from dsecd.errors import BadRequest, LimitExceeded


def test_frame_roundtrip_through_incremental_decoder():
    frames = [{"id": i, "op": "ping", "args": {}} for i in range(5)]
    data = b"".join(protocol.encode_frame(f) for f in frames)
    dec = protocol.FrameDecoder(1 << 20)
    out = []
    for i in range(0, len(data), 3):   # byte-sized dribbles
        out += dec.feed(data[i:i + 3])
    assert out == frames


def test_encode_refuses_oversized_frame():
    with pytest.raises(LimitExceeded) as e:
        protocol.encode_frame({"data": b"x" * 100}, max_bytes=50)
    assert e.value.code == "limit"


def test_decoder_refuses_oversized_header_before_reading_payload():
    dec = protocol.FrameDecoder(1024)
    with pytest.raises(LimitExceeded):
        dec.feed(protocol.HEADER.pack(1025))


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb("str"), b""])
def test_non_map_payload_is_bad_request(payload):
    with pytest.raises(BadRequest):
        protocol.decode_payload(payload)


def test_parse_create_fills_defaults():
    rid, req = protocol.parse_request({"id": 7, "op": "create", "args": {"image": "busybox"}})
    assert rid == 7 and isinstance(req, protocol.Create)
    # cwd and user: None, so the image's WorkingDir and User apply.
    assert req.env == {} and req.cpu is None and req.cwd is None and req.user is None


@pytest.mark.parametrize("frame, needle", [
    ({"op": "ping"}, "id"),
    ({"id": -1, "op": "ping"}, "id"),
    ({"id": True, "op": "ping"}, "id"),
    ({"id": 1}, "op"),
    ({"id": 1, "op": "nope"}, "unknown op"),
    ({"id": 1, "op": "ping", "args": []}, "args"),
    ({"id": 1, "op": "ping", "extra": 1}, "unknown frame fields"),
    ({"id": 1, "op": "create", "args": {}}, "missing required field 'image'"),
    ({"id": 1, "op": "create", "args": {"image": 3}}, "field 'image'"),
    ({"id": 1, "op": "create", "args": {"image": "x", "cpu": "2"}}, "field 'cpu'"),
    ({"id": 1, "op": "create", "args": {"image": "x", "env": {"A": 1}}}, "field 'env'"),
    ({"id": 1, "op": "create", "args": {"image": "x", "colour": "red"}}, "unknown fields: colour"),
    ({"id": 1, "op": "exec", "args": {"sandbox": "a", "argv": "ls"}}, "field 'argv'"),
    ({"id": 1, "op": "exec", "args": {"sandbox": "a", "argv": ["ls"], "timeout": True}}, "field 'timeout'"),
    ({"id": 1, "op": "file_write", "args": {"sandbox": "a", "path": "/x", "data": "text"}}, "field 'data'"),
])
def test_bad_requests_say_what_is_wrong(frame, needle):
    with pytest.raises(BadRequest) as e:
        protocol.parse_request(frame)
    assert needle in e.value.message


def test_int_accepted_for_float_but_bool_is_not_int():
    _, req = protocol.parse_request({"id": 1, "op": "create", "args": {"image": "x", "cpu": 2}})
    assert req.cpu == 2
    with pytest.raises(BadRequest):
        protocol.parse_request({"id": 1, "op": "create", "args": {"image": "x", "pids": True}})


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(sorted(protocol.REQUESTS) + ["bogus"]),
       args=st.dictionaries(st.text(max_size=10), _values, max_size=4),
       rid=st.integers(min_value=-5, max_value=2**64))
def test_parse_request_never_raises_anything_but_bad_request(op, args, rid):
    try:
        protocol.parse_request({"id": rid, "op": op, "args": args})
    except BadRequest:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_decoder_on_garbage_raises_only_protocol_errors(data):
    dec = protocol.FrameDecoder(1 << 16)
    try:
        dec.feed(data)
    except (BadRequest, LimitExceeded):
        pass


def test_a_path_that_is_not_utf8_travels_as_bytes_and_decodes_as_the_same_name():
    name = os.fsdecode(b"/work/\xffx")          # as argv or os.listdir give it
    frame = protocol.decode_payload(protocol.encode_frame(
        {"id": 1, "op": "file_rename", "args": {"sandbox": "sb", "src": name, "dst": "/work/y"}})[4:])
    assert frame["args"]["src"] == b"/work/\xffx"
    _, req = protocol.parse_request(frame)
    assert (req.src, req.dst) == (name, "/work/y")
    # An answer's names as bytes; an error's text escaped, still text.
    answer = protocol.decode_payload(protocol.encode_frame(
        {"id": 1, "result": {"entries": [{"name": name[6:]}]}})[4:])
    assert answer["result"]["entries"] == [{"name": b"\xffx"}]
    error = protocol.decode_payload(protocol.encode_frame(
        {"id": 1, "error": {"code": "not_found", "message": f"list sb:{name}: gone", "detail": {"path": name}}})[4:])
    assert error["error"]["message"] == "list sb:/work/\\xffx: gone" and error["error"]["detail"]["path"] == \
        "/work/\\xffx"


@pytest.mark.parametrize("op,base", [("exec", {"sandbox": "sb"}), ("proc_start", {"sandbox": "sb"}),
                                     ("call", {"image": "busybox"})])
def test_argv_and_env_that_are_not_utf8_travel_as_bytes_and_decode_as_fsdecode_does(op, base):
    """A command's arguments and environment are bytes to execve: a file
    name with latin-1 bytes (sys.argv's surrogates in Python) goes as msgpack
    bin, and the daemon gets os.fsdecode's str back, which os.fsencode turns
    into the same bytes at the exec."""
    arg, key, value = (os.fsdecode(raw) for raw in (b"caf\xe9", b"K\xff", b"v\xe9"))
    sent = {**base, "argv": ["ls", arg, b"raw\xff"], "env": {key: value, b"B": b"\xfe"}}
    if op != "call":
        sent["cwd"] = os.fsdecode(b"/w\xe9")
    frame = protocol.decode_payload(protocol.encode_frame({"id": 1, "op": op, "args": sent})[4:])
    assert frame["args"]["argv"] == ["ls", b"caf\xe9", b"raw\xff"]
    _, req = protocol.parse_request(frame)
    assert [os.fsencode(a) for a in req.argv] == [b"ls", b"caf\xe9", b"raw\xff"]
    assert {os.fsencode(k): os.fsencode(v) for k, v in req.env.items()} == {b"K\xff": b"v\xe9", b"B": b"\xfe"}
    assert op == "call" or os.fsencode(req.cwd) == b"/w\xe9"


def test_a_call_codes_args_may_be_bytes_too():
    _, req = protocol.parse_request({"id": 1, "op": "call", "args": {"image": "py", "code": "pass",
                                                                     "args": [b"\xff", "x"]}})
    assert req.args == [os.fsdecode(b"\xff"), "x"]


@pytest.mark.parametrize("args,needle", [
    ({"argv": ["ls", 3]}, "field 'argv' must be list[str], got list with int at [1]"),
    ({"argv": ["ls"], "env": {"A": 1}}, "field 'env' must be dict[str, str], got map with int at ['A']"),
    ({"argv": "ls"}, "field 'argv' must be list[str], got str"),
])
def test_a_wrong_item_of_a_list_or_map_is_named(args, needle):
    with pytest.raises(BadRequest) as err:
        protocol.parse_request({"id": 1, "op": "exec", "args": {"sandbox": "sb", **args}})
    assert needle in str(err.value)
