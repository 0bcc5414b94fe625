"""Network benchmarks at the library level (dsecd.net.Network, no daemon).

Everything runs in test-owned namespaces (tests/integration/test_net_kit.py):
a bridge netns, a server netns with a sink, and sandboxes that are agent
processes in their own netns and cgroup. Progress goes to stderr; the last
stdout line is one JSON object.

  tcp_throughput_ratio     bulk TCP sandbox -> sink, 1,000-rule allowlist / no programs attached
  connect_rate_ratio       connect+close per second, same two arms
  rule_update_p99_ms       Network.update (add or remove one rule) on a 10-rule policy, end to end
                           (merge, kernel maps, journal write); *_apply_* = the kernel-side step alone
  net_create_overhead_p50_ms  Network.attach(mode=default) - Network.attach(mode=none), netns and
                           cgroup made beforehand (the sandbox gets both with --net none too)

Arms alternate in ABBA order so drift hits both; ratios are medians of
per-pair ratios (BENCH_NET_ROUNDS pairs of BENCH_NET_SECS each). On a small
shared machine the per-pair spread is wide; the stderr log shows every pair.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from test_net_kit import World, bpf_skip_reason  # noqa: E402

SINK = r'''
import socket, sys, threading
def sink(s):
    while True:
        c, _ = s.accept()
        def drain(c):
            buf = bytearray(1 << 20)
            while c.recv_into(buf): pass
            c.close()
        threading.Thread(target=drain, args=(c,), daemon=True).start()
def closer(s):
    while True:
        c, _ = s.accept(); c.close()
host = sys.argv[1]
a = socket.socket(); a.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); a.bind((host, 5001)); a.listen(64)
b = socket.socket(); b.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); b.bind((host, 5002)); b.listen(4096)
threading.Thread(target=sink, args=(a,), daemon=True).start()
print("ready", flush=True)
closer(b)
'''

ROUNDS = int(os.environ.get("BENCH_NET_ROUNDS", "16"))
CPUS = len(os.sched_getaffinity(0))
SECS = float(os.environ.get("BENCH_NET_SECS", "0.75"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def thousand_rules(world: World) -> list[str]:
    """999 rules elsewhere (a deep trie of /24s and /16s) plus the sink's."""
    out = [f"172.{16 + i // 250}.{i % 250}.0/24:443/tcp" for i in range(900)]
    out += [f"100.{64 + i}.0.0/16:80-90/tcp" for i in range(99)]
    out.append(f"{world.pkg}:5001-5002/tcp")
    return out


def start_sink(world: World) -> subprocess.Popen:
    from pyroute2 import netns as pr_netns

    ns = f"/run/netns/{world.srv_ns}"
    def enter() -> None:
        pr_netns.setns(ns, flags=0)
        if CPUS > 1:
            os.sched_setaffinity(0, {1})        # sender on CPU 0, sink on CPU 1: less run-to-run noise

    p = subprocess.Popen([sys.executable, "-c", SINK, world.pkg], stdout=subprocess.PIPE, text=True,
                         preexec_fn=enter)
    assert p.stdout.readline().strip() == "ready"
    return p


def alternate(world: World, agent, cgroup: str, ask: dict, value) -> dict:
    """Rounds of (no programs, policy); returns per-arm values and the median pair ratio."""
    eng = world.net.engine
    base, pol, ratios = [], [], []
    for i in range(ROUNDS):
        # ABBA order: a linear drift in the machine's load cancels out of the pairs.
        if i % 2 == 0:
            eng.detach(cgroup)
            b = value(agent.ask(**ask))
            eng.attach(cgroup)
            p = value(agent.ask(**ask))
        else:
            p = value(agent.ask(**ask))
            eng.detach(cgroup)
            b = value(agent.ask(**ask))
            eng.attach(cgroup)
        base.append(b)
        pol.append(p)
        ratios.append(p / b)
        log(f"  round {i}: none {b:,.0f}  policy {p:,.0f}  ratio {p / b:.3f}")
    return {"none": statistics.median(base), "policy": statistics.median(pol),
            "ratio": statistics.median(ratios)}


