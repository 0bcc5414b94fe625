"""Registries on loopback for the pull tests and the bench.

Registry: Debian's docker-registry (CNCF distribution) on 127.0.0.1:<free
port> with a generated config and a temp storage dir; plain HTTP, htpasswd
basic auth, or TLS with a test CA made by openssl. Stopped by its pid.

FakeRegistry: a small Python server speaking just enough of the v2 API
(manifests and blobs, GET and HEAD, Range on blobs) for skopeo and
dsecd.fs.registry to pull from it, which can lie: serve other bytes than a
blob's digest, cut a blob short (always, or its first K answers), slow one
down; can ask for bearer tokens from a /token endpoint of its own (tokens
that expire after N uses), and redirect blob GETs to a second server that
records whether it was sent an Authorization header; and counts every blob
GET and Range request.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from pathlib import Path

REGISTRY_BIN = "/usr/bin/docker-registry"
STALL_BYTES = 100              # what FakeRegistry sends of a stalled blob


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_tools() -> str | None:
    """Why the pull tests cannot run here, or None."""
    for tool in ("skopeo", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup.sh installs it)"
    if not os.access(REGISTRY_BIN, os.X_OK):
        return f"{REGISTRY_BIN} is not installed (apt-get install docker-registry; scripts/setup.sh does)"
    return None


def make_ca(d: Path, host: str = "127.0.0.1") -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for `host` (an IP): (ca.crt, server.crt, server.key)."""
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = d / "ca.key", d / "ca.crt"
    key, csr, crt, ext = d / "server.key", d / "server.csr", d / "server.crt", d / "ext.cnf"

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca_crt),
        "-days", "2", "-subj", "/CN=dsecd test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={host}")
    ext.write_text(f"subjectAltName=IP:{host}\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(crt), "-days", "2", "-extfile", str(ext))
    return ca_crt, crt, key


def credential_helper(bindir: Path, name: str, host: str, user: str, secret: str) -> Path:
    """docker-credential-<name> in `bindir`: answers `get` for `host` with
    these credentials (docker's helper protocol), and "credentials not
    found" for any other server URL."""
    bindir.mkdir(parents=True, exist_ok=True)
    path = bindir / f"docker-credential-{name}"
    answer = json.dumps({"ServerURL": host, "Username": user, "Secret": secret})
    path.write_text(f'#!/bin/sh\n[ "$1" = get ] || exit 9\nread url\n'
                    f'if [ "$url" = "{host}" ]; then echo \'{answer}\'; exit 0; fi\n'
                    'echo "credentials not found in native keychain"; exit 1\n')
    path.chmod(0o700)
    return path


def auth_json(path: Path, host: str, user: str, password: str) -> Path:
    """A docker-style auth.json with one registry's credentials."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": token}}}))
    path.chmod(0o600)
    return path


class Registry:
    """docker-registry on loopback. `auth` = (user, password) for htpasswd basic
    auth; `tls` serves HTTPS with a test CA (self.ca)."""

    def __init__(self, tmp: Path, auth: tuple[str, str] | None = None, tls: bool = False):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.auth, self.tls = auth, tls
        self.log = self.tmp / "registry.log"
        self.ca: Path | None = None
        self.proc: subprocess.Popen | None = None

    def start(self) -> Registry:
        cfg = ["version: 0.1", "log:", "  level: info", "  accesslog:", "    disabled: false",
               "storage:", "  filesystem:", f"    rootdirectory: {self.tmp / 'data'}",
               "  delete:", "    enabled: true", "http:", f"  addr: {self.host}"]
        if self.tls:
            self.ca, crt, key = make_ca(self.tmp / "tls")
            cfg += ["  tls:", f"    certificate: {crt}", f"    key: {key}"]
        if self.auth:
            user, password = self.auth
            out = subprocess.run(["htpasswd", "-Bbn", user, password], capture_output=True, text=True,
                                 check=True, timeout=30).stdout
            (self.tmp / "htpasswd").write_text(out)
            cfg += ["auth:", "  htpasswd:", "    realm: dsecd-test", f"    path: {self.tmp / 'htpasswd'}"]
        (self.tmp / "config.yml").write_text("\n".join(cfg) + "\n")
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(self.tmp / "config.yml")],
                                     stdout=logf, stderr=logf, stdin=subprocess.DEVNULL)
        logf.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"docker-registry did not listen on {self.host}: {self.log.read_text()[-2000:]}")

    def push_args(self) -> list[str]:
        """skopeo options to push here."""
        args = []
        if self.tls:
            certs = self.tmp / "push-certs"
            certs.mkdir(exist_ok=True)
            shutil.copy(self.ca, certs / "ca.crt")
            args += ["--dest-cert-dir", str(certs), "--dest-tls-verify=true"]
        if self.auth:
            args += ["--dest-creds", f"{self.auth[0]}:{self.auth[1]}"]
        return args

    def blob_gets(self, digest: str) -> int:
        """GETs of a blob in the access log (what was downloaded, not HEAD probes)."""
        pattern = re.compile(rf'"GET /v2/[^ ]*/blobs/{re.escape(digest)} ')
        return sum(1 for line in self.log.read_text(errors="replace").splitlines() if pattern.search(line))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 (keep-alive), no access log on stderr."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    """Says nothing when a client goes away mid-answer (the tests abort and
    cancel downloads on purpose); any other handler error is printed."""

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionError, ssl.SSLError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class LoopbackServer:
    """A threading HTTP server on 127.0.0.1:<free port> (self.host) answering
    with `handler`, in a thread from start() to stop()."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler]):
        self.server = _QuietServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def serve_tls(self, cert: Path, key: Path) -> None:
        """HTTPS instead of HTTP (before start()), with this certificate and key."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeRegistry(LoopbackServer):
    """A v2 registry from dicts, with knobs for hostile answers:

    lie[digest] = bytes     served instead of the blob (wrong content)
    cut.add(digest)         the blob's full Content-Length, half its bytes, then close
    cut_first[digest] = K   the same, for the blob's first K GETs only (later ones whole)
    slow[digest] = seconds  the blob trickles out over that long
    stall.add(digest)       the blob's headers and first STALL_BYTES, then nothing until stop()
    stall_ranges.add(digest)   a Range GET of the blob (a resume) gets no answer until stop()
    stall_manifests = "headers" / "body"   manifest GETs get no answer / no more than a
                            byte of their body until stop()
    gets[digest]            blob GETs served
    ranges[digest]          blob GETs with a Range header (answered 206 + Content-Range)
    ignore_range = True     Range headers ignored (200 with the whole blob)
    fail[digest] = [503, 429]  the blob's next GETs answered with these statuses, in turn
    use_tokens(...)         bearer tokens required (see there); with refresh_token=, also
                            issued to a POST of the OAuth2 refresh-token grant (token_posts)
    token_realm = url       the realm the 401s name instead of this server's /token
    token_body = bytes      what /token answers instead of a token
    redirect_blobs()        blob GETs answered 307 to a second server (see there)
    """

    def __init__(self):
        self.manifests: dict[tuple[str, str], tuple[bytes, str]] = {}
        self.blobs: dict[str, bytes] = {}
        self.lie: dict[str, bytes] = {}
        self.cut: set[str] = set()
        self.cut_first: dict[str, int] = {}
        self.slow: dict[str, float] = {}
        self.stall: set[str] = set()
        self.stall_ranges: set[str] = set()
        self.stall_manifests = ""                   # "headers" or "body": where manifest GETs stall
        self.unstalled = threading.Event()
        self.gets: Counter[str] = Counter()
        self.ranges: Counter[str] = Counter()
        self.ignore_range = False
        self.fail: dict[str, list[int]] = {}
        self.tokens: dict[str, int | None] = {}     # token -> uses left (None: no limit)
        self.token_gets = 0                          # GETs of /token that issued a token
        self.token_creds: tuple[str, str] | None = None
        self.refresh_token: str | None = None
        self.token_posts: list[dict] = []            # the forms POSTed to /token
        self.token_uses: int | None = None
        self.token_required = False
        self.token_realm: str | None = None
        self.token_body: bytes | None = None
        self.blob_store: BlobStore | None = None
        self._lock = threading.Lock()
        super().__init__(self._handler())

    def stop(self) -> None:
        self.unstalled.set()
        super().stop()
        if self.blob_store is not None:
            self.blob_store.stop()

    def use_tokens(self, creds: tuple[str, str] | None = None, uses: int | None = None,
                   refresh_token: str | None = None) -> None:
        """Every /v2/ request needs `Authorization: Bearer <token>`; without one it
        gets 401 + `WWW-Authenticate: Bearer realm="http://<host>/token",...`. The
        /token endpoint issues tokens to GETs (with Basic `creds` only, when
        given), and, with `refresh_token`, to a POSTed form of the OAuth2
        refresh-token grant holding it; each token good for `uses` requests
        (None: no limit)."""
        self.token_required, self.token_creds, self.token_uses = True, creds, uses
        self.refresh_token = refresh_token

    def redirect_blobs(self) -> BlobStore:
        """Blob GETs answered 307 to a second server (another port) serving the
        same blobs, which records the Authorization header of each GET."""
        if self.blob_store is None:
            self.blob_store = BlobStore(self).start()
        return self.blob_store

    def _issue_token(self, authorization: str | None) -> str | None:
        if self.token_creds is not None:
            user, password = self.token_creds
            want = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
            if authorization != want:
                return None
        return self._new_token()

    def _token_for_grant(self, form: dict) -> str | None:
        """A token for a POSTed OAuth2 refresh-token grant, if it holds our refresh token."""
        with self._lock:
            self.token_posts.append(form)
        if self.refresh_token is None or form.get("grant_type") != "refresh_token" or \
                form.get("refresh_token") != self.refresh_token:
            return None
        return self._new_token()

    def _new_token(self) -> str:
        with self._lock:
            token = f"t{len(self.tokens)}-{os.urandom(6).hex()}"
            self.tokens[token] = self.token_uses
            self.token_gets += 1
        return token

    def _token_ok(self, authorization: str | None) -> bool:
        """A valid bearer token, one of its uses taken."""
        if not authorization or not authorization.startswith("Bearer "):
            return False
        token = authorization[len("Bearer "):]
        with self._lock:
            if token not in self.tokens:
                return False
            left = self.tokens[token]
            if left is None:
                return True
            if left <= 0:
                return False
            self.tokens[token] = left - 1
            return True

    def _take_failure(self, digest: str) -> int | None:
        """The status this GET of `digest` is to be answered with instead, if any."""
        with self._lock:
            statuses = self.fail.get(digest)
            return statuses.pop(0) if statuses else None

    def _take_cut(self, digest: str) -> bool:
        """Whether this GET of `digest` is to be cut short."""
        if digest in self.cut:
            return True
        with self._lock:
            left = self.cut_first.get(digest, 0)
            if left > 0:
                self.cut_first[digest] = left - 1
                return True
        return False

    def put_manifest(self, repo: str, tag: str | None, data: bytes, media_type: str) -> str:
        from image_kit import sha256

        digest = sha256(data)
        self.manifests[(repo, digest)] = (data, media_type)
        if tag:
            self.manifests[(repo, tag)] = (data, media_type)
        return digest

    def put_layout(self, repo: str, tag: str, layout, desc: dict) -> None:
        """Serve a Layout's blobs, and `desc` (a manifest or index of it) under `tag`."""
        for f in (layout.root / "blobs" / "sha256").iterdir():
            self.blobs["sha256:" + f.name] = f.read_bytes()
        data = self.blobs[desc["digest"]]
        self.put_manifest(repo, tag, data, desc["mediaType"])
        for blob in self.blobs.values():           # child manifests of an index, by digest
            try:
                doc = json.loads(blob)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("mediaType", "").endswith(("manifest.v1+json", "index.v1+json")):
                self.put_manifest(repo, None, blob, doc["mediaType"])

    def _handler(self):
        fake = self

        class Handler(QuietHandler):
            def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    try:
                        self.wfile.write(body)
                    except (BrokenPipeError, ConnectionResetError):    # a client that stopped reading
                        self.close_connection = True

            def _route(self, head: bool):
                path = self.path.split("?")[0]
                if path == "/token" and fake.token_required:
                    token = fake._issue_token(self.headers.get("Authorization"))
                    if token is None:
                        return self._send(401, b'{"details":"bad credentials"}', head=head)
                    if fake.token_body is not None:
                        return self._send(200, fake.token_body, {"Content-Type": "application/json"}, head)
                    return self._send(200, json.dumps({"token": token}).encode(),
                                      {"Content-Type": "application/json"}, head)
                if fake.token_required and not fake._token_ok(self.headers.get("Authorization")):
                    realm = f'Bearer realm="{fake.token_realm or f"http://{fake.host}/token"}",service="fake-registry"'
                    m = re.match(r"^/v2/(.+)/(?:manifests|blobs)/", path)
                    if m:
                        realm += f',scope="repository:{m.group(1)}:pull"'
                    return self._send(401, b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication '
                                      b'required"}]}', {"Content-Type": "application/json",
                                                        "WWW-Authenticate": realm}, head)
                if path in ("/v2/", "/v2"):
                    return self._send(200, b"{}", {"Content-Type": "application/json"}, head)
                m = re.match(r"^/v2/(.+)/(manifests|blobs)/([^/]+)$", path)
                if not m:
                    return self._send(404, b'{"errors":[{"code":"NOT_FOUND"}]}', head=head)
                repo, kind, ref = m.groups()
                if kind == "manifests":
                    if fake.stall_manifests == "headers":
                        fake.unstalled.wait(60)
                        self.close_connection = True
                        return None
                    if fake.stall_manifests == "body":
                        self.send_response(200)
                        self.send_header("Content-Length", "1000")
                        self.end_headers()
                        self.wfile.write(b"{")
                        self.wfile.flush()
                        fake.unstalled.wait(60)
                        self.close_connection = True
                        return None
                    found = fake.manifests.get((repo, ref))
                    if found is None:
                        return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":'
                                          b'"manifest unknown"}]}', {"Content-Type": "application/json"}, head)
                    data, media = found
                    from image_kit import sha256

                    return self._send(200, data, {"Content-Type": media, "Docker-Content-Digest": sha256(data)},
                                      head)
                if ref not in fake.blobs:
                    return self._send(404, b'{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown"}]}',
                                      {"Content-Type": "application/json"}, head)
                data = fake.lie.get(ref, fake.blobs[ref])
                if head:
                    return self._send(200, data, {"Content-Type": "application/octet-stream"}, head=True)
                status = fake._take_failure(ref)
                if status is not None:
                    fake.gets[ref] += 1
                    return self._send(status, b'{"errors":[{"code":"UNAVAILABLE"}]}',
                                      {"Content-Type": "application/json"})
                if fake.blob_store is not None:
                    return self._send(307, b"", {"Location": f"http://{fake.blob_store.host}/store/{ref}"})
                serve_blob(self, fake, ref, data)

            def do_GET(self):
                self._route(False)

            def do_HEAD(self):
                self._route(True)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                if self.path.split("?")[0] != "/token" or not fake.token_required:
                    return self._send(404, b'{"errors":[{"code":"NOT_FOUND"}]}')
                token = fake._token_for_grant(dict(urllib.parse.parse_qsl(body)))
                if token is None:
                    return self._send(401, b'{"error":"invalid_grant"}', {"Content-Type": "application/json"})
                return self._send(200, json.dumps({"access_token": token, "expires_in": 300}).encode(),
                                  {"Content-Type": "application/json"})

        return Handler


