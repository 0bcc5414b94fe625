"""What `dsec` prints and how it reads KEY=VALUE words and argv values: shared by the
command line (dsecd/cli/) and its fleet commands (fleet_cli.py)."""

from __future__ import annotations

import json
import os
import shlex
import time


class UsageError(Exception):
    """The command line itself is wrong (exit 2, or 125 for RUNS_A_COMMAND)."""


def kv(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"dsec: {what} must look like KEY=VALUE, got {item!r}")
        out[k] = v
    return out


def env_vars(a) -> dict[str, str]:
    """The environment of `--env-file FILE` and `--env` words, as docker run
    reads them: the files first, then each --env over them; `K=V` sets K,
    `K` alone takes our own environment's value (and sets nothing where we
    have none). A file holds one KEY=VALUE or KEY per line, taken as it is
    (no quotes removed); blank lines and lines starting with # are skipped."""
    out: dict[str, str] = {}
    for path in getattr(a, "env_file", None) or []:
        try:
            # A value that is not UTF-8 is kept as its bytes (os.fsdecode's
            # surrogates, sent as bytes), as docker passes it on.
            with open(path, encoding="utf-8", errors="surrogateescape") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"dsec: --env-file {path}: {getattr(err, 'strerror', None) or err}") from None
        for n, line in enumerate(lines, 1):
            if line.strip() and not line.lstrip().startswith("#"):
                _set_env(out, line.lstrip(), f"--env-file {path}, line {n}")
    for item in a.env or []:
        _set_env(out, item, "--env")
    return out


def _set_env(env: dict[str, str], item: str, what: str) -> None:
    k, sep, v = item.partition("=")
    if not k or any(c.isspace() for c in k):
        raise UsageError(f"dsec: {what} must look like KEY=VALUE or KEY, got {item!r}")
    if sep:
        env[k] = v
    elif k in os.environ:
        env[k] = os.environ[k]


def create_args(a) -> dict:
    """The create's arguments of `dsec create`, `dsec run` and `dsec fleet
    create` (cliargs._create_options), but for image, key, lease and backend."""
    return dict(cpu=a.cpu, memory=a.memory, pids=a.pids, disk=a.disk, env=env_vars(a),
                labels=kv(a.label, "--label"), hostname=a.hostname, cwd=a.cwd, user=a.user, qos=a.qos,
                cpu_quota=a.cpu_quota, ttl=a.ttl, idle_ttl=a.idle_ttl, net=a.net, allow=a.allow,
                publish=a.publish, policy=a.policy)


def image_config(a) -> dict:
    """The image config `dsec image build|import` options give (those set)."""
    config = {"env": kv(a.env, "--env") or None, "cwd": a.cwd, "user": a.user,
              "entrypoint": argv_value(a.entrypoint, "--entrypoint"),
              "cmd": argv_value(a.cmd_args, "--cmd"), "labels": kv(a.label, "--label") or None,
              "exposed_ports": a.expose}
    return {k: v for k, v in config.items() if v is not None}


def argv_value(value: str | None, what: str) -> list[str] | None:
    """An image config's Entrypoint or Cmd given as one option value: a JSON
    array (exec form, `'["python3", "-m", "app"]'`) or shell words
    (`"python3 -m app"`). One value, so the option cannot swallow the
    positional arguments that follow it."""
    if value is None:
        return None
    if value.lstrip().startswith("["):
        try:
            argv = json.loads(value)
        except json.JSONDecodeError as err:
            raise UsageError(f"dsec: {what} {value!r} is not a JSON array of strings: {err}") from None
        if not isinstance(argv, list) or not all(isinstance(x, str) for x in argv):
            raise UsageError(f"dsec: {what} {value!r} must be a JSON array of strings")
        return argv
    try:
        argv = shlex.split(value)
    except ValueError as err:
        raise UsageError(f"dsec: {what} {value!r}: {err} (quote it, or give a JSON array)") from None
    if not argv:
        raise UsageError(f"dsec: {what} is empty; give a program, e.g. {what} 'python3 -m app'")
    return argv


