"""CPU QoS classes: what "best-effort" and "latency-sensitive" mean on this host.

A BE sandbox only gets CPU that nobody else wants, enforced twice: its cgroup
is marked idle (`cpu.idle=1`: the group competes with its siblings as a
SCHED_IDLE entity, so a waking LS task preempts it at once), and every process
in it runs SCHED_IDLE (set by the C helpers before execve; children inherit
it and cannot leave it without CAP_SYS_NICE). The two cover different cases:
the group flag orders the sandbox against its sibling sandboxes, the task
policy orders its processes against everything on their CPU's runqueue.

An LS sandbox runs SCHED_OTHER with `ls_weight_factor` times the weight, and,
where the kernel has core scheduling, a cookie of its own so an SMT sibling
never runs another tenant's code beside it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .. import cgroup

log = logging.getLogger(__name__)

BE = "be"
LS = "ls"
CLASSES = (BE, LS)


class QosError(ValueError):
    pass


@dataclass(frozen=True)
class Plan:
    """What one sandbox's class means here, derived once per create."""

    qos: str
    weight_factor: float     # x the weight cgroup.Group.set_limits would write
    cpu_idle: bool           # write cpu.idle=1 on the sandbox's cpu group
    sched_idle: bool         # SCHED_IDLE for init and every exec
    core_sched: str          # "on", "off" (BE, or config), "unavailable" (kernel)

    def make_group(self, group: cgroup.Group, lim: cgroup.Limits) -> None:
        """The sandbox's groups with its limits and the cgroup half of the
        plan (the weight scaled, cpu.idle), written before the init joins
        (Group.make: one native call)."""
        group.make(lim, self.weight_factor, self.cpu_idle)


def has_cpu_idle(layout: cgroup.Layout) -> bool:
    """cpu.idle exists on v2 and on v1 since Linux 5.15; look, don't guess."""
    where = layout.controller_dir("cpu")
    if where is None:
        return False
    version, mnt = where
    # The v2 root has no cpu.* files: a child group shows what the kernel offers.
    if (mnt / "cpu.idle").exists():
        return True
    try:
        return any((Path(e.path) / "cpu.idle").exists() for e in os.scandir(mnt) if e.is_dir())
    except OSError:
        return False


def check_config(cfg: dict) -> None:
    """QosError for a [cpu] QoS setting out of its range."""
    if cfg["default_qos"] not in CLASSES:
        raise QosError(f"cpu.default_qos must be one of {CLASSES}, got {cfg['default_qos']!r}")
    if cfg["core_sched"] not in ("auto", "off"):
        raise QosError(f"cpu.core_sched must be 'auto' or 'off', got {cfg['core_sched']!r}")
    if not cfg["ls_weight_factor"] >= 1:
        raise QosError(f"cpu.ls_weight_factor must be >= 1, got {cfg['ls_weight_factor']}")


class Classes:
    """Turns a requested class into a Plan, given config and kernel features."""

    def __init__(self, cfg: dict, cpu_idle: bool, core_available: bool, core_detail: str):
        check_config(cfg)
        self.default = cfg["default_qos"]
        self.ls_factor = float(cfg["ls_weight_factor"])
        self.cpu_idle = cpu_idle
        self.core_wanted = cfg["core_sched"] == "auto"
        self.core_available = core_available
        self.core_detail = core_detail
        if not cpu_idle:
            log.warning("cpu.idle is missing on this kernel: BE sandboxes rely on SCHED_IDLE alone")
        if self.core_wanted and not core_available:
            # Logged once here; each LS sandbox says core_sched: unavailable.
            log.warning("core scheduling unavailable (%s): LS sandboxes run without a cookie", core_detail)

    def plan(self, qos: str | None) -> Plan:
        qos = self.default if qos is None else qos
        if qos not in CLASSES:
            raise QosError(f"qos must be one of {', '.join(CLASSES)}, got {qos!r}")
        if qos == BE:
            return Plan(BE, 1.0, self.cpu_idle, True, "off")
        core = "off" if not self.core_wanted else ("on" if self.core_available else "unavailable")
        return Plan(LS, self.ls_factor, False, False, core)

    def info(self) -> dict:
        return {"default_qos": self.default, "classes": list(CLASSES), "ls_weight_factor": self.ls_factor,
                "cpu_idle": self.cpu_idle,
                "core_sched": ("off" if not self.core_wanted else
                               "available" if self.core_available else f"unavailable: {self.core_detail}")}
