"""Networking through the daemon: --net default/none, --allow, `net show`, `net set`.

The bridge lives in a test-owned netns (net.host_netns) and the fake package
index / reference-solution servers in another (test_net_kit.World); traffic
never leaves namespaces this test made.
"""

import json
import re
import subprocess
import time

import pytest
from test_net_kit import bpf_skip_reason

from dsecd.errors import BadRequest, LimitExceeded
from dsecd.journal import read_records

pytestmark = pytest.mark.skipif(bpf_skip_reason() is not None, reason=bpf_skip_reason() or "")


def _toml_net(cfg: dict) -> str:
    lines = ["[net]", 'default_mode = "none"']
    for k in ("bridge", "mtu", "host_netns", "ipv4_subnet", "ipv4_pool", "ipv6_subnet"):
        lines.append(f"{k} = {json.dumps(cfg[k])}")
    # The resolver's upstream: a test-owned address (nothing listens there unless a
    # test starts dnsmasq on it), never the host's resolvers.
    lines.append(f"dns_upstreams = {json.dumps(cfg.get('dns_upstreams', [dead_upstream(cfg)]))}")
    lines.append("[net.rule_sets]")
    for name, rules in cfg["rule_sets"].items():
        lines.append(f"{name} = {json.dumps(rules)}")
    return "\n".join(lines) + "\n"


def dead_upstream(cfg: dict) -> str:
    """An address in the World's servers netns with no resolver behind it."""
    return cfg["ipv4_subnet"].rsplit(".", 2)[0] + ".2.54"


@pytest.fixture
def netd(world, daemon_factory, busybox_rootfs):
    # The daemon's pool must not overlap the World's own Network's pool.
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.3.0/24")
    d = daemon_factory(_toml_net(cfg))
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    yield d, c
    c.close()


def connect(sb, host, port):
    r = sb.exec(["sh", "-c", f"echo ping | nc -w 2 {host} {port}"], timeout=20)
    return r.exit_code, (r.stdout + r.stderr).decode()


def test_allowlist_enforced_and_changed_live(world, netd):
    d, c = netd
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    code, out = connect(sb, world.pkg, 80)
    assert code == 0 and "srv80:ping" in out
    code, out = connect(sb, world.ref, 443)
    assert code != 0 and "not permitted" in out.lower()
    view = sb.net_show()
    assert view["lease"]["ipv4"].startswith(f"10.{world.octet}.3.")
    assert any(r["allowed"] >= 1 for r in view["rules"] if r["rule"].startswith(world.pkg))
    assert view["default"]["denied_connect"] >= 1

    sb.net_set(add=["refsol"])
    assert connect(sb, world.ref, 443)[0] == 0
    sb.net_set(remove=["refsol"])
    assert connect(sb, world.ref, 443)[0] != 0
    sb.net_set(replace=[f"{world.ref}:443/tcp"])
    assert connect(sb, world.ref, 443)[0] == 0 and connect(sb, world.pkg, 80)[0] != 0
    # A bad update changes nothing.
    with pytest.raises(BadRequest):
        sb.net_set(add=["10.0.0.0/33"])
    # Nor does one too large to parse: what it removes counts as what it adds
    # (each term is parsed under the lock every sandbox's updates share).
    with pytest.raises(LimitExceeded, match="net.max_rules_per_sandbox"):
        sb.net_set(remove=[f"10.9.{i // 256}.{i % 256}/32" for i in range(4097)])
    assert connect(sb, world.ref, 443)[0] == 0
    sb.destroy()


def test_net_none_is_loopback_only_and_bad_input(world, netd):
    d, c = netd
    sb = c.create(image="busybox")                   # default_mode = none
    assert connect(sb, world.pkg, 80)[0] != 0
    assert sb.net_show()["mode"] == "none"
    with pytest.raises(BadRequest):
        sb.net_set(add=["pypi"])
    sb.destroy()
    with pytest.raises(BadRequest):
        c.create(image="busybox", net="none", allow=["pypi"])
    with pytest.raises(BadRequest):
        c.create(image="busybox", net="default", allow=["no-such-set"])
    with pytest.raises(BadRequest):
        c.create(image="busybox", net="default", allow=["10.0.0.1:70000/tcp"])
    assert c.list() == []                            # failed creates left nothing


