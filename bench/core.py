"""`make bench-core`: the core figures of dsecd on this host, against its peers.

It starts a private daemon (own socket, state dir and cgroup subtree in a temp
dir), imports the busybox rootfs as image "busybox", and measures through the
Python SDK:

* create_exec_p50_ms / _p99_ms: sequential create + exec `true` + destroy;
* creates_per_s: 16 concurrent clients creating and destroying a fixed
  number of sandboxes, over the wall time of the whole batch;
* exec_rtt_p50_ms / _p99_ms: exec `true` in one running sandbox;
* idle_host_mib_per_sandbox: host memory per idle sandbox, reclaimable
  kernel memory included (method at `host_used_bytes`), and
  idle_host_mib_per_sandbox_unreclaimable without it;

then, with the daemon stopped, the same unit of work in bubblewrap and crun
(bench/peers.py): bwrap_p50_ms, crun_p50_ms, and the ratios
create_exec_p50_ms / peer_p50_ms (bwrap_ratio, crun_ratio; > 1 = dsecd slower).

Progress goes to stderr; the last line of stdout is one JSON object with those
names. Whatever happens (failure, Ctrl-C, SIGTERM), the bench removes its
sandboxes (`dsec rm --all`), stops its daemon, unmounts what the daemon left
mounted in the temp dir, removes its cgroup subtree and the temp dir.

Run as root: `.venv/bin/python bench/core.py [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import peers
import uvloop

import dsecd

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / ".venv" / "bin"
IMAGE = "busybox"
CREATE_ARGS = {"image": IMAGE, "cpu": 0.5, "memory": "256M"}
OP_TIMEOUT_S = 120  # one create/exec/destroy; a hung daemon fails the bench instead of hanging it
DAEMON_START_TIMEOUT_S = 60
WARMUP = 5


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    return round(peers.percentile(values, q), 3)


async def op(aw):
    """Await one SDK call with the per-operation time limit."""
    return await asyncio.wait_for(aw, OP_TIMEOUT_S)


async def exec_true(sb) -> None:
    r = await op(sb.exec(["true"], timeout=10))
    if r.exit_code != 0 or r.timed_out:
        raise RuntimeError(f"exec true: exit {r.exit_code}, signal {r.signal}, stderr {r.stderr!r}")


async def destroy_all(sandboxes: list) -> None:
    """Destroy sandboxes popped from the list until it is empty (several of
    these may share one list). A failure is reported and the rest go on:
    `dsec rm --all` at the end catches what is left."""
    while sandboxes:
        sb = sandboxes.pop()
        try:
            await op(sb.destroy())
        except Exception as err:
            log(f"destroy failed: {err}")


async def open_clients(stack: contextlib.AsyncExitStack, sock: str, n: int) -> list:
    """n SDK connections (hello done), closed when `stack` closes."""
    return [await op(stack.enter_async_context(dsecd.Client(sock))) for _ in range(n)]


# -------------------------------------------------------------------- phases


async def measure_create_exec(sock: str, n: int) -> dict:
    """Sequential create + exec `true` + destroy, one client, timed per cycle."""
    log(f"create+exec+destroy: {n} sequential (+{WARMUP} warm-up)")
    latencies: list[float] = []
    async with dsecd.Client(sock) as c:
        for i in range(-WARMUP, n):
            t0 = time.perf_counter_ns()
            sb = await op(c.create(**CREATE_ARGS))
            try:
                await exec_true(sb)
            finally:
                await op(sb.destroy())
            if i >= 0:
                latencies.append((time.perf_counter_ns() - t0) / 1e6)
    out = {"create_exec_p50_ms": pct(latencies, 50), "create_exec_p99_ms": pct(latencies, 99)}
    log(f"  {out}")
    return out


async def measure_exec_rtt(sock: str, n: int) -> dict:
    """exec `true` n times in one running sandbox."""
    log(f"exec round trip: {n} in one sandbox (+{WARMUP * 2} warm-up)")
    latencies: list[float] = []
    async with dsecd.Client(sock) as c:
        sb = await op(c.create(**CREATE_ARGS))
        try:
            for i in range(-WARMUP * 2, n):
                t0 = time.perf_counter_ns()
                await exec_true(sb)
                if i >= 0:
                    latencies.append((time.perf_counter_ns() - t0) / 1e6)
        finally:
            await op(sb.destroy())
    out = {"exec_rtt_p50_ms": pct(latencies, 50), "exec_rtt_p99_ms": pct(latencies, 99)}
    log(f"  {out}")
    return out


async def measure_create_rate(sock: str, clients: int, total: int) -> dict:
    """`clients` connections, each creating and destroying sandboxes one after
    the other until `total` creates are done; the rate is total / wall time
    (connections are opened before the clock starts)."""
    log(f"create rate: {total} creates+destroys over {clients} concurrent clients")
    remaining = total

    async def worker(c) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1  # no await in between: the event loop makes this atomic
            sb = await op(c.create(**CREATE_ARGS))
            await op(sb.destroy())

    async with contextlib.AsyncExitStack() as stack:
        conns = await open_clients(stack, sock, clients)
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:  # a failing worker cancels the others
            for c in conns:
                tg.create_task(worker(c))
        elapsed = time.perf_counter() - t0
    out = {"creates_per_s": round(total / elapsed, 1)}
    log(f"  {out} ({elapsed:.2f} s)")
    return out


def host_used_bytes() -> tuple[int, int]:
    """(all, unreclaimable) host memory in use, bytes, from /proc/meminfo.

    all = MemTotal - MemFree - Buffers - (Cached - Shmem): everything but the
    file page cache, so reclaimable slab (dentries, inodes of the sandboxes'
    mounts) counts too - the conservative figure. unreclaimable = MemTotal -
    MemAvailable, what the kernel could not give back under pressure."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    every = (fields["MemTotal"] - fields["MemFree"] - fields["Buffers"]
             - (fields["Cached"] - fields["Shmem"]))
    return every, fields["MemTotal"] - fields["MemAvailable"]


