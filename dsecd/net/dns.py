"""The sandboxes' resolver: DNS on the bridge's gateway address, port 53 (UDP and TCP).

Every --net default sandbox's /etc/resolv.conf names the gateway; its egress
allowlist allows the gateway on port 53 and nothing else there
(Network.resolver_rule). The resolver runs on the daemon's event loop with its
sockets made inside net.host_netns (a socket stays in the netns it was made
in), and forwards to the upstreams (net.dns_upstreams, else the nameservers of
the host's /etc/resolv.conf), from that same netns.

A query's source address is a lease, so it names the sandbox - on the bridge
only, where a sandbox cannot send with another's address (a container's
socket cannot use an address its netns does not have, a microVM's tap drops
frames from any but its own). Elsewhere a sandbox's address is anyone's to
put in a packet (a host on the uplink, a process of the host side), so the
sockets are bound to the bridge (SO_BINDTODEVICE) and what arrives on another
interface never reaches the resolver. For a name no
name rule of that sandbox matches, the answer is REFUSED (or NXDOMAIN,
net.dns_refuse) without asking upstream. For a matching name, the upstream's
answer is checked and trimmed before it leaves:
  - only the CNAME chain from the queried name (at most MAX_CNAME links) and
    the addresses of its last name are kept; other names' records are dropped;
  - an address that is loopback, link-local, the gateway or in the sandboxes'
    pool (Network.is_blocked) is dropped and counted (`hostile_dropped`);
  - at most net.dns_max_addrs_per_answer addresses are kept (`capped`);
  - TTLs are clamped to [net.dns_ttl_min_s, net.dns_ttl_max_s].
The kept addresses join the sandbox's allowlist with each matching rule's ports
until TTL + net.dns_grace_s (Network.learn) before the answer is sent, so the
sandbox's first connect after the answer is allowed; a sweep removes them at
expiry (Network.expire).

The wire format is dnspython's (Debian's python3-dnspython): a strict parser
(name compression loops, lengths and counts are checked, a bad message raises)
whose message objects let the answer be edited and re-encoded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import secrets
import socket
import struct
import time

import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdatatype
import dns.rrset

from .network import Learned, Network
from .plumbing import in_netns

log = logging.getLogger(__name__)

MAX_CNAME = 8                 # links of a CNAME chain followed; a longer one gives no address
MAX_INFLIGHT = 1024           # queries being answered at once (UDP beyond that is dropped)
MAX_TCP_CLIENTS = 256
# One source address's (one sandbox's) share of those: a sandbox flooding
# queries of a slow name, or holding idle TCP connections, must not leave
# the other sandboxes without a resolver.
MAX_INFLIGHT_PER_CLIENT = 128
MAX_TCP_PER_CLIENT = 16
TCP_IDLE_S = 10.0
SWEEP_S = 1.0                 # at most this late, an expired entry is removed
IP_FREEBIND = 15


class RateLimiter:
    """A token bucket per source address (one per sandbox): `rate` queries
    a second on average, up to twice that at once. rate 0: no limit. A
    source whose bucket is full again holds no entry (prune)."""

    def __init__(self, rate: float, clock=time.monotonic):
        self.rate = float(rate)
        self.burst = 2.0 * self.rate
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}     # src -> (tokens, when)

    def allow(self, src: str) -> bool:
        if not self.rate:
            return True
        now = self.clock()
        tokens, then = self._buckets.get(src, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens < 1.0:
            self._buckets[src] = (tokens, now)
            return False
        self._buckets[src] = (tokens - 1.0, now)
        return True

    def prune(self) -> None:
        now = self.clock()
        full = [src for src, (tokens, then) in self._buckets.items()
                if tokens + (now - then) * self.rate >= self.burst]
        for src in full:
            del self._buckets[src]

    def __len__(self) -> int:
        return len(self._buckets)


def parse_upstreams(cfg: dict, resolv_conf: str = "/etc/resolv.conf") -> list[tuple[str, int]]:
    """net.dns_upstreams ("addr", "addr:port", "[v6]:port"), else the host's nameservers."""
    given = list(cfg.get("dns_upstreams") or [])
    if not given:
        try:
            with open(resolv_conf) as f:
                given = [ln.split()[1] for ln in f if ln.split()[:1] == ["nameserver"] and len(ln.split()) > 1]
        except OSError as err:
            raise ValueError(f"read the upstream resolvers from {resolv_conf}: {err.strerror}; "
                             "set net.dns_upstreams") from err
    out = []
    for text in given:
        host, port = text, 53
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else 53
        elif text.count(":") == 1:
            host, p = text.split(":")
            port = int(p)
        try:
            ipaddress.ip_address(host)
        except ValueError as err:
            raise ValueError(f"net.dns_upstreams: {text!r} is not an address[:port]") from err
        out.append((host, port))
    if not out:
        raise ValueError(f"no upstream resolver: {resolv_conf} names no nameserver; set net.dns_upstreams")
    return out


