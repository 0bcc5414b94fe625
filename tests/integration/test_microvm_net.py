"""microVM networking: a tap on the sandboxes' bridge, the allowlist on it.

The bridge lives in a test-owned netns (net.host_netns) and the servers in
another (test_net_kit.World), as for test_net_daemon.py; traffic never
leaves namespaces this test made. One VM at a time (TCG).
"""

from __future__ import annotations

import ipaddress
import socket
import time

import pytest
from conftest import skip_unless_microvm
from test_net_daemon import _recv_line, _toml_net, connect, echo_server
from test_net_kit import bpf_skip_reason

pytestmark = pytest.mark.skipif(bpf_skip_reason() is not None, reason=bpf_skip_reason() or "")


def _vm_daemon(world, busybox_rootfs, **net):
    """A daemon on the World's bridge with busybox: (daemon, client), for a
    module's tests; `net` overrides the World's [net] settings. Its VMs
    start from the run's templates (conftest.VM_TEMPLATES)."""
    import tempfile
    from pathlib import Path

    from conftest import Daemon

    d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")), _toml_net(dict(world.cfg, **net)),
               shared_vm_templates=True)
    try:
        d.start()
        c = d.client()
        skip_unless_microvm(c)
        c.import_image(busybox_rootfs, "busybox")
        yield d, c
        c.close()
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def vmnet(world, busybox_rootfs):
    """A daemon on the World's bridge (its own pool in 10.x.4.0/24) with busybox."""
    yield from _vm_daemon(world, busybox_rootfs, ipv4_pool=f"10.{world.octet}.4.0/24")


def _vm(c, **kw):
    return c.create("busybox", backend="microvm", memory="256M", disk="64M", **kw)


def test_allowlist_on_the_tap(world, vmnet):
    d, c = vmnet
    sb = _vm(c, net="default", allow=[f"{world.pkg}:80/tcp"])
    try:
        code, out = connect(sb, world.pkg, 80)
        assert code == 0 and "srv80:ping" in out, out
        code, out = connect(sb, world.ref, 443)
        assert code != 0, out
        view = sb.net_show()
        assert sb.read_file("/etc/resolv.conf") == f"nameserver 10.{world.octet}.0.1\n".encode()
        ip = view["lease"]["ipv4"].split("/")[0]
        assert f"{ip}\t{sb.info['hostname']}" in sb.read_file("/etc/hosts").decode().splitlines()
        assert view["interface"].startswith("dv")
        assert view["lease"]["ipv4"].startswith(f"10.{world.octet}.4.")
        assert any(r["allowed"] >= 1 for r in view["rules"] if r["rule"].startswith(world.pkg))
        assert view["default"]["denied_connect"] >= 1 and view["default"]["dropped_packets"] >= 1
        # A live update reaches the tap's program like a container's hooks.
        sb.net_set(add=[f"{world.ref}:443/tcp"])
        assert connect(sb, world.ref, 443)[0] == 0
        sb.net_set(remove=[f"{world.ref}:443/tcp"])
        assert connect(sb, world.ref, 443)[0] != 0
        assert sb.inspect()["vm"]["template"], "restored from a template, NIC and all"
        # A pause ends QEMU and its tap; the resume plugs a new one, policy and all.
        sb.pause()
        assert connect(sb, world.pkg, 80)[0] == 0
        assert connect(sb, world.ref, 443)[0] != 0
    finally:
        sb.destroy()


def test_the_guest_cannot_send_as_another(world, vmnet):
    """Root in its own kernel, a guest can put any address or MAC on its
    frames: the tap's program drops what is not the VM's own."""
    d, c = vmnet
    sb = _vm(c, net="default", allow=[f"{world.pkg}:80/tcp"])
    try:
        assert connect(sb, world.pkg, 80)[0] == 0
        other = f"10.{world.octet}.4.250"
        r = sb.exec(["sh", "-c", f"ifconfig eth0 {other} netmask 255.255.0.0 && echo ping | nc -w 2 {world.pkg} 80"],
                    timeout=30)
        assert r.exit_code != 0, r.stdout
        mine = sb.net_show()["lease"]["ipv4"].split("/")[0]
        r = sb.exec(["sh", "-c", f"ifconfig eth0 {mine} netmask 255.255.0.0 && route add default gw "
                     f"10.{world.octet}.0.1 && ifconfig eth0 hw ether 02:00:00:00:00:07 && "
                     f"echo ping | nc -w 2 {world.pkg} 80"], timeout=30)
        assert r.exit_code != 0, r.stdout
        assert sb.net_show()["default"]["dropped_packets"] >= 2
    finally:
        sb.destroy()


