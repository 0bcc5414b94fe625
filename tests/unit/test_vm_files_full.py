"""What a microVM's full writable layer or /tmp says (MicroVMService._full):
the cap that was met and what to change, and what the failed request left."""

from __future__ import annotations

import errno
from types import SimpleNamespace

from dsecd.engine.microvms import MicroVMService


def _vm(disk: int, memory: int = 256 << 20):
    return SimpleNamespace(id="vm1", limits={"disk": disk, "memory": memory})


def test_a_disk_below_half_the_memory_is_the_cap_to_raise():
    err = MicroVMService._full("write", "vm1:/m2", _vm(1 << 20))
    assert err.code == "limit" and err.detail["errno"] == "ENOSPC"
    assert "a larger --disk" in err.message, err.message


def test_half_the_memory_is_the_cap_to_raise():
    err = MicroVMService._full("write", "vm1:/big", _vm(128 << 20))
    assert "more --memory" in err.message and "a larger --disk" not in err.message, err.message


def test_a_directory_copy_says_it_left_nothing():
    reports = {"err": (str(errno.ENOSPC), "write work/big")}
    err = MicroVMService._copy_failed("copy into", "vm1:/work/d", 1, reports, 10, 10, _vm(128 << 20))
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

    async def file_op(sb, req):
        sent.append(req)
        return {"data": b"", "size": 0, "eof": True}

    async def ensure_running(sb, why):
        pass

    svc = object.__new__(FileService)
    sb = SimpleNamespace(id="vm1", backend="microvm")
    svc.max_chunk, svc.ensure_running = 4 << 20, ensure_running
    svc.registry = SimpleNamespace(get=lambda sid, req: sb)
    svc.vms = SimpleNamespace(file_op=file_op)
    asyncio.run(svc.read(FileRead(sandbox="vm1", path="/etc/passwd"), None))
    assert sent[0].length == 4 << 20
