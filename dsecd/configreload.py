"""Config reload: SIGHUP (`systemctl reload dsecd`) reads the config again.

The file read is the one a start would read (--config, else
/etc/dsecd/dsecd.toml if it exists, over the embedded defaults, with the
command line's --socket, --state-dir and --log-level on top), checked as
`dsecd --check-config` checks it (daemon.build_config). A config that
fails the check is refused whole: one error line says why, and every
setting stays as it runs. Of a valid one, the settings in RELOADABLE are
applied at once; every other change is logged, one warning per setting,
as taking effect at the next start, and the daemon goes on with the value
it runs with. A later reload compares the file with what runs, so a change
still waiting for a restart is said again.

A setting is in RELOADABLE only when its new value is right as soon as it
is set: read afresh at each use (a create's admission, a call's choice of
call sandbox), with nothing built from the old one. limits.max_sandboxes,
for one, sizes the BPF maps of networking and of the denial monitor when
they load: it is not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from . import logs
from .config import FREE_FORM, ConfigError, keys_of

log = logging.getLogger("dsecd")


def _log_level(node, value) -> None:
    logs.set_level(value)


def _max_active_creates(node, value) -> None:
    node.create_service.admission.set_max_active(int(value))


def _max_queued_creates(node, value) -> None:
    node.create_service.admission.max_queued = int(value)


def _full_retry_after(node, value) -> None:
    """Read from the running config's [admission] at each refusal."""


def _stop_timeout(node, value) -> None:
    """Read from the running config's [daemon] as the stop begins."""


def _fncall_max_boxes(node, value) -> None:
    node.call_service.fn_cfg["max_boxes"] = int(value)


def _fncall_idle_ttl(node, value) -> None:
    node.call_service.set_idle_ttl(float(value))


async def _pager_cache_max(node, value) -> None:
    await node.workers.run(node.image_service.set_cache_max, value)


# The settings a reload applies: dotted key -> what makes the running daemon
# use the new value (after which the running config holds it too); a
# coroutine function where that blocks, run in a worker.
RELOADABLE: dict[str, Callable] = {
    "daemon.log_level": _log_level,
    "daemon.stop_timeout_s": _stop_timeout,
    "admission.max_active_creates": _max_active_creates,
    "admission.max_queued_creates": _max_queued_creates,
    "admission.full_retry_after_s": _full_retry_after,
    "fncall.max_boxes": _fncall_max_boxes,
    "fncall.idle_ttl_s": _fncall_idle_ttl,
    "pager.cache_max_bytes": _pager_cache_max,
}


def settings(raw: dict, where: str = "") -> dict:
    """A config's settings by dotted name; a table of user-named entries
    (FREE_FORM: rule sets, task policies, mirrors) gives one per entry."""
    out = {}
    for key, value in raw.items():
        name = f"{where}{key}"
        if isinstance(value, dict) and name not in FREE_FORM:
            out.update(settings(value, name + "."))
        elif isinstance(value, dict):
            out.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            out[name] = value
    return out


