"""Plumbing over rtnetlink (pyroute2's message classes): bridge, veth pairs, addresses.

No `ip` commands. The create path sends hand-batched netlink requests over
plain netlink sockets because pyroute2's high-level IPRoute costs about 1 ms
per request (it runs an asyncio loop per call); measured on the 2-core CI
machine: the IPRoute path took ~9 ms per sandbox, the three requests here
(create the pair, look up the peer's ifindex, one batch of address + link
up + route) ~2-4 ms, ~0.7 ms of it pyroute2's message encoding. IPRoute is
used only for the one-time bridge setup.

A sandbox's side is configured through a netlink socket opened *inside* its
netns: this worker thread setns()es into the netns, opens the socket, and
setns()es back (setns on CLONE_NEWNET changes only the calling thread, and a
socket stays in the netns it was created in).

The bridge lives in `host_netns` (a name under /run/netns or a path; "" is the
daemon's own netns). dsecd only ever creates, configures and deletes its own
bridge and `ds*` veths there; it adds no routes towards other interfaces (NAT
out of an uplink, when configured, is nat.py's own nftables table).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import socket
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns
from pyroute2.netlink import (
    NETLINK_ROUTE,
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_EXCL,
    NLM_F_REQUEST,
    NLMSG_ERROR,
)
from pyroute2.netlink.rtnl import RTM_DELLINK, RTM_GETLINK, RTM_NEWADDR, RTM_NEWLINK, RTM_NEWROUTE
from pyroute2.netlink.rtnl.ifaddrmsg import IFA_F_NODAD, ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import IFF_UP, ifinfmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from . import nldump
from .ipam import Lease

_NLMSG_HDR = struct.Struct("=IHHII")
_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_ID_IFNAME = re.compile(r"^[0-9a-z]{1,13}$")


def host_ifname(sb_id: str) -> str:
    """`ds<id>` (IFNAMSIZ is 16 with the NUL); long or odd ids are hashed."""
    if _ID_IFNAME.match(sb_id):
        return f"ds{sb_id}"
    return "ds" + hashlib.blake2s(sb_id.encode(), digest_size=8).hexdigest()[:13]


def vm_ifname(sb_id: str) -> str:
    """`dv<id>`: a microVM's tap on the bridge (as host_ifname, for taps)."""
    return "dv" + host_ifname(sb_id)[2:]


def vm_mac(ipv4: bytes) -> bytes:
    """A microVM's MAC: locally administered, unicast, 02:d5 and its IPv4
    address (its lease names it, so two VMs on the bridge never share one)."""
    return b"\x02\xd5" + ipv4


def netns_path(spec: int | str) -> str:
    """A pid (its netns), an absolute path, or a name under /run/netns."""
    if isinstance(spec, int):
        return f"/proc/{spec}/ns/net"
    if spec.startswith("/"):
        return spec
    return f"/run/netns/{spec}"


@contextmanager
def in_netns(path: str):
    """Run the block in netns `path` on this thread only; always switch back."""
    back = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise OSError(err.errno, f"open netns `{path}`: {os.strerror(err.errno)}") from err
        try:
            pr_netns.setns(fd, flags=0)
        finally:
            os.close(fd)
        try:
            yield
        finally:
            # A thread left in a sandbox's netns would open later sockets there.
            pr_netns.setns(back, flags=0)
    finally:
        os.close(back)


def netlink_socket(path: str | None = None, groups: int = 0) -> socket.socket:
    """A bound NETLINK_ROUTE socket in netns `path` (None: this thread's),
    receiving the notifications of the multicast `groups` (RTMGRP_* bits)."""
    if path is None:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
    else:
        with in_netns(path):
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
    s.bind((0, groups))
    return s


def request(sock: socket.socket, msgs: list[tuple[int, int, object, str]]) -> None:
    """Send (type, flags, msg, what) requests in one datagram; raise on the first error.

    The kernel handles the messages of one datagram in order and acks each.
    """
    buf = bytearray()
    for seq, (typ, flags, msg, _what) in enumerate(msgs, 1):
        msg["header"]["type"] = typ
        msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | flags
        msg["header"]["sequence_number"] = seq
        msg.encode()
        buf += msg.data
    sock.sendto(bytes(buf), (0, 0))
    pending, errors = set(range(1, len(msgs) + 1)), {}
    while pending:
        data = sock.recv(65536)
        off = 0
        while off + _NLMSG_HDR.size <= len(data):
            length, typ, _fl, seq, _pid = _NLMSG_HDR.unpack_from(data, off)
            if typ == NLMSG_ERROR and seq in pending:
                (err,) = struct.unpack_from("=i", data, off + 16)
                if err:
                    errors[seq] = -err
                pending.discard(seq)
            off += (length + 3) & ~3
    if errors:
        seq = min(errors)
        num, what = errors[seq], msgs[seq - 1][3]
        raise OSError(num, f"{what}: {os.strerror(num)}")


