"""A client of the OCI distribution API (v2), the registry side of `dsec image pull`.

One Registry object serves one pull of one repository on one registry host,
from several threads at once:

    manifest(ref)        a manifest or an index, by tag or digest, as served
    blob(digest)         a small blob (an image config), at most 4 MiB
    open_blob(digest)    a layer as a stream (BlobStream) whose reads return what has
                         arrived, resumed with a Range request where the connection
                         drops, stopped at once from any thread by its abort()

Connections, TLS and redirects are urllib3's (Debian's python3-urllib3): one
pool per host, kept alive across the blobs of a pull. Around it, what a
registry needs: anonymous requests first, then on a 401 the server's
challenge answered, Basic with the registry's credentials, Bearer with a
token fetched from its realm (one token for all threads, fetched again
once when it expires; credentials never to a plain-http realm
of a registry reached over HTTPS); a blob GET redirected to blob storage on
another host without our Authorization header; retries of refused
connections, 5xx and 429 answers; per-host CAs and client certificates from
<certs_dir>/<host[:port]>/; and, for a registry listed as insecure, HTTPS
without verification, or plain HTTP when HTTPS fails in any way. That lack
of verification is the registry's own host's only: its token realm and blob
storage on other hosts are verified like any other.

The client does not hash: the callers check every digest (the converter
hashes each layer as it reads it, the pull checks manifests and configs),
which spares a second sha256 pass over every byte.

Why our own client rather than skopeo: on a 2-core host skopeo alone used
~1.8 cores to copy a 224 MiB image (Go 1.19's sha256 without SHA-NI, and
every blob written to disk before we could read it), 0.5-0.6 s; the same 7
blobs fetched in 7 threads with http.client and hashed with hashlib took
0.17-0.2 s and ~0.22 CPU-s. With the bytes in our hands as they arrive, the
conversion to EROFS reads them straight off the socket.

Credentials (fs/credentials.py: a docker-style auth.json, and the
credential helpers and stores it names) are looked up once per Registry,
when the registry first answers 401 (Docker Hub does so to anonymous pulls
too, for their token: configured credentials are then used, as docker
uses them); an identity token is traded for a pull token with the OAuth2
refresh-token grant. They
stay in the auth file, the helper and this object: never in an error, a log
line or an exception's message.

What it does not do: registries.conf (blocked registries, short-name
aliases): a pull goes to the registry its reference names, or first to the
mirrors images.mirrors lists for it (RegistryConfig.sources, fs/pull.py).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import ssl
import threading
import time
import warnings
from dataclasses import dataclass, field
from http.client import IncompleteRead
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import urllib3
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    InsecureRequestWarning,
    MaxRetryError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    ResponseError,
    SSLError,
)

from . import credentials, names
from .credentials import DOCKER_HUB_NAMES, Credentials, CredentialsError
from .httpstop import CONNECTION_CLASSES, Stop, shut_down

log = logging.getLogger(__name__)

# Largest manifest, index or config accepted (skopeo's bound too).
MAX_METADATA_BYTES = 4 << 20
MAX_TOKEN_BYTES = 1 << 20      # a token service's answer (a JWT and a few fields)
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MANIFEST_ACCEPT = (OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST)

MAX_REDIRECTS = 5
BACKOFF_S = 0.2               # first retry's wait; doubles with each retry
POOL_CONNECTIONS = 16         # kept-alive connections per host (a pull fetches up to 6-8 blobs at once)
DOCKER_HUB = "registry-1.docker.io"     # Docker Hub's API host
DOCKER_HUB_NAME = "docker.io"           # the name images.mirrors files Docker Hub's mirrors under
USER_AGENT = "dsecd"

# Only registries the operator listed in images.insecure_registries get an
# unverified TLS context; urllib3 would warn on every connection to them.
warnings.filterwarnings("ignore", category=InsecureRequestWarning)


class RegistryError(Exception):
    """code: a protocol error code (not_found, permission, io, unsupported, bad_request, busy)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RegistryConfig:
    """The [images] keys that say how registries are reached."""

    auth_file: str = ""                       # docker-style auth.json; "" = anonymous
    certs_dir: str = ""                       # <certs_dir>/<host[:port]>/*.crt, *.cert, *.key
    insecure: tuple[str, ...] = field(default_factory=tuple)   # host[:port]: TLS unverified, plain HTTP allowed
    retry_times: int = 2
    timeout_s: float = 60.0                   # per-read timeout of one request
    # A TCP connect that takes longer meets a host that is down or drops
    # packets (SYNs go out at 0, 1 and 3 s): 10 s lets three through.
    connect_timeout_s: float = 10.0
    # Retries of a connect that failed (refused, timed out); None: retry_times.
    # A mirror's pull takes none: the next source is the better retry.
    connect_retries: int | None = None
    # registry -> mirrors tried before it, in order, each host[:port][/path prefix]
    mirrors: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def from_section(cls, section: dict) -> RegistryConfig:
        return cls(auth_file=section["auth_file"], certs_dir=section["certs_dir"],
                   insecure=tuple(section["insecure_registries"]), retry_times=int(section["pull_retries"]),
                   mirrors=parse_mirrors(section["mirrors"]))

    def sources(self, registry: str, repository: str) -> list[Source]:
        """Where a pull of registry/repository looks, in order: the
        registry's mirrors, then the registry itself."""
        key = mirrors_key(registry)
        out = []
        for mirror in self.mirrors.get(key, ()):
            host, _, prefix = mirror.partition("/")
            out.append(Source(host, f"{prefix}/{repository}" if prefix else repository, mirror=True))
        return out + [Source(registry, repository)]


