"""The registry client's pure parts (dsecd/fs/registry.py): WWW-Authenticate
challenges, the TLS files of a certs dir, the HTTP fallback of an insecure
registry and TLS per host, credentials from helpers and identity tokens, and
errors and log lines that never carry a password (through a stubbed
transport). Where credentials come from: test_credentials.py."""

import base64
import io
import json
import logging
import ssl
import threading
import time
import tomllib
import traceback
from importlib import resources
from urllib.parse import parse_qsl

import pytest
import urllib3
from urllib3.exceptions import (
    ConnectTimeoutError,
    MaxRetryError,
    NewConnectionError,
    ProtocolError,
    SSLError,
)

from dsecd.fs import registry as rc
from dsecd.fs.httpstop import Stop

SECRET = "s3cr3t-Pa55"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize("header, scheme, params", [
    ('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
     'scope="repository:library/python:pull"',
     "bearer", {"realm": "https://auth.docker.io/token", "service": "registry.docker.io",
                "scope": "repository:library/python:pull"}),
    ('Bearer realm="https://ghcr.io/token", service="ghcr.io", scope="repository:a/b:pull,push"',
     "bearer", {"realm": "https://ghcr.io/token", "service": "ghcr.io", "scope": "repository:a/b:pull,push"}),
    ('Basic realm="dsecd-test"', "basic", {"realm": "dsecd-test"}),
    ("basic realm=plain,charset=UTF-8", "basic", {"realm": "plain", "charset": "UTF-8"}),
    ('Bearer realm="http://h/t?a=1",error="invalid_token",x="a \\"quoted\\" word"',
     "bearer", {"realm": "http://h/t?a=1", "error": "invalid_token", "x": 'a "quoted" word'}),
    ("", "", {}),
])
def test_parse_challenge(header, scheme, params):
    assert rc.parse_challenge(header) == (scheme, params)


def test_api_host_of_docker_hub():
    assert rc.api_host("docker.io") == "registry-1.docker.io"
    assert rc.api_host("index.docker.io") == "registry-1.docker.io"
    assert rc.api_host("ghcr.io") == "ghcr.io"
    assert rc.api_host("127.0.0.1:5000") == "127.0.0.1:5000"


def test_tls_files_of_a_certs_dir(tmp_path):
    d = tmp_path / "certs" / "reg.example.com:5443"
    d.mkdir(parents=True)
    for name in ("b.crt", "a.crt", "client.cert", "client.key", "notes.txt"):
        (d / name).write_text("x")
    cas, pairs = rc.tls_files(str(tmp_path / "certs"), "reg.example.com:5443")
    assert [p.name for p in cas] == ["a.crt", "b.crt"]
    assert [(c.name, k.name) for c, k in pairs] == [("client.cert", "client.key")]
    assert rc.tls_files(str(tmp_path / "certs"), "other.example.com") == ([], [])
    assert rc.tls_files("", "reg.example.com:5443") == ([], [])
    (d / "lonely.cert").write_text("x")
    with pytest.raises(rc.RegistryError) as e:
        rc.tls_files(str(tmp_path / "certs"), "reg.example.com:5443")
    assert e.value.code == "bad_request" and "lonely.key" in str(e.value)


def test_unloadable_ca_is_a_bad_request_naming_the_dir(tmp_path):
    d = tmp_path / "reg:1"
    d.mkdir()
    (d / "ca.crt").write_text("not a certificate")
    with pytest.raises(rc.RegistryError) as e:
        rc.ssl_context(rc.RegistryConfig(certs_dir=str(tmp_path)), "reg:1", False)
    assert e.value.code == "bad_request" and str(d) in str(e.value)


def test_ssl_context_verifies_unless_insecure():
    cfg = rc.RegistryConfig()
    ctx = rc.ssl_context(cfg, "reg:1", False)
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    ctx = rc.ssl_context(cfg, "reg:1", True)
    assert ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname


