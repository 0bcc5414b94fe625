"""dsecd.mem.pause and dsecd.mem.zram pieces that need no root: freezer state
machines on fixture cgroup files, the working-set record, the swap header."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from pathlib import Path

import pytest

from dsecd import cgroup
from dsecd.mem import pause as mp
from dsecd.mem.zram import MM_STAT_FIELDS, SWAP_MAGIC, ZramConfig, ZramError, ZramSwap, swap_header


def _group(tmp_path: Path, v2: bool) -> cgroup.Group:
    if v2:
        layout = cgroup.Layout(v2=tmp_path / "unified", v2_controllers=frozenset())
    else:
        layout = cgroup.Layout(v2=None, v2_controllers=frozenset(), v1={"freezer": tmp_path / "freezer"})
    g = cgroup.Group(layout, "dsecd/sb1")
    for d in g.dirs.values():
        d.mkdir(parents=True)
    return g


def test_v1_freezer_state_and_freeze(tmp_path):
    g = _group(tmp_path, v2=False)
    state = g.dirs["freezer"] / "freezer.state"
    state.write_text("THAWED\n")
    f = mp.Freezer.of(g)
    assert f.version == "v1" and f.state() == "THAWED"
    f.freeze(1.0)                # a plain file "becomes" FROZEN on the write
    assert state.read_text().strip() == "FROZEN"
    f.thaw()
    assert f.state() == "THAWED"


def test_v2_freeze_times_out_and_thaws_again(tmp_path):
    g = _group(tmp_path, v2=True)
    d = g.dirs[cgroup.V2]
    (d / "cgroup.freeze").write_text("0\n")
    (d / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    f = mp.Freezer.of(g)
    assert f.version == "v2" and f.state() == "THAWED"

    with pytest.raises(mp.PauseError) as exc:
        f.freeze(0.05)           # cgroup.events never says frozen 1
    assert exc.value.errno == errno.EBUSY and "thawed again" in str(exc.value)
    assert (d / "cgroup.freeze").read_text().strip() == "0"
    (d / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    (d / "cgroup.freeze").write_text("1")
    assert f.state() == "FROZEN"


def test_no_freezer_is_eopnotsupp(tmp_path):
    g = cgroup.Group(cgroup.Layout(v2=None, v2_controllers=frozenset()), "dsecd/x")
    with pytest.raises(mp.PauseError) as exc:
        mp.Freezer.of(g)
    assert exc.value.errno == errno.EOPNOTSUPP


def test_resident_ranges_cover_touched_memory():
    size = 64 * mp.PAGE
    buf = ctypes.create_string_buffer(size + mp.PAGE)
    addr = (ctypes.addressof(buf) + mp.PAGE - 1) // mp.PAGE * mp.PAGE
    ctypes.memset(addr, 1, size)
    ranges = mp.resident_ranges(os.getpid())
    assert any(s <= addr and addr + size <= s + n for s, n in ranges)
    assert all(s % mp.PAGE == 0 and n % mp.PAGE == 0 for s, n in ranges)


def test_mappings_skip_special_vmas():
    names = {name for _s, _e, name in mp.mappings(os.getpid())}
    assert "[vdso]" not in names and "[vvar]" not in names
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert mp.mappings(pid_max + 1) == [] and mp.resident_ranges(pid_max + 1) == []


def test_pause_record_json_roundtrip():
    rec = mp.PauseRecord(frozen_s=0.001, before={"total": 10}, after={"total": 4},
                         methods={"limit": 6}, working_set={123: [(4096, 8192)]}, notes=["x"])
    back = mp.PauseRecord.from_json(rec.to_json())
    assert back.working_set == {123: [(4096, 8192)]} and back.freed == 6 and back.notes == ["x"]


def test_swap_header_layout():
    page = swap_header(64 << 20, 4096)
    assert len(page) == 4096 and page[-10:] == SWAP_MAGIC
    version, last_page, nr_bad = struct.unpack_from("<III", page, 1024)
    assert (version, last_page, nr_bad) == (1, (64 << 20) // 4096 - 1, 0)
    assert page[:1024] == bytes(1024)
    with pytest.raises(ValueError):
        swap_header(4096 * 5, 4096)


def test_zram_without_module_is_a_clear_error(tmp_path):
    z = ZramSwap(ZramConfig(enabled=True), sys_root=tmp_path)
    ok, why = z.available()
    assert not ok and "modprobe zram" in why
    with pytest.raises(ZramError) as exc:
        z.setup()
    assert exc.value.errno == errno.ENODEV
    z.teardown()                 # nothing made: nothing to undo


def test_zram_unknown_algorithm_is_refused_and_device_removed(tmp_path):
    """hot_add hands out device 5; the algorithm is missing; teardown resets
    and hot_removes device 5 (and only it)."""
    control = tmp_path / "class" / "zram-control"
    control.mkdir(parents=True)
    (control / "hot_add").write_text("5\n")
    (control / "hot_remove").write_text("")
    block = tmp_path / "block" / "zram5"
    block.mkdir(parents=True)
    for name, value in {"comp_algorithm": "lzo [lzo-rle] lz4", "reset": "", "disksize": "0",
                        "mm_stat": " ".join(["0"] * len(MM_STAT_FIELDS))}.items():
        (block / name).write_text(value)
    z = ZramSwap(ZramConfig(enabled=True, algorithm="zstd"), sys_root=tmp_path, dev_root=tmp_path)
    with pytest.raises(ZramError) as exc:
        z.setup()
    assert exc.value.errno == errno.EINVAL and "lzo lzo-rle lz4" in str(exc.value)
    assert (control / "hot_remove").read_text() == "5" and (block / "reset").read_text() == "1"
    assert z.device is None


def test_prefetch_mode_is_checked_and_none_does_nothing():
    with pytest.raises(ValueError):
        mp.prefetch({1: [(4096, 4096)]}, mode="eager")
    assert mp.prefetch({1: [(4096, 4096)]}, mode="none") == (0, 0)


def test_default_config_builds_every_memory_config():
    """dsecd/default.toml's [memory] tables and the from_section readers agree."""
    import tomllib

    from dsecd.mem.damon import DamonConfig

    defaults = (Path(__file__).resolve().parents[2] / "dsecd" / "default.toml").read_text()
    cfg = tomllib.loads(defaults)["memory"]
    pc = mp.PauseConfig.from_section(cfg)
    assert pc == mp.PauseConfig()                       # the documented defaults are the code's
    z = ZramConfig.from_section(cfg["zram"])
    assert z == ZramConfig()
    from dsecd.mem.swapfile import SwapfileConfig

    assert SwapfileConfig.from_section(cfg["swapfile"], "/var/lib/dsecd") == SwapfileConfig()
    d = DamonConfig.from_section(cfg["damon"], "/var/lib/dsecd")
    assert d.cold_age_us == DamonConfig().cold_age_us and d.quota_bytes == 64 << 20
    assert d.state_file == "/var/lib/dsecd/damon.json"
    with pytest.raises(ValueError):
        mp.PauseConfig.from_section({**cfg, "v1_reclaim": ["soft_limit"]})


