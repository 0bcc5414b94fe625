"""A build or import from a client's path takes the client's pidfd in a
worker (fs/clientpaths.py). It is taken through the connection's socket,
whose fd number is closed when the connection ends (or the transport fails)
while a cancelled request's worker may still run, and the next connection
may get that number: the pidfd is taken on the loop, and only while the
connection's transport is open."""

from __future__ import annotations

import asyncio
import os
import socket
from types import SimpleNamespace

import pytest

from dsecd.server import Connection, RequestContext


async def _connection() -> tuple[Connection, socket.socket]:
    mine, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=mine)
    conn = Connection(SimpleNamespace(max_frame=1 << 20), None, writer)
    conn.sock, conn.pid = writer.get_extra_info("socket"), os.getpid()
    return conn, theirs


def _pid_of(pidfd: int) -> int:
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Pid:")))


def test_a_worker_gets_the_clients_pidfd_while_the_connection_is_open():
    async def run():
        conn, theirs = await _connection()
        ctx = RequestContext(conn, 1)
        pidfd = await asyncio.to_thread(ctx.peer_pidfd)
        try:
            assert _pid_of(pidfd) == os.getpid()
        finally:
            os.close(pidfd)
            conn.writer.close()
            theirs.close()
    asyncio.run(run())


def test_a_worker_asking_after_the_connection_closed_gets_no_pidfd():
    async def run():
        conn, theirs = await _connection()
        ctx = RequestContext(conn, 1)
        number = conn.sock.fileno()
        conn.writer.close()
        await asyncio.sleep(0.01)
        # The next connection takes the number (its peer: this process).
        taken, peer = socket.socketpair()
        try:
            assert number in (taken.fileno(), peer.fileno())
            with pytest.raises(ProcessLookupError):
                await asyncio.to_thread(ctx.peer_pidfd)
        finally:
            taken.close()
            peer.close()
            theirs.close()
    asyncio.run(run())