def test_config_from_the_default_images_section():
    section = tomllib.loads(resources.files("dsecd").joinpath("default.toml").read_text())["images"]
    cfg = rc.RegistryConfig.from_section(section)
    assert cfg == rc.RegistryConfig(retry_times=section["pull_retries"])
    cfg = rc.RegistryConfig.from_section({**section, "insecure_registries": ["h:1"], "auth_file": "/a.json"})
    assert cfg.insecure == ("h:1",) and cfg.auth_file == "/a.json"


@pytest.mark.parametrize("status, body, code", [
    (401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', "permission"),
    (403, b'{"errors":[{"code":"DENIED"}]}', "permission"),
    (404, b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}', "not_found"),
    (429, b"", "busy"),
    (500, b"oops", "io"),
])
def test_status_errors_say_what_and_what_to_do(status, body, code):
    with rc.Registry(rc.RegistryConfig(), "reg.example.com", "team/app") as reg:
        err = reg._status_error(status, body, "fetch the manifest of reg.example.com/team/app:v1")
    assert err.code == code
    text = str(err)
    assert "reg.example.com/team/app:v1" in text and str(status) in text
    if code == "permission":
        assert "images.auth_file" in text
    if code == "not_found":
        assert "MANIFEST_UNKNOWN" in text and "images.default_registry" in text


@pytest.mark.parametrize("reason, advice", [
    ("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate in certificate chain",
     "images.certs_dir/<host[:port]>/"),
    ("[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:992)", "images.insecure_registries"),
])
def test_tls_advice(reason, advice):
    assert advice in rc._tls_advice(reason)


# ---------------------------------------------------------------- through a stubbed transport


def answer(status: int, body: bytes = b"", headers: dict | None = None) -> urllib3.HTTPResponse:
    return urllib3.HTTPResponse(body=io.BytesIO(body), status=status, preload_content=False,
                                headers={"Content-Length": str(len(body)), **(headers or {})})


class Transport:
    """Stands in for Registry._http.request: `serve(url, headers)` answers each
    GET (an HTTPResponse) or raises what urllib3 would; every call recorded."""

    def __init__(self, serve, mutable_headers: bool = False):
        self.serve = serve
        self.mutable_headers = mutable_headers      # serve() gets the dict urllib3 would, not a copy
        self.calls: list[tuple[str, dict]] = []
        self.posted: list[tuple[str, str]] = []     # (url, form) of each POST

    def request(self, method, url, headers=None, body=None, **kw):
        self.calls.append((url, dict(headers or {})))
        if method == "POST":
            self.posted.append((url, body))
        return self.serve(url, headers if self.mutable_headers else dict(headers or {}))


def stubbed(monkeypatch, reg: rc.Registry, serve, mutable_headers: bool = False) -> Transport:
    transport = Transport(serve, mutable_headers)
    monkeypatch.setattr(reg._http, "request", transport.request)
    monkeypatch.setattr(rc, "BACKOFF_S", 0.0)
    return transport


def unreachable(url: str, reason: Exception) -> MaxRetryError:
    return MaxRetryError(None, url, reason)


HTTPS_FAILURES = {
    "refused": NewConnectionError(None, "Failed to establish a new connection: [Errno 111] Connection refused"),
    "connect timeout": ConnectTimeoutError(None, "Connection to registry.lab timed out. (connect timeout=60)"),
    "tls": SSLError("[SSL: WRONG_VERSION_NUMBER] wrong version number"),
    "protocol": ProtocolError("Connection aborted.", ConnectionResetError(104, "Connection reset by peer")),
}


@pytest.mark.parametrize("failure", sorted(HTTPS_FAILURES))
def test_insecure_registry_falls_back_to_http_on_any_https_failure(monkeypatch, failure):
    manifest = b'{"schemaVersion":2}'

    def serve(url, headers):
        if url.startswith("https://"):
            raise unreachable(url, HTTPS_FAILURES[failure])
        return answer(200, manifest, {"Content-Type": rc.OCI_MANIFEST})

    with rc.Registry(rc.RegistryConfig(insecure=("registry.lab",), retry_times=0), "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, serve)
        assert reg.manifest("v1") == manifest
        assert reg._scheme == "http"
        assert reg.manifest("v1") == manifest          # the scheme that answered is kept
    assert [url for url, _ in transport.calls] == ["https://registry.lab/v2/a/b/manifests/v1",
                                                   "http://registry.lab/v2/a/b/manifests/v1",
                                                   "http://registry.lab/v2/a/b/manifests/v1"]


def test_secure_registry_never_falls_back_to_http(monkeypatch):
    def serve(url, headers):
        raise unreachable(url, HTTPS_FAILURES["refused"])

    with rc.Registry(rc.RegistryConfig(retry_times=1), "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, serve)
        with pytest.raises(rc.RegistryError) as e:
            reg.manifest("v1")
    assert e.value.code == "io" and "cannot reach registry.lab" in str(e.value)
    assert all(url.startswith("https://") for url, _ in transport.calls) and len(transport.calls) == 2


def test_insecure_registry_unreachable_both_ways_is_retried_then_an_error(monkeypatch):
    def serve(url, headers):
        raise unreachable(url, HTTPS_FAILURES["refused"])

    with rc.Registry(rc.RegistryConfig(insecure=("registry.lab",), retry_times=1), "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, serve)
        with pytest.raises(rc.RegistryError) as e:
            reg.manifest("v1")
        assert reg._scheme is None
    assert e.value.code == "io" and "cannot reach registry.lab" in str(e.value) and "refused" in str(e.value)
    assert [url.split(":")[0] for url, _ in transport.calls] == ["https", "http", "https", "http"]


def test_credentials_never_go_to_a_plain_http_realm_of_an_https_registry(monkeypatch, tmp_path):
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {"registry.lab": {"auth": b64(f"me:{SECRET}")}}}))
    challenge = {"WWW-Authenticate": 'Bearer realm="http://auth.lab/token",service="registry.lab"'}

    def serve(url, headers):
        if url.startswith("https://registry.lab/"):
            if headers.get("Authorization") == "Bearer tok":
                return answer(200, b"{}")
            return answer(401, b"", challenge)
        assert url.startswith("http://auth.lab/token?")
        return answer(200, b'{"token": "tok"}')

    with rc.Registry(rc.RegistryConfig(auth_file=str(auth)), "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, serve)
        with pytest.raises(rc.RegistryError) as e:
            reg.manifest("v1")
    assert e.value.code == "permission" and "auth.lab over plain HTTP" in str(e.value)
    assert SECRET not in str(e.value) and b64(f"me:{SECRET}") not in str(e.value)
    assert [url for url, _ in transport.calls] == ["https://registry.lab/v2/a/b/manifests/v1"]
    # a registry listed as insecure may send them there
    cfg = rc.RegistryConfig(auth_file=str(auth), insecure=("registry.lab",))
    with rc.Registry(cfg, "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, serve)
        assert reg.manifest("v1") == b"{}"
    assert transport.calls[1][1]["Authorization"] == rc.basic_header("me", SECRET)


def test_only_the_insecure_registrys_own_host_goes_unverified():
    cfg = rc.RegistryConfig(insecure=("registry.lab:5000",))
    with rc.Registry(cfg, "registry.lab:5000", "a/b") as reg:
        assert reg._tls_for("registry.lab", 5000).verify_mode == ssl.CERT_NONE
        assert reg._tls_for("REGISTRY.lab", 5000).verify_mode == ssl.CERT_NONE
        for host, port in (("registry.lab", None), ("registry.lab", 443), ("auth.lab", 5000), ("s3.lab", None)):
            assert reg._tls_for(host, port).verify_mode == ssl.CERT_REQUIRED, (host, port)
    with rc.Registry(rc.RegistryConfig(insecure=("[fd00::1]:5000",)), "[fd00::1]:5000", "a/b") as reg:
        assert reg._tls_for("[fd00::1]", 5000).verify_mode == ssl.CERT_NONE
        assert reg._tls_for("fd00::1", 5000).verify_mode == ssl.CERT_NONE
        assert reg._tls_for("fd00::2", 5000).verify_mode == ssl.CERT_REQUIRED


# Answers that echo the request's Authorization header back, as some servers'
# error pages do: what the client reports must never quote them.
def echo(status: int, headers: dict, extra: dict | None = None) -> urllib3.HTTPResponse:
    return answer(status, json.dumps({"errors": [{"code": "DENIED", "message": headers.get("Authorization", "")}],
                                      "details": headers.get("Authorization", "")}).encode(), extra)


BASIC_CHALLENGE = {"WWW-Authenticate": 'Basic realm="registry.lab"'}
BEARER_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="https://auth.lab/token",service="registry.lab"'}


def basic_refused(url, headers):
    return echo(401, headers, BASIC_CHALLENGE)


def realm_refuses(url, headers):
    return echo(401, headers) if "auth.lab" in url else echo(401, headers, BEARER_CHALLENGE)


def realm_fails(url, headers):
    return echo(500, headers) if "auth.lab" in url else echo(401, headers, BEARER_CHALLENGE)


def realm_sends_no_token(url, headers):
    return echo(200, headers) if "auth.lab" in url else echo(401, headers, BEARER_CHALLENGE)


def realm_unreachable(url, headers):
    if "auth.lab" in url:
        raise unreachable(url, NewConnectionError(None, "Failed to establish a new connection: [Errno 111] "
                                                         "Connection refused"))
    return echo(401, headers, BEARER_CHALLENGE)


def token_refused_by_the_registry(url, headers):
    if "auth.lab" in url:
        return answer(200, b'{"token": "tok"}')
    return echo(403, headers) if headers.get("Authorization") == "Bearer tok" else echo(401, headers, BEARER_CHALLENGE)


@pytest.mark.parametrize("serve, code", [
    (basic_refused, "permission"),
    (realm_refuses, "permission"),
    (realm_fails, "io"),
    (realm_sends_no_token, "io"),
    (realm_unreachable, "io"),
    (token_refused_by_the_registry, "permission"),
], ids=lambda v: getattr(v, "__name__", v))
def test_failed_authentication_never_shows_the_password(monkeypatch, tmp_path, caplog, serve, code):
    caplog.set_level(logging.DEBUG)
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {"registry.lab": {"auth": b64(f"me:{SECRET}")}}}))
    with rc.Registry(rc.RegistryConfig(auth_file=str(auth), retry_times=1), "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, serve)
        with pytest.raises(rc.RegistryError) as e:
            reg.manifest("v1")
    assert any(h.get("Authorization") == rc.basic_header("me", SECRET) for _, h in transport.calls), \
        "the credentials were never sent: the test would prove nothing"
    assert e.value.code == code, str(e.value)
    shown = "".join(traceback.format_exception(e.value)) + caplog.text + repr(reg)
    for secret in (SECRET, b64(f"me:{SECRET}"), rc.basic_header("me", SECRET)):
        assert secret not in shown




IDENTITY_TOKEN = "idtok-Qw3-never-shown"


def test_an_identity_token_is_traded_at_the_realm_with_the_refresh_token_grant(monkeypatch, tmp_path):
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {"https://registry.lab/v1/": {"identitytoken": IDENTITY_TOKEN}}}))

    def serve(url, headers):
        if url == "https://auth.lab/token":
            assert headers["Content-Type"] == "application/x-www-form-urlencoded" and "Authorization" not in headers
            return answer(200, b'{"access_token": "tok", "expires_in": 300}')
        return answer(200, b"{}") if headers.get("Authorization") == "Bearer tok" else answer(401, b"", BEARER_CHALLENGE)

    with rc.Registry(rc.RegistryConfig(auth_file=str(auth)), "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, serve)
        assert reg.manifest("v1") == b"{}"
    (url, form), = transport.posted
    assert dict(parse_qsl(form)) == {"grant_type": "refresh_token", "refresh_token": IDENTITY_TOKEN,
                                     "client_id": "dsecd", "access_type": "offline", "service": "registry.lab",
                                     "scope": "repository:a/b:pull"}
    assert all(IDENTITY_TOKEN not in json.dumps(h) for _, h in transport.calls)


def test_an_identity_token_refused_or_asked_for_by_basic_auth_is_never_shown(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {"registry.lab": {"identitytoken": IDENTITY_TOKEN}}}))
    for serve, code in ((basic_refused, "unsupported"), (realm_refuses, "permission")):
        with rc.Registry(rc.RegistryConfig(auth_file=str(auth), retry_times=0), "registry.lab", "a/b") as reg:
            stubbed(monkeypatch, reg, serve)
            with pytest.raises(rc.RegistryError) as e:
                reg.manifest("v1")
        assert e.value.code == code, str(e.value)
        shown = "".join(traceback.format_exception(e.value)) + caplog.text + repr(reg)
        assert IDENTITY_TOKEN not in shown
    assert "identity token" in str(e.value) or code == "permission"


