"""dsecd/framing.py: frames cut out of a byte stream, under asyncio and uvloop."""

import asyncio
import os
import socket

import pytest
import uvloop

from dsecd import framing


def _frame(payload: bytes) -> bytes:
    return framing.HEADER.pack(len(payload)) + payload


async def _connected(max_frame: int):
    """(our socket, the protocol reading the other end)."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    loop = asyncio.get_running_loop()
    _transport, proto = await loop.connect_accepted_socket(lambda: framing.FrameProtocol(max_frame), theirs)
    return ours, proto


async def _send(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    return asyncio.run if request.param == "asyncio" else uvloop.run


def test_many_small_frames_in_one_read_and_big_ones_across_reads(run):
    small = [os.urandom(n) for n in (0, 1, 100, 5000)]
    big = os.urandom(3 * framing.SCRATCH_BYTES + 7)

    async def main():
        sock, proto = await _connected(1 << 24)
        stream = b"".join(_frame(p) for p in small) + _frame(big) + _frame(b"after")
        sender = asyncio.ensure_future(_send(sock, stream))
        got = [await proto.read_payload() for _ in range(len(small) + 2)]
        await sender
        sock.close()
        assert await proto.read_payload() is None          # end of stream
        return got

    got = run(main())
    assert [bytes(p) for p in got] == [*small, big, b"after"]


def test_a_frame_split_byte_by_byte(run):
    async def main():
        sock, proto = await _connected(1 << 20)
        for byte in _frame(b"slow"):
            await _send(sock, bytes([byte]))
        payload = await proto.read_payload()
        sock.close()
        return payload

    assert bytes(run(main())) == b"slow"


def test_a_frame_over_the_limit_is_refused(run):
    async def main():
        sock, proto = await _connected(1000)
        await _send(sock, framing.HEADER.pack(1001) + b"x" * 10)
        with pytest.raises(framing.FrameTooBig) as err:
            await proto.read_payload()
        sock.close()
        return err.value

    err = run(main())
    assert (err.size, err.limit) == (1001, 1000)


def test_idle_and_frame_timeouts(run):
    async def main():
        sock, proto = await _connected(1 << 20)
        with pytest.raises(framing.IdleTimeout):
            await proto.read_payload(idle_timeout=0.05, frame_timeout=5)
        await _send(sock, framing.HEADER.pack(10) + b"abc")       # a frame begins, then stops
        with pytest.raises(framing.FrameTimeout):
            await proto.read_payload(idle_timeout=5, frame_timeout=0.1)
        sock.close()

    run(main())


def test_a_big_frame_grows_its_buffer_as_its_bytes_come(run):
    async def main():
        sock, proto = await _connected(1 << 26)
        await _send(sock, framing.HEADER.pack(48 << 20) + b"x" * 1000)     # 48 MiB announced, 1000 sent
        await asyncio.sleep(0.05)
        held = len(proto._big)
        body = os.urandom(48 << 20)
        sender = asyncio.ensure_future(_send(sock, body[1000:]))
        got = await proto.read_payload()
        await sender
        sock.close()
        return held, bytes(got[:1000]), len(got), bytes(got[1000:]) == body[1000:]

    held, head, size, rest_ok = run(main())
    assert held <= framing.BIG_START and head == b"x" * 1000 and size == 48 << 20 and rest_ok


# ---------------------------------------------------------------- tails (protocol.TAILED)

def _payload(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)[framing.HEADER.size:]


def test_a_file_write_sends_its_data_as_a_tail_and_decodes_to_a_view():
    from dsecd import protocol

    data = os.urandom(protocol.TAIL_MIN)
    parts = protocol.encode_tailed_request({"id": 3, "op": "file_write", "args": {"sandbox": "s", "path": "/p",
                                                                                   "data": data}})
    assert len(parts) == 3 and parts[2] is data                      # neither copied nor encoded
    got = protocol.decode_payload(bytearray(_payload(parts)))
    assert isinstance(got["args"]["data"], memoryview) and bytes(got["args"]["data"]) == data
    assert got["args"]["path"] == "/p"
    rid, req = protocol.parse_request(got)
    assert rid == 3 and bytes(req.data) == data
    small = protocol.encode_tailed_request({"id": 4, "op": "file_write", "args": {"data": b"x"}})
    assert len(small) == 2 and protocol.decode_payload(small[1])["args"]["data"] == b"x"


def test_an_answer_tail_and_refused_tails():
    import msgpack

    from dsecd import protocol
    from dsecd.errors import BadRequest

    data = os.urandom(protocol.TAIL_MIN + 1)
    parts = protocol.encode_frame_parts({"id": 1, "result": {"data": protocol.AsTail(data), "eof": True}})
    got = protocol.decode_payload(_payload(parts))
    assert bytes(got["result"]["data"]) == data and got["result"]["eof"] is True
    short = protocol.encode_frame_parts({"id": 1, "result": {"data": protocol.AsTail(b"ab")}})
    assert protocol.decode_payload(short[1])["result"]["data"] == b"ab"

    def tailed(obj, tail=b"t" * 10):
        head = msgpack.packb(obj, use_bin_type=True)
        return bytes((protocol.TAILED,)) + len(head).to_bytes(4, "big") + head + tail

    marker = msgpack.ExtType(protocol.TAIL_EXT, b"")
    with pytest.raises(BadRequest, match="only for"):
        protocol.decode_payload(tailed({"id": 1, "op": "exec_input", "args": {"data": marker}}))
    with pytest.raises(BadRequest, match="only for"):
        protocol.decode_payload(tailed({"id": 1, "op": "file_write", "args": {"data": marker, "path": marker}}))
    with pytest.raises(BadRequest, match="longer than the frame"):
        protocol.decode_payload(bytes((protocol.TAILED,)) + (1 << 20).to_bytes(4, "big") + b"\x80")
    with pytest.raises(BadRequest, match="not valid msgpack"):
        protocol.decode_payload(tailed({"id": 1, "op": "file_write", "args": {"data": msgpack.ExtType(7, b"")}}))


def test_a_big_buffer_is_filled_again_only_once_nothing_refers_to_it(run):
    async def main():
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        loop = asyncio.get_running_loop()
        _t, proto = await loop.connect_accepted_socket(lambda: framing.FrameProtocol(1 << 24, recycle=2), theirs)
        one, two, three = (os.urandom(framing.SCRATCH_BYTES * 4) for _ in range(3))
        await _send(ours, _frame(one))
        first = await proto.read_payload()
        await _send(ours, _frame(two))
        second = await proto.read_payload()             # `first` is alive: a buffer of its own
        assert bytes(first) == one and bytes(second) == two
        first_id = id(first.obj if isinstance(first, memoryview) else first)
        del first
        await _send(ours, _frame(three))
        third = await proto.read_payload()              # `first` is gone: its buffer is filled again
        third_id = id(third.obj if isinstance(third, memoryview) else third)
        ours.close()
        return bytes(second) == two and bytes(third) == three, third_id == first_id

    intact, reused = run(main())
    assert intact and reused
