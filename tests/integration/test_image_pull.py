"""`image pull` from registries on loopback: names, multi-platform indexes,
gzip/zstd/plain layers, whiteouts, a base stored once, auth, TLS, claims
shared by daemons on one store, resumption, and hostile registries."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import Daemon, skip_unless_microvm
from image_kit import INDEX, Layout, _entry, _file, _tar_bytes, layer_of, push, rootfs_layer, sha256
from registry_kit import (
    FakeRegistry,
    Registry,
    auth_json,
    credential_helper,
    free_port,
    missing_tools,
)

from dsecd.errors import BadRequest, DsecError, NotFound, PermissionDenied

pytestmark = pytest.mark.skipif(missing_tools() is not None, reason=missing_tools() or "")


def _layers(busybox: bytes) -> dict[str, bytes]:
    """The tar layers the images are made of (busybox is the shared base)."""
    return {
        "base": busybox,
        "files": _tar_bytes([_entry("data", tarfile.DIRTYPE, mode=0o755), _file("data/a", b"a"),
                             _file("data/b", b"b"), _file("etc/gone", b"x"), _file("app/zstd.txt", b"zstd layer\n")]),
        "whiteouts": _tar_bytes([_file("etc/.wh.gone"), _entry("data", tarfile.DIRTYPE, mode=0o755),
                                 _file("data/.wh..wh..opq"), _file("data/c", b"c"), _file("app/plain.txt", b"plain\n")]),
        "arm": _tar_bytes([_file("arch.txt", b"arm64\n")]),
        "v2": _tar_bytes([_file("app/v2.txt", b"v2\n")]),
    }


@pytest.fixture(scope="module")
def world(busybox_rootfs, tmp_path_factory):
    """A registry with app:v1 (amd64 + arm64 index), app:v2 (same base) and a
    daemon that trusts it as an insecure (plain HTTP) registry."""
    tmp = tmp_path_factory.mktemp("pull")
    reg = Registry(tmp / "registry").start()
    d = None
    try:
        L = _layers(rootfs_layer(busybox_rootfs))
        layout = Layout(tmp / "layout")
        amd = layout.image([(L["base"], "gzip"), (L["files"], "zstd"), (L["whiteouts"], "tar")],
                           {"User": "1000", "Env": ["LANG=C.UTF-8"], "WorkingDir": "/app"}, "amd64")
        arm = layout.image([(L["base"], "gzip"), (L["arm"], "gzip")], {}, "arm64")
        layout.tag("v1", layout.index([amd, arm]))
        layout.tag("v2", layout.image([(L["base"], "gzip"), (L["v2"], "zstd")], {}, "amd64"))
        push(layout, "v1", f"{reg.host}/test/app:v1")
        push(layout, "v2", f"{reg.host}/test/app:v2")
        d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")),
                   f'[images]\ninsecure_registries = ["{reg.host}"]\ndefault_registry = "{reg.host}"\n')
        d.start()
        yield {"reg": reg, "daemon": d, "layers": L, "tmp": tmp}
    finally:
        if d is not None:
            d.cleanup()
        reg.stop()


@pytest.fixture
def c(world):
    client = world["daemon"].client()
    yield client
    client.close()


def store_blobs(d: Daemon) -> set[str]:
    return set(os.listdir(d.state / "store" / "blobs" / "sha256"))


def test_pull_index_picks_host_platform_converts_every_layer_and_runs(world, c):
    reg = world["reg"]
    events = []
    img = c.pull_image(f"{reg.host}/test/app:v1", progress=events.append)
    assert img["name"] == f"{reg.host}/test/app:v1"
    assert img["source"]["platform"] == "linux/amd64" and img["source"]["index"]
    assert len(img["layers"]) == 3
    assert img["config"]["user"] == "1000" and img["config"]["cwd"] == "/app"
    assert img["config"]["env"] == {"LANG": "C.UTF-8"}
    steps = {e["step"] for e in events}
    assert {"resolve", "pull"} <= steps
    finals = {e["layer"]: e["state"] for e in events if e["step"] == "pull"}
    assert set(finals.values()) == {"stored"} and len(finals) == 3
    sb = c.create(image=img["name"])
    try:
        assert sb.exec(["cat", "/app/zstd.txt", "/app/plain.txt"]).stdout == b"zstd layer\nplain\n"
        assert sb.exec(["ls", "/data"]).stdout.split() == [b"c"]            # opaque dir
        assert sb.exec(["test", "-e", "/etc/gone"]).exit_code == 1           # whiteout
        assert sb.exec(["id", "-u"]).stdout == b"1000\n"                      # the config's User
    finally:
        sb.destroy()


def test_platform_choice_and_a_platform_the_index_lacks(world, c):
    reg = world["reg"]
    img = c.pull_image(f"{reg.host}/test/app:v1", platform="linux/arm64")
    assert img["source"]["platform"] == "linux/arm64" and len(img["layers"]) == 2
    # Its programs cannot run on this host: a create says so (not "exec format error" at each exec).
    with pytest.raises(BadRequest, match=r"is for linux/arm64 \(pulled with --platform\); this host runs linux/"):
        c.create(image=f"{reg.host}/test/app:v1")
    # Nor in a call sandbox, which is made without a create.
    with pytest.raises(BadRequest, match=r"is for linux/arm64 \(pulled with --platform\)"):
        c.call(image=f"{reg.host}/test/app:v1", argv=["true"])
    # Nor under an image built on it, which would not know where it came from.
    ctx = world["tmp"] / "platform-ctx"
    ctx.mkdir(exist_ok=True)
    with pytest.raises(BadRequest, match=r"Dockerfile:1: FROM .*is for linux/arm64 \(pulled with --platform\)"):
        c.build_dockerfile(str(ctx), "on-arm", text=f"FROM {reg.host}/test/app:v1\nENV A=1\n")
    with pytest.raises(BadRequest, match=r"is for linux/arm64 \(pulled with --platform\)"):
        c.build_image(str(ctx), "on-arm", parent=f"{reg.host}/test/app:v1")
    with pytest.raises(NotFound, match="no image for linux/s390x"):
        c.pull_image(f"{reg.host}/test/app:v1", platform="linux/s390x")
    c.pull_image(f"{reg.host}/test/app:v1")         # back to this host's, for the tests below


def test_two_images_on_one_base_store_it_once(world, c):
    reg, d = world["reg"], world["daemon"]
    v1 = c.pull_image(f"{reg.host}/test/app:v1")
    v2 = c.pull_image(f"{reg.host}/test/app:v2")
    assert v2["pull"]["reused_layers"] == 1
    assert v1["layers"][0]["digest"] == v2["layers"][0]["digest"]
    base_blob = layer_blob(world["layers"]["base"])
    assert reg.blob_gets(base_blob) == 1, "the shared base was downloaded more than once"
    du = c.request("image_du")
    assert du["shared_layer_bytes"] >= v1["layers"][0]["bytes"]
    assert v1["layers"][0]["digest"][7:] in store_blobs(d)


def test_repull_is_up_to_date_and_names_resolve_every_way(world, c):
    reg = world["reg"]
    ref = f"{reg.host}/test/app:v1"
    again = c.pull_image(ref)
    assert again["pull"]["up_to_date"] is True
    by_digest = c.pull_image(f"{reg.host}/test/app@{again['source']['index']}")
    assert by_digest["manifest"] == again["manifest"]
    assert by_digest["name"] == f"{reg.host}/test/app@{again['source']['index']}"
    names = [i["name"] for i in c.list_images()]
    assert ref in names and by_digest["name"] in names
    assert c.request("image_inspect", name=ref)["source"]["ref"] == ref
    c.request("image_rm", name=by_digest["name"])
    with pytest.raises(NotFound):
        c.request("image_inspect", name=by_digest["name"])
    # A short name resolves in images.default_registry; rm says which name it removed.
    short = c.pull_image("test/app:v2")
    assert short["name"] == f"{reg.host}/test/app:v2"
    removed = world["daemon"].cli("image", "rm", "test/app:v2")
    assert removed.stdout.decode().startswith(f"removed image name {reg.host}/test/app:v2 "), removed
    with pytest.raises(BadRequest, match="an image name is"):
        c.request("image_inspect", name="Bad/Name:x")


def test_cli_pull_prints_the_result_alone_off_a_terminal_and_bars_on_one(world):
    reg, d = world["reg"], world["daemon"]
    ref = f"{reg.host}/test/app:v2"
    out = d.cli("image", "pull", ref, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["name"] == ref and out.stderr == b""
    plain = d.cli("image", "pull", ref)
    assert plain.returncode == 0 and plain.stdout.decode().startswith(f"up to date {ref}:")
    assert plain.stderr == b""
    c = d.client()
    c.request("image_rm", name=ref)
    c.close()
    # On a terminal (script(1) gives dsec a pty): per-layer bars.
    dsec = str(Path(sys.executable).parent / "dsec")
    tty = subprocess.run(["script", "-qec", f"{dsec} --socket {d.socket} image pull {ref}", "/dev/null"],
                         capture_output=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    text = tty.stdout.decode(errors="replace")
    assert tty.returncode == 0, text
    assert "layer 2/2" in text and f"pulled {ref}" in text


def test_cli_pull_of_a_bare_name_says_when_a_local_image_has_it(world, busybox_rootfs):
    """`dsec image pull app` stores <registry>/app:latest, but a local image
    named app is what `app` names (local names first): the CLI says so, or
    the next `dsec run app` runs the other image without a word."""
    reg, d = world["reg"], world["daemon"]
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{reg.host}/test/app:v2", f"docker://{reg.host}/shadowed:latest"],
                   check=True, capture_output=True, timeout=120)
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "shadowed")
        out = d.cli("image", "pull", "shadowed")
        assert out.returncode == 0, out.stderr
        assert out.stdout.decode().startswith(f"pulled {reg.host}/shadowed:latest")
        warning = out.stderr.decode()
        assert "'shadowed' names the local image shadowed" in warning, warning
        assert f"{reg.host}/shadowed:latest" in warning
        c.remove_image("shadowed")
        again = d.cli("image", "pull", "shadowed")         # no local image: the name finds the pulled one
        assert again.returncode == 0 and again.stderr == b"", again.stderr
    finally:
        for name in ("shadowed", f"{reg.host}/shadowed:latest"):
            with contextlib.suppress(NotFound):
                c.remove_image(name)
        c.close()


def _pull_and_run(d: Daemon, ref: str) -> None:
    """`ref` pulled through daemon `d`, and a sandbox of it runs `true`."""
    c = d.client()
    img = c.pull_image(ref)
    sb = c.create(image=img["name"])
    assert sb.exec(["true"]).exit_code == 0
    sb.destroy()
    c.close()


def test_auth_registry(busybox_rootfs, tmp_path, daemon_factory):
    reg = Registry(tmp_path / "reg", auth=("tester", "s3cret-pw")).start()
    try:
        layout = Layout(tmp_path / "layout")
        layout.tag("v1", layout.image([(rootfs_layer(busybox_rootfs), "gzip")]))
        push(layout, "v1", f"{reg.host}/private/app:v1", *reg.push_args())
        anon = daemon_factory(f'[images]\ninsecure_registries = ["{reg.host}"]\n')
        c = anon.client()
        with pytest.raises(PermissionDenied, match=r"asks for a user and password \(anonymously\); give credentials"):
            c.pull_image(f"{reg.host}/private/app:v1")
        c.close()
        auth = auth_json(tmp_path / "auth.json", reg.host, "tester", "s3cret-pw")
        d = daemon_factory(f'[images]\ninsecure_registries = ["{reg.host}"]\nauth_file = "{auth}"\n')
        _pull_and_run(d, f"{reg.host}/private/app:v1")
        assert "s3cret-pw" not in d.log.read_text() and "s3cret-pw" not in anon.log.read_text()
    finally:
        reg.stop()


def test_credentials_from_a_credential_helper_on_the_daemons_path(busybox_rootfs, tmp_path, daemon_factory,
                                                                  monkeypatch):
    """auth.json's "credHelpers": the daemon runs docker-credential-<name>
    from its PATH when the registry asks, as docker does."""
    reg = Registry(tmp_path / "reg", auth=("tester", "h3lper-pw")).start()
    try:
        layout = Layout(tmp_path / "layout")
        layout.tag("v1", layout.image([(rootfs_layer(busybox_rootfs), "gzip")]))
        push(layout, "v1", f"{reg.host}/private/app:v1", *reg.push_args())
        credential_helper(tmp_path / "bin", "lab", reg.host, "tester", "h3lper-pw")
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        auth = tmp_path / "auth.json"
        auth.write_text(json.dumps({"credHelpers": {reg.host: "lab"}}))
        d = daemon_factory(f'[images]\ninsecure_registries = ["{reg.host}"]\nauth_file = "{auth}"\n')
        _pull_and_run(d, f"{reg.host}/private/app:v1")
        assert "h3lper-pw" not in d.log.read_text()
    finally:
        reg.stop()


def test_tls_registry_with_a_test_ca(busybox_rootfs, tmp_path, daemon_factory):
    reg = Registry(tmp_path / "reg", tls=True).start()
    try:
        layout = Layout(tmp_path / "layout")
        layout.tag("v1", layout.image([(rootfs_layer(busybox_rootfs), "zstd")]))
        push(layout, "v1", f"{reg.host}/tls/app:v1", *reg.push_args())
        untrusting = daemon_factory("")
        c = untrusting.client()
        with pytest.raises(DsecError, match="certificate"):
            c.pull_image(f"{reg.host}/tls/app:v1")
        c.close()
        certs = tmp_path / "certs.d"
        (certs / reg.host).mkdir(parents=True)
        (certs / reg.host / "ca.crt").write_bytes(reg.ca.read_bytes())
        d = daemon_factory(f'[images]\ncerts_dir = "{certs}"\n')
        c = d.client()
        assert len(c.pull_image(f"{reg.host}/tls/app:v1")["layers"]) == 1
        c.close()
    finally:
        reg.stop()


# ---------------------------------------------------------------- a fake registry: claims, resumption, lies


@pytest.fixture
def fake():
    f = FakeRegistry().start()
    yield f
    f.stop()


def fake_image(tmp: Path, fake: FakeRegistry, repo: str, layers: list[tuple[bytes, str]],
               config_patch: dict | None = None) -> tuple[Layout, dict]:
    layout = Layout(tmp / f"layout-{repo.replace('/', '-')}")
    desc = layout.image(layers)
    if config_patch:
        manifest = json.loads((layout.root / "blobs" / "sha256" / desc["digest"][7:]).read_bytes())
        cfg = json.loads((layout.root / "blobs" / "sha256" / manifest["config"]["digest"][7:]).read_bytes())
        cfg.update(config_patch)
        manifest["config"] = layout.blob(json.dumps(cfg).encode(), manifest["config"]["mediaType"])
        desc = {**layout.blob(json.dumps(manifest).encode(), desc["mediaType"]), "platform": desc["platform"]}
    fake.put_layout(repo, "v1", layout, desc)
    return layout, desc


def layer_blob(tar: bytes, kind: str = "gzip") -> str:
    from image_kit import compress

    return sha256(compress(tar, kind)[0])


def _repeating_image(tmp_path, fake, busybox_rootfs, name: str, again: str) -> bytes:
    """`name`:v1 on the fake registry: busybox, a marker layer, a layer
    that changes the marker, the marker layer again (compressed by
    `again`); the marker layer's tar."""
    marker = _tar_bytes([_file("marker.txt", b"once\n")])
    middle = _tar_bytes([_file("marker.txt", b"middle\n")])
    fake_image(tmp_path, fake, name, [(rootfs_layer(busybox_rootfs), "gzip"), (marker, "gzip"), (middle, "tar"),
                                      (marker, again)])
    return marker


