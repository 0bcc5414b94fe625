"""The whole-table conntrack reads of a destroy (dsecd/net/ctdump.py,
nat.forget_address for IPv6), against a real table in a test-owned netns."""

from __future__ import annotations

import concurrent.futures
import errno
import ipaddress
import os
import secrets
import socket
import subprocess
import time

import pytest

from dsecd.net import ctdump, nat

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, conntrack)")


@pytest.fixture
def netns():
    name = f"dsecd-test-ct-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield f"/run/netns/{name}"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def _ct(ns_path: str, family: int):
    from pyroute2 import Conntrack

    s = nat._netfilter_socket(ns_path)
    s.bind((0, 0))
    return Conntrack(fileno=s.detach(), nfgen_family=family)


def _add(ns_path: str, flows: list[tuple[str, str, int]]) -> None:
    """A tracked TCP flow per (source, destination, source port)."""
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    fam = socket.AF_INET6 if ":" in flows[0][0] else socket.AF_INET
    with _ct(ns_path, fam) as ct:
        for src, dst, sport in flows:
            ct.entry("add", timeout=600, status=0x8 | 0x2,
                     tuple_orig=NFCTAttrTuple(family=fam, saddr=src, daddr=dst, proto=6, sport=sport, dport=80),
                     tuple_reply=NFCTAttrTuple(family=fam, saddr=dst, daddr=src, proto=6, sport=80, dport=sport))


def _table(ns_path: str, family: int) -> set[tuple[str, str, int]]:
    with _ct(ns_path, family) as ct:
        return {(str(e.tuple_orig.saddr), str(e.tuple_orig.daddr), e.tuple_orig.sport) for e in ct.dump_entries()}


def test_forget_address_deletes_the_ipv6_entries_from_and_to_it_and_no_other(netns):
    ours, other, peer = "fd00::7", "fd00::8", "fd01::1"
    flows = [(ours, peer, 1000 + i) for i in range(5)] + [(peer, ours, 2000 + i) for i in range(3)] \
        + [(other, peer, 3000 + i) for i in range(300)] + [(peer, other, 4000)]
    _add(netns, flows)
    assert nat.forget_address(netns, ours) == 8
    assert _table(netns, socket.AF_INET6) == {f for f in flows if ours not in f[:2]}
    assert nat.forget_address(netns, ours) == 0


def test_an_ipv6_address_inside_another_is_not_taken_for_it(netns):
    """The byte search before the parse only skips: a message holding the
    address's bytes elsewhere is parsed and matched by its tuple."""
    ours = "fd00::1:0"
    lookalike = "fd00::1:0:0"         # another address
    _add(netns, [(lookalike, "fd01::1", 5000), ("fd01::2", "fd00::", 5001)])
    assert nat.forget_address(netns, ours) == 0
    assert len(_table(netns, socket.AF_INET6)) == 2


def test_a_delete_of_an_entry_gone_meanwhile_is_no_error(netns):
    _add(netns, [("10.9.0.2", "10.9.0.3", 6000), ("10.9.0.2", "10.9.0.4", 6001)])
    with ctdump.CtSocket(nat._netfilter_socket(netns)) as ct:
        entries = ct.dump(socket.AF_INET)
        assert {(socket.inet_ntop(socket.AF_INET, e.src), socket.inet_ntop(socket.AF_INET, e.dst))
                for e in entries} == {("10.9.0.2", "10.9.0.3"), ("10.9.0.2", "10.9.0.4")}
        assert [ct.delete(socket.AF_INET, e) for e in entries] == [True, True]
        assert [ct.delete(socket.AF_INET, e) for e in entries] == [False, False]
    assert _table(netns, socket.AF_INET) == set()


