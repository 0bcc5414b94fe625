"""Where a registry's credentials come from (dsecd/fs/credentials.py): an
auth.json's "auths" entries under docker.io's several keys, credential
helpers and stores run as docker runs them (fake helpers in a PATH of the
test's), identity tokens, and errors that never carry a secret."""

import base64
import json
import os
import stat
import threading
import time

import pytest
from proc_kit import running

from dsecd.fs import credentials as cr

SECRET = "s3cr3t-Pa55"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize("key", ["https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io",
                                 "docker.io"])
def test_docker_hub_credentials_under_any_of_its_keys(key):
    auths = {"ghcr.io": {"auth": b64("other:x")}, key: {"auth": b64(f"me:{SECRET}")}}
    assert cr.lookup_credentials(auths, "docker.io") == ("me", SECRET)


def test_credentials_by_host_and_port_and_username_keys():
    auths = {"127.0.0.1:5000": {"auth": b64("a:b:c")},           # a password may hold ':'
             "https://reg.example.com": {"username": "u", "password": "p"},
             "127.0.0.1": {"auth": b64("wrong:port")}}
    assert cr.lookup_credentials(auths, "127.0.0.1:5000") == ("a", "b:c")
    assert cr.lookup_credentials(auths, "reg.example.com") == ("u", "p")
    assert cr.lookup_credentials(auths, "127.0.0.1:5001") is None
    assert cr.lookup_credentials(auths, "docker.io") is None


def test_malformed_auth_entry_names_the_registry_not_the_value():
    bad = b64(f"no-colon-{SECRET}")
    with pytest.raises(ValueError) as e:
        cr.lookup_credentials({"h:1": {"auth": bad}}, "h:1")
    assert "h:1" in str(e.value) and SECRET not in str(e.value) and bad not in str(e.value)
    with pytest.raises(ValueError):
        cr.lookup_credentials({"h:1": {"auth": "!!not base64!!"}}, "h:1")