def test_a_missing_credential_store_leaves_pulls_anonymous_and_a_refusal_says_why(monkeypatch, tmp_path, caplog):
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {"registry.lab": {}}, "credsStore": "desktop"}))

    def public(url, headers):
        if "auth.lab" in url:
            assert "Authorization" not in headers
            return answer(200, b'{"token": "tok"}')
        return answer(200, b"{}") if headers.get("Authorization") == "Bearer tok" else answer(401, b"", BEARER_CHALLENGE)

    with rc.Registry(rc.RegistryConfig(auth_file=str(auth)), "registry.lab", "a/b") as reg:
        stubbed(monkeypatch, reg, public)
        assert reg.manifest("v1") == b"{}"
    assert "docker-credential-desktop" in caplog.text and "is not installed" in caplog.text
    with rc.Registry(rc.RegistryConfig(auth_file=str(auth), retry_times=0), "registry.lab", "a/b") as reg:
        stubbed(monkeypatch, reg, realm_refuses)
        with pytest.raises(rc.RegistryError) as e:
            reg.manifest("v1")
    assert e.value.code == "permission"
    assert "anonymously: the credential helper docker-credential-desktop" in str(e.value)


def test_a_registry_that_serves_without_a_challenge_runs_no_credential_helper(monkeypatch, tmp_path):
    ran = tmp_path / "ran"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    helper = bindir / "docker-credential-spy"
    helper.write_text(f"#!/bin/sh\ntouch {ran}\necho '{{\"Username\": \"u\", \"Secret\": \"p\"}}'\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"credsStore": "spy"}))
    with rc.Registry(rc.RegistryConfig(auth_file=str(auth)), "registry.lab", "a/b") as reg:
        stubbed(monkeypatch, reg, lambda url, headers: answer(200, b"{}"))
        assert reg.manifest("v1") == b"{}"
    assert not ran.exists()
    with rc.Registry(rc.RegistryConfig(auth_file=str(auth)), "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, basic_refused)
        with pytest.raises(rc.RegistryError):
            reg.manifest("v1")
    assert ran.exists() and transport.calls[-1][1]["Authorization"] == rc.basic_header("u", "p")


def test_mirrors_come_before_their_registry_in_order_with_their_path_prefix():
    cfg = rc.RegistryConfig(mirrors=rc.parse_mirrors({
        "index.docker.io": ["mirror.gcr.io"], "docker.io": ["harbor.lab:8443/dockerhub/cache"],
        "ghcr.io": ["[fd00::5]:5000"]}))
    assert [(str(s), s.repository) for s in cfg.sources("docker.io", "library/python")] == [
        ("mirror mirror.gcr.io", "library/python"), ("mirror harbor.lab:8443", "dockerhub/cache/library/python"),
        ("docker.io", "library/python")]
    assert [s.registry for s in cfg.sources("ghcr.io", "a/b")] == ["[fd00::5]:5000", "ghcr.io"]
    assert [s.registry for s in cfg.sources("quay.io", "a/b")] == ["quay.io"]


@pytest.mark.parametrize("table", [["mirror.gcr.io"], {"docker.io": "mirror.gcr.io"},
                                   {"docker.io": ["https://mirror.gcr.io"]}, {"docker.io": ["m.lab/Upper"]},
                                   {"docker.io": ["m.lab/a/../b"]}, {"docker.io": [5000]}])
def test_mirrors_that_are_not_host_port_path_are_refused(table):
    with pytest.raises(ValueError, match="images.mirrors"):
        rc.parse_mirrors(table)


def test_the_default_config_has_no_mirrors():
    section = tomllib.loads(resources.files("dsecd").joinpath("default.toml").read_text())["images"]
    assert rc.RegistryConfig.from_section(section).mirrors == {}


def test_an_identity_tokens_grant_is_never_sent_on_to_where_a_redirect_points(monkeypatch, tmp_path):
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {"registry.lab": {"identitytoken": IDENTITY_TOKEN}}}))

    def serve(url, headers):
        if url == "https://auth.lab/token":
            return answer(302, b"", {"Location": "https://elsewhere.lab/token"})
        assert "elsewhere" not in url
        return answer(401, b"", BEARER_CHALLENGE)

    with rc.Registry(rc.RegistryConfig(auth_file=str(auth), retry_times=0), "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, serve)
        with pytest.raises(rc.RegistryError) as e:
            reg.manifest("v1")
    assert e.value.code == "io" and "redirect (302), which is not followed" in str(e.value)
    assert [url for url, _ in transport.posted] == ["https://auth.lab/token"]
    assert IDENTITY_TOKEN not in str(e.value)


@pytest.mark.parametrize("table", [{"https://ghcr.io/": ["m.lab"]}, {"docker.io": ["m.lab:99999"]},
                                   {"ghcr.io": ["GHCR.io/cache"]}, {"registry.lab:5000": ["m.lab", "registry.lab:5000"]}])
def test_mirror_keys_ports_and_self_mirrors_are_refused(table):
    with pytest.raises(ValueError, match="images.mirrors"):
        rc.parse_mirrors(table)


def test_mirror_keys_match_whatever_the_case():
    cfg = rc.RegistryConfig(mirrors=rc.parse_mirrors({"GHCR.io": ["m.lab"]}))
    assert [s.registry for s in cfg.sources("ghcr.io", "a/b")] == ["m.lab", "ghcr.io"]


def test_a_stop_ends_a_credential_helper_the_registry_waits_for(monkeypatch, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    helper = bindir / "docker-credential-slow"
    helper.write_text("#!/bin/sh\nsleep 30\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"credsStore": "slow"}))
    stop = Stop()
    with rc.Registry(rc.RegistryConfig(auth_file=str(auth)), "registry.lab", "a/b") as reg:
        stubbed(monkeypatch, reg, basic_refused)
        threading.Timer(0.3, stop.set).start()
        started = time.monotonic()
        with pytest.raises(rc.RegistryError) as e:
            reg.manifest("v1", stop)
    assert e.value.code == "conflict" and str(e.value).endswith(": stopped")
    assert time.monotonic() - started < 2.0


def test_each_try_of_the_token_service_carries_the_credentials_and_our_user_agent(monkeypatch, tmp_path):
    """urllib3 pops Authorization from the headers it is given when a
    redirect leaves the host: a retry must not go out without it."""
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {"registry.lab": {"auth": b64(f"me:{SECRET}")}}}))
    tries = []

    def serve(url, headers):
        if "auth.lab" in url:
            tries.append(dict(headers))
            if len(tries) == 1:
                headers.pop("Authorization", None)     # what a cross-host redirect does to the dict
                return answer(503)
            return answer(200, b'{"token": "tok"}')
        return answer(200, b"{}") if headers.get("Authorization") == "Bearer tok" else answer(401, b"", BEARER_CHALLENGE)

    with rc.Registry(rc.RegistryConfig(auth_file=str(auth)), "registry.lab", "a/b") as reg:
        transport = stubbed(monkeypatch, reg, serve, mutable_headers=True)
        assert reg.manifest("v1") == b"{}"
    assert [t.get("Authorization") for t in tries] == [rc.basic_header("me", SECRET)] * 2
    assert all(h.get("User-Agent") == "dsecd" for _, h in transport.calls)
