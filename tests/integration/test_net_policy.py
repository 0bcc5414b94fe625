"""Egress policy with real traffic: test-owned bridge netns, servers in another netns,
each sandbox an agent process in its own netns + cgroup (see test_net_kit.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import pytest

# The kit sits next to this file (tests/integration/conftest.py puts that dir on sys.path).
from test_net_kit import V2, bpf_skip_reason, bridge_links, pr_netns

from dsecd.errors import BadRequest, Conflict, LimitExceeded, NotFound
from dsecd.journal import read_records
from dsecd.net.plumbing import host_ifname

pytestmark = pytest.mark.skipif(bpf_skip_reason() is not None, reason=bpf_skip_reason() or "")


@pytest.fixture
def sandbox(world, request):
    """An agent with networking attached; detached (and checked gone) afterwards."""
    made = []

    def make(rules=None, name=None, mode="default", root=False):
        a = world.agent(name, root=root)
        world.net.attach(a.name, f"/run/netns/{a.netns}", a.cgroup, rules, mode=mode)
        made.append(a)
        return a

    yield make
    for a in made:
        world.net.detach(a.name)
        a.stop()


def test_connect_allowed_and_denied_with_counters(world, sandbox):
    a = sandbox([f"{world.pkg}:443/tcp"])
    assert a.ask(op="connect", host=world.pkg, port=443) == {"ok": True, "data": "srv443:hello"}
    assert a.ask(op="connect", host=world.pkg, port=80) == {"errno": "EPERM"}      # same host, other port
    assert a.ask(op="connect", host=world.ref, port=443) == {"errno": "EPERM"}     # the reference host
    # IPv6 socket, IPv4-mapped destination: the connect6 hook applies the same IPv4 rules
    assert a.ask(op="connect", host=f"::ffff:{world.pkg}", port=443)["ok"]
    assert a.ask(op="connect", host=f"::ffff:{world.ref}", port=443) == {"errno": "EPERM"}
    assert a.ask(op="connect", host="127.0.0.1", port=9) == {"errno": "ECONNREFUSED"}   # loopback always
    view = world.net.show(a.name)
    assert view["rules"] == [{"rule": f"{world.pkg}:443/tcp", "from": [f"{world.pkg}:443/tcp"], "allowed": 2}]
    assert view["default"]["denied_connect"] == 3
    assert view["lease"]["ipv4"].startswith(f"10.{world.octet}.1.")


def test_ipv6_lease_and_rules(world, sandbox):
    a = sandbox([f"[{world.pkg6}]:443/tcp"])
    lease = world.net.show(a.name)["lease"]
    assert lease["ipv6"].startswith(f"fd00:{world.octet}::") and lease["gateway6"] == f"fd00:{world.octet}::1"
    assert a.ask(op="connect", host=world.pkg6, port=443) == {"ok": True, "data": "srv443:hello"}
    assert a.ask(op="connect", host=world.pkg6, port=80) == {"errno": "EPERM"}
    assert a.ask(op="connect", host=world.ref6, port=443) == {"errno": "EPERM"}
    assert a.ask(op="connect", host=world.pkg, port=443) == {"errno": "EPERM"}     # no IPv4 rule
    assert a.ask(op="connect", host="::1", port=9) == {"errno": "ECONNREFUSED"}    # loopback always


def test_udp_sendmsg_hook(world, sandbox):
    a = sandbox(["dns"])
    assert a.ask(op="udp", host=world.pkg, port=53) == {"ok": True, "data": "udp:ping"}
    assert a.ask(op="udp", host=world.ref, port=53) == {"errno": "EPERM"}
    assert world.net.show(a.name)["default"]["denied_sendmsg"] == 1


def test_named_sets_and_live_merge(world, sandbox):
    a = sandbox(["pypi"])
    assert a.ask(op="connect", host=world.pkg, port=80)["ok"]
    assert a.ask(op="connect", host=world.ref, port=443) == {"errno": "EPERM"}
    world.net.update(a.name, add=["refsol"])                # the "solving" phase gets a new host
    assert a.ask(op="connect", host=world.ref, port=443)["ok"]
    view = world.net.update(a.name, remove=["pypi"])
    assert view["terms"] == ["refsol"]
    assert a.ask(op="connect", host=world.pkg, port=443) == {"errno": "EPERM"}
    world.net.update(a.name, replace=[f"{world.pkg}:8080/tcp"])
    assert a.ask(op="connect", host=world.pkg, port=8080)["ok"]
    assert a.ask(op="connect", host=world.ref, port=443) == {"errno": "EPERM"}


def test_failed_updates_leave_policy_unchanged(world, sandbox):
    a = sandbox(["pypi"])
    before = world.net.show(a.name)
    bad = [dict(add=["npm"]), dict(remove=["dns"]), dict(add=[f"{world.ref}:0/tcp"]),
           dict(add=[f"{world.ref}:443/sctp"]), dict(replace=["pypi"], add=["dns"])]
    for kw in bad:
        with pytest.raises(BadRequest):
            world.net.update(a.name, **kw)
    big = [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:443/tcp" for i in range(100_000)]
    with pytest.raises(LimitExceeded, match="100000 rules"):
        world.net.update(a.name, replace=big)
    after = world.net.show(a.name)
    assert after["terms"] == before["terms"] == ["pypi"]
    assert a.ask(op="connect", host=world.pkg, port=443)["ok"]
    assert a.ask(op="connect", host=world.ref, port=443) == {"errno": "EPERM"}


def test_established_connection_is_cut_by_removal(world, sandbox):
    """The egress backstop checks every packet: removing a rule stalls open connections."""
    a = sandbox(["pypi"])
    assert a.ask(op="connect", host=world.pkg, port=443, hold="c") == {"ok": True, "data": "srv443:hello"}
    assert a.ask(op="talk", hold="c") == {"ok": True, "data": "srv443:again"}
    dropped = world.net.show(a.name)["default"]["dropped_packets"]
    world.net.update(a.name, remove=["pypi"])
    assert a.ask(op="talk", hold="c", timeout=0.5) == {"ok": False, "timeout": True}
    assert world.net.show(a.name)["default"]["dropped_packets"] > dropped


def test_egress_backstop_drops_raw_packets(world, sandbox):
    """Raw sockets bypass the connect/sendmsg hooks; the cgroup_skb program drops them."""
    a = sandbox([world.ref], root=True)          # root: has CAP_NET_RAW; all protocols to ref only
    assert a.ask(op="icmp", host=world.ref)["ok"]
    r = a.ask(op="icmp", host=world.pkg)
    assert r in ({"errno": "EPERM"}, {"ok": False, "timeout": True})
    assert world.net.show(a.name)["default"]["dropped_packets"] >= 1


def test_sandbox_cannot_touch_its_policy(world, sandbox):
    a = sandbox(["pypi"])
    assert a.ask(op="bpf") == {"rc": -1, "errno": "EPERM"}
    fds = a.ask(op="fds")["fds"]
    assert not [f for f in fds if "bpf" in f], fds
    # and none can leak through an exec of the daemon: every BPF fd it holds is O_CLOEXEC
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "bpf" not in os.readlink(f"/proc/self/fd/{fd}"):
                continue
            info = open(f"/proc/self/fdinfo/{fd}").read()
        except OSError:
            continue
        held += 1
        flags = int(next(x for x in info.splitlines() if x.startswith("flags")).split()[1], 8)
        assert flags & os.O_CLOEXEC, (fd, oct(flags))
    assert held >= 10          # 5 maps + 5 programs


def test_a_broad_rule_reaches_neither_other_sandboxes_nor_the_gateway(world, sandbox):
    """`0.0.0.0/0:443/tcp` is the internet's HTTPS: it does not open another
    sandbox's listeners or the host's services on the gateway (EPERM at
    once); a rule naming the sandbox's address does (its connect reaches
    it: nothing listens there, ECONNREFUSED); the resolver stays reachable."""
    b = sandbox([])
    b_ip = world.net.show(b.name)["lease"]["ipv4"].split("/")[0]
    gateway = f"10.{world.octet}.0.1"
    a = sandbox(["0.0.0.0/0:443/tcp"])
    assert a.ask(op="connect", host=world.pkg, port=443)["ok"]          # the internet, as asked
    assert a.ask(op="connect", host=b_ip, port=443) == {"errno": "EPERM"}
    assert a.ask(op="connect", host=gateway, port=443) == {"errno": "EPERM"}
    world.net.update(a.name, add=[f"{b_ip}:443/tcp"])
    assert a.ask(op="connect", host=b_ip, port=443) == {"errno": "ECONNREFUSED"}
    assert a.ask(op="connect", host=gateway, port=443) == {"errno": "EPERM"}
    world.net.update(a.name, remove=[f"{b_ip}:443/tcp"])
    assert a.ask(op="connect", host=b_ip, port=443) == {"errno": "EPERM"}
    # Its own address is as its loopback, whatever its rules (a server on its
    # eth0 reached by its hostname): nothing listens there, so refused, not denied.
    for sb in (a, b):
        lease = world.net.show(sb.name)["lease"]
        for own in (lease["ipv4"], lease["ipv6"]):
            assert sb.ask(op="connect", host=own.split("/")[0], port=9) == {"errno": "ECONNREFUSED"}, own


def test_refreshed_fences_take_in_an_address_the_host_gained(world, sandbox):
    """refresh_host_fences: an address the host side gained is walled off
    from a broad rule in a running sandbox's policy; unchanged, nothing is
    rewritten; once the address is gone, the broad rule reaches it again."""
    gained = "198.18.77.2"
    a = sandbox(["0.0.0.0/0:443/tcp"])
    assert world.net.refresh_host_fences() is False
    subprocess.run(["ip", "-n", world.br_ns, "addr", "add", f"{gained}/32", "dev", "dsec0"], check=True)
    try:
        assert a.ask(op="connect", host=gained, port=443) == {"errno": "ECONNREFUSED"}   # the host's, open
        assert world.net.refresh_host_fences() is True
        assert a.ask(op="connect", host=gained, port=443) == {"errno": "EPERM"}
        assert world.net.refresh_host_fences() is False and not world.net.fences_pending()
    finally:
        subprocess.run(["ip", "-n", world.br_ns, "addr", "del", f"{gained}/32", "dev", "dsec0"], check=True)
    assert world.net.refresh_host_fences() is True
    assert a.ask(op="connect", host=gained, port=443) != {"errno": "EPERM"}


def test_net_none_is_loopback_only(world, sandbox):
    a = sandbox(mode="none")
    assert world.net.show(a.name) == {"sandbox": a.name, "mode": "none"}
    assert a.ask(op="connect", host=world.pkg, port=443) == {"errno": "ENETUNREACH"}
    with pytest.raises(Conflict):
        world.net.update(a.name, add=["pypi"])
    with pytest.raises(BadRequest, match="needs --net default"):
        world.net.attach("x", f"/run/netns/{a.netns}", a.cgroup, ["pypi"], mode="none")


def test_detach_frees_everything(world):
    eng = world.net.engine
    base = (eng.prefixes_used, len(eng.counters.used), len(eng.slots.used))
    a = world.agent()
    try:
        world.net.attach(a.name, f"/run/netns/{a.netns}", a.cgroup, ["pypi", "dns"])
        assert world.net.plumbing.has_sandbox(host_ifname(a.name))
        world.net.detach(a.name)
        world.net.detach(a.name)                       # idempotent
        assert not world.net.plumbing.has_sandbox(host_ifname(a.name))
        assert world.net.ipam.get(a.name) is None
        assert (eng.prefixes_used, len(eng.counters.used), len(eng.slots.used)) == base
        with pytest.raises(NotFound):
            world.net.show(a.name)
        assert a.ask(op="connect", host=world.pkg, port=443) == {"errno": "ENETUNREACH"}
        # the same netns again (the kernel numbers the new peer differently): works
        world.net.attach(a.name, f"/run/netns/{a.netns}", a.cgroup, ["pypi"])
        assert a.ask(op="connect", host=world.pkg, port=443)["ok"]
    finally:
        world.net.detach(a.name)


def test_updates_racing_with_detach(world):
    eng = world.net.engine
    base = (eng.prefixes_used, len(eng.counters.used), len(eng.slots.used))
    a = world.agent()
    world.net.attach(a.name, f"/run/netns/{a.netns}", a.cgroup, ["pypi"])
    errors, done = [], threading.Event()

    def churn():
        i = 0
        while not done.is_set():
            try:
                world.net.update(a.name, replace=["pypi", "dns"] if i % 2 == 0 else ["refsol"])
                i += 1
            except (NotFound, Conflict):
                return
            except Exception as err:      # anything else is a bug
                errors.append(err)
                return

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    world.net.detach(a.name)
    done.set()
    for t in threads:
        t.join(10)
    assert not errors
    assert (eng.prefixes_used, len(eng.counters.used), len(eng.slots.used)) == base


def test_restart_readopts_policy_and_lease(world, tmp_path):
    """An 'old daemon' process attaches and exits; its programs keep enforcing; a new
    Network readopts: same lease, same policy, now changeable again; dead ones are freed."""
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.3.0/24")
    state = tmp_path / "state"
    keep, gone = world.agent(), world.agent()
    script = (
        "import json, sys\nfrom pathlib import Path\nfrom dsecd.net import Network\n"
        "cfg, state, root, sbs = json.loads(sys.argv[1])\n"
        "net = Network(cfg, Path(state), Path('/sys/fs/cgroup/unified'), root)\n"
        "for name, ns, cg in sbs: net.attach(name, ns, cg, ['pypi'])\n"
        "print(json.dumps(net.show(sbs[0][0])['lease']))\n")
    arg = json.dumps([cfg, str(state), world.cgroup_root,
                      [[x.name, f"/run/netns/{x.netns}", str(x.cgroup)] for x in (keep, gone)]])
    out = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lease = json.loads(out.stdout.splitlines()[-1])
    # daemon down: the old programs and maps still enforce
    assert keep.ask(op="connect", host=world.pkg, port=443)["ok"]
    assert keep.ask(op="connect", host=world.ref, port=443) == {"errno": "EPERM"}
    gone.stop()
    pr_netns.remove(gone.netns)
    world.netns.remove(gone.netns)
    from dsecd.net import Network

    net2 = Network(cfg, state, V2, world.cgroup_root)
    try:
        res = net2.readopt({keep.name: (f"/run/netns/{keep.netns}", str(keep.cgroup))})
        assert res == {"adopted": [keep.name], "released": [gone.name], "failed": {}, "sealed": [], "held": []}
        view = net2.show(keep.name)
        assert view["lease"] == lease and view["terms"] == ["pypi"]
        assert net2.ipam.get(gone.name) is None
        assert keep.ask(op="connect", host=world.pkg, port=443)["ok"]
        assert keep.ask(op="connect", host=world.ref, port=443) == {"errno": "EPERM"}
        net2.update(keep.name, add=["refsol"])        # only works if the new programs are the attached ones
        assert keep.ask(op="connect", host=world.ref, port=443)["ok"]
        assert net2.show(keep.name)["rules"][-1]["allowed"] == 1
    finally:
        net2.detach(keep.name)
        net2.close()
    assert read_records(state / "net" / "records.log") == {}


def test_kernel_failure_at_the_flip_leaves_policy_unchanged(world, sandbox, monkeypatch):
    """A map update failing mid-update: old policy in force, nothing of the new one left."""
    a = sandbox(["pypi"])
    eng = world.net.engine
    base = (eng.prefixes_used, len(eng.counters.used))

    def fail(*_args):
        raise OSError(5, "update map `sandboxes`: Input/output error (injected)")

    monkeypatch.setattr(eng, "register", fail)
    with pytest.raises(OSError, match="injected"):
        world.net.update(a.name, replace=["refsol", "dns", "10.9.0.0/16:80/tcp"])
    monkeypatch.undo()
    assert world.net.show(a.name)["terms"] == ["pypi"]
    assert (eng.prefixes_used, len(eng.counters.used)) == base
    assert a.ask(op="connect", host=world.pkg, port=443)["ok"]
    assert a.ask(op="connect", host=world.ref, port=443) == {"errno": "EPERM"}


def test_record_write_failure_reverts_the_kernel(world, sandbox, monkeypatch):
    """kernel and record agree: a failed append re-applies the old policy before raising."""
    a = sandbox(["pypi", "refsol"])

    def fail(*_args):
        raise OSError(28, "append to `records.log`: No space left on device (injected)")

    monkeypatch.setattr(world.net.records, "put", fail)
    with pytest.raises(OSError, match="injected"):
        world.net.update(a.name, remove=["refsol"])
    monkeypatch.undo()
    assert world.net.show(a.name)["terms"] == ["pypi", "refsol"]
    assert a.ask(op="connect", host=world.ref, port=443)["ok"]


def test_pool_entry_joined_by_a_sandbox_and_nothing_left_at_close(world, tmp_path):
    from dsecd.net import Network

    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.4.0/24", pool_size=2)
    net = Network(cfg, tmp_path / "state", V2, world.cgroup_root)
    prefix = f"dp{net.tag}"
    try:
        deadline = time.monotonic() + 30
        while net.pool.stats()["ready"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert net.pool.stats()["ready"] == 2 and len(bridge_links(world, prefix)) == 2
        ready = net.take_ready()
        a = world.agent(nsfd=ready.nsfd)
        view = net.attach(a.name, a.proc.pid, a.cgroup, ["pypi"], ready=ready)
        assert view["interface"] == ready.name and view["lease"]["ipv4"] == str(ready.lease.ipv4)
        assert ready.nsfd == -1                          # the sandbox holds its netns now
        assert a.ask(op="connect", host=world.pkg, port=443) == {"ok": True, "data": "srv443:hello"}
        assert a.ask(op="connect", host=world.ref, port=443) == {"errno": "EPERM"}
        assert net.records.get(a.name)["ifname"] == ready.name
        # a pool entry handed to the wrong sandbox is refused and removed
        wrong = net.take_ready() or net.pool.take()
        b = world.agent()
        with pytest.raises(OSError, match="not the pooled netns"):
            net.attach(b.name, f"/run/netns/{b.netns}", b.cgroup, ["pypi"], ready=wrong)
        assert wrong.name not in bridge_links(world, prefix) and net.ipam.get(wrong.name) is None
        net.detach(a.name)
        assert ready.name not in bridge_links(world, prefix)
    finally:
        net.close()
    assert bridge_links(world, prefix) == []


def test_update_now_only_when_short(world, sandbox):
    """The event-loop path (Network.update_now) never waits and never takes big policies."""
    a = sandbox(["pypi"])
    assert world.net.update_now(a.name, add=["refsol"])["terms"] == ["pypi", "refsol"]
    assert a.ask(op="connect", host=world.ref, port=443)["ok"]
    held, release = threading.Event(), threading.Event()

    def hold():
        with world.net._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        assert world.net.update_now(a.name, remove=["refsol"]) is None     # busy: nothing done
    finally:
        release.set()
        t.join()
    assert world.net.show(a.name)["terms"] == ["pypi", "refsol"]
    many = [f"10.77.{i}.0/24:443/tcp" for i in range(100)]
    assert world.net.update_now(a.name, add=many) is None                  # large: a worker's job
    with pytest.raises(BadRequest):
        world.net.update_now(a.name, add=["10.0.0.0/33"])                  # errors as update()'s
    assert world.net.update_now("no-such-sandbox", add=["pypi"]) is None


def test_learned_addresses_are_capped_per_sandbox(world, sandbox, monkeypatch):
    """A name rule on a zone whose names map to any address (`*.amazonaws.com`:
    ec2-A-B-C-D.compute-1.amazonaws.com is A.B.C.D) must not let one sandbox
    learn addresses without end: the trie they go to is every sandbox's. At
    most net.dns_max_learned; past it the resolver answers SERVFAIL until
    some expire. A known address is still renewed."""
    import ipaddress

    from dsecd.net import rules as R
    from dsecd.net.network import Learned

    monkeypatch.setattr(world.net, "max_learned", 8)
    a = sandbox(["*.example.test:443/tcp"])
    rule = R.parse_rule("*.example.test:443/tcp")
    expires = time.monotonic() + 60

    def entry(i: int) -> dict:
        addr = int(ipaddress.IPv4Address(f"198.51.100.{i}"))
        return {rule.address_rule(R.FAM_V4, addr): Learned(expires + i, rule, f"h{i}.example.test")}

    for i in range(8):
        assert world.net.learn(a.name, entry(i)) is True
    assert world.net.learn(a.name, entry(8)) is False
    view = world.net.show(a.name)
    assert len(view["learned"]) == 8 and view["dns"]["learned_full"] == 1
    assert world.net.learn(a.name, {r: Learned(expires + 99, rule, "h3.example.test")
                                    for r in entry(3)}) is True


def test_sandboxes_at_their_learned_cap_leave_each_other_sandbox_its_share(world, sandbox, monkeypatch):
    """The learned budget is every sandbox's, but first come, first served:
    a few sandboxes at net.dns_max_learned would take all of it, and every
    other sandbox's lookups of allowed names would fail until theirs
    expire. Half of it is reserved, a share per sandbox at max_sandboxes:
    here 16 for all, 3 sandboxes at most, so 2 each always, 10 shared."""
    import ipaddress

    from dsecd.net import rules as R
    from dsecd.net.network import Learned

    net = world.net
    monkeypatch.setattr(net, "max_learned", 8)
    monkeypatch.setattr(net, "learned_budget", 16)
    monkeypatch.setattr(net, "max_sandboxes", 3, raising=False)
    rule = R.parse_rule("*.example.test:443/tcp")
    greedy, late = sandbox(["*.example.test:443/tcp"]), sandbox(["*.example.test:443/tcp"])
    quiet = sandbox(["*.example.test:443/tcp"])
    expires = time.monotonic() + 60
    n = iter(range(1, 250))

    def learn(sb) -> bool:
        i = next(n)
        addr = int(ipaddress.IPv4Address(f"198.51.100.{i}"))
        return net.learn(sb.name, {rule.address_rule(R.FAM_V4, addr): Learned(expires, rule, f"h{i}.example.test")})

    assert [learn(greedy) for _ in range(9)] == [True] * 8 + [False]        # its cap
    assert [learn(late) for _ in range(7)] == [True] * 6 + [False]          # its share + what is left shared
    assert [learn(quiet) for _ in range(3)] == [True, True, False]          # its share, whatever they hold
    assert net.learned_live() == 16
    assert net.learned_info()["reserved_per_sandbox"] == 2 and net.learned_info()["shared"] == 10


def test_accepted_marks_are_for_connections_from_outside_while_they_last(world, sandbox):
    """The map of connections a sandbox accepted (their answers pass its
    allowlist) is every sandbox's, an LRU of MAX_ACCEPTED: a sandbox making
    thousands of connections to itself pushed out another sandbox's mark of
    a long-lived connection from the host, whose answers were then dropped.
    Connections to itself (loopback, its own address) need no mark, and a
    mark goes when its connection closes."""
    import socket

    marks = world.net.engine.marks["accepted"]

    def count() -> int:
        return sum(1 for _ in marks.keys())

    a = sandbox([])
    own = world.net.show(a.name)["lease"]["ipv4"].split("/")[0]
    base = count()
    assert a.ask(op="listen", port=7100) == {"ok": True}
    for host in ("127.0.0.1", own):
        assert a.ask(op="selfconnect", host=host, port=7100, n=20) == {"ok": True}
    assert count() == base
    conn = world.in_bridge_netns(lambda: socket.create_connection((own, 7100), timeout=5))
    assert a.ask(op="accept", port=7100, hold="h") == {"ok": True}
    assert count() == base + 1                      # from outside: marked
    conn.close()
    assert a.ask(op="close", hold="h") == {"ok": True}
    deadline = time.monotonic() + 5
    while count() != base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count() == base                          # closed: its mark went with it


def test_udp_peers_are_marked_for_datagrams_from_outside_only(world, sandbox):
    """The peers a sandbox may answer from a published UDP port are in one
    LRU every sandbox shares: a sandbox sending datagrams to its own port
    from thousands of ports would push out another sandbox's peers, whose
    answers would then be refused. Datagrams from itself (loopback, its own
    address) need no mark; one from outside is marked."""
    import socket

    peers = world.net.engine.udp_peers

    def count() -> int:
        return sum(1 for _ in peers.keys())

    net = world.net
    a = sandbox([])
    own = net.show(a.name)["lease"]["ipv4"].split("/")[0]
    assert a.ask(op="udpbind", port=5353) == {"ok": True}
    net.publish(a.name, 5353, protocol="udp")
    base = count()
    for host in ("127.0.0.1", own):
        assert a.ask(op="udpself", host=host, port=5353, n=20) == {"ok": True}
    assert count() == base

    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"outside", (own, 5353))

    world.in_bridge_netns(send)
    deadline = time.monotonic() + 5
    while count() == base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count() == base + 1                      # from outside: marked
    net.unpublish(a.name, 5353, protocol="udp")
    assert count() == base                          # unpublished: its peers went with it


def test_a_publish_past_the_udp_published_map_s_size_is_a_limit(world, sandbox):
    """`udp_published` holds every sandbox's published UDP ports; when it
    is full a UDP publish is refused as the limit it is (the map's name and
    size), not as an I/O error, and leaves nothing behind: no DNAT, no port
    shown or recorded. A TCP port needs no entry and is still published."""
    from dsecd.net.policy import _UDP_GEN, _UDP_PORT

    net = world.net
    a = sandbox()
    ports = net.engine.udp_published
    taken = sum(1 for _ in ports.keys())
    # Entries of sandbox keys no cgroup has (ids count up from 1), to fill the map.
    fillers = [_UDP_PORT.pack((1 << 62) + i, b"\0\1") for i in range(ports.max_entries - taken)]
    ports.update_many([(k, _UDP_GEN.pack(1)) for k in fillers])
    try:
        with pytest.raises(LimitExceeded, match="udp_published is full") as got:
            net.publish(a.name, 5353, protocol="udp")
        assert got.value.detail == {"limit": "udp_published", "size": ports.max_entries}
        assert net.show(a.name)["ports"] == [] and _published_keys(world) == []
        assert read_records(net.records.path)[a.name].get("udp_ports", []) == []
        net.publish(a.name, 8080)
    finally:
        for k in fillers:
            ports.delete(k)
    net.publish(a.name, 5353, protocol="udp")
    assert sorted((p["port"], p["protocol"]) for p in net.show(a.name)["ports"]) == [(5353, "udp"), (8080, "tcp")]


def test_a_datagram_on_the_sandbox_s_loopback_marks_no_peer_whatever_its_source(world, sandbox):
    """Only the sandbox itself sends on its loopback: a datagram there to its
    published UDP port, from whatever source address, is its own and marks
    no peer. One with a foreign source (a sandbox with CAP_NET_ADMIN or
    CAP_NET_RAW in its netns can forge one: IP_TRANSPARENT, a raw socket)
    marked that address, and the sandbox could then send to it from the
    port whatever its allowlist said. Sent here from the host side, as
    root, in the sandbox's netns; to its own address (routed over
    loopback) and to 127.0.0.1."""
    import socket

    net = world.net
    a = sandbox([])
    own = net.show(a.name)["lease"]["ipv4"].split("/")[0]
    assert a.ask(op="udpbind", port=5353) == {"ok": True}
    net.publish(a.name, 5353, protocol="udp")
    ip_transparent = getattr(socket, "IP_TRANSPARENT", 19)

    def forge(src: tuple[str, int], dst: tuple[str, int]) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_IP, ip_transparent, 1)
            s.bind(src)
            s.sendto(b"forged", dst)

    for src, dst in ((("203.0.113.7", 40000), (own, 5353)), (("198.51.100.9", 40001), ("127.0.0.1", 5353))):
        world.in_netns(a.netns, forge, src, dst)
        assert a.ask(op="udpanswer", port=5353) == {"from": list(src), "errno": "EPERM"}
    # A datagram from outside still marks its sender.
    world.in_bridge_netns(forge, (f"10.{world.octet}.0.1", 40002), (own, 5353))
    assert a.ask(op="udpanswer", port=5353) == {"from": [f"10.{world.octet}.0.1", 40002], "ok": True}
    net.unpublish(a.name, 5353, protocol="udp")


def _udp_port_5353_published(world, sandbox):
    """A sandbox bound to UDP 5353 and publishing it: (its network service,
    the sandbox, the bridge's gateway, send(src_port): a datagram from the
    gateway's src_port to the sandbox's port, sent from the bridge's netns)."""
    import socket

    net = world.net
    a = sandbox([])
    own = net.show(a.name)["lease"]["ipv4"].split("/")[0]
    gateway = f"10.{world.octet}.0.1"
    assert a.ask(op="udpbind", port=5353) == {"ok": True}
    net.publish(a.name, 5353, protocol="udp")
    ip_transparent = getattr(socket, "IP_TRANSPARENT", 19)

    def send(src_port: int) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_IP, ip_transparent, 1)
            s.bind((gateway, src_port))
            s.sendto(b"ask", (own, 5353))

    return net, a, gateway, lambda src_port: world.in_bridge_netns(send, src_port)


