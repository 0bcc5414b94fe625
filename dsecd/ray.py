"""dsecd.ray: the dsec hosts of a Ray cluster driven as one dsecd.Fleet.

    import ray, dsecd.ray
    ray.init(address="auto")
    async with dsecd.ray.RayFleet() as fleet:        # every node with a "dsec" resource
        sb = await fleet.create(image="busybox", labels={"job": "j7"})
        await sb.exec("echo hi")
        await fleet.job_pause("j7")

A dsec host is a Ray node that advertises the custom resource `dsec`
(`ray start ... --resources '{"dsec": 1}'`) and runs dsecd. The fleet
reaches each host's daemon through a small actor pinned to that node
(NodeAffinitySchedulingStrategy, soft=False), which holds a Client on the
daemon's unix socket and passes requests to it. The driver's side of that
actor is ActorClient: a Client whose requests go to the actor instead of a
socket, so dsecd.Fleet (placement, job verbs, list/info, failure handling)
and Sandbox (exec, files, pause, resume, destroy) run unchanged on top.

Liveness is Ray's as well as the fleet's: a request to an actor that died
(its node or its worker gone, or ray.kill) raises RayActorError, which marks
the host down at once (host_down, a sandbox_lost per sandbox), as a dropped
ssh connection does; the fleet's heartbeat (a ping through the actor) still
catches a daemon that stops answering. The fleet then tries every rejoin_s
to start a new actor on the same node; once it answers, the host is up again
(host_up, sandbox_back for the sandboxes that survived).

What the actor carries: every request/answer op. A streamed op (exec_stream,
run_stream, events with follow=False) is carried whole: its frames come
back together when it ends, not as they are made. Ops that feed a running
request (exec with stdin or a pty, upload_tar) or never end (events that
follow, watch) fail with `unsupported`: use a Client over ssh:// for those.

A host is a daemon socket on a machine, named ray://<node address><socket>.
The hosts are those found when the fleet is made; a machine that joins the
cluster later is not added. A node that Ray declares dead and that comes
back (a raylet restarted has a new node id) rejoins: the actor goes on any
alive dsec node at the host's address.

Ray is an optional dependency (`pip install dsecd[ray]`): it is imported
when this module is, and nothing else in dsecd imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .client import Client, default_socket
from .errors import ConnectionLost, DsecError, Unsupported
from .fleet import CONNECT_TIMEOUT_S, Fleet

RESOURCE = "dsec"          # the custom resource a Ray node advertises to be a dsec host
SCHEME = "ray://"


class DaemonActor:
    """Runs on a dsec host (one Ray actor per host and fleet): a Client on
    the local daemon's socket. Answers are plain dicts ({"result": ...},
    {"error": wire error} or {"lost": why}) so that nothing but builtins
    crosses Ray's serialization."""

    def __init__(self, socket: str, name: str):
        self.client = Client(socket, name=name, reconnect=True)

    async def hello(self) -> dict:
        try:
            await self.client.connect()
        except (ConnectionError, OSError) as err:
            return {"lost": f"node {ray.get_runtime_context().get_node_id()}: {err}"}
        return {"result": self.client.server}

    async def request(self, op: str, args: dict) -> dict:
        try:
            return {"result": await self.client.request(op, **args)}
        except DsecError as err:
            return {"error": err.to_wire()}
        except (ConnectionError, OSError) as err:
            return {"lost": str(err)}

    async def frames(self, op: str, args: dict) -> dict:
        """A streamed op to its end: every frame, the final result last."""
        out = []
        try:
            async with contextlib.aclosing(self.client.frames(op, **args)) as frames:
                async for frame in frames:
                    out.append(frame)
        except DsecError as err:
            return {"error": err.to_wire(), "frames": out}
        except (ConnectionError, OSError) as err:
            return {"lost": str(err)}
        return {"result": out}


def host_target(address: str, socket: str) -> str:
    """The fleet's name of the daemon at `socket` on the machine whose Ray
    node(s) have the address `address` (a node's NodeManagerAddress)."""
    return f"{SCHEME}{address}{socket}"


def parse_target(target: str) -> tuple[str, str]:
    """(node address, socket path) of a host_target."""
    if not target.startswith(SCHEME) or "/" not in target[len(SCHEME):]:
        raise ValueError(f"{target!r} is not a Ray dsec host ({SCHEME}<node address><socket path>)")
    address, slash, path = target[len(SCHEME):].partition("/")
    return address, slash + path