def serve_blob(handler: http.server.BaseHTTPRequestHandler, fake: FakeRegistry, ref: str, data: bytes) -> None:
    """A blob GET's answer, with FakeRegistry's knobs: Range (206), cut, slow."""
    fake.gets[ref] += 1
    start = 0
    m = re.match(r"^bytes=(\d+)-$", handler.headers.get("Range", ""))
    if m:
        fake.ranges[ref] += 1
        if ref in fake.stall_ranges:
            fake.unstalled.wait(60)
            handler.close_connection = True
            return
        if not fake.ignore_range:
            start = int(m.group(1))
    if m and not fake.ignore_range:
        if start >= len(data):
            handler.send_response(416)
            handler.send_header("Content-Range", f"bytes */{len(data)}")
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        handler.send_response(206)
        handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
    else:
        handler.send_response(200)
    data = data[start:]
    handler.send_header("Content-Type", "application/octet-stream")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if ref in fake.stall:
        try:
            handler.wfile.write(data[:STALL_BYTES])
        except (BrokenPipeError, ConnectionResetError):
            return
        fake.unstalled.wait(60)
        handler.close_connection = True
        return
    cut = fake._take_cut(ref)
    body = data[: len(data) // 2] if cut else data
    delay = fake.slow.get(ref, 0.0)
    step = max(1, len(body) // 50) if delay else len(body) or 1
    try:
        for i in range(0, len(body), step):
            handler.wfile.write(body[i:i + step])
            if delay:
                handler.wfile.flush()
                time.sleep(delay / 50)
    except (BrokenPipeError, ConnectionResetError):
        return
    if cut:
        handler.close_connection = True
        handler.wfile.flush()
        handler.connection.shutdown(socket.SHUT_RDWR)


class BlobStore(LoopbackServer):
    """Where FakeRegistry.redirect_blobs() sends blob GETs: the same blobs on
    another port, GET /store/<digest>. authorization[i] is the Authorization
    header of its i-th GET (None when absent)."""

    def __init__(self, fake: FakeRegistry):
        self.fake = fake
        self.authorization: list[str | None] = []
        super().__init__(self._handler())

    def _handler(self):
        store = self

        class Handler(QuietHandler):
            def do_GET(self):
                store.authorization.append(self.headers.get("Authorization"))
                ref = self.path.split("?")[0].removeprefix("/store/")
                if ref not in store.fake.blobs:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                serve_blob(self, store.fake, ref, store.fake.lie.get(ref, store.fake.blobs[ref]))

        return Handler
