"""IPAM: one address per sandbox from the bridge's subnet.

The table is in memory; what makes it durable is the sandbox's network record
(dsecd/journal.py RecordLog), which carries the address: a restarted daemon rebuilds
the table from the records (`restore`) and frees the leases of sandboxes that
are gone. One appended record per create instead of rewriting a whole lease
file (that was a temp file + rename per change: ~1 ms, and 150 KB at 4,096
sandboxes). Addresses of the netns pool (dsecd/net/pool.py) are leased here
under the pool entry's name and never recorded: a pool entry dies with the
daemon, and so does its lease. `rekey` hands one over to the sandbox that
takes the entry.

Addresses are handed out round-robin from a cursor so a just-freed address is
not reused at once (a peer's ARP cache may still point at the old sandbox's MAC).

IPv6, when configured, mirrors IPv4: the sandbox gets the address at the same
offset in the IPv6 subnet, so one lease covers both families.

Daemons may share a bridge (each with its own state dir; two with the
default config share dsec0): every address leased is also claimed host-wide
(`AddressClaims`), and one another daemon on the same bridge holds is
passed over, so no two sandboxes on one bridge get the same address.

Not thread-safe by itself: callers hold a lock (Network does).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import Busy
from ..hostclaims import HostClaims, pids_note

log = logging.getLogger(__name__)

# The one file every dsecd daemon of the host claims its sandboxes' addresses in.
HOST_CLAIMS = "/run/dsecd-net.lock"

V4Net = ipaddress.IPv4Network
V6Net = ipaddress.IPv6Network


@dataclass(frozen=True)
class Lease:
    owner: str
    ipv4: ipaddress.IPv4Interface          # address/prefixlen of the subnet
    gateway4: ipaddress.IPv4Address
    ipv6: ipaddress.IPv6Interface | None = None
    gateway6: ipaddress.IPv6Address | None = None

    def to_dict(self) -> dict:
        return {"owner": self.owner, "ipv4": str(self.ipv4), "gateway4": str(self.gateway4),
                "ipv6": str(self.ipv6) if self.ipv6 else None,
                "gateway6": str(self.gateway6) if self.gateway6 else None}


def bridge_block(ns_path: str | None, bridge: str) -> int:
    """2^32 times 31 bits of a hash of a bridge's netns (its nsfs device and
    inode; None: this process's) and name: where the host-wide claims of
    that bridge begin (daemons on one bridge compute the same)."""
    st = os.stat(ns_path or "/proc/self/ns/net")
    digest = hashlib.blake2b(f"{st.st_dev}:{st.st_ino}:{bridge}".encode(), digest_size=4).digest()
    return (int.from_bytes(digest, "big") >> 1) << 32


class AddressClaims:
    """The IPv4 addresses leased on one bridge, claimed host-wide: byte
    `base + address` of HOST_CLAIMS (HostClaims), where `base` is the
    bridge's block (bridge_block). Daemons on one bridge claim the same bytes for the same address;
    bridges of the same name in other netns, and other bridges, claim
    others (offsets stay below 2^63, the largest a lock can name)."""

    def __init__(self, ns_path: str | None, bridge: str, path: str = HOST_CLAIMS):
        self.base = bridge_block(ns_path, bridge)
        self.claims = HostClaims(path)

    def claim(self, a: int) -> int | None:
        """None once address `a` is this daemon's; else the pid of a daemon holding it (0: let go meanwhile)."""
        return self.claims.claim(self.base + a, 1)

    def give_up(self, a: int) -> None:
        self.claims.give_up(self.base + a, 1)


