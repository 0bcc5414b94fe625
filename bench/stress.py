"""`make stress`: many clients mixing every sandbox op against one daemon,
with a kill -9 of the daemon in the middle.

Each client loops until the deadline over a random mix of: create (with an
idempotency key, a few sandboxes per client), exec, file write + read back,
pause + resume, a FnCall (plain argv), and destroy. It checks:

* only documented errors: `busy`, `conflict` and `limit` are accepted where a
  real client would retry; anything else (an `internal` or `io` error, a
  wrong answer, a lost connection outside the kill) is a failure;
* the journal after the kill -9: the daemon restarted on the same state dir
  must re-adopt every sandbox a client had been told exists (each answers an
  exec), and a create that was in flight at the kill, retried with its key,
  must give exactly one sandbox;
* no leaks at the end, all sandboxes destroyed: no sandbox, journal record,
  sandbox dir or sandbox cgroup left, no mount under the state dir but the
  daemon's own, and the daemon's fd count back near its start.

`run_stress` is shared with tests/integration/test_stress_short.py (a few
seconds of the same). Run: `.venv/bin/python bench/stress.py [--clients 64
--seconds 120]`; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import dsecd
from dsecd.errors import DsecError
from dsecd.journal import read_records

RETRYABLE = {"busy", "conflict", "limit"}
SHAPE = {"cpu": 0.1, "memory": "48M"}


class Tally:
    def __init__(self):
        self.ops: Counter = Counter()
        self.retryable: Counter = Counter()
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)


class StressClient:
    """One client: its own connection, its own sandboxes, its own keys."""

    def __init__(self, n: int, sock: str, image: str, tally: Tally, rng: random.Random, per_client: int):
        self.n, self.sock, self.image, self.tally, self.rng = n, sock, image, tally, rng
        self.per_client = per_client
        self.c: dsecd.Client | None = None
        self.mine: dict[str, dsecd.Sandbox] = {}     # the daemon said these exist
        self.pending_key: str | None = None          # a create sent, answer not seen
        self.pending_destroy: str | None = None      # a destroy sent, answer not seen
        self.seq = 0

    async def connect(self) -> None:
        self.c = dsecd.Client(self.sock, name=f"stress-{self.n}")
        await self.c.connect()

    async def close(self) -> None:
        if self.c:
            await self.c.close()

    async def step(self) -> None:
        ops = ["exec", "file", "pause", "call", "destroy", "create"]
        weights = [5, 3, 1, 1, 1, 4 if len(self.mine) < self.per_client else 0]
        op = self.rng.choices(ops, weights)[0]
        if op != "create" and op != "call" and not self.mine:
            op = "create"
        self.tally.ops[op] += 1
        try:
            await getattr(self, f"op_{op}")()
        except DsecError as err:
            if err.code in RETRYABLE:
                self.tally.retryable[err.code] += 1
            else:
                self.tally.fail(f"client {self.n} {op}: {err.code}: {err.message}")

    async def op_create(self) -> None:
        self.seq += 1
        key = self.pending_key or f"stress-{self.n}-{self.seq}"
        self.pending_key = key
        sb = await self.c.create(self.image, key=key, labels={"job": f"stress{self.n % 4}"}, **SHAPE)
        self.pending_key = None
        if sb.id in self.mine and not sb.info.get("existing"):
            self.tally.fail(f"client {self.n}: create returned a sandbox it already had")
        self.mine[sb.id] = sb

    def _pick(self) -> dsecd.Sandbox:
        return self.mine[self.rng.choice(sorted(self.mine))]

    async def op_exec(self) -> None:
        sb = self._pick()
        word = f"w{self.rng.randrange(10**6)}"
        r = await sb.exec(["sh", "-c", f"echo {word}"], timeout=30)
        if r.stdout != f"{word}\n".encode():
            self.tally.fail(f"client {self.n} exec in {sb.id}: {r}")

    async def op_file(self) -> None:
        sb = self._pick()
        data = os.urandom(self.rng.randrange(1, 64 << 10))
        path = f"/tmp/f{self.rng.randrange(8)}"
        await sb.write_file(path, data)
        if await sb.read_file(path) != data:
            self.tally.fail(f"client {self.n} file {sb.id}:{path}: read back differs")

    async def op_pause(self) -> None:
        sb = self._pick()
        await sb.pause()
        r = await sb.exec(["true"], timeout=30)      # auto-resume
        if r.exit_code != 0:
            self.tally.fail(f"client {self.n} exec after pause in {sb.id}: {r}")

    async def op_call(self) -> None:
        r = await self.c.call(self.image, argv=["sh", "-c", "echo $((6 * 7))"], timeout=30)
        if r.stdout != b"42\n":
            self.tally.fail(f"client {self.n} call: {r}")

    async def op_destroy(self) -> None:
        sb = self._pick()
        self.pending_destroy = sb.id
        await sb.destroy(force=True)
        del self.mine[sb.id]
        self.pending_destroy = None

    async def run_until(self, deadline: float, stop: asyncio.Event) -> None:
        while time.monotonic() < deadline and not stop.is_set():
            await self.step()


async def _phase(clients: list[StressClient], seconds: float, tally: Tally) -> None:
    stop = asyncio.Event()
    deadline = time.monotonic() + seconds
    results = await asyncio.gather(*(c.run_until(deadline, stop) for c in clients), return_exceptions=True)
    for c, r in zip(clients, results, strict=True):
        if isinstance(r, BaseException):
            tally.fail(f"client {c.n}: {type(r).__name__}: {r}")


async def _interrupted_phase(clients: list[StressClient], seconds: float, kill: Callable[[], None]) -> None:
    """Run the mix, kill -9 the daemon under it; errors here are the kill's."""
    stop = asyncio.Event()
    deadline = time.monotonic() + seconds + 60
    tasks = [asyncio.ensure_future(c.run_until(deadline, stop)) for c in clients]
    await asyncio.sleep(seconds)
    # In a thread: the restart waits for the socket (and may use a sync client).
    await asyncio.get_running_loop().run_in_executor(None, kill)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _check_after_restart(clients: list[StressClient], tally: Tally) -> dict:
    """Every sandbox a client was told about is back and answers; a create
    that was in flight, retried with its key, gives one sandbox."""
    for c in clients:
        await c.close()
        deadline = time.monotonic() + 60
        while True:           # the restarted daemon may still be re-adopting: retry, as clients do
            try:
                await c.connect()
                break
            except ConnectionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        for sb_id in list(c.mine):
            sb = dsecd.Sandbox(c.c, sb_id, {})
            try:
                r = await sb.exec(["true"], timeout=30)
                if r.exit_code != 0:
                    tally.fail(f"re-adopted {sb_id}: exec {r}")
                c.mine[sb_id] = sb
            except DsecError as err:
                # A destroy in flight at the kill may have killed the init
                # (dead) or finished (not_found): either is that destroy's doing.
                if sb_id != c.pending_destroy or err.code not in ("not_found", "conflict"):
                    tally.fail(f"sandbox {sb_id} lost across kill -9: {err}")
                elif err.code == "conflict":
                    await sb.destroy(force=True)
                del c.mine[sb_id]
        c.pending_destroy = None
        if c.pending_key:
            await c.op_create()
    async with dsecd.Client(clients[0].sock) as admin:
        live = {s["id"] for s in await admin.list() if s["state"] != "dead" and "dsec.pool" not in s["labels"]}
    known = set().union(*(c.mine for c in clients))
    orphans = live - known        # made by a create whose answer was lost and never retried
    if orphans:
        tally.fail(f"{len(orphans)} sandboxes after the restart that no client owns: {sorted(orphans)[:5]}")
    return {"readopted": len(known), "orphans": len(orphans)}


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _check_no_leaks(sock: str, state_dir: Path, cgroup_dirs: list[Path], pid: int, fds0: int,
                          tally: Tally) -> dict:
    async with dsecd.Client(sock) as c:
        await c.destroy_all(force=True)
        left = await c.list()
    deadline = time.monotonic() + 10
    while True:
        dirs = [e for e in os.listdir(state_dir / "sandboxes") if not e.startswith(".")]
        journal = list(read_records(state_dir / "journal.log"))
        groups = [e.name for d in cgroup_dirs if d.is_dir() for e in os.scandir(d)
                  if e.is_dir() and not e.name.startswith(".")]
        with open("/proc/self/mountinfo") as f:
            mounts = [ln.split()[4] for ln in f if ln.split()[4].startswith(str(state_dir / "sandboxes"))]
        fds = _fd_count(pid)
        clean = not (left or dirs or journal or groups or mounts) and fds <= fds0 + 16
        if clean or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    if not clean:
        tally.fail(f"leaks: sandboxes {len(left)}, dirs {dirs[:5]}, journal {journal[:5]}, "
                   f"cgroups {groups[:5]}, mounts {mounts[:5]}, fds {fds0} -> {fds}")
    return {"fds_start": fds0, "fds_end": fds}


