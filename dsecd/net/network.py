"""Network: what the node calls. One per daemon; every method blocks (worker threads only).

    net = Network(cfg["net"], state_dir, layout.v2, cgroup_root)    # bridge, BPF load, IPAM, pool
    ready = net.take_ready()                                        # a pooled netns, or None
    view = net.attach(sb_id, init_pid, cgroup_v2_dir, rules, mode, ready)  # on create
    view = net.update(sb_id, add=, remove=, replace=)               # live, atomic
    view = net.show(sb_id)
    net.detach(sb_id)                                               # on destroy / death
    net.readopt({sb_id: (init_pid, cgroup_v2_dir)})                 # after a restart
    view = net.attach_vm(sb_id, rules)                              # a microVM: policy, lease
    fd, guest = net.plug_vm(sb_id)                                  # its tap, before each QEMU start
    pub = net.publish(sb_id, 8080, host_port=None, bind="")         # DNAT a host port to it (nat.py)
    pub = net.publish(sb_id, 5353, protocol="udp")                  # a UDP port (tcp is the default)
    net.unpublish(sb_id, 8080)                                      # (..., protocol="udp")

Per sandbox: the policy (terms), veth name, address and BPF bookkeeping are one
record in <state_dir>/net/records.log (dsecd/journal.py: an append-only log, one
~5 us write per change instead of a rename).

Learned entries (an address the resolver answered for a name rule, allowed
until its TTL plus net.dns_grace_s) are kept apart from the terms: in memory
only, never recorded. They are compiled into the same trie as the terms' rules
(`_effective`), so a sandbox's allowlist is its terms' rules plus its live
learned entries; a restarted daemon starts with none, and a sandbox's next
query for the name learns the address again (docs/network.md says why).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import hashlib
import ipaddress
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import native
from ..errors import BadRequest, Conflict, DsecError, LimitExceeded, NotFound
from ..fds import close_quietly
from ..hostclaims import pids_note
from ..journal import RecordLog
from ..protocol import check_protocol
from . import rules as R
from .ipam import AddressClaims, Ipam, Lease
from .nat import (
    HostNat,
    Ipv6Forgets,
    NatError,
    PortClaims,
    delete_table,
    forget_address,
    table_name,
)
from .plumbing import BridgeSpec, Plumbing, host_ifname, in_netns, netns_path, vm_ifname, vm_mac
from .policy import Engine
from .pool import NetnsPool, Ready

log = logging.getLogger(__name__)

MODES = ("default", "none")
# The resolver's per-sandbox counters (dsecd/net/dns.py), shown by `net show`.
DNS_COUNTERS = ("queries", "answered", "refused", "learned", "expired", "hostile_dropped", "capped",
                "learned_full", "upstream_failed", "rate_limited")
INLINE_MAX_RULES = 64          # update_now(): larger policies go to a worker thread
REFUSED_NAMES = 8              # the names the resolver refused a sandbox last, shown by `net show`


@dataclass
class _Sandbox:
    id: str
    mode: str
    cgroup_dir: str
    cgroup_id: int
    terms: tuple[str, ...] = ()
    policy: int = 0
    slot: int = -1
    counters: dict = field(default_factory=dict)     # Rule -> counter index
    prefixes: dict = field(default_factory=dict)      # live policy: (fam, addr, plen) -> entries
    state: str = "attached"                           # attached | detaching | lost (a failed readopt's, held)
    lost: str = ""                                    # why, with state "lost"
    ifname: str = ""                                  # host end of the veth ("" for --net none)
    ipv4: str = ""                                    # the lease, recorded: IPAM is rebuilt from records
    lease_view: dict | None = None                    # the lease as shown, computed once
    ports: dict = field(default_factory=dict)         # published: (port, protocol) -> {port, protocol, host_port, bind}
    names: tuple = ()                                 # name rules of the policy (the resolver reads it)
    learned: dict = field(default_factory=dict)       # Rule -> Learned (not recorded)
    dns: collections.Counter = field(default_factory=collections.Counter)   # resolver counters
    refused_names: collections.deque = field(default_factory=lambda: collections.deque(maxlen=REFUSED_NAMES))
    kind: str = "container"                           # container (veth, cgroup programs) | vm (tap, dsec_tap)
    tap_index: int = 0                                # a VM's current tap (0: no QEMU runs)
    dropped: bool = False                             # policy and counters freed (a detach got that far)

    def record(self) -> dict:
        """The sandbox as its record keeps it. TCP publications are under
        `ports`, UDP ones under `udp_ports`: a daemon from before UDP ports
        reads `ports` and publishes each entry as TCP whatever its
        `protocol`, so a UDP port there would come back from a downgrade as
        a TCP port of that number; `udp_ports` it does not read at all."""
        pubs = list(self.ports.values())
        return {"id": self.id, "mode": self.mode, "cgroup_dir": self.cgroup_dir, "cgroup_id": self.cgroup_id,
                "terms": list(self.terms), "ifname": self.ifname, "ipv4": self.ipv4,
                "ports": [p for p in pubs if p["protocol"] == "tcp"],
                "udp_ports": [p for p in pubs if p["protocol"] == "udp"], "kind": self.kind}


def recorded_ports(rec: dict) -> list[dict]:
    """The publications of a sandbox's record, each with its `protocol` and
    `bind`: `ports` (TCP; an entry naming another protocol is from a record
    that kept UDP ports there too, and is of that one) and `udp_ports`."""
    out = [{**pub, "protocol": pub.get("protocol", "tcp"), "bind": pub.get("bind", "")}
           for pub in rec.get("ports") or ()]
    out += [{**pub, "protocol": "udp", "bind": pub.get("bind", "")} for pub in rec.get("udp_ports") or ()]
    return out


class Network:
    def __init__(self, cfg: dict, state_dir: Path, cgroup_v2_root: Path, cgroup_root: str = "dsecd",
                 max_sandboxes: int = 4096):
        self.cfg = cfg
        self.v2 = Path(cgroup_v2_root)
        self.level = len(Path(cgroup_root).parts) + 1
        self.sets = R.parse_rule_sets(cfg.get("rule_sets", {}))
        self.essentials = tuple(R.canonical_term(t, self.sets) for t in cfg.get("essentials", []))
        self.max_rules = int(cfg["max_rules_per_sandbox"])
        # Learned addresses (the resolver's answers): at most dns_max_learned a
        # sandbox, and a quarter of the trie for all of them together. The trie
        # is every sandbox's, a policy update may need its whole size again
        # (the flip), and a zone whose names map to any address
        # (ec2-A-B-C-D.compute-1.amazonaws.com is A.B.C.D) lets a sandbox
        # learn without end: the rest stays for the policies. Half of that
        # quarter is reserved, an equal share per sandbox at max_sandboxes
        # (learned_shares), so sandboxes at their cap cannot starve the others.
        self.max_learned = min(int(cfg.get("dns_max_learned", 256)), self.max_rules)
        self.learned_budget = int(cfg["max_prefixes"]) // 4
        self.max_sandboxes = max(1, int(max_sandboxes))
        self.dns_enabled = bool(cfg.get("dns", True))
        netdir = Path(state_dir) / "net"
        self.records = RecordLog(netdir / "records.log", fsync=bool(cfg.get("fsync", False)))
        # Claimed host-wide: another daemon on the same bridge never gets an address one of ours holds.
        host_netns = cfg.get("host_netns", "")
        claims = AddressClaims(netns_path(host_netns) if host_netns else None, cfg["bridge"])
        self.ipam = Ipam(cfg["ipv4_subnet"], cfg.get("ipv4_pool", ""), cfg.get("ipv6_subnet", ""), claims=claims)
        self._migrate(netdir)
        self._restore_leases()
        # The gateway and the sandboxes' own addresses, in both families.
        self.own_nets = [ipaddress.ip_network(self.ipam.gateway4), self.ipam.pool]
        if self.ipam.subnet6:
            off = int(self.ipam.pool.network_address) - int(self.ipam.subnet.network_address)
            base6 = int(self.ipam.subnet6.network_address) + off
            self.own_nets += [ipaddress.ip_network(self.ipam.gateway6)]
            self.own_nets += ipaddress.summarize_address_range(
                ipaddress.IPv6Address(base6), ipaddress.IPv6Address(base6 + self.ipam.pool.num_addresses - 1))
        # What the resolver may never add (hostile answers): loopback, link-local,
        # unspecified, multicast, and those.
        self._always_blocked = [ipaddress.ip_network(n) for n in (
            "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3", "::/127", "fe80::/10", "ff00::/8")]
        self._always_blocked += self.own_nets
        # Sandboxes reach the resolver on the gateway, and nothing else there.
        self.resolver_rule = R.Rule(R.FAM_V4, int(self.ipam.gateway4), 32, 53, 53, R.P_TCP | R.P_UDP) \
            if self.dns_enabled else None
        gw6 = f"{self.ipam.gateway6}/{self.ipam.subnet6.prefixlen}" if self.ipam.subnet6 else ""
        self.plumbing = Plumbing(BridgeSpec(
            name=cfg["bridge"], mtu=int(cfg["mtu"]), host_netns=cfg.get("host_netns", ""),
            gateway4=f"{self.ipam.gateway4}/{self.ipam.subnet.prefixlen}", gateway6=gw6,
            sandbox_ifname=cfg.get("sandbox_ifname", "eth0")))
        # A destroy's IPv6 conntrack entries: one dump of the table for the
        # destroys running at once (nat.Ipv6Forgets).
        self._ipv6_forgets = Ipv6Forgets(self.plumbing.ns_path)
        self.engine = Engine.shared(max_sandboxes, int(cfg["max_prefixes"]), int(cfg["max_counters"]),
                                    bpf_cache_dir(cfg, state_dir))
        self.engine.set_level(self.level)
        self._lock = threading.RLock()
        self._sbs: dict[str, _Sandbox] = {}
        self._stale_fences: set[str] = set()     # sandboxes whose policy missed a change of the fences
        self._update_ms: collections.deque[float] = collections.deque(maxlen=1024)
        # What the default-deny refused and the resolver answered for sandboxes
        # that are gone: drop_totals() adds them, so its sums never go down.
        self._retired: collections.Counter = collections.Counter()
        # Pool entries are `dp<tag><n>`; tag = this state dir, so daemons sharing a
        # bridge netns never take each other's for leftovers.
        self.tag = pool_tag(state_dir)
        # Never the internet whatever a rule's breadth (rules.LINK_SCOPED), and
        # the subnet's broadcast, which reaches the host and every sandbox: a
        # fence of its own also inside the pool's (the whole subnet, by
        # default), so that a rule naming the pool reaches the sandboxes only.
        self._scoped = [ipaddress.ip_network(n) for n in R.LINK_SCOPED]
        broadcast = ipaddress.ip_network(self.ipam.subnet.broadcast_address)
        self._scoped.append(broadcast)
        if not broadcast.subnet_of(self.ipam.pool):
            self._always_blocked.append(broadcast)
        self._fence_host_nets(self._host_nets())
        in_use = {r.get("ifname") for r in self.records.records.values()}
        # Pool entries a sandbox took keep their name: new ones are numbered past them.
        self._seq = itertools.count(1 + max((_pool_seq(n, f"dp{self.tag}") for n in in_use), default=-1))
        for name in set(self.plumbing.links_with_prefix(f"dp{self.tag}")) - in_use:
            log.info("removing netns pool entry %s left by a previous daemon", name)
            self.plumbing.remove_sandbox(name)
        self.nat: HostNat | None = None
        self.uplink = str(cfg.get("uplink", "") or "")
        lo, _, hi = str(cfg.get("publish_ports", "30000-32767")).partition("-")
        self.publish_range = (int(lo), int(hi or lo))
        self._host_ports: dict[tuple[str, str, int], str] = {}     # (protocol, bind, host port) -> sandbox id
        # Claimed host-wide (nat.PortClaims): another daemon of the bridge's
        # netns never publishes a host port one of ours holds. The records'
        # ports are claimed again now, before this daemon's table replaces
        # the previous one's (whose DNAT kept other daemons off them), and
        # kept for readopt's republish.
        self.port_claims = PortClaims(self.plumbing.ns_path)
        self._claim_recorded_ports()
        if self.uplink:
            try:
                self._nat_table()
            except BaseException:
                self.port_claims.keep_only(set())     # no Network: nothing of this daemon's is published
                self.records.close()
                self.plumbing.close()
                raise
        self.pool = NetnsPool(int(cfg.get("pool_size", 0)), self._make_ready, self._destroy_ready,
                              housekeeping=self._compact, wanted=self.records.needs_compaction)

    def _host_nets(self) -> list:
        """Each address of the host side (the bridge's netns: its uplink's,
        any other interface's, as they are now) that is not the gateway, and
        the broadcast address of each of their IPv4 subnets and the
        subnet-router anycast of each IPv6 prefix (a datagram there reaches
        the host's UDP services as one to its own address does), as a
        one-address network. With the gateway and the pool they are the
        fences: a sandbox reaches them only through a rule naming them or a
        narrower range, never through a broader one (`0.0.0.0/0:443` is the
        internet's HTTPS, not another sandbox's or the host's services)."""
        gateways = {self.ipam.gateway4, self.ipam.gateway6}
        out = []
        for addr in self.plumbing.local_addresses(subnets=True):
            # In the pool's fence too, they are fences of their own: a rule
            # naming the pool reaches the sandboxes, not the host.
            if not (addr.is_loopback or addr.is_link_local or addr in gateways
                    or any(addr in n for n in self._scoped)):
                out.append(ipaddress.ip_network(addr))
        return out

    def _fence_host_nets(self, host_nets: list) -> None:
        """What no rule broader than them reaches (rules.compile_prefixes),
        and no resolver answer may point at: the gateway and the other
        sandboxes, what is never the internet, and the host's own addresses
        `host_nets`."""
        self.host_nets = host_nets
        self.dns_blocked = self._always_blocked + self._scoped + host_nets
        self.fences = tuple((R.FAM_V4 if n.version == 4 else R.FAM_V6, int(n.network_address), n.prefixlen)
                            for n in self.own_nets + host_nets + self._scoped)

    def refresh_host_fences(self) -> bool:
        """Fence the host's addresses as they are now: an address the host
        side gained since start (an interface brought up, a new lease) is
        walled off from broad rules in every sandbox's policy, and resolver
        answers learned for it are dropped; one it lost is no longer fenced.
        Whether anything changed. The lock is taken per sandbox, so creates
        and rule updates go on meanwhile (they compile with the new fences
        already). A sandbox whose policy could not be rewritten is retried
        at the next call (fences_pending)."""
        host_nets = self._host_nets()
        with self._lock:
            moved = set(host_nets) != set(self.host_nets)
            if not moved and not self._stale_fences:
                return False
            if moved:
                log.info("the host's addresses changed: fencing %s", ", ".join(str(n) for n in host_nets) or "none")
            todo = sorted(self._sbs) if moved else sorted(self._stale_fences)
            self._fence_host_nets(host_nets)
            self._stale_fences = set()
        for sb_id in todo:
            with self._lock:
                self._refence(sb_id)
        return True

    def _refence(self, sb_id: str) -> None:
        """Recompile a sandbox's policy with the current fences. Caller holds the lock."""
        sb = self._sbs.get(sb_id)
        if sb is None or sb.state != "attached" or not sb.policy:
            return                        # gone, going, or its policy is still to be written (with them)
        old = sb.learned
        sb.learned = {r: ln for r, ln in old.items() if not self.is_blocked(r.network.network_address)}
        try:
            self._apply(sb, sb.terms, whole=True)
        except Exception as err:
            sb.learned = old
            self._stale_fences.add(sb_id)
            log.error("sandbox %s: fence the host's addresses %s in its egress policy: %s; retried",
                      sb_id, ", ".join(str(n) for n in self.host_nets), err)

    def resolver_gone(self) -> None:
        """The resolver did not start: gateway:53 is open to sandboxes for
        it alone, and whatever else listens there (a host's own DNS server
        bound to every address) is a service of the host like any other.
        Every sandbox's policy is compiled again without it."""
        with self._lock:
            if self.resolver_rule is None:
                return
            self.resolver_rule = None
            todo = sorted(self._sbs)
        for sb_id in todo:
            with self._lock:
                self._refence(sb_id)

    def fences_pending(self) -> bool:
        """Whether some sandbox's policy still misses the fences' last change."""
        return bool(self._stale_fences)

    def close(self) -> None:
        """Daemon shutdown: sandboxes keep their veths and attached programs; the
        pool's entries are removed (no sandbox uses them); dsecd's nftables table
        stays while networked sandboxes run on (their egress NAT and published
        ports go on until the next daemon, as across a kill -9), else goes."""
        self.pool.close()
        with self._lock:
            self.port_claims.keep_only(set())
        try:
            if self.nat is not None:
                with self._lock:
                    running = len(self._sbs)
                if running:
                    self.nat.leave(running)
                else:
                    self.nat.close()
        finally:
            self.records.close()
            self.plumbing.close()

    def _nat_table(self) -> HostNat:
        """dsecd's nftables table, made at start when net.uplink is set, else at the
        first published port."""
        with self._lock:
            if self.nat is None:
                nat = HostNat(self.plumbing.ns_path, self.cfg["bridge"], self.cfg["ipv4_subnet"], self.uplink)
                nat.start()
                self.nat = nat
            return self.nat

    def nat_info(self) -> dict:
        if self.nat is None:
            return {"uplink": "", "detail": "net.uplink is off: no egress NAT" if not self.uplink else ""}
        return {**self.nat.info(), "ports": len(self._host_ports)}

    # ------------------------------------------------------------ records

    def _migrate(self, netdir: Path) -> None:
        """Records of an older dsecd (a JSON file per sandbox + leases.json) into the log."""
        old = netdir / "sandboxes"
        if not old.is_dir():
            return
        leases = Ipam.read_legacy(netdir / "leases.json")

        def fix(sb_id: str, rec: dict) -> dict:
            rec.setdefault("ifname", host_ifname(sb_id) if rec.get("mode") == "default" else "")
            if sb_id in leases:
                rec.setdefault("ipv4", f"{leases[sb_id]}/{self.ipam.subnet.prefixlen}")
            return rec

        self.records.migrate_dir(old, fix)
        (netdir / "leases.json").unlink(missing_ok=True)

    def _restore_leases(self) -> None:
        for sb_id, rec in self.records.records.items():
            if rec.get("ipv4"):
                try:
                    self.ipam.restore(sb_id, rec["ipv4"])
                except ValueError as err:     # readopt gives it a fresh one if it is still alive
                    log.error("sandbox %s: %s", sb_id, err)

    def _claim_recorded_ports(self) -> None:
        for sb_id, rec in self.records.records.items():
            for pub in recorded_ports(rec):
                try:
                    key = _nat_key(sb_id, int(pub["port"]), pub["protocol"])
                    pid = self.port_claims.claim(pub["protocol"], int(pub["host_port"]), key, pub["bind"])
                except (KeyError, TypeError, ValueError):
                    continue                  # a torn entry: its republish says so
                if pid is not None:
                    log.warning("sandbox %s: host port %s/%s on %s of its port %s is another daemon's now%s",
                                sb_id, pub["host_port"], pub["protocol"], pub["bind"] or "every address",
                                pub["port"], pids_note([pid]))

    def _published_keys(self) -> set[str]:
        """The keys of every publication this daemon has (_nat_key)."""
        with self._lock:
            return {_nat_key(sb.id, port, proto) for sb in self._sbs.values() for port, proto in sb.ports}

    def _compact(self) -> None:
        # Under the Network lock: update_now() then sees it busy and leaves the
        # event loop alone instead of waiting for the rewrite.
        with self._lock:
            self.records.compact()

    def _write_record(self, sb: _Sandbox) -> None:
        self.records.put(sb.id, sb.record())
        if self.records.needs_compaction():
            self.pool.kick()

    # ------------------------------------------------------------ netns pool

    def take_ready(self) -> Ready | None:
        """A ready netns for a --net default create (None: pool off or empty). Give
        it to attach(), or to release_ready() if the sandbox could not be made."""
        return self.pool.take() if self.pool.size > 0 else None

    def release_ready(self, ready: Ready) -> None:
        self._destroy_ready(ready)

    def _make_ready(self) -> Ready:
        """Pool thread: netns, veth into the bridge, lo up, address, routes."""
        name = f"dp{self.tag}{next(self._seq):09x}"
        nsfd = native.netns_create()
        try:
            with self._lock:
                lease = self.ipam.allocate(name)
            try:
                self.plumbing.add_sandbox(name, f"/proc/self/fd/{nsfd}", lease)
            except BaseException:
                with self._lock:
                    self.ipam.release(name)
                raise
        except BaseException:
            close_quietly(nsfd)
            raise
        return Ready(name, nsfd, lease)

    def _destroy_ready(self, r: Ready) -> None:
        try:
            self.plumbing.remove_sandbox(r.name)
        finally:
            close_quietly(r.nsfd)
            r.nsfd = -1
            with self._lock:
                if self.ipam.get(r.name) is not None:
                    self.ipam.release(r.name)

    # ------------------------------------------------------------ create / destroy

    def attach(self, sb_id: str, netns: int | str, cgroup_dir: str | Path, rules: list[str] | None = None,
               mode: str = "default", ready: Ready | None = None) -> dict:
        """Policy first, then the interface: the sandbox never has a link without its policy.

        With `ready` (a pooled netns the sandbox's PID 1 joined at spawn) the link
        exists already, but only dsec-init runs in the sandbox until the node
        answers the create, and it opens no socket: the policy is in force before
        any sandbox code can use the link."""
        if mode not in MODES:
            raise BadRequest(f"net mode must be one of {MODES}, got {mode!r}")
        if mode == "none" and rules:
            raise BadRequest("--allow needs --net default (--net none is loopback only)")
        cgroup_dir = str(cgroup_dir)
        self._check_level(cgroup_dir)
        with self._lock:
            if sb_id in self._sbs:
                raise Conflict(f"sandbox {sb_id} already has networking", {"sandbox": sb_id})
            sb = _Sandbox(sb_id, mode, cgroup_dir, os.stat(cgroup_dir).st_ino)
            self._sbs[sb_id] = sb
        handed_over = False
        try:
            if mode == "default":
                self.check_request_size(len(rules or []))
                terms = R.merge((), self.sets, replace=list(rules or []))
                # The lease first: the policy lets the sandbox reach its own
                # address (_effective). Its veth comes after the policy.
                if ready is not None:
                    _check_joined(netns, ready)
                    with self._lock:
                        sb.ifname, lease = ready.name, self.ipam.rekey(ready.name, sb_id)
                    handed_over = True
                else:
                    lease = self.ipam_allocate(sb_id)
                sb.ipv4 = str(lease.ipv4)
                self._bpf_attach(sb, terms)
                if ready is None:
                    sb.ifname = host_ifname(sb_id)
                    self.plumbing.add_sandbox(sb.ifname, netns_path(netns), lease)
            self._write_record(sb)
        except BaseException:
            self._teardown(sb)
            if ready is not None and not handed_over:
                self._destroy_ready(ready)
            raise
        finally:
            if ready is not None:
                close_quietly(ready.nsfd)          # the sandbox's PID 1 holds the netns now
                ready.nsfd = -1
        with self._lock:
            return self._view(sb, counters=False)

    # ------------------------------------------------------------ microVMs

    def attach_vm(self, sb_id: str, rules: list[str] | None = None) -> dict:
        """A microVM's networking, before its QEMU starts: its policy (under
        `vm_key`, what its tap's frames are checked against) and its lease.
        Its tap comes with each QEMU (plug_vm): a pause ends QEMU and the tap
        with it. Undoes itself on failure."""
        with self._lock:
            if sb_id in self._sbs:
                raise Conflict(f"sandbox {sb_id} already has networking", {"sandbox": sb_id})
            sb = _Sandbox(sb_id, "default", "", vm_key(sb_id), kind="vm", ifname=vm_ifname(sb_id))
            self._sbs[sb_id] = sb
        try:
            self.check_request_size(len(rules or []))
            sb.ipv4 = str(self.ipam_allocate(sb_id).ipv4)
            self._bpf_attach(sb, R.merge((), self.sets, replace=list(rules or [])))
            self._write_record(sb)
        except BaseException:
            self._teardown(sb)
            raise
        with self._lock:
            return self._view(sb, counters=False)

    def plug_vm(self, sb_id: str) -> tuple[int, dict]:
        """A tap for the microVM's next QEMU: on the bridge, dsec_tap attached
        to its ingress and told the VM's address and MAC, all before the fd
        goes to QEMU, so no frame of the guest ever passes unchecked. Returns
        the fd (the caller passes it to QEMU and closes its own) and what the
        guest's NIC is to be given (the agent sets it up: wire.NET)."""
        with self._lock:
            sb = self._get(sb_id)
        if sb.kind != "vm":
            raise BadRequest(f"sandbox {sb_id} is no microVM")
        iface = ipaddress.ip_interface(sb.ipv4)
        mac = vm_mac(iface.ip.packed)
        ipv6 = self._vm_ipv6(sb_id)
        self.plumbing.remove_sandbox(sb.ifname)     # a previous QEMU's tap, if the kernel has not removed it yet
        fd, idx = self.plumbing.add_tap(sb.ifname)
        try:
            self.engine.register_tap(idx, sb.cgroup_id, iface.ip.packed, mac, ipv6.ip.packed if ipv6 else b"")
            with self._bridge_netns():
                self.engine.attach_tap(idx, sb.ifname)
        except BaseException:
            os.close(fd)
            self.plumbing.remove_sandbox(sb.ifname)
            self.engine.unregister_tap(idx)
            raise
        old, sb.tap_index = sb.tap_index, idx
        if old and old != idx:
            self.engine.unregister_tap(old)
        return fd, {"mac": mac, "ipv4": iface, "gateway": self.ipam.gateway4, "mtu": int(self.cfg["mtu"]),
                    "ipv6": ipv6, "gateway6": self.ipam.gateway6 if ipv6 else None}

    def _vm_ipv6(self, sb_id: str) -> ipaddress.IPv6Interface | None:
        """The VM's IPv6 lease (net.ipv6_subnet set: derived from its IPv4
        one, as a container's), or None."""
        with self._lock:
            lease = self.ipam.get(sb_id)
        return lease.ipv6 if lease is not None else None

    def _bridge_netns(self):
        """This thread in the bridge's netns: TCX finds a device by ifindex in
        the caller's netns."""
        return in_netns(self.plumbing.ns_path) if self.plumbing.ns_path else contextlib.nullcontext()

    def unplug_vm(self, sb_id: str) -> None:
        """The VM's QEMU ended (a pause): its tap went with it; forget its entry."""
        with self._lock:
            sb = self._sbs.get(sb_id)
        if sb is not None and sb.tap_index:
            self.engine.unregister_tap(sb.tap_index)
            sb.tap_index = 0

    def ipam_allocate(self, sb_id: str) -> Lease:
        with self._lock:
            return self.ipam.allocate(sb_id)

    def detach(self, sb_id: str) -> None:
        """Remove the veth, the policy and the lease; safe to repeat, safe on a dead sandbox."""
        with self._lock:
            sb = self._sbs.get(sb_id)
            if sb is None:
                self._release_leftovers(sb_id)
                return
            sb.state = "detaching"           # an update racing with this gets Conflict
        self._teardown(sb)

    def retry_detach(self, sb_id: str) -> None:
        """detach() again, for a sandbox whose detach failed: nothing if
        the id has networking that is not being detached (it was given to
        a sandbox made since)."""
        with self._lock:
            sb = self._sbs.get(sb_id)
            if sb is not None and sb.state != "detaching":
                return
        self.detach(sb_id)

    def _teardown(self, sb: _Sandbox, live: bool = False) -> None:
        """Every step runs even if an earlier one failed (one stuck resource must not
        leak the rest); the first error is raised at the end.

        live: the sandbox runs on, cut off (a failed readopt): see _cut_off."""
        steps = []
        link = {"gone": not (sb.mode == "default" and sb.ifname)}

        def delete_link() -> None:
            self.plumbing.remove_sandbox(sb.ifname)
            link["gone"] = True

        if sb.ports:
            steps += [("unpublish ports", lambda: self._unpublish_all(sb))]
        if sb.mode == "default" and sb.ifname:
            steps += [("delete veth" if sb.kind == "container" else "delete tap", delete_link)]
        cut_off = live and sb.kind == "container" and sb.mode == "default"
        if sb.kind == "vm":
            steps += [("forget the tap", lambda: self.unplug_vm(sb.id))]
        elif sb.mode == "default" and not cut_off:
            steps += [("detach programs", lambda: self.engine.detach(sb.cgroup_dir))]
        if sb.mode == "default" and sb.ipv4:
            # While the address is still its lease: the next sandbox given it
            # must not inherit its connections.
            steps += [("forget its connections", lambda: self._forget_connections(sb.id, sb.ipv4))]

        # A port whose DNAT could not be deleted, or a veth that could not
        # be (its other end, in the sandbox, still has the address and
        # answers ARP for it), keeps the sandbox's address leased and its
        # record: a sandbox given that address would get the port's
        # connections, or share it on the bridge. A repeated detach retries
        # (NetworkService.detach_net repeats a destroy's in the background);
        # a restarted daemon replaces the whole table and removes the veths
        # of records no live sandbox has.
        def held() -> bool:
            return bool(sb.ports) or not link["gone"]

        steps += [("free policy, lease", lambda: self._free(sb, held()))]
        if cut_off:                     # after _free: no `sandboxes` entry names its cgroup now
            steps += [("cut off its egress", lambda: self._cut_off(sb, link["gone"]))]
        steps += [("delete record", lambda: None if held() else self.records.delete(sb.id))]
        first = None
        for what, fn in steps:
            try:
                fn()
            except Exception as err:
                log.error("sandbox %s: %s: %s", sb.id, what, err)
                first = first or err
        if first is not None:
            raise first

    def _forget_connections(self, sb_id: str, ipv4: str) -> None:
        """Delete the host side's conntrack entries of the sandbox's addresses
        (nat.forget_address): entries outlive the sandbox (an established TCP
        one for days), and the next sandbox leased the address would inherit
        them. With net.ipv6_subnet its IPv6 address (the mirror of the IPv4
        one, leased again with it) too. Nothing to do on a kernel without
        conntrack."""
        if not os.path.exists("/sys/module/nf_conntrack"):
            return
        own = ipaddress.ip_interface(ipv4).ip
        addrs = [own]
        if self.ipam.subnet6 is not None:
            addrs.append(self.ipam.own_ipv6(own))
        first = None
        for addr in addrs:
            try:
                n = forget_address(self.plumbing.ns_path, str(addr), self._ipv6_forgets)
            except Exception as err:        # the other family's entries still go
                first = first or err
                continue
            if n:
                log.info("sandbox %s: deleted %d conntrack entries of its address %s", sb_id, n, addr)
        if first is not None:
            raise first

    def _cut_off(self, sb: _Sandbox, link_gone: bool) -> None:
        self._cut_off_cgroup(sb.id, sb.cgroup_dir, sb.ifname, link_gone)

    def _cut_off_cgroup(self, sb_id: str, cgroup_dir: str, ifname: str, link_gone: bool) -> None:
        """A sandbox that runs on without its networking (a failed readopt).
        With its veth gone it has loopback only: no program stays on its
        cgroup, neither this daemon's nor an earlier one's (whose refuse-all
        programs, put there when that daemon could not delete the veth,
        would refuse loopback too): ours replace them, then go. A veth that
        could not be deleted would leave it a link with no programs, i.e. no
        egress policy at all: then this daemon's programs go on its cgroup
        (replacing the previous daemon's), and with no `sandboxes` entry for
        it they refuse its every connect, send and packet, loopback
        included."""
        try:
            self.engine.attach(cgroup_dir)
        except OSError as err:
            if err.errno == errno.ENOENT:     # the cgroup is gone: so are the programs on it
                return
            raise
        if link_gone:
            self.engine.detach(cgroup_dir)
            return
        log.error("sandbox %s: its veth %s could not be deleted; its cgroup keeps programs that refuse all "
                  "of its traffic (loopback too) until it is destroyed", sb_id, ifname)

    def _free(self, sb: _Sandbox, held: bool = False) -> None:
        """Its policy, counters and slot, then its lease and its entry here,
        unless `held` (a DNAT to its address or its veth stands: see _teardown)."""
        with self._lock:
            if sb.mode == "default":
                if not sb.dropped:
                    self._retire_counts(sb)
                    self._drop_policy(sb)
                    sb.learned = {}           # not in the shared learned budget while held
                    sb.dropped = True
                if held:
                    lease = self.ipam.get(sb.id)
                    log.error("sandbox %s: its address %s stays leased while %s; detach is retried",
                              sb.id, lease.ipv4 if lease else "(none)", f"port(s) {', '.join(f'{p}/{proto}' for p, proto in sb.ports)} of it stay published "
                              "(their DNAT could not be deleted)" if sb.ports else f"its veth {sb.ifname} stays")
                    return
                self.ipam.release(sb.id)
            self._sbs.pop(sb.id, None)

    def _release_leftovers(self, sb_id: str) -> None:
        rec = self.records.get(sb_id) or {}
        if self.ipam.get(sb_id) is not None or rec.get("ifname"):
            self.plumbing.remove_sandbox(rec.get("ifname") or host_ifname(sb_id))
            if rec.get("ipv4") and self._address_free_or_of(sb_id, rec["ipv4"]):
                try:
                    self._forget_connections(sb_id, rec["ipv4"])
                except OSError as err:
                    log.error("sandbox %s: forget its connections: %s", sb_id, err)
            with self._lock:
                self.ipam.release(sb_id)
        self.records.delete(sb_id)

    def _address_free_or_of(self, sb_id: str, ipv4: str) -> bool:
        """Whether `ipv4` is leased to `sb_id` or to nobody: a recorded address
        whose restore failed (net.ipv4_pool changed, or the address was leased
        twice) may be another live sandbox's lease now, and deleting the
        conntrack entries of that address would cut that sandbox's
        connections."""
        a = int(ipaddress.ip_interface(ipv4).ip)
        with self._lock:
            return self.ipam._owner_of.get(a, sb_id) == sb_id

    # ------------------------------------------------------------ published ports

    def publish(self, sb_id: str, port: int, host_port: int | None = None, bind: str = "",
                protocol: str = "tcp") -> dict:
        """Make `protocol` (tcp|udp) `port` of the sandbox reachable on the bridge
        netns' `bind`:`host_port` (bind "" = its every non-loopback address;
        host_port None = a free one of net.publish_ports). A TCP and a UDP port
        of one number are two publications. Journaled: a restarted daemon
        publishes it again."""
        import ipaddress

        protocol = check_protocol(protocol)
        if not 1 <= int(port) <= 65535:
            raise BadRequest(f"port {port} is not a {protocol.upper()} port (1-65535)")
        if host_port is not None and not 1 <= int(host_port) <= 65535:
            raise BadRequest(f"host port {host_port} is not a {protocol.upper()} port (1-65535)")
        if bind:
            try:
                addr = ipaddress.IPv4Address(bind)
            except ValueError:
                raise BadRequest(f"bind address {bind!r} is not an IPv4 address") from None
            if addr.is_loopback:
                raise BadRequest(f"bind address {bind} is loopback: connections from 127.0.0.0/8 cannot be "
                                 "DNATed into the bridge; bind a non-loopback address (the default, \"\", "
                                 "takes all of them)")
            bind = str(addr)
        nat = self._nat_table()
        port = int(port)
        with self._lock:
            sb = self._get(sb_id)
            if sb.mode != "default":
                raise Conflict(f"sandbox {sb_id} has --net none: it has no address to publish a port of")
            if (port, protocol) in sb.ports:
                pub = sb.ports[(port, protocol)]
                if host_port in (None, pub["host_port"]) and bind in ("", pub["bind"]):
                    return self._port_view(sb, pub)          # asked again: where it is (`dsec port SB 8080`)
                raise Conflict(f"port {port}/{protocol} of sandbox {sb_id} is published already, on host port "
                               f"{pub['host_port']}{' of ' + pub['bind'] if pub['bind'] else ''}; unpublish it "
                               "first (dsec port --rm) to move it",
                               {"sandbox": sb_id, "port": port, "protocol": protocol})
            if bind:
                self._check_local(bind)
            key = _nat_key(sb_id, port, protocol)
            hp = self._pick_host_port(nat, host_port, bind, sb_id, protocol, key)
            self._publish_rules(nat, sb, {"port": port, "protocol": protocol, "host_port": hp, "bind": bind})
            try:
                self._write_record(sb)
            except BaseException:
                self._unpublish_one(sb, (port, protocol))
                raise
            return self._port_view(sb, sb.ports[(port, protocol)])

    def _check_local(self, bind: str) -> None:
        """BadRequest unless `bind` is an address of the host side (the
        bridge's netns), where a published port can listen."""
        import ipaddress

        have = [a for a in self.plumbing.local_addresses() if a.version == 4 and not a.is_loopback]
        if ipaddress.IPv4Address(bind) not in have:
            raise BadRequest(f"bind address {bind} is not an address of the host side (the bridge's network "
                             f"namespace); give one of {', '.join(sorted(map(str, have))) or '(none)'}, or none "
                             "for all of them", {"bind": bind})

    def _pick_host_port(self, nat: HostNat, host_port: int | None, bind: str, sb_id: str,
                        protocol: str, key: str) -> int:
        """A host port for a `protocol` publication: one no other publication of
        that protocol here, no other daemon's claim (nat.PortClaims), no other
        table's DNAT of it and no socket of it on the host side has (TCP and
        UDP ports of one number are apart). Returned claimed for `key`."""
        def dnated(hp: int) -> bool:
            """Whether another table's DNAT of `hp` matches connections to `bind` too."""
            addrs = others.get(hp)
            return bool(addrs) and (not bind or "" in addrs or bind in addrs)

        def taken(hp: int) -> str | None:
            for (proto, b, p), owner in self._host_ports.items():
                if proto == protocol and p == hp and (not b or not bind or b == bind):
                    return owner
            return None

        shown = f"{host_port}/udp" if protocol == "udp" else host_port
        try:
            others = nat.dnat_ports_of_others(protocol)
        except NatError as err:
            log.warning("publish a port of sandbox %s: %s; host ports other tables DNAT are not avoided", sb_id, err)
            others = {}
        if host_port is not None:
            owner = taken(host_port)
            if owner is not None:
                raise Conflict(f"host port {shown} is published already (sandbox {owner}); pick another "
                               "--host-port", {"host_port": host_port, "protocol": protocol})
            self._claim_port(protocol, int(host_port), key, bind)
            try:
                if dnated(host_port):
                    raise Conflict(f"host port {shown} is DNATed by another nftables table of the host side "
                                   "(the bridge's network namespace: another daemon's published port, or a "
                                   "container engine's); pick another --host-port",
                                   {"host_port": host_port, "protocol": protocol})
                try:
                    nat.check_host_port(host_port, bind, protocol)
                except NatError as err:
                    raise Conflict(err.strerror or str(err),
                                   {"host_port": host_port, "protocol": protocol}) from None
            except BaseException:
                self.port_claims.give_up(protocol, int(host_port), key, bind)
                raise
            return int(host_port)
        lo, hi = self.publish_range
        held_by: set[int] = set()
        for hp in range(lo, hi + 1):
            if taken(hp) is None and not dnated(hp):
                pid = self.port_claims.claim(protocol, hp, key, bind)
                if pid is not None:         # another daemon's, maybe not DNATed yet: passed over
                    held_by.add(pid)
                    continue
                try:
                    nat.check_host_port(hp, bind, protocol)
                except NatError:
                    self.port_claims.give_up(protocol, hp, key, bind)
                    continue
                return hp
        raise LimitExceeded(f"no free {protocol.upper()} host port in net.publish_ports {lo}-{hi} "
                            f"for sandbox {sb_id}"
                            + (f" (some are other daemons'{pids_note(held_by)})" if held_by else ""))

    def _claim_port(self, protocol: str, host_port: int, key: str, bind: str) -> None:
        """Claim `protocol` `host_port` on `bind` ("": every address) for the
        publication `key`; Conflict naming the daemon that holds it."""
        pid = self.port_claims.claim(protocol, host_port, key, bind)
        if pid is not None:
            shown = f"{host_port}/udp" if protocol == "udp" else host_port
            where = (f"on {bind} or on every address" if bind
                     else "on some address (a publication on every address takes the port on each)")
            raise Conflict(f"host port {shown} is published by another dsecd daemon of the host side (the "
                           f"bridge's network namespace){pids_note([pid])}, {where}; pick another --host-port"
                           + ("" if bind else " or --bind an address it is not published on"),
                           {"host_port": host_port, "protocol": protocol, "bind": bind, "pid": pid})

    def _publish_rules(self, nat: HostNat, sb: _Sandbox, pub: dict) -> None:
        """The publication's DNAT, and for UDP the BPF side's entry that lets
        the sandbox answer who writes to the port (a TCP connection made to
        it is marked when accepted): the entry first, so the first datagram
        the DNAT lets in already marks its sender."""
        addr = sb.ipv4.split("/")[0]
        port, proto = pub["port"], pub["protocol"]
        key = _nat_key(sb.id, port, proto)
        self._claim_port(proto, pub["host_port"], key, pub["bind"])   # held already when picked (or restored)
        try:                                                # given up if it is not published
            if proto == "udp":
                self.engine.publish_udp(sb.cgroup_id, port)
            try:
                nat.publish(key, pub["host_port"], pub["bind"], addr, port, proto)
            except BaseException:
                if proto == "udp":
                    self.engine.unpublish_udp(sb.cgroup_id, port)
                raise
        except BaseException:
            self.port_claims.give_up(proto, pub["host_port"], key, pub["bind"])
            raise
        sb.ports[(port, proto)] = pub
        self._host_ports[(proto, pub["bind"], pub["host_port"])] = sb.id

    def _unpublish_one(self, sb: _Sandbox, key: tuple[int, str]) -> None:
        """Delete the port's DNAT, then forget it. If the DNAT could not be
        deleted, the port stays published (shown, recorded, its host port
        taken): the rule still sends that host port's connections to the
        sandbox's address. A UDP port's peers (whom the sandbox may answer)
        go after its DNAT and before its conntrack entries: no datagram
        marks a peer once the DNAT is gone, and none goes on through an
        entry (nat.unpublish deletes those last)."""
        pub = sb.ports[key]
        port, proto = key
        if self.nat is not None:
            self.nat.unpublish(_nat_key(sb.id, port, proto), None)
        if proto == "udp":
            self.engine.unpublish_udp(sb.cgroup_id, port)
        if self.nat is not None:
            self.nat.forget_flows(pub["host_port"], sb.ipv4.split("/")[0], port, proto)
        del sb.ports[key]
        self._host_ports.pop((proto, pub["bind"], pub["host_port"]), None)
        self.port_claims.give_up(proto, pub["host_port"], _nat_key(sb.id, port, proto), pub["bind"])

    def unpublish(self, sb_id: str, port: int, protocol: str = "tcp") -> dict:
        protocol = check_protocol(protocol)
        port = int(port)
        with self._lock:
            sb = self._get(sb_id)
            if (port, protocol) not in sb.ports:
                other = "udp" if protocol == "tcp" else "tcp"
                hint = f" ({port}/{other} is: name it as {port}/{other})" if (port, other) in sb.ports else ""
                raise NotFound(f"port {port}/{protocol} of sandbox {sb_id} is not published{hint}",
                               {"sandbox": sb_id, "port": port, "protocol": protocol})
            self._unpublish_one(sb, (port, protocol))
            self._write_record(sb)
            return {"sandbox": sb_id, "port": port, "protocol": protocol}

    def _unpublish_all(self, sb: _Sandbox) -> None:
        """Each port, whether or not another's failed; the first error is raised."""
        first = None
        with self._lock:
            for key in list(sb.ports):
                try:
                    self._unpublish_one(sb, key)
                except Exception as err:
                    first = first or err
        if first is not None:
            raise first

    def ports(self, sb_id: str) -> list[dict]:
        """The sandbox's published ports, as `show` lists them (none for one
        this Network does not have, or whose networking is gone)."""
        with self._lock:
            sb = self._sbs.get(sb_id)
            if sb is None or sb.mode != "default":
                return []
            return [self._port_view(sb, p) for p in sb.ports.values()]

    def _port_view(self, sb: _Sandbox, pub: dict) -> dict:
        host = pub["bind"] or str(self.ipam.gateway4)
        return {"port": pub["port"], "protocol": pub["protocol"], "host_port": pub["host_port"],
                "bind": pub["bind"], "host": f"{host}:{pub['host_port']}",
                "target": f"{sb.ipv4.split('/')[0]}:{pub['port']}"}

    # ------------------------------------------------------------ policy

    def _check_level(self, cgroup_dir: str) -> None:
        try:
            rel = Path(cgroup_dir).relative_to(self.v2)
        except ValueError:
            raise BadRequest(f"cgroup dir {cgroup_dir} is not under the cgroup v2 root {self.v2}") from None
        if len(rel.parts) != self.level:
            raise BadRequest(f"cgroup dir {cgroup_dir} is at depth {len(rel.parts)}, sandboxes are at {self.level}")

    def _effective(self, terms: tuple[str, ...], sb: _Sandbox | None = None) -> tuple[list[R.Rule], tuple]:
        """(address rules to compile, name rules): the terms' rules, the resolver's,
        and `sb`'s learned entries whose name rule is still in the terms."""
        rules = R.expand(list(self.essentials) + [t for t in terms if t not in self.essentials], self.sets)
        R.check_size(rules, self.max_rules)
        names = tuple(r for r in rules if isinstance(r, R.NameRule))
        addrs = [r for r in rules if not isinstance(r, R.NameRule)]
        if self.resolver_rule is not None:
            addrs.append(self.resolver_rule)
        if sb is not None and sb.ipv4:
            # Its own addresses, as its loopback: a server it runs on its eth0
            # and reaches by its hostname (/etc/hosts). Inside the pool's
            # fence, so no broader rule was ever needed for them.
            own = ipaddress.ip_interface(sb.ipv4).ip
            addrs.append(R.Rule(R.FAM_V4, int(own), 32))
            if self.ipam.subnet6 is not None:
                addrs.append(R.Rule(R.FAM_V6, int(self.ipam.own_ipv6(own)), 128))
        if sb is not None and sb.learned:
            keep = set(names)
            addrs += [r for r, ln in sb.learned.items() if ln.source in keep]
            addrs = list(dict.fromkeys(addrs))
        return addrs, names

    def _bpf_attach(self, sb: _Sandbox, terms: tuple[str, ...]) -> None:
        eng = self.engine
        with self._lock:
            sb.slot = eng.slots.take()[0]
            eng.reset_stats(sb.slot)
            self._apply(sb, terms)
        if sb.kind == "container":       # a VM's programs go on its tap (plug_vm)
            eng.attach(sb.cgroup_dir)

    def _apply(self, sb: _Sandbox, terms: tuple[str, ...], whole: bool = False) -> None:
        """Make `terms` the sandbox's policy, atomically. Caller holds the lock.
        whole: recompile all of it even if the rules did not change (the
        fences did).

        If the change touches one trie prefix, that prefix is rewritten in place:
        one map update, atomic by itself, O(1) whatever the policy's size. Otherwise
        the whole policy is written under a fresh id, the sandbox's entry flips to
        it (one map update), and the old id's prefixes are deleted. Any failure
        before the flip leaves the old policy in force and frees what was written.
        """
        eng = self.engine
        rules, names = self._effective(terms, sb)
        prefixes, candidates, delta = self._compile(sb, rules, whole)
        whole = candidates is None
        if whole:                       # recompiled whole: compare every prefix
            fresh = [r for r in rules if r not in sb.counters]
            counters = {r: sb.counters[r] for r in rules if r in sb.counters}
            candidates = prefixes.keys() | sb.prefixes.keys()
        else:                           # only `delta` changed: O(delta) bookkeeping, not O(policy)
            fresh = [r for r in rules if r in delta] if delta else []
            counters = dict(sb.counters)
            for r in delta:
                counters.pop(r, None)
        idxs = eng.counters.take(len(fresh))
        counters.update(zip(fresh, idxs, strict=True))
        changed = [k for k in candidates if prefixes.get(k) != sb.prefixes.get(k)]
        try:
            eng.reset_counters(idxs)
            if sb.policy and len(changed) <= 1:
                self._apply_in_place(sb, changed, prefixes, counters)
            else:
                self._apply_flip(sb, prefixes, counters)
        except BaseException:
            eng.counters.give(idxs)
            raise
        old_counters = sb.counters
        sb.terms, sb.prefixes, sb.counters, sb.names = terms, prefixes, counters, names
        if sb.learned and len(sb.learned) != sum(1 for r in sb.learned if r in counters):
            sb.learned = {r: ln for r, ln in sb.learned.items() if r in counters}   # name rule removed
        gone = old_counters.keys() - counters.keys() if whole else [r for r in delta if r in old_counters]
        eng.counters.give([old_counters[r] for r in gone])

    def _compile(self, sb: _Sandbox, rules: list[R.Rule], whole: bool = False) -> tuple[dict, set | None, set]:
        """(the new policy's trie entries, the keys that may differ from the sandbox's
        current ones - None: any -, the rules added or removed). When few rules
        change, only the prefixes they can affect are recomputed (a 1,000-rule
        policy stays cheap to edit), unless `whole` is asked for."""
        delta = set(rules) ^ sb.counters.keys()
        if whole or not sb.policy or len(delta) > 8 or R.touches_fence(delta, self.fences):
            return R.compile_prefixes(rules, fences=self.fences), None, delta
        # Every rule not in the delta is on a prefix the policy already has.
        keys = sb.prefixes.keys() | {r.key for r in delta}
        affected = R.affected_prefixes(delta, keys)
        partial = R.compile_prefixes(rules, only=affected, fences=self.fences)
        prefixes = dict(sb.prefixes)
        for k in affected:
            if k in partial:
                prefixes[k] = partial[k]
            else:
                prefixes.pop(k, None)
        return prefixes, affected, delta

    def _apply_in_place(self, sb: _Sandbox, changed: list, prefixes: dict, counters: dict) -> None:
        for k in changed:
            if k in prefixes:
                self.engine.write_prefix(sb.policy, k, prefixes[k], counters, new=k not in sb.prefixes)
            else:
                self.engine.delete_policy(sb.policy, [k])

    def _apply_flip(self, sb: _Sandbox, prefixes: dict, counters: dict) -> None:
        eng = self.engine
        policy = eng.new_policy_id()
        eng.write_policy(policy, prefixes, counters)
        try:
            eng.register(sb.cgroup_id, policy, sb.slot)   # the flip
        except BaseException:
            eng.delete_policy(policy, prefixes.keys())    # the old policy stays in force
            raise
        old_policy, old_prefixes = sb.policy, sb.prefixes
        sb.policy = policy
        if old_policy:
            eng.delete_policy(old_policy, old_prefixes.keys())

    def _drop_policy(self, sb: _Sandbox) -> None:
        eng = self.engine
        eng.unregister(sb.cgroup_id)
        if sb.policy:
            eng.delete_policy(sb.policy, sb.prefixes.keys())
        eng.counters.give(list(sb.counters.values()))
        if sb.slot >= 0:
            eng.slots.give([sb.slot])
        sb.prefixes, sb.counters, sb.slot, sb.policy = {}, {}, -1, 0

    def _get(self, sb_id: str) -> _Sandbox:
        sb = self._sbs.get(sb_id)
        if sb is None:
            raise NotFound(f"sandbox {sb_id} has no networking", {"sandbox": sb_id})
        if sb.state == "lost":
            raise Conflict(f"sandbox {sb_id}: its networking was cut off when the daemon restarted ({sb.lost}); "
                           "destroy it and create another", {"sandbox": sb_id})
        if sb.state != "attached":
            raise Conflict(f"sandbox {sb_id} is being destroyed", {"sandbox": sb_id})
        return sb

    def update_now(self, sb_id: str, add: list[str] | None = None, remove: list[str] | None = None,
                   replace: list[str] | None = None) -> dict | None:
        """update() on the caller's thread (the event loop) when it is known to be short,
        else None having done nothing (the caller then uses a worker thread).

        Why: through the daemon a `net set` on a 10-rule policy is ~0.1 ms of work
        (merge, compile, 1-3 map updates, one appended record line), less than
        the hop to a worker thread and back, which on a loaded 2-core host is
        two scheduling delays that dominate the p99 (target <= 1 ms). Short
        means: nobody holds the lock (no attach/readopt/compaction/other update
        in flight: never wait on the loop), at most INLINE_MAX_RULES rules before
        and after expanding sets, and no fsync of the record.
        """
        if self.records.fsync or not self._lock.acquire(blocking=False):
            return None
        try:
            sb = self._sbs.get(sb_id)
            if sb is None or sb.state != "attached" or sb.mode != "default":
                return None                       # the thread path gives the precise error
            if len(sb.counters) > INLINE_MAX_RULES or self.expanded_size(
                    (add or []) + (remove or []) + (replace or [])) > INLINE_MAX_RULES:
                return None
            return self.update(sb_id, add=add, remove=remove, replace=replace)
        finally:
            self._lock.release()

    def check_request_size(self, n: int) -> None:
        """Every term is at least one rule: refuse a huge request before parsing it
        (parsing is ~30 us a rule; a 100k-rule request would hold the lock for seconds)."""
        if n > self.max_rules:
            raise LimitExceeded(f"{n} rules in one request; net.max_rules_per_sandbox is {self.max_rules}",
                                {"rules": n, "max": self.max_rules})

    def expanded_size(self, terms: list[str]) -> int:
        """How many rules `terms` stand for, named sets counted whole; no parse."""
        return sum(len(self.sets[t]) if t in self.sets else 1 for t in terms)

    def update(self, sb_id: str, add: list[str] | None = None, remove: list[str] | None = None,
               replace: list[str] | None = None) -> dict:
        """Merge (see rules.py) and apply atomically; on any error the policy is unchanged."""
        t0 = time.perf_counter()
        try:
            return self._update(sb_id, add, remove, replace)
        finally:
            self._update_ms.append((time.perf_counter() - t0) * 1e3)

    def update_stats(self) -> dict:
        """Wall time of the last 1,024 updates inside the daemon (lock wait, merge, maps,
        record), for `dsec info`: the part of a `net set` that is this module's."""
        xs = sorted(self._update_ms)
        if not xs:
            return {"count": 0}
        return {"count": len(xs), "p50_ms": round(xs[len(xs) // 2], 3),
                "p99_ms": round(xs[min(len(xs) - 1, int(0.99 * (len(xs) - 1) + 0.5))], 3)}

    def _update(self, sb_id: str, add, remove, replace) -> dict:
        with self._lock:
            sb = self._get(sb_id)
            if sb.mode != "default":
                raise Conflict(f"sandbox {sb_id} has --net {sb.mode}: it has no policy to change")
            self.check_request_size(len(add or []) + len(replace or []))
            self.check_request_size(len(remove or []))        # parsed too: as long a list is as slow
            blocked = [t for t in (remove or []) if t in self.essentials]
            if blocked:
                raise BadRequest(f"{blocked} are essentials (net.essentials) and cannot be removed")
            terms = R.merge(sb.terms, self.sets, add=add, remove=remove, replace=replace)
            old = sb.terms
            self._apply(sb, terms)
            try:
                # Before the answer: an answered update is never lost. A crash after
                # the map update and before this line leaves the kernel with the new
                # policy and the record with the old one; the client got no answer,
                # and a restarted daemon re-applies the recorded (old) policy.
                self._write_record(sb)
            except OSError:
                self._apply(sb, old)          # keep kernel and journal in agreement
                raise
            return self._view(sb, counters=False)

    # ------------------------------------------------------------ learned entries (the resolver's)

    def client(self, addr: str) -> _Sandbox | None:
        """The attached --net default sandbox whose lease is `addr` (a query's source)."""
        try:
            a = int(ipaddress.IPv4Address(addr))
        except ValueError:
            return None
        sb = self._sbs.get(self.ipam._owner_of.get(a, ""))
        return sb if sb is not None and sb.state == "attached" and sb.mode == "default" else None

    def is_blocked(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        """An address no answer may add: loopback, link-local, the gateway, the
        sandboxes' pool, the host's addresses, and what is never the internet
        (rules.LINK_SCOPED: the cloud metadata services among them)."""
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr.version == n.version and addr in n for n in self.dns_blocked)

    def learn(self, sb_id: str, entries: dict[R.Rule, Learned], blocking: bool = True) -> bool | None:
        """Allow `entries` (address rules of a resolver's answer) until their expiry,
        atomically with the rest of the policy; a known entry's expiry only grows.
        blocking=False (the event loop): None, having done nothing, if the lock is
        busy or the change is not small. On error nothing is added; False, having
        added nothing, when the sandbox would hold more than max_learned
        learned entries, or more than its share (learned_shares) when the
        shared part of learned_budget is full."""
        if not self._lock.acquire(blocking=blocking):
            return None
        try:
            sb = self._sbs.get(sb_id)
            if sb is None or sb.state != "attached" or sb.mode != "default":
                return False
            if not blocking and len(sb.counters) > INLINE_MAX_RULES:      # a compile of >8 changes: a thread
                return None
            fresh = {r: ln for r, ln in entries.items()
                     if r not in sb.learned or sb.learned[r].expires < ln.expires}
            if not fresh:
                return True
            more = sum(1 for r in fresh if r not in sb.learned)
            if more and not self._may_learn(sb, more):
                # The trie is every sandbox's: see max_learned.
                sb.dns["learned_full"] += 1
                return False
            old = sb.learned
            sb.learned = {**old, **fresh}
            new_rules = [r for r in fresh if r not in old]
            if new_rules:
                try:
                    self._apply(sb, sb.terms)
                except BaseException:
                    sb.learned = old
                    raise
            return True
        finally:
            self._lock.release()

    def expire(self, now: float | None = None) -> float | None:
        """Remove learned entries past their expiry; the next expiry (monotonic), or None."""
        now = time.monotonic() if now is None else now
        nxt = None
        with self._lock:
            for sb in list(self._sbs.values()):
                if not sb.learned or sb.state != "attached":
                    continue
                gone = [r for r, ln in sb.learned.items() if ln.expires <= now]
                if gone:
                    old = sb.learned
                    sb.learned = {r: ln for r, ln in old.items() if ln.expires > now}
                    try:
                        self._apply(sb, sb.terms)
                        sb.dns["expired"] += len(gone)
                    except Exception as err:       # kept: retried at the next sweep
                        sb.learned = old
                        log.error("sandbox %s: remove %d expired learned entries: %s", sb.id, len(gone), err)
                        nxt = now + 1.0
                for ln in sb.learned.values():
                    nxt = ln.expires if nxt is None else min(nxt, ln.expires)
        return nxt

    def learned_shares(self) -> tuple[int, int]:
        """(what each sandbox may always learn, what all of them may learn
        beyond that together). Half of learned_budget is split evenly over
        limits.max_sandboxes (at most max_learned each): however many
        sandboxes sit at max_learned, each of the others can still learn its
        share. The other half (and what the shares leave) is first come,
        first served. A share that would round to 0 (a small net.max_prefixes)
        is 1 while the quarter holds one a sandbox, which the config check
        (engine/network.py _check_config) requires: with none reserved,
        sandboxes at their cap would starve the others again."""
        per = self.learned_budget // (2 * self.max_sandboxes)
        if per == 0 and self.learned_budget >= self.max_sandboxes:
            per = 1
        reserved = min(self.max_learned, per)
        return reserved, self.learned_budget - reserved * self.max_sandboxes

    def _may_learn(self, sb: _Sandbox, more: int) -> bool:
        """Whether `sb` may hold `more` learned entries more. Caller holds the lock."""
        have = len(sb.learned)
        if have + more > self.max_learned:
            return False
        reserved, shared = self.learned_shares()
        extra = max(0, have + more - reserved) - max(0, have - reserved)
        if not extra:
            return True
        beyond = sum(max(0, len(o.learned) - reserved) for o in self._sbs.values())
        return beyond + extra <= shared

    def learned_live(self) -> int:
        """Learned entries of all sandboxes now (list(): one step under the
        GIL, so the event loop may ask without the lock)."""
        return sum(len(sb.learned) for sb in list(self._sbs.values()))

    def learned_info(self) -> dict:
        """For `dsec info`: learned entries now, and the caps (see max_learned)."""
        reserved, shared = self.learned_shares()
        return {"live": self.learned_live(), "budget": self.learned_budget, "per_sandbox": self.max_learned,
                "reserved_per_sandbox": reserved, "shared": shared}

    def _retire_counts(self, sb: _Sandbox) -> None:
        self._retired.update({f"dns_{k}": v for k, v in sb.dns.items()})
        if sb.slot >= 0:
            try:
                self._retired.update(self.engine.stats(sb.slot))
            except OSError as err:        # the map is gone (shutdown): its counts with it
                log.warning("sandbox %s: read its default-deny counters: %s", sb.id, err)

    def drop_totals(self) -> dict:
        """What the default-deny refused (denied_connect, denied_sendmsg,
        dropped_packets) and the resolver's per-sandbox counters (dns_<name>),
        summed over every sandbox this daemon networked, gone ones included
        (blocking: a BPF map read per live sandbox). For the metrics."""
        with self._lock:
            live = [(sb.slot, collections.Counter(sb.dns)) for sb in self._sbs.values()
                    if sb.mode == "default" and sb.slot >= 0]
            out = collections.Counter(self._retired)
        for slot, dns in live:
            out.update({f"dns_{k}": v for k, v in dns.items()})
            out.update(self.engine.stats(slot))
        return dict(out)

    def show(self, sb_id: str) -> dict:
        """Terms, rules with their `allowed` counters, and what the default-deny refused."""
        with self._lock:
            return self._view(self._get(sb_id), counters=True)

    def _view(self, sb: _Sandbox, counters: bool) -> dict:
        out = {"sandbox": sb.id, "mode": sb.mode}
        if sb.mode != "default":
            return out
        eng = self.engine
        sources: dict[R.Rule, list[str]] = {}
        names: dict[R.NameRule, list[str]] = {}
        for t in self.essentials + sb.terms:
            for r in self.sets[t] if t in self.sets else (_parse_term(t),):
                src = (names if isinstance(r, R.NameRule) else sources).setdefault(r, [])
                if t not in src:
                    src.append(t)
        now = time.monotonic()
        learned = []
        for r, ln in sb.learned.items():
            sources.setdefault(r, []).append(f"dns:{ln.qname}")
            learned.append({"rule": str(r), "name": ln.qname, "by": str(ln.source),
                            "expires_in": round(max(0.0, ln.expires - now), 1)})
        rules = [{"rule": str(r), "from": sources.get(r, []), **({"allowed": eng.hits(idx)} if counters else {})}
                 for r, idx in sb.counters.items() if r in sources]     # not the resolver's rule: see "dns"
        if sb.lease_view is None:             # fixed for the sandbox's life; ipaddress's str() is slow
            lease = self.ipam.get(sb.id)
            sb.lease_view = lease.to_dict() if lease else None
        out.update(interface=sb.ifname, lease=dict(sb.lease_view) if sb.lease_view else None,
                   terms=list(sb.terms), essentials=list(self.essentials), rules=rules,
                   ports=[self._port_view(sb, p) for p in sb.ports.values()],
                   names=[{"rule": str(r), "from": src} for r, src in names.items()], learned=learned)
        if self.dns_enabled:
            out["dns"] = {"resolver": str(self.ipam.gateway4), **{k: sb.dns.get(k, 0) for k in DNS_COUNTERS},
                          "refused_names": list(sb.refused_names)}
        if counters:
            out["default"] = {"action": "deny", **eng.stats(sb.slot)}
        return out

    # ------------------------------------------------------------ restart

    def readopt(self, live: dict[str, tuple[int | str, str]]) -> dict:
        """After a daemon restart. `live` = {sb_id: (netns, cgroup_v2_dir)} of sandboxes still running.
        Returns {"adopted", "released", "failed": {sb_id: why}, "sealed", "held"}:
        `failed` sandboxes are cut off with loopback only, except the
        `sealed` ones among them, whose veth could not be deleted: all of
        their traffic is refused, loopback too (_cut_off_cgroup). `held`:
        sandboxes that are gone (a destroy whose detach failed, retried in
        the background until the daemon stopped, or one that died while no
        daemon ran) whose veth could not be deleted now either: their
        address stays leased and their record kept, for retry_detach.

        Rebuilds each live sandbox's policy in this process's maps and re-attaches
        (an atomic replace of the old daemon's programs, which enforced the old
        policy meanwhile); recreates a missing veth; frees leases and records of
        everything else. Counters restart from zero.
        """
        records = dict(self.records.records)
        adopted, released, failed, sealed, stuck = [], [], {}, [], []
        previous: dict = {}                 # the previous daemon's mark maps, held open (Engine.hold_marks)
        if self.nat is None and any(recorded_ports(rec) for rec in records.values()):
            # The previous daemon published ports, and if it was killed its table is
            # still there: replace it now, or the DNAT of a sandbox that is gone
            # would stay, towards an address IPAM leases again.
            try:
                self._nat_table()
            except NatError as err:
                log.error("replace the nftables table a previous daemon left: %s", err)
        elif self.nat is None:
            # No uplink and no published port: this daemon needs no table, and one
            # the previous daemon kept at its stop (or left when killed), with an
            # uplink then, would masquerade on for no daemon.
            try:
                if delete_table(self.plumbing.ns_path, self.cfg["bridge"]):
                    log.info("deleted the nftables table %s a previous daemon left (no net.uplink, no "
                             "published port now)", table_name(self.cfg["bridge"]))
            except NatError as err:
                log.error("delete the nftables table a previous daemon left: %s", err)
        for sb_id, rec in records.items():
            if sb_id not in live:
                try:
                    self._release_leftovers(sb_id)
                except Exception as err:
                    # Its veth stands (its other end has the address): the lease
                    # and record stay. One stuck link must not take every
                    # sandbox's networking down with it.
                    log.error("sandbox %s is gone, but what is left of its networking could not be "
                              "removed: %s; its address stays leased, removal is retried", sb_id, err)
                    stuck.append(sb_id)
                    continue
                released.append(sb_id)
                continue
            netns, cgroup_dir = live[sb_id]
            try:
                if rec.get("lost"):
                    # An earlier daemon cut it off and said so; what it could not
                    # remove then (its veth) is removed now, nothing given back.
                    raise OSError(errno.ENETDOWN, f"cut off by an earlier daemon: {rec['lost']}")
                self._readopt_one(sb_id, rec, netns, str(cgroup_dir), previous)
                adopted.append(sb_id)
            except Exception as err:
                # Fail closed: no veth, no lease, no record; the node should destroy it.
                log.error("readopt networking of sandbox %s: %s; cutting it off", sb_id, err)
                failed[sb_id] = str(err)
                sb = self._sbs.get(sb_id)
                try:
                    if sb is not None:
                        self._teardown(sb, live=True)
                    else:
                        try:
                            self._release_leftovers(sb_id)
                        except Exception:
                            self._cut_off_cgroup(sb_id, str(cgroup_dir), rec.get("ifname", ""), link_gone=False)
                            raise
                        self._cut_off_cgroup(sb_id, str(cgroup_dir), "", link_gone=True)
                except Exception as err2:
                    log.error("tear down networking of sandbox %s: %s", sb_id, err2)
                with self._lock:
                    held = self._sbs.get(sb_id)
                    if held is not None and held.state == "attached":
                        # Its address stays leased while its veth (or a VM's tap)
                        # stands; it has no networking for anyone to show,
                        # change, plug or answer queries of.
                        held.state, held.lost = "lost", str(err)
                if rec.get("kind") != "vm" and rec.get("ifname") and self._has_link(rec["ifname"]):
                    sealed.append(sb_id)          # its veth stays: refuse-all programs on its cgroup
                if self.records.get(sb_id) is not None:
                    # Held (its veth stays): the next daemon must not adopt it again.
                    try:
                        self.records.put(sb_id, {**rec, "lost": rec.get("lost") or str(err)})
                    except OSError as err3:
                        log.error("sandbox %s: record that its networking was cut off: %s", sb_id, err3)
        try:
            if previous:
                # Again, now that no program of the previous daemon marks anything:
                # what it marked between the first copy and each replace.
                self.engine.carry_marks(previous.values())
        except OSError as err:
            log.error("copy the previous daemon's accepted connections: %s", err)
        finally:
            for m in previous.values():
                m.close()
            with self._lock:
                # Ports of records whose sandbox is gone, or that were not
                # published again: no longer this daemon's.
                self.port_claims.keep_only(self._published_keys())
        return {"adopted": adopted, "released": sorted(set(released)), "failed": failed, "sealed": sealed,
                "held": stuck}

    def _has_link(self, ifname: str) -> bool:
        """Whether the veth `ifname` is still there; if that cannot be told, yes."""
        try:
            return self.plumbing.has_sandbox(ifname)
        except OSError as err:
            log.error("look for the veth %s: %s", ifname, err)
            return True

    def _readopt_one(self, sb_id: str, rec: dict, netns, cgroup_dir: str, previous: dict) -> None:
        if rec.get("kind") == "vm":
            self._readopt_vm(sb_id, rec)
            return
        sb = _Sandbox(sb_id, rec["mode"], cgroup_dir, os.stat(cgroup_dir).st_ino,
                      ifname=rec.get("ifname") or (host_ifname(sb_id) if rec["mode"] == "default" else ""))
        with self._lock:
            self._sbs[sb_id] = sb
        if sb.mode != "default":
            return
        terms = []
        for t in rec.get("terms", []):
            try:
                terms.append(R.canonical_term(t, self.sets))
            except BadRequest as err:     # a rule set renamed or removed from the config meanwhile
                log.warning("sandbox %s: dropping rule %r on readopt: %s", sb_id, t, err.message)
        terms = tuple(terms)
        # The lease before the policy, which lets the sandbox reach its own address.
        lease = self.ipam_allocate(sb_id)       # the restored one, or a fresh one if it was lost
        if rec.get("ipv4") and str(lease.ipv4) != rec["ipv4"] and self.plumbing.has_sandbox(sb.ifname):
            # Its eth0 keeps the old address, outside the pool's fence now
            # (net.ipv4_pool changed): fail closed, as a microVM does.
            raise OSError(errno.EADDRNOTAVAIL, f"its address {rec['ipv4']} was lost (not in net.ipv4_pool "
                          f"{self.ipam.pool} now); its eth0 still has it")
        sb.ipv4 = str(lease.ipv4)
        self._carry_marks(cgroup_dir, previous)
        self._bpf_attach(sb, terms)
        if not self.plumbing.has_sandbox(sb.ifname):
            self.plumbing.add_sandbox(sb.ifname, netns_path(netns), lease)
        self._republish(sb, rec)
        self._write_record(sb)

    def _republish(self, sb: _Sandbox, rec: dict) -> None:
        """A readopted sandbox's published ports (its record's), again: the
        record written after holds only what sb.ports has."""
        for pub in recorded_ports(rec):
            name = pub.get("port") if pub["protocol"] == "tcp" else f"{pub.get('port')}/{pub['protocol']}"
            try:
                nat = self._nat_table()
                with self._lock:
                    # Another daemon may hold it now (claimed while none of
                    # ours did): refused, naming it.
                    self._claim_port(pub["protocol"], int(pub["host_port"]),
                                     _nat_key(sb.id, int(pub["port"]), pub["protocol"]), pub["bind"])
                # While no daemon ran (its table goes at stop) a process of the
                # host side may have taken the port: the DNAT would hide it.
                nat.check_host_port(int(pub["host_port"]), pub["bind"], pub["protocol"])
                with self._lock:
                    self._publish_rules(nat, sb, pub)
            except (OSError, DsecError) as err:     # the port stays closed; the sandbox keeps the rest
                why = (err.strerror if isinstance(err, OSError) else None) or str(err)
                log.error("sandbox %s: port %s not published again after the restart (host port %s): %s; "
                          "`dsec port %s %s` publishes it on a free one", sb.id, name,
                          pub.get("host_port"), why.removesuffix("; pick another --host-port"), sb.id, name)


    def _carry_marks(self, cgroup_dir: str, previous: dict) -> None:
        """Before this daemon's programs replace the previous daemon's on a
        sandbox: the connections the sandbox accepted under them, copied
        into this daemon's map once per map, which `previous` (id -> Map)
        then holds open for readopt's second pass (the last replace frees
        it otherwise). A failure costs those connections their answers, not
        the sandbox."""
        try:
            found = self.engine.hold_marks(self.engine.previous_marks(cgroup_dir) - previous.keys())
            previous.update(found)
            self.engine.carry_marks(found.values())
        except OSError as err:
            log.error("copy the previous daemon's accepted connections (%s): %s", cgroup_dir, err)

    def _readopt_vm(self, sb_id: str, rec: dict) -> None:
        """A microVM's policy and lease again; if its QEMU runs (its tap is
        there) this daemon's dsec_tap replaces the previous daemon's on it.
        A paused VM has no tap until its resume plugs one."""
        sb = _Sandbox(sb_id, "default", "", vm_key(sb_id), kind="vm", ifname=rec.get("ifname") or vm_ifname(sb_id))
        with self._lock:
            self._sbs[sb_id] = sb
        terms = []
        for t in rec.get("terms", []):
            try:
                terms.append(R.canonical_term(t, self.sets))
            except BadRequest as err:
                log.warning("sandbox %s: dropping rule %r on readopt: %s", sb_id, t, err.message)
        lease = self.ipam_allocate(sb_id)
        if rec.get("ipv4") and str(lease.ipv4) != rec["ipv4"]:
            raise OSError(errno.EADDRNOTAVAIL, f"its address {rec['ipv4']} was lost (given {lease.ipv4} now); "
                          "the guest still uses the old one")
        sb.ipv4 = str(lease.ipv4)
        self._bpf_attach(sb, tuple(terms))      # after the lease: the policy holds its own address
        idx = self.plumbing.link_index(sb.ifname)
        if idx is not None:
            iface, ipv6 = ipaddress.ip_interface(sb.ipv4), self._vm_ipv6(sb_id)
            self.engine.register_tap(idx, sb.cgroup_id, iface.ip.packed, vm_mac(iface.ip.packed),
                                     ipv6.ip.packed if ipv6 else b"")
            with self._bridge_netns():
                self.engine.attach_tap(idx, sb.ifname)
            sb.tap_index = idx
        # Its ports go to its address whether or not its QEMU runs now (a
        # paused VM's resume plugs a new tap; the NAT rules need none).
        self._republish(sb, rec)
        self._write_record(sb)


def _nat_key(sb_id: str, port: int, protocol: str) -> str:
    """A publication's name in the nftables table: `SB:PORT` for TCP (as it
    always was), `SB:PORT/udp` for UDP."""
    return f"{sb_id}:{port}" if protocol == "tcp" else f"{sb_id}:{port}/{protocol}"


def vm_key(sb_id: str) -> int:
    """A microVM's key in the `sandboxes` map, in place of a cgroup id (no
    socket of the guest is on the host). The top bit is never set in a
    cgroup id (its high half is a generation number counting from 1), so the
    two never meet; stable across restarts (from the id alone)."""
    return (1 << 63) | int.from_bytes(hashlib.blake2s(sb_id.encode(), digest_size=7).digest(), "big")


@functools.lru_cache(maxsize=65536)
def _parse_term(term: str) -> R.Rule:
    """Canonical terms repeat across updates and views; parsing one is ~30 us (regex, ipaddress)."""
    return R.parse_rule(term)


def bpf_cache_dir(cfg: dict, state_dir: Path | str) -> Path:
    """Where the compiled BPF object is cached (net.bpf_cache_dir, "" = <state_dir>/cache/bpf)."""
    return Path(cfg.get("bpf_cache_dir") or Path(state_dir) / "cache" / "bpf")


@dataclass(frozen=True)
class Learned:
    expires: float        # time.monotonic()
    source: R.NameRule    # the name rule it was learned for
    qname: str            # the name the sandbox asked for


def _pool_seq(name: str | None, prefix: str) -> int:
    """The number of a pool entry's name `<prefix><hex>`; -1 for any other name."""
    if not name or not name.startswith(prefix):
        return -1
    try:
        return int(name[len(prefix):], 16)
    except ValueError:
        return -1


def pool_tag(state_dir: Path | str) -> str:
    """4 hex digits naming this state dir's pool entries (`dp<tag><n>`)."""
    return hashlib.blake2s(str(Path(state_dir).resolve()).encode(), digest_size=2).hexdigest()


def _check_joined(netns: int | str, ready: Ready) -> None:
    """The sandbox really is in the pooled netns (else its policy would guard the wrong link)."""
    want, got = os.fstat(ready.nsfd), os.stat(netns_path(netns))
    if (want.st_dev, want.st_ino) != (got.st_dev, got.st_ino):
        raise OSError(errno.EINVAL, f"sandbox netns `{netns_path(netns)}` is not the pooled netns {ready.name} it was given")
