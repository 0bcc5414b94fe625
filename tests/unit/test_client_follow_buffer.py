"""A followed background process's output held for a reader that is
behind, against a stand-in daemon on a unix socket: bounded, with what
did not fit counted as dropped, as the daemon's ring counts it."""

from __future__ import annotations

import asyncio

import pytest
from standin_kit import serving

from dsecd import protocol
from dsecd.client import FOLLOWED_OUTPUT_BYTES, Client, Process, Sandbox

MIB = 1 << 20


@pytest.mark.parametrize("follow", [True, False])
def test_a_follower_that_falls_behind_gets_a_dropped_count_not_every_byte(tmp_path, follow):
    """The client reads every frame as it comes (other requests share the
    connection), so a process writing faster than its follower reads was
    held whole: gigabytes in seconds for `cat /dev/zero`. Without follow,
    what comes is the daemon's ring, however large it was made: all of it."""
    sock_path = str(tmp_path / "d.sock")
    sent = 2 * FOLLOWED_OUTPUT_BYTES // MIB + 4

    async def answer(f: dict, writer) -> bool:
        if f["op"] == "proc_logs":
            writer.write(protocol.encode_frame({"id": f["id"], "stream": {"dropped": 0}}))
            for i in range(sent):
                writer.write(protocol.encode_frame({"id": f["id"], "stream": {"fd": 1, "data": b"x" * MIB,
                                                                             "time": float(i)}}))
                await writer.drain()
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"pid": 3, "state": "exited"}}))
        else:
            writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                proc = Process(Sandbox(c, "sb", {}), 3)
                chunks = proc.output(follow=follow)
                got = [await anext(chunks)]
                # Answered after every frame of the output was written: by
                # the time it is here, the client has read all of them.
                await c.info()
                got += [chunk async for chunk in chunks]
                return got

    got = asyncio.run(go())
    data = sum(len(c.data) for c in got)
    dropped = sum(c.dropped for c in got)
    assert data + dropped == sent * MIB
    if not follow:
        assert dropped == 0
        return
    assert dropped > 0 and data <= FOLLOWED_OUTPUT_BYTES + MIB
    # Where the gap is: after what was held, before the end.
    assert (got[-1].fd, got[-1].data, got[-1].dropped) == (0, b"", dropped)
