"""File access from the host never leaves the sandbox (openat2 RESOLVE_IN_ROOT)."""

import asyncio
import contextlib
import os

import pytest

import dsecd
from dsecd.errors import BadRequest, NotFound


def test_write_read_roundtrip_with_parents(sandbox):
    sandbox.write_file("/work/dir/a.py", b"print(1)\n", mode=0o755)
    assert sandbox.read_file("/work/dir/a.py") == b"print(1)\n"
    st = sandbox.stat("/work/dir/a.py")
    assert st["type"] == "file" and st["mode"] == 0o755 and st["size"] == 9
    names = [e["name"] for e in sandbox.list_files("/work/dir")]
    assert names == ["a.py"]
    assert sandbox.exec(["cat", "/work/dir/a.py"]).stdout == b"print(1)\n"


def test_empty_and_100mib_files(sandbox):
    sandbox.write_file("/tmp/empty", b"")
    assert sandbox.read_file("/tmp/empty") == b""
    big = os.urandom(1 << 20) * 100
    sandbox.write_file("/work/big", big)
    assert sandbox.stat("/work/big")["size"] == len(big)
    assert sandbox.read_file("/work/big") == big


def test_atomic_write_errors_name_the_callers_path(sandbox):
    """write_file goes through a temporary file beside the target; its
    failures name the target, with the daemon's code and errno."""
    with pytest.raises(NotFound) as info:
        sandbox.write_file("/x/y/z", b"x", parents=False)
    err = info.value
    assert "/x/y/z" in err.message and ".dsec-" not in str(err) and ".dsec-" not in repr(err.detail)
    assert err.code == "not_found" and err.detail["errno"] == "ENOENT"
    assert err.detail["path"].endswith("/x/y/z")
    sandbox.exec(["mkdir", "-p", "/work/dir/sub"])
    with pytest.raises(BadRequest) as info:         # the rename step: a directory is in the way
        sandbox.write_file("/work/dir", b"x")
    assert "/work/dir" in info.value.message and ".dsec-" not in str(info.value)
    assert [e["name"] for e in sandbox.list_files("/work")] == ["dir"]       # no temporary left


def test_file_data_given_as_str_says_to_encode_it(sandbox):
    with pytest.raises(TypeError, match=r"write_file: data must be bytes \(got str\): encode it"):
        sandbox.write_file("/work/a", "text")
    with pytest.raises(TypeError, match=r"write_at: data must be bytes \(got str\)"):
        sandbox.write_at("/work/a", 0, "text")


def test_dotdot_in_path_is_refused(sandbox):
    with pytest.raises(BadRequest, match=r"\.\."):
        sandbox.read_file("/../../etc/hostname")
    with pytest.raises(BadRequest, match="absolute"):
        sandbox.read_file("etc/passwd")


def test_a_mode_out_of_range_is_shown_in_octal(sandbox):
    """0o17777 given, "got 17777" said: a reader takes that for decimal."""
    with pytest.raises(BadRequest, match=r"mode must be in \[0, 0o7777\], got 0o17777$"):
        sandbox.write_file("/work/m", b"x", mode=0o17777)
    with pytest.raises(BadRequest, match=r"got 0o10000$"):
        sandbox.mkdir("/work/d", mode=0o10000)


@pytest.mark.parametrize("mtime", [float("inf"), float("nan"), 1e20, -1e20])
def test_an_mtime_no_file_can_have_is_a_bad_request(sandbox, mtime):
    """set_attrs with an infinite, NaN or far out mtime failed as the
    daemon's own `internal` error (its conversion to nanoseconds raised)."""
    sandbox.exec(["mkdir", "/work/d"])
    with pytest.raises(BadRequest, match="mtime must be"):
        sandbox.set_attrs("/work/d", mtime=mtime)


def test_absolute_symlink_stays_inside(sandbox, tmp_path):
    host_secret = tmp_path / "secret"
    host_secret.write_text("host data")
    sandbox.exec(["sh", "-c", f"echo sandbox data > /tmp/mine; ln -s {host_secret} /tmp/evil; "
                              "ln -s ../../../../../tmp/mine /tmp/rel"])
    # The sandbox's /tmp/evil points at a path that exists only on the host.
    with pytest.raises(NotFound):
        sandbox.read_file("/tmp/evil")
    assert sandbox.read_file("/tmp/rel") == b"sandbox data\n"
    # Writing through the link must not create or touch the host file either.
    sandbox.exec(["sh", "-c", "ln -s /etc/host-owned /tmp/w"])
    sandbox.write_file("/tmp/w", b"x")
    assert not os.path.exists("/etc/host-owned")
    assert host_secret.read_text() == "host data"


