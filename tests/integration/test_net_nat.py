"""Egress NAT (net.uplink) and published ports, through the daemon.

The daemon's host side is a test-owned bridge netns; its uplink is a veth
into a test-owned "internet" netns (test_net_kit.World.add_internet). No
traffic, route or rule ever touches the host's own interfaces or ruleset:
the test checks the host's ruleset is the same before and after.
"""

import contextlib
import ipaddress
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
from test_net_daemon import _toml_net
from test_net_kit import World, bpf_skip_reason

from dsecd.errors import BadRequest, DsecError
from dsecd.net.nat import PortClaims
from dsecd.net.plumbing import netns_path

pytestmark = pytest.mark.skipif(bpf_skip_reason() is not None, reason=bpf_skip_reason() or "")


def ruleset(ns: str | None = None) -> str:
    cmd = ["nft", "list", "ruleset"]
    if ns:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def iworld():
    w = World()
    try:
        w.add_internet()
        yield w
    finally:
        w.close()


@pytest.fixture
def natd(iworld, daemon_factory, busybox_rootfs):
    """A daemon with net.uplink = "auto" (resolves to the world's up0); checks at the
    end that stopping it removed its table and left every other ruleset as it was."""
    host_before, br_before = ruleset(), ruleset(iworld.br_ns)
    cfg = dict(iworld.cfg, ipv4_pool=f"10.{iworld.octet}.3.0/24")
    d = daemon_factory(_toml_net(cfg).replace("[net]\n", '[net]\nuplink = "auto"\n'))
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    yield d, c
    c.close()
    c = d.client()          # a test may have restarted the daemon
    c.destroy_all(force=True)
    c.close()
    d.stop(signal.SIGTERM)
    assert "dsecd" not in ruleset(iworld.br_ns)
    assert ruleset(iworld.br_ns) == br_before
    assert ruleset() == host_before


def wget(sb, url: str) -> tuple[int, str]:
    """GET `url` (http://host[:port]/path) with busybox nc (its static wget crashes)."""
    hostport, _, path = url.removeprefix("http://").partition("/")
    host, _, port = hostport.partition(":")
    r = sb.exec(["sh", "-c", f"printf 'GET /{path} HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port or 80}"],
                timeout=20)
    out = (r.stdout + r.stderr).decode()
    return (r.exit_code if "200 OK" in out else 1), out


