"""The resolver's learned addresses: all sandboxes together hold at most a
quarter of net.max_prefixes, half of which is reserved as an equal share per
sandbox at limits.max_sandboxes (Network.learned_shares). A share that rounds
to 0 reserves nothing: sandboxes at their cap starve the others again. No
root: the arithmetic and the config check only."""

import json

import pytest

from dsecd import daemon
from dsecd.config import ConfigError, load_config
from dsecd.engine.network import _check_config
from dsecd.net.network import Network


def _shares(max_prefixes: int, max_sandboxes: int, max_learned: int = 256) -> tuple[int, int]:
    net = object.__new__(Network)
    net.max_learned, net.learned_budget, net.max_sandboxes = max_learned, max_prefixes // 4, max_sandboxes
    return net.learned_shares()


def test_the_defaults_reserve_eight_a_sandbox():
    assert _shares(262144, 4096) == (8, 262144 // 4 - 8 * 4096)


def test_a_small_trie_still_reserves_one_a_sandbox_within_the_quarter():
    # A quarter of 128 is 32: an eighth of it over 20 sandboxes rounds to 0.
    reserved, shared = _shares(128, 20)
    assert reserved == 1 and shared == 32 - 20
    assert _shares(128, 32) == (1, 0)                 # the whole quarter, one each


def test_the_share_never_exceeds_what_a_sandbox_may_hold():
    assert _shares(262144, 1, max_learned=5) == (5, 262144 // 4 - 5)
    assert _shares(262144, 4096, max_learned=0) == (0, 262144 // 4)


def _net(**over) -> dict:
    return {**load_config().section("net"), **over}


def test_a_trie_too_small_for_one_learned_address_a_sandbox_is_refused_saying_what_to_give():
    with pytest.raises(ConfigError) as err:
        _check_config(_net(max_prefixes=128), 4096)
    msg = str(err.value)
    assert msg.startswith("net.max_prefixes = 128") and "limits.max_sandboxes = 4096" in msg, msg
    assert "at least 16384" in msg, msg
    _check_config(_net(max_prefixes=128), 32)                   # one each fits
    _check_config(_net(max_prefixes=128, dns=False), 4096)     # nothing is learned
    _check_config(_net(max_prefixes=128, dns_max_learned=0), 4096)


def test_check_config_refuses_it_naming_the_key(tmp_path, capsys):
    conf = tmp_path / "dsecd.toml"
    conf.write_text("[net]\nmax_prefixes = 128\n")
    with pytest.raises(SystemExit) as err:
        daemon.main(["--check-config", str(conf), "--json"])
    said = json.loads(capsys.readouterr().out)
    assert err.value.code == 1 and said["key"] == "net.max_prefixes", said
    conf.write_text("[limits]\nmax_sandboxes = 8\n[net]\nmax_prefixes = 128\n")
    with pytest.raises(SystemExit) as err:
        daemon.main(["--check-config", str(conf), "--json"])
    assert err.value.code == 0, capsys.readouterr().out