@pytest.mark.attack
def test_one_vm_cannot_reach_another(world, vmnet, probe_binary):
    """Adversarial suite (docs/hardening.md, microVMs): root in its guest,
    a VM has raw sockets and any route it likes; the tap's program still
    drops every frame to a neighbour VM or the host side of the bridge that
    its allowlist does not name (the guest's connect times out: no RST)."""
    from attack_kit import install_probe
    from test_net_daemon import _listen

    d, c = vmnet
    a = _vm(c, net="default", allow=[f"{world.pkg}:80/tcp"])
    b = _vm(c, net="default", allow=[f"{world.pkg}:80/tcp"])
    try:
        install_probe(b, probe_binary)
        b_ip = b.net_show()["lease"]["ipv4"].split("/")[0]
        gateway = f"10.{world.octet}.0.1"
        _listen(b, 7777)
        assert connect(a, world.pkg, 80)[0] == 0                  # neighbour: its allowlist works
        assert connect(a, b_ip, 7777)[0] != 0                     # not on A's allowlist
        assert connect(a, gateway, 22)[0] != 0                    # nor the bridge's host side
        r = a.exec(["sh", "-c", f"ping -c 1 -W 2 {b_ip}"], timeout=30)
        assert r.exit_code != 0, r.stdout                          # raw ICMP, root's in its guest: dropped
        assert b.exec(["sh", "-c", "cat /tmp/listen.out"]).stdout.split() == [b"listening"]
        assert connect(b, "127.0.0.1", 7777)[0] == 0               # B's one-shot listener was up
        assert a.net_show()["default"]["dropped_packets"] >= 2
    finally:
        a.destroy()
        b.destroy()


def test_net_none_has_no_nic(vmnet):
    d, c = vmnet
    sb = _vm(c, net="none")
    try:
        ifaces = sb.exec(["cat", "/proc/net/dev"]).stdout.decode()
        names = {line.split(":")[0].strip() for line in ifaces.splitlines()[2:]}
        assert names == {"lo"}
        assert sb.exec(["ping", "-c", "1", "-W", "1", "127.0.0.1"]).exit_code == 0
    finally:
        sb.destroy()


def test_a_restarted_daemon_takes_over_the_tap(world, vmnet):
    """The tap's program stays attached while no daemon runs (the guest's
    egress stays checked); the next daemon puts its own in its place, and a
    connection made to the guest before goes on (its flow copied over)."""
    import signal

    from dsecd.net import bpfsys
    from dsecd.net.plumbing import in_netns

    d, c = vmnet
    sb = _vm(c, net="default", allow=[f"{world.pkg}:80/tcp"])
    ifname = sb.net_show()["interface"]
    vm_ip = sb.net_show()["lease"]["ipv4"].split("/")[0]
    echo_server(sb, 9000)
    conn = world.in_bridge_netns(lambda: socket.create_connection((vm_ip, 9000), timeout=10))
    conn.sendall(b"before\n")
    assert _recv_line(conn) == b"before\n"

    def tap_programs() -> list[int]:
        """The programs on the tap: its ingress (what the guest sends), then its egress."""
        with in_netns(f"/run/netns/{world.br_ns}"):
            idx = socket.if_nametoindex(ifname)
            return [p for at in ("TCX_INGRESS", "TCX_EGRESS")
                    for p in bpfsys.tcx_query(idx, bpfsys.ATTACH_TYPES[at], "query")]

    before = tap_programs()
    assert len(before) == 2
    d.stop(signal.SIGTERM)
    assert tap_programs() == before           # no daemon: the old program still decides
    d.start()
    c2 = d.client()
    try:
        s2 = c2.get(sb.id)
        after = tap_programs()
        assert len(after) == 2 and not set(after) & set(before)
        conn.sendall(b"after\n")
        assert _recv_line(conn) == b"after\n"
        assert connect(s2, world.pkg, 80)[0] == 0
        assert connect(s2, world.ref, 443)[0] != 0
        s2.destroy()
    finally:
        conn.close()
        c2.close()


