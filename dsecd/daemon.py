"""`dsecd`: the daemon's entry point.

Start-up order: config (--config, else /etc/dsecd/dsecd.toml if it exists,
over the embedded defaults) -> logging (dsecd/logs.py) -> single-instance
locks on the state dir and on sandbox.cgroup_root -> feature probe (stop
on a missing required feature) -> node (re-adopt sandboxes) -> socket ->
metrics endpoint (if metrics.listen) -> READY=1 to systemd
(dsecd/sdnotify.py; nothing without $NOTIFY_SOCKET). From then on a loop
monitor (dsecd/looplag.py) measures the event loop's lag and sends systemd
WATCHDOG=1 and STATUS=. SIGTERM/SIGINT stop the daemon and leave every
sandbox running; the next daemon re-adopts them from the journal. SIGHUP
reloads the config (dsecd/configreload.py): what can change in a running
daemon changes, the rest is said to take a restart.

A start that fails says why in one log line (level critical) and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import fcntl
import gc
import logging
import os
import re
import signal
import sys
from pathlib import Path

from . import __version__, cgroup, fds, logs, pinned, profiling
from .config import DEFAULT_PATH, ConfigError, keys_of, load_config
from .configreload import Reloader
from .engine.procs import QUIESCE_S
from .features import probe_all
from .looplag import LoopMonitor
from .metrics import MetricsServer, parse_listen
from .node import RUNNING_MARK, Node
from .sdnotify import Notifier
from .server import Server
from .stopclock import LEFT_WORK_STATUS, StopClock, end_what_is_left, exit_now

log = logging.getLogger("dsecd")

# How long a stop waits for a config reload under way before it cancels
# it: the stop needs nothing from it, and a reload held by a hung file
# system must not eat the requests' share of daemon.stop_timeout_s.
RELOAD_STOP_S = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsecd", description="dsecd: the per-host sandbox daemon")
    p.add_argument("--config", help="TOML file overlaid on the embedded defaults (dsecd/default.toml); "
                   f"default: {DEFAULT_PATH} if it exists")
    p.add_argument("--socket", help="unix socket path (daemon.socket)")
    p.add_argument("--state-dir", help="journal, sandbox and image directory (daemon.state_dir)")
    p.add_argument("--log-level", help="debug, info, warning or error (daemon.log_level)")
    p.add_argument("--print-config", action="store_true", help="print the effective config as JSON and exit")
    p.add_argument("--check-config", nargs="?", const="", default=None, metavar="FILE",
                   help="check the config (FILE, else --config, else the default file) as a start does and "
                   "exit: 0 if a start takes it, 1 saying what is wrong and naming the key; starts nothing, "
                   "touches no state (what only the host can refuse, such as a kernel feature, is left to "
                   "the start)")
    p.add_argument("--json", action="store_true", help="with --check-config: the verdict as one JSON object")
    p.add_argument("--version", action="version", version=f"dsecd {__version__}")
    args = p.parse_args(argv)
    if args.json and args.check_config is None:
        p.error("--json goes with --check-config")
    return args


def config_path(given: str | None) -> str | None:
    """The file to overlay: --config (which must exist), else DEFAULT_PATH if
    it exists (a host configured by the operator), else None (the defaults)."""
    if given is not None:
        return given
    return DEFAULT_PATH if os.path.exists(DEFAULT_PATH) else None


def build_config(args: argparse.Namespace):
    # Paths on the command line are taken from where dsecd is started.
    daemon = {k: v for k, v in (("socket", args.socket and os.path.abspath(args.socket)),
                                ("state_dir", args.state_dir and os.path.abspath(args.state_dir)),
                                ("log_level", args.log_level)) if v}
    cfg = load_config(config_path(args.config), {"daemon": daemon} if daemon else None)
    # Bound only once the sandboxes are re-adopted: a bad address must stop
    # the start before that work, not after it.
    if cfg.section("metrics")["listen"]:
        try:
            parse_listen(cfg.section("metrics")["listen"])
        except ValueError as err:
            raise ConfigError(str(err)) from err
    check_services(cfg)
    return cfg


def check_services(cfg) -> None:
    """ConfigError for a setting a service would refuse as it is built (in
    Node, after the state dir and cgroup root are locked), checked here as
    that service checks it, without building it: so that a bad one stops
    the start before anything is touched, and `--check-config` finds it.
    What only the host can say (kernel features, the image store's
    directory, cgroup controllers) is left to the start."""
    from . import seccomp, userns
    from .config import parse_duration
    from .cpu import qos
    from .engine.builds import BuildLimits
    from .engine.images import check_pager_config
    from .engine.network import _check_config as check_net
    from .engine.vmballoon import settings_from
    from .errors import BadRequest
    from .fs import upper as upperfs
    from .fs.registry import RegistryConfig
    from .mem import damon, pause, swapfile, zram

    check_net(cfg.section("net"), int(cfg.section("limits")["max_sandboxes"]))
    sb = cfg.section("sandbox")
    try:
        qos.check_config(cfg.section("cpu"))
        if sb["userns"]:
            userns.RangeAllocator(int(sb["userns_base"]), int(sb["userns_size"]))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        parse_duration(sb["default_ttl"] or None, "sandbox.default_ttl")
    except BadRequest as err:
        raise ConfigError(err.message) from None
    BuildLimits.from_config(cfg)
    settings_from(cfg)
    mem = cfg.section("memory")
    try:
        pause.PauseConfig.from_section(mem)
        zram.ZramConfig.from_section(mem["zram"])
        swapfile.SwapfileConfig.from_section(mem["swapfile"], cfg.state_dir)
        damon.DamonConfig.from_section(mem["damon"], cfg.state_dir)
        RegistryConfig.from_section(cfg.section("images"))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    exec_via = sb["exec_via"]
    if exec_via not in ("init", "helper"):
        raise ConfigError(f"sandbox.exec_via must be init or helper, got {exec_via!r}")
    if sb["writable_layer"] not in upperfs.MODES:      # whether this kernel can give "tmpfs": the start's
        raise ConfigError(f"sandbox.writable_layer must be one of {', '.join(upperfs.MODES)}, "
                          f"got {sb['writable_layer']!r}")
    if sb["seccomp"]:
        try:
            seccomp.profile_number(sb["seccomp"])
        except ValueError as err:
            raise ConfigError(f"sandbox.seccomp: {err}") from None
    # "auto" is a tmpfs wherever the kernel can give one, so its cap is
    # checked too: on such a host the start would refuse it.
    if sb["writable_layer"] in ("tmpfs", "auto"):
        try:
            upperfs.check_default_cap(cfg.size("sandbox", "disk"), sb["disk_inodes"])
        except upperfs.UpperError as err:
            raise ConfigError(str(err)) from None
    # "auto" pages layers in lazily wherever the store is on a network or
    # FUSE file system: where it is not, the pager's settings go unused.
    if cfg.section("images")["mode"] in ("lazy", "auto"):
        check_pager_config(cfg)


def config_key_named(message: str, raw: dict) -> str | None:
    """The config key a ConfigError's message is about: the one it quotes
    as `config key 'x.y'`, else the first dotted name in it that is a key
    (or table) of the config; None if it names none."""
    m = re.search(r"config key '([^']+)'", message)
    if m:
        return m.group(1)
    for name in re.findall(r"\b[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)+", message):
        table = raw
        for part in name.split("."):
            if not isinstance(table, dict) or part not in table:
                break
            table = table[part]
        else:
            return name
    return None


def check_config(args: argparse.Namespace) -> int:
    """`dsecd --check-config [FILE]`: load and check the config as a start
    does (build_config), print the verdict, and return the exit status: 0
    when a start would take the config, 1 when it would stop, saying why
    and naming the key. Nothing else runs: no lock, no log, no state dir."""
    import json

    if args.check_config:
        if args.config is not None and os.path.abspath(args.config) != os.path.abspath(args.check_config):
            print(f"dsecd: --check-config {args.check_config} and --config {args.config} name two files; "
                  "give one", file=sys.stderr)
            return 2
        args.config = args.check_config
    path = config_path(args.config)
    try:
        build_config(args)
    except ConfigError as err:
        key = config_key_named(str(err), keys_of(path))
        if args.json:
            print(json.dumps({"ok": False, "config": path, "error": str(err), "key": key}))
        else:
            print(f"dsecd: config {path or '(embedded defaults)'}: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": True, "config": path, "error": None, "key": None}))
    else:
        print(f"dsecd: config {path or '(embedded defaults: ' + DEFAULT_PATH + ' does not exist)'} is valid")
    return 0


def lock_cgroup_root(root: str, mount: Path | None = None) -> list[int]:
    """One daemon per sandbox.cgroup_root, and no two whose roots nest
    (dsecd-x and dsecd-x/sub): at start a daemon destroys every group below
    its root that its own journal does not name, which would be another
    daemon's sandboxes. Flocks in one hierarchy (the same one for every
    daemon of the host; `mount`, else the first one), held for life: an
    exclusive one on the root's directory, a shared one on each directory
    above it, taken top down before the next is made. Returns their fds."""
    if mount is None:
        layout = cgroup.detect_layout()
        mounts = [layout.v2] if layout.v2 else sorted(layout.hierarchies().values())
        if not mounts:
            return []           # no cgroup file system: the feature probe stops the start, saying so
        mount = mounts[0]
    parts = Path(root).parts
    held: list[int] = []
    try:
        for depth in range(1, len(parts) + 1):
            name = "/".join(parts[:depth])
            path = mount / name
            try:
                os.makedirs(path, exist_ok=True)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as err:
                raise SystemExit(f"dsecd: cannot use sandbox.cgroup_root {root!r}: {err.strerror} "
                                 f"({path})") from None
            held.append(fd)
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if depth == len(parts) else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SystemExit(_cgroup_root_taken(mount, root, name)) from None
    except BaseException:
        for fd in held:
            os.close(fd)
        raise
    return held


def _cgroup_root_taken(mount: Path, root: str, name: str) -> str:
    """What a daemon whose lock on `name` (its root, or a directory above
    it) is refused says: which other daemon's root is in the way."""
    shown = f"sandbox.cgroup_root {root!r} ({mount / root})"
    fix = "; stop it, or give this one a cgroup_root that neither holds nor is held by another daemon's"
    if name != root:
        return (f"dsecd: another daemon uses sandbox.cgroup_root {name!r} ({mount / name}), which holds this "
                f"one's {shown}: each would take the other's sandboxes for leftovers at its start{fix}")
    below = _locked_below(mount / root)
    if below is not None:
        other = str(below.relative_to(mount))
        return (f"dsecd: another daemon uses sandbox.cgroup_root {other!r} ({below}), below this one's "
                f"{shown}: each would take the other's sandboxes for leftovers at its start{fix}")
    return (f"dsecd: another daemon uses {shown}, and would lose its sandboxes to this one's start; stop it, "
            "or give this one a cgroup_root of its own")


