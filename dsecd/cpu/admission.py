"""Admission by oversubscription: may one more sandbox start on this host?

~90% of sandboxes use <= 5% of the CPU they ask for, so requests are admitted
against a multiple of the real machine: cores x `cpu.oversubscription` of
requested CPU, MemTotal x `cpu.memory_oversubscription` of memory limits. A
create past either is refused at once with the figures, so a fleet layer can
place it on another host (as DSec's edge does). LS sandboxes are the
exception that is not oversubscribed: their measured recent use plus the new
request must fit `ls_max_load` of the cores, because protection only helps
against BE load, not against other LS tenants.

Pure arithmetic over numbers the caller passes in: unit-testable without a host.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capacity:
    cpus: int
    mem_total: int            # bytes
    cpu_ratio: float          # 0 = unchecked
    mem_ratio: float          # 0 = unchecked
    ls_max_load: float        # fraction of cores; 0 = unchecked

    @property
    def cpu(self) -> float | None:
        return self.cpus * self.cpu_ratio if self.cpu_ratio > 0 else None

    @property
    def memory(self) -> int | None:
        return int(self.mem_total * self.mem_ratio) if self.mem_ratio > 0 else None


@dataclass(frozen=True)
class Requested:
    """What the live sandboxes ask for (dead ones hold nothing); call
    sandboxes (FnCall's, one per image) count as sandboxes and are also
    counted apart in `call_sandboxes`."""

    cpu: float = 0.0
    memory: int = 0
    sandboxes: int = 0
    call_sandboxes: int = 0


def total(limits: list[dict]) -> Requested:
    """Sum of the `limits` dicts ({"cpu", "memory"}) of live sandboxes."""
    return Requested(cpu=sum(x["cpu"] for x in limits), memory=sum(x["memory"] for x in limits),
                     sandboxes=len(limits))


def refusal(cap: Capacity, req: Requested, cpu: float, memory: int, ls: bool = False,
            ls_recent: float = 0.0) -> dict | None:
    """None if a sandbox asking for (cpu, memory) fits, else the figures of the
    first dimension it does not fit in (for the `busy` error's detail)."""
    if cap.cpu is not None and req.cpu + cpu > cap.cpu + 1e-9:
        return {"resource": "cpu", "requested": round(req.cpu, 3), "asking": cpu,
                "capacity": round(cap.cpu, 3), "ratio": cap.cpu_ratio, "cpus": cap.cpus}
    if cap.memory is not None and req.memory + memory > cap.memory:
        return {"resource": "memory", "requested": req.memory, "asking": memory,
                "capacity": cap.memory, "ratio": cap.mem_ratio, "mem_total": cap.mem_total}
    if ls and cap.ls_max_load > 0 and ls_recent + cpu > cap.cpus * cap.ls_max_load + 1e-9:
        return {"resource": "ls_cpu", "ls_recent": round(ls_recent, 3), "asking": cpu,
                "capacity": round(cap.cpus * cap.ls_max_load, 3), "ratio": cap.ls_max_load,
                "cpus": cap.cpus}
    return None


def never_fits(cap: Capacity, cpu: float, memory: int, ls: bool = False) -> dict | None:
    """None if a sandbox asking for (cpu, memory) could run on this host, else
    the figures of the first dimension in which it could not even on an empty
    host: more CPU than the host has cores (or admits), more memory than it
    has (or admits), or an LS request past `ls_max_load` of the cores. Such a
    create is a bad request, not `busy`: no retry here can succeed."""
    cpu_max = cap.cpus if cap.cpu is None else min(cap.cpus, cap.cpu)
    if ls and cap.ls_max_load > 0:
        cpu_max = min(cpu_max, cap.cpus * cap.ls_max_load)
    if cpu > cpu_max + 1e-9:
        return {"resource": "cpu", "asking": cpu, "max": round(cpu_max, 3), "cpus": cap.cpus}
    mem_max = cap.mem_total if cap.memory is None else min(cap.mem_total, cap.memory)
    if memory > mem_max:
        return {"resource": "memory", "asking": memory, "max": mem_max, "mem_total": cap.mem_total}
    return None


def state(cap: Capacity, req: Requested, probe_cpu: float, probe_memory: int, max_sandboxes: int | None = None,
          queued: int = 0, drained: bool = False, idle: Requested | None = None) -> dict:
    """The admission figures for `dsec info`: "open" while a sandbox of the
    default size still fits, else "full" and why: "drain" while the host is
    drained (`dsec drain`: no create makes a sandbox or takes a pool's; a
    keyed create whose sandbox exists still gets it), "sandboxes" when the
    live sandboxes and the creates queued for a slot reach `max_sandboxes`
    (limits.max_sandboxes: a create that would make a sandbox is then
    refused as the host is full, whatever CPU and memory are left; one a
    warm pool's spare answers is still taken, as it adds no sandbox), else
    "cpu" or "memory". `live` counts the call sandboxes too
    (`call_sandboxes` of them). `idle`: what the idle call sandboxes (no
    call in flight) of `req` hold: a create the host has no room for drops
    them (engine/creates.py _room), so the state is the host's without
    them, and `idle_call_sandboxes` says what they hold."""
    idle = idle or Requested()
    free = Requested(req.cpu - idle.cpu, req.memory - idle.memory, req.sandboxes - idle.sandboxes)
    if drained:
        why = {"resource": "drain"}
    elif max_sandboxes is not None and free.sandboxes + queued >= max_sandboxes:
        why = {"resource": "sandboxes"}
    else:
        why = refusal(cap, free, probe_cpu, probe_memory)
    return {"state": "full" if why else "open", "full_on": why["resource"] if why else None,
            "sandboxes": {"live": req.sandboxes, "call_sandboxes": req.call_sandboxes, "queued": queued,
                          "max": max_sandboxes},
            "idle_call_sandboxes": {"sandboxes": idle.sandboxes, "cpu": round(idle.cpu, 3), "memory": idle.memory},
            "cpu": {"requested": round(req.cpu, 3), "capacity": cap.cpu, "ratio": cap.cpu_ratio,
                    "cpus": cap.cpus},
            "memory": {"requested": req.memory, "capacity": cap.memory, "ratio": cap.mem_ratio,
                       "mem_total": cap.mem_total},
            "ls_max_load": cap.ls_max_load}