def http_get(addr: str) -> str:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=3) as s:
        s.sendall(b"GET /index.html HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data.decode()


def test_egress_through_nat_needs_the_rule(iworld, natd):
    d, c = natd
    assert c.info()["features"]["nft_nat"]["available"]
    allowed = c.create(image="busybox", net="default", allow=[f"{iworld.inet}:80/tcp"])
    denied = c.create(image="busybox", net="default")
    code, out = wget(allowed, f"http://{iworld.inet}/")
    assert code == 0 and f"whoami {iworld.uplink_addr}" in out      # masqueraded to the uplink's address
    code, out = wget(denied, f"http://{iworld.inet}/")
    assert code != 0 and "whoami" not in out
    # A rule for the whole internet is not one for the host: its uplink's
    # address (a service of the host there) stays out of reach, at once.
    broad = c.create(image="busybox", net="default", allow=["0.0.0.0/0:80/tcp"])
    assert wget(broad, f"http://{iworld.inet}/")[0] == 0
    r = broad.exec(["sh", "-c", f"nc -w 2 {iworld.uplink_addr} 80 </dev/null"], timeout=20)
    assert r.exit_code != 0 and b"not permitted" in r.stderr, r
    nat = c.info()["net"]["nat"]
    assert nat["uplink"] == iworld.uplink and nat["table"] == "inet dsecd"
    table = ruleset(iworld.br_ns)
    assert "masquerade" in table and f'oifname "{iworld.uplink}"' in table


def test_a_broad_rule_reaches_no_cloud_metadata_service(iworld, natd):
    """Alibaba Cloud's metadata service (100.100.100.200) is no link-local
    address: a broad rule reached it through the NAT, and with it the
    host's cloud credentials. It is fenced; a rule naming it opens it."""
    d, c = natd
    broad = c.create(image="busybox", net="default", allow=["0.0.0.0/0:80/tcp"])
    named = c.create(image="busybox", net="default", allow=["100.100.100.200:80/tcp"])
    r = broad.exec(["sh", "-c", "nc -w 1 100.100.100.200 80 </dev/null"], timeout=20)
    assert r.exit_code != 0 and b"not permitted" in r.stderr, r
    r = named.exec(["sh", "-c", "nc -w 1 100.100.100.200 80 </dev/null"], timeout=20)
    assert b"not permitted" not in r.stderr, r          # let through (nobody answers in the test's internet)


def test_an_address_the_host_gains_is_fenced_at_once(iworld, natd):
    """An address the host side gains while the daemon runs (here a second
    one on the uplink) is walled off from a broad rule as the first one is,
    within moments; once it is gone it is no longer fenced."""
    d, c = natd
    gained = "198.18.77.1"
    broad = c.create(image="busybox", net="default", allow=["0.0.0.0/0:80/tcp"])

    def refused_by_policy() -> bool:
        r = broad.exec(["sh", "-c", f"nc -w 1 {gained} 80 </dev/null"], timeout=20)
        return b"not permitted" in r.stderr

    assert not refused_by_policy()           # not the host's yet: the broad rule reaches it
    subprocess.run(["ip", "-n", iworld.br_ns, "addr", "add", f"{gained}/32", "dev", iworld.uplink], check=True)
    try:
        deadline = time.monotonic() + 5
        while not refused_by_policy():
            assert time.monotonic() < deadline, c.info()["net"]["fences"]
        fences = c.info()["net"]["fences"]
        assert gained in fences["host_addresses"] and fences["follows_changes"], fences
    finally:
        subprocess.run(["ip", "-n", iworld.br_ns, "addr", "del", f"{gained}/32", "dev", iworld.uplink], check=True)
    deadline = time.monotonic() + 5
    while refused_by_policy():
        assert time.monotonic() < deadline, c.info()["net"]["fences"]


@pytest.mark.attack
def test_a_broad_udp_rule_reaches_no_broadcast_address_of_the_host(iworld, natd, probe_binary):
    """The host takes a datagram to the broadcast address of any of its
    subnets (here the uplink's, 198.18.x.255) as its own, from whichever
    interface it comes: a UDP service of the host bound to every address
    gets it, and can answer. `0.0.0.0/0:7777/udp` is the internet's port
    7777, not the host's."""
    from attack_kit import install_probe, outcome

    d, c = natd
    received = []

    host_service = iworld.host_udp_service(7777)
    try:
        sb = c.create(image="busybox", net="default", allow=["0.0.0.0/0:7777/udp"])
        install_probe(sb, probe_binary)
        broadcast = iworld.inet_net.replace(".0/24", ".255")
        assert outcome(sb, "udp", broadcast, "7777") == "EPERM"
        assert outcome(sb, "udp", iworld.uplink_addr, "7777") == "EPERM"
        with pytest.raises(TimeoutError):
            received.append(host_service.recvfrom(100))
        assert received == []
        assert outcome(sb, "udp", iworld.inet, "7777") == "ok"           # the rule itself works
        assert broadcast in c.info()["net"]["fences"]["host_addresses"]
    finally:
        host_service.close()


def test_uplink_off_is_unreachable(iworld, daemon_factory, busybox_rootfs):
    cfg = dict(iworld.cfg, ipv4_pool=f"10.{iworld.octet}.4.0/24")
    d = daemon_factory(_toml_net(cfg))
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", net="default", allow=[f"{iworld.inet}:80/tcp"])
        code, out = wget(sb, f"http://{iworld.inet}/")
        assert code != 0 and "whoami" not in out
        assert "dsecd" not in ruleset(iworld.br_ns)             # no uplink, no port: no table
        c.destroy_all(force=True)
    finally:
        c.close()


def test_an_uplink_that_is_not_there_is_said_at_start(iworld, daemon_factory):
    cfg = dict(iworld.cfg, ipv4_pool=f"10.{iworld.octet}.4.0/24")
    d = daemon_factory(_toml_net(cfg).replace("[net]\n", '[net]\nuplink = "upx9"\n'))
    log = d.log.read_text()
    assert "has no interface upx9: nothing the sandboxes send beyond the bridge is masqueraded" in log, log[-2000:]
    c = d.client()
    try:
        assert c.info()["net"]["nat"]["uplink"] == "upx9"
    finally:
        c.close()
    d.stop(signal.SIGTERM)
    assert "dsecd" not in ruleset(iworld.br_ns)


def _serve_http(sb, port: int) -> None:
    sb.exec(["sh", "-c", "mkdir -p /tmp/www && echo sandbox-page > /tmp/www/index.html"])
    _serve(sb, port, f"httpd -p {port} -h /tmp/www")


def _serve(sb, port: int, server: str) -> None:
    """Start `server` in the sandbox, in a session of its own; wait until `port` listens."""
    sb.exec(["sh", "-c", f"setsid {server} </dev/null >/dev/null 2>&1 &"])
    deadline = time.monotonic() + 5
    while sb.exec(["sh", "-c", f"netstat -ltn | grep -q ':{port} '"]).exit_code != 0:
        assert time.monotonic() < deadline, f"{server} did not listen"
        time.sleep(0.05)


def test_published_port(iworld, natd):
    d, c = natd
    sb = c.create(image="busybox", net="default", publish=[8080, 8080])      # one port, named twice
    _serve_http(sb, 8080)
    host = sb.get_host(8080)
    # Asked again (`dsec port SB 8080`), the port says where it is published.
    again = d.cli("port", sb.id, "8080")
    assert (again.returncode, again.stdout.decode().strip()) == (0, host), again
    # Without a port (`docker port` habit), what is published.
    listed = d.cli("port", sb.id)
    assert (listed.returncode, listed.stdout.decode()) == (0, f"8080/tcp -> {host}\n"), listed
    bare = d.cli("port", sb.id, "--rm")
    assert bare.returncode == 2 and b"--rm, --host-port and --bind take the sandbox's port" in bare.stderr, bare
    # A bind address the host side does not have: said so at once.
    bad = d.cli("port", sb.id, "9090", "--bind", "192.0.2.77")
    assert bad.returncode != 0 and b"not an address of the host side" in bad.stderr, bad
    gateway = f"10.{iworld.octet}.0.1"
    assert host.startswith(f"{gateway}:")
    hp = int(host.rsplit(":", 1)[1])
    assert "sandbox-page" in iworld.in_bridge_netns(http_get, host)                   # the host side
    assert "sandbox-page" in iworld.in_bridge_netns(http_get, f"{iworld.uplink_addr}:{hp}")
    # The sandbox still cannot open connections to the host side.
    code, out = wget(sb, f"http://{gateway}:{hp}/index.html")
    assert code != 0 and "sandbox-page" not in out
    assert sb.net_show()["default"]["denied_connect"] >= 1
    assert [p["port"] for p in sb.net_show()["ports"]] == [8080]
    assert sb.inspect()["net"]["ports"] == sb.net_show()["ports"]         # as `docker inspect` shows them

    # Restart: the port is journaled and published again.
    c.close()
    d.stop(signal.SIGTERM)
    assert "sandbox-page" in iworld.in_bridge_netns(http_get, host)     # kept for the sandbox that runs on
    d.start()
    c = d.client()
    sb = c.get(sb.id)
    assert sb.get_host(8080) == host
    assert "sandbox-page" in iworld.in_bridge_netns(http_get, host)

    sb.unpublish(8080)
    with pytest.raises(OSError):
        iworld.in_bridge_netns(http_get, host)
    assert f"dport {hp}" not in ruleset(iworld.br_ns)

    sb.publish(8080, host_port=hp, bind=gateway)
    assert "sandbox-page" in iworld.in_bridge_netns(http_get, host)
    assert f"dport {hp}" in ruleset(iworld.br_ns)
    sb.destroy()
    assert f"dport {hp}" not in ruleset(iworld.br_ns)                  # destroy removed the rules
    with pytest.raises(OSError):
        iworld.in_bridge_netns(http_get, host)
    c.close()


def test_a_host_port_in_use_is_refused_saying_why(iworld, natd):
    d, c = natd
    sb = c.create(image="busybox", net="default")

    def listen() -> socket.socket:
        s = socket.socket()
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        return s

    held = iworld.in_bridge_netns(listen)
    try:
        port = held.getsockname()[1]
        r = d.cli("port", sb.id, "8080", "--host-port", str(port))
        err = r.stderr.decode()
        assert r.returncode != 0 and err.startswith(f"dsec port: conflict: host port {port} on every address"), err
        assert "Address already in use; pick another --host-port" in err and "[Errno" not in err, err
    finally:
        held.close()
    assert sb.net_show()["ports"] == []
    sb.destroy()


def test_run_with_publish_says_where_the_port_is(iworld, natd):
    d, c = natd
    r = d.cli("run", "--net", "default", "--publish", "8080", "busybox", "--", "echo", "up")
    err = r.stderr.decode()
    assert (r.returncode, r.stdout) == (0, b"up\n"), err
    assert re.fullmatch(rf"dsec run: port 8080 of sandbox \w+ is published on 10\.{iworld.octet}\.0\.1:\d+\n", err), err
    assert c.list() == []


def test_a_host_port_taken_while_no_daemon_ran_is_not_published_over(iworld, natd):
    d, c = natd
    sb = c.create(image="busybox", net="default", publish=[8080])
    _serve_http(sb, 8080)
    hp = int(sb.get_host(8080).rsplit(":", 1)[1])
    c.close()
    d.stop(signal.SIGTERM)            # the table goes with the daemon: the port is free on the host side

    def listen() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", hp))
        s.listen(1)
        return s

    held = iworld.in_bridge_netns(listen)
    try:
        d.start()
        c = d.client()
        sb = c.get(sb.id)
        # Not DNATed over the process that listens there now; the log says why and what to do.
        assert sb.net_show()["ports"] == []
        assert f"dport {hp} " not in ruleset(iworld.br_ns)
        assert f"port 8080 not published again after the restart (host port {hp})" in d.log.read_text()
        # Asked again, it goes on a free host port, and serves there.
        host = sb.get_host(8080)
        assert int(host.rsplit(":", 1)[1]) != hp
        assert "sandbox-page" in iworld.in_bridge_netns(http_get, host)
        sb.destroy()
        c.close()
    finally:
        held.close()


def test_a_host_port_another_daemon_holds_is_passed_over_or_refused_naming_it(iworld, natd):
    """Host ports are claimed host-wide (nat.PortClaims), TCP and UDP apart,
    before a daemon checks and DNATs them: a port another daemon claimed and
    has not DNATed yet (this test's process, standing in for one between its
    pick and its DNAT) is passed over by an automatic pick and refused,
    naming that daemon, when asked for. The daemon's own claims go with the
    publication, come back from its journal when it restarts, and go with
    the sandbox."""
    d, c = natd
    sb = c.create(image="busybox", net="default")
    first = sb.publish(8080)["host_port"]          # what the daemon picks first
    sb.unpublish(8080)
    other = PortClaims(netns_path(iworld.br_ns))
    assert other.claim("tcp", first, "other") is None          # given up with the unpublish
    try:
        assert sb.publish(8080)["host_port"] != first
        r = d.cli("port", sb.id, "9090", "--host-port", str(first))
        err = r.stderr.decode()
        assert r.returncode != 0 and f"host port {first} is published by another dsecd daemon" in err, err
        assert f"(pid {os.getpid()})" in err, err
        # The UDP port of that number is not the claimed TCP one.
        assert sb.publish(5353, host_port=first, protocol="udp")["host_port"] == first
        assert other.claim("udp", first, "other") == d.proc.pid
        sb.unpublish(5353, protocol="udp")
        assert other.claim("udp", first, "other") is None
        assert sb.publish(5353, protocol="udp")["host_port"] != first
        r = d.cli("port", sb.id, "5354/udp", "--host-port", str(first))
    finally:
        other.give_up("tcp", first, "other")
        other.give_up("udp", first, "other")
    err = r.stderr.decode()
    assert r.returncode != 0 and f"host port {first}/udp is published by another dsecd daemon" in err, err
    sb.publish(9090, host_port=first)
    assert other.claim("tcp", first, "other") == d.proc.pid
    # Killed, its claims go with it; started again, it claims its records' ports.
    c.close()
    d.stop(signal.SIGKILL)
    d.start()
    c = d.client()
    sb = c.get(sb.id)
    assert sb.get_host(9090).endswith(f":{first}")
    assert other.claim("tcp", first, "other") == d.proc.pid
    sb.destroy()
    try:
        assert other.claim("tcp", first, "other") is None       # gone with the sandbox
    finally:
        other.give_up("tcp", first, "other")
    c.close()


def _connect_in(ns: str, addr: str) -> socket.socket:
    """A TCP connection to `addr` ("host:port") made from the netns `ns`."""
    host, port = addr.rsplit(":", 1)
    return World.in_netns(ns, socket.create_connection, (host, int(port)), 3)


def _echoes(s: socket.socket, data: bytes) -> bool:
    """`data` comes back on `s` (an echo server at the other end); False on a reset,
    end of stream or silence."""
    try:
        s.sendall(data)
        got = b""
        while len(got) < len(data):
            chunk = s.recv(64)
            if not chunk:
                return False
            got += chunk
        return got == data
    except OSError:
        return False


def test_unpublish_cuts_connections_made_through_the_port(iworld, natd):
    """An unpublished port takes its open connections with it (their conntrack
    entries, which would keep forwarding them, are deleted); a connection through
    another port of the sandbox, still published, goes on."""
    d, c = natd
    sb = c.create(image="busybox", net="default", publish=[8080, 8081])
    for port in (8080, 8081):
        _echo_server(sb, port)
    hp = int(sb.get_host(8080).rsplit(":", 1)[1])
    kept_hp = int(sb.get_host(8081).rsplit(":", 1)[1])
    gateway = f"10.{iworld.octet}.0.1"
    conns = [_connect_in(iworld.br_ns, f"{gateway}:{hp}"),                 # the host side's own
             _connect_in(iworld.inet_ns, f"{iworld.uplink_addr}:{hp}")]   # from beyond the uplink
    kept = _connect_in(iworld.inet_ns, f"{iworld.uplink_addr}:{kept_hp}")
    try:
        for s in (*conns, kept):
            s.settimeout(3)
            assert _echoes(s, b"before\n")
        sb.unpublish(8080)
        for s in conns:
            assert not _echoes(s, b"after\n")
        assert _echoes(kept, b"after\n")
    finally:
        for s in (*conns, kept):
            s.close()
    sb.destroy()


def _echo_server(sb, port: int) -> None:
    _serve(sb, port, f"nc -ll -p {port} -e cat")


def test_a_stopped_daemon_keeps_published_ports_for_sandboxes_that_run_on(iworld, natd):
    """Sandboxes run on while no daemon does (a restart): so do their egress NAT
    and published ports. A stop keeps the table while networked sandboxes
    live; an open connection through a published port goes on, and a new one
    is made, until and after the next daemon replaces the table."""
    d, c = natd
    sb = c.create(image="busybox", net="default", publish=[8080])
    _echo_server(sb, 8080)
    addr = f"{iworld.uplink_addr}:{sb.get_host(8080).rsplit(':', 1)[1]}"
    conn = _connect_in(iworld.inet_ns, addr)
    try:
        conn.settimeout(3)
        assert _echoes(conn, b"before\n")
        d.stop(signal.SIGTERM)
        assert "dsecd" in ruleset(iworld.br_ns)
        assert _echoes(conn, b"while stopped\n")
        fresh = _connect_in(iworld.inet_ns, addr)
        fresh.settimeout(3)
        assert _echoes(fresh, b"new\n")
        fresh.close()
        d.start()
        assert _echoes(conn, b"after\n")
    finally:
        conn.close()


def test_a_table_no_daemon_needs_now_is_deleted_at_start(iworld, daemon_factory, busybox_rootfs):
    """A stop kept the table (egress NAT) for a sandbox that runs on; the next
    daemon runs without net.uplink and publishes nothing: the table would
    masquerade on for no daemon, and goes."""
    cfg = dict(iworld.cfg, ipv4_pool=f"10.{iworld.octet}.7.0/24")
    with_uplink = _toml_net(cfg).replace("[net]\n", '[net]\nuplink = "auto"\n')
    d = daemon_factory(with_uplink)
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    c.create(image="busybox", net="default")
    c.close()
    d.stop(signal.SIGTERM)
    assert "masquerade" in ruleset(iworld.br_ns)
    d.config.write_text(d.config.read_text().replace('uplink = "auto"\n', ""))
    d.start()
    c = d.client()
    try:
        assert [x["state"] for x in c.list()] == ["running"]
        deadline = time.monotonic() + 10          # the Network is built behind the start
        while "dsecd" in ruleset(iworld.br_ns):
            assert time.monotonic() < deadline, ruleset(iworld.br_ns)
            time.sleep(0.1)
        c.destroy_all(force=True)
    finally:
        c.close()
    d.stop(signal.SIGTERM)


def test_a_port_of_a_sandbox_that_died_while_no_daemon_ran_is_not_left_published(iworld, daemon_factory,
                                                                                   busybox_rootfs):
    """Without net.uplink the table exists only for published ports. A daemon
    killed with -9 leaves it (the kernel keeps forwarding meanwhile); if the
    sandbox whose port it published is gone by the restart, the next daemon
    must not leave its DNAT behind, pointing at an address IPAM will lease again."""
    cfg = dict(iworld.cfg, ipv4_pool=f"10.{iworld.octet}.6.0/24")
    d = daemon_factory(_toml_net(cfg))
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", net="default", publish=[8080])
    hp = int(sb.get_host(8080).rsplit(":", 1)[1])
    assert f"dport {hp} " in ruleset(iworld.br_ns)
    init_pid = sb.inspect()["init_pid"]
    c.close()
    d.stop(signal.SIGKILL)
    os.kill(init_pid, signal.SIGKILL)          # the sandbox dies while no daemon runs
    d.start()
    c = d.client()
    try:
        assert [x["state"] for x in c.list()] == ["dead"]
        assert f"dport {hp} " not in ruleset(iworld.br_ns)
        c.destroy_all(force=True)
    finally:
        c.close()
    d.stop(signal.SIGTERM)
    assert "dsecd" not in ruleset(iworld.br_ns)


def test_daemons_sharing_a_netns_keep_their_own_tables(iworld, natd, daemon_factory, busybox_rootfs):
    """A second daemon in the same bridge netns (a bridge and subnet of its
    own) neither replaces the first one's table at its start nor deletes it at
    its stop: the first one's published port and egress NAT go on. Neither
    publishes on a host port the other one's table DNATs."""
    d, c = natd
    sb = c.create(image="busybox", net="default", publish=[8080], allow=[f"{iworld.inet}:80/tcp"])
    _serve_http(sb, 8080)
    host = sb.get_host(8080)
    other = _second_daemon(iworld, daemon_factory)
    try:
        assert "sandbox-page" in iworld.in_bridge_netns(http_get, host)
        assert wget(sb, f"http://{iworld.inet}/")[0] == 0
        oc = other.client()
        try:
            assert oc.info()["net"]["nat"]["table"] == "inet dsecd-dsec1"
            oc.import_image(busybox_rootfs, "busybox")
            osb = oc.create(image="busybox", net="default", publish=[8080])
            assert osb.get_host(8080).rsplit(":", 1)[1] != host.rsplit(":", 1)[1]
            r = other.cli("port", osb.id, "9090", "--host-port", host.rsplit(":", 1)[1])
            err = r.stderr.decode()
            assert r.returncode != 0 and "is published by another dsecd daemon of the host side" in err, err
            assert f"(pid {d.proc.pid})" in err, err
            osb.destroy()
        finally:
            oc.close()
        assert c.info()["net"]["nat"]["table"] == "inet dsecd"
    finally:
        other.stop(signal.SIGTERM)
    assert "dsecd-dsec1" not in ruleset(iworld.br_ns)
    assert "sandbox-page" in iworld.in_bridge_netns(http_get, host)
    assert wget(sb, f"http://{iworld.inet}/")[0] == 0
    sb.unpublish(8080)
    sb.destroy()


def _second_daemon(iworld, daemon_factory):
    """A second daemon in the bridge netns of `iworld`'s (natd's), with a
    bridge (dsec1) and subnet (10.77.0.0/16, gateway 10.77.0.1) of its own."""
    cfg = dict(iworld.cfg, bridge="dsec1", ipv4_subnet="10.77.0.0/16", ipv4_pool="10.77.1.0/24", ipv6_subnet="")
    return daemon_factory(_toml_net(cfg).replace("[net]\n", '[net]\nuplink = "auto"\n'))


@contextlib.contextmanager
def _second_daemon_client(iworld, daemon_factory, busybox_rootfs):
    """_second_daemon and a client of it with busybox imported, while the
    block runs; then its sandboxes destroyed (its table goes at its stop
    only with no sandbox left) and the daemon stopped."""
    other = _second_daemon(iworld, daemon_factory)
    oc = other.client()
    try:
        oc.import_image(busybox_rootfs, "busybox")
        yield other, oc
    finally:
        oc.destroy_all(force=True)
        oc.close()
        other.stop(signal.SIGTERM)


def test_two_daemons_publishing_at_once_never_share_a_host_port(iworld, natd, daemon_factory, busybox_rootfs):
    """Two daemons of one bridge netns (bridges of their own) publishing at
    the same moment: each picks a host port, checks it free and adds its
    DNAT, and without the host-wide claim (nat.PortClaims) both would take
    the ports neither had DNATed yet."""
    d, c = natd
    with _second_daemon_client(iworld, daemon_factory, busybox_rootfs) as (other, oc):
        sandboxes = [c.create(image="busybox", net="default"), oc.create(image="busybox", net="default")]
        got: list[list[int]] = [[], []]
        errors: list[BaseException] = []
        both_ready = threading.Barrier(2)

        def publish(i: int) -> None:
            try:
                both_ready.wait()
                for port in range(8000, 8020):
                    got[i].append(sandboxes[i].publish(port)["host_port"])
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=publish, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(set(got[0])) == len(set(got[1])) == 20
        assert set(got[0]) & set(got[1]) == set()


def test_two_daemons_publish_one_host_port_on_two_addresses_not_on_every_one(iworld, natd, daemon_factory,
                                                                              busybox_rootfs):
    """Host ports are claimed per bind address (nat.PortClaims): two daemons
    of one bridge netns publish one host port on two of its addresses, each
    reaching its own sandbox; a publication on every address takes the port
    on each, so it and one on a single address refuse each other, naming
    the daemon that holds the port."""
    d, c = natd
    with _second_daemon_client(iworld, daemon_factory, busybox_rootfs) as (other, oc):
        mine, theirs = c.create(image="busybox", net="default"), oc.create(image="busybox", net="default")
        for sb, page in ((mine, "page-of-the-first"), (theirs, "page-of-the-second")):
            sb.exec(["sh", "-c", f"mkdir -p /tmp/www && echo {page} > /tmp/www/index.html"])
            _serve(sb, 8080, "httpd -p 8080 -h /tmp/www")
        # Two addresses of the bridge netns: each daemon's bridge gateway.
        first_addr, second_addr = f"10.{iworld.octet}.0.1", "10.77.0.1"
        hp = mine.publish(8080, bind=first_addr)["host_port"]
        assert theirs.publish(8080, host_port=hp, bind=second_addr)["host_port"] == hp
        assert "page-of-the-first" in iworld.in_bridge_netns(http_get, f"{first_addr}:{hp}")
        assert "page-of-the-second" in iworld.in_bridge_netns(http_get, f"{second_addr}:{hp}")
        # On the other's address, or on every address: refused, naming the other daemon.
        with pytest.raises(DsecError, match=rf"host port {hp} is published by another dsecd daemon .*"
                                            rf"\(pid {d.proc.pid}\), on {first_addr} or on every address"):
            theirs.publish(9090, host_port=hp, bind=first_addr)
        narrow = theirs.publish(7070, bind=second_addr)["host_port"]
        with pytest.raises(DsecError, match=rf"host port {narrow} is published by another dsecd daemon .*"
                                            rf"\(pid {other.proc.pid}\), on some address"):
            mine.publish(7070, host_port=narrow)
        # The other way round: a port published on every address is taken on each.
        wide = mine.publish(9090)["host_port"]
        with pytest.raises(DsecError, match=rf"host port {wide} is published by another dsecd daemon .*"
                                            rf"\(pid {d.proc.pid}\), on {second_addr} or on every address"):
            theirs.publish(9090, host_port=wide, bind=second_addr)
        # Unpublished, the first address's port is free for the other daemon there.
        mine.unpublish(8080)
        theirs.unpublish(8080)
        assert theirs.publish(8080, host_port=hp, bind=first_addr)["host_port"] == hp
        assert "page-of-the-second" in iworld.in_bridge_netns(http_get, f"{first_addr}:{hp}")


def _tracked_from(ns: str, addr: str) -> list:
    """The conntrack entries of the netns `ns` whose original direction comes from `addr`."""
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    def dump() -> list:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, 12)   # NETLINK_NETFILTER
        s.bind((0, 0))
        if ":" not in addr:
            with Conntrack(fileno=s.detach()) as ct:
                return [(e.tuple_orig.daddr, e.tuple_orig.dport)
                        for e in ct.dump_entries(tuple_orig=NFCTAttrTuple(saddr=addr))]
        # The kernel's tuple filter inverts its IPv6 address match (nat.forget_address).
        with Conntrack(fileno=s.detach(), nfgen_family=socket.AF_INET6) as ct:
            return [(e.tuple_orig.daddr, e.tuple_orig.dport) for e in ct.dump_entries()
                    if e.tuple_orig.family == socket.AF_INET6
                    and ipaddress.ip_address(e.tuple_orig.saddr) == ipaddress.ip_address(addr)]

    return World.in_netns(ns, dump)


