"""`dsec`: the command-line client, a thin shell over the SDK.

It talks to the local daemon socket, so `ssh host dsec ps` works on any host;
`dsec --host ssh://host ps` (or DSEC_HOST) runs a command through the SDK's
ssh:// transport, `dsec fleet --hosts h1,h2 ps` through dsecd.Fleet
(fleet_cli.py), and `dsec rpc --stdio` bridges the raw protocol over
stdin/stdout for both and for fleet tools. Every command takes --json,
before or after its name. Options of
`exec`, `trace` and `call` go before or after the sandbox id; the command to
run follows `--` (or starts at the first word that is not an option).

Exit status: the command's own for `exec`, `trace`, `call` and `run` (and for
`wait` and `attach`, the background process's); 124 when it timed out;
128+N when it died of signal N; 127 when the program to run was not found,
126 when it could not be executed; 125 when dsec itself failed for them
(daemon error, bad input, usage). Other commands: 1 when the daemon
refused or failed, 2 on a usage error. A closed stdout (`dsec ps | head -1`)
ends dsec quietly with 141, as SIGPIPE would.

With --json, a failure prints `{"error": {"code", "message", "detail"}}` on
stdout (the stderr line as without it), with the same exit status: the
daemon's error, or dsec's own coded as the protocol's (bad_request for a
usage error, io or the errno's code for a local file), `unreachable` for no
connection to the daemon and `interrupted` for a signal (detail: signal, and
the output an exec or run had kept). `rm` prints each sandbox's or path's
result or error, `cat` a line per file, its content or its error (and goes
on to the next, as cat(1)); the streams (events, watch, logs, attach) end
with the error as one more line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import io
import json
import os
import posixpath
import secrets
import shlex
import signal
import stat
import sys
import tarfile
import tempfile
import termios
import time
import tty
from collections.abc import AsyncIterator

from . import cpmerge, cptar, fleet_cli, imageconfig, localcopy, pullview, rpcrelay, sigint, topview
from .cliargs import (  # noqa: F401 (parse_args and the parser's names: the CLI's, as before)
    EXIT_BROKEN_PIPE,
    EXIT_DSEC_ERROR,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    FLEET_CONNECT_TIMEOUT_S,
    GIVES_A_STATUS,
    RUNS_A_COMMAND,
    VALUED_OPTIONS,
    _closed_outputs,
    _interrupted,
    _local_error,
    _port_to_publish,
    _print_error,
    _sandbox_port,
    _silence_stdout,
    build_parser,
    find_verb,
    join_signed_values,
    parse_args,
    parsed,
    split_command,
)
from .client import Client, default_socket, named_as
from .clitext import (
    UsageError,
    create_args,
    env_vars,
    event_fields,
    image_config,
    image_removed,
    job_done,
    job_verb,
)
from .clitext import clock as _clock
from .clitext import human_bytes as _human_bytes
from .clitext import kv as _kv
from .clitext import pct as _pct
from .clitext import print_json as _print_json
from .clitext import table as _table
from .cptar import in_a_thread_of_its_own as _in_a_thread_of_its_own
from .errors import (
    BadRequest,
    ConnectionLost,
    DsecError,
    HostsDown,
    NotFound,
    PermissionDenied,
    io_error,
)
from .fds import read_ready
from .fleet import fleet_target
from .localcopy import LocalCopyError
from .pullview import PullView
from .remote import SshOptions
from .tarsafe import Refused, TooLarge

# ---------------------------------------------------------------- commands

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


class _ProgressBar:
    """One status line on a tty for long builds; silent otherwise (and with --json)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.shown = False

    def __call__(self, p: dict) -> None:
        if not self.enabled:
            return
        if p.get("step") == "queued":
            text = f"waiting: images.max_flattens ({p['max']}) flattens already running"
        elif p.get("step") == "unpack":
            text = f"unpacking layer {p['layer']}/{p['of']} ({p['entries']} entries)"
        elif p.get("step") == "measure":
            text = f"measuring the room needed: layer {p['layer']}/{p['of']} ({p['entries']} entries)"
        elif p.get("step") == "merge":
            text = (f"merging layer {p['layer']}/{p['of']}: {p['entries']} entries, "
                    f"{_human_bytes(p['bytes'])} copied")
        elif p.get("step") == "mkfs.erofs" and "bytes" in p:
            of = f" of ~{_human_bytes(p['total'])}" if p.get("total") else ""
            text = f"packing the layer: {_human_bytes(p['bytes'])}{of} written"
        elif p.get("step") == "layer":
            text = f"layer {p['digest'][7:19]} {_human_bytes(p['bytes'])}{'' if p['new'] else ' (exists)'}"
        else:
            text = f"{p.get('step', 'working')} {p.get('source', '')}"
        print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)
        self.shown = True

    def done(self) -> None:
        if self.shown:
            print(file=sys.stderr)


def _replaced(img: dict) -> str:
    """A build's note of the image its name had: the name moved, and that
    image stays for the sandboxes on it until `image gc`."""
    return f"; replaced manifest {img['replaced'][:19]} under that name" if img.get("replaced") else ""


def _print_image(img: dict, verb: str, note: str = "") -> None:
    layers = ", ".join(layer["digest"][7:19] for layer in img["layers"])
    print(f"{verb} {img['name']}: {len(img['layers'])} layer(s) [{layers}], {_human_bytes(img['bytes'])}, "
          f"manifest {img['manifest'][:19]}{note}")


def _stdin_dockerfile() -> str:
    """The Dockerfile `-f -` reads from stdin: UTF-8, as a Dockerfile read
    from a file must be (stdin's text layer would pass other bytes on as
    surrogates, which no request can carry)."""
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"the Dockerfile on stdin (-f -) is not UTF-8 text (byte {err.start}: {err.reason}); "
                         "is it the Dockerfile?", {"dockerfile": "<stdin>"}) from None


async def cmd_image_dockerfile(c: Client, a) -> int:
    """`dsec image build -f Dockerfile CONTEXT --name N`: progress on a
    terminal (dsecd/buildview.py), else only the result."""
    view = None
    if not a.json and sys.stdout.isatty():
        from .buildview import BuildView

        view = BuildView()

    def warnings_only(event: dict) -> None:
        # Off a terminal: no steps, but what a warning says (files left out) on stderr.
        if event.get("event") == "warning":
            print(f"dsec image build: warning: {event['message']}", file=sys.stderr)

    dockerfile, text = (a.file, None) if a.file != "-" else ("<stdin>", _stdin_dockerfile())    # docker's -f -
    try:
        img = await c.build_dockerfile(a.path, a.name, dockerfile, text, build_args=_build_args(a.build_arg),
                                       allow=a.allow, no_cache=a.no_cache, progress=view or warnings_only)
    except DsecError as err:
        if view is None and err.detail.get("output_tail"):     # nothing of the failed RUN was shown: its last output
            print(err.detail["output_tail"].rstrip("\n"), file=sys.stderr)
        raise
    finally:
        if view is not None:        # whatever ends the build (Ctrl-C too): or the cursor stays hidden
            view.close()
    if a.json:
        _print_json(img)
        return 0
    cached = sum(1 for s in img["steps"] if s["cached"])
    _print_image(img, "built", _replaced(img))
    if view is not None:
        print(f"{len(img['steps'])} steps, {cached} cached, {img['seconds']:.2f}s")
    return 0


# What `dsec image inspect` says after the last name of an image's
# ancestors, by why the walk stopped there (image_inspect's ancestors_end).
_ANCESTORS_END = {
    "removed": " (removed since)",
    "replaced": " (the name was moved to another image since)",
    "loop": " again: a cycle of parents in refs written before parents were recorded with their manifest",
}


def _ancestors(img: dict) -> str:
    """An image's chain of parents as inspect answers it, by name, each the
    parent of the one before, and what became of the last one."""
    chain = img.get("ancestors")
    if not chain:                    # none, or a daemon that does not answer it
        return "-"
    return " -> ".join(chain) + _ANCESTORS_END.get(img.get("ancestors_end"), "")


def _print_image_details(img: dict) -> None:
    """`dsec image inspect` without --json: the image and its config, one field a line."""
    cfg = imageconfig.normalise(img.get("config"))
    rows = [("name", img["name"]), ("manifest", img["manifest"]),
            ("layers", ", ".join(f"{layer['digest'][7:19]} ({_human_bytes(layer.get('bytes', layer['size']))})"
                                 for layer in img["layers"]) or "none"),
            ("size", _human_bytes(img["bytes"])), ("parent", img.get("parent") or "-"),
            ("ancestors", _ancestors(img)),
            ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(img["created"]))
             if img.get("created") else "-"),
            ("user", cfg["user"] or "(root)"), ("cwd", cfg["cwd"]),
            ("entrypoint", json.dumps(cfg["entrypoint"], ensure_ascii=False)),
            ("cmd", json.dumps(cfg["cmd"], ensure_ascii=False)),
            ("exposed ports", " ".join(cfg["exposed_ports"]) or "-")]
    rows += [("env", f"{k}={v}") for k, v in sorted(cfg["env"].items())]
    rows += [("label", f"{k}={v}") for k, v in sorted(cfg["labels"].items())]
    rows.append(("sandboxes", " ".join(img.get("sandboxes") or []) or "-"))
    for name, value in rows:
        print(f"{name + ':':<15}{value}")


async def _warn_if_shadowed(c: Client, ref: str, pulled: str) -> None:
    """A bare name (`app`) finds a local image of that name before the
    pulled `app:latest` (local names first): say so after a pull of one, or
    the next `dsec run app` runs the other image without a word."""
    if any(ch in ref for ch in "/:@"):
        return
    try:
        found = await c.inspect_image(ref)
    except DsecError:
        return
    if found["name"] != pulled:
        print(f"dsec image pull: warning: {ref!r} names the local image {found['name']} (made here), which a "
              f"bare name finds first; name the pulled image {pulled}, or remove the local one "
              f"(`dsec image rm {found['name']}`)", file=sys.stderr)


