"""Client.hold renews leases in the background for as long as the client
lives, across a connection that drops and comes back (no daemon: the
client's renew is a stand-in)."""

from __future__ import annotations

import asyncio

from dsecd import BadRequest, Client, ConnectionLost


def test_hold_goes_on_renewing_after_the_connection_dropped():
    """One renew fails (a daemon restarted, an ssh connection dropped: the
    sandboxes live on): the next ones are still sent, so their leases do
    not run out while the client holds them."""
    async def go():
        c = Client("/nonexistent/dsecd.sock")
        calls = []

        async def renew(ids, lease=None):
            calls.append(list(ids))
            if len(calls) == 2:
                raise ConnectionLost("renew on /nonexistent/dsecd.sock: connection lost", op="renew", sent=True)
            return {"renewed": list(ids), "missing": []}

        c.renew = renew
        task = c.hold(["sb1"], lease=0.3)                # renewed every 0.1 s
        await asyncio.sleep(0.8)
        alive = not task.done()
        task.cancel()
        return alive, calls

    alive, calls = asyncio.run(go())
    assert alive and len(calls) >= 4 and calls[-1] == ["sb1"], calls


def test_hold_of_a_closed_client_ends():
    async def go():
        c = Client("/nonexistent/dsecd.sock")
        await c.close()
        task = c.hold(["sb1"], lease=0.3)
        await asyncio.wait_for(task, 2.0)
        return task

    task = asyncio.run(go())
    assert task.done() and task.exception() is None


def test_hold_takes_a_lease_as_create_does_and_refuses_a_bad_one_at_once():
    """A lease as create(lease=) takes it, "5m" too; one the daemon would
    refuse fails the hold() call itself, not the renewing task behind it,
    where nobody would see it while the leases ran out."""
    async def go():
        c = Client("/nonexistent/dsecd.sock")
        sent = []

        async def renew(ids, lease=None):
            sent.append(lease)
            return {"renewed": list(ids), "missing": []}

        c.renew = renew
        task = c.hold(["sb1"], lease="6m")
        await asyncio.sleep(0.1)
        alive = not task.done()
        task.cancel()
        refused = []
        for bad in ({"lease": 0}, {"lease": "soon"}, {"lease": None, "every": 0}, {"lease": -3},
                    {"lease": "10 min", "every": 30}):       # a bad lease beside a good period
            try:
                c.hold(["sb1"], **bad)
            except (ValueError, BadRequest) as err:
                refused.append(str(err))
        return alive, sent, refused

    alive, sent, refused = asyncio.run(go())
    assert alive and sent == ["6m"], sent
    assert len(refused) == 5, refused