def test_a_destroyed_sandbox_leaves_no_connection_tracked_for_its_address(iworld, natd):
    """The host side's conntrack entries of a sandbox's connections go with
    it: they would outlive it (an established TCP connection's, for days),
    and the next sandbox given its address would inherit them, with the
    answers `ct state established` lets into the bridge."""
    d, c = natd
    sb = c.create(image="busybox", net="default", allow=[f"{iworld.inet}:9000/tcp"])
    ip = sb.net_show()["lease"]["ipv4"].split("/")[0]
    # A connection held open through the uplink, to the internet's sink.
    sb.exec(["sh", "-c", f"setsid sh -c 'sleep 600 | nc {iworld.inet} 9000' </dev/null >/dev/null 2>&1 &"])
    deadline = time.monotonic() + 10
    while (iworld.inet, 9000) not in _tracked_from(iworld.br_ns, ip):
        assert time.monotonic() < deadline, "the sandbox's connection was never tracked"
        time.sleep(0.1)
    sb.destroy(force=True)
    assert _tracked_from(iworld.br_ns, ip) == []


def test_a_destroyed_sandbox_leaves_no_connection_tracked_for_its_ipv6_address(iworld, natd):
    """With net.ipv6_subnet the sandbox's IPv6 address is leased again too
    (it mirrors the IPv4 one), and `ct state established` lets answers into
    the bridge for IPv6 as for IPv4: its entries go with it as well."""
    d, c = natd
    gw6 = f"fd00:{iworld.octet}::1"

    def listen() -> socket.socket:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.bind((gw6, 9001))
        s.listen(4)                 # the kernel completes the handshake: nothing need accept
        return s

    srv = iworld.in_bridge_netns(listen)
    try:
        sb = c.create(image="busybox", net="default", allow=[f"[{gw6}]:9001/tcp"])
        ip6 = sb.net_show()["lease"]["ipv6"].split("/")[0]
        sb.exec(["sh", "-c", f"setsid sh -c 'sleep 600 | nc {gw6} 9001' </dev/null >/dev/null 2>&1 &"])
        deadline = time.monotonic() + 10
        while (gw6, 9001) not in _tracked_from(iworld.br_ns, ip6):
            assert time.monotonic() < deadline, "the sandbox's IPv6 connection was never tracked"
            time.sleep(0.1)
        sb.destroy(force=True)
        assert _tracked_from(iworld.br_ns, ip6) == []
    finally:
        srv.close()


