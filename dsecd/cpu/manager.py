"""The CPU side of the host, as the engine sees it: QoS plans, admission,
the sampling loop, and the figures of `dsec info` / `dsec top`.

The engine owns the sandbox registry and passes in what this needs (limits
of live sandboxes, {id: qos}); nothing here holds a reference to a Sandbox.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import psutil

from .. import cgroup
from ..config import ConfigError, size_text, size_texts
from ..errors import BadRequest, Busy
from . import admission, qos, sampler

log = logging.getLogger(__name__)


def busy_message(why: dict) -> str:
    """The `busy` of a create that does not fit (admission.refusal's
    figures), in a person's units: what the sandboxes here ask for (their
    limits, not what they use), what this one asks, and the bound."""
    res, ratio = why["resource"], why["ratio"]
    if res == "memory":
        # The room left said too: rounded, the sum of what is asked can read
        # as the bound itself ("ask for 96.0G ... more than the 96.0G").
        left = max(0, why["capacity"] - why["requested"])
        said = (f"its sandboxes ask for {size_text(why['requested'])} and this one {size_text(why['asking'])}, more than "
                f"the {size_text(why['capacity'])} it admits ({ratio:g} x its {size_text(why['mem_total'])} of memory; "
                f"{size_text(left)} left)")
    elif res == "cpu":
        said = (f"its sandboxes ask for {why['requested']:g} CPUs and this one {why['asking']:g}, more than "
                f"the {why['capacity']:g} it admits ({ratio:g} x its {why['cpus']} CPUs)")
    else:       # ls_cpu: the latency-sensitive sandboxes' recent load
        said = (f"its latency-sensitive sandboxes used {why['ls_recent']:g} cores lately and this one asks "
                f"{why['asking']:g}, more than the {why['capacity']:g} it admits ({ratio:g} of its "
                f"{why['cpus']} CPUs)")
    return f"host at capacity for {res}: {said}; retry later or on another host"


class CpuHost:
    def __init__(self, cfg: dict, layout: cgroup.Layout, features, cgroup_root: str):
        self.cfg = cfg
        # Cores this daemon (and so its sandboxes) may run on.
        self.cpus = len(os.sched_getaffinity(0))
        core = features.items.get("sched_core")
        try:
            self.classes = qos.Classes(cfg, qos.has_cpu_idle(layout), bool(core and core.available),
                                       core.detail if core else "not probed")
        except qos.QosError as err:
            raise ConfigError(str(err)) from err
        for key in ("oversubscription", "memory_oversubscription", "ls_max_load", "sample_interval_s",
                    "recent_half_life_s"):
            if not isinstance(cfg[key], (int, float)) or cfg[key] < 0:
                raise ConfigError(f"cpu.{key} must be a number >= 0, got {cfg[key]!r}")
        self.capacity = admission.Capacity(self.cpus, psutil.virtual_memory().total, float(cfg["oversubscription"]),
                                           float(cfg["memory_oversubscription"]), float(cfg["ls_max_load"]))
        self.sampler = sampler.Sampler(layout, cgroup_root, float(cfg["recent_half_life_s"]))
        self.interval = float(cfg["sample_interval_s"])

    # ------------------------------------------------------------ QoS

    def plan(self, name: str | None) -> qos.Plan:
        try:
            return self.classes.plan(name)
        except qos.QosError as err:
            raise BadRequest(str(err), {"classes": list(qos.CLASSES)}) from err

    @staticmethod
    def bind(handle, plan: qos.Plan) -> None:
        """Execs in this sandbox get the plan's policy (see backend.spawn)."""
        handle.sched_idle = plan.sched_idle
        handle.core_sched = plan.core_sched == "on"

    # ------------------------------------------------------------ admission

    def check_possible(self, cpu: float, memory: int, qos_name: str | None) -> None:
        """Raise `bad_request` for a sandbox this host could never admit."""
        why = admission.never_fits(self.capacity, cpu, memory, ls=self.plan(qos_name).qos == qos.LS)
        if why:
            if why["resource"] == "cpu":
                asking, most = f"{why['asking']:g} CPUs", f"{why['max']:g}"
            else:
                asking, most = size_texts(why["asking"], why["max"])
                asking += " of memory"
            raise BadRequest(f"asks for {asking}, more than this host can ever give a sandbox ({most}); "
                             "ask for less, or place it on a larger host", why)

    def admit(self, used: admission.Requested, cpu: float, memory: int, ls: bool) -> None:
        """Raise `busy` with the figures if a sandbox of this size does not
        fit beside what the live sandboxes ask for (`used`); `ls`: also
        check the LS rule on the LS sandboxes' recent load."""
        ls_recent = self.sampler.latest.host.get("sandbox_recent_cores", {}).get(qos.LS, 0.0) \
            if ls and self.sampler.latest.host else 0.0
        why = admission.refusal(self.capacity, used, cpu, memory, ls=ls, ls_recent=ls_recent)
        if why:
            raise Busy(busy_message(why), why)

    # ------------------------------------------------------------ sampling

    async def run(self, entries, run_blocking) -> None:
        """Sample every `interval` seconds until cancelled. `entries()` gives
        {sandbox id: (qos, has quota)} of the sandboxes to sample now."""
        if self.interval <= 0:
            return
        while True:
            t0 = time.monotonic()
            try:
                await run_blocking(self.sampler.sample, entries())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cpu sampling pass failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - t0)))

    # ------------------------------------------------------------ reports

    def info(self, requested: admission.Requested, default_cpu: float, default_memory: int,
             max_sandboxes: int | None = None, queued: int = 0, drained: bool = False,
             idle: admission.Requested | None = None) -> dict:
        """`requested`: what the live sandboxes ask for (SandboxRegistry.requested);
        `max_sandboxes` (limits.max_sandboxes) and `queued` (creates waiting
        for a slot), which count against it; `drained`: the host admits none;
        `idle`: what the idle call sandboxes hold, which a create may take
        (admission.state)."""
        snap = self.sampler.latest
        host = snap.host
        used = host.get("sandbox_cores") if host else None
        return {"cpus": self.cpus, **self.classes.info(),
                "admission": admission.state(self.capacity, requested, default_cpu, default_memory,
                                             max_sandboxes, queued, drained, idle),
                "used": {"host_cpu_pct": host.get("cpu_pct") if host else None,
                         "sandbox_cores": used,
                         "sample_interval_s": self.interval, "last_pass_ms": snap.duration_ms},
                "placement": sampler.placement_hint(snap, self.cpus)}

    def top(self, sandboxes: list[dict]) -> dict:
        """`sandboxes`: [{id, state, qos, cpu (requested), memory_limit}]."""
        snap = self.sampler.latest
        rows = []
        for sb in sandboxes:
            s = snap.sandboxes.get(sb["id"], {})
            rows.append({**sb, "cpu_pct": s.get("cpu_pct"), "throttled_pct": s.get("throttled_pct"),
                         "throttled_ms": s.get("throttled_ms"), "memory": s.get("memory")})
        return {"sampled_at": snap.t or None, "interval_s": self.interval, "host": snap.host,
                "sandboxes": rows}
