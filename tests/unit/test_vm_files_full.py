"""What a microVM's full writable layer or /tmp says (VmFiles._full):
the cap that was met and what to change, and what the failed request left."""

from __future__ import annotations

import errno
from types import SimpleNamespace

from vm_kit import vm_files

from dsecd.backends.microvm.backend import upper_cap
from dsecd.engine.microvms import MicroVMService
from dsecd.engine.vmfiles import VmFiles


def _vm(disk: int, memory: int = 256 << 20):
    return SimpleNamespace(id="vm1", limits={"disk": disk, "memory": memory})


def test_a_disk_below_half_the_memory_is_the_cap_to_raise():
    err = VmFiles._full("write", "vm1:/m2", _vm(1 << 20))
    assert err.code == "limit" and err.detail["errno"] == "ENOSPC"
    assert "a larger --disk" in err.message, err.message


def test_half_the_memory_is_the_cap_to_raise():
    err = VmFiles._full("write", "vm1:/big", _vm(upper_cap(256 << 20)))
    assert "more --memory" in err.message and "a larger --disk" not in err.message, err.message


def test_a_directory_copy_says_it_left_nothing():
    reports = {"err": (str(errno.ENOSPC), "write work/big")}
    err = VmFiles._copy_failed("copy into", "vm1:/work/d", 1, reports, 10, 10, _vm(128 << 20))
    assert err.code == "limit" and "partly written" not in err.message, err.message
    assert "nothing of the copy is left" in err.message, err.message


def test_a_file_read_without_a_length_reads_a_chunk_of_a_vm():
    # The protocol's length is optional (up to limits.max_file_chunk_bytes);
    # a VM's read sent None to the agent: `internal: required argument is
    # not an integer`.
    import asyncio

    from dsecd.engine.files import FileService
    from dsecd.protocol import FileRead

    sent = []

    async def file_op(sb, req, owner=None):
        sent.append(req)
        return {"data": b"", "size": 0, "eof": True}

    async def ensure_running(sb, why):
        pass

    svc = object.__new__(FileService)
    sb = SimpleNamespace(id="vm1", backend="microvm")
    svc.max_chunk, svc.ensure_running, svc.workers = 4 << 20, ensure_running, None
    svc.registry = SimpleNamespace(get=lambda sid, req: sb)
    svc.vm_files = SimpleNamespace(file_op=file_op)
    asyncio.run(svc.read(FileRead(sandbox="vm1", path="/etc/passwd"), None))
    assert sent[0].length == 4 << 20


class _FifoLink:
    """A guest agent whose /w/fifo is a FIFO: READ and WRITE refuse it
    (require_regular: EINVAL at "open"), STAT says what it is."""
    closed = False
    agent_version = 8

    async def request(self, kind, *fields):
        from dsecd.backends.microvm import wire
        from dsecd.backends.microvm.agent import AgentError

        if kind == wire.STAT:
            return wire.Reader(wire.bstr("fifo") + wire.u64(0) + wire.u64(0o644) + wire.u64(0) * 3)
        raise AgentError(errno.EINVAL, "open")


def test_reading_a_fifo_says_what_it_is_as_a_containers_does():
    import asyncio

    import pytest

    from dsecd.errors import BadRequest
    from dsecd.protocol import FileRead, FileWrite

    link = _FifoLink()
    svc, _ = vm_files(agent=lambda sb: link)
    sb = _vm(128 << 20)
    for req in (FileRead(sandbox="vm1", path="/w/fifo", length=4096), FileWrite(sandbox="vm1", path="/w/fifo", data=b"x")):
        with pytest.raises(BadRequest) as exc:
            asyncio.run(svc.file_op(sb, req))
        verb = "read" if isinstance(req, FileRead) else "write"
        assert exc.value.message == f"{verb} vm1:/w/fifo: /w/fifo is a fifo, not a regular file", exc.value.message
        assert exc.value.detail["path"] == "/w/fifo"


def test_a_rename_onto_an_existing_name_says_what_to_do_as_a_containers_does():
    from dsecd.backends.microvm.agent import AgentError
    from dsecd.engine.vmfiles import _as_a_containers

    err = _as_a_containers(AgentError(errno.EEXIST, "rename"), "/w/l -> /w/f")
    assert err.errno == errno.EEXIST
    assert err.strerror == "/w/f exists; rename with overwrite to replace it"


