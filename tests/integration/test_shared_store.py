"""images.store on a real distributed file system: two daemons ("hosts"),
each with its own FUSE client of one GlusterFS volume (gluster_kit.py).

An image built or snapshotted on one host starts on the other without a
copy (its layers paged in by the other's pager, images.mode auto -> lazy on
FUSE); both publishing one name at once leave one complete image under it;
and a store that goes away mid-read fails the reading process, not the
daemons.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from gluster_kit import GlusterVolume, skip_reason

from dsecd.errors import IOFailure

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@pytest.fixture(scope="module")
def volume():
    with GlusterVolume() as vol:
        yield vol


@pytest.fixture(scope="module")
def hosts(volume, busybox_rootfs):
    """Daemons A and B, each on its own mount of the volume; `base` built by A."""
    import tempfile

    from conftest import Daemon

    made = []
    try:
        for _ in range(2):
            store = volume.mount()
            d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")),
                       f'[images]\nstore = "{store}"\nmode = "auto"\n')
            made.append(d)
            d.start()
            d.store = store
        a, b = made
        ca = a.client()
        ca.build_image(busybox_rootfs, "base")
        ca.close()
        yield a, b
    finally:
        for d in made:
            d.cleanup()


def _pager_stats(d) -> dict:
    return json.loads((d.state / "pager" / ".stats").read_text())


def test_mounts_are_distinct_clients_of_one_volume(volume, hosts):
    a, b = hosts
    assert a.store != b.store
    assert (b.store / "refs" / "base").exists()            # A's name, seen through B's client
    for d in hosts:
        with open("/proc/self/mountinfo") as f:
            fs = [line.split(" - ")[1].split()[0] for line in f if line.split()[4] == str(d.store)]
        assert fs == ["fuse.glusterfs"]


def test_built_on_a_runs_on_b_paged_in_lazily(hosts):
    a, b = hosts
    cb = b.client()
    try:
        sb = cb.create(image="base")
        r = sb.exec(["sh", "-c", "md5sum /bin/busybox"])
        assert r.exit_code == 0, r.stderr
        layer = cb.request("image_inspect", name="base")["layers"][0]["digest"][7:]
        # No copy: B mounts the layer from its pager, which fetched only chunks.
        assert not (b.state / "eager").exists() or not any((b.state / "eager").iterdir())
        stats = _pager_stats(b)["blobs"][layer]
        assert 0 < stats["fetched_bytes"] and stats["chunks"] >= 1
        sb.destroy()
    finally:
        cb.close()


def test_snapshot_on_b_starts_on_a(hosts):
    a, b = hosts
    ca, cb = a.client(), b.client()
    try:
        sb = cb.create(image="base")
        assert sb.exec(["sh", "-c", "mkdir -p /work && echo made-on-b > /work/note"]).exit_code == 0
        sb.snapshot("snap-b")
        sb.destroy()
        sa = ca.create(image="snap-b")
        assert sa.exec(["cat", "/work/note"]).stdout == b"made-on-b\n"
        sa.destroy()
    finally:
        ca.close()
        cb.close()


def test_concurrent_publish_of_one_name_leaves_one_image(hosts, tmp_path):
    """Both hosts build a different tree under the same name at the same
    moment, a few times: a build replaces the image of its name, so both
    publish, and each time the name ends on a complete manifest of one of
    the two builds, which both hosts see once their mounts' entry caches
    expire (a rename on one FUSE client reaches another's lookups after
    its entry timeout, 1 s by default)."""
    a, b = hosts
    for round_ in range(4):
        name = f"race-{round_}"
        results: dict[str, object] = {}
        trees = {}
        for tag in ("a", "b"):
            tree = tmp_path / f"{name}-{tag}" / "work"
            tree.mkdir(parents=True)
            (tree / "who").write_text(f"{tag}\n")
            trees[tag] = tree.parent
        threads = [threading.Thread(target=_build_into, args=(d, str(trees[t]), name, results, t))
                   for d, t in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        won = [t for t, r in results.items() if isinstance(r, dict)]
        assert sorted(won) == ["a", "b"], results
        seen = {d: d.client() for d in (a, b)}
        try:
            deadline = time.monotonic() + 30
            while True:
                inspected = {c.request("image_inspect", name=name)["manifest"] for c in seen.values()}
                if len(inspected) == 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            (manifest,) = inspected
            assert manifest in {r["manifest"] for r in results.values()}
            blob = (a.store / "blobs" / "sha256" / manifest[7:]).read_bytes()
            assert "sha256:" + hashlib.sha256(blob).hexdigest() == manifest
            sb = seen[b].create(image=name)
            who = sb.exec(["cat", "/work/who"]).stdout.decode().strip()
            sb.destroy()
            assert results[who]["manifest"] == manifest
        finally:
            for c in seen.values():
                c.close()


def test_fleet_places_on_the_host_whose_pager_cache_holds_the_image(volume, busybox_rootfs, tmp_path):
    """Both hosts list every image of the shared store; a dsecd.Fleet of the
    two sends creates to the one that already paged the image in. Host B
    runs the image once (reading its 8 MiB layer), then unmounts it (a
    1 s layer grace): only B's pager cache holds it. Every create of the
    image then lands on B; the time to read the layer on each host is
    printed (the figure for docs/notes/log.md)."""
    import asyncio
    import os
    import tempfile
    import time

    from conftest import Daemon

    import dsecd

    made = []
    try:
        for _ in range(2):
            d = Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-")),
                       f'[images]\nstore = "{volume.mount()}"\nmode = "auto"\nlayer_grace_s = 1.0\n')
            made.append(d)
            d.start()
        a, b = made
        extra = tmp_path / "probe"
        extra.mkdir()
        (extra / "blob").write_bytes(os.urandom(8 << 20))
        with a.client() as ca:
            ca.build_image(busybox_rootfs, "pbase")
            probe = ca.build_image(str(extra), "probe", parent="pbase")
        big = next(layer["digest"] for layer in probe["layers"] if layer["size"] >= 8 << 20)

        def read_blob(d) -> float:
            with d.client() as c:
                sb = c.create(image="probe", cpu=0.1, memory="64M")
                t0 = time.monotonic()
                r = sb.exec(["sh", "-c", "cat /blob > /dev/null"])
                took = time.monotonic() - t0
                assert r.exit_code == 0, r.stderr
                sb.destroy(force=True)
                return took

        cold_b = read_blob(b)
        with b.client() as cb:
            deadline = time.monotonic() + 30
            while big in cb.request("image_du")["mounted_layers"] and time.monotonic() < deadline:
                time.sleep(0.2)
            du = cb.request("image_du")
        assert big not in du["mounted_layers"], du["mounted_layers"]
        assert du["cached_layers"].get(big, 0) > 0.5, du["cached_layers"]     # the blob; not all metadata
        with a.client() as ca:
            assert big not in ca.request("image_du")["cached_layers"]

        async def place() -> tuple[list[str], dict]:
            async with dsecd.Fleet([a.socket, b.socket]) as fleet:
                warmth = {t: round(h.warmth("probe"), 2) for t, h in fleet.hosts.items()}
                hosts = []
                for _ in range(10):
                    sb = await fleet.create("probe", cpu=0.1, memory="64M")
                    hosts.append(sb.host)
                    await sb.destroy(force=True)
                return hosts, warmth

        hosts, warmth = asyncio.run(place())
        assert hosts == [b.socket] * 10, (hosts, warmth)
        warm_b, cold_a = read_blob(b), read_blob(a)
        print(f"warmth {warmth}; 8 MiB layer read: B first {cold_b:.3f} s, B cached {warm_b:.3f} s, "
              f"A cold {cold_a:.3f} s")
    finally:
        for d in made:
            d.cleanup()


def test_store_unreachable_mid_read_fails_the_reader_not_the_daemon(volume, hosts, tmp_path):
    """Runs last: it kills the volume's brick (and starts it again)."""
    a, b = hosts
    tree = tmp_path / "big" / "data"
    tree.mkdir(parents=True)
    # Random bytes: EROFS cannot compress them away, so the file spans many
    # pager chunks that no one has read yet.
    (tree / "blob").write_bytes(_random(24 << 20))
    ca, cb = a.client(), b.client()
    try:
        ca.build_image(str(tree.parent), "big", parent="base")
        ca.build_image(str(tree.parent), "unseen-on-b", parent="base")
        held = cb.create(image="base")          # keeps base's layer mounted on B
        sb = cb.create(image="big")
        head = sb.exec(["sh", "-c", "head -c 4096 /data/blob | wc -c"])
        assert head.stdout.strip() == b"4096", head.stderr
        # Host A replaces the layer's file with the same bytes (what gc on one
        # host and the same layer stored again do): B's pager holds the old
        # file open, which the file system cannot reopen after the outage.
        layer = ca.request("image_inspect", name="big")["layers"][-1]["digest"][7:]
        blob = a.store / "blobs" / "sha256" / layer
        copy = a.store / "tmp" / f"{layer}.again"
        shutil.copyfile(blob, copy)
        copy.chmod(0o444)
        copy.rename(blob)
        volume.kill_brick()
        r = sb.exec(["sh", "-c", "tail -c 1048576 /data/blob | wc -c; cat /data/blob > /dev/null"],
                    timeout=120)
        assert r.exit_code != 0, r
        assert b"I/O error" in r.stderr or b"Input/output" in r.stderr, r.stderr
        # The daemons still answer: info, a create of an image whose layers
        # are mounted, exec in it, destroy.
        for c in (ca, cb):
            assert c.info()
        again = cb.create(image="base")
        assert again.exec(["true"]).exit_code == 0
        again.destroy()
        # What needs the store says so: `io`, naming the store, not `internal`.
        with pytest.raises(IOFailure, match="unreachable"):
            cb.create(image="unseen-on-b")
        with pytest.raises(IOFailure, match="unreachable"):
            ca.build_image(str(tree.parent), "during-outage", parent="base")
        # The store back: the same reader gets its bytes (nothing cached the
        # failure; the pager reopened the blob's path, its old file being gone).
        volume.restart_brick()
        r = sb.exec(["md5sum", "/data/blob"], timeout=120)
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split()[0].decode() == hashlib.md5((tree / "blob").read_bytes()).hexdigest()
        sb.destroy()
        held.destroy()
        assert cb.info()
    finally:
        ca.close()
        cb.close()


def _build_into(d, source: str, name: str, results: dict, tag: str) -> None:
    """Build `name` on daemon `d`; its image, or the error the loser got, into results[tag]."""
    c = d.client()
    try:
        results[tag] = c.build_image(source, name, parent="base")
    except Exception as err:
        results[tag] = err
    finally:
        c.close()


def _random(n: int) -> bytes:
    import os

    return os.urandom(n)
