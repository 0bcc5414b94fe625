"""The same requests, the same answers, on every backend.

Each test runs once per backend (container, microvm) against one sandbox of
that backend, made once per module: a microVM under TCG takes seconds to
boot and a whole core while it does, so there is one at a time and the
tests share it. The last test of each backend destroys its sandbox and
checks nothing is left: no process, no cgroup, no directory.

microvm runs where `dsec info` says the backend is available (QEMU and the
guest kernel set up by scripts/setup.sh), and skips with the reason
otherwise.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import shutil
import subprocess
import tarfile
import threading
import time

import pytest
from conftest import skip_unless_microvm

from dsecd import native
from dsecd.errors import DsecError, NotFound

# Its VMs start from the run's templates (conftest.VM_TEMPLATES): none of its tests is about how one is built.
pytestmark = pytest.mark.shared_vm_templates

BACKENDS = ("container", "microvm")


@pytest.fixture(scope="module", params=BACKENDS)
def box(request, daemon):
    """(client, sandbox, backend) of one backend, shared by this module's tests of it."""
    c = daemon.client()
    backend = request.param
    if backend == "microvm":
        skip_unless_microvm(c)
    sb = c.create("busybox", backend=backend, memory="256M", net="none", disk="64M")
    state = {"sb": sb, "destroyed": False}
    try:
        yield c, sb, backend, state
    finally:
        if not state["destroyed"]:
            try:
                sb.destroy(force=True)
            except DsecError:
                pass
        c.close()


