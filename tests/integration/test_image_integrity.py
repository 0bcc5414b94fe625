"""Bad stores: a layer whose bytes no longer match its digest, a missing blob,
a store that goes away mid-read, a disk that fills up during a build.

Every case must fail clearly where it happens (the mount, the read, the
build) and leave sandboxes on other images and later builds unaffected.
"""

import os
import subprocess
from pathlib import Path

import pytest

from dsecd.errors import DsecError

MARK = b"DSEC-INTEGRITY-CHECK-"


def make_tree(root: Path, payload_mib: int = 2) -> Path:
    """A small workspace: a marker file of payload_mib MiB, whose bytes can be
    found in the layer blob (EROFS stores file data uncompressed by default)."""
    (root / "work").mkdir(parents=True)
    data = (MARK + b"x" * (4096 - len(MARK))) * (payload_mib * 256)
    (root / "work" / "payload.bin").write_bytes(data)
    (root / "work" / "other.txt").write_text("a neighbour file\n")
    return root


def layer_blob(d, c, image: str) -> Path:
    top = c.request("image_inspect", name=image)["layers"][-1]["digest"]
    return Path(d.state) / "store" / "blobs" / "sha256" / top[7:]


def flip_byte_in_payload(blob: Path, nth_block: int = 100) -> None:
    """Corrupt one byte inside payload.bin's data in the store's copy of the layer."""
    raw = blob.read_bytes()
    at = -1
    for _ in range(nth_block + 1):
        at = raw.index(MARK, at + 1)
    fd = os.open(blob, os.O_WRONLY)      # root: the 0444 mode does not stop us
    try:
        os.pwrite(fd, bytes([raw[at + 100] ^ 0xFF]), at + 100)
    finally:
        os.close(fd)


@pytest.fixture(params=["direct", "eager", "lazy"])
def store_daemon(request, daemon_factory, busybox_rootfs, tmp_path):
    d = daemon_factory(f'[images]\nmode = "{request.param}"\n')
    c = d.client()
    c.build_image(busybox_rootfs, "base")
    c.build_image(str(make_tree(tmp_path / "ws")), "ws", parent="base")
    yield request.param, d, c
    c.close()


@pytest.mark.attack
def test_corrupt_layer_in_the_store_is_never_served(store_daemon):
    mode, d, c = store_daemon
    neighbour = c.create(image="base")       # another image, mounted before the damage
    flip_byte_in_payload(layer_blob(d, c, "ws"))
    if mode in ("direct", "eager"):
        # The whole layer is hashed before its first mount: the create fails.
        with pytest.raises(DsecError) as err:
            c.create(image="ws")
        assert err.value.code == "io" and "corrupt" in str(err.value)
    else:
        # Lazy: the layer mounts (its metadata chunks are intact) and only the
        # damaged chunk fails, with EIO, never with the wrong bytes.
        sb = c.create(image="ws")
        r = sb.exec(["cat", "/work/payload.bin"])
        assert r.exit_code != 0 and b"Input/output error" in r.stderr
        assert sb.exec(["cat", "/work/other.txt"]).stdout == b"a neighbour file\n"
        top = c.request("image_inspect", name="ws")["layers"][-1]["digest"]
        stats = c.request("image_inspect", name="ws")["pager"][top]
        assert stats["verified"] and stats["corrupt"] >= 1 and stats["verified_bytes"] > 0
        sb.destroy()
    # Sandboxes on other images are unaffected, old and new.
    assert neighbour.exec(["cat", "/bin/busybox"]).exit_code == 0
    fresh = c.create(image="base")
    assert fresh.exec(["true"]).exit_code == 0
    fresh.destroy()
    neighbour.destroy()