def print_json(obj, line: bool = False) -> None:
    """`obj` as JSON on stdout, indented; with `line`, on one line, for the
    commands that print one object per sandbox, path or event
    (cliargs.JSON_LINES), whose output a reader takes line by line."""
    def default(o):
        if isinstance(o, (bytes, bytearray)):
            return o.decode("utf-8", "replace")
        raise TypeError(type(o).__name__)

    print(json.dumps(_str_keys(obj), indent=None if line else 2, sort_keys=True, default=default), flush=line)


def _str_keys(obj):
    """`obj` with every map key a str: the daemon sends a key that is not
    UTF-8 (an environment variable's name) as bytes, and json.dumps takes
    no bytes key (nor sorts one among str keys). Its bytes that are not
    UTF-8 are written as \\xNN: two names apart only in those bytes stay
    two keys."""
    if isinstance(obj, dict):
        return {k.decode("utf-8", "backslashreplace") if isinstance(k, (bytes, bytearray)) else k: _str_keys(v)
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_str_keys(v) for v in obj]
    return obj


def human_bytes(n: int) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def clock(ts: float, now: float | None = None) -> str:
    """When `ts` was, for a listing (ps, proc ls): its time of day if that
    was today, else its date too, so that yesterday's 15:23 does not read
    as today's."""
    at = time.localtime(ts)
    if time.localtime(time.time() if now is None else now)[:3] == at[:3]:
        return time.strftime("%H:%M:%S", at)
    return time.strftime("%Y-%m-%d %H:%M", at)


def table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())


def pct(v) -> str:
    return "-" if v is None else f"{v:.1f}%"


# Event fields that are sizes in bytes: a human reads them as 512.0M (what
# `ps` and `top` show); `--json` keeps the numbers.
BYTE_FIELDS = ("memory",)


def event_fields(ev: dict, shown: tuple[str, ...]) -> str:
    """An event's other fields as `key=value` words for a human: a missing
    value as "-", sizes in bytes as 512.0M, labels and other maps or lists
    as compact JSON (what `--json` gives too), not Python's repr of them,
    with their letters as they are (a label "ü", not "\\u00fc")."""
    words = []
    for k, v in ev.items():
        if k in shown:
            continue
        if v is None:
            v = "-"
        elif isinstance(v, int) and not isinstance(v, bool) and v >= 0 and (k in BYTE_FIELDS or k.endswith("_bytes")):
            v = human_bytes(v)
        elif isinstance(v, (dict, list)):
            v = json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        words.append(f"{k}={v}")
    return " ".join(words)


def job_done(r: dict) -> list:
    """The sandboxes a job verb's answer says it paused, resumed or destroyed."""
    return r.get("paused") or r.get("resumed") or r.get("destroyed") or []


async def job_verb(target, a) -> dict:
    """`job pause|resume|rm JOB` on a Client or a Fleet (the same method names)."""
    if a.job_cmd == "pause":
        return await target.job_pause(a.job)
    if a.job_cmd == "resume":
        return await target.job_resume(a.job)
    return await target.job_rm(a.job, a.force)


def image_removed(r: dict, name: str) -> str:
    """What `dsec image rm` says of its answer `r` (the image removed; `name`:
    the name given): the layers of an image sandboxes run on stay until they
    end, so a gc right after frees nothing of it."""
    removed = r.get("name") or name          # the name the daemon resolved (a pulled docker.io/...)
    users = r.get("sandboxes") or []
    if not users:
        return f"removed image name {removed} (its layers go at the next `dsec image gc`)"
    shown = ", ".join(users[:5]) + (", ..." if len(users) > 5 else "")
    return (f"removed image name {removed}; {len(users)} sandbox(es) on it run on and keep its layers "
            f"({shown}): a `dsec image gc` after they end frees them")
