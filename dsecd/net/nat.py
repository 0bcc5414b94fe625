"""dsecd's own nftables table in the bridge netns: egress NAT and published ports.

    nat = HostNat(ns_path, bridge="dsec0", subnet4="10.88.0.0/16", uplink="eth0")
    nat.start()                        # (re)creates `inet dsecd`; ip_forward on when uplink is set
    nat.publish(key, 31000, "", "10.88.1.5", 8080)    # DNAT host port -> sandbox port (tcp)
    nat.publish(key, 31001, "", "10.88.1.5", 5353, "udp")
    nat.unpublish(key)
    nat.close()                        # deletes `inet dsecd`

Everything goes through libnftables' JSON API (Debian's python3-nftables):
one transaction per change, so a rule set is either fully in or not at all,
and no `nft` process is spawned. dsecd creates, changes and deletes only its
table `inet dsecd` (`inet dsecd-<bridge>` when net.bridge is not dsec0, so that
daemons sharing a netns keep apart); every other table of the host's ruleset
is left alone. Daemons sharing a bridge would share its table: it is claimed
host-wide (a record lock on /run/dsecd-nat.lock, at the bridge's block) by
the daemon that makes it, for as long as that daemon lives. Another daemon
on the bridge neither makes it anew (start refuses, EBUSY) nor deletes it
as a leftover.
Its chains are base chains with their own hooks: an `accept` here does not
override a `drop` of another table (an operator's firewall keeps the last word).

The table holds:
  postrouting  (nat, srcnat)  masquerade the bridge subnet out of the uplink
  prerouting   (nat, dstnat)  published ports, for connections from outside
  output       (nat, dstnat)  published ports, for the bridge netns' own connections
  forward      (filter)       into the bridge only what was published or answers
                              a sandbox's connection: with ip_forward on, hosts
                              on the uplink side must not reach sandboxes directly

A connection from the bridge netns to 127.0.0.1 cannot be DNATed to a sandbox
(the kernel drops a loopback source leaving by the bridge unless
route_localnet is set for the whole netns), so published ports answer on
non-loopback local addresses only (the bridge's gateway address always works).

libnftables opens its netlink socket when its context is made, in the calling
thread's netns, and uses it for every command: the context is made inside
`in_netns(ns_path)`, and then talks to that netns whatever thread uses it.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
import threading

from ..hostclaims import HostClaims, pids_note
from . import ctdump, nldump
from .ctdump import NETLINK_NETFILTER
from .ipam import bridge_block
from .plumbing import in_netns, netlink_socket

log = logging.getLogger(__name__)

FAMILY = "inet"
TABLE = "dsecd"
DEFAULT_BRIDGE = "dsec0"
# Where a daemon claims the table of its bridge (a byte at the bridge's block).
HOST_CLAIMS = "/run/dsecd-nat.lock"
# Where every daemon claims the host ports it publishes (PortClaims).
PORT_CLAIMS = "/run/dsecd-ports.lock"
RT_TABLE_MAIN = 254             # the routing table `ip route` shows


def _claim_table(ns_path: str | None, bridge: str) -> int | None:
    """Claim the table of `bridge` for this daemon: None once it is, else the
    pid of the daemon that has it (0: it let go a moment ago)."""
    return HostClaims(HOST_CLAIMS).claim(bridge_block(ns_path, bridge), 1)


def _give_up_table(ns_path: str | None, bridge: str) -> None:
    HostClaims(HOST_CLAIMS).give_up(bridge_block(ns_path, bridge), 1)


class PortClaims:
    """The host ports published in one netns (the bridge's), claimed
    host-wide per bind address: two daemons may publish one port on two
    addresses (their DNAT rules match apart), never one port on one
    address, nor on every address (bind "") and on any one of them. Two
    daemons of one netns each pick a host port, check it free (no
    listener, no other table's DNAT) and then add their DNAT: without the
    claim both could pick and publish the same one at the same moment. A
    claim is taken before those checks and held while the publication
    stands, so one port of one address is never two daemons'.

    The locks (HostClaims) are on byte `base + port` of a file for a TCP
    port, `base + 65536 + port` for a UDP one, where `base` is the netns's
    block (bridge_block with no bridge name: a host port is the netns's,
    whichever bridge its DNAT leads to):
      - PORT_CLAIMS, the every-address file: a publication on every
        address locks the port's byte exclusively there, one on a single
        address shares it (a read lock), so those on single addresses
        coexist and exclude one on every address;
      - PORT_CLAIMS with "-<address>" before ".lock", one file per bind
        address: a publication on that address locks the byte
        exclusively there.
    A daemon of a version that claimed per port only locks its byte in
    PORT_CLAIMS exclusively, whatever its bind address: it conflicts with
    every claim of the port here both ways, as it did before.

    Each of this daemon's publications claims its port under its own key
    (two publications may share a host port on different bind addresses):
    a byte is given up when the last of its publications goes. The
    lifetime is HostClaims': the daemon process's, so a restarted daemon
    claims its records' ports again. Not thread-safe by itself: callers
    hold a lock (Network does)."""

    def __init__(self, ns_path: str | None, path: str = PORT_CLAIMS):
        self.base = bridge_block(ns_path, "")
        self.path = path
        self.claims = HostClaims(path)
        # (protocol, host port) -> bind address ("": every one) -> publication keys
        self._users: dict[tuple[str, int], dict[str, set[str]]] = {}

    def _offset(self, proto: str, port: int) -> int:
        return self.base + (65536 if proto == "udp" else 0) + int(port)

    def _bound(self, bind: str) -> HostClaims:
        """The claims of the single address `bind` (opened once per process, as every HostClaims file)."""
        return HostClaims(f"{self.path.removesuffix('.lock')}-{bind}.lock")

    def _set_every_address(self, proto: str, port: int, binds) -> int | None:
        """Lock the port's byte of PORT_CLAIMS as `binds` (this daemon's bind
        addresses of it) need: exclusively if one is "" (every address),
        shared if there are only single ones, not at all if none. None once it
        is; else the pid of the daemon whose claim excludes it (this daemon's
        lock is then left as it was)."""
        off = self._offset(proto, port)
        if not binds:
            self.claims.give_up(off, 1)
            return None
        return self.claims.claim(off, 1, shared="" not in binds)

    def claim(self, proto: str, port: int, user: str, bind: str = "") -> int | None:
        """Claim `proto` host port `port` on `bind` ("": every address) for
        the publication `user`: None once it is this daemon's, else the pid
        of the daemon holding it (0: it let go a moment ago)."""
        port = int(port)
        held = self._users.get((proto, port), {})
        if bind in held:
            held[bind].add(user)
            return None
        had = set(held)
        if "" not in had and (not had or not bind):     # the every-address lock is taken or made exclusive
            pid = self._set_every_address(proto, port, had | {bind})
            if pid is not None:
                return pid
        if bind:
            pid = self._bound(bind).claim(self._offset(proto, port), 1)
            if pid is not None:
                self._set_every_address(proto, port, had)     # as it was
                return pid
        self._users.setdefault((proto, port), {})[bind] = {user}
        return None

    def give_up(self, proto: str, port: int, user: str, bind: str = "") -> None:
        """The publication `user` no longer holds the port on `bind` (a no-op
        if it did not); the bytes go with the last one."""
        port = int(port)
        held = self._users.get((proto, port))
        if held is None or user not in held.get(bind, ()):
            return
        held[bind].discard(user)
        if held[bind]:
            return
        del held[bind]
        if bind:
            self._bound(bind).give_up(self._offset(proto, port), 1)
        if not held:
            del self._users[(proto, port)]
        if not held or not bind:        # let go, or made shared again (never refused: it was exclusive)
            self._set_every_address(proto, port, set(held))

    def keep_only(self, users: set[str]) -> None:
        """Give up every claim of a publication not in `users` (those a
        restart claimed for records whose sandbox is gone, or whose port was
        not published again)."""
        for (proto, port), binds in list(self._users.items()):
            for bind, held in list(binds.items()):
                for user in held - users:
                    self.give_up(proto, port, user, bind)

    def held(self) -> dict[tuple[str, str, int], set[str]]:
        """(protocol, bind address, host port) -> the keys of this daemon's publications holding it."""
        return {(proto, bind, port): set(keys)
                for (proto, port), binds in self._users.items() for bind, keys in binds.items()}


def table_name(bridge: str) -> str:
    """The table of the daemon whose bridge is `bridge`: `dsecd` for the default
    bridge, `dsecd-<bridge>` for another. Daemons sharing a netns have bridges
    of their own, so each replaces and deletes only its own table."""
    return TABLE if bridge == DEFAULT_BRIDGE else f"{TABLE}-{bridge}"


class NatError(OSError):
    pass


def _nft(ns_path: str | None):
    """A libnftables context bound to the netns `ns_path`: it opens its netlink
    socket when made, in the calling thread's netns, and keeps it."""
    try:
        import nftables
    except ImportError as err:
        raise NatError(errno.ENOSYS, f"import nftables: {err}; install Debian's python3-nftables "
                       "(net.uplink and published ports need it)") from err
    with _maybe_netns(ns_path):
        nft = nftables.Nftables()
    nft.set_json_output(True)
    nft.set_handle_output(True)
    return nft


@contextlib.contextmanager
def _maybe_netns(ns_path: str | None):
    if ns_path is None:
        yield
    else:
        with in_netns(ns_path):
            yield


def run(nft, cmds: list[dict], what: str) -> list:
    """One transaction of JSON commands; raise NatError naming `what` on failure."""
    rc, out, err = nft.json_cmd({"nftables": cmds})
    if rc != 0:
        raise NatError(errno.EINVAL, f"nftables: {what}: {(err or '').strip() or f'rc {rc}'}")
    return (out or {}).get("nftables", []) if isinstance(out, dict) else []


def _base_chain(table: str, name: str, typ: str, hook: str, prio: int) -> dict:
    return {"chain": {"family": FAMILY, "table": table, "name": name, "type": typ, "hook": hook,
                      "prio": prio, "policy": "accept"}}


def _rule(table: str, chain: str, expr: list, comment: str | None = None) -> dict:
    r = {"family": FAMILY, "table": table, "chain": chain, "expr": expr}
    if comment:
        r["comment"] = comment
    return {"rule": r}


def _match(left: dict, right, op: str = "==") -> dict:
    return {"match": {"op": op, "left": left, "right": right}}


def _meta(key: str) -> dict:
    return {"meta": {"key": key}}


def _payload(proto: str, field: str) -> dict:
    return {"payload": {"protocol": proto, "field": field}}


def _prefix(net: ipaddress.IPv4Network) -> dict:
    return {"prefix": {"addr": str(net.network_address), "len": net.prefixlen}}


def probe(ns_path: str) -> None:
    """Load a real masquerade rule into a scratch table of the netns `ns_path` (a
    throwaway netns: the host's ruleset is never touched); raise NatError if it fails."""
    nft = _nft(ns_path)
    name = "dsecd-probe"
    run(nft, [{"add": {"table": {"family": FAMILY, "name": name}}},
              {"add": {"chain": {"family": FAMILY, "table": name, "name": "p", "type": "nat",
                                 "hook": "postrouting", "prio": 100, "policy": "accept"}}},
              {"add": {"rule": {"family": FAMILY, "table": name, "chain": "p",
                                "expr": [_match(_payload("ip", "saddr"), {"prefix": {"addr": "10.0.0.0", "len": 8}}),
                                         {"masquerade": None}]}}},
              {"delete": {"table": {"family": FAMILY, "name": name}}}],
        "load a masquerade rule")


def delete_table(ns_path: str | None, bridge: str) -> bool:
    """Delete the table of the daemon whose bridge is `bridge` from the netns,
    if there is one (a previous daemon's) and no live daemon has it (another
    one on the same bridge); whether it was deleted."""
    name = table_name(bridge)
    try:
        nft = _nft(ns_path)
    except NatError as err:
        if err.errno == errno.ENOSYS:   # no python3-nftables: no daemon here could have made one
            return False
        raise
    if _claim_table(ns_path, bridge) is not None:
        return False                    # the table of another daemon on the bridge, which runs
    try:
        return _delete(nft, name, f"delete table {FAMILY} {name}")
    finally:
        _give_up_table(ns_path, bridge)


def _delete(nft, table: str, what: str) -> bool:
    """Delete `table` (and every rule in it); whether it was there."""
    try:
        run(nft, [{"delete": {"table": {"family": FAMILY, "name": table}}}], what)
    except NatError as err:
        if "No such file" in str(err):
            return False
        raise
    return True


def default_route_ifname(ns_path: str | None) -> str:
    """The interface of the IPv4 default route in the netns (net.uplink = "auto")."""
    from pyroute2 import IPRoute

    sock = netlink_socket(ns_path)
    try:
        found = nldump.routes(sock, socket.AF_INET, "list the IPv4 routes")
    finally:
        sock.close()
    # A default route: one with no destination. The dump holds every
    # table's, in table order: another table's (policy routing: a VPN's,
    # say) would come before main's, whose is the one the sandboxes'
    # traffic leaves by unless rules say otherwise. Main's first; another
    # table's serves where main has none.
    defaults = [r for r in found if r.get_attr("RTA_DST") is None]
    defaults.sort(key=lambda r: (r.get_attr("RTA_TABLE") or r["table"]) != RT_TABLE_MAIN)
    oifs = [r.get_attr("RTA_OIF") for r in defaults]
    with IPRoute(fileno=netlink_socket(ns_path).detach(), groups=0) as ipr:
        for oif in filter(None, oifs):
            links = ipr.get_links(oif)
            if links:
                return links[0].get_attr("IFLA_IFNAME")
    where = f"netns `{ns_path}`" if ns_path else "the daemon's netns"
    raise NatError(errno.ENETUNREACH, f"net.uplink = \"auto\": no IPv4 default route in {where}; "
                   "set net.uplink to an interface name, or \"\" for no egress NAT")


def link_exists(ns_path: str | None, ifname: str) -> bool:
    """An interface named `ifname` is in the netns (now)."""
    from pyroute2 import IPRoute

    with IPRoute(fileno=netlink_socket(ns_path).detach(), groups=0) as ipr:
        return bool(ipr.link_lookup(ifname=ifname))


PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}


