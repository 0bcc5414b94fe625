"""BlobStore: the eager mode's whole-blob copy and its throttle, digest checks,
layer chunk indexes (no root)."""

import hashlib
import os
import subprocess
import sys
import time

import pytest

from dsecd.fs.store import (
    CHUNK,
    INDEX_BLOCK,
    BlobStore,
    ChunkHasher,
    StoreError,
    check_index,
    digest_and_index,
)


def test_copy_out_copies_the_blob(tmp_path):
    store = BlobStore(tmp_path / "store")
    data = os.urandom(5 * (1 << 20) + 123)
    digest = store.put_bytes(data)
    store.copy_out(digest, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == data


def test_copy_out_is_paced_by_the_throttle(tmp_path):
    store = BlobStore(tmp_path / "store")
    digest = store.put_bytes(os.urandom(1 << 20))
    t0 = time.monotonic()
    store.copy_out(digest, tmp_path / "copy", bandwidth_bps=10_000_000, latency_us=50_000)
    # 1 MiB at 10 MB/s after 50 ms of latency: >= 0.155 s.
    assert time.monotonic() - t0 >= 0.15


def test_copy_out_of_a_missing_blob_is_a_store_error(tmp_path):
    store = BlobStore(tmp_path / "store")
    with pytest.raises(StoreError) as err:
        store.copy_out("sha256:" + "0" * 64, tmp_path / "copy")
    assert err.value.code == "not_found"


def test_copy_out_checks_the_digest(tmp_path):
    store = BlobStore(tmp_path / "store")
    digest = store.put_bytes(b"layer bytes" * 1000)
    store.copy_out(digest, tmp_path / "good")
    assert (tmp_path / "good").read_bytes() == b"layer bytes" * 1000
    path = store.path(digest)
    path.chmod(0o644)
    path.write_bytes(b"LAYER bytes" + b"layer bytes" * 999)
    with pytest.raises(StoreError) as err:
        store.copy_out(digest, tmp_path / "bad")
    assert err.value.code == "io" and "corrupt" in str(err.value)
    store.copy_out(digest, tmp_path / "unchecked", verify=False)     # images.verify = false


@pytest.mark.parametrize("size", [0, 1, INDEX_BLOCK - 1, INDEX_BLOCK, 3 * INDEX_BLOCK + 5, CHUNK + 7])
def test_chunk_index_has_one_hash_per_block(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "layer").write_bytes(data)
    digest, index = digest_and_index(tmp_path / "layer")
    assert digest == "sha256:" + hashlib.sha256(data).hexdigest()
    check_index(index, size)
    hashes = index[24:]
    assert len(hashes) == 32 * -(-size // INDEX_BLOCK)
    for i in range(0, size, INDEX_BLOCK):
        k = i // INDEX_BLOCK
        assert hashes[32 * k:32 * k + 32] == hashlib.sha256(data[i:i + INDEX_BLOCK]).digest()


@pytest.mark.parametrize("steps", [[0], [INDEX_BLOCK + 5], [3 * INDEX_BLOCK, 3 * INDEX_BLOCK + 7, CHUNK + INDEX_BLOCK],
                                   [CHUNK * 2 + 3 * INDEX_BLOCK]])
def test_chunk_hashes_made_while_written_give_the_same_index(tmp_path, steps):
    # The file as a writer leaves it: chunk 0 (block 0, the superblock) is
    # written last, so what was hashed before must not include it.
    size = CHUNK * 2 + 3 * INDEX_BLOCK + 100
    data = os.urandom(size)
    path = tmp_path / "layer"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data[INDEX_BLOCK:], INDEX_BLOCK)
        chunks = ChunkHasher()
        for final in steps:
            chunks.advance(fd, final)
        assert len(chunks.hashes) == max(0, max(steps) // INDEX_BLOCK - 1)
        os.pwrite(fd, data[:INDEX_BLOCK], 0)
    finally:
        os.close(fd)
    assert digest_and_index(path, chunks) == digest_and_index(path)


def test_check_index_refuses_damaged_or_foreign_indexes(tmp_path):
    (tmp_path / "layer").write_bytes(os.urandom(2 * INDEX_BLOCK))
    _, index = digest_and_index(tmp_path / "layer")
    for bad, size in [(index[:10], 2 * INDEX_BLOCK), (b"X" + index[1:], 2 * INDEX_BLOCK),
                      (index, 2 * INDEX_BLOCK + 1), (index[:-1], 2 * INDEX_BLOCK)]:
        with pytest.raises(StoreError):
            check_index(bad, size)


def test_ingest_layer_stores_the_index_and_replaces_a_truncated_copy(tmp_path):
    store = BlobStore(tmp_path / "store")
    tmp = store.temp_path()
    tmp.write_bytes(os.urandom(100_000))
    data = tmp.read_bytes()
    digest, added, index = store.ingest_layer(tmp)
    assert added and store.exists(index)
    check_index(store.read_bytes(index), 100_000)
    store.path(digest).chmod(0o644)
    with open(store.path(digest), "r+b") as f:
        f.truncate(1000)                       # damaged in the store
    again = store.temp_path()
    again.write_bytes(data)
    assert store.ingest_layer(again)[:2] == (digest, True)
    assert store.path(digest).read_bytes() == data


def test_sweep_removes_temp_files_of_dead_writers_of_this_host_at_once(tmp_path):
    store = BlobStore(tmp_path / "store")
    mine = store.temp_path(".erofs")
    mine.write_bytes(b"in progress")
    child = os.fork()
    if child == 0:
        store.temp_path(".erofs").write_bytes(b"left by a writer that died")
        os._exit(0)
    os.waitpid(child, 0)
    other_host = store.tmp / f"{child}-1-000000000000-{'0' * 32}.erofs"
    other_host.write_bytes(b"another host's write")
    unnamed = store.tmp / "0123abcd"
    unnamed.write_bytes(b"a write of an older daemon")
    removed = store.sweep_tmp()
    assert len(removed) == 1 and removed[0].startswith(f"{child}-")
    assert sorted(p.name for p in store.tmp.iterdir()) == sorted([mine.name, other_host.name, unnamed.name])
    old = time.time() - 7200
    for p in (mine, other_host, unnamed):
        os.utime(p, (old, old))
    assert sorted(store.sweep_tmp()) == sorted([mine.name, other_host.name, unnamed.name])


@pytest.mark.skipif(os.geteuid() != 0, reason="a pid namespace of its own: root")
def test_sweep_keeps_the_temp_files_of_a_live_writer_in_another_pid_namespace(tmp_path):
    # Two daemons of one kernel in two pid namespaces (two pods of a node)
    # share the boot id; the other's pid means another process here, or none.
    store = BlobStore(tmp_path / "store")
    script = ("import sys, time\nfrom pathlib import Path\nfrom dsecd.fs.store import BlobStore\n"
              f"p = BlobStore(Path({str(tmp_path / 'store')!r})).temp_path('.erofs')\n"
              "p.write_bytes(b'in progress')\nprint(p.name, flush=True)\nsys.stdin.read()\n")
    writer = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        name = writer.stdout.readline().strip()
        if not name and writer.wait(10) != 0:
            # A chroot's / is no mount point: unshare cannot make its /proc
            # private there (EINVAL), and nothing else gives the child a /proc
            # of its own pid namespace without touching the host's.
            pytest.skip(f"no pid namespace with a /proc of its own here: {writer.stderr.read().strip()}")
        assert name and (store.tmp / name).exists()
        assert store.sweep_tmp() == []
        assert (store.tmp / name).exists()
    finally:
        writer.stdin.close()
        writer.wait(10)