def test_symlink_loop_is_bad_request(sandbox):
    sandbox.exec(["sh", "-c", "ln -s /tmp/l2 /tmp/l1; ln -s /tmp/l1 /tmp/l2"])
    with pytest.raises(BadRequest) as e:
        sandbox.read_file("/tmp/l1")
    assert e.value.detail["errno"] == "ELOOP"


def test_proc_magic_links_are_not_followed(sandbox):
    with pytest.raises(Exception) as e:
        sandbox.read_file("/proc/1/root/etc/passwd")
    assert getattr(e.value, "code", "") in ("bad_request", "permission", "not_found", "io")


def test_special_files_are_refused(sandbox):
    with pytest.raises(BadRequest):
        sandbox.read_file("/dev/zero")
    sandbox.exec(["mkfifo", "/tmp/fifo"])
    with pytest.raises(BadRequest):
        sandbox.read_file("/tmp/fifo")


def test_missing_file_and_dir(sandbox):
    with pytest.raises(NotFound):
        sandbox.read_file("/nope")
    with pytest.raises(NotFound):
        sandbox.list_files("/nope")


def test_a_cancelled_write_leaves_no_temporary_file(daemon):
    """A write_file cancelled mid-way (asyncio.wait_for, a task cancelled)
    leaves no `.dsec-` part beside its target: a chunk the daemon was
    writing when the cancel came must not make the file again after the
    write's clean-up removed it."""
    async def go() -> list[str]:
        data = os.urandom(30 << 20)
        async with dsecd.Client(daemon.socket) as c:
            async with c.sandbox(image="busybox") as sb:
                for i in range(60):             # cancelled at every stage of it
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(sb.write_file("/work/out.bin", data), i % 20 * 0.003)
                await asyncio.sleep(0.5)          # what the daemon was still doing is done
                return [e["name"] for e in await sb.list_files("/work")]

    assert asyncio.run(go()) in ([], ["out.bin"])


def test_a_read_is_never_torn_by_a_file_replaced_meanwhile(daemon):
    """read_file reads a large file in chunks, each request opening it
    again: a file replaced meanwhile (an atomic write_file, an editor's or
    a `mv`) must come back whole, old or new, never the start of one and
    the rest of the other."""
    a, b = b"a" * (20 << 20), b"b" * (12 << 20)

    async def go() -> list[bytes]:
        async with dsecd.Client(daemon.socket) as c:
            async with c.sandbox(image="busybox", memory="1G") as sb:
                await sb.write_file("/work/f", a)
                writes = 0

                async def replace() -> None:
                    nonlocal writes
                    while True:
                        await sb.write_file("/work/f", b if writes % 2 else a)
                        writes += 1

                writer = asyncio.create_task(replace())
                try:
                    return [await sb.read_file("/work/f") for _ in range(20)]
                finally:
                    writer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await writer

    torn = [i for i, data in enumerate(asyncio.run(go())) if data not in (a, b)]
    assert torn == []


def test_a_cancelled_recursive_remove_deletes_nothing_after_its_cancel(daemon):
    """A recursive remove runs in a daemon thread: cancelled (a timeout, the
    caller gone), it went on deleting the tree after the caller was told
    it was cancelled. It stops, and the cancel returns once it has."""
    files = 60_000

    async def go() -> tuple[int, int]:
        async with dsecd.Client(daemon.socket) as c:
            async with c.sandbox(image="busybox", memory="1G", disk="512M") as sb:
                await sb.exec(["sh", "-c", f"mkdir /work/t && cd /work/t && i=0; "
                                           f"while [ $i -lt {files} ]; do : > $i; i=$((i+1)); done"],
                              timeout=300)

                async def count() -> int:
                    out = await sb.exec(["sh", "-c", "ls /work/t 2>/dev/null | wc -l"])
                    return int(out.stdout)

                # Cancelled ever later until it has begun (it first lists the tree).
                for attempt in range(1, 40):
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(sb.remove("/work/t", recursive=True), 0.05 * attempt)
                    if (left := await count()) < files:
                        break
                await asyncio.sleep(1.0)
                return left, await count()

    left, later = asyncio.run(go())
    assert 0 < left < files and later == left
