"""EROFS images: build, layers, dedup, names, gc, tarballs, and pack_diff snapshots."""

import asyncio
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import tarfile
import threading
import time
from pathlib import Path

import pytest
from image_kit import _entry, _file, _tar_bytes, docker_save

import dsecd
from dsecd.errors import BadRequest, Conflict, LimitExceeded, NotFound


def tree_digest(sb, root="/work"):
    """A walk of `root` inside the sandbox: path, type, mode and content hash."""
    script = (f"cd {root} 2>/dev/null || exit 0; find . | sort | while read p; do "
              "if [ -L \"$p\" ]; then echo \"$p L $(readlink \"$p\")\"; "
              "elif [ -d \"$p\" ]; then echo \"$p D $(stat -c %a \"$p\")\"; "
              "else echo \"$p F $(stat -c %a \"$p\") $(md5sum < \"$p\")\"; fi; done")
    r = sb.exec(["sh", "-c", script])
    assert r.exit_code == 0, r.stderr
    return r.stdout.decode()


@pytest.fixture(params=["direct", "lazy"])
def images(request, daemon_factory, busybox_rootfs):
    """Both ways a layer reaches the host: mounted from the store file, and paged
    in through dsec-pager (what a store on a distributed file system gets)."""
    d = daemon_factory(f'[images]\nmode = "{request.param}"\n')
    c = d.client()
    c.build_image(busybox_rootfs, "base")
    yield d, c
    c.close()


def test_build_is_reproducible_and_deduplicated(images, busybox_rootfs):
    d, c = images
    again = c.build_image(busybox_rootfs, "base2")
    base = c.request("image_inspect", name="base")
    assert again["layers"] == base["layers"] and again["manifest"] == base["manifest"]
    du = c.request("image_du")
    assert du["blobs"] == 3          # one layer, its chunk index, one manifest, shared by both names


def test_layer_on_top_and_config(images, tmp_path):
    d, c = images
    ws = tmp_path / "ws"
    (ws / "work").mkdir(parents=True)
    (ws / "work" / "hello.txt").write_text("from the workspace layer\n")
    img = c.build_image(str(ws), "repo-1", parent="base", env={"PROJECT": "repo-1"}, cwd="/work")
    assert len(img["layers"]) == 2 and img["config"]["cwd"] == "/work"
    sb = c.create(image="repo-1")
    assert sb.exec(["cat", "/work/hello.txt"]).stdout == b"from the workspace layer\n"
    assert sb.exec(["sh", "-c", "ls /bin/busybox"]).exit_code == 0
    sb.destroy()


def test_layers_mounted_once_and_shared(images):
    d, c = images
    sbs = [c.create(image="base") for _ in range(3)]
    layer = c.request("image_inspect", name="base")["layers"][0]["digest"]
    with open("/proc/self/mountinfo") as f:
        mounts = [line for line in f if f"{d.state}/layers/{layer[7:]}" in line and " - erofs " in line]
    assert len(mounts) == 1
    assert c.request("image_du")["mounted_layers"][layer] == 3
    for sb in sbs:
        sb.destroy()


def test_rm_name_keeps_running_sandboxes_and_gc_keeps_their_layers(images):
    d, c = images
    sb = c.create(image="base")
    # An rm says which sandboxes run on the image: a gc frees nothing of it until they end.
    removed = d.cli("image", "rm", "base")
    assert removed.returncode == 0, removed.stderr
    assert f"1 sandbox(es) on it run on and keep its layers ({sb.id})".encode() in removed.stdout
    with pytest.raises(NotFound):
        c.request("image_inspect", name="base")
    assert c.request("image_du")["unreferenced_bytes"] == 0      # what a gc would free: nothing yet
    gc = c.request("image_gc")
    assert gc["removed"] == []          # the live sandbox still uses all three blobs
    assert sb.exec(["true"]).exit_code == 0
    sb.destroy()
    collectable = c.request("image_du")["unreferenced_bytes"]
    gc = c.request("image_gc")
    assert len(gc["removed"]) == 3 and gc["freed_bytes"] == collectable > 0     # manifest, layer, chunk index
    assert c.request("image_du")["blobs"] == 0


def test_gc_removes_the_eager_copies_of_the_layers_it_removes(daemon_factory, busybox_rootfs, tmp_path):
    """images.mode eager copies each layer to <state>/eager before its first
    mount; once gc has removed the layer from the store, its copy goes too,
    or every layer the host ever ran would stay on its disk."""
    d = daemon_factory('[images]\nmode = "eager"\n')
    c = d.client()
    c.build_image(busybox_rootfs, "base")
    (tmp_path / "ws" / "work").mkdir(parents=True)
    (tmp_path / "ws" / "work" / "f").write_text("f\n")
    top = c.build_image(str(tmp_path / "ws"), "ws", parent="base")["layers"][-1]["digest"]
    c.create(image="ws").destroy()
    eager = d.state / "eager"
    assert top[7:] in os.listdir(eager)
    (eager / ("0" * 64 + ".tmp")).write_bytes(b"half a copy of a layer no store holds")
    (eager / ("1" * 64 + ".tmp")).write_bytes(b"a copy being written as gc lists the store")
    for name in os.listdir(eager):                   # made a while ago, but the one being written
        if not name.startswith("1"):
            os.utime(eager / name, (time.time() - 60, time.time() - 60))
    c.request("image_rm", name="ws")
    gc = c.request("image_gc")
    assert top in gc["removed"]
    base = c.request("image_inspect", name="base")["layers"][0]["digest"]
    assert sorted(os.listdir(eager)) == sorted([base[7:], "1" * 64 + ".tmp"])      # the kept image's copy stays
    assert c.create(image="base").exec(["true"]).exit_code == 0
    c.close()



