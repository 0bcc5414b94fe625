"""An image's config honoured: User (resolved in the image's /etc/passwd and
/etc/group), Env and WorkingDir at create; Entrypoint and Cmd by `dsec run`
(SDK Client.run), whose sandbox goes however the run ends; ExposedPorts and
Labels shown. And what an import takes: plain root file system tarballs,
unpacked docker-save and OCI-layout directories, the host's image of a
multi-platform index."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tarfile
import time

import pytest
from conftest import VENV_BIN
from image_kit import _file, _tar_bytes, docker_save, layer_of, oci_layout, rootfs_layer, unpack

from dsecd.errors import BadRequest
from dsecd.fs.oci import host_platform

BUSYBOX_PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
PASSWD = BUSYBOX_PASSWD + b"app:x:1234:2345:App:/home/app:/bin/sh\n"
GROUP = b"root:x:0:\nstaff:x:50:app\napp:x:2345:\nnobody:x:65534:\n"


@pytest.fixture(scope="module")
def kit(daemon, busybox_rootfs, tmp_path_factory):
    """The module's images, built once: a name per config under test."""
    c = daemon.client()
    work = tmp_path_factory.mktemp("image-config")
    base = rootfs_layer(busybox_rootfs)
    accounts = layer_of({"etc/passwd": PASSWD, "etc/group": GROUP, "home": None, "home/app": None})

    def build(name: str, config: dict, layers: tuple = (base, accounts)) -> None:
        docker_save(work / f"{name}.tar", list(layers), config)
        c.build_image(str(work / f"{name}.tar"), name)

    build("uid-gid", {"User": "1000:1000"})
    build("named", {"User": "app"})
    build("ghost", {"User": "ghost"})
    build("envdir", {"Env": ["LANG=C.UTF-8", "A=image", "PATH=/usr/bin:/bin"], "WorkingDir": "/srv/app",
                     "Entrypoint": ["sh", "-c", "touch /tmp/ran"]})
    build("greeter", {"Entrypoint": ["echo", "hello"], "Cmd": ["world"],
                      "ExposedPorts": {"8080/tcp": {}, "53/udp": {}}, "Labels": {"version": "1.0"}})
    yield c, work, base
    c.close()


def _out(sb, script: str, **kw) -> str:
    r = sb.exec(["sh", "-c", script], **kw)
    assert r.exit_code == 0, r.stderr
    return r.stdout.decode()


def _left(c, image: str) -> list[str]:
    return [s["id"] for s in c.list() if s["image"] == image]


# ---------------------------------------------------------------- create: User, Env, WorkingDir

def test_a_numeric_user_and_group_need_no_passwd_entry(kit):
    c, _, _ = kit
    sb = c.create(image="uid-gid")
    try:
        assert _out(sb, "id -u; id -g; echo $HOME") == "1000\n1000\n/\n"     # no passwd line: HOME=/, as docker
        assert (sb.info["user"], sb.info["gid"]) == (1000, 1000)
        assert _out(sb, "id -u", user=0) == "0\n"              # an exec's own user still goes first
    finally:
        sb.destroy()


def test_a_user_name_is_resolved_in_the_images_passwd_and_group(kit):
    c, _, _ = kit
    sb = c.create(image="named")
    try:
        assert _out(sb, "id -u; id -g; echo $HOME") == "1234\n2345\n/home/app\n"
        # With its groups (staff lists app), as docker gives them.
        assert _out(sb, "grep ^Groups: /proc/self/status").split() == ["Groups:", "50", "2345"]
        assert sb.info["groups"] == [50, 2345]
    finally:
        sb.destroy()
    # A create's user goes over the image's: by name and group name, or by id.
    sb = c.create(image="named", user="app:staff")
    try:
        assert _out(sb, "id -u; id -g; grep ^Groups: /proc/self/status").split() == ["1234", "50", "Groups:"]
    finally:
        sb.destroy()
    sb = c.create(image="named", user=0)
    try:
        assert _out(sb, "id -u; id -g; echo $HOME") == "0\n0\n/root\n"
    finally:
        sb.destroy()


