"""The sandboxes' resolver and name rules, through the daemon.

Upstream is Debian's dnsmasq, started by the test in the World's servers netns
on an address of its own (dns_kit); the daemon reaches it only through its
config (net.dns_upstreams). Every name and address is test-owned; nothing
leaves the namespaces the test made.
"""

import contextlib
import os
import secrets
import socket
import time

import dns.message
import pytest
from attack_kit import PROBE_IN_SANDBOX, install_probe, outcome
from dns_kit import Dnsmasq, addresses, dns_config, nslookup
from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns
from test_net_daemon import _toml_net, connect
from test_net_kit import bpf_skip_reason, lo_up

from dsecd.net.plumbing import netlink_socket

pytestmark = pytest.mark.skipif(bpf_skip_reason() is not None or Dnsmasq.missing() is not None,
                                reason=bpf_skip_reason() or Dnsmasq.missing() or "")


@pytest.fixture(scope="module")
def upstream(world):
    d = Dnsmasq(world)
    yield d
    d.stop()


@pytest.fixture
def dnsd(world, upstream, daemon_factory, busybox_rootfs):
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.3.0/24", rule_sets={}, dns_upstreams=[upstream.address])
    d = daemon_factory(_toml_net(cfg).replace("[net.rule_sets]", dns_config(upstream) + "[net.rule_sets]"))
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    yield d, c
    c.close()


def test_resolv_conf_and_refused_names(world, dnsd):
    d, c = dnsd
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    gw = f"10.{world.octet}.0.1"
    assert sb.read_file("/etc/resolv.conf").decode().split() == ["nameserver", gw]
    # A name outside the set: refused, without an address, and counted.
    code, out = nslookup(sb, "other.test")
    assert code != 0 and "REFUSED" in out, out
    view = sb.net_show()
    assert view["dns"]["refused"] >= 1 and view["learned"] == []
    # A refused name looks like an outage to the client ("Temporary failure in
    # name resolution"): `net show` says which names were refused, and what to do.
    assert view["dns"]["refused_names"] == ["other.test"]
    shown = d.cli("net", "show", sb.id).stdout.decode()
    assert "refused names: other.test" in shown and f"dsec net set {sb.id} --add" in shown, shown
    # Its address stays closed, also after the refused query.
    assert connect(sb, world.ref, 443)[0] != 0
    # The resolver's port is the only thing open on the gateway.
    assert connect(sb, gw, 22)[0] != 0
    sb.destroy()


def test_a_sandbox_resolves_its_own_hostname_and_snapshots_keep_none_of_it(world, dnsd):
    """Its /etc/hosts names its hostname on its address (Ray, torch.distributed
    and MPI resolve gethostname() with no DNS record for it), as docker's
    does; that file and /etc/resolv.conf are the sandbox's, not its image's:
    a snapshot leaves them out."""
    d, c = dnsd
    sb = c.create(image="busybox", net="default", hostname="worker-3")
    try:
        ip = sb.info["net"]["lease"]["ipv4"].split("/")[0]
        hosts = sb.read_file("/etc/hosts").decode().splitlines()
        assert f"{ip}\tworker-3" in hosts and "127.0.0.1\tlocalhost" in hosts, hosts
        sb.exec(["sh", "-c", "echo kept > /etc/kept"])
        sb.snapshot("net-snap")
    finally:
        sb.destroy()
    with c.sandbox(image="net-snap") as plain:            # --net none: nothing written for it
        assert plain.read_file("/etc/kept") == b"kept\n"
        assert plain.read_file("/etc/hosts") == b"127.0.0.1\tlocalhost\n::1\tlocalhost\n"     # the image's
        assert not plain.exists("/etc/resolv.conf")


