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

What the actor carries: every op, with the SDK interface of a local or
ssh:// Client. A request is one actor call. A streamed op (exec_stream,
attach-style execs fed stdin or typed into a pty, proc output followed,
events, file watches, tar streams both ways, the progress of pulls, builds
and snapshots) is a Ray streaming generator of the actor (DaemonActor.stream)
whose frames reach the driver as the daemon sends them, in batches of what
has come meanwhile (at most STREAM_BATCH_BYTES). It is bounded: Ray holds
STREAM_AHEAD unread batches, then the actor stops reading that stream.
Requests that feed or signal a running one (exec_input, exec_resize,
exec_signal, file_tar_input) name it by the driver's request id; the
actor maps that to the id on its own connection and holds them until the stream is on that connection (Ray
may start the two actor calls in either order). A driver that leaves a
stream early (break, cancel) cancels the generator (ray.cancel), and the
actor's client tells the daemon to cancel the request (an exec is killed).
A request the driver cancels (a task cancelled, a timeout) cancels its
actor call the same way, but a create: Ray may say such a call was
cancelled though it ran to its end, so a cancelled create's call is let
end and the sandbox it made is destroyed (ActorClient._settle_cancelled_create).

A host is a daemon socket on a machine, named ray://<node address><socket>.
The fleet reads the cluster's nodes when it is made and again every
discover_s (RayFleet.discover): a dsec node that joins later adds its
host(s), connected and placed on like the others (host_added, host_up);
an up host whose node Ray no longer has alive is marked down then, with
its sandboxes reported lost, even before a request or the heartbeat finds
its actor dead. A node that Ray declares dead and that comes back (a
raylet restarted has a new node id) rejoins: the actor goes on any alive
dsec node at the host's address.

Ray is an optional dependency (`pip install dsecd[ray]`): it is imported
when this module is, and nothing else in dsecd imports this module.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import AsyncIterator

try:
    import ray
except ModuleNotFoundError as err:
    # Ray is an optional extra; without it the import would only say "No module named 'ray'".
    raise ModuleNotFoundError(f"dsecd.ray needs Ray, which is not installed ({err}): pip install "
                              "'dsecd[ray]', or DSECD_SETUP_RAY=1 bash scripts/setup.sh in a checkout",
                              name=err.name) from err
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .client import ABANDONED_CREATE_WAIT_S, Client, default_socket, lost_after_sending
from .errors import BadRequest, ConnectionLost, DsecError
from .fleet import CONNECT_TIMEOUT_S, Fleet

RESOURCE = "dsec"          # the custom resource a Ray node advertises to be a dsec host
SCHEME = "ray://"
DISCOVER_S = 2.0           # how often a RayFleet reads the cluster's nodes again

log = logging.getLogger(__name__)


# Streams through the actor. The actor reads a stream's frames from the
# daemon ahead of the driver (STREAM_QUEUE frames at most) and sends them on
# in batches: what has come when the driver's last batch left, up to
# STREAM_BATCH_BYTES (one frame at least), so that a fast stream costs one
# Ray object per batch rather than per frame. Ray holds STREAM_AHEAD batches
# the driver has not taken; past them the actor's generator waits, its
# queue fills, and the actor reads no more of that stream from the daemon.
STREAM_BATCH_BYTES = 1 << 20
STREAM_QUEUE = 64
STREAM_AHEAD = 8
# Requests that name a running request of this connection by its id, and the
# field that does: the driver's id is put back to the actor's own.
NAMING_OPS = {"exec_input": "exec_id", "exec_resize": "exec_id", "exec_signal": "exec_id", "file_tar_input": "put_id",
              "cancel": "target"}
# How long such a request waits for the stream it names to reach the daemon
# (Ray may run the two in either order), and how many ended streams the
# actor remembers, so that a late input gets the daemon's own answer.
NAMED_WAIT_S = 30.0
ENDED_KEPT = 4096
# Async actor methods running at once: every open stream holds one.
ACTOR_CONCURRENCY = 4096
# How much longer than connect_timeout the driver waits for the daemon's
# hello through a started actor, whose own Client gives up (saying why) first.
HELLO_SLACK_S = 2.0


class _ActorStream:
    """A stream the actor carries: the driver's request id maps to `own`,
    the id of the same request on the actor's connection to the daemon;
    `sent` is set once it is on that connection (or ended)."""

    def __init__(self, own: int):
        self.own = own
        self.sent = asyncio.Event()
        self.waiting = 0            # requests naming it that wait for it to be sent
        self.streaming = False      # its own stream() runs (sent or about to be: the entry stays)


