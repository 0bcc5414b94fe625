"""pip in a sandbox with `--allow pypi`, by name, through the daemon's resolver and NAT.

The "internet" is a test-owned netns behind the daemon's uplink
(test_net_kit.World.add_internet): Debian's dnsmasq there is the daemon's
only upstream (net.dns_upstreams) and answers pypi.org, files.pythonhosted.org
and other.test with addresses of that netns, where a plain-HTTP index on port
443 (pypi_kit.IndexServer; the shipped `pypi` set is those names on 443/tcp)
serves wheels the test builds. The sandbox runs the host's python3 and
Debian's pip (scripts/mkpyrootfs.sh --pip). Nothing leaves the namespaces
the test made; the daemon's and the host's nftables rulesets are compared
before and after.
"""

import hashlib
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from dns_kit import Dnsmasq
from pypi_kit import IndexServer, build_wheel
from test_net_daemon import _toml_net, connect
from test_net_kit import World, bpf_skip_reason
from test_net_nat import ruleset

ROOT = Path(__file__).resolve().parents[2]
PIP = "/usr/lib/python3/dist-packages/pip"

pytestmark = pytest.mark.skipif(
    bpf_skip_reason() is not None or Dnsmasq.missing() is not None or not os.path.isdir(PIP),
    reason=bpf_skip_reason() or Dnsmasq.missing() or f"{PIP} missing (apt-get install python3-pip)")

PROJECT = "dsec-probe"
# pip's own settings: no prompt, no cache, no version check, no config file, no
# retries (a first attempt that fails must fail the test), a short timeout.
PIP_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "PIP_NO_INPUT": "1", "PIP_NO_CACHE_DIR": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_CONFIG_FILE": "/dev/null", "PIP_RETRIES": "0",
           "PIP_DEFAULT_TIMEOUT": "5", "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture(scope="module")
def pip_rootfs() -> str:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "mkpyrootfs.sh"), "--pip"], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


class Internet:
    """The World with its internet netns, the names' addresses there, dnsmasq and the index."""

    def __init__(self, world: World):
        o = world.octet
        self.world = world
        self.pypi, self.files, self.other = f"198.18.{o}.10", f"198.18.{o}.11", f"198.18.{o}.12"
        for a in (self.pypi, self.files, self.other):
            world.add_inet_address(a)
        self.wheels = [build_wheel(world.tmp / "wheels", PROJECT, v) for v in ("1.0", "1.1")]
        self.latest = self.wheels[-1]
        self.index = IndexServer(f"/run/netns/{world.inet_ns}", self.wheels,
                                 files_host={"pypi.org": "files.pythonhosted.org"})
        self.dns = None
        try:
            self.dns = Dnsmasq(world, netns=world.inet_ns, address=f"198.18.{o}.53", prefixlen=24,
                               records={"pypi.org": self.pypi, "files.pythonhosted.org": self.files,
                                        "other.test": self.other})
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            self.index.stop()
        finally:
            if self.dns is not None:
                self.dns.stop()


@pytest.fixture(scope="module")
def inet():
    w = World(network=False)
    net = None
    try:
        w.add_internet()
        net = Internet(w)
        yield net
    finally:
        if net is not None:
            net.close()
        w.close()


@pytest.fixture
def pipd(inet, daemon_factory, pip_rootfs):
    """A daemon with NAT out of up0 and the resolver forwarding to the test's dnsmasq;
    at the end, stopping it must leave the bridge netns' and the host's rulesets as they were."""
    w = inet.world
    host_before, br_before = ruleset(), ruleset(w.br_ns)
    # rule_sets={}: the shipped sets (`pypi` = pypi.org and files.pythonhosted.org, 443/tcp).
    cfg = dict(w.cfg, ipv4_pool=f"10.{w.octet}.5.0/24", rule_sets={}, dns_upstreams=[inet.dns.address])
    d = daemon_factory(_toml_net(cfg).replace("[net]\n", '[net]\nuplink = "auto"\n'))
    c = d.client()
    c.import_image(pip_rootfs, "py")
    yield d, c
    c.destroy_all(force=True)
    c.close()
    d.stop(signal.SIGTERM)
    assert "dsecd" not in ruleset(w.br_ns)
    assert ruleset(w.br_ns) == br_before
    assert ruleset() == host_before


def pip_download(sb, index_host: str, project: str = PROJECT):
    r = sb.exec(["python3", "-m", "pip", "download", "--no-deps", "--index-url", f"http://{index_host}:443/simple/",
                 "--trusted-host", index_host, "--trusted-host", "files.pythonhosted.org",
                 "-d", "/tmp/dl", project], env=PIP_ENV, timeout=60)
    return r.exit_code, (r.stdout + r.stderr).decode()


def hits(inet, since: int, host: str) -> list[tuple[str, str, str, int]]:
    """(client, local address, path, status) of the index's requests for `host` after the first `since`."""
    return [(h.client, h.local, h.path, h.status) for h in inet.index.requests()[since:] if h.host == host]