class Ipam:
    def __init__(self, subnet: str, pool: str = "", subnet6: str = "", claims: AddressClaims | None = None):
        self.subnet = V4Net(subnet)
        self.pool = V4Net(pool) if pool else self.subnet
        if not self.pool.subnet_of(self.subnet):
            raise ValueError(f"net.ipv4_pool {self.pool} is not inside net.ipv4_subnet {self.subnet}")
        if self.subnet.num_addresses < 4:
            raise ValueError(f"net.ipv4_subnet {self.subnet} is too small")
        self.gateway4 = self.subnet.network_address + 1
        self.subnet6 = V6Net(subnet6) if subnet6 else None
        if self.subnet6 and self.subnet6.num_addresses < self.subnet.num_addresses:
            raise ValueError(f"net.ipv6_subnet {self.subnet6} is smaller than the IPv4 subnet {self.subnet}")
        self.gateway6 = self.subnet6.network_address + 1 if self.subnet6 else None
        self._leases: dict[str, int] = {}        # owner -> IPv4 address as int
        self._owner_of: dict[int, str] = {}      # the reverse, so nothing here is O(leases)
        self._cursor = 0
        self.claims = claims

    def _set(self, owner: str, a: int) -> Lease:
        self._leases[owner] = a
        self._owner_of[a] = owner
        return self._lease(owner, a)

    # ------------------------------------------------------------ restart

    def restore(self, owner: str, ipv4: str) -> Lease:
        """Re-enter a recorded lease (after a restart). ValueError if the address is
        outside the pool (the config changed) or already someone else's."""
        a = int(ipaddress.IPv4Interface(ipv4).ip)
        if not (int(self.pool.network_address) <= a <= int(self.pool.broadcast_address)) or not self._usable(a):
            raise ValueError(f"recorded address {ipv4} of {owner} is not in net.ipv4_pool {self.pool}")
        holder = self._owner_of.get(a)
        if holder is not None and holder != owner:
            raise ValueError(f"recorded address {ipv4} of {owner} is leased to {holder} too")
        if self._leases.get(owner) != a:
            # (The same address kept: giving its claim up before claiming it
            # again would let another daemon on the bridge take it in between.)
            self.release(owner)
        self._cursor = max(self._cursor, (a - int(self.pool.network_address) + 1) % self.pool.num_addresses)
        if self.claims is not None and (pid := self.claims.claim(a)) is not None:
            # Taken by another daemon on the bridge while this one was down:
            # the sandbox's interface has the address either way.
            log.error("address %s of %s is also held by another daemon on the bridge%s: two sandboxes "
                      "there have it; destroy one of them", ipv4, owner, pids_note([pid]))
        return self._set(owner, a)

    @staticmethod
    def read_legacy(path: Path) -> dict[str, str]:
        """owner -> address from a leases.json of an older dsecd ({} if none)."""
        try:
            with open(path, "rb") as f:
                return dict(json.load(f).get("leases", {}))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError) as err:
            raise ValueError(f"read IPAM leases {path}: {err}") from err

    # ------------------------------------------------------------ leases

    def _lease(self, owner: str, a: int) -> Lease:
        v4 = ipaddress.IPv4Interface((a, self.subnet.prefixlen))
        v6 = None
        if self.subnet6:
            off = a - int(self.subnet.network_address)
            v6 = ipaddress.IPv6Interface((int(self.subnet6.network_address) + off, self.subnet6.prefixlen))
        return Lease(owner, v4, self.gateway4, v6, self.gateway6)

    def _usable(self, a: int) -> bool:
        return a not in (int(self.subnet.network_address), int(self.subnet.broadcast_address),
                         int(self.gateway4))

    def allocate(self, owner: str) -> Lease:
        """The owner's lease (the same one again if it has one). Busy when the pool is full."""
        if owner in self._leases:
            return self._lease(owner, self._leases[owner])
        base, n = int(self.pool.network_address), self.pool.num_addresses
        elsewhere: Counter[int] = Counter()     # pid of another daemon on the bridge -> addresses it holds
        for i in range(n):
            off = (self._cursor + i) % n
            a = base + off
            if self._usable(a) and a not in self._owner_of:
                if self.claims is not None and (pid := self.claims.claim(a)) is not None:
                    elsewhere[pid] += 1
                    continue
                self._cursor = (off + 1) % n
                return self._set(owner, a)
        held = sum(elsewhere.values())
        raise Busy(f"no free address in net.ipv4_pool {self.pool} ({len(self._leases)} leased"
                   + (f", {held} held by another daemon on this bridge" + pids_note(elsewhere)
                      + "; give each daemon a net.ipv4_pool or net.bridge of its own" if held else "") + ")",
                   {"pool": str(self.pool), "leased": len(self._leases), "held_elsewhere": held})

    def own_ipv6(self, ipv4: ipaddress.IPv4Address) -> ipaddress.IPv6Address:
        """The IPv6 address that mirrors `ipv4` (net.ipv6_subnet set)."""
        return self.subnet6.network_address + (int(ipv4) - int(self.subnet.network_address))

    def get(self, owner: str) -> Lease | None:
        a = self._leases.get(owner)
        return None if a is None else self._lease(owner, a)

    def release(self, owner: str) -> bool:
        a = self._leases.pop(owner, None)
        if a is None:
            return False
        self._owner_of.pop(a, None)
        if self.claims is not None:
            self.claims.give_up(a)
        return True

    def rekey(self, old: str, new: str) -> Lease:
        """Give `old`'s lease (a pool entry's) to `new` (the sandbox that took it)."""
        if new in self._leases:
            raise ValueError(f"{new} already has a lease")
        a = self._leases.pop(old)
        return self._set(new, a)

    def retain(self, owners: set[str]) -> list[str]:
        """After a restart: free the leases of owners not in `owners`; returns them."""
        gone = sorted(o for o in self._leases if o not in owners)
        for o in gone:
            self.release(o)
        return gone

    def owners(self) -> set[str]:
        return set(self._leases)
