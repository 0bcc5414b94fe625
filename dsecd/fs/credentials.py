"""A registry's credentials: from a docker-style auth.json and the credential
helpers it names (the registry client asks here when a registry first
wants credentials, fs/registry.py).

For a registry, under its name and, for docker.io, each of its other names
("https://index.docker.io/v1/", "index.docker.io", ...), in this order:

1. "credHelpers": {"<registry>": "<name>"}: the program
   `docker-credential-<name> get`, run with the registry's server URL on
   its stdin, answers {"Username": ..., "Secret": ...} (docker's credential
   helper protocol: ecr-login, gcloud, pass, secretservice, ...);
2. "auths": {"<registry>": {...}} with "identitytoken" (taken first, as
   docker does: its login writes one beside an "auth" of the user and an
   empty password), "auth" (base64 of user:password), or "username" and
   "password";
3. "credsStore": "<name>": the same protocol, for every registry.

A helper that has nothing for the registry (its "credentials not found"
answer) passes to the next source; a store docker wrote, whose "auths"
entries are empty, is so reached. An identity token (an "identitytoken"
entry, or a helper's answer with the Username "<token>") is an OAuth2
refresh token: the registry client trades it at the registry's token
service for an access token, and a registry that asks for Basic auth
cannot take it.

Helpers are found in the daemon's PATH and run as it, with its environment
(a helper that reads cloud credentials finds them where the daemon's
environment says: under systemd, set them in the unit), without a shell,
in a session of their own that is killed after `timeout` seconds, or at
once when the pull that asked is stopped. Their answers and the secrets
in them are never logged nor put in an error: a failing helper is quoted
by the first line it printed (stderr first).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

DOCKER_HUB_NAMES = ("docker.io", "index.docker.io", "registry-1.docker.io", "https://index.docker.io/v1/")
# The server URL docker's tools store Docker Hub's credentials under, and ask helpers with.
DOCKER_HUB_SERVER_URL = "https://index.docker.io/v1/"
HELPER_PREFIX = "docker-credential-"
HELPER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
HELPER_TIMEOUT_S = 30.0
STOP_POLL_S = 0.1                    # how often a running helper looks at its stop
REAP_S = 2.0                         # the wait for a killed helper's pipes to end
MAX_HELPER_OUTPUT = 1 << 20
IDENTITY_TOKEN_USER = "<token>"      # a helper's Username for a Secret that is an identity token
NOT_FOUND = "credentials not found"  # docker-credential-helpers' answer for an unknown server URL


class CredentialsError(Exception):
    """code: bad_request (the auth file or a helper's answer is malformed),
    unsupported (a helper is not installed), permission (a helper failed),
    conflict (stopped while a helper ran).
    The message never holds a secret."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, repr=False)
class Credentials:
    user: str
    secret: str                     # a password, or an identity token
    identity_token: bool = False    # secret is an OAuth2 refresh token, traded for access tokens
    source: str = ""                # where they came from, for messages: "images.auth_file", "docker-credential-pass"

    def __repr__(self) -> str:      # never the secret
        kind = "identity token" if self.identity_token else f"user {self.user!r}"
        return f"Credentials({kind} from {self.source})"


# ---------------------------------------------------------------- names


def auth_key_host(key: str) -> str:
    """An auth.json key as host[:port]: "https://index.docker.io/v1/" -> "index.docker.io"."""
    if "://" in key:
        key = urlsplit(key).netloc
    return key.split("/", 1)[0]


def auth_candidates(registry: str) -> list[str]:
    """The auth.json keys that may hold `registry`'s credentials, most specific first."""
    if registry in DOCKER_HUB_NAMES:
        return list(DOCKER_HUB_NAMES)
    return [registry]


def server_url(registry: str) -> str:
    """What a credential helper is asked with: the URL docker's tools store
    Docker Hub under, else the registry's host[:port]."""
    return DOCKER_HUB_SERVER_URL if registry in DOCKER_HUB_NAMES else registry


def _first_entry(table: dict, registry: str, usable) -> tuple[str, object] | None:
    """(name, value) of `table`'s first entry for `registry` whose value is
    `usable`, under its names in auth_candidates' order (an exact key before
    one that differs in scheme or path); None if there is none."""
    by_host: dict = {}
    for key, value in table.items():
        by_host.setdefault(key, value)
        by_host.setdefault(auth_key_host(key), value)
    for name in auth_candidates(registry):
        for value in (by_host.get(name), by_host.get(auth_key_host(name))):
            if usable(value):
                return name, value
    return None


def _has_password(value) -> bool:
    """Whether an "auths" entry holds a user and password (docker leaves {}
    where a store keeps them)."""
    return isinstance(value, dict) and bool(
        value.get("auth") or (value.get("username") is not None and value.get("password") is not None))


def _has_identity_token(value) -> bool:
    return isinstance(value, dict) and bool(value.get("identitytoken"))


# ---------------------------------------------------------------- the auth file


def load_auth_file(auth_file: str) -> dict:
    """The auth.json `auth_file` ("" = none: {})."""
    if not auth_file:
        return {}
    try:
        doc = json.loads(Path(auth_file).read_bytes())
    except OSError as e:
        raise CredentialsError("bad_request", f"images.auth_file {auth_file} cannot be read ({e.strerror}); "
                               "fix the path in the config or make the file readable by root") from None
    except ValueError:
        raise CredentialsError("bad_request", f"images.auth_file {auth_file} is not JSON; write it as "
                               '{"auths": {"<host[:port]>": {"auth": "<base64 of user:password>"}}}') from None
    return doc if isinstance(doc, dict) else {}


def lookup_credentials(auths: dict, registry: str) -> tuple[str, str] | None:
    """(user, password) for `registry` from the "auths" object of an
    auth.json, or None. Raises ValueError (which never quotes the secret)
    on a malformed entry."""
    entry = _first_entry(auths, registry, _has_password)
    if entry is None:
        return None
    name, value = entry
    if value.get("auth"):
        try:
            user, sep, password = base64.b64decode(value["auth"], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError, TypeError):
            raise ValueError(f'the "auth" value for {name} is not base64 of user:password') from None
        if not sep:
            raise ValueError(f'the "auth" value for {name} is not base64 of user:password')
        return user, password
    return str(value["username"]), str(value["password"])


def lookup(auth_file: str, registry: str, timeout: float = HELPER_TIMEOUT_S, stop=None) -> Credentials | None:
    """`registry`'s credentials from the auth file and the helpers it names,
    in the order of this module's docstring; None: ask anonymously. `stop`
    (an Event-like: is_set()), once set, kills a helper still running
    (CredentialsError "conflict")."""
    doc = load_auth_file(auth_file)
    helpers = doc.get("credHelpers")
    if isinstance(helpers, dict):
        entry = _first_entry(helpers, registry, lambda v: isinstance(v, str) and v)
        if entry is not None:
            found = run_helper(entry[1], registry, timeout, f'"credHelpers" of images.auth_file {auth_file}', stop)
            if found is not None:
                return found
    auths = doc.get("auths")
    if isinstance(auths, dict):
        found = _from_auths(auths, registry, auth_file)
        if found is not None:
            return found
    store = doc.get("credsStore")
    if isinstance(store, str) and store:
        return run_helper(store, registry, timeout, f'"credsStore" of images.auth_file {auth_file}', stop)
    return None


def _from_auths(auths: dict, registry: str, auth_file: str) -> Credentials | None:
    """An "auths" entry's credentials: its identity token where it has one
    (docker's login writes it beside an "auth" of the user and an empty
    password, and docker's client then uses the token), else its user and
    password."""
    entry = _first_entry(auths, registry, _has_identity_token)
    if entry is not None:
        token = entry[1]["identitytoken"]
        if not isinstance(token, str):
            raise CredentialsError("bad_request", f'images.auth_file {auth_file}: the "identitytoken" of '
                                   f"{entry[0]} is not a string; fix that entry")
        return Credentials("", token, identity_token=True, source="images.auth_file")
    try:
        pair = lookup_credentials(auths, registry)
    except ValueError as e:
        raise CredentialsError("bad_request", f"images.auth_file {auth_file}: {e}; fix that entry") from None
    return Credentials(*pair, source="images.auth_file") if pair is not None else None


# ---------------------------------------------------------------- helpers


def run_helper(name: str, registry: str, timeout: float = HELPER_TIMEOUT_S, named_in: str = "",
               stop=None) -> Credentials | None:
    """`docker-credential-<name> get` for `registry`: its credentials, or
    None when it has none. `named_in` says where the helper was named, for
    errors; `stop` as for lookup()."""
    program = HELPER_PREFIX + name
    where = f" (named in the {named_in})" if named_in else ""
    if not HELPER_NAME.fullmatch(name):
        raise CredentialsError("bad_request", f"{name!r}{where} is not a credential helper's name: a "
                               f"helper is a program {HELPER_PREFIX}<name> in PATH; fix the entry")
    path = shutil.which(program)
    if path is None:
        raise CredentialsError("unsupported", f"the credential helper {program}{where} is not installed: it is "
                               f"in none of the daemon's PATH ({os.environ.get('PATH', '')}); install it there "
                               "or remove the entry")
    try:
        returncode, out, err = _run(path, server_url(registry).encode(), timeout, stop)
    except InterruptedError:
        raise CredentialsError("conflict", f"the credential helper {program} for {registry}: stopped") from None
    except subprocess.TimeoutExpired:
        raise CredentialsError("permission", f"the credential helper {program}{where} did not answer for "
                               f"{registry} within {timeout:g} s (it and what it started were killed)") from None
    except OSError as e:
        raise CredentialsError("permission", f"the credential helper {path}{where} cannot be run: "
                               f"{e.strerror}") from None
    if returncode != 0:
        said = (out + err)[:MAX_HELPER_OUTPUT].decode(errors="replace")
        if NOT_FOUND in said.lower():
            return None
        raise CredentialsError("permission", f"the credential helper {program}{where} failed for {registry} "
                               f"(exit {returncode}" + (f": {_first_line(err, out)}" if said.strip() else "") + ")")
    return _helper_answer(out, program, registry)


def _run(path: str, stdin: bytes, timeout: float, stop=None) -> tuple[int, bytes, bytes]:
    """`path get` with `stdin`: (exit status, stdout, stderr). On the timeout
    (TimeoutExpired) or once `stop` is set (InterruptedError) its whole
    session is killed: a helper may start others (gpg, a cloud CLI)."""
    proc = subprocess.Popen([path, "get"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, close_fds=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        # The request (a server URL) at once, and its end: a pipe takes it
        # whole, and communicate() in slices could give up before writing it.
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(stdin)
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        proc.stdin = None                      # communicate() then leaves it alone
        while True:
            try:
                # in slices, to see `stop`; a retried communicate() loses no output
                out, err = proc.communicate(timeout=min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
                return proc.returncode, out, err
            except subprocess.TimeoutExpired:
                if stop is not None and stop.is_set():
                    raise InterruptedError(errno.EINTR, "stopped") from None
                if time.monotonic() >= deadline:
                    raise
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _reap(proc)
        raise


def _reap(proc: subprocess.Popen) -> None:
    """Wait for a killed helper. A process it started that left its session
    may hold the pipes open: they are closed after a while, not read to
    their end."""
    try:
        proc.communicate(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        proc.wait()


def _first_line(err: bytes, out: bytes) -> str:
    """What a failing helper said: its stderr's first line, else its
    stdout's (docker-credential-helpers print their errors there), at most
    200 characters."""
    for stream in (err, out):
        for line in stream[:MAX_HELPER_OUTPUT].decode(errors="replace").splitlines():
            if line.strip():
                return line.strip()[:200]
    return ""


def _helper_answer(out: bytes, program: str, registry: str) -> Credentials | None:
    """A helper's JSON answer as Credentials (None: an empty secret)."""
    bad = CredentialsError("bad_request", f"the credential helper {program} answered for {registry} with "
                           'something other than {"Username": ..., "Secret": ...}')
    if len(out) > MAX_HELPER_OUTPUT:
        raise bad
    try:
        doc = json.loads(out)
    except ValueError:
        raise bad from None
    if not isinstance(doc, dict):
        raise bad
    user, secret = doc.get("Username", ""), doc.get("Secret", "")
    if not isinstance(user, str) or not isinstance(secret, str):
        raise bad
    if not secret:
        return None
    if user == IDENTITY_TOKEN_USER:
        return Credentials("", secret, identity_token=True, source=program)
    return Credentials(user, secret, source=program)
