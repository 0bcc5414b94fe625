"""Directory copies (file_tar_put / file_tar_get; SDK upload_dir,
download_dir, upload_tar; dsec cp -r): trees round-trip with their
symlinks, empty files and modes; hostile archives are refused with the entry
named and leave nothing behind; FIFOs and devices are neither copied nor
copied onto; symlinks planted in the sandbox never lead a copy out.

Each test runs on both backends: a container per test, and one microVM the
module's tests share (its /work emptied before each), since a VM under TCG
takes seconds to start."""

from __future__ import annotations

import asyncio
import datetime
import io
import os
import stat
import tarfile
import threading

import pytest
from conftest import sandbox_on, shared_vm, skip_unless_microvm

import dsecd
from dsecd.errors import BadRequest, Conflict, DsecError, LimitExceeded, NotFound
from dsecd.localcopy import LocalCopyError

# Its VMs start from the run's templates (conftest.VM_TEMPLATES): none of its tests is about how one is built.
pytestmark = pytest.mark.shared_vm_templates

BACKENDS = ("container", "microvm")


@pytest.fixture(scope="module")
def vm(daemon):
    yield from shared_vm(daemon)


@pytest.fixture(params=BACKENDS)
def sandbox(request, client):
    yield from sandbox_on(request.param, request, client, "rm -rf /work /inside && mkdir /work")


def make_tree(top):
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "deep.txt").write_bytes(b"deep\n" * 1000)
    (top / "empty").write_bytes(b"")
    (top / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(top / "run.sh", 0o750)
    (top / "sticky").mkdir()
    os.chmod(top / "sticky", 0o1777)
    (top / "big.bin").write_bytes(os.urandom(9 << 20))          # more than one 4M chunk
    os.symlink("a/b/deep.txt", top / "rel-link")
    os.symlink("/etc/passwd", top / "abs-link")
    os.symlink("nowhere", top / "dangling")
    os.chmod(top / "a" / "b", 0o500)                            # read-only dir: filled before its mode is set


def describe(top) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, top)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), open(path, "rb").read(), int(st.st_mtime))
    return out


def leftovers(sb, parent="/work") -> list[str]:
    return [e["name"] for e in sb.list_files(parent) if e["name"].startswith(".dsec-")]


def test_round_trip_keeps_tree_links_and_modes(sandbox, tmp_path):
    make_tree(tmp_path / "src")
    r = sandbox.upload_dir(str(tmp_path / "src"), "/work/copy")
    assert r["count"] == 11 and r["path"] == "/work/copy"
    ls = sandbox.exec(["sh", "-c", "cat /work/copy/rel-link; readlink /work/copy/abs-link; "
                                   "stat -c %a /work/copy/run.sh /work/copy/sticky /work/copy/a/b"])
    assert ls.stdout.decode().split() == ["deep"] * 1000 + ["/etc/passwd", "750", "1777", "500"]
    back = sandbox.download_dir("/work/copy", str(tmp_path / "back"))
    assert back["skipped"] == [] and back["count"] == 11
    assert describe(tmp_path / "back") == describe(tmp_path / "src")
    with pytest.raises(Conflict, match="exists"):
        sandbox.upload_dir(str(tmp_path / "src"), "/work/copy")
    with pytest.raises(LocalCopyError, match="exists"):
        sandbox.download_dir("/work/copy", str(tmp_path / "back"))
    assert leftovers(sandbox) == []


def test_a_copy_into_a_paused_sandbox_resumes_it_and_takes_every_chunk(sandbox, tmp_path):
    """The SDK sends the tar right behind the request, which first resumes
    the sandbox: the chunks wait for the copy to start, none is lost."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.bin").write_bytes(os.urandom(5 << 20))          # two chunks
    sandbox.pause()
    r = sandbox.upload_dir(str(tmp_path / "src"), "/work/after-pause")
    assert r["count"] == 2
    assert sandbox.read_file("/work/after-pause/f.bin") == (tmp_path / "src" / "f.bin").read_bytes()


def test_a_pause_during_a_copy_resumes_the_sandbox_for_it(daemon_factory, busybox_rootfs, tmp_path):
    """A pause freezes the sandbox's copier: a directory copy under way made
    no progress and failed once limits.frame_timeout_s had passed. The copy
    is the sandbox's op, as a file write's next chunk is: it resumes it and
    ends whole."""
    import time

    d = daemon_factory("[limits]\nframe_timeout_s = 3\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", memory="1G", disk="1G")
        tree = tmp_path / "tree"
        tree.mkdir()
        for i in range(300):
            (tree / f"f{i}").write_bytes(os.urandom(256 << 10))
        done: list = []
        copier = threading.Thread(target=lambda: done.append(sb.upload_dir(str(tree), "/work/tree")))
        copier.start()
        try:
            deadline = time.monotonic() + 60        # its landing dir is made: the copy is under way
            while time.monotonic() < deadline and not any(e["name"].startswith(".dsec-")
                                                           for e in sb.list_files("/work")):
                time.sleep(0.02)
            assert sb.pause()["state"] == "paused"
            copier.join(120)
            assert done and done[0]["count"] == 301, done
            assert sb.inspect()["state"] == "running"
            assert sb.exec(["sh", "-c", "ls /work/tree | wc -l"]).stdout == b"300\n"
        finally:
            copier.join(120)
            sb.destroy(force=True)
    finally:
        c.close()


def tar_of(*members) -> io.BytesIO:
    """A tar of (TarInfo fields, data) pairs, crafted as an attacker would."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for fields, data in members:
            fields = dict(fields)
            info = tarfile.TarInfo(fields.pop("name"))
            for key, value in fields.items():
                setattr(info, key, value)
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


OK_FILE = ({"name": "ok.txt"}, b"fine")      # comes first: the refusal must undo it too