def _final(frame: dict) -> bool:
    return "__result__" in frame or "__error__" in frame or "__lost__" in frame


def _frame_bytes(frame: dict) -> int:
    data = frame.get("data")
    return 64 + (len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0)


class DaemonActor:
    """Runs on a dsec host (one Ray actor per host and fleet): a Client on
    the local daemon's socket. Answers are plain dicts ({"result": ...},
    {"error": wire error} or {"lost": why}) and a stream's frames are lists
    of dicts, so that nothing but builtins crosses Ray's serialization."""

    def __init__(self, socket: str, name: str, connect_timeout: float = CONNECT_TIMEOUT_S):
        self.client = Client(socket, name=name, reconnect=True, connect_timeout=connect_timeout)
        self.streams: dict[int, _ActorStream] = {}           # the driver's request id -> its stream here
        self.ended: collections.deque[int] = collections.deque()

    async def ready(self) -> bool:
        """Answers once the actor runs (ActorClient.connect asks before hello)."""
        return True

    async def hello(self) -> dict:
        try:
            await self.client.connect()
        except (ConnectionError, OSError) as err:
            node = ray.get_runtime_context().get_node_id()
            cause = err.__cause__ if isinstance(err.__cause__, OSError) else None
            if cause is not None:           # no socket, or nobody listening: said without dsec's own advice
                return {"lost": f"no daemon at {self.client.socket_path} on node {node}: {cause.strerror}",
                        "socket": True}
            return {"lost": f"node {node}: {err}"}
        return {"result": self.client.server}

    def _stream(self, rid: int) -> _ActorStream:
        stream = self.streams.get(rid)
        if stream is None:
            stream = self.streams[rid] = _ActorStream(self.client.new_id())
        return stream

    def _ended(self, rid: int, stream: _ActorStream) -> None:
        stream.sent.set()           # an input still waiting goes now, and gets the daemon's "not running"
        self.ended.append(rid)
        while len(self.ended) > ENDED_KEPT:
            self.streams.pop(self.ended.popleft(), None)

    def _forget_unsent(self, rid: int, stream: _ActorStream) -> None:
        """A request named `rid` and it never came: its entry goes, once no
        other request waits on it (one per bad id would otherwise stay for
        the actor's life). Should it come later after all, it makes a new
        entry."""
        if not (stream.sent.is_set() or stream.waiting or stream.streaming) and self.streams.get(rid) is stream:
            del self.streams[rid]

    async def request(self, op: str, args: dict) -> dict:
        try:
            field = NAMING_OPS.get(op)
            if field is not None and field in args:
                stream = self._stream(args[field])
                stream.waiting += 1
                try:
                    async with asyncio.timeout(NAMED_WAIT_S):
                        await stream.sent.wait()
                    came = True
                except TimeoutError:
                    came = False
                finally:                    # a timeout, or the request cancelled while it waits
                    stream.waiting -= 1
                    self._forget_unsent(args[field], stream)
                if not came:
                    raise BadRequest(f"{op}: the request {args[field]} it names did not reach the daemon "
                                     f"in {NAMED_WAIT_S:g} s through this actor; send that request first",
                                     {field: args[field]}) from None
                args = {**args, field: stream.own}
            return {"result": await self.client.request(op, **args)}
        except DsecError as err:
            return {"error": err.to_wire()}
        except (ConnectionError, OSError) as err:
            return {"lost": self._why_lost(err)}

    def _why_lost(self, err: BaseException) -> str:
        """What ended the daemon's connection here: its cause, without this
        Client's advice (which is not the driver's: the fleet reconnects, and
        the driver's ActorClient says so with what the request may have done)."""
        conn = self.client._conn
        if isinstance(err, ConnectionLost) and conn is not None and conn.lost is not None:
            return f"connection lost: {conn.lost}"
        return str(err)

    async def stream(self, rid: int, op: str, args: dict):
        """A streamed op (a Ray streaming generator): its frames in batches,
        the final one ({"__result__": ...}, {"__error__": wire error} or
        {"__lost__": why}) last. Cancelled (ray.cancel, the driver gone),
        it stops reading, and the daemon is told to cancel the request."""
        stream = self._stream(rid)
        stream.streaming = True
        queue: asyncio.Queue[dict] = asyncio.Queue(STREAM_QUEUE)
        pump = asyncio.get_running_loop().create_task(self._pump(stream, op, args, queue))
        try:
            while True:
                frame = await queue.get()
                batch, size = [], 0
                while True:
                    if "__raise__" in frame:
                        # What the Client here raised (an argument it cannot
                        # send): raised to the driver, after what came before.
                        if batch:
                            yield batch
                        raise frame["__raise__"]
                    batch.append(frame)
                    size += _frame_bytes(frame)
                    if _final(frame) or size >= STREAM_BATCH_BYTES or queue.empty():
                        break
                    frame = queue.get_nowait()
                yield batch
                if _final(frame):
                    return
        finally:
            pump.cancel()
            self._ended(rid, stream)

    async def _pump(self, stream: _ActorStream, op: str, args: dict, queue: asyncio.Queue) -> None:
        try:
            async with contextlib.aclosing(self.client.frames_with_id(stream.own, op, args, stream.sent)) as frames:
                async for frame in frames:
                    if isinstance(frame.get("data"), memoryview):
                        frame = {**frame, "data": bytes(frame["data"])}
                    await queue.put(frame)
        except DsecError as err:
            await queue.put({"__error__": err.to_wire()})
        except (ConnectionError, OSError) as err:
            await queue.put({"__lost__": self._why_lost(err)})
        except Exception as err:            # else the stream would wait for a frame forever
            await queue.put({"__raise__": err})


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
        # The daemon is on the node's machine: a path it reads there (build_image)
        # is that machine's, so it must be absolute, as over ssh://.
        self.remote = True
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
        ).remote(self.socket_path, self.name, self.connect_timeout)
        self._aborted = asyncio.Event()
        started = False
        try:
            # Two waits, so that a timeout says what did not answer: the
            # actor (its node), then the daemon, whose hello the actor's
            # Client bounds by connect_timeout and answers why (a daemon
            # that took the connection but is stuck) before this side gives up.
            async with asyncio.timeout(self.connect_timeout):
                await self._actor.ready.remote()
            started = True
            async with asyncio.timeout(self.connect_timeout + HELLO_SLACK_S):
                answer = await self._actor.hello.remote()
        except TimeoutError:
            self._kill_actor()
            if started:
                raise ConnectionError(f"{self.target}: the actor on node {self.node_id} started, but its hello "
                                      f"to the daemon did not end in {self.connect_timeout:g} s") from None
            raise ConnectionError(f"{self.target}: the actor on node {self.node_id} did not answer in "
                                  f"{self.connect_timeout:g} s: is the node alive (ray status)?") from None
        except RayError as err:
            self._kill_actor()
            raise ConnectionError(f"{self.target}: cannot start the actor on node {self.node_id}: "
                                  f"{_first_line(err)}") from None
        if "lost" in answer:
            self._kill_actor()
            advice = ("; is dsecd running there? RayFleet(socket=PATH) names where the nodes' daemons listen, "
                      "sockets={node id: PATH} one node's") if answer.get("socket") else ""
            raise ConnectionError(f"{self.target}: the actor started, but reaches no daemon: {answer['lost']}{advice}")
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
        if self._undoing and self._lost is None:
            # Destroys of what cancelled creates made, through the actor: before it goes.
            await asyncio.wait(set(self._undoing), timeout=ABANDONED_CREATE_WAIT_S)
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
            text += lost_after_sending(op)
        return ConnectionLost(f"{text}; {self._advice()}", target=self.target, op=op, sent=sent)

    def _advice(self) -> str:
        if self._closed:
            # Nothing connects it again (lost_advice, the fleet's, says it would).
            return "it was closed (RayFleet.close); make a new RayFleet to go on"
        return self.lost_advice or "call connect() again to go on"

    def _actor_or_lost(self, op: str):
        if self._actor is None or self._lost is not None:
            raise ConnectionLost(f"{op} on {self.target}: not connected ({self._lost or 'no actor'}); "
                                 f"{self._advice()}", target=self.target, op=op, sent=False)
        return self._actor

    async def _until_aborted(self, awaitable, op: str):
        """What `awaitable` (an actor call's answer) gives, unless the client is
        aborted first or the actor dies: then ConnectionLost, as for a socket."""
        aborted = asyncio.ensure_future(self._aborted.wait())
        answer_f = asyncio.ensure_future(awaitable)
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
        except RayTaskError as err:
            # The actor's method raised, and the actor lives: what its Client
            # raised for this request (an argument it cannot send, say) is the
            # caller's error, as a local Client raises it, not the host's.
            self.last_frame_at = asyncio.get_running_loop().time()
            cause = getattr(err, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise err.as_instanceof_cause() from None     # one Ray could not rebuild: its text kept
        except RayError as err:          # RayActorError above all: the actor, its worker or its node died
            raise self._lost_now(f"the actor on node {self.node_id} failed: {_first_line(err)}", op,
                                 sent=True) from None
        self.last_frame_at = asyncio.get_running_loop().time()
        return answer

    async def _call(self, method: str, op: str, args: dict) -> dict:
        actor = self._actor_or_lost(op)
        ref = getattr(actor, method).remote(op, _plain(args))
        key = args.get("key") if op == "create" else None
        if key:
            self._keyed_create_sent(key)
        undone = False
        try:
            answer = await self._until_aborted(_await(ref), op)
        except asyncio.CancelledError:
            # The caller gave up (a cancel, a timeout).
            if op == "create":
                # Not ray.cancel: Ray (2.60) may answer an async actor call it
                # was asked to cancel with TaskCancelledError though the call
                # ran to its end, and nobody would then destroy the sandbox.
                # The call ends, and what it made is destroyed here.
                if key:
                    # Now, before the undo waits: a create of the key sent
                    # from here on is the caller's retry (_asked_again).
                    self._keyed_create_ended(key, undo=True)
                    undone = True
                await self._settle_cancelled_create(ref, key)
            else:
                # The actor's call is cancelled too: its Client tells the
                # daemon to cancel the request (an exec is killed).
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
            raise
        finally:
            if key and not undone:
                self._keyed_create_ended(key, undo=False)
        if "lost" in answer:
            # The actor lives but its daemon connection dropped: the host is down as far as the fleet goes.
            raise self._lost_now(f"the daemon's socket on node {self.node_id}: {answer['lost']}", op, sent=True)
        if "error" in answer:
            raise DsecError.from_wire(answer["error"])
        return answer["result"]

    async def _settle_cancelled_create(self, ref, key: str | None) -> None:
        """A create the caller cancelled: once its actor call ends, the
        sandbox it made for nobody is destroyed, as Client._undo_abandoned
        does for a local one whose answer was on its way, unless a create of
        its key was sent meanwhile (the caller's retry, answered with that
        sandbox). Waited for up to ABANDONED_CREATE_WAIT_S; the undo goes on
        in the background after that, and close() waits for it."""
        async def settle() -> None:
            try:
                answer = await ref
            except Exception:               # the actor died: the host is down, the fleet settles keys on rejoin
                return
            finally:
                asked_again = self._asked_again(key)
            if not asked_again:
                await self._destroy_made_for_nobody(answer.get("result") or {})

        task = asyncio.get_running_loop().create_task(settle())
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)
        await asyncio.wait([task], timeout=ABANDONED_CREATE_WAIT_S)

    async def request(self, op: str, **args) -> dict:
        return await self._call("request", op, args)

    async def frames_with_id(self, rid: int, op: str, args: dict,
                             sent: asyncio.Event | None = None) -> AsyncIterator[dict]:
        """A streamed op through the actor's streaming generator (DaemonActor.stream):
        its frames as they come, in the Client's form (stream payloads, then
        {"__result__": ...}). Requests that name it (exec_input, exec_resize,
        exec_signal, file_tar_input) give `rid`, which the actor maps to its own id."""
        actor = self._actor_or_lost(op)
        gen = actor.stream.options(_generator_backpressure_num_objects=STREAM_AHEAD).remote(rid, op, _plain(args))
        if sent is not None:
            sent.set()          # feeding requests may follow: the actor holds them until the stream is sent
        finished = False
        try:
            while True:
                batch = await self._until_aborted(_next_batch(gen), op)
                if batch is None:
                    raise self._lost_now(f"the actor on node {self.node_id} ended {op} without its final frame",
                                         op, sent=True)
                for frame in batch:
                    if "__lost__" in frame:
                        raise self._lost_now(f"the daemon's socket on node {self.node_id}: {frame['__lost__']}",
                                             op, sent=True)
                    if "__error__" in frame:
                        finished = True
                        raise DsecError.from_wire(frame["__error__"])
                    if "__result__" in frame:
                        finished = True
                    yield frame
                    if finished:
                        return
        finally:
            if not finished:
                # Left early (break, an exception, a cancel): the actor stops
                # the stream, and its client tells the daemon to cancel it.
                with contextlib.suppress(Exception):
                    ray.cancel(gen)


