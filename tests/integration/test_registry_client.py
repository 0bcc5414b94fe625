"""The registry client (dsecd/fs/registry.py) against Debian's docker-registry
(plain HTTP, htpasswd basic auth, TLS with a test CA) and against
FakeRegistry (bearer tokens and their expiry, redirects to blob storage,
Range resumption, truncated blobs, huge manifests)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from image_kit import Layout, layer_of, push, sha256
from registry_kit import (
    STALL_BYTES,
    FakeRegistry,
    Registry,
    auth_json,
    credential_helper,
    free_port,
    make_ca,
    missing_tools,
)

from dsecd.fs import registry as rc
from dsecd.fs.httpstop import Stop
from dsecd.fs.registry import MAX_METADATA_BYTES, RegistryConfig, RegistryError
from dsecd.fs.registry import Registry as Client

pytestmark = pytest.mark.skipif(missing_tools() is not None, reason=missing_tools() or "")

PASSWORD = "pw-Zq8-never-shown"
REPO = "test/app"


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(rc, "BACKOFF_S", 0.01)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """An OCI layout with one image (a gzip layer, a 3 MiB plain layer): (layout, manifest desc, manifest)."""
    layout = Layout(tmp_path_factory.mktemp("layout"))
    big = layer_of({"data/random": os.urandom(3 << 20)})
    desc = layout.image([(layer_of({"a.txt": b"a\n"}), "gzip"), (big, "tar")], {"Env": ["A=1"]})
    layout.tag("v1", desc)
    manifest = json.loads((layout.root / "blobs" / "sha256" / desc["digest"][7:]).read_bytes())
    return layout, desc, manifest


def blob_bytes(layout: Layout, digest: str) -> bytes:
    return (layout.root / "blobs" / "sha256" / digest[7:]).read_bytes()


def read_all(stream, piece: int = 1 << 20) -> bytes:
    out = bytearray()
    while data := stream.read(piece):
        out += data
    return bytes(out)


def pull_all(client: Client, image) -> None:
    """Manifest by tag and by digest, config, and every layer streamed: each the bytes pushed."""
    layout, desc, manifest = image
    data = client.manifest("v1")
    assert sha256(data) == desc["digest"]
    assert client.manifest(desc["digest"]) == data
    assert client.blob(manifest["config"]["digest"]) == blob_bytes(layout, manifest["config"]["digest"])
    for layer in manifest["layers"]:
        with client.open_blob(layer["digest"], layer["size"]) as stream:
            assert read_all(stream) == blob_bytes(layout, layer["digest"])
            assert stream.bytes_read == layer["size"]
            assert stream.read(1 << 20) == b""


# ---------------------------------------------------------------- docker-registry


@pytest.fixture(scope="module")
def plain(image, tmp_path_factory):
    reg = Registry(tmp_path_factory.mktemp("plain")).start()
    try:
        push(image[0], "v1", f"{reg.host}/{REPO}:v1")
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def basic(image, tmp_path_factory):
    reg = Registry(tmp_path_factory.mktemp("basic"), auth=("alice", PASSWORD)).start()
    try:
        push(image[0], "v1", f"{reg.host}/{REPO}:v1", *reg.push_args())
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def tls(image, tmp_path_factory):
    reg = Registry(tmp_path_factory.mktemp("tls"), tls=True).start()
    try:
        push(image[0], "v1", f"{reg.host}/{REPO}:v1", *reg.push_args())
        yield reg
    finally:
        reg.stop()


def test_plain_http_registry_listed_as_insecure(plain, image):
    with Client(RegistryConfig(insecure=(plain.host,)), plain.host, REPO) as client:
        pull_all(client, image)
        assert client._scheme == "http"


def test_not_found_names_the_registry_code_and_the_default_registry(plain, image):
    manifest = image[2]
    cfg = RegistryConfig(insecure=(plain.host,))
    cases = [(REPO, lambda c: c.manifest("nope"), "MANIFEST_UNKNOWN", f"{plain.host}/{REPO}:nope"),
             # distribution answers MANIFEST_UNKNOWN, not NAME_UNKNOWN, for a repository it never had
             ("test/other", lambda c: c.manifest("v1"), "MANIFEST_UNKNOWN", f"{plain.host}/test/other:v1"),
             (REPO, lambda c: c.blob("sha256:" + "0" * 64), "BLOB_UNKNOWN", "sha256:" + "0" * 64)]
    for repo, call, code, named in cases:
        with Client(cfg, plain.host, repo) as client, pytest.raises(RegistryError) as e:
            call(client)
        assert e.value.code == "not_found", str(e.value)
        assert code in str(e.value) and named in str(e.value) and "images.default_registry" in str(e.value)
    with Client(cfg, plain.host, REPO) as client:             # the layers are there all the same
        assert client.blob(manifest["config"]["digest"])


def test_https_to_a_plain_http_registry_advises_insecure_registries(plain):
    with Client(RegistryConfig(retry_times=0), plain.host, REPO) as client, pytest.raises(RegistryError) as e:
        client.manifest("v1")
    assert e.value.code == "io"
    assert "images.insecure_registries" in str(e.value) and f"{plain.host}/{REPO}:v1" in str(e.value)


def test_connection_refused_names_the_host():
    host = f"127.0.0.1:{free_port()}"
    with Client(RegistryConfig(retry_times=1, insecure=(host,)), host, REPO) as client:
        with pytest.raises(RegistryError) as e:
            client.manifest("v1")
    assert e.value.code == "io"
    assert f"cannot reach {host}" in str(e.value) and "refused" in str(e.value).lower()


def test_basic_auth_from_auth_json(basic, image, tmp_path):
    auth = auth_json(tmp_path / "auth.json", basic.host, "alice", PASSWORD)
    with Client(RegistryConfig(auth_file=str(auth), insecure=(basic.host,)), basic.host, REPO) as client:
        pull_all(client, image)


def test_basic_auth_from_a_credential_helper(basic, image, tmp_path, monkeypatch):
    credential_helper(tmp_path / "bin", "test", basic.host, "alice", PASSWORD)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"credHelpers": {basic.host: "test"}}))
    with Client(RegistryConfig(auth_file=str(auth), insecure=(basic.host,)), basic.host, REPO) as client:
        pull_all(client, image)


@pytest.mark.parametrize("creds", [None, ("alice", "wrong-" + PASSWORD)])
def test_basic_auth_refused_is_permission_without_the_password(basic, tmp_path, creds):
    auth = str(auth_json(tmp_path / "auth.json", basic.host, *creds)) if creds else ""
    with Client(RegistryConfig(auth_file=auth, insecure=(basic.host,)), basic.host, REPO) as client:
        with pytest.raises(RegistryError) as e:
            client.manifest("v1")
    assert e.value.code == "permission"
    assert "images.auth_file" in str(e.value) and f"{basic.host}/{REPO}:v1" in str(e.value)
    assert PASSWORD not in str(e.value)


def test_tls_with_the_ca_in_certs_dir(tls, image, tmp_path):
    d = tmp_path / "certs" / tls.host
    d.mkdir(parents=True)
    shutil.copy(tls.ca, d / "ca.crt")
    with Client(RegistryConfig(certs_dir=str(tmp_path / "certs")), tls.host, REPO) as client:
        pull_all(client, image)
        assert client._scheme == "https"


def test_tls_without_its_ca_advises_certs_dir(tls, tmp_path):
    with Client(RegistryConfig(retry_times=0), tls.host, REPO) as client, pytest.raises(RegistryError) as e:
        client.manifest("v1")
    assert e.value.code == "io"
    assert "images.certs_dir/<host[:port]>/" in str(e.value) and f"{tls.host}/{REPO}:v1" in str(e.value)


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_insecure_tls_registry_stays_on_unverified_https(tls, image):
    with Client(RegistryConfig(insecure=(tls.host,)), tls.host, REPO) as client:
        pull_all(client, image)
        assert client._scheme == "https"


# ---------------------------------------------------------------- FakeRegistry


@pytest.fixture
def fake(image):
    layout, desc, _ = image
    f = FakeRegistry().start()
    try:
        f.put_layout(REPO, "v1", layout, desc)
        yield f
    finally:
        f.stop()


@pytest.fixture
def big_layer(image):
    layer = image[2]["layers"][1]
    return layer["digest"], layer["size"], blob_bytes(image[0], layer["digest"])


def fake_client(fake: FakeRegistry, tmp_path: Path, creds: tuple[str, str] | None = None, **kw) -> Client:
    auth = str(auth_json(tmp_path / "auth.json", fake.host, *creds)) if creds else ""
    return Client(RegistryConfig(auth_file=auth, insecure=(fake.host,), **kw), fake.host, REPO)


def test_bearer_token_fetched_once_for_all_threads(fake, image, tmp_path):
    fake.use_tokens(creds=("bob", PASSWORD))
    with fake_client(fake, tmp_path, ("bob", PASSWORD)) as client:
        digest = image[2]["layers"][1]["digest"]
        size = image[2]["layers"][1]["size"]
        results, errors = [], []

        def one():
            try:
                with client.open_blob(digest, size) as stream:
                    results.append(read_all(stream))
            except Exception as e:      # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert len(results) == 6 and all(r == blob_bytes(image[0], digest) for r in results)
        pull_all(client, image)
    assert fake.token_gets == 1


def test_bearer_token_refused_is_permission(fake, tmp_path):
    fake.use_tokens(creds=("bob", PASSWORD))
    with fake_client(fake, tmp_path, ("bob", "wrong-" + PASSWORD)) as client, pytest.raises(RegistryError) as e:
        client.manifest("v1")
    assert e.value.code == "permission" and "images.auth_file" in str(e.value)
    assert PASSWORD not in str(e.value)


def test_an_identity_token_gets_tokens_from_the_refresh_token_grant(fake, image, tmp_path):
    fake.use_tokens(creds=("bob", PASSWORD), refresh_token="refresh-" + PASSWORD)
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {fake.host: {"identitytoken": "refresh-" + PASSWORD}}}))
    with Client(RegistryConfig(auth_file=str(auth), insecure=(fake.host,)), fake.host, REPO) as client:
        pull_all(client, image)
    assert [f["grant_type"] for f in fake.token_posts] == ["refresh_token"]
    assert fake.token_posts[0]["scope"] == f"repository:{REPO}:pull"
    auth.write_text(json.dumps({"auths": {fake.host: {"identitytoken": "stale"}}}))
    with Client(RegistryConfig(auth_file=str(auth), insecure=(fake.host,)), fake.host, REPO) as client, \
            pytest.raises(RegistryError) as e:
        client.manifest("v1")
    assert e.value.code == "permission" and "stale" not in str(e.value)


def test_expired_token_is_fetched_again(fake, image, tmp_path):
    fake.use_tokens(uses=2)
    with fake_client(fake, tmp_path) as client:
        for _ in range(3):
            assert sha256(client.manifest("v1")) == image[1]["digest"]
    # the first request anonymous; tokens 1 and 2 serve two requests each
    assert fake.token_gets == 2


def test_token_answer_over_a_mebibyte_is_refused(fake, tmp_path):
    fake.use_tokens()
    fake.token_body = b'{"token": "' + b"t" * (1 << 20) + b'"}'
    with fake_client(fake, tmp_path) as client, pytest.raises(RegistryError) as e:
        client.manifest("v1")
    assert e.value.code == "io" and f"the token service {fake.host}" in str(e.value)
    assert "more than 1 MiB, more than a token answer may have" in str(e.value)


def test_insecure_registry_verifies_its_token_realm_on_another_host(fake, tls, tmp_path):
    """Only the insecure registry's own host goes unverified: its token realm,
    here the TLS docker-registry on another port, needs its CA in certs_dir."""
    fake.use_tokens()
    fake.token_realm = f"https://{tls.host}/token"
    certs = tmp_path / "certs"
    certs.mkdir()
    with fake_client(fake, tmp_path, retry_times=0, certs_dir=str(certs)) as client, \
            pytest.raises(RegistryError) as e:
        client.manifest("v1")
    assert e.value.code == "io" and f"TLS with the token service {tls.host} failed" in str(e.value)
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value) and "images.certs_dir" in str(e.value)
    (certs / tls.host).mkdir()
    shutil.copy(tls.ca, certs / tls.host / "ca.crt")
    with fake_client(fake, tmp_path, retry_times=0, certs_dir=str(certs)) as client, \
            pytest.raises(RegistryError) as e:
        client.manifest("v1")
    # verified now: docker-registry has no /token, and says so
    assert e.value.code == "io" and f"the token service {tls.host} answered 404" in str(e.value)


def test_redirect_to_blob_storage_without_authorization(fake, image, tmp_path, big_layer):
    fake.use_tokens()
    store = fake.redirect_blobs()
    digest, size, data = big_layer
    with fake_client(fake, tmp_path) as client:
        with client.open_blob(digest, size) as stream:
            assert read_all(stream) == data
        assert client.blob(image[2]["config"]["digest"]) == blob_bytes(image[0], image[2]["config"]["digest"])
    assert len(store.authorization) == 2
    assert store.authorization == [None, None], "the registry's token went to another host"


@pytest.mark.parametrize("ignore_range", [False, True])
def test_dropped_blob_resumes_from_where_it_stopped(fake, tmp_path, big_layer, ignore_range):
    digest, size, data = big_layer
    fake.cut_first[digest] = 1
    fake.ignore_range = ignore_range
    with fake_client(fake, tmp_path) as client, client.open_blob(digest, size) as stream:
        assert read_all(stream) == data
    assert fake.gets[digest] == 2 and fake.ranges[digest] == 1


def test_blob_cut_every_time_is_truncated_after_the_retries(fake, tmp_path, big_layer):
    digest, size, _ = big_layer
    fake.cut.add(digest)
    with fake_client(fake, tmp_path, retry_times=2) as client, client.open_blob(digest, size) as stream:
        with pytest.raises(RegistryError) as e:
            read_all(stream)
    assert e.value.code == "io"
    assert f"truncated: got {stream.bytes_read} of {size} bytes" in str(e.value)
    assert digest in str(e.value) and f"{fake.host}/{REPO}" in str(e.value)
    assert fake.gets[digest] == 3 and fake.ranges[digest] == 2


def in_thread(call) -> tuple[threading.Thread, dict]:
    """call() in a thread: (the thread, {"data": what it returned} or
    {"error": the RegistryError it raised} once it ends)."""
    result: dict = {}

    def run():
        try:
            result["data"] = call()
        except RegistryError as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def read_in_thread(stream) -> tuple[threading.Thread, dict]:
    return in_thread(lambda: read_all(stream))


def assert_ends_on_stop(thread: threading.Thread, result: dict, stop, waiting_s: float = 0.3) -> None:
    """`thread` still waits after `waiting_s`; stop() ends it within a
    second, with the stopped error."""
    time.sleep(waiting_s)
    assert thread.is_alive(), result
    started = time.monotonic()
    stop()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - started < 1.0
    assert result["error"].code == "conflict" and str(result["error"]).endswith(": stopped")


def assert_stopped(fake: FakeRegistry, stream, thread: threading.Thread, result: dict) -> None:
    """abort() ends the read blocked in `thread` within a second, with the
    stopped error, and every read after it raises it too."""
    assert_ends_on_stop(thread, result, stream.abort)
    stopped = f"{fake.host}/{REPO}: blob {stream.digest}: stopped"
    assert str(result["error"]) == stopped
    with pytest.raises(RegistryError) as e:
        stream.read(1 << 20)
    assert str(e.value) == stopped


@pytest.fixture
def fake_tls(image, tmp_path):
    """A FakeRegistry over HTTPS (a test CA's certificate for 127.0.0.1)."""
    layout, desc, _ = image
    f = FakeRegistry()
    _, crt, key = make_ca(tmp_path / "fake-tls")
    f.serve_tls(crt, key)
    f.start()
    try:
        f.put_layout(REPO, "v1", layout, desc)
        yield f
    finally:
        f.stop()


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
@pytest.mark.parametrize("server", ["fake", "fake_tls"])
def test_read_returns_what_arrived_and_abort_wakes_a_blocked_read(request, tmp_path, big_layer, server):
    fake = request.getfixturevalue(server)
    digest, size, data = big_layer
    fake.stall.add(digest)
    with fake_client(fake, tmp_path) as client, client.open_blob(digest, size) as stream:   # 60 s timeout
        assert client._scheme == ("https" if server == "fake_tls" else "http")
        assert stream.read(1 << 20) == data[:STALL_BYTES]
        thread, result = read_in_thread(stream)
        assert_stopped(fake, stream, thread, result)
    assert fake.gets[digest] == 1, "an aborted stream asked again"


def test_abort_wakes_a_resume_backoff_and_stops_the_resumes(fake, tmp_path, big_layer, monkeypatch):
    digest, size, _ = big_layer
    fake.cut.add(digest)
    monkeypatch.setattr(rc, "BACKOFF_S", 30.0)
    with fake_client(fake, tmp_path, retry_times=3) as client, client.open_blob(digest, size) as stream:
        thread, result = read_in_thread(stream)
        assert_stopped(fake, stream, thread, result)
    assert fake.gets[digest] == 1 and fake.ranges[digest] == 0


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
@pytest.mark.parametrize("server", ["fake", "fake_tls"])
def test_abort_ends_a_resume_awaiting_its_answer(request, tmp_path, big_layer, server):
    fake = request.getfixturevalue(server)
    digest, size, _ = big_layer
    fake.cut_first[digest] = 1                 # the first answer ends halfway...
    fake.stall_ranges.add(digest)              # ...and the resume gets no answer (60 s timeout)
    with fake_client(fake, tmp_path, retry_times=3) as client, client.open_blob(digest, size) as stream:
        thread, result = read_in_thread(stream)
        deadline = time.monotonic() + 10
        while fake.ranges[digest] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert_stopped(fake, stream, thread, result)
    assert fake.ranges[digest] == 1


@pytest.mark.parametrize("stalls", ["headers", "body"])
def test_a_stop_ends_a_manifest_request_awaiting_its_answer(fake, tmp_path, stalls):
    fake.use_tokens()                          # the token's GET first, then the stalled manifest's
    fake.stall_manifests = stalls
    stop = Stop()
    with fake_client(fake, tmp_path) as client:
        assert_ends_on_stop(*in_thread(lambda: client.manifest("v1", stop)), stop.set, waiting_s=0.5)
    assert fake.token_gets == 1


@contextlib.contextmanager
def unanswered_host():
    """host:port on loopback whose listen queue is full: a connect() to it
    gets no answer (its SYN is dropped) until its timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        with socket.create_connection(listener.getsockname(), timeout=5):      # the queue is full now
            yield f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_stop_ends_a_request_still_connecting(tmp_path):
    """A registry whose listen queue is full takes no more connections: a
    connect() waits for its timeout (10 s) unless the stop ends it."""
    with unanswered_host() as host:
        stop = Stop()
        with Client(RegistryConfig(insecure=(host,), retry_times=2), host, REPO) as client:
            thread, result = in_thread(lambda: client.open_blob("sha256:" + "0" * 64, 10, stop=stop))
            assert_ends_on_stop(thread, result, stop.set, waiting_s=0.5)


def test_a_stop_ends_a_tls_handshake_awaiting_its_answer(tmp_path):
    """A host that takes the connection (the kernel's accept queue) and never
    answers the TLS hello: the handshake waits for the read timeout (60 s)
    unless the stop ends it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        host = f"127.0.0.1:{listener.getsockname()[1]}"
        stop = Stop()
        with Client(RegistryConfig(retry_times=2), host, REPO) as client:
            thread, result = in_thread(lambda: client.manifest("v1", stop))
            assert_ends_on_stop(thread, result, stop.set, waiting_s=0.5)


def test_a_connect_that_gets_no_answer_ends_at_the_connect_timeout(tmp_path):
    """connect_retries=0 (a mirror's): one try over each scheme, each ended
    by the connect timeout, then "cannot reach"."""
    with unanswered_host() as host:
        cfg = RegistryConfig(insecure=(host,), retry_times=2, connect_timeout_s=0.5, connect_retries=0)
        started = time.monotonic()
        with Client(cfg, host, REPO) as client, pytest.raises(RegistryError) as e:
            client.manifest("v1")
    assert time.monotonic() - started < 3.0                # HTTPS, then HTTP: 0.5 s each, no retry
    assert e.value.code == "io" and "no connection in time (connect timeout)" in str(e.value)
    assert "(after 1 tries)" in str(e.value)


def test_abort_before_the_first_read(fake, tmp_path, big_layer):
    digest, size, _ = big_layer
    with fake_client(fake, tmp_path) as client:
        with client.open_blob(digest, size) as stream:
            stream.abort()
            with pytest.raises(RegistryError) as e:
                stream.read(1 << 20)
        assert e.value.code == "conflict" and str(e.value).endswith(f"blob {digest}: stopped")
        with client.open_blob(digest, size) as stream:        # the client serves on
            assert stream.read(1 << 20)


def test_blob_connections_are_kept_alive(fake, tmp_path, big_layer):
    digest, size, data = big_layer
    with fake_client(fake, tmp_path) as client:
        for _ in range(3):
            with client.open_blob(digest, size) as stream:
                assert read_all(stream) == data
        pool = client._http.connection_from_url(f"http://{fake.host}/")
        assert pool.num_connections == 1


def test_blob_longer_than_its_descriptor_is_refused(fake, image, tmp_path, big_layer):
    digest, size, data = big_layer
    # no retries: a connection put back with the refused body unread would fail the next request
    with fake_client(fake, tmp_path, retry_times=0) as client:
        with pytest.raises(RegistryError) as e:
            client.open_blob(digest, size - 10)
        assert e.value.code == "io" and f"more than the {size - 10} bytes" in str(e.value)
        assert sha256(client.manifest("v1")) == image[1]["digest"]
        with client.open_blob(digest, size) as stream:
            assert read_all(stream) == data


def test_huge_manifest_and_config_are_refused(fake, tmp_path):
    fake.put_manifest(REPO, "huge", b" " * (MAX_METADATA_BYTES + 1), rc.OCI_MANIFEST)
    fake.put_manifest(REPO, "fits", b" " * MAX_METADATA_BYTES, rc.OCI_MANIFEST)
    big = b"x" * 100
    fake.blobs[sha256(big)] = big
    with fake_client(fake, tmp_path) as client:
        assert len(client.manifest("fits")) == MAX_METADATA_BYTES
        with pytest.raises(RegistryError) as e:
            client.manifest("huge")
        assert e.value.code == "io" and "sent more than 4 MiB" in str(e.value) and ":huge" in str(e.value)
        with pytest.raises(RegistryError) as e:
            client.blob(sha256(big), limit=99)
        assert e.value.code == "io" and "more than 99 bytes" in str(e.value)
        assert client.blob(sha256(big), limit=100) == big


def test_fake_404_codes(fake, tmp_path):
    with fake_client(fake, tmp_path) as client:
        for call, code in ((lambda: client.manifest("nope"), "MANIFEST_UNKNOWN"),
                           (lambda: client.open_blob("sha256:" + "1" * 64, 5), "BLOB_UNKNOWN")):
            with pytest.raises(RegistryError) as e:
                call()
            assert e.value.code == "not_found" and code in str(e.value)


def test_5xx_and_429_are_retried(fake, tmp_path, big_layer):
    digest, size, data = big_layer
    fake.fail[digest] = [503, 429]
    with fake_client(fake, tmp_path, retry_times=2) as client, client.open_blob(digest, size) as stream:
        assert read_all(stream) == data
    assert fake.gets[digest] == 3


@pytest.mark.parametrize("status, code", [(429, "busy"), (502, "io")])
def test_answers_still_failing_after_the_retries(fake, tmp_path, big_layer, status, code):
    digest, size, _ = big_layer
    fake.fail[digest] = [status] * 3
    with fake_client(fake, tmp_path, retry_times=2) as client, pytest.raises(RegistryError) as e:
        client.open_blob(digest, size)
    assert e.value.code == code and str(status) in str(e.value) and digest in str(e.value)
    assert fake.gets[digest] == 3
