"""How long a busy daemon takes to answer a ping: the figure behind the
SDK's silence watch on a local socket (client.wire.LOCAL_SILENCE_S).

It starts a test daemon (tests/integration/conftest.py's Daemon, on a
private socket, state dir and dsecd-test-* cgroup subtree), imports the
busybox rootfs, and, while --clients clients create --burst sandboxes
(each then answers an exec of `true`, as bench/burst.py's burst does) and
one destroy_all removes them, a separate process pings the daemon on its
own connection every --every s. It prints one JSON object: the ping round
trips (ms: p50, p99, p999, max, count) during the creates and during the
destroy, the burst's wall times, and the load average before it.

    sudo .venv/bin/python bench/ping_in_burst.py --burst 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

CONFIG = ("[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n"
          "[limits]\nmax_sandboxes = 8192\nmax_requests_per_client = 1024\n")
SHAPE = {"cpu": 0.1, "memory": "64M"}


async def pinger(sock: str, every: float) -> None:
    """Ping until stdin closes, printing each round trip (ms), one a line;
    a line `phase NAME` read from stdin starts a new phase."""
    import dsecd

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    phase = ["idle"]

    async def phases() -> None:
        while line := await reader.readline():
            phase[0] = line.decode().split()[1]
        phase[0] = ""

    watcher = asyncio.create_task(phases())
    async with dsecd.Client(sock) as c:
        while phase[0]:
            t, now = time.perf_counter(), phase[0]
            await c.request("ping")
            print(now, round((time.perf_counter() - t) * 1000, 3), flush=True)
            await asyncio.sleep(every)
    await watcher


def figures(rtts: list[float]) -> dict:
    rtts = sorted(rtts)
    if not rtts:
        return {"count": 0}
    at = lambda q: rtts[min(len(rtts) - 1, int(q * len(rtts)))]  # noqa: E731
    return {"count": len(rtts), "p50": at(0.5), "p99": at(0.99), "p999": at(0.999), "max": rtts[-1]}


async def burst(sock: str, total: int, clients: int, in_flight: int) -> float:
    import dsecd

    conns = [dsecd.Client(sock) for _ in range(clients)]
    for cl in conns:
        await cl.connect()
    queue = list(range(total))

    async def one(cl) -> None:
        while queue:
            queue.pop()
            while True:
                try:
                    sb = await cl.create("busybox", labels={"bench": "ping"}, **SHAPE)
                    break
                except dsecd.errors.Busy as err:
                    await asyncio.sleep(err.detail.get("retry_after_s", 0.1))
            r = await sb.exec(["true"], timeout=60)
            if r.exit_code != 0:
                raise RuntimeError(f"exec true in {sb.id}: {r}")

    t = time.perf_counter()
    try:
        await asyncio.gather(*(one(cl) for cl in conns for _ in range(in_flight)))
    finally:
        for cl in conns:
            await cl.close()
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--burst", type=int, default=2000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=4, help="creates in flight per client")
    p.add_argument("--every", type=float, default=0.02, help="seconds between pings")
    p.add_argument("--ping", metavar="SOCKET", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.ping:
        asyncio.run(pinger(a.ping, a.every))
        return 0

    from conftest import Daemon

    import dsecd

    rootfs = subprocess.run(["bash", str(ROOT / "scripts" / "mkrootfs.sh")], check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")), CONFIG, log_level="info")
    ping = None
    try:
        d.start()
        c = d.client()
        c.import_image(rootfs, "busybox")
        load = os.getloadavg()[0]
        ping = subprocess.Popen([sys.executable, __file__, "--ping", d.socket, "--every", str(a.every)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        time.sleep(1)
        ping.stdin.write("phase create\n")
        ping.stdin.flush()
        create_s = asyncio.run(burst(d.socket, a.burst, a.clients, a.in_flight))
        ping.stdin.write("phase destroy\n")
        ping.stdin.flush()
        t = time.perf_counter()
        destroyed = c.destroy_all(force=True)
        destroy_s = time.perf_counter() - t
        c.close()
        out, _ = ping.communicate(timeout=60)
        by: dict[str, list[float]] = {}
        for line in out.splitlines():
            phase, ms = line.split()
            by.setdefault(phase, []).append(float(ms))
        print(json.dumps({"burst": a.burst, "clients": a.clients, "in_flight": a.in_flight,
                          "load_before": load, "create_s": round(create_s, 1),
                          "destroy_s": round(destroy_s, 1), "destroyed": len(destroyed.get("destroyed", [])),
                          "dsecd": dsecd.__version__,
                          **{f"ping_ms_{k}": figures(v) for k, v in by.items()}}))
    finally:
        if ping is not None and ping.poll() is None:
            ping.kill()
            ping.wait()
        d.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