def test_a_diff_id_the_image_repeats_is_fetched_once(busybox_rootfs, tmp_path, daemon_factory, fake):
    """Older images repeat a layer (the same empty layer, say), even under
    another compression: one copy is fetched and converted, the others take
    its stored layer."""
    marker = _repeating_image(tmp_path, fake, busybox_rootfs, "repeat/app", "zstd")
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\n')
    c = d.client()
    events = []
    img = c.pull_image(f"{fake.host}/repeat/app:v1", progress=events.append)
    assert fake.gets[layer_blob(marker, "gzip")] + fake.gets[layer_blob(marker, "zstd")] == 1
    assert img["pull"]["reused_layers"] == 1
    layers = [layer["digest"] for layer in img["layers"]]
    assert len(layers) == 4 and layers[1] == layers[3]
    last = {e["layer"]: e for e in events if e.get("step") == "pull"}
    assert [last[i]["state"] for i in range(4)] == ["stored", "stored", "stored", "reused"] or \
        [last[i]["state"] for i in range(4)] == ["stored", "reused", "stored", "stored"], last
    sb = c.create(image=img["name"])
    try:
        assert sb.exec(["cat", "/marker.txt"]).stdout == b"once\n"        # the top layer's copy wins
    finally:
        sb.destroy()
    c.close()


