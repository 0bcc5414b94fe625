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
import signal
import struct
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .. import fds, tarsafe, userns
from ..backends.microvm import wire
from ..backends.microvm.agent import AgentError, AgentExec, AgentGone
from ..backends.microvm.backend import (
    GUEST_FIXED,
    MAX_LAYERS,
    MIN_GUEST_MEMORY,
    SAVED_STATE,
    Machine,
    MicroVMBackend,
    VmError,
    VmHandle,
    tmp_cap,
    upper_cap,
)
from ..config import size_text
from ..errors import (
    BadRequest,
    Busy,
    Conflict,
    DsecError,
    LimitExceeded,
    NotFound,
    Unsupported,
    exec_error,
    io_error,
)
from ..execio import DEFAULT_WINDOW, RunTimer, _decode_status, ended
from ..fs import erofs, tarcopy, uppertar, users
from ..fs import files as sbfiles
from ..fs.layers import distinct_layers
from ..mem import pause as mempause
from ..protocol import FileMkdir
from .network import hosts_text
from .sandboxes import Sandbox
from .vmtemplates import TemplateService, is_boot_failure
from .workers import Workers

log = logging.getLogger(__name__)

KILL_GRACE_S = 10.0     # a killed exec's EXITED should come at once; past this the result is sent anyway
# What a file write or copy into a VM must leave of the guest's available
# memory, for its kernel and processes: a 16th of its RAM, within these
# bounds (as engine/copier.py keeps for a container's).
GUEST_RESERVE_MIN = 16 << 20
GUEST_RESERVE_MAX = 64 << 20
# A file of a directory copy at least this big is checked against the
# guest's memory before it is sent (smaller ones meet the layer's cap).
PUT_CHECK_BYTES = 1 << 20
# How long a pause waits for the VM's agent requests under way (a file
# chunk of limits.max_file_chunk_bytes takes about a second under TCG).
REQUESTS_SETTLE_S = 30.0
PUT_END_S = 30.0        # a cancelled put's guest child ends by then (it writes what came, or removes it)