def test_exec_status_and_streams(box):
    _, sb, _, _ = box
    r = sb.exec(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (r.exit_code, r.signal, r.stdout, r.stderr) == (7, None, b"out\n", b"err\n")
    assert not r.timed_out and not r.truncated


def test_exec_env_cwd_user(box):
    _, sb, _, _ = box
    r = sb.exec(["sh", "-c", 'echo "$FOO $(pwd) $(id -u)"'], env={"FOO": "bar"}, cwd="/tmp", user=1000)
    assert r.stdout == b"bar /tmp 1000\n"


def test_arguments_and_environment_that_are_not_utf8_reach_the_command(box):
    """Bytes, as execve takes them: the SDK sends os.fsdecode's str (a
    latin-1 file name from sys.argv or os.listdir) as those bytes."""
    _, sb, _, _ = box
    name = os.fsdecode(b"caf\xe9")
    r = sb.exec(["sh", "-c", 'printf %s "$1$V"', "x", name], env={"V": name})
    assert (r.exit_code, r.stdout) == (0, b"caf\xe9caf\xe9"), r
    proc = sb.spawn([b"sh", "-c", 'printf %s "$1$V"', "x", b"\xff"], env={b"V": b"\xfe"})
    assert proc.wait().exit_code == 0
    assert b"".join(c.data for c in proc.output() if c.fd == 1) == b"\xff\xfe"


def test_exec_and_process_users_by_name(box):
    """As `docker exec --user`: a name or name:group from the sandbox's own
    /etc/passwd and /etc/group as they are now."""
    _, sb, _, _ = box
    assert sb.exec(["sh", "-c", "id -u; id -g"], user="nobody").stdout == b"65534\n65534\n"
    assert sb.exec(["id", "-u"], user="root").stdout == b"0\n"
    assert sb.exec(["sh", "-c", "id -u; id -g"], user="1234:50").stdout == b"1234\n50\n"
    sb.exec(["sh", "-c", "echo 'agent:x:2000:2001::/home/agent:/bin/sh' >> /etc/passwd; "
                         "echo 'team:x:3000:' >> /etc/group"])
    assert sb.exec(["sh", "-c", "id -u; id -g; echo $HOME"], user="agent").stdout == b"2000\n2001\n/home/agent\n"
    assert sb.exec(["sh", "-c", "echo $HOME"], user="agent", env={"HOME": "/tmp"}).stdout == b"/tmp\n"
    assert sb.exec(["sh", "-c", "id -u; id -g"], user="agent:team").stdout == b"2000\n3000\n"
    proc = sb.spawn(["sh", "-c", "id -u"], user="agent")
    assert proc.wait().exit_code == 0
    assert b"".join(o.data for o in proc.output(follow=False)) == b"2000\n"
    with pytest.raises(DsecError) as err:
        sb.exec(["true"], user="")
    assert err.value.code == "bad_request" and "must not be empty" in err.value.message
    for bad in ("ghost", "agent:ghosts"):
        with pytest.raises(DsecError) as err:
            sb.exec(["true"], user=bad)
        assert err.value.code == "bad_request" and repr(bad.split(":")[-1]) in err.value.message, err.value
    sb.exec(["sh", "-c", "sed -i '/^agent:/d' /etc/passwd; sed -i '/^team:/d' /etc/group"])


def _groups(out: bytes) -> list[str]:
    """The supplementary gids in a /proc/self/status text."""
    line = next(x for x in out.decode().splitlines() if x.startswith("Groups:"))
    return line.split()[1:]


def test_a_named_user_has_its_supplementary_groups(box):
    """As docker (runc's GetExecUser): a user named without a group gets the
    groups /etc/group lists it in, and its own gid; with a group named, or a
    uid alone, none. Execs, background processes and terminals alike, by
    either way a container starts them."""
    _, sb, _, _ = box
    sb.exec(["sh", "-c", "echo 'agent:x:2000:2001::/home/agent:/bin/sh' >> /etc/passwd; "
                         "echo 'team:x:3000:nobody,agent' >> /etc/group; echo 'dev:x:3001:agent' >> /etc/group; "
                         "mkdir -p /srv/team && chown 0:3000 /srv/team && chmod 0770 /srv/team"])
    try:
        status = ["cat", "/proc/self/status"]
        assert _groups(sb.exec(status, user="agent").stdout) == ["2001", "3000", "3001"]
        assert _groups(sb.exec(status, user="2000").stdout) == ["2001", "3000", "3001"]
        assert _groups(sb.exec(status, user="agent:team").stdout) == []
        assert _groups(sb.exec(status, user=2000).stdout) == []          # an int: exactly these ids
        assert _groups(sb.exec(status).stdout) == []                       # root, as made
        # The group's directory is the member's, and no one else's.
        assert sb.exec(["touch", "/srv/team/f"], user="agent").exit_code == 0
        denied = sb.exec(["touch", "/srv/team/g"], user="2000:2001")
        assert denied.exit_code != 0 and b"Permission denied" in denied.stderr, denied
        streamed = sb.exec(status, user="agent", stdin=b"")
        assert _groups(streamed.stdout) == ["2001", "3000", "3001"]
        terminal = sb.exec(status, user="agent", pty=True)
        assert _groups(terminal.stdout) == ["2001", "3000", "3001"]
        traced = sb.exec(status, user="agent", trace=True)          # a container's: by the daemon's helper
        assert _groups(traced.stdout) == ["2001", "3000", "3001"], traced
        proc = sb.spawn(status, user="agent")
        assert proc.wait().exit_code == 0
        assert _groups(b"".join(o.data for o in proc.output(follow=False))) == ["2001", "3000", "3001"]
        assert _groups(sb.exec(status, user="nobody").stdout) == ["3000", "65534"]
    finally:
        sb.exec(["sh", "-c", "sed -i '/^agent:/d' /etc/passwd; sed -i '/^team:/d; /^dev:/d' /etc/group; "
                             "rm -rf /srv/team"])


def test_what_a_create_and_its_image_say_its_processes_get(box, tmp_path):
    """env, cwd and user, from the create and from the image's config (its
    WorkingDir made where the image lacks it, as docker does), apply to
    every exec on every backend; a cwd or user the image lacks is refused."""
    c, _, backend, _ = box
    shape = {"backend": backend, "memory": "256M", "net": "none", "disk": "64M"}
    check = ["sh", "-c", 'echo "$K $PWD $(id -u) $HOME"']
    sb = c.create("busybox", env={"K": "V"}, cwd="/tmp", user="nobody", **shape)
    try:
        assert sb.exec(check).stdout == b"V /tmp 65534 /nonexistent\n"
        assert (sb.info["cwd"], sb.info["user"], sb.info["env"]["K"]) == ("/tmp", 65534, "V")
    finally:
        sb.destroy()
    (tmp_path / "empty").mkdir(exist_ok=True)
    c.build_image(str(tmp_path / "empty"), f"cfg-{backend}", parent="busybox", env={"K": "image"},
                  cwd="/srv/app", user="nobody")
    sb = c.create(f"cfg-{backend}", **shape)
    try:
        assert sb.exec(check).stdout == b"image /srv/app 65534 /nonexistent\n"
    finally:
        sb.destroy()
    for bad, word in (({"cwd": "/nonexist"}, "/nonexist"), ({"user": "ghost"}, "ghost")):
        with pytest.raises(DsecError) as err:
            c.create("busybox", **bad, **shape)
        assert err.value.code == "bad_request" and word in err.value.message, err.value
    assert [s["id"] for s in c.list() if s["image"] == "busybox"] == [box[1].id]     # nothing left behind


def test_a_non_root_exec_is_kept_out_of_roots_files(box):
    """As docker's `--user`: a uid other than 0 gets none of root's
    capabilities, so file modes and other users' processes keep it out."""
    _, sb, _, _ = box
    r = sb.exec(["sh", "-c", "echo x >> /etc/passwd && echo wrote; kill -0 1 && echo signalled; "
                             "grep CapEff /proc/self/status"], user="nobody")
    assert b"wrote" not in r.stdout and b"signalled" not in r.stdout, r
    assert int(r.stdout.split()[-1], 16) & ~(1 << 10) == 0, r        # NET_BIND_SERVICE at most


def test_exec_stdin_and_streamed_output(box):
    _, sb, _, _ = box
    seen = []
    r = sb.exec(["sh", "-c", "cat; echo done >&2"], stdin=b"line 1\nline 2\n", on_stdout=seen.append)
    assert r.exit_code == 0
    assert b"".join(seen) == b"line 1\nline 2\n" == r.stdout
    assert r.stderr == b"done\n"


def test_exec_input_is_streamed_while_it_runs(box):
    """Each line is sent only after the answer to the previous one came back:
    input reaches the process while it runs, not buffered to its end."""
    _, sb, _, _ = box
    seen: list[bytes] = []

    async def lines():
        for i in range(3):
            yield f"line {i}\n".encode()
            for _ in range(3000):
                if f"got line {i}\n".encode() in b"".join(seen):
                    break
                await asyncio.sleep(0.01)

    stream = sb.exec_stream(["sh", "-c", 'while read l; do echo "got $l"; done; echo eof'], stdin=lines())
    for fd, data in stream:
        assert fd == 1
        seen.append(data)
    assert stream.result.exit_code == 0
    assert b"".join(seen) == b"got line 0\ngot line 1\ngot line 2\neof\n"


def test_exec_signal_reaches_the_running_command(box):
    """exec_signal: the signal reaches the exec's process group, whose own
    handler decides the end; once it has ended there is nothing to signal."""
    _, sb, _, _ = box
    stream = sb.exec_stream(["sh", "-c", 'trap "echo got INT; exit 3" INT; echo ready; '
                                         'while :; do sleep 0.1; done'])
    out = b""
    for _fd, data in stream:
        out += data
        if out == b"ready\n":
            stream.signal("INT")
    assert (stream.result.exit_code, out) == (3, b"ready\ngot INT\n")
    with pytest.raises(DsecError) as err:
        stream.signal("TERM")
    assert err.value.code == "not_found"


def test_exec_errors(box):
    _, sb, _, _ = box
    with pytest.raises(DsecError) as err:
        sb.exec(["no-such-command"])
    assert err.value.code == "not_found"
    with pytest.raises(DsecError) as err:
        sb.exec(["true"], cwd="/no/such/dir")
    assert err.value.code == "not_found"
    # An executable file that is neither a binary nor a #! script does not
    # run (execve's ENOEXEC), in PATH or named: no shell runs it instead. It
    # cannot be executed, as EACCES: `permission` naming it (dsec exec: 126).
    sb.write_file("/usr/local/bin/no-shebang", b"echo ran\n", mode=0o755)
    for argv in (["no-shebang"], ["/usr/local/bin/no-shebang"]):
        with pytest.raises(DsecError) as err:
            sb.exec(argv)
        assert err.value.code == "permission" and "Exec format error" in err.value.message, (argv, err.value)
        assert err.value.detail["argv0"] == argv[0], err.value.detail


def test_a_command_is_found_in_its_own_path(box):
    """The PATH searched is the exec's env's (an image's ENV PATH, a
    caller's env), not the one of whatever starts the command."""
    _, sb, _, _ = box
    sb.write_file("/opt/tools/mytool", b"#!/bin/sh\necho tool\n", mode=0o755)
    assert sb.exec(["mytool"], env={"PATH": "/opt/tools:/bin"}).stdout == b"tool\n"
    with pytest.raises(DsecError) as err:
        sb.exec(["mytool"])
    assert err.value.code == "not_found"
    # As execvpe: one found that cannot run (its #! interpreter missing) is
    # passed over for a later one of the name, and is the answer if none runs.
    sb.write_file("/opt/first/mytool", b"#!/no/such/interpreter\n", mode=0o755)
    assert sb.exec(["mytool"], env={"PATH": "/opt/first:/opt/tools"}).stdout == b"tool\n"
    with pytest.raises(DsecError) as err:
        sb.exec(["mytool"], env={"PATH": "/opt/first"})
    assert err.value.code == "not_found", err.value


def test_exec_timeout_kills_the_group(box):
    _, sb, _, _ = box
    t0 = time.monotonic()
    r = sb.exec(["sh", "-c", "sleep 30 & sleep 30"], timeout=1)
    assert r.timed_out and r.signal == 9
    assert time.monotonic() - t0 < 15


def test_files(box):
    _, sb, _, _ = box
    sb.mkdir("/work/conf/a/b", parents=True)
    sb.write_file("/work/conf/a/b/f.txt", b"hello")
    assert sb.read_file("/work/conf/a/b/f.txt") == b"hello"
    assert sb.write_at("/work/conf/a/b/f.txt", 5, b" world") == 11
    assert sb.read_file("/work/conf/a/b/f.txt") == b"hello world"
    sb.write_file("/work/conf/big", os.urandom(6 << 20) + b"end", atomic=False)    # past one chunk
    assert sb.read_file("/work/conf/big")[-3:] == b"end"
    data = os.urandom(9 << 20)
    assert sb.write_file("/work/conf/big", io.BytesIO(data)) == len(data)             # streamed both ways
    out = io.BytesIO()
    assert sb.read_file_to("/work/conf/big", out) == len(data) and out.getvalue() == data
    sb.remove("/work/conf/big")
    st = sb.stat("/work/conf/a/b/f.txt")
    assert (st["type"], st["size"]) == ("file", 11)
    names = {e["name"]: e["type"] for e in sb.list_files("/work/conf", depth=3)}
    assert names == {"a": "dir", "a/b": "dir", "a/b/f.txt": "file"}
    sb.rename("/work/conf/a/b/f.txt", "/work/conf/g.txt")
    assert sb.exec(["cat", "/work/conf/g.txt"]).stdout == b"hello world"
    assert sb.remove("/work/conf", recursive=True)["removed"] == 4


def test_a_written_file_keeps_the_setuid_and_setgid_bits_asked_for(box):
    """A container's file data is written by the sandbox's copier, and the
    kernel clears setuid and setgid at a write by a process without
    CAP_FSETID over the file: write_file(mode=0o4755) with data made an
    0o755 file, where a microVM's kept the bits. The write is the sandbox
    root's, which keeps them; so does a later chunk's, and a write_at."""
    _, sb, _, _ = box
    sb.write_file("/work/suid", b"x" * 100, mode=0o4755, atomic=False)
    sb.write_file("/work/sgid", os.urandom(6 << 20), mode=0o2755)       # atomic, past one chunk
    sb.write_at("/work/suid", 0, b"y")
    try:
        assert sb.stat("/work/suid")["mode"] & 0o7777 == 0o4755
        assert sb.stat("/work/sgid")["mode"] & 0o7777 == 0o2755
        assert sb.exec(["sh", "-c", "[ -u /work/suid ] && [ -g /work/sgid ]"]).exit_code == 0
    finally:
        sb.remove("/work/suid")
        sb.remove("/work/sgid")


def test_mtimes_before_1970_and_below_a_second_read_back_as_set(box):
    """stat and list_files give the file's mtime as os.stat's st_mtime gives
    it: one before 1970 is negative (a VM's read as 2^64 ns less, some year
    2554), and nanoseconds come as the same float on both backends."""
    _, sb, _, _ = box
    sb.mkdir("/work/times")
    try:
        assert sb.exec(["sh", "-c", "cd /work/times && touch -d @-100 before && touch -d @-315619200 long_before "
                                    "&& touch now"]).exit_code == 0
        sb.set_attrs("/work/times/now", mtime=1600000000.123456789)
        sec, nsec = divmod(int(1600000000.123456789 * 1e9), 10**9)      # as file_set_attrs sets it
        want = {"before": -100.0, "long_before": -315619200.0, "now": sec + nsec * 1e-9}
        assert {e["name"]: e["mtime"] for e in sb.list_files("/work/times")} == want
        assert {name: sb.stat(f"/work/times/{name}")["mtime"] for name in want} == want
    finally:
        sb.remove("/work/times", recursive=True)


def _mtime_of(seconds: float) -> float:
    """st_mtime of a file whose mtime was set from `seconds` (os.utime's ns)."""
    sec, nsec = divmod(int(seconds * 1e9), 10**9)
    return sec + nsec * 1e-9


def test_mtimes_before_1970_and_below_a_second_go_through_copies_both_ways(box, daemon):
    """A pax tar's mtimes, before 1970 and fractional, are what the copy in
    sets (a microVM's agent took whole seconds, one before 1970 as 0, and a
    container kept its own mtime for a directory entry's before 1970); a
    copy out gives them back, fractions and those before 1970 in pax
    records (a microVM's tar said 0 before 1970, and both whole seconds);
    file_set_attrs sets one too."""
    _, sb, _, _ = box
    spool = io.BytesIO()
    with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, mtime in (("d", tarfile.DIRTYPE, -1000), ("d/old", tarfile.REGTYPE, -100.25),
                                  ("d/new", tarfile.REGTYPE, 1600000000.5), ("d/ln", tarfile.SYMTYPE, -50)):
            m = tarfile.TarInfo(name)
            m.type, m.mtime, m.mode = kind, mtime, 0o755 if kind == tarfile.DIRTYPE else 0o644
            if kind == tarfile.SYMTYPE:
                m.linkname = "old"
            m.size = 1 if kind == tarfile.REGTYPE else 0
            tf.addfile(m, io.BytesIO(b"x") if kind == tarfile.REGTYPE else None)
    sb.upload_tar(spool.getvalue(), "/work/copied")
    try:
        got = {e["name"]: e["mtime"] for e in sb.list_files("/work/copied", depth=2)}
        assert got == {"d": -1000.0, "d/old": _mtime_of(-100.25), "d/new": _mtime_of(1600000000.5),
                       "d/ln": -50.0}, got
        r = daemon.cli("cp", f"{sb.id}:/work/copied/.", "-")
        assert r.returncode == 0, r.stderr
        out = {m.name.removeprefix("./"): m.mtime for m in tarfile.open(fileobj=io.BytesIO(r.stdout))}
        assert {k: out[k] for k in got} == {"d": -1000, "d/old": -100.25, "d/new": 1600000000.5, "d/ln": -50}, out
        sb.set_attrs("/work/copied/d/new", mtime=-12.5)
        assert sb.stat("/work/copied/d/new")["mtime"] == -12.5
    finally:
        sb.remove("/work/copied", recursive=True)


SUBSECOND = 981173106.123456789         # 2001-02-03 04:05:06.123456789 UTC
NS = 10**9


def _mtimes_ns(top) -> dict:
    return {rel: os.lstat(os.path.join(top, rel)).st_mtime_ns for rel in ("", "d", "d/f", "d/link", "whole")}


def _pax_headers(data: bytes) -> int:
    """How many pax extended headers the tar holds: the blocks that are
    neither a member's own header nor its data come two to a header."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tf:
        own = sum(1 + (m.size + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE for m in tf)
        return (tf.offset // tarfile.BLOCKSIZE - own) // 2


def test_a_copy_out_keeps_mtimes_to_the_nanosecond(box, daemon, tmp_path):
    """A copy out gives a file's, a directory's and a symlink's mtime to the
    nanosecond (both backends' tar said whole seconds): the SDK's
    download_dir, `dsec cp -r SB:/dir DIR` (a new directory, or merged
    into one that exists) and the tar of `dsec cp SB:/dir -`, which GNU tar
    lists with its fraction. An entry of whole seconds costs no pax header."""
    _, sb, _, _ = box
    top = "/work/subsec"
    sb.mkdir(f"{top}/d", parents=True)
    try:
        sb.write_file(f"{top}/d/f", b"data")
        sb.set_attrs(f"{top}/d/f", mtime=SUBSECOND)
        # busybox touch takes no fraction, but -r copies one whole, -h onto a symlink.
        assert sb.exec(["sh", "-c", f"cd {top} && ln -s f d/link && touch -h -r d/f d/link && touch -r d/f d "
                                    "&& echo x > whole && touch -d '2001-02-03 04:05:06' whole "
                                    "&& touch -r d/f ."]).exit_code == 0
        want = int(SUBSECOND * 1e9)          # as file_set_attrs sets it
        shown = sb.exec(["stat", "-c", "%y", f"{top}/d/link"]).stdout.decode()
        assert f".{want % NS:09d} " in shown, (shown, want)         # what the sandbox holds
        expected = {"": want, "d": want, "d/f": want, "d/link": want, "whole": want // NS * NS}

        sb.download_dir(top, str(tmp_path / "sdk"))
        assert _mtimes_ns(tmp_path / "sdk") == expected
        r = daemon.cli("cp", "-r", f"{sb.id}:{top}", str(tmp_path / "cli"))
        assert r.returncode == 0, r.stderr
        assert _mtimes_ns(tmp_path / "cli") == expected
        os.makedirs(tmp_path / "merge" / "subsec" / "d")
        r = daemon.cli("cp", "-r", f"{sb.id}:{top}", str(tmp_path / "merge"))
        assert r.returncode == 0, r.stderr
        assert _mtimes_ns(tmp_path / "merge" / "subsec") == expected

        r = daemon.cli("cp", f"{sb.id}:{top}", "-")
        assert r.returncode == 0, r.stderr
        assert _pax_headers(r.stdout) == 4, "subsec, d, d/f and d/link have a fraction; whole has none"
        (tmp_path / "out.tar").write_bytes(r.stdout)
        listed = subprocess.run(["tar", "--full-time", "-tvf", str(tmp_path / "out.tar")], capture_output=True,
                                text=True, env={**os.environ, "TZ": "UTC"})
        assert listed.returncode == 0 and not listed.stderr, listed.stderr
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(want // NS)) + f".{want % NS:09d}"
        for name in ("subsec/", "subsec/d/", "subsec/d/f", "subsec/d/link -> f"):
            assert f" {when} {name}\n" in listed.stdout, listed.stdout
        assert re.search(r" 2001-02-03 04:05:06 +subsec/whole$", listed.stdout, re.M), listed.stdout
    finally:
        sb.remove(top, recursive=True)


def test_a_symlinks_stat_gives_its_target_and_follows_on_request(box, daemon, tmp_path):
    """lstat by default, with the link's text as `target` (bytes where it is
    not UTF-8); `follow` stats what it leads to inside the sandbox. So `dsec
    cp -r SB:/link` makes the same link on either backend, and a plain copy
    of a link to a file gives the target's permission bits (a microVM's
    agent read no links: its copy was a new file's 0644, and -r the
    target's bytes)."""
    _, sb, _, _ = box
    sb.mkdir("/work/links")
    try:
        assert sb.exec(["sh", "-c", "cd /work/links && echo hi > f && chmod 750 f && ln -s f ln "
                                    "&& ln -s \"$(printf 'caf\\351')\" odd && ln -s /nowhere dangling"]).exit_code == 0
        st = sb.stat("/work/links/ln")
        assert (st["type"], st["target"]) == ("symlink", "f"), st
        assert sb.stat("/work/links/odd")["target"] == os.fsdecode(b"caf\xe9")
        assert sb.stat("/work/links/dangling")["target"] == "/nowhere"
        followed = sb.stat("/work/links/ln", follow=True)
        assert (followed["type"], followed["mode"], followed["size"]) == ("file", 0o750, 3), followed
        assert "target" not in followed and "target" not in sb.stat("/work/links/f")
        with pytest.raises(NotFound):
            sb.stat("/work/links/dangling", follow=True)
        r = daemon.cli("cp", "-r", f"{sb.id}:/work/links/ln", str(tmp_path / "ln"))
        assert r.returncode == 0, r.stderr
        assert os.readlink(tmp_path / "ln") == "f"
        r = daemon.cli("cp", f"{sb.id}:/work/links/ln", str(tmp_path / "copy"))
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "copy").read_bytes() == b"hi\n" and (tmp_path / "copy").stat().st_mode & 0o777 == 0o750
    finally:
        sb.remove("/work/links", recursive=True)