def _hold_first_dump_until(monkeypatch, forgets: nat.Ipv6Forgets, queued: int, fail: bool = False) -> list:
    """The first dump of `forgets` starts once `queued` other addresses wait
    for the next one (or fails, with `fail`); the address sets of each dump."""
    real, seen = nat._forget_ipv6, []

    def held(ns_path, addresses):
        seen.append(set(addresses))
        if len(seen) == 1:
            while True:
                with forgets._cond:
                    if len(forgets._asked) >= queued:
                        break
                time.sleep(0.005)
            if fail:
                raise nat.NatError(errno.EPERM, "conntrack: refused")
        return real(ns_path, addresses)

    monkeypatch.setattr(nat, "_forget_ipv6", held)
    return seen


def test_concurrent_ipv6_forgets_share_one_dump_and_each_gets_its_count(netns, monkeypatch):
    addrs = [f"fd00::{i + 1:x}" for i in range(6)]
    _add(netns, [(a, "fd01::1", 7000 + 10 * i + k) for i, a in enumerate(addrs) for k in range(i + 1)]
         + [("fd00::99", "fd01::1", 7999)])
    forgets = nat.Ipv6Forgets(netns)
    dumps = _hold_first_dump_until(monkeypatch, forgets, queued=5)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        first = pool.submit(nat.forget_address, netns, addrs[0], forgets)
        while not dumps:
            time.sleep(0.005)
        rest = [pool.submit(nat.forget_address, netns, a, forgets) for a in addrs[1:]]
        counts = [first.result(30)] + [f.result(30) for f in rest]
    assert counts == [1, 2, 3, 4, 5, 6]
    assert forgets.dumps == 2 and dumps[1] == {ipaddress.ip_address(a).packed for a in addrs[1:]}
    assert _table(netns, socket.AF_INET6) == {("fd00::99", "fd01::1", 7999)}


def test_a_failed_shared_dump_fails_every_caller_it_served_and_no_later_one(netns, monkeypatch):
    _add(netns, [("fd00::1", "fd01::1", 8000), ("fd00::2", "fd01::1", 8001)])
    forgets = nat.Ipv6Forgets(netns)
    dumps = _hold_first_dump_until(monkeypatch, forgets, queued=1, fail=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(nat.forget_address, netns, "fd00::1", forgets)
        while not dumps:
            time.sleep(0.005)
        second = pool.submit(nat.forget_address, netns, "fd00::2", forgets)
        with pytest.raises(nat.NatError, match="refused"):
            first.result(30)
        assert second.result(30) == 1          # its own dump, after the failed one
    assert nat.forget_address(netns, "fd00::1", forgets) == 1


def test_a_delete_refused_in_a_shared_dump_fails_only_its_address(netns, monkeypatch):
    """An entry the kernel will not delete (EBUSY: offloaded to a flow
    table) fails the forget of its own address; the dump it was part of
    goes on and deletes the entries of every other address, and of its
    own that it can."""
    ours, busy = ipaddress.ip_address("fd00::1").packed, ipaddress.ip_address("fd00::2").packed
    _add(netns, [("fd00::1", "fd01::1", 9000), ("fd00::2", "fd01::1", 9001), ("fd01::1", "fd00::2", 9002),
                 ("fd00::1", "fd01::1", 9003)])
    real = ctdump.CtSocket.delete

    def delete(self, family, entry):
        if entry.src == busy and entry.dst != busy:
            raise ctdump.CtError(errno.EBUSY, "conntrack: Device or resource busy")
        return real(self, family, entry)

    monkeypatch.setattr(ctdump.CtSocket, "delete", delete)
    forgets = nat.Ipv6Forgets(netns)
    dumps = _hold_first_dump_until(monkeypatch, forgets, queued=2)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(nat.forget_address, netns, "fd00::9", forgets)
        while not dumps:
            time.sleep(0.005)
        mine = pool.submit(nat.forget_address, netns, "fd00::1", forgets)
        theirs = pool.submit(nat.forget_address, netns, "fd00::2", forgets)
        assert first.result(30) == 0
        assert mine.result(30) == 2
        with pytest.raises(nat.NatError) as err:
            theirs.result(30)
    assert err.value.errno == errno.EBUSY
    assert dumps[1:] == [{ours, busy}], dumps           # one dump for both
    assert _table(netns, socket.AF_INET6) == {("fd00::2", "fd01::1", 9001)}
