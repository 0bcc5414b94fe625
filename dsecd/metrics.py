"""Prometheus metrics: the daemon's instruments, a collector that reads the
figures the services already keep, and the endpoint that serves them.

Two kinds of series, both in one private registry (REGISTRY):

* Instruments, updated where the thing happens: the module-level Counters
  and Histograms below (creates, destroys by reason, exec and call
  latencies, pauses, resumes, OOM kills, admission waits, journal syncs,
  image builds, requests by op and result, event-loop lag). Lifecycle ones
  are fed by dsecd/engine/lifelog.py from the events the services publish;
  the rest by the code that times them.
* Figures the services keep anyway (`dsec info --json`, `dsec top --json`
  show the same numbers): read at scrape time by NodeCollector from a
  snapshot (Snapshot.take) - sandboxes by state and QoS, committed CPU and
  memory against capacity, the create queue, FnCall counters, zram, the
  pager's fetches, their latency and its cache, network denials and DNS
  answers, task-policy denials. Nothing is counted twice.

Per-sandbox series (CPU, memory, throttling by sandbox id) only with
`metrics.per_sandbox`: a host runs thousands of short-lived sandboxes, and
every id is a new series for the time-series database.

The endpoint (`metrics.listen`: "host:port" or a unix socket path; off when
empty) is an asyncio handler on the daemon's loop: a scrape reads the
blocking sources (sysfs, BPF maps, the pager's stats file) in worker
threads, each within SOURCE_TIMEOUT_S, then renders. Without per-sandbox series the render (~300 lines)
takes ~1.3 ms and runs on the loop; with them it grows with the sandboxes
(16 ms for 500) and runs in a worker, where the loop gets the interpreter
back at every switch interval (5 ms) instead of waiting for the whole
render. bench/core.py --scrape-interval measures the loop's lag with and
without a scraper; figures in docs/operations.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from . import __version__, unixsock
from .protocol import ANY_STATE

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)        # the daemon's CPU seconds, RSS, open fds
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

# Latency buckets, seconds: a create or exec is milliseconds (an exec or a
# zygote call 1-2 ms); an exec may run for an hour.
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_LONG = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
_DISK = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_LAG = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)

# ---------------------------------------------------------------- instruments

CREATES = Counter("dsecd_sandboxes_created", "Sandboxes created (warm-pool refills included)", ["qos"],
                  registry=REGISTRY)
CREATE_SECONDS = Histogram("dsecd_create_duration_seconds", "Wall time of a create, from its admission "
                           "to a running sandbox (queue wait excluded)", buckets=_FAST, registry=REGISTRY)
DESTROYS = Counter("dsecd_sandboxes_destroyed", "Sandboxes destroyed, by reason: request, job, all, "
                   "ttl, lease, idle_ttl, pool", ["reason"], registry=REGISTRY)
DIED = Counter("dsecd_sandboxes_died", "Sandboxes whose init exited on its own", registry=REGISTRY)
EXPIRED = Counter("dsecd_sandboxes_expired", "Sandboxes the reaper destroyed, by reason", ["reason"],
                  registry=REGISTRY)
ADOPTED = Counter("dsecd_sandboxes_adopted", "Sandboxes re-adopted from the journal at start",
                  registry=REGISTRY)
OOM_KILLS = Counter("dsecd_oom_kills", "Processes killed by a sandbox's memory limit", registry=REGISTRY)
EXEC_SECONDS = Histogram("dsecd_exec_duration_seconds", "Wall time of an exec request, by who started "
                         "the process: init (the sandbox's PID 1), helper (the daemon's spawn helper) or "
                         "microvm (the guest's agent)",
                         ["backend"], buckets=_LONG, registry=REGISTRY)
CALL_SECONDS = Histogram("dsecd_call_duration_seconds", "Wall time of a FnCall, by path: zygote or plain",
                         ["path"], buckets=_LONG, registry=REGISTRY)
PAUSES = Counter("dsecd_pauses", "Sandboxes paused (job pauses included)", registry=REGISTRY)
RECLAIMED = Counter("dsecd_pause_reclaimed_bytes", "Memory given back by pauses", registry=REGISTRY)
RESUMES = Counter("dsecd_resumes", "Sandboxes resumed (on demand and job resumes included)",
                  registry=REGISTRY)
PREFETCHED = Counter("dsecd_resume_prefetched_bytes", "Working-set bytes brought back before a thaw",
                     registry=REGISTRY)
RESUME_SECONDS = Histogram("dsecd_resume_duration_seconds", "Wall time of a resume (thaw and the "
                           "prefetch done before it)", buckets=_FAST, registry=REGISTRY)
ADMISSION_WAIT = Histogram("dsecd_admission_wait_seconds", "Time creates waited for a slot of the "
                           "create queue", buckets=_FAST, registry=REGISTRY)
REQUESTS = Counter("dsecd_requests", "Requests answered, by op and result (ok or the error code; "
                   "busy answers are result=\"busy\")", ["op", "result"], registry=REGISTRY)
JOURNAL_APPENDS = Counter("dsecd_journal_appends", "Writes to a record log (one or more records "
                          "each)", ["log"], registry=REGISTRY)
JOURNAL_FSYNC = Histogram("dsecd_journal_fsync_seconds", "fdatasync of a record log append "
                          "(journal.fsync, net.fsync)", ["log"], buckets=_DISK, registry=REGISTRY)
IMAGE_BUILDS = Counter("dsecd_image_builds", "Images made, by kind (build: from a directory or an "
                       "import; dockerfile; pull; snapshot) and result (ok, failed)", ["kind", "result"],
                       registry=REGISTRY)
IMAGE_BUILD_SECONDS = Histogram("dsecd_image_build_duration_seconds", "Wall time of a successful "
                                "image build, pull or snapshot", ["kind"], buckets=_LONG, registry=REGISTRY)
IMAGE_BUILD_BYTES = Counter("dsecd_image_build_bytes", "Bytes of the images built (their layers' size)",
                            ["kind"], registry=REGISTRY)
LOOP_LAG = Histogram("dsecd_event_loop_lag_seconds", "How late the event loop ran a timer "
                     "(dsecd/looplag.py): time the loop spent on other work", buckets=_LAG,
                     registry=REGISTRY)
SCRAPES = Counter("dsecd_scrapes", "Scrapes of this endpoint", registry=REGISTRY)
SCRAPE_SECONDS = Gauge("dsecd_scrape_duration_seconds", "Wall time of the previous scrape, gathering "
                       "and rendering", registry=REGISTRY)

# The values the labels of these counters take: each series is served from
# the daemon's start, at 0. One that first shows up at 1 has no earlier
# sample, so increase() and rate() miss that first event (an alert on the
# first expiry or failed build after a start would not fire) and a
# dashboard shows "no data" instead of 0.
QOS_CLASSES = ("be", "ls")
DESTROY_REASONS = ("request", "job", "all", "ttl", "lease", "idle_ttl", "pool")
EXPIRY_REASONS = ("ttl", "lease", "idle_ttl")
IMAGE_BUILD_KINDS = ("build", "dockerfile", "pull", "snapshot")
for _qos in QOS_CLASSES:
    CREATES.labels(_qos)
for _reason in DESTROY_REASONS:
    DESTROYS.labels(_reason)
for _reason in EXPIRY_REASONS:
    EXPIRED.labels(_reason)
for _kind in IMAGE_BUILD_KINDS:
    for _result in ("ok", "failed"):
        IMAGE_BUILDS.labels(_kind, _result)


# ---------------------------------------------------------------- the figures services keep

# DenialService.state, its first word ("off: why" -> off).
DENIAL_MONITOR_STATES = ("on", "loading", "off", "not_loaded_yet")


@dataclass
class Snapshot:
    """What a scrape reads from the node: plain data, taken at once."""

    taken: float = 0.0
    states: dict = field(default_factory=dict)        # (state, qos) -> count
    cpu: dict = field(default_factory=dict)           # CpuHost.info()
    admission: dict = field(default_factory=dict)     # CreateService.info()
    fncall: dict = field(default_factory=dict)        # CallService.info()
    memory: dict = field(default_factory=dict)        # MemoryService.info() (blocking)
    images: dict = field(default_factory=dict)        # ImageService.info() (blocking)
    net: dict = field(default_factory=dict)           # NetworkService.drop_totals() (blocking)
    denials: dict = field(default_factory=dict)       # DenialService.info() (one BPF map read)
    balloon: dict = field(default_factory=dict)       # BalloonService.info() (microVMs' idle balloon)
    connections: int = 0
    sandboxes: list = field(default_factory=list)     # top rows, with metrics.per_sandbox only
    errors: list = field(default_factory=list)        # sources that could not be read

    @classmethod
    async def take(cls, node, connections: int, per_sandbox: bool) -> Snapshot:
        snap = cls(taken=time.time(), connections=connections)
        for sb in node.registry.by_id.values():
            key = (sb.state, sb.qos or "")
            snap.states[key] = snap.states.get(key, 0) + 1
        snap.cpu = node.cpu_info()
        snap.admission = node.create_service.info()
        snap.fncall = node.call_service.info()
        snap.balloon = node.vm_balloon.info()
        if per_sandbox:
            snap.sandboxes = node.cpu.top([
                {"id": s.id, "state": s.state, "qos": s.qos, "cpu": s.limits["cpu"],
                 "memory_limit": s.limits["memory"], "vm_guest_size": (node.vm_balloon.view(s.id) or {}).get(
                     "guest_size")} for s in node.registry.by_id.values()])["sandboxes"]
        # At once, each with a deadline: one source down or stuck must not
        # cost the scrape the rest.
        snap.memory, snap.images, snap.net = await asyncio.gather(
            read_source("memory", lambda: node.workers.run(node.memory.info), snap.errors),
            read_source("images", lambda: node.workers.run(node.image_service.info), snap.errors),
            read_source("net", node.net_service.drop_totals, snap.errors))
        try:
            snap.denials = node.denials.info()
        except Exception as err:
            snap.errors.append(f"policy denials: {err}")
        return snap


# How long a scrape waits for each blocking source (Prometheus gives a scrape
# 10 s by default). A source's read still under way from an earlier scrape (a
# worker stuck on a hung store or file) is waited for again, not asked anew,
# so that scrapes do not pile reads up behind it in the workers' queue.
SOURCE_TIMEOUT_S = 5.0
_READS: dict[str, asyncio.Future] = {}


async def read_source(name: str, start, errors: list[str]) -> dict:
    """The figures of source `name` (start() reads them), or {} with why in `errors`."""
    fut = _READS.get(name)
    if fut is None or fut.done() or fut.get_loop() is not asyncio.get_running_loop():
        fut = _READS[name] = asyncio.ensure_future(start())
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())     # read by a later scrape, or nobody
    try:
        return await asyncio.wait_for(asyncio.shield(fut), SOURCE_TIMEOUT_S)
    except TimeoutError:
        errors.append(f"{name}: no answer in {SOURCE_TIMEOUT_S:g} s (every worker thread busy, or a read hangs); "
                      "its series are left out until it answers")
    except Exception as err:
        errors.append(f"{name}: {err}")
    return {}


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


class NodeCollector:
    """Series from a Snapshot (set by the endpoint right before it renders)."""

    def __init__(self):
        self.snapshot = Snapshot()

    def describe(self):
        return []           # no fixed set: what the snapshot holds decides

    def collect(self):
        s = self.snapshot
        info = _gauge("dsecd_build_info", "The daemon's version", ["version"])
        info.add_metric([__version__], 1)
        yield info
        live = _gauge("dsecd_sandboxes", "Sandboxes by state and QoS class", ["state", "qos"])
        # Every state of both classes, 0 when none is in it: a series that
        # vanished would be "no data" to Prometheus, not 0.
        counts = {(state, qos): 0 for state in ANY_STATE for qos in ("be", "ls")} | s.states
        for (state, qos), n in sorted(counts.items()):
            live.add_metric([state, qos], n)
        yield live
        conns = _gauge("dsecd_connections", "Client connections open")
        conns.add_metric([], s.connections)
        yield conns
        yield from self._cpu(s.cpu)
        yield from self._admission(s.admission)
        yield from self._fncall(s.fncall)
        yield from self._memory(s.memory)
        yield from self._pager(s.images.get("pager") or {})
        yield from self._net(s.net)
        yield from self._denials(s.denials)
        yield from self._balloon(s.balloon)
        if s.sandboxes:
            yield from self._per_sandbox(s.sandboxes)
        errors = _gauge("dsecd_scrape_source_errors", "Sources this scrape could not read "
                        "(the daemon log says why)")
        errors.add_metric([], len(s.errors))
        yield errors

    @staticmethod
    def _cpu(cpu: dict):
        if not cpu:
            return
        adm = cpu["admission"]
        for kind, unit, scale in (("cpu", "cores", 1), ("memory", "bytes", 1)):
            a = adm[kind]
            req = _gauge(f"dsecd_committed_{kind}_{unit}", f"{kind.upper() if kind == 'cpu' else 'Memory'} "
                         "requested by live sandboxes (what admission counts)")
            req.add_metric([], a["requested"] * scale)
            yield req
            if a.get("capacity") is not None:
                cap = _gauge(f"dsecd_capacity_{kind}_{unit}", f"Admission capacity of {kind}: the host's "
                             f"{'cores' if kind == 'cpu' else 'MemTotal'} x the oversubscription ratio")
                cap.add_metric([], a["capacity"] * scale)
                yield cap
        full = _gauge("dsecd_admission_open", "1 while a sandbox of the [sandbox] default size fits the "
                      "admission capacity, the host holds fewer than limits.max_sandboxes and is not drained, 0 "
                      "when not (smaller ones may still be admitted when only CPU or memory is short)")
        full.add_metric([], 1 if adm.get("state") == "open" else 0)
        yield full
        used = cpu.get("used") or {}
        cores = _gauge("dsecd_sandbox_cpu_used_cores", "CPU the sandboxes used at the last sample, by QoS",
                       ["qos"])
        for qos, v in sorted((used.get("sandbox_cores") or {}).items()):
            cores.add_metric([qos], v)
        yield cores
        if used.get("host_cpu_pct") is not None:
            host = _gauge("dsecd_host_cpu_percent", "Host CPU use at the last sample")
            host.add_metric([], used["host_cpu_pct"])
            yield host

    @staticmethod
    def _admission(q: dict):
        if not q:
            return
        g = _gauge("dsecd_create_queue", "The create queue: creates running and waiting", ["what"])
        for what in ("active", "queued", "max_active", "max_queued"):
            g.add_metric([what], q[what])
        yield g
        if "drain" in q:
            d = _gauge("dsecd_drained", "1 while the host is drained (dsec drain): it refuses creates and "
                       "refills no pool; 0 otherwise")
            d.add_metric([], 1 if q["drain"]["drained"] else 0)
            yield d
        c = _counter("dsecd_admission_admitted", "Creates that got a slot of the create queue")
        c.add_metric([], q["admitted"])
        yield c
        c = _counter("dsecd_admission_rejected", "Creates refused with busy by the queue or a full host "
                     "(max_sandboxes); CPU and memory admission refusals are in dsecd_requests_total")
        c.add_metric([], q["rejected_busy"])
        yield c
        pools = _gauge("dsecd_pool_sandboxes", "Warm pools: ready and creating sandboxes", ["pool", "what"])
        taken = _counter("dsecd_pool_taken", "Sandboxes handed out by warm pools", ["pool"])
        for name, p in sorted(q.get("pools", {}).items()):
            pools.add_metric([name, "ready"], p["ready"])
            pools.add_metric([name, "creating"], p["creating"])
            taken.add_metric([name], p["taken"])
        yield pools
        yield taken

    @staticmethod
    def _fncall(f: dict):
        if not f:
            return
        calls = _counter("dsecd_calls", "FnCalls answered, by path", ["path"])
        calls.add_metric(["zygote"], f.get("zygote_calls", 0))
        calls.add_metric(["plain"], f.get("plain_calls", 0))
        yield calls
        for name, key, doc in (("dsecd_call_busy", "busy", "FnCalls refused busy: fncall.max_inflight or "
                                "fncall.max_boxes reached, or no call sandbox admitted on a full host"),
                               ("dsecd_zygotes_started", "zygotes_started", "Zygotes started"),
                               ("dsecd_zygotes_replaced", "zygotes_replaced", "Zygotes replaced"),
                               ("dsecd_call_sandboxes_dropped_for_creates", "dropped_for_creates",
                                "Idle call sandboxes dropped to make room for a create on a full host"),
                               ("dsecd_call_sandboxes_dropped_for_calls", "dropped_for_calls",
                                "Idle call sandboxes dropped to make room for another image's on a full host")):
            c = _counter(name, doc)
            c.add_metric([], f.get(key, 0))
            yield c
        g = _gauge("dsecd_calls_inflight", "FnCalls running")
        g.add_metric([], f.get("inflight", 0))
        yield g

    @staticmethod
    def _memory(m: dict):
        z = m.get("zram") or {}
        on = _gauge("dsecd_swap_on", "1 when dsecd's own swap backend is on", ["backend"])
        for name in ("zram", "swapfile"):
            if name in m:
                on.add_metric([name], 1 if m[name].get("on") else 0)
        yield on
        stats = z.get("stats") or {}
        if stats or "size" in z:
            g = _gauge("dsecd_zram_bytes", "dsecd's zram device: size and used (of the swap area), orig "
                       "(data stored), compr (compressed), mem_used (RAM it takes), mem_limit", ["what"])
            for key in ("size", "used"):
                if key in z:
                    g.add_metric([key], z[key])
            for key in ("orig_data_size", "compr_data_size", "mem_used_total", "mem_limit"):
                if key in stats:
                    g.add_metric([key.removesuffix("_data_size").removesuffix("_total")], stats[key])
            yield g
        f = m.get("swapfile") or {}
        if "size" in f:
            g = _gauge("dsecd_swapfile_bytes", "dsecd's swap file: size and used", ["what"])
            g.add_metric(["size"], f["size"])
            g.add_metric(["used"], f.get("used", 0))
            yield g

    @staticmethod
    def _pager(p: dict):
        if "blobs" not in p:           # no pager (images.mode is not lazy), or its stats unreadable
            return
        sums = dict.fromkeys(("fetches", "fetched_bytes", "chunk_hits", "chunk_misses", "kernel_read_bytes",
                              "evictions", "errors", "uncached", "corrupt"), 0)
        for b in p["blobs"].values():
            for key in sums:
                sums[key] += int(b.get(key, 0))
        for key, doc in (("fetches", "Chunk fetches from the store"),
                         ("fetched_bytes", "Bytes fetched from the store (misses and read-ahead)"),
                         ("kernel_read_bytes", "Bytes the kernel read through the pager"),
                         ("evictions", "Chunks evicted from the local cache"),
                         ("errors", "Failed fetches"), ("corrupt", "Fetched chunks that failed their check"),
                         ("uncached", "Fetched chunks the local cache could not keep (its disk full)")):
            c = _counter(f"dsecd_pager_{key}", f"{doc} (since the pager started)")
            c.add_metric([], sums[key])
            yield c
        c = _counter("dsecd_pager_chunk_lookups", "Chunks that reads needed, by whether the local cache had "
                     "them (hit) or not (miss: fetched, or waited for a fetch under way)", ["result"])
        c.add_metric(["hit"], sums["chunk_hits"])
        c.add_metric(["miss"], sums["chunk_misses"])
        yield c
        lat = p.get("fetch_latency")    # None from a pager older than the histogram
        if lat:
            h = HistogramMetricFamily("dsecd_pager_fetch_seconds", "Wall time of a chunk fetch (read-ahead's "
                                      "included): cache room, store read, check, throttle, cache write "
                                      "(since the pager started)")
            cumulative, buckets = 0, []
            for bound, n in zip([*lat["bounds_ns"], None], lat["counts"], strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound is None else floatToGoString(bound / 1e9), cumulative))
            h.add_metric([], buckets, lat["sum_ns"] / 1e9)
            yield h
        g = _gauge("dsecd_pager_cache_bytes", "The pager's chunk cache: used and cap (0 = none)", ["what"])
        g.add_metric(["used"], p.get("cache_used", 0))
        g.add_metric(["max"], p.get("cache_max", 0))
        yield g

    @staticmethod
    def _net(n: dict):
        if not n:
            return
        denied = _counter("dsecd_net_denied", "Egress the default-deny refused, by reason: connect "
                          "(connect(2) to a destination no rule allows), sendmsg (a UDP send), packet "
                          "(dropped by the egress program: raw sockets and the like)", ["reason"])
        for reason, key in (("connect", "denied_connect"), ("sendmsg", "denied_sendmsg"),
                            ("packet", "dropped_packets")):
            denied.add_metric([reason], n.get(key, 0))
        yield denied
        dns = n.get("dns") or {}
        if dns:
            c = _counter("dsecd_dns", "The sandboxes' resolver, by outcome (queries, answered, refused: "
                         "no rule allows the name, hostile_dropped, upstream_failed, ...)", ["outcome"])
            for key, v in sorted(dns.items()):
                c.add_metric([key], v)
            yield c

    @staticmethod
    def _denials(d: dict):
        if not d:
            return
        state = d["monitor"].split(":", 1)[0].replace(" ", "_")
        g = _gauge("dsecd_policy_denial_monitor", "The task-policy denial monitor: 1 for its state (on; "
                   "loading; off: turned off or could not load, the daemon log says why; not_loaded_yet)",
                   ["state"])
        for name in DENIAL_MONITOR_STATES:
            g.add_metric([name], 1 if name == state else 0)
        yield g
        g = _gauge("dsecd_policy_watched_sandboxes", "Sandboxes whose execs' denials are counted (from "
                   "their first exec under a restricting policy to their end)")
        g.add_metric([], d.get("watched_sandboxes", 0))
        yield g
        c = _counter("dsecd_policy_denials", "EACCES and EPERM of the calls Landlock mediates, in execs "
                     "under a task policy, by policy and kind of call (file, socket, signal)",
                     ["policy", "kind"])
        for policy, kinds in sorted(d.get("by_policy_kind", {}).items()):
            for kind, n in sorted(kinds.items()):
                c.add_metric([policy, kind], n)
        yield c
        c = _counter("dsecd_policy_denials_unattributed", "Denials in watched sandboxes from a process "
                     "that left its exec's session (setsid): no policy to charge, by kind", ["kind"])
        for kind, n in sorted(d.get("unattributed_by_kind", {}).items()):
            c.add_metric([kind], n)
        yield c
        c = _counter("dsecd_policy_denials_lost", "Denial records lost: the ring buffer was full "
                     "(a burst faster than the daemon reads)")
        c.add_metric([], d.get("lost", 0))
        yield c

    @staticmethod
    def _balloon(b: dict):
        if not b.get("enabled"):
            return
        vms = _gauge("dsecd_vm_balloon_vms", "Running microVMs the idle balloon looks at, by what it does "
                     "with them: ballooned (smaller than their RAM), full, skipped (a template's restore)",
                     ["state"])
        vms.add_metric(["ballooned"], b["ballooned"])
        vms.add_metric(["skipped"], b["skipped"])
        vms.add_metric(["full"], b["vms"] - b["ballooned"] - b["skipped"])
        held = _gauge("dsecd_vm_balloon_held_bytes", "Guest RAM the microVMs' balloons hold (given back "
                      "to the host by QEMU)")
        held.add_metric([], b["held_bytes"])
        changes = _counter("dsecd_vm_balloon_changes", "Balloon targets set: inflate (an idle guest made "
                           "smaller), wake (an op gave it its RAM back), pressure (it ran short)", ["kind"])
        changes.add_metric(["inflate"], b["inflates"])
        changes.add_metric(["wake"], b["deflates_wake"])
        changes.add_metric(["pressure"], b["deflates_pressure"])
        yield from (vms, held, changes)

    @staticmethod
    def _per_sandbox(rows: list[dict]):
        cpu = _gauge("dsecd_sandbox_cpu_percent", "A sandbox's CPU use at the last sample (100 = one core)",
                     ["sandbox", "qos"])
        thr = _gauge("dsecd_sandbox_throttled_percent", "Share of the last sample a sandbox was throttled",
                     ["sandbox"])
        mem = _gauge("dsecd_sandbox_memory_bytes", "A sandbox's memory use", ["sandbox"])
        lim = _gauge("dsecd_sandbox_memory_limit_bytes", "A sandbox's memory limit", ["sandbox"])
        guest = _gauge("dsecd_sandbox_vm_guest_bytes", "A microVM's guest size (its RAM less what its "
                       "balloon holds)", ["sandbox"])
        for r in rows:
            if r.get("vm_guest_size") is not None:
                guest.add_metric([r["id"]], r["vm_guest_size"])
            if r.get("cpu_pct") is not None:
                cpu.add_metric([r["id"], r["qos"] or ""], r["cpu_pct"])
            if r.get("throttled_pct") is not None:
                thr.add_metric([r["id"]], r["throttled_pct"])
            if r.get("memory") is not None:
                mem.add_metric([r["id"]], r["memory"])
            lim.add_metric([r["id"]], r["memory_limit"])
        yield from (cpu, thr, mem, lim, guest)


COLLECTOR = NodeCollector()
REGISTRY.register(COLLECTOR)


def render(accept: str = "") -> tuple[bytes, str]:
    """The registry in the format the scraper asked for: (body, content type)."""
    encoder, content_type = choose_encoder(accept)
    return encoder(REGISTRY), content_type


# ---------------------------------------------------------------- the endpoint

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
# How long an answer may take to reach its scraper (Prometheus gives a scrape
# 10 s by default). One that reads nothing (stopped, hung, its peer gone
# silent) is dropped past it, with the body it would hold for ever.
WRITE_TIMEOUT_S = 30.0


def parse_listen(value: str) -> tuple[str, int] | str:
    """metrics.listen: (host, port) for "host:port" or "[v6]:port", or the
    absolute path of a unix socket."""
    if value.startswith("/"):
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ValueError(f"metrics.listen must be HOST:PORT (e.g. 127.0.0.1:9464) or an absolute unix "
                         f"socket path, got {value!r}")
    return host.strip("[]"), int(port)


class MetricsServer:
    """GET /metrics over HTTP/1.x on TCP or a unix socket; one request per
    connection. `node` gives the snapshot's sources; `connections` counts the
    protocol's clients (the server's set)."""

    def __init__(self, node, listen: str, per_sandbox: bool, connections):
        self.node = node
        self.where = parse_listen(listen)
        self.per_sandbox = per_sandbox
        self.connections = connections
        self._server: asyncio.AbstractServer | None = None
        self._scrape_lock = asyncio.Lock()

    async def start(self) -> None:
        if isinstance(self.where, str):
            try:
                unixsock.remove_dead_socket(self.where)
            except ValueError as err:
                raise ValueError(f"{err} (daemon.socket, or another daemon's endpoint)") from None
            # As the protocol's socket's: /run/dsecd may not be there yet.
            os.makedirs(os.path.dirname(self.where), mode=0o755, exist_ok=True)
            self._server = await unixsock.serve_private(                # 0660, like the protocol's socket
                self.where, os.getegid(),
                lambda sock: asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_REQUEST_BYTES))
        else:
            host, port = self.where
            self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True,
                                                      limit=MAX_REQUEST_BYTES)
        log.info("metrics on %s", self.describe())

    def describe(self) -> str:
        if isinstance(self.where, str):
            return self.where
        host, port = self.where
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"      # an IPv6 address in brackets

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if isinstance(self.where, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.where)

    async def scrape(self, accept: str = "") -> tuple[bytes, str]:
        # One scrape at a time: two scrapers (or one retrying) share the work
        # instead of doubling it.
        async with self._scrape_lock:
            t0 = time.perf_counter()
            COLLECTOR.snapshot = await Snapshot.take(self.node, len(self.connections()), self.per_sandbox)
            for err in COLLECTOR.snapshot.errors:
                log.warning("metrics: could not read %s", err)
            SCRAPES.inc()
            if self.per_sandbox:
                body, ctype = await self.node.workers.run(render, accept)
            else:
                body, ctype = render(accept)
            SCRAPE_SECONDS.set(time.perf_counter() - t0)
            return body, ctype

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, *_ = lines[0].split(" ") + ["", ""]
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                await _answer(writer, 405, b"only GET\n", "text/plain", extra="Allow: GET, HEAD\r\n")
            elif path not in ("/metrics", "/"):
                await _answer(writer, 404, b"the metrics are at /metrics\n", "text/plain")
            else:
                body, ctype = await self.scrape(headers.get("accept", ""))
                try:
                    async with asyncio.timeout(WRITE_TIMEOUT_S):
                        await _answer(writer, 200, body, ctype, head_only=method == "HEAD")
                except TimeoutError:
                    # close() would wait to flush what the scraper does not read.
                    writer.transport.abort()
                    raise
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass                                # a broken or slow client: dropped
        except Exception:
            log.exception("metrics request failed")
            with contextlib.suppress(Exception):
                await _answer(writer, 500, b"internal error; see the daemon log\n", "text/plain")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _answer(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str, extra: str = "",
                  head_only: bool = False) -> None:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}[status]
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                 f"Connection: close\r\n{extra}\r\n".encode() + (b"" if head_only else body))
    await writer.drain()
