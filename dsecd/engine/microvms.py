"""What the engine does for microVM sandboxes (backend "microvm"), where the
container path does not fit: the VM's start and its wait for the guest
agent, execs over the agent's channel, pause and resume through QEMU's
monitor. The mechanism is dsecd/backends/microvm/. A VM's files (file
requests, directory copies, file watches, the writable layer) are
engine/vmfiles.py's, over the channel `agent` gives.

The services that own an op (creates, execs, lifecycle, memory) keep its
checks and hand a VM sandbox to the method here of the same name, so both
backends answer one protocol with the same semantics and error codes: a
command that does not exist is `not_found`, a bad cwd `not_found`, a
timeout kills the process group and says `timed_out`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import sys
import time
from pathlib import Path

from .. import fds, userns
from ..backends.microvm import wire
from ..backends.microvm.agent import AgentError, AgentExec, AgentGone
from ..backends.microvm.backend import (
    MAX_LAYERS,
    MIN_GUEST_MEMORY,
    SAVED_STATE,
    Machine,
    MicroVMBackend,
    VmError,
    VmHandle,
)
from ..errors import (
    BadRequest,
    Busy,
    Conflict,
    DsecError,
    Unsupported,
    exec_error,
)
from ..execio import DEFAULT_WINDOW, RunTimer, ended
from ..fs import users
from ..fs.layers import distinct_layers
from ..mem import pause as mempause
from .network import hosts_text
from .sandboxes import Sandbox
from .vmtemplates import TemplateService, is_boot_failure
from .workers import Workers

log = logging.getLogger(__name__)

KILL_GRACE_S = 10.0     # a killed exec's EXITED should come at once; past this the result is sent anyway
# How long a pause waits for the VM's agent requests under way (a file
# chunk of limits.max_file_chunk_bytes takes about a second under TCG).
REQUESTS_SETTLE_S = 30.0


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
    """Creates, execs, pause and resume of microVM sandboxes; the agent's
    channel every op goes through (`agent`), and what a pause waits for or
    ends (`request_running`, `watch_started`). `backend` is None where the
    host cannot run them (`why` says why)."""

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
        # sandbox id -> the guest children of its running file watches (watch_started):
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
            # A directory copy runs as an exec of the guest agent (VmFiles._copy): named apart.
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

    def watch_started(self, sb: Sandbox, run: AgentExec) -> None:
        """A watch's guest child runs (VmFiles.start_watch): a pause ends it until watch_over."""
        self._watches.setdefault(sb.id, set()).add(run)

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

    # ------------------------------------------------------------ exec

    def agent(self, sb: Sandbox):
        """The agent's channel, for an op: every op (here, the files' in
        vmfiles.py and the background processes' in vmprocs.py) goes through
        here, so here the VM's balloon learns it is in use (it deflates in
        the background)."""
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
            run_over(sb, link, run)
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


def run_over(sb: Sandbox, link, run) -> None:
    """An agent run (an exec or a directory copy) is over: the channel lets
    go of it, and the sandbox counts one exec fewer and was active now."""
    if run is not None:
        link.forget(run)
    sb.execs -= 1
    sb.last_active = time.monotonic()
