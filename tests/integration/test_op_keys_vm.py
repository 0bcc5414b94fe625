"""Idempotency keys and input offsets on a microVM sandbox: what
test_op_keys.py proves of a container, for the paths a VM has of its own
(an exec through dsecd/engine/microvms.py, a snapshot through
dsecd/engine/vmfiles.py, a background process kept by the guest agent,
whose input the agent counts and skips by offset). A request whose
connection drops after it was written is sent again by the SDK, and what
it does happens once.

One VM for the module (TCG boots are slow), from the run's VM templates;
each test leaves no process of its own running in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from conftest import shared_vm
from relay_kit import (
    CuttingRelay,
    assert_streamed_once_and_whole,
    stream_through_a_cut,
    write_twice_through_a_cut,
)

from dsecd import Client
from dsecd.errors import Conflict

pytestmark = pytest.mark.shared_vm_templates


@pytest.fixture(scope="module")
def vm(daemon):
    yield from shared_vm(daemon)


async def _kill_all(sb) -> None:
    """Room for the next test: the VM's processes still running ended."""
    for p in await sb.processes():
        if p.state == "running":
            proc = sb.process(p.pid)
            await proc.kill()
            await proc.wait()


def test_a_keyed_exec_in_a_vm_whose_connection_drops_runs_once_and_answers(daemon, vm, tmp_path):
    async def go():
        async with Client(daemon.socket) as direct:
            sb = await direct.get(vm.id)
            await sb.exec(["rm", "-f", "/tmp/exec-ran"])
            async with CuttingRelay(daemon.socket, str(tmp_path / "r.sock"), "exec") as relay:
                async with Client(relay.path) as c:
                    mine = await c.get(vm.id)
                    r = await mine.exec("echo ran >> /tmp/exec-ran; sleep 0.5; echo out; echo err >&2; exit 3",
                                        key=f"vm-ran-once-{time.monotonic_ns()}")
                assert relay.cut.is_set() and relay.seen.count("exec") == 2, relay.seen
            return r, (await sb.read_file("/tmp/exec-ran")).decode()

    r, lines = asyncio.run(go())
    assert lines == "ran\n", lines
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n"), r


def test_a_streamed_exec_in_a_vm_whose_connection_drops_mid_output_runs_once_and_goes_on(daemon, vm, tmp_path):
    async def go():
        async with Client(daemon.socket) as direct:
            sb = await direct.get(vm.id)
            await sb.exec(["rm", "-f", "/tmp/ran"])
            r, got, relay = await stream_through_a_cut(daemon.socket, str(tmp_path / "r.sock"), vm.id)
            return r, got, relay, await sb.read_file("/tmp/ran")

    assert_streamed_once_and_whole(*asyncio.run(go()))


def test_a_background_process_in_a_vm_whose_start_drops_starts_once(daemon, vm, tmp_path):
    async def go():
        async with Client(daemon.socket) as direct:
            sb = await direct.get(vm.id)
            await _kill_all(sb)
            await sb.exec(["rm", "-f", "/tmp/start-ran"])
            try:
                async with CuttingRelay(daemon.socket, str(tmp_path / "r.sock"), "proc_start") as relay:
                    async with Client(relay.path) as c:
                        mine = await c.get(vm.id)
                        proc = await mine.spawn("echo ran >> /tmp/start-ran; echo started; sleep 30", stdin=False)
                    assert relay.cut.is_set() and relay.seen.count("proc_start") == 2, relay.seen
                # Under TCG it may not have run its first line yet: its output says it did.
                async for chunk in sb.process(proc.pid).output():
                    if b"started" in chunk.data:
                        break
                running = [p.pid for p in await sb.processes() if p.state == "running"]
                return proc.pid, running, await sb.read_file("/tmp/start-ran")
            finally:
                await _kill_all(sb)

    pid, running, lines = asyncio.run(go())
    assert running == [pid] and lines == b"ran\n", (pid, running, lines)


