"""How a pull walks a registry's mirrors (fs/pull.py, Puller.pull), with the
pull from each source stood in for: the order, what each is asked with,
and which failures end the pull instead of going on."""

from __future__ import annotations

import pytest

from dsecd.fs.images import ImageStore
from dsecd.fs.pull import Puller, PullError, PullSettings, _Final
from dsecd.fs.registry import RegistryConfig, RegistryError, parse_mirrors


@pytest.fixture
def puller(tmp_path):
    cfg = RegistryConfig(retry_times=2, mirrors=parse_mirrors({"registry.lab": ["down.lab", "cache.lab/hub"]}))
    return Puller(ImageStore(tmp_path / "store", tmp_path / "scratch"), cfg, PullSettings())


def sources_answering(monkeypatch, answers: dict) -> list:
    """Puller._pull_from replaced: each source raises or returns its entry
    in `answers`; the (registry, repository, connect_retries) asked, in order."""
    asked = []

    def pull_from(self, registry, name, wanted, emit, cancelled, stats, deadline):
        asked.append((registry.registry, registry.repository, registry.cfg.connect_retries))
        answer = answers[registry.registry]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(Puller, "_pull_from", pull_from)
    return asked


def test_mirrors_are_asked_without_connect_retries_and_the_registry_with_them(puller, monkeypatch):
    asked = sources_answering(monkeypatch, {"down.lab": RegistryError("io", "cannot reach down.lab"),
                                            "cache.lab": PullError("not_found", "no such image"),
                                            "registry.lab": "the image"})
    events = []
    image, stats = puller.pull("registry.lab/a/b:v1", progress=events.append)
    assert asked == [("down.lab", "a/b", 0), ("cache.lab", "hub/a/b", 0), ("registry.lab", "a/b", None)]
    assert image == "the image" and stats["registry"] == "registry.lab"
    assert [(e["mirror"], e["next"]) for e in events] == [("down.lab", "cache.lab"), ("cache.lab", "registry.lab")]


@pytest.mark.parametrize("end", [_Final("busy", "another host's pull of it ran past pull_timeout_s"),
                                 _Final("conflict", "cancelled")])
def test_the_pulls_own_ends_stop_at_the_first_mirror(puller, monkeypatch, end):
    asked = sources_answering(monkeypatch, {"down.lab": end, "cache.lab": "unused", "registry.lab": "unused"})
    with pytest.raises(_Final):
        puller.pull("registry.lab/a/b:v1")
    assert [a[0] for a in asked] == ["down.lab"]


def test_the_last_sources_failure_is_the_pulls(puller, monkeypatch):
    sources_answering(monkeypatch, {"down.lab": RegistryError("io", "a"), "cache.lab": RegistryError("busy", "b"),
                                    "registry.lab": RegistryError("permission", "refused")})
    with pytest.raises(PullError) as e:          # what the engine turns into the protocol's error
        puller.pull("registry.lab/a/b:v1")
    assert e.value.code == "permission" and str(e.value) == "refused"


def test_a_registry_client_that_cannot_be_made_fails_the_pull_as_a_pull_error(tmp_path):
    certs = tmp_path / "certs" / "registry.lab"
    certs.mkdir(parents=True)
    (certs / "client.cert").write_text("no key beside it")
    puller = Puller(ImageStore(tmp_path / "store", tmp_path / "scratch"),
                    RegistryConfig(certs_dir=str(tmp_path / "certs")), PullSettings())
    with pytest.raises(PullError) as e:
        puller.pull("registry.lab/a/b:v1")
    assert e.value.code == "bad_request" and "client.key" in str(e.value)


@pytest.mark.parametrize("platform", ["bogus//x", "linux", "linux/amd64/v8/extra", "/amd64", "linux/AMD64",
                                      "linux/amd 64", "linux/amd64\n"])
def test_a_malformed_platform_is_refused_before_any_source_is_asked(puller, monkeypatch, platform):
    asked = sources_answering(monkeypatch, {"down.lab": "unused", "cache.lab": "unused", "registry.lab": "unused"})
    with pytest.raises(PullError) as e:
        puller.pull("registry.lab/a/b:v1", wanted=platform)
    assert e.value.code == "bad_request" and repr(platform) in str(e.value), e.value
    assert asked == []
