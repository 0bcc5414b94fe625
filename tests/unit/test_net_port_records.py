"""Where a sandbox's record keeps its published ports: a daemon from before
UDP ports must not read a UDP publication as a TCP port (a downgrade would
publish the sandbox's TCP port of that number), and this daemon reads every
form a record has had."""

from __future__ import annotations

import json

from dsecd.net.network import _Sandbox, recorded_ports


def _written() -> dict:
    """The record of a sandbox with 8080/tcp and 5353/udp published, as the daemon writes it."""
    sb = _Sandbox("sb1", "default", "/sys/fs/cgroup/dsecd/sb1", 42, ifname="dssb1", ipv4="10.88.1.5/16")
    sb.ports[(8080, "tcp")] = {"port": 8080, "protocol": "tcp", "host_port": 30000, "bind": ""}
    sb.ports[(5353, "udp")] = {"port": 5353, "protocol": "udp", "host_port": 30001, "bind": ""}
    return json.loads(json.dumps(sb.record()))


def _older_daemon_publishes(rec: dict) -> list[tuple[int, int]]:
    """(host port, sandbox port) of each TCP DNAT a daemon from before UDP
    ports makes from a record: its readopt (Network._republish) publishes
    every entry of `ports` with its `port`, `host_port` and `bind`, and
    nothing else of the record."""
    return [(int(pub["host_port"]), int(pub["port"])) for pub in rec.get("ports", [])]


def test_an_older_daemon_takes_no_udp_publication_for_a_tcp_port():
    assert _older_daemon_publishes(_written()) == [(30000, 8080)]


def test_the_daemon_reads_its_records_back_and_the_earlier_forms():
    def seen(rec: dict) -> list[tuple[int, str, int, str]]:
        return sorted((p["port"], p["protocol"], p["host_port"], p["bind"]) for p in recorded_ports(rec))

    both = [(5353, "udp", 30001, ""), (8080, "tcp", 30000, "")]
    assert seen(_written()) == both
    # A record that kept UDP ports under `ports`, naming their protocol.
    assert seen({"ports": [{"port": 8080, "protocol": "tcp", "host_port": 30000, "bind": ""},
                           {"port": 5353, "protocol": "udp", "host_port": 30001, "bind": ""}]}) == both
    # A record of a daemon that published TCP only: no protocol, maybe no bind.
    assert seen({"ports": [{"port": 8080, "host_port": 30000}]}) == [(8080, "tcp", 30000, "")]
    assert seen({"id": "sb1"}) == []
