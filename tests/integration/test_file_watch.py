"""file_watch from the SDK and the CLI: changes made inside a sandbox arrive
as events, recursive watches follow new directories and never symlinks, the
watch ends when its directory or sandbox goes, caps are `limit`, and no fd
is left behind.

Each test runs on both backends: a container per test, and one microVM the
module's tests share (its /work emptied before each), since a VM under TCG
takes seconds to start; a VM's watch runs in its guest."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time

import pytest
from conftest import sandbox_on, shared_vm, skip_unless_microvm

from dsecd.errors import BadRequest, DsecError, LimitExceeded

# Its VMs start from the run's templates (conftest.VM_TEMPLATES): none of its tests is about how one is built.
pytestmark = pytest.mark.shared_vm_templates

BACKENDS = ("container", "microvm")
VM = {"memory": "256M", "net": "none", "disk": "64M"}


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def vm(daemon):
    yield from shared_vm(daemon)


@pytest.fixture
def sandbox(request, backend, client):
    yield from sandbox_on(backend, request, client, "rm -rf /work /outside && mkdir /work")


def _create(c, backend: str, memory: str = "64M"):
    if backend == "microvm":
        skip_unless_microvm(c, close=False)
        return c.create(image="busybox", backend="microvm", **VM)
    return c.create(image="busybox", memory=memory)


class Watcher:
    """A SyncSandbox.watch drained by a thread into a queue (errors too)."""

    def __init__(self, sb, path: str, recursive: bool = False):
        self.q: queue.Queue = queue.Queue()
        self.gen = sb.watch(path, recursive)
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()
        self.ready = self.next()
        assert self.ready["kind"] == "ready", self.ready

    def _drain(self) -> None:
        try:
            for ev in self.gen:
                self.q.put(ev)
        except Exception as err:
            self.q.put(err)

    def next(self, timeout: float = 10) -> dict:
        item = self.q.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        return item

    def until(self, pred, timeout: float = 10) -> list[dict]:
        """Events up to and including the first for which pred is true."""
        out, deadline = [], time.monotonic() + timeout
        while True:
            ev = self.next(max(0.01, deadline - time.monotonic()))
            out.append(ev)
            if pred(ev):
                return out

    def quiet(self, seconds: float = 0.5) -> list[dict]:
        out = []
        try:
            while True:
                out.append(self.next(seconds))
        except queue.Empty:
            return out


def pairs(events):
    return [(e["kind"], e["path"]) for e in events]


def test_create_modify_delete_rename(sandbox):
    sandbox.mkdir("/work/w")
    w = Watcher(sandbox, "/work/w")
    sandbox.exec(["sh", "-c", "echo a > /work/w/f && chmod 600 /work/w/f && mv /work/w/f /work/w/g "
                              "&& rm /work/w/g && mkdir /work/w/sub && touch /work/w/sub/not-seen"])
    got = w.until(lambda e: e["kind"] == "create" and e["path"] == "/work/w/sub")
    assert pairs(got) == [("create", "/work/w/f"), ("modify", "/work/w/f"), ("attrib", "/work/w/f"),
                          ("move_from", "/work/w/f"), ("move_to", "/work/w/g"), ("delete", "/work/w/g"),
                          ("create", "/work/w/sub")]
    assert got[3]["cookie"] == got[4]["cookie"] and got[-1]["is_dir"] is True
    assert w.quiet() == []                     # not recursive: nothing from inside sub
    sandbox.write_file("/work/w/host.txt", b"from the host", atomic=False)      # in place: create, modify
    assert ("create", "/work/w/host.txt") in pairs(w.until(lambda e: e["kind"] == "modify"))
    sandbox.write_file("/work/w/host.txt", b"again")           # atomic: a temporary renamed over it
    assert ("move_to", "/work/w/host.txt") in pairs(w.until(lambda e: e["kind"] == "move_to"))
    w.gen.close()


def test_recursive_follows_new_directories_not_symlinks(sandbox):
    sandbox.exec(["sh", "-c", "mkdir -p /work/r/old /outside && ln -s /outside /work/r/link"])
    w = Watcher(sandbox, "/work/r", recursive=True)
    assert w.ready["dirs"] == 2                # r and old; the link is not entered
    sandbox.exec(["sh", "-c", "touch /work/r/old/a /outside/secret && mkdir -p /work/r/n/m "
                              "&& echo x > /work/r/n/m/deep"])
    got = w.until(lambda e: e["path"] == "/work/r/n/m/deep" and e["kind"] in ("modify", "create")
                  and e.get("scanned", e["kind"] == "modify"))
    paths = {e["path"] for e in got} | {e["path"] for e in w.quiet()}
    assert {"/work/r/old/a", "/work/r/n", "/work/r/n/m", "/work/r/n/m/deep"} <= paths
    assert not any("secret" in p or p.startswith("/work/r/link/") for p in paths)
    sandbox.exec(["sh", "-c", "echo later > /work/r/n/m/later"])
    assert ("create", "/work/r/n/m/later") in pairs(w.until(lambda e: e["path"].endswith("later")))
    w.gen.close()


def test_watch_stops_when_its_directory_or_sandbox_goes(client, sandbox, backend):
    sandbox.mkdir("/work/gone")
    w = Watcher(sandbox, "/work/gone")
    sandbox.exec(["rmdir", "/work/gone"])
    last = w.until(lambda e: e["kind"] == "stopped")[-1]
    assert last["reason"] == "deleted"
    other = _create(client, backend)
    other.mkdir("/work/x")
    w2 = Watcher(other, "/work/x", recursive=True)
    other.destroy(force=True)
    assert w2.until(lambda e: e["kind"] == "stopped")[-1]["reason"] == "sandbox destroyed"


def test_a_watch_of_tmp_says_its_sandbox_was_destroyed(client, backend):
    """/tmp is a mount of its own, taken down by the destroy before the
    sandbox's `destroyed` event: its watch said "unmounted", as if
    something had unmounted /tmp, where /work's says "sandbox destroyed"."""
    sb = _create(client, backend)
    w = Watcher(sb, "/tmp")
    sb.destroy(force=True)
    assert w.until(lambda e: e["kind"] == "stopped")[-1]["reason"] == "sandbox destroyed"


