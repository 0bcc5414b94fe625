"""Registries on loopback for the pull tests and the bench.

Registry: Debian's docker-registry (CNCF distribution) on 127.0.0.1:<free
port> with a generated config and a temp storage dir; plain HTTP, htpasswd
basic auth, or TLS with a test CA made by openssl. Stopped by its pid.

FakeRegistry: a small Python server speaking just enough of the v2 API
(manifests and blobs, GET and HEAD) for skopeo to pull from it, which can
lie: serve other bytes than a blob's digest, cut a blob short, slow one
down; and counts every blob GET.
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
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

REGISTRY_BIN = "/usr/bin/docker-registry"


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


class FakeRegistry:
    """A v2 registry from dicts, with knobs for hostile answers:

    lie[digest] = bytes     served instead of the blob (wrong content)
    cut.add(digest)         the blob's full Content-Length, half its bytes, then close
    slow[digest] = seconds  the blob trickles out over that long
    gets[digest]            blob GETs served
    """

    def __init__(self):
        self.manifests: dict[tuple[str, str], tuple[bytes, str]] = {}
        self.blobs: dict[str, bytes] = {}
        self.lie: dict[str, bytes] = {}
        self.cut: set[str] = set()
        self.slow: dict[str, float] = {}
        self.gets: Counter[str] = Counter()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeRegistry:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

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

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head: bool):
                path = self.path.split("?")[0]
                if path in ("/v2/", "/v2"):
                    return self._send(200, b"{}", {"Content-Type": "application/json"}, head)
                m = re.match(r"^/v2/(.+)/(manifests|blobs)/([^/]+)$", path)
                if not m:
                    return self._send(404, b'{"errors":[{"code":"NOT_FOUND"}]}', head=head)
                repo, kind, ref = m.groups()
                if kind == "manifests":
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
                fake.gets[ref] += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                body = data[: len(data) // 2] if ref in fake.cut else data
                delay = fake.slow.get(ref, 0.0)
                step = max(1, len(body) // 50) if delay else len(body) or 1
                try:
                    for i in range(0, len(body), step):
                        self.wfile.write(body[i:i + step])
                        if delay:
                            self.wfile.flush()
                            time.sleep(delay / 50)
                except (BrokenPipeError, ConnectionResetError):
                    return
                if ref in fake.cut:
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)

            def do_GET(self):
                self._route(False)

            def do_HEAD(self):
                self._route(True)

        return Handler