def test_eager_copies_are_capped_by_the_cache_cap(daemon_factory, busybox_rootfs, tmp_path):
    """images.mode eager copies each layer whole to <state>/eager: the local
    cache of that mode, as <state>/pager-cache is lazy's. The copies of
    layers still in the store stayed for good, past pager.cache_max_bytes,
    which capped only the pager's cache: the layers of every image the host
    ran, on the state dir's file system. A copy that would take them past
    the cap now makes room first, dropping the least recently used copies
    of layers no mount holds."""
    d = daemon_factory('[images]\nmode = "eager"\n')
    c = d.client()
    try:
        base = c.build_image(busybox_rootfs, "base")["layers"][0]
        tops = {}
        for name in ("a", "b"):
            (tmp_path / name / "data").mkdir(parents=True)
            (tmp_path / name / "data" / "blob").write_bytes(os.urandom(2 << 20))    # incompressible
            tops[name] = c.build_image(str(tmp_path / name), name, parent="base")["layers"][-1]
    finally:
        c.close()
    d.stop()
    # Room for the base and one top layer, not for both tops.
    cap = base["size"] + max(t["size"] for t in tops.values()) + (64 << 10)
    assert cap < base["size"] + sum(t["size"] for t in tops.values())
    d.config.write_text(d.config.read_text() + f'[pager]\ncache_max_bytes = "{cap}"\n')
    d.start()
    eager = d.state / "eager"
    c = d.client()
    try:
        c.create(image="a").destroy()
        assert sorted(os.listdir(eager)) == sorted([base["digest"][7:], tops["a"]["digest"][7:]])
        c.request("image_gc")                       # unmounts the layers no sandbox uses
        sb = c.create(image="b")
        assert sorted(os.listdir(eager)) == sorted([base["digest"][7:], tops["b"]["digest"][7:]])
        assert sum(f.stat().st_size for f in eager.iterdir()) <= cap
        assert sb.exec(["cat", "/data/blob"]).exit_code == 0
        info = c.info()["images"]["eager"]
        assert info["cache_max"] == cap and 0 < info["cache_used"] <= cap
        assert c.create(image="a").exec(["true"]).exit_code == 0     # copied again: over the cap, said
    finally:
        c.close()
    assert "eager copies" in d.log.read_text()

def test_a_half_made_eager_copy_goes_at_the_next_start(daemon_factory, busybox_rootfs):
    """A daemon killed while it copied a layer (eager) leaves <hex>.tmp. The
    layer is still in the store, so no gc removes it: the next start does
    (no copy runs then)."""
    d = daemon_factory('[images]\nmode = "eager"\n')
    c = d.client()
    base = c.build_image(busybox_rootfs, "base")["layers"][0]["digest"]
    c.close()
    eager = d.state / "eager"
    eager.mkdir(exist_ok=True)
    (eager / f"{base[7:]}.tmp").write_bytes(b"half a copy of a layer the store holds")
    d.stop(signal.SIGKILL)
    d.start()
    assert os.listdir(eager) == []
    c = d.client()
    assert c.create(image="base").exec(["true"]).exit_code == 0
    assert os.listdir(eager) == [base[7:]]
    c.close()


def test_an_import_under_a_taken_name_replaces_the_image(images, busybox_rootfs, tmp_path):
    """As a Dockerfile build and a pull do (and docker build and import):
    the name moves to the new image at once, a sandbox on the old one keeps
    it, and gc keeps the old layers while that sandbox lives."""
    d, c = images
    for n in (1, 2):
        shutil.copytree(busybox_rootfs, tmp_path / f"v{n}", symlinks=True)
        (tmp_path / f"v{n}" / "version").write_text(f"{n}\n")
    first = c.import_image(str(tmp_path / "v1"), "app")
    assert first["replaced"] is None
    with c.sandbox(image="app") as old:
        again = d.cli("image", "import", str(tmp_path / "v2"), "--name", "app")
        assert again.returncode == 0, again.stderr
        second = c.request("image_inspect", name="app")
        assert second["manifest"] != first["manifest"]
        assert f"replaced manifest {first['manifest'][:19]}".encode() in again.stdout
        c.image_gc()
        assert old.exec(["cat", "/version"]).stdout == b"1\n"
        with c.sandbox(image="app") as new:
            assert new.exec(["cat", "/version"]).stdout == b"2\n"
    on_top = c.build_image(str(tmp_path / "v1"), "app", parent="base")
    assert on_top["replaced"] == second["manifest"] and len(on_top["layers"]) == 2
    assert c.build_image(str(tmp_path / "v1"), "app", parent="base")["replaced"] is None    # the same image