@dataclass(frozen=True)
class Source:
    """A registry host and the repository path a pull asks it for."""

    registry: str
    repository: str
    mirror: bool = False

    def __str__(self) -> str:
        return f"{'mirror ' if self.mirror else ''}{self.registry}"


_IPV6_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\](?::[0-9]+)?")


def _host_port(text: str) -> bool:
    """Whether `text` is host[:port]: a name, an IPv4 address or a bracketed
    IPv6 one, and a port of 1-65535."""
    if not (names.DOMAIN_RE.match(text) or _IPV6_HOST.fullmatch(text)):
        return False
    port = text.rpartition("]")[2].partition(":")[2] if text.startswith("[") else text.partition(":")[2]
    return not port or 1 <= int(port) <= 65535


def _mirror(text) -> bool:
    """Whether `text` is host[:port][/path prefix]."""
    if not isinstance(text, str):
        return False
    host, _, prefix = text.partition("/")
    return _host_port(host) and all(names.PATH_PART_RE.match(part) for part in prefix.split("/") if prefix)


def mirrors_key(registry: str) -> str:
    """The images.mirrors key of `registry`: lower case, Docker Hub's names as "docker.io"."""
    return DOCKER_HUB_NAME if registry in DOCKER_HUB_NAMES else registry.lower()


def parse_mirrors(table) -> dict[str, tuple[str, ...]]:
    """images.mirrors: {"docker.io": ["mirror.gcr.io", "harbor.lab/dockerhub"]}
    as {registry in lower case: (mirror, ...)}, Docker Hub's other names
    folded into "docker.io". ValueError, saying what to write, for anything
    else."""
    if not isinstance(table, dict):
        raise ValueError(f"images.mirrors must be a table of registry = [mirror, ...], not {table!r}")
    out: dict[str, tuple[str, ...]] = {}
    for registry, mirrors in table.items():
        key = mirrors_key(registry)
        if not _host_port(key):
            raise ValueError(f"images.mirrors: {registry!r} is not a registry's host[:port] (such as "
                             '"docker.io" or "registry.lab:5000")')
        if not isinstance(mirrors, list) or not all(_mirror(m) for m in mirrors):
            raise ValueError(f"images.mirrors: the mirrors of {registry!r} must be a list of host[:port][/path] "
                             f'(such as ["mirror.gcr.io", "10.0.0.5:5000/dockerhub"]), not {mirrors!r}')
        if any(m.partition("/")[0].lower() == key for m in mirrors):
            raise ValueError(f"images.mirrors: {registry!r} lists itself as its mirror; it is tried after "
                             "its mirrors anyway")
        out[key] = out.get(key, ()) + tuple(mirrors)
    return out


# ---------------------------------------------------------------- pure parts


def api_host(registry: str) -> str:
    """The host[:port] the v2 API of `registry` is served on."""
    return DOCKER_HUB if registry in ("docker.io", "index.docker.io") else registry


_CHALLENGE_PARAM = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))\s*(?:,|$)')


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """A WWW-Authenticate header as (scheme in lower case, {param: value}):
    'Bearer realm="https://auth.docker.io/token",service="registry.docker.io"'."""
    header = header.strip()
    scheme, _, rest = header.partition(" ")
    params: dict[str, str] = {}
    pos = 0
    while pos < len(rest):
        m = _CHALLENGE_PARAM.match(rest, pos)
        if not m or m.end() == pos:
            break
        quoted, bare = m.group(2), m.group(3)
        params[m.group(1).lower()] = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare
        pos = m.end()
    return scheme.lower(), params


def basic_header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def tls_files(certs_dir: str, registry: str) -> tuple[list[Path], list[tuple[Path, Path]]]:
    """The CAs (*.crt) and client certificates (*.cert with its *.key) in
    <certs_dir>/<registry>/, sorted; a *.cert without its *.key is an error."""
    if not certs_dir:
        return [], []
    d = Path(certs_dir) / registry
    if not d.is_dir():
        return [], []
    cas = sorted(d.glob("*.crt"))
    pairs = []
    for cert in sorted(d.glob("*.cert")):
        key = cert.with_suffix(".key")
        if not key.is_file():
            raise RegistryError("bad_request", f"{cert} has no key {key.name} beside it; put the client "
                                f"certificate's key there or remove the certificate")
        pairs.append((cert, key))
    return cas, pairs


