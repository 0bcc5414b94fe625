"""`docker run` in the SDK: an image's Entrypoint and Cmd in a sandbox of
its own, streamed (RunStream, Client.run_stream and run) or in the
background (run_detached).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from .. import imageconfig
from ..config import parse_duration
from ..errors import BadRequest, DsecError, NotFound
from .args import Stdin
from .blocks import _destroy_on_the_way_out, _left_behind
from .execs import ExecStream
from .processes import Process
from .results import ExecResult

if TYPE_CHECKING:
    from .core import Client
    from .sandbox import Sandbox


# The lease of a sandbox Client.run makes and removes: renewed while the
# command runs, so a client that dies without removing it (SIGKILL, a lost
# host) leaves it to the daemon, which destroys it this long after.
RUN_LEASE_S = 60.0


def _run_args(args: list[str] | None) -> list[str] | None:
    if args is not None and (isinstance(args, str) or not all(isinstance(a, str) for a in args)):
        raise TypeError(f"args must be a list of strings (they replace the image's Cmd), got {args!r}")
    return None if args is None else list(args)


async def _run_argv(client, image: str, args: list[str] | None, entrypoint: list[str] | str | None) -> list[str]:
    """What a run of `image` starts, as docker run says: its Entrypoint and
    Cmd, args replacing Cmd, entrypoint replacing Entrypoint (and Cmd)."""
    config = (await client.inspect_image(image))["config"]
    try:
        return imageconfig.run_argv(config, args, entrypoint)
    except imageconfig.ConfigError as err:
        raise BadRequest(f"run {image}: {err} (args=)", {"image": image, "needs": "command"}) from None


async def run_detached(client, image: str, args: list[str] | None = None,
                       entrypoint: list[str] | str | None = None, **create_args) -> Process:
    """`docker run -d` on `client` (a Client, or anything with its
    inspect_image and create: the fleet's placing one): a sandbox of `image`
    with the run's command started in it as a background process. If the
    command cannot be started the sandbox is removed again, so a failed or
    cancelled run leaves nothing behind."""
    argv = await _run_argv(client, image, _run_args(args), entrypoint)
    sb = await client.create(image, **create_args)
    try:
        return await sb.spawn(argv)
    except BaseException:
        try:
            await _destroy_on_the_way_out(sb)
        except NotFound:
            pass
        except (DsecError, ConnectionError) as err:
            _left_behind(sb, err)           # the spawn's error is the one raised
        raise


class RunStream:
    """Client.run_stream: an image's command in a sandbox of its own, which
    goes when the block ends. Iterate it for (fd, data)."""

    def __init__(self, client: Client, image: str, args: list[str] | None, entrypoint: list[str] | str | None,
                 timeout: float | None, stdin: Stdin | None, remove: bool,
                 create_args: dict, terminal: dict | None = None):
        self.client = client
        self.terminal = terminal or {}          # exec_stream's pty, rows, cols
        self.image = image
        self.args = _run_args(args)
        self.entrypoint = entrypoint
        self.timeout = timeout
        self.stdin = stdin
        self.remove = remove
        self.create_args = create_args
        self.argv: list[str] | None = None          # what runs, once the block is entered
        self.sandbox: Sandbox | None = None
        self.stream: ExecStream | None = None
        self._hold: asyncio.Task | None = None

    @property
    def result(self) -> ExecResult | None:
        return self.stream.result if self.stream is not None else None

    async def __aenter__(self) -> RunStream:
        self.argv = await _run_argv(self.client, self.image, self.args, self.entrypoint)
        create_args = dict(self.create_args)
        if self.remove:
            create_args.setdefault("lease", RUN_LEASE_S)
        self.sandbox = await self.client.create(self.image, **create_args)
        try:
            if self.remove:      # renewed at a third of the lease, to the lease it was made with
                every = parse_duration(create_args["lease"], "lease") / 3
                # The sandbox's own client: a fleet's run (dsec fleet run) made it on its host's.
                self._hold = self.sandbox.client.hold([self.sandbox.id], None, every)
            self.stream = self.sandbox.exec_stream(self.argv, timeout=self.timeout, stdin=self.stdin,
                                                   **self.terminal)
        except BaseException:
            await self._remove(True)
            raise
        return self

    async def __aiter__(self):
        assert self.stream is not None, "iterate a RunStream inside its `async with` block"
        async with contextlib.aclosing(aiter(self.stream)) as chunks:      # closed with this one
            async for chunk in chunks:
                yield chunk

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self._remove(exc_type is not None)

    async def _remove(self, failing: bool) -> None:
        if self._hold is not None:
            self._hold.cancel()
            with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
                await self._hold
        if not self.remove or self.sandbox is None:
            return
        # A cancel (Ctrl-C in `dsec run`) is what often brings us here.
        try:
            await _destroy_on_the_way_out(self.sandbox)
        except NotFound:
            pass                                   # gone already (its lease ran out, or removed by hand)
        except (DsecError, ConnectionError) as err:
            if not failing:                        # else the error that brought us here is the one to see
                raise
            _left_behind(self.sandbox, err)