async def sample_used(samples: int = 5, interval_s: float = 0.5) -> tuple[int, int]:
    values = []
    for _ in range(samples):
        values.append(host_used_bytes())
        await asyncio.sleep(interval_s)
    return (int(statistics.median(v[0] for v in values)),
            int(statistics.median(v[1] for v in values)))


async def measure_idle_memory(sock: str, clients: int, n: int) -> dict:
    """Host memory per idle sandbox.

    Method: host "used" memory = MemTotal - MemAvailable (/proc/meminfo), the
    median of 5 samples 0.5 s apart, before creating n idle sandboxes and
    again 2 s after the last create; (after - before) / n. Caches are not
    dropped (that would disturb the host): the delta is everything the host
    spends on the sandboxes that the kernel does not count as reclaimable —
    their processes, page tables, cgroups, mounts, namespaces and the
    daemon's own bookkeeping. Other activity on the host adds noise, which
    500 sandboxes amortize. If the daemon refuses more sandboxes (busy/limit),
    the figure is over the ones it created, said on stderr.
    """
    log(f"idle memory: {n} idle sandboxes over {clients} clients")
    before = await sample_used()
    created: list = []
    refused: list[BaseException] = []
    remaining = n

    async def worker(c) -> None:
        nonlocal remaining
        while remaining > 0 and not refused:
            remaining -= 1
            try:
                created.append(await op(c.create(**CREATE_ARGS)))
            except Exception as err:
                if getattr(err, "code", None) not in ("busy", "limit"):
                    raise
                refused.append(err)

    async with contextlib.AsyncExitStack() as stack:
        conns = await open_clients(stack, sock, clients)
        try:
            async with asyncio.TaskGroup() as tg:
                for c in conns:
                    tg.create_task(worker(c))
            if refused:
                log(f"  the daemon refused sandbox {len(created) + 1}: {refused[0]}")
            count = len(created)
            if count < min(n, 10):
                raise RuntimeError(f"only {count} idle sandboxes could be created")
            await asyncio.sleep(2)
            after = await sample_used()
            log(f"  destroying {count} sandboxes")
            async with asyncio.TaskGroup() as tg:
                for _ in range(clients):
                    tg.create_task(destroy_all(created))
        finally:
            await destroy_all(created)
    out = {"idle_host_mib_per_sandbox": round((after[0] - before[0]) / count / 2**20, 3),
           "idle_host_mib_per_sandbox_unreclaimable": round((after[1] - before[1]) / count / 2**20, 3)}
    log(f"  {out} (host used {before[0] / 2**20:.0f} -> {after[0] / 2**20:.0f} MiB)")
    return out


