"""`dsec create`, `ps`, `inspect` and `rm`: sandboxes made, listed and
removed (`rm SANDBOX:/path` removes a file in one: files.py)."""

from __future__ import annotations

import shlex
import sys

from ..client import Client
from ..clitext import UsageError, create_args
from ..clitext import clock as _clock
from ..clitext import human_bytes as _human_bytes
from ..clitext import kv as _kv
from ..clitext import print_json as _print_json
from ..clitext import table as _table
from ..errors import DsecError
from ..protocol import VM_DIED_BECAUSE
from .common import _print_item_error, _split_remote
from .files import _rm_paths


async def cmd_create(c: Client, a) -> int:
    sb = await c.create(image=a.image, lease=a.lease, key=a.key, backend=a.backend, **create_args(a))
    if a.json:
        _print_json(sb.info)
    else:
        print(sb.id)
    return 0


async def cmd_ps(c: Client, a) -> int:
    sbs = await c.list(_kv(a.label, "--label"))
    if a.json:
        _print_json(sbs)
        return 0
    rows = []
    for s in sorted(sbs, key=lambda s: s["created"]):
        lim = s["limits"]
        # Networking a restarted daemon could not re-adopt is gone: said where the sandboxes are listed.
        state = s["state"] + _death_tag(s.get("death")) + (", net lost" if (s.get("net") or {}).get("lost") else "")
        rows.append([s["id"], s["image"], state, f"{lim['cpu']:g}", _human_bytes(lim["memory"]),
                     str(s["execs_running"]), str(s.get("procs_running", 0)),
                     _clock(s["created"]),
                     # One shell word per label: a value with spaces, commas or quotes reads back whole.
                     " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(s["labels"].items()))])
    _table(rows, ["ID", "IMAGE", "STATE", "CPU", "MEMORY", "EXECS", "PROCS", "CREATED", "LABELS"])
    return 0


def _death_tag(death: dict | None) -> str:
    """What a dead sandbox died of, in a word or three for its STATE
    column ("dead, SIGKILL", a microVM's "dead, exited, SIGKILL, 1 oom
    kills"; `dsec inspect` has it whole)."""
    if not death:
        return ""
    words = [death["reason"]] if death.get("reason") in VM_DIED_BECAUSE else []
    if "signal" in death:
        words.append(death["signal"])
    elif "exit_code" in death:
        words.append(f"exit {death['exit_code']}")
    if death.get("oom_kills"):
        words.append(f"{death['oom_kills']} oom kills")
    return "".join(f", {w}" for w in words)


async def cmd_inspect(c: Client, a) -> int:
    _print_json(await c.request("inspect", sandbox=a.sandbox))
    return 0


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