def ssl_context(cfg: RegistryConfig, registry: str, insecure: bool) -> ssl.SSLContext:
    """System CAs plus <certs_dir>/<registry>/*.crt, its client certificate,
    and no verification for an insecure registry."""
    ctx = ssl.create_default_context()
    cas, pairs = tls_files(cfg.certs_dir, registry)
    try:
        for ca in cas:
            ctx.load_verify_locations(cafile=str(ca))
        for cert, key in pairs:
            ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as e:
        raise RegistryError("bad_request", f"the TLS files in {Path(cfg.certs_dir) / registry} cannot be "
                            f"loaded ({e}); fix or remove them") from None
    # urllib3 matches the host name itself (as it does with its own contexts),
    # also for a registry named by IP address, to which it sends no SNI name
    # that the ssl module's own check would need.
    ctx.check_hostname = False
    if insecure:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def certs_name(cfg: RegistryConfig, name: str, host: str) -> str:
    """The directory of <certs_dir> for a registry called `name` and served on
    `host`: <name> if there is one, else <host> (docker.io's is registry-1.docker.io)."""
    return host if cfg.certs_dir and not (Path(cfg.certs_dir) / name).is_dir() else name


def split_host(host: str, default_port: int = 443) -> tuple[str, int]:
    """host[:port] as (host in lower case, port)."""
    parts = urlsplit("//" + host)
    return (parts.hostname or host).lower(), parts.port or default_port


class HostTLSPoolManager(urllib3.PoolManager):
    """A PoolManager whose HTTPS pool for each host gets the SSL context
    `context_for(host, port)` picks, redirects included (urllib3 1.26's own
    PoolManager has one context for all hosts)."""

    def __init__(self, context_for, **kw):
        super().__init__(**kw)
        self._context_for = context_for

    def _new_pool(self, scheme, host, port, request_context=None):
        if scheme == "https":
            request_context = dict(self.connection_pool_kw if request_context is None else request_context)
            ctx = self._context_for(host, port)
            # cert_reqs and ca_certs given: Debian's urllib3 defaults them to CERT_REQUIRED
            # and its CA bundle, which would undo an insecure context and load the
            # bundle again into the context at every new connection.
            request_context.update(ssl_context=ctx, cert_reqs=ctx.verify_mode, ca_certs=None)
        pool = super()._new_pool(scheme, host, port, request_context)
        # Connections whose sockets a Stop can shut down mid-request (fs/httpstop.py).
        pool.ConnectionCls = CONNECTION_CLASSES[scheme]
        return pool


def _registry_code(body: bytes) -> str:
    """The first error code of a registry's JSON error body ("MANIFEST_UNKNOWN"), or ""."""
    try:
        errors = json.loads(body).get("errors") or []
        return " ".join(str(e.get("code", "")) for e in errors[:1] if isinstance(e, dict))
    except (ValueError, AttributeError):
        return ""


def _tls_advice(reason: str) -> str:
    low = reason.lower()
    if "certificate" in low or "self signed" in low or "self-signed" in low:
        return "; put the CA that signed this registry's certificate in images.certs_dir/<host[:port]>/"
    return ("; if the registry speaks plain HTTP, list it in images.insecure_registries "
            "(TLS failed: is it a TLS server?)")


# ---------------------------------------------------------------- the client


class Registry:
    """One registry host and one repository, for one pull; safe to use from several threads at once."""

    def __init__(self, cfg: RegistryConfig, registry: str, repository: str):
        self.cfg = cfg
        self.registry = registry
        self.repository = repository
        self.host = api_host(registry)
        # Looked up when the registry first answers 401: a registry that
        # serves without a challenge never runs a credential helper.
        self._creds: Credentials | None = None
        self._creds_looked_up = False
        self._creds_problem = ""               # why a helper gave none, for the error if the registry refuses
        self._insecure = registry in cfg.insecure or self.host in cfg.insecure
        self._scheme = None if self._insecure else "https"
        self._auth: str | None = None          # the Authorization header that worked last
        self._lock = threading.Lock()
        # Only the registry's own host gets its (possibly unverified) context; its
        # token realm and blob storage on other hosts are always verified.
        self._own_tls = ssl_context(cfg, certs_name(cfg, registry, self.host), self._insecure)
        self._other_tls: dict[tuple[str, int], ssl.SSLContext] = {}
        self._tls_lock = threading.Lock()
        timeout = urllib3.Timeout(connect=cfg.connect_timeout_s, read=cfg.timeout_s)
        self._http = HostTLSPoolManager(self._tls_for, num_pools=8, maxsize=POOL_CONNECTIONS, block=False,
                                        timeout=timeout)

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.clear()

    def _tls_for(self, host: str, port: int | None) -> ssl.SSLContext:
        """The SSL context of an HTTPS connection to host:port: the registry's
        own for its host, else one that verifies with the system CAs and the
        CAs of <certs_dir>/<host[:port]>/, never unverified."""
        key = (host.strip("[]").lower(), port or 443)        # an IPv6 host with or without brackets
        if key == split_host(self.host):
            return self._own_tls
        with self._tls_lock:
            ctx = self._other_tls.get(key)
            if ctx is None:
                name = host if key[1] == 443 else f"{host}:{key[1]}"
                ctx = self._other_tls[key] = ssl_context(self.cfg, name, insecure=False)
            return ctx

    def __repr__(self) -> str:                 # never the credentials
        return f"Registry({self.registry}/{self.repository})"

    # ------------------------------------------------------------ public

    def manifest(self, ref: str, stop: Stop | None = None) -> bytes:
        """The manifest or index `ref` (a tag or a sha256 digest) names, as
        served. `stop` set: RegistryError("conflict"), at once."""
        what = f"fetch the manifest of {self._name(ref)}"
        return self._fetch_small(f"manifests/{ref}", {"Accept": ", ".join(MANIFEST_ACCEPT)}, what,
                                 MAX_METADATA_BYTES, stop)

    def blob(self, digest: str, limit: int = MAX_METADATA_BYTES, stop: Stop | None = None) -> bytes:
        """A small blob (an image config), at most `limit` bytes; not checked
        against its digest. `stop` as for manifest()."""
        what = f"fetch the blob {digest} of {self._name()}"
        return self._fetch_small(f"blobs/{digest}", {}, what, limit, stop)

    def open_blob(self, digest: str, size: int, stop: Stop | None = None) -> BlobStream:
        """The `size` bytes of blob `digest` as they arrive. `stop`: an event
        that stops the stream once set, from its first request on (its
        abort() sets it)."""
        return BlobStream(self, digest, size, stop)

    # ------------------------------------------------------------ requests

    def _name(self, ref: str = "") -> str:
        sep = "@" if ref.startswith("sha256:") else ":"
        return f"{self.registry}/{self.repository}" + (f"{sep}{ref}" if ref else "")

    def _url(self, scheme: str, path: str) -> str:
        return f"{scheme}://{self.host}/v2/{self.repository}/{path}"

    def _fetch_small(self, path: str, headers: dict[str, str], what: str, limit: int,
                     stop: Stop | None) -> bytes:
        """_get and the body read whole, both under `stop`: once it is set,
        RegistryError("conflict"), whatever the request was waiting for."""
        try:
            with stop.requests() if stop is not None else contextlib.nullcontext():
                return self._read_small(self._get(path, headers, what, stop), limit, what)
        except (_Aborted, RegistryError):
            if stop is not None and stop.is_set():
                raise RegistryError("conflict", f"{what}: stopped") from None
            raise

    def _get(self, path: str, headers: dict[str, str], what: str,
             stop: Stop | None = None) -> urllib3.HTTPResponse:
        """A GET of /v2/<repository>/<path> answered 200 or 206, body not yet read
        (the caller reads and releases it): auth, retries and errors handled here.
        Once `stop` is set, raises _Aborted: before any further try, at once
        from a backoff, and from a request under way (its socket shut down,
        connecting or awaiting the answer)."""
        refreshed = False
        attempt = 0
        while True:
            if stop is not None and stop.is_set():
                raise _Aborted()
            auth = self._auth
            with stop.requests() if stop is not None else contextlib.nullcontext():
                resp = self._send(path, headers, auth, what, attempt, stop)
            if resp is None:                   # a connection error, retried
                attempt += 1
                continue
            status = resp.status
            if status in (200, 206):
                return resp
            body = self._drain(resp)
            if status == 401 and not refreshed:
                refreshed = True
                with stop.requests() if stop is not None else contextlib.nullcontext():
                    self._authenticate(resp.headers.get("WWW-Authenticate", ""), auth, what, stop)
                continue
            if (status >= 500 or status == 429) and attempt < self.cfg.retry_times:
                log.info("%s: the registry answered %d; retrying", what, status)
                self._backoff(attempt, stop)
                attempt += 1
                continue
            raise self._status_error(status, body, what)

    def _send(self, path: str, headers: dict[str, str], auth: str | None, what: str,
              attempt: int, stop: Stop | None = None) -> urllib3.HTTPResponse | None:
        """One request (redirects followed); None after a connection error worth retrying.
        An insecure registry is tried over HTTPS first, then, if that attempt
        fails in any way short of an answer (refused, timed out, TLS or protocol
        error, as docker and skopeo do), over plain HTTP; the scheme that answered
        is kept for the later requests."""
        hdrs = dict(headers)
        if auth:
            hdrs["Authorization"] = auth
        scheme = self._scheme
        try:
            if scheme is None:
                try:
                    resp = self._request(self._url("https", path), hdrs)
                    self._scheme = "https"
                    return resp
                except MaxRetryError as e:
                    if isinstance(e.reason, ResponseError):     # too many redirects: an answer all the same
                        raise
                    log.info("%s: no HTTPS with %s (%s); trying plain HTTP (it is in "
                             "images.insecure_registries)", what, self.host, _describe(e))
                resp = self._request(self._url("http", path), hdrs)
                self._scheme = "http"
                return resp
            return self._request(self._url(scheme, path), hdrs)
        except MaxRetryError as e:
            reason = e.reason if e.reason is not None else e
            if isinstance(reason, SSLError):
                raise RegistryError("io", f"{what}: TLS with {self.host} failed: {reason}"
                                    f"{_tls_advice(str(reason))}") from None
            if isinstance(reason, ResponseError):
                raise RegistryError("io", f"{what}: more than {MAX_REDIRECTS} redirects") from None
            return self._retry_or_raise(reason, what, attempt, stop)
        except (HTTPError, OSError) as e:
            return self._retry_or_raise(e, what, attempt, stop)

    def _request(self, url: str, headers: dict[str, str], form: str | None = None) -> urllib3.HTTPResponse:
        """A GET with its body unread, redirects followed, never with our
        Authorization to another host; or a POST of `form` (an identity token's
        grant), whose redirects are not followed: urllib3 would send the form,
        secret and all, to wherever it points. Any failure raised as urllib3
        raises it."""
        retries = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=MAX_REDIRECTS,
                                raise_on_redirect=True, raise_on_status=False,
                                remove_headers_on_redirect=["Authorization"])
        # A copy: on a redirect to another host urllib3 pops Authorization from
        # the dict it is given, and a retry would go out without it. Headers
        # given replace the pool's own, so the User-Agent goes in here.
        return self._http.request("GET" if form is None else "POST", url, body=form,
                                  headers={"User-Agent": USER_AGENT, **headers}, retries=retries,
                                  redirect=form is None, preload_content=False, decode_content=False,
                                  enforce_content_length=True)

    def _retry_or_raise(self, reason: BaseException, what: str, attempt: int,
                        stop: Stop | None = None) -> None:
        if stop is not None and stop.is_set():
            raise _Aborted()                   # the failure is the stop's shutdown of its socket
        retries = self.cfg.retry_times
        if self.cfg.connect_retries is not None and isinstance(reason, (NewConnectionError, ConnectTimeoutError)):
            retries = self.cfg.connect_retries
        if attempt < retries:
            log.info("%s: %s; retrying", what, _describe(reason))
            self._backoff(attempt, stop)
            return None
        raise RegistryError("io", f"{what}: cannot reach {self.host}: {_describe(reason)} "
                            f"(after {attempt + 1} tries); check the registry's name and that it is up") from None

    @staticmethod
    def _backoff(attempt: int, stop: Stop | None = None) -> None:
        """The wait before retry `attempt` + 1; over at once when `stop` is set."""
        delay = BACKOFF_S * (2 ** attempt)
        if stop is None:
            time.sleep(delay)
        else:
            stop.wait(delay)

    @staticmethod
    def _drain(resp: urllib3.HTTPResponse) -> bytes:
        """The (small) body of an answer that is not the one wanted, and the connection back in its pool."""
        try:
            body = resp.read(64 << 10, decode_content=False) or b""
        except (HTTPError, OSError):
            resp.close()
            return b""
        _put_back(resp)
        return body

    def _read_small(self, resp: urllib3.HTTPResponse, limit: int, what: str,
                    kind: str = "a manifest or config") -> bytes:
        done = False
        try:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise self._too_big(what, limit, kind)
            chunks, got = [], 0
            while got <= limit:
                piece = resp.read(min(1 << 20, limit + 1 - got), decode_content=False)
                if not piece:
                    break
                chunks.append(piece)
                got += len(piece)
            if got > limit:
                raise self._too_big(what, limit, kind)
            done = True
            return b"".join(chunks)
        except (HTTPError, OSError) as e:
            raise RegistryError("io", f"{what}: the connection to {self.host} failed while reading: "
                                f"{_describe(e)}") from None
        finally:
            if done:
                _put_back(resp)
            else:
                resp.close()

    @staticmethod
    def _too_big(what: str, limit: int, kind: str) -> RegistryError:
        size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
        return RegistryError("io", f"{what}: the server sent more than {size}, more than {kind} may have")

    def _status_error(self, status: int, body: bytes, what: str) -> RegistryError:
        code = _registry_code(body)
        answer = f"the registry answered {status}" + (f" {code}" if code else "")
        if status == 404:
            return RegistryError("not_found", f"{what}: {answer}; the registry has no such name, tag or "
                                 "digest: check the reference (a name that names no registry is looked up "
                                 "in images.default_registry)")
        if status in (401, 403):
            return self._credentials_refused(f"{what}: {answer}")
        if status == 429:
            return RegistryError("busy", f"{what}: {answer} (too many requests) after "
                                 f"{self.cfg.retry_times} retries; pull again later")
        return RegistryError("io", f"{what}: {answer}")

    def _credentials_refused(self, refusal: str) -> RegistryError:
        """A refusal ("<what>: the registry answered 401") with how we asked and what to do."""
        given = f"with the credentials of {self._creds.source}" if self._creds else "anonymously"
        if self._creds_problem:
            given += f": {self._creds_problem}"
        return RegistryError("permission", f"{refusal} ({given}); give credentials for {self.registry} in "
                             "images.auth_file (a docker-style auth.json, or a credential helper it names)")

    # ------------------------------------------------------------ auth

    def _authenticate(self, challenge: str, used: str | None, what: str, stop: Stop | None = None) -> None:
        """Answer a 401's challenge: the Authorization header all threads send from now on.
        A header other than `used` already in place was set by another thread: take it."""
        with self._lock:
            if stop is not None and stop.is_set():
                raise _Aborted()             # a thread that waited here for a helper the stop killed
            if self._auth != used:
                return
            scheme, params = parse_challenge(challenge)
            creds = self._credentials(stop)
            if scheme == "basic":
                if creds is None:
                    raise self._credentials_refused(f"{what}: the registry asks for a user and password")
                if creds.identity_token:
                    raise RegistryError("unsupported", f"{what}: the registry asks for a user and password, and "
                                        f"{creds.source} gives {self.registry} an identity token, which only a "
                                        "bearer token service takes; give a user and password for it instead")
                self._auth = basic_header(creds.user, creds.secret)
            elif scheme == "bearer" and params.get("realm"):
                self._auth = "Bearer " + self._fetch_token(params, creds, what, stop)
            else:
                raise RegistryError("unsupported", f"{what}: the registry asks for authentication this "
                                    f"client does not speak ({scheme or 'no WWW-Authenticate header'})")

    def _credentials(self, stop: Stop | None = None) -> Credentials | None:
        """This registry's credentials (fs/credentials.py), looked up once.
        A malformed auth file is the operator's to fix: an error. A helper
        that is missing or fails leaves the request anonymous, which a public
        image needs no more than; the refusal that may follow says why. A
        helper still running when `stop` is set is killed (_Aborted)."""
        if not self._creds_looked_up:
            try:
                self._creds = credentials.lookup(self.cfg.auth_file, self.registry, stop=stop)
            except CredentialsError as e:
                if e.code == "conflict":
                    raise _Aborted() from None       # looked up again by the next request that asks
                if e.code == "bad_request":
                    raise RegistryError("bad_request", str(e)) from None
                self._creds_problem = str(e)
                log.warning("%s: asking anonymously: %s", self._name(), e)
            self._creds_looked_up = True
        return self._creds

    def _fetch_token(self, params: dict[str, str], creds: Credentials | None, what: str,
                     stop: Stop | None = None) -> str:
        """A pull token from the challenge's realm: asked for with a GET
        (Basic auth with a user and password, or none), or, for an identity
        token, with the OAuth2 refresh-token grant (a form POST)."""
        realm = params["realm"]
        realm_url = urlsplit(realm)
        if realm_url.scheme not in ("http", "https"):
            raise RegistryError("io", f"{what}: the registry's token realm {realm!r} is not an http(s) URL")
        if creds and realm_url.scheme == "http" and not self._insecure:
            raise RegistryError("permission", f"{what}: the registry, reached over HTTPS, sends us for a token "
                                f"to {realm_url.netloc} over plain HTTP, which would carry the credentials of "
                                f"{creds.source} unencrypted; refused (list {self.host} in "
                                "images.insecure_registries only if that network is trusted)")
        query = {"scope": f"repository:{self.repository}:pull"}
        if params.get("service"):
            query = {"service": params["service"], **query}
        form = None
        if creds and creds.identity_token:
            url, headers = realm, {"Content-Type": "application/x-www-form-urlencoded"}
            form = urlencode({"grant_type": "refresh_token", "refresh_token": creds.secret, "client_id": USER_AGENT,
                              "access_type": "offline", **query})
        else:
            url = realm + ("&" if "?" in realm else "?") + urlencode(query)
            headers = {"Authorization": basic_header(creds.user, creds.secret)} if creds else {}
        service = f"the token service {realm_url.netloc}"
        resp = self._token_answer(url, headers, service, what, form, stop)
        if resp.status != 200:
            self._drain(resp)                  # its body never quoted: it may echo what we sent
            if resp.status in (401, 403):
                raise self._credentials_refused(f"{what}: {service} refused a pull token ({resp.status})")
            if form is not None and 300 <= resp.status < 400:
                raise RegistryError("io", f"{what}: {service} answered the identity token's grant with a "
                                    f"redirect ({resp.status}), which is not followed: it would carry the token "
                                    "to another address")
            raise RegistryError("io", f"{what}: {service} answered {resp.status}")
        body = self._read_small(resp, MAX_TOKEN_BYTES, f"{what}: {service}", "a token answer")
        try:
            doc = json.loads(body)
            token = doc.get("token") or doc.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise RegistryError("io", f"{what}: {service} sent no token")
        return token

    def _token_answer(self, url: str, headers: dict[str, str], service: str, what: str,
                      form: str | None = None, stop: Stop | None = None) -> urllib3.HTTPResponse:
        """The token service's answer to a GET (or a POST of `form`), its body
        unread; connection errors, 5xx and 429 retried. Once `stop` is set,
        raises _Aborted instead of trying again."""
        for attempt in range(self.cfg.retry_times + 1):
            if stop is not None and stop.is_set():
                raise _Aborted()
            try:
                resp = self._request(url, headers, form)
            except MaxRetryError as e:
                reason = e.reason if e.reason is not None else e
                if isinstance(reason, SSLError):
                    raise RegistryError("io", f"{what}: TLS with {service} failed: {reason}; put the CA that "
                                        "signed its certificate in images.certs_dir/<host[:port]>/") from None
                if isinstance(reason, ResponseError):
                    raise RegistryError("io", f"{what}: {service}: more than {MAX_REDIRECTS} redirects") from None
                error = reason
            except (HTTPError, OSError) as e:
                error = e
            else:
                if not (resp.status >= 500 or resp.status == 429) or attempt == self.cfg.retry_times:
                    return resp
                self._drain(resp)
                error = None
            if stop is not None and stop.is_set():
                raise _Aborted()
            if attempt == self.cfg.retry_times:
                raise RegistryError("io", f"{what}: cannot reach {service}: {_describe(error)}") from None
            self._backoff(attempt, stop)
        raise AssertionError("unreachable")


