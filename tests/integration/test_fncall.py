"""FnCall backend through the daemon: zygote calls, plain argv calls, fresh state,
timeouts, caps, rlimits, zygote replacement, concurrency, CLI."""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsecd import Client, native
from dsecd.errors import BadRequest, Busy, DsecError, NotFound, Unsupported

ROOT = Path(__file__).resolve().parents[2]


def import_py(c) -> str:
    """The host's python3 + stdlib imported as the image "py" through client
    `c` (scripts/mkpyrootfs.sh, cached)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "mkpyrootfs.sh")], check=True,
                         capture_output=True, text=True)
    c.import_image(out.stdout.strip().splitlines()[-1], "py")
    return "py"


@pytest.fixture(scope="module")
def py_image(daemon) -> str:
    c = daemon.client()
    try:
        return import_py(c)
    finally:
        c.close()


def test_code_call_runs_in_the_zygote(client, py_image):
    r = client.call(py_image, code="import sys, os\nprint(sum(range(10)), sys.argv[1:], os.getuid())",
                    args=["a", "b"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.startswith(b"45 ['a', 'b'] ")
    assert 60000 <= int(r.stdout.split()[-1]) < 60000 + 4096      # fncall.uid_base, uid_count
    assert r.path == "zygote" and r.run_ms > 0 and r.total_ms >= r.run_ms


def test_arguments_and_environment_that_are_not_utf8_reach_a_call_as_bytes(client, py_image):
    """Through the zygote (a code call's args, an argv it execs) and as a
    plain exec, a latin-1 argument or value is the same bytes in the call."""
    name = os.fsdecode(b"caf\xe9")
    r = client.call(py_image, code="import os, sys\nsys.stdout.buffer.write(os.fsencode(sys.argv[1]) + "
                                   "os.environb[b'V'])", args=[name], env={"V": name})
    assert (r.exit_code, r.path, r.stdout) == (0, "zygote", b"caf\xe9caf\xe9"), r
    for image, path in ((py_image, "zygote"), ("busybox", "exec")):
        r = client.call(image, argv=["sh", "-c", 'printf %s "$1$V"', "x", b"\xff"], env={b"V": name})
        assert (r.exit_code, r.path, r.stdout) == (0, path, b"\xffcaf\xe9"), r


def test_a_program_not_found_whose_name_is_not_utf8_is_127_and_not_found(client, py_image):
    """The not-found message quotes the program's name: one made of a file
    name's bytes failed the plain call as `internal` and put an encoding
    error on a zygote call's stderr."""
    for image, path in ((py_image, "zygote"), ("busybox", "exec")):
        r = client.call(image, argv=[b"/no-caf\xe9"])
        assert (r.exit_code, r.path) == (127, path), r
        assert r.stderr.startswith(b"fncall: /no-caf\xe9") and b"not found" in r.stderr, r.stderr


def test_the_zygote_serves_on_a_python_without_pidfd_open(client, py_image, tmp_path):
    """Python 3.8 has no os.pidfd_open (an image's python3 runs the zygote):
    it sees its workers end on SIGCHLD instead. Stood in for by the host's
    python3 with os.pidfd_open taken away before anything runs."""
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (tmp_path / "sitecustomize.py").write_text("import os\ndel os.pidfd_open\n")
    client.build_dockerfile(str(tmp_path), "py-nopidfd",
                            text=f"FROM {py_image}\nCOPY sitecustomize.py /usr/lib/{ver}/sitecustomize.py\n")
    probe = client.call("py-nopidfd", code="import os\nprint(hasattr(os, 'pidfd_open'))")
    assert (probe.exit_code, probe.stdout, probe.path) == (0, b"False\n", "zygote"), probe
    for i in range(12):                 # more than the spares: workers end, are reaped, forked again
        r = client.call("py-nopidfd", code=f"import subprocess\nprint({i}, subprocess.run(['true']).returncode)")
        assert (r.exit_code, r.stdout) == (0, f"{i} 0\n".encode()), r
    r = client.call("py-nopidfd", code="import sys\nsys.exit(7)")
    assert r.exit_code == 7, r
    r = client.call("py-nopidfd", code="import time\ntime.sleep(30)", timeout=0.5)
    assert r.timed_out, r
    r = client.call("py-nopidfd", code="print('after')")
    assert (r.exit_code, r.stdout, r.path) == (0, b"after\n", "zygote"), r


def test_the_zygote_serves_on_a_python_without_unshare_or_ctypes(daemon, client, py_image, tmp_path):
    """Neither os.unshare (Python 3.12+) nor ctypes: the zygote cannot give
    a call an IPC namespace of its own, says so, and serves calls in the
    call sandbox's, as before. Stood in for by the host's python3 with
    both taken away before anything runs."""
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (tmp_path / "sitecustomize.py").write_text("import os, sys\nsys.modules['ctypes'] = None\n"
                                               "if hasattr(os, 'unshare'):\n    del os.unshare\n")
    client.build_dockerfile(str(tmp_path), "py-noctypes",
                            text=f"FROM {py_image}\nCOPY sitecustomize.py /usr/lib/{ver}/sitecustomize.py\n")
    for i in range(12):                 # more than the spares
        r = client.call("py-noctypes", code=f"import os\nprint({i}, os.readlink('/proc/self/ns/ipc'))")
        assert r.exit_code == 0 and r.path == "zygote", r
        assert r.stdout.split()[0] == str(i).encode(), r
    mine = client.call("py-noctypes", code="import os\nprint(os.readlink('/proc/self/ns/ipc'))").stdout
    other = client.call("py-noctypes", code="import os\nprint(os.readlink('/proc/self/ns/ipc'))").stdout
    assert mine == other, (mine, other)         # the call sandbox's
    assert "zygote for py-noctypes cannot give calls an IPC namespace each" in daemon.log.read_text()


def test_python_c_argv_goes_through_the_zygote(client, py_image):
    r = client.call(py_image, argv=["python3", "-c", "import sys; print(sys.argv)", "x"])
    assert (r.exit_code, r.stdout, r.path) == (0, b"['-c', 'x']\n", "zygote")
    # Other argv are forked and exec'ed by the zygote.
    r = client.call(py_image, argv=["sh", "-c", "echo $0; exit 3", "hi"])
    assert (r.exit_code, r.stdout, r.path) == (3, b"hi\n", "zygote")


def test_only_the_zygotes_own_python_c_is_routed_as_code(daemon, client, py_image, tmp_path):
    """`python3 -c` (fncall.python, as the zygote was started) runs in the
    zygote; another interpreter's -c (python2, a venv's python, python3 on
    a PATH of the call's own) runs that interpreter, as in a sandbox."""
    (tmp_path / "other").write_text("#!/bin/sh\necho \"other got $*\"\n")
    (tmp_path / "other").chmod(0o755)
    client.build_dockerfile(str(tmp_path), "py-two", text=f"FROM {py_image}\nCOPY other /usr/local/bin/python2\n"
                                                          "COPY other /opt/venv/bin/python3\n")
    for argv, env in ((["python2", "-c", "print 1", "x"], None), (["/opt/venv/bin/python3", "-c", "print 1"], None),
                      (["python3", "-c", "print 1"], {"PATH": "/opt/venv/bin:/usr/bin:/bin"})):
        r = client.call("py-two", argv=argv, env=env)
        assert (r.exit_code, r.stdout) == (0, f"other got {' '.join(argv[1:])}\n".encode()), r
    r = client.call("py-two", argv=["python3", "-c", "print(3)"])
    assert (r.exit_code, r.stdout, r.path) == (0, b"3\n", "zygote"), r


def test_python_c_argv_runs_where_there_is_no_zygote(daemon_factory):
    """An argv call is one whatever its command: without a zygote
    (fncall.zygote = false) `python3 -c` runs as the image's python3."""
    def check(c, image, path):
        r = c.call(image, argv=["python3", "-c", "import sys; print(sys.argv)", "x"])
        assert (r.exit_code, r.stdout, r.path) == (0, b"['-c', 'x']\n", path), r

    with_plain_calls(daemon_factory, check)


@pytest.mark.parametrize("path", ["zygote", "exec"])
def test_an_argv_that_cannot_run_exits_as_a_shell_says(client, py_image, path):
    """As sh says it: 127 and `not found` for a command in no PATH dir, 126
    for a file that is not executable; named as given, not as the last
    PATH dir tried. The same through the zygote and as a plain call."""
    check_cannot_run(client, py_image if path == "zygote" else "busybox", path)


def check_cannot_run(client, image: str, path: str) -> None:
    path_dirs = client.call(image, argv=["sh", "-c", "echo $PATH"]).stdout.strip()
    r = client.call(image, argv=["no-such-cmd", "x"])
    assert (r.exit_code, r.path) == (127, path)
    assert r.stderr == b"fncall: no-such-cmd: not found (PATH " + path_dirs + b")\n", r.stderr
    r = client.call(image, argv=["/etc/passwd"])
    assert r.exit_code == 126 and r.stderr == b"fncall: /etc/passwd: Permission denied\n", r


def test_a_call_that_closed_its_stdout_ends_quietly(client, py_image):
    r = client.call(py_image, code="import os\nprint('x', flush=True)\nos.close(1)\nos.close(0)\n")
    assert (r.exit_code, r.stdout, r.stderr) == (0, b"x\n", b"")


def test_a_code_call_imports_from_its_dir_and_pythonpath(client, py_image):
    """As under `python3 -c`: its cwd (the private dir) heads sys.path, then
    the dirs of PYTHONPATH from the call's env (the zygote itself runs -I)."""
    r = client.call(py_image, code="open('helper.py', 'w').write('X = 41\\n')\nimport helper\nprint(helper.X + 1)")
    assert (r.exit_code, r.stdout) == (0, b"42\n"), r.stderr
    r = client.call(py_image, argv=["python3", "-c", "import sys; print(sys.path[:3])"],
                    env={"PYTHONPATH": "/opt/a:/opt/b"})
    assert r.stdout == b"['', '/opt/a', '/opt/b']\n", r


def test_a_code_call_runs_as_the_main_module(client, py_image):
    """Its globals are sys.modules['__main__'], as under `python3 -c`: what it
    defines pickles by reference (multiprocessing, concurrent.futures), and
    nothing of the zygote's own module shows."""
    r = client.call(py_image, code=(
        "import pickle, sys\n"
        "def f(x):\n    return x + 1\n"
        "class C:\n    pass\n"
        "print(pickle.loads(pickle.dumps(f))(1), type(pickle.loads(pickle.dumps(C()))).__name__,"
        " sys.modules['__main__'].f is f, hasattr(sys.modules['__main__'], 'Zygote'))\n"))
    assert (r.exit_code, r.stdout) == (0, b"2 C True False\n"), r.stderr


def test_calls_get_the_images_environment(daemon, client, py_image, tmp_path):
    """The image's ENV, under the call's own env, as an exec gets it: for
    zygote calls, their argv and plain calls alike."""
    r = daemon.cli("image", "build", str(tmp_path), "--from", py_image, "--name", "py-env",
                   "--env", "GREETING=hi", "--env", "SHARED=image")
    assert r.returncode == 0, r.stderr
    r = daemon.cli("image", "build", str(tmp_path), "--from", "busybox", "--name", "busybox-env",
                   "--env", "GREETING=hi", "--env", "SHARED=image")
    assert r.returncode == 0, r.stderr
    show = "import os; print(os.environ.get('GREETING'), os.environ.get('SHARED'))"
    assert client.call("py-env", code=show, env={"SHARED": "call"}).stdout == b"hi call\n"
    r = client.call("py-env", argv=["sh", "-c", "echo $GREETING $SHARED"])
    assert (r.stdout, r.path) == (b"hi image\n", "zygote")
    r = client.call("busybox-env", argv=["sh", "-c", "echo $GREETING $SHARED"], env={"SHARED": "call"})
    assert (r.stdout, r.path) == (b"hi call\n", "exec")


def test_calls_of_a_rebuilt_image_run_in_the_new_one(daemon, client, tmp_path):
    """A name rebuilt (rm + build, or a Dockerfile build replacing it) runs
    its next call in a call sandbox of the new image, not of the old one;
    a call running meanwhile ends in the old one."""
    def build(value: str) -> None:
        r = daemon.cli("image", "build", str(tmp_path), "--from", "busybox", "--name", "bb-rebuilt",
                       "--env", f"V={value}")
        assert r.returncode == 0, r.stderr

    build("one")
    assert client.call("bb-rebuilt", argv=["sh", "-c", "echo $V"]).stdout == b"one\n"

    async def running():
        async with Client(daemon.socket) as ac:
            return await ac.call("bb-rebuilt", argv=["sh", "-c", "sleep 1; echo $V"])

    task = asyncio.new_event_loop()
    slow = task.create_task(running())
    task.run_until_complete(asyncio.sleep(0.3))
    assert daemon.cli("image", "rm", "bb-rebuilt").returncode == 0
    build("two")
    assert client.call("bb-rebuilt", argv=["sh", "-c", "echo $V"]).stdout == b"two\n"
    assert task.run_until_complete(slow).stdout == b"one\n"
    task.close()
    (tmp_path / "Dockerfile").write_text("FROM busybox\nENV V=three\n")
    r = daemon.cli("image", "build", "-f", str(tmp_path / "Dockerfile"), str(tmp_path), "--name", "bb-rebuilt")
    assert r.returncode == 0, r.stderr
    assert client.call("bb-rebuilt", argv=["sh", "-c", "echo $V"]).stdout == b"three\n"


def test_no_shared_dir_of_the_image_keeps_what_a_call_writes(daemon, client, tmp_path):
    """/var/tmp and /run/lock (and /var/lock, a link to it on Debian) are
    world-writable in most images: a file one call left there would be
    read, and owned, by later calls. A call sandbox's root is read-only;
    /tmp is root-only."""
    (tmp_path / "Dockerfile").write_text(
        "FROM busybox\nRUN mkdir -p /var/tmp /run/lock && chmod 1777 /var/tmp /run/lock && "
        "ln -s /run/lock /var/lock\n")
    r = daemon.cli("image", "build", "-f", str(tmp_path / "Dockerfile"), str(tmp_path), "--name", "bb-shared-dirs")
    assert r.returncode == 0, r.stderr
    for d in ("/var/tmp", "/run/lock", "/var/lock"):
        r = client.call("bb-shared-dirs", argv=["sh", "-c", f"echo left > {d}/f || echo refused"])
        assert r.stdout == b"refused\n", (d, r)
    r = client.call("bb-shared-dirs", argv=["sh", "-c", "echo $HOME/x; echo ok > $HOME/x && cat $HOME/x"])
    assert r.stdout.endswith(b"ok\n"), r


@pytest.mark.parametrize("base", ["busybox", "py"])
def test_no_world_writable_place_of_the_image_keeps_what_a_call_writes(daemon, client, py_image, tmp_path, base):
    """Any dir or file of the image that is world-writable (or owned by a
    call's uid) would keep what one call wrote for the calls after it,
    under other uids: a call sandbox's root is read-only, and a call writes
    in its own dir under /tmp only."""
    (tmp_path / "Dockerfile").write_text(
        f"FROM {base}\nRUN mkdir -p /srv/drop && chmod 1777 /srv/drop && touch /etc/shared.conf && "
        "chmod 666 /etc/shared.conf\n")
    name = f"{base}-world-writable"
    r = daemon.cli("image", "build", "-f", str(tmp_path / "Dockerfile"), str(tmp_path), "--name", name)
    assert r.returncode == 0, r.stderr
    for probe in ("echo left > /srv/drop/f", "echo left >> /etc/shared.conf", "mkdir /srv/drop/d"):
        r = client.call(name, argv=["sh", "-c", f"{probe} 2>/dev/null || echo refused"])
        assert (r.exit_code, r.stdout) == (0, b"refused\n"), (probe, r)
    r = client.call(name, argv=["sh", "-c", "ls -A /srv/drop; cat /etc/shared.conf; echo ok > $HOME/x && cat $HOME/x"])
    assert (r.exit_code, r.stdout) == (0, b"ok\n"), r


def test_each_call_starts_from_fresh_private_state(client, py_image):
    first = client.call(py_image, code=(
        "import os, json\n"
        "open('mine', 'w').write('x')\n"
        "json.dumps = None\n"
        "os.environ['LEAK'] = '1'\n"
        "try:\n    open('/tmp/shared', 'w')\nexcept PermissionError as e:\n    print('denied', e.errno)\n"
        "print(os.getcwd())"))
    assert first.exit_code == 0, first.stderr
    denied, cwd = first.stdout.decode().split("\n")[:2]
    assert denied == "denied 13"          # /tmp itself is not writable: no shared scratch
    second = client.call(py_image, code=(
        "import os, json\n"
        f"print(os.path.exists({cwd!r}), os.listdir('.'), json.dumps(1), os.environ.get('LEAK'),"
        " os.environ['TMPDIR'] == os.getcwd())"))
    assert second.stdout == b"False [] 1 None True\n", second.stderr


def _host_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Uid:")).split()[1])


def test_a_call_sandbox_has_a_user_namespace_of_its_own(client, py_image):
    """Its zygote is root only inside it, and a call's uid is an id of its
    range: on the host both are unprivileged ids of the sandbox.userns range."""
    r = client.call(py_image, argv=["sh", "-c", "id -u; cat /proc/self/uid_map"])
    uid, first, host_first, count = (int(x) for x in r.stdout.split())
    userns = client.info()["userns"]
    assert r.exit_code == 0 and (first, count) == (0, userns["size"]) and host_first >= userns["base"], r
    assert 60000 <= uid < 60000 + 4096                            # fncall.uid_base, inside the range
    box = next(b for b in client.info()["fncall"]["boxes"] if b["image"] == py_image)
    assert _host_uid(box["zygote_pid"]) == host_first             # the zygote's root, mapped


def test_without_user_namespaces_calls_run_as_host_uids_past_the_hosts_own(daemon_factory):
    """sandbox.userns = false: a call's uid is a host uid, picked from
    100000 up, past host users and services (systemd's dynamic users end
    at 65519), not the 60000 a user namespace's range starts calls at."""
    d = daemon_factory("[sandbox]\nuserns = false\n")
    c = d.client()
    try:
        import_py(c)
        r = c.call("py", code="import os\nprint(os.getuid())")
        assert r.exit_code == 0 and 100000 <= int(r.stdout) < 100000 + 4096, r
    finally:
        c.close()


def test_a_call_cannot_touch_its_zygote(client, py_image):
    r = client.call(py_image, code="import os\ntry:\n    os.kill(os.getppid(), 9)\n"
                                   "except PermissionError as e:\n    print(e.errno)")
    assert r.stdout == b"1\n"             # EPERM: calls run as another uid than the zygote
    assert client.call(py_image, code="print(1)").stdout == b"1\n"


def _calls_at_once(daemon, image: str, *codes: str) -> list:
    """The results of code calls sent together on one connection."""
    async def run():
        async with Client(daemon.socket) as c:
            return await asyncio.gather(*(c.call(image, code=code) for code in codes))

    return asyncio.run(run())


def test_concurrent_calls_cannot_reach_each_other(daemon, py_image):
    """Calls run under different uids: one cannot list the dir that holds the
    others' private dirs, nor signal the other calls' (or idle workers')
    processes. Their pids are not in its /proc: it tries every pid given out
    in the call sandbox so far."""
    probe = ("import os, signal, time\n"
             "me = os.getuid()\n"
             "print(me, flush=True)\n"
             "time.sleep(0.3)\n"
             "try:\n    os.listdir(os.path.dirname(os.getcwd()))\n    print('listed')\n"
             "except PermissionError:\n    print('nolist')\n"
             "killed = denied = 0\n"
             "for p in range(2, int(open('/proc/sys/kernel/ns_last_pid').read()) + 1):\n"
             "    if p == os.getpid():\n        continue\n"
             "    try:\n        os.kill(p, signal.SIGKILL)\n        killed += 1\n"
             "    except PermissionError:\n        denied += 1\n"
             "    except ProcessLookupError:\n        pass\n"
             "print(denied > 0 and killed == 0)")

    a, b = _calls_at_once(daemon, py_image, probe, probe)
    assert a.stdout.split()[0] != b.stdout.split()[0]
    assert a.stdout.split()[1:] == [b"nolist", b"True"], a.stderr
    assert b.stdout.split()[1:] == [b"nolist", b"True"], b.stderr


IPC_HOLDER = (
    "import ctypes, os, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "made = [libc.shmget(KEY, 4096, 0o1666), libc.semget(KEY, 1, 0o1666), libc.msgget(KEY, 0o1666),\n"
    "        libc.mq_open(QUEUE, 0o100 | 2, 0o666, None)]\n"          # O_CREAT | O_RDWR
    "open(READY, 'w').close()\n"
    "while not os.path.exists(DONE):\n    time.sleep(0.05)\n"
    "print(min(made) >= 0)")
IPC_LOOKER = (
    "import ctypes, os, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "while not os.path.exists(READY):\n    time.sleep(0.05)\n"
    "found = [libc.shmget(KEY, 0, 0) >= 0, libc.semget(KEY, 0, 0) >= 0, libc.msgget(KEY, 0) >= 0,\n"
    "         libc.mq_open(QUEUE, 0) >= 0]\n"                           # O_RDONLY
    "took = libc.shmget(KEY, 4096, 0o3666) >= 0\n"                     # IPC_CREAT | IPC_EXCL
    "open(DONE, 'w').close()\n"
    "while os.path.exists(READY):\n    time.sleep(0.05)\n"     # gone with the holder's end, DONE with ours
    "print(found, took)")


def test_a_call_cannot_reach_or_take_what_a_concurrent_call_made_in_ipc(daemon, py_image):
    """Each call runs in an IPC namespace of its own: SysV shared memory,
    semaphores, message queues and POSIX message queues one running call
    made are not found by another running at the same time, which can make
    the same key itself (no call squats a key or name another expects).
    The holder says it made them through /dev/shm, and ends once told to;
    the other waits for the holder's file to go (removed with what the
    holder left), so neither misses the other's."""
    tag = secrets.token_hex(4)
    names = (f"KEY = 0x5ec{int(tag[:4], 16):04x}\nQUEUE = b'/q-{tag}'\n"
             f"READY = '/dev/shm/ready-{tag}'\nDONE = '/dev/shm/done-{tag}'\n")
    held, looked = _calls_at_once(daemon, py_image, names + IPC_HOLDER, names + IPC_LOOKER)
    assert (looked.exit_code, looked.stdout) == (0, b"[False, False, False, False] True\n"), looked
    assert (held.exit_code, held.stdout) == (0, b"True\n"), held


def _plain_calls_at_once(daemon, image: str, *codes: str) -> list:
    """The results of argv calls of python3 -c CODE sent together on one
    connection (argv of sh, so not routed as code)."""
    async def run():
        async with Client(daemon.socket) as c:
            return await asyncio.gather(*(c.call(image, argv=["sh", "-c", 'exec python3 -c "$0"', code])
                                          for code in codes))

    return asyncio.run(run())


@pytest.mark.parametrize("exec_via", ["init", "helper"])
def test_a_plain_call_cannot_reach_or_take_what_a_concurrent_one_made_in_ipc(daemon_factory, exec_via):
    """A plain call (no zygote), forked by the call sandbox's init or by the
    helper, runs in an IPC namespace of its own as well: SysV objects and a
    message queue one running plain call made are not found by another,
    which can make the same key itself."""
    d = daemon_factory(f'exec_via = "{exec_via}"\n[fncall]\nzygote = false\n')
    c = d.client()
    try:
        py = import_py(c)
    finally:
        c.close()
    tag = secrets.token_hex(4)
    names = (f"KEY = 0x5ec{int(tag[:4], 16):04x}\nQUEUE = b'/q-{tag}'\n"
             f"READY = '/dev/shm/ready-{tag}'\nDONE = '/dev/shm/done-{tag}'\n")
    held, looked = _plain_calls_at_once(d, py, names + IPC_HOLDER, names + IPC_LOOKER)
    assert (held.exit_code, held.stdout, held.path) == (0, b"True\n", "exec"), held
    assert (looked.exit_code, looked.stdout) == (0, b"[False, False, False, False] True\n"), looked


NET_HOLDER = (
    "import os, socket, time\n"
    "tcp = socket.socket()\ntcp.bind(('127.0.0.1', PORT))\ntcp.listen()\n"
    "unix = socket.socket(socket.AF_UNIX)\nunix.bind(ABSTRACT)\nunix.listen()\n"
    "open(READY, 'w').close()\n"
    "while not os.path.exists(DONE):\n    time.sleep(0.05)\n"
    "print('held')")
NET_LOOKER = (
    "import os, socket, time\n"
    "while not os.path.exists(READY):\n    time.sleep(0.05)\n"
    "def reached(family, addr):\n"
    "    with socket.socket(family) as s:\n"
    "        return s.connect_ex(addr) == 0\n"
    "found = [reached(socket.AF_INET, ('127.0.0.1', PORT)), reached(socket.AF_UNIX, ABSTRACT)]\n"
    "try:\n    socket.socket().bind(('127.0.0.1', PORT))\n    took = True\n"
    "except OSError:\n    took = False\n"
    "open(DONE, 'w').close()\n"
    "while os.path.exists(READY):\n    time.sleep(0.05)\n"     # gone with the holder's end, DONE with ours
    "print(found, took)")


def calls_on_the_network(daemon, image: str) -> tuple:
    """A call listening on 127.0.0.1:PORT and on an abstract unix socket,
    and what another running at the same time saw: (reached each, could
    bind PORT itself). The holder says it listens through /dev/shm and
    ends once told to."""
    tag = secrets.token_hex(4)
    names = (f"PORT = {20000 + int(tag[:4], 16) % 40000}\nABSTRACT = b'\\0calls-{tag}'\n"
             f"READY = '/dev/shm/ready-{tag}'\nDONE = '/dev/shm/done-{tag}'\n")
    held, looked = _calls_at_once(daemon, image, names + NET_HOLDER, names + NET_LOOKER)
    assert (held.exit_code, held.stdout) == (0, b"held\n"), held
    assert looked.exit_code == 0, looked
    return looked.stdout


def test_calls_share_the_call_sandboxs_loopback_by_default(daemon, py_image):
    """What docs/burst.md says stays shared ("What concurrent calls share"):
    without fncall.own_net a call reaches another's server on localhost
    and its abstract unix socket, and cannot take its port."""
    assert calls_on_the_network(daemon, py_image) == b"[True, True] False\n"


def test_with_own_net_a_call_cannot_reach_or_take_a_concurrent_calls_server(daemon_factory):
    """fncall.own_net: each call in a net namespace of its own, its
    loopback up: another call's server on localhost and its abstract unix
    socket are out of reach, and the port is free to take."""
    d = daemon_factory("[fncall]\nown_net = true\n")
    c = d.client()
    try:
        assert calls_on_the_network(d, import_py(c)) == b"[False, False] True\n"
        r = c.call("py", code="import socket\ns = socket.create_server(('127.0.0.1', 0))\n"
                              "c = socket.create_connection(s.getsockname())\nprint(s.accept()[0].fileno() > 0)")
        assert (r.exit_code, r.stdout) == (0, b"True\n"), r      # its own loopback works
    finally:
        c.close()


def test_a_net_namespace_the_zygote_cannot_have_leaves_calls_their_ipc_one(daemon_factory, tmp_path):
    """fncall.own_net where a worker cannot bring its loopback up (stood in
    for by a python3 whose fcntl.ioctl fails): the zygote says so, and its
    calls keep an IPC namespace each and share the call sandbox's network."""
    d = daemon_factory("[fncall]\nown_net = true\n")
    c = d.client()
    try:
        py = import_py(c)
        ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        (tmp_path / "sitecustomize.py").write_text("import fcntl\n"
                                                   "def ioctl(*_):\n    raise OSError(1, 'refused')\n"
                                                   "fcntl.ioctl = ioctl\n")
        c.build_dockerfile(str(tmp_path), "py-noioctl",
                           text=f"FROM {py}\nCOPY sitecustomize.py /usr/lib/{ver}/sitecustomize.py\n")
        assert calls_on_the_network(d, "py-noioctl") == b"[True, True] False\n"
        assert "zygote for py-noioctl cannot give calls a net namespace each" in d.log.read_text()
        tag = secrets.token_hex(4)
        names = (f"KEY = 0x5ec{int(tag[:4], 16):04x}\nQUEUE = b'/q-{tag}'\n"
                 f"READY = '/dev/shm/ready-{tag}'\nDONE = '/dev/shm/done-{tag}'\n")
        held, looked = _calls_at_once(d, "py-noioctl", names + IPC_HOLDER, names + IPC_LOOKER)
        assert (looked.exit_code, looked.stdout) == (0, b"[False, False, False, False] True\n"), looked
    finally:
        c.close()


def _argv_calls_at_once(daemon, image: str, *argvs: list[str]) -> list:
    """The results of argv calls sent together on one connection."""
    async def run():
        async with Client(daemon.socket) as c:
            return await asyncio.gather(*(c.call(image, argv=argv, timeout=30) for argv in argvs))

    return asyncio.run(run())


@pytest.mark.parametrize("path", ["zygote", "exec"])
def test_a_call_cannot_see_another_calls_processes(daemon, py_image, path):
    """A call's /proc shows none of the other calls' processes (nor the
    zygote's, nor init's): no other call's argv, environment or pid. The
    running call says its pid through /dev/shm (a name the other knows),
    and ends once told to; the other waits for its file to go (removed
    with what the call left), so neither misses the other's."""
    tag = secrets.token_hex(4)
    ready, done = f"/dev/shm/ready-{tag}", f"/dev/shm/done-{tag}"
    # Written under another name, then renamed: `> {ready}` makes the file
    # before the pid is in it, and the looker would read an empty pid.
    holder = ["sh", "-c", f"echo $$ > {ready}.w && mv {ready}.w {ready}; until [ -e {done} ]; do sleep 0.05; done",
              f"secret-{tag}"]
    looker = ["sh", "-c",
              f"until [ -e {ready} ]; do sleep 0.05; done; pid=$(cat {ready}); id -u; "
              "for p in /proc/[0-9]*; do stat -c %u $p; done 2>/dev/null | sort -u | tr '\\n' ' '; echo; "
              "cat /proc/$pid/cmdline 2>/dev/null | tr '\\0' ' '; echo; "
              f"[ -e /proc/$pid ] && echo seen || echo hidden; touch {done}; "
              f"while [ -e {ready} ]; do sleep 0.05; done"]
    image = py_image if path == "zygote" else "busybox"
    held, looked = _argv_calls_at_once(daemon, image, holder, looker)
    assert looked.exit_code == 0 and looked.path == path, looked
    assert held.exit_code == 0 and held.path == path, held
    me, owners, cmdline, seen = looked.stdout.decode().split("\n")[:4]
    assert owners.split() == [me], looked
    assert f"secret-{tag}" not in cmdline and seen == "hidden", looked


def test_multiprocessing_works_in_a_call(client, py_image):
    """Its locks, queues and shared memory live in /dev/shm (glibc makes
    them nowhere else): a call may make them there."""
    r = client.call(py_image, code=(
        "import multiprocessing as mp\n"
        "from multiprocessing import shared_memory\n"
        "with mp.Pool(2) as pool:\n    print(pool.map(abs, [-1, -2]))\n"
        "q = mp.Queue()\nq.put(3)\nprint(q.get())\n"
        "m = shared_memory.SharedMemory(create=True, size=8)\nm.buf[0] = 7\nprint(m.buf[0])\n"
        "m.close()\nm.unlink()\n"))
    assert (r.exit_code, r.stdout) == (0, b"[1, 2]\n3\n7\n"), r.stderr


def test_calls_cannot_list_or_remove_each_others_dev_shm_files(daemon, py_image):
    holder = ("import os, time\n"
              "open('/dev/shm/held', 'w').write('mine')\n"
              "print('made', flush=True)\n"
              "time.sleep(1)\n"
              "print(open('/dev/shm/held').read())\n")
    other = ("import os, time\n"
             "time.sleep(0.4)\n"
             "for what, op in (('list', lambda: os.listdir('/dev/shm')), ('rm', lambda: os.unlink('/dev/shm/held')),\n"
             "                 ('mv', lambda: os.rename('/dev/shm/held', '/dev/shm/x'))):\n"
             "    try:\n        op()\n        print(what, 'done')\n"
             "    except PermissionError:\n        print(what, 'denied')\n")

    a, b = _calls_at_once(daemon, py_image, holder, other)
    assert (a.exit_code, a.stdout) == (0, b"made\nmine\n"), a.stderr
    assert b.stdout == b"list denied\nrm denied\nmv denied\n", b.stderr


def test_what_a_call_left_in_another_calls_dir_goes_with_its_uid(daemon, py_image):
    """One call leaves a world-writable dir in /dev/shm and runs on; another
    puts a file in it and ends: that file goes when its uid is freed, not
    when the dir's owner ends."""
    holder = ("import os, time\n"
              "os.mkdir('/dev/shm/open-dir', 0o777)\nos.chmod('/dev/shm/open-dir', 0o777)\n"
              "time.sleep(0.5)\n"
              "deadline = time.monotonic() + 5\n"
              "while os.path.exists('/dev/shm/open-dir/f') and time.monotonic() < deadline:\n"
              "    time.sleep(0.05)\n"
              "print(os.path.exists('/dev/shm/open-dir/f'))\n")
    other = ("import time\ntime.sleep(0.2)\nopen('/dev/shm/open-dir/f', 'w').write('x')\nprint('put')\n")
    a, b = _calls_at_once(daemon, py_image, holder, other)
    assert (b.stdout, a.stdout) == (b"put\n", b"False\n"), (a, b)


@pytest.mark.parametrize("path", ["zygote", "exec"])
@pytest.mark.parametrize("kind", ["file", "tree", "deep"])
def test_what_a_call_leaves_in_dev_shm_is_removed(client, py_image, path, kind):
    """Before its uid goes to another call: a later call of that uid would
    own it (and could read it whatever its mode). A tree goes whole, one
    deeper than recursion or an fd per level reach too."""
    name = f"/dev/shm/left-by-{path}-{kind}"
    image = py_image if path == "zygote" else "busybox"
    make = {"file": f"echo x > {name}", "tree": f"mkdir -p {name}/a/b && echo x > {name}/a/b/f",
            "deep": f"mkdir {name} && cd {name} && i=0 && while [ $i -lt 1200 ]; do mkdir d && cd d && "
                    "i=$((i+1)) || exit 1; done && echo x > f"}[kind]
    if path == "zygote":
        r = client.call(py_image, code=f"import os\nos.system({make!r})\nprint('left')")
    else:
        r = client.call("busybox", argv=["sh", "-c", f"{make} && echo left"])
    assert (r.exit_code, r.stdout, r.path) == (0, b"left\n", path), r
    deadline = time.monotonic() + 5
    while client.call(image, argv=["test", "-e", name]).exit_code == 0:
        assert time.monotonic() < deadline, f"{name} is still there"
        time.sleep(0.05)


SYSV_LEFTOVERS = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "shm = libc.shmget(0x5ec21, 4096, 0o1666)\n"
    "sem = libc.semget(0x5ec22, 1, 0o1666)\n"
    "msg = libc.msgget(0x5ec23, 0o1666)\n"
    "given = libc.shmget(0x5ec24, 4096, 0o1600)\n"
    "perm = (ctypes.c_uint * 32)()\n"
    "assert libc.shmctl(given, 2, perm) == 0\n"           # IPC_STAT
    "perm[1] = os.getuid() + 1\n"                         # ipc_perm.uid: another call's
    "assert libc.shmctl(given, 1, perm) == 0\n"           # IPC_SET
    "print(min(shm, sem, msg, given) >= 0)")


def check_sysv_leftovers_go(c, image: str, path: str) -> None:
    """SysV shared memory, semaphores and message queues a call made are not
    there for a later call: through the zygote they go with the call's own
    IPC namespace; a plain call's live in the call sandbox's, past the call,
    and go before its uid goes to another call (a later call could read
    them, and a later call of that uid would own them). Even one given to
    another uid (IPC_SET) goes: its creator is the call's uid."""
    r = c.call(image, argv=["sh", "-c", 'exec python3 -c "$0"', SYSV_LEFTOVERS])     # not routed as code
    assert (r.exit_code, r.stdout, r.path) == (0, b"True\n", path), r
    keys = {f"{k}" for k in range(0x5ec21, 0x5ec25)}
    probe = "for k in shm sem msg; do tail -n +2 /proc/sysvipc/$k; done"
    deadline = time.monotonic() + 5
    while True:
        left = c.call(image, argv=["sh", "-c", probe]).stdout.decode().split("\n")
        left = [line for line in left if line.split()[:1] and line.split()[0] in keys]
        if not left:
            break
        assert time.monotonic() < deadline, f"still there: {left}"
        time.sleep(0.05)


def test_what_a_call_leaves_in_sysv_ipc_is_removed(client, py_image):
    check_sysv_leftovers_go(client, py_image, "zygote")


def with_plain_calls(daemon_factory, *checks, config: str = "") -> None:
    """Each check(client, the py image, "exec") on a daemon whose calls all
    go the plain route (no zygote), python3 in the image all the same."""
    d = daemon_factory(config + "[fncall]\nzygote = false\n")
    c = d.client()
    try:
        py = import_py(c)
        for check in checks:
            check(c, py, "exec")
    finally:
        c.close()


def test_what_a_plain_call_leaves_in_sysv_ipc_is_removed(daemon_factory):
    with_plain_calls(daemon_factory, check_sysv_leftovers_go)


MQ_LEFT = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
           "q = libc.mq_open(b'/left-by-a-call', 0o100 | 2, 0o666, None)\n"      # O_CREAT | O_RDWR
           "print(q >= 0 and libc.mq_send(q, b'secret', 6, 0) == 0)")
