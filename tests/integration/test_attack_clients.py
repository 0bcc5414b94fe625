"""Adversarial suite, part 4: hostile clients of the daemon's socket.

Slow clients (a frame trickled a byte at a time, or never finished), clients
that never read their answers, who may connect at all (SO_PEERCRED: root and
the configured group; anyone else is refused even when the socket file's
mode would let them in). More in test_server.py (1,000 idle connections,
clients vanishing mid-stream, oversized frames, one client hammering),
marked `attack` there too.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from dsecd import protocol

pytestmark = pytest.mark.attack

TIMEOUTS = "[limits]\nframe_timeout_s = 1.0\nhello_timeout_s = 1.0\n"


def connect(d) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(d.socket)
    return s


def recv(s) -> dict | None:
    """One frame, or None if the daemon closed the connection. A close with
    bytes of ours still unread in the daemon's buffer arrives as a reset."""
    buf = b""
    while len(buf) < 4:
        try:
            chunk = s.recv(4 - len(buf))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        buf += chunk
    (n,) = struct.unpack(">I", buf)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return msgpack.unpackb(body, raw=False)


def hello(s) -> None:
    s.sendall(protocol.encode_frame({"id": 0, "op": "hello", "args": {"protocol": 1, "client": "attack"}}))
    assert "result" in recv(s)


def ping_frame(rid: int) -> bytes:
    return protocol.encode_frame({"id": rid, "op": "ping", "args": {}})


def trickle(s, data: bytes, delay: float, stop_after: int | None = None) -> None:
    for i, byte in enumerate(data):
        if stop_after is not None and i >= stop_after:
            return
        try:
            s.send(bytes([byte]))
        except OSError:            # dropped by the daemon meanwhile
            return
        time.sleep(delay)


@pytest.fixture(scope="module")
def strict(busybox_rootfs):
    """A daemon with 1 s frame and hello deadlines."""
    import tempfile

    from conftest import Daemon

    d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")), TIMEOUTS)
    try:
        d.start()
        yield d
    finally:
        d.cleanup()


def test_slow_frame_within_the_deadline_is_served(strict):
    s = connect(strict)
    hello(s)
    frame = ping_frame(1)                        # ~30 bytes at 10 ms each: well inside 1 s
    trickle(s, frame, 0.01)
    r = recv(s)
    assert r["id"] == 1 and "result" in r


def test_slowloris_frame_is_bounded_and_others_are_served(strict):
    """One byte per 100 ms: the frame cannot finish within frame_timeout_s.
    Others are answered meanwhile; the slow one gets `limit` and is dropped."""
    s = connect(strict)
    hello(s)
    t = threading.Thread(target=trickle, args=(s, ping_frame(7) + b"\0" * 64, 0.1))
    t0 = time.monotonic()
    t.start()
    other = strict.client()
    for _ in range(5):                           # answered while the slow frame is open
        assert other.request("ping")
        time.sleep(0.05)
    r = recv(s)
    assert r is not None and r["error"]["code"] == "limit", r
    assert "frame_timeout_s" in r["error"]["message"]
    assert recv(s) is None                       # and dropped
    assert time.monotonic() - t0 < 5
    t.join()
    other.close()


def test_frame_that_never_finishes_is_dropped(strict):
    s = connect(strict)
    hello(s)
    s.sendall(struct.pack(">I", 1000) + b"\x82")  # promises 1000 bytes, sends 1, then nothing
    r = recv(s)
    assert r["error"]["code"] == "limit"
    assert recv(s) is None
    # Half a header, then nothing: the same.
    s = connect(strict)
    hello(s)
    s.sendall(b"\0\0")
    assert recv(s)["error"]["code"] == "limit"


def test_connection_without_hello_is_dropped_but_idle_after_hello_is_kept(strict):
    silent = connect(strict)
    idle = connect(strict)
    hello(idle)
    time.sleep(1.5)
    r = recv(silent)
    assert r["error"]["code"] == "limit" and "hello" in r["error"]["message"]
    assert recv(silent) is None
    idle.sendall(ping_frame(3))                  # idle between frames is allowed
    assert recv(idle)["id"] == 3


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_client_that_never_reads_cannot_grow_the_daemons_buffers(strict):
    """Every bad frame gets an error frame that echoes its op (~32 KiB here).
    A client pipelining them without reading would make the daemon buffer
    every answer; instead it stops reading from that client."""
    s = connect(strict)
    hello(s)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    bad = protocol.encode_frame({"id": 1, "op": "x" * 32768, "args": {}})
    rss0 = _rss_kib(strict.proc.pid)
    s.settimeout(0.5)
    sent = 0
    try:
        for _ in range(4000):                    # 128 MiB of answers if all were buffered
            s.sendall(bad)
            sent += 1
    except (TimeoutError, OSError):
        pass                                     # the daemon stopped reading us: the point
    grown = _rss_kib(strict.proc.pid) - rss0
    assert sent < 4000, "the daemon kept reading a client that reads nothing"
    assert grown < 32 * 1024, f"daemon RSS grew {grown} KiB"
    other = strict.client()                      # neighbour: everybody else is served
    assert other.request("ping")
    other.close()
    s.close()


