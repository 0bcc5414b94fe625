"""The [memory] settings the memory service reads at start: one that is
out of range or contradicts another stops the start as a config error
naming the key (dsecd/daemon.py turns a ConfigError into one log line),
not as an uncaught exception with a traceback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsecd.config import ConfigError, load_config
from dsecd.engine.memory import MemoryService


@pytest.mark.parametrize("memory, says", [
    ({"swapfile": {"priority": 40000}}, "memory.swapfile.priority must be -1..32767"),
    ({"swapfile": {"size": "4K"}}, "memory.swapfile.size must be at least 10 pages"),
    ({"zram": {"priority": 40000}}, "memory.zram.priority must be -1..32767"),
    ({"zram": {"size": "4K"}}, "memory.zram.size must be at least 10 pages"),
    ({"zram": {"size": "0"}}, "memory.zram.size must be at least 10 pages"),
    ({"damon": {"wmark_metric": "x"}}, "memory.damon.wmark_metric must be none or free_mem_rate"),
    ({"damon": {"wmark_high": 2000}}, "memory.damon.wmark_low <= wmark_mid <= wmark_high <= 1000"),
    ({"damon": {"min_nr_regions": 0}}, "memory.damon.min_nr_regions"),
    ({"damon": {"sample_us": 200000}}, "memory.damon.sample_us <= aggr_us <= update_us"),
])
def test_a_bad_memory_setting_is_a_config_error_naming_the_key(tmp_path, memory, says):
    cfg = load_config(overrides={"daemon": {"state_dir": str(tmp_path)}, "memory": memory})
    with pytest.raises(ConfigError) as err:
        MemoryService(cfg, "dsecd-unit", SimpleNamespace(by_id={}), None, None)
    assert says in str(err.value), str(err.value)


def test_the_default_memory_settings_make_a_service(tmp_path):
    cfg = load_config(overrides={"daemon": {"state_dir": str(tmp_path)}})
    MemoryService(cfg, "dsecd-unit", SimpleNamespace(by_id={}), None, None).mem_pool.shutdown()