MQ_PROBE = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "q = libc.mq_open(b'/left-by-a-call', 0)\nprint(q >= 0 or ctypes.get_errno())")


def check_mqueue_leftovers_go(c, image: str, path: str) -> None:
    """A POSIX message queue lives in the call sandbox's IPC namespace, past
    the call that made it: it goes before the call's uid goes to another."""
    def run(code):
        return c.call(image, argv=["sh", "-c", 'exec python3 -c "$0"', code])     # not routed as code

    r = run(MQ_LEFT)
    assert (r.exit_code, r.stdout, r.path) == (0, b"True\n", path), r
    deadline = time.monotonic() + 5
    while (left := run(MQ_PROBE).stdout) != f"{errno.ENOENT}\n".encode():
        assert time.monotonic() < deadline, f"still there: {left}"
        time.sleep(0.05)


def test_a_message_queue_a_call_leaves_is_removed(client, py_image):
    check_mqueue_leftovers_go(client, py_image, "zygote")


def test_a_message_queue_a_plain_call_leaves_is_removed(daemon_factory):
    with_plain_calls(daemon_factory, check_mqueue_leftovers_go)


def test_without_user_namespaces_what_a_plain_call_leaves_in_ipc_is_removed(daemon_factory):
    """Without a user namespace of the call sandbox's own a plain call
    cannot have an IPC namespace of its own: its SysV objects and message
    queues are in the call sandbox's, and are removed after it."""
    with_plain_calls(daemon_factory, check_sysv_leftovers_go, check_mqueue_leftovers_go,
                     config="[sandbox]\nuserns = false\n")