def forget_connections(ns_path: str | None, host_port: int, sb_addr: str, port: int, proto: str = "tcp") -> int:
    """Delete the conntrack entries of the netns for `proto` (tcp|udp) flows made
    to `host_port` and DNATed to `sb_addr`:`port` (the reply comes from there), and
    no other (a flow made to the sandbox's address itself has no DNAT):
    the next packet of such a TCP connection finds no DNAT and is answered with a
    reset; a datagram finds no DNAT to the sandbox. Returns how many were deleted."""
    from pyroute2.netlink.nfnetlink.nfctsocket import IPS_DST_NAT, NFCTAttrTuple

    def ours(entry) -> bool:
        reply = entry.tuple_reply
        return bool((entry.status or 0) & IPS_DST_NAT) and reply is not None and reply.saddr == sb_addr \
            and reply.sport == int(port)

    return _forget(ns_path, [NFCTAttrTuple(proto=PROTOCOLS[proto], dport=int(host_port))], ours)


def forget_address(ns_path: str | None, address: str, ipv6: Ipv6Forgets | None = None) -> int:
    """Delete the conntrack entries of the netns for every connection of a
    sandbox's `address` (IPv4, or its IPv6 one with net.ipv6_subnet): what it
    opened (masqueraded out of the uplink, or to the host side) and what was
    opened to it directly (those made through a published port go at its
    unpublish: forget_connections). A destroyed sandbox's entries would
    otherwise outlive it, a TCP one for days, and the next sandbox leased its
    address would inherit them: answers to the old connections, which
    `ct state established` lets into the bridge (the `inet` table's rule is
    IPv6's too), and their NAT bindings. Returns how many were deleted.

    IPv6 entries are dumped whole (the kernel keeps to the family) and
    matched here: the kernel's tuple filter inverts its IPv6 address
    comparison (ctnetlink_filter_match_tuple tests `!ipv6_addr_cmp`, so it
    passes every entry but the address's, seen on 6.18), which would find
    none of them. That dump is read with ctdump (pyroute2 decodes every
    attribute of every entry: ~0.4 ms per entry of the table), and shared
    with concurrent callers through `ipv6`, the netns' Ipv6Forgets."""
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    addr = ipaddress.ip_address(address)
    if addr.version == 6:
        return (ipv6 or Ipv6Forgets(ns_path)).forget(addr.packed)
    return _forget(ns_path, [NFCTAttrTuple(saddr=str(addr)), NFCTAttrTuple(daddr=str(addr))],
                   lambda _entry: True)