def test_an_image_that_repeats_a_layer_runs_in_a_microvm(busybox_rootfs, tmp_path, daemon_factory, fake):
    """A microVM gets each of the image's layers as a pmem device of its own,
    a repeated one twice (QEMU maps the same store file twice), and the
    guest stacks their EROFS mounts, distinct mounts that overlay takes."""
    _repeating_image(tmp_path, fake, busybox_rootfs, "repeat/vm", "gzip")
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\n[microvm]\ntemplates = false\n')
    c = d.client()
    skip_unless_microvm(c)
    try:
        img = c.pull_image(f"{fake.host}/repeat/vm:v1")
        assert len(img["layers"]) == 4
        sb = c.create(image=img["name"], backend="microvm", memory="256M", net="none")
        try:
            assert sb.inspect()["vm"]["template"] is None           # booted with the image's four layers
            assert sb.exec(["cat", "/marker.txt"]).stdout == b"once\n"
            assert sb.exec(["sh", "-c", "echo kept > /w && cat /w"]).stdout == b"kept\n"
        finally:
            sb.destroy()
    finally:
        c.close()


def test_a_pull_tries_the_registrys_mirrors_first(busybox_rootfs, tmp_path, daemon_factory, fake):
    """images.mirrors, in order: one that is down, one that serves the image
    under a path prefix; the registry itself only for what no mirror has."""
    layout, desc = fake_image(tmp_path, fake, "team/app", [(rootfs_layer(busybox_rootfs), "gzip"),
                                                           (_tar_bytes([_file("app.txt", b"app\n")]), "gzip")])
    fake_image(tmp_path, fake, "team/new", [(rootfs_layer(busybox_rootfs), "gzip"),
                                            (_tar_bytes([_file("new.txt", b"new\n")]), "gzip")])
    mirror = FakeRegistry().start()
    down = f"127.0.0.1:{free_port()}"
    try:
        mirror.put_layout("hub/team/app", "v1", layout, desc)
        d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}", "{mirror.host}", "{down}"]\n'
                           f'[images.mirrors]\n"{fake.host}" = ["{down}", "{mirror.host}/hub"]\n')
        c = d.client()
        events = []
        img = c.pull_image(f"{fake.host}/team/app:v1", progress=events.append)
        assert img["pull"]["registry"] == mirror.host and img["name"] == f"{fake.host}/team/app:v1"
        assert sum(mirror.gets.values()) == 3 and sum(fake.gets.values()) == 0       # its config and 2 layers
        assert [(e["mirror"], e["next"]) for e in events if e["step"] == "mirror"] == [(down, mirror.host)]
        assert "cannot reach" in next(e["error"] for e in events if e["step"] == "mirror")
        assert [e["registry"] for e in events if e["step"] == "resolve"] == [mirror.host]
        sb = c.create(image=img["name"])
        try:
            assert sb.exec(["cat", "/app.txt"]).stdout == b"app\n"
        finally:
            sb.destroy()
        c.request("image_rm", name=img["name"])
        out = d.cli("image", "pull", f"{fake.host}/team/app:v1")
        assert out.returncode == 0, out.stderr
        assert out.stdout.decode().startswith(f"pulled {fake.host}/team/app:v1: ")
        assert out.stdout.decode().rstrip().endswith(f", from the mirror {mirror.host}")
        # No mirror has it: the registry serves it, and only the layer the store lacks.
        events.clear()
        img = c.pull_image(f"{fake.host}/team/new:v1", progress=events.append)
        assert img["pull"]["registry"] == fake.host and img["pull"]["reused_layers"] == 1
        assert [e["mirror"] for e in events if e["step"] == "mirror"] == [down, mirror.host]
        assert "no such name" in [e for e in events if e["step"] == "mirror"][1]["error"]
        c.close()
    finally:
        mirror.stop()


