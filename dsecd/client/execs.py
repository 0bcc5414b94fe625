"""An exec's output as a stream (ExecStream: stdin fed, a pty resized, a
signal sent while it runs), and its collection into an ExecResult.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from ..errors import ConnectionLost, DsecError
from .args import Stdin
from .pieces import DEFAULT_CHUNK
from .results import ExecResult
from .wire import _cancel

if TYPE_CHECKING:
    from .sandbox import Sandbox


class ExecStream:
    """Async iterator of (fd, bytes) output chunks; `.result` once it is exhausted.

    Iterating sends the exec. While it runs, `write` sends input (to a pty
    exec: typed into its terminal, b"\\x03" is ^C), `resize` sets a pty
    exec's window size and `signal` signals its process group; they wait
    until the exec request is on the wire, so they are called from another
    task than the one iterating (or between its chunks)."""

    def __init__(self, sb: Sandbox, args: dict, stdin: Stdin | None):
        if not (stdin is None or isinstance(stdin, (bytes, bytearray, memoryview)) or hasattr(stdin, "__aiter__")):
            hint = ": encode it" if isinstance(stdin, str) else " (b\"\".join(...) a list of chunks)"
            raise TypeError(f"stdin must be bytes or an async iterator of bytes, got {type(stdin).__name__}{hint}")
        self.sb = sb
        self.args = args
        self.stdin = stdin
        self.result: ExecResult | None = None
        self.exec_id = sb.client.new_id()        # the exec request's id: exec_input and exec_resize name it
        self._sent = asyncio.Event()
        self._iterated = False
        self._stdin_failed: Exception | None = None      # the stdin iterator's own error
        # Why the exec ended before it was sent (set then, with _sent, so
        # that write, resize and signal waiting for it end too).
        self._unsent: BaseException | None = None

    async def _until_sent(self, op: str) -> None:
        """Wait until the exec request is on the wire; raise if it ended without being sent."""
        await self._sent.wait()
        if self._unsent is not None:
            text = (f"{op}: exec {self.args['argv']!r} in {self.sb.id} was never sent, so it did not run: "
                    f"{type(self._unsent).__name__}: {self._unsent}")
            if isinstance(self._unsent, ConnectionError):
                raise ConnectionLost(text, target=self.sb.client.target, op=op, sent=False)
            raise RuntimeError(text)

    async def write(self, data: bytes) -> None:
        """Input for the running exec (one exec_input; waits while it does not read)."""
        await self._until_sent("exec_input")
        await self.sb.client.request("exec_input", exec_id=self.exec_id, data=bytes(data))

    async def resize(self, rows: int, cols: int) -> None:
        """A pty exec's window size; its foreground process group gets SIGWINCH."""
        await self._until_sent("exec_resize")
        await self.sb.client.request("exec_resize", exec_id=self.exec_id, rows=rows, cols=cols)

    async def signal(self, signal: int | str) -> None:
        """Send a signal to the running exec's process group: a number or a
        name ("INT", "SIGTERM"); one still starting gets it once it has
        started. NotFound when it has ended."""
        await self._until_sent("exec_signal")
        sig = int(signal) if not isinstance(signal, str) else signal
        await self.sb.client.request("exec_signal", exec_id=self.exec_id, signal=sig)

    async def _feed(self, exec_id: int, sent: asyncio.Event) -> None:
        """stdin as exec_input requests; a stdin iterator that fails cancels the exec."""
        c = self.sb.client
        await sent.wait()      # exec_input must follow the exec request on the wire
        chunk = c.server.get("limits", {}).get("max_file_chunk_bytes", DEFAULT_CHUNK)
        if isinstance(self.stdin, (bytes, bytearray, memoryview)):
            data = bytes(self.stdin)
            for i in range(0, len(data), chunk):
                await c.request("exec_input", exec_id=exec_id, data=data[i:i + chunk])
        elif self.stdin is not None:
            source = aiter(self.stdin)
            while True:
                try:
                    piece = await anext(source)
                    if not isinstance(piece, (bytes, bytearray, memoryview)):
                        raise TypeError(f"exec stdin: the async iterator gave a {type(piece).__name__}; give bytes"
                                        + (": encode it" if isinstance(piece, str) else ""))
                except StopAsyncIteration:
                    break
                except Exception as err:
                    # The command would wait for the rest of its input, and
                    # its caller with it: it is cancelled (killed), and
                    # __aiter__ raises the iterator's error once it has ended
                    # (which may come before the cancel's own answer).
                    self._stdin_failed = err
                    await _cancel(c, exec_id)
                    return
                await c.request("exec_input", exec_id=exec_id, data=bytes(piece))
        await c.request("exec_input", exec_id=exec_id, eof=True)

    async def __aiter__(self):
        if self._iterated:
            # Again, it would run the command a second time, under the same request id.
            raise RuntimeError(f"exec_stream {self.args['argv']!r} in {self.sb.id} runs once: it was iterated "
                               "already (its output went to that loop; .result is its result); call "
                               "exec_stream again to run the command again")
        self._iterated = True
        c = self.sb.client
        feeder = None
        rid, sent = self.exec_id, self._sent
        if self.stdin is not None:
            feeder = asyncio.get_running_loop().create_task(self._feed(rid, sent))
        failure: BaseException | None = None
        lost = 0
        try:
            async with contextlib.aclosing(c.frames_with_id(rid, "exec", self.args, sent)) as frames:
                async for frame in frames:
                    if "__result__" in frame:
                        self.result = ExecResult.from_result(frame["__result__"])
                        self.result.lost_output = lost
                        return
                    if frame.get("lost"):           # taken up again after a loss, past what the daemon kept
                        lost += frame["lost"]
                        continue
                    if "data" not in frame:         # {"resumed": true}: sent again, and taken up
                        continue
                    yield frame["fd"], frame["data"]
        except BaseException as err:
            failure = err
            raise
        finally:
            if feeder:
                if not feeder.done():
                    feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
                    await feeder
            if not sent.is_set():
                # Never sent (its connection lost for good, its arguments
                # refused here, the loop closed early): write, resize and
                # signal waiting for it raise instead of waiting for ever.
                self._unsent = failure or RuntimeError("the loop iterating it stopped first")
                sent.set()
            if feeder and self._stdin_failed is not None:
                raise self._stdin_failed


async def _collect(stream, on_stdout, on_stderr) -> ExecResult:
    """Drain an exec's stream of (fd, data): its ExecResult with the whole
    output, each chunk also handed to its fd's callback (which may be async)."""
    out: dict[int, list[bytes]] = {1: [], 2: []}
    callbacks = {1: on_stdout, 2: on_stderr}
    # aclosing: a callback that raises ends the exec (cancelled, and settled)
    # before its error goes on, not whenever the stream is collected.
    async with contextlib.aclosing(aiter(stream)) as chunks:
        async for fd, data in chunks:
            out[fd].append(data)
            if callbacks[fd] is not None:
                result = callbacks[fd](data)
                if asyncio.iscoroutine(result):
                    await result
    assert stream.result is not None
    stream.result.stdout, stream.result.stderr = b"".join(out[1]), b"".join(out[2])
    return stream.result