async def measure_dsecd(sock: str, args) -> dict:
    results = {}
    results.update(await measure_create_exec(sock, args.n_seq))
    results.update(await measure_exec_rtt(sock, args.n_rtt))
    results.update(await measure_create_rate(sock, args.clients, args.n_rate))
    results.update(await measure_idle_memory(sock, args.clients, args.n_idle))
    return results


def measure_peers(rootfs: str, n: int) -> dict:
    out = {}
    for name, fn in (("bwrap", peers.bench_bwrap), ("crun", peers.bench_crun)):
        log(f"peer {name}: {n} runs of /bin/true")
        lat = fn(rootfs, n)
        out[f"{name}_p50_ms"] = pct(lat, 50)
        log(f"  {name}: p50 {pct(lat, 50)} ms, p99 {pct(lat, 99)} ms")
    return out


# -------------------------------------------------------------------- daemon


class BenchDaemon:
    """A dsecd of the bench's own, in `tmp`: socket, state dir, config, and a
    cgroup subtree named after this process, so that neither its sandboxes nor
    its clean-up meet another daemon's on the same host."""

    def __init__(self, tmp: Path, config: str | None):
        self.tmp = tmp
        self.sock = str(tmp / "dsecd.sock")
        self.state = str(tmp / "state")
        self.log_path = tmp / "dsecd.log"
        self.cgroup_root = f"dsecd-bench-{os.getpid()}"
        self.config = config or self._write_config()
        self.proc: subprocess.Popen | None = None

    def _write_config(self) -> str:
        path = self.tmp / "bench.toml"
        path.write_text(f'[sandbox]\ncgroup_root = "{self.cgroup_root}"\n')
        return str(path)

    def start(self) -> None:
        argv = [str(BIN / "dsecd"), "--socket", self.sock, "--state-dir", self.state,
                "--config", self.config]  # fmt: skip
        log(f"starting {' '.join(argv)}")
        with open(self.log_path, "wb") as out:
            # Own session: a Ctrl-C at the terminal reaches the bench, which then
            # cleans up in order, not the daemon.
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while not self._socket_answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsecd exited {self.proc.returncode} before its socket was up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"dsecd socket not up after {DAEMON_START_TIMEOUT_S} s")
            time.sleep(0.05)

    def _socket_answers(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(self.sock)
                return True
            except OSError:
                return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no daemon log)"

    def cli(self, *args: str, timeout: float = 600) -> None:
        argv = [str(BIN / "dsec"), "--socket", self.sock, *args]
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
            start_new_session=True,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout}"
            )

    def import_image(self, rootfs: str) -> None:
        log(f"importing {rootfs} as image {IMAGE!r}")
        self.cli("image", "import", rootfs, "--name", IMAGE)

    def stop(self) -> None:
        """Remove all sandboxes, then SIGTERM (SIGKILL after 20 s). Each step
        runs even if the one before failed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                log("removing all sandboxes")
                self.cli("rm", "--all", "--force", timeout=300)
            except Exception as err:
                log(f"dsec rm --all --force failed: {err}")
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                log("dsecd ignored SIGTERM for 20 s: SIGKILL")
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode not in (0, -signal.SIGTERM):
            log(f"dsecd exited {self.proc.returncode}; last lines of its log:\n{self.log_tail()}")
        self._remove_cgroups()

    def _remove_cgroups(self) -> None:
        """Remove the bench's cgroup subtree in every hierarchy. Processes
        still in it are sandboxes of this bench's daemon that `rm --all`
        missed: they are killed (by pid, from our own subtree only) first."""
        for mnt in cgroup_mounts():
            top = Path(mnt) / self.cgroup_root
            if not top.is_dir():
                continue
            for dirpath, _dirs, _files in os.walk(top, topdown=False):
                leftover = read_pids(Path(dirpath) / "cgroup.procs")
                if leftover:
                    log(f"killing leftover sandbox processes in {dirpath}: {sorted(leftover)[:8]}")
                    for pid in leftover:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    time.sleep(0.2)
                try:
                    os.rmdir(dirpath)
                except OSError as err:
                    log(f"cannot remove cgroup {dirpath}: {err.strerror}")


def cgroup_mounts() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            fstype = parts[parts.index("-") + 1]
            if fstype in ("cgroup", "cgroup2"):
                out.append(unescape_mount_path(parts[4]))
    return out


def read_pids(path: Path) -> set[int]:
    try:
        return {int(x) for x in path.read_text().split()}
    except OSError:
        return set()


def unescape_mount_path(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(top: Path) -> list[str]:
    prefix = str(top).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        points = [unescape_mount_path(line.split()[4]) for line in f]
    return [p for p in points if p == str(top) or p.startswith(prefix)]


def remove_tmp(tmp: Path) -> None:
    """Unmount what the daemon left mounted below tmp (deepest first, lazily),
    then delete tmp. rmtree never runs while a mount remains: it would walk
    into the mounted filesystem."""
    for point in sorted(mounts_under(tmp), key=len, reverse=True):
        log(f"unmounting leftover {point}")
        subprocess.run(["umount", "-l", point], stdin=subprocess.DEVNULL, check=False)
    left = mounts_under(tmp)
    if left:
        log(f"NOT removing {tmp}: still mounted: {left}")
        return
    shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------- main


def build_rootfs() -> str:
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "mkrootfs.sh")],
        check=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-seq", type=int, default=200, help="sequential create+exec+destroy")
    p.add_argument("--n-rtt", type=int, default=300, help="execs in one sandbox")
    p.add_argument("--n-rate", type=int, default=400, help="creates in the concurrent batch")
    p.add_argument("--n-idle", type=int, default=500, help="idle sandboxes for the memory figure")
    p.add_argument("--n-peers", type=int, default=200, help="runs per peer")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--rootfs", help="rootfs to import (default: scripts/mkrootfs.sh's cache)")
    p.add_argument("--daemon-config", help="dsecd --config file (default: a private cgroup_root)")
    p.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.n_seq, args.n_rtt, args.n_rate, args.n_idle, args.n_peers = 20, 30, 64, 50, 20
    return args


def interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        log("must run as root")
        return 1
    signal.signal(signal.SIGTERM, interrupt)  # same clean-up path as Ctrl-C
    rootfs = args.rootfs or build_rootfs()
    tmp = Path(tempfile.mkdtemp(prefix="dsecd-bench-"))
    daemon = BenchDaemon(tmp, args.daemon_config)
    try:
        daemon.start()
        daemon.import_image(rootfs)
        results = uvloop.run(measure_dsecd(daemon.sock, args))
    except Exception as err:
        log(f"FAILED: {err!r}")
        if daemon.proc is not None and daemon.proc.poll() is None:
            log(f"last lines of the daemon's log:\n{daemon.log_tail()}")
        raise
    finally:
        # Clean-up must finish: later signals are ignored until it has.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            daemon.stop()
        finally:
            remove_tmp(tmp)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, interrupt)

    # The daemon is gone: the peers run on the same quiet host.
    results.update(measure_peers(rootfs, args.n_peers))
    results["bwrap_ratio"] = round(results["create_exec_p50_ms"] / results["bwrap_p50_ms"], 2)
    results["crun_ratio"] = round(results["create_exec_p50_ms"] / results["crun_p50_ms"], 2)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted (cleaned up)")
        sys.exit(130)