def test_call_workers_run_under_the_seccomp_filter(client, py_image):
    """The zygote is started by the exec helper with the sandbox profile
    (sandbox.seccomp) and every worker it forks inherits it: a denied syscall
    fails with EPERM where an unfiltered process as the same uid succeeds, and
    its allowed neighbour works. x86_64 numbers, as in test_seccomp_kernel.py."""
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def call(*a):\n"
        "    ctypes.set_errno(0)\n"
        "    rc = libc.syscall(*a)\n"
        "    return 'ok' if rc >= 0 else ctypes.get_errno()\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(status['Seccomp'].strip(), status['NoNewPrivs'].strip())\n"
        "print(call(250, 0, -3, 0))\n"      # keyctl(KEYCTL_GET_KEYRING_ID, session): denied
        "print(call(425, 1, 0))\n"          # io_uring_setup: denied
        "print(call(39))\n"                 # getpid: allowed
        "print(call(272, 0x08000000))\n"    # unshare(CLONE_NEWIPC): the filter lets the zygote, no call
    )
    r = client.call(py_image, code=code)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split("\n")[:5] == ["2 1", str(errno.EPERM), str(errno.EPERM), "ok", str(errno.EPERM)]
    # An argv call (forked by the zygote, then exec'ed) keeps the filter too.
    r = client.call(py_image, argv=["sh", "-c", "grep '^Seccomp:' /proc/self/status"])
    assert r.stdout == b"Seccomp:\t2\n", r.stderr