def test_a_published_port_reaches_the_guest_and_only_its_answers_go_out(world, vmnet):
    """A port published at create is DNATed to the VM's address. The guest's
    answers leave through its tap whatever its allowlist says (none here),
    but a connection of its own is its egress, from a published port too;
    after a pause the new tap keeps both."""
    from test_net_nat import _serve_http, http_get

    d, _ = vmnet
    c = d.client()          # the module's client: the restart test above ended its connection
    sb = _vm(c, net="default", publish=[8080, 8081])
    try:
        _serve_http(sb, 8080)
        host = sb.get_host(8080)
        assert "sandbox-page" in world.in_bridge_netns(http_get, host)
        vm_ip = sb.net_show()["lease"]["ipv4"].split("/")[0]
        assert "sandbox-page" in world.in_bridge_netns(http_get, f"{vm_ip}:8080")     # straight to it
        denied = sb.net_show()["default"]["denied_connect"]
        r = sb.exec(["sh", "-c", f"echo ping | nc -w 2 -p 8081 {world.pkg} 80"], timeout=20)
        assert r.exit_code != 0, r.stdout + r.stderr
        assert sb.net_show()["default"]["denied_connect"] > denied
        assert connect(sb, world.pkg, 80)[0] != 0
        sb.pause()
        assert sb.exec(["true"]).exit_code == 0        # auto-resume: a new QEMU and tap, httpd still running
        assert "sandbox-page" in world.in_bridge_netns(http_get, host)
        sb.unpublish(8080)
        with pytest.raises(OSError):
            world.in_bridge_netns(http_get, host)
        assert [p["port"] for p in sb.net_show()["ports"]] == [8081]
    finally:
        sb.destroy()
        c.close()


def _vm_inbound_map(world, ifname: str):
    """The daemon's `vm_inbound` map, found through the programs on the VM's tap."""
    import os

    from dsecd.net import bpfsys
    from dsecd.net.plumbing import in_netns

    with in_netns(f"/run/netns/{world.br_ns}"):
        idx = socket.if_nametoindex(ifname)
        progs = bpfsys.tcx_query(idx, bpfsys.ATTACH_TYPES["TCX_EGRESS"], "query")
    fd = bpfsys.prog_fd_by_id(progs[0])
    try:
        ids = bpfsys.prog_map_ids(fd)
    finally:
        os.close(fd)
    return next(bpfsys.Map.by_id(i) for i in ids if bpfsys.map_info_by_id(i)["name"] == "vm_inbound")


def test_an_inbound_flow_leaves_the_shared_map_when_its_connection_ends(world, vmnet):
    """`vm_inbound` (the flows whose answers a VM's tap lets out) is every
    VM's, an LRU: a flow stays while its connection is open and goes at its
    end, whichever side closes first, so that churn does not push out an
    idle long-lived connection's flow and stall its answers."""
    import struct
    import time

    from test_net_nat import _serve_http, http_get

    from dsecd.net.network import vm_key

    d, _ = vmnet
    c = d.client()
    sb = _vm(c, net="default")                 # no rule: every answer needs its flow
    flows = None
    try:
        ifname = sb.net_show()["interface"]
        vm_ip = sb.net_show()["lease"]["ipv4"].split("/")[0]
        flows = _vm_inbound_map(world, ifname)
        key = struct.pack("=Q", vm_key(sb.id))

        def held_after_close() -> int:
            deadline = time.monotonic() + 5
            while (n := sum(1 for k in flows.keys() if k[:8] == key)) and time.monotonic() < deadline:
                time.sleep(0.05)
            return n

        _serve_http(sb, 8080)                  # the guest closes first (httpd after its answer)
        for _ in range(3):
            assert "sandbox-page" in world.in_bridge_netns(http_get, f"{vm_ip}:8080")
        assert held_after_close() == 0
        echo_server(sb, 9000)                  # the peer closes first
        conn = world.in_bridge_netns(lambda: socket.create_connection((vm_ip, 9000), timeout=10))
        conn.sendall(b"open\n")
        assert _recv_line(conn) == b"open\n"
        assert sum(1 for k in flows.keys() if k[:8] == key) == 1
        conn.close()
        assert held_after_close() == 0
    finally:
        if flows is not None:
            flows.close()
        sb.destroy()
        c.close()


