"""What every bench/ script shares: a private dsecd (own socket, state dir,
config and cgroup subtree in a temp dir), started, fed an image, and torn
down in order whatever happens (failure, Ctrl-C, SIGTERM): sandboxes removed
(`dsec rm --all`), daemon stopped, leftover mounts under the temp dir
unmounted, the cgroup subtree and the temp dir removed.

    with harness.private_daemon(rootfs, image="busybox", extra_config="[cpu]\n...") as d:
        ... d.sock ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsecd.config import with_setting
from dsecd.sysfs import unescape_mount_field

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / ".venv" / "bin"
DAEMON_START_TIMEOUT_S = 60


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes, by field name."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


class BenchDaemon:
    """A dsecd of the bench's own, in `tmp`: socket, state dir, config, and a
    cgroup subtree named after this process, so that neither its sandboxes nor
    its clean-up meet another daemon's on the same host."""

    def __init__(self, tmp: Path, config: str | None, extra_config: str = "", tag: str = "",
                 cgroup_prefix: str = "dsecd-bench"):
        self.tmp = tmp
        self.extra_config = extra_config
        self.sock = str(tmp / "dsecd.sock")
        self.state = str(tmp / "state")
        self.log_path = tmp / "dsecd.log"
        self.cgroup_root = f"{cgroup_prefix}-{os.getpid()}{tag}"   # tag: several daemons at once
        self.config = config or self._write_config()
        self.proc: subprocess.Popen | None = None

    def _write_config(self) -> str:
        path = self.tmp / "bench.toml"
        path.write_text(f'[sandbox]\ncgroup_root = "{self.cgroup_root}"\n{with_setting(self.extra_config, "microvm", "guest_dir", os.environ.get("DSECD_GUEST_DIR"))}')
        return str(path)

    def start(self) -> None:
        argv = [str(BIN / "dsecd"), "--socket", self.sock, "--state-dir", self.state,
                "--config", self.config]  # fmt: skip
        log(f"starting {' '.join(argv)}")
        with open(self.log_path, "wb") as out:
            # Own session: a Ctrl-C at the terminal reaches the bench, which then
            # cleans up in order, not the daemon.
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while not self._socket_answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsecd exited {self.proc.returncode} before its socket was up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"dsecd socket not up after {DAEMON_START_TIMEOUT_S} s")
            time.sleep(0.05)

    def _socket_answers(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(self.sock)
                return True
            except OSError:
                return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no daemon log)"

    def cli(self, *args: str, timeout: float = 600) -> None:
        argv = [str(BIN / "dsec"), "--socket", self.sock, *args]
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
            start_new_session=True,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout}"
            )

    def import_image(self, rootfs: str, name: str) -> None:
        log(f"importing {rootfs} as image {name!r}")
        self.cli("image", "import", rootfs, "--name", name)

    def stop(self) -> None:
        """Remove all sandboxes, then SIGTERM (SIGKILL after 20 s). Each step
        runs even if the one before failed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                log("removing all sandboxes")
                self.cli("rm", "--all", "--force", timeout=300)
            except Exception as err:
                log(f"dsec rm --all --force failed: {err}")
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                log("dsecd ignored SIGTERM for 20 s: SIGKILL")
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode not in (0, -signal.SIGTERM):
            log(f"dsecd exited {self.proc.returncode}; last lines of its log:\n{self.log_tail()}")
        self._remove_cgroups()

    def _remove_cgroups(self) -> None:
        """Remove the bench's cgroup subtree in every hierarchy. Processes
        still in it are sandboxes of this bench's daemon that `rm --all`
        missed: they are killed (by pid, from our own subtree only) first."""
        for mnt in cgroup_mounts():
            top = Path(mnt) / self.cgroup_root
            if not top.is_dir():
                continue
            for dirpath, _dirs, _files in os.walk(top, topdown=False):
                leftover = read_pids(Path(dirpath) / "cgroup.procs")
                if leftover:
                    log(f"killing leftover sandbox processes in {dirpath}: {sorted(leftover)[:8]}")
                    for pid in leftover:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    time.sleep(0.2)
                try:
                    os.rmdir(dirpath)
                except OSError as err:
                    log(f"cannot remove cgroup {dirpath}: {err.strerror}")


def cgroup_mounts() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            fstype = parts[parts.index("-") + 1]
            if fstype in ("cgroup", "cgroup2"):
                out.append(unescape_mount_field(parts[4]))
    return out


def read_pids(path: Path) -> set[int]:
    try:
        return {int(x) for x in path.read_text().split()}
    except OSError:
        return set()


def mounts_under(top: Path) -> list[str]:
    prefix = str(top).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        points = [unescape_mount_field(line.split()[4]) for line in f]
    return [p for p in points if p == str(top) or p.startswith(prefix)]


def remove_tmp(tmp: Path) -> None:
    """Unmount what the daemon left mounted below tmp (deepest first, lazily),
    then delete tmp. rmtree never runs while a mount remains: it would walk
    into the mounted filesystem."""
    for point in sorted(mounts_under(tmp), key=len, reverse=True):
        log(f"unmounting leftover {point}")
        subprocess.run(["umount", "-l", point], stdin=subprocess.DEVNULL, check=False)
    left = mounts_under(tmp)
    if left:
        log(f"NOT removing {tmp}: still mounted: {left}")
        return
    shutil.rmtree(tmp, ignore_errors=True)



def build_rootfs() -> str:
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "mkrootfs.sh")],
        check=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def private_daemon(rootfs: str, image: str, config: str | None = None, extra_config: str = "",
                   tag: str = "", cgroup_prefix: str = "dsecd-bench"):
    """A started BenchDaemon with `rootfs` imported as `image`; cleaned up on exit.
    SIGTERM takes the Ctrl-C path, and clean-up ignores further signals until done.
    cgroup_prefix: the start of its cgroup subtree's name (a host may reserve one)."""
    signal.signal(signal.SIGTERM, interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="dsecd-bench-"))
    daemon = BenchDaemon(tmp, config, extra_config, tag, cgroup_prefix)
    try:
        daemon.start()
        daemon.import_image(rootfs, image)
        yield daemon
    except Exception as err:
        log(f"FAILED: {err!r}")
        if daemon.proc is not None and daemon.proc.poll() is None:
            log(f"last lines of the daemon's log:\n{daemon.log_tail()}")
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            daemon.stop()
        finally:
            remove_tmp(tmp)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, interrupt)


def run(main) -> None:
    """A bench script's entry point: exit with main()'s status. On Ctrl-C or
    SIGTERM, private_daemon has already cleaned up by the time this sees it."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted (cleaned up)")
        sys.exit(130)