def test_a_peer_left_in_udp_peers_is_not_answered_once_the_port_is_unpublished(world, sandbox):
    """Unpublish deletes the port's `udp_published` entry, then reads
    `udp_peers` for its peers and deletes them. A datagram whose
    dsec_ingress found the port still published, and marked its sender
    after that read, left a peer behind, and the sandbox could answer it
    from the port after the unpublish, whatever its allowlist said. A
    peer is answered only while its port is published; the leftover is
    made here by hand."""
    import socket

    from dsecd.net.policy import _FLOW, _UDP_PORT

    net, a, gateway, send = _udp_port_5353_published(world, sandbox)
    send(40010)
    assert a.ask(op="udpanswer", port=5353) == {"from": [gateway, 40010], "ok": True}
    key = net._sbs[a.name].cgroup_id
    publication = net.engine.udp_published.lookup(_UDP_PORT.pack(key, (5353).to_bytes(2, "big")))
    net.unpublish(a.name, 5353, protocol="udp")
    leftover = _FLOW.pack(key, socket.inet_aton(gateway) + bytes(12), (40011).to_bytes(2, "big"),
                          (5353).to_bytes(2, "big"), 4)
    net.engine.udp_peers.update(leftover, publication)      # marked under the publication that was
    try:
        send(40011)
        assert a.ask(op="udpanswer", port=5353) == {"from": [gateway, 40011], "errno": "EPERM"}
    finally:
        net.engine.udp_peers.delete(leftover)


