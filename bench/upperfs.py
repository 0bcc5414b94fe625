"""`make bench-upperfs`: what the capped writable layer costs a create.

Two private daemons run side by side, one with `sandbox.writable_layer =
"dir"` (upper dir in the state dir, no cap) and one with "tmpfs" (a detached
tmpfs capped at `sandbox.disk`, dsecd/fs/upper.py). The bench alternates
between them, one create + exec `true` + destroy at a time, so both see the
same load on a shared machine; each figure is over --n rounds per daemon.

Last line of stdout: one JSON object with create_exec_p50_ms_dir,
create_exec_p50_ms_tmpfs (and p90), delta_p50_ms, and
write_mib_per_s_dir/_tmpfs (best of 3 dd runs of 128 MiB into the writable layer).

Run as root: `.venv/bin/python bench/upperfs.py [--n 150]`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import harness
import peers

import dsecd

# Appended to the harness's [sandbox] section (its own cgroup subtree per tag,
# removed at exit).
EXTRA = 'writable_layer = "{mode}"\n[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n'
MODES = ("dir", "tmpfs")


def one_round(client) -> float:
    t0 = time.perf_counter()
    sb = client.create(image="busybox", memory="256M")
    sb.exec(["true"])
    sb.destroy()
    return (time.perf_counter() - t0) * 1000


def write_rate(client, mib: int = 128, tries: int = 3) -> float:
    """Best of `tries` dd runs of `mib` MiB into the writable layer (exec overhead included)."""
    sb = client.create(image="busybox", memory="1G")
    try:
        best = 0.0
        for _ in range(tries):
            t0 = time.perf_counter()
            r = sb.exec(["sh", "-c", f"dd if=/dev/zero of=/f bs=1M count={mib} 2>/dev/null && rm /f"])
            if r.exit_code != 0:
                raise RuntimeError(f"dd failed: {r.stderr!r}")
            best = max(best, mib / (time.perf_counter() - t0))
        return best
    finally:
        sb.destroy(force=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=150, help="create+exec+destroy rounds per daemon")
    args = p.parse_args()
    rootfs = harness.build_rootfs()
    with contextlib.ExitStack() as stack:
        clients = {}
        for mode in MODES:
            daemon = stack.enter_context(harness.private_daemon(
                rootfs, "busybox", extra_config=EXTRA.format(mode=mode), tag=f"-{mode}"))
            c = dsecd.SyncClient(daemon.sock)
            c.connect()
            stack.callback(c.close)
            clients[mode] = c
        for c in clients.values():          # warm-up: layer mounts, caches
            for _ in range(5):
                one_round(c)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.n):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                times[mode].append(one_round(clients[mode]))
        rates = {m: round(write_rate(clients[m]), 1) for m in MODES}
    out = {}
    for m in MODES:
        out[f"create_exec_p50_ms_{m}"] = peers.pct(times[m], 50)
        out[f"create_exec_p90_ms_{m}"] = peers.pct(times[m], 90)
    out["delta_p50_ms"] = round(out["create_exec_p50_ms_tmpfs"] - out["create_exec_p50_ms_dir"], 3)
    for m in MODES:
        out[f"write_mib_per_s_{m}"] = rates[m]
    out["rounds"] = args.n
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    harness.run(main)