def test_large_code_stdin_and_output_cap(client, py_image):
    """Code past the inline packet size travels in a memfd, stdin in a memfd
    too; output past limits.max_exec_output_bytes (8M) is cut and flagged."""
    big = "x = 1\n" * 20000 + "import sys\nprint(len(sys.stdin.read()), x)"
    r = client.call(py_image, code=big, stdin=b"y" * (1 << 20))
    assert (r.exit_code, r.stdout) == (0, b"1048576 1\n"), r.stderr
    r = client.call(py_image, code="import sys\nsys.stdout.buffer.write(b'z' * (9 << 20))")
    assert r.truncated and len(r.stdout) == 8 << 20


def test_large_argv_and_env_go_through_the_zygote(client, py_image):
    """A request past the inline packet size travels in a memfd whatever
    makes it large: the argv of an argv call, or the env of any call (the
    zygote reads packets of at most 64 KiB)."""
    words = [f"{i:04}" + "w" * 996 for i in range(100)]          # 100 KB of argv
    r = client.call(py_image, argv=["sh", "-c", 'echo "$#" "${100%%w*}"', "sh", *words])
    assert (r.exit_code, r.stdout, r.path) == (0, b"100 0099\n", "zygote"), r
    env = {f"K{i}": "v" * 1000 for i in range(100)}
    r = client.call(py_image, code="import os\nprint(len(os.environ['K99']), len(os.environ))", env=env)
    assert (r.exit_code, r.stdout[:5]) == (0, b"1000 "), r
    r = client.call(py_image, argv=["sh", "-c", "echo ${#K5}"], env=env)
    assert (r.exit_code, r.stdout) == (0, b"1000\n"), r
    r = client.call(py_image, code="print('the zygote is still there')")
    assert r.stdout == b"the zygote is still there\n" and client.info()["fncall"]["zygotes_replaced"] == 0