@functools.cache
def _daemon_actor():
    """DaemonActor as a Ray actor class: no CPU of the node's (it only relays
    to the daemon), and no restart by Ray: a death must reach the fleet,
    which starts the next actor itself when the host rejoins."""
    return ray.remote(num_cpus=0, max_restarts=0, max_concurrency=ACTOR_CONCURRENCY)(DaemonActor)


async def _await(ref):
    return await ref


async def _next_batch(gen) -> list[dict] | None:
    """The next batch of a DaemonActor.stream, or None when it ended."""
    try:
        ref = await gen.__anext__()
    except StopAsyncIteration:
        return None
    return await ref


def _plain(args: dict) -> dict:
    """Ray pickles the arguments: memoryviews (file chunks) go as bytes."""
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in args.items()}


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _targets(nodes: list[dict], sockets: dict[str, str | list[str]] | None, socket: str | None) -> dict[str, str]:
    socket = socket or default_socket()
    targets: dict[str, str] = {}
    for node in nodes:
        paths = (sockets or {}).get(node["NodeID"], socket)
        for path in [paths] if isinstance(paths, str) else paths:
            targets.setdefault(host_target(node["NodeManagerAddress"], path), node["NodeID"])
    return targets


def discover(sockets: dict[str, str | list[str]] | None = None, socket: str | None = None) -> dict[str, str]:
    """The fleet's hosts, {target: node id}: for every alive Ray node with a
    `dsec` resource, the daemon socket(s) `sockets[node id]` names, else
    `socket` (default DSEC_SOCKET or /run/dsecd/dsecd.sock). A socket named
    by two nodes of one machine is one host. ray.init() must have run."""
    if not ray.is_initialized():
        raise RuntimeError("dsecd.ray: call ray.init() (address of the cluster) before making a RayFleet")
    return _targets(dsec_nodes(), sockets, socket)