async def cmd_image(c: Client, a) -> int:
    if a.image_cmd == "build" and a.file:
        return await cmd_image_dockerfile(c, a)
    if a.image_cmd in ("build", "import"):
        bar = _ProgressBar(not a.json)
        try:
            img = await c.build_image(a.path, a.name, getattr(a, "parent", None), bar, **image_config(a))
        finally:
            bar.done()          # ends its status line: an error goes on a line of its own
        if a.json:
            _print_json(img)
        else:
            _print_image(img, "built", _replaced(img))
        return 0
    if a.image_cmd == "pull":
        with PullView(pullview.wanted(a.json)) as view:
            img = await c.pull_image(a.ref, view, a.platform)
        if a.json:
            _print_json(img)
        else:
            via = img["pull"].get("registry")
            mirrored = via and not img["name"].startswith(f"{via}/") and via != "docker.io"
            _print_image(img, "up to date" if img["pull"].get("up_to_date") else "pulled",
                         f", from the mirror {via}" if mirrored else "")
        await _warn_if_shadowed(c, a.ref, img["name"])
        return 0
    if a.image_cmd == "ls":
        listing = await c.image_listing()
        images = listing["images"]
        for bad in listing.get("unreadable", []):
            print(f"dsec image ls: image {bad['name']} cannot be read: {bad['error']} (`dsec image rm "
                  f"{bad['name']}` removes the name)", file=sys.stderr)
        if a.json:
            _print_json(images)
        else:
            _table([[i["name"], str(len(i["layers"])), _human_bytes(i["bytes"]), i["manifest"][7:19],
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(i["created"]))] for i in images],
                   ["NAME", "LAYERS", "SIZE", "MANIFEST", "CREATED"])
        return 0
    if a.image_cmd == "inspect":
        img = await c.inspect_image(a.name)
        _print_json(img) if a.json else _print_image_details(img)
        return 0
    if a.image_cmd == "rm":
        r = await c.remove_image(a.name)
        if a.json:
            _print_json(r)
        else:
            print(image_removed(r, a.name))
            if r.get("damaged"):
                print(f"dsec image rm: the image could not be read: {r['damaged']}", file=sys.stderr)
        return 0
    if a.image_cmd == "tag":
        img = await c.tag_image(a.source, a.name)
        _print_json(img) if a.json else _print_image(img, "tagged", _replaced(img))
        return 0
    if a.image_cmd == "flatten":
        bar = _ProgressBar(not a.json)
        try:
            img = await c.flatten_image(a.name, a.as_name, bar)
        finally:
            bar.done()
        if a.json:
            _print_json(img)
        else:
            _print_image(img, "flattened", f" (from {img['flattened']['layers']} layer(s), manifest "
                         f"{img['flattened']['manifest'][:19]}){_replaced(img)}")
        return 0
    if a.image_cmd == "gc":
        r = await c.image_gc()
        _print_json(r) if a.json else print(f"removed {len(r['removed'])} blob(s), "
                                            f"freed {_human_bytes(r['freed_bytes'])}")
        return 0
    if a.image_cmd == "du":
        r = await c.image_du()
        if a.json:
            _print_json(r)
            return 0
        print(f"{r['blobs']} blobs, {_human_bytes(r['bytes'])} in the store; shared layers "
              f"{_human_bytes(r['shared_layer_bytes'])}; unreferenced {_human_bytes(r['unreferenced_bytes'])}")
        _table([[i["name"], str(i["layers"]), _human_bytes(i["bytes"])] for i in r["images"]],
               ["IMAGE", "LAYERS", "SIZE"])
        return 0
    raise UsageError("dsec image: give a subcommand: build, import, pull, ls, inspect, tag, rm, gc, du")


def _pause_summary(r: dict) -> str:
    if r.get("already"):
        return ""
    if r["state"] == "paused":
        return f": froze in {r['frozen_s'] * 1000:.0f} ms, freed {_human_bytes(r['freed_bytes'])}"
    # A microVM's resume is its restore (thaw_s), with nothing to prefetch.
    took = (r["prefetch_s"] + r["thaw_s"]) * 1000
    return f": resumed in {took:.0f} ms, prefetched {_human_bytes(r['prefetched_bytes'])}"


async def cmd_pause_resume(c: Client, a) -> int:
    """`dsec pause` and `dsec resume`: the op is the command's name. As `rm`,
    a sandbox that fails is said and the others are still done."""
    status = 0
    for sb_id in a.sandboxes:
        try:
            r = await c.request(a.cmd, sandbox=sb_id)
        except DsecError as err:
            _print_item_error(a, err, sandbox=sb_id)
            print(f"dsec: {a.cmd} {sb_id}: {err}", file=sys.stderr)
            status = 1
            continue
        _print_json(r, line=True) if a.json else print(f"{r['id']} {r['state']}{_pause_summary(r)}")
    return status


async def cmd_renew(c: Client, a) -> int:
    """`dsec renew SB... [--lease D]`: what Client.hold does once, for a
    sandbox made with --lease. Each is named as the other commands take
    it (an id or a unique prefix); one missing is said, and the exit
    status is then 1; one without a lease is said too, as no failure."""
    ids, status = [], 0
    for spec in a.sandboxes:
        try:
            ids.append((await c.get(spec)).id)
        except DsecError as err:
            _print_item_error(a, err, sandbox=spec)
            print(f"dsec renew: {spec}: {err}", file=sys.stderr)
            status = 1
    if not ids:
        return status
    r = await c.renew(ids, a.lease)
    if a.json:
        _print_json(r, line=True)
    for sb_id in r["renewed"]:
        if not a.json:
            print(f"{sb_id} renewed")
    for sb_id in r["missing"]:
        print(f"dsec renew: {sb_id}: gone meanwhile", file=sys.stderr)
    for sb_id in r.get("no_lease", ()):          # not a failure: it lives on without one
        print(f"dsec renew: {sb_id} has no lease to renew (give --lease to set one)", file=sys.stderr)
    return 1 if status or r["missing"] else 0


async def cmd_job(c: Client, a) -> int:
    r = await job_verb(c, a)
    if a.json:
        _print_json(r)
    else:
        done = job_done(r)
        print(f"job {a.job}: {a.job_cmd} {len(done)} sandbox(es)")
        failed = r.get("failed") or {}
        for sb_id in failed:
            print(f"dsec job {a.job_cmd}: {sb_id}: {failed[sb_id] if isinstance(failed, dict) else 'failed'}",
                  file=sys.stderr)
    return 1 if r.get("failed") else 0


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


async def cmd_snapshot(c: Client, a) -> int:
    for path in a.exclude or []:
        if set(path) & set("*?["):        # a glob habit: nothing expands it, so little or nothing is left out
            print(f"dsec snapshot: warning: --exclude {path!r} is a path, not a pattern: only an entry of that "
                  "exact name is left out (name a directory to leave out all of it)", file=sys.stderr)
    sb = await c.get(a.sandbox)
    bar = _ProgressBar(not a.json)
    img = await sb.snapshot(a.name, a.exclude or [], bar)
    bar.done()
    _print_json(img) if a.json else _print_image(img, "snapshot")
    return 0


async def cmd_create(c: Client, a) -> int:
    sb = await c.create(image=a.image, lease=a.lease, key=a.key, backend=a.backend, **create_args(a))
    if a.json:
        _print_json(sb.info)
    else:
        print(sb.id)
    return 0


async def cmd_pool(c: Client, a) -> int:
    if a.pool_cmd == "set":
        p = await c.pool_set(a.image, a.min, a.max, cpu=a.cpu, memory=a.memory)
        if a.json:
            _print_json(p)
        else:
            print(f"{p['name']}: min {p['min']} max {p['max']}" + (" (removed)" if p.get("removed") else ""))
        return 0
    pools = await c.pool_list()
    if a.json:
        _print_json(pools)
        return 0
    _table([[p["name"], p["image"], f"{p['cpu']:g}", f"{p['memory'] >> 20}M", str(p["min"]), str(p["max"]),
             str(p["ready"]), str(p["creating"]), str(p["taken"]), p["error"] or ""] for p in pools],
           ["POOL", "IMAGE", "CPU", "MEMORY", "MIN", "MAX", "READY", "CREATING", "TAKEN", "ERROR"])
    return 0


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


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


def _read_code(path: str) -> str:
    """A --code-file's text, decoded as python3 decodes a script: by its
    coding declaration (PEP 263), else as UTF-8, whatever our locale."""
    import tokenize

    with open(path, "rb") as f:         # once, not tokenize.open's seek: a pipe or <(...) is read too
        raw = f.read()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (UnicodeDecodeError, SyntaxError) as err:
        # SyntaxError: its first two lines (where a declaration goes) did not decode, or name no codec
        why = (f"not UTF-8 text (byte {err.start}: {err.reason})" if isinstance(err, UnicodeDecodeError)
               else err.msg.replace(f" for {path!r}", ""))
        raise BadRequest(f"--code-file {path}: {why}; save it as UTF-8 or declare its encoding "
                         "(# -*- coding: NAME -*-)", {"code_file": path}) from None


async def cmd_call(c: Client, a) -> int:
    code = _read_code(a.code_file) if a.code_file else None
    stdin = None
    if a.stdin == "-":
        stdin = sys.stdin.buffer.read()
    elif a.stdin:
        with open(a.stdin, "rb") as f:
            stdin = f.read()
    r = await c.call(a.image, argv=None if code is not None else a.argv, code=code,
                     args=a.argv if code is not None else None, stdin=stdin, env=_kv(a.env, "--env"),
                     timeout=a.timeout)
    out = CommandOutput(a.json)
    out.write(1, r.stdout)
    out.write(2, r.stderr)
    if a.json:
        _print_json({"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                     "killed_by": r.killed_by, "destroyed_by": r.destroyed_by,
                     "truncated": r.truncated, "path": r.path, "run_ms": r.run_ms, "total_ms": r.total_ms,
                     **out.fields()})
    _say_truncated(r)
    return _exit_status(r, f"dsec: call timed out after {a.timeout}s; its process group was killed")


def _say_truncated(r) -> None:
    """A command's output past the daemon's cap is cut and its pipes closed
    (it then mostly dies of SIGPIPE): said, or the end looks like its own."""
    if r.truncated:
        print("dsec: output truncated at the daemon's limits.max_exec_output_bytes; "
              "the command's pipes were closed", file=sys.stderr)


def _say_lost(r) -> None:
    """Output a keyed exec taken up after a cut link (over ssh://) missed,
    the daemon no longer having it (ExecResult.lost_output): a gap in what
    was printed, said, or the output reads as whole."""
    if r.lost_output:
        print(f"dsec: {r.lost_output} bytes of the command's output were lost: the link to the daemon was "
              "cut and the daemon no longer had them (it keeps the last 4 MiB for the exec taken up again)",
              file=sys.stderr)


# Why the daemon says a command was SIGKILLed (ExecResult.killed_by).
KILLED_BY = {"oom": "the sandbox reached its memory limit (the kernel's OOM killer took it)",
             "destroy": "its sandbox was destroyed"}
# Why that destroy came (ExecResult.destroyed_by), as a later request on the
# sandbox says it (dsecd/engine/sandboxes.py DESTROYED_BECAUSE).
DESTROYED_BY = {"ttl": "its ttl ran out", "idle_ttl": "it was idle past its idle_ttl",
                "lease": "its lease was not renewed", "request": "by a destroy request", "job": "by a job rm",
                "all": "by a destroy of all sandboxes", "pool": "by its warm pool",
                "build": "by its image build, whose step it ran"}