def test_timeout_kills_the_call(client, py_image):
    t = time.monotonic()
    r = client.call(py_image, code="import time\nprint('start', flush=True)\ntime.sleep(30)", timeout=0.5)
    assert r.timed_out and r.signal == signal.SIGKILL and r.exit_code is None
    assert r.stdout == b"start\n"
    assert time.monotonic() - t < 5


def test_stdin_exceptions_and_exit_codes(client, py_image):
    r = client.call(py_image, code="import sys\nprint(sys.stdin.read().upper())", stdin=b"hello")
    assert r.stdout == b"HELLO\n"
    r = client.call(py_image, code="raise ValueError('boom')")
    assert r.exit_code == 1 and b"ValueError: boom" in r.stderr
    assert client.call(py_image, code="import sys; sys.exit(7)").exit_code == 7


def test_a_code_call_ends_as_the_interpreter_does(client, py_image):
    """As under `python3 -c`: the call's non-daemon threads are waited for,
    its atexit functions run, and an uncaught exception goes to
    sys.excepthook with a traceback that starts at the call's own code."""
    r = client.call(py_image, code=(
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit')\n"
        "def late():\n    time.sleep(0.2)\n    print('thread', flush=True)\n"
        "threading.Thread(target=late).start()\n"
        "print('main', flush=True)\n"))
    assert (r.exit_code, r.stdout) == (0, b"main\nthread\natexit\n"), r.stderr
    r = client.call(py_image, code="def f():\n    raise ValueError('boom')\nf()\n")
    assert r.exit_code == 1
    assert r.stderr.startswith(b'Traceback (most recent call last):\n  File "<call>", line 3, in <module>\n')
    assert r.stderr.endswith(b"ValueError: boom\n") and b"worker" not in r.stderr, r.stderr
    r = client.call(py_image, code="import sys\nsys.excepthook = lambda t, v, tb: print('hook', t.__name__)\n"
                                   "raise KeyError(1)\n")
    assert (r.exit_code, r.stdout, r.stderr) == (1, b"hook KeyError\n", b"")


def test_rlimit_bounds_a_call(client, py_image):
    r = client.call(py_image, code="try:\n    b = bytearray(3 << 30)\nexcept MemoryError:\n    print('capped')")
    assert r.stdout == b"capped\n", r.stderr
    big = client.call(py_image, code="print(len(bytearray(64 << 20)))")
    assert big.stdout == b"67108864\n"


FORK_ALL = ("import os, time\n"
            "kids = []\n"
            "try:\n"
            "    for _ in range(64):\n"
            "        pid = os.fork()\n"
            "        if pid == 0:\n"
            "            time.sleep(30)\n"
            "            os._exit(0)\n"
            "        kids.append(pid)\n"
            "except BlockingIOError:\n"
            "    pass\n"
            "time.sleep(0.5)\n"          # the others' calls run meanwhile
            "print(len(kids))\n"
            "for pid in kids:\n"
            "    os.kill(pid, 9)\n")


def test_a_call_that_forks_without_end_leaves_room_for_the_others(daemon_factory):
    """fncall.rlimit_nproc bounds each call's processes (RLIMIT_NPROC of its
    own uid): one call's fork loop stops there, and a call beside it still
    forks what it needs, from the same call sandbox's pids."""
    d = daemon_factory("[fncall]\nrlimit_nproc = 16\n")
    c = d.client()
    try:
        image = import_py(c)
        hog, other = _calls_at_once(d, image, FORK_ALL, "import time\ntime.sleep(0.2)\n" + FORK_ALL.replace("64", "8"))
    finally:
        c.close()
    assert hog.exit_code == 0 and int(hog.stdout) == 15, hog.stderr          # 16 with the call's own process
    assert other.exit_code == 0 and int(other.stdout) == 8, other.stderr