class _Aborted(Exception):
    """A request given up because its Stop was set (a BlobStream's abort, a pull's stop)."""


def _put_back(resp: urllib3.HTTPResponse) -> None:
    """A response's connection back into its pool if its body was read to the
    end, else closed (unread bytes would be taken for the next answer)."""
    if resp.closed:
        resp.release_conn()
    else:
        resp.close()


def _describe(e: BaseException) -> str:
    """A connection error in a few words, without urllib3's object reprs."""
    if isinstance(e, MaxRetryError) and e.reason is not None:
        e = e.reason
    if isinstance(e, NewConnectionError):
        text = str(e)
        m = re.search(r"Failed to establish a new connection: (.*)$", text)
        return m.group(1) if m else text
    if isinstance(e, ConnectTimeoutError):
        return "no connection in time (connect timeout)"
    if isinstance(e, (ReadTimeoutError, TimeoutError)):
        return "no answer in time (read timeout)"
    if isinstance(e, ProtocolError) and e.args:
        inner = e.args[-1]
        if isinstance(inner, BaseException):
            return f"connection broken ({type(inner).__name__}: {inner})"
    return f"{type(e).__name__}: {e}"


def _shut_down(resp: urllib3.HTTPResponse) -> None:
    """Shut down the socket under `resp` (httpstop.shut_down): a thread
    blocked reading it wakes with an end of file."""
    sock = getattr(getattr(resp, "_connection", None), "sock", None)
    if sock is None:                           # the connection already given back: its file's socket
        raw = getattr(getattr(getattr(resp, "_fp", None), "fp", None), "raw", None)
        sock = getattr(raw, "_sock", None)
    if sock is not None:
        shut_down(sock)