def ifindex(sock: socket.socket, name: str) -> int:
    """RTM_GETLINK by name on `sock`'s netns."""
    m = ifinfmsg()
    m["index"] = 0
    m["attrs"] = [["IFLA_IFNAME", name]]
    m["header"]["type"], m["header"]["flags"], m["header"]["sequence_number"] = RTM_GETLINK, NLM_F_REQUEST, 1
    m.encode()
    sock.sendto(m.data, (0, 0))
    while True:
        data = sock.recv(65536)
        _length, typ, _fl, seq, _pid = _NLMSG_HDR.unpack_from(data, 0)
        if seq != 1:
            continue
        if typ == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, 16)
            raise OSError(-err, f"find link `{name}`: {os.strerror(-err)}")
        # struct ifinfomsg after the 16-byte header: family, pad, type (u16), index (i32)
        return struct.unpack_from("=i", data, 16 + 4)[0]


def addr_msg(index: int, iface, nodad: bool) -> ifaddrmsg:
    m = ifaddrmsg()
    m["family"] = socket.AF_INET if iface.version == 4 else socket.AF_INET6
    m["prefixlen"] = iface.network.prefixlen
    m["index"] = index
    attrs = [["IFA_LOCAL", str(iface.ip)], ["IFA_ADDRESS", str(iface.ip)]]
    if nodad:
        # No duplicate address detection: the address is ours by lease, and DAD
        # would keep it tentative (unusable) for about a second.
        attrs.append(["IFA_FLAGS", IFA_F_NODAD])
    m["attrs"] = attrs
    return m


def _default_route_msg(gateway, oif: int) -> rtmsg:
    m = rtmsg()
    m["family"] = socket.AF_INET if gateway.version == 4 else socket.AF_INET6
    m["dst_len"], m["table"], m["proto"], m["scope"], m["type"] = 0, 254, 4, 0, 1
    m["attrs"] = [["RTA_GATEWAY", str(gateway)], ["RTA_OIF", oif]]
    return m


def link_up_msg(index: int) -> ifinfmsg:
    m = ifinfmsg()
    m["index"], m["flags"], m["change"] = index, IFF_UP, IFF_UP
    return m


@dataclass
class BridgeSpec:
    name: str
    mtu: int
    host_netns: str           # "" = the daemon's own netns
    gateway4: str             # "10.88.0.1/16"
    gateway6: str = ""        # "fd00:88::1/64" or ""
    sandbox_ifname: str = "eth0"


