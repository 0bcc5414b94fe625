"""Integration tier: root, the real kernel, a real daemon per test module.

Each daemon gets its own socket, state dir and cgroup subtree
(`dsecd-test-<random>` in every hierarchy); finalizers destroy its sandboxes,
stop it, and remove the subtree and the temp dirs even when a test fails.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dsecd.config import with_setting

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "integration tests need root (namespaces, cgroups, mounts)"
    if not Path("/bin/busybox").exists():
        return "busybox-static is not installed (scripts/setup.sh installs it)"
    try:
        from dsecd import native  # noqa: F401
    except ImportError as err:
        return f"dsecd._native is not built ({err}); run scripts/setup.sh"
    return None


def pytest_configure(config):
    # `timeout` and job runners stop a run with SIGTERM, which would end
    # pytest without its teardowns and leave the run's daemons, VMs, mounts
    # and cgroups behind. As KeyboardInterrupt, pytest tears fixtures down.
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    reason = _skip_reason()
    if reason:
        for item in items:
            if "integration" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed while a daemon of the run had died on its own (not
    stopped by a test): that daemon's exit status and the end of its log go
    in the report, since its dir (and log) is removed at its cleanup."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for d in list(Daemon.running):
            if d.proc is not None and d.proc.poll() is not None and not d.stopped:
                report.sections.append((f"dsecd {d.proc.pid} exited {d.proc.returncode}",
                                        d.log.read_text(errors="replace")[-6000:]))
                Daemon.running.discard(d)


@pytest.fixture(scope="session")
def busybox_rootfs() -> str:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "mkrootfs.sh")], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


# One cache of compiled BPF objects for every daemon of the run. A daemon on a
# fresh state dir compiles its two objects in the background at start (2-4 s
# of clang each on this host) and its stop waits for them: per test, that was
# most of a daemon's cost. Objects are named by a hash of their source and
# defines and written by rename, so daemons share the directory safely.
BPF_CACHE = Path(tempfile.mkdtemp(prefix="dsecd-test-bpf-"))
atexit.register(shutil.rmtree, BPF_CACHE, True)


# One store of microVM templates for the daemons that opt in (shared_vm_templates):
# a daemon's first VM of a shape boots a guest (6-10 s of a core under TCG)
# and snapshots it; a template found in the state dir at start is loaded
# instead (a restarted daemon's way), well under a second. The key hashes
# everything a restore must match (QEMU's command line with per-VM paths as
# placeholders, the layers' digests, the guest build, the QEMU binary), so a
# template is valid for any daemon of this run that makes the same shape.
# Files are hard-linked, not copied (a template's RAM holds ~70 MiB of data):
# dsecd never writes a template file in place (a build writes a new directory
# and renames it over; a drop or gc unlinks), so a link is as good as a copy,
# and each state dir's directory entries stay its own.
VM_TEMPLATES = Path(tempfile.mkdtemp(prefix="dsecd-test-vm-templates-"))
atexit.register(shutil.rmtree, VM_TEMPLATES, True)
VM_TEMPLATES_DIR = "vm-templates"       # dsecd.backends.microvm.templates.DIR_NAME


def _published_templates(root: Path) -> list[Path]:
    """The complete templates under root (published by rename; a .tmp- one is half-written)."""
    if not root.is_dir():
        return []
    return [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
            and (d / "meta.json").is_file()]


def _link_template(src: Path, dst_root: Path) -> None:
    """src (a template dir) into dst_root under its key: its files linked
    into a new directory, published by rename."""
    tmp = dst_root / f".link-{src.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    try:
        for f in src.iterdir():
            os.link(f, tmp / f.name)
        os.rename(tmp, dst_root / src.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _test_config(extra: str) -> str:
    """A test's config with the run's BPF cache, and the microVM guest of
    $DSECD_GUEST_DIR when that is set (scripts/setup.sh built this checkout's
    guest there); either left as the test's own where it sets it."""
    extra = with_setting(extra, "net", "bpf_cache_dir", str(BPF_CACHE))
    return with_setting(extra, "microvm", "guest_dir", os.environ.get("DSECD_GUEST_DIR"))