def test_a_missing_user_is_a_clear_error_and_leaves_nothing(kit, daemon):
    c, _, _ = kit
    with pytest.raises(BadRequest, match="image 'ghost' cannot run as the image's User 'ghost': no user "
                                         "'ghost': its /etc/passwd has no such user"):
        c.create(image="ghost")
    with pytest.raises(BadRequest, match="no group 'wheel'"):
        c.create(image="named", user="app:wheel")
    r = daemon.cli("create", "--image", "busybox", "--user", "app")
    assert r.returncode == 1 and b"image 'busybox' cannot run as the create's user 'app'" in r.stderr
    assert _left(c, "ghost") == [] and _left(c, "named") == []
    # A user given by id needs no line: the ghost image runs as one.
    sb = c.create(image="ghost", user="4242")
    try:
        assert _out(sb, "id -u; id -g") == "4242\n4242\n"
    finally:
        sb.destroy()


def test_image_env_and_working_dir_under_the_creates(kit):
    c, _, _ = kit
    sb = c.create(image="envdir", env={"A": "create"})
    try:
        # WorkingDir is made where the image lacks it; env merges, the create's winning.
        assert _out(sb, "pwd; echo $LANG $A; echo $PATH") == "/srv/app\nC.UTF-8 create\n/usr/bin:/bin\n"
        assert sb.info["cwd"] == "/srv/app" and sb.info["env"]["LANG"] == "C.UTF-8"
        assert _out(sb, "echo $A", env={"A": "exec"}) == "exec\n"
        # A create runs nothing: the image's Entrypoint waits for `dsec run`.
        assert sb.exec(["test", "-e", "/tmp/ran"]).exit_code == 1
    finally:
        sb.destroy()
    sb = c.create(image="envdir", cwd="/tmp")
    try:
        assert _out(sb, "pwd") == "/tmp\n"
    finally:
        sb.destroy()
    with pytest.raises(BadRequest, match="not a directory in image"):
        c.create(image="envdir", cwd="/no/such/dir")       # a create's own cwd must exist


def test_exposed_ports_and_labels_are_shown(kit, daemon):
    r = daemon.cli("image", "inspect", "greeter")
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    assert "53/udp 8080/tcp" in text and "version=1.0" in text and '["echo", "hello"]' in text
    cfg = json.loads(daemon.cli("image", "inspect", "greeter", "--json").stdout)["config"]
    assert cfg["exposed_ports"] == ["53/udp", "8080/tcp"] and cfg["labels"] == {"version": "1.0"}
    assert (cfg["entrypoint"], cfg["cmd"], cfg["user"]) == (["echo", "hello"], ["world"], "")


# ---------------------------------------------------------------- dsec run

