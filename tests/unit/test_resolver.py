"""The sandboxes' resolver's admission (dsecd/net/dns.py), with a stand-in
Network: no root, no sockets."""

from __future__ import annotations

import asyncio
import types

from dsecd.net import dns as D


def _resolver(rate: float = 0) -> D.Resolver:
    """A resolver with no sandbox; rate: net.dns_rate_per_s (0, no limit: the slot tests)."""
    net = types.SimpleNamespace(ipam=types.SimpleNamespace(gateway4="10.88.0.1"),
                                plumbing=types.SimpleNamespace(ns_path="", spec=types.SimpleNamespace(name="dsec0")),
                                client=lambda src: None)
    return D.Resolver(net, {"dns_upstreams": ["192.0.2.53"], "dns_rate_per_s": rate}, run_blocking=None)


class _Writer:
    def __init__(self, src: str):
        self.src, self.closed = src, False

    def get_extra_info(self, key):
        return (self.src, 4242) if key == "peername" else None

    def write(self, data) -> None:
        pass

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_one_sandbox_cannot_take_every_tcp_connection_of_the_resolver():
    """A sandbox holding idle TCP connections to the resolver leaves room
    for the others: it gets at most MAX_TCP_PER_CLIENT at once."""
    async def run():
        r = _resolver()
        readers, tasks, writers = [], [], []

        def connect(src: str) -> _Writer:
            reader, writer = asyncio.StreamReader(), _Writer(src)
            readers.append(reader)
            writers.append(writer)
            tasks.append(asyncio.ensure_future(r._tcp_client(reader, writer)))
            return writer

        hog = [connect("10.88.3.5") for _ in range(D.MAX_TCP_CLIENTS)]
        other = connect("10.88.3.6")
        await asyncio.sleep(0.01)
        held = [w for w in hog if not w.closed]
        assert len(held) == D.MAX_TCP_PER_CLIENT
        assert not other.closed                   # served: waits for its query
        assert r.stats["tcp_refused"] == D.MAX_TCP_CLIENTS - D.MAX_TCP_PER_CLIENT
        for reader in readers:
            reader.feed_eof()
        await asyncio.gather(*tasks)
        assert r._tcp_clients == 0 and not r._tcp_by_src
        connect("10.88.3.5")                      # its slots are free again
        await asyncio.sleep(0.01)
        assert not writers[-1].closed
        readers[-1].feed_eof()
        await tasks[-1]

    asyncio.run(run())


def test_one_sandbox_cannot_take_every_udp_query_slot_of_the_resolver():
    """Queries of one sandbox waiting for a slow upstream fill at most
    MAX_INFLIGHT_PER_CLIENT slots; another sandbox's query is still answered."""
    async def run():
        r = _resolver()
        release = asyncio.Event()
        answered = []

        async def answer(data, src, tcp):
            await release.wait()
            answered.append(src)
            return None

        r.answer = answer
        proto = D._UdpProtocol(r)
        for _ in range(D.MAX_INFLIGHT):
            proto.datagram_received(b"q", ("10.88.3.5", 5353))
        proto.datagram_received(b"q", ("10.88.3.6", 5353))
        assert r._inflight == D.MAX_INFLIGHT_PER_CLIENT + 1
        assert r.stats["dropped_busy"] == D.MAX_INFLIGHT - D.MAX_INFLIGHT_PER_CLIENT
        release.set()
        await asyncio.sleep(0.01)
        assert answered.count("10.88.3.6") == 1 and r._inflight == 0 and not r._inflight_by_src

    asyncio.run(run())


def test_a_source_over_its_rate_is_dropped_before_its_query_is_read():
    async def run():
        r = _resolver(rate=2)
        seen = []

        async def answer(data, src, tcp):
            seen.append(src)
            return None

        r.answer = answer
        proto = D._UdpProtocol(r)
        for _ in range(10):
            proto.datagram_received(b"q", ("10.88.3.5", 5353))
        proto.datagram_received(b"q", ("10.88.3.6", 5353))
        await asyncio.sleep(0.01)
        assert seen.count("10.88.3.5") == 4 and seen.count("10.88.3.6") == 1     # a burst of twice the rate
        assert r.stats["rate_limited"] == 6

    asyncio.run(run())


