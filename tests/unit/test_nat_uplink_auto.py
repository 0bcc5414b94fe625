"""net.uplink = "auto" (nat.default_route_ifname): the interface of the
IPv4 default route, read from a route dump fed through a stand-in socket."""

from __future__ import annotations

import socket
import struct

import pyroute2
import pytest
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from dsecd.net import nat, nldump

HDR = struct.Struct("=IHHII")
NLM_F_MULTI = 0x2
RT_TABLE_MAIN = 254
LINKS = {2: "eth0", 7: "wg0"}


def _default_route(table: int, oif: int) -> bytes:
    m = rtmsg()
    m["family"], m["table"], m["type"] = socket.AF_INET, min(table, 255), 1      # RTN_UNICAST
    m["attrs"] = [["RTA_TABLE", table], ["RTA_OIF", oif], ["RTA_GATEWAY", "192.0.2.1"]]
    m.encode()
    return bytes(m.data[HDR.size:])


class _RouteDump:
    """A NETLINK_ROUTE socket's stand-in answering one route dump with the
    default routes `routes` ((table, oif) each, in the kernel's order)."""

    def __init__(self, routes: list[tuple[int, int]]):
        self.routes = routes
        self.queue: list[bytes] = []

    def send(self, data: bytes) -> int:
        seq = HDR.unpack_from(data)[3]
        out = b""
        for table, oif in self.routes:
            body = _default_route(table, oif)
            out += HDR.pack(HDR.size + len(body), nldump.RTM_NEWROUTE, NLM_F_MULTI, seq, 0) + body
        self.queue += [out, HDR.pack(HDR.size + 4, nldump.NLMSG_DONE, NLM_F_MULTI, seq, 0) + struct.pack("=i", 0)]
        return len(data)

    def recvmsg(self, _size: int) -> tuple[bytes, list, int, None]:
        return self.queue.pop(0), [], 0, None

    def close(self) -> None:
        pass

    def detach(self) -> int:
        return -1


class _Link:
    def __init__(self, name: str):
        self.name = name

    def get_attr(self, attr: str) -> str | None:
        return self.name if attr == "IFLA_IFNAME" else None


class _Links:
    """IPRoute's stand-in: the links of LINKS by index."""

    def __init__(self, **_kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_exc) -> None:
        pass

    def get_links(self, index: int) -> list[_Link]:
        return [_Link(LINKS[index])] if index in LINKS else []


@pytest.mark.parametrize("routes", [[(100, 7), (RT_TABLE_MAIN, 2)], [(RT_TABLE_MAIN, 2), (100, 7)]])
def test_the_main_tables_default_route_is_the_uplink_whatever_other_tables_hold(monkeypatch, routes):
    """A host with policy routing (a VPN's table 100 with a default route of
    its own, dumped before main's) had that table's interface taken as the
    uplink, and the sandboxes' egress masqueraded on it, though the traffic
    the main table routes leaves by eth0."""
    monkeypatch.setattr(nat, "netlink_socket", lambda _ns: _RouteDump(routes))
    monkeypatch.setattr(pyroute2, "IPRoute", _Links)
    assert nat.default_route_ifname(None) == "eth0"


def test_a_default_route_of_another_table_serves_where_main_has_none(monkeypatch):
    monkeypatch.setattr(nat, "netlink_socket", lambda _ns: _RouteDump([(100, 7)]))
    monkeypatch.setattr(pyroute2, "IPRoute", _Links)
    assert nat.default_route_ifname(None) == "wg0"


def test_no_default_route_says_what_to_set(monkeypatch):
    monkeypatch.setattr(nat, "netlink_socket", lambda _ns: _RouteDump([]))
    monkeypatch.setattr(pyroute2, "IPRoute", _Links)
    with pytest.raises(nat.NatError, match="net.uplink"):
        nat.default_route_ifname(None)
