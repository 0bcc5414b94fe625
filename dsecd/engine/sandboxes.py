"""Every sandbox of this daemon, by id, and its journal record.

Sandbox states:
    creating -> running -> stopping -> (gone)
                  |  ^
                  v  |
                 paused
                  |
    running/paused +-> dead (its init exited on its own; only inspect/destroy accept it)

A record (Sandbox.record) is written to the journal (dsecd/journal.py) when
a sandbox starts running and whenever a journaled field changes, so that the
next daemon re-adopts it; runtime-only fields are rebuilt then.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from fractions import Fraction

from .. import userns
from ..backends.container import Handle
from ..cpu.admission import Requested
from ..errors import BadRequest, Conflict, LimitExceeded, NotFound, Unsupported, io_error
from ..journal import Journal
from ..protocol import VM_DIED_BECAUSE
from .opkeys import OpKeys

# The ops a microVM sandbox serves (dsecd/engine/microvms.py, vmfiles.py); the others are
# `unsupported` for it until the backend grows them.
MICROVM_OPS = frozenset({"inspect", "destroy", "exec", "file_read", "file_write", "file_list", "file_stat",
                         "file_mkdir", "file_remove", "file_rename", "file_set_attrs", "file_watch", "file_tar_get",
                         "file_tar_put",
                         "pause", "resume", "net_show", "net_set", "net_publish", "net_unpublish", "snapshot",
                         "proc_start", "proc_list", "proc_logs", "proc_input", "proc_kill", "proc_wait"})


@dataclass
class Sandbox:
    id: str
    image: str
    state: str
    created: float
    limits: dict
    env: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    hostname: str = ""
    cwd: str = "/"
    user: int = 0               # the uid of its processes, unless an exec names another
    gid: int | None = None      # their gid; None (records of older daemons): the uid's number
    groups: list = field(default_factory=list)   # their supplementary gids (dsecd/fs/users.py)
    backend: str = "container"
    handle: Handle | None = None
    # Runtime only (not journaled): pause/resume/snapshot serialisation and clocks.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    pausing: bool = False             # a pause holds `lock`, frozen but its state still running
    # Copiers one at a time (file_write, directory copies: dsecd/engine/
    # copier.py), each checking the room under the memory limit: two at once
    # could both pass the check and fill it together.
    copy_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    last_active: float = 0.0          # monotonic; the idle TTL counts from here
    paused_at: float | None = None
    paused_total: float = 0.0
    lease_deadline: float | None = None
    expired: bool = False             # its `expired` event was published (its destroy may be retried)
    oom_kills: int = 0                # the memory cgroup's OOM-kill count last seen
    execs: int = 0
    stopping_by: str | None = None    # a destroy under way: its reason (ttl, request, ...), for its execs' results
    helper_execs: bool = False        # the daemon's helper started one: its CLONE_PARENT children are ours
    copies: int = 0                   # directory copies in or out running (the idle TTL waits for them)
    died: float | None = None
    # What its "died" event said (journaled): {"reason": ...} and how its
    # init or QEMU ended ("signal" or "exit_code", "detail", "qemu_said");
    # a microVM's also "oom_kills", its QEMU's memory cgroup's.
    death: dict | None = None
    manifest: str = ""          # image manifest digest: what snapshot and gc go by
    layers: list = field(default_factory=list)   # layer digests, bottom first
    ttl: float | None = None        # max lifetime, seconds
    idle_ttl: float | None = None   # stop after this long without requests (paused time excluded)
    lease: float | None = None      # a client must `renew` within this many seconds
    pause_record: dict | None = None   # what pause did (dsecd/mem/pause.py), for resume
    net: dict | None = None            # {"mode": "default", "lease": {...}}; None = loopback only
    qos: str = "be"             # CPU class (dsecd/cpu/qos.py)
    core_sched: str = "off"     # on | off | unavailable
    key: str | None = None      # idempotency key of the create (dsecd/engine/creates.py)
    key_args: str | None = None  # digest of that create's other arguments: a reuse must match them
    # Idempotency keys of its execs, processes and snapshots (dsecd/engine/opkeys.py), oldest first:
    # in the order they began, a key moved last as its request ends.
    op_keys: dict = field(default_factory=dict)
    idmap: dict | None = None   # user-namespace id range (dsecd/userns.py); None = host ids
    procs: list = field(default_factory=list)   # background processes' records (dsecd/engine/procs.py)
    # Default task policy of its execs, {"name", "spec"} (dsecd/engine/policies.py); None: none.
    policy: dict | None = None
    # Runtime only: task-policy denials seen (dsecd/engine/denials.py): total, by_policy, unattributed.
    denials: dict = field(default_factory=dict)
    # A microVM's machine (backend.Machine.to_record) and the template it was
    # restored from: what a resume must start QEMU with (engine/microvms.py).
    vm: dict | None = None

    def paused_for(self) -> float:
        """Seconds it has spent paused so far, a pause in progress included."""
        now_paused = time.monotonic() - self.paused_at if self.paused_at is not None else 0.0
        return self.paused_total + now_paused

    def root_copy(self) -> int:
        """A copy of the container's root fd, taken on the loop for a worker
        that walks under it (handed to fds.call_closing, or closed by its
        owner). Not the handle's number itself: a destroy meanwhile (it
        takes no sandbox lock) closes that, and parked fds reuse the lowest
        free number, so a worker still using it could land in another
        sandbox's root. Conflict once the sandbox is being destroyed;
        LimitExceeded when the daemon is out of fds (its RLIMIT_NOFILE)."""
        if self.handle is None or self.handle.rootfd < 0:
            raise Conflict(f"sandbox {self.id} is {self.state}", {"sandbox": self.id})
        try:
            return os.dup(self.handle.rootfd)
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):
                raise LimitExceeded(f"sandbox {self.id}: the daemon has no fd left for the request "
                                    f"({err.strerror}); retry once fewer requests are under way, or raise "
                                    "the daemon's RLIMIT_NOFILE (LimitNOFILE= in its unit)",
                                    {"sandbox": self.id, "errno": errno.errorcode[err.errno]}) from err
            raise io_error("reach the root of sandbox", self.id, err) from err

    def end_paused_time(self) -> None:
        """The pause clock stopped (a resume, or a pause that was undone):
        the time since paused_at joins paused_total."""
        if self.paused_at is not None:
            self.paused_total += time.monotonic() - self.paused_at
        self.paused_at = None

    def record(self) -> dict:
        h = self.handle
        return {"id": self.id, "image": self.image, "state": self.state, "created": self.created,
                "limits": self.limits, "env": self.env, "labels": self.labels,
                "hostname": self.hostname, "cwd": self.cwd, "user": self.user, "gid": self.gid,
                "groups": self.groups,
                "backend": self.backend,
                "init_pid": h.init_pid if h else None, "init_start": h.init_start if h else None,
                "died": self.died, "death": self.death, "qos": self.qos, "core_sched": self.core_sched,
                "manifest": self.manifest, "layers": self.layers, "ttl": self.ttl,
                "idle_ttl": self.idle_ttl, "lease": self.lease, "pause_record": self.pause_record,
                "net": self.net, "key": self.key, "key_args": self.key_args, "op_keys": self.op_keys,
                "idmap": self.idmap, "procs": self.procs,
                "policy": self.policy, "vm": self.vm}

    def public(self) -> dict:
        out = self.record()
        out.pop("init_start")
        out.pop("pause_record")
        out.pop("procs")
        out.pop("op_keys")      # one per exec the SDK sends: for the daemon, not for listings
        out.pop("vm")           # inspect's "vm" says it for a microVM
        if self.backend == "microvm" and self.handle is not None and self.handle.pidfd < 0:
            out["init_pid"] = None  # a paused VM: its QEMU ended, and its pid may be another's now
        out["execs_running"] = self.execs
        # Background processes (proc_start) that run: their records say so as they start and end.
        out["procs_running"] = sum(1 for rec in self.procs if rec.get("state") == "running")
        out["denials"] = self.denials
        return out


def death_says(death: dict) -> str:
    """A sandbox's death record (Sandbox.death) in a few words, for errors:
    why, how its init or QEMU ended, and its OOM kills."""
    reason = death.get("reason", "")
    words = [VM_DIED_BECAUSE.get(reason, reason)]
    if "signal" in death:
        words.append(f"killed by {death['signal']}")
    elif "exit_code" in death:
        words.append(f"exit code {death['exit_code']}")
    if death.get("oom_kills"):
        words.append(f"{death['oom_kills']} OOM kill(s) of its QEMU's memory cgroup")
    if death.get("detail"):
        words.append(str(death["detail"])[:200])
    return "; ".join(w for w in words if w)


# Why a destroyed sandbox went (destroy_sandbox's reasons), for the error of
# a request that names it later.
DESTROYED_BECAUSE = {"ttl": "its ttl ran out", "idle_ttl": "it was idle past its idle_ttl",
                     "lease": "its lease was not renewed", "request": "by a destroy request",
                     "job": "by a job rm", "all": "by a destroy of all sandboxes", "pool": "by its warm pool",
                     "build": "by its image build, whose step it ran"}


class JobCreate:
    """A create of a job under way (SandboxRegistry.job_create_begun), and the
    job op begun while it ran that its sandbox is yet to join."""

    __slots__ = ("op",)

    def __init__(self):
        self.op: str | None = None

    def left(self, op: str) -> None:
        # The last op wins, but a job removed stays removed: a pause or
        # resume after the rm does not bring its sandboxes back.
        if self.op != "rm":
            self.op = op

    def take(self) -> str | None:
        """The op to apply now (None: none since the last take)."""
        op, self.op = self.op, None
        return op


class SandboxRegistry:
    """The sandboxes by id (live and dead), by idempotency key, and the
    journal their records go to."""

    # How many destroyed sandboxes it remembers (id -> when and why), so that a
    # request naming one says it was destroyed and why, not only "no sandbox".
    REMEMBER_DESTROYED = 4096
    # The shortest id prefix that names a sandbox: a shorter one would too
    # easily name another than the caller meant (a `dsec rm` of "7").
    MIN_PREFIX = 4

    def __init__(self, journal: Journal):
        self.journal = journal
        self.by_id: dict[str, Sandbox] = {}
        self.destroyed: OrderedDict[str, tuple[float, str]] = OrderedDict()
        # Idempotency key -> the id of the sandbox a create with it made, or
        # the future of the create still making it (dsecd/engine/creates.py).
        # A key is free again once its sandbox is destroyed.
        self.keys: dict[str, str | asyncio.Future] = {}
        # The idempotency keys of requests in a sandbox: exec, proc_start, snapshot.
        self.op_keys = OpKeys(self)
        # The live (not dead) sandboxes and what they ask for, kept as they
        # come, die and go: every create checks the live count and admission
        # the sums, and a scan of thousands of sandboxes there cost the event
        # loop 0.115 ms per create at 2,000. CPU as an exact fraction (every
        # float is one), so that adding and taking away leave no drift.
        # {id: (CPUs, memory bytes)} of the live ones, and of call sandboxes (hold).
        self._counted: dict[str, tuple[Fraction, int]] = {}
        self._held: set[str] = set()        # keys of _counted that are no sandbox of by_id (hold)
        self._cpu = Fraction(0)
        self._memory = 0
        # The creates under way of each job (label job=...), each with the
        # job op (pause, resume, rm) begun while it ran, if any: the op's
        # list of the job's sandboxes cannot hold one that does not run yet,
        # so the create applies it to its sandbox once made (CreateService).
        self._job_creates: dict[str, dict[JobCreate, None]] = {}
        # One job op of a job at a time (job_lock): {job: [lock, its holders and waiters]}.
        self._job_locks: dict[str, list] = {}

    def named(self, sb_id: str) -> Sandbox:
        """The sandbox `sb_id`, or the one sandbox whose id starts with it
        (MIN_PREFIX characters at least), whatever its state."""
        sb = self.by_id.get(sb_id)
        if sb is not None:
            return sb
        matches = [s for k, s in self.by_id.items() if k.startswith(sb_id)] if sb_id else []
        if len(matches) > 1 and len(sb_id) >= self.MIN_PREFIX:
            ids = sorted(s.id for s in matches)
            shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
            raise BadRequest(f"sandbox prefix {sb_id!r} is ambiguous: it begins {shown}; give more of the id",
                             {"matches": ids})
        if len(matches) != 1 or len(sb_id) < self.MIN_PREFIX:
            if sb_id in self.destroyed:
                at, reason = self.destroyed[sb_id]
                raise NotFound(f"no sandbox {sb_id!r}: it was destroyed {time.monotonic() - at:.0f} s ago, "
                               f"{DESTROYED_BECAUSE.get(reason, reason)}", {"sandbox": sb_id, "destroyed": reason})
            if matches:     # too short to stand for an id, though some begin with it
                raise NotFound(f"no sandbox {sb_id!r}: an id prefix needs {self.MIN_PREFIX} characters at least "
                               f"(`dsec ps` lists the ids)", {"sandbox": sb_id})
            raise NotFound(f"no sandbox {sb_id!r} (see `dsec ps`)", {"sandbox": sb_id})
        return matches[0]

    def get(self, sb_id: str, op_cls) -> Sandbox:
        """The sandbox `named` `sb_id` in a state `op_cls` (a protocol
        request) accepts."""
        sb = self.named(sb_id)
        if sb.backend == "microvm" and op_cls.OP not in MICROVM_OPS:
            raise Unsupported(f"{op_cls.OP} is not available for microVM sandboxes yet ({sb.id} runs "
                              "with backend microvm); see docs/architecture.md, \"The microVM backend\"",
                              {"sandbox": sb.id, "backend": sb.backend})
        if op_cls.STATES and sb.state not in op_cls.STATES:
            # Dead stays dead (its init or QEMU exited): only its record is left to remove.
            dead = sb.state == "dead"
            said = f" ({death_says(sb.death)})" if dead and sb.death else ""
            then = f"; a dead sandbox never runs again: `dsec rm {sb.id}` removes it" if dead else ""
            raise Conflict(f"sandbox {sb.id} is {sb.state}{said}; {op_cls.OP} needs it "
                           f"{' or '.join(op_cls.STATES)}" + then,
                           {"sandbox": sb.id, "state": sb.state} | ({"death": sb.death} if said else {}))
        return sb

    def add(self, sb: Sandbox) -> None:
        self.by_id[sb.id] = sb
        self._uncount(sb.id)
        if sb.state != "dead":
            self._count(sb)

    def _count(self, sb: Sandbox) -> None:
        self._count_as(sb.id, sb.limits["cpu"], sb.limits["memory"])

    def _count_as(self, key: str, cpu: float, memory: int) -> None:
        cpu_f = Fraction(cpu)
        self._counted[key] = (cpu_f, memory)
        self._cpu += cpu_f
        self._memory += memory

    def _uncount(self, sb_id: str) -> None:
        cpu, memory = self._counted.pop(sb_id, (0, 0))
        self._cpu -= cpu
        self._memory -= memory

    def hold(self, key: str, cpu: float, memory: int) -> None:
        """Count a sandbox this registry does not hold (a call sandbox,
        engine/calls.py) as a live one, until release(key): it takes a slot
        of limits.max_sandboxes and the CPU and memory it asks for, as a
        create's sandbox does."""
        self._uncount(key)
        self._count_as(key, cpu, memory)
        self._held.add(key)

    def release(self, key: str) -> None:
        self._uncount(key)
        self._held.discard(key)

    @contextlib.asynccontextmanager
    async def job_lock(self, job: str):
        """Held by a job op (job_pause, job_resume, job_rm) from before it
        lists the job's sandboxes to its end: the next op of the job lists
        them as this one left them (a job_resume sent after a job_pause finds
        the sandboxes it paused), and neither freezes what the other thaws."""
        entry = self._job_locks.setdefault(job, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._job_locks[job]

    def job_create_begun(self, job: str) -> JobCreate:
        """A create of `job` under way, until job_create_ended: job ops begun
        meanwhile are left on it (JobCreate.take)."""
        create = JobCreate()
        self._job_creates.setdefault(job, {})[create] = None
        return create

    def job_create_ended(self, job: str, create: JobCreate) -> None:
        creates = self._job_creates.get(job, {})
        creates.pop(create, None)
        if not creates:
            self._job_creates.pop(job, None)

    def job_op_begun(self, job: str, op: str, states: tuple[str, ...]) -> list[Sandbox]:
        """A job op (`op`: pause, resume, rm) begins: it is left on each create
        of the job under way, and its sandboxes in one of `states` are
        returned (of_job); none is not_found only if no create is under way."""
        creates = self._job_creates.get(job, {})
        for create in creates:
            create.left(op)
        try:
            return self.of_job(job, states)
        except NotFound:
            if creates:
                return []
            raise

    def of_job(self, job: str, states: tuple[str, ...]) -> list[Sandbox]:
        """The sandboxes labelled job=`job` in one of `states`; not_found if none has the label."""
        sbs = [s for s in self.by_id.values() if s.labels.get("job") == job and s.state in states]
        if not sbs and not any(s.labels.get("job") == job for s in self.by_id.values()):
            raise NotFound(f"no sandbox has label job={job}")
        return sbs

    def live_count(self) -> int:
        return len(self._counted)

    def requested(self, without: tuple[str, ...] = ()) -> Requested:
        """What the live sandboxes ask for, summed (no scan); `without`: as
        if the call sandboxes held under those keys were released."""
        if not without:         # every create asks: no Fraction arithmetic
            return Requested(cpu=float(self._cpu), memory=self._memory, sandboxes=len(self._counted),
                             call_sandboxes=len(self._held))
        cpu, memory, gone = self._held_sums(without)
        return Requested(cpu=float(self._cpu - cpu), memory=self._memory - memory,
                         sandboxes=len(self._counted) - gone, call_sandboxes=len(self._held) - gone)

    def held(self, keys) -> Requested:
        """What the call sandboxes held under `keys` (hold) ask for, summed."""
        cpu, memory, n = self._held_sums(keys)
        return Requested(cpu=float(cpu), memory=memory, sandboxes=n, call_sandboxes=n)

    def _held_sums(self, keys) -> tuple[Fraction, int, int]:
        """(CPU, memory, how many) of the call sandboxes held under `keys`."""
        cpu, memory, n = Fraction(0), 0, 0
        for key in keys:
            if key in self._held:
                c, m = self._counted[key]
                cpu, memory, n = cpu + c, memory + m, n + 1
        return cpu, memory, n

    def save(self, sb: Sandbox) -> None:
        # A record is one line appended to the log (dsecd/journal.py): cheap
        # enough for the event loop. With journal.fsync on, each write waits
        # for the disk; use a slower but crash-proof config knowingly.
        self.journal.write(sb.id, sb.record())

    def listed(self, sb: Sandbox) -> bool:
        """`sb` is still the registry's (no destroy took it away meanwhile)."""
        return self.by_id.get(sb.id) is sb

    def destroyed_error(self, sb: Sandbox, what: str) -> Conflict | None:
        """The error for a request on `sb` that failed because a destroy (a
        request, a TTL, a job's) took the sandbox away under it, or None if
        it is still here: its copier or exec was killed by the destroy, not
        by its memory limit or its own doing."""
        if sb.state != "stopping" and self.listed(sb):
            return None
        return Conflict(f"{what}: sandbox {sb.id} was destroyed meanwhile", {"sandbox": sb.id})

    def mark_dead(self, sb: Sandbox) -> None:
        """`sb`'s init is gone: it stays listed, as dead, until destroyed."""
        if self.listed(sb):
            self._uncount(sb.id)
        sb.state = "dead"

    def forget(self, sb_id: str) -> None:
        """A sandbox whose create failed: it was never journaled."""
        if self.by_id.pop(sb_id, None) is not None:
            self._uncount(sb_id)

    def remove(self, sb: Sandbox, reason: str = "request") -> None:
        """`sb` is destroyed (`reason`: destroy_sandbox's): its record and its key go too."""
        if self.by_id.pop(sb.id, None) is sb:
            self._uncount(sb.id)
        self.destroyed[sb.id] = (time.monotonic(), reason)
        while len(self.destroyed) > self.REMEMBER_DESTROYED:
            self.destroyed.popitem(last=False)
        if sb.key and self.keys.get(sb.key) == sb.id:
            del self.keys[sb.key]
        self.op_keys.forget_sandbox(sb.id)
        self.journal.delete(sb.id)


async def in_root(workers, sb: Sandbox, fn, *args, owner: tuple[int, int] | None = None):
    """fn(root, *args), a host-side file operation, in a worker, as the
    sandbox's root user (userns.file_op; what it makes belongs to `owner`
    if given), on the worker's own copy of the sandbox's root
    (Sandbox.root_copy): closed when fn returns, or dropped with the work
    if its caller is cancelled before it starts (Workers.run_owning)."""
    root = sb.root_copy()
    return await workers.run_owning(root, functools.partial(userns.file_op, owner=owner),
                                    userns.IdMap.from_record(sb.idmap), fn, root, *args)