def _locked_below(top: Path) -> Path | None:
    """The first directory below `top` another daemon holds as its root (an
    exclusive flock); its own groups are not looked into."""
    for dirpath, dirnames, _ in os.walk(top):
        for d in list(dirnames):
            try:
                fd = os.open(os.path.join(dirpath, d), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                dirnames.remove(d)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return Path(dirpath) / d
            finally:
                os.close(fd)
    return None


def raise_fd_limit() -> None:
    """Every connection, sandbox (pidfd, root fd) and exec (pipes) holds fds."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def lock_state_dir(state_dir: str) -> int:
    """One daemon per state dir: a second one would fight over the same sandboxes."""
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(state_dir, "dsecd.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise SystemExit(f"dsecd: cannot use state dir {state_dir}: {err.strerror} ({err.filename}); "
                         "daemon.state_dir must name a writable directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = f" (pid {int(os.pread(fd, 32, 0))})"      # what the holder wrote below
        except ValueError:
            holder = ""
        os.close(fd)
        raise SystemExit(f"dsecd: another daemon{holder} uses state dir {state_dir}; stop it, or give this "
                         "one a daemon.state_dir (--state-dir) and daemon.socket of its own") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


async def serve(cfg, args: argparse.Namespace, locks: list[int]) -> int:
    """The daemon from its start to its stop, and the exit status its stop
    calls for; `locks`: the fds of its flocks (state dir, cgroup root),
    held for its life (given up early only by a stop that exits with
    threads stuck: stopclock.exit_now)."""
    notifier = Notifier()
    # From the first step: a start can take minutes (re-adoption), and a
    # signal's default meanwhile would end the daemon without a clean stop
    # (SIGTERM: the next start takes it for a death) or without a word
    # (SIGHUP, which systemd takes for a clean exit). A SIGTERM during the
    # start stops the daemon as soon as it is up; a SIGHUP reloads the
    # config once it is up (the start read the file before the signal).
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    up: list[Reloader] = []     # the node's, once the daemon is ready
    early: list[int] = []       # a SIGHUP before that

    def sighup() -> None:
        if up:
            up[0].request()
        elif not early:
            log.info("SIGHUP during the start: the config is read again once the daemon is ready",
                     extra={"fields": {"event": "sighup"}})
            early.append(signal.SIGHUP)

    loop.add_signal_handler(signal.SIGHUP, sighup)
    feats = probe_all(cfg.section("sandbox")["cgroup_root"], str(cfg.state_dir), cfg.section("microvm"))
    missing = feats.missing_required()
    if missing:
        details = "; ".join(f"{m}: {feats.items[m].detail}" for m in missing)
        raise SystemExit(f"dsecd: required kernel features missing: {details}")
    try:
        node = Node(cfg, feats, cgroup.detect_layout())
    except ConfigError as err:      # a setting this host cannot honour (e.g. sandbox.writable_layer)
        raise SystemExit(f"dsecd: {err}") from err
    node.reloader = Reloader(args, node, build_config, config_path, config_key_named)
    await start_node(node)
    server = Server(node, cfg.socket, cfg.section("daemon")["socket_group"], cfg.section("limits"),
                    cfg.size("limits", "max_frame_bytes"))
    try:
        await server.start()
        try:
            exporter = await start_metrics(cfg, node, server)
        except BaseException:
            await server.stop()
            raise
    except BaseException:
        # As a clean stop: else the next daemon takes this one for a death
        # (output of background processes marked lost, execs killed). The
        # server's stop is only for a server that started: a socket path
        # another daemon serves is that daemon's.
        if not await node.close():
            node.forget_running_mark()
        raise
    monitor = node.loop_monitor = LoopMonitor(notifier, lambda: node.status_line(len(server.connections)))
    monitor.start()
    # What start-up made (modules, config, re-adopted sandboxes) lives as long
    # as the daemon: out of the cyclic GC's reach, so that its full passes
    # during a burst walk only what came after.
    gc.collect()
    gc.freeze()
    # The registry keeps dead sandboxes too (for inspect and rm): not adopted, not running.
    adopted = sum(1 for sb in node.registry.by_id.values() if sb.state != "dead")
    log.info("dsecd ready: %d sandboxes adopted, pid %d", adopted, os.getpid(),
             extra={"fields": {"event": "ready", "adopted": adopted, "pid": os.getpid(),
                               "config": cfg.path, "socket": cfg.socket,
                               "metrics": exporter.describe() if exporter else None}})
    notifier.ready(node.status_line(0))
    up.append(node.reloader)
    if early:
        node.reloader.request()
    await stop.wait()
    return await stop_daemon(node, server, monitor, exporter, notifier, locks)


async def stop_daemon(node: Node, server: Server, monitor: LoopMonitor, exporter, notifier: Notifier,
                      locks: list[int]) -> int:
    """The stop: every wait in it ends by one deadline, daemon.stop_timeout_s
    from now (dsecd/stopclock.py); what does not end by then is logged and
    left, and the daemon exits anyway (a last resort ends it a few seconds
    later should the event loop's own thread be held in a blocking call).
    Its exit status: 0, or stopclock.LEFT_WORK_STATUS when it left work."""
    clock = StopClock(node.cfg.section("daemon")["stop_timeout_s"])
    clock.backstop()
    log.info("stopping; sandboxes keep running", extra={"fields": {"event": "stopping",
                                                                   "stop_timeout_s": clock.budget}})
    await node.reloader.close(min(RELOAD_STOP_S, clock.for_requests()))
    live = sum(1 for sb in node.registry.by_id.values() if sb.state != "dead")
    notifier.stopping(f"stopping; {live} sandboxes keep running")
    monitor.stop()
    if exporter is not None:
        await exporter.stop()
    # Before the connections close: what the daemon read of background
    # processes' output reaches their followers, and the rest stays in the
    # pipes for the next daemon.
    await node.procs.quiesce(min(QUIESCE_S, clock.for_requests()))
    await server.stop()
    try:
        left = await node.close(server.wait_stopped, clock)
    except Exception:
        # A bug in a close step: the stop still ends by its deadline, here,
        # not in asyncio's unbounded cancel of the tasks left.
        log.exception("stopping: closing the daemon's services failed; the stop goes on")
        left = 1
    notifier.close()
    stuck = await end_what_is_left(clock)
    if stuck:
        exit_now(stuck, clock, locks)       # says it, and that the running mark stays
    if left:
        log.warning("stopping: %s stays in the state dir, as the stop left work under way: the next start "
                    "takes this stop for a death, and kills the execs left running in sandboxes; exit "
                    "status %d", RUNNING_MARK, LEFT_WORK_STATUS)
        return LEFT_WORK_STATUS
    node.forget_running_mark()
    return 0


async def start_node(node) -> None:
    """node.start(), or SystemExit saying why it could not: a journaled
    sandbox this config cannot take back, or a file the start writes (the
    journal, first of all, as sandboxes are re-adopted) that it cannot."""
    try:
        await node.start()
    except ConfigError as err:
        raise SystemExit(f"dsecd: {err}") from err
    except OSError as err:
        # The sandboxes live in cgroups of their own, outside the daemon's:
        # a start that stops here leaves them running for the next one.
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            todo = "free space on that file system and start dsecd again"
        elif err.errno == errno.EROFS:
            todo = "make that file system writable and start dsecd again"
        else:
            todo = "fix that and start dsecd again"
        what = (err.strerror or str(err)) + (f" ({err.filename})" if err.filename else "")
        raise SystemExit(f"dsecd: start failed: {what}; {todo} (sandboxes keep running meanwhile)") from err


async def start_metrics(cfg, node: Node, server: Server):
    """The metrics endpoint, when metrics.listen names one (dsecd/metrics.py)."""
    m = cfg.section("metrics")
    if not m["listen"]:
        return None
    try:
        exporter = MetricsServer(node, m["listen"], bool(m["per_sandbox"]), lambda: server.connections)
        await exporter.start()
    except (ValueError, OSError) as err:
        raise SystemExit(f"dsecd: metrics.listen {m['listen']!r}: {getattr(err, 'strerror', None) or err}; "
                         "pick a free address or set metrics.listen = \"\" to turn the endpoint off") from err
    return exporter


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.check_config is not None:
        sys.exit(check_config(args))
    profiling.start_from_env()      # DSECD_PROFILE: a debug hook, off by default
    try:
        cfg = build_config(args)
    except ConfigError as err:
        # Before the config is read there is no log format to honour: the
        # default one (JSON), so a log reader still parses the line.
        logs.setup("info", "json")
        fail(f"dsecd: {err}")
    if args.print_config:
        import json

        print(json.dumps(cfg.raw, indent=2))
        return
    d = cfg.section("daemon")
    logs.setup(d["log_level"], d["log_format"])
    try:
        if os.geteuid() != 0:
            raise SystemExit("dsecd: must run as root (namespaces, cgroups, mounts)")
        locks = [lock_state_dir(str(cfg.state_dir)), *lock_cgroup_root(cfg.section("sandbox")["cgroup_root"])]
        # Before anything is exec'ed: what it execs comes from this copy.
        try:
            pinned.pin(cfg.state_dir)
        except OSError as err:
            raise SystemExit(f"dsecd: cannot copy its code into {cfg.state_dir}/code: "
                             f"{err.strerror or err} ({err.filename}); free space there and start dsecd "
                             "again (sandboxes keep running meanwhile)") from err
        raise_fd_limit()
        fds.init_parking()
        try:
            import uvloop

            status = uvloop.run(serve(cfg, args, locks))
        except ImportError:
            log.warning("uvloop not installed; using the default asyncio loop")
            status = asyncio.run(serve(cfg, args, locks))
    except SystemExit as err:
        if isinstance(err.code, str):       # a start that failed, said in words
            fail(err.code)
        raise
    if status:
        sys.exit(status)


def fail(message: str) -> None:
    """End a failed start: the reason as one log line, exit status 1."""
    log.critical(message.removeprefix("dsecd: "), extra={"fields": {"event": "start_failed"}})
    logging.shutdown()
    sys.exit(1)


if __name__ == "__main__":
    main()