class RayFleet(Fleet):
    """dsecd.Fleet over the Ray cluster's dsec hosts (see the module's docstring).

    sockets: {node id: socket path or paths} where a node's daemon does not
    listen on `socket` (tests run more than one daemon per node); a node
    not named there, a late one too, has its daemon on `socket` (default
    DSEC_SOCKET, else /run/dsecd/dsecd.sock). discover_s: how often the
    cluster's nodes are read again (`discover`). The other arguments are
    Fleet's."""

    def __init__(self, sockets: dict[str, str | list[str]] | None = None, socket: str | None = None,
                 *, discover_s: float = DISCOVER_S, name: str = "dsecd-ray",
                 connect_timeout: float = CONNECT_TIMEOUT_S, **fleet_args):
        if discover_s <= 0:
            raise ValueError("discover_s must be positive")
        self.sockets = dict(sockets or {})
        self.socket = socket
        self.discover_s = discover_s
        self._nodes = discover(self.sockets, socket)            # target -> the node it was found on
        if not self._nodes:
            raise RuntimeError(f"dsecd.ray: no alive Ray node advertises the {RESOURCE!r} resource; start "
                               f"the dsec hosts' raylets with --resources '{{\"{RESOURCE}\": 1}}'")
        super().__init__(list(self._nodes), name=name, connect_timeout=connect_timeout,
                         client_factory=lambda t: ActorClient(t, self._nodes[t], name=name,
                                                              connect_timeout=connect_timeout),
                         **fleet_args)

    async def start(self) -> None:
        await super().start()
        self._tasks.append(asyncio.get_running_loop().create_task(self._discover_loop(), name="ray-discover"))

    async def _discover_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.discover_s)
            try:
                await self.discover()
            except RayError as err:             # the GCS did not answer: the next round asks again
                log.warning("dsecd.ray: reading the cluster's nodes failed: %s", _first_line(err))

    async def discover(self) -> list[str]:
        """Read the cluster's nodes now (every discover_s anyway). A dsec
        node that was not there before adds its host(s) (`host_added`, then
        `host_up` once its actor answers, and placement uses it). An up host
        whose actor's node Ray no longer has alive is marked down at once
        (`host_down` and a `sandbox_lost` per sandbox), without waiting for
        the heartbeat; it rejoins when a dsec node at its address answers
        again. Returns the hosts added."""
        nodes = await asyncio.to_thread(dsec_nodes)
        found = _targets(nodes, self.sockets, self.socket)
        added = []
        for target, node_id in found.items():
            if target not in self.hosts and not self._closing:
                self._nodes[target] = node_id
                self.add_host(target)
                added.append(target)
        alive = {n["NodeID"] for n in nodes}
        for host in list(self.hosts.values()):
            node_id = host.client.node_id
            if host.up and node_id not in alive:
                self._host_down(host, f"Ray no longer has its node {node_id} alive with the {RESOURCE!r} "
                                      "resource (ray status)")
        return added