def test_auth_file_unreadable_or_malformed_is_a_bad_request(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(cr.CredentialsError) as e:
        cr.lookup(str(missing), "h:1")
    assert e.value.code == "bad_request"
    assert str(missing) in str(e.value) and "fix the path" in str(e.value)
    junk = tmp_path / "junk.json"
    junk.write_text(f"{{ {SECRET}")
    with pytest.raises(cr.CredentialsError) as e:
        cr.lookup(str(junk), "h:1")
    assert e.value.code == "bad_request" and SECRET not in str(e.value)
    assert cr.lookup("", "h:1") is None
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert cr.lookup(str(empty), "h:1") is None


# ---------------------------------------------------------------- helpers and stores


@pytest.fixture
def helpers(tmp_path, monkeypatch):
    """make(name, script): a docker-credential-<name> in a dir put first in
    PATH; each run appends the server URL it was asked for to <dir>/asked."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")

    def make(name: str, script: str) -> None:
        path = bindir / f"docker-credential-{name}"
        path.write_text(f'#!/bin/sh\n[ "$1" = get ] || exit 9\nread url\necho "$url" >> {bindir}/asked\n{script}\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR)

    make.asked = lambda: (bindir / "asked").read_text().split() if (bindir / "asked").exists() else []
    return make


def answer_json(user: str, secret: str) -> str:
    return f"echo '{json.dumps({'ServerURL': 'x', 'Username': user, 'Secret': secret})}'"


NOT_FOUND = "echo 'credentials not found in native keychain'; exit 1"


def auth_file(tmp_path, doc: dict) -> str:
    path = tmp_path / "auth.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_credential_helper_for_the_registry_comes_first(tmp_path, helpers):
    helpers("lab", answer_json("robot", SECRET))
    auth = auth_file(tmp_path, {"credHelpers": {"registry.lab": "lab"},
                                "auths": {"registry.lab": {"auth": b64("file:pw")}}, "credsStore": "other"})
    creds = cr.lookup(auth, "registry.lab")
    assert (creds.user, creds.secret, creds.identity_token) == ("robot", SECRET, False)
    assert creds.source == "docker-credential-lab" and SECRET not in repr(creds)
    assert helpers.asked() == ["registry.lab"]


def test_docker_hub_is_asked_for_under_its_server_url(tmp_path, helpers):
    helpers("hub", answer_json("me", SECRET))
    auth = auth_file(tmp_path, {"credHelpers": {"docker.io": "hub"}})
    assert cr.lookup(auth, "docker.io").user == "me"
    assert helpers.asked() == ["https://index.docker.io/v1/"]


def test_a_helper_with_nothing_passes_to_the_auths_entry_then_the_store(tmp_path, helpers):
    helpers("empty", NOT_FOUND)
    helpers("store", answer_json("stored", SECRET))
    auth = auth_file(tmp_path, {"credHelpers": {"registry.lab": "empty"},
                                "auths": {"registry.lab": {"auth": b64("file:pw")}, "other.lab": {}},
                                "credsStore": "store"})
    assert (cr.lookup(auth, "registry.lab").user, cr.lookup(auth, "registry.lab").source) == \
        ("file", "images.auth_file")
    # docker leaves {} in "auths" where its store keeps the credentials
    creds = cr.lookup(auth, "other.lab")
    assert (creds.user, creds.source) == ("stored", "docker-credential-store")
    helpers("store", NOT_FOUND)
    assert cr.lookup(auth, "third.lab") is None


def test_an_identity_token_beside_the_auth_docker_writes_with_it_is_the_one_used(tmp_path):
    # docker login stores the user with an empty password, and the token
    auth = auth_file(tmp_path, {"auths": {"myreg.azurecr.io": {
        "auth": b64("00000000-0000-0000-0000-000000000000:"), "identitytoken": SECRET}}})
    creds = cr.lookup(auth, "myreg.azurecr.io")
    assert creds.identity_token and creds.secret == SECRET


def test_identity_tokens_from_the_auth_file_and_from_a_helper(tmp_path, helpers):
    auth = auth_file(tmp_path, {"auths": {"https://registry.lab/v1/": {"identitytoken": SECRET}},
                                "credHelpers": {"tok.lab": "tok"}})
    creds = cr.lookup(auth, "registry.lab")
    assert creds.identity_token and creds.secret == SECRET and SECRET not in repr(creds)
    helpers("tok", answer_json("<token>", SECRET))
    creds = cr.lookup(auth, "tok.lab")
    assert creds.identity_token and creds.secret == SECRET and creds.user == ""


def test_a_helper_that_is_not_installed_is_unsupported_and_says_where_it_looked(tmp_path, helpers):
    auth = auth_file(tmp_path, {"credsStore": "desktop"})
    with pytest.raises(cr.CredentialsError) as e:
        cr.lookup(auth, "registry.lab")
    assert e.value.code == "unsupported"
    assert "docker-credential-desktop" in str(e.value) and '"credsStore"' in str(e.value)
    assert os.environ["PATH"] in str(e.value)


def test_a_failing_helper_is_quoted_from_its_stderr_first(tmp_path, helpers):
    helpers("broken", f"echo '{SECRET}'; echo 'no session: run login first' >&2; exit 3")
    auth = auth_file(tmp_path, {"credHelpers": {"registry.lab": "broken"}})
    with pytest.raises(cr.CredentialsError) as e:
        cr.lookup(auth, "registry.lab")
    assert e.value.code == "permission"
    assert "exit 3: no session: run login first" in str(e.value) and SECRET not in str(e.value)


def test_a_failing_helper_that_says_why_on_stdout_is_quoted_from_there(tmp_path, helpers):
    # docker-credential-helpers print their errors to stdout
    helpers("pass", "echo 'error getting credentials - err: exit status 2, out: gpg: decryption failed'; exit 1")
    with pytest.raises(cr.CredentialsError) as e:
        cr.lookup(auth_file(tmp_path, {"credsStore": "pass"}), "registry.lab")
    assert "(exit 1: error getting credentials - err: exit status 2, out: gpg: decryption failed)" in str(e.value)


@pytest.mark.parametrize("script", ["echo 'not json'", "echo '[1]'", "echo '{\"Username\": 1, \"Secret\": 2}'"])
def test_a_helper_answer_that_is_not_credentials_is_a_bad_request(tmp_path, helpers, script):
    helpers("odd", script)
    with pytest.raises(cr.CredentialsError) as e:
        cr.lookup(auth_file(tmp_path, {"credHelpers": {"registry.lab": "odd"}}), "registry.lab")
    assert e.value.code == "bad_request" and "docker-credential-odd" in str(e.value)


def test_a_helper_that_hangs_is_given_up_with_what_it_started(tmp_path, helpers):
    pidfile = tmp_path / "child.pid"
    helpers("slow", f"sleep 30 & echo $! > {pidfile}; wait")
    with pytest.raises(cr.CredentialsError) as e:
        cr.lookup(auth_file(tmp_path, {"credHelpers": {"registry.lab": "slow"}}), "registry.lab", timeout=0.5)
    assert e.value.code == "permission" and "within 0.5 s" in str(e.value)
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child), "the helper's own child outlived the timeout"


def test_a_stop_kills_a_helper_still_running(tmp_path, helpers):
    pidfile = tmp_path / "child.pid"
    helpers("slow", f"sleep 30 & echo $! > {pidfile}; wait")
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(cr.CredentialsError) as e:
        cr.lookup(auth_file(tmp_path, {"credsStore": "slow"}), "registry.lab", stop=stop)
    assert e.value.code == "conflict" and time.monotonic() - started < 2.0
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child)


@pytest.mark.parametrize("name", ["../../bin/sh", "a b", "-x"])
def test_a_helper_name_that_is_not_a_name_is_refused(tmp_path, helpers, name):
    auth = auth_file(tmp_path, {"credHelpers": {"registry.lab": name}})
    with pytest.raises(cr.CredentialsError) as e:
        cr.lookup(auth, "registry.lab")
    assert e.value.code == "bad_request" and "not a credential helper's name" in str(e.value)