def test_tag_names_an_image_again_without_a_copy(images, tmp_path):
    """docker tag: a second name for the same manifest; removing either
    name leaves the other, and a taken name is moved, as a build moves it."""
    d, c = images
    sb = c.create(image="base")
    sb.exec(["sh", "-c", "echo snap > /snapped"])
    snap = sb.snapshot("snap")
    sb.destroy()
    blobs = c.request("image_du")["blobs"]
    tagged = d.cli("image", "tag", "snap", "team/app:stable")
    assert tagged.returncode == 0, tagged.stderr
    assert tagged.stdout.decode().startswith("tagged docker.io/team/app:stable: 2 layer(s)")
    stable = c.request("image_inspect", name="team/app:stable")
    assert (stable["manifest"], stable["parent"]) == (snap["manifest"], "base")
    assert c.request("image_du")["blobs"] == blobs          # nothing copied
    c.request("image_rm", name="snap")
    c.image_gc()
    with c.sandbox(image="team/app:stable") as again:
        assert again.exec(["cat", "/snapped"]).stdout == b"snap\n"
    moved = c.tag_image("base", "team/app:stable")
    assert moved["replaced"] == snap["manifest"] and moved["manifest"] == c.inspect_image("base")["manifest"]
    assert c.tag_image("base", "team/app:stable")["replaced"] is None
    with pytest.raises(NotFound):
        c.tag_image("no-such-image", "x")
    with pytest.raises(BadRequest, match="has a digest"):
        c.tag_image("base", "x@sha256:" + "0" * 64)
    assert "x" not in [i["name"] for i in c.list_images()]


def test_bad_builds(images, tmp_path):
    d, c = images
    with pytest.raises(NotFound):
        c.build_image(str(tmp_path / "absent"), "x")
    with pytest.raises(BadRequest, match="an image name is"):
        c.build_image(str(tmp_path), "Bad/Name")
    with pytest.raises(BadRequest, match="an image name is"):
        c.build_image(str(tmp_path), "x@sha256:123")
    with pytest.raises(NotFound):
        c.build_image(str(tmp_path), "x", parent="no-such-image")


def test_docker_save_tarball_with_whiteouts(images, tmp_path, busybox_rootfs):
    d, c = images
    # Layer 0: busybox plus files; layer 1 deletes one file and makes /data opaque.
    base = io.BytesIO()
    with tarfile.open(fileobj=base, mode="w") as tf:
        tf.add(busybox_rootfs, arcname=".")
    l0 = base.getvalue()
    extra0 = _tar_bytes([_entry("data", tarfile.DIRTYPE, mode=0o755), _file("data/a", b"a"),
                         _file("data/b", b"b"), _file("etc/gone", b"x")])
    l1 = _tar_bytes([_file("etc/.wh.gone"), _entry("data", tarfile.DIRTYPE, mode=0o755),
                     _file("data/.wh..wh..opq"), _file("data/c", b"c")])
    tarpath = tmp_path / "img.tar"
    docker_save(tarpath, [l0, extra0, l1], {"Env": ["LANG=C.UTF-8"], "WorkingDir": "/data"})
    img = c.build_image(str(tarpath), "from-tar")
    assert len(img["layers"]) == 3 and img["config"]["env"] == {"LANG": "C.UTF-8"}
    sb = c.create(image="from-tar")
    assert sb.exec(["ls", "/data"]).stdout.split() == [b"c"]
    assert sb.exec(["test", "-e", "/etc/gone"]).exit_code == 1
    sb.destroy()


@pytest.mark.parametrize("evil", ["../escape", "/abs/path"])
def test_tarball_with_unsafe_names_is_refused(images, tmp_path, evil):
    d, c = images
    tarpath = tmp_path / "evil.tar"
    docker_save(tarpath, [_tar_bytes([_file(evil, b"pwned")])])
    with pytest.raises(BadRequest, match="absolute|'..'"):
        c.build_image(str(tarpath), "evil")
    assert not os.path.exists("/abs/path") and not (tmp_path.parent / "escape").exists()
    with pytest.raises(NotFound):
        c.request("image_inspect", name="evil")


def test_an_archive_whose_bytes_are_not_what_it_says_is_refused(images, tmp_path):
    """A tampered OCI layout blob (named by a digest it no longer has), and
    a docker save whose config's diff_id does not match its layer: both
    refused, as a pull refuses a registry's, nothing named."""
    import io
    import json

    from image_kit import oci_layout

    d, c = images
    good, evil = _tar_bytes([_file("f", b"good")]), _tar_bytes([_file("f", b"evil")])
    layout = tmp_path / "layout.tar"
    oci_layout(layout, [(None, [good], {})], nested=False)
    buf = io.BytesIO()
    with tarfile.open(layout) as src, tarfile.open(fileobj=buf, mode="w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if data == good:
                data, m.size = evil, len(evil)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    layout.write_bytes(buf.getvalue())
    with pytest.raises(BadRequest, match="not to the digest it is named by"):
        c.build_image(str(layout), "tampered-layout")

    cfg = {"config": {}, "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}}
    save = tmp_path / "save.tar"
    save.write_bytes(_tar_bytes([_file("l0/layer.tar", good), _file("config.json", json.dumps(cfg).encode()),
                                 _file("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": ["t:1"],
                                                                     "Layers": ["l0/layer.tar"]}]).encode())]))
    with pytest.raises(BadRequest, match="diff_id"):
        c.build_image(str(save), "tampered-save")
    for name in ("tampered-layout", "tampered-save"):
        with pytest.raises(NotFound):
            c.request("image_inspect", name=name)


def test_tarball_writing_through_a_symlink_is_refused(images, tmp_path):
    d, c = images
    host_dir = tmp_path / "hostdir"
    host_dir.mkdir()
    layer = _tar_bytes([_entry("link", tarfile.SYMTYPE, linkname=str(host_dir)), _file("link/owned", b"x")])
    tarpath = tmp_path / "sym.tar"
    docker_save(tarpath, [layer])
    with pytest.raises(BadRequest, match="not a directory"):
        c.build_image(str(tarpath), "sym")
    assert not (host_dir / "owned").exists()