class VmExec:
    """A running VM exec as the server sees it (ctx.register_exec): stdin in, cancel."""

    cancelled = False

    def __init__(self, takes_stdin: bool, has_tty: bool = False):
        self.takes_stdin = takes_stdin
        self.has_tty = has_tty
        self.run: AgentExec | None = None
        # Set once the exec was sent to the agent (or failed to be): input
        # that comes before waits for it instead of being lost.
        self.sent = asyncio.Event()

    def resize(self, rows: int, cols: int) -> None:
        if self.run is None:
            raise OSError(errno.EAGAIN, "the terminal is not open yet: the exec is starting")
        try:
            self.run.resize(rows, cols)
        except AgentGone as err:
            raise OSError(errno.EBADF, f"the terminal is closed: {err}") from err

    def signal(self, signum: int) -> bool:
        """signum to the exec's process group in the guest; False when it
        has not been sent to the agent yet or has ended."""
        if self.run is None or self.run.done or self.run.ended:
            return False
        self.run.kill(signum)
        return True

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
                 max_output: int, uid_fallback: int, templates: TemplateService | None = None,
                 max_trace: int = 1 << 20):
        self.backend = backend
        self.templates = templates          # None: every create boots (microvm.templates = false)
        self.why = why
        self.workers = workers
        self.store_path = store_path            # digest -> Path of the blob (the image store's)
        self.cfg = cfg
        self.max_output = max_output
        self.max_trace = max_trace              # limits.max_trace_bytes: a traced exec's record
        self.uid_fallback = uid_fallback
        # LifecycleService.watch, set by the node: a resumed VM's new QEMU is watched like the first.
        self.watch = None
        # NetworkService, set by the node: a VM with --net default gets a tap per QEMU.
        self.net = None
        # ProcessService's VmProcs.linked, set by the node: called with the
        # sandbox after a resume gave it a new agent channel, or a HELLO on
        # the old one (either detaches the agent's background processes).
        self.relinked = None
        # BalloonService (engine/vmballoon.py), set by the node: every op wakes the VM's balloon.
        self.balloon = None
        # sandbox id -> the guest children of its running file watches (start_watch):
        # a pause ends them (_end_watches).
        self._watches: dict[str, set[AgentExec]] = {}
        # sandbox id -> its agent requests under way that a pause must not
        # cut (file ops, background process starts and kills: request_running),
        # and the event a pause waits on for the last of them to end (_requests_settled).
        self._requests: dict[str, int] = {}
        self._requests_idle: dict[str, asyncio.Event] = {}

    def info(self) -> dict:
        if self.backend is None:
            return {"available": False, "why": self.why}
        own_root = self.backend.own_root
        return {"available": True, "accel": self.backend.accel, "why": self.why,
                "guest_kernel": self.backend.guest.version, "templates": self.templates is not None,
                "own_mount_namespace": own_root.available, "root": own_root.detail}

    def template_info(self) -> dict:
        """Blocking (a worker's): info's `template_store`, the templates on
        disk and what each loaded one holds in the daemon's memory now
        (`held_bytes`: the guest RAM its boot wrote, and the whole guest RAM
        from the first pause of a VM restored from it on), with their sum:
        memory charged to the daemon, not to any sandbox. {} when templates
        are off."""
        if self.backend is None or self.templates is None:
            return {}
        rows = self.templates.info()
        return {"templates": rows, "held_bytes": sum(r["held_bytes"] for r in rows),
                "max": self.templates.store.max_templates}

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
        """What a VM cannot do (yet), refused before anything is made: a
        create that boots a VM none of whose execs could run (a task policy)
        or that asks a limit it would not have (pids) fails now, not after
        the boot."""
        self.require()
        if memory < MIN_GUEST_MEMORY:
            raise BadRequest(f"a microVM needs memory of at least {MIN_GUEST_MEMORY >> 20}M, got {memory} bytes")
        if req.policy is not None:
            # (A sandbox's policy comes from its create alone: no config default applies.)
            raise Unsupported("create --backend microvm: task policies (--policy; Landlock and seccomp applied by "
                              "dsec-init) are enforced in containers only, and every exec of the VM would be "
                              "refused; create the microVM without --policy, or a container with it",
                              {"policy": req.policy if isinstance(req.policy, str) else None})
        if req.pids is not None:
            raise Unsupported(f"create --backend microvm: --pids {req.pids} cannot be enforced in a microVM (its "
                              "processes are the guest kernel's, and its guest has no pids limit); its --memory "
                              "bounds them. Create it without --pids, or a container with it", {"pids": req.pids})

    @staticmethod
    def check_layers(image: str, digests: list[str]) -> None:
        """An image with more distinct layers than a VM has virtio-pmem
        slots for is refused before anything is made (QEMU would not start)."""
        n = len(distinct_layers(digests))
        if n > MAX_LAYERS:
            raise BadRequest(f"image {image!r} has {n} distinct layers, and a microVM takes at most {MAX_LAYERS} "
                             f"layers (one virtio-pmem device each): `dsec image flatten {image}` makes it a "
                             "single layer; or run it in a container",
                             {"layers": n, "max_layers": MAX_LAYERS})

    async def create(self, sb: Sandbox, limits, disk: int) -> VmHandle:
        """Start the VM, from its template where there is one (made now if
        not), else by a boot, and wait for its agent; with networking
        (sb.net, attached before: NetworkService.attach_vm), its NIC set up.
        Cancelled or failed, no QEMU is left (a template being built goes on
        for later creates)."""
        backend = self.require()
        digests = distinct_layers(sb.layers)
        layers = self._layer_files(digests)
        what = f"microVM {sb.id}"
        net = networked(sb)
        if self.templates is not None:
            key = self.templates.key(layers, digests, limits.memory_bytes, limits.cpu, disk, net)
            try:
                t = await self.templates.get(key, layers, digests, limits, disk, net)
            except OSError as err:
                if is_boot_failure(err):
                    raise DsecError(f"create sandbox {sb.id}: {err.strerror}", {"errno": "EIO"}, code="io") from err
                if err.errno == errno.ECANCELED:        # nor a boot now: the daemon stops
                    raise Busy(f"create sandbox {sb.id}: {err.strerror}; create it again once dsecd runs",
                               {"sandbox": sb.id}) from err
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

    def _layer_files(self, digests: list[str]) -> list[Path]:
        """The store's blob of each layer, one virtio-pmem device each (a
        repeated layer is attached once: distinct_layers)."""
        return [Path(self.store_path(d)) for d in digests]

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
            await handle.agent.request(wire.NET, *wire.net_fields(guest["mac"], iface, guest["gateway"], guest["mtu"],
                                                                  guest.get("ipv6"), guest.get("gateway6")))
        except AgentError as err:
            raise VmError(err.errno, f"set up the network of microVM {sb.id}: {err.strerror}") from err
        net = await self.net.network()
        files = {"/etc/hosts": hosts_text(sb.hostname, {"ipv4": str(iface.ip),
                                                        "ipv6": str(guest["ipv6"].ip) if guest.get("ipv6") else ""})}
        if net.dns_enabled:
            files["/etc/resolv.conf"] = f"nameserver {net.ipam.gateway4}\n"
        link = handle.agent
        for path, text in files.items():
            try:
                st = (await link.request(wire.STAT, wire.bstr(path))).stat()
                if st["type"] == "symlink":       # replaced, not followed (as write_net_files does)
                    await link.request(wire.REMOVE, wire.bstr(path), wire.u64(0))
            except AgentError:
                pass
            try:
                await link.request(wire.WRITE, wire.bstr(path), wire.u64(wire.WRITE_PARENTS),
                                   wire.u64(0o644), wire.u64(wire.NO_OFFSET), wire.bstr(text))
            except AgentError as err:
                raise VmError(err.errno, f"write {path} of microVM {sb.id}: {err.strerror}") from err

    async def reconnect(self, sb: Sandbox, handle: VmHandle) -> None:
        """The monitor and agent of a VM re-adopted after a daemon restart.
        A paused VM's agent is not reached until it is resumed."""
        paused = sb.state == "paused"
        await self.require().connect(handle, f"microVM {sb.id}", sb.hostname, 30.0, hello=not paused,
                                     wake=not paused)

    def detach(self, handle: VmHandle) -> None:
        """Daemon shutdown: the channels close, the VM runs on for the next daemon."""
        for link in (handle.agent, handle.qmp):
            if link is not None:
                link.close()
        handle.agent = handle.qmp = None
        handle.close_pidfd()

    def inspect(self, sb: Sandbox) -> dict:
        h = sb.handle
        return {"qemu_pid": h.init_pid if h.pidfd >= 0 else None,          # none while paused: QEMU ended
                "accel": h.accel, "dir": str(h.vm_dir),
                "serial_log": str(h.vm_dir / "serial.log"), "guest_memory": h.guest_memory,
                "agent": h.agent is not None and not h.agent.closed,
                "template": (sb.vm or {}).get("template"), "ram": h.machine.ram,
                "balloon": None if self.balloon is None else self.balloon.view(sb.id)}

    # ------------------------------------------------------------ pause / resume

    def _uid(self, sb: Sandbox) -> int:
        idmap = userns.IdMap.from_record(sb.idmap)
        return idmap.uid if idmap else self.uid_fallback

    async def pause(self, sb: Sandbox) -> dict:
        """The VM's state to a file in its dir, its QEMU ended: its memory
        goes back to the host. The record says where the image is, how much
        the sandbox's cgroups were charged less after it (freed_bytes) and
        what they still are (held_bytes: None where unreadable)."""
        backend, h = self.require(), sb.handle
        if sb.execs:
            # A directory copy runs as an exec of the guest agent (_copy): named apart.
            copies = min(sb.copies, sb.execs)
            running = [f"{sb.execs - copies} running exec(s)"] if sb.execs > copies else []
            running += [f"{copies} directory cop{'y' if copies == 1 else 'ies'} under way"] if copies else []
            raise Conflict(f"sandbox {sb.id} has {' and '.join(running)}; a microVM pauses only idle "
                           "(its agent's channel does not survive the stop)",
                           {"sandbox": sb.id, "execs": sb.execs - copies, "copies": copies})
        await self._requests_settled(sb)
        await self._end_watches(sb)
        image = h.vm_dir / SAVED_STATE
        if h.machine.ram == "private" and self.templates is not None and h.template:
            made = await self.workers.run(self.templates.store.fill_holes, h.template, h.init_pid)
            if made:
                log.info("sandbox %s: %d MiB of its template's RAM made before its save", sb.id, made >> 20)
        before = await self._charged(h)
        t0 = time.monotonic()
        pidfd = h.pidfd         # (-1: a destroy came meanwhile, from a worker)
        if pidfd >= 0:
            self.workers.loop.remove_reader(pidfd)      # its end is ours, not a death
        try:
            size = await backend.save(h, image, self.workers.run)
        except OSError as err:
            if self.watch is not None and sb.handle is h:     # not taken by a destroy meanwhile
                self.watch(sb)
            raise DsecError(f"pause sandbox {sb.id}: {err}", code="io") from err
        saved = time.monotonic()
        if not await self._end_qemu(sb, h):
            raise DsecError(f"pause sandbox {sb.id}: its state is saved in {image}, but its QEMU (pid "
                            f"{h.init_pid}) did not exit after SIGKILL: it is stuck in the kernel (hung "
                            "storage?); destroy the sandbox once the host recovers",
                            {"sandbox": sb.id, "qemu_stuck": h.init_pid}, code="io")
        stop_s = round(time.monotonic() - saved, 4)
        # Measured, not assumed: QEMU held only the guest pages ever touched
        # (less for a VM restored from a template), and what stays charged
        # (pages of shared files its reads brought in) is not given back.
        held = await self._charged(h)
        freed = 0 if before is None or held is None else max(0, before - held)
        return {"vm_image": str(image), "image_bytes": size, "save_s": round(saved - t0, 4),
                "stop_s": stop_s, "freed_bytes": freed, "held_bytes": held}

    async def _charged(self, h: VmHandle) -> int | None:
        """What the VM's memory cgroup is charged now; None if unreadable."""
        if h.group is None:
            return None
        return (await self.workers.run(mempause.charged, {"vm": h.group})).get("vm")

    async def _end_qemu(self, sb: Sandbox, h: VmHandle) -> bool:
        """End the VM's QEMU `h` (its state saved, or its restore failed) and
        unplug its tap, which went with it; its dir and cgroups stay.
        Whether it exited (if not, end_process logged it). `h` is the
        caller's: a destroy meanwhile takes sb.handle (and ends QEMU itself)."""
        exited = await self.workers.run(self.require().end_process, h)
        if networked(sb) and self.net is not None and self.net.net is not None:
            await self.workers.run(self.net.net.unplug_vm, sb.id)
        return exited

    async def _requests_settled(self, sb: Sandbox) -> None:
        """Wait for the VM's agent requests under way to be answered (the
        caller holds the sandbox's lock, so no new one starts: ensure_running
        waits for it). A QEMU ended while a request's frame was on its way
        would leave the guest agent half a frame, which it would take the
        resume's HELLO for the rest of: the VM would never answer again. And
        a process start cut there could not be sent again: it may have run."""
        deadline = time.monotonic() + REQUESTS_SETTLE_S
        try:
            # Again after each wake: one counted meanwhile (before this task
            # ran on) is waited for too.
            while self._requests.get(sb.id):
                idle = self._requests_idle.setdefault(sb.id, asyncio.Event())
                await asyncio.wait_for(idle.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise Conflict(f"sandbox {sb.id} has file or process requests under way for {REQUESTS_SETTLE_S:.0f}s; "
                           "a microVM pauses only idle (its agent's channel does not survive the stop); retry",
                           {"sandbox": sb.id}) from None

    def requests_under_way(self, sb: Sandbox) -> int:
        """How many agent requests a pause waits for are under way in the VM."""
        return self._requests.get(sb.id, 0)

    @contextlib.contextmanager
    def request_running(self, sb: Sandbox):
        """Count an agent request a pause must wait for, from the caller's
        first step (before its first await, so that a pause that takes the
        sandbox's lock after the caller's ensure_running waits for it)."""
        self._requests[sb.id] = self._requests.get(sb.id, 0) + 1
        try:
            yield
        finally:
            left = self._requests.pop(sb.id) - 1
            if left:
                self._requests[sb.id] = left
            elif (idle := self._requests_idle.pop(sb.id, None)) is not None:
                idle.set()

    async def _end_watches(self, sb: Sandbox) -> None:
        """A pause ends the VM's file watches, each with an error saying so
        (engine/watches.py): its agent's channel ends with its QEMU, and a
        watcher in the saved guest would go on after the resume for nobody
        (the new channel knows nothing of it), holding its inotify instance,
        while its watch heard nothing more. Their children are killed and
        waited for here, while the guest runs, so that none is saved."""
        runs = [r for r in self._watches.get(sb.id, ()) if not (r.done or r.ended)]
        for run in runs:
            run.stopped_by = "pause"
            with contextlib.suppress(AgentGone):
                run.kill()
        if not runs:
            return
        waits = [asyncio.ensure_future(r.over.wait()) for r in runs]
        _, pending = await asyncio.wait(waits, timeout=KILL_GRACE_S)
        for w in pending:
            w.cancel()
        if pending:
            log.warning("sandbox %s: %d file watch(es) did not end %g s after their kill; pausing all the same",
                        sb.id, len(pending), KILL_GRACE_S)

    def watching(self, sb: Sandbox) -> int:
        """How many file watches run in the VM now."""
        return len(self._watches.get(sb.id, ()))

    def watch_over(self, sb: Sandbox, run: AgentExec) -> None:
        """A watch's request is over (engine/watches.py): its child is no longer the pause's to end."""
        runs = self._watches.get(sb.id)
        if runs is not None:
            runs.discard(run)
            if not runs:
                del self._watches[sb.id]

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
            self._relinked(sb)
            return {"restore_s": round(time.monotonic() - t0, 4)}
        image = Path(rec.get("vm_image") or h.vm_dir / SAVED_STATE)
        t0 = time.monotonic()
        layers = self._layer_files(distinct_layers(sb.layers))
        tap_fd = (await self._plug(sb))[0] if h.machine.net else -1
        try:
            await self.workers.run(backend.respawn, h, layers, sb.limits["cpu"], sb.limits["disk"], self._uid(sb),
                                   tap_fd)
        finally:
            fds.close_quietly(tap_fd)
        try:
            await backend.restore(h, image, f"microVM {sb.id}", sb.hostname, sandbox_id=sb.id)
        except OSError as err:
            # Its new QEMU goes, as a pause ends one: it would hold the dir's
            # sockets under the QEMU of the next resume, which then never
            # reaches its agent, and its memory for as long as the VM is paused.
            await self._end_qemu(sb, h)     # one that does not exit is logged: the restore's error is the news
            raise DsecError(f"resume sandbox {sb.id}: {err}; its saved state stays in {image}", code="io") from err
        # Loaded, and the VM runs: the state file is set aside (".loaded") and
        # goes once the record says running (saved_state_done). A daemon that
        # dies in between leaves a record saying paused, no paused.ram, and
        # this QEMU, which the next one adopts as running (found_qemu).
        await self.workers.run(os.rename, image, image.with_name(image.name + ".loaded"))
        sb.vm = {**(sb.vm or {}), "machine": h.machine.to_record()}
        if self.watch is not None:
            self.watch(sb)
        self._relinked(sb)
        if self.balloon is not None:
            await self.balloon.resumed(sb)
        return {"restore_s": round(time.monotonic() - t0, 4)}

    async def saved_state_done(self, sb: Sandbox) -> None:
        """`sb`'s resume is journaled: the state file it loaded goes, before
        the sandbox's lock is let go (a pause right after writes a new one)."""
        if self.backend is not None:
            await self.workers.run(self.backend.drop_saved_state, sb.id)

    def _relinked(self, sb: Sandbox) -> None:
        if self.relinked is not None:
            self.relinked(sb)

    async def check_cwd(self, sb: Sandbox, cwd: str, make: bool = False) -> None:
        """As CreateService.check_cwd, in the guest: one stat, and the
        directory made (with its parents, 0755) where `make` says so and the
        image lacks it."""
        if cwd == "/":
            return
        try:
            st = await self.stat_path(sb, cwd)
        except NotFound:
            if make:
                await self.file_op(sb, FileMkdir(sandbox=sb.id, path=cwd, parents=True, mode=0o755))
                return
            st = None
        except DsecError:
            st = None
        if st is None or st["type"] != "dir":
            raise BadRequest(f"cwd {cwd!r} is not a directory in image {sb.image!r}: give one that "
                             "exists, or create without --cwd and make it with an exec", {"cwd": cwd})

    # ------------------------------------------------------------ exec

    def agent(self, sb: Sandbox):
        """The agent's channel, for an op: every op (here and the background
        processes' in vmprocs.py) goes through here, so here the VM's balloon
        learns it is in use (it deflates in the background)."""
        h = sb.handle
        if h is None or h.agent is None or h.agent.closed:
            raise Conflict(f"sandbox {sb.id} is exiting (its VM's agent channel is closed)", {"sandbox": sb.id})
        if self.balloon is not None:
            self.balloon.wake(sb)
        return h.agent

    async def exec(self, sb: Sandbox, req, env: list[str], cwd: str, ids: users.ProcessIds,
                   timeout: float | None, ctx) -> dict:
        link = self.agent(sb)
        check_groups_sent(sb, link, ids)
        recorder = None
        if req.trace:
            # The command runs in the guest's kernel: the guest agent traces
            # it, this turns its records into a container's trace format.
            from ..backends.microvm.vmtrace import GuestTrace
            from ..trace import Limits

            recorder = GuestTrace(Limits(max_bytes=self.max_trace))
        argv = list(req.argv)
        # A terminal (pty) session streams with no output cap, as a
        # container's (execio.PtyIO): a cap would hang up a long session.
        window = None
        if req.pty:
            window = DEFAULT_WINDOW if req.rows is None else (req.rows, req.cols)
        cap = sys.maxsize if req.pty else self.max_output
        io = VmExec(req.stdin or req.pty, has_tty=req.pty)
        out: dict[int, list[bytes]] = {1: [], 2: []}
        delivered, truncated, timed_out = 0, False, False
        started = time.monotonic()
        sb.execs += 1
        ctx.register_exec(io)
        run = None
        try:
            try:
                run = io.run = await link.start_exec(
                    argv, env, cwd, ids.uid, req.stdin or req.pty, window=window,
                    trace=None if recorder is None else (recorder.limits.max_string, recorder.limits.max_argv),
                    gid=ids.gid, groups=ids.groups)
            finally:
                io.sent.set()
            loop = asyncio.get_running_loop()
            # The timeout counts the VM's run time: a job pause stops its
            # vCPUs and keeps QEMU, and the exec goes on after the resume.
            timer = None if timeout is None else RunTimer(timeout, sb.paused_for)
            kill_deadline = None
            status = None
            while status is None:
                if kill_deadline is not None:
                    wait = max(0.0, kill_deadline - loop.time())
                else:
                    wait = None if timer is None else timer.until_next_look()
                try:
                    ev = await asyncio.wait_for(run.next_event(), wait)
                except TimeoutError:
                    if timed_out:      # killed, and no end reported within the grace
                        raise DsecError(f"exec {argv[0]!r} in sandbox {sb.id}: did not end "
                                        f"{KILL_GRACE_S:.0f}s after a kill", code="io") from None
                    if not timer.expired():
                        continue
                    timed_out = True
                    run.kill()
                    kill_deadline = loop.time() + KILL_GRACE_S
                    continue
                kind = ev[0]
                if kind == "out" and ev[1] == wire.TRACE_FD:
                    if recorder is not None:
                        recorder.feed(ev[2])
                elif kind == "out":
                    data = ev[2]
                    room = cap - delivered
                    if len(data) > room:
                        # The cap. A container's process then writes to a
                        # closed pipe and dies of SIGPIPE (signal 13): so
                        # here, and SIGKILL if output still comes (it
                        # ignores or handles SIGPIPE).
                        run.kill(signal.SIGKILL if truncated else signal.SIGPIPE)
                        data, truncated = data[:room], True
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
                    if sb.state != "stopping":
                        raise Conflict(f"sandbox {sb.id} is exiting; exec {argv[0]!r} ended with its VM",
                                       {"sandbox": sb.id})
                    # A destroy ended the VM, and the process with it: the
                    # result a container's exec gets then, SIGKILL, which
                    # _why_killed (engine/execs.py) says was the destroy's.
                    status = signal.SIGKILL
        except BaseException:
            if run is not None and not run.done:
                run.kill()
            raise
        finally:
            _run_over(sb, link, run)
            ctx.unregister_exec()
        code, sig, timed_out = ended(status, timed_out)
        result = {"exit_code": code, "signal": sig, "timed_out": timed_out, "truncated": truncated,
                  "cancelled": io.cancelled, "duration_ms": round((time.monotonic() - started) * 1000, 3)}
        if not req.stream:
            result["stdout"] = b"".join(out[1])
            result["stderr"] = b"".join(out[2])
        if recorder is not None:
            result["trace"] = recorder.finish(timed_out)
        return result

    # ------------------------------------------------------------ the writable layer

    @contextlib.asynccontextmanager
    async def upper_tree(self, sb: Sandbox, scratch: Path, max_bytes: int, exclude: list[str] = ()):
        """The VM's writable layer (the overlay's upper dir in the guest) as
        a host directory, for snapshot: the agent streams it as a tar (every
        guest process frozen meanwhile), unpacked under `scratch`
        (dsecd/fs/uppertar.py); removed on exit. No pause or resume runs
        meanwhile (the sandbox's lock). The `exclude`d paths are left out
        by the agent, so they count neither in the tar nor against
        `max_bytes` (the container's bound leaves them out too): past
        that, `limit`."""
        self.agent(sb)
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
                    if sb.state == "paused":        # by a pause this waited for: its channel went
                        raise Conflict(f"sandbox {sb.id} is a paused microVM; resume it first (dsec resume "
                                       f"{sb.id})", {"sandbox": sb.id, "state": sb.state})
                    skip = sorted({rel for rel in map(erofs.exclude_rel, exclude) if rel})
                    link = self.agent(sb)
                    # The agent freezes the guest's processes while it
                    # streams: their execs' run-time timeouts
                    # (Sandbox.paused_for) must not count it, as a
                    # container's do not count its snapshot's freeze.
                    clock = sb.paused_at is None
                    if clock:
                        sb.paused_at = time.monotonic()
                    try:
                        r = await link.stream(wire.TAR, on_data, wire.u64(max_bytes), wire.u64(len(skip)),
                                              *map(wire.bstr, skip))
                    finally:
                        if clock:
                            sb.end_paused_time()
            except AgentError as err:
                if err.errno == errno.EFBIG:
                    raise LimitExceeded(f"snapshot: the sandbox's changed files add up to more than "
                                        f"images.max_snapshot_bytes ({max_bytes} bytes; {err.step}); remove large "
                                        "or sparse files, or exclude them", {"sandbox": sb.id}) from err
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

    # ------------------------------------------------------------ directory copies

    async def tar_get(self, sb: Sandbox, path: str, max_entries: int, max_bytes: int, ctx) -> dict:
        """file_tar_get: a child of the guest agent walks the directory and
        writes the tar to its stdout (csrc/guest/agent.c, tar_get_main), by
        the container backend's rules; its chunks go to the client as they
        come."""
        path = _check(path, f"copy out of {sb.id}:{path}")
        where = f"{sb.id}:{path}"

        async def emit(data: bytes) -> None:
            await ctx.emit({"data": data})

        code, reports = await self._copy(sb, "copy out of", where, [path, str(max_entries), str(max_bytes)],
                                         wire.EXEC_TAR_GET, emit)
        if code == 0 and "done" in reports:
            count, size = reports["done"]
            return {"path": path, "count": int(count), "bytes": int(size), "skipped": reports["skip"]}
        raise self._copy_failed("copy out of", where, code, reports, max_entries, max_bytes)

    async def tar_put(self, sb: Sandbox, path: str, pipe, max_entries: int, max_bytes: int,
                      owner: tuple[int, int] | None = None, dirs: int = 0) -> dict:
        """file_tar_put: the client's tar (`pipe`, a dircopies.ChunkPipe) is
        read and checked here (dsecd/tarsafe.py, in a worker) and its entries
        sent as records to a child of the guest agent that makes them under a
        new directory and renames it into place (agent.c, tar_put_main).
        `dirs`: the budget of tarcopy.dir_entries (0: not listed). A
        refused or broken copy leaves nothing: the child removes what it made
        when its input ends before the end record."""
        path = _check(path, f"copy into {sb.id}:{path}")
        where = f"{sb.id}:{path}"
        if path == "/":
            raise BadRequest(f"copy into {where}: cannot copy a directory onto /; name a new directory below it",
                             {"path": path})
        # The put child's argv: the directory, then its owner's ids (agent.c),
        # then how its records give their mtimes to an agent that takes them
        # finer than in seconds (_put_records).
        ids = owner if self._owner_fields(sb, owner, f"copy into {where}") else None
        version = self.agent(sb).agent_version
        if version >= wire.TIMES_AGENT_VERSION:
            argv = [path, *(str(i) for i in ids or (0, 0)), "ts" if version >= wire.WIDE_TIMES_AGENT_VERSION else "ns"]
        else:
            argv = [path, *(str(i) for i in ids)] if ids else [path]
        loop = asyncio.get_running_loop()
        started: asyncio.Future = loop.create_future()

        def send(data: bytes, eof: bool) -> None:          # from the worker
            run = started.result()
            asyncio.run_coroutine_threadsafe(run.send_stdin(data, eof), loop).result()
            if not eof and (run.ended or run.done):
                raise _CopyEnded()

        def room(size: int) -> None:                     # from the worker, before a big file's record
            asyncio.run_coroutine_threadsafe(self.check_room(sb, size, where), loop).result()

        async def records() -> tarsafe.Seen:
            run = await started
            try:
                return await self.workers.run(_put_records, pipe, send, max_entries, max_bytes, room,
                                              self.agent(sb).agent_version)
            except BaseException:
                # Refused, broken or abandoned: the child's input ends before
                # the end record, so it removes what it made and exits.
                with contextlib.suppress(AgentGone):
                    run.close_stdin_nowait()
                raise

        feeding = loop.create_task(records())
        try:
            code, reports = await self._copy(sb, "copy into", where, argv, wire.EXEC_TAR_PUT, None, started)
        except BaseException:
            feeding.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        finally:
            if not started.done():
                started.cancel()
            pipe.end("the copy request ended")        # the worker, if still reading, stops
        seen, failed = None, None
        try:
            seen = await feeding
        except Exception as err:
            failed = err
        if code == 0 and "done" in reports and seen is not None:
            out = {"path": path, "count": seen.entries, "bytes": seen.bytes}
            if dirs:
                out["dirs"] = tarcopy.dir_entries(seen, dirs)
            return out
        if isinstance(failed, tarsafe.Refused):
            raise BadRequest(f"copy into {where}: {failed}", {"path": where}) from failed
        if isinstance(failed, tarsafe.TooLarge):
            raise LimitExceeded(f"copy into {where}: {failed} (limits.max_tar_entries, limits.max_tar_bytes)",
                                {"max_entries": max_entries, "max_bytes": max_bytes}) from failed
        if isinstance(failed, (tarfile.TarError, EOFError)):
            raise BadRequest(f"copy into {where}: the tar stream is not a valid archive: {failed}",
                             {"path": where}) from failed
        if type(failed).__name__ == "Aborted" and reports.get("err", (str(errno.ECONNABORTED),))[0] == str(
                errno.ECONNABORTED):
            # (dircopies.Aborted: the request was cancelled or its client sent nothing in time)
            raise Conflict(f"copy into {where}: {failed}; nothing was left behind") from failed
        if failed is not None and not isinstance(failed, (_CopyEnded, OSError)) and type(failed).__name__ != "Aborted":
            raise failed
        raise self._copy_failed("copy into", where, code, reports, max_entries, max_bytes, sb)

    async def _copy(self, sb: Sandbox, verb: str, where: str, argv: list[str], flags: int, on_out,
                    started: asyncio.Future | None = None) -> tuple[int | None, dict]:
        """Run one copy child to its end: its stdout to on_out, its reports
        (NUL-separated fields on stderr) parsed; (exit code, reports). It
        counts as a running exec (no pause, no idle expiry meanwhile); a
        cancel ends its input (a put's child then removes what it made) and
        kills it."""
        link = self.agent(sb)
        put = bool(flags & wire.EXEC_TAR_PUT)
        sb.execs += 1
        run = None
        err_out = bytearray()
        try:
            run = await link.start_exec(argv, [], "/", 0, put, flags)
            if started is not None:
                started.set_result(run)
            status = None
            while status is None:
                ev = await run.next_event()
                if ev[0] == "out":
                    if ev[1] == 1 and on_out is not None:
                        await on_out(ev[2])
                    elif ev[1] == 2 and len(err_out) < self.max_output:
                        err_out += ev[2]
                elif ev[0] == "exited":
                    status = ev[1]
                elif ev[0] == "error":
                    raise io_error(verb, where, ev[1])
                elif ev[0] == "gone":
                    raise Conflict(f"sandbox {sb.id} is exiting; the directory copy ended with its VM",
                                   {"sandbox": sb.id})
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err
        except BaseException:
            if run is not None and not run.done:
                with contextlib.suppress(AgentGone):
                    run.close_stdin_nowait()
                    if not put:
                        run.kill()
                if put:
                    # Its child, its input ended, either renames the whole
                    # copy into place (all of it came) or removes it: the
                    # request ends after that, so that what its end triggers
                    # (a temporary's removal when its client is gone) finds
                    # the copy where it will stay.
                    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                        await asyncio.wait_for(run.over.wait(), PUT_END_S)
            raise
        finally:
            _run_over(sb, link, run)
        code, _sig = _decode_status(status)
        return code, _reports(bytes(err_out), put)

    @staticmethod
    def _copy_failed(verb: str, where: str, code: int | None, reports: dict, max_entries: int,
                     max_bytes: int, sb: Sandbox | None = None) -> DsecError:
        if "err" in reports:
            num, what = reports["err"]
            num = int(num) or errno.EIO
            if code == 3:
                return LimitExceeded(f"{verb} {where}: {what} (limits.max_tar_entries, limits.max_tar_bytes)",
                                     {"max_entries": max_entries, "max_bytes": max_bytes})
            if num == errno.ENOSPC and sb is not None:
                return MicroVMService._full(verb, where, sb, "nothing of the copy is left")
            if num == errno.EEXIST and what.startswith("exists"):
                return io_error(verb, where, OSError(num, f"{where.partition(':')[2]} {what}"))
            return io_error(verb, where, OSError(num, f"{os.strerror(num)} (at {what or '.'})"))
        return DsecError(f"{verb} {where}: the guest's copy ended with status {code} and no report",
                         code="io")

    # ------------------------------------------------------------ file watches

    async def start_watch(self, sb: Sandbox, path: str, recursive: bool, max_dirs: int):
        """Start file_watch's child in the guest (csrc/guest/agent.c,
        watch_main); (link, AgentExec): its records come on the exec's
        stdout (dsecd/engine/watches.py reads them)."""
        link = self.agent(sb)
        start = asyncio.ensure_future(link.start_exec([path, "1" if recursive else "0", str(max_dirs)], [], "/",
                                                      0, False, wire.EXEC_WATCH))

        def kill_orphan(fut: asyncio.Future) -> None:
            # A request cancelled while its start was being sent: the child
            # would watch on with nobody reading it. The agent takes frames
            # in order, so the kill finds it started.
            if not fut.cancelled() and fut.exception() is None:
                run = fut.result()
                with contextlib.suppress(AgentGone):
                    run.kill()
                link.forget(run)

        try:
            run = await asyncio.shield(start)
        except asyncio.CancelledError:
            start.add_done_callback(kill_orphan)
            raise
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err
        self._watches.setdefault(sb.id, set()).add(run)        # the caller ends with watch_over
        return link, run

    # ------------------------------------------------------------ files

    async def _file(self, sb: Sandbox, verb: str, where: str, kind: int, *fields: bytes) -> wire.Reader:
        # Counted, as file_op is: not every file request comes through it
        # (the stat that records a temporary by its guest's inode, a
        # create's cwd check), and a pause must not cut one on its way.
        link = self.agent(sb)
        try:
            with self.request_running(sb):
                return await link.request(kind, *fields)
        except AgentError as err:
            if err.errno == errno.EINVAL and err.step == "open" and kind in (wire.READ, wire.WRITE):
                await self._refuse_irregular(sb, verb, where)     # the agent's require_regular
            failed = io_error(verb, f"{sb.id}:{where}", _as_a_containers(err, where))
            failed.detail["guest_step"] = err.step
            raise failed from err
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err

    async def _refuse_irregular(self, sb: Sandbox, verb: str, path: str) -> None:
        """BadRequest, in a container's words (fs/files.py _require_regular),
        if `path` is a FIFO, socket or device: the guest agent reads and
        writes regular files only and says EINVAL of the others."""
        try:
            kind = (await self.stat_path(sb, path))["type"]
        except DsecError:
            return
        if kind not in ("file", "dir"):
            raise BadRequest(f"{verb} {sb.id}:{path}: {path} is a {kind}, not a regular file", {"path": path})

    async def check_room(self, sb: Sandbox, size: int, where: str) -> None:
        """Refuse (`limit`) writing `size` bytes of files into the VM when
        they would not fit in its guest's available memory (less a reserve):
        a VM's files are tmpfs pages of its RAM, which nothing reclaims, as a
        container's are charged to its --memory (copier.check_room). The
        layer's cap (upper_cap) is what keeps the guest alive whatever this
        says (its processes allocate meanwhile; a guest may fake its
        /proc/meminfo and fool only itself); this makes the common case a
        clear refusal before anything is written."""
        if size <= 0:
            return
        available = await self._guest_available(sb)
        if available is None:
            return
        memory = sb.limits["memory"]
        reserve = min(max(GUEST_RESERVE_MIN, memory // 16), GUEST_RESERVE_MAX)
        if size > available - reserve:
            raise LimitExceeded(
                f"write {where}: {size_text(size)} would take the sandbox past its memory limit "
                f"({size_text(memory)} of guest RAM; {size_text(max(0, available))} available, less "
                f"{size_text(reserve)} kept for its kernel and processes). "
                "A microVM's files are kept in its RAM: write less, free memory or remove files in the sandbox, "
                "or create it with more --memory",
                {"path": where, "size": size, "left": max(0, available), "reserve": reserve})

    async def _guest_available(self, sb: Sandbox) -> int | None:
        """The guest's MemAvailable (its /proc/meminfo, read by the agent)
        plus what its balloon holds (given back on use); None if unknown."""
        link = self.agent(sb)
        try:
            r = await link.request(wire.READ, wire.bstr("/proc/meminfo"), wire.u64(0), wire.u64(16 << 10))
        except AgentError as err:
            log.debug("sandbox %s: its /proc/meminfo is unreadable (%s); a write is not checked against its "
                      "memory", sb.id, err)
            return None
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err
        r.u64()
        available = _mem_available(r.bytes())
        if available is None:
            return None
        return available + (0 if self.balloon is None else self.balloon.held(sb.id))

    @staticmethod
    def _full(verb: str, where: str, sb: Sandbox, left: str = "the file is partly written") -> LimitExceeded:
        """ENOSPC from the guest: its writable layer or /tmp is full. `left`:
        what the failed request left behind. The advice names the cap that
        was met: the layer's is --disk where that is below upper_cap."""
        memory, disk = sb.limits["memory"], sb.limits.get("disk")
        most = upper_cap(memory)
        bigger = (f"a larger --disk (up to {most} bytes) or, for /tmp, more --memory"
                  if disk is not None and disk < most else "more --memory")
        inodes = sb.limits.get("disk_inodes")
        files = f" and {inodes} files and directories (sandbox.disk_inodes)" if inodes else ""
        return LimitExceeded(
            f"{verb} {where}: no space left in the sandbox. A microVM's files are kept in its RAM: its "
            f"writable layer is capped at {disk} bytes (--disk, and at most half of its --memory of "
            f"{memory} less {GUEST_FIXED >> 20}M for the guest's kernel){files}, /tmp at {tmp_cap(memory)} bytes "
            f"(an eighth of the same); {left}. Remove files in the sandbox, or create it with {bigger}",
            {"path": where, "errno": "ENOSPC"})

    async def _require_replaceable(self, sb: Sandbox, dst: str) -> None:
        try:
            kind = (await self.stat_path(sb, dst))["type"]
        except DsecError as err:
            if err.code == "not_found":
                return
            raise
        why = sbfiles.unreplaceable(dst, kind)
        if why:
            raise BadRequest(why, {"sandbox": sb.id, "path": dst})

    async def stat_path(self, sb: Sandbox, path: str, follow: bool = False) -> dict:
        """As the container's sbfiles.stat_path: lstat, a symlink with its
        `target` (from an agent of STAT_AGENT_VERSION on); with `follow`
        what it leads to, inside the guest's root. Its mtime is any time a
        time_t holds from an agent of WIDE_STAT_AGENT_VERSION on (an older
        one's wraps past 2262 and before 1677)."""
        path = _check(path, f"stat {sb.id}:{path}")
        version = self.agent(sb).agent_version
        if follow and version < wire.STAT_AGENT_VERSION:
            # bad_request, as it was before any agent could (dsec cp falls back on it)
            raise BadRequest(f"stat {sb.id}:{path}: this microVM's guest agent (version {version}) cannot follow "
                             f"a symlink (version {wire.STAT_AGENT_VERSION} can): stat the target's own path, "
                             "or recreate the sandbox on this daemon's guest image",
                             {"sandbox": sb.id, "agent_version": version})
        ts = version >= wire.WIDE_STAT_AGENT_VERSION
        flags = (wire.STAT_FOLLOW if follow else 0) | (wire.STAT_TS if ts else 0)
        fields = (wire.u64(flags),) if version >= wire.STAT_AGENT_VERSION else ()
        r = await self._file(sb, "stat", path, wire.STAT, wire.bstr(path), *fields)
        out = {**r.stat(ts), "path": path}
        if r.more():
            r.u64(), r.u64()                    # its device and inode numbers (identity)
        if out["type"] == "symlink" and r.more():
            out["target"] = sbfiles.name_text(r.bytes())
        return out

    async def identity(self, sb: Sandbox, path: str) -> tuple[int, int] | None:
        """The guest's (device, inode) numbers of `path` (not followed): what
        a temporary a copy made is recorded by, so that a restarted daemon
        removes that path only while it is still the same file. None when
        the guest's agent predates reporting them. Raises as stat does."""
        path = _check(path, f"stat {sb.id}:{path}")
        r = await self._file(sb, "stat", path, wire.STAT, wire.bstr(path))
        r.stat()
        if not r.more():
            return None
        return r.u64(), r.u64()

    async def file_op(self, sb: Sandbox, req, owner: tuple[int, int] | None = None) -> dict:
        """file_read, file_write, file_list, file_stat, file_mkdir,
        file_remove, file_rename (their checks done by FileService);
        `owner`: the (uid, gid) what a write or mkdir makes belongs to
        (None: root). Counted before its first await, so that a pause that
        takes the sandbox's lock after the caller's ensure_running waits for it."""
        with self.request_running(sb):
            return await self._file_op(sb, req, self._owner_fields(sb, owner, f"{req.OP} {sb.id}"))

    def _owner_fields(self, sb: Sandbox, owner: tuple[int, int] | None, what: str) -> tuple[bytes, ...]:
        """A write's, mkdir's or put's owner as the agent's trailing fields
        (none for root, which every agent gives files); `unsupported` from
        an agent older than OWNER_AGENT_VERSION, which would ignore them."""
        if owner is None or owner == (0, 0):
            return ()
        version = self.agent(sb).agent_version
        if version < wire.OWNER_AGENT_VERSION:
            raise Unsupported(f"{what}: this microVM's guest agent (version {version}) cannot give files an "
                              f"owner (version {wire.OWNER_AGENT_VERSION} can): leave owner out and chown "
                              "them with an exec, or recreate the sandbox on this daemon's guest image",
                              {"sandbox": sb.id, "agent_version": version})
        return wire.u64(owner[0]), wire.u64(owner[1])

    async def _file_op(self, sb: Sandbox, req, owner_fields: tuple[bytes, ...] = ()) -> dict:
        op = req.OP
        if op == "file_stat":
            return await self.stat_path(sb, req.path, req.follow)
        if op == "file_rename":
            src = _check(req.src, f"rename {sb.id}:{req.src} -> {req.dst}")
            dst = _check(req.dst, f"rename {sb.id}:{req.src} -> {req.dst}")
            _refuse_root("rename", f"{sb.id}:{src} -> {dst}", src, dst)
            flags = ((wire.RENAME_OVERWRITE if req.overwrite else 0)
                     | (wire.RENAME_KEEP_ATTRS if req.keep_attrs else 0))
            if req.keep_attrs:             # an atomic write's: as a container's (sbfiles.rename)
                await self._require_replaceable(sb, dst)
            await self._file(sb, "rename", f"{src} -> {dst}", wire.RENAME, wire.bstr(src), wire.bstr(dst),
                             wire.u64(flags))
            return {"src": src, "dst": dst}
        path = _check(req.path, f"{FILE_VERBS.get(op, op)} {sb.id}:{req.path}")
        if op == "file_read":
            r = await self._file(sb, "read", path, wire.READ, wire.bstr(path), wire.u64(req.offset),
                                 wire.u64(req.length))
            size, data = r.u64(), r.bytes()
            return {"data": data, "size": size, "eof": req.offset + len(data) >= size}
        if op == "file_write":
            _refuse_root("write", f"{sb.id}:{path}", path)
            if req.same_as is not None:         # its writes give no `file` to name
                raise BadRequest(f"write {sb.id}:{path}: same_as is not available for a microVM sandbox's files")
            flags = ((wire.WRITE_APPEND if req.append else 0) | (wire.WRITE_PARENTS if req.parents else 0)
                     | (wire.WRITE_KEEP if req.offset is not None else 0))
            where = f"{sb.id}:{path}"
            if len(req.data) >= PUT_CHECK_BYTES:      # a smaller one meets the layer's cap (upper_cap)
                await self.check_room(sb, len(req.data), where)
            try:
                r = await self._file(sb, "write", path, wire.WRITE, wire.bstr(path), wire.u64(flags),
                                     wire.u64(req.mode),
                                     wire.u64(wire.NO_OFFSET if req.offset is None else req.offset),
                                     wire.bstr(bytes(req.data)), *owner_fields)
            except DsecError as err:
                if err.detail.get("errno") == "ENOSPC":
                    raise self._full("write", where, sb) from err
                raise
            return {"size": r.u64()}
        if op == "file_list":
            # Each mtime as seconds and nanoseconds where the agent can (as stat_path).
            ts = self.agent(sb).agent_version >= wire.WIDE_STAT_AGENT_VERSION
            flags = (wire.u64(wire.LIST_TS),) if ts else ()
            r = await self._file(sb, "list", path, wire.LIST, wire.bstr(path), wire.u64(req.depth), *flags)
            entries = []
            body_end = len(r.body) - 16           # the count and the truncated flag close the body
            while r.at < body_end:
                name = r.str()
                entries.append({"name": name, **r.stat(ts)})
            r.u64()
            truncated = bool(r.u64())
            entries.sort(key=lambda e: e["name"])
            return {"path": path, "entries": entries, "truncated": truncated}
        if op == "file_mkdir":
            r = await self._file(sb, "mkdir", path, wire.MKDIR, wire.bstr(path), wire.u64(1 if req.parents else 0),
                                 wire.u64(req.mode), *owner_fields)
            return {"path": path, "created": bool(r.u64())}
        if op == "file_set_attrs":
            version = self.agent(sb).agent_version
            if version < wire.ATTRS_AGENT_VERSION:
                raise Unsupported(f"set attributes of {sb.id}:{path}: this microVM's guest agent (version "
                                  f"{version}) cannot set a file's mode or mtime (version "
                                  f"{wire.ATTRS_AGENT_VERSION} can)", {"sandbox": sb.id, "agent_version": version})
            mtime_flags, mtime_fields = _setattr_mtime(sb.id, path, req.mtime, version)
            flags = ((wire.SETATTR_MODE if req.mode is not None else 0) | mtime_flags
                     | (wire.SETATTR_FOLLOW if req.follow else 0))
            try:
                await self._file(sb, "set attributes of", path, wire.SETATTR, wire.bstr(path), wire.u64(flags),
                                 wire.u64(req.mode or 0), *mtime_fields)
            except DsecError as err:
                if err.detail.get("guest_step") != "not a file or directory":
                    raise
                kind = (await self.stat_path(sb, path))["type"]
                raise BadRequest(f"set attributes of {sb.id}:{path}: {path} is a {kind}, not a file or "
                                 "directory", {"path": path}) from err
            return {"path": path}
        if op == "file_remove":
            _refuse_root("remove", f"{sb.id}:{path}", path)
            r = await self._file(sb, "remove", path, wire.REMOVE, wire.bstr(path),
                                 wire.u64(1 if req.recursive else 0))
            return {"path": path, "removed": r.u64()}
        raise Unsupported(f"{op} is not available for backend microvm yet")


class _CopyEnded(Exception):
    """A put's child ended before its input did (it reported why)."""


PUT_CHUNK = 256 << 10       # records go to the guest in stdin chunks of about this size


def _put_records(pipe, send, max_entries: int, max_bytes: int, room=None,
                 agent_version: int = wire.REPLACE_AGENT_VERSION) -> tarsafe.Seen:
    """Read the tar from `pipe` (in a worker), check each entry as the
    container backend does (tarsafe.check) and send(data, eof) its records
    (csrc/guest/agent.c, put_record): missing parent directories first,
    the removal of what an earlier entry of a name made before a later
    one replaces it, directories' modes last, deepest first, then the end.
    room(size), if given, raises when a file of PUT_CHECK_BYTES or more
    would not fit in the guest (MicroVMService.check_room); the records
    before it are sent first. An agent older than REPLACE_AGENT_VERSION
    has no removal: such an archive is refused. mtimes go to the agent as
    _mtime_field says: from WIDE_TIMES_AGENT_VERSION on (its argv says
    "ts") exactly, whatever the time; from TIMES_AGENT_VERSION (its argv
    says "ns") as 64-bit nanoseconds, a time outside them refused; to an
    older agent as whole seconds, one before 1970 as 0."""
    seen = tarsafe.Seen(max_entries, max_bytes)
    out = bytearray()
    made = {""}
    dir_modes: dict[str, tuple[int, int | None]] = {"": (0o755, None)}     # mtimes in ns

    def record(kind: bytes, rel: str, mode: int = 0, mtime_ns: int | None = None, data: bytes = b"",
               size: int | None = None) -> None:
        name = rel.encode(errors="surrogateescape")
        out.extend(kind + struct.pack(">I", len(name)) + name + struct.pack(">I", mode)
                   + _mtime_field(rel, mtime_ns, agent_version)
                   + struct.pack(">Q", len(data) if size is None else size) + data)
        if len(out) >= PUT_CHUNK:
            flush()

    def flush(eof: bool = False) -> None:
        if out or eof:
            send(bytes(out), eof)
            out.clear()

    def make_dirs(rel: str) -> None:
        path = ""
        for part in rel.split("/") if rel else ():
            path = f"{path}/{part}" if path else part
            if path not in made:
                record(b"d", path)
                made.add(path)

    with tarfile.open(fileobj=pipe, mode="r|", errorlevel=2, tarinfo=tarsafe.Member) as tf:
        for m in tf:
            rel = tarsafe.check(m, seen)
            if seen.replaces == "itself":
                continue
            if seen.replaces in ("file", "other") or (seen.replaces == "dir" and not m.isdir()):
                if agent_version < wire.REPLACE_AGENT_VERSION:
                    raise tarsafe.Refused(f"entry {m.name!r} comes again in the archive, and this microVM's guest "
                                          f"agent (version {agent_version}) cannot replace what the earlier one "
                                          f"made (version {wire.REPLACE_AGENT_VERSION} can): leave out the "
                                          "earlier one")
                record(b"r", rel, 1 if seen.replaces == "dir" else 0)
                made.discard(rel)
                dir_modes.pop(rel, None)
            if m.isdir():
                dir_modes[rel] = (m.mode & tarsafe.KEPT_MODE, tarsafe.mtime_ns(m))
                _mtime_field(rel, dir_modes[rel][1], agent_version)     # refused now, not after the tree
                make_dirs(rel)
                continue
            make_dirs(rel.rpartition("/")[0])
            if m.isreg():
                if room is not None and m.size >= PUT_CHECK_BYTES:
                    flush()
                    room(m.size)
                record(b"f", rel, m.mode & tarsafe.KEPT_MODE, tarsafe.mtime_ns(m), size=m.size)
                src = tf.extractfile(m)
                left = m.size
                while left:
                    piece = src.read(min(PUT_CHUNK, left))
                    if not piece:
                        raise EOFError(f"the archive ends inside {m.name!r}")
                    out.extend(piece)
                    left -= len(piece)
                    if len(out) >= PUT_CHUNK:
                        flush()
            elif m.issym():
                record(b"s", rel, 0, tarsafe.mtime_ns(m), m.linkname.encode(errors="surrogateescape"))
            else:
                record(b"h", rel, data=tarsafe.entry_name(m.linkname).encode(errors="surrogateescape"))
        tarsafe.check_end(tf)
    while pipe.read(1 << 20):               # the zero padding after the archive, up to the input's end
        pass
    # One the archive has no entry for gets 0755, as tar(1) and docker cp make it.
    for rel in sorted(made, key=lambda rel: -rel.count("/") - bool(rel)):
        record(b"D", rel, *dir_modes.get(rel, (0o755, None)))
    record(b"E", "")
    flush(eof=True)
    return seen


def _setattr_mtime(sb_id: str, path: str, mtime: float | None, agent_version: int) -> tuple[int, tuple[bytes, ...]]:
    """A SETATTR's mtime (None: none) as an agent of `agent_version` takes
    it (csrc/guest/agent.c, do_setattr): its flags, and its fields from the
    mtime's on. The time is the container backend's, int(mtime * 1e9) ns
    (wire.mtime_ns). From WIDE_SETATTR_AGENT_VERSION on it goes as signed
    seconds with the nanoseconds last (SETATTR_TS): any time a time_t holds.
    An older agent takes signed nanoseconds in 64 bits, which would wrap a
    time before 1677-09-21 or past 2262-04-11 (2300 became 1715): refused
    as bad_request, as a copy in refuses it (_mtime_field); one older than
    TIMES_AGENT_VERSION takes no time before 1970 either."""
    if mtime is None:
        return 0, (wire.u64(0),)
    ns = wire.mtime_ns(mtime)
    if agent_version >= wire.WIDE_SETATTR_AGENT_VERSION:
        sec, nsec = divmod(ns, tarsafe.NS)                  # floor: before 1970 too, as os.utime splits it
        return wire.SETATTR_MTIME | wire.SETATTR_TS, (wire.s64(sec), wire.u64(nsec))
    where = f"set attributes of {sb_id}:{path}"
    if ns < 0 and agent_version < wire.TIMES_AGENT_VERSION:
        raise Unsupported(f"{where}: this microVM's guest agent (version {agent_version}) cannot set an mtime "
                          f"before 1970 (version {wire.TIMES_AGENT_VERSION} can): recreate the sandbox on this "
                          "daemon's guest image", {"sandbox": sb_id, "agent_version": agent_version})
    if not -(2**63) <= ns < 2**63:
        raise BadRequest(f"{where}: mtime {mtime!r} s since 1970 is outside 1677-09-21 to 2262-04-11, the times "
                         f"this microVM's guest agent (version {agent_version}) can set (version "
                         f"{wire.WIDE_SETATTR_AGENT_VERSION} sets any): recreate the sandbox on this daemon's guest "
                         "image, or give a time in that range",
                         {"path": path, "mtime": mtime, "agent_version": agent_version})
    return wire.SETATTR_MTIME, (wire.s64(ns),)


def _mtime_field(rel: str, mtime_ns: int | None, agent_version: int) -> bytes:
    """A put record's mtime (None: none) as an agent of `agent_version`
    takes it (csrc/guest/agent.c, put_record): signed seconds and
    nanoseconds ("ts"), signed nanoseconds in 64 bits ("ns"), or seconds.
    A time 64-bit nanoseconds do not hold (before 1677-09-21, past
    2262-04-11), which a container's copy sets, is refused to an agent
    that takes no other: it would wrap to another time."""
    if agent_version >= wire.WIDE_TIMES_AGENT_VERSION:
        if mtime_ns is None:
            return struct.pack(">qI", 0, wire.PUT_TS_NO_MTIME)
        return struct.pack(">qI", *divmod(mtime_ns, tarsafe.NS))       # floor: before 1970 too
    if agent_version >= wire.TIMES_AGENT_VERSION:
        if mtime_ns is None:
            return struct.pack(">Q", wire.PUT_NO_MTIME)
        if not -(2**63) < mtime_ns < 2**63:                 # -2**63 itself is PUT_NO_MTIME
            raise tarsafe.Refused(
                f"entry {rel or '.'!r}: its mtime, {mtime_ns / tarsafe.NS:.0f} s since 1970, is outside "
                f"1677-09-21 to 2262-04-11, the times this microVM's guest agent (version {agent_version}) "
                f"can set (version {wire.WIDE_TIMES_AGENT_VERSION} sets any): recreate the sandbox on this "
                "daemon's guest image, or give the entry a time in that range")
        return wire.s64(mtime_ns)
    return struct.pack(">Q", 2**64 - 1 if mtime_ns is None else max(0, mtime_ns // tarsafe.NS))


def _mem_available(meminfo: bytes) -> int | None:
    """MemAvailable of a /proc/meminfo, in bytes (None: not there)."""
    for line in meminfo.decode(errors="replace").splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            parts = value.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return None


def _reports(data: bytes, put: bool) -> dict:
    """A copy child's stderr: "skip" type reason path, "done" (a get's:
    entries bytes), "err" errno what; NUL-separated fields."""
    fields = [f.decode(errors="surrogateescape") for f in data.split(b"\0")]
    out: dict = {"skip": []}
    i = 0
    while i < len(fields):
        tag = fields[i]
        if tag == "skip" and i + 3 < len(fields):
            out["skip"].append({"type": fields[i + 1], "reason": fields[i + 2], "path": fields[i + 3]})
            i += 4
        elif tag == "done":
            out["done"] = () if put else tuple(fields[i + 1:i + 3])
            i += 1 if put else 3
        elif tag == "err" and i + 2 < len(fields):
            out["err"] = (fields[i + 1], fields[i + 2])
            i += 3
        else:
            i += 1
    return out


def _as_a_containers(err: AgentError, where: str) -> OSError:
    """A guest agent's file error in the words a container's gets
    (dsecd/fs/files.py), so that a client reads the same advice whatever
    the backend; the agent's step goes to the error's detail."""
    if err.errno == errno.EISDIR:
        return OSError(err.errno, f"{where} is a directory, not a regular file (`dsec ls` lists it, "
                       "`dsec cp -r` copies it)")
    if err.errno == errno.EEXIST and err.step == "rename":
        return OSError(err.errno, f"{where.rpartition(' -> ')[2]} exists; rename with overwrite to replace it")
    if err.errno == errno.ENOTEMPTY:
        return OSError(err.errno, f"{where} is a directory that is not empty; remove it recursively "
                       "(`dsec rm -r`, SDK remove(path, recursive=True))")
    return OSError(err.errno, f"{err.step} `{where}`: {os.strerror(err.errno)}")


def check_groups_sent(sb: Sandbox, link, ids: users.ProcessIds) -> None:
    """Conflict if the exec has supplementary groups and the VM's guest agent
    predates them: it would run the command without them."""
    if ids.groups and not link.sets_groups:
        raise Conflict(f"sandbox {sb.id}: its VM's guest agent is older than this dsecd and cannot give the "
                       f"command its user's supplementary groups {list(ids.groups)}; recreate the sandbox, "
                       "or name a group (user:group) to run it with that group only",
                       {"sandbox": sb.id, "groups": list(ids.groups)})


def networked(sb: Sandbox) -> bool:
    """Whether the sandbox has a network of its own (--net default)."""
    return bool(sb.net) and sb.net.get("mode") == "default"


# The verb a file op's errors start with, as FileService's for a container.
FILE_VERBS = {"file_read": "read", "file_write": "write", "file_list": "list", "file_mkdir": "mkdir",
              "file_set_attrs": "set attributes of",
              "file_remove": "remove"}


def _check(path: str, what: str = "") -> str:
    """`path` checked as a container's file ops check it; `what` (e.g.
    "read <sandbox>:<path>") goes first in the error, as theirs has it."""
    try:
        return sbfiles.check_path(path)
    except sbfiles.PathError as err:
        raise BadRequest(f"{what}: {err}" if what else str(err), {"path": path}) from err


def _refuse_root(verb: str, where: str, *paths: str) -> None:
    """BadRequest, as a container's file ops give it, if one of `paths` is /."""
    try:
        sbfiles.refuse_root(verb, *paths)
    except sbfiles.PathError as err:
        raise BadRequest(f"{verb} {where}: {err}", {"path": where.partition(":")[2]}) from err


def _run_over(sb: Sandbox, link, run) -> None:
    """An agent run (an exec or a directory copy) is over: the channel lets
    go of it, and the sandbox counts one exec fewer and was active now."""
    if run is not None:
        link.forget(run)
    sb.execs -= 1
    sb.last_active = time.monotonic()
