"""One structured log line and the metrics counters per lifecycle event.

The services publish every state change on the EventBus (events.py); this
listener turns each into one line of the daemon's log (logger
"dsecd.lifecycle", fields: event, sandbox and the event's own, see
LINES) and into the counters of dsecd/metrics.py. So a sandbox's life reads
in the log as created ... paused/resumed ... destroyed (or died, expired),
and the log, the `events` stream and the metrics cannot disagree.

Re-adoption at start is not an event of the protocol's stream (no client
saw the sandbox go); `adopted` logs and counts it the same way.
"""

from __future__ import annotations

import logging

from .. import metrics

log = logging.getLogger("dsecd.lifecycle")

# event kind -> (log level, message). The fields are the event's own.
LINES = {
    "created": (logging.INFO, "sandbox created"),
    "destroyed": (logging.INFO, "sandbox destroyed"),
    "paused": (logging.INFO, "sandbox paused"),
    "reclaimed": (logging.INFO, "paused sandbox's memory reclaimed after its job's pause"),
    "resumed": (logging.INFO, "sandbox resumed"),
    "expired": (logging.INFO, "sandbox expired"),
    "adopted": (logging.INFO, "sandbox re-adopted"),
    "oom": (logging.WARNING, "sandbox processes killed by its memory limit"),
    "died": (logging.WARNING, "sandbox init exited; the sandbox is dead"),
    "net_lost": (logging.ERROR, "sandbox networking not re-adopted at start; it is cut off (see reason)"),
}


def on_event(ev: dict) -> None:
    """EventBus listener: called on the loop for every published event."""
    kind = ev["event"]
    count(kind, ev)
    level, msg = LINES.get(kind, (logging.INFO, f"sandbox {kind}"))
    if log.isEnabledFor(level):
        fields = {"event": kind, **{k: v for k, v in ev.items() if k not in ("event", "time", "seq")}}
        log.log(level, msg, extra={"fields": fields})


def adopted(sb_id: str, **detail) -> None:
    on_event({"event": "adopted", "sandbox": sb_id, **detail})


def count(kind: str, ev: dict) -> None:
    if kind == "created":
        metrics.CREATES.labels(ev.get("qos") or "").inc()
        if ev.get("duration_ms") is not None:
            metrics.CREATE_SECONDS.observe(ev["duration_ms"] / 1000)
    elif kind == "destroyed":
        metrics.DESTROYS.labels(ev.get("reason") or "request").inc()
    elif kind == "paused":
        metrics.PAUSES.inc()
        metrics.RECLAIMED.inc(ev.get("freed_bytes") or 0)
    elif kind == "reclaimed":                   # after a job pause, whose event said 0
        metrics.RECLAIMED.inc(ev.get("freed_bytes") or 0)
    elif kind == "resumed":
        metrics.RESUMES.inc()
        metrics.PREFETCHED.inc(ev.get("prefetched_bytes") or 0)
        if ev.get("duration_ms") is not None:
            metrics.RESUME_SECONDS.observe(ev["duration_ms"] / 1000)
    elif kind == "oom":
        metrics.OOM_KILLS.inc(ev.get("kills") or 0)
    elif kind == "died":
        metrics.DIED.inc()
    elif kind == "expired":
        metrics.EXPIRED.labels(ev.get("reason") or "").inc()
    elif kind == "adopted":
        metrics.ADOPTED.inc()