class Daemon:
    """A dsecd process on a private socket/state dir/cgroup subtree."""

    running: set[Daemon] = set()      # started and not cleaned up (pytest_runtest_makereport)

    def __init__(self, tmp: Path, extra_config: str = "", wrap: list[str] | None = None,
                 log_level: str = "debug", shared_vm_templates: bool = False):
        """wrap: words the daemon's command line goes after (fleet_kit runs
        it in a network namespace with `nsenter --net=...`); log_level:
        "info" for a bench, whose thousands of creates would log megabytes;
        shared_vm_templates: start with the run's VM templates (VM_TEMPLATES)
        and add its own to them at cleanup, for tests that want VMs and do
        not look at how a template is built."""
        self.tmp = tmp
        self.shared_vm_templates = shared_vm_templates
        self.socket = str(tmp / "dsecd.sock")
        self.state = tmp / "state"
        self.cgroup_root = f"dsecd-test-{secrets.token_hex(4)}"
        # A bridge of its own, unless the test names one: a daemon without
        # net.host_netns makes its bridge in the host's namespace, where the
        # default dsec0 would be shared with any other daemon and outlive it.
        self.bridge = f"dsect-{secrets.token_hex(4)}"
        self.config = tmp / "dsecd.toml"
        # The test's own [daemon] or [sandbox] keys go in the same tables;
        # keys before any table are [sandbox] keys.
        first = next((line.strip() for line in extra_config.splitlines()
                      if line.strip() and not line.lstrip().startswith("#")), "[")
        text = _test_config(extra_config if first.startswith("[") else "[sandbox]\n" + extra_config)
        for section, key, value in (("daemon", "log_level", log_level), ("daemon", "state_dir", str(self.state)),
                                    ("daemon", "socket", self.socket), ("sandbox", "cgroup_root", self.cgroup_root),
                                    ("net", "bridge", self.bridge)):
            text = with_setting(text, section, key, value)
        # Host ids of their own, unless the test names a base: test daemons
        # alive at once would otherwise give their first sandboxes the same
        # host ids, and a test that looks for a sandbox's processes by uid
        # could find another daemon's.
        if not re.search(r"^\s*userns_base\s*=", text, re.M):
            base = 1_000_000_000 + 65536 * secrets.randbelow(30_000)
            text = text.replace("[sandbox]\n", f"[sandbox]\nuserns_base = {base}\n", 1)
        self.config.write_text(text)
        self.log = tmp / "dsecd.log"
        self.proc: subprocess.Popen | None = None
        # How a test may start it differently: a command in front (setpriv,
        # nsenter), its environment (NOTIFY_SOCKET), a function run in the child (a cgroup).
        self.wrapper: list[str] = list(wrap or [])
        self.env: dict | None = None
        self.preexec = None
        self._settled: int | None = None     # the pid of the daemon open_fds() waited for
        self.stopped = False                 # by a test (stop), not on its own

    def start(self, timeout: float = 20.0) -> None:
        if self.shared_vm_templates and not self.state.exists():
            self._seed_vm_templates()
        logf = open(self.log, "ab")
        # A crash in native code (a fault, an abort) leaves the Python
        # tracebacks of every thread in the log, not only an exit status.
        env = {**(os.environ if self.env is None else self.env), "PYTHONFAULTHANDLER": "1"}
        self.proc = subprocess.Popen([*self.wrapper, str(VENV_BIN / "dsecd"), "--config", str(self.config)],
                                     stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, env=env,
                                     preexec_fn=self.preexec)
        logf.close()
        self.stopped = False
        Daemon.running.add(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsecd exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if os.path.exists(self.socket):
                try:
                    self.client(connect_timeout=5).close()     # a socket nobody serves must not hang the test
                    return
                except (ConnectionError, OSError):
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"dsecd did not start in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def _seed_vm_templates(self) -> None:
        """Before the first start: the run's templates in the state dir."""
        own = self.state / VM_TEMPLATES_DIR
        own.mkdir(mode=0o700, parents=True)
        os.chmod(self.state, 0o700)
        for t in _published_templates(VM_TEMPLATES):
            _link_template(t, own)

    def _keep_vm_templates(self) -> None:
        """At cleanup (stopped): the templates this daemon built, into the run's store."""
        known = {t.name for t in _published_templates(VM_TEMPLATES)}
        for t in _published_templates(self.state / VM_TEMPLATES_DIR):
            if t.name not in known:
                _link_template(t, VM_TEMPLATES)

    def settle(self, timeout: float = 120.0) -> None:
        """Wait for the daemon's start-up work in the background (BPF load,
        network, netns pool: `info` net.starting). The fds it opens are kept,
        not leaked: a test that counts the daemon's fds waits for it first."""
        c = self.client()
        try:
            deadline = time.monotonic() + timeout
            while starting := c.info()["net"].get("starting"):
                if time.monotonic() > deadline:
                    raise AssertionError(f"dsecd was still {', '.join(starting)} after {timeout:.0f} s; "
                                         f"see {self.log}")
                time.sleep(0.1)
        finally:
            c.close()

    def open_fds(self) -> int:
        """How many fds the daemon holds, once its start-up work is done, but
        for its subtree roots: the CPU sampler opens one per hierarchy at its
        first pass with a sandbox, and holds it for the daemon's life."""
        if self._settled != self.proc.pid:
            self.settle()
            self._settled = self.proc.pid
            time.sleep(0.3)          # for the daemon to close its end of settle()'s connection
        roots = {str(d) for d in self.cgroup_dirs()}
        fd_dir = f"/proc/{self.proc.pid}/fd"
        held = []
        for fd in os.listdir(fd_dir):
            try:
                held.append(os.readlink(f"{fd_dir}/{fd}"))
            except FileNotFoundError:         # closed meanwhile
                pass
        return sum(1 for target in held if target not in roots)

    def client(self, connect_timeout: float = 30.0):
        from dsecd import SyncClient

        c = SyncClient(self.socket, connect_timeout=connect_timeout)
        try:
            c.connect()
        except BaseException:
            c.close()               # its loop's thread, or each try of start() would leave one
            self.raise_if_gone()
            raise
        return c

    def raise_if_gone(self) -> None:
        """A daemon that exited on its own: how, and the end of its log
        (removed at cleanup, and the only account of what happened)."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"dsecd (pid {self.proc.pid}) exited {self.proc.returncode}; "
                               f"the end of its log:\n{self.log.read_text(errors='replace')[-6000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.stopped = True
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cli(self, *args, input: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(VENV_BIN / "dsec"), "--socket", self.socket, *args], input=input,
                              capture_output=True, timeout=timeout)

    def cgroup_dirs(self) -> list[Path]:
        from dsecd import cgroup

        return [mnt / self.cgroup_root for mnt in cgroup.detect_layout().hierarchies().values()]

    def cleanup(self) -> None:
        """Destroy every sandbox this daemon made, stop it, remove its cgroups and dirs."""
        try:
            if self.proc and self.proc.poll() is None:
                c = self.client()
                c.destroy_all(force=True)
                c.close()
        except Exception as err:   # keep cleaning up; report below
            print(f"cleanup: destroy_all failed: {err}", file=sys.stderr)
        self.stop()
        Daemon.running.discard(self)
        _swap_off_left_on(self.tmp, self.state)
        if self.shared_vm_templates:
            try:
                self._keep_vm_templates()
            except Exception as err:   # only a later daemon's boot is lost; clean up on
                print(f"cleanup: keeping the VM templates of {self.state}: {err}", file=sys.stderr)
        _kill_and_remove_cgroups(self.cgroup_dirs())
        _unmount_below(self.tmp)
        shutil.rmtree(self.tmp, ignore_errors=True)
        # Made in this namespace when the test gave no net.host_netns (else
        # they went with the test's own namespace); none there: nothing to do.
        # The nftables table stays after a stop with networked sandboxes alive,
        # or a kill -9.
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        try:
            from dsecd.net.nat import delete_table

            delete_table(None, self.bridge)
        except Exception as err:   # keep cleaning up; report below
            print(f"cleanup: delete the nftables table of bridge {self.bridge}: {err}", file=sys.stderr)


def _swap_off_left_on(top: Path, state: Path) -> None:
    """Take down the swap a daemon under `top` left on: a stop leaves its
    swap file and zram device on while sandboxes live (for the next daemon),
    which a failed test's daemon, or one killed, may have done."""
    from dsecd import native
    from dsecd.mem.zram import ZramConfig, ZramSwap

    with open("/proc/swaps") as f:
        areas = [line.split()[0].replace("\\040", " ") for line in f.readlines()[1:]]
    for area in areas:
        if area.startswith(str(top) + "/"):
            try:
                native.swapoff(area)
            except OSError as err:
                print(f"cleanup: swapoff {area}: {err}", file=sys.stderr)
    try:
        rec = json.loads((state / "zram.json").read_text())
        device = rec["device"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    from dsecd.engine.memory import boot_id

    zram = ZramSwap(ZramConfig(), owner=str(state))
    try:
        if zram.adopt(device):          # still ours: swap, with dsecd's label naming this state dir
            zram.teardown()
        elif rec.get("boot_id") == boot_id():
            zram.remove_leftover(device)    # a daemon killed while making it: not swap yet
    except OSError as err:
        print(f"cleanup: zram{device}: {err}", file=sys.stderr)


def _unmount_below(top: Path) -> None:
    """Lazily unmount whatever a failed test left mounted under its temp dir
    (layer mounts of a daemon killed with sandboxes still running)."""
    from dsecd import native

    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(str(top) + "/")), key=len, reverse=True):
        try:
            native.umount(point, detach=True)
        except OSError as err:
            print(f"cleanup: umount {point}: {err}", file=sys.stderr)