def test_file_errors(box):
    _, sb, _, _ = box
    with pytest.raises(DsecError) as err:
        sb.read_file("/no/such/file")
    assert err.value.code == "not_found" and err.value.detail["errno"] == "ENOENT"
    assert err.value.message.endswith(": open `/no/such/file`: No such file or directory"), err.value
    # The same advice on every backend: what the path is, and the command that takes it.
    sb.mkdir("/work/tree/sub", parents=True)
    with pytest.raises(DsecError) as err:
        sb.read_file("/work/tree")
    assert "/work/tree is a directory, not a regular file (`dsec ls` lists it, `dsec cp -r` copies it)" \
        in err.value.message, err.value
    assert err.value.message.startswith(f"read {sb.id}:/work/tree: "), err.value
    with pytest.raises(DsecError) as err:
        sb.remove("/work/tree")
    assert "is a directory that is not empty; remove it recursively (`dsec rm -r`" in err.value.message, err.value
    sb.remove("/work/tree", recursive=True)
    with pytest.raises(DsecError) as err:
        sb.read_file("/../etc/passwd")
    assert err.value.code == "bad_request"
    assert err.value.message.startswith(f"read {sb.id}:/../etc/passwd: "), err.value     # which request, which sandbox
    sb.mkdir("/work/full")
    with pytest.raises(DsecError) as err:
        sb.mkdir("/work/full", parents=False)
    assert err.value.code == "conflict" and err.value.detail["errno"] == "EEXIST"
    sb.remove("/work/full")
    # An atomic write's failure names the file given, not its temporary file.
    with pytest.raises(DsecError) as err:
        sb.write_file("/no/such/f", b"x", parents=False)
    assert err.value.code == "not_found" and err.value.detail["errno"] == "ENOENT"
    assert "/no/such/f" in err.value.message and ".dsec-" not in f"{err.value} {err.value.detail}"
    # The root, in the same words everywhere (a microVM's said less, or left it to its agent).
    for call, message, path in [
            (lambda: sb.write_file("/", b"x", atomic=False), f"write {sb.id}:/: cannot write to /", "/"),
            (lambda: sb.remove("/", recursive=True),
             f"remove {sb.id}:/: refusing to remove / (remove what is under it instead)", "/"),
            (lambda: sb.rename("/work", "/", overwrite=True),
             f"rename {sb.id}:/work -> /: cannot rename / or onto /", "/work -> /")]:
        with pytest.raises(DsecError) as err:
            call()
        assert (err.value.code, err.value.message, err.value.detail) == ("bad_request", message, {"path": path})