def test_lease_freed_on_destroy_and_kept_across_restart(world, netd):
    import signal

    d, c = netd
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    ip = sb.net_show()["lease"]["ipv4"]
    c.close()
    d.stop(signal.SIGTERM)
    d.start()
    c2 = d.client()
    s2 = c2.get(sb.id)
    assert s2.net_show()["lease"]["ipv4"] == ip
    assert connect(s2, world.pkg, 80)[0] == 0 and connect(s2, world.ref, 443)[0] != 0
    # Its own addresses stay as its loopback: refused (nothing listens), not denied.
    for own in (ip, s2.net_show()["lease"]["ipv6"]):
        assert "refused" in connect(s2, own.split("/")[0], 9)[1], own
    s2.destroy()
    assert sb.id not in read_records(d.state / "net" / "records.log")     # lease and record gone
    c2.close()


@pytest.mark.attack
def test_a_sandbox_whose_address_left_the_pool_is_cut_off_at_restart(world, netd, probe_binary):
    """net.ipv4_pool changed while a sandbox ran on: its address is outside
    the pool's fence now, where another sandbox's broad rule would reach it,
    and its lease would be an address its eth0 does not have. It keeps
    loopback only, as a microVM whose address was lost does."""
    import signal

    from attack_kit import install_probe, outcome

    d, c = netd
    a = c.create(image="busybox", memory="64M", net="default")
    old = a.net_show()["lease"]["ipv4"].split("/")[0]
    install_probe(a, probe_binary)
    c.close()
    d.stop(signal.SIGTERM)
    d.config.write_text(d.config.read_text().replace(f"10.{world.octet}.3.0/24", f"10.{world.octet}.4.0/24"))
    d.start()
    c = d.client()
    try:
        a = c.get(a.id)
        assert "inet " not in a.exec(["ip", "-4", "addr", "show"]).stdout.decode().replace("inet 127.", ""), \
            "the sandbox kept an address outside net.ipv4_pool"
        assert "lost its networking across the restart" in d.log.read_text()
        # And whoever lists the sandboxes or follows the events is told too.
        assert f"{a.id}" in (ps := d.cli("ps").stdout.decode()) and "running, net lost" in ps, ps
        events = [json.loads(ln) for ln in d.cli("events", "--replay", "--no-follow", "--json").stdout.splitlines()]
        assert [e["event"] for e in events if e["sandbox"] == a.id] == ["net_lost"], events
        lost = json.loads(d.cli("inspect", a.id).stdout)["net"]["lost"]
        assert "could not be re-adopted" in lost and "it keeps loopback only" in lost, lost   # its veth is gone
        shown = d.cli("net", "show", a.id)
        assert shown.returncode == 1 and b"could not be re-adopted" in shown.stderr, shown
        b = c.create(image="busybox", memory="64M", net="default", allow=["0.0.0.0/0:7777/tcp"])
        install_probe(b, probe_binary)
        _listen(a, 7777)
        assert outcome(b, "connect", old, "7777") != "ok"
    finally:
        c.destroy_all(force=True)
        c.close()


def echo_server(sb, port: int, timeout: float = 20.0) -> None:
    """One connection's echo (busybox nc -e cat) on `port` of the sandbox,
    listening once this returns."""
    sb.exec(["sh", "-c", f"setsid nc -l -p {port} -e cat </dev/null >/dev/null 2>&1 &"])
    deadline = time.monotonic() + timeout
    while sb.exec(["sh", "-c", f"netstat -ltn | grep -q ':{port} '"]).exit_code != 0:
        assert time.monotonic() < deadline, "nc did not listen"
        time.sleep(0.05)


def _recv_line(conn) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            break
        data += chunk
    return data


def test_a_connection_the_sandbox_accepted_goes_on_across_a_restart(world, netd):
    """The answers of a connection made to the sandbox pass its allowlist by a
    mark the kernel's passive open leaves in a BPF map; the restarted daemon's
    programs use a map of their own, into which it copies the marks."""
    import signal
    import socket

    d, c = netd
    sb = c.create(image="busybox", net="default")          # lets nothing out
    ip = sb.net_show()["lease"]["ipv4"].split("/")[0]
    echo_server(sb, 9000)
    conn = world.in_bridge_netns(lambda: socket.create_connection((ip, 9000), timeout=5))
    try:
        conn.sendall(b"before\n")
        assert _recv_line(conn) == b"before\n"
        c.close()
        d.stop(signal.SIGTERM)
        d.start()
        c = d.client()
        conn.sendall(b"after\n")
        assert _recv_line(conn) == b"after\n"
    finally:
        conn.close()
    c.get(sb.id).destroy()
    c.close()


