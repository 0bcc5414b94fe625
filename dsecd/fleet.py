"""dsecd.Fleet: the daemons of many hosts driven as one.

    async with dsecd.Fleet(["ssh://h1", "ssh://h2", "ssh://h3"], on_event=print) as fleet:
        sb = await fleet.create(image="busybox", labels={"job": "j7"})   # placed on a host
        await sb.exec("echo hi")            # straight to sb.host: a Sandbox of that host's Client
        await fleet.job_pause("j7")         # every host at once
        rows = await fleet.list()           # every host's sandboxes, each with "host"

A host is any Client target: ssh://[user@]host[:port] (a bare name means
ssh://name) or a local socket path. One Client (one ssh connection) per
host carries everything for that host; a sandbox handle keeps its host's
Client, so exec, files, pause and destroy go straight there.

Placement (`create`). Among the hosts that are up, not refusing creates
(`busy` in the last few seconds), holding the image (image_list) and with
room for the sandbox and not drained (`dsec drain`, by its last `info`), the
first by

    (its sandboxes of this job,   only for a create labelled job=...
     its load, in steps of LOAD_STEP,
     its warmth, most first, in tenths,
     chance)

  job        a job's sandboxes spread evenly, so that losing a host costs the
             job a part of itself, never most of it.
  load       the host's fullest resource once this sandbox is added: CPU
             and memory requested over the admission capacities `info`
             reports (cpu.admission: cores x oversubscription, MemTotal x
             ratio), sandboxes over limits.max_sandboxes (and the user
             namespace slots). Counted from the host's last `info` plus the
             creates this fleet sent it since, so a burst spreads before the
             next `info` comes. A host where it would pass 1 has no room.
             Loads within a step (5% of a host) count as equal, so that...
  warmth     ...how much of the image's layer bytes the host holds
             decides: a layer mounted there counts whole, one paged in
             counts the share of its chunks in the host's pager cache
             (image_du: mounted_layers, cached_layers), weighted by layer
             size. With a shared store (images.store on a distributed file
             system) every host lists every image, and this is what sends
             a create to the host that already read its image: its start
             reads less from the store.

Creates carry an idempotency key (one is made when none is given). A host
answering `busy` (or not_found: no such image there; or bad_request for
more than it can ever give a sandbox) is skipped and the same key is sent
to the next best. When no host takes it, the create fails with `busy`
naming each host's reason if any host is merely full, busy or down (a
retry may succeed); if every host refused for good, with that error
instead: `not_found` (no host has the image) or `bad_request` (no host is
large enough; a host whose `info` says so is not even asked). A key
remembers its host: a create sent again with it goes back there and gets
the same sandbox (until the sandbox is destroyed: the daemon frees the key
then, and so does the fleet). Keys made before the fleet (a driver restarted) are
learned from each host's sandboxes when it joins; until every host has
answered once, a create with a key of the caller's that the fleet has not
learned is HostsDown (its sandbox may be on the host not heard from). A
sandbox that goes without this fleet (its TTL, its lease, another client)
is forgotten, with its key, at the next refresh whose `info` counts fewer
live sandboxes on its host than the fleet does, at a listing of the
host's sandboxes every PRUNE_S, or when its host rejoins.

Failure. Every host is pinged each `heartbeat_s`; a host whose connection
drops, or from which nothing (no answer, no bytes) came for `down_after_s`,
is marked down at once (so within down_after_s + heartbeat_s, 4 s by
default): its connection is closed (requests in flight on it fail with
ConnectionLost), placement avoids it, and the caller is told through
`on_event` and `events()`: a `host_down` event and one `sandbox_lost` per
sandbox it held. The fleet then tries to connect again every `rejoin_s`;
when the host answers, it is up again (`host_up`, with `sandbox_back` for
each sandbox that survived: a daemon restart keeps them). A host added
later (`add_host`; dsecd.ray adds the Ray nodes it discovers) joins the
same way as one that was down from the start.

No sandbox twice. A create whose connection was lost after it was sent may
or may not have happened on that host; it is retried elsewhere with the same
key, and the key is remembered for that host. When the host rejoins, a
sandbox there holding such a key whose create succeeded elsewhere is
destroyed (`duplicate_removed`); one whose create failed everywhere is kept
as that key's sandbox.

What the fleet counts per host (its sandboxes, per job) comes from its own
creates and destroys, from `list()` (which resyncs it) and from each rejoin:
sandboxes made or destroyed by other clients are seen then.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from . import remote
from .client import Client, Sandbox, _SandboxContext
from .config import parse_size
from .errors import BadRequest, Busy, ConnectionLost, DsecError, HostsDown, NotFound

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
DOWN_AFTER_S = 3.0
REJOIN_S = 1.0
REFRESH_S = 2.0            # how often each host's info and images are read again
PRUNE_S = 30.0             # how often, at least, each host's sandboxes are listed to forget those gone
CONNECT_TIMEOUT_S = 10.0
# Loads closer than this (a share of a host) are equal for placement, and
# mounted layers decide between such hosts (see the module's docstring).
LOAD_STEP = 0.05
# The daemon's shipped [sandbox] defaults: what a create that names no cpu or
# memory is counted as until the host's next `info` says what it took.
DEFAULT_CPU = 1.0
DEFAULT_MEMORY = 512 << 20
# A host that answered `busy` gets no create for this long (or its retry_after_s, if shorter).
BUSY_BACKOFF_S = 2.0
# How a create's `lasting` refusals (see Fleet._no_host) record a host that
# lacks the image, apart from a not_found about another thing the create names.
NO_IMAGE = "no_image"


def fleet_target(host: str) -> str:
    """A Client target for a host as given: ssh:// or a socket path as it is, a bare name as ssh://name."""
    if remote.is_remote(host) or host.startswith("/"):
        return host
    if "/" in host:
        # A relative socket path: as ssh://run/x.sock it would be refused as
        # an ssh:// address with a path, which says nothing of sockets.
        raise ValueError(f"{host!r} is neither a host nor a socket path: give ssh://[user@]host[:port], "
                         "a host name, or the absolute path of a daemon's socket")
    return remote.SCHEME + host


