"""mkdir, remove, rename and exists inside a sandbox, from the SDK and the CLI,
with the escapes a sandbox could plant (symlinks out of it) refused."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dsecd.errors import BadRequest, Conflict, NotFound


def test_mkdir_rename_remove(sandbox):
    assert sandbox.mkdir("/work/a/b/c")["created"] is True
    assert sandbox.mkdir("/work/a/b/c")["created"] is False            # -p: no error
    with pytest.raises(Conflict):
        sandbox.mkdir("/work/a/b/c", parents=False)
    sandbox.exec(["ln", "-s", "/work/a/b", "/work/blink"])
    assert sandbox.mkdir("/work/blink")["created"] is False            # -p: a link to a directory is fine
    sandbox.remove("/work/blink")
    sandbox.write_file("/work/a/b/c/f.txt", b"x")
    sandbox.write_file("/work/a/top.txt", b"y")
    assert sandbox.exists("/work/a/b/c/f.txt") and not sandbox.exists("/work/nope")
    sandbox.rename("/work/a/top.txt", "/work/a/b/moved.txt")
    assert sandbox.read_file("/work/a/b/moved.txt") == b"y" and not sandbox.exists("/work/a/top.txt")
    sandbox.write_file("/work/a/other.txt", b"z")
    with pytest.raises(Conflict, match="exists"):
        sandbox.rename("/work/a/other.txt", "/work/a/b/moved.txt")
    sandbox.rename("/work/a/other.txt", "/work/a/b/moved.txt", overwrite=True)
    assert sandbox.read_file("/work/a/b/moved.txt") == b"z"
    with pytest.raises(Conflict, match="not empty"):
        sandbox.remove("/work/a")
    assert sandbox.remove("/work/a", recursive=True)["removed"] == 5     # a, b, c, f.txt, moved.txt
    assert not sandbox.exists("/work/a")
    with pytest.raises(NotFound):
        sandbox.remove("/work/a")
    with pytest.raises(BadRequest):
        sandbox.remove("/", recursive=True)


def test_list_to_a_depth(sandbox):
    sandbox.exec(["sh", "-c", "mkdir -p /work/l/a/b/c /keep && touch /work/l/top /work/l/a/b/c/deep "
                              "&& ln -s /keep /work/l/link"])
    assert [e["name"] for e in sandbox.list_files("/work/l")] == ["a", "link", "top"]
    two = {e["name"]: e["type"] for e in sandbox.list_files("/work/l", depth=2)}
    assert two == {"a": "dir", "a/b": "dir", "link": "symlink", "top": "file"}
    deep = {e["name"] for e in sandbox.list_files("/work/l", depth=10)}
    assert "a/b/c/deep" in deep and not any(n.startswith("link/") for n in deep)
    with pytest.raises(BadRequest, match="depth"):
        sandbox.list_files("/work/l", depth=0)


def test_remove_never_follows_a_symlink_out_of_its_tree(sandbox):
    """A sandbox points a link inside the tree at a directory elsewhere: the
    link goes, what it points at stays."""
    sandbox.exec(["sh", "-c", "mkdir -p /keep /work/t && echo kept > /keep/f && ln -s /keep /work/t/link"])
    assert sandbox.remove("/work/t", recursive=True)["removed"] == 2       # t and the link
    assert sandbox.exec(["cat", "/keep/f"]).stdout == b"kept\n"


def test_cli_ls_cat_rm(daemon, sandbox):
    sandbox.write_file("/work/d/one.txt", b"hello\n")
    sandbox.mkdir("/work/d/sub")
    r = daemon.cli("ls", f"{sandbox.id}:/work/d")
    assert r.returncode == 0 and b"one.txt" in r.stdout and b"sub" in r.stdout, r.stderr
    names = {e["name"]: e["type"] for e in json.loads(daemon.cli("ls", f"{sandbox.id}:/work/d", "--json").stdout)}
    assert names == {"one.txt": "file", "sub": "dir"}
    sandbox.write_file("/work/d/sub/two.txt", b"2")
    r = daemon.cli("ls", "--depth", "2", f"{sandbox.id}:/work/d")
    assert r.returncode == 0 and b"sub/two.txt" in r.stdout, r.stderr
    assert daemon.cli("cat", f"{sandbox.id}:/work/d/one.txt").stdout == b"hello\n"
    r = daemon.cli("cat", "--json", f"{sandbox.id}:/work/d/one.txt", f"{sandbox.id}:/work/d/sub/two.txt")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.splitlines()] == [
        {"sandbox": sandbox.id, "path": "/work/d/one.txt", "size": 6, "data": "hello\n"},
        {"sandbox": sandbox.id, "path": "/work/d/sub/two.txt", "size": 1, "data": "2"}]
    r = daemon.cli("rm", f"{sandbox.id}:/work/d")
    assert r.returncode == 1 and b"not empty" in r.stderr and b"dsec rm -r" in r.stderr, r.stderr
    assert daemon.cli("rm", "-r", f"{sandbox.id}:/work/d").returncode == 0
    assert not sandbox.exists("/work/d")
    r = daemon.cli("rm", sandbox.id, f"{sandbox.id}:/work")
    assert r.returncode == 2 and b"not both" in r.stderr
    assert daemon.cli("ls", "/local/path").returncode == 2


def test_a_refused_path_says_which_request_and_sandbox(sandbox):
    """A scaffold running many sandboxes at once reads which one and which
    request a refusal was about, as it does for a file that is missing."""
    sandbox.exec(["sh", "-c", "mkdir -p /work/d && mkfifo /work/fifo"])
    cases = [(lambda: sandbox.read_file("/work/d"), "read", "/work/d", "is a directory, not a regular file"),
             (lambda: sandbox.read_file("/work/fifo"), "read", "/work/fifo", "is a fifo, not a regular file"),
             (lambda: sandbox.write_file("/work/d", b"x"), "write", "/work/d", "is a directory, not a file"),
             (lambda: sandbox.list_files("work"), "list", "work", "must be absolute"),
             (lambda: sandbox.stat("/work/../etc"), "stat", "/work/../etc", "must not contain '..'"),
             (lambda: sandbox.read_file("/proc/self/status"), "read", "/proc/self/status", "kernel interface")]
    for call, verb, path, says in cases:
        with pytest.raises(BadRequest) as err:
            call()
        assert err.value.message.startswith(f"{verb} {sandbox.id}:{path}: "), err.value
        assert says in err.value.message and err.value.detail["path"] == path, err.value
    with pytest.raises(NotFound) as err:             # how a missing file has always been said
        sandbox.read_file("/work/none")
    assert err.value.message.startswith(f"read {sandbox.id}:/work/none: "), err.value


# A client that starts an atomic write (what `dsec cp FILE SB:/dir/` sends
# first: its temporary file) and then waits to be killed.
_CUT_WRITER = """
import asyncio, sys, dsecd
async def main():
    async with dsecd.Client(sys.argv[1]) as c:
        for name in sys.argv[3:]:
            await c.request("file_write", sandbox=sys.argv[2], path=name, data=b"part", temporary=True)
        print("written", flush=True)
        await asyncio.sleep(600)
