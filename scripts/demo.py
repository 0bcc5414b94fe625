"""A real workload through a running dsecd, printing what happened.

Imports the busybox rootfs as an image (once), creates a batch of sandboxes
concurrently, runs commands in them (a tiny "agent task": write code, run it,
read the result back), shows a timeout and the output cap, and destroys them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import dsecd
from dsecd.errors import DsecError

TASK = b"""#!/bin/sh
# An agent's step: compute something and leave a file behind.
n=0; for i in $(seq 1 $1); do n=$((n + i)); done
echo "sum(1..$1) = $n" | tee /work/result.txt
"""


async def one_task(c: dsecd.Client, i: int) -> dict:
    t0 = time.perf_counter()
    sb = await c.create(image="busybox", cpu=0.5, memory="128M", labels={"demo": "1"})
    t_create = time.perf_counter() - t0
    await sb.write_file("/work/task.sh", TASK, mode=0o755)
    r = await sb.exec(["/work/task.sh", str(100 * (i + 1))], timeout=30)
    result = await sb.read_file("/work/result.txt")
    await sb.destroy()
    return {"id": sb.id, "create_ms": t_create * 1000, "exit": r.exit_code,
            "stdout": r.stdout.decode().strip(), "file": result.decode().strip()}


async def main(socket: str, rootfs: str, n: int) -> None:
    async with dsecd.Client(socket, name="demo") as c:
        info = await c.info()
        missing = [k for k, v in info["features"].items() if not v["available"]]
        print(f"dsecd {info['version']} on kernel {info['kernel']} (cgroups {info['cgroup_mode']}); "
              f"unavailable here: {', '.join(sorted(missing)) or 'nothing'}")
        if "busybox" not in {i["name"] for i in await c.list_images()}:
            img = await c.build_image(rootfs, "busybox")
            print(f"built image busybox: {len(img['layers'])} EROFS layer(s), {img['bytes'] / 1e6:.1f} MB, "
                  f"manifest {img['manifest'][:19]}")

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_task(c, i) for i in range(n)))
        wall = time.perf_counter() - t0
        for r in results[:3]:
            print(f"  sandbox {r['id']}: exit {r['exit']}, stdout {r['stdout']!r}, /work/result.txt {r['file']!r}")
        ok = sum(1 for r in results if r["exit"] == 0 and r["stdout"] == r["file"])
        print(f"{ok}/{n} agent tasks ok (create, write, exec, read back, destroy) in {wall:.2f}s; "
              f"create p50 {statistics.median(r['create_ms'] for r in results):.1f} ms")

        sb = await c.create(image="busybox", labels={"demo": "1"})
        r = await sb.exec(["sh", "-c", "echo start; sleep 30"], timeout=1)
        print(f"timeout: `sleep 30` with timeout=1s -> timed_out={r.timed_out}, signal={r.signal}")
        r = await sb.exec(["yes"], timeout=30)
        print(f"output cap: `yes` -> truncated={r.truncated} after {len(r.stdout)} bytes, signal={r.signal}")
        try:
            await sb.read_file("/../../etc/shadow")
        except DsecError as err:
            print(f"escape attempt refused: {err}")
        await sb.destroy()
        left = await c.list({"demo": "1"})
        print(f"sandboxes left from the demo: {len(left)}")
        if ok != n or left:
            raise SystemExit("demo: FAILED")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--socket", default=dsecd.client.default_socket())
    p.add_argument("--rootfs", required=True)
    p.add_argument("-n", type=int, default=20)
    a = p.parse_args()
    asyncio.run(main(a.socket, a.rootfs, a.n))