def short_name(target: str) -> str:
    return target.removeprefix(remote.SCHEME)


@dataclass
class _Shape:
    cpu: float
    memory: int


def live_sandboxes(info: dict) -> int:
    """The sandboxes a host's `info` counts, but the dead."""
    return sum(n for state, n in info.get("sandboxes", {}).items() if state != "dead")


def call_sandboxes(info: dict) -> int:
    """FnCall's call sandboxes of a host's `info` with a call in flight:
    not in its `sandboxes`, yet each takes a slot of limits.max_sandboxes
    (0 from a daemon that did not count them). Idle ones are not counted:
    a create drops them for its room."""
    adm = (info.get("cpu") or {}).get("admission") or {}
    idle = (adm.get("idle_call_sandboxes") or {}).get("sandboxes") or 0
    return ((adm.get("sandboxes") or {}).get("call_sandboxes") or 0) - idle


class FleetHost:
    """What the fleet knows of one host, and its Client."""

    def __init__(self, target: str, client: Client):
        self.target = target
        self.name = short_name(target)
        self.client = client
        self.up = False
        self.joined = False          # it answered once: the keys of its sandboxes are known
        self.since = time.time()
        self.reason = "not connected yet"                  # why it is down
        self.rejoin_error = ""                             # why the last try to connect again failed
        self.last_answer = 0.0
        self.info: dict | None = None
        self.images: dict[str, list[str]] | None = None      # image name -> its layer digests
        self.mounted: set[str] = set()                       # layer digests mounted there
        self.cached: dict[str, float] = {}                   # layer digest -> share in its pager cache
        self.layer_sizes: dict[str, int] = {}                # layer digest -> bytes
        self.sandboxes: dict[str, str] = {}                  # id -> job label ("" without one)
        self.jobs: collections.Counter[str] = collections.Counter()
        self.reported_lost: set[str] = set()
        self.uncertain_keys: set[str] = set()                # creates sent here whose answer was lost
        self.busy_until = 0.0
        self.pruned_at = float("-inf")                       # loop time of the last listing (Fleet._prune)
        # Creates sent since the last info: done ones (loop time, shape), and
        # the totals of those and the ones in flight (kept as sums: placement
        # reads them for every host on every create).
        self.done: collections.deque[tuple[float, _Shape]] = collections.deque()
        self.extra = _Shape(0.0, 0)
        self.extra_n = 0
        self.pending_jobs: collections.Counter[str] = collections.Counter()

    def __repr__(self) -> str:
        return f"<FleetHost {self.name} {'up' if self.up else 'down'}>"

    def status(self) -> dict:
        return {"host": self.target, "up": self.up, "since": self.since,
                "reason": None if self.up else self.reason,
                "rejoin_error": None if self.up else (self.rejoin_error or None),
                "sandboxes": len(self.sandboxes)}

    def add(self, sandbox_id: str, job: str) -> None:
        if sandbox_id not in self.sandboxes:
            self.sandboxes[sandbox_id] = job
            self.jobs[job] += 1

    def forget(self, sandbox_id: str) -> None:
        job = self.sandboxes.pop(sandbox_id, None)
        if job is not None:
            self.jobs[job] -= 1

    def resync(self, rows: list[dict]) -> None:
        self.sandboxes = {}
        self.jobs = collections.Counter()
        for row in rows:
            if row.get("state") != "dead":
                self.add(row["id"], row.get("labels", {}).get("job", ""))

    def has_image(self, image: str) -> bool | None:
        """Whether the host's store holds the image (None: not known yet)."""
        return None if self.images is None else image in self.images

    def warmth(self, image: str) -> float:
        """The share (0-1) of the image's layer bytes held here: mounted
        layers whole, paged-in ones by their cached share."""
        layers = (self.images or {}).get(image)
        if not layers:
            return 0.0
        total = held = 0.0
        for d in layers:
            size = max(1, self.layer_sizes.get(d, 1))
            total += size
            held += size * (1.0 if d in self.mounted else self.cached.get(d, 0.0))
        return held / total

    def never_fits(self, shape: _Shape) -> str | None:
        """Why a sandbox of `shape` could not run here even on an empty host
        (more CPUs or memory than its `info` says it can ever give one, as
        the daemon's own check, cpu/admission.py never_fits), else None."""
        adm = (self.info or {}).get("cpu", {}).get("admission", {})
        cpu, mem = adm.get("cpu", {}), adm.get("memory", {})
        cpu_max = min((x for x in (cpu.get("cpus"), cpu.get("capacity")) if x), default=None)
        if cpu_max is not None and shape.cpu > cpu_max + 1e-9:
            return f"asks for {shape.cpu:g} CPUs, more than this host can ever give a sandbox ({cpu_max:g})"
        mem_max = min((x for x in (mem.get("mem_total"), mem.get("capacity")) if x), default=None)
        if mem_max is not None and shape.memory > mem_max:
            return (f"asks for {shape.memory >> 20} MiB of memory, more than this host can ever give a sandbox "
                    f"({mem_max >> 20} MiB)")
        return None

    def drained(self) -> bool:
        """Whether the host's last `info` says it is drained (op drain): it
        refuses every create until undrained, so none is sent there."""
        return bool(((self.info or {}).get("drain") or {}).get("drained"))

    def load_after(self, shape: _Shape) -> float | None:
        """The fullest resource's share once `shape` is added; None if it does not fit."""
        if self.info is None:
            return 0.0              # nothing known yet: its own answer will say (busy) if it is full
        adm = self.info.get("cpu", {}).get("admission", {})
        shares = []
        cpu, mem = adm.get("cpu", {}), adm.get("memory", {})
        idle = adm.get("idle_call_sandboxes") or {}     # a create drops them for its room
        if cpu.get("capacity"):
            shares.append((cpu.get("requested", 0) - idle.get("cpu", 0) + self.extra.cpu + shape.cpu)
                          / cpu["capacity"])
        if mem.get("capacity"):
            shares.append((mem.get("requested", 0) - idle.get("memory", 0) + self.extra.memory + shape.memory)
                          / mem["capacity"])
        slots = self.info.get("limits", {}).get("max_sandboxes")
        userns = self.info.get("userns") or {}
        if userns.get("enabled"):
            slots = min(slots or userns["slots"], userns["slots"])
        if slots:
            live = live_sandboxes(self.info) + call_sandboxes(self.info)
            queued = self.info.get("admission", {}).get("queued", 0)
            shares.append((live + queued + self.extra_n + 1) / slots)
        load = max(shares, default=0.0)
        return None if load > 1.0 else load

    def count(self, shape: _Shape, sign: int) -> None:
        """Add (sign 1) or take away (-1) a create's shape in the totals."""
        self.extra.cpu += sign * shape.cpu
        self.extra.memory += sign * shape.memory
        self.extra_n += sign


