"""Idempotency keys of exec, proc_start and snapshot: a request whose
connection drops after it was written and before its answer came (an
ssh:// link cut) is sent again by the SDK with the same key, and the daemon
answers it with what the first one did instead of doing it twice."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from relay_kit import (
    CuttingRelay,
    assert_streamed_once_and_whole,
    stream_through_a_cut,
    write_twice_through_a_cut,
)

from dsecd import Client
from dsecd.errors import BadRequest, Conflict


async def _sandbox(c: Client):
    return await c.create(image="busybox", memory="128M")


def test_an_exec_whose_connection_drops_after_it_was_sent_runs_once_and_answers(daemon, tmp_path):
    """The exec goes again on the next connection with its key (the
    caller's here; over ssh:// the SDK makes one: test_fleet), and is
    answered with the one run's status and output: the command ran once
    (one line appended), not twice, nor killed with the link."""
    async def go():
        async with Client(daemon.socket) as direct:
            sb = await _sandbox(direct)
            try:
                async with CuttingRelay(daemon.socket, str(tmp_path / "r.sock"), "exec") as relay:
                    async with Client(relay.path) as c:
                        mine = await c.get(sb.id)
                        r = await mine.exec("echo ran >> /tmp/ran; sleep 0.5; echo out; echo err >&2; exit 3",
                                            key="ran-once")
                    assert relay.cut.is_set() and relay.seen.count("exec") == 2, relay.seen
                lines = (await sb.read_file("/tmp/ran")).decode()
                return r, lines
            finally:
                await sb.destroy(force=True)

    r, lines = asyncio.run(go())
    assert lines == "ran\n", lines
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n"), r


def test_a_background_process_whose_start_drops_after_it_was_sent_starts_once(daemon, tmp_path):
    async def go():
        async with Client(daemon.socket) as direct:
            sb = await _sandbox(direct)
            try:
                async with CuttingRelay(daemon.socket, str(tmp_path / "r.sock"), "proc_start") as relay:
                    async with Client(relay.path) as c:
                        mine = await c.get(sb.id)
                        proc = await mine.spawn("echo ran >> /tmp/ran; sleep 30", stdin=False)
                    assert relay.cut.is_set() and relay.seen.count("proc_start") == 2, relay.seen
                listed = await sb.processes()
                return proc.pid, [p.pid for p in listed]
            finally:
                await sb.destroy(force=True)

    pid, listed = asyncio.run(go())
    assert listed == [pid], listed


def test_a_snapshot_whose_connection_drops_after_it_was_sent_is_made_once(daemon, tmp_path):
    """Sent again with its key, the snapshot answers with the image the
    first one made (a snapshot of the same name again would be refused:
    the name is taken)."""
    name = f"keyed-snap-{time.monotonic_ns()}"

    async def go():
        async with Client(daemon.socket) as direct:
            sb = await _sandbox(direct)
            try:
                await sb.write_file("/tmp/made", b"x")
                async with CuttingRelay(daemon.socket, str(tmp_path / "r.sock"), "snapshot") as relay:
                    async with Client(relay.path) as c:
                        mine = await c.get(sb.id)
                        made = await mine.snapshot(name)
                    assert relay.cut.is_set() and relay.seen.count("snapshot") == 2, relay.seen
                images = [i for i in await direct.list_images() if i["name"] == name]
                return made, images
            finally:
                await sb.destroy(force=True)
                with contextlib.suppress(Exception):
                    await direct.request("image_rm", name=name)

    made, images = asyncio.run(go())
    assert len(images) == 1 and made["name"] == name and made["manifest"] == images[0]["manifest"], (made, images)


def test_a_snapshot_sent_again_hears_the_progress_of_the_pack_under_way(daemon, tmp_path):
    """The connection is cut as the snapshot goes by: the SDK sends it
    again with its key, and the request sent again waits for the pack the
    first one began. That pack's progress comes to it from then on (it went
    to the cut connection alone, and the caller heard nothing more until
    the image came), each event once: the bytes written only grow, and the
    layer is told once."""
    name = f"keyed-snap-progress-{time.monotonic_ns()}"
    heard: list[dict] = []

    async def go():
        async with Client(daemon.socket) as direct:
            sb = await direct.create(image="busybox", memory="256M")
            try:
                # Random bytes, so that the pack (mkfs.erofs, then the layer's
                # digest) lasts past the SDK's reconnect by far.
                r = await sb.exec(["dd", "if=/dev/urandom", "of=/root/big", "bs=1M", "count=64"])
                assert r.exit_code == 0, r.stderr
                async with CuttingRelay(daemon.socket, str(tmp_path / "r.sock"), "snapshot") as relay:
                    async with Client(relay.path) as c:
                        mine = await c.get(sb.id)
                        made = await mine.snapshot(name, progress=heard.append)
                    assert relay.cut.is_set() and relay.seen.count("snapshot") == 2, relay.seen
                return made
            finally:
                await sb.destroy(force=True)
                with contextlib.suppress(Exception):
                    await direct.request("image_rm", name=name)

    made = asyncio.run(go())
    layers = [p for p in heard if p.get("step") == "layer"]
    assert len(layers) == 1 and layers[0]["digest"] == made["layers"][-1]["digest"], heard
    written = [p["bytes"] for p in heard if p.get("step") == "mkfs.erofs" and "bytes" in p]
    begun = [p for p in heard if p.get("step") == "mkfs.erofs" and "bytes" not in p]
    assert written == sorted(written) and len(begun) <= 1, heard


def test_a_key_given_again_with_other_arguments_is_a_conflict_naming_it(client, sandbox):
    first = client.request("exec", sandbox=sandbox.id, argv=["echo", "one"], stream=False, key="step-1")
    again = client.request("exec", sandbox=sandbox.id, argv=["echo", "one"], stream=False, key="step-1")
    with pytest.raises(Conflict) as e:
        client.request("exec", sandbox=sandbox.id, argv=["echo", "two"], stream=False, key="step-1")
    assert first["stdout"] == b"one\n" and again["stdout"] == b"one\n" and again["existing"] is True
    assert "'step-1'" in e.value.message and "other arguments" in e.value.message, e.value.message
    assert e.value.detail["key"] == "step-1"
    # One key per exec the SDK sends: for the daemon, not for what listings show.
    listed = next(row for row in client.list() if row["id"] == sandbox.id)
    assert "op_keys" not in sandbox.inspect() and "op_keys" not in listed


def test_a_key_is_refused_where_a_request_cannot_be_sent_again(client, sandbox):
    """An exec's input would go twice, or in part: a key is for execs without stdin."""
    with pytest.raises(BadRequest) as e:
        client.request("exec", sandbox=sandbox.id, argv=["cat"], stdin=True, key="k")
    assert "stdin" in e.value.message, e.value.message
    with pytest.raises(BadRequest) as e:
        client.request("exec", sandbox=sandbox.id, argv=["true"], stream_from=[0, 0])
    assert "give its key" in e.value.message, e.value.message


