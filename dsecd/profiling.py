"""A debug hook: the daemon's Python profiled with cProfile, every thread.

Set DSECD_PROFILE to a file path before starting the daemon; it then runs
one cProfile profiler per thread (the event loop's and every worker's,
installed through `threading.setprofile` as each thread starts) and writes
their merged statistics to that path (pstats format) when it stops, and
the event loop's thread alone to `<path>.loop`:

    DSECD_PROFILE=/tmp/dsecd.prof dsecd ...
    python3 -m pstats /tmp/dsecd.prof    # sort tottime, stats 40

Times are wall-clock by default: a worker blocked in a syscall (a cgroup
mkdir waiting for the kernel's cgroup mutex) shows as busy. With
DSECD_PROFILE_CPU=1 every thread's profiler counts its own CPU time instead
(time.thread_time: a syscall per event, so the daemon runs several times
slower; compare shares, not times). The profilers slow the daemon's Python
down in any case: compare shares of a profile, not its times with an
unprofiled run. Off (nothing installed) when the variable is unset.
"""

from __future__ import annotations

import atexit
import cProfile
import os
import pstats
import threading
import time

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()
_timer: tuple = ()          # (time.thread_time,) with DSECD_PROFILE_CPU=1: CPU time per thread


def _start_in_thread(*_args) -> None:
    """The first profile event of a new thread: give it a profiler of its
    own (enable() replaces this hook for the thread)."""
    prof = cProfile.Profile(*_timer)
    with _lock:
        _profiles.append(prof)
    prof.enable()


def _dump(path: str) -> None:
    with _lock:
        profs = list(_profiles)
    stats = None
    for i, prof in enumerate(profs):
        try:
            prof.create_stats()
        except Exception:           # a thread that never ran a Python call
            continue
        if not prof.stats:
            continue
        if i == 0:                  # the loop's thread, alone (Stats() empties a profile it reads)
            pstats.Stats(prof).dump_stats(path + ".loop")
            prof.create_stats()
        if stats is None:
            stats = pstats.Stats(prof)
        else:
            stats.add(prof)
    if stats is not None:
        stats.dump_stats(path)


def start_from_env() -> bool:
    """Profile this process if DSECD_PROFILE names a file; True if it does."""
    path = os.environ.get("DSECD_PROFILE")
    if not path:
        return False
    global _timer
    if os.environ.get("DSECD_PROFILE_CPU") == "1":
        _timer = (time.thread_time,)
    threading.setprofile(_start_in_thread)
    main = cProfile.Profile(*_timer)
    _profiles.insert(0, main)          # first: _dump writes it alone too (the loop's thread)
    main.enable()
    atexit.register(_dump, path)
    return True
