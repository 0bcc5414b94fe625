"""Sandbox: one sandbox's requests: execs, background processes,
snapshots, its network and ports, pause, resume, inspect and destroy (its
files: files.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import parse_duration
from .args import (
    Command,
    Stdin,
    _given,
    _port_arg,
    _protocol_arg,
    _sandbox_info,
    command_argv,
    string_map,
)
from .execs import ExecStream, _collect
from .files import _Files
from .ops import _with_key
from .processes import Process, ProcStatus
from .results import ExecResult

if TYPE_CHECKING:
    from .core import Client


class Sandbox(_Files):
    """A sandbox on `client`'s daemon, by its id (Client.create, Client.get);
    `info` is what the daemon last said of it. Its file requests come from
    _Files (files.py)."""

    def __init__(self, client: Client, sandbox_id: str, info: dict):
        self.client = client
        self.id = sandbox_id
        self.info = info

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.get('state')} on {self.client.target}>"

    @property
    def host(self) -> str:
        """Where it lives: its daemon's socket path or ssh:// address."""
        return self.client.target

    def _exec_args(self, argv, env, cwd, user, timeout, stdin: bool, stream: bool, trace: bool = False,
                   pty: bool = False, rows: int | None = None, cols: int | None = None,
                   policy: str | dict | None = None) -> dict:
        if isinstance(timeout, str):        # "5m", as a ttl takes it
            timeout = parse_duration(timeout, "timeout")
        args = _given({"sandbox": self.id, "argv": command_argv(argv), "env": string_map(env, "env", raw=True),
                       "stdin": stdin, "stream": stream, "trace": trace}, cwd=cwd, user=user, timeout=timeout,
                      policy=policy)
        if pty:            # sent only when asked: older daemons do not know the fields
            args.update(_given({"pty": True, "stdin": True}, rows=rows, cols=cols))
        elif rows is not None or cols is not None:
            raise ValueError("rows and cols are a terminal's window size: give them with pty=True")
        return args

    async def exec(self, argv: Command, timeout: float | str | None = None, env: dict | None = None,
                   cwd: str | None = None, user: int | str | None = None, stdin: Stdin | None = None,
                   trace: bool = False, on_stdout: Callable[[bytes], object] | None = None,
                   on_stderr: Callable[[bytes], object] | None = None, pty: bool = False,
                   rows: int | None = None, cols: int | None = None,
                   policy: str | dict | None = None, key: str | None = None) -> ExecResult:
        """Run a command (an argv list, or a string run by /bin/sh -c); return
        its collected output and status (and, with trace, the ptrace record of
        what it executed, opened and connected to). on_stdout / on_stderr get
        each chunk as it arrives (a coroutine function is awaited). With pty,
        it runs on a terminal (rows x cols, default 24 x 80): `stdin` is typed
        into it, and everything it shows (echo included) is in stdout.
        policy: the task policy it runs under (a name or an inline dict;
        default: the sandbox's). user: a uid, or as `docker exec --user` a
        name, "name:group" or "uid:gid" from the sandbox's /etc/passwd and
        /etc/group (default: the sandbox's user).
        key: idempotency key of an exec without stdin or pty; without one
        the SDK makes one over an ssh:// link (where the daemon takes them),
        so an exec whose connection was lost is sent again on the next and
        answered with its one run's result (with on_stdout or on_stderr, its
        output taken up where it stopped: see exec_stream), instead of
        running twice or not at all. Given again with the same arguments,
        it is answered with that run's result. On a local socket none is
        made: a connection lost there is a daemon that stopped, whose
        successor could only say the exec's outcome is unknown (as
        ConnectionLost does), and a key costs the daemon a journal write
        per exec."""
        if stdin is None and on_stdout is None and on_stderr is None and not pty:
            args = self._exec_args(argv, env, cwd, user, timeout, False, False, trace, pty, rows, cols, policy)
            r = await self._keyed("exec", args, key, make_key=self.client.key_execs)
            return ExecResult.from_result(r)
        stream = self.exec_stream(argv, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin, trace=trace,
                                  pty=pty, rows=rows, cols=cols, policy=policy, key=key)
        return await _collect(stream, on_stdout, on_stderr)

    def exec_stream(self, argv: Command, timeout: float | str | None = None, env: dict | None = None,
                    cwd: str | None = None, user: int | str | None = None,
                    stdin: Stdin | None = None, trace: bool = False, pty: bool = False,
                    rows: int | None = None, cols: int | None = None,
                    policy: str | dict | None = None, key: str | None = None) -> ExecStream:
        """The exec as an ExecStream of (fd, data). With pty, it runs on a
        terminal of rows x cols (default 24 x 80), its output one stream (fd
        1); send keystrokes with `write`, the window size with `resize`. An
        end of `stdin` does not end a terminal's input: send b"\\x04" (^D).
        key: idempotency key of one without stdin or pty; over an ssh://
        link the SDK makes one where the daemon takes them (its hello lists
        "op.keys.stream"). A lost connection then sends it again, after each
        loss that output came before: the command runs once, and its output
        goes on from the bytes that came (those the daemon no longer had, in
        result.lost_output)."""
        if key is not None and (stdin is not None or pty):
            raise ValueError("key is for an exec without stdin or pty: sent again, its input would go twice, "
                             "or part of it be lost")
        args = self._exec_args(argv, env, cwd, user, timeout, stdin is not None, True, trace, pty, rows, cols,
                               policy)
        _with_key(args, key, stdin is None and not pty and self.client.key_execs
                  and "op.keys.stream" in self.client.server.get("capabilities", ()))
        return ExecStream(self, args, stdin)

    async def spawn(self, argv: Command, env: dict | None = None, cwd: str | None = None,
                    user: int | str | None = None, stdin: bool = True, policy: str | dict | None = None,
                    key: str | None = None) -> Process:
        """Start a background process (an argv list, or a string run by
        /bin/sh -c); returns once it runs. It outlives this client and a
        daemon restart; take it up again with `process(pid)`. stdin: a pipe
        fed by Process.write until close_stdin (False: /dev/null). policy:
        its task policy, as exec's. Cancelled, it leaves no process running.
        key: idempotency key, as exec's (the SDK makes one if none is given):
        sent again, the start answers with the process it started."""
        args = _given({"sandbox": self.id, "argv": command_argv(argv), "env": string_map(env, "env", raw=True),
                       "stdin": stdin}, cwd=cwd, user=user, policy=policy)
        r = await self._keyed("proc_start", args, key)
        # Its input counted from its start, where the daemon checks offsets
        # (op.keys); not that of a process an earlier spawn of the caller's
        # key started (`existing`), which may have had input since.
        counted = stdin and "existing" not in r and "op.keys" in self.client.server.get("capabilities", ())
        return Process(self, r["pid"], 0 if counted else None)

    async def _keyed(self, op: str, args: dict, key: str | None,
                     progress: Callable[[dict], None] | None = None, make_key: bool = True) -> dict:
        """Request `op` (KEYED) with idempotency key `key`, or (make_key)
        one the SDK makes where the daemon takes keys for it (its hello
        lists "op.keys"), so that a lost connection sends it again instead
        of leaving its outcome unknown."""
        made_key = _with_key(args, key, make_key and "op.keys" in self.client.server.get("capabilities", ()))
        # Lost and not answered again, its ConnectionLost names the key (lost_after_sending).
        if op == "snapshot":
            r = await self.client._with_progress(op, args, progress)
        else:
            r = await self.client.request(op, **args)
        if made_key:
            # Its own key found again on a new connection: this request's answer, not an earlier one's.
            r.pop("existing", None)
        return r

    def process(self, pid: int) -> Process:
        """A background process of this sandbox by its pid (from spawn, processes() or `dsec proc ls`)."""
        return Process(self, pid)

    async def processes(self) -> list[ProcStatus]:
        """Its background processes, running and exited (kept until evicted), oldest first."""
        r = await self.client.request("proc_list", sandbox=self.id)
        return [ProcStatus.from_wire(p) for p in r["processes"]]

    async def snapshot(self, name: str, exclude: list[str] | None = None,
                       progress: Callable[[dict], None] | None = None, key: str | None = None) -> dict:
        """pack_diff: this sandbox's changes as a new image `name` over its own image,
        leaving out the `exclude` paths: paths in the sandbox, a relative one
        read from its root (`root/.cache` is /root/.cache), never from a
        working directory. key: idempotency key, as exec's (the SDK makes
        one if none is given): sent again, the snapshot answers with the
        image it made; `progress` then hears the pack under way from where
        it is by then, each event once (a pack from its start again only if
        the first made no image: its error went with the connection, and
        the key with it)."""
        return await self._keyed("snapshot", {"sandbox": self.id, "name": name, "exclude": exclude or []}, key,
                                 progress)

    async def net_show(self) -> dict:
        """The egress policy: rules with allowed counters, and what default-deny refused."""
        return await self.client.request("net_show", sandbox=self.id)

    async def net_set(self, add: list[str] | None = None, remove: list[str] | None = None,
                      replace: list[str] | None = None) -> dict:
        """Change the policy atomically: add/remove (merge), or replace the whole of it."""
        return await self.client.request("net_set", sandbox=self.id, add=add or [], remove=remove or [],
                                         replace=replace)

    async def publish(self, port: int | str, host_port: int | None = None, bind: str = "",
                      protocol: str | None = None) -> dict:
        """Make the sandbox's `protocol` ("tcp", the default, or "udp") `port`
        (or "5353/udp") reachable from the host: {port, protocol, host_port,
        bind, host ("addr:port" to connect or send to), target}. host_port
        None = one the daemon picks; bind "" = every non-loopback address of
        the daemon's host side. A TCP and a UDP port of one number are
        published apart (and may get different host ports)."""
        number, proto = _port_arg(port, protocol)
        return await self.client.request("net_publish", sandbox=self.id, port=number, host_port=host_port,
                                         bind=bind, **_protocol_arg(proto))

    async def unpublish(self, port: int | str, protocol: str | None = None) -> dict:
        """The `protocol` `port` (or "5353/udp") no longer published; the flows
        open through it are cut."""
        number, proto = _port_arg(port, protocol)
        return await self.client.request("net_unpublish", sandbox=self.id, port=number, **_protocol_arg(proto))

    async def get_host(self, port: int | str, protocol: str | None = None) -> str:
        """"host:port" where the host reaches the sandbox's `protocol` ("tcp",
        the default, or "udp") `port` (or "5353/udp"); publishes it (on a host
        port the daemon picks) if it is not published yet."""
        number, proto = _port_arg(port, protocol)
        for p in (await self.net_show()).get("ports", []):
            if p["port"] == number and p.get("protocol", "tcp") == proto:
                return p["host"]
        return (await self.publish(number, protocol=proto))["host"]

    async def pause(self) -> dict:
        """Freeze and reclaim; any later exec or file op resumes it (auto_resume)."""
        return await self.client.request("pause", sandbox=self.id)

    async def resume(self) -> dict:
        return await self.client.request("resume", sandbox=self.id)

    async def inspect(self) -> dict:
        self.info = _sandbox_info(await self.client.request("inspect", sandbox=self.id))
        return self.info

    async def destroy(self, force: bool = False) -> dict:
        return await self.client.request("destroy", sandbox=self.id, force=force)
