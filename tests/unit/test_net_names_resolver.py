"""Name rules need the sandboxes' resolver (engine/network.py
NetworkService.check_names): without it they are refused, saying why, not
taken to allow nothing (no root: the check runs before any kernel work)."""

from types import SimpleNamespace

import pytest

from dsecd.engine.network import NetworkService
from dsecd.errors import BadRequest
from dsecd.net import rules as R

NET = SimpleNamespace(sets=R.parse_rule_sets({"pypi": ["pypi.org:443/tcp", "files.pythonhosted.org:443/tcp"],
                                              "lan": ["10.1.0.0/16:443/tcp"]}))


def _service(resolver=None, dns_error=None) -> NetworkService:
    ops = NetworkService(SimpleNamespace(section=lambda name: {}, state_dir=None), None, "dsecd-test", 1,
                         None, None, None)
    ops.resolver, ops.dns_error = resolver, dns_error
    return ops


def test_name_rules_are_refused_while_no_resolver_runs():
    with pytest.raises(BadRequest) as err:
        _service().check_names(NET, ["10.2.0.0/16", "pypi", "github.com:443/tcp"])
    assert err.value.message == (
        "name rules (pypi.org:443/tcp, files.pythonhosted.org:443/tcp, github.com:443/tcp) allow the addresses "
        "the daemon's resolver answers, and its resolver is off (net.dns = false); give addresses (CIDR rules) "
        "instead")
    with pytest.raises(BadRequest, match=r"its resolver did not start: net.dns_refuse must be"):
        _service(dns_error="net.dns_refuse must be 'refused' or 'nxdomain'").check_names(NET, ["pypi.org"])


def test_address_rules_need_no_resolver_and_names_pass_with_one():
    _service().check_names(NET, ["10.2.0.0/16", "lan", "[2001:db8::/32]:443/tcp"])
    _service().check_names(NET, [])
    _service(resolver=object()).check_names(NET, ["pypi", "*.github.com:443/tcp"])
    # A bad term is the rule's own error, as without the check.
    with pytest.raises(BadRequest, match="unknown rule set 'nosuch'"):
        _service().check_names(NET, ["nosuch"])
