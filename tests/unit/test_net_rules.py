"""Rule syntax, rule sets, merge semantics and trie compilation (no root)."""

from __future__ import annotations

import pytest

from dsecd.errors import BadRequest, LimitExceeded
from dsecd.net import rules as R

SETS = R.parse_rule_sets({"pypi": ["151.101.0.0/16:443/tcp", "151.101.0.0/16:80/tcp"],
                          "dns": ["10.0.0.53:53/udp", "10.0.0.53:53/tcp"]})


@pytest.mark.parametrize("text, canon, protos, ports", [
    ("10.0.0.0/8", "10.0.0.0/8", R.P_ANY, (0, 65535)),
    ("10.1.2.3", "10.1.2.3", R.P_ANY, (0, 65535)),
    ("10.1.2.0/24:443", "10.1.2.0/24:443", R.P_TCP | R.P_UDP, (443, 443)),
    ("10.1.2.0/24:443/tcp", "10.1.2.0/24:443/tcp", R.P_TCP, (443, 443)),
    ("10.1.2.0/24:1000-2000/UDP", "10.1.2.0/24:1000-2000/udp", R.P_UDP, (1000, 2000)),
    ("192.0.2.10:80/tcp", "192.0.2.10:80/tcp", R.P_TCP, (80, 80)),
    ("2001:db8::/32", "2001:db8::/32", R.P_ANY, (0, 65535)),
    ("[2001:db8::/32]:443/tcp", "[2001:db8::/32]:443/tcp", R.P_TCP, (443, 443)),
    ("[2001:db8::1]:53/udp", "[2001:db8::1]:53/udp", R.P_UDP, (53, 53)),
    (" 0.0.0.0/0 ", "0.0.0.0/0", R.P_ANY, (0, 65535)),
])
def test_parse_rule(text, canon, protos, ports):
    r = R.parse_rule(text)
    assert str(r) == canon
    assert r.protos == protos and (r.port_lo, r.port_hi) == ports
    assert R.parse_rule(str(r)) == r            # canonical text round-trips


@pytest.mark.parametrize("text, why", [
    ("", "empty"),
    ("10.0.0.0/33", "bad CIDR"),
    ("10.0.0.1/8", "host bits set; did you mean 10.0.0.0/8"),
    ("300.1.1.1", "bad CIDR"),
    ("10.0.0.0/8:0", "port 0 out of range"),
    ("10.0.0.0/8:65536", "port 65536 out of range"),
    ("10.0.0.0/8:99999999", "bad port"),
    ("10.0.0.0/8:200-100", "reversed"),
    ("10.0.0.0/8:80/sctp", "unknown protocol 'sctp'"),
    ("10.0.0.0/8/tcp", "needs a port"),
    ("10.0.0.0/8:http", "bad port"),
    ("[2001:db8::/32:443", "missing ']'"),
    ("[2001:db8::/32]443", "expected ':port'"),
    ("[::]/0:443/tcp", "did you mean '[::/0]:443/tcp'"),
    ("[2001:db8::]/32", "did you mean '[2001:db8::/32]'"),
    ("2001:db8::/32:443/tcp", "did you mean '[2001:db8::/32]:443/tcp'"),
    ("x" * 200, "longer than"),
    # An IPv4-mapped IPv6 address is IPv4 to the allowlist (the hooks look it up as such).
    ("[::ffff:10.1.2.3]:443/tcp", "did you mean '10.1.2.3:443/tcp'"),
    ("[::ffff:10.1.2.0/120]:443", "did you mean '10.1.2.0/24:443'"),
    ("::ffff:0:0/96", "did you mean '0.0.0.0/0'"),
    # A list in one term, or a URL: said so, not taken for an IPv6 rule or a host name.
    ("pypi.org:443/tcp,files.pythonhosted.org:443/tcp", "one rule per term: give each rule its own --allow"),
    ("pypi.org files.pythonhosted.org", "one rule per term"),
    ("10.0.0.0/8,10.1.0.0/16", "one rule per term"),
    ("https://pypi.org/simple", "not a URL: did you mean 'pypi.org:443/tcp'?"),
    ("http://example.org:8080", "not a URL: did you mean 'example.org:8080/tcp'?"),
])
def test_parse_rule_rejects(text, why):
    with pytest.raises(BadRequest) as ei:
        R.parse_rule(text)
    assert why in ei.value.message


