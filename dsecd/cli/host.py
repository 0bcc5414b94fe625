"""`dsec info`, `top`, `policy`, `events`, `drain` and `undrain`: the host
and its daemon, as they say themselves."""

from __future__ import annotations

import json
import time

from .. import topview
from ..client import Client
from ..clitext import event_fields
from ..clitext import human_bytes as _human_bytes
from ..clitext import kv as _kv
from ..clitext import pct as _pct
from ..clitext import print_json as _print_json
from ..clitext import table as _table
from .common import _utc


def _reload_text(r: dict | None) -> str:
    """`dsec info`: the last config reload (SIGHUP) and its result."""
    if r is None:
        return "; not reloaded since the start"
    if not r["ok"]:
        return f"; reload {_utc(r['at'])} REFUSED: {r['error']} (the running settings stay)"
    waiting = r["restart_needed"]
    n = len(r["applied"])
    return (f"; reload {_utc(r['at'])}: {n} setting{'' if n == 1 else 's'} applied"
            + (f", {len(waiting)} take effect at the next start: {', '.join(waiting)}" if waiting else ""))


def _print_template_store(store: dict) -> None:
    """`dsec info`'s lines on the microVM templates: what each loaded one
    holds in the daemon's memory (charged to the daemon, not to a sandbox)."""
    rows = store["templates"]
    loaded = [t for t in rows if t["loaded"]]
    print(f"  vm templates: {len(rows)} of at most {store['max']} on disk, {len(loaded)} loaded, holding "
          f"{_human_bytes(store['held_bytes'])} of the daemon's memory")
    for t in rows:
        held = (f"holds {_human_bytes(t['held_bytes'])}" + (" (all of its guest RAM)"
                                                            if t["held_bytes"] >= (t["memory"] or 0) else "")
                if t["loaded"] else "not loaded")
        wrote = _human_bytes(t["ram_data_bytes"]) if t["ram_data_bytes"] is not None else "?"
        memory = _human_bytes(t["memory"]) if t["memory"] is not None else "?"
        print(f"    {t['key'][:16]}  guest RAM {memory}, its boot wrote {wrote}, {held}")


