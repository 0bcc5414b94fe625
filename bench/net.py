"""`make bench-net`: networking figures through a private daemon.

The bench owns every namespace the traffic crosses (tests/integration/test_net_kit.py
World, network=False): a netns holding the bridge (the daemon's net.host_netns),
a netns of servers on that bridge (a sink), and the daemon's sandboxes. Nothing
is sent to an address outside them. Progress goes to stderr; the last stdout
line is one JSON object:

  net_create_overhead_p50_ms   p50 of `create --net default` - p50 of `create --net none`
                               (SDK round trips, alternated, --create-gap apart), netns pool on;
  net_create_overhead_nopool_p50_ms  the same with net.pool_size = 0 (a second daemon);
  netns_pool_create_p50_ms     what building one pool entry costs the daemon (in the
                               background: netns + veth into the bridge + address + routes);
  rule_update_p50/_p99_ms      `net_set` add or remove of one rule on a 10-rule policy,
                               SDK round trip; rpc_floor_* = an `inspect` round trip;
                               rule_update_daemon_* = the same updates timed inside the
                               daemon (Network.update: merge, maps, record; `dsec info`);
  rule_update_1000_rules_p99_ms the same on a 1,000-rule policy;
  first_net_create_cold_ms     the first `create --net default` right after a daemon start
                               whose BPF object cache is empty (the programs compile in a
                               helper process, started in the background at daemon start);
  first_net_create_warm_ms     the same after a second start on the same cache (no compile);
  first_net_create_ms          = the warm figure (what every restart but the first sees);
  daemon_rss_mib               the daemon's resident memory after its programs are loaded
                               (after the first --net default create of the pooled daemon);
  tcp_throughput_ratio         bulk TCP sandbox -> sink, 1,000-rule allowlist / no policy;
  connect_rate_ratio           connect+close per second, same two arms;
  nat_throughput_ratio         bulk TCP sandbox -> a sink in a bench "internet" netns through
                               net.uplink's masquerade / the same sender in the bridge netns
                               straight over the uplink veth (target >= 0.95);
  published_port_throughput_ratio  bulk TCP from the bridge netns to a sink in the sandbox:
                               through its published port (DNAT) / to its address (target >= 0.9);
  *_cpu_ratio                  the same per CPU-second of the sending process (user +
                               system: the eBPF programs run in its syscalls), which a
                               descheduled sender does not skew: a check on the wall ratios;
  dns_p50_ms / dns_direct_p50_ms  an A query from a sandbox through the daemon's resolver /
                               straight to the same upstream (dnsmasq in the servers netns,
                               allowed by a rule), alternated; dns_ratio = the first / second;
  fqdn_first_connect_p50_ms    query for pypi.org (a name rule) to the first connect to its
                               address succeeding (the learned entries are dropped between
                               rounds by removing and re-adding the rule, untimed).

For the two ratios, two bench processes join the sandbox's netns (the daemon
made it: veth, address, route): one in the sandbox's cgroup v2 dir, where the
daemon attached the programs, one in a bench-owned cgroup without programs.
Same path, only the eBPF differs. Arms alternate ABBA over BENCH_NET_ROUNDS
rounds of BENCH_NET_SECS; the ratio is the median of per-pair ratios (the
machine is shared and noisy: the stderr log shows every pair).

Run as root: `.venv/bin/python bench/net.py [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from dns_kit import Dnsmasq  # noqa: E402
from test_net_kit import AGENT, V2, World, bpf_skip_reason  # noqa: E402

import dsecd  # noqa: E402

IMAGE = "busybox"
NO_ADMISSION = "[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n"
CPUS = len(os.sched_getaffinity(0))
log = harness.log

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


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def ms(xs: list[float], p: float) -> float:
    return round(pct(xs, p), 3)


def thousand_rules(world: World) -> list[str]:
    """999 rules elsewhere (a deep trie of /24s and /16s) plus the sink's."""
    out = [f"172.{16 + i // 250}.{i % 250}.0/24:443/tcp" for i in range(900)]
    out += [f"100.{64 + i}.0.0/16:80-90/tcp" for i in range(99)]
    out.append(f"{world.pkg}:5001-5002/tcp")
    return out