def test_rule_sets_from_config():
    assert [str(r) for r in SETS["pypi"]] == ["151.101.0.0/16:443/tcp", "151.101.0.0/16:80/tcp"]
    with pytest.raises(ValueError, match="bad set name"):
        R.parse_rule_sets({"Bad Name": ["10.0.0.0/8"]})
    with pytest.raises(ValueError, match="net.rule_sets.x: bad rule"):
        R.parse_rule_sets({"x": ["10.0.0.0/8:0"]})
    with pytest.raises(ValueError, match="non-empty list"):
        R.parse_rule_sets({"x": []})



@pytest.mark.parametrize("net,says", [
    ({"rule_sets": {"x": 5}}, "net.rule_sets.x: must be a non-empty list"),
    ({"rule_sets": {"x": ["bogus rule"]}}, "net.rule_sets.x: bad rule"),
    ({"rule_sets": {"Bad Name": ["10.0.0.0/8"]}}, "net.rule_sets: bad set name"),
    ({"essentials": ["nosuchset"]}, "net.essentials: unknown rule set 'nosuchset'"),
    ({"ipv4_subnet": "garbage"}, "net.ipv4_subnet: .*'garbage'"),
    ({"ipv4_pool": "10.1.0.0/24"}, "net.ipv4_pool 10.1.0.0/24 is not inside"),
    ({"ipv6_subnet": "zz"}, "net.ipv6_subnet: .*'zz'"),
    ({"ipv4_pool": "bogus"}, "net.ipv4_pool: .*'bogus'"),
])
def test_a_bad_net_setting_stops_the_start(net, says):
    """Not only when the network is first built (the first --net default
    create, maybe hours later), which would leave networking unavailable
    with the daemon up and `dsec net sets` failing with an internal error."""
    from types import SimpleNamespace

    from dsecd.config import ConfigError, load_config
    from dsecd.engine.network import NetworkService

    defaults = load_config()
    cfg = SimpleNamespace(section=lambda name: defaults.section(name) | net, state_dir=None)
    with pytest.raises(ConfigError, match=says):
        NetworkService(cfg, None, "dsecd-test", 1, None, None, None)
    NetworkService(SimpleNamespace(section=defaults.section, state_dir=None), None, "dsecd-test", 1, None, None,
                   None)

def test_unknown_set_name():
    with pytest.raises(BadRequest, match=r"unknown rule set 'npm' \(known: dns, pypi\)") as info:
        R.canonical_term("npm", SETS)
    # It says how to give a rule instead, and where a set is defined.
    assert "[net.rule_sets]" in info.value.message and "npm = [" in info.value.message
    assert info.value.detail["known"] == ["dns", "pypi"]
    with pytest.raises(BadRequest, match=r"known: none configured.*\[net\.rule_sets\]"):
        R.canonical_term("pypi", {})


def test_merge_add_remove_replace():
    p = R.merge((), SETS, replace=["pypi", "10.1.0.0/16:443/tcp"])
    assert p == ("pypi", "10.1.0.0/16:443/tcp")
    # add: appends new terms; present ones (in any spelling) are a no-op
    p2 = R.merge(p, SETS, add=["dns", " 10.1.0.0/16:443/TCP", "192.0.2.10:80/tcp"])
    assert p2 == ("pypi", "10.1.0.0/16:443/tcp", "dns", "192.0.2.10:80/tcp")
    # remove: by set name or by rule (canonicalised)
    p3 = R.merge(p2, SETS, remove=["pypi", "192.0.2.10:80/tcp"])
    assert p3 == ("10.1.0.0/16:443/tcp", "dns")
    assert R.merge(p3, SETS, replace=[]) == ()


