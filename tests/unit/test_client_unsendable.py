"""A request whose arguments cannot be packed (a datetime.timedelta where a
number of seconds goes), against a stand-in daemon on a unix socket that
records what reaches it: nothing was sent, so nothing is cancelled or
waited for."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from standin_kit import serving

from dsecd import protocol
from dsecd.client import Client


@pytest.mark.parametrize("op,args", [("exec", {"sandbox": "sb", "argv": ["true"],
                                               "timeout": datetime.timedelta(seconds=5)}),
                                     ("create", {"image": "busybox", "ttl": datetime.timedelta(hours=1)})])
def test_a_request_that_cannot_be_packed_was_not_sent(tmp_path, op, args):
    """It was taken as sent and abandoned: a cancel went for a request the
    daemon never saw, the call waited 10 s for its answer, and a create's
    undo held close() up another 10 s."""
    sock_path = str(tmp_path / "d.sock")
    seen: list[str] = []

    async def record(f: dict, writer) -> bool:
        seen.append(f["op"])
        writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(record), sock_path)
        async with server:
            async with Client(sock_path) as c:
                with pytest.raises(TypeError) as err:
                    await c.request(op, **args)
                assert not c._undoing
                await c.info()             # answered after anything sent before it has arrived
                assert c.connected

                return str(err.value)

    message = asyncio.run(go())
    assert seen == ["info"]
    assert message.startswith(f"{op}: ") and "timedelta" in message      # which request, and what
