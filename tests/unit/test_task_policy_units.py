"""dsecd/policy.py: task policies validated with errors that name the field,
the ABI each field needs, and the plan of Landlock rules they compile to
(the kernel side is tests/integration/test_task_policies.py)."""

from __future__ import annotations

import struct

import pytest

from dsecd import policy as P
from dsecd.config import ConfigError, load_config

RO, W = P.READ_ONLY, P.FS_ALL


def test_shipped_policies_parse_and_agent_hides_the_grader():
    named = P.named(load_config().raw["policy"])
    assert set(named) >= {"agent", "grader", "unrestricted"}
    agent = named["agent"]
    assert "/grader" in agent.hidden and "/usr" in agent.read_only and "/workspace" in agent.writable
    assert agent.scope_signals and agent.scope_abstract_unix
    assert not named["unrestricted"].restricts() and named["unrestricted"].compile() is None


@pytest.mark.parametrize("table, field", [
    ("not a table", "policy.t"),
    ({"read_only": "/usr"}, "policy.t.read_only"),
    ({"read_only": ["usr"]}, "policy.t.read_only[0]"),
    ({"writable": ["/a", 3]}, "policy.t.writable[1]"),
    ({"hidden": ["/a/../b"]}, "policy.t.hidden[0]"),
    ({"hidden": ["/a/"]}, "policy.t.hidden[0]"),
    ({"hidden": ["//a"]}, "policy.t.hidden[0]"),
    ({"hidden": ["/a\0b"]}, "policy.t.hidden[0]"),
    ({"read_only": ["/a"], "hidden": ["/a"]}, "policy.t.hidden[0]"),
    ({"writable": ["/"]}, "policy.t.writable"),
    ({"rest": "secret"}, "policy.t.rest"),
    ({"tcp_bind": 80}, "policy.t.tcp_bind"),
    ({"tcp_connect": [80, 65536]}, "policy.t.tcp_connect[1]"),
    ({"tcp_connect": [True]}, "policy.t.tcp_connect[0]"),
    ({"scope_signals": "yes"}, "policy.t.scope_signals"),
    ({"hiden": ["/x"]}, "policy.t.hiden"),
    ({"capabilities": "KILL"}, "policy.t.capabilities"),
    ({"capabilities": ["KILL", "NOT_A_CAP"]}, "policy.t.capabilities"),
])
def test_a_bad_policy_names_its_field(table, field):
    with pytest.raises(P.PolicyError) as exc:
        P.parse("t", table)
    assert exc.value.field == field
    assert field in str(exc.value)


def test_an_inline_policy_names_the_request_field():
    with pytest.raises(P.PolicyError, match=r"^exec: policy\.hidden\[0\]"):
        P.parse(P.INLINE, {"hidden": ["x"]}, where="exec: policy")