def test_merge_errors_leave_input_alone():
    p = ("pypi",)
    with pytest.raises(BadRequest, match="not in the policy"):
        R.merge(p, SETS, remove=["dns"])
    with pytest.raises(BadRequest, match="both added and removed"):
        R.merge(p, SETS, add=["dns"], remove=["dns"])
    with pytest.raises(BadRequest, match="cannot be combined"):
        R.merge(p, SETS, replace=["dns"], add=["pypi"])
    with pytest.raises(BadRequest, match="port 0"):
        R.merge(p, SETS, add=["dns", "10.0.0.0/8:0"])
    assert p == ("pypi",)


def test_remove_never_carves_holes():
    p = R.merge((), SETS, replace=["10.0.0.0/8", "10.1.0.0/16:443/tcp"])
    p = R.merge(p, SETS, remove=["10.1.0.0/16:443/tcp"])
    rules = R.expand(p, SETS)
    assert [str(r) for r in rules] == ["10.0.0.0/8"]     # 10.1/16 stays reachable through 10/8


def test_expand_dedupes_across_sets():
    rules = R.expand(("pypi", "151.101.0.0/16:443/tcp", "dns"), SETS)
    assert [str(r) for r in rules] == ["151.101.0.0/16:443/tcp", "151.101.0.0/16:80/tcp",
                                       "10.0.0.53:53/udp", "10.0.0.53:53/tcp"]


def test_size_limit():
    rules = [R.Rule(R.FAM_V4, (10 << 24) + i * 4, 30, 443, 443, R.P_TCP) for i in range(100_000)]
    with pytest.raises(LimitExceeded, match="100000 rules"):
        R.check_size(rules, 4096)


def test_compile_inherits_covering_prefixes():
    rules = [R.parse_rule(t) for t in ("10.0.0.0/8:443/tcp", "10.1.0.0/16:80/tcp", "10.1.2.3:22/tcp",
                                       "10.1.0.0/16:443/tcp", "0.0.0.0/0:53/udp")]
    out = R.compile_prefixes(rules)
    host = out[(R.FAM_V4, int.from_bytes(bytes([10, 1, 2, 3]), "big"), 32)]
    # most specific first; 10.1/16:443 already covers 10/8:443 there, so the latter is dropped
    assert [str(e.rule) for e in host] == ["10.1.2.3:22/tcp", "10.1.0.0/16:80/tcp", "10.1.0.0/16:443/tcp",
                                           "0.0.0.0/0:53/udp"]
    eight = out[(R.FAM_V4, 10 << 24, 8)]
    assert [str(e.rule) for e in eight] == ["10.0.0.0/8:443/tcp", "0.0.0.0/0:53/udp"]


def _key(text: str) -> tuple[int, int, int]:
    return R.parse_rule(text).key


def test_a_fence_keeps_broader_rules_out_and_lets_rules_inside_it_in():
    """The sandboxes' subnet and the host's address are fences: 0.0.0.0/0 does
    not reach into them; a rule naming an address inside does; the resolver's
    rule on the gateway stays the gateway's only entry."""
    subnet, host = _key("10.88.0.0/16"), _key("198.18.0.1")
    rules = [R.parse_rule(t) for t in ("0.0.0.0/0:443/tcp", "10.88.1.7:8080/tcp", "10.88.0.1:53")]
    out = R.compile_prefixes(rules, fences=(subnet, host))
    assert out[subnet] == [] and out[host] == []            # walled off: nothing allowed there
    assert [str(e.rule) for e in out[_key("10.88.1.7")]] == ["10.88.1.7:8080/tcp"]
    assert [str(e.rule) for e in out[_key("10.88.0.1")]] == ["10.88.0.1:53"]
    assert [str(e.rule) for e in out[_key("0.0.0.0/0")]] == ["0.0.0.0/0:443/tcp"]
    # A rule on the fence itself opens it, to the rules inside it.
    out = R.compile_prefixes(rules + [R.parse_rule("10.88.0.0/16:22/tcp")], fences=(subnet, host))
    assert [str(e.rule) for e in out[subnet]] == ["10.88.0.0/16:22/tcp"]
    assert [str(e.rule) for e in out[_key("10.88.1.7")]] == ["10.88.1.7:8080/tcp", "10.88.0.0/16:22/tcp"]
    # No rule covers a fence: it needs no entry (the default deny is enough).
    assert _key("198.18.0.1") not in R.compile_prefixes([R.parse_rule("10.0.0.0/8:443")], fences=(host,))
    # Only the keys asked for, as an update recompiles them.
    assert R.compile_prefixes(rules, only={subnet}, fences=(subnet, host)) == {subnet: []}
    assert R.touches_fence([R.parse_rule("0.0.0.0/0:80")], (host,))
    assert not R.touches_fence([R.parse_rule("192.0.2.0/24:80")], (subnet, host))