def _kill_and_remove_cgroups(dirs: list[Path]) -> None:
    """Last resort for a failed test: SIGKILL what is left in OUR subtree, rmdir it."""
    for _ in range(200):
        left = False
        for top in dirs:
            if not top.exists():
                continue
            for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
                try:
                    for pid in Path(dirpath, "cgroup.procs").read_text().split():
                        os.kill(int(pid), signal.SIGKILL)
                except (FileNotFoundError, ProcessLookupError):
                    pass
                try:
                    os.rmdir(dirpath)
                except OSError:
                    left = True
        if not left:
            return
        time.sleep(0.05)


@pytest.fixture
def daemon_factory():
    made: list[Daemon] = []

    def make(extra_config: str = "", start: bool = True, shared_vm_templates: bool = False) -> Daemon:
        d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")), extra_config,
                   shared_vm_templates=shared_vm_templates)
        made.append(d)
        if start:
            d.start()
        return d

    yield make
    for d in made:
        d.cleanup()


@pytest.fixture(scope="module")
def daemon(request, busybox_rootfs):
    """A started daemon with the busybox image imported as `busybox`; with
    the run's VM templates where the module is marked shared_vm_templates."""
    shared = request.node.get_closest_marker("shared_vm_templates") is not None
    d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")), shared_vm_templates=shared)
    try:
        d.start()
        c = d.client()
        c.import_image(busybox_rootfs, "busybox")
        c.close()
        yield d
    finally:
        d.cleanup()


