"""Bytes a client writes into a sandbox are the sandbox's: charged to its
memory cgroup (written by a copier its init forks, dsecd/engine/copier.py),
so a client cannot fill the host past a sandbox's --memory with files."""

import contextlib
import os

import pytest

from dsecd.errors import LimitExceeded

MiB = 1 << 20


def _memcg_file(sb, name: str) -> int:
    groups = [g for k, g in sb.inspect()["cgroups"].items() if "memory" in k]
    assert groups, sb.inspect()["cgroups"]
    with open(os.path.join(groups[0], name)) as f:
        return int(f.read().split()[0])


def test_written_bytes_are_charged_to_the_sandbox(client):
    sb = client.create(image="busybox", memory="128M")
    try:
        before = _memcg_file(sb, "memory.usage_in_bytes")
        sb.write_file("/tmp/data", os.urandom(4 * MiB) * 8)
        after = _memcg_file(sb, "memory.usage_in_bytes")
        # 32 MiB of tmpfs pages, in the sandbox's group (the daemon's own
        # write left it at a few hundred KiB).
        assert after - before >= 30 * MiB, (before, after)
        assert sb.stat("/tmp/data")["size"] == 32 * MiB
    finally:
        sb.destroy(force=True)


def _oom_kills(sb) -> int:
    groups = [g for k, g in sb.inspect()["cgroups"].items() if "memory" in k]
    with open(os.path.join(groups[0], "memory.oom_control")) as f:
        return next(int(line.split()[1]) for line in f if line.startswith("oom_kill "))


def test_a_copy_larger_than_memory_is_refused_in_the_sandbox_and_leaves_nothing(client):
    sb = client.create(image="busybox", memory="64M")
    try:
        with pytest.raises(LimitExceeded, match="memory limit") as info:
            sb.write_file("/tmp/big", os.urandom(4 * MiB) * 40)    # 160 MiB, atomic: the SDK's default
        # Named as the caller named it, not as the temporary file it went to.
        assert f"write {sb.id}:/tmp/big: " in info.value.message and ".dsec-" not in str(info.value)
        assert info.value.detail["path"] == f"{sb.id}:/tmp/big" and info.value.code == "limit"
        # Charged to the sandbox up to its limit (less a reserve), then refused:
        # no OOM kill, nothing on the host.
        assert _memcg_file(sb, "memory.max_usage_in_bytes") >= 40 * MiB
        assert _oom_kills(sb) == 0
        assert sb.list_files("/tmp") == []                         # no partial file, no temporary
        assert sb.exec(["true"]).exit_code == 0                    # and the sandbox lives on
    finally:
        sb.destroy(force=True)


def test_write_at_an_offset_keeps_the_rest(client):
    sb = client.create(image="busybox", memory="64M")
    try:
        sb.write_file("/tmp/f", b"0123456789")
        assert sb.write_at("/tmp/f", 3, b"abc") == 10
        assert sb.read_file("/tmp/f") == b"012abc6789"
        assert sb.write_at("/tmp/f", 12, b"Z") == 13              # past the end: a hole of zeros
        assert sb.read_file("/tmp/f") == b"012abc6789\0\0Z"
        from dsecd.errors import BadRequest
        with pytest.raises(BadRequest, match="offset"):
            client.request("file_write", sandbox=sb.id, path="/tmp/f", data=b"x", offset=-1)
    finally:
        sb.destroy(force=True)


def test_a_directory_copy_is_charged_to_the_sandbox(client, tmp_path):
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    for i in range(4):
        (src / "sub" / f"f{i}").write_bytes(os.urandom(8 * MiB))
    sb = client.create(image="busybox", memory="128M")
    try:
        before = _memcg_file(sb, "memory.usage_in_bytes")
        assert sb.upload_dir(str(src), "/tmp/tree")["bytes"] >= 32 * MiB
        assert _memcg_file(sb, "memory.usage_in_bytes") - before >= 30 * MiB
    finally:
        sb.destroy(force=True)
    for i in range(4, 12):                                        # 96 MiB: past a 64M sandbox
        (src / "sub" / f"f{i}").write_bytes(os.urandom(8 * MiB))
    sb = client.create(image="busybox", memory="64M")
    try:
        with pytest.raises(LimitExceeded, match="memory limit"):
            sb.upload_dir(str(src), "/tmp/tree")
        assert _memcg_file(sb, "memory.max_usage_in_bytes") >= 40 * MiB
        assert _oom_kills(sb) == 0
        assert sb.list_files("/tmp") == []                        # the half-made copy is gone
    finally:
        sb.destroy(force=True)


def _fds_into(pid: int, part: str) -> list[str]:
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:           # closed meanwhile
            continue
        if part in target:
            held.append(target)
    return held


def test_a_cancelled_write_leaves_no_open_file_in_the_daemon(daemon):
    """A write_file cancelled by its caller (a timeout, a task cancelled)
    while the daemon opens the file: the open goes on in a worker, and the
    file it opened was never closed. Each such cancel kept a file of the
    sandbox open in the daemon, past the sandbox's destroy."""
    import asyncio

    import dsecd

    async def go():
        async with dsecd.Client(daemon.socket) as c:
            sb = await c.create(image="busybox", memory="256M")
            try:
                for i in range(12):
                    for atomic in (True, False):
                        task = asyncio.create_task(sb.write_file("/leakcheck/big", os.urandom(8 * MiB),
                                                                 atomic=atomic))
                        await asyncio.sleep(0.002 * i)
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError, LimitExceeded):   # or done before the cancel
                            await task
                await asyncio.sleep(1)
                return _fds_into(daemon.proc.pid, "/leakcheck/")
            finally:
                await sb.destroy(force=True)

    assert asyncio.run(go()) == []


def test_a_cancelled_write_is_not_logged_as_an_error(daemon):
    """The copier of a cancelled write is killed on purpose: the daemon
    logged each as an asyncio "Task exception was never retrieved" error,
    blaming the OOM killer, for an operator to chase."""
    import asyncio

    import dsecd

    start = daemon.log.stat().st_size

    async def go():
        async with dsecd.Client(daemon.socket) as c:
            sb = await c.create(image="busybox", memory="256M")
            try:
                for i in range(12):
                    task = asyncio.create_task(sb.write_file("/tmp/big", os.urandom(8 * MiB)))
                    await asyncio.sleep(0.01 + 0.003 * i)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, LimitExceeded):   # or done before the cancel
                        await task
                await asyncio.sleep(1)
            finally:
                await sb.destroy(force=True)

    asyncio.run(go())
    with open(daemon.log, "rb") as f:
        f.seek(start)
        logged = f.read().decode(errors="replace")
    assert "never retrieved" not in logged, logged[-3000:]