def test_an_atomic_write_does_not_replace_a_device_or_fifo(box):
    """It would swap /dev/null for a regular file."""
    _, sb, _, _ = box
    with pytest.raises(DsecError) as err:
        sb.write_file("/dev/null", b"x")
    assert err.value.code == "bad_request" and "/dev/null is a char device" in err.value.message
    assert sb.stat("/dev/null")["type"] == "char"
    assert sb.exec(["sh", "-c", "echo gone > /dev/null; cat /dev/null"]).stdout == b""
    assert not [e for e in sb.list_files("/dev") if e["name"].startswith(".dsec-")]    # no temp file left
    sb.exec(["mkfifo", "/tmp/fifo"])
    with pytest.raises(DsecError) as err:
        sb.write_file("/tmp/fifo", b"x")
    assert "/tmp/fifo is a fifo" in err.value.message
    sb.remove("/tmp/fifo")


def test_symlinks_stay_inside(box):
    _, sb, _, _ = box
    sb.exec(["ln", "-sf", "/../../../etc/hostname", "/tmp/escape"])
    # Resolved in the sandbox's root: its own /etc/hostname (or none), never the host's.
    try:
        data = sb.read_file("/tmp/escape")
    except DsecError as err:
        assert err.code == "not_found"
    else:
        assert data != open("/etc/hostname", "rb").read() or not data


