"""A sandbox that goes when its block (or a run) ends: Client.sandbox()'s
context, and the destroy on the way out, shielded from a cancel, sent
again after a lost connection, its failure said when nobody is left to
raise it to.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ..errors import Conflict, ConnectionLost, DsecError, NotFound
from .wire import _reconnects

if TYPE_CHECKING:
    from .sandbox import Sandbox


# The SDK's one logger, whichever of its modules logs: a caller's logging
# configuration names it.
log = logging.getLogger("dsecd.client")


class _SandboxContext:
    """Client.sandbox() (and Fleet.sandbox(): `client` is then the fleet):
    create on enter, destroy (force) on exit."""

    def __init__(self, client, image: str, create_args: dict):
        self.client = client
        self.image = image
        self.create_args = create_args
        self.sandbox: Sandbox | None = None

    async def __aenter__(self) -> Sandbox:
        self.sandbox = await self.client.create(self.image, **self.create_args)
        return self.sandbox

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self.sandbox is not None:
            try:
                await _destroy_on_the_way_out(self.sandbox)
            except NotFound:
                pass                        # destroyed inside the block already
            except (DsecError, ConnectionError) as err:
                if exc_type is None:
                    raise
                # The block's own error (a cancel, an asyncio.timeout's)
                # is the one raised: replaced, a timeout would not be one,
                # a TaskGroup's cancelled task would fail.
                _left_behind(self.sandbox, err)


def _left_behind(sb, err: BaseException) -> None:
    """Say that the destroy of `sb`, on the way out of a sandbox() block (or
    a run) that ended by an error of its own, failed with `err`: that error
    is raised, or nobody is left to raise it to."""
    log.warning("sandbox %s on %s was not destroyed as its block ended (%s); remove it with "
                "`dsec rm --force %s`", sb.id, sb.host, err, sb.id)


async def _destroy_on_the_way_out(sb) -> dict:
    """sb.destroy(force=True) for a block or a run that ends, however it
    ends. Shielded: a cancel is one way to get here, and the sandbox must
    go all the same. A second cancel ends the caller's wait, not the
    destroy: it goes on as one of its client's undos (close() waits for
    them), and its failure is logged then, as nobody is left to raise it
    to. Its own failure is raised to a caller that waits."""
    destroy = asyncio.ensure_future(_destroy_again_if_lost(sb))
    undoing = getattr(sb.client, "_undoing", None)
    if undoing is not None:
        undoing.add(destroy)
        destroy.add_done_callback(undoing.discard)
    try:
        return await asyncio.shield(destroy)
    except asyncio.CancelledError:
        destroy.add_done_callback(lambda fut: _unheard_destroy(sb, fut))
        raise


async def _destroy_again_if_lost(sb) -> dict:
    """sb.destroy(force=True), sent again once if its connection was lost
    after it was sent (a daemon restart), on a client that reconnects: the
    first may have run, in part or whole, and the second ends what it did
    not, or finds the sandbox gone (NotFound, which the callers take as
    done), or still being destroyed by the first (the same daemon, reached
    again over ssh://: it finishes a destroy whose client went)."""
    try:
        return await sb.destroy(force=True)
    except ConnectionLost as err:
        if not (err.sent and _reconnects(sb.client)):
            raise
    try:
        return await sb.destroy(force=True)
    except Conflict:
        info = await sb.client.request("inspect", sandbox=sb.id)        # NotFound: gone since
        if info.get("state") != "stopping":
            raise
        return {"id": sb.id, "previous_state": None}


def _unheard_destroy(sb, fut: asyncio.Future) -> None:
    """The end of a destroy whose caller stopped waiting for it: a failure
    said (and retrieved), as nobody else will see it."""
    if fut.cancelled():
        _left_behind(sb, asyncio.CancelledError("its destroy was cancelled (the event loop ended?)"))
    elif (err := fut.exception()) is not None and not isinstance(err, NotFound):
        _left_behind(sb, err)