def _udp_echo_server(sb, probe: bytes, port: int) -> None:
    """attack_probe's UDP echo server on `port` of the sandbox, in the background;
    waits until the port is bound."""
    from attack_kit import PROBE_IN_SANDBOX, install_probe

    install_probe(sb, probe)
    sb.exec(["sh", "-c", f"setsid {PROBE_IN_SANDBOX} udp_echo {port} </dev/null >/dev/null 2>&1 &"])
    deadline = time.monotonic() + 5
    while sb.exec(["sh", "-c", f"netstat -lun | grep -q ':{port} '"]).exit_code != 0:
        assert time.monotonic() < deadline, "the UDP echo server did not bind"
        time.sleep(0.05)


def _udp_socket(ns: str, addr: str) -> socket.socket:
    """A UDP socket of the netns `ns`, connected to `addr` ("host:port"): its
    datagrams are one flow (one conntrack entry), and an ICMP port unreachable
    answering one is an error on it."""
    host, port = addr.rsplit(":", 1)

    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(3)
        s.connect((host, int(port)))
        return s

    return World.in_netns(ns, make)


def _udp_echoes(s: socket.socket, data: bytes) -> bool:
    """`data` sent on `s` comes back (a UDP echo server at the other end); False
    on silence or an ICMP error."""
    try:
        s.send(data)
        return s.recv(2048) == data
    except OSError:
        return False


