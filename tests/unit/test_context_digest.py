"""Hashing a Dockerfile build's context (dsecd/build/context.py digest):
its bound on a source's size and its stop."""

from __future__ import annotations

import os

import pytest
from stop_kit import SetAfter

from dsecd.build.context import (
    HASH_CHUNK,
    BuildContext,
    DigestCache,
    HashStopped,
    SourcesTooLarge,
    SourceTooLarge,
)


def test_a_source_larger_than_a_layer_is_refused_before_it_is_read(tmp_path):
    with open(tmp_path / "big", "wb") as f:
        f.truncate(1 << 40)             # sparse: a TiB that costs nothing to make
    context = BuildContext.open(str(tmp_path))
    sources = context.sources("big")
    with pytest.raises(SourceTooLarge) as err:
        context.digest(sources, DigestCache(), max_bytes=1 << 20)
    assert err.value.rel == "big" and err.value.size == 1 << 40 and err.value.max_bytes == 1 << 20
    assert "big is 1099511627776 bytes" in str(err.value) and "images.max_layer_bytes" in str(err.value)


def test_a_source_that_grows_past_the_bound_after_the_walk_is_refused(tmp_path):
    (tmp_path / "grows").write_bytes(b"x")
    context = BuildContext.open(str(tmp_path))
    sources = context.sources("grows")
    with open(tmp_path / "grows", "r+b") as f:
        f.truncate(3 * HASH_CHUNK)
    with pytest.raises(SourceTooLarge) as err:
        context.digest(sources, DigestCache(), max_bytes=HASH_CHUNK)
    assert err.value.rel == "grows" and err.value.size == 3 * HASH_CHUNK


def test_a_source_within_the_bound_is_hashed(tmp_path):
    (tmp_path / "small").write_bytes(b"y" * 100)
    context = BuildContext.open(str(tmp_path))
    sources = context.sources("small")
    assert context.digest(sources, DigestCache(), max_bytes=100) == context.digest(sources, DigestCache())


def test_a_stop_ends_the_hashing_at_its_next_chunk(tmp_path, monkeypatch):
    with open(tmp_path / "big", "wb") as f:
        f.truncate(8 * HASH_CHUNK)
    context = BuildContext.open(str(tmp_path))
    sources = context.sources("big")
    stop = SetAfter(2)
    reads = []
    real_pread = os.pread

    def pread(fd, n, offset):
        reads.append(offset)
        return real_pread(fd, n, offset)

    cache = DigestCache()
    monkeypatch.setattr(os, "pread", pread)
    with pytest.raises(HashStopped):
        context.digest(sources, cache, stop)
    monkeypatch.undo()
    assert reads == [0, HASH_CHUNK]
    assert cache._cache == {}           # nothing half-hashed is kept


def test_sources_that_add_up_past_a_layer_are_refused_before_they_are_read(tmp_path, monkeypatch):
    for i in range(3):
        (tmp_path / f"f{i}").write_bytes(b"z" * 400)
    context = BuildContext.open(str(tmp_path))
    sources = context.sources("f*")
    monkeypatch.setattr(os, "pread", lambda *a: pytest.fail("read before the bound was checked"))
    with pytest.raises(SourcesTooLarge) as err:
        context.digest(sources, DigestCache(), max_bytes=1000)
    assert (err.value.files, err.value.size, err.value.max_bytes) == (3, 1200, 1000)
    assert "its 3 files add up to 1200 bytes" in str(err.value) and "images.max_layer_bytes" in str(err.value)