def test_corrupt_and_truncated_tarballs(images, tmp_path):
    d, c = images
    tarpath = tmp_path / "t.tar"
    docker_save(tarpath, [_tar_bytes([_file("f", os.urandom(100000))])])
    data = tarpath.read_bytes()
    tarpath.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadRequest):
        c.build_image(str(tarpath), "trunc")
    tarpath.write_bytes(b"this is not a tar file" * 100)
    with pytest.raises(BadRequest):
        c.build_image(str(tarpath), "junk")


def test_snapshot_roundtrip(images):
    d, c = images
    sb = c.create(image="base")
    setup = """
    set -e
    mkdir -p /work/keep /work/opaque/sub /work/tmpdir
    echo one > /work/keep/file; chmod 640 /work/keep/file
    echo x > /work/opaque/sub/old
    ln -s keep/file /work/link
    echo hard > /work/keep/h1; ln /work/keep/h1 /work/keep/h2
    head -c 300000 /dev/urandom > /work/big.bin
    rm /etc/hostname 2>/dev/null || true
    rm -rf /work/opaque && mkdir -p /work/opaque && echo new > /work/opaque/only
    mv /work/keep/file /work/keep/renamed
    echo f > /work/was-file; rm /work/was-file; mkdir /work/was-file; echo inside > /work/was-file/x
    echo residue > /work/tmpdir/junk
    """
    assert sb.exec(["sh", "-c", setup]).exit_code == 0
    before = tree_digest(sb)
    img = sb.snapshot("snap-1", exclude=["work/tmpdir"])
    assert len(img["layers"]) == 2
    sb2 = c.create(image="snap-1")
    after = tree_digest(sb2)
    expected = "\n".join(line for line in before.splitlines() if "tmpdir" not in line) + "\n"
    assert after.replace("./tmpdir D 755\n", "") == expected
    assert sb2.exec(["test", "-e", "/etc/hostname"]).exit_code == 1     # the deletion survived
    ino = sb2.exec(["sh", "-c", "stat -c %i /work/keep/h1 /work/keep/h2"]).stdout.split()
    assert ino[0] == ino[1]                                             # hard link kept
    assert sb.exec(["true"]).exit_code == 0                             # thawed after the snapshot
    sb.destroy()
    sb2.destroy()


def test_a_snapshot_has_its_images_config_not_its_creates(images):
    """As the README says: what a create gave (env, cwd, user) is not in a
    snapshot's config, which is its image's (docker commit keeps them)."""
    d, c = images
    sb = c.create(image="base", env={"K": "V"}, cwd="/tmp", user="65534")
    img = sb.snapshot("snap-config")
    assert (img["config"]["env"], img["config"]["cwd"], img["config"]["user"]) == ({}, "/", "")
    sb2 = c.create(image="snap-config")
    assert sb2.exec("echo K=$K; pwd; id -u").stdout == b"K=\n/\n0\n"
    sb.destroy()
    sb2.destroy()


def _frozen(cgroups: dict) -> bool:
    """Whether the freezer of a sandbox (inspect's `cgroups`) holds it frozen."""
    for path in cgroups.values():
        if (Path(path) / "cgroup.freeze").exists():
            return (Path(path) / "cgroup.freeze").read_text().strip() == "1"
        if (Path(path) / "freezer.state").exists():
            return (Path(path) / "freezer.state").read_text().strip() != "THAWED"
    raise AssertionError(f"no freezer among {cgroups}")


def test_a_snapshot_cancelled_while_it_packs_publishes_nothing(daemon_factory, busybox_rootfs):
    """A caller's timeout around a snapshot that comes while its layer is
    packed: once the cancel has returned, the pack is over, its image is
    not published (now or later: a retry under the same name is not told
    the name is taken) and the sandbox is thawed and runs with its files
    as they were."""
    d = daemon_factory()
    with d.client() as c:
        c.build_image(busybox_rootfs, "base")

    async def go() -> list[str]:
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="base", memory="512M")
            cgroups = (await sb.inspect())["cgroups"]
            await sb.exec("head -c 64M /dev/urandom > /work/big")
            want = (await sb.exec("md5sum /work/big")).stdout
            published = []
            for i in range(4):
                name = f"cut-{i}"
                began = asyncio.Event()

                def on_progress(p: dict, began=began) -> None:
                    if p.get("step") == "mkfs.erofs":       # the pack has begun
                        began.set()

                task = asyncio.ensure_future(sb.snapshot(name, progress=on_progress))
                await began.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert not _frozen(cgroups)
                assert (await sb.inspect())["state"] == "running"
                assert (await sb.exec("md5sum /work/big")).stdout == want
                await asyncio.sleep(1)          # a pack left running would publish meanwhile
                published += [i["name"] for i in await c.list_images() if i["name"] == name]
            assert (await sb.snapshot("cut-0"))["name"] == "cut-0"      # the name is free
            await sb.destroy()
            return published

    assert asyncio.run(go()) == []


def test_the_same_changes_in_two_sandboxes_snapshot_to_one_layer(images):
    """Layers are content-addressed: two sandboxes of one image that made
    the same changes give the same layer, stored once (each overlay's own
    random id on its upper dir is not packed)."""
    d, c = images
    sbs = [c.create(image="base") for _ in range(2)]
    layers = []
    for i, sb in enumerate(sbs):
        assert sb.exec("mkdir -p /work/dep && echo 1.0 > /work/dep/VERSION && rm /bin/vi").exit_code == 0
        layers.append(sb.snapshot(f"same-{i}")["layers"][-1]["digest"])
        sb.destroy()
    assert layers[0] == layers[1]