def test_pause_resume_keeps_state(box):
    c, sb, _, _ = box
    sb.write_file("/tmp/kept", b"before the pause")
    sb.exec(["sh", "-c", "echo 42 > /dev/shm/mem"])
    r = sb.pause()
    assert r["state"] == "paused"
    assert sb.resume()["state"] == "running"
    assert sb.read_file("/tmp/kept") == b"before the pause"
    assert sb.exec(["cat", "/dev/shm/mem"]).stdout == b"42\n"
    sb.pause()
    # An exec on a paused sandbox resumes it first (memory.auto_resume).
    assert sb.exec(["echo", "awake"]).stdout == b"awake\n"
    sb.pause()
    # Input sent right behind such an exec waits for its start: none is lost.
    assert sb.exec(["cat"], stdin=b"typed\n", timeout=60).stdout == b"typed\n"


def test_snapshot_packs_the_writable_layer(box):
    c, sb, backend, _ = box
    sb.exec(["sh", "-c", "mkdir -p /work/snap && echo kept > /work/snap/f && rm -f /bin/false"])
    name = f"conformance-snap-{backend}"
    with pytest.raises(DsecError) as err:      # refused before anything is frozen or packed
        sb.snapshot(name, exclude=["/tmp", "/work/../etc"])
    assert err.value.code == "bad_request"
    assert err.value.message == "snapshot: exclude paths must not hold '..' or NUL, got '/work/../etc'"
    image = sb.snapshot(name)
    assert len(image["layers"]) == 2
    other = c.create(name, memory="64M")           # whatever made it, a container runs it
    try:
        r = other.exec(["sh", "-c", "cat /work/snap/f; [ -e /bin/false ] || echo deleted"])
        assert r.stdout == b"kept\ndeleted\n"
    finally:
        other.destroy()
        c.request("image_rm", name=name)
    sb.exec(["rm", "-r", "/work/snap"])