def test_intact_layers_are_checked_and_pass(store_daemon):
    mode, d, c = store_daemon
    sb = c.create(image="ws")
    r = sb.exec(["md5sum", "/work/payload.bin"])
    assert r.exit_code == 0, r.stderr
    if mode == "lazy":
        top = c.request("image_inspect", name="ws")["layers"][-1]["digest"]
        stats = c.request("image_inspect", name="ws")["pager"][top]
        assert stats["verified"] and stats["corrupt"] == 0
        assert stats["verified_bytes"] >= stats["fetched_bytes"] > 0
    sb.destroy()


def test_missing_layer_blob_fails_the_create_clearly(store_daemon):
    mode, d, c = store_daemon
    layer_blob(d, c, "ws").unlink()
    with pytest.raises(DsecError) as err:
        c.create(image="ws")
    assert err.value.code in ("io", "not_found")
    assert "ws" in str(err.value) or "sha256:" in str(err.value)
    sb = c.create(image="base")
    assert sb.exec(["true"]).exit_code == 0
    sb.destroy()


def test_store_gone_mid_read_gives_eio_then_recovers(daemon_factory, busybox_rootfs, tmp_path):
    """Lazy: the store copy vanishes (truncated: an unreachable server, a
    replaced file) after the layer is mounted. Chunks already fetched keep
    being served; the others fail with EIO, and work again once it is back."""
    d = daemon_factory('[images]\nmode = "lazy"\n[pager]\nreadahead_chunks = 0\n')
    c = d.client()
    c.build_image(busybox_rootfs, "base")
    c.build_image(str(make_tree(tmp_path / "ws")), "ws", parent="base")
    blob = layer_blob(d, c, "ws")
    saved = blob.read_bytes()
    sb = c.create(image="ws")
    assert sb.exec(["cat", "/work/other.txt"]).exit_code == 0
    with open(blob, "r+b") as f:
        f.truncate(64 << 10)
    try:
        r = sb.exec(["cat", "/work/payload.bin"])
        assert r.exit_code != 0 and b"Input/output error" in r.stderr
        assert sb.exec(["cat", "/work/other.txt"]).stdout == b"a neighbour file\n"   # cached
    finally:
        with open(blob, "r+b") as f:
            f.write(saved)
    r = sb.exec(["md5sum", "/work/payload.bin"])
    assert r.exit_code == 0, r.stderr
    sb.destroy()
    c.close()


@pytest.fixture
def small_store(tmp_path):
    """A 24 MiB tmpfs as the blob store: builds past it hit ENOSPC."""
    store = tmp_path / "small-store"
    store.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "dsecd-test", str(store)],
                   check=True)
    yield store
    subprocess.run(["umount", "-l", str(store)], check=False)


def test_disk_full_during_build(small_store, daemon_factory, busybox_rootfs, tmp_path):
    d = daemon_factory(f'[images]\nstore = "{small_store}"\n')      # auto: lazy (tmpfs store)
    c = d.client()
    c.build_image(busybox_rootfs, "base")
    sb = c.create(image="base")
    big = make_tree(tmp_path / "big", payload_mib=40)
    with pytest.raises(DsecError) as err:
        c.build_image(str(big), "too-big", parent="base")
    assert err.value.code == "io" and "space" in str(err.value).lower()
    names = [i["name"] for i in c.request("image_list")["images"]]
    assert names == ["base"]                              # nothing under the new name
    assert os.listdir(small_store / "tmp") == []          # no half-written blob left
    assert sb.exec(["true"]).exit_code == 0               # the live sandbox carries on
    small = make_tree(tmp_path / "small", payload_mib=1)
    c.build_image(str(small), "fits", parent="base")      # and the store still works
    sb2 = c.create(image="fits")
    assert sb2.exec(["cat", "/work/other.txt"]).stdout == b"a neighbour file\n"
    sb2.destroy()
    sb.destroy()
    c.close()


def test_direct_mode_on_a_tmpfs_store_is_refused_at_start(small_store, daemon_factory):
    d = daemon_factory(f'[images]\nstore = "{small_store}"\nmode = "direct"\n', start=False)
    with pytest.raises(RuntimeError) as err:
        d.start()
    assert "cannot back EROFS" in str(err.value)
