"""The node's image ops: build, list, inspect, remove, gc, du, and snapshot.

A mixin of Node (dsecd/node.py), kept apart so node.py stays about
sandboxes. The blob store and layer mounts belong to dsecd/fs/; this module
only turns protocol requests into calls on them, in worker threads, and
streams their progress to the client.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from .errors import DsecError
from .fs.images import ImageError, ImageStore
from .fs.layers import LayerMounts

log = logging.getLogger(__name__)


def image_error(err: ImageError) -> DsecError:
    return DsecError(str(err), code=err.code)


class ImageOps:
    """Needs from Node: cfg, sandboxes, loop, run_blocking, backend, _get."""

    def init_images(self, cfg) -> None:
        section = cfg.section("images")
        store = Path(section["store"]) if section["store"] else cfg.state_dir / "store"
        self.images = ImageStore(store, cfg.state_dir / "scratch")
        self.layers = LayerMounts(cfg.state_dir / "layers", self.images.store.path, section["layer_grace_s"])
        self.snapshot_exclude = list(section["snapshot_exclude"])
        self._sweep_task: asyncio.Task | None = None

    def start_layer_sweeper(self) -> None:
        async def sweep() -> None:
            period = max(1.0, self.layers.grace_s / 2)
            while True:
                await asyncio.sleep(period)
                try:
                    await self.run_blocking(self.layers.sweep)
                except Exception:
                    log.exception("layer sweep failed")

        self._sweep_task = self.loop.create_task(sweep())

    def _progress(self, ctx):
        def progress(p: dict) -> None:
            self.loop.call_soon_threadsafe(ctx.emit_nowait, {"progress": p})

        return progress

    async def _images_call(self, fn, *args):
        try:
            return await self.run_blocking(fn, *args)
        except ImageError as err:
            raise image_error(err) from err

    async def op_image_build(self, req, ctx) -> dict:
        config = {k: v for k, v in (("env", req.env), ("cwd", req.cwd), ("user", req.user),
                                    ("entrypoint", req.entrypoint)) if v is not None}
        image = await self._images_call(self.images.build_from_dir, req.source, req.name, req.parent,
                                        config, self._progress(ctx))
        return image.to_dict()

    async def op_image_list(self, req, ctx) -> dict:
        images = await self._images_call(self.images.list)
        return {"images": [i.to_dict() for i in images]}

    async def op_image_inspect(self, req, ctx) -> dict:
        image = await self._images_call(self.images.get, req.name)
        users = [s.id for s in self.sandboxes.values() if s.manifest == image.manifest]
        mounted = {d: self.layers.is_mounted(d) for d in image.layer_digests}
        return {**image.to_dict(), "sandboxes": users, "layers_mounted": mounted}

    async def op_image_rm(self, req, ctx) -> dict:
        """Removes the name only; layers stay until `image_gc`, which keeps those
        a live sandbox uses, so sandboxes on the image are unaffected."""
        image = await self._images_call(self.images.remove, req.name)
        return image.to_dict()

    def _in_use(self) -> tuple[set[str], set[str]]:
        live = [s for s in self.sandboxes.values() if s.state != "dead"]
        return {d for s in live for d in s.layers}, {s.manifest for s in live if s.manifest}

    async def op_image_gc(self, req, ctx) -> dict:
        layers, manifests = self._in_use()
        await self.run_blocking(self.layers.sweep, True)
        return await self._images_call(self.images.gc, layers, manifests)

    async def op_image_du(self, req, ctx) -> dict:
        out = await self._images_call(self.images.du)
        out["mounted_layers"] = self.layers.in_use()
        return out

    async def op_snapshot(self, req, ctx) -> dict:
        """pack_diff: freeze the sandbox, pack its upper dir as a layer, thaw."""
        sb = self._get(req.sandbox, req)
        base = await self._images_call(self.images.get_manifest, sb.manifest, sb.image)
        exclude = self.snapshot_exclude + list(req.exclude)
        group = sb.handle.group
        await self.run_blocking(group.freeze)
        try:
            image = await self._images_call(self.images.snapshot, sb.handle.dir / "upper", base,
                                            req.name, exclude, self._progress(ctx))
        finally:
            await self.run_blocking(group.thaw)
        return image.to_dict()