def _bridge_mac(world) -> str:
    out = subprocess.run(["ip", "-n", world.br_ns, "-j", "link", "show", world.cfg["bridge"]],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]["address"]


def test_bridge_mac_stays_when_a_port_with_a_lower_mac_comes_and_goes(world, netd):
    """A Linux bridge with no MAC of its own takes its ports' lowest; a sandbox that
    cached the gateway's MAC would then send into a port. The daemon pins it."""
    d, c = netd
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    assert connect(sb, world.pkg, 80)[0] == 0                  # caches the gateway's MAC
    before = _bridge_mac(world)
    ns = ["ip", "-n", world.br_ns]
    subprocess.run([*ns, "link", "add", "dtlow0", "address", "02:00:00:00:00:01", "type", "veth",
                    "peer", "name", "dtlow1"], check=True)
    try:
        subprocess.run([*ns, "link", "set", "dtlow0", "master", world.cfg["bridge"], "up"], check=True)
        assert _bridge_mac(world) == before
    finally:
        subprocess.run([*ns, "link", "del", "dtlow0"], check=True)
    assert _bridge_mac(world) == before
    assert connect(sb, world.pkg, 80)[0] == 0
    sb.destroy()


def _listen(sb, port: int, timeout: float = 20.0) -> None:
    """A one-shot listener (attack-probe) on `port` of all the sandbox's
    addresses, up once this returns. The exec returns as soon as the shell
    has put the listener in the background, which may be before the
    background shell has even made its output file (in a microVM under TCG,
    notably)."""
    import time

    from dsecd.errors import NotFound

    sb.exec(["sh", "-c", f"setsid attack-probe listen {port} </dev/null >/tmp/listen.out 2>&1 &"])
    deadline = time.monotonic() + timeout
    out = b""
    while time.monotonic() < deadline:
        try:
            out = sb.read_file("/tmp/listen.out")
        except NotFound:
            out = b""
        if b"listening" in out:
            return
        time.sleep(0.05)
    pytest.fail(f"the listener on port {port} did not start within {timeout:.0f} s: {out[-300:]!r}")


@pytest.mark.attack
def test_sandbox_cannot_reach_another_sandbox_or_the_bridge(world, netd, probe_binary):
    """Adversarial suite (docs/hardening.md): with networking on, a sandbox's
    egress allowlist keeps it off its neighbours and the host side of the bridge."""
    from attack_kit import install_probe, outcome

    d, c = netd
    a = c.create(image="busybox", memory="64M", net="default", allow=["pypi"])
    b = c.create(image="busybox", memory="64M", net="default", allow=["pypi"])
    for sb in (a, b):
        install_probe(sb, probe_binary)
    b_ip = b.net_show()["lease"]["ipv4"]
    gateway = world.cfg["ipv4_subnet"].rsplit(".", 2)[0] + ".0.1"
    _listen(b, 7777)
    assert outcome(a, "connect", world.pkg, "80") == "ok"             # neighbour: its allowlist works
    assert outcome(a, "connect", b_ip, "7777") == "EPERM"             # not on A's allowlist
    assert outcome(a, "connect", gateway, "22") == "EPERM"            # nor the host side of the bridge
    assert outcome(a, "socket", "raw_icmp") == "EPERM"                # no raw packets to go around it
    assert outcome(b, "connect", "127.0.0.1", "7777") == "ok"         # B's one-shot listener was up
    c.destroy_all(force=True)


def _link_local(lines: str) -> str:
    """The fe80:: address in `ip -6 addr` output."""
    return re.search(r"inet6 (fe80::[0-9a-f:]+)/64", lines).group(1)