def _udp_answered(ns: str, addr: str, data: bytes) -> bool:
    """A datagram sent to `addr` from a fresh socket of the netns `ns` is echoed."""
    s = _udp_socket(ns, addr)
    try:
        return _udp_echoes(s, data)
    finally:
        s.close()


def test_a_published_udp_port_answers_until_it_is_unpublished(iworld, natd, probe_binary):
    """`--publish 5353/udp`: a datagram to the host port reaches the sandbox's
    UDP server, which may answer it (its allowlist names no client: the
    sender of a datagram to a published UDP port may be answered), from the
    host side and from beyond the uplink. Unpublished, the flows through it
    are cut (their conntrack entries go, as its peers do) and new ones get
    no answer."""
    from attack_kit import outcome

    d, c = natd
    sb = c.create(image="busybox", net="default", publish=["5353/udp"])
    _udp_echo_server(sb, probe_binary, 5353)
    host = sb.get_host(5353, protocol="udp")
    gateway = f"10.{iworld.octet}.0.1"
    assert host.startswith(f"{gateway}:")
    hp = int(host.rsplit(":", 1)[1])
    listed = d.cli("port", sb.id)
    assert (listed.returncode, listed.stdout.decode()) == (0, f"5353/udp -> {host}\n"), listed
    assert [(p["port"], p["protocol"]) for p in sb.net_show()["ports"]] == [(5353, "udp")]
    assert sb.inspect()["net"]["ports"] == sb.net_show()["ports"]          # as `docker inspect` shows them
    assert f"udp dport {hp}" in ruleset(iworld.br_ns)
    # No TCP port was published with it; the error names the UDP one that is.
    r = d.cli("port", sb.id, "5353", "--rm")
    assert r.returncode != 0 and b"(5353/udp is: name it as 5353/udp)" in r.stderr, r

    flows = [_udp_socket(iworld.br_ns, host),                                    # the host side's own
             _udp_socket(iworld.inet_ns, f"{iworld.uplink_addr}:{hp}")]         # from beyond the uplink
    try:
        for s in flows:
            assert _udp_echoes(s, b"before")
        assert sb.net_show()["default"]["denied_sendmsg"] == 0
        # The sandbox answers whoever wrote to the port, from that port, and
        # opens nothing: a datagram of its own to the host side is refused.
        peer = str(flows[0].getsockname()[1])
        assert outcome(sb, "udp_from", "5353", gateway, peer) == "ok"
        assert outcome(sb, "udp_from", "5354", gateway, peer) == "EPERM"
        assert outcome(sb, "udp", gateway, str(hp)) == "EPERM"
        assert (iworld.uplink_addr, hp) in _tracked_from(iworld.br_ns, iworld.inet)
        r = d.cli("port", sb.id, "5353/udp", "--rm")
        assert (r.returncode, r.stdout.decode()) == (0, f"{sb.id}: port 5353/udp unpublished\n"), r
        assert f"udp dport {hp}" not in ruleset(iworld.br_ns)
        assert (iworld.uplink_addr, hp) not in _tracked_from(iworld.br_ns, iworld.inet)    # the flow is cut
        assert outcome(sb, "udp_from", "5353", gateway, peer) == "EPERM"                 # its peers too
        for s in flows:
            assert not _udp_echoes(s, b"after")
    finally:
        for s in flows:
            s.close()
    assert not _udp_answered(iworld.br_ns, host, b"fresh")
    assert sb.net_show()["ports"] == [] and sb.inspect()["net"]["ports"] == []
    sb.destroy()