def _pull_past_a_failing_mirror(tmp_path, fake, daemon_factory, repo: str, layers: list, break_it) -> tuple:
    """`repo`:v1 of `layers` on the registry and on one mirror of it, which
    `break_it(mirror)` makes fail: (the pull's result, its progress events)."""
    layout, desc = fake_image(tmp_path, fake, repo, layers)
    mirror = FakeRegistry().start()
    try:
        mirror.put_layout(repo, "v1", layout, desc)
        break_it(mirror)
        d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}", "{mirror.host}"]\n'
                           f'[images.mirrors]\n"{fake.host}" = ["{mirror.host}"]\n')
        c = d.client()
        events = []
        img = c.pull_image(f"{fake.host}/{repo}:v1", progress=events.append)
        c.close()
    finally:
        mirror.stop()
    assert img["pull"]["registry"] == fake.host
    return img, events


def test_a_mirror_that_fails_mid_pull_leaves_its_layers_to_the_registrys_pull(busybox_rootfs, tmp_path,
                                                                           daemon_factory, fake):
    small = _tar_bytes([_file("small.bin", os.urandom(64 << 10))])
    cut = _tar_bytes([_file("cut.bin", os.urandom(256 << 10))])
    # every GET of `cut` from the mirror ends halfway, resumed ones too
    img, events = _pull_past_a_failing_mirror(
        tmp_path, fake, daemon_factory, "team/cut",
        [(rootfs_layer(busybox_rootfs), "gzip"), (small, "gzip"), (cut, "gzip")],
        lambda mirror: mirror.cut.add(layer_blob(cut)))
    assert "truncated" in next(e["error"] for e in events if e["step"] == "mirror")
    assert fake.gets[layer_blob(cut)] == 1 and fake.gets[layer_blob(small)] == 0
    assert img["pull"]["reused_layers"] == 2


