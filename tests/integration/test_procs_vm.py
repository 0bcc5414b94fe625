"""Background processes of a microVM (dsecd/engine/vmprocs.py): the guest
agent keeps them, their output ring and exit status, so nothing is lost
across a pause and resume (QEMU ends, a new one restores the VM) or a
daemon restart (SIGTERM or kill -9) while the VM runs; ring overflow and
limits.max_procs_per_sandbox as for a container. The tests that mean the
same on both backends are in test_procs.py.

One daemon and one VM for the module (TCG boots are slow); the tests run in
order on it, each with a client of its own (the restart test restarts the
daemon). No timings asserted.
"""

from __future__ import annotations

import asyncio
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import Daemon, skip_unless_microvm

from dsecd import Client
from dsecd.errors import LimitExceeded

CONFIG = '[limits]\nproc_output_bytes = "64K"\nmax_procs_per_sandbox = 3\n'
TICKER = "i=0; while [ $i -lt 40 ]; do echo line $i; i=$((i+1)); sleep 0.1; done; exit 4"


@pytest.fixture(scope="module")
def vmd(busybox_rootfs):
    """(daemon, the VM's id): a daemon of this module's config and its one VM
    (from the run's VM templates, conftest.VM_TEMPLATES)."""
    d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")), CONFIG, shared_vm_templates=True)
    try:
        d.start()
        c = d.client()
        skip_unless_microvm(c)
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create("busybox", backend="microvm", memory="256M", net="none", disk="64M")
        c.close()
        yield d, sb.id
    finally:
        d.cleanup()


@pytest.fixture
def vm(vmd):
    d, sb_id = vmd
    c = d.client()
    sb = c.get(sb_id)
    yield sb
    for p in sb.processes():            # room for the next test (3 at most)
        if p.state == "running":
            sb.process(p.pid).kill()
            sb.process(p.pid).wait()
    c.close()


def _text(proc, follow: bool = True) -> tuple[bytes, int]:
    """(stdout and stderr as read, bytes said dropped)."""
    data, dropped = [], 0
    for chunk in proc.output(follow=follow):
        if chunk.dropped:
            dropped += chunk.dropped
        else:
            data.append(chunk.data)
    return b"".join(data), dropped