def enable_bpf_stats():
    """bpf(BPF_ENABLE_STATS, BPF_STATS_RUN_TIME): run_time_ns/run_cnt per program in fdinfo
    while the returned fd stays open (closing it turns the accounting off again)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 4)(0, 0, 0, 0)        # union bpf_attr { enable_stats.type = 0 }
    fd = libc.syscall(321, 32, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "bpf(BPF_ENABLE_STATS)")
    return fd


def prog_stats(world: World) -> dict[str, tuple[int, int]]:
    out = {}
    for name, (fn, _at) in world.net.engine.fns.items():
        info = dict(line.split(":\t", 1) for line in open(f"/proc/self/fdinfo/{fn.fd}").read().splitlines()
                    if ":\t" in line)
        out[name] = (int(info.get("run_time_ns", 0)), int(info.get("run_cnt", 0)))
    return out


def bench_datapath(world: World) -> dict:
    sink = start_sink(world)
    a = world.agent("bench")
    try:
        rules = thousand_rules(world)
        world.net.attach(a.name, f"/run/netns/{a.netns}", a.cgroup, rules)
        assert len(world.net.show(a.name)["rules"]) == 1000
        cg = str(a.cgroup)
        if CPUS > 1:
            a.ask(op="pin", cpu=0)
        # warm up ARP and the path
        a.ask(op="connects", host=world.pkg, port=5002, secs=0.2)
        stats_fd = enable_bpf_stats()
        try:
            s0 = prog_stats(world)
            log("tcp throughput (bytes/s), 1000-rule allowlist vs none:")
            tp = alternate(world, a, cg, dict(op="bulk", host=world.pkg, port=5001, secs=SECS),
                           lambda r: r["bytes"] / r["secs"])
            s1 = prog_stats(world)
            log("connect rate (connects/s):")
            cr = alternate(world, a, cg, dict(op="connects", host=world.pkg, port=5002, secs=SECS),
                           lambda r: r["n"] / r["secs"])
            s2 = prog_stats(world)
        finally:
            os.close(stats_fd)

        def per_run(a_, b_, name):
            dt, dn = b_[name][0] - a_[name][0], b_[name][1] - a_[name][1]
            return (dt / dn if dn else 0.0), dn

        egress_ns, egress_n = per_run(s0, s1, "dsec_egress")
        connect_ns, connect_n = per_run(s1, s2, "dsec_connect4")
        log(f"  in-kernel cost with 1000 rules: egress {egress_ns:.0f} ns/packet ({egress_n:,} packets), "
            f"connect4 {connect_ns:.0f} ns/call ({connect_n:,} calls)")
        hits = world.net.show(a.name)["rules"][-1]["allowed"]
        log(f"  sink rule counted {hits:,} connects")
        world.net.detach(a.name)
        return {"tcp": tp, "connect": cr, "egress_ns": egress_ns, "connect_ns": connect_ns,
                "egress_packets": egress_n, "bulk_bytes_policy": tp["policy"] * SECS * ROUNDS}
    finally:
        sink.kill()
        sink.wait()


def bench_updates(world: World, base_rules: list[str], n: int) -> tuple[list[float], list[float]]:
    """(Network.update wall times, the part of each that changes the kernel's policy), ms.

    The second is the `_apply` step (compile, map writes, flip) timed by a wrapper;
    the rest of update() is the merge and the journal write of the new terms.
    """
    a = world.agent()
    world.net.attach(a.name, f"/run/netns/{a.netns}", a.cgroup, base_rules)
    extra = f"{world.ref}:8080/tcp"
    times, applies = [], []
    real_apply = world.net._apply

    def timed_apply(*args):
        t = time.perf_counter()
        try:
            return real_apply(*args)
        finally:
            applies.append((time.perf_counter() - t) * 1e3)

    world.net._apply = timed_apply
    try:
        for i in range(n):
            kw = {"add": [extra]} if i % 2 == 0 else {"remove": [extra]}
            t = time.perf_counter()
            world.net.update(a.name, **kw)
            times.append((time.perf_counter() - t) * 1e3)
    finally:
        del world.net._apply
        world.net.detach(a.name)
        a.stop()
    return times, applies


def bench_create(world: World, n: int) -> dict:
    from pyroute2 import netns as pr_netns

    rules = ["pypi", "dns"]
    t_def, t_none, t_detach = [], [], []
    for i in range(n):
        for mode in ("default", "none"):
            name = f"c{i}{mode[0]}{secrets.token_hex(2)}"
            ns = f"{world.prefix}-sb-{name}"
            pr_netns.create(ns)
            world.netns.append(ns)
            cg = world.cgroup / name
            cg.mkdir()
            try:
                t = time.perf_counter()
                world.net.attach(name, f"/run/netns/{ns}", cg, rules if mode == "default" else None, mode=mode)
                (t_def if mode == "default" else t_none).append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                world.net.detach(name)
                if mode == "default":
                    t_detach.append((time.perf_counter() - t) * 1e3)
            finally:
                cg.rmdir()
                pr_netns.remove(ns)
                world.netns.remove(ns)
    return {"default_p50": statistics.median(t_def), "default_p99": pct(t_def, 99),
            "none_p50": statistics.median(t_none), "detach_p50": statistics.median(t_detach)}


def main() -> int:
    # SIGTERM (e.g. from `timeout`) must still run the finally below that removes the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reason = bpf_skip_reason()
    if reason:
        print(json.dumps({"error": reason}))
        return 1
    t = time.perf_counter()
    world = World()
    compile_s = time.perf_counter() - t
    log(f"world up (BPF compile included) in {compile_s:.2f}s")
    try:
        dp = bench_datapath(world)
        log("rule updates ...")
        small, small_apply = bench_updates(world, ["pypi", "dns"] + [f"172.16.{i}.0/24:443/tcp" for i in range(6)],
                                           1000)
        big, big_apply = bench_updates(world, thousand_rules(world)[:-1], 300)
        log(f"  10 rules: p50 {statistics.median(small):.3f} ms p99 {pct(small, 99):.3f} ms "
            f"(kernel-side apply p99 {pct(small_apply, 99):.3f} ms); "
            f"1000 rules: p50 {statistics.median(big):.2f} ms p99 {pct(big, 99):.2f} ms")
        log("attach/detach ...")
        cr = bench_create(world, 60)
        log(f"  attach default p50 {cr['default_p50']:.2f} ms, none p50 {cr['none_p50']:.3f} ms, "
            f"detach p50 {cr['detach_p50']:.2f} ms")
    finally:
        world.close()
    out = {
        "tcp_throughput_ratio": round(dp["tcp"]["ratio"], 4),
        "tcp_throughput_gbit_none": round(dp["tcp"]["none"] * 8 / 1e9, 3),
        "tcp_throughput_gbit_policy": round(dp["tcp"]["policy"] * 8 / 1e9, 3),
        "egress_prog_ns_per_packet": round(dp["egress_ns"], 1),
        "connect4_prog_ns_per_call": round(dp["connect_ns"], 1),
        "egress_prog_ns_per_mb": round(dp["egress_ns"] * dp["egress_packets"] / (dp["bulk_bytes_policy"] / 1e6), 1),
        "connect_rate_ratio": round(dp["connect"]["ratio"], 4),
        "connects_per_s_none": round(dp["connect"]["none"]),
        "connects_per_s_policy": round(dp["connect"]["policy"]),
        "rule_update_p50_ms": round(statistics.median(small), 4),
        "rule_update_p99_ms": round(pct(small, 99), 4),
        "rule_update_apply_p99_ms": round(pct(small_apply, 99), 4),
        "rule_update_1000_rules_p50_ms": round(statistics.median(big), 3),
        "rule_update_1000_rules_p99_ms": round(pct(big, 99), 3),
        "rule_update_1000_rules_apply_p99_ms": round(pct(big_apply, 99), 3),
        "net_create_overhead_p50_ms": round(cr["default_p50"] - cr["none_p50"], 3),
        "net_attach_p99_ms": round(cr["default_p99"], 3),
        "net_detach_p50_ms": round(cr["detach_p50"], 3),
        "bpf_compile_and_setup_s": round(compile_s, 2),
        "rounds": ROUNDS, "round_secs": SECS, "cpus": CPUS,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
