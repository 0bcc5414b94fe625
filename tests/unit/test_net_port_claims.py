"""Published host ports claimed host-wide (nat.PortClaims): TCP and UDP
ports of one number apart, held while any of this daemon's publications of
the port stands, and what another process sees meanwhile."""

from __future__ import annotations

import os
import subprocess
import sys

from dsecd.net.nat import PortClaims


def _other_claims(path: str, proto: str, port: int) -> int | None:
    """What another process (another daemon) gets claiming `proto` `port`:
    None if it got it (it lets go as it exits), else the holder's pid."""
    code = ("import sys; from dsecd.net.nat import PortClaims; "
            f"print(PortClaims(None, {path!r}).claim({proto!r}, {port}, 'other'))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    return None if out == "None" else int(out)


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
    assert claims.held() == {("tcp", 30000): {"sb1:80"}, ("udp", 30000): {"sb1:53/udp"}}
    assert _other_claims(path, "tcp", 30001) is None
    assert _other_claims(path, "udp", 30000) == os.getpid()
    claims.keep_only(set())
    assert _other_claims(path, "tcp", 30000) is None
