"""Name rules need the sandboxes' resolver (engine/network.py
NetworkService.check_names): without it they are refused, saying why, not
taken to allow nothing (no root: the check runs before any kernel work)."""

import asyncio
from types import SimpleNamespace

import pytest

from dsecd.config import load_config
from dsecd.engine.network import NetworkService
from dsecd.errors import BadRequest, LimitExceeded
from dsecd.net import rules as R

SETS = R.parse_rule_sets({"pypi": ["pypi.org:443/tcp", "files.pythonhosted.org:443/tcp"],
                          "lan": ["10.1.0.0/16:443/tcp"]})


def _Net():
    """The real size checks (Network's), without a network."""
    from dsecd.net.network import Network

    net = object.__new__(Network)
    net.sets, net.max_rules = SETS, 100
    return net


class _Workers:
    def __init__(self):
        self.ran = 0

    async def run(self, fn, *args):
        self.ran += 1
        return fn(*args)


def _service(resolver=None, dns_error=None) -> NetworkService:
    ops = NetworkService(SimpleNamespace(section=load_config().section, state_dir=None), None, "dsecd-test", 1,
                         None, None, None)
    ops.resolver, ops.dns_error = resolver, dns_error
    ops.workers = _Workers()
    return ops


def _check(svc, terms):
    asyncio.run(svc.check_names(_Net(), terms))


def test_name_rules_are_refused_while_no_resolver_runs():
    with pytest.raises(BadRequest) as err:
        _check(_service(), ["10.2.0.0/16", "pypi", "github.com:443/tcp"])
    assert err.value.message == (
        "name rules (pypi.org:443/tcp, files.pythonhosted.org:443/tcp, github.com:443/tcp) allow the addresses "
        "the daemon's resolver answers, and its resolver is off (net.dns = false); give addresses (CIDR rules) "
        "instead")
    with pytest.raises(BadRequest, match=r"its resolver did not start: net.dns_refuse must be"):
        _check(_service(dns_error="net.dns_refuse must be 'refused' or 'nxdomain'"), ["pypi.org"])


def test_address_rules_need_no_resolver_and_names_pass_with_one():
    _check(_service(), ["10.2.0.0/16", "lan", "[2001:db8::/32]:443/tcp"])
    _check(_service(), [])
    _check(_service(resolver=object()), ["pypi", "*.github.com:443/tcp"])
    # A bad term is the rule's own error, as without the check.
    with pytest.raises(BadRequest, match="unknown rule set 'nosuch'"):
        _check(_service(), ["nosuch"])


def test_a_request_too_large_is_refused_before_its_terms_are_parsed():
    """Parsing is ~30 us a term: 300,000 of them (a 16 MiB frame holds
    more) held the loop every client shares for 9.5 s. Named sets count
    whole; the same term twice counts once."""
    svc = _service()
    with pytest.raises(LimitExceeded):
        _check(svc, [f"10.0.{i}.0/24" for i in range(101)])
    with pytest.raises(LimitExceeded):
        _check(svc, [f"10.0.{i}.0/24" for i in range(99)] + ["pypi"])
    assert svc.workers.ran == 0
    _check(svc, ["10.0.0.0/8"] * 1000 + ["lan"])
    assert svc.workers.ran == 0                 # small: parsed at once
    _check(svc, [f"10.0.{i}.0/24" for i in range(100)])
    assert svc.workers.ran == 1                 # large: parsed in a worker