def test_dead_zygote_is_replaced(client, py_image):
    assert client.call(py_image, code="print(1)").exit_code == 0
    info = client.info()["fncall"]
    box = next(b for b in info["boxes"] if b["image"] == py_image)
    os.kill(box["zygote_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        info2 = client.info()["fncall"]
        if info2["zygotes_replaced"] > info["zygotes_replaced"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    r = client.call(py_image, code="print(2)")
    assert (r.exit_code, r.stdout, r.path) == (0, b"2\n", "zygote")
    info3 = client.info()["fncall"]
    box3 = next(b for b in info3["boxes"] if b["image"] == py_image)
    assert box3["zygote_pid"] != box["zygote_pid"] and box3["id"] != box["id"]
    assert info3["zygotes_replaced"] == info["zygotes_replaced"] + 1


def test_many_calls_in_flight_on_one_connection(daemon, py_image):
    async def run():
        async with Client(daemon.socket) as c:
            return await asyncio.gather(*(c.call(py_image, code=f"print({i} * 2)") for i in range(60)))

    results = asyncio.run(run())
    assert [r.stdout for r in results] == [f"{i * 2}\n".encode() for i in range(60)]


def test_hundreds_of_calls_in_flight_from_several_clients(daemon, py_image):
    """More calls at once than the zygote's socket queues (net.unix.max_dgram_qlen
    packets): they wait for room; none fails, the zygote is not replaced."""
    c = daemon.client()
    before = c.info()["fncall"]["zygotes_replaced"]

    async def one(i):
        async with Client(daemon.socket) as ac:
            return await asyncio.gather(*(ac.call(py_image, code=f"print({i} * {j})") for j in range(100)),
                                        return_exceptions=True)

    async def run():
        return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(run())
    for i, rs in enumerate(results):
        assert [r if isinstance(r, Exception) else r.stdout for r in rs] == \
            [f"{i * j}\n".encode() for j in range(100)]
    assert c.info()["fncall"]["zygotes_replaced"] == before
    c.close()


@pytest.mark.skipif(native.probe_pidfd_group_signal() != 0,
                    reason="execs go through the daemon's helper on kernels without PIDFD_SIGNAL_PROCESS_GROUP")
def test_plain_calls_are_forked_by_the_call_sandboxs_init(client):
    """With sandbox.exec_via = "init" (the default where the kernel has it), a
    plain call is forked by its call sandbox's init (parent pid 1 inside),
    not entered by the daemon's helper (parent outside the pid namespace: 0)."""
    before = client.info()["fncall"]
    r = client.call("busybox", argv=["sh", "-c", "echo $PPID; id -u; cat"], stdin=b"in\n")
    after = client.info()["fncall"]
    ppid, uid, echoed = r.stdout.decode().split()
    assert r.exit_code == 0 and ppid == "1" and echoed == "in", r
    assert int(uid) >= 60000                 # its own uid, as through the helper
    assert after["plain_calls_by_init"] == before["plain_calls_by_init"] + 1
    assert after["plain_calls"] == before["plain_calls"] + 1


PLAIN_CALL_PROBE = ("grep CapEff /proc/self/status; echo x > /etc/motd || echo no-etc; "
                    "echo x > /tmp/leak || echo no-tmp; kill -0 1 || echo no-kill")


def test_a_plain_call_keeps_no_capability(client):
    """Its own uid, and none of the sandbox's capabilities (DAC_OVERRIDE,
    CHOWN, KILL...): nothing a later call runs with can be changed."""
    r = client.call("busybox", argv=PLAIN_CALL_PROBE)
    lines = r.stdout.decode().split("\n")
    assert lines[0].split() == ["CapEff:", "0000000000000000"], r
    assert lines[1:4] == ["no-etc", "no-tmp", "no-kill"], r


def _running(marker: bytes) -> list[int]:
    """Host pids of live (not zombie) processes whose argv is exactly `marker` (NUL-separated)."""
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (Path(f"/proc/{p}/cmdline").read_bytes() == marker + b"\0"
                    and "\nState:\tZ" not in Path(f"/proc/{p}/status").read_text()):
                pids.append(int(p))
        except OSError:
            continue
    return pids


def _gone_soon(marker: bytes) -> bool:
    deadline = time.monotonic() + 10
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(marker)


@pytest.mark.parametrize("path", ["zygote", "exec"])
def test_what_a_call_leaves_running_is_killed(client, py_image, path):
    """A process that left the call's process group and session dies with the
    call: its uid goes to later calls, which it could otherwise signal or trace."""
    marker = f"sleep\0{3170 + len(path)}".encode()
    if path == "zygote":
        r = client.call(py_image, code=("import os\nif os.fork() == 0:\n    os.setsid()\n"
                                        f"    os.execv('/bin/sleep', ['sleep', '{3170 + len(path)}'])\n"
                                        "print('forked')"))
    else:
        r = client.call("busybox", argv=f"setsid sleep {3170 + len(path)} & echo forked")
    assert (r.exit_code, r.stdout, r.path) == (0, b"forked\n", path), r
    assert _gone_soon(marker)
    assert client.call(py_image if path == "zygote" else "busybox", argv=["true"]).exit_code == 0


def test_a_plain_calls_end_spares_processes_of_its_uid_outside_its_sandbox(client):
    """What a plain call left running is killed by its uid in its call
    sandbox only: a process of the same host uid outside it (another
    daemon's sandbox whose id range overlaps this one's, or the host's own)
    runs on."""
    r = client.call("busybox", argv=["sh", "-c", "id -u; cat /proc/self/uid_map"])
    in_uid, first, host_first, _count = map(int, r.stdout.split())
    # The next call's uid is one of these: a later one, or an earlier call's
    # given back once what that call left was gone (a test before this one).
    uids = range(max(first, in_uid - 8), in_uid + 8)
    outside = [subprocess.Popen(["setpriv", f"--reuid={host_first + u - first}", f"--regid={host_first + u - first}",
                                 "--clear-groups", "sleep", "60"]) for u in uids]
    try:
        r = client.call("busybox", argv=["sh", "-c", "setsid sleep 3333 & id -u"])
        assert int(r.stdout) in uids, r
        assert _gone_soon(b"sleep\x003333")      # killed by its uid: the same kill would reach `outside`
        assert [p.poll() for p in outside] == [None] * len(uids), "a process of a call's uid outside was killed"
    finally:
        for p in outside:
            p.kill()
            p.wait()


def test_garbage_on_a_workers_link_does_not_kill_the_zygote(client, py_image):
    """A code call holds its worker's link to the zygote (fd 3): what it
    writes there must not take down the zygote, and with it every call in
    flight beside it."""
    def zygote_pid() -> int:
        return next(b for b in client.info()["fncall"]["boxes"] if b["image"] == py_image)["zygote_pid"]

    assert client.call(py_image, code="print(1)").exit_code == 0
    zyg = zygote_pid()
    for junk in (b"garbage", b'{"done": "x"}', b'{"done": 1e999}', b"[]"):
        r = client.call(py_image, code=f"import os\nos.write(3, {junk!r})\nprint('sent')")
        assert (r.exit_code, r.stdout, r.path) == (0, b"sent\n", "zygote"), r
    assert zygote_pid() == zyg


def test_a_call_that_nests_dirs_deeply_does_not_kill_the_zygote(client, py_image):
    """Its dir is removed after it by the zygote: a tree deeper than a
    recursive walk goes must not take the zygote (and every call in flight
    beside it) down."""
    assert client.call(py_image, code="print(1)").exit_code == 0
    box = next(b for b in client.info()["fncall"]["boxes"] if b["image"] == py_image)
    r = client.call(py_image, code="import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\n"
                                   "print('deep')")
    assert (r.exit_code, r.stdout) == (0, b"deep\n"), r
    time.sleep(0.5)
    assert client.call(py_image, code="print(2)").stdout == b"2\n"
    after = next(b for b in client.info()["fncall"]["boxes"] if b["image"] == py_image)
    assert after["zygote_pid"] == box["zygote_pid"]


def test_a_call_that_says_it_is_done_is_not_left_running(client, py_image):
    """A call that writes its own end report on its link and sleeps on
    ends there: it may not outlive the call (and its timeout)."""
    r = client.call(py_image, code=("import json, os, time\nos.write(3, json.dumps({'done': 0}).encode())\n"
                                    "os.close(1)\nos.close(2)\nos.execv('/bin/sleep', ['sleep', '3181'])"),
                    timeout=2)
    assert r.exit_code == 0 or r.signal == signal.SIGKILL, r
    assert _gone_soon(b"sleep\x003181")


# A call's code moving its worker out of its process group, into the
# zygote's (a session leader's, whose workers share its session).
INTO_ZYGOTES_GROUP = "import json, os, time\nos.setpgid(0, os.getpgid(os.getppid()))\n"


def test_a_call_that_left_its_process_group_is_killed_at_its_end(client, py_image):
    """A call that moves itself out of its process group and reports its own
    end, then sleeps on: the kill after the report reaches it all the same,
    and the uid it held goes to later calls only once it is gone."""
    r = client.call(py_image, code=INTO_ZYGOTES_GROUP + (
        "os.write(3, json.dumps({'done': 0}).encode())\n"
        "os.close(1)\nos.close(2)\nos.execv('/bin/sleep', ['sleep', '3188'])"), timeout=30)
    assert r.exit_code == 0 or r.signal == signal.SIGKILL, r
    assert _gone_soon(b"sleep\x003188")


def test_a_call_that_left_its_process_group_is_killed_at_its_timeout(client, py_image):
    """Its timeout's kill reaches it outside its group: the call ends timed
    out, and the zygote (and every call beside it) goes on."""
    assert client.call(py_image, code="print(1)").exit_code == 0
    zygote = next(b for b in client.info()["fncall"]["boxes"] if b["image"] == py_image)["zygote_pid"]
    t0 = time.monotonic()
    r = client.call(py_image, code=INTO_ZYGOTES_GROUP + "os.execv('/bin/sleep', ['sleep', '3189'])", timeout=1)
    assert r.timed_out and time.monotonic() - t0 < 10, r
    assert _gone_soon(b"sleep\x003189")
    assert client.call(py_image, code="print(2)").stdout == b"2\n"
    assert next(b for b in client.info()["fncall"]["boxes"] if b["image"] == py_image)["zygote_pid"] == zygote


def test_a_process_a_call_cloned_onto_the_zygote_is_killed(client, py_image):
    """clone(CLONE_PARENT) gives the new process the caller's parent: for a
    call through the zygote, the zygote, not the call sandbox's init. In its
    own session it outlived the call, under the uid the next call gets (which
    it could then trace, signal and read)."""
    r = client.call(py_image, code=(
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "pid = libc.syscall(56, 0x00008000 | 17, 0, 0, 0, 0)\n"     # clone(CLONE_PARENT | SIGCHLD)
        "if pid == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '3183'])\n"
        "print('cloned' if pid > 0 else ctypes.get_errno())"))
    assert (r.exit_code, r.stdout) == (0, b"cloned\n"), r
    assert _gone_soon(b"sleep\x003183")
    left = client.call(py_image, code=(
        "import os\nfor p in filter(str.isdigit, os.listdir('/proc')):\n"
        "    s = open(f'/proc/{p}/status').read()\n"
        "    print('Z' if '\\nState:\\tZ' in s else '', end='')"))
    assert left.stdout == b"", left        # and reaped: no zombie of it stays with the zygote


CLONE_ONTO_PARENT = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "pid = libc.syscall(56, 0x00008000 | 17, 0, 0, 0, 0)\n"     # clone(CLONE_PARENT | SIGCHLD)
    "if pid == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '{secs}'])\n"
    "print('cloned' if pid > 0 else ctypes.get_errno())")


@pytest.mark.parametrize("exec_via", ["init", "helper"])
def test_a_process_a_plain_call_cloned_onto_its_parent_is_killed(daemon_factory, exec_via):
    """A plain call's parent is the call sandbox's init, or, forked by the
    helper, the daemon: what it clones onto it (CLONE_PARENT) dies with it."""
    d = daemon_factory(f'exec_via = "{exec_via}"\n[fncall]\nzygote = false\n')
    c = d.client()
    try:
        py = import_py(c)
        secs = 3190 + len(exec_via)
        r = c.call(py, argv=["sh", "-c", 'exec python3 -c "$0"', CLONE_ONTO_PARENT.format(secs=secs)])
        assert (r.exit_code, r.stdout, r.path) == (0, b"cloned\n", "exec"), r
        assert _gone_soon(f"sleep\0{secs}".encode())
    finally:
        c.close()


def test_a_left_thread_whose_leader_exited_is_killed_too(client, py_image):
    """A leader that exits its main thread alone shows as a zombie while its
    other threads run on under the call's uid: they die with the call."""
    r = client.call(py_image, code=(
        "import ctypes, os, threading, time\n"
        "libc = ctypes.CDLL(None)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    def run():\n"
        "        libc.prctl(15, b'dsecleftover', 0, 0, 0)\n"
        "        time.sleep(60)\n"
        "    threading.Thread(target=run).start()\n"
        "    time.sleep(0.3)\n"
        "    libc.syscall(60, 0)\n"                   # SYS_exit: the main thread alone
        "time.sleep(0.6)\n"
        "print('left')"))
    assert r.stdout == b"left\n", r

    def threads_left() -> int:
        n = 0
        for task in Path("/proc").glob("[0-9]*/task/*"):
            try:
                if (task / "comm").read_text() == "dsecleftover\n" and "\nState:\tZ" not in (task / "status").read_text():
                    n += 1
            except OSError:
                continue
        return n

    deadline = time.monotonic() + 10
    while threads_left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threads_left() == 0


def test_plain_calls_use_the_helper_when_execs_do(daemon_factory, busybox_rootfs):
    d = daemon_factory('exec_via = "helper"\n')     # lands in [sandbox]
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        r = c.call("busybox", argv=["sh", "-c", "echo $PPID"])
        assert r.exit_code == 0 and r.stdout == b"0\n"     # entered from outside the pid namespace
        assert c.info()["fncall"]["plain_calls_by_init"] == 0
        r = c.call("busybox", argv=PLAIN_CALL_PROBE)       # the helper's calls keep no capability either
        assert r.stdout.decode().split("\n")[0].split() == ["CapEff:", "0000000000000000"], r
        check_cannot_run(c, "busybox", "exec")
    finally:
        c.close()


def test_info_says_which_modules_the_zygote_could_not_import(daemon_factory):
    d = daemon_factory('[fncall]\nmodules = ["json", "no_such_module_here"]\n')
    c = d.client()
    try:
        import_py(c)
        assert c.call("py", code="print(1)").exit_code == 0
        box = next(b for b in c.info()["fncall"]["boxes"] if b["image"] == "py")
        assert box["modules"] == ["json"]
        assert "No module named 'no_such_module_here'" in box["modules_failed"]["no_such_module_here"]
    finally:
        c.close()


def test_a_zygote_that_did_not_start_in_time_is_tried_again(daemon_factory):
    """A zygote not ready within fncall.zygote_start_timeout_s fails that
    call with `io`, saying so; it does not leave the image without a zygote
    for good (code calls `unsupported`, as if it had no python3)."""
    d = daemon_factory("[fncall]\nzygote_start_timeout_s = 0.001\n")
    c = d.client()
    try:
        import_py(c)
        for _ in range(2):
            with pytest.raises(DsecError) as err:
                c.call("py", code="print(1)")
            assert err.value.code == "io" and "fncall.zygote_start_timeout_s" in str(err.value), err.value
        # The call sandboxes of the failed starts went with them.
        fncall_groups = d.cgroup_dirs()[0] / ".fncall"
        deadline = time.monotonic() + 10
        while [p for p in fncall_groups.iterdir() if p.is_dir()]:
            assert time.monotonic() < deadline, list(fncall_groups.iterdir())
            time.sleep(0.1)
    finally:
        c.close()


def test_a_call_the_oom_killer_took_says_so(daemon_factory):
    """A call SIGKILLed by its call sandbox's OOM killer (fncall.memory,
    shared by every call of the image) says `killed_by` "oom", as an exec
    does; one that SIGKILLs itself does not."""
    d = daemon_factory('[fncall]\nmemory = "256M"\n')
    c = d.client()
    try:
        import_py(c)
        r = c.call("py", code="b = bytearray(400 << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\n")
        assert (r.signal, r.killed_by) == (signal.SIGKILL, "oom"), r
        r = c.call("py", code="import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
        assert (r.signal, r.killed_by) == (signal.SIGKILL, None), r
        cli = d.cli("call", "--image", "py", "--", "python3", "-c", "b'x' * (400 << 20)")
        assert cli.returncode == 137 and b"memory limit" in cli.stderr, cli.stderr
    finally:
        c.close()


def test_a_recycled_zygote_lets_its_running_calls_end(daemon_factory):
    """After fncall.zygote_max_calls calls the zygote is replaced: new calls
    go to a new one, and the calls still running on the old one end as
    they would have, not with an `io` error."""
    d = daemon_factory("[fncall]\nzygote_max_calls = 10\n")
    c = d.client()
    try:
        import_py(c)

        async def run():
            async with Client(d.socket) as ac:
                return await asyncio.gather(*(ac.call("py", code=f"import time; time.sleep(0.3); print({i})")
                                              for i in range(30)), return_exceptions=True)

        results = asyncio.run(run())
        assert [r if isinstance(r, Exception) else r.stdout for r in results] == \
            [f"{i}\n".encode() for i in range(30)]
        assert c.call("py", code="print('next')").stdout == b"next\n"
        assert c.info()["fncall"]["zygotes_replaced"] >= 1
        # The recycled call sandboxes went once their calls ended: one is left.
        fncall_groups = d.cgroup_dirs()[0] / ".fncall"
        deadline = time.monotonic() + 10
        while len([p for p in fncall_groups.iterdir() if p.is_dir()]) != 1:
            assert time.monotonic() < deadline, list(fncall_groups.iterdir())
            time.sleep(0.1)
    finally:
        c.close()


def _numbered_images(d, c, busybox_rootfs: str, tmp_path, n: int) -> list[str]:
    """n images bb-0... on busybox, each a call sandbox of its own."""
    c.import_image(busybox_rootfs, "busybox")
    for i in range(n):
        (tmp_path / "Dockerfile").write_text(f"FROM busybox\nRUN echo {i} > /n\n")
        r = d.cli("image", "build", "-f", str(tmp_path / "Dockerfile"), str(tmp_path), "--name", f"bb-{i}")
        assert r.returncode == 0, r.stderr
    return [f"bb-{i}" for i in range(n)]


def _box_images(c) -> list[str]:
    return sorted(b["image"].split(":")[0].rsplit("/", 1)[-1] for b in c.info()["fncall"]["boxes"])


def test_a_call_to_an_image_that_is_not_there_drops_no_call_sandbox(daemon_factory, busybox_rootfs):
    """At fncall.max_boxes, a call naming no image made room first (dropped
    the idle box used least recently), then failed: any client could churn
    every warm zygote with made-up names."""
    d = daemon_factory("[fncall]\nmax_boxes = 1\n")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        assert c.call("busybox", argv=["true"]).exit_code == 0
        boxes = [b["id"] for b in c.info()["fncall"]["boxes"]]
        with pytest.raises(NotFound):
            c.call("no-such-image", argv=["true"])
        assert [b["id"] for b in c.info()["fncall"]["boxes"]] == boxes
    finally:
        c.close()


def test_past_fncall_max_boxes_the_least_recently_used_idle_call_sandbox_goes(daemon_factory, busybox_rootfs,
                                                                              tmp_path):
    """Each image called keeps a call sandbox (its zygote, layers, id
    range): at most fncall.max_boxes; the idle one used least recently
    makes room, and with calls running in every one a call to another
    image is `busy`."""
    d = daemon_factory("[fncall]\nmax_boxes = 2\n")
    c = d.client()
    try:
        a, b, other = _numbered_images(d, c, busybox_rootfs, tmp_path, 3)
        for image in (a, b, a, other):
            r = c.call(image, argv=["cat", "/n"])
            assert (r.exit_code, r.stdout) == (0, f"{image[-1]}\n".encode()), r
        assert _box_images(c) == [a, other]

        async def hold_both_then_call_b():
            async with Client(d.socket) as ac:
                held = [asyncio.ensure_future(ac.call(image, argv=["sleep", "60"], timeout=60)) for image in (a, other)]
                try:
                    while sorted(x["running"] for x in (await ac.info())["fncall"]["boxes"]) != [1, 1]:
                        await asyncio.sleep(0.05)
                    with pytest.raises(DsecError) as err:
                        await ac.call(b, argv=["true"])
                    return err.value
                finally:
                    for t in held:
                        t.cancel()
                    await asyncio.gather(*held, return_exceptions=True)

        err = asyncio.run(hold_both_then_call_b())
        assert err.code == "busy" and "fncall.max_boxes" in str(err), err
        # The held calls end once their cancels reach the daemon: busy until then, as it says.
        deadline = time.monotonic() + 20
        while True:
            try:
                r = c.call(b, argv=["cat", "/n"])
                break
            except Busy:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert r.stdout == b"1\n"
        assert len(_box_images(c)) <= 2
    finally:
        c.close()


def test_a_call_sandbox_no_call_used_for_fncall_idle_ttl_s_goes(daemon_factory, busybox_rootfs, tmp_path):
    d = daemon_factory("[fncall]\nidle_ttl_s = 0.5\n")
    c = d.client()
    try:
        (image,) = _numbered_images(d, c, busybox_rootfs, tmp_path, 1)
        assert c.call(image, argv=["cat", "/n"]).stdout == b"0\n"
        fncall_groups = d.cgroup_dirs()[0] / ".fncall"
        deadline = time.monotonic() + 20
        while c.info()["fncall"]["boxes"] or [p for p in fncall_groups.iterdir() if p.is_dir()]:
            assert time.monotonic() < deadline, (c.info()["fncall"], list(fncall_groups.iterdir()))
            time.sleep(0.1)
        assert c.call(image, argv=["cat", "/n"]).stdout == b"0\n"      # a new one
    finally:
        c.close()


def test_calls_that_keep_the_cpu_busy_do_not_starve_the_zygote(daemon_factory):
    """Calls share their call sandbox's CPU with the zygote, which forks
    their workers and relays their kills: beside a call that keeps 30
    processes busy, calls killed at once (a tiny timeout) still end within
    fncall.kill_grace_s, and the zygote is not taken for unresponsive."""
    d = daemon_factory("[fncall]\nspares = 0\n")
    c = d.client()
    try:
        import_py(c)
        assert c.call("py", code="import os; print(os.nice(0))").stdout == b"19\n"
        spin = ("import os\n"
                "for _ in range(30):\n"
                "    if os.fork() == 0:\n"
                "        break\n"
                "while True:\n"
                "    pass\n")

        async def run():
            async with Client(d.socket) as ac:
                hog = asyncio.ensure_future(ac.call("py", code=spin, timeout=10))
                await asyncio.sleep(1)
                killed = []
                for _ in range(2):
                    killed += await asyncio.gather(*(ac.call("py", code="import time; time.sleep(5)", timeout=0.001)
                                                     for _ in range(30)), return_exceptions=True)
                return await hog, killed

        hog, killed = asyncio.run(run())
        assert hog.timed_out
        assert [k if isinstance(k, Exception) else k.timed_out for k in killed] == [True] * 60
        assert c.info()["fncall"]["zygotes_replaced"] == 0
    finally:
        c.close()


def test_a_call_past_every_uid_is_busy_on_either_route(daemon_factory, busybox_rootfs):
    """More calls at once than fncall.uid_count: `busy` with a retry hint,
    through the zygote as for plain calls."""
    d = daemon_factory("[fncall]\nuid_count = 2\nspares = 1\n")
    c = d.client()
    try:
        import_py(c)
        c.import_image(busybox_rootfs, "busybox")

        async def run(image):
            async with Client(d.socket) as ac:
                return await asyncio.gather(*(ac.call(image, argv=["sleep", "1"]) for _ in range(3)),
                                            return_exceptions=True)

        for image in ("py", "busybox"):
            out = asyncio.run(run(image))
            busy = [e for e in out if isinstance(e, DsecError)]
            assert len(busy) == 1 and busy[0].code == "busy" and busy[0].detail["retry_after_s"] > 0, (image, out)
            assert "uid" in str(busy[0]), busy
    finally:
        c.close()


def test_a_call_holding_every_pid_does_not_kill_the_zygote(daemon_factory):
    """A call that keeps its call sandbox at fncall.pids leaves the zygote no
    pid for a spare: the zygote tries again later (a call meanwhile may fail
    to get a worker, and says why), the call times out as any other, and
    the zygote stays."""
    d = daemon_factory("[fncall]\npids = 64\nspares = 2\n")
    c = d.client()
    try:
        import_py(c)
        assert c.call("py", code="print(1)").exit_code == 0
        hog = ("import os, time\n"
               "while True:\n"
               "    try:\n"
               "        if os.fork() == 0:\n"
               "            time.sleep(60)\n"
               "            os._exit(0)\n"
               "    except OSError:\n"
               "        time.sleep(0.001)\n")

        async def run():
            async with Client(d.socket) as ac:
                held = asyncio.ensure_future(ac.call("py", code=hog, timeout=4))
                await asyncio.sleep(1.5)
                beside = []
                for _ in range(4):            # each takes a spare or needs a fork
                    try:
                        beside.append((await ac.call("py", code="print(2)", timeout=10)).stdout)
                    except DsecError as err:
                        beside.append(str(err))
                return await held, beside

        held, beside = asyncio.run(run())
        assert held.timed_out, held
        for b in beside:
            assert b == b"2\n" or "fncall.pids" in b, beside
        assert c.info()["fncall"]["zygotes_replaced"] == 0
        assert c.call("py", code="print(3)").stdout == b"3\n"
    finally:
        c.close()


def test_plain_argv_calls_work_on_any_image(client, py_image):
    r = client.call("busybox", argv=["sh", "-c", "pwd; id -u; touch f; ls; echo $TMPDIR"])
    assert r.exit_code == 0 and r.path == "exec"
    pwd, uid, ls, tmpdir = r.stdout.decode().split()
    assert pwd.startswith("/tmp/call-") and int(uid) >= 60000 and ls == "f" and tmpdir == pwd
    # Its dir goes behind the answer: until then, another call's uid cannot read it.
    deadline = time.monotonic() + 10
    while True:
        again = client.call("busybox", argv=["sh", "-c", f"ls {pwd} 2>&1"])
        if b"No such file" in again.stdout:
            break
        assert b"Permission denied" in again.stdout, again.stdout
        assert time.monotonic() < deadline, "a plain call's private dir is still there 10 s after it"
        time.sleep(0.05)
    with pytest.raises(Unsupported):
        client.call("busybox", code="print(1)")
    with pytest.raises(BadRequest):
        client.call("busybox", argv=["true"], code="print(1)")


def test_cli_call(daemon, py_image, tmp_path):
    r = daemon.cli("call", "--image", py_image, "--", "python3", "-c", "print(sum(range(10)))")
    assert (r.returncode, r.stdout) == (0, b"45\n"), r.stderr
    code = tmp_path / "judge.py"
    code.write_text("import sys\nn = int(sys.stdin.read())\nprint(n * n)\nsys.exit(n % 5)\n")
    inp = tmp_path / "input.txt"
    inp.write_text("12")
    r = daemon.cli("call", "--image", py_image, "--code-file", str(code), "--stdin", str(inp), "--timeout", "5")
    assert (r.returncode, r.stdout) == (2, b"144\n"), r.stderr
    # '-': dsec's own stdin, as `dsec cp - SB:/path` reads it.
    r = daemon.cli("call", "--image", "busybox", "--stdin", "-", "--", "wc", "-c", input=b"12345")
    assert (r.returncode, r.stdout.strip()) == (0, b"5"), r.stderr


DEEP_TREE = ("import os\nos.mkdir({top!r}, 0o777)\nos.chdir({top!r})\n"
             "for _ in range(3000):\n    os.mkdir('d', 0o777)\n    os.chdir('d')\nprint('deep')")


@pytest.mark.parametrize("route", ["zygote", "exec"])
def test_a_deep_tree_a_call_leaves_in_its_dir_costs_no_uid(daemon_factory, busybox_rootfs, route):
    """A call's own dir is removed after it at any depth (shutil.rmtree
    recurses, and stops at ~1,000 levels): with 2 uids, calls that each
    leave a tree 3,000 deep would run out of uids by the third, through
    the zygote or as plain calls (an image without python3)."""
    d = daemon_factory("[fncall]\nuid_count = 2\nspares = 1\n")
    c = d.client()
    try:
        if route == "zygote":
            py = import_py(c)
        else:
            c.import_image(busybox_rootfs, "busybox")
        for i in range(6):
            if route == "zygote":
                r = c.call(py, code=DEEP_TREE.format(top="deep"))
            else:
                r = c.call("busybox", argv=["sh", "-c", "mkdir deep && cd deep && i=0 && while [ $i -lt 1500 ]; "
                                            "do mkdir d && cd d && i=$((i+1)) || exit 1; done && echo deep"])
            assert (r.exit_code, r.stdout, r.path) == (0, b"deep\n", route), (i, r)
        if route == "exec":         # every call's dir went before its uid came back
            time.sleep(0.5)
            box = next(b for b in c.info()["fncall"]["boxes"] if b["image"] == "busybox")
            pid = next(p for top in d.cgroup_dirs() for f in top.rglob("cgroup.procs") if box["id"] in str(f)
                       for p in f.read_text().split())
            assert [n for n in os.listdir(f"/proc/{pid}/root/tmp") if n.startswith("call-")] == []
    finally:
        c.close()
