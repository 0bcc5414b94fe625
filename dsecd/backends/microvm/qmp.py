"""A QMP client on asyncio: QEMU's JSON control protocol over a unix socket.

QMP is line-delimited JSON: QEMU greets with {"QMP": ...}, the client sends
{"execute": "qmp_capabilities"}, then commands, each answered in order by
{"return": ...} or {"error": {"class", "desc"}}; {"event": ...} lines may
come at any time. Debian 12 packages no QMP library for Python
(python3-qemu.qmp is not in bookworm, and the PyPI qemu.qmp is an
alpha-versioned dependency for the ~80 lines needed here), so this is the
documented protocol spoken directly. Commands are serialised (one in flight),
which is all a sandbox's control needs; events are kept in a short list for
waiters (`wait_event`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from ...onloop import on_loop

log = logging.getLogger(__name__)


class QMPError(ConnectionError):
    """QEMU refused a command, or the monitor is gone. `qmp_class` is QEMU's error class."""

    def __init__(self, message: str, qmp_class: str = ""):
        super().__init__(message)
        self.qmp_class = qmp_class


class QMP:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, what: str):
        self.reader, self.writer, self.what = reader, writer, what
        self._loop = asyncio.get_running_loop()
        self.closed = False
        self._lock = asyncio.Lock()
        self.events: list[dict] = []
        self._event_waiters: list[tuple[str, asyncio.Future]] = []

    @classmethod
    async def connect(cls, path: str, what: str, timeout: float = 10.0) -> QMP:
        """Connect to QEMU's monitor socket at `path` (retried until it
        exists: QEMU makes it while starting) and negotiate capabilities."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path, limit=1 << 24)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise QMPError(f"{what}: no QMP monitor at {path} after {timeout:.0f}s "
                                   "(QEMU did not start; see its serial and stderr logs)") from None
                await asyncio.sleep(0.02)
        qmp = cls(reader, writer, what)
        try:
            greeting = await asyncio.wait_for(qmp._read(), timeout)
            if "QMP" not in greeting:
                raise QMPError(f"{what}: unexpected QMP greeting {greeting!r}")
            await qmp._command_now("qmp_capabilities", None, timeout)
        except BaseException:
            qmp.close()
            raise
        return qmp

    async def _read(self) -> dict:
        while True:
            line = await self.reader.readline()
            if not line:
                raise QMPError(f"{self.what}: QMP monitor closed (QEMU exited)")
            msg = json.loads(line)
            if "event" in msg:
                self._on_event(msg)
                continue
            return msg

    def _on_event(self, msg: dict) -> None:
        self.events.append(msg)
        del self.events[:-32]
        for name, fut in list(self._event_waiters):
            if msg["event"] == name and not fut.done():
                fut.set_result(msg)

    async def _command_now(self, name: str, args: dict | None, timeout: float) -> object:
        msg = {"execute": name, **({"arguments": args} if args else {})}
        if self.closed or self.writer.is_closing():
            # close() was called (a destroy ends the VM under a pause or a
            # resume; from a worker, the transport closes at the loop's next
            # turn): uvloop raises RuntimeError on a write to a closed one.
            raise QMPError(f"{self.what}: QMP monitor closed (its VM is being ended)")
        self.writer.write(json.dumps(msg).encode() + b"\n")
        await self.writer.drain()
        answer = await asyncio.wait_for(self._read(), timeout)
        if "error" in answer:
            err = answer["error"]
            raise QMPError(f"{self.what}: QMP {name} failed: {err.get('desc')}", err.get("class", ""))
        return answer.get("return")

    async def command(self, name: str, args: dict | None = None, timeout: float = 30.0) -> object:
        async with self._lock:
            return await self._command_now(name, args, timeout)

    async def send_fd(self, name: str, fd: int, timeout: float = 10.0) -> None:
        """`getfd`: hand QEMU an open fd (SCM_RIGHTS on the monitor socket)
        under `name`, for a later "fd:<name>" migration URI. Migrating to an
        fd, not `exec:` or a path, because QEMU runs under -sandbox
        spawn=deny as a uid that cannot open the VM's files itself."""
        import socket

        async with self._lock:
            if self.closed or self.writer.is_closing():
                raise QMPError(f"{self.what}: QMP monitor closed (its VM is being ended)")
            await self.writer.drain()
            sock = self.writer.get_extra_info("socket")
            line = json.dumps({"execute": "getfd", "arguments": {"fdname": name}}).encode() + b"\n"
            raw = socket.socket(fileno=os.dup(sock.fileno()))
            try:
                raw.setblocking(True)
                socket.send_fds(raw, [line], [fd])
            finally:
                raw.close()
            answer = await asyncio.wait_for(self._read(), timeout)
            if "error" in answer:
                raise QMPError(f"{self.what}: QMP getfd failed: {answer['error'].get('desc')}")

    async def migrate_wait(self, timeout: float) -> dict:
        """Poll query-migrate until the migration (out or in) completed;
        QMPError if it failed or did not finish in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            st = await self.command("query-migrate")
            status = (st or {}).get("status")
            if status == "completed":
                return st
            if status in ("failed", "cancelled"):
                raise QMPError(f"{self.what}: migration {status}: {st.get('error-desc', '')}")
            if loop.time() > deadline:
                raise QMPError(f"{self.what}: migration not done after {timeout:.0f}s (status {status})")
            await asyncio.sleep(0.01)

    async def wait_event(self, name: str, timeout: float) -> dict:
        """The next event `name` (read while a command waits, or by polling
        query-status in between: QMP sends events only when we read)."""
        fut = asyncio.get_running_loop().create_future()
        self._event_waiters.append((name, fut))
        try:
            deadline = asyncio.get_running_loop().time() + timeout
            while not fut.done():
                if asyncio.get_running_loop().time() > deadline:
                    raise QMPError(f"{self.what}: no {name} event within {timeout:.0f}s")
                await self.command("query-status")
                if not fut.done():
                    await asyncio.sleep(0.02)
            return fut.result()
        finally:
            self._event_waiters.remove((name, fut))

    def close(self) -> None:
        """Safe from any thread (a destroy's or a pause's blocking end of
        QEMU calls it in a worker): `closed` at once, the transport closed
        on the loop."""
        self.closed = True
        on_loop(self._loop, self._close_on_loop)

    def _close_on_loop(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass
