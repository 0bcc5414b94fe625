"""The netns pool and live updates through the daemon: pooled creates work, nothing of
the pool outlives a shutdown or a kill -9, updates racing with destroy stay clean.

The bridge lives in a test-owned netns (test_net_kit.World) and the servers in
another; traffic never leaves namespaces this test made.
"""

import json
import signal
import threading
import time

import pytest
from test_net_kit import bpf_skip_reason, bridge_links

from dsecd.errors import Conflict, DsecError, NotFound
from dsecd.journal import read_records
from dsecd.net.network import pool_tag

pytestmark = pytest.mark.skipif(bpf_skip_reason() is not None, reason=bpf_skip_reason() or "")


def _config(world, pool_size: int) -> str:
    cfg = world.cfg
    lines = ["[net]", 'default_mode = "none"', f"pool_size = {pool_size}", f'host_netns = "{world.br_ns}"',
             f'bridge = "{cfg["bridge"]}"', f'ipv4_subnet = "{world.subnet}"',
             f'ipv4_pool = "10.{world.octet}.5.0/24"',
             f'dns_upstreams = ["10.{world.octet}.2.54"]', "[net.rule_sets]"]     # test-owned, nothing there
    lines += [f"{k} = {json.dumps(v)}" for k, v in cfg["rule_sets"].items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def pooled(world, daemon_factory, busybox_rootfs):
    d = daemon_factory(_config(world, 2))
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    yield d, c, f"dp{pool_tag(d.state)}"
    c.close()


def _connect(sb, host, port):
    r = sb.exec(["sh", "-c", f"echo ping | nc -w 2 {host} {port}"], timeout=20)
    return r.exit_code, (r.stdout + r.stderr).decode()


def _wait(cond, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _pool(c) -> dict:
    return c.info()["net"].get("pool", {})


def test_pooled_create_and_nothing_left_after_shutdown(world, pooled):
    d, c, prefix = pooled
    sb = c.create(image="busybox", net="default", allow=["pypi"])    # builds the Network (+ pool)
    _wait(lambda: _pool(c).get("ready") == 2, "the pool to fill")
    sb2 = c.create(image="busybox", net="default", allow=["pypi"])
    view = sb2.net_show()
    assert view["interface"].startswith(prefix)                       # it took a pool entry
    assert _pool(c)["taken"] >= 1 and _pool(c)["create_p50_ms"] > 0
    code, out = _connect(sb2, world.pkg, 80)
    assert code == 0 and "srv80:ping" in out
    assert _connect(sb2, world.ref, 443)[0] != 0                       # the policy guards the pooled link
    sb2.destroy()
    sb.destroy()
    _wait(lambda: _pool(c).get("ready") == 2, "the pool to refill")
    assert len(bridge_links(world, prefix)) == 2                       # only the ready entries
    d.stop(signal.SIGTERM)
    assert bridge_links(world, prefix) == []                           # shutdown removed them


def test_kill_9_leaves_no_pool_entry_behind(world, pooled):
    d, c, prefix = pooled
    first = c.create(image="busybox", net="default", allow=["pypi"])
    _wait(lambda: _pool(c).get("ready") == 2, "the pool to fill")
    sb = c.create(image="busybox", net="default", allow=["pypi"])      # a pooled one this time
    mine = sb.net_show()["interface"]
    assert mine.startswith(prefix)
    # The first create may have taken a pool entry too, if one was ready by then.
    theirs = {mine, first.net_show()["interface"]} & {*bridge_links(world, prefix)}
    c.close()
    d.stop(signal.SIGKILL)
    # The pool's netns were held only by the daemon's fds: the kernel frees them and their veths.
    _wait(lambda: set(bridge_links(world, prefix)) == theirs, "the dead daemon's pool entries to go")
    d.start()
    c2 = d.client()
    s2 = c2.get(sb.id)
    assert s2.net_show()["interface"] == mine                          # re-adopted, veth kept
    assert _connect(s2, world.pkg, 80)[0] == 0 and _connect(s2, world.ref, 443)[0] != 0
    _wait(lambda: _pool(c2).get("ready") == 2, "the new pool to fill")
    assert len(bridge_links(world, prefix)) == len(theirs) + 2          # the sandboxes' + 2 ready
    # New entries are numbered past the adopted sandboxes' names: none failed on a name in use.
    assert _pool(c2).get("failed", 0) == 0, _pool(c2)
    s2.destroy()
    c2.get(first.id).destroy()
    c2.close()
    d.stop(signal.SIGTERM)
    assert bridge_links(world, prefix) == []
    assert read_records(d.state / "net" / "records.log") == {}


def test_updates_racing_with_destroy(world, pooled):
    """net_set from several clients while the sandbox is destroyed: each update is applied
    whole or refused (busy/not_found/conflict), never half; nothing is left afterwards."""
    d, c, prefix = pooled
    sb = c.create(image="busybox", net="default", allow=["pypi"])
    iface = sb.net_show()["interface"]
    errors, stop = [], threading.Event()

    def churn(i: int):
        cl = d.client()
        try:
            s = cl.get(sb.id)
            n = 0
            while not stop.is_set():
                try:
                    s.net_set(replace=["pypi", "dns"] if n % 2 else ["refsol"])
                    n += 1
                except (NotFound, Conflict):
                    return
                except DsecError as err:
                    if err.code in ("not_found", "conflict", "busy"):
                        return
                    errors.append(err)
                    return
        finally:
            cl.close()

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    sb.destroy()
    stop.set()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert iface not in bridge_links(world, prefix) and iface not in bridge_links(world, "ds")
    assert sb.id not in read_records(d.state / "net" / "records.log")
