"""Configuration: the embedded defaults (default.toml) overlaid with a user file.

Every key the daemon reads is in default.toml with a comment; a user file may
only name keys that exist there (a typo is an error at start, not a silently
ignored knob), with a value of its default's kind (a whole number, a number,
true or false, a string, a list; sizes and durations as strings or numbers)
and in range (no negative numbers; POSITIVE lists those zero would break).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from . import caps, policy, unixsock
from .errors import BadRequest

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ConfigError(ValueError):
    pass


def parse_size(value: int | str) -> int:
    """Bytes from 123, "123", "512M", "2G", "1.5GiB"."""
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number or a string like '512M', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must not be negative: {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"bad size {value!r}: use bytes or a number with K, M, G or T")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_text(n: int) -> str:
    """Bytes as a person reads them in a message: 512B, 1.1M, 23.0G (the
    units parse_size takes back, as `dsec ps` shows sizes)."""
    for unit in ("B", "K", "M", "G"):
        # Below 1024 as it is printed: 1048575 bytes are 1.0M, not 1024.0K.
        if (n if unit == "B" else round(n, 1)) < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def size_texts(*sizes: int) -> list[str]:
    """size_text of each size; where two different sizes would read the same
    (a bound and what went past it by less than the rounding), each with
    its bytes too, so that a refusal never reads "23.5G, more than 23.5G"."""
    texts = [size_text(n) for n in sizes]
    if len(set(texts)) < len(set(sizes)):
        texts = [f"{t} ({n} bytes)" for t, n in zip(texts, sizes, strict=True)]
    return texts


def _load_defaults() -> dict:
    text = resources.files("dsecd").joinpath("default.toml").read_text()
    return tomllib.loads(text)


# Tables whose keys are the user's own names (rule sets, task policies), not
# knobs: a user file adds names or replaces a named table whole.
FREE_FORM = {"net.rule_sets", "policy", "images.mirrors"}

# Keys dsecd no longer has, and what replaced them: a config naming one is
# refused like any unknown key, with this said.
REMOVED = {
    "images.skopeo": "image pulls no longer run skopeo: dsecd talks to registries itself; delete the key",
    "images.pull_convert_threads": "layers convert as they download now; images.pull_parallel_layers "
                                   "sets how many at once",
}


def _overlay(base: dict, extra: dict, where: str = "") -> dict:
    out = dict(base)
    if where.rstrip(".") in FREE_FORM:
        out.update(extra)
        return out
    for key, value in extra.items():
        name = f"{where}{key}"
        if key not in base:
            if name in REMOVED:
                raise ConfigError(f"config key {name!r} was removed: {REMOVED[name]}")
            raise ConfigError(f"unknown config key {name!r} (see dsecd/default.toml)")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {name!r} must be a table")
            out[key] = _overlay(base[key], value, name + ".")
        else:
            _check_value(name, base[key], value)
            out[key] = value
    return out


# Numbers and sizes that must be above zero (a zero would stop the daemon
# working, not turn a feature off); every other number must not be negative.
POSITIVE = {
    "admission.max_active_creates", "build.cpu", "cpu.recent_half_life_s", "daemon.stop_timeout_s",
    "daemon.worker_threads", "fncall.cpu",
    "fncall.default_timeout_s", "fncall.kill_grace_s", "fncall.max_inflight", "fncall.max_timeout_s", "fncall.pids",
    "fncall.rlimit_as", "fncall.rlimit_fsize", "fncall.rlimit_nofile", "fncall.rlimit_nproc", "fncall.tmp_size",
    "fncall.uid_count", "fncall.zygote_max_calls", "fncall.zygote_start_timeout_s",
    "images.max_flattens", "images.max_pulls", "images.pull_parallel_layers", "images.pull_timeout_s", "limits.frame_timeout_s",
    "limits.hello_timeout_s", "limits.max_connections", "limits.max_procs_per_sandbox",
    "limits.max_requests_per_client", "limits.max_sandboxes", "limits.max_tar_entries", "limits.max_tar_puts",
    "limits.max_watches", "memory.background_threads", "memory.freeze_timeout_s", "microvm.balloon_idle_s",
    "microvm.balloon_interval_s", "microvm.boot_timeout_s", "microvm.max_vcpus", "net.dns_timeout_s", "net.mtu",
    "pool.refill_interval_s", "pool.refill_per_s",
    "sandbox.cpu", "sandbox.cpu_period_us", "sandbox.destroy_timeout_s", "sandbox.disk_inodes", "sandbox.pids",
    "sandbox.userns_size",
}

# Paths the daemon uses; "" where a key has one means its default or none.
ABSOLUTE_PATHS = ("daemon.socket", "daemon.state_dir", "images.store", "images.auth_file", "images.certs_dir",
                  "net.bpf_cache_dir", "microvm.guest_dir")

# String keys that take a number too: sizes ("512M" or bytes) and durations ("90s" or seconds).
_NUMBER_OR_STRING = {"sandbox.default_ttl"}

# Size keys that also take "auto", a size worked out on the host where it is
# used (pager.cache_max_bytes: dsecd.fs.pager.cache_cap).
SIZE_OR_AUTO = {"pager.cache_max_bytes"}


def _check_value(name: str, default, value) -> None:
    """`value` for the key `name` has the kind of its default (a whole number,
    a number, a boolean, a string, a list of strings or numbers) and is in
    range: ConfigError naming the key otherwise."""
    def fail(want: str):
        raise ConfigError(f"config key {name!r} must be {want}, got {value!r}")

    if name in SIZE_OR_AUTO:
        if value == "auto":
            return
        default = "0"               # else checked as any size is
    if isinstance(default, bool):
        if not isinstance(value, bool):
            fail("true or false")
    elif isinstance(default, (int, float)):
        whole = isinstance(default, int)
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            fail("a whole number" if whole else "a number")
        if value < 0 or (value == 0 and name in POSITIVE):
            fail("above zero" if name in POSITIVE else "zero or more")
    elif isinstance(default, str):
        size = bool(default and _SIZE.match(default)) and name not in _NUMBER_OR_STRING
        takes_number = size or name in _NUMBER_OR_STRING
        if takes_number and isinstance(value, (int, float)) and not isinstance(value, bool):
            if value < 0 or (value == 0 and name in POSITIVE):
                fail("above zero" if name in POSITIVE else "zero or more")
        elif not isinstance(value, str):
            fail("a string" + (" or a number" if takes_number else ""))
        elif size:
            # Parsed where it is used, maybe only at the first call or create:
            # a bad one must stop the start, not fail that request.
            if not _SIZE.match(value):
                fail("a size (bytes, or a number with K, M, G or T)"
                     + (' or "auto"' if name in SIZE_OR_AUTO else ""))
            if name in POSITIVE and parse_size(value) == 0:
                fail("above zero")
    elif isinstance(default, list):
        kinds = {type(v) for v in default} or {str}
        if not isinstance(value, list) or not all(type(v) in kinds for v in value):
            fail("a list of " + " or ".join(sorted("strings" if k is str else "whole numbers" for k in kinds)))


# Where dsecd looks for its config when --config names none; absent = the
# embedded defaults alone.
DEFAULT_PATH = "/etc/dsecd/dsecd.toml"


@dataclass(frozen=True)
class Config:
    raw: dict
    path: str | None = None         # the file overlaid on the defaults, if any

    # Frequently used values, parsed once.
    @property
    def socket(self) -> str:
        return self.raw["daemon"]["socket"]

    @property
    def state_dir(self) -> Path:
        return Path(self.raw["daemon"]["state_dir"])

    def section(self, name: str) -> dict:
        return self.raw[name]

    def size(self, section: str, key: str) -> int:
        try:
            return parse_size(self.raw[section][key])
        except ConfigError as err:
            raise ConfigError(f"{section}.{key}: {err}") from err


def load_config(path: str | None = None, overrides: dict | None = None) -> Config:
    """Defaults, overlaid with the TOML file at `path`, then with `overrides`."""
    raw = _load_defaults()
    if path:
        try:
            with open(path, "rb") as f:
                user = tomllib.load(f)
        except OSError as err:
            raise ConfigError(f"read config {path}: {err.strerror}") from err
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"parse config {path}: {err}") from err
        except UnicodeDecodeError as err:
            raise ConfigError(f"parse config {path}: not UTF-8 (byte {err.object[err.start]:#04x} at offset "
                              f"{err.start}): a TOML file is UTF-8 text") from err
        raw = _overlay(raw, user)
    if overrides:
        raw = _overlay(raw, overrides)
    cfg = Config(raw, path)
    _validate(cfg)
    return cfg


def keys_of(path: str | None) -> dict:
    """The tables and keys a config names: the embedded defaults with the
    file at `path` merged in, unchecked (a file that cannot be read or
    parsed adds nothing). What an error's key is looked up in."""
    def merge(base: dict, extra: dict) -> dict:
        out = dict(base)
        for key, value in extra.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
                else value
        return out

    raw = _load_defaults()
    if not path:
        return raw
    try:
        with open(path, "rb") as f:
            return merge(raw, tomllib.load(f))
    except (OSError, ValueError):        # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        return raw


