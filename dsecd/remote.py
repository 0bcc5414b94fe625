"""The SDK's ssh:// transport: the protocol through `ssh HOST dsec rpc --stdio`.

    Client("ssh://user@host:2222")      # any number of requests and streams
                                        # share the one ssh process below

A remote client runs OpenSSH's own client as a subprocess whose stdin and
stdout are one end of a socketpair; the client's frames go into it as they
would into the daemon's unix socket, and the remote `dsec rpc --stdio` relays
them, byte for byte, to that host's daemon. The protocol already multiplexes
requests by id over one byte stream, so one ssh connection carries all of a
client's requests, streams and file transfers.

Why OpenSSH's client and not a Python SSH library (asyncssh): `ssh` is what
operators already configure and trust. It honours ~/.ssh/config (host
aliases, ProxyJump, ports, users), the agent and its keys, known_hosts and
certificates, ControlMaster sharing, GSSAPI, FIDO keys; asyncssh reads only
part of ssh_config and would be one more SSH implementation on the client
machines to keep patched (Debian ships it, PyPI ships it, they differ). A
subprocess costs a process per connection (one per host, ~5 MiB) and its
start-up (one key exchange, ~30-100 ms; ControlMaster makes later ones ~10
ms); neither matters next to the hours a connection lives.

Keepalives: ssh's ServerAliveInterval/ServerAliveCountMax, so a host that
stops answering ends the ssh process, hence the connection, within
keepalive_s x keepalive_count seconds. Those options do not reach a master
connection that ssh shares (ControlMaster): the Client watches the same
window itself, pinging the daemon while requests wait in silence
(Client._watch_silence). dsecd.Fleet adds its own heartbeat on top for a
bound of a few seconds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import os
import shlex
import signal
import socket
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

SCHEME = "ssh://"
# ssh's own failures (cannot connect, refused key, unknown host key) exit 255.
SSH_FAILED = 255
# What a POSIX shell exits with for a command it cannot find / cannot run.
NOT_FOUND = 127
NOT_EXECUTABLE = 126
# How much of ssh's stderr is kept to explain a failure.
STDERR_LINES = 20
# After the connection ends, how long to wait for ssh to exit so its status
# and last words can be reported (it exits within milliseconds of its end).
EXIT_WAIT_S = 0.5
# close(): how long ssh gets to finish (the remote answers what was sent,
# then exits) before it is killed.
CLOSE_GRACE_S = 2.0
# <linux/prctl.h>
PR_SET_PDEATHSIG = 1


def is_remote(target: str | None) -> bool:
    return bool(target) and target.startswith(SCHEME)


@dataclass(frozen=True)
class SshTarget:
    """ssh://[user@]host[:port]; host may be an alias of the ssh config."""

    host: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, target: str) -> SshTarget:
        if not is_remote(target):
            raise ValueError(f"{target!r} is not an ssh:// address: give ssh://[user@]host[:port]")
        try:
            parts = urlsplit(target)
        except ValueError as err:                # an unbalanced [ or ] of an IPv6 address
            raise ValueError(f"{target!r}: {err}: give ssh://[user@]host[:port], an IPv6 host "
                             "in brackets as ssh://[fd00::1]:22") from None
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.password is not None:
            raise ValueError(f"{target!r}: an ssh:// address is ssh://[user@]host[:port], nothing more "
                             "(keys and options go in the ssh config, SshOptions or DSEC_SSH_COMMAND)")
        try:
            port = parts.port
        except ValueError:
            port = 0
        if port == 0:            # urlsplit takes port 0, which ssh would read as "the default port"
            raise ValueError(f"{target!r}: the port must be a number from 1 to 65535")
        if not parts.hostname:
            raise ValueError(f"{target!r}: no host name")
        if parts.hostname.startswith("-"):
            # ssh refuses it, and in the `ssh ... HOST true` an error suggests
            # trying, it would be read as one of ssh's options.
            raise ValueError(f"{target!r}: a host name cannot begin with '-'")
        return cls(host=parts.hostname, user=parts.username or None, port=port)

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}{self.user + '@' if self.user else ''}{host}{':' + str(self.port) if self.port else ''}"