def _v1_freezers(tmp_path, n: int, state: str) -> list:
    """n v1 freezer groups, each reading `state`."""
    freezers = []
    for i in range(n):
        g = _group(tmp_path / str(i), v2=False)
        (g.dirs["freezer"] / "freezer.state").write_text(f"{state}\n")
        freezers.append(mp.Freezer.of(g))
    return freezers


def test_freeze_all_asks_every_group_first(tmp_path):
    freezers = _v1_freezers(tmp_path, 3, "THAWED")
    assert mp.freeze_all(freezers, 1.0) == []
    assert all(f.state() == "FROZEN" for f in freezers)


def test_thaw_all_thaws_every_group_and_reports_the_ones_it_could_not(tmp_path):
    freezers = _v1_freezers(tmp_path, 3, "FROZEN")
    (freezers[1].dir / "freezer.state").unlink()            # its group vanished meanwhile
    assert mp.thaw_all(freezers, 1.0) == [freezers[1]]
    assert freezers[0].state() == "THAWED" and freezers[2].state() == "THAWED"


def test_reclaim_frozen_refuses_a_running_group(tmp_path):
    g = _group(tmp_path, v2=False)
    (g.dirs["freezer"] / "freezer.state").write_text("THAWED\n")
    with pytest.raises(mp.PauseError) as exc:
        mp.reclaim_frozen(g)
    assert exc.value.errno == errno.EBUSY and "not FROZEN" in str(exc.value)


