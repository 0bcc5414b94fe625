"""When a microVM create boots and when it restores a template snapshot.

The first create of an (image, shape) builds the template: a guest booted to
its agent in a QEMU of its own (cgroup and VM dir `.template-<key>`, as
microvm.uid), snapshotted there (device state to a file, RAM in a memfd:
backends/microvm/templates.py), and ended. That create, and every later one
of the same key, then restores the template: a QEMU started waiting for the
state, which it loads (its RAM is the template's memfd mapped copy-on-write),
and the agent's HELLO gives the copy its own identity.

A template of a shape with networking has the NIC too, on a hub port with
no other port (it sends nowhere, and its agent never sets the NIC up); each
restore gets its own tap and its NIC set up after the restore.

One build per key at a time: creates arriving meanwhile wait for it. A
build whose guest does not boot fails the create with the boot's error (the
same error a plain boot would give); a build that boots but cannot be
snapshotted or stored, and a restore that fails, fall back to a plain boot
(logged), and a template that failed to restore is dropped.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from pathlib import Path

from ..backends.microvm import templates
from ..backends.microvm.backend import Machine, MicroVMBackend, VmError, VmHandle
from ..backends.microvm.templates import Template, TemplateStore
from .workers import Workers

log = logging.getLogger(__name__)

TEMPLATE_HOSTNAME = "dsec-template"     # the template guest's own; every restore sets the sandbox's


class TemplateService:
    def __init__(self, backend: MicroVMBackend, store: TemplateStore, workers: Workers, boot_timeout: float,
                 uid: int):
        self.backend, self.store, self.workers = backend, store, workers
        self.boot_timeout = boot_timeout
        self.uid = uid
        self._building: dict[str, asyncio.Future] = {}
        # The daemon's stop (close): builds end at their next step. Not by a
        # cancel: one that came while a step ran in a worker would leave the
        # step running unseen, its QEMU (create) or the RAM fd (commit)
        # destroyed or closed under it, or made after the clean-up.
        self._stopping = asyncio.Event()

    def key(self, layers: list[Path], digests: list[str], memory: int, cpu: float, disk: int,
            net: bool = False) -> str:
        argv = self.backend.template_argv(layers, memory, cpu, disk, net)
        return templates.key_of(argv, digests, self.store.guest_digest, self.store.qemu_id)

    async def get(self, key: str, layers: list[Path], digests: list[str], limits, disk: int,
                  net: bool = False) -> Template:
        """The template `key`: loaded, or built now (one build per key; the
        others wait for it). Raises VmError if its guest does not boot,
        TemplateError or OSError if it cannot be snapshotted or stored."""
        t = await self.workers.run(self.store.get, key)
        if t is not None:
            return t
        fut = self._building.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._build(key, layers, digests, limits, disk, net))
            self._building[key] = fut
            fut.add_done_callback(lambda _: self._building.pop(key, None))
        # A create cancelled meanwhile leaves the build running for the others
        # (and for the next create of the key).
        return await asyncio.shield(fut)

    async def _build(self, key: str, layers: list[Path], digests: list[str], limits, disk: int,
                     net: bool) -> Template:
        name = f".template-{key[:16]}"
        what = f"VM template {key[:16]}"
        t0 = time.monotonic()
        ram = await self.workers.run(templates.new_ram, limits.memory_bytes)
        handle: VmHandle | None = None
        try:
            self._go_on(what)
            handle = await self.workers.run(self.backend.create, name, layers, limits, disk, self.uid, False,
                                            Machine(ram="shared", reporting=False, net=net), ram)
            await self._unless_stopping(self.backend.connect(handle, what, TEMPLATE_HOSTNAME, self.boot_timeout),
                                        what)
            booted = time.monotonic()
            state = handle.vm_dir / "state"
            try:
                await self._unless_stopping(self.backend.snapshot(handle, state), what)
            except templates.TemplateError:
                raise               # the daemon stops: said as such, not as a failed snapshot
            except OSError as err:
                raise templates.TemplateError(errno.EIO, f"{what}: snapshot: {err}") from err
            # Its QEMU ends before the seal: a writable shared mapping of the
            # memfd refuses F_SEAL_WRITE.
            self._go_on(what)
            await self.workers.run(self.backend.stop, name, handle)
            meta = {"layers": list(digests), "created": time.time(), "boot_s": round(booted - t0, 3),
                    "build_s": round(time.monotonic() - t0, 3)}
            self._go_on(what)
            t = await self.workers.run(self.store.commit, key, ram, state, meta)
            ram = -1                                    # commit took it over
        finally:
            if handle is not None:
                await asyncio.shield(self.workers.run(self.backend.destroy, name, handle))
            if ram >= 0:
                os.close(ram)
        log.info("%s built in %.1fs (boot %.1fs): %d MiB of RAM, %d KiB of device state", what,
                 time.monotonic() - t0, meta["boot_s"], t.meta.get("ram_data_bytes", 0) >> 20,
                 t.meta.get("state_bytes", 0) >> 10)
        return t

    def _go_on(self, what: str) -> None:
        """Before a build's next step: none once the daemon stops."""
        if self._stopping.is_set():
            raise templates.TemplateError(errno.ECANCELED, f"{what}: not built: the daemon is stopping")

    async def _unless_stopping(self, step, what: str):
        """Await coroutine `step` (a guest's boot, its snapshot: on the loop,
        safe to cut), cut short by the daemon's stop."""
        if self._stopping.is_set():
            step.close()            # never started
            self._go_on(what)
        task = asyncio.ensure_future(step)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
        if task.cancelled():
            self._go_on(what)
        return task.result()

    async def restore(self, handle: VmHandle, t: Template, what: str, hostname: str, sandbox_id: str) -> None:
        """Load template `t` into `handle`, a QEMU started incoming on its
        RAM, and give the copy its identity."""
        await self.backend.restore(handle, t.state, what, hostname, self.boot_timeout, sandbox_id=sandbox_id,
                                   ignore_shared=True)
        handle.template = t.key

    async def drop(self, key: str, why: str) -> None:
        log.warning("VM template %s dropped: %s", key[:16], why)
        await self.workers.run(self.store.drop, key)

    async def gc(self, live_layers: set[str]) -> list[str]:
        return await self.workers.run(self.store.gc, live_layers)

    async def close(self) -> None:
        """Daemon shutdown: builds under way end at their next step (a boot
        or snapshot at once), their QEMU destroyed while the workers still
        run (a build left to asyncio's last cancel could not clean up: its
        QEMU, VM dir and cgroups would outlive the daemon until the next
        one's sweep_builds)."""
        self._stopping.set()
        await asyncio.gather(*self._building.values(), return_exceptions=True)

    def sweep_builds(self) -> None:
        """Blocking, at the daemon's start: what a build interrupted by a
        crash left (QEMU in its cgroup, its VM dir), and stale templates."""
        for name in self.backend.template_build_leftovers():
            log.warning("removing an interrupted VM template build %s", name)
            self.backend.destroy(name, None)
        for key in self.store.sweep():
            log.info("VM template %s removed: built for another guest, QEMU or format", key[:16])

    def info(self) -> list[dict]:
        return self.store.info()


def is_boot_failure(err: BaseException) -> bool:
    """A template build that failed because its guest did not boot: the
    create fails with that (a plain boot would too), rather than booting again."""
    return isinstance(err, VmError)
