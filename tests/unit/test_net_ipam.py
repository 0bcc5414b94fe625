"""IPAM: allocation, restore after a restart, pool hand-over, release, exhaustion (no root)."""

from __future__ import annotations

import pytest

from dsecd.errors import Busy
from dsecd.net.ipam import Ipam


def test_allocate_is_idempotent_and_skips_gateway():
    ipam = Ipam("10.88.0.0/24")
    a = ipam.allocate("sb1")
    assert str(a.ipv4) == "10.88.0.2/24" and str(a.gateway4) == "10.88.0.1"
    assert ipam.allocate("sb1") == a
    assert str(ipam.allocate("sb2").ipv4) == "10.88.0.3/24"


def test_restore_after_restart_and_release():
    ipam = Ipam("10.88.0.0/24")
    a, b = ipam.allocate("a"), ipam.allocate("b")
    again = Ipam("10.88.0.0/24")
    assert again.restore("a", str(a.ipv4)) == a and again.restore("b", str(b.ipv4)) == b
    assert str(again.allocate("c").ipv4) == "10.88.0.4/24"      # the cursor moved past restored ones
    assert again.release("a") and not again.release("a")
    with pytest.raises(ValueError, match="leased to b"):
        again.restore("x", str(b.ipv4))
    with pytest.raises(ValueError, match="not in net.ipv4_pool"):
        again.restore("y", "10.99.0.5/24")


def test_pool_lease_is_handed_over():
    ipam = Ipam("10.88.0.0/24")
    entry = ipam.allocate("dpool1")
    got = ipam.rekey("dpool1", "sb1")
    assert got.ipv4 == entry.ipv4 and got.owner == "sb1"
    assert ipam.get("dpool1") is None and ipam.owners() == {"sb1"}


def test_legacy_lease_file(tmp_path):
    (tmp_path / "l.json").write_text('{"leases": {"a": "10.88.0.7"}}')
    assert Ipam.read_legacy(tmp_path / "l.json") == {"a": "10.88.0.7"}
    assert Ipam.read_legacy(tmp_path / "none.json") == {}


def test_freed_address_is_not_reused_at_once():
    ipam = Ipam("10.88.0.0/24")
    first = ipam.allocate("a").ipv4
    ipam.release("a")
    assert ipam.allocate("b").ipv4 != first


def test_retain_frees_dead_owners():
    ipam = Ipam("10.88.0.0/24")
    for o in ("a", "b", "c"):
        ipam.allocate(o)
    assert ipam.retain({"b"}) == ["a", "c"]
    assert ipam.owners() == {"b"}


def test_pool_exhaustion_is_busy():
    ipam = Ipam("10.88.0.0/16", pool="10.88.5.0/30")
    got = {str(ipam.allocate(f"s{i}").ipv4) for i in range(4)}
    assert got == {f"10.88.5.{i}/16" for i in range(4)}
    with pytest.raises(Busy, match="no free address"):
        ipam.allocate("one-too-many")


def test_pool_must_be_inside_subnet():
    with pytest.raises(ValueError, match="not inside"):
        Ipam("10.88.0.0/16", pool="10.89.0.0/24")


def test_ipv6_mirrors_ipv4_offset():
    ipam = Ipam("10.88.0.0/24", subnet6="fd00:88::/64")
    a = ipam.allocate("a")
    assert str(a.ipv6) == "fd00:88::2/64" and str(a.gateway6) == "fd00:88::1"
    assert ipam.own_ipv6(a.ipv4.ip) == a.ipv6.ip


def test_corrupt_legacy_file_is_a_clear_error(tmp_path):
    (tmp_path / "l.json").write_text("{not json")
    with pytest.raises(ValueError, match="read IPAM leases"):
        Ipam.read_legacy(tmp_path / "l.json")


def _hold(path, offset):
    """Another process (as another daemon on the bridge would) holding byte
    `offset` of the host-wide claims file; ended with .kill()."""
    import subprocess
    import sys

    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
            "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(sys.argv[2])); "
            "print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(path), str(offset)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "held\n"
    return p


def test_an_address_another_daemon_on_the_bridge_holds_is_never_handed_out(tmp_path):
    """Two daemons on one bridge (the default dsec0 of two default configs):
    the second passes over the addresses the first's sandboxes hold."""
    import ipaddress

    from dsecd.net.ipam import AddressClaims

    path = str(tmp_path / "claims")
    claims = AddressClaims(None, "dsec0", path)
    other_claims = AddressClaims(None, "dsec1", path)        # another bridge: another key
    assert other_claims.base != claims.base
    first = int(ipaddress.IPv4Address("10.88.0.2"))
    other = _hold(path, claims.base + first)
    try:
        ipam = Ipam("10.88.0.0/29", claims=claims)
        assert str(ipam.allocate("a").ipv4.ip) == "10.88.0.3"
        for name in "bcd":
            ipam.allocate(name)
        with pytest.raises(Busy, match=rf"1 held by another daemon on this bridge \(pid {other.pid}\)"):
            ipam.allocate("e")
        ipam.restore("old", "10.88.0.2/29")           # a sandbox of this daemon's journal: kept, said loudly
        assert str(ipam.get("old").ipv4.ip) == "10.88.0.2"
    finally:
        other.kill()
        other.wait()
    ipam.release("old")
    ipam.release("a")
    assert str(ipam.allocate("f").ipv4.ip) == "10.88.0.2"


def test_restoring_a_lease_it_holds_never_lets_its_claim_go():
    """A lease restored again (the same owner and address) keeps its
    host-wide claim throughout: given up and claimed again, another daemon
    on the bridge could take the address in between."""
    calls = []

    class Claims:
        def claim(self, a):
            calls.append(("claim", a))

        def give_up(self, a):
            calls.append(("give_up", a))

    ipam = Ipam("10.88.0.0/29", claims=Claims())
    ipam.restore("sb", "10.88.0.2/29")
    ipam.restore("sb", "10.88.0.2/29")
    assert [c for c, _ in calls] == ["claim", "claim"]
    ipam.restore("sb", "10.88.0.3/29")                # another address: the old one's claim goes
    assert [c for c, _ in calls][2:] == ["give_up", "claim"]
