"""A Dockerfile build cancelled while its image's name is being published
(engine/builds.py): the publish runs on in its worker, and is told of the
cancel before it links the name, so the build publishes nothing (no root;
needs mkfs.erofs)."""

from __future__ import annotations

import asyncio
import shutil
import threading
from types import SimpleNamespace

import pytest

from dsecd.engine.builds import _Build
from dsecd.engine.workers import Workers
from dsecd.fs import images as images_mod
from dsecd.fs.images import ImageStore

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def test_a_build_cancelled_while_its_name_is_published_publishes_nothing(tmp_path, monkeypatch):
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    src = tmp_path / "root"
    src.mkdir()
    (src / "f").write_text("base")
    base = store.build_from_dir(str(src), "base")
    entered, release = threading.Event(), threading.Event()
    write_durable = images_mod.write_durable

    def slow_write(path, data):          # the ref's write and fsync, on a slow store
        write_durable(path, data)
        entered.set()
        release.wait(30)
    monkeypatch.setattr(images_mod, "write_durable", slow_write)

    async def go() -> None:
        workers = Workers(2)
        workers.start(asyncio.get_running_loop())
        svc = SimpleNamespace(images=SimpleNamespace(images=store), workers=workers)
        build = _Build(svc, SimpleNamespace(name="app", dockerfile_name=None), None)
        task = asyncio.ensure_future(build._publish(base, "base", base))
        await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.to_thread(workers.pool.shutdown, True)     # the publish, run on, is over
    asyncio.run(go())
    assert store.names() == ["base"]
