"""A streaming exec read by a client that decides when it reads: a raw
socket speaking the daemon's protocol (the client library reads every
frame as it comes, into its own memory, so it cannot be slow where it
matters: at the socket). Its receive buffer is small, so what it does not
read waits in the daemon (or, with flow control, behind it). Used by
test_microvm_flow.py and bench/microvm.py --exec-output."""

from __future__ import annotations

import socket
import struct

import msgpack

from dsecd import protocol

RCVBUF = 32 << 10       # the kernel doubles it; small, so that the daemon's side of the socket fills soon


class SlowStream:
    """One exec, streamed (`stream` on; `pty`: on a terminal, uncapped),
    on a connection of its own; nothing is read until read_* is called."""

    def __init__(self, socket_path: str, sandbox: str, argv: list[str], pty: bool = True, timeout: float = 300):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self.sock.settimeout(timeout)
        self.sock.connect(socket_path)
        self.data = bytearray()
        self.result: dict | None = None
        self._send({"id": 0, "op": "hello", "args": {"protocol": 1, "client": "stream_kit"}})
        hello = self._recv()
        if "result" not in hello:
            raise RuntimeError(f"hello refused: {hello}")
        args = {"sandbox": sandbox, "argv": argv, "env": {}, "stdin": pty, "stream": True, "trace": False}
        if pty:
            args["pty"] = True
        self._send({"id": 1, "op": "exec", "args": args})

    def _send(self, obj: dict) -> None:
        self.sock.sendall(protocol.encode_frame(obj))

    def _exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            out += chunk
        return bytes(out)

    def _recv(self) -> dict:
        (n,) = struct.unpack(">I", self._exactly(4))
        return msgpack.unpackb(self._exactly(n), raw=False)

    def _next(self) -> bool:
        """One frame of the exec: False once its result came."""
        frame = self._recv()
        if frame.get("id") != 1:
            return True
        if "stream" in frame:
            self.data += frame["stream"]["data"]
            return True
        if "error" in frame:
            raise RuntimeError(f"exec failed: {frame['error']}")
        self.result = frame["result"]
        return False

    def read_at_least(self, n: int) -> None:
        """Read until `n` bytes of output came (or the exec ended)."""
        while self.result is None and len(self.data) < n:
            self._next()

    def read_to_end(self) -> dict:
        while self.result is None and self._next():
            pass
        return self.result

    def close(self) -> None:
        self.sock.close()