async def cmd_info(c: Client, a) -> int:
    info = await c.info()
    if a.json:
        _print_json(info)
        return 0
    print(f"dsecd {info['version']} (protocol {info['protocol']}), pid {info['pid']}, up {info['uptime_s']:.0f}s")
    print(f"kernel {info['kernel']}, cgroups {info['cgroup_mode']}: "
          + ", ".join(f"{k}={v}" for k, v in sorted(info["cgroup_controllers"].items())))
    print("features:")
    for name, f in sorted(info["features"].items()):
        print(f"  {name:<18} {'yes' if f['available'] else 'no ':<4} {f['detail']}")
    print("limits:")
    for k, v in sorted(info["limits"].items()):
        print(f"  {k:<26} {v}")
    print("sandboxes: " + (", ".join(f"{k} {v}" for k, v in sorted(info["sandboxes"].items())) or "none"))
    print("paths:")
    for k, v in sorted(info["paths"].items()):
        if isinstance(v, dict):          # cgroup_dirs: a dir per hierarchy
            print(f"  {k}:")
            for name, path in sorted(v.items()):
                print(f"    {name:<10} {path}")
        else:
            print(f"  {k:<12} {v}")
    if "cpu" in info:
        _print_cpu_info(info["cpu"])
    for name, b in info.get("memory", {}).items():
        where = b.get("device") or b.get("path") or "-"
        used = f", {_human_bytes(b['used'])} of {_human_bytes(b['size'])} used" if "size" in b else ""
        if "mem_used_total" in (b.get("stats") or {}):     # zram: what it takes of RAM, compressed
            used += f", {_human_bytes(b['stats']['mem_used_total'])} of RAM"
        not_enabled = (" (not enabled: left on by a previous daemon for its sandboxes, removed at "
                       "a stop with none left)" if b["on"] else " (not enabled)")
        print(f"swap {name}: {'on' if b['on'] else 'off'} {where}{used}"
              + ("" if b["enabled"] else not_enabled) + (f"; error: {b['error']}" if "error" in b else ""))
    images = info.get("images") or {}
    if images:
        print(f"images: {images['mode']}, store {images['store']}")
        pager = images.get("pager")
        if pager and "error" in pager:
            print(f"pager cache: not read ({pager['error']})")
        elif pager:         # the running pager's own figures: the cap in force
            cap = _human_bytes(pager["cache_max"]) if pager["cache_max"] else "none"
            print(f"pager cache: cap {cap}, {_human_bytes(pager['cache_used'])} used; pager pid {pager['pid']}")
        if "eager" in images:
            e = images["eager"]
            cap = _human_bytes(e["cache_max"]) if e["cache_max"] else "none"
            print(f"eager copies: cap {cap}, {_human_bytes(e['cache_used'])} used")
    if "admission" in info:
        q = info["admission"]
        print(f"create queue: {q['active']} running of {q['max_active']}, {q['queued']} queued of "
              f"{q['max_queued']}, wait p50 {q['wait_p50_ms']} ms p99 {q['wait_p99_ms']} ms "
              f"max {q['wait_max_ms']} ms, {q['creates_per_s']} creates/s, {q['rejected_busy']} busy"
              + (", by job: " + ", ".join(f"{j or '-'} {n}" for j, n in q["queued_by_job"].items())
                 if q["queued_by_job"] else ""))
        for name, p in q["pools"].items():
            print(f"  pool {name}: {p['ready']} ready, {p['creating']} creating, {p['taken']} taken")
    drain = info.get("drain") or {}
    if drain.get("drained"):
        print(f"drain: DRAINED since {_utc(drain['since'])}" + (f" ({drain['reason']})" if drain["reason"] else "")
              + ": creates and pool refills are refused; `dsec undrain` takes them again")
    elif drain:
        print("drain: no (creates taken)")
    for name, b in info.get("backends", {}).items():
        detail = (f"accel {b['accel']}, guest kernel {b['guest_kernel']}" if b.get("accel")
                  else b.get("why", "")) if name == "microvm" else ""
        print(f"backend {name}: {'available' if b['available'] else 'unavailable'}"
              + (f" ({detail})" if detail else "")
              + (f"; why: {b['why']}" if name == "microvm" and b.get("accel") else "")
              + (f"; QEMU's root: {b['root']}" if name == "microvm" and b.get("root") else ""))
        if b.get("template_store"):
            _print_template_store(b["template_store"])
    if info.get("daemon"):
        d = info["daemon"]
        lag = d.get("loop_lag") or {}
        print(f"daemon: config {d['config'] or '(embedded defaults)'}, log {d['log_level']} as {d['log_format']}, "
              f"metrics {d['metrics'] or 'off'}" + (f", event-loop lag p50 {lag['p50_ms']} ms p99 {lag['p99_ms']} ms "
                                                  f"max {lag['max_ms']} ms" if lag.get("samples") else ""))
        if d.get("config_loaded_at"):
            print(f"config: loaded {_utc(d['config_loaded_at'])}" + _reload_text(d.get("last_reload")))
        code = d.get("code")
        if code and code["installed_changed_count"]:
            print(f"code: installed code differs from the running daemon's ({code['installed_changed_count']} "
                  f"files changed since its start: {', '.join(code['installed_changed'][:3])}): it runs on from "
                  f"{code['running_from']}; restart it to finish the upgrade (sandboxes survive a restart)")
        elif code:
            print(f"code: as installed ({code['installed']}), run from {code['running_from']}")
    if "policy" in info:
        p = info["policy"]
        print(f"task policies (Landlock ABI {p['landlock_abi'] or 'none'}): " + ", ".join(p["policies"]))
        print("  fields need: " + ", ".join(f"{name} ABI {f['abi']}" + ("" if f["available"] else " (missing)")
                                            for name, f in p["fields"].items()))
        for name, why in p["unusable"].items():
            print(f"  {name}: {why}")
        if "denials" in p:
            d = p["denials"]
            print(f"  denials: {d['total']} counted; monitor {d['monitor']}")
    if "net" in info:
        for line in net_info_lines(info["net"]):
            print(line)
    if "fncall" in info:
        f = info["fncall"]
        print(f"fncall: {f['calls']} calls ({f['zygote_calls']} zygote, {f['plain_calls']} plain, "
              f"{f.get('plain_calls_by_init', 0)} of them forked by init), "
              f"{f['inflight']} in flight, zygotes started {f['zygotes_started']} replaced {f['zygotes_replaced']}, "
              f"call sandboxes dropped for creates {f.get('dropped_for_creates', 0)}, "
              f"for other images' calls {f.get('dropped_for_calls', 0)}")
    for why in info.get("unread", []):
        print(f"not read: {why}")
    return 0


def net_info_lines(net: dict) -> list[str]:
    """`dsec info`'s networking (info's "net"): whether --net default works
    and why not, what is still starting, the netns pool, resolver and NAT."""
    state = {True: "available: ", False: "unavailable: "}.get(net.get("available"), "")
    out = [f"net: {state}{net.get('detail', '')}"]
    if net.get("starting"):
        out.append(f"  starting   {', '.join(net['starting'])}")
    if "pool" in net:
        p = net["pool"]
        out.append(f"  pool       {p.get('ready', 0)} ready of {p.get('size', 0)}, {p.get('taken', 0)} taken, "
                   f"{p.get('misses', 0)} misses, {p.get('failed', 0)} failed"
                   + (f" (last error: {p['last_error']})" if p.get("last_error") else ""))
    dns = net.get("dns")
    if dns is not None:
        out.append(f"  resolver   {dns['address']} -> {', '.join(dns.get('upstreams', []))}" if "address" in dns
                   else f"  resolver   {dns.get('error', 'off')}")
    nat = net.get("nat")
    if nat is not None:
        if nat.get("table"):
            out.append(f"  nat        table {nat['table']}, uplink {nat.get('uplink') or '(none)'}, "
                       f"{nat.get('published', 0)} port(s) published")
        else:
            out.append(f"  nat        {nat.get('detail') or 'off'}")
    return out