def test_a_peer_marked_under_an_earlier_publication_is_not_answered_under_a_later_one(world, sandbox):
    """A datagram whose dsec_ingress found the port published, and marked
    its sender after the unpublish read `udp_peers`, leaves a mark behind.
    Once the port is published again that mark must not let the sandbox
    send to the peer: the peer wrote to an earlier publication, not to this
    one. It is answered again once it writes to this one. The leftover is
    made here as the race leaves it: the peer's own mark, read before the
    unpublish and written back after it."""
    import socket

    from dsecd.net.policy import _FLOW

    net, a, gateway, send = _udp_port_5353_published(world, sandbox)
    send(40020)
    assert a.ask(op="udpanswer", port=5353) == {"from": [gateway, 40020], "ok": True}
    assert a.ask(op="udpsendto", port=5353, host=gateway, to=40020) == {"ok": True}     # a marked peer
    peer = _FLOW.pack(net._sbs[a.name].cgroup_id, socket.inet_aton(gateway) + bytes(12),
                      (40020).to_bytes(2, "big"), (5353).to_bytes(2, "big"), 4)
    peers = net.engine.udp_peers
    mark = peers.lookup(peer)
    assert mark is not None
    net.unpublish(a.name, 5353, protocol="udp")
    assert peers.lookup(peer) is None
    peers.update(peer, mark)
    net.publish(a.name, 5353, protocol="udp")
    try:
        assert a.ask(op="udpsendto", port=5353, host=gateway, to=40020) == {"errno": "EPERM"}
        send(40020)          # it writes to this publication: answered again
        assert a.ask(op="udpanswer", port=5353) == {"from": [gateway, 40020], "ok": True}
        assert a.ask(op="udpsendto", port=5353, host=gateway, to=40020) == {"ok": True}
    finally:
        net.unpublish(a.name, 5353, protocol="udp")
    assert peers.lookup(peer) is None