def test_bad_config_policy_stops_the_daemon_with_its_name(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[policy.mine]\nhidden = ["relative"]\n')
    with pytest.raises(ConfigError, match=r"policy\.mine\.hidden\[0\]"):
        load_config(str(f))
    f.write_text('[policy.Bad]\nrest = "writable"\n')
    with pytest.raises(ConfigError, match="policy.Bad"):
        load_config(str(f))


def test_a_config_table_replaces_a_shipped_policy_whole(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[policy.agent]\nhidden = ["/answers"]\n[policy.mine]\nrest = "writable"\n')
    named = P.named(load_config(str(f)).raw["policy"])
    assert named["agent"].hidden == ("/answers",) and named["agent"].read_only == ()
    assert not named["agent"].scope_signals
    assert "mine" in named and "unrestricted" in named


def test_capabilities_narrow_the_sandboxs_set_and_need_no_landlock():
    from dsecd.caps import cap_mask

    sandbox = cap_mask(["CHOWN", "KILL", "NET_BIND_SERVICE"])
    pol = P.parse("t", {"rest": "writable", "capabilities": ["cap_kill", "SYS_ADMIN"]})
    assert pol.capabilities == ("KILL", "SYS_ADMIN")
    assert pol.cap_keep(sandbox) == cap_mask(["KILL"])          # never more than the sandbox's
    assert P.parse("t", {"capabilities": []}).cap_keep(sandbox) == 0
    assert P.parse("t", {}).cap_keep(sandbox) == sandbox
    assert pol.needs() == {} and pol.compile() is None and pol.spec()["capabilities"] == ["KILL", "SYS_ADMIN"]


def test_needs_names_the_abi_of_each_restricting_field():
    pol = P.parse("t", {"hidden": ["/g"], "tcp_connect": [443], "scope_signals": True})
    assert pol.needs() == {"hidden": 3, "rest": 3, "tcp_connect": 4, "scope_signals": 6}
    pol.check(6)
    with pytest.raises(P.PolicyError) as exc:
        pol.check(4)
    assert exc.value.unsupported == {"abi": 4, "needs": {"scope_signals": 6}}
    assert "scope_signals (ABI >= 6)" in str(exc.value)
    with pytest.raises(P.PolicyError, match="no Landlock"):
        pol.check(0)
    # Writable alone under a writable rest restricts nothing: no file rights handled.
    assert P.parse("t", {"rest": "writable", "writable": ["/w"]}).needs() == {}


def test_plan_for_a_hidden_path_grants_its_siblings_not_its_ancestors():
    pol = P.parse("t", {"read_only": ["/usr"], "writable": ["/work"], "hidden": ["/grader"]})
    assert pol.plan() == [
        (P.CHILDREN, "/", RO, ("grader", "usr", "work")),
        (P.RULE, "/usr", RO, ()),
        (P.RULE, "/work", W, ()),
    ]


def test_plan_narrowing_inside_a_writable_tree_keeps_what_both_share():
    pol = P.parse("t", {"rest": "writable", "read_only": ["/usr"], "hidden": ["/usr/share/secret"],
                        "writable": ["/usr/share/secret/pub"]})
    assert pol.plan() == [
        (P.CHILDREN, "/", W, ("usr",)),
        (P.CHILDREN, "/usr", RO, ("share",)),
        (P.CHILDREN, "/usr/share", RO, ("secret",)),
        (P.RULE, "/usr/share/secret/pub", W, ()),
    ]


def test_plan_widening_only_needs_no_listing():
    pol = P.parse("t", {"writable": ["/tmp", "/home/u"]})
    assert pol.plan() == [(P.RULE, "/", RO, ()), (P.RULE, "/home/u", W & ~RO, ()), (P.RULE, "/tmp", W & ~RO, ())]


def _rights(plan, path: str, listing: dict[str, list[str]]) -> int:
    """What the plan grants at `path`, simulated as the kernel adds rules up
    (`listing`: the entries CHILDREN finds in a directory)."""
    rules: dict[str, int] = {}
    for kind, p, access, names in plan:
        if kind == P.RULE:
            rules[p] = rules.get(p, 0) | access
        else:
            for entry in listing.get(p, []):
                if entry not in names:
                    child = p.rstrip("/") + "/" + entry
                    rules[child] = rules.get(child, 0) | access
    got, node = 0, path
    while True:
        got |= rules.get(node, 0)
        if node == "/":
            return got
        node = node.rsplit("/", 1)[0] or "/"


def test_plan_gives_every_path_exactly_its_level():
    pol = P.parse("t", {"read_only": ["/usr", "/w/ro"], "writable": ["/w", "/usr/share/hidden/pub"],
                        "hidden": ["/g", "/usr/share/hidden", "/w/ro/secret"]})
    listing = {"/": ["usr", "w", "g", "bin", "etc"], "/usr": ["share", "lib"],
               "/usr/share": ["hidden", "doc"], "/w": ["ro", "a"], "/w/ro": ["secret", "b"]}
    want = {"/bin/sh": RO, "/etc/x": RO, "/g": 0, "/g/x": 0, "/usr/lib/x": RO, "/usr/share/doc/x": RO,
            "/usr/share/hidden/x": 0, "/usr/share/hidden/pub/x": W, "/w/a/x": W, "/w/ro/b": RO,
            "/w/ro/secret/x": 0}
    plan = pol.plan()
    for path, level in want.items():
        assert _rights(plan, path, listing) == level, path
    # The ancestors of a narrower path keep only what everything below them shares.
    assert _rights(plan, "/", listing) == 0 and _rights(plan, "/w", listing) == 0


def test_compile_writes_the_layout_csrc_reads():
    pol = P.parse("t", {"hidden": ["/g"], "tcp_connect": [443, 80], "tcp_bind": [8080, 80],
                        "scope_signals": True})
    blob = pol.compile()
    magic, n_ports, n_paths, flags, fs, net, scoped = struct.unpack_from("=IIIIQQQ", blob)
    assert (magic, n_ports, n_paths, flags) == (P.MAGIC, 3, 1, 0)
    assert (fs, net, scoped) == (P.FS_ALL, P.NET_BIND_TCP | P.NET_CONNECT_TCP, P.SCOPE_SIGNAL)
    ports = [struct.unpack_from("=QQ", blob, 40 + 16 * i) for i in range(3)]
    assert ports == [(80, P.NET_BIND_TCP | P.NET_CONNECT_TCP), (443, P.NET_CONNECT_TCP), (8080, P.NET_BIND_TCP)]
    access, kind, n_except, strings_len, _ = struct.unpack_from("=QIIII", blob, 88)
    assert (access, kind, n_except) == (RO, P.CHILDREN, 1)
    assert blob[112:112 + strings_len].rstrip(b"\0") == b"/\0g" and strings_len % 8 == 0
    assert len(blob) == 112 + strings_len


def test_an_empty_port_list_handles_the_right_and_allows_nothing():
    blob = P.parse("t", {"rest": "writable", "tcp_bind": []}).compile()
    _, n_ports, n_paths, _, fs, net, _ = struct.unpack_from("=IIIIQQQ", blob)
    assert (n_ports, n_paths, fs, net) == (0, 0, 0, P.NET_BIND_TCP)


def test_the_service_refuses_what_the_kernel_cannot_enforce():
    from dsecd.engine.policies import PolicyService
    from dsecd.errors import BadRequest, NotFound, Unsupported

    svc = PolicyService(load_config().raw["policy"], abi=5)
    assert "agent" in svc.unusable and "scope_signals" in svc.unusable["agent"]
    with pytest.raises(Unsupported) as exc:
        svc.resolve("agent", "exec: policy")
    assert exc.value.detail["needs"] == {"scope_signals": 6, "scope_abstract_unix": 6}
    assert svc.resolve({"hidden": ["/g"]}, "exec: policy").name == P.INLINE      # ABI 3 is enough
    with pytest.raises(NotFound, match="no policy 'nope'"):
        svc.resolve("nope", "exec: policy")
    with pytest.raises(BadRequest) as exc:
        svc.resolve({"hidden": "x"}, "exec: policy")
    assert exc.value.detail["field"] == "exec: policy.hidden"
    info = svc.info()
    assert info["fields"]["scope_signals"] == {"abi": 6, "available": False}
    assert info["fields"]["tcp_bind"] == {"abi": 4, "available": True}
    assert PolicyService(load_config().raw["policy"], abi=0).unusable.keys() >= {"agent"}


def test_too_many_rules_is_an_error_not_a_cut():
    many = [f"/d{i}/{'x' * 200}" for i in range(P.MAX_PATHS)]
    with pytest.raises(P.PolicyError, match="compiles to"):
        P.parse("t", {"hidden": many}).compile()
    with pytest.raises(P.PolicyError, match="more than"):
        P.parse("t", {"hidden": [*many, "/one-more"]})