class Resolver:
    """run_blocking(fn, *args): awaitable, runs fn on a worker thread (Workers.run)."""

    def __init__(self, net: Network, cfg: dict, run_blocking):
        self.net = net
        self.run_blocking = run_blocking
        self.address = str(net.ipam.gateway4)
        self.bridge = net.plumbing.spec.name
        self.ns_path = net.plumbing.ns_path
        self.upstreams = parse_upstreams(cfg)
        refuse = cfg.get("dns_refuse", "refused")
        if refuse not in ("refused", "nxdomain"):
            raise ValueError(f"net.dns_refuse must be 'refused' or 'nxdomain', got {refuse!r}")
        self.refuse = dns.rcode.REFUSED if refuse == "refused" else dns.rcode.NXDOMAIN
        self.ttl_min = int(cfg.get("dns_ttl_min_s", 30))
        self.ttl_max = int(cfg.get("dns_ttl_max_s", 3600))
        self.grace = float(cfg.get("dns_grace_s", 300))
        self.max_addrs = int(cfg.get("dns_max_addrs_per_answer", 16))
        self.timeout = float(cfg.get("dns_timeout_s", 2.0))
        self.limiter = RateLimiter(float(cfg.get("dns_rate_per_s", 500)))
        if not 0 <= self.ttl_min <= self.ttl_max:
            raise ValueError(f"net.dns_ttl_min_s {self.ttl_min} must be in [0, net.dns_ttl_max_s {self.ttl_max}]")
        self.stats: collections.Counter = collections.Counter()     # queries of no sandbox, malformed, ...
        self._inflight = 0
        self._inflight_by_src: collections.Counter = collections.Counter()
        self._tcp_clients = 0
        self._tcp_by_src: collections.Counter = collections.Counter()
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task | None = None
        self._wake = asyncio.Event()
        # The soonest expiry of what was learned since the sweeper last
        # asked the Network for its next one (None: nothing since).
        self._learned_due: float | None = None

    # ------------------------------------------------------------ lifecycle

    def _sockets(self) -> tuple[socket.socket, socket.socket]:
        with in_netns(self.ns_path) if self.ns_path else contextlib.nullcontext():
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # SO_REUSEADDR on TCP only (a restart within TIME_WAIT): on UDP it would let
            # a second daemon on the same bridge share the port and take some queries.
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            for s in (udp, tcp):
                s.setsockopt(socket.IPPROTO_IP, IP_FREEBIND, 1)
                # Only what comes through the bridge: a query's source address
                # is its sandbox's identity there and nowhere else.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, self.bridge.encode())
                s.bind((self.address, 53))
                s.setblocking(False)
            tcp.listen(128)
        except OSError as err:
            udp.close()
            tcp.close()
            raise OSError(err.errno, f"bind the sandboxes' resolver to {self.address}:53 in netns "
                          f"{self.ns_path or '(the daemon s own)'}: {err.strerror}; stop what listens there, "
                          "or set net.dns = false") from err
        return udp, tcp

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        udp, tcp = self._sockets()
        self._udp, _ = await loop.create_datagram_endpoint(lambda: _UdpProtocol(self), sock=udp)
        self._tcp = await asyncio.start_server(self._tcp_client, sock=tcp)
        self._sweeper = loop.create_task(self._sweep())
        log.info("resolver for sandboxes on %s:53 (udp, tcp), upstreams %s", self.address,
                 ", ".join(f"{h}:{p}" for h, p in self.upstreams))

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._tcp.wait_closed(), 1.0)

    def info(self) -> dict:
        return {"address": f"{self.address}:53", "upstreams": [f"{h}:{p}" for h, p in self.upstreams],
                **dict(self.stats)}

    async def _sweep(self) -> None:
        """Removes learned entries at expiry (on a worker: map updates block),
        and the rate limiter's idle buckets."""
        nxt = None
        while True:
            due = _sooner(nxt, self._learned_due)      # an entry learned meanwhile may expire first
            delay = SWEEP_S if due is None else min(SWEEP_S, max(0.0, due - time.monotonic()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            self.limiter.prune()          # the buckets of sources quiet long enough to be full again
            due = _sooner(nxt, self._learned_due)
            if due is None or due <= time.monotonic():
                # What is learned from here on is not surely in expire's answer.
                self._learned_due = None
                try:
                    nxt = await self.run_blocking(self.net.expire)
                except Exception:
                    log.exception("remove expired learned entries")
                    nxt = None

    # ------------------------------------------------------------ transports

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        src = (writer.get_extra_info("peername") or ("",))[0]
        if self._tcp_clients >= MAX_TCP_CLIENTS or self._tcp_by_src[src] >= MAX_TCP_PER_CLIENT:
            self.stats["tcp_refused"] += 1
            writer.close()
            return
        self._tcp_clients += 1
        self._tcp_by_src[src] += 1
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE_S)
                data = await asyncio.wait_for(reader.readexactly(struct.unpack("!H", head)[0]), TCP_IDLE_S)
                if not self.admit(src):
                    break                # over its rate: the connection ends unanswered
                out = await self.answer(data, src, tcp=True)
                if out is None:
                    break
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:
            log.exception("resolver: TCP client %s", src)
        finally:
            self._tcp_clients -= 1
            _release(self._tcp_by_src, src)
            writer.close()

    # ------------------------------------------------------------ answers

    def admit(self, src: str) -> bool:
        """Whether a query from `src` is within its sandbox's rate
        (net.dns_rate_per_s), checked before it is parsed: a sandbox
        flooding the resolver costs the daemon little, and the others
        keep their answers. Counted where refused."""
        if self.limiter.allow(src):
            return True
        self.stats["rate_limited"] += 1
        sb = self.net.client(src)
        if sb is not None:
            sb.dns["rate_limited"] += 1
        return False

    async def answer(self, data: bytes, src: str, tcp: bool) -> bytes | None:
        """The reply to one query from `src` (None: no reply)."""
        try:
            q = dns.message.from_wire(data)
        except Exception:
            self.stats["malformed"] += 1
            return _formerr(data)
        if q.flags & dns.flags.QR:
            return None
        sb = self.net.client(src)
        if sb is None:
            self.stats["unknown_client"] += 1
            return _reply(q, dns.rcode.REFUSED)
        sb.dns["queries"] += 1
        if q.opcode() != dns.opcode.QUERY or len(q.question) != 1:
            return _reply(q, dns.rcode.NOTIMP if q.opcode() != dns.opcode.QUERY else dns.rcode.FORMERR)
        qname = q.question[0].name.to_text(omit_final_dot=True).lower()
        # An escape in the text is a byte no host name has in a label: a dot
        # (`evil\.com\.pythonhosted.org` is one label under org, whose text
        # still ends in `.pythonhosted.org`) or an unprintable one. No rule's.
        rules = [r for r in sb.names if r.matches(qname)] if "\\" not in qname else []
        if not rules:
            sb.dns["refused"] += 1
            # The client only sees a failed lookup (glibc: "Temporary failure in
            # name resolution"); `net show` names what was refused.
            if qname in sb.refused_names:
                sb.refused_names.remove(qname)
            sb.refused_names.append(qname)
            return _reply(q, self.refuse)
        resp = await self._forward(q, data, tcp)
        if resp is None:
            sb.dns["upstream_failed"] += 1
            return _reply(q, dns.rcode.SERVFAIL)
        if resp.rcode() != dns.rcode.NOERROR:
            _trim_failed(sb, resp)
        else:
            entries = self._trim(sb, resp, rules, qname)
            if entries:
                try:
                    done = self.net.learn(sb.id, entries, blocking=False)
                    if done is None:
                        done = await self.run_blocking(self.net.learn, sb.id, entries)
                except Exception as err:
                    log.error("sandbox %s: allow the addresses of %s: %s", sb.id, qname, err)
                    done = False
                if not done:
                    return _reply(q, dns.rcode.SERVFAIL)
                sb.dns["learned"] += len(entries)
                self._learned_due = _sooner(self._learned_due, min(ln.expires for ln in entries.values()))
                self._wake.set()
        sb.dns["answered"] += 1
        try:
            return resp.to_wire(max_size=65535 if tcp else max(512, q.payload if q.edns >= 0 else 512))
        except dns.exception.TooBig:
            r = _reply(q, dns.rcode.NOERROR, wire=False)
            r.flags |= dns.flags.TC
            return r.to_wire()

    def _trim(self, sb, resp: dns.message.Message, rules: list, qname: str) -> dict:
        """Edit `resp` in place to what the sandbox may see; the entries to learn."""
        name = resp.question[0].name
        chain, cur = {name}, name
        for _ in range(MAX_CNAME + 1):
            link = next((rr for rr in resp.answer if rr.rdtype == dns.rdatatype.CNAME and rr.name == cur), None)
            if link is None:
                break
            cur = link[0].target
            chain.add(cur)
        else:
            cur = None                        # chain too long: no address of it is learned
            sb.dns["hostile_dropped"] += 1
        now = time.monotonic()
        entries: dict = {}
        kept, n = [], 0
        addr_ttl = self.ttl_max
        for rr in resp.answer:
            if rr.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA):
                if rr.name in chain:
                    kept.append(rr)
                continue
            if rr.name != cur:
                sb.dns["hostile_dropped"] += len(rr)    # an address for a name we did not ask about
                continue
            ttl = min(max(rr.ttl, self.ttl_min), self.ttl_max)
            addr_ttl = min(addr_ttl, ttl)
            good = []
            for rd in rr:
                ip = ipaddress.ip_address(rd.address)
                if self.net.is_blocked(ip):
                    sb.dns["hostile_dropped"] += 1
                    continue
                if n >= self.max_addrs:
                    sb.dns["capped"] += 1
                    continue
                n += 1
                good.append(rd)
                fam = 4 if ip.version == 4 else 6
                for r in rules:
                    entries[r.address_rule(fam, int(ip))] = Learned(now + ttl + self.grace, r, qname)
            if good:
                kept.append(dns.rrset.from_rdata_list(rr.name, ttl, good))
        for rr in kept:                       # a CNAME is not cached longer than the addresses behind it
            if rr.rdtype == dns.rdatatype.CNAME:
                rr.ttl = min(rr.ttl, addr_ttl)
        resp.answer = kept
        resp.additional = [rr for rr in resp.additional
                           if rr.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA)]
        return entries

    async def _forward(self, q: dns.message.Message, data: bytes, tcp: bool) -> dns.message.Message | None:
        """The upstreams' answer (each tried once, in order), under a fresh id; None if none answered."""
        qid = secrets.randbelow(65536)
        wire = struct.pack("!H", qid) + data[2:]
        for host, port in self.upstreams:
            try:
                raw = await asyncio.wait_for(self._ask(host, port, wire, tcp), self.timeout)
                resp = dns.message.from_wire(raw)
            except (TimeoutError, OSError, dns.exception.DNSException, struct.error) as err:
                log.debug("upstream %s:%s: %s", host, port, err)
                self.stats["upstream_errors"] += 1
                continue
            if resp.id != qid or not (resp.flags & dns.flags.QR) or resp.question != q.question:
                self.stats["upstream_mismatch"] += 1
                continue
            resp.id = q.id
            return resp
        return None

    async def _ask(self, host: str, port: int, wire: bytes, tcp: bool) -> bytes:
        loop = asyncio.get_running_loop()
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        kind = socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM
        with in_netns(self.ns_path) if self.ns_path else contextlib.nullcontext():
            s = socket.socket(fam, kind | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        with s:
            await loop.sock_connect(s, (host, port))
            if not tcp:
                await loop.sock_sendall(s, wire)
                return await loop.sock_recv(s, 65535)
            await loop.sock_sendall(s, struct.pack("!H", len(wire)) + wire)
            head = await _recv_exactly(loop, s, 2)
            return await _recv_exactly(loop, s, struct.unpack("!H", head)[0])


async def _recv_exactly(loop, s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = await loop.sock_recv(s, n - len(buf))
        if not chunk:
            raise ConnectionError("upstream closed the TCP connection mid-answer")
        buf += chunk
    return buf


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, resolver: Resolver):
        self.r = resolver
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        if not self.r.admit(addr[0]):
            return                       # as a lost datagram: the client retries later
        if self.r._inflight >= MAX_INFLIGHT or self.r._inflight_by_src[addr[0]] >= MAX_INFLIGHT_PER_CLIENT:
            self.r.stats["dropped_busy"] += 1
            return
        self.r._inflight += 1
        self.r._inflight_by_src[addr[0]] += 1
        asyncio.get_running_loop().create_task(self._one(data, addr))

    async def _one(self, data: bytes, addr) -> None:
        try:
            out = await self.r.answer(data, addr[0], tcp=False)
            if out is not None and self.transport is not None:
                self.transport.sendto(out, addr)
        except Exception:
            log.exception("resolver: query from %s", addr[0])
        finally:
            self.r._inflight -= 1
            _release(self.r._inflight_by_src, addr[0])


def _release(counts: collections.Counter, src: str) -> None:
    """One of `src`'s slots free again (no key kept for a source that holds none)."""
    counts[src] -= 1
    if counts[src] <= 0:
        del counts[src]


def _reply(q: dns.message.Message, rcode: int, wire: bool = True):
    r = dns.message.make_response(q)
    r.set_rcode(rcode)
    return r.to_wire() if wire else r


def _formerr(data: bytes) -> bytes | None:
    """FORMERR for a message whose header at least parses (else no reply)."""
    if len(data) < 12 or data[2] & 0x80:
        return None
    return data[:2] + bytes([0x80 | (data[2] & 0x79), 0x01]) + b"\0" * 8


def _sooner(a: float | None, b: float | None) -> float | None:
    """The earlier of two times, either of which may be None (no time)."""
    return b if a is None else a if b is None else min(a, b)


def _trim_failed(sb, resp: dns.message.Message) -> None:
    """A failed answer (NXDOMAIN, SERVFAIL, ...) carries no record the
    sandbox needs but the authority's SOA (how long to cache the failure):
    the rest, addresses of any name among them, is dropped and counted."""
    dropped = sum(len(rr) for rr in resp.answer + resp.authority + resp.additional
                  if rr.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA))
    sb.dns["hostile_dropped"] += dropped
    resp.answer = []
    resp.additional = []
    resp.authority = [rr for rr in resp.authority if rr.rdtype == dns.rdatatype.SOA]