def _netfilter_socket(ns_path: str | None) -> socket.socket:
    """A netfilter netlink socket opened in the netns (`ns_path`; None: this
    one), which then speaks for that netns' conntrack table."""
    with _maybe_netns(ns_path):
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)


def _forget_ipv6(ns_path: str | None, addresses: set[bytes]) -> dict[bytes, int | NatError]:
    """Delete the IPv6 entries of the netns' table whose original direction
    is from or to one of `addresses` (packed, 16 bytes each), in one dump of
    the table; how many of each address's, or the NatError of the first of
    its entries the kernel would not delete (EBUSY: offloaded to a flow
    table). Such an entry fails its own address only: the others of the
    dump, its address's too, are still deleted. NatError if the dump fails."""
    # Few addresses: a substring search per message skips the parse of most.
    # Many: each message is parsed (a few us) rather than searched for each.
    containing = next(iter(addresses)) if len(addresses) == 1 else b""
    counts = dict.fromkeys(addresses, 0)
    errors: dict[bytes, NatError] = {}
    s = _netfilter_socket(ns_path)
    try:
        with ctdump.CtSocket(s) as ct:
            for entry in ct.dump(socket.AF_INET6, containing=containing):
                addr = entry.src if entry.src in counts else entry.dst if entry.dst in counts else None
                if addr is None:
                    continue
                try:
                    if ct.delete(socket.AF_INET6, entry):
                        counts[addr] += 1
                except ctdump.CtError as err:
                    errors.setdefault(addr, NatError(err.errno, err.strerror))
        return {**counts, **errors}
    except ctdump.CtError as err:
        raise NatError(err.errno, err.strerror) from err
    finally:
        s.close()