def test_a_snapshot_that_waited_for_a_pause_says_the_vm_is_paused(tmp_path):
    # A snapshot that came as a pause ran waited for the sandbox's lock, then
    # sent its TAR on the channel the pause had closed: "conflict: sandbox
    # ... is exiting: the agent channel is closed", though nothing was.
    import asyncio

    import pytest

    from dsecd.errors import Conflict

    async def main():
        class Link:
            closed = False

            async def stream(self, *args):
                raise AssertionError("TAR sent to a paused VM's channel")

        link = Link()
        sb = SimpleNamespace(id="vm1", state="running", lock=asyncio.Lock(), handle=SimpleNamespace(agent=link))
        svc, _ = vm_files(workers=SimpleNamespace(run=lambda fn, *a: asyncio.sleep(0, fn(*a))))
        await sb.lock.acquire()                 # the pause, under way
        snap = asyncio.ensure_future(svc.upper_tree(sb, tmp_path, 1 << 20).__aenter__())
        await asyncio.sleep(0.01)
        sb.state, link.closed = "paused", True  # saved, its QEMU and channel gone
        sb.lock.release()
        with pytest.raises(Conflict, match="is a paused microVM; resume it first"):
            await snap

    asyncio.run(main())


def test_a_paused_vm_shows_no_pid_of_its_ended_qemu():
    # A pause saves the guest and ends its QEMU; inspect and ps went on
    # showing that QEMU's pid (init_pid, vm.qemu_pid), which the host may
    # since have given to any other process.
    from pathlib import Path

    from dsecd.backends.microvm.backend import Machine, VmHandle
    from dsecd.engine.sandboxes import Sandbox

    h = VmHandle(init_pid=4242, init_start=1, pidfd=-1, group=None, vm_dir=Path("/nonexistent"),
                 is_child=False, accel="tcg", machine=Machine())
    sb = Sandbox(id="vm1", image="busybox", state="paused", created=0.0, limits={"memory": 256 << 20},
                 backend="microvm", handle=h)
    assert sb.public()["init_pid"] is None
    assert sb.record()["init_pid"] == 4242          # the journal's record is the backend's to read
    svc = object.__new__(MicroVMService)
    svc.balloon = None
    assert svc.inspect(sb)["qemu_pid"] is None
    assert svc.inspect(sb)["dir"] == "/nonexistent"
    h.pidfd = 7                                     # a running (or only stopped) QEMU
    assert sb.public()["init_pid"] == 4242 and svc.inspect(sb)["qemu_pid"] == 4242



def test_a_vm_path_that_is_not_utf8_goes_to_the_agent_as_its_bytes():
    """A name a file op takes as bytes (not UTF-8) is the str os.fsdecode
    makes; to a VM's agent it goes as those bytes, as its names come back."""
    import os
    import struct

    from dsecd.backends.microvm import wire

    assert wire.bstr(os.fsdecode(b"/work/\xffx")) == struct.pack(">I", 8) + b"/work/\xffx"


def test_an_owner_goes_only_to_an_agent_that_sets_it():
    """An agent before version 5 would ignore the owner's fields and make
    root's files: such a request is refused, saying so; root needs none."""
    import pytest

    from dsecd.backends.microvm import wire
    from dsecd.errors import Unsupported

    link = SimpleNamespace(agent_version=4)
    svc, _ = vm_files(agent=lambda sb: link)
    sb = SimpleNamespace(id="vm1")
    assert svc._owner_fields(sb, None, "file_write vm1") == ()
    assert svc._owner_fields(sb, (0, 0), "file_write vm1") == ()
    with pytest.raises(Unsupported, match=r"guest agent \(version 4\) cannot give files an owner"):
        svc._owner_fields(sb, (65534, 65534), "file_write vm1")
    link.agent_version = wire.OWNER_AGENT_VERSION
    assert svc._owner_fields(sb, (65534, 100), "file_write vm1") == (wire.u64(65534), wire.u64(100))


def test_a_vms_snapshot_stops_its_execs_clocks(tmp_path):
    # The guest's processes are frozen while the agent streams the layer, as
    # a container's are while its layer is packed; an exec's run-time
    # timeout (Sandbox.paused_for) went on counting, so a command frozen by
    # a long snapshot could be killed having run far less than its timeout.
    import asyncio

    import pytest

    from dsecd.backends.microvm.agent import AgentError
    from dsecd.engine.sandboxes import Sandbox
    from dsecd.errors import DsecError

    seen = []

    async def main():
        class Link:
            closed = False

            async def stream(self, *args):
                seen.append(sb.paused_at)
                await asyncio.sleep(0.01)
                raise AgentError(errno.EIO, "read work/f")

        sb = Sandbox(id="vm1", image="busybox", state="running", created=0.0, limits={"memory": 256 << 20},
                     backend="microvm", handle=SimpleNamespace(agent=Link()))
        svc, _ = vm_files(workers=SimpleNamespace(run=lambda fn, *a: asyncio.sleep(0, fn(*a))))
        with pytest.raises(DsecError, match="read the writable layer"):
            async with svc.upper_tree(sb, tmp_path, 1 << 20):
                pass
        return sb

    sb = asyncio.run(main())
    assert seen[0] is not None                      # the clock stood still while it streamed
    assert sb.paused_at is None and sb.paused_total > 0