def _exit_status(r, timeout_msg: str) -> int:
    """The shell's exit status for a command's result: 124 on timeout, 128+N
    if killed by signal N (and why, when the daemon knows)."""
    if r.timed_out:
        print(timeout_msg, file=sys.stderr)
        return EXIT_TIMEOUT
    if r.signal:
        if r.killed_by in KILLED_BY:
            why = f": {DESTROYED_BY[r.destroyed_by]}" if r.destroyed_by in DESTROYED_BY else ""
            print(f"dsec: killed: {KILLED_BY[r.killed_by]}{why}", file=sys.stderr)
        return 128 + r.signal
    return r.exit_code or 0


async def cmd_exec(c: Client, a) -> int:
    sb = await c.get(a.sandbox)
    if getattr(a, "detach", False):
        proc = await sb.spawn(a.argv, env=env_vars(a), cwd=a.cwd, user=a.user, policy=a.policy)
        _print_json({"pid": proc.pid, "sandbox": sb.id}) if a.json else print(proc.pid)
        return 0
    if getattr(a, "tty", False):
        return await _exec_on_terminal(sb, a)
    tracing = a.cmd == "trace"
    stream = sb.exec_stream(a.argv, timeout=a.timeout, env=env_vars(a), cwd=a.cwd, user=a.user,
                            stdin=_stdin_as_it_comes() if a.interactive else None, trace=tracing, policy=a.policy)
    out = a.kept_output = CommandOutput(a.json and not tracing)
    async for fd, data in stream:
        out.write(fd, data)
    r = stream.result
    if tracing:
        _print_trace(r.trace or {}, a.json, a.output)
    elif a.json:
        _print_json({"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                     "killed_by": r.killed_by, "destroyed_by": r.destroyed_by,
                     "truncated": r.truncated, "duration_ms": r.duration_ms, "policy": r.policy,
                     "denials": r.denials, "lost_output": r.lost_output, **out.fields()})
    _say_truncated(r)
    _say_lost(r)
    return _exit_status(r, f"dsec: timed out after {a.timeout}s; the command's process group was killed")


async def _exec_on_terminal(sb, a) -> int:
    """`dsec exec -t`: the command on a pty in the sandbox (_on_terminal)."""
    rows, cols = _window_size(sys.stdin.fileno())
    stream = sb.exec_stream(a.argv, timeout=a.timeout, env=env_vars(a), cwd=a.cwd, user=a.user,
                            pty=True, rows=rows, cols=cols)
    ended_by = await _on_terminal(stream, a)
    if ended_by is not None:              # the terminal is ours again: --json's error on it
        _interrupted(a, ended_by, f"{signal.Signals(ended_by).name}: the exec was cancelled")
        return 128 + ended_by
    return _terminal_status(stream.result, a)


def _terminal_status(r, a) -> int:
    if a.json:
        _print_json({"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                     "killed_by": r.killed_by, "destroyed_by": r.destroyed_by,
                     "duration_ms": r.duration_ms})
    return _exit_status(r, f"dsec: timed out after {a.timeout}s; the command's process group was killed")


async def _on_terminal(stream, a) -> int | None:
    """A pty exec's stream (`dsec exec -t`, `dsec run -t`) driven from our
    terminal: raw mode (with -i) so that every key, ^C included, goes to the
    sandbox's terminal as typed; its window size follows ours (SIGWINCH).
    The signal that ended it (the stream cancelled), or None at its end."""
    fd = sys.stdin.fileno()
    ended_by = None                       # the signal that ended it
    with _raw_terminal(fd) if a.interactive else contextlib.nullcontext():
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        killed: list[int] = []

        def on_signal(signum: int) -> None:
            killed.append(signum)
            main.cancel()

        for signum in _ENDING_SIGNALS:
            loop.add_signal_handler(signum, on_signal, signum)
        loop.add_signal_handler(signal.SIGWINCH, _follow_window, loop, stream, fd)
        keys = loop.create_task(_forward_keys(stream, fd)) if a.interactive else None
        try:
            async for _fd, data in stream:
                _write_flush(1, data)
        except asyncio.CancelledError:
            if not killed:
                raise
            ended_by = killed[0]
        finally:
            for signum in (*_ENDING_SIGNALS, signal.SIGWINCH):
                loop.remove_signal_handler(signum)
            if keys is not None:
                keys.cancel()
                with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
                    await keys
    return ended_by


# Signals that end `dsec exec -t` (its terminal restored, the exec cancelled)
# and that `dsec run` forwards to its command (the second one kills it and
# removes its sandbox).
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)


async def _say_published(sb, a) -> None:
    """`dsec run --publish PORT`: where the host reaches each port (a host port
    the daemon picked), on stderr as the command starts: the user knows no
    id of the sandbox to ask `dsec port` with."""
    if not getattr(a, "publish", None):
        return
    for p in (await sb.net_show()).get("ports", []):
        name = p["port"] if p.get("protocol", "tcp") == "tcp" else f"{p['port']}/{p['protocol']}"
        print(f"dsec run: port {name} of sandbox {sb.id} is published on {p['host']}", file=sys.stderr,
              flush=True)


async def cmd_run(c: Client, a) -> int:
    """`dsec run IMAGE [ARG...]`, as `docker run --rm`: a sandbox of the
    image, its Entrypoint and Cmd (ARGs replace Cmd) run with the output
    streamed, and the sandbox removed however that ends: the command's end,
    an error, or signals. The first of SIGINT, SIGTERM, SIGHUP, SIGQUIT is
    forwarded to the command, as docker run's --sig-proxy does (^C reaches
    it as SIGINT, and its own handling decides the end); a second one kills
    it and ends the run, and more do not cut the removal short. A signal
    that comes before the command has started ends the run at once."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    signals: list[int] = []       # those that ended the run
    forwarded: list[asyncio.Task] = []

    def on_signal(signum: int) -> None:
        if not forwarded and not signals and run.stream is not None:
            forwarded.append(loop.create_task(_forward_signal(run.stream, signum)))
            return
        if not signals:
            main.cancel()
        signals.append(signum)

    if a.detach:
        return await _run_detached(c, a)
    a.rm = a.rm is not False              # --rm is the default without -d
    if a.tty:
        return await _run_on_terminal(c, a)
    stdin = _stdin_as_it_comes() if a.interactive else None
    out = a.kept_output = CommandOutput(a.json)
    run = c.run_stream(a.image, a.argv or None, a.entrypoint, a.timeout, stdin, a.rm, backend=a.backend,
                       **create_args(a))
    for signum in _ENDING_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        async with run:
            if not a.rm:
                print(f"dsec run: sandbox {run.sandbox.id} (kept: --no-rm)", file=sys.stderr, flush=True)
            await _say_published(run.sandbox, a)
            async for fd, data in run:
                # In a thread: a reader that stalls our stdout must not stall the
                # loop, which renews the sandbox's lease meanwhile.
                await loop.run_in_executor(None, out.write, fd, data)
    except asyncio.CancelledError:
        if not signals:
            raise
        message = (f"{signal.Signals(signals[0]).name}: the command was killed"
                   + (" and its sandbox removed" if a.rm else ""))
        _interrupted(a, signals[0], message, sandbox=run.sandbox.id if run.sandbox else None)
        print(f"dsec run: {message}", file=sys.stderr)
        return 128 + signals[0]
    except BadRequest as err:
        _cli_run_hint(err, a.image)
        raise
    finally:
        for signum in _ENDING_SIGNALS:
            loop.remove_signal_handler(signum)
        for task in forwarded:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    r = run.result
    if a.json:
        _print_json({"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                     "killed_by": r.killed_by, "destroyed_by": r.destroyed_by,
                     "truncated": r.truncated, "duration_ms": r.duration_ms, "sandbox": run.sandbox.id,
                     **_fleet_host(a, run.sandbox), "argv": run.argv, "lost_output": r.lost_output,
                     **out.fields()})
    _say_truncated(r)
    _say_lost(r)
    return _exit_status(r, f"dsec: timed out after {a.timeout}s; the command's process group was killed")


def _fleet_host(a, sb) -> dict:
    """{"host": where `sb` was placed} for `dsec fleet run --json` (a
    script needs it to reach the sandbox again); {} for a local run."""
    return {"host": sb.host} if getattr(a, "fleet", None) else {}


async def _run_detached(c: Client, a) -> int:
    """`dsec run -d`: the sandbox's id on stdout (as docker run -d prints the
    container's), where its command runs on stderr."""
    proc = await c.run_detached(a.image, a.argv or None, a.entrypoint, backend=a.backend, **create_args(a))
    sb = proc.sb.id
    if a.json:
        _print_json({"sandbox": sb, **_fleet_host(a, proc.sb), "pid": proc.pid})
    else:
        print(sb)
        # Over ssh (--host, a fleet's placement), a bare `dsec` would ask this machine's daemon.
        dsec = f"dsec --host {proc.sb.client.target}" if a.host or getattr(a, "fleet", None) else "dsec"
        print(f"dsec run: process {proc.pid} in {sb}: {dsec} logs {sb} {proc.pid}; {dsec} rm --force {sb} ends it",
              file=sys.stderr)
    return 0


async def _run_on_terminal(c: Client, a) -> int:
    """`dsec run -t`: the image's command on a pty of a sandbox of its own,
    driven from our terminal as `dsec exec -t` does (^C is a key, typed into
    it), the sandbox removed however it ends."""
    rows, cols = _window_size(sys.stdin.fileno())
    run = c.run_stream(a.image, a.argv or None, a.entrypoint, a.timeout, None, a.rm, pty=True, rows=rows,
                       cols=cols, backend=a.backend, **create_args(a))
    try:
        async with run:
            if not a.rm:
                print(f"dsec run: sandbox {run.sandbox.id} (kept: --no-rm)", file=sys.stderr, flush=True)
            await _say_published(run.sandbox, a)
            ended_by = await _on_terminal(run.stream, a)
    except BadRequest as err:
        _cli_run_hint(err, a.image)
        raise
    if ended_by is not None:
        message = f"{signal.Signals(ended_by).name}: the command was killed" + \
            (" and its sandbox removed" if a.rm else "")
        _interrupted(a, ended_by, message, sandbox=run.sandbox.id)
        print(f"dsec run: {message}", file=sys.stderr)
        return 128 + ended_by
    return _terminal_status(run.result, a)


async def _forward_signal(stream, signum: int) -> None:
    """`dsec run`'s signal to its command; one that ended meanwhile needs none."""
    with contextlib.suppress(DsecError, ConnectionError):
        await stream.signal(signum)


def _cli_run_hint(err: BadRequest, image: str) -> None:
    """`dsec run IMAGE` of an image without a command: say where the CLI
    takes it, in place of the SDK's `(args=)`."""
    if err.detail.get("needs") == "command" and err.message.endswith(" (args=)"):
        err.message = err.message[:-len(" (args=)")] + f" (after the image's name: dsec run {image} COMMAND [ARG...])"
        err.args = (err.message,)


