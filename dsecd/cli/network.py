"""`dsec net` and `dsec port`: a sandbox's network rules and its published
ports."""

from __future__ import annotations

from ..client import Client
from ..clitext import UsageError
from ..clitext import print_json as _print_json
from ..clitext import table as _table


def net_set_summary(sb_id: str, view: dict) -> str:
    """One line after `dsec net set`: the rules as given (a set name such as
    pypi is one rule here, however many addresses or names it expands to),
    and the daemon's net.essentials, which every policy has besides them."""
    terms = view.get("terms", [])
    line = f"{sb_id}: {len(terms)} rule(s): {' '.join(terms) or '(none)'}"
    if view.get("essentials"):
        line += f"; in force besides: {' '.join(view['essentials'])} (net.essentials)"
    return line


async def cmd_net(c: Client, a) -> int:
    if a.net_cmd == "sets":
        sets = await c.net_sets()
        if a.json:
            _print_json(sets)
        else:
            _table([[s["name"], " ".join(s["rules"])] for s in sets], ["SET", "RULES"])
        return 0
    sb = await c.get(a.sandbox)
    if a.net_cmd == "set":
        if a.replace and (a.add or a.remove):
            raise UsageError("dsec net set: --replace takes --allow rules; don't mix it with --add/--remove")
        if a.replace:
            view = await sb.net_set(replace=a.allow or [])
        else:
            view = await sb.net_set(add=(a.add or []) + (a.allow or []), remove=a.remove or [])
        if not a.json:
            print(net_set_summary(sb.id, view))
            return 0
    else:
        view = await sb.net_show()
    if a.json:
        _print_json(view)
        return 0
    if view.get("mode") != "default":
        print(f"{sb.id}: --net none (loopback only)")
        return 0
    lease = view.get("lease") or {}
    print(f"{sb.id}: {view['interface']} {lease.get('ipv4', '')} {lease.get('ipv6', '') or ''}".rstrip())
    _table([[r["rule"], ",".join(r["from"]), str(r["allowed"])] for r in view["rules"]],
           ["RULE", "FROM", "ALLOWED"])
    if view.get("names"):
        print("names: " + " ".join(n["rule"] for n in view["names"]))
    for ln in view.get("learned", []):
        print(f"learned {ln['rule']} for {ln['name']} ({ln['by']}), {ln['expires_in']:g} s left")
    d = view["default"]
    print(f"default deny: {d.get('denied_connect', 0)} connects, {d.get('denied_sendmsg', 0)} sends, "
          f"{d.get('dropped_packets', 0)} packets refused")
    if view.get("ports"):
        _table([[f"{p['port']}/{p.get('protocol', 'tcp')}", p["host"], p["bind"] or "(all non-loopback)"]
                for p in view["ports"]],
               ["PORT", "HOST", "BIND"])
    if "dns" in view:
        q = view["dns"]
        print(f"dns ({q['resolver']}:53): {q['queries']} queries, {q['refused']} refused, {q['learned']} "
              f"learned, {q['expired']} expired, {q['hostile_dropped']} hostile dropped, {q['capped']} capped, "
              f"{q['upstream_failed']} upstream failed")
        if q.get("rate_limited"):
            print(f"{q['rate_limited']} queries over net.dns_rate_per_s went unanswered (the sandbox saw them "
                  "time out)")
        if q.get("learned_full"):
            print(f"{q['learned_full']} answers over the learned cap (net.dns_max_learned for the sandbox, a "
                  "quarter of net.max_prefixes for all of them): answered SERVFAIL until learned addresses expire")
        if q.get("refused_names"):
            print(f"refused names: {' '.join(q['refused_names'])} (no name rule allows them; the sandbox saw a "
                  f"failed lookup: allow one with `dsec net set {sb.id} --add NAME:443/tcp`)")
    return 0


async def cmd_port(c: Client, a) -> int:
    if a.port is None and (a.remove or a.host_port is not None or a.bind):
        raise UsageError("dsec port: --rm, --host-port and --bind take the sandbox's port: "
                         "dsec port SANDBOX PORT [...]")
    sb = await c.get(a.sandbox)
    if a.port is None:
        ports = (await sb.net_show()).get("ports", [])
        if a.json:
            _print_json(ports)
        for p in [] if a.json else ports:
            print(f"{p['port']}/{p.get('protocol', 'tcp')} -> {p['host']}")
        return 0
    port, proto = a.port
    if a.remove:
        out = await sb.unpublish(port, proto)
    else:
        out = await sb.publish(port, a.host_port, a.bind or "", proto)
    if a.json:
        _print_json(out)
    elif a.remove:
        print(f"{sb.id}: port {port}/{proto} unpublished")
    else:
        print(out["host"])
    return 0
