"""A refusal for want of room says its figures in a person's units, not
bare byte counts: the `busy` a full host answers a create with (what the
sandboxes here ask for, what this one asks, the bound), and the `limit`
of a write past a sandbox's memory."""

from types import SimpleNamespace

import pytest

from dsecd.cpu import admission
from dsecd.cpu.manager import CpuHost
from dsecd.errors import BadRequest, Busy

GiB = 1 << 30


def _host(cpus: int, mem_total: int, cpu_ratio: float = 64.0, mem_ratio: float = 4.0):
    """What CpuHost.admit reads of itself: its capacity and its sampler's last pass."""
    return SimpleNamespace(capacity=admission.Capacity(cpus, mem_total, cpu_ratio, mem_ratio, 0.0),
                           sampler=SimpleNamespace(latest=SimpleNamespace(host={})))


def test_a_host_full_of_memory_says_it_in_gigabytes():
    host = _host(2, 24 * GiB)
    with pytest.raises(Busy) as info:
        CpuHost.admit(host, admission.Requested(cpu=4.0, memory=92 * GiB, sandboxes=4), 1.0, 23 * GiB, ls=False)
    assert str(info.value.message) == (
        "host at capacity for memory: its sandboxes ask for 92.0G and this one 23.0G, more than the 96.0G "
        "it admits (4 x its 24.0G of memory; 4.0G left); retry later or on another host")
    assert info.value.detail["requested"] == 92 * GiB      # the figures stay in bytes for a program


def test_a_host_nearly_full_of_memory_says_the_room_left():
    """Rounded, what the sandboxes ask for reads as the bound itself: the
    room left says why 100M does not fit."""
    host = _host(2, 24 * GiB, mem_ratio=1.0)
    with pytest.raises(Busy) as info:
        CpuHost.admit(host, admission.Requested(cpu=4.0, memory=24 * GiB - (50 << 20), sandboxes=90), 0.1,
                      100 << 20, ls=False)
    assert "its sandboxes ask for 24.0G and this one 100.0M, more than the 24.0G it admits (1 x its 24.0G of " \
           "memory; 50.0M left)" in info.value.message, info.value.message


def test_a_host_full_of_cpu_says_it_in_cpus():
    host = _host(2, 24 * GiB, cpu_ratio=2.0)
    with pytest.raises(Busy) as info:
        CpuHost.admit(host, admission.Requested(cpu=3.5, memory=GiB, sandboxes=4), 1.0, 256 << 20, ls=False)
    assert str(info.value.message) == (
        "host at capacity for cpu: its sandboxes ask for 3.5 CPUs and this one 1, more than the 4 it admits "
        "(2 x its 2 CPUs); retry later or on another host")


def test_a_write_past_the_memory_limit_says_its_sizes_as_a_person_reads_them(monkeypatch):
    """dsec cp into a full sandbox: the refusal's sizes in M, not bytes."""
    from dsecd.engine import copier
    from dsecd.errors import LimitExceeded

    monkeypatch.setattr(copier.pause, "charge", lambda group: (32 << 20, 31 << 20))
    monkeypatch.setattr(copier.pause, "droppable_cache", lambda group: 0)
    with pytest.raises(LimitExceeded) as info:
        copier.check_room(object(), 4 << 20, "sb:/work/big")
    assert info.value.message.startswith(
        "write sb:/work/big: 4.0M would take the sandbox past its memory limit (32.0M; 1.0M left, less 2.0M "
        "kept for its processes)"), info.value.message
    assert info.value.detail == {"path": "sb:/work/big", "size": 4 << 20, "left": 1 << 20, "reserve": 2 << 20}


def test_a_sandbox_too_big_for_the_host_says_its_memory_in_gigabytes():
    from dsecd.cpu import qos

    host = _host(2, 24 * GiB)
    host.plan = lambda qos_name: SimpleNamespace(qos=qos.BE)
    with pytest.raises(BadRequest) as info:
        CpuHost.check_possible(host, 1.0, 100 * GiB, None)
    assert info.value.message.startswith("asks for 100.0G of memory, more than this host can ever give a "
                                         "sandbox ("), info.value.message


def test_a_sandbox_just_past_the_host_says_sizes_that_read_apart():
    """`dsec info` shows a host's memory as 23.5G; `--memory 23.5G` may be a
    little more than the bytes it has. Both rounded to 23.5G, the refusal
    read "asks for 23.5G, more than ... (23.5G)": the bytes say the difference."""
    from dsecd.cpu import qos

    mem_total = 25_231_130_624                      # 23.498G: shown as 23.5G
    host = _host(2, mem_total, mem_ratio=1.0)
    host.plan = lambda qos_name: SimpleNamespace(qos=qos.BE)
    asking = int(23.5 * GiB)
    with pytest.raises(BadRequest) as info:
        CpuHost.check_possible(host, 1.0, asking, None)
    assert info.value.message.startswith(
        f"asks for 23.5G ({asking} bytes) of memory, more than this host can ever give a sandbox "
        f"(23.5G ({mem_total} bytes))"), info.value.message


def test_sizes_that_read_alike_get_their_bytes_and_others_do_not():
    from dsecd.config import size_texts

    assert size_texts(100 * GiB, 24 * GiB) == ["100.0G", "24.0G"]
    assert size_texts(GiB, GiB) == ["1.0G", "1.0G"]             # the same size: read alike, rightly
    assert size_texts(GiB + 1, GiB) == [f"1.0G ({GiB + 1} bytes)", f"1.0G ({GiB} bytes)"]
