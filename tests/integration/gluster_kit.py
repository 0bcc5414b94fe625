"""A private GlusterFS volume for tests: one glusterd, one brick, FUSE mounts.

Debian's glusterfs-server is used as installed (scripts/setup.sh), but never
its system service: the test starts its own `glusterd -N` with a volfile of
its own, so that its state (working-directory), its runtime files
(run-directory) and its CLI socket (glusterd-sockfile) are all under the
test's temp dir, not /var/lib/glusterd or /var/run.

Gluster refuses a brick on a loopback address (127.0.0.0/8), so glusterd,
its brick process and every FUSE client run in a network namespace the kit
makes, with a private address on that namespace's own `lo` (nothing outside
the namespace can reach it). The mounts are made with `nsenter --net` only,
not `ip netns exec`: the latter also enters a new mount namespace, and the
mount would be invisible to the daemons under test.

What glusterd writes outside the temp dir, with no option to move it: each
brick process's socket in /var/run/gluster and its log in
/var/log/glusterfs/bricks (close() removes the ones this volume made), a
line per volume command appended to /var/log/glusterfs/cmd_history.log, and
empty directories under /var/log/glusterfs and /var/run/gluster (left: a
system glusterd would use the same ones). /var/lib/glusterd is not used.

Everything is stopped by pid (the pidfiles glusterd and the bricks write,
the FUSE client's pid found by its mountpoint), never by name.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from dsecd import native

GLUSTERD = "/usr/sbin/glusterd"


def skip_reason() -> str | None:
    for tool in (GLUSTERD, "/usr/sbin/gluster", "/sbin/mount.glusterfs"):
        if not os.path.exists(tool):
            return f"{tool} is missing: glusterfs-server and glusterfs-client (scripts/setup.sh)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stop_pid(pid: int | None, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; returns once the pid is gone."""
    if pid is None or not _pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    if _pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class GlusterVolume:
    """`with GlusterVolume() as vol:` one started volume `tv`; `vol.mount()`
    gives another FUSE client of it (a "host"); `vol.kill_brick()` makes the
    store unreachable."""

    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="dsecd-gluster-"))
        octet = secrets.randbelow(200) + 20
        self.netns = f"dsecgl-{secrets.token_hex(3)}"
        self.nspath = f"/run/netns/{self.netns}"
        self.address = f"10.{octet}.{secrets.randbelow(250) + 1}.1"
        self.volume = "tv"
        self.brick = self.tmp / "brick"
        self.workdir = self.tmp / "glusterd"
        self.rundir = self.tmp / "run"
        self.logs = self.tmp / "log"
        self.glusterd_pid: int | None = None
        self.mounts: list[tuple[Path, int | None]] = []     # (mountpoint, FUSE client pid)
        self._brick_pids: set[int] = set()
        self._brick_sockets: set[Path] = set()
        self._brick_logs: set[Path] = set()
        self._netns_made = False

    # ------------------------------------------------------------ setup

    def __enter__(self) -> GlusterVolume:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _in_ns(self, argv: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        out = subprocess.run(["nsenter", f"--net={self.nspath}", *argv], capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stdout}{out.stderr}")
        return out

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._in_ns(["gluster", f"--glusterd-sock={self.rundir}/cli.socket",
                            f"--log-file={self.logs}/cli.log", "--mode=script", *args], check=check)

    def start(self) -> None:
        for d in (self.brick, self.workdir, self.rundir, self.logs):
            d.mkdir(parents=True)
        subprocess.run(["ip", "netns", "add", self.netns], check=True, capture_output=True)
        self._netns_made = True
        subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", self.netns, "addr", "add", f"{self.address}/32", "dev", "lo"], check=True)
        vol = self.tmp / "glusterd.vol"
        vol.write_text(
            "volume management\n"
            "    type mgmt/glusterd\n"
            f"    option working-directory {self.workdir}\n"
            f"    option run-directory {self.rundir}\n"
            f"    option glusterd-sockfile {self.rundir}/cli.socket\n"
            "    option transport-type socket\n"
            f"    option transport.socket.bind-address {self.address}\n"
            "    option transport.socket.listen-port 24007\n"
            "    option ping-timeout 0\n"
            "    option event-threads 1\n"
            "end-volume\n")
        pidfile = self.tmp / "glusterd.pid"
        # -N: foreground, our child; its pidfile is still written.
        proc = subprocess.Popen(["nsenter", f"--net={self.nspath}", GLUSTERD, "-N", "-f", str(vol),
                                 f"--log-file={self.logs}/glusterd.log", "-p", str(pidfile)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.glusterd_pid = proc.pid       # nsenter execs glusterd: the same pid
        self._proc = proc
        deadline = time.monotonic() + 30
        while not (self.rundir / "cli.socket").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"glusterd did not start (exit {proc.poll()}): "
                                   f"{(self.logs / 'glusterd.log').read_text()[-2000:]}")
            time.sleep(0.1)
        # glusterd answers the CLI a moment after its socket appears.
        for _ in range(50):
            if self.cli("volume", "list", check=False).returncode == 0:
                break
            time.sleep(0.2)
        self.cli("volume", "create", self.volume, f"{self.address}:{self.brick}", "force")
        self.cli("volume", "start", self.volume)
        self._note_bricks()

    def _note_bricks(self) -> None:
        """Remember the brick processes (by pidfile) and their files outside the temp dir."""
        for pidfile in (self.rundir / "vols" / self.volume).glob("*.pid"):
            pid = _read_pid(pidfile)
            if pid is None:
                continue
            self._brick_pids.add(pid)
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode() for a in argv]
            for flag, into in (("-S", self._brick_sockets), ("-l", self._brick_logs)):
                if flag in args:
                    into.add(Path(args[args.index(flag) + 1]))

    def mount(self) -> Path:
        """A new FUSE client of the volume, mounted on a fresh directory."""
        point = self.tmp / f"mnt{len(self.mounts)}"
        point.mkdir()
        self.mounts.append((point, None))
        self._in_ns(["mount", "-t", "glusterfs", "-o", f"log-file={self.logs}/client-{point.name}.log",
                     f"{self.address}:/{self.volume}", str(point)])
        self.mounts[-1] = (point, self._client_pid(point))
        return point

    @staticmethod
    def _client_pid(point: Path) -> int | None:
        """The glusterfs FUSE client serving `point` (its argv ends with it)."""
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a for a in argv if a]
            if words and words[0].endswith(b"glusterfs") and words[-1] == str(point).encode() \
                    and b"--process-name" in words:
                return int(entry.name)
        return None

    # ------------------------------------------------------------ faults

    def kill_brick(self) -> None:
        """SIGKILL the brick process: every client's reads of data it has
        not cached now fail (ENOTCONN), as with a storage host gone."""
        for pid in self._brick_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # glusterd takes a brick whose pidfile names a live pid for running, and
        # a killed brick stays a zombie until whoever it was reparented to reaps
        # it: without its pidfile, `volume start force` starts it again.
        for pidfile in (self.rundir / "vols" / self.volume).glob("*.pid"):
            pidfile.unlink()

    def restart_brick(self, timeout: float = 60.0) -> None:
        """Start the killed brick again (`volume start force` starts the bricks
        that are down) and wait until every FUSE client has reconnected."""
        self.cli("volume", "start", self.volume, "force")
        self._note_bricks()
        deadline = time.monotonic() + timeout
        for point, _ in self.mounts:
            while True:
                try:
                    os.listdir(point)
                    (point / ".").stat()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        for point, pid in reversed(self.mounts):
            with open("/proc/self/mountinfo") as f:
                mounted = any(line.split()[4] == str(point) for line in f)
            if mounted:
                try:
                    native.umount(str(point))
                except OSError:
                    native.umount(str(point), detach=True)
            _stop_pid(pid)
        for pid in self._brick_pids:
            _stop_pid(pid)
        if self.glusterd_pid is not None:
            _stop_pid(self.glusterd_pid)
            with contextlib.suppress(Exception):
                self._proc.wait(5)
        for path in self._brick_sockets | self._brick_logs:
            with contextlib.suppress(OSError):
                path.unlink()
        if self._netns_made:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