def test_a_snapshot_cancelled_while_it_packs_leaves_no_layer_behind(daemon_factory, busybox_rootfs):
    """A snapshot cancelled (a caller's ^C or timeout) while mkfs.erofs
    writes its layer stops that write: no layer of it is stored (a store
    shared by hosts may never see an `image gc`) and no temporary file is
    left; the sandbox runs on, thawed."""
    d = daemon_factory()
    with d.client() as c:
        c.build_image(busybox_rootfs, "base")

    async def go() -> tuple[int, int, list[str], str]:
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="base")
            # Sparse: free to make, but mkfs.erofs writes every byte of it.
            await sb.exec("truncate -s 2G /work/sparse")
            blobs = (await c.request("image_du"))["blobs"]
            began = asyncio.Event()

            def on_progress(p: dict) -> None:
                if p.get("step") == "mkfs.erofs":
                    began.set()

            task = asyncio.ensure_future(sb.snapshot("cut", progress=on_progress))
            await began.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            state = (await sb.inspect())["state"]
            await sb.destroy()
            return blobs, (await c.request("image_du"))["blobs"], os.listdir(d.state / "store" / "tmp"), state

    before, after, temps, state = asyncio.run(go())
    assert (after, temps, state) == (before, [], "running")


def test_a_snapshot_leaves_out_a_write_file_still_under_way(daemon_factory, busybox_rootfs):
    """An atomic write_file (or cp) runs on the host side, which a
    snapshot's freeze does not stop: its temporary `.dsec-<hex>` file, half
    written, is not the sandbox's and is not packed. The write then ends
    as it would have (renamed into place in the sandbox); the snapshot has
    the tree as it was before the write, as for any write not yet done."""
    d = daemon_factory()
    with d.client() as c:
        c.build_image(busybox_rootfs, "base")

    async def go() -> tuple[bytes, bytes]:
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="base")
            await sb.exec("echo old > /work/kept")
            rest = asyncio.Event()
            first = b"1" * c.server["limits"]["max_file_chunk_bytes"]      # one whole request's chunk

            async def pieces():
                yield first
                await rest.wait()
                yield b"the rest\n"

            async def temporary_made() -> None:
                while not any(e["name"].startswith(".dsec-") for e in await sb.list_files("/work")):
                    await asyncio.sleep(0.05)

            writing = asyncio.ensure_future(sb.write_file("/work/upload", pieces()))
            await asyncio.wait_for(temporary_made(), 60)      # its first chunk is in its temporary file
            await sb.snapshot("mid-write")
            rest.set()
            await writing
            assert await sb.read_file("/work/upload") == first + b"the rest\n"
            sb2 = await c.create(image="mid-write")
            listed = (await sb2.exec("ls -A /work")).stdout
            kept = await sb2.read_file("/work/kept")
            await sb.destroy()
            await sb2.destroy()
            return listed, kept

    assert asyncio.run(go()) == (b"kept\n", b"old\n")


