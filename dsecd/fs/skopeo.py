"""skopeo, the registry client behind `dsec image pull`.

Every byte from a registry comes through Debian's skopeo: the v2 API, token
and basic auth from a docker-style auth.json, TLS with per-registry CA
directories, redirects to blob storage, retries, and the digest check of
every blob it writes. dsecd asks it for two things:

    inspect_raw   a manifest, an index or an image config, as the registry
                  serves it (`skopeo inspect --raw [--config]`)
    copy          one image manifest's blobs into an OCI layout directory
                  (`skopeo copy docker://repo@digest oci:DIR:TAG`), where a
                  blob appears under blobs/sha256/ only once complete and
                  checked, and a blob already there is not fetched again

Credentials stay in the auth file: they are never on a command line, in an
error or in a log. Why skopeo and not a client of our own: docs/architecture.md.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# What a registry may send as one manifest, index or config: skopeo's own bound.
MAX_METADATA_BYTES = 4 << 20
INSPECT_TIMEOUT_S = 300


class RegistryError(Exception):
    """code: a protocol error code (not_found, permission, io, unsupported, bad_request)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RegistryConfig:
    """The [images] keys that say how registries are reached."""

    skopeo: str = "skopeo"
    auth_file: str = ""                       # docker-style auth.json; "" = anonymous
    certs_dir: str = ""                       # <certs_dir>/<host[:port]>/*.crt, *.cert, *.key
    insecure: tuple[str, ...] = field(default_factory=tuple)   # host[:port] without TLS verification
    retry_times: int = 2

    @classmethod
    def from_section(cls, section: dict) -> RegistryConfig:
        return cls(skopeo=section["skopeo"], auth_file=section["auth_file"], certs_dir=section["certs_dir"],
                   insecure=tuple(section["insecure_registries"]), retry_times=int(section["pull_retries"]))


_FATAL = re.compile(r'level=fatal msg="(.*)"\s*$')


def _message(stderr: str) -> str:
    """skopeo's own words for what failed: the msg of its fatal log line, else its last line."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        m = _FATAL.search(line)
        if m:
            return m.group(1).replace('\\"', '"')
    return lines[-1] if lines else "no message"


def _code(message: str) -> str:
    low = message.lower()
    if any(w in low for w in ("unauthorized", "authentication required", "denied", "invalid username")):
        return "permission"
    if any(w in low for w in ("manifest unknown", "name unknown", "not found", "blob unknown")):
        return "not_found"
    return "io"


def _advice(code: str, message: str) -> str:
    """What to do about a failed registry request, as a clause to append to
    skopeo's words (which say what failed, not what to change)."""
    low = message.lower()
    if code == "not_found":
        return ("; the registry has no such name, tag or digest: check the reference (a name that "
                "names no registry is looked up in images.default_registry)")
    if code == "permission":
        return "; give credentials for this registry in images.auth_file (a docker-style auth.json)"
    if "server gave http response to https client" in low:
        return "; for a registry that speaks plain HTTP, list it in images.insecure_registries"
    if "x509" in low or "certificate" in low:
        return "; put the CA that signed this registry's certificate in images.certs_dir/<host[:port]>/"
    return ""


class Skopeo:
    def __init__(self, cfg: RegistryConfig):
        self.cfg = cfg

    def _source_args(self, registry: str, prefix: str) -> list[str]:
        """Auth, TLS and retry options for `registry` (prefix "" for inspect, "src-" for copy)."""
        cfg = self.cfg
        args = [f"--{prefix}authfile", cfg.auth_file] if cfg.auth_file else [f"--{prefix}no-creds"]
        if cfg.certs_dir and (Path(cfg.certs_dir) / registry).is_dir():
            args += [f"--{prefix}cert-dir", str(Path(cfg.certs_dir) / registry)]
        if registry in cfg.insecure:
            args.append(f"--{prefix}tls-verify=false")
        return args + ["--retry-times", str(cfg.retry_times)]

    def _check_auth_file(self) -> None:
        if self.cfg.auth_file and not os.access(self.cfg.auth_file, os.R_OK):
            raise RegistryError("bad_request", f"images.auth_file {self.cfg.auth_file} cannot be read; "
                                "fix the path in the config or make the file readable by root")

    def _run(self, argv: list[str], what: str, timeout: float) -> bytes:
        self._check_auth_file()
        try:
            proc = subprocess.run([self.cfg.skopeo, *argv], capture_output=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            raise RegistryError("unsupported", f"{self.cfg.skopeo} is not installed; image pull needs it "
                                "(apt-get install skopeo)") from None
        except subprocess.TimeoutExpired:
            raise RegistryError("io", f"{what}: no answer from the registry in {timeout:.0f} s") from None
        if proc.returncode != 0:
            msg = _message(proc.stderr.decode(errors="replace"))
            code = _code(msg)
            raise RegistryError(code, f"{what}: {msg}{_advice(code, msg)}")
        return proc.stdout

    def inspect_raw(self, registry: str, ref: str, config: bool = False) -> bytes:
        """The manifest (or, with `config`, the image config) of `ref`
        (registry/repo:tag or @digest), as served; not yet checked against any digest."""
        what = f"fetch the {'config' if config else 'manifest'} of {ref}"
        argv = ["inspect", "--raw", *(["--config"] if config else []), *self._source_args(registry, ""),
                f"docker://{ref}"]
        data = self._run(argv, what, INSPECT_TIMEOUT_S)
        if len(data) > MAX_METADATA_BYTES:
            raise RegistryError("io", f"{what}: the registry sent {len(data)} bytes, more than the "
                                f"{MAX_METADATA_BYTES >> 20} MiB a manifest or config may have")
        return data

    def copy(self, registry: str, ref: str, layout: Path, tag: str, log: Path) -> subprocess.Popen:
        """Start copying `ref`'s blobs into the OCI layout `layout` (made if
        missing); the caller watches the process and the directory. Layers
        are kept as the registry compressed them (no recompression). skopeo's
        messages go to the file `log` (a pipe nobody reads while it runs could fill)."""
        self._check_auth_file()
        argv = [self.cfg.skopeo, "copy", "--quiet", "--dest-oci-accept-uncompressed-layers",
                *self._source_args(registry, "src-"), f"docker://{ref}", f"oci:{layout}:{tag}"]
        with open(log, "wb") as err:
            try:
                return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
            except FileNotFoundError:
                raise RegistryError("unsupported", f"{self.cfg.skopeo} is not installed; image pull "
                                    "needs it (apt-get install skopeo)") from None

    @staticmethod
    def copy_error(log: Path, ref: str) -> RegistryError:
        """The error of a copy that failed, from its log."""
        try:
            text = log.read_text(errors="replace")
        except OSError:
            text = ""
        msg = _message(text)
        code = _code(msg)
        return RegistryError(code, f"download {ref}: {msg}{_advice(code, msg)}")
