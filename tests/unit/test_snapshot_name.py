"""A snapshot to a name an image already has (ImageService.snapshot): said
before anything is done to the sandbox."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dsecd.engine.images import ImageService
from dsecd.engine.opkeys import OpKeys
from dsecd.errors import DsecError
from dsecd.fs.images import ImageError


def test_a_taken_name_is_refused_before_the_sandbox_is_frozen():
    """It was found only after the sandbox had been frozen and its layer
    viewed, at the commit: a pause of its work for nothing."""
    frozen = []

    def name_free(name):
        raise ImageError("conflict", f"image {name!r} exists; remove it first (`dsec image rm {name}`)")

    async def run_now(fn, *args):
        return fn(*args)

    svc = object.__new__(ImageService)
    svc.images = SimpleNamespace(name_free=name_free, get_manifest=lambda *a: frozen.append("base"))
    svc.workers = SimpleNamespace(run=run_now)
    svc.registry = SimpleNamespace(get=lambda sb_id, req: SimpleNamespace(id=sb_id, copies=0, backend="container",
                                                                         state="running"),
                                   op_keys=OpKeys(None))
    svc.frozen_upper = lambda sb: frozen.append("frozen")
    req = SimpleNamespace(sandbox="sb1", name="app", exclude=[], key=None)
    with pytest.raises(DsecError, match="image 'app' exists") as info:
        asyncio.run(svc.snapshot(req, None))
    assert info.value.code == "conflict" and frozen == []