class CommandOutput:
    """Where a command's output goes: to our stdout and stderr as it comes,
    or, with --json, kept for the one JSON object printed at its end (the
    command's own output before it would make stdout no longer JSON)."""

    def __init__(self, as_json: bool):
        self.as_json = as_json
        self.kept = {1: bytearray(), 2: bytearray()}

    def write(self, fd: int, data: bytes) -> None:
        if self.as_json:
            self.kept[fd] += data
            return
        _write_flush(fd, data)

    def fields(self) -> dict:
        """stdout and stderr for the JSON result, as text (bytes that are not
        UTF-8 become U+FFFD)."""
        return {"stdout": self.kept[1].decode("utf-8", "replace"),
                "stderr": self.kept[2].decode("utf-8", "replace")}


def _window_size(fd: int) -> tuple[int, int]:
    """(rows, cols) of the terminal on fd; 24 x 80 where it says 0 (a serial line, some emulators)."""
    cols, rows = os.get_terminal_size(fd)
    return rows or 24, cols or 80


def _follow_window(loop: asyncio.AbstractEventLoop, stream, fd: int) -> None:
    """SIGWINCH: our window changed; the sandbox's terminal gets the new size."""
    rows, cols = _window_size(fd)
    task = loop.create_task(stream.resize(rows, cols))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())    # the exec may have ended meanwhile


class _ReadQueue:
    """The chunks of fd as the event loop reads them (b"" last, at its end or
    on an error), queued; `watch` raises PermissionError for an fd epoll does
    not take (a regular file). Use as a context: the reader goes at its end."""

    def __init__(self, fd: int):
        self.fd = fd
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()

    def watch(self) -> _ReadQueue:
        self.loop.add_reader(self.fd, self._on_readable)
        return self

    def _on_readable(self) -> None:
        data = read_ready(self.fd, 1 << 16)
        if data is None:
            return
        if not data:
            self.loop.remove_reader(self.fd)
        self.queue.put_nowait(data)

    def __enter__(self) -> asyncio.Queue[bytes]:
        return self.queue

    def __exit__(self, *exc) -> None:
        self.loop.remove_reader(self.fd)


async def _forward_keys(stream, fd: int) -> None:
    """Our stdin's bytes, as they come, into the sandbox's terminal (in order,
    what arrived meanwhile in one exec_input). Our end of input (the terminal
    hung up) stops the forwarding only: the sandbox's terminal reads ^D as its end."""
    with _ReadQueue(fd).watch() as queue:
        while True:
            chunks = [await queue.get()]
            while not queue.empty():
                chunks.append(queue.get_nowait())
            if data := b"".join(chunks):
                await stream.write(data)
            if not chunks[-1]:
                return


@contextlib.contextmanager
def _raw_terminal(fd: int):
    """The terminal on fd in raw mode (no echo, no line editing, no signals
    from keys) for the block; its settings back however the block ends."""
    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSANOW)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


# ---------------------------------------------------------------- background processes

def parse_since(text: str, now: float | None = None) -> float:
    """--since: a duration back from now ("90s", "5m", "2h", "1d", or seconds
    below 10^9), a Unix timestamp, or an ISO 8601 time; seconds since the epoch."""
    from datetime import datetime

    from .config import parse_duration

    now = time.time() if now is None else now
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        return value if value >= 1e9 else now - value
    try:
        return now - parse_duration(text, "--since")
    except DsecError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise UsageError(f"dsec logs: --since takes a duration (90s, 5m, 2h), a Unix timestamp or an "
                         f"ISO 8601 time (2024-05-01T12:00:00), got {text!r}") from None


def _when(ts: float | None) -> str:
    return "-" if ts is None else _clock(ts)


def _proc_state(p) -> str:
    if p.state == "running":
        return "running"
    if not p.signal:
        return "exited"
    try:
        return f"killed ({signal.Signals(p.signal).name})"
    except ValueError:
        return f"killed (signal {p.signal})"


async def cmd_proc(c: Client, a) -> int:
    sb = await c.get(a.sandbox)
    procs = await sb.processes()
    if a.json:
        _print_json([vars(p) for p in procs])
        return 0
    _names_as_bytes()           # an argument that is not UTF-8, as ps(1) prints it
    _table([[str(p.pid), _proc_state(p), "-" if p.exit_code is None else str(p.exit_code), _when(p.started),
             _human_bytes(p.output_bytes), _human_bytes(p.dropped), " ".join(p.argv)] for p in procs],
           ["PID", "STATE", "EXIT", "STARTED", "KEPT", "DROPPED", "COMMAND"])
    return 0


def _write_output(chunk, pid: int) -> None:
    """A chunk of a process's output to our stdout or stderr, or the notice of what fell out."""
    if chunk.lost_before is not None:
        print(f"dsec: output process {pid} wrote before {_when(chunk.lost_before)}, if any, is lost: the "
              "daemon restarted then, and the one before did not say how much it had read (it died, or is "
              "older than that count)", file=sys.stderr, flush=True)
    if chunk.dropped:
        print(f"dsec: {chunk.dropped} bytes of the output of process {pid} fell out of the daemon's buffer "
              "(limits.proc_output_bytes, or a daemon restart) or of dsec's, which it was writing out slower "
              "than the process wrote them, before this", file=sys.stderr, flush=True)
    if chunk.fd == 0:
        return
    _write_flush(chunk.fd, chunk.data)


def _write_flush(fd: int, data: bytes) -> None:
    """Every byte of `data` to our stdout (fd 1) or stderr (2), at once, after
    what was printed before. A failure raises (BrokenPipeError: nobody reads
    it; ENOSPC: a full disk): a buffered writer can report a short write of
    a large block instead, and the rest would be lost without a word."""
    (sys.stdout if fd == 1 else sys.stderr).flush()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def output_chunk_json(chunk) -> str:
    """`dsec logs --json`: one line per chunk, as `watch --json` and `events
    --json` print theirs (the data as text; bytes that are not UTF-8 become U+FFFD)."""
    return json.dumps({"fd": chunk.fd, "data": chunk.data.decode("utf-8", "replace"), "time": chunk.time,
                       "dropped": chunk.dropped, "lost_before": chunk.lost_before}, sort_keys=True)


async def cmd_logs(c: Client, a) -> int:
    proc = (await c.get(a.sandbox)).process(a.pid)
    async for chunk in proc.output(follow=a.follow, since=a.since_ts):
        if a.json:
            print(output_chunk_json(chunk), flush=True)
        else:
            _write_output(chunk, a.pid)
    return 0


def _exit_of(st) -> int:
    """A background process's status as a shell's: its exit code, 128+N if
    signal N killed it; 125 when its end is not known (a daemon recorded it
    as exited without seeing its status: never a success)."""
    if st.signal:
        return 128 + st.signal
    if st.exit_code is None:
        print(f"dsec: process {st.pid} ended with a status the daemon does not know (it lost track of the "
              "process across a restart: see its log)", file=sys.stderr)
        return EXIT_DSEC_ERROR
    return st.exit_code


async def cmd_wait(c: Client, a) -> int:
    st = await (await c.get(a.sandbox)).process(a.pid).wait()
    if a.json:
        _print_json(vars(st))
    return _exit_of(st)


async def cmd_kill(c: Client, a) -> int:
    r = await (await c.get(a.sandbox)).process(a.pid).kill(a.signal)
    if a.json:
        _print_json(r)
    return 0


async def cmd_attach(c: Client, a) -> int:
    """Our stdin to the process's (our end of input closes its stdin), its
    output to ours as `logs -f`; Ctrl-C detaches and leaves it running."""
    proc = (await c.get(a.sandbox)).process(a.pid)
    cut: list[ConnectionError] = []
    following = [asyncio.current_task()]      # emptied once the output has ended
    feeder = asyncio.get_running_loop().create_task(_feed_stdin(proc, cut, following))
    try:
        async for chunk in proc.output(follow=True):
            if a.json:
                print(output_chunk_json(chunk), flush=True)
            else:
                _write_output(chunk, a.pid)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if cut and task is not None and task.cancelling() == 1:
            # Cancelled by the feeder alone: the input is what ended.
            task.uncancel()
            raise ConnectionLost(
                f"input to process {a.pid} in sandbox {a.sandbox} was cut by a lost connection ({cut[0]}): "
                "what was being written may not all have reached it. It runs on, its stdin open: "
                f"`dsec attach {a.sandbox} {a.pid}` to go on", target=c.target, op="proc_input",
                sent=True) from None
        print(f"dsec: detached from process {a.pid}; it keeps running", file=sys.stderr)
        a.said_how_it_ended = True
        raise
    finally:
        following.clear()
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
            await feeder
    st = await proc.wait()
    if a.json:                                 # the last line: its end, the fields of `wait --json`
        print(json.dumps(vars(st), sort_keys=True), flush=True)
    return _exit_of(st)


async def _feed_stdin(proc, cut: list[ConnectionError], following: list[asyncio.Task | None]) -> None:
    """Our stdin, as it comes, to the process; at its end the process's stdin
    is closed. Stops quietly where the process takes no more input. A chunk
    lost with the connection (a daemon restart) may have reached it in
    part, and nothing after it may go as if it had: its error goes in `cut`
    and the task in `following` (following the output, while it does) is
    cancelled."""
    try:
        async for data in _stdin_as_it_comes():
            await proc.write(data)
        await proc.close_stdin()
    except DsecError:
        pass          # exited, stdin closed or never open: the output still shows
    except ConnectionError as err:
        cut.append(err)
        for task in following:
            if task is not None:
                task.cancel()


async def _stdin_as_it_comes():
    """Chunks of our stdin: by the event loop for a pipe or a terminal; a
    regular file (never blocks for long) is read by a thread."""
    try:
        reads = _ReadQueue(sys.stdin.fileno()).watch()
    except PermissionError:            # epoll takes no regular file
        async for data in _stdin_chunks():
            yield data
        return
    with reads as queue:
        while data := await queue.get():
            yield data


def _print_trace(rec: dict, as_json: bool, path: str | None) -> None:
    """The record of `dsec trace`: to --output, else to stderr (stdout is the command's)."""
    if "error" in rec:
        print(f"dsec trace: {rec['error']}", file=sys.stderr)
        return
    if as_json:
        text = json.dumps(rec, sort_keys=True) + "\n"
    else:
        from .trace import Trace

        text = Trace(**rec).to_text()
    if path:
        with open(path, "w") as f:
            f.write(text)
    else:
        sys.stderr.write(text)


def _split_remote(spec: str) -> tuple[str | None, str]:
    """'SB:/path' -> (SB, /path); a local path -> (None, path). ./x:y stays local."""
    head, sep, tail = spec.partition(":")
    if sep and head and "/" not in head and tail.startswith("/"):
        return head, tail
    return None, spec


def _relative_remote(spec: str) -> bool:
    """SB:path with a path that is not absolute (SB:tmp/x, SB:), and no
    local file of that name: a sandbox's path given as docker cp takes
    one, relative to the container's directory, which dsec does not."""
    head, sep, tail = spec.partition(":")
    return bool(sep and head and "/" not in head and not tail.startswith("/") and not os.path.lexists(spec))