def test_an_on_demand_resume_prefetches_the_working_set_behind_the_request():
    # dsecd/engine/memory.py ensure_running: the pause record is read before the
    # resume, which clears it (it was read after, so no prefetch ever ran).
    import asyncio
    from types import SimpleNamespace

    from dsecd.engine.memory import MemoryService

    rec = mp.PauseRecord(working_set={42: [(4096, 8192)]})
    group = object()
    sb = SimpleNamespace(id="sb1", state="paused", pause_record=rec.to_json(), last_active=0.0, pausing=False,
                         handle=SimpleNamespace(group=group))
    behind = []

    async def resume(s, mode):
        assert mode == "none"                  # thaw only: the request is not held up
        s.state, s.pause_record = "running", None

    node = SimpleNamespace(auto_resume=True, _resume=resume, pause_cfg=SimpleNamespace(prefetch_mode="populate"),
                           _behind_answer=lambda s, fn, *args: behind.append((s.id, fn, args)))
    asyncio.run(MemoryService.ensure_running(node, sb, "exec"))
    # With the group: the prefetch stops short of its memory limit (prefetch_room).
    assert behind == [("sb1", mp.prefetch, ({42: [(4096, 8192)]}, "populate", group))]


def test_a_prefetch_brings_back_no_more_than_the_room_its_group_has(monkeypatch):
    """A working set larger than the sandbox's memory limit (the rest was in
    swap before the pause) is cut where the room ends, at a page."""
    import os

    page = mp.native.PAGE_SIZE
    populated = []
    monkeypatch.setattr(mp, "prefetch_room", lambda group: 3 * page + 100)
    monkeypatch.setattr(mp.native, "process_populate",
                        lambda pid, ranges: populated.append(ranges) or
                        mp.native.MadviseResult(sum(n for _, n in ranges), 0, 0))
    done, skipped = mp.prefetch({os.getpid(): [(0x1000, 2 * page), (0x10000, 4 * page)]}, "populate", object())
    assert populated == [[(0x1000, 2 * page), (0x10000, page)]]
    assert (done, skipped) == (3 * page, 0)
    populated.clear()
    mp.prefetch({os.getpid(): [(0x1000, 2 * page)]}, "populate")        # no group: no cap
    assert populated == [[(0x1000, 2 * page)]]


def test_a_prefetch_spends_its_room_on_pages_that_are_not_mapped(monkeypatch):
    """Pages of the working set still mapped cost the group nothing to bring
    back: with little room, it goes to the pages that are out (in swap)."""
    import ctypes
    import mmap
    import os

    page = mp.native.PAGE_SIZE
    area = mmap.mmap(-1, 4 * page)
    try:
        area[0] = area[page] = 1                     # pages 0 and 1 mapped, 2 and 3 not
        first = ctypes.c_char.from_buffer(area)
        start = ctypes.addressof(first)
        del first                                    # (or the map cannot be closed)
        populated = []
        monkeypatch.setattr(mp, "prefetch_room", lambda group: 2 * page + 100)
        monkeypatch.setattr(mp.native, "process_populate",
                            lambda pid, ranges: populated.append(ranges) or
                            mp.native.MadviseResult(sum(n for _, n in ranges), 0, 0))
        done, _ = mp.prefetch({os.getpid(): [(start, 4 * page)]}, "populate", object())
        assert populated == [[(start + 2 * page, 2 * page)]]
        assert done == 2 * page
        populated.clear()
        # Room for all of it: the ranges go as recorded, no pagemap read.
        monkeypatch.setattr(mp, "unmapped_ranges", lambda pid, ranges: [])
        monkeypatch.setattr(mp, "prefetch_room", lambda group: 4 * page)
        mp.prefetch({os.getpid(): [(start, 4 * page)]}, "populate", object())
        assert populated == [[(start, 4 * page)]]
    finally:
        area.close()


