"""`make bench-policy`: what a task policy costs (docs/hardening.md, "Task policies").

Through the daemon (a private one, the busybox image), exec `true` in a
sandbox without a policy and in one whose default is `agent`, alternating
one by one so that the noise of a shared host falls on both alike:

* exec_plain_p50_ms, exec_agent_p50_ms: the SDK's exec round trip;
* exec_policy_overhead_p50_ms: the median of the per-pair differences
  (agent minus the plain exec next to it); target <= 0.3 ms. Two daemons
  run at once, the denial monitor on in one (the default) and off in the
  other (exec_policy_overhead_no_monitor_p50_ms: Landlock alone), their
  pairs alternating; the monitor's host-wide sys_exit cost is below.

In child processes of this one (bench/policy_loop.c, no daemon):

* open_ns_plain / open_ns_agent: open+close of a file, unconfined and after
  restricting itself with the compiled agent policy as an exec's child does
  (Landlock checks each open against the rules of every directory above the
  file), for a shallow (/etc/passwd) and a deep path (landlock_open_*_deep);
  landlock_open_overhead_ns: the median per-pair difference (shallow);
* landlock_apply_agent_us: building and applying the agent plan in a fresh
  process (listing the host's / instead of a sandbox's): what an exec pays
  when dsec-init keeps no ruleset for its plan (the first exec under it, or
  the first after its paths changed) and every exec the helper starts;
* getppid_ns_detached / getppid_ns_attached: a syscall that does nothing,
  with the denial monitor's sys_exit program detached and attached: what
  every syscall of the host pays while some sandbox is watched.

Arms alternate in every series; figures are medians. Progress on stderr;
the last line of stdout is one JSON object. Run as root:
`.venv/bin/python bench/policy.py [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import harness

import dsecd
from dsecd import policy as P
from dsecd.config import load_config
from dsecd.denials import Monitor

log = harness.log
IMAGE = "busybox"
NO_ADMISSION = "[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n"
# Bench daemons' cgroups live under the prefix this host reserves for tests.
CGROUP_PREFIX = "dsecd-test-bench"
DEEP_PATH = "/usr/lib/x86_64-linux-gnu/libc.so.6"


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


class Arm:
    """A plain sandbox and an `agent` one on one daemon, and their exec times (ms)."""

    def __init__(self, name: str, sock: str):
        self.name = name
        self.client = dsecd.SyncClient(sock)
        self.client.connect()
        self.plain = self.client.create(image=IMAGE, memory="128M")
        self.agent = self.client.create(image=IMAGE, memory="128M", policy="agent")
        for sb in (self.plain, self.agent, self.plain, self.agent):   # warm: first exec, the monitor's load
            assert sb.exec(["true"]).exit_code == 0
        self.times: dict[str, list[float]] = {"plain": [], "agent": []}

    def pair(self, agent_first: bool) -> None:
        for kind in (("agent", "plain") if agent_first else ("plain", "agent")):
            sb = self.agent if kind == "agent" else self.plain
            t0 = time.perf_counter()
            r = sb.exec(["true"])
            self.times[kind].append((time.perf_counter() - t0) * 1e3)
            assert r.exit_code == 0, r

    def figures(self) -> dict:
        t = self.times
        return {"plain": median(t["plain"]), "agent": median(t["agent"]),
                "delta": median([a - b for a, b in zip(t["agent"], t["plain"], strict=True)]),
                "monitor": self.client.info()["policy"]["denials"]["monitor"]}

    def close(self) -> None:
        for sb in (self.plain, self.agent):
            sb.destroy(force=True)
        self.client.close()


def through_daemons(rootfs: str, n: int) -> dict:
    """Two daemons at once, the denial monitor on in one and off in the other;
    pairs alternate between them and within each pair. The monitor's sys_exit
    program, attached for the first daemon's agent sandbox, runs for the
    second's execs too (it is host-wide): each daemon's delta is its own
    per-exec cost, the program's host-wide cost is sys_exit_monitor_overhead_ns."""
    # extra_config follows the [sandbox] table the harness writes: its first lines belong to it.
    with harness.private_daemon(rootfs, IMAGE, extra_config=NO_ADMISSION, tag="-on",
                                cgroup_prefix=CGROUP_PREFIX) as on_d, \
            harness.private_daemon(rootfs, IMAGE, extra_config="policy_denials = false\n" + NO_ADMISSION,
                                   tag="-off", cgroup_prefix=CGROUP_PREFIX) as off_d:
        arms = [Arm("on", on_d.sock), Arm("off", off_d.sock)]
        try:
            log(f"exec round trips: {n} pairs on each daemon, alternating")
            for i in range(n):
                for arm in (arms if i % 2 == 0 else arms[::-1]):
                    arm.pair(agent_first=(i // 2) % 2 == 1)
            out = {arm.name: arm.figures() for arm in arms}
        finally:
            for arm in arms:
                arm.close()
    for name, f in out.items():
        log(f"  monitor {name}: plain p50 {f['plain']} ms, agent p50 {f['agent']} ms, "
            f"paired delta p50 {f['delta']} ms ({f['monitor']})")
    return out


def build_loop(tmp: Path) -> Path:
    exe = tmp / "policy_loop"
    src = Path(__file__).with_name("policy_loop.c")
    subprocess.run(["cc", "-O2", "-Wall", "-I", str(harness.REPO / "csrc"), "-o", str(exe), str(src)], check=True)
    return exe


def loop_ns(exe: Path, *args: str) -> float:
    out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def micro(tmp: Path, rounds: int, iters: int) -> dict:
    exe = build_loop(tmp)
    plan = tmp / "agent.plan"
    plan.write_bytes(P.named(load_config().raw["policy"])["agent"].compile())
    out: dict = {}
    for name, path in (("shallow", "/etc/passwd"), ("deep", DEEP_PATH)):
        if not os.path.exists(path):
            continue
        plain, agent = [], []
        for i in range(rounds):
            arms = (("plain", plain), ("agent", agent)) if i % 2 == 0 else (("agent", agent), ("plain", plain))
            for arm, xs in arms:
                xs.append(loop_ns(exe, "open", str(iters), path, *((str(plan),) if arm == "agent" else ())))
        out[name] = (plain, agent)
        log(f"open({path}): plain {median(plain)} ns, agent {median(agent)} ns")

    applied = [loop_ns(exe, "apply", "200", str(plan)) for _ in range(rounds)]
    log(f"building and applying the agent plan in a fresh process: {median(applied)} ns (host's /)")
    cache = tmp / "bpf"
    mon = Monitor(cache, 16)
    log("loading the denial monitor (compiles once: a few seconds)")
    mon.load()
    detached, attached = [], []
    fake_cgroup = 1 << 62            # no process is in it: the program runs, reports nothing
    try:
        for i in range(rounds):
            for arm in (("detached", "attached") if i % 2 == 0 else ("attached", "detached")):
                if arm == "attached":
                    mon.watch(fake_cgroup)
                    attached.append(loop_ns(exe, "getppid", str(iters * 10)))
                    mon.unwatch(fake_cgroup)
                else:
                    detached.append(loop_ns(exe, "getppid", str(iters * 10)))
    finally:
        mon.close()
    log(f"getppid: monitor detached {median(detached)} ns, attached {median(attached)} ns")
    plain, agent = out["shallow"]
    res = {"open_ns_plain": median(plain), "open_ns_agent": median(agent),
           "landlock_open_overhead_ns": median([a - b for a, b in zip(agent, plain, strict=True)]),
           "getppid_ns_detached": median(detached), "getppid_ns_attached": median(attached),
           "sys_exit_monitor_overhead_ns": median([a - b for a, b in zip(attached, detached, strict=True)]),
           "landlock_apply_agent_us": round(median(applied) / 1e3, 1)}
    if "deep" in out:
        res["landlock_open_plain_deep_ns"], res["landlock_open_agent_deep_ns"] = map(median, out["deep"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer pairs and rounds (a smoke run)")
    a = ap.parse_args()
    pairs, rounds, iters = (40, 5, 20000) if a.quick else (300, 15, 100000)
    rootfs = harness.build_rootfs()
    with tempfile.TemporaryDirectory(prefix="dsecd-bench-policy-") as tmpdir:
        micro_res = micro(Path(tmpdir), rounds, iters)
    d = through_daemons(rootfs, pairs)
    on, off = d["on"], d["off"]
    res = {"exec_plain_p50_ms": on["plain"], "exec_agent_p50_ms": on["agent"],
           "exec_policy_overhead_p50_ms": on["delta"], "exec_policy_overhead_no_monitor_p50_ms": off["delta"],
           "exec_plain_no_monitor_p50_ms": off["plain"], "exec_agent_no_monitor_p50_ms": off["agent"],
           "monitor": on["monitor"], "pairs": pairs, **micro_res, "loadavg": os.getloadavg()[0]}
    print(json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    harness.run(main)
