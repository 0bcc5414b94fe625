"""Test-owned network worlds for the net tests and bench/net.py (no tests in this file).

A World is: a cgroup v2 subtree `dsecd-test-<hex>`, a netns holding the bridge
(`dsec-test-br-<hex>`, never the host's), a netns of servers on that bridge
(the "package index" 10.x.2.10 and the "reference solution" host 10.x.2.20),
and a Network whose host_netns is the bridge netns. Sandboxes are an agent
process (uid nobody, no capabilities unless asked) in its own netns and its own
cgroup below the subtree. Traffic only ever goes between these namespaces.
Everything is removed by World.close(), which fixtures call in finalizers.

World.add_internet() adds an "internet": one more netns, linked to the bridge
netns by a test-owned veth (`up0` there, 198.18.<x>.1/24, with the default
route of the bridge netns through it), holding an HTTP server at
198.18.<x>.2:80 that answers with the address it saw the client connect
from. A daemon given `net.uplink = "up0"` NATs the sandboxes out of that veth.
The internet netns has no route to the bridge subnet: only masqueraded
traffic gets answers. add_inet_address() gives it more addresses in
198.18.<x>.0/24 for the servers a test starts there.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns

from dsecd.net.plumbing import addr_msg, in_netns, link_up_msg, netlink_socket, request

V2 = Path("/sys/fs/cgroup/unified")
SERVER_TCP_PORTS = (80, 443, 8080)

AGENT = r'''
import ctypes, errno, json, os, socket, struct, sys, time
held = {}
def err(e): return {"errno": errno.errorcode.get(e.errno, str(e.errno))}
def talk(s, data, timeout):
    s.settimeout(timeout); s.sendall(data)
    try: return {"ok": True, "data": s.recv(256).decode()}
    except socket.timeout: return {"ok": False, "timeout": True}
for line in sys.stdin:
    q = json.loads(line); op = q["op"]; r = {}
    try:
        if op == "connect":
            fam = socket.AF_INET6 if ":" in q["host"] else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(q.get("timeout", 2))
            s.connect((q["host"], q["port"]))
            if q.get("hold"): held[q["hold"]] = s; r = talk(s, b"hello", 2)
            else: r = talk(s, b"hello", 2); s.close()
        elif op == "talk":
            r = talk(held[q["hold"]], b"again", q.get("timeout", 1))
        elif op == "listen":      # a listener on every address, kept as "listen<port>"
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", q["port"])); s.listen(64); held[f"listen{q['port']}"] = s; r = {"ok": True}
        elif op == "accept":      # one connection to that listener, kept as `hold`
            s = held[f"listen{q['port']}"]; s.settimeout(q.get("timeout", 2))
            held[q["hold"]] = s.accept()[0]; r = {"ok": True}
        elif op == "selfconnect":  # n connections to that listener from the sandbox itself, closed
            s = held[f"listen{q['port']}"]
            for _ in range(q["n"]):
                c = socket.create_connection((q["host"], q["port"]), timeout=2); s.accept()[0].close(); c.close()
            r = {"ok": True}
        elif op == "close":
            held.pop(q["hold"]).close(); r = {"ok": True}
        elif op == "udp":
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(q.get("timeout", 1))
            s.sendto(b"ping", (q["host"], q["port"]))
            try: r = {"ok": True, "data": s.recvfrom(256)[0].decode()}
            except socket.timeout: r = {"ok": False, "timeout": True}
            s.close()
        elif op == "udpbind":     # a UDP socket on every address at `port`, kept as "udp<port>"
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", q["port"]))
            held[f"udp{q['port']}"] = s; r = {"ok": True}
        elif op == "udpself":     # n datagrams to that socket from the sandbox itself, each from a fresh port
            s = held[f"udp{q['port']}"]; s.settimeout(2)
            for _ in range(q["n"]):
                c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); c.sendto(b"self", (q["host"], q["port"]))
                s.recvfrom(64); c.close()
            r = {"ok": True}
        elif op == "udpanswer":   # one datagram to that socket, answered from it: its source and how the answer went
            s = held[f"udp{q['port']}"]; s.settimeout(q.get("timeout", 2))
            data, src = s.recvfrom(64); r = {"from": list(src)}
            try: s.sendto(b"answer", src); r["ok"] = True
            except OSError as e: r.update(err(e))
        elif op == "udpsendto":   # one datagram from that socket to host:to, unasked (nothing is read first)
            held[f"udp{q['port']}"].sendto(b"unasked", (q["host"], q["to"])); r = {"ok": True}
        elif op == "icmp":
            s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(q.get("timeout", 1))
            s.sendto(bytes([8, 0, 0xf7, 0xfe, 0, 1, 0, 0]), (q["host"], 0))
            try: r = {"ok": True, "n": len(s.recvfrom(256)[0])}
            except socket.timeout: r = {"ok": False, "timeout": True}
            s.close()
        elif op == "bpf":
            libc = ctypes.CDLL(None, use_errno=True)
            attr = (ctypes.c_uint32 * 8)(1, 4, 8, 1, 0, 0, 0, 0)     # BPF_MAP_TYPE_HASH, 4-byte key, 8-byte value
            rc = libc.syscall(321, 0, ctypes.byref(attr), ctypes.sizeof(attr))   # bpf(BPF_MAP_CREATE)
            r = {"rc": rc, "errno": errno.errorcode.get(ctypes.get_errno(), "")}
        elif op == "fds":
            d = "/proc/self/fd"
            r = {"fds": [os.readlink(f"{d}/{n}") for n in os.listdir(d) if os.path.exists(f"{d}/{n}")]}
        elif op == "pin":
            os.sched_setaffinity(0, {q["cpu"]}); r = {"ok": True}
        elif op == "bulk":        # bench: stream to a sink for `secs`
            s = socket.create_connection((q["host"], q["port"])); buf = b"x" * 262144; n = 0
            c0 = time.process_time(); t0 = time.perf_counter(); end = t0 + q["secs"]
            while time.perf_counter() < end:
                s.sendall(buf); n += len(buf)
            r = {"bytes": n, "secs": time.perf_counter() - t0, "cpu": time.process_time() - c0}; s.close()
        elif op == "connects":    # bench: connect+close (RST, no TIME_WAIT) for `secs`
            n = 0; c0 = time.process_time(); t0 = time.perf_counter(); end = t0 + q["secs"]
            lg = struct.pack("ii", 1, 0)
            while time.perf_counter() < end:
                s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, lg)
                s.connect((q["host"], q["port"])); s.close(); n += 1
            r = {"n": n, "secs": time.perf_counter() - t0, "cpu": time.process_time() - c0}
    except OSError as e:
        r = err(e)
    print(json.dumps(r), flush=True)
'''


def _run_server_tcp(sock: socket.socket, stop: threading.Event) -> None:
    def serve(c: socket.socket, port: int) -> None:
        with c:
            while True:
                try:
                    data = c.recv(256)
                except OSError:
                    return
                if not data:
                    return
                c.sendall(f"srv{port}:".encode() + data)

    port = sock.getsockname()[1]
    while not stop.is_set():
        try:
            c, _ = sock.accept()
        except (TimeoutError, OSError):
            continue
        threading.Thread(target=serve, args=(c, port), daemon=True).start()


def _run_http_whoami(sock: socket.socket, stop: threading.Event) -> None:
    """HTTP/1.0: the body is the client address the server saw."""
    while not stop.is_set():
        try:
            c, peer = sock.accept()
        except (TimeoutError, OSError):
            continue
        with c:
            c.settimeout(2)
            try:
                c.recv(4096)
                body = f"whoami {peer[0]}\n".encode()
                c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            except OSError:
                pass


def _run_sink(sock: socket.socket, stop: threading.Event) -> None:
    """Reads and discards until EOF, then answers the byte count (bench)."""
    def serve(c: socket.socket) -> None:
        n = 0
        with c:
            while True:
                try:
                    data = c.recv(1 << 20)
                except OSError:
                    return
                if not data:
                    break
                n += len(data)
            with contextlib.suppress(OSError):
                c.sendall(str(n).encode())

    while not stop.is_set():
        try:
            c, _ = sock.accept()
        except (TimeoutError, OSError):
            continue
        threading.Thread(target=serve, args=(c,), daemon=True).start()


def _run_server_udp(sock: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            data, peer = sock.recvfrom(256)
        except (TimeoutError, OSError):
            continue
        sock.sendto(b"udp:" + data, peer)


class Agent:
    """A stand-in sandbox: a process in its own netns and cgroup."""

    def __init__(self, world: World, name: str, root: bool = False, nsfd: int | None = None):
        """nsfd: join that netns (a pool entry's) instead of making one."""
        self.name = name
        self.cgroup = world.cgroup / name
        self.cgroup.mkdir()
        procs = str(self.cgroup / "cgroup.procs")
        if nsfd is None:
            self.netns = f"{world.prefix}-sb-{name}"
            pr_netns.create(self.netns)
            world.netns.append(self.netns)
            nspath = f"/run/netns/{self.netns}"
            lo_up(nspath)                       # the spawn helper does this in real sandboxes
        else:
            self.netns, nspath = None, f"/proc/self/fd/{nsfd}"

        def enter() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
            pr_netns.setns(nspath, flags=0)
            if not root:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)                            # drops every capability

        self.proc = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, preexec_fn=enter)

    def ask(self, **q) -> dict:
        self.proc.stdin.write(json.dumps(q) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


class World:
    def __init__(self, net_overrides: dict | None = None, network: bool = True):
        """network=False: the bridge only (made by Plumbing), no Network of this
        process; bench/net.py gives the bridge netns to a daemon instead."""
        h = secrets.token_hex(3)
        self.prefix = f"dsec-test-{h}"
        self.octet = 200 + secrets.randbelow(50)
        self.subnet = f"10.{self.octet}.0.0/16"
        self.pkg = f"10.{self.octet}.2.10"          # the fake package index
        self.ref = f"10.{self.octet}.2.20"          # the fake reference-solution host
        self.subnet6 = f"fd00:{self.octet}::/64"    # IPv6 mirrors IPv4 offsets (see ipam.py)
        self.pkg6 = f"fd00:{self.octet}::20a"
        self.ref6 = f"fd00:{self.octet}::214"
        self.tmp = Path(tempfile.mkdtemp(prefix="dsec-net-test-"))
        self.netns: list[str] = []
        self.agents: list[Agent] = []
        self.stop_event = threading.Event()
        self.server_socks: list[socket.socket] = []
        self.net = None
        self.plumbing = None
        self.cgroup_root = f"dsecd-test-{h}"
        self.cgroup = V2 / self.cgroup_root
        self.cgroup.mkdir()
        try:
            self._make_bridge_netns()
            self._make_servers()
            self.cfg = net_config(self)
            self.cfg.update(net_overrides or {})
            if network:
                from dsecd.net import Network
                self.net = Network(self.cfg, self.tmp / "state", V2, self.cgroup_root)
                self.bridge_index = self.net.plumbing.bridge_index
            else:
                from dsecd.net.plumbing import BridgeSpec, Plumbing
                self.plumbing = Plumbing(BridgeSpec(name=self.cfg["bridge"], mtu=self.cfg["mtu"],
                                                    host_netns=self.br_ns, gateway4=f"10.{self.octet}.0.1/16"))
                self.bridge_index = self.plumbing.bridge_index
            self._link_servers()
        except BaseException:
            self.close()
            raise

    def _make_bridge_netns(self) -> None:
        self.br_ns = f"{self.prefix}-br"
        pr_netns.create(self.br_ns)
        self.netns.append(self.br_ns)
        self.srv_ns = f"{self.prefix}-srv"
        pr_netns.create(self.srv_ns)
        self.netns.append(self.srv_ns)

    def _make_servers(self) -> None:
        lo_up(f"/run/netns/{self.srv_ns}")
        with in_netns(f"/run/netns/{self.srv_ns}"):
            socks = []
            for host in (self.pkg, self.ref):
                for port in SERVER_TCP_PORTS:
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.setsockopt(socket.IPPROTO_IP, 15, 1)   # IP_FREEBIND: addresses come with the veth below
                    s.bind((host, port))
                    s.listen(128)
                    socks.append(("tcp", s))
                u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                u.setsockopt(socket.IPPROTO_IP, 15, 1)
                u.bind((host, 53))
                socks.append(("udp", u))
            for host in (self.pkg6, self.ref6):
                for port in (80, 443):
                    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                    s.setsockopt(socket.IPPROTO_IPV6, 78, 1)  # IPV6_FREEBIND
                    s.bind((host, port))
                    s.listen(128)
                    socks.append(("tcp", s))
        for kind, s in socks:
            s.settimeout(0.2)
            self.server_socks.append(s)
            target = _run_server_tcp if kind == "tcp" else _run_server_udp
            threading.Thread(target=target, args=(s, self.stop_event), daemon=True).start()

    def _link_servers(self) -> None:
        """A veth from the bridge into the server netns, addresses outside the IPAM pool."""
        br = f"/run/netns/{self.br_ns}"
        srv_fd = os.open(f"/run/netns/{self.srv_ns}", os.O_RDONLY)
        try:
            with IPRoute(fileno=netlink_socket(br).detach(), groups=0) as ipr:
                ipr.link("add", ifname="srv0", kind="veth", peer={"ifname": "eth0", "net_ns_fd": srv_fd})
                idx = ipr.link_lookup(ifname="srv0")[0]
                ipr.link("set", index=idx, master=self.bridge_index, state="up")
        finally:
            os.close(srv_fd)
        with IPRoute(fileno=netlink_socket(f"/run/netns/{self.srv_ns}").detach(), groups=0) as ipr:
            idx = ipr.link_lookup(ifname="eth0")[0]
            for host in (self.pkg, self.ref):
                ipr.addr("add", index=idx, address=host, prefixlen=16)
            ipr.link("set", index=idx, state="up")
        s = netlink_socket(f"/run/netns/{self.srv_ns}")
        try:
            request(s, [(20, 0x400 | 0x200, addr_msg(idx, ipaddress.ip_interface(f"{h}/64"), True), f"add {h}")
                        for h in (self.pkg6, self.ref6)])       # RTM_NEWADDR, CREATE|EXCL, no DAD
        finally:
            s.close()

    def add_internet(self) -> None:
        self.inet_ns = f"{self.prefix}-inet"
        pr_netns.create(self.inet_ns)
        self.netns.append(self.inet_ns)
        self.uplink = "up0"
        self.inet_net = f"198.18.{self.octet}.0/24"
        self.uplink_addr = f"198.18.{self.octet}.1"
        self.inet = f"198.18.{self.octet}.2"
        inet_path, br = f"/run/netns/{self.inet_ns}", f"/run/netns/{self.br_ns}"
        lo_up(inet_path)
        inet_fd = os.open(inet_path, os.O_RDONLY)
        try:
            with IPRoute(fileno=netlink_socket(br).detach(), groups=0) as ipr:
                ipr.link("add", ifname=self.uplink, kind="veth", peer={"ifname": "eth0", "net_ns_fd": inet_fd})
                idx = ipr.link_lookup(ifname=self.uplink)[0]
                ipr.addr("add", index=idx, address=self.uplink_addr, prefixlen=24)
                ipr.link("set", index=idx, state="up")
                ipr.route("add", dst="0.0.0.0/0", gateway=self.inet)
        finally:
            os.close(inet_fd)
        with IPRoute(fileno=netlink_socket(inet_path).detach(), groups=0) as ipr:
            idx = ipr.link_lookup(ifname="eth0")[0]
            ipr.addr("add", index=idx, address=self.inet, prefixlen=24)
            ipr.link("set", index=idx, state="up")
        with in_netns(inet_path):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((self.inet, 80))
            s.listen(64)
            sink = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sink.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sink.bind((self.inet, 9000))
            sink.listen(16)
        for sock, target in ((s, _run_http_whoami), (sink, _run_sink)):
            sock.settimeout(0.2)
            self.server_socks.append(sock)
            threading.Thread(target=target, args=(sock, self.stop_event), daemon=True).start()

    def add_inet_address(self, address: str) -> None:
        """One more address in self.inet_net on the internet netns' eth0 (add_internet first)."""
        with IPRoute(fileno=netlink_socket(f"/run/netns/{self.inet_ns}").detach(), groups=0) as ipr:
            idx = ipr.link_lookup(ifname="eth0")[0]
            ipr.addr("add", index=idx, address=address, prefixlen=24)

    def in_bridge_netns(self, fn, *args):
        """fn(*args) on a thread in the bridge netns (the daemon's host side)."""
        return self.in_netns(self.br_ns, fn, *args)

    def host_udp_service(self, port: int, family: int = socket.AF_INET) -> socket.socket:
        """A UDP socket of the host side (the bridge netns) bound to every
        address at `port`, its reads timing out after 3 s: what a sandbox
        must not reach through a broad rule."""
        def bind() -> socket.socket:
            s = socket.socket(family, socket.SOCK_DGRAM)
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
            s.settimeout(3)
            return s

        return self.in_bridge_netns(bind)

    @staticmethod
    def in_netns(ns: str, fn, *args):
        """fn(*args) on a thread in the netns `ns` (its name under /run/netns)."""
        out: dict = {}

        def run() -> None:
            try:
                with in_netns(f"/run/netns/{ns}"):
                    out["value"] = fn(*args)
            except BaseException as err:      # handed to the caller
                out["error"] = err

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def agent(self, name: str | None = None, root: bool = False, nsfd: int | None = None) -> Agent:
        a = Agent(self, name or secrets.token_hex(4), root=root, nsfd=nsfd)
        self.agents.append(a)
        return a

    def close(self) -> None:
        self.stop_event.set()
        if self.net is not None:
            for sb_id in list(self.net._sbs):
                with contextlib.suppress(Exception):
                    self.net.detach(sb_id)
            self.net.close()
        if self.plumbing is not None:
            self.plumbing.close()
        for a in self.agents:
            a.stop()
        for s in self.server_socks:
            s.close()
        for ns in self.netns:
            with contextlib.suppress(OSError):
                pr_netns.remove(ns)
        if self.cgroup.exists():
            for d in sorted(self.cgroup.rglob("*"), key=lambda p: -len(p.parts)):
                if d.is_dir():
                    with contextlib.suppress(OSError):
                        d.rmdir()
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()
        shutil.rmtree(self.tmp, ignore_errors=True)


def net_config(world: World) -> dict:
    o = world.octet
    return {
        "bridge": "dsec0", "mtu": 1500, "host_netns": world.br_ns, "sandbox_ifname": "eth0",
        "ipv4_subnet": world.subnet, "ipv4_pool": f"10.{o}.1.0/24", "ipv6_subnet": world.subnet6,
        "max_rules_per_sandbox": 4096, "max_prefixes": 65536, "max_counters": 65536, "fsync": False,
        "essentials": [],
        "rule_sets": {"pypi": [f"{world.pkg}:443/tcp", f"{world.pkg}:80/tcp"],
                      "refsol": [f"{world.ref}:443/tcp"],
                      "dns": [f"{world.pkg}:53/udp", f"{world.pkg}:53/tcp"]},
    }


def lo_up(nspath: str) -> None:
    s = netlink_socket(nspath)
    try:
        request(s, [(16, 0, link_up_msg(1), "set lo up")])      # RTM_NEWLINK
    finally:
        s.close()


def bpf_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (netns, cgroups, BPF)"
    if not (V2 / "cgroup.procs").exists():
        return f"no cgroup v2 hierarchy at {V2}"
    try:
        import bcc  # noqa: F401
    except ImportError as err:
        return f"bcc unavailable: {err}"
    return None


def bridge_links(world: World, prefix: str) -> list[str]:
    """Links named prefix* in the world's bridge netns."""
    with IPRoute(fileno=netlink_socket(f"/run/netns/{world.br_ns}").detach(), groups=0) as ipr:
        names = [link.get_attr("IFLA_IFNAME") or "" for link in ipr.get_links()]
    return [n for n in names if n.startswith(prefix)]