@pytest.fixture
def client(daemon):
    c = daemon.client()
    yield c
    c.close()


@pytest.fixture
def sandbox(client):
    yield from _container(client)


def _container(client):
    sb = client.create(image="busybox", memory="128M")
    yield sb
    try:
        sb.destroy(force=True)
    except Exception:
        pass


# ------------------------------------------------------------ microVMs

def skip_unless_microvm(c, close: bool = True) -> dict:
    """The daemon's microvm backend (`info`); where it is unavailable, the
    test is skipped (c closed first unless close is False: a shared client)."""
    info = c.info()["backends"]["microvm"]
    if not info["available"]:
        if close:
            c.close()
        pytest.skip(f"backend microvm unavailable here: {info['why']}")
    return info


def microvm_daemon(busybox_rootfs, config: str, **kw):
    """Fixture body: a module's own daemon with `config` and busybox imported
    (kw to Daemon, e.g. shared_vm_templates=True); skipped where the microvm
    backend is unavailable; cleaned up at the end."""
    d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")), config, **kw)
    try:
        d.start()
        c = d.client()
        try:
            skip_unless_microvm(c, close=False)
            c.import_image(busybox_rootfs, "busybox")
        finally:
            c.close()
        yield d
    finally:
        d.cleanup()


def shared_vm(daemon, disk: str = "64M"):
    """Fixture body: one microVM a module's tests share (a VM under TCG takes
    seconds to start), on a client of its own; destroyed at the end."""
    c = daemon.client()
    skip_unless_microvm(c)
    try:
        sb = c.create("busybox", backend="microvm", memory="256M", net="none", disk=disk)
    except BaseException:
        c.close()
        raise
    try:
        yield sb
    finally:
        try:
            sb.destroy(force=True)
        finally:
            c.close()


def sandbox_on(backend: str, request, client, reset: str):
    """Fixture body: a test's sandbox on `backend`: a new container, or the
    module's shared VM (its fixture `vm`) after the shell command `reset`."""
    if backend == "microvm":
        sb = request.getfixturevalue("vm")
        sb.exec(["sh", "-c", reset])
        yield sb
        return
    yield from _container(client)


@pytest.fixture(autouse=True, scope="session")
def _enough_fds():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# Fixtures of the adversarial suite (test_attack_*.py): the probe binary and armed
# sandboxes. This file is also loaded by path (tests/fuzz, bench/), so its own
# directory may not be on sys.path yet.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_kit import admin, armed, probe_binary  # noqa: E402,F401
from fuse_kit import gate_fuse_binary  # noqa: E402,F401


@pytest.fixture(scope="module")
def world():
    """The net tests' World (test_net_kit.py), one per test module."""
    from test_net_kit import World

    w = World()
    yield w
    w.close()
