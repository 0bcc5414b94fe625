"""MemoryService.info: what `dsec info` says of dsecd's own swap."""

from __future__ import annotations

from types import SimpleNamespace

from dsecd.config import load_config
from dsecd.engine.memory import MemoryService
from dsecd.mem import zram


def test_the_zram_device_says_its_size_and_use_as_the_swap_file_does(tmp_path, monkeypatch):
    """A full zram device (a paused sandbox's anon pages then go to the
    swap file, or stay) must show in `dsec info`, not only that it is on."""
    cfg = load_config(overrides={"daemon": {"state_dir": str(tmp_path)}, "memory": {"zram": {"enabled": True}}})
    svc = MemoryService(cfg, "dsecd-unit", SimpleNamespace(by_id={}), None, None)
    svc.mem_pool.shutdown()
    monkeypatch.setattr(zram, "swap_areas", lambda *a: {"/dev/zram7": {"size": 512 << 20, "used": 500 << 20}})
    monkeypatch.setattr(svc.zram, "stats", lambda: {"mem_used_total": 260 << 20})
    svc.zram.device = 7
    out = svc.info()["zram"]
    assert out["on"] and out["device"] == "/dev/zram7", out
    assert (out["size"], out["used"]) == (512 << 20, 500 << 20), out


def test_dsec_info_prints_the_zram_use_and_the_ram_it_takes(capsys):
    import asyncio

    from dsecd import cli

    class Info:
        async def info(self):
            return {"version": "0.1.0", "protocol": 1, "pid": 1, "uptime_s": 5.0, "kernel": "6.1",
                    "cgroup_mode": "v2", "cgroup_controllers": {}, "features": {}, "limits": {},
                    "sandboxes": {}, "paths": {},
                    "memory": {"zram": {"enabled": True, "device": "/dev/zram7", "on": True, "size": 512 << 20,
                                        "used": 500 << 20, "stats": {"mem_used_total": 260 << 20}}}}

    assert asyncio.run(cli.cmd_info(Info(), cli.parse_args(["info"]))) == 0
    out = capsys.readouterr().out
    assert "swap zram: on /dev/zram7, 500.0M of 512.0M used, 260.0M of RAM" in out, out
