"""The user-namespace id ranges of sandboxes (dsecd/userns.py): one range
per sandbox, allocated at create, released at destroy, reserved again for
the sandboxes a restarted daemon re-adopts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .. import userns
from ..config import ConfigError
from ..errors import Busy
from .sandboxes import Sandbox

log = logging.getLogger(__name__)


class IdRanges:
    """`allocator` is None where sandbox.userns is off: sandboxes then run
    with host ids and every method here does nothing."""

    def __init__(self, allocator: userns.RangeAllocator | None):
        self.allocator = allocator

    @classmethod
    def from_config(cls, sb_defaults: dict, state: Path) -> IdRanges:
        """The allocator, after checking that the upper dirs' file system can be
        idmapped (a sandbox could not be created otherwise)."""
        if not sb_defaults["userns"]:
            log.warning("sandbox.userns is false: sandbox root is host root (with reduced capabilities)")
            return cls(None)
        idmap = userns.probe_idmap(str(state))
        if not idmap.available:
            raise ConfigError(f"sandbox.userns = true, but the state dir {state} cannot be idmapped: "
                              f"{idmap.detail}; "
                              "set sandbox.userns = false or move state_dir to ext4, xfs, btrfs or tmpfs")
        try:
            claims = userns.HostClaims(userns.HOST_CLAIMS)
        except OSError as err:
            raise ConfigError(f"sandbox.userns = true, but the host-wide claims file of sandbox ids "
                              f"{userns.HOST_CLAIMS} cannot be opened: {err.strerror}; every daemon of the host "
                              "claims its sandboxes' host ids there, so that no two hand out the same") from err
        try:
            return cls(userns.RangeAllocator(int(sb_defaults["userns_base"]), int(sb_defaults["userns_size"]),
                                             claims=claims))
        except ValueError as err:
            raise ConfigError(str(err)) from err

    @property
    def size(self) -> int | None:
        """Ids in each sandbox's range (None: host ids)."""
        return self.allocator.size if self.allocator else None

    def info(self) -> dict:
        r = self.allocator
        if r is None:
            return {"enabled": False}
        return {"enabled": True, "base": r.base, "size": r.size, "slots": r.slots, "used": len(r.used),
                "foreign": len(r.foreign)}

    def allocate(self, sb: Sandbox) -> None:
        idmap = self.take()
        sb.idmap = idmap.record() if idmap is not None else None

    def release(self, sb: Sandbox) -> None:
        self.give_back(userns.IdMap.from_record(sb.idmap))

    def take(self) -> userns.IdMap | None:
        """A free range (None: host ids), for a sandbox or a call sandbox."""
        if self.allocator is None:
            return None
        try:
            return self.allocator.allocate()
        except userns.RangesExhausted as err:
            raise Busy(f"{err}; retry once a sandbox is destroyed",
                       {"userns_slots": self.allocator.slots}) from err

    def give_back(self, idmap: userns.IdMap | None) -> None:
        if self.allocator is not None:
            self.allocator.release(idmap)

    def reserve(self, sb: Sandbox) -> None:
        idmap = userns.IdMap.from_record(sb.idmap)
        if idmap is None or self.allocator is None:
            return
        try:
            mine = self.allocator.reserve(idmap)
        except ValueError as err:
            log.error("sandbox %s: %s", sb.id, err)
            return
        if not mine:
            log.warning("sandbox %s keeps the id range %d..%d of an earlier sandbox.userns_base/userns_size; "
                        "no new sandbox gets ids that overlap it while it lives",
                        sb.id, idmap.uid, idmap.uid + idmap.count - 1)
