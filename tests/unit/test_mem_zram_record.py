"""The zram device a daemon makes is recorded (<state_dir>/zram.json) as
soon as hot_add hands it out, so that one left half made by a daemon killed
while making it is removed at the next start; a device the record names
that is not this daemon's is never touched. On a fixture sysfs."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from dsecd.config import load_config
from dsecd.engine import memory as memsvc
from dsecd.mem import zram
from dsecd.mem.zram import MM_STAT_FIELDS


def _device(sys_root, dev_root, n: int) -> None:
    """What hot_add makes: /sys/block/zramN (no disksize yet) and /dev/zramN."""
    block = sys_root / "block" / f"zram{n}"
    block.mkdir(parents=True)
    for name, value in {"comp_algorithm": "lzo [lzo-rle] lz4", "reset": "", "disksize": "0", "mem_limit": "0",
                        "mm_stat": " ".join(["0"] * len(MM_STAT_FIELDS))}.items():
        (block / name).write_text(value)
    (dev_root / f"zram{n}").write_bytes(b"")


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A fixture sysfs whose hot_add hands out the number in its file, and a
    ZramSwap made by the service that looks there."""
    sys_root, dev_root = tmp_path / "sys", tmp_path / "dev"
    control = sys_root / "class" / "zram-control"
    control.mkdir(parents=True)
    dev_root.mkdir()
    (control / "hot_remove").write_text("")
    real = zram.ZramSwap.__init__

    def init(self, cfg, sys_root_=None, dev_root_=None, owner=""):
        real(self, cfg, sys_root, dev_root, owner=owner)

    monkeypatch.setattr(zram.ZramSwap, "__init__", init)
    monkeypatch.setattr(zram.native, "swapon", lambda path, prio: None)
    return SimpleNamespace(sys=sys_root, dev=dev_root, control=control, state=tmp_path / "state")


def _service(host, enabled: bool = True) -> memsvc.MemoryService:
    host.state.mkdir(exist_ok=True)
    cfg = load_config(overrides={"daemon": {"state_dir": str(host.state)},
                                 "memory": {"zram": {"enabled": enabled, "size": "1M", "algorithm": "lz4"}}})
    svc = memsvc.MemoryService(cfg, "dsecd-unit", SimpleNamespace(by_id={}), None, None)
    svc.mem_pool.shutdown()
    return svc


def _killed_while_making_its_device(host) -> None:
    """A daemon killed -9 after hot_add, before its device is swap."""
    (host.control / "hot_add").write_text("7\n")
    _device(host.sys, host.dev, 7)
    pid = os.fork()
    if pid == 0:
        try:
            svc = _service(host)
            svc.zram._write_header = lambda: os._exit(9)
            svc.start()
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9


def test_a_device_left_half_made_by_a_killed_daemon_is_removed_at_the_next_start(host):
    _killed_while_making_its_device(host)
    (host.control / "hot_add").write_text("8\n")
    _device(host.sys, host.dev, 8)
    svc = _service(host)
    svc.start()
    assert (host.sys / "block" / "zram7" / "reset").read_text() == "1"
    assert (host.control / "hot_remove").read_text() == "7"
    assert svc.zram.device == 8 and json.loads((host.state / "zram.json").read_text())["device"] == 8
    assert zram.read_owner(host.dev / "zram8") == str(host.state)


def test_with_zram_disabled_the_next_start_removes_it_too(host):
    _killed_while_making_its_device(host)
    svc = _service(host, enabled=False)
    svc.start()
    assert (host.control / "hot_remove").read_text() == "7"
    assert svc.zram.device is None and not (host.state / "zram.json").exists()


@pytest.mark.parametrize("header", ["another daemon's", "not dsecd's", "another boot's"])
def test_a_recorded_device_that_is_not_this_daemons_is_left_alone(host, header):
    """The number was handed out again since (after a reboot, or once the
    device was removed behind the daemon's back): someone else's now."""
    _device(host.sys, host.dev, 7)
    host.state.mkdir()
    boot = memsvc.boot_id()
    if header == "another daemon's":
        (host.dev / "zram7").write_bytes(zram.swap_header(1 << 20, owner="/var/lib/other-dsecd"))
    elif header == "not dsecd's":
        (host.dev / "zram7").write_bytes(zram.swap_header(1 << 20, label=b"host-swap"))
    else:
        boot = "an-earlier-boot"
    (host.state / "zram.json").write_text(json.dumps({"device": 7, "boot_id": boot}))
    svc = _service(host, enabled=False)
    svc.start()
    assert (host.control / "hot_remove").read_text() == ""
    assert (host.sys / "block" / "zram7" / "reset").read_text() == ""
    assert not (host.state / "zram.json").exists()


def test_a_device_another_daemon_made_and_left_on_is_neither_adopted_nor_removed(host, monkeypatch):
    """Its number in this daemon's record (this daemon's device was removed
    behind its back, and the number handed to another daemon since)."""
    _device(host.sys, host.dev, 7)
    host.state.mkdir()
    (host.dev / "zram7").write_bytes(zram.swap_header(1 << 20, owner="/var/lib/other-dsecd"))
    monkeypatch.setattr(zram, "active_swaps", lambda: {str(host.dev / "zram7")})
    (host.state / "zram.json").write_text(json.dumps({"device": 7, "boot_id": memsvc.boot_id()}))
    (host.control / "hot_add").write_text("8\n")
    _device(host.sys, host.dev, 8)
    svc = _service(host)
    svc.start()
    assert svc.zram.device == 8
    assert (host.control / "hot_remove").read_text() == ""
    svc.registry.by_id.clear()
    monkeypatch.setattr(zram, "active_swaps", lambda: {str(host.dev / "zram7"), str(host.dev / "zram8")})
    monkeypatch.setattr(zram.native, "swapoff", lambda path: None)
    svc.close()                     # its own device goes, the other's stays
    assert (host.control / "hot_remove").read_text() == "8"
    assert (host.sys / "block" / "zram7" / "reset").read_text() == ""