def changes(running: dict, read: dict) -> list[tuple[str, object, object]]:
    """(key, running value, value read) of each setting that differs; None
    for an entry of a free-form table one side has not."""
    old, new = settings(running), settings(read)
    return [(k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


# The log level, applied around the reload's own lines so that the more
# verbose of the two levels decides which of them show: raised (info to
# warning), once they are logged, or it would hide those after it; lowered
# (warning to info), before the first, or the old level would hide them all.
LEVEL_KEY = "daemon.log_level"


def lowers_the_level(old, new) -> bool:
    """Whether log level `new` shows more than `old` does (debug < info < ...)."""
    return logging.getLevelName(str(new).upper()) < logging.getLevelName(str(old).upper())


def shown(value) -> str:
    return "(none)" if value is None else json.dumps(value)


class Reloader:
    """Reloads of the config of a daemon started with `args`, whose node is
    `node`, one at a time. `state()` is what `info` shows of them. The
    daemon's own functions: `build` reads and checks the config as a start
    and --check-config do (build_config), `path_of` names the file they read
    (config_path), `key_named` the key an error is about (config_key_named)."""

    def __init__(self, args, node, build: Callable, path_of: Callable, key_named: Callable):
        self.args = args
        self.node = node
        self.build = build
        self.path_of = path_of
        self.key_named = key_named
        self.loaded_at = time.time()
        self.last: dict | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.closed = False

    def request(self) -> None:
        """SIGHUP: a reload, after any under way; none once the daemon stops."""
        if self.closed:
            log.info("SIGHUP while stopping: the config is not read again",
                     extra={"fields": {"event": "sighup"}})
            return
        task = asyncio.get_running_loop().create_task(self.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def state(self) -> dict:
        return {"config_loaded_at": round(self.loaded_at, 3), "last_reload": self.last}

    async def close(self, timeout: float) -> None:
        """The daemon stops: no reload from now on, and the one under way
        ends first. A reload applies settings to the services the stop
        closes: run alongside, it would start an idle sweep again after the
        call service closed, or ask a worker pool shut down meanwhile.
        Waited for `timeout` s at most (a read of the config file on a hung
        file system, a setting applied through a worker that does not
        return): then cancelled where it is, so that it applies nothing
        more, and the stop goes on."""
        self.closed = True
        tasks = set(self._tasks)        # one asked for after the one under way reads nothing once it runs
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=timeout)
        if pending:
            log.warning("stopping: a config reload still under way after %.1f s; cancelled, what it had not "
                        "applied yet is not applied", timeout, extra={"fields": {"event": "reload_cut_short"}})
            for task in pending:
                task.cancel()

    async def reload(self) -> dict | None:
        """The reload's result (info's last_reload); None once the daemon
        stops (close()), when nothing is read."""
        async with self._lock:
            if self.closed:
                return None
            try:
                result = await self._reload()
            except Exception as err:        # a bug: the running settings stay, said
                log.error("config reload failed: %s; the running settings stay", err, exc_info=True,
                          extra={"fields": {"event": "reload_refused"}})
                result = self._result(False, None, f"internal error: {type(err).__name__}: {err}", None)
            self.last = result
            return result

    def _result(self, ok: bool, path: str | None, error: str | None, key: str | None,
                applied: list[str] | None = None, restart: list[str] | None = None) -> dict:
        return {"at": round(time.time(), 3), "ok": ok, "config": path, "error": error, "key": key,
                "applied": applied or [], "restart_needed": restart or []}

    async def _reload(self) -> dict:
        path = self.path_of(self.args.config)
        try:
            cfg = await self.node.workers.run(self.build, self.args)
        except ConfigError as err:
            error = str(err)
        else:
            return await self._apply(cfg, path)
        key = await self.node.workers.run(lambda: self.key_named(error, keys_of(path)))
        log.error("config reload refused: %s: %s; the running settings stay", path or "(embedded defaults)", error,
                  extra={"fields": {"event": "reload_refused", "config": path, "key": key}})
        return self._result(False, path, error, key)

    async def _apply(self, cfg, path: str | None) -> dict:
        """A checked config's changes: applied where RELOADABLE says how, else said to wait."""
        running = self.node.cfg.raw
        applied, restart, last = [], [], []
        found = changes(running, cfg.raw)
        for key, old, new in found:
            if key == LEVEL_KEY and lowers_the_level(old, new):
                RELOADABLE[key](self.node, new)
        for key, old, new in found:
            if key not in RELOADABLE:
                restart.append(key)
                log.warning("%s changed: takes effect at the next start; still %s", key, shown(old),
                            extra={"fields": {"event": "setting_needs_restart", "key": key}})
                continue
            if key == LEVEL_KEY:
                if lowers_the_level(old, new):
                    _set(running, key, new)         # applied above, before the first line
                else:
                    last.append((key, new))
            else:
                try:
                    done = RELOADABLE[key](self.node, new)
                    if asyncio.iscoroutine(done):
                        await done
                except OSError as err:
                    # Not taken (the pager's cap): the next start takes it,
                    # and the next reload tries again.
                    restart.append(key)
                    log.warning("%s changed: applying it failed (%s); takes effect at the next start; still %s",
                                key, err, shown(old),
                                extra={"fields": {"event": "setting_needs_restart", "key": key}})
                    continue
                _set(running, key, new)
            applied.append(key)
            log.info("%s changed: now %s (was %s)", key, shown(new), shown(old),
                     extra={"fields": {"event": "setting_changed", "key": key}})
        self.loaded_at = time.time()
        log.info("config reloaded from %s: %d settings applied, %d take effect at the next start",
                 path or "(embedded defaults)", len(applied), len(restart),
                 extra={"fields": {"event": "reloaded", "config": path, "applied": applied,
                                   "restart_needed": restart}})
        for key, new in last:
            RELOADABLE[key](self.node, new)
            _set(running, key, new)
        return self._result(True, path, None, None, applied, restart)


def _set(running: dict, key: str, value) -> None:
    """The running config's `key` (section.name) set to `value`."""
    section, _, name = key.partition(".")
    running[section][name] = value