def test_published_ports_survive_a_daemon_restart(world, vmnet):
    """A container's published ports are published again by the next
    daemon; a VM's were dropped from its record (no PORT section in `net
    show`, the host port refused): its readopt did not publish them."""
    import signal

    from test_net_nat import _serve_http, http_get

    d, _ = vmnet
    c = d.client()          # the module's client: a restart test ended its connection
    sb = _vm(c, net="default", publish=[8080])
    c2 = None
    try:
        _serve_http(sb, 8080)
        host = sb.get_host(8080)
        assert "sandbox-page" in world.in_bridge_netns(http_get, host)
        c.close()
        d.stop(signal.SIGTERM)
        d.start()
        c = c2 = d.client()
        s2 = c2.get(sb.id)
        assert [(p["port"], p["host"]) for p in s2.net_show()["ports"]] == [(8080, host)]
        assert "sandbox-page" in world.in_bridge_netns(http_get, host)
        # A second restart finds them in the record the first one wrote.
        c2.close()
        d.stop(signal.SIGTERM)
        d.start()
        c = c2 = d.client()
        s2 = c2.get(sb.id)
        assert [p["port"] for p in s2.net_show()["ports"]] == [8080]
        assert "sandbox-page" in world.in_bridge_netns(http_get, host)
        s2.destroy()
    finally:
        try:
            c.get(sb.id).destroy(force=True)
        except Exception:
            pass
        c.close()


def test_a_published_udp_port_of_a_vm_answers_until_it_is_unpublished(world, vmnet, probe_binary):
    """A UDP port published at create is DNATed to the VM's address; the
    guest's answers to whoever wrote to it leave through its tap whatever its
    allowlist says (none here), and only those: unpublished, the port gets
    no answer."""
    from test_net_nat import _udp_answered, _udp_echo_server

    d, _ = vmnet
    c = d.client()
    sb = _vm(c, net="default", publish=["5353/udp"])
    try:
        _udp_echo_server(sb, probe_binary, 5353)
        host = sb.get_host(5353, protocol="udp")
        assert _udp_answered(world.br_ns, host, b"ping")
        sb.unpublish(5353, protocol="udp")
        assert not _udp_answered(world.br_ns, host, b"ping")
        assert sb.net_show()["ports"] == []
    finally:
        sb.destroy()
        c.close()


def test_a_vm_answers_a_published_udp_port_with_a_datagram_past_the_mtu(world, vmnet, probe_binary):
    """An answer bigger than the tap's MTU leaves the guest in IP fragments:
    the first, with the UDP header, passed as an answer to a peer, and the
    rest, without ports, were dropped as "other protocol" to an address the
    allowlist does not name, so the peer never had the whole answer. (A
    container's answers are checked before the kernel fragments them.)"""
    from test_net_nat import _udp_answered, _udp_echo_server

    d, _ = vmnet
    c = d.client()
    sb = _vm(c, net="default", publish=["5353/udp"])
    try:
        _udp_echo_server(sb, probe_binary, 5353)
        host = sb.get_host(5353, protocol="udp")
        assert _udp_answered(world.br_ns, host, b"ping")
        assert _udp_answered(world.br_ns, host, b"x" * 1900)      # MTU 1500: two fragments each way
        sb.unpublish(5353, protocol="udp")
        assert not _udp_answered(world.br_ns, host, b"x" * 1900)
    finally:
        sb.destroy()
        c.close()


def test_a_vm_answers_a_published_udp_port_over_ipv6_past_the_mtu(world, vmnet, probe_binary):
    """Over IPv6 a datagram bigger than the MTU has a fragment header before
    its UDP header, in every fragment: dsec_tap_in took the peer's first
    fragment for "other protocol" and marked no peer, and dsec_tap dropped
    each fragment of the answer, the first included. Sent from the bridge
    netns to the VM's IPv6 address (a DNAT is IPv4 only)."""
    from attack_kit import PROBE_IN_SANDBOX, install_probe
    from test_net_nat import _udp_echoes

    d, _ = vmnet
    c = d.client()
    sb = _vm(c, net="default", publish=["5353/udp"])
    try:
        install_probe(sb, probe_binary)
        sb.exec(["sh", "-c", f"setsid {PROBE_IN_SANDBOX} udp6_echo 5353 </dev/null >/dev/null 2>&1 &"])
        deadline = time.monotonic() + 5
        while sb.exec(["sh", "-c", "netstat -lun | grep -q ':5353 '"]).exit_code != 0:
            assert time.monotonic() < deadline, "the UDP echo server did not bind"
            time.sleep(0.05)
        mine = sb.net_show()["lease"]["ipv6"].split("/")[0]

        def answered(data: bytes) -> bool:
            with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
                s.settimeout(3)
                s.connect((mine, 5353))
                return _udp_echoes(s, data)

        assert world.in_bridge_netns(answered, b"ping")
        assert world.in_bridge_netns(answered, b"x" * 1900)      # MTU 1500: two fragments each way
        sb.unpublish(5353, protocol="udp")
        assert not world.in_bridge_netns(answered, b"x" * 1900)
    finally:
        sb.destroy()
        c.close()