asyncio.run(main())
"""


@contextlib.contextmanager
def _killed_after(daemon, script: str, *args: str, ready: bytes):
    """A client (`script` run with the daemon's socket and `args`) that has
    printed `ready`, SIGKILLed when the with block ends, however it ends."""
    client = subprocess.Popen([sys.executable, "-c", script, daemon.socket, *args], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert client.stdout.readline() == ready
        yield
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
        client.stdout.close()


def test_a_client_killed_mid_write_has_its_temporary_file_removed_at_once(daemon, sandbox):
    """A `dsec cp BIG SB:/work/` killed with SIGKILL left its `.dsec-<hex>`
    part in the sandbox until the daemon restarted; the daemon removes it
    when the client's connection drops, and no file that took its name."""
    sandbox.exec(["mkdir", "-p", "/work/cut"])
    with _killed_after(daemon, _CUT_WRITER, sandbox.id, "/work/cut/.dsec-aaaaaaaaaaaa",
                       "/work/cut/.dsec-bbbbbbbbbbbb", ready=b"written\n"):
        sandbox.exec(["sh", "-c", "mv /work/cut/.dsec-bbbbbbbbbbbb /work/cut/kept && "
                                  "echo user > /work/cut/.dsec-bbbbbbbbbbbb"])
    deadline = time.monotonic() + 10
    while ".dsec-aaaaaaaaaaaa" in (names := sorted(e["name"] for e in sandbox.list_files("/work/cut"))):
        assert time.monotonic() < deadline, names
        time.sleep(0.05)
    assert names == [".dsec-bbbbbbbbbbbb", "kept"]
    assert sandbox.read_file("/work/cut/.dsec-bbbbbbbbbbbb") == b"user\n"
    while _copy_records(daemon, sandbox.id):      # the file goes first, then its record
        assert time.monotonic() < deadline, _copy_records(daemon, sandbox.id)
        time.sleep(0.05)


_CUT_LANDER = """
import asyncio, io, sys, tarfile, dsecd
def tar():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("part.txt"); info.size = 4
        tf.addfile(info, io.BytesIO(b"part"))
    return buf.getvalue()
async def main():
    async with dsecd.Client(sys.argv[1]) as c:
        sb = await c.get(sys.argv[2])
        await sb.upload_tar(tar(), sys.argv[3], temporary=True)
        await sb.upload_tar(tar(), sys.argv[4], temporary=True)
        await sb.remove(sys.argv[4], recursive=True)        # its own, removed by itself: forgotten
        print("landed", flush=True)
        await asyncio.sleep(600)
asyncio.run(main())
"""


def test_a_client_killed_mid_merge_has_its_landing_directory_removed(daemon, sandbox):
    """`dsec cp -r DIR/. SB:/work/in` lands the tree in `.dsec-cp-*` inside
    /work/in and merges it from there; killed in between, the landing
    directory stayed in the user's directory for good. The daemon removes
    it when the connection drops."""
    sandbox.exec(["mkdir", "-p", "/work/in"])
    with _killed_after(daemon, _CUT_LANDER, sandbox.id, "/work/in/.dsec-cp-1-aaaa", "/work/in/.dsec-cp-1-bbbb",
                       ready=b"landed\n"):
        assert sorted(e["name"] for e in sandbox.list_files("/work/in")) == [".dsec-cp-1-aaaa"]
        assert _copy_records(daemon, sandbox.id)
    # The landing directory goes first, then its record (dsecd/engine/files.py _temp_orphaned).
    deadline = time.monotonic() + 10
    while sandbox.list_files("/work/in") or _copy_records(daemon, sandbox.id):
        assert time.monotonic() < deadline, (sandbox.list_files("/work/in"), _copy_records(daemon, sandbox.id))
        time.sleep(0.05)


def _copy_records(daemon, sb_id: str) -> list[str]:
    """The daemon's records of the temporaries its clients left under way in `sb_id`."""
    return [n for n in os.listdir(daemon.state / "copy-temps") if n.startswith(sb_id)]


def test_names_that_are_not_utf8_list_and_copy_byte_exact(daemon, sandbox, tmp_path):
    """A name made in the sandbox of bytes that are not UTF-8 (`touch
    $'\\xff'`) broke `dsec ls` (an internal error) and every file call
    naming it; it lists (as its bytes; in JSON and the SDK as os.listdir's
    surrogates) and copies both ways as the same bytes."""
    sandbox.exec(["sh", "-c", 'mkdir -p /work/odd && cd /work/odd && printf one > "$(printf "\\377x")" && '
                              'mkdir "$(printf "sub\\376")" && printf two > "$(printf "sub\\376/a\\300b")"'])
    ff, sub, c0, new = (os.fsdecode(raw) for raw in (b"\xffx", b"sub\xfe", b"a\xc0b", b"new\x80"))
    assert sorted(e["name"] for e in sandbox.list_files("/work/odd", depth=2)) == [sub, f"{sub}/{c0}", ff]
    r = daemon.cli("ls", f"{sandbox.id}:/work/odd")
    assert r.returncode == 0 and b" \xffx\n" in r.stdout and b" sub\xfe\n" in r.stdout, r
    r = daemon.cli("ls", "--json", f"{sandbox.id}:/work/odd")
    assert r.returncode == 0 and sorted(e["name"] for e in json.loads(r.stdout)) == [sub, ff], r
    assert sandbox.read_file(f"/work/odd/{ff}") == b"one"
    # Out and in again under CLI arguments of the same bytes, file by file and as a tree.
    r = daemon.cli("cp", f"{sandbox.id}:/work/odd/{ff}", str(tmp_path))
    assert r.returncode == 0 and (tmp_path / ff).read_bytes() == b"one", r
    assert daemon.cli("cat", f"{sandbox.id}:/work/odd/{sub}/{c0}").stdout == b"two"
    r = daemon.cli("cp", "-r", f"{sandbox.id}:/work/odd", str(tmp_path / "tree"))
    assert r.returncode == 0 and (tmp_path / "tree" / sub / c0).read_bytes() == b"two", r
    (tmp_path / "tree" / sub / new).write_bytes(b"three")
    r = daemon.cli("cp", "-r", f"{tmp_path / 'tree'}/.", f"{sandbox.id}:/work/odd")    # merged into it
    assert r.returncode == 0, r
    assert sandbox.read_file(f"/work/odd/{sub}/{new}") == b"three"
    r = daemon.cli("cp", str(tmp_path / ff), f"{sandbox.id}:/work/{ff}")
    assert r.returncode == 0 and sandbox.exec(["sh", "-c", "cat /work/?x"]).stdout == b"one", r
    assert sandbox.stat(f"/work/{ff}")["path"] == f"/work/{ff}"
    r = daemon.cli("rm", "--json", f"{sandbox.id}:/work/{ff}")
    assert r.returncode == 0 and json.loads(r.stdout)["path"] == f"/work/{ff}", r
    assert not sandbox.exists(f"/work/{ff}")
    r = daemon.cli("ls", f"{sandbox.id}:/work/{os.fsdecode(b'gone' + bytes([0xff]))}")
    assert r.returncode == 1 and b"not_found" in r.stderr and b"gone\\xff" in r.stderr, r


def test_a_listing_cut_short_says_so(daemon, sandbox):
    """A directory of more entries than one listing gives (100,000): `dsec
    ls` printed 100,000 of them and exited 0, as if that were all."""
    sandbox.exec(["sh", "-c", "mkdir /work/many && cd /work/many && seq 1 100003 | xargs touch"], timeout=120)
    listed = sandbox.list_files("/work/many")
    assert listed.truncated and len(listed) == 100_000
    assert not sandbox.list_files("/work").truncated
    for args in ((), ("--json",)):
        r = daemon.cli("ls", *args, f"{sandbox.id}:/work/many")
        assert r.returncode == 1 and b"only 100000 of its entries are listed" in r.stderr, r.stderr
    sandbox.remove("/work/many", recursive=True)


_MEASURED_DSEC = """
import resource, sys
from dsecd.cli import main
try:
    main(sys.argv[1:])
finally:
    print(f"maxrss_kib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
"""


def _measured_dsec(daemon, *args, stdin=None, stdout=None) -> tuple[subprocess.CompletedProcess, int]:
    """`dsec ARGS` and the most memory its process held (KiB)."""
    r = subprocess.run([sys.executable, "-c", _MEASURED_DSEC, "--socket", daemon.socket, *args], stdin=stdin,
                       stdout=stdout if stdout is not None else subprocess.PIPE, stderr=subprocess.PIPE,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=120)
    return r, int(r.stderr.rsplit(b"maxrss_kib=", 1)[1])


def test_a_copy_larger_than_memory_allows_streams_both_ways(daemon, client, tmp_path):
    """dsec cp and cat held a whole file in the client's memory (a 10 GB
    checkpoint out of a sandbox: 10 GB in dsec); they stream it, whatever
    its size, within a few chunks of memory, and the bytes are exact."""
    sb = client.create(image="busybox", memory="256M")
    try:
        big = tmp_path / "big"
        with open(big, "wb") as f:
            for _ in range(24):
                f.write(os.urandom(4 << 20))            # 96 MiB
        size = big.stat().st_size
        _, floor = _measured_dsec(daemon, "version")
        r, upload = _measured_dsec(daemon, "cp", "--json", str(big), f"{sb.id}:/work/big")
        assert r.returncode == 0 and json.loads(r.stdout)["size"] == size, r.stderr
        assert sb.exec(["sh", "-c", "wc -c < /work/big"]).stdout.strip() == str(size).encode()
        r, download = _measured_dsec(daemon, "cp", f"{sb.id}:/work/big", str(tmp_path / "back"))
        assert r.returncode == 0, r.stderr
        with open(tmp_path / "cat", "wb") as out:
            r, cat = _measured_dsec(daemon, "cat", f"{sb.id}:/work/big", stdout=out)
        assert r.returncode == 0, r.stderr
        with open(big, "rb") as src:
            r, from_stdin = _measured_dsec(daemon, "cp", "-", f"{sb.id}:/work/again", stdin=src)
        assert r.returncode == 0, r.stderr
        for copy in ("back", "cat"):
            assert (tmp_path / copy).read_bytes() == big.read_bytes(), copy
        assert sb.exec(["cmp", "/work/big", "/work/again"]).exit_code == 0
        # A few 4 MiB chunks in flight, never the file's 96 MiB.
        for what, peak in {"upload": upload, "download": download, "cat": cat, "stdin": from_stdin}.items():
            assert peak - floor < 48 << 10, f"dsec {what} held {peak - floor} KiB more than dsec version"
    finally:
        sb.destroy(force=True)


def test_what_the_file_api_writes_is_the_sandbox_roots_whatever_its_user(client):
    """As the README says: a write_file or upload_dir into a sandbox that
    runs as nobody makes files of uid 0, which a chown as root hands over."""
    sb = client.create(image="busybox", memory="128M", user="nobody")
    try:
        sb.write_file("/work/a.txt", b"x")
        assert sb.stat("/work/a.txt")["uid"] == 0
        assert sb.exec("echo >> /work/a.txt").exit_code != 0
        assert sb.exec(["chown", "nobody", "/work/a.txt"], user="0").exit_code == 0
        assert sb.exec("echo >> /work/a.txt").exit_code == 0
    finally:
        sb.destroy(force=True)


def check_owners(sb, local_dir) -> None:
    """What the file API makes belongs to the `owner` a request names (a
    name, a uid, name:group), its parents too; without one, to the
    sandbox's root; a file it replaces keeps its own owner. (A microVM's
    too: test_microvm.py.)"""
    def ids(path: str) -> tuple[int, int]:
        st = sb.stat(path)
        return st["uid"], st["gid"]

    sb.write_file("/work/own/a/f.txt", b"x", owner="nobody")
    assert ids("/work/own/a/f.txt") == ids("/work/own/a") == ids("/work/own") == (65534, 65534)
    assert sb.exec(["sh", "-c", "echo y >> /work/own/a/f.txt"], user="nobody").exit_code == 0
    sb.write_file("/work/own/raw.txt", b"x", owner=1000, atomic=False)
    assert ids("/work/own/raw.txt") == (1000, 1000)
    assert sb.mkdir("/work/own/m/n", owner="nobody:root")["created"] is True
    assert ids("/work/own/m/n") == ids("/work/own/m") == (65534, 0)
    sb.write_file("/work/root.txt", b"r")
    assert ids("/work/root.txt") == (0, 0)
    sb.write_file("/work/root.txt", b"r2", owner="nobody")          # replaced: its owner stays
    assert ids("/work/root.txt") == (0, 0) and sb.read_file("/work/root.txt") == b"r2"
    (local_dir / "sub").mkdir(parents=True)
    (local_dir / "sub" / "g.txt").write_text("g")
    (local_dir / "link").symlink_to("sub/g.txt")
    sb.upload_dir(str(local_dir), "/work/up", owner="65534")
    for path in ("/work/up", "/work/up/sub", "/work/up/sub/g.txt", "/work/up/link"):
        assert ids(path) == (65534, 65534), path
    with pytest.raises(BadRequest, match="cannot give files to owner 'nosuch'"):
        sb.write_file("/work/own/x", b"x", owner="nosuch")
    with pytest.raises(BadRequest, match="owner uid 70000 does not exist"):
        sb.mkdir("/work/own/y", owner=70000)
    assert not sb.exists("/work/own/x") and not sb.exists("/work/own/y")


def test_what_the_file_api_makes_belongs_to_the_owner_named(daemon, sandbox, tmp_path):
    check_owners(sandbox, tmp_path / "tree")
    (tmp_path / "cli.txt").write_text("c")
    r = daemon.cli("cp", "--owner", "nobody", str(tmp_path / "cli.txt"), f"{sandbox.id}:/work/cli/c.txt")
    assert r.returncode == 0, r.stderr
    assert (sandbox.stat("/work/cli/c.txt")["uid"], sandbox.stat("/work/cli")["uid"]) == (65534, 65534)
    r = daemon.cli("cp", "-r", "--owner", "1000:1000", str(tmp_path / "tree"), f"{sandbox.id}:/work/cli")
    assert r.returncode == 0, r.stderr
    assert sandbox.stat("/work/cli/tree/sub/g.txt")["uid"] == 1000
    r = daemon.cli("cp", "--owner", "nobody", f"{sandbox.id}:/work/cli/c.txt", str(tmp_path / "back.txt"))
    assert r.returncode == 2 and b"--owner" in r.stderr, r.stderr


def test_a_later_chunk_never_makes_again_a_file_that_went(daemon, sandbox):
    """A streamed write's later chunks name the file its first chunk made
    (same_as): one removed meanwhile (a temporary file whose connection
    ended, the SDK reconnecting) is not made again holding only the later
    chunks, and another file at the path is not written into."""
    with daemon.client() as a:
        fid = a.request("file_write", sandbox=sandbox.id, path="/work/part", data=b"AAAA", temporary=True)["file"]
    deadline = time.monotonic() + 10
    while sandbox.exists("/work/part") and time.monotonic() < deadline:    # removed as a's connection ends
        time.sleep(0.05)
    assert not sandbox.exists("/work/part")
    with daemon.client() as b:
        with pytest.raises(NotFound):
            b.request("file_write", sandbox=sandbox.id, path="/work/part", offset=4, data=b"BB", same_as=fid)
        assert not sandbox.exists("/work/part")
        sandbox.write_file("/work/part", b"other", atomic=False)
        with pytest.raises(Conflict) as exc:
            b.request("file_write", sandbox=sandbox.id, path="/work/part", offset=4, data=b"BB", same_as=fid)
        assert exc.value.detail.get("replaced") is True
        with pytest.raises(Conflict):               # nor emptied, by a write from the start
            b.request("file_write", sandbox=sandbox.id, path="/work/part", data=b"BB", same_as=fid)
        assert sandbox.read_file("/work/part") == b"other"
        fid = b.request("file_write", sandbox=sandbox.id, path="/work/part", data=b"1234")["file"]
        b.request("file_write", sandbox=sandbox.id, path="/work/part", offset=4, data=b"56", same_as=fid)
        assert sandbox.read_file("/work/part") == b"123456"