def test_vm_watch_stops_when_the_guest_dies(client):
    skip_unless_microvm(client, close=False)
    sb = _create(client, "microvm")
    try:
        sb.mkdir("/work/p")
        w = Watcher(sb, "/work/p", recursive=True)
        with pytest.raises(DsecError):
            sb.exec(["sh", "-c", "echo c > /proc/sysrq-trigger; sleep 30"], timeout=60)
        assert w.until(lambda e: e["kind"] == "stopped", timeout=60)[-1]["reason"] == "sandbox died"
    finally:
        sb.destroy(force=True)


def test_a_vm_watch_ends_at_a_pause_and_the_vm_serves_on(vm):
    """A pause ends a VM's agent channel. A watch held open across it heard
    nothing more, and failed only 30 s later; its child, left in the saved
    guest, held an exec id the resumed VM's new channel then reused, and an
    exec failed "File exists (guest agent, at exec id in use)". The pause now
    ends the watch at once with a `conflict` saying so, and the VM serves on."""
    vm.exec(["sh", "-c", "rm -rf /work && mkdir -p /work/pz"])
    w = Watcher(vm, "/work/pz", recursive=True)
    vm.pause()
    with pytest.raises(DsecError) as err:
        w.until(lambda e: False, timeout=10)
    assert err.value.code == "conflict" and "paused" in err.value.message, err.value
    for _ in range(8):
        assert vm.exec(["true"]).exit_code == 0
    w2 = Watcher(vm, "/work/pz")
    vm.exec(["touch", "/work/pz/f"])
    assert ("create", "/work/pz/f") in pairs(w2.until(lambda e: e["kind"] == "create"))
    w2.gen.close()


def test_refusals(sandbox):
    sandbox.write_file("/work/file", b"x")
    with pytest.raises(Exception, match="not a directory|Not a directory"):
        next(sandbox.watch("/work/file"))
    with pytest.raises(BadRequest, match="kernel interface") as err:
        next(sandbox.watch("/proc"))
    # Which request and sandbox, as a file request's refusal says it.
    assert err.value.message.startswith(f"watch {sandbox.id}:/proc: "), err.value
    with pytest.raises(BadRequest, match="absolute") as err:
        next(sandbox.watch("work"))
    assert err.value.message.startswith(f"watch {sandbox.id}:work: "), err.value


