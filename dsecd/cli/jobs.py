"""`dsec pause`, `resume`, `renew`, `job` and `pool`: sandboxes' memory
(frozen and swapped out, or back), their leases, jobs and warm pools."""

from __future__ import annotations

import sys

from ..client import Client
from ..clitext import human_bytes as _human_bytes
from ..clitext import job_done, job_verb
from ..clitext import print_json as _print_json
from ..clitext import table as _table
from ..errors import DsecError
from .common import _print_item_error


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