def test_run_runs_entrypoint_and_cmd_and_removes_its_sandbox(kit, daemon):
    c, _, _ = kit
    r = daemon.cli("run", "greeter")
    assert (r.returncode, r.stdout) == (0, b"hello world\n"), r.stderr
    r = daemon.cli("run", "greeter", "--", "there")                 # ARGs replace Cmd
    assert (r.returncode, r.stdout) == (0, b"hello there\n"), r.stderr
    r = daemon.cli("run", "--entrypoint", "sh", "greeter", "--", "-c", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    r = daemon.cli("run", "--env", "K=V", "--memory", "64M", "--user", "app:staff", "named", "--",
                   "sh", "-c", "echo $K; id -u; id -g")
    assert (r.returncode, r.stdout) == (0, b"V\n1234\n50\n"), r.stderr
    assert _left(c, "greeter") == [] and _left(c, "named") == []


def test_cli_entrypoint_and_cmd_are_one_value_each_wherever_the_path_stands(kit, daemon):
    """`image build --entrypoint ... PATH`: the options take one value (shell
    words or a JSON array), so the path after them stays the path."""
    _, work, _ = kit
    r = daemon.cli("image", "build", "--name", "cli-argv", "--entrypoint", "echo from", "--cmd",
                   '["the cli", "x"]', str(work / "greeter.tar"))
    assert r.returncode == 0, r.stderr
    cfg = json.loads(daemon.cli("image", "inspect", "cli-argv", "--json").stdout)["config"]
    assert (cfg["entrypoint"], cfg["cmd"]) == (["echo", "from"], ["the cli", "x"])
    r = daemon.cli("run", "cli-argv")
    assert (r.returncode, r.stdout) == (0, b"from the cli x\n"), r.stderr
    r = daemon.cli("image", "build", "--name", "cli-argv-bad", "--cmd", '["unclosed', str(work / "greeter.tar"))
    assert r.returncode == 2 and b"--cmd" in r.stderr and b"JSON array" in r.stderr, r.stderr
    daemon.cli("image", "rm", "cli-argv")


def test_a_failing_command_or_a_failed_start_leaves_no_sandbox(kit, daemon):
    c, _, _ = kit
    r = daemon.cli("run", "busybox", "--", "sh", "-c", "exit 3")
    assert r.returncode == 3
    r = daemon.cli("run", "busybox", "--", "no-such-program")
    assert r.returncode == 127 and b"not_found" in r.stderr
    r = daemon.cli("run", "busybox")                                  # busybox has no Entrypoint or Cmd
    assert r.returncode == 125 and b"no Entrypoint or Cmd" in r.stderr
    r = daemon.cli("run", "ghost", "--", "true")
    assert r.returncode == 125 and b"no user 'ghost'" in r.stderr
    assert _left(c, "busybox") == [] and _left(c, "ghost") == []


def test_no_rm_keeps_the_sandbox(kit, daemon):
    c, _, _ = kit
    r = daemon.cli("run", "--no-rm", "--label", "kept=1", "greeter")
    assert r.returncode == 0 and b"kept" in r.stderr
    kept = c.list({"kept": "1"})
    assert len(kept) == 1
    c.get(kept[0]["id"]).destroy()


def _readline(stream, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0, f"no line within {timeout}s (so far {line!r})"
        if select.select([stream], [], [], left)[0]:
            chunk = os.read(stream.fileno(), 1)
            assert chunk, f"output ended before a line: {line!r}"
            line += chunk
    return line


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_run_streams_live_and_a_signal_ends_it_and_removes_its_sandbox(kit, daemon, sig):
    """The signal goes to the command (as docker run's --sig-proxy); it dies
    of it, and its sandbox goes with the run."""
    c, _, _ = kit
    label = f"sig={sig.name}"
    proc = subprocess.Popen([str(VENV_BIN / "dsec"), "--socket", daemon.socket,
                             "run", "--label", label, "busybox", "--", "sh", "-c", "echo started; sleep 60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert _readline(proc.stdout, 20) == b"started\n"            # streamed while the command runs
        assert len(c.list({"sig": sig.name})) == 1
        proc.send_signal(sig)
        assert proc.wait(30) == 128 + sig, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert c.list({"sig": sig.name}) == []


RUN_AND_DIE = """
import asyncio, sys, dsecd

async def main():
    async with dsecd.Client(sys.argv[1]) as c:
        async with c.run_stream("busybox", ["sh", "-c", "echo started; sleep 60"], lease=2,
                                labels={"lease": "run"}) as run:
            async for fd, data in run:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()

asyncio.run(main())
"""


def test_a_run_killed_outright_leaves_its_sandbox_to_its_lease(kit, daemon):
    c, _, _ = kit
    proc = subprocess.Popen([str(VENV_BIN / "python"), "-c", RUN_AND_DIE, daemon.socket], stdout=subprocess.PIPE)
    try:
        assert _readline(proc.stdout, 20) == b"started\n"
        time.sleep(4)                                      # twice its lease: renewed while it runs
        assert len(c.list({"lease": "run"})) == 1
        proc.kill()                                        # no clean-up of its own
        proc.wait()
        deadline = time.monotonic() + 15
        while c.list({"lease": "run"}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.list({"lease": "run"}) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_sdk_runs_an_image(kit):
    c, _, _ = kit
    seen = []
    r = c.run("greeter", ["from", "the", "sdk"], on_stdout=seen.append, labels={"sdk": "1"})
    assert (r.exit_code, r.stdout, b"".join(seen)) == (0, b"hello from the sdk\n", b"hello from the sdk\n")
    r = c.run("busybox", ["sh", "-c", "exit 4"])
    assert r.exit_code == 4
    with pytest.raises(BadRequest, match="no Entrypoint or Cmd"):
        c.run("busybox")
    assert c.list({"sdk": "1"}) == [] and _left(c, "busybox") == []


# ---------------------------------------------------------------- what an import takes

@pytest.mark.parametrize("compress", ["", "z"])
def test_a_plain_rootfs_tarball_is_a_one_layer_image(kit, busybox_rootfs, compress):
    c, work, _ = kit
    tarball = work / f"rootfs-{compress or 'plain'}.tar"
    subprocess.run(["tar", "-C", busybox_rootfs, f"-c{compress}f", str(tarball), "."], check=True)
    name = f"rootfs-tar-{compress or 'plain'}"
    img = c.build_image(str(tarball), name)
    assert len(img["layers"]) == 1 and img["config"]["entrypoint"] == []
    with c.sandbox(image=name) as sb:
        assert _out(sb, "ls /bin/busybox") == "/bin/busybox\n"


def test_layers_compressed_any_way_docker_takes_are_built(kit):
    """A layer of a docker save or OCI layout as a pull takes it (gzip, zstd,
    plain, by its magic bytes), and bzip2 and xz, which older docker saves
    may hold."""
    import bz2
    import gzip
    import lzma

    import zstandard

    c, work, base = kit
    packs = {"gzip": gzip.compress, "zstd": zstandard.ZstdCompressor().compress, "bzip2": bz2.compress,
             "xz": lzma.compress}
    layers = [base] + [pack(layer_of({f"etc/{name}": f"{name}\n".encode()})) for name, pack in packs.items()]
    docker_save(work / "packed.tar", layers, {})
    img = c.build_image(str(work / "packed.tar"), "packed")
    assert len(img["layers"]) == 5
    with c.sandbox(image="packed") as sb:
        assert _out(sb, "cat /etc/gzip /etc/zstd /etc/bzip2 /etc/xz") == "gzip\nzstd\nbzip2\nxz\n"


def test_unpacked_docker_save_and_oci_layout_directories(kit):
    c, work, base = kit
    extra = layer_of({"etc/which": b"unpacked\n"})
    docker_save(work / "ds.tar", [base, extra], {"Env": ["FROM=docker"]})
    oci_layout(work / "oci.tar", [(host_platform(), [base, extra], {"Env": ["FROM=oci"]})])
    for name, tarball in (("ds-dir", "ds.tar"), ("oci-dir", "oci.tar")):
        img = c.build_image(str(unpack(work / tarball, work / name)), name)
        assert len(img["layers"]) == 2, name                  # the archive's layers, not its files
        with c.sandbox(image=name) as sb:
            assert _out(sb, "cat /etc/which; echo $FROM") == f"unpacked\n{name[:-4].replace('ds', 'docker')}\n"


def test_an_ambiguous_or_incomplete_directory_says_what_was_expected(kit):
    c, work, base = kit
    docker_save(work / "amb.tar", [base], {})
    mixed = unpack(work / "amb.tar", work / "mixed")
    (mixed / "etc").mkdir()
    with pytest.raises(BadRequest, match=r"image archive .* and also other top-level entries \(etc\)"):
        c.build_image(str(mixed), "mixed")
    half = work / "half"
    half.mkdir()
    (half / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": []}))
    (half / "oci-layout").write_text("{}")
    with pytest.raises(BadRequest, match="has index.json but not the blobs/ directory: expected an OCI image layout"):
        c.build_image(str(half), "half")


def _other_platform() -> dict:
    host = host_platform()
    return {"os": "linux", "architecture": "s390x" if host["architecture"] != "s390x" else "amd64",
            "variant": None}


@pytest.mark.parametrize("nested", [True, False])
def test_a_multi_platform_index_gives_the_hosts_image(kit, nested):
    c, work, base = kit
    other = _other_platform()
    tarball = work / f"multi-{nested}.tar"
    oci_layout(tarball, [(other, [base, layer_of({"arch": b"other\n"})], {}),        # first, and wrong
                         (host_platform(), [base, layer_of({"arch": b"host\n"})], {"Env": ["WHICH=host"]})],
               nested=nested)
    name = f"multi-{'nested' if nested else 'flat'}"
    img = c.build_image(str(tarball), name)
    assert img["config"]["env"] == {"WHICH": "host"}
    with c.sandbox(image=name) as sb:
        assert _out(sb, "cat /arch") == "host\n"


def test_an_index_without_the_hosts_platform_lists_what_it_has(kit):
    c, work, base = kit
    other = _other_platform()
    tarball = work / "foreign.tar"
    oci_layout(tarball, [(other, [base], {}), ({"os": "windows", "architecture": "amd64"}, [base], {})])
    host = "/".join(x for x in host_platform().values() if x)
    with pytest.raises(BadRequest, match=f"no image for this host's platform {host}; it has "
                                         f"linux/{other['architecture']}, windows/amd64"):
        c.build_image(str(tarball), "foreign")


def test_an_archive_of_several_images_is_refused_naming_them(kit):
    """docker save of two images, or an OCI layout of two tags: building
    the first without a word would give the user an image they did not ask for."""
    c, work, base = kit
    oci_layout(work / "two.tar", [(None, [base], {"Env": ["V=a"]}),
                                  (None, [base, layer_of({"v": b"b\n"})], {"Env": ["V=b"]})], nested=False)
    with pytest.raises(BadRequest, match=r"index.json holds 2 images \(sha256:.*\), not one .*: make an archive"):
        c.build_image(str(work / "two.tar"), "two")
    cfgs = [_file(f"c{i}.json", json.dumps({"config": {"Env": [f"I={i}"]}}).encode()) for i in (1, 2)]
    manifest = [{"Config": f"c{i}.json", "RepoTags": [f"img{i}:latest"], "Layers": ["l.tar"]} for i in (1, 2)]
    (work / "two-saved.tar").write_bytes(_tar_bytes([_file("l.tar", base), *cfgs,
                                                     _file("manifest.json", json.dumps(manifest).encode())]))
    with pytest.raises(BadRequest, match=r"lists 2 images \(img1:latest; img2:latest\): build from a docker save "
                                         "of one image"):
        c.build_image(str(work / "two-saved.tar"), "two")
    # Two tags of one image (docker save a:1 a:latest) are one image.
    one = [{"Config": "c1.json", "RepoTags": [f"img:{tag}"], "Layers": ["l.tar"]} for tag in ("1", "latest")]
    (work / "one-saved.tar").write_bytes(_tar_bytes([_file("l.tar", base), cfgs[0],
                                                     _file("manifest.json", json.dumps(one).encode())]))
    assert len(c.build_image(str(work / "one-saved.tar"), "one-of-two-tags")["layers"]) == 1
    assert "two" not in [i["name"] for i in c.request("image_list")["images"]]


def test_an_image_tarball_with_a_rootfs_beside_it_is_refused(kit):
    c, work, base = kit
    docker_save(work / "both.tar", [base], {})
    with tarfile.open(work / "both.tar", "a") as tf:
        ti = tarfile.TarInfo("bin")
        ti.type = tarfile.DIRTYPE
        tf.addfile(ti)
    with pytest.raises(BadRequest, match="not both"):
        c.build_image(str(work / "both.tar"), "both")


def test_a_users_groups_are_kept_across_a_daemon_restart(kit, daemon):
    """Last in the module: it restarts the module's daemon. The groups a
    create resolved are journaled with the sandbox, as its uid and gid."""
    c, _, _ = kit
    sb = c.create(image="named")
    try:
        daemon.stop()
        daemon.start()
        with daemon.client() as again:
            kept = again.get(sb.id)
            assert kept.info["groups"] == [50, 2345]
            assert _out(kept, "grep ^Groups: /proc/self/status").split() == ["Groups:", "50", "2345"]
    finally:
        with daemon.client() as again:
            again.get(sb.id).destroy()
