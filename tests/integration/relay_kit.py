"""A relay between a client and the daemon that cuts the connection right
after a request of a given op went by (an ssh:// link lost mid-request):
for the tests of what a request sent again does (idempotency keys, input
offsets) on either backend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from dsecd import Client, protocol


class CuttingRelay:
    """A unix socket relaying to the daemon's, byte for byte, that drops
    the first connection on which a request of op `cut_op` goes by: both
    of its sides are aborted right after that request was passed on to the
    daemon, before any answer to it came back; or, given `cut_after` (an
    awaitable: the daemon acting on the request, seen from elsewhere),
    once that came, still before the answer. Later connections (the SDK's
    reconnect) are relayed as they are, `hold_s` after the cut at the
    earliest (a link that takes that long to come back)."""

    def __init__(self, daemon_socket: str, path: str, cut_op: str, cut_after: Awaitable | None = None,
                 hold_s: float = 0.0):
        self.daemon_socket = daemon_socket
        self.path = path
        self.cut_op = cut_op
        self.cut_after = cut_after
        self.hold_s = hold_s
        self._cut_at: float | None = None
        self.cut = asyncio.Event()
        self.resent = asyncio.Event()  # a request of `cut_op` went by after the cut
        self.seen: list[str] = []      # the ops of the requests relayed, in order
        self._server = None
        self._links: set[asyncio.Task] = set()

    async def __aenter__(self) -> CuttingRelay:
        self._server = await asyncio.start_unix_server(self._relay, self.path)
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        for task in self._links:
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)

    async def _relay(self, client_reader, client_writer) -> None:
        self._links.add(asyncio.current_task())
        if self._cut_at is not None:
            await asyncio.sleep(self._cut_at + self.hold_s - time.monotonic())
        daemon_reader, daemon_writer = await asyncio.open_unix_connection(self.daemon_socket)

        async def to_daemon() -> None:
            frames = protocol.FrameDecoder(1 << 30)
            while data := await client_reader.read(65536):
                daemon_writer.write(data)
                await daemon_writer.drain()
                for frame in frames.feed(data):
                    self.seen.append(frame.get("op"))
                    if frame.get("op") == self.cut_op and self.cut.is_set():
                        self.resent.set()
                    if frame.get("op") == self.cut_op and not self.cut.is_set():
                        if self.cut_after is not None:
                            await self.cut_after
                        self.cut.set()
                        self._cut_at = time.monotonic()
                        daemon_writer.transport.abort()
                        client_writer.transport.abort()
                        return

        async def to_client() -> None:
            while data := await daemon_reader.read(65536):
                client_writer.write(data)
                await client_writer.drain()

        try:
            up = asyncio.ensure_future(to_daemon())
            down = asyncio.ensure_future(to_client())
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
        finally:
            for writer in (daemon_writer, client_writer):
                writer.transport.abort()
            self._links.discard(asyncio.current_task())


async def write_twice_through_a_cut(daemon_socket: str, relay_path: str, sandbox_id: str):
    """Spawn `cat > /tmp/in` in the sandbox through a relay that cuts the
    connection after the first proc_input, write the lines "once" and
    "twice", close its stdin and wait for it: (its ProcStatus, the relay). Each
    input carries its offset, so the one sent again after the cut goes in
    once."""
    async with CuttingRelay(daemon_socket, relay_path, "proc_input") as relay:
        async with Client(relay.path) as c:
            mine = await c.get(sandbox_id)
            proc = await mine.spawn("cat > /tmp/in")
            await proc.write(b"once\n")
            await proc.write(b"twice\n")
            await proc.close_stdin()
            return await proc.wait(), relay



# A streamed exec's output: the numbers 1 to STREAM_LINES, a line each
# (~590 KB, more than the sockets between the daemon and the client hold),
# then "err" on stderr and exit 4.
STREAM_LINES = 100_000
STREAM_CUT_AT = 100_000     # bytes of it the client has when the link is cut


async def stream_through_a_cut(daemon_socket: str, relay_path: str, sandbox_id: str):
    """Run a keyed streamed exec (`seq`, STREAM_LINES) in the sandbox through
    a relay that cuts the connection once the client has STREAM_CUT_AT bytes
    of its output, with what was in flight lost with the link: (its
    ExecResult, the stdout its callback got, the relay). The exec goes
    again with the bytes that came; the daemon sends the rest."""
    got = bytearray()
    enough = asyncio.Event()

    def on_stdout(data: bytes) -> None:
        got.extend(data)
        if len(got) >= STREAM_CUT_AT:
            enough.set()

    async with CuttingRelay(daemon_socket, relay_path, "exec", cut_after=enough.wait()) as relay:
        async with Client(relay.path) as c:
            mine = await c.get(sandbox_id)
            r = await mine.exec(f"echo ran >> /tmp/ran; seq 1 {STREAM_LINES}; echo err >&2; exit 4",
                                on_stdout=on_stdout, key=f"streamed-once-{time.monotonic_ns()}")
            return r, bytes(got), relay


def assert_streamed_once_and_whole(r, got: bytes, relay, ran: bytes) -> None:
    """What stream_through_a_cut gave: the command ran once, and its output
    came whole, each byte once, to the result and the callback alike."""
    whole = "".join(f"{n}\n" for n in range(1, STREAM_LINES + 1)).encode()
    assert relay.cut.is_set() and relay.seen.count("exec") == 2, relay.seen
    assert ran == b"ran\n", ran
    assert (r.exit_code, r.stderr, r.lost_output) == (4, b"err\n", 0), r
    assert r.stdout == whole and got == whole, (len(r.stdout), len(got), len(whole))