@dataclass
class SshOptions:
    """How to reach a host's daemon over ssh. Each field's default may come
    from the environment (from_env): the names are in brackets.

    command:      the ssh program and options before ours [DSEC_SSH_COMMAND,
                  shell words, e.g. "ssh -i key"; default "ssh"]
    config:       an ssh config file to use instead of ~/.ssh/config (ssh -F)
                  [DSEC_SSH_CONFIG]
    remote_dsec:  the dsec command on the host, as shell words [DSEC_REMOTE_DSEC;
                  default "dsec", found on the host's PATH]
    remote_socket: the daemon's socket on the host [DSEC_REMOTE_SOCKET; default:
                  the host's own default, its DSEC_SOCKET or /run/dsecd/dsecd.sock]
    keepalive_s, keepalive_count: ssh's ServerAliveInterval and
                  ServerAliveCountMax: a host silent for their product ends the
                  connection
    connect_timeout_s: ssh's ConnectTimeout
    options:      more `-o` options for ssh ("Compression=yes")
    """

    command: list[str] = field(default_factory=lambda: ["ssh"])
    config: str | None = None
    remote_dsec: str = "dsec"
    remote_socket: str | None = None
    keepalive_s: int = 5
    keepalive_count: int = 3
    connect_timeout_s: int = 10
    options: list[str] = field(default_factory=list)

    @classmethod
    def from_env(cls, env: dict | None = None, **given) -> SshOptions:
        """Defaults from the environment, then `given` (None values ignored)."""
        env = os.environ if env is None else env
        out = cls()
        if env.get("DSEC_SSH_COMMAND"):
            out.command = shlex.split(env["DSEC_SSH_COMMAND"])
        out.config = env.get("DSEC_SSH_CONFIG") or None
        out.remote_dsec = env.get("DSEC_REMOTE_DSEC") or out.remote_dsec
        out.remote_socket = env.get("DSEC_REMOTE_SOCKET") or None
        return replace(out, **{k: v for k, v in given.items() if v is not None})

    def remote_command(self) -> str:
        """The command line the host's shell runs."""
        words = shlex.split(self.remote_dsec)
        if self.remote_socket:
            words += ["--socket", self.remote_socket]
        return shlex.join([*words, "rpc", "--stdio"])

    def argv(self, target: SshTarget) -> list[str]:
        if not self.command:
            raise ValueError("SshOptions.command is empty: give the ssh program, e.g. ['ssh']")
        argv = [*self.command, "-T", "-e", "none",
                "-o", "BatchMode=yes",                  # never a password prompt: fail instead
                "-o", f"ServerAliveInterval={max(1, int(self.keepalive_s))}",
                "-o", f"ServerAliveCountMax={max(1, int(self.keepalive_count))}",
                "-o", f"ConnectTimeout={max(1, int(self.connect_timeout_s))}",
                "-o", "ClearAllForwardings=yes"]        # a config's forwards must not fail the link
        if self.config:
            argv += ["-F", self.config]
        for opt in self.options:
            argv += ["-o", opt]
        if target.port:
            argv += ["-p", str(target.port)]
        if target.user:
            argv += ["-l", target.user]
        return [*argv, "--", target.host, self.remote_command()]


