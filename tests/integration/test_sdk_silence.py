"""The SDK's silence watch on a local socket: a daemon that stops answering
(SIGSTOP) fails the requests waiting on it instead of holding them for
ever; one that answers its pings keeps long quiet requests running."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import dsecd
from dsecd import ConnectionLost

WINDOW_S = 1.0


def test_a_stopped_daemon_fails_the_waiting_request_and_a_quiet_one_runs_on(daemon_factory, busybox_rootfs):
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.close()

    async def go():
        async with dsecd.Client(d.socket, silence_timeout=WINDOW_S) as c:
            sb = await c.create("busybox", memory="64M")
            # Quiet for three windows, its pings answered: left to run. So
            # is a follow of a process that prints nothing for as long.
            proc = await sb.spawn(["sh", "-c", f"sleep {3 * WINDOW_S}; echo late"])
            quiet = await sb.exec(["sleep", str(3 * WINDOW_S)], timeout=30)
            assert quiet.exit_code == 0, quiet
            said = b"".join([chunk.data async for chunk in proc.output()])
            assert said == b"late\n", said

            os.kill(d.proc.pid, signal.SIGSTOP)         # this test's daemon only
            try:
                t = time.monotonic()
                try:
                    await asyncio.wait_for(sb.exec(["true"]), 30)
                except ConnectionLost as err:
                    lost, took = err, time.monotonic() - t
                else:
                    raise AssertionError("an exec on a stopped daemon was answered")
                with open(f"/proc/{d.proc.pid}/status") as f:
                    assert "State:\tT" in f.read()      # still stopped: the watch ended it, not the daemon
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            r = await sb.exec(["echo", "back"], timeout=30)      # on a new connection
            await sb.destroy(force=True)
            return lost, took, r

    lost, took, r = asyncio.run(go())
    said = str(lost)
    assert WINDOW_S <= took < WINDOW_S + 4, (took, said)
    assert f"the daemon at {d.socket} sent nothing for " in said and "with requests waiting" in said, said
    assert f"State: T in /proc/{d.proc.pid}/status" in said and "wedged" in said, said
    assert r.exit_code == 0 and r.stdout == b"back\n", r
