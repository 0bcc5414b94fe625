"""A simulated fleet on this machine, for tests/integration/test_fleet.py and
bench/fleet.py (no tests in this file).

    fleet = SimFleet(3, busybox_rootfs)      # made and started; close() undoes all
    fleet.targets          ["ssh://h1", "ssh://h2", "ssh://h3"]
    fleet.ssh              SshOptions to give Client/Fleet (ssh=...)
    fleet.env()            the same as environment variables, for `dsec`
    fleet.hosts[0].kill()  SIGKILL its daemon, its sshd and the sshd's sessions
    fleet.hosts[0].cut()   its link goes down: packets vanish, nothing closes
    fleet.hosts[0].start() back (the daemon re-adopts its sandboxes)

What it makes, all of it its own:

* a "client" network namespace with a bridge (br0, 10.<x>.0.1/24); the SDK's
  ssh runs there (SshOptions.command = nsenter --net=<it> ssh), so that no
  interface or route of the host's own network namespace is touched;
* per host hN a network namespace joined to the bridge by a veth (eth0,
  10.<x>.0.<10+N>/24) holding
  - an sshd: /usr/sbin/sshd -D -f <its config> listening on that address,
    port 2222 only, with a host key and an authorized client key made here,
    PAM off, root by key only, and SetEnv DSEC_SOCKET=<its daemon's socket>
    so that `dsec rpc --stdio` finds the daemon;
  - a dsecd (conftest.Daemon: private socket, state dir and cgroup subtree
    dsecd-test-<random>), run in that network namespace by nsenter;
* an ssh client config (-F) naming h1..hN with their addresses, the client
  key, a known_hosts file of the test host key (strict checking) and no
  agent: nothing of root's ~/.ssh is read or written.

Processes are started by this kit and stopped by their pids (an sshd with
the sessions it forked: its descendants, found through /proc). close() runs
in finalizers, so it undoes everything even when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns

from dsecd.net.plumbing import in_netns, netlink_socket
from dsecd.remote import SshOptions

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import VENV_BIN, Daemon  # noqa: E402

SSHD = "/usr/sbin/sshd"
SSH_PORT = 2222                      # in the kit's own namespaces only
# sshd refuses to start without its privilege separation directory, which
# Debian's unit makes at boot (RuntimeDirectory). Made here when missing and
# left (an empty directory on /run's tmpfs; another sshd may use it meanwhile).
PRIVSEP_DIR = "/run/sshd"
START_TIMEOUT_S = 20
# The hosts' sandboxes use no network: no eBPF compile at daemon start (its
# compiler, a child of the daemon, would outlive a host stopped seconds
# after its start and write into its removed state dir).
NO_NET_PRELOAD = "[net]\npreload = false\n"


def sshd_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd, cgroups)"
    for tool in (SSHD, shutil.which("ssh"), shutil.which("ssh-keygen"), shutil.which("nsenter")):
        if not tool or not os.path.exists(tool):
            return f"{tool or 'ssh/ssh-keygen/nsenter'} missing: scripts/setup.sh installs openssh-server and util-linux"
    return None


def descendants(pid: int) -> list[int]:
    """The pids below `pid` (children, theirs, ...), from /proc."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: read after its ')'.
        parent_of[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent_of.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def kill_tree(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    """Signal a process we started and everything it forked, by pid; reap it."""
    if proc is None or proc.poll() is not None:
        return
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _ipr(nspath: str) -> IPRoute:
    return IPRoute(fileno=netlink_socket(nspath).detach(), groups=0)


class SimHost:
    def __init__(self, fleet: SimFleet, index: int, extra_config: str, log_level: str):
        self.fleet = fleet
        self.name = f"h{index + 1}"
        self.address = f"10.{fleet.octet}.0.{11 + index}"
        self.netns = f"{fleet.prefix}-{self.name}"
        self.nspath = f"/run/netns/{self.netns}"
        self.link = f"v{self.name}"          # its veth's end on the bridge, in the client netns
        self.tmp = fleet.tmp / self.name
        self.tmp.mkdir()
        (self.tmp / "daemon").mkdir()
        if "[net]" not in extra_config:
            extra_config = NO_NET_PRELOAD + extra_config
        self.daemon = Daemon(self.tmp / "daemon", extra_config, wrap=self.nsenter(), log_level=log_level)
        self.sshd: subprocess.Popen | None = None
        self.sshd_config = self.tmp / "sshd_config"
        self.sshd_log = self.tmp / "sshd.log"

    @property
    def target(self) -> str:
        return f"ssh://{self.name}"

    def nsenter(self) -> list[str]:
        return ["nsenter", f"--net={self.nspath}", "--"]

    def plumb(self) -> None:
        pr_netns.create(self.netns)
        self.fleet.netns.append(self.netns)
        host_fd = os.open(self.nspath, os.O_RDONLY)
        try:
            with _ipr(self.fleet.client_nspath) as ipr:
                ipr.link("add", ifname=self.link, kind="veth", peer={"ifname": "eth0", "net_ns_fd": host_fd})
                idx = ipr.link_lookup(ifname=self.link)[0]
                ipr.link("set", index=idx, master=self.fleet.bridge_index, state="up")
        finally:
            os.close(host_fd)
        with _ipr(self.nspath) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            idx = ipr.link_lookup(ifname="eth0")[0]
            ipr.addr("add", index=idx, address=self.address, prefixlen=24)
            ipr.link("set", index=idx, state="up")

    def start(self) -> None:
        """Its daemon (same state dir: a restart re-adopts its sandboxes), then its sshd."""
        if self.daemon.proc is None or self.daemon.proc.poll() is not None:
            self.daemon.start()
        if self.sshd is None or self.sshd.poll() is not None:
            self.start_sshd()

    def start_sshd(self) -> None:
        os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
        self.sshd_config.write_text(
            f"ListenAddress {self.address}:{SSH_PORT}\n"
            f"HostKey {self.fleet.host_key}\n"
            "PidFile none\n"                        # not /run/sshd.pid, the system sshd's
            f"AuthorizedKeysFile {self.fleet.authorized_keys}\n"
            "StrictModes no\n"                      # the key files live under /tmp
            "UsePAM no\nPermitRootLogin prohibit-password\nAuthenticationMethods publickey\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "X11Forwarding no\nAllowTcpForwarding no\nAllowAgentForwarding no\nPermitTunnel no\n"
            "PrintMotd no\nPrintLastLog no\nUseDNS no\n"
            "MaxStartups 64\nMaxSessions 64\nLoginGraceTime 20\n"
            "ClientAliveInterval 2\nClientAliveCountMax 3\n"
            f"SetEnv DSEC_SOCKET={self.daemon.socket}\n")
        self.sshd = subprocess.Popen([*self.nsenter(), SSHD, "-D", "-f", str(self.sshd_config),
                                      "-E", str(self.sshd_log)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._port_open():
            if self.sshd.poll() is not None:
                raise RuntimeError(f"sshd of {self.name} exited {self.sshd.returncode}: "
                                   f"{self.sshd_log.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd of {self.name} not listening on {self.address}:{SSH_PORT} "
                                   f"after {START_TIMEOUT_S} s")
            time.sleep(0.05)

    def _port_open(self) -> bool:
        """Whether the sshd accepts connections, tried from the client netns."""
        out = {}

        def probe() -> None:
            with in_netns(self.fleet.client_nspath):
                s = socket.socket()
            s.settimeout(1)
            try:
                s.connect((self.address, SSH_PORT))
                out["ok"] = True
            except OSError:
                out["ok"] = False
            finally:
                s.close()

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return out["ok"]

    def kill(self) -> None:
        """The host dies: SIGKILL to its daemon and to its sshd and the
        sessions it forked. Its sandboxes live on (as after a daemon crash)."""
        if self.daemon.proc is not None and self.daemon.proc.poll() is None:
            self.daemon.proc.kill()
            self.daemon.proc.wait()
        kill_tree(self.sshd)

    def cut(self) -> None:
        """Its link goes down: packets to it vanish, no connection closes."""
        self._set_link("down")

    def heal(self) -> None:
        self._set_link("up")

    def _set_link(self, state: str) -> None:
        with _ipr(self.fleet.client_nspath) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname=self.link)[0], state=state)

    def close(self) -> None:
        kill_tree(self.sshd, signal.SIGTERM)
        self.daemon.cleanup()


class SimFleet:
    def __init__(self, n: int, rootfs: str | None = None, extra_config: str | list[str] = "",
                 image: str = "busybox", log_level: str = "debug"):
        """n hosts, started; `rootfs` imported as `image` on each. extra_config:
        daemon config for all hosts, or a list of one per host."""
        h = secrets.token_hex(3)
        self.prefix = f"dsft-{h}"
        self.octet = 100 + secrets.randbelow(100)
        self.tmp = Path(tempfile.mkdtemp(prefix="dsec-fleet-test-"))
        self.netns: list[str] = []
        self.hosts: list[SimHost] = []
        try:
            self._make_client_netns()
            self._make_keys()
            configs = extra_config if isinstance(extra_config, list) else [extra_config] * n
            self.hosts = [SimHost(self, i, configs[i], log_level) for i in range(n)]
            for host in self.hosts:
                host.plumb()
            self._write_ssh_config()
            for host in self.hosts:
                host.start()
                if rootfs:
                    c = host.daemon.client()
                    try:
                        c.import_image(rootfs, image)
                    finally:
                        c.close()
        except BaseException:
            self.close()
            raise

    @property
    def targets(self) -> list[str]:
        return [h.target for h in self.hosts]

    @property
    def ssh(self) -> SshOptions:
        return SshOptions(command=self.ssh_command(), config=str(self.ssh_config),
                          remote_dsec=str(VENV_BIN / "dsec"), keepalive_s=1, keepalive_count=3,
                          connect_timeout_s=5)

    def ssh_command(self) -> list[str]:
        return ["nsenter", f"--net={self.client_nspath}", "--", "ssh"]

    def env(self) -> dict[str, str]:
        """The environment for `dsec --host ssh://h1 ...` and `dsec fleet --hosts h1,...`."""
        import shlex

        return {**os.environ, "DSEC_SSH_COMMAND": shlex.join(self.ssh_command()),
                "DSEC_SSH_CONFIG": str(self.ssh_config), "DSEC_REMOTE_DSEC": str(VENV_BIN / "dsec")}

    def host(self, name_or_target: str) -> SimHost:
        name = name_or_target.removeprefix("ssh://")
        return next(h for h in self.hosts if h.name == name)

    def _make_client_netns(self) -> None:
        self.client_ns = f"{self.prefix}-c"
        self.client_nspath = f"/run/netns/{self.client_ns}"
        pr_netns.create(self.client_ns)
        self.netns.append(self.client_ns)
        with _ipr(self.client_nspath) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            ipr.link("add", ifname="br0", kind="bridge")
            self.bridge_index = ipr.link_lookup(ifname="br0")[0]
            ipr.addr("add", index=self.bridge_index, address=f"10.{self.octet}.0.1", prefixlen=24)
            ipr.link("set", index=self.bridge_index, state="up")

    def _make_keys(self) -> None:
        keys = self.tmp / "keys"
        keys.mkdir(mode=0o700)
        self.host_key = keys / "host_ed25519"
        self.client_key = keys / "client_ed25519"
        for path, comment in ((self.host_key, "dsec-fleet-test-host"), (self.client_key, "dsec-fleet-test")):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                           check=True, stdin=subprocess.DEVNULL, capture_output=True)
        self.authorized_keys = keys / "authorized_keys"
        self.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())

    def _write_ssh_config(self) -> None:
        host_pub = Path(f"{self.host_key}.pub").read_text().split()
        self.known_hosts = self.tmp / "keys" / "known_hosts"
        self.known_hosts.write_text("".join(
            f"[{h.name}]:{SSH_PORT},[{h.address}]:{SSH_PORT} {host_pub[0]} {host_pub[1]}\n" for h in self.hosts))
        self.ssh_config = self.tmp / "ssh_config"
        blocks = [f"Host {h.name}\n    HostName {h.address}\n" for h in self.hosts]
        self.ssh_config.write_text("".join(blocks) + (
            "Host *\n"
            "    User root\n"
            f"    Port {SSH_PORT}\n"
            f"    IdentityFile {self.client_key}\n"
            "    IdentitiesOnly yes\n"
            "    IdentityAgent none\n"
            f"    UserKnownHostsFile {self.known_hosts}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    UpdateHostKeys no\n"
            "    CheckHostIP no\n"
            "    PasswordAuthentication no\n"
            "    KbdInteractiveAuthentication no\n"
            "    GSSAPIAuthentication no\n"
            "    ControlMaster no\n"
            "    ControlPath none\n"
            "    LogLevel ERROR\n"))

    def clear(self) -> None:
        """Destroy every sandbox of every host that runs (between tests)."""
        for host in self.hosts:
            if host.daemon.proc is not None and host.daemon.proc.poll() is None:
                c = host.daemon.client()
                try:
                    c.destroy_all(force=True)
                finally:
                    c.close()

    def close(self) -> None:
        for host in self.hosts:
            try:
                host.close()
            except Exception as err:          # keep cleaning up; report
                print(f"fleet_kit: closing {host.name}: {err}", file=sys.stderr)
        for ns in self.netns:
            with contextlib.suppress(OSError):
                pr_netns.remove(ns)
        shutil.rmtree(self.tmp, ignore_errors=True)
