"""A pool of ready network namespaces for `--net default` creates.

Building a sandbox's network on the create path costs a netns, a veth pair
into the bridge (kernel ~2 ms), and addressing it from inside (~2 ms): the
measured --net default overhead was 6.6-15 ms p50 on the 2-core CI VM. None
of it depends on the sandbox (its cgroup, its policy), so a background thread
keeps `size` namespaces ready - lo up, `eth0` (the veth's peer) with an
address and default route(s), the host end `dp<tag><n>` up on the bridge -
and a create takes one: the sandbox's PID 1 joins it (spawn.c netns_fd)
instead of unsharing an empty one. The policy is attached to the sandbox's
cgroup before anything but dsec-init (which opens no socket) runs there.

Ownership: an entry is an fd of its netns and nothing else holds it (no
bind mount, no process), so an entry the daemon never handed out dies with
the daemon - kill -9 included - and the kernel deletes its veth pair with
it. `close()` (daemon shutdown) deletes the host ends itself so that nothing
is left even for the moment the kernel's netns clean-up takes; a restarted
daemon also deletes any `dp<tag>*` link it finds (a previous daemon's entries
whose clean-up had not finished). `tag` is per state dir, so two daemons
sharing a bridge netns (the tests do) never touch each other's entries.

The entry's address is leased in IPAM under the entry's name and never
recorded; the sandbox that takes the entry gets the lease (`Ipam.rekey`).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .ipam import Lease

log = logging.getLogger(__name__)

RETRY_AFTER_FAILURE_S = 1.0
# Refill only once creates have paused this long. Building an entry is ~5 ms of
# CPU, netlink (the kernel's RTNL lock) and GIL; started at once on a take, it
# runs during the very create that took the entry (the next steps: spawn,
# policy, answer) and on 2 cores made that create measurably slower than one
# without networking. A burst that drains the pool gets the create-path build
# for the rest (`misses`), which is what it would get without a pool.
REFILL_DELAY_S = 0.05


@dataclass
class Ready:
    """One ready namespace; `nsfd` is its only reference."""

    name: str            # host-side veth name, also its IPAM owner until taken
    nsfd: int
    lease: Lease
    made_ms: float = 0.0


class NetnsPool:
    """`make()` builds one Ready (blocking, netlink); `destroy(ready)` undoes one.

    A daemon thread refills to `size`; `take()` never blocks (None when empty:
    the caller builds the network on the create path as without a pool). The
    same thread runs `housekeeping()` whenever `wanted()` says so (the record
    log's compaction), so no request pays for it."""

    def __init__(self, size: int, make: Callable[[], Ready], destroy: Callable[[Ready], None],
                 housekeeping: Callable[[], None] = lambda: None, wanted: Callable[[], bool] = lambda: False):
        self.size = size
        self._make, self._destroy = make, destroy
        self._housekeeping, self._wanted = housekeeping, wanted
        self._ready: list[Ready] = []
        self._cond = threading.Condition()
        self._closed = False
        self._last_take = 0.0
        self._made_ms: list[float] = []      # the last 256 build times
        self.counts = {"made": 0, "taken": 0, "misses": 0, "failed": 0}
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="dsec-netns-pool", daemon=True)
        self._thread.start()

    def take(self) -> Ready | None:
        with self._cond:
            self._last_take = time.monotonic()
            if not self._ready:
                self.counts["misses"] += 1
                return None
            r = self._ready.pop(0)
            self.counts["taken"] += 1
            self._cond.notify()
            return r

    def kick(self) -> None:
        """Wake the thread (housekeeping wanted)."""
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and len(self._ready) >= self.size and not self._wanted():
                    self._cond.wait()
                if self._closed:
                    return
                short = len(self._ready) < self.size
                quiet_in = self._last_take + REFILL_DELAY_S - time.monotonic()
                if short and quiet_in > 0:
                    self._cond.wait(quiet_in)         # a take meanwhile pushes it further
                    continue
            if self._wanted():
                try:
                    self._housekeeping()
                except Exception as err:          # a failed compaction must not stop the pool
                    # ... nor spin it: wanted() stays true until one succeeds
                    # (a full disk), so the next try waits.
                    log.error("net housekeeping: %s (retry in %.0f s)", err, RETRY_AFTER_FAILURE_S)
                    with self._cond:
                        self._cond.wait(RETRY_AFTER_FAILURE_S)
            if short:
                self._fill_one()

    def _fill_one(self) -> None:
        t = time.perf_counter()
        try:
            r = self._make()
        except Exception as err:
            # No retry storm against a broken host (bridge gone, addresses exhausted).
            self.counts["failed"] += 1
            self.last_error = f"{type(err).__name__}: {err}"
            log.error("netns pool: building an entry failed: %s (retry in %.0f s)", err, RETRY_AFTER_FAILURE_S)
            with self._cond:
                self._cond.wait(RETRY_AFTER_FAILURE_S)
            return
        r.made_ms = (time.perf_counter() - t) * 1e3
        with self._cond:
            if self._closed:
                keep = False
            else:
                keep = True
                self._ready.append(r)
                self.counts["made"] += 1
                self._made_ms = self._made_ms[-255:] + [r.made_ms]
        if not keep:
            self._safe_destroy(r)

    def _safe_destroy(self, r: Ready) -> None:
        try:
            self._destroy(r)
        except Exception as err:
            log.error("netns pool: removing entry %s: %s", r.name, err)

    def close(self) -> None:
        """Stop refilling and remove every entry not handed out."""
        with self._cond:
            self._closed = True
            left, self._ready = self._ready, []
            self._cond.notify_all()
        self._thread.join(timeout=30)
        for r in left:
            self._safe_destroy(r)

    def stats(self) -> dict:
        with self._cond:
            made = list(self._made_ms)
            out = {"size": self.size, "ready": len(self._ready), **self.counts}
        if made:
            made.sort()
            out["create_p50_ms"] = round(statistics.median(made), 3)
            out["create_p99_ms"] = round(made[min(len(made) - 1, int(0.99 * (len(made) - 1) + 0.5))], 3)
        if self.last_error:
            out["last_error"] = self.last_error
        return out