def _inet6(sb) -> list[str]:
    """The guest's IPv6 addresses on eth0 (/proc/net/if_inet6: 32 hex digits first)."""
    r = sb.exec(["sh", "-c", "cat /proc/net/if_inet6 2>/dev/null; true"])
    return [str(ipaddress.IPv6Address(bytes.fromhex(line.split()[0])))
            for line in r.stdout.decode().splitlines() if line.split()[-1] == "eth0"]


def test_ipv6_lease_on_the_tap(world, vmnet):
    """With net.ipv6_subnet a VM gets an IPv6 lease as a container does; the
    tap checks its IPv6 against the same allowlist, and only from its own
    address (neighbor discovery included) does anything leave."""
    from test_net_nat import _serve_http, http_get

    from dsecd.net.network import vm_mac
    from dsecd.net.policy import link_local

    d, _ = vmnet
    c = d.client()          # the module's client: the restart test above ended its connection
    sb = _vm(c, net="default", allow=[f"[{world.pkg6}]:80/tcp"])
    try:
        lease = sb.net_show()["lease"]
        mine = lease["ipv6"].split("/")[0]
        assert ipaddress.IPv6Address(mine) in ipaddress.IPv6Network(world.subnet6)
        # its link-local address is the one its tap lets do neighbor discovery
        v4 = ipaddress.IPv4Interface(lease["ipv4"]).ip
        assert set(_inet6(sb)) == {mine, str(ipaddress.IPv6Address(link_local(vm_mac(v4.packed))))}
        assert sb.exec(["cat", "/proc/sys/net/ipv6/conf/eth0/accept_ra"]).stdout.strip() == b"0"
        code, out = connect(sb, world.pkg6, 80)
        assert code == 0 and "srv80:ping" in out, out
        assert connect(sb, world.ref6, 443)[0] != 0                 # not on its allowlist
        view = sb.net_show()
        assert any(r["allowed"] >= 1 for r in view["rules"] if world.pkg6 in r["rule"])
        assert view["default"]["denied_connect"] >= 1
        # A connection made to it over IPv6 gets its answers (not on its allowlist).
        _serve_http(sb, 8080)
        assert "sandbox-page" in world.in_bridge_netns(http_get, f"{mine}:8080")
        # Root in its guest, it takes another address of the subnet: nothing
        # from it leaves (neither its neighbor solicitations nor the connect).
        dropped = view["default"]["dropped_packets"]
        other = str(ipaddress.IPv6Network(world.subnet6)[0xfffe])
        r = sb.exec(["sh", "-c", f"ifconfig eth0 del {lease['ipv6']} && ifconfig eth0 add {other}/64 && "
                     f"echo ping | nc -w 2 {world.pkg6} 80"], timeout=30)
        assert r.exit_code != 0, r.stdout + r.stderr
        assert sb.net_show()["default"]["dropped_packets"] > dropped
    finally:
        sb.destroy()
        c.close()


@pytest.fixture(scope="module")
def vmnet_v4only(world, busybox_rootfs):
    """A daemon on the World's bridge without net.ipv6_subnet (its own pool, 10.x.5.0/24)."""
    yield from _vm_daemon(world, busybox_rootfs, ipv4_pool=f"10.{world.octet}.5.0/24", ipv6_subnet="")


def test_no_ipv6_without_an_ipv6_subnet(world, vmnet_v4only):
    """No IPv6 lease: the guest's kernel has IPv6 off (no address, not even
    link-local) and the tap passes no IPv6 frame."""
    d, c = vmnet_v4only
    sb = _vm(c, net="default", allow=[f"{world.pkg}:80/tcp", f"[{world.pkg6}]:80/tcp"])
    try:
        assert sb.net_show()["lease"]["ipv6"] is None
        assert connect(sb, world.pkg, 80)[0] == 0
        assert sb.exec(["cat", "/proc/sys/net/ipv6/conf/eth0/disable_ipv6"]).stdout.strip() == b"1"
        assert _inet6(sb) == []
        assert connect(sb, world.pkg6, 80)[0] != 0
    finally:
        sb.destroy()