def test_a_snapshot_keeps_the_user_xattrs_of_image_files_the_sandbox_changed(box, daemon, busybox_rootfs,
                                                                              tmp_path):
    """A file or directory of the image that the sandbox changes (chmod,
    touch, a write in place, a rename) is copied up with its user.* xattrs
    in a container; a microVM's upper (a tmpfs of a guest kernel before 6.6)
    holds none, so overlayfs dropped them there and its snapshot lost them.
    The agent gives the copied-up file the image's (nothing in the guest can
    set or remove one); a file made anew has none."""
    c, _, backend, _ = box
    root = tmp_path / "root"
    shutil.copytree(busybox_rootfs, root, symlinks=True)
    (root / "x").mkdir()
    for name, value in (("chmodded", b"a"), ("written", b"w" * 1000), ("renamed", b"r"), ("replaced", b"p"),
                        ("untouched", b"u")):
        (root / "x" / name).write_bytes(b"data\n")
        os.setxattr(root / "x" / name, "user.note", value)
    os.setxattr(root / "x", "user.dir", b"d")
    image, snap = f"conformance-ux-{backend}", f"conformance-ux-snap-{backend}"
    c.import_image(str(root), image)
    sb = c.create(image, backend=backend, memory="256M", net="none", disk="64M")
    try:
        r = sb.exec(["sh", "-c", "cd /x && chmod 600 chmodded && echo more >> written && mv renamed moved "
                                 "&& rm replaced && echo new > replaced && touch ."])
        assert r.exit_code == 0, r
        layer = sb.snapshot(snap)["layers"][-1]["digest"]
    finally:
        sb.destroy(force=True)
    try:
        got = _user_xattrs_in_layer(daemon, layer, tmp_path / "mnt", with_dir=True)
    finally:
        for name in (snap, image):
            c.request("image_rm", name=name)
    assert got == {"x": {"user.dir": b"d"}, "chmodded": {"user.note": b"a"},
                   "written": {"user.note": b"w" * 1000}, "moved": {"user.note": b"r"}, "replaced": {}}, got


