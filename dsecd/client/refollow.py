"""How a follow (Client.events, Sandbox.watch, Process.output) is taken
up again after each lost connection, and when it is given up.
"""

from __future__ import annotations

import asyncio

from ..errors import ConnectionLost
from . import wire

# A follow taken up again after each lost connection (Client.events,
# Sandbox.watch, Process.output) ends once it was lost this many times in
# a row with no frame of it come: the daemon takes the connection and
# drops the request, every time (it fails on it), and asking again would
# go on for ever. A daemon restart with nothing since is such a loss too,
# so a few in a row are let through; an attach that lived
# FOLLOW_ATTACHED_S before its loss was a follow the daemon took, and
# counts again from none.
FOLLOW_LOST_MAX = 8
FOLLOW_ATTACHED_S = 10.0


class _Refollow:
    """How a follow (Client.events, Sandbox.watch, Process.output) is taken
    up again after each lost connection: at once after one of which a
    frame came; else after a gap, doubled at each such loss in a row (a
    daemon that drops the connection at once is not asked in a tight loop;
    a restart drops it once), and not after FOLLOW_LOST_MAX of them (lost
    raises)."""

    def __init__(self):
        # Paced as a reconnect is: wire's gaps, read there at each use.
        self.gap = wire.RECONNECT_GAP_S
        self.in_a_row = 0             # losses with no frame come, none of a lived attach between
        self.began = 0.0

    def attach(self) -> None:
        self.began = asyncio.get_running_loop().time()

    async def lost(self, err: ConnectionLost, came: bool) -> None:
        """The attach begun last was lost with `err`; `came`: a frame of it came."""
        if came:
            self.in_a_row, self.gap = 0, wire.RECONNECT_GAP_S
            return
        if asyncio.get_running_loop().time() - self.began >= FOLLOW_ATTACHED_S:
            self.in_a_row, self.gap = 0, wire.RECONNECT_GAP_S
        self.in_a_row += 1
        if self.in_a_row >= FOLLOW_LOST_MAX:
            raise ConnectionLost(
                f"{err}; it was lost {self.in_a_row} times in a row without a frame of it coming: the daemon "
                "takes the connection and drops the request each time (see its log), so it was not asked again",
                target=err.target, op=err.op, sent=err.sent) from None
        self.gap = min(2 * self.gap, wire.RECONNECT_GAP_MAX_S)
        await asyncio.sleep(self.gap)
