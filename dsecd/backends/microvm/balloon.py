"""A VM's virtio-balloon through QMP: its guest statistics, its target, its size.

The device is `virtio-balloon-pci,id=balloon0` (backend.qemu_argv). QEMU's
words, kept here: the balloon's *target* (QMP `balloon`, bytes) and its
*actual* (`query-balloon`) are sizes of the guest's memory, not of the
balloon: a guest of 256 MiB whose balloon holds 100 MiB has an actual of
156 MiB. `balloon` only sets the target and notifies the guest; the guest's
driver inflates or deflates on its own afterwards, so the command returns
at once whatever the distance.

Guest statistics come when the device polls for them: the QOM property
`guest-stats-polling-interval` (seconds, 0 = off) makes QEMU ask the guest
every so often; `guest-stats` is the last answer ({"stats": {name: value,
-1 when the guest did not say}, "last-update": unix time, 0 before the
first}). The polling is QEMU's, not the migration stream's: a QEMU started
for a resume or a restore polls only once it is set again.
"""

from __future__ import annotations

from dataclasses import dataclass

from .qmp import QMP

DEVICE_PATH = "/machine/peripheral/balloon0"


@dataclass(frozen=True)
class GuestStats:
    """What the guest last said about its memory (bytes; None: not said)."""

    total: int | None          # MemTotal
    available: int | None      # MemAvailable (Linux 4.16+)
    free: int | None           # MemFree
    caches: int | None         # page cache the guest could drop
    updated: float             # unix time of the guest's answer; 0: none yet

    @classmethod
    def from_qom(cls, value: dict) -> GuestStats:
        stats = value.get("stats") or {}

        def get(name: str) -> int | None:
            v = stats.get(name, -1)
            return None if v is None or v < 0 else int(v)

        return cls(total=get("stat-total-memory"), available=get("stat-available-memory"),
                   free=get("stat-free-memory"), caches=get("stat-disk-caches"),
                   updated=float(value.get("last-update") or 0))


async def poll_stats(qmp: QMP, interval_s: int) -> None:
    """Have QEMU ask the guest for its statistics every `interval_s` seconds (0: stop)."""
    await qmp.command("qom-set", {"path": DEVICE_PATH, "property": "guest-stats-polling-interval",
                                  "value": int(interval_s)})


async def guest_stats(qmp: QMP) -> GuestStats:
    return GuestStats.from_qom(await qmp.command("qom-get", {"path": DEVICE_PATH, "property": "guest-stats"}))


async def deflates_on_oom(qmp: QMP) -> bool:
    """Whether the device offers VIRTIO_BALLOON_F_DEFLATE_ON_OOM: the guest
    takes pages back from the balloon before its OOM killer would run, and
    (Linux) counts the balloon's pages as used rather than out of MemTotal."""
    return bool(await qmp.command("qom-get", {"path": DEVICE_PATH, "property": "deflate-on-oom"}))


async def set_target(qmp: QMP, size: int) -> None:
    """Ask the guest to be `size` bytes (the balloon holds the rest)."""
    await qmp.command("balloon", {"value": int(size)})


async def actual(qmp: QMP) -> int:
    """The guest's size now, as the balloon's driver last reported it."""
    return int((await qmp.command("query-balloon"))["actual"])