def test_an_unpublish_reads_the_full_udp_peer_map_in_batches(world, sandbox, monkeypatch):
    """`udp_peers` is every sandbox's (65536 entries): an unpublish of a UDP
    port finds the port's peers in it while holding the Network's lock, so
    it reads the map in batches, not one bpf(2) call per key (65536 calls,
    ~0.25 s with every network request of the daemon waiting), and deletes
    those peers and no others: not the sandbox's other port's, nor other
    sandboxes'."""
    from dsecd.net import bpfsys
    from dsecd.net.policy import _FLOW, _UDP_GEN

    net = world.net
    a = sandbox()
    key = net._sbs[a.name].cgroup_id
    for port in (5353, 5354):
        net.publish(a.name, port, protocol="udp")
    peers = net.engine.udp_peers

    def flow(owner: int, i: int, port: int) -> bytes:
        return _FLOW.pack(owner, (0x0a000000 + i).to_bytes(4, "big") + bytes(12), (1024 + i % 60000).to_bytes(2, "big"),
                          port.to_bytes(2, "big"), 1)

    def theirs(port: int) -> int:
        return sum(1 for k in peers.keys() if (f := _FLOW.unpack_from(k))[0] == key and f[3] == port.to_bytes(2, "big"))

    # Another sandbox's peers fill the map; this one's go in last (an LRU drops the oldest).
    others = [flow((1 << 62) + i % 5, i, 7000) for i in range(peers.max_entries - 200)]
    own = [flow(key, i, 5353 + i % 2) for i in range(200)]
    peers.update_many([(k, _UDP_GEN.pack(1)) for k in others + own])
    try:
        kept, other_count = theirs(5354), sum(1 for k in peers.keys() if _FLOW.unpack_from(k)[0] != key)
        assert theirs(5353) > 0 and kept > 0 and other_count > peers.max_entries // 2
        calls = []
        real = bpfsys.bpf

        def counting(cmd, attr, what):
            calls.append(cmd)
            return real(cmd, attr, what)

        monkeypatch.setattr(bpfsys, "bpf", counting)
        net.unpublish(a.name, 5353, protocol="udp")
        monkeypatch.undo()
        assert len(calls) < 64, f"{len(calls)} bpf(2) calls"
        assert theirs(5353) == 0 and theirs(5354) == kept
        assert sum(1 for k in peers.keys() if _FLOW.unpack_from(k)[0] != key) == other_count
    finally:
        monkeypatch.undo()
        peers.delete_many(others + own)