# ---------------------------------------------------------------- who may connect

PEER = r"""
import json, socket, struct, sys
sys.path.insert(0, sys.argv[2])
import msgpack
from dsecd import protocol
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except OSError as err:
    print(json.dumps({"connect": err.errno})); sys.exit()
try:   # a refused peer may find the connection closed already; the refusal is still readable
    s.sendall(protocol.encode_frame({"id": 0, "op": "hello", "args": {"protocol": 1, "client": "peer"}}))
except BrokenPipeError:
    pass
hdr = s.recv(4)
n = struct.unpack(">I", hdr)[0]
body = b""
while len(body) < n:
    body += s.recv(n - len(body))
print(json.dumps(msgpack.unpackb(body, raw=False), default=str))
"""


def _as_user(d, uid: int, gid: int, groups: list[int]) -> dict:
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", PEER, d.socket, root], user=uid, group=gid,
                         extra_groups=groups, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def group_daemon(daemon_factory):
    """A daemon whose socket_group is `nogroup` (gid 65534 on Debian), its
    socket reachable by others (a 0711 dir), the socket itself 0666 as if an
    operator had loosened it: only SO_PEERCRED stands between."""
    return _group_daemon(daemon_factory)


def _group_daemon(daemon_factory, extra_config: str = ""):
    import grp

    try:
        gid = grp.getgrnam("nogroup").gr_gid
    except KeyError:
        pytest.skip("no `nogroup` group on this host")
    d = daemon_factory(extra_config, start=False)
    d.config.write_text(d.config.read_text().replace("[daemon]\n", '[daemon]\nsocket_group = "nogroup"\n'))
    d.start()
    os.chmod(d.tmp, 0o711)
    st = os.stat(d.socket)
    assert (st.st_gid, st.st_mode & 0o777) == (gid, 0o660)    # as the daemon made it
    os.chmod(d.socket, 0o666)
    return d, gid


def test_root_and_the_group_may_connect_others_are_refused(group_daemon):
    d, gid = group_daemon
    nobody = 65534
    assert "result" in _as_user(d, 0, 0, [])                        # root
    assert "result" in _as_user(d, nobody, gid, [])                 # primary group
    assert "result" in _as_user(d, nobody, 1, [gid])                # supplementary (SO_PEERGROUPS)
    refused = _as_user(d, nobody, 1, [])                             # not in the group
    assert refused["id"] is None and refused["error"]["code"] == "permission", refused
    assert "nogroup" in refused["error"]["message"]
    assert "result" in _as_user(d, 0, 0, [])                        # the daemon goes on


def test_root_only_daemon_refuses_everybody_else(daemon_factory):
    d = daemon_factory()
    os.chmod(d.tmp, 0o711)
    os.chmod(d.socket, 0o666)
    refused = _as_user(d, 65534, 65534, [])
    assert refused["error"]["code"] == "permission", refused
    os.chmod(d.socket, 0o660)                   # as the daemon made it: the file mode refuses first
    assert _as_user(d, 65534, 65534, []) == {"connect": 13}          # EACCES
    assert "result" in _as_user(d, 0, 0, [])


BUILD_AS = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from dsecd import DsecError, SyncClient
c = SyncClient(sys.argv[1])
c.connect()
try:
    args = json.loads(sys.argv[3])
    print(json.dumps({"result": c.request(args.pop("op"), **args)}, default=str))
except DsecError as err:
    print(json.dumps({"code": err.code, "message": str(err)}))
finally:
    c.close()