class Ipv6Forgets:
    """forget_address for IPv6 addresses of one netns, with the dumps of
    concurrent callers shared: the IPv6 table is read whole for any address
    (forget_address says why), so a mass destroy, its workers each asking
    for one address, would read it once per sandbox. A caller that finds no
    dump running takes every address asked for so far and does one dump for
    them all; the others wait for the dump that has their address. So at most
    one dump runs, and a request waits for at most the one running and its
    own."""

    def __init__(self, ns_path: str | None):
        self.ns_path = ns_path
        self._cond = threading.Condition()
        self._asked: dict[bytes, list[list]] = {}     # address -> its callers' [done, count, error]
        self._dumping = False
        self.dumps = 0                                 # for tests: dumps done

    def forget(self, packed: bytes) -> int:
        """Delete the entries of the IPv6 address `packed`; how many (NatError
        if the dump it was part of failed)."""
        mine = [False, 0, None]
        with self._cond:
            self._asked.setdefault(packed, []).append(mine)
            while not mine[0]:
                if self._dumping:
                    self._cond.wait()
                    continue
                batch, self._asked = self._asked, {}
                self._dumping = True
                self._cond.release()
                try:
                    counts, error = _forget_ipv6(self.ns_path, set(batch)), None
                except BaseException as err:   # every caller of the batch gets it
                    counts, error = {}, err
                finally:
                    self._cond.acquire()
                    self._dumping = False
                    self.dumps += 1
                for addr, callers in batch.items():
                    n = counts.get(addr, 0)
                    for caller in callers:      # an entry it could not delete fails its address's
                        caller[:] = [True, 0, n] if isinstance(n, NatError) else [True, n, error]
                self._cond.notify_all()
        if mine[2] is not None:
            raise mine[2]
        return mine[1]