HOSTILE = {
    "absolute": [({"name": "/etc/evil"}, b"x")],
    "dotdot": [({"name": "a/../../evil"}, b"x")],
    "through its own symlink": [({"name": "l", "type": tarfile.SYMTYPE, "linkname": "/"}, None),
                                ({"name": "l/etc/evil"}, b"x")],
    "through a symlink to a directory above": [({"name": "up", "type": tarfile.SYMTYPE, "linkname": ".."}, None),
                                               ({"name": "up/evil"}, b"x")],
    "char device": [({"name": "null", "type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, None)],
    "block device": [({"name": "sda", "type": tarfile.BLKTYPE, "devmajor": 8, "devminor": 0}, None)],
    "fifo": [({"name": "pipe", "type": tarfile.FIFOTYPE}, None)],
    "hard link out": [({"name": "h", "type": tarfile.LNKTYPE, "linkname": "../../etc/passwd"}, None)],
    "hard link to nothing": [({"name": "h", "type": tarfile.LNKTYPE, "linkname": "missing"}, None)],
    "setuid": [({"name": "suid", "mode": 0o4755}, b"#!/bin/sh\n")],
    "a file over a directory with entries": [({"name": "d", "type": tarfile.DIRTYPE}, None),
                                             ({"name": "d/f"}, b"1"), ({"name": "d"}, b"2")],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archives_are_refused_and_leave_nothing(sandbox, case):
    with pytest.raises(BadRequest) as err:
        sandbox.upload_tar(tar_of(OK_FILE, *HOSTILE[case]), "/work/hostile")
    assert "entry" in err.value.message or "link" in err.value.message
    assert not sandbox.exists("/work/hostile") and leftovers(sandbox) == []
    assert not sandbox.exists("/etc/evil") and not sandbox.exists("/evil") and not sandbox.exists("/work/evil")


def test_a_truncated_archive_leaves_nothing(sandbox):
    data = tar_of(OK_FILE, ({"name": "big"}, b"x" * 100_000)).getvalue()[:20_000]
    with pytest.raises(BadRequest, match="not a valid archive"):
        sandbox.upload_tar(io.BytesIO(data), "/work/cut")
    assert not sandbox.exists("/work/cut") and leftovers(sandbox) == []


def test_upload_tar_takes_bytes_and_says_what_else_it_takes(sandbox):
    """docker's put_archive takes the tar's bytes: so does upload_tar; a
    path given as a str is a TypeError saying to open it, not an
    AttributeError from deep inside, and nothing is sent."""
    assert sandbox.upload_tar(tar_of(OK_FILE).getvalue(), "/work/from-bytes")["count"] >= 1
    assert sandbox.read_file("/work/from-bytes/" + OK_FILE[0]["name"]) == OK_FILE[1]
    with pytest.raises(TypeError, match=r"upload_tar: give a binary file object \(open\(path, 'rb'\)\) or "
                                        r"the tar's bytes, got str"):
        sandbox.upload_tar("/etc/hostname", "/work/from-str")
    assert not sandbox.exists("/work/from-str") and leftovers(sandbox) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_entry_and_byte_caps(daemon_factory, busybox_rootfs, tmp_path, backend):
    d = daemon_factory('[limits]\nmax_tar_entries = 5\nmax_tar_bytes = "1K"\n',
                       shared_vm_templates=backend == "microvm")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        if backend == "microvm":
            skip_unless_microvm(c, close=False)
            sb = c.create(image="busybox", backend="microvm", memory="256M", net="none", disk="64M")
        else:
            sb = c.create(image="busybox", memory="64M")
        many = [({"name": f"f{i}"}, b"") for i in range(10)]
        with pytest.raises(LimitExceeded, match="entries"):
            sb.upload_tar(tar_of(*many), "/work/many")
        with pytest.raises(LimitExceeded, match="bytes"):
            sb.upload_tar(tar_of(({"name": "big"}, b"x" * 2000)), "/work/big")
        assert leftovers(sb) == [] and not sb.exists("/work/many")
        sb.exec(["sh", "-c", "mkdir /work/t && touch /work/t/1 /work/t/2 /work/t/3 /work/t/4 /work/t/5"])
        with pytest.raises(LimitExceeded, match="entries"):
            sb.download_dir("/work/t", str(tmp_path / "t"))
        assert not (tmp_path / "t").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".dsec")]
    finally:
        c.close()


def test_fifos_and_devices_are_not_copied(sandbox, tmp_path):
    src = tmp_path / "withfifo"
    src.mkdir()
    os.mkfifo(src / "pipe")
    with pytest.raises(LocalCopyError, match="FIFO"):
        sandbox.upload_dir(str(src), "/work/f")
    assert not sandbox.exists("/work/f")
    sandbox.exec(["sh", "-c", "mkdir -p /work/dev && mkfifo /work/dev/pipe && echo x > /work/dev/file"])
    r = sandbox.download_dir("/work/dev", str(tmp_path / "dev"))
    assert r["skipped"] == [{"path": "pipe", "type": "fifo", "reason": "not a file, directory or symlink: "
                                                                       "not copied"}]
    assert sorted(os.listdir(tmp_path / "dev")) == ["file"]
    r = sandbox.download_dir("/dev", str(tmp_path / "devices"))
    kinds = {s["type"] for s in r["skipped"]}
    assert "char" in kinds and not any(stat.S_ISCHR(os.lstat(os.path.join(p, f)).st_mode)
                                       for p, _, fs in os.walk(tmp_path / "devices") for f in fs)
    with pytest.raises(Conflict, match="exists"):                 # a FIFO as the target
        sandbox.upload_dir(str(tmp_path / "dev"), "/work/dev/pipe")
    os.mkfifo(tmp_path / "localpipe")
    with pytest.raises(LocalCopyError, match="exists"):
        sandbox.download_dir("/work/dev", str(tmp_path / "localpipe"))
    with pytest.raises(NotFound):                                # a FIFO as the source
        sandbox.download_dir("/work/dev/pipe", str(tmp_path / "p2"))


def test_symlinks_in_the_sandbox_never_lead_out(sandbox, tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f").write_bytes(b"x")
    sandbox.exec(["sh", "-c", "ln -s /proc/self/root /work/magic && ln -s / /work/rootlink"])
    with pytest.raises(DsecError):
        sandbox.upload_dir(str(tmp_path / "s"), "/work/magic/evil")
    with pytest.raises(DsecError):
        sandbox.download_dir("/work/magic", str(tmp_path / "m"))
    # An absolute link resolves inside the sandbox: /work/rootlink/x is the sandbox's /x.
    sandbox.upload_dir(str(tmp_path / "s"), "/work/rootlink/inside")
    assert sandbox.read_file("/inside/f") == b"x" and not os.path.exists("/inside")


def test_cli_cp_recursive(daemon, sandbox, tmp_path):
    make_tree(tmp_path / "src")
    up = daemon.cli("cp", "-r", str(tmp_path / "src"), f"{sandbox.id}:/work")      # into a dir: /work/src
    assert up.returncode == 0, up.stderr
    assert sandbox.read_file("/work/src/rel-link") == b"deep\n" * 1000
    down = daemon.cli("cp", "-r", f"{sandbox.id}:/work/src", str(tmp_path / "out"))
    assert down.returncode == 0, down.stderr
    assert describe(tmp_path / "out") == describe(tmp_path / "src")
    again = daemon.cli("cp", "-r", f"{sandbox.id}:/work/src", str(tmp_path / "out"))   # lands in out/src
    assert again.returncode == 0 and (tmp_path / "out" / "src" / "empty").exists()
    no_r = daemon.cli("cp", str(tmp_path / "src"), f"{sandbox.id}:/work/x")
    assert no_r.returncode != 0 and b"cp -r" in no_r.stderr
    os.mkfifo(tmp_path / "src" / "fifo")
    bad = daemon.cli("cp", "-r", str(tmp_path / "src"), f"{sandbox.id}:/work/y")
    assert bad.returncode == 1 and b"FIFO" in bad.stderr


def test_a_relative_source_is_a_bad_request(sandbox, tmp_path):
    """Refused before anything is read, as every file op refuses one."""
    with pytest.raises(BadRequest, match="must be absolute"):
        sandbox.download_dir("relative/path", str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()


class _StalledTar(io.RawIOBase):
    """A tar whose reads give its first `head` bytes, then wait for
    `release`: a copy left in progress, its first chunk extracted."""

    def __init__(self, data: bytes, head: int, release: threading.Event):
        self.data, self.head, self.release, self.pos = data, head, release, 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.head:
            self.release.wait()
            end = len(self.data) if n < 0 else self.pos + n
        else:
            end = self.head if n < 0 else min(self.pos + n, self.head)
        piece = self.data[self.pos:end]
        self.pos += len(piece)
        return piece


def test_a_cancelled_upload_has_left_nothing_when_its_cancel_returns(daemon, client):
    """A caller's timeout around upload_tar (a trainer's step): once the
    cancelled call has returned, the partial directory beside the target
    is gone, so what comes next (a listing, a snapshot) never sees it."""
    sb = client.create(image="busybox", memory="256M")
    data = tar_of(*(({"name": f"f{i}"}, os.urandom(1 << 20)) for i in range(8))).getvalue()
    release = threading.Event()

    async def go() -> list[str]:
        async with dsecd.Client(daemon.socket) as c:
            asb = await c.get(sb.id)
            chunk = asb._chunk_size()
            task = asyncio.ensure_future(asb.upload_tar(_StalledTar(data, chunk, release), "/work/up"))
            try:
                for _ in range(600):            # until the first chunk is extracted beside /work/up
                    if any(e["name"].startswith(".dsec-put-") for e in await asb.list_files("/work")):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the copy never began")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return [e["name"] for e in await asb.list_files("/work")]
            finally:
                release.set()               # the read the cancel left waiting in its thread

    try:
        assert asyncio.run(go()) == []
    finally:
        sb.destroy(force=True)


def test_a_cancelled_download_has_left_nothing_when_its_cancel_returns(daemon, client, tmp_path):
    """A caller's timeout around download_dir that comes while the tree is
    being unpacked here: once the cancelled call has returned, neither
    the destination nor its temporary directory beside it is there, nor
    turns up later (a retry to the same destination would find it)."""
    sb = client.create(image="busybox", memory="256M")
    sb.exec(["sh", "-c", "mkdir -p /work/d && cd /work/d && for i in $(seq 1 3000); do echo $i > f$i; done"])
    dst = tmp_path / "out" / "d"
    dst.parent.mkdir()

    def temporaries() -> list[str]:
        return [n for n in os.listdir(dst.parent) if n.startswith(".dsec-get-")]

    async def go() -> tuple[bool, list[str]]:
        async with dsecd.Client(daemon.socket) as c:
            task = asyncio.ensure_future((await c.get(sb.id)).download_dir("/work/d", str(dst)))
            while not temporaries():        # until the unpacking here has begun
                assert not task.done(), "the download ended before its unpacking was seen"
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return dst.exists(), temporaries()

    try:
        assert asyncio.run(go()) == (False, [])
        assert not dst.exists() and temporaries() == []
    finally:
        sb.destroy(force=True)


# ------------------------------------------------------------ dsec cp -: a tar on stdin or stdout

@pytest.fixture(params=BACKENDS)
def box(request, client):
    """A sandbox whose /work/in holds two files (dsec cp - makes and reads the tar on the client; the
    daemon's side is the one above)."""
    setup = "rm -rf /work /inside && mkdir -p /work/in && echo kept > /work/in/keep && echo old > /work/in/empty"
    for sb in sandbox_on(request.param, request, client, setup):
        sb.exec(["sh", "-c", setup])            # a new container's too
        yield sb


def tar_of_dir(top, gzip: bool = False) -> bytes:
    """`tar -C top -cf - .` as a Docker scaffold pipes it, by tarfile (hard links as links)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gzip else "w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(str(top), arcname=".")
    return buf.getvalue()


def untar(data: bytes, where) -> None:
    """The tar as `dsec cp SB:/dir - | tar -x -C where` gets it."""
    import subprocess

    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["tar", "-x", "-C", str(where)], input=data, capture_output=True)
    assert r.returncode == 0, r.stderr


def test_cli_cp_a_tar_from_stdin_and_to_stdout(daemon, box, tmp_path):
    """docker cp - CONTAINER:/dir and docker cp CONTAINER:/dir -: the tar's
    entries merge into the existing directory (links, modes, mtimes,
    hard links kept); out, the tree comes under its base name."""
    src = tmp_path / "src"
    make_tree(src)
    os.link(src / "run.sh", src / "hard")
    (src / "empty").write_bytes(b"")
    up = daemon.cli("cp", "-", f"{box.id}:/work/in", input=tar_of_dir(src))
    assert up.returncode == 0, up.stderr
    same = box.exec(["sh", "-c", "stat -c %i /work/in/run.sh /work/in/hard; cat /work/in/keep /work/in/empty; "
                                 "readlink /work/in/rel-link; stat -c %a /work/in/run.sh /work/in/a/b"])
    ino, ino2, *rest = same.stdout.decode().split()
    assert ino == ino2 and rest == ["kept", "a/b/deep.txt", "750", "500"]
    assert leftovers(box, "/work/in") == []

    down = daemon.cli("cp", f"{box.id}:/work/in", "-")
    assert down.returncode == 0 and down.stderr == b"", down.stderr
    names = tarfile.open(fileobj=io.BytesIO(down.stdout)).getnames()
    assert names[0] == "in" and all(n.startswith("in/") for n in names[1:])
    untar(down.stdout, tmp_path / "out")
    want = describe(src)
    want["keep"] = ("file", 0o644, b"kept\n", want["empty"][3])
    got = describe(tmp_path / "out" / "in")
    got["keep"] = got["keep"][:3] + (want["empty"][3],)          # made in the sandbox: its own mtime
    assert got == want

    contents = daemon.cli("cp", f"{box.id}:/work/in/.", "-")       # DIR/.: its entries, not itself
    assert contents.returncode == 0, contents.stderr
    assert "in" not in tarfile.open(fileobj=io.BytesIO(contents.stdout)).getnames()
    box.exec(["mkdir", "/work/gz"])
    gz = daemon.cli("cp", "-", f"{box.id}:/work/gz", input=tar_of_dir(src, gzip=True))
    assert gz.returncode == 0, gz.stderr
    assert box.read_file("/work/gz/a/b/deep.txt") == b"deep\n" * 1000


def test_cli_cp_stdin_into_a_file_or_a_missing_directory(daemon, box):
    """A file's path still takes stdin's bytes as they are; a directory that is not there is said so."""
    r = daemon.cli("cp", "-", f"{box.id}:/work/in/raw", input=b"not a tar")
    assert r.returncode == 0 and box.read_file("/work/in/raw") == b"not a tar"
    r = daemon.cli("cp", "-", f"{box.id}:/work/nope/", input=tar_of(OK_FILE).getvalue())
    assert r.returncode == 2 and b"/work/nope/: no such directory" in r.stderr


@pytest.mark.parametrize("case", ["dotdot", "through its own symlink", "hard link out", "char device"])
def test_cli_cp_stdin_refuses_escapes_and_leaves_the_directory_as_it_was(daemon, box, case):
    before = box.list_files("/work/in")
    r = daemon.cli("cp", "-", f"{box.id}:/work/in", input=tar_of(OK_FILE, *HOSTILE[case]).getvalue())
    assert r.returncode == 1 and b"bad_request" in r.stderr and b"entry" in r.stderr, r.stderr
    assert b".dsec-" not in r.stderr                    # named as the user named it
    assert box.list_files("/work/in") == before
    assert not box.exists("/etc/evil") and not box.exists("/work/evil")


@pytest.mark.parametrize("cut", ["in a file", "at an entry", "garbage", "gzip cut"])
def test_cli_cp_stdin_cut_short_fails_and_leaves_the_directory_as_it_was(daemon, box, tmp_path, cut):
    import gzip

    whole = tar_of(OK_FILE, ({"name": "big"}, b"x" * 100_000), ({"name": "last"}, b"y")).getvalue()
    data = {"in a file": whole[:20_000],
            "at an entry": whole[:whole.index(b"y" + b"\0" * 511) - 512],     # before the last entry's header
            "garbage": b"garbage" * 1000,
            "gzip cut": gzip.compress(whole)[:-100]}[cut]
    before = box.list_files("/work/in")
    r = daemon.cli("cp", "-", f"{box.id}:/work/in", input=data)
    assert r.returncode == 1, r.stderr
    assert re_any(r.stderr, b"not a valid archive", b"cut short"), r.stderr
    assert box.list_files("/work/in") == before


def re_any(text: bytes, *parts: bytes) -> bool:
    return any(p in text for p in parts)


def test_cli_cp_to_a_closed_stdout_ends_quietly(daemon, box, tmp_path):
    """`dsec cp SB:/dir - | head -c 10`: the reader goes; dsec ends as a
    shell's command does (141, nothing on stderr) and leaves no spool."""
    import subprocess

    from conftest import VENV_BIN

    box.exec(["sh", "-c", "mkdir /work/big && for i in 1 2 3 4 5 6; do "
                          "dd if=/dev/urandom of=/work/big/f$i bs=1M count=10 2>/dev/null; done"])
    spool = tmp_path / "tmp"
    spool.mkdir()
    r = subprocess.run(f"'{VENV_BIN / 'dsec'}' --socket '{daemon.socket}' cp {box.id}:/work/big - | head -c 10 "
                       ">/dev/null; echo ${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
                       capture_output=True, env={**os.environ, "TMPDIR": str(spool)}, timeout=120)
    assert r.stdout == b"141\n" and r.stderr == b"", r.stderr
    assert os.listdir(spool) == []
    whole = daemon.cli("cp", f"{box.id}:/work/big", "-")            # and the daemon copies it again
    assert whole.returncode == 0 and len(whole.stdout) > 60 << 20


def test_cli_cp_stdin_interrupted_leaves_nothing(daemon, box):
    """^C while the tar still comes: dsec ends (130) and nothing of the copy is left in the directory."""
    import signal
    import subprocess
    import time

    from conftest import VENV_BIN

    data = tar_of(*(({"name": f"f{i}"}, os.urandom(1 << 20)) for i in range(12))).getvalue()
    p = subprocess.Popen([str(VENV_BIN / "dsec"), "--socket", daemon.socket, "cp", "-", f"{box.id}:/work/in"],
                         stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        p.stdin.write(data[:6 << 20])
        p.stdin.flush()
        for _ in range(600):                    # its landing directory is made: the copy is under way
            if leftovers(box, "/work/in"):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the copy never began")
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 130, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    assert leftovers(box, "/work/in") == [] and sorted(e["name"] for e in box.list_files("/work/in")) == \
        ["empty", "keep"]


def test_cli_cp_stdin_that_trickles_in_is_not_taken_for_a_stalled_one(daemon_factory, busybox_rootfs):
    """`ssh host tar -c dir | dsec cp - SB:/dir` over a slow link: what
    came goes on to the daemon, which drops a copy that sends nothing
    for limits.frame_timeout_s, rather than waiting for a whole chunk."""
    import subprocess
    import time

    from conftest import VENV_BIN

    d = daemon_factory("[limits]\nframe_timeout_s = 3\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", memory="256M")
        sb.exec(["mkdir", "/work"])
        data = tar_of(*(({"name": f"f{i}"}, os.urandom(16 << 10)) for i in range(64))).getvalue()
        p = subprocess.Popen([str(VENV_BIN / "dsec"), "--socket", d.socket, "cp", "-", f"{sb.id}:/work"],
                             stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            step = len(data) // 16 + 1
            for start in range(0, len(data), step):     # 16 pieces over 8 s: far less than a chunk in 3 s
                try:
                    p.stdin.write(data[start:start + step])
                except BrokenPipeError:
                    raise AssertionError(p.stderr.read()) from None
                p.stdin.flush()
                time.sleep(0.5)
            p.stdin.close()
            assert p.wait(60) == 0, p.stderr.read()
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()
        assert len(sb.list_files("/work")) == 64
    finally:
        c.close()


def test_hard_links_come_out_as_hard_links(daemon, sandbox, tmp_path):
    """A file with two names in the sandbox comes out once, its second name
    a link to it (one copy of its bytes), as tar(1) and docker cp give it."""
    sandbox.exec(["sh", "-c", "mkdir -p /work/h/sub && dd if=/dev/urandom of=/work/h/a bs=1k count=64 2>/dev/null "
                          "&& ln /work/h/a /work/h/sub/b && echo solo > /work/h/c"])
    r = sandbox.download_dir("/work/h", str(tmp_path / "h"))
    assert r["bytes"] == (64 << 10) + 5
    assert os.stat(tmp_path / "h" / "a").st_ino == os.stat(tmp_path / "h" / "sub" / "b").st_ino
    out = daemon.cli("cp", f"{sandbox.id}:/work/h", "-")
    assert out.returncode == 0, out.stderr
    links = [(m.name, m.linkname) for m in tarfile.open(fileobj=io.BytesIO(out.stdout)) if m.islnk()]
    assert links == [("h/sub/b", "h/a")]


def test_cli_cp_takes_no_tar_from_a_terminal_nor_writes_one_to_it(daemon, box):
    """As tar(1) refuses to: a tar on a terminal is noise, and one to be
    typed in would wait for it."""
    import subprocess

    from conftest import VENV_BIN

    leader, follower = os.openpty()
    try:
        dsec = [str(VENV_BIN / "dsec"), "--socket", daemon.socket, "cp"]
        out = subprocess.run([*dsec, f"{box.id}:/work/in", "-"], stdout=follower, stderr=subprocess.PIPE,
                             timeout=60)
        assert out.returncode == 2 and b"stdout is a terminal: not writing a tar there" in out.stderr, out.stderr
        into = subprocess.run([*dsec, "-", f"{box.id}:/work/in"], stdin=follower, stderr=subprocess.PIPE,
                              timeout=60)
        assert into.returncode == 2 and b"stdin is a terminal" in into.stderr, into.stderr
    finally:
        os.close(leader)
        os.close(follower)
    assert sorted(e["name"] for e in box.list_files("/work/in")) == ["empty", "keep"]


def test_hard_links_go_into_a_sandbox_as_hard_links(sandbox, tmp_path):
    """upload_dir (dsec cp -r) sends a file with two names once, its
    second name a link to the first, as the daemon makes it."""
    src = tmp_path / "h"
    (src / "sub").mkdir(parents=True)
    (src / "a").write_bytes(os.urandom(64 << 10))
    os.link(src / "a", src / "sub" / "b")
    r = sandbox.upload_dir(str(src), "/work/h")
    assert r["count"] == 4 and r["bytes"] == 64 << 10
    inodes = sandbox.exec(["stat", "-c", "%i", "/work/h/a", "/work/h/sub/b"]).stdout.split()
    assert len(inodes) == 2 and inodes[0] == inodes[1]


def test_cli_cp_tar_gives_a_files_tar_as_docker_cp_does(daemon, box, tmp_path):
    """`docker cp C:/file - | tar -x` takes a tar of the file: --tar gives
    one (without it, '-' gives the file's bytes); into a path that is no
    directory, --tar says so rather than writing the tar as a file."""
    box.exec(["sh", "-c", "chmod 640 /work/in/keep && ln -s keep /work/in/link"])
    for name in ("keep", "link"):           # a symlink: what it leads to, as a plain copy follows it
        r = daemon.cli("cp", "--tar", f"{box.id}:/work/in/{name}", "-")
        assert r.returncode == 0, r.stderr
        [m] = tarfile.open(fileobj=io.BytesIO(r.stdout)).getmembers()
        assert (m.name, m.isreg(), m.size, stat.S_IMODE(m.mode)) == (name, True, 5, 0o640)
    untar(r.stdout, tmp_path / "x")
    assert (tmp_path / "x" / "link").read_bytes() == b"kept\n"
    r = daemon.cli("cp", f"{box.id}:/work/in/keep", "-")
    assert r.returncode == 0 and r.stdout == b"kept\n"
    r = daemon.cli("cp", "--tar", "-", f"{box.id}:/work/in/new", input=tar_of(OK_FILE).getvalue())
    assert r.returncode == 2 and b"no such directory" in r.stderr and not box.exists("/work/in/new")
    r = daemon.cli("cp", "--tar", str(tmp_path / "x"), f"{box.id}:/work/in")
    assert r.returncode == 2 and b"--tar goes with '-'" in r.stderr


def test_cli_cp_stdin_a_name_that_comes_again_is_the_later_one(daemon, box):
    """`tar -rf` appends a newer copy of a file to an archive; GNU tar
    extracts the last, and so does dsec cp -, merged into the directory."""
    data = tar_of(({"name": "keep"}, b"older\n"), ({"name": "d", "type": tarfile.DIRTYPE, "mode": 0o755}, None),
                  ({"name": "d/f"}, b"f\n"), ({"name": "keep", "mode": 0o600}, b"newer\n"),
                  ({"name": "d", "type": tarfile.DIRTYPE, "mode": 0o700}, None)).getvalue()
    r = daemon.cli("cp", "-", f"{box.id}:/work/in", input=data)
    assert r.returncode == 0, r.stderr
    got = box.exec(["sh", "-c", "cat /work/in/keep /work/in/d/f; stat -c %a /work/in/keep"]).stdout
    assert got.split() == [b"newer", b"f", b"600"]
    assert leftovers(box, "/work/in") == []


def test_cli_cp_stdin_sets_the_modes_and_mtimes_of_directories_it_merges_into(daemon, box):
    """GNU tar as root (--overwrite-dir, its default) gives a directory that
    exists the mode and mtime of the archive's entry for it, "." included
    (docker cp does so below "."); one the archive has no entry for keeps
    its own."""
    box.exec(["sh", "-c", "mkdir -m 700 /work/in/sub /work/in/bare && chmod 711 /work/in/bare && "
                          "echo old > /work/in/sub/old && chmod 755 /work/in"])
    data = tar_of(({"name": ".", "type": tarfile.DIRTYPE, "mode": 0o750, "mtime": 1_000_000}, None),
                  ({"name": "sub", "type": tarfile.DIRTYPE, "mode": 0o1777, "mtime": 2_000_000}, None),
                  ({"name": "sub/new", "mtime": 3_000_000}, b"new\n"),
                  ({"name": "bare/f"}, b"f\n")).getvalue()
    r = daemon.cli("cp", "-", f"{box.id}:/work/in", input=data)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    got = box.exec(["sh", "-c", "stat -c '%a %Y' /work/in /work/in/sub /work/in/bare; cat /work/in/sub/old"])
    lines = got.stdout.decode().splitlines()
    assert lines[:2] == ["750 1000000", "1777 2000000"] and lines[2].startswith("711 ") and lines[3] == "old"
    assert leftovers(box, "/work/in") == []


def test_cli_cp_stdin_gives_a_directory_it_merges_into_a_time_past_2262(daemon, box):
    """The merge sets an existing directory by file_set_attrs, which refused
    a time past 2262 that the copy itself sets: the cp failed after its moves."""
    data = tar_of(({"name": ".", "type": tarfile.DIRTYPE, "mode": 0o750,
                    "pax_headers": {"mtime": "10413792000.5"}}, None),
                  ({"name": "new"}, b"new\n")).getvalue()
    r = daemon.cli("cp", "-", f"{box.id}:/work/in", input=data)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    got = box.exec(["stat", "-c", "%a %Y", "/work/in"]).stdout.decode()
    assert got == "750 10413792000\n"
    assert leftovers(box, "/work/in") == []


def test_a_copy_in_sets_an_mtime_past_2262_to_the_nanosecond(sandbox):
    """2300-01-01 00:00:00.123456789 UTC: its nanoseconds pass 2**63, where a
    microVM's put records held them, and wrapped to a time before 1970; on
    both backends the file and the directory get the tar's time."""
    far = {"pax_headers": {"mtime": "10413792000.123456789"}}
    data = tar_of(({"name": "d", "type": tarfile.DIRTYPE, "mode": 0o755, **far}, None),
                  ({"name": "d/f", **far}, b"far\n"))
    sandbox.upload_tar(data, "/work/far")
    got = sandbox.exec(["stat", "-c", "%Y %y", "/work/far/d", "/work/far/d/f"]).stdout.decode()
    assert got.splitlines() == ["10413792000 2300-01-01 00:00:00.123456789 +0000"] * 2


def test_set_attrs_sets_a_files_or_directorys_mode_and_mtime_and_follows_no_symlink(sandbox):
    sandbox.exec(["sh", "-c", "mkdir -p /work/d && echo x > /work/f && ln -s f /work/l"])
    assert sandbox.set_attrs("/work/f", mode=0o600, mtime=1_500_000_000)["path"] == "/work/f"
    sandbox.set_attrs("/work/d", mode=0o1750)
    sandbox.set_attrs("/work/d", mtime=1_600_000_000.5)
    got = sandbox.exec(["stat", "-c", "%a %Y", "/work/f", "/work/d"]).stdout.decode().split("\n")
    assert got[:2] == ["600 1500000000", "1750 1600000000"]
    with pytest.raises(BadRequest, match="/work/l is a symlink, not a file or directory"):
        sandbox.set_attrs("/work/l", mode=0o777)
    sandbox.set_attrs("/work/l", mode=0o640, follow=True)          # what it leads to
    with pytest.raises(NotFound):
        sandbox.set_attrs("/work/missing", mode=0o777)
    with pytest.raises(BadRequest, match="give mode, mtime or both"):
        sandbox.set_attrs("/work/f")
    assert sandbox.exec(["stat", "-c", "%a", "/work/f"]).stdout == b"640\n"


@pytest.mark.parametrize("mtime", [10413792000.123456789, -11676096000.25])    # 2300-01-01, 1600-01-01
def test_set_attrs_sets_an_mtime_past_2262_or_before_1677(sandbox, mtime):
    """Its nanoseconds pass 2**63 either way: file_set_attrs refused such a
    time, which a container's os.utime takes and a copy in sets; on both
    backends the file and the directory now get the time os.utime is given."""
    sandbox.exec(["sh", "-c", "mkdir -p /work/d && echo x > /work/f"])
    sandbox.set_attrs("/work/f", mtime=mtime)
    sandbox.set_attrs("/work/d", mtime=mtime, mode=0o750)
    sec, nsec = divmod(int(mtime * 1e9), 10**9)         # as file_set_attrs sets it
    when = datetime.datetime(1970, 1, 1) + datetime.timedelta(seconds=sec)
    got = sandbox.exec(["stat", "-c", "%Y %y", "/work/f", "/work/d"]).stdout.decode()
    assert got.splitlines() == [f"{sec} {when:%Y-%m-%d %H:%M:%S}.{nsec:09d} +0000"] * 2


@pytest.mark.parametrize("mtime", [10413792000.123456789, -11676096000.25])    # 2300-01-01, 1600-01-01
def test_stat_and_list_give_an_mtime_past_2262_or_before_1677(sandbox, mtime):
    """A microVM's agent answered each mtime as 64-bit nanoseconds, which
    wrapped 2300-01-01 to 1715; both backends now give the float a
    container's os.stat does: seconds plus nanoseconds * 1e-9."""
    sandbox.exec(["sh", "-c", "mkdir -p /work/d && echo x > /work/f"])
    sandbox.set_attrs("/work/f", mtime=mtime)
    sandbox.set_attrs("/work/d", mtime=mtime)
    sec, nsec = divmod(int(mtime * 1e9), 10**9)         # as file_set_attrs sets it
    want = sec + nsec * 1e-9
    assert [sandbox.stat(p)["mtime"] for p in ("/work/f", "/work/d")] == [want, want]
    listed = {e["name"]: e["mtime"] for e in sandbox.list_files("/work")}
    assert listed == {"d": want, "f": want}


def test_cli_cp_stdin_into_a_symlink_to_a_directory_sets_the_directorys(daemon, box):
    """As tar -C follows a symlink to the directory it extracts into."""
    box.exec(["sh", "-c", "ln -s in /work/ln && chmod 755 /work/in"])
    data = tar_of(({"name": ".", "type": tarfile.DIRTYPE, "mode": 0o750, "mtime": 1_000_000}, None),
                  ({"name": "new"}, b"new\n")).getvalue()
    r = daemon.cli("cp", "-", f"{box.id}:/work/ln", input=data)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    got = box.exec(["sh", "-c", "stat -c '%a %Y' /work/in; readlink /work/ln; cat /work/in/new"]).stdout
    assert got.decode().split("\n")[:3] == ["750 1000000", "in", "new"]


def test_cli_cp_stdin_sets_a_directory_whose_name_is_not_utf8(daemon, box):
    """The put lists such a name as bytes (as a listing gives it): it is
    still the directory the merge sets."""
    name = os.fsdecode(b"\xff-dir")
    box.exec(["sh", "-c", "mkdir \"/work/in/$(printf '\\377-dir')\""])
    data = tar_of(({"name": name, "type": tarfile.DIRTYPE, "mode": 0o750, "mtime": 1_000_000}, None),
                  ({"name": f"{name}/f"}, b"f\n")).getvalue()
    r = daemon.cli("cp", "-", f"{box.id}:/work/in", input=data)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    got = box.exec(["sh", "-c", "stat -c '%a %Y' \"/work/in/$(printf '\\377-dir')\""]).stdout
    assert got == b"750 1000000\n"


def test_cli_cp_recursive_into_a_directory_gives_those_it_merges_into_the_sources_modes(daemon, box, tmp_path):
    """docker cp gives a directory that exists the mode and mtime of the
    source's directory of that name (but the destination's own, where
    DIR/. copies the contents)."""
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_bytes(b"f\n")
    os.chmod(src / "sub", 0o750)
    os.utime(src / "sub", (1_000_000, 1_000_000))
    os.chmod(src, 0o700)
    box.exec(["sh", "-c", "mkdir -m 711 /work/in/sub && chmod 755 /work/in"])
    r = daemon.cli("cp", "-r", f"{src}/.", f"{box.id}:/work/in")
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert box.exec(["stat", "-c", "%a", "/work/in", "/work/in/sub"]).stdout == b"755\n750\n"
    assert box.exec(["stat", "-c", "%Y", "/work/in/sub"]).stdout == b"1000000\n"
    r = daemon.cli("cp", "-r", str(src), f"{box.id}:/work")                 # /work/in is its namesake
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert box.exec(["stat", "-c", "%a", "/work/in"]).stdout == b"700\n"
    assert leftovers(box, "/work/in") == [] and leftovers(box) == []


def test_cli_cp_recursive_out_of_a_sandbox_gives_those_it_merges_into_the_sources_modes(daemon, box, tmp_path):
    """The same out of a sandbox: a local directory that exists takes the
    mode and mtime of the sandbox's directory of that name (the local top
    keeps its own where SB:DIR/. copies the contents)."""
    box.exec(["sh", "-c", "mkdir -p /work/in/sub && echo f > /work/in/sub/f && chmod 750 /work/in/sub && "
                          "touch -d @1000000 /work/in/sub && chmod 700 /work/in && touch -d @2000000 /work/in"])
    dst = tmp_path / "in"
    (dst / "sub").mkdir(parents=True)
    os.chmod(dst / "sub", 0o711)
    os.chmod(dst, 0o755)
    r = daemon.cli("cp", "-r", f"{box.id}:/work/in/.", str(dst))
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert (dst / "sub" / "f").read_bytes() == b"f\n"
    assert stat.S_IMODE(os.stat(dst).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(dst / "sub").st_mode) == 0o750 and os.stat(dst / "sub").st_mtime == 1_000_000
    r = daemon.cli("cp", "-r", f"{box.id}:/work/in", str(tmp_path))               # tmp_path/in is its namesake
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert stat.S_IMODE(os.stat(dst).st_mode) == 0o700 and os.stat(dst).st_mtime == 2_000_000
    assert [n for n in os.listdir(dst) if n.startswith(".dsec-")] == []


def test_cli_cp_recursive_merge_that_fails_says_what_of_the_destination_it_changed(daemon, sandbox, tmp_path):
    """A merge stopped by a move that fails (/tmp is a file system of its
    own: a rename from the landing directory into it is EXDEV) names the
    destination, not the landing directory, and says which names had
    already moved in."""
    src = tmp_path / "src"
    (src / "tmp").mkdir(parents=True)
    (src / "tmp" / "x").write_bytes(b"x\n")
    (src / "aaa").write_bytes(b"a\n")
    r = daemon.cli("cp", "-r", f"{src}/.", f"{sandbox.id}:/")
    err = r.stderr.decode()
    assert r.returncode == 1 and ".dsec-cp-" not in err, err
    assert "/tmp/x" in err and "Invalid cross-device link" in err and "1 of 2" in err and "/aaa" in err, err
    assert sandbox.read_file("/aaa") == b"a\n" and leftovers(sandbox, "/") == []


def test_cli_cp_recursive_out_of_a_sandbox_merge_that_fails_says_what_it_changed(daemon, sandbox, tmp_path):
    """The same for a local destination: a name whose move is refused (an
    immutable directory) is named with what had moved in before it."""
    import subprocess

    sandbox.exec(["sh", "-c", "mkdir -p /work/m/sub && echo a > /work/m/aaa && echo f > /work/m/sub/f"])
    dst = tmp_path / "dst"
    (dst / "sub").mkdir(parents=True)
    if subprocess.run(["chattr", "+i", str(dst / "sub")], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        r = daemon.cli("cp", "-r", f"{sandbox.id}:/work/m/.", str(dst))
    finally:
        subprocess.run(["chattr", "-i", str(dst / "sub")], check=True)
    err = r.stderr.decode()
    assert r.returncode == 1 and ".dsec-cp-" not in err, err
    assert f"{dst}/sub/f" in err and "1 of 2" in err and f"{dst}/aaa" in err, err
    assert sorted(os.listdir(dst)) == ["aaa", "sub"] and os.listdir(dst / "sub") == []


def test_cli_cp_to_stdout_names_that_are_not_utf8_read_by_gnu_tar_without_warnings(daemon, box, tmp_path):
    """A name (or a link's target) that is not UTF-8 goes into the tar as
    its bytes in a PAX path record: GNU tar knows no hdrcharset record
    (Python's writer marks such a header with one) and warned of it once a
    file. GNU tar, dsec cp - and tarfile read the bytes back as they were."""
    import shutil
    import subprocess

    from conftest import VENV_BIN

    if shutil.which("tar") is None:
        pytest.skip("no tar")
    long = b"\xe9" * 150
    octal = "".join(f"\\{b:o}" for b in long)
    box.exec(["sh", "-c", "cd /work/in && echo a > \"$(printf '\\377-f')\" && mkdir \"$(printf '\\351-d')\" && "
                          "echo b > \"$(printf '\\351-d')/$(printf '\\376')\" && "
                          "ln -s \"$(printf '\\377-f')\" link && ln \"$(printf '\\377-f')\" hard && "
                          f"echo c > \"$(printf '{octal}')\""])
    out = tmp_path / "out"
    out.mkdir()
    dsec = f"'{VENV_BIN / 'dsec'}' --socket '{daemon.socket}'"
    r = subprocess.run(f"{dsec} cp {box.id}:/work/in - | tar -x -C '{out}'", shell=True, executable="/bin/bash",
                       capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    top = os.fsencode(out / "in")
    assert sorted(os.listdir(top)) == sorted([b"\xff-f", b"\xe9-d", b"link", b"hard", long, b"empty", b"keep"])
    assert os.readlink(os.path.join(top, b"link")) == b"\xff-f"
    assert os.listdir(os.path.join(top, b"\xe9-d")) == [b"\xfe"]
    assert os.stat(os.path.join(top, b"hard")).st_ino == os.stat(os.path.join(top, b"\xff-f")).st_ino
    box.exec(["mkdir", "/work/back"])
    r = subprocess.run(f"{dsec} cp {box.id}:/work/in - | {dsec} cp - {box.id}:/work/back", shell=True,
                       executable="/bin/bash", capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    got = box.exec(["sh", "-c", "cd /work/back/in && for f in *; do printf '%s\\0' \"$f\"; done && readlink link"])
    got = got.stdout.split(b"\0")
    assert sorted(got[:-1]) == sorted([b"\xff-f", b"\xe9-d", b"link", b"hard", long, b"empty", b"keep"])
    assert got[-1] == b"\xff-f\n"
    with tarfile.open(fileobj=io.BytesIO(daemon.cli("cp", f"{box.id}:/work/in", "-").stdout),
                      encoding="utf-8", errors="surrogateescape") as tf:
        names = {os.fsencode(m.name) for m in tf}
    assert {b"in/\xff-f", b"in/\xe9-d/\xfe", b"in/" + long} <= names
