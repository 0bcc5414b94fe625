"""BlobStore.copy_out: the eager mode's whole-blob copy, and its throttle (no root)."""

import os
import time

import pytest

from dsecd.fs.store import BlobStore, StoreError


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
    assert err.value.code == "io"