def _validate(cfg: Config) -> None:
    for section, key in (("limits", "max_frame_bytes"), ("limits", "max_file_chunk_bytes"),
                         ("limits", "max_exec_output_bytes"), ("sandbox", "memory"),
                         ("sandbox", "tmp_size"), ("sandbox", "shm_size"), ("images", "pull_tmpfs"),
                         ("images", "max_snapshot_bytes"), ("images", "max_layer_bytes")):
        cfg.size(section, key)
    if cfg.size("limits", "max_file_chunk_bytes") + 4096 > cfg.size("limits", "max_frame_bytes"):
        raise ConfigError("limits.max_file_chunk_bytes must be smaller than limits.max_frame_bytes")
    for section, key, allowed in (("daemon", "log_level", ("debug", "info", "warning", "error")),
                                  ("daemon", "log_format", ("json", "logfmt")),
                                  ("sandbox", "backend", ("container", "microvm")),
                                  ("fncall", "qos", ("ls", "be")),
                                  ("images", "mode", ("auto", "lazy", "eager", "direct")),
                                  ("memory", "prefetch", ("populate", "willneed", "both", "none")),
                                  ("memory.damon", "operations", ("paddr", "vaddr")),
                                  ("net", "default_mode", ("none", "default")),
                                  ("net", "dns_refuse", ("refused", "nxdomain"))):
        value = _table(cfg, section)[key]
        if value not in allowed:
            raise ConfigError(f"{section}.{key} must be one of {', '.join(allowed)}, got {value!r}")
    # Relative to the daemon's working directory, a path would name one place
    # when dsecd is started by hand and another under systemd (cwd /): one
    # config, two state dirs, and the start with the second destroys the
    # sandboxes of the first under the same cgroup_root as leftovers.
    for dotted in ABSOLUTE_PATHS:
        section, _, key = dotted.rpartition(".")
        value = _table(cfg, section)[key]
        if value and not value.startswith("/"):
            raise ConfigError(f"{dotted} must be an absolute path, got {value!r}")
        if not value and dotted in ("daemon.socket", "daemon.state_dir"):
            raise ConfigError(f"{dotted} must be an absolute path, got ''")
    # Served only once the sandboxes are re-adopted, and reached by clients
    # only at an address a unix socket can take.
    problem = unixsock.address_problem(cfg.socket)
    if problem:
        raise ConfigError(f"daemon.socket {cfg.socket!r} {problem}")
    # At start every group below it that no journal record names is destroyed
    # (orphans of a crash): it must be a subtree of dsecd's own, never a
    # hierarchy's root or above it, whose groups are the host's.
    root = cfg.section("sandbox")["cgroup_root"]
    if any(not part.strip() or part in (".", "..") for part in root.split("/")):
        raise ConfigError(f"sandbox.cgroup_root must be a relative path of names below each cgroup "
                          f"hierarchy's root, such as \"dsecd\", got {root!r}")
    vm = cfg.section("microvm")
    if vm["watchdog_interval_s"] > 0 and vm["watchdog_timeout_s"] <= vm["watchdog_interval_s"]:
        raise ConfigError(f"microvm.watchdog_timeout_s ({vm['watchdog_timeout_s']}) must be longer than "
                          f"microvm.watchdog_interval_s ({vm['watchdog_interval_s']}): a VM answers one ping "
                          "per interval, and one silent past the timeout is killed as hung")
    for method in cfg.section("memory")["v1_reclaim"]:
        if method not in ("pageout", "limit", "force_empty"):
            raise ConfigError(f"memory.v1_reclaim must name only pageout, limit, force_empty, got {method!r}")
    # Read when the network is first built, maybe at the first --net default
    # create: a bad one must stop the start, not make networking unavailable.
    ports = cfg.section("net")["publish_ports"]
    m = re.fullmatch(r"\s*(\d{1,5})\s*(?:-\s*(\d{1,5})\s*)?", ports)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2) or m.group(1)) <= 65535:
        raise ConfigError(f"net.publish_ports must be a port range LO-HI (or one port) within 1-65535, "
                          f"LO <= HI, got {ports!r}")
    # Made when the network is first built too: a name the kernel refuses
    # (dev_valid_name: 1 to 15 bytes, no "/", ":" or white space, not "." or
    # "..") would leave networking unavailable with a netlink error.
    for key in ("bridge", "sandbox_ifname"):
        name = cfg.section("net")[key]
        if (not 0 < len(name.encode()) < 16 or name in (".", "..")
                or any(c in "/:" or c.isspace() for c in name)):
            raise ConfigError(f"net.{key} must be a network interface name: 1 to 15 bytes, without '/', ':' "
                              f"or white space, got {name!r}")
    net = cfg.section("net")
    if not 68 <= net["mtu"] <= 65535:
        raise ConfigError(f"net.mtu must be 68 to 65535, got {net['mtu']}: the kernel refuses the bridge "
                          "and veths another MTU")
    if net["ipv6_subnet"] and net["mtu"] < 1280:
        raise ConfigError(f"net.mtu must be at least 1280 with net.ipv6_subnet (IPv6's minimum), got {net['mtu']}")
    if not cfg.section("fncall")["python"].strip():
        raise ConfigError("fncall.python must name the interpreter of the zygote (\"python3\"); "
                          "fncall.zygote = false turns the zygote off")
    fc, sb = cfg.section("fncall"), cfg.section("sandbox")
    # A worker sets its rlimits before it receives its call: fds 0-3 (its
    # link to the zygote on 3) plus the call's stdin, stdout, stderr and code.
    if fc["rlimit_nofile"] < 8:
        raise ConfigError(f"fncall.rlimit_nofile must be at least 8, got {fc['rlimit_nofile']}: a call's "
                          "worker holds 4 fds and receives the call's stdin, stdout, stderr and code as 4 more")
    base = call_uid_base(cfg)
    if sb["userns"] and base + fc["uid_count"] > sb["userns_size"]:
        raise ConfigError(f"fncall.uid_base + fncall.uid_count ({base} + {fc['uid_count']}) must be at "
                          f"most sandbox.userns_size ({sb['userns_size']}): calls run under ids of their call "
                          "sandbox's user namespace")
    try:
        caps.cap_mask(cfg.section("sandbox")["capabilities"])
    except ValueError as err:
        raise ConfigError(str(err)) from err
    try:
        policy.named(cfg.raw.get("policy", {}))
    except policy.PolicyError as err:
        raise ConfigError(str(err)) from err