def test_directory_cap_is_a_limit(daemon_factory, busybox_rootfs, backend):
    d = daemon_factory("[limits]\nmax_watch_dirs = 4\nmax_watches = 2\n", shared_vm_templates=backend == "microvm")
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        sb = _create(c, backend)
        sb.exec(["mkdir", "-p", "/work/big/a", "/work/big/b", "/work/big/c", "/work/big/d"])
        with pytest.raises(LimitExceeded, match="max_watch_dirs"):
            next(sb.watch("/work/big", recursive=True))
        sb.exec(["mkdir", "-p", "/work/small/a"])
        w = Watcher(sb, "/work/small", recursive=True)
        sb.exec(["mkdir", "-p", "/work/small/b/c/d"])       # 2 + 3 directories: past the cap
        with pytest.raises(LimitExceeded, match="max_watch_dirs"):
            w.until(lambda e: False)
        w1, w2 = Watcher(sb, "/work/small"), Watcher(sb, "/work/small")
        with pytest.raises(LimitExceeded, match="max_watches"):
            next(sb.watch("/work/small"))
        w1.gen.close()
        w2.gen.close()
    finally:
        c.close()


def guest_procs(sb) -> int:
    """How many processes in the sandbox run PID 1's program (in a VM the
    guest agent's forks: its watch children among them)."""
    return int(sb.exec(["sh", "-c", "n=0; for p in /proc/[0-9]*; do cmp -s $p/cmdline /proc/1/cmdline "
                                    "&& n=$((n+1)); done; echo $n"]).stdout)


def test_no_fd_is_left_behind(daemon, sandbox):
    sandbox.exec(["mkdir", "-p", "/work/fd/a/b"])
    procs = guest_procs(sandbox)
    Watcher(sandbox, "/work/fd", recursive=True).gen.close()      # warm up (worker threads, caches)
    time.sleep(0.3)
    before = daemon.open_fds()
    for _ in range(5):
        w = Watcher(sandbox, "/work/fd", recursive=True)
        sandbox.exec(["mkdir", "-p", "/work/fd/a/b/c"])
        w.until(lambda e: e["path"] == "/work/fd/a/b/c")
        w.gen.close()
        sandbox.exec(["rmdir", "/work/fd/a/b/c"])
    time.sleep(0.3)
    assert daemon.open_fds() == before
    deadline = time.monotonic() + 10          # a VM's watch children die with their requests, soon
    while guest_procs(sandbox) != procs and time.monotonic() < deadline:
        time.sleep(0.2)
    assert guest_procs(sandbox) == procs


def test_cli_watch(daemon, sandbox):
    sandbox.mkdir("/work/cli")
    p = subprocess.Popen([str(daemon_bin()), "--socket", daemon.socket, "watch", f"{sandbox.id}:/work/cli", "-r",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert json.loads(p.stdout.readline())["kind"] == "ready"
        sandbox.exec(["mkdir", "/work/cli/d"])
        assert json.loads(p.stdout.readline()) == {"kind": "create", "path": "/work/cli/d", "is_dir": True}
        sandbox.exec(["rmdir", "/work/cli/d", "/work/cli"])
        lines = [json.loads(x) for x in p.stdout.read().splitlines()]
        assert lines[-1]["kind"] == "stopped" and p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def daemon_bin():
    import sys
    from pathlib import Path

    return Path(sys.executable).parent / "dsec"


def test_a_name_that_is_not_utf8_is_watched_as_its_bytes(daemon, sandbox, backend):
    """Such a name made the watch's events unsendable, and `dsec watch
    --json` a traceback; they come as list_files gives names."""
    if backend != "container":
        pytest.skip("the names of a container's files")
    sandbox.mkdir("/work/odd")
    w = Watcher(sandbox, "/work/odd")
    p = subprocess.Popen([str(daemon_bin()), "--socket", daemon.socket, "watch", f"{sandbox.id}:/work/odd",
                          "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t = subprocess.Popen([str(daemon_bin()), "--socket", daemon.socket, "watch", f"{sandbox.id}:/work/odd"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert json.loads(p.stdout.readline())["kind"] == "ready"
        deadline = time.monotonic() + 10
        while b"watching" not in t.stderr.readline():
            assert time.monotonic() < deadline
        sandbox.exec(["sh", "-c", 'touch "/work/odd/$(printf "\\377x")"'])
        name = "/work/odd/" + b"\xffx".decode(errors="surrogateescape")
        assert ("create", name) in pairs(w.until(lambda e: e["kind"] == "create"))
        assert json.loads(p.stdout.readline()) == {"kind": "create", "path": name, "is_dir": False}
        assert t.stdout.readline() == b"create    /work/odd/\xffx\n"
    finally:
        w.gen.close()
        for proc in (p, t):
            proc.kill()
            proc.wait()
