"""An image's config (dsecd/imageconfig.py): read from OCI configs,
checked, stacked by builds, older forms read in today's; and its users
resolved against /etc/passwd and /etc/group (dsecd/fs/users.py); without a
daemon."""

from __future__ import annotations

import json
import shutil

import pytest

from dsecd import imageconfig
from dsecd.fs import users
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
"""


@pytest.mark.parametrize("spec, want", [
    ("", users.Identity(0, 0, None)),
    ("app", users.Identity(1000, 1001, "/home/app")),
    ("app:staff", users.Identity(1000, 50, "/home/app")),
    ("app:7", users.Identity(1000, 7, "/home/app")),
    ("1000", users.Identity(1000, 1001, "/home/app")),       # a uid's gid and home from its line
    ("1000:1000", users.Identity(1000, 1000, "/home/app")),
    ("4242", users.Identity(4242, 4242, None)),              # no line: the same number, no home
    ("4242:staff", users.Identity(4242, 50, None)),
    ("root", users.Identity(0, 0, "/root")),
])
def test_users_resolve_against_the_images_files(spec, want):
    assert users.resolve(spec, PASSWD, GROUP) == want


def test_numeric_ids_need_no_files():
    assert users.resolve("1000:1000", None, None) == users.Identity(1000, 1000, None)
    assert users.files_needed("") == (False, False)
    assert users.files_needed("1000:1000") == (True, False)     # for HOME
    assert users.files_needed("app:staff") == (True, True)


@pytest.mark.parametrize("spec, passwd, group, needle", [
    ("nobody", PASSWD, GROUP, "no user 'nobody': its /etc/passwd has no such user"),
    ("app", None, None, "no user 'app': it has no /etc/passwd"),
    ("app:wheel", PASSWD, GROUP, "no group 'wheel': its /etc/group has no such group"),
    ("app:staff", PASSWD, None, "no group 'staff': it has no /etc/group"),
])
def test_a_missing_user_or_group_is_named(spec, passwd, group, needle):
    with pytest.raises(users.UserError, match=needle):
        users.resolve(spec, passwd, group)


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