def test_a_snapshot_leaves_out_a_directory_copy_still_under_way(daemon_factory, busybox_rootfs):
    """A directory copy in (`dsec cp -r`, upload_tar) extracts into a
    `.dsec-put-<hex>` directory the daemon renames into place at its end:
    a snapshot taken meanwhile leaves that half-made directory out."""
    d = daemon_factory()
    with d.client() as c:
        c.build_image(busybox_rootfs, "base")

    async def go() -> bytes:
        async with dsecd.Client(d.socket) as c:
            sb = await c.create(image="base")
            rest = threading.Event()
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for i in range(2):
                    info = tarfile.TarInfo(f"f{i}")
                    info.size = 1 << 20
                    tar.addfile(info, io.BytesIO(b"x" * info.size))
            data = buf.getvalue()

            r, w = os.pipe()

            def send() -> None:               # half the tar, then the rest once the snapshot is taken
                with open(w, "wb") as out:
                    out.write(data[:len(data) // 2])
                    out.flush()
                    rest.wait()
                    out.write(data[len(data) // 2:])

            async def landing_made() -> None:
                while not any(e["name"].startswith(".dsec-put-") for e in await sb.list_files("/work")):
                    await asyncio.sleep(0.05)

            sending = asyncio.ensure_future(asyncio.to_thread(send))
            with open(r, "rb") as tar_in:
                copying = asyncio.ensure_future(sb.upload_tar(tar_in, "/work/in"))
                await asyncio.wait_for(landing_made(), 60)
                await sb.snapshot("mid-copy")
                rest.set()
                await copying
            await sending
            assert (await sb.exec("ls /work/in")).stdout == b"f0\nf1\n"
            sb2 = await c.create(image="mid-copy")
            listed = (await sb2.exec("ls -A /work")).stdout
            await sb.destroy()
            await sb2.destroy()
            return listed

    assert asyncio.run(go()) == b""


def test_a_chain_of_snapshots_flattens_to_one_layer_of_the_same_tree(images):
    """Each snapshot of a snapshot adds a layer, with deletions (whiteouts),
    a directory replaced whole (opaque), hard links, symlinks and owners.
    `image flatten` makes one layer a sandbox sees exactly as the chain:
    under a new name (its parent the chain's top), or moving the name."""
    d, c = images
    steps = [
        "mkdir -p /work/a/sub /work/gone && echo 0 > /work/a/sub/f && echo x > /work/gone/x && ln -s a/sub/f /work/l"
        " && echo h > /work/h1 && ln /work/h1 /work/h2",
        "rm -rf /work/gone /bin/vi && echo 1 >> /work/a/sub/f && ln /work/a/sub/f /work/a/hard && chmod 600 /work/a/hard",
        "rm -rf /work/a/sub && mkdir /work/a/sub && echo new > /work/a/sub/only && chown 1000:1000 /work/a/sub/only",
        "mkdir /work/gone && echo back > /work/gone/y && rm /work/l && ln -s gone/y /work/l && rm /etc/group",
    ]
    image = "base"
    for n, step in enumerate(steps):
        with c.sandbox(image=image) as sb:
            assert sb.exec(["sh", "-c", step]).exit_code == 0
            image = sb.snapshot(f"chain-{n}")["name"]
    script = ("cd / && find bin etc work | sort | while read p; do if [ -L \"$p\" ]; then echo \"$p L $(readlink "
              "\"$p\")\"; elif [ -d \"$p\" ]; then echo \"$p D $(stat -c %a:%u:%g \"$p\")\"; else echo \"$p F "
              "$(stat -c %a:%u:%g \"$p\") $(md5sum < \"$p\")\"; fi; done")

    def tree(name: str) -> str:
        with c.sandbox(image=name) as sb:
            r = sb.exec(["sh", "-c", script])
            assert r.exit_code == 0, r.stderr
            return r.stdout.decode()
    chained = tree(image)
    assert "work/a/sub/only F 644:1000:1000 " in chained and "work/gone/x" not in chained
    events = []
    flat = c.flatten_image(image, "chain-flat", progress=events.append)
    deep = c.inspect_image(image)
    assert len(deep["layers"]) == len(steps) + 1 and len(flat["layers"]) == 1
    assert (flat["name"], flat["parent"], flat["config"]) == ("chain-flat", image, deep["config"])
    assert flat["flattened"] == {"manifest": deep["manifest"], "layers": len(steps) + 1}
    assert {e["step"] for e in events} >= {"merge", "layer"}
    assert [e for e in events if e["step"] == "merge"][-1]["layer"] == len(steps) + 1
    assert tree("chain-flat") == chained       # (link counts left out: overlay shows a lower file's own)
    with c.sandbox(image="chain-flat") as sb:
        inodes = sb.exec(["stat", "-c", "%i", "/work/h1", "/work/h2"]).stdout.split()
        assert inodes[0] == inodes[1]                                  # a hard link stays one
    moved = d.cli("image", "flatten", image, "--as", image, "--json")      # NAME as itself: moved
    assert moved.returncode == 0, moved.stderr
    moved = json.loads(moved.stdout)
    assert (moved["manifest"], moved["replaced"]) == (flat["manifest"], deep["manifest"])
    assert c.inspect_image(image)["parent"] == deep["parent"]        # the same image, one layer: its parent kept
    with pytest.raises(Conflict, match="exists"):
        c.flatten_image(image, "chain-0")
    with pytest.raises(NotFound):
        c.flatten_image("no-such-image")
    r = d.cli("image", "flatten", "no-such-image")
    assert r.returncode == 1 and b"no image named 'no-such-image'" in r.stderr


def test_flattens_past_max_flattens_wait_their_turn(daemon_factory, busybox_rootfs):
    """images.max_flattens bounds the flattens that write into the scratch
    dir at once; one more was refused `busy`, to be retried by hand. It now
    waits for a slot, told so (a `queued` step), and a cancel while it waits
    ends it with nothing run."""
    d = daemon_factory("[images]\nmax_flattens = 1\n")
    c = d.client()
    c.build_image(busybox_rootfs, "base")
    c.close()

    async def go() -> tuple[list[dict], list[list[dict]]]:
        async with dsecd.Client(d.socket) as ac:
            seen: list[list[dict]] = [[], [], []]
            first = asyncio.ensure_future(ac.flatten_image("base", "flat-a", progress=seen[0].append))
            await asyncio.sleep(0)
            second = asyncio.ensure_future(ac.flatten_image("base", "flat-b", progress=seen[1].append))
            third = asyncio.ensure_future(ac.flatten_image("base", "flat-c", progress=seen[2].append))
            while not seen[2] and not third.done():
                await asyncio.sleep(0.01)
            third.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await third
            return list(await asyncio.gather(first, second)), seen

    (a, b), seen = asyncio.run(go())
    assert (a["name"], b["name"]) == ("flat-a", "flat-b") and a["manifest"] == b["manifest"]
    queued = [[e for e in events if e["step"] == "queued"] for events in seen]
    assert not queued[0] and queued[1] == [{"step": "queued", "max": 1}] and queued[2], seen
    c = d.client()
    assert "flat-c" not in {i["name"] for i in c.list_images()}
    c.close()


def test_parents_that_already_loop_are_read_and_shown_without_hanging(daemon_factory, busybox_rootfs, tmp_path):
    """Refs written before parents had their manifest recorded, each naming
    the other as its parent (and one itself): inspect answers each one's
    chain up to where it loops, the CLI says so, ls and create work, and a
    build on one of them records its parent's manifest."""
    d = daemon_factory()
    c = d.client()
    try:
        manifest = c.build_image(busybox_rootfs, "base")["manifest"]
        refs = d.state / "store" / "refs"
        for name, parent in (("a", "b"), ("b", "a"), ("self", "self")):
            (refs / name).write_text(json.dumps({"manifest": manifest, "created": 0.0, "parent": parent}))
        a = c.inspect_image("a")
        assert (a["parent"], a["ancestors"], a["ancestors_end"]) == ("b", ["b", "a"], "loop")
        assert (c.inspect_image("self")["ancestors"], c.inspect_image("self")["ancestors_end"]) == (["self"], "loop")
        r = d.cli("image", "inspect", "a")
        assert r.returncode == 0
        assert "ancestors:     b -> a again: a cycle of parents" in r.stdout.decode()
        assert {"a", "b", "self", "base"} <= {i["name"] for i in c.list_images()}
        with c.sandbox(image="a") as sb:
            assert sb.exec(["true"]).exit_code == 0
        (tmp_path / "top").mkdir()
        (tmp_path / "top" / "f").write_text("top\n")
        on = c.build_image(str(tmp_path / "top"), "on-a", parent="a")
        assert on["parent"] == "a" and on["parent_manifest"] == manifest
        assert c.inspect_image("on-a")["ancestors"] == ["a", "b", "a"]
        base = c.inspect_image("base")
        assert (base["ancestors"], base["ancestors_end"]) == ([], "none")
        assert d.cli("image", "inspect", "base").stdout.decode().count("ancestors:     -\n") == 1
    finally:
        c.close()


def test_snapshot_name_conflict_and_missing_sandbox(images):
    d, c = images
    sb = c.create(image="base")
    with pytest.raises(Conflict):
        sb.snapshot("base")
    sb.destroy()
    with pytest.raises(NotFound):
        c.request("snapshot", sandbox="ffffffffffff", name="n")


def test_digest_of_blob_matches_its_name(images):
    d, c = images
    img = c.request("image_inspect", name="base")
    store = d.state / "store" / "blobs" / "sha256"
    for layer in img["layers"]:
        data = (store / layer["digest"][7:]).read_bytes()
        assert "sha256:" + hashlib.sha256(data).hexdigest() == layer["digest"]


def test_pager_restart_is_survived_by_new_sandboxes(images):
    """The supervisor restarts a killed pager and remounts the layers, so new
    sandboxes work again (old ones may see EIO on pages never cached)."""
    import signal
    import time

    d, c = images
    info = c.info()
    if info["images"]["mode"] != "lazy":
        pytest.skip("the pager runs in lazy mode only (this is the direct-mode run)")
    sb = c.create(image="base")
    assert sb.exec(["true"]).exit_code == 0
    old_pid = info["images"]["pager"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pager = c.info()["images"].get("pager", {})
        if pager.get("pid") not in (None, old_pid) and "error" not in pager:
            break
        time.sleep(0.2)
    assert pager.get("pid") not in (None, old_pid), pager
    sb2 = c.create(image="base")
    assert sb2.exec(["sh", "-c", "ls /bin | wc -l"]).exit_code == 0
    sb.destroy()
    sb2.destroy()


def test_reference_names_for_local_builds(images, busybox_rootfs, tmp_path):
    """A reference is a name like any other: normalized on the default registry,
    stored under refs/_repos/, found by every spelling, listed, removed."""
    d, c = images
    img = c.build_image(busybox_rootfs, "team/tools:1.0")
    assert img["name"] == "docker.io/team/tools:1.0"
    for spelling in ("team/tools:1.0", "docker.io/team/tools:1.0"):
        assert c.request("image_inspect", name=spelling)["manifest"] == img["manifest"]
    assert (d.state / "store" / "refs" / "_repos" / "docker.io" / "team" / "tools" / ":1.0").is_file()
    (tmp_path / "top").mkdir()
    (tmp_path / "top" / "marker").write_text("top\n")
    py = c.build_image(str(tmp_path / "top"), "python:3.11", parent="team/tools:1.0")
    assert py["name"] == "docker.io/library/python:3.11" and py["parent"] == img["name"]
    latest = c.build_image(busybox_rootfs, "localhost:5000/x")
    assert latest["name"] == "localhost:5000/x:latest"
    names = [i["name"] for i in c.list_images()]
    assert names[0] == "base" and {img["name"], py["name"], latest["name"]} <= set(names)
    sb = c.create(image="python:3.11")
    assert sb.exec(["true"]).exit_code == 0
    sb.destroy()
    pool = c.request("pool_set", image="python:3.11", min=0, max=1)
    assert pool["name"].startswith("docker.io/library/python:3.11@")
    assert c.request("pool_set", image="docker.io/library/python:3.11", min=0, max=0)["removed"]
    again = c.build_image(busybox_rootfs, "docker.io/library/python:3.11")     # the same name: replaced
    assert again["name"] == py["name"] and again["replaced"] == py["manifest"]
    for name in (img["name"], py["name"], latest["name"]):
        c.request("image_rm", name=name)
    assert not (d.state / "store" / "refs" / "_repos" / "docker.io").exists()     # emptied dirs pruned
    c.build_image(busybox_rootfs, "busybox:latest")
    # A bare name no local image has is the default registry's `library/<name>:latest`.
    assert c.request("image_inspect", name="busybox")["name"] == "docker.io/library/busybox:latest"


def _layer_chain(c, rootfs: str, tmp_path, count: int) -> None:
    """Images l0 (`rootfs`) to l{count-1}, each a layer on the one before
    holding /f{n} and /top (which hides the layer's below)."""
    c.build_image(rootfs, "l0")
    for n in range(1, count):
        layer = tmp_path / f"l{n}"
        layer.mkdir()
        (layer / f"f{n}").write_text(f"{n}\n")
        (layer / "top").write_text(f"{n}\n")
        c.build_image(str(layer), f"l{n}", parent=f"l{n - 1}")


@pytest.mark.parametrize("userns", [True, False])
def test_an_image_of_many_layers_starts(daemon_factory, busybox_rootfs, tmp_path, userns):
    """One overlay lowerdir per layer, top first: 16 layers of /proc/self/fd/N
    paths (a user namespace's idmapped clones), or 3 of store paths without
    one, are past the 255 bytes one fsconfig value may hold; then each layer
    goes as a "lowerdir+" of its own. 40 layers, as deep Dockerfiles make."""
    d = daemon_factory("" if userns else "[sandbox]\nuserns = false\n")
    c = d.client()
    try:
        _layer_chain(c, busybox_rootfs, tmp_path, 40)
        assert len(c.request("image_inspect", name="l39")["layers"]) == 40
        with c.sandbox(image="l39") as sb:
            r = sb.exec(["sh", "-c", "cat /f1 /f16 /f39 /top"])
            assert (r.exit_code, r.stdout) == (0, b"1\n16\n39\n39\n"), r
    finally:
        c.close()


def test_an_image_of_more_layers_than_an_overlay_mounts_is_a_limit(daemon_factory, busybox_rootfs, tmp_path):
    """A chain of snapshots (or builds) adds a layer each time; past what
    one overlay mount takes (its options, a path per layer, fit in a
    page: a couple of hundred layers), a create is `limit` saying so and
    what to do, not an internal error, and nothing of it is left; the
    image flattened to one layer starts."""
    d = daemon_factory()
    c = d.client()
    try:
        _layer_chain(c, busybox_rootfs, tmp_path, 300)
        with pytest.raises(LimitExceeded) as err:
            c.create(image="l299")
        assert "300 layers" in err.value.message and "dsec image flatten IMAGE" in err.value.message
        assert c.list() == []
        flat = c.flatten_image("l299", "l299-flat")          # no overlay mount: no limit of one
        assert len(flat["layers"]) == 1 and flat["flattened"]["layers"] == 300
        with c.sandbox(image="l299-flat") as sb:
            r = sb.exec(["sh", "-c", "cat /f1 /f150 /f299 /top"])
            assert (r.exit_code, r.stdout) == (0, b"1\n150\n299\n299\n"), r
    finally:
        c.close()


def test_a_snapshot_the_daemon_died_in_leaves_no_temp_file_after_a_restart(daemon_factory, busybox_rootfs):
    """A daemon killed mid-write leaves a partial layer in the store's tmp;
    the next daemon removes it at start (its writer is gone), not an hour later."""
    import signal
    import threading

    d = daemon_factory()
    c = d.client()
    c.build_image(busybox_rootfs, "base")
    sb = c.create(image="base", memory="512M")
    assert sb.exec(["sh", "-c", "head -c 200000000 /dev/urandom > /big"]).exit_code == 0
    tmp = d.state / "store" / "tmp"
    threading.Thread(target=lambda: _quietly(lambda: sb.snapshot("big")), daemon=True).start()
    deadline = time.monotonic() + 30
    while not any(tmp.iterdir()):
        assert time.monotonic() < deadline, "the snapshot wrote no temp file"
        time.sleep(0.02)
    d.stop(signal.SIGKILL)
    c.close()
    assert any(tmp.iterdir())
    d.start()
    assert list(tmp.iterdir()) == []


def _quietly(fn):
    try:
        fn()
    except Exception:
        pass


def test_a_tarball_import_the_daemon_died_in_leaves_no_tree_after_a_restart(daemon_factory, tmp_path):
    """A daemon killed unpacking a docker save leaves the layers' trees in
    its scratch dir; the next daemon removes them at start."""
    import signal
    import threading

    layer = _tar_bytes([_file(f"d/f{i}", os.urandom(2000)) for i in range(30000)])
    docker_save(tmp_path / "save.tar", [layer, layer])
    d = daemon_factory()
    c = d.client()
    threading.Thread(target=lambda: _quietly(lambda: c.build_image(str(tmp_path / "save.tar"), "big")),
                     daemon=True).start()
    scratch = d.state / "scratch"
    deadline = time.monotonic() + 30
    while not any(p.name.startswith("unpack-") for p in scratch.iterdir()):
        assert time.monotonic() < deadline, "the import unpacked nothing"
        time.sleep(0.02)
    d.stop(signal.SIGKILL)
    c.close()
    assert any(scratch.iterdir())
    d.start()
    assert list(scratch.iterdir()) == []


def test_image_ls_lists_more_images_than_one_frame_holds(daemon_factory, busybox_rootfs, tmp_path):
    """Each image lists all its layers, so images of deep snapshot chains
    add up past the frame limit (800 of them past the default 16 MiB; here a
    30-image chain past a 64 KiB limit): the listing still comes whole, to
    the SDK and to `dsec image ls` (--json one document), in several frames."""
    d = daemon_factory('[limits]\nmax_frame_bytes = "64K"\nmax_file_chunk_bytes = "16K"\n')
    c = d.client()
    try:
        _layer_chain(c, busybox_rootfs, tmp_path, 30)
        (d.state / "store" / "refs" / "broken").write_text("not a ref")     # listed apart, as unreadable
        wanted = {f"l{n}" for n in range(30)}
        assert {i["name"] for i in c.list_images()} == wanted
        assert [u["name"] for u in c.image_listing()["unreadable"]] == ["broken"]
        listed = d.cli("image", "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        assert b"image broken cannot be read" in listed.stderr
        images = json.loads(listed.stdout)
        assert {i["name"] for i in images} == wanted
        assert {len(i["layers"]) for i in images if i["name"] == "l29"} == {30}
        table = d.cli("image", "ls")
        assert table.returncode == 0, table.stderr
        assert {line.split()[0] for line in table.stdout.decode().splitlines()[1:]} == wanted
    finally:
        c.close()