async def run_stress(sock: str, image: str, clients: int, seconds: float, state_dir: Path,
                     cgroup_dirs: list[Path], daemon_pid: Callable[[], int],
                     kill9_and_restart: Callable[[], None], per_client: int = 3, seed: int = 1) -> dict:
    """Half the time, a kill -9 and restart, the other half; then the checks."""
    tally = Tally()
    rng = random.Random(seed)
    fds0 = _fd_count(daemon_pid())
    cs = [StressClient(i, sock, image, tally, random.Random(rng.random()), per_client) for i in range(clients)]
    for c in cs:
        await c.connect()
    t0 = time.monotonic()
    await _interrupted_phase(cs, seconds / 2, kill9_and_restart)
    restart = await _check_after_restart(cs, tally)
    await _phase(cs, seconds / 2, tally)
    for c in cs:
        await c.close()
    leaks = await _check_no_leaks(sock, state_dir, cgroup_dirs, daemon_pid(), fds0, tally)
    return {"clients": clients, "seconds": round(time.monotonic() - t0, 1), "ops": sum(tally.ops.values()),
            "ops_by_kind": dict(tally.ops), "retryable_errors": dict(tally.retryable), **restart, **leaks,
            "failures": len(tally.failures), "failure_samples": tally.failures[:10]}


def main(argv: list[str] | None = None) -> int:
    import harness
    import uvloop

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=120)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        harness.log("must run as root")
        return 1
    config = "[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n"
    with harness.private_daemon(harness.build_rootfs(), "busybox", extra_config=config) as d:
        def kill9_and_restart() -> None:
            harness.log("kill -9 of the daemon")
            d.proc.kill()
            d.proc.wait()
            d.start()
            harness.log("daemon restarted")

        cgroup_dirs = [Path(m) / d.cgroup_root for m in harness.cgroup_mounts()]
        report = uvloop.run(run_stress(d.sock, "busybox", args.clients, args.seconds, Path(d.state),
                                       cgroup_dirs, lambda: d.proc.pid, kill9_and_restart))
    harness.log(f"{report['ops']} ops by {args.clients} clients; failures: {report['failure_samples']}")
    print(json.dumps(report), flush=True)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
