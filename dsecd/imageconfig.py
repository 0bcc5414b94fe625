"""An image's config: the environment, directory and user a sandbox made
from the image gets, and the command `dsec run` starts in it.

Each image manifest (dsecd/fs/images.py) stores it under "config", always
with exactly these keys:

    env            {"LANG": "C.UTF-8"}   the image's environment; a create's env goes over it
    cwd            "/app"                the default working directory ("/" when the image names none)
    user           "app"                 as OCI gives it: "" (root), "name", "uid", "name:group",
                                         "uid:gid"; resolved at create against the image's
                                         /etc/passwd and /etc/group (dsecd/fs/users.py)
    entrypoint     ["python3", "-m"]     OCI Entrypoint
    cmd            ["http.server"]       OCI Cmd: the default arguments, which `dsec run IMAGE ARGS` replaces
    exposed_ports  ["8080/tcp"]          sorted; what the image says it listens on (nothing is published)
    labels         {"org.opencontainers.image.version": "1.0"}

Images stored by older daemons have "user" as an int uid (0 when unset) and
"entrypoint" as Entrypoint and Cmd joined, without "cmd": `normalise` reads
both forms, so a reader never sees the old one.

The daemon (builds, imports, creates) and the SDK (`Client.run`) share this
module, so it imports nothing of the daemon.
"""

from __future__ import annotations

KEYS = ("env", "cwd", "user", "entrypoint", "cmd", "exposed_ports", "labels")
# The PATH of a process whose image sets none (Docker's, and BuildKit's for a
# base image without one).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROTOCOLS = ("tcp", "udp", "sctp")


class ConfigError(ValueError):
    """A config value that cannot be stored or used; the message says which and why."""


def default() -> dict:
    """The config of an image that names nothing."""
    return {"env": {}, "cwd": "/", "user": "", "entrypoint": [], "cmd": [], "exposed_ports": [], "labels": {}}


# ---------------------------------------------------------------- single values

def check_env(env: dict, what: str = "env") -> dict[str, str]:
    """Environment variables execve can take: a non-empty name without '=' or NUL, a value without NUL."""
    if not isinstance(env, dict):
        raise ConfigError(f"{what} must be a map of names to values, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k or "\0" in k or "\0" in v:
            raise ConfigError(f"{what}: bad environment variable {k!r}={v!r} (a name must be non-empty, "
                              "without '=' or NUL; a value without NUL)")
    return dict(env)


def check_cwd(cwd: str, what: str = "cwd") -> str:
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd:
        raise ConfigError(f"{what} must be an absolute path, got {cwd!r}")
    return cwd


def check_argv(argv: list, what: str) -> list[str]:
    """An Entrypoint or Cmd: a list of strings without NUL (empty: none)."""
    if not isinstance(argv, list) or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise ConfigError(f"{what} must be a list of strings without NUL bytes, got {argv!r}")
    return list(argv)


def check_labels(labels: dict, what: str = "labels") -> dict[str, str]:
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                               for k, v in labels.items()):
        raise ConfigError(f"{what} must be a map of strings to strings, got {labels!r}")
    return dict(labels)


def port_key(port: str | int) -> str:
    """An exposed port as OCI spells it: "8080" or 8080 -> "8080/tcp", "53/UDP" -> "53/udp"."""
    text = str(port).strip().lower()
    number, _, proto = text.partition("/")
    proto = proto or "tcp"
    if not number.isdigit() or not 1 <= int(number) <= 65535 or proto not in PROTOCOLS:
        raise ConfigError(f"exposed port {port!r}: expected PORT[/tcp|udp|sctp] with PORT in 1..65535")
    return f"{int(number)}/{proto}"


def check_ports(ports) -> list[str]:
    if not isinstance(ports, (list, tuple)):
        raise ConfigError(f"exposed_ports must be a list like ['8080/tcp'], got {ports!r}")
    return sorted({port_key(p) for p in ports})


def is_id(part: str) -> bool:
    """Whether a user spec's part (or an account file's field) is a decimal
    id: ASCII digits only (str.isdigit also takes '²', which int() refuses)."""
    return part.isascii() and part.isdigit()


def parse_user(spec: str) -> tuple[str, str | None]:
    """A user spec as OCI's config.User gives it -> (user, group or None).
    "" is root. Each part is a name or a decimal id; ids must fit a uid_t
    below 2^32-1 (that value means "no id" to the kernel)."""
    if not isinstance(spec, str):
        raise ConfigError(f"user must be a string such as 'app', '1000' or '1000:1000', got {spec!r}")
    if spec == "":
        return "", None
    user, sep, group = spec.partition(":")
    for part, what in ((user, "user"), *(((group, "group"),) if sep else ())):
        if not part or ":" in part or any(c.isspace() or c == "\0" for c in part):
            raise ConfigError(f"user {spec!r}: expected NAME, UID, NAME:GROUP or UID:GID (each part "
                              f"non-empty, without spaces); the {what} part is {part!r}")
        if is_id(part) and int(part) >= 2**32 - 1:
            raise ConfigError(f"user {spec!r}: {what} id {part} is too large (ids are below 2^32-1)")
    return user, group if sep else None


