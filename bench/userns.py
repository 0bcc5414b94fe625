"""`make bench-userns`: what a user namespace per sandbox costs.

Two private daemons run side by side, one with `[sandbox] userns = true`, one
with `userns = false` (sandbox root = host root), both with admission off.
Cycles alternate between them (and which goes first), so the noise of a
shared host falls on both alike. Measured through the Python SDK:

* create_p50_ms / _p99_ms: the `create` call alone (namespace, idmapped
  layer clones, spawn, network, journal), per mode;
* create_exec_destroy_p50_ms: create + exec `true` + destroy, per mode;
* exec_rtt_p50_ms: exec `true` in a running sandbox (the exec helper joins
  the user namespace with one more setns), per mode;
* *_delta_ms: userns minus host-root, of the p50s;

*_paired_delta_p50_ms: the median of the per-cycle differences (each
userns cycle minus the host-root cycle next to it), less moved by drift;

and, in this process, without a daemon: spawn_us_p50_{userns,hostroot}
(namespace + idmapped clones + dsec_spawn_container of a busybox overlay,
no cgroups, network or journal; alternating) and the two native steps the
create adds:
userns_create_us_p50 (clone a holder into a new user namespace, write its
maps, keep an fd, kill it) and idmap_mount_us_p50 (open_tree clone +
mount_setattr MOUNT_ATTR_IDMAP of one mount).

Progress on stderr; the last line of stdout is one JSON object.
Run as root: `.venv/bin/python bench/userns.py [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

import harness
import peers
import uvloop

import dsecd
from dsecd import native, userns
from dsecd.backends.container import _IdmappedLayers

IMAGE = "busybox"
CREATE_ARGS = {"image": IMAGE, "cpu": 0.5, "memory": "256M"}
NO_ADMISSION = "[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n"
MODES = ("userns", "hostroot")
WARMUP = 5
OP_TIMEOUT_S = 120

log = harness.log


p = peers.pct


def measure_native(n: int) -> dict:
    """The two kernel steps a userns create adds, timed in this process."""
    log(f"native: {n} x userns_create, {n} x idmapped clone of {tempfile.gettempdir()}")
    ns_us, idmap_us = [], []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        ns = native.userns_create(2**32 - 2 - 65536, 2**32 - 2 - 65536, 65536)
        t1 = time.perf_counter_ns()
        fd = native.mount_idmapped(tempfile.gettempdir(), ns)
        t2 = time.perf_counter_ns()
        os.close(fd)
        os.close(ns)
        ns_us.append((t1 - t0) / 1e3)
        idmap_us.append((t2 - t1) / 1e3)
    out = {"userns_create_us_p50": p(ns_us, 50), "idmap_mount_us_p50": p(idmap_us, 50)}
    log(f"  {out}")
    return out


def spawn_once(lower: str, top: Path, idmap: userns.IdMap | None) -> float:
    """µs for namespace + idmapped clones + spawn of one container; then kill it."""
    for sub in ("upper", "work", "rootfs"):
        (top / sub).mkdir(parents=True)
    t0 = time.perf_counter_ns()
    with _IdmappedLayers(idmap, [lower], top / "upper", top / "work") as layers:
        spec = native.ContainerSpec(
            rootfs=str(top / "rootfs"), lowerdirs=layers.lowerdirs, upperdir=layers.upperdir,
            workdir=layers.workdir, hostname="bench", init_path=native.init_binary_path(),
            cgroup_procs=[], tmp_size_bytes=64 << 20, shm_size_bytes=16 << 20,
            userns_fd=layers.userns_fd, userns_uid=idmap.uid if idmap else 0,
            userns_gid=idmap.gid if idmap else 0)
        pid = native.spawn_container(spec)
    elapsed = (time.perf_counter_ns() - t0) / 1e3
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    shutil.rmtree(top)
    return elapsed


def measure_spawn(rootfs: str, n: int) -> dict:
    log(f"native spawn: {n} per mode, alternating (+{WARMUP} warm-up)")
    idmap = userns.IdMap(0, 2**32 - 2 - 65536, 2**32 - 2 - 65536, 65536)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    tmp = Path(tempfile.mkdtemp(prefix="dsecd-bench-userns-"))
    try:
        for i in range(-WARMUP, n):
            for m in (MODES if i % 2 == 0 else MODES[::-1]):
                us = spawn_once(rootfs, tmp / f"{m}-{i}", idmap if m == "userns" else None)
                if i >= 0:
                    times[m].append(us)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {f"spawn_us_p50_{m}": p(times[m], 50) for m in MODES}
    out["spawn_paired_delta_us_p50"] = round(statistics.median(
        a - b for a, b in zip(times["userns"], times["hostroot"], strict=True)), 1)
    log(f"  {out}")
    return out


async def one_cycle(c) -> tuple[float, float]:
    """(create ms, create+exec+destroy ms)."""
    t0 = time.perf_counter_ns()
    sb = await asyncio.wait_for(c.create(**CREATE_ARGS), OP_TIMEOUT_S)
    t1 = time.perf_counter_ns()
    try:
        r = await asyncio.wait_for(sb.exec(["true"], timeout=10), OP_TIMEOUT_S)
        if r.exit_code != 0:
            raise RuntimeError(f"exec true: exit {r.exit_code}, stderr {r.stderr!r}")
    finally:
        await asyncio.wait_for(sb.destroy(), OP_TIMEOUT_S)
    return (t1 - t0) / 1e6, (time.perf_counter_ns() - t0) / 1e6


async def measure_daemons(socks: dict[str, str], n: int, n_rtt: int) -> dict:
    log(f"create/exec/destroy: {n} cycles per mode, alternating (+{WARMUP} warm-up)")
    create = {m: [] for m in MODES}
    cycle = {m: [] for m in MODES}
    rtt = {m: [] for m in MODES}
    clients = {m: await dsecd.Client(s).__aenter__() for m, s in socks.items()}
    try:
        for i in range(-WARMUP, n):
            for m in (MODES if i % 2 == 0 else MODES[::-1]):
                c_ms, all_ms = await one_cycle(clients[m])
                if i >= 0:
                    create[m].append(c_ms)
                    cycle[m].append(all_ms)
        log(f"exec round trip: {n_rtt} per mode, alternating")
        sbs = {m: await clients[m].create(**CREATE_ARGS) for m in MODES}
        try:
            for i in range(-WARMUP, n_rtt):
                for m in MODES:
                    t0 = time.perf_counter_ns()
                    await sbs[m].exec(["true"], timeout=10)
                    if i >= 0:
                        rtt[m].append((time.perf_counter_ns() - t0) / 1e6)
        finally:
            for sb in sbs.values():
                await sb.destroy()
    finally:
        for c in clients.values():
            await c.__aexit__(None, None, None)
    out: dict = {"cycles": n}
    for m in MODES:
        out[f"create_p50_ms_{m}"] = p(create[m], 50)
        out[f"create_p99_ms_{m}"] = p(create[m], 99)
        out[f"create_exec_destroy_p50_ms_{m}"] = p(cycle[m], 50)
        out[f"exec_rtt_p50_ms_{m}"] = p(rtt[m], 50)
    for key in ("create_p50_ms", "create_exec_destroy_p50_ms", "exec_rtt_p50_ms"):
        out[key.replace("_ms", "_delta_ms")] = round(out[f"{key}_userns"] - out[f"{key}_hostroot"], 3)
    for name, series in (("create", create), ("create_exec_destroy", cycle), ("exec_rtt", rtt)):
        out[f"{name}_paired_delta_p50_ms"] = round(statistics.median(
            a - b for a, b in zip(series["userns"], series["hostroot"], strict=True)), 3)
    log(f"  {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="create cycles per mode")
    ap.add_argument("--n-rtt", type=int, default=200, help="execs per mode")
    ap.add_argument("--n-native", type=int, default=500, help="native userns_create / idmap runs")
    ap.add_argument("--rootfs", help="rootfs dir to import (default: scripts/mkrootfs.sh)")
    ap.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.n_rtt, args.n_native = 20, 20, 50
    if os.geteuid() != 0:
        log("must run as root")
        return 1
    results = measure_native(args.n_native)
    rootfs = args.rootfs or harness.build_rootfs()
    results.update(measure_spawn(rootfs, args.n))
    with harness.private_daemon(rootfs, IMAGE, None, _config(True), tag="-userns") as on, \
         harness.private_daemon(rootfs, IMAGE, None, _config(False), tag="-hostroot") as off:
        results.update(uvloop.run(measure_daemons({"userns": on.sock, "hostroot": off.sock},
                                                  args.n, args.n_rtt)))
    print(json.dumps(results), flush=True)
    return 0


def _config(userns: bool) -> str:
    # Lands in the [sandbox] table the harness opens; admission goes after it.
    return f"userns = {'true' if userns else 'false'}\n{NO_ADMISSION}"


if __name__ == "__main__":
    harness.run(main)