def dsec_nodes() -> list[dict]:
    """The alive Ray nodes advertising the dsec resource (ray.nodes() rows)."""
    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(RESOURCE)]


class ActorClient(Client):
    """A Client whose requests go through a DaemonActor on a Ray node of
    the host's machine, which passes them to the daemon at the target's
    socket there. Made by RayFleet; a Fleet uses it as it uses a Client
    (connect, request, abort_now, close, on_lost, last_frame_at).

    The actor goes on node `node_id` while Ray has it alive; once Ray
    declares it dead (a raylet restarted comes back with a new node id),
    on any alive dsec node with the same address: the socket is a path on
    that machine, so any raylet there reaches it."""

    def __init__(self, target: str, node_id: str = "", name: str = "dsecd-ray",
                 connect_timeout: float = CONNECT_TIMEOUT_S):
        address, socket = parse_target(target)
        super().__init__(socket, name=name, connect_timeout=connect_timeout, reconnect=False)
        self.target = target
        self.address = address
        self.node_id = node_id
        self._actor = None
        self._lost: str | None = "not connected yet"
        self._aborted = asyncio.Event()

    def __repr__(self) -> str:
        return f"<ActorClient {self.target}>"

    @property
    def connected(self) -> bool:
        return self._actor is not None and self._lost is None

    @property
    def _tails(self) -> bool:
        return False            # answers are copied through Ray: whole bytes, not frame views

    async def connect(self) -> None:
        """Start the actor on the node (again, after a loss) and say hello to the daemon through it."""
        if self.connected:
            return
        self._closed = False
        self._kill_actor()
        self.node_id = await asyncio.to_thread(self._pick_node)
        self._actor = _daemon_actor().options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
        ).remote(self.socket_path, self.name)
        self._aborted = asyncio.Event()
        try:
            async with asyncio.timeout(self.connect_timeout):
                answer = await self._actor.hello.remote()
        except TimeoutError:
            self._kill_actor()
            raise ConnectionError(f"{self.target}: the actor on node {self.node_id} did not answer in "
                                  f"{self.connect_timeout:g} s: is the node alive (ray status)?") from None
        except RayError as err:
            self._kill_actor()
            raise ConnectionError(f"{self.target}: cannot start the actor on node {self.node_id}: "
                                  f"{_first_line(err)}") from None
        if "lost" in answer:
            self._kill_actor()
            raise ConnectionError(f"{self.target}: the actor started, but reaches no daemon: {answer['lost']}")
        self.server = answer["result"]
        self.max_frame = self.server.get("limits", {}).get("max_frame_bytes", self.max_frame)
        self._lost = None
        self.last_frame_at = asyncio.get_running_loop().time()

    def _pick_node(self) -> str:
        nodes = dsec_nodes()
        if any(n["NodeID"] == self.node_id for n in nodes):
            return self.node_id
        here = [n["NodeID"] for n in nodes if n.get("NodeManagerAddress") == self.address]
        if not here:
            raise ConnectionError(f"{self.target}: no alive Ray node at {self.address} advertises the "
                                  f"{RESOURCE!r} resource (ray status); the host rejoins once one does")
        return here[0]

    def _kill_actor(self) -> None:
        actor, self._actor = self._actor, None
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    async def close(self) -> None:
        self._closed = True
        self._lost = "closed"
        self._aborted.set()
        self._kill_actor()

    def abort_now(self, reason: str) -> None:
        """End it now: the requests in flight fail with ConnectionLost(reason)
        and the actor is killed (a hung one must not hold the node's worker)."""
        if self._lost is not None:
            return None
        self._lost = reason
        self._aborted.set()
        self._kill_actor()
        return None

    async def abort(self, reason: str) -> None:
        self.abort_now(reason)

    def _lost_now(self, why: str, op: str, sent: bool) -> ConnectionLost:
        """The actor is gone: mark this client lost (telling the fleet once) and say so."""
        if self._lost is None:
            self._lost = why
            self._aborted.set()
            if self.on_lost is not None and not self._closed:
                with contextlib.suppress(Exception):
                    self.on_lost(why)
        text = f"{op} on {self.target}: {why}"
        if sent:
            text += "; the request may have been carried out (a create with an idempotency key can be sent again safely)"
        return ConnectionLost(text, target=self.target, op=op, sent=sent)

    async def _call(self, method: str, op: str, args: dict) -> dict:
        if self._actor is None or self._lost is not None:
            raise ConnectionLost(f"{op} on {self.target}: not connected ({self._lost or 'no actor'})",
                                 target=self.target, op=op, sent=False)
        # Ray pickles the arguments: memoryviews (file chunks) go as bytes.
        args = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in args.items()}
        ref = getattr(self._actor, method).remote(op, args)
        aborted = asyncio.ensure_future(self._aborted.wait())
        answer_f = asyncio.ensure_future(_await(ref))
        try:
            await asyncio.wait([answer_f, aborted], return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            if not answer_f.done():
                answer_f.cancel()
        if not answer_f.done() or answer_f.cancelled():
            raise self._lost_now(self._lost or "aborted", op, sent=True)
        try:
            answer = answer_f.result()
        except RayError as err:          # RayActorError above all: the actor, its worker or its node died
            raise self._lost_now(f"the actor on node {self.node_id} failed: {_first_line(err)}", op,
                                 sent=True) from None
        self.last_frame_at = asyncio.get_running_loop().time()
        if "lost" in answer:
            # The actor lives but its daemon connection dropped: the host is down as far as the fleet goes.
            raise self._lost_now(f"the daemon's socket on node {self.node_id}: {answer['lost']}", op, sent=True)
        if "error" in answer:
            raise DsecError.from_wire(answer["error"])
        return answer["result"]

    async def request(self, op: str, **args) -> dict:
        return await self._call("request", op, args)

    async def frames_with_id(self, rid: int, op: str, args: dict,
                             sent: asyncio.Event | None = None) -> AsyncIterator[dict]:
        if op == "watch" or (op == "events" and args.get("follow", True)) or args.get("stdin") \
                or args.get("pty") or op == "upload_tar":
            raise Unsupported(f"{op} on {self.target}: a stream that is fed or never ends is not carried "
                              "through a Ray actor (dsecd.ray); use a Client over ssh:// for it")
        if sent is not None:
            sent.set()
        for frame in await self._call("frames", op, args):
            yield frame


@functools.cache
def _daemon_actor():
    """DaemonActor as a Ray actor class: no CPU of the node's (it only relays
    to the daemon), and no restart by Ray: a death must reach the fleet,
    which starts the next actor itself when the host rejoins."""
    return ray.remote(num_cpus=0, max_restarts=0)(DaemonActor)


async def _await(ref):
    return await ref


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def discover(sockets: dict[str, str | list[str]] | None = None, socket: str | None = None) -> dict[str, str]:
    """The fleet's hosts, {target: node id}: for every alive Ray node with a
    `dsec` resource, the daemon socket(s) `sockets[node id]` names, else
    `socket` (default DSEC_SOCKET or /run/dsecd/dsecd.sock). A socket named
    by two nodes of one machine is one host. ray.init() must have run."""
    if not ray.is_initialized():
        raise RuntimeError("dsecd.ray: call ray.init() (address of the cluster) before making a RayFleet")
    socket = socket or default_socket()
    targets: dict[str, str] = {}
    for node in dsec_nodes():
        paths = (sockets or {}).get(node["NodeID"], socket)
        for path in [paths] if isinstance(paths, str) else paths:
            targets.setdefault(host_target(node["NodeManagerAddress"], path), node["NodeID"])
    return targets


class RayFleet(Fleet):
    """dsecd.Fleet over the Ray cluster's dsec hosts (see the module's docstring).

    sockets: {node id: socket path or paths} where a node's daemon does not
    listen on `socket` (tests run more than one daemon per node). The other
    arguments are Fleet's."""

    def __init__(self, sockets: dict[str, str | list[str]] | None = None, socket: str | None = None,
                 *, name: str = "dsecd-ray", connect_timeout: float = CONNECT_TIMEOUT_S, **fleet_args):
        hosts = discover(sockets, socket)
        if not hosts:
            raise RuntimeError(f"dsecd.ray: no alive Ray node advertises the {RESOURCE!r} resource; start "
                               f"the dsec hosts' raylets with --resources '{{\"{RESOURCE}\": 1}}'")
        super().__init__(list(hosts), name=name, connect_timeout=connect_timeout,
                         client_factory=lambda t: ActorClient(t, hosts[t], name=name,
                                                              connect_timeout=connect_timeout),
                         **fleet_args)