def _table(cfg: Config, dotted: str) -> dict:
    """The table `dotted` names ("memory.damon": [memory.damon])."""
    table = cfg.raw
    for part in dotted.split("."):
        table = table[part]
    return table


def with_setting(text: str, section: str, key: str, value: str | None) -> str:
    """TOML `text` with `key = "value"` added to [section] (the section added
    where text has none); `text` as it is when value is None or text sets
    key already. For the configs test and bench daemons are started with."""
    if value is None or re.search(rf"^\s*{re.escape(key)}\s*=", text, re.M):
        return text
    head, line = f"[{section}]\n", f'{key} = "{value}"\n'
    if head in text:
        return text.replace(head, head + line, 1)
    return f"{text}\n{head}{line}"


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|[smhd])")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_seconds(text: str) -> float:
    """Seconds from "90", "1.5", "90s", "5m", "2h", "1d", "500ms", or parts
    of those run together as docker and Go write them ("1h30m", "1m30s");
    ValueError for anything else."""
    word = text.strip().lower()
    try:
        return float(word)
    except ValueError:
        pass
    parts = _DURATION_PART.findall(word)
    if not parts or "".join(n + u for n, u in parts) != word:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def parse_duration(value, what: str) -> float | None:
    """Seconds from 90, 1.5, or a string duration_seconds reads ("90s",
    "1h30m"); None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        try:
            seconds = duration_seconds(str(value))
        except ValueError:
            raise BadRequest(f"{what} must be seconds or a duration like 90s, 5m, 1h30m; "
                             f"got {value!r}") from None
    if not 0 < seconds <= 365 * 86400:
        raise BadRequest(f"{what} must be more than 0 s and at most 365 days, got {value!r}")
    return seconds


# fncall.uid_base = 0 (the default) picks the first uid of calls: with user
# namespaces an id of the call sandbox's range (below userns_size, 65536 by
# default, and above an image's own users); without, a host uid past those
# of host users and services (systemd's dynamic users end at 65519).
CALL_UID_BASE_USERNS = 60000
CALL_UID_BASE_HOST = 100000


def call_uid_base(cfg: Config) -> int:
    """The first uid of calls ([fncall] uid_base, 0: picked as above)."""
    base = cfg.section("fncall")["uid_base"]
    if base:
        return base
    return CALL_UID_BASE_USERNS if cfg.section("sandbox")["userns"] else CALL_UID_BASE_HOST