def _published_keys(world) -> list[str]:
    """The comments (`<sandbox>:<port>`) of the DNAT rules in dsecd's table of the world's bridge netns."""
    from dsecd.net.nat import _nft, run

    items = run(_nft(f"/run/netns/{world.br_ns}"), [{"list": {"table": {"family": "inet", "name": "dsecd"}}}],
                "list the table")
    return sorted(it["rule"]["comment"] for it in items if "rule" in it and it["rule"].get("comment"))


def _failing_rule_deletes(nat, monkeypatch) -> None:
    """nftables refuses to delete any rule of dsecd's table from now on (until monkeypatch.undo())."""
    from dsecd.net.nat import NatError

    real = nat._run

    def run(cmds, what):
        if any("rule" in c.get("delete", {}) for c in cmds):
            raise NatError(errno.EIO, f"nftables: {what}: Input/output error (injected)")
        return real(cmds, what)

    monkeypatch.setattr(nat, "_run", run)


def test_a_failed_unpublish_keeps_the_port_until_its_dnat_is_gone(world, sandbox, monkeypatch):
    """A DNAT rule nftables did not delete still sends the host port's
    connections to the sandbox's address: the port stays published (shown,
    recorded, its host port taken) and a retry deletes it. A destroy that
    cannot delete it keeps the sandbox's address from being leased again,
    which would hand the port to the next sandbox given it, until a repeated
    detach deletes the rule."""
    a = sandbox()
    net = world.net
    net.publish(a.name, 8080)
    key = f"{a.name}:8080"
    assert _published_keys(world) == [key, key]
    _failing_rule_deletes(net.nat, monkeypatch)
    with pytest.raises(OSError, match="injected"):
        net.unpublish(a.name, 8080)
    assert _published_keys(world) == [key, key]
    assert [p["port"] for p in net.show(a.name)["ports"]] == [8080]
    assert [p["port"] for p in read_records(net.records.path)[a.name]["ports"]] == [8080]
    monkeypatch.undo()
    net.unpublish(a.name, 8080)
    assert _published_keys(world) == [] and net.show(a.name)["ports"] == []

    b = world.agent()
    net.attach(b.name, f"/run/netns/{b.netns}", b.cgroup)
    net.publish(b.name, 8080)
    addr = net.ipam.get(b.name).ipv4
    _failing_rule_deletes(net.nat, monkeypatch)
    with pytest.raises(OSError, match="injected"):
        net.detach(b.name)
    assert _published_keys(world) == [f"{b.name}:8080"] * 2
    assert net.ipam.get(b.name).ipv4 == addr          # not free for another sandbox while the DNAT stands
    assert b.name in read_records(net.records.path)
    monkeypatch.undo()
    net.detach(b.name)
    assert _published_keys(world) == [] and net.ipam.get(b.name) is None
    assert b.name not in read_records(net.records.path)


