"""An image's config (dsecd/imageconfig.py), its users resolved against
/etc/passwd and /etc/group (dsecd/fs/users.py), and what an image archive
is and which of an index's images it takes (dsecd/fs/oci.py), without a
daemon."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import pytest

from dsecd import imageconfig, native
from dsecd.fs import oci, users
from dsecd.fs.images import ImageStore, _canonical
from dsecd.imageconfig import ConfigError

OCI_CONFIG = {"architecture": "amd64", "os": "linux", "config": {
    "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8", "EMPTY="], "WorkingDir": "/app", "User": "1000:1000",
    "Entrypoint": ["python3", "-m"], "Cmd": ["http.server"],
    "ExposedPorts": {"8080/tcp": {}, "53/udp": {}, "443/tcp": {}}, "Labels": {"version": "1.0"}}}


def test_an_oci_config_keeps_every_field_that_matters():
    cfg = imageconfig.from_oci(OCI_CONFIG)
    assert cfg == {"env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "EMPTY": ""}, "cwd": "/app",
                   "user": "1000:1000", "entrypoint": ["python3", "-m"], "cmd": ["http.server"],
                   "exposed_ports": ["443/tcp", "53/udp", "8080/tcp"], "labels": {"version": "1.0"}}
    assert tuple(cfg) == imageconfig.KEYS


def test_an_oci_config_that_names_nothing_is_the_default():
    assert imageconfig.from_oci({}) == imageconfig.default()
    assert imageconfig.from_oci({"config": {"Env": None, "Cmd": None, "Labels": None}}) == imageconfig.default()


@pytest.mark.parametrize("config, needle", [
    ({"WorkingDir": "relative"}, "WorkingDir"),
    ({"User": "a:b:c"}, "NAME:GROUP"),
    ({"User": "4294967295"}, "too large"),
    ({"Env": "PATH=/bin"}, "Env"),
    ({"Env": ["=x"]}, "Env"),
    ({"Cmd": [1]}, "Cmd"),
    ({"ExposedPorts": {"http": {}}}, "exposed port"),
    ({"ExposedPorts": {"70000/tcp": {}}}, "exposed port"),
    ({"Labels": {"a": 1}}, "Labels"),
])
def test_a_bad_oci_config_says_which_field(config, needle):
    with pytest.raises(ConfigError, match=needle):
        imageconfig.from_oci({"config": config})


def test_a_shell_form_string_command_runs_through_sh():
    cfg = imageconfig.from_oci({"config": {"Cmd": "echo hi"}})
    assert cfg["cmd"] == ["/bin/sh", "-c", "echo hi"]


def test_configs_of_older_daemons_are_read_in_todays_form():
    old = {"env": {"A": "1"}, "cwd": "/w", "user": 0, "entrypoint": ["python3", "app.py"]}
    assert imageconfig.normalise(old) == {**imageconfig.default(), "env": {"A": "1"}, "cwd": "/w",
                                          "entrypoint": ["python3", "app.py"]}
    assert imageconfig.normalise({**old, "user": 1000})["user"] == "1000"
    assert imageconfig.normalise(None) == imageconfig.default()
    new = imageconfig.from_oci(OCI_CONFIG)
    assert imageconfig.normalise(new) == new


def test_build_overrides_are_checked_and_stacked_like_a_dockerfile():
    below = imageconfig.from_oci(OCI_CONFIG)
    above = imageconfig.overrides(env={"LANG": "C", "NEW": "1"}, user=0, labels={"team": "rl"},
                                  exposed_ports=["9000", "53/UDP"])
    assert above == {"env": {"LANG": "C", "NEW": "1"}, "user": "0", "labels": {"team": "rl"},
                     "exposed_ports": ["53/udp", "9000/tcp"]}
    out = imageconfig.stack(below, above)
    assert out["env"] == {"PATH": "/usr/bin:/bin", "LANG": "C", "EMPTY": "", "NEW": "1"}
    assert out["labels"] == {"version": "1.0", "team": "rl"} and out["cmd"] == ["http.server"]
    # A new entrypoint drops the old cmd (its arguments), unless a cmd comes with it.
    assert imageconfig.stack(below, imageconfig.overrides(entrypoint=["sh"]))["cmd"] == []
    assert imageconfig.stack(below, imageconfig.overrides(entrypoint=["sh"], cmd=["-c", "x"]))["cmd"] == ["-c", "x"]
    with pytest.raises(ConfigError, match="cwd"):
        imageconfig.overrides(cwd="work")
    with pytest.raises(ConfigError, match="uid"):
        imageconfig.overrides(user=-1)


def test_run_argv_is_docker_runs():
    cfg = imageconfig.from_oci(OCI_CONFIG)
    assert imageconfig.run_argv(cfg) == ["python3", "-m", "http.server"]
    assert imageconfig.run_argv(cfg, ["json.tool"]) == ["python3", "-m", "json.tool"]   # ARGs replace Cmd
    assert imageconfig.run_argv(cfg, []) == ["python3", "-m"]
    assert imageconfig.run_argv(cfg, entrypoint="sh") == ["sh"]                           # Cmd dropped
    assert imageconfig.run_argv(cfg, ["-c", "id"], entrypoint="sh") == ["sh", "-c", "id"]
    assert imageconfig.run_argv({"cmd": ["ls", "/"]}) == ["ls", "/"]
    with pytest.raises(ConfigError, match="no Entrypoint or Cmd"):
        imageconfig.run_argv(imageconfig.default())


@pytest.mark.parametrize("spec, want", [
    ("", ("", None)), ("app", ("app", None)), ("1000", ("1000", None)), ("app:staff", ("app", "staff")),
    ("1000:50", ("1000", "50")),
])
def test_user_specs(spec, want):
    assert imageconfig.parse_user(spec) == want


@pytest.mark.parametrize("spec", [":", "app:", ":g", "a b", "a:b:c", "1:4294967295"])
def test_bad_user_specs(spec):
    with pytest.raises(ConfigError):
        imageconfig.parse_user(spec)


PASSWD = """root:x:0:0:root:/root:/bin/sh
# a comment
broken line
app:x:1000:1001:App:/home/app:/bin/sh
svc:x:1002:1002::/srv:/bin/false
"""
GROUP = """root:x:0:
staff:x:50:app
app:x:1001:
audio:x:29:svc,app
appx:x:77:appx,apps
wheel:x:10:root
"""


# Supplementary groups as runc gives them (libcontainer/user GetExecUser):
# only to a user found in /etc/passwd whose spec names no group; the
# primary gid among them (initgroups).
@pytest.mark.parametrize("spec, want", [
    ("", users.Identity(0, 0, None)),                                # no file read for the default
    ("app", users.Identity(1000, 1001, "/home/app", (29, 50, 1001))),
    ("app:staff", users.Identity(1000, 50, "/home/app")),
    ("app:7", users.Identity(1000, 7, "/home/app")),
    ("1000", users.Identity(1000, 1001, "/home/app", (29, 50, 1001))),  # a uid's gid, home, groups from its line
    ("1000:1000", users.Identity(1000, 1000, "/home/app")),
    ("4242", users.Identity(4242, 4242, None)),              # no line: the same number, no home, no groups
    ("4242:staff", users.Identity(4242, 50, None)),
    ("root", users.Identity(0, 0, "/root", (0, 10))),
    ("svc", users.Identity(1002, 1002, "/srv", (29, 1002))),
])
def test_users_resolve_against_the_images_files(spec, want):
    assert users.resolve(spec, PASSWD, GROUP) == want


def test_numeric_ids_need_no_files():
    assert users.resolve("1000:1000", None, None) == users.Identity(1000, 1000, None)
    assert users.files_needed("") == (False, False)
    assert users.files_needed("1000:1000") == (True, False)     # for HOME
    assert users.files_needed("app:staff") == (True, True)
    assert users.files_needed("app") == (True, True)             # its supplementary groups


def test_groups_without_a_group_file_are_the_primary_gid_only():
    assert users.resolve("app", PASSWD, None) == users.Identity(1000, 1001, "/home/app", (1001,))


def test_a_user_in_more_groups_than_an_exec_may_have_is_refused_with_the_way_out():
    many = "".join(f"g{i}:x:{2000 + i}:app\n" for i in range(native.MAX_GROUPS))
    with pytest.raises(users.UserError, match=r"user 'app' is in 1025 groups .* name a group \(user:group\)"):
        users.resolve("app", PASSWD, many)
    assert users.resolve("app:staff", PASSWD, many + GROUP).groups == ()


def test_ids_are_ascii_decimal_digits():
    """Other characters str.isdigit takes ('²', '١') are no id to int() or
    to the kernel: a spec of them is a name, a file line with them is
    malformed and skipped (getpwnam skips it too), never an internal error.
    A sandbox's root can write such a line in its own /etc/passwd."""
    with pytest.raises(users.UserError, match="no user '²'"):
        users.resolve("²", PASSWD, GROUP)
    with pytest.raises(users.UserError, match="no user '١٠٠٠'"):
        users.resolve("١٠٠٠", PASSWD, GROUP)
    with pytest.raises(users.UserError, match="no group '²'"):
        users.resolve("1000:²", PASSWD, GROUP)
    odd_passwd = PASSWD + "odd:x:²:0::/:/bin/sh\nodd2:x:7:³::/:/bin/sh\n"
    odd_group = GROUP + "g2:x:³:app\n"
    assert users.resolve("app", odd_passwd, odd_group) == users.Identity(1000, 1001, "/home/app", (29, 50, 1001))
    assert users.resolve("app:staff", odd_passwd, odd_group).gid == 50
    with pytest.raises(users.UserError, match="no user 'odd'"):
        users.resolve("odd", odd_passwd, odd_group)
    assert users.files_needed("1000:²") == (True, True)


