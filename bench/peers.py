"""Latency of the peers on dsecd's smallest unit of work.

dsecd's figure is create + exec `true` + destroy of a container sandbox. The
same work for the peers is one run of `/bin/true` in fresh namespaces over a
read-only busybox rootfs:

* bubblewrap: `bwrap --unshare-all ... /bin/true`;
* crun: `crun run` of an OCI bundle over the same rootfs, namespaces
  pid/mount/ipc/uts/network, no cgroup (no `linux.resources`,
  `--cgroup-manager=disabled`).

Each run is timed from the benchmark's side, fork/exec of the peer included,
as the dsecd figure includes its RPC round trips.

crun 1.8 refuses a hybrid cgroup host ("cgroups in hybrid mode not
supported") even with the cgroup manager disabled, so it runs in a private
mount namespace where /sys/fs/cgroup/unified is unmounted. That wrapper
(`unshare -m`) is paid once: the N runs are timed one by one by a Python
process started inside it, so its cost stays out of the figures.

Run as root: `python bench/peers.py [--rootfs DIR] [-n N]` prints p50/p99 as
JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HYBRID_V2_MOUNT = "/sys/fs/cgroup/unified"
WARMUP_RUNS = 5


def default_rootfs() -> str:
    """Path of the cached busybox rootfs, built on first use."""
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "mkrootfs.sh")],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): an observed value, no interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def pct(values: list[float], q: float) -> float:
    """percentile(), rounded to 3 decimals as the benches report it."""
    return round(percentile(values, q), 3)


def summarize(latencies_ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": pct(latencies_ms, 50),
        "p99_ms": pct(latencies_ms, 99),
        "n": len(latencies_ms),
    }


def time_runs(argv_for_run, n: int, warmup: int = WARMUP_RUNS) -> list[float]:
    """Run `argv_for_run(i)` n times (after `warmup` untimed runs), one at a
    time; return each run's wall time in ms. A failing run raises."""
    latencies = []
    for i in range(-warmup, n):
        argv = argv_for_run(i)
        t0 = time.perf_counter_ns()
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        elapsed_ms = (time.perf_counter_ns() - t0) / 1e6
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip()
            raise RuntimeError(f"{argv[0]} exited {proc.returncode}: {err}")
        if i >= 0:
            latencies.append(elapsed_ms)
    return latencies


# ---------------------------------------------------------------- bubblewrap


def bwrap_argv(rootfs: str) -> list[str]:
    return [
        "bwrap", "--unshare-all", "--die-with-parent",
        "--ro-bind", rootfs, "/",
        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
        "/bin/true",
    ]  # fmt: skip


def bench_bwrap(rootfs: str, n: int) -> list[float]:
    """Per-run latencies (ms) of n bubblewrap runs of /bin/true."""
    argv = bwrap_argv(rootfs)
    return time_runs(lambda _i: argv, n)


# ---------------------------------------------------------------------- crun


def crun_config(rootfs: str) -> dict:
    """Minimal OCI config: the namespaces dsecd gives a container (but cgroup),
    /proc, a tmpfs /dev (crun fills in the default devices) and /tmp, no
    capabilities, no resources."""
    tmpfs_opts = ["nosuid", "nodev", "mode=1777"]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/true"],
            "env": ["PATH=/bin"],
            "cwd": "/",
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs, "readonly": True},
        "hostname": "peer",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": tmpfs_opts},
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "mount", "ipc", "uts", "network")],
        },
    }  # fmt: skip


def crun_argv(state_dir: str, bundle: str, container_id: str) -> list[str]:
    return [
        "crun", "--root", state_dir, "--cgroup-manager=disabled",
        "run", "--bundle", bundle, container_id,
    ]  # fmt: skip


def _crun_inner(state_dir: str, bundle: str, n: int) -> None:
    """Body of the process that runs inside the private mount namespace: time
    n crun runs, print the latencies as JSON on stdout."""
    prefix = f"peer-{os.getpid()}"
    latencies = time_runs(lambda i: crun_argv(state_dir, bundle, f"{prefix}-{i + WARMUP_RUNS}"), n)
    json.dump(latencies, sys.stdout)


def bench_crun(rootfs: str, n: int) -> list[float]:
    """Per-run latencies (ms) of n `crun run`s of /bin/true, each with a new
    container id; crun's state dir and the bundle live in a temp dir that is
    removed afterwards."""
    tmp = tempfile.mkdtemp(prefix="dsecd-peer-crun-")
    try:
        bundle = os.path.join(tmp, "bundle")
        state = os.path.join(tmp, "state")
        os.mkdir(bundle)
        os.mkdir(state, 0o700)
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump(crun_config(rootfs), f)
        # The umount happens only in the new (private) mount namespace.
        script = (
            f"if mountpoint -q {HYBRID_V2_MOUNT}; then umount {HYBRID_V2_MOUNT} || exit 1; fi; "
            'exec "$@"'
        )
        inner = [sys.executable, os.path.abspath(__file__), "--crun-inner", state, bundle, str(n)]
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *inner],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"crun benchmark failed ({proc.returncode}): {proc.stderr.strip()}")
        return json.loads(proc.stdout)
    finally:
        # `crun run` deletes each container when it exits; a run that failed
        # half-way may leave state, which goes with the temp dir.
        shutil.rmtree(tmp, ignore_errors=True)


PEERS = {"bwrap": bench_bwrap, "crun": bench_crun}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rootfs", help="rootfs dir (default: scripts/mkrootfs.sh's cache)")
    parser.add_argument("-n", type=int, default=200, help="timed runs per peer (default 200)")
    parser.add_argument("--peer", choices=sorted(PEERS), action="append", help="default: all")
    parser.add_argument("--crun-inner", nargs=3, metavar=("STATE", "BUNDLE", "N"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    if args.crun_inner:
        state, bundle, n = args.crun_inner
        _crun_inner(state, bundle, int(n))
        return 0

    rootfs = args.rootfs or default_rootfs()
    result = {}
    for name in args.peer or sorted(PEERS):
        print(f"peers: {name}: {args.n} runs", file=sys.stderr)
        for key, value in summarize(PEERS[name](rootfs, args.n)).items():
            result[f"{name}_{key}"] = value
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
