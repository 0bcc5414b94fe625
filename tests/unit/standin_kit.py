"""Stand-in daemons the unit tests share: asyncio unix-socket servers that
speak just enough of the protocol to put a client in a given spot."""

from __future__ import annotations

from dsecd import protocol


def serving(on_request):
    """A connection callback for asyncio.start_unix_server: hello answered
    as a daemon answers it (no limits), every other request frame handed to
    `await on_request(frame, writer)` in order; a true return ends the
    connection's reading."""
    async def serve(reader, writer) -> None:
        dec = protocol.FrameDecoder(1 << 20)
        while data := await reader.read(65536):
            for f in dec.feed(data):
                if f["op"] == "hello":
                    writer.write(protocol.encode_frame({"id": f["id"], "result": {"limits": {}}}))
                elif await on_request(f, writer):
                    return
    return serve


async def _drop(frame: dict, writer) -> bool:
    writer.transport.abort()
    return True


async def _hold(frame: dict, writer) -> bool:
    return False


# Answers hello, then drops the connection at the first other request (a
# daemon that dies under a request in flight).
hello_then_drop = serving(_drop)
# Answers hello, then leaves every other request unanswered (a daemon busy
# with it).
hello_then_hold = serving(_hold)


async def _say_and_hold(frame: dict, writer) -> bool:
    print("request", frame["op"], flush=True)
    return False


# As hello_then_hold, and each request's op printed on stdout ("request
# OP") as it comes: a test run in another process waits for that line
# rather than guessing how long the client takes to get there.
hello_then_say_and_hold = serving(_say_and_hold)
