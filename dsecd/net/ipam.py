"""IPAM: one address per sandbox from the bridge's subnet, leases kept on disk.

Leases live in one JSON file replaced atomically (temp file + rename, fsync
optional), so a daemon killed at any point leaves the old or the new lease
table, never a torn one; a restarted daemon reads it back and keeps every
lease whose sandbox is still alive (`retain`). Addresses are handed out
round-robin from a cursor so a just-freed address is not reused at once (a
peer's ARP cache may still point at the old sandbox's MAC).

IPv6, when configured, mirrors IPv4: the sandbox gets the address at the same
offset in the IPv6 subnet, so one lease covers both families.

Not thread-safe by itself: callers hold a lock (Network does).
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import Busy

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


class Ipam:
    def __init__(self, path: Path, subnet: str, pool: str = "", subnet6: str = "", fsync: bool = False):
        self.path = Path(path)
        self.fsync = fsync
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
        self._cursor = 0
        self._load()

    # ------------------------------------------------------------ persistence

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            raise ValueError(f"read IPAM leases {self.path}: {err}") from err
        self._leases = {o: int(ipaddress.IPv4Address(a)) for o, a in data.get("leases", {}).items()}
        self._cursor = int(data.get("cursor", 0))

    def _save(self) -> None:
        data = {"version": 1, "subnet": str(self.subnet), "cursor": self._cursor,
                "leases": {o: str(ipaddress.IPv4Address(a)) for o, a in sorted(self._leases.items())}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(data).encode())
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)

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
        used = set(self._leases.values())
        base, n = int(self.pool.network_address), self.pool.num_addresses
        for i in range(n):
            off = (self._cursor + i) % n
            a = base + off
            if self._usable(a) and a not in used:
                self._leases[owner] = a
                self._cursor = (off + 1) % n
                self._save()
                return self._lease(owner, a)
        raise Busy(f"no free address in net.ipv4_pool {self.pool} ({len(used)} leased)",
                   {"pool": str(self.pool), "leased": len(used)})

    def get(self, owner: str) -> Lease | None:
        a = self._leases.get(owner)
        return None if a is None else self._lease(owner, a)

    def release(self, owner: str) -> bool:
        if self._leases.pop(owner, None) is None:
            return False
        self._save()
        return True

    def retain(self, owners: set[str]) -> list[str]:
        """After a restart: free the leases of owners not in `owners`; returns them."""
        gone = sorted(o for o in self._leases if o not in owners)
        for o in gone:
            del self._leases[o]
        if gone:
            self._save()
        return gone

    def owners(self) -> set[str]:
        return set(self._leases)
