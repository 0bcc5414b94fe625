"""User namespaces of container sandboxes: id ranges, and what maps through them.

With `[sandbox] userns = true` every container sandbox gets its own range of
`userns_size` host ids starting at `userns_base + slot * userns_size`: its
root (uid 0) is host uid `userns_base + slot * userns_size`, an unprivileged
uid owning nothing on the host. The slot is part of the sandbox's journal
record, so a restarted daemon keeps every live sandbox's range and never
hands it out twice; a slot is free again once its sandbox is destroyed (its
processes are dead and its files deleted by then, so no host object keeps a
reused id). Ranges are claimed host-wide too (`HostClaims`): another daemon
of the host, whatever its userns_base and userns_size, never hands out ids
a live daemon holds.

Files keep in-sandbox ids on disk (docs/hardening.md "User namespaces"): the
layers and the upper dir are idmapped mounts through the sandbox's user
namespace, so uid 0 in the image, in the upper dir and in pack_diff stays 0.
The daemon's own file access goes through the same overlay and so runs with
the sandbox root's host ids as fs ids (`as_sandbox_root`), and translates
the ids it reports back (`IdMap.to_sandbox`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from dataclasses import dataclass

from . import native
from .feature import Feature
from .hostclaims import HostClaims, pids_note

ID_MAX = 2**32 - 2          # (u32)-1 is "no id" to the kernel
OVERFLOW_ID = 65534         # what the kernel shows for an unmapped id (overflowuid)
# The one file every dsecd daemon of the host claims its sandboxes' host ids
# in (HostClaims: a record lock on bytes uid..uid+count-1).
HOST_CLAIMS = "/run/dsecd-userns.lock"

log = logging.getLogger(__name__)


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
    """Slots of `size` ids from `base`; the lowest free slot is handed out.

    A restarted daemon reserves the ranges of the sandboxes it re-adopts.
    One made under another userns_base or userns_size keeps its ids (its
    namespace cannot change), so it is held as a foreign range, and no
    slot overlapping it is handed out while it lives: ranges stay disjoint
    across a configuration change.

    With `claims`, every range held is claimed host-wide (HostClaims), and a
    slot another daemon has claimed ids of is passed over."""

    def __init__(self, base: int, size: int, max_slots: int = 0, claims: HostClaims | None = None):
        if not 0 < size <= 2**32 or base < 1 or base + size > ID_MAX:
            raise ValueError(f"sandbox.userns_base {base} + userns_size {size} is not a valid id range")
        fit = (ID_MAX + 1 - base) // size
        self.base, self.size = base, size
        self.slots = min(fit, max_slots) if max_slots > 0 else fit
        self.used: set[int] = set()
        self.foreign: list[IdMap] = []      # live ranges of another base or size
        self.claims = claims
        self._next = 0

    def _make(self, slot: int) -> IdMap:
        start = self.base + slot * self.size
        return IdMap(slot, start, start, self.size)

    def _overlaps_foreign(self, slot: int) -> bool:
        start = self.base + slot * self.size
        end = start + self.size
        return any(f.uid < end and start < f.uid + f.count or f.gid < end and start < f.gid + f.count
                   for f in self.foreign)

    def allocate(self) -> IdMap:
        elsewhere: Counter[int] = Counter()     # pid of another daemon -> slots it holds ids of
        if len(self.used) < self.slots:
            for i in range(self.slots):
                slot = (self._next + i) % self.slots
                if slot not in self.used and not (self.foreign and self._overlaps_foreign(slot)):
                    idmap = self._make(slot)
                    if self.claims is not None and (pid := self.claims.claim(idmap.uid, idmap.count)) is not None:
                        elsewhere[pid] += 1
                        continue
                    self.used.add(slot)
                    self._next = (slot + 1) % self.slots   # round robin: a freed range rests before reuse
                    return idmap
        held = sum(elsewhere.values())
        raise RangesExhausted(f"all {self.slots} user-namespace id ranges of {self.size} ids "
                              f"from {self.base} are in use (sandbox.userns_base/userns_size)"
                              + (f", {len(self.foreign)} of them overlapped by ranges made under an earlier "
                                 "configuration" if self.foreign else "")
                              + (f", {held} of them held by another daemon" + pids_note(elsewhere)
                                 + "; give each daemon of the host a userns_base of its own" if held else ""))

    def _claim(self, idmap: IdMap) -> None:
        """A journaled range claimed host-wide again. Another daemon holding
        some of its ids took them while this one was down: the sandbox
        lives on with them either way, so it is said, loudly."""
        if self.claims is None:
            return
        pid = self.claims.claim(idmap.uid, idmap.count)
        if pid is not None:
            log.error("host ids %d..%d of a re-adopted sandbox are also held by another daemon%s: their "
                      "sandboxes share host ids; destroy one of them", idmap.uid, idmap.uid + idmap.count - 1,
                      pids_note([pid]))

    def reserve(self, idmap: IdMap) -> bool:
        """Mark a journaled range used again (daemon restart). True if it is
        one of this configuration's slots; False if it was made under another
        base or size (held as a foreign range). ValueError for a range that
        is journaled twice."""
        if idmap in self.foreign or (self._make(idmap.slot) == idmap and idmap.slot in self.used):
            raise ValueError(f"id range {idmap.record()} is journaled twice")
        self._claim(idmap)
        if idmap.slot < self.slots and self._make(idmap.slot) == idmap:
            self.used.add(idmap.slot)
            return True
        self.foreign.append(idmap)
        return False

    def release(self, idmap: IdMap | None) -> None:
        if idmap is None:
            return
        if idmap in self.foreign:
            self.foreign.remove(idmap)
        elif self._make(idmap.slot) == idmap and idmap.slot in self.used:
            self.used.discard(idmap.slot)
        else:
            return
        if self.claims is not None:
            self.claims.give_up(idmap.uid, idmap.count)


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


def as_sandbox_ids(idmap: IdMap | None, uid: int, gid: int):
    """as_sandbox_root, but what the thread creates belongs to the sandbox's
    (uid, gid) (in the sandbox's range: the caller checks it). The
    capabilities stay, so access is still checked as the sandbox root's."""
    if idmap is None:
        return native.fs_ids(uid, gid) if (uid, gid) != (0, 0) else contextlib.nullcontext()
    return native.fs_ids(idmap.uid + uid, idmap.gid + gid)


def file_op(idmap: IdMap | None, fn, *args, owner: tuple[int, int] | None = None):
    """Run a host-side file operation of dsecd/fs/files.py as the sandbox's
    root, what it creates owned by `owner` (sandbox uid, gid; None: root),
    and report the ids it returns (stat, list) as the sandbox sees them."""
    with as_sandbox_root(idmap) if owner is None else as_sandbox_ids(idmap, *owner):
        out = fn(*args)
    if idmap is not None and isinstance(out, dict):
        for item in (out, *out.get("entries", ())):
            if "uid" in item:
                item["uid"] = idmap.to_sandbox(item["uid"])
                item["gid"] = idmap.to_sandbox(item["gid"], gid=True)
    return out