@pytest.mark.attack
def test_a_broad_rule_reaches_no_link_local_multicast_or_broadcast_address(world, netd, probe_binary):
    """`[::/0]:7777` and `0.0.0.0/0:7777` are the internet's port 7777. Every
    interface on the bridge has a link-local address (the host's bridge, each
    sandbox's eth0), and a datagram to a multicast group or a broadcast address
    reaches the host and every sandbox at once: none of them is the internet,
    so only a rule naming them opens them."""
    from attack_kit import install_probe, outcome

    d, c = netd
    a = c.create(image="busybox", memory="64M", net="default",
                 allow=["[::/0]:7777/tcp", "[::/0]:7777/udp", "0.0.0.0/0:7777/udp"])
    b = c.create(image="busybox", memory="64M", net="default")
    install_probe(a, probe_binary)
    ip6 = ["ip", "-6", "addr", "show", "dev"]
    bridge_ll = _link_local(world.in_bridge_netns(
        lambda: subprocess.run([*ip6, "dsec0"], capture_output=True, text=True, check=True).stdout))
    b_ll = _link_local(b.exec([*ip6, "eth0"], timeout=20).stdout.decode())
    subnet_broadcast = world.subnet.replace(".0.0/16", ".255.255")
    assert outcome(a, "connect", world.pkg6, "7777") == "ECONNREFUSED"    # the rule works: nobody listens
    assert outcome(a, "udp", world.pkg, "7777") == "ok"
    assert outcome(a, "connect", f"{bridge_ll}%eth0", "7777") == "EPERM"  # the host, by its link-local address
    assert outcome(a, "connect", f"{b_ll}%eth0", "7777") == "EPERM"       # another sandbox, by its own
    for dest in (f"{bridge_ll}%eth0", "ff02::1%eth0", "224.0.0.1", "255.255.255.255", subnet_broadcast):
        assert outcome(a, "udp", dest, "7777") == "EPERM", dest
    a.net_set(add=["fe80::/10"])                                            # named: open
    assert outcome(a, "connect", f"{bridge_ll}%eth0", "7777") == "ECONNREFUSED"
    c.destroy_all(force=True)


@pytest.mark.attack
def test_a_broad_ipv6_rule_reaches_no_subnet_router_anycast_of_the_host(world, netd, probe_binary):
    """A host that forwards IPv6 answers the subnet-router anycast address
    of each of its prefixes (the prefix with an all-zero interface id, here
    the bridge's own fd00:x::) as one of its own: a UDP service of the host
    bound to every address gets a datagram sent there. `[::/0]:7777/udp` is
    the internet's port 7777, not the host's."""
    import socket

    from attack_kit import install_probe, outcome

    d, c = netd
    forwarding = ["ip", "netns", "exec", world.br_ns, "sysctl", "-qw"]
    subprocess.run([*forwarding, "net.ipv6.conf.all.forwarding=1"], check=True)

    host_service = world.host_udp_service(7777, socket.AF_INET6)
    try:
        sb = c.create(image="busybox", memory="64M", net="default", allow=["[::/0]:7777/udp"])
        install_probe(sb, probe_binary)
        anycast = world.subnet6.split("/")[0]
        assert outcome(sb, "udp", anycast, "7777") == "EPERM"
        with pytest.raises(TimeoutError):
            host_service.recvfrom(100)
        assert outcome(sb, "udp", world.pkg6, "7777") == "ok"            # the rule itself works
        assert anycast in c.info()["net"]["fences"]["host_addresses"]
    finally:
        host_service.close()
        subprocess.run([*forwarding, "net.ipv6.conf.all.forwarding=0"], check=True)
        c.destroy_all(force=True)


@pytest.mark.attack
def test_the_host_side_of_a_point_to_point_address_is_fenced(world, netd, probe_binary):
    """An address with a peer (a tunnel's: `ip addr add A peer B`) is the
    host's A; B is the other end. A broad rule reaches the host's services
    at A no more than at its other addresses."""

    from attack_kit import install_probe, outcome

    d, c = netd
    local, peer = "192.0.2.1", "192.0.2.2"
    ip = ["ip", "-n", world.br_ns]
    subprocess.run([*ip, "link", "add", "dsecptp0", "type", "veth", "peer", "name", "dsecptp1"], check=True)
    try:
        subprocess.run([*ip, "addr", "add", local, "peer", f"{peer}/32", "dev", "dsecptp0"], check=True)
        subprocess.run([*ip, "link", "set", "dsecptp0", "up"], check=True)

        host_service = world.host_udp_service(7777)
        try:
            sb = c.create(image="busybox", memory="64M", net="default", allow=["0.0.0.0/0:7777/udp"])
            install_probe(sb, probe_binary)
            assert outcome(sb, "udp", local, "7777") == "EPERM"
            with pytest.raises(TimeoutError):
                host_service.recvfrom(100)
            assert local in c.info()["net"]["fences"]["host_addresses"]
        finally:
            host_service.close()
    finally:
        subprocess.run([*ip, "link", "del", "dsecptp0"], check=True)
        c.destroy_all(force=True)


