"""Client: the asyncio SDK's entry point, a daemon's requests of sandboxes,
runs, calls, pools, jobs, leases and events (its connection: wire.py; its
image requests: images.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from ..config import parse_duration
from ..errors import ConnectionLost, NotFound
from .args import Command, Stdin, _given, _publish_spec, _sandbox_info, command_argv, string_map
from .blocks import _SandboxContext
from .execs import _collect
from .images import _Images
from .ops import _made_key
from .processes import Process
from .refollow import _Refollow
from .results import CallResult, ExecResult
from .runs import RunStream, run_detached
from .sandbox import Sandbox
from .wire import _reconnects

# How soon Client.hold renews again after a renew found the connection gone.
HOLD_RETRY_S = 1.0

# The SDK's one logger, whichever of its modules logs: a caller's logging
# configuration names it.
log = logging.getLogger("dsecd.client")


class Client(_Images):
    """A connection to one daemon: `target` is its unix socket's path (default
    DSEC_SOCKET, else /run/dsecd/dsecd.sock) or ssh://[user@]host[:port],
    reached through `ssh host dsec rpc --stdio` (dsecd/remote.py; `ssh`:
    SshOptions, default from the environment).

    A lost connection fails the requests in flight with errors.ConnectionLost.
    With `reconnect` (the default: a daemon restart, which leaves the
    sandboxes running, or a network over ssh:// drops a connection), the
    next request connects again first, waiting up to reconnect_timeout for
    the daemon to answer, and the requests that were still queued in this
    client (never sent) go on the new connection; otherwise every later
    request fails with ConnectionLost too, until connect() is called again.

    Two timeouts: `connect_timeout` bounds one connect, the socket (ssh's
    connect and login over ssh://) and the daemon's hello, so that a daemon
    that is wedged fails a client instead of hanging it; `reconnect_timeout`
    bounds how long requests wait, after a lost connection, for the daemon
    to answer again (a restart under systemd), trying to connect again and
    again meanwhile. Not given, it is connect_timeout (as the one timeout
    of older versions was both).

    `silence_timeout` (a local socket's; over ssh://, ssh's keepalives in
    SshOptions): how long a connection may stay silent while requests wait
    on it and the pings sent meanwhile go unanswered (a daemon stopped by
    SIGSTOP, or its event loop wedged) before it is given up, its requests
    failing with ConnectionLost saying so. A daemon that answers pings is
    never silent, however long its requests run. Default
    DSEC_SILENCE_TIMEOUT, else LOCAL_SILENCE_S (10 s); 0 turns it off."""

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---------------------------------------------------------------- host

    async def info(self) -> dict:
        return await self.request("info")

    # ---------------------------------------------------------------- sandboxes

    async def create(self, image: str, cpu: float | None = None, memory: int | str | None = None,
                     pids: int | None = None, env: dict | None = None, labels: dict | None = None,
                     hostname: str | None = None, cwd: str | None = None, user: int | str | None = None,
                     ttl: float | str | None = None, idle_ttl: float | str | None = None,
                     lease: float | str | None = None, qos: str | None = None,
                     cpu_quota: bool | None = None, net: str | None = None,
                     allow: list[str] | None = None, key: str | None = None,
                     disk: int | str | None = None, publish: list[int | str] | None = None,
                     network_rules: dict[str, bool] | None = None, backend: str | None = None,
                     policy: str | dict | None = None) -> Sandbox:
        """allow: egress rules ("10.1.2.0/24:443/tcp", "pypi.org:443/tcp", "*.example.org:443")
        and rule-set names ("pypi"), with net="default".
        network_rules: the same as a dict, {"pypi": True}: the keys whose value is true join `allow`.
        publish: ports of the sandbox to make reachable from the host (Sandbox.get_host): 8080
        (TCP), "8080/tcp" or "5353/udp"; each on a host port the daemon picks.
        key: idempotency key; a retried create with the same key returns the same sandbox.
        Without one the SDK makes one (see _made_key), so a create whose
        answer a lost connection took is sent again once, and answered with
        the sandbox it made, instead of leaving that sandbox to nobody.
        disk: size cap of the writable layer ("20G"; default sandbox.disk).
        backend: "container" or "microvm" (a QEMU guest per sandbox; default sandbox.backend).
        env, cwd, user: over the image's config (env merged; default: the
        image's WorkingDir and User); user is a uid or "name", "uid:gid",
        "name:group", resolved in the image's /etc/passwd and /etc/group.
        A create runs nothing: `run` starts the image's Entrypoint and Cmd.
        policy: the task policy of every exec in it unless an exec names
        another: a name of the daemon's (`policy_list`) or an inline dict
        (docs/protocol.md, "Task policies")."""
        allow = list(allow or [])
        if network_rules is not None:
            if not isinstance(network_rules, dict):
                raise TypeError(f"network_rules must be a dict of rule -> bool, got {type(network_rules).__name__}")
            allow += [r for r, on in network_rules.items() if on and r not in allow]
        made_key = key is None
        if made_key:
            key = _made_key()
        args = _given({"image": image, "env": string_map(env, "env", raw=True), "labels": string_map(labels, "labels"),
                       "allow": allow, **({"publish": [_publish_spec(p) for p in publish]} if publish else {})},
                      cwd=cwd, user=user, cpu=cpu, memory=memory, pids=pids, hostname=hostname, ttl=ttl,
                      idle_ttl=idle_ttl, lease=lease, qos=qos, cpu_quota=cpu_quota, net=net, key=key, disk=disk,
                      backend=backend, policy=policy)
        try:
            info = _sandbox_info(await self.request("create", **args))
        except ConnectionLost as err:
            if not (made_key and err.sent):
                raise
            # Not sent again (no daemon answered in time, or lost again): the
            # caller can only settle it with the key it never saw.
            raise ConnectionLost(f"{err}; its key was {key!r}: a create of the same arguments with "
                                 f"key={key!r} (dsec create --key) answers with the sandbox it made, if any",
                                 target=err.target, op=err.op, sent=True) from None
        if made_key:
            # Its own key found again on a new connection: this create's
            # sandbox, not an earlier create's.
            info.pop("existing", None)
        return Sandbox(self, info["id"], info)

    def run_stream(self, image: str, args: list[str] | None = None, entrypoint: list[str] | str | None = None,
                   timeout: float | str | None = None, stdin: Stdin | None = None,
                   remove: bool = True, pty: bool = False, rows: int | None = None, cols: int | None = None,
                   **create_args) -> RunStream:
        """`async with c.run_stream(image, args) as run:` makes a sandbox of
        `image` (create's arguments: env, cwd, user, net, allow, memory, ...)
        and starts its command as `docker run` does: the image's Entrypoint
        and Cmd, `args` replacing Cmd, `entrypoint` replacing Entrypoint (and
        dropping Cmd). `async for fd, data in run` streams its output;
        `run.result` is its ExecResult, `run.sandbox` the sandbox. On the way
        out, however it is left (an error, a cancel), the sandbox is destroyed
        unless remove=False; meanwhile it is leased (RUN_LEASE_S), so it goes
        even if this process dies. pty: the command runs on a terminal of
        rows x cols (as exec_stream's; `run.stream.write` is its keyboard)."""
        return RunStream(self, image, args, entrypoint, timeout, stdin, remove, create_args,
                         {"pty": True, "rows": rows, "cols": cols} if pty else {})

    async def run(self, image: str, args: list[str] | None = None, entrypoint: list[str] | str | None = None,
                  timeout: float | str | None = None, stdin: Stdin | None = None,
                  on_stdout: Callable[[bytes], object] | None = None,
                  on_stderr: Callable[[bytes], object] | None = None, remove: bool = True,
                  **create_args) -> ExecResult:
        """`docker run --rm`: run_stream's command to its end, its output
        collected (on_stdout / on_stderr get each chunk as it comes); the
        sandbox is gone when this returns (unless remove=False). The
        ExecResult's exit_code is the command's."""
        async with self.run_stream(image, args, entrypoint, timeout, stdin, remove, **create_args) as run:
            return await _collect(run, on_stdout, on_stderr)

    async def run_detached(self, image: str, args: list[str] | None = None,
                           entrypoint: list[str] | str | None = None, **create_args) -> Process:
        """`docker run -d`: a sandbox of `image` (create's arguments) with
        run_stream's command started in it in the background; returns that
        Process (its `.sb` is the sandbox, which stays until destroyed:
        bound it with ttl= or lease=; idle_ttl= counts requests on the
        sandbox, not its command running, so it ends a quiet server
        too). Nothing is left if it fails."""
        return await run_detached(self, image, args, entrypoint, **create_args)

    def sandbox(self, image: str, **create_args) -> _SandboxContext:
        """`async with client.sandbox(image=...) as sb:` creates a sandbox
        (create's arguments) and destroys it on the way out, killing its
        execs; a destroy cut by a daemon restart is sent again to the next."""
        return _SandboxContext(self, image, create_args)

    async def call(self, image: str, argv: Command | None = None, code: str | None = None,
                   args: list[str] | None = None, stdin: bytes | bytearray | memoryview | None = None,
                   env: dict | None = None,
                   timeout: float | str | None = None) -> CallResult:
        """A stateless function call (FnCall backend): `argv`, or Python `code` run by a fork of
        the image's pre-imported zygote. Many may be in flight on one client."""
        if stdin is not None and not isinstance(stdin, (bytes, bytearray, memoryview)):
            raise TypeError(f"call stdin must be bytes, got {type(stdin).__name__}"
                            + (": encode it" if isinstance(stdin, str) else ""))
        if isinstance(timeout, str):        # "5m", as exec's
            timeout = parse_duration(timeout, "timeout")
        req = _given({"image": image, "env": string_map(env, "env", raw=True)},
                     argv=None if argv is None else command_argv(argv), code=code, args=args,
                     stdin=None if stdin is None else bytes(stdin), timeout=timeout)
        return CallResult.from_call(await self.request("call", **req))

    async def pool_set(self, image: str, min: int, max: int, cpu: float | None = None,
                       memory: int | str | None = None) -> dict:
        """Keep between min and max warm sandboxes of (image, cpu, memory); max=0 removes the pool."""
        args = _given({"image": image, "min": min, "max": max}, cpu=cpu, memory=memory)
        return await self.request("pool_set", **args)

    async def pool_list(self) -> list[dict]:
        return (await self.request("pool_list"))["pools"]

    async def drain(self, reason: str = "") -> dict:
        """Drain the host: it refuses new creates (`Busy`, detail `drained`) and
        refills no pool until undrain; its sandboxes run on. Kept across
        daemon restarts. Returns {drained, reason, since}."""
        return await self.request("drain", reason=reason)

    async def undrain(self) -> dict:
        """Take creates again after a drain. Returns {drained, reason, since}."""
        return await self.request("undrain")

    async def policy_list(self) -> dict:
        """The daemon's named task policies and its Landlock ABI (`dsec policy ls`)."""
        return await self.request("policy_list")

    async def net_sets(self) -> list[dict]:
        """The daemon's named rule sets for allow=[NAME]: [{name, rules}]."""
        return (await self.request("net_sets"))["sets"]

    async def job_pause(self, job: str) -> dict:
        """Pause every sandbox labelled job=<job>: frozen at once, memory reclaimed after."""
        return await self.request("job_pause", job=job)

    async def job_resume(self, job: str) -> dict:
        return await self.request("job_resume", job=job)

    async def job_rm(self, job: str, force: bool = False) -> dict:
        return await self.request("job_rm", job=job, force=force)

    async def renew(self, sandbox_ids: list[str], lease: float | str | None = None) -> dict:
        return await self.request("renew", sandboxes=list(sandbox_ids), lease=lease)

    def hold(self, sandbox_ids: list[str], lease: float | str | None,
             every: float | str | None = None) -> asyncio.Task:
        """Renew the leases of these sandboxes in the background until the task is
        cancelled or the client is closed; then they expire after `lease` seconds
        (None: each one's own lease, renewed `every` seconds). A renew that
        finds the connection gone is tried again (HOLD_RETRY_S) until it
        is back: the daemon's restart keeps the sandboxes, an ssh:// client
        reconnects, a fleet rejoins the host. Durations as create's lease:
        seconds or "90s", "5m"; one out of range is BadRequest here, not
        an end of the task behind it that nobody would see."""
        if lease is None and every is None:
            raise ValueError("hold: give the lease, or how often to renew (every=)")
        # Both checked here, whichever gives the period.
        given_every = parse_duration(every, "hold: every")
        given_lease = parse_duration(lease, "hold: lease")
        period = given_every or given_lease / 3

        async def renew_forever() -> None:
            failing = False
            while True:
                try:
                    await self.renew(sandbox_ids, lease)
                except ConnectionError as err:
                    if self._closed:
                        return
                    if not failing:
                        log.warning("hold on %s: renewing the leases failed (%s); trying again every %g s",
                                    self.target, err, min(period, HOLD_RETRY_S))
                    failing = True
                    await asyncio.sleep(min(period, HOLD_RETRY_S))
                    continue
                failing = False
                await asyncio.sleep(period)

        return asyncio.get_running_loop().create_task(renew_forever())

    async def events(self, sandbox: str | None = None, replay: bool = False,
                     follow: bool = True) -> AsyncIterator[dict]:
        """State changes (created, paused, resumed, expired, oom, died, destroyed) and task-policy
        denials (denied), as they happen; with replay, the recent history first; with
        follow=False, only that history.

        A lost connection (a daemon restart) is followed again on the next
        one, on a client that reconnects (the default): with the daemon's
        recent history (replay), so that what the next daemon published
        before then (a sandbox found dead at its start) is not missed, and
        what came already passed over (by its time and `seq`: the next
        daemon numbers from 1 again, later), as is, without replay, what
        the same daemon (reached again over ssh://) published before the
        follow began (by its time then, which a ping asks first); a
        `sandbox` prefix is asked for by the id its first event carried. No
        daemon runs meanwhile, so none is missed unless the next daemon
        published more than its history keeps (256) first. Lost
        FOLLOW_LOST_MAX times in a row with no event come (a daemon that
        drops the request), it ends with the ConnectionLost; followed
        again, a `sandbox` the next daemon no longer knows ends it with
        NotFound, saying so."""
        # `follow` only when it differs from the default, which older daemons do not know.
        extra = {} if follow else {"follow": False}
        last: tuple[float, int] | None = None          # the (time, seq) of the last event given
        if follow and not replay and _reconnects(self) and self.connected:
            # Followed again, it asks for the history, and the same daemon
            # (reached again over ssh://) has in it what came before this
            # follow began: passed over by the daemon's time now. (Not
            # connected, the request's own error says so.)
            now = (await self.request("ping")).get("time")
            if now is not None:
                last = (now, 0)
        again = False
        refollow = _Refollow()
        while True:
            args = {"sandbox": sandbox, "replay": replay or again, **extra}
            came = False
            refollow.attach()
            try:
                async with contextlib.aclosing(self.frames("events", **args)) as frames:
                    async for frame in frames:
                        came = True
                        if "__result__" in frame:
                            return
                        if sandbox and frame.get("sandbox"):
                            # Followed again, by the id the daemon resolved `sandbox` to: a
                            # prefix resolved again by the next daemon may name another
                            # sandbox by then (this one destroyed, a new one sharing it).
                            sandbox = frame["sandbox"]
                        at = (frame.get("time", 0.0), frame.get("seq", 0))
                        if again and last is not None and at <= last:
                            continue                    # given before the loss
                        last = at
                        yield frame
                return
            except ConnectionLost as err:
                # Not sent: the daemon did not answer again (reconnect_timeout).
                if not (err.sent and _reconnects(self)):
                    raise
                again = True
                await refollow.lost(err, came)
            except NotFound as err:
                if not (again and sandbox and not came):
                    raise
                # Its answer alone would read as if the follow named a
                # sandbox that never was.
                raise NotFound(f"events of sandbox {sandbox}: followed again after the connection to the daemon "
                               "was lost (a daemon restart), the daemon has no such sandbox any more (destroyed "
                               f"before the restart, or meanwhile): its events end here: {err.message}",
                               err.detail) from None

    async def get(self, sandbox_id: str) -> Sandbox:
        info = _sandbox_info(await self.request("inspect", sandbox=sandbox_id))
        return Sandbox(self, info["id"], info)

    async def list(self, labels: dict | None = None) -> list[dict]:
        return [_sandbox_info(s) for s in (await self.request("list", labels=labels or {}))["sandboxes"]]

    async def destroy_all(self, force: bool = False, labels: dict | None = None) -> dict:
        return await self.request("destroy_all", force=force, labels=labels or {})

    async def top(self, labels: dict | None = None) -> dict:
        """Sampled CPU/memory use per sandbox and for the host (see `dsec top`)."""
        return await self.request("top", labels=labels or {})