def test_a_rate_limited_mirror_hands_over_to_the_registry(busybox_rootfs, tmp_path, daemon_factory, fake):
    extra = _tar_bytes([_file("extra.bin", os.urandom(32 << 10))])
    # pull_retries = 2: three answers from the mirror, all 429
    _, events = _pull_past_a_failing_mirror(
        tmp_path, fake, daemon_factory, "team/busy", [(rootfs_layer(busybox_rootfs), "gzip"), (extra, "gzip")],
        lambda mirror: mirror.fail.__setitem__(layer_blob(extra), [429] * 3))
    assert "429" in next(e["error"] for e in events if e["step"] == "mirror")
    assert fake.gets[layer_blob(extra)] == 1


def test_mirrors_that_are_not_hosts_stop_the_start(tmp_path, daemon_factory):
    d = daemon_factory('[images.mirrors]\n"docker.io" = ["https://mirror.gcr.io"]\n', start=False)
    with pytest.raises(RuntimeError, match=r"the mirrors of 'docker.io' must be a list of host\[:port\]\[/path\]"):
        d.start()


def test_concurrent_pulls_of_images_on_one_base_download_it_once(busybox_rootfs, tmp_path, daemon_factory, fake):
    """Two images on one new base, pulled at once (task images of one
    benchmark): one pull downloads the base, the other waits for it and
    reuses it."""
    base = _tar_bytes([_file("base.bin", os.urandom(4 << 20))])
    fake_image(tmp_path, fake, "share/one", [(rootfs_layer(busybox_rootfs), "gzip"), (base, "gzip"),
                                            (layer_of({"one": b"1\n"}), "gzip")])
    fake_image(tmp_path, fake, "share/two", [(rootfs_layer(busybox_rootfs), "gzip"), (base, "gzip"),
                                            (layer_of({"two": b"2\n"}), "gzip")])
    fake.slow[layer_blob(base, "gzip")] = 2.0
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\n')
    results, errors = {}, []

    def pull(name):
        try:
            c = d.client()
            results[name] = c.pull_image(f"{fake.host}/share/{name}:v1")
            c.close()
        except Exception as err:   # reported below
            errors.append(err)

    threads = [threading.Thread(target=pull, args=(n,)) for n in ("one", "two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert fake.gets[layer_blob(base, "gzip")] == 1, "two pulls downloaded the same layer"
    assert fake.gets[layer_blob(rootfs_layer(busybox_rootfs), "gzip")] == 1
    assert results["one"]["layers"][1]["digest"] == results["two"]["layers"][1]["digest"]


def test_concurrent_daemons_on_one_store_download_once(busybox_rootfs, tmp_path, daemon_factory, fake):
    big = _tar_bytes([_file("big.bin", os.urandom(4 << 20))])
    fake_image(tmp_path, fake, "shared/app", [(rootfs_layer(busybox_rootfs), "gzip"), (big, "tar")])
    fake.slow[sha256(big)] = 2.0
    store = tmp_path / "store"
    config = f'[images]\nstore = "{store}"\ninsecure_registries = ["{fake.host}"]\n'
    a, b = daemon_factory(config), daemon_factory(config)
    results, errors = {}, []

    def pull(name, d):
        try:
            c = d.client()
            results[name] = c.pull_image(f"{fake.host}/shared/app:v1")
            c.close()
        except Exception as err:   # reported below
            errors.append(err)

    threads = [threading.Thread(target=pull, args=(n, d)) for n, d in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert fake.gets[sha256(big)] == 1, "two daemons on one store downloaded the same layer"
    assert results["a"]["manifest"] == results["b"]["manifest"]
    assert max(r["pull"]["waited_s"] for r in results.values()) > 0.3


def test_a_dead_holders_claim_is_broken(busybox_rootfs, tmp_path, daemon_factory, fake):
    _, desc = fake_image(tmp_path, fake, "stale/app", [(rootfs_layer(busybox_rootfs), "gzip")])
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\n')
    pulls = d.state / "store" / "pulls"
    pulls.mkdir(parents=True, exist_ok=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (pulls / f"{desc['digest'][7:]}.claim").write_text(json.dumps(
        {"host": os.uname().nodename, "pid": dead.pid, "start": "1", "token": "x"}))
    c = d.client()
    t = time.monotonic()
    assert c.pull_image(f"{fake.host}/stale/app:v1")["pull"]["waited_s"] < 5
    assert time.monotonic() - t < 30
    c.close()


def test_a_cancelled_pull_resumes_with_the_layers_it_stored(busybox_rootfs, tmp_path, daemon_factory, fake):
    from dsecd.client import Client

    first = rootfs_layer(busybox_rootfs)
    slow = _tar_bytes([_file("slow.bin", os.urandom(2 << 20))])
    fake_image(tmp_path, fake, "resume/app", [(first, "gzip"), (slow, "tar")])
    fake.slow[sha256(slow)] = 30.0
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\n')
    ref = f"{fake.host}/resume/app:v1"
    first_stored = d.state / "store" / "diffids" / sha256(first)[7:]

    async def pull_then_cancel():
        async with Client(d.socket) as client:
            task = asyncio.ensure_future(client.pull_image(ref))
            deadline = time.monotonic() + 60
            while not first_stored.exists():
                assert time.monotonic() < deadline, "the first layer was never stored"
                await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(pull_then_cancel())
    c = d.client()
    with pytest.raises(NotFound):
        c.request("image_inspect", name=ref)                 # nothing published
    fake.slow.clear()
    img = c.pull_image(ref)
    assert img["pull"]["reused_layers"] == 1
    assert fake.gets[layer_blob(first)] == 1, "the stored layer was downloaded again"
    c.close()


def test_cancelling_a_pull_stalled_on_a_blob_frees_its_slot_at_once(busybox_rootfs, tmp_path, daemon_factory,
                                                                     fake):
    """The registry sends a blob's first bytes, then nothing: the cancelled
    pull aborts that connection instead of waiting out its read timeout
    (60 s), so the next pull (one slot: images.max_pulls = 1) starts and
    finishes at once."""
    from dsecd.client import Client

    stalled = _tar_bytes([_file("stalled.bin", os.urandom(1 << 20))])
    fake_image(tmp_path, fake, "stall/app", [(rootfs_layer(busybox_rootfs), "gzip"), (stalled, "tar")])
    fake.stall.add(sha256(stalled))
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\nmax_pulls = 1\n')
    ref = f"{fake.host}/stall/app:v1"

    async def pull_then_cancel():
        async with Client(d.socket) as client:
            task = asyncio.ensure_future(client.pull_image(ref))
            deadline = time.monotonic() + 60
            while not fake.gets[sha256(stalled)]:
                assert time.monotonic() < deadline, "the stalled blob was never asked for"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)                    # its first bytes read, the rest never coming
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(pull_then_cancel())
    fake.stall.clear()
    c = d.client()
    t = time.monotonic()
    img = c.pull_image(ref)
    assert time.monotonic() - t < 20, "the cancelled pull held its slot until its read timed out"
    assert img["pull"]["reused_layers"] == 1
    c.close()


def test_layer_progress_counts_the_bytes_as_they_come(busybox_rootfs, tmp_path, daemon_factory, fake):
    slow = _tar_bytes([_entry("d", tarfile.DIRTYPE, mode=0o750), _file("d/big.bin", os.urandom(3 << 20)),
                       _file("d/small.txt", b"small\n"), _entry("d/link", tarfile.SYMTYPE, linkname="small.txt"),
                       _file("etc/.wh.hostname")])
    fake_image(tmp_path, fake, "stream/app", [(rootfs_layer(busybox_rootfs), "gzip"), (slow, "gzip")])
    target = layer_blob(slow, "gzip")
    fake.slow[target] = 2.0
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\n')
    c = d.client()
    events = []
    img = c.pull_image(f"{fake.host}/stream/app:v1", progress=events.append)
    mine = [e for e in events if e.get("step") == "pull" and e["digest"] == target]
    size = mine[0]["size"]
    during = [e["bytes"] for e in mine if e["state"] == "downloading"]
    assert any(0 < b < size for b in during), f"no progress seen while the layer came: {mine}"
    assert during == sorted(during), "a layer's bytes went backwards"
    assert mine[-1]["state"] == "stored" and mine[-1]["bytes"] == size
    assert img["pull"]["downloaded_bytes"] == sum(e["size"] for e in events
                                                  if e.get("step") == "pull" and e["state"] == "waiting")
    sb = c.create(image=img["name"])
    try:
        assert sb.exec(["cat", "/d/link"]).stdout == b"small\n"
        assert sb.exec(["test", "-e", "/etc/hostname"]).exit_code == 1
    finally:
        sb.destroy()
    assert not list((d.state / "scratch").iterdir()) and not pull_mounts(d), "a conversion left its tree"
    c.close()


def assert_a_failed_pull_left_nothing(c, d, ref: str, before) -> None:
    """After a refused pull of `ref` on daemon `d`: no name, and once
    collected, the blobs of `before` (store_blobs), no half-written layer
    in the store's tmp/, no conversion tree, blob file or mount."""
    assert ref not in [i["name"] for i in c.list_images()]
    c.request("image_gc")
    assert store_blobs(d) == before, "a failed pull left blobs behind"
    assert not list((d.state / "store" / "tmp").iterdir()), "a half-written layer is left in the store"
    assert not list((d.state / "scratch").iterdir()) and not pull_mounts(d), "a conversion tree is left"


def pull_mounts(d) -> list[str]:
    """The tmpfs mounts of converting layers (pull-mem-*) of daemon `d` now
    (another test's daemon may still be converting a pull it cancelled)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p.startswith(f"{d.state}/") and "/pull-mem-" in p]


def test_a_layer_too_big_for_the_tmpfs_is_unpacked_on_disk_into_the_same_layer(busybox_rootfs, tmp_path,
                                                                               daemon_factory, fake):
    # 2 MiB of zeros: a few KiB compressed (under the 256 KiB cap, so the tmpfs
    # is tried), 2 MiB unpacked (over it: ENOSPC, then the scratch disk). Its
    # PAX global header is what the direct EROFS writer leaves to this path.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "g"}) as tf:
        for info, data in [_entry("d", tarfile.DIRTYPE, mode=0o755), _file("d/zeros", bytes(2 << 20)),
                           _entry("d/link", tarfile.SYMTYPE, linkname="zeros"), _file("d/.wh..wh..opq")]:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    big = buf.getvalue()
    small = _tar_bytes([_file("small.txt", b"small\n")])
    fake_image(tmp_path, fake, "cap/app", [(rootfs_layer(busybox_rootfs), "gzip"), (big, "gzip"), (small, "zstd")])
    ref = f"{fake.host}/cap/app:v1"
    layers = {}
    for cap in ("256K", "1G", "0"):
        d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\npull_tmpfs = "{cap}"\n')
        c = d.client()
        events = []
        img = c.pull_image(ref, progress=events.append)
        layers[cap] = [layer["digest"] for layer in img["layers"]]
        # The layer is read twice (the writer stops at its PAX global
        # header, then the blob is fetched again for unpack-and-mkfs): its
        # progress still only goes forward, and ends at its size.
        mine = [e for e in events if e.get("step") == "pull" and e["layer"] == 1]
        counts = [e["bytes"] for e in mine]
        assert counts == sorted(counts), f"the progress went back: {mine}"
        assert mine[-1]["state"] == "stored" and counts[-1] == mine[-1]["size"], mine
        sb = c.create(image=img["name"])
        try:
            assert sb.exec(["wc", "-c", "/d/link"]).stdout.split()[0] == str(2 << 20).encode()
            assert sb.exec(["cat", "/small.txt"]).stdout == b"small\n"
        finally:
            sb.destroy()
        assert not list((d.state / "scratch").iterdir()), "a conversion left its tree in the scratch dir"
        assert not pull_mounts(d), "a conversion tmpfs is still mounted"
        c.close()
    assert layers["256K"] == layers["1G"] == layers["0"], "tmpfs and disk conversions differ"


def _sparse_tar(tmp: Path, size: int) -> bytes:
    """A tar (GNU tar -S) of one sparse file of `size` bytes: a few KiB."""
    src = tmp / "sparse-src"
    src.mkdir()
    with open(src / "hole", "wb") as f:
        f.truncate(size)
    out = tmp / "sparse.tar"
    subprocess.run(["tar", "-S", "-cf", str(out), "-C", str(src), "hole"], check=True)
    return out.read_bytes()


@pytest.mark.parametrize("shape", ["zeros", "sparse", "trailing"])
def test_a_layer_that_unpacks_past_max_layer_bytes_is_refused_before_it_is_written(
        busybox_rootfs, tmp_path, daemon_factory, fake, shape):
    # 8 MiB of zeros gzip to ~8 KiB (the direct EROFS writer's path); a
    # 64 MiB sparse file is ~10 KiB of tar (unpack-and-mkfs, which would
    # write every byte of it). Both are `limit` at a 4 MiB bound, before
    # the store or the scratch disk hold the bytes.
    # A small tar followed by 8 MiB of zeros past its end (the diff_id
    # covers them: they are inflated and hashed) is bounded the same way.
    layer = {"zeros": lambda: _tar_bytes([_file("zeros", bytes(8 << 20))]),
             "sparse": lambda: _sparse_tar(tmp_path, 64 << 20),
             "trailing": lambda: _tar_bytes([_file("small", b"x")]) + bytes(8 << 20)}[shape]()
    assert len(gzip.compress(layer)) < 64 << 10
    fake_image(tmp_path, fake, "bomb/app", [(rootfs_layer(busybox_rootfs), "gzip"), (layer, "gzip")])
    ref = f"{fake.host}/bomb/app:v1"
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\nmax_layer_bytes = "4M"\n')
    c = d.client()
    before = store_blobs(d)
    with pytest.raises(DsecError) as e:
        c.pull_image(ref)
    assert e.value.code == "limit", e.value
    assert "max_layer_bytes (4194304 bytes" in str(e.value), e.value
    assert ("(sparse)" in str(e.value)) == (shape == "sparse"), e.value
    assert_a_failed_pull_left_nothing(c, d, ref, before)
    c.close()


# The code each hostile case fails with: the registry's fault (other bytes
# than the digest's, a cut blob, a manifest past any bound) is io, the
# image's (unsafe entries, a config that lies about its layers) bad_request.
HOSTILE_CODES = {"wrong_digest": "io", "truncated_blob": "io", "dotdot_entry": "bad_request",
                 "symlink_escape": "bad_request", "diff_id_mismatch": "bad_request", "index_loop": "unsupported",
                 "huge_manifest": "io"}


def hostile_cases(busybox: bytes) -> dict:
    return {
        "wrong_digest": ([(busybox, "gzip")], None, "lie", "not to the digest the manifest names"),
        "truncated_blob": ([(_tar_bytes([_file("f", os.urandom(1 << 20))]), "tar")], None, "cut",
                           "EOF|truncated|unexpected|short|length"),
        "dotdot_entry": ([(_tar_bytes([_file("../escape", b"pwned")]), "gzip")], None, None, "'..'"),
        "symlink_escape": ([(_tar_bytes([_entry("link", tarfile.SYMTYPE, linkname="/tmp"),
                                         _file("link/owned-by-pull", b"x")]), "gzip")], None, None,
                           "not a directory"),
        "diff_id_mismatch": ([(busybox, "gzip")], {"rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}},
                             None, "diff_id"),
    }


@pytest.mark.parametrize("case", ["wrong_digest", "truncated_blob", "dotdot_entry", "symlink_escape",
                                  "diff_id_mismatch", "index_loop", "huge_manifest"])
def test_hostile_registry_fails_clearly_and_leaves_nothing(case, busybox_rootfs, tmp_path, daemon_factory, fake):
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\n')
    c = d.client()
    before = store_blobs(d)
    ref = f"{fake.host}/evil/app:v1"
    if case == "index_loop":
        # An index can name itself only through a digest fixed point, which
        # nobody can compute; what a registry can serve is a chain of indexes,
        # each naming the one before (as deep as it likes). The first index
        # below an index is refused: nothing is followed forever.
        digest = sha256(b"the first index names nothing")
        for _ in range(3):
            index = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": [
                {"mediaType": INDEX, "digest": digest, "size": 10,
                 "platform": {"architecture": "amd64", "os": "linux"}}]}).encode()
            digest = fake.put_manifest("evil/app", "v1", index, INDEX)
        match = "another index"
    elif case == "huge_manifest":
        fake.put_manifest("evil/app", "v1", b'{"schemaVersion": 2, "x": "' + b"a" * (5 << 20) + b'"}',
                          "application/vnd.oci.image.manifest.v1+json")
        match = "sent more than 4 MiB"
    else:
        layers, patch, knob, match = hostile_cases(rootfs_layer(busybox_rootfs))[case]
        fake_image(tmp_path, fake, "evil/app", layers, patch)
        target = layer_blob(*layers[0])
        if knob == "lie":
            fake.lie[target] = fake.blobs[target][:-10] + b"0123456789"
        elif knob == "cut":
            fake.cut.add(target)
    with pytest.raises(DsecError, match=match) as info:
        c.pull_image(ref)
    assert info.value.code == HOSTILE_CODES[case]
    assert "evil/app" in str(info.value) or "sha256:" in str(info.value)
    assert not os.path.exists("/tmp/owned-by-pull") and not (d.state / "store" / "escape").exists()
    assert_a_failed_pull_left_nothing(c, d, ref, before)
    c.close()


@pytest.mark.parametrize("case", ["wrong_digest", "truncated_blob", "dotdot_entry"])
def test_a_bad_layer_found_while_it_downloads_fails_the_pull_and_leaves_nothing(case, busybox_rootfs, tmp_path,
                                                                                daemon_factory, fake):
    # The bad blob trickles in, so its conversion is under way when the end of
    # the stream shows it wrong (digest, length) or the tar parse does ('..').
    d = daemon_factory(f'[images]\ninsecure_registries = ["{fake.host}"]\n')
    c = d.client()
    before = store_blobs(d)
    ref = f"{fake.host}/evil/app:v1"
    layers, patch, knob, match = hostile_cases(rootfs_layer(busybox_rootfs))[case]
    payload = _tar_bytes([_file("pad.bin", os.urandom(2 << 20))])
    fake_image(tmp_path, fake, "evil/app", [(payload, "tar"), *layers], patch)
    target = layer_blob(*layers[0])
    fake.slow[target] = 2.0
    if knob == "lie":
        fake.lie[target] = fake.blobs[target][:-10] + b"0123456789"
    elif knob == "cut":
        fake.cut.add(target)
    with pytest.raises(DsecError, match=match) as info:
        c.pull_image(ref)
    assert info.value.code == HOSTILE_CODES[case]
    assert_a_failed_pull_left_nothing(c, d, ref, before)
    c.close()