def test_a_label_holding_a_dot_is_no_name_below_a_wildcard():
    """`evil\\.com\\.pythonhosted.org` is one label under org, not a name
    below pythonhosted.org, though its text ends so: refused, upstream
    never asked. A name of the rule's, whatever its case, is forwarded."""
    import collections

    import dns.message
    import dns.name
    import dns.rcode

    from dsecd.net import rules as R

    sb = types.SimpleNamespace(names=(R.parse_rule("*.pythonhosted.org:443/tcp"),), dns=collections.Counter(),
                               refused_names=collections.deque(maxlen=8))
    r = _resolver()
    r.net.client = lambda src: sb
    asked = []

    async def forward(q, data, tcp):
        asked.append(q.question[0].name)
        return None                               # no upstream here: SERVFAIL

    r._forward = forward

    def ask(name: dns.name.Name) -> int:
        wire = dns.message.make_query(name, "A").to_wire()
        return dns.message.from_wire(asyncio.run(r.answer(wire, "10.88.3.5", tcp=False))).rcode()

    assert ask(dns.name.Name([b"evil.com.pythonhosted", b"org", b""])) == dns.rcode.REFUSED
    assert ask(dns.name.Name([b"x", b"pythonhosted.org", b""])) == dns.rcode.REFUSED
    assert asked == [] and sb.dns["refused"] == 2
    assert list(sb.refused_names) == ["evil\\.com\\.pythonhosted.org", "x.pythonhosted\\.org"]
    ask(dns.name.Name([b"evil.com.pythonhosted", b"org", b""]))      # again: the most recent last, once
    assert list(sb.refused_names) == ["x.pythonhosted\\.org", "evil\\.com\\.pythonhosted.org"]
    assert ask(dns.name.from_text("Files.PythonHosted.org")) == dns.rcode.SERVFAIL
    assert len(asked) == 1


def test_an_entry_learned_after_the_sweep_planned_its_next_expiry_goes_on_time():
    """The sweeper asked the Network for its next expiry (a long TTL, 100 s
    away); an entry learned after that with a TTL of 0.3 s must go at 0.3 s,
    not when the long one does."""
    async def run():
        r = _resolver()
        calls = []
        t0 = D.time.monotonic()

        def expire():
            calls.append(D.time.monotonic() - t0)
            return t0 + 100.0

        async def run_blocking(fn, *args):
            return fn(*args)

        r.net.expire, r.run_blocking = expire, run_blocking
        sweeper = asyncio.ensure_future(r._sweep())
        await asyncio.sleep(D.SWEEP_S + 0.1)
        assert len(calls) == 1                          # its first pass: the next expiry is 100 s away
        learned = D.time.monotonic() - t0
        r._learned_due = D._sooner(r._learned_due, t0 + learned + 0.3)     # what a learn does
        r._wake.set()
        await asyncio.sleep(0.6)
        sweeper.cancel()
        return calls, learned

    calls, learned = asyncio.run(run())
    assert len(calls) == 2 and 0.3 <= calls[1] - learned < 0.5, (calls, learned)


def test_a_failed_answer_keeps_only_its_soa():
    """An NXDOMAIN (or any failure) from the upstream leaves with no record
    but the SOA that says how long to cache it: addresses of other names,
    the gateway's or loopback among them, are dropped and counted."""
    import collections

    import dns.message
    import dns.rcode
    import dns.rrset

    q = dns.message.make_query("nope.pythonhosted.org", "A")
    resp = dns.message.make_response(q)
    resp.set_rcode(dns.rcode.NXDOMAIN)
    resp.answer.append(dns.rrset.from_text("other.test.", 60, "IN", "A", "127.0.0.1"))
    resp.authority.append(dns.rrset.from_text("pythonhosted.org.", 60, "IN", "SOA",
                                              "ns. host. 1 2 3 4 5"))
    resp.authority.append(dns.rrset.from_text("pythonhosted.org.", 60, "IN", "NS", "ns.pythonhosted.org."))
    resp.additional.append(dns.rrset.from_text("ns.pythonhosted.org.", 60, "IN", "A", "10.88.0.1"))
    sb = types.SimpleNamespace(dns=collections.Counter())
    D._trim_failed(sb, resp)
    assert resp.answer == [] and resp.additional == []
    assert [rr.rdtype for rr in resp.authority] == [dns.rdatatype.SOA]
    assert sb.dns["hostile_dropped"] == 2
    assert dns.message.from_wire(resp.to_wire()).rcode() == dns.rcode.NXDOMAIN
