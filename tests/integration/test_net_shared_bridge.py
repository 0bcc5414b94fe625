"""Two daemons of one host on one bridge (as two daemons with the default
config share dsec0): their sandboxes never get the same address."""

from __future__ import annotations

import json
import signal

import pytest
from test_net_kit import bpf_skip_reason

from dsecd.errors import Busy

pytestmark = pytest.mark.skipif(bpf_skip_reason() is not None, reason=bpf_skip_reason() or "")


def _config(world) -> str:
    cfg = world.cfg
    lines = ["[net]", 'default_mode = "none"', "pool_size = 0", f'host_netns = "{world.br_ns}"',
             f'bridge = "{cfg["bridge"]}"', f'ipv4_subnet = "{world.subnet}"',
             f'ipv4_pool = "10.{world.octet}.6.0/31"',                   # two addresses
             f'dns_upstreams = ["10.{world.octet}.2.54"]', "[net.rule_sets]"]     # test-owned, nothing there
    lines += [f"{k} = {json.dumps(v)}" for k, v in cfg["rule_sets"].items()]
    return "\n".join(lines) + "\n"


def _address(sb) -> str:
    out = sb.exec(["ip", "-4", "-o", "addr", "show", "eth0"]).stdout.decode().split()
    return out[out.index("inet") + 1]


def test_two_daemons_on_one_bridge_never_hand_out_one_address(world, daemon_factory, busybox_rootfs):
    first, second = daemon_factory(_config(world)), daemon_factory(_config(world))
    c1, c2 = first.client(), second.client()
    for c in (c1, c2):
        c.import_image(busybox_rootfs, "busybox")
    a = c1.create(image="busybox", net="default")
    b = c2.create(image="busybox", net="default")
    addr_a = _address(a)
    assert _address(b) != addr_a
    # Killed -9 and started again: its sandbox claims its address again, so
    # the second daemon's next lease, round robin to the pool's first
    # address, passes it over.
    c1.close()
    first.stop(signal.SIGKILL)
    first.start()
    c1 = first.client()
    b.destroy(force=True)
    b2 = c2.create(image="busybox", net="default")
    assert _address(b2) != addr_a
    with pytest.raises(Busy, match="held by another daemon on this bridge"):
        c2.create(image="busybox", net="default")
    assert _address(c1.get(a.id)) == addr_a
    for sb in (c1.get(a.id), b2):
        sb.destroy(force=True)
    c1.close()
    c2.close()