def _forget(ns_path: str | None, filters: list, wanted, family: int = socket.AF_INET) -> int:
    """Delete the entries of the netns' conntrack table of `family` that one of
    `filters` (an NFCTAttrTuple of the original direction, matched by the
    kernel and again by pyroute2; None: every entry of the family) lists and
    `wanted(entry)` keeps; how many.

    pyroute2's ctnetlink client over a socket opened in the netns: the
    `conntrack` tool is not installed with dsecd (nor on Debian by
    default), and a process per destroy or unpublish would be the only
    subprocess on those paths."""
    from pyroute2 import Conntrack
    from pyroute2.netlink.exceptions import NetlinkError

    s = _netfilter_socket(ns_path)
    try:
        s.bind((0, 0))
    except OSError:
        s.close()
        raise
    fd = s.detach()
    try:
        ct = Conntrack(fileno=fd, nfgen_family=family)
    except BaseException:
        os.close(fd)
        raise
    n = 0
    try:
        with ct:
            for match in filters:
                for entry in list(ct.dump_entries(tuple_orig=match)):
                    if not wanted(entry):
                        continue
                    try:
                        ct.delete(entry)
                        n += 1
                    except NetlinkError as err:
                        if err.code != errno.ENOENT:             # else it ended meanwhile
                            raise
    except NetlinkError as err:
        raise NatError(err.code, f"conntrack: {os.strerror(err.code)}") from err
    return n


