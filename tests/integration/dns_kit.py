"""A test-owned upstream resolver: Debian's dnsmasq in a netns of a World.

By default it runs in the World's servers netns on an address of its own there
(10.<octet>.2.53) and serves the test zone below; a test may instead name the
netns, the address (added to that netns' eth0) and the records. It serves only
its records (no upstream of its own, no /etc/hosts) and is stopped by its pid.
The daemon reaches it through its config (net.dns_upstreams).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time

import dns.message
import dns.query
import dns.rcode

from dsecd.net.plumbing import in_netns

DNSMASQ = "/usr/sbin/dnsmasq"


class Dnsmasq:
    @staticmethod
    def missing() -> str | None:
        if not shutil.which(DNSMASQ):
            return f"{DNSMASQ} missing (apt-get install dnsmasq-base; scripts/setup.sh does)"
        return None

    def __init__(self, world, extra: list[str] | None = None, *, netns: str | None = None,
                 address: str | None = None, prefixlen: int = 16, records: dict[str, str] | None = None):
        """netns, address/prefixlen: where it listens (default the servers netns,
        10.<octet>.2.53/16); records: name -> "addr[,addr...][,ttl]" (dnsmasq's
        --host-record), served instead of the default zone; its first name is the
        readiness probe. Names under the records' top-level domains that no
        record has are answered here (NXDOMAIN, NODATA), never forwarded."""
        self.world = world
        self.netns = netns or world.srv_ns
        self.address = address or f"10.{world.octet}.2.53"
        base = [DNSMASQ, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
                "--bind-interfaces", f"--listen-address={self.address}", "--port=53", "--pid-file=",
                "--user=root", "--group=root", "--log-facility=-", "--local-ttl=30", "--cache-size=0"]
        if records is not None:
            self.names = dict(records)
            args = base + [f"--local=/{t}/" for t in sorted({n.rsplit(".", 1)[-1] for n in self.names})]
            args += [f"--host-record={n},{a}" for n, a in self.names.items()]
        else:
            args = base + self._default_zone()
        self._start(args + (extra or []), prefixlen)

    def _default_zone(self) -> list[str]:
        """test_net_dns's zone: sets self.names, returns dnsmasq's arguments."""
        o = self.world.octet
        pkg, ref = self.world.pkg, self.world.ref
        self.names = {
            "pypi.org": pkg, "files.pythonhosted.org": pkg, "other.test": ref,
            "b.fastly.test": ref, "loop.pythonhosted.org": "127.0.0.1",
            "gw.pythonhosted.org": f"10.{o}.0.1", "nbr.pythonhosted.org": f"10.{o}.3.77",
            "ll.pythonhosted.org": "169.254.1.1", "l10.chain.test": pkg,
            "meta.pythonhosted.org": "100.100.100.200",      # Alibaba Cloud's metadata service
        }
        args = ["--local=/org/", "--local=/test/"]      # answered here (NODATA, NXDOMAIN), never forwarded
        args.append(f"--host-record=pypi.org,{pkg},2")
        args += [f"--host-record={n},{a}" for n, a in self.names.items() if n != "pypi.org"]
        args += [f"--host-record=big.pythonhosted.org,10.{o}.9.{i}" for i in range(1, 11)]
        args.append(f"--host-record=huge.pythonhosted.org,10.{o}.9.50,999999")
        args += ["--cname=cdn.pythonhosted.org,a.fastly.test", "--cname=a.fastly.test,b.fastly.test"]
        # long.pythonhosted.org -> l1 -> ... -> l10 (A): longer than the resolver follows.
        args.append("--cname=long.pythonhosted.org,l1.chain.test")
        args += [f"--cname=l{i}.chain.test,l{i + 1}.chain.test" for i in range(1, 10)]
        return args

    def _start(self, args: list[str], prefixlen: int) -> None:
        subprocess.run(["ip", "-n", self.netns, "addr", "add", f"{self.address}/{prefixlen}", "dev", "eth0"],
                       check=True)
        self.log_path = self.world.tmp / f"dnsmasq-{self.address}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.netns}", "--", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def query(self, name: str, rdtype: str = "A", timeout: float = 1.0) -> dns.message.Message:
        """Straight to dnsmasq, from the bridge's netns (as the daemon's resolver asks)."""
        with in_netns(f"/run/netns/{self.world.br_ns}"):
            return dns.query.udp(dns.message.make_query(name, rdtype), self.address, timeout=timeout)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(Exception):
                if self.query(next(iter(self.names)), timeout=0.2).rcode() == dns.rcode.NOERROR:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("dnsmasq did not answer within 10 s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def dns_config(upstream: Dnsmasq) -> str:
    """[net] keys for short TTLs (the upstream itself: cfg["dns_upstreams"], see test_net_dns)."""
    return ("dns_ttl_min_s = 1\ndns_ttl_max_s = 60\ndns_grace_s = 1\ndns_max_addrs_per_answer = 4\n")


def nslookup(sb, name: str) -> tuple[int, str]:
    r = sb.exec(["nslookup", name], timeout=20)
    return r.exit_code, (r.stdout + r.stderr).decode()


def addresses(out: str) -> list[str]:
    """The answer's addresses in busybox nslookup's output (not the server's own line)."""
    return [ln.split()[1] for ln in out.splitlines() if ln.startswith("Address: ")]