def _user_xattrs_in_layer(daemon, layer: str, mnt, with_dir: bool = False) -> dict[str, dict[str, bytes]]:
    """The user.* xattrs of /x's entries (and of /x itself, with_dir) in the
    store's layer blob `layer` (a digest), mounted at `mnt` for the read;
    whiteouts left out."""
    mnt.mkdir()
    native.mount_erofs(str(daemon.state / "store" / "blobs" / "sha256" / layer.split(":", 1)[1]), str(mnt))
    try:
        top = (mnt / "x",) if with_dir else ()
        return {p.name: {k: os.getxattr(p, k) for k in os.listxattr(p) if k.startswith("user.")}
                for p in (*top, *sorted((mnt / "x").iterdir())) if not p.is_char_device()}
    finally:
        native.umount(str(mnt))


def test_a_snapshot_keeps_the_user_xattrs_of_files_renamed_from_any_layer(box, daemon, busybox_rootfs,
                                                                          tmp_path):
    """A file renamed in the sandbox keeps its user.* xattrs whichever layer
    of a several-layer image it came from. In a microVM the copied-up file
    names its image inode only by a file handle, and every layer's EROFS had
    the same (null) uuid: with two layers the handle did not say which, and
    the snapshot's layer had the renamed files without their xattrs."""
    c, _, backend, _ = box
    root, top = tmp_path / "root", tmp_path / "top"
    shutil.copytree(busybox_rootfs, root, symlinks=True)
    for tree, files in ((root, ("low", "low-kept", "up")), (top, ("up",))):
        (tree / "x").mkdir(parents=True)
        for name in files:
            (tree / "x" / name).write_bytes(b"data\n")
            os.setxattr(tree / "x" / name, "user.note", f"{name} in {tree.name}".encode())
    base, image, snap = (f"conformance-ux2-{what}-{backend}" for what in ("base", "image", "snap"))
    c.import_image(str(root), base)
    names = [base]
    try:
        c.build_image(str(top), image, parent=base)         # the second layer: its own "up" over the first's
        names.append(image)
        sb = c.create(image, backend=backend, memory="256M", net="none", disk="64M")
        try:
            assert len(sb.inspect()["layers"]) == 2
            r = sb.exec(["sh", "-c", "cd /x && mv low low-moved && mv up up-moved && chmod 600 low-kept"])
            assert r.exit_code == 0, r
            layer = sb.snapshot(snap)["layers"][-1]["digest"]
            names.append(snap)
        finally:
            sb.destroy(force=True)
        got = _user_xattrs_in_layer(daemon, layer, tmp_path / "mnt")
    finally:
        for name in reversed(names):
            c.request("image_rm", name=name)
    assert got == {"low-kept": {"user.note": b"low-kept in root"}, "low-moved": {"user.note": b"low in root"},
                   "up-moved": {"user.note": b"up in top"}}, got