def test_a_streamed_exec_whose_connection_drops_mid_output_runs_once_and_goes_on(daemon, tmp_path):
    """Sent again with the bytes its client got, the exec is sent the rest:
    what was in flight when the link went, then what came after."""
    async def go():
        async with Client(daemon.socket) as direct:
            sb = await _sandbox(direct)
            try:
                r, got, relay = await stream_through_a_cut(daemon.socket, str(tmp_path / "r.sock"), sb.id)
                return r, got, relay, await sb.read_file("/tmp/ran")
            finally:
                await sb.destroy(force=True)

    assert_streamed_once_and_whole(*asyncio.run(go()))


def test_a_streamed_exec_that_ends_while_its_link_is_down_keeps_its_last_output(daemon, tmp_path):
    """The command writes and exits while no request of its key is
    connected: that output is kept for the request sent again, not lost
    with the pipes once the exec's end was waited for."""
    async def go():
        async with Client(daemon.socket) as direct:
            sb = await _sandbox(direct)
            try:
                first = asyncio.Event()
                relay = CuttingRelay(daemon.socket, str(tmp_path / "r.sock"), "exec", cut_after=first.wait(),
                                     hold_s=3.0)
                async with relay, Client(relay.path) as c:
                    mine = await c.get(sb.id)
                    r = await mine.exec("echo first; sleep 1; echo late; exit 5", key=f"late-{time.monotonic_ns()}",
                                        on_stdout=lambda data: first.set())
                return r, relay
            finally:
                await sb.destroy(force=True)

    r, relay = asyncio.run(go())
    assert relay.cut.is_set() and relay.seen.count("exec") == 2, relay.seen
    assert (r.exit_code, r.stdout, r.lost_output) == (5, b"first\nlate\n", 0), r


def test_an_input_whose_connection_drops_after_it_was_sent_reaches_the_process_once(daemon, tmp_path):
    """Process.write sends its offset in the process's input: sent again,
    the daemon skips the bytes it wrote before."""
    async def go():
        async with Client(daemon.socket) as direct:
            sb = await _sandbox(direct)
            try:
                ended, relay = await write_twice_through_a_cut(daemon.socket, str(tmp_path / "r.sock"), sb.id)
                assert relay.cut.is_set() and relay.seen.count("proc_input") == 4, relay.seen
                return ended, await sb.read_file("/tmp/in")
            finally:
                await sb.destroy(force=True)

    ended, got = asyncio.run(go())
    assert ended.exit_code == 0 and got == b"once\ntwice\n", got


def test_an_input_at_an_offset_past_what_was_written_is_a_conflict_naming_where_to_send_from(client, sandbox):
    proc = sandbox.spawn("cat > /dev/null")
    client.request("proc_input", sandbox=sandbox.id, pid=proc.pid, data=b"abc", offset=0)
    again = client.request("proc_input", sandbox=sandbox.id, pid=proc.pid, data=b"abcdef", offset=0)
    with pytest.raises(Conflict) as e:
        client.request("proc_input", sandbox=sandbox.id, pid=proc.pid, data=b"x", offset=9)
    assert again["skipped"] == 3 and e.value.detail["taken"] == 6 and "from offset 6" in e.value.message