def enable_ip_forward(ns_path: str | None) -> bool:
    """net.ipv4.ip_forward = 1 in the netns (per netns; /proc/sys/net follows the
    opening thread's netns). True if this call turned it on."""
    path = "/proc/sys/net/ipv4/ip_forward"
    with _maybe_netns(ns_path):
        with open(path) as f:
            if f.read().strip() == "1":
                return False
        with open(path, "w") as f:
            f.write("1")
    return True


class HostNat:
    def __init__(self, ns_path: str | None, bridge: str, subnet4: str, uplink: str):
        self.ns_path = ns_path
        self.bridge = bridge
        self.table = table_name(bridge)
        self.subnet4 = ipaddress.ip_network(subnet4)
        self.uplink_cfg = uplink
        self.uplink = ""
        self.nft = None
        self._lock = threading.Lock()
        self._handles: dict[str, list[tuple[str, int]]] = {}     # key -> [(chain, rule handle)]
        self.started = False

    def _run(self, cmds: list[dict], what: str) -> list:
        return run(self.nft, cmds, what)

    def start(self) -> None:
        """(Re)create the table: a table of ours left by a daemon that died is replaced
        whole, in the same transaction (add, delete, add: atomic)."""
        self.nft = _nft(self.ns_path)
        pid = _claim_table(self.ns_path, self.bridge)
        if pid is not None:
            raise NatError(errno.EBUSY, f"nftables table {FAMILY} {self.table} of bridge {self.bridge} in "
                           f"{self._where()} is another daemon's" + pids_note([pid])
                           + ": daemons on one bridge cannot each have egress NAT or published ports; give this "
                           "daemon a net.bridge (and net.ipv4_subnet) of its own")
        try:
            self._start()
        except BaseException:
            _give_up_table(self.ns_path, self.bridge)
            raise

    def _start(self) -> None:
        if self.uplink_cfg == "auto":
            self.uplink = default_route_ifname(self.ns_path)
        else:
            self.uplink = self.uplink_cfg
        br, t = self.bridge, self.table
        cmds = [{"add": {"table": {"family": FAMILY, "name": t}}},
                {"delete": {"table": {"family": FAMILY, "name": t}}},
                {"add": {"table": {"family": FAMILY, "name": t}}},
                {"add": _base_chain(t, "postrouting", "nat", "postrouting", 100)},
                {"add": _base_chain(t, "prerouting", "nat", "prerouting", -100)},
                {"add": _base_chain(t, "output", "nat", "output", -100)},
                {"add": _base_chain(t, "forward", "filter", "forward", 0)},
                # Into the bridge from elsewhere: only published ports and answers.
                {"add": _rule(t, "forward", [_match(_meta("oifname"), br), _match({"ct": {"key": "status"}}, "dnat",
                                                                                  "in"), {"accept": None}])},
                {"add": _rule(t, "forward", [_match(_meta("oifname"), br),
                                             _match({"ct": {"key": "state"}}, ["established", "related"], "in"),
                                             {"accept": None}])},
                {"add": _rule(t, "forward", [_match(_meta("oifname"), br), _match(_meta("iifname"), br, "!="),
                                             {"drop": None}])}]
        if self.uplink:
            cmds.append({"add": _rule(t, "postrouting", [
                _match(_payload("ip", "saddr"), _prefix(self.subnet4)),
                _match(_meta("oifname"), self.uplink), {"masquerade": None}])})
        with self._lock:
            self._run(cmds, f"create table {FAMILY} {self.table} in {self._where()}")
            self._handles.clear()
            self.started = True
        if self.uplink:
            if not link_exists(self.ns_path, self.uplink):
                log.warning("net.uplink = %s: %s has no interface %s: nothing the sandboxes send beyond the "
                            "bridge is masqueraded until one of that name appears (their connections time "
                            "out); `ip link` lists the interfaces", self.uplink_cfg, self._where(), self.uplink)
            if enable_ip_forward(self.ns_path):
                log.warning("net.uplink = %s: turned net.ipv4.ip_forward on in %s (sandboxes' traffic is "
                            "routed out of %s, masqueraded); dsecd leaves it on at stop",
                            self.uplink_cfg, self._where(), self.uplink)
            log.info("egress NAT: %s masqueraded out of %s (nftables table %s %s)", self.subnet4, self.uplink,
                     FAMILY, self.table)

    def _where(self) -> str:
        return f"netns `{self.ns_path}`" if self.ns_path else "the daemon's netns"

    def leave(self, sandboxes: int) -> None:
        """A daemon stop while `sandboxes` networked sandboxes run on: the table
        stays, so their egress NAT and published ports (and the connections
        made through them) go on while no daemon runs; the next daemon
        replaces it whole (start, or Network.readopt)."""
        with self._lock:
            if not self._let_go():
                return
        log.info("nftables table %s %s in %s kept at stop for %d networked sandbox(es) that run on; the next "
                 "daemon replaces it", FAMILY, self.table, self._where(), sandboxes)

    def close(self) -> None:
        """Delete the table (and with it every rule dsecd added); nothing else."""
        with self._lock:
            if self._let_go():
                try:
                    _delete(self.nft, self.table, f"delete table {FAMILY} {self.table} in {self._where()}")
                finally:
                    _give_up_table(self.ns_path, self.bridge)

    def _let_go(self) -> bool:
        """Under the lock: the table is no longer this daemon's to change
        (stop); whether it was."""
        if not self.started:
            return False
        self.started = False
        self._handles.clear()
        return True

    # ------------------------------------------------------------ published ports

    def check_host_port(self, host_port: int, bind: str, proto: str = "tcp") -> None:
        """Refuse a host port some process of the bridge netns listens on with
        `proto` (tcp|udp; the DNAT would hide it): a bind() there of a socket of
        that protocol says."""
        kind = socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM
        with _maybe_netns(self.ns_path):
            s = socket.socket(socket.AF_INET, kind)
        try:
            if kind == socket.SOCK_STREAM:
                # A TCP port's closed connections in TIME_WAIT do not hold it.
                # Not for UDP: it has no TIME_WAIT, and with SO_REUSEADDR the
                # bind would pass over a server that set it too.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((bind or "0.0.0.0", host_port))
        except OSError as err:
            shown = f"{host_port}/udp" if proto == "udp" else host_port
            raise NatError(err.errno, f"host port {shown} on {bind or 'every address'} of {self._where()}: "
                           f"{err.strerror}; pick another --host-port") from err
        finally:
            s.close()

    def dnat_ports_of_others(self, proto: str = "tcp") -> dict[int, set[str]]:
        """The `proto` (tcp|udp) ports other tables of the netns DNAT (another
        daemon's published ports, a container engine's), each with the IPv4
        addresses its rules match (`ip daddr == A`; "" for a rule matching no
        single one: every address, as far as this can tell). A publication
        of one of them on one of those addresses here too would not get its
        connections (the other table's rule, at the same hook, sees them as
        well), so it counts as taken there."""
        with self._lock:
            items = self._run([{"list": {"ruleset": None}}], f"list the ruleset of {self._where()}")
        dport = {"payload": {"protocol": proto, "field": "dport"}}
        daddr = {"payload": {"protocol": "ip", "field": "daddr"}}
        ports: dict[int, set[str]] = {}
        for it in items:
            r = it.get("rule") if isinstance(it, dict) else None
            if not r or (r.get("family"), r.get("table")) == (FAMILY, self.table):
                continue
            exprs = r.get("expr") or []
            if not any("dnat" in e or "redirect" in e for e in exprs):
                continue
            matches = [e["match"] for e in exprs if isinstance(e.get("match"), dict) and e["match"].get("op") == "=="]
            addr = next((m["right"] for m in matches if m.get("left") == daddr and isinstance(m.get("right"), str)
                         and not m["right"].startswith("@")),
                        "")
            for m in matches:
                if m.get("left") == dport and isinstance(m.get("right"), int):
                    ports.setdefault(m["right"], set()).add(addr)
        return ports

    def publish(self, key: str, host_port: int, bind: str, sb_addr: str, port: int, proto: str = "tcp") -> None:
        """DNAT `proto` (tcp|udp) `bind`:`host_port` (bind "" = every local non-loopback address) to
        `sb_addr`:`port`, for connections from outside (prerouting, not from the
        bridge itself) and from the bridge netns (output)."""
        if bind:
            dst = [_match(_payload("ip", "daddr"), bind)]
        else:
            dst = [_match({"fib": {"result": "type", "flags": ["daddr"]}}, "local"),
                   _match(_payload("ip", "daddr"), {"prefix": {"addr": "127.0.0.0", "len": 8}}, "!=")]
        tail = dst + [_match(_payload(proto, "dport"), host_port),
                      {"dnat": {"family": "ip", "addr": sb_addr, "port": port}}]
        cmds = [{"add": _rule(self.table, "prerouting", [_match(_meta("iifname"), self.bridge, "!="), *tail], key)},
                {"add": _rule(self.table, "output", tail, key)}]
        with self._lock:
            if not self.started:
                raise NatError(errno.ESHUTDOWN, "nftables table of dsecd is not set up (daemon stopping)")
            if key in self._handles:
                raise NatError(errno.EEXIST, f"{key} is published already")
            self.nft.set_echo_output(True)
            try:
                rc, out, err = self.nft.json_cmd({"nftables": cmds})
            finally:
                self.nft.set_echo_output(False)
            if rc != 0:
                raise NatError(errno.EINVAL, f"nftables: publish {key}: {(err or '').strip()}")
            # Echo answers each command as it was applied: {"add": {"rule": {..., "handle": n}}}.
            handles = [(it["add"]["rule"]["chain"], it["add"]["rule"]["handle"])
                       for it in (out or {}).get("nftables", []) if "rule" in it.get("add", {})]
            if len(handles) != len(cmds):
                raise NatError(errno.EPROTO, f"nftables: publish {key}: no rule handles in the echo {out!r}")
            self._handles[key] = handles

    def unpublish(self, key: str, host_port: int | None = None, sb_addr: str = "", port: int = 0,
                  proto: str = "tcp") -> bool:
        """Delete the publication's rules, then (given `host_port`, `sb_addr` and
        `port`) the conntrack entries of the `proto` flows made through it: an entry
        keeps its DNAT for the flow's life (a UDP one while datagrams keep coming),
        so without this an open flow would go on reaching the sandbox through a
        port no longer published."""
        with self._lock:
            handles = self._handles.get(key)
            if not handles or not self.started:
                self._handles.pop(key, None)
                return False
            self._delete_rules(key, handles)
            # Forgotten only once deleted: a rule left in place still sends the
            # host port's connections to the sandbox's address, so it stays
            # known, and a retry deletes it.
            del self._handles[key]
        if host_port is not None:
            self.forget_flows(host_port, sb_addr, port, proto)
        return True

    def forget_flows(self, host_port: int, sb_addr: str, port: int, proto: str = "tcp") -> int:
        """The conntrack entries of the `proto` flows made through an unpublished
        port, deleted (forget_connections); a failure is logged: those flows go
        on until they end. How many were."""
        try:
            cut = forget_connections(self.ns_path, host_port, sb_addr, port, proto)
        except OSError as err:
            log.warning("unpublish %s:%s: %s flows already open through host port %s were not cut "
                        "(deleting their conntrack entries in %s failed: %s); they go on until they end",
                        sb_addr, port, proto, host_port, self._where(), err)
            return 0
        if cut:
            log.info("unpublish %s:%s: cut %d open %s flow(s) through host port %s", sb_addr, port, cut, proto,
                     host_port)
        return cut

    def _delete_rules(self, key: str, handles: list[tuple[str, int]]) -> None:
        """Delete a publication's rules, in one transaction. A rule already
        gone (deleted by hand, the table flushed) is as good as deleted: the
        transaction fails for it whole, so then each is deleted on its own.
        Under the lock."""
        def delete(chain: str, handle: int) -> dict:
            return {"delete": {"rule": {"family": FAMILY, "table": self.table, "chain": chain, "handle": handle}}}

        try:
            self._run([delete(c, h) for c, h in handles], f"unpublish {key}")
        except NatError as err:
            if "No such file" not in str(err):
                raise
            for c, h in handles:
                try:
                    self._run([delete(c, h)], f"unpublish {key}")
                except NatError as err1:
                    if "No such file" not in str(err1):
                        raise

    def info(self) -> dict:
        return {"table": f"{FAMILY} {self.table}", "uplink": self.uplink, "published": len(self._handles)}