def daemon_config(world: World, pool_size: int) -> str:
    cfg = world.cfg
    lines = [NO_ADMISSION, "[net]", 'default_mode = "none"', f"pool_size = {pool_size}",
             f'host_netns = "{world.br_ns}"', f'bridge = "{cfg["bridge"]}"',
             f'ipv4_subnet = "{world.subnet}"', f'ipv4_pool = "10.{world.octet}.64.0/18"',
             f'dns_upstreams = ["10.{world.octet}.2.53"]',       # the bench's dnsmasq (Dnsmasq)
             "[net.rule_sets]"]
    lines += [f"{name} = {json.dumps(rules)}" for name, rules in cfg["rule_sets"].items()]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------- processes in the test netns


def start_sink(world: World) -> subprocess.Popen:
    from pyroute2 import netns as pr_netns

    def enter() -> None:
        pr_netns.setns(f"/run/netns/{world.srv_ns}", flags=0)
        if CPUS > 1:
            os.sched_setaffinity(0, {1})        # sender on CPU 0, sink on CPU 1: less run-to-run noise

    p = subprocess.Popen([sys.executable, "-c", SINK, world.pkg], stdout=subprocess.PIPE, text=True,
                         preexec_fn=enter)
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError("the sink did not start")
    return p


class Joined:
    """A bench agent (tests/integration/test_net_kit.py AGENT) in a sandbox's netns and in
    `cgroup_dir` (the sandbox's v2 dir: the daemon's programs apply; a bench one: none)."""

    def __init__(self, init_pid: int | str, cgroup_dir: Path, script: str = AGENT, argv: tuple = ()):
        """init_pid: a sandbox's PID 1 (its netns), or a netns path."""
        from pyroute2 import netns as pr_netns

        procs = str(cgroup_dir / "cgroup.procs")
        nspath = init_pid if isinstance(init_pid, str) else f"/proc/{init_pid}/ns/net"

        def enter() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
            pr_netns.setns(nspath, flags=0)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)

        self.proc = subprocess.Popen([sys.executable, "-c", script, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, preexec_fn=enter)

    def ask(self, **q) -> dict:
        self.proc.stdin.write(json.dumps(q) + "\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        if "errno" in r:
            raise RuntimeError(f"agent {q['op']}: {r['errno']}")
        return r

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# -------------------------------------------------------------------- DNS

DNS_AGENT = r'''
import json, socket, sys, time
import dns.message, dns.query
for line in sys.stdin:
    q = json.loads(line)
    if q["op"] == "dns":
        out = {}
        for arm in ("resolver", "direct"):
            out[arm] = []
        for i in range(q["n"]):
            for arm in (("resolver", "direct") if i % 2 else ("direct", "resolver")):
                msg = dns.message.make_query(q["name"], "A")
                t0 = time.perf_counter()
                r = dns.query.udp(msg, q[arm], timeout=2)
                out[arm].append((time.perf_counter() - t0) * 1e3)
                assert r.answer, (arm, r.rcode(), r.flags)
    else:                           # first: query, then connect until it succeeds
        t0 = time.perf_counter()
        r = dns.query.udp(dns.message.make_query(q["name"], "A"), q["resolver"], timeout=2)
        addr = r.answer[-1][0].address
        s = socket.create_connection((addr, q["port"]), timeout=2)
        out = {"ms": (time.perf_counter() - t0) * 1e3, "addr": addr}
        s.close()
    print(json.dumps(out), flush=True)
'''


class DnsAgent(Joined):
    """A bench process in a sandbox's netns and cgroup (its policy applies) asking DNS."""

    def __init__(self, init_pid: int, cgroup_dir: Path):
        super().__init__(init_pid, cgroup_dir, DNS_AGENT)

    def ask(self, **q) -> dict:
        self.proc.stdin.write(json.dumps(q) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the DNS bench agent died (see stderr)")
        return json.loads(line)


async def run_dns(c, world: World, upstream: Dnsmasq, args) -> dict:
    gw = f"10.{world.octet}.0.1"
    sb = await c.create(image=IMAGE, net="default", allow=["pypi.org:443/tcp", f"{upstream.address}:53/udp"])
    try:
        info = await sb.inspect()
        agent = DnsAgent(info["init_pid"], Path(info["cgroups"]["unified"]))
        try:
            n = args.n_dns
            log(f"dns: {n} queries each way, then {n // 4} first connects")
            r = agent.ask(op="dns", n=n, name="pypi.org", resolver=gw, direct=upstream.address)
            firsts = []
            for _ in range(max(4, n // 4)):
                await sb.net_set(remove=["pypi.org:443/tcp"])     # drops what was learned for it
                await sb.net_set(add=["pypi.org:443/tcp"])
                x = agent.ask(op="first", name="pypi.org", resolver=gw, port=443)
                assert x["addr"] == world.pkg, x
                firsts.append(x["ms"])
        finally:
            agent.stop()
    finally:
        await sb.destroy()
    out = {"dns_p50_ms": ms(r["resolver"], 50), "dns_direct_p50_ms": ms(r["direct"], 50),
           "dns_p99_ms": ms(r["resolver"], 99), "fqdn_first_connect_p50_ms": ms(firsts, 50),
           "fqdn_first_connect_p99_ms": ms(firsts, 99)}
    out["dns_ratio"] = round(out["dns_p50_ms"] / out["dns_direct_p50_ms"], 3)
    log(f"  {out}")
    return out


# -------------------------------------------------------------------- in-kernel cost of the programs
# The wall-clock ratios swing by +-3 % even A/A (--null-check) on this shared
# host; the programs' own run time (BPF_ENABLE_STATS) does not depend on how
# the sender gets scheduled. ctypes here is bench-only: the daemon never does this.

BPF_PROG_GET_FD_BY_ID, BPF_PROG_QUERY, BPF_ENABLE_STATS = 13, 16, 32
ATTACH_EGRESS, ATTACH_CONNECT4 = 1, 10


def _bpf(cmd: int, attr) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(321, cmd, ctypes.byref(attr), ctypes.sizeof(attr))      # x86_64 bpf(2)
    if rc < 0:
        raise OSError(ctypes.get_errno(), f"bpf cmd {cmd}")
    return rc


def enable_bpf_stats() -> int:
    """run_time_ns/run_cnt accounting while the returned fd is open."""
    import ctypes

    return _bpf(BPF_ENABLE_STATS, (ctypes.c_uint32 * 4)(0, 0, 0, 0))


def attached_prog_fds(cgroup_dir: Path) -> dict[str, int]:
    import ctypes

    out = {}
    cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, atype in (("egress", ATTACH_EGRESS), ("connect4", ATTACH_CONNECT4)):
            ids = (ctypes.c_uint32 * 4)()
            attr = (ctypes.c_uint8 * 64)()
            ctypes.memmove(ctypes.byref(attr, 0), (ctypes.c_uint32 * 2)(cg, atype), 8)
            ctypes.memmove(ctypes.byref(attr, 16), (ctypes.c_uint64 * 1)(ctypes.addressof(ids)), 8)
            ctypes.memmove(ctypes.byref(attr, 24), (ctypes.c_uint32 * 1)(4), 4)
            _bpf(BPF_PROG_QUERY, attr)
            out[name] = _bpf(BPF_PROG_GET_FD_BY_ID, (ctypes.c_uint32 * 4)(ids[0], 0, 0, 0))
    finally:
        os.close(cg)
    return out


def prog_stats(fds: dict[str, int]) -> dict[str, tuple[int, int]]:
    out = {}
    for name, fd in fds.items():
        info = dict(line.split(":\t", 1) for line in open(f"/proc/self/fdinfo/{fd}").read().splitlines()
                    if ":\t" in line)
        out[name] = (int(info.get("run_time_ns", 0)), int(info.get("run_cnt", 0)))
    return out


def per_run_ns(a: dict, b: dict, name: str) -> float:
    dt, dn = b[name][0] - a[name][0], b[name][1] - a[name][1]
    return round(dt / dn, 1) if dn else 0.0


# -------------------------------------------------------------------- phases


async def measure_create(c, n: int, allow: list[str], gap: float) -> dict:
    """Alternating `--net none` / `--net default` creates (each destroyed after), timed,
    `gap` seconds apart (both arms): the pool refills between creates, as it does between
    bursts smaller than the pool; with gap 0 its refill competes with the create it follows."""
    t = {"none": [], "default": []}
    for i in range(-3, n):
        for mode in (("none", "default") if i % 2 else ("default", "none")):
            await asyncio.sleep(gap)
            t0 = time.perf_counter()
            sb = await c.create(image=IMAGE, net=mode, allow=allow if mode == "default" else None)
            dt = (time.perf_counter() - t0) * 1e3
            await sb.destroy()
            if i >= 0:
                t[mode].append(dt)
    return {"none_p50": statistics.median(t["none"]), "default_p50": statistics.median(t["default"]),
            "default_p99": pct(t["default"], 99),
            "overhead_p50": statistics.median(t["default"]) - statistics.median(t["none"])}


async def measure_updates(c, base: list[str], extra: str, n: int) -> tuple[list[float], list[float]]:
    """net_set add/remove of `extra` on a sandbox whose policy is `base`; and the RPC floor."""
    sb = await c.create(image=IMAGE, net="default", allow=base)
    upd, floor = [], []
    try:
        for i in range(-10, n):
            t0 = time.perf_counter()
            await (sb.net_set(add=[extra]) if i % 2 == 0 else sb.net_set(remove=[extra]))
            dt = (time.perf_counter() - t0) * 1e3
            t1 = time.perf_counter()
            await sb.inspect()
            df = (time.perf_counter() - t1) * 1e3
            if i >= 0:
                upd.append(dt)
                floor.append(df)
    finally:
        await sb.destroy()
    return upd, floor


def alternate(policy: Joined, free: Joined, ask: dict, amount: str, rounds: int) -> dict:
    """Rounds of (no programs, policy) in ABBA order: a linear drift in load cancels out of the pairs.
    Per arm: amount per wall second, and per CPU second of the sender."""
    base, pol, ratios, cpu_ratios = [], [], [], []
    for i in range(rounds):
        if i % 2 == 0:
            b = free.ask(**ask)
            p = policy.ask(**ask)
        else:
            p = policy.ask(**ask)
            b = free.ask(**ask)
        rb, rp = b[amount] / b["secs"], p[amount] / p["secs"]
        cb, cp = b[amount] / max(b["cpu"], 1e-6), p[amount] / max(p["cpu"], 1e-6)
        base.append(rb)
        pol.append(rp)
        ratios.append(rp / rb)
        cpu_ratios.append(cp / cb)
        log(f"  round {i}: none {rb:,.0f}/s  policy {rp:,.0f}/s  ratio {rp / rb:.3f}  per CPU-s {cp / cb:.3f}")
    return {"none": statistics.median(base), "policy": statistics.median(pol), "ratio": statistics.median(ratios),
            "cpu_ratio": statistics.median(cpu_ratios)}


async def measure_datapath(c, world: World, rounds: int, secs: float, null_check: bool = False,
                           n_rules: int = 1000) -> dict:
    sb = await c.create(image=IMAGE, net="default", allow=thousand_rules(world)[-n_rules:])
    free_cg = V2 / f"dsecd-bench-net-{os.getpid()}-free"
    free_cg.mkdir()
    extra_cgs: list[Path] = []
    agents: list[Joined] = []
    sink = start_sink(world)
    try:
        info = await sb.inspect()
        assert len((await sb.net_show())["rules"]) == n_rules
        pid, cg = info["init_pid"], Path(info["cgroups"]["unified"])
        if null_check:           # A/A: both arms without programs, to see the bench's own bias
            cg = V2 / f"dsecd-bench-net-{os.getpid()}-free2"
            cg.mkdir()
            extra_cgs.append(cg)
        policy, free = Joined(pid, cg), Joined(pid, free_cg)
        agents += [policy, free]
        for a in agents:
            if CPUS > 1:
                a.ask(op="pin", cpu=0)
            a.ask(op="connects", host=world.pkg, port=5002, secs=0.2)     # warm up ARP and the path
        fds = attached_prog_fds(Path(info["cgroups"]["unified"]))
        stats_fd = enable_bpf_stats()
        s0 = prog_stats(fds)
        log("tcp throughput (bytes/s), 1000-rule allowlist vs none:")
        tp = await asyncio.to_thread(alternate, policy, free, dict(op="bulk", host=world.pkg, port=5001, secs=secs),
                                     "bytes", rounds)
        s1 = prog_stats(fds)
        log("connect rate (connects/s):")
        cr = await asyncio.to_thread(alternate, policy, free, dict(op="connects", host=world.pkg, port=5002,
                                                                   secs=secs), "n", rounds)
        s2 = prog_stats(fds)
        os.close(stats_fd)
        for fd in fds.values():
            os.close(fd)
        kernel = {"egress_prog_ns_per_packet": per_run_ns(s0, s1, "egress"),
                  "connect4_prog_ns_per_call": per_run_ns(s1, s2, "connect4"),
                  "egress_packets_per_connect": round((s2["egress"][1] - s1["egress"][1])
                                                      / max(1, s2["connect4"][1] - s1["connect4"][1]), 2)}
        log(f"  in-kernel: {kernel}")
        hits = (await sb.net_show())["rules"]
        log(f"  sink rule counted {max(r['allowed'] for r in hits):,} connects")
        return {"tcp": tp, "connect": cr, "kernel": kernel}
    finally:
        for a in agents:
            a.stop()
        sink.kill()
        sink.wait()
        await sb.destroy()
        for d in [free_cg, *extra_cgs]:
            with contextlib.suppress(OSError):
                d.rmdir()


async def measure_nat(c, world: World, rounds: int, secs: float) -> dict:
    """Both NAT figures: the same bulk sender op in two places, ABBA (alternate())."""
    sb = await c.create(image=IMAGE, net="default", allow=[f"{world.inet}:9000/tcp"], publish=[5001])
    cg_free = V2 / f"dsecd-bench-net-{os.getpid()}-host"
    cg_free.mkdir()
    procs: list[Joined] = []
    try:
        info = await sb.inspect()
        pid, cg = info["init_pid"], Path(info["cgroups"]["unified"])
        sb_ip = (await sb.net_show())["lease"]["ipv4"].split("/")[0]
        host = await sb.get_host(5001)
        hh, hp = host.rsplit(":", 1)
        in_sb = Joined(pid, cg)                                   # the sandbox's programs apply
        on_host = Joined(f"/run/netns/{world.br_ns}", cg_free)    # the bridge netns, no programs
        sink = subprocess.Popen([sys.executable, "-c", SINK, "0.0.0.0"], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: _join(pid, cg))  # a sink inside the sandbox
        procs += [in_sb, on_host]
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError("the sink in the sandbox did not start")
        for a in procs:
            if CPUS > 1:
                a.ask(op="pin", cpu=0)
        in_sb.ask(op="bulk", host=world.inet, port=9000, secs=0.2)          # warm up ARP, conntrack
        on_host.ask(op="bulk", host=sb_ip, port=5001, secs=0.2)
        log("NAT: bulk TCP to the internet sink, sandbox through NAT ('policy') vs bridge netns direct ('none'):")
        nat = await asyncio.to_thread(alternate, in_sb, on_host, dict(op="bulk", host=world.inet, port=9000,
                                                                     secs=secs), "bytes", rounds)

        class _Via:                                   # the host-side sender, to one target or the other
            def __init__(self, host, port):
                self.host, self.port = host, port

            def ask(self, **q):
                return on_host.ask(**{**q, "host": self.host, "port": self.port})

        log(f"published port: bulk TCP from the bridge netns, via {host} ('policy') vs {sb_ip}:5001 ('none'):")
        pub = await asyncio.to_thread(alternate, _Via(hh, int(hp)), _Via(sb_ip, 5001),
                                      dict(op="bulk", secs=secs), "bytes", rounds)
        return {"nat": nat, "pub": pub}
    finally:
        for a in procs:
            a.stop()
        with contextlib.suppress(NameError):
            sink.kill()
            sink.wait()
        await sb.destroy()
        with contextlib.suppress(OSError):
            cg_free.rmdir()


def _join(pid: int, cg: Path) -> None:
    from pyroute2 import netns as pr_netns

    with open(cg / "cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    pr_netns.setns(f"/proc/{pid}/ns/net", flags=0)
    if CPUS > 1:
        os.sched_setaffinity(0, {1})


async def run_nat(sock: str, world: World, args) -> dict:
    async with dsecd.Client(sock) as c:
        r = await measure_nat(c, world, args.rounds, args.secs)
    return {"nat_throughput_ratio": round(r["nat"]["ratio"], 4),
            "nat_throughput_cpu_ratio": round(r["nat"]["cpu_ratio"], 4),
            "nat_throughput_gbit": round(r["nat"]["policy"] * 8 / 1e9, 3),
            "direct_uplink_throughput_gbit": round(r["nat"]["none"] * 8 / 1e9, 3),
            "published_port_throughput_ratio": round(r["pub"]["ratio"], 4),
            "published_port_throughput_cpu_ratio": round(r["pub"]["cpu_ratio"], 4),
            "published_port_throughput_gbit": round(r["pub"]["policy"] * 8 / 1e9, 3),
            "sandbox_direct_throughput_gbit": round(r["pub"]["none"] * 8 / 1e9, 3)}


async def pool_stats(c) -> dict:
    return ((await c.info()).get("net") or {}).get("pool") or {}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


async def first_create(sock: str) -> tuple[float, dict]:
    """ms of the first --net default create of a daemon; its `dsec info` net section."""
    async with dsecd.Client(sock) as c:
        t0 = time.perf_counter()
        sb = await c.create(image=IMAGE, net="default", allow=["pypi"])
        dt = (time.perf_counter() - t0) * 1e3
        await sb.destroy()
        return dt, (await c.info()).get("net") or {}


def run_first(rootfs: str, world: World) -> dict:
    """Two daemon starts on one BPF cache dir, emptied before the first."""
    import shutil
    import tempfile

    cache = Path(tempfile.mkdtemp(prefix="dsecd-bench-bpf-"))
    out = {}
    try:
        for arm in ("cold", "warm"):
            cfg = daemon_config(world, 8).replace("[net]\n", f'[net]\nbpf_cache_dir = "{cache}"\n', 1)
            with harness.private_daemon(rootfs, IMAGE, extra_config=cfg) as d:
                dt, net = uvloop.run(first_create(d.sock))
                log(f"first --net default create, {arm} BPF cache: {dt:.1f} ms; bpf {net.get('bpf')}; pool {net.get('pool')}")
                out[f"first_net_create_{arm}_ms"] = round(dt, 1)
                out[f"first_net_create_{arm}_bpf"] = net.get("bpf")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    out["first_net_create_ms"] = out.get("first_net_create_warm_ms")
    return out


async def run_pooled(sock: str, world: World, args, pid: int) -> dict:
    out = {}
    async with dsecd.Client(sock) as c:
        # The first --net default create builds the daemon's Network (and, with a
        # bcc-era daemon, compiled the programs: seconds).
        t0 = time.perf_counter()
        sb = await c.create(image=IMAGE, net="default", allow=["pypi"])
        await sb.destroy()
        out["bpf_compile_and_first_create_s"] = round(time.perf_counter() - t0, 2)
        out["daemon_rss_mib"] = rss_mib(pid)
        log(f"daemon RSS after its programs are loaded: {out['daemon_rss_mib']} MiB")
        await asyncio.sleep(1.0)              # let the pool fill
        if "create" in args.phases:
            log(f"create overhead, pool on: {args.n_create} pairs")
            cr = await measure_create(c, args.n_create, ["pypi", "dns"], args.create_gap)
            log(f"  {cr}")
            out.update(net_create_default_p50_ms=round(cr["default_p50"], 3),
                       net_create_none_p50_ms=round(cr["none_p50"], 3),
                       net_create_overhead_p50_ms=round(cr["overhead_p50"], 3))
        if "updates" in args.phases:
            out.update(await run_updates(c, world, args))
        if "datapath" in args.phases:
            out.update(await run_datapath(c, world, args))
        if "dns" in args.phases:
            out.update(await run_dns(c, world, args.upstream, args))
        pool = await pool_stats(c)
        log(f"pool: {pool}")
        out["netns_pool_create_p50_ms"] = pool.get("create_p50_ms")
        out["netns_pool"] = pool
    return out


async def run_updates(c, world: World, args) -> dict:
    out = {}
    log(f"rule updates: {args.n_update} on 10 rules, {args.n_update // 4} on 1,000")
    small = ["pypi", "dns"] + [f"172.16.{i}.0/24:443/tcp" for i in range(6)]
    upd, floor = await measure_updates(c, small, f"{world.ref}:8080/tcp", args.n_update)
    daemon_side = ((await c.info()).get("net") or {}).get("updates", {})
    out.update(rule_update_daemon_p50_ms=daemon_side.get("p50_ms"), rule_update_daemon_p99_ms=daemon_side.get("p99_ms"))
    big, _ = await measure_updates(c, thousand_rules(world)[:-1], f"{world.ref}:8080/tcp", args.n_update // 4)
    out.update(rule_update_p50_ms=ms(upd, 50), rule_update_p99_ms=ms(upd, 99),
               rpc_floor_p50_ms=ms(floor, 50), rpc_floor_p99_ms=ms(floor, 99),
               rule_update_1000_rules_p50_ms=ms(big, 50), rule_update_1000_rules_p99_ms=ms(big, 99))
    log(f"  10 rules p50 {out['rule_update_p50_ms']} p99 {out['rule_update_p99_ms']} ms "
        f"(inspect p50 {out['rpc_floor_p50_ms']} p99 {out['rpc_floor_p99_ms']}); "
        f"1000 rules p99 {out['rule_update_1000_rules_p99_ms']} ms")
    return out


async def run_datapath(c, world: World, args) -> dict:
    out = {}
    dp = await measure_datapath(c, world, args.rounds, args.secs, args.null_check, args.policy_rules)
    out.update(tcp_throughput_ratio=round(dp["tcp"]["ratio"], 4),
               tcp_throughput_gbit_none=round(dp["tcp"]["none"] * 8 / 1e9, 3),
               tcp_throughput_gbit_policy=round(dp["tcp"]["policy"] * 8 / 1e9, 3),
               tcp_throughput_cpu_ratio=round(dp["tcp"]["cpu_ratio"], 4),
               connect_rate_ratio=round(dp["connect"]["ratio"], 4),
               connect_rate_cpu_ratio=round(dp["connect"]["cpu_ratio"], 4),
               connects_per_s_none=round(dp["connect"]["none"]),
               connects_per_s_policy=round(dp["connect"]["policy"]), **dp["kernel"])
    return out


async def run_nopool(sock: str, args) -> dict:
    async with dsecd.Client(sock) as c:
        sb = await c.create(image=IMAGE, net="default", allow=["pypi"])
        await sb.destroy()
        log(f"create overhead, pool off: {args.n_create} pairs")
        cr = await measure_create(c, args.n_create, ["pypi", "dns"], args.create_gap)
        log(f"  {cr}")
    return {"net_create_overhead_nopool_p50_ms": round(cr["overhead_p50"], 3),
            "net_create_default_nopool_p50_ms": round(cr["default_p50"], 3)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-create", type=int, default=40, help="create pairs (none, default) per daemon")
    p.add_argument("--n-update", type=int, default=1000, help="net_set calls on the 10-rule policy")
    p.add_argument("--rounds", type=int, default=int(os.environ.get("BENCH_NET_ROUNDS", "24")))
    p.add_argument("--secs", type=float, default=float(os.environ.get("BENCH_NET_SECS", "0.5")))
    p.add_argument("--pool-size", type=int, default=8, help="net.pool_size of the pooled daemon")
    p.add_argument("--create-gap", type=float, default=0.1, help="seconds between timed creates (both arms)")
    p.add_argument("--no-nopool", action="store_true", help="skip the pool-off daemon")
    p.add_argument("--phases", default="create,updates,datapath,dns,first,nat",
                   help="comma-separated subset of create,updates,datapath,dns,first,nat (the pool-off daemon "
                        "runs with create; first: two more daemon starts, cold then warm BPF cache; nat: a "
                        "daemon with net.uplink into a bench-owned internet netns)")
    p.add_argument("--n-dns", type=int, default=400, help="DNS queries per arm")
    p.add_argument("--null-check", action="store_true",
                   help="datapath A/A: the 'policy' arm also runs without programs (the ratios should be ~1)")
    p.add_argument("--policy-rules", type=int, default=1000, help="rules of the datapath policy (1..1000)")
    p.add_argument("--rootfs", help="rootfs to import (default: scripts/mkrootfs.sh's cache)")
    p.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.n_create, args.n_update, args.rounds, args.secs, args.n_dns = 10, 100, 4, 0.3, 80
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = bpf_skip_reason()
    if reason:
        print(json.dumps({"error": reason}))
        return 1
    rootfs = args.rootfs or harness.build_rootfs()
    world = World(network=False)
    args.upstream = None
    try:
        if "dns" in args.phases:
            args.upstream = Dnsmasq(world)
        results = {}
        if not args.no_nopool and "create" in args.phases:
            with harness.private_daemon(rootfs, IMAGE, extra_config=daemon_config(world, 0)) as d:
                results.update(uvloop.run(run_nopool(d.sock, args)))
        if set(args.phases.split(",")) - {"nat", "first"}:
            with harness.private_daemon(rootfs, IMAGE, extra_config=daemon_config(world, args.pool_size)) as d:
                results.update(uvloop.run(run_pooled(d.sock, world, args, d.proc.pid)))
        if "first" in args.phases:
            results.update(run_first(rootfs, world))
        if "nat" in args.phases:
            world.add_internet()
            cfg = daemon_config(world, args.pool_size).replace("[net]\n", f'[net]\nuplink = "{world.uplink}"\n')
            with harness.private_daemon(rootfs, IMAGE, extra_config=cfg) as d:
                results.update(uvloop.run(run_nat(d.sock, world, args)))
    finally:
        if args.upstream is not None:
            args.upstream.stop()
        world.close()
    results.update(rounds=args.rounds, round_secs=args.secs, create_gap_s=args.create_gap, cpus=CPUS,
                   loadavg_1m=round(os.getloadavg()[0], 1))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    harness.run(main)