def _cp_sides(a) -> tuple[str | None, str, str | None, str]:
    """(source sandbox, source path, destination sandbox, destination path): one side is a sandbox's."""
    src_sb, src = _split_remote(a.src)
    dst_sb, dst = _split_remote(a.dst)
    if (src_sb is None) == (dst_sb is None):
        relative = [s for s in (a.src, a.dst) if src_sb is None and _relative_remote(s)]
        if relative:
            raise UsageError(f"dsec cp: a sandbox's path must be absolute: give SANDBOX:/path, got {relative[0]!r}")
        raise UsageError("dsec cp: exactly one side must be SANDBOX:/absolute/path")
    return src_sb, src, dst_sb, dst


def _contents_of(path: str) -> bool:
    """`DIR/.`: docker cp's form for a directory's contents, not the directory."""
    return path == "." or path.endswith("/.")


async def _cp_dir(c: Client, a, src_sb: str | None, src: str, dst_sb: str | None, dst: str) -> int:
    """cp -r: a directory as a tar stream. Like cp -r, an existing directory
    as the destination receives the copy under the source's name; with
    `SRC/.`, as docker cp, the source's contents go into it instead. Where
    the copy's directory exists already it is merged into, as docker cp
    does (_cp_merged). --json: the daemon's result (path, count, bytes;
    skipped when copied from it) with the sandbox and the local path."""
    if src_sb is None:
        sb = await c.get(dst_sb)
        if await _remote_dir(sb, dst):
            if not _contents_of(src):
                dst = posixpath.join(dst, os.path.basename(os.path.normpath(src)))
            if _contents_of(src) or await _remote_dir(sb, dst):
                return await _cp_merged(a, sb, src, dst, upload=True)
        r = await sb.upload_dir(src, dst, owner=a.owner)
        if a.json:
            _print_json({**r, "sandbox": sb.id, "local": src})
        return 0
    sb = await c.get(src_sb)
    if os.path.isdir(dst):
        if not _contents_of(src):
            dst = os.path.join(dst, posixpath.basename(posixpath.normpath(src)) or "root")
        if _contents_of(src) or os.path.isdir(dst):
            return await _cp_merged(a, sb, src, dst, upload=False)
    elif not os.path.isdir(os.path.dirname(os.path.abspath(dst))):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), dst)
    r = await sb.download_dir(src, dst)
    if a.json:
        _print_json({**r, "sandbox": sb.id, "local": dst})
    _report_skipped(src, r)
    return 0


async def _remote_dir(sb, path: str, follow: bool = False) -> bool:
    """Whether `path` is a directory in the sandbox (one stat; a missing path
    is not); with `follow`, a symlink to one is too (a listing as well)."""
    try:
        kind = (await sb.stat(path))["type"]
    except NotFound:
        return False
    return kind == "dir" or (follow and kind == "symlink" and await _lists_as_dir(sb, path))


async def _cp_tar_out(a, sb, sb_id: str, src: str) -> int:
    """`dsec cp SB:/dir -`: the tree as a tar on stdout, its entries below
    the directory's base name (SB:/dir/.: the contents, without it), as
    docker cp gives it; written as it comes (dsecd/cptar.py)."""
    if a.json:
        raise UsageError(f"dsec cp: --json: stdout carries the tar of {sb_id}:{src}; drop --json (what "
                         "was left out is said on stderr)")
    if os.isatty(1):        # as tar(1) refuses: the bytes would garble the terminal
        raise UsageError(f"dsec cp: {sb_id}:{src} is a directory, and stdout is a terminal: not writing a tar "
                         "there; redirect it (> dir.tar) or pipe it (| tar -x)")
    top = "" if _contents_of(src) else posixpath.basename(posixpath.normpath(src))
    r = await cptar.tar_to_fd(sb, src if src.endswith("/") else src + "/", top)     # a symlink: what it leads to
    _report_skipped(src, r)
    return 0


async def _cp_file_tar_out(a, sb, sb_id: str, src: str) -> int:
    """`dsec cp --tar SB:/file -`: a tar of the one file (a symlink: what it
    leads to, as a plain copy follows one), named by its base name, with its
    permission bits and mtime, as docker cp gives it. The file is spooled
    first (to $TMPDIR, never all in memory), so that the size its header
    says is the size that follows, whatever the sandbox does meanwhile."""
    if a.json or os.isatty(1):
        raise UsageError(f"dsec cp: --tar: stdout carries the tar of {sb_id}:{src}: not with --json, nor onto "
                         "a terminal; redirect it (> file.tar) or pipe it (| tar -x)")
    st = await sb.stat(src)
    if st["type"] == "symlink":
        with contextlib.suppress(BadRequest):       # a microVM's agent before version 8 does not follow
            st = await sb.stat(src, follow=True)
    with tempfile.TemporaryFile() as spool:
        async with contextlib.aclosing(sb.read_chunks(src)) as chunks:
            async for piece in chunks:
                spool.write(piece)
        info = cptar.RawNameTarInfo(posixpath.basename(src.rstrip("/")))
        info.size = spool.tell()
        info.mode = st["mode"] & 0o777 if st["type"] == "file" else 0o644
        info.mtime = int(st.get("mtime") or time.time())
        spool.seek(0)
        await _in_a_thread_of_its_own(cptar.one_file_tar, info, spool)
    return 0


def _landing_name() -> str:
    """A name of this client's own, beside what a copy lands on, for the
    copy to arrive whole under before it moves into place."""
    return f".dsec-cp-{os.getpid()}-{secrets.token_hex(4)}"