def test_a_snapshot_of_a_vm_whose_connection_drops_is_made_once(daemon, vm, tmp_path):
    """Sent again with its key, the snapshot answers with the image the
    first one made (the same name again would be refused: it is taken)."""
    name = f"vm-keyed-snap-{time.monotonic_ns()}"

    async def go():
        async with Client(daemon.socket) as direct:
            sb = await direct.get(vm.id)
            try:
                await sb.write_file("/tmp/made", b"x")
                async with CuttingRelay(daemon.socket, str(tmp_path / "r.sock"), "snapshot") as relay:
                    async with Client(relay.path) as c:
                        mine = await c.get(vm.id)
                        made = await mine.snapshot(name)
                    assert relay.cut.is_set() and relay.seen.count("snapshot") == 2, relay.seen
                images = [i for i in await direct.list_images() if i["name"] == name]
                return made, images
            finally:
                with contextlib.suppress(Exception):
                    await direct.request("image_rm", name=name)

    made, images = asyncio.run(go())
    assert len(images) == 1 and made["name"] == name and made["manifest"] == images[0]["manifest"], (made, images)


def test_input_to_a_vm_process_whose_connection_drops_reaches_it_once(daemon, vm, tmp_path):
    """Process.write sends its offset: sent again, the daemon and the agent
    skip the bytes the agent took before."""
    async def go():
        async with Client(daemon.socket) as direct:
            sb = await direct.get(vm.id)
            try:
                ended, relay = await write_twice_through_a_cut(daemon.socket, str(tmp_path / "r.sock"), vm.id)
                assert relay.cut.is_set() and relay.seen.count("proc_input") == 4, relay.seen
                return ended, await sb.read_file("/tmp/in")
            finally:
                await _kill_all(sb)

    ended, got = asyncio.run(go())
    assert ended.exit_code == 0 and got == b"once\ntwice\n", got


def test_a_chunk_the_agent_took_in_part_when_the_connection_dropped_goes_in_once(daemon, vm, tmp_path):
    """The process reads one byte, says so, then nothing until /tmp/go
    exists: of a chunk larger than its pipe, the agent holds what the pipe
    did not take, and the request waits for it. Its connection cut then,
    the SDK sends it again at the same offset while the agent still holds
    that input: it must wait for it and skip what was taken, not fail with
    the agent busy nor write it twice."""
    chunk = bytes(range(256)) * 1024          # 256 KiB: four pipes' worth

    async def go():
        async with Client(daemon.socket) as direct:
            sb = await direct.get(vm.id)
            await sb.exec(["rm", "-f", "/tmp/go", "/tmp/first", "/tmp/big"])
            took = asyncio.get_running_loop().create_future()

            async def await_took(pid: int) -> None:
                async for out in sb.process(pid).output():
                    if b"took" in out.data:
                        took.set_result(None)
                        return

            try:
                async with CuttingRelay(daemon.socket, str(tmp_path / "r.sock"), "proc_input", cut_after=took) as relay:
                    async with Client(relay.path) as c:
                        mine = await c.get(vm.id)
                        proc = await mine.spawn("dd bs=1 count=1 of=/tmp/first 2>/dev/null; echo took; "
                                                "until [ -e /tmp/go ]; do sleep 0.1; done; cat > /tmp/big")
                        watching = asyncio.create_task(await_took(proc.pid))
                        writing = asyncio.create_task(proc.write(chunk))
                        await relay.resent.wait()
                        # The process reads on only once the input sent again is on its way to the agent.
                        await sb.write_file("/tmp/go", b"")
                        await writing
                        await watching
                        await proc.write(b"tail")
                        await proc.close_stdin()
                        ended = await proc.wait()
                    assert relay.seen.count("proc_input") == 4, relay.seen
                return ended, await sb.read_file("/tmp/first") + await sb.read_file("/tmp/big")
            finally:
                await _kill_all(sb)

    ended, got = asyncio.run(go())
    assert ended.exit_code == 0, ended
    assert len(got) == len(chunk) + 4 and got == chunk + b"tail", f"{len(got)} bytes, not {len(chunk) + 4}"


def test_input_to_a_vm_process_past_what_was_written_is_a_conflict_naming_where_to_send_from(client, vm):
    proc = vm.spawn("cat > /dev/null")
    try:
        client.request("proc_input", sandbox=vm.id, pid=proc.pid, data=b"abc", offset=0)
        again = client.request("proc_input", sandbox=vm.id, pid=proc.pid, data=b"abcdef", offset=0)
        with pytest.raises(Conflict) as e:
            client.request("proc_input", sandbox=vm.id, pid=proc.pid, data=b"x", offset=9)
    finally:
        proc.kill()
        proc.wait()
    assert again["skipped"] == 3 and e.value.detail["taken"] == 6 and "from offset 6" in e.value.message, e.value