def test_an_op_on_a_vm_being_paused_waits_for_the_pause_then_resumes_it():
    # dsecd/engine/memory.py ensure_running: a VM's pause holds the sandbox's
    # lock while it saves the guest and ends QEMU, its state still "running";
    # an exec that went ahead then met the ending channel ("is exiting").
    import asyncio
    from types import SimpleNamespace

    from dsecd.engine.memory import MemoryService

    async def main():
        sb = SimpleNamespace(id="vm1", backend="microvm", state="running", pause_record=None, last_active=0.0,
                             lock=asyncio.Lock())
        resumed = []

        async def resume(s, mode=None):
            resumed.append(s.id)
            s.state = "running"

        node = SimpleNamespace(auto_resume=True, _resume=resume)
        await sb.lock.acquire()                 # the pause, under way
        op = asyncio.ensure_future(MemoryService.ensure_running(node, sb, "exec"))
        await asyncio.sleep(0.01)
        assert not op.done(), "the exec went on while the VM was being paused"
        sb.state = "paused"
        sb.lock.release()
        await asyncio.wait_for(op, 1)
        assert resumed == ["vm1"]

    asyncio.run(main())


def test_an_op_on_a_container_being_paused_waits_for_the_pause_then_resumes_it():
    # dsecd/engine/memory.py ensure_running: a pause holds the sandbox's lock
    # from its freeze through its reclaim (seconds into swap), its state
    # still "running"; an exec that went ahead joined the frozen cgroup and
    # stood there, its timeout not counting, until someone resumed it.
    import asyncio
    from types import SimpleNamespace

    from dsecd.engine.memory import MemoryService

    async def main():
        sb = SimpleNamespace(id="sb1", backend="container", state="running", pause_record=None, last_active=0.0,
                             lock=asyncio.Lock(), pausing=True)
        resumed = []

        async def resume(s, mode=None):
            resumed.append(s.id)
            s.state = "running"

        node = SimpleNamespace(auto_resume=True, _resume=resume, _behind_answer=None,
                               pause_cfg=SimpleNamespace(prefetch_mode="populate"))
        await sb.lock.acquire()                 # the pause, under way
        op = asyncio.ensure_future(MemoryService.ensure_running(node, sb, "exec"))
        await asyncio.sleep(0.01)
        assert not op.done(), "the exec went on while the sandbox was being paused"
        sb.state, sb.pausing = "paused", False
        sb.lock.release()
        await asyncio.wait_for(op, 1)
        assert resumed == ["sb1"]

    asyncio.run(main())


def test_an_op_on_a_container_being_snapshotted_does_not_wait_for_its_lock():
    # A snapshot holds the lock too, for as long as its pack takes: a file
    # read, which the daemon serves without the sandbox's processes, goes on.
    import asyncio
    from types import SimpleNamespace

    from dsecd.engine.memory import MemoryService

    async def main():
        sb = SimpleNamespace(id="sb1", backend="container", state="running", pause_record=None, last_active=0.0,
                             lock=asyncio.Lock(), pausing=False)
        node = SimpleNamespace(auto_resume=True)
        async with sb.lock:
            await asyncio.wait_for(MemoryService.ensure_running(node, sb, "file read"), 1)

    asyncio.run(main())


def test_swap_of_groups_is_read_from_each_hierarchy_s_files(tmp_path):
    """v2: memory.swap.current; v1: memsw less usage (memsw counts both). A
    group without the files (gone, no swap accounting) is left out."""
    from types import SimpleNamespace

    v1, v2, bare = tmp_path / "v1", tmp_path / "v2", tmp_path / "bare"
    for d in (v1, v2, bare):
        d.mkdir()
    (v1 / "memory.memsw.usage_in_bytes").write_text("30000\n")
    (v1 / "memory.usage_in_bytes").write_text("10000\n")
    (v2 / "memory.swap.current").write_text("4096\n")
    (bare / "memory.usage_in_bytes").write_text("10000\n")

    def group(version, d):
        return SimpleNamespace(dir_for=lambda ctl: (version, d), rel=str(d))

    got = mp.swapped({"a": group("v1", v1), "b": group("v2", v2), "c": group("v1", bare)})
    assert got == {"a": 20000, "b": 4096}