def test_link_scoped_prefixes_are_no_part_of_the_internet():
    """::/0 and 0.0.0.0/0 leave link-local, multicast and broadcast out (the
    bridge and every sandbox have an fe80:: address); naming them opens them."""
    fences = tuple(_key(n) for n in R.LINK_SCOPED)
    rules = [R.parse_rule(t) for t in ("[::/0]:22/tcp", "0.0.0.0/0:5353/udp")]
    out = R.compile_prefixes(rules, fences=fences)
    for net in R.LINK_SCOPED:
        assert out[_key(net)] == [], net
    out = R.compile_prefixes(rules + [R.parse_rule("[fe80::/10]:22")], fences=fences)
    assert [str(e.rule) for e in out[_key("fe80::/10")]] == ["[fe80::/10]:22"]
    # Metadata services the host reaches by its NAT, not link-local: fenced too.
    for metadata in ("100.100.100.200/32", "fd00:ec2::254/128"):
        assert metadata in R.LINK_SCOPED
    out = R.compile_prefixes([R.parse_rule("0.0.0.0/0:80/tcp")], fences=fences)
    assert out[_key("100.100.100.200/32")] == []


def test_compile_families_do_not_mix():
    out = R.compile_prefixes([R.parse_rule("::/0"), R.parse_rule("10.0.0.0/8:443/tcp")])
    assert [str(e.rule) for e in out[(R.FAM_V4, 10 << 24, 8)]] == ["10.0.0.0/8:443/tcp"]


def test_compile_too_many_entries_on_one_prefix():
    rules = [R.parse_rule(f"10.0.0.0/8:{p}/tcp") for p in range(1000, 1000 + R.MAX_ENTRIES + 1)]
    with pytest.raises(BadRequest, match="port/protocol entries apply to 10.0.0.0/8"):
        R.compile_prefixes(rules)
    R.compile_prefixes(rules[:R.MAX_ENTRIES])


def test_compile_thousand_rules_is_fast():
    import time

    rules = [R.parse_rule(f"10.{i // 250}.{i % 250}.0/24:443/tcp") for i in range(1000)]
    rules.append(R.parse_rule("10.0.0.0/8:80/tcp"))
    t = time.perf_counter()
    out = R.compile_prefixes(rules)
    assert len(out) == 1001
    assert time.perf_counter() - t < 1.0


def test_incremental_compile_matches_full():
    import random

    rnd = random.Random(7)
    pool = [R.parse_rule(t) for t in ("0.0.0.0/0:53/udp", "10.0.0.0/8:443/tcp", "10.1.0.0/16", "10.1.2.0/24:80/tcp",
                                      "10.1.2.3:22/tcp", "10.2.0.0/16:8000-9000/tcp", "[::/0]:53/udp",
                                      "[2001:db8::/32]:443/tcp", "2001:db8::1", "192.0.2.0/24")]
    for _ in range(200):
        # policies keep the relative order of surviving rules, so sample in pool order
        old = [r for r in pool if rnd.random() < 0.6]
        new = [r for r in pool if rnd.random() < 0.6]
        full_old, full_new = R.compile_prefixes(old), R.compile_prefixes(new)
        keys = full_old.keys() | {(r.family, r.addr, r.plen) for r in new}
        affected = R.affected_prefixes(set(old) ^ set(new), keys)
        inc = dict(full_old)
        part = R.compile_prefixes(new, only=affected)
        for k in affected:
            if k in part:
                inc[k] = part[k]
            else:
                inc.pop(k, None)
        assert inc == full_new