async def _cp_merged(a, sb, src: str, dst: str, upload: bool, tar: AsyncIterator[bytes] | None = None) -> int:
    """`dsec cp -r` into the existing directory DST: SRC's entries (of SRC/.,
    or of the directory SRC where DST is its namesake; or those of `tar`, a
    tar stream, where SRC is "-") become entries of DST, merged as docker
    cp merges (dsecd/cpmerge.py). The tree arrives whole in a new directory
    inside DST, then moves into place."""
    landing = _landing_name()
    if upload:
        held = posixpath.join(dst, landing)
        try:
            if tar is not None:
                r = await sb.upload_tar(tar, held, temporary=True, owner=a.owner, dirs=True)
            else:
                r = await sb.upload_dir(src, held, temporary=True, owner=a.owner, dirs=True)
        except DsecError as err:            # named as the user named it, not by the landing
            raise named_as(err, held, dst) from None
        dirs = r.pop("dirs", ())
        if tar is None and _contents_of(src) and dirs:
            # As docker cp: SRC/. gives DST its contents, not SRC's own mode and mtime.
            dirs = [entry for entry in dirs if entry[0]]
        try:
            replaced = await cpmerge.into_sandbox(sb, held, dst, dirs,
                                                  lambda text: print(f"dsec cp: {text}", file=sys.stderr))
        except BaseException:
            with contextlib.suppress(DsecError, ConnectionError):    # keep the error that got us here
                await sb.remove(held, recursive=True)
            raise
    else:
        held = os.path.join(dst, landing)
        r = await sb.download_dir(src, held)
        try:
            # As docker cp: SRC/. gives DST its contents, not SRC's own mode and mtime.
            st = os.lstat(held)
            top = None if _contents_of(src) else (stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            os.chmod(held, 0o700)        # it has SRC's mode, which may not let us move entries out
            replaced = await cpmerge.into_local(held, dst, top)
        except BaseException:
            localcopy.remove_tree(held)
            raise
    if a.json:
        _print_json({**r, "path": dst if upload else r["path"], "sandbox": sb.id,
                     "local": src if upload else dst, "replaced": replaced})
    _report_skipped(src, r)
    return 0


def _report_skipped(src: str, r: dict) -> None:
    """What a copy out of a sandbox left behind (FIFOs, devices, sockets)."""
    top = src[:-2] if src.endswith("/.") else src.rstrip("/")
    for item in r.get("skipped", []):
        print(f"dsec cp: not copied: {top}/{item['path']} ({item['type']}): {item['reason']}", file=sys.stderr)


def named_sandboxes(a) -> list[str]:
    """The sandbox ids a command names: `dsec fleet` sends it to their host."""
    if a.cmd == "cp":
        src_sb, _, dst_sb, _ = _cp_sides(a)
        return [sb for sb in (src_sb, dst_sb) if sb]
    if a.cmd in ("ls", "watch"):
        return [_split_remote(a.target)[0] or a.target]
    if a.cmd == "cat":
        return [_split_remote(t)[0] or t for t in a.targets]
    if a.cmd in ("rm", "pause", "resume", "renew"):
        return [_split_remote(s)[0] or s for s in a.sandboxes]
    sb = getattr(a, "sandbox", None)
    return [sb] if sb else []


@contextlib.contextmanager
def _cancelled_by_ending_signals(signals: list[int]):
    """For the with block: SIGTERM and SIGHUP (a `timeout`, a closed
    terminal) cancel the current task, as ^C would end it, through the
    loop (a handler raising from wherever the interpreter is could land in
    one of asyncio's callbacks, which drops it); each is added to
    `signals`, whose first tells the CancelledError from any other. A
    second one ends the process at once, as a second ^C does: the clean-up
    the first started (a temporary file's removal, a cancel's answer) may
    wait on a daemon that no longer answers."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_signal(signum: int) -> None:
        if signals:
            os._exit(128 + signum)
        main.cancel()
        signals.append(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield
    finally:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(signum)


async def cmd_cp(c: Client, a) -> int:
    """SIGTERM and SIGHUP end a copy as ^C does: the copy is cancelled, and
    an upload's temporary file in the sandbox removed, not left there
    half-written; exits 128+signal."""
    signals: list[int] = []
    try:
        with _cancelled_by_ending_signals(signals):
            return await _cp(c, a)
    except asyncio.CancelledError:
        if not signals:
            raise
        message = f"{signal.Signals(signals[0]).name}: the copy was cancelled"
        _interrupted(a, signals[0], message)
        print(f"dsec cp: {message}", file=sys.stderr)
        return 128 + signals[0]


async def _cp(c: Client, a) -> int:
    src_sb, src, dst_sb, dst = _cp_sides(a)
    if a.owner is not None and src_sb is not None:
        raise UsageError("dsec cp: --owner gives what a copy into a sandbox makes to a user of the sandbox; "
                         "a copy out of one belongs to whoever runs dsec")
    if getattr(a, "tar", False) and (dst if src_sb is not None else src) != "-":
        raise UsageError("dsec cp: --tar goes with '-': dsec cp --tar SB:/path - or dsec cp --tar - SB:/dir")
    if src_sb is not None and dst == "-":
        sb = await c.get(src_sb)
        # As docker cp - gives it: a directory (or a symlink to one) as a tar;
        # a file's bytes as they are, or with --tar a tar of the one file.
        if await _remote_dir(sb, src, follow=True):
            return await _cp_tar_out(a, sb, src_sb, src)
        if getattr(a, "tar", False):
            return await _cp_file_tar_out(a, sb, src_sb, src)
    if src_sb is not None and dst != "-" and _keeps_links(a) and await _cp_link_out(c, a, src_sb, src, dst):
        return 0
    if src_sb is None and _keeps_links(a) and await _cp_link_in(c, a, src, dst_sb, dst):
        return 0
    if src_sb is None and a.recursive and getattr(a, "follow_link", False) and os.path.islink(src) \
            and os.path.isdir(src):
        src += "/"              # -L: the directory it leads to, as LINK/ names it
    if a.recursive and not await _is_a_file(c, src_sb, src):     # cp -r copies a file as a file
        return await _cp_dir(c, a, src_sb, src, dst_sb, dst)
    if src_sb is None and os.path.isdir(src):
        raise UsageError(f"dsec cp: {src} is a directory; copy it with dsec cp -r")
    if src_sb is None:
        sb = await c.get(dst_sb)
        if src == "-" and await _remote_dir(sb, dst, follow=True):
            # As docker cp - takes it: a tar stream, its entries merged into the directory.
            if os.isatty(0):
                raise UsageError(f"dsec cp: {dst} is a directory, which takes a tar on stdin, and stdin is a "
                                 "terminal: pipe the tar in (tar -cf - . | dsec cp - SB:/dir), or name a file "
                                 f"(SB:{dst.rstrip('/')}/NAME)")
            try:
                return await _cp_merged(a, sb, src, dst, upload=True,
                                        tar=cptar.batched(cptar.decompressed(_stdin_chunks())))
            except BadRequest as err:
                if "not a valid archive" not in err.message:
                    raise
                raise BadRequest(f"{err.message} (stdin into a directory is a tar, as docker cp - takes it; "
                                 f"name a file to write stdin's bytes to: SB:{dst.rstrip('/')}/NAME)",
                                 err.detail) from None
        if getattr(a, "tar", False):
            raise UsageError(f"dsec cp: {dst}: no such directory; a tar goes into a directory that exists, as "
                             "docker cp - requires")
        dst = await _cp_remote_target(sb, src, dst)
        # Streamed, never all in memory; atomic: a failed copy leaves nothing.
        if src == "-":
            size = await sb.write_file(dst, _stdin_chunks(), mode=0o644, atomic=True, owner=a.owner)
        else:
            # A FIFO's open waits for its writer: not on the loop, or no signal could end dsec.
            with await _in_a_thread_of_its_own(open, src, "rb") as f:
                st = os.fstat(f.fileno())
                # A pipe or FIFO (<(cmd), /dev/stdin) may block for as long as its writer likes.
                source = f if stat.S_ISREG(st.st_mode) else _stdin_chunks(f.fileno())
                size = await sb.write_file(dst, source, mode=st.st_mode & 0o7777, atomic=True, owner=a.owner)
        if a.json:
            _print_json({"sandbox": sb.id, "path": dst, "local": src, "size": size})
        return 0
    sb = await c.get(src_sb)
    if dst == "-":
        if a.json:               # the one object on stdout: the bytes as text, as `cat --json` gives them
            data = await sb.read_file(src)
            _print_json({"sandbox": sb.id, "path": src, "size": len(data), "data": data.decode("utf-8", "replace")})
        else:
            await _to_stdout(sb, src)
        return 0
    if os.path.isdir(dst):
        dst = os.path.join(dst, os.path.basename(src))
    elif dst.endswith("/"):
        raise UsageError(f"dsec cp: {dst}: no such directory (a destination ending in / must be one)")
    st = await sb.stat(src)
    if st["type"] == "symlink":     # -L (or a microVM's link): its target's bits
        with contextlib.suppress(BadRequest):       # a microVM's agent before version 8 does not follow
            st = await sb.stat(src, follow=True)
    # Its permission bits, as docker cp keeps them; never setuid or setgid
    # on our side (a sandbox's file, owned here by whoever runs dsec).
    size = await _copy_out(sb, src, dst, st["mode"] & 0o777 if st["type"] == "file" else None)
    if a.json:
        _print_json({"sandbox": sb.id, "path": src, "local": dst, "size": size})
    return 0


async def _stdin_chunks(fd: int = 0) -> AsyncIterator[bytes]:
    """fd 0 (or a FIFO's `fd`) as it comes, each read in a thread of its
    own (cmd_cp's SIGTERM ends the copy while one blocks: an executor's
    thread would hold the exit until the writer wrote or closed),
    unbuffered: a thread left blocked in sys.stdin's buffered read at exit
    holds its lock, and the interpreter's shutdown aborts on it."""
    while chunk := await _in_a_thread_of_its_own(os.read, fd, 1 << 20):
        yield chunk


async def _to_stdout(sb, path: str) -> int:
    """The sandbox's file onto stdout as it comes, never all in memory; the
    bytes written. A file replaced while it is read fails (Conflict) after
    what was written: a pipe cannot be written again."""
    written = 0
    async with contextlib.aclosing(sb.read_chunks(path)) as chunks:
        async for piece in chunks:
            await _in_a_thread_of_its_own(_write_flush, 1, piece)
            written += len(piece)
    return written


def _keeps_links(a) -> bool:
    """Whether a symlink named as the source of a copy (out, or in) is copied
    as a symlink, as cp(1) has it: with -r (or -P), not without (or with -L). A
    plain copy follows it inside the sandbox: a link the sandbox made would
    otherwise land on the host as a link resolved against the host's files
    (/etc/shadow, ~/.ssh/id_rsa), which the next copy into a sandbox sends."""
    return (a.recursive or getattr(a, "no_dereference", False)) and not getattr(a, "follow_link", False)


async def _cp_link_out(c: Client, a, sb_id: str, src: str, dst: str) -> bool:
    """`dsec cp -r SB:/link DST` (or -P), as cp -a and docker cp do it: a
    symlink comes out as a symlink with the same target (a trailing / or /.
    follows it). False when `src` is no symlink, or its target is not known
    (a microVM's agent before version 8 reads no links): the caller copies
    what it leads to."""
    if src.endswith("/") or _contents_of(src):
        return False
    sb = await c.get(sb_id)
    try:
        st = await sb.stat(src)
    except NotFound:
        return False        # the copy says what is missing
    if st["type"] != "symlink" or "target" not in st:
        return False
    if os.path.isdir(dst):
        dst = os.path.join(dst, posixpath.basename(src))
    elif dst.endswith("/"):
        raise UsageError(f"dsec cp: {dst}: no such directory (a destination ending in / must be one)")
    _link_local(dst, st["target"])         # os.fsdecode's str where it is not UTF-8 (the SDK's stat)
    if a.json:
        _print_json({"sandbox": sb.id, "path": src, "local": dst, "target": st["target"]})
    return True


async def _cp_link_in(c: Client, a, src: str, sb_id: str, dst: str) -> bool:
    """`dsec cp -r LINK SB:DST` (or -P): the host symlink LINK arrives as a
    symlink with the same target, as _cp_link_out gives one out; nothing it
    leads to is read. False when `src` is no symlink (or LINK/ follows it).
    It is sent as a tar of that one entry into a new directory beside the
    destination, and renamed from there over DST."""
    if src.endswith("/") or _contents_of(src) or not os.path.islink(src):
        return False
    target = os.readlink(src)
    sb = await c.get(sb_id)
    dst = await _cp_remote_target(sb, src, dst)
    parent, name = posixpath.split(dst)
    landing = posixpath.join(parent, _landing_name())
    spool = io.BytesIO()
    with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tf:
        link = tarfile.TarInfo(name)
        link.type, link.linkname, link.mode = tarfile.SYMTYPE, target, 0o777
        link.mtime = int(os.lstat(src).st_mtime)
        tf.addfile(link)
    spool.seek(0)
    await sb.mkdir(parent, parents=True, owner=a.owner)      # as a file's copy makes them
    try:
        await sb.upload_tar(spool, landing, temporary=True, owner=a.owner)
        try:
            await sb.rename(posixpath.join(landing, name), dst, overwrite=True)
        finally:
            with contextlib.suppress(DsecError, ConnectionError):    # keep the error that got us here
                await sb.remove(landing, recursive=True)
    except DsecError as err:                  # named as the user named it, not by the landing
        raise named_as(named_as(err, posixpath.join(landing, name), dst), landing, dst) from None
    if a.json:
        _print_json({"sandbox": sb.id, "path": dst, "local": src, "target": target})
    return True


def _link_local(dst: str, target: str) -> None:
    """Symlink `dst` -> `target`, made under a temporary name beside it and
    renamed over what `dst` was (as _copy_out does a file)."""
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), dst)
    tmp = f"{dst}.dsec-tmp-{os.getpid()}"
    try:
        os.symlink(target, tmp)
        os.replace(tmp, dst)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise type(err)(err.errno, err.strerror, dst) from err


async def _is_a_file(c: Client, sb_id: str | None, path: str) -> bool:
    """Whether a cp source is a regular file (a sandbox's, or ours: sb_id None)."""
    if sb_id is None:
        return path == "-" or os.path.isfile(path)
    sb = await c.get(sb_id)
    try:
        kind = (await sb.stat(path))["type"]
    except NotFound:
        return False        # the directory copy says what is missing
    # file_stat does not follow a symlink; listing does (a link to a directory lists).
    return kind == "file" or (kind == "symlink" and not await _lists_as_dir(sb, path))


async def _cp_remote_target(sb, src: str, dst: str) -> str:
    """Where `dsec cp SRC SB:DST` writes, as cp(1) would: DST, or DST/NAME
    (NAME: the source's) when DST ends in /, is a directory or a symlink to
    one (one stat; a listing too when DST is a symlink, the one call that
    follows it). A symlink to anything else is replaced, as the write's
    rename replaces any name."""
    into = dst.endswith("/")
    if not into:
        try:
            kind = (await sb.stat(dst))["type"]
            into = kind == "dir" or (kind == "symlink" and await _lists_as_dir(sb, dst))
        except NotFound:
            pass
    if not into:
        return dst
    if src == "-":              # a directory takes stdin as a tar (_cp): this one is not there
        raise UsageError(f"dsec cp: {dst}: no such directory (stdin goes into a directory that exists as a "
                         "tar stream, or to a file named without a trailing /)")
    return posixpath.join(dst, os.path.basename(src))


async def _lists_as_dir(sb, path: str) -> bool:
    """Whether symlink `path` leads to a directory: file_list follows it."""
    try:
        await sb.list_files(path)
    except (NotFound, BadRequest, PermissionDenied):
        return False
    return True