def test_a_udp_server_that_connects_to_its_client_answers_it(iworld, natd, probe_binary):
    """A UDP server that answers over a socket connect()ed to its client (the
    connect hook decides, then the packets' own check) may, as one that
    answers with sendto: the client wrote to the published port."""
    from attack_kit import PROBE_IN_SANDBOX, install_probe

    d, c = natd
    sb = c.create(image="busybox", net="default", publish=["5353/udp"])
    install_probe(sb, probe_binary)
    sb.exec(["sh", "-c", f"setsid {PROBE_IN_SANDBOX} udp_echo_connected 5353 </dev/null >/tmp/out 2>&1 &"])
    deadline = time.monotonic() + 5
    while sb.exec(["sh", "-c", "netstat -lun | grep -q ':5353 '"]).exit_code != 0:
        assert time.monotonic() < deadline, "the UDP server did not bind"
        time.sleep(0.05)
    s = _udp_socket(iworld.br_ns, sb.get_host(5353, protocol="udp"))
    try:
        assert _udp_echoes(s, b"connected")
    finally:
        s.close()
    assert sb.exec(["cat", "/tmp/out"]).stdout == b"ok\n"
    sb.destroy()


def test_a_published_udp_port_answers_after_a_restart(iworld, natd, probe_binary):
    d, c = natd
    sb = c.create(image="busybox", net="default")
    _udp_echo_server(sb, probe_binary, 5353)
    host = sb.get_host(5353, protocol="udp")
    assert _udp_answered(iworld.br_ns, host, b"before")
    c.close()
    d.stop(signal.SIGTERM)
    assert _udp_answered(iworld.br_ns, host, b"while stopped")     # kept for the sandbox that runs on
    d.start()
    c = d.client()
    sb = c.get(sb.id)
    assert sb.get_host(5353, protocol="udp") == host
    assert _udp_answered(iworld.br_ns, host, b"after")
    hp = host.rsplit(":", 1)[1]
    assert _udp_answered(iworld.inet_ns, f"{iworld.uplink_addr}:{hp}", b"after, from outside")
    sb.destroy()
    assert f"udp dport {hp}" not in ruleset(iworld.br_ns)
    assert not _udp_answered(iworld.br_ns, host, b"destroyed")
    c.close()