def _print_cpu_info(cpu: dict) -> None:
    adm, used, hint = cpu["admission"], cpu["used"], cpu["placement"]
    c, m = adm["cpu"], adm["memory"]
    print(f"cpu: {cpu['cpus']} cores, default qos {cpu['default_qos']}, LS weight x{cpu['ls_weight_factor']:g}, "
          f"cpu.idle {'yes' if cpu['cpu_idle'] else 'no'}, core scheduling {cpu['core_sched']}")
    if adm["full_on"] == "drain":
        print("  admission   full (full on drain: the host is drained; no create makes a sandbox or takes "
              "a pool's)")
    elif adm["full_on"] == "sandboxes":
        n = adm["sandboxes"]
        calls = f" ({n['call_sandboxes']} of them FnCall's call sandboxes)" if n.get("call_sandboxes") else ""
        print(f"  admission   full (full on sandboxes: {n['live']} live{calls} and {n['queued']} queued of "
              f"limits.max_sandboxes {n['max']}; no create makes a sandbox, a warm pool's spare is still "
              "taken)")
    else:
        print(f"  admission   {adm['state']}" + (f" (full on {adm['full_on']}: a sandbox of the default size no "
                                                "longer fits; smaller ones may)" if adm["full_on"] else ""))
    print(f"  cpu         requested {c['requested']:g} of capacity "
          + (f"{c['capacity']:g} ({c['cpus']} x {c['ratio']:g})" if c["capacity"] is not None else "unchecked"))
    print(f"  memory      requested {_human_bytes(m['requested'])} of capacity "
          + (f"{_human_bytes(m['capacity'])} ({_human_bytes(m['mem_total'])} x {m['ratio']:g})"
             if m["capacity"] is not None else "unchecked"))
    cores = used["sandbox_cores"] or {}
    print(f"  used        host {_pct(used['host_cpu_pct'])}, sandboxes LS {cores.get('ls', 0):.2f} "
          f"BE {cores.get('be', 0):.2f} cores (sampled every {used['sample_interval_s']:g}s)")
    if hint.get("ready"):
        print(f"  placement   LS headroom {hint['ls_headroom_cores']:.2f} cores, BE headroom "
              f"{hint['be_headroom_cores']:.2f}, BE pressure {_pct(hint['be_pressure_pct'])}, "
              f"ls_score {hint['ls_score']}")


async def cmd_top(c: Client, a) -> int:
    """Live on a terminal (dsecd/topview.py); one snapshot when piped, --once or --json."""
    labels = _kv(a.label, "--label")
    if not (a.json or a.once) and topview.live_possible():
        return await topview.run_live(lambda: c.top(labels), a.interval, a.sort, labels)
    top = await c.top(labels)
    if a.json:
        _print_json({**top, "sandboxes": topview.ordered(top, a.sort)})
    else:
        topview.print_snapshot(top, a.sort)
    return 0


async def cmd_events(c: Client, a) -> int:
    async for ev in c.events(a.sandbox or a.sandbox_id, a.replay, a.follow):
        if a.json:
            print(json.dumps(ev, sort_keys=True), flush=True)
        else:
            extra = event_fields(ev, ("seq", "time", "event", "sandbox"))
            print(f"{time.strftime('%H:%M:%S', time.localtime(ev['time']))} {ev['event']:<9} {ev['sandbox']} "
                  f"{extra}".rstrip(), flush=True)
    return 0


async def cmd_policy(c: Client, a) -> int:
    r = await c.policy_list()
    if a.json:
        _print_json(r)
        return 0
    print(f"Landlock ABI {r['landlock_abi'] or 'none'}")
    rows = []
    for p in r["policies"]:
        parts = [f"{k}={','.join(map(str, p[k]))}" for k in ("read_only", "writable", "hidden") if p[k]]
        parts.append(f"rest={p['rest']}")
        parts += [f"{k}={','.join(map(str, p[k])) or '-'}" for k in ("tcp_bind", "tcp_connect") if k in p]
        parts += [k for k in ("scope_signals", "scope_abstract_unix") if p[k]]
        if "capabilities" in p:
            parts.append(f"capabilities={','.join(p['capabilities']) or '-'}")
        state = "yes" if p["enforceable"] else "NO"
        rows.append([p["name"], state if p["restricts"] else "no restriction", " ".join(parts)])
    _table(rows, ["POLICY", "ENFORCEABLE", "RULES"])
    for p in r["policies"]:
        if p["error"]:
            print(f"{p['name']}: {p['error']}")
    return 0


async def cmd_drain(c: Client, a) -> int:
    r = await (c.drain(a.reason or "") if a.cmd == "drain" else c.undrain())
    if a.json:
        _print_json(r)
    elif r["drained"]:
        print(f"drained since {_utc(r['since'])}" + (f" ({r['reason']})" if r["reason"] else "")
              + ": new creates and pool refills are refused; running sandboxes keep working")
    else:
        print("undrained: creates are taken again")
    return 0