async def _copy_out(sb, src: str, dst: str, mode: int | None = None) -> int:
    """The sandbox's file `src` as local file `dst` (with permission bits
    `mode`; None: as a new file gets them), streamed into a temporary name
    beside it and renamed over it (a failed or cancelled copy leaves the old
    file or none). Errors name `dst`, the path the user gave, not the
    temporary file. The bytes copied."""
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), dst)
    tmp = f"{dst}.dsec-tmp-{os.getpid()}"
    try:
        with _named_as_ours(dst, f" (creating the copy in {parent} first)"):
            f = open(tmp, "wb")
        with f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            # Its own errors (the daemon's, a lost connection) as they are;
            # the local file's writes say which file.
            size = await sb.read_file_to(src, _LocalFile(f, dst, parent))
        with _named_as_ours(dst):
            os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return size


@contextlib.contextmanager
def _named_as_ours(dst: str, where: str = ""):
    """An OSError of our side's file (not a daemon's error, nor a lost
    connection: no plain OSError) named as the path the user gave."""
    try:
        yield
    except ConnectionError:
        raise
    except OSError as err:
        raise OSError(err.errno, f"{err.strerror}{where}", dst) from err


class _LocalFile:
    """The local file a copy out writes, whose write errors (a full disk)
    name the path the user gave, not the temporary file."""

    def __init__(self, f, dst: str, parent: str):
        self.f, self.dst, self.parent = f, dst, parent

    def write(self, data) -> int:
        with _named_as_ours(self.dst, f" (writing the copy in {self.parent})"):
            return self.f.write(data)

    def seekable(self) -> bool:
        return self.f.seekable()

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, pos: int) -> int:
        return self.f.seek(pos)

    def truncate(self) -> int:
        return self.f.truncate()


