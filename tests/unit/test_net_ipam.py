"""IPAM: allocation, persistence across a restart, release, exhaustion (no root)."""

from __future__ import annotations

import json

import pytest

from dsecd.errors import Busy
from dsecd.net.ipam import Ipam


def test_allocate_is_idempotent_and_skips_gateway(tmp_path):
    ipam = Ipam(tmp_path / "leases.json", "10.88.0.0/24")
    a = ipam.allocate("sb1")
    assert str(a.ipv4) == "10.88.0.2/24" and str(a.gateway4) == "10.88.0.1"
    assert ipam.allocate("sb1") == a
    assert str(ipam.allocate("sb2").ipv4) == "10.88.0.3/24"


def test_leases_survive_restart_and_release(tmp_path):
    path = tmp_path / "leases.json"
    ipam = Ipam(path, "10.88.0.0/24")
    a, b = ipam.allocate("a"), ipam.allocate("b")
    again = Ipam(path, "10.88.0.0/24")
    assert again.get("a") == a and again.get("b") == b
    assert again.release("a") and not again.release("a")
    assert Ipam(path, "10.88.0.0/24").get("a") is None
    assert not list(tmp_path.glob(".*.tmp"))          # atomic writes leave no temp files


def test_freed_address_is_not_reused_at_once(tmp_path):
    ipam = Ipam(tmp_path / "l.json", "10.88.0.0/24")
    first = ipam.allocate("a").ipv4
    ipam.release("a")
    assert ipam.allocate("b").ipv4 != first


def test_retain_frees_dead_owners(tmp_path):
    ipam = Ipam(tmp_path / "l.json", "10.88.0.0/24")
    for o in ("a", "b", "c"):
        ipam.allocate(o)
    assert ipam.retain({"b"}) == ["a", "c"]
    assert ipam.owners() == {"b"}
    assert json.loads((tmp_path / "l.json").read_text())["leases"].keys() == {"b"}


def test_pool_exhaustion_is_busy(tmp_path):
    ipam = Ipam(tmp_path / "l.json", "10.88.0.0/16", pool="10.88.5.0/30")
    got = {str(ipam.allocate(f"s{i}").ipv4) for i in range(4)}
    assert got == {f"10.88.5.{i}/16" for i in range(4)}
    with pytest.raises(Busy, match="no free address"):
        ipam.allocate("one-too-many")


def test_pool_must_be_inside_subnet(tmp_path):
    with pytest.raises(ValueError, match="not inside"):
        Ipam(tmp_path / "l.json", "10.88.0.0/16", pool="10.89.0.0/24")


def test_ipv6_mirrors_ipv4_offset(tmp_path):
    ipam = Ipam(tmp_path / "l.json", "10.88.0.0/24", subnet6="fd00:88::/64")
    a = ipam.allocate("a")
    assert str(a.ipv6) == "fd00:88::2/64" and str(a.gateway6) == "fd00:88::1"


def test_corrupt_file_is_a_clear_error(tmp_path):
    (tmp_path / "l.json").write_text("{not json")
    with pytest.raises(ValueError, match="read IPAM leases"):
        Ipam(tmp_path / "l.json", "10.88.0.0/24")