"""


def _request_as(d, uid: int, gid: int, op: str, **args) -> dict:
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", BUILD_AS, d.socket, root, json.dumps({"op": op, **args})],
                         user=uid, group=gid, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def shared_dir():
    """A directory anyone may search (pytest's tmp dirs are root's alone)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="dsecd-test-paths-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_a_group_member_builds_only_from_files_it_may_read(group_daemon, shared_dir):
    """The daemon reads a named host path as root: for a member of
    socket_group it first checks that the member could read all of it."""
    d, gid = group_daemon
    nobody = 65534
    ctx = shared_dir / "ctx"
    (ctx / "etc").mkdir(parents=True)
    (ctx / "etc" / "motd").write_text("hello")
    for p in (ctx, ctx / "etc"):
        p.chmod(0o755)
    (ctx / "etc" / "motd").chmod(0o644)
    secret = shared_dir / "secret"
    secret.write_text("root's alone")
    secret.chmod(0o600)
    private = shared_dir / "private"
    private.mkdir(mode=0o700)
    (private / "ctx").mkdir(mode=0o755)

    ok = _request_as(d, nobody, gid, "image_build", source=str(ctx), name="member-ok")
    assert "result" in ok, ok

    (ctx / "etc" / "shadow").write_text("root's alone")     # a root-only file inside the tree
    (ctx / "etc" / "shadow").chmod(0o600)
    refused = _request_as(d, nobody, gid, "image_build", source=str(ctx), name="member-shadow")
    assert refused["code"] == "permission", refused
    assert f"may not read {ctx}/etc/shadow" in refused["message"]
    refused = _request_as(d, nobody, gid, "image_build", source=str(secret), name="member-secret")
    assert refused["code"] == "permission", refused
    refused = _request_as(d, nobody, gid, "image_build", source=str(private / "ctx"), name="member-private")
    assert refused["code"] == "permission" and "search a directory above it" in refused["message"], refused
    refused = _request_as(d, nobody, gid, "image_build_dockerfile", context=str(ctx), name="member-df",
                          dockerfile="FROM member-ok\nCOPY etc/motd /motd\n")
    assert refused["code"] == "permission" and "etc/shadow" in refused["message"], refused

    with d.client() as root:               # root builds what it names, as before
        assert root.request("image_build", source=str(ctx), name="root-ok")["name"] == "root-ok"
        names = {i["name"] for i in root.request("image_list")["images"]}
    assert "member-ok" in names and not names & {"member-shadow", "member-secret", "member-private", "member-df"}
    assert not any(d.state.joinpath("client-paths").iterdir()), "nothing left attached"


RACE_AS = r"""
import ctypes, json, os, sys, threading
sys.path.insert(0, sys.argv[2])
from dsecd import DsecError, SyncClient
sock, ctx, pairs, attempts = sys.argv[1], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
args = json.loads(sys.argv[6])
op = args.pop("op")
libc = ctypes.CDLL(None, use_errno=True)
names = [(os.path.join(ctx, f"d{i}").encode(), os.path.join(ctx, f"l{i}").encode()) for i in range(pairs)]
done = threading.Event()

def swap():
    # Each directory d<i> and symlink l<i> trade names, again and again
    # (renameat2 RENAME_EXCHANGE): whatever looks at d<i> finds a directory
    # of the member's one moment and a symlink to the secret the next.
    while not done.is_set():
        for a, b in names:
            libc.renameat2(-100, a, -100, b, 2)

swapper = threading.Thread(target=swap)
swapper.start()
c = SyncClient(sock)
c.connect()
out = {"ok": 0, "failed": []}
for i in range(attempts):
    try:
        c.request(op, name=f"race-{i}", **args)
        out["ok"] += 1
    except DsecError as err:
        out["failed"].append(f"{err.code}: {err}")
done.set()
swapper.join()
c.request(op, name="after", **args)       # the tree left still: it builds
print(json.dumps(out))
"""


class _Inotify:
    """Opens and reads (IN_OPEN, IN_ACCESS) of a directory and what is in it."""

    def __init__(self, path: Path):
        import ctypes

        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        assert self._libc.inotify_add_watch(self.fd, os.fsencode(path), 0x20 | 0x01) >= 0

    def events(self) -> list[str]:
        out = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i < len(buf):
                _, mask, _, n = struct.unpack_from("iIII", buf, i)
                out.append(f"{mask:#x} {buf[i + 16:i + 16 + n].rstrip(bytes(1)).decode() or '.'}")
                i += 16 + n

    def close(self) -> None:
        os.close(self.fd)