class Plumbing:
    """The host bridge and the per-sandbox veth pairs."""

    def __init__(self, spec: BridgeSpec):
        self.spec = spec
        self.ns_path = netns_path(spec.host_netns) if spec.host_netns else None
        # One host-side netlink socket per worker thread: no lock, so a slow
        # request (deleting a veth waits ~20 ms for RCU in the kernel) does not
        # hold up the other workers' creates.
        self._local = threading.local()
        self._all: list[socket.socket] = []
        self._all_lock = threading.Lock()
        self.bridge_index = self._ensure_bridge()

    @property
    def _sock(self) -> socket.socket:
        s = getattr(self._local, "sock", None)
        if s is None:
            s = self._local.sock = netlink_socket(self.ns_path)
            with self._all_lock:
                self._all.append(s)
        return s

    def close(self) -> None:
        with self._all_lock:
            for s in self._all:
                s.close()
            self._all.clear()

    def _ensure_bridge(self) -> int:
        """Create the bridge once (or find it after a restart), give it the gateways, up."""
        import ipaddress

        ipr = IPRoute(fileno=netlink_socket(self.ns_path).detach(), groups=0)
        try:
            found = ipr.link_lookup(ifname=self.spec.name)
            if not found:
                ipr.link("add", ifname=self.spec.name, kind="bridge", mtu=self.spec.mtu, address=_random_mac())
                found = ipr.link_lookup(ifname=self.spec.name)
            idx = found[0]
            # A bridge whose MAC was never set takes the lowest of its ports' and
            # changes it as veths come and go: every sandbox that cached the gateway's
            # MAC would then send to a port instead of the gateway until its ARP entry
            # expires. Setting it, even to the current value, pins it.
            mac = ipr.get_links(idx)[0].get_attr("IFLA_ADDRESS")
            ipr.link("set", index=idx, address=mac)
            have = {(a.get_attr("IFA_ADDRESS"), a["prefixlen"]) for a in self._dump(nldump.addresses)
                    if a["index"] == idx}
            for gw in filter(None, (self.spec.gateway4, self.spec.gateway6)):
                iface = ipaddress.ip_interface(gw)
                if (str(iface.ip), iface.network.prefixlen) not in have:
                    request(self._sock, [(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL,
                                          addr_msg(idx, iface, iface.version == 6), f"add {gw} to bridge")])
            ipr.link("set", index=idx, state="up")
            return idx
        finally:
            ipr.close()

    def add_sandbox(self, host_if: str, sandbox_ns: str, lease: Lease) -> str:
        """veth `host_if` on the bridge, its peer `eth0` in the sandbox netns, addressed and routed
        (and lo up: a pool netns has nobody else to do it)."""
        nsfd = os.open(sandbox_ns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            m = ifinfmsg()
            m["index"], m["flags"], m["change"] = 0, IFF_UP, IFF_UP
            # The peer is created directly in the sandbox netns. It cannot be
            # brought up in the same request (the kernel answers ENOTCONN), and
            # its ifindex there is the kernel's choice (a requested peer index is
            # ignored unless the host side's is given too), hence the lookup below.
            peer = {"index": 0, "flags": 0, "change": 0,
                    "attrs": [["IFLA_IFNAME", self.spec.sandbox_ifname], ["IFLA_NET_NS_FD", nsfd],
                              ["IFLA_MTU", self.spec.mtu]]}
            m["attrs"] = [["IFLA_IFNAME", host_if], ["IFLA_MTU", self.spec.mtu],
                          ["IFLA_MASTER", self.bridge_index],
                          ["IFLA_LINKINFO", {"attrs": [["IFLA_INFO_KIND", "veth"], ["IFLA_INFO_DATA", {
                              "attrs": [["VETH_INFO_PEER", peer]]}]]}]]
            request(self._sock, [(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, m,
                                  f"create veth `{host_if}` into `{sandbox_ns}`")])
        finally:
            os.close(nsfd)
        try:
            self._configure_inside(sandbox_ns, lease)
        except BaseException:
            self.remove_sandbox(host_if)
            raise
        return host_if

    def _configure_inside(self, sandbox_ns: str, lease: Lease) -> None:
        sock = netlink_socket(sandbox_ns)
        try:
            idx = ifindex(sock, self.spec.sandbox_ifname)
            request(sock, self._inside_msgs(idx, lease))
        except OSError as err:
            raise OSError(err.errno, f"configure `{self.spec.sandbox_ifname}` in `{sandbox_ns}`: "
                          f"{err.strerror}") from err
        finally:
            sock.close()

    def _inside_msgs(self, idx: int, lease: Lease) -> list:
        msgs = [(RTM_NEWLINK, 0, link_up_msg(1), "set lo up"),      # lo is ifindex 1 in every netns
                (RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, addr_msg(idx, lease.ipv4, False), f"add {lease.ipv4}"),
                (RTM_NEWLINK, 0, link_up_msg(idx), "set sandbox link up"),
                (RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, _default_route_msg(lease.gateway4, idx),
                 f"add default route via {lease.gateway4}")]
        if lease.ipv6 is not None:
            msgs += [(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, addr_msg(idx, lease.ipv6, True), f"add {lease.ipv6}"),
                     (RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, _default_route_msg(lease.gateway6, idx),
                      f"add default route via {lease.gateway6}")]
        return msgs

    def add_tap(self, name: str) -> tuple[int, int]:
        """A tap device `name` on the bridge, up: (the fd that holds it, its
        ifindex). Not persistent: it goes when the last fd on it closes, so a
        microVM's QEMU, given the fd, takes its tap along when it exits.
        Made in the bridge netns: a tun fd's device is created in the netns
        /dev/net/tun was opened in."""
        if self.ns_path:
            with in_netns(self.ns_path):
                fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        else:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            ifr = struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI)
            try:
                fcntl.ioctl(fd, _TUNSETIFF, ifr)
            except OSError as err:
                raise OSError(err.errno, f"create tap `{name}`: {err.strerror}") from err
            idx = ifindex(self._sock, name)
            m = ifinfmsg()
            m["index"], m["flags"], m["change"] = idx, IFF_UP, IFF_UP
            m["attrs"] = [["IFLA_MTU", self.spec.mtu], ["IFLA_MASTER", self.bridge_index]]
            request(self._sock, [(RTM_NEWLINK, 0, m, f"put tap `{name}` on the bridge and up")])
        except BaseException:
            os.close(fd)
            raise
        return fd, idx

    def link_index(self, name: str) -> int | None:
        """The ifindex of link `name` in the bridge netns, None if there is none."""
        try:
            return ifindex(self._sock, name)
        except OSError as err:
            if err.errno == errno.ENODEV:
                return None
            raise

    def remove_sandbox(self, host_if: str) -> bool:
        """Delete the host side `host_if` (the peer goes with it); False if already gone
        (a netns that died took the pair with it)."""
        m = ifinfmsg()
        m["index"] = 0
        m["attrs"] = [["IFLA_IFNAME", host_if]]
        try:
            request(self._sock, [(RTM_DELLINK, 0, m, f"delete veth `{host_if}`")])
        except OSError as err:
            if err.errno == errno.ENODEV:
                return False
            raise
        return True

    def has_sandbox(self, host_if: str) -> bool:
        m = ifinfmsg()
        m["index"] = 0
        m["attrs"] = [["IFLA_IFNAME", host_if]]
        try:
            # RTM_NEWLINK without CREATE on an existing link with no changes: a cheap existence probe.
            request(self._sock, [(RTM_NEWLINK, 0, m, "probe veth")])
        except OSError as err:
            if err.errno == errno.ENODEV:
                return False
            raise
        return True

    def _dump(self, what):
        """`what` (an nldump dump) of the bridge netns, over a socket of its own."""
        sock = netlink_socket(self.ns_path)
        try:
            return what(sock)
        finally:
            sock.close()

    def links_with_prefix(self, prefix: str) -> list[str]:
        """Names of the bridge netns' links starting with `prefix` (a start-up sweep; not hot)."""
        names = [link.get_attr("IFLA_IFNAME") or "" for link in self._dump(nldump.links)]
        return [n for n in names if n.startswith(prefix)]


    def local_addresses(self, subnets: bool = False) -> list:
        """The addresses of every interface of the bridge netns (the host
        side: its uplink's, the gateways, any other), as ipaddress objects.
        subnets: with the addresses of their subnets the host also takes as
        its own, from whichever interface a packet comes: each IPv4 subnet's
        broadcast (and any IFA_BROADCAST given), and each IPv6 prefix's
        subnet-router anycast (the prefix itself, answered while the host
        forwards IPv6)."""
        import ipaddress

        out = []
        for a in self._dump(nldump.addresses):
            # IFA_LOCAL is this side's address; IFA_ADDRESS is the same
            # but on a point-to-point one (`ip addr add A peer B`), where
            # it is the peer's.
            text = a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")
            if not text:
                continue
            addr = ipaddress.ip_address(text)
            out.append(addr)
            if not subnets or addr.is_loopback:
                continue
            net = ipaddress.ip_interface(f"{addr}/{a['prefixlen']}").network
            if addr.version == 4 and net.prefixlen < 31:
                out.append(net.broadcast_address)
            elif addr.version == 6 and net.prefixlen < 127:
                out.append(net.network_address)
            if a.get_attr("IFA_BROADCAST"):
                out.append(ipaddress.ip_address(a.get_attr("IFA_BROADCAST")))
        return list(dict.fromkeys(out))


def bridge_exists(host_netns: str, name: str) -> bool:
    """Whether `name` is a link in `host_netns` ("" = this process's netns): a daemon
    start asks whether networking was in use on this host before (the bridge
    outlives daemons, not reboots)."""
    try:
        ns = netns_path(host_netns) if host_netns else None
        if ns is not None and not os.path.exists(ns):
            return False
        ipr = IPRoute(fileno=netlink_socket(ns).detach(), groups=0)
    except OSError:
        return False
    try:
        return bool(ipr.link_lookup(ifname=name))
    finally:
        ipr.close()


def _random_mac() -> str:
    """A random unicast, locally administered MAC (the bridge's own, see _ensure_bridge)."""
    b = bytearray(os.urandom(6))
    b[0] = (b[0] & 0xFE) | 0x02
    return ":".join(f"{x:02x}" for x in b)
