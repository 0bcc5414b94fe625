"""`dsec fleet --hosts H1,H2 COMMAND ...`: dsec's commands across hosts.

The command line is parsed as dsec's own (cli.parse_args); here it runs
through a dsecd.Fleet instead of one Client. Commands about the whole fleet
(create, ps, top, info, job, rm --all, events, call, run, image, pool, drain,
undrain) have
their own versions below; every other command names sandboxes and runs, as dsec's
own command does, against the Client of the host that holds them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time

from .client import RunStream, run_detached
from .clitext import (
    UsageError,
    clock,
    create_args,
    event_fields,
    human_bytes,
    image_config,
    image_removed,
    job_done,
    job_verb,
    kv,
    pct,
    print_json,
    table,
)
from .errors import ConnectionLost, DsecError, HostsDown, NotFound
from .fleet import Fleet, FleetHost, short_name
from .remote import SshOptions
from .topview import ordered


async def run(a, commands: dict, named, ssh: SshOptions) -> int:
    """Run command `a` across the fleet `a.fleet`. commands: dsec's own
    (verb -> coroutine(client, a)); named(a): the sandbox ids `a` names."""
    async with Fleet(a.fleet, ssh=ssh, name=f"dsec fleet {a.cmd}", connect_timeout=a.connect_timeout) as fleet:
        for host in fleet.hosts.values():
            # One command: nothing here connects again, as a long-lived Fleet would.
            host.client.lost_advice = f"run the command again once {host.name} answers"
        fleet.down_advice = "run the command again once that host answers (`dsec fleet ... info` shows it)"
        up = fleet.up_hosts()
        for st in fleet.status():
            if not st["up"]:
                print(f"dsec fleet: {short_name(st['host'])} is down: {st['reason']}", file=sys.stderr)
        if not up:
            down = {st["host"]: st["reason"] for st in fleet.status()}
            raise HostsDown("no host of the fleet answered: "
                            + "; ".join(f"{short_name(t)}: {why}" for t, why in down.items()), {"down": down})
        if a.cmd in ("call", "run"):   # dsec's own, with the call or the run's sandbox placed by the fleet
            return await commands[a.cmd](_ThroughFleet(fleet), a)
        own = FLEET_COMMANDS.get(a.cmd)
        if own is not None and (a.cmd != "rm" or a.all):
            return await own(fleet, a)
        if a.cmd in ("rm", "pause", "resume"):
            return await _each_sandbox(fleet, a, commands, named(a))
        ids = named(a)
        if not ids:
            # A command about no sandbox and no fleet-wide meaning (net sets):
            # any host answers it.
            return await commands[a.cmd](up[0].client, a)
        found = [await fleet.get(sb) for sb in ids]
        clients = {sb.client for sb in found}
        if len(clients) > 1:
            raise UsageError(f"dsec fleet {a.cmd}: the sandboxes are on different hosts "
                             f"({', '.join(short_name(sb.host) for sb in found)}); name one host's at a time")
        return await commands[a.cmd](found[0].client, a)


async def _each_sandbox(fleet: Fleet, a, commands: dict, ids: list[str]) -> int:
    """rm / pause / resume of sandboxes (or SANDBOX:/paths) on any hosts:
    dsec's own command per host, with that host's ids. A host whose command
    fails does not stop the others; the status is 1 if anything failed."""
    by_host: dict = {}
    status = 0
    for sb_id in ids:
        try:
            sb = await fleet.get(sb_id)
        except (DsecError, ConnectionError) as err:
            if a.json:              # as `dsec --json rm` prints one sandbox's failure, naming it
                wire = _error_wire(err)
                print_json({"error": {**wire, "detail": {"sandbox": sb_id, **wire["detail"]}}}, line=True)
            print(f"dsec fleet {a.cmd}: {sb_id}: {err}", file=sys.stderr)
            status = 1
            continue
        by_host.setdefault(sb.client, []).append(sb_id)
    words = list(a.sandboxes)
    for client, mine in by_host.items():
        # Each host's command gets its own copy of the arguments: the words
        # (ids, or SANDBOX:/paths) naming that host's sandboxes, in the order given.
        own = argparse.Namespace(**vars(a))
        own.sandboxes = [w for w in words if w.partition(":")[0] in mine]
        try:
            status = max(status, await commands[a.cmd](client, own))
        except (DsecError, ConnectionError) as err:
            if a.json:              # its command ended early: that host's sandboxes, some maybe done
                wire = _error_wire(err)
                print_json({"error": {**wire, "detail": {"host": client.target, "sandboxes": own.sandboxes,
                                                         **wire["detail"]}}}, line=True)
            print(f"dsec fleet {a.cmd}: {short_name(client.target)}: {err}", file=sys.stderr)
            status = 1
    return status


def _host_col(target: str) -> str:
    return short_name(target)


def _incomplete(fleet: Fleet, what: str, errors: dict) -> int:
    """The status of a command that merges every host's answer: 1 when some
    host's part is missing, a host down (said when the command started) or
    one that failed to answer (said here), so that a script, --json too,
    can tell an empty answer from a partial one."""
    for target, err in errors.items():
        print(f"dsec fleet {what}: {_host_col(target)}: {err}", file=sys.stderr)
    return 1 if errors or not all(h.up for h in fleet.hosts.values()) else 0


def _missing_rows(fleet: Fleet, errors: dict) -> list[dict]:
    """--json of a merged listing: one row per host whose part is missing,
    {"host", "error": {code, message, detail}} (`unreachable` for a host
    down, as dsec --json prints an error), after the rows: without them a
    script reading the JSON could not tell which hosts its rows leave out."""
    # A host whose connection dropped during the command is both down and
    # in `errors`: one row, its own error's.
    down = [{"host": h.target, "error": {"code": "unreachable", "message": f"down: {h.reason}", "detail": {}}}
            for h in fleet.hosts.values() if not h.up and h.target not in errors]
    return down + [{"host": target, "error": _error_wire(err)} for target, err in errors.items()]


async def fleet_ps(fleet: Fleet, a) -> int:
    errors: dict = {}
    rows = await fleet.list(kv(a.label, "--label"), errors)
    status = _incomplete(fleet, "ps", errors)
    if a.json:
        print_json(rows + _missing_rows(fleet, errors))
        return status
    out = []
    for s in sorted(rows, key=lambda s: (s["host"], s["created"])):
        lim = s["limits"]
        out.append([_host_col(s["host"]), s["id"], s["image"], s["state"], f"{lim['cpu']:g}",
                    human_bytes(lim["memory"]), str(s["execs_running"]), str(s.get("procs_running", 0)),
                    clock(s["created"]),
                    # One shell word per label, as `dsec ps` prints them.
                    " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(s["labels"].items()))])
    table(out, ["HOST", "ID", "IMAGE", "STATE", "CPU", "MEMORY", "EXECS", "PROCS", "CREATED", "LABELS"])
    return status


async def fleet_top(fleet: Fleet, a) -> int:
    top = await fleet.top(kv(a.label, "--label"))
    status = _incomplete(fleet, "top", top["errors"])
    if a.json:
        print_json({**top, "sandboxes": ordered(top, a.sort)})
        return status
    table([[_host_col(t), str(h.get("cpus", "-")), pct(h.get("cpu_pct")),
            " ".join(map(str, h.get("loadavg", []))) or "-",
            f"{human_bytes(h['mem_total'] - h['mem_available'])}/{human_bytes(h['mem_total'])}"
            if h.get("mem_total") else "-"] for t, h in sorted(top["hosts"].items())],
          ["HOST", "CPUS", "CPU%", "LOAD", "MEM"])
    print()
    rows = [[_host_col(s["host"]), s["id"], s["qos"], s["state"], f"{s['cpu']:g}", pct(s["cpu_pct"]),
             pct(s["throttled_pct"]), "-" if s["memory"] is None else human_bytes(s["memory"]),
             human_bytes(s["memory_limit"]), "-" if s.get("swap") is None else human_bytes(s["swap"])]
            for s in ordered(top, a.sort)]
    # SWAP last: scripts read these columns by position.
    table(rows, ["HOST", "ID", "QOS", "STATE", "CPU", "CPU%", "THROTTLED", "MEM", "MEM LIMIT", "SWAP"])
    return status


async def fleet_info(fleet: Fleet, a) -> int:
    """Every host's row; a host down, or failing to answer, is a row saying
    why, and (as for ps) the status 1: the answer is partial."""
    infos = await fleet.info()
    status = 0 if all(i.get("up") for i in infos.values()) else 1
    if a.json:
        print_json({"hosts": infos, "status": fleet.status()})
        return status
    rows = []
    for target, i in infos.items():
        if not i.get("up"):
            rows.append([_host_col(target), "down", "-", "-", "-", "-", "-", i.get("reason", "")])
            continue
        adm = i.get("cpu", {}).get("admission", {})
        cpu, mem = adm.get("cpu", {}), adm.get("memory", {})
        rows.append([_host_col(target), "up", i["version"],
                     ", ".join(f"{k} {v}" for k, v in sorted(i["sandboxes"].items())) or "none",
                     adm.get("state", "-"),
                     f"{cpu.get('requested', 0):g}/{cpu['capacity']:g}" if cpu.get("capacity") else "-",
                     f"{human_bytes(mem.get('requested', 0))}/{human_bytes(mem['capacity'])}"
                     if mem.get("capacity") else "-", i["kernel"]])
    table(rows, ["HOST", "STATE", "VERSION", "SANDBOXES", "ADMISSION", "CPU REQ/CAP", "MEM REQ/CAP", "KERNEL"])
    return status


async def fleet_create(fleet: Fleet, a) -> int:
    sb = await fleet.create(image=a.image, key=a.key, lease=a.lease, backend=a.backend, **create_args(a))
    if a.json:
        print_json({**sb.info, "host": sb.host})
    else:
        print(sb.id)
    return 0


async def fleet_job(fleet: Fleet, a) -> int:
    r = await job_verb(fleet, a)
    if a.json:
        print_json(r)
    else:
        done = job_done(r)
        hosts = sum(1 for v in r["hosts"].values() if v == "ok")
        print(f"job {a.job}: {a.job_cmd} {len(done)} sandbox(es) on {hosts} host(s)")
        for sb_id, why in r["failed"].items():
            print(f"dsec fleet job {a.job_cmd}: {sb_id}: {why}", file=sys.stderr)
        for target, outcome in r["hosts"].items():
            if outcome.startswith("failed"):
                print(f"dsec fleet job {a.job_cmd}: {_host_col(target)}: {outcome}", file=sys.stderr)
    bad = r["failed"] or any(v.startswith("failed") for v in r["hosts"].values()) or r["down"]
    return 1 if bad else 0


async def fleet_rm_all(fleet: Fleet, a) -> int:
    r = await fleet.destroy_all(force=a.force, labels=kv(a.label, "--label"))
    # A host that failed to answer removed nothing that it said: as a job
    # verb's, its outcome fails the status, and stderr names it.
    failed_hosts = {t: outcome for t, outcome in r["hosts"].items() if outcome.startswith("failed")}
    if a.json:
        print_json(r)
    else:
        print(f"removed {len(r['destroyed'])} sandbox(es) on {len(r['hosts']) - len(failed_hosts)} host(s)")
        for sb_id, err in r["failed"].items():
            print(f"dsec fleet: rm {sb_id}: {err}", file=sys.stderr)
    for target, outcome in failed_hosts.items():
        print(f"dsec fleet rm --all: {_host_col(target)}: {outcome}", file=sys.stderr)
    return 1 if r["failed"] or r["down"] or failed_hosts else 0


async def fleet_events(fleet: Fleet, a) -> int:
    """Every up host's events, merged as they come; each names its host. A
    host whose stream fails (its daemon or connection gone) is said, on
    stderr and with --json as one more line, its error naming the host;
    the others' go on, and the status is 1. With a sandbox named, the
    hosts that do not hold it answer not_found: that is said only when
    every host does."""
    queue: asyncio.Queue = asyncio.Queue()
    named = a.sandbox or getattr(a, "sandbox_id", None)
    missing: list[NotFound] = []

    async def pump(host: FleetHost) -> None:
        try:
            async for ev in host.client.events(named, a.replay, a.follow):
                queue.put_nowait({**ev, "host": host.target})
        except (DsecError, ConnectionError) as err:
            queue.put_nowait((host.target, err))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.get_running_loop().create_task(pump(h)) for h in fleet.up_hosts()]
    left = len(tasks)
    status = 0
    try:
        while left:
            ev = await queue.get()
            if ev is None:
                left -= 1
                continue
            if isinstance(ev, tuple):              # (host, the error its stream ended on)
                target, err = ev
                if named and isinstance(err, NotFound):
                    missing.append(err)             # not there: another host holds it
                    continue
                status = 1
                if a.json:
                    print(json.dumps({"error": _error_wire(err), "host": target}, sort_keys=True), flush=True)
                print(f"dsec fleet events: {_host_col(target)}: {err}", file=sys.stderr)
                continue
            if a.json:
                print(json.dumps(ev, sort_keys=True), flush=True)
            else:
                extra = event_fields(ev, ("seq", "time", "event", "sandbox", "host"))
                print(f"{time.strftime('%H:%M:%S', time.localtime(ev['time']))} {_host_col(ev['host']):<10} "
                      f"{ev['event']:<9} {ev['sandbox']} {extra}".rstrip(), flush=True)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if missing and len(missing) == len(tasks):
        raise missing[0]                            # no host holds it
    return status


def _error_wire(err: BaseException) -> dict:
    """An error as dsec's --json prints it: the daemon's, or `unreachable`
    (a connection that failed or went silent)."""
    if isinstance(err, DsecError):
        return err.to_wire()
    detail = {"target": err.target, "op": err.op, "sent": err.sent} if isinstance(err, ConnectionLost) else {}
    return {"code": "unreachable", "message": str(err), "detail": detail}


class _ThroughFleet:
    """What cli/execs.py's cmd_call and cmd_run need of a client, placed by the
    fleet: call() on the least loaded host holding the image; run_stream()
    and run_detached() whose sandbox fleet.create makes (placed as `dsec
    fleet create`'s), its command, lease and removal then going straight to
    that sandbox's host."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.call = fleet.call

    def run_stream(self, image: str, args: list[str] | None = None, entrypoint=None, timeout: float | None = None,
                   stdin=None, remove: bool = True, **create_args) -> RunStream:
        return RunStream(self, image, args, entrypoint, timeout, stdin, remove, create_args)

    async def run_detached(self, image: str, args: list[str] | None = None, entrypoint=None, **create_args):
        return await run_detached(self, image, args, entrypoint, **create_args)

    async def inspect_image(self, name: str) -> dict:
        """The image as an up host that lists it has it (placement prefers
        those): its config says what the run starts, before anything is made."""
        up = self.fleet.up_hosts()
        host = next((h for h in up if h.has_image(name)), up[0])
        try:
            return await host.client.inspect_image(name)
        except NotFound as err:
            if any(h.has_image(name) is not False for h in up):
                raise                   # a host listing it, or one not listed yet, answered for itself
            # One host's answer (and its `dsec image ls` advice) would name
            # neither that host nor the others, which lack it as well.
            hosts = {h.target: "no such image" for h in up} | self.fleet._down()
            raise NotFound(f"no host of the fleet has an image named {name!r} "
                           f"({', '.join(short_name(t) for t in hosts)}; see `dsec fleet --hosts ... image ls`; "
                           f"`dsec fleet --hosts ... image pull {name}` fetches it on each host)",
                           {"image": name, "hosts": hosts}) from err

    async def create(self, image: str, **create_args):
        return await self.fleet.create(image, **create_args)


async def _on_every_host(fleet: Fleet, a, what: str, fn, summary=None) -> int:
    """fn(client) on every up host; one line (or JSON object) per host, its
    text summary(result) (default _summary). A host that is down did not
    run it: its error in the JSON, status 1."""
    found = await fleet.each_host(fn)
    status = 1 if not all(h.up for h in fleet.hosts.values()) else 0
    if a.json:
        down = {h.target: {"error": f"down: {h.reason}"} for h in fleet.hosts.values() if not h.up}
        print_json({**down, **{t: {"error": str(r)} if isinstance(r, BaseException) else r
                               for t, r in found.items()}})
    for target, r in found.items():
        if isinstance(r, BaseException):
            print(f"dsec fleet {what}: {_host_col(target)}: {r}", file=sys.stderr)
            status = 1
        elif not a.json:
            print(f"{_host_col(target)}: {(summary or _summary)(r)}")
    return status


def _summary(r) -> str:
    if isinstance(r, dict):
        if "name" in r and "layers" in r:
            return f"{r['name']}: {len(r['layers'])} layer(s), {human_bytes(r.get('bytes', 0))}"
        if "removed" in r:
            return f"removed {len(r['removed'])} blob(s), freed {human_bytes(r.get('freed_bytes', 0))}"
        if "blobs" in r:
            return f"{r['blobs']} blobs, {human_bytes(r['bytes'])}"
    return str(r)


async def fleet_image(fleet: Fleet, a) -> int:
    if a.image_cmd == "ls":
        errors: dict = {}
        images = await fleet.list_images(errors)
        status = _incomplete(fleet, "image ls", errors)
        if a.json:
            print_json(images + _missing_rows(fleet, errors))
        else:
            table([[_host_col(i["host"]), i["name"], str(len(i["layers"])), human_bytes(i["bytes"]),
                    i["manifest"][7:19]] for i in sorted(images, key=lambda i: (i["name"], i["host"]))],
                  ["HOST", "NAME", "LAYERS", "SIZE", "MANIFEST"])
        return status
    if a.image_cmd in ("build", "import"):
        if not a.path.startswith("/"):
            raise UsageError(f"dsec fleet image {a.image_cmd}: give an absolute path: each host reads "
                             f"{a.path!r} from its own disk")
        if getattr(a, "file", None):
            raise UsageError("dsec fleet image build: --file (a Dockerfile build) runs on one host: "
                             "dsec --host HOST image build -f ...")
        config = image_config(a)
        return await _on_every_host(fleet, a, "image build", lambda c: c.build_image(
            a.path, a.name, getattr(a, "parent", None), None, **config))
    if a.image_cmd == "inspect":
        return await _on_every_host(fleet, a, "image inspect", lambda c: c.inspect_image(a.name))
    if a.image_cmd == "rm":
        # As `dsec image rm` says it: the answer is the image removed, which
        # _summary would print as a build's.
        return await _on_every_host(fleet, a, "image rm", lambda c: c.remove_image(a.name),
                                    lambda r: image_removed(r, a.name))
    if a.image_cmd == "tag":
        # Every host's store: on one shared store the hosts name the same image, once each.
        return await _on_every_host(fleet, a, "image tag", lambda c: c.tag_image(a.source, a.name))
    if a.image_cmd == "gc":
        return await _on_every_host(fleet, a, "image gc", lambda c: c.image_gc())
    if a.image_cmd == "pull":
        # Each host pulls from the registry itself (no progress view: the
        # hosts' would interleave); one line per host once it has it.
        return await _on_every_host(fleet, a, "image pull", lambda c: c.pull_image(a.ref, None, a.platform),
                                    lambda r: f"{'up to date' if r.get('pull', {}).get('up_to_date') else 'pulled'} "
                                              f"{_summary({**r, 'bytes': r.get('bytes', 0)})}")
    if a.image_cmd == "du":
        return await _on_every_host(fleet, a, "image du", lambda c: c.image_du())
    raise UsageError(f"dsec fleet image {a.image_cmd}: not run across a fleet; run it on each host "
                     "(dsec --host HOST image ...)")


async def fleet_pool(fleet: Fleet, a) -> int:
    if a.pool_cmd == "set":
        # As `dsec pool set` says it: a pool set to min 0 max 0 is removed
        # (its answer's `removed`), which _summary would take for an image gc's.
        return await _on_every_host(fleet, a, "pool set",
                                    lambda c: c.pool_set(a.image, a.min, a.max, cpu=a.cpu, memory=a.memory),
                                    lambda p: f"pool {p['name']}: min {p['min']} max {p['max']}"
                                              + (" (removed)" if p.get("removed") else ""))
    found = await fleet.each_host(lambda c: c.pool_list())
    pools = [{**p, "host": t} for t, ps in found.items() if not isinstance(ps, BaseException) for p in ps]
    errors = {t: r for t, r in found.items() if isinstance(r, BaseException)}
    status = _incomplete(fleet, "pool ls", errors)
    if a.json:
        print_json(pools + _missing_rows(fleet, errors))
        return status
    table([[_host_col(p["host"]), p["name"], str(p["min"]), str(p["max"]), str(p["ready"]), str(p["taken"]),
            p["error"] or ""] for p in pools], ["HOST", "POOL", "MIN", "MAX", "READY", "TAKEN", "ERROR"])
    return status


async def fleet_drain(fleet: Fleet, a) -> int:
    """drain / undrain every host named: a host left out (down) is said, and
    the status is 1, as the operator takes the whole fleet for drained."""
    if a.cmd == "drain":
        return await _on_every_host(fleet, a, "drain", lambda c: c.drain(a.reason or ""),
                                    lambda r: "drained" + (f" ({r['reason']})" if r.get("reason") else ""))
    return await _on_every_host(fleet, a, "undrain", lambda c: c.undrain(), lambda r: "undrained")


FLEET_COMMANDS = {"ps": fleet_ps, "top": fleet_top, "info": fleet_info, "create": fleet_create,
                  "job": fleet_job, "rm": fleet_rm_all, "events": fleet_events,
                  "image": fleet_image, "pool": fleet_pool, "drain": fleet_drain, "undrain": fleet_drain}