def test_tcp_and_udp_ports_of_one_number_are_published_apart(iworld, natd, probe_binary):
    """Port 7000/tcp and 7000/udp of one sandbox are two publications: each
    answers on its host port, and one goes without the other. A host port a
    UDP socket of the host side holds is refused for UDP, not for TCP."""
    d, c = natd
    sb = c.create(image="busybox", net="default", publish=[7000])
    _echo_server(sb, 7000)
    _udp_echo_server(sb, probe_binary, 7000)

    held = iworld.host_udp_service(0)
    try:
        busy = held.getsockname()[1]
        r = d.cli("port", sb.id, "7000/udp", "--host-port", str(busy))
        err = r.stderr.decode()
        assert r.returncode != 0 and f"host port {busy}/udp on every address" in err, err
        assert "Address already in use; pick another --host-port" in err, err
    finally:
        held.close()

    # The TCP port's host port is free for UDP: the host's TCP and UDP ports are apart.
    tcp_host = sb.get_host(7000)
    r = d.cli("port", sb.id, "7000/udp", "--host-port", tcp_host.rsplit(":", 1)[1])
    assert r.returncode == 0, r
    udp_host = r.stdout.decode().strip()
    assert udp_host == tcp_host
    listed = d.cli("port", sb.id).stdout.decode().splitlines()
    assert sorted(listed) == [f"7000/tcp -> {tcp_host}", f"7000/udp -> {udp_host}"], listed
    conn = _connect_in(iworld.br_ns, tcp_host)
    try:
        conn.settimeout(3)
        assert _echoes(conn, b"tcp\n")
        assert _udp_answered(iworld.br_ns, udp_host, b"udp")
        sb.unpublish(7000, protocol="udp")
        assert not _udp_answered(iworld.br_ns, udp_host, b"udp")
        assert _echoes(conn, b"tcp still\n")
    finally:
        conn.close()
    assert [(p["port"], p["protocol"]) for p in sb.net_show()["ports"]] == [(7000, "tcp")]
    bad = d.cli("port", sb.id, "7000/sctp")
    assert bad.returncode == 2 and "protocol 'sctp' is not tcp or udp" in bad.stderr.decode(), bad
    with pytest.raises(BadRequest, match="protocol 'sctp' of a published port is not tcp or udp"):
        sb.publish(7000, protocol="sctp")
    sb.destroy()