def user_spec(user: int | str | None) -> str:
    """A user as given to a build or a create (an int uid, as older clients
    send it, or a spec string) -> a spec string, checked."""
    if isinstance(user, bool):
        raise ConfigError(f"user must be a uid or a string such as 'app:app', got {user!r}")
    if isinstance(user, int):
        if not 0 <= user < 2**32 - 1:
            raise ConfigError(f"user must be a uid in [0, 2^32-1), got {user}")
        return str(user)
    parse_user(user)
    return user


# ---------------------------------------------------------------- whole configs

def from_oci(doc: dict) -> dict:
    """The image config JSON of a docker-save or OCI image (its "config"
    object: Env, WorkingDir, User, Entrypoint, Cmd, ExposedPorts, Labels)
    -> this module's config. ConfigError names the field that is wrong."""
    if not isinstance(doc, dict):
        raise ConfigError(f"the image config is not a JSON object: {type(doc).__name__}")
    c = doc.get("config") or {}
    if not isinstance(c, dict):
        raise ConfigError(f"the image config's 'config' is not an object: {type(c).__name__}")
    env_lines = c.get("Env") or []
    if not isinstance(env_lines, list) or not all(isinstance(e, str) for e in env_lines):
        raise ConfigError(f"config.Env must be a list of 'K=V' strings, got {env_lines!r}")
    # A line without '=' names a variable with no value: execve has no such thing, so it is dropped.
    env = check_env(dict(e.split("=", 1) for e in env_lines if "=" in e), "config.Env")
    out = default()
    out["env"] = env
    if c.get("WorkingDir"):
        out["cwd"] = check_cwd(c["WorkingDir"], "config.WorkingDir")
    if c.get("User"):
        out["user"] = user_spec(c["User"])
    for key, field in (("entrypoint", "Entrypoint"), ("cmd", "Cmd")):
        value = c.get(field) or []
        if isinstance(value, str):          # older Docker wrote a bare string for a shell-form command
            value = ["/bin/sh", "-c", value]
        out[key] = check_argv(value, f"config.{field}")
    ports = c.get("ExposedPorts") or {}
    if not isinstance(ports, dict):
        raise ConfigError(f"config.ExposedPorts must be a map like {{'8080/tcp': {{}}}}, got {ports!r}")
    out["exposed_ports"] = check_ports(list(ports))
    out["labels"] = check_labels(c.get("Labels") or {}, "config.Labels")
    return out


def normalise(stored: dict | None) -> dict:
    """A config as a manifest stores it, of any dsecd version, in the current
    form (every key of KEYS; see the module docstring for the older form)."""
    stored = stored or {}
    out = default()
    out["env"] = dict(stored.get("env") or {})
    out["cwd"] = stored.get("cwd") or "/"
    user = stored.get("user", "")
    out["user"] = ("" if user == 0 else str(user)) if isinstance(user, int) else (user or "")
    out["entrypoint"] = list(stored.get("entrypoint") or [])
    out["cmd"] = list(stored.get("cmd") or [])       # absent in the older form: its entrypoint holds both
    out["exposed_ports"] = sorted(stored.get("exposed_ports") or [])
    out["labels"] = dict(stored.get("labels") or {})
    return out


def overrides(env: dict | None = None, cwd: str | None = None, user: int | str | None = None,
              entrypoint: list | None = None, cmd: list | None = None, labels: dict | None = None,
              exposed_ports: list | None = None) -> dict:
    """The config fields a build sets (None: left as the image below has
    them), checked and in stored form."""
    out: dict = {}
    if env is not None:
        out["env"] = check_env(env)
    if cwd is not None:
        out["cwd"] = check_cwd(cwd)
    if user is not None:
        out["user"] = user_spec(user)
    if entrypoint is not None:
        out["entrypoint"] = check_argv(entrypoint, "entrypoint")
    if cmd is not None:
        out["cmd"] = check_argv(cmd, "cmd")
    if labels is not None:
        out["labels"] = check_labels(labels)
    if exposed_ports is not None:
        out["exposed_ports"] = check_ports(exposed_ports)
    return out


def stack(below: dict, above: dict) -> dict:
    """The config of an image built on top of another: `above`'s fields
    win; env and labels merge, `above`'s winning per key. As in a
    Dockerfile, a new entrypoint without a new cmd drops the old cmd (it
    held arguments for the old entrypoint)."""
    base = normalise(below)
    out = {**base, **above}
    out["env"] = {**base["env"], **above.get("env", {})}
    out["labels"] = {**base["labels"], **above.get("labels", {})}
    if "entrypoint" in above and "cmd" not in above:
        out["cmd"] = []
    return out


def run_argv(config: dict, args: list[str] | None = None, entrypoint: list[str] | str | None = None) -> list[str]:
    """What `dsec run` starts, as `docker run` does: the image's Entrypoint
    followed by its Cmd; `args` (when given, even empty) replace Cmd; an
    `entrypoint` (a program, or a list) replaces Entrypoint and drops Cmd.
    An empty result is ConfigError: there is nothing to run."""
    config = normalise(config)
    if entrypoint is not None:
        head = [entrypoint] if isinstance(entrypoint, str) else list(entrypoint)
        tail = list(args or [])
    else:
        head = config["entrypoint"]
        tail = config["cmd"] if args is None else list(args)
    argv = head + tail
    if not argv or not argv[0]:
        raise ConfigError("the image has no Entrypoint or Cmd: give a command to run")
    return argv