@pytest.mark.attack
def test_a_rule_naming_the_pool_reaches_no_broadcast_of_the_host(world, daemon_factory, busybox_rootfs,
                                                                  probe_binary):
    """With the pool the whole subnet (the default), a rule naming it
    (`10.x.0.0/16:7777/udp`, to let sandboxes talk) reaches the sandboxes,
    not the host: neither the gateway nor the subnet's broadcast, which the
    host (and every sandbox) takes as its own."""

    from attack_kit import install_probe, outcome

    d = daemon_factory(_toml_net(dict(world.cfg, ipv4_pool="")))
    c = d.client()

    host_service = world.host_udp_service(7777)
    try:
        c.import_image(busybox_rootfs, "busybox")
        a = c.create(image="busybox", memory="64M", net="default", allow=[f"{world.subnet}:7777/udp"])
        b = c.create(image="busybox", memory="64M", net="default")
        install_probe(a, probe_binary)
        broadcast = world.subnet.replace(".0.0/16", ".255.255")
        assert outcome(a, "udp", broadcast, "7777") == "EPERM"
        assert outcome(a, "udp", f"10.{world.octet}.0.1", "7777") == "EPERM"
        with pytest.raises(TimeoutError):
            host_service.recvfrom(100)
        assert outcome(a, "udp", b.net_show()["lease"]["ipv4"].split("/")[0], "7777") == "ok"
    finally:
        host_service.close()
        c.destroy_all(force=True)
        c.close()


def test_kill9_after_net_set_keeps_rule_and_restart_compiles_nothing(world, netd):
    """An answered net_set is in the record log (one write(2) to an open fd, in the
    page cache before the answer): a kill -9 right after it loses nothing. The
    restart loads the BPF object the first start cached: no compile."""
    import signal

    d, c = netd
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    first = c.info()["net"]["bpf"]
    assert first["object"] in ("compiled", "cached")
    sb.net_set(add=["refsol"])
    d.stop(signal.SIGKILL)
    c.close()
    d.start()
    c2 = d.client()
    try:
        s2 = c2.get(sb.id)
        assert s2.net_show()["terms"] == ["pypi", "refsol"]
        assert connect(s2, world.ref, 443)[0] == 0            # the re-adopted policy has it
        bpf = c2.info()["net"]["bpf"]
        assert bpf["object"] == "cached" and "compile_ms" not in bpf and bpf["path"] == first["path"]
        s2.destroy()
    finally:
        c2.close()


def _net_available(c, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while True:
        avail = c.info()["net"]["available"]
        if avail is not None or time.monotonic() > deadline:
            return avail
        time.sleep(0.05)


def test_a_start_where_the_bridge_exists_builds_networking_in_the_background(world, daemon_factory):
    """The World's bridge is there: the daemon builds its Network (and pool) without
    waiting for a create; with net.preload off it waits for the first create."""
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.3.0/24")
    c = daemon_factory(_toml_net(cfg)).client()
    assert _net_available(c, 20) is True
    deadline = time.monotonic() + 30        # `starting` says what is still under way, until it is done
    while (starting := c.info()["net"].get("starting")) and time.monotonic() < deadline:
        assert set(starting) <= {"loading the BPF programs", "building the network", "filling the netns pool"}
        time.sleep(0.05)
    net = c.info()["net"]
    assert "starting" not in net and net["pool"]["ready"] == net["pool"]["size"] > 0
    c.close()
    lazy = daemon_factory(_toml_net(cfg).replace("[net]\n", "[net]\npreload = false\n")).client()
    assert _net_available(lazy, 1.0) is None
    assert "starting" not in lazy.info()["net"]          # preload off: nothing runs in the background
    lazy.close()


def test_a_create_failing_after_its_network_was_attached_gives_it_back(world, daemon_factory, busybox_rootfs,
                                                                      tmp_path):
    """An image whose /etc/hosts is a directory fails its create after the
    network was attached (the hosts file cannot be written): the lease,
    slot and policy go with it, so a pool of 8 addresses serves 9 such
    creates and then a good one."""
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.3.0/29")
    d = daemon_factory(_toml_net(cfg))
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        bad = tmp_path / "rootfs"
        subprocess.run(["cp", "-a", str(busybox_rootfs), str(bad)], check=True)
        (bad / "etc" / "hosts").unlink(missing_ok=True)
        (bad / "etc" / "hosts").mkdir()
        c.import_image(str(bad), "hosts-dir")
        for _ in range(9):
            with pytest.raises(Exception, match="/etc/hosts"):
                c.create(image="hosts-dir", net="default")
        sb = c.create(image="busybox", net="default")
        assert sb.net_show()["lease"]["ipv4"].startswith(f"10.{world.octet}.3.")
        sb.destroy()
        assert c.list() == []
    finally:
        c.close()