def test_pip_download_by_name_through_resolver_and_nat(inet, pipd):
    d, c = pipd
    w = inet.world
    sb = c.create(image="py", net="default", allow=["pypi"])
    n = len(inet.index.requests())
    code, out = pip_download(sb, "pypi.org")
    assert code == 0, out
    # The newest version, byte for byte (pip checked the link's sha256 too).
    listing = sb.exec(["ls", "/tmp/dl"]).stdout.decode().split()
    assert listing == [inet.latest.filename], (listing, out)
    data = sb.read_file(f"/tmp/dl/{inet.latest.filename}")
    assert hashlib.sha256(data).hexdigest() == inet.latest.sha256
    # Both hosts were reached by name through the NAT (masqueraded to the uplink's address).
    up = w.uplink_addr
    assert hits(inet, n, "pypi.org") == [(up, inet.pypi, f"/simple/{PROJECT}/", 200)]
    assert hits(inet, n, "files.pythonhosted.org") == [(up, inet.files, f"/packages/{inet.latest.filename}", 200)]
    # The resolver learned exactly the two names' addresses, on the set's port.
    view = sb.net_show()
    learned = sorted((x["name"], x["rule"]) for x in view["learned"])
    assert learned == [("files.pythonhosted.org", f"{inet.files}:443/tcp"), ("pypi.org", f"{inet.pypi}:443/tcp")]
    assert view["dns"]["refused"] == 0
    # pip install of a pinned version (into a target dir: the image's python is
    # Debian's, marked externally managed), and the module imports.
    r = sb.exec(["python3", "-m", "pip", "install", "--no-deps", "--index-url", "http://pypi.org:443/simple/",
                 "--trusted-host", "pypi.org", "--trusted-host", "files.pythonhosted.org",
                 "--target", "/tmp/site", f"{PROJECT}==1.0"], env=PIP_ENV, timeout=60)
    assert r.exit_code == 0, (r.stdout + r.stderr).decode()
    r = sb.exec(["python3", "-c", "import dsec_probe; print(dsec_probe.VERSION)"],
                env={**PIP_ENV, "PYTHONPATH": "/tmp/site"})
    assert (r.exit_code, r.stdout) == (0, b"1.0\n"), r.stderr

    # Another index, by a name outside the set: the resolver refuses the name, so pip
    # cannot even connect, although other.test serves the same project (checked
    # from the bridge netns, outside any sandbox).
    assert " 200 " in w.in_bridge_netns(_get, inet.other, f"/simple/{PROJECT}/").split("\r\n")[0]
    n = len(inet.index.requests())
    code, out = pip_download(sb, "other.test")
    assert code != 0 and "No matching distribution" in out, out
    assert sb.net_show()["dns"]["refused"] >= 1
    assert inet.index.requests()[n:] == []
    # Its address, its port, directly: refused by the allowlist (EPERM at connect).
    code, out = connect(sb, inet.other, 443)
    assert code != 0 and "not permitted" in out.lower(), out
    # A learned address on another port, and the internet's other server: refused too.
    for host, port in ((inet.pypi, 80), (w.inet, 80)):
        code, out = connect(sb, host, port)
        assert code != 0 and "not permitted" in out.lower(), (host, port, out)
    assert sb.net_show()["default"]["denied_connect"] >= 3
    assert sorted(x["name"] for x in sb.net_show()["learned"]) == ["files.pythonhosted.org", "pypi.org"]
    sb.destroy()


def test_pip_download_needs_both_names_of_the_set(inet, pipd):
    d, c = pipd
    up = inet.world.uplink_addr
    # No rule: the resolver refuses pypi.org; the index never hears of the sandbox.
    sb = c.create(image="py", net="default", allow=[])
    n = len(inet.index.requests())
    code, out = pip_download(sb, "pypi.org")
    assert code != 0 and "No matching distribution" in out, out
    view = sb.net_show()
    assert view["learned"] == [] and view["dns"]["refused"] >= 1
    assert inet.index.requests()[n:] == []
    assert sb.exec(["test", "-e", f"/tmp/dl/{inet.latest.filename}"]).exit_code != 0
    sb.destroy()
    # pypi.org only: the index answers, the wheel's host is refused.
    sb = c.create(image="py", net="default", allow=["pypi.org:443/tcp"])
    n = len(inet.index.requests())
    code, out = pip_download(sb, "pypi.org")
    assert code != 0 and "files.pythonhosted.org" in out, out
    assert hits(inet, n, "pypi.org") == [(up, inet.pypi, f"/simple/{PROJECT}/", 200)]
    assert hits(inet, n, "files.pythonhosted.org") == []
    assert [x["name"] for x in sb.net_show()["learned"]] == ["pypi.org"]
    assert sb.exec(["test", "-e", f"/tmp/dl/{inet.latest.filename}"]).exit_code != 0
    sb.destroy()


def _get(host: str, path: str) -> str:
    """GET `path` from host:443 (run in the bridge netns: in_bridge_netns)."""
    with socket.create_connection((host, 443), timeout=3) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: other.test\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data.decode(errors="replace")
