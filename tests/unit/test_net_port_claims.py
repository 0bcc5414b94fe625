"""Published host ports claimed host-wide (nat.PortClaims): TCP and UDP
ports of one number apart, one port on two bind addresses apart but not on
every address and on one, held while any of this daemon's publications of
the port stands, and what another process sees meanwhile."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from dsecd.hostclaims import HostClaims
from dsecd.net.nat import PortClaims


def _other_claims(path: str, proto: str, port: int, bind: str = "") -> int | None:
    """What another process (another daemon) gets claiming `proto` `port` on
    `bind`: None if it got it (it lets go as it exits), else the holder's pid."""
    code = ("import sys; from dsecd.net.nat import PortClaims; "
            f"print(PortClaims(None, {path!r}).claim({proto!r}, {port}, 'other', {bind!r}))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    return None if out == "None" else int(out)


@contextlib.contextmanager
def _holding(path: str, proto: str, port: int, bind: str, old_version: bool = False):
    """Another process (another daemon) holding `proto` `port` on `bind`
    until the block ends; `old_version`: claimed as a daemon that claimed
    per port only did (an exclusive lock on the port's byte of the one
    file, whatever the bind address). Yields its pid."""
    if old_version:
        claim = (f"c = PortClaims(None, {path!r}); "
                 f"r = HostClaims({path!r}).claim(c._offset({proto!r}, {port}), 1)")
    else:
        claim = f"r = PortClaims(None, {path!r}).claim({proto!r}, {port}, 'other', {bind!r})"
    code = ("import sys; from dsecd.hostclaims import HostClaims; from dsecd.net.nat import PortClaims; "
            f"{claim}; print(r, flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        got = child.stdout.readline().strip()         # claimed (or refused) once it says
        assert got == "None", f"the other process did not get {proto} {port} on {bind or 'every address'}: {got}"
        yield child.pid
    finally:
        child.stdin.close()
        child.wait(timeout=30)


def test_a_claimed_port_is_this_daemon_s_until_its_last_publication_goes(tmp_path):
    path = str(tmp_path / "ports.lock")
    claims = PortClaims(None, path)
    assert claims.claim("tcp", 30000, "sb1:8080") is None
    assert _other_claims(path, "tcp", 30000) == os.getpid()
    assert _other_claims(path, "udp", 30000) is None            # UDP 30000 is another port
    # Two publications on one host port (different bind addresses).
    assert claims.claim("tcp", 30000, "sb2:8080") is None
    claims.give_up("tcp", 30000, "sb1:8080")
    assert _other_claims(path, "tcp", 30000) == os.getpid()
    claims.give_up("tcp", 30000, "sb1:8080")                     # again: a no-op
    assert _other_claims(path, "tcp", 30000) == os.getpid()
    claims.give_up("tcp", 30000, "sb2:8080")
    assert _other_claims(path, "tcp", 30000) is None
    assert claims.held() == {}


def test_keep_only_gives_up_the_claims_of_publications_not_kept(tmp_path):
    path = str(tmp_path / "ports.lock")
    claims = PortClaims(None, path)
    for proto, port, user in (("tcp", 30000, "sb1:80"), ("udp", 30000, "sb1:53/udp"), ("tcp", 30001, "gone:80")):
        assert claims.claim(proto, port, user) is None
    claims.keep_only({"sb1:80", "sb1:53/udp"})
    assert claims.held() == {("tcp", "", 30000): {"sb1:80"}, ("udp", "", 30000): {"sb1:53/udp"}}
    assert _other_claims(path, "tcp", 30001) is None
    assert _other_claims(path, "udp", 30000) == os.getpid()
    claims.keep_only(set())
    assert _other_claims(path, "tcp", 30000) is None


def test_one_port_on_two_addresses_is_two_daemons_but_not_on_one(tmp_path):
    path = str(tmp_path / "ports.lock")
    with _holding(path, "tcp", 30000, "10.0.0.5") as other:
        claims = PortClaims(None, path)
        assert claims.claim("tcp", 30000, "sb1:80", "10.0.0.6") is None
        assert claims.claim("tcp", 30000, "sb2:80", "10.0.0.5") == other
        assert claims.claim("tcp", 30000, "sb2:80") == other            # every address takes 10.0.0.5 too
        assert claims.claim("udp", 30000, "sb2:53/udp") is None          # UDP 30000 is another port
        assert claims.held() == {("tcp", "10.0.0.6", 30000): {"sb1:80"}, ("udp", "", 30000): {"sb2:53/udp"}}
        claims.give_up("tcp", 30000, "sb1:80", "10.0.0.6")
        claims.give_up("udp", 30000, "sb2:53/udp")
    assert claims.held() == {}
    assert _other_claims(path, "tcp", 30000) is None                    # all gone with both


@pytest.mark.parametrize("old_version", [False, True])
def test_a_port_claimed_on_every_address_excludes_it_on_any_one(tmp_path, old_version):
    """Claimed on every address by another daemon, or by a daemon of a
    version that claimed per port only (whatever its bind address): the
    port is taken on each address, and the other way round."""
    path = str(tmp_path / "ports.lock")
    claims = PortClaims(None, path)
    with _holding(path, "tcp", 30000, "", old_version) as other:
        assert claims.claim("tcp", 30000, "sb1:80", "10.0.0.5") == other
        assert claims.claim("tcp", 30000, "sb1:80") == other
        assert claims.held() == {}
    assert claims.claim("tcp", 30000, "sb1:80", "10.0.0.5") is None
    me = os.getpid()
    assert _other_claims(path, "tcp", 30000) == me
    assert _other_claims(path, "tcp", 30000, "10.0.0.5") == me
    assert _other_claims(path, "tcp", 30000, "10.0.0.6") is None
    c = PortClaims(None, path)
    code = ("from dsecd.hostclaims import HostClaims; "
            f"print(HostClaims({path!r}).claim({c._offset('tcp', 30000)}, 1))")
    old = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert old == str(me)                       # an old version's claim of the port is refused
    claims.give_up("tcp", 30000, "sb1:80", "10.0.0.5")
    assert _other_claims(path, "tcp", 30000) is None


def test_the_last_claim_on_every_address_gone_leaves_those_on_one(tmp_path):
    """One daemon holding a port on every address and on one (a journal's
    records claimed again at a restart): the every-address claim given up,
    others may take the port on other addresses, not on every one."""
    path = str(tmp_path / "ports.lock")
    claims = PortClaims(None, path)
    assert claims.claim("tcp", 30000, "sb1:80", "10.0.0.5") is None
    assert claims.claim("tcp", 30000, "sb2:80") is None
    assert _other_claims(path, "tcp", 30000, "10.0.0.6") == os.getpid()
    claims.give_up("tcp", 30000, "sb2:80")
    assert _other_claims(path, "tcp", 30000, "10.0.0.6") is None
    assert _other_claims(path, "tcp", 30000) == os.getpid()
    assert _other_claims(path, "tcp", 30000, "10.0.0.5") == os.getpid()
    claims.keep_only(set())
    assert _other_claims(path, "tcp", 30000) is None
    assert HostClaims(path).holder(PortClaims(None, path)._offset("tcp", 30000), 1) == 0