async def cmd_ps(c: Client, a) -> int:
    sbs = await c.list(_kv(a.label, "--label"))
    if a.json:
        _print_json(sbs)
        return 0
    rows = []
    for s in sorted(sbs, key=lambda s: s["created"]):
        lim = s["limits"]
        # Networking a restarted daemon could not re-adopt is gone: said where the sandboxes are listed.
        state = s["state"] + (", net lost" if (s.get("net") or {}).get("lost") else "")
        rows.append([s["id"], s["image"], state, f"{lim['cpu']:g}", _human_bytes(lim["memory"]),
                     str(s["execs_running"]), str(s.get("procs_running", 0)),
                     _clock(s["created"]),
                     # One shell word per label: a value with spaces, commas or quotes reads back whole.
                     " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(s["labels"].items()))])
    _table(rows, ["ID", "IMAGE", "STATE", "CPU", "MEMORY", "EXECS", "PROCS", "CREATED", "LABELS"])
    return 0


async def cmd_inspect(c: Client, a) -> int:
    _print_json(await c.request("inspect", sandbox=a.sandbox))
    return 0


def _remote_path(spec: str, verb: str) -> tuple[str, str]:
    sb_id, path = _split_remote(spec)
    if sb_id is None:
        raise UsageError(f"dsec {verb}: give SANDBOX:/absolute/path, got {spec!r}")
    return sb_id, path


async def cmd_ls(c: Client, a) -> int:
    sb_id, path = _remote_path(a.target, "ls")
    sb = await c.get(sb_id)
    try:
        entries = await sb.list_files(path, a.depth)
    except DsecError as err:
        if err.detail.get("errno") not in ("ENOTDIR", "ENOENT") or path.endswith("/"):
            raise
        try:                # not a directory (or a dangling symlink): the entry itself, as ls(1) lists it
            st = await sb.stat(path)
        except DsecError:
            raise err from None         # a path below a file: the listing's own error
        st.pop("path", None)
        entries = [{**st, "name": posixpath.basename(path)}]
    if a.json:
        _print_json(entries)
        return _listed_whole(a, entries)
    _names_as_bytes()
    _table([[e["type"], f"{e['mode']:04o}", str(e["size"]), time.strftime("%Y-%m-%d %H:%M", time.localtime(e["mtime"])),
             e["name"]] for e in entries], ["TYPE", "MODE", "SIZE", "MODIFIED", "NAME"])
    return _listed_whole(a, entries)


def _names_as_bytes() -> None:
    """Print a name that is not UTF-8 (its odd bytes held as surrogates,
    os.fsdecode's) as its bytes, as ls(1) prints it into a pipe."""
    with contextlib.suppress(AttributeError):       # stdout replaced by something else (a test's)
        sys.stdout.reconfigure(errors="surrogateescape")


def _listed_whole(a, entries) -> int:
    """0, or 1 and why on stderr when the listing was cut short (the most
    entries one listing gives), as ls(1) fails on a directory it could not read whole."""
    if not getattr(entries, "truncated", False):
        return 0
    print(f"dsec ls: {a.target}: only {len(entries)} of its entries are listed (the most one listing gives); "
          f"list its subdirectories one by one, or run `dsec exec SANDBOX -- ls` for all of it", file=sys.stderr)
    return 1


async def cmd_watch(c: Client, a) -> int:
    """Print changes under a directory until interrupted, or until it or its sandbox goes."""
    sb_id, path = _remote_path(a.target, "watch")
    sb = await c.get(sb_id)
    _names_as_bytes()
    async for ev in sb.watch(path, recursive=a.recursive):
        if a.json:
            print(json.dumps(ev, sort_keys=True), flush=True)
        elif ev["kind"] == "stopped":
            print(f"dsec watch: stopped: {ev['reason']}", file=sys.stderr)
        elif ev["kind"] == "ready":
            print(f"dsec watch: watching {ev['dirs']} director{'y' if ev['dirs'] == 1 else 'ies'} "
                  f"under {ev['path']}", file=sys.stderr)
        else:
            print(f"{ev['kind']:<9} {ev['path']}{'/' if ev['is_dir'] else ''}", flush=True)
    return 0


async def cmd_cat(c: Client, a) -> int:
    """The files' bytes as they are; --json: one line per file, its content as
    text (bytes that are not UTF-8 become U+FFFD, as `logs --json` prints output).
    As cat(1), a file that cannot be read is an error line and the others are
    still printed; the exit status is then 1."""
    status = 0
    for sb_id, path in [_remote_path(spec, "cat") for spec in a.targets]:
        try:
            sb = await c.get(sb_id)
            if a.json:
                data = await sb.read_file(path)
                print(json.dumps({"sandbox": sb_id, "path": path, "size": len(data),
                                  "data": data.decode("utf-8", "replace")}, sort_keys=True), flush=True)
            else:
                await _to_stdout(sb, path)      # streamed: a file of any size
        except DsecError as err:
            sys.stdout.flush()             # what came before, before the error
            _print_item_error(a, err, sandbox=sb_id, path=path)
            print(f"dsec cat: {err.code}: {err.message}", file=sys.stderr, flush=True)
            status = 1
    sys.stdout.flush()
    return status


async def _rm_paths(c: Client, a) -> int:
    """`dsec rm SANDBOX:/path...`; with -f, as rm -f: a path that does not
    exist is passed over quietly (a missing sandbox, or a file where a
    directory should be, is still a failure)."""
    status = 0
    for spec in a.sandboxes:
        sb_id, path = _remote_path(spec, "rm")
        try:
            r = await (await c.get(sb_id)).remove(path, recursive=a.recursive)
            if a.json:
                _print_json(r, line=True)
        except DsecError as err:
            if a.force and err.code == "not_found" and err.detail.get("errno") == "ENOENT":
                continue
            _print_item_error(a, err, sandbox=sb_id, path=path)
            print(f"dsec: rm {spec}: {err.code}: {err.message}", file=sys.stderr)
            status = 1
    return status


async def cmd_rm(c: Client, a) -> int:
    paths = [s for s in a.sandboxes if _split_remote(s)[0] is not None]
    if paths and len(paths) != len(a.sandboxes):
        raise UsageError("dsec rm: give sandbox ids or SANDBOX:/paths, not both")
    if paths:
        return await _rm_paths(c, a)
    if a.recursive:
        raise UsageError("dsec rm: -r goes with SANDBOX:/paths (a sandbox is removed whole)")
    if a.all:
        if a.sandboxes:
            raise UsageError("dsec rm: give sandbox ids or --all, not both")
        r = await c.destroy_all(force=a.force, labels=_kv(a.label, "--label"))
        if a.json:
            _print_json(r, line=True)
        else:
            print(f"removed {len(r['destroyed'])} sandbox(es)")
            for sb_id, err in r["failed"].items():
                print(f"dsec: rm {sb_id}: {err}", file=sys.stderr)
        return 1 if r["failed"] else 0
    if not a.sandboxes:
        raise UsageError("dsec rm: give sandbox ids, or --all")
    status = 0
    for sb_id in a.sandboxes:
        try:
            r = await c.request("destroy", sandbox=sb_id, force=a.force)
            _print_json(r, line=True) if a.json else print(r["id"])
        except DsecError as err:
            _print_item_error(a, err, sandbox=sb_id)
            print(f"dsec: rm {sb_id}: {err}", file=sys.stderr)
            status = 1
    return status


def _print_item_error(a, err: DsecError, **which) -> None:
    """--json: one sandbox's or path's failure (rm, cat), as the error object (naming it)."""
    wire = err.to_wire()
    wire["detail"] = {**which, **wire["detail"]}
    _print_error(a, wire)


# ---------------------------------------------------------------- parser

COMMANDS = {"policy": cmd_policy, "info": cmd_info, "image": cmd_image, "snapshot": cmd_snapshot,
            "pause": cmd_pause_resume, "resume": cmd_pause_resume, "renew": cmd_renew, "job": cmd_job,
            "events": cmd_events,
            "net": cmd_net, "port": cmd_port, "trace": cmd_exec, "create": cmd_create, "run": cmd_run,
            "exec": cmd_exec, "call": cmd_call, "pool": cmd_pool, "drain": cmd_drain, "undrain": cmd_drain,
            "cp": cmd_cp,
            "ps": cmd_ps, "inspect": cmd_inspect, "rm": cmd_rm, "top": cmd_top, "ls": cmd_ls, "cat": cmd_cat,
            "watch": cmd_watch, "proc": cmd_proc, "logs": cmd_logs, "attach": cmd_attach, "kill": cmd_kill,
            "wait": cmd_wait}


def ssh_options(a) -> SshOptions:
    """How --host and fleet reach hosts: the environment, then the options."""
    return SshOptions.from_env(config=a.ssh_config, remote_dsec=a.remote_dsec,
                               remote_socket=a.socket if (a.host or a.fleet) else None)


def make_client(a) -> Client:
    if a.host:
        c = Client(fleet_target(a.host), name=f"dsec {a.cmd}", ssh=ssh_options(a))
    else:
        c = Client(a.socket or default_socket(), name=f"dsec {a.cmd}",
                   silence_timeout=getattr(a, "silence_timeout", None))
    c.lost_advice = "run the command again once the daemon answers"
    return c


async def _run(a) -> int:
    """The command, ended by SIGTERM or SIGHUP (a `timeout`, a closed
    terminal) as ^C ends it: the command is cancelled (its requests with
    it) and _EndedBySignal raised, unless the command handles these
    signals itself (cp, run, exec -t replace this handler while they run)."""
    ended: list[int] = []
    try:
        with _cancelled_by_ending_signals(ended):
            if a.fleet:
                return await fleet_cli.run(a, COMMANDS, named_sandboxes, ssh_options(a))
            async with make_client(a) as c:
                return await COMMANDS[a.cmd](c, a)
    except asyncio.CancelledError:
        if not ended:
            raise
        raise _EndedBySignal(ended[0]) from None


def _absolute_excludes(paths: list[str]) -> None:
    """`dsec snapshot --exclude` takes absolute paths in the sandbox. The
    daemon reads a relative one from the sandbox's root (`root/.cache` is
    /root/.cache, as images.snapshot_exclude writes them), but on a command
    line `node_modules` reads as from the working directory (/app/node_modules)
    and would leave out nothing there, without a word: said instead."""
    for path in paths:
        if path and not path.startswith("/"):
            raise UsageError(f"dsec snapshot: --exclude {path!r} is relative; give an absolute path in the "
                             f"sandbox: /{path.removeprefix('./')} from its root, or the one under its working "
                             "directory you mean (a relative path is not read from there)")


def check_usage(a: argparse.Namespace) -> None:
    """What argparse cannot say, checked before the daemon is asked anything."""
    if a.cmd in ("exec", "trace") and not a.argv:
        raise UsageError(f"dsec {a.cmd}: give a command after the sandbox id, e.g. dsec {a.cmd} SB -- ls /")
    if getattr(a, "detach", False) and (a.tty or a.interactive or a.timeout is not None):
        raise UsageError(f"dsec {a.cmd}: -d runs the command in the background: drop -t, -i and --timeout "
                         "(send input with dsec attach, end it with dsec kill)")
    if a.cmd == "run" and a.detach and a.rm:
        raise UsageError("dsec run: -d leaves the command running in a sandbox that stays until dsec rm: "
                         "drop --rm (--ttl or --idle-ttl bound its life)")
    if a.cmd == "logs":
        a.since_ts = None if a.since is None else parse_since(a.since)
    if (a.cmd == "events" and a.sandbox and a.sandbox_id        # an id and a prefix of it name one sandbox
            and not (a.sandbox.startswith(a.sandbox_id) or a.sandbox_id.startswith(a.sandbox))):
        raise UsageError(f"dsec events: two sandboxes, {a.sandbox_id} and --sandbox {a.sandbox}: "
                         "give one (events of every sandbox: give neither)")
    if getattr(a, "tty", False) and not (sys.stdin is not None and os.isatty(0)):
        raise UsageError(f"dsec {a.cmd}: -t needs a terminal, but the input device is not a TTY; "
                         "drop -t (with -i alone the command reads piped input)")
    if a.cmd == "call" and not a.argv and not a.code_file:
        raise UsageError("dsec call: give a command after --, or --code-file FILE")
    if hasattr(a, "env_file"):          # docker's forms: K=V, K alone, files
        env_vars(a)
    else:
        _kv(getattr(a, "env", None), "--env")
    _kv(getattr(a, "label", None), "--label")
    if a.cmd == "snapshot":
        _absolute_excludes(a.exclude or [])
    if a.cmd == "cp":
        _cp_sides(a)
    if a.cmd == "rm":
        # No sandbox id has a colon: SB:path with a relative path is a path
        # given wrongly, not an id to look for.
        for spec in a.sandboxes:
            if ":" in spec and _split_remote(spec)[0] is None:
                raise UsageError(f"dsec rm: a sandbox's path must be absolute: give SANDBOX:/path, got {spec!r}")
    if a.cmd == "image" and a.image_cmd == "build":
        _check_image_build(a)


def _build_args(items: list[str] | None) -> dict[str, str]:
    """--build-arg K=V, or K alone for the value of $K here (none when it is
    unset), as docker build takes them: `--build-arg HTTP_PROXY`."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" in item:
            out.update(_kv([item], "--build-arg"))
        elif not item:
            raise UsageError("dsec: --build-arg must look like KEY=VALUE or KEY (its value from the environment)")
        elif item in os.environ:
            out[item] = os.environ[item]
    return out


def _check_image_build(a: argparse.Namespace) -> None:
    """A Dockerfile build (-f) and a directory or tarball build take different options."""
    if a.file:
        for option, value in (("--from", a.parent), ("--env", a.env), ("--cwd", a.cwd), ("--user", a.user),
                              ("--entrypoint", a.entrypoint)):
            if value:
                raise UsageError(f"dsec image build: {option} is for a directory or tarball build; with -f "
                                 "the Dockerfile says it (FROM, ENV, WORKDIR, USER, ENTRYPOINT)")
        _build_args(a.build_arg)
        return
    for option, value in (("--build-arg", a.build_arg), ("--allow", a.allow), ("--no-cache", a.no_cache)):
        if value:
            raise UsageError(f"dsec image build: {option} goes with -f DOCKERFILE (a Dockerfile build)")
    # `docker build .` habit: without -f the directory itself becomes the
    # image's root, and an image of a project's sources runs nothing.
    dockerfile = os.path.join(a.path, "Dockerfile")
    if not (a.host or getattr(a, "fleet", None)) and os.path.isfile(dockerfile):
        print(f"dsec image build: warning: {a.path} holds a Dockerfile, but without -f the directory is "
              f"imported as the image's root file system; to build from the Dockerfile: "
              f"dsec image build -f {dockerfile} {a.path} --name {a.name}", file=sys.stderr)


def _oserror_text(err: OSError) -> str:
    where = f": {err.filename}" if err.filename else ""
    return f"{err.strerror or err}{where}"


def _connection_error(err: ConnectionError) -> dict:
    detail = {}
    if isinstance(err, ConnectionLost):
        detail = {"target": err.target, "op": err.op, "sent": err.sent}
    elif isinstance(err, HostsDown):
        detail = err.detail
    return _local_error("unreachable", str(err), detail)


def _oserror_wire(a, err: OSError) -> dict:
    """A local OSError (a file of dsec's side) as the daemon codes one: the
    errno's closest code, the errno's name in detail."""
    if err.errno is None:
        return _local_error("io", _oserror_text(err))
    wire = io_error(a.cmd, str(err.filename or ""), err).to_wire()
    detail = {"errno": wire["detail"]["errno"], "path": err.filename}
    return _local_error(wire["code"], _oserror_text(err), {k: v for k, v in detail.items() if v})


def _failed_status(a, err: DsecError) -> int:
    """The exit status of a command dsec failed: for one that runs a command
    line, 127 when its program was not found and 126 when it could not be
    executed (the errors name it: detail argv0), as a shell and docker give
    them; else 125 (RUNS_A_COMMAND, GIVES_A_STATUS) or 1."""
    if a.cmd in RUNS_A_COMMAND and "argv0" in err.detail:
        if err.code == "not_found":
            return 127
        if err.code == "permission":
            return 126
    return EXIT_DSEC_ERROR if a.cmd in GIVES_A_STATUS else 1


class _EndedBySignal(BaseException):
    """SIGTERM or SIGHUP ended a command (_run): main prints the
    `interrupted` error --json promises and exits 128+signal, where the
    signal's default would have killed dsec where it stood."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: list[str] | None = None) -> None:
    """`dsec ARGV`: exits with the command's status. A ^C is said and exits
    130 whenever it comes: held (sigint.py) until the command starts, a
    KeyboardInterrupt while it runs, held again while dsec says how it
    ended."""
    found = signal.getsignal(signal.SIGINT)
    sigint.hold()          # already, if started by the console script (cliboot)
    try:
        run_command(parsed(sys.argv[1:] if argv is None else list(argv)))
    finally:
        sigint.restore(found)


def run_command(a: argparse.Namespace) -> None:
    """The command `a` (cliargs.parsed), and how it ended: exits with its status."""
    if a.cmd == "rpc":
        rpcrelay.run(a)
    fail = EXIT_DSEC_ERROR if a.cmd in GIVES_A_STATUS else 1
    try:
        with sigint.raised():    # a ^C held since the start raises here: the command does not start
            check_usage(a)
            status = asyncio.run(_run(a))
            sys.stdout.flush()   # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError as err:
        closed = _closed_outputs()
        if not closed:                   # the daemon's socket broke, not our reader
            _print_error(a, _local_error("unreachable", f"connection to dsecd lost: {err.strerror}"))
            print(f"dsec: connection to dsecd lost: {err.strerror}", file=sys.stderr)
            sys.exit(fail)
        _silence_stdout(tuple(closed))   # stdout or stderr: as a shell's command, quietly 141
        status = EXIT_BROKEN_PIPE
    except UsageError as err:
        _print_error(a, _local_error("bad_request", str(err)))
        print(err, file=sys.stderr)
        status = EXIT_DSEC_ERROR if a.cmd in GIVES_A_STATUS else EXIT_USAGE
    except DsecError as err:
        _print_error(a, err.to_wire())
        print(f"dsec {a.cmd}: {err.code}: {err.message}", file=sys.stderr)
        status = _failed_status(a, err)
    except ConnectionError as err:
        _print_error(a, _connection_error(err))
        print(f"dsec: {err}", file=sys.stderr)
        status = fail
    except (LocalCopyError, Refused, TooLarge) as err:      # a directory copy's local side
        _print_error(a, _local_error("limit" if isinstance(err, TooLarge) else "bad_request", str(err)))
        print(f"dsec {a.cmd}: {err}", file=sys.stderr)
        status = fail
    except OSError as err:
        _print_error(a, _oserror_wire(a, err))
        print(f"dsec {a.cmd}: {_oserror_text(err)}", file=sys.stderr)
        status = fail
    except ValueError as err:           # a value only the SDK could check (an ssh:// address, a path)
        _print_error(a, _local_error("bad_request", str(err)))
        print(f"dsec {a.cmd}: {err}", file=sys.stderr)
        status = fail
    except KeyboardInterrupt:
        # ^C: the command was cancelled (a copy's with its temporary file);
        # said as the other ending signals are, not left for a failure.
        _interrupted(a, signal.SIGINT, "interrupted (SIGINT)")
        if not getattr(a, "said_how_it_ended", False):     # attach: that it detached
            print(f"dsec {a.cmd}: interrupted (SIGINT)", file=sys.stderr)
        status = 130
    except _EndedBySignal as ended:
        name = signal.Signals(ended.signum).name
        _interrupted(a, ended.signum, f"interrupted ({name})")
        if not getattr(a, "said_how_it_ended", False):
            print(f"dsec {a.cmd}: interrupted ({name})", file=sys.stderr)
        status = 128 + ended.signum
    except Exception as err:            # a bug: its traceback as without --json, after the error object
        _print_error(a, _local_error("internal", f"{type(err).__name__}: {err}"))
        raise
    sys.exit(status)


if __name__ == "__main__":
    main()


