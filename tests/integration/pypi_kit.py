"""A test-owned package index: wheels built here and a PEP 503 simple index.

build_wheel() writes a pure-Python wheel with zipfile (a module and its
dist-info: METADATA, WHEEL, RECORD), so nothing is fetched from anywhere.
IndexServer is Python's http.server on a thread, its listening socket made
inside a test-owned netns (a socket stays in the netns it was made in), plain
HTTP on the given port. It serves

    /simple/<project>/     links to http://<files host>:<port>/packages/<wheel>#sha256=<hex>
    /packages/<wheel>      the wheel's bytes

where <files host> is `files_host[Host]` for the Host header the index was
asked with (pypi.org -> files.pythonhosted.org), else that Host itself. Every
request is recorded (client address, local address, Host, path, status).
stop() shuts the server down and closes its socket; fixtures call it in
finalizers.
"""

from __future__ import annotations

import base64
import hashlib
import html
import http.server
import re
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dsecd.net.plumbing import in_netns

EPOCH = (2020, 1, 1, 0, 0, 0)       # fixed member times: the same inputs give the same wheel bytes


def normalize(name: str) -> str:
    """PEP 503's normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Wheel:
    project: str
    version: str
    path: Path
    sha256: str

    @property
    def filename(self) -> str:
        return self.path.name


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def build_wheel(dest: Path, project: str, version: str) -> Wheel:
    """<dist>-<version>-py3-none-any.whl in `dest`: module <dist>.py and its dist-info."""
    dist = re.sub(r"[-_.]+", "_", project).lower()
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}.py": f'VERSION = "{version}"\n'.encode(),
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
                             "Summary: a test wheel\n").encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: dsecd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            zi = zipfile.ZipInfo(name, EPOCH)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            z.writestr(zi, data)
    return Wheel(project, version, path, hashlib.sha256(path.read_bytes()).hexdigest())


@dataclass
class Hit:
    client: str
    local: str
    host: str
    path: str
    status: int


class IndexServer:
    def __init__(self, netns_path: str, wheels: list[Wheel], port: int = 443,
                 files_host: dict[str, str] | None = None, bind: str = ""):
        self.port = port
        self.wheels = list(wheels)
        self.files_host = dict(files_host or {})
        self.hits: list[Hit] = []
        self._lock = threading.Lock()
        handler = _handler(self)
        with in_netns(netns_path):
            self.httpd = http.server.ThreadingHTTPServer((bind, port), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                       daemon=True)
        self.thread.start()

    def index_html(self, project: str, host: str) -> bytes | None:
        files = self.files_host.get(host, host)
        links = [f'<a href="http://{files}:{self.port}/packages/{w.filename}#sha256={w.sha256}">'
                 f"{html.escape(w.filename)}</a><br/>"
                 for w in self.wheels if normalize(w.project) == project]
        if not links:
            return None
        return ("<!DOCTYPE html>\n<html><head><title>Links for " + html.escape(project) + "</title></head>"
                "<body>\n" + "\n".join(links) + "\n</body></html>\n").encode()

    def wheel(self, filename: str) -> Wheel | None:
        return next((w for w in self.wheels if w.filename == filename), None)

    def record(self, hit: Hit) -> None:
        with self._lock:
            self.hits.append(hit)

    def requests(self) -> list[Hit]:
        with self._lock:
            return list(self.hits)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def _handler(server: IndexServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:       # noqa: N802 (http.server's name)
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0].lower()
            path = self.path.split("?", 1)[0]
            body, ctype = None, "text/html; charset=utf-8"
            m = re.fullmatch(r"/simple/([^/]+)/", path)
            if m:
                body = server.index_html(normalize(m.group(1)), host)
            elif path.startswith("/packages/"):
                w = server.wheel(path.removeprefix("/packages/"))
                if w is not None:
                    body, ctype = w.path.read_bytes(), "application/octet-stream"
            status = 200 if body is not None else 404
            server.record(Hit(self.client_address[0], self.connection.getsockname()[0], host, path, status))
            body = body if body is not None else b"not found\n"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    return Handler