@pytest.mark.parametrize("op", ["image_build_dockerfile", "image_build"])
def test_a_member_racing_renames_in_its_tree_reads_nothing_it_may_not(group_daemon, shared_dir,
                                                                       busybox_rootfs, op):
    """The daemon checks a member's tree as the member before a build; the
    member owns the tree and may rename in it while the build reads it,
    swapping a directory for a symlink to a directory only root may read,
    with a file of the same name (/etc/shadow's, say). Whatever it swaps
    in, the daemon opens for it only what the member itself could open:
    the secret directory is never listed nor its file opened."""
    d, gid = group_daemon
    nobody, pairs = 65534, 24
    with d.client() as root:
        root.import_image(busybox_rootfs, "busybox")
    secret = shared_dir / "secret"
    secret.mkdir(mode=0o700)
    (secret / "f").write_text("root's alone\n")
    (secret / "f").chmod(0o600)
    ctx = shared_dir / "ctx"
    ctx.mkdir()
    for i in range(pairs):
        (ctx / f"d{i}").mkdir()
        (ctx / f"d{i}" / "f").write_text("member's f\n")      # the secret's name and size
        os.symlink(secret, ctx / f"l{i}")
    subprocess.run(["chown", "-hR", f"{nobody}:{gid}", str(ctx)], check=True)
    if op == "image_build":
        args, failure = {"op": op, "source": str(ctx)}, ("conflict", "changed while the build read it")
    else:
        args = {"op": op, "context": str(ctx), "dockerfile": "FROM busybox\nCOPY . /ctx/\n"}
        failure = ("bad_request", "Dockerfile:2: COPY")
    watch = _Inotify(secret)
    try:
        out = subprocess.run([sys.executable, "-c", RACE_AS, d.socket, str(Path(__file__).resolve().parents[2]),
                              str(ctx), str(pairs), "40", json.dumps(args)],
                             user=nobody, group=gid, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert watch.events() == [], result
    finally:
        watch.close()
    # A build fails only where a file it read changed under it.
    assert all(f.startswith(failure[0]) and failure[1] in f for f in result["failed"]), result["failed"]
    assert not any(d.state.joinpath("client-paths").iterdir()), "nothing left attached"


def test_a_members_directory_builds_the_layer_roots_build_makes(group_daemon, shared_dir):
    """A member's directory is copied reading it as the member and built
    from the copy: the layer is the one root's build of it makes (names,
    types, modes, owners, xattrs, hard links; mkfs.erofs keeps no times)."""
    d, gid = group_daemon
    nobody = 65534
    ctx = shared_dir / "tree"
    (ctx / "etc" / "private").mkdir(parents=True)
    (ctx / "etc" / "motd").write_text("hello\n")
    (ctx / "etc" / "private" / "key").write_text("the member's\n")
    os.link(ctx / "etc" / "motd", ctx / "etc" / "motd.link")
    os.symlink("motd", ctx / "etc" / "motd.sym")
    os.symlink("/nowhere", ctx / "dangling")
    os.mkfifo(ctx / "fifo")
    (ctx / "bin").mkdir()
    (ctx / "bin" / "tool").write_bytes(b"#!/bin/sh\n")
    os.setxattr(ctx / "bin" / "tool", "user.note", b"kept")
    (ctx / "empty").mkdir()
    subprocess.run(["chown", "-hR", f"{nobody}:{gid}", str(ctx)], check=True)
    os.chown(ctx / "etc" / "motd", 0, 0)          # root's, readable by all: the member reads it
    (ctx / "etc" / "private").chmod(0o700)
    (ctx / "etc" / "private" / "key").chmod(0o600)
    (ctx / "bin" / "tool").chmod(0o4755)
    (ctx / "empty").chmod(0o555)

    member = _request_as(d, nobody, gid, "image_build", source=str(ctx), name="tree-member")
    assert "result" in member, member
    with d.client() as root:
        built = root.request("image_build", source=str(ctx), name="tree-root")
    assert [la["digest"] for la in member["result"]["layers"]] == [la["digest"] for la in built["layers"]]
    assert d.state.joinpath("scratch").is_dir() and not any(d.state.joinpath("scratch").glob("unpack-*")), \
        "the copy is removed"


BIND_THEN = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'


@pytest.mark.parametrize("op", ["image_build", "image_build_dockerfile"])
def test_a_member_cannot_have_the_daemons_proc_files_read_for_it(group_daemon, shared_dir, busybox_rootfs, op):
    """The daemon reads a member's tree in a thread of its own process, so
    /proc/<the daemon's pid> files pass the kernel's ptrace check there as
    the daemon's own, whatever ids the thread has. A member in a user and
    mount namespace of its own binds the daemon's fdinfo into its tree and
    builds from it: refused, naming it; no image is made."""
    d, gid = group_daemon
    nobody = 65534
    probe = subprocess.run(["unshare", "-Urm", "true"], user=nobody, group=gid, capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no user namespace for nobody here: {probe.stderr.strip()}")
    with d.client() as root:
        root.import_image(busybox_rootfs, "busybox")
    ctx = shared_dir / "ctx"
    (ctx / "fdinfo").mkdir(parents=True)
    (ctx / "motd").write_text("hello\n")
    subprocess.run(["chown", "-R", f"{nobody}:{gid}", str(ctx)], check=True)
    if op == "image_build":
        args = {"op": op, "source": str(ctx), "name": "leak"}
    else:
        args = {"op": op, "context": str(ctx), "name": "leak", "dockerfile": "FROM busybox\nCOPY fdinfo/0 /leak\n"}
    out = subprocess.run(["unshare", "-Urm", "sh", "-c", BIND_THEN, "sh", f"/proc/{d.proc.pid}/fdinfo",
                          str(ctx / "fdinfo"), sys.executable, "-c", BUILD_AS, d.socket,
                          str(Path(__file__).resolve().parents[2]), json.dumps(args)],
                         user=nobody, group=gid, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    refused = json.loads(out.stdout)
    assert refused.get("code") == "permission", refused
    assert f"{ctx}/fdinfo is on proc, a kernel interface" in refused["message"], refused
    with d.client() as root:
        assert "leak" not in {i["name"] for i in root.request("image_list")["images"]}
    assert not any(d.state.joinpath("client-paths").iterdir()), "nothing left attached"


def test_a_members_directory_is_copied_only_up_to_the_layer_bound(daemon_factory, shared_dir):
    """A member's directory is copied before it is built, and a sparse
    file of any size costs the member nothing (`truncate -s 1T`) but its
    copy writes every byte: the copy stops at images.max_layer_bytes, as
    an imported tarball's unpacking does, and nothing of it is left."""
    d, gid = _group_daemon(daemon_factory, '[images]\nmax_layer_bytes = "1M"\n')
    nobody = 65534
    ctx = shared_dir / "tree"
    ctx.mkdir()
    (ctx / "small").write_bytes(b"x" * 4096)
    with open(ctx / "sparse", "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["chown", "-R", f"{nobody}:{gid}", str(ctx)], check=True)
    refused = _request_as(d, nobody, gid, "image_build", source=str(ctx), name="sparse")
    assert refused.get("code") == "limit", refused
    assert "images.max_layer_bytes (1048576 bytes" in refused["message"] and f"{ctx}/sparse" in refused["message"]
    assert not any(d.state.joinpath("scratch").glob("unpack-*")), "the copy is removed"
    (ctx / "sparse").unlink()
    assert "result" in _request_as(d, nobody, gid, "image_build", source=str(ctx), name="small")


def test_a_members_directory_is_copied_only_up_to_the_entry_bound(daemon_factory, shared_dir):
    """Empty files, or one directory bind-mounted many times, cost a member
    nothing, and each takes an inode of the scratch dir when its directory
    is copied before it is built: the copy stops at limits.max_tar_entries
    entries, naming the bound, and nothing of it is left."""
    d, gid = _group_daemon(daemon_factory, '[limits]\nmax_tar_entries = 10\n')
    nobody = 65534
    ctx = shared_dir / "many"
    ctx.mkdir()
    for i in range(11):
        (ctx / f"f{i:02}").touch()
    subprocess.run(["chown", "-R", f"{nobody}:{gid}", str(ctx)], check=True)
    refused = _request_as(d, nobody, gid, "image_build", source=str(ctx), name="many")
    assert refused.get("code") == "limit", refused
    assert "more than limits.max_tar_entries (10)" in refused["message"] and str(ctx) in refused["message"], refused
    assert not any(d.state.joinpath("scratch").glob("unpack-*")), "the copy is removed"
    (ctx / "f10").unlink()
    assert "result" in _request_as(d, nobody, gid, "image_build", source=str(ctx), name="ten")


def test_a_members_directory_copy_that_fills_the_scratch_dir_says_so(daemon_factory, shared_dir):
    """A member's directory is copied into the daemon's scratch dir before
    it is built; the scratch dir filling up is said as the copy's failure,
    naming the file and the scratch dir, not as the image store's."""
    d, gid = _group_daemon(daemon_factory)
    nobody = 65534
    ctx = shared_dir / "tree"
    ctx.mkdir()
    (ctx / "big").write_bytes(b"x" * (1 << 20))
    subprocess.run(["chown", "-R", f"{nobody}:{gid}", str(ctx)], check=True)
    scratch = d.state / "scratch"
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "dsecd-test-scratch", str(scratch)], check=True)
    try:
        refused = _request_as(d, nobody, gid, "image_build", source=str(ctx), name="full")
    finally:
        subprocess.run(["umount", str(scratch)], check=True)
    assert refused.get("code") == "io", refused
    assert f"copying it into the daemon's scratch dir ({scratch}) failed at {ctx}/big" in refused["message"], refused
    assert "No space left on device" in refused["message"] and "image store" not in refused["message"], refused
