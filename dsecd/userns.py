"""User namespaces of container sandboxes: id ranges, and what maps through them.

With `[sandbox] userns = true` every container sandbox gets its own range of
`userns_size` host ids starting at `userns_base + slot * userns_size`: its
root (uid 0) is host uid `userns_base + slot * userns_size`, an unprivileged
uid owning nothing on the host. The slot is part of the sandbox's journal
record, so a restarted daemon keeps every live sandbox's range and never
hands it out twice; a slot is free again once its sandbox is destroyed (its
processes are dead and its files deleted by then, so no host object keeps a
reused id).

Files keep in-sandbox ids on disk (docs/hardening.md "User namespaces"): the
layers and the upper dir are idmapped mounts through the sandbox's user
namespace, so uid 0 in the image, in the upper dir and in pack_diff stays 0.
The daemon's own file access goes through the same overlay and so runs with
the sandbox root's host ids as fs ids (`as_sandbox_root`), and translates
the ids it reports back (`IdMap.to_sandbox`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from . import native
from .feature import Feature

ID_MAX = 2**32 - 2          # (u32)-1 is "no id" to the kernel
OVERFLOW_ID = 65534         # what the kernel shows for an unmapped id (overflowuid)


class RangesExhausted(Exception):
    """Every id range is in use."""


@dataclass(frozen=True)
class IdMap:
    """In-sandbox ids 0..count-1 are host ids uid.. (and gid..)."""

    slot: int
    uid: int
    gid: int
    count: int

    def to_sandbox(self, host_id: int, gid: bool = False) -> int:
        base = self.gid if gid else self.uid
        return host_id - base if base <= host_id < base + self.count else OVERFLOW_ID

    def record(self) -> dict:
        return {"slot": self.slot, "uid": self.uid, "gid": self.gid, "count": self.count}

    @classmethod
    def from_record(cls, rec: dict | None) -> IdMap | None:
        if not rec:
            return None
        return cls(int(rec["slot"]), int(rec["uid"]), int(rec["gid"]), int(rec["count"]))


class RangeAllocator:
    """Slots of `size` ids from `base`; the lowest free slot is handed out."""

    def __init__(self, base: int, size: int, max_slots: int = 0):
        if not 0 < size <= 2**32 or base < 1 or base + size > ID_MAX:
            raise ValueError(f"sandbox.userns_base {base} + userns_size {size} is not a valid id range")
        fit = (ID_MAX + 1 - base) // size
        self.base, self.size = base, size
        self.slots = min(fit, max_slots) if max_slots > 0 else fit
        self.used: set[int] = set()
        self._next = 0

    def _make(self, slot: int) -> IdMap:
        start = self.base + slot * self.size
        return IdMap(slot, start, start, self.size)

    def allocate(self) -> IdMap:
        if len(self.used) >= self.slots:
            raise RangesExhausted(f"all {self.slots} user-namespace id ranges of {self.size} ids "
                                  f"from {self.base} are in use (sandbox.userns_base/userns_size)")
        slot = self._next
        while slot in self.used:
            slot = (slot + 1) % self.slots
        self.used.add(slot)
        self._next = (slot + 1) % self.slots   # round robin: a freed range rests before reuse
        return self._make(slot)

    def reserve(self, idmap: IdMap) -> None:
        """Mark a journaled range used again (daemon restart). A record that does
        not match this configuration is refused: its sandbox keeps its ids, but
        they could overlap the new ranges."""
        if self._make(idmap.slot) != idmap or idmap.slot >= self.slots:
            raise ValueError(f"journaled id range {idmap.record()} does not match sandbox.userns_base "
                             f"{self.base} / userns_size {self.size}")
        if idmap.slot in self.used:
            raise ValueError(f"id range slot {idmap.slot} is journaled twice")
        self.used.add(idmap.slot)

    def release(self, idmap: IdMap | None) -> None:
        if idmap is not None:
            self.used.discard(idmap.slot)


def create_namespace(idmap: IdMap) -> int:
    """An fd of a new user namespace for `idmap` (close it after the spawn)."""
    return native.userns_create(idmap.uid, idmap.gid, idmap.count)


def probe_idmap(path: str) -> Feature:
    """Whether a mount holding `path` can be idmapped here (a user namespace
    is made and a real idmapped clone of the mount taken), or why not."""
    try:
        ns = native.userns_create(ID_MAX - 65536, ID_MAX - 65536, 65536)
    except OSError as err:
        return Feature(False, f"user namespace: {err}")
    try:
        os.close(native.mount_idmapped(path, ns))
    except OSError as err:
        return Feature(False, str(err))
    finally:
        os.close(ns)
    return Feature(True, f"user namespace + MOUNT_ATTR_IDMAP of {path} works")


def as_sandbox_root(idmap: IdMap | None):
    """Context for host-side file access into a sandbox: with a user namespace,
    the thread's fs ids become the sandbox root's host ids (files it creates
    are owned by sandbox root, which an idmapped upper layer can store; files
    owned by host root could not be)."""
    if idmap is None:
        return contextlib.nullcontext()
    return native.fs_ids(idmap.uid, idmap.gid)


def file_op(idmap: IdMap | None, fn, *args):
    """Run a host-side file operation of dsecd/fs/files.py as the sandbox's
    root, and report the ids it returns (stat, list) as the sandbox sees them."""
    with as_sandbox_root(idmap):
        out = fn(*args)
    if idmap is not None and isinstance(out, dict):
        for item in (out, *out.get("entries", ())):
            if "uid" in item:
                item["uid"] = idmap.to_sandbox(item["uid"])
                item["gid"] = idmap.to_sandbox(item["gid"], gid=True)
    return out