def test_a_retried_detach_leaves_a_sandbox_attached_since_alone(world, sandbox, monkeypatch):
    """The node retries a failed detach in the background, by sandbox id:
    a retry finishes a held detach, and leaves alone networking attached
    under that id since (not being detached)."""
    a = sandbox([f"{world.pkg}:443/tcp"])
    net = world.net
    net.retry_detach(a.name)                           # attached, not being detached: nothing
    assert net.show(a.name)["terms"] == [f"{world.pkg}:443/tcp"]
    assert a.ask(op="connect", host=world.pkg, port=443) == {"ok": True, "data": "srv443:hello"}
    b = world.agent()
    net.attach(b.name, f"/run/netns/{b.netns}", b.cgroup)
    monkeypatch.setattr(net.plumbing, "remove_sandbox", lambda _ifname: (_ for _ in ()).throw(
        OSError(errno.EBUSY, "delete veth: Device or resource busy (injected)")))
    with pytest.raises(OSError, match="injected"):
        net.detach(b.name)
    assert net.ipam.get(b.name) is not None and b.name in read_records(net.records.path)    # held
    monkeypatch.undo()
    net.retry_detach(b.name)
    assert net.ipam.get(b.name) is None and b.name not in read_records(net.records.path)
    b.stop()


def test_a_failed_readopt_cuts_the_sandbox_off_even_if_its_veth_stays(world, tmp_path, monkeypatch):
    """Networking that a restarted daemon cannot re-adopt is taken away
    (fail closed). If its veth cannot be deleted either, the sandbox must not
    keep it with no programs on its cgroup, i.e. with no egress policy at
    all: this daemon's programs stay on it and refuse everything."""
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.8.0/24")
    state = tmp_path / "state"
    a = world.agent()
    script = (
        "import json, sys\nfrom pathlib import Path\nfrom dsecd.net import Network\n"
        "cfg, state, root, name, ns, cg = json.loads(sys.argv[1])\n"
        "net = Network(cfg, Path(state), Path('/sys/fs/cgroup/unified'), root)\n"
        "net.attach(name, ns, cg, ['pypi'])\n")
    arg = json.dumps([cfg, str(state), world.cgroup_root, a.name, f"/run/netns/{a.netns}", str(a.cgroup)])
    out = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert a.ask(op="connect", host=world.pkg, port=443)["ok"]          # the old daemon's programs
    from dsecd.net import Network

    net2 = Network(cfg, state, V2, world.cgroup_root)
    try:
        def lost(_sb_id):
            raise OSError(errno.EADDRNOTAVAIL, "its address was lost (injected)")

        def stuck(_ifname):
            raise OSError(errno.EBUSY, "delete veth: Device or resource busy (injected)")

        monkeypatch.setattr(net2, "ipam_allocate", lost)
        monkeypatch.setattr(net2.plumbing, "remove_sandbox", stuck)
        res = net2.readopt({a.name: (f"/run/netns/{a.netns}", str(a.cgroup))})
        assert list(res["failed"]) == [a.name] and "injected" in res["failed"][a.name]
        assert res["sealed"] == [a.name]                # its veth stays: loopback refused too, and said
        assert a.ask(op="connect", host=world.pkg, port=443) == {"errno": "EPERM"}
        assert a.ask(op="connect", host=world.ref, port=443) == {"errno": "EPERM"}
        assert a.ask(op="udp", host=world.pkg, port=53) == {"errno": "EPERM"}
        # Its eth0 still has its address: no other sandbox is given it meanwhile.
        lease = read_records(state / "net" / "records.log")[a.name]["ipv4"]
        assert str(net2.ipam.get(a.name).ipv4) == lease
        # What is held of it is not networking: neither shown nor changed as
        # an attached sandbox's, and the resolver does not take it for one.
        for call in (lambda: net2.show(a.name), lambda: net2.update(a.name, add=[f"{world.ref}:443/tcp"])):
            with pytest.raises(Conflict, match="cut off"):
                call()
        assert net2.update_now(a.name, add=[f"{world.ref}:443/tcp"]) is None     # update() says why
        assert net2.client(lease.split("/")[0]) is None
        monkeypatch.undo()
    finally:
        net2.close()
    # The next daemon does not give it back the networking this one took
    # away (the node told everyone it is lost): it removes what is left.
    net3 = Network(cfg, state, V2, world.cgroup_root)
    try:
        res = net3.readopt({a.name: (f"/run/netns/{a.netns}", str(a.cgroup))})
        assert res["adopted"] == [] and list(res["failed"]) == [a.name] and res["sealed"] == [], res
        assert a.ask(op="connect", host=world.pkg, port=443) != {"ok": True, "data": "srv443:hello"}
        assert net3.ipam.get(a.name) is None and a.name not in read_records(state / "net" / "records.log")
        # With its veth gone it has loopback only, as said: not the refuse-all
        # programs the previous daemon left on its cgroup.
        assert a.ask(op="connect", host="127.0.0.1", port=9) == {"errno": "ECONNREFUSED"}
        assert a.ask(op="udp", host="127.0.0.1", port=9).get("errno") != "EPERM"
        net3.detach(a.name)                 # its destroy
    finally:
        net3.close()