def _die_with(parent: int):
    """A preexec_fn that makes ssh die (SIGKILL) with the thread that starts
    it: the client's event loop, so with the client's process.

    Nothing else would end it. Its own session keeps it from the terminal's
    signals, and the end of its stdin (our end of the socketpair closed by
    the kernel) only half-closes the remote `dsec rpc --stdio`, which then
    runs every request already sent to its end (a scripted half close must
    keep working that way). A dead ssh instead ends the sshd session: the
    relay's stdout loses its reader and it closes the daemon connection, so
    the daemon cancels that client's requests and kills its execs, as it
    does for a local client whose socket closes. The prctl function is
    looked up here, before the fork: the child only calls it. None where
    there is no prctl (a client on macOS): there ssh outlives a killed
    client as before."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except AttributeError:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:       # the client died before the prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class SshLink:
    """One ssh process carrying one protocol connection."""

    def __init__(self, target: SshTarget, options: SshOptions):
        self.target = target
        self.options = options
        self.argv = options.argv(target)
        self.proc: asyncio.subprocess.Process | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._stderr_task: asyncio.Task | None = None
        self.aborted: str | None = None          # why this side ended it, if it did
        # The daemon answered through it (the client's hello): a later 255 is
        # the connection dropping, not a login that failed.
        self.established = False

    async def open(self, protocol_factory):
        """Start ssh; (transport, protocol) of our end of its stdin/stdout."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                # Its own session: a Ctrl-C at the terminal reaches the program,
                # which then closes the connection in order, not ssh.
                self.proc = await asyncio.create_subprocess_exec(
                    *self.argv, stdin=theirs, stdout=theirs, stderr=asyncio.subprocess.PIPE,
                    start_new_session=True, preexec_fn=_die_with(os.getpid()))
            except FileNotFoundError:
                raise ConnectionError(
                    f"cannot reach {self.target.url()}: the ssh program {self.argv[0]!r} was not found; "
                    "install openssh-client, or name the program in DSEC_SSH_COMMAND "
                    "(SshOptions.command)") from None
            finally:
                theirs.close()
            self._stderr_task = asyncio.get_running_loop().create_task(self._collect_stderr())
            return await asyncio.get_running_loop().create_unix_connection(protocol_factory, sock=ours)
        except BaseException:
            ours.close()
            self.kill()
            raise

    async def _collect_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode("utf-8", "replace").strip()
            if text:
                self._stderr.append(text[:500])

    def kill(self) -> None:
        """End ssh now (our own child, by its pid)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)

    async def close(self, grace: float = CLOSE_GRACE_S) -> None:
        """Once our end of the socket is closed: wait up to `grace` for ssh to
        exit by itself, then kill it; reap it either way."""
        if self.proc is None:
            return
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            self.kill()
            await self.proc.wait()
        if self._stderr_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._stderr_task, EXIT_WAIT_S)

    async def why_ended(self) -> str:
        """Why the connection ended, for an error message: ssh's exit status
        read as ssh's own failure, a missing remote command or the remote
        dsec's failure, with the last of what ssh and the remote printed."""
        if self.aborted:
            return self.aborted
        if self.proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), EXIT_WAIT_S)
            if self._stderr_task is not None:
                with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(self._stderr_task), EXIT_WAIT_S)
        return self.describe()

    def check_command(self) -> str:
        """The ssh command line that tries this host as the link does: same
        program, config file, port and user, running `true`."""
        words = [*self.options.command, "-o", "BatchMode=yes"]
        if self.options.config:
            words += ["-F", self.options.config]
        if self.target.port:
            words += ["-p", str(self.target.port)]
        if self.target.user:
            words += ["-l", self.target.user]
        return shlex.join([*words, self.target.host, "true"])

    def describe(self) -> str:
        host = self.target.url()
        # ssh's lines may end with a period; the sentences below add their own.
        said = " | ".join(self._stderr).rstrip(".") or "nothing on stderr"
        rc = None if self.proc is None else self.proc.returncode
        if rc is None:
            return f"ssh to {host} closed the connection but has not exited ({said})"
        if rc == SSH_FAILED and self.established:
            return (f"the ssh connection to {host} dropped after it had worked: {said}. The host, its sshd "
                    "or the network path to it went away; check that it is up and reachable")
        if rc == SSH_FAILED:
            return (f"ssh to {host} failed: {said}. Check that `{self.check_command()}` works from here "
                    "(keys or agent, known_hosts, ssh config)")
        if rc == NOT_FOUND:
            return (f"{self.options.remote_dsec!r} was not found on {host} ({said}); install dsecd there, or "
                    "give the path of its dsec: remote_dsec=..., --remote-dsec, DSEC_REMOTE_DSEC")
        if rc == NOT_EXECUTABLE:
            return f"{self.options.remote_dsec!r} on {host} cannot be run ({said})"
        if rc < 0:
            return f"ssh to {host} was killed by signal {-rc} ({said})"
        if rc == 0:
            return f"the daemon on {host} closed the connection"
        return f"the remote `{self.options.remote_command()}` on {host} exited {rc}: {said}"