def test_a_daemon_sharing_the_bridge_leaves_the_table_of_the_one_that_has_it(iworld, natd, daemon_factory,
                                                                             busybox_rootfs):
    """A second daemon on the same bridge (an address pool of its own): at its
    start it neither deletes the first one's table (it has no uplink and no
    published port) nor, given an uplink, replaces it; the first one's
    published port and egress NAT go on."""
    d, c = natd
    sb = c.create(image="busybox", net="default", publish=[8080], allow=[f"{iworld.inet}:80/tcp"])
    _serve_http(sb, 8080)
    host = sb.get_host(8080)
    cfg = dict(iworld.cfg, ipv4_pool=f"10.{iworld.octet}.8.0/24")
    for extra in ("", 'uplink = "auto"\n'):
        other = daemon_factory(_toml_net(cfg).replace("[net]\n", f"[net]\n{extra}"))
        try:
            oc = other.client()
            try:
                oc.import_image(busybox_rootfs, "busybox")
                if not extra:
                    oc.create(image="busybox", net="default").destroy()      # its network is built by then
                else:
                    with pytest.raises(DsecError, match=rf"table inet \S+ of bridge {cfg['bridge']} .* is another "
                                       rf"daemon's \(pid {d.proc.pid}\).*net.bridge"):
                        oc.create(image="busybox", net="default")
            finally:
                oc.close()
            assert f"dport {host.rsplit(':', 1)[1]} " in ruleset(iworld.br_ns)
            assert "sandbox-page" in iworld.in_bridge_netns(http_get, host)
        finally:
            other.stop(signal.SIGTERM)
        assert "sandbox-page" in iworld.in_bridge_netns(http_get, host)
        assert wget(sb, f"http://{iworld.inet}/")[0] == 0
    sb.unpublish(8080)
    sb.destroy()