def test_leftovers_of_a_gone_sandbox_spare_the_connections_of_its_address_s_new_owner(world, sandbox,
                                                                                       monkeypatch):
    """A record left by a sandbox that is gone names an address that is
    another live sandbox's lease now (its restore found it taken, or the
    pool changed): removing that record must not delete the conntrack
    entries of the address, which are the live sandbox's connections."""
    a = sandbox([f"{world.pkg}:443/tcp"])
    net = world.net
    addr = str(net.ipam.get(a.name).ipv4)
    gone = f"gone-{a.name}"[:24]
    net.records.put(gone, {"id": gone, "mode": "default", "cgroup_dir": "", "cgroup_id": 0, "terms": [],
                           "ifname": host_ifname(gone), "ipv4": addr, "ports": [], "kind": "container"})
    flushed = []
    real = net._forget_connections
    monkeypatch.setattr(net, "_forget_connections", lambda sb_id, ipv4: (flushed.append(ipv4), real(sb_id, ipv4)))
    net.detach(gone)                                  # a destroy of it, or a restart's clean-up
    assert gone not in read_records(net.records.path)
    assert flushed == [] and str(net.ipam.get(a.name).ipv4) == addr
    # Its own leftovers (its lease, nobody else's) are flushed.
    net.records.put(gone, {"id": gone, "mode": "default", "cgroup_dir": "", "cgroup_id": 0, "terms": [],
                           "ifname": host_ifname(gone), "ipv4": f"10.{world.octet}.250.9/16", "ports": [],
                           "kind": "container"})
    net.detach(gone)
    assert flushed == [f"10.{world.octet}.250.9/16"]


