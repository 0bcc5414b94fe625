"""Stand-in daemons the unit tests share: asyncio unix-socket servers that
speak just enough of the protocol to put a client in a given spot."""

from __future__ import annotations

from dsecd import protocol


async def hello_then_drop(reader, writer) -> None:
    """Answers hello, then drops the connection at the first other request
    (a daemon that dies under a request in flight)."""
    dec = protocol.FrameDecoder(1 << 20)
    while data := await reader.read(65536):
        for f in dec.feed(data):
            if f["op"] != "hello":
                writer.transport.abort()
                return
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"limits": {}}}))
