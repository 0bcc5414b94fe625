"""The SDK's resend of a request the daemon refused over its in-flight
limit (before it ran), against a stand-in daemon on a unix socket."""

from __future__ import annotations

import asyncio

import pytest
from standin_kit import serving

from dsecd import protocol
from dsecd.client import Client, Process, Sandbox
from dsecd.errors import Conflict, LimitExceeded


@pytest.mark.parametrize("op,args", [("exec_input", {"exec_id": "e1", "data": b"chunk"}),
                                     ("proc_input", {"sandbox": "sb", "pid": 3, "data": b"chunk"}),
                                     ("file_tar_input", {"put_id": 7, "data": b"tar", "eof": False}),
                                     ("file_stat", {"sandbox": "sb", "path": "/x"})])
def test_a_refused_request_is_sent_again_input_chunks_too(tmp_path, op, args):
    """A stdin chunk refused while the daemon still counted answers being
    drained failed, and the SDK's feeder (which ignores its own errors)
    left the process waiting for input that never came. Nothing ran: it is
    sent again, and its feeders await each chunk before the next, so it
    overtakes nothing."""
    sock_path = str(tmp_path / "d.sock")
    seen: list[dict] = []

    async def refuse_the_first(f: dict, writer) -> bool:
        seen.append(f)
        if len(seen) == 1:
            refusal = LimitExceeded("64 requests in flight on this connection (max 64)",
                                    {"max": 64, "in_flight": 64})
            writer.write(protocol.encode_frame({"id": f["id"], "error": refusal.to_wire()}))
        else:
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"ok": True}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(refuse_the_first), sock_path)
        async with server:
            async with Client(sock_path) as c:
                assert await asyncio.wait_for(c.request(op, **args), 10) == {"ok": True}

    asyncio.run(go())
    assert [f["op"] for f in seen] == [op, op]


def test_process_writes_stay_in_order_when_the_first_is_refused_in_flight(tmp_path):
    """Writes to a Process from tasks of one loop go out at once, each at
    its offset. The first, refused for the in-flight limit, went again a
    moment later, after the second had reached the daemon, which refused
    that one as past the bytes written: the second write failed. It now
    goes again once the write before it has ended."""
    sock_path = str(tmp_path / "d.sock")
    stdin = bytearray()
    refused = []

    async def like_a_daemon(frame: dict, writer) -> bool:
        f = frame["args"]
        if not refused:
            refused.append(f["offset"])
            answer = {"error": LimitExceeded("64 requests in flight on this connection (max 64)",
                                             {"max": 64, "in_flight": 64}).to_wire()}
        elif f["offset"] > len(stdin):       # as procs._not_written_yet
            answer = {"error": Conflict(f"input at offset {f['offset']} is past the {len(stdin)} bytes its "
                                        "stdin took", {"offset": f["offset"], "taken": len(stdin)}).to_wire()}
        else:
            stdin.extend(f["data"][len(stdin) - f["offset"]:])
            answer = {"result": {"pid": 3, "written": len(f["data"])}}
        writer.write(protocol.encode_frame({"id": frame["id"], **answer}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(like_a_daemon), sock_path)
        async with server:
            async with Client(sock_path) as c:
                p = Process(Sandbox(c, "sb", {}), 3, stdin_at=0)
                await asyncio.wait_for(asyncio.gather(*(p.write(b"%d;" % i) for i in range(5))), 10)
                await asyncio.wait_for(p.write(b"end"), 10)     # the offset is still known

    asyncio.run(go())
    assert refused == [0]
    assert bytes(stdin) == b"0;1;2;3;4;end"