def test_a_gone_sandbox_s_veth_that_cannot_be_deleted_at_start_is_held_not_fatal(world, tmp_path, monkeypatch):
    """A destroy whose veth could not be deleted keeps the address leased
    and the record, and retries in the background; a restart meanwhile
    leaves it to the next start's clean-up of records no live sandbox has.
    If the veth still cannot be deleted then, that one record must neither
    take every sandbox's networking down (readopt raising) nor let go of the
    address its veth's other end still has: it is held, for detach to retry."""
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.9.0/24")
    state = tmp_path / "state"
    from dsecd.net import Network

    net = Network(cfg, state, V2, world.cgroup_root)
    try:
        gone = "gone-held-veth"
        addr = str(net.ipam.allocate(gone).ipv4)
        net.records.put(gone, {"id": gone, "mode": "default", "cgroup_dir": "", "cgroup_id": 0, "terms": [],
                               "ifname": host_ifname(gone), "ipv4": addr, "ports": [], "kind": "container"})
    finally:
        net.close()
    net2 = Network(cfg, state, V2, world.cgroup_root)
    try:
        def stuck(_ifname):
            raise OSError(errno.EBUSY, "delete veth: Device or resource busy (injected)")

        monkeypatch.setattr(net2.plumbing, "remove_sandbox", stuck)
        res = net2.readopt({})
        assert res["held"] == [gone] and gone not in res["released"], res
        assert str(net2.ipam.get(gone).ipv4) == addr
        assert gone in read_records(state / "net" / "records.log")
        monkeypatch.undo()
        net2.retry_detach(gone)                   # the service's retry, in the background
        assert net2.ipam.get(gone) is None and gone not in read_records(state / "net" / "records.log")
    finally:
        net2.close()