@pytest.mark.parametrize("spec, passwd, group, needle", [
    ("nobody", PASSWD, GROUP, "no user 'nobody': its /etc/passwd has no such user"),
    ("app", None, None, "no user 'app': it has no /etc/passwd"),
    ("app:adm", PASSWD, GROUP, "no group 'adm': its /etc/group has no such group"),
    ("app:staff", PASSWD, None, "no group 'staff': it has no /etc/group"),
])
def test_a_missing_user_or_group_is_named(spec, passwd, group, needle):
    with pytest.raises(users.UserError, match=needle):
        users.resolve(spec, passwd, group)


# ---------------------------------------------------------------- archives and platforms

def _tar(members: dict[str, bytes | None]) -> tarfile.TarFile:
    """An in-memory tarball: name -> file content (None: a directory)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            if data is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            else:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    buf.seek(0)
    return tarfile.open(fileobj=buf, mode="r")


DOCKER = json.dumps([{"Config": "c.json", "Layers": ["l/layer.tar"]}]).encode()
INDEX = json.dumps({"schemaVersion": 2, "manifests": []}).encode()


@pytest.mark.parametrize("members, kind", [
    ({"./": None, "./bin/": None, "./bin/sh": b"", "./etc/passwd": b""}, oci.ROOTFS),
    ({"manifest.json": DOCKER, "c.json": b"{}", "l/layer.tar": b""}, oci.DOCKER_SAVE),
    ({"./manifest.json": DOCKER, "./c.json": b"{}"}, oci.DOCKER_SAVE),       # a docker save re-tarred with ./
    ({"index.json": INDEX, "oci-layout": b"{}", "blobs/": None}, oci.OCI_LAYOUT),
    ({"manifest.json": DOCKER, "index.json": INDEX, "oci-layout": b"{}", "blobs/": None, "repositories": b"{}"},
     oci.DOCKER_SAVE),                                                         # docker >= 25 writes both
    ({"manifest.json": b'{"name": "my web app"}', "index.html": b""}, oci.ROOTFS),   # a web app's manifest
    ({"index.json": b'{"pages": []}', "README": b""}, oci.ROOTFS),
    ({".git/": None, "manifest.json": DOCKER, "c.json": b"{}"}, oci.DOCKER_SAVE),
])
def test_what_an_archive_is(members, kind):
    src = oci._TarSource(_tar(members), "t")
    assert oci.classify(src)[0] == kind


@pytest.mark.parametrize("members, needle", [
    ({"manifest.json": DOCKER, "etc/": None, "bin/": None}, "holds an image archive .* and also other "
                                                            "top-level entries \\(bin, etc\\)"),
    ({"index.json": INDEX, "oci-layout": b"{}", "blobs/": None, "usr/": None}, "not both"),
    ({"index.json": INDEX}, "not the oci-layout file or the blobs/ directory"),
    ({"index.json": INDEX, "oci-layout": b"{}"}, "not the blobs/ directory"),
    ({"blobs/": None, "oci-layout": b"{}"}, "no OCI index.json"),
    ({"manifest.json": b"[]"}, "lists no image"),
])
def test_an_ambiguous_or_incomplete_archive_says_what_was_expected(members, needle):
    with pytest.raises(oci.TarError, match=needle):
        oci.classify(oci._TarSource(_tar(members), "t"))


AMD64 = {"os": "linux", "architecture": "amd64", "variant": None}
ARM64 = {"os": "linux", "architecture": "arm64", "variant": "v8"}
ARMV7 = {"os": "linux", "architecture": "arm", "variant": "v7"}


def _desc(digest: str, **platform) -> dict:
    return {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": f"sha256:{digest}",
            **({"platform": platform} if platform else {})}


MULTI = [_desc("a1", os="linux", architecture="arm64", variant="v8"),
         _desc("a2", os="linux", architecture="amd64"),
         _desc("a3", os="linux", architecture="arm", variant="v6"),
         _desc("a4", os="linux", architecture="arm", variant="v7"),
         _desc("a5", os="unknown", architecture="unknown"),          # a buildx attestation
         _desc("a6", os="windows", architecture="amd64")]


@pytest.mark.parametrize("host, digest", [(AMD64, "sha256:a2"), (ARM64, "sha256:a1"), (ARMV7, "sha256:a4"),
                                          ({**ARMV7, "variant": "v6"}, "sha256:a3")])
def test_an_index_gives_the_hosts_platform_not_its_first_entry(host, digest):
    assert oci.choose_manifest(MULTI, "index.json", host)["digest"] == digest


def test_an_arm64_image_without_a_variant_fits_and_an_older_arm_variant_runs():
    assert oci.choose_manifest([_desc("b1", os="linux", architecture="arm64")], "i", ARM64)["digest"] == "sha256:b1"
    only_v6 = [_desc("b2", os="linux", architecture="arm", variant="v6")]
    assert oci.choose_manifest(only_v6, "i", ARMV7)["digest"] == "sha256:b2"


def test_no_image_for_the_host_lists_what_the_index_has():
    with pytest.raises(oci.PlatformError, match="no image for this host's platform linux/s390x; it has "
                                                "linux/amd64, linux/arm/v6, linux/arm/v7, linux/arm64/v8, "
                                                "unknown/unknown, windows/amd64"):
        oci.choose_manifest(MULTI, "index.json", {"os": "linux", "architecture": "s390x", "variant": None})


def test_an_entry_without_a_platform_is_a_single_image_and_two_are_refused():
    assert oci.choose_manifest([_desc("c1")], "i", AMD64)["digest"] == "sha256:c1"
    assert oci.choose_manifest([_desc("c1"), _desc("c1")], "i", AMD64)["digest"] == "sha256:c1"   # two tags, one image
    two = [_desc("c1"), {**_desc("c2"), "annotations": {oci.REF_NAME: "v2"}}]
    with pytest.raises(oci.TarError, match=r"i holds 2 images \(sha256:c1, v2\)"):
        oci.choose_manifest(two, "i", AMD64)


def test_the_hosts_platform_has_oci_names(monkeypatch):
    for machine, want in (("x86_64", AMD64), ("aarch64", ARM64), ("armv7l", ARMV7)):
        monkeypatch.setattr(oci.platform, "machine", lambda m=machine: m)
        assert oci.host_platform() == want


# ---------------------------------------------------------------- the store

needs_erofs = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


@needs_erofs
def test_an_image_stored_by_an_older_daemon_reads_in_todays_form(tmp_path):
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    (tmp_path / "root").mkdir()
    layer = store.build_from_dir(str(tmp_path / "root"), "new").layers
    old = {"schema": 1, "layers": layer, "config": {"env": {"A": "1"}, "cwd": "/", "user": 1000,
                                                      "entrypoint": ["python3", "app.py"]}}
    store._publish("old", store.store.put_bytes(_canonical(old)), None)
    cfg = ImageStore(tmp_path / "store", tmp_path / "scratch").get("old").config
    assert cfg == {**imageconfig.default(), "env": {"A": "1"}, "user": "1000",
                   "entrypoint": ["python3", "app.py"]}
    assert imageconfig.run_argv(cfg, ["--verbose"]) == ["python3", "app.py", "--verbose"]
    # An image built on it is stored in today's form, its config carried up.
    (tmp_path / "ws").mkdir()
    img = store.build_from_dir(str(tmp_path / "ws"), "on-old", parent="old", config={"cwd": "/ws"})
    assert img.config == {**cfg, "cwd": "/ws"}
    assert json.loads(store.store.read_bytes(img.manifest))["config"] == img.config


@needs_erofs
def test_a_build_stacks_its_config_on_the_parents(tmp_path):
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    (tmp_path / "root").mkdir()
    base = store.build_from_dir(str(tmp_path / "root"), "base", config=imageconfig.overrides(
        env={"A": "1", "B": "1"}, entrypoint=["python3"], cmd=["app.py"], labels={"x": "1"}))
    top = store.build_from_dir(str(tmp_path / "root"), "top", parent="base",
                               config=imageconfig.overrides(env={"B": "2"}, entrypoint=["sh"]))
    assert base.config["cmd"] == ["app.py"]
    assert top.config == {**imageconfig.default(), "env": {"A": "1", "B": "2"}, "entrypoint": ["sh"],
                          "labels": {"x": "1"}}


def test_a_malformed_exec_user_is_named_once():
    # "user '99999999999': user '99999999999': user id 99999999999 is too large"
    import asyncio
    from types import SimpleNamespace

    from dsecd.engine.execs import named_user
    from dsecd.errors import BadRequest

    sb = SimpleNamespace(id="sb1", backend="container")
    with pytest.raises(BadRequest) as exc:
        asyncio.run(named_user(sb, "99999999999", None, None))
    assert exc.value.message.count("99999999999") == 2, exc.value.message     # the spec, then the id
    assert exc.value.message.startswith("user '99999999999': user id 99999999999 is too large")