def test_nxdomain_mode(world, upstream, daemon_factory, busybox_rootfs):
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.4.0/24", rule_sets={}, dns_upstreams=[upstream.address])
    extra = dns_config(upstream) + 'dns_refuse = "nxdomain"\n'
    d = daemon_factory(_toml_net(cfg).replace("[net.rule_sets]", extra + "[net.rule_sets]"))
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    code, out = nslookup(sb, "other.test")
    assert code != 0 and "NXDOMAIN" in out, out
    c.close()


def test_learned_addresses_stop_at_max_rules_per_sandbox(world, upstream, daemon_factory, busybox_rootfs):
    """Past net.max_rules_per_sandbox learned addresses an answer is SERVFAIL,
    and `net show` says why (the trie is every sandbox's)."""
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.5.0/24", rule_sets={}, dns_upstreams=[upstream.address])
    extra = dns_config(upstream) + "max_rules_per_sandbox = 4\n"
    d = daemon_factory(_toml_net(cfg).replace("[net.rule_sets]", extra + "[net.rule_sets]"))
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", net="default", allow=["*.pythonhosted.org:443/tcp"])
    assert len(addresses(nslookup(sb, "big.pythonhosted.org")[1])) == 4      # 4 learned: the cap
    code, out = nslookup(sb, "files.pythonhosted.org")
    assert code != 0 and "SERVFAIL" in out, out
    view = sb.net_show()
    assert len(view["learned"]) == 4 and view["dns"]["learned_full"] >= 1, view
    shown = d.cli("net", "show", sb.id).stdout.decode()
    assert "answers over the learned cap (net.dns_max_learned for the sandbox" in shown, shown
    c.close()


def test_a_sandbox_flooding_the_resolver_is_held_to_its_rate(world, upstream, daemon_factory, busybox_rootfs,
                                                             probe_binary):
    """Past net.dns_rate_per_s (twice that at once) a sandbox's datagrams to
    the resolver go unanswered, before they are parsed, counted and said by
    `net show`; another sandbox's queries are answered meanwhile."""
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.6.0/24", rule_sets={}, dns_upstreams=[upstream.address])
    extra = dns_config(upstream) + "dns_rate_per_s = 5\n"
    d = daemon_factory(_toml_net(cfg).replace("[net.rule_sets]", extra + "[net.rule_sets]"))
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    flood = c.create(image="busybox", net="default", allow=["pypi"])
    calm = c.create(image="busybox", net="default", allow=["pypi"])
    install_probe(flood, probe_binary)
    gw = f"10.{world.octet}.0.1"
    r = flood.exec(["sh", "-c", f"i=0; while [ $i -lt 100 ]; do {PROBE_IN_SANDBOX} udp {gw} 53 >/dev/null; "
                                "i=$((i+1)); done"], timeout=60)
    assert r.exit_code == 0, r
    dns = flood.net_show()["dns"]
    assert dns["rate_limited"] >= 50, dns
    assert addresses(nslookup(calm, "pypi.org")[1]), calm.net_show()["dns"]
    assert calm.net_show()["dns"]["rate_limited"] == 0
    shown = d.cli("net", "show", flood.id).stdout.decode()
    assert "over net.dns_rate_per_s went unanswered" in shown, shown
    c.close()


@pytest.mark.attack
def test_a_resolver_that_did_not_start_opens_nothing_on_the_gateway(world, daemon_factory, busybox_rootfs,
                                                                     probe_binary):
    """Something of the host listens on port 53 of every address (a host's own
    dnsmasq): the resolver cannot bind the gateway's. Gateway:53 is open to
    sandboxes for dsecd's resolver; what listens there now is not it, and a
    sandbox reaches it no more than any other service of the host."""
    host_service = world.host_udp_service(53)
    try:
        cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.7.0/24", rule_sets={})
        d = daemon_factory(_toml_net(cfg))
        c = d.client()
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", net="default")
        install_probe(sb, probe_binary)
        assert "did not start" in d.cli("net", "show", sb.id).stdout.decode() or \
            "error" in c.info()["net"]["dns"], c.info()["net"]
        gw = f"10.{world.octet}.0.1"
        assert outcome(sb, "udp", gw, "53") == "EPERM"
        with pytest.raises(TimeoutError):
            host_service.recvfrom(100)
        c.destroy_all(force=True)
        c.close()
    finally:
        host_service.close()