def _wait_for_output(sb, pid: int, least: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while next(p for p in sb.processes() if p.pid == pid).output_bytes < least:
        assert time.monotonic() < deadline, "no output"
        time.sleep(0.05)


def test_eviction_and_the_limit(vm):
    first = vm.spawn("exit 1")
    first.wait()
    running = [vm.spawn("sleep 300") for _ in range(2)]
    third = vm.spawn("sleep 300")                # the exited one makes room
    assert first.pid not in {p.pid for p in vm.processes()}
    with pytest.raises(LimitExceeded, match="max_procs_per_sandbox"):
        vm.spawn("sleep 300")
    for p in [*running, third]:
        p.kill()
        assert p.wait().signal == signal.SIGKILL
    assert vm.spawn("true").wait().exit_code == 0     # exited ones are evicted again


def test_ring_overflow_is_counted(vm):
    proc = vm.spawn("head -c 300000 /dev/zero")
    assert proc.wait().exit_code == 0
    _text(proc)                                  # to its end
    out, dropped = _text(proc, follow=False)
    st = proc.status()
    assert len(out) == st.output_bytes and len(out) <= 64 * 1024
    assert dropped == st.dropped == 300000 - len(out) > 0


def test_output_and_status_survive_a_pause(vm):
    done = vm.spawn("echo done; echo to-err >&2; exit 3")
    assert done.wait().exit_code == 3
    waiting = vm.spawn("echo before; read l; echo after $l; exit 5")
    _wait_for_output(vm, waiting.pid, len("before\n"))
    vm.pause()
    # While paused (no QEMU): what the daemon has is there, the process still runs.
    by_pid = {p.pid: p for p in vm.processes()}
    assert by_pid[waiting.pid].state == "running" and by_pid[done.pid].exit_code == 3
    assert _text(waiting, follow=False) == (b"before\n", 0)
    vm.resume()
    waiting.write(b"x\n")
    st = waiting.wait()
    assert (st.state, st.exit_code) == ("exited", 5)
    assert _text(waiting) == (b"before\nafter x\n", 0)
    assert _text(done) == (b"done\nto-err\n", 0)
    assert done.wait().exit_code == 3


def test_an_input_cut_by_a_pause_goes_on_after_the_resume(vm):
    """An input the process does not read (more than its pipe holds) waits
    across the pause and resume; the process gets every byte once."""
    proc = vm.spawn("while [ ! -e /tmp/go ]; do sleep 0.1; done; wc -c")
    size = 300 * 1024
    done = {}

    def feed():
        try:
            done["result"] = proc.write(b"x" * size)
            proc.close_stdin()
        except Exception as err:        # the assertion below says what failed
            done["error"] = err

    feeder = threading.Thread(target=feed)
    feeder.start()
    time.sleep(0.5)                  # the input is under way, held by the full pipe
    vm.pause()
    vm.resume()
    vm.write_file("/tmp/go", b"")
    feeder.join(120)
    assert not feeder.is_alive() and "error" not in done, done
    assert proc.wait().exit_code == 0
    assert _text(proc)[0].split() == [str(size).encode()]
    vm.exec(["rm", "/tmp/go"])


def test_inputs_in_flight_at_once_reach_the_process_in_their_order(vmd):
    """Writes sent without waiting for the one before (tasks of one loop),
    while the VM is paused and resumed for the first of them: past the
    client's share of the in-flight limit they queue, and the first ones
    wait for the attach of the VM's new channel. None overtakes another
    on its way to the process's stdin (the later one was refused as past
    the bytes written, and those behind it with it); every byte arrives
    once, in order."""
    d, sb_id = vmd
    rounds, writes = 4, 2000

    async def main() -> tuple[bytes, bytes]:
        async with Client(d.socket) as c:
            sb = await c.get(sb_id)
            proc = await sb.spawn("cat")
            sent = []
            for _round in range(rounds):
                await sb.pause()
                tasks = []
                for _ in range(writes):
                    sent.append(b"%05d\n" % len(sent))
                    tasks.append(asyncio.ensure_future(proc.write(sent[-1])))
                    await asyncio.sleep(0.0003)     # on while answers come and free slots
                failed = [r for r in await asyncio.gather(*tasks, return_exceptions=True) if r is not None]
                assert not failed, f"{len(failed)} of {writes} writes failed, the first: {failed[0]!r}"
            await proc.close_stdin()
            assert (await proc.wait()).exit_code == 0
            out = b"".join([chunk.data async for chunk in proc.output(follow=False)])
            return out, b"".join(sent)

    out, sent = asyncio.run(main())
    assert out == sent


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_output_and_status_survive_a_daemon_restart(vmd, how):
    d, sb_id = vmd
    c = d.client()
    sb = c.get(sb_id)
    ticker = sb.spawn(TICKER)
    short = sb.spawn("sleep 0.5; echo while-down; exit 6")       # ends while no daemon runs
    reader = sb.spawn("echo ready; read l; echo got $l")
    _wait_for_output(sb, ticker.pid, len("line 0\n"))
    _wait_for_output(sb, reader.pid, len("ready\n"))
    c.close()
    d.stop(how)
    time.sleep(1.0)                  # the ticker writes on meanwhile, the short one ends
    d.start()
    c = d.client()
    try:
        sb = c.get(sb_id)
        assert {ticker.pid, short.pid, reader.pid} <= {p.pid for p in sb.processes()}
        short = sb.process(short.pid)
        assert short.wait().exit_code == 6
        assert _text(short) == (b"while-down\n", 0)
        reader = sb.process(reader.pid)
        reader.write(b"again\n")
        assert reader.wait().exit_code == 0
        assert _text(reader) == (b"ready\ngot again\n", 0)      # what the old daemon had read too
        ticker = sb.process(ticker.pid)
        text, dropped = _text(ticker)
        numbers = [int(n) for n in re.findall(r"line (\d+)", text.decode())]
        assert (numbers, dropped) == (list(range(40)), 0), text        # every line, from the first
        st = ticker.wait()
        assert (st.state, st.exit_code) == ("exited", 4)
        for p in sb.processes():          # room for the next test
            if p.state == "running":
                sb.process(p.pid).kill()
                sb.process(p.pid).wait()
    finally:
        c.close()


def test_a_paused_vm_across_a_restart(vmd):
    """Paused, then the daemon restarts: its processes are attached again at
    the resume, which an input to one of them makes."""
    d, sb_id = vmd
    c = d.client()
    sb = c.get(sb_id)
    proc = sb.spawn("echo one; read l; echo two $l; exit 7")
    _wait_for_output(sb, proc.pid, len("one\n"))
    sb.pause()
    c.close()
    d.stop(signal.SIGTERM)
    d.start()
    c = d.client()
    try:
        sb = c.get(sb_id)
        assert [p.state for p in sb.processes() if p.pid == proc.pid] == ["running"]
        proc = sb.process(proc.pid)
        proc.write(b"z\n")                      # resumes the VM first (its agent must run to take it)
        assert sb.inspect()["state"] == "running"
        assert proc.wait().exit_code == 7
        assert _text(proc) == (b"one\ntwo z\n", 0)
    finally:
        c.close()


def test_destroy_kills_them_and_ends_followers(vmd):
    """Last: the module's VM goes. Its processes die with it (signal 9), a
    waiter and a follower end."""
    d, sb_id = vmd
    c = d.client()
    sb = c.get(sb_id)
    proc = sb.spawn("echo up; exec sleep 300")
    _wait_for_output(sb, proc.pid, len("up\n"))
    c2 = d.client()
    try:
        follower = c2.get(sb_id).process(proc.pid)
        chunks = follower.output(follow=True)
        assert next(c for c in chunks if c.data).data == b"up\n"
        sb.destroy(force=True)
        assert list(chunks) == []              # ends with the process
    finally:
        c2.close()
        c.close()
