"""The FnCall zygote's own cost per call: what `make bench-burst`'s CPU split
cannot tell apart.

Starts a private daemon (bench/harness.py) with the host's python3 imported
as "py" (scripts/mkpyrootfs.sh), warms the image's call sandbox with 30
calls, then for each of `--concurrency` (1, 8, 64 calls in flight by
default) runs `--calls` calls of `python3 -c 'print(1)'` and reads the
zygote's /proc/PID/stat around them: its minor faults per call (each one,
past the fork's own, a page of the zygote's copy-on-write memory its loop
wrote after a fork: docs/burst.md, "Spares forked in a batch") and its CPU
ms per call (user + system, the workers it reaped not counted).

Prints progress on stderr and one JSON object as the last line of stdout:
{"zygote_faults_per_call": {"1": ..., "8": ..., "64": ...},
 "zygote_cpu_ms_per_call": {...}}. Run as root:
`.venv/bin/python bench/zygote.py [--calls N] [--concurrency 1,8,64]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import harness
import uvloop
from burst import CONFIG, build_py_rootfs

import dsecd

ARGV = ["python3", "-c", "print(1)"]
log = harness.log


def zygote_counters(pid: int) -> tuple[int, int]:
    """(minor faults, user + system clock ticks) of process `pid`."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[11]) + int(fields[12])


async def measure(sock: str, calls: int, levels: list[int]) -> dict:
    ticks_ms = 1000 / os.sysconf("SC_CLK_TCK")
    faults, cpu = {}, {}
    async with dsecd.Client(sock) as c:
        for _ in range(30):
            await c.call("py", argv=ARGV)
        info = await c.info()
        pid = next(b for b in info["fncall"]["boxes"] if b["image"] == "py")["zygote_pid"]
        async def one(gate: asyncio.Semaphore) -> None:
            async with gate:
                r = await c.call("py", argv=ARGV)
            if r.stdout != b"1\n":
                raise RuntimeError(f"call: {r}")

        for level in levels:
            gate = asyncio.Semaphore(level)
            f0, t0 = zygote_counters(pid)
            await asyncio.gather(*(one(gate) for _ in range(calls)))
            f1, t1 = zygote_counters(pid)
            faults[str(level)] = round((f1 - f0) / calls, 1)
            cpu[str(level)] = round((t1 - t0) * ticks_ms / calls, 3)
            log(f"zygote: {level} in flight: {faults[str(level)]} minor faults, {cpu[str(level)]} CPU ms per call")
    return {"zygote_faults_per_call": faults, "zygote_cpu_ms_per_call": cpu}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400, help="calls per concurrency level")
    p.add_argument("--concurrency", default="1,8,64", help="calls in flight, comma-separated levels")
    args = p.parse_args()
    if os.geteuid() != 0:
        log("must run as root")
        return 1
    levels = [int(x) for x in args.concurrency.split(",") if x]
    rootfs = harness.build_rootfs()
    py = build_py_rootfs()
    with harness.private_daemon(rootfs, "busybox", extra_config=CONFIG) as daemon:
        daemon.import_image(py, "py")
        result = uvloop.run(measure(daemon.sock, args.calls, levels))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