class BlobStream:
    """A blob's bytes as they arrive. read(n) -> bytes, b"" once `size` bytes were given.
    A connection that drops mid-body is asked again from where it stopped
    (Range: bytes=<bytes_read>-), up to the config's retry_times per blob.
    abort(), from any thread, stops it at once: no more reads, resumes or retries."""

    def __init__(self, reg: Registry, digest: str, size: int, stop: Stop | None = None):
        self._reg = reg
        self.digest = digest
        self.size = size
        self.bytes_read = 0
        self._resumes = 0
        self._what = f"download the blob {digest} of {reg._name()}"
        self._resp: urllib3.HTTPResponse | None = None
        self._aborted = stop if stop is not None else Stop()   # may be shared: a pull's stop
        self._lock = threading.Lock()          # self._resp, between the reading thread and abort()
        self._open()

    def __enter__(self) -> BlobStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def abort(self) -> None:
        """Stop the stream, from any thread, at any time: a read() blocked in
        another thread returns at once (its socket is shut down), a resume
        waiting out its backoff or its request (connecting, awaiting the
        answer's headers: fs/httpstop.py) at once too, and every read() from
        now on raises RegistryError("conflict", "... stopped")."""
        self._aborted.set()
        with self._lock:
            if self._resp is not None:
                _shut_down(self._resp)

    def _stopped(self) -> RegistryError:
        return RegistryError("conflict", f"{self._reg._name()}: blob {self.digest}: stopped")

    def _take_resp(self) -> urllib3.HTTPResponse | None:
        with self._lock:
            resp, self._resp = self._resp, None
        return resp

    def _open(self) -> None:
        start = self.bytes_read
        headers = {"Range": f"bytes={start}-"} if start else {}
        try:
            resp = self._reg._get(f"blobs/{self.digest}", headers, self._what, self._aborted)
        except _Aborted:
            raise self._stopped() from None
        try:
            if start and resp.status == 206:
                m = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
                if m is None or int(m.group(1)) != start:
                    raise RegistryError("io", f"{self._what}: asked for the bytes from {start}, the registry "
                                        f"sent {resp.headers.get('Content-Range') or 'no Content-Range'}")
            remaining = self.size - start
            length = resp.headers.get("Content-Length")
            if resp.status == 200:
                remaining = self.size
                self._skip(resp, start)
            if length is not None and length.isdigit() and int(length) > remaining:
                raise RegistryError("io", f"{self._what}: the registry sends {int(length)} bytes from byte "
                                    f"{start if resp.status == 206 else 0}, more than the {self.size} bytes of "
                                    "the blob's descriptor")
        except BaseException:
            resp.close()                       # its body unread: not back into the pool
            raise
        with self._lock:
            if not self._aborted.is_set():
                self._resp = resp
                return
        resp.close()
        raise self._stopped()

    def _skip(self, resp: urllib3.HTTPResponse, n: int) -> None:
        """Drop the first n bytes of a 200 answer to a Range request (the server ignored the Range)."""
        left = n
        try:
            while left:
                piece = _body(resp).read1(min(left, 1 << 20))
                if not piece:
                    break
                left -= len(piece)
        except (HTTPError, OSError, IncompleteRead) as e:
            raise RegistryError("io", f"{self._what}: truncated: the connection failed ({_describe(e)}) while "
                                f"skipping to byte {n} of an answer that ignored our Range request") from None
        if left:
            raise RegistryError("io", f"{self._what}: truncated: the answer ended before byte {n}, where the "
                                "download was to resume (the registry ignored our Range request)")

    def read(self, n: int = -1) -> bytes:
        """Up to n bytes, as many as have arrived (at least one), b"" at the
        blob's end; n < 0: all the rest."""
        if n is None or n < 0:
            chunks = []
            while piece := self.read(1 << 20):
                chunks.append(piece)
            return b"".join(chunks)
        if self._aborted.is_set():
            raise self._stopped()
        remaining = self.size - self.bytes_read
        if remaining <= 0 or n == 0:
            if remaining == 0 and self._resp is not None:
                self._check_end()
            return b""
        while True:
            resp = self._resp
            if resp is None:
                raise RegistryError("io", f"{self._what}: the stream is closed")
            try:
                # read1: what the socket has (one recv), not a wait for all n bytes
                piece = _body(resp).read1(min(n, remaining))
            except (IncompleteRead, OSError, ValueError) as e:
                piece, reason = b"", _describe(e)
            else:
                reason = "the connection ended early"
            if piece:
                self.bytes_read += len(piece)
                if self.bytes_read == self.size:
                    self._check_end()
                return piece
            if self._aborted.is_set():
                raise self._stopped()
            self._resume(reason)

    def _check_end(self) -> None:
        """After `size` bytes: the answer must end there; then its connection goes back to the pool."""
        resp = self._take_resp()
        if resp is None:
            return
        try:
            extra = _body(resp).read(1)
        except (IncompleteRead, OSError, ValueError):
            extra = b""
        if extra:
            resp.close()
            raise RegistryError("io", f"{self._what}: the registry sent more than the {self.size} bytes of "
                                "the blob's descriptor")
        _put_back(resp)

    def _resume(self, reason: str) -> None:
        resp = self._take_resp()
        if resp is not None:
            resp.close()                       # a broken connection: not back into the pool
        if self._resumes >= self._reg.cfg.retry_times:
            raise RegistryError("io", f"{self._what}: truncated: got {self.bytes_read} of {self.size} bytes "
                                f"({reason}; after {self._resumes} resumed requests)")
        self._resumes += 1
        log.info("%s: %s at byte %d of %d; asking for the rest", self._what, reason, self.bytes_read, self.size)
        Registry._backoff(self._resumes - 1, self._aborted)
        if self._aborted.is_set():
            raise self._stopped()
        self._open()

    def close(self) -> None:
        resp = self._take_resp()
        if resp is not None:
            resp.close()


def _body(resp: urllib3.HTTPResponse):
    """The http.client response under urllib3's: its read1() returns what has
    arrived, where urllib3 1.26's read(n) waits for all n bytes. BlobStream
    reads through it alone, so urllib3's own count of the body is never
    consulted (it would take the body read here for missing)."""
    return resp._fp
