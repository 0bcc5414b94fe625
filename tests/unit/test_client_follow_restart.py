"""Process.output() across a lost connection (a daemon restart: the
process runs on), against stand-in daemons on a unix socket: each
connection's proc_logs answered from a script, the first one cut short."""

from __future__ import annotations

import asyncio
import os

import pytest
from standin_kit import serving

from dsecd import ConnectionLost, DsecError, NotFound, protocol
from dsecd.client import Client, Process, ProcOutput, Sandbox


def _chunk(data: bytes, at: float) -> dict:
    return {"fd": 1, "data": data, "time": at}


def _follow_across(tmp_path, lives: list[list[dict]], since: float | None = None,
                   reconnect: bool = True) -> tuple[list, list[dict]]:
    """Follow pid 3's output while each of `lives` (the stream frames one
    connection's proc_logs gets) is served in turn: every one but the last
    ends with the connection cut, the last with the process's end. Returns
    what output() gave (its ProcOutputs, then the error that ended it, if
    any) and the args of each proc_logs the daemons got."""
    sock_path = str(tmp_path / "d.sock")
    asked: list[dict] = []

    async def answer(f: dict, writer) -> bool:
        if f["op"] != "proc_logs":
            writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
            return False
        asked.append(f["args"])
        life = lives[len(asked) - 1]
        for stream in life:
            writer.write(protocol.encode_frame({"id": f["id"], "stream": stream}))
        if len(asked) < len(lives):
            await writer.drain()
            writer.transport.abort()           # the daemon goes (the process runs on)
            return True
        writer.write(protocol.encode_frame({"id": f["id"], "result": {"pid": 3, "state": "exited"}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        got: list = []
        async with server:
            async with Client(sock_path, reconnect=reconnect) as c:
                try:
                    async for chunk in Process(Sandbox(c, "sb", {}), 3).output(since=since):
                        got.append(chunk)
                except ConnectionLost as err:
                    got.append(err)
        return got

    return asyncio.run(asyncio.wait_for(go(), 30)), asked


def test_a_follower_goes_on_after_a_clean_restart_with_nothing_lost_or_repeated(tmp_path):
    """A container's process after a clean restart: the next daemon's ring
    starts where the old one had read to (its first frame's `dropped`), and
    what it reads is new. The follower had failed with ConnectionLost as if
    the process's output had ended."""
    got, asked = _follow_across(tmp_path, [
        [{"dropped": 0}, _chunk(b"one\n", 1.0), _chunk(b"two\n", 2.0)],
        [{"dropped": 8}, _chunk(b"three\n", 3.0)],
    ])
    assert got == [ProcOutput(1, b"one\n", 1.0), ProcOutput(1, b"two\n", 2.0), ProcOutput(1, b"three\n", 3.0)]
    assert len(asked) == 2 and asked[1]["follow"] is True


def test_a_follower_is_told_what_the_old_daemon_read_and_never_sent(tmp_path):
    """The old daemon had read 4 bytes more than reached the follower: they
    went with it, counted as dropped, not as the whole output before."""
    got, _ = _follow_across(tmp_path, [
        [{"dropped": 0}, _chunk(b"one\n", 1.0)],
        [{"dropped": 8}, _chunk(b"three\n", 3.0)],
    ])
    assert got == [ProcOutput(1, b"one\n", 1.0), ProcOutput(0, b"", 0.0, 4), ProcOutput(1, b"three\n", 3.0)]


def test_a_follower_of_a_ring_that_outlived_the_connection_gets_no_chunk_twice(tmp_path):
    """A microVM's ring (its agent keeps it across a restart), or the same
    daemon reached again: what came before the loss comes again from the
    ring, and is passed over, part of a chunk too."""
    got, _ = _follow_across(tmp_path, [
        [{"dropped": 2}, _chunk(b"one\n", 1.0), _chunk(b"two\n", 2.0)],
        [{"dropped": 3}, _chunk(b"ne\ntwo\n", 1.0), _chunk(b"three\n", 3.0)],
    ])
    assert got == [ProcOutput(0, b"", 0.0, 2), ProcOutput(1, b"one\n", 1.0), ProcOutput(1, b"two\n", 2.0),
                   ProcOutput(1, b"three\n", 3.0)]


def test_a_follower_is_told_only_of_what_it_lost_itself_from_a_ring_it_reads_again(tmp_path):
    """Bytes the ring's second reading dropped on the way (a follower too
    slow) that had come before the loss are no loss."""
    got, _ = _follow_across(tmp_path, [
        [{"dropped": 2}, _chunk(b"one\n", 1.0), _chunk(b"two\n", 2.0)],
        [{"dropped": 3}, {"dropped": 5}, _chunk(b"o\n", 2.0), _chunk(b"three\n", 3.0), {"dropped": 4},
         _chunk(b"five\n", 5.0)],
    ])
    assert got == [ProcOutput(0, b"", 0.0, 2), ProcOutput(1, b"one\n", 1.0), ProcOutput(1, b"two\n", 2.0),
                   ProcOutput(1, b"three\n", 3.0), ProcOutput(0, b"", 0.0, 4), ProcOutput(1, b"five\n", 5.0)]


def test_a_follower_after_a_daemon_that_died_is_told_of_the_uncounted_loss(tmp_path):
    """A daemon that died took what it had read without a count: the next
    one says so (`lost_before`), and everything in its ring is new."""
    got, _ = _follow_across(tmp_path, [
        [{"dropped": 0}, _chunk(b"one\n", 1.0), _chunk(b"two\n", 2.0)],
        [{"dropped": 0, "lost_before": 2.5}, _chunk(b"three\n", 3.0)],
    ])
    assert got == [ProcOutput(1, b"one\n", 1.0), ProcOutput(1, b"two\n", 2.0),
                   ProcOutput(0, b"", 0.0, 0, 2.5), ProcOutput(1, b"three\n", 3.0)]


def test_a_follower_since_a_time_asks_again_just_past_its_last_chunk(tmp_path):
    """With `since` the offsets of what came are not known: the follower
    asks again for what was read after its last chunk."""
    got, asked = _follow_across(tmp_path, [
        [{"dropped": 0}, _chunk(b"two\n", 2.0)],
        [{"dropped": 0}, _chunk(b"three\n", 3.0)],
    ], since=1.5)
    assert got == [ProcOutput(1, b"two\n", 2.0), ProcOutput(1, b"three\n", 3.0)]
    assert asked[0]["since"] == 1.5 and 2.0 < asked[1]["since"] < 2.001


def test_a_follower_whose_client_does_not_reconnect_says_the_process_runs_on(tmp_path):
    got, asked = _follow_across(tmp_path, [
        [{"dropped": 0}, _chunk(b"one\n", 1.0)],
        [{"dropped": 0}],
    ], reconnect=False)
    assert got[0] == ProcOutput(1, b"one\n", 1.0) and len(asked) == 1
    err = got[1]
    assert isinstance(err, ConnectionLost) and err.op == "proc_logs"
    said = str(err)
    assert "process 3 in sandbox sb runs on" in said and ".output(since=1.0000000000000002)" in said, said


def _line(n: int) -> dict:
    return _chunk(f"line {n}\n".encode(), float(n))


def test_a_follower_lost_again_and_again_before_the_daemon_answers_goes_on_with_every_line_once(
        tmp_path, monkeypatch):
    """Connections cut as soon as the follow was sent, FOLLOW_LOST_MAX - 1
    times in a row (daemon restarts with nothing answered between), twice,
    with a ring that outlived them (a microVM's, the same daemon's) read
    again between: the follow goes on, as Client.events() and watch() do,
    and every numbered line comes once. It gave up at the first such loss."""
    from dsecd.client import refollow, wire

    monkeypatch.setattr(wire, "RECONNECT_GAP_S", 0.001)
    monkeypatch.setattr(wire, "RECONNECT_GAP_MAX_S", 0.001)
    unanswered = [[]] * (refollow.FOLLOW_LOST_MAX - 1)
    got, asked = _follow_across(tmp_path, [
        [{"dropped": 0}, _line(1), _line(2), _line(3)],
        *unanswered,
        [{"dropped": 0}, *map(_line, range(1, 6))],
        *unanswered,
        [{"dropped": 0}, *map(_line, range(1, 9))],
    ])
    assert got == [ProcOutput(1, f"line {n}\n".encode(), float(n)) for n in range(1, 9)], got
    assert len(asked) == 3 + 2 * len(unanswered) and all(a["follow"] is True for a in asked)


def test_a_follower_lost_follow_lost_max_times_in_a_row_gives_up_saying_the_process_runs_on(
        tmp_path, monkeypatch):
    """A daemon that takes the connection and drops the follow every time
    (one failing on it): after FOLLOW_LOST_MAX losses in a row it is not
    asked again, and the error says so and how to follow the process."""
    from dsecd.client import refollow, wire

    monkeypatch.setattr(wire, "RECONNECT_GAP_S", 0.001)
    monkeypatch.setattr(wire, "RECONNECT_GAP_MAX_S", 0.001)
    got, asked = _follow_across(tmp_path, [[{"dropped": 0}, _line(1)], *[[]] * refollow.FOLLOW_LOST_MAX,
                                           [{"dropped": 0}]])
    assert got[0] == ProcOutput(1, b"line 1\n", 1.0) and len(asked) == 1 + refollow.FOLLOW_LOST_MAX
    err = got[1]
    assert isinstance(err, ConnectionLost) and err.op == "proc_logs" and err.sent, err
    said = str(err)
    assert f"lost {refollow.FOLLOW_LOST_MAX} times in a row without a frame" in said, said
    assert "process 3 in sandbox sb runs on" in said and ".output(since=1.0000000000000002)" in said, said


def _tar_of(files: dict[str, bytes]) -> bytes:
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_directory_copied_out_across_a_restart_is_copied_again_whole(tmp_path):
    """download_dir spools the tar before anything reaches `local`: a
    connection lost under it (a daemon restart) left nothing to undo, and
    the copy, which changes nothing in the sandbox, goes again on the next
    connection instead of failing."""
    tar = _tar_of({"a": b"first\n", "b": b"second\n" * 1000})
    sock_path = str(tmp_path / "d.sock")
    asked: list[dict] = []

    async def answer(f: dict, writer) -> bool:
        if f["op"] != "file_tar_get":
            writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
            return False
        asked.append(f["args"])
        if len(asked) == 1:
            writer.write(protocol.encode_frame({"id": f["id"], "stream": {"data": tar[:1024]}}))
            await writer.drain()
            writer.transport.abort()
            return True
        writer.write(protocol.encode_frame({"id": f["id"], "stream": {"data": tar}}))
        writer.write(protocol.encode_frame({"id": f["id"], "result": {"path": "/work", "count": 2,
                                                                      "bytes": len(tar), "skipped": []}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                return await asyncio.wait_for(Sandbox(c, "sb", {}).download_dir("/work", str(tmp_path / "out")), 30)

    r = asyncio.run(go())
    assert r["count"] == 2 and len(asked) == 2
    assert (tmp_path / "out" / "a").read_bytes() == b"first\n"
    assert (tmp_path / "out" / "b").read_bytes() == b"second\n" * 1000


def _ev(seq: int, at: float, kind: str = "paused") -> dict:
    return {"seq": seq, "time": at, "event": kind, "sandbox": "sb"}


def _events_across(tmp_path, lives: list[list[dict]], now: float = 0.0, end: dict | None = None,
                   **kwargs) -> tuple[list, list[dict]]:
    """Client.events(**kwargs) while each of `lives` (the events one
    connection's request gets) is served in turn, every one but the last
    cut short by the daemon going; the last then ends the request, with the
    error `end` if given. What events() gave (then the error that ended it,
    if any), and the args of each events request. `now`: the daemon's time,
    as ping answers it."""
    sock_path = str(tmp_path / "d.sock")
    asked: list[dict] = []

    async def answer(f: dict, writer) -> bool:
        if f["op"] != "events":
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"time": now} if f["op"] == "ping" else {}}))
            return False
        asked.append(f["args"])
        for ev in lives[len(asked) - 1]:
            writer.write(protocol.encode_frame({"id": f["id"], "stream": ev}))
        if len(asked) < len(lives):
            await writer.drain()
            writer.transport.abort()
            return True
        writer.write(protocol.encode_frame({"id": f["id"], **({"error": end} if end else {"result": {}})}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        got: list = []
        async with server:
            async with Client(sock_path) as c:
                try:
                    async for ev in c.events(**kwargs):
                        got.append(ev)
                except (ConnectionLost, DsecError) as err:      # `end` is a DsecError
                    got.append(err)
        return got

    return asyncio.run(asyncio.wait_for(go(), 30)), asked


def test_an_events_follower_goes_on_after_a_daemon_restart(tmp_path):
    """The next daemon numbers its events from 1 again and keeps its own
    recent history: the follower asks for it (replay), so that what it
    published before the follow was taken up again is not missed."""
    got, asked = _events_across(tmp_path, [
        [_ev(1, 1.0), _ev(2, 2.0)],
        [_ev(1, 5.0, "died"), _ev(2, 6.0)],
    ], sandbox="sb")
    assert got == [_ev(1, 1.0), _ev(2, 2.0), _ev(1, 5.0, "died"), _ev(2, 6.0)]
    assert [a["replay"] for a in asked] == [False, True] and asked[1]["sandbox"] == "sb"


def test_an_events_follower_of_a_prefix_follows_the_sandbox_it_named_after_a_restart(tmp_path):
    """events(sandbox=PREFIX) was followed again with the prefix, which the
    next daemon resolves again: by then it may name another sandbox (the
    one it named destroyed, a new one sharing the prefix), or be ambiguous.
    Followed again, it asks for the id its events carried."""
    first = {**_ev(1, 1.0), "sandbox": "abc123"}
    got, asked = _events_across(tmp_path, [[first], [{**_ev(1, 5.0), "sandbox": "abc123"}]], sandbox="abc")
    assert [a["sandbox"] for a in asked] == ["abc", "abc123"]
    assert len(got) == 2


def test_an_events_follower_of_a_sandbox_the_next_daemon_has_not_says_so(tmp_path):
    """Followed again after a daemon restart, the events of a sandbox the
    next daemon does not know (destroyed before it, or meanwhile) ended
    with its answer alone, "no sandbox 'sb' (see `dsec ps`)", as if the
    follow had named a sandbox that never was."""
    error = {"code": "not_found", "message": "no sandbox 'sb' (see `dsec ps`)", "detail": {"sandbox": "sb"}}
    got, asked = _events_across(tmp_path, [[_ev(1, 1.0, "destroyed")], []], end=error, sandbox="sb")
    err = got.pop()
    assert isinstance(err, NotFound), err
    assert got == [_ev(1, 1.0, "destroyed")] and len(asked) == 2
    assert "lost" in err.message and "no sandbox 'sb'" in err.message and err.detail == {"sandbox": "sb"}, err


def test_an_events_follower_of_the_same_daemon_gets_no_event_twice(tmp_path):
    """A connection lost while the daemon stays (an ssh:// link): its
    history has what came already, passed over."""
    got, _ = _events_across(tmp_path, [
        [_ev(1, 1.0), _ev(2, 2.0)],
        [_ev(1, 1.0), _ev(2, 2.0), _ev(3, 3.0)],
    ], replay=True)
    assert got == [_ev(1, 1.0), _ev(2, 2.0), _ev(3, 3.0)]


def test_an_events_follower_without_replay_gets_no_event_from_before_it_began(tmp_path):
    """A connection lost while the daemon stays (an ssh:// link) before any
    event came: the follow asked again with the daemon's history, and gave
    all of it, events from before it began, as if they were new."""
    got, asked = _events_across(tmp_path, [
        [],
        [_ev(1, 1.0, "destroyed"), _ev(2, 2.0, "created"), _ev(3, 6.0)],
    ], now=5.0)
    assert got == [_ev(3, 6.0)]
    assert [a["replay"] for a in asked] == [False, True]


def test_a_watch_goes_on_after_a_daemon_restart_saying_what_it_may_have_missed(tmp_path):
    """sb.watch() had ended with ConnectionLost. It watches again on the
    next connection; the changes made while nothing watched are unknown,
    which the new watch's `ready` says as the `overflow` it is (list the
    tree again)."""
    sock_path = str(tmp_path / "d.sock")
    lives = [
        [{"kind": "ready", "path": "/work", "is_dir": True, "dirs": 1},
         {"kind": "create", "path": "/work/a", "is_dir": False}],
        [{"kind": "ready", "path": "/work", "is_dir": True, "dirs": 1},
         {"kind": "create", "path": "/work/b", "is_dir": False},
         {"kind": "stopped", "path": "/work", "is_dir": True, "reason": "deleted"}],
    ]
    asked: list[dict] = []

    async def answer(f: dict, writer) -> bool:
        if f["op"] != "file_watch":
            writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
            return False
        asked.append(f["args"])
        for ev in lives[len(asked) - 1]:
            writer.write(protocol.encode_frame({"id": f["id"], "stream": ev}))
        if len(asked) < len(lives):
            await writer.drain()
            writer.transport.abort()
            return True
        writer.write(protocol.encode_frame({"id": f["id"], "result": {"reason": "deleted"}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                return [ev async for ev in Sandbox(c, "sb", {}).watch("/work", recursive=True)]

    got = asyncio.run(asyncio.wait_for(go(), 30))
    assert [(ev["kind"], ev["path"]) for ev in got] == [
        ("ready", "/work"), ("create", "/work/a"), ("overflow", "/work"), ("create", "/work/b"),
        ("stopped", "/work")]
    assert "lost" in got[2]["message"] and asked[1] == asked[0]


@pytest.mark.parametrize("follower", ["events", "watch", "output"])
def test_a_follower_whose_daemon_does_not_come_back_ends(tmp_path, follower):
    """Followed again after a loss, each waits reconnect_timeout for the
    daemon; one that never answers again ends the follow with the error
    saying so, instead of a wait begun again and again."""
    sock_path = str(tmp_path / "d.sock")
    servers: list = []
    first = {"events": {"seq": 1, "time": 1.0, "event": "paused", "sandbox": "sb"},
             "watch": {"kind": "ready", "path": "/work", "is_dir": True, "dirs": 1},
             "output": {"dropped": 0}}[follower]

    async def answer(f: dict, writer) -> bool:
        if f["op"] in ("events", "file_watch", "proc_logs"):
            writer.write(protocol.encode_frame({"id": f["id"], "stream": first}))
            await writer.drain()
            servers[0].close()              # the daemon goes, for good
            os.unlink(sock_path)
            writer.transport.abort()
            return True
        writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
        return False

    async def go():
        servers.append(await asyncio.start_unix_server(serving(answer), sock_path))
        async with Client(sock_path, reconnect_timeout=0.3) as c:
            sb = Sandbox(c, "sb", {})
            stream = {"events": lambda: c.events(), "watch": lambda: sb.watch("/work"),
                      "output": lambda: Process(sb, 3).output()}[follower]()
            got = []
            with pytest.raises(ConnectionLost) as e:
                async for item in stream:
                    got.append(item)
            return got, e.value

    got, err = asyncio.run(asyncio.wait_for(go(), 30))
    assert "did not answer again within 0.3 s" in str(err), err
    assert len(got) == (0 if follower == "output" else 1)


def test_a_directory_copy_out_whose_daemon_does_not_come_back_is_not_asked_again(tmp_path):
    """download_dir asked again after any ConnectionLost, one never sent
    too: a daemon that did not answer within reconnect_timeout was then
    waited for a second reconnect_timeout before the copy failed."""
    sock_path = str(tmp_path / "d.sock")
    servers: list = []
    conns: list = []

    async def answer(f: dict, writer) -> bool:
        conns.append(writer)
        writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
        return False

    async def go():
        servers.append(await asyncio.start_unix_server(serving(answer), sock_path))
        async with Client(sock_path, reconnect_timeout=0.2) as c:
            await c.request("ping")
            servers[0].close()                  # the daemon goes, for good
            os.unlink(sock_path)
            conns[0].transport.abort()
            while c.connected:
                await asyncio.sleep(0.01)
            asked = []
            frames = c.frames

            def counted(op, **args):
                asked.append(op)
                return frames(op, **args)

            c.frames = counted
            with pytest.raises(ConnectionLost) as e:
                await Sandbox(c, "sb", {}).download_dir("/work", str(tmp_path / "out"))
            return asked, e.value

    asked, err = asyncio.run(asyncio.wait_for(go(), 30))
    assert not err.sent and "did not answer again" in str(err), err
    assert asked == ["file_tar_get"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gone, reason", [({"path": "sb:/work"}, "deleted"),
                                          ({"sandbox": "sb"}, "sandbox destroyed")])
def test_a_watch_whose_directory_went_during_a_restart_ends_as_a_watch_does(tmp_path, gone, reason):
    """Watched again after a daemon restart, a directory (or sandbox) that
    went meanwhile ended the loop with NotFound, where a watch that sees
    it go ends with `stopped` and its reason."""
    sock_path = str(tmp_path / "d.sock")
    asked: list[dict] = []

    async def answer(f: dict, writer) -> bool:
        if f["op"] != "file_watch":
            writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
            return False
        asked.append(f["args"])
        if len(asked) == 1:
            writer.write(protocol.encode_frame({"id": f["id"], "stream": {"kind": "ready", "path": "/work",
                                                                          "is_dir": True, "dirs": 1}}))
            await writer.drain()
            writer.transport.abort()
            return True
        error = {"code": "not_found", "message": "watch sb:/work: gone", "detail": gone}
        writer.write(protocol.encode_frame({"id": f["id"], "error": error}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                return [ev async for ev in Sandbox(c, "sb", {}).watch("/work")]

    got = asyncio.run(asyncio.wait_for(go(), 30))
    assert [(ev["kind"], ev["path"]) for ev in got] == [("ready", "/work"), ("stopped", "/work")]
    assert got[-1]["reason"] == reason and len(asked) == 2


def test_a_renew_cut_by_a_daemon_restart_is_sent_again_and_a_hold_says_nothing(tmp_path, caplog):
    """A renew sets a lease from now: sent again to the next daemon, it
    renews as the first would have. Client.hold's renew in flight at a
    daemon restart failed, was logged as a failure, and waited HOLD_RETRY_S
    for the next try, however soon the daemon was back."""
    import logging

    sock_path = str(tmp_path / "d.sock")
    renews: list[dict] = []
    again = asyncio.Event()

    async def answer(f: dict, writer) -> bool:
        if f["op"] != "renew":
            writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
            return False
        renews.append(f["args"])
        if len(renews) == 1:
            writer.transport.abort()            # the daemon goes under the renew
            return True
        writer.write(protocol.encode_frame({"id": f["id"], "result": {"renewed": f["args"]["sandboxes"],
                                                                      "missing": [], "no_lease": []}}))
        again.set()
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                held = c.hold(["sb"], lease=60)
                try:
                    await asyncio.wait_for(again.wait(), 10)
                finally:
                    held.cancel()

    with caplog.at_level(logging.WARNING, logger="dsecd.client"):
        asyncio.run(asyncio.wait_for(go(), 30))
    assert [r["sandboxes"] for r in renews] == [["sb"], ["sb"]]
    assert not [r for r in caplog.records if "renewing the leases failed" in r.getMessage()]


def _follow_a_dropping_daemon(tmp_path, monkeypatch, follower: str, lives: list[list[dict]]) -> list:
    """events() or watch() against a daemon that serves `lives` in turn (the
    frames each connection's request gets before the connection is cut),
    then drops every request at once without a frame. What the follow gave,
    then the error that ended it."""
    from dsecd.client import wire

    monkeypatch.setattr(wire, "RECONNECT_GAP_S", 0.001)
    monkeypatch.setattr(wire, "RECONNECT_GAP_MAX_S", 0.001)
    sock_path = str(tmp_path / "d.sock")
    asked: list[dict] = []

    async def answer(f: dict, writer) -> bool:
        if f["op"] not in ("events", "file_watch"):
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"time": 0.0}}))
            return False
        asked.append(f["args"])
        for stream in lives[len(asked) - 1] if len(asked) <= len(lives) else []:
            writer.write(protocol.encode_frame({"id": f["id"], "stream": stream}))
        await writer.drain()
        writer.transport.abort()
        return True

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        got: list = []
        async with server:
            async with Client(sock_path) as c:
                stream = c.events() if follower == "events" else Sandbox(c, "sb", {}).watch("/work")
                try:
                    async for item in stream:
                        got.append(item)
                except ConnectionLost as err:
                    got.append(err)
        return got

    return asyncio.run(asyncio.wait_for(go(), 20))


@pytest.mark.parametrize("follower", ["events", "watch"])
def test_a_follower_whose_daemon_drops_every_request_gives_up(tmp_path, monkeypatch, follower):
    """A daemon that takes the connection and drops the follow without a
    frame, every time (one failing on the request), was asked again for
    ever; Process.output() gives up on it. They end with the error, saying so."""
    first = _ev(1, 1.0) if follower == "events" else {"kind": "ready", "path": "/work", "is_dir": True, "dirs": 1}
    got = _follow_a_dropping_daemon(tmp_path, monkeypatch, follower, [[first]])
    assert len(got) == 2 and isinstance(got[1], ConnectionLost), got[1:3]
    said = str(got[1])
    assert "in a row" in said and "without a frame" in said and got[1].sent, said


def test_an_events_follower_goes_on_through_restarts_with_no_event_between(tmp_path, monkeypatch):
    """Daemon restarts with no event between them are losses with nothing
    that came: a few in a row do not end the follow."""
    got = _follow_a_dropping_daemon(tmp_path, monkeypatch, "events", [[_ev(1, 1.0)], [], [], [], [_ev(1, 5.0)]])
    assert got[:2] == [_ev(1, 1.0), _ev(1, 5.0)] and isinstance(got[2], ConnectionLost)