def test_name_rule_allows_after_resolution_and_expires(world, dnsd):
    d, c = dnsd
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    # Not before the sandbox resolved the name: knowing the address is not enough.
    assert connect(sb, world.pkg, 443)[0] != 0
    code, out = nslookup(sb, "pypi.org")
    assert code == 0 and world.pkg in out, out
    t_answer = time.monotonic()
    code, out = connect(sb, world.pkg, 443)
    assert code == 0 and "srv443:ping" in out, out
    assert connect(sb, world.pkg, 80)[0] != 0            # only the rule's port
    # By name, through the C library's resolver (getaddrinfo) too.
    code, out = connect(sb, "pypi.org", 443)
    assert code == 0 and "srv443:ping" in out, out
    view = sb.net_show()
    learned = [x for x in view["learned"] if x["name"] == "pypi.org"]
    assert [x["rule"] for x in learned] == [f"{world.pkg}:443/tcp"], view["learned"]
    assert learned[0]["expires_in"] <= 2 + 1 + 0.5         # dnsmasq's TTL 2 + grace 1
    assert view["dns"]["learned"] >= 1
    # TTL 2 + grace 1 (sweep <= 1 s late): gone, and the connect is refused again.
    deadline = t_answer + 10
    while sb.net_show()["learned"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sb.net_show()["learned"] == []
    assert time.monotonic() - t_answer >= 2.5
    assert connect(sb, world.pkg, 443)[0] != 0
    assert sb.net_show()["dns"]["expired"] >= 1
    sb.destroy()


def test_wildcard_cname_chain(world, dnsd):
    d, c = dnsd
    sb = c.create(image="busybox", net="default", allow=["*.pythonhosted.org:443/tcp"])
    # cdn.pythonhosted.org -> a.fastly.test -> b.fastly.test -> A ref: allowed (the queried name is).
    code, out = nslookup(sb, "cdn.pythonhosted.org")
    assert code == 0 and world.ref in out, out
    assert connect(sb, world.ref, 443)[0] == 0
    # The chain's target asked for directly is not allowed.
    code, out = nslookup(sb, "b.fastly.test")
    assert code != 0 and "REFUSED" in out, out
    # A chain longer than the resolver follows gives no address.
    code, out = nslookup(sb, "long.pythonhosted.org")
    assert addresses(out) == [], out
    assert all(x["name"] != "long.pythonhosted.org" for x in sb.net_show()["learned"])
    # pythonhosted.org itself is not below *.pythonhosted.org.
    assert "REFUSED" in nslookup(sb, "pythonhosted.org")[1]
    sb.destroy()


def test_hostile_answers_change_nothing(world, dnsd):
    d, c = dnsd
    sb = c.create(image="busybox", net="default", allow=["*.pythonhosted.org:443/tcp"])
    gw = f"10.{world.octet}.0.1"
    before = sb.net_show()
    names = ("loop.pythonhosted.org", "gw.pythonhosted.org", "nbr.pythonhosted.org", "ll.pythonhosted.org",
             "meta.pythonhosted.org")
    for name in names:
        code, out = nslookup(sb, name)
        assert addresses(out) == [], out
    view = sb.net_show()
    assert view["learned"] == [] and [r["rule"] for r in view["rules"]] == [r["rule"] for r in before["rules"]]
    assert view["dns"]["hostile_dropped"] == len(names), view["dns"]
    assert connect(sb, gw, 443)[0] != 0
    # A huge answer: at most dns_max_addrs_per_answer (4) addresses kept and learned.
    code, out = nslookup(sb, "big.pythonhosted.org")
    view = sb.net_show()
    assert len([x for x in view["learned"] if x["name"] == "big.pythonhosted.org"]) == 4
    assert view["dns"]["capped"] == 6
    # A huge TTL is clamped to dns_ttl_max_s (60) + grace (1).
    nslookup(sb, "huge.pythonhosted.org")
    ttl = [x["expires_in"] for x in sb.net_show()["learned"] if x["name"] == "huge.pythonhosted.org"]
    assert ttl and max(ttl) <= 61
    sb.destroy()


def test_dns_over_tcp_and_sets_listed(world, dnsd):
    d, c = dnsd
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    # busybox has no TCP DNS client: the probe asks over TCP with a hand-made query.
    q = ("\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00"
         "\\x04pypi\\x03org\\x00\\x00\\x01\\x00\\x01")
    gw = f"10.{world.octet}.0.1"
    r = sb.exec(["sh", "-c", f"printf '\\x00\\x1a{q}' | nc -w 2 {gw} 53 | od -An -tx1"], timeout=20)
    octets = "".join(world.pkg.split("."))
    hexes = r.stdout.decode().split()
    assert hexes[:2] == ["00", "2a"] or len(hexes) > 20, r
    assert [int(h, 16) for h in hexes[-4:]] == [int(o) for o in world.pkg.split(".")], (hexes, octets)
    assert connect(sb, world.pkg, 443)[0] == 0
    sets = {s["name"]: s["rules"] for s in c.net_sets()}
    assert sets["pypi"] == ["pypi.org:443/tcp", "files.pythonhosted.org:443/tcp"]
    assert {"github", "huggingface", "npm", "debian"} <= set(sets)
    sb.destroy()


def test_sdk_network_rules_dict(world, dnsd):
    d, c = dnsd
    sb = c.create(image="busybox", net="default", network_rules={"pypi": True, "*.fastly.test:443/tcp": True,
                                                                  "files.pythonhosted.org:443/tcp": False})
    assert sb.net_show()["terms"] == ["pypi", "*.fastly.test:443/tcp"]
    sb.destroy()


def _spoofer(world, address: str, gw: str) -> str:
    """A netns of the test linked to the bridge's netns by a veth that is no
    port of the bridge, holding `address` (a sandbox's lease) with a route to
    the gateway through that veth: a host on another interface of the host
    side that sends with a sandbox's source address. Removed with the World."""
    ns = f"{world.prefix}-spf{secrets.token_hex(2)}"
    pr_netns.create(ns)
    world.netns.append(ns)
    lo_up(f"/run/netns/{ns}")
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        with IPRoute(fileno=netlink_socket(f"/run/netns/{world.br_ns}").detach(), groups=0) as ipr:
            name = f"spf{secrets.token_hex(3)}"
            ipr.link("add", ifname=name, kind="veth", peer={"ifname": "eth0", "net_ns_fd": fd})
            ipr.link("set", index=ipr.link_lookup(ifname=name)[0], state="up")
    finally:
        os.close(fd)
    with IPRoute(fileno=netlink_socket(f"/run/netns/{ns}").detach(), groups=0) as ipr:
        idx = ipr.link_lookup(ifname="eth0")[0]
        ipr.addr("add", index=idx, address=address, prefixlen=32)
        ipr.link("set", index=idx, state="up")
        ipr.route("add", dst=f"{gw}/32", oif=idx, scope=253)        # RT_SCOPE_LINK
    return ns


@pytest.mark.attack
def test_a_query_with_a_sandbox_address_from_another_interface_is_not_the_sandbox_s(world, dnsd):
    """The resolver takes a query's source address for its sandbox's
    identity, which holds only on the bridge: a query carrying a sandbox's
    address that arrives on another interface of the host side is not the
    sandbox's. It gets no answer, and the sandbox learns nothing from it and
    is charged nothing for it."""
    d, c = dnsd
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    ip = sb.info["net"]["lease"]["ipv4"].split("/")[0]
    gw = f"10.{world.octet}.0.1"
    ns = _spoofer(world, ip, gw)
    # A socket of the host side on another port: it shows that datagrams from
    # `ip` through the spoofer's veth do reach the bridge's netns, and when.
    control = world.host_udp_service(5399)

    def spoof() -> list:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((ip, 0))
        s.settimeout(1)
        for name in ("other.test", "pypi.org"):
            s.sendto(dns.message.make_query(name, "A").to_wire(), (gw, 53))
        answers = []
        with contextlib.suppress(TimeoutError, ConnectionRefusedError):
            answers.append(s.recv(512))
        s.sendto(b"after the queries", (gw, 5399))
        s.close()
        return answers

    try:
        assert world.in_netns(ns, spoof) == []
        data, (src, _) = control.recvfrom(100)        # so the queries are in the resolver's socket too
        assert (data, src) == (b"after the queries", ip)
    finally:
        control.close()
    # The sandbox's own queries come after them and are its own.
    code, out = nslookup(sb, "files.pythonhosted.org")
    assert code == 0 and world.pkg in out, out
    assert "REFUSED" in nslookup(sb, "own.test")[1]
    view = sb.net_show()
    assert view["dns"]["refused_names"] == ["own.test"], view["dns"]
    assert [x["name"] for x in view["learned"]] == ["files.pythonhosted.org"], view["learned"]


def test_learned_addresses_cannot_fill_the_trie_every_sandbox_shares(world, daemon_factory, busybox_rootfs):
    """One sandbox resolving many names of a zone whose names map to any
    address stops learning well before the BPF trie every sandbox's policy
    lives in is full: the others' creates and rule changes still fit, and
    `net show` says why its answers went SERVFAIL."""
    o = world.octet
    fill = Dnsmasq(world, records={f"n{i}.fill.test": f"10.{o}.10.{i}" for i in range(1, 151)},
                   address=f"10.{o}.2.55")
    try:
        cfg = dict(world.cfg, ipv4_pool=f"10.{o}.11.0/24", rule_sets={}, dns_upstreams=[fill.address])
        extra = dns_config(fill) + "max_prefixes = 128\n"
        # A trie that small holds a learned address a sandbox for 32 of them
        # (--check-config refuses it for more): 8 reserve 2 each.
        d = daemon_factory(_toml_net(cfg).replace("[net.rule_sets]", extra + "[net.rule_sets]")
                           + "[limits]\nmax_sandboxes = 8\n")
        c = d.client()
        c.import_image(busybox_rootfs, "busybox")
        greedy = c.create(image="busybox", net="default", allow=["*.fill.test:443/tcp"])
        r = greedy.exec(["sh", "-c", "i=1; while [ $i -le 150 ]; do nslookup n$i.fill.test >/dev/null 2>&1; "
                                     "i=$((i+1)); done"], timeout=300)
        assert r.exit_code == 0, r
        view = greedy.net_show()
        assert view["dns"]["learned_full"] >= 1 and len(view["learned"]) <= 128 // 4, \
            (len(view["learned"]), view["dns"])
        shown = d.cli("net", "show", greedy.id).stdout.decode()
        assert "answers over the learned cap" in shown, shown
        assert c.info()["net"]["dns"]["learned"] == {"live": len(view["learned"]), "budget": 32,
                                                     "per_sandbox": 256, "reserved_per_sandbox": 2,
                                                     "shared": 16}
        others = [c.create(image="busybox", net="default", allow=[f"10.{o}.12.{i}:443/tcp"]) for i in (1, 2)]
        for sb in others:
            sb.net_set(add=[f"10.{o}.13.{i}:80/tcp" for i in range(1, 6)])
        c.destroy_all(force=True)
        c.close()
    finally:
        fill.stop()