class Fleet:
    def __init__(self, hosts: list[str], *, ssh: remote.SshOptions | None = None,
                 heartbeat_s: float = HEARTBEAT_S, down_after_s: float = DOWN_AFTER_S,
                 rejoin_s: float = REJOIN_S, refresh_s: float = REFRESH_S,
                 connect_timeout: float = CONNECT_TIMEOUT_S,
                 on_event: Callable[[dict], object] | None = None, name: str = "dsecd-fleet",
                 client_factory: Callable[[str], Client] | None = None):
        """hosts: ssh://[user@]host[:port], bare host names (ssh://name) or
        socket paths. ssh: how to reach them (default: SshOptions.from_env()).
        on_event(event dict): host_down, sandbox_lost, host_up, sandbox_back,
        duplicate_removed, host_added (add_host), as they happen (on the fleet's event loop).
        client_factory(host): the transport, when it is not a Client over
        ssh or a socket: a Client subclass whose connect, request, abort_now,
        close, on_lost and last_frame_at keep the Client's meaning (dsecd.ray
        gives one that goes through a Ray actor); hosts are then taken as
        they are written."""
        if isinstance(hosts, str):
            # Iterated, a string is its characters: a fleet of hosts "h", "1", ...
            raise TypeError(f"Fleet takes a list of hosts, not a string: Fleet({hosts.split(',')!r})")
        if not hosts:
            raise ValueError("a Fleet needs at least one host")
        if any(inspect.iscoroutinefunction(f) for f in (on_event, type(on_event).__call__)):
            # Called, it would only make a coroutine nobody awaits: every event lost.
            raise TypeError("on_event is called as each event happens and must not be async; "
                            "iterate fleet.events() in a task of your own instead")
        # Each is a sleep or a timeout of a loop per host: at 0 (or below) a
        # host that is down would be tried again, by a new ssh, without pause,
        # and every host's info read again without pause.
        for name, value in (("heartbeat_s", heartbeat_s), ("down_after_s", down_after_s),
                            ("rejoin_s", rejoin_s), ("refresh_s", refresh_s), ("connect_timeout", connect_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        self.ssh = ssh or remote.SshOptions.from_env()
        self.heartbeat_s = heartbeat_s
        self.down_after_s = down_after_s
        self.rejoin_s = rejoin_s
        self.refresh_s = refresh_s
        self.connect_timeout = connect_timeout
        self.on_event = on_event
        self.name = name
        self.client_factory = client_factory
        self.hosts: dict[str, FleetHost] = {}
        for host in hosts:
            self._new_host(host)
        self._key_home: dict[str, str] = {}          # idempotency key -> the host holding its sandbox
        self._where: dict[str, str] = {}             # sandbox id -> host
        self._key_of: dict[str, str] = {}            # sandbox id -> its idempotency key
        self._tasks: list[asyncio.Task] = []
        self._subscribers: list[asyncio.Queue] = []
        self._started = False
        self._closing = False
        # What to do about a sandbox that may be on a host that is down (for
        # the SDK user; `dsec fleet` names its own).
        self.down_advice = "retry once that host is back (Fleet.status())"

    def _new_host(self, host: str) -> FleetHost:
        target = host if self.client_factory else fleet_target(host)
        if target in self.hosts:
            raise ValueError(f"host {host!r} is given twice")
        if self.client_factory is not None:
            client = self.client_factory(target)
        else:
            # reconnect=False: the fleet reconnects a host itself (rejoin),
            # so a request to a host that is down fails at once.
            client = Client(target, name=self.name, connect_timeout=self.connect_timeout, ssh=self.ssh,
                            reconnect=False)
        # The fleet, not the caller, connects a host again (its rejoin).
        client.lost_advice = (f"the fleet connects to {short_name(target)} again once it answers "
                              "(Fleet.status(); event host_up); retry then")
        h = self.hosts[target] = FleetHost(target, client)
        return h

    # ---------------------------------------------------------------- life

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect to every host at once; a host that cannot be reached starts
        down (its reason in status()) and is tried again every rejoin_s."""
        for host in self.hosts.values():
            host.client.on_lost = lambda why, host=host: self._host_down(host, f"connection lost: {why}")
        joined = await asyncio.gather(*(self._join(h) for h in self.hosts.values()), return_exceptions=True)
        for host, r in zip(self.hosts.values(), joined, strict=True):
            if isinstance(r, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                raise r
            if isinstance(r, BaseException):
                # A DsecError is the daemon's own answer: the link works.
                host.reason = (f"connected, but joining failed: {r}" if isinstance(r, DsecError)
                               else f"cannot connect: {r}")
        for host in self.hosts.values():
            self._tend(host)
        self._started = True

    def _tend(self, host: FleetHost) -> None:
        """The host's heartbeat (and rejoin) and refresh tasks."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._watch(host), name=f"fleet-watch-{host.name}"))
        self._tasks.append(loop.create_task(self._refresh_loop(host), name=f"fleet-refresh-{host.name}"))

    def add_host(self, host: str) -> FleetHost:
        """A host joining the fleet after it was made (written as in `hosts`).
        It starts down and is connected by its own task, as a host that
        could not be reached at start is: `host_added` now, `host_up` once
        it answered; placement takes it from then on."""
        self._check_open(f"add_host({host!r})")
        h = self._new_host(host)
        h.client.on_lost = lambda why, h=h: self._host_down(h, f"connection lost: {why}")
        self._emit("host_added", h)
        if self._started:
            self._tend(h)
        return h

    async def close(self) -> None:
        self._closing = True
        pending = set(self._tasks)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        self._tasks.clear()
        await asyncio.gather(*(h.client.close() for h in self.hosts.values()), return_exceptions=True)
        for q in self._subscribers:
            q.put_nowait(None)

    def _check_open(self, what: str) -> None:
        """A closed fleet's hosts still read as up, and their clients answer
        ConnectionLost: a create would be `busy`, a list empty. Say it instead."""
        if self._closing:
            raise RuntimeError(f"{what}: the fleet is closed")

    def status(self) -> list[dict]:
        """Each host: up, since when (unix time), why it is down, sandboxes known."""
        return [h.status() for h in self.hosts.values()]

    def up_hosts(self) -> list[FleetHost]:
        return [h for h in self.hosts.values() if h.up]

    # ---------------------------------------------------------------- events

    def _emit(self, event: str, host: FleetHost, **detail) -> None:
        ev = {"event": event, "host": host.target, "time": time.time(), **detail}
        (log.debug if "sandbox" in detail else log.info)(
            "fleet: %s %s %s", event, host.name, detail.get("reason") or detail.get("sandbox") or "")
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:
                log.exception("fleet: on_event raised for %s", ev)
        for q in self._subscribers:
            q.put_nowait(ev)

    def events(self) -> FleetEvents:
        """The fleet's events (host_down, sandbox_lost, host_up, sandbox_back,
        duplicate_removed, host_added) from this call on, until aclose(), the
        loop stops or the fleet closes."""
        return FleetEvents(self._subscribers)

    # ---------------------------------------------------------------- health

    def _host_down(self, host: FleetHost, reason: str) -> None:
        if not host.up or self._closing:
            return
        host.up = False
        host.since = time.time()
        host.reason = reason
        lost = sorted(host.sandboxes)
        host.reported_lost = set(lost)
        self._emit("host_down", host, reason=reason, sandboxes=lost)
        for sb in lost:
            self._emit("sandbox_lost", host, sandbox=sb)
        # Requests in flight on it fail now (ConnectionLost), not when TCP gives
        # up; the client is not connected from here on, so a rejoin connects anew.
        host.client.abort_now(f"{host.name} marked down: {reason}")

    async def _join(self, host: FleetHost) -> None:
        """Connect (again), learn what the host holds, settle uncertain keys, mark it up."""
        await host.client.connect()
        try:
            rows = await host.client.list()
            await self._settle_keys(host, rows)
            host.resync([r for r in rows if not r.get("_removed")])
            await self._refresh(host)
        except BaseException:
            await host.client.abort("joining failed")
            raise
        # Those it no longer runs went while it was away (their TTL, another
        # client): forgotten with their keys, as _prune does, or a key would
        # keep naming this host as its sandbox's.
        present = {r["id"] for r in rows if not r.get("_removed")}
        for sb_id in [s for s, t in self._where.items() if t == host.target and s not in present]:
            self._forget(sb_id, destroyed=True)
        for sb_id in host.sandboxes:
            self._where[sb_id] = host.target
        for row in rows:
            if row.get("key") and not row.get("_removed"):
                self._key_of[row["id"]] = row["key"]
                # A key made before this fleet (by a driver since restarted, or
                # another client): a create sent again with it goes back here,
                # where the daemon answers with its sandbox, not to a host that
                # would make a second one.
                self._key_home.setdefault(row["key"], host.target)
        back = sorted(host.reported_lost & set(host.sandboxes))
        gone = sorted(host.reported_lost - set(host.sandboxes))
        host.reported_lost = set()
        host.up = True
        host.joined = True
        host.since = time.time()
        host.reason = ""
        host.last_answer = asyncio.get_running_loop().time()
        host.busy_until = 0.0
        self._emit("host_up", host, sandboxes=sorted(host.sandboxes), back=back, gone=gone)
        for sb_id in back:
            self._emit("sandbox_back", host, sandbox=sb_id)

    async def _settle_keys(self, host: FleetHost, rows: list[dict]) -> None:
        """Sandboxes on a rejoining host from creates whose answer was lost:
        a duplicate of one made elsewhere is destroyed; one whose key has no
        other home is kept as the key's sandbox."""
        for row in rows:
            key = row.get("key")
            if not key or key not in host.uncertain_keys:
                continue
            home = self._key_home.get(key)
            if home is None or home == host.target:
                self._key_home[key] = host.target
                continue
            try:
                await host.client.request("destroy", sandbox=row["id"], force=True)
                row["_removed"] = True
                self._emit("duplicate_removed", host, sandbox=row["id"], key=key, kept_on=home)
            except NotFound:
                row["_removed"] = True
        host.uncertain_keys.clear()

    async def _watch(self, host: FleetHost) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            if not host.up:
                try:
                    await self._join(host)
                except (ConnectionError, DsecError, OSError, TimeoutError) as err:
                    host.rejoin_error = str(err)
                    log.debug("fleet: %s still down: %s", host.name, err)
                    await asyncio.sleep(self.rejoin_s)
                continue
            started = loop.time()
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can
                # swallow a cancel that comes as the ping is answered, and the
                # fleet's close would wait for this loop forever.
                async with asyncio.timeout(self.heartbeat_s):
                    await host.client.request("ping")
                host.last_answer = loop.time()
            except TimeoutError:
                pass
            except (ConnectionError, DsecError) as err:
                self._host_down(host, f"heartbeat failed: {err}")
                continue
            silent = loop.time() - max(host.last_answer, host.client.last_frame_at)
            if silent >= self.down_after_s:
                self._host_down(host, f"no answer for {silent:.1f} s (down_after_s = {self.down_after_s:g})")
                continue
            await asyncio.sleep(max(0.0, self.heartbeat_s - (loop.time() - started)))

    async def _refresh_loop(self, host: FleetHost) -> None:
        while not self._closing:
            await asyncio.sleep(self.refresh_s)
            if host.up:
                with contextlib.suppress(ConnectionError, DsecError, TimeoutError):
                    await self._refresh(host)

    async def _refresh(self, host: FleetHost) -> None:
        """Read the host's capacity (info) and images again; forget the
        sandboxes it no longer runs."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        info, images, du = await asyncio.gather(host.client.info(), host.client.list_images(),
                                                _image_du(host.client))
        live = live_sandboxes(info)
        # Fewer live than counted: some went. Equal counts can hide a gone
        # one behind another client's new one, so list every PRUNE_S anyway.
        if len(host.sandboxes) > live or loop.time() - host.pruned_at >= PRUNE_S:
            await self._prune(host)
        host.info = info
        host.images = {i["name"]: [layer["digest"] for layer in i.get("layers", [])] for i in images}
        host.layer_sizes = {layer["digest"]: layer.get("size", 1) for i in images for layer in i.get("layers", [])}
        host.mounted = set(du.get("mounted_layers", {}))
        host.cached = du.get("cached_layers") or {}          # daemons before it sent none
        # Creates answered before the info was asked are in its figures now.
        while host.done and host.done[0][0] < asked:
            host.count(host.done.popleft()[1], -1)

    # ---------------------------------------------------------------- placement

    def _place(self, image: str, job: str, shape: _Shape, skip: dict[str, str],
               lasting: dict[str, str] | None = None) -> FleetHost | None:
        """The best up host not in `skip`; the hosts passed over go into
        `skip` (host -> why), and into `lasting` (host -> error code, or NO_IMAGE) those
        that can never take this create (see _no_host)."""
        lasting = {} if lasting is None else lasting
        now = asyncio.get_running_loop().time()
        candidates = [h for h in self.up_hosts() if h.target not in skip]
        for h in candidates:
            if h.busy_until > now:
                skip[h.target] = "answered busy moments ago"
            elif (why := h.never_fits(shape)) is not None:
                skip[h.target] = why
                lasting[h.target] = BadRequest.code
            elif h.drained():
                skip[h.target] = "drained (dsec drain)"
        candidates = [h for h in candidates if h.target not in skip]
        holding = [h for h in candidates if h.has_image(image) is not False]
        # A host whose image list lacks it may have it after all (the list is
        # stale): such hosts are tried once none that lists it is left, and
        # count as lacking it only when they answer so.
        candidates = holding or candidates
        best: tuple | None = None
        for h in candidates:
            load = h.load_after(shape)
            if load is None:
                skip[h.target] = "full by its last info"
                continue
            spread = h.jobs[job] + h.pending_jobs[job] if job else 0
            key = (spread, int(load / LOAD_STEP), -int(h.warmth(image) * 10), random.random())
            if best is None or key < best[0]:
                best = (key, h)
        return None if best is None else best[1]

    async def create(self, image: str, *, key: str | None = None, labels: dict | None = None,
                     cpu: float | None = None, memory: int | str | None = None, **create_args) -> FleetSandbox:
        """Client.create on the best host (see the module's docstring); the
        sandbox's `host` says where. When no host takes it: `busy` (with
        detail.hosts: each host's reason) if some host is full, busy or
        down; `not_found` (no host has the image) or `bad_request` (more than
        any host can ever give a sandbox) if every host refused for good."""
        self._check_open(f"create {image!r}")
        if key is not None and key not in self._key_home:
            self._check_key_unknown_everywhere(key)
        key = key or f"fleet-{secrets.token_hex(10)}"
        labels = dict(labels or {})
        job = labels.get("job", "")
        # Read here to place it: a value that does not read is the request's
        # error, as a host's own create would answer it, not a ValueError.
        try:
            shape = _Shape(DEFAULT_CPU if cpu is None else float(cpu), DEFAULT_MEMORY)
        except (TypeError, ValueError) as err:
            raise BadRequest(f"create: cpu {cpu!r} is not a number of CPUs ({err})", {"cpu": cpu}) from None
        try:
            shape.memory = DEFAULT_MEMORY if memory is None else parse_size(memory)
        except (TypeError, ValueError) as err:
            raise BadRequest(f"create: memory: {err}", {"memory": memory}) from None
        skip: dict[str, str] = {}
        lasting: dict[str, str] = {}       # hosts that can never take it: host -> error code or NO_IMAGE
        while True:
            home = self.hosts.get(self._key_home.get(key, ""))
            if home is not None and not home.up:
                # Another sandbox elsewhere would be a second one for the key.
                raise ConnectionLost(f"create with key {key!r}: its sandbox is on {home.name}, which is down "
                                     f"({home.reason}); it is answered again once the host rejoins",
                                     target=home.target, op="create", sent=False)
            if home is not None and home.target not in skip:
                host = home                  # the key's sandbox is there: the same answer again
            else:
                host = self._place(image, job, shape, skip, lasting)
            if host is None:
                raise self._no_host(image, skip, lasting)
            host.count(shape, 1)
            host.pending_jobs[job] += 1
            try:
                sb = await host.client.create(image, key=key, labels=labels, cpu=cpu, memory=memory, **create_args)
            except Busy as err:
                retry = err.detail.get("retry_after_s") or BUSY_BACKOFF_S
                host.busy_until = asyncio.get_running_loop().time() + min(BUSY_BACKOFF_S, float(retry))
                skip[host.target] = f"busy: {err.message}"
                continue
            except NotFound as err:
                self._not_there(host, image, err, skip, lasting)
                continue
            except BadRequest as err:
                if not err.detail.get("resource"):
                    raise                       # the request itself is wrong: every host would say so
                # More than this host can ever give (cpu/admission.py never_fits): a larger one may take it.
                skip[host.target] = f"bad_request: {err.message}"
                lasting[host.target] = err.code
                continue
            except ConnectionLost as err:
                if err.sent:
                    host.uncertain_keys.add(key)
                skip[host.target] = f"connection lost: {err}"
                continue
            except ConnectionError as err:              # down between the choice and the send
                skip[host.target] = str(err)
                continue
            finally:
                host.count(shape, -1)
                host.pending_jobs[job] -= 1
            host.done.append((asyncio.get_running_loop().time(), shape))
            host.count(shape, 1)
            host.add(sb.id, job)
            self._key_home[key] = host.target
            self._where[sb.id] = host.target
            self._key_of[sb.id] = key
            return FleetSandbox(self, sb)

    def sandbox(self, image: str, **create_args) -> _SandboxContext:
        """`async with fleet.sandbox(image=...) as sb:` creates a sandbox on
        the best host (create's arguments) and destroys it on the way out,
        killing its execs, as Client.sandbox does."""
        return _SandboxContext(self, image, create_args)

    def _not_there(self, host: FleetHost, image: str, err: NotFound, skip: dict[str, str],
                   lasting: dict[str, str]) -> None:
        """A host's not_found to a create or call: it is passed over for good.
        The daemon's not_found of a missing image names nothing else; one
        naming a policy (say) is about that, which another host may have."""
        if set(err.detail) <= {"image"}:
            if host.images is not None:
                host.images.pop(image, None)
            lasting[host.target] = NO_IMAGE
        else:
            lasting[host.target] = err.code
        skip[host.target] = f"not_found: {err.message}"

    def _check_key_unknown_everywhere(self, key: str) -> None:
        """A caller's key this fleet has not seen may be that of a sandbox on
        a host that has not answered since the fleet started (a driver
        restarted while it was down): placed elsewhere, the create would
        make a second sandbox for the key. HostsDown until every host has
        answered once."""
        unknown = {h.target: h.reason for h in self.hosts.values() if not h.joined}
        if unknown:
            raise HostsDown(f"create with key {key!r}: the key's sandbox may be on a host that has not answered "
                            f"since this fleet started ({'; '.join(f'{short_name(t)}: {why}' for t, why in unknown.items())}), "
                            f"and a create placed elsewhere would make a second one; {self.down_advice}",
                            {"key": key, "down": unknown})

    def _no_host(self, image: str, skip: dict[str, str], lasting: dict[str, str] | None = None,
                 what: str = "create") -> DsecError:
        """Why no host took a create (or call): `busy` while some host may
        take it later (full, busy, down); when every host refused it for
        good (`lasting`: no such image there, more than it can ever give),
        that error instead, since retrying cannot help."""
        lasting = lasting or {}
        down = {h.target: f"down: {h.reason}" for h in self.hosts.values() if not h.up}
        reasons = {**down, **skip}
        text = "; ".join(f"{short_name(t)}: {why}" for t, why in reasons.items())
        if not self.up_hosts():
            return Busy(f"{what} {image!r}: no host of the fleet is up ({text})", {"hosts": reasons})
        if reasons and set(reasons) <= set(lasting):
            if all(code == NO_IMAGE for code in lasting.values()):
                return NotFound(f"{what} {image!r}: no host of the fleet has the image ({text})",
                                {"image": image, "hosts": reasons})
            if all(code in (NO_IMAGE, NotFound.code) for code in lasting.values()):
                return NotFound(f"{what} {image!r}: no host of the fleet can take it as asked ({text})",
                                {"image": image, "hosts": reasons})
            return BadRequest(f"{what} {image!r}: no host of the fleet can ever take it as asked ({text}); "
                              "ask for less, or add a host that has the image and is large enough",
                              {"image": image, "hosts": reasons})
        return Busy(f"{what} {image!r}: no host took it ({text}); retry later or add hosts",
                    {"hosts": reasons, "retry_after_s": BUSY_BACKOFF_S})

    # ---------------------------------------------------------------- one sandbox

    async def get(self, sandbox_id: str) -> FleetSandbox:
        """A sandbox by id (or unique prefix) on whichever host holds it.
        `not_found` if no host has it; errors.HostsDown (a ConnectionError)
        if no up host has it while some host is down."""
        self._check_open(f"get {sandbox_id!r}")
        target = self._where.get(sandbox_id)
        if target is not None and self.hosts[target].up:
            with contextlib.suppress(NotFound):
                return FleetSandbox(self, await self.hosts[target].client.get(sandbox_id))
        found = await self._each(lambda h: h.client.get(sandbox_id))
        hits = [(t, r) for t, r in found.items() if not isinstance(r, BaseException)]
        if len(hits) > 1:
            raise BadRequest(f"{sandbox_id!r} names sandboxes on {', '.join(short_name(t) for t, _ in hits)}: "
                             "give more of the id")
        if hits:
            self._where[hits[0][1].id] = hits[0][0]
            return FleetSandbox(self, hits[0][1])
        for r in found.values():
            if isinstance(r, DsecError) and not isinstance(r, NotFound):
                raise r                 # a host's own answer about the id (a prefix it finds ambiguous)
        # Hosts that could not answer may hold it as much as those that are down.
        down = {**self._down(), **{t: f"did not answer: {r}" for t, r in found.items()
                                   if isinstance(r, ConnectionError)}}
        if down:
            # Not found where we could look; it may be on a host that is down.
            raise HostsDown(f"no sandbox {sandbox_id!r} on any host that is up, and it may be on one that is down "
                            f"({'; '.join(f'{short_name(t)}: {why}' for t, why in down.items())}); "
                            f"{self.down_advice}",
                            {"sandbox": sandbox_id, "down": down})
        raise NotFound(f"no sandbox {sandbox_id!r} on any host of the fleet", {"sandbox": sandbox_id})

    # ---------------------------------------------------------------- every host

    async def _each(self, fn: Callable[[FleetHost], Awaitable]) -> dict[str, object]:
        """fn on every host that is up, at once: host -> result or exception."""
        self._check_open("a request to every host")
        up = self.up_hosts()
        results = await asyncio.gather(*(fn(h) for h in up), return_exceptions=True)
        for r in results:
            if isinstance(r, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                raise r
        return dict(zip((h.target for h in up), results, strict=True))

    def _down(self) -> dict[str, str]:
        return {h.target: h.reason for h in self.hosts.values() if not h.up}

    async def list(self, labels: dict | None = None, errors: dict[str, BaseException] | None = None) -> list[dict]:
        """Every up host's sandboxes, each with `host`. Hosts that failed to
        answer are skipped: `errors`, if given, gets host -> what it raised
        (the hosts that are down: `status()`)."""
        found = await self._each(lambda h: h.client.list(labels))
        out = []
        for target, rows in found.items():
            if isinstance(rows, BaseException):
                if errors is not None:
                    errors[target] = rows
                continue
            if not labels:
                self.hosts[target].resync(rows)
            for row in rows:
                self._where[row["id"]] = target
                out.append({**row, "host": target})
        return out

    async def top(self, labels: dict | None = None) -> dict:
        """{"hosts": {host: its top's host figures}, "sandboxes": [... each with host], "down": {host: why}}"""
        found = await self._each(lambda h: h.client.top(labels))
        out = {"hosts": {}, "sandboxes": [], "down": self._down(), "errors": {}}
        for target, top in found.items():
            if isinstance(top, BaseException):
                out["errors"][target] = str(top)
                continue
            out["hosts"][target] = {**(top.get("host") or {}), "sampled_at": top.get("sampled_at")}
            out["sandboxes"] += [{**s, "host": target} for s in top.get("sandboxes", [])]
        return out

    async def info(self) -> dict[str, dict]:
        """Every host's info (up ones asked now), or {"up": False, "reason": ...}."""
        found = await self._each(lambda h: h.client.info())
        out = {}
        for target, host in self.hosts.items():
            r = found.get(target)
            if r is None or isinstance(r, BaseException):
                out[target] = {"up": False, "reason": host.reason if r is None else str(r)}
            else:
                host.info = r
                out[target] = {"up": True, **r}
        return out

    async def _job_verb(self, verb: str, job: str, done_key: str, **args) -> dict:
        found = await self._each(lambda h: getattr(h.client, verb)(job, **args))
        done: list[str] = []
        failed: dict[str, str] = {}
        hosts: dict[str, str] = {}
        for target, r in found.items():
            if isinstance(r, NotFound):
                hosts[target] = "none there"
            elif isinstance(r, BaseException):
                hosts[target] = f"failed: {r}"
            else:
                hosts[target] = "ok"
                done += r.get(done_key, [])
                f = r.get("failed") or {}
                failed.update(f if isinstance(f, dict) else {sb: "failed" for sb in f})
                if verb == "job_rm":
                    for sb in r.get(done_key, []):
                        self._forget(sb, destroyed=True)
        if not done and not failed and all(v == "none there" for v in hosts.values()) and not self._down():
            raise NotFound(f"no sandbox has the label job={job} on any host", {"job": job})
        return {"job": job, done_key: done, "failed": failed, "hosts": hosts, "down": self._down()}

    async def job_pause(self, job: str) -> dict:
        """Pause the job's sandboxes on every host at once: paused, failed, hosts (each one's outcome), down."""
        return await self._job_verb("job_pause", job, "paused")

    async def job_resume(self, job: str) -> dict:
        return await self._job_verb("job_resume", job, "resumed")

    async def job_rm(self, job: str, force: bool = False) -> dict:
        return await self._job_verb("job_rm", job, "destroyed", force=force)

    async def destroy_all(self, force: bool = False, labels: dict | None = None) -> dict:
        found = await self._each(lambda h: h.client.destroy_all(force, labels))
        out = {"destroyed": [], "failed": {}, "hosts": {}, "down": self._down()}
        for target, r in found.items():
            if isinstance(r, BaseException):
                out["hosts"][target] = f"failed: {r}"
                continue
            out["hosts"][target] = "ok"
            out["destroyed"] += r["destroyed"]
            out["failed"].update(r["failed"])
            for sb in r["destroyed"]:
                self._forget(sb, destroyed=True)
        return out

    async def list_images(self, errors: dict[str, BaseException] | None = None) -> list[dict]:
        """Every up host's images, each with `host`; `errors` as for list()."""
        found = await self._each(lambda h: h.client.list_images())
        if errors is not None:
            errors.update({t: r for t, r in found.items() if isinstance(r, BaseException)})
        return [{**img, "host": t} for t, imgs in found.items() if not isinstance(imgs, BaseException)
                for img in imgs]

    async def each_host(self, fn: Callable[[Client], Awaitable]) -> dict[str, object]:
        """fn(client) on every host that is up, at once (image builds, pools):
        host -> result or the exception it raised."""
        return await self._each(lambda h: fn(h.client))

    async def call(self, image: str, **call_args):
        """Client.call on the least loaded up host holding the image; on
        `busy`, or not_found there, the next. When none takes it, the error
        is as create's (_no_host)."""
        self._check_open(f"call {image!r}")
        skip: dict[str, str] = {}
        lasting: dict[str, str] = {}
        while (host := self._place(image, "", _Shape(0.0, 0), skip, lasting)) is not None:
            try:
                return await host.client.call(image, **call_args)
            except NotFound as err:
                self._not_there(host, image, err, skip, lasting)
            except (Busy, ConnectionError) as err:
                skip[host.target] = str(err)
        raise self._no_host(image, skip, lasting, "call")

    async def _prune(self, host: FleetHost) -> None:
        """The host runs fewer sandboxes than the fleet counts there: some
        were destroyed by their TTL, their lease or another client, or died.
        Those gone are forgotten with their keys (as the daemon freed them),
        dead ones no longer count for placement. Only sandboxes known before
        the listing are looked at: one a create answered meanwhile stays."""
        known = set(host.sandboxes)
        host.pruned_at = asyncio.get_running_loop().time()
        rows = {r["id"]: r for r in await host.client.list() if not r.get("_removed")}
        for sb_id in known:
            row = rows.get(sb_id)
            if row is None and self._where.get(sb_id) == host.target:
                self._forget(sb_id, destroyed=True)
            elif row is None or row.get("state") == "dead":
                host.forget(sb_id)

    def _forget(self, sandbox_id: str, destroyed: bool = False) -> None:
        """Stop counting a sandbox; `destroyed`: its host said it is gone."""
        target = self._where.pop(sandbox_id, None)
        if target is not None:
            self.hosts[target].forget(sandbox_id)
        key = self._key_of.pop(sandbox_id, None) if destroyed else self._key_of.get(sandbox_id)
        # The daemon frees a key with its sandbox, and so does the fleet: a
        # create with it again is placed anew, and a fleet making sandboxes
        # for days does not hold every key it ever used. Kept while a host
        # may hold a copy from a create whose answer was lost: its rejoin
        # destroys that copy by the key's home (_settle_keys).
        if (destroyed and key is not None and self._key_home.get(key) == target
                and not any(key in h.uncertain_keys for h in self.hosts.values())):
            del self._key_home[key]


async def _image_du(client) -> dict:
    """The host's image_du; {} from a daemon older than the op (a fleet
    mid-upgrade): its warmth is then unknown, and the host still joins."""
    try:
        return await client.image_du()
    except BadRequest as err:
        if "image_du" in err.detail.get("ops", ["image_du"]):
            raise
        return {}


class FleetEvents:
    """Fleet.events(): an async iterator subscribed when made, so that an
    event between the call and the first next() is kept, not missed (an
    async generator would subscribe only once first iterated)."""

    def __init__(self, subscribers: list[asyncio.Queue]):
        self._subscribers = subscribers
        self._queue: asyncio.Queue | None = asyncio.Queue()
        subscribers.append(self._queue)

    def __aiter__(self) -> FleetEvents:
        return self

    async def __anext__(self) -> dict:
        if self._queue is None:
            raise StopAsyncIteration
        ev = await self._queue.get()
        if ev is None:                      # the fleet closed
            self._unsubscribe()
            raise StopAsyncIteration
        return ev

    async def aclose(self) -> None:
        self._unsubscribe()

    def _unsubscribe(self) -> None:
        q, self._queue = self._queue, None
        if q is not None:
            with contextlib.suppress(ValueError):
                self._subscribers.remove(q)

    def __del__(self) -> None:
        self._unsubscribe()                 # dropped unclosed: its queue must not grow on


class FleetSandbox(Sandbox):
    """A Sandbox of its host's Client (every request goes straight there)
    whose destroy also tells the fleet."""

    def __init__(self, fleet: Fleet, sb: Sandbox):
        super().__init__(sb.client, sb.id, sb.info)
        self.fleet = fleet

    async def destroy(self, force: bool = False) -> dict:
        try:
            r = await super().destroy(force)
        except BaseException:
            self.fleet._forget(self.id)
            raise
        self.fleet._forget(self.id, destroyed=True)
        return r
