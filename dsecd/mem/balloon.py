"""The idle-balloon policy: how big an idle microVM's guest should be.

A container's memory is reclaimed by the host kernel directly (pause.py); a
microVM's is not visible to it: guest RAM the guest once touched stays in
QEMU's RSS while the guest keeps it, as page cache or free pages (free-page
reporting gives back only free blocks of 2 MiB and more). Where the host's
DAMON is free, it could find the QEMU process's cold pages; on a host whose
DAMON belongs to someone else the policy has the balloon's own means:

  - a VM idle for `idle_s` (no exec, file op, copy or watch start) is made
    `used + headroom` big, never less than `floor` nor more than its RAM;
    `used` is its size (RAM less the balloon) less what its statistics say
    is available (MemAvailable): the kernel's own reserve outside MemTotal
    counts, and the balloon's pages do not, whether the guest counts them
    as used (deflate-on-oom) or out of MemTotal (without it);
  - an op deflates it to its whole RAM at once (engine/vmballoon.py, wake);
  - pressure deflates it too: the guest's available memory below
    `low_available`, or a guest that took pages back from the balloon on
    its own (deflate-on-oom: its size above the target and growing). After pressure the
    VM counts as busy for another `idle_s`, so that a working set that grew
    is not squeezed again at once.

This module decides; it does no I/O (the service asks QEMU and applies it).
Sizes in bytes, times in monotonic seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class BalloonSettings:
    idle_s: float = 30.0              # no op for this long: idle
    headroom: int = 64 * MiB          # kept above the guest's working set
    floor: int = 64 * MiB             # no idle guest is made smaller
    low_available: int = 24 * MiB     # less available in a ballooned guest: pressure, deflate
    interval_s: float = 2.0           # how often the policy runs (and the guest reports)

    def __post_init__(self):
        if self.idle_s <= 0 or self.interval_s <= 0:
            raise ValueError("balloon_idle_s and balloon_interval_s must be > 0")
        if min(self.headroom, self.floor, self.low_available) < 0:
            raise ValueError("balloon_headroom, balloon_floor and balloon_low_available must be >= 0")
        if self.low_available >= self.headroom:
            raise ValueError("balloon_low_available must be below balloon_headroom: a guest ballooned to its "
                             "working set plus the headroom would count as under pressure at once")

    @property
    def step(self) -> int:
        """The smallest change of target worth a request (the guest's working
        set moves by a few MiB between reports)."""
        return max(4 * MiB, self.headroom // 4)


@dataclass(frozen=True)
class Observation:
    """One VM as the service last saw it."""

    ram: int                          # its configured RAM
    actual: int                       # its guest's size now (query-balloon)
    last_actual: int                  # its size at the look before (as actual when there was none)
    target: int                       # the size last asked for (ram: not ballooned)
    available: int | None             # guest MemAvailable (None: no statistics yet)
    idle_for: float                   # seconds since its last op (or pressure)
    busy: bool                        # an exec or copy runs now


@dataclass(frozen=True)
class Decision:
    target: int                       # the size to ask for
    why: str                          # idle | grow | wake | pressure


def working_set(o: Observation) -> int | None:
    """What the guest uses of its size, or None without statistics."""
    if o.available is None:
        return None
    return max(0, o.actual - o.available)


def under_pressure(s: BalloonSettings, o: Observation) -> bool:
    """A ballooned guest that runs short: little available, or it deflated
    itself past the target (deflate-on-oom: above the target, and growing;
    above it and shrinking is an inflation under way)."""
    if o.target >= o.ram:
        return False
    if o.actual > o.target + s.step and o.actual > o.last_actual:
        return True
    return o.available is not None and o.available < s.low_available


def decide(s: BalloonSettings, o: Observation) -> Decision | None:
    """The target to ask for now, or None to leave the VM as it is."""
    if under_pressure(s, o):
        return Decision(o.ram, "pressure")
    if o.busy or o.idle_for < s.idle_s:
        return Decision(o.ram, "wake") if o.target < o.ram else None
    used = working_set(o)
    if used is None or abs(o.actual - o.target) > s.step:
        return None                   # no statistics, or the guest is still on its way to the target
    want = min(o.ram, max(s.floor, _round_up(used + s.headroom)))
    if want <= o.target - s.step:
        return Decision(want, "idle")
    if want >= o.target + s.step:
        return Decision(want, "grow")
    return None


def _round_up(n: int) -> int:
    return -(-n // MiB) * MiB
