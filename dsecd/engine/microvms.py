"""What the engine does for microVM sandboxes (backend "microvm"), where the
container path does not fit: the VM's start and its wait for the guest
agent, execs and file operations over the agent's channel, pause and resume
through QEMU's monitor. The mechanism is dsecd/backends/microvm/.

The services that own an op (creates, execs, files, lifecycle, memory) keep
its checks and hand a VM sandbox to the method here of the same name, so
both backends answer one protocol with the same semantics and error codes:
a command that does not exist is `not_found`, a bad cwd `not_found`, a file
error carries `detail.errno`, a timeout kills the process group and says
`timed_out`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from .. import fds, userns
from ..backends.microvm import wire
from ..backends.microvm.agent import AgentError, AgentExec, AgentGone
from ..backends.microvm.backend import MIN_GUEST_MEMORY, Machine, MicroVMBackend, VmError, VmHandle
from ..errors import (
    BadRequest,
    Conflict,
    DsecError,
    Unsupported,
    exec_error,
    io_error,
)
from ..execio import _decode_status
from ..fs import files as sbfiles
from ..fs import uppertar
from .sandboxes import Sandbox
from .vmtemplates import TemplateService, is_boot_failure
from .workers import Workers

log = logging.getLogger(__name__)

KILL_GRACE_S = 10.0     # a killed exec's EXITED should come at once; past this the result is sent anyway


class VmExec:
    """A running VM exec as the server sees it (ctx.register_exec): stdin in, cancel."""

    has_tty = False
    cancelled = False

    def __init__(self, takes_stdin: bool):
        self.takes_stdin = takes_stdin
        self.run: AgentExec | None = None
        # Set once the exec was sent to the agent (or failed to be): input
        # that comes before waits for it instead of being lost.
        self.sent = asyncio.Event()

    async def feed_stdin(self, data: bytes, eof: bool) -> None:
        """Waits while the process does not read (AgentExec.send_stdin)."""
        await self.sent.wait()
        if self.run is not None:
            with contextlib.suppress(AgentGone):        # the VM is going: the exec reports its end
                await self.run.send_stdin(bytes(data), eof)


class MicroVMService:
    """Creates, execs, files, pause and resume of microVM sandboxes.
    `backend` is None where the host cannot run them (`why` says why)."""

    def __init__(self, backend: MicroVMBackend | None, why: str, workers: Workers, store_path, cfg: dict,
                 max_output: int, uid_fallback: int, templates: TemplateService | None = None):
        self.backend = backend
        self.templates = templates          # None: every create boots (microvm.templates = false)
        self.why = why
        self.workers = workers
        self.store_path = store_path            # digest -> Path of the blob (the image store's)
        self.cfg = cfg
        self.max_output = max_output
        self.uid_fallback = uid_fallback
        # LifecycleService.watch, set by the node: a resumed VM's new QEMU is watched like the first.
        self.watch = None
        # NetworkService, set by the node: a VM with --net default gets a tap per QEMU.
        self.net = None

    def info(self) -> dict:
        if self.backend is None:
            return {"available": False, "why": self.why}
        return {"available": True, "accel": self.backend.accel, "why": self.why,
                "guest_kernel": self.backend.guest.version, "templates": self.templates is not None}

    async def gc_templates(self, live_layers: set[str]) -> list[str]:
        """`image gc`: templates of layers the store no longer has go."""
        if self.templates is None:
            return []
        return await self.templates.gc(live_layers)

    def require(self) -> MicroVMBackend:
        if self.backend is None:
            raise Unsupported(f"backend microvm is not available on this host: {self.why} (see `dsec info`)")
        return self.backend

    # ------------------------------------------------------------ create

    def check_create(self, req, memory: int) -> None:
        """What a VM cannot do (yet), refused before anything is made."""
        self.require()
        if memory < MIN_GUEST_MEMORY:
            raise BadRequest(f"a microVM needs memory of at least {MIN_GUEST_MEMORY >> 20}M, got {memory} bytes")
        if req.publish:
            raise Unsupported("backend microvm publishes no ports yet: its tap's program checks every frame "
                              "the guest sends against the allowlist, answers to inbound connections included; "
                              "create it without publish")

    async def create(self, sb: Sandbox, limits, disk: int) -> VmHandle:
        """Start the VM, from its template where there is one (made now if
        not), else by a boot, and wait for its agent; with networking
        (sb.net, attached before: NetworkService.attach_vm), its NIC set up.
        Cancelled or failed, no QEMU is left (a template being built goes on
        for later creates)."""
        backend = self.require()
        layers = [Path(self.store_path(d)) for d in sb.layers]
        what = f"microVM {sb.id}"
        net = networked(sb)
        if self.templates is not None:
            key = self.templates.key(layers, sb.layers, limits.memory_bytes, limits.cpu, disk, net)
            try:
                t = await self.templates.get(key, layers, sb.layers, limits, disk, net)
            except OSError as err:
                if is_boot_failure(err):
                    raise DsecError(f"create sandbox {sb.id}: {err.strerror}", {"errno": "EIO"}, code="io") from err
                log.warning("sandbox %s: no VM template (%s); booting it", sb.id, err)
            else:
                handle, guest_net = await self._start(sb, layers, limits, disk,
                                                      Machine(ram="private", reporting=False, net=net), t.ram_fd)
                try:
                    await self.templates.restore(handle, t, what, sb.hostname, sb.id)
                except OSError as err:
                    await asyncio.shield(self.workers.run(backend.destroy, sb.id, handle))
                    await self.templates.drop(key, f"sandbox {sb.id} could not be restored from it ({err})")
                except BaseException:
                    await asyncio.shield(self.workers.run(backend.destroy, sb.id, handle))
                    raise
                else:
                    await self._finish(sb, handle, guest_net)
                    sb.vm = {"machine": handle.machine.to_record(), "template": key}
                    return handle
        handle, guest_net = await self._start(sb, layers, limits, disk, Machine(net=net), -1)
        try:
            await backend.connect(handle, what, sb.hostname, float(self.cfg["boot_timeout_s"]), sandbox_id=sb.id)
        except BaseException as err:
            await asyncio.shield(self.workers.run(backend.destroy, sb.id, handle))
            if isinstance(err, VmError):
                raise DsecError(f"create sandbox {sb.id}: {err.strerror}", {"errno": "EIO"}, code="io") from err
            raise
        await self._finish(sb, handle, guest_net)
        sb.vm = {"machine": handle.machine.to_record(), "template": None}
        return handle

    async def _finish(self, sb: Sandbox, handle: VmHandle, guest_net: dict | None) -> None:
        """The guest's network after its boot or restore; a failure ends the VM."""
        try:
            await self._setup_net(sb, handle, guest_net)
        except BaseException as err:
            await asyncio.shield(self.workers.run(self.require().destroy, sb.id, handle))
            if isinstance(err, OSError):
                raise DsecError(f"create sandbox {sb.id}: {err.strerror or err}", {"errno": "EIO"},
                                code="io") from err
            raise

    async def _start(self, sb: Sandbox, layers: list[Path], limits, disk: int, machine: Machine,
                     ram_fd: int) -> tuple[VmHandle, dict | None]:
        """QEMU started in the sandbox's cgroups (waiting for a template's
        state when its machine maps one), on a new tap when it has a NIC;
        and what the guest's NIC is to be given (None: no NIC)."""
        backend = self.require()
        tap_fd, guest_net = await self._plug(sb) if machine.net else (-1, None)

        def abandoned(fut) -> None:       # the request went while QEMU started: it goes too
            if not fut.cancelled() and fut.exception() is None:
                self.workers.behind(backend.destroy, sb.id, fut.result())

        try:
            handle = await self.workers.run_shielded(abandoned, backend.create, sb.id, layers, limits, disk,
                                                     self._uid(sb), machine.ram == "private", machine, ram_fd,
                                                     tap_fd)
        except OSError as err:
            raise DsecError(f"create sandbox {sb.id}: {err.strerror or err}",
                            {"errno": errno.errorcode.get(err.errno or 0)}, code="io") from err
        finally:
            fds.close_quietly(tap_fd)         # QEMU has its own; the tap lives as long as QEMU
        return handle, guest_net

    # ------------------------------------------------------------ networking

    async def _plug(self, sb: Sandbox) -> tuple[int, dict]:
        """A tap for the VM's next QEMU, its policy program on it (Network.plug_vm)."""
        if self.net is None:
            raise Unsupported("networking is not set up in this daemon")
        net = await self.net.network()
        try:
            return await self.workers.run(net.plug_vm, sb.id)
        except OSError as err:
            raise DsecError(f"make the tap of sandbox {sb.id}: {err}", code="io") from err

    async def _setup_net(self, sb: Sandbox, handle: VmHandle, guest: dict | None) -> None:
        """The guest's NIC (address, route, MAC: the agent, wire.NET) and its
        /etc/resolv.conf naming the sandboxes' resolver, as a container's."""
        if guest is None:
            return
        iface = guest["ipv4"]
        try:
            await handle.agent.request(wire.NET, wire.bstr(guest["mac"]), wire.u64(int(iface.ip)),
                                       wire.u64(iface.network.prefixlen), wire.u64(int(guest["gateway"])),
                                       wire.u64(guest["mtu"]))
        except AgentError as err:
            raise VmError(err.errno, f"set up the network of microVM {sb.id}: {err.strerror}") from err
        net = await self.net.network()
        if net.dns_enabled:
            link = handle.agent
            try:
                st = (await link.request(wire.STAT, wire.bstr("/etc/resolv.conf"))).stat()
                if st["type"] == "symlink":       # replaced, not followed (as write_resolv_conf does)
                    await link.request(wire.REMOVE, wire.bstr("/etc/resolv.conf"), wire.u64(0))
            except AgentError:
                pass
            try:
                await link.request(wire.WRITE, wire.bstr("/etc/resolv.conf"), wire.u64(wire.WRITE_PARENTS),
                                   wire.u64(0o644), wire.u64(wire.NO_OFFSET),
                                   wire.bstr(f"nameserver {net.ipam.gateway4}\n"))
            except AgentError as err:
                raise VmError(err.errno, f"write /etc/resolv.conf of microVM {sb.id}: {err.strerror}") from err

    async def reconnect(self, sb: Sandbox, handle: VmHandle) -> None:
        """The monitor and agent of a VM re-adopted after a daemon restart.
        A paused VM's agent is not reached until it is resumed."""
        paused = sb.state == "paused"
        await self.require().connect(handle, f"microVM {sb.id}", sb.hostname, 30.0, hello=not paused)

    def detach(self, handle: VmHandle) -> None:
        """Daemon shutdown: the channels close, the VM runs on for the next daemon."""
        for link in (handle.agent, handle.qmp):
            if link is not None:
                link.close()
        handle.agent = handle.qmp = None
        fds.close_quietly(handle.pidfd)
        handle.pidfd = -1

    def inspect(self, sb: Sandbox) -> dict:
        h = sb.handle
        return {"qemu_pid": h.init_pid, "accel": h.accel, "dir": str(h.vm_dir),
                "serial_log": str(h.vm_dir / "serial.log"), "guest_memory": h.guest_memory,
                "agent": h.agent is not None and not h.agent.closed,
                "template": (sb.vm or {}).get("template"), "ram": h.machine.ram}

    # ------------------------------------------------------------ pause / resume

    def _uid(self, sb: Sandbox) -> int:
        idmap = userns.IdMap.from_record(sb.idmap)
        return idmap.uid if idmap else self.uid_fallback

    async def pause(self, sb: Sandbox) -> dict:
        """The VM's state to a file in its dir, its QEMU ended: all its memory
        goes back to the host. The record says where the image is."""
        backend, h = self.require(), sb.handle
        if sb.execs:
            raise Conflict(f"sandbox {sb.id} has {sb.execs} running exec(s); a microVM pauses only idle "
                           "(its agent's channel does not survive the stop)", {"sandbox": sb.id})
        image = h.vm_dir / "paused.ram"
        t0 = time.monotonic()
        self.workers.loop.remove_reader(h.pidfd)       # its end is ours, not a death
        try:
            size = await backend.save(h, image)
        except OSError as err:
            if self.watch is not None:
                self.watch(sb)
            raise DsecError(f"pause sandbox {sb.id}: {err}", code="io") from err
        saved = time.monotonic()
        await self.workers.run(backend.end_process, h)
        if networked(sb) and self.net is not None and self.net.net is not None:
            await self.workers.run(self.net.net.unplug_vm, sb.id)       # its tap went with QEMU
        return {"vm_image": str(image), "image_bytes": size, "save_s": round(saved - t0, 4),
                "stop_s": round(time.monotonic() - saved, 4)}

    def adopted(self, sb: Sandbox, handle: VmHandle) -> None:
        """A re-adopted VM's handle learns its machine from the record (a
        resume starts QEMU with it)."""
        handle.machine = Machine.from_record((sb.vm or {}).get("machine"))
        handle.template = (sb.vm or {}).get("template")
        handle.guest_memory = sb.limits["memory"]

    async def stop_vcpus(self, sb: Sandbox) -> None:
        """A job pause's freeze: the VM's vCPUs stop (QMP stop); QEMU and its
        memory stay until the save behind the answer (MemoryService)."""
        h = sb.handle
        if h is None or h.qmp is None:
            raise Conflict(f"sandbox {sb.id} is exiting (no monitor)", {"sandbox": sb.id})
        await h.qmp.command("stop")

    async def resume(self, sb: Sandbox, rec: dict) -> dict:
        backend, h = self.require(), sb.handle
        if rec.get("vm_stopped") and not rec.get("vm_image"):
            # Only its vCPUs were stopped (a job pause whose save had not run):
            # run them, and step the guest's clock over the stop (HELLO).
            t0 = time.monotonic()
            try:
                await h.qmp.command("cont")
                if h.agent is not None and not h.agent.closed:
                    await h.agent.hello(sb.hostname, sb.id)
                else:           # re-adopted while stopped: its agent is reached now
                    h.agent = await backend.connect_agent(h, f"microVM {sb.id}", sb.hostname, 30.0, sb.id)
            except OSError as err:
                raise DsecError(f"resume sandbox {sb.id}: {err}", code="io") from err
            return {"restore_s": round(time.monotonic() - t0, 4)}
        image = Path(rec.get("vm_image") or h.vm_dir / "paused.ram")
        t0 = time.monotonic()
        layers = [Path(self.store_path(d)) for d in sb.layers]
        tap_fd = (await self._plug(sb))[0] if h.machine.net else -1
        try:
            await self.workers.run(backend.respawn, h, layers, sb.limits["cpu"], sb.limits["disk"], self._uid(sb),
                                   tap_fd)
        finally:
            fds.close_quietly(tap_fd)
        try:
            await backend.restore(h, image, f"microVM {sb.id}", sb.hostname, sandbox_id=sb.id)
        except OSError as err:
            raise DsecError(f"resume sandbox {sb.id}: {err}; its saved state stays in {image}", code="io") from err
        image.unlink(missing_ok=True)
        sb.vm = {**(sb.vm or {}), "machine": h.machine.to_record()}
        if self.watch is not None:
            self.watch(sb)
        return {"restore_s": round(time.monotonic() - t0, 4)}

    async def check_cwd(self, sb: Sandbox, cwd: str) -> None:
        if cwd == "/":
            return
        try:
            st = await self.stat_path(sb, cwd)
        except DsecError:
            st = None
        if st is None or st["type"] != "dir":
            raise BadRequest(f"cwd {cwd!r} is not a directory in image {sb.image!r}: give one that "
                             "exists, or create without --cwd and make it with an exec", {"cwd": cwd})

    # ------------------------------------------------------------ exec

    def _agent(self, sb: Sandbox):
        h = sb.handle
        if h is None or h.agent is None or h.agent.closed:
            raise Conflict(f"sandbox {sb.id} is exiting (its VM's agent channel is closed)", {"sandbox": sb.id})
        return h.agent

    async def exec(self, sb: Sandbox, req, env: list[str], cwd: str, user: int, timeout: float | None, ctx) -> dict:
        if req.pty or req.trace:
            raise Unsupported("backend microvm runs no pty or traced execs yet: drop pty/trace")
        link = self._agent(sb)
        argv = list(req.argv)
        io = VmExec(req.stdin)
        out: dict[int, list[bytes]] = {1: [], 2: []}
        delivered, truncated, timed_out = 0, False, False
        started = time.monotonic()
        sb.execs += 1
        ctx.register_exec(io)
        run = None
        try:
            try:
                run = io.run = await link.start_exec(argv, env, cwd, user, req.stdin)
            finally:
                io.sent.set()
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            status = None
            while status is None:
                wait = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    ev = await asyncio.wait_for(run.events.get(), wait)
                except TimeoutError:
                    if timed_out:      # killed, and no end reported within the grace
                        raise DsecError(f"exec {argv[0]!r} in sandbox {sb.id}: did not end "
                                        f"{KILL_GRACE_S:.0f}s after a kill", code="io") from None
                    timed_out = True
                    run.kill()
                    deadline = loop.time() + KILL_GRACE_S
                    continue
                kind = ev[0]
                if kind == "out":
                    data = ev[2]
                    room = self.max_output - delivered
                    if len(data) > room:
                        data, truncated = data[:room], True
                        run.kill()       # the cap: like EPIPE on the container side, the process stops
                    delivered += len(data)
                    if data:
                        if req.stream:
                            await ctx.emit({"fd": ev[1], "data": data})
                        else:
                            out[ev[1]].append(data)
                elif kind == "exited":
                    status = ev[1]
                elif kind == "error":
                    raise exec_error(ev[1], argv[0], cwd)
                elif kind == "gone":
                    raise Conflict(f"sandbox {sb.id} is exiting; exec {argv[0]!r} ended with its VM",
                                   {"sandbox": sb.id})
        except BaseException:
            if run is not None and not run.done:
                run.kill()
            raise
        finally:
            if run is not None:
                link.forget(run)
            sb.execs -= 1
            sb.last_active = time.monotonic()
            ctx.unregister_exec()
        code, sig = _decode_status(status)
        result = {"exit_code": code, "signal": sig, "timed_out": timed_out, "truncated": truncated,
                  "cancelled": io.cancelled, "duration_ms": round((time.monotonic() - started) * 1000, 3)}
        if not req.stream:
            result["stdout"] = b"".join(out[1])
            result["stderr"] = b"".join(out[2])
        return result

    # ------------------------------------------------------------ the writable layer

    @contextlib.asynccontextmanager
    async def upper_tree(self, sb: Sandbox, scratch: Path, max_bytes: int):
        """The VM's writable layer (the overlay's upper dir in the guest) as
        a host directory, for snapshot: the agent streams it as a tar (every
        guest process stopped meanwhile), unpacked under `scratch`
        (dsecd/fs/uppertar.py); removed on exit. No pause or resume runs
        meanwhile (the sandbox's lock)."""
        link = self._agent(sb)
        work = Path(tempfile.mkdtemp(prefix=f"vm-upper-{sb.id}-", dir=scratch))
        try:
            tar, tree = work / "upper.tar", work / "upper"
            fd = os.open(tar, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            failed: list[OSError] = []

            def on_data(data: bytes) -> None:       # on the loop, from the link's reader: never raise
                if failed:
                    return
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                except OSError as err:
                    failed.append(err)

            try:
                async with sb.lock:
                    r = await link.stream(wire.TAR, on_data, wire.u64(max_bytes))
            except AgentError as err:
                raise io_error("read the writable layer of", sb.id, err) from err
            except AgentGone as err:
                raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err
            finally:
                os.close(fd)
            if failed:
                raise io_error("store the writable layer of", f"{sb.id} in {tar}", failed[0])
            entries, file_bytes, skipped = r.u64(), r.u64(), r.u64()
            log.info("sandbox %s: writable layer read, %d entries, %d bytes of files, %d skipped (sockets, "
                     "devices)", sb.id, entries, file_bytes, skipped)
            tree.mkdir(0o700)
            try:
                await self.workers.run(uppertar.unpack, tar, tree)
            except (ValueError, OSError) as err:
                raise DsecError(f"snapshot of sandbox {sb.id}: its writable layer's tar: {err}", code="io") from err
            tar.unlink()
            yield tree
        finally:
            await self.workers.run(shutil.rmtree, work, True)

    # ------------------------------------------------------------ files

    async def _file(self, sb: Sandbox, verb: str, where: str, kind: int, *fields: bytes) -> wire.Reader:
        link = self._agent(sb)
        try:
            return await link.request(kind, *fields)
        except AgentError as err:
            raise io_error(verb, f"{sb.id}:{where}", err) from err
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err

    async def stat_path(self, sb: Sandbox, path: str) -> dict:
        path = _check(path)
        r = await self._file(sb, "stat", path, wire.STAT, wire.bstr(path))
        return {**r.stat(), "path": path}

    async def file_op(self, sb: Sandbox, req) -> dict:
        """file_read, file_write, file_list, file_stat, file_mkdir,
        file_remove, file_rename (their checks done by FileService)."""
        op = req.OP
        if op == "file_stat":
            return await self.stat_path(sb, req.path)
        if op == "file_rename":
            src, dst = _check(req.src), _check(req.dst)
            flags = ((wire.RENAME_OVERWRITE if req.overwrite else 0)
                     | (wire.RENAME_KEEP_ATTRS if req.keep_attrs else 0))
            await self._file(sb, "rename", f"{src} -> {dst}", wire.RENAME, wire.bstr(src), wire.bstr(dst),
                             wire.u64(flags))
            return {"src": src, "dst": dst}
        path = _check(req.path)
        if op == "file_read":
            r = await self._file(sb, "read", path, wire.READ, wire.bstr(path), wire.u64(req.offset),
                                 wire.u64(req.length))
            size, data = r.u64(), r.bytes()
            return {"data": data, "size": size, "eof": req.offset + len(data) >= size}
        if op == "file_write":
            if path == "/":
                raise BadRequest("cannot write to /")
            flags = ((wire.WRITE_APPEND if req.append else 0) | (wire.WRITE_PARENTS if req.parents else 0)
                     | (wire.WRITE_KEEP if req.offset is not None else 0))
            r = await self._file(sb, "write", path, wire.WRITE, wire.bstr(path), wire.u64(flags),
                                 wire.u64(req.mode), wire.u64(wire.NO_OFFSET if req.offset is None else req.offset),
                                 wire.bstr(bytes(req.data)))
            return {"size": r.u64()}
        if op == "file_list":
            r = await self._file(sb, "list", path, wire.LIST, wire.bstr(path), wire.u64(req.depth))
            entries = []
            body_end = len(r.body) - 16           # the count and the truncated flag close the body
            while r.at < body_end:
                name = r.str()
                entries.append({"name": name, **r.stat()})
            r.u64()
            truncated = bool(r.u64())
            entries.sort(key=lambda e: e["name"])
            return {"path": path, "entries": entries, "truncated": truncated}
        if op == "file_mkdir":
            r = await self._file(sb, "mkdir", path, wire.MKDIR, wire.bstr(path), wire.u64(1 if req.parents else 0),
                                 wire.u64(req.mode))
            return {"path": path, "created": bool(r.u64())}
        if op == "file_remove":
            if path == "/":
                raise BadRequest("cannot remove /")
            r = await self._file(sb, "remove", path, wire.REMOVE, wire.bstr(path),
                                 wire.u64(1 if req.recursive else 0))
            return {"path": path, "removed": r.u64()}
        raise Unsupported(f"{op} is not available for backend microvm yet")


def networked(sb: Sandbox) -> bool:
    """Whether the sandbox has a network of its own (--net default)."""
    return bool(sb.net) and sb.net.get("mode") == "default"


def _check(path: str) -> str:
    try:
        return sbfiles.check_path(path)
    except sbfiles.PathError as err:
        raise BadRequest(str(err), {"path": path}) from err


