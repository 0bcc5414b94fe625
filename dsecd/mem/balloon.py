"""Balloon hooks: how the memory policy asks a VM backend to give memory back.

A container's memory is reclaimed by the host kernel directly (pause.py); a
microVM's is not visible to it: the guest must return pages through its
virtio-balloon. A VM backend implements `Balloon` for each of its sandboxes,
and `BalloonPolicy` decides the targets: on pause, inflate to all but a floor;
on resume, deflate fully; under host pressure, take back a share of each
idle VM's free memory. The microVM backend does not exist yet (its issue);
the policy is tested with a fake balloon (tests/unit/test_mem_balloon.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Balloon(Protocol):
    """What a VM backend provides per sandbox (sizes in bytes)."""

    def guest_memory(self) -> int:
        """The VM's configured memory."""

    def inflated(self) -> int:
        """Bytes the balloon holds now (pages the guest gave back to the host)."""

    def set_target(self, target: int) -> int:
        """Ask the guest to hold `target` bytes in the balloon; return what it holds
        after the request settled (the guest may give less than asked)."""


@dataclass(frozen=True)
class BalloonPolicy:
    floor_bytes: int = 64 << 20          # what a paused VM keeps (kernel, page tables)
    pressure_share: float = 0.5          # share of free guest memory taken under pressure

    def __post_init__(self):
        if self.floor_bytes < 0 or not 0.0 <= self.pressure_share <= 1.0:
            raise ValueError("floor_bytes must be >= 0 and pressure_share in [0, 1]")

    def on_pause(self, b: Balloon) -> int:
        """Inflate to everything but the floor; return bytes given back."""
        before = b.inflated()
        return max(0, b.set_target(max(0, b.guest_memory() - self.floor_bytes)) - before)

    def on_resume(self, b: Balloon) -> int:
        """Deflate fully before the guest runs again; return bytes handed back to it."""
        before = b.inflated()
        return max(0, before - b.set_target(0))

    def on_pressure(self, b: Balloon, guest_free: int) -> int:
        """Take a share of the guest's free memory; return bytes given back."""
        before = b.inflated()
        want = min(b.guest_memory() - self.floor_bytes, before + int(guest_free * self.pressure_share))
        return max(0, b.set_target(max(before, want)) - before)
