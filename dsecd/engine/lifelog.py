"""One structured log line per lifecycle event.

The services publish every state change on the EventBus (events.py); this
listener turns each into one line of the daemon's log (logger
"dsecd.lifecycle", fields: event, sandbox and the event's own, see
LINES). So a sandbox's life reads in the log as created ... paused/resumed
... destroyed (or died, expired), and the log and the `events` stream
cannot disagree.

Re-adoption at start is not an event of the protocol's stream (no client
saw the sandbox go); `adopted` logs it the same way.
"""

from __future__ import annotations

import logging

log = logging.getLogger("dsecd.lifecycle")

# event kind -> (log level, message). The fields are the event's own.
LINES = {
    "created": (logging.INFO, "sandbox created"),
    "destroyed": (logging.INFO, "sandbox destroyed"),
    "paused": (logging.INFO, "sandbox paused"),
    "resumed": (logging.INFO, "sandbox resumed"),
    "expired": (logging.INFO, "sandbox expired"),
    "adopted": (logging.INFO, "sandbox re-adopted"),
    "oom": (logging.WARNING, "sandbox processes killed by its memory limit"),
    "died": (logging.WARNING, "sandbox init exited; the sandbox is dead"),
}


def on_event(ev: dict) -> None:
    """EventBus listener: called on the loop for every published event."""
    kind = ev["event"]
    level, msg = LINES.get(kind, (logging.INFO, f"sandbox {kind}"))
    if log.isEnabledFor(level):
        fields = {"event": kind, **{k: v for k, v in ev.items() if k not in ("event", "time", "seq")}}
        log.log(level, msg, extra={"fields": fields})


def adopted(sb_id: str, **detail) -> None:
    on_event({"event": "adopted", "sandbox": sb_id, **detail})
