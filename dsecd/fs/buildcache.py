"""The build cache: which image a Dockerfile step made from which parent.

    <store>/build-cache/<hex of the step key> -> {"manifest": "sha256:..", "created": t}

A step's key is the sha256 of its parent image's manifest digest, the
instruction after ARG/ENV expansion, and for COPY/ADD the content hash of
the files it copies (dsecd/engine/builds.py); the entry names the manifest
of the image after the step. Entries live in the store beside the names,
so every host sharing the store shares the cache.

An entry is a reference like a name, but a weak one: `image gc` keeps an
entry (and so its manifest) while every layer it needs is still used by a
name, a live sandbox or a build in progress, and removes it otherwise (the
image was removed, or the build failed and nothing kept its layers). A
lookup whose blobs are gone is a miss, and the entry goes.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from .store import write_durable

KEY_RE = re.compile(r"^[0-9a-f]{64}$")


class BuildCache:
    def __init__(self, root: Path, temp_path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._temp_path = temp_path       # the blob store's: same file system, atomic rename

    def _path(self, key: str) -> Path:
        hexpart = key.removeprefix("sha256:")
        if not KEY_RE.match(hexpart):
            raise ValueError(f"bad build cache key {key!r}")
        return self.root / hexpart

    def get(self, key: str) -> str | None:
        """The manifest digest a step with this key made, or None."""
        try:
            return json.loads(self._path(key).read_text())["manifest"]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, manifest: str) -> None:
        tmp = self._temp_path(".cache")
        write_durable(tmp, json.dumps({"manifest": manifest, "created": time.time()}).encode())
        os.replace(tmp, self._path(key))

    def drop(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def entries(self) -> Iterator[tuple[str, str | None]]:
        """(key, manifest digest or None when unreadable) of every entry."""
        for e in os.scandir(self.root):
            if KEY_RE.match(e.name):
                yield e.name, self.get(e.name)

    def count(self) -> int:
        return sum(1 for e in os.scandir(self.root) if KEY_RE.match(e.name))