def test_lease_renewed_then_expired(box):
    c, _, backend, _ = box
    sb = c.create("busybox", backend=backend, memory="256M", net="none", disk="64M", lease=3)
    try:
        for _ in range(5):                  # longer than the lease, renewed within it
            assert c.renew([sb.id, "nosuchsandbox"]) == {"renewed": [sb.id], "missing": ["nosuchsandbox"],
                                                         "no_lease": []}
            time.sleep(1)
        assert sb.id in {s["id"] for s in c.list()}
        pid = sb.inspect()["init_pid"]
        for _ in range(300):                # no more renewals: the reaper destroys it
            if sb.id not in {s["id"] for s in c.list()}:
                break
            time.sleep(0.1)
        assert sb.id not in {s["id"] for s in c.list()}
        assert _is_zombie_gone(pid)
    finally:
        if sb.id in {s["id"] for s in c.list()}:
            sb.destroy(force=True)


def test_output_past_the_cap_ends_the_command_as_a_closed_pipe(box):
    """Past limits.max_exec_output_bytes a container's command writes to a
    closed pipe and dies of SIGPIPE; a VM's was SIGKILLed (9), so scripts
    saw another status for the same thing."""
    _, sb, _, _ = box
    r = sb.exec(["yes"], timeout=120)
    assert r.truncated and not r.timed_out and r.signal == 13, (r.signal, r.exit_code)


def test_destroy_leaves_nothing(box, daemon):
    c, sb, backend, state = box
    info = sb.inspect()
    pid = info["init_pid"]
    cgroups = list(info["cgroups"].values())
    # An exec running when the sandbox is destroyed ends killed by the
    # destroy, on both backends (a VM's was a `conflict`, "sandbox is exiting").
    ended: list = []
    other = daemon.client()
    try:
        running = threading.Thread(target=lambda: ended.append(
            _run(other.get(sb.id), ["sh", "-c", "echo up > /tmp/exec-up; exec sleep 60"])))
        running.start()
        # Running, not only counted: an exec counts from its request on, and
        # one whose start a destroy cuts off is `conflict` ("sandbox is
        # exiting"), never having run.
        deadline = time.monotonic() + 30
        while not _exists(sb, "/tmp/exec-up") and time.monotonic() < deadline:
            time.sleep(0.05)
        sb.destroy(force=True)
        running.join(60)
    finally:
        other.close()
    r, = ended
    assert not isinstance(r, Exception), r
    assert (r.signal, r.killed_by, r.destroyed_by) == (9, "destroy", "request"), r
    state["destroyed"] = True
    assert not os.path.exists(f"/proc/{pid}") or _is_zombie_gone(pid)
    assert not any(os.path.exists(d) for d in cgroups)
    assert sb.id not in {s["id"] for s in c.list()}
    # Directories go behind the answer (LifecycleService: backend.release).
    for sub in ("sandboxes", "vms"):
        d = daemon.state / sub
        for _ in range(100):
            if not d.exists() or sb.id not in os.listdir(d):
                break
            time.sleep(0.05)
        assert not d.exists() or sb.id not in os.listdir(d)


def _exists(sb, path: str) -> bool:
    try:
        sb.read_file(path)
    except NotFound:
        return False
    return True


def _run(sb, argv):
    try:
        return sb.exec(argv, timeout=90)
    except Exception as err:
        return err


def _is_zombie_gone(pid: int) -> bool:
    for _ in range(100):
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False
