"""Task-policy denials counted per sandbox, policy and exec, and published as
`denied` events (the records come from dsecd/denials.py).

A sandbox is watched from its first exec under a policy that restricts
something until it is destroyed or dies. Each exec of a watched sandbox is
known by its session (the exec's pid in the sandbox: it leads a session of
its own), so a record names the exec and thus the policy it ran under;
records of an exec without a policy (a grader running unrestricted) are not
denials of any policy and are dropped. A record that arrives before the
daemon has read its exec's start waits up to PENDING_S; one whose session
no exec leads (a process that called setsid) is counted as `unattributed`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from .. import cgroup
from ..denials import Denial, Monitor
from .events import EventBus
from .policies import Applied
from .sandboxes import Sandbox, SandboxRegistry
from .workers import Workers

log = logging.getLogger(__name__)

PENDING_S = 2.0            # how long a record waits for its exec's start to be read
MAX_EXECS = 16384          # execs remembered for attribution (oldest forgotten first)
# Sandbox events after which its cgroup is no longer watched.
ENDS_WATCH = ("destroyed", "died")


@dataclass
class ExecRef:
    """One exec of a watched sandbox, for attribution."""

    sandbox: str
    policy: str | None          # None: no policy (its failures are not denials)
    cgroup: int
    pid: int = 0                # in the sandbox, once started
    argv0: str = ""
    count: int = 0              # denials attributed to it


class DenialService:
    """Owns the monitor (loaded at start in a worker, attached while a
    sandbox is watched), the attribution of its records and the counts.
    `events_per_exec`: `denied` events published per exec; later denials
    of that exec are counted only."""

    def __init__(self, monitor: Monitor | None, events_per_exec: int, layout: cgroup.Layout,
                 registry: SandboxRegistry, workers: Workers, events: EventBus):
        self.monitor = monitor
        self.events_per_exec = events_per_exec
        self.layout = layout
        self.registry = registry
        self.workers = workers
        self.events = events
        self.state = "off: sandbox.policy_denials = false" if monitor is None else "not loaded yet"
        self._loading: asyncio.Task | None = None
        self.by_cgroup: dict[int, str] = {}            # watched cgroup id -> sandbox id
        self._cgroups: dict[str, int] = {}             # sandbox id -> its cgroup v2 id (one stat each)
        self.execs: OrderedDict[tuple[int, int], ExecRef] = OrderedDict()
        self.pending: deque[tuple[float, Denial]] = deque(maxlen=4096)
        self._expiry: asyncio.TimerHandle | None = None
        self.total = 0
        self.unattributed = 0
        # For the metrics: (policy, kind) -> count, and unattributed by kind
        # (file, socket, signal: dsecd.denials.kind_of). Policy names are the
        # config's and "inline", so these stay few.
        self.by_policy_kind: dict[tuple[str, str], int] = {}
        self.unattributed_by_kind: dict[str, int] = {}
        events.subscribers.add(self)         # push(): a watched sandbox's end

    # ------------------------------------------------------------ start / stop

    def start(self) -> None:
        if self.monitor is not None and self.layout.v2 is None:
            self.state = "off: no cgroup v2 hierarchy (the program tells sandboxes apart by their v2 cgroup)"
            self.monitor = None
        if self.monitor is not None:
            self._loading = self.workers.loop.create_task(self._load())

    async def _load(self) -> None:
        """Load (the first time on a host: compile, seconds) in a thread of its
        own, not a worker: a daemon that stops meanwhile must not wait for it
        (worker threads are joined when the process exits)."""
        assert self.monitor is not None
        self.state = "loading"
        loop = self.workers.loop
        done = loop.create_future()

        def settle(err: Exception | None) -> None:
            if done.done():               # the load was cancelled: the daemon is stopping
                return
            if err is None:
                done.set_result(None)
            else:
                done.set_exception(err)

        def run() -> None:
            err = None
            try:
                self.monitor.load()
            except Exception as e:
                err = e
            try:
                loop.call_soon_threadsafe(settle, err)
            except RuntimeError:          # the loop is closed: the daemon stopped meanwhile
                pass

        threading.Thread(target=run, name="dsecd-denials-load", daemon=True).start()
        try:
            await done
        except Exception as err:
            self.state = f"off: {err}"
            log.warning("policy denials will not be counted: %s", err)
            return
        self.workers.loop.add_reader(self.monitor.fd, self._on_readable)
        self.state = "on"

    def close(self) -> None:
        self.events.subscribers.discard(self)
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self.monitor is not None and self.state == "on":
            self.workers.loop.remove_reader(self.monitor.fd)
        if self._expiry is not None:
            self._expiry.cancel()
        if self.monitor is not None:
            self.monitor.close()

    # ------------------------------------------------------------ execs

    async def exec_starting(self, sb: Sandbox, applied: Applied | None, argv0: str) -> ExecRef | None:
        """Before an exec of sb starts: a policy exec makes sb watched (the
        first one waits for the monitor to load: a compile, the first time
        on a host); the returned ref is `bind`ed once the exec's pid is known.
        None when nothing is counted for it."""
        confined = applied is not None and applied.plan is not None
        if self.monitor is None or not (confined or self.by_cgroup):
            return None
        cg = self._cgroup_of(sb)
        if not cg or (not confined and cg not in self.by_cgroup):
            return None
        if confined and cg not in self.by_cgroup:
            if self._loading is not None:
                await asyncio.shield(self._loading)
            if self.state != "on":
                return None
            try:
                self.monitor.watch(cg)
            except OSError as err:
                self.state = f"off: {err}"
                log.warning("policy denials will not be counted: %s", err)
                return None
            self.by_cgroup[cg] = sb.id
        return ExecRef(sb.id, applied.name if confined else None, cg, argv0=argv0)

    def bind(self, ref: ExecRef | None, sandbox_pid: int) -> None:
        """The exec's pid in the sandbox is known: its records are its own."""
        if ref is None or not sandbox_pid:
            return
        ref.pid = sandbox_pid
        key = (ref.cgroup, sandbox_pid)
        self.execs[key] = ref
        self.execs.move_to_end(key)
        while len(self.execs) > MAX_EXECS:
            self.execs.popitem(last=False)
        if self.pending:
            waiting, self.pending = self.pending, deque(maxlen=self.pending.maxlen)
            for t, d in waiting:
                if (d.cgroup, d.session) == key:
                    self._count(ref, d)
                else:
                    self.pending.append((t, d))

    def ended(self, ref: ExecRef | None) -> int | None:
        """The exec's end (its result is being made): its denials so far,
        after reading what the ring buffer holds (its own syscalls have all
        returned). None when none was counted for it."""
        if ref is None or ref.policy is None:
            return None
        self._on_readable()
        return ref.count

    @staticmethod
    def host_to_sandbox_pid(host_pid: int) -> int:
        """The sandbox's pid of a process the exec helper started (a child of
        the daemon, known by its host pid): the last NSpid of its status."""
        try:
            with open(f"/proc/{host_pid}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        return int(line.split()[-1])
        except (OSError, ValueError):
            pass
        return 0

    def _cgroup_of(self, sb: Sandbox) -> int:
        """The id BPF knows sb's processes by: its cgroup v2 dir's inode (0: none)."""
        cg = self._cgroups.get(sb.id)
        if cg is None:
            d = sb.handle.group.dirs.get(cgroup.V2) if sb.handle else None
            try:
                cg = os.stat(d).st_ino if d is not None else 0
            except OSError:
                return 0
            self._cgroups[sb.id] = cg
        return cg

    # ------------------------------------------------------------ records

    def _on_readable(self) -> None:
        if self.monitor is None:
            return
        for d in self.monitor.drain():
            ref = self.execs.get((d.cgroup, d.session))
            if ref is None:
                if d.cgroup in self.by_cgroup:
                    self.pending.append((time.monotonic(), d))
                continue
            self._count(ref, d)
        if self.pending and self._expiry is None:
            self._expiry = self.workers.loop.call_later(PENDING_S, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        now = time.monotonic()
        while self.pending and now - self.pending[0][0] >= PENDING_S:
            _, d = self.pending.popleft()
            sb = self.registry.by_id.get(self.by_cgroup.get(d.cgroup, ""))
            if sb is not None:
                self.unattributed += 1
                self.unattributed_by_kind[d.kind] = self.unattributed_by_kind.get(d.kind, 0) + 1
                sb.denials["unattributed"] = sb.denials.get("unattributed", 0) + 1
        if self.pending:
            self._expiry = self.workers.loop.call_later(PENDING_S, self._expire)

    def _count(self, ref: ExecRef, d: Denial) -> None:
        if ref.policy is None:
            return          # an exec without a policy: its EACCES are its own business
        ref.count += 1
        self.total += 1
        key = (ref.policy, d.kind)
        self.by_policy_kind[key] = self.by_policy_kind.get(key, 0) + 1
        sb = self.registry.by_id.get(ref.sandbox)
        if sb is not None:
            sb.denials["total"] = sb.denials.get("total", 0) + 1
            by = sb.denials.setdefault("by_policy", {})
            by[ref.policy] = by.get(ref.policy, 0) + 1
        if ref.count <= self.events_per_exec:
            self.events.publish("denied", ref.sandbox, policy=ref.policy, exec_pid=ref.pid, argv0=ref.argv0,
                                count=ref.count, **d.public())

    # ------------------------------------------------------------ events and info

    def push(self, ev: dict) -> None:
        """EventBus subscriber: a watched sandbox that ended is no longer watched."""
        if ev["event"] not in ENDS_WATCH or self.monitor is None:
            return
        self._cgroups.pop(ev["sandbox"], None)
        for cg, sb_id in list(self.by_cgroup.items()):
            if sb_id == ev["sandbox"]:
                del self.by_cgroup[cg]
                try:
                    self.monitor.unwatch(cg)
                except OSError as err:
                    log.warning("stop watching sandbox %s for policy denials: %s", sb_id, err)
                for key in [k for k in self.execs if k[0] == cg]:
                    del self.execs[key]

    def info(self) -> dict:
        by_kind: dict[str, dict[str, int]] = {}
        for (policy, kind), n in sorted(self.by_policy_kind.items()):
            by_kind.setdefault(policy, {})[kind] = n
        return {"monitor": self.state, "total": self.total, "unattributed": self.unattributed,
                "lost": self.monitor.lost() if self.monitor is not None and self.state == "on" else 0,
                "watched_sandboxes": len(self.by_cgroup), "by_policy_kind": by_kind,
                "unattributed_by_kind": dict(sorted(self.unattributed_by_kind.items()))}
